"""Masks and biases: our path (`kernels.flash_attn_func(attn_mask=, attn_bias=)`) against torch's
FlexAttention and SDPA on the same mask and bias, in one run.

Workloads (bf16, B=1, H=16, D=128, 16K tokens by default; `--seqlen`, `--heads`):
  window W   a causal sliding-window mask built at run time as a bool tensor (key j seen by row
             i when i - W < j <= i), for each W of `--windows` (32 ... 16K: the sweep of the
             dynamic-mask benchmark), with an additive bias (1, Hb, N, N) that requires a
             gradient (`--bias-heads` Hb: 1, shared by the heads, by default: FlexAttention's
             score_mod indexes a captured tensor in 32-bit arithmetic, and a per-head bias of
             16 x 16K x 16K cells (2**32) made it read out of bounds);
  tiles10    10% of the 128 x 128 tiles seen whole (random, every row's diagonal tile among
             them), the same bias; and `tiles10 mask only`, the same mask without a bias (the
             TFLOP/s share of our dense kernel's: issue 37's 70% line).
Methods:
  ours   flash_attn_func(q, k, v, attn_mask=mask, attn_bias=bias);
  ours-prepared  the same with attn_mask=kernels.prepare_mask(mask), prepared outside the
         timing as FlexAttention's BlockMask is (the tile lists, their transpose and the bias
         gradient's map of visited tiles then built at the first call and reused);
  flex   torch.nn.attention.flex_attention, compiled: a BlockMask from the same mask tensor
         (`create_block_mask`, 128 x 128 blocks, built outside the timing as a user would
         reuse it) and a score_mod that adds the bias read at (b, h, q, k), with its gradient
         (its backward one pipeline stage short of its default: FLEX_KERNEL_OPTIONS);
  sdpa   F.scaled_dot_product_attention with the float mask (the bias, -inf where the mask
         hides), its gradient flowing to the bias;
  dense  our kernel without mask or bias (non-causal), for the tiles' TFLOP/s share.
Before timing, ours and ours-prepared (those of `--methods`) are checked against the torch path
of kernels/masked.py (the reference the kernel tests use) on the first and last 256 query rows:
out, dq and dbias (a row's are exact on its own rows of q, dout, mask and bias: no causal or
window rule here); a relative error above 2e-2 stops the run (`--no-check` skips it). dk and dv
sum over every row and are left to the GPU tests (tests/kernels/test_sm90_masked.py).
Passes: fwd (no graph), fwd+bwd (gradients of q, k, v and the bias), and bwd = fwd+bwd - fwd.
CUDA events of device time after warm-up, medians. TFLOP/s count the attended pairs (4 D flops
per pair and head forward, 3.5x for forward+backward). On a GPU each method's forward+backward
line ends with the peak memory one call adds above what was allocated before it (its outputs,
gradients and temporaries; "peak +X GiB"), from one more call after the timing. Inputs are
random normal, never zeros.
Prints a table per workload and a short table of the ratios last (flex / ours, sdpa bwd /
ours bwd); `--json` writes the rows.

    python tools/bench_masked.py --json masked.json
    python tools/bench_masked.py --windows 512,4096 --methods ours,flex --seqlen 8192
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import flash_attn_func, prepare_mask  # noqa: E402
from tools._common import (add_switch_argument, describe_device, int_list,  # noqa: E402
                           parse_switches, positive_int, resolve_device, time_ms,
                           write_results_json)

TOOL = "bench_masked"
METHODS = ("ours", "ours-prepared", "flex", "sdpa", "dense")
PASSES = ("fwd", "fwd+bwd")
TILE = 128
# FlexAttention's sm90 backward default at D=128 (64 x 128 tiles, 3 stages) needs 240 KiB of
# shared memory with the bias's gradient, over the H200's 227 KiB (its compile fails): one
# stage less.
FLEX_KERNEL_OPTIONS = {"bwd_num_stages": 2}
CHECK_ROWS = 256
CHECK_TOLERANCE = 2e-2


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=positive_int, default=16384)
    parser.add_argument("--heads", type=positive_int, default=16)
    parser.add_argument("--head-dim", type=positive_int, default=128)
    parser.add_argument("--bias-heads", type=positive_int, default=1,
                        help="the bias's heads: 1 (shared) or --heads")
    parser.add_argument("--windows", type=int_list,
                        default=[32, 128, 512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--tiles", action=argparse.BooleanOptionalAction, default=True,
                        help="also the random 10%% tile mask")
    parser.add_argument("--methods", type=lambda s: s.split(","), default=list(METHODS))
    parser.add_argument("--passes", type=lambda s: s.split(","), default=list(PASSES),
                        help="fwd, fwd+bwd or both (default)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                        help="check ours against the torch path on some rows before timing")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None)
    parser.add_argument("--json", type=Path, default=None)
    add_switch_argument(parser)
    args = parser.parse_args(argv)
    args.switches = parse_switches(parser, args)
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        parser.error(f"--methods: unknown {sorted(unknown)}; choose from {METHODS}")
    if args.bias_heads not in (1, args.heads):
        parser.error(f"--bias-heads must be 1 or --heads ({args.heads}), got {args.bias_heads}")
    if not args.passes or set(args.passes) - set(PASSES):
        parser.error(f"--passes: choose from {PASSES}, got {args.passes}")
    return args


def window_mask(seqlen: int, window: int, device) -> torch.Tensor:
    rows = torch.arange(seqlen, device=device)[:, None]
    keys = torch.arange(seqlen, device=device)[None, :]
    return ((keys <= rows) & (keys > rows - window))[None, None]


def tile_mask(seqlen: int, share: float, generator, device) -> torch.Tensor:
    tiles = -(-seqlen // TILE)
    seen = torch.rand(tiles, tiles, generator=generator, device=device) < share
    seen.fill_diagonal_(True)
    cells = seen.repeat_interleave(TILE, 0).repeat_interleave(TILE, 1)
    return cells[:seqlen, :seqlen][None, None].contiguous()


def attended_pairs(mask: torch.Tensor, heads: int) -> int:
    return int(mask.sum()) * (heads if mask.shape[1] == 1 else 1)


def check_ours(q, k, v, mask, bias, dout, prepared: bool = False) -> dict:
    """{"out", "dq"[, "dbias"]: relative error} of ours (the mask `prepared` or the tensor)
    against the torch path of kernels/masked.py on the first and last CHECK_ROWS query rows (a
    row's out, dq and dbias depend only on its own rows of q, dout, mask and bias, and on every
    key); RuntimeError above CHECK_TOLERANCE."""
    from kernels import masked
    from kernels.validate import validate_attention_forward

    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    bias_leaf = None if bias is None else bias.detach().clone().requires_grad_()
    out = flash_attn_func(*leaves, attn_mask=prepare_mask(mask) if prepared else mask,
                          attn_bias=bias_leaf)
    wanted = [leaves[0]] + ([bias_leaf] if bias_leaf is not None else [])
    dq, *dbias = torch.autograd.grad(out, wanted, dout)
    seqlen = q.shape[1]
    errors: dict[str, float] = {}
    for start in sorted({0, max(seqlen - CHECK_ROWS, 0)}):
        rows = slice(start, min(start + CHECK_ROWS, seqlen))
        q_rows, dout_rows = q[:, rows], dout[:, rows]
        mask_rows = mask[..., rows, :]
        bias_rows = None if bias is None else bias[..., rows, :]
        problem = validate_attention_forward(q_rows, k, v)
        ref_out, ref_lse = masked.forward(problem, q_rows, k, v, mask_rows, bias_rows)
        ref_dq, _, _, ref_dbias = masked.backward(problem, dout_rows, q_rows, k, v, ref_out,
                                                  ref_lse, mask_rows, bias_rows,
                                                  bias_gradient=bias is not None)
        pairs = [("out", out[:, rows], ref_out), ("dq", dq[:, rows], ref_dq)]
        if bias is not None:
            pairs.append(("dbias", dbias[0][..., rows, :], ref_dbias))
        for what, got, want in pairs:
            errors[what] = max(errors.get(what, 0.0), _relative_error(got, want))
    bad = {what: error for what, error in errors.items() if not error <= CHECK_TOLERANCE}
    if bad:
        raise RuntimeError(f"ours{'-prepared' if prepared else ''} differs from the torch path "
                           f"on rows of this workload: "
                           f"{bad} (tolerance {CHECK_TOLERANCE}); nothing timed")
    return errors


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    finite = torch.isfinite(want)
    difference = (got.float() - want.float())[finite].norm()
    return (difference / want.float()[finite].norm().clamp_min(1e-12)).item()


def methods_for(args, q, k, v, mask, bias, dout) -> dict:
    """name -> {pass: callable} for each method of `--methods` on this workload (bias None:
    the mask alone)."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, bias) if x is not None]
    if bias is None:
        leaves.append(None)
    runs = {}

    def both(forward):
        def fwd():
            with torch.no_grad():
                forward(*leaves)

        def fwd_bwd():
            out = forward(*leaves)
            torch.autograd.grad(out, [x for x in leaves if x is not None], dout)
        return {"fwd": fwd, "fwd+bwd": fwd_bwd}

    if "ours" in args.methods:
        runs["ours"] = both(lambda q_, k_, v_, b_: flash_attn_func(
            q_, k_, v_, attn_mask=mask, attn_bias=b_))
    if "ours-prepared" in args.methods:
        prepared = prepare_mask(mask)
        runs["ours-prepared"] = both(lambda q_, k_, v_, b_: flash_attn_func(
            q_, k_, v_, attn_mask=prepared, attn_bias=b_))
    if "flex" in args.methods:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        compiled = torch.compile(flex_attention, dynamic=False)
        cells = mask[0, 0]
        block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: cells[q_idx, kv_idx], 1, 1,
                                       q.shape[1], k.shape[1], device=q.device,
                                       BLOCK_SIZE=TILE)

        def flex(q_, k_, v_, b_):
            add_bias = None
            if b_ is not None:
                shared = b_.shape[1] == 1

                def add_bias(score, b, h, q_idx, kv_idx):
                    return score + b_[b, 0 if shared else h, q_idx, kv_idx]
            out = compiled(*(x.transpose(1, 2) for x in (q_, k_, v_)), score_mod=add_bias,
                           block_mask=block_mask, kernel_options=FLEX_KERNEL_OPTIONS)
            return out.transpose(1, 2)
        runs["flex"] = both(flex)
    if "sdpa" in args.methods:
        hidden = ~mask

        def sdpa(q_, k_, v_, b_):
            float_mask = mask if b_ is None else b_.masked_fill(hidden, float("-inf"))
            out = torch.nn.functional.scaled_dot_product_attention(
                *(x.transpose(1, 2) for x in (q_, k_, v_)), attn_mask=float_mask)
            return out.transpose(1, 2)
        runs["sdpa"] = both(sdpa)
    if "dense" in args.methods:
        plain = [x.detach().clone().requires_grad_() for x in (q, k, v)]

        def dense_fwd():
            with torch.no_grad():
                flash_attn_func(*plain)

        def dense_fwd_bwd():
            torch.autograd.grad(flash_attn_func(*plain), plain, dout)
        runs["dense"] = {"fwd": dense_fwd, "fwd+bwd": dense_fwd_bwd}
    return runs


def measure(args, name: str, mask: torch.Tensor, device, generator,
            with_bias: bool = True) -> dict:
    n, heads, dim = args.seqlen, args.heads, args.head_dim
    q, k, v, dout = (torch.randn(1, n, heads, dim, generator=generator, device=device,
                                 dtype=torch.bfloat16) for _ in range(4))
    bias = None
    if with_bias:
        bias = torch.randn(1, args.bias_heads, n, n, generator=generator, device=device,
                           dtype=torch.bfloat16)
    pairs = attended_pairs(mask, heads)
    row = {"workload": name, "seqlen": n, "heads": heads, "head_dim": dim,
           "bias_heads": args.bias_heads if with_bias else 0,
           "kept_share": pairs / (heads * n * n), "ms": {}, "tflops": {}}
    if args.check:
        for method in ("ours", "ours-prepared"):
            if method in args.methods:
                row.setdefault("check", {})[method] = check_ours(
                    q, k, v, mask, bias, dout, prepared=method == "ours-prepared")
    for method, passes in methods_for(args, q, k, v, mask, bias, dout).items():
        counted = heads * n * n if method == "dense" else pairs
        for pass_name, fn in passes.items():
            if pass_name not in args.passes:
                continue
            try:
                ms = time_ms(fn, device, warmup=args.warmup, repeats=args.repeats,
                             gpu_only=True)
            except torch.OutOfMemoryError as error:
                print(f"{name} {method} {pass_name}: out of memory ({error})", file=sys.stderr)
                torch.cuda.empty_cache()
                continue
            row["ms"][f"{method} {pass_name}"] = ms
            if pass_name == "fwd+bwd" and device.type == "cuda":
                row.setdefault("peak_gib", {})[method] = added_peak_gib(fn, device)
            flops = 4 * dim * counted * (3.5 if pass_name == "fwd+bwd" else 1.0)
            row["tflops"][f"{method} {pass_name}"] = flops / ms / 1e9
        fwd, both = row["ms"].get(f"{method} fwd"), row["ms"].get(f"{method} fwd+bwd")
        if fwd is not None and both is not None:
            row["ms"][f"{method} bwd"] = both - fwd
    return row


def added_peak_gib(fn, device) -> float:
    """GiB that one call of fn adds to the allocator's peak above what is allocated before."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**30


def main(argv=None) -> list[dict]:
    args = parse_arguments(argv)
    device = resolve_device(args.device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    workloads = [(f"window {w}", window_mask(args.seqlen, w, device), True)
                 for w in args.windows]
    if args.tiles:
        tiles = tile_mask(args.seqlen, 0.1, generator, device)
        workloads += [("tiles10", tiles, True), ("tiles10 mask only", tiles, False)]
    for switch in args.switches:
        print(f"switch: {switch}")
    rows = []
    for name, mask, with_bias in workloads:
        row = measure(args, name, mask, device, generator, with_bias)
        rows.append(row)
        checked = "; ".join(method + "".join(f" {what} {error:.1e}"
                                             for what, error in errors.items())
                            for method, errors in row.get("check", {}).items())
        print(f"{name}: kept {row['kept_share']:.1%} of the cells"
              + (f" (against the torch path: {checked})" if checked else ""))
        for key, ms in row["ms"].items():
            tflops = row["tflops"].get(key)
            method, pass_name = key.rsplit(" ", 1)
            peak = row.get("peak_gib", {}).get(method) if pass_name == "fwd+bwd" else None
            print(f"  {key:<22} {ms:9.3f} ms" + (f"  {tflops:7.1f} TFLOP/s" if tflops else "")
                  + (f"  peak +{peak:.2f} GiB" if peak is not None else ""))
    print("\nfwd+bwd unless said; 'prepared' = ours-prepared")
    print("workload          flex/ours  flex/prepared  sdpa bwd/ours bwd  ours/dense TFLOP/s  "
          "prepared/dense")
    for row in rows:
        ms, tf = row["ms"], row["tflops"]
        ratio = lambda a, b: f"{ms[a] / ms[b]:.2f}x" if a in ms and b in ms else "-"  # noqa: E731
        share = lambda a: (f"{tf[a] / tf['dense fwd+bwd']:.0%}"  # noqa: E731
                           if a in tf and "dense fwd+bwd" in tf else "-")
        print(f"{row['workload']:<17} {ratio('flex fwd+bwd', 'ours fwd+bwd'):>9}  "
              f"{ratio('flex fwd+bwd', 'ours-prepared fwd+bwd'):>13}  "
              f"{ratio('sdpa bwd', 'ours bwd'):>17}  {share('ours fwd+bwd'):>18}  "
              f"{share('ours-prepared fwd+bwd'):>14}")
    if args.json is not None:
        write_results_json(args.json, TOOL, list(argv if argv is not None else sys.argv[1:]),
                           describe_device(device), rows)
    return rows


if __name__ == "__main__":
    main()
