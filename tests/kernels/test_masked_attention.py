"""flash_attn_func(attn_mask=, attn_bias=): the masked attention of kernels/masked.py against a
float64 reference that materialises the whole score matrix (CPU; the torch path)."""
from __future__ import annotations

import pytest
import torch

from kernels import flash_attn_func
from kernels import masked as masked_module
from kernels.interface import masked_attention_backward, masked_attention_forward


def _reference(q, k, v, mask, bias, *, causal=False, window=(-1, -1), compress_factor=1):
    """out (B, Nq, H, D) in float64 from the whole (B, H, Nq, Nk) score matrix."""
    batch, seqlen_q, heads, dim = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    kk, vv = (x.double().repeat_interleave(group, 2) for x in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * dim ** -0.5
    visible = torch.ones(batch, heads, seqlen_q, seqlen_k, dtype=torch.bool)
    if bias is not None:
        scores = scores + _spread(bias, heads, kv_heads).double()
    if mask is not None:
        visible &= _spread(mask, heads, kv_heads)
    rows = torch.arange(seqlen_q)[:, None]
    last_token = (torch.arange(seqlen_k)[None, :] + 1) * compress_factor - 1
    if causal:
        visible &= last_token <= rows
    if window[0] >= 0:
        visible &= last_token >= rows - window[0]
    if window[1] >= 0:
        visible &= last_token <= rows + window[1]
    scores = scores.masked_fill(~visible, float("-inf"))
    probabilities = torch.softmax(scores, -1).nan_to_num(0.0)  # rows that see nothing: 0
    return torch.einsum("bhqk,bkhd->bqhd", probabilities, vv)


def _spread(x, heads, kv_heads):
    """A (Bm, Hm, Nq, Nk) mask or bias (or fewer leading dims) over (B, H, Nq, Nk)."""
    x = x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))
    if x.shape[1] == kv_heads and kv_heads != heads:
        x = x.repeat_interleave(heads // kv_heads, 1)
    return x


def _inputs(batch, seqlen_q, seqlen_k, heads, kv_heads, dim, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, n, h, dim, generator=generator).to(dtype).requires_grad_()
            for n, h in ((seqlen_q, heads), (seqlen_k, kv_heads), (seqlen_k, kv_heads))]


def _random_mask(shape, keep: float, seed: int) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < keep


# (case name): (B, Nq, Nk, H, Hkv, mask shape or None, keep, bias shape or None, options)
CASES = {
    "mask10-gqa4-causal": (2, 40, 40, 8, 2, (2, 8, 40, 40), 0.1, None, dict(causal=True)),
    "mask50-bias-gqa1": (2, 33, 45, 4, 4, (1, 1, 33, 45), 0.5, (2, 4, 33, 45), {}),
    "mask90-kvheads-bias-shared": (3, 29, 29, 8, 1, (1, 1, 29, 29), 0.9, (1, 8, 29, 29),
                                   dict(causal=True)),
    "bias-only-2d-gqa8": (1, 50, 37, 8, 1, None, None, (50, 37), {}),
    "mask-per-kv-head-window": (2, 48, 48, 8, 2, (1, 2, 48, 48), 0.7, (1, 1, 48, 48),
                                dict(causal=True, window_size=(9, 0))),
    "mask-compressed": (1, 64, 16, 4, 2, (16,), 0.6, (1, 2, 64, 16),
                        dict(causal=True, compress_factor=4)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_masked_attention_matches_the_reference_with_every_gradient(name):
    batch, nq, nk, heads, kv_heads, mask_shape, keep, bias_shape, options = CASES[name]
    q, k, v = _inputs(batch, nq, nk, heads, kv_heads, 16, torch.float64)
    mask = None
    if mask_shape is not None:
        shape = mask_shape if len(mask_shape) > 1 else (nq, nk)
        mask = _random_mask(shape, keep, seed=1)
        if mask.dim() == 4:
            mask[0, 0, 5] = False  # a row (and, for a shared mask, every head's) sees nothing
    bias = None
    if bias_shape is not None:
        bias = torch.randn(bias_shape, generator=torch.Generator().manual_seed(2),
                           dtype=torch.float64).requires_grad_()
    window = options.get("window_size", (-1, -1))
    out = flash_attn_func(q, k, v, attn_mask=mask, attn_bias=bias, **options)
    expected = _reference(q, k, v, mask, bias, causal=options.get("causal", False),
                          window=window, compress_factor=options.get("compress_factor", 1))
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    assert torch.isfinite(out).all()
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
    leaves = [x for x in (q, k, v, bias) if x is not None]
    got = torch.autograd.grad(out, leaves, dout)
    wanted = torch.autograd.grad(expected, leaves, dout)
    for index, (a, b) in enumerate(zip(got, wanted)):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=f"gradient {index}")
    if bias is not None:
        assert got[-1].shape == bias.shape and got[-1].dtype == bias.dtype


def test_rows_that_see_nothing_output_zero_and_get_zero_gradients():
    q, k, v = _inputs(1, 12, 12, 2, 1, 8, torch.float32)
    mask = torch.ones(12, 12, dtype=torch.bool)
    mask[4] = False
    bias = torch.zeros(1, 1, 12, 12, requires_grad=True)
    with torch.no_grad():
        bias[0, 0, 7] = float("-inf")  # a bias of -inf hides its cell like the mask
    out, lse = flash_attn_func(q, k, v, attn_mask=mask, attn_bias=bias, return_lse=True)
    assert (out[0, 4] == 0).all() and (out[0, 7] == 0).all()
    assert torch.isneginf(lse[0, :, 4]).all() and torch.isneginf(lse[0, :, 7]).all()
    dq, dbias = torch.autograd.grad(out.sum(), (q, bias))
    assert (dq[0, 4] == 0).all() and (dq[0, 7] == 0).all()
    assert torch.isfinite(dbias).all() and (dbias[0, 0, 4] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_with_a_half_bias_and_chunked_rows(dtype, monkeypatch):
    """Half-precision q, k, v and bias; rows in chunks of a few (a small budget) with a bias
    shared by the batch, so dbias sums chunk by chunk over the batch before its one write."""
    q, k, v = _inputs(3, 30, 30, 4, 2, 16, dtype, seed=5)
    bias = (torch.randn(1, 4, 30, 30, generator=torch.Generator().manual_seed(6)) * 0.5).to(
        dtype).requires_grad_()
    mask = _random_mask((3, 1, 30, 30), 0.6, seed=7)
    monkeypatch.setattr(masked_module, "CHUNK_BUDGET_BYTES", 4 * 4 * 30 * 4 * 7)
    out = flash_attn_func(q, k, v, attn_mask=mask, attn_bias=bias, causal=True)
    expected = _reference(q, k, v, mask, bias, causal=True)
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(8)).to(dtype)
    got = torch.autograd.grad(out, (q, k, v, bias), dout)
    wanted = torch.autograd.grad(expected, (q, k, v, bias), dout.double())
    for a, b in zip(got, wanted):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), b.double(), rtol=5e-2, atol=5e-2)


def test_the_backward_is_bit_identical_from_run_to_run():
    q, k, v = _inputs(2, 24, 24, 4, 2, 8, torch.float32, seed=9)
    bias = torch.randn(1, 2, 24, 24, requires_grad=True)
    mask = _random_mask((2, 4, 24, 24), 0.5, seed=10)
    runs = []
    for _ in range(2):
        out = flash_attn_func(q, k, v, attn_mask=mask, attn_bias=bias, causal=True)
        runs.append(torch.autograd.grad(out.square().sum(), (q, k, v, bias)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_bad_masks_and_biases_are_refused_by_name():
    q, k, v = _inputs(2, 8, 6, 4, 2, 8, torch.float32)
    good = torch.ones(8, 6, dtype=torch.bool)
    cases = [
        (dict(attn_mask=torch.ones(8, 7, dtype=torch.bool)), ValueError,
         r"attn_mask must broadcast as \(B or 1, H or Hkv or 1, Nq, Nk\)"),
        (dict(attn_mask=torch.ones(2, 3, 8, 6, dtype=torch.bool)), ValueError,
         "attn_mask must broadcast"),
        (dict(attn_mask=torch.ones(8, 6)), TypeError, "attn_mask must be bool"),
        (dict(attn_bias=torch.ones(8, 6, dtype=torch.int32)), TypeError,
         "attn_bias must be float16/bfloat16/float32/float64"),
        (dict(attn_bias=torch.ones(3, 1, 8, 6)), ValueError, "attn_bias must broadcast"),
        (dict(attn_bias=torch.ones(8, 6, device="meta")), ValueError,
         "attn_bias must be on q's device"),
        (dict(attn_mask=good.tolist()), TypeError, "attn_mask must be a torch.Tensor"),
    ]
    for kwargs, error, phrase in cases:
        with pytest.raises(error, match=phrase):
            flash_attn_func(q, k, v, **kwargs)
    with pytest.raises(ValueError, match="not taken with block_sparse"):
        flash_attn_func(q, k, v, attn_mask=good, block_sparse=object())
    with pytest.raises(ValueError, match="padded"):
        masked_attention_forward(q[0], k[0], v[0], attn_mask=good)
    out, lse = masked_attention_forward(q, k, v, attn_mask=good)
    with pytest.raises(ValueError, match="bias_gradient: there is no attn_bias"):
        masked_attention_backward(torch.ones_like(out), q, k, v, out, lse, attn_mask=good,
                                  bias_gradient=True)


@pytest.mark.parametrize("rule", [dict(causal=True), dict(window_size=(100, 0)),
                                  dict(causal=True, window_size=(200, -1)), {},
                                  dict(causal=True, compress_factor=16)])
def test_the_kernels_tile_lists_cover_every_seen_cell(rule):
    """kernels/masked.py `tile_lists` (what the sm90 path visits): every tile with a seen
    cell is listed, "full" exactly where every existing cell is seen, under the rule, the mask
    and the bias's -inf cells together (against sparsity's builder on the combined dense mask);
    a listed "mask" tile may be empty (classes combine tile by tile)."""
    from kernels.fallback import visible_under_rule
    from kernels.validate import validate_attention_forward
    from sparsity import build_block_sparse_from_mask
    from sparsity.testing import FULL_BLOCK, dense_block_mask

    batch, seqlen_q, seqlen_k, heads, kv_heads = 2, 300, 500, 4, 2
    if rule.get("compress_factor"):
        seqlen_k = 40
    q = torch.randn(batch, seqlen_q, heads, 64)
    k = torch.randn(batch, seqlen_k, kv_heads, 64)
    problem = validate_attention_forward(q, k, k, **rule)
    mask = _random_mask((batch, 1, seqlen_q, seqlen_k), 0.7, seed=1)
    mask[..., :256, :] = True          # whole tiles seen
    mask[..., 256:, :128] = False      # whole tiles hidden
    bias = torch.randn(1, kv_heads, seqlen_q, seqlen_k)
    bias[..., 128:256, 256:] = float("-inf")
    lists = masked_module.tile_lists(problem, mask, bias)

    seen = mask.expand(batch, kv_heads, -1, -1) & ~torch.isneginf(bias)
    seen = seen & visible_under_rule(problem, torch.arange(seqlen_q)[:, None],
                                     torch.arange(seqlen_k)[None, :])
    expected = build_block_sparse_from_mask(seen, q_tile=128, kv_block=128)
    blocks = -(-seqlen_k // 128)
    got, want = dense_block_mask(lists, blocks), dense_block_mask(expected, blocks)
    assert ((want > 0) <= (got > 0)).all()
    assert torch.equal(got == FULL_BLOCK, want == FULL_BLOCK)
    assert (got == 0).any()
    if not {"window_size", "compress_factor"} & set(rule):  # (their tiles are all partial)
        assert (got == FULL_BLOCK).any()


@pytest.mark.parametrize("forms, list_heads", [(((1, 1), None), 2), ((None, (1, 1)), 2),
                                               (((1, 2), (1, 1)), 2), (((1, 1), (2, 4)), 4)])
def test_the_kernels_tile_lists_have_a_list_per_kv_head_at_least(forms, list_heads):
    """The kernels take lists per query head or per KV head (Hs in {H, Hkv}): a mask and bias
    shared by every head still give one list per KV head (one list over several KV heads gave
    a wrong backward on the GPU)."""
    from kernels.validate import validate_attention_forward

    batch, seqlen, heads, kv_heads = 2, 200, 4, 2
    q = torch.randn(batch, seqlen, heads, 64)
    k = torch.randn(batch, seqlen, kv_heads, 64)
    problem = validate_attention_forward(q, k, k)
    mask_form, bias_form = forms
    mask = None if mask_form is None else _random_mask((*mask_form, seqlen, seqlen), 0.5, seed=2)
    bias = None if bias_form is None else torch.randn(*bias_form, seqlen, seqlen)
    lists = masked_module.tile_lists(problem, mask, bias)
    assert lists.num_heads == list_heads and lists.num_rows == batch * 2


@pytest.mark.parametrize("forms", [((1, 1), (1, 1)), ((2, 4), (1, 1)), ((1, 2), (2, 2)),
                                   ((2, 1), (1, 4)), (None, (2, 4))],
                         ids=lambda f: str(f).replace(" ", ""))
def test_the_bias_gradients_visited_tiles_are_every_list_of_its_slab(forms):
    """kernels/masked.py `_visited_tiles` (the tiles of each bias slab that the sm90 backward
    may add dS into, zeroed and converted there, zeros written elsewhere): the union of the
    lists of every (batch entry, query head) the slab serves, the serving taken from the slab
    table the kernels read. A tile missing would leave stale float32 sums in the gradient; one
    too many costs only its zeroing."""
    from kernels.validate import validate_attention_forward
    from sparsity.testing import dense_block_mask

    batch, seqlen_q, seqlen_k, heads, kv_heads = 2, 300, 420, 4, 2
    q = torch.randn(batch, seqlen_q, heads, 64)
    k = torch.randn(batch, seqlen_k, kv_heads, 64)
    problem = validate_attention_forward(q, k, k, causal=True)
    mask_form, bias_form = forms
    mask = None if mask_form is None else _random_mask((*mask_form, seqlen_q, seqlen_k), 0.1,
                                                       seed=3)
    bias = torch.randn(*bias_form, seqlen_q, seqlen_k)
    bias[..., :128, 128:256] = float("-inf")  # a tile no row sees
    lists = masked_module.tile_lists(problem, mask, bias)
    visited = masked_module._visited_tiles(problem, lists, bias_form)

    tiles_q, tiles_k = -(-seqlen_q // 128), -(-seqlen_k // 128)
    listed = dense_block_mask(lists, tiles_k).view(batch, tiles_q, lists.num_heads, tiles_k) > 0
    slabs = masked_module.score_mod_tensors(problem, mask, bias).slabs  # (B, H, 2)
    expected = torch.zeros(bias_form[0] * bias_form[1], tiles_q, tiles_k, dtype=torch.bool)
    for b in range(batch):
        for h in range(heads):
            list_head = h // (heads // lists.num_heads)
            expected[slabs[b, h, 1]] |= listed[b, :, list_head]
    assert visited.dtype == torch.int8
    assert torch.equal(visited > 0, expected)
    assert not expected.all() and expected.any()


def test_slabs_past_32_bit_row_offsets_are_not_sent_to_the_kernels_backward():
    """The sm90 backward reads the mask and bias, and sums dbias, at 32-bit offsets from each
    slab's start (kernels/sm90/score_mod.py `slab_rows`): a slab whose cells reach 2**31
    elements from its start goes to the torch path."""
    fits = torch.empty(2, 46340, 46340, device="meta")       # 2,147,395,600 cells a slab
    too_long = torch.empty(1, 46341, 46341, device="meta")  # 2,147,488,281: past 2**31 - 1
    strided = torch.empty(1, 32768, 65536 + 8, device="meta")[..., :65536]  # rows 65,544 apart
    assert masked_module._rows_are_32_bit_offsets(fits, None)
    assert not masked_module._rows_are_32_bit_offsets(fits, too_long)
    assert not masked_module._rows_are_32_bit_offsets(strided)
    # 32,764 rows: the last cell 2**31 - 40 elements from the slab's start; one row more: past.
    assert masked_module._rows_are_32_bit_offsets(strided[:, :32764])
    assert not masked_module._rows_are_32_bit_offsets(strided[:, :32765])


def test_a_prepared_mask_computes_what_its_tensor_computes():
    """kernels.prepare_mask: the same outputs and gradients as the bool tensor itself, with and
    without a bias, over several calls (the torch path reads the tensor)."""
    from kernels import prepare_mask

    q, k, v = _inputs(2, 40, 40, 4, 2, 16, torch.float64, seed=11)
    mask = _random_mask((2, 1, 40, 40), 0.5, seed=12)
    bias = torch.randn(1, 4, 40, 40, dtype=torch.float64, requires_grad=True)
    prepared = prepare_mask(mask)
    assert prepared.tensor() is mask
    for attn_bias in (None, bias, None):
        leaves = [x for x in (q, k, v, attn_bias) if x is not None]
        results = []
        for attn_mask in (mask, prepared):
            out = flash_attn_func(q, k, v, attn_mask=attn_mask, attn_bias=attn_bias,
                                  causal=True)
            results.append((out, *torch.autograd.grad(out.square().sum(), leaves)))
        for a, b in zip(*results):
            assert torch.equal(a, b)


def test_a_prepared_mask_keeps_its_lists_per_call_shape(monkeypatch):
    """The kernels' tile lists of a prepared mask: those of its tensor and the rule, built once
    per call shape, rule and list heads and reused with or without a bias (a bias's -inf cells
    take no tile off them, where the tensor mask's lists drop the tiles a bias hides whole); a
    bias per query head asks for lists per query head; the mask's tile classes read once and
    the bias's never."""
    from kernels import prepare_mask
    from kernels.validate import validate_attention_forward
    from sparsity.testing import dense_block_mask

    batch, seqlen, heads, kv_heads = 2, 300, 4, 2
    q = torch.randn(batch, seqlen, heads, 64)
    k = torch.randn(batch, seqlen, kv_heads, 64)
    mask = _random_mask((batch, 1, seqlen, seqlen), 0.6, seed=13)
    mask[..., 256:, :128] = False
    prepared = prepare_mask(mask)
    bias = torch.randn(1, 1, seqlen, seqlen)
    bias[..., :128, 128:256] = float("-inf")
    per_head_bias = torch.randn(1, heads, seqlen, seqlen)
    blocks = -(-seqlen // 128)
    reads = []
    original = masked_module._cell_classes

    def counted(x, seen, tile, prior=None):
        reads.append(x.dtype)
        return original(x, seen, tile, prior)
    for rule in (dict(causal=True), {}):
        problem = validate_attention_forward(q, k, k, **rule)
        first = masked_module.tile_lists(problem, prepared)
        assert first.full_count.shape[1] == kv_heads
        assert masked_module.tile_lists(problem, prepared) is first
        assert masked_module.tile_lists(problem, prepared, bias) is first
        want = masked_module.tile_lists(problem, mask)
        assert torch.equal(dense_block_mask(first, blocks), dense_block_mask(want, blocks))
        if not rule:  # the tensor mask with the bias drops the tile that the bias hides
            def tile_0_1(lists):  # whole: query tile 0, key tile 1 (causal hides it anyway)
                return dense_block_mask(lists, blocks).view(batch, blocks, -1, blocks)[:, 0, :, 1]
            assert not tile_0_1(masked_module.tile_lists(problem, mask, bias)).any()
            assert tile_0_1(first).all()
        per_head = masked_module.tile_lists(problem, prepared, per_head_bias)
        assert per_head is not first and per_head.full_count.shape[1] == heads
        assert masked_module.tile_lists(problem, prepared, per_head_bias) is per_head
        assert torch.equal(dense_block_mask(per_head, blocks),
                           dense_block_mask(first, blocks).repeat_interleave(heads // kv_heads,
                                                                             dim=1))
        if not reads:  # from here on count the classes read
            monkeypatch.setattr(masked_module, "_cell_classes", counted)
    # The second rule read the mask's classes for the two unprepared calls and the bias's
    # classes for the second of them: never the prepared mask's, never for its calls.
    assert reads.count(torch.bool) == 2 and len(reads) == 3


def test_a_prepared_mask_is_refused_once_its_tensor_changes_and_checked_like_a_mask():
    from kernels import PreparedMask, prepare_mask

    q, k, v = _inputs(1, 8, 6, 2, 1, 8, torch.float32)
    mask = torch.ones(8, 6, dtype=torch.bool)
    prepared = prepare_mask(mask)
    assert isinstance(prepared, PreparedMask)
    flash_attn_func(q, k, v, attn_mask=prepared)
    mask[0, 0] = False
    with pytest.raises(ValueError, match="attn_mask: the tensor of this kernels.PreparedMask "
                                         "was changed in place"):
        flash_attn_func(q, k, v, attn_mask=prepared)
    for bad, error, phrase in ((mask.tolist(), TypeError, "attn_mask must be a torch.Tensor"),
                               (mask.float(), TypeError, "attn_mask must be bool"),
                               (mask[0], ValueError, "attn_mask must be 2-D to 4-D")):
        with pytest.raises(error, match=phrase):
            prepare_mask(bad)
    with pytest.raises(ValueError, match="attn_mask must broadcast"):
        flash_attn_func(q, k, v, attn_mask=prepare_mask(torch.ones(8, 7, dtype=torch.bool)))
    with pytest.raises(TypeError, match="attn_mask must be a torch.Tensor or a "
                                        "kernels.PreparedMask"):
        flash_attn_func(q, k, v, attn_mask="causal")


def test_the_kernel_backward_chunks_keys_past_its_sums_budget(monkeypatch):
    """The sm90 backward's float32 dbias sums stay under KERNEL_SUMS_BUDGET_BYTES: a shared
    16-bit bias whose sums pass it is taken in whole tiles of keys (one at least); a float32
    bias (its own sums) and a bias per batch entry and query head (stores) never chunk."""
    from kernels.validate import validate_attention_forward

    batch, seqlen, heads, kv_heads = 2, 600, 4, 2
    q = torch.randn(batch, seqlen, heads, 64)
    k = torch.randn(batch, seqlen, kv_heads, 64)
    problem = validate_attention_forward(q, k, k, causal=True)
    shared = torch.randn(1, 1, seqlen, seqlen, dtype=torch.bfloat16)
    cells = masked_module._broadcast_view(shared).reshape(-1, seqlen, seqlen)
    keys = masked_module._keys_per_launch
    assert keys(problem, shared, cells) == seqlen
    monkeypatch.setattr(masked_module, "KERNEL_SUMS_BUDGET_BYTES", 300 * seqlen * 4)
    assert keys(problem, shared, cells) == 256  # 300 keys fit: two whole tiles
    monkeypatch.setattr(masked_module, "KERNEL_SUMS_BUDGET_BYTES", 10)
    assert keys(problem, shared, cells) == 128
    assert keys(problem, shared.float(), cells.float()) == seqlen
    per_head = torch.randn(batch, heads, seqlen, seqlen, dtype=torch.float16)
    assert keys(problem, per_head, per_head.reshape(-1, seqlen, seqlen)) == seqlen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_bias_gradient_of_column_chunks_is_the_one_launch_gradient(dtype, monkeypatch):
    """_BiasGradient by chunks of keys (`_backward_by_columns`: one float32 buffer of the
    chunk's width, each launch's columns zeroed, summed into, converted): the same gradient as
    one launch over every key, the last chunk narrower; a float32 bias sums into its own
    gradient. The launches' sums stand in for the kernel's reductions."""
    from kernels.validate import validate_attention_forward

    seqlen_q, seqlen_k = 200, 600
    q = torch.randn(1, seqlen_q, 2, 64)
    k = torch.randn(1, seqlen_k, 2, 64)
    problem = validate_attention_forward(q, k, k)
    bias = torch.randn(1, 1, seqlen_q, seqlen_k).to(dtype)
    cells = masked_module._broadcast_view(bias).reshape(-1, seqlen_q, seqlen_k)
    lists = masked_module.tile_lists(problem, None, bias)
    ds = torch.randn(2, 1, seqlen_q, seqlen_k, generator=torch.Generator().manual_seed(2))

    def gradient(budget):
        monkeypatch.setattr(masked_module, "KERNEL_SUMS_BUDGET_BYTES", budget)
        result = masked_module._BiasGradient(problem, bias, cells, lists, None)
        keys = seqlen_k if budget > seqlen_q * seqlen_k * 4 or dtype == torch.float32 else 256
        assert result.chunks == [(c0, min(c0 + keys, seqlen_k))
                                 for c0 in range(0, seqlen_k, keys)]
        for index, (c0, c1) in enumerate(result.chunks):
            sums = result.launch(index)["dbias"]
            assert sums.shape == (1, seqlen_q, c1 - c0)
            assert (sums == 0).all()  # zeroed for the launch
            for head in ds:  # the kernel's reductions: every head's dS into the cells
                sums += head[:, :, c0:c1].to(sums.dtype)
            result.convert()
        return result.result()

    whole = gradient(1 << 30)
    assert whole.shape == bias.shape and whole.dtype == dtype
    assert torch.equal(whole, ds.sum(0, keepdim=True).view(bias.shape).to(dtype))
    assert torch.equal(gradient(seqlen_q * 300 * 4), whole)  # 300 keys fit: 2 tiles a launch


def test_a_prepared_mask_keeps_each_column_chunk_transpose():
    """A prepared mask keeps the transpose of each chunk of keys of its lists (one build per
    KV tile range, then reused), with those lists: lists it does not hold build each time."""
    from kernels import prepare_mask
    from kernels.validate import validate_attention_forward

    q = torch.randn(1, 512, 2, 64)
    prepared = prepare_mask(_random_mask((1, 1, 512, 512), 0.5, seed=4))
    problem = validate_attention_forward(q, q, q)
    lists = masked_module.tile_lists(problem, prepared)
    built = []

    def build(tiles):
        built.append(tiles)
        return object()
    first, second = (prepared.columns_for(lists, tiles, lambda tiles=tiles: build(tiles))
                     for tiles in ((0, 2), (2, 4)))
    assert first is not second and built == [(0, 2), (2, 4)]
    assert prepared.columns_for(lists, (2, 4), lambda: build(None)) is second
    assert built == [(0, 2), (2, 4)]
    stranger = masked_module._tile_lists(problem, prepared.mask, None, 2)
    prepared.columns_for(stranger, (0, 2), lambda: build("stranger"))
    prepared.columns_for(stranger, (0, 2), lambda: build("stranger"))
    assert built[2:] == ["stranger", "stranger"]


def test_visited_tiles_count_their_slots_once():
    """_VisitedTiles.slots: each visited tile's slot in the sums of the visited tiles alone,
    numbered tile column by tile column (slab, then tile row, inside one), -1 elsewhere, and
    each column's count; counted once. _slot_runs: the launches' runs of columns whose slots
    fit a capacity, one column at least."""
    visited = torch.tensor([[[1, 0, 1], [0, 0, 1]], [[0, 1, 0], [1, 1, 0]]], dtype=torch.int8)
    tiles = masked_module._VisitedTiles(visited)
    slots, counts = tiles.slots()
    assert counts == [2, 2, 2] and slots.dtype == torch.int32 and slots.is_contiguous()
    assert slots.tolist() == [[[0, -1, 4], [-1, -1, 5]], [[-1, 2, -1], [1, 3, -1]]]
    assert tiles.slots()[0] is slots
    runs = masked_module._slot_runs
    assert runs([2, 2, 2], 6) == [(0, 3, 0, 6)]
    assert runs([2, 2, 2], 4) == [(0, 2, 0, 4), (2, 3, 4, 2)]
    assert runs([5, 0, 1, 3], 2) == [(0, 1, 0, 5), (1, 3, 5, 1), (3, 4, 6, 3)]
