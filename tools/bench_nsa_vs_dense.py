"""Benchmark NSA forward and forward+backward against dense causal attention.

Methods, each timed where it can run (a method that cannot is listed with the reason):
  nsa          nsa.nsa (ours: CuTe DSL kernels on sm_90, the PyTorch fallback elsewhere),
               eager: where nsa()'s captured plans apply (`--capture`, nsa/captured.py; by
               default up to 16K tokens at H=32) the timed calls replay them
  nsa-graph    the same nsa() call captured in a CUDA graph (torch.cuda.graph) and replayed:
               the forward alone and forward+backward are each one capture (CUDA only; padded
               inputs need no host bounds and packed ones pass host_cu_seqlens, so nsa() reads
               nothing from the device)
  dense        kernels.flash_attn_func(causal=True) (ours, same dispatch)
  sdpa         torch.nn.functional.scaled_dot_product_attention(is_causal=True, enable_gqa=True)
  fa4          flash_attn.cute.flash_attn_func(causal=True), if flash-attn-4 is installed
               (packed inputs: its flash_attn_varlen_func on the same cu_seqlens)
  fla-nsa      fla.ops.nsa.parallel_nsa, if fla is installed (its NSA: own selection rule,
               group size H/Hkv a power of two >= 16)
  fa4-nsa      the seed's NSA design on FA4's public kernels, if flash-attn-4 is installed
               (tools/_fa4_nsa.py: compressed branch through a mask_mod, top-n blocks of the
               tile's mean query mapped to 128 x 128 block-sparse lists, FA4's window, mean
               gating; forward and backward on FA4)

Inputs: a padded batch of B sequences of N tokens, or with `--num-seqs S` the same B x N tokens
packed into S sequences of random lengths (varlen, the same lengths for every method: nsa()
with `cu_seqlens` and its host copy, our and FA4's varlen attention, fla with `cu_seqlens`;
SDPA and fa4-nsa take padded inputs only and say so). `--branch-profile` is padded.

Packed documents (`--packed`, instead of --seqlens): named workloads of document lengths fixed
by a seed (tools/packed_workloads.py), packed the same way for every method: nsa() eager and in a
CUDA graph with cu_seqlens and host_cu_seqlens, dense FA4 through flash_attn_varlen_func.

  lognormal-2k  64K tokens, log-normal lengths, median 2K, sigma 1, capped at 32K, the last
                trimmed to fill the total (seed 0: 25 documents, the longest 8,031)
  docs-8k       64K tokens, 8 documents of 8K
  docs-1k       16K tokens, 16 documents of 1K
  docs-256      16K tokens, 64 documents of 256
  (any lognormal-<median> or docs-<length> works; `--packed standard` names these four;
  `--total-tokens` sets each workload's total, one value for all or one per workload)

After the main table a packed summary gives per workload and pass: documents, the longest, the
attended-pair ratio (dense causal pairs / NSA's pairs, counted per document: row i attends
min(i+1, n*l') selected, min(i+1, w) window and (i+1)//l compressed keys, with the options
benchmarked), nsa ms, dense ms, the speedup, and its share of the limit, (dense ms / ratio) /
nsa ms, against the target of 70%. The dense column is fa4 where it ran, else our dense.

Timing: `--warmup` untimed calls, then the median of `--repeats` calls, CUDA events on a GPU and
perf_counter on the CPU; inputs are random normal, never zeros. `--rounds R` (R > 1) times the
methods of a case in R interleaved rounds instead of one after another: all are prepared first
(inputs, captures: their memory together), each round times every method (--warmup calls before
its first round, one before each later one) in an order rotated by one a round, and a figure is
the median of its R round medians (the table's "spread": the slowest round's less the fastest's,
over that figure; the JSON keeps each round's as `round_ms`). The GPU's clock drifts under its
power cap, so methods timed one after another may run at different clocks (FINDINGS.md: lines
moved by up to 8% between runs); interleaved they share the drift. TFLOP/s counts the (row, key)
pairs each method attends (dense: the causal triangle; NSA: an upper bound over its three
branches, see _common.nsa_pairs), 4*D flops per pair and head forward, 3.5x that for fwd+bwd.
"host ms" is the median wall time of the same calls until they return, without a sync: where it
comes close to "ms", the eager call is host-bound (Python and launches, not the GPU, set its
pace) and a CUDA graph (`nsa-graph`) is what removes it. `--clocks` adds the GPU's median SM
clock and power while each pass was timed and the share of those samples under the software
power cap (nvidia-smi, every 20 ms; tools/_clocks.py): a GPU at its power cap clocks down
within tens of milliseconds of heavy work, so methods timed in turn may run at different
clocks, and a short profiled burst at a higher one than a timed loop.

`--deterministic` passes deterministic=True to nsa() and to our dense attention (bit-identical
gradients from run to run; the backward's slower mode).

`--branch-profile` also times each NSA branch (compressed, selected, window) alone, forward and
backward, on nsa()'s own inputs: the compressed keys, the block lists its selection builds and
their transpose, built the way nsa.function.NSAFunction builds them (as
tools/profile_nsa_forward.py runs the forward's stages). Each branch's backward runs on its
forward's out and lse with a random dout, as nsa()'s backward calls it; the table gives backward
vs forward time and the backend of each (sm90 or the fallback and why). `--methods none` runs the
branch profile alone.

    python tools/bench_nsa_vs_dense.py --json bench.json            # per-device default sizes
    python tools/bench_nsa_vs_dense.py --seqlens 16384,65536 --heads 64 --kv-heads 4
    python tools/bench_nsa_vs_dense.py --seqlens 65536 --methods none --branch-profile
    python tools/bench_nsa_vs_dense.py --seqlens 65536 --num-seqs 16     # varlen: 16 lengths
    python tools/bench_nsa_vs_dense.py --packed standard --methods nsa,nsa-graph,fa4
    python tools/plot_bench.py bench.json                            # charts

`--context-parallel N` (under `torchrun --nproc-per-node N`) times nsa() across the N ranks
instead, against one GPU's nsa() per length (tools/bench_context_parallel.py runs it; no dense
anchors there):

    torchrun --nproc-per-node 4 tools/bench_nsa_vs_dense.py --context-parallel 4 --seqlens 1048576
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernels  # noqa: E402
from nsa import CMP_KV_BLOCK, SELECTION_Q_TILE, nsa  # noqa: E402
from nsa.compression import compress_pair, compressed_cu_seqlens  # noqa: E402
from nsa.function import (compressed_starts, describe_branches,  # noqa: E402
                          select_for_branches)
from nsa.validation import validate_nsa_call  # noqa: E402
from bench_context_parallel import add_context_parallel_argument, run_for_tool  # noqa: E402
from _clocks import ClockSampler  # noqa: E402
from _common import (CAPTURE_OPTIONS, RECOMPUTE_OPTIONS,  # noqa: E402
                     add_capture_argument, add_cmp_selected_argument, add_num_seqs_argument,
                     add_problem_arguments, add_recompute_argument, add_switch_argument,
                     captured, parse_switches,
                     attention_tflops, capped_causal_pairs, causal_pairs, check_num_seqs,
                     int_list, positive_int,
                     compressed_key_cap, compressed_pairs, cu_seqlens_of, nsa_options, nsa_pairs,
                     problem_defaults_epilog, problem_summary, random_gate, random_qkv,
                     resolve_problem_arguments, time_ms, varlen_lengths,
                     write_results_json)
from packed_workloads import (STANDARD_WORKLOADS, TARGET_SHARE_OF_LIMIT,  # noqa: E402
                              NSAPairRule, PackedWorkload, attended_pair_ratio, build_workload,
                              dense_pairs, nsa_document_pairs, parse_workload_name,
                              share_of_limit)

METHODS = ("nsa", "nsa-graph", "dense", "sdpa", "fa4", "fla-nsa", "fa4-nsa")
OURS = ("nsa", "nsa-graph", "dense")
PASSES = ("fwd", "fwd+bwd")


@dataclass
class Result:
    seqlen: int
    method: str
    pass_: str
    ms: float | None
    tflops: float | None
    speedup: float | None  # baseline ms / this ms, same pass
    status: str            # "ok", or why it did not run
    # Median host time of the timed calls: the Python call's wall time until it returns, no
    # sync (where it approaches ms, the step is host-bound: an eager caller waits on it).
    host_ms: float | None = None
    # The packed workload's name (`--packed`; seqlen is then its total tokens), else None.
    workload: str | None = None
    # With --clocks: the median SM clock (MHz) and power (W) nvidia-smi sampled while this
    # pass's timed calls ran, and the share of those samples with the software power cap
    # holding the clock down; None where no sample fell in them.
    sm_mhz: float | None = None
    watts: float | None = None
    power_capped: float | None = None
    # With --rounds R > 1: each round's median ms, in round order (the figure is their median).
    round_ms: list[float] | None = None


# ----------------------------------------------------------------------------------------------
# The methods: each returns a function run(q, k, v, packing) running one forward, on padded
# (B, N, H, D) tensors (packing None) or on packed varlen (T, H, D) ones (`--num-seqs`: packing
# a `Packing`); a method that takes no varlen input raises RuntimeError there
# ----------------------------------------------------------------------------------------------

@dataclass
class Packing:
    """Packed varlen sequences: lengths, cu_seqlens (int32, on the device), their host copy."""
    lengths: list[int]
    cu_seqlens: torch.Tensor
    host_cu_seqlens: tuple[int, ...]

    @property
    def max_seqlen(self) -> int:
        return max(self.lengths)


def padded_only(name: str, packing) -> None:
    if packing is not None:
        raise RuntimeError(f"{name} takes padded inputs only (no --num-seqs or --packed)")


def nsa_method(args) -> Callable:
    W_gate = random_gate(args.heads, args.head_dim, args.torch_dtype, args.device,
                         requires_grad=True) if args.gate else None
    options = (nsa_options(args) | deterministic_option(args) | RECOMPUTE_OPTIONS[args.recompute]
               | CAPTURE_OPTIONS[args.capture])

    def run(q, k, v, packing=None):
        if packing is None:
            return nsa(q, k, v, W_gate=W_gate, **options)
        # The host bounds: no device read (and none inside a CUDA-graph capture)
        return nsa(q, k, v, W_gate=W_gate, cu_seqlens=packing.cu_seqlens,
                   max_seqlen=packing.max_seqlen, host_cu_seqlens=packing.host_cu_seqlens,
                   **options)
    return run


def nsa_graph_method(args) -> Callable:
    """nsa_method's call, marked for time_method to capture and replay (CUDA only)."""
    if args.device.type != "cuda":
        raise RuntimeError("CUDA graphs need a CUDA device")
    run = nsa_method(args)
    run.cuda_graph = True
    return run


def varlen_kwargs(packing: Packing) -> dict:
    """flash-attention's varlen keywords (ours and FA4's spell them alike)."""
    return dict(cu_seqlens_q=packing.cu_seqlens, cu_seqlens_k=packing.cu_seqlens,
                max_seqlen_q=packing.max_seqlen, max_seqlen_k=packing.max_seqlen)


def dense_method(args) -> Callable:
    options = deterministic_option(args)

    def run(q, k, v, packing=None):
        if packing is None:
            return kernels.flash_attn_func(q, k, v, causal=True, **options)
        return kernels.flash_attn_varlen_func(q, k, v, causal=True, **varlen_kwargs(packing),
                                              **options)
    return run


def deterministic_option(args) -> dict:
    """deterministic=True for our calls with --deterministic; nothing otherwise, so the default
    runs call exactly what a user who never heard of the switch calls."""
    return {"deterministic": True} if args.deterministic else {}


def sdpa_method(args) -> Callable:
    def run(q, k, v, packing=None):
        padded_only("sdpa", packing)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True, enable_gqa=True)
        return out.transpose(1, 2)
    return run


def fa4_method(args) -> Callable:
    if args.device.type != "cuda":
        raise RuntimeError("needs a CUDA GPU")
    flash_attn_cute = importlib.import_module("flash_attn.cute")

    def run(q, k, v, packing=None):
        if packing is None:
            out = flash_attn_cute.flash_attn_func(q, k, v, causal=True)
        else:
            out = flash_attn_cute.flash_attn_varlen_func(q, k, v, causal=True,
                                                         **varlen_kwargs(packing))
        return out[0] if isinstance(out, tuple) else out  # some releases also return the lse
    return run


def fla_nsa_method(args) -> Callable:
    if args.device.type != "cuda":
        raise RuntimeError("needs a CUDA GPU")
    group = args.heads // args.kv_heads
    if group < 16 or group & (group - 1):
        raise RuntimeError(f"fla needs H/Hkv a power of two >= 16, got {group}")
    if args.compress_block_size != args.selected_block_size:
        raise RuntimeError("fla uses one block size for compression and selection")
    parallel_nsa = importlib.import_module("fla.ops.nsa").parallel_nsa

    def run(q, k, v, packing=None):
        extra = {}
        if packing is not None:  # fla's varlen: one batch row of packed tokens
            q, k, v = q[None], k[None], v[None]
            extra = dict(cu_seqlens=packing.cu_seqlens.long())
        # Mean gating like ours without W_gate: each branch weighted 1/3 (no window: 1/2).
        branches = 3 if args.window_size else 2
        gate = torch.full(q.shape[:3], 1.0 / branches, dtype=q.dtype, device=q.device)
        out = parallel_nsa(q, k, v, g_cmp=gate, g_slc=gate,
                           g_swa=gate if args.window_size else None,
                           block_counts=args.num_selected_blocks,
                           block_size=args.selected_block_size, window_size=args.window_size,
                           **extra)
        return out if packing is None else out[0]
    return run


def fa4_nsa_method(args) -> Callable:
    if args.device.type != "cuda":
        raise RuntimeError("needs a CUDA GPU")
    from _fa4_nsa import fa4_nsa_method as build

    padded = build(compress_block_size=args.compress_block_size,
                   selected_block_size=args.selected_block_size,
                   num_selected_blocks=args.num_selected_blocks, window_size=args.window_size)

    def run(q, k, v, packing=None):
        padded_only("fa4-nsa", packing)
        return padded(q, k, v)
    return run


METHOD_FACTORIES = {"nsa": nsa_method, "nsa-graph": nsa_graph_method,
                    "dense": dense_method, "sdpa": sdpa_method,
                    "fa4": fa4_method, "fla-nsa": fla_nsa_method, "fa4-nsa": fa4_nsa_method}


def attended_pairs(method: str, lengths: list[int], args) -> int:
    """(row, key) pairs of all sequences (a padded batch: B sequences of N)."""
    if method in ("nsa", "nsa-graph", "fla-nsa", "fa4-nsa"):
        return sum(nsa_pairs(n, args.compress_block_size, args.selected_block_size,
                             args.num_selected_blocks, args.window_size,
                             args.num_cmp_selected_blocks) for n in lengths)
    return sum(causal_pairs(n) for n in lengths)


def packing_for(seqlen: int, args) -> Packing | None:
    """None for a padded batch; with --num-seqs, batch x seqlen tokens in that many sequences
    of random lengths (the same for every method)."""
    if args.num_seqs is None:
        return None
    lengths = varlen_lengths(args.batch * seqlen, args.num_seqs,
                             torch.Generator().manual_seed(3))
    return packing_of(lengths, args.device)


def packing_of(lengths, device: torch.device) -> Packing:
    """cu_seqlens (int32) on the device and its host copy, taken before any timed call so the
    calls read nothing back."""
    lengths = list(lengths)
    cu_seqlens = cu_seqlens_of(lengths, device)
    return Packing(lengths, cu_seqlens, tuple(cu_seqlens.tolist()))


@dataclass
class Case:
    """One measured input: a padded (or --num-seqs) N, or a packed workload."""
    seqlen: int                        # N, or the workload's total tokens
    packing: Packing | None
    workload: PackedWorkload | None = None


def benchmark_cases(args) -> list[Case]:
    if args.packed:
        return [Case(workload.total_tokens, packing_of(workload.lengths, args.device), workload)
                for workload in args.workloads]
    return [Case(seqlen, packing_for(seqlen, args)) for seqlen in args.seqlens]


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------

def host_timed(fn: Callable[[], object], samples: list[float]) -> Callable[[], object]:
    """fn, appending each call's host wall time (ms, until it returns; no sync) to samples."""
    def timed():
        begin = time.perf_counter()
        result = fn()
        samples.append((time.perf_counter() - begin) * 1e3)
        return result
    return timed


def prepare_method(run: Callable, seqlen: int, args, packing: Packing | None = None
                   ) -> dict[str, Callable[[], object]]:
    """Each pass's call on random inputs (never zeros): "fwd" a forward without autograd (run
    under torch.no_grad by `time_passes`), "fwd+bwd" forward+backward; for nsa-graph each the
    replay of its own capture (made here)."""
    rows = (args.batch, seqlen) if packing is None else (sum(packing.lengths),)
    shape_q = (*rows, args.heads, args.head_dim)
    shape_kv = (*rows, args.kv_heads, args.head_dim)
    q, k, v = random_qkv(shape_q, shape_kv, args.torch_dtype, args.device)
    graph = getattr(run, "cuda_graph", False)
    calls = {}
    if "fwd" in args.passes:
        def forward():
            return run(q, k, v, packing)
        if graph:
            with torch.no_grad():
                forward = captured(forward)
        calls["fwd"] = forward
    if "fwd+bwd" not in args.passes:
        return calls
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    dout = torch.randn(shape_q, generator=torch.Generator().manual_seed(7)).to(
        device=args.device, dtype=args.torch_dtype)

    def forward_backward():
        q.grad = k.grad = v.grad = None
        run(q, k, v, packing).backward(dout)
    calls["fwd+bwd"] = captured(forward_backward) if graph else forward_backward
    return calls


def time_passes(calls: dict[str, Callable[[], object]], args, warmup: int
                ) -> dict[str, tuple[float, float, tuple[float, float]]]:
    """Per pass of `prepare_method`'s calls: (median ms, median host ms, (start, end) in
    time.time() seconds) of `args.repeats` calls after `warmup` untimed ones; the host median
    and the window (for --clocks) over the timed calls only (`host_timed`; a warm-up may
    compile kernels, with the GPU idle)."""
    timings = {}
    for pass_, fn in calls.items():
        hosts: list[float] = []
        fn = host_timed(fn, hosts)
        with torch.no_grad() if pass_ == "fwd" else contextlib.nullcontext():
            for _ in range(warmup):
                fn()
            start = time.time()
            ms = time_ms(fn, args.device, warmup=0, repeats=args.repeats)
        timings[pass_] = (ms, statistics.median(hosts[-args.repeats:]), (start, time.time()))
    return timings


def time_method(run: Callable, seqlen: int, args, packing: Packing | None = None
                ) -> dict[str, tuple[float, float, tuple[float, float]]]:
    """`time_passes` of one method on its own (its inputs freed after)."""
    return time_passes(prepare_method(run, seqlen, args, packing), args, args.warmup)


def rounds_order(methods: list[str], round_index: int) -> list[str]:
    """The methods in the order round `round_index` times them: rotated by one a round, so
    that none is always first (right after the warm-ups) or right after the same neighbour."""
    shift = round_index % len(methods) if methods else 0
    return methods[shift:] + methods[:shift]


def merged_rounds(per_round: list[dict[str, tuple[float, float, tuple[float, float]]]]
                  ) -> dict[str, tuple[float, float, list[tuple[float, float]], list[float]]]:
    """Per pass: the median over the rounds of each round's median ms and host ms, every
    round's window, and every round's ms."""
    return {pass_: (statistics.median(r[pass_][0] for r in per_round),
                    statistics.median(r[pass_][1] for r in per_round),
                    [r[pass_][2] for r in per_round],
                    [r[pass_][0] for r in per_round])
            for pass_ in per_round[0]}


def benchmark(args) -> list[Result]:
    """Every case and method timed, in turn or in --rounds; with --clocks, nvidia-smi samples
    the GPU's clock throughout and each result gets the medians of its windows."""
    sampler = ClockSampler(args.device.index or 0) if args.clocks else None
    try:
        results, windows = timed_results(args)
    finally:
        if sampler is not None:
            sampler.stop()
    if sampler is not None:
        if not sampler.samples:
            print("--clocks: nvidia-smi gave no samples (it numbers the GPUs without "
                  "CUDA_VISIBLE_DEVICES' renumbering: the device's index may name another)",
                  file=sys.stderr)
        for result, window in zip(results, windows):
            clocks = sampler.during(window) if window else None
            if clocks is not None:
                result.sm_mhz, result.watts = clocks.sm_mhz, clocks.watts
                result.power_capped = clocks.power_capped
    return results


def timed_results(args) -> tuple[list[Result], list[list[tuple[float, float]] | None]]:
    """The results and, beside each, the wall-clock windows its pass was timed in (one per
    round; None for those that did not run)."""
    results: list[Result] = []
    windows: list[list[tuple[float, float]] | None] = []
    runners, unavailable = {}, {}
    for method in args.methods:
        try:
            runners[method] = METHOD_FACTORIES[method](args)
        except (ImportError, RuntimeError) as error:
            unavailable[method] = f"unavailable: {error}"

    for case in benchmark_cases(args):
        seqlen, packing = case.seqlen, case.packing
        workload = case.workload.name if case.workload else None
        failed: dict[str, str] = {}
        methods = [m for m in args.methods if m not in unavailable]
        time_case = timed_in_rounds if args.rounds > 1 else timed_in_turn
        timings = time_case(runners, methods, seqlen, args, packing, failed)
        lengths = [seqlen] * args.batch if packing is None else packing.lengths
        baseline = args.baseline if args.baseline in timings else "dense"
        for method in args.methods:
            status = unavailable.get(method, failed.get(method))
            if status is not None:
                windows.extend([None] * len(args.passes))
                results += [Result(seqlen, method, p, None, None, None, status,
                                   workload=workload) for p in args.passes]
                continue
            pairs = attended_pairs(method, lengths, args)
            for p in args.passes:
                ms, host_ms, method_windows, round_ms = timings[method][p]
                base = timings.get(baseline, {}).get(p, (None,))[0]
                results.append(Result(
                    seqlen, method, p, ms,
                    attention_tflops(pairs, 1, args.heads, args.head_dim, ms,
                                     backward=p == "fwd+bwd"),
                    base / ms if base else None, "ok", host_ms, workload,
                    round_ms=round_ms if args.rounds > 1 else None))
                windows.append(method_windows)
    return results, windows


def timed_in_turn(runners: dict, methods: list[str], seqlen: int, args,
                  packing: Packing | None, failed: dict[str, str]) -> dict:
    """Method -> pass -> (ms, host ms, [window], [ms]): each method prepared, timed and freed in
    turn (--rounds 1: one method's inputs and graphs in memory at a time). A method that
    fails goes into `failed` with why (`_record_failure`)."""
    timings = {}
    for method in methods:
        try:
            timings[method] = {p: (ms, host, [window], [ms]) for p, (ms, host, window) in
                               time_method(runners[method], seqlen, args, packing).items()}
        except Exception as error:  # noqa: BLE001 - sorted by _record_failure
            _record_failure(method, error, failed)
    return timings


def timed_in_rounds(runners: dict, methods: list[str], seqlen: int, args,
                    packing: Packing | None, failed: dict[str, str]) -> dict:
    """Method -> pass -> (ms, host ms, windows, round ms) over --rounds rounds: every method
    prepared first (all in memory at once), then each round times each method's passes in
    `rounds_order`, after --warmup calls in the first round and one in the later ones; each
    figure is the median of the rounds' medians (`merged_rounds`). The GPU's clock drifts
    over a run (FINDINGS.md: a line moved by up to 8% between runs): methods timed in turn
    give that drift to whichever runs later, interleaved they share it."""
    prepared, per_round = {}, {}
    for method in methods:
        try:
            prepared[method] = prepare_method(runners[method], seqlen, args, packing)
            per_round[method] = []
        except Exception as error:  # noqa: BLE001 - sorted by _record_failure
            _record_failure(method, error, failed)
    for round_index in range(args.rounds):
        for method in rounds_order(list(prepared), round_index):
            if method in failed:
                continue
            warmup = args.warmup if round_index == 0 else 1
            try:
                per_round[method].append(time_passes(prepared[method], args, warmup))
            except Exception as error:  # noqa: BLE001 - sorted by _record_failure
                _record_failure(method, error, failed)
                prepared[method] = None
    return {method: merged_rounds(rounds) for method, rounds in per_round.items()
            if method not in failed}


def _record_failure(method: str, error: Exception, failed: dict[str, str]) -> None:
    """A method's failure: out of memory is reported for any method (the cache emptied for the
    next); other errors of third-party methods are reported, ours raise."""
    if isinstance(error, torch.OutOfMemoryError):
        failed[method] = "out of memory"
        torch.cuda.empty_cache()
        return
    if method in OURS:
        raise error
    failed[method] = f"error: {type(error).__name__}: {error}"[:200]


# ----------------------------------------------------------------------------------------------
# Packed documents: the summary against the attended-pair limit
# ----------------------------------------------------------------------------------------------

NSA_METHODS_PACKED = ("nsa", "nsa-graph")
# The dense reference of the packed summary, in order of preference: FA4 is the anchor the
# issue names; our dense attention stands in where FA4 cannot run (the CPU).
DENSE_REFERENCES = ("fa4", "dense")


def workload_record(workload: PackedWorkload, rule: NSAPairRule) -> dict:
    """Everything that defines a workload and its pair counts (for the JSON)."""
    return dict(workload=workload.name, seed=workload.seed, rule=workload.rule,
                total_tokens=workload.total_tokens, documents=workload.documents,
                longest=workload.longest, lengths=list(workload.lengths),
                dense_pairs=dense_pairs(workload.lengths),
                nsa_pairs=nsa_document_pairs(workload.lengths, rule),
                pair_ratio=attended_pair_ratio(workload.lengths, rule))


def packed_summary(results: list[Result], workloads: list[PackedWorkload],
                   rule: NSAPairRule) -> list[dict]:
    """One row per workload, pass and NSA method that ran: its ms beside the dense reference's
    (fa4, else our dense), the speedup, the pair ratio and the speedup's share of it."""
    timed = {(r.workload, r.method, r.pass_): r.ms for r in results
             if r.status == "ok" and r.ms is not None}
    passes = list(dict.fromkeys(r.pass_ for r in results))
    rows = []
    for workload in workloads:
        record = workload_record(workload, rule)
        for pass_ in passes:
            dense_method = next((m for m in DENSE_REFERENCES
                                 if (workload.name, m, pass_) in timed), None)
            dense_ms = timed.get((workload.name, dense_method, pass_))
            for method in NSA_METHODS_PACKED:
                nsa_ms = timed.get((workload.name, method, pass_))
                if nsa_ms is None:
                    continue
                speedup = dense_ms / nsa_ms if dense_ms else None
                share = (share_of_limit(dense_ms, nsa_ms, record["pair_ratio"])
                         if dense_ms else None)
                rows.append(dict(workload=workload.name, documents=workload.documents,
                                 longest=workload.longest, total_tokens=workload.total_tokens,
                                 pair_ratio=record["pair_ratio"], pass_=pass_, method=method,
                                 nsa_ms=nsa_ms, dense_method=dense_method, dense_ms=dense_ms,
                                 speedup=speedup, share_of_limit=share))
    return rows


def format_packed_table(rows: list[dict]) -> str:
    header = (f"{'workload':<14} {'tokens':>7} {'docs':>5} {'longest':>7} {'ratio':>6}  "
              f"{'pass':<8} {'method':<9} {'nsa ms':>9} {'dense':>5} {'dense ms':>9} "
              f"{'speedup':>8} {'share of limit':>14}")
    lines = ["Packed documents: ratio = dense causal pairs / NSA pairs (the speedup at dense "
             "attention's pairs per second); share of limit = (dense ms / ratio) / nsa ms; "
             f"target: {TARGET_SHARE_OF_LIMIT:.0%} of the limit",
             header, "-" * len(header)]
    for r in rows:
        dense_ms = f"{r['dense_ms']:9.3f}" if r["dense_ms"] is not None else f"{'-':>9}"
        speedup = f"{r['speedup']:7.2f}x" if r["speedup"] is not None else f"{'-':>8}"
        if r["share_of_limit"] is None:
            share = f"{'-':>14}"
        else:
            verdict = "ok" if r["share_of_limit"] >= TARGET_SHARE_OF_LIMIT else "below"
            share = f"{r['share_of_limit']:7.0%} {verdict:>6}"
        lines.append(f"{r['workload']:<14} {r['total_tokens']:>7} {r['documents']:>5} "
                     f"{r['longest']:>7} {r['pair_ratio']:6.2f}  {r['pass_']:<8} "
                     f"{r['method']:<9} {r['nsa_ms']:9.3f} {r['dense_method'] or '-':>5} "
                     f"{dense_ms} {speedup} {share}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Branch profile: each NSA branch alone, forward and backward, on nsa()'s own lists
# ----------------------------------------------------------------------------------------------

BRANCH_NAMES = ("compressed", "selected", "window")  # nsa.branches' order (and W_gate's)


def nsa_branches(q, k, v, cu_seqlens, max_seqlen, args):
    """(branches, k_cmp, v_cmp): nsa()'s branches for packed inputs, with their block lists
    from nsa()'s own selection, as NSAFunction.forward builds them (no projections)."""
    config, sequences = validate_nsa_call(
        q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, W_k=None, W_v=None, W_gate=None,
        causal=True, softmax_scale=None, q_tile=SELECTION_Q_TILE,
        cmp_kv_block=CMP_KV_BLOCK, **nsa_options(args), **deterministic_option(args))
    cu_seqlens_cmp = compressed_cu_seqlens(cu_seqlens, config.compress_block_size)
    starts = compressed_starts(cu_seqlens, cu_seqlens_cmp, sequences, config)
    # The compute dtype: selection scores read k_cmp.
    k_cmp, v_cmp = compress_pair((k, v), starts, config.compress_block_size, (None, None))
    selection = select_for_branches(q, k_cmp, cu_seqlens, cu_seqlens_cmp, sequences, config)
    branches = describe_branches(selection, cu_seqlens, cu_seqlens_cmp, sequences, config)
    return branches, k_cmp.to(k.dtype), v_cmp.to(v.dtype)


def branch_pairs(name: str, seqlen: int, args) -> int:
    """Attended (row, key) pairs of one branch in one sequence (the selected branch: an upper
    bound, num_selected_blocks whole blocks per row, as _common.nsa_pairs counts it)."""
    if name == "compressed":
        return compressed_pairs(seqlen, args.compress_block_size,
                                compressed_key_cap(args.num_cmp_selected_blocks))
    if name == "selected":
        return capped_causal_pairs(seqlen, args.num_selected_blocks * args.selected_block_size)
    return capped_causal_pairs(seqlen, args.window_size)


def profile_branches(seqlen: int, args) -> list[dict]:
    """One row per branch at this N: forward and backward ms, their ratio, TFLOP/s and backends;
    plus the time to build the transposed lists the sm90 backward reads (nsa() builds them once
    per backward), for the branches that have lists."""
    total = args.batch * seqlen
    q, k, v = random_qkv((total, args.heads, args.head_dim),
                         (total, args.kv_heads, args.head_dim), args.torch_dtype, args.device,
                         seed=5)
    cu_seqlens = cu_seqlens_of([seqlen] * args.batch, args.device)
    branches, k_cmp, v_cmp = nsa_branches(q, k, v, cu_seqlens, seqlen, args)
    generator = torch.Generator().manual_seed(9)

    def timed(fn) -> float:
        # At least 3 warm-up calls: with one, the selected branch's backward at 16K read 24.4 ms
        # where a direct timing after 3 read 7.2 ms (H100, 2026-11-24, commit adce0ac; the
        # first branch timed also pays for the GPU leaving its idle clocks).
        return time_ms(fn, args.device, warmup=max(args.warmup, 3), repeats=args.repeats)

    rows = []
    for branch in branches:
        name = BRANCH_NAMES[branch.index]
        keys, values = (k_cmp, v_cmp) if branch.reads_compressed else (k, v)
        out, lse = branch.forward(q, keys, values)
        transposed = branch.transposed_lists()
        # nsa()'s backward hands each branch g_b * dO: a random dout of the same magnitude.
        dout = (torch.randn(q.shape, generator=generator) / len(branches)).to(
            device=args.device, dtype=q.dtype)
        backward_options = dict(deterministic=args.deterministic,
                                block_sparse_transposed=transposed)
        asked = {key: value for key, value in backward_options.items()
                 if value is not None and value is not False}
        fwd_ms = timed(lambda: branch.forward(q, keys, values))
        bwd_ms = timed(lambda: branch.backward(dout, q, keys, values, out, lse,
                                               **backward_options))
        pairs = branch_pairs(name, seqlen, args)
        fwd_tflops = attention_tflops(pairs, args.batch, args.heads, args.head_dim, fwd_ms,
                                      backward=False)
        row = dict(seqlen=seqlen, branch=name, fwd_ms=fwd_ms, bwd_ms=bwd_ms,
                   bwd_over_fwd=bwd_ms / fwd_ms, fwd_tflops=fwd_tflops,
                   bwd_tflops=fwd_tflops * fwd_ms / bwd_ms * 2.5,
                   fwd_backend=kernels.which_backend(q, keys, values, **branch.kernel_kwargs),
                   bwd_backend=kernels.which_backend(q, keys, values, backward=True, **asked,
                                                     **branch.kernel_kwargs),
                   transpose_ms=None)
        if transposed is not None:
            row["transpose_ms"] = timed(branch.transposed_lists)
        rows.append(row)
        del out, lse, transposed, dout
    return rows


def format_branch_profile(rows: list[dict]) -> str:
    header = (f"{'N':>8}  {'branch':<11} {'fwd ms':>9} {'bwd ms':>9} {'bwd/fwd':>8} "
              f"{'fwd TF/s':>9} {'bwd TF/s':>9} {'transpose':>10}  backend fwd | bwd")
    lines = ["NSA branches alone on nsa()'s own lists (TF/s over attended pairs, the selected "
             "branch's an upper bound; backward = 2.5x the forward's flops; transpose = building "
             "the lists the sm90 backward reads, once per nsa() backward)",
             header, "-" * len(header)]
    for r in rows:
        transpose = f"{r['transpose_ms']:10.3f}" if r["transpose_ms"] is not None \
            else f"{'-':>10}"
        lines.append(f"{r['seqlen']:>8}  {r['branch']:<11} {r['fwd_ms']:9.3f} {r['bwd_ms']:9.3f} "
                     f"{r['bwd_over_fwd']:7.2f}x {r['fwd_tflops']:9.3f} {r['bwd_tflops']:9.3f} "
                     f"{transpose}  {r['fwd_backend']} | {r['bwd_backend']}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------

def format_table(results: list[Result], baseline: str, rounds: int = 1) -> str:
    # Packed rows name their workload where the others give N (wider column then).
    width = max([8] + [len(r.workload) for r in results if r.workload])
    label = "workload" if any(r.workload for r in results) else "N"
    clocks = any(r.sm_mhz is not None for r in results)
    spread = any(r.round_ms for r in results)
    header = (f"{label:>{width}}  {'method':<9} {'pass':<8} {'ms':>10} {'speedup':>8} "
              f"{'TFLOP/s':>9} {'host ms':>9}" + (f" {'spread':>7}" if spread else "")
              + (f" {'SM MHz':>7} {'W':>5} {'capped':>6}" if clocks else "") + "  status")
    lines = [f"speedup = {baseline} ms / method ms (same N and pass); TFLOP/s over attended "
             f"pairs; host ms = the call's wall time until it returns (no sync)"
             + (f"; ms, host ms = medians of {rounds} interleaved rounds' medians, spread = "
                "(slowest - fastest round) / ms" if rounds > 1 else "")
             + ("; SM MHz, W = nvidia-smi's medians while the pass was timed, capped = the "
                "share of its samples with the software power cap active" if clocks else ""),
             header, "-" * len(header)]
    for r in results:
        ms = f"{r.ms:10.3f}" if r.ms is not None else f"{'-':>10}"
        speedup = f"{r.speedup:7.2f}x" if r.speedup is not None else f"{'-':>8}"
        tflops = f"{r.tflops:9.3f}" if r.tflops is not None else f"{'-':>9}"
        host = f"{r.host_ms:9.3f}" if r.host_ms is not None else f"{'-':>9}"
        case = r.workload or r.seqlen
        rounds_spread = ""
        if spread:
            rounds_spread = (f" {(max(r.round_ms) - min(r.round_ms)) / r.ms:7.1%}"
                             if r.round_ms and r.ms else f" {'-':>7}")
        sampled = ""
        if clocks:
            sampled = (f" {r.sm_mhz:7.0f} {r.watts:5.0f} {r.power_capped:6.0%}"
                       if r.sm_mhz is not None else f" {'-':>7} {'-':>5} {'-':>6}")
        lines.append(f"{case:>{width}}  {r.method:<9} {r.pass_:<8} {ms} {speedup} {tflops} "
                     f"{host}{rounds_spread}{sampled}  {r.status}")
    return "\n".join(lines)


def attention_backends(args) -> dict[str, str]:
    """Which path our attention calls take for this dtype, head dim and device."""
    q, k, v = random_qkv((1, 256, args.heads, args.head_dim), (1, 256, args.kv_heads,
                         args.head_dim), args.torch_dtype, args.device)
    return {"forward": kernels.which_backend(q, k, v, causal=True),
            "backward": kernels.which_backend(q, k, v, causal=True, backward=True,
                                              **deterministic_option(args))}


def git_commit() -> str | None:
    """HEAD of the checkout the tool runs from, "+dirty" when tracked files differ; None where
    there is no git checkout (a copied tree)."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root,
                              capture_output=True, text=True, timeout=10)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def run_metadata(args, argv) -> dict:
    device = (torch.cuda.get_device_name(args.device) if args.device.type == "cuda"
              else f"cpu ({platform.processor() or platform.machine()}, "
                   f"{torch.get_num_threads()} threads)")
    return {
        "tool": "bench_nsa_vs_dense",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "command": " ".join(["python", "tools/bench_nsa_vs_dense.py", *argv]),
        "device": device,
        "torch": torch.__version__,
        "backend": attention_backends(args),
        "problem": {key: getattr(args, key) for key in (
            "batch", "heads", "kv_heads", "head_dim", "dtype", "compress_block_size",
            "selected_block_size", "num_selected_blocks", "window_size", "gate", "deterministic",
            "recompute",
            "num_seqs", "packed", "total_tokens", "warmup", "repeats", "rounds")},
        "baseline": args.baseline,
    }


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="NSA forward and forward+backward vs dense causal attention.",
        epilog=problem_defaults_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_problem_arguments(parser)
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated subset of {','.join(METHODS)} (default: all), "
                             "or none (with --branch-profile: only the branches)")
    parser.add_argument("--passes", default=",".join(PASSES),
                        help="comma-separated subset of fwd,fwd+bwd (default: both)")
    parser.add_argument("--baseline", choices=["dense", "sdpa", "fa4"], default=None,
                        help="the speedup column's reference (default: fa4 if it runs, "
                             "else dense)")
    parser.add_argument("--deterministic", action="store_true",
                        help="deterministic=True for nsa() and our dense attention: "
                             "bit-identical gradients from run to run (slower backward)")
    add_recompute_argument(parser)
    add_capture_argument(parser)
    parser.add_argument("--branch-profile", action="store_true",
                        help="also time each NSA branch alone, forward and backward, on "
                             "nsa()'s own lists (see the description)")
    add_num_seqs_argument(parser)
    add_cmp_selected_argument(parser)
    packed = parser.add_argument_group("packed documents (see the description)")
    packed.add_argument("--packed", default=None,
                        help="comma-separated workloads to run instead of --seqlens: "
                             "lognormal-<median> and docs-<length>, e.g. "
                             f"{','.join(STANDARD_WORKLOADS)} (or 'standard' for these four)")
    packed.add_argument("--total-tokens", type=int_list, default=None,
                        help="each packed workload's total tokens: one value for all or one "
                             "per workload (default: 64K for lognormal, docs-L 16K or 8 "
                             "documents, whichever is more)")
    packed.add_argument("--packed-seed", type=int, default=0,
                        help="seed of the lognormal lengths (default 0)")
    add_context_parallel_argument(parser)
    add_switch_argument(parser)
    parser.add_argument("--clocks", action="store_true",
                        help="sample the GPU's SM clock and power with nvidia-smi every 20 ms "
                             "and give each result the medians of its timing (GPU only; a "
                             "pass timed in under 20 ms may get no sample)")
    parser.add_argument("--rounds", type=positive_int, default=1,
                        help="time the methods of each case in this many interleaved rounds "
                             "(all prepared at once, each round in a rotated order; the "
                             "median of the rounds' medians); 1 (the default): each method "
                             "in turn, alone in memory")
    parser.add_argument("--json", type=Path, help="write the results to this JSON file")
    args = parser.parse_args(argv)
    args.switches = parse_switches(parser, args)
    if args.context_parallel is not None and (args.packed is not None or args.branch_profile):
        parser.error("--context-parallel times nsa() on --seqlens (each one packed sequence "
                     "of --num-seqs documents): not with --packed or --branch-profile")
    check_packed_arguments(args, parser)
    resolve_problem_arguments(args, parser)
    if args.clocks and args.device.type != "cuda":
        parser.error(f"--clocks: samples a GPU's clock with nvidia-smi; --device is "
                     f"{args.device}")
    check_num_seqs(args, parser)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.methods == ["none"]:
        if not args.branch_profile:
            parser.error("--methods none leaves nothing to run without --branch-profile")
        args.methods = []
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        parser.error(f"--methods: unknown {unknown}; expected a subset of {list(METHODS)}")
    args.passes = [p.strip() for p in args.passes.split(",") if p.strip()]
    if not args.passes or set(args.passes) - set(PASSES):
        parser.error(f"--passes: expected a subset of {list(PASSES)}, got {args.passes}")
    if args.baseline is None:
        args.baseline = "fa4" if "fa4" in args.methods and args.device.type == "cuda" \
            else "dense"
    return args


def check_packed_arguments(args, parser) -> None:
    """Resolve --packed into args.workloads (before the device defaults fill --seqlens: a
    packed run measures its workloads, not N)."""
    args.workloads = []
    if args.packed is None:
        if args.total_tokens is not None:
            parser.error("--total-tokens needs --packed")
        return
    names = [n.strip() for n in args.packed.split(",") if n.strip()]
    names = [w for n in names for w in (STANDARD_WORKLOADS if n == "standard" else [n])]
    for option, value in (("--seqlens", args.seqlens), ("--num-seqs", args.num_seqs),
                          ("--batch", args.batch)):
        if value is not None:
            parser.error(f"--packed sets the tokens itself: drop {option}")
    if args.branch_profile:
        parser.error("--branch-profile is padded: drop --packed")
    try:
        for name in names:
            parse_workload_name(name)
    except ValueError as error:
        parser.error(f"--packed: {error}")
    if not names or len(set(names)) != len(names):
        parser.error(f"--packed: expected distinct workload names, got {args.packed!r}")
    totals = args.total_tokens or [None]
    if len(totals) not in (1, len(names)):
        parser.error(f"--total-tokens: give one value or one per workload ({len(names)})")
    totals = totals * len(names) if len(totals) == 1 else totals
    try:
        args.workloads = [build_workload(name, total, seed=args.packed_seed)
                          for name, total in zip(names, totals)]
    except RuntimeError as error:  # no numpy for the lognormal lengths
        parser.error(f"--packed: {error}")
    args.packed = names
    args.batch = 1
    # --seqlens stays the list of totals (the header, check_num_seqs) once args.packed is set.
    args.seqlens = [w.total_tokens for w in args.workloads]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.context_parallel is not None:
        # nsa() across the ranks against one GPU's nsa() per length (the table and the JSON
        # are bench_context_parallel's; dense anchors are not run there).
        rows = run_for_tool("bench_nsa_vs_dense", args)
        if args.json and int(os.environ.get("RANK", "0")) == 0:
            write_results_json(args.json, "bench_nsa_vs_dense", argv, rows[0]["device"], rows)
        return 0
    metadata = run_metadata(args, argv)
    print(f"{metadata['device']}, torch {metadata['torch']}; our attention: forward "
          f"{metadata['backend']['forward']}, backward {metadata['backend']['backward']}")
    print(f"B={args.batch} {problem_summary(args)}; "
          f"{'learned' if args.gate else 'mean'} gates"
          f"{'; deterministic backward' if args.deterministic else ''}"
          + "".join(f"; {switch}" for switch in args.switches))
    rule = NSAPairRule.from_args(args)
    for workload in args.workloads:
        record = workload_record(workload, rule)
        print(f"{workload.name}: {workload.total_tokens} tokens in {workload.documents} "
              f"documents, the longest {workload.longest}; dense / NSA pairs "
              f"{record['pair_ratio']:.2f} ({workload.rule})")
    results = benchmark(args)
    if results:
        print(format_table(results, args.baseline, args.rounds))
    packed_rows = packed_summary(results, args.workloads, rule) if args.packed else []
    if packed_rows:
        print(format_packed_table(packed_rows))
    branch_rows = []
    if args.branch_profile:
        for seqlen in args.seqlens:
            branch_rows += profile_branches(seqlen, args)
        print(format_branch_profile(branch_rows))
    if args.json:
        payload = {"meta": metadata, "results": [
            {**{k: v for k, v in asdict(r).items() if k != "pass_"}, "pass": r.pass_}
            for r in results]}
        if args.branch_profile:
            payload["branch_profile"] = branch_rows
        if args.packed:
            payload["packed"] = {
                "target_share_of_limit": TARGET_SHARE_OF_LIMIT,
                "workloads": [workload_record(w, rule) for w in args.workloads],
                "summary": [{**{k: v for k, v in row.items() if k != "pass_"},
                             "pass": row["pass_"]} for row in packed_rows]}
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
