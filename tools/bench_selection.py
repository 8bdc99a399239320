"""Time nsa()'s block selection, the torch path against the sm90 selection kernel's builds.

Selection as nsa() runs it (`nsa.function.select_for_branches`: scoring queries, scores, the
group's softmax, the ranking, and on the kernel the selected branch's forward lists), on one
sequence of N random bf16 tokens compressed as nsa() compresses them. Variants:
  torch          the chunked torch scoring and the ranking kernel (nsa.selection's fallback path,
                 `select_blocks(..., selection_kernel=False)`); its lists are built by the
                 branch, so not timed here
  fma            the selection kernel with float32 FMA scoring (kernels/sm90/select_blocks.py),
                 the tokens per lane it dispatches
  fma-1, fma-2   the same, 1 or 2 tokens per lane (the build before 2026-11-27, and its middle)
  tensor-cores   the kernel scoring on tensor cores (`tensor_cores=True`;
                 kernels/sm90/split_products.py: six bf16 products per float32 one)
The variants are timed round robin in a shuffled order (`_common.interleaved_medians`:
device time, the host's launch work hidden), medians printed per N. Then each variant's
selection is compared with the fma build's: the rows (tile, KV head) whose blocks differ (float32
near-ties fall either way; a large count is a bug), and with `--reference` with the float64
reference (nsa.reference.select_blocks_reference, minutes at 64K).

    python tools/bench_selection.py --seqlens 16384,65536,262144
    python tools/bench_selection.py --seqlens 65536 --variants fma,tensor-cores --reference
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nsa.compression import compress_kv  # noqa: E402
from nsa.reference import select_blocks_reference  # noqa: E402
from _common import (  # noqa: E402
    add_problem_arguments, describe_device, interleaved_medians, measure_seqlens,
    problem_defaults_epilog, problem_summary, resolve_problem_arguments)

VARIANTS = ("torch", "fma", "fma-1", "fma-2", "tensor-cores")


def variant_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown variants {unknown} (choose from {', '.join(VARIANTS)})")
    return names


def selection_call(variant: str, q, k_cmp, cu_seqlens, cu_cmp, args):
    """A function running the selection as `variant` selects (the kernel choice passed as
    select_blocks's arguments, the tokens per lane patched per call, so variants can
    alternate)."""
    import nsa.selection as selection
    from kernels.sm90 import select_blocks as kernel

    seqlen = q.shape[0]
    host_bounds = ([0, seqlen], cu_cmp.tolist())
    tokens = {"fma-1": 1, "fma-2": 2}.get(variant)
    default_tokens = kernel.default_tokens_per_lane

    def tokens_per_lane(group, tensor_cores=False):
        return tokens if tokens is not None else default_tokens(group, tensor_cores)

    def run():
        kernel.default_tokens_per_lane = tokens_per_lane
        try:
            return selection.select_blocks(
                q, k_cmp, cu_seqlens, cu_cmp, compress_block_size=args.compress_block_size,
                selected_block_size=args.selected_block_size,
                num_selected_blocks=args.num_selected_blocks,
                softmax_scale=args.head_dim ** -0.5, host_bounds=host_bounds,
                write_selected_lists=variant != "torch", selection_kernel=variant != "torch",
                tensor_cores=variant == "tensor-cores")
        finally:  # the library's own tokens per lane back as they were
            kernel.default_tokens_per_lane = default_tokens
    return run


def measure(seqlen: int, args) -> dict:
    generator = torch.Generator(device=args.device).manual_seed(seqlen)
    q = torch.randn(seqlen, args.heads, args.head_dim, generator=generator,
                    device=args.device).to(args.torch_dtype)
    k = torch.randn(seqlen, args.kv_heads, args.head_dim, generator=generator,
                    device=args.device).to(args.torch_dtype)
    cu_seqlens = torch.tensor([0, seqlen], dtype=torch.int32, device=args.device)
    # As nsa() scores: the compressed keys as compression returns them (the compute dtype,
    # float32 for bf16 inputs; nsa.function.compress_and_plan).
    k_cmp, _, cu_cmp = compress_kv(k, k, cu_seqlens, args.compress_block_size)
    calls = {variant: selection_call(variant, q, k_cmp, cu_seqlens, cu_cmp, args)
             for variant in args.variants}
    ms = interleaved_medians(calls, args.device, rounds=args.rounds, repeats=args.repeats)
    selected = {variant: call().selected for variant, call in calls.items()}
    anchor = selected.get("fma", next(iter(selected.values())))
    result = {"seqlen": seqlen, "ms": ms, "rows": anchor.shape[0] * anchor.shape[1],
              "rows_differing_from_fma": {
                  variant: int((s != anchor).any(-1).sum()) for variant, s in selected.items()}}
    if args.reference:
        reference = select_blocks_reference(
            q.double(), k_cmp.double(), cu_seqlens, cu_cmp,
            compress_block_size=args.compress_block_size,
            selected_block_size=args.selected_block_size,
            num_selected_blocks=args.num_selected_blocks,
            softmax_scale=args.head_dim ** -0.5).selected.to(anchor.device)
        result["rows_differing_from_reference"] = {
            variant: int((s != reference).any(-1).sum()) for variant, s in selected.items()}
    return result


def describe(result: dict) -> str:
    lines = [f"N={result['seqlen']}: {result['rows']} (tile, KV head) rows"]
    for variant, ms in result["ms"].items():
        line = (f"  {variant:<13} {ms:9.3f} ms   rows differing from fma: "
                f"{result['rows_differing_from_fma'][variant]}")
        if "rows_differing_from_reference" in result:
            line += f", from the float64 reference: " \
                    f"{result['rows_differing_from_reference'][variant]}"
        lines.append(line)
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Time nsa()'s block selection: the torch path and the sm90 selection "
                    "kernel's builds.",
        epilog=problem_defaults_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_problem_arguments(parser)
    parser.add_argument("--variants", type=variant_list, default=list(VARIANTS),
                        help=f"comma-separated subset of {','.join(VARIANTS)} (default: all)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median)")
    parser.add_argument("--reference", action="store_true",
                        help="also compare each selection with the float64 reference (slow)")
    parser.add_argument("--json", type=Path, help="write the results to this JSON file")
    args = parser.parse_args(argv)
    resolve_problem_arguments(args, parser)
    if args.device.type != "cuda":
        parser.error("the selection kernel needs an sm90 GPU (--device cuda)")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    device = describe_device(args.device)
    print(f"{device}, torch {torch.__version__}; {problem_summary(args)}")
    measure_seqlens("bench_selection", argv, args, device, measure, describe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
