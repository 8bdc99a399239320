"""The forward that writes rowsum(dO * O) instead of O (`FwdSpec.row_dot_output`): nsa()'s
backward takes each recomputed branch's gate gradient from it (nsa/function.py
`fused_gate_pass`). On the GPU: equal to the row dot of the kernel's own output, on the
schedules of nsa()'s three branches; its argument checks on any machine."""
import pytest
import torch

from gpu_marks import requires_sm90
from sparsity import build_selected_block_sparse

HEADS, KV_HEADS, D = 8, 2, 128


def _packed(lengths, generator, head_dim=D):
    total = sum(lengths)
    q = torch.randn(total, HEADS, head_dim, device="cuda", dtype=torch.bfloat16,
                    generator=generator)
    k, v = (torch.randn(total, KV_HEADS, head_dim, device="cuda", dtype=torch.bfloat16,
                        generator=generator) for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    return q, k, v, cu


def _call(case, lengths, q, k, v, cu, generator):
    """(k, v, run keywords) of one of nsa()'s branch shapes."""
    call = dict(cu_seqlens_q=cu, max_seqlen_q=max(lengths), causal=True)
    if case == "window":
        return k, v, dict(call, cu_seqlens_k=cu, max_seqlen_k=max(lengths),
                          window_size=(511, 0))
    if case == "compressed":
        cf = 64
        cmp_lengths = [n // cf for n in lengths]
        k_cmp, v_cmp = (x[:sum(cmp_lengths)].contiguous() for x in (k, v))
        cu_k = torch.tensor([0, *torch.tensor(cmp_lengths).cumsum(0).tolist()],
                            dtype=torch.int32, device="cuda")
        return k_cmp, v_cmp, dict(call, cu_seqlens_k=cu_k, max_seqlen_k=max(cmp_lengths),
                                  compress_factor=cf)
    # selected: 4 random 64-key blocks per 128-row tile and KV head (block 0 and the
    # diagonal among them: the causal mask applies there), as nsa()'s selected branch
    rows = []
    for n in lengths:
        for tile in range(-(-n // 128)):
            last_block = (min((tile + 1) * 128, n) - 1) // 64
            picks = torch.randint(0, last_block + 1, (KV_HEADS, 4), generator=generator,
                                  device="cuda")
            picks[:, 0] = 0
            picks[:, 1] = last_block
            rows.append(picks)
    lists = build_selected_block_sparse(torch.stack(rows), cu_seqlens_q=cu, cu_seqlens_k=cu,
                                        q_tile=128, selected_block_size=64, kv_block=64,
                                        causal=True)
    return k, v, dict(call, cu_seqlens_k=cu, max_seqlen_k=max(lengths), block_sparse=lists)


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("case", ["compressed", "selected", "window"])
@pytest.mark.parametrize("lengths", [[4096], [300, 2048, 77, 1701]], ids=["one", "varlen"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_row_dots_equal_the_row_dots_of_the_output(case, lengths, head_dim):
    from kernels.sm90.forward import run

    generator = torch.Generator(device="cuda").manual_seed(5)
    q, k, v, cu = _packed(lengths, generator, head_dim)
    k, v, call = _call(case, lengths, q, k, v, cu, generator)
    dout = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=generator)
    dout[5] = 0  # a zero row: exactly zero
    out, _ = run(q, k, v, **call)
    into = torch.full((HEADS, q.shape[0]), float("nan"), device="cuda")
    assert run(q, k, v, row_dot_with=dout, row_dot_into=into, **call) is None
    expected = (dout.float() * out.float()).sum(-1).t()
    assert torch.isfinite(into).all()  # every row written
    assert (into[:, 5] == 0).all()
    # The kernel's dot uses its float32 accumulator, the expected one out rounded to bf16
    # (at most 2^-8 of each |o|): the two differ by at most 2^-8 sum |dO| |O|, plus float32
    # summation; twice that bound.
    bound = 2.0 ** -7 * (dout.float().abs() * out.float().abs()).sum(-1).t() + 1e-4
    assert ((into - expected).abs() <= bound).all()


@pytest.mark.gpu
@requires_sm90
def test_a_zero_dout_row_gives_zero_against_a_non_finite_output():
    """Rows whose output is NaN (they see a NaN in V) and whose dO is zero get exactly 0: the
    products are selected, not multiplied (the gated-sum kernels' rule); rows with a nonzero dO
    that see it get NaN."""
    from kernels.sm90.forward import run

    generator = torch.Generator(device="cuda").manual_seed(6)
    q, k, v, cu = _packed([1000], generator)
    v[300] = float("nan")
    call = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1000, max_seqlen_k=1000,
                causal=True, window_size=(511, 0))
    dout = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=generator)
    dout[300:310] = 0
    into = torch.empty(HEADS, 1000, device="cuda")
    run(q, k, v, row_dot_with=dout, row_dot_into=into, **call)
    assert (into[:, 300:310] == 0).all()
    assert torch.isnan(into[:, 310:812]).all()  # rows 310..811 see key 300 (window 512)
    assert torch.isfinite(into[:, :256]).all()  # their query tiles never load key 300


@pytest.mark.parametrize("bad", ["no into", "no with", "into shape", "with dtype", "padded"])
def test_row_dot_arguments_are_checked_before_any_launch(bad):
    """run() refuses a malformed row-dot request by name, on a machine without a GPU too (so
    before anything reaches the device)."""
    from kernels.sm90.forward import run

    q = torch.randn(10, HEADS, D, dtype=torch.bfloat16)
    k = torch.randn(10, KV_HEADS, D, dtype=torch.bfloat16)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    into, with_ = torch.empty(HEADS, 10), q.clone()
    call = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=10, max_seqlen_k=10, causal=True)
    if bad == "no into":
        into = None
    elif bad == "no with":
        with_ = None
    elif bad == "into shape":
        into = torch.empty(10, HEADS)
    elif bad == "with dtype":
        with_ = q.half()
    else:
        q, k, with_ = q[None], k[None], with_[None]
        call = dict(causal=True)
    name = "packed" if bad == "padded" else ("row_dot_into" if "into" in bad else "row_dot_with")
    with pytest.raises(ValueError, match=name):
        run(q, k, k, row_dot_with=with_, row_dot_into=into, **call)
