"""A small decoder-only causal LM whose attention is NSAAttention: NSA or dense, same weights.

Pre-norm blocks: x + attention(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)); a final RMSNorm and an
untied LM head. Inputs are token ids, packed (T,) with cu_seqlens (documents packed into one
batch) or padded (B, N).

Weights are initialised per parameter name from the seed (`CausalLM.init_weights`), not from
the global RNG stream: a dense model and an NSA model built with one seed hold identical values
in every weight they share, whatever extra weights (W_k, W_v, W_gate) the NSA one has.

Compute dtype: `LMConfig.compute_dtype` ("float32" on a CPU; "bfloat16" on a GPU, where the
kernels run). Parameters stay in whatever dtype the model is moved to (float32 master weights
for the optimizer); activations run in the compute dtype, each weight cast where it is used;
RMSNorm statistics, the rotary embedding and the loss are float32.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from nsa.fused import fused_on_gpu
from nsa.layer import NSAAttention, shard_positions

# Byte-level vocabulary: 256 byte values, then the document markers.
BYTE_VOCAB = 256
BOS_ID = 256
EOS_ID = 257
VOCAB_SIZE = 264  # 256 bytes + 2 markers, padded to a multiple of 8 for the matmuls


@dataclass(frozen=True)
class LMConfig:
    vocab_size: int = VOCAB_SIZE
    hidden_size: int = 1024
    num_layers: int = 12
    num_heads: int = 16
    num_kv_heads: int = 4
    head_dim: int = 128
    intermediate_size: int = 2816
    attention: str = "nsa"  # "nsa" | "dense"
    compress_block_size: int = 64
    selected_block_size: int = 64
    num_selected_blocks: int = 16
    window_size: int = 512
    num_cmp_selected_blocks: int | None = None
    compress_weights: bool = True
    gate: bool = True
    rope_base: float = 10000.0
    rms_norm_eps: float = 1e-6
    init_std: float = 0.02
    compute_dtype: str = "float32"  # activations: "float32" | "bfloat16" | "float16"
    # nsa()'s backward memory policy for every layer (nsa/memory_policy.py): None keeps each
    # layer's branch outputs while they fit its per-call rule; True recomputes (long sequences
    # in deep models, where every layer keeping three q-sized outputs adds up).
    recompute: bool | None = None
    # nsa()'s test-only tile overrides, so tiny CI models exercise many selection tiles.
    test_q_tile: int | None = None
    test_cmp_kv_block: int | None = None

    def with_attention(self, attention: str) -> "LMConfig":
        return replace(self, attention=attention)

    def to_dict(self) -> dict:
        return asdict(self)


# Sizes: "tiny" for CI on a CPU (seconds per step at 2K tokens); "small" about 76M and "base"
# about 170M parameters for the H100 comparison (H * D = 2048 at width 1024 in "base": the
# attention is a large share of the step at 32K, as in long-context models).
MODEL_PRESETS: dict[str, LMConfig] = {
    "tiny": LMConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     intermediate_size=128, compress_block_size=16, selected_block_size=32,
                     num_selected_blocks=6, window_size=64),
    "small": LMConfig(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4,
                      head_dim=64, intermediate_size=2048, compute_dtype="bfloat16"),
    "base": LMConfig(hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=4,
                     head_dim=128, intermediate_size=2816, compute_dtype="bfloat16"),
}


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


@fused_on_gpu
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / rms(x) * weight in x's dtype; one kernel on a GPU (nsa/fused.py)."""
    # float32 statistics: a bf16 mean of squares loses the small channels.
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


@fused_on_gpu
def silu_product(gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU's silu(gate) * up; one kernel on a GPU (nsa/fused.py)."""
    return F.silu(gate) * up


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate = F.linear(x, self.gate_proj.weight.to(x.dtype))
        up = F.linear(x, self.up_proj.weight.to(x.dtype))
        return F.linear(silu_product(gate, up), self.down_proj.weight.to(x.dtype))


class DecoderBlock(nn.Module):
    def __init__(self, config: LMConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = attention_layer(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, x: Tensor, **sequences) -> Tensor:
        x = x + self.attention(self.attention_norm(x), **sequences)
        return x + self.mlp(self.mlp_norm(x))


def attention_layer(config: LMConfig) -> NSAAttention:
    test_tiles = {}
    if config.test_q_tile is not None:
        test_tiles["_q_tile"] = config.test_q_tile
    if config.test_cmp_kv_block is not None:
        test_tiles["_cmp_kv_block"] = config.test_cmp_kv_block
    return NSAAttention(
        config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
        attention=config.attention, compress_block_size=config.compress_block_size,
        selected_block_size=config.selected_block_size,
        num_selected_blocks=config.num_selected_blocks, window_size=config.window_size,
        num_cmp_selected_blocks=config.num_cmp_selected_blocks,
        compress_weights=config.compress_weights, gate=config.gate,
        rope_base=config.rope_base, recompute=config.recompute, **test_tiles)


class CausalLM(nn.Module):
    """Token ids in, logits (or the mean next-token loss) out."""

    def __init__(self, config: LMConfig, seed: int = 0):
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(DecoderBlock(config) for _ in range(config.num_layers))
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Each weight drawn from its own generator, seeded by (seed, parameter name): the
        same name gets the same values in any model of the same config family.

        Matrices ~ N(0, init_std^2); residual outputs (o_proj, down_proj) scaled down by
        sqrt(2 * num_layers) (GPT-2's rule: the residual stream's variance stays O(1) with
        depth); norms = 1; W_k, W_v = identity and W_gate ~ N(0, 0.02^2) (NSAAttention)."""
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.num_layers)
        for name, parameter in self.named_parameters():
            generator = torch.Generator().manual_seed(_name_seed(seed, name))
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("norm.weight"):
                values = torch.ones(parameter.shape)
            elif leaf in ("W_k", "W_v"):
                values = torch.eye(parameter.shape[-1]).expand(parameter.shape)
            elif leaf == "W_gate":
                values = torch.randn(parameter.shape, generator=generator) * 0.02
            elif leaf == "bias":
                values = torch.zeros(parameter.shape)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                values = torch.randn(parameter.shape, generator=generator) * residual_std
            else:
                values = torch.randn(parameter.shape, generator=generator) * std
            parameter.copy_(values)

    def forward(self, input_ids: Tensor, *, cu_seqlens: Tensor | None = None,
                max_seqlen: int | None = None,
                host_cu_seqlens: tuple[int, ...] | list[int] | None = None,
                position_ids: Tensor | None = None, labels: Tensor | None = None,
                context_parallel_group=None,
                context_parallel_layout: str = "contiguous") -> Tensor:
        """input_ids (T,) packed with cu_seqlens, or (B, N) padded. Returns logits (..., vocab)
        in float32, or with labels (same shape as input_ids; -100 = ignored) the mean
        cross-entropy over the labelled positions. labels[i] is the target of row i (the next
        token, shifted by the caller): the model never shifts them.

        context_parallel_group (attention="nsa", packed): input_ids and labels are this rank's
        shard of the batch's tokens and labels under context_parallel_layout ("contiguous",
        the default, or "zigzag": nsa.distributed.shard_sequence with layout=), cu_seqlens
        the whole batch's (the same on every rank); every attention layer runs across the
        group (NSAAttention). Shift the labels before sharding: a chunk's last row's target
        is the first token of the chunk after it, which another rank holds (zigzag: or this
        rank, in its other chunk, not next to it in the shard). The loss returned is then
        this rank's share scaled so that the mean over the ranks is the batch's mean loss (its
        labelled tokens' sum over all ranks, divided by their count; a sum of per-token terms,
        so the same under either layout): averaging the ranks' gradients, as DDP and FSDP2 do
        over data x context ranks, gives the gradient of the batch's mean loss."""
        compute_dtype = getattr(torch, self.config.compute_dtype)
        sequences = dict(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                         host_cu_seqlens=host_cu_seqlens)
        if context_parallel_group is not None:
            from nsa.distributed.sharding import check_layout

            # Before the positions read it: the error names this forward's argument.
            check_layout(context_parallel_layout, "context_parallel_layout")
            sequences.update(context_parallel_group=context_parallel_group,
                             context_parallel_layout=context_parallel_layout)
        if position_ids is None and cu_seqlens is not None:
            # Once for every layer (each would otherwise derive the same positions again).
            position_ids = shard_positions(cu_seqlens, input_ids.shape[0],
                                           context_parallel_group,
                                           layout=context_parallel_layout)
        sequences["position_ids"] = position_ids
        x = self.embedding(input_ids).to(compute_dtype)
        for block in self.blocks:
            x = block(x, **sequences)
        x = self.final_norm(x)
        logits = F.linear(x, self.lm_head.weight.to(compute_dtype)).float()
        if labels is None:
            return logits
        if context_parallel_group is None:
            return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=-100)
        return _context_parallel_loss(logits, labels, context_parallel_group)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def _context_parallel_loss(logits: Tensor, labels: Tensor, group) -> Tensor:
    """This rank's cross-entropy sum times world / the labelled tokens of all ranks (see
    CausalLM.forward). The count is summed on the device (no host read)."""
    import torch.distributed as dist

    from nsa.distributed import resolve_group

    context = resolve_group(group, "context_parallel_group")
    total = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=-100,
                            reduction="sum")
    count = (labels != -100).sum().to(logits.dtype)
    dist.all_reduce(count, group=context.process_group)
    return total * context.world_size / count


def _name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2 ** 63 - 1)


def shared_parameter_names(a: nn.Module, b: nn.Module) -> list[str]:
    """Names of the parameters two models both hold (with the same shape)."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return sorted(n for n in pa.keys() & pb.keys() if pa[n].shape == pb[n].shape)


__all__ = ["BOS_ID", "BYTE_VOCAB", "CausalLM", "DecoderBlock", "EOS_ID", "LMConfig",
           "MODEL_PRESETS", "RMSNorm", "SwiGLU", "VOCAB_SIZE",
           "shared_parameter_names"]
