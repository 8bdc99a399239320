"""tools/_fa4_nsa.py, the `fa4-nsa` benchmark method: its selection and list layout on the CPU
against brute force; on an sm_90 GPU with flash-attn-4, its output against dense masks."""
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.fixture(scope="module")
def fa4_nsa():
    spec = importlib.util.spec_from_file_location("tools_fa4_nsa", TOOLS / "_fa4_nsa.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _problem(seqlen, heads, kv_heads, dim, block, seed=0, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, seqlen, heads, dim, generator=gen).to(device=device, dtype=dtype)
    k, v = (torch.randn(2, seqlen, kv_heads, dim, generator=gen).to(device=device, dtype=dtype)
            for _ in range(2))
    num_blocks = seqlen // block
    k_cmp = k[:, :num_blocks * block].unflatten(1, (num_blocks, block)).mean(2)
    return q, k, v, k_cmp


@pytest.mark.parametrize("seqlen", [1000, 1024])
def test_selected_tiles_match_brute_force(fa4_nsa, seqlen):
    block, tile, picks = 16, 128, 5
    q, _, _, k_cmp = _problem(seqlen, heads=4, kv_heads=2, dim=8, block=block)
    full, diagonal = fa4_nsa.selected_tiles(q, k_cmp, block=block, num_selected=picks, tile=tile)
    tiles = -(-seqlen // tile)
    assert full.shape == (2, 2, tiles, tiles) and torch.equal(diagonal, torch.eye(tiles) > 0)
    for b in range(2):
        for g in range(2):
            for t in range(tiles):
                rows = q[b, t * tile:(t + 1) * tile, 2 * g:2 * g + 2].double().mean(0)  # (2, D)
                scores = (rows @ k_cmp[b, :, g].double().T).sum(0)  # summed over the group
                last = min(t * tile + tile - 1, seqlen - 1)
                reachable = [c for c in range(k_cmp.shape[1]) if c * block <= last]
                best = sorted(reachable, key=lambda c: -scores[c].item())[:picks]
                expected = {c * block // tile for c in best} - {t}
                assert set(full[b, g, t].nonzero().flatten().tolist()) == expected
                assert max(expected, default=-1) < t  # full tiles lie in the past


def test_lists_hold_each_table_row_ascending(fa4_nsa):
    table = torch.rand(3, 7, 9, generator=torch.Generator().manual_seed(1)) < 0.3
    table[0, 0] = False  # an empty row
    count, index = fa4_nsa.table_lists(table)
    assert count.dtype == index.dtype == torch.int32
    for h in range(3):
        for r in range(7):
            listed = index[h, r, :count[h, r]].tolist()
            assert listed == table[h, r].nonzero().flatten().tolist()


def _dense_reference(q, k, v, full, diagonal, *, block, window, tile=128):
    """The design's three branches through dense masks in float64, mean of the three."""
    batch, seqlen, heads, dim = q.shape
    group = heads // k.shape[2]
    q64, k64, v64 = (x.double().transpose(1, 2) for x in (q, k, v))
    k64, v64 = (x.repeat_interleave(group, dim=1) for x in (k64, v64))
    num_blocks = seqlen // block
    k_cmp = k64[:, :, :num_blocks * block].unflatten(2, (num_blocks, block)).mean(3)
    v_cmp = v64[:, :, :num_blocks * block].unflatten(2, (num_blocks, block)).mean(3)
    rows = torch.arange(seqlen, device=q.device)[:, None]
    keys = torch.arange(seqlen, device=q.device)[None, :]
    compressed = (torch.arange(num_blocks, device=q.device)[None, :] + 1) * block <= rows + 1
    listed = (full.repeat_interleave(group, dim=1) | diagonal)  # (B, H, M, C)
    listed = listed.repeat_interleave(tile, 2).repeat_interleave(tile, 3)[..., :seqlen, :seqlen]
    selected = listed & (keys <= rows)
    sliding = (keys <= rows) & (keys > rows - window)
    scale = dim ** -0.5

    def attend(kk, vv, mask):
        scores = (q64 @ kk.transpose(-1, -2) * scale).masked_fill(~mask, -math.inf)
        probs = torch.softmax(scores, -1).nan_to_num(0.0)  # rows that see nothing: 0
        return probs @ vv

    out = (attend(k_cmp, v_cmp, compressed) + attend(k64, v64, selected)
           + attend(k64, v64, sliding)) / 3
    return out.transpose(1, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available()
                         and torch.cuda.get_device_capability() == (9, 0)),
                    reason="needs an sm_90 GPU")
def test_fa4_nsa_matches_dense_masks(fa4_nsa):
    pytest.importorskip("flash_attn.cute", reason="the fa4-nsa method needs flash-attn-4")
    block, window = 64, 256
    q, k, v, k_cmp = _problem(2048, heads=8, kv_heads=2, dim=128, block=block, seed=3,
                              device="cuda", dtype=torch.bfloat16)
    run = fa4_nsa.fa4_nsa_method(compress_block_size=block, selected_block_size=block,
                                 num_selected_blocks=4, window_size=window)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = run(*leaves)
    full, diagonal = fa4_nsa.selected_tiles(q, k_cmp, block=block, num_selected=4)
    expected = _dense_reference(q, k, v, full, diagonal, block=block, window=window)
    error = (out.double() - expected).norm() / expected.norm()
    assert error < 1e-2, f"relative error {error:.3e}"
    grads = torch.autograd.grad(out, leaves, torch.randn_like(out))
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
