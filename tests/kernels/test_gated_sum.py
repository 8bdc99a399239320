"""GatedSum (kernels/gated_sum.py): the gated combination of NSA's branch outputs.

CPU: the torch path against an explicit float64 sum, the errors, the CuTe DSL kernel's sm_90a
builds. GPU (sm_90): the kernel against the float64 sum, to one rounding of the output dtype.
"""
import cutlass  # noqa: F401  (a dependency: a broken CuTe DSL install fails here, not skips)
import pytest
import torch

from kernels.gated_sum import GatedSum
from gpu_marks import requires_sm90


def _problem(rows, heads, dim, dtype, terms, device="cpu", gate_width=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    outputs = [torch.randn(rows, heads, dim, generator=gen).to(device=device, dtype=dtype)
               for _ in range(terms)]
    gates = torch.rand(rows, heads, gate_width, generator=gen).to(device)
    return outputs, gates


def _exact(outputs, gates, columns):
    return sum(gates[..., c, None].double() * o.double() for o, c in zip(outputs, columns))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_torch_path_sums_in_float32_and_rounds_once(dtype):
    outputs, gates = _problem(37, 3, 24, dtype, terms=3)
    total = GatedSum(gates, like=outputs[0])
    assert total.backend == "torch" and "cpu" in total.reason
    for column, out in zip((2, 0, 1), outputs):
        total.add(column, out)
    result = total.result()
    exact = _exact(outputs, gates, (2, 0, 1))
    assert result.dtype == dtype and result.shape == outputs[0].shape
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(result.double(), exact, rtol=eps, atol=10 * eps)


def test_no_terms_give_zeros():
    outputs, gates = _problem(5, 2, 8, torch.bfloat16, terms=1)
    assert torch.equal(GatedSum(gates, like=outputs[0]).result(), torch.zeros_like(outputs[0]))


def test_bad_input_names_the_argument():
    outputs, gates = _problem(6, 2, 8, torch.bfloat16, terms=2)
    with pytest.raises(ValueError, match="gates: expected shape"):
        GatedSum(gates[:5], like=outputs[0])
    with pytest.raises(ValueError, match="gates: expected a floating tensor"):
        GatedSum(gates.to(torch.int32), like=outputs[0])
    total = GatedSum(gates, like=outputs[0])
    with pytest.raises(ValueError, match="term: expected"):
        total.add(0, outputs[1].float())
    with pytest.raises(ValueError, match="term: expected"):
        total.add(0, outputs[1][:3])
    with pytest.raises(ValueError, match="column: 3 outside"):
        total.add(3, outputs[1])


def test_result_is_taken_once():
    outputs, gates = _problem(6, 2, 8, torch.bfloat16, terms=2)
    total = GatedSum(gates, like=outputs[0])
    for column, out in enumerate(outputs):
        total.add(column, out)
    first = total.result()
    assert total.result() is first
    with pytest.raises(RuntimeError, match="after result"):
        total.add(0, outputs[0])


def test_term_on_another_device_is_refused():
    outputs, gates = _problem(6, 2, 8, torch.float32, terms=1)
    with pytest.raises(ValueError, match="term: expected .* on cpu, got .* on meta"):
        GatedSum(gates, like=outputs[0]).add(0, outputs[0].to("meta"))


def test_disable_env_keeps_the_torch_path(monkeypatch):
    monkeypatch.setenv("NSA_CUTE_DISABLE", "1")
    outputs, gates = _problem(4, 2, 8, torch.bfloat16, terms=1)
    total = GatedSum(gates, like=outputs[0])
    assert total.backend == "torch" and "NSA_CUTE_DISABLE" in total.reason


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
@pytest.mark.parametrize("columns", [(0, 1), (0, 1, 2)], ids=["2terms", "3terms"])
def test_kernel_builds_for_sm90(dtype, head_dim, columns):
    # CUTE_DSL_ARCH=sm_90a: tests/conftest.py
    from kernels.sm90.gated_sum import GatedSumSpec, compile_gated_sum_on_fake_tensors

    assert compile_gated_sum_on_fake_tensors(GatedSumSpec(dtype, head_dim, columns, 3))


def test_kernel_spec_rejects_what_it_cannot_build():
    from kernels.sm90.gated_sum import GatedSumSpec

    with pytest.raises(ValueError, match="head_dim 100"):
        GatedSumSpec("bfloat16", 100, (0, 1), 3)
    with pytest.raises(ValueError, match="columns"):
        GatedSumSpec("bfloat16", 128, (0, 3), 3)
    with pytest.raises(ValueError, match="dtype"):
        GatedSumSpec("float32", 128, (0,), 3)


def _sum_copy_is_a_new_sum_each_time(device: str, dtype) -> None:
    outputs, gates = _problem(300, 4, 128, dtype, terms=3, device=device)
    total = GatedSum(gates, like=outputs[0], keep_terms=True)
    for column, out in zip((2, 0, 1), outputs):
        total.add(column, out)
    kept = [o.clone() for o in outputs]
    first, second = total.sum_copy(), total.sum_copy()
    assert first.data_ptr() not in {second.data_ptr(), *(o.data_ptr() for o in outputs)}
    assert torch.equal(first, second) and torch.equal(first, total.result())
    assert all(torch.equal(o, k) for o, k in zip(outputs, kept))  # the terms are untouched
    with pytest.raises(RuntimeError, match="keep_terms"):
        GatedSum(gates, like=outputs[0]).sum_copy()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_sum_copy_is_a_new_sum_each_time_torch_path(dtype):
    """`sum_copy` (nsa()'s captured plans sum outside their graph with it): a new tensor per
    call, equal to `result()`, the kept terms untouched (float64: no conversion to hide a
    shared tensor behind)."""
    _sum_copy_is_a_new_sum_each_time("cpu", dtype)


@pytest.mark.gpu
@requires_sm90
def test_sum_copy_is_a_new_sum_each_time_kernel():
    _sum_copy_is_a_new_sum_each_time("cuda", torch.bfloat16)


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", [
    # rows, heads, head dim, gate columns of the terms (rows x heads x dim / 8 threads: all but
    # the last case leave the last 256-thread block partly idle, so its bound check runs)
    (1000, 3, 128, (0, 1, 2)),
    (777, 31, 64, (0, 1)),
    (513, 5, 192, (2, 0)),
    (129, 7, 256, (1,)),
    (16384, 32, 128, (0, 1, 2)),
], ids=lambda c: f"T{c[0]}-H{c[1]}-D{c[2]}-cols{''.join(map(str, c[3]))}")
def test_kernel_matches_the_exact_sum_to_one_rounding(case, dtype):
    rows, heads, dim, columns = case
    outputs, gates = _problem(rows, heads, dim, dtype, len(columns), device="cuda", seed=rows)
    exact = _exact(outputs, gates, columns)
    total = GatedSum(gates, like=outputs[0])
    assert total.backend == "sm90", total.reason
    for column, out in zip(columns, outputs):
        total.add(column, out)
    result = total.result()
    torch.cuda.synchronize()
    assert result.dtype == dtype and result.shape == (rows, heads, dim)
    # One rounding of a float32 sum: within half an ulp of the exact value, plus float32 noise
    # (~1e-7 of the terms' magnitude), and almost always the correctly rounded value itself.
    error = (result.double() - exact).abs()
    assert (error <= exact.abs() * torch.finfo(dtype).eps / 2 + 1e-6).all(), error.max()
    assert (result != exact.to(dtype)).float().mean() < 1e-3


@pytest.mark.gpu
@requires_sm90
def test_kernel_takes_any_term_layout_and_broadcast_gates():
    """Non-contiguous and misaligned terms are copied first, stride-0 (mean) gates and a gate
    row of 2 work, the result lands in the lowest column's term (contiguous), empty input stays
    on torch."""
    rows, heads, dim = 300, 4, 128
    gen = torch.Generator(device="cuda").manual_seed(7)
    base = torch.randn(rows, heads, dim + 8, device="cuda", dtype=torch.bfloat16, generator=gen)
    strided = base[..., :dim]  # non-contiguous
    flat = torch.randn(rows * heads * dim + 1, device="cuda", dtype=torch.bfloat16, generator=gen)
    misaligned = flat[1:].view(rows, heads, dim)  # contiguous, 2 bytes off 16-byte alignment
    first = torch.randn(rows, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    gates = torch.tensor([0.25, 0.75], device="cuda").expand(rows, heads, 2)  # stride 0
    terms, columns = (first, strided, misaligned), (0, 1, 1)
    exact = _exact(terms, gates, columns)
    total = GatedSum(gates, like=first)
    assert total.backend == "sm90", total.reason
    for column, term in zip(columns, terms):
        total.add(column, term)
    result = total.result()
    assert result.data_ptr() == first.data_ptr()
    error = (result.double() - exact).abs()
    assert (error <= exact.abs() * torch.finfo(torch.bfloat16).eps / 2 + 1e-6).all()

    empty = torch.empty(0, heads, dim, device="cuda", dtype=torch.bfloat16)
    total = GatedSum(torch.rand(0, heads, 3, device="cuda"), like=empty)
    assert total.backend == "torch" and "no elements" in total.reason
    total.add(0, empty)
    assert total.result().shape == (0, heads, dim)


@pytest.mark.gpu
@requires_sm90
def test_kernel_through_dlpack_equals_tvm_ffi(monkeypatch):
    """The launch without apache-tvm-ffi (NSA_CUTE_TVM_FFI=0) computes the same sum."""
    import kernels.sm90.launch as launch

    outputs, gates = _problem(1000, 3, 128, torch.bfloat16, 3, device="cuda", seed=11)
    results = []
    for tvm_ffi in (True, False):
        monkeypatch.setattr(launch, "tvm_ffi_available", lambda tvm_ffi=tvm_ffi: tvm_ffi)
        total = GatedSum(gates, like=outputs[0])
        for column, out in enumerate(outputs):
            total.add(column, out.clone())
        results.append(total.result())
    assert torch.equal(results[0], results[1])


# ------------------------------------------------------------------------------------------------
# gated_sum_backward: the backward of one term (NSA's backward, per branch).
# ------------------------------------------------------------------------------------------------

def _backward_problem(rows, heads, dim, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    dout, term = (torch.randn(rows, heads, dim, generator=gen).to(device=device, dtype=dtype)
                  for _ in range(2))
    gates = torch.rand(rows, heads, 3, generator=gen).to(device)
    return dout, term, gates


def _check_backward(dout, term, gates, column):
    """Run gated_sum_backward and gate_gradient into d_gates of sentinels; check the results
    and that the other columns kept their sentinels."""
    from kernels.gated_sum import gate_gradient, gated_sum_backward

    accumulate = torch.promote_types(dout.dtype, torch.float32)
    d_gates = torch.full(gates.shape, -7.0, dtype=accumulate, device=dout.device)
    d_term = gated_sum_backward(dout, term, gates, column, d_gates)
    exact_gate = (dout.double() * term.double()).sum(-1)
    # g * dO is one float32 product rounded to the term's dtype: bitwise what torch gives.
    expected = (gates[..., column, None].to(accumulate) * dout.to(accumulate)).to(dout.dtype)
    assert d_term.dtype == dout.dtype and torch.equal(d_term, expected)
    torch.testing.assert_close(d_gates[..., column].double(), exact_gate, rtol=1e-5, atol=1e-4)
    others = [c for c in range(gates.shape[-1]) if c != column]
    assert (d_gates[..., others] == -7.0).all()
    # gate_gradient: the same column alone, bit for bit (the same pass without g * dO).
    alone = torch.full(gates.shape, -7.0, dtype=accumulate, device=dout.device)
    assert gate_gradient(dout, term, column, alone) is None
    assert torch.equal(alone[..., column], d_gates[..., column])
    assert (alone[..., others] == -7.0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_backward_torch_path(dtype):
    dout, term, gates = _backward_problem(37, 3, 24, dtype)
    _check_backward(dout, term, gates, column=1)


def test_backward_keeps_a_nan_of_an_unused_row_out_of_the_gate_gradient():
    """dO == 0 on a row (the loss does not read it) whose term is NaN: d_gates is 0 there, not
    NaN, and the term's gradient is 0; the same from gate_gradient."""
    from kernels.gated_sum import gate_gradient, gated_sum_backward

    dout, term, gates = _backward_problem(9, 2, 16, torch.bfloat16)
    dout[4] = 0
    term[4, 1, 3] = float("nan")
    term[5, 0, 0] = float("inf")
    d_gates = torch.zeros(9, 2, 3)
    d_term = gated_sum_backward(dout, term, gates, 2, d_gates)
    assert (d_gates[4] == 0).all() and (d_term[4] == 0).all()
    assert not torch.isfinite(d_gates[5, 0, 2])  # a row the loss reads keeps its Inf
    alone = torch.zeros(9, 2, 3)
    gate_gradient(dout, term, 2, alone)
    assert (alone[4] == 0).all() and not torch.isfinite(alone[5, 0, 2])


def _check_gate_gradients(dout, terms, columns, width=3):
    """gate_gradients of several terms into d_gates of sentinels equals gate_gradient of each
    term alone, bit for bit (the same per-row sums, dO read once), and leaves the other
    columns alone."""
    from kernels.gated_sum import gate_gradient, gate_gradients

    accumulate = torch.promote_types(dout.dtype, torch.float32)
    shape = (*dout.shape[:2], width)
    together = torch.full(shape, -7.0, dtype=accumulate, device=dout.device)
    gate_gradients(dout, terms, columns, together)
    alone = torch.full(shape, -7.0, dtype=accumulate, device=dout.device)
    for term, column in zip(terms, columns):
        gate_gradient(dout, term, column, alone)
    assert torch.equal(together, alone)
    others = [c for c in range(width) if c not in columns]
    assert (together[..., others] == -7.0).all()
    for term, column in zip(terms, columns):
        exact = (dout.double() * term.double()).sum(-1)
        torch.testing.assert_close(together[..., column].double(), exact, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("columns", [(2,), (0, 2), (1, 2, 0)], ids=lambda c: "cols" + "".join(map(str, c)))
def test_gate_gradients_of_several_terms_torch_path(columns):
    gen = torch.Generator().manual_seed(3)
    dout, *terms = (torch.randn(37, 3, 24, generator=gen).bfloat16()
                    for _ in range(1 + len(columns)))
    _check_gate_gradients(dout, terms, columns)


def test_gate_gradients_bad_input_names_the_argument():
    from kernels.gated_sum import gate_gradients

    dout, term, _ = _backward_problem(6, 2, 8, torch.bfloat16)
    d_gates = torch.zeros(6, 2, 3)
    with pytest.raises(ValueError, match="terms, columns"):
        gate_gradients(dout, (term, term), (0,), d_gates)
    with pytest.raises(ValueError, match="terms, columns"):
        gate_gradients(dout, (term, term), (1, 1), d_gates)
    with pytest.raises(ValueError, match="terms, columns"):
        gate_gradients(dout, (), (), d_gates)
    with pytest.raises(ValueError, match="column: 3 outside"):
        gate_gradients(dout, (term, term), (0, 3), d_gates)
    with pytest.raises(ValueError, match="term: expected"):
        gate_gradients(dout, (term, term[:, :1]), (0, 1), d_gates)


def test_backward_bad_input_names_the_argument():
    from kernels.gated_sum import gate_gradient, gated_sum_backward

    dout, term, gates = _backward_problem(6, 2, 8, torch.bfloat16)
    d_gates = torch.zeros(6, 2, 3)
    with pytest.raises(ValueError, match="term: expected"):
        gated_sum_backward(dout, term.float(), gates, 0, d_gates)
    with pytest.raises(ValueError, match="gates: expected"):
        gated_sum_backward(dout, term, gates[:5], 0, d_gates)
    with pytest.raises(ValueError, match="d_gates: expected"):
        gated_sum_backward(dout, term, gates, 0, d_gates.int())
    with pytest.raises(ValueError, match="column: 3 outside"):
        gated_sum_backward(dout, term, gates, 3, d_gates)
    with pytest.raises(ValueError, match="term: expected"):
        gate_gradient(dout, term[:, :1], 0, d_gates)
    with pytest.raises(ValueError, match="d_gates: expected"):
        gate_gradient(dout, term, 0, d_gates[..., None])


@pytest.mark.parametrize("term_gradient", [True, False], ids=["", "gate-only"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
def test_backward_kernel_builds_for_sm90(dtype, head_dim, term_gradient):
    from kernels.sm90.gated_sum import GatedSumBackwardSpec, compile_gated_sum_on_fake_tensors

    spec = GatedSumBackwardSpec(dtype, head_dim, (1,), 3, term_gradient)
    assert compile_gated_sum_on_fake_tensors(spec)


@pytest.mark.parametrize("columns", [(0, 2), (2, 0, 1)], ids=lambda c: "cols" + "".join(map(str, c)))
def test_several_terms_gate_only_kernel_builds_for_sm90(columns):
    from kernels.sm90.gated_sum import GatedSumBackwardSpec, compile_gated_sum_on_fake_tensors

    spec = GatedSumBackwardSpec("bfloat16", 128, columns, 3, term_gradient=False)
    assert compile_gated_sum_on_fake_tensors(spec)


def test_backward_kernel_spec_rejects_what_it_cannot_build():
    from kernels.sm90.gated_sum import GatedSumBackwardSpec, can_run

    with pytest.raises(ValueError, match="head_dim 72"):
        GatedSumBackwardSpec("bfloat16", 72, (0,), 3)
    with pytest.raises(ValueError, match=r"columns \(3,\) outside"):
        GatedSumBackwardSpec("bfloat16", 128, (3,), 3)
    with pytest.raises(ValueError, match="1 term with term_gradient"):
        GatedSumBackwardSpec("bfloat16", 128, (0, 1), 3)  # g * dO of one term only
    with pytest.raises(ValueError, match="1 to 3"):
        GatedSumBackwardSpec("bfloat16", 128, (0, 1, 2, 3), 4, term_gradient=False)
    ok, reason = can_run(torch.empty(4, 2, 72, dtype=torch.bfloat16), backward=True)
    assert not ok and "D % 64" in reason


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", [
    (1000, 3, 128, 0), (777, 31, 64, 2), (513, 5, 192, 1), (129, 7, 256, 1),
    (16384, 32, 128, 2),
], ids=lambda c: f"T{c[0]}-H{c[1]}-D{c[2]}-col{c[3]}")
def test_backward_kernel_matches_exact(case, dtype):
    from kernels.gated_sum import backward_runs_on_sm90

    rows, heads, dim, column = case
    dout, term, gates = _backward_problem(rows, heads, dim, dtype, device="cuda", seed=rows)
    dout[rows // 2] = 0
    term[rows // 2, 0, 0] = float("nan")  # a row the loss does not read
    assert backward_runs_on_sm90(dout, torch.empty(1, device="cuda"))
    _check_backward(dout, term.nan_to_num(), gates, column)
    from kernels.gated_sum import gated_sum_backward

    d_gates = torch.zeros(rows, heads, 3, device="cuda")
    gated_sum_backward(dout, term, gates, column, d_gates)
    assert (d_gates[rows // 2] == 0).all() and torch.isfinite(d_gates).all()


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", [
    (1000, 3, 128, (0, 1, 2)), (777, 31, 64, (2, 0)), (513, 5, 192, (1, 2, 0)),
    (16384, 32, 128, (0, 1, 2)),
], ids=lambda c: f"T{c[0]}-H{c[1]}-D{c[2]}-cols{''.join(map(str, c[3]))}")
def test_gate_gradients_kernel_reads_dout_once_for_every_term(case, dtype):
    """The several-term pass equals the one-term passes bit for bit, and a row the loss does
    not read (dO == 0) keeps a NaN of any term out of every column."""
    from kernels.gated_sum import backward_runs_on_sm90, gate_gradients

    rows, heads, dim, columns = case
    gen = torch.Generator().manual_seed(rows)
    dout, *terms = (torch.randn(rows, heads, dim, generator=gen).to("cuda", dtype)
                    for _ in range(1 + len(columns)))
    assert backward_runs_on_sm90(dout, torch.empty(1, device="cuda"))
    _check_gate_gradients(dout, terms, columns)
    dout[rows // 2] = 0
    for term in terms:
        term[rows // 2, 0, 0] = float("nan")
    d_gates = torch.zeros(rows, heads, 3, device="cuda")
    gate_gradients(dout, terms, columns, d_gates)
    assert (d_gates[rows // 2] == 0).all() and torch.isfinite(d_gates).all()


@pytest.mark.gpu
@requires_sm90
def test_kernels_split_tensors_over_launches(monkeypatch):
    """Tensors past the kernels' 32-bit indexing (2**31 elements: q at 1M tokens, H=32, D=128)
    run as several launches over row ranges; here the limit is lowered to 1000 rows of D so a
    small problem takes 4 launches, and every result matches the exact one."""
    import kernels.sm90.gated_sum as sm90_gated_sum

    monkeypatch.setattr(sm90_gated_sum, "LAUNCH_ELEMENTS", 1000 * 128 + 5)
    rows, heads = 1300, 3  # 3900 (t, h) rows
    outputs, gates = _problem(rows, heads, 128, torch.bfloat16, 3, device="cuda", seed=5)
    exact = _exact(outputs, gates, (0, 1, 2))
    total = GatedSum(gates, like=outputs[0])
    for column, out in enumerate(outputs):
        total.add(column, out.clone())
    error = (total.result().double() - exact).abs()
    assert (error <= exact.abs() * torch.finfo(torch.bfloat16).eps / 2 + 1e-6).all()
    dout, term, gates = _backward_problem(rows, heads, 128, torch.bfloat16, "cuda", seed=6)
    _check_backward(dout, term, gates, column=1)
    _check_gate_gradients(dout, (term, gates[..., :1].expand_as(term).bfloat16(), dout),
                          (2, 0, 1))


def test_launch_chunks_cover_the_rows_once_in_ranges_of_whole_rows(monkeypatch):
    """The flat views each launch gets: one range (each tensor's own flat view) below the
    32-bit limit; above it, consecutive ranges of whole (t, h) rows, the gates' and the terms'
    ranges over the same rows (CPU: views only, no launch)."""
    import kernels.sm90.gated_sum as sm90_gated_sum

    rows, heads, dim = 7, 3, 16
    terms = torch.randn(rows, heads, dim)
    gates = torch.randn(rows, heads, 3)
    (whole,) = sm90_gated_sum._launch_chunks([gates, terms, None], terms)
    assert whole[0].data_ptr() == gates.data_ptr() and whole[1].numel() == terms.numel()
    assert whole[2] is None
    monkeypatch.setattr(sm90_gated_sum, "LAUNCH_ELEMENTS", 4 * dim + 3)  # 4 rows a launch
    chunks = sm90_gated_sum._launch_chunks([gates, terms, None], terms)
    assert [c[1].numel() // dim for c in chunks] == [4, 4, 4, 4, 4, 1]
    assert torch.equal(torch.cat([c[0] for c in chunks]), gates.flatten())
    assert torch.equal(torch.cat([c[1] for c in chunks]), terms.flatten())
    assert all(c[2] is None for c in chunks)


@pytest.mark.gpu
@requires_sm90
def test_kernel_sums_in_column_order_whatever_order_the_terms_came_in():
    """nsa() adds its branch outputs in the order they were launched, which depends on the
    streams it runs them on (nsa/streams.py): the sum must not."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    terms = [torch.randn(500, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
             for _ in range(3)]
    gates = torch.rand(500, 4, 3, device="cuda", generator=gen)
    results = []
    for order in ((0, 1, 2), (2, 0, 1), (1, 2, 0)):
        total = GatedSum(gates, like=terms[0], keep_terms=True)
        for column in order:
            total.add(column, terms[column])
        results.append(total.result())
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
