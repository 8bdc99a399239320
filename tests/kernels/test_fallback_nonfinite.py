"""Non-finite inputs on the fallback reach only the rows that see them (issue 16, item 2).

Causality is absolute: a value no row can see must never reach that row, nor any gradient it
produces. Before the fix, one NaN or inf at row 200 of a 300-token sequence made every earlier
output row NaN (flash_attn_func causal and windowed, the block-sparse path's listed-but-masked
keys, and nsa()): a masked probability of exactly 0 still multiplied the NaN inside P V, and the
backward's dS K, dS^T Q and P^T dO did the same.

Two oracles, both exact:
- the past: with the loss on rows < 200 only, outputs and gradients of rows and keys < 200 equal
  those of the sequence cut to 200 tokens, and keys >= 200 get exactly zero gradient;
- the reach: with every row in the loss, what does not see the bad value equals the run with the
  bad value replaced by a finite one, and what sees it is non-finite (never silently finite).
"""
from __future__ import annotations

import pytest
import torch

from kernels import flash_attn_func
from nsa import nsa
from reference_attention import one_thread  # noqa: F401 (fixture)
from sparsity import build_selected_block_sparse
from gpu_marks import requires_sm90

pytestmark = pytest.mark.usefixtures("one_thread")

SEQLEN, BAD_ROW, HEADS, KV_HEADS, HEAD_DIM = 300, 200, 4, 2, 16
WINDOW = 64  # the windowed cases: row i sees keys (i - 64, i]
Q_TILE, KV_BLOCK = 128, 64  # the block-sparse case's geometry (NSA's selected branch)


def _selected_lists(seqlen: int):
    """NSA-like lists: block 0, one earlier block, the tile's diagonal blocks (mask blocks).
    Tile 1 (rows 128..255) lists block 3 (keys 192..255) as a mask block: rows 128..199 list
    key 200 without seeing it."""
    per_tile = [[0, 1, -1, -1], [0, 1, 2, 3], [0, 2, 4, -1]]
    tiles = -(-seqlen // Q_TILE)
    selected = torch.tensor(per_tile[:tiles]).unsqueeze(1).expand(tiles, KV_HEADS, 4)
    cu = torch.tensor([0, seqlen], dtype=torch.int32)
    lists = build_selected_block_sparse(selected.contiguous(), cu_seqlens_q=cu, cu_seqlens_k=cu,
                                        q_tile=Q_TILE, selected_block_size=KV_BLOCK,
                                        kv_block=KV_BLOCK, causal=True)
    return lists


def _causal(q, k, v):
    return flash_attn_func(q, k, v, causal=True)


def _window(q, k, v):
    return flash_attn_func(q, k, v, causal=True, window_size=(WINDOW - 1, 0))


def _block_sparse(q, k, v):
    return flash_attn_func(q, k, v, causal=True, block_sparse=_selected_lists(q.shape[1]))


def _nsa(q, k, v, weights):
    return nsa(q, k, v, **weights)  # the defaults: l = l' = 64, 16 blocks, window 512


PATHS = {"causal": _causal, "causal-window": _window, "block-sparse-mask-block": _block_sparse}
BAD = {"v-nan": ("v", float("nan")), "k-nan": ("k", float("nan")),
       "v-inf": ("v", float("inf")), "k-inf": ("k", float("inf")),
       "v-neg-inf": ("v", float("-inf"))}


def _inputs(seed: int = 0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, SEQLEN, heads, HEAD_DIM, generator=generator).to(dtype)
            for heads in (HEADS, KV_HEADS, KV_HEADS)]


def _poisoned(q, k, v, bad: str, row: int = BAD_ROW):
    name, value = BAD[bad]
    q, k, v = (x.clone() for x in (q, k, v))
    {"q": q, "k": k, "v": v}[name][:, row] = value
    return q, k, v


def _run(function, q, k, v, dout):
    """Output and (dq, dk, dv) of sum(out * dout)."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = function(*leaves)
    out.backward(dout)
    return out.detach(), [x.grad for x in leaves]


def _past_only(dout: torch.Tensor, rows: int = BAD_ROW) -> torch.Tensor:
    dout = dout.clone()
    dout[:, rows:] = 0
    return dout


def _assert_past_is_the_cut_sequence(out, grads, cut_out, cut_grads,
                                     exact_future=("dq", "dk", "dv")):
    assert torch.isfinite(out[:, :BAD_ROW]).all(), "earlier output rows are finite"
    torch.testing.assert_close(out[:, :BAD_ROW], cut_out, rtol=1e-5, atol=1e-6)
    for name, grad, cut in zip(("dq", "dk", "dv"), grads, cut_grads):
        assert torch.isfinite(grad[:, :BAD_ROW]).all(), f"{name} of earlier rows is finite"
        torch.testing.assert_close(grad[:, :BAD_ROW], cut, rtol=1e-5, atol=1e-6, msg=name)
        if name in exact_future:  # rows >= 200 have a zero dO: nothing reaches a gradient
            assert (grad[:, BAD_ROW:] == 0).all(), f"{name} of later rows is exactly 0"


@pytest.mark.parametrize("bad", BAD, ids=str)
@pytest.mark.parametrize("path", PATHS, ids=str)
def test_future_nonfinite_does_not_reach_the_past(path, bad):
    """One NaN/inf at row 200: rows < 200 (outputs and gradients of a loss on them) equal those
    of the sequence cut to 200 tokens."""
    function = PATHS[path]
    q, k, v = _inputs()
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    out, grads = _run(function, *_poisoned(q, k, v, bad), _past_only(dout))
    cut_out, cut_grads = _run(function, q[:, :BAD_ROW], k[:, :BAD_ROW], v[:, :BAD_ROW],
                              dout[:, :BAD_ROW])
    _assert_past_is_the_cut_sequence(out, grads, cut_out, cut_grads)
    if bad.startswith("v"):  # rows that see the value are not silently finite
        assert not torch.isfinite(out[:, BAD_ROW]).any()


@pytest.mark.parametrize("bad", ["v-nan", "k-inf"])
@pytest.mark.parametrize("path", ["causal-window", "block-sparse-mask-block"])
def test_future_nonfinite_does_not_reach_the_past_in_bfloat16(path, bad):
    """The same in bfloat16, whose rows the fallback converts before zeroing NaN and inf."""
    function = PATHS[path]
    q, k, v = _inputs(seed=9, dtype=torch.bfloat16)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    out, grads = _run(function, *_poisoned(q, k, v, bad), _past_only(dout))
    cut_out, cut_grads = _run(function, q[:, :BAD_ROW], k[:, :BAD_ROW], v[:, :BAD_ROW],
                              dout[:, :BAD_ROW])
    for name, actual, cut in zip(("out", "dq", "dk", "dv"), (out, *grads), (cut_out, *cut_grads)):
        assert actual.dtype == torch.bfloat16
        assert torch.isfinite(actual[:, :BAD_ROW]).all(), name
        torch.testing.assert_close(actual[:, :BAD_ROW], cut, rtol=1e-2, atol=1e-2, msg=name)
        if name != "out":
            assert (actual[:, BAD_ROW:] == 0).all(), name


def _expected_reach(path: str, row: int):
    """(rows, keys) bool (N,): rows that see key `row`, and the keys those rows see."""
    position = torch.arange(SEQLEN)
    if path == "causal":
        sees = lambda i, j: j <= i  # noqa: E731
    elif path == "causal-window":
        sees = lambda i, j: (j <= i) & (j > i - WINDOW)  # noqa: E731
    else:
        raise ValueError(path)
    rows = sees(position, row)
    keys = sees(position[rows].unsqueeze(1), position).any(0)
    return rows, keys


@pytest.mark.parametrize("bad", ["v-nan", "k-nan", "v-inf", "q-nan", "dout-nan"])
@pytest.mark.parametrize("path", ["causal-window", "causal"])
def test_nonfinite_reaches_exactly_the_rows_and_keys_that_see_it(path, bad):
    """Every row in the loss. Rows that see row 200 (and, for q and dO, row 200 itself) are
    non-finite and so are dk, dv of every key those rows see; everything else equals the run with
    row 200 finite."""
    function = PATHS[path]
    q, k, v = _inputs(seed=2)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    name = bad.split("-")[0]
    if name in ("q", "dout"):
        poisoned_q, poisoned_dout = q.clone(), dout.clone()
        (poisoned_q if name == "q" else poisoned_dout)[:, BAD_ROW] = float("nan")
        out, grads = _run(function, poisoned_q, k, v, poisoned_dout)
        rows = torch.arange(SEQLEN) == BAD_ROW  # a query row reaches only its own keys
        _, keys = _expected_reach(path, BAD_ROW)
        keys &= torch.arange(SEQLEN) <= BAD_ROW
        out_rows = rows if name == "q" else torch.zeros_like(rows)
    else:
        out, grads = _run(function, *_poisoned(q, k, v, bad), dout)
        rows, keys = _expected_reach(path, BAD_ROW)
        out_rows = rows
    finite_out, finite_grads = _run(function, q, k, v, dout)

    def check(actual, expected, bad_rows, what):
        assert not torch.isfinite(actual[:, bad_rows]).all(-1).any(), f"{what}: hit rows"
        assert torch.isfinite(actual[:, ~bad_rows]).all(), f"{what}: the rest is finite"
        torch.testing.assert_close(actual[:, ~bad_rows], expected[:, ~bad_rows], rtol=1e-5,
                                   atol=1e-6, msg=what)

    check(out, finite_out, out_rows, "out")
    check(grads[0], finite_grads[0], rows, "dq")
    check(grads[1], finite_grads[1], keys, "dk")
    check(grads[2], finite_grads[2], keys, "dv")


def test_block_sparse_reach_follows_the_lists():
    """A NaN value at key 200 listed (as a mask block) for rows 128..255: only rows 200..255
    see it; rows 256.. do not list block 3 and stay exact."""
    q, k, v = _inputs(seed=4)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    out, grads = _run(_block_sparse, *_poisoned(q, k, v, "v-nan"), dout)
    finite_out, finite_grads = _run(_block_sparse, q, k, v, dout)
    rows = (torch.arange(SEQLEN) >= BAD_ROW) & (torch.arange(SEQLEN) < 2 * Q_TILE)
    assert not torch.isfinite(out[:, rows]).all(-1).any()
    torch.testing.assert_close(out[:, ~rows], finite_out[:, ~rows], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[0][:, ~rows], finite_grads[0][:, ~rows], rtol=1e-5,
                               atol=1e-6)
    assert not torch.isfinite(grads[0][:, rows]).all(-1).any()


def _nsa_weights(seed: int = 6):
    generator = torch.Generator().manual_seed(seed)
    scale = HEAD_DIM ** -0.5
    return dict(W_k=torch.randn(KV_HEADS, HEAD_DIM, HEAD_DIM, generator=generator) * scale,
                W_v=torch.randn(KV_HEADS, HEAD_DIM, HEAD_DIM, generator=generator) * scale,
                W_gate=torch.randn(HEADS, 3, HEAD_DIM, generator=generator) * scale)


@pytest.mark.parametrize("weights", [False, True], ids=["mean-pooling", "with-W"])
@pytest.mark.parametrize("bad", ["v-nan", "k-nan", "v-inf", "k-inf"])
def test_nsa_future_nonfinite_does_not_reach_the_past(bad, weights):
    """nsa() on the CPU (every branch on the fallback): the compressed token of keys 192..255
    holds the NaN and is seen from row 255 on; the selected branch lists block 3 for rows
    128..255 as a mask block; the window sees row 200 from row 200 on."""
    q, k, v = _inputs(seed=7)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(8))
    parameters = _nsa_weights() if weights else {}
    leaves = {name: W.clone().requires_grad_() for name, W in parameters.items()}

    def run(q, k, v, dout):
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        for W in leaves.values():
            W.grad = None
        out = _nsa(*inputs, leaves)
        out.backward(dout)
        return out.detach(), [x.grad for x in inputs], {n: W.grad for n, W in leaves.items()}

    out, grads, weight_grads = run(*_poisoned(q, k, v, bad), _past_only(dout))
    cut_out, cut_grads, cut_weight_grads = run(q[:, :BAD_ROW], k[:, :BAD_ROW], v[:, :BAD_ROW],
                                               dout[:, :BAD_ROW])
    _assert_past_is_the_cut_sequence(out, grads, cut_out, cut_grads,
                                     exact_future=("dq", "dk", "dv"))
    # W_k, W_v: the NaN block's compressed token has a zero gradient; W_gate: a zero dO row
    # contributes exactly zero to dL/dg (nsa/function.py selects, it does not multiply).
    for name in ("W_k", "W_v", "W_gate"):
        if name in weight_grads:
            assert torch.isfinite(weight_grads[name]).all(), name
            torch.testing.assert_close(weight_grads[name], cut_weight_grads[name], rtol=1e-5,
                                       atol=1e-6, msg=name)


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("window", [None, WINDOW], ids=["causal", "window"])
def test_sm90_kernel_keeps_a_non_finite_value_inside_the_tiles_that_load_it(window):
    """The documented bound of the sm90 kernels (docs/interfaces.md), not the fallback's exact
    reach: a NaN in V at key 200 may reach rows of the query tile that loads its KV tile (rows
    128..199 here) but never a row whose query tile does not load it (rows 0..127), and the rows
    that see it are NaN; the forward and the gradients of q, k, v alike."""
    from kernels import which_backend

    generator = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(1, SEQLEN, h, 128, device="cuda", dtype=torch.bfloat16,
                           generator=generator).requires_grad_()
               for h in (HEADS, KV_HEADS, KV_HEADS))
    options = dict(causal=True)
    if window is not None:
        options["window_size"] = (window, 0)
    assert which_backend(q, k, v, **options).startswith("sm90")
    bad_v = v.detach().clone()
    bad_v[0, BAD_ROW] = float("nan")
    bad_v.requires_grad_()
    out = flash_attn_func(q, k, bad_v, **options)
    assert torch.isfinite(out[0, :Q_TILE]).all()
    assert torch.isnan(out[0, BAD_ROW:BAD_ROW + 1]).all()
    # Loss on the first query tile only: the gradients of its rows and of the keys it sees are
    # finite (tiles that load key 200 may carry its NaN into theirs: dP = dO V^T is 0 * NaN
    # even where dO is 0).
    dq, dk, dv = torch.autograd.grad(out[0, :Q_TILE].float().square().sum(), (q, k, bad_v))
    for grad in (dq, dk, dv):
        assert torch.isfinite(grad[0, :Q_TILE]).all()


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("case", ["causal", "window", "packed", "sparse", "full"])
def test_sm90_screen_flags_a_masked_non_finite_value_and_changes_nothing(case):
    """The diagnostic build behind issue 16's cost measurement (kernels/sm90/screen.py): it
    reads the V tiles that get a mask and flags a NaN there (for "full", non-causal attention
    over whole tiles, no tile gets a mask: nothing to flag), flags nothing on finite inputs,
    and its output and lse equal the dispatched kernel's bit for bit."""
    from kernels.sm90.forward import run

    generator = torch.Generator(device="cuda").manual_seed(4)
    n = 1024
    q, k, v = (torch.randn(n, h, 128, device="cuda", dtype=torch.bfloat16, generator=generator)
               for h in (HEADS, KV_HEADS, KV_HEADS))
    lengths = [256, 300, 468] if case == "packed" else [n]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    call = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
                max_seqlen_k=max(lengths), causal=case != "full")
    if case == "window":
        call["window_size"] = (WINDOW, 0)
    if case == "sparse":  # each tile lists block 0 and its own (diagonal, masked) blocks
        tiles = n // Q_TILE
        own = torch.arange(tiles, device="cuda")[:, None] * 2 + torch.arange(2, device="cuda")
        selected = torch.cat([torch.zeros(tiles, 1, dtype=torch.long, device="cuda"), own], 1)
        call["block_sparse"] = build_selected_block_sparse(
            selected[:, None].expand(tiles, KV_HEADS, 3).contiguous(), cu_seqlens_q=cu,
            cu_seqlens_k=cu, q_tile=Q_TILE, selected_block_size=KV_BLOCK, kv_block=KV_BLOCK,
            causal=True)
    out, lse = run(q, k, v, **call)
    screened_out, screened_lse, flag = run(q, k, v, spec_overrides={"screen_masked_v": True},
                                           **call)
    assert flag.item() == 0
    assert torch.equal(out, screened_out) and torch.equal(lse, screened_lse)
    bad_v = v.clone()
    bad_v[BAD_ROW] = float("nan")  # in the diagonal KV tile of rows 128..255
    _, _, flag = run(q, k, bad_v, spec_overrides={"screen_masked_v": True}, **call)
    assert flag.item() == (0 if case == "full" else 1)
