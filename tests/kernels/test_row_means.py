"""row_means (kernels/row_means.py): the float32 mean of runs of rows, NSA's pooling.

CPU: the torch path against an explicit float64 loop, runs of no rows, two tensors at once, the
errors, the CuTe DSL kernel's sm_90a builds. GPU (sm_90): the kernel against the float64 loop on
strided rows, and past 2**31 elements.
"""
import cutlass  # noqa: F401  (a dependency: a broken CuTe DSL install fails here, not skips)
import pytest
import torch

from kernels.row_means import row_means
from gpu_marks import requires_sm90


def _runs(total_rows, num_runs, longest, gen, device="cpu"):
    starts = torch.randint(0, total_rows - longest + 1, (num_runs,), generator=gen)
    counts = torch.randint(0, longest + 1, (num_runs,), generator=gen)
    counts[0] = longest  # the longest run is there, and (below) a run of no rows
    counts[-1] = 0
    return starts.to(device), counts.to(device)


def _exact(x, starts, counts):
    out = torch.zeros(starts.shape[0], *x.shape[1:], dtype=torch.float64)
    for r, (s, n) in enumerate(zip(starts.tolist(), counts.tolist())):
        if n:
            out[r] = x[s:s + n].cpu().double().sum(0) / n
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_torch_path_matches_the_exact_means(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 3, 8, generator=gen).to(dtype)
    starts, counts = _runs(300, 40, 16, gen)
    (means,) = row_means((x,), starts, counts, count=16)
    assert means.dtype == torch.promote_types(dtype, torch.float32)
    assert means.shape == (40, 3, 8)
    torch.testing.assert_close(means.double(), _exact(x, starts, counts), rtol=1e-6, atol=1e-6)
    assert torch.equal(means[-1], torch.zeros_like(means[-1]))  # no rows: 0, not NaN


def test_fixed_runs_and_two_tensors_at_once():
    gen = torch.Generator().manual_seed(1)
    k, v = (torch.randn(130, 2, 8, generator=gen).to(torch.bfloat16) for _ in range(2))
    starts = torch.tensor([0, 64, 3])
    k_means, v_means = row_means((k, v), starts, None, count=64)
    fixed = torch.full_like(starts, 64)
    torch.testing.assert_close(k_means.double(), _exact(k, starts, fixed))
    torch.testing.assert_close(v_means.double(), _exact(v, starts, fixed))


def test_gather_chunks_give_the_same_means(monkeypatch):
    import kernels.row_means as module

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(200, 4, 8, generator=gen)
    starts, counts = _runs(200, 30, 32, gen)
    whole = row_means((x,), starts, counts, count=32)[0]
    monkeypatch.setattr(module, "GATHER_CHUNK_ELEMENTS", 32 * 32 * 3)  # 3 runs per chunk
    assert torch.equal(row_means((x,), starts, counts, count=32)[0], whole)


def test_bad_input_names_the_argument():
    x = torch.randn(10, 2, 8)
    with pytest.raises(ValueError, match="xs: expected one or two tensors"):
        row_means((x, x[:5]), torch.tensor([0]), None, count=2)
    with pytest.raises(ValueError, match="starts, counts: expected"):
        row_means((x,), torch.tensor([[0]]), None, count=2)
    with pytest.raises(ValueError, match="starts, counts: expected"):
        row_means((x,), torch.tensor([0, 1]), torch.tensor([1]), count=2)


@pytest.mark.parametrize("spec", [("bfloat16", 4096, True, False), ("float16", 1024, False, True),
                                  ("bfloat16", 64, True, True), ("bfloat16", 2048, False, False)],
                         ids=lambda s: f"{s[0]}-W{s[1]}{'-counted' if s[2] else ''}"
                                       f"{'-pair' if s[3] else ''}")
def test_kernel_builds_for_sm90(spec):
    # CUTE_DSL_ARCH=sm_90a: tests/conftest.py
    from kernels.sm90.row_means import RowMeansSpec, compile_on_fake_tensors

    assert compile_on_fake_tensors(RowMeansSpec(*spec))


def test_kernel_spec_rejects_what_it_cannot_build():
    from kernels.sm90.row_means import RowMeansSpec

    with pytest.raises(ValueError, match="width 100"):
        RowMeansSpec("bfloat16", 100, True)
    with pytest.raises(ValueError, match="dtype"):
        RowMeansSpec("float32", 128, True)


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", [
    # rows, heads, head dim, runs, longest run, two tensors
    (5000, 32, 128, 300, 128, False),   # scoring queries (4096-wide rows: 4 CTAs per run)
    (4099, 8, 128, 64, 64, True),       # K and V compression
    (777, 3, 64, 50, 17, False),        # 24 vectors per row: a CTA of 24 threads
    (1000, 1, 8, 20, 5, True),          # one vector per row
], ids=lambda c: f"T{c[0]}-H{c[1]}-D{c[2]}-runs{c[3]}{'-pair' if c[5] else ''}")
def test_kernel_matches_the_exact_means(case, dtype):
    from kernels.row_means import runs_on_sm90

    rows, heads, dim, num_runs, longest, pair = case
    gen = torch.Generator().manual_seed(rows)
    # Strided rows: one head of a wider tensor, as q = qkv[:, :H] would be.
    wide = [torch.randn(rows, heads + 2, dim, generator=gen).to("cuda", dtype) for _ in range(2)]
    xs = tuple(w[:, 1:heads + 1] for w in wide)[:2 if pair else 1]
    starts, counts = _runs(rows, num_runs, longest, gen, "cuda")
    assert runs_on_sm90([x.flatten(1) for x in xs])  # the kernel, not the torch path
    for counted in (True, False):
        run_counts = counts if counted else torch.full_like(counts, longest)
        means = row_means(xs, starts, counts if counted else None, count=longest)
        torch.cuda.synchronize()
        for x, m in zip(xs, means):
            exact = _exact(x, starts.cpu(), run_counts.cpu())
            assert m.dtype == torch.float32 and m.shape == (num_runs, heads, dim)
            torch.testing.assert_close(m.cpu().double(), exact, rtol=2e-6, atol=2e-6)


@pytest.mark.gpu
@requires_sm90
def test_kernel_reads_rows_past_two_to_the_31_elements():
    """q at 1M tokens, H=32, D=128 has 2**32 elements: the row offsets are 64-bit."""
    from kernels.sm90.row_means import can_run

    rows, width = 600_000, 4096  # 2.46e9 elements, 4.9 GB of bf16
    x = torch.empty(rows, width, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(5)
    tail = 2000  # random values in the rows the runs read (past 2**31 / 4096 = 524288)
    x[-tail:].normal_(generator=gen)
    x[:10].normal_(generator=gen)
    starts = torch.tensor([rows - tail, rows - 128, rows - 1, 0], device="cuda")
    counts = torch.tensor([128, 128, 1, 10], device="cuda")
    assert can_run(x)
    (means,) = row_means((x,), starts, counts, count=128)
    torch.cuda.synchronize()
    exact = torch.stack([x[s:s + n].double().sum(0) / n
                         for s, n in zip(starts.tolist(), counts.tolist())])
    torch.testing.assert_close(means.double(), exact, rtol=2e-6, atol=2e-6)
