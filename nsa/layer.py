"""NSAAttention: Native Sparse Attention as a model layer (hidden states in, hidden states out).

The layer owns the q/k/v/o projections (GQA: num_kv_heads <= num_heads), the rotary position
embedding, and NSA's learned weights in the form nsa() takes them:

- W_k, W_v (Hkv, D, D): the compression projections, k_cmp = mean(k over a block) @ W_k.
  Initialised to the identity, so a compressed token starts as the plain mean of its block's
  keys (mean-preserving): the compressed branch starts as average pooling, and training moves
  it from there rather than from a random mixing of the head's channels.
- W_gate (H, 3, D): the branch gates g_b = sigmoid(q . W_gate[h, b]) per head, computed by
  nsa() from the (rotated) query. The NSA paper computes the gates from the hidden state
  through its own projection; nsa() has one fused gated path that reads q, and takes no
  precomputed gates, so the layer uses that path (one call, no extra tensor). Initialised
  small (std 0.02), so every gate starts near 0.5. docs/model.md discusses the difference.

attention="dense" swaps nsa() for causal flash attention (kernels.flash_attn_varlen_func /
flash_attn_func) and drops W_k, W_v, W_gate: every other weight has the same name and shape,
so a dense and an NSA model can start from the same weights and be compared fairly.

Input layouts: padded hidden states (B, N, hidden) with positions 0..N-1 in every row, or
packed (T, hidden) with cu_seqlens (S+1,) int32, whose positions restart at 0 at each
sequence's start (documents packed into one batch do not see each other, nor each other's
positions). host_cu_seqlens (cu_seqlens's values as Python ints) lets nsa() skip reading the
tensor back: required under torch.compile and CUDA graphs.

Compute dtype: the dtype of the hidden states. Parameters may be stored in another dtype (fp32
master weights with bf16 activations on a GPU): each is cast to the activations' dtype where
it is used, so no autocast is needed. The rotary embedding is computed in float32.

NSAAttentionReference computes the same function in plain PyTorch through nsa_reference (and
a masked softmax for attention="dense"), written independently of NSAAttention (complex-number
rotary, per-sequence loops) so that tests of one against the other check the layer's wiring,
not only nsa() against nsa_reference. The two share parameter names: a state_dict moves from
one to the other.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import kernels
from nsa.api import nsa
from nsa.fused import fused_on_gpu
from nsa.reference import nsa_reference
from nsa.selection_rule import CMP_KV_BLOCK, SELECTION_Q_TILE

ATTENTION_KINDS = ("nsa", "dense")


def positions_in_sequences(cu_seqlens: Tensor, total: int) -> Tensor:
    """(T,) int64 position of each packed row inside its own sequence, computed on cu_seqlens's
    device without reading it back (searchsorted: no host sync, traceable by torch.compile).
    Empty sequences are allowed."""
    bounds = cu_seqlens.to(torch.int64)
    rows = torch.arange(total, device=cu_seqlens.device)
    sequence = torch.searchsorted(bounds[1:], rows, right=True)
    return rows - bounds[sequence]


def shard_positions(cu_seqlens: Tensor, local_rows: int, group=None, *,
                    layout: str = "contiguous", rank: int | None = None,
                    world_size: int | None = None) -> Tensor:
    """(local_rows,) positions in their documents of this process's packed rows: all of them
    without a context-parallel group; with one (`group`, or `rank` and `world_size` where a
    data loader knows them without a process group), this rank's shard under `layout`
    (nsa.distributed.sharding: "contiguous" or "zigzag") of the whole batch's positions
    (local_rows x the group's size rows), so that a document cut by a shard or chunk bound
    keeps counting its positions across it."""
    if group is None and rank is None and world_size is None:
        return positions_in_sequences(cu_seqlens, local_rows)
    from nsa.distributed import resolve_group, shard_sequence

    world = (resolve_group(group, "context_parallel_group").world_size if group is not None
             else world_size)
    # A missing or bad world_size is named by shard_sequence (it checks rank and world_size).
    everything = positions_in_sequences(
        cu_seqlens, local_rows * world if isinstance(world, int) else local_rows)
    return shard_sequence(everything, group, rank=rank, world_size=world_size, layout=layout,
                          name="the packed tokens")


def rotary_tables(positions: Tensor, head_dim: int, base: float,
                  dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotary angles at positions (...), each (..., 1, D/2): channel i pairs
    with channel i + D/2 at frequency base ** (-i / (D/2)). At least float32: bf16 angles would
    be off by whole radians at long positions. Made once per layer call and read by q and k
    (computed per element of q and k instead, the sines and cosines were the rotary kernel's
    time: 17.6 of a 32K LM step's 149 ms on an H200)."""
    half = head_dim // 2
    precision = torch.promote_types(dtype, torch.float32)
    frequencies = base ** (-torch.arange(half, device=positions.device, dtype=precision) / half)
    angles = positions.to(precision)[..., None, None] * frequencies
    return angles.cos(), angles.sin()


@fused_on_gpu
def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (..., heads, D) rotated by `rotary_tables` (rotate-half layout), in their precision,
    returned in x's dtype. One kernel on a GPU (nsa/fused.py)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].to(cos.dtype), x[..., half:].to(cos.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class NSAAttention(nn.Module):
    """Attention layer with Native Sparse Attention (or dense causal attention) inside.

    hidden_size: model width (input and output features).
    num_heads, num_kv_heads: query heads H and key/value heads Hkv (GQA, H % Hkv == 0;
        default num_kv_heads = num_heads).
    head_dim: D (default hidden_size // num_heads); even (rotary embedding).
    attention: "nsa" (nsa.nsa) or "dense" (causal flash attention over the whole sequence).
    compress_block_size, selected_block_size, num_selected_blocks, window_size,
        num_cmp_selected_blocks, deterministic: passed to nsa() (see its docstring).
    compress_weights: learn W_k, W_v (else a compressed token is the plain mean of its block).
    gate: learn W_gate (else nsa() weights each branch equally).
    rope_base: rotary embedding base (theta).
    softmax_scale: attention scale (default D ** -0.5).
    bias: biases on the q, k, v projections (the output projection never has one).
    recompute: nsa()'s backward memory policy (None: nsa/memory_policy.py's size rule, which
        sees one call; in a deep model at long lengths pass True so that the layers do not
        each keep three q-sized branch outputs until their backward). The output is the same.
    capture: nsa()'s captured plans (None: automatic, see nsa/captured.py; False where a graph
        through the layer is differentiated twice). The output is the same.
    _q_tile, _cmp_kv_block: nsa()'s test-only tile overrides (tests at tiny sizes).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int | None = None,
                 head_dim: int | None = None, *, attention: str = "nsa",
                 compress_block_size: int = 64, selected_block_size: int = 64,
                 num_selected_blocks: int = 16, window_size: int = 512,
                 num_cmp_selected_blocks: int | None = None, compress_weights: bool = True,
                 gate: bool = True, rope_base: float = 10000.0,
                 softmax_scale: float | None = None, bias: bool = False,
                 deterministic: bool = False, recompute: bool | None = None,
                 capture: bool | None = None, _q_tile: int = SELECTION_Q_TILE,
                 _cmp_kv_block: int = CMP_KV_BLOCK, device=None, dtype=None):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        head_dim = hidden_size // num_heads if head_dim is None else head_dim
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"attention: expected one of {ATTENTION_KINDS}, got {attention!r}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                             f"({num_kv_heads})")
        if head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary embedding), got {head_dim}")
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.attention = attention
        self.rope_base = float(rope_base)
        self.softmax_scale = softmax_scale
        self.deterministic = deterministic
        # Only nsa() reads these; kept for dense too so the two layers describe themselves alike.
        self.nsa_options = dict(
            compress_block_size=compress_block_size, selected_block_size=selected_block_size,
            num_selected_blocks=num_selected_blocks, window_size=window_size,
            num_cmp_selected_blocks=num_cmp_selected_blocks, _q_tile=_q_tile,
            _cmp_kv_block=_cmp_kv_block)
        self.recompute = recompute  # nsa()'s only: the reference has no backward to steer
        self.capture = capture  # nsa()'s only, likewise

        factory = dict(device=device, dtype=dtype)
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias, **factory)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False, **factory)
        uses_nsa = attention == "nsa"
        if uses_nsa and compress_weights:
            self.W_k = nn.Parameter(torch.empty(num_kv_heads, head_dim, head_dim, **factory))
            self.W_v = nn.Parameter(torch.empty(num_kv_heads, head_dim, head_dim, **factory))
        else:
            self.register_parameter("W_k", None)
            self.register_parameter("W_v", None)
        if uses_nsa and gate:
            self.W_gate = nn.Parameter(torch.empty(num_heads, 3, head_dim, **factory))
        else:
            self.register_parameter("W_gate", None)
        self.reset_nsa_parameters()

    def reset_nsa_parameters(self, generator: torch.Generator | None = None) -> None:
        """W_k, W_v = identity (compressed token = mean of its block); W_gate ~ N(0, 0.02^2)
        (gates near 0.5). The projections keep nn.Linear's own initialisation."""
        with torch.no_grad():
            for W in (self.W_k, self.W_v):
                if W is not None:
                    W.copy_(torch.eye(self.head_dim, dtype=W.dtype).expand_as(W))
            if self.W_gate is not None:
                noise = torch.randn(self.W_gate.shape, generator=generator) * 0.02
                self.W_gate.copy_(noise)

    def extra_repr(self) -> str:
        text = (f"attention={self.attention}, hidden_size={self.hidden_size}, "
                f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, rope_base={self.rope_base}")
        if self.attention == "nsa":
            options = {k: v for k, v in self.nsa_options.items() if not k.startswith("_")}
            text += ", " + ", ".join(f"{k}={v}" for k, v in options.items())
        return text

    def forward(self, hidden_states: Tensor, *, cu_seqlens: Tensor | None = None,
                max_seqlen: int | None = None,
                host_cu_seqlens: tuple[int, ...] | list[int] | None = None,
                position_ids: Tensor | None = None, context_parallel_group=None,
                context_parallel_layout: str = "contiguous") -> Tensor:
        """hidden_states (B, N, hidden) padded, or (T, hidden) packed with cu_seqlens (S+1,)
        int32 (+ max_seqlen, host_cu_seqlens when known). position_ids (B, N) or (T,) override
        the positions used by the rotary embedding (default: 0.. within each sequence).

        context_parallel_group (attention="nsa", packed input): hidden_states is this rank's
        shard of the packed tokens (nsa.distributed.shard_sequence) and cu_seqlens (with
        host_cu_seqlens) the whole batch's, the same on every rank; the result is the rank's
        shard of the output (nsa()'s context parallelism; the default positions are the
        shard's rows' positions in their documents). context_parallel_layout: how the tokens
        were sharded, "contiguous" (the default) or "zigzag" (docs/context_parallel.md),
        the same on every rank; unused without a group, as in nsa()."""
        packed = cu_seqlens is not None
        if packed != (hidden_states.dim() == 2):
            raise ValueError("hidden_states: expected (T, hidden) with cu_seqlens, or "
                             f"(B, N, hidden) without; got {tuple(hidden_states.shape)} and "
                             f"cu_seqlens={'given' if packed else None}")
        if context_parallel_group is not None and (self.attention != "nsa" or not packed):
            raise ValueError("context_parallel_group: only attention='nsa' on packed input "
                             "(hidden_states (T, hidden) with cu_seqlens) runs across ranks; "
                             f"this layer has attention={self.attention!r} and "
                             f"{'packed' if packed else 'padded'} input")
        if context_parallel_group is not None:
            # Before the positions and nsa() read it (and before nsa()'s first collective),
            # so that the error names this layer's argument.
            from nsa.distributed.sharding import check_layout

            check_layout(context_parallel_layout, "context_parallel_layout")
        rows = hidden_states.shape[:-1]
        dtype = hidden_states.dtype
        q = F.linear(hidden_states, *_cast(self.q_proj, dtype)).unflatten(-1, (self.num_heads, -1))
        k = F.linear(hidden_states, *_cast(self.k_proj, dtype)).unflatten(
            -1, (self.num_kv_heads, -1))
        v = F.linear(hidden_states, *_cast(self.v_proj, dtype)).unflatten(
            -1, (self.num_kv_heads, -1))

        if position_ids is None:
            if packed:
                position_ids = shard_positions(cu_seqlens, rows[0], context_parallel_group,
                                               layout=context_parallel_layout)
            else:
                position_ids = torch.arange(rows[1], device=q.device).expand(rows)
        cos, sin = rotary_tables(position_ids, self.head_dim, self.rope_base, dtype)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)

        if packed and max_seqlen is None:
            bounds = host_cu_seqlens if host_cu_seqlens is not None else cu_seqlens.tolist()
            max_seqlen = max((b - a for a, b in zip(bounds[:-1], bounds[1:])), default=0)
        if self.attention == "nsa":
            out = nsa(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                      host_cu_seqlens=host_cu_seqlens, W_k=_as(self.W_k, dtype),
                      W_v=_as(self.W_v, dtype), W_gate=_as(self.W_gate, dtype),
                      softmax_scale=self.softmax_scale, deterministic=self.deterministic,
                      recompute=self.recompute, capture=self.capture,
                      context_parallel_group=context_parallel_group,
                      context_parallel_layout=context_parallel_layout, **self.nsa_options)
        elif packed:
            out = kernels.flash_attn_varlen_func(
                q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                softmax_scale=self.softmax_scale, causal=True, deterministic=self.deterministic,
                host_cu_seqlens=host_cu_seqlens)
        else:
            out = kernels.flash_attn_func(q, k, v, softmax_scale=self.softmax_scale, causal=True,
                                          deterministic=self.deterministic)
        return F.linear(out.flatten(-2), *_cast(self.o_proj, dtype))


class NSAAttentionReference(NSAAttention):
    """NSAAttention's function in plain PyTorch: nsa_reference for attention="nsa", a masked
    softmax per sequence for "dense". Same constructor, parameters and forward signature;
    slow, for tests (run it in float64)."""

    def forward(self, hidden_states: Tensor, *, cu_seqlens: Tensor | None = None,
                max_seqlen: int | None = None,
                host_cu_seqlens: tuple[int, ...] | list[int] | None = None,
                position_ids: Tensor | None = None) -> Tensor:
        padded_shape = None
        if cu_seqlens is None:  # B rows of N: the same as B sequences of N packed
            padded_shape = hidden_states.shape
            batch, n = padded_shape[:2]
            cu_seqlens = torch.arange(batch + 1, dtype=torch.int32) * n
            hidden_states = hidden_states.reshape(batch * n, -1)
            if position_ids is not None:
                position_ids = position_ids.reshape(-1)
        bounds = [int(b) for b in cu_seqlens.tolist()]
        dtype = hidden_states.dtype

        def project(linear: nn.Linear, heads: int) -> Tensor:
            out = hidden_states @ linear.weight.to(dtype).T
            if linear.bias is not None:
                out = out + linear.bias.to(dtype)
            return out.reshape(len(hidden_states), heads, self.head_dim)

        q = project(self.q_proj, self.num_heads)
        k = project(self.k_proj, self.num_kv_heads)
        v = project(self.v_proj, self.num_kv_heads)
        if position_ids is None:
            position_ids = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])])
        q, k = (self._rotate(x, position_ids) for x in (q, k))

        if self.attention == "nsa":
            out = nsa_reference(
                q, k, v, cu_seqlens=cu_seqlens, W_k=_as(self.W_k, dtype),
                W_v=_as(self.W_v, dtype), W_gate=_as(self.W_gate, dtype),
                softmax_scale=self.softmax_scale, **self.nsa_options)
        else:
            out = torch.cat([self._dense_causal(q[a:b], k[a:b], v[a:b])
                             for a, b in zip(bounds, bounds[1:])])
        out = out.reshape(len(hidden_states), -1) @ self.o_proj.weight.to(dtype).T
        return out if padded_shape is None else out.reshape(padded_shape)

    def _rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotation of each channel pair (i, i + D/2), read as one complex number, by
        position * base ** (-i / (D/2)), in float64."""
        half = self.head_dim // 2
        pairs = torch.complex(x[..., :half].double(), x[..., half:].double())
        frequencies = self.rope_base ** (
            -torch.arange(half, dtype=torch.float64, device=x.device) / half)
        angles = positions.to(x.device, torch.float64)[:, None, None] * frequencies
        rotated = pairs * torch.exp(1j * angles)
        return torch.cat([rotated.real, rotated.imag], dim=-1).to(x.dtype)

    def _dense_causal(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        group = self.num_heads // self.num_kv_heads
        k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
        scale = self.head_dim ** -0.5 if self.softmax_scale is None else self.softmax_scale
        scores = torch.einsum("ihd,jhd->hij", q, k) * scale
        n = len(q)
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        return torch.einsum("hij,jhd->ihd", weights, v)


def _cast(linear: nn.Linear, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """(weight, bias) of a projection in the activations' dtype (a no-op when they match)."""
    return linear.weight.to(dtype), None if linear.bias is None else linear.bias.to(dtype)


def _as(weight: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return None if weight is None else weight.to(dtype)
