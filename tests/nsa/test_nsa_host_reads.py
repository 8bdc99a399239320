"""How often one nsa() forward and backward reads the device, counted on the CPU.

On a GPU every device -> host read stalls the host until the device catches up. nsa() reads
cu_seqlens once while checking its arguments and hands the values on: the compressed bounds, the
number of compressed tokens and the checks of all nine attention calls (three in the forward,
three recomputed forwards and three backwards) use them instead of reading the tensors again, via
the kernels' trusted entry points. The reads left are selection's and the list builders'.

Before this change (varlen, three sequences): 32 reads in the forward and 49 in the backward with
the dense compressed branch, 59 and 89 with the sparse one. Each kernel call re-read cu_seqlens
and re-checked the block-sparse lists' contents (21 reads per list), and the number of compressed
tokens was read in the forward and again in the backward. After: 6 and 0 (dense), 11 and 0
(sparse); the padded layout has no cu_seqlens to check, one read fewer. Since then
selection takes the host bounds nsa() read and the selected branch's lists are built from them
(`build_selected_block_sparse_trusted`), and so are the sparse compressed branch's
(`build_compressed_block_sparse_trusted`), each padded to host bounds: 1 read in the forward
(nsa()'s check of cu_seqlens), 0 in the backward, dense or sparse compressed branch; with
host_cu_seqlens given (or a padded batch) none at all, as CUDA-graph capture needs.
"""

import pytest
import torch

import kernels
import nsa.branches as branches_module
from kernels.interface import (add_into_accumulators, attention_backward_trusted,
                               attention_forward_trusted)
from nsa import NSAFunction, nsa
from nsa.validation import validate_nsa_call
from nsa_testing import SMALL, cu_seqlens_of, random_inputs
from op_counting import OpCounter
from sparsity import build_selected_block_sparse

LENGTHS = [40, 17, 29]

# nsa()'s check of cu_seqlens (1); selection and both list builders take nsa()'s host bounds (0).
NSA_CHECKS, SELECTION = 1, 0
SELECTED_LISTS = 0  # built from nsa()'s host bounds (build_selected_block_sparse_trusted)
COMPRESSED_LISTS = 0  # built from nsa()'s host bounds (build_compressed_block_sparse_trusted)


def _inputs(layout: str, seed: int = 0) -> dict:
    inputs = random_inputs(LENGTHS, heads=4, kv_heads=2, head_dim=8, seed=seed,
                           dtype=torch.float32)
    if layout == "padded":
        # The same 86 rows as a (B, N, H, D) batch of two sequences.
        inputs = {name: x.reshape(2, 43, *x.shape[1:]) if name in ("q", "k", "v") else x
                  for name, x in inputs.items() if name != "cu_seqlens"}
    for name in ("q", "k", "v", "W_k", "W_v", "W_gate"):
        inputs[name].requires_grad_()
    return inputs


def _options(compressed: str) -> dict:
    return dict(SMALL, num_cmp_selected_blocks=1 if compressed == "sparse" else None)


@pytest.mark.parametrize("layout", ["varlen", "padded"])
@pytest.mark.parametrize("compressed", ["dense", "sparse"])
def test_forward_reads_only_for_checks_selection_and_lists_backward_never(layout, compressed,
                                                                          monkeypatch):
    inputs = _inputs(layout)
    counter = OpCounter(monkeypatch)
    with counter:
        out = nsa(**inputs, **_options(compressed))
    expected = (NSA_CHECKS if layout == "varlen" else 0) + SELECTION + SELECTED_LISTS + (
        COMPRESSED_LISTS if compressed == "sparse" else 0)
    assert counter.reads == expected  # varlen: 1 (nsa()'s check), padded: 0

    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    counter = OpCounter(monkeypatch)
    with counter:
        out.backward(dout)
    assert counter.reads == 0
    assert all(inputs[name].grad.abs().sum() > 0 for name in ("q", "k", "v", "W_k", "W_gate"))


@pytest.mark.parametrize("layout", ["varlen", "padded"])
@pytest.mark.parametrize("compressed", ["dense", "sparse"])
def test_trusted_calls_equal_fully_checked_calls(layout, compressed, monkeypatch):
    """Every kernel call nsa() makes passes the public, fully checking entry points too (its
    trusted values are true) and gives the same bits."""
    def run():
        inputs = _inputs(layout, seed=3)
        # recompute=True: the recomputing forwards are kernel calls too
        out = nsa(**inputs, **_options(compressed), recompute=True)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(4)))
        return [out] + [inputs[n].grad for n in ("q", "k", "v", "W_k", "W_v", "W_gate")]

    trusted = run()
    checked_calls = []

    def checked(public):
        def call(*args, host_cu_seqlens, dout_dot_out=None, lse_gate=None, dq_accumulator=None,
                 dkv_accumulators=None, **kwargs):
            assert dout_dot_out is None and lse_gate is None  # only where the sm90 kernel runs
            checked_calls.append(host_cu_seqlens)
            result = public(*args, **kwargs)
            if dq_accumulator is None and dkv_accumulators is None:
                return result
            # The public entry has no accumulators: add as the trusted one does.
            return add_into_accumulators(result, dq_accumulator, dkv_accumulators)
        return call

    monkeypatch.setattr(branches_module, "attention_forward_trusted",
                        checked(kernels.attention_forward))
    monkeypatch.setattr(branches_module, "attention_backward_trusted",
                        checked(kernels.attention_backward))
    fully_checked = run()
    assert len(checked_calls) == 9  # 3 forwards, 3 recomputed forwards, 3 backwards
    for a, b in zip(trusted, fully_checked):
        assert torch.equal(a, b)


def test_nsa_function_without_host_bounds_reads_them_once(monkeypatch):
    inputs = _inputs("varlen", seed=5)
    config, sequences = validate_nsa_call(
        inputs["q"], inputs["k"], inputs["v"], cu_seqlens=inputs["cu_seqlens"], max_seqlen=None,
        W_k=inputs["W_k"], W_v=inputs["W_v"], W_gate=inputs["W_gate"], causal=True,
        softmax_scale=None, num_cmp_selected_blocks=None, q_tile=SMALL["_q_tile"],
        cmp_kv_block=SMALL["_cmp_kv_block"], compress_block_size=SMALL["compress_block_size"],
        selected_block_size=SMALL["selected_block_size"],
        num_selected_blocks=SMALL["num_selected_blocks"], window_size=SMALL["window_size"])
    assert sequences.cu_seqlens == tuple(inputs["cu_seqlens"].tolist())
    assert sequences.compressed_cu_seqlens(4) == (0, 10, 14, 21)
    counter = OpCounter(monkeypatch)
    with counter:
        out = NSAFunction.apply(*(inputs[n] for n in ("q", "k", "v", "W_k", "W_v", "W_gate")),
                                inputs["cu_seqlens"], sequences.max_seqlen, config)
    assert counter.reads == SELECTION + SELECTED_LISTS + 1
    assert torch.equal(out, nsa(**inputs, **SMALL))


# --- the kernels' trusted entry points check what needs no device read, like the public ones ---

def _attention_call(seed: int = 6) -> dict:
    gen = torch.Generator().manual_seed(seed)
    lengths, total = [5, 0, 11], 16
    return dict(q=torch.randn(total, 4, 8, generator=gen), k=torch.randn(total, 2, 8, generator=gen),
                v=torch.randn(total, 2, 8, generator=gen), cu_seqlens_q=cu_seqlens_of(lengths),
                cu_seqlens_k=cu_seqlens_of(lengths), causal=True)


def _host(call: dict) -> tuple:
    return tuple(call["cu_seqlens_q"].tolist()), tuple(call["cu_seqlens_k"].tolist())


BAD_CALLS = {
    "k dtype": lambda c: c.update(k=c["k"].double()),
    "heads": lambda c: c.update(q=c["q"][:, :3]),
    "cu_seqlens end": lambda c: c.update(cu_seqlens_q=torch.tensor([0, 5, 5, 15],
                                                                   dtype=torch.int32)),
    "cu_seqlens order": lambda c: c.update(cu_seqlens_k=torch.tensor([0, 9, 5, 16],
                                                                     dtype=torch.int32)),
    "cu_seqlens dtype": lambda c: c.update(cu_seqlens_q=c["cu_seqlens_q"].long()),
    "max_seqlen": lambda c: c.update(max_seqlen_q=10),
    "window": lambda c: c.update(window_size=(-2, 0)),
    "list heads": lambda c: c.update(block_sparse=build_selected_block_sparse(
        torch.zeros(3, 3, 1, dtype=torch.int32), cu_seqlens_q=c["cu_seqlens_q"],
        cu_seqlens_k=c["cu_seqlens_k"], q_tile=8, selected_block_size=8, kv_block=8)),
    "list sequences": lambda c: c.update(block_sparse=build_selected_block_sparse(
        torch.zeros(2, 2, 1, dtype=torch.int32), cu_seqlens_q=torch.tensor([0, 16]).int(),
        cu_seqlens_k=torch.tensor([0, 16]).int(), q_tile=8, selected_block_size=8, kv_block=8)),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_trusted_entry_points_raise_the_public_errors(case):
    call = _attention_call()
    BAD_CALLS[case](call)
    with pytest.raises((ValueError, TypeError)) as public:
        kernels.attention_forward(**call)
    with pytest.raises(public.type) as trusted:
        attention_forward_trusted(**call, host_cu_seqlens=_host(call))
    assert str(trusted.value) == str(public.value)


def test_trusted_entry_points_reject_host_bounds_of_another_length():
    call = _attention_call()
    cu_q, cu_k = _host(call)
    with pytest.raises(ValueError, match="host_cu_seqlens must hold the values"):
        attention_forward_trusted(**call, host_cu_seqlens=(cu_q[:-1], cu_k))


def test_trusted_backward_equals_public_backward_without_reads(monkeypatch):
    call = _attention_call(seed=7)
    out, lse = kernels.attention_forward(**call)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(8))
    tensors, host = {name: call.pop(name) for name in ("q", "k", "v")}, _host(call)
    counter = OpCounter(monkeypatch)
    with counter:
        trusted = attention_backward_trusted(dout, *tensors.values(), out, lse,
                                             host_cu_seqlens=host, **call)
    assert counter.reads == 0
    public = kernels.attention_backward(dout, *tensors.values(), out, lse, **call)
    for a, b in zip(trusted, public):
        assert a.abs().sum() > 0 and torch.equal(a, b)


@pytest.mark.parametrize("layout", ["varlen", "padded"])
@pytest.mark.parametrize("compressed", ["dense", "sparse"])
def test_with_host_bounds_nothing_is_read_forward_or_backward(layout, compressed, monkeypatch):
    """With host_cu_seqlens (varlen) or a padded batch: not one device read in the forward or
    the backward, and no tensor made from Python values (a host -> device copy on a GPU), which
    is what CUDA-graph capture needs. The first GPU capture (H100, 2026-11-24) failed on two such
    copies, `x[i] = 1.0` in the gate weights and `key[..., 0] = float` in selection."""
    inputs = _inputs(layout, seed=5)
    host = {}
    if layout == "varlen":
        host = dict(host_cu_seqlens=tuple(inputs["cu_seqlens"].tolist()))
    counter = OpCounter(monkeypatch)
    with counter:
        out = nsa(**inputs, **host, **_options(compressed))
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)))
    assert counter.reads == 0
    assert counter.host_copies == 0
    reference = _inputs(layout, seed=5)
    torch.testing.assert_close(nsa(**reference, **_options(compressed)), out, rtol=0, atol=0)
