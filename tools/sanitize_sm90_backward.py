"""One small sm90 backward call per dispatched path, sized for compute-sanitizer.

Runs, on an sm_90 GPU, at head dims 128 and 64 (128-row query steps): dense causal GQA varlen
(with one-row, 64-row and 129-row sequences), a causal window, compress_factor 64 (split rows,
launched heaviest first), each fast and deterministic, the compressed case also head by head
and in row bands with the fused dQ (fast only, as dispatched), the dense cases also with dQ fused
into the KV-centric kernel (the writer warp and the accumulator's conversion; dispatched from
4096-key sequences on), 64-key block-sparse lists (split lists; also with two warpgroups
on alternate query steps), and 128-key lists per query head (the fused dQ in head-major work
units, and the dQ kernel); asserts the gradients are finite.
Each call launches three backward kernels (row statistics, the KV-centric kernel, and the dQ
kernel or the fused dQ's conversion), whose names all contain "Backward", so the filter below
instruments every one of them. Meant as the program under compute-sanitizer (docs/history.md,
2026-11-24):

    compute-sanitizer --tool racecheck --kernel-name kns=Backward \\
        python3 tools/sanitize_sm90_backward.py
    (likewise --tool synccheck, --tool memcheck; `--head-dims 128` and `--head-dims 64` in two
    processes side by side halve the wall time, which the three tools triple)
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Dense, window and compressed calls: (sequence lengths, attention options, H, Hkv).
CASES = (
    ([300, 1, 129], dict(causal=True), 8, 2),
    ([64, 1, 200], dict(causal=True), 4, 4),  # steps past the sequence's tiles at head dim 64
    ([500], dict(causal=True, window_size=(100, 0)), 4, 1),
    ([2048], dict(causal=True, compress_factor=64), 4, 1),
)


@contextlib.contextmanager
def small_row_bands(backward_module):
    """Row bands of one step at these sizes (`ROW_BAND_BYTES` bounds a band's share of the dQ
    accumulator; 16 MiB would make one band of a small call)."""
    saved = backward_module.ROW_BAND_BYTES
    backward_module.ROW_BAND_BYTES = 1 << 16
    try:
        yield
    finally:
        backward_module.ROW_BAND_BYTES = saved


def run_cases(head_dim: int = 128, block_sparse_only: bool = False) -> None:
    from kernels import attention_forward
    from kernels.sm90 import backward

    from bench_kernels import block_sparse_case

    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=generator)

    def cu(lengths):
        bounds = torch.tensor([0, *lengths]).cumsum(0)
        return bounds.to(device=device, dtype=torch.int32)

    for lengths, options, heads, kv_heads in () if block_sparse_only else CASES:
        keys = [n // options.get("compress_factor", 1) for n in lengths]
        q, dout = randn(sum(lengths), heads, head_dim), randn(sum(lengths), heads, head_dim)
        k, v = randn(sum(keys), kv_heads, head_dim), randn(sum(keys), kv_heads, head_dim)
        kwargs = dict(cu_seqlens_q=cu(lengths), cu_seqlens_k=cu(keys),
                      max_seqlen_q=max(lengths), max_seqlen_k=max(keys), **options)
        out, lse = attention_forward(q, k, v, **kwargs)
        runs = [dict(deterministic=False), dict(deterministic=True)]
        if options == dict(causal=True):  # plain causal: the fused dQ too
            runs.append(dict(spec_overrides=dict(dq_separate=False)))
        if "compress_factor" in options:  # CTAs launched head by head too (not heaviest first)
            runs.append(dict(spec_overrides=dict(heavy_first=False)))
            # The fused dQ in row bands (dispatched from ROW_BANDS_FUSED_MIN_KEYS compressed
            # keys on), here in bands of one query step (small_row_bands): 32 bands at head dim 128.
            runs.append(dict(spec_overrides=dict(split_rows=True, row_bands=True,
                                                 heavy_first=False, dq_separate=False)))
        for run in runs:
            with small_row_bands(backward):
                grads = backward.run(dout, q, k, v, out, lse, **run, **kwargs)
            assert all(torch.isfinite(g).all() for g in grads), (lengths, options, run)
    n = 1024
    lists = block_sparse_case(n, 4, 0.25, 64)[0]
    q, dout = randn(1, n, 4, head_dim), randn(1, n, 4, head_dim)
    k, v = randn(1, n, 1, head_dim), randn(1, n, 1, head_dim)
    out, lse = attention_forward(q, k, v, causal=False, block_sparse=lists)
    for overrides in (None, dict(alternate_steps=True)):  # and two warpgroups on alternate steps
        grads = backward.run(dout, q, k, v, out, lse, causal=False, block_sparse=lists,
                             max_seqlen_q=n, max_seqlen_k=n, spec_overrides=overrides)
        assert all(torch.isfinite(g).all() for g in grads), overrides
    # 128-key lists per query head: the fused dQ in head-major work units (the dispatcher's
    # choice for lists FUSED_DQ_MIN_LIST_WIDTH wide; forced here on a small case), and the dQ
    # kernel walking the group unsplit.
    n = 2048
    lists = block_sparse_case(n, 4, 0.5, 128)[0]
    q, dout = randn(1, n, 4, head_dim), randn(1, n, 4, head_dim)
    k, v = randn(1, n, 2, head_dim), randn(1, n, 2, head_dim)
    out, lse = attention_forward(q, k, v, causal=False, block_sparse=lists)
    for overrides in (dict(split_lists=True, dq_separate=False), None):
        grads = backward.run(dout, q, k, v, out, lse, causal=False, block_sparse=lists,
                             max_seqlen_q=n, max_seqlen_k=n, spec_overrides=overrides)
        assert all(torch.isfinite(g).all() for g in grads), overrides
    torch.cuda.synchronize()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="One small sm90 backward call per dispatched path, for compute-sanitizer.",
        epilog=__doc__.split("\n\n", 2)[-1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", type=int, nargs="+", choices=(128, 64), default=[128, 64],
                        help="head dims to run (default both; 64 takes 128-row query steps); "
                             "one per process lets the sanitizer runs go side by side")
    parser.add_argument("--block-sparse-only", action="store_true",
                        help="only the block-sparse cases (a shorter run under racecheck)")
    args = parser.parse_args(argv)
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        print("sanitize_sm90_backward: needs an sm_90 GPU", file=sys.stderr)
        return 1
    for head_dim in args.head_dims:
        run_cases(head_dim, args.block_sparse_only)
    print("sanitize_sm90_backward: every case ran, gradients finite")
    return 0


if __name__ == "__main__":
    sys.exit(main())
