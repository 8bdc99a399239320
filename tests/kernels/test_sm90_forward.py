"""The sm90 CuTe DSL forward against the torch fallback (fp32) on the GPU.

The fallback is itself checked against a dense float64 oracle on the CPU
(test_fallback*.py); here the kernel must match it to bf16/fp16 accuracy, lse included,
on random data, with empty rows giving out = 0 and lse = -inf.
"""
import pytest
import torch

from kernels.fallback import attention_forward_fallback
from gpu_marks import requires_sm90

pytestmark = pytest.mark.gpu


def _cu_seqlens(lengths, device):
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return cu.to(device)


def _random_block_sparse(lengths_q, lengths_k, heads, tile_m, tile_n, density, generator):
    """Random compact lists (incl. empty rows); full/mask classification also random."""
    from sparsity import BlockSparseTensors

    rows = [(lq + tile_m - 1) // tile_m for lq in lengths_q]
    total_rows = sum(rows)
    lists = []
    for s, num_rows in enumerate(rows):
        n_blocks = (lengths_k[s] + tile_n - 1) // tile_n
        for _ in range(num_rows):
            per_head = []
            for _ in range(heads):
                chosen = (torch.rand(n_blocks, generator=generator) < density).nonzero().flatten()
                is_full = torch.rand(len(chosen), generator=generator) < 0.5
                per_head.append((chosen[is_full].tolist(), chosen[~is_full].tolist()))
            lists.append(per_head)
    kf = max([len(f) for row in lists for f, _ in row] + [1])
    km = max([len(m) for row in lists for _, m in row] + [1])
    full_index = torch.full((total_rows, heads, kf), -1, dtype=torch.int32)
    mask_index = torch.full((total_rows, heads, km), -1, dtype=torch.int32)
    full_count = torch.zeros((total_rows, heads), dtype=torch.int32)
    mask_count = torch.zeros((total_rows, heads), dtype=torch.int32)
    for r, row in enumerate(lists):
        for h, (full, mask) in enumerate(row):
            full_count[r, h], mask_count[r, h] = len(full), len(mask)
            full_index[r, h, :len(full)] = torch.tensor(full, dtype=torch.int32)
            mask_index[r, h, :len(mask)] = torch.tensor(mask, dtype=torch.int32)
    offsets = torch.zeros(len(rows) + 1, dtype=torch.int32)
    offsets[1:] = torch.tensor(rows).cumsum(0)
    return BlockSparseTensors(
        full_count=full_count.cuda(), full_index=full_index.cuda(),
        mask_count=mask_count.cuda(), mask_index=mask_index.cuda(),
        row_block_size=tile_m, col_block_size=tile_n, row_block_offsets=offsets.cuda())


def _check(q, k, v, spec_overrides=None, **kwargs):
    from kernels.sm90.forward import can_run, run

    ok, reason = can_run(q, k, v, **kwargs)
    assert ok, reason
    out, lse = run(q, k, v, spec_overrides=spec_overrides, **kwargs)
    ref_out, ref_lse = attention_forward_fallback(q.float(), k.float(), v.float(), **kwargs)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    err = (out.float() - ref_out).norm() / ref_out.norm().clamp_min(1e-6)
    assert err < 1e-2, f"relative error {err:.3e}"
    empty = ref_lse == -float("inf")
    assert torch.equal(lse == -float("inf"), empty)
    assert (out.float().transpose(-2, -3) if out.dim() == 4 else out.float().transpose(0, 1))[
        empty].abs().max().item() == 0 if empty.any() else True
    if (~empty).any():
        assert (lse[~empty] - ref_lse[~empty].float()).abs().max() < 1e-2
    return err


DENSE_CASES = [
    # (lengths, H, Hkv, D, causal, cf, window). Dense sequences of at most 4096 keys take the
    # persistent short-sequence schedule at head dims up to 192; longer ones, and head dim 256,
    # one CTA per tile (`choose_spec`).
    ([5000, 77], 8, 2, 128, True, 1, (-1, -1)),
    ([4200], 4, 4, 64, False, 1, (-1, -1)),  # head dim 64 over long ranges: 192-row tiles
    ([5000, 300], 8, 2, 64, True, 1, (-1, -1)),
    ([4500, 300], 4, 2, 64, False, 1, (100, 50)),  # 192-row tiles with both window edges
    ([5000, 77], 8, 2, 64, True, 1, (2500, 0)),  # a long window: 192-row tiles too
    ([1000], 4, 4, 128, True, 1, (-1, -1)),
    ([1000], 4, 4, 64, True, 1, (-1, -1)),
    ([777], 8, 2, 128, False, 1, (-1, -1)),
    ([513, 1, 130, 1025], 8, 1, 128, True, 1, (-1, -1)),
    ([2048], 16, 1, 128, True, 1, (511, 0)),
    ([1500, 300], 8, 8, 64, True, 1, (100, 0)),
    ([900], 4, 4, 128, False, 1, (100, 50)),
    ([2000, 37], 16, 16, 128, True, 16, (-1, -1)),
    ([4096, 1000], 8, 2, 128, True, 64, (-1, -1)),
    ([4096], 4, 1, 64, True, 64, (-1, -1)),
    ([3000, 500], 4, 2, 128, True, 16, (700, 0)),
    ([1500], 4, 4, 64, False, 16, (300, 100)),
    # Head dims 192 and 256: 64-key tiles, one Q buffer, the output staged in it when one CTA
    # takes one tile (256: dense and windows), one K/V stage for 256's persistent schedules.
    ([1000], 4, 4, 192, True, 1, (-1, -1)),
    ([777, 1500], 8, 2, 192, False, 1, (-1, -1)),
    ([4500], 4, 2, 192, True, 1, (-1, -1)),
    ([777, 300], 8, 2, 256, False, 1, (-1, -1)),
    ([1000, 130], 4, 2, 256, True, 1, (-1, -1)),
    ([2048, 99], 8, 2, 192, True, 1, (511, 0)),
    ([2048, 99], 8, 2, 256, True, 1, (511, 0)),
    ([4096, 1000], 8, 2, 256, True, 64, (-1, -1)),
    ([3000, 500], 4, 2, 192, True, 16, (700, 0)),
    ([1500], 4, 4, 256, False, 16, (300, 100)),
]


@requires_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", DENSE_CASES, ids=lambda c: f"L{c[0]}-H{c[1]}/{c[2]}-D{c[3]}-"
                         f"causal{int(c[4])}-cf{c[5]}-w{c[6][0]}_{c[6][1]}")
def test_dense_varlen_matches_fallback(case, dtype):
    lengths, heads, heads_kv, dim, causal, cf, window = case
    torch.manual_seed(0)
    lengths_k = [n // cf for n in lengths]
    q = torch.randn(sum(lengths), heads, dim, device="cuda", dtype=dtype)
    k = torch.randn(sum(lengths_k), heads_kv, dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    _check(q, k, v, cu_seqlens_q=_cu_seqlens(lengths, "cuda"),
           cu_seqlens_k=_cu_seqlens(lengths_k, "cuda"), max_seqlen_q=max(lengths),
           max_seqlen_k=max(lengths_k), softmax_scale=dim ** -0.5, causal=causal,
           compress_factor=cf, window_size=window)


@requires_sm90
@pytest.mark.parametrize("group", [1, 4, 8, 16])
def test_padded_gqa_matches_fallback(group):
    torch.manual_seed(1)
    q = torch.randn(2, 1031, 16, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 1031, 16 // group, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    _check(q, k, v, max_seqlen_q=1031, max_seqlen_k=1031, softmax_scale=0.1, causal=True)


@requires_sm90
def test_dlpack_launch_matches_tvm_ffi(monkeypatch):
    """The launch without apache-tvm-ffi (NSA_CUTE_TVM_FFI=0): same kernel, same output."""
    import kernels.sm90.forward as forward
    import kernels.sm90.launch as launch

    torch.manual_seed(6)
    q = torch.randn(1500, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1500, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu = _cu_seqlens([1000, 500], "cuda")
    kwargs = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1000, max_seqlen_k=1000,
                  softmax_scale=0.1, causal=True)
    out_ffi, lse_ffi = forward.run(q, k, v, **kwargs)
    monkeypatch.setattr(launch, "tvm_ffi_available", lambda: False)
    out, lse = forward.run(q, k, v, **kwargs)
    assert torch.equal(out, out_ffi) and torch.equal(lse, lse_ffi)


@requires_sm90
@pytest.mark.parametrize("tile_n", [64, 128])
@pytest.mark.parametrize("sparse_heads", ["per_head", "per_kv_head"])
@pytest.mark.parametrize("dim", [64, 128, 192, 256])
def test_block_sparse_matches_fallback(tile_n, sparse_heads, dim):
    gen = torch.Generator().manual_seed(2)
    # A long sequence before short ones: the grid covers the longest sequence's tiles, so most
    # CTAs of the short ones lie past their end and must not read the lists at all.
    lengths = [4000, 1500, 129, 700, 130]
    heads, heads_kv = 8, 2
    hs = heads if sparse_heads == "per_head" else heads_kv
    bs = _random_block_sparse(lengths, lengths, hs, 128, tile_n, 0.3, gen)
    q = torch.randn(sum(lengths), heads, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lengths), heads_kv, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu = _cu_seqlens(lengths, "cuda")
    if dim > 128 and tile_n == 128:
        # 128-key tiles of a wide head do not fit shared memory: the kernel declines them
        # (the dispatcher then takes the fallback) and says why.
        from kernels.sm90.forward import can_run

        ok, reason = can_run(q, k, v, causal=True, block_sparse=bs)
        assert not ok and "shared memory" in reason, reason
        return
    _check(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
           max_seqlen_k=max(lengths), softmax_scale=dim ** -0.5, causal=True, block_sparse=bs)


@requires_sm90
def test_many_short_sequences():
    torch.manual_seed(3)
    lengths = [int(x) for x in torch.randint(1, 300, (16,))]
    q = torch.randn(sum(lengths), 8, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(sum(lengths), 4, 128, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    cu = _cu_seqlens(lengths, "cuda")
    _check(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
           max_seqlen_k=max(lengths), softmax_scale=0.09, causal=True)


# One CTA per query tile, every output-path switch off: the baseline each schedule below adds
# to. Entries spell out the schedule they test, since the dispatcher's own pick for a case
# (persistent for short ranges and packed short sequences) would otherwise leak in.
GRID = dict(persistent=False, heads_fastest=False, q_stages=1, pingpong=False, store_warp=False,
            defer_store=False, overlap_tiles=False, o_in_q=False)
SCHEDULES = {
    "grid+heads": GRID | dict(heads_fastest=True),
    "persistent": GRID | dict(persistent=True),
    "persistent+heads": GRID | dict(persistent=True, heads_fastest=True),
    "persistent+heads+q2": GRID | dict(persistent=True, heads_fastest=True, q_stages=2),
    "pingpong": GRID | dict(pingpong=True, tile_m=128),
    "persistent+q2+pingpong": GRID | dict(persistent=True, q_stages=2, pingpong=True, tile_m=128),
    "m64": GRID | dict(tile_m=64, tile_n=64),
    "m64+persistent+q2": GRID | dict(tile_m=64, tile_n=64, persistent=True, q_stages=2),
    # The output's path: stored by a storer warp, or under the next tile's first Q K^T.
    "grid+store_warp": GRID | dict(store_warp=True),
    "persistent+q2+store_warp": GRID | dict(persistent=True, q_stages=2, store_warp=True,
                                            tile_m=128),
    "persistent+q2+defer": GRID | dict(persistent=True, q_stages=2, defer_store=True,
                                       tile_m=128, narrow_first_tile=False),
    "persistent+q2+store_warp+defer": GRID | dict(persistent=True, q_stages=2, store_warp=True,
                                                  defer_store=True, pingpong=True, tile_m=128,
                                                  narrow_first_tile=False),
    "m64+persistent+q2+store_warp": GRID | dict(tile_m=64, tile_n=64, persistent=True,
                                                q_stages=2, store_warp=True),
    # A tile's last P V under the next tile's first softmax (not for block-sparse lists).
    "persistent+q2+overlap": GRID | dict(persistent=True, q_stages=2, overlap_tiles=True,
                                         pingpong=True, store_warp=True, tile_m=128,
                                         narrow_first_tile=False),
    "m64+persistent+q2+overlap": GRID | dict(tile_m=64, tile_n=64, persistent=True, q_stages=2,
                                             store_warp=True, overlap_tiles=True,
                                             narrow_first_tile=False),
    "m192+persistent+q2+store_warp": GRID | dict(tile_m=192, tile_n=64, persistent=True,
                                                 q_stages=2, store_warp=True),
    # Three warpgroups taking turns round robin.
    "m192+pingpong": GRID | dict(tile_m=192, tile_n=64, pingpong=True),
    "m192+persistent+q2+pingpong+store_warp": GRID | dict(
        tile_m=192, tile_n=64, persistent=True, q_stages=2, pingpong=True, store_warp=True),
    # One tile per CTA, the output staged in the Q buffer; the freed smem as a third K/V
    # stage or 96-key tiles.
    "grid+o_in_q": GRID | dict(o_in_q=True),
    "grid+o_in_q+s3": GRID | dict(o_in_q=True, num_stages=3),
    "grid+o_in_q+n96": GRID | dict(o_in_q=True, tile_n=96, narrow_first_tile=False),
    # The first KV tile multiplied only as far as each warpgroup sees (an arithmetic switch:
    # the one-CTA kernel it is compared with has it too).
    "narrow": GRID | dict(narrow_first_tile=True),
    "persistent+q2+pingpong+store_warp+narrow": GRID | dict(
        persistent=True, q_stages=2, pingpong=True, store_warp=True, tile_m=128, tile_n=128,
        narrow_first_tile=True),
    # Windows' and packed short sequences' dispatched schedule.
    "persistent+q2+pingpong+store_warp+heads": GRID | dict(
        persistent=True, q_stages=2, pingpong=True, store_warp=True, heads_fastest=True,
        tile_m=128, tile_n=128),
    # Head dim 64 over long ranges: 192x128 tiles, three warpgroups' turns (dispatched), and
    # the same tile persistent.
    "m192n128+pingpong": GRID | dict(tile_m=192, tile_n=128, pingpong=True),
    "m192n128+pingpong+heads": GRID | dict(tile_m=192, tile_n=128, pingpong=True,
                                           heads_fastest=True),
    "m192n128+persistent+q2+pingpong+store_warp": GRID | dict(
        tile_m=192, tile_n=128, persistent=True, q_stages=2, pingpong=True, store_warp=True),
}
SCHEDULE_CASES = {
    # lengths (query; keys are lengths // cf), H, Hkv, D, causal, cf, window, block-sparse density
    # A sequence over 4096 keys: the dispatcher's own pick is one CTA per tile.
    "varlen-causal": ([5000, 129, 1, 700], 8, 2, 128, True, 1, (-1, -1), None),
    "window": ([5000, 300], 8, 2, 128, True, 1, (511, 0), None),
    "compressed": ([9000, 1000, 64], 8, 2, 128, True, 64, (-1, -1), None),
    "sparse64": ([4000, 1500, 129], 8, 2, 64, True, 1, (-1, -1), 0.3),
    "dense64": ([5000, 130, 1, 900], 8, 2, 64, True, 1, (-1, -1), None),
}


def _schedule_applies(case, schedule):
    """Whether a schedule can run a case: block-sparse lists fix the tile to their 128x64 blocks
    and are not a KV range to overlap or narrow; 192x128 tiles are for head dim 64 (at 128
    they spill), whose case runs them and the short-range schedules only."""
    fields, dim, density = SCHEDULES[schedule], SCHEDULE_CASES[case][3], SCHEDULE_CASES[case][7]
    if density is not None:
        return (fields.get("tile_m", 128) == 128 and "tile_n" not in fields
                and not fields.get("overlap_tiles") and not fields.get("narrow_first_tile"))
    if case == "dense64":
        return schedule.startswith("m192n128") or schedule in (
            "persistent+q2+pingpong+store_warp+heads", "grid+heads", "persistent+q2+store_warp")
    return not schedule.startswith("m192n128") or dim == 64


@requires_sm90
@pytest.mark.parametrize("case,schedule", [(c, s) for c in SCHEDULE_CASES for s in SCHEDULES
                                           if _schedule_applies(c, s)])
def test_tile_schedules_match_the_grid_kernel(case, schedule):
    """Persistent CTAs, GQA-grouped tile order, a second Q buffer, ping-pong and two CTAs per SM
    change only which CTA runs which tile and when: outputs must equal those of the one-CTA-per-
    tile kernel with the same tile shape bit for bit, and match the fallback."""
    from kernels.sm90.forward import run

    lengths, heads, heads_kv, dim, causal, cf, window, density = SCHEDULE_CASES[case]
    torch.manual_seed(4)
    lengths_k = [n // cf for n in lengths]
    q = torch.randn(sum(lengths), heads, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lengths_k), heads_kv, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    kwargs = dict(cu_seqlens_q=_cu_seqlens(lengths, "cuda"),
                  cu_seqlens_k=_cu_seqlens(lengths_k, "cuda"), max_seqlen_q=max(lengths),
                  max_seqlen_k=max(lengths_k), softmax_scale=dim ** -0.5, causal=causal,
                  compress_factor=cf, window_size=window)
    if density is not None:
        kwargs["block_sparse"] = _random_block_sparse(
            lengths, lengths_k, heads_kv, 128, 64, density, torch.Generator().manual_seed(5))
    schedule = SCHEDULES[schedule]
    _check(q, k, v, spec_overrides=schedule, **kwargs)
    same_tile = {key: schedule[key] for key in ("tile_m", "tile_n", "narrow_first_tile")
                 if key in schedule}
    grid_out, grid_lse = run(q, k, v, spec_overrides=GRID | same_tile, **kwargs)
    out, lse = run(q, k, v, spec_overrides=schedule, **kwargs)
    torch.cuda.synchronize()
    assert torch.equal(out, grid_out)
    assert torch.equal(lse, grid_lse)
