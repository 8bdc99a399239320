"""nsa() rejects every malformed argument with an error that names it, before computing."""
import re

import pytest
import torch

from nsa import nsa
from nsa.validation import validate_nsa_arguments
from nsa_testing import SMALL, cu_seqlens_of, random_inputs


def _valid_varlen() -> dict:
    x = random_inputs([20, 12], 4, 2, 8, seed=0, dtype=torch.float32)
    return {**x, **SMALL}


def _valid_padded() -> dict:
    x = random_inputs([20, 20], 4, 2, 8, seed=0, dtype=torch.float32)
    for name in "qkv":
        x[name] = x[name].view(2, 20, *x[name].shape[1:])
    x.pop("cu_seqlens")
    return {**x, **SMALL}


META = torch.device("meta")  # a second device, so device checks run without a GPU

# (case id, argument changes, error type, text the message must contain)
BAD_ARGUMENTS = [
    ("q-not-tensor", lambda a: a.update(q=a["q"].tolist()), TypeError, "q must be a torch.Tensor"),
    ("k-not-tensor", lambda a: a.update(k=None), TypeError, "k must be a torch.Tensor"),
    ("v-not-tensor", lambda a: a.update(v=1.0), TypeError, "v must be a torch.Tensor"),
    ("q-rank", lambda a: a.update(q=a["q"][None]), ValueError, "q must be 3-D"),
    ("k-rank", lambda a: a.update(k=a["k"][..., 0]), ValueError, "k must be 3-D"),
    ("q-dtype-int", lambda a: a.update(q=a["q"].to(torch.int32)), TypeError, "q must be float"),
    ("k-dtype", lambda a: a.update(k=a["k"].double()), TypeError, "k must have q's dtype"),
    ("v-dtype", lambda a: a.update(v=a["v"].half()), TypeError, "v must have q's dtype"),
    ("k-device", lambda a: a.update(k=a["k"].to(META)), ValueError, "k must be on q's device"),
    ("v-device", lambda a: a.update(v=a["v"].to(META)), ValueError, "v must be on q's device"),
    ("k-rows", lambda a: a.update(k=a["k"][:-1]), ValueError, "k must have q's leading dims"),
    ("v-shape", lambda a: a.update(v=a["v"][:, :1]), ValueError, "v must have k's shape"),
    ("heads-not-divisible", lambda a: a.update(k=torch.randn(32, 3, 8), v=torch.randn(32, 3, 8),
                                                W_k=None, W_v=None),
     ValueError, "multiple of k's heads"),
    ("head-dim", lambda a: a.update(k=a["k"][..., :4], v=a["v"][..., :4]), ValueError,
     "k must have q's head dim"),
    ("cu_seqlens-list", lambda a: a.update(cu_seqlens=[0, 20, 32]), TypeError,
     "cu_seqlens must be a torch.Tensor"),
    ("cu_seqlens-int64", lambda a: a.update(cu_seqlens=a["cu_seqlens"].long()), TypeError,
     "cu_seqlens must be int32"),
    ("cu_seqlens-2d", lambda a: a.update(cu_seqlens=a["cu_seqlens"][None]), ValueError,
     "cu_seqlens must be 1-D"),
    ("cu_seqlens-device", lambda a: a.update(cu_seqlens=a["cu_seqlens"].to(META)), ValueError,
     "cu_seqlens must be on q's device"),
    ("cu_seqlens-start",
     lambda a: a.update(cu_seqlens=torch.tensor([2, 20, 32], dtype=torch.int32)),
     ValueError, "cu_seqlens must start at 0"),
    ("cu_seqlens-decreasing",
     lambda a: a.update(cu_seqlens=torch.tensor([0, 20, 10, 32], dtype=torch.int32)),
     ValueError, "cu_seqlens must be non-decreasing"),
    ("cu_seqlens-end", lambda a: a.update(cu_seqlens=cu_seqlens_of([20, 11])), ValueError,
     "cu_seqlens must end at q's number of rows"),
    ("max_seqlen-float", lambda a: a.update(max_seqlen=20.0), TypeError,
     "max_seqlen must be an int"),
    ("max_seqlen-short", lambda a: a.update(max_seqlen=19), ValueError, "max_seqlen must be >="),
    ("max_seqlen-beyond-int32", lambda a: a.update(max_seqlen=2**40), ValueError,
     "max_seqlen must be <= 2**31 - 1"),
    ("q-meta", lambda a: a.update({n: a[n].to(META) for n in
                                   ("q", "k", "v", "cu_seqlens", "W_k", "W_v", "W_gate")}),
     ValueError, "q is on the meta device"),
    ("q-meta-only", lambda a: a.update(q=a["q"].to(META)), ValueError,
     "q is on the meta device"),
    ("compress_block_size-zero", lambda a: a.update(compress_block_size=0), ValueError,
     "compress_block_size must be an int >= 1"),
    ("compress_block_size-float", lambda a: a.update(compress_block_size=4.0), TypeError,
     "compress_block_size must be an int"),
    ("selected_block_size-negative", lambda a: a.update(selected_block_size=-8), ValueError,
     "selected_block_size must be an int >= 1"),
    ("selected_block_size-not-multiple", lambda a: a.update(selected_block_size=6), ValueError,
     "selected_block_size (6) must be a multiple of compress_block_size (4)"),
    ("num_selected_blocks-zero", lambda a: a.update(num_selected_blocks=0), ValueError,
     "num_selected_blocks must be an int >= 1"),
    ("num_selected_blocks-too-few", lambda a: a.update(num_selected_blocks=2), ValueError,
     "num_selected_blocks must be >= 3"),
    ("num_selected_blocks-bool", lambda a: a.update(num_selected_blocks=True), TypeError,
     "num_selected_blocks must be an int"),
    ("window_size-negative", lambda a: a.update(window_size=-1), ValueError,
     "window_size must be an int >= 0"),
    ("window_size-str", lambda a: a.update(window_size="12"), TypeError,
     "window_size must be an int"),
    ("W_k-not-tensor", lambda a: a.update(W_k="W"), TypeError, "W_k must be a torch.Tensor"),
    ("W_k-shape", lambda a: a.update(W_k=a["W_k"][:, :4]), ValueError,
     "W_k must have shape (Hkv, D, D)"),
    ("W_k-dtype", lambda a: a.update(W_k=a["W_k"].double()), TypeError,
     "W_k must have q's dtype"),
    ("W_k-device", lambda a: a.update(W_k=a["W_k"].to(META)), ValueError,
     "W_k must be on q's device"),
    ("W_v-shape", lambda a: a.update(W_v=a["W_v"][:1]), ValueError,
     "W_v must have shape (Hkv, D, D)"),
    ("W_v-dtype", lambda a: a.update(W_v=a["W_v"].bfloat16()), TypeError,
     "W_v must have q's dtype"),
    ("W_gate-shape", lambda a: a.update(W_gate=a["W_gate"][:, :2]), ValueError,
     "W_gate must have shape (H, 3, D)"),
    ("W_gate-dtype", lambda a: a.update(W_gate=a["W_gate"].double()), TypeError,
     "W_gate must have q's dtype"),
    ("W_gate-device", lambda a: a.update(W_gate=a["W_gate"].to(META)), ValueError,
     "W_gate must be on q's device"),
    ("causal-int", lambda a: a.update(causal=1), TypeError, "causal must be a bool"),
    ("deterministic-int", lambda a: a.update(deterministic=1), TypeError,
     "deterministic must be a bool"),
    ("deterministic-str", lambda a: a.update(deterministic="True"), TypeError,
     "deterministic must be a bool"),
    ("deterministic-none", lambda a: a.update(deterministic=None), TypeError,
     "deterministic must be a bool"),
    ("softmax_scale-negative", lambda a: a.update(softmax_scale=-0.5), ValueError,
     "softmax_scale must be positive"),
    ("softmax_scale-nan", lambda a: a.update(softmax_scale=float("nan")), ValueError,
     "softmax_scale must be positive"),
    ("softmax_scale-str", lambda a: a.update(softmax_scale="0.5"), TypeError,
     "softmax_scale must be a float"),
    ("softmax_scale-zero", lambda a: a.update(softmax_scale=0.0), ValueError,
     "softmax_scale must be positive and finite"),
    ("softmax_scale-inf", lambda a: a.update(softmax_scale=float("inf")), ValueError,
     "softmax_scale must be positive and finite"),
    ("softmax_scale-inf-in-float32", lambda a: a.update(softmax_scale=1e39), ValueError,
     "softmax_scale must be finite in float32"),
    ("num_cmp_selected_blocks-negative", lambda a: a.update(num_cmp_selected_blocks=-1), ValueError,
     "num_cmp_selected_blocks must be an int >= 0"),
    ("num_cmp_selected_blocks-float", lambda a: a.update(num_cmp_selected_blocks=1.5), TypeError,
     "num_cmp_selected_blocks must be an int"),
    ("q_tile-zero", lambda a: a.update(_q_tile=0), ValueError, "_q_tile must be an int >= 1"),
    ("cmp_kv_block-zero", lambda a: a.update(_cmp_kv_block=0), ValueError,
     "_cmp_kv_block must be an int >= 1"),
]


@pytest.mark.parametrize("change,error,message", [c[1:] for c in BAD_ARGUMENTS],
                         ids=[c[0] for c in BAD_ARGUMENTS])
def test_bad_argument_is_named(change, error, message):
    args = _valid_varlen()
    change(args)
    with pytest.raises(error, match=_literal(message)):
        nsa(**args)


BAD_PADDED = [
    ("q-rank", lambda a: a.update(q=a["q"][0]), ValueError, "q must be 4-D"),
    ("max_seqlen-beyond-int32", lambda a: a.update(max_seqlen=2**40), ValueError,
     "max_seqlen must be <= 2**31 - 1"),
    ("q-meta", lambda a: a.update({n: a[n].to(META) for n in
                                   ("q", "k", "v", "W_k", "W_v", "W_gate")}),
     ValueError, "q is on the meta device"),
    ("max_seqlen", lambda a: a.update(max_seqlen=21), ValueError,
     "max_seqlen must be None or q.shape[1]"),
    ("k-seqlen", lambda a: a.update(k=a["k"][:, :-1], v=a["v"][:, :-1]), ValueError,
     "k must have q's leading dims"),
]


@pytest.mark.parametrize("change,error,message", [c[1:] for c in BAD_PADDED],
                         ids=[c[0] for c in BAD_PADDED])
def test_bad_padded_argument_is_named(change, error, message):
    args = _valid_padded()
    change(args)
    with pytest.raises(error, match=_literal(message)):
        nsa(**args)


def test_the_valid_arguments_run():
    # The baselines the cases above break are themselves accepted.
    assert nsa(**_valid_varlen()).shape == (32, 4, 8)
    assert nsa(**_valid_padded()).shape == (2, 20, 4, 8)


def test_forced_block_bound_counts_unaligned_blocks():
    # With 48-key blocks a 128-row tile can overlap 4 of them (rows 128..255 touch blocks 2..5),
    # so 1 + 128/48 rounded up (4) is not enough: block 0 and the four diagonal ones need 5.
    args = {**_valid_varlen(), "_q_tile": 128, "compress_block_size": 16,
            "selected_block_size": 48}
    with pytest.raises(ValueError, match="num_selected_blocks must be >= 5"):
        nsa(**{**args, "num_selected_blocks": 4})
    assert nsa(**{**args, "num_selected_blocks": 5}).shape == (32, 4, 8)


def test_num_selected_blocks_is_clipped_to_the_blocks_of_the_longest_sequence():
    # Sequences of 20 and 12 rows, blocks of 8: the longest has 3 blocks, fewer than the forced
    # minimum (1 + 16 / 8 = 3 with 16-row tiles): clipped to 3. With max_seqlen=40: 5 blocks.
    args = _valid_varlen()
    config, _ = validate_nsa_arguments(**_validation_kwargs(args, num_selected_blocks=10**6))
    assert config.num_selected_blocks == 3
    config, max_seqlen = validate_nsa_arguments(
        **_validation_kwargs(args, num_selected_blocks=10**6, max_seqlen=40))
    assert (config.num_selected_blocks, max_seqlen) == (5, 40)
    config, _ = validate_nsa_arguments(**_validation_kwargs(args, num_selected_blocks=4,
                                                            max_seqlen=40))
    assert config.num_selected_blocks == 4  # below the block count: kept
    # The same function: a tile has no more blocks to select.
    expected = nsa(**{**args, "num_selected_blocks": 3})
    assert torch.equal(nsa(**{**args, "num_selected_blocks": 10**5}), expected)


def _validation_kwargs(args: dict, **changes) -> dict:
    """nsa()'s arguments as validate_nsa_arguments takes them."""
    args = {**args, **changes}
    kwargs = dict(cu_seqlens=None, max_seqlen=None, compress_block_size=64,
                  selected_block_size=64, num_selected_blocks=16, window_size=512, W_k=None,
                  W_v=None, W_gate=None, causal=True, softmax_scale=None,
                  num_cmp_selected_blocks=None)
    kwargs.update({name: value for name, value in args.items() if not name.startswith("_")})
    kwargs.update(q_tile=args.get("_q_tile", 128), cmp_kv_block=args.get("_cmp_kv_block", 128))
    return kwargs


def _literal(text: str) -> str:
    return re.escape(text)
