"""The bias gradient's layout pass (kernels/sm90/dbias_transpose.py, used by kernels/masked.py
`sm90_backward`): dbias[s, q, k] = acc[s, k, q] in the bias's dtype.

CPU: the sm_90a builds, what the launcher refuses, the torch fallback of `_bias_layout`. GPU
(sm_90): the kernel against torch's transposed copy over every dtype, odd rows (a padding row in
acc), lengths that are no multiple of the 64 x 64 blocks, several slabs.
"""
from __future__ import annotations

import cutlass  # noqa: F401  (a dependency: a broken CuTe DSL install fails here, not skips)
import pytest
import torch

from gpu_marks import requires_sm90
from kernels import masked

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _acc(slabs, seqlen_q, seqlen_k, device, gen):
    padded = seqlen_q + seqlen_q % 2
    acc = torch.randn(slabs, seqlen_k, padded, generator=gen, device=device)
    acc[..., seqlen_q:] = float("nan")  # the padding row is never read into the gradient
    return acc


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_kernel_builds_for_sm90(dtype):
    # CUTE_DSL_ARCH=sm_90a: tests/conftest.py
    from kernels.sm90.dbias_transpose import DbiasTransposeSpec, compile_on_fake_tensors

    assert compile_on_fake_tensors(DbiasTransposeSpec(dtype))


def test_the_launcher_refuses_what_the_kernel_cannot_write():
    from kernels.sm90.dbias_transpose import DbiasTransposeSpec, can_run

    with pytest.raises(ValueError, match="dtype 'float64'"):
        DbiasTransposeSpec("float64")
    acc = torch.zeros(2, 100, 64)
    assert can_run(acc, torch.bfloat16) and can_run(acc, torch.float32)
    assert not can_run(acc, torch.float64)
    assert not can_run(acc[:, :99], torch.bfloat16)      # odd keys: no key pairs
    assert not can_run(acc[..., :63], torch.bfloat16)    # odd padded rows
    assert not can_run(acc.double(), torch.bfloat16)
    assert not can_run(acc.transpose(1, 2), torch.bfloat16)


def test_torch_fallback_is_the_transpose():
    gen = torch.Generator().manual_seed(0)
    acc = _acc(3, 77, 90, "cpu", gen)
    got = masked._bias_layout(acc, 77, torch.bfloat16)
    assert got.shape == (3, 77, 90) and got.is_contiguous()
    assert torch.equal(got, acc[..., :77].transpose(1, 2).to(torch.bfloat16))


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1024, 2048), (3, 333, 1000), (2, 65, 130), (1, 1, 2)],
                         ids=lambda s: "x".join(map(str, s)))
def test_kernel_equals_the_transpose(dtype, shape):
    from kernels.sm90.dbias_transpose import can_run

    slabs, seqlen_q, seqlen_k = shape
    gen = torch.Generator(device="cuda").manual_seed(seqlen_q)
    acc = _acc(slabs, seqlen_q, seqlen_k, "cuda", gen)
    assert can_run(acc, dtype)  # the kernel, not the fallback
    got = masked._bias_layout(acc, seqlen_q, dtype)
    torch.cuda.synchronize()
    assert got.shape == shape and got.dtype == dtype
    assert torch.equal(got, acc[..., :seqlen_q].transpose(1, 2).to(dtype))
