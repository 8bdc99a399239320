"""Time each component of the NSA forward: compression, selection, block lists, each branch, gating.

Runs the stages nsa.NSAFunction.forward runs, one at a time, through the library's own functions
(nsa.compression, nsa.selection, nsa.branches, nsa.gating), each timed alone on the previous
stage's real outputs: `--warmup` untimed calls, then the median of `--repeats`, CUDA events on a
GPU and perf_counter on the CPU. The last row times nsa() end to end for comparison with the sum.

    python tools/profile_nsa_forward.py                          # per-device default sizes
    python tools/profile_nsa_forward.py --seqlens 65536 --json profile.json
    python tools/profile_nsa_forward.py --num-seqs 8             # varlen: 8 random lengths
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernels  # noqa: E402
from kernels.gated_sum import GatedSum  # noqa: E402
from nsa import CMP_KV_BLOCK, SELECTION_Q_TILE, nsa  # noqa: E402
from nsa.compression import compress, compressed_cu_seqlens  # noqa: E402
from nsa.function import compressed_rows, describe_branches  # noqa: E402
from nsa.gating import gate_weights  # noqa: E402
from nsa.selection import select_blocks  # noqa: E402
from nsa.validation import validate_nsa_call  # noqa: E402
from _common import (  # noqa: E402
    add_problem_arguments, cu_seqlens_of, describe_device, measure_seqlens, nsa_options,
    positive_int, problem_defaults_epilog, problem_summary, random_gate, random_qkv,
    resolve_problem_arguments, time_ms, varlen_lengths)

STAGES = ("compress k, v", "select blocks", "build block lists", "compressed branch",
          "selected branch", "window branch", "gate + combine")


def packed_problem(seqlen: int, args):
    """Packed q, k, v, cu_seqlens, max_seqlen: batch x seqlen tokens in num_seqs sequences
    (equal lengths when num_seqs == batch, the padded case)."""
    total = args.batch * seqlen
    if args.num_seqs is None:
        lengths = [seqlen] * args.batch
    else:
        lengths = varlen_lengths(total, args.num_seqs, torch.Generator().manual_seed(3))
    q, k, v = random_qkv((total, args.heads, args.head_dim), (total, args.kv_heads, args.head_dim),
                         args.torch_dtype, args.device)
    return q, k, v, cu_seqlens_of(lengths, args.device), max(lengths)


def profile(seqlen: int, args) -> dict:
    q, k, v, cu_seqlens, max_seqlen = packed_problem(seqlen, args)
    W_gate = random_gate(args.heads, args.head_dim, args.torch_dtype, args.device) \
        if args.gate else None
    config, sequences = validate_nsa_call(
        q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, W_k=None, W_v=None,
        W_gate=W_gate, causal=True, softmax_scale=None,
        num_cmp_selected_blocks=args.num_cmp_selected_blocks, q_tile=SELECTION_Q_TILE,
        cmp_kv_block=CMP_KV_BLOCK, **nsa_options(args))
    l = config.compress_block_size

    def timed(fn) -> float:
        return time_ms(fn, args.device, warmup=args.warmup, repeats=args.repeats)

    # Each stage as NSAFunction.forward runs it, with the host copies of the sequence bounds it
    # holds (so the branches take the trusted kernel entry, without device reads); the next
    # stage reads this one's outputs.
    def compress_kv():
        cu_cmp = compressed_cu_seqlens(cu_seqlens, l)
        rows = compressed_rows(cu_seqlens, cu_cmp, sequences, config)
        return cu_cmp, compress(k, rows), compress(v, rows).to(v.dtype)

    def select():
        return select_blocks(q, k_cmp, cu_seqlens, cu_seqlens_cmp, **config.selection_kwargs())

    def build_branches():
        return describe_branches(selection, cu_seqlens, cu_seqlens_cmp, sequences, config)

    def gate_and_combine():
        # On sm90 the sum lands in the first output's storage: the terms are copies made for
        # this stage, which drift (a gated mean of random tensors) but never become zeros.
        total = GatedSum(gate_weights(q, W_gate, config.branches), like=q)
        for branch, branch_out in zip(branches, combine_terms):
            total.add(branch.index, branch_out)
        return total.result()

    rows = []
    cu_seqlens_cmp, k_cmp, v_cmp = compress_kv()
    rows.append((STAGES[0], timed(compress_kv), "torch"))
    selection = select()
    rows.append((STAGES[1], timed(select), "torch"))
    branches = build_branches()
    rows.append((STAGES[2], timed(build_branches), "torch (sparsity)"))

    k_cmp = k_cmp.to(k.dtype)
    branch_outputs = []
    for name, branch in zip(STAGES[3:6], branches):
        keys, values = (k_cmp, v_cmp) if branch.reads_compressed else (k, v)
        branch_outputs.append(branch.forward(q, keys, values)[0])
        ms = timed(lambda: branch.forward(q, keys, values))
        rows.append((name, ms, kernels.which_backend(q, keys, values, **branch.kernel_kwargs)))
    combine_terms = [t.clone() for t in branch_outputs]
    rows.append((STAGES[6], timed(gate_and_combine), GatedSum.choose_backend(q)[0]))

    end_to_end = timed(lambda: nsa(
        q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, W_gate=W_gate,
        num_cmp_selected_blocks=args.num_cmp_selected_blocks, **nsa_options(args)))
    selected_lists = branches[1].kernel_kwargs["block_sparse"]
    return {
        "seqlen": seqlen,
        "tokens": q.shape[0],
        "sequences": len(cu_seqlens) - 1,
        "stages": [{"stage": name, "ms": ms, "backend": backend} for name, ms, backend in rows],
        "sum_ms": sum(ms for _, ms, _ in rows),
        "nsa_forward_ms": end_to_end,
        "selected_lists_per_tile": int(selected_lists.full_index.shape[-1]
                                       + selected_lists.mask_index.shape[-1]),
    }


def format_profile(result: dict) -> str:
    total = result["sum_ms"]
    lines = [f"N={result['seqlen']} ({result['tokens']} tokens in {result['sequences']} "
             f"sequences)",
             f"  {'stage':<20} {'ms':>10} {'share':>7}  backend",
             "  " + "-" * 60]
    for stage in result["stages"]:
        lines.append(f"  {stage['stage']:<20} {stage['ms']:10.3f} "
                     f"{stage['ms'] / total:7.1%}  {stage['backend']}")
    lines.append(f"  {'sum of stages':<20} {total:10.3f}")
    lines.append(f"  {'nsa() forward':<20} {result['nsa_forward_ms']:10.3f}  (end to end)")
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Time each component of the NSA forward.", epilog=problem_defaults_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_problem_arguments(parser)
    parser.add_argument("--num-seqs", type=positive_int,
                        help="split the batch*N tokens into this many random-length sequences "
                             "(varlen); default: batch sequences of N")
    parser.add_argument("--num-cmp-selected-blocks", type=positive_int,
                        help="make the compressed branch block-sparse (default: dense)")
    parser.add_argument("--json", type=Path, help="write the results to this JSON file")
    args = parser.parse_args(argv)
    resolve_problem_arguments(args, parser)
    for seqlen in args.seqlens:
        if args.num_seqs is not None and args.num_seqs > args.batch * seqlen:
            parser.error(f"--num-seqs ({args.num_seqs}) exceeds the {args.batch * seqlen} tokens")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    device = describe_device(args.device)
    print(f"{device}, torch {torch.__version__}; {problem_summary(args)}")
    measure_seqlens("profile_nsa_forward", argv, args, device, profile, format_profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
