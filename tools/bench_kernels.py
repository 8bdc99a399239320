"""Time our sm90 forward and backward kernels against FA4 (flash-attn-4) in the same run.

Cases (bf16, B=1, D=128, H=32, Hkv=8 by default): dense causal; block-sparse with random lists of
25% and 5% of the 128x128 KV blocks per q tile (128x64 for head dims over 128, without FA4)
(non-causal, all blocks "full", the same lists for both kernels); the same fractions of keys in
64-key blocks (ours only: FA4's SM90 kernels take KV blocks of their tile_n, 128 at D=128; the
summary gives their TFLOP/s as a share of ours at 128-key blocks); causal sliding window 512;
compress_factor 64 over N/64 compressed keys (no FA4 equivalent: compared with our own dense
causal figure); packed causal 256-token sequences.

Passes (`--passes fwd,bwd`, default both):
  fwd      the forward kernel alone (ours: `kernels.sm90.forward.run`; FA4: `flash_attn_func`).
  bwd      the backward given the forward's out and lse. Ours: `attention_backward` through its
           trusted entry (`kernels.interface.attention_backward_trusted`: the same dispatch and
           checks without device reads, as nsa() calls it), with the block-sparse lists'
           transpose (`sparsity.transpose_block_sparse_csr`) built once outside the timing.
           FA4: its `_flash_attn_bwd` with the transposed lists (`block_sparse_tensors` of the
           backward, KV block -> q tiles). Also forward+backward: ours the forward kernel then
           the backward; FA4 `flash_attn_func(..., block_sparse_tensors_bwd=...)` and
           `torch.autograd.grad`.
Our backward is timed only where `kernels.which_backend(..., backward=True)` says "sm90" (else
stderr and the row's "notes" in the JSON say why); it never times the torch fallback.

TFLOP/s count only the attended pairs: 4 * D flops per pair and head forward, 2.5x that for the
backward, 3.5x for forward+backward. Speed ratios are FA4 time / our time (above 1: ours is
faster). CUDA-event timings of the device work alone (a spin kernel queued ahead of each start
event hides the host's launch overhead, which is the same for both kernels' callers but not
kernel time), after warm-up; every function of a case (ours and FA4, each pass) is timed round
by round in a shuffled order and reports the median of its per-round medians. Inputs are random
normal, never zeros. Prints the forward and backward tables, then a short table of the ratios
last; writes JSON (`--json`: the rows, with the forward's fields as before and the backward's
added).

    python tools/bench_kernels.py --seqlens 16384 65536 --json out.json
    python tools/bench_kernels.py --passes bwd --seqlens 16384        # backward rows only
"""
from __future__ import annotations

import argparse
import inspect
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, also when loaded by tests

import _common  # noqa: E402

PASSES = ("fwd", "bwd")
# The timed functions of a case, by kernel and pass ("fwd+bwd" comes with "bwd").
TIMED = [(kernel, pass_) for pass_ in ("fwd", "bwd", "fwd+bwd") for kernel in ("ours", "fa4")]
BACKWARD_FLOPS = 2.5  # the backward's flops per forward flop (the usual flash-attention count)


def random_block_lists(num_rows: int, num_heads: int, num_blocks: int, density: float, seed: int):
    """(count (H, R), index (H, R, K)) with exactly round(density * num_blocks) sorted blocks."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k = max(1, round(density * num_blocks))
    scores = torch.rand(num_heads, num_rows, num_blocks, generator=gen, device="cuda")
    index = scores.topk(k, dim=-1).indices.sort(dim=-1).values.to(torch.int32)
    count = torch.full((num_heads, num_rows), k, dtype=torch.int32, device="cuda")
    return count, index


def transposed_block_lists(count: torch.Tensor, index: torch.Tensor,
                           num_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The transpose of per-head lists: for (count (H, R), index (H, R, K)) listing column blocks
    per row block, (count (H, C), index (H, C, W)) listing, per column block, the rows that list
    it, ascending, padded with 0 to the longest list W (FA4 reads only the first count entries).
    Through a dense (H, R, C) table: fine at benchmark sizes (FA4 needs these lists; ours are
    built by `sparsity.transpose_block_sparse_csr`)."""
    heads, rows, width = index.shape
    listed = torch.arange(width, device=index.device) < count[..., None]
    table = torch.zeros(heads, rows, num_cols + 1, dtype=torch.bool, device=index.device)
    # Unlisted slots scatter into a spare last column, dropped below.
    table.scatter_(2, torch.where(listed, index.long(), num_cols), True)
    return _common.table_lists(table[..., :num_cols].transpose(1, 2))  # (H, C, R)


def block_sparse_case(n: int, heads: int, density: float, block_n: int = 128):
    """Random lists of `density` of the block_n-key KV blocks per 128-row query tile and head
    (all "full", no mask), as our BlockSparseTensors and as FA4's (None without FA4 or for
    block_n other than 128), and the attended pairs per head."""
    ours_lists, fa4_lists, _, pairs = block_sparse_case_with_backward(n, heads, density, block_n)
    return ours_lists, fa4_lists, pairs


def block_sparse_case_with_backward(n: int, heads: int, density: float, block_n: int = 128):
    """`block_sparse_case`, plus FA4's backward lists (the transpose: per KV block and head, the
    q tiles listing it; None where FA4's forward lists are None):
    (ours, fa4 forward, fa4 backward, attended pairs per head)."""
    from sparsity import BlockSparseTensors

    num_rows, num_blocks = n // 128, n // block_n
    count, index = random_block_lists(num_rows, heads, num_blocks, density, seed=1)
    ours_lists = BlockSparseTensors(
        full_count=count.transpose(0, 1).contiguous(),
        full_index=index.transpose(0, 1).contiguous(),
        mask_count=torch.zeros_like(count).transpose(0, 1).contiguous(),
        mask_index=torch.full((num_rows, heads, 1), -1, dtype=torch.int32, device="cuda"),
        row_block_size=128, col_block_size=block_n,
        row_block_offsets=torch.tensor([0, num_rows], dtype=torch.int32, device="cuda"),
    )
    fa4_lists = fa4_backward_lists = None
    try:
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

        if block_n == 128:
            fa4_lists = BlockSparseTensorsTorch(
                mask_block_cnt=torch.zeros_like(count)[None],
                mask_block_idx=torch.zeros_like(index)[None],
                full_block_cnt=count[None], full_block_idx=index[None], block_size=(128, 128))
            t_count, t_index = transposed_block_lists(count, index, num_blocks)
            fa4_backward_lists = BlockSparseTensorsTorch(
                mask_block_cnt=torch.zeros_like(t_count)[None],
                mask_block_idx=torch.zeros_like(t_index)[None],
                full_block_cnt=t_count[None], full_block_idx=t_index[None],
                block_size=(128, 128))
    except Exception as error:  # no FA4, or its block-sparse API differs between releases
        print(f"FA4 block-sparse unavailable: {error!r}", file=sys.stderr)
    return ours_lists, fa4_lists, fa4_backward_lists, count.sum().item() / heads * 128 * block_n


def ours(q, k, v, **kwargs):
    from kernels.sm90.forward import run

    return lambda: run(q, k, v, **kwargs)


def fa4(q, k, v, **kwargs):
    try:
        from flash_attn.cute.interface import flash_attn_func
    except ImportError:
        return None
    return lambda: flash_attn_func(q, k, v, **kwargs)


def fa4_varlen(q, k, v, **kwargs):
    try:
        from flash_attn.cute.interface import flash_attn_varlen_func
    except ImportError:
        return None
    return lambda: flash_attn_varlen_func(q, k, v, **kwargs)


# ----------------------------------------------------------------------------------------------
# The backward: our call and FA4's, each given its own forward's out and lse
# ----------------------------------------------------------------------------------------------

def ours_backward(q, k, v, dout, **kwargs) -> tuple[dict[str, Callable], str]:
    """({"bwd": backward, "fwd+bwd": forward then backward}, backend) on packed (T, heads, D)
    inputs, `kwargs` those of attention_forward with cu_seqlens_q/k (tensors) and max_seqlen_q/k.

    The backward is `attention_backward_trusted` (the sequence bounds read here, once), on the
    out and lse of one forward run; block-sparse calls get the transposed lists built here.
    Empty dict when our backward would not run on the sm90 kernel; backend says why."""
    import kernels
    from kernels.interface import attention_backward_trusted
    from kernels.sm90.forward import run as forward_run

    backward_kwargs = dict(kwargs)
    if kwargs.get("block_sparse") is not None:
        from sparsity import transpose_block_sparse_csr

        backward_kwargs["block_sparse_transposed"] = transpose_block_sparse_csr(
            kwargs["block_sparse"], cu_seqlens_k=kwargs["cu_seqlens_k"])
    backend = kernels.which_backend(q, k, v, backward=True, **backward_kwargs)
    if backend != "sm90":
        return {}, backend
    host_cu_seqlens = (tuple(kwargs["cu_seqlens_q"].tolist()),
                       tuple(kwargs["cu_seqlens_k"].tolist()))
    out, lse = forward_run(q, k, v, **kwargs)

    def backward(out=out, lse=lse):
        return attention_backward_trusted(dout, q, k, v, out, lse,
                                          host_cu_seqlens=host_cu_seqlens, **backward_kwargs)

    def forward_backward():
        return backward(*forward_run(q, k, v, **kwargs))

    return {"bwd": backward, "fwd+bwd": forward_backward}, backend


def fa4_backward(q, k, v, dout, *, varlen: bool = False, backward_lists=None,
                 **kwargs) -> dict[str, Callable]:
    """{"bwd": FA4's backward on its forward's out and lse, "fwd+bwd": its autograd}, or {}
    without FA4. `kwargs` are those of FA4's flash_attn_func (flash_attn_varlen_func with
    `varlen`); `backward_lists` its transposed block-sparse lists (BlockSparseTensorsTorch)."""
    try:
        from flash_attn.cute import interface as fa4_interface
    except ImportError:
        return {}
    forward_fn = (fa4_interface.flash_attn_varlen_func if varlen
                  else fa4_interface.flash_attn_func)
    fns = {}
    try:
        out, lse = forward_fn(q, k, v, return_lse=True, **kwargs)[:2]
        window = kwargs.get("window_size", (None, None))
        backward_kwargs = dict(softmax_scale=kwargs.get("softmax_scale"),
                               causal=kwargs.get("causal", False),
                               window_size_left=window[0], window_size_right=window[1],
                               block_sparse_tensors=backward_lists)
        if varlen:
            backward_kwargs.update({name: kwargs[name] for name in (
                "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")})
        fns["bwd"] = lambda: fa4_interface._flash_attn_bwd(q, k, v, out, dout, lse,
                                                           **backward_kwargs)
    except Exception as error:  # a private function: its arguments change between releases
        print(f"FA4 backward (_flash_attn_bwd) unavailable: {error!r}", file=sys.stderr)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    autograd_kwargs = dict(kwargs)
    if backward_lists is not None:
        if "block_sparse_tensors_bwd" not in inspect.signature(forward_fn).parameters:
            print("FA4 forward+backward: this release takes no block_sparse_tensors_bwd",
                  file=sys.stderr)
            return fns
        autograd_kwargs["block_sparse_tensors_bwd"] = backward_lists

    def forward_backward():
        out = forward_fn(*leaves, **autograd_kwargs)
        out = out[0] if isinstance(out, tuple) else out  # some releases also return the lse
        return torch.autograd.grad(out, leaves, dout)

    fns["fwd+bwd"] = forward_backward
    return fns


# The compressed case's attention shape as dense attention that FA4 computes too: N / 256
# packed causal sequences of 256 tokens. Each 128-row query tile sees one or two KV tiles, the
# pairs are within 1% of compress_factor 64's and Q and O are the same bytes (K and V add 25% at
# Hkv = 8). It anchors the compressed target: how near its own dense figure does the best dense
# kernel get on that shape?
PACKED_CASE = "causal, 256-token seqs"
PACKED_LENGTH = 256
COPY_CASE = "Q -> O copy (floor)"
SPARSE_64_SUFFIX = " (64-key)"


@dataclass
class Case:
    """One row: its attended pairs and the functions to time, built only when the row is timed
    (each holds its own out, lse and lists)."""

    name: str
    pairs: float
    build: Callable[[], dict[tuple[str, str], Callable]]  # (kernel, pass) -> function
    notes: list[str] = field(default_factory=list)


def bench_seqlen(n: int, heads: int, heads_kv: int, dim: int, reps: int, rounds: int,
                 passes=PASSES, only: list[str] | None = None) -> list[dict]:
    """One row per case. Every timed function of a case (ours and FA4, forward, backward,
    forward+backward) is timed interleaved (`_common.interleaved_medians`): each round takes
    them all in a shuffled order, so drift in clocks or power during the run reaches all.
    `only`: time the cases whose names contain one of these strings (default: all)."""
    torch.manual_seed(0)
    q = torch.randn(1, n, heads, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, n, heads_kv, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    scale = dim ** -0.5
    base = dict(max_seqlen_q=n, max_seqlen_k=n, softmax_scale=scale)
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    packed = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n, max_seqlen_k=n,
                  softmax_scale=scale)
    backward = "bwd" in passes

    def case(name, pairs, ours_fwd, fa4_fwd=None, ours_kwargs=None, fa4_kwargs=None,
             tensors=(q, k, v, dout), fa4_packed=False) -> Case:
        """A row: the forward functions as given; the backward ones (when timed) built from our
        attention kwargs on the packed tensors and from FA4's flash_attn_func kwargs
        (flash_attn_varlen_func's on packed tensors with fa4_packed; None: no FA4 counterpart).
        """
        row = Case(name, pairs, build=None)
        packed_tensors = tuple(t[0] for t in tensors)  # (1, N, heads, D) -> (N, heads, D)

        def build():
            fns = {}
            if "fwd" in passes:
                fns[("ours", "fwd")] = ours_fwd
                if fa4_fwd is not None:
                    fns[("fa4", "fwd")] = fa4_fwd
            if backward and ours_kwargs is not None:
                ours_fns, backend = ours_backward(*packed_tensors, **ours_kwargs)
                if backend != "sm90":
                    row.notes.append(f"our backward not timed: {backend}")
                fns.update({("ours", p): fn for p, fn in ours_fns.items()})
            if backward and fa4_kwargs is not None:
                fa4_fns = fa4_backward(*(packed_tensors if fa4_packed else tensors),
                                       varlen=fa4_packed, **fa4_kwargs)
                fns.update({("fa4", p): fn for p, fn in fa4_fns.items()})
            return fns

        row.build = build
        return row

    cases = [case("dense causal", _common.causal_pairs(n), ours(q, k, v, causal=True, **base),
                  fa4(q, k, v, causal=True), dict(packed, causal=True), dict(causal=True))]
    # Wide heads (192, 256) take 64-key blocks only (128-key tiles overflow shared memory):
    # their block-sparse rows have no FA4 counterpart. At 128 and below, rows with 64-key
    # blocks and the same fraction of the keys follow the 128-key ones (ours only: FA4's SM90
    # kernels take KV blocks of their tile_n, 128 there).
    for block_n in ([128, 64] if dim <= 128 else [64]):
        for density in (0.25, 0.05):
            bs, fa4_bs, fa4_bs_bwd, pairs = block_sparse_case_with_backward(n, heads, density,
                                                                            block_n)
            suffix = "" if block_n == 128 else SPARSE_64_SUFFIX
            cases.append(case(
                f"block-sparse {int(density * 100)}%{suffix}", pairs,
                ours(q, k, v, causal=False, block_sparse=bs, **base),
                fa4(q, k, v, causal=False, block_sparse_tensors=fa4_bs)
                if fa4_bs is not None else None,
                dict(packed, causal=False, block_sparse=bs),
                dict(causal=False, block_sparse_tensors=fa4_bs, backward_lists=fa4_bs_bwd)
                if fa4_bs is not None else None))
    window = 512
    cases.append(case("causal window 512", _common.capped_causal_pairs(n, window),
                      ours(q, k, v, causal=True, window_size=(window - 1, 0), **base),
                      fa4(q, k, v, causal=True, window_size=(window - 1, 0)),
                      dict(packed, causal=True, window_size=(window - 1, 0)),
                      dict(causal=True, window_size=(window - 1, 0))))
    cf = 64
    kc = torch.randn(1, n // cf, heads_kv, dim, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    pairs = _common.compressed_pairs(n, cf)
    cu_cmp = torch.tensor([0, n // cf], dtype=torch.int32, device="cuda")
    cases.append(case("compress_factor 64", pairs,
                      ours(q, kc, vc, causal=True, compress_factor=cf, max_seqlen_q=n,
                           max_seqlen_k=n // cf, softmax_scale=scale),
                      ours_kwargs=dict(packed, cu_seqlens_k=cu_cmp, max_seqlen_k=n // cf,
                                       causal=True, compress_factor=cf),
                      tensors=(q, kc, vc, dout)))
    if n % PACKED_LENGTH == 0:
        cu_packed = torch.arange(0, n + 1, PACKED_LENGTH, dtype=torch.int32, device="cuda")
        seqs = dict(cu_seqlens_q=cu_packed, cu_seqlens_k=cu_packed, max_seqlen_q=PACKED_LENGTH,
                    max_seqlen_k=PACKED_LENGTH, softmax_scale=scale, causal=True)
        cases.append(case(PACKED_CASE, n // PACKED_LENGTH * _common.causal_pairs(PACKED_LENGTH),
                          ours(q[0], k[0], v[0], **seqs), fa4_varlen(q[0], k[0], v[0], **seqs),
                          seqs, seqs, fa4_packed=True))
    # The compressed case's memory floor: its kernel must read Q and write O, the same bytes
    # as this device copy (K, V and lse add 2%). The row's TFLOP/s is what the compressed case
    # would reach in the copy's time: no kernel of that shape gets much past it.
    if "fwd" in passes:
        out = torch.empty_like(q)
        cases.append(case(COPY_CASE, pairs, lambda: out.copy_(q)))

    device = torch.device("cuda")
    rows = []
    for row_case in cases:
        if only and not any(part in row_case.name for part in only):
            continue
        fns = row_case.build()
        timed = {f"{kernel} {pass_}": fn for (kernel, pass_), fn in fns.items()}
        medians = _common.interleaved_medians(timed, device, rounds=rounds, repeats=reps)
        del fns, timed
        torch.cuda.empty_cache()
        rows.append(make_row(n, row_case.name, row_case.pairs, heads, dim, medians,
                             row_case.notes))
        for note in row_case.notes:
            print(f"N={n} {row_case.name}: {note}", file=sys.stderr)
    return rows


def make_row(n: int, case: str, pairs: float, heads: int, dim: int, medians: dict[str, float],
             notes=()) -> dict:
    """The JSON row of a case from its medians ("ours fwd", "fa4 bwd", ...; missing = not
    timed). Forward fields keep their names (ours_ms, fa4_ms, ours_tflops, fa4_tflops, ratio);
    backward ones are ours_bwd_ms, ..., bwd_ratio and ours_fwdbwd_ms, ..., fwdbwd_ratio.
    Ratios are FA4 ms / our ms."""
    flops_per_pass = {"fwd": 1.0, "bwd": BACKWARD_FLOPS, "fwd+bwd": 1.0 + BACKWARD_FLOPS}
    row = dict(seqlen=n, case=case)
    for pass_, prefix in (("fwd", ""), ("bwd", "bwd_"), ("fwd+bwd", "fwdbwd_")):
        for kernel in ("ours", "fa4"):
            ms = medians.get(f"{kernel} {pass_}")
            row[f"{kernel}_{prefix}ms"] = ms
            row[f"{kernel}_{prefix}tflops"] = None if ms is None else (
                flops_per_pass[pass_] * _common.attention_tflops(pairs, 1, heads, dim, ms,
                                                                 backward=False))
        ours_ms, fa4_ms = row[f"ours_{prefix}ms"], row[f"fa4_{prefix}ms"]
        row[f"{prefix}ratio"] = fa4_ms / ours_ms if ours_ms and fa4_ms else None
    if notes:
        row["notes"] = list(notes)
    return row


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------

def summary(rows: list[dict]) -> list[str]:
    """compress_factor 64 (and the copy floor) as a share of our dense causal TFLOP/s, per N:
    issue 3's target for it is 50%. The packed 256-token row, its shape as dense attention,
    as a share of each kernel's own dense causal figure."""
    lines = []
    for n in sorted({r["seqlen"] for r in rows}):
        at_n = {r["case"]: r for r in rows if r["seqlen"] == n}
        dense = at_n.get("dense causal", {})
        if not dense.get("ours_tflops"):
            continue
        shares = [f"{case} {at_n[case]['ours_tflops'] / dense['ours_tflops']:.0%}"
                  for case in ("compress_factor 64", COPY_CASE)
                  if at_n.get(case, {}).get("ours_tflops")]
        packed = at_n.get(PACKED_CASE, {})
        for kernel in ("ours", "fa4"):
            key = f"{kernel}_tflops"
            if packed.get(key) and dense.get(key):
                shares.append(f"{PACKED_CASE} ({kernel}, of its own dense) "
                              f"{packed[key] / dense[key]:.0%}")
        lines.append(f"N={n}: of our dense causal TFLOP/s: " + ", ".join(shares))
    return lines


def sparse_block_shares(rows: list[dict]) -> list[str]:
    """Our block-sparse rows at 64-key blocks as a share of ours at 128-key blocks (same key
    fraction), forward and backward effective TFLOP/s: what smaller selection blocks cost."""
    lines = []
    for n in sorted({r["seqlen"] for r in rows}):
        at_n = {r["case"]: r for r in rows if r["seqlen"] == n}
        shares = []
        for case, row in at_n.items():
            if not case.endswith(SPARSE_64_SUFFIX):
                continue
            reference = at_n.get(case[:-len(SPARSE_64_SUFFIX)], {})
            for pass_, key in (("fwd", "ours_tflops"), ("bwd", "ours_bwd_tflops")):
                if row.get(key) and reference.get(key):
                    share = row[key] / reference[key]
                    row[f"{key}_share_of_128key"] = share
                    shares.append(f"{case[:-len(SPARSE_64_SUFFIX)]} {pass_} {share:.0%}")
        if shares:
            lines.append(f"N={n}: ours at 64-key blocks, of ours at 128-key blocks (TFLOP/s): "
                         + ", ".join(shares))
    return lines


def _fmt(x, digits):
    return f"{x:.{digits}f}" if x is not None else "-"


def forward_table(rows: list[dict]) -> list[str]:
    lines = [f"{'N':>7} {'case':<26} {'ours ms':>9} {'TFLOP/s':>8} {'FA4 ms':>9} "
             f"{'TFLOP/s':>8} {'FA4/ours':>8}"]
    for r in rows:
        if r["ours_ms"] is None and r["fa4_ms"] is None:
            continue
        lines.append(f"{r['seqlen']:>7} {r['case']:<26} {_fmt(r['ours_ms'], 3):>9} "
                     f"{_fmt(r['ours_tflops'], 0):>8} {_fmt(r['fa4_ms'], 3):>9} "
                     f"{_fmt(r['fa4_tflops'], 0):>8} {_fmt(r['ratio'], 2):>8}")
    return lines


def backward_table(rows: list[dict]) -> list[str]:
    """Backward (given the forward's out, lse) and forward+backward, ours and FA4."""
    lines = [f"{'N':>7} {'case':<26} {'ours bwd':>9} {'TFLOP/s':>8} {'FA4 bwd':>9} "
             f"{'TFLOP/s':>8} {'FA4/ours':>8} | {'ours f+b':>9} {'FA4 f+b':>9} "
             f"{'FA4/ours':>8}"]
    for r in rows:
        if all(r.get(key) is None for key in ("ours_bwd_ms", "fa4_bwd_ms", "ours_fwdbwd_ms",
                                              "fa4_fwdbwd_ms")):
            continue
        lines.append(f"{r['seqlen']:>7} {r['case']:<26} {_fmt(r['ours_bwd_ms'], 3):>9} "
                     f"{_fmt(r['ours_bwd_tflops'], 0):>8} {_fmt(r['fa4_bwd_ms'], 3):>9} "
                     f"{_fmt(r['fa4_bwd_tflops'], 0):>8} {_fmt(r['bwd_ratio'], 2):>8} | "
                     f"{_fmt(r['ours_fwdbwd_ms'], 3):>9} {_fmt(r['fa4_fwdbwd_ms'], 3):>9} "
                     f"{_fmt(r['fwdbwd_ratio'], 2):>8}")
    return lines


def ratio_table(rows: list[dict]) -> list[str]:
    """The short table printed last: speed ratios FA4 / ours per pass (above 1: ours faster),
    and our backward's TFLOP/s."""
    lines = [f"{'N':>7} {'case':<26} {'fwd':>6} {'bwd':>6} {'f+b':>6} {'ours bwd TFLOP/s':>17}"]
    for r in rows:
        if r["case"] == COPY_CASE:
            continue
        lines.append(f"{r['seqlen']:>7} {r['case']:<26} {_fmt(r.get('ratio'), 2):>6} "
                     f"{_fmt(r.get('bwd_ratio'), 2):>6} {_fmt(r.get('fwdbwd_ratio'), 2):>6} "
                     f"{_fmt(r.get('ours_bwd_tflops'), 0):>17}")
    return lines


def parse_passes(text: str) -> list[str]:
    passes = [p.strip() for p in text.split(",") if p.strip()]
    if not passes or set(passes) - set(PASSES):
        raise argparse.ArgumentTypeError(f"expected a subset of {','.join(PASSES)}, got {text!r}")
    return [p for p in PASSES if p in passes]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_kernel_shape_arguments(parser)
    parser.add_argument("--passes", type=parse_passes, default=list(PASSES),
                        help="comma-separated subset of fwd,bwd (default: both; bwd also times "
                             "forward+backward)")
    parser.add_argument("--reps", type=_common.positive_int, default=10,
                        help="timed calls per round (default 10)")
    parser.add_argument("--rounds", type=_common.positive_int, default=5,
                        help="rounds, each timing ours and FA4 in a shuffled order (default 5)")
    parser.add_argument("--cases", nargs="+", metavar="TEXT",
                        help="time only the cases whose names contain one of these strings "
                             "(for example 'compress' 'block-sparse 25%%'; default: all)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (sm_90)")
    return args


def main(argv=None):
    args = parse_args(argv)
    rows = []
    for n in args.seqlens:
        rows += bench_seqlen(n, args.heads, args.heads_kv, args.head_dim, args.reps,
                             args.rounds, args.passes, args.cases)
    device = torch.cuda.get_device_name()
    print(f"\n{device}, bf16, B=1, H={args.heads}, Hkv={args.heads_kv}, D={args.head_dim}, "
          f"medians of {args.rounds} rounds x {args.reps} calls, ours and FA4 interleaved")
    if "fwd" in args.passes:
        print("\nforward")
        print("\n".join(forward_table(rows)))
        for line in summary(rows):
            print(line)
    if "bwd" in args.passes:
        print("\nbackward (on the forward's out and lse) and forward+backward; TFLOP/s over "
              f"attended pairs, backward = {BACKWARD_FLOPS}x the forward's flops")
        print("\n".join(backward_table(rows)))
    for line in sparse_block_shares(rows):
        print(line)
    print("\nspeed ratios FA4 / ours (above 1: ours faster)")
    print("\n".join(ratio_table(rows)))
    if args.json:
        args.json.write_text(json.dumps(dict(device=device, passes=args.passes, rows=rows),
                                        indent=1))


if __name__ == "__main__":
    main()
