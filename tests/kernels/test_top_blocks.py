"""The sm90 block-ranking kernel (kernels/sm90/top_blocks.py) builds for sm_90a on the CPU;
its lists are checked against the stable sort on the GPU in tests/nsa/test_nsa_selection.py."""
import pytest


@pytest.mark.parametrize("width,limited", [(19, True), (19, False), (32, True), (1, False)])
def test_ranking_kernel_builds_for_sm90(width, limited):
    # CUTE_DSL_ARCH=sm_90a: tests/conftest.py
    from kernels.sm90.top_blocks import TopBlocksSpec, compile_on_fake_tensors

    assert compile_on_fake_tensors(TopBlocksSpec(width, limited))


def test_ranking_kernel_spec_rejects_more_ranks_than_lanes():
    from kernels.sm90.top_blocks import TopBlocksSpec

    with pytest.raises(ValueError, match="width 33"):
        TopBlocksSpec(33, False)
    with pytest.raises(ValueError, match="width 0"):
        TopBlocksSpec(0, True)
