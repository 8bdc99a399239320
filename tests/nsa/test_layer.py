"""NSAAttention (nsa/layer.py) against its plain-PyTorch reference module, and each of its
constructor arguments shown to change the output.

Tolerances: float64 layer vs float64 reference, outputs and gradients ||a - b|| / ||b|| < 1e-10
(the two differ only in summation order); float32 layer vs float64 reference < 1e-4.
Geometry: nsa()'s small test tiles (16-row selection tiles, blocks of 4 / 8 tokens), so short
random sequences exercise selection, compression and the window.
"""
from __future__ import annotations

import io

import pytest
import torch

import nsa.layer as layer_module
from gpu_marks import record_backward_launches, requires_sm90
from nsa.layer import (NSAAttention, NSAAttentionReference, positions_in_sequences,
                       shard_positions)

HIDDEN = 32
SMALL_NSA = dict(compress_block_size=4, selected_block_size=8, num_selected_blocks=4,
                 window_size=12, _q_tile=16, _cmp_kv_block=4)
LENGTHS = [70, 5, 53]  # a short one, odd lengths, several tiles and blocks each


def cu_seqlens_of(lengths):
    return torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32)


def make_layer(cls=NSAAttention, *, seed=0, num_heads=4, num_kv_heads=2, head_dim=8,
               dtype=torch.float64, hidden=HIDDEN, geometry=SMALL_NSA, **options):
    """A layer whose every weight is random (W_k, W_v off the identity, W_gate of order 1), so
    no parameter sits at a value where its effect could vanish."""
    options = {**geometry, **options}
    torch.manual_seed(seed)
    layer = cls(hidden, num_heads, num_kv_heads, head_dim, **options).to(dtype)
    generator = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, parameter in layer.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float64)
            if name in ("W_k", "W_v"):
                parameter.add_((noise * 0.3).to(dtype))
            elif name == "W_gate":
                parameter.copy_(noise.to(dtype))
            elif name.endswith("bias"):
                parameter.copy_((noise * 0.1).to(dtype))
    return layer


def random_hidden(shape, *, seed=1, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)


def rel_err(a, b):
    b = b.detach().double()
    return float((a.detach().double() - b).norm() / b.norm())


def outputs_and_grads(layer, x, **call):
    """Output, and gradients of <output, fixed random> in x and every parameter."""
    x = x.detach().clone().requires_grad_()
    out = layer(x, **call)
    probe = random_hidden(out.shape, seed=7, dtype=out.dtype).to(out.device)
    names = [n for n, _ in layer.named_parameters()]
    grads = torch.autograd.grad((out * probe).sum(), [x, *layer.parameters()])
    return out, dict(zip(["input", *names], grads))


@pytest.mark.parametrize("attention", ["nsa", "dense"])
@pytest.mark.parametrize("layout", ["varlen", "padded"])
def test_layer_equals_reference_module_float64(attention, layout):
    layer = make_layer(attention=attention, bias=True)
    reference = make_layer(NSAAttentionReference, attention=attention, bias=True)
    reference.load_state_dict(layer.state_dict())
    if layout == "varlen":
        x = random_hidden((sum(LENGTHS), HIDDEN))
        call = dict(cu_seqlens=cu_seqlens_of(LENGTHS))
    else:
        x = random_hidden((2, 45, HIDDEN))
        call = {}
    out, grads = outputs_and_grads(layer, x, **call)
    ref_out, ref_grads = outputs_and_grads(reference, x, **call)
    assert rel_err(out, ref_out) < 1e-10
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert rel_err(grads[name], ref_grads[name]) < 1e-10, name


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_bfloat16_layer_on_the_kernels_close_to_float64_reference(attention, monkeypatch):
    """The layer in bfloat16 on an sm_90 GPU, at nsa()'s default geometry (its branches on the
    CuTe DSL kernels) or with the dense kernel, against the float64 reference module holding
    the same weights: packed documents of several tiles and blocks, GQA, head dim 128."""
    launched = record_backward_launches(monkeypatch)
    shape = dict(num_heads=8, num_kv_heads=2, head_dim=128, hidden=256, geometry={},
                 attention=attention)
    layer = make_layer(dtype=torch.bfloat16, **shape).cuda()
    reference = make_layer(NSAAttentionReference, **shape).cuda()
    reference.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
    lengths = [1500, 300, 77]
    call = dict(cu_seqlens=cu_seqlens_of(lengths).cuda())
    x = random_hidden((sum(lengths), 256)).cuda()
    out, grads = outputs_and_grads(layer, x.bfloat16(), **call)
    ref_out, ref_grads = outputs_and_grads(reference, x, **call)
    assert launched, "the attention backward did not run on the sm90 kernels"
    assert out.dtype == torch.bfloat16 and rel_err(out, ref_out) < 2e-2
    for name in grads:
        assert rel_err(grads[name], ref_grads[name]) < 3e-2, name


def test_layer_float32_close_to_float64_reference():
    layer = make_layer(dtype=torch.float32)
    reference = make_layer(NSAAttentionReference)
    reference.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
    call = dict(cu_seqlens=cu_seqlens_of(LENGTHS))
    x = random_hidden((sum(LENGTHS), HIDDEN))
    out, grads = outputs_and_grads(layer, x.float(), **call)
    ref_out, ref_grads = outputs_and_grads(reference, x, **call)
    assert rel_err(out, ref_out) < 1e-4
    for name in grads:
        assert rel_err(grads[name], ref_grads[name]) < 1e-4, name


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 1), (8, 2)])
def test_gqa_groups_equal_reference(num_heads, num_kv_heads):
    layer = make_layer(num_heads=num_heads, num_kv_heads=num_kv_heads)
    reference = make_layer(NSAAttentionReference, num_heads=num_heads, num_kv_heads=num_kv_heads)
    reference.load_state_dict(layer.state_dict())
    x = random_hidden((40, HIDDEN))
    call = dict(cu_seqlens=cu_seqlens_of([40]))
    assert layer.k_proj.out_features == num_kv_heads * 8
    assert layer.W_k.shape == (num_kv_heads, 8, 8)
    assert rel_err(layer(x, **call), reference(x, **call)) < 1e-10


def test_packed_documents_are_independent_and_positions_restart():
    """Each packed sequence's output equals the sequence run alone: nothing crosses a
    boundary, and the rotary positions restart at 0 (host bounds or not)."""
    layer = make_layer()
    x = random_hidden((sum(LENGTHS), HIDDEN))
    cu = cu_seqlens_of(LENGTHS)
    packed = layer(x, cu_seqlens=cu, host_cu_seqlens=tuple(cu.tolist()), max_seqlen=70)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = layer(x[a:b], cu_seqlens=cu_seqlens_of([b - a]))
        torch.testing.assert_close(packed[a:b], alone, rtol=1e-12, atol=1e-12)


def test_positions_in_sequences_with_empty_sequences():
    cu = torch.tensor([0, 3, 3, 5, 5], dtype=torch.int32)
    assert positions_in_sequences(cu, 5).tolist() == [0, 1, 2, 0, 1]


def test_shard_positions_follow_the_layout():
    """A rank's rows' positions in their documents under each layout: a document cut by a
    shard or zigzag chunk bound keeps counting across it."""
    cu = cu_seqlens_of([5, 7])  # 12 tokens at positions 0..4, 0..6
    expected = {
        ("contiguous", 0): [0, 1, 2, 3, 4, 0], ("contiguous", 1): [1, 2, 3, 4, 5, 6],
        # 4 chunks of 3: rank 0 holds rows 0-2 and 9-11, rank 1 rows 3-5 and 6-8
        ("zigzag", 0): [0, 1, 2, 4, 5, 6], ("zigzag", 1): [3, 4, 0, 1, 2, 3],
    }
    for (layout, rank), positions in expected.items():
        assert shard_positions(cu, 6, layout=layout, rank=rank,
                               world_size=2).tolist() == positions, (layout, rank)
    # 4 ranks, 8 chunks of 2: rank 1 holds rows 2-3 (chunk 1) and 12-13 (chunk 6)
    assert shard_positions(cu_seqlens_of([3, 13]), 4, layout="zigzag", rank=1,
                           world_size=4).tolist() == [2, 0, 9, 10]
    assert shard_positions(cu, 12).tolist() == positions_in_sequences(cu, 12).tolist()


def test_context_parallel_layout_is_refused_by_name():
    """An unknown layout raises before the group is used (a stand-in object here: nothing may
    reach it), naming the layer's argument; shard_positions names its own."""
    layer = make_layer(dtype=torch.float32)
    x = random_hidden((12, HIDDEN), dtype=torch.float32)
    with pytest.raises(ValueError, match=r"context_parallel_layout must be one of "
                                         r"\('contiguous', 'zigzag'\), got 'ring'"):
        layer(x, cu_seqlens=cu_seqlens_of([12]), context_parallel_group=object(),
              context_parallel_layout="ring")
    with pytest.raises(ValueError, match="^layout must be one of"):
        shard_positions(cu_seqlens_of([12]), 6, layout="ring", rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"the packed tokens has 10 tokens, not a multiple of "
                                         r"4 \(layout='zigzag'"):
        shard_positions(cu_seqlens_of([10]), 5, layout="zigzag", rank=0, world_size=2)


def test_explicit_position_ids_are_used():
    layer = make_layer()
    x = random_hidden((30, HIDDEN))
    cu = cu_seqlens_of([30])
    default = layer(x, cu_seqlens=cu)
    same = layer(x, cu_seqlens=cu, position_ids=torch.arange(30))
    shifted = layer(x, cu_seqlens=cu, position_ids=torch.arange(30) + 1000)
    torch.testing.assert_close(default, same)
    assert rel_err(shifted, default) > 1e-3


def test_state_dict_round_trip_and_dense_shares_every_other_weight():
    layer = make_layer()
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    restored = NSAAttention(HIDDEN, 4, 2, 8, **SMALL_NSA).double()
    restored.load_state_dict(torch.load(buffer))
    x = random_hidden((sum(LENGTHS), HIDDEN))
    call = dict(cu_seqlens=cu_seqlens_of(LENGTHS))
    assert torch.equal(layer(x, **call), restored(x, **call))
    # The dense layer is the NSA layer without W_k, W_v, W_gate: strict load of the rest.
    dense = NSAAttention(HIDDEN, 4, 2, 8, attention="dense").double()
    shared = {k: v for k, v in layer.state_dict().items() if not k.startswith("W_")}
    dense.load_state_dict(shared)
    assert set(layer.state_dict()) - set(dense.state_dict()) == {"W_k", "W_v", "W_gate"}


# One case per constructor argument whose value changes the function: (argument, changed value,
# extra options shared by both layers). The compared layers hold the same weights.
VALUE_ARGUMENTS = [
    ("attention", "dense", {}),
    ("compress_block_size", 8, {}),
    ("selected_block_size", 16, {}),
    ("num_selected_blocks", 3, {}),
    ("window_size", 0, {}),
    ("num_cmp_selected_blocks", 1, {}),
    ("compress_weights", False, {}),
    ("gate", False, {}),
    ("rope_base", 50.0, {}),
    ("softmax_scale", 0.9, {}),
    ("bias", True, {}),
    ("_q_tile", 32, dict(num_selected_blocks=5)),
    ("_cmp_kv_block", 8, dict(num_cmp_selected_blocks=1)),
]


@pytest.mark.parametrize("argument,value,shared", VALUE_ARGUMENTS,
                         ids=[case[0] for case in VALUE_ARGUMENTS])
def test_each_argument_changes_the_output(argument, value, shared):
    base = make_layer(**shared)
    changed = make_layer(**{**shared, argument: value})
    # Same values in every weight both have (a weight only one has keeps its random value).
    changed.load_state_dict(base.state_dict(), strict=False)
    x = random_hidden((sum(LENGTHS), HIDDEN))
    call = dict(cu_seqlens=cu_seqlens_of(LENGTHS))
    assert rel_err(changed(x, **call), base(x, **call)) > 1e-6


@pytest.mark.parametrize("argument,value", [("hidden_size", 48), ("num_heads", 8),
                                            ("num_kv_heads", 4), ("head_dim", 16)])
def test_each_shape_argument_sets_the_shapes(argument, value):
    sizes = dict(hidden_size=HIDDEN, num_heads=4, num_kv_heads=2, head_dim=8)
    sizes[argument] = value
    layer = NSAAttention(**sizes, **SMALL_NSA)
    assert layer.q_proj.weight.shape == (sizes["num_heads"] * sizes["head_dim"],
                                         sizes["hidden_size"])
    assert layer.k_proj.weight.shape == (sizes["num_kv_heads"] * sizes["head_dim"],
                                         sizes["hidden_size"])
    assert layer.W_gate.shape == (sizes["num_heads"], 3, sizes["head_dim"])
    x = random_hidden((20, sizes["hidden_size"]), dtype=torch.float32)
    assert layer(x, cu_seqlens=cu_seqlens_of([20])).shape == x.shape


def test_defaults_of_num_kv_heads_and_head_dim():
    layer = NSAAttention(64, 4)
    assert (layer.num_kv_heads, layer.head_dim) == (4, 16)


def test_deterministic_and_factory_arguments_reach_their_targets(monkeypatch):
    """deterministic, recompute and capture do not change values (the backward's summation
    order on a GPU; whether it recomputes the branch outputs; whether CUDA graphs replay the
    call): they must reach nsa(). device/dtype place
    the parameters."""
    seen = {}
    real_nsa = layer_module.nsa

    def recording_nsa(*args, **kwargs):
        seen.update(kwargs)
        return real_nsa(*args, **kwargs)

    monkeypatch.setattr(layer_module, "nsa", recording_nsa)
    layer = NSAAttention(HIDDEN, 4, 2, 8, deterministic=True, recompute=True, capture=False,
                         dtype=torch.float64, device="cpu", **SMALL_NSA)
    assert all(p.dtype == torch.float64 for p in layer.parameters())
    layer(random_hidden((20, HIDDEN)), cu_seqlens=cu_seqlens_of([20]))
    assert seen["deterministic"] is True and seen["recompute"] is True
    assert seen["capture"] is False


def test_compute_follows_the_activations_dtype():
    """float32 parameters, float64 activations: the layer computes in float64 (on a GPU:
    float32 master weights, bfloat16 activations)."""
    layer = make_layer(dtype=torch.float32)
    out = layer(random_hidden((20, HIDDEN)), cu_seqlens=cu_seqlens_of([20]))
    assert out.dtype == torch.float64


def test_initial_compression_is_the_block_mean_and_gates_start_near_half():
    layer = NSAAttention(HIDDEN, 4, 2, 8)
    assert torch.equal(layer.W_k, torch.eye(8).expand(2, 8, 8))
    assert torch.equal(layer.W_v, torch.eye(8).expand(2, 8, 8))
    assert layer.W_gate.abs().max() < 0.2


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="attention"):
        NSAAttention(HIDDEN, 4, attention="linear")
    with pytest.raises(ValueError, match="multiple"):
        NSAAttention(HIDDEN, 4, 3)
    with pytest.raises(ValueError, match="even"):
        NSAAttention(HIDDEN, 4, 2, 7)
    with pytest.raises(ValueError, match="hidden_states"):
        NSAAttention(HIDDEN, 4, 2, 8)(random_hidden((2, 5, HIDDEN), dtype=torch.float32),
                                       cu_seqlens=cu_seqlens_of([10]))
