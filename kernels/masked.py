"""Attention with a user mask and an additive bias, and the bias's gradient (padded inputs).

    S = softmax_scale * q k^T + attn_bias,   S = -inf where attn_mask is False
        or where causal / window_size / compress_factor hide the key,
    out = softmax(S) v,   lse = logsumexp(S)

attn_mask (bool, True = attend) and attn_bias (float16, bfloat16, float32; float64 on this torch
path) broadcast over
(B, H, Nq, Nk): each is (Bm, Hm, Nq, Nk) with Bm in {1, B} and Hm in {1, Hkv, H} (Hkv: one
per KV head, shared by its query heads), or the same with leading dims left out. A bias cell of
-inf hides its key like a False mask cell. A row that sees no key outputs 0, has lse -inf and
gets zero gradients (never NaN). With a bias gradient, dbias = dL/dS summed over the broadcast
dims, in the bias's dtype; cells no row sees get 0.

The forward runs on the sm90 kernel where it takes the call (`sm90_forward`): the tiles to
visit are listed from the mask, the bias's -inf cells and the causal/window rule, per
128 x 128 tile (`tile_lists`: tiles where nothing is seen are never loaded, tiles where
everything is seen skip the mask), and the kernel adds the bias and reads the mask in
registers (kernels/sm90/score_mod.py). Its backward sums a shared 16-bit bias's gradient in
float32 over at most KERNEL_SUMS_BUDGET_BYTES, one chunk of keys at a time past it.

A mask that many calls share (a model's layers, a fixed pattern across steps) can be prepared
once (`prepare_mask`, FlexAttention's BlockMask in our terms): its tile classes, the tile lists
of each call shape and their transpose for the backward are then built at the first call and
reused, with or without a bias; its tensor must not change afterwards (an in-place change is
refused at the next call). A prepared mask decides the tiles visited, as a BlockMask does: a
bias's -inf cells still hide their keys but no longer take tiles off the lists (a tile the
bias hides whole is visited and contributes nothing; put such tiles in the mask to skip them).

The torch path here is the reference those kernels are held to, and the backward: it works one
chunk of query rows at a time (all keys, every head) so that its temporaries stay under
`CHUNK_BUDGET_BYTES`; nothing of Nq x Nk is allocated beyond the user's mask and bias and the
bias's gradient. The chunks walk the batch inside each row range, so a bias shared by the batch
(Bm = 1) sums its gradient over the batch in float32 and is written once per cell.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from .fallback import accumulation_dtype, has_rule, visible_under_rule
from .validate import AttentionProblem

CHUNK_BUDGET_BYTES = 256 << 20
# float64 too: the torch path computes float64 inputs exactly (gradient checks).
BIAS_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The sm90 path: its tiles (query rows x keys) and the bias types it reads.
KERNEL_TILE = 128
KERNEL_BIAS_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The bias's tile classes read only the tiles the rule and the mask list (`_prior_for`);
# False: the whole bias (a switch for the A/B, `tools/bench_masked.py --switch`).
BIAS_CLASSES_AFTER_MASK = True
# The sm90 backward's float32 dbias sums (a 16-bit bias a slab of which serves several heads or
# batch entries: dS is summed over them, `_BiasGradient`) hold at most this many bytes: past
# it the backward runs in chunks of keys whose sums fit (`_backward_by_columns`), so no call
# keeps a float32 copy of its bias's size beside the bias and its gradient (a shared 16K x 16K
# bias would need 1 GiB, 64K x 64K 16 GiB).
KERNEL_SUMS_BUDGET_BYTES = 256 << 20


@dataclass(frozen=True)
class Broadcast:
    """How a (Bm, Hm, Nq, Nk) mask or bias spreads over (B, H, Nq, Nk)."""

    batch: int  # Bm: 1 or B
    heads: int  # Hm: 1, Hkv or H


class PreparedMask:
    """An attention mask whose tile lists are built once (`prepare_mask`): pass it as
    flash_attn_func's attn_mask. Holds the bool tensor, its tile classes (built at the first
    call on the kernels) and, per call shape and rule (`AttentionProblem`), the tile lists,
    their transpose and, per bias broadcast form, the map of tiles they visit (the bias
    gradient's), reused by every later call of that shape. The tensor must keep its values: a
    call after an in-place change raises (torch's version counter; an inference tensor has
    none and is trusted)."""

    # Call shapes kept (train and eval, a few rules); the oldest goes first.
    MAX_SHAPES = 8

    def __init__(self, mask: torch.Tensor):
        self.mask = mask
        self._version = None if mask.is_inference() else mask._version
        self._classes: torch.Tensor | None = None
        # (AttentionProblem, list heads) -> [lists, their transpose or None,
        #     {bias form: visited tiles}, {KV tiles of a chunk of keys: their transpose}]
        self._lists: dict = {}

    def tensor(self) -> torch.Tensor:
        """The mask, refused (ValueError) if it changed since it was prepared."""
        if self._version is not None and self.mask._version != self._version:
            raise ValueError("attn_mask: the tensor of this kernels.PreparedMask was changed in "
                             "place after prepare_mask (its tile lists no longer describe it); "
                             "prepare it again")
        return self.mask

    def cell_classes(self, tile: int) -> torch.Tensor:
        """`_cell_classes` of the mask, built once."""
        if self._classes is None:
            self._classes = _cell_classes(self.mask, lambda m: m != 0, tile)
        return self._classes

    def lists_for(self, problem: AttentionProblem, heads: int, build):
        """The tile lists of `problem` (the mask's and the rule's), `heads` lists per batch
        entry and tile: build()'s result, kept."""
        key = (problem, heads)
        entry = self._lists.get(key)
        if entry is None:
            while len(self._lists) >= self.MAX_SHAPES:
                self._lists.pop(next(iter(self._lists)))
            entry = self._lists[key] = [build(), None, {}, {}]
        return entry[0]

    def _entry(self, lists):
        return next((entry for entry in self._lists.values() if entry[0] is lists), None)

    def transposed_for(self, lists):
        """The kept transpose of `lists` (lists of this mask), or None."""
        entry = self._entry(lists)
        return None if entry is None else entry[1]

    def keep_transposed(self, lists, transposed) -> None:
        entry = self._entry(lists)
        if entry is not None:
            entry[1] = transposed

    def columns_for(self, lists, tiles: tuple[int, int], build):
        """build()'s transpose of `lists` (lists of this mask) restricted to the KV tiles
        [first, end) `tiles` (a chunk of keys of `_backward_by_columns`), kept with them."""
        entry = self._entry(lists)
        if entry is None:
            return build()
        if tiles not in entry[3]:
            entry[3][tiles] = build()
        return entry[3][tiles]

    def visited_for(self, lists, bias_form, build):
        """build()'s tiles `lists` (lists of this mask) visit per bias slab of the (Bm, Hm)
        form `bias_form` (`_VisitedTiles`: their map, and their slots once counted), kept with
        them."""
        entry = self._entry(lists)
        if entry is None:
            return build()
        form = tuple(bias_form)
        if form not in entry[2]:
            entry[2][form] = build()
        return entry[2][form]


def prepare_mask(attn_mask: torch.Tensor) -> PreparedMask:
    """attn_mask (bool, broadcastable as flash_attn_func's) prepared for many calls: pass the
    result as attn_mask. Its tile lists are built at the first call of each shape and reused
    with or without a bias (the sm90 kernels; the torch path reads the tensor as it is): they
    decide the tiles visited, a bias's -inf cells hide keys inside them. Checked here for its
    type and rank; its shape against q and k at each call."""
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool:
        raise TypeError(f"attn_mask must be bool (True = attend), got {attn_mask.dtype}")
    if not 2 <= attn_mask.dim() <= 4:
        raise ValueError(f"attn_mask must be 2-D to 4-D (B or 1, H or Hkv or 1, Nq, Nk), got "
                         f"shape {tuple(attn_mask.shape)}")
    return PreparedMask(attn_mask)


def mask_tensor(attn_mask):
    """The tensor of an attn_mask that is a tensor, a PreparedMask (checked unchanged) or None."""
    return attn_mask.tensor() if isinstance(attn_mask, PreparedMask) else attn_mask


def prepared_of(attn_mask) -> PreparedMask | None:
    """attn_mask where it is a PreparedMask, else None (a tensor or no mask)."""
    return attn_mask if isinstance(attn_mask, PreparedMask) else None


def check_mask_and_bias(q, k, attn_mask, attn_bias) -> tuple[Broadcast | None, Broadcast | None]:
    """The broadcast of each (None where not given), or a TypeError / ValueError naming the
    argument. q (B, Nq, H, D), k (B, Nk, Hkv, D) are already checked. attn_mask may be a
    `PreparedMask`."""
    attn_mask = mask_tensor(attn_mask)
    if q.dim() != 4:
        raise ValueError("attn_mask, attn_bias: padded inputs only (q (B, Nq, H, D)); packed "
                         "varlen calls do not take them")
    forms = []
    for name, x, dtypes in (("attn_mask", attn_mask, (torch.bool,)),
                            ("attn_bias", attn_bias, BIAS_DTYPES)):
        if x is None:
            forms.append(None)
            continue
        if not isinstance(x, torch.Tensor):
            also = " or a kernels.PreparedMask" if name == "attn_mask" else ""
            raise TypeError(f"{name} must be a torch.Tensor{also}, got {type(x).__name__}")
        if x.dtype not in dtypes:
            names = "/".join(str(d).removeprefix("torch.") for d in dtypes)
            raise TypeError(f"{name} must be {names}, got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}), got {x.device}")
        forms.append(_broadcast(name, x, q, k))
    return forms[0], forms[1]


def _broadcast(name: str, x: torch.Tensor, q, k) -> Broadcast:
    batch, seqlen_q, heads, _ = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    form = f"(B or 1, H or Hkv or 1, Nq, Nk) = ({batch} or 1, {heads} or {kv_heads} or 1, " \
           f"{seqlen_q}, {seqlen_k})"
    if not 2 <= x.dim() <= 4:
        raise ValueError(f"{name} must broadcast as {form}, got shape {tuple(x.shape)}")
    shape = (1,) * (4 - x.dim()) + tuple(x.shape)
    if (shape[0] not in (1, batch) or shape[1] not in (1, kv_heads, heads)
            or shape[2:] != (seqlen_q, seqlen_k)):
        raise ValueError(f"{name} must broadcast as {form}, got shape {tuple(x.shape)}")
    return Broadcast(shape[0], shape[1])


def _as_4d(x: torch.Tensor) -> torch.Tensor:
    return x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))


def _head_sharing(heads: int, kv_heads: int, group: int) -> str:
    """Whom each of a mask's or bias's Hm heads serves: "query" (one per query head), "kv"
    (one per KV head; H == Hkv counts as "query"), or "all" (one for every head)."""
    if heads == kv_heads * group and heads != kv_heads:
        return "query"
    if heads == kv_heads and heads > 1:
        return "kv"
    return "all"


def _per_head(x: torch.Tensor, heads: int, kv_heads: int, group: int) -> torch.Tensor:
    """(Hm, rows, keys) as (Hkv or 1, G or 1, rows, keys), broadcasting like the scores."""
    sharing = _head_sharing(heads, kv_heads, group)
    if sharing == "query":
        return x.view(kv_heads, group, *x.shape[1:])
    return x.unsqueeze(1) if sharing == "kv" else x.unsqueeze(0)


def _rows_per_chunk(problem: AttentionProblem, num_keys: int, acc: torch.dtype,
                    budget: int) -> int:
    """Query rows per chunk: scores, probabilities and their gradient for every head."""
    per_row = problem.num_heads * max(num_keys, 1) * torch.finfo(acc).bits // 8 * 4
    return max(1, budget // per_row)


class _Chunk:
    """One range of query rows of one batch entry: its scores under every rule, and what the
    forward and the backward read of them. Heads are laid out (Hkv, G, rows, ...)."""

    def __init__(self, problem, q, k, attn_mask, attn_bias, b: int, r0: int, r1: int, acc):
        kv_heads, group = problem.num_kv_heads, problem.group_size
        self.rows = r1 - r0
        q_rows = q[b, r0:r1].to(acc)  # (rows, H, D)
        self.q = q_rows.view(self.rows, kv_heads, group, -1).permute(1, 2, 0, 3)
        self.k = k[b].to(acc).permute(1, 0, 2).unsqueeze(1)  # (Hkv, 1, Nk, D)
        scores = torch.matmul(self.q, self.k.transpose(-1, -2)).mul_(problem.softmax_scale)
        if attn_bias is not None:
            bias = _as_4d(attn_bias)
            scores += _per_head(bias[b if bias.shape[0] > 1 else 0, :, r0:r1].to(acc),
                                bias.shape[1], kv_heads, group)
        hidden = None
        if has_rule(problem):
            rows = torch.arange(r0, r1, device=q.device).unsqueeze(1)
            keys = torch.arange(k.shape[1], device=q.device)
            hidden = ~visible_under_rule(problem, rows, keys)
        if attn_mask is not None:
            mask = _as_4d(attn_mask)
            unmasked = _per_head(mask[b if mask.shape[0] > 1 else 0, :, r0:r1], mask.shape[1],
                                 kv_heads, group)
            hidden = ~unmasked if hidden is None else hidden | ~unmasked
        if hidden is not None:
            scores.masked_fill_(hidden, float("-inf"))
        self.scores = scores  # (Hkv, G, rows, Nk)

    def lse(self) -> torch.Tensor:
        """(Hkv, G, rows): -inf for a row that sees nothing."""
        return torch.logsumexp(self.scores, dim=-1)

    def probabilities(self, lse: torch.Tensor) -> torch.Tensor:
        """exp(S - lse), 0 in every cell of a row that sees nothing (its lse is -inf)."""
        finite = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
        return torch.exp(self.scores - finite.unsqueeze(-1))

    @staticmethod
    def to_rows(x: torch.Tensor) -> torch.Tensor:
        """(Hkv, G, rows, D) -> (rows, H, D)."""
        kv_heads, group, rows, dim = x.shape
        return x.permute(2, 0, 1, 3).reshape(rows, kv_heads * group, dim)


def _chunks(problem: AttentionProblem, q, k, budget: int):
    """(b, r0, r1) in row-range-major order (the batch inside each range)."""
    acc = accumulation_dtype(q.dtype)
    step = _rows_per_chunk(problem, k.shape[1], acc, budget)
    for r0 in range(0, q.shape[1], step):
        for b in range(q.shape[0]):
            yield b, r0, min(r0 + step, q.shape[1])


def forward(problem: AttentionProblem, q, k, v, attn_mask=None, attn_bias=None,
            budget: int = CHUNK_BUDGET_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, Nq, H, D) in q's dtype, lse (B, H, Nq) float32 (float64 for float64))."""
    acc = accumulation_dtype(q.dtype)
    batch, seqlen_q, heads, dim = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, seqlen_q, dtype=acc, device=q.device)
    for b, r0, r1 in _chunks(problem, q, k, budget):
        chunk = _Chunk(problem, q, k, attn_mask, attn_bias, b, r0, r1, acc)
        chunk_lse = chunk.lse()
        values = v[b].to(acc).permute(1, 0, 2).unsqueeze(1)  # (Hkv, 1, Nk, D)
        out[b, r0:r1] = _Chunk.to_rows(torch.matmul(chunk.probabilities(chunk_lse), values))
        lse[b, :, r0:r1] = chunk_lse.reshape(heads, r1 - r0)
    return out, lse


def backward(problem: AttentionProblem, dout, q, k, v, out, lse, attn_mask=None, attn_bias=None,
             bias_gradient: bool = False, budget: int = CHUNK_BUDGET_BYTES):
    """(dq, dk, dv, dbias): dk, dv summed over each KV group; dbias (the bias's shape and dtype)
    with bias_gradient, else None."""
    acc = accumulation_dtype(q.dtype)
    batch, seqlen_q, heads, dim = q.shape
    kv_heads, group = problem.num_kv_heads, problem.group_size
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    dbias = None
    if bias_gradient:
        dbias = torch.zeros_like(attn_bias)
        bias_4d = _as_4d(attn_bias)
        dbias_4d = _as_4d(dbias)
        shared_batch = bias_4d.shape[0] == 1
    pending = None  # (r0, r1, float32 dbias rows summed over the batch) for a shared bias
    for b, r0, r1 in _chunks(problem, q, k, budget):
        chunk = _Chunk(problem, q, k, attn_mask, attn_bias, b, r0, r1, acc)
        rows_lse = lse[b, :, r0:r1].to(acc).view(kv_heads, group, r1 - r0)
        p = chunk.probabilities(rows_lse)  # (Hkv, G, rows, Nk)
        values = v[b].to(acc).permute(1, 0, 2).unsqueeze(1)  # (Hkv, 1, Nk, D)
        d_rows = dout[b, r0:r1].to(acc).view(r1 - r0, kv_heads, group, dim).permute(1, 2, 0, 3)
        o_rows = out[b, r0:r1].to(acc).view(r1 - r0, kv_heads, group, dim).permute(1, 2, 0, 3)
        delta = (d_rows * o_rows).sum(-1, keepdim=True)
        ds = p * (torch.matmul(d_rows, values.transpose(-1, -2)) - delta)
        dq[b, r0:r1] = _Chunk.to_rows(torch.matmul(ds, chunk.k) * problem.softmax_scale)
        dk[b] += (torch.matmul(ds.transpose(-1, -2), chunk.q).sum(1)
                  * problem.softmax_scale).permute(1, 0, 2)
        dv[b] += torch.matmul(p.transpose(-1, -2), d_rows).sum(1).permute(1, 0, 2)
        if dbias is None:
            continue
        rows_grad = _reduce_heads(ds, bias_4d.shape[1])  # (Hm, rows, Nk)
        if not shared_batch:
            dbias_4d[b, :, r0:r1] = rows_grad.to(dbias.dtype)
            continue
        if pending is not None and pending[0] != r0:
            dbias_4d[0, :, pending[0]:pending[1]] = pending[2].to(dbias.dtype)
            pending = None
        pending = (r0, r1, rows_grad if pending is None else pending[2] + rows_grad)
    if pending is not None:
        dbias_4d[0, :, pending[0]:pending[1]] = pending[2].to(dbias.dtype)
    return dq, dk.to(k.dtype), dv.to(v.dtype), dbias


def _reduce_heads(ds: torch.Tensor, heads: int) -> torch.Tensor:
    """dS (Hkv, G, rows, Nk) summed to a bias's Hm heads: (Hm, rows, Nk)."""
    sharing = _head_sharing(heads, *ds.shape[:2])
    if sharing == "query":
        return ds.reshape(heads, *ds.shape[2:])
    return ds.sum(1) if sharing == "kv" else ds.sum((0, 1)).unsqueeze(0)


# --- the sm90 forward ----------------------------------------------------------------------------

def sm90_forward(problem: AttentionProblem, q, k, v, attn_mask=None, attn_bias=None,
                 bias_gradient: bool = False):
    """(out, lse, tiles) of `forward` on the sm90 kernel (tiles: a `ForwardTiles`, what the
    backward may reuse), or None where it does not take the call (then the torch path runs).
    The same function, dtype rules and outputs. attn_mask may be a `PreparedMask`.
    bias_gradient: the backward will take the bias's gradient; where its float32 sums would
    pass KERNEL_SUMS_BUDGET_BYTES, the tiles the lists visit are counted here for it
    (`_VisitedTiles.count_later`: the backward reads the count without waiting for more than
    this point of the forward)."""
    call = _kernel_call("forward", problem, q, k, v, attn_mask, attn_bias)
    if call is None:
        return None
    kernel, kwargs = call
    mods = score_mod_tensors(problem, mask_tensor(attn_mask), attn_bias)
    lists, visited = kwargs["block_sparse"], None
    # The cells' sums pass the budget (`_keys_per_launch` takes every key where there are
    # no float32 sums): the rule `_BiasGradient` counts the visited tiles by.
    if (bias_gradient and prepared_of(attn_mask) is None
            and _keys_per_launch(problem, attn_bias, mods.bias) < problem.max_seqlen_k
            and not torch.cuda.is_current_stream_capturing()):
        visited = _VisitedTiles.of(problem, lists, _as_4d(attn_bias).shape[:2])
        visited.count_later()
    out, lse = kernel.run(q, k, v, **kwargs, score_mods=mods)
    return out, lse, ForwardTiles(lists, visited)


@dataclass(frozen=True)
class ForwardTiles:
    """What the sm90 forward hands its backward (`sm90_backward(tiles=)`): the tile lists it
    ran on and, where it counted them for the bias's gradient, the tiles they visit per bias
    slab (`_VisitedTiles`)."""
    lists: object
    visited: "_VisitedTiles | None" = None


def sm90_backward(problem: AttentionProblem, dout, q, k, v, out, lse, attn_mask=None,
                  attn_bias=None, bias_gradient: bool = False, tiles=None):
    """(dq, dk, dv, dbias) of `backward` on the sm90 kernel (the KV-centric kernel with the
    fused dQ, dS summed into a float32 dbias by reductions), or None where it does not take
    the call. Its float32 sums (dQ, dbias) land in a run-dependent order: deterministic callers
    take the torch path. tiles: the forward's `ForwardTiles` of this call (None: the lists
    built here). attn_mask may be a `PreparedMask`."""
    if bias_gradient and _broadcast_view(attn_bias).shape != _as_4d(attn_bias).shape:
        return None  # an expanded bias's gradient is per copy: its cells are not one slab
    tiles = tiles or ForwardTiles(None)
    call = _kernel_call("backward", problem, q, k, v, attn_mask, attn_bias, tiles.lists)
    if call is None:
        return None
    kernel, kwargs = call
    mods = score_mod_tensors(problem, mask_tensor(attn_mask), attn_bias)
    if (not kernel.can_run_score_mods(q, k, v, score_mods=mods, bias_grad=bias_gradient,
                                      **kwargs)
            or not _rows_are_32_bit_offsets(mods.mask, mods.bias)):
        return None
    gradient = _BiasGradient(problem, attn_bias, mods.bias, kwargs["block_sparse"],
                             prepared_of(attn_mask), tiles.visited) if bias_gradient else None
    if gradient is not None and len(gradient.chunks) > 1:
        return _backward_by_columns(gradient, problem, dout, q, k, v, out, lse, attn_mask,
                                    mods, kernel, kwargs)
    dq, dk, dv = kernel.run(dout, q, k, v, out, lse, **kwargs, score_mods=mods,
                            head_major_units=mods.head_major_units,
                            **({} if gradient is None else gradient.launch(0)))
    if gradient is not None:
        gradient.convert()
    return dq, dk, dv, None if gradient is None else gradient.result()


def _keys_per_launch(problem: AttentionProblem, attn_bias: torch.Tensor,
                     bias: torch.Tensor) -> int:
    """Keys per backward launch: all of them, or where the float32 dbias sums of all keys
    pass KERNEL_SUMS_BUDGET_BYTES, the most whole tiles of keys whose sums fit (one tile at
    least). bias: the (slabs, Nq, Nk) cells the kernel reads."""
    slabs, rows, keys = bias.shape
    if not _sums_in_float32(problem, attn_bias, bias):
        return keys
    per_key = slabs * rows * 4
    if keys * per_key <= KERNEL_SUMS_BUDGET_BYTES:
        return keys
    return max(1, KERNEL_SUMS_BUDGET_BYTES // (per_key * KERNEL_TILE)) * KERNEL_TILE


def _backward_by_columns(gradient: "_BiasGradient", problem: AttentionProblem, dout, q, k, v,
                         out, lse, attn_mask, mods, kernel, kwargs):
    """`sm90_backward` with the bias's gradient, one launch per chunk of keys
    (`gradient.chunks`, whole KERNEL_TILE tiles). Each launch is the backward of its keys
    alone: k, v, the mask's and the bias's columns, the transpose of the call's lists
    restricted to its KV tiles (`sparsity.csr.csr_rows`), and where a rule reads positions,
    the rows placed so that the keys keep theirs (q_start_positions moved back by the chunk's
    first key's position). So dK and dV of its keys are whole and written once,
    its float32 dbias sums cover its columns alone and are converted into them before the
    next launch reuses them, and every launch adds its dQ into one float32 accumulator
    (`DqSums`), converted once; the row statistics are computed once. A `PreparedMask` keeps
    each chunk's transpose."""
    from sparsity.csr import csr_rows

    from .sm90.backward import DqSums, SharedRowStatistics

    seqlen_k, tile = problem.max_seqlen_k, KERNEL_TILE
    lists, transposed = kwargs["block_sparse"], kwargs["block_sparse_transposed"]
    prepared = prepared_of(attn_mask)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dq_sums, statistics = DqSums(), SharedRowStatistics()
    for index, (c0, c1) in enumerate(gradient.chunks):
        tiles = (c0 // tile, -(-c1 // tile))
        build = functools.partial(csr_rows, transposed, -(-seqlen_k // tile), *tiles)
        part = dict(kwargs, max_seqlen_k=c1 - c0, block_sparse_transposed=(
            build() if prepared is None else prepared.columns_for(lists, tiles, build)))
        if has_rule(problem):  # key j of the chunk is key c0 + j: its position moves by c0 cf
            part["q_start_positions"] = tuple(problem.q_start(s) - c0 * problem.compress_factor
                                              for s in range(problem.num_seqs))
        part_mods = dataclasses.replace(
            mods, mask=None if mods.mask is None else mods.mask[..., c0:c1],
            bias=mods.bias[..., c0:c1])
        columns = (dk[:, c0:c1], dv[:, c0:c1])  # contiguous for one batch entry: written
        dq_part, *dkv_part = kernel.run(
            dout, q, k[:, c0:c1], v[:, c0:c1], out, lse, **part, score_mods=part_mods,
            head_major_units=mods.head_major_units, **gradient.launch(index),
            dq_sums=dq_sums, row_statistics=statistics, dkv_out=columns)
        gradient.convert()
        assert dq_part is None, "a chunk's dQ adds into the shared float32 sums"
        for into, part_grad in zip(columns, dkv_part):
            if part_grad.data_ptr() != into.data_ptr():  # not written in place
                into.copy_(part_grad)
    return dq_sums.finish().view(q.shape), dk, dv, gradient.result()


class _BiasGradient:
    """The float32 sums the sm90 backward adds dS into and the bias's gradient made of them,
    over one launch or one launch per chunk of keys (`chunks`, `_backward_by_columns`):
    `launch(i)` gives launch i's dbias arguments of the kernel, its sums zeroed where it
    adds, `convert()` turns them into the gradient's columns after it, and `result()` is the
    gradient. The sums take one of two forms, decided here:

    - the bias's cells, (slabs, Nq, Nk), in one launch where they fit
      KERNEL_SUMS_BUDGET_BYTES;
    - past it, the visited 128 x 128 tiles alone, (slots, 128, 128), each found through an
      int32 map of the tiles (`BwdSpec.score_dbias_tiles`), where they are counted on the
      host: a prepared mask's, counted once at its first backward that needs them, or a
      tensor mask's, counted by the forward (`counted`) (a window of 2048 keys at 16K visits
      12% of the tiles); one launch per run of tile columns whose visited tiles fit the
      budget;
    - else one launch per chunk of keys whose cells fit (`_keys_per_launch`), the chunks'
      sums one buffer in turn.

    Only the tiles some list visits receive a sum. Where `kernels.sm90.dbias_tiles` runs, only
    those tiles of the cells' sums are zeroed before the backward and read after it; the
    gradient's other tiles are written as zeros in the same pass (at 16K x 16K, window 32, the
    whole-tensor zeroing and conversion cost 0.67 ms, more than the attention). A float32
    bias's gradient is its own sums. Elsewhere the columns are zeroed and converted whole in
    torch.

    Where every slab serves one batch entry and query head (`stores`: a (B, H, Nq, Nk) bias, the
    largest), nothing is summed: the backward stores each visited cell's dS into the gradient
    itself, in the bias's dtype (`BwdSpec.score_dbias_stores`), the other tiles are zeroed, and
    there is no float32 temporary (a per-head 16-bit bias of 16 x 16K x 16K would need 16 GiB)."""

    def __init__(self, problem: AttentionProblem, attn_bias: torch.Tensor, bias: torch.Tensor,
                 lists, prepared: PreparedMask | None = None,
                 counted: "_VisitedTiles | None" = None):
        from . import dispatch

        self.shape = attn_bias.shape
        device = bias.device
        keys = bias.shape[2]
        self.stores = _dbias_stores(problem, bias)
        self.out = torch.empty(bias.shape, dtype=attn_bias.dtype, device=device)
        self._tiles, _ = dispatch.sm90_module("dbias_tiles", device)
        visited = None
        if self._tiles is not None:
            form = _as_4d(attn_bias).shape[:2]
            build = functools.partial(_VisitedTiles.of, problem, lists, form)
            visited = counted or (build() if prepared is None
                                  else prepared.visited_for(lists, form, build))
        self._map = None if visited is None else visited.map
        self.chunks = [(0, keys)]  # the keys of each launch
        self._slots = None  # the (slabs, Tq, Tk) int32 slot map of sums of the visited tiles
        self._slot_runs = None  # per launch: (first tile column, end, first slot, slots)
        self._sums = None  # one launch's float32 sums, or None: the gradient's own cells
        if _sums_in_float32(problem, attn_bias, bias):
            width = _keys_per_launch(problem, attn_bias, bias)
            # The cells where they fit: a step finds its tile's slot with one more dependent
            # load (H200, 16K, prepared: window 2048 3.64 -> 3.77 ms, window 16384 in chunks
            # 12.67 -> 13.45).
            if width < keys and visited is not None and (prepared is not None
                                                         or visited is counted):
                slots, column_counts = visited.slots()
                runs = _slot_runs(column_counts,
                                  KERNEL_SUMS_BUDGET_BYTES // (4 * KERNEL_TILE * KERNEL_TILE))
                sums = torch.empty(max(1, *(run[3] for run in runs)), KERNEL_TILE,
                                   KERNEL_TILE, dtype=torch.float32, device=device)
                if self._tiles.can_run_slots(slots, sums, self.out):
                    self._slots, self._slot_runs, self._sums = slots, runs, sums
                    self.chunks = [(t0 * KERNEL_TILE, min(t1 * KERNEL_TILE, keys))
                                   for t0, t1, _, _ in runs]
            if self._sums is None:
                self.chunks = [(c0, min(c0 + width, keys)) for c0 in range(0, keys, width)]
                self._sums = torch.empty((*bias.shape[:2], width), dtype=torch.float32,
                                         device=device)
        self._launch = None  # (visited tiles or slots or None, sums, gradient cells)

    def launch(self, index: int) -> dict:
        """The kernel's dbias arguments (`kernels.sm90.backward.run`) for launch `index`, over
        keys chunks[index] (whole tiles from the first), its sums zeroed where it adds (with
        stores: the gradient's tiles no list visits zeroed)."""
        c0, c1 = self.chunks[index]
        out = self.out[..., c0:c1]
        if self._slots is not None:  # every slot is a visited tile's
            t0, t1, first, count = self._slot_runs[index]
            slots = self._slots
            if (t0, t1) != (0, slots.shape[2]):  # the run's columns, its first slot 0 (a copy:
                slots = slots[..., t0:t1] - first  # the kernel reads it 16-byte aligned)
            sums = self._sums[:max(count, 1)]
            sums.zero_()
            self._launch = (slots, sums, out)
            return dict(dbias=sums, dbias_slots=slots)
        sums = out if self._sums is None else self._sums[..., :c1 - c0]
        visited = None
        if self._map is not None:
            visited = self._map[..., c0 // KERNEL_TILE:-(-c1 // KERNEL_TILE)]
            if not self._tiles.can_run(visited, sums, out):
                visited = None
        if visited is None:
            sums.zero_()
        elif self.stores:
            self._tiles.zero_unlisted(visited, out)
        else:
            self._tiles.zero_listed(visited, sums)
        self._launch = (visited, sums, out)
        return dict(dbias=sums, dbias_stores=self.stores)

    def convert(self) -> None:
        """The launch's columns of the gradient from its sums (0 in every tile no list
        visits)."""
        visited, sums, out = self._launch
        if self._slots is not None:
            self._tiles.convert_slots(visited, sums, out)
        elif visited is not None and not self.stores:
            self._tiles.convert(visited, sums, out)
        elif out is not sums:
            out.copy_(sums)
        self._launch = None

    def result(self) -> torch.Tensor:
        """The gradient in the bias's shape and dtype."""
        return self.out.view(self.shape)


def _slot_runs(column_counts: list[int], capacity: int) -> list[tuple[int, int, int, int]]:
    """(first tile column, end, first slot, slots) of each launch: the longest runs of tile
    columns whose visited tiles (`column_counts` per column, slots numbered column by column)
    fit `capacity` slots, one column at least."""
    runs, start, first, total = [], 0, 0, 0
    for column, count in enumerate(column_counts):
        if column > start and total + count > capacity:
            runs.append((start, column, first, total))
            start, first, total = column, first + total, 0
        total += count
    runs.append((start, len(column_counts), first, total))
    return runs


class _VisitedTiles:
    """The 128 x 128 tiles a call's lists visit per bias slab (`map`, `_visited_tiles`) and
    each visited tile's slot in float32 sums of those tiles alone, numbered tile column by
    tile column, with the count of each column (`slots`). A prepared mask keeps them with
    its lists and counts them once, at its first backward; a tensor mask's are counted by the
    forward (`count_later`) and read by the backward."""

    def __init__(self, visited: torch.Tensor):
        self.map = visited
        self._slots = None
        self._pending = None  # (slots, the counts in pinned host memory, their copy's event)

    @classmethod
    def of(cls, problem: AttentionProblem, lists, bias_form) -> "_VisitedTiles":
        return cls(_visited_tiles(problem, lists, bias_form))

    def _slot_map(self) -> tuple[torch.Tensor, torch.Tensor]:
        by_column = self.map.permute(2, 0, 1) != 0  # (Tk, slabs, Tq)
        seen = by_column.flatten()
        order = torch.cumsum(seen, 0, dtype=torch.int32) - 1
        slots = torch.where(seen, order, -1).view(by_column.shape)
        counts = by_column.flatten(1).sum(1, dtype=torch.int32)
        return slots.permute(1, 2, 0).contiguous(), counts

    def count_later(self) -> None:
        """Count the slots now, on the device, and copy the counts to the host without
        waiting: `slots` then waits for this point of the stream alone (the forward's, long
        passed by the time its backward runs in a training step), not for all queued work."""
        slots, counts = self._slot_map()
        host = torch.empty(counts.shape, dtype=torch.int32, pin_memory=True)
        host.copy_(counts, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self._pending = (slots, host, copied)

    def slots(self) -> tuple[torch.Tensor, list[int]]:
        """((slabs, Tq, Tk) int32: a visited tile's slot, -1 elsewhere; the visited tiles of
        each tile column, whose slots follow those of the columns before it)."""
        if self._slots is None:
            if self._pending is not None:
                slots, host, copied = self._pending
                copied.synchronize()
                self._slots, self._pending = (slots, host.tolist()), None
            else:
                slots, counts = self._slot_map()
                self._slots = (slots, counts.tolist())
        return self._slots


def _dbias_stores(problem: AttentionProblem, bias: torch.Tensor) -> bool:
    """Whether every slab of the (slabs, Nq, Nk) bias cells serves one batch entry and query
    head: each dbias cell then takes one dS, stored (`BwdSpec.score_dbias_stores`)."""
    return bias.shape[0] == problem.num_seqs * problem.num_heads


def _sums_in_float32(problem: AttentionProblem, attn_bias: torch.Tensor,
                     bias: torch.Tensor) -> bool:
    """Whether the backward sums dS into a float32 temporary of the bias cells' shape: not
    where the gradient is its own sums (a float32 bias) or takes stores (`_dbias_stores`)."""
    return attn_bias.dtype != torch.float32 and not _dbias_stores(problem, bias)


def _rows_are_32_bit_offsets(*cells) -> bool:
    """Whether every cell of these (slabs, Nq, Nk) views (None: absent) lies below 2**31
    elements from its slab's start: the backward reads them, and sums dS into float32 sums laid
    out as the bias is, at 32-bit offsets from one 64-bit address per slab
    (`kernels.sm90.score_mod.slab_rows`)."""
    return all(x is None or (x.shape[1] - 1) * x.stride(1) + x.shape[2] <= 2**31 - 1
               for x in cells)


def _visited_tiles(problem: AttentionProblem, lists, bias_form) -> torch.Tensor:
    """(slabs, Tq, Tk) int8: 1 where a list of one of the heads and batch entries a bias slab
    serves visits the tile. lists: (B * Tq, Hs) rows (`tile_lists`); bias_form: the bias's
    (Bm, Hm), Hm dividing Hs (its heads are one per query head, one per KV head, or one) and
    each list head's bias head its index // (Hs / Hm)."""
    rows, heads = lists.full_count.shape
    batch, (form_batch, form_heads) = problem.num_seqs, tuple(bias_form)
    tiles_q, tiles_k = rows // batch, -(-problem.max_seqlen_k // lists.col_block_size)
    visited = torch.zeros(rows, heads, tiles_k + 1, dtype=torch.int8,
                          device=lists.full_count.device)
    for count, index in ((lists.full_count, lists.full_index),
                         (lists.mask_count, lists.mask_index)):
        listed = torch.arange(index.shape[-1], device=index.device) < count.unsqueeze(-1)
        # Slots past the count go to the spare last column.
        visited.scatter_(-1, torch.where(listed, index, tiles_k).long(), 1)
    visited = visited[..., :tiles_k].view(form_batch, batch // form_batch, tiles_q,
                                          form_heads, heads // form_heads, tiles_k)
    return visited.amax(dim=(1, 4)).transpose(1, 2).reshape(form_batch * form_heads, tiles_q,
                                                            tiles_k)


def _kernel_call(direction: str, problem: AttentionProblem, q, k, v, attn_mask, attn_bias,
                 lists=None):
    """(kernel module, its keyword arguments) of the sm90 `direction` ("forward" or
    "backward") for this call, the tile lists under "block_sparse" (`lists`, or built here),
    or None where the kernel does not take it. Checked before any list is built: a bias type
    the kernels read, rows and keys (an empty side is the torch path's: every row sees
    nothing), and q, k, v the kernel module takes."""
    from . import dispatch

    if ((attn_bias is not None and attn_bias.dtype not in KERNEL_BIAS_DTYPES)
            or problem.max_seqlen_q == 0 or problem.max_seqlen_k == 0):
        return None
    module, _ = dispatch.sm90_module(direction, q.device)
    if module is None or module.unsupported_inputs(q, k, v, module.SUPPORTED_HEAD_DIMS):
        return None
    if lists is None:
        lists = tile_lists(problem, attn_mask, attn_bias)
    kwargs = dispatch.normalised_kwargs(problem, None, None, lists)
    prepared = prepared_of(attn_mask)
    if direction == "backward" and prepared is not None:
        kwargs["block_sparse_transposed"] = prepared.transposed_for(lists)
    kernel, _ = dispatch.attention_kernel(direction, q, k, v, kwargs, problem)
    if direction == "backward" and prepared is not None:
        prepared.keep_transposed(lists, kwargs.get("block_sparse_transposed"))
    return None if kernel is None else (kernel, kwargs)


def tile_lists(problem: AttentionProblem, attn_mask=None, attn_bias=None):
    """The block-sparse lists (`sparsity.BlockSparseTensors`, KERNEL_TILE square tiles, one
    list per (batch entry, tile, list head)) of the tiles a row may see something in: a tile is
    "full" when the rule, the mask and the bias let every existing cell through, "mask" when
    some, unlisted when none (combined tile by tile: a "mask" tile of two sources may turn out
    empty, which costs a visit, never a wrong result). Built on the device, without reads.
    A `PreparedMask` gives its kept lists, those of its mask and the rule, with or without a
    bias (the bias's -inf cells then hide keys inside the visited tiles without taking tiles
    off, as FlexAttention's BlockMask and score_mod divide the work; a tile of -inf scores adds
    nothing to a row's softmax, and a row of them outputs 0 with lse -inf as on a tensor
    mask)."""
    heads = _list_heads(problem, mask_tensor(attn_mask), attn_bias)
    if isinstance(attn_mask, PreparedMask):
        return attn_mask.lists_for(problem, heads,
                                   lambda: _tile_lists(problem, attn_mask, None, heads))
    return _tile_lists(problem, attn_mask, attn_bias, heads)


def _list_heads(problem: AttentionProblem, *given) -> int:
    """Lists per batch entry and tile: one per KV head at least (the kernels take lists per
    query head or per KV head, Hs in {H, Hkv}; lists shared by several KV heads gave a wrong
    backward), one per head of a mask or bias given per query head (a bias slab's heads then
    divide the list heads, as the bias gradient's map of visited tiles needs)."""
    return max([problem.num_kv_heads, *(_as_4d(x).shape[1] for x in given if x is not None)])


def _tile_lists(problem: AttentionProblem, attn_mask, attn_bias, heads: int):
    from sparsity import build_block_sparse_from_tile_classes

    tile = KERNEL_TILE
    prepared = prepared_of(attn_mask)
    attn_mask = mask_tensor(attn_mask)
    given = [x for x in (attn_mask, attn_bias) if x is not None]
    classes = _rule_classes(problem, tile, given[0].device)
    if attn_mask is not None:
        mask_classes = (prepared.cell_classes(tile) if prepared is not None
                        else _cell_classes(attn_mask, lambda m: m != 0, tile))
        classes = torch.minimum(classes, _expand(mask_classes, problem, heads))
    if attn_bias is not None:
        # The bias is read only in the tiles the rule and the mask list for a row it serves.
        prior = None
        if BIAS_CLASSES_AFTER_MASK and (attn_mask is not None or has_rule(problem)):
            prior = _prior_for(classes, _broadcast_view(attn_bias).shape[:2], heads)
        classes = torch.minimum(classes, _expand(
            _cell_classes(attn_bias, lambda b: b > float("-inf"), tile, prior), problem,
            heads))
    classes = classes.expand(problem.num_seqs, heads, *classes.shape[2:])
    on_kernel = _lists_on_kernel(classes, tile)
    if on_kernel is not None:
        return on_kernel
    return build_block_sparse_from_tile_classes(
        classes, seqlen_q=problem.max_seqlen_q, seqlen_k=problem.max_seqlen_k, q_tile=tile,
        kv_block=tile)


def _lists_on_kernel(classes: torch.Tensor, tile: int):
    """`build_block_sparse_from_tile_classes` of (B, Hs, Tq, Tk) classes (every sequence of the
    same length, lists Tk wide) in one launch of `kernels.sm90.class_lists`, or None where it
    does not take them."""
    from sparsity import BlockSparseTensors

    from . import dispatch
    from .sm90.launch import uniform_cu_seqlens

    module, _ = dispatch.sm90_module("class_lists", classes.device)
    if module is None or not module.can_run(classes):
        return None
    full_count, full_index, mask_count, mask_index = module.run(classes)
    sequences, _, tiles, _ = classes.shape
    return BlockSparseTensors(
        full_count=full_count, full_index=full_index, mask_count=mask_count,
        mask_index=mask_index, row_block_size=tile, col_block_size=tile,
        # Each sequence's first row block: the bounds of `sequences` runs of `tiles` (cached).
        row_block_offsets=uniform_cu_seqlens(sequences, tiles, classes.device))


@functools.lru_cache(maxsize=64)
def _rule_classes(problem: AttentionProblem, tile: int, device: torch.device) -> torch.Tensor:
    """(1, 1, Tq, Tk) int8 classes of the causal/window/compress rule over the existing cells
    (all FULL_BLOCK without a rule). Cached per call shape and rule (a layer's calls repeat
    them; some ten small ops each otherwise): shared, read only. The rule is a band of key
    positions per row, so a tile is seen whole when its last key is seen from its first row
    and its first key from its last row, and touched when the bands of its rows reach its
    keys' positions."""
    from sparsity.builders import FULL_BLOCK, MASK_BLOCK, NOT_LISTED

    seqlen_q, seqlen_k = problem.max_seqlen_q, problem.max_seqlen_k
    first_row = torch.arange(0, seqlen_q, tile, device=device)[:, None]
    last_row = (first_row + tile).clamp(max=seqlen_q) - 1
    first_key = torch.arange(0, seqlen_k, tile, device=device)[None, :]
    last_key = (first_key + tile).clamp(max=seqlen_k) - 1
    full = (visible_under_rule(problem, first_row, last_key)
            & visible_under_rule(problem, last_row, first_key))
    left, right = problem.window_size
    # How far past its own position a row sees (None: no bound).
    reach_right = ((0,) if problem.causal else ()) + ((right,) if right >= 0 else ())
    cf = problem.compress_factor
    touched = torch.ones_like(full)
    if reach_right:
        touched &= (first_key + 1) * cf - 1 <= last_row + min(reach_right)
    if left >= 0:
        touched &= (last_key + 1) * cf - 1 >= first_row - left
    classes = torch.full(full.shape, MASK_BLOCK, dtype=torch.int8, device=device)
    classes[full] = FULL_BLOCK
    classes[~touched] = NOT_LISTED
    return classes[None, None]


def _cell_classes(x: torch.Tensor, seen, tile: int, prior=None) -> torch.Tensor:
    """(Bx, Hx, Tq, Tk) classes of a mask or bias: every cell of a tile seen, some, or none
    (a mask's True cells, a bias's cells above -inf: `seen`). On sm90 one pass of
    `kernels.sm90.tile_classes`; else from the extremes of each tile (seen is monotone: True
    above False, a finite bias above -inf), reductions along its rows' contiguous keys. No
    temporary of Nq x Nk either way. prior ((Bx, Hx, Tq, Tk) int8 or None): classes the
    caller takes the minimum with; the kernel skips the tiles it leaves unlisted (and calls
    them so)."""
    x = _broadcast_view(x)
    if x.dtype == torch.bool:
        x = x.view(torch.uint8)
    on_kernel = _cell_classes_on_kernel(x, tile, prior)
    if on_kernel is not None:
        return on_kernel
    return _cell_classes_from_extremes(x, seen, tile)


def _prior_for(classes: torch.Tensor, form: tuple[int, int], heads: int) -> torch.Tensor | None:
    """For a source of (Bx, Hx) slabs, the classes (B', H', Tq, Tk; B' in {1, Bx, B}, H' in
    {1, heads}) of the sources before it, as (Bx, Hx, Tq, Tk): each slab's tile unlisted only
    where it is unlisted for every (batch entry, list head) the slab serves (NOT_LISTED is the
    least class, so their maximum). None where Hx is neither 1 nor a divisor of `heads`
    (validated calls have no such form: Hx is 1, Hkv or H, and heads is Hkv or H)."""
    batch, slab_heads = form
    if classes.shape[0] != batch:
        classes = (classes.amax(0, keepdim=True) if batch == 1
                   else classes.expand(batch, *classes.shape[1:]))
    held = classes.shape[1]
    if held != slab_heads and held != 1:  # held == heads
        if slab_heads == 1:
            classes = classes.amax(1, keepdim=True)
        elif heads % slab_heads == 0:  # a slab per KV head, lists per query head
            classes = classes.unflatten(1, (slab_heads, heads // slab_heads)).amax(2)
        else:
            return None
    return classes.expand(batch, slab_heads, *classes.shape[2:]).contiguous()


def _cell_classes_from_extremes(x: torch.Tensor, seen, tile: int) -> torch.Tensor:
    """`_cell_classes` of x (Bx, Hx, Nq, Nk; a mask as uint8) in torch."""
    from sparsity.builders import FULL_BLOCK, MASK_BLOCK, NOT_LISTED

    lo, hi = _tile_extremes(x, tile)
    return torch.where(seen(lo), FULL_BLOCK,
                       torch.where(seen(hi), MASK_BLOCK, NOT_LISTED)).to(torch.int8)


def _cell_classes_on_kernel(x: torch.Tensor, tile: int, prior=None) -> torch.Tensor | None:
    """`_cell_classes` of x (Bx, Hx, Nq, Nk; a mask as uint8) by the sm90 kernel, one launch per
    run of slabs that is one strided view (all of x unless its batch and head strides do not
    merge), or None where it does not take x. prior: as `_cell_classes`'."""
    from . import dispatch

    module, _ = dispatch.sm90_module("tile_classes", x.device)
    if module is None or tile != module.TILE:
        return None
    batch, heads = x.shape[:2]
    if batch == 1 or heads == 1 or x.stride(0) == x.stride(1) * heads:
        runs = [x.flatten(0, 1)]
        priors = [None if prior is None else prior.flatten(0, 1)]
    else:
        runs = list(x.unbind(0))
        priors = [None] * batch if prior is None else list(prior.unbind(0))
    if not all(module.can_run(run) for run in runs):
        return None
    priors = [p if p is not None and module.can_run(run, p) else None
              for run, p in zip(runs, priors)]
    classes = [module.run(run, p) for run, p in zip(runs, priors)]
    return (classes[0] if len(classes) == 1 else torch.cat(classes)).view(
        batch, heads, *classes[0].shape[1:])


def _tile_extremes(x: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of x (Bx, Hx, Nq, Nk) over each tile x tile block of its last two dims (the
    last row and key blocks partial): (Bx, Hx, Tq, Tk) each."""
    seqlen_q, seqlen_k = x.shape[-2:]
    whole = seqlen_k // tile * tile
    parts = []
    if whole:
        parts.append(torch.aminmax(x[..., :whole].unflatten(-1, (whole // tile, tile)), dim=-1))
    if whole < seqlen_k:
        parts.append(torch.aminmax(x[..., whole:], dim=-1, keepdim=True))
    lo = torch.cat([part.min for part in parts], dim=-1)
    hi = torch.cat([part.max for part in parts], dim=-1)
    rows = -(-seqlen_q // tile) * tile - seqlen_q
    if rows:  # the last row block's missing rows: neutral for each extreme
        info = torch.finfo(x.dtype) if x.is_floating_point() else torch.iinfo(x.dtype)
        lo = torch.nn.functional.pad(lo, (0, 0, 0, rows), value=info.max)
        hi = torch.nn.functional.pad(hi, (0, 0, 0, rows), value=info.min)
    return (lo.unflatten(2, (-1, tile)).amin(dim=3), hi.unflatten(2, (-1, tile)).amax(dim=3))


def _broadcast_view(x: torch.Tensor) -> torch.Tensor:
    """x as 4-D, a batch or head dim that is an expanded broadcast (stride 0) narrowed to one:
    the same function, no copy of the repeats."""
    x = _as_4d(x)
    for dim in (0, 1):
        if x.shape[dim] > 1 and x.stride(dim) == 0:
            x = x.narrow(dim, 0, 1)
    return x


def _expand(classes: torch.Tensor, problem: AttentionProblem, heads: int) -> torch.Tensor:
    """A source's (Bx, Hx, Tq, Tk) classes over the lists' `heads` (1, Hkv or H; Hx divides
    it): one per KV head repeated over its query heads where the lists are per query head."""
    if classes.shape[1] not in (1, heads):
        classes = classes.repeat_interleave(heads // classes.shape[1], dim=1)
    return classes


def score_mod_tensors(problem: AttentionProblem, attn_mask, attn_bias):
    """The mask and bias as the sm90 kernel reads them (`kernels.sm90.forward.ScoreModTensors`):
    (slabs, Nq, Nk) views (copies only where the cells are not row-major or the bias is not
    16-byte aligned) and the (B, H, 2) slab table."""
    from kernels.sm90.forward import ScoreModTensors

    cells, forms = [], []
    for x in (attn_mask, attn_bias):
        if x is None:
            cells.append(None)
            forms.append((1, 1))
            continue
        x = _broadcast_view(x)
        forms.append(tuple(x.shape[:2]))
        if x.stride(-1) != 1 or x.data_ptr() % 16:
            x = x.contiguous()
        x = x.reshape(-1, *x.shape[2:])
        cells.append(x.view(torch.uint8) if x.dtype == torch.bool else x)
    device = (attn_mask if attn_mask is not None else attn_bias).device
    slabs = _slab_table(problem.num_seqs, problem.num_heads, problem.num_kv_heads, *forms,
                        device)
    return ScoreModTensors(cells[0], cells[1], slabs,
                           bias_shared=attn_bias is not None and forms[1][1] < problem.num_heads)


@functools.lru_cache(maxsize=64)
def _slab_table(batch: int, heads: int, kv_heads: int, mask_form: tuple[int, int],
                bias_form: tuple[int, int], device: torch.device) -> torch.Tensor:
    """(B, H, 2) int32: (batch b, query head h)'s slab of the mask and of the bias, each
    (Bx, Hx) broadcast as `kernels.masked` states (Hx = H: h; Hx = Hkv: h's KV head; 1: 0)."""
    b = torch.arange(batch)[:, None]
    h = torch.arange(heads)[None, :]
    group = heads // kv_heads
    columns = []
    for form_batch, form_heads in (mask_form, bias_form):
        sharing = _head_sharing(form_heads, kv_heads, group)
        head = h if sharing == "query" else (h // group if sharing == "kv" else h * 0)
        columns.append((b if form_batch > 1 else b * 0) * form_heads + head)
    return torch.stack(columns, dim=-1).to(torch.int32).to(device)
