"""A user mask and an additive bias on the sm90 forward kernel (kernels/sm90/score_mod.py, the
lists of kernels/masked.py `tile_lists`), against the torch path of the same call in float32
(itself held to a float64 reference in test_masked_attention.py): out and lse, over random masks
of 10/50/90% of the cells with rows and whole tiles hidden, window-like masks, biases with and
without a mask and with -inf cells, every broadcast form, GQA 1/4/8, head dims 64/128,
bfloat16/float16, lengths that are no multiple of the tiles, alone and with causal/window. The
gradients (the torch backward on the kernel's out and lse) against the torch path's.

    python -m pytest -q tests/kernels/test_sm90_masked.py     # on an sm_90 GPU
"""
from __future__ import annotations

import pytest
import torch

from gpu_marks import requires_sm90
from kernels import flash_attn_func, prepare_mask
from kernels import masked
from kernels.fallback import has_rule, visible_under_rule
from kernels.validate import validate_attention_forward

pytestmark = [pytest.mark.gpu, requires_sm90]

TOLERANCE = 2e-2


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    finite = torch.isfinite(expected)
    return ((actual.float() - expected.float())[finite].norm()
            / expected.float()[finite].norm().clamp_min(1e-12)).item()


def _cells(kind: str, shape, gen, keep: float = 0.5) -> torch.Tensor:
    """A (Bm, Hm, Nq, Nk) bool mask of `kind`: random cells with the first rows and one whole
    128 x 128 tile hidden, or a band |row - key| < 300 (window-like)."""
    *lead, seqlen_q, seqlen_k = shape
    if kind == "band":
        rows = torch.arange(seqlen_q, device="cuda")[:, None]
        keys = torch.arange(seqlen_k, device="cuda")[None, :]
        return ((rows - keys).abs() < 300).expand(*lead, seqlen_q, seqlen_k)
    mask = torch.rand(shape, generator=gen, device="cuda") < keep
    mask[..., :5, :] = False          # rows that see nothing
    mask[..., 128:256, 256:384] = False  # a tile that sees nothing
    mask[..., 384:512, :128] = True   # a tile that sees everything
    return mask


def _bias(shape, dtype, gen, with_inf: bool) -> torch.Tensor:
    bias = torch.randn(shape, generator=gen, device="cuda").mul_(2).to(dtype)
    if with_inf:
        bias[..., 256:384, :128] = float("-inf")  # a tile hidden by the bias alone
        bias[..., 7, :] = float("-inf")
    return bias


def _unseen_cells(problem, mask, bias) -> torch.Tensor:
    """(Bb, Hb, Nq, Nk) bool, the bias's slabs: the cells that no (batch entry, query head)
    the bias cell serves sees, under the rule, the mask or a -inf bias. The cases' masks and
    biases are (B or 1, H or Hkv or 1, Nq, Nk)."""
    batch, heads = problem.num_seqs, problem.num_heads
    seen = torch.ones(batch, heads, problem.max_seqlen_q, problem.max_seqlen_k,
                      dtype=torch.bool, device="cuda")
    if has_rule(problem):
        rows = torch.arange(problem.max_seqlen_q, device="cuda")[:, None]
        keys = torch.arange(problem.max_seqlen_k, device="cuda")[None, :]
        seen &= visible_under_rule(problem, rows, keys)
    for cells in (mask, bias > float("-inf")):
        if cells is not None:  # the query heads' cells (a KV head's serve its group)
            seen &= cells.repeat_interleave(heads // cells.shape[1], dim=1)
    slabs_b, slabs_h = bias.shape[:2]
    return ~seen.view(slabs_b, batch // slabs_b, slabs_h, heads // slabs_h,
                      *seen.shape[-2:]).any(dim=3).any(dim=1)


# name: (B, Nq, Nk, H, Hkv, D, dtype, mask (kind, keep, shape) or None,
#        bias (dtype, shape, with -inf) or None, rule)
CASES = {
    "mask10-mha": (2, 1000, 1300, 4, 4, 128, torch.bfloat16, ("random", 0.1, (2, 4)), None, {}),
    "mask50-gqa4-causal": (2, 1100, 1100, 8, 2, 128, torch.bfloat16, ("random", 0.5, (1, 8)),
                           None, dict(causal=True)),
    "mask90-gqa8-d64-fp16": (1, 777, 1500, 8, 1, 64, torch.float16, ("random", 0.9, (1, 1)),
                             None, {}),
    "band-mask-per-kv-head": (2, 1024, 1024, 8, 2, 128, torch.bfloat16, ("band", 0, (1, 2)),
                              None, {}),
    "bias-only-bf16": (2, 900, 700, 8, 2, 128, torch.bfloat16, None,
                       (torch.bfloat16, (2, 8), True), {}),
    "bias-only-fp32-causal": (1, 1300, 1300, 4, 1, 64, torch.float16, None,
                              (torch.float32, (1, 1), False), dict(causal=True)),
    "mask-and-bias-window": (2, 1000, 1000, 8, 2, 128, torch.bfloat16, ("random", 0.5, (2, 1)),
                             (torch.float16, (1, 2), True), dict(causal=True,
                                                                 window_size=(300, 0))),
    "mask-and-bias-gqa8-fp16": (1, 640, 900, 8, 1, 128, torch.float16, ("random", 0.9, (1, 8)),
                                (torch.float32, (1, 1), True), {}),
    # A mask and bias shared by every head over several KV heads: one list per KV head.
    "mask50-shared-mha": (1, 768, 1024, 4, 4, 128, torch.bfloat16, ("random", 0.5, (1, 1)),
                          None, {}),
    # Odd rows and keys: no pair of rows or keys shares an aligned word.
    "bias-odd-rows": (2, 333, 1000, 4, 4, 128, torch.bfloat16, None,
                      (torch.float16, (1, 4), True), dict(causal=True)),
    "bias-odd-rows-and-keys": (1, 777, 901, 4, 2, 64, torch.bfloat16, ("random", 0.5, (1, 1)),
                               (torch.bfloat16, (1, 1), False), {}),
    # Keys a multiple of 8: the backward stages the bias's tiles in smem (all but the last).
    "bias-staged-d64": (1, 600, 1000, 4, 2, 64, torch.bfloat16, None,
                        (torch.bfloat16, (1, 1), True), dict(causal=True)),
    # A bias slab per batch entry and query head: the backward stores dbias = dS in the bias's
    # dtype, no float32 sums (`BwdSpec.score_dbias_stores`; "bias-only-bf16" above too).
    "mask-and-bias-per-head-window": (1, 1000, 1000, 4, 2, 128, torch.float16,
                                      ("random", 0.5, (1, 4)), (torch.float16, (1, 4), True),
                                      dict(causal=True, window_size=(300, 0))),
    "bias-per-head-fp32-mha": (2, 700, 900, 4, 4, 64, torch.bfloat16, None,
                               (torch.float32, (2, 4), False), {}),
    # A mask shared by the heads beside a bias per query head: lists per query head.
    "mask-shared-bias-per-head-gqa": (1, 700, 900, 8, 2, 128, torch.bfloat16,
                                      ("random", 0.5, (1, 1)), (torch.bfloat16, (1, 8), True),
                                      dict(causal=True)),
}


def _call(name):
    batch, seqlen_q, seqlen_k, heads, kv_heads, dim, dtype, mask_form, bias_form, rule = \
        CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(len(name))
    q = torch.randn(batch, seqlen_q, heads, dim, generator=gen, device="cuda").to(dtype)
    k, v = (torch.randn(batch, seqlen_k, kv_heads, dim, generator=gen, device="cuda").to(dtype)
            for _ in range(2))
    mask = bias = None
    if mask_form is not None:
        kind, keep, lead = mask_form
        mask = _cells(kind, (*lead, seqlen_q, seqlen_k), gen, keep)
    if bias_form is not None:
        bias_dtype, lead, with_inf = bias_form
        bias = _bias((*lead, seqlen_q, seqlen_k), bias_dtype, gen, with_inf)
    return q, k, v, mask, bias, rule


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_kernel_equals_the_torch_path(name):
    q, k, v, mask, bias, rule = _call(name)
    problem = validate_attention_forward(q, k, v, **rule)
    on_kernel = masked.sm90_forward(problem, q, k, v, mask, bias)
    assert on_kernel is not None, "the sm90 kernel did not take the call"
    out, lse, tiles = on_kernel
    assert tiles.lists.row_block_size == masked.KERNEL_TILE and tiles.visited is None
    expected_out, expected_lse = masked.forward(problem, q, k, v, mask, bias)
    assert _rel_err(out, expected_out) < TOLERANCE
    # Rows that see nothing: out 0 and lse -inf, as on the torch path.
    blind = torch.isneginf(expected_lse)
    assert torch.equal(torch.isneginf(lse), blind)
    assert (out.float().permute(0, 2, 1, 3)[blind] == 0).all()
    assert (lse[~blind] - expected_lse[~blind]).abs().max().item() < 2e-2
    assert not out.isnan().any()


def test_expanded_masks_are_read_without_copies_of_the_repeats():
    """A mask expanded over batch and heads (stride 0) reads its one slab."""
    q, k, v, mask, _, rule = _call("mask50-gqa4-causal")
    wide = mask[:1, :1].expand(q.shape[0], q.shape[2], *mask.shape[2:])
    problem = validate_attention_forward(q, k, v, **rule)
    out, _, _ = masked.sm90_forward(problem, q, k, v, wide, None)
    expected, _ = masked.forward(problem, q, k, v, mask[:1, :1], None)
    assert _rel_err(out, expected) < TOLERANCE


@pytest.mark.parametrize("name", ["mask-and-bias-window", "bias-only-bf16"])
def test_gradients_through_flash_attn_func(name):
    """The kernel's forward under the torch backward: every gradient, the bias's included,
    against the torch path's forward and backward."""
    q, k, v, mask, bias, rule = _call(name)
    dout = torch.randn_like(q)
    grads = []
    for use_kernel in (True, False):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, bias)]
        if use_kernel:
            out = flash_attn_func(*leaves[:3], attn_mask=mask, attn_bias=leaves[3], **rule)
        else:
            problem = validate_attention_forward(q, k, v, **rule)
            out, lse = masked.forward(problem, *leaves[:3], mask, leaves[3])
            out = _TorchPath.apply(problem, *leaves, mask, out, lse)
        out.backward(dout)
        grads.append([x.grad for x in leaves])
    for actual, expected in zip(*grads):
        assert _rel_err(actual, expected) < TOLERANCE


class _TorchPath(torch.autograd.Function):
    """The torch path's forward outputs with its backward (the reference's gradients)."""

    @staticmethod
    def forward(ctx, problem, q, k, v, bias, mask, out, lse):
        ctx.problem, ctx.mask = problem, mask
        ctx.save_for_backward(q, k, v, bias, out, lse)
        return out.detach()

    @staticmethod
    def backward(ctx, dout):
        q, k, v, bias, out, lse = ctx.saved_tensors
        dq, dk, dv, dbias = masked.backward(ctx.problem, dout, q, k, v, out, lse, ctx.mask, bias,
                                            bias_gradient=True)
        return None, dq, dk, dv, dbias, None, None, None


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_kernel_backward_equals_the_torch_path(name):
    """dq, dk, dv and dbias of the sm90 backward (fused dQ; dS summed into float32 dbias sums,
    or stored into the gradient where each bias slab serves one batch entry and query head)
    against the torch path's on the same out and lse; dbias exactly 0 in every cell that no
    batch entry and head it serves can see (hidden by the rule, the mask or a -inf bias; the
    tiles no list visits among them). Elsewhere a 0 of the torch path's may be a sum that
    cancels there and not on the kernel (a row seeing one key has P = 1 and dS = dP - dO.O,
    exactly 0 in the torch path's arithmetic and a rounding apart on the kernel's): the
    relative error covers those cells."""
    q, k, v, mask, bias, rule = _call(name)
    problem = validate_attention_forward(q, k, v, **rule)
    out, lse = masked.forward(problem, q, k, v, mask, bias)
    dout = torch.randn(q.shape, generator=torch.Generator(device="cuda").manual_seed(len(name)),
                       device="cuda").to(q.dtype)
    with_grad = bias is not None
    on_kernel = masked.sm90_backward(problem, dout, q, k, v, out, lse, mask, bias, with_grad)
    assert on_kernel is not None, "the sm90 backward did not take the call"
    expected = masked.backward(problem, dout, q, k, v, out, lse, mask, bias, with_grad)
    for got, want, what in zip(on_kernel, expected, ("dq", "dk", "dv", "dbias")):
        if want is None:
            assert got is None
            continue
        assert got.shape == want.shape and got.dtype == want.dtype, what
        assert not got.isnan().any(), what
        assert _rel_err(got, want) < TOLERANCE, what
        if what == "dbias":
            unseen = _unseen_cells(problem, mask, bias).view(got.shape)
            assert (want[unseen] == 0).all() and (got[unseen] == 0).all(), what


@pytest.mark.parametrize("name", ["mask50-gqa4-causal", "mask-and-bias-window",
                                  "mask-shared-bias-per-head-gqa"])
def test_a_prepared_mask_on_the_kernels(name, monkeypatch):
    """kernels.prepare_mask on the sm90 kernels: the forward bit-equal to the bool tensor's
    (which drops the tiles a -inf bias hides whole, where the prepared mask's lists visit
    them: a tile of -inf scores adds exactly nothing), the gradients (the bias's included)
    equal to its within the float32 sums' rounding, and the bias's gradient exactly 0 where
    nothing is seen; the lists, their transpose and the bias gradient's map of visited tiles
    built at the first prepared call only (no classes of the mask or the bias read after it)."""
    q, k, v, mask, bias, rule = _call(name)
    prepared = prepare_mask(mask)
    dout = torch.randn_like(q)
    results = []
    for call, attn_mask in enumerate((mask, prepared, prepared)):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        attn_bias = None if bias is None else bias.detach().clone().requires_grad_()
        out, lse = flash_attn_func(*leaves, attn_mask=attn_mask, attn_bias=attn_bias,
                                   return_lse=True, **rule)
        out.backward(dout)
        grads = [x.grad for x in leaves] + ([] if attn_bias is None else [attn_bias.grad])
        results.append((out, lse, grads))
        if call == 1:  # after the first prepared call: nothing built again
            def no_classes(*args, **kwargs):
                raise AssertionError("tile classes read for a prepared mask's second call")

            def no_map(*args, **kwargs):
                raise AssertionError("the bias gradient's map of visited tiles built again")
            monkeypatch.setattr(masked, "_cell_classes", no_classes)
            monkeypatch.setattr(masked, "_visited_tiles", no_map)
    (out0, lse0, grads0) = results[0]
    for out, lse, grads in results[1:]:
        assert torch.equal(out, out0) and torch.equal(lse, lse0)
        for actual, expected in zip(grads, grads0):
            assert _rel_err(actual, expected) < 1e-2
    if bias is not None:
        problem = validate_attention_forward(q, k, v, **rule)
        unseen = _unseen_cells(problem, mask, bias).view(bias.shape)
        assert (results[-1][2][-1][unseen] == 0).all()
    (entry,) = prepared._lists.values()
    assert entry[1] is not None  # the backward's transpose, kept
    if bias is not None and entry[2]:  # its cells' sums fit the budget: no tiles counted
        (visited,) = entry[2].values()
        assert visited._slots is None


def _assert_the_bias_gradients_agree(problem, dout, q, k, v, out, lse, mask, bias, got_grads,
                                     one_launch_grads):
    """(dq, dk, dv, dbias) of a backward whose bias gradient's sums took another form (chunks
    of keys, the visited tiles') against the torch path's and the cells' one launch, dbias
    exactly 0 where nothing is seen."""
    expected = masked.backward(problem, dout, q, k, v, out, lse, mask, bias, True)
    for got, one_launch, want, what in zip(got_grads, one_launch_grads, expected,
                                           ("dq", "dk", "dv", "dbias")):
        assert got.shape == want.shape and got.dtype == want.dtype, what
        assert not got.isnan().any(), what
        assert _rel_err(got, want) < TOLERANCE, what
        assert _rel_err(got, one_launch) < 1e-2, what
    unseen = _unseen_cells(problem, mask, bias).view(got_grads[3].shape)
    assert (got_grads[3][unseen] == 0).all()


@pytest.mark.parametrize("name, prepared", [("mask-and-bias-window", False),
                                            ("mask-and-bias-window", True),
                                            ("bias-staged-d64", False),
                                            ("bias-odd-rows-and-keys", False),
                                            ("bias-odd-rows-and-keys", True)])
def test_the_backward_in_column_chunks(name, prepared, monkeypatch):
    """A shared 16-bit bias's gradient past KERNEL_SUMS_BUDGET_BYTES: the backward runs in
    chunks of 256 keys (the rule's rows placed for the chunk's keys: a causal window, causal,
    none; keys a multiple of 4 or not, the dbias tile pass or the whole-columns one), dq, dk,
    dv and dbias equal to the torch path's and to the one-launch kernel's within the float32
    sums' rounding, dbias 0 where nothing is seen, and no float32 sums larger than the budget.
    A prepared mask (its sums over its visited tiles alone, in runs of tile columns whose
    tiles fit the budget) keeps each chunk's transpose: its second backward builds none."""
    import sparsity.csr

    q, k, v, mask, bias, rule = _call(name)
    problem = validate_attention_forward(q, k, v, **rule)
    out, lse = masked.forward(problem, q, k, v, mask, bias)
    dout = torch.randn(q.shape, generator=torch.Generator(device="cuda").manual_seed(5),
                       device="cuda").to(q.dtype)
    whole = masked.sm90_backward(problem, dout, q, k, v, out, lse, mask, bias, True)
    slabs = masked._broadcast_view(bias).shape[:2].numel()
    budget = slabs * q.shape[1] * 256 * 4
    monkeypatch.setattr(masked, "KERNEL_SUMS_BUDGET_BYTES", budget)
    sums = []
    original = masked._BiasGradient.launch

    def recorded(self, index):
        result = original(self, index)
        sums.append((self._sums.numel() * self._sums.element_size(), "dbias_slots" in result))
        return result
    monkeypatch.setattr(masked._BiasGradient, "launch", recorded)
    attn_mask = prepare_mask(mask) if prepared else mask
    chunked = masked.sm90_backward(problem, dout, q, k, v, out, lse, attn_mask, bias, True)
    assert max(size for size, _ in sums) <= budget
    # A prepared mask's visited tiles are counted and take the sums, where the tile pass can
    # write the gradient's columns (keys a multiple of 4); elsewhere the cells' chunks.
    assert all(compact == (prepared and k.shape[1] % 4 == 0) for _, compact in sums)
    assert len(sums) > 1 and (sums[0][1] or len(sums) == -(-k.shape[1] // 256))
    if prepared:  # the call's lists, their transpose and each chunk's
        (entry,) = attn_mask._lists.values()
        assert entry[1] is not None and len(entry[3]) == len(sums)

        def no_lists(*args, **kwargs):
            raise AssertionError("lists built for a prepared mask's chunk again")
        monkeypatch.setattr(sparsity.csr, "csr_rows", no_lists)
        monkeypatch.setattr(masked, "_visited_tiles", no_lists)
        again = masked.sm90_backward(problem, dout, q, k, v, out, lse, attn_mask, bias, True)
        for got, first in zip(again, chunked):
            assert _rel_err(got, first) < 1e-2
    _assert_the_bias_gradients_agree(problem, dout, q, k, v, out, lse, mask, bias, chunked, whole)


@pytest.mark.parametrize("name", ["mask-and-bias-window", "bias-staged-d64"])
def test_a_tensor_masks_bias_gradient_over_the_visited_tiles(name, monkeypatch):
    """Where a shared 16-bit bias's float32 sums over its cells pass
    KERNEL_SUMS_BUDGET_BYTES, the forward counts the tiles its lists visit (the backward
    reads the count) and the backward sums into those tiles alone, in one launch: dq, dk, dv
    and dbias equal to the torch path's and to the cells' one launch, through
    flash_attn_func too."""
    q, k, v, mask, bias, rule = _call(name)
    problem = validate_attention_forward(q, k, v, **rule)
    dout = torch.randn(q.shape, generator=torch.Generator(device="cuda").manual_seed(6),
                       device="cuda").to(q.dtype)
    out, lse, plain = masked.sm90_forward(problem, q, k, v, mask, bias, bias_gradient=True)
    assert plain.visited is None  # the cells' sums fit the budget: nothing counted
    whole = masked.sm90_backward(problem, dout, q, k, v, out, lse, mask, bias, True)
    cells = masked._broadcast_view(bias).shape[:2].numel() * q.shape[1] * k.shape[1] * 4
    monkeypatch.setattr(masked, "KERNEL_SUMS_BUDGET_BYTES", cells - 1)
    out, lse, tiles = masked.sm90_forward(problem, q, k, v, mask, bias, bias_gradient=True)
    assert tiles.visited is not None
    launches = []
    original = masked._BiasGradient.launch

    def recorded(self, index):
        result = original(self, index)
        launches.append("dbias_slots" in result)
        return result
    monkeypatch.setattr(masked._BiasGradient, "launch", recorded)
    counted = masked.sm90_backward(problem, dout, q, k, v, out, lse, mask, bias, True, tiles)
    assert launches == [True]  # one launch, over the visited tiles' sums
    _, counts = tiles.visited.slots()
    assert 0 < sum(counts) * 128 * 128 * 4 < cells
    _assert_the_bias_gradients_agree(problem, dout, q, k, v, out, lse, mask, bias, counted, whole)

    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, bias)]
    flash_attn_func(*leaves[:3], attn_mask=mask, attn_bias=leaves[3], **rule).backward(dout)
    assert launches == [True, True]
    for leaf, want in zip(leaves, counted):
        assert _rel_err(leaf.grad, want) < 1e-2
