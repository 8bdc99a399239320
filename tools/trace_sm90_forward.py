"""Where a work tile's time goes in the sm90 forward kernel, phase by phase.

Launches the traced build (`FwdSpec.trace`, kernels/sm90/trace.py), which stamps the SM cycle
counter at fixed points of every tile, and prints per phase the median and mean cycles, split
by how many KV tiles the query tile visits, plus how long the consumers waited for the
producer's loads. The timestamps cost a few instructions per tile, so compare traced numbers
with each other, and speeds with tools/tune_sm90_forward.py.

    python tools/trace_sm90_forward.py --case compressed --seqlens 16384 --variant persistent+q2
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, tune_sm90_forward

import _common  # noqa: E402
from tune_sm90_forward import add_one_case_arguments, one_case  # noqa: E402


def phase_table(buffer: torch.Tensor) -> list[tuple[str, int, str, float, float]]:
    """(role, KV tiles, phase, median cycles, mean cycles) rows from a filled trace buffer."""
    from kernels.sm90.trace import CONSUMER_EVENTS, KV_TILES_SLOT, PRODUCER_EVENTS

    data = buffer.cpu()
    ctas, roles, tiles, _ = data.shape
    consumer_kv = data[:, 1, :, KV_TILES_SLOT]
    rows = []
    for role in range(roles):
        all_events = PRODUCER_EVENTS if role == 0 else CONSUMER_EVENTS
        name = "producer" if role == 0 else f"consumer wg{role - 1}"
        # Only the events this build stamps (the others stay 0).
        present = [i for i, _ in enumerate(all_events) if bool((data[:, role, :, i] > 0).any())]
        events = [all_events[i] for i in present]
        stamps = data[:, role, :, present]
        valid = stamps[..., 0] > 0
        # A tile's period runs from its start to the next tile's start on the same CTA.
        period = torch.full(valid.shape, -1, dtype=torch.int64)
        period[:, :-1] = torch.where(valid[:, 1:], stamps[:, 1:, 0] - stamps[:, :-1, 0], -1)
        for kv in sorted(set(consumer_kv[valid].tolist())):
            sel = valid & (consumer_kv == kv)
            phases = [(f"{events[i - 1]} -> {events[i]}", stamps[..., i] - stamps[..., i - 1])
                      for i in range(1, len(events))]
            phases.append(("tile period", period))
            for phase, values in phases:
                picked = values[sel & (values >= 0) & (stamps[..., -1] > 0)]
                if picked.numel():
                    rows.append((name, int(kv), phase, float(picked.median()),
                                 float(picked.float().mean())))
    # From the producer issuing a load to consumer warpgroup 0 finding it in smem: the load's
    # latency when the consumer already waits, more when the consumer arrives late.
    producer, consumer = data[:, 0], data[:, 1]
    for kv in sorted(set(consumer_kv[consumer[..., 0] > 0].tolist())):
        sel = (consumer[..., 0] > 0) & (producer[..., 0] > 0) & (consumer_kv == kv)
        for load, issued, ready in (("Q", "q_issued", "q_ready"), ("K0", "k0_issued", "k0_ready")):
            delay = (consumer[..., CONSUMER_EVENTS.index(ready)]
                     - producer[..., PRODUCER_EVENTS.index(issued)])[sel]
            if delay.numel():
                rows.append(("producer->wg0", int(kv), f"{load} issued -> ready",
                             float(delay.median()), float(delay.float().mean())))
        # Two consumer warpgroups in the same phase at the same time contend for one unit
        # (tensor cores, MUFU) while the others idle; how far apart they run shows whether a
        # schedule (ping-pong) really puts one's softmax under the other's products.
        if roles > 2:
            other = data[:, 2]
            both = sel & (other[..., 0] > 0)
            for event in ("s0_done", "softmax0_done"):
                i = CONSUMER_EVENTS.index(event)
                apart = (other[..., i] - consumer[..., i])[both & (other[..., i] > 0)]
                if apart.numel():
                    rows.append(("wg1 - wg0", int(kv), event, float(apart.median()),
                                 float(apart.float().mean())))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_one_case_arguments(parser)
    parser.add_argument("--save", type=Path, default=None, help="write the raw buffer (.pt)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (sm_90)")
    from kernels.sm90.forward import run

    device = torch.device("cuda")
    for n in args.seqlens:
        name, q, k, v, call = one_case(args, n, device)
        plain_ms = _common.time_ms(lambda: run(q, k, v, **call), device, warmup=3, repeats=20,
                                   gpu_only=True)
        out, lse = run(q, k, v, **call)
        for _ in range(3):  # warm-up launches of the traced build; keep the last buffer
            traced_out, traced_lse, buffer = run(q, k, v, trace=True, **call)
        if not (torch.equal(out, traced_out) and torch.equal(lse, traced_lse)):
            raise SystemExit("the traced build computed a different result")
        traced_ms = _common.time_ms(lambda: run(q, k, v, trace=True, **call), device, gpu_only=True,
                                    warmup=1, repeats=10)
        torch.cuda.synchronize()
        if args.save:
            torch.save(buffer.cpu(), args.save.with_suffix(f".{n}.pt"))
        print(f"\n{_common.describe_device(device)}: {name}, N={n}, variant "
              f"{args.variant or 'dispatched'}; {plain_ms:.3f} ms untraced, "
              f"{traced_ms:.3f} ms traced; grid {buffer.shape[0]} CTAs x "
              f"{buffer.shape[2]} tiles max")
        print(f"{'role':<14} {'KV':>3} {'phase':<32} {'median':>8} {'mean':>8}  (cycles)")
        for role, kv, phase, median, mean in phase_table(buffer):
            print(f"{role:<14} {kv:>3} {phase:<32} {median:>8.0f} {mean:>8.0f}")


if __name__ == "__main__":
    main()
