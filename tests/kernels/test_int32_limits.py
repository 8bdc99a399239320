"""The sm90 kernels' 32-bit limits, checked before any launch (on CPU: shapes only).

Sequence bounds are int32, so ``max_seqlen_*`` above 2**31 - 1 is refused by every entry point
with a ValueError naming it. Shapes that a kernel's Int32 index arithmetic or its launch grid
cannot hold (`kernels.sm90.limits.int32_limits_reason`, which reads shapes only, so meta tensors
describe them without memory) are sent to the fallback, which has no such limits, with the
reason in `which_backend`.
"""
from __future__ import annotations

import types

import pytest
import torch

from kernels import flash_attn_func, flash_attn_varlen_func, which_backend
from kernels.sm90.limits import int32_limits_reason
from kernels.validate import INT32_MAX
from test_fallback_dispatch import fake_sm90  # noqa: F401 (fixture)
from gpu_marks import requires_sm90

META = torch.device("meta")


def meta(*shape):
    return torch.empty(*shape, device=META)


def sequences(num_seqs):
    """cu_seqlens of num_seqs sequences; only its length is read."""
    return meta(num_seqs + 1).to(torch.int32)


def limits(q, k, *, num_seqs=1, max_seqlen_q=None, max_seqlen_k=None, **kwargs):
    max_seqlen_q = q.shape[0] if max_seqlen_q is None else max_seqlen_q
    max_seqlen_k = k.shape[0] if max_seqlen_k is None else max_seqlen_k
    return int32_limits_reason(q, k, cu_seqlens_q=sequences(num_seqs), max_seqlen_q=max_seqlen_q,
                               max_seqlen_k=max_seqlen_k, **kwargs)


def lists(rows, heads, width, kv_block):
    """Forward block-sparse lists as the limits read them: shapes and the KV block."""
    return types.SimpleNamespace(full_count=meta(rows, heads), full_index=meta(rows, heads, width),
                                 mask_index=meta(rows, heads, 1), col_block_size=kv_block)


def test_a_million_tokens_fit():
    # 1M tokens at H=32, D=128: q has 2**32 elements, beyond int32, but every index the kernels
    # compute in Int32 (rows, tiles, slots) stays far below it (strides are 64-bit).
    q, k = meta(2**20, 32, 128), meta(2**20, 8, 128)
    assert q.numel() > INT32_MAX
    assert limits(q, k) == "" and limits(q, k, backward=True) == ""
    sparse = lists(2**13, 8, 16, 64)
    assert limits(q, k, backward=True, block_sparse=sparse) == ""


def test_forward_tile_count_beyond_int32():
    # ceil(2**20 / 128) * 64 heads * 4097 sequences > 2**31 - 1 tiles.
    q, k = meta(2**21, 64, 64), meta(2**21, 8, 64)
    reason = limits(q, k, num_seqs=4097, max_seqlen_q=2**20, max_seqlen_k=2**20)
    assert "forward work tiles" in reason
    assert limits(q, k, num_seqs=4095, max_seqlen_q=2**20, max_seqlen_k=2**20) == ""


def test_backward_grid_holds_at_most_65535_sequences():
    q, k = meta(70_000 * 16, 4, 64), meta(70_000 * 16, 2, 64)
    kwargs = dict(num_seqs=70_000, max_seqlen_q=16, max_seqlen_k=16)
    assert limits(q, k, **kwargs) == ""  # the forward's grid is one-dimensional
    assert "65535" in limits(q, k, backward=True, **kwargs)
    # Block-sparse lists split into work units: a one-dimensional grid again, unless the
    # backward is deterministic.
    sparse = lists(70_000, 2, 1, 64)
    assert limits(q, k, backward=True, block_sparse=sparse, **kwargs) == ""
    assert "65535" in limits(q, k, backward=True, block_sparse=sparse, deterministic=True,
                             **kwargs)
    # Lists per query head are split only at 128 keys, wide enough for the fused dQ, with no
    # window or compressed keys (kernels/sm90/spec.py `splits_lists`, `fuses_listed_dq`;
    # head dim 64 here: at least 16 wide).
    for kv_block, width, extra, split in ((64, 40, {}, False), (128, 8, {}, False),
                                          (128, 40, {}, True),
                                          (128, 40, dict(window_size=(8, 0)), False),
                                          (128, 40, dict(window_size=(-1, 0), causal=True), True),
                                          (128, 40, dict(deterministic=True), False)):
        per_head = lists(70_000, 4, width, kv_block)
        reason = limits(q, k, backward=True, block_sparse=per_head, **extra, **kwargs)
        assert (reason == "") == split, (kv_block, width, extra, reason)
    # Padded (B, N, H, D) inputs, head dim 128 (at least 32 wide): the same grid rule.
    q4, k4 = meta(70_000, 16, 4, 128), meta(70_000, 16, 2, 128)
    for width, split in ((31, False), (32, True)):
        reason = limits(q4, k4, backward=True, block_sparse=lists(70_000, 4, width - 1, 128),
                        **kwargs)
        assert (reason == "") == split, (width, reason)


def test_backward_slots_beyond_int32():
    q, k = meta(2**31 - 64, 1, 64), meta(2**31 - 64, 1, 64)
    assert limits(q, k, num_seqs=1, max_seqlen_q=2**29, max_seqlen_k=2**29) == ""
    assert "query-tile slots" in limits(q, k, num_seqs=2, max_seqlen_q=2**29,
                                        max_seqlen_k=2**29, backward=True)


def test_sequences_reaching_the_kernels_unbounded_sentinel():
    q, k = meta(2**30, 1, 64), meta(2**30, 1, 64)
    assert "max_seqlen_q" in limits(q, k)
    assert "max_seqlen_k" in limits(q[:8], k)


def test_compressed_and_windowed_positions_beyond_int32():
    q, k = meta(4096, 4, 64), meta(4096, 4, 64)
    assert "positions" in limits(q, k, compress_factor=2**20)
    assert limits(q, k, compress_factor=2**10) == ""
    assert "positions" in limits(q, k, window_size=(2**31 - 100, 0))


def test_padded_rows_beyond_int32():
    q = meta(2**16, 2**15 + 1, 1, 64)
    assert "rows of q" in int32_limits_reason(q, q, max_seqlen_q=q.shape[1],
                                              max_seqlen_k=q.shape[1])


def test_dispatch_sends_what_the_kernels_cannot_hold_to_the_fallback(fake_sm90):  # noqa: F811
    # 70,000 one-token sequences: the backward kernel's grid (KV tiles, Hkv, S) cannot launch.
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(70_000, 2, 8, generator=generator)
    k = v = torch.randn(70_000, 1, 8, generator=generator)
    cu = torch.arange(70_001, dtype=torch.int32)
    kwargs = dict(cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert which_backend(q, k, v, **kwargs) == "sm90"
    backend = which_backend(q, k, v, backward=True, **kwargs)
    assert backend.startswith("fallback (kernels.sm90.backward: the backward's grid"), backend
    assert fake_sm90["backward"].can_run_calls == []  # declined before the kernel is asked


def test_entry_points_refuse_max_seqlen_beyond_int32():
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(10, 2, 8, generator=generator) for _ in range(3))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^max_seqlen_q must be <= 2\*\*31 - 1"):
        flash_attn_varlen_func(q, k, v, cu, cu, 2**40, 6)
    with pytest.raises(ValueError, match=r"^max_seqlen_k must be <= 2\*\*31 - 1"):
        flash_attn_varlen_func(q, k, v, cu, cu, 6, 2**31)
    assert flash_attn_varlen_func(q, k, v, cu, cu, INT32_MAX, INT32_MAX).shape == q.shape


@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
def test_flash_attn_refuses_meta_tensors(varlen):
    if varlen:
        q, k = meta(10, 2, 8), meta(10, 1, 8)
        cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=META)
        call = lambda: flash_attn_varlen_func(q, k, k, cu, cu, 6, 6)  # noqa: E731
    else:
        q, k = meta(1, 10, 2, 8), meta(1, 10, 1, 8)
        call = lambda: flash_attn_func(q, k, k, causal=True)  # noqa: E731
    with pytest.raises(ValueError, match=r"^q is on the meta device"):
        call()


def test_direct_kernel_calls_refuse_what_their_int32_arithmetic_cannot_hold():
    """kernels.sm90.forward.run / backward.run called directly (tools, tuners) check the same
    limits as the dispatcher, before allocating or compiling anything (meta tensors: no data)."""
    from kernels.sm90 import backward, forward

    q, k = meta(1000, 2, 128).to(torch.bfloat16), meta(1000, 1, 128).to(torch.bfloat16)
    cu = torch.tensor([0, 1000], dtype=torch.int32, device=META)
    too_long = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=2**30, max_seqlen_k=1000)
    with pytest.raises(ValueError,
                       match=r"^kernels.sm90.forward.run: max_seqlen_q = 1073741824 reaches 2\*\*30"):
        forward.run(q, k, k, **too_long)
    with pytest.raises(ValueError, match=r"^kernels.sm90.backward.run: max_seqlen_q"):
        backward.run(q, q, k, k, q, meta(2, 1000), **too_long)
    many = torch.arange(70_001, dtype=torch.int32, device=META)
    q, k = meta(70_000, 1, 128).to(torch.bfloat16), meta(70_000, 1, 128).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"^kernels.sm90.backward.run: .*65535"):
        backward.run(q, q, k, k, q, meta(1, 70_000), cu_seqlens_q=many, cu_seqlens_k=many,
                     max_seqlen_q=1, max_seqlen_k=1)


@pytest.mark.gpu
@requires_sm90
def test_kernels_at_a_million_tokens_match_float32_on_the_last_rows():
    """The kernels past 2**31 elements (q at 1M tokens, H=32, D=128 has 2**32): forward and
    backward over two packed causal sequences of 1M tokens in all, checked on the last 128 rows
    of each sequence (the rows whose offsets are largest) against float32 torch on that slice:
    out, lse, dq, and dk, dv of every key of the sequence. dO is random on those rows and 0
    elsewhere, so the slice alone determines dk and dv exactly."""
    import math

    import kernels

    lengths, heads, kv_heads, dim, last = (600_001, 448_575), 32, 8, 128, 128
    total = sum(lengths)
    assert total == 2 ** 20 and total * heads * dim == 2 ** 32
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=generator)

    q, k, v = randn(total, heads, dim), randn(total, kv_heads, dim), randn(total, kv_heads, dim)
    bounds = [0, lengths[0], total]
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    options = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
                   max_seqlen_k=max(lengths), causal=True)
    assert kernels.which_backend(q, k, v, **options).startswith("sm90")
    assert kernels.which_backend(q, k, v, backward=True, **options).startswith("sm90")
    out, lse = kernels.attention_forward(q, k, v, **options)
    dout = torch.zeros_like(q)
    for end in bounds[1:]:
        dout[end - last:end] = randn(last, heads, dim)
    dq, dk, dv = kernels.attention_backward(dout, q, k, v, out, lse, **options)
    torch.cuda.synchronize()

    scale, group = 1.0 / math.sqrt(dim), heads // kv_heads
    for start, end in zip(bounds[:-1], bounds[1:]):
        rows, keys = slice(end - last, end), slice(start, end)
        n = end - start
        # Row n - last + r of the sequence sees its keys 0 .. n - last + r.
        visible = (torch.arange(n, device=device)[None, :]
                   <= (n - last + torch.arange(last, device=device))[:, None])
        dk_ref = torch.zeros(n, kv_heads, dim, device=device)
        dv_ref = torch.zeros(n, kv_heads, dim, device=device)
        for h in range(heads):
            g = h // group
            qh, kh, vh = q[rows, h].float(), k[keys, g].float(), v[keys, g].float()
            doh = dout[rows, h].float()
            s = (qh @ kh.T * scale).masked_fill_(~visible, -math.inf)
            lse_ref = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - lse_ref[:, None])
            out_ref = p @ vh
            ds = p * (doh @ vh.T - (doh * out_ref).sum(-1, keepdim=True))
            torch.testing.assert_close(out[rows, h].float(), out_ref, atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(lse[h, rows], lse_ref, atol=1e-3, rtol=1e-4)
            dq_ref = ds @ kh * scale
            assert (dq[rows, h].float() - dq_ref).norm() <= 2e-2 * dq_ref.norm(), (start, h)
            dk_ref[:, g] += ds.T @ qh * scale
            dv_ref[:, g] += p.T @ doh
            del s, p, ds
        for grad, ref in ((dk[keys], dk_ref), (dv[keys], dv_ref)):
            assert torch.isfinite(grad).all()
            assert (grad.float() - ref).norm() <= 2e-2 * ref.norm(), start
    assert (dq[:bounds[1] - last] == 0).all()  # rows whose dO is 0
