"""kernels/dkv_sums.py: dK/dV sums written first without zeroing, finished with the compressed
keys' row gradients (kernels/sm90/dkv_finish.py on sm90).

CPU: the torch path against an explicit sum, `write_into`, the kernel's sm_90a builds and its
spec's refusals. GPU (sm_90): the kernel equals the torch path bit for bit.
"""
import cutlass  # noqa: F401  (a dependency: a broken CuTe DSL install fails here, not skips)
import pytest
import torch

from gpu_marks import requires_sm90
from kernels.dkv_sums import UnwrittenDkvSums, finish_dkv, write_into


def _problem(rows, tokens, heads, dim, device="cpu", seed=0):
    """Float32 sums (rows, heads, dim) for dK and dV, row gradients (tokens + 1, ...) whose
    last row is zeros, and row tokens: blocks of 16 rows per token, the rest of the rows
    (an incomplete tail) on the zero row."""
    gen = torch.Generator().manual_seed(seed)
    sums = tuple(torch.randn(rows, heads, dim, generator=gen).to(device) for _ in range(2))
    row_gradients = tuple(torch.cat([torch.randn(tokens, heads, dim, generator=gen),
                                     torch.zeros(1, heads, dim)]).to(device) for _ in range(2))
    row_tokens = torch.full((rows,), tokens, dtype=torch.int64)
    row_tokens[:16 * tokens] = torch.arange(tokens).repeat_interleave(16)
    return sums, row_gradients, row_tokens.to(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_finish_adds_each_rows_token_then_rounds_once(dtype):
    sums, row_gradients, row_tokens = _problem(100, 5, 3, 32)
    dk, dv = finish_dkv(sums, row_gradients, row_tokens, dtype)
    for got, s, g in ((dk, sums[0], row_gradients[0]), (dv, sums[1], row_gradients[1])):
        expected = s.clone()
        expected[:80] += g[:5].repeat_interleave(16, dim=0)  # rows 80..99: no token
        assert got.dtype == dtype and torch.equal(got, expected.to(dtype))
        assert got.data_ptr() != s.data_ptr()


def test_write_into_copies_into_unwritten_sums_and_adds_into_others():
    dk, dv = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    unwritten = UnwrittenDkvSums(torch.full_like(t, float("nan")) for t in (dk, dv))
    got = write_into(unwritten, dk, dv)
    assert got[0] is unwritten[0] and torch.equal(got[0], dk) and torch.equal(got[1], dv)
    start = [torch.ones_like(dk), torch.ones_like(dv)]
    got = write_into(tuple(start), dk, dv)
    assert got[0] is start[0] and torch.equal(got[0], 1 + dk) and torch.equal(got[1], 1 + dv)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernel_builds_for_sm90(dtype, head_dim):
    from kernels.sm90.dkv_finish import DkvFinishSpec, compile_on_fake_tensors

    assert callable(compile_on_fake_tensors(DkvFinishSpec(dtype, head_dim)))


def test_kernel_spec_and_can_run_refuse_what_the_kernel_cannot_take():
    from kernels.sm90.dkv_finish import DkvFinishSpec, can_run

    with pytest.raises(ValueError, match="dtype"):
        DkvFinishSpec("float32", 128)
    with pytest.raises(ValueError, match="head_dim"):
        DkvFinishSpec("bfloat16", 100)
    sums, row_gradients, row_tokens = _problem(64, 2, 2, 64)
    assert can_run(sums, row_gradients, row_tokens, torch.bfloat16)[0]
    assert not can_run(sums, row_gradients, row_tokens, torch.float32)[0]
    assert not can_run(sums, row_gradients, row_tokens.int(), torch.bfloat16)[0]
    doubled = tuple(s.double() for s in sums)
    assert not can_run(doubled, row_gradients, row_tokens, torch.bfloat16)[0]


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(1000, 7, 8, 128), (777, 40, 2, 64), (8192, 128, 8, 128)],
                         ids=lambda s: f"T{s[0]}-Tc{s[1]}-H{s[2]}-D{s[3]}")
def test_kernel_equals_the_torch_path_bit_for_bit(shape, dtype):
    """Rows not a multiple of the CTA's rows, tail rows on the zero token, both head dims."""
    from kernels.sm90 import dkv_finish

    rows, tokens, heads, dim = shape
    sums, row_gradients, row_tokens = _problem(rows, tokens, heads, dim, device="cuda",
                                               seed=rows)
    assert dkv_finish.can_run(sums, row_gradients, row_tokens, dtype)[0]
    got = finish_dkv(sums, row_gradients, row_tokens, dtype)
    expected = tuple((s + g.index_select(0, row_tokens)).to(dtype)
                     for s, g in zip(sums, row_gradients))
    torch.cuda.synchronize()
    for g, e in zip(got, expected):
        assert g.shape == e.shape and torch.equal(g, e)
    assert row_gradients[0][:tokens].abs().sum() > 0  # not vacuous: the tokens add something
