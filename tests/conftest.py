"""Shared test configuration: GPU tests carry the `gpu` marker and skip without CUDA."""
import os

# CuTe DSL kernels compile for Hopper on any machine (no GPU needed); see test_sm90_compile.py.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _no_captured_plans_from_other_tests():
    """Each test starts without nsa()'s captured plans (nsa/captured.py): a signature that
    another test warmed up would replay here, where a test may watch the launches or host work
    of an eager call. (Cheap where there are none, as on the CPU.)"""
    from nsa.captured import release_captured_plans

    release_captured_plans()
    yield
