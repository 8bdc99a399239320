"""Benchmark nsa() across GPUs (context parallelism, nsa.distributed) against one GPU.

Run under torchrun, one process per GPU (NCCL), or with --device cpu on gloo:

    torchrun --nproc-per-node 8 tools/bench_context_parallel.py --seqlen 262144 --json cp.json
    torchrun --nproc-per-node 4 tools/bench_context_parallel.py --seqlen 1048576 --no-check
    python tools/bench_context_parallel.py --device cpu --seqlen 512 --heads 4 --kv-heads 2

Without torchrun's environment (RANK, WORLD_SIZE) it runs as a group of one process.
The inputs are packed: --num-seqs random-length documents (from --seed), which cross the shard
bounds. --layout picks how the tokens are sharded (nsa.distributed.sharding; by default zigzag in
sequence mode, whose causal work it balances, and contiguous in heads mode). With --check (the
default) every rank builds the same full inputs from --seed, takes its shard and runs
nsa_context_parallel forward and forward+backward; rank 0 also runs one-GPU nsa() on the full inputs
and compares the gathered output and dq, dk, dv with it (heads mode: bitwise expected) and times it,
for the ratio "context-parallel time / (one-GPU time / W)" (1.0 = perfect scaling). With --no-check
each rank makes only its own shard (random values from --seed and its rank), so lengths that no
single GPU holds run too.
Timing: --warmup untimed calls, then the median of --repeats (CUDA events on a GPU,
perf_counter on the CPU); the reported time is the slowest rank's median. The mode's exchanges
alone are timed the same way, to give communication's share of the step: in heads mode the
all-to-alls (q, k, v to head shards and the output back; the backward moves the same volumes
the other way), in sequence mode the all-gathers of k and v and the backward's reduce-scatter of
the whole sequence's dk and dv (an all-reduce on a backend without reduce-scatter).

`--max-length` (CUDA) instead searches the longest T whose context-parallel forward+backward
fits these ranks, each rank making only its own shard (random values from --seed and its rank;
replicated W_k, W_v, W_gate; --num-seqs documents): doubling from --seqlen until a rank runs
out of memory, then bisecting to a multiple of --resolution. Every trial's verdict is the
group's (a trial fits when it fits on every rank), and the group agrees to start each trial, so
every rank runs the same trials. A rank that runs out of memory where the others do not (they
then wait for it inside an all-to-all) ends the search with the process group's timeout
(--timeout) instead of an answer: ranks hold the same shapes, so this needs an uneven
allocator state.

    torchrun --nproc-per-node 4 tools/bench_context_parallel.py --max-length \
        --seqlen 1048576 --resolution 524288 --time-limit 500
"""
from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import (DTYPES, RECOMPUTE_OPTIONS, add_cmp_selected_argument,  # noqa: E402
                     add_layout_argument, add_recompute_argument,
                     cu_seqlens_of, describe_answer, describe_device, positive_float,
                     positive_int, resolve_device, resolve_layout, search_longest, time_ms,
                     varlen_lengths, write_results_json)
from nsa import nsa  # noqa: E402
from nsa.distributed import (choose_mode, nsa_context_parallel,  # noqa: E402
                             resolve_group, shard_ranges, shard_sequence, unshard_sequence)
from nsa.distributed.sharding import chunks_per_rank  # noqa: E402
from nsa.distributed.exchange import heads_to_sequence, sequence_to_heads  # noqa: E402

TOOL = "bench_context_parallel"


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"{TOOL}.py",
        description="Time nsa() across GPUs (context parallelism) against one GPU: "
                    "forward, forward+backward, the exchanges alone; check equality.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--seqlen", type=positive_int, default=None,
                        help="global tokens T, split over the ranks (default: 262144 on CUDA, "
                             "512 on the CPU)")
    parser.add_argument("--num-seqs", type=positive_int, default=4,
                        help="documents packed into the T tokens (random lengths)")
    parser.add_argument("--heads", type=positive_int, default=32)
    parser.add_argument("--kv-heads", type=positive_int, default=8)
    parser.add_argument("--head-dim", type=positive_int, default=128)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default: bfloat16 on CUDA, float32 on the CPU (whose bfloat16 "
                             "matmuls are slow)")
    parser.add_argument("--mode", choices=("auto", "heads", "sequence"), default="auto")
    add_layout_argument(parser)
    parser.add_argument("--overlap-chunks", type=positive_int, default=1, metavar="N",
                        help="heads mode pipelined in N chunks of a rank's KV heads, each "
                             "chunk's all-to-alls overlapping its neighbour's compute "
                             "(nsa_context_parallel's overlap_chunks; default 1: none)")
    parser.add_argument("--compress-block-size", type=positive_int, default=64)
    parser.add_argument("--selected-block-size", type=positive_int, default=64)
    parser.add_argument("--num-selected-blocks", type=positive_int, default=16)
    parser.add_argument("--window-size", type=int, default=512)
    add_cmp_selected_argument(parser)
    add_recompute_argument(parser, help_more=(
        "; the same for the context-parallel and the one-GPU run (auto can decide differently "
        "for a rank's heads than for all of them; on the kernels kept and recomputed gate "
        "gradients differ in the last bits, so the bitwise check wants keep or recompute)"))
    parser.add_argument("--deterministic", action="store_true",
                        help="deterministic=True for both runs (the default backward sums dQ "
                             "in an order that changes from run to run, so its dq can differ "
                             "in the last bits even between two one-GPU runs)")
    parser.add_argument("--no-weights", action="store_true",
                        help="run without W_k, W_v, W_gate (mean gating)")
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                        help="rank 0 runs one-GPU nsa() on the full inputs: equality and ratio")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=positive_int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-length", action="store_true",
                        help="search the longest T whose forward+backward fits these ranks "
                             "instead of timing (CUDA; from --seqlen up; see the description)")
    parser.add_argument("--resolution", type=positive_int, default=262144,
                        help="with --max-length: the answer's granularity in tokens")
    parser.add_argument("--time-limit", type=positive_float, default=None,
                        help="with --max-length: start no trial after this many seconds")
    parser.add_argument("--timeout", type=positive_float, default=None,
                        help="the process group's timeout in seconds (torch's default: 10 "
                             "minutes); ends a search that one rank's failure left waiting")
    parser.add_argument("--device", default=None, help="cuda (one GPU per rank) or cpu (gloo)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.heads % args.kv_heads:
        parser.error(f"--kv-heads ({args.kv_heads}) must divide --heads ({args.heads})")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_arguments(argv)
    created_group = _init_process_group(args)
    try:
        if args.max_length:
            return _max_length(args, argv)
        return _run(args, argv)
    finally:
        if created_group:
            dist.destroy_process_group()


def add_context_parallel_argument(parser) -> None:
    """--context-parallel N of tools/diagnose_memory.py and tools/bench_nsa_vs_dense.py (read
    back by `run_for_tool`)."""
    parser.add_argument("--context-parallel", type=positive_int, default=None, metavar="N",
                        help="run nsa() across N ranks (context parallelism, heads mode; launch "
                             "with torchrun --nproc-per-node N): this tool's problem on "
                             "tools/bench_context_parallel.py, one packed sequence of "
                             "--num-seqs documents per length; learned W_k, W_v, W_gate with "
                             "--gate, none without")


def delegated_argv(args, seqlen: int) -> list[str]:
    """This tool's command line for another tool's resolved problem (`_common`'s problem
    arguments) at one length: the shapes, dtype, NSA options and timing it shares."""
    argv = ["--seqlen", str(seqlen), "--num-seqs", str(getattr(args, "num_seqs", None) or 1),
            "--heads", str(args.heads), "--kv-heads", str(args.kv_heads),
            "--head-dim", str(args.head_dim), "--dtype", args.dtype,
            "--compress-block-size", str(args.compress_block_size),
            "--selected-block-size", str(args.selected_block_size),
            "--num-selected-blocks", str(args.num_selected_blocks),
            "--window-size", str(args.window_size), "--warmup", str(args.warmup),
            "--repeats", str(args.repeats), "--device", args.device.type]
    if getattr(args, "num_cmp_selected_blocks", None) is not None:
        argv += ["--num-cmp-selected-blocks", str(args.num_cmp_selected_blocks)]
    if not args.gate:
        argv.append("--no-weights")
    if getattr(args, "deterministic", False):
        argv.append("--deterministic")
    if getattr(args, "recompute", "auto") != "auto":
        argv += ["--recompute", args.recompute]
    return argv


def run_for_tool(tool: str, args, *, max_length: bool = False,
                 extra: tuple[str, ...] = ()) -> list[dict]:
    """`--context-parallel N` of another tool: its problem run here across the ranks, one
    result per length of args.seqlens (the step against one GPU, `extra` added to the command
    line), or with max_length the longest T that fits, from the first length up
    (args.resolution, args.time_limit). The same on every rank; SystemExit where the launch
    does not have N ranks or the batch is not one sequence."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.context_parallel:
        raise SystemExit(f"{tool}: --context-parallel {args.context_parallel} runs under "
                         f"torchrun --nproc-per-node {args.context_parallel} (WORLD_SIZE is "
                         f"{world})")
    if args.batch != 1:
        raise SystemExit(f"{tool}: --context-parallel shards one packed sequence: --batch 1 "
                         f"(got {args.batch}; --num-seqs packs documents)")
    if max_length:
        limit = [] if args.time_limit is None else ["--time-limit", str(args.time_limit)]
        return [main(delegated_argv(args, args.seqlens[0])
                     + ["--max-length", "--resolution", str(args.resolution), *limit])]
    return [main(delegated_argv(args, seqlen) + list(extra)) for seqlen in args.seqlens]


def _init_process_group(args) -> bool:
    """Join torchrun's group (NCCL on CUDA, gloo on the CPU), or make a group of one."""
    wants_cuda = args.device != "cpu" and (args.device is not None or torch.cuda.is_available())
    if wants_cuda and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if dist.is_initialized():
        return False
    backend = "nccl" if wants_cuda else "gloo"
    timeout = {} if args.timeout is None else {
        "timeout": datetime.timedelta(seconds=args.timeout)}
    if "RANK" in os.environ:
        dist.init_process_group(backend, **timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                **timeout)
    return True


def _run(args, argv) -> dict:
    group = resolve_group(dist.group.WORLD)
    rank, world = group.rank, group.world_size
    device = resolve_device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    seqlen = args.seqlen or (262144 if device.type == "cuda" else 512)
    mode = choose_mode(args.mode, world, args.kv_heads)  # the same error on every rank
    layout = resolve_layout(args.layout, mode)
    try:
        shard_ranges(seqlen, rank=0, world_size=world, layout=layout, name="--seqlen")
    except ValueError as error:
        raise SystemExit(str(error)) from None
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = DTYPES[args.dtype]
    options = _nsa_options(args)
    # Replicated trainable weights: the backward computes each rank's partial dW too.
    weights = _replicated_weights(args, dtype, device)
    cu_seqlens, host_cu = _bounds(args, seqlen, device)
    if args.check:  # every rank makes the whole sequence (rank 0 runs it on one GPU) and shards it
        full = _full_inputs(args, seqlen, dtype, device)
        local = {n: shard_sequence(full[n], group.process_group, layout=layout,
                                   name=n).contiguous()
                 for n in ("q", "k", "v", "dout")}
    else:  # only its own shard: no rank ever holds the whole sequence
        local = _shard_inputs(args, seqlen, dtype, device, group.rank, world)

    def forward(leaves=None):
        q, k, v = leaves or (local["q"], local["k"], local["v"])
        return nsa_context_parallel(q, k, v, group=group.process_group, cu_seqlens=cu_seqlens,
                                    host_cu_seqlens=host_cu, mode=args.mode, layout=layout,
                                    overlap_chunks=args.overlap_chunks, **weights, **options)

    leaves = [local[n].detach().requires_grad_() for n in ("q", "k", "v")]

    def forward_backward():
        out = forward(leaves)
        return torch.autograd.grad(out, [*leaves, *weights.values()], local["dout"])

    if args.check:  # the whole output and gradients, gathered on every rank
        out = forward(leaves)
        grads = torch.autograd.grad(out, leaves, local["dout"], retain_graph=True)
        gathered = {"out": unshard_sequence(out, group.process_group, layout=layout)} | {
            n: unshard_sequence(g, group.process_group, layout=layout)
            for n, g in zip(("dq", "dk", "dv"), grads)}
        del out, grads

    dist.barrier()
    with torch.no_grad():  # an inference-style forward: no graph kept
        fwd_ms = _slowest(time_ms(lambda: forward(), device, warmup=args.warmup,
                                  repeats=args.repeats), device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    fwd_bwd_ms = _slowest(time_ms(forward_backward, device, warmup=args.warmup,
                                  repeats=args.repeats), device)
    # The fullest rank's peak over forward+backward (None off CUDA): every rank calls it.
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else -1
    peak = _max_over_ranks(peak, device)
    comm = (_time_sequence_exchanges(args, local, group, device) if mode == "sequence"
            else _time_exchanges(args, local, group, device, dtype))

    result = {"world_size": world, "mode": mode, "layout": layout,
              "overlap_chunks": args.overlap_chunks,
              "seqlen": seqlen, "num_seqs": args.num_seqs,
              "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
              "dtype": args.dtype, "weights": not args.no_weights, "options": options,
              "device": describe_device(device), "fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms,
              "peak_bytes": None if peak < 0 else peak,
              **comm,
              "comm_share_fwd": comm["exchange_fwd_ms"] / fwd_ms,
              "comm_share_fwd_bwd": comm["exchange_fwd_bwd_ms"] / fwd_bwd_ms}
    if args.check:
        result.update(_compare_with_one_device(args, full, (cu_seqlens, host_cu), weights,
                                               options, gathered, device, rank, world, fwd_ms,
                                               fwd_bwd_ms))
    if rank == 0:
        _print_table(result)
        if args.json is not None:
            write_results_json(args.json, TOOL, list(argv or sys.argv[1:]), result["device"],
                               [result])
    return result


def _nsa_options(args) -> dict:
    """nsa()'s options from the command line (the block sizes, window, deterministic,
    recompute), the same for the timed run, the one-GPU check and the length search."""
    options = dict(compress_block_size=args.compress_block_size,
                   selected_block_size=args.selected_block_size,
                   num_selected_blocks=args.num_selected_blocks, window_size=args.window_size,
                   num_cmp_selected_blocks=args.num_cmp_selected_blocks)
    if args.deterministic:
        options["deterministic"] = True
    return options | RECOMPUTE_OPTIONS[args.recompute]


def _max_length(args, argv) -> dict:
    """--max-length: the longest T (a multiple of --resolution) whose context-parallel
    forward+backward fits every rank; one row per trial and the answer (rank 0 prints)."""
    group = resolve_group(dist.group.WORLD)
    device = resolve_device(args.device)
    if device.type != "cuda":
        raise SystemExit("bench_context_parallel: --max-length needs CUDA devices (it detects "
                         "running out of GPU memory)")
    device = torch.device("cuda", torch.cuda.current_device())
    mode = choose_mode(args.mode, group.world_size, args.kv_heads)
    layout = resolve_layout(args.layout, mode)
    dtype = DTYPES[args.dtype or "bfloat16"]
    step = math.lcm(args.resolution, group.world_size * chunks_per_rank(layout))
    deadline = None if args.time_limit is None else time.monotonic() + args.time_limit

    def fits_here(n: int) -> tuple[bool, int]:
        fits, peak = _fits_on_this_rank(args, n, layout, dtype, device, group)
        gc.collect()  # the trial's frame (a failed one's traceback) is gone: free its blocks
        torch.cuda.empty_cache()
        return fits, peak

    rows, (good, bad) = search_on_ranks(fits_here, max(step, args.seqlen or step), step,
                                        deadline, device, group.rank)
    complete = bad is not None and bad - good <= step
    answer = dict(world_size=group.world_size, mode=mode, layout=layout, max_seqlen=good,
                  first_failure=bad, complete=complete, heads=args.heads, kv_heads=args.kv_heads,
                  head_dim=args.head_dim, dtype=str(dtype).removeprefix("torch."),
                  device=describe_device(device))
    if group.rank == 0:
        print(f"{group.world_size} ranks, mode {mode}, layout {layout}: "
              + describe_answer("fwd+bwd", good, bad, step, complete))
        if args.json is not None:
            write_results_json(args.json, TOOL, list(argv or sys.argv[1:]), answer["device"],
                               [*rows, answer])
    return answer


def search_on_ranks(fits_here, start: int, step: int, deadline: float | None, device,
                    rank: int, clock=time.monotonic) -> tuple[list[dict], tuple[int, int | None]]:
    """`search_longest` with the group's verdicts: (one row per trial, (good, bad)).
    fits_here(n) -> (fits on this rank, its peak bytes). The ranks agree before each trial
    (none starts one another has stopped for: the time limit) and after it (a trial fits when
    it fits on every rank; the peak is the fullest rank's), so all run the same trials."""
    rows = []

    def trial(n: int) -> bool | None:
        if _any_rank(deadline is not None and clock() >= deadline, device):
            return None
        fits, peak = fits_here(n)
        verdict = not _any_rank(not fits, device)
        peak = _max_over_ranks(peak, device)  # every rank calls it, whatever the verdict
        rows.append(dict(seqlen=n, fits=verdict, peak_bytes=peak if verdict else None))
        if rank == 0:
            state = (f"fits, peak {rows[-1]['peak_bytes'] / 2**30:.2f} GiB on the fullest rank"
                     if verdict else "out of memory")
            print(f"  T={n:>10d}  {state}", flush=True)
        return verdict

    return rows, search_longest(trial, start // step * step, step)


def _fits_on_this_rank(args, seqlen: int, layout: str, dtype, device,
                       group) -> tuple[bool, int]:
    """Whether this rank's forward+backward of a T = seqlen call fits, and its peak bytes
    (0 when it does not)."""
    try:
        torch.cuda.reset_peak_memory_stats(device)
        local = _shard_inputs(args, seqlen, dtype, device, group.rank, group.world_size)
        leaves = [local[n].requires_grad_() for n in ("q", "k", "v")]
        weights = _replicated_weights(args, dtype, device)
        cu_seqlens, host_cu = _bounds(args, seqlen, device)
        out = nsa_context_parallel(
            *leaves, group=group.process_group, cu_seqlens=cu_seqlens, host_cu_seqlens=host_cu,
            mode=args.mode, layout=layout, overlap_chunks=args.overlap_chunks,
            **_nsa_options(args),
            **weights)
        torch.autograd.grad(out, [*leaves, *weights.values()], local["dout"])
        torch.cuda.synchronize(device)
        return True, torch.cuda.max_memory_allocated(device)
    except torch.cuda.OutOfMemoryError:
        return False, 0


def _any_rank(flag: bool, device) -> bool:
    """Whether the flag is set on any rank (a collective: every rank must call it)."""
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _max_over_ranks(value, device, dtype=torch.int64):
    """The largest rank's value (a collective: every rank must call it)."""
    tensor = torch.tensor([value], dtype=dtype, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def _bounds(args, seqlen: int, device) -> tuple[torch.Tensor, tuple[int, ...]]:
    """cu_seqlens of --num-seqs random-length documents (from --seed) and its host copy."""
    lengths = varlen_lengths(seqlen, min(args.num_seqs, seqlen),
                             torch.Generator().manual_seed(args.seed))
    return (cu_seqlens_of(lengths, device),
            tuple(cu_seqlens_of(lengths, torch.device("cpu")).tolist()))


def _replicated_weights(args, dtype, device) -> dict:
    """W_k, W_v, W_gate (none with --no-weights): the same on every rank (one seed), leaves
    that require grad."""
    if args.no_weights:
        return {}
    Hkv, D = args.kv_heads, args.head_dim
    generator = torch.Generator(device=device).manual_seed(args.seed)
    return {n: (torch.randn(*shape, generator=generator, device=device) * D ** -0.5).to(
                dtype).requires_grad_()
            for n, shape in (("W_k", (Hkv, D, D)), ("W_v", (Hkv, D, D)),
                             ("W_gate", (args.heads, 3, D)))}


def _token_inputs(args, rows: int, dtype, device, seed: int) -> dict:
    """q, k, v, dout of `rows` tokens, random from `seed` (drawn on the device)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    H, Hkv, D = args.heads, args.kv_heads, args.head_dim
    return {n: torch.randn(rows, h, D, generator=generator, device=device).to(dtype)
            for n, h in (("q", H), ("k", Hkv), ("v", Hkv), ("dout", H))}


def _full_inputs(args, seqlen, dtype, device) -> dict:
    """The whole sequence's q, k, v, dout, the same on every rank (one seed)."""
    return _token_inputs(args, seqlen, dtype, device, args.seed)


def _shard_inputs(args, seqlen, dtype, device, rank: int, world: int) -> dict:
    """Only this rank's shard of q, k, v, dout (random from --seed and the rank): for the runs
    that compare nothing with one GPU (--no-check, --max-length), so that the longest
    sequences are not limited by one rank holding all of it."""
    return _token_inputs(args, seqlen // world, dtype, device, args.seed + 1 + rank)


def _time_exchanges(args, local, group, device, dtype) -> dict:
    """The forward's two all-to-alls alone: q, k, v to head shards, the output back. The
    backward's move the same bytes (dout to head shards; dq, dk, dv back)."""
    q, k, v = (local[n].unsqueeze(0) for n in ("q", "k", "v"))
    out_heads = torch.randn(1, q.shape[1] * group.world_size, q.shape[2] // group.world_size,
                            q.shape[3], device=device).to(dtype)
    to_heads = _slowest(time_ms(lambda: sequence_to_heads((q, k, v), group), device,
                                warmup=args.warmup, repeats=args.repeats), device)
    to_sequence = _slowest(time_ms(lambda: heads_to_sequence((out_heads,), group), device,
                                   warmup=args.warmup, repeats=args.repeats), device)
    return {"all_to_all_qkv_ms": to_heads, "all_to_all_out_ms": to_sequence,
            "all_to_all_fwd_ms": to_heads + to_sequence,
            "all_to_all_fwd_bwd_ms": 2 * (to_heads + to_sequence),
            "exchange_fwd_ms": to_heads + to_sequence,
            "exchange_fwd_bwd_ms": 2 * (to_heads + to_sequence)}


def _time_sequence_exchanges(args, local, group, device) -> dict:
    """Sequence mode's exchanges alone (nsa/distributed/sequence_mode.py): the forward's
    all-gathers of k and v (the q halo is 256 rows a chunk: not counted), the backward's
    reduce-scatter of the whole sequence's dk and dv (each rank receiving its rows; an
    all-reduce where the backend has no reduce-scatter, as sequence mode does). The layout only
    reorders rows around these: the same collectives, the same bytes."""
    process_group = group.process_group
    k, v = local["k"], local["v"]

    def gather():
        for x in (k, v):
            dist.all_gather([torch.empty_like(x) for _ in range(group.world_size)], x,
                            group=process_group)

    # (W, T/W, Hkv, D): every rank's shard of a rank's partial dk (dv)
    partials = [torch.zeros(group.world_size, *x.shape, dtype=x.dtype, device=x.device)
                for x in (k, v)]

    def reduce():
        for x in partials:
            group.sum_scattered(x)

    gather_ms = _slowest(time_ms(gather, device, warmup=args.warmup, repeats=args.repeats),
                         device)
    reduce_ms = _slowest(time_ms(reduce, device, warmup=args.warmup, repeats=args.repeats),
                         device)
    return {"all_gather_kv_ms": gather_ms, "reduce_dkv_ms": reduce_ms,
            "exchange_fwd_ms": gather_ms, "exchange_fwd_bwd_ms": gather_ms + reduce_ms}


def _compare_with_one_device(args, full, bounds, weights, options, gathered, device, rank,
                             world, fwd_ms, fwd_bwd_ms) -> dict:
    """Rank 0: one-device nsa() on the full inputs, its times, and the equality verdicts;
    broadcast so every rank returns the same record."""
    names = ("out", "dq", "dk", "dv")
    verdict = torch.zeros(4 * len(names) + 2, dtype=torch.float64, device=device)
    if rank == 0:
        leaves = [full[n].detach().clone().requires_grad_() for n in ("q", "k", "v")]

        def one_device(grad: bool):
            out = nsa(*leaves, cu_seqlens=bounds[0], host_cu_seqlens=bounds[1], **weights,
                      **options)
            return torch.autograd.grad(out, [*leaves, *weights.values()], full["dout"]) \
                if grad else out

        def outputs() -> dict:
            with torch.enable_grad():
                out = one_device(False)
            return {"out": out.detach(), **dict(zip(("dq", "dk", "dv"), torch.autograd.grad(
                out, leaves, full["dout"])))}

        # Run twice: the second run's distance from the first is one device's own run-to-run
        # spread (the default backward's float32 sums land in a varying order), the yardstick
        # of "equal up to the order of float sums".
        expected, again = outputs(), outputs()
        equal = [float(torch.equal(gathered[n], expected[n])) for n in names]
        diffs = [float((gathered[n].float() - expected[n].float()).abs().max()) for n in names]
        relative = [_relative_diff(gathered[n], expected[n]) for n in names]
        spread = [_relative_diff(again[n], expected[n]) for n in names]
        with torch.no_grad():
            one_fwd = time_ms(lambda: one_device(False), device, warmup=args.warmup,
                              repeats=args.repeats)
        one_fwd_bwd = time_ms(lambda: one_device(True), device, warmup=args.warmup,
                              repeats=args.repeats)
        verdict[:] = torch.tensor([*equal, *diffs, *relative, *spread, one_fwd, one_fwd_bwd],
                                  dtype=torch.float64)
    dist.broadcast(verdict, src=dist.get_global_rank(dist.group.WORLD, 0))
    values = verdict.tolist()
    n = len(names)
    equal, diffs, relative, spread = (values[i * n:(i + 1) * n] for i in range(4))
    one_fwd, one_fwd_bwd = values[-2:]
    return {"bitwise_equal_one_device": all(equal), "max_abs_diff": max(diffs),
            "bitwise_equal": dict(zip(names, map(bool, equal))),
            "max_abs_diffs": dict(zip(names, diffs)),
            "relative_diffs": dict(zip(names, relative)),
            "one_device_relative_spread": dict(zip(names, spread)),
            "one_device_fwd_ms": one_fwd, "one_device_fwd_bwd_ms": one_fwd_bwd,
            "fwd_ratio_to_ideal": fwd_ms / (one_fwd / world),
            "fwd_bwd_ratio_to_ideal": fwd_bwd_ms / (one_fwd_bwd / world)}


def _relative_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float32 (0 where both are 0)."""
    scale = expected.float().norm()
    return float((actual.float() - expected.float()).norm() / scale) if scale > 0 else float(
        actual.float().norm())


def _slowest(ms: float, device) -> float:
    """The slowest rank's time: a step waits for every rank."""
    return _max_over_ranks(ms, device, torch.float64)


def _print_table(result: dict) -> None:
    chunks = result["overlap_chunks"]
    print(f"nsa context parallel: {result['world_size']} ranks, mode {result['mode']}"
          f"{f' in {chunks} overlapped chunks' if chunks > 1 else ''}, "
          f"layout {result['layout']}, "
          f"T={result['seqlen']} in {result['num_seqs']} documents, H={result['heads']} "
          f"Hkv={result['kv_heads']} D={result['head_dim']} {result['dtype']}, "
          f"{result['device']}")
    rows = [("forward", result["fwd_ms"], result["exchange_fwd_ms"], "fwd"),
            ("forward+backward", result["fwd_bwd_ms"], result["exchange_fwd_bwd_ms"],
             "fwd_bwd")]
    print(f"{'pass':<18}{'ms':>10}{'exchanges ms':>15}{'comm share':>12}"
          f"{'1 device ms':>13}{'ms / (1 dev / W)':>18}")
    for name, ms, comm_ms, key in rows:
        one = result.get(f"one_device_{key}_ms")
        ratio = result.get(f"{key}_ratio_to_ideal")
        print(f"{name:<18}{ms:>10.3f}{comm_ms:>15.3f}{comm_ms / ms:>12.1%}"
              f"{'' if one is None else f'{one:.3f}':>13}"
              f"{'' if ratio is None else f'{ratio:.2f}':>18}")
    if "bitwise_equal_one_device" in result:
        print(f"equal to one device: bitwise {result['bitwise_equal_one_device']}, "
              f"max |diff| {result['max_abs_diff']:.3g}; per tensor: " + ", ".join(
                  f"{n} {'equal' if result['bitwise_equal'][n] else 'differs'} "
                  f"({result['max_abs_diffs'][n]:.3g})" for n in result["bitwise_equal"]))
        print("relative difference ||x - one device|| / ||one device|| (one device against "
              "itself): " + ", ".join(
                  f"{n} {result['relative_diffs'][n]:.2e} "
                  f"({result['one_device_relative_spread'][n]:.2e})"
                  for n in result["relative_diffs"]))


if __name__ == "__main__":
    main()
