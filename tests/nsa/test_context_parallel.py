"""nsa_context_parallel (heads mode, plain and pipelined) against one-process nsa(), on gloo with
2 and 4 processes.

Each world size is one spawn of W processes (process start dominates the time) that runs every
check of that size and reports per check; the tests below read those reports. Every rank also
computes one-process nsa() on the full inputs (the same seed everywhere) and compares its shard:
outputs and dq, dk, dv bitwise (heads mode runs the very code one process runs, on a subset of
heads: the all-to-all only moves numbers), and dW_k, dW_v, dW_gate summed over the ranks bitwise
(each rank's partial is zero outside its heads, so the sum adds only exact zeros).
Bad inputs: every rank must raise a ValueError naming the argument, and the group must still work
afterwards (the next check runs collectives); a hung rank fails the test through the join timeout.
"""
from __future__ import annotations

import datetime
import multiprocessing
import os
import traceback

import pytest
import torch

# One pytest-xdist worker takes this module's tests (`--dist loadgroup` in the test command),
# so the multi-process runs behind `reports` start once per world size, not once per worker.
pytestmark = pytest.mark.xdist_group("context_parallel")

JOIN_TIMEOUT_S = 150
OPTIONS = dict(compress_block_size=8, selected_block_size=16, num_selected_blocks=4,
               window_size=24, _q_tile=32, _cmp_kv_block=8)
WEIGHTS = ("W_k", "W_v", "W_gate")

# name: (H, Hkv, D, layout, lengths or (B, N), weights, dtype). Packed documents cross the shard
# bounds (128 for 2 ranks; 64, 128, 192 for 4), and each selection tile, window and compressed
# block near a bound reads tokens from both sides of it.
EQUALITY_CASES = {
    2: {
        "padded_gqa1_weights": (8, 8, 16, "padded", (2, 128), True, torch.float32),
        "packed_gqa4_weights": (16, 4, 16, "packed", (50, 150, 56), True, torch.float32),
        "packed_gqa4_no_weights": (16, 4, 16, "packed", (50, 150, 56), False, torch.float32),
        "packed_gqa8_bf16": (16, 2, 16, "packed", (21, 200, 35), True, torch.bfloat16),
        "padded_gqa8_no_weights": (32, 4, 16, "padded", (2, 96), False, torch.float32),
    },
    4: {
        "packed_gqa8_weights": (32, 4, 16, "packed", (40, 100, 75, 41), True, torch.float32),
        "padded_gqa4_no_weights": (16, 4, 16, "padded", (2, 128), False, torch.float32),
        "packed_gqa1_no_weights": (8, 8, 16, "packed", (40, 100, 75, 41), False,
                                   torch.float32),
        "padded_gqa1_weights": (8, 8, 16, "padded", (2, 64), True, torch.float32),
    },
}
# Heads mode pipelined (overlap_chunks): name: (case as above, chunks). Each chunk is nsa() on a
# slice of a rank's KV heads, so the check is bitwise against one process running nsa() per
# such slice (world x chunks slices), and within float rounding of the all-heads call.
PIPELINED_CASES = {
    2: {
        "packed_gqa4_weights_2_chunks": ((16, 4, 16, "packed", (50, 150, 56), True,
                                          torch.float32), 2),
        "padded_gqa1_weights_4_chunks": ((8, 8, 16, "padded", (2, 128), True, torch.float32), 4),
        "padded_gqa1_no_weights_2_chunks": ((8, 8, 16, "padded", (2, 128), False,
                                             torch.float32), 2),
        "packed_gqa8_bf16_2_chunks": ((32, 4, 16, "packed", (21, 200, 35), True,
                                       torch.bfloat16), 2),
    },
    4: {
        "packed_gqa2_weights_2_chunks": ((16, 8, 16, "packed", (40, 100, 75, 41), True,
                                          torch.float32), 2),
    },
}
# Sequence mode (each rank keeps its query rows; nsa/distributed/sequence_mode.py): name: (case as
# above, mode). Equal to one process within float summation order (the ranks' dK/dV are summed
# in another order), at least 2 x _q_tile = 64 tokens a rank.
SEQUENCE_CASES = {
    2: {
        "packed_gqa4_weights": ((16, 4, 16, "packed", (50, 150, 56), True, torch.float32),
                                "sequence"),
        "padded_gqa1_weights": ((8, 8, 16, "padded", (2, 128), True, torch.float32),
                                "sequence"),
        "packed_gqa8_no_weights": ((16, 2, 16, "packed", (21, 200, 35), False, torch.float32),
                                   "sequence"),
    },
    4: {
        "packed_hkv2_auto_weights": ((16, 2, 16, "packed", (40, 100, 75, 41), True,
                                      torch.float32), "auto"),
        "padded_gqa4_no_weights": ((16, 4, 16, "padded", (2, 256), False, torch.float32),
                                   "sequence"),
    },
}
# The zigzag layout (rank r holds chunks r and 2W-1-r of 2W): name: (case as above, mode,
# overlap_chunks), checked as the contiguous cases of that mode are (heads mode bitwise, sequence
# mode within float32 rounding). The chunk bounds (64, 128, 192 for 2 ranks; multiples of 32 or
# 64 for 4) cut documents, and in sequence mode a chunk's halo comes from another rank's chunk
# (or, for rank 1 of 2, from its own other chunk).
ZIGZAG_CASES = {
    2: {
        "heads_packed_gqa4_weights": ((16, 4, 16, "packed", (50, 150, 56), True,
                                       torch.float32), "heads", 1),
        "sequence_packed_gqa8_weights": ((16, 2, 16, "packed", (21, 200, 35), True,
                                          torch.float32), "sequence", 1),
    },
    4: {
        "pipelined_packed_gqa2_2_chunks": ((16, 8, 16, "packed", (40, 100, 75, 41), True,
                                            torch.float32), "heads", 2),
        "sequence_padded_gqa4_weights": ((16, 4, 16, "padded", (2, 512), True, torch.float32),
                                         "sequence", 1),
    },
}
# CausalLM across 2 ranks: name: (context_parallel_layout, num_kv_heads). Hkv=2 runs heads mode,
# Hkv=1 sequence mode (the mode zigzag balances). 192 tokens in documents of (50, 100, 42): the
# contiguous bound at 96 and the zigzag chunk bounds at 48, 96 and 144 all cut documents.
LANGUAGE_MODEL_CASES = {
    "contiguous": ("contiguous", 2),
    "zigzag": ("zigzag", 2),
    "zigzag_sequence_mode": ("zigzag", 1),
}
# name: the phrase the ValueError must contain on every rank.
BAD_INPUT_CASES = {
    2: {
        "sequence_mode_noncausal": "mode='sequence': causal attention only",
        "unequal_shards": "q must hold the same number of tokens on every rank",
        "cu_seqlens_disagree": "cu_seqlens must be the same global cu_seqlens",
        "local_cu_seqlens_instead_of_global": "cu_seqlens must be the global cu_seqlens",
        "k_on_another_device_on_one_rank": "k is on the meta device",
        "options_disagree": "window_size must be the same on every rank",
        "requires_grad_disagrees": "must require grad alike",
        "mode_unknown": "mode must be one of",
        "overlap_chunks_not_dividing": "overlap_chunks must divide the KV heads of a rank",
        "overlap_chunks_disagree": "overlap_chunks must be the same on every rank",
        "layout_unknown": "layout must be one of ('contiguous', 'zigzag')",
        "layout_disagrees": "layout must be the same on every rank",
        "zigzag_odd_shard": "q must hold a multiple of 2 tokens on every rank with "
                            "layout='zigzag'",
    },
    4: {
        "auto_sequence_mode_too_few_tokens_world_not_dividing_kv_heads":
            "every rank must hold at least 64 tokens",
        "heads_with_world_not_dividing_kv_heads": "mode='heads'",
        "unequal_shards": "q must hold the same number of tokens on every rank",
        "sequence_zigzag_chunk_too_short": "every rank must hold at least 64 tokens per chunk",
    },
}


# ------------------------------------------------------------------------------------------------
# What each rank runs
# ------------------------------------------------------------------------------------------------

def _full_inputs(heads, kv_heads, head_dim, layout, shape, weights, dtype, seed=0) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=gen) * scale).to(dtype)

    lead = (sum(shape),) if layout == "packed" else tuple(shape)
    inputs = dict(q=randn(*lead, heads, head_dim), k=randn(*lead, kv_heads, head_dim),
                  v=randn(*lead, kv_heads, head_dim), dout=randn(*lead, heads, head_dim))
    if layout == "packed":
        inputs["cu_seqlens"] = torch.tensor((0, *shape)).cumsum(0).to(torch.int32)
    if weights:
        scale = head_dim ** -0.5
        inputs.update(W_k=randn(kv_heads, head_dim, head_dim, scale=scale),
                      W_v=randn(kv_heads, head_dim, head_dim, scale=scale),
                      W_gate=randn(heads, 3, head_dim, scale=scale))
    return inputs


def _check_equal_to_one_process(group, case, chunks: int = 1, layout: str = "contiguous") -> None:
    from nsa.distributed import nsa_context_parallel, shard_sequence, unshard_sequence

    inputs = _full_inputs(*case)
    seq_dim = 0 if "cu_seqlens" in inputs else 1
    names = [n for n in ("q", "k", "v", *WEIGHTS) if n in inputs]
    cu_seqlens = inputs.get("cu_seqlens")

    expected, expected_grads = _one_process_result(group, inputs, names)
    world = torch.distributed.get_world_size(_process_group(group))
    sliced = inputs["k"].shape[-2] == world or chunks > 1
    if sliced:
        # The CPU fallback's matmuls take another kernel (another summation order) when they
        # see a single KV head, so nsa() on one KV head differs from nsa() on several in the
        # last bit, in one process too. Heads mode is then bitwise equal to one process running
        # nsa() per KV head, and within float rounding of the all-heads call. Pipelined, each
        # chunk is such a slice.
        nearly, nearly_grads = expected, expected_grads
        expected, expected_grads = _one_process_result(group, inputs, names,
                                                       head_groups=world * chunks)

    def shard(x, name):
        return shard_sequence(x, group, seq_dim=seq_dim, layout=layout, name=name)

    local = {n: (shard(inputs[n], n) if n in ("q", "k", "v") else inputs[n]).clone()
             .requires_grad_() for n in names}
    out = nsa_context_parallel(local["q"], local["k"], local["v"], group=group,
                               cu_seqlens=cu_seqlens, overlap_chunks=chunks, layout=layout,
                               **{n: local[n] for n in WEIGHTS if n in local}, **OPTIONS)
    grads = dict(zip(names, torch.autograd.grad(out, [local[n] for n in names],
                                                shard(inputs["dout"], "dout"))))

    inference = None
    if chunks > 1:  # the pipelined forward without autograd keeps no graph, same numbers
        with torch.no_grad():
            inference = nsa_context_parallel(local["q"], local["k"], local["v"], group=group,
                                             cu_seqlens=cu_seqlens, overlap_chunks=chunks,
                                             layout=layout,
                                             **{n: local[n] for n in WEIGHTS if n in local},
                                             **OPTIONS)

    # Every collective first, the asserts after: a rank failing an assert must not leave the
    # others waiting in a collective it skipped.
    gathered = unshard_sequence(out, group, seq_dim=seq_dim, layout=layout)
    weight_sums = {name: _sum_over_ranks(grads[name], group) for name in WEIGHTS if name in grads}

    assert torch.equal(out, shard(expected, "out")), "output shard differs from one process"
    if inference is not None:
        assert not inference.requires_grad and torch.equal(inference, out)
    assert torch.equal(gathered, expected), "unshard_sequence(out) differs from one process"
    for name in ("q", "k", "v"):
        assert torch.equal(grads[name], shard(expected_grads[name], name)), f"d{name} differs"
    for name, total in weight_sums.items():
        assert torch.equal(total, expected_grads[name]), f"sum over ranks of d{name} differs"
    if sliced:
        tolerance = 1e-6 if inputs["q"].dtype == torch.float32 else 1e-2
        assert _rel_err(gathered, nearly) < tolerance
        for name in ("q", "k", "v"):
            assert _rel_err(grads[name], shard(nearly_grads[name], name)) < tolerance, name
        for name, total in weight_sums.items():
            assert _rel_err(total, nearly_grads[name]) < tolerance, name


def _check_sequence_mode(group, case, mode: str, layout: str = "contiguous") -> None:
    """Sequence mode against one process: output, dq, dk, dv shards and the weight gradients
    summed over the ranks, within float32 rounding."""
    from nsa.distributed import nsa_context_parallel, shard_sequence, unshard_sequence

    inputs = _full_inputs(*case)
    seq_dim = 0 if "cu_seqlens" in inputs else 1
    names = [n for n in ("q", "k", "v", *WEIGHTS) if n in inputs]
    expected, expected_grads = _one_process_result(group, inputs, names)

    def shard(x, name):
        return shard_sequence(x, group, seq_dim=seq_dim, layout=layout, name=name)

    local = {n: (shard(inputs[n], n) if n in ("q", "k", "v") else inputs[n]).clone()
             .requires_grad_() for n in names}
    out = nsa_context_parallel(local["q"], local["k"], local["v"], group=group,
                               cu_seqlens=inputs.get("cu_seqlens"), mode=mode, layout=layout,
                               **{n: local[n] for n in WEIGHTS if n in local}, **OPTIONS)
    grads = dict(zip(names, torch.autograd.grad(out, [local[n] for n in names],
                                                shard(inputs["dout"], "dout"))))
    gathered = unshard_sequence(out, group, seq_dim=seq_dim, layout=layout)
    weight_sums = {name: _sum_over_ranks(grads[name], group) for name in WEIGHTS if name in grads}
    assert _rel_err(gathered, expected) < 1e-6, "output differs from one process"
    for name in ("q", "k", "v"):
        assert _rel_err(grads[name], shard(expected_grads[name], name)) < 1e-6, f"d{name}"
    for name, total in weight_sums.items():
        assert _rel_err(total, expected_grads[name]) < 1e-6, f"sum over ranks of d{name}"


def _check_reduce_scatter_fallback(group) -> None:
    """Sequence mode's gather of K/V: its backward on a backend without reduce-scatter
    (all-reduce, keep this rank's rows) gives the reduce-scatter's bits, zigzag padded."""
    from dataclasses import replace

    from nsa.distributed import resolve_group
    from nsa.distributed.sequence_mode import _GatherSequence, _RankRows

    context = resolve_group(group)
    gen = torch.Generator().manual_seed(context.rank)
    shard = torch.randn(2, 64, 2, 4, generator=gen)  # (B, N/W, Hkv, D), N = 128
    grad = torch.randn(2 * 128, 2, 4, generator=gen)  # this rank's partial of the whole's
    rows = _RankRows(segments=(), bounds=(0, 128, 256), entries=2, length=128, layout="zigzag")
    results = []
    for backend in ("gloo", "a backend without reduce-scatter"):
        leaf = shard.clone().requires_grad_()
        whole = _GatherSequence.apply(replace(context, backend=backend), leaf, rows)
        results.append(torch.autograd.grad(whole, leaf, grad)[0])
    assert torch.equal(*results)


def _rel_err(actual, expected) -> float:
    expected = expected.double()
    return float((actual.double() - expected).norm() / expected.norm())


def _sum_over_ranks(partial, group):
    """The partials added in rank order (all-gathered, so the order is ours, not the backend's)."""
    process_group = _process_group(group)
    partials = [torch.empty_like(partial)
                for _ in range(torch.distributed.get_world_size(process_group))]
    torch.distributed.all_gather(partials, partial, group=process_group)
    total = partials[0]
    for other in partials[1:]:
        total = total + other
    return total


def _one_process_result(group, inputs, names, head_groups: int = 1):
    """nsa() on the full inputs in one process: computed on the group's first rank and
    broadcast (exact), so the W processes sharing the CPU compute it once, not W times.
    head_groups > 1: one nsa() call per slice of Hkv / head_groups KV heads (and their q heads),
    joined along the heads, weight gradients added (each slice's is zero elsewhere)."""
    import torch.distributed as dist
    shapes = {"out": inputs["q"]} | {n: inputs[n] for n in names}
    results = {n: torch.empty_like(x) for n, x in shapes.items()}
    first = dist.get_global_rank(_process_group(group), 0)
    if dist.get_rank() == first:
        results = _sliced_nsa(inputs, names, head_groups)
    for name in shapes:
        dist.broadcast(results[name], src=first, group=_process_group(group))
    return results["out"], {n: results[n] for n in names}


def _sliced_nsa(inputs, names, head_groups: int) -> dict:
    from nsa import nsa
    leaves = {n: inputs[n].clone().requires_grad_() for n in names}
    heads, kv_heads = inputs["q"].shape[-2], inputs["k"].shape[-2]
    outs = []
    for part in range(head_groups):
        qs = slice(part * heads // head_groups, (part + 1) * heads // head_groups)
        ks = slice(part * kv_heads // head_groups, (part + 1) * kv_heads // head_groups)
        sliced = {"q": leaves["q"][..., qs, :], "k": leaves["k"][..., ks, :],
                  "v": leaves["v"][..., ks, :], "W_k": leaves.get("W_k"),
                  "W_v": leaves.get("W_v"), "W_gate": leaves.get("W_gate")}
        sliced = {n: (None if x is None else x[qs] if n == "W_gate" else x[ks]
                      if n in WEIGHTS else x) for n, x in sliced.items()}
        outs.append(nsa(sliced["q"], sliced["k"], sliced["v"],
                        cu_seqlens=inputs.get("cu_seqlens"),
                        **{n: sliced[n] for n in WEIGHTS}, **OPTIONS))
    out = torch.cat(outs, dim=-2)
    grads = torch.autograd.grad(out, [leaves[n] for n in names], inputs["dout"])
    return {"out": out.detach()} | dict(zip(names, grads))


def _process_group(group):
    return group[0].get_group(group[1]) if isinstance(group, tuple) else group


def _bad_call(group, name, rank, world) -> None:
    """Make this rank's part of bad input `name` and call nsa_context_parallel with it."""
    from nsa.distributed import nsa_context_parallel, shard_sequence

    kv_heads = 2 if "dividing_kv_heads" in name else 4
    lengths = (20, 50, 37, 21)
    inputs = _full_inputs(16, kv_heads, 16, "packed", lengths, True, torch.float32, seed=3)
    q, k, v = (shard_sequence(inputs[n], group, name=n) for n in ("q", "k", "v"))
    kwargs = dict(group=group, cu_seqlens=inputs["cu_seqlens"], **OPTIONS,
                  **{n: inputs[n] for n in WEIGHTS})
    last = rank == world - 1
    if name == "sequence_mode_noncausal":
        kwargs.update(mode="sequence", causal=False)
    elif name == "heads_with_world_not_dividing_kv_heads":
        kwargs["mode"] = "heads"
    elif name == "mode_unknown" and last:
        kwargs["mode"] = "ring"
    elif name == "unequal_shards" and last:
        q, k, v = q[:-8], k[:-8], v[:-8]
    elif name == "cu_seqlens_disagree" and last:
        kwargs["cu_seqlens"] = torch.tensor((0, 20, 70, 108, 128), dtype=torch.int32)
    elif name == "local_cu_seqlens_instead_of_global":  # every rank makes the same mistake
        kwargs["cu_seqlens"] = torch.tensor((0, 20, q.shape[0]), dtype=torch.int32)
    elif name == "k_on_another_device_on_one_rank" and last:
        k = torch.empty(k.shape, device="meta")
    elif name == "options_disagree" and last:
        kwargs["window_size"] = 64
    elif name == "requires_grad_disagrees" and last:
        q = q.clone().requires_grad_()
    elif name == "overlap_chunks_not_dividing" and last:  # 2 KV heads a rank: 3 chunks cannot
        kwargs["overlap_chunks"] = 3
    elif name == "overlap_chunks_disagree" and last:
        kwargs["overlap_chunks"] = 2
    elif name == "layout_unknown" and last:
        kwargs["layout"] = "ring"
    elif name == "layout_disagrees":
        kwargs["layout"] = "zigzag" if last else "contiguous"
    elif name == "zigzag_odd_shard":  # 2 ranks x 65 tokens: 4 chunks do not split 130
        q, k, v = (inputs[n][:65] for n in ("q", "k", "v"))
        kwargs.update(layout="zigzag",
                      cu_seqlens=torch.tensor((0, 20, 130), dtype=torch.int32))
    elif name == "sequence_zigzag_chunk_too_short":  # 32 tokens a chunk, 64 needed
        kwargs.update(mode="sequence", layout="zigzag")
    nsa_context_parallel(q, k, v, **kwargs)


def _sum_over_group_still_works(group, world) -> None:
    total = torch.ones(1)
    torch.distributed.all_reduce(total, group=group)
    assert total.item() == world


def _worker(rank: int, world: int, store_path: str, results) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    checks: list[tuple[str, str | None]] = []
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        group = dist.group.WORLD
        for name, case in EQUALITY_CASES[world].items():
            checks.append((f"equal:{name}", _outcome(_check_equal_to_one_process, group, case)))
        for name, (case, chunks) in PIPELINED_CASES[world].items():
            checks.append((f"pipelined:{name}",
                           _outcome(_check_equal_to_one_process, group, case, chunks)))
        for name, (case, mode) in SEQUENCE_CASES[world].items():
            checks.append((f"sequence:{name}",
                           _outcome(_check_sequence_mode, group, case, mode)))
        for name, (case, mode, chunks) in ZIGZAG_CASES[world].items():
            check = (_check_equal_to_one_process, group, case, chunks, "zigzag") \
                if mode == "heads" else (_check_sequence_mode, group, case, mode, "zigzag")
            checks.append((f"zigzag:{name}", _outcome(*check)))
        if world == 2:
            checks.append(("reduce_scatter_fallback",
                           _outcome(_check_reduce_scatter_fallback, group)))
        for name, phrase in BAD_INPUT_CASES[world].items():
            checks.append((f"bad:{name}", _raised(lambda: _bad_call(group, name, rank, world),
                                                  phrase)))
            _sum_over_group_still_works(group, world)
        checks.append(("mesh_dimension", _outcome(_check_mesh_dimension, world)))
        checks.append(("nsa_keyword", _outcome(_check_nsa_keyword, group)))
        if world == 2:
            for name, (layout, kv_heads) in LANGUAGE_MODEL_CASES.items():
                checks.append((f"language_model:{name}",
                               _outcome(_check_language_model, group, layout, kv_heads)))
            checks.append(("language_model_bad_layout", _raised(
                lambda: _language_model_loss(group, "contiguous", 2, model_layout="ring"),
                "context_parallel_layout")))
            _sum_over_group_still_works(group, world)
        if world == 4:
            checks.append(("fsdp2_data_by_context",
                           _outcome(_check_fsdp2_data_by_context, world)))
        dist.destroy_process_group()
    except Exception:  # reported, so the parent fails with this rank's traceback
        checks.append(("worker", traceback.format_exc()))
    results.put((rank, checks))


def _check_language_model(group, layout: str, kv_heads: int) -> None:
    """CausalLM(context_parallel_group=, context_parallel_layout=): on token shards with the
    batch's cu_seqlens, the ranks' losses average to the one-process loss, their gradients
    averaged to its gradients (documents cross the shard and chunk bounds; the rotary positions
    continue across them; the labels, shifted on the whole batch, shard like the tokens)."""
    import torch.distributed as dist

    runs = [_language_model_loss(None, layout, kv_heads),
            _language_model_loss(group, layout, kv_heads)]
    world = dist.get_world_size(group)
    for grad in (runs[1][0], *runs[1][1].values()):
        dist.all_reduce(grad, group=group)
        grad /= world
    (one_loss, one_grads), (cp_loss, cp_grads) = runs
    torch.testing.assert_close(cp_loss, one_loss, rtol=1e-5, atol=1e-6)
    for name, grad in one_grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(cp_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def _language_model_loss(group, layout: str, kv_heads: int, model_layout: str | None = None):
    """The tiny LM's loss and gradients on one packed batch of 192 tokens: the whole batch
    (group None), or this rank's shard of it in `layout` (told to the model as model_layout,
    if given: a bad one must raise)."""
    from dataclasses import replace

    from nsa.distributed import shard_sequence
    from nsa.models.lm import MODEL_PRESETS, CausalLM

    config = replace(MODEL_PRESETS["tiny"], num_kv_heads=kv_heads, compress_block_size=4,
                     selected_block_size=8, num_selected_blocks=4, window_size=12,
                     test_q_tile=16, test_cmp_kv_block=4)
    lengths = (50, 100, 42)
    ids = torch.randint(0, 256, (sum(lengths),), generator=torch.Generator().manual_seed(4))
    labels = ids.roll(-1).masked_fill(torch.tensor(lengths).cumsum(0)[:, None].eq(
        torch.arange(1, sum(lengths) + 1)).any(0), -100)  # no target across a document's end
    cu = torch.tensor((0, *lengths)).cumsum(0).to(torch.int32)
    model = CausalLM(config, seed=0)
    if group is None:
        loss = model(ids, labels=labels, cu_seqlens=cu, host_cu_seqlens=tuple(cu.tolist()))
    else:
        loss = model(shard_sequence(ids, group, layout=layout),
                     labels=shard_sequence(labels, group, layout=layout), cu_seqlens=cu,
                     host_cu_seqlens=tuple(cu.tolist()), context_parallel_group=group,
                     context_parallel_layout=model_layout or layout)
    loss.backward()
    return loss.detach().clone(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _check_fsdp2_data_by_context(world) -> None:
    """FSDP2 over a (dp=2, cp=W/2) mesh: each data row trains its own batch, its context ranks
    shard that batch's tokens (CausalLM(context_parallel_group=(mesh, "cp"))), and fully_shard
    over the flattened mesh reduces the gradients; they equal one process's gradient of the
    mean of the data rows' mean losses (W_k, W_v, W_gate included: the context ranks' partials
    are completed by that same reduction)."""
    from dataclasses import replace

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from nsa.distributed import shard_sequence
    from nsa.models.lm import MODEL_PRESETS, CausalLM

    config = replace(MODEL_PRESETS["tiny"], compress_block_size=4, selected_block_size=8,
                     num_selected_blocks=4, window_size=12, test_q_tile=16, test_cmp_kv_block=4)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "cp"))
    batches = []
    for row, lengths in enumerate(((50, 100, 42), (70, 30, 92))):  # 192 tokens each
        ids = torch.randint(0, 256, (sum(lengths),),
                            generator=torch.Generator().manual_seed(10 + row))
        ends = torch.tensor(lengths).cumsum(0)[:, None].eq(torch.arange(1, sum(lengths) + 1))
        labels = ids.roll(-1).masked_fill(ends.any(0), -100)
        cu = torch.tensor((0, *lengths)).cumsum(0).to(torch.int32)
        batches.append((ids, labels, cu, tuple(cu.tolist())))

    reference = CausalLM(config, seed=0)
    loss = sum(reference(ids, labels=labels, cu_seqlens=cu, host_cu_seqlens=bounds)
               for ids, labels, cu, bounds in batches) / len(batches)
    loss.backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}

    model = CausalLM(config, seed=0)
    fully_shard(model, mesh=mesh["dp", "cp"]._flatten("dp_cp"))
    ids, labels, cu, bounds = batches[mesh.get_local_rank("dp")]
    cp = (mesh, "cp")
    model(shard_sequence(ids, cp), labels=shard_sequence(labels, cp), cu_seqlens=cu,
          host_cu_seqlens=bounds, context_parallel_group=cp).backward()
    got = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    dist.barrier()
    for name, grad in expected.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def _check_nsa_keyword(group) -> None:
    """nsa(..., context_parallel_group=group) is nsa_context_parallel: the same bits, forward
    and backward, with recompute and the layout passed through."""
    from nsa import nsa
    from nsa.distributed import nsa_context_parallel, shard_sequence

    inputs = _full_inputs(16, 4, 16, "packed", (50, 150, 56), True, torch.float32, seed=3)
    results = []
    for call in (lambda q, k, v, **kw: nsa(q, k, v, context_parallel_group=group,
                                           context_parallel_layout="zigzag", **kw),
                 lambda q, k, v, **kw: nsa_context_parallel(q, k, v, group=group,
                                                            layout="zigzag", **kw)):
        local = {n: shard_sequence(inputs[n], group, layout="zigzag", name=n).clone()
                 .requires_grad_() for n in ("q", "k", "v")}
        out = call(local["q"], local["k"], local["v"], cu_seqlens=inputs["cu_seqlens"],
                   W_gate=inputs["W_gate"], recompute=True, **OPTIONS)
        grads = torch.autograd.grad(out, list(local.values()), shard_sequence(
            inputs["dout"], group, layout="zigzag", name="dout"))
        results.append((out, *grads))
    for a, b in zip(*results):
        assert torch.equal(a, b), "nsa(context_parallel_group=) differs from nsa_context_parallel"


def _check_mesh_dimension(world) -> None:
    """(mesh, dim) on a 2-D (data x context) mesh: each context row computes its own copy."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "cp"))
    _check_equal_to_one_process((mesh, "cp"), (16, 4, 16, "packed", (50, 150, 56), True,
                                                torch.float32))


def _outcome(check, *args) -> str | None:
    try:
        check(*args)
    except Exception:
        return traceback.format_exc()
    return None


def _raised(call, phrase: str) -> str | None:
    try:
        call()
    except ValueError as error:
        return None if phrase in str(error) else f"ValueError without {phrase!r}: {error}"
    except Exception:
        return "expected a ValueError, got:\n" + traceback.format_exc()
    return "no error was raised"


# ------------------------------------------------------------------------------------------------
# The parent: one spawn per world size
# ------------------------------------------------------------------------------------------------

_REPORTS: dict[int, dict[str, list[str | None]]] = {}


def _run_world(world: int, tmp_dir) -> dict[str, list[str | None]]:
    if world in _REPORTS:
        return _REPORTS[world]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    store = os.path.join(str(tmp_dir), f"store_{world}")
    processes = [context.Process(target=_worker, args=(rank, world, store, results), daemon=True)
                 for rank in range(world)]
    for process in processes:
        process.start()
    reports: dict[int, list] = {}
    try:
        for _ in range(world):
            rank, checks = results.get(timeout=JOIN_TIMEOUT_S)
            reports[rank] = checks
    except Exception:
        pass
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join()
    missing = sorted(set(range(world)) - set(reports))
    assert not missing, f"ranks {missing} of {world} hung or died without a report"
    by_check: dict[str, list[str | None]] = {}
    for rank in range(world):
        for name, outcome in reports[rank]:
            by_check.setdefault(name, [None] * world)[rank] = outcome
    _REPORTS[world] = by_check
    return by_check


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return lambda world: _run_world(world, tmp_path_factory.mktemp(f"world{world}"))


def _assert_passed(report: dict, name: str) -> None:
    assert "worker" not in report, report["worker"]
    assert name in report, f"check {name} did not run"
    failures = {rank: outcome for rank, outcome in enumerate(report[name]) if outcome}
    assert not failures, "\n".join(f"rank {r}: {o}" for r, o in failures.items())


def _world_and_name(cases_by_world: dict) -> list[tuple[int, str]]:
    """(world size, case name) of every case of a {world size: {name: ...}} table."""
    return [(world, name) for world, cases in cases_by_world.items() for name in cases]


@pytest.mark.parametrize("world, name", _world_and_name(EQUALITY_CASES))
def test_heads_mode_equals_one_process(reports, world, name):
    _assert_passed(reports(world), f"equal:{name}")


@pytest.mark.parametrize("world, name", _world_and_name(PIPELINED_CASES))
def test_pipelined_heads_mode_equals_one_process(reports, world, name):
    _assert_passed(reports(world), f"pipelined:{name}")


@pytest.mark.parametrize("world, name", _world_and_name(SEQUENCE_CASES))
def test_sequence_mode_equals_one_process(reports, world, name):
    _assert_passed(reports(world), f"sequence:{name}")


@pytest.mark.parametrize("world, name", _world_and_name(ZIGZAG_CASES))
def test_zigzag_layout_equals_one_process(reports, world, name):
    _assert_passed(reports(world), f"zigzag:{name}")


@pytest.mark.parametrize("world, name", _world_and_name(BAD_INPUT_CASES))
def test_bad_input_raises_on_every_rank(reports, world, name):
    _assert_passed(reports(world), f"bad:{name}")


@pytest.mark.parametrize("world", [2, 4])
def test_one_dimension_of_a_device_mesh(reports, world):
    _assert_passed(reports(world), "mesh_dimension")


@pytest.mark.parametrize("world", [2, 4])
def test_nsa_takes_the_context_parallel_group(reports, world):
    _assert_passed(reports(world), "nsa_keyword")


def test_sequence_mode_gradient_without_reduce_scatter(reports):
    _assert_passed(reports(2), "reduce_scatter_fallback")


@pytest.mark.parametrize("name", LANGUAGE_MODEL_CASES)
def test_language_model_across_ranks_equals_one_process(reports, name):
    _assert_passed(reports(2), f"language_model:{name}")


def test_language_model_refuses_an_unknown_layout_on_every_rank(reports):
    _assert_passed(reports(2), "language_model_bad_layout")


def test_fsdp2_over_data_and_context_equals_one_process(reports):
    _assert_passed(reports(4), "fsdp2_data_by_context")


# ------------------------------------------------------------------------------------------------
# In this process: what needs no group
# ------------------------------------------------------------------------------------------------

def test_shard_sequence_refuses_a_length_the_world_does_not_divide():
    from nsa.distributed import shard_sequence
    with pytest.raises(ValueError, match=r"q has 10 tokens.*multiple of 4"):
        shard_sequence(torch.randn(10, 2, 4), rank=0, world_size=4, name="q")


def test_shard_sequence_splits_contiguously_along_seq_dim():
    from nsa.distributed import shard_bounds, shard_sequence
    x = torch.randn(2, 12, 3, 4)
    parts = [shard_sequence(x, rank=r, world_size=3, seq_dim=1) for r in range(3)]
    assert torch.equal(torch.cat(parts, dim=1), x)
    assert shard_bounds(12, rank=2, world_size=3) == (8, 12)


def test_zigzag_shards_round_trip_with_their_indices():
    """Rank r of W holds chunks r and 2W-1-r of 2W; the shards in rank order come back to the
    natural order, and shard_indices names each shard row's place in the whole."""
    from nsa.distributed import shard_indices, shard_ranges, shard_sequence
    from nsa.distributed.sharding import to_natural_order, to_rank_order

    world, total = 3, 24  # chunks of 4
    x = torch.randn(2, total, 3)
    shards = [shard_sequence(x, rank=r, world_size=world, seq_dim=1, layout="zigzag")
              for r in range(world)]
    assert shard_ranges(total, rank=1, world_size=world, layout="zigzag") == ((4, 8), (16, 20))
    for rank, part in enumerate(shards):
        indices = shard_indices(total, rank=rank, world_size=world, layout="zigzag")
        assert torch.equal(part, x[:, indices])
    by_rank = torch.cat(shards, dim=1)
    assert torch.equal(to_natural_order(by_rank, 1, world, "zigzag"), x)
    assert torch.equal(to_rank_order(x, 1, world, "zigzag"), by_rank)
    all_indices = torch.cat([shard_indices(total, rank=r, world_size=world, layout="zigzag")
                             for r in range(world)])
    assert sorted(all_indices.tolist()) == list(range(total))
    # contiguous: the rank order is the natural order, returned as it is
    assert to_natural_order(x, 1, world, "contiguous") is x


def test_zigzag_sharding_names_the_tensor_the_multiple_and_the_layout():
    from nsa.distributed import shard_sequence
    with pytest.raises(ValueError, match=r"q has 12 tokens.*multiple of 8.*layout='zigzag'"):
        shard_sequence(torch.randn(12, 2), rank=0, world_size=4, layout="zigzag", name="q")
    with pytest.raises(ValueError, match=r"layout must be one of \('contiguous', 'zigzag'\)"):
        shard_sequence(torch.randn(12, 2), rank=0, world_size=4, layout="ring")


@pytest.mark.parametrize("backend, expected", [
    ("nccl", True), ("gloo", True), ("cpu:gloo,cuda:nccl", True), ("mpi", False),
    ("cpu:gloo,cuda:custom", False)])
def test_reduce_scatter_where_the_backend_has_it(backend, expected):
    from nsa.distributed.groups import backend_reduces_scatter
    assert backend_reduces_scatter(backend) is expected


@pytest.mark.parametrize("mode, world, kv_heads, expected", [
    ("auto", 4, 8, "heads"), ("heads", 2, 2, "heads"), ("auto", 1, 1, "heads"),
    ("auto", 4, 2, "sequence"), ("sequence", 2, 8, "sequence")])
def test_choose_mode_picks_heads_when_the_world_divides_kv_heads(mode, world, kv_heads, expected):
    from nsa.distributed import choose_mode
    assert choose_mode(mode, world, kv_heads) == expected


def test_choose_mode_names_the_argument_and_the_values():
    from nsa.distributed import choose_mode
    with pytest.raises(ValueError, match=r"mode='heads'.*world size 4, Hkv 2.*mode='sequence'"):
        choose_mode("heads", 4, 2)
    with pytest.raises(ValueError, match="mode must be one of"):
        choose_mode("ring", 4, 2)
