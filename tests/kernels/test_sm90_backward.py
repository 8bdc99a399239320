"""The sm90 CuTe DSL backward against the torch fallback in float32, on the GPU.

Each case runs the forward and backward through the differentiable entry points
(`kernels.flash_attn_func` / `flash_attn_varlen_func`) in bf16 or fp16, and the fallback
(`kernels.fallback`, itself checked against a float64 oracle on the CPU in
test_fallback*.py) on the same values upcast to float32. It asserts, per case:

- `kernels.which_backend(..., backward=True) == "sm90"` (and the forward's too): a silent
  fallback to torch fails the test instead of passing it with the fallback's own numbers;
- dq, dk and dv are finite, with relative error ||x - ref|| / ||ref|| < 2e-2;
- rows that see no key (lse = -inf) get dq = 0 exactly, and keys no row sees (never-listed KV
  blocks, compressed tokens no row reaches) get dk = dv = 0 exactly.

`deterministic=True` must give bit-identical gradients over three runs (dense causal GQA,
varlen, block-sparse, compressed) and match the reference as well. Block-sparse backward
launched 50 times in a row must stay finite (a race FA4's SM90 kernel once had).

Each case compiles a kernel variant, so features are grouped (about 80 cases, not a full
product): dense (causal/non-causal x GQA groups 1/4/8/16, padded and varlen), compressed
(compress_factor 16/64 with rows that see nothing), windows, block-sparse (KV blocks of 64 and
128 keys, 128-row q tiles, lists per query head or per KV head, empty tiles and never-listed
blocks), varlen (1 to 16 sequences of odd lengths, some shorter than 64 and 128, one empty),
each in bf16 and fp16 at head dims 64 and 128. `test_case_list_covers_every_feature` (CPU)
keeps the list honest.

    python -m pytest -q tests/kernels/test_sm90_backward.py            # on an sm_90 GPU
"""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import kernels
from kernels.fallback import attention_backward_fallback, attention_forward_fallback
from gpu_marks import record_backward_launches, requires_sm90

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
HEAD_DIMS = (64, 128)
HEADS = 16  # query heads; the KV heads are HEADS // group
GRAD_TOLERANCE = 2e-2
Q_TILE = 128  # the kernels' block-sparse q tile


# ----------------------------------------------------------------------------------------------
# The cases
# ----------------------------------------------------------------------------------------------

# Sequence lengths (query rows; keys are length // compress_factor).
PADDED_LENGTHS = (1031, 1031)  # B = 2 sequences of an odd length, in the padded layout
VARLEN_16 = (1000, 1, 7, 63, 65, 129, 300, 77, 255, 513, 31, 128, 999, 3, 64, 1537)
VARLEN_ONE = (777,)
# A sequence past kernels.sm90.spec.FUSED_DQ_MIN_KEYS: the dispatcher fuses dQ (plain causal
# or full attention) beside short ones.
VARLEN_LONG = (4500, 1, 300)
VARLEN_WITH_EMPTY = (5, 0, 129, 63, 0, 1000, 1)  # zero-length sequences among short ones
# compress_factor 16/64: sequences shorter than the factor have no compressed key at all, and
# rows < cf - 1 of every sequence see nothing.
COMPRESSED_LENGTHS = (2049, 63, 1000, 130, 64, 1)
WINDOW_LENGTHS = (1500, 63, 700, 129, 1, 2047)
SPARSE_LENGTHS = (1500, 63, 700, 129, 1, 300)
SPARSE_COMPRESSED_LENGTHS = (9000, 2000, 64)  # 140, 31 and 1 compressed keys at cf 64


@dataclasses.dataclass(frozen=True)
class Case:
    """One backward call: layout, mask and lists, dtype and head dim."""

    dtype: str  # "bf16" or "fp16"
    dim: int
    lengths: tuple[int, ...]
    group: int  # query heads per KV head
    causal: bool = True
    compress_factor: int = 1
    window: tuple[int, int] = (-1, -1)
    kv_block: int | None = None  # block-sparse KV block size; None: dense
    lists_per: str = "kv"  # block-sparse lists per query head ("q") or per KV head ("kv")
    padded: bool = False  # (B, N, H, D) layout; lengths are then B equal lengths
    deterministic: bool = False

    @property
    def id(self) -> str:
        mask = "causal" if self.causal else "noncausal"
        if self.compress_factor > 1:
            mask += f"-cf{self.compress_factor}"
        if self.window != (-1, -1):
            mask += f"-window{self.window[0]}_{self.window[1]}"
        if self.kv_block is not None:
            mask += f"-sparse{self.kv_block}-lists_per_{self.lists_per}"
        if self.padded:
            layout = f"padded{len(self.lengths)}x{self.lengths[0]}"
        else:
            layout = f"varlen{len(self.lengths)}" + ("-empty" if 0 in self.lengths else "")
        suffix = "-deterministic" if self.deterministic else ""
        return f"{self.dtype}-d{self.dim}-{mask}-g{self.group}-{layout}{suffix}"

    @property
    def key_lengths(self) -> tuple[int, ...]:
        return tuple(n // self.compress_factor for n in self.lengths)


def _dense_cases() -> list[Case]:
    """Causal and non-causal, GQA groups 1 and 16 padded, 4 and 8 over 16 varlen sequences."""
    cases = []
    for dtype, dim, causal in itertools.product(DTYPES, HEAD_DIMS, (True, False)):
        cases += [Case(dtype, dim, PADDED_LENGTHS, 1, causal, padded=True),
                  Case(dtype, dim, VARLEN_16, 4, causal),
                  Case(dtype, dim, PADDED_LENGTHS, 16, causal, padded=True)]
        if causal:
            cases.append(Case(dtype, dim, VARLEN_16, 8, causal))
    cases += [Case("bf16", 128, VARLEN_LONG, 4, causal=True),
              Case("fp16", 64, VARLEN_LONG, 8, causal=False)]
    return cases


def _varlen_cases() -> list[Case]:
    cases = []
    for dtype, dim in itertools.product(DTYPES, HEAD_DIMS):
        cases += [Case(dtype, dim, VARLEN_ONE, 8, causal=False),
                  Case(dtype, dim, VARLEN_WITH_EMPTY, 4, causal=True)]
    return cases


def _compressed_cases() -> list[Case]:
    cases = [Case(dtype, dim, COMPRESSED_LENGTHS, 4, compress_factor=cf)
             for dtype, dim, cf in itertools.product(DTYPES, HEAD_DIMS, (16, 64))]
    cases.append(Case("bf16", 128, (4096, 4096), 16, compress_factor=64, padded=True))
    return cases


def _window_cases() -> list[Case]:
    windows = [(True, (100, 0)), (True, (512, 0)), (False, (64, 32))]
    return [Case(dtype, dim, WINDOW_LENGTHS, 4 if causal else 8, causal, window=window)
            for dtype, dim, (causal, window) in itertools.product(DTYPES, HEAD_DIMS, windows)]


def _block_sparse_cases() -> list[Case]:
    cases = [Case(dtype, dim, SPARSE_LENGTHS, 4, kv_block=kv_block, lists_per=lists_per)
             for dtype, dim, kv_block, lists_per in itertools.product(
                 DTYPES, HEAD_DIMS, (64, 128), ("q", "kv"))]
    cases += [
        Case("bf16", 128, SPARSE_LENGTHS, 8, causal=False, kv_block=128),
        Case("fp16", 64, SPARSE_LENGTHS, 1, causal=False, kv_block=64, lists_per="q"),
        # NSA's sparse compressed branch: lists over blocks of 128 compressed tokens.
        Case("bf16", 128, SPARSE_COMPRESSED_LENGTHS, 16, compress_factor=64, kv_block=128),
        Case("fp16", 64, SPARSE_COMPRESSED_LENGTHS, 4, compress_factor=64, kv_block=128),
        Case("bf16", 64, PADDED_LENGTHS, 4, kv_block=64, padded=True),
    ]
    return cases


def _deterministic_cases() -> list[Case]:
    """Long enough that many KV tiles add into each dQ tile (where atomics reorder sums)."""
    return [
        Case("bf16", 128, (4096, 4096), 8, padded=True, deterministic=True),
        Case("bf16", 128, VARLEN_16, 4, deterministic=True),
        Case("bf16", 128, SPARSE_LENGTHS + (4000,), 4, kv_block=64, deterministic=True),
        Case("fp16", 64, SPARSE_LENGTHS + (4000,), 16, kv_block=128, lists_per="q",
             deterministic=True),
        Case("bf16", 128, (8192, 1000, 63), 4, compress_factor=64, deterministic=True),
    ]


GRADIENT_CASES = (_dense_cases() + _varlen_cases() + _compressed_cases() + _window_cases()
                  + _block_sparse_cases())
DETERMINISTIC_CASES = _deterministic_cases()


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------

def _cu_seqlens(lengths, device) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return cu.to(device)


def block_sparse_lists(case: Case, seed: int, device):
    """Random compact lists for `case` (forward layout, 128-row q tiles) with the awkward parts
    guaranteed: every third q tile of a sequence lists nothing for any head (its rows see no
    key), KV blocks b with b % 4 == 2 are listed by no tile (their keys get no gradient), the
    rest are listed with probability 1/2 each. Under causal masking a block is "full" only when
    every key of it is at or before the tile's first row (what a causal builder guarantees),
    else "mask", so some listed mask blocks lie wholly in the future (the kernel must mask them
    out); non-causal, full or mask at random."""
    from sparsity import BlockSparseTensors

    generator = torch.Generator().manual_seed(seed)
    heads = HEADS if case.lists_per == "q" else HEADS // case.group
    block, cf = case.kv_block, case.compress_factor
    full_lists, mask_lists, offsets = [], [], [0]
    for nq, nk in zip(case.lengths, case.key_lengths):
        tiles, blocks = -(-nq // Q_TILE), -(-nk // block)
        offsets.append(offsets[-1] + tiles)
        for tile in range(tiles):
            full_row, mask_row = [], []
            for _ in range(heads):
                chosen = torch.rand(blocks, generator=generator) < 0.5
                chosen[2::4] = False  # never listed
                if tile % 3 == 1:
                    chosen[:] = False  # an empty tile
                chosen = chosen.nonzero().flatten()
                if case.causal:
                    last_key_position = (chosen + 1) * block * cf - 1
                    as_full = last_key_position <= tile * Q_TILE
                else:
                    as_full = torch.rand(len(chosen), generator=generator) < 0.5
                full_row.append(chosen[as_full].tolist())
                mask_row.append(chosen[~as_full].tolist())
            full_lists.append(full_row)
            mask_lists.append(mask_row)

    def pack(lists):
        width = max([len(entries) for row in lists for entries in row] + [1])
        count = torch.zeros(len(lists), heads, dtype=torch.int32)
        index = torch.full((len(lists), heads, width), -1, dtype=torch.int32)
        for r, row in enumerate(lists):
            for h, entries in enumerate(row):
                count[r, h] = len(entries)
                index[r, h, :len(entries)] = torch.tensor(entries, dtype=torch.int32)
        return count.to(device), index.to(device)

    full_count, full_index = pack(full_lists)
    mask_count, mask_index = pack(mask_lists)
    return BlockSparseTensors(
        full_count=full_count, full_index=full_index, mask_count=mask_count,
        mask_index=mask_index, row_block_size=Q_TILE, col_block_size=block,
        row_block_offsets=torch.tensor(offsets, dtype=torch.int32, device=device))


def make_inputs(case: Case, seed: int = 0, device="cuda"):
    """(q, k, v, dout, kwargs): random normal tensors (never zeros) in the case's dtype and
    layout, and the keyword arguments of attention_forward/backward (softmax_scale included)."""
    generator = torch.Generator().manual_seed(seed)
    dtype = DTYPES[case.dtype]
    heads_kv = HEADS // case.group

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    kwargs = dict(softmax_scale=case.dim ** -0.5, causal=case.causal,
                  compress_factor=case.compress_factor, window_size=case.window)
    if case.padded:
        batch, n = len(case.lengths), case.lengths[0]
        assert all(length == n for length in case.lengths), "padded lengths must be equal"
        q = randn(batch, n, HEADS, case.dim)
        k = randn(batch, n // case.compress_factor, heads_kv, case.dim)
        v = randn(batch, n // case.compress_factor, heads_kv, case.dim)
        dout = randn(batch, n, HEADS, case.dim)
    else:
        q = randn(sum(case.lengths), HEADS, case.dim)
        k = randn(sum(case.key_lengths), heads_kv, case.dim)
        v = randn(sum(case.key_lengths), heads_kv, case.dim)
        dout = randn(sum(case.lengths), HEADS, case.dim)
        kwargs.update(cu_seqlens_q=_cu_seqlens(case.lengths, device),
                      cu_seqlens_k=_cu_seqlens(case.key_lengths, device),
                      max_seqlen_q=max(case.lengths), max_seqlen_k=max(case.key_lengths))
    if case.kv_block is not None:
        kwargs["block_sparse"] = block_sparse_lists(case, seed + 1, device)
    return q, k, v, dout, kwargs


# ----------------------------------------------------------------------------------------------
# Running and checking
# ----------------------------------------------------------------------------------------------

def assert_backends_are_sm90(q, k, v, kwargs, deterministic=False):
    forward = kernels.which_backend(q, k, v, **kwargs)
    assert forward == "sm90", f"forward: {forward}"
    # deterministic is passed only when set, so the default path is asked exactly as a
    # training step that never mentions it asks.
    extra = {"deterministic": True} if deterministic else {}
    backward = kernels.which_backend(q, k, v, backward=True, **extra, **kwargs)
    assert backward == "sm90", f"backward: {backward}"


def kernel_gradients(q, k, v, dout, kwargs, deterministic=False):
    """(dq, dk, dv) through the differentiable entry point, as a training step gets them."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    options = {name: value for name, value in kwargs.items() if not name.startswith(
        ("cu_seqlens", "max_seqlen"))}
    if deterministic:
        options["deterministic"] = True
    if "cu_seqlens_q" in kwargs:
        out = kernels.flash_attn_varlen_func(
            *leaves, kwargs["cu_seqlens_q"], kwargs["cu_seqlens_k"], kwargs["max_seqlen_q"],
            kwargs["max_seqlen_k"], **options)
    else:
        out = kernels.flash_attn_func(*leaves, **options)
    return torch.autograd.grad(out, leaves, dout)


def reference_gradients(q, k, v, dout, kwargs):
    """(dq, dk, dv, lse) of the fallback in float32 on the same (upcast) values."""
    q32, k32, v32, dout32 = (t.float() for t in (q, k, v, dout))
    out, lse = attention_forward_fallback(q32, k32, v32, **kwargs)
    grads = attention_backward_fallback(dout32, q32, k32, v32, out, lse, **kwargs)
    return (*grads, lse)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return float((actual.double() - expected).norm() / expected.norm().clamp_min(1e-30))


def _rows_first(x: torch.Tensor) -> torch.Tensor:
    """(rows, heads, D) of a padded (B, N, heads, D) or packed (T, heads, D) tensor."""
    return x.flatten(0, 1) if x.dim() == 4 else x


def assert_gradients_match(grads, reference, case: Case):
    dq, dk, dv = grads
    ref_dq, ref_dk, ref_dv, ref_lse = reference
    for name, grad, ref in (("dq", dq, ref_dq), ("dk", dk, ref_dk), ("dv", dv, ref_dv)):
        assert grad.shape == ref.shape and grad.dtype == DTYPES[case.dtype], name
        assert torch.isfinite(grad).all(), f"{name} has NaN/inf"
        err = rel_err(grad, ref)
        assert err < GRAD_TOLERANCE, f"{name}: relative error {err:.3e}"

    # Rows that see no key: lse = -inf in the reference, exactly zero dq in ours.
    lse_rows = ref_lse if ref_lse.dim() == 2 else ref_lse.permute(1, 0, 2).flatten(1)  # (H, T)
    empty_rows = (lse_rows == float("-inf")).transpose(0, 1)  # (T, H)
    if empty_rows.any():
        assert _rows_first(dq)[empty_rows].abs().max() == 0, "dq of rows that see nothing"
    # Keys no row sees: exactly zero in the float32 reference (nothing was ever added).
    unseen = ((_rows_first(ref_dk) == 0).all(-1) & (_rows_first(ref_dv) == 0).all(-1))
    if unseen.any():
        assert _rows_first(dk)[unseen].abs().max() == 0, "dk of keys no row sees"
        assert _rows_first(dv)[unseen].abs().max() == 0, "dv of keys no row sees"


def check_against_fallback(case: Case):
    """The case's dq/dk/dv through the differentiable entry point (on the sm90 kernels, in
    the case's mode) against the float32 fallback's; returns them and the inputs."""
    inputs = q, k, v, dout, kwargs = make_inputs(case)
    assert_backends_are_sm90(q, k, v, kwargs, deterministic=case.deterministic)
    grads = kernel_gradients(q, k, v, dout, kwargs, deterministic=case.deterministic)
    torch.cuda.synchronize()
    assert_gradients_match(grads, reference_gradients(q, k, v, dout, kwargs), case)
    return grads, inputs


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("case", GRADIENT_CASES, ids=lambda case: case.id)
def test_backward_matches_fallback(case: Case):
    check_against_fallback(case)


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("case", _dense_cases() + _varlen_cases(), ids=lambda case: case.id)
def test_fused_dq_backward_matches_fallback(case: Case, monkeypatch):
    """The dense and varlen cases again with dQ fused into the KV-centric kernel whatever the
    sequence length (the dispatcher fuses it from FUSED_DQ_MIN_KEYS keys on): the writer warp,
    the register-order dQ blocks and their conversion, over GQA 1-16, odd and empty
    sequences, both head dims and dtypes."""
    from kernels.sm90 import spec as sm90_spec

    monkeypatch.setattr(sm90_spec, "FUSED_DQ_MIN_KEYS", 1)
    check_against_fallback(case)


COMPRESSED_CAUSAL_CASES = [case for case in GRADIENT_CASES + DETERMINISTIC_CASES
                     if case.compress_factor != 1 and case.causal and case.kv_block is None]


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("case", COMPRESSED_CAUSAL_CASES, ids=lambda case: case.id)
def test_heads_order_backward_matches_fallback(case: Case, monkeypatch):
    """The compressed causal cases with the KV-centric CTAs launched head by head, the order
    before `BwdSpec.heavy_first` was dispatched (the gradient tests run the dispatched
    heaviest-first order), fast and deterministic: both launch orders stay correct."""
    from kernels.sm90 import spec as sm90_spec

    monkeypatch.setattr(sm90_spec, "HEAVY_FIRST_COMPRESSED_CAUSAL", False)
    check_against_fallback(case)


ALTERNATE_STEPS_CASES = [case for case in GRADIENT_CASES + DETERMINISTIC_CASES
                         if case.kv_block == 64]
DS_TILE_CASES = ALTERNATE_STEPS_CASES  # every 64-key list case
# 128-key lists per query head: the fused dQ in head-major work units, which the dispatcher
# picks for long walks only (the lists here are short; the test lowers the bar).
FUSED_LIST_CASES = [case for case in GRADIENT_CASES
                    if case.kv_block == 128 and case.lists_per == "q"]


# Calls with fewer KV tiles than SMs (split rows): compressed keys and short padded batches.
ROW_BAND_CASES = [case for case in GRADIENT_CASES
                  if case.compress_factor > 1 and case.kv_block is None] + [
    Case("bf16", 128, PADDED_LENGTHS, 4, causal=True, padded=True),
    Case("fp16", 64, PADDED_LENGTHS, 4, causal=False, padded=True),
    # Long enough for the fused dQ (FUSED_DQ_MIN_KEYS), few enough KV tiles for split rows.
    Case("bf16", 128, (4096, 4096), 16, causal=True, padded=True),
    Case("bf16", 64, (4096, 4096), 16, causal=True, padded=True)]


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("ds_tiles", [True, False], ids=["ds-tiles", "dq-recomputes"])
@pytest.mark.parametrize("case", DS_TILE_CASES, ids=lambda case: case.id)
def test_64_key_lists_backward_with_and_without_ds_tiles(case: Case, ds_tiles, monkeypatch):
    """64-key lists' dQ both ways: multiplied from the dS tiles the KV-centric kernel stores
    (`BwdSpec.stores_ds`, dispatched where they fit kernels.sm90.backward's memory share) and
    recomputed by the dQ kernel; each matches the fallback, and the launches say which ran
    (lists per query head and per KV head, odd and one-token sequences, padded, deterministic)."""
    from kernels.sm90 import backward

    monkeypatch.setattr(backward, "DS_TILES", ds_tiles)
    launched = record_backward_launches(monkeypatch)
    check_against_fallback(case)
    assert launched and all(spec.stores_ds == ds_tiles for spec in launched)


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("case", ROW_BAND_CASES, ids=lambda case: case.id)
def test_row_band_backward_matches_fallback(case: Case, monkeypatch):
    """Split rows by bands common to every KV tile, launched band by band
    (`BwdSpec.row_bands`, a tuner variant: compressed keys and short dense calls with the
    two-kernel path, 4096-key dense calls with the fused dQ), including bands that see none of
    a KV tile's keys."""
    from kernels.sm90 import backward
    from kernels.sm90 import spec as sm90_spec

    monkeypatch.setattr(sm90_spec, "ROW_BANDS_FOR_SPLIT_ROWS", True)
    monkeypatch.setattr(backward, "ROW_BAND_BYTES", 1 << 16)  # many bands at these sizes
    launched = record_backward_launches(monkeypatch)
    check_against_fallback(case)
    assert launched and all(spec.row_bands and spec.split_rows for spec in launched)
    if case.lengths[0] >= sm90_spec.FUSED_DQ_MIN_KEYS and case.compress_factor == 1:
        assert all(spec.fuses_dq for spec in launched)


# One long document among many short ones (compressed keys, 8 KV heads): more CTAs than SMs,
# but the long document's would walk most of the work alone.
UNEQUAL_DOCUMENTS = (4100,) + (64, 200, 130, 257) * 5


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,dim", [("bf16", 128), ("fp16", 64)])
def test_unequal_documents_split_rows_and_match_fallback(dtype, dim, monkeypatch):
    """Packed documents of unequal lengths split the long document's rows although the grid
    holds more CTAs than SMs (`balanced_kv_tiles`), and the gradients match the fallback."""
    from kernels.sm90 import backward

    case = Case(dtype, dim, UNEQUAL_DOCUMENTS, 2, causal=True, compress_factor=64)
    assert len(case.lengths) * HEADS // case.group >= 132  # one CTA per KV tile filled the GPU
    launched = record_backward_launches(monkeypatch)
    row_splits = []
    splits = backward._row_splits
    monkeypatch.setattr(backward, "_row_splits",
                        lambda *args: row_splits.append(splits(*args)) or row_splits[-1])
    check_against_fallback(case)
    assert launched and all(spec.split_rows for spec in launched)
    assert row_splits and min(row_splits) > 1


def _planned_call(tensors, dout, host, call):
    """(plan, (lse, row dots), its (dq, dk, dv) alone, cloned) of one planned backward call
    on (q, k, v) = tensors: `call` its keyword arguments (`deterministic` goes to the backward
    alone); host: the host bounds (q's, k's)."""
    from kernels.interface import plan_backward_trusted

    forward = {name: value for name, value in call.items() if name != "deterministic"}
    out, lse = kernels.attention_forward(*tensors, **forward)
    plan = plan_backward_trusted(*tensors, host_cu_seqlens=host, **call)
    row_dots = (dout.float() * out.float()).sum(-1)
    alone = [t.clone() for t in plan.backward(dout, lse, dout_dot_out=row_dots)]
    return plan, (lse, row_dots), alone


def _poison_opened_dq_sums(monkeypatch):
    """`DqSums.open_for_store` filling the sums it opens with NaN, so that a value the opening
    call did not store shows in the result."""
    from kernels.sm90.backward import DqSums

    opened = DqSums.open_for_store

    def poisoned(self, *args):
        sums = opened(self, *args)
        return None if sums is None else sums.fill_(float("nan"))

    monkeypatch.setattr(DqSums, "open_for_store", poisoned)


def _planned_calls(q, k, v, dout, host, calls):
    """(plans, (lse, row dots) per call, each call's (dq, dk, dv) alone) of `_planned_call`s
    on the same q, k, v, dout and host bounds."""
    planned = [_planned_call((q, k, v), dout, host, call) for call in calls]
    return tuple(list(column) for column in zip(*planned))


@requires_sm90
@pytest.mark.gpu
def test_dq_sums_shared_by_two_fused_calls(monkeypatch):
    """Two planned backward calls on the same q that both fuse dQ (a causal call and a causal
    window, 4500 keys: nsa()'s window and compressed branches share sums this way) add into
    one `DqSums`, converted once into a running dq: the result equals the running dq plus the
    two calls' own dq (within a bf16 rounding of the sum), nothing is written into the
    running dq before `finish`, and dk, dv are those of the calls alone."""
    from kernels.sm90.backward import DqSums

    case = Case("bf16", 128, VARLEN_LONG, 4)
    q, k, v, dout, kwargs = make_inputs(case)
    lengths = tuple(itertools.accumulate(case.lengths, initial=0))
    host = (lengths, lengths)
    calls = [dict(kwargs), dict(kwargs, window_size=(512, 0))]
    launched = record_backward_launches(monkeypatch)
    plans, statistics, alone = _planned_calls(q, k, v, dout, host, calls)
    assert len(launched) == 2 and all(spec.fuses_dq for spec in launched), launched
    dq_total = alone[0][0].float() + alone[1][0].float()
    # A running dq of the increments' size, so that its bf16 rounding does not hide them.
    running = (torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
               * dq_total.std().item()).to(q)
    sums = DqSums()
    shared = running.clone()
    for plan, (lse, row_dots), (_, dk_alone, dv_alone) in zip(plans, statistics, alone):
        dq, dk, dv = plan.backward(dout, lse, dout_dot_out=row_dots, dq_accumulator=shared,
                                   dq_sums=sums)
        assert dq is shared and torch.equal(shared, running), "dq converted before finish"
        assert torch.equal(dk, dk_alone) and torch.equal(dv, dv_alone)
    assert sums.finish(into=shared) is shared
    torch.cuda.synchronize()
    assert rel_err(shared, running.float() + dq_total) < 1e-2
    assert rel_err(shared.float() - running.float(), dq_total) < 2e-2


@requires_sm90
@pytest.mark.gpu
def test_dq_kernel_consumes_the_fused_calls_dq_sums(monkeypatch):
    """Two fused-dQ calls add into a consuming `DqSums`; a third call on the dQ kernel (the
    deterministic path) takes the sums into the dQ it adds into the running dq
    (`DqSpec.sums_block_cols`), so `finish` has nothing left: the running dq ends as itself
    plus the three calls' own dq (one bf16 rounding), and dk, dv are those of the calls
    alone."""
    from kernels.sm90.backward import DqSums

    case = Case("bf16", 128, VARLEN_LONG, 4)
    q, k, v, dout, kwargs = make_inputs(case)
    lengths = tuple(itertools.accumulate(case.lengths, initial=0))
    host = (lengths, lengths)
    calls = [dict(kwargs), dict(kwargs, window_size=(512, 0)),
             dict(kwargs, window_size=(256, 0), deterministic=True)]
    launched = record_backward_launches(monkeypatch)
    plans, statistics, alone = _planned_calls(q, k, v, dout, host, calls)
    assert [spec.fuses_dq for spec in launched] == [True, True, False], launched
    dq_total = sum(dq.float() for dq, _, _ in alone)
    running = (torch.randn(q.shape, generator=torch.Generator().manual_seed(6))
               * dq_total.std().item()).to(q)
    sums = DqSums(consumes=True)
    shared = running.clone()
    for plan, (lse, row_dots), (_, dk_alone, dv_alone) in zip(plans, statistics, alone):
        dq, dk, dv = plan.backward(dout, lse, dout_dot_out=row_dots, dq_accumulator=shared,
                                   dq_sums=sums)
        assert dq is shared
        assert torch.equal(dk, dk_alone) and torch.equal(dv, dv_alone)
    converted = shared.clone()
    assert sums.finish(into=shared) is shared and torch.equal(shared, converted), \
        "the dQ kernel left sums to convert"
    torch.cuda.synchronize()
    assert rel_err(shared, running.float() + dq_total) < 1e-2
    assert rel_err(shared.float() - running.float(), dq_total) < 2e-2


@requires_sm90
@pytest.mark.gpu
def test_dq_kernel_opens_the_dq_sums_that_fused_calls_add_into(monkeypatch):
    """nsa()'s order with `DqSums.stores_first`: a first call on the dQ kernel (a deterministic
    window: the compressed branch in nsa()) stores its dQ as the sums' first values and
    returns no dq, two fused-dQ calls add into those unzeroed sums, and a last call on the dQ
    kernel consumes them into the dq it writes: that dq equals the four calls' own dq summed
    (within bf16 rounding). The opened sums are filled with NaN first, so a value the first
    call did not store would show."""
    from kernels.sm90.backward import DqSums

    _poison_opened_dq_sums(monkeypatch)
    case = Case("bf16", 128, VARLEN_LONG, 4)
    q, k, v, dout, kwargs = make_inputs(case)
    lengths = tuple(itertools.accumulate(case.lengths, initial=0))
    host = (lengths, lengths)
    calls = [dict(kwargs, window_size=(256, 0), deterministic=True), dict(kwargs),
             dict(kwargs, window_size=(512, 0)),
             dict(kwargs, window_size=(128, 0), deterministic=True)]
    launched = record_backward_launches(monkeypatch)
    plans, statistics, alone = _planned_calls(q, k, v, dout, host, calls)
    fused = [spec.fuses_dq for spec in launched]
    assert fused == [False, True, True, False], launched
    assert [plan.fuses_dq for plan in plans] == fused
    dq_total = sum(dq.float() for dq, _, _ in alone)
    sums = DqSums(consumes=True, stores_first=True)
    results = []
    for plan, (lse, row_dots), (_, dk_alone, dv_alone) in zip(plans, statistics, alone):
        dq, dk, dv = plan.backward(dout, lse, dout_dot_out=row_dots, dq_sums=sums)
        assert torch.equal(dk, dk_alone) and torch.equal(dv, dv_alone)
        results.append(dq)
    assert results[:3] == [None, None, None], "dq written before the consuming call"
    assert sums.finish() is None, "the consuming call left sums to convert"
    torch.cuda.synchronize()
    assert torch.isfinite(results[3]).all()
    assert rel_err(results[3], dq_total) < 1e-2


@requires_sm90
@pytest.mark.gpu
def test_compressed_fused_dq_opens_the_sums_the_window_adds_into(monkeypatch):
    """nsa()'s compressed branch on documents up to 8K tokens: each query tile meets the one KV
    tile of its sequence's compressed keys, so its backward stores its fused dQ as the sums'
    first values (`BwdSpec.dq_stores`, no dQ kernel, nothing zeroed; sums filled with NaN so a
    value it did not store would show); a window call on the original keys adds into them and a
    last call on the dQ kernel consumes them: that dq equals the three calls' own dq (each
    alone on its usual path: the compressed one on the dQ kernel) summed. The sequences hold 70,
    4, 1 and 31 compressed keys; a sequence without one (under 64 tokens) keeps the dQ kernel."""
    from kernels.sm90.backward import DqSums

    _poison_opened_dq_sums(monkeypatch)

    def run(lengths):
        generator = torch.Generator().manual_seed(11)
        rows = tuple(itertools.accumulate(lengths, initial=0))
        keys = tuple(itertools.accumulate((n // 64 for n in lengths), initial=0))

        def randn(count, heads):
            return torch.randn(count, heads, 128, generator=generator).to("cuda", torch.bfloat16)

        q, dout = randn(rows[-1], 8), randn(rows[-1], 8)
        k, v = randn(rows[-1], 2), randn(rows[-1], 2)
        k_cmp, v_cmp = randn(keys[-1], 2), randn(keys[-1], 2)
        cu_rows, cu_keys = (torch.tensor(b, dtype=torch.int32, device="cuda")
                            for b in (rows, keys))
        on_rows = dict(cu_seqlens_q=cu_rows, cu_seqlens_k=cu_rows, max_seqlen_q=max(lengths),
                       max_seqlen_k=max(lengths), causal=True)
        most_keys = max(b - a for a, b in zip(keys, keys[1:]))
        calls = [((q, k_cmp, v_cmp), (rows, keys),
                  dict(on_rows, cu_seqlens_k=cu_keys, max_seqlen_k=most_keys,
                       compress_factor=64)),
                 ((q, k, v), (rows, rows), dict(on_rows, window_size=(512, 0))),
                 ((q, k, v), (rows, rows), dict(on_rows, window_size=(128, 0),
                                                deterministic=True))]
        launched = record_backward_launches(monkeypatch)
        planned = [_planned_call(tensors, dout, host, call) for tensors, host, call in calls]
        assert not any(spec.dq_stores for spec in launched), launched
        launched.clear()
        sums = DqSums(consumes=True, stores_first=True)
        results = []
        for plan, (lse, row_dots), (_, dk_alone, dv_alone) in planned:
            dq, dk, dv = plan.backward(dout, lse, dout_dot_out=row_dots, dq_sums=sums)
            torch.testing.assert_close(dk, dk_alone, rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(dv, dv_alone, rtol=2e-2, atol=2e-2)
            results.append(dq)
        torch.cuda.synchronize()
        assert results[:2] == [None, None] and sums.finish() is None
        assert torch.isfinite(results[2]).all()
        assert rel_err(results[2], sum(alone[0].float() for _, _, alone in planned)) < 1e-2
        return launched[0]

    first = run((4500, 300, 64, 2000))
    assert first.dq_stores and first.fuses_dq, first
    first = run((4500, 300, 63, 2000))  # a sequence without compressed keys
    assert first.dq_separate and not first.dq_stores, first


COMPRESSED_CASES = [case for case in GRADIENT_CASES
                    if case.compress_factor > 1 and case.kv_block is None]


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("case", COMPRESSED_CASES, ids=lambda case: case.id)
def test_compressed_fused_row_band_backward_matches_fallback(case: Case, monkeypatch):
    """Compressed causal keys with the fused dQ in row bands (dispatched from
    ROW_BANDS_FUSED_MIN_KEYS keys on; the test lowers the bar and the band size so these
    lengths take many bands); windowed and non-causal compressed calls keep their path."""
    from kernels.sm90 import backward
    from kernels.sm90 import spec as sm90_spec

    monkeypatch.setattr(sm90_spec, "ROW_BANDS_FUSED_MIN_KEYS", 1)
    monkeypatch.setattr(backward, "ROW_BAND_BYTES", 1 << 16)
    launched = record_backward_launches(monkeypatch)
    check_against_fallback(case)
    fused_bands = case.causal and case.window == (-1, -1) and not case.deterministic
    assert launched and all(spec.row_bands == spec.fuses_dq == fused_bands
                            for spec in launched), launched


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [None, 2], ids=["whole-lists", "chunks-of-2"])
@pytest.mark.parametrize("case", FUSED_LIST_CASES, ids=lambda case: case.id)
def test_fused_dq_list_units_backward_matches_fallback(case: Case, chunk, monkeypatch):
    """128-key lists per query head run as work units taken head by head, each unit one
    head's whole list (or chunks of 2 entries, so lists span several units), with dQ fused
    into the KV-centric kernel (`fuses_listed_dq`): the varlen lists with empty tiles and
    unlisted blocks of the block-sparse cases. The dispatched spec and units are checked."""
    from kernels.sm90 import backward
    from kernels.sm90 import spec as sm90_spec

    monkeypatch.setattr(sm90_spec, "FUSED_DQ_MIN_LIST_WIDTH", {64: 1, 128: 1})
    if chunk is not None:
        monkeypatch.setattr(backward, "list_chunk", lambda csr, spec: chunk)
    launched = record_backward_launches(monkeypatch)
    unit_calls, work_units = [], backward.work_units
    monkeypatch.setattr(backward, "work_units", lambda csr, chunk_, head_major=False: (
        unit_calls.append((chunk_, head_major)), work_units(csr, chunk_, head_major))[1])
    check_against_fallback(case)
    assert launched and all(spec.split_lists and spec.fuses_dq for spec in launched)
    assert unit_calls and all(head_major for _, head_major in unit_calls)
    if chunk is not None:
        assert all(chunk_ == chunk for chunk_, _ in unit_calls)


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("case", ALTERNATE_STEPS_CASES, ids=lambda case: case.id)
def test_alternate_steps_backward_matches_fallback(case: Case, monkeypatch):
    """The 64-key list cases with two consumer warpgroups taking alternate query steps of one
    64-key tile (`BwdSpec.alternate_steps`: the pipelines' stages handed to one warpgroup per
    step, dK/dV summed through smem), fast and deterministic; the deterministic ones also
    bit for bit over repeated calls."""
    from kernels.sm90 import spec as sm90_spec

    monkeypatch.setattr(sm90_spec, "ALTERNATE_STEPS_AT_64_KEYS", True)
    assert sm90_spec.choose_backward_spec(
        dtype="bfloat16", head_dim=case.dim, causal=case.causal, window_size=case.window,
        sparse_block_size=64, deterministic=case.deterministic).alternate_steps
    grads, (q, k, v, dout, kwargs) = check_against_fallback(case)
    if case.deterministic:
        again = kernel_gradients(q, k, v, dout, kwargs, deterministic=True)
        assert all(torch.equal(a, b) for a, b in zip(grads, again))


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("case", DETERMINISTIC_CASES, ids=lambda case: case.id)
def test_deterministic_backward_is_bitwise_stable(case: Case):
    """deterministic=True: attention_backward on one forward's (out, lse) three times, bit for
    bit, and the autograd path (which reruns the deterministic forward) gives the same bits."""
    q, k, v, dout, kwargs = make_inputs(case, seed=3)
    assert_backends_are_sm90(q, k, v, kwargs, deterministic=True)
    out, lse = kernels.attention_forward(q, k, v, **kwargs)
    runs = [kernels.attention_backward(dout, q, k, v, out, lse, deterministic=True, **kwargs)
            for _ in range(3)]
    torch.cuda.synchronize()
    for run in runs[1:]:
        for name, first, again in zip(("dq", "dk", "dv"), runs[0], run):
            assert torch.equal(first, again), f"{name} differs between deterministic runs"
    through_autograd = kernel_gradients(q, k, v, dout, kwargs, deterministic=True)
    for name, first, again in zip(("dq", "dk", "dv"), runs[0], through_autograd):
        assert torch.equal(first, again), f"{name}: flash_attn_*(deterministic=True) differs"
    assert_gradients_match(runs[0], reference_gradients(q, k, v, dout, kwargs), case)


# Block-sparse cases already compiled above, launched many times: FA4's SM90 block-sparse
# backward once read lse/dPsum before its preprocess had written them (NaN in 0.1-1% of launches).
REPEATED_LAUNCH_CASES = [case for case in GRADIENT_CASES if case.kv_block is not None
                         and case.causal and case.dtype == "bf16" and case.lists_per == "kv"
                         and case.compress_factor == 1 and not case.padded]
LAUNCHES = 50


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("case", REPEATED_LAUNCH_CASES, ids=lambda case: case.id)
def test_block_sparse_backward_stays_finite_over_many_launches(case: Case):
    q, k, v, dout, kwargs = make_inputs(case, seed=4)
    out, lse = kernels.attention_forward(q, k, v, **kwargs)
    first = kernels.attention_backward(dout, q, k, v, out, lse, **kwargs)
    for launch in range(LAUNCHES):
        grads = kernels.attention_backward(dout, q, k, v, out, lse, **kwargs)
        for name, grad, reference in zip(("dq", "dk", "dv"), grads, first):
            assert torch.isfinite(grad).all(), f"{name} has NaN/inf at launch {launch}"
            # Atomic adds may reorder dQ's sums: equal up to rounding, not bit for bit.
            assert rel_err(grad, reference) < 1e-3, f"{name} moved at launch {launch}"


# ----------------------------------------------------------------------------------------------
# CPU: the case list itself
# ----------------------------------------------------------------------------------------------

def test_case_list_covers_every_feature():
    """Every feature the backward must support appears in at least one case, the ids are unique
    and readable, and the list stays small enough to compile in one GPU run."""
    cases = GRADIENT_CASES + DETERMINISTIC_CASES
    ids = [case.id for case in cases]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    assert len(cases) < 120, f"{len(cases)} cases: each compiles a kernel variant"

    def some(predicate, cases=GRADIENT_CASES):
        return any(predicate(case) for case in cases)

    for dtype, dim in itertools.product(DTYPES, HEAD_DIMS):
        same = lambda case: case.dtype == dtype and case.dim == dim  # noqa: E731
        assert some(lambda c: same(c) and c.causal and c.kv_block is None
                    and c.compress_factor == 1 and c.window == (-1, -1)), (dtype, dim)
        assert some(lambda c: same(c) and not c.causal and c.kv_block is None), (dtype, dim)
        for cf in (16, 64):
            assert some(lambda c: same(c) and c.compress_factor == cf), (dtype, dim, cf)
        for window in ((100, 0), (512, 0)):
            assert some(lambda c: same(c) and c.causal and c.window == window), (dtype, dim)
        assert some(lambda c: same(c) and not c.causal and c.window == (64, 32)), (dtype, dim)
        for kv_block, lists_per in itertools.product((64, 128), ("q", "kv")):
            assert some(lambda c: same(c) and c.kv_block == kv_block
                        and c.lists_per == lists_per), (dtype, dim, kv_block, lists_per)
    for group in (1, 4, 8, 16):
        assert some(lambda c: c.group == group and c.causal and c.kv_block is None), group
        assert some(lambda c: c.group == group and c.kv_block is not None), group
    assert some(lambda c: c.padded) and some(lambda c: not c.padded)
    assert some(lambda c: not c.padded and len(c.lengths) == 1)
    assert some(lambda c: not c.padded and len(c.lengths) >= 16)
    assert some(lambda c: not c.padded and 0 in c.lengths)
    varlen_lengths = {n for c in GRADIENT_CASES if not c.padded for n in c.lengths}
    assert {1, 7, 63, 65, 129, 300, 1000} <= varlen_lengths
    assert any(n < 64 for n in varlen_lengths) and any(64 < n < 128 for n in varlen_lengths)
    # Rows that see nothing: compress_factor 64 with causal rows < 63; empty sparse tiles.
    assert some(lambda c: c.compress_factor == 64 and c.causal)
    assert some(lambda c: c.kv_block is not None and c.compress_factor > 1)
    # Deterministic: dense causal GQA, varlen, block-sparse, compressed.
    det = DETERMINISTIC_CASES
    assert all(c.deterministic for c in det)
    assert some(lambda c: c.padded and c.causal and c.group > 1 and c.kv_block is None, det)
    assert some(lambda c: not c.padded and len(c.lengths) >= 16, det)
    assert some(lambda c: c.kv_block == 64, det) and some(lambda c: c.kv_block == 128, det)
    assert some(lambda c: c.compress_factor == 64, det)
    # The fused dQ by dispatch: plain causal and full attention past FUSED_DQ_MIN_KEYS keys.
    from kernels.sm90.spec import FUSED_DQ_MIN_KEYS

    for causal in (True, False):
        assert some(lambda c: c.causal == causal and c.kv_block is None and c.compress_factor == 1
                    and c.window == (-1, -1) and max(c.lengths) >= FUSED_DQ_MIN_KEYS), causal
    assert {case.dim for case in REPEATED_LAUNCH_CASES} == set(HEAD_DIMS)
    assert {case.kv_block for case in REPEATED_LAUNCH_CASES} == {64, 128}
    assert ids[0] == "bf16-d64-causal-g1-padded2x1031"
    assert "bf16-d128-causal-g4-varlen16" in ids


@pytest.mark.parametrize("case", [c for c in GRADIENT_CASES + DETERMINISTIC_CASES
                                  if c.kv_block is not None], ids=lambda case: case.id)
def test_block_sparse_lists_have_empty_tiles_and_unlisted_blocks(case: Case):
    """The random lists (built on the CPU here) are valid, and have what the GPU test relies on:
    q tiles listing nothing and KV blocks no tile lists."""
    from sparsity import validate_block_sparse

    bs = block_sparse_lists(case, seed=1, device="cpu")
    validate_block_sparse(bs, cu_seqlens_q=_cu_seqlens(case.lengths, "cpu"),
                          cu_seqlens_k=_cu_seqlens(case.key_lengths, "cpu"),
                          num_heads=HEADS, num_kv_heads=HEADS // case.group)
    listed = bs.full_count + bs.mask_count
    assert (listed.sum(dim=1) == 0).any(), "no empty q tile"
    assert (listed > 0).any(), "nothing listed at all"
    assert int(bs.mask_count.sum()) > 0
    if case.causal and case.compress_factor == 1:
        assert int(bs.full_count.sum()) > 0
    never = max(-(-nk // case.kv_block) for nk in case.key_lengths) > 2
    if never:
        for index, count in ((bs.full_index, bs.full_count), (bs.mask_index, bs.mask_count)):
            slots = torch.arange(index.shape[-1]) < count[..., None]
            assert not (index[slots] % 4 == 2).any(), "a never-listed block was listed"
