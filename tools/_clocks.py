"""The GPU's SM clock and power while a benchmark times: `nvidia-smi` sampled in the background.

A GPU under its power cap lowers its clock within tens of milliseconds of heavy work: an H200
(700 W) ran attention at 1965 MHz for the first few steps and at 1650-1740 MHz after, with the
software power cap as the clock-event reason, dense FA4 and nsa() alike (FINDINGS.md). So a
kernel's time from a short profiled burst reads lower than the same kernel in a longer timed
loop, and two methods timed minutes apart may have run at different clocks. `ClockSampler`
runs `nvidia-smi --loop-ms` for the benchmark's whole run and keeps timestamped samples; after
`stop()`, `during(windows)` gives the medians over timed windows ((start, end) pairs in
wall-clock seconds of `time.time()`: one per round of a benchmark's interleaved rounds).
"""
from __future__ import annotations

import datetime
import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass

# power.draw.instant: power.draw is a one-second average on Hopper, staler than a timing.
QUERY = "timestamp,clocks.sm,power.draw.instant,clocks_event_reasons.active"
SW_POWER_CAP = 0x4  # nvidia-smi's clocks_event_reasons bit: the software power cap


@dataclass(frozen=True)
class Sample:
    time: float  # seconds since the epoch (the machine's clock, as time.time())
    sm_mhz: float
    watts: float
    reasons: int  # clocks_event_reasons.active bits


@dataclass(frozen=True)
class ClockSummary:
    sm_mhz: float  # medians over the window's samples
    watts: float
    power_capped: float  # share of the samples with the software power cap active
    samples: int


def parse_sample(line: str) -> Sample | None:
    """One `--format=csv,noheader,nounits` line of QUERY, or None for anything else (a header,
    a field nvidia-smi reports as N/A)."""
    fields = [field.strip() for field in line.split(",")]
    if len(fields) != 4:
        return None
    try:
        stamp = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f")
        return Sample(stamp.timestamp(), float(fields[1]), float(fields[2]), int(fields[3], 16))
    except ValueError:
        return None


def summarise(samples: list[Sample]) -> ClockSummary | None:
    if not samples:
        return None
    return ClockSummary(statistics.median(s.sm_mhz for s in samples),
                        statistics.median(s.watts for s in samples),
                        sum(bool(s.reasons & SW_POWER_CAP) for s in samples) / len(samples),
                        len(samples))


class ClockSampler:
    """nvidia-smi's samples of one GPU (`device_index` as nvidia-smi numbers them) every
    `interval_ms` from construction to `stop()`."""

    def __init__(self, device_index: int, interval_ms: int = 20):
        if shutil.which("nvidia-smi") is None:
            raise RuntimeError("nvidia-smi is not on PATH")
        self.samples: list[Sample] = []
        self.interval_ms = interval_ms
        # Into a pipe nvidia-smi's output is block-buffered, and the lines still in its buffer
        # when it is stopped are lost (a benchmark's last seconds): line-buffered by stdbuf.
        line_buffered = ["stdbuf", "-oL"] if shutil.which("stdbuf") else []
        self._process = subprocess.Popen(
            [*line_buffered, "nvidia-smi", "-i", str(device_index), f"--query-gpu={QUERY}",
             "--format=csv,noheader,nounits", f"--loop-ms={interval_ms}"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._process.stdout:
            sample = parse_sample(line)
            if sample is not None:
                self.samples.append(sample)

    def stop(self) -> None:
        """End the sampling (the samples stay), after two more intervals' samples."""
        time.sleep(2 * self.interval_ms / 1e3)
        self._process.terminate()
        self._process.wait()
        self._reader.join(timeout=5)

    def during(self, windows: list[tuple[float, float]]) -> ClockSummary | None:
        """The medians over the samples taken inside the (start, end) windows (time.time()),
        None where none was (windows shorter than the interval)."""
        return summarise([s for s in self.samples
                          if any(start <= s.time <= end for start, end in windows)])
