"""Time compile-time variants of the sm90 forward kernel against each other and FA4.

The dispatcher (`kernels/sm90/forward.py::_spec_for`) picks a tile schedule per case; this
script is how those picks are measured. For each case it runs the default spec and the
variants (persistent CTAs, GQA heads side by side in the tile order, a second Q buffer), checks
every variant's output and lse against the one-CTA-per-tile kernel (they must agree exactly:
the schedule does not change the arithmetic), and prints a table with FA4 from the same run.

    python tools/tune_sm90_forward.py --seqlens 16384 65536 --json tune.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _common  # noqa: E402

VARIANTS = {
    "grid": dict(persistent=False, heads_fastest=False, q_stages=1, pingpong=False),
    "grid+heads": dict(persistent=False, heads_fastest=True, q_stages=1, pingpong=False),
    "grid+pingpong": dict(persistent=False, heads_fastest=False, q_stages=1, pingpong=True),
    "persistent": dict(persistent=True, heads_fastest=False, q_stages=1, pingpong=False),
    "persistent+pingpong": dict(persistent=True, heads_fastest=False, q_stages=1, pingpong=True),
    "persistent+q2": dict(persistent=True, heads_fastest=False, q_stages=2, pingpong=False),
    "persistent+q2+pingpong": dict(persistent=True, heads_fastest=False, q_stages=2,
                                   pingpong=True),
    "persistent+q2+heads": dict(persistent=True, heads_fastest=True, q_stages=2,
                                pingpong=False),
    "persistent+q2+n64+heads": dict(persistent=True, heads_fastest=True, q_stages=2, tile_n=64,
                                    pingpong=False),
    "persistent+q2+n64": dict(persistent=True, heads_fastest=False, q_stages=2, tile_n=64,
                              pingpong=False),
    # 64-row tiles, one consumer warpgroup, two CTAs per SM (tile_n 64 so that both fit).
    "m64": dict(persistent=False, heads_fastest=False, q_stages=1, pingpong=False, tile_m=64,
                tile_n=64),
    "m64+persistent": dict(persistent=True, heads_fastest=False, q_stages=1, pingpong=False,
                           tile_m=64, tile_n=64),
    "m64+persistent+q2": dict(persistent=True, heads_fastest=False, q_stages=2, pingpong=False,
                              tile_m=64, tile_n=64),
    # 64-row tiles with 128-key KV tiles: one K and one V buffer so that two CTAs fit an SM.
    "m64+n128+s1+persistent+q2": dict(persistent=True, heads_fastest=False, q_stages=2,
                                      pingpong=False, tile_m=64, tile_n=128, num_stages=1),
    "persistent+q2+pingpong+heads": dict(persistent=True, heads_fastest=True, q_stages=2,
                                         pingpong=True),
    # One tile per CTA with the output staged in the Q buffer (`o_in_q`): the freed smem buys
    # a deeper K/V pipeline or wider KV tiles (wide heads: s1 is the single-stage pick without
    # it at head dim 256).
    "grid+s1": dict(persistent=False, heads_fastest=False, q_stages=1, pingpong=False,
                    num_stages=1),
    "grid+oq": dict(persistent=False, heads_fastest=False, q_stages=1, pingpong=False,
                    o_in_q=True, num_stages=2),
    "grid+oq+s3": dict(persistent=False, heads_fastest=False, q_stages=1, pingpong=False,
                       o_in_q=True, num_stages=3),
    "grid+oq+narrow": dict(persistent=False, heads_fastest=False, q_stages=1, pingpong=False,
                           o_in_q=True, num_stages=2, narrow_first_tile=True),
    "grid+oq+pingpong": dict(persistent=False, heads_fastest=False, q_stages=1, pingpong=True,
                             o_in_q=True, num_stages=2),
    "grid+oq+n96": dict(persistent=False, heads_fastest=False, q_stages=1, pingpong=False,
                        o_in_q=True, num_stages=2, tile_n=96),
    # FA4's wide-head tile widths (80 keys at head dim 256, 112 at 192 with a 192 V).
    "grid+oq+n80": dict(persistent=False, heads_fastest=False, q_stages=1, pingpong=False,
                        o_in_q=True, num_stages=2, tile_n=80),
    "grid+oq+n112": dict(persistent=False, heads_fastest=False, q_stages=1, pingpong=False,
                         o_in_q=True, num_stages=2, tile_n=112),
    # A tile's output stored under the next tile's first Q K^T.
    "persistent+q2+defer": dict(persistent=True, heads_fastest=False, q_stages=2,
                                pingpong=False, defer_store=True),
    "persistent+q2+pingpong+defer": dict(persistent=True, heads_fastest=False, q_stages=2,
                                         pingpong=True, defer_store=True),
    "m64+persistent+q2+defer": dict(persistent=True, heads_fastest=False, q_stages=2,
                                    pingpong=False, tile_m=64, tile_n=64, defer_store=True),
    # A producer-warpgroup warp issues the output's TMA store and writes lse.
    "persistent+q2+sw": dict(persistent=True, heads_fastest=False, q_stages=2, pingpong=False,
                             store_warp=True),
    "persistent+q2+sw+defer": dict(persistent=True, heads_fastest=False, q_stages=2,
                                   pingpong=False, store_warp=True, defer_store=True),
    "persistent+q2+pingpong+sw": dict(persistent=True, heads_fastest=False, q_stages=2,
                                      pingpong=True, store_warp=True),
    "persistent+q2+pingpong+sw+defer": dict(persistent=True, heads_fastest=False, q_stages=2,
                                            pingpong=True, store_warp=True, defer_store=True),
    "m64+persistent+q2+sw": dict(persistent=True, heads_fastest=False, q_stages=2,
                                 pingpong=False, tile_m=64, tile_n=64, store_warp=True),
    # A tile's last P V under the next tile's first softmax.
    "persistent+q2+pingpong+sw+overlap": dict(persistent=True, heads_fastest=False,
                                              q_stages=2, pingpong=True, store_warp=True,
                                              tile_m=128, tile_n=128, overlap_tiles=True),
    "persistent+q2+sw+overlap": dict(persistent=True, heads_fastest=False, q_stages=2,
                                     pingpong=False, store_warp=True, tile_m=128, tile_n=128,
                                     overlap_tiles=True),
    # 128x128 tiles whatever the dispatch.
    "m128+persistent+q2+sw": dict(persistent=True, heads_fastest=False, q_stages=2,
                                  pingpong=False, tile_m=128, tile_n=128, store_warp=True),
    "m128+persistent+q2+pingpong+sw": dict(persistent=True, heads_fastest=False, q_stages=2,
                                           pingpong=True, tile_m=128, tile_n=128,
                                           store_warp=True),
    "m64+persistent+q2+sw+defer": dict(persistent=True, heads_fastest=False, q_stages=2,
                                       pingpong=False, tile_m=64, tile_n=64, store_warp=True,
                                       defer_store=True),
    # 192-row tiles: three consumer warpgroups at 160 registers (64-key tiles so that fits).
    "m192+n64+persistent+q2+sw": dict(persistent=True, heads_fastest=False, q_stages=2,
                                      pingpong=False, tile_m=192, tile_n=64, store_warp=True),
    "m192+n64+persistent+q2": dict(persistent=True, heads_fastest=False, q_stages=2,
                                   pingpong=False, tile_m=192, tile_n=64),
    "m64+persistent+q2+heads": dict(persistent=True, heads_fastest=True, q_stages=2,
                                    pingpong=False, tile_m=64, tile_n=64),
    # The first (diagonal) KV tile multiplied only as far as each warpgroup's rows see.
    "m128+persistent+q2+pingpong+sw+narrow": dict(persistent=True, heads_fastest=False,
                                                  q_stages=2, pingpong=True, tile_m=128,
                                                  tile_n=128, store_warp=True,
                                                  narrow_first_tile=True),
    "m128+persistent+q2+sw+narrow": dict(persistent=True, heads_fastest=False, q_stages=2,
                                         pingpong=False, tile_m=128, tile_n=128,
                                         store_warp=True, narrow_first_tile=True),
    "m192+n64+persistent+q2+sw+narrow": dict(persistent=True, heads_fastest=False,
                                             q_stages=2, pingpong=False, tile_m=192,
                                             tile_n=64, store_warp=True,
                                             narrow_first_tile=True),
    "m64+persistent+q2+sw+narrow": dict(persistent=True, heads_fastest=False, q_stages=2,
                                        pingpong=False, tile_m=64, tile_n=64, store_warp=True,
                                        narrow_first_tile=True),
    # The dispatched short-range schedules with a GQA group's heads side by side in the tile
    # order: the CTAs running at once then read one contiguous band of Q and O rows.
    "m128+persistent+q2+pingpong+sw+narrow+heads": dict(
        persistent=True, heads_fastest=True, q_stages=2, pingpong=True, tile_m=128, tile_n=128,
        store_warp=True, narrow_first_tile=True),
    "persistent+q2+pingpong+sw+heads": dict(persistent=True, heads_fastest=True, q_stages=2,
                                            pingpong=True, store_warp=True),
    "persistent+q2+sw+heads": dict(persistent=True, heads_fastest=True, q_stages=2,
                                   pingpong=False, store_warp=True),
    "grid+narrow": dict(persistent=False, heads_fastest=False, q_stages=1, pingpong=False,
                        narrow_first_tile=True),
    # 192x128 tiles, three consumer warpgroups (head dim 64: FA3's tile for it; 160 registers
    # hold a 64-column output, 128-key scores and P).
    "grid+m128": dict(persistent=False, heads_fastest=False, q_stages=1, pingpong=False,
                      tile_m=128, tile_n=128),
    "grid+m192+pingpong": dict(persistent=False, heads_fastest=False, q_stages=1, pingpong=True,
                               tile_m=192, tile_n=128),
    "grid+m192+n64+pingpong": dict(persistent=False, heads_fastest=False, q_stages=1,
                                   pingpong=True, tile_m=192, tile_n=64),
    "grid+m192+n64+oq+pingpong": dict(persistent=False, heads_fastest=False, q_stages=1,
                                      pingpong=True, tile_m=192, tile_n=64, o_in_q=True),
    "grid+m192+s3": dict(persistent=False, heads_fastest=False, q_stages=1, pingpong=False,
                         tile_m=192, tile_n=128, num_stages=3),
    "grid+m192": dict(persistent=False, heads_fastest=False, q_stages=1, pingpong=False,
                      tile_m=192, tile_n=128),
    "m192+n64+persistent+q2+pingpong+sw+narrow": dict(
        persistent=True, heads_fastest=False, q_stages=2, pingpong=True, tile_m=192, tile_n=64,
        store_warp=True, narrow_first_tile=True),
    "m192+persistent+q2+pingpong+sw+heads": dict(persistent=True, heads_fastest=True,
                                                 q_stages=2, pingpong=True, tile_m=192,
                                                 tile_n=128, store_warp=True),
    "m192+persistent+q2+sw+heads": dict(persistent=True, heads_fastest=True, q_stages=2,
                                        pingpong=False, tile_m=192, tile_n=128,
                                        store_warp=True),
    # Head dim 256's persistent schedule (one Q buffer, one K/V stage, 64-key tiles), for
    # cases whose dispatch is one tile per CTA there (packed short sequences).
    "persistent+s1+n64+pingpong+sw+heads": dict(persistent=True, heads_fastest=True,
                                                q_stages=1, pingpong=True, store_warp=True,
                                                num_stages=1, tile_n=64),
    # ... or with 48-key tiles, which leave room for two K/V stages beside the output buffer.
    "persistent+n48+pingpong+sw+heads": dict(persistent=True, heads_fastest=True, q_stages=1,
                                             pingpong=True, store_warp=True, num_stages=2,
                                             tile_n=48),
    # Short lists of 64-key blocks (NSA's selected branch): ping-pong, a deeper K/V pipeline
    # (a stage is half a 128-key one), the heads of a group side by side (lists per KV head).
    "persistent+q2+pingpong+sw+s3": dict(persistent=True, heads_fastest=False, q_stages=2,
                                         pingpong=True, store_warp=True, num_stages=3),
    "persistent+q2+sw+s4": dict(persistent=True, heads_fastest=False, q_stages=2,
                                pingpong=False, store_warp=True, num_stages=4),
    "persistent+q2+pingpong+sw+s4": dict(persistent=True, heads_fastest=False, q_stages=2,
                                         pingpong=True, store_warp=True, num_stages=4),
    "persistent+q2+sw+s4+heads": dict(persistent=True, heads_fastest=True, q_stages=2,
                                      pingpong=False, store_warp=True, num_stages=4),
    "persistent+q2+pingpong+sw+s4+heads": dict(persistent=True, heads_fastest=True,
                                               q_stages=2, pingpong=True, store_warp=True,
                                               num_stages=4),
}


def variant_overrides(name: str) -> dict:
    """FwdSpec fields of a variant; the output-path switches it does not name are off (not the
    dispatcher's picks), so a variant means the same kernel whatever the dispatch. Fields it
    does not name at all keep the dispatcher's pick: a variant without tile_m/tile_n runs
    192x128 tiles at head dim 64 over long ranges, 128x128 (or 64-key) tiles elsewhere.
    "dispatched" is the dispatcher's own pick (no overrides); "dispatched+screen" the same
    with the V of every masked tile read for non-finite values first (kernels/sm90/screen.py:
    the least that keeping masked keys out of P V exactly would cost)."""
    if name == "dispatched":
        return {}
    if name == "dispatched+screen":
        return dict(screen_masked_v=True)
    return dict(store_warp=False, defer_store=False, overlap_tiles=False,
                narrow_first_tile=False, o_in_q=False) | VARIANTS[name]


def packed_lengths(n: int, short: str) -> list[int]:
    """The sequence lengths of a packed case: "packed<L>" is n / L sequences of L tokens,
    "mixed<S>" S random lengths (seeded) summing to n."""
    if short.startswith("packed"):
        length = int(short.removeprefix("packed"))
        if n % length:
            raise ValueError(f"{short}: {n} tokens are not a whole number of {length}-token "
                             f"sequences")
        return [length] * (n // length)
    return _common.varlen_lengths(n, int(short.removeprefix("mixed")),
                                  torch.Generator().manual_seed(0))


def cases(n: int, heads: int, names=("window", "compressed", "dense"), heads_kv: int = 0):
    """(name, attended pairs per head, kwargs for run, FA4 kwargs or None, kv length, packed
    sequence lengths or None for one sequence of n) of the case names in `names`
    (CASE_NAMES). heads_kv: the KV heads, for "nsa16"'s lists (one per KV head)."""
    for short in names:
        if short.startswith(("packed", "mixed")):  # dense causal over packed sequences
            lengths = packed_lengths(n, short)
            yield (CASE_NAMES[short], sum(_common.causal_pairs(m) for m in lengths),
                   dict(causal=True), dict(causal=True), n, lengths)
        elif short == "window":
            window = 512
            yield ("causal window 512", _common.capped_causal_pairs(n, window),
                   dict(causal=True, window_size=(window - 1, 0)),
                   dict(causal=True, window_size=(window - 1, 0)), n, None)
        elif short == "compressed":
            cf = 64
            yield ("compress_factor 64", _common.compressed_pairs(n, cf),
                   dict(causal=True, compress_factor=cf), None, n // cf, None)
        elif short == "dense":
            yield ("dense causal", _common.causal_pairs(n), dict(causal=True),
                   dict(causal=True), n, None)
        elif short == "full":
            yield ("dense non-causal", n * n, dict(causal=False), dict(causal=False), n, None)
        else:  # bench_kernels' random lists: 5% / 25% of 128x128 blocks, or 16 64-key blocks
            import bench_kernels

            list_heads = heads
            if short in ("selected16", "nsa16"):
                density, block_n = 16 / (n // 64), 64
                if short == "nsa16":  # NSA's selected branch: a GQA group shares its lists
                    if not heads_kv:
                        raise ValueError("nsa16: lists per KV head need heads_kv")
                    list_heads = heads_kv
            else:
                density, block_n = int(short.removeprefix("sparse")) / 100, 128
            ours_lists, fa4_lists, pairs = bench_kernels.block_sparse_case(
                n, list_heads, density, block_n)
            fa4_kwargs = None
            if fa4_lists is not None:
                fa4_kwargs = dict(causal=False, block_sparse_tensors=fa4_lists)
            yield (CASE_NAMES[short], pairs, dict(causal=False, block_sparse=ours_lists),
                   fa4_kwargs, n, None)


# --case names (--cases here; one --case for the tools that run one: trace_sm90_forward,
# launch_sm90_forward).
CASE_NAMES = {"window": "causal window 512", "compressed": "compress_factor 64",
              "dense": "dense causal", "full": "dense non-causal", "sparse5": "block-sparse 5%",
              "sparse25": "block-sparse 25%", "selected16": "16 64-key blocks",
              "nsa16": "16 64-key blocks/group",
              "packed256": "causal 256-token seqs", "packed1024": "causal 1024-token seqs",
              "packed4096": "causal 4096-token seqs", "packed8192": "causal 8192-token seqs",
              "mixed32": "causal 32 random seqs"}


def add_one_case_arguments(parser: argparse.ArgumentParser) -> None:
    """Kernel shape, --case and --variant, for the tools that run one case."""
    _common.add_kernel_shape_arguments(parser)
    parser.add_argument("--case", choices=sorted(CASE_NAMES), default="compressed")
    parser.add_argument("--variant", default=None,
                        help="a tools/tune_sm90_forward.py variant (default: the dispatcher's)")


def one_case(args: argparse.Namespace, n: int, device: torch.device):
    """(case name, q, k, v, `run` keywords) of --case at length n (seeded random inputs), with
    --variant's spec overrides."""
    torch.manual_seed(0)
    q = torch.randn(n, args.heads, args.head_dim, device=device, dtype=torch.bfloat16)
    name, _, kwargs, _, n_k, lengths = next(cases(n, args.heads, [args.case], args.heads_kv))
    k, v, call = case_inputs(q, n, n_k, kwargs, args.heads_kv, lengths)
    call["spec_overrides"] = variant_overrides(args.variant) if args.variant else None
    return name, q, k, v, call


def case_inputs(q, n: int, n_k: int, kwargs: dict, heads_kv: int, lengths=None):
    """Random k, v (n_k keys) for query q of one length-n sequence (or of packed sequences of
    `lengths`, keys alike), and the `run` keywords of the case."""
    k = torch.randn(n_k, heads_kv, q.shape[-1], device=q.device, dtype=q.dtype)
    v = torch.randn_like(k)
    if lengths is None:
        cu_q = torch.tensor([0, n], dtype=torch.int32, device=q.device)
        cu_k = torch.tensor([0, n_k], dtype=torch.int32, device=q.device)
        max_q, max_k = n, n_k
    else:
        cu_q = cu_k = _common.cu_seqlens_of(lengths, q.device)
        max_q = max_k = max(lengths)
    call = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                softmax_scale=q.shape[-1] ** -0.5, **kwargs)
    return k, v, call


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_kernel_shape_arguments(parser)
    parser.add_argument("--reps", type=int, default=10, help="timed calls per round")
    parser.add_argument("--rounds", type=int, default=5, help="round-robin rounds (median)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated variant names, or 'dispatched'")
    parser.add_argument("--cases", default="window,compressed,dense",
                        help=f"comma-separated, of {','.join(CASE_NAMES)}")
    parser.add_argument("--skip-dense", action="store_true", help="leave out dense causal")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    case_names = [name for name in args.cases.split(",")
                  if not (args.skip_dense and name == "dense")]
    unknown = sorted(set(case_names) - set(CASE_NAMES))
    if unknown:
        parser.error(f"--cases: unknown {unknown}; choose from {sorted(CASE_NAMES)}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (sm_90)")
    from kernels.sm90.forward import run

    device = torch.device("cuda")
    variants = args.variants.split(",")
    rows = []
    for n in args.seqlens:
        torch.manual_seed(0)
        q = torch.randn(n, args.heads, args.head_dim, device=device, dtype=torch.bfloat16)
        for name, pairs, kwargs, fa4_kwargs, n_k, lengths in cases(n, args.heads, case_names,
                                                                       args.heads_kv):
            k, v, call = case_inputs(q, n, n_k, kwargs, args.heads_kv, lengths)
            def tflops(ms, pairs=pairs):
                return _common.attention_tflops(pairs, 1, args.heads, args.head_dim, ms,
                                                backward=False)
            reference = None
            timed = {}
            if fa4_kwargs is not None:
                try:
                    from flash_attn.cute.interface import flash_attn_func, flash_attn_varlen_func

                    if lengths is None:
                        timed["FA4"] = lambda: flash_attn_func(q[None], k[None], v[None],
                                                               **fa4_kwargs)
                    else:
                        packed = {key: call[key] for key in (
                            "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")}
                        timed["FA4"] = lambda: flash_attn_varlen_func(q, k, v, **packed,
                                                                      **fa4_kwargs)
                except ImportError:
                    pass
            diffs = {}
            for variant in variants:
                overrides = variant_overrides(variant)
                try:
                    out, lse = run(q, k, v, spec_overrides=overrides, **call)[:2]
                    torch.cuda.synchronize()
                except Exception as error:  # report a variant that cannot launch, go on
                    rows.append(dict(seqlen=n, case=name, variant=variant, error=repr(error)))
                    print(f"{n} {name} {variant}: {error!r}", file=sys.stderr)
                    continue
                if reference is None:
                    reference = (out, lse)
                diffs[variant] = max(
                    (out.float() - reference[0].float()).abs().max().item(),
                    (lse - reference[1]).nan_to_num(0.0, 0.0, 0.0).abs().max().item())
                timed[variant] = (lambda o: lambda: run(q, k, v, spec_overrides=o, **call))(
                    overrides)
            medians = _common.interleaved_medians(timed, device, rounds=args.rounds,
                                                  repeats=args.reps)
            fa4_ms = medians.get("FA4")
            for variant in diffs:
                ms = medians[variant]
                rows.append(dict(seqlen=n, case=name, variant=variant, ms=ms,
                                 tflops=tflops(ms), fa4_ms=fa4_ms,
                                 fa4_over_ours=fa4_ms / ms if fa4_ms else None,
                                 max_diff_vs_first=diffs[variant]))
    print(f"\n{_common.describe_device(device)}, bf16, B=1, H={args.heads}, "
          f"Hkv={args.heads_kv}, D={args.head_dim}, medians of {args.rounds} rounds x "
          f"{args.reps} calls, variants interleaved")
    print(f"{'N':>6} {'case':<22} {'variant':<24} {'ms':>8} {'TFLOP/s':>8} {'FA4 ms':>8} "
          f"{'FA4/ours':>8} {'diff':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['seqlen']:>6} {r['case']:<22} {r['variant']:<24} error")
            continue
        fa4 = f"{r['fa4_ms']:.3f}" if r["fa4_ms"] else "-"
        ratio = f"{r['fa4_over_ours']:.2f}" if r["fa4_over_ours"] else "-"
        print(f"{r['seqlen']:>6} {r['case']:<22} {r['variant']:<24} {r['ms']:>8.3f} "
              f"{r['tflops']:>8.0f} {fa4:>8} {ratio:>8} {r['max_diff_vs_first']:>8.1e}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
