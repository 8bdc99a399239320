"""Plain PyTorch NSA: the oracle the fast path is tested against.

Written to be obviously correct, not fast: loops over sequences, tiles and heads, dense boolean
masks, autograd for gradients. Run it in float64 (float32 works). Every piece has the signature
of its fast counterpart, so tests compare piece by piece:

    compress_kv_reference           <->  nsa.compression.compress_kv
    select_blocks_reference         <->  nsa.selection.select_blocks
    compressed_attention_reference  <->  nsa.branches.compressed_attention
    selected_attention_reference    <->  nsa.branches.selected_attention
    window_attention_reference      <->  nsa.branches.window_attention
    gates_reference                 <->  nsa.gating.gate_weights
    nsa_reference                   <->  nsa.nsa

Inputs are packed varlen (T, H, D) with cu_seqlens; nsa_reference also takes the padded layout.
Positions are local to a sequence; l = compress_block_size, l' = selected_block_size,
Q = q_tile (SELECTION_Q_TILE = 128).

Compression: k_cmp[j] = mean(k[j l : (j+1) l]) (then @ W_k[h] per KV head), complete blocks only.
Compressed branch: row i sees compressed token j iff (j+1) l <= i + 1.

The causal selection rule, exactly. For query tile t of a sequence of n rows (rows [a, e),
a = Q t, e = min(a + Q, n)), the anchor is row a:
1. Scoring query per head: the mean of q over rows [max(0, a - Q + 1), a] (the Q rows ending at
   the anchor: nothing after the tile's first row, so selection never sees the future).
2. p_h = softmax_j(scale * qbar_h . k_cmp[j]) over the compressed tokens the anchor sees,
   (j+1) l <= a + 1. Importance of selection block c = the sum of p_h over its l'/l compressed
   tokens and over the query heads of the KV group (the group shares one selection).
3. Forced: block 0 and every block overlapping rows [a, e). Candidates: blocks c >= 1 complete
   before the tile, (c+1) l' <= a. Selected = forced + the top (num_selected_blocks - |forced|)
   candidates by importance, ties to the lower block index.
4. The selected branch: row i sees key j iff j's block is selected for i's tile and j <= i.
Non-causal: the scoring query is the mean of the tile's own rows [a, e), every compressed token of
the sequence is scored, candidates are all complete blocks c >= 1 ((c+1) l' <= n), only block 0
is forced, and no causal mask applies anywhere.

Sparse compressed branch (num_cmp_selected_blocks not None): compressed tokens are grouped in
blocks of cmp_kv_block (CMP_KV_BLOCK = 128). Per tile and KV head the branch attends to block 0,
the diagonal blocks (those the anchor does not see whole but the tile's last row sees in part:
the tile's mask blocks), and the top num_cmp_selected_blocks of the other blocks the anchor sees
whole (a sequence's partial last block counts as whole once all its tokens are seen), ranked by
the step-2 probabilities summed over the block, ties to the lower index; the compressed causal
mask applies inside. Non-causal: block 0 plus the top ranked others.

Window branch: row i sees keys i - window_size < j <= i (always backward-looking).
Gating: out = sum_b g_b o_b with g = sigmoid(q @ W_gate[h].T) per head (W_gate (H, 3, D), branches
in the order compressed, selected, window); without W_gate, the mean of the branches that run.
window_size = 0 switches the window branch off (it contributes nothing).
"""
from __future__ import annotations

import torch
from torch import Tensor

from nsa.selection_rule import (CMP_KV_BLOCK, SELECTION_Q_TILE, BlockSelection,
                                cmp_selection_width)


def compress_kv_reference(k: Tensor, v: Tensor, cu_seqlens: Tensor, compress_block_size: int,
                          W_k: Tensor | None = None, W_v: Tensor | None = None
                          ) -> tuple[Tensor, Tensor, Tensor]:
    """Mean of each complete block of l keys/values per sequence, optionally projected.

    Returns k_cmp, v_cmp (Tc, Hkv, D) and cu_seqlens_cmp (S+1,) int32.
    """
    l = compress_block_size
    k_parts, v_parts, counts = [], [], []
    for start, end in _sequences(cu_seqlens):
        n_cmp = (end - start) // l
        counts.append(n_cmp)
        for x, W, parts in ((k, W_k, k_parts), (v, W_v, v_parts)):
            pooled = x[start:start + n_cmp * l].unflatten(0, (n_cmp, l)).mean(dim=1)
            if W is not None:
                pooled = torch.einsum("nhd,hde->nhe", pooled, W)
            parts.append(pooled)
    cu_cmp = torch.tensor([0] + counts, device=k.device).cumsum(0).to(torch.int32)
    return torch.cat(k_parts), torch.cat(v_parts), cu_cmp


def select_blocks_reference(q: Tensor, k_cmp: Tensor, cu_seqlens: Tensor, cu_seqlens_cmp: Tensor,
                            *, compress_block_size: int, selected_block_size: int,
                            num_selected_blocks: int, softmax_scale: float, causal: bool = True,
                            num_cmp_selected_blocks: int | None = None,
                            q_tile: int = SELECTION_Q_TILE, cmp_kv_block: int = CMP_KV_BLOCK
                            ) -> BlockSelection:
    """The selection rule of the module docstring, one (sequence, tile, KV head) at a time."""
    l, l_sel, Q = compress_block_size, selected_block_size, q_tile
    heads, kv_heads = q.shape[1], k_cmp.shape[1]
    group = heads // kv_heads
    selected_rows, cmp_rows, tiles_per_seq = [], [], []
    for (start, end), (cmp_start, cmp_end) in zip(_sequences(cu_seqlens),
                                                   _sequences(cu_seqlens_cmp)):
        n, n_cmp = end - start, cmp_end - cmp_start
        q_seq, k_seq = q[start:end].double(), k_cmp[cmp_start:cmp_end].double()
        num_tiles = -(-n // Q)
        tiles_per_seq.append(num_tiles)
        for tile in range(num_tiles):
            a, e = tile * Q, min(tile * Q + Q, n)
            scoring_rows = q_seq[max(0, a - Q + 1):a + 1] if causal else q_seq[a:e]
            q_bar = scoring_rows.mean(dim=0)  # (H, D)
            seen = (a + 1) // l if causal else n_cmp  # compressed tokens the anchor sees
            selected_heads, cmp_heads = [], []
            for kv_head in range(kv_heads):
                token_weight = torch.zeros(n_cmp, dtype=torch.float64, device=q.device)
                for head in range(kv_head * group, (kv_head + 1) * group):
                    if seen > 0:
                        logits = softmax_scale * (k_seq[:seen, kv_head] @ q_bar[head])
                        token_weight[:seen] += torch.softmax(logits, dim=0)
                selected_heads.append(_select_blocks_of_tile(
                    token_weight, n, a, e, l, l_sel, num_selected_blocks, causal))
                if num_cmp_selected_blocks is not None:
                    cmp_heads.append(_select_cmp_blocks_of_tile(
                        token_weight, n_cmp, seen, e // l, cmp_kv_block,
                        num_cmp_selected_blocks, causal))
            selected_rows.append(selected_heads)
            cmp_rows.append(cmp_heads)

    device = q.device
    selected = _pad_lists(selected_rows, kv_heads, num_selected_blocks, device)
    cmp_selected = None
    if num_cmp_selected_blocks is not None:
        width = cmp_selection_width(Q, l, cmp_kv_block, num_cmp_selected_blocks)
        cmp_selected = _pad_lists(cmp_rows, kv_heads, width, device)
    offsets = torch.tensor([0] + tiles_per_seq, device=device).cumsum(0).to(torch.int32)
    return BlockSelection(selected=selected, cmp_selected=cmp_selected, row_block_offsets=offsets)


def _select_blocks_of_tile(token_weight: Tensor, n: int, a: int, e: int, l: int, l_sel: int,
                           k: int, causal: bool) -> list[int]:
    per_block = l_sel // l
    num_blocks = -(-n // l_sel)
    if causal:
        forced = {0} | {c for c in range(num_blocks) if c * l_sel < e and (c + 1) * l_sel > a}
        complete_before = a
    else:
        forced, complete_before = {0}, n
    candidates = [c for c in range(1, num_blocks)
                  if (c + 1) * l_sel <= complete_before and c not in forced]
    importance = {c: float(token_weight[c * per_block:(c + 1) * per_block].sum())
                  for c in candidates}
    ranked = sorted(candidates, key=lambda c: (-importance[c], c))
    return sorted(forced | set(ranked[:max(0, k - len(forced))]))


def _select_cmp_blocks_of_tile(token_weight: Tensor, n_cmp: int, anchor_seen: int,
                               tile_seen: int, block: int, k: int, causal: bool) -> list[int]:
    num_blocks = -(-n_cmp // block)
    if num_blocks == 0:
        return []
    if causal:
        # Blocks the anchor sees whole (a partial last block counts once all of it is seen) ...
        seen_whole = num_blocks if anchor_seen >= n_cmp else anchor_seen // block
        # ... and the diagonal: blocks after those that the tile's last row sees some of.
        diagonal = set(range(seen_whole, -(-tile_seen // block)))
        candidates = list(range(1, seen_whole))
    else:
        diagonal, candidates = set(), list(range(1, num_blocks))
    importance = {c: float(token_weight[c * block:(c + 1) * block].sum()) for c in candidates}
    ranked = sorted(candidates, key=lambda c: (-importance[c], c))
    return sorted({0} | diagonal | set(ranked[:k]))


def compressed_attention_reference(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, cu_seqlens: Tensor,
                                   cu_seqlens_cmp: Tensor, *, compress_block_size: int,
                                   softmax_scale: float, causal: bool = True,
                                   cmp_selected: Tensor | None = None,
                                   q_tile: int = SELECTION_Q_TILE,
                                   cmp_kv_block: int = CMP_KV_BLOCK) -> Tensor:
    """Row i attends to compressed token j iff (j+1) l <= i+1 (when causal), and, with
    cmp_selected, iff j's block of cmp_kv_block tokens is listed for i's tile and KV head."""
    outs = []
    for s, ((start, end), (cmp_start, cmp_end)) in enumerate(
            zip(_sequences(cu_seqlens), _sequences(cu_seqlens_cmp))):
        n, n_cmp = end - start, cmp_end - cmp_start
        i = torch.arange(n, device=q.device)[:, None]
        j = torch.arange(n_cmp, device=q.device)[None, :]
        visible = ((j + 1) * compress_block_size <= i + 1) | (not causal)
        visible = visible[None].expand(q.shape[1], n, n_cmp)
        if cmp_selected is not None:
            visible = visible & _listed_blocks_mask(cmp_selected, s, cu_seqlens, n, n_cmp,
                                                    q.shape[1], q_tile, cmp_kv_block)
        outs.append(_attend(q[start:end], k_cmp[cmp_start:cmp_end], v_cmp[cmp_start:cmp_end],
                            visible, softmax_scale))
    return torch.cat(outs)


def selected_attention_reference(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor,
                                 selected: Tensor, *, selected_block_size: int,
                                 softmax_scale: float, causal: bool = True,
                                 q_tile: int = SELECTION_Q_TILE) -> Tensor:
    """Row i sees key j iff j's block is selected for i's tile and KV head (and j <= i)."""
    outs = []
    for s, (start, end) in enumerate(_sequences(cu_seqlens)):
        n = end - start
        visible = _listed_blocks_mask(selected, s, cu_seqlens, n, n, q.shape[1], q_tile,
                                      selected_block_size)
        if causal:
            visible = visible & torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        outs.append(_attend(q[start:end], k[start:end], v[start:end], visible, softmax_scale))
    return torch.cat(outs)


def window_attention_reference(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, *,
                               window_size: int, softmax_scale: float) -> Tensor:
    """Row i sees keys i - window_size < j <= i."""
    outs = []
    for start, end in _sequences(cu_seqlens):
        n = end - start
        i = torch.arange(n, device=q.device)[:, None]
        j = torch.arange(n, device=q.device)[None, :]
        visible = ((j <= i) & (j > i - window_size))[None].expand(q.shape[1], n, n)
        outs.append(_attend(q[start:end], k[start:end], v[start:end], visible, softmax_scale))
    return torch.cat(outs)


def gates_reference(q: Tensor, W_gate: Tensor | None, branches: tuple[bool, bool, bool]
                    ) -> Tensor:
    """(T, H, 3) branch weights: sigmoid(q . W_gate[h, b]) or 1 / (branches that run); 0 for a
    branch that does not run."""
    running = torch.tensor(branches, dtype=q.dtype, device=q.device)
    if W_gate is None:
        return (running / running.sum()).expand(*q.shape[:2], 3)
    return torch.sigmoid(torch.einsum("thd,hbd->thb", q, W_gate)) * running


def nsa_reference(q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens: Tensor | None = None,
                  max_seqlen: int | None = None, compress_block_size: int = 64,
                  selected_block_size: int = 64, num_selected_blocks: int = 16,
                  window_size: int = 512, W_k: Tensor | None = None, W_v: Tensor | None = None,
                  W_gate: Tensor | None = None, causal: bool = True,
                  softmax_scale: float | None = None, num_cmp_selected_blocks: int | None = None,
                  _q_tile: int = SELECTION_Q_TILE, _cmp_kv_block: int = CMP_KV_BLOCK) -> Tensor:
    """NSA with the nsa() signature, differentiable through autograd (selection is discrete).

    Trusts its inputs (no validation); max_seqlen is accepted for signature parity only.
    """
    padded_shape = None
    if cu_seqlens is None:  # padded (B, N, H, D): B sequences of N rows
        padded_shape = q.shape
        batch, n = q.shape[:2]
        cu_seqlens = torch.arange(batch + 1, device=q.device, dtype=torch.int32) * n
        q, k, v = (x.flatten(0, 1) for x in (q, k, v))
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale

    k_cmp, v_cmp, cu_cmp = compress_kv_reference(k, v, cu_seqlens, compress_block_size, W_k, W_v)
    selection = select_blocks_reference(
        q.detach(), k_cmp.detach(), cu_seqlens, cu_cmp, compress_block_size=compress_block_size,
        selected_block_size=selected_block_size, num_selected_blocks=num_selected_blocks,
        softmax_scale=scale, causal=causal, num_cmp_selected_blocks=num_cmp_selected_blocks,
        q_tile=_q_tile, cmp_kv_block=_cmp_kv_block)
    outputs = [
        compressed_attention_reference(
            q, k_cmp, v_cmp, cu_seqlens, cu_cmp, compress_block_size=compress_block_size,
            softmax_scale=scale, causal=causal, cmp_selected=selection.cmp_selected,
            q_tile=_q_tile, cmp_kv_block=_cmp_kv_block),
        selected_attention_reference(
            q, k, v, cu_seqlens, selection.selected, selected_block_size=selected_block_size,
            softmax_scale=scale, causal=causal, q_tile=_q_tile),
    ]
    if window_size > 0:
        outputs.append(window_attention_reference(q, k, v, cu_seqlens, window_size=window_size,
                                                  softmax_scale=scale))
    gates = gates_reference(q, W_gate, (True, True, window_size > 0))
    out = sum(gates[..., b, None] * o for b, o in enumerate(outputs))
    return out if padded_shape is None else out.unflatten(0, padded_shape[:2])


# --- helpers -------------------------------------------------------------------------------------

def _sequences(cu_seqlens: Tensor) -> list[tuple[int, int]]:
    cu = cu_seqlens.tolist()
    return list(zip(cu[:-1], cu[1:]))


def _attend(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, softmax_scale: float) -> Tensor:
    """Softmax attention of one sequence under a (H, n, m) mask; a row that sees nothing is 0."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q, k) * softmax_scale
    sees_any = visible.any(dim=-1, keepdim=True)
    # Rows that see nothing get finite logits (then weight 0), so no NaN reaches any gradient.
    scores = scores.masked_fill(~visible, float("-inf")).masked_fill(~sees_any, 0.0)
    probs = torch.softmax(scores, dim=-1) * sees_any
    return torch.einsum("hnm,mhd->nhd", probs, v)


def _listed_blocks_mask(lists: Tensor, sequence: int, cu_seqlens: Tensor, n: int, m: int,
                        heads: int, q_tile: int, block_size: int) -> Tensor:
    """(H, n, m) bool: row i may see key j iff j's block is listed for (i's tile, KV head)."""
    earlier = _sequences(cu_seqlens)[:sequence]
    first_tile = sum(-(-(end - start) // q_tile) for start, end in earlier)
    kv_heads = lists.shape[1]
    group = heads // kv_heads
    mask = torch.zeros(heads, n, m, dtype=torch.bool, device=lists.device)
    for tile in range(-(-n // q_tile)):
        rows = slice(tile * q_tile, (tile + 1) * q_tile)
        for kv_head in range(kv_heads):
            for block in lists[first_tile + tile, kv_head].tolist():
                if block >= 0:
                    keys = slice(block * block_size, (block + 1) * block_size)
                    mask[kv_head * group:(kv_head + 1) * group, rows, keys] = True
    return mask


def _pad_lists(rows: list[list[list[int]]], kv_heads: int, width: int, device) -> Tensor:
    out = torch.full((len(rows), kv_heads, width), -1, dtype=torch.int32)
    for r, heads in enumerate(rows):
        for h, blocks in enumerate(heads):
            out[r, h, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    return out.to(device)
