"""Charts from the JSON of tools/bench_nsa_vs_dense.py: time and speedup against N.

Writes one PNG with two panels per pass (forward, forward+backward): milliseconds per method on
log-log axes, and the speedup of each method over the run's baseline. Needs matplotlib
(`pip install -e '.[bench]'`).

    python tools/bench_nsa_vs_dense.py --json bench.json
    python tools/plot_bench.py bench.json --out bench.png
"""
from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

PASSES = ("fwd", "fwd+bwd")


def load_results(path: Path) -> tuple[dict, dict]:
    """(meta, series) with series[pass][method] = sorted [(N, ms, speedup)] of the runs that ran."""
    try:
        payload = json.loads(path.read_text())
        meta, results = payload["meta"], payload["results"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SystemExit(f"{path}: not a bench_nsa_vs_dense JSON file ({error})")
    series: dict = defaultdict(lambda: defaultdict(list))
    for row in results:
        if row.get("status") == "ok" and row.get("ms") is not None:
            series[row["pass"]][row["method"]].append((row["seqlen"], row["ms"], row["speedup"]))
    for by_method in series.values():
        for points in by_method.values():
            points.sort()
    if not series:
        raise SystemExit(f"{path}: no successful measurements to plot")
    return meta, series


def plot(meta: dict, series: dict, out: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plot_bench needs matplotlib: pip install -e '.[bench]'")

    passes = [p for p in PASSES if p in series]
    figure, axes = plt.subplots(2, len(passes), figsize=(6 * len(passes), 8), squeeze=False)
    for column, pass_ in enumerate(passes):
        time_axis, speedup_axis = axes[0][column], axes[1][column]
        for method, points in sorted(series[pass_].items()):
            seqlens = [n for n, _, _ in points]
            time_axis.plot(seqlens, [ms for _, ms, _ in points], marker="o", label=method)
            speedups = [(n, s) for n, _, s in points if s is not None]
            if speedups:
                speedup_axis.plot(*zip(*speedups), marker="o", label=method)
        time_axis.set(title=f"{pass_}: time", xscale="log", yscale="log", ylabel="ms")
        speedup_axis.set(title=f"{pass_}: speedup over {meta.get('baseline', 'baseline')}",
                         xscale="log", yscale="log", xlabel="sequence length N",
                         ylabel="baseline ms / ms")
        speedup_axis.axhline(1.0, color="grey", linewidth=0.8)
        for axis in (time_axis, speedup_axis):
            axis.grid(True, which="both", alpha=0.3)
            axis.legend()
    problem = meta.get("problem", {})
    title = f"{meta.get('device', '?')}, {meta.get('date', '?')}: " + \
        ", ".join(f"{k}={v}" for k, v in problem.items())
    figure.suptitle(textwrap.fill(title, width=120), fontsize=8)
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Charts (PNG) from the JSON written by tools/bench_nsa_vs_dense.py.")
    parser.add_argument("json", type=Path, help="bench_nsa_vs_dense.py --json output")
    parser.add_argument("--out", type=Path, help="PNG to write (default: the JSON path with .png)")
    args = parser.parse_args(argv)
    meta, series = load_results(args.json)
    out = args.out or args.json.with_suffix(".png")
    plot(meta, series, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
