"""Time compile-time variants of the sm90 backward kernel against the dispatched one.

The backward dispatcher (`kernels/sm90/spec.py::choose_backward_spec`) picks its switches by
measurements of this script and of torch.profiler runs (docs/history.md, 2026-11-24):
`dq_separate` (dQ from the query-centric kernel, or fused into the KV-centric one with a dQ
writer warp: fused for plain causal or full attention, and for wide 128-key lists per query
head, 2026-11-27), `split_lists` and `split_rows` (several CTAs per KV tile, for calls with
fewer KV tiles than SMs, such as compressed keys). For each case it runs
the dispatched spec and the variants with a switch turned, checks every variant's dq/dk/dv
against the dispatched kernel's (the float32 sums are ordered differently, so within 1e-2
relative, not bitwise), and prints backward times.

Each variant runs in its own process with a time limit: a variant that hangs on the GPU (a
first TMA reduce-add did) is reported as "hung" and the others still run.

    python tools/tune_sm90_backward.py --seqlens 16384 --json tune_bwd.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _common  # noqa: E402

VARIANTS = {
    "dispatched": {},
    "split_rows on": dict(split_rows=True),
    "split_rows off": dict(split_rows=False),
    "q_stages3": dict(q_stages=3),
    # Block-sparse: one work unit per KV tile walking the whole group (no float32 dK/dV
    # partials), or longer chunks of the split lists (`list_chunk` sets
    # kernels.sm90.backward.LIST_CHUNK in the child).
    "split_lists off": dict(split_lists=False),
    "list_chunk 48": dict(list_chunk=48),
    # Split-list units taken KV block by KV block instead of head by head
    # (kernels.sm90.backward.run(head_major_units=False)).
    "units CSR order": dict(head_major_units=False),
    # dQ in the query-centric kernel (kernels/sm90/bwd_dq_sm90.py) or fused into the KV-centric
    # one (not at 64-key tiles and head dim 128: two dQ products per step).
    "dq own kernel": dict(dq_separate=True),
    "dq fused": dict(dq_separate=False),
    # 64-key tiles at head dim 128: two CTAs per SM serialise every wgmma (232 registers).
    "one CTA per SM": dict(one_cta_per_sm=True),
    # Dense walks: CTAs launched KV tile by KV tile (heads innermost), heaviest first, with the
    # dQ kernel (dispatched for compressed causal keys below ROW_BANDS_FUSED_MIN_KEYS; above,
    # the dispatch before 2026-11-27, with "... one CTA per tile" where the KV tiles fill the
    # SMs).
    "heavy first": dict(heavy_first=True, row_bands=False, dq_separate=True),
    "heavy first, one CTA per tile": dict(heavy_first=True, row_bands=False, dq_separate=True,
                                          split_rows=False),
    # Split rows by bands common to every KV tile, launched band by band, with the fused dQ:
    # its float32 sums then land in about one band of rows at a time (compressed keys: each
    # query row meets few KV tiles, and the whole accumulator missed L2, 2026-11-25).
    "row bands, fused dQ": dict(split_rows=True, row_bands=True, heavy_first=False,
                                dq_separate=False),
    "row bands": dict(split_rows=True, row_bands=True, heavy_first=False),
    # 64-key tiles: two consumer warpgroups on alternate query steps, one CTA per SM.
    "alternate steps": dict(alternate_steps=True),
    # Query rows per step (128 is dispatched at head dim 64 with 128-key tiles).
    "tile_m 64": dict(tile_m=64),
    "tile_m 128": dict(tile_m=128),
}
# Case name -> keyword arguments of the attention call (keys are N // compress_factor).
CASES = {
    "dense causal": dict(causal=True),
    "causal window 512": dict(causal=True, window_size=(511, 0)),
    "compress_factor 64": dict(causal=True, compress_factor=64),
    # Random lists of 25% of the 128- or 64-key (NSA's block size) blocks per 128-row query tile.
    "block-sparse 25%": dict(causal=False, sparse_density=0.25, sparse_block=128),
    "block-sparse 5%": dict(causal=False, sparse_density=0.05, sparse_block=128),
    "block-sparse 25% 64-key": dict(causal=False, sparse_density=0.25, sparse_block=64),
    # NSA's selected branch at the defaults: 16 random 64-key blocks per 128-row query tile,
    # one list per KV group.
    "nsa-like 16x64 per group": dict(causal=False, sparse_blocks=16, sparse_block=64),
}


def run_variant(case: str, variant: str, n: int, heads: int, heads_kv: int, dim: int,
                reps: int) -> dict:
    """In this process: time the variant's backward, compare with the dispatched one."""
    from kernels import attention_forward
    from kernels.sm90 import backward

    device = torch.device("cuda")
    kwargs = CASES[case]
    keys = n // kwargs.get("compress_factor", 1)
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(rows, h):
        return torch.randn(1, rows, h, dim, device=device, dtype=torch.bfloat16, generator=gen)

    q, k, v, dout = rand(n, heads), rand(keys, heads_kv), rand(keys, heads_kv), rand(n, heads)
    kwargs = dict(kwargs)
    if "sparse_blocks" in kwargs:
        from bench_kernels import block_sparse_case

        block = kwargs.pop("sparse_block")
        kwargs["block_sparse"] = block_sparse_case(
            n, heads_kv, kwargs.pop("sparse_blocks") * block / n, block)[0]
    if "sparse_density" in kwargs:
        from bench_kernels import block_sparse_case

        kwargs["block_sparse"] = block_sparse_case(n, heads, kwargs.pop("sparse_density"),
                                                   kwargs.pop("sparse_block"))[0]
    out, lse = attention_forward(q, k, v, **kwargs)
    common = dict(max_seqlen_q=n, max_seqlen_k=keys, **kwargs)
    if "block_sparse" in kwargs:  # the transpose once, outside the timing
        from sparsity import transpose_block_sparse_csr

        cu = torch.tensor([0, keys], dtype=torch.int32, device=device)
        common["block_sparse_transposed"] = transpose_block_sparse_csr(kwargs["block_sparse"],
                                                                       cu_seqlens_k=cu)

    def call(overrides):
        overrides = dict(overrides)
        backward.LIST_CHUNK = overrides.pop("list_chunk", chunk)
        head_major_units = overrides.pop("head_major_units", backward.UNITS_HEAD_MAJOR)
        return backward.run(dout, q, k, v, out, lse, spec_overrides=overrides or None,
                            head_major_units=head_major_units, **common)

    chunk = backward.LIST_CHUNK

    reference = call({})
    grads = call(VARIANTS[variant])
    errors = [((g.float() - r.float()).norm() / r.float().norm()).item()
              for g, r in zip(grads, reference)]
    ms = _common.time_ms(lambda: call(VARIANTS[variant]), device, warmup=2, repeats=reps,
                         gpu_only=True)
    return dict(case=case, variant=variant, n=n, ms=ms, max_rel_error=max(errors),
                status="ok" if max(errors) < 1e-2 else "wrong")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[16384])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--heads-kv", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES),
                        help="cases to run (default: all)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="variants to run (default: all; the dispatched one always runs)")
    parser.add_argument("--timeout", type=int, default=180,
                        help="seconds one variant may take (compile included) before it counts "
                             "as hung (default 180)")
    parser.add_argument("--json")
    parser.add_argument("--one", nargs=3, metavar=("CASE", "VARIANT", "N"),
                        help=argparse.SUPPRESS)  # the child process's entry
    args = parser.parse_args(argv)
    if args.one:
        case, variant, n = args.one
        print(json.dumps(run_variant(case, variant, int(n), args.heads, args.heads_kv,
                                     args.head_dim, args.reps)))
        return 0
    if not torch.cuda.is_available():
        print("tune_sm90_backward: needs an sm_90 GPU", file=sys.stderr)
        return 1
    rows = []
    for n in args.seqlens:
        for case in args.cases:
            for variant in dict.fromkeys(["dispatched", *args.variants]):
                sparse = "sparse_block" in CASES[case]
                if sparse and "split_rows" in variant:
                    continue  # split rows walk a query-tile range
                if not sparse and "list" in variant:
                    continue  # lists only when sparse
                block = CASES[case].get("sparse_block")
                if block == 64 and args.head_dim == 128 and "fused" in variant:
                    continue  # two dQ products per step: not fused (`BwdSpec.can_fuse_dq`)
                if variant == "tile_m 128" and (args.head_dim == 128 or block == 64):
                    continue  # 128-row steps: head dim 64 with two key warpgroups only
                if variant == "alternate steps" and block != 64:
                    continue  # 64-key tiles only
                if variant.startswith("heavy first") and sparse:
                    continue  # dense walks only
                rows.append(_child(case, variant, n, args))
                print(_format(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(),
                                                   rows=rows), indent=1))
    return 0


def _child(case: str, variant: str, n: int, args) -> dict:
    command = [sys.executable, __file__, "--one", case, variant, str(n), "--heads",
               str(args.heads), "--heads-kv", str(args.heads_kv), "--head-dim",
               str(args.head_dim), "--reps", str(args.reps)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return dict(case=case, variant=variant, n=n, status="hung")
    if done.returncode != 0:
        return dict(case=case, variant=variant, n=n, status="failed",
                    error=done.stderr.strip().splitlines()[-1:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def _format(row: dict) -> str:
    timing = f"{row['ms']:9.3f} ms  err {row['max_rel_error']:.1e}" if "ms" in row else ""
    return f"{row['n']:6d}  {row['case']:20s} {row['variant']:26s} {row['status']:7s} {timing}"


if __name__ == "__main__":
    sys.exit(main())
