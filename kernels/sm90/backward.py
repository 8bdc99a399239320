"""Torch entry to the sm90 backward kernel: `can_run` decides, `run` prepares, launches and
finishes.

Both take the keyword arguments of `kernels.attention_backward`, already validated and
normalised by `kernels.validate` (`block_sparse_transposed`, a `sparsity.BlockSparseCSR`, is
built by `kernels.interface` when the caller gave none). Three launches, no host read:

1. the row statistics (kernels/sm90/bwd_preprocess.py): lse * log2(e) (+inf where a row sees
   nothing) and rowsum(dO * O) in float32, both scattered into a layout of 64-row query tiles
   per sequence (P slots per head, +inf / 0 in the padding). Padding the tiles makes every TMA
   load of a tile's row statistics 16-byte aligned and gives rows past a sequence's end P = 0
   for free (128-row steps, head dim 64, reach past the sequence's tiles: the kernel sets
   those rows' lse to +inf);
2. the KV-centric kernel (kernels/sm90/bwd_sm90.py): dK, dV, written in the input type (or
   added into float32 accumulators where several CTAs share a KV tile, converted after; with
   split lists only the tiles several work units share, kernels/sm90/dkv_tiles.py, the others
   stored by the unit that owns them);
3. the query-centric dQ kernel (kernels/sm90/bwd_dq_sm90.py), which writes dQ in the input
   type (`BwdSpec.dq_separate`); or, where the dispatcher fuses dQ (dense keys: causal, full
   or a sliding window; wide 128-key lists per query head: `choose_backward_spec`), the
   KV-centric kernel
   reduces dQ into a zeroed float32 accumulator in the tile layout and
   kernels/sm90/dq_convert.py scales it and writes it back to (T, H, D).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch

from kernels.device import sm_count, total_memory
from kernels.dkv_sums import UnwrittenDkvSums
from kernels.sm90.forward import SUPPORTED_DTYPES, unsupported_inputs
from kernels.sm90.launch import (aligned_rows, as_cute, has_aligned_rows, launch_compiled,
                                 launch_on_current_stream, query_positions, uniform_cu_seqlens)
from kernels.sm90.limits import GRID_YZ_MAX, require_int32_limits
from kernels.sm90.spec import (BACKWARD_DENSE_TILE_N, DS_TILE_ELEMENTS, H100_NUM_SMS,
                               choose_backward_spec, dq_spec_for, ds_tile_count,
                               fused_dq_block_cols, list_shape)
from kernels.sm90.spec import QUERY_SLOT_ROWS as SLOT_ROWS  # `QueryTiles`' tile rows
from kernels.validate import sequence_lengths

SUPPORTED_HEAD_DIMS = (64, 128)
LIST_Q_TILE = 128       # block-sparse lists name query tiles of this many rows
SPARSE_KV_BLOCKS = (64, 128)
_LOG2_E = 1.4426950408889634
# `BwdSpec.split_lists`: list entries (128-row query tiles) per work unit. NSA's lists average
# about 8 entries per KV block; block 0's has one per query tile.
LIST_CHUNK = 16  # (beside the dQ kernel; the fused dQ's units are longer: `list_chunk`)
# Split-list units taken head by head (list head by list head), beside the dQ kernel as with
# the fused dQ: the CTAs running together read one KV group's Q and dO, which L2 holds, instead
# of every group's at random query tiles. H100, 2026-11-27, NSA-like 16 x 64-key lists per KV
# group (H=32, Hkv=8, D=128), the whole backward, CSR order / head by head: 16K 2.57 / 2.14 ms,
# 64K 10.18 / 9.09; random 25% 64-key lists per query head 5.77 / 5.75 and 101.5 / 101.8.
# run(head_major_units=False) (the tuner's "units CSR order") takes them KV block by KV block.
UNITS_HEAD_MAJOR = True  # run()'s default
# Split rows sized by how the work spreads over packed sequences (`balanced_kv_tiles`, from the
# host bounds) rather than by the CTA count; False: the CTA count (the switch for the A/B).
BALANCED_SPLIT_ROWS = True
# Split-list units that alone add into their KV tile store its dK/dV themselves
# (`BwdSpec.owned_dkv_stores`, kernels/sm90/dkv_tiles.py), where the float32 partials are the
# kernel's own (not the caller's sums); the other tiles' partials are zeroed and converted
# tile by tile. A switch for the A/B and the GPU tests.
OWNED_DKV_STORES = True
# Rows per chunk of the preprocess and postprocess (bounds their float32 temporaries).
_CHUNK_ROWS = 32768
# 64-key lists beside the dQ kernel: the KV-centric kernel stores each step's dS^T and the dQ
# kernel multiplies it (`BwdSpec.stores_ds`, kernels/sm90/bwd_dq_from_ds.py: one product per
# step instead of recomputing S and dP) where the tiles (`ds_tile_count`: 16 KiB per forward
# list slot and query head at 16 bits) take at most DS_TILES_MEMORY_FRACTION of the device's
# memory; they live through this backward call alone. False: the dQ kernel always recomputes
# (a switch for the A/B). NSA at H=32, 16 selected blocks: 5.1 GB at 64K tokens (within an
# 80 GB H100's 5.3 GB), 1M tokens recompute.
DS_TILES = True
DS_TILES_MEMORY_FRACTION = 1 / 16
# A call whose every query tile meets one KV tile (`dq_store_opens_sums`: nsa()'s compressed
# branch on documents up to 8K tokens) opens the caller's `DqSums` with its fused dQ instead
# of running the dQ kernel. False: the dQ kernel (a switch for the A/B).
DQ_STORES = True


def can_run(q, k, v, *, block_sparse=None, causal=False, window_size=(-1, -1),
            compress_factor=1, deterministic=False, **_) -> tuple[bool, str]:
    """(ok, reason): whether the sm90 backward kernel computes this case."""
    reason = unsupported_inputs(q, k, v, SUPPORTED_HEAD_DIMS, "the backward kernel")
    if reason:
        return False, reason
    if block_sparse is not None:
        if block_sparse.row_block_size != LIST_Q_TILE:
            return False, (f"block-sparse row_block_size {block_sparse.row_block_size} != "
                           f"{LIST_Q_TILE}")
        if block_sparse.col_block_size not in SPARSE_KV_BLOCKS:
            return False, (f"block-sparse col_block_size {block_sparse.col_block_size} not in "
                           f"{SPARSE_KV_BLOCKS}")
    try:
        _spec_for(q, k, causal, window_size, block_sparse, compress_factor, deterministic)
    except ValueError as error:
        return False, str(error)
    return True, "sm90 CuTe DSL kernel"


def _spec_for(q, k, causal, window_size, block_sparse, compress_factor, deterministic,
              kv_tile_ctas=None, max_seqlen_k=None, dq_accumulator_bytes=None):
    return choose_backward_spec(
        dtype=str(q.dtype).removeprefix("torch."), head_dim=q.shape[-1], causal=causal,
        window_size=window_size, compress_factor=compress_factor,
        sparse_block_size=block_sparse.col_block_size if block_sparse is not None else None,
        deterministic=deterministic, kv_tile_ctas=kv_tile_ctas, max_seqlen_k=max_seqlen_k,
        num_sms=_sm_count(q.device), dq_accumulator_bytes=dq_accumulator_bytes,
        lists=None if block_sparse is None else list_shape(block_sparse, q.shape[-2],
                                                            k.shape[-2]))


def _call_spec(q, k, cu_seqlens_q, max_seqlen_k, causal, window_size, block_sparse,
               compress_factor, deterministic, kv_tile_ctas=None):
    """`run`'s spec for packed (T, H, D) inputs, before its overrides and score mods;
    kv_tile_ctas: `_kv_tile_ctas` of the call (None: counted without host bounds)."""
    if kv_tile_ctas is None:
        kv_tile_ctas = _kv_tile_ctas(k, cu_seqlens_q, max_seqlen_k)
    return _spec_for(q, k, causal, window_size, block_sparse, compress_factor, deterministic,
                     kv_tile_ctas, max_seqlen_k, dq_accumulator_bytes=4 * q.numel())


def _kv_tile_ctas(k, cu_seqlens_q, max_seqlen_k, host_cu_seqlens_q=None, host_cu_seqlens_k=None,
                  window_left: int = -1) -> int:
    """The grid without block-sparse lists (KV tiles x KV heads x sequences) counted in CTAs
    as heavy as its heaviest: `split_rows` splits calls below the SM count, `_row_splits`
    sizes the split from it. Without host bounds every sequence counts as the longest
    (sequences alike: the CTA count); with them, `balanced_kv_tiles`."""
    if not BALANCED_SPLIT_ROWS or host_cu_seqlens_q is None or host_cu_seqlens_k is None:
        kv_tiles = -(-(max_seqlen_k or 0) // BACKWARD_DENSE_TILE_N) * (cu_seqlens_q.numel() - 1)
    else:
        kv_tiles = balanced_kv_tiles(tuple(host_cu_seqlens_q), tuple(host_cu_seqlens_k),
                                     int(window_left))
    return kv_tiles * k.shape[1]


@functools.lru_cache(maxsize=256)
def balanced_kv_tiles(host_cu_seqlens_q: tuple, host_cu_seqlens_k: tuple,
                      window_left: int = -1) -> int:
    """The KV tiles of packed sequences (one KV head) counted in tiles as heavy as the
    heaviest: the query steps of every KV tile over those of the heaviest (at least one tile
    where any runs). A KV tile's steps are taken as its sequence's query steps (the first KV
    tile of a causal sequence meets them all; an upper bound for the later ones), at most a
    sliding window's span. Sequences alike give their KV tiles; one long document among
    short ones gives far fewer: nsa()'s compressed branch on 25 documents of log-normal
    lengths (64K tokens, the longest 8,031) ran one CTA per document and KV head, the longest
    document's CTA walking 126 query steps of each of 4 heads while the mean CTA walked 41."""
    steps_cap = None
    if window_left >= 0:
        steps_cap = -(-(window_left + BACKWARD_DENSE_TILE_N) // SLOT_ROWS) + 1
    work, heaviest = 0, 0
    lengths = zip(sequence_lengths(host_cu_seqlens_q), sequence_lengths(host_cu_seqlens_k))
    for rows, keys in lengths:
        if rows <= 0 or keys <= 0:
            continue
        steps = -(-rows // SLOT_ROWS)
        if steps_cap is not None:
            steps = min(steps, steps_cap)
        work += steps * -(-keys // BACKWARD_DENSE_TILE_N)
        heaviest = max(heaviest, steps)
    return -(-work // heaviest) if heaviest else 0


def fuses_dq(q, k, *, cu_seqlens_q, max_seqlen_k, causal=False, window_size=(-1, -1),
             block_sparse=None, compress_factor=1, deterministic=False, **_) -> bool:
    """Whether `run` on these packed inputs adds its dQ into float32 sums (`BwdSpec.fuses_dq`,
    without spec overrides or score mods): nsa()'s backward asks it of its later branches
    before the first opens its `DqSums` (`DqSums.stores_first`). A call that may open the
    sums with a stored fused dQ (`dq_store_opens_sums`) counts as not fusing: it adds nothing
    into sums another call opened. Reads no device value."""
    return _call_spec(q, k, cu_seqlens_q, max_seqlen_k, causal, window_size, block_sparse,
                      compress_factor, deterministic).fuses_dq


def score_mod_spec(spec, score_mods, bias_grad: bool, dbias_stores: bool = False,
                   dbias_tiles: bool = False):
    """`spec` with a user mask and bias (`score_mods`) and dbias where `bias_grad` (stored,
    not summed, with `dbias_stores`: `BwdSpec.score_dbias_stores`; summed into sums of the
    visited tiles alone with `dbias_tiles`: `BwdSpec.score_dbias_tiles`): on the
    fused dQ (the dQ kernel would recompute P without them); None where it cannot fuse. A
    16-bit bias whose rows start 16 bytes apart is staged in smem (`score_stage_bias`) where
    its tile fits (H200, 16K, window 16K: backward 13.97 -> 11.69 ms, docs/history.md).

    dbias takes reductions (`red.global.add`) even where one CTA walks every head a bias cell
    serves: plain loads and adds there put the load's latency into every step (H200,
    2026-11-28, window masks at 16K with one bias for 16 heads: backward 30.4 / 57.5 ms at
    windows 8192 / 16384 against 23.8 / 41.8 with reductions, docs/history.md)."""
    fused = dataclasses.replace(spec, dq_separate=False,
                                score_mask=score_mods.mask is not None,
                                score_bias=score_mods.bias_dtype, score_bias_grad=bias_grad,
                                score_dbias_stores=bias_grad and dbias_stores,
                                score_dbias_tiles=bias_grad and dbias_tiles)
    if not (fused.can_fuse_dq and fused.fits_in_smem()):
        return None
    staged = dataclasses.replace(fused, score_stage_bias=True)
    return staged if _can_stage_bias(score_mods.bias) and staged.fits_in_smem() else fused


def _can_stage_bias(bias) -> bool:
    """Whether the backward can copy the bias's tiles to smem 16 bytes at a time
    (`BwdSpec.score_stage_bias`): a 16-bit bias whose slabs and rows start 16 bytes apart."""
    return bias is not None and bias.element_size() == 2 and has_aligned_rows(bias)


def can_run_score_mods(q, k, v, *, block_sparse, score_mods, bias_grad: bool,
                       **kwargs) -> bool:
    """Whether `run` takes this call with `score_mods` (after `can_run` said yes)."""
    spec = _spec_for(q, k, kwargs.get("causal", False), kwargs.get("window_size", (-1, -1)),
                     block_sparse, kwargs.get("compress_factor", 1), False)
    return score_mod_spec(spec, score_mods, bias_grad) is not None


def _sm_count(device) -> int:
    return sm_count(device) if device.type == "cuda" else H100_NUM_SMS


def run(
    dout, q, k, v, out, lse, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
    max_seqlen_k=None, softmax_scale=None, causal=False, compress_factor=1, window_size=(-1, -1),
    block_sparse=None, block_sparse_transposed=None, deterministic=False, spec_overrides=None,
    dout_dot_out=None, dq_accumulator=None, dkv_accumulators=None, lse_gate=None,
    host_cu_seqlens_q=None, head_major_units=UNITS_HEAD_MAJOR, q_start_positions=None,
    score_mods=None, dbias=None, dbias_stores=False, dbias_slots=None, dq_sums=None,
    row_statistics=None, dkv_out=None, host_cu_seqlens_k=None,
):
    """(dq, dk, dv) of the sm90 backward kernel; dk and dv summed over each KV group.

    dout_dot_out: rowsum(dout * out) as a (Tq, H) floating tensor ((B, Nq, H) padded) when the
    caller has it (nsa()'s gate backward writes it); then `out` is not read and may be None.
    dq_accumulator: a tensor of q's shape and dtype that dq is added into and returned as (the
    dQ kernel adds as it writes, `DqSpec.accumulate`, where it can write the tensor's strides;
    elsewhere dq is added after).
    dkv_accumulators: (dk_sum, dv_sum), contiguous float32 tensors of k's and v's shape that
    dk and dv are added into and returned as; the kernel adds into them itself, its float32
    partial sums (`BwdSpec.partial_dkv`) or, one CTA per KV tile, its dK, dV as it stores them
    (`BwdSpec.add_dkv`). As `kernels.dkv_sums.UnwrittenDkvSums` they hold nothing yet: one CTA
    per KV tile stores its float32 dK, dV into them (`BwdSpec.store_dkv_sums`), partial sums
    go in after they are zeroed.
    lse_gate: (gates (Tq, H, B), b) with dout_dot_out: `lse` is the branch's own and the gate
    gates[..., b] is folded into it here (`gate_folded_lse`; on the GPU in the row-statistics
    launch, `GateFoldedStatistics`). nsa()'s backward passes it instead of folding in torch.
    host_cu_seqlens_q: the values of cu_seqlens_q (packed inputs), when the caller holds them:
    the query tile layout is then kept across calls (sparsity/host_cache.py) instead of being
    rebuilt on the device (about 20 small launches) by every call. host_cu_seqlens_k: those of
    cu_seqlens_k: with both, a call whose every query tile meets one KV tile may open
    `dq_sums` with its fused dQ (`dq_store_opens_sums`).
    head_major_units: split-list work units taken list head by list head (the default,
    UNITS_HEAD_MAJOR) or, False, KV block by KV block (tools/tune_sm90_backward.py compares).
    q_start_positions (host ints, one per sequence): the position of each sequence's first
    query row (`BwdSpec.q_positions`, and the dQ kernel's); negative where the keys given are
    a later part of the sequence's (`kernels.masked`'s chunks of keys).
    score_mods (`kernels.sm90.forward.ScoreModTensors`, padded inputs with the lists of the
    mask, `kernels.masked.sm90_backward`): the forward's user mask and bias, on the fused dQ
    (`score_mod_spec`); dbias: a float32 (slabs, Nq, Nk) tensor that dS is summed into, zeroed
    where the lists visit; with `dbias_stores` (each bias slab serves one batch entry and query
    head) a tensor of the bias's dtype whose visited cells are written dS
    (`BwdSpec.score_dbias_stores`); with dbias_slots ((slabs, Tq, Tk) int32, each visited
    128 x 128 tile's slot) a float32 (slots, 128, 128) tensor of the visited tiles' sums
    alone, zeroed (`BwdSpec.score_dbias_tiles`).
    dq_sums (a `DqSums`): where this call fuses dQ into a float32 accumulator of the sums'
    layout, it adds into the shared one and leaves it unconverted; dq is then returned as
    dq_accumulator (None without one) and the caller's `dq_sums.finish` converts it. Where it
    runs the dQ kernel instead (packed inputs) and `dq_sums.consumes` says so, that kernel adds
    the sums into its dQ (`DqSpec.sums_block_cols`) and the sums are spent.
    row_statistics (a `SharedRowStatistics`): calls on the same rows (other keys of them:
    `kernels.masked`'s chunks of keys) compute the row statistics once.
    dkv_out: (dk, dv) tensors of k's and v's shape and dtype, contiguous, that dK and dV are
    written into and returned as where the units that own their KV tile store them
    (`owned_dkv_stores`; elsewhere new tensors are returned)."""
    if lse_gate is not None and dout_dot_out is None:
        raise ValueError("lse_gate: only taken with dout_dot_out (the gate's row dots)")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q: dtype {q.dtype} is not supported by the sm90 backward kernel "
                         f"(bfloat16 or float16)")
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q: head dim {q.shape[-1]} is not supported by the sm90 backward "
                         f"kernel (one of {SUPPORTED_HEAD_DIMS})")
    padded = q.dim() == 4
    if padded:
        batch, seqlen_q, num_heads, head_dim = q.shape
        seqlen_k = k.shape[1]
        dout, q, k, v, out, dout_dot_out = (None if t is None else t.reshape(-1, *t.shape[2:])
                                            for t in (dout, q, k, v, out, dout_dot_out))
        lse = lse.permute(1, 0, 2).reshape(num_heads, batch * seqlen_q)
        cu_seqlens_q = uniform_cu_seqlens(batch, seqlen_q, q.device)
        cu_seqlens_k = uniform_cu_seqlens(batch, seqlen_k, q.device)
        max_seqlen_q, max_seqlen_k = seqlen_q, seqlen_k
        if lse_gate is not None:
            lse_gate = (lse_gate[0].reshape(-1, *lse_gate[0].shape[2:]), lse_gate[1])
    total_q, num_heads, head_dim = q.shape
    # The dQ kernel adds into the caller's dq where it can write it; elsewhere dq is added after.
    dq_into = None if dq_accumulator is None else _kernel_rows(dq_accumulator, q.shape)
    require_int32_limits("kernels.sm90.backward.run", q, k, backward=True,
                         cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                         max_seqlen_k=max_seqlen_k, compress_factor=compress_factor,
                         window_size=window_size, block_sparse=block_sparse,
                         deterministic=deterministic, causal=causal)
    dout = aligned_rows(dout)
    out = None if out is None else aligned_rows(out)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    kv_tile_ctas = _kv_tile_ctas(k, cu_seqlens_q, max_seqlen_k, host_cu_seqlens_q,
                                 host_cu_seqlens_k, window_size[0])
    spec = _call_spec(q, k, cu_seqlens_q, max_seqlen_k, causal, window_size, block_sparse,
                      compress_factor, deterministic, kv_tile_ctas)
    if spec_overrides:
        spec = dataclasses.replace(spec, **spec_overrides)
    score_tensors = (None,) * 5
    if score_mods is not None:
        spec = score_mod_spec(spec, score_mods, dbias is not None, dbias_stores,
                              dbias_slots is not None)
        if spec is None:
            raise ValueError("score_mods: this call's backward cannot take the fused dQ "
                             "(kernels.masked sends it to the torch path)")
        score_tensors = (score_mods.mask, score_mods.bias, score_mods.slabs, dbias,
                         dbias_slots)
    positions = None
    if q_start_positions is not None:
        spec = dataclasses.replace(spec, q_positions=True)
        positions = query_positions(tuple(q_start_positions), q.device)

    adds_into_accumulators = dkv_accumulators is not None
    unwritten = isinstance(dkv_accumulators, UnwrittenDkvSums)
    spec = with_dkv_destination(spec, adds_into_accumulators, unwritten)
    if unwritten and not spec.store_dkv_sums:  # partials add into them, or no launch writes
        for t in dkv_accumulators:
            t.zero_()
    owned = (None, None)  # `owned_dkv_stores`: dK and dV in the input dtype
    if adds_into_accumulators:  # the caller's float32 sums take the CTAs' dK, dV
        dk, dv = (t.view(-1, *t.shape[-2:]) for t in dkv_accumulators)
    elif spec.owned_dkv_stores:  # partials zeroed and converted only where units share tiles
        dk, dv = (torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in (k, v))
        if dkv_out is not None and all(o.is_contiguous() and o.numel() == t.numel()
                                       and o.dtype == t.dtype for o, t in zip(dkv_out, (k, v))):
            owned = tuple(o.view(t.shape) for o, t in zip(dkv_out, (k, v)))
        else:
            owned = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (k, v))
    elif spec.partial_dkv:  # float32 accumulators of several CTAs' partial sums
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    else:
        dk = torch.empty_like(k)
        dv = torch.empty_like(v)
    # The dK, dV a direct call gets back (before a conversion of float32 partials), zeroed where
    # no launch writes them.
    returned = owned if spec.owned_dkv_stores else (dk, dv)
    if total_q == 0 or max_seqlen_q == 0 or k.shape[0] == 0:
        dq = torch.zeros_like(q)
        if not adds_into_accumulators or spec.store_dkv_sums:  # nothing stores into them
            for t in returned:
                t.zero_()
    else:
        if padded:  # the bounds are the batch's multiples of its length: known here
            host_cu_seqlens_q = tuple(range(0, total_q + 1, max_seqlen_q))
        tiles = query_tiles(cu_seqlens_q, total_q, host_cu_seqlens_q)
        statistics = functools.partial(tiles.row_statistics, dout, out, lse, dout_dot_out,
                                       lse_gate)
        lse_log2, dpsum = statistics() if row_statistics is None else row_statistics.of(
            tiles, statistics)
        dq_acc = shared_sums = None
        sums_shape = (num_heads, tiles.num_slots, head_dim)  # a fused dQ's float32 sums
        if (dq_sums is not None and dq_sums.awaits_store and dq_accumulator is None
                and not padded
                and dq_store_opens_sums(spec, host_cu_seqlens_q, host_cu_seqlens_k,
                                        compress_factor, positions is not None)):
            stored = dataclasses.replace(spec, dq_separate=False, dq_stores=True,
                                         heavy_first=False)
            if stored.fits_in_smem():
                shared_sums = dq_sums.open_for_store(tiles, sums_shape,
                                                     stored.dq_cols_per_warpgroup,
                                                     softmax_scale, q.dtype, q.device)
            if shared_sums is not None:
                spec, dq_acc = stored, shared_sums
        if spec.fuses_dq and dq_acc is None:
            if dq_sums is not None:
                shared_sums = dq_sums.take(tiles, sums_shape, spec.dq_cols_per_warpgroup,
                                           softmax_scale, q.dtype, q.device)
            dq_acc = shared_sums if shared_sums is not None else torch.zeros(
                sums_shape, dtype=torch.float32, device=q.device)
        forward_lists = (None,) * 5  # read by the dQ kernel
        if block_sparse is not None:
            bs = block_sparse
            forward_lists = (bs.full_count, bs.full_index, bs.mask_count, bs.mask_index,
                             bs.row_block_offsets)
        window = (max(window_size[0], 0), max(window_size[1], 0))  # the kernels' int32 scalars
        lists = (None,) * 4
        ds_tiles = (None, None)  # `stores_ds`: each list entry's forward slot, the dS tiles
        units = None
        num_ctas = -(-max_seqlen_k // spec.tile_n)
        row_splits = 1
        if spec.row_bands:  # bands of rows whose fused dQ sums L2 holds
            row_splits = _row_bands(max_seqlen_q, num_heads, head_dim, spec.tile_m)
        elif spec.split_rows:  # dense only: num_ctas KV tiles of BACKWARD_DENSE_TILE_N keys
            row_splits = _row_splits(kv_tile_ctas, -(-max_seqlen_q // spec.tile_m), q.device)
        if spec.block_sparse:
            csr = block_sparse_transposed
            if csr is None:
                from sparsity import transpose_block_sparse_csr

                # A direct call (kernels.interface always passes one): the checked build.
                csr = transpose_block_sparse_csr(block_sparse, cu_seqlens_k=cu_seqlens_k)
            lists = (csr.offsets, csr.index, csr.mask_count, csr.row_block_offsets)
            if _stores_ds(spec, block_sparse, csr, num_heads, q, max_seqlen_q):
                spec = dataclasses.replace(spec, stores_ds=True)
                ds_tiles = (csr.slot, torch.empty(ds_tile_count(block_sparse, num_heads),
                                                  DS_TILE_ELEMENTS, dtype=q.dtype,
                                                  device=q.device))
            if spec.split_lists:
                chunk = list_chunk(csr, spec)
                units = work_units(csr, chunk, head_major=head_major_units)
                num_ctas = units.shape[0]
        if max_seqlen_k > 0 and num_ctas > 0:
            tile_pass = None
            if spec.owned_dkv_stores:  # the tiles no unit owns: zeroed before, finished after
                from kernels.sm90 import dkv_tiles

                tile_pass = functools.partial(dkv_tiles.run, csr=csr, chunk=chunk,
                                              cu_seqlens_k=cu_seqlens_k, tile_n=spec.tile_n,
                                              sums=(dk, dv), out=owned)
                tile_pass("zero")
            tensors = (q, k, v, dout, lse_log2, dpsum, dq_acc, dk, dv, cu_seqlens_q,
                       cu_seqlens_k, tiles.tile_offsets)
            scalars = (num_ctas, row_splits, softmax_scale, compress_factor, *window)
            _launch(spec, tensors, scalars,
                    (*lists, units, positions, *score_tensors, *owned, *ds_tiles))
            if tile_pass is not None:
                tile_pass("finish")
        elif not adds_into_accumulators or spec.store_dkv_sums:  # nothing stores into them
            for t in returned:
                t.zero_()
        if spec.dq_separate:
            # The first call on the sums may open them with its dQ (no zeroing, no dq
            # written); else the fused branches' sums, when this call can take them, go into
            # its dQ.
            sums, sums_cols, stores = None, 0, False
            if dq_sums is not None and not padded:
                if dq_accumulator is None and not spec.stores_ds:
                    stores_cols = fused_dq_block_cols(head_dim)
                    sums = dq_sums.open_for_store(tiles, sums_shape, stores_cols,
                                                  softmax_scale, q.dtype, q.device)
                    stores = sums is not None
                    sums_cols = stores_cols if stores else 0
                if not stores:
                    sums, sums_cols = dq_sums.consume(tiles, softmax_scale, q.dtype)
            dq = None if stores else torch.empty_like(q) if dq_into is None else dq_into
            dq_spec = dq_spec_for(
                spec, accumulate=dq_into is not None, sums_block_cols=sums_cols,
                stores_sums=stores,
                heads_per_list=(num_heads // block_sparse.full_count.shape[1]
                                if block_sparse is not None else 1))
            _launch_dq(dq_spec,
                       (q, k, v, dout, lse_log2, dpsum, dq, cu_seqlens_q, cu_seqlens_k,
                        tiles.tile_offsets),
                       (-(-max_seqlen_q // dq_spec.tile_m), softmax_scale, compress_factor,
                        *window),
                       (*forward_lists, positions, sums,
                        *((ds_tiles[1],) if spec.stores_ds else ())))
        elif shared_sums is not None:  # converted by the caller's dq_sums.finish
            dq = dq_into
        else:
            dq = tiles.gather_dq(dq_acc, spec.dq_cols_per_warpgroup, softmax_scale, q.dtype,
                                 into=dq_into)
    if dq_accumulator is not None:
        if dq is not dq_into:  # computed fresh: added here
            dq_accumulator.add_(dq.reshape(dq_accumulator.shape))
        dq = dq_accumulator
    elif padded and dq is not None:  # None: in the caller's dq_sums
        dq = dq.view(batch, seqlen_q, num_heads, head_dim)
    if adds_into_accumulators:
        return dq, *dkv_accumulators
    if spec.owned_dkv_stores:
        dk, dv = returned
    elif spec.partial_dkv:
        dk, dv = dk.to(k.dtype), dv.to(v.dtype)
    if padded:
        dk = dk.view(batch, seqlen_k, *dk.shape[1:])
        dv = dv.view(batch, seqlen_k, *dv.shape[1:])
    return dq, dk, dv


def _stores_ds(spec, block_sparse, csr, num_heads: int, q, max_seqlen_q: int) -> bool:
    """Whether this call's KV-centric kernel stores its dS tiles for the dQ kernel
    (DS_TILES, `BwdSpec.stores_ds`): 64-key lists beside the dQ kernel, one step per 64 rows,
    no score mods, a transpose that names each entry's forward slot, a grid of 64-row dQ CTAs
    within CUDA's y extent, and the tiles within DS_TILES_MEMORY_FRACTION of the device's
    memory (shapes and the device only: a CUDA graph sees the same choice on every call)."""
    if not (DS_TILES and spec.dq_separate and spec.tile_n == 64 and spec.tile_m == 64
            and not spec.alternate_steps and not spec.score_mods and csr.slot is not None
            and -(-max_seqlen_q // 64) <= GRID_YZ_MAX):
        return False
    budget = total_memory(q.device) * DS_TILES_MEMORY_FRACTION
    tile_bytes = DS_TILE_ELEMENTS * q.element_size()
    return ds_tile_count(block_sparse, num_heads) * tile_bytes <= budget


def dq_store_opens_sums(spec, host_cu_seqlens_q, host_cu_seqlens_k, compress_factor: int,
                        q_positions: bool) -> bool:
    """Whether this call's backward may store its fused dQ as the first values of a `DqSums`
    (`BwdSpec.dq_stores`) instead of running the dQ kernel: every (query head, 64-row tile) of
    every sequence must then be written by exactly one CTA. So: dense causal keys without a
    window (compressed ones: nsa()'s compressed branch up to 8K tokens a document), each
    sequence with rows holding 1 to tile_n keys (one KV tile, which with a compress factor up
    to the 64-row step sees from the first query tile on: key 0 stands for rows up to
    cf - 1), its rows cut into disjoint runs by split rows, not bands; from the host bounds."""
    if (not DQ_STORES or host_cu_seqlens_q is None or host_cu_seqlens_k is None
            or not spec.dq_separate or spec.block_sparse or not spec.causal
            or spec.has_window_left or spec.has_window_right or spec.row_bands or q_positions
            or spec.score_mods or spec.deterministic or compress_factor > spec.tile_m):
        return False
    if not dataclasses.replace(spec, dq_separate=False).can_fuse_dq:
        return False
    lengths = zip(sequence_lengths(host_cu_seqlens_q), sequence_lengths(host_cu_seqlens_k))
    return all(rows == 0 or 1 <= keys <= spec.tile_n for rows, keys in lengths)


def with_dkv_destination(spec, into_caller_sums: bool, unwritten: bool = False):
    """`spec` with where its dK and dV go: into the caller's float32 sums (`add_dkv` where one
    CTA owns each KV tile, `store_dkv_sums` there when the sums hold nothing yet (`unwritten`),
    else its partials added there), or beside the kernel's own float32 partials, stored by the
    split-list units that own their tile (`owned_dkv_stores`, while OWNED_DKV_STORES), or as
    the spec has them."""
    if into_caller_sums:
        if spec.partial_dkv:
            return spec
        return dataclasses.replace(spec, **{"store_dkv_sums" if unwritten else "add_dkv": True})
    if spec.split_lists and OWNED_DKV_STORES:
        return dataclasses.replace(spec, owned_dkv_stores=True)
    return spec


def query_tiles(cu_seqlens_q: torch.Tensor, total_q: int, host_cu_seqlens_q=None) -> "QueryTiles":
    """`QueryTiles` of these sequences; with their host values, from sparsity/host_cache.py
    (a function of the host bounds only, so the three branches of an nsa() backward, and the
    steps of a training loop with the same packing, build it once)."""
    if host_cu_seqlens_q is None:
        return QueryTiles(cu_seqlens_q, total_q)
    from sparsity.host_cache import cached

    host_key = (tuple(host_cu_seqlens_q), total_q)
    return cached(("query tiles", *host_key), cu_seqlens_q,
                  lambda: QueryTiles(cu_seqlens_q, total_q, host_key))


def gate_folded_lse(lse: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """lse - log(g) (H, T) float32, for a branch whose output o = softmax(S) V enters the
    result as g * o (g: (T, H) gate column).

    The attention backward of g * o with dO: dV = P^T (g dO), dS = P * (g dO V^T - delta),
    delta = rowsum(g dO * o). Written with P' = g P = exp(S - (lse - log g)) that is
    dV = P'^T dO and dS = P' * (dO V^T - <dO, o>): the plain backward on dO itself, with lse
    replaced by this and delta by <dO, o> (the gate's gradient, which nsa() has). So nsa()
    never writes g * dO, and keeps no o for the backward.
    A gate that is not > 0 (sigmoid underflow; NaN) adds nothing: its row gets -inf, the mark
    of a row that sees nothing (whose lse is -inf already), so P' = 0 and never NaN. The GPU
    computes the same in `GateFoldedStatistics` (kernels/sm90/bwd_preprocess.py)."""
    folded = lse.float() - torch.log(gate.float()).t()
    return folded.masked_fill_(~(gate > 0).t(), -math.inf)


class QueryTiles:
    """The 64-row query tile layout of the kernel's row statistics and dQ accumulator.

    Sequence s owns tiles tile_offsets[s] .. tile_offsets[s+1] - 1 (ceil(len / 64) of them);
    packed row t of sequence s sits in slot 64 * tile_offsets[s] + (t - cu_seqlens[s]). The
    number of slots is bounded from shapes (T + 64 S rounded to tiles), so nothing is read back
    from the device."""

    def __init__(self, cu_seqlens_q: torch.Tensor, total_q: int, host_key=None):
        # (host cu_seqlens, total_q) where the layout was built from host bounds: two layouts
        # with one key are equal (`same_layout`) even where the cache did not hand out one
        # object (a capture on a side stream builds its own).
        self.host_key = host_key
        device = cu_seqlens_q.device
        cu = cu_seqlens_q.to(torch.int64)
        num_seqs = cu.numel() - 1
        tiles = (cu.diff() + SLOT_ROWS - 1) // SLOT_ROWS
        self.tile_offsets = torch.cat([cu.new_zeros(1), tiles.cumsum(0)]).to(torch.int32)
        self.cu_seqlens = cu.to(torch.int32)
        self.num_slots = SLOT_ROWS * (total_q // SLOT_ROWS + num_seqs)
        rows = torch.arange(total_q, device=device)
        sequence = torch.searchsorted(cu[1:], rows, right=True)
        slot = SLOT_ROWS * self.tile_offsets[sequence].to(torch.int64) + rows - cu[sequence]
        # Only int32 kept (< 2**31: kernels.validate checks the slots): host_cache holds this
        # layout per packing, 4 bytes a row.
        self.slot32 = slot.to(torch.int32)

    def same_layout(self, other: "QueryTiles") -> bool:
        """Whether `other` lays the rows out as this one does, known on the host: the same
        object, or both built from the same host bounds."""
        return other is self or (self.host_key is not None and other.host_key == self.host_key)

    @property
    def slot(self) -> torch.Tensor:
        """The rows' slots as int64 (the torch paths' index)."""
        return self.slot32.to(torch.int64)

    def row_statistics(self, dout, out, lse, dout_dot_out=None, lse_gate=None):
        """(lse * log2(e), rowsum(dO * O)) as (H, slots) float32, +inf / 0 in the padding. On
        the GPU one CuTe DSL pass (kernels/sm90/bwd_preprocess.py): from O and dO, or from a
        given dout_dot_out (T, H) with the gate of `lse_gate` folded into lse
        (`GateFoldedStatistics`). On the CPU (the unit tests' reference), or from a given
        dout_dot_out without a gate, in torch (O is then not read)."""
        num_heads = dout.shape[1]
        shape = (num_heads, self.num_slots)
        on_gpu = dout.is_cuda and dout.shape[0] > 0
        if lse_gate is not None:
            gates, index = lse_gate
            if on_gpu and gates.dtype == torch.float32 and gates.stride(-1) == 1:
                # The kernel writes every slot, the padding too: no fills.
                lse_log2, dpsum = (torch.empty(shape, dtype=torch.float32, device=dout.device)
                                   for _ in range(2))
                _launch_gate_fold(dout_dot_out, lse, gates, index, self.slot32, lse_log2, dpsum)
                return lse_log2, dpsum
            lse = gate_folded_lse(lse, gates[..., index])
        lse_log2 = torch.full(shape, math.inf, dtype=torch.float32, device=dout.device)
        dpsum = torch.zeros(shape, dtype=torch.float32, device=dout.device)
        if on_gpu and dout_dot_out is None:
            _launch_preprocess(dout, out, lse, self.slot32, lse_log2, dpsum)
            return lse_log2, dpsum
        scaled = lse.float() * _LOG2_E
        # A row that sees nothing has lse = -inf: +inf makes its P = exp2(s - inf) exactly 0.
        lse_log2[:, self.slot] = torch.where(torch.isneginf(scaled), math.inf, scaled)
        if dout_dot_out is not None:
            dpsum[:, self.slot] = dout_dot_out.t().float()
            return lse_log2, dpsum
        for r0 in range(0, dout.shape[0], _CHUNK_ROWS):
            r1 = min(r0 + _CHUNK_ROWS, dout.shape[0])
            d = dout[r0:r1].float()
            rowsum = (d * out[r0:r1].float()).masked_fill_(d == 0, 0).sum(-1)  # (rows, H)
            dpsum[:, self.slot32[r0:r1].long()] = rowsum.t()
        return lse_log2, dpsum

    def gather_dq(self, dq_acc, block_cols: int, softmax_scale: float, dtype,
                  into=None) -> torch.Tensor:
        """dQ (T, H, D) in `dtype` from the fused backward's float32 accumulator (H, slots, D),
        whose 64-row tiles hold blocks of `block_cols` columns in the dQ product's register
        order (kernels/sm90/dq_accumulator.py), or added into `into` (a (T, H, D) tensor of
        `dtype` the conversion kernel can write) and returned as it. On the GPU one CuTe DSL
        pass (kernels/sm90/dq_convert.py); on the CPU (the unit tests' reference) in torch."""
        total_q = self.slot32.numel()
        dq = into
        if dq is None:
            dq = torch.empty((total_q, dq_acc.shape[0], dq_acc.shape[2]), dtype=dtype,
                             device=dq_acc.device)
        if dq_acc.is_cuda:
            _launch_dq_convert(dq_acc, self.tile_offsets, self.cu_seqlens, dq, block_cols,
                               softmax_scale, accumulate=into is not None)
            return dq
        rows = _rows_from_fragment_order(dq_acc, block_cols)[:, self.slot] * softmax_scale
        if into is None:
            dq.copy_(rows.transpose(0, 1))
        else:
            dq.copy_(dq.float() + rows.transpose(0, 1))  # one rounding, as the kernel
        return dq


class SharedRowStatistics:
    """The row statistics (lse * log2 e and rowsum(dO O) in the query tile layout) of one set
    of rows, computed by the first of several backward calls on those rows and read by the
    others (`kernels.masked`'s chunks of keys: each call walks other KV tiles of the same rows;
    `run(row_statistics=)`)."""

    def __init__(self):
        self._held = None  # (QueryTiles, (lse_log2, dpsum))

    def of(self, tiles: "QueryTiles", compute):
        """compute()'s statistics for rows of this tile layout, computed once."""
        if self._held is None or not self._held[0].same_layout(tiles):
            self._held = (tiles, compute())
        return self._held[1]


class DqSums:
    """One float32 dQ accumulator for several fused-dQ backward calls on the same q (nsa()'s
    compressed and window branches, both on the fused dQ from 32K tokens at l = 64;
    `kernels.masked`'s chunks of keys, each on some of the keys): the first
    call zeroes it, each call adds into it, and `finish` converts it once. On its own each
    call zeroes and converts an accumulator of 4 x T x H x D bytes (4 GiB at 256K tokens,
    H=32, D=128). H200, 2026-11-29, nsa() at 256K: the conversions 4.10 -> 2.49 ms and the
    zeroing 1.92 -> 1.00 ms of a step, its kernels -3.6 ms (docs/history.md). The sums live
    from the first such call to `finish` (through the selected branch's backward in nsa()).
    A call of another layout (tile layout, the dQ blocks' columns, softmax scale, dtype)
    keeps its own accumulator, as without sums. With `consumes`, a later call on the dQ
    kernel adds the sums into the dQ it writes (`consume`: nsa()'s selected branch, run last
    where its outputs are kept), so no conversion pass reads them and dq is rounded once.
    With `stores_first`, a first call on the dQ kernel stores its dQ as the sums' first values
    (`open_for_store`: nsa()'s compressed branch below 32K tokens), so nothing is zeroed; or,
    where each of its query tiles meets one KV tile (`dq_store_opens_sums`: the compressed
    branch on documents up to 8K tokens), its fused dQ does, and no dQ kernel runs."""

    def __init__(self, consumes: bool = False, stores_first: bool = False):
        self._sums = None
        self._layout = None  # (QueryTiles, block columns, softmax scale, dtype)
        # A dQ-kernel call may take the sums into its dQ (`consume`): only where the caller
        # makes that call the last to see them.
        self.consumes = consumes
        # The first call, without a running dq, may store its dQ as the sums' first values
        # (`open_for_store`: from the dQ kernel, or a fused dQ where `dq_store_opens_sums`):
        # where the caller knows a later call fuses dQ into them, which then needs no zeroed
        # sums.
        self.stores_first = stores_first

    @property
    def awaits_store(self) -> bool:
        """Whether a call may still open the sums by storing into them (`open_for_store`)."""
        return self.stores_first and self._sums is None

    def open_for_store(self, tiles: QueryTiles, shape, block_cols: int, softmax_scale: float,
                       dtype, device) -> torch.Tensor | None:
        """Unwritten float32 sums of this layout for a call to store its whole dQ into (a dQ
        kernel's `DqSpec.stores_sums` or a fused dQ's `BwdSpec.dq_stores`: every slot tile of
        every sequence is written, so nothing is zeroed; later calls of the layout `take` and
        add into them), where `stores_first` is on and no call opened the sums yet; else None.
        At 64K tokens, H=32, D=128 this saves zeroing 1 GiB of sums and reading a 16-bit dq
        back in the consuming call."""
        if not self.awaits_store:
            return None
        self._sums = torch.empty(shape, dtype=torch.float32, device=device)
        self._layout = (tiles, block_cols, softmax_scale, dtype)
        return self._sums

    def take(self, tiles: QueryTiles, shape, block_cols: int, softmax_scale: float, dtype,
             device) -> torch.Tensor | None:
        """The accumulator a call of this layout adds into (zeroed for the first), else None."""
        if self._sums is None:
            self._sums = torch.zeros(shape, dtype=torch.float32, device=device)
            self._layout = (tiles, block_cols, softmax_scale, dtype)
            return self._sums
        if (self._holds(tiles, softmax_scale, dtype) and self._layout[1] == block_cols
                and tuple(self._sums.shape) == tuple(shape)):
            return self._sums
        return None

    def consume(self, tiles: QueryTiles, softmax_scale: float, dtype):
        """(sums, block columns) for a dQ-kernel call of this layout to add into its dQ, which
        spends them (`finish` then has nothing to convert), or (None, 0): no sums, another
        layout, or `consumes` off. The caller orders its calls so that the one taking them
        comes after every call that adds into them."""
        if not self.consumes or self._sums is None or not self._holds(tiles, softmax_scale,
                                                                      dtype):
            return None, 0
        sums, block_cols = self._sums, self._layout[1]
        self._sums = self._layout = None
        return sums, block_cols

    def _holds(self, tiles: QueryTiles, softmax_scale: float, dtype) -> bool:
        """Whether the sums held are of this query tile layout, scale and dtype."""
        held_tiles, _, held_scale, held_dtype = self._layout
        return (held_tiles.same_layout(tiles) and held_scale == softmax_scale
                and held_dtype == dtype)

    def finish(self, into: torch.Tensor | None = None) -> torch.Tensor | None:
        """dq (T, H, D) from the sums, added into `into` where given (returned as it); `into`
        itself where no call took the sums."""
        if self._sums is None:
            return into
        tiles, block_cols, softmax_scale, dtype = self._layout
        sums, self._sums, self._layout = self._sums, None, None
        target = None if into is None else _kernel_rows(into, into.shape)
        dq = tiles.gather_dq(sums, block_cols, softmax_scale, dtype, into=target)
        if into is None:
            return dq
        if target is None:  # strides the conversion cannot write
            into.add_(dq)
        return into


def _rows_from_fragment_order(dq_acc: torch.Tensor, block_cols: int) -> torch.Tensor:
    """(H, slots, D) in row order from the fused backward's register-order blocks: value v of
    thread t of a 64 x block_cols wgmma accumulator sits at float ((v // 4) * 128 + t) * 4 +
    v % 4 of its block (kernels/sm90/dq_accumulator.py); the fragment puts it at row
    16 (t // 32) + (t % 32) // 4 + 8 ((v // 2) % 2), column 8 (v // 4) + 2 (t % 4) + v % 2."""
    heads, slots, dim = dq_acc.shape
    f = torch.arange(SLOT_ROWS * block_cols)
    t, v = (f // 4) % 128, (f // 512) * 4 + f % 4
    row = 16 * (t // 32) + (t % 32) // 4 + 8 * ((v // 2) % 2)
    col = 8 * (v // 4) + 2 * (t % 4) + v % 2
    blocks = dq_acc.reshape(heads, slots // SLOT_ROWS, dim // block_cols, SLOT_ROWS * block_cols)
    natural = torch.empty_like(blocks).view(heads, slots // SLOT_ROWS, dim // block_cols,
                                            SLOT_ROWS, block_cols)
    natural[..., row, col] = blocks
    return natural.permute(0, 1, 3, 2, 4).reshape(heads, slots, dim)


def _kernel_rows(t: torch.Tensor, shape) -> torch.Tensor | None:
    """t viewed as `shape` where the dQ kernel can write it (unit last stride, the others
    multiples of 8 elements, 16-byte aligned), else None."""
    try:
        rows = t.view(shape)
    except RuntimeError:
        return None
    if rows.stride(-1) != 1 or any(s % 8 for s in rows.stride()[:-1]) or rows.data_ptr() % 16:
        return None
    return rows


def _row_splits(num_ctas: int, max_query_tiles: int, device) -> int:
    """`split_rows`: CTAs per KV tile so that the grid fills the GPU about twice (compressed
    keys at 16K: 2 KV tiles x 8 KV heads = 16 CTAs otherwise), at most one per query tile."""
    wanted = 2 * _sm_count(device)
    return max(1, min(-(-wanted // max(num_ctas, 1)), max_query_tiles))


# `BwdSpec.row_bands`: float32 dQ accumulator bytes of one band of rows (all heads): the CTAs
# running together add into about one band, so L2 (50 MiB on the H100) should hold it.
ROW_BAND_BYTES = 16 << 20


def _row_bands(max_seqlen_q: int, num_heads: int, head_dim: int, tile_m: int) -> int:
    """`row_bands`: the bands each sequence's query steps are cut into, so that a band of the
    longest sequence holds about ROW_BAND_BYTES of the dQ accumulator (at least one step)."""
    rows = max(ROW_BAND_BYTES // (num_heads * head_dim * 4) // tile_m, 1) * tile_m
    return max(-(-max_seqlen_q // rows), 1)


def list_chunk(csr, spec) -> int:
    """List entries per work unit of `split_lists`. With the dQ kernel beside it: LIST_CHUNK,
    which bounds NSA's block 0 (listed by every query tile). With the fused dQ: twice the mean
    list (from the capacity, a host bound), at least LIST_CHUNK, so that lists of even length
    stay whole: each chunk more re-reads K and V and adds float32 dK/dV partials (random 25%
    lists per query head, 128-key blocks, H200: 97.7 ms in chunks of 16, 85.4 whole, at 64K)."""
    if not spec.fuses_dq:
        return LIST_CHUNK
    lists = max(csr.offsets.numel() - 1, 1)
    return max(LIST_CHUNK, 2 * -(-csr.index.numel() // lists))


def work_units(csr, chunk: int, head_major: bool = False) -> torch.Tensor:
    """(U, 5) int32 work units of `split_lists`: (sequence, KV block in it, list head, first
    entry, end entry), each list cut into chunks of at most `chunk` entries, in CSR order (KV
    block by KV block) or, `head_major`, list head by list head. U is bounded from shapes
    (lists + capacity / chunk), so nothing is read back from the device; units past the real
    ones are empty (first = end) and their CTAs exit at once. Empty lists get no unit (their
    keys' dK/dV stay 0 in the zeroed accumulators).

    `run` takes them head-major by default (`head_major_units`): with the fused dQ the CTAs running
    together then add into one head's float32 dQ accumulator (32 MiB at 64K, D=128), which L2
    holds, not into every head's at random query tiles (random 25% lists, H200: 128.8 ms KV
    block by KV block, 97.7 head by head, chunks of 16, 64K); beside the dQ kernel they read
    one KV group's Q and dO."""
    # One launch (kernels/sm90/list_layout.py) instead of ~37 ops; its int32 unit and entry
    # arithmetic needs the entries plus a chunk below 2**31.
    if csr.offsets.is_cuda and csr.index.numel() + chunk < 2**31 - 1:
        from kernels.sm90 import list_layout

        return list_layout.work_units(csr, chunk, head_major)
    return work_units_torch(csr, chunk, head_major)


def work_units_torch(csr, chunk: int, head_major: bool = False) -> torch.Tensor:
    """`work_units` in torch ops (the CPU, and the GPU kernel's reference in the tests)."""
    offsets = csr.offsets.to(torch.int64)
    num_lists = offsets.numel() - 1
    if num_lists == 0:  # nothing listed: every unit empty
        return torch.zeros(csr.index.numel() // chunk, 5, dtype=torch.int32,
                           device=offsets.device)
    # order[i]: the list (CSR group) taken i-th.
    order = torch.arange(num_lists, device=offsets.device)
    if head_major:
        order = order.view(-1, csr.num_heads).t().reshape(-1)
    lengths = (offsets[1:] - offsets[:-1])[order]
    chunks = (lengths + chunk - 1) // chunk
    ends = chunks.cumsum(0)
    unit = torch.arange(num_lists + csr.index.numel() // chunk, device=offsets.device)
    taken = torch.searchsorted(ends, unit, right=True)
    real = taken < num_lists
    taken = taken.clamp(max=num_lists - 1)
    owner = order[taken]
    first = offsets[owner] + (unit - (ends[taken] - chunks[taken])) * chunk
    end = torch.minimum(first + chunk, offsets[owner + 1])
    first, end = torch.where(real, first, 0), torch.where(real, end, 0)
    kv_row, list_head = owner // csr.num_heads, owner % csr.num_heads
    block_offsets = csr.row_block_offsets.to(torch.int64)
    sequence = torch.searchsorted(block_offsets[1:], kv_row, right=True)
    sequence = sequence.clamp(max=block_offsets.numel() - 2)
    return torch.stack([sequence, kv_row - block_offsets[sequence], list_head, first, end],
                       dim=1).to(torch.int32).contiguous()


def _as_cute(t: torch.Tensor | None, tvm_ffi: bool = False):
    """`as_cute`, with tensors of two or more modes 16-byte aligned (TMA reads the float32 lse
    and dO.O; q, k, v and dO are checked or copied so), int32 vectors 4-byte."""
    return as_cute(t, tvm_ffi, None if t is None else 16 if t.dim() > 1 else 4)


def _typed_scalars(scalars):
    import cutlass

    num_kv_tiles, row_splits, scale, compress_factor, left, right = scalars
    return (cutlass.Int32(num_kv_tiles), cutlass.Int32(row_splits), cutlass.Float32(scale),
            cutlass.Int32(compress_factor), cutlass.Int32(left), cutlass.Int32(right))


def _launch(spec, tensors, scalars, optional):
    from kernels.sm90.compile import compiled_backward

    launch_compiled(compiled_backward, spec, tensors, scalars, _typed_scalars, optional,
                    as_cute_view=_as_cute)


def _typed_dq_scalars(scalars):
    import cutlass

    num_m_blocks, scale, compress_factor, left, right = scalars
    return (cutlass.Int32(num_m_blocks), cutlass.Float32(scale), cutlass.Int32(compress_factor),
            cutlass.Int32(left), cutlass.Int32(right))


def _launch_dq(spec, tensors, scalars, forward_lists):
    from kernels.sm90.compile import compiled_dq

    launch_compiled(compiled_dq, spec, tensors, scalars, _typed_dq_scalars, forward_lists,
                    as_cute_view=_as_cute)


def _launch_dq_convert(dq_acc, tile_offsets, cu_seqlens, dq, block_cols: int, scale: float,
                       accumulate: bool):
    import cutlass

    from kernels.sm90.compile import compiled_dq_convert
    from kernels.sm90.dq_convert import DqConvertSpec

    spec = DqConvertSpec(str(dq.dtype).removeprefix("torch."), dq.shape[-1], block_cols,
                         accumulate)
    launch_compiled(compiled_dq_convert, spec, (dq_acc, tile_offsets, cu_seqlens, dq), (scale,),
                    lambda scalars: (cutlass.Float32(scalars[0]),), (), as_cute_view=_as_cute)


def _launch_gate_fold(dout_dot_out, lse, gates, index, slot, lse_log2, dpsum):
    from kernels.sm90.bwd_preprocess import GateFoldedStatistics, GateFoldSpec
    from kernels.sm90.compile import fake_gate_fold_arguments

    # (T, H) row dots as the kernel reads them, (H, T), of any strides: nsa() passes a column
    # of its gate gradients (T, H, 3) or the transpose of the (H, T) tensor a recomputing
    # forward wrote, both views.
    dots = dout_dot_out.t().float()
    launch_on_current_stream(GateFoldedStatistics, GateFoldSpec(), fake_gate_fold_arguments,
                             (dots, lse.float().contiguous(), gates, index, slot, lse_log2,
                              dpsum), lse.device)


def _launch_preprocess(dout, out, lse, slot, lse_log2, dpsum):
    from kernels.sm90.bwd_preprocess import PreprocessSpec
    from kernels.sm90.compile import compiled_preprocess

    def as_vectors(t, tvm_ffi=False):  # 16-byte vectors from O and dO, scalars elsewhere
        return as_cute(t, tvm_ffi, 16 if t.dim() == 3 else 4)

    spec = PreprocessSpec(str(dout.dtype).removeprefix("torch."), dout.shape[-1])
    launch_compiled(compiled_preprocess, spec, (out, dout, lse.float().contiguous(), slot,
                                                lse_log2, dpsum),
                    (), lambda scalars: (), (), as_cute_view=as_vectors)
