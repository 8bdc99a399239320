"""Run the GPU test suite (`pytest -m gpu`) split over the visible GPUs, one pytest per GPU.

The suite is mostly kernel compilation (host CPU) and many small launches, so N GPUs and a few
processes per GPU finish it several times sooner: the tests are collected once, dealt
round-robin to the shards (neighbouring tests, often variants of one kernel, land in different
processes), and each shard runs in its own process with CUDA_VISIBLE_DEVICES set to its GPU and
its own CuTe DSL compile cache (shards never write one cache at once). Tests marked `whole_gpu`
(they need a GPU's memory to themselves, e.g. 2M tokens) run after the shards, one at a time
per GPU. Logs go to --log-dir; the summary gives each shard's counts, the ids of its failed
and erroring tests, and the total, and the exit code is nonzero when a shard failed or
reported a failure.

    python tools/run_gpu_tests.py                          # every visible GPU, all gpu tests
    python tools/run_gpu_tests.py --gpus 2 tests/nsa       # two GPUs, the nsa tests only
    python tools/run_gpu_tests.py --per-gpu 3              # three processes on each GPU
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)")


def visible_devices(gpus: int) -> list[str]:
    """The first `gpus` devices this process may use, as CUDA_VISIBLE_DEVICES entries: a shard
    must stay inside the caller's own CUDA_VISIBLE_DEVICES (GPU 0 of a shard is the caller's
    first visible GPU, not the machine's)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = [e.strip() for e in visible.split(",") if e.strip()] if visible else \
        [str(i) for i in range(gpus)]
    if len(entries) < gpus:
        raise SystemExit(f"--gpus {gpus}: only {len(entries)} visible (CUDA_VISIBLE_DEVICES="
                         f"{visible})")
    return entries[:gpus]


WHOLE_GPU = "whole_gpu"


def collect(paths: list[str], marker: str, allow_empty: bool = False) -> list[str]:
    """The node ids pytest selects with `-m marker` under `paths` (allow_empty: none is fine)."""
    listing = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", marker,
         "-p", "no:cacheprovider", *paths], cwd=REPO, capture_output=True, text=True)
    ids = [line for line in listing.stdout.splitlines() if "::" in line]
    if listing.returncode not in (0, 5) or not (ids or allow_empty):
        raise SystemExit(f"collection failed (exit {listing.returncode}):\n{listing.stdout[-3000:]}"
                         f"\n{listing.stderr[-3000:]}")
    return ids


def deal(ids: list[str], shards: int) -> list[list[str]]:
    """Round-robin: shard i gets ids i, i + shards, ..."""
    return [ids[i::shards] for i in range(shards)]


def counts(log_tail: str) -> dict[str, int]:
    """pytest's final counts ('3 passed, 1 skipped') as a dict."""
    found: dict[str, int] = {}
    for number, kind in _COUNTS.findall(log_tail):
        found[kind.rstrip("s") if kind.startswith("error") else kind] = int(number)
    return found


def failures(log_text: str) -> list[str]:
    """The test ids pytest's short summary names as failed or erroring ('FAILED path::id -
    message', 'ERROR path::id'), without the message: the run's summary prints them, so a
    caller who only sees this process's output (a remote run that returns its tail and not
    every log) still learns which tests failed."""
    found = []
    for line in log_text.splitlines():
        kind, _, rest = line.partition(" ")
        if kind in ("FAILED", "ERROR") and "::" in rest:
            found.append(f"{kind} {rest.split(' - ')[0]}")
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("paths", nargs="*", default=["tests"], help="test paths (default: tests)")
    parser.add_argument("--gpus", type=int, default=None,
                        help="GPUs to use (default: every visible GPU)")
    parser.add_argument("--per-gpu", type=int, default=1,
                        help="processes per GPU (default 1; compilation is host work, so 2-3 "
                             "keep a GPU busier where the host has the cores)")
    parser.add_argument("--marker", default="gpu", help="pytest -m expression (default: gpu)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds; then every shard still running is interrupted (pytest "
                             "reports what it ran so far) and the summary says so")
    parser.add_argument("--log-dir", default=os.environ.get("OUT", "gpu-test-logs"),
                        help="where each shard's log goes (default: $OUT or ./gpu-test-logs)")
    args = parser.parse_args(argv)

    gpus = args.gpus
    if gpus is None:
        import torch
        gpus = torch.cuda.device_count()
    if gpus < 1:
        parser.error("--gpus: no GPU visible (give --gpus N with N >= 1 on a GPU machine)")
    if args.per_gpu < 1:
        parser.error(f"--per-gpu: expected an integer >= 1, got {args.per_gpu}")
    shared_marker = f"({args.marker}) and not {WHOLE_GPU}"
    ids = collect(args.paths, shared_marker, allow_empty=True)
    alone = collect(args.paths, f"({args.marker}) and {WHOLE_GPU}", allow_empty=True)
    if not ids and not alone:
        raise SystemExit(f"no test under {args.paths} carries -m {args.marker!r}")
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    devices = visible_devices(gpus)
    # Shared shards first (many per GPU), then the whole-GPU tests: one process per GPU, each
    # running its tests one after another, so no other test shares its GPU's memory.
    phases = [(shared_marker, [s for s in deal(ids, gpus * args.per_gpu) if s], "gpu_tests"),
              (f"({args.marker}) and {WHOLE_GPU}", [s for s in deal(alone, gpus) if s],
               "gpu_tests_whole_gpu")]
    print(f"{len(ids)} tests in {len(phases[0][1])} processes on {gpus} GPUs, then "
          f"{len(alone)} with a GPU each; logs in {log_dir}", flush=True)

    started = time.perf_counter()
    failed = False
    total: dict[str, int] = {}
    cut = ""
    # A shard outlives this process unless stopped: a caller's `timeout` (SIGTERM) or Ctrl-C
    # must not leave pytest processes compiling and running on the GPUs afterwards.
    children: list[subprocess.Popen] = []
    signal.signal(signal.SIGTERM, _raise_system_exit)
    try:
        for marker, shards, log_name in phases:
            running = []
            for index, shard in enumerate(shards):
                env = dict(os.environ, CUDA_VISIBLE_DEVICES=devices[index % gpus],
                           CUTE_DSL_CACHE_DIR=os.path.join(
                               os.environ.get("CUTE_DSL_CACHE_DIR", "/tmp/cute-dsl-cache"),
                               f"shard{index}"))
                log = open(log_dir / f"{log_name}_{index}.log", "w")
                # -v: each test's outcome in the log as it finishes, so an interrupted shard tells
                command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
                           "-p", "no:warnings", "-m", marker, *shard]
                # Its own process group: stopping a shard stops what it started too.
                process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True)
                children.append(process)
                running.append((index, process, log))
            interrupted = _wait_all([process for _, process, _ in running], started,
                                    args.time_limit)
            failed |= bool(interrupted)
            for index, process, log in running:
                code = process.wait()
                log.close()
                text = (log_dir / f"{log_name}_{index}.log").read_text()
                tail = text[-2000:]
                found = counts(tail.splitlines()[-1] if tail.strip() else "")
                for kind, number in found.items():
                    total[kind] = total.get(kind, 0) + number
                failed |= code != 0 or found.get("failed", 0) > 0 or found.get("error", 0) > 0
                print(f"{log_name} {index} (GPU {index % gpus}): exit {code}, {found}", flush=True)
                for line in failures(text):
                    print(f"  {line}", flush=True)
            if interrupted:
                cut = f"; {len(interrupted)} processes interrupted at the time limit"
                break
    finally:
        _stop(children)
    print(f"all: {total} in {time.perf_counter() - started:.0f} s{cut}", flush=True)
    return 1 if failed else 0


def _raise_system_exit(signum, _frame):
    raise SystemExit(f"run_gpu_tests: stopped by signal {signum}")


def _stop(processes) -> None:
    """Kill every process of `processes` still running, with its process group (and wait)."""
    for process in processes:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()


def _wait_all(processes, started: float, time_limit: float | None) -> list:
    """Wait for every process; past time_limit interrupt the ones left (SIGINT: pytest then
    prints its summary), kill any that outlive 30 s more. Returns the interrupted ones."""
    while time_limit is not None and any(p.poll() is None for p in processes):
        if time.perf_counter() - started > time_limit:
            left = [p for p in processes if p.poll() is None]
            for process in left:
                process.send_signal(signal.SIGINT)
            deadline = time.perf_counter() + 30
            for process in left:
                try:
                    process.wait(timeout=max(0.0, deadline - time.perf_counter()))
                except subprocess.TimeoutExpired:
                    process.kill()
            return left
        time.sleep(1)
    return []


if __name__ == "__main__":
    sys.exit(main())
