"""Memory of NSA forward+backward against dense attention, and the size of the sparsity metadata.

Per sequence length N it reports, all measured on real tensors of the run:
  metadata      bytes of the selected branch's compact block lists (forward layout), of their
                CSR transpose (what the sm90 backward reads), of the sparse compressed branch's
                lists when enabled, and of the raw selection; beside them the bytes a dense
                (tiles x blocks x Hkv) boolean mask would take, the layout the compact one avoids
  saved         bytes autograd keeps from forward to backward (torch.autograd.graph
                saved_tensors_hooks; each storage counted once; q, k, v included)
  must exist    bytes of the tensors a training step cannot do without: q, k, v, out, dout,
                dq, dk, dv and one float32 lse (H x tokens)
  peak (GPU)    torch.cuda.max_memory_allocated over forward+backward (and over the forward
                alone, without autograd), everything allocated included, and the ratio of the
                forward+backward peak to "must exist"; CUDA only, "-" on the CPU

`--max-length` (CUDA) instead searches the longest single sequence (B=1) whose forward, and
whose forward+backward, fit the GPU: doubling from the first of --seqlens until an allocation
fails, then bisecting to a multiple of `--resolution` tokens (64K); it prints each trial's
peak and the stage that reached it (forward or backward). Each trial at a million tokens takes
a minute or more on an H100, so `--passes fwd+bwd` and a coarser `--resolution` keep one
search inside a 10-minute device command (on an H100, 2026-11-24: the full search at 64K
resolution did not finish the forward's in 600 s; 2026-11-27: fwd+bwd from 1M at 256K
resolution had tried 1M and 2M when a 420 s limit killed it). `--time-limit` starts no trial
past that many seconds and reports the range found so far instead of being killed with
nothing.

    python tools/diagnose_memory.py                       # per-device default sizes
    python tools/diagnose_memory.py --seqlens 65536,262144 --json memory.json
    python tools/diagnose_memory.py --seqlens 1048576 --no-dense    # nsa()'s peak at 1M
    python tools/diagnose_memory.py --seqlens 262144 --max-length
    python tools/diagnose_memory.py --seqlens 1048576 --max-length --passes fwd+bwd \
        --resolution 262144 --time-limit 400

Across GPUs (context parallelism): `torchrun --nproc-per-node N tools/diagnose_memory.py
--context-parallel N ...` runs the same problem (one packed sequence) on N ranks through
tools/bench_context_parallel.py: per length the fullest rank's forward+backward peak, or with
`--max-length` the longest sequence the N ranks fit, each holding its shard.

    torchrun --nproc-per-node 4 tools/diagnose_memory.py --context-parallel 4 \
        --seqlens 4194304 --max-length --resolution 2097152 --time-limit 300

The tool sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless the caller set it: at a
million tokens the caching allocator's fragmentation (7.7 GiB reserved but unallocated in an
H100 run of 2026-11-24, commit 6f48f9f) decides whether a step fits, and training at such
lengths wants the setting too. The peaks reported are allocated bytes either way.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernels  # noqa: E402
from nsa import CMP_KV_BLOCK, SELECTION_Q_TILE, nsa  # noqa: E402
from nsa.branches import compressed_branch, selected_branch  # noqa: E402
from nsa.compression import compress, compressed_block_starts, compressed_cu_seqlens  # noqa: E402
from nsa.selection import select_blocks  # noqa: E402
from nsa.validation import validate_nsa_arguments  # noqa: E402
from bench_context_parallel import add_context_parallel_argument, run_for_tool  # noqa: E402
from sparsity import row_block_offsets_from_cu_seqlens, transpose_block_sparse_csr  # noqa: E402
from _common import (  # noqa: E402
    add_cmp_selected_argument, add_problem_arguments, describe_answer, describe_device, measure_seqlens, nsa_options,
    positive_float, positive_int, problem_defaults_epilog, problem_summary, random_gate,
    random_qkv, resolve_problem_arguments, search_longest, write_results_json)

MiB = 2 ** 20


def metadata_bytes(q, k, cu_seqlens, max_seqlen, args) -> dict[str, int]:
    """Bytes of the block-sparse metadata one nsa() call builds for these inputs."""
    config, max_seqlen = validate_nsa_arguments(
        q, k, k, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, W_k=None, W_v=None, W_gate=None,
        causal=True, softmax_scale=None, q_tile=SELECTION_Q_TILE, cmp_kv_block=CMP_KV_BLOCK, **nsa_options(args))
    l = config.compress_block_size
    cu_cmp = compressed_cu_seqlens(cu_seqlens, l)
    k_cmp = compress(k, compressed_block_starts(cu_seqlens, cu_cmp, l, int(cu_cmp[-1])), l)
    selection = select_blocks(q, k_cmp, cu_seqlens, cu_cmp, **config.selection_kwargs())
    selected = selected_branch(cu_seqlens, selection.selected,
                               selected_block_size=config.selected_block_size,
                               softmax_scale=config.softmax_scale, causal=True,
                               q_tile=config.q_tile, max_seqlen=max_seqlen)
    lists = selected.kernel_kwargs["block_sparse"]
    transposed = transpose_block_sparse_csr(
        lists, row_block_offsets_from_cu_seqlens(cu_seqlens, config.selected_block_size))
    result = {
        "selection": selection.selected.nbytes,
        "selected_lists": lists.nbytes,
        "selected_lists_transposed": transposed.nbytes,
    }
    if args.num_cmp_selected_blocks is not None:
        compressed = compressed_branch(
            cu_seqlens, cu_cmp, compress_block_size=l, softmax_scale=config.softmax_scale,
            causal=True, cmp_selected=selection.cmp_selected, q_tile=config.q_tile,
            cmp_kv_block=config.cmp_kv_block, max_seqlen=max_seqlen)
        result["compressed_lists"] = compressed.kernel_kwargs["block_sparse"].nbytes
    tiles = lists.full_count.shape[0]
    blocks = int(row_block_offsets_from_cu_seqlens(cu_seqlens, config.selected_block_size)[-1])
    # A dense mask keeps one byte per (tile, KV block) pair for every KV head, and each
    # sequence's tiles only meet its own blocks: count those pairs.
    lengths = cu_seqlens.diff().tolist()
    dense_pairs = sum(-(-n // config.q_tile) * -(-n // config.selected_block_size)
                      for n in lengths)
    result["dense_mask_equivalent"] = dense_pairs * args.kv_heads
    result["tiles"], result["kv_blocks"] = tiles, blocks
    return result


def saved_for_backward_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves while fn() runs its forward."""
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn()
    del out
    return sum(storages.values())


def must_exist_bytes(q, k, v) -> int:
    """q, k, v, out, dout, dq, dk, dv and one float32 lse: what any attention training step
    holds at its peak."""
    tokens, heads = q.numel() // (q.shape[-1] * q.shape[-2]), q.shape[-2]
    return 4 * q.nbytes + 2 * (k.nbytes + v.nbytes) + 4 * heads * tokens


def peak_bytes(fn, dout, device, backward: bool = True) -> int | None:
    """CUDA memory at the peak of fn() (and of its backward(dout) with `backward`), all
    allocations included (inputs too); None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    if backward:
        out.backward(dout)
    del out
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def problem_tensors(seqlen: int, args):
    """(q, k, v, dout, W_gate) for one run, on args.device."""
    shape_q = (args.batch, seqlen, args.heads, args.head_dim)
    shape_kv = (args.batch, seqlen, args.kv_heads, args.head_dim)
    q, k, v = random_qkv(shape_q, shape_kv, args.torch_dtype, args.device, requires_grad=True)
    dout = torch.randn(shape_q, generator=torch.Generator().manual_seed(7)).to(
        device=args.device, dtype=args.torch_dtype)
    W_gate = random_gate(args.heads, args.head_dim, args.torch_dtype, args.device,
                         requires_grad=True) if args.gate else None
    return q, k, v, dout, W_gate


def nsa_call(q, k, v, W_gate, args):
    return lambda: nsa(q, k, v, W_gate=W_gate, **nsa_options(args))


def diagnose(seqlen: int, args) -> dict:
    q, k, v, dout, W_gate = problem_tensors(seqlen, args)
    run_nsa = nsa_call(q, k, v, W_gate, args)

    def run_dense():
        return kernels.flash_attn_func(q, k, v, causal=True)

    packed = [t.detach().reshape(-1, *t.shape[2:]) for t in (q, k)]
    cu_seqlens = torch.arange(args.batch + 1, dtype=torch.int32, device=args.device) * seqlen
    with torch.no_grad():
        metadata = metadata_bytes(*packed, cu_seqlens, seqlen, args)

    must_exist = must_exist_bytes(q, k, v)
    result = {"seqlen": seqlen, "inputs": sum(t.nbytes for t in (q, k, v)),
              "must_exist": must_exist, "metadata": metadata}
    for name, fn in (("nsa", run_nsa), ("dense", run_dense)):
        if name == "dense" and args.no_dense:
            result[name] = None
            continue
        peak = peak_bytes(fn, dout, args.device)
        q.grad = k.grad = v.grad = None
        with torch.no_grad():
            peak_fwd = peak_bytes(fn, dout, args.device, backward=False)
        result[name] = {"saved_for_backward": saved_for_backward_bytes(fn),
                        "peak_fwd": peak_fwd, "peak_fwd_bwd": peak,
                        "peak_over_must_exist": None if peak is None else peak / must_exist}
        q.grad = k.grad = v.grad = None
    return result


def fits(seqlen: int, args, backward: bool) -> tuple[bool, dict]:
    """Whether nsa() forward (+ backward) at B=1, N=seqlen fits; with the peak and the stage
    that reached it when it does, or the allocator's message when it does not."""
    device = args.device
    try:
        q, k, v, dout, W_gate = problem_tensors(seqlen, args)
        must_exist = must_exist_bytes(q, k, v)
        run = nsa_call(q, k, v, W_gate, args)
        torch.cuda.reset_peak_memory_stats(device)
        if backward:
            out = run()
            peak_fwd = torch.cuda.max_memory_allocated(device)
            out.backward(dout)
            del out
        else:
            with torch.no_grad():
                run()
            peak_fwd = torch.cuda.max_memory_allocated(device)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        stage = "backward" if peak > peak_fwd else "forward"
        return True, dict(peak=peak, must_exist=must_exist, stage=stage)
    except torch.cuda.OutOfMemoryError as error:
        return False, dict(error=str(error).splitlines()[0])


def max_length(args, clock=time.monotonic) -> list[dict]:
    """The longest N (a multiple of args.resolution) whose forward, and forward+backward, fit
    (the passes in args.passes): one row per trial, then one row per pass with the answer.

    With args.time_limit (seconds from the call), no trial starts past the limit: a pass cut
    short reports what it knows, the longest N that fitted and the shortest that did not (None
    when none failed yet), with complete=False; a pass not started reports neither."""
    step = args.resolution
    deadline = None if args.time_limit is None else clock() + args.time_limit
    rows = []

    def trial(n: int, backward: bool) -> bool | None:
        """Whether N fits; None, without trying, once the time limit has passed."""
        if deadline is not None and clock() >= deadline:
            return None
        ok, info = fits(n, args, backward)
        # fits' frame (and a failed trial's traceback) is gone: return its blocks to the GPU.
        gc.collect()
        torch.cuda.empty_cache()
        rows.append(dict(pass_="fwd+bwd" if backward else "fwd", seqlen=n, fits=ok, **info))
        print(describe_trial(rows[-1]), flush=True)
        return ok

    for backward in (p == "fwd+bwd" for p in args.passes):
        good, bad = search_longest(lambda n: trial(n, backward),
                                   max(step, args.seqlens[0] // step * step), step)
        pass_name = "fwd+bwd" if backward else "fwd"
        complete = bad is not None and bad - good <= step
        rows.append(dict(pass_=pass_name, max_seqlen=good, first_failure=bad,
                         complete=complete))
        print(describe_answer(pass_name, good, bad, step, complete))
    return rows


def describe_trial(row: dict) -> str:
    if not row["fits"]:
        return f"  {row['pass_']:8s} N={row['seqlen']:>9d}  out of memory"
    return (f"  {row['pass_']:8s} N={row['seqlen']:>9d}  peak {human(row['peak'])} in the "
            f"{row['stage']}, {row['peak'] / row['must_exist']:.2f}x the tensors that must "
            f"exist ({human(row['must_exist'])})")


def human(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    return f"{nbytes / MiB:.3f} MiB" if nbytes >= 2 ** 14 else f"{nbytes} B"


def format_result(result: dict) -> str:
    meta = result["metadata"]
    lines = [f"N={result['seqlen']}: {meta['tiles']} q tiles x {meta['kv_blocks']} KV blocks; "
             f"q, k, v {human(result['inputs'])}",
             f"  {'metadata':<34} {'bytes':>14}"]
    for key in ("selection", "selected_lists", "selected_lists_transposed", "compressed_lists",
                "dense_mask_equivalent"):
        if key in meta:
            lines.append(f"  {key:<34} {human(meta[key]):>14}")
    lines.append(f"  {'memory':<34} {'nsa':>14} {'dense':>14}")
    dense = result["dense"] or {}  # None with --no-dense
    for key in ("saved_for_backward", "peak_fwd", "peak_fwd_bwd"):
        lines.append(f"  {key:<34} {human(result['nsa'][key]):>14} "
                     f"{human(dense.get(key)):>14}")
    ratios = [result["nsa"]["peak_over_must_exist"], dense.get("peak_over_must_exist")]
    lines.append(f"  {'peak / must exist':<34} "
                 + " ".join(f"{'-' if r is None else f'{r:.2f}x':>14}" for r in ratios)
                 + f"   (must exist: {human(result['must_exist'])})")
    return "\n".join(lines)


def _passes(text: str) -> list[str]:
    passes = [p.strip() for p in text.split(",") if p.strip()]
    if not passes or any(p not in ("fwd", "fwd+bwd") for p in passes):
        raise argparse.ArgumentTypeError(f"expected a subset of fwd,fwd+bwd, got {text!r}")
    return passes


def _context_parallel(args, argv, device: str) -> int:
    """--context-parallel N: the problem on N ranks (tools/bench_context_parallel.py): each
    length's forward+backward peak on the fullest rank, or the longest length that fits."""
    rows = run_for_tool("diagnose_memory", args, max_length=args.max_length,
                        extra=("--no-check", "--warmup", "0", "--repeats", "1"))
    if not args.max_length and int(os.environ.get("RANK", "0")) == 0:
        for row in rows:
            peak = row["peak_bytes"]
            print(f"N={row['seqlen']} on {row['world_size']} ranks: forward+backward peak "
                  + ("- (CPU)" if peak is None else f"{peak / 2**30:.2f} GiB on the fullest rank"))
    if args.json and int(os.environ.get("RANK", "0")) == 0:
        write_results_json(args.json, "diagnose_memory", argv, device, rows)
    return 0


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Peak memory of NSA vs dense attention and the size of the sparsity "
                    "metadata, per sequence length.",
        epilog=problem_defaults_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_problem_arguments(parser)
    add_cmp_selected_argument(parser)
    parser.add_argument("--max-length", action="store_true",
                        help="search the longest N whose nsa() forward and forward+backward "
                             "fit the GPU (CUDA only; B=1, from the first --seqlens up)")
    parser.add_argument("--passes", type=_passes, default=["fwd", "fwd+bwd"],
                        help="with --max-length: comma-separated subset of fwd,fwd+bwd "
                             "(default: both)")
    parser.add_argument("--resolution", type=positive_int, default=65536,
                        help="with --max-length: the answer's granularity in tokens "
                             "(default 65536)")
    parser.add_argument("--no-dense", action="store_true",
                        help="measure nsa() alone, without the dense comparison (dense "
                             "attention at a million tokens takes minutes)")
    parser.add_argument("--time-limit", type=positive_float, default=None,
                        help="with --max-length: start no trial after this many seconds and "
                             "report the range found so far (a trial at a million tokens takes "
                             "a minute or more; default: no limit)")
    add_context_parallel_argument(parser)
    parser.add_argument("--json", type=Path, help="write the results to this JSON file")
    args = parser.parse_args(argv)
    resolve_problem_arguments(args, parser)
    return args


def main(argv=None) -> int:
    # Read by torch's CUDA allocator when it starts (the first CUDA allocation), so set before
    # anything here touches CUDA; a caller's own setting wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    device = describe_device(args.device)
    if args.context_parallel is not None:
        return _context_parallel(args, argv, device)
    print(f"{device}, torch {torch.__version__}; B={args.batch} {problem_summary(args)}")
    if args.max_length:
        if args.device.type != "cuda" or args.batch != 1:
            print("diagnose_memory: --max-length needs a CUDA device and --batch 1",
                  file=sys.stderr)
            return 2
        rows = max_length(args)
        if args.json:
            write_results_json(args.json, "diagnose_memory", argv, device, rows)
        return 0
    if args.device.type != "cuda":
        print("CPU: peak memory needs CUDA's allocator statistics; saved-for-backward, "
              "must-exist and metadata bytes are measured")
    measure_seqlens("diagnose_memory", argv, args, device, diagnose, format_result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
