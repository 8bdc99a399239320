"""Helpers the tools share: argument types, device choice, timing, random inputs."""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import random
import statistics
import time
from pathlib import Path
from typing import Callable

import torch


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def int_list(text: str) -> list[int]:
    """'1024,4096' -> [1024, 4096] (each positive)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def resolve_device(name: str | None) -> torch.device:
    """The device a tool runs on: the one asked for, else cuda when available, else cpu."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: CUDA is not available on this machine")
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device {name}: expected cpu, cuda or cuda:N")
    return device


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def describe_device(device: torch.device) -> str:
    """The GPU's name, or "cpu (N threads)", for a tool's header and JSON."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, *, warmup: int = 2,
            repeats: int = 5, gpu_only: bool = False) -> float:
    """Median wall time of fn() in milliseconds after `warmup` untimed calls.

    CUDA: one pair of events around each call. By default the span includes the host's work
    before the first launch (what an eager caller waits for). `gpu_only` measures the launched
    work alone: a spin kernel queued ahead of the start event keeps the GPU busy while the host
    prepares and enqueues fn's launches, so the events bracket device time only (kernel
    benchmarks: a 0.12 ms kernel read 0.16 ms with the host's 40-50 us in the span).
    CPU: time.perf_counter around each call.
    """
    for _ in range(warmup):
        fn()
    synchronize(device)
    spin_cycles = 0
    if gpu_only and device.type == "cuda":
        begin = time.perf_counter()
        fn()
        host_s = time.perf_counter() - begin
        synchronize(device)
        # Twice the host time plus 0.2 ms, at 2 GHz (faster than any sm90 clock: never short).
        spin_cycles = int((2 * host_s + 2e-4) * 2e9)
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if spin_cycles:
                torch.cuda._sleep(spin_cycles)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(samples)


def captured(fn: Callable[[], object]) -> Callable[[], None]:
    """fn captured in a CUDA graph (after two warm-up calls on a side stream, which compile the
    kernels and settle the allocator), returned as the graph's replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def interleaved_medians(fns: dict[str, Callable[[], object]], device: torch.device, *,
                        rounds: int, repeats: int, seed: int = 0) -> dict[str, float]:
    """Device time (ms) of each fn: the median over `rounds` rounds of each round's median of
    `repeats` calls (`time_ms`), the fns taken round robin in a shuffled order each round.

    Clocks, power and neighbours drift over a run: timing one fn's calls after another's hands
    that drift to one of them (a 64K block-sparse kernel read 0.80x FA4 when timed right after
    FA4's calls and 0.99x alone, docs/history.md section 1). Interleaved, both see the same
    drift."""
    samples: dict[str, list[float]] = {key: [] for key in fns}
    order = list(fns)
    generator = random.Random(seed)
    for _ in range(rounds):
        generator.shuffle(order)
        for key in order:
            samples[key].append(time_ms(fns[key], device, warmup=2, repeats=repeats,
                                        gpu_only=True))
    return {key: statistics.median(values) for key, values in samples.items()}


def add_num_seqs_argument(parser) -> None:
    """--num-seqs: the batch's tokens packed into random-length sequences (varlen)."""
    parser.add_argument("--num-seqs", type=positive_int,
                        help="split the batch*N tokens into this many random-length sequences "
                             "(varlen); default: batch sequences of N")


# --recompute: nsa()'s recompute argument (nsa/memory_policy.py); auto leaves nsa()'s size rule
RECOMPUTE_OPTIONS = {"auto": {}, "keep": {"recompute": False}, "recompute": {"recompute": True}}


def add_recompute_argument(parser, help_more: str = "") -> None:
    """--recompute keep|recompute|auto, read back with RECOMPUTE_OPTIONS[args.recompute]."""
    parser.add_argument("--recompute", choices=sorted(RECOMPUTE_OPTIONS), default="auto",
                        help="nsa()'s backward: keep the branch outputs (keep), recompute them "
                             "(recompute), or nsa()'s size rule (auto, the default)" + help_more)


CAPTURE_OPTIONS = {"auto": {}, "on": {"capture": True}, "off": {"capture": False}}


def add_capture_argument(parser) -> None:
    """--capture auto|on|off, read back with CAPTURE_OPTIONS[args.capture]."""
    parser.add_argument("--capture", choices=sorted(CAPTURE_OPTIONS), default="auto",
                        help="nsa()'s captured plans (nsa/captured.py): eager calls replayed "
                             "from CUDA graphs after the first (on), never (off), or nsa()'s "
                             "size rule (auto, the default)")


def add_cmp_selected_argument(parser) -> None:
    """--num-cmp-selected-blocks: nsa()'s sparse compressed branch (read by nsa_options)."""
    parser.add_argument("--num-cmp-selected-blocks", type=positive_int, default=None,
                        help="make the compressed branch block-sparse: this many KV blocks of "
                             "compressed tokens per query tile (default: dense)")


def add_layout_argument(parser, flag: str = "--layout") -> None:
    """`flag` auto|contiguous|zigzag: how the tokens are sharded over the context-parallel
    ranks (nsa.distributed.sharding), read back with resolve_layout once the mode is known."""
    from nsa.distributed import LAYOUTS

    parser.add_argument(flag, choices=("auto", *LAYOUTS), default="auto",
                        help="how the tokens are sharded over the ranks; auto: zigzag in "
                             "sequence mode (rank r holds chunks r and 2W-1-r of 2W: every rank "
                             "the same causal work), contiguous in heads mode (balanced "
                             "already: zigzag would only add a reorder of the gathered tokens)")


def resolve_layout(layout: str, mode: str) -> str:
    """The layout as run: auto is zigzag in sequence mode (each rank computes its own rows, whose
    causal work zigzag balances), contiguous in heads mode (each rank computes every row)."""
    if layout != "auto":
        return layout
    return "zigzag" if mode == "sequence" else "contiguous"


def check_num_seqs(args, parser) -> None:
    """Refuse --num-seqs beyond the tokens of the shortest N (after the problem's defaults)."""
    for seqlen in args.seqlens:
        if args.num_seqs is not None and args.num_seqs > args.batch * seqlen:
            parser.error(f"--num-seqs ({args.num_seqs}) exceeds the {args.batch * seqlen} tokens")


def table_lists(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count (..., R) int32, index (..., R, W) int32) of a boolean (..., R, C) table: each row's
    true columns, ascending, padded with 0 to the longest row W (at least 1), the layout of FA4's
    block-sparse lists (it reads only the first count entries). Fresh row-major tensors:
    `.contiguous()` keeps any stride on a size-1 dim (width-1 lists of a transposed table),
    which FA4's DLPack import refuses."""
    count = table.sum(-1, dtype=torch.int32)
    columns = torch.arange(table.shape[-1], device=table.device)
    order = torch.where(table, columns, table.shape[-1]).sort(-1).values
    width = max(int(count.max()) if count.numel() else 0, 1)
    index = order[..., :width]
    index = torch.where(index < table.shape[-1], index, 0)
    return (torch.empty(count.shape, dtype=torch.int32, device=table.device).copy_(count),
            torch.empty(index.shape, dtype=torch.int32, device=table.device).copy_(index))


def varlen_lengths(total: int, num_sequences: int, generator: torch.Generator) -> list[int]:
    """`num_sequences` random lengths (each >= 1) summing to `total`."""
    if num_sequences > total:
        raise ValueError(f"cannot split {total} tokens into {num_sequences} non-empty sequences")
    if num_sequences == 1:
        return [total]
    cuts = torch.randperm(total - 1, generator=generator)[: num_sequences - 1] + 1
    bounds = [0] + sorted(cuts.tolist()) + [total]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def cu_seqlens_of(lengths: list[int], device: torch.device) -> torch.Tensor:
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def random_qkv(shape_q: tuple[int, ...], shape_kv: tuple[int, ...], dtype: torch.dtype,
               device: torch.device, *, requires_grad: bool = False, seed: int = 0):
    """Random (never zero) q, k, v, drawn on the CPU for reproducibility then moved."""
    generator = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
               for shape in (shape_q, shape_kv, shape_kv)]
    return [t.requires_grad_(requires_grad) for t in tensors]


# ----------------------------------------------------------------------------------------------
# NSA options and problem sizes shared by the profiling, benchmark and memory tools
# ----------------------------------------------------------------------------------------------

# Per-device defaults: tiny on the CPU (a smoke run in seconds), the paper's sizes on a GPU.
PROBLEM_DEFAULTS = {
    "cpu": dict(seqlens=[512, 1024], batch=1, heads=4, kv_heads=2, head_dim=32,
                dtype="float32", compress_block_size=16, selected_block_size=16,
                num_selected_blocks=12, window_size=64),
    "cuda": dict(seqlens=[4096, 16384, 65536], batch=1, heads=32, kv_heads=8, head_dim=128,
                 dtype="bfloat16", compress_block_size=64, selected_block_size=64,
                 num_selected_blocks=16, window_size=512),
}


def add_problem_arguments(parser: argparse.ArgumentParser) -> None:
    """Sizes, dtype, device and NSA options; unset ones take PROBLEM_DEFAULTS per device."""
    group = parser.add_argument_group("problem (unset: per-device defaults, see the epilog)")
    group.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if "
                       "available)")
    group.add_argument("--seqlens", type=int_list, help="comma-separated sequence lengths N")
    group.add_argument("--batch", type=positive_int, help="sequences per batch B")
    group.add_argument("--heads", type=positive_int, help="query heads H")
    group.add_argument("--kv-heads", type=positive_int, help="key/value heads Hkv (H %% Hkv == 0)")
    group.add_argument("--head-dim", type=positive_int, help="head dimension D")
    group.add_argument("--dtype", choices=sorted(DTYPES), help="dtype of q, k, v")
    nsa_group = parser.add_argument_group("NSA options")
    nsa_group.add_argument("--compress-block-size", type=positive_int, help="l")
    nsa_group.add_argument("--selected-block-size", type=positive_int, help="l'")
    nsa_group.add_argument("--num-selected-blocks", type=positive_int, help="selected blocks n")
    nsa_group.add_argument("--window-size", type=int, help="sliding window w (0: off)")
    nsa_group.add_argument("--gate", action="store_true",
                           help="learned gates (random W_gate) instead of the mean of branches")
    timing = parser.add_argument_group("timing")
    timing.add_argument("--warmup", type=positive_int, default=2, help="untimed calls first")
    timing.add_argument("--repeats", type=positive_int, default=5, help="timed calls (median)")


# Packages whose module-level switches `--switch` may set.
SWITCH_PACKAGES = ("kernels", "nsa", "sparsity")


def add_switch_argument(parser: argparse.ArgumentParser) -> None:
    """`--switch MODULE.NAME=VALUE` (repeatable): set one of the library's module-level
    switches (an UPPER_CASE constant such as kernels.sm90.backward.OWNED_DKV_STORES) before the
    run, so an A/B of a dispatch choice is two runs of the same command."""
    parser.add_argument("--switch", action="append", default=[], metavar="MODULE.NAME=VALUE",
                        help="set a module-level switch of kernels/, nsa/ or sparsity/ first "
                             "(a Python literal of the constant's type; repeatable)")


def parse_switches(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """`apply_switches` of the parsed `--switch` options, a bad one reported as the parser's
    usage error (exit 2, the switch named)."""
    try:
        return apply_switches(args.switch)
    except ValueError as error:
        parser.error(str(error))


def apply_switches(switches: list[str]) -> list[str]:
    """Set each `MODULE.NAME=VALUE` (`add_switch_argument`); returns them as set, for the
    run's header. ValueError naming the switch where the module is not the library's or does
    not exist, the name is not an UPPER_CASE constant it has, or the value is not a literal of
    the constant's type (nothing is set then)."""
    resolved = [_resolve_switch(switch) for switch in switches]
    for module, name, value in resolved:
        setattr(module, name, value)
    return [f"{module.__name__}.{name}={value!r}" for module, name, value in resolved]


@contextlib.contextmanager
def switched(switches: list[str]):
    """`apply_switches` for the block, the previous values put back after it (an A/B in one
    process: tools/profile_kernels.py)."""
    resolved = [_resolve_switch(switch) for switch in switches]
    previous = [(module, name, getattr(module, name)) for module, name, _ in resolved]
    try:
        for module, name, value in resolved:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in reversed(previous):
            setattr(module, name, value)


def _resolve_switch(switch: str):
    """(module, name, value) of one `MODULE.NAME=VALUE`, or the ValueError of
    `apply_switches`."""
    import ast
    import importlib

    target, sep, text = switch.partition("=")
    module_name, _, name = target.rpartition(".")
    if not sep or not module_name or not name:
        raise ValueError(f"--switch {switch!r}: expected MODULE.NAME=VALUE")
    if module_name.split(".")[0] not in SWITCH_PACKAGES:
        raise ValueError(f"--switch {switch!r}: the module must be in one of "
                         f"{SWITCH_PACKAGES}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError:
        raise ValueError(f"--switch {switch!r}: no module {module_name}") from None
    if not name.isupper() or not hasattr(module, name):
        raise ValueError(f"--switch {switch!r}: {module_name} has no UPPER_CASE constant "
                         f"{name}")
    current = getattr(module, name)
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ValueError(f"--switch {switch!r}: {text!r} is not a Python literal") from None
    if type(value) is not type(current) and not (
            isinstance(current, bool) and value in (0, 1) and type(value) is int):
        raise ValueError(f"--switch {switch!r}: {name} is of type "
                         f"{type(current).__name__}, got {type(value).__name__}")
    return module, name, type(current)(value)


def add_kernel_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The attention shape of the kernel benchmarks (bench_kernels, tune_sm90_forward): issue
    3's H100 configuration by default."""
    parser.add_argument("--seqlens", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--heads-kv", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)


def problem_defaults_epilog() -> str:
    return "Per-device defaults: " + "; ".join(
        f"{device}: " + ", ".join(f"{key}={value}" for key, value in defaults.items())
        for device, defaults in PROBLEM_DEFAULTS.items())


def resolve_problem_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Fill unset options from the device's defaults and check the combination."""
    args.device = resolve_device(args.device)
    for key, value in PROBLEM_DEFAULTS[args.device.type].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.heads % args.kv_heads:
        parser.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if args.window_size < 0:
        parser.error(f"--window-size must be >= 0, got {args.window_size}")
    args.torch_dtype = DTYPES[args.dtype]


def problem_summary(args: argparse.Namespace) -> str:
    """The heads, dtype and NSA options of a resolved problem, for a tool's header line."""
    sparse_compressed = getattr(args, "num_cmp_selected_blocks", None)
    return (f"H={args.heads} Hkv={args.kv_heads} D={args.head_dim} {args.dtype}; "
            f"l={args.compress_block_size} l'={args.selected_block_size} "
            f"n={args.num_selected_blocks} w={args.window_size}"
            + ("" if sparse_compressed is None
               else f" sparse compressed branch: {sparse_compressed} KV blocks"))


def nsa_options(args: argparse.Namespace) -> dict:
    """The keyword arguments of nsa.nsa that the command line sets (the sparse compressed
    branch where the tool has add_cmp_selected_argument's option, else dense)."""
    return dict(compress_block_size=args.compress_block_size,
                selected_block_size=args.selected_block_size,
                num_selected_blocks=args.num_selected_blocks, window_size=args.window_size,
                num_cmp_selected_blocks=getattr(args, "num_cmp_selected_blocks", None))


def random_gate(heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, *,
                requires_grad: bool = False, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    W_gate = torch.randn(heads, 3, head_dim, generator=generator) * head_dim ** -0.5
    return W_gate.to(device=device, dtype=dtype).requires_grad_(requires_grad)


def causal_pairs(seqlen: int) -> int:
    """(row, key) pairs dense causal attention computes for one sequence."""
    return seqlen * (seqlen + 1) // 2


def capped_causal_pairs(seqlen: int, cap: int) -> int:
    """Pairs of causal attention where row i sees at most `cap` keys: sum of min(i + 1, cap)
    (a sliding window of `cap` tokens; 0 gives 0)."""
    cap = min(cap, seqlen)
    return cap * (cap + 1) // 2 + (seqlen - cap) * cap


def compressed_pairs(seqlen: int, compress_factor: int, cap: int | None = None) -> int:
    """Pairs of causal attention over keys compressed by `compress_factor`: row i sees
    floor((i + 1) / compress_factor) keys, at most `cap` of them where given (the sparse
    compressed branch's bound)."""
    if cap is not None and seqlen > (cap + 1) * compress_factor - 1:
        uncapped_rows = (cap + 1) * compress_factor - 1  # rows that see <= cap keys
        return (compressed_pairs(uncapped_rows, compress_factor)
                + (seqlen - uncapped_rows) * cap)
    full, rest = divmod(seqlen, compress_factor)
    return compress_factor * full * (full - 1) // 2 + full * (rest + 1)


def compressed_key_cap(num_cmp_selected_blocks: int | None) -> int | None:
    """The most compressed tokens a row of the sparse compressed branch attends to (None:
    the dense branch, no cap)."""
    from nsa.selection_rule import CMP_KV_BLOCK

    return None if num_cmp_selected_blocks is None else num_cmp_selected_blocks * CMP_KV_BLOCK


def nsa_pairs(seqlen: int, compress_block_size: int, selected_block_size: int,
              num_selected_blocks: int, window_size: int,
              num_cmp_selected_blocks: int | None = None) -> int:
    """(row, key) pairs NSA's three branches attend to in one sequence, an upper bound.

    Compressed: row i sees floor((i + 1) / l) compressed tokens (at most
    num_cmp_selected_blocks whole KV blocks of them with the sparse compressed branch).
    Selected: at most n blocks of l' keys, and never more than the i + 1 keys in the past.
    Window: min(i + 1, w). Selection scoring is not counted.
    """
    return (compressed_pairs(seqlen, compress_block_size,
                             compressed_key_cap(num_cmp_selected_blocks))
            + capped_causal_pairs(seqlen, num_selected_blocks * selected_block_size)
            + capped_causal_pairs(seqlen, window_size))


def attention_tflops(pairs: int, batch: int, heads: int, head_dim: int, ms: float, *,
                     backward: bool) -> float:
    """TFLOP/s of attention over `pairs` (row, key) pairs: 4 D flops per pair and head forward
    (QK^T and PV), 2.5x that more for the backward (the usual flash-attention count)."""
    flops = 4 * head_dim * pairs * batch * heads * (3.5 if backward else 1.0)
    return flops / (ms * 1e-3) / 1e12


def measure_seqlens(tool: str, argv: list[str], args, device: str, measure, describe) -> list:
    """results = [measure(seqlen, args) for each of args.seqlens], each printed with describe
    as it comes, and written with write_results_json when args.json is set."""
    results = []
    for seqlen in args.seqlens:
        results.append(measure(seqlen, args))
        print(describe(results[-1]))
    if args.json:
        write_results_json(args.json, tool, argv, device, results)
    return results


def write_results_json(path: Path, tool: str, argv: list[str], device: str, results) -> None:
    """Write {"meta": tool, device, torch, date, command; "results": results} to `path`."""
    meta = {"tool": tool, "device": device, "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python", f"tools/{tool}.py", *argv])}
    path.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {path}")


# --- the longest length that fits (diagnose_memory, bench_context_parallel) -------------------

def search_longest(fits_at, start: int, step: int) -> tuple[int, int | None]:
    """(good, bad): doubling from `start` until fits_at fails, then bisecting to `step`.
    good: the longest N found to fit (0 if none), bad: the shortest found not to (None if none).
    fits_at returns None to stop the search where it is (the time limit)."""
    good, bad, n = 0, None, start
    while (ok := fits_at(n)):  # double until a trial fails
        good, n = n, 2 * n
    if ok is None:
        return good, bad
    bad = n
    while bad - good > step:  # bisect between the last fit and the first failure
        n = (good + bad) // 2 // step * step
        ok = fits_at(n)
        if ok is None:
            break
        good, bad = (n, bad) if ok else (good, n)
    return good, bad


def describe_answer(pass_name: str, good: int, bad: int | None, step: int,
                    complete: bool) -> str:
    if complete:
        return (f"{pass_name}: the longest N that fits is {good} tokens (a multiple of {step}; "
                f"{bad} does not fit)")
    if good == 0 and bad is None:
        return f"{pass_name}: not searched (the time limit was reached first)"
    if bad is None:
        return (f"{pass_name}: stopped by the time limit: {good} tokens fit, no longer N was "
                f"tried")
    fitted = f"{good} fits" if good else "no N tried fits"
    return (f"{pass_name}: stopped by the time limit: the longest N that fits lies in "
            f"[{good}, {bad}) ({fitted}, {bad} does not)")
