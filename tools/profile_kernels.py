"""Where an nsa() forward+backward step's device time goes, kernel by kernel, and an A/B of the
library's switches in one process.

For each workload (`--seqlens`, or `--packed` names of tools/packed_workloads.py) the tool runs
`--warmup` steps, then profiles `--repeats` steps with torch.profiler and prints the kernels by
device time per step (their mean over those steps): launches per step, ms per step, share of
the step, and the step's total kernel time. On the CPU (a smoke run; no GPU figure) it lists
the ops' own CPU time instead.

With `--switch MODULE.NAME=VALUE` (repeatable) the rounds (`--rounds`, default 4) alternate in
one process: the library's settings ("A"), the switched ones ("B"), A, B, ...; each round
re-warms (captured plans are dropped first: a graph keeps the settings it was captured with)
and prints the step's total kernel time and the kernels whose time moved most between the
two settings. Paired rounds in one process are far steadier than two processes' end-to-end
times (at 256K a forward varied by 2-3 ms between runs of the same code, FINDINGS.md).

    python tools/profile_kernels.py --seqlens 8192
    python tools/profile_kernels.py --seqlens 262144 --warmup 1 --repeats 1 --top 30
    python tools/profile_kernels.py --packed lognormal-2k \\
        --switch nsa.function.SELECTED_CONSUMES_DQ_SUMS=False
    python tools/profile_kernels.py --packed docs-8k --gaps
    python tools/profile_kernels.py --packed docs-8k --gaps --from-idle

`--gaps` also reports where the GPU sat idle during the profiled steps: the span from the
first kernel's start to the last one's end against the time kernels ran (their union), per
step, and the longest idle stretches with the kernels on either side. An eager step whose
device time exceeds its kernel time by more than a graph's launch gaps waits on its host
(a synchronisation, or host work longer than the kernels queued before it).

`--from-idle` adds, per round, the median of --repeats steps each timed from an idle GPU (a
sync before each, CUDA events around it, as the bench's eager figure): where a switch moves
the host's work and not the kernels, the kernel time stays and this moves. With `--gaps` the
profiled steps then start from an idle GPU too (a sync and a marker launch before each), and
the report counts each step from its start: the host's work before the first kernel, and every
wait inside the step, are its idle; the idle between steps (the sync) is left out.

`--graph` captures the whole step in one CUDA graph and profiles its replays (the bench's
nsa-graph method; GPU only): no host work between the kernels, so what stays between the
step's kernel time and its span is the launch gaps of the graph.

`--by-launch` gives a kernel launched n > 1 times in every step a row per launch, ` @i` for
its i-th in the step: the three branches' attention kernels share one CuTe DSL name, and
would otherwise be one row (`launch_order` says which branch each place is).

`--time-only` leaves the profiler out: each round (or the one setting, without `--switch`)
times --repeats steps from an idle GPU, as `--from-idle` does, and an A/B ends with each
setting's median over its rounds. torch.profiler's collection and processing of the events
take most of a profiled run's wall time (the two 64K-token packings with `--by-launch
--from-idle`, two warm-up and five profiled steps each, did not finish in 100 s on an H200
host, 2026-12-01), so an A/B decided by the step's time costs a fraction of the device time
this way.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (CAPTURE_OPTIONS, add_capture_argument, add_problem_arguments,  # noqa: E402
                     add_switch_argument, captured, cu_seqlens_of, describe_device, nsa_options,
                     positive_int, problem_defaults_epilog, problem_summary,
                     resolve_problem_arguments, switched, synchronize, time_ms)
from packed_workloads import (PackedWorkload, build_workload,  # noqa: E402
                              parse_workload_name)

NAME_WIDTH = 100  # characters of a kernel's name in the table (CuTe DSL names run long)


def workloads(args) -> list[tuple[str, PackedWorkload | None, int]]:
    """(label, the packing or None for padded sequences, tokens) per workload."""
    found = [(f"{args.batch} x {n} tokens" if args.batch > 1 else f"{n} tokens", None, n)
             for n in (args.seqlens if not args.packed else [])]
    for name in args.packed:
        workload = build_workload(name)
        found.append((f"{name} ({workload.documents} documents)", workload,
                      workload.total_tokens))
    return found


def make_step(args, packing: PackedWorkload | None, tokens: int):
    """One nsa() forward+backward on random inputs (never zeros), as a training step: the
    leaves' .grad cleared first; with --forward a forward alone, without autograd."""
    from nsa import nsa

    device, dtype = args.device, args.torch_dtype
    generator = torch.Generator().manual_seed(0)
    rows = (tokens,) if packing is not None else (args.batch, tokens)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)

    call = dict(nsa_options(args), **CAPTURE_OPTIONS[args.capture])
    for name, heads in (("q", args.heads), ("k", args.kv_heads), ("v", args.kv_heads)):
        call[name] = randn(*rows, heads, args.head_dim).requires_grad_()
    if args.gate:
        call["W_gate"] = randn(args.heads, 3, args.head_dim,
                               scale=args.head_dim ** -0.5).requires_grad_()
    if packing is not None:
        call.update(cu_seqlens=cu_seqlens_of(list(packing.lengths), device),
                    max_seqlen=packing.longest, host_cu_seqlens=packing.cu_seqlens())
    dout = randn(*rows, args.heads, args.head_dim)
    leaves = [x for x in call.values() if isinstance(x, torch.Tensor) and x.requires_grad]

    def step():
        for leaf in leaves:
            leaf.grad = None
        torch.autograd.backward(nsa(**call), dout)

    def forward():
        with torch.no_grad():
            nsa(**call)
    return forward if args.forward else step


# The name `idle_report` gives a step's start (the marker launched after the sync before a step
# profiled from an idle GPU): the idle before it is the sync's, the idle after it the step's.
STEP_START = "(step start)"
MARKER_KERNEL = "spin_kernel"  # torch.cuda._sleep's kernel


def kernel_times(step, steps: int, device: torch.device, intervals: list | None = None,
                 by_launch: bool = False, from_idle: bool = False) -> collections.Counter:
    """name -> (ms per step, launches per step) over `steps` profiled steps: the GPU's
    kernels (and copies) by device time, or on the CPU the ops by their own CPU time.
    intervals (a list, on a GPU): gets (start us, end us, name) of every kernel and copy.
    by_launch: a kernel launched n > 1 times in every step gets a row per launch
    (`launch_order`). from_idle (GPU): each step after a sync and a marker launch (a spin
    of no length), which `intervals` holds as a STEP_START of no length at its end and the
    table leaves out."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    synchronize(device)
    with profile(activities=[activity]) as profiler:
        for _ in range(steps):
            if from_idle and cuda:
                synchronize(device)
                torch.cuda._sleep(0)
            step()
        synchronize(device)
    recorded = []  # (start us, name, us) of each kernel (CPU: op)
    for event in profiler.events():
        if cuda:
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            if from_idle and MARKER_KERNEL in event.name:
                if intervals is not None:
                    intervals.append((event.time_range.end, event.time_range.end, STEP_START))
                continue
            microseconds = event.device_time_total
            if intervals is not None:
                intervals.append((event.time_range.start, event.time_range.end, event.name))
        else:
            microseconds = event.self_cpu_time_total
        recorded.append((event.time_range.start, event.name, microseconds))
    times: collections.Counter = collections.Counter()
    launches: collections.Counter = collections.Counter()
    for (name, launch), microseconds in (launch_order(recorded, steps) if by_launch else
                                         (((name, 0), us) for _, name, us in recorded)):
        times[name, launch] += microseconds / 1e3 / steps
        launches[name, launch] += 1
    shown = dict(zip(dict.fromkeys(name for name, _ in times),
                     shown_names(dict.fromkeys(name for name, _ in times))))
    return collections.Counter({
        shown[name] + (f" @{launch}" if launch else ""): (ms, launches[name, launch] / steps)
        for (name, launch), ms in times.items()})


def launch_order(recorded, steps: int):
    """((name, i), us) for each recorded (start, name, us): i is the launch's place (1..n) among
    its kernel's n launches of the step where every step launches that kernel n > 1 times (the
    three branches' attention kernels share one CuTe DSL name: in nsa()'s forward @1, @2, @3
    are the window, compressed and selected branch (`nsa.function.UNSELECTED_FIRST`; with it
    off, compressed, selected, window), in its backward the order
    `nsa.function.backward_order` gives), else 0."""
    by_name: dict[str, list] = collections.defaultdict(list)
    for start, name, microseconds in recorded:
        by_name[name].append((start, microseconds))
    for name, runs in by_name.items():
        per_step, left = divmod(len(runs), steps)
        for index, (_, microseconds) in enumerate(sorted(runs)):
            yield (name, index % per_step + 1 if per_step > 1 and not left else 0), microseconds


def idle_report(intervals: list, steps: int, top: int) -> str:
    """Device span against kernel time (their union) per step, and the `top` longest idle
    stretches between kernels with the kernels on either side (names cut to 60 characters).
    With STEP_START markers (steps profiled from an idle GPU) the idle before each marker (the
    sync between steps) is left out of the span and the gaps, and the idle right after one (the
    host's work before the step's first kernel) is reported apart too."""
    if not intervals:
        return "  no kernels recorded"
    intervals = sorted(intervals)
    busy, between_steps, before_first, gaps = 0.0, 0.0, 0.0, []
    current_start, current_end, current_name = intervals[0]
    for start, end, name in intervals[1:]:
        if start > current_end:
            busy += current_end - current_start
            if name == STEP_START:
                between_steps += start - current_end
            else:
                before_first += start - current_end if current_name == STEP_START else 0.0
                gaps.append((start - current_end, current_name, name))
            current_start, current_end, current_name = start, end, name
        elif end > current_end:
            current_end, current_name = end, name
    busy += current_end - current_start
    span = current_end - intervals[0][0] - between_steps
    marked = any(name == STEP_START for _, _, name in intervals)
    lines = [f"  span {span / 1e3 / steps:.3f} ms per step, kernels {busy / 1e3 / steps:.3f}, "
             f"idle {(span - busy) / 1e3 / steps:.3f} in {len(gaps) / steps:.1f} gaps "
             + (f"(of it {before_first / 1e3 / steps:.3f} before the first kernel; each step "
                f"from its start, the sync between steps left out)" if marked else
                "(the idle between the profiled steps included)"),
             f"  {'idle us':>9}  after -> before"]
    for gap, before, after in sorted(gaps, reverse=True)[:top]:
        lines.append(f"  {gap:9.1f}  {before[:60]} -> {after[:60]}")
    return "\n".join(lines)


def shown_names(full_names) -> list[str]:
    """The table's names: each kernel's first NAME_WIDTH characters, and where two kernels
    share them (CuTe DSL kernels of one class, e.g. the three branches' backward, differ only
    past them) a " #i" suffix in order of first launch, so they stay apart."""
    first = [name[:NAME_WIDTH] for name in full_names]
    count = collections.Counter(first)
    seen: collections.Counter = collections.Counter()
    shown = []
    for name in first:
        seen[name] += 1
        shown.append(f"{name} #{seen[name]}" if count[name] > 1 else name)
    return shown


def time_kind(device: torch.device) -> str:
    """What the tables add up: the GPU's kernel time, or on the CPU the ops' own time."""
    return "kernel time" if device.type == "cuda" else "CPU op time (own)"


def step_kind(args) -> str:
    return "forward" if args.forward else "forward+backward"


def total_ms(table: collections.Counter) -> float:
    return sum(ms for ms, _ in table.values())


def format_table(table: collections.Counter, top: int) -> str:
    total = total_ms(table)
    rows = sorted(table.items(), key=lambda item: -item[1][0])[:top]
    lines = [f"  {'ms/step':>9} {'share':>6} {'launches':>8}  kernel",
             *(f"  {ms:9.3f} {ms / total:6.1%} {count:8.1f}  {name}"
               for name, (ms, count) in rows),
             f"  {total:9.3f} {'100%':>6} {sum(c for _, c in table.values()):8.1f}  (all)"]
    return "\n".join(lines)


def format_moves(a: collections.Counter, b: collections.Counter, top: int) -> str:
    """The kernels whose ms per step moved most from setting A to setting B."""
    names = set(a) | set(b)
    moves = sorted(names, key=lambda n: -abs(b.get(n, (0.0, 0))[0] - a.get(n, (0.0, 0))[0]))
    lines = [f"  {'A ms':>9} {'B ms':>9} {'B - A':>9}  kernel"]
    for name in moves[:top]:
        ms_a, ms_b = a.get(name, (0.0, 0))[0], b.get(name, (0.0, 0))[0]
        lines.append(f"  {ms_a:9.3f} {ms_b:9.3f} {ms_b - ms_a:+9.3f}  {name}")
    return "\n".join(lines)


def warm(step, warmup: int, device: torch.device) -> None:
    """`warmup` steps, captured plans dropped first (a graph keeps the switches it was
    captured with: the rounds of an A/B recapture)."""
    from nsa.captured import release_captured_plans

    release_captured_plans()
    for _ in range(warmup):
        step()
    synchronize(device)


def profiled_step(step, args):
    """The step as profiled, warmed (`warm`): with --graph its capture's replay. The capture
    warms the step up on a side stream first (torch.cuda.graph's recipe) and the replays are
    warmed after it, as torch's CUDA-graph notes ask of a captured backward: gradient
    accumulators still alive from an eager step on the default stream would tie the capture
    to that stream (FINDINGS.md: how nsa()'s plans once kept them alive)."""
    if args.graph:
        step = captured(step)
    warm(step, args.warmup, args.device)
    return step


def from_idle_time(step, args) -> str:
    """With --from-idle, ", X ms from an idle GPU": the median of --repeats steps each from an
    idle GPU to its end (a sync before each, CUDA events around it: the host's work before its
    first launch and every wait on the host included, as the bench's eager figure); else ""."""
    if not args.from_idle:
        return ""
    return f", {idle_ms(step, args):.3f} ms from an idle GPU"


def idle_ms(step, args) -> float:
    """The median of --repeats steps each timed from an idle GPU (`from_idle_time`)."""
    return time_ms(step, args.device, warmup=1, repeats=args.repeats)


def profile_workload(args, label: str, packing, tokens: int) -> None:
    step = make_step(args, packing, tokens)
    if args.graph:
        label += ", the step in one CUDA graph"
    if args.time_only:
        time_rounds(args, label, step)
        return
    if not args.switch:
        step = profiled_step(step, args)
        intervals = [] if args.gaps and args.device.type == "cuda" else None
        table = kernel_times(step, args.repeats, args.device, intervals, args.by_launch,
                             from_idle=args.from_idle and args.gaps)
        print(f"\n{label}: {total_ms(table):.3f} ms of {time_kind(args.device)} per "
              f"{step_kind(args)}{from_idle_time(step, args)}")
        print(format_table(table, args.top))
        if intervals is not None:
            print(f"\n{label}: where the GPU was idle, {args.repeats} steps")
            print(idle_report(intervals, args.repeats, args.top))
        return
    tables = {"A": [], "B": []}
    for number, setting, timed in ab_rounds(step, args):
        tables[setting].append(kernel_times(timed, args.repeats, args.device,
                                            by_launch=args.by_launch))
        print(f"{label}: round {number} ({setting}) "
              f"{total_ms(tables[setting][-1]):.3f} ms of {time_kind(args.device)} per "
              f"{step_kind(args)}{from_idle_time(timed, args)}")
    # The last round of each setting, kernel by kernel.
    print(f"\n{label}: kernels that moved most, A (the library's settings) -> B "
          f"({', '.join(args.switch)}), last round of each")
    print(format_moves(tables["A"][-1], tables["B"][-1], args.top))


def ab_rounds(step, args):
    """The A/B's rounds: (round number, "A" or "B", the step warmed under that setting), A the
    library's settings and B with the switches, which stay in force until the next round."""
    for round_index in range(args.rounds):
        setting = "AB"[round_index % 2]
        with switched(args.switch if setting == "B" else []):
            yield round_index + 1, setting, profiled_step(step, args)


def time_rounds(args, label: str, step) -> None:
    """`--time-only`: the step timed from an idle GPU, one setting, or --rounds alternating
    the library's settings (A) and the switched ones (B), then each setting's median."""
    if not args.switch:
        timed = profiled_step(step, args)
        print(f"{label}: {idle_ms(timed, args):.3f} ms from an idle GPU per {step_kind(args)} "
              f"(median of {args.repeats})")
        return
    times = {"A": [], "B": []}
    for number, setting, timed in ab_rounds(step, args):
        times[setting].append(idle_ms(timed, args))
        print(f"{label}: round {number} ({setting}) {times[setting][-1]:.3f} ms from an idle "
              f"GPU per {step_kind(args)}")
    a, b = (statistics.median(times[setting]) for setting in "AB")
    print(f"{label}: median of the rounds, A (the library's settings) {a:.3f} ms, B "
          f"({', '.join(args.switch)}) {b:.3f} ms, B - A {b - a:+.3f} ms")


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 3)[-1] + "\n\n"
                                     + problem_defaults_epilog(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_problem_arguments(parser)
    parser.add_argument("--packed", action="append", default=[], metavar="WORKLOAD",
                        help="a workload of tools/packed_workloads.py (lognormal-2k, docs-8k, "
                             "docs-1k, docs-256) instead of --seqlens; repeatable")
    parser.add_argument("--top", type=positive_int, default=25,
                        help="kernels listed (default 25)")
    parser.add_argument("--rounds", type=positive_int, default=4,
                        help="A/B rounds with --switch (default 4: A, B, A, B)")
    parser.add_argument("--gaps", action="store_true",
                        help="also report the GPU's idle time and longest gaps (GPU only; "
                             "not with --switch)")
    parser.add_argument("--by-launch", action="store_true",
                        help="a row per launch for a kernel launched n > 1 times every step "
                             "(' @i': its i-th in the step; the branches' attention kernels "
                             "share one name)")
    parser.add_argument("--from-idle", action="store_true",
                        help="also time each round's steps from an idle GPU (host and device "
                             "together, as the bench's eager figure)")
    parser.add_argument("--graph", action="store_true",
                        help="capture the whole step in one CUDA graph and profile its "
                             "replays (GPU only)")
    parser.add_argument("--time-only", action="store_true",
                        help="no profiler: time the steps from an idle GPU only (each round's "
                             "with --switch, then each setting's median)")
    parser.add_argument("--forward", action="store_true",
                        help="steps of a forward alone, without autograd (as the bench's fwd "
                             "pass), instead of forward+backward")
    add_capture_argument(parser)
    add_switch_argument(parser)
    args = parser.parse_args(argv)
    resolve_problem_arguments(args, parser)
    if args.graph and args.device.type != "cuda":
        parser.error(f"--graph: captures a CUDA graph; --device is {args.device}")
    if args.gaps and args.switch:
        parser.error("--gaps: reports one setting's steps; leave out --switch")
    if args.time_only and (args.gaps or args.by_launch):
        parser.error("--time-only: no kernel table to show --gaps or --by-launch in")
    if args.rounds < 2 and args.switch:
        parser.error(f"--rounds: an A/B needs at least 2, got {args.rounds}")
    for name in args.packed:
        try:
            parse_workload_name(name)
        except ValueError as error:
            parser.error(f"--packed: {error}")
    try:
        with switched(args.switch):  # checked (and undone) before anything runs
            pass
    except ValueError as error:
        parser.error(str(error))
    return args


def main(argv=None) -> int:
    args = parse_arguments(argv)
    print(f"{describe_device(args.device)}: nsa() {step_kind(args)}, {problem_summary(args)}, "
          f"{'learned' if args.gate else 'mean'} gates, --capture {args.capture}")
    for label, packing, tokens in workloads(args):
        profile_workload(args, label, packing, tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
