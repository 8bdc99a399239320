"""nsa() on an sm_90 GPU, with its branches on the CuTe DSL kernels, against the float64
reference: outputs and every gradient, packed varlen and padded, GQA, default NSA geometry
(compressed blocks of 64, selected blocks of 64, 128-row selection tiles, window 512).

The backward tests assert that every branch's attention backward ran on the sm90 kernel
(`kernels.which_backend(..., backward=True)` for the exact call each branch makes, recorded by
wrapping `Branch.backward`): a silent fallback to torch fails them. `deterministic=True` must
give bit-identical gradients of q, k, v, W_k, W_v and W_gate over three runs.

    python -m pytest -q tests/nsa/test_nsa_gpu.py            # on an sm_90 GPU
"""
import pytest
import torch

import kernels
from nsa import nsa, nsa_reference
from nsa.branches import COMPRESSED, SELECTED, WINDOW, Branch
from nsa_testing import (bf16_reference_inputs, cu_seqlens_of, differentiable, grads_of,
                         random_cuda_inputs, rel_err)
from gpu_marks import record_backward_launches, requires_sm90

pytestmark = pytest.mark.gpu


CASES = [
    # lengths, H, Hkv, D, options
    ([1500, 77, 700], 8, 2, 128, dict()),
    ([2100], 16, 1, 64, dict(num_selected_blocks=8, window_size=256)),
    ([1000, 1030], 4, 4, 128, dict(num_cmp_selected_blocks=2)),
    ([900, 300], 8, 2, 192, dict()),
    ([700], 4, 1, 256, dict(window_size=256)),
]


@requires_sm90
@pytest.mark.parametrize("case", CASES, ids=["gqa4-varlen", "gqa16-d64", "sparse-compressed",
                                             "d192", "d256"])
def test_nsa_on_kernels_matches_reference(case):
    lengths, heads, heads_kv, dim, options = case
    x = random_cuda_inputs(lengths, heads, heads_kv, dim, seed=7)
    cu = x["cu_seqlens"]
    backend = kernels.which_backend(
        x["q"].bfloat16(), x["k"].bfloat16(), x["v"].bfloat16(), cu_seqlens_q=cu,
        cu_seqlens_k=cu, causal=True, window_size=(511, 0))
    assert backend == "sm90", backend
    fast_in = differentiable(x, torch.bfloat16)
    ref_in = bf16_reference_inputs(x)
    out = nsa(**fast_in, max_seqlen=max(lengths), **options)
    ref = nsa_reference(**ref_in, max_seqlen=max(lengths), **options)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert rel_err(out, ref) < 1e-2
    dout = torch.randn(out.shape, device="cuda", dtype=torch.float64)
    grads, ref_grads = grads_of(out, fast_in, dout), grads_of(ref, ref_in, dout)
    for name in grads:
        assert rel_err(grads[name], ref_grads[name]) < 1e-2, name


@requires_sm90
def test_nsa_with_fused_compressed_row_bands_matches_reference(monkeypatch):
    """The compressed branch's backward with the fused dQ in row bands (dispatched from
    ROW_BANDS_FUSED_MIN_KEYS compressed keys on, 32K tokens at the defaults; lowered here),
    adding into nsa()'s running dq and float32 dk, dv."""
    from kernels.sm90 import backward
    from kernels.sm90 import spec as sm90_spec

    monkeypatch.setattr(sm90_spec, "ROW_BANDS_FUSED_MIN_KEYS", 1)
    monkeypatch.setattr(backward, "ROW_BAND_BYTES", 1 << 16)
    launched = record_backward_launches(monkeypatch)
    test_nsa_on_kernels_matches_reference(CASES[0])
    assert any(spec.row_bands and spec.fuses_dq and spec.compressed for spec in launched)


@requires_sm90
def test_nsa_padded_equals_packed_on_kernels():
    torch.manual_seed(3)
    q = torch.randn(2, 1100, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 1100, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    padded = nsa(q, k, v)
    packed = nsa(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                 cu_seqlens=cu_seqlens_of([1100, 1100]).cuda(), max_seqlen=1100)
    assert rel_err(padded.flatten(0, 1), packed) < 1e-3


@requires_sm90
def test_nsa_empty_inputs_on_the_gpu():
    """No rows at all: every stage, the gated sum included, must take its empty path."""
    q = torch.randn(0, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(0, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = nsa(q, k, k, cu_seqlens=cu_seqlens_of([0, 0]).cuda())
    out.sum().backward()
    assert out.shape == (0, 4, 128) and q.grad.shape == q.shape
    padded = nsa(*(torch.randn(0, 5, h, 128, device="cuda", dtype=torch.bfloat16)
                   for h in (4, 2, 2)))
    assert padded.shape == (0, 5, 4, 128)


# ----------------------------------------------------------------------------------------------
# The backward on the kernels
# ----------------------------------------------------------------------------------------------

BRANCH_NAMES = {COMPRESSED: "compressed", SELECTED: "selected", WINDOW: "window"}
# bf16 kernels against a float64 reference; the backward's dS is rounded to bf16 before the
# dQ/dK products (as in every flash attention), so gradients get twice the output's tolerance.
OUT_TOLERANCE, GRAD_TOLERANCE = 1e-2, 2e-2


@pytest.fixture
def branch_backends(monkeypatch) -> dict:
    """Branch name -> kernels.which_backend(backward=True) of the attention backward nsa() runs
    for that branch, asked with exactly the call's arguments (transposed lists and
    deterministic included)."""
    backends = {}
    original = Branch.backward

    def recording_backward(self, dout, q, k, v, out, lse, **options):
        if torch.cuda.is_current_stream_capturing():
            # A captured plan's backward: which_backend reads cu_seqlens back, which a capture
            # refuses (the plan would fall back to eager); its eager warm-up call recorded.
            return original(self, dout, q, k, v, out, lse, **options)
        # dout_dot_out replaces out, lse_gate goes with it, the accumulators and dq_sums
        # receive dq, dk, dv, and plan is the path already chosen: none chooses it,
        # which_backend takes none
        asked = {name: value for name, value in options.items()
                 if value is not None and value is not False
                 and name not in ("dout_dot_out", "lse_gate", "dq_accumulator",
                                  "dkv_accumulators", "plan", "dq_sums")}
        backend = kernels.which_backend(q, k, v, backward=True, **asked, **self.kernel_kwargs)
        # On the kernel, nsa() frees the branch output first and passes rowsum(dO * O) instead
        kept = out is not None or options.get("dout_dot_out") is None
        backends[BRANCH_NAMES[self.index]] = backend + (" (branch output kept)" if kept else "")
        return original(self, dout, q, k, v, out, lse, **options)

    monkeypatch.setattr(Branch, "backward", recording_backward)
    return backends


def _assert_backward_on_kernels(backends: dict, window: bool = True):
    expected = {"compressed", "selected"} | ({"window"} if window else set())
    assert set(backends) == expected, backends
    off_kernel = {name: backend for name, backend in backends.items() if backend != "sm90"}
    assert not off_kernel, f"branch backward not on the sm90 kernel: {off_kernel}"


def _assert_grads_match_reference(grads: dict, x: dict, lengths, dout, **options) -> None:
    """Every gradient in `grads` finite and within GRAD_TOLERANCE of the float64 reference's
    on the same bf16-rounded inputs `x` (nsa()'s keyword arguments, `options` added)."""
    ref_in = bf16_reference_inputs(x)
    ref = nsa_reference(**ref_in, max_seqlen=max(lengths), **options)
    ref_grads = grads_of(ref, ref_in, dout)
    for name, grad in grads.items():
        assert torch.isfinite(grad).all(), f"{name} has NaN/inf"
        err = rel_err(grad, ref_grads[name])
        assert err < GRAD_TOLERANCE, f"{name}: relative error {err:.3e}"


def _random_dout(shape, device, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(device)


BACKWARD_CASES = {
    # lengths (odd, some shorter than a 64-token block or a 128-row tile), H, Hkv, D, options
    "gqa1-varlen": ([1500, 77, 700, 1, 300], 16, 16, 128, dict()),
    "gqa4-varlen": ([1031, 63, 2050, 129], 16, 4, 128, dict()),
    "gqa16-varlen": ([1500, 77, 700, 1, 300], 16, 1, 128, dict(window_size=256)),
    "gqa4-varlen-d64-sparse-compressed": ([1000, 1030, 65], 16, 4, 64,
                                          dict(num_cmp_selected_blocks=2)),
}


@requires_sm90
@pytest.mark.parametrize("case", list(BACKWARD_CASES))
def test_nsa_backward_on_kernels_matches_reference(case, branch_backends):
    """Gradients of q, k, v, W_k, W_v and W_gate with every branch's backward on the kernels."""
    lengths, heads, heads_kv, dim, options = BACKWARD_CASES[case]
    x = random_cuda_inputs(lengths, heads, heads_kv, dim, seed=11)
    fast_in = differentiable(x, torch.bfloat16)
    ref_in = bf16_reference_inputs(x)
    out = nsa(**fast_in, max_seqlen=max(lengths), **options)
    ref = nsa_reference(**ref_in, max_seqlen=max(lengths), **options)
    assert rel_err(out, ref) < OUT_TOLERANCE
    dout = _random_dout(out.shape, out.device, seed=5)
    grads, ref_grads = grads_of(out, fast_in, dout), grads_of(ref, ref_in, dout)
    _assert_backward_on_kernels(branch_backends)
    assert set(grads) == {"q", "k", "v", "W_k", "W_v", "W_gate"}
    for name in grads:
        assert grads[name].dtype == torch.bfloat16, name
        assert torch.isfinite(grads[name]).all(), f"{name} has NaN/inf"
        err = rel_err(grads[name], ref_grads[name])
        assert err < GRAD_TOLERANCE, f"{name}: relative error {err:.3e}"


@requires_sm90
@pytest.mark.parametrize("case", ["gqa4-varlen", "gqa4-varlen-d64-sparse-compressed"])
@pytest.mark.filterwarnings("error:nsa\\(\\). capturing a CUDA graph:RuntimeWarning")
def test_nsa_deterministic_backward_is_bitwise_stable(case, branch_backends):
    """deterministic=True: three forward+backward runs give the same bits for every gradient,
    with every branch's backward on the kernels, and gradients that match the reference. The
    second and third run from a captured plan (nsa/captured.py), whose captures must not fail
    (a failed one falls back to eager with a warning: an error here)."""
    lengths, heads, heads_kv, dim, options = BACKWARD_CASES[case]
    x = random_cuda_inputs(lengths, heads, heads_kv, dim, seed=12)
    fast_in = differentiable(x, torch.bfloat16)
    dout = _random_dout(x["q"].shape, x["q"].device, seed=6)
    runs = []
    for _ in range(3):
        out = nsa(**fast_in, max_seqlen=max(lengths), deterministic=True, **options)
        runs.append(grads_of(out, fast_in, dout))
    torch.cuda.synchronize()
    _assert_backward_on_kernels(branch_backends)
    for again in runs[1:]:
        for name, grad in runs[0].items():
            assert torch.equal(grad, again[name]), f"{name} differs between deterministic runs"

    ref_in = bf16_reference_inputs(x)
    ref = nsa_reference(**ref_in, max_seqlen=max(lengths), **options)
    ref_grads = grads_of(ref, ref_in, dout)
    for name, grad in runs[0].items():
        err = rel_err(grad, ref_grads[name])
        assert err < GRAD_TOLERANCE, f"{name}: relative error {err:.3e}"


@requires_sm90
def test_nsa_shared_gate_pass_gives_the_per_branch_passes_bits(monkeypatch, branch_backends):
    """With the branch outputs kept (nsa()'s default at these sizes), one pass over dO writes
    every branch's gate gradient (`nsa.function.SHARED_GATE_PASS`); deterministic=True gives
    the same bits as a pass per branch, for every gradient W_gate's included."""
    import kernels.gated_sum as gated_sum
    import nsa.function as function

    lengths, heads, heads_kv, dim, options = BACKWARD_CASES["gqa4-varlen"]
    x = random_cuda_inputs(lengths, heads, heads_kv, dim, seed=13)
    fast_in = differentiable(x, torch.bfloat16)
    dout = _random_dout(x["q"].shape, x["q"].device, seed=7)
    shared_calls = []
    original = gated_sum.gate_gradients

    def counting(dout, terms, columns, d_gates):
        shared_calls.append(len(tuple(terms)))
        return original(dout, terms, columns, d_gates)
    monkeypatch.setattr(function, "gate_gradients", counting)
    runs = {}
    for shared in (True, False):
        monkeypatch.setattr(function, "SHARED_GATE_PASS", shared)
        out = nsa(**fast_in, max_seqlen=max(lengths), deterministic=True, recompute=False,
                  capture=False, **options)
        runs[shared] = grads_of(out, fast_in, dout)
    torch.cuda.synchronize()
    _assert_backward_on_kernels(branch_backends)
    assert shared_calls == [3], shared_calls  # the shared run's one pass of three terms
    for name, grad in runs[True].items():
        assert torch.equal(grad, runs[False][name]), f"{name} differs with the shared pass"


@requires_sm90
@pytest.mark.parametrize("short", [[], [40]], ids=["fused-dq-stores", "dq-kernel-stores"])
def test_nsa_compressed_dq_opens_the_sums_the_window_adds_into(monkeypatch, branch_backends,
                                                               short):
    """From FUSED_DQ_MIN_KEYS keys the window branch fuses its dQ: with the outputs kept, the
    compressed branch stores its dQ as the first values of the shared `DqSums`
    (`nsa.function.DQ_KERNEL_OPENS_SUMS`, filled with NaN here first so a value it did not
    store would show): from its fused dQ where every document has 1 to 128 compressed keys
    (`BwdSpec.dq_stores`), else (a 40-token document: none) from its dQ kernel; the window
    adds into them and the selected branch's dQ kernel consumes
    them: every gradient matches the reference, and dq matches the run that writes dq from
    the compressed branch (the switch off) within bf16 rounding (dk, dv: float32 partials in
    any order, so neither run is bitwise repeatable)."""
    import nsa.function as function
    from kernels.sm90.backward import DqSums
    from kernels.sm90.spec import FUSED_DQ_MIN_KEYS

    opened, open_for_store = [], DqSums.open_for_store

    def poisoned(self, *args):
        sums = open_for_store(self, *args)
        opened.append(sums is not None)
        return None if sums is None else sums.fill_(float("nan"))

    monkeypatch.setattr(DqSums, "open_for_store", poisoned)
    lengths, heads, heads_kv, dim = [FUSED_DQ_MIN_KEYS + 403, 300, *short], 8, 2, 128
    x = random_cuda_inputs(lengths, heads, heads_kv, dim, seed=14)
    fast_in = differentiable(x, torch.bfloat16)
    dout = _random_dout(x["q"].shape, x["q"].device, seed=8)
    runs = {}
    launched = record_backward_launches(monkeypatch)
    for opens in (True, False):
        monkeypatch.setattr(function, "DQ_KERNEL_OPENS_SUMS", opens)
        opened.clear()
        launched.clear()
        out = nsa(**fast_in, max_seqlen=max(lengths), recompute=False, capture=False)
        runs[opens] = grads_of(out, fast_in, dout)
        # Opened once, by the compressed branch (before the fused window), or never.
        assert opened.count(True) == int(opens) and opened[:1] == [opens], opened
        assert any(spec.dq_stores for spec in launched) == (opens and not short), launched
    torch.cuda.synchronize()
    _assert_backward_on_kernels(branch_backends)
    _assert_grads_match_reference(runs[True], x, lengths, dout)
    assert rel_err(runs[True]["q"], runs[False]["q"]) < 1e-2


@requires_sm90
@pytest.mark.parametrize("recompute", [True, False], ids=["recomputed", "kept"])
def test_nsa_window_past_the_accumulator_cap_takes_the_dq_kernel(monkeypatch, branch_backends,
                                                                 recompute):
    """Past kernels.sm90.spec.FUSED_DQ_MAX_ACCUMULATOR_BYTES (beyond 256K tokens at H=32, D=128;
    lowered here to a byte below this call's accumulator) the window branch's backward takes
    the dQ kernel instead of its fused dQ, so no float32 dQ sums are held (nsa()'s peak at 1M
    tokens): no backward launch fuses dQ, where the same call under the cap does, and every
    gradient matches the reference with the outputs recomputed or kept."""
    import kernels.sm90.spec as sm90_spec

    lengths, heads, heads_kv, dim = [sm90_spec.FUSED_DQ_MIN_KEYS + 403, 300], 8, 2, 128
    x = random_cuda_inputs(lengths, heads, heads_kv, dim, seed=15)
    fast_in = differentiable(x, torch.bfloat16)
    dout = _random_dout(x["q"].shape, x["q"].device, seed=9)
    launched = record_backward_launches(monkeypatch)
    fused = {}
    for cap in (sm90_spec.FUSED_DQ_MAX_ACCUMULATOR_BYTES, 4 * x["q"].numel() - 1):
        monkeypatch.setattr(sm90_spec, "FUSED_DQ_MAX_ACCUMULATOR_BYTES", cap)
        launched.clear()
        out = nsa(**fast_in, max_seqlen=max(lengths), recompute=recompute, capture=False)
        grads = grads_of(out, fast_in, dout)
        fused[cap] = any(spec.fuses_dq for spec in launched)
    torch.cuda.synchronize()
    assert list(fused.values()) == [True, False], fused
    _assert_backward_on_kernels(branch_backends)
    _assert_grads_match_reference(grads, x, lengths, dout)
