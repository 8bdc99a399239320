"""Where an eager nsa() call spends host time: the time until the call returns, with the GPU
kept busy so that the host never waits on it, and what the host did in that time.

An eager step is as fast as the slower of the host (Python, checks, torch op dispatch, kernel
launches) and the device. `tools/bench_nsa_vs_dense.py` reports the host time beside the step;
this tool takes it apart, on one workload:

- host ms of the forward and of forward+backward: median and minimum over --repeats calls,
  each queued behind a spin kernel of about 100 ms (torch.cuda._sleep), so no call waits for the
  device, and the GPU synchronised between calls;
- with --first-launch, host ms from the forward's start to its first kernel launch (what an
  eager step from an idle GPU waits before any kernel runs), and with --cprofile the functions
  that time went to;
- step ms of forward+backward: from an idle GPU until it has run the call (host and device
  together, what a loop of such calls waits for);
- Python function calls per forward+backward (cProfile), and with --cprofile the functions
  with the most own time and the most cumulative time;
- torch ops and kernel-launch calls of one forward+backward (torch.profiler), and the table of
  host time per op.

bf16, learned gates (W_gate; `--mean-gates` for none), dO random; the other options are nsa()'s
defaults (`--capture`: with the default, calls up to 16K tokens at H=32 replay nsa()'s captured
plans after the warm-up; `--capture off` times the eager path itself).

    python tools/profile_host.py                              # 8K tokens, H=32, Hkv=8, D=128
    python tools/profile_host.py --packed lognormal-2k        # a packed workload
    python tools/profile_host.py --seqlen 16384 --cprofile
    python tools/profile_host.py --packed lognormal-2k --new-packing   # a training loop's calls
    python tools/profile_host.py --switch MODULE.NAME=VALUE           # a library switch set first
    python tools/profile_host.py --packed docs-8k --first-launch --cprofile 25

`--new-packing` gives every call a packing of its own (the workload's lengths drawn with seed 1,
2, ...; the same total tokens): a training loop over packed documents, whose packing changes
every batch, so no layout, checked signature or captured plan of an earlier call applies.
"""
from __future__ import annotations

import argparse
import cProfile
import collections
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (CAPTURE_OPTIONS, add_capture_argument, add_switch_argument,  # noqa: E402
                     cu_seqlens_of, parse_switches, positive_int)
from packed_workloads import build_workload  # noqa: E402

SPIN_CYCLES = 200_000_000  # about 100 ms of GPU clock: longer than any call's host time


def make_inputs(args, device: torch.device) -> tuple[dict, torch.Tensor]:
    """nsa()'s keyword arguments (q, k, v requiring grad, W_gate; cu_seqlens and host bounds
    for a packed workload) and a dO like the output."""
    generator = torch.Generator(device=device).manual_seed(0)
    call: dict = {}
    if args.packed:
        call.update(packing_arguments(args.packed, 0, device))
        rows = (call["host_cu_seqlens"][-1],)
    else:
        rows = (1, args.seqlen)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=generator) * scale).bfloat16()

    head_dim = args.head_dim
    for name, heads in (("q", args.heads), ("k", args.kv_heads), ("v", args.kv_heads)):
        call[name] = randn(*rows, heads, head_dim).requires_grad_()
    if not args.mean_gates:
        call["W_gate"] = randn(args.heads, 3, head_dim, scale=head_dim ** -0.5).requires_grad_()
    return call, randn(*rows, args.heads, head_dim)


def packing_arguments(workload: str, seed: int, device: torch.device) -> dict:
    """nsa()'s packing arguments for `workload` drawn with `seed`: cu_seqlens on the device,
    its host copy and max_seqlen, all made before anything is timed."""
    lengths = list(build_workload(workload, seed=seed).lengths)
    cu = cu_seqlens_of(lengths, device)
    return dict(cu_seqlens=cu, max_seqlen=max(lengths), host_cu_seqlens=tuple(cu.tolist()))


def new_packings(workload: str, calls: int, device: torch.device) -> list[dict]:
    """Packing arguments of `workload` for `calls` calls, seeds 1, 2, ...: no two alike. Made
    at once before any timing (each reads its bounds from the device)."""
    return [packing_arguments(workload, seed, device) for seed in range(1, calls + 1)]


def host_times(step, repeats: int) -> list[float]:
    """Milliseconds until `step()` returns, each call queued behind a spin kernel."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(SPIN_CYCLES)
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return times


def step_times(step, repeats: int) -> list[float]:
    """Milliseconds of `step()` from an idle GPU until the GPU has run it (synchronised on both
    sides): what a loop of such calls waits for per call, host and device together."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times


# The launchers every sm90 kernel goes through (kernels/sm90/launch.py); `FirstLaunch` wraps
# them wherever a module holds them.
_LAUNCHERS = ("launch_compiled", "launch_on_current_stream")


class FirstLaunch:
    """Within: the first call of an sm90 kernel launcher or of a CUDA graph's replay (nsa()'s
    captured plans) records `time.perf_counter()` into `at` (and disables `profile`, when
    given) before it launches. Every loaded kernels.* module's reference to a launcher is
    wrapped, as the forward and backward modules import them by name."""

    def __init__(self, profile: cProfile.Profile | None = None):
        self.at, self.profile, self.saved = None, profile, []

    def __enter__(self):
        for name, module in list(sys.modules.items()):
            if not (name == "kernels" or name.startswith("kernels.")) or module is None:
                continue
            for launcher in _LAUNCHERS:
                if callable(getattr(module, launcher, None)):
                    original = getattr(module, launcher)
                    self.saved.append((module, launcher, original))
                    setattr(module, launcher, self._wrapped(original))
        replay = torch.cuda.CUDAGraph.replay
        self.saved.append((torch.cuda.CUDAGraph, "replay", replay))
        torch.cuda.CUDAGraph.replay = self._wrapped(replay)
        return self

    def __exit__(self, *exc):
        for module, launcher, original in reversed(self.saved):
            setattr(module, launcher, original)
        self.saved.clear()

    def _wrapped(self, launcher):
        def first_launch_recorded(*args, **kwargs):
            if self.at is None:
                if self.profile is not None:
                    self.profile.disable()
                self.at = time.perf_counter()
            return launcher(*args, **kwargs)
        return first_launch_recorded


def first_launch_times(step, repeats: int, show: int) -> tuple[list[float], str]:
    """Milliseconds from `step()`'s start to its first sm90 kernel launch, each call queued
    behind a spin kernel (so none waits on the GPU); with `show`, the top functions of that
    stretch by own and by cumulative microseconds per call, from `repeats` more calls under
    cProfile (whose overhead the times above do not carry)."""
    def until_first_launch(profile=None) -> float:
        torch.cuda.synchronize()
        torch.cuda._sleep(SPIN_CYCLES)
        with FirstLaunch(profile) as first:
            if profile is not None:
                profile.enable()
            start = time.perf_counter()
            step()
            if profile is not None:
                profile.disable()
        if first.at is None:
            raise RuntimeError("the step launched no sm90 kernel and replayed no graph (is the "
                               "GPU an sm_90 one?)")
        return (first.at - start) * 1e3

    times = [until_first_launch() for _ in range(repeats)]
    text = ""
    if show:
        profile = cProfile.Profile()
        for _ in range(repeats):
            until_first_launch(profile)
        text = per_call_table(pstats.Stats(profile), repeats, show,
                              "until the first launch (cProfile)")
    torch.cuda.synchronize()
    return times, text


def per_call_table(stats: pstats.Stats, calls: int, show: int, title: str) -> str:
    """The `show` functions with the most own and the most cumulative time, in microseconds
    per call of the profiled step (pstats prints seconds to three places: all zeros here)."""
    rows = [(own, cumulative, count, pstats.func_std_string(func))
            for func, (_, count, own, cumulative, _) in stats.stats.items()]
    text = ""
    for label, key in (("own", 0), ("cumulative", 1)):
        text += f"--- {title}, {calls} calls, by {label} us per call\n"
        text += "    own us    cum us   calls  function\n"
        for own, cumulative, count, name in sorted(rows, key=lambda row: -row[key])[:show]:
            text += (f"  {own / calls * 1e6:8.1f}  {cumulative / calls * 1e6:8.1f}  "
                     f"{count / calls:6.1f}  {name}\n")
    return text


def python_calls(step, steps: int, show: int) -> tuple[float, str]:
    """Python function calls per `step()` (cProfile over `steps` calls behind one long spin),
    and the top `show` functions by own and by cumulative time (empty when show is 0)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN_CYCLES * steps)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        step()
    profile.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profile)
    calls = sum(entry[1] for entry in stats.stats.values()) / steps
    return calls, per_call_table(stats, steps, show, "cProfile") if show else ""


def op_counts(step) -> tuple[int, int, str]:
    """(aten ops, kernel-launch calls, the profiler's table) of one `step()`."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    counts = collections.Counter()
    for event in events:
        counts[event.key] += event.count
    aten = sum(n for key, n in counts.items() if key.startswith("aten::"))
    launches = sum(n for key, n in counts.items() if "LaunchKernel" in key)
    return aten, launches, events.table(sort_by="self_cpu_time_total", row_limit=30)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 3)[-1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlen", type=positive_int, default=8192,
                        help="tokens of one padded sequence (default 8192)")
    parser.add_argument("--packed", default=None,
                        help="a workload of tools/packed_workloads.py instead (lognormal-2k, "
                             "docs-8k, docs-1k, docs-256)")
    parser.add_argument("--heads", type=positive_int, default=32)
    parser.add_argument("--kv-heads", type=positive_int, default=8)
    parser.add_argument("--head-dim", type=positive_int, default=128)
    parser.add_argument("--warmup", type=positive_int, default=5)
    parser.add_argument("--repeats", type=positive_int, default=21)
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="print the N functions with the most own and cumulative time")
    parser.add_argument("--mean-gates", action="store_true",
                        help="no W_gate: each branch weighted equally (bench_nsa_vs_dense's "
                             "default)")
    parser.add_argument("--ops", action="store_true",
                        help="print torch.profiler's table of host time per op")
    parser.add_argument("--new-packing", action="store_true",
                        help="a packing of its own for every call (needs --packed): a training "
                             "loop whose packing changes every batch")
    parser.add_argument("--first-launch", action="store_true",
                        help="also time the forward's host work until its first kernel launch "
                             "or graph replay (with --cprofile: the functions in it)")
    add_capture_argument(parser)
    add_switch_argument(parser)
    args = parser.parse_args(argv)
    switched = parse_switches(parser, args)
    if args.new_packing and not args.packed:
        parser.error("--new-packing needs --packed (a workload whose lengths it redraws)")
    if not torch.cuda.is_available():
        print("profile_host: needs a CUDA GPU (it measures the host time of GPU calls)",
              file=sys.stderr)
        return 1
    from nsa import nsa

    call, dout = make_inputs(args, torch.device("cuda"))
    call.update(CAPTURE_OPTIONS[args.capture])

    packings = None
    if args.new_packing:  # every call below: warm-up and timed calls of both steps, the
        # synchronised steps, the cProfile runs (5 steps each) and the profiler's one step
        calls = (2 * (args.warmup + args.repeats) + args.repeats
                 + 5 * (2 if args.cprofile else 1) + 1
                 + (args.repeats * (2 if args.cprofile else 1) if args.first_launch else 0))
        packings = iter(new_packings(args.packed, calls, torch.device("cuda")))

    def forward():
        if packings is not None:
            call.update(next(packings))
        return nsa(**call)

    leaves = [x for x in call.values() if isinstance(x, torch.Tensor) and x.requires_grad]

    def forward_backward():
        for leaf in leaves:  # as a training step: no .grad accumulation (an add_ per leaf)
            leaf.grad = None
        torch.autograd.backward(nsa(**call), dout)

    workload = args.packed or f"{args.seqlen} tokens"
    if args.new_packing:
        workload += ", a new packing every call"
    if switched:
        workload += f" ({', '.join(switched)})"
    print(f"{torch.cuda.get_device_name()}: {workload}, H={args.heads} Hkv={args.kv_heads} "
          f"D={args.head_dim} bf16, {'mean' if args.mean_gates else 'learned'} gates")
    for name, step in (("fwd", forward), ("fwd+bwd", forward_backward)):
        for _ in range(args.warmup):
            step()
        if args.first_launch and name == "fwd":
            times, text = first_launch_times(step, args.repeats, args.cprofile)
            print(f"host ms until the forward's first launch  median "
                  f"{statistics.median(times):7.3f}  min {min(times):7.3f}")
            if text:
                print(text)
        times = host_times(step, args.repeats)
        print(f"host ms {name:8s} median {statistics.median(times):7.3f}  min {min(times):7.3f}")
    steps = step_times(forward_backward, args.repeats)
    print(f"step ms fwd+bwd  median {statistics.median(steps):7.3f}  min {min(steps):7.3f}  "
          "(host and GPU, synchronised before and after)")
    if args.cprofile:  # the forward alone first: what the host does before the GPU starts
        _, text = python_calls(forward, 5, args.cprofile)
        print(text.replace("--- cProfile", "--- forward alone, cProfile"))
    calls, text = python_calls(forward_backward, 5, args.cprofile)
    aten, launches, table = op_counts(forward_backward)
    print(f"per fwd+bwd: {calls:,.0f} Python calls, {aten} aten ops, {launches} kernel launches")
    if text:
        print(text)
    if args.ops:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
