"""Train a small NSA transformer on packed variable-length sequences of a synthetic recall task.

The main end-to-end job of the repository: every step draws sequences of random lengths, packs
them into one varlen batch (`cu_seqlens`), and runs forward and backward through `nsa.nsa` in
every layer. On an sm_90 GPU the attention runs on the CuTe DSL kernels; elsewhere on the
PyTorch fallback (the summary names which).

The task (register recall, `RegisterRecallTask`): each sequence opens with one value per
register, then asks for registers again and again among filler tokens; an answer is the value its
register got at the start. Without the context an answer is uniform over its register's alphabet
(ln(values_per_register) nats); with it, it is certain. Only answers are trained on, so the loss
falls far below that entropy only by attending back over up to max_len tokens, mostly beyond the
sliding window.

    python tools/train_packed.py                    # CPU: small model, ~1-2 minutes on 2 cores
    python tools/train_packed.py --device cuda      # Hopper: bigger model and batches
    python tools/train_packed.py --steps 5 --json out.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernels  # noqa: E402
from nsa import nsa  # noqa: E402
from _common import positive_int, resolve_device  # noqa: E402

# ----------------------------------------------------------------------------------------------
# Data: register recall, packed into varlen batches
# ----------------------------------------------------------------------------------------------

BOS = 0


@dataclass(frozen=True)
class RegisterRecallTask:
    """Recall, from anywhere in a sequence, the value each register got at its start.

    A sequence is BOS, then one value per register (register r draws its value from its own
    alphabet of `values_per_register` tokens; the registers come in random order), then filler
    tokens with queries interleaved: a query is the token ASK_r followed by register r's value.
    The answer tokens are the only ones trained on. Given which register is asked, an answer is
    uniform over that register's alphabet (entropy ln(values_per_register)); given the context
    it is certain. Answers sit at every distance from the definitions, most of them beyond the
    sliding window, so the model must learn to use the compressed and selected branches.
    """

    num_registers: int
    values_per_register: int
    num_fillers: int
    query_every: int  # mean distance between queries
    min_len: int
    max_len: int

    @property
    def first_ask(self) -> int:
        return BOS + 1

    @property
    def first_value(self) -> int:
        return self.first_ask + self.num_registers

    @property
    def first_filler(self) -> int:
        return self.first_value + self.num_registers * self.values_per_register

    @property
    def vocab_size(self) -> int:
        return self.first_filler + self.num_fillers

    @property
    def answer_entropy(self) -> float:
        """Entropy of an answer given the asked register but not the context, in nats."""
        return math.log(self.values_per_register)

    def sequence(self, length: int, generator: torch.Generator):
        """(tokens (length,), answer_mask (length,)): answer_mask[t] says tokens[t] is an answer."""
        registers = self.num_registers
        values = torch.randint(self.values_per_register, (registers,), generator=generator)
        value_tokens = self.first_value + torch.arange(registers) * self.values_per_register \
            + values
        order = torch.randperm(registers, generator=generator)
        head = torch.cat([torch.tensor([BOS]), value_tokens[order]])

        body_length = length - len(head)
        body = self.first_filler + torch.randint(self.num_fillers, (body_length,),
                                                 generator=generator)
        # Queries start at even body positions, so two never overlap; a query is ASK_r, value_r.
        starts = torch.arange(0, body_length - 1, 2)
        starts = starts[torch.rand(len(starts), generator=generator) < 2.0 / self.query_every]
        asked = torch.randint(registers, (len(starts),), generator=generator)
        body[starts] = self.first_ask + asked
        body[starts + 1] = value_tokens[asked]
        answer_mask = torch.zeros(length, dtype=torch.bool)
        answer_mask[len(head) + starts + 1] = True
        return torch.cat([head, body]), answer_mask


@dataclass
class PackedBatch:
    tokens: torch.Tensor      # (T,) int64
    targets: torch.Tensor     # (T,) int64: the next token of the same sequence
    loss_mask: torch.Tensor   # (T,) bool: positions whose target is an answer
    positions: torch.Tensor   # (T,) int64: position inside the token's own sequence
    cu_seqlens: torch.Tensor  # (S+1,) int32
    max_seqlen: int

    def to(self, device: torch.device) -> "PackedBatch":
        return PackedBatch(self.tokens.to(device), self.targets.to(device),
                           self.loss_mask.to(device), self.positions.to(device),
                           self.cu_seqlens.to(device), self.max_seqlen)


def packed_batch(task: RegisterRecallTask, tokens_per_step: int,
                 generator: torch.Generator) -> PackedBatch:
    """Sequences of uniform random lengths in [min_len, max_len] packed up to tokens_per_step."""
    pieces, masks, lengths = [], [], []
    total = 0
    while True:
        length = int(torch.randint(task.min_len, task.max_len + 1, (1,), generator=generator))
        if pieces and total + length > tokens_per_step:
            break
        tokens, answers = task.sequence(length, generator)
        pieces.append(tokens)
        masks.append(answers)
        lengths.append(length)
        total += length

    tokens = torch.cat(pieces)
    # Next-token targets stay inside a sequence: each sequence's last token predicts nothing.
    targets = torch.cat([torch.cat([p[1:], p[:1]]) for p in pieces])
    loss_mask = torch.cat([F.pad(m[1:], (0, 1), value=False) for m in masks])
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu_seqlens = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    return PackedBatch(tokens, targets, loss_mask, positions, cu_seqlens, max(lengths))


# ----------------------------------------------------------------------------------------------
# Model: pre-norm transformer blocks with NSA attention
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_ratio: int
    compress_block_size: int
    selected_block_size: int
    num_selected_blocks: int
    window_size: int
    attention_dtype: str  # dtype q, k, v enter nsa() with: "float32" | "bfloat16" | "float16"


def rotary(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of x (T, heads, D) at per-sequence positions (T,)."""
    half = x.shape[-1] // 2
    frequencies = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None] * frequencies[None, :]  # (T, D/2)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class NSAAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj = nn.Linear(config.dim, heads * head_dim, bias=False)
        self.kv_proj = nn.Linear(config.dim, 2 * kv_heads * head_dim, bias=False)
        self.out_proj = nn.Linear(heads * head_dim, config.dim, bias=False)
        # Branch gate g = sigmoid(q @ W_gate): per head, one logit per branch.
        self.W_gate = nn.Parameter(torch.randn(heads, 3, head_dim) * head_dim ** -0.5)

    def forward(self, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        c = self.config
        q = self.q_proj(x).view(-1, c.num_heads, c.head_dim)
        k, v = self.kv_proj(x).view(-1, 2, c.num_kv_heads, c.head_dim).unbind(dim=1)
        q, k = rotary(q, batch.positions), rotary(k, batch.positions)
        dtype = getattr(torch, c.attention_dtype)
        out = nsa(
            q.to(dtype), k.to(dtype), v.contiguous().to(dtype),
            cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen,
            compress_block_size=c.compress_block_size,
            selected_block_size=c.selected_block_size,
            num_selected_blocks=c.num_selected_blocks, window_size=c.window_size,
            W_gate=self.W_gate.to(dtype),
        )
        return self.out_proj(out.reshape(-1, c.num_heads * c.head_dim).to(x.dtype))


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim)
        self.attention = NSAAttention(config)
        self.mlp_norm = nn.RMSNorm(config.dim)
        self.mlp = nn.Sequential(
            nn.Linear(config.dim, config.mlp_ratio * config.dim, bias=False),
            nn.GELU(),
            nn.Linear(config.mlp_ratio * config.dim, config.dim, bias=False),
        )

    def forward(self, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), batch)
        return x + self.mlp(self.mlp_norm(x))


class NSATransformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embedding = nn.Embedding(config.vocab_size, config.dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.final_norm = nn.RMSNorm(config.dim)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        x = self.embedding(batch.tokens)
        for block in self.blocks:
            x = block(x, batch)
        return self.lm_head(self.final_norm(x))


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------

# Defaults per device: small enough for ~1-2 minutes on 2 CPU cores; larger on a GPU.
DEFAULTS = {
    "cpu": dict(steps=200, tokens_per_step=2048, min_len=64, max_len=512, dim=128, layers=2,
                heads=4, kv_heads=2, head_dim=32, registers=4, values_per_register=16,
                fillers=32, query_every=8, lr=3e-3, compress_block_size=16,
                selected_block_size=16, num_selected_blocks=12, window_size=64,
                dtype="float32"),
    # Sized for the forward on the CuTe kernels with the backward still on the torch fallback.
    "cuda": dict(steps=200, tokens_per_step=16384, min_len=512, max_len=4096, dim=256,
                 layers=2, heads=8, kv_heads=2, head_dim=64, registers=4, values_per_register=16,
                 fillers=64, query_every=8, lr=3e-3, compress_block_size=32,
                 selected_block_size=64, num_selected_blocks=8, window_size=128,
                 dtype="bfloat16"),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a small NSA transformer on packed varlen synthetic recall sequences.",
        epilog="Unset options take per-device defaults: " + "; ".join(
            f"{device}: " + ", ".join(f"{k}={v}" for k, v in d.items())
            for device, d in DEFAULTS.items()),
    )
    parser.add_argument("--device", default=None,
                        help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    parser.add_argument("--steps", type=positive_int, help="optimizer steps")
    parser.add_argument("--tokens-per-step", type=positive_int,
                        help="packed tokens per step (sequences are never split)")
    parser.add_argument("--min-len", type=positive_int, help="shortest sequence")
    parser.add_argument("--max-len", type=positive_int, help="longest sequence")
    parser.add_argument("--dim", type=positive_int, help="model width")
    parser.add_argument("--layers", type=positive_int, help="transformer blocks")
    parser.add_argument("--heads", type=positive_int, help="query heads")
    parser.add_argument("--kv-heads", type=positive_int, help="key/value heads (GQA)")
    parser.add_argument("--head-dim", type=positive_int, help="head dimension")
    parser.add_argument("--registers", type=positive_int, help="registers per sequence")
    parser.add_argument("--values-per-register", type=positive_int,
                        help="alphabet size of each register's values")
    parser.add_argument("--fillers", type=positive_int, help="filler alphabet size")
    parser.add_argument("--query-every", type=positive_int,
                        help="mean distance between queries")
    parser.add_argument("--lr", type=float, help="peak AdamW learning rate")
    parser.add_argument("--compress-block-size", type=positive_int, help="NSA l")
    parser.add_argument("--selected-block-size", type=positive_int, help="NSA l'")
    parser.add_argument("--num-selected-blocks", type=positive_int, help="NSA top-n")
    parser.add_argument("--window-size", type=positive_int, help="NSA sliding window")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        help="dtype of q, k, v inside nsa()")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the summary to this JSON file")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bar (logs every 10%%)")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)

    args.device = resolve_device(args.device)
    for key, value in DEFAULTS[args.device.type].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.min_len > args.max_len:
        parser.error(f"--min-len ({args.min_len}) must be <= --max-len ({args.max_len})")
    if args.max_len > args.tokens_per_step:
        parser.error(f"--max-len ({args.max_len}) must be <= --tokens-per-step "
                     f"({args.tokens_per_step})")
    if args.min_len < args.registers + 3:
        parser.error(f"--min-len must be >= registers + 3 = {args.registers + 3} "
                     "(BOS, the register values, one query)")
    if args.heads % args.kv_heads:
        parser.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if args.head_dim % 2:
        parser.error(f"--head-dim ({args.head_dim}) must be even (rotary embedding)")
    return args


def learning_rate(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over the first 5% of steps, then cosine decay to 10% of peak."""
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def answer_loss(model: NSATransformer, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy over answer tokens, and the fraction of answers predicted exactly."""
    logits = model(batch)[batch.loss_mask].float()
    targets = batch.targets[batch.loss_mask]
    accuracy = (logits.argmax(dim=-1) == targets).float().mean()
    return F.cross_entropy(logits, targets), accuracy


def backend_names(config: ModelConfig, batch: PackedBatch) -> dict[str, str]:
    """Which kernel path the attention calls of this run take (forward and backward)."""
    device = batch.tokens.device
    dtype = getattr(torch, config.attention_dtype)
    total = batch.tokens.numel()
    q = torch.randn(total, config.num_heads, config.head_dim, device=device, dtype=dtype)
    k = torch.randn(total, config.num_kv_heads, config.head_dim, device=device, dtype=dtype)
    varlen = dict(cu_seqlens_q=batch.cu_seqlens, cu_seqlens_k=batch.cu_seqlens,
                  max_seqlen_q=batch.max_seqlen, max_seqlen_k=batch.max_seqlen, causal=True,
                  window_size=(config.window_size - 1, 0))
    return {direction: kernels.which_backend(q, k, k, backward=direction == "backward", **varlen)
            for direction in ("forward", "backward")}


def train(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    data_generator = torch.Generator().manual_seed(args.seed)
    task = RegisterRecallTask(args.registers, args.values_per_register, args.fillers,
                              args.query_every, args.min_len, args.max_len)
    config = ModelConfig(
        vocab_size=task.vocab_size, dim=args.dim, num_layers=args.layers, num_heads=args.heads,
        num_kv_heads=args.kv_heads, head_dim=args.head_dim, mlp_ratio=4,
        compress_block_size=args.compress_block_size,
        selected_block_size=args.selected_block_size,
        num_selected_blocks=args.num_selected_blocks, window_size=args.window_size,
        attention_dtype=args.dtype,
    )
    model = NSATransformer(config).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01,
                                  betas=(0.9, 0.95))
    parameters = sum(p.numel() for p in model.parameters())
    print(f"model: {parameters / 1e6:.2f}M parameters, {config}")
    print(f"task: answer entropy without context ln({task.values_per_register}) = "
          f"{task.answer_entropy:.3f} nats")

    losses, accuracies = [], []
    tokens_seen = 0
    steady_tokens, steady_start = 0, None
    start = time.perf_counter()
    bar = tqdm(range(args.steps), desc="train", disable=args.no_progress, dynamic_ncols=True)
    for step in bar:
        batch = packed_batch(task, args.tokens_per_step, data_generator).to(args.device)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr)
        loss, accuracy = answer_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

        losses.append(loss.item())  # .item() synchronises: the timing below is honest
        accuracies.append(accuracy.item())
        tokens_seen += batch.tokens.numel()
        if step == 0:  # the first step compiles kernels: keep it out of the steady rate
            steady_start = time.perf_counter()
        else:
            steady_tokens += batch.tokens.numel()
        bar.set_postfix(loss=f"{losses[-1]:.3f}", acc=f"{accuracies[-1]:.2f}",
                        seqs=len(batch.cu_seqlens) - 1)
        if args.no_progress and (step + 1) % max(1, args.steps // 10) == 0:
            print(f"step {step + 1}/{args.steps} loss {losses[-1]:.4f} acc {accuracies[-1]:.3f}")
    elapsed = time.perf_counter() - start
    steady_elapsed = time.perf_counter() - steady_start

    window = max(1, min(10, len(losses) // 5))
    summary = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "tools/train_packed.py", *args.argv]),
        "device": str(args.device) if args.device.type == "cpu"
        else torch.cuda.get_device_name(args.device),
        "steps": args.steps,
        "parameters": parameters,
        "model": asdict(config),
        "answer_entropy": task.answer_entropy,
        "first_loss": losses[0],
        "last_loss": sum(losses[-window:]) / window,
        "last_accuracy": sum(accuracies[-window:]) / window,
        "tokens": tokens_seen,
        "seconds": elapsed,
        "tokens_per_second": tokens_seen / elapsed,
        "steady_tokens_per_second": steady_tokens / steady_elapsed if steady_tokens else None,
        "backend": backend_names(config, batch),
        "losses": losses,
    }
    return summary


def print_summary(summary: dict) -> None:
    steady = summary["steady_tokens_per_second"]
    print(f"\nsummary ({summary['steps']} steps on {summary['device']})")
    print(f"  answer loss: first step {summary['first_loss']:.3f} -> last steps "
          f"{summary['last_loss']:.3f} nats (entropy without the context: "
          f"{summary['answer_entropy']:.3f})")
    print(f"  answer accuracy, last steps: {summary['last_accuracy']:.1%}")
    print(f"  throughput: {summary['tokens_per_second']:,.0f} tokens/s overall"
          + (f", {steady:,.0f} tokens/s after the first step" if steady else ""))
    print(f"  attention backend: forward {summary['backend']['forward']}, "
          f"backward {summary['backend']['backward']}")


def main(argv=None) -> int:
    args = parse_args(argv)
    summary = train(args)
    print_summary(summary)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
