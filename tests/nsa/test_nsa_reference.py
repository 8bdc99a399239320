"""The oracle itself, against torch's scaled_dot_product_attention where the two must agree."""
import torch
import torch.nn.functional as F

from nsa.reference import (compress_kv_reference, compressed_attention_reference,
                           nsa_reference, selected_attention_reference,
                           window_attention_reference)
from nsa_testing import random_inputs


def _sdpa(q, k, v, mask):
    """q (n, H, D), k, v (m, Hkv, D), mask (n, m) bool -> (n, H, D), GQA by repetition."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, dim=1).transpose(0, 1) for x in (k, v))
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask).transpose(0, 1)


def test_selecting_every_block_is_causal_attention():
    x = random_inputs([50], 4, 2, 8, seed=0)
    every_block = torch.arange(7, dtype=torch.int32).expand(4, 2, 7)  # 4 tiles of 16, blocks of 8
    out = selected_attention_reference(x["q"], x["k"], x["v"], x["cu_seqlens"], every_block,
                                       selected_block_size=8, softmax_scale=8 ** -0.5, q_tile=16)
    causal = torch.ones(50, 50, dtype=torch.bool).tril()
    torch.testing.assert_close(out, _sdpa(x["q"], x["k"], x["v"], causal))


def test_selected_attention_sees_only_the_listed_blocks():
    x = random_inputs([32], 2, 1, 8, seed=1)
    lists = torch.tensor([[[0, -1]], [[1, 3]]], dtype=torch.int32)  # tile 0: block 0; tile 1: 1, 3
    out = selected_attention_reference(x["q"], x["k"], x["v"], x["cu_seqlens"], lists,
                                       selected_block_size=8, softmax_scale=8 ** -0.5, q_tile=16)
    i, j = torch.arange(32)[:, None], torch.arange(32)[None, :]
    listed = torch.where(i < 16, j < 8, ((j >= 8) & (j < 16)) | (j >= 24))
    mask = listed & (j <= i)
    torch.testing.assert_close(out, _sdpa(x["q"], x["k"], x["v"], mask))
    assert torch.all(out[16:24] != 0)  # rows 16..23 see block 1 only


def test_wide_window_is_causal_attention_and_width_one_is_v():
    x = random_inputs([30, 9], 4, 2, 8, seed=2)
    wide = window_attention_reference(x["q"], x["k"], x["v"], x["cu_seqlens"], window_size=30,
                                      softmax_scale=8 ** -0.5)
    causal = torch.ones(30, 30, dtype=torch.bool).tril()
    torch.testing.assert_close(wide[:30], _sdpa(x["q"][:30], x["k"][:30], x["v"][:30], causal))
    one = window_attention_reference(x["q"], x["k"], x["v"], x["cu_seqlens"], window_size=1,
                                     softmax_scale=8 ** -0.5)
    torch.testing.assert_close(one, x["v"].repeat_interleave(2, dim=1))


def test_compression_of_single_tokens_is_causal_attention():
    x = random_inputs([25], 2, 1, 8, seed=3)
    k_cmp, v_cmp, cu_cmp = compress_kv_reference(x["k"], x["v"], x["cu_seqlens"], 1)
    torch.testing.assert_close(k_cmp, x["k"])
    out = compressed_attention_reference(x["q"], k_cmp, v_cmp, x["cu_seqlens"], cu_cmp,
                                         compress_block_size=1, softmax_scale=8 ** -0.5)
    causal = torch.ones(25, 25, dtype=torch.bool).tril()
    torch.testing.assert_close(out, _sdpa(x["q"], x["k"], x["v"], causal))


def test_compressed_token_is_seen_once_its_block_is_complete():
    x = random_inputs([12], 1, 1, 4, seed=4)
    k_cmp, v_cmp, cu_cmp = compress_kv_reference(x["k"], x["v"], x["cu_seqlens"], 4)
    out = compressed_attention_reference(x["q"], k_cmp, v_cmp, x["cu_seqlens"], cu_cmp,
                                         compress_block_size=4, softmax_scale=0.5)
    assert torch.all(out[:3] == 0)  # rows 0..2: block 0 is incomplete
    torch.testing.assert_close(out[3:7], v_cmp[0].expand(4, 1, 4))  # rows 3..6 see token 0 only


def test_gated_sum_of_the_branches():
    x = random_inputs([40], 2, 1, 8, seed=5)
    options = dict(compress_block_size=4, selected_block_size=8, num_selected_blocks=3,
                   window_size=6, _q_tile=16)
    out = nsa_reference(**x, **options)
    k_cmp, v_cmp, cu_cmp = compress_kv_reference(x["k"], x["v"], x["cu_seqlens"], 4, x["W_k"],
                                                 x["W_v"])
    o_cmp = compressed_attention_reference(x["q"], k_cmp, v_cmp, x["cu_seqlens"], cu_cmp,
                                           compress_block_size=4, softmax_scale=8 ** -0.5)
    o_swa = window_attention_reference(x["q"], x["k"], x["v"], x["cu_seqlens"], window_size=6,
                                       softmax_scale=8 ** -0.5)
    gates = torch.sigmoid(torch.einsum("thd,hbd->thb", x["q"], x["W_gate"]))
    # Rows 0..15 (the first tile) select block 0 and block 1 only: their selected branch is plain
    # causal attention over rows 0..15.
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    o_slc = _sdpa(x["q"][:16], x["k"][:16], x["v"][:16], causal)
    expected = gates[:16, :, 0:1] * o_cmp[:16] + gates[:16, :, 1:2] * o_slc + \
        gates[:16, :, 2:3] * o_swa[:16]
    torch.testing.assert_close(out[:16], expected)
    padded = nsa_reference(*(x[n].view(1, 40, *x[n].shape[1:]) for n in "qkv"), W_k=x["W_k"],
                           W_v=x["W_v"], W_gate=x["W_gate"], **options)
    torch.testing.assert_close(padded[0], out)
