"""Train a causal LM with NSA and with dense attention on real long documents, side by side.

The documents are the Python source files this machine already has (the standard library and
torch's package: nsa/models/corpus.py), one per file or, with --documents package, one per
directory (long documents), byte-level tokens, packed into batches of exactly --seq-len tokens
with cu_seqlens (documents never attend to each other; long ones are split). A fixed rule
holds out ~5% of the documents; held-out loss is measured on a fixed set of held-out
batches every --eval-every steps.

With --attention both, the NSA model and the dense model (nsa.models.CausalLM with
attention="nsa" / "dense": identical in every shared weight, built from one seed) train on the
same batches in the same order with the same optimizer and schedule, one after the other. The
JSON holds both curves (train loss and held-out loss against steps, tokens and training
seconds), tokens/s, and the comparison at equal tokens and at equal wall-clock; the PNG draws
them (needs matplotlib: pip install -e '.[plot]').

    python tools/train_lm.py --model tiny --device cpu --seq-len 2048 --steps 20
    python tools/train_lm.py --model base --seq-len 32768 --steps 1200 --minutes 10 \\
        --json lm_32k.json --png lm_32k.png                          # H100: the comparison

Two GPUs can train the two models at once, one each (--attention nsa / dense, the same other
arguments: the same batches in the same order), and --combine joins the two JSON files into
the comparison:

    CUDA_VISIBLE_DEVICES=0 python tools/train_lm.py --attention nsa --json nsa.json ... &
    CUDA_VISIBLE_DEVICES=1 python tools/train_lm.py --attention dense --json dense.json ... &
    wait; python tools/train_lm.py --combine nsa.json dense.json --json lm.json --png lm.png

Across GPUs (context parallelism, NSA only): `torchrun --nproc-per-node N tools/train_lm.py
--context-parallel N --attention nsa ...` shards every batch's tokens over the N ranks (the
batch's cu_seqlens on all), runs each layer's nsa() across them (nsa.distributed: heads mode
where N divides the KV heads, else sequence mode), averages the gradients over the ranks and
steps the same optimizer on each; rank 0 prints and writes. --cp-layout picks the shards
(default auto: zigzag, rank r holding chunks r and 2N-1-r of 2N, in sequence mode, whose causal
work it balances; contiguous 1/N in heads mode, balanced either way); the JSON records the one
used. tokens/s counts the whole batch. Dense attention has no context-parallel path here.

Timing: training seconds exclude evaluation; each step ends with loss.item() (a sync) on a GPU,
so a step's time is its device time. tokens/s is measured after --warmup-steps steps (the first
steps compile kernels).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (add_layout_argument, positive_int, resolve_device,  # noqa: E402
                     resolve_layout)
from nsa.distributed import choose_mode, shard_ranges, shard_sequence  # noqa: E402
from nsa.distributed.sharding import chunks_per_rank  # noqa: E402
from nsa.models.corpus import (DOCUMENT_UNITS, DocumentPacker, find_documents,  # noqa: E402
                               heldout_batches, source_roots, split_documents)
from nsa.models.lm import MODEL_PRESETS, CausalLM, LMConfig  # noqa: E402

LR_DEFAULTS = {"tiny": 3e-3, "small": 6e-4, "base": 6e-4}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a causal LM with NSA and dense attention on real long documents "
                    "(Python source files), same seed, data and model; writes JSON and a PNG.")
    parser.add_argument("--attention", choices=["nsa", "dense", "both"], default="both")
    parser.add_argument("--model", choices=sorted(MODEL_PRESETS), default=None,
                        help="size preset (default: base on a GPU, tiny on a CPU)")
    parser.add_argument("--seq-len", type=positive_int, default=None,
                        help="tokens per packed batch (default 32768 on a GPU, 2048 on a CPU)")
    parser.add_argument("--steps", type=positive_int, default=None,
                        help="optimizer steps per model (the schedule's length; default 1000 "
                             "on a GPU, 20 on a CPU)")
    parser.add_argument("--minutes", type=float, default=None,
                        help="training time budget per model: stop when it is spent, and "
                             "anneal the learning rate by the larger of step and time progress")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N")
    parser.add_argument("--seed", type=int, default=0, help="weights and data order")
    parser.add_argument("--lr", type=float, default=None, help="peak AdamW learning rate")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help="learning-rate warm-up steps, and steps left out of tokens/s "
                             "(default: 2%% of --steps, at least 2)")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="held-out evaluation every N steps (0: only at the start and end; "
                             "default: --steps / 10)")
    parser.add_argument("--eval-batches", type=positive_int, default=4,
                        help="held-out batches of --seq-len tokens per evaluation")
    parser.add_argument("--corpus", choices=["stdlib", "stdlib+torch"], default="stdlib+torch",
                        help="which installed sources make the documents")
    parser.add_argument("--documents", choices=DOCUMENT_UNITS, default="file",
                        help="one document per source file, or per directory of them "
                             "(package: long documents, most longer than a 32K batch)")
    parser.add_argument("--max-documents", type=positive_int, default=None,
                        help="use only the first N training documents (and N/20 held-out)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--png", type=Path, help="draw the loss curves and throughput here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--test-q-tile", type=positive_int, default=None,
                        help="test only: nsa()'s selection tile (tiny CPU runs)")
    parser.add_argument("--context-parallel", type=positive_int, default=1, metavar="N",
                        help="shard each batch's tokens over N ranks (run under torchrun "
                             "--nproc-per-node N; NSA only; --seq-len splits into N equal "
                             "chunks, 2N with --cp-layout zigzag; heads mode where N divides "
                             "the KV heads, else sequence mode)")
    add_layout_argument(parser, "--cp-layout")
    parser.add_argument("--profile-step", type=positive_int, default=None, metavar="N",
                        help="profile optimizer step N (torch.profiler, CPU and CUDA): print "
                             "its wall time, the GPU's busy time and the ops with the most "
                             "GPU time, and keep the summary in the JSON")
    parser.add_argument("--combine", nargs=2, type=Path, metavar=("NSA_JSON", "DENSE_JSON"),
                        help="train nothing: join an --attention nsa run's JSON and an "
                             "--attention dense run's (same model, data and seed) into the "
                             "comparison, written with --json / --png")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.device = resolve_device(args.device)
    if args.device.type == "cuda" and "LOCAL_RANK" in os.environ and args.device.index is None:
        args.device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))  # a rank, its GPU
    on_gpu = args.device.type == "cuda"
    args.model = args.model or ("base" if on_gpu else "tiny")
    args.seq_len = args.seq_len or (32768 if on_gpu else 2048)
    args.steps = args.steps or (1000 if on_gpu else 20)
    args.lr = args.lr or LR_DEFAULTS[args.model]
    if args.warmup_steps is None:
        args.warmup_steps = max(2, args.steps // 50)
    if args.eval_every is None:
        args.eval_every = max(1, args.steps // 10)
    if args.minutes is not None and args.minutes <= 0:
        parser.error(f"--minutes must be positive, got {args.minutes}")
    # The mode every layer's nsa() will choose (its default, "auto"), and the layout for it.
    mode = choose_mode("auto", args.context_parallel, MODEL_PRESETS[args.model].num_kv_heads)
    args.cp_layout = resolve_layout(args.cp_layout, mode)
    if args.context_parallel > 1:
        if args.attention != "nsa":
            parser.error(f"--context-parallel {args.context_parallel}: only --attention nsa "
                         f"runs across ranks, got --attention {args.attention}")
        try:  # the training batches are exactly --seq-len tokens: the layout must split them
            shard_ranges(args.seq_len, rank=0, world_size=args.context_parallel,
                         layout=args.cp_layout, name="--seq-len")
        except ValueError as error:
            parser.error(f"--context-parallel {args.context_parallel}: {error}")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != args.context_parallel:
            parser.error(f"--context-parallel {args.context_parallel}: run under torchrun "
                         f"--nproc-per-node {args.context_parallel} (WORLD_SIZE is {world})")
    return args


def model_config(args: argparse.Namespace, attention: str) -> LMConfig:
    config = MODEL_PRESETS[args.model].with_attention(attention)
    if args.device.type != "cuda":
        config = replace(config, compute_dtype="float32")  # no bf16 kernels on a CPU
    if args.test_q_tile is not None:
        config = replace(config, test_q_tile=args.test_q_tile)
    return config


def learning_rate(progress: float, step: int, args: argparse.Namespace) -> float:
    """Linear warm-up over --warmup-steps, then cosine to 10% of the peak at progress 1."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Ranks:
    """The context-parallel ranks of a torchrun launch (--context-parallel N, the tokens
    sharded by --cp-layout), or this process alone (N = 1: every method is then the
    identity)."""

    def __init__(self, size: int, device: torch.device, layout: str = "contiguous"):
        self.size, self.rank, self.group, self.layout = size, 0, None, layout
        # A batch's tokens must be a multiple of this to shard (2N chunks for zigzag); one
        # process shards nothing.
        self.tokens_multiple = size * chunks_per_rank(layout) if size > 1 else 1
        if size > 1:
            import torch.distributed as dist

            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
            self.rank, self.group = dist.get_rank(), dist.group.WORLD

    @property
    def first(self) -> bool:
        """Rank 0: the one that prints and writes."""
        return self.rank == 0

    def model_inputs(self, batch) -> dict:
        """CausalLM's arguments for `batch` (on the device): this rank's shard of the tokens
        and labels (the batch's labels are already the next tokens, so they shard like the
        tokens), the whole batch's bounds, the group and the layout."""
        inputs = dict(batch.model_inputs(), input_ids=batch.input_ids, labels=batch.labels)
        if self.group is not None:
            inputs.update(
                input_ids=shard_sequence(batch.input_ids, self.group, layout=self.layout),
                labels=shard_sequence(batch.labels, self.group, layout=self.layout),
                context_parallel_group=self.group, context_parallel_layout=self.layout)
        return inputs

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The ranks' mean of a (detached) tensor: CausalLM's loss shares give the batch's."""
        value = value.detach().clone()
        if self.group is not None:
            import torch.distributed as dist

            dist.all_reduce(value, group=self.group)
            value /= self.size
        return value

    def average_gradients(self, model: torch.nn.Module) -> None:
        """Each gradient averaged over the ranks (summed, then divided: gloo has no average)."""
        if self.group is None:
            return
        import torch.distributed as dist

        for parameter in model.parameters():
            if parameter.grad is not None:
                dist.all_reduce(parameter.grad, group=self.group)
                parameter.grad /= self.size

    def close(self, completed: bool) -> None:
        """The group's end. After a completed run every rank first waits for the others, so
        that none closes its connections while a peer may still be finishing a collective over
        them; after a failure no rank waits (the others may never arrive: the launcher stops
        them once this one exits)."""
        if self.group is not None:
            import torch.distributed as dist

            if completed:
                dist.barrier(group=self.group)
            dist.destroy_process_group()
            self.group = None
            # Objects still in reference cycles (autograd contexts that held the group) go now,
            # not during the interpreter's teardown, where a backend's threads may no longer
            # take the GIL to free what they hold.
            gc.collect()


@torch.no_grad()
def heldout_loss(model: CausalLM, batches, device: torch.device, ranks: Ranks) -> float:
    """Mean loss per held-out target token over the fixed held-out batches (a batch whose
    tokens the ranks do not divide gets a filler document without targets)."""
    model.eval()
    total, count = 0.0, 0
    for batch in batches:
        batch = batch.padded_to_multiple(ranks.tokens_multiple).to(device)
        loss = ranks.mean(model(**ranks.model_inputs(batch)))
        targets = batch.num_targets  # a device read: once per batch
        total += float(loss) * targets
        count += targets
    model.train()
    return total / count


def train_one(attention: str, args, train_documents, eval_set, ranks: Ranks) -> dict:
    config = model_config(args, attention)
    torch.manual_seed(args.seed)
    model = CausalLM(config, seed=args.seed).to(args.device)
    fused = args.device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=args.weight_decay, fused=fused)
    packer = DocumentPacker(train_documents, args.seq_len, seed=args.seed)
    budget = None if args.minutes is None else args.minutes * 60
    if ranks.first:
        print(f"[{attention}] {model.num_parameters() / 1e6:.1f}M parameters, {config}"
              + (f", context parallel over {ranks.size} ranks ({ranks.layout} layout)"
                 if ranks.size > 1 else ""))

    record = dict(attention=attention, parameters=model.num_parameters(),
                  config=config.to_dict(), steps=[], train_loss=[], tokens=[], seconds=[],
                  lr=[], eval=[])

    def evaluate(step: int, tokens: int, seconds: float) -> None:
        loss = heldout_loss(model, eval_set, args.device, ranks)
        record["eval"].append(dict(step=step, tokens=tokens, seconds=seconds,
                                   heldout_loss=loss))

    evaluate(0, 0, 0.0)
    tokens_seen, train_seconds = 0, 0.0
    steady_tokens, steady_seconds = 0, 0.0
    bar = tqdm(total=args.steps, desc=attention, disable=args.no_progress or not ranks.first,
               dynamic_ncols=True, file=sys.stdout)
    batches = iter(packer)
    step = 0
    for step in range(1, args.steps + 1):
        batch = next(batches).to(args.device)
        progress = (step - 1) / args.steps
        if budget is not None:
            progress = max(progress, train_seconds / budget)
        lr = learning_rate(progress, step - 1, args)
        for group in optimizer.param_groups:
            group["lr"] = lr

        synchronize(args.device)
        profiler = step_profiler(args.device) if step == args.profile_step else None
        start = time.perf_counter()
        with profiler or contextlib.nullcontext():
            loss = model(**ranks.model_inputs(batch))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            ranks.average_gradients(model)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            loss_value = ranks.mean(loss).item()  # a sync: the step's work is done at the clock
        elapsed = time.perf_counter() - start
        if profiler is not None:
            record["profile"] = profile_summary(profiler, step, elapsed, attention,
                                                show=ranks.first)

        train_seconds += elapsed
        tokens_seen += batch.num_tokens
        if step > args.warmup_steps and step != args.profile_step:  # the profiler slows it
            steady_tokens += batch.num_tokens
            steady_seconds += elapsed
        for key, value in (("steps", step), ("train_loss", loss_value), ("tokens", tokens_seen),
                           ("seconds", train_seconds), ("lr", lr)):
            record[key].append(value)
        bar.update(1)
        bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{batch.num_tokens / elapsed:,.0f}")
        out_of_time = budget is not None and train_seconds >= budget
        if (args.eval_every and step % args.eval_every == 0) or step == args.steps \
                or out_of_time:
            evaluate(step, tokens_seen, train_seconds)
            if ranks.first:
                bar.write(f"[{attention}] step {step} tokens {tokens_seen:,} train "
                          f"{loss_value:.4f} held-out {record['eval'][-1]['heldout_loss']:.4f}")
        if out_of_time:
            break
    bar.close()
    record.update(
        steps_run=step, tokens_seen=tokens_seen, train_seconds=train_seconds,
        tokens_per_second=tokens_seen / train_seconds,
        steady_tokens_per_second=steady_tokens / steady_seconds if steady_seconds else None,
        final_heldout_loss=record["eval"][-1]["heldout_loss"],
        peak_memory_gib=(torch.cuda.max_memory_allocated(args.device) / 2 ** 30
                         if args.device.type == "cuda" else None))
    if args.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(args.device)
    del model, optimizer
    return record


def step_profiler(device: torch.device):
    """torch.profiler over one training step: host ops, and the kernels where on a GPU."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    return profile(activities=activities)


def profile_summary(profiler, step: int, elapsed: float, attention: str, show: bool,
                    rows: int = 25) -> dict:
    """What one profiled step spent: its wall time, the GPU's busy time (the kernels' own time
    summed: a wall time well above it is time the GPU waited on the host or on a sync), and the
    ops with the most GPU time (each op's kernels; an autograd Function's own launches count
    as its own), or with the most host time without a GPU. Printed when `show`."""
    from torch.autograd import DeviceType

    events = profiler.key_averages()
    kernels = [event for event in events if event.device_type != DeviceType.CPU]
    ops = [event for event in events if event.device_type == DeviceType.CPU]
    on_gpu = bool(kernels)
    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    busy_ms = sum(event.self_device_time_total for event in kernels) / 1e3 if on_gpu else None
    top = sorted(ops, key=lambda event: -getattr(event, key))[:rows]
    summary = dict(step=step, wall_ms=elapsed * 1e3, gpu_busy_ms=busy_ms,
                   top=[dict(name=event.key, calls=event.count,
                             ms=getattr(event, key) / 1e3) for event in top])
    if show:
        busy = f", GPU busy {busy_ms:.1f} ms" if on_gpu else ""
        print(f"[{attention}] profiled step {step}: wall {elapsed * 1e3:.1f} ms{busy}; ops by "
              f"{'GPU' if on_gpu else 'host'} time:")
        for row in summary["top"]:
            print(f"  {row['ms']:9.3f} ms {row['calls']:6d}x  {row['name'][:90]}")
    return summary


def heldout_at(record: dict, *, tokens: int | None = None, seconds: float | None = None):
    """Held-out loss at the last evaluation with at most `tokens` tokens seen (or `seconds` of
    training), and that evaluation's point."""
    key, limit = ("tokens", tokens) if tokens is not None else ("seconds", seconds)
    points = [e for e in record["eval"] if e[key] <= limit + 1e-9]
    return points[-1] if points else None


def compare(nsa_run: dict, dense_run: dict) -> dict:
    """NSA vs dense at equal tokens seen and at equal training wall-clock."""
    tokens = min(nsa_run["tokens_seen"], dense_run["tokens_seen"])
    seconds = min(nsa_run["train_seconds"], dense_run["train_seconds"])
    result = {}
    for name, where in (("equal_tokens", dict(tokens=tokens)),
                        ("equal_seconds", dict(seconds=seconds))):
        a, b = heldout_at(nsa_run, **where), heldout_at(dense_run, **where)
        result[name] = dict(
            **where, nsa=a, dense=b,
            nsa_over_dense=a["heldout_loss"] / b["heldout_loss"] if a and b else None)
    speeds = [run["steady_tokens_per_second"] or run["tokens_per_second"]
              for run in (nsa_run, dense_run)]
    result["throughput_nsa_over_dense"] = speeds[0] / speeds[1]
    return result


def draw(summary: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--png {path}: skipped, matplotlib is not installed "
              "(pip install -e '.[plot]')")
        return
    runs = summary["runs"]
    figure, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    for run in runs:
        name = run["attention"]
        axes[0].plot(run["tokens"], run["train_loss"], label=name, alpha=0.8)
        for axis, key in ((axes[1], "tokens"), (axes[2], "seconds")):
            axis.plot([e[key] for e in run["eval"]], [e["heldout_loss"] for e in run["eval"]],
                      marker="o", label=name)
    axes[0].set(title="train loss", xlabel="tokens seen", ylabel="nats / byte")
    axes[1].set(title="held-out loss vs tokens", xlabel="tokens seen", ylabel="nats / byte")
    axes[2].set(title="held-out loss vs training time", xlabel="seconds",
                ylabel="nats / byte")
    names = [run["attention"] for run in runs]
    speeds = [run["steady_tokens_per_second"] or run["tokens_per_second"] for run in runs]
    bars = axes[3].bar(names, speeds, color=["C0", "C1"][:len(runs)])
    axes[3].bar_label(bars, labels=[f"{s:,.0f}" for s in speeds])
    axes[3].set(title=f"training throughput at {summary['seq_len']:,} tokens/batch",
                ylabel="tokens / s")
    for axis in axes[:3]:
        axis.legend()
        axis.grid(alpha=0.3)
    figure.suptitle(f"{summary['model']} ({runs[0]['parameters'] / 1e6:.0f}M) on "
                    f"{summary['device']}, seed {summary['seed']}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    print(f"wrote {path}")


# What two single-attention runs must share to be compared (the batches follow from them).
SHARED_SETTINGS = ("model", "seq_len", "seed", "lr", "corpus", "documents", "train_documents",
                   "heldout_documents", "heldout_tokens")


def combine(paths: list[Path]) -> dict:
    """The summary of an nsa run and a dense run written by two processes (--combine)."""
    parts = []
    for path, attention in zip(paths, ("nsa", "dense")):
        try:
            part = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise SystemExit(f"--combine: cannot read {path}: {error}")
        if [run["attention"] for run in part.get("runs", [])] != [attention]:
            raise SystemExit(f"--combine: {path} must hold one run with --attention {attention}, "
                             f"got {[run.get('attention') for run in part.get('runs', [])]}")
        parts.append(part)
    for key in SHARED_SETTINGS:
        if parts[0].get(key) != parts[1].get(key):
            raise SystemExit(f"--combine: the runs differ in {key} ({parts[0].get(key)!r} vs "
                             f"{parts[1].get(key)!r}): not the same data and model")
    summary = dict(parts[0], runs=[parts[0]["runs"][0], parts[1]["runs"][0]],
                   command=[parts[0]["command"], parts[1]["command"]],
                   device=parts[0]["device"] if parts[0]["device"] == parts[1]["device"]
                   else [parts[0]["device"], parts[1]["device"]])
    summary["comparison"] = compare(*summary["runs"])
    return summary


def report(summary: dict, args) -> None:
    """Print the runs and the comparison; write --json and --png."""
    for run in summary["runs"]:
        steady = run["steady_tokens_per_second"]
        print(f"[{run['attention']}] {run['steps_run']} steps, {run['tokens_seen']:,} tokens in "
              f"{run['train_seconds']:.1f} s: held-out {run['final_heldout_loss']:.4f}, "
              f"{run['tokens_per_second']:,.0f} tokens/s"
              + (f" ({steady:,.0f} after warm-up)" if steady else ""))
    if "comparison" in summary:
        c = summary["comparison"]
        for key in ("equal_tokens", "equal_seconds"):
            ratio = c[key]["nsa_over_dense"]
            print(f"NSA / dense held-out loss at {key.replace('_', ' ')}: "
                  + ("n/a" if ratio is None else f"{ratio:.4f}"))
        print(f"NSA / dense throughput: {c['throughput_nsa_over_dense']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
        print(f"wrote {args.json}")
    if args.png:
        draw(summary, args.png)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.combine:
        report(combine(args.combine), args)
        return 0
    roots = source_roots(include_torch=args.corpus == "stdlib+torch")
    train_documents, heldout_documents = split_documents(
        find_documents(roots, unit=args.documents))
    if args.max_documents is not None:
        train_documents = train_documents[:args.max_documents]
        heldout_documents = heldout_documents[:max(1, args.max_documents // 20)]
    eval_set = heldout_batches(heldout_documents, args.seq_len, args.eval_batches)
    ranks = Ranks(args.context_parallel, args.device, args.cp_layout)
    if ranks.first:
        print(f"corpus: {len(train_documents)} training and {len(heldout_documents)} held-out "
              f"{args.documents} documents ({args.corpus}); held-out set "
              f"{sum(b.num_tokens for b in eval_set):,} tokens in {len(eval_set)} batches of "
              f"up to {args.seq_len:,}")

    attentions = ["nsa", "dense"] if args.attention == "both" else [args.attention]
    completed = False
    try:
        runs = [train_one(attention, args, train_documents, eval_set, ranks)
                for attention in attentions]
        completed = True
    finally:
        ranks.close(completed)
    if not ranks.first:
        return 0
    summary = dict(
        tool="train_lm",
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=" ".join(["python", "tools/train_lm.py", *args.argv]),
        device=(torch.cuda.get_device_name(args.device) if args.device.type == "cuda"
                else f"cpu ({torch.get_num_threads()} threads)"),
        torch=torch.__version__, model=args.model, seq_len=args.seq_len, seed=args.seed,
        lr=args.lr, corpus=args.corpus, documents=args.documents,
        train_documents=len(train_documents),
        heldout_documents=len(heldout_documents),
        heldout_tokens=sum(b.num_tokens for b in eval_set), context_parallel=args.context_parallel,
        cp_layout=args.cp_layout, runs=runs)
    if len(runs) == 2:
        summary["comparison"] = compare(*runs)
    report(summary, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
