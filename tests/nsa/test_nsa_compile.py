"""torch.compile(fullgraph=True) of models calling nsa(), on the CPU: compiles, forward and
backward, and matches eager nsa().

Under compile nsa() calls the custom ops of nsa/ops.py; fullgraph=True makes any graph break an
error, so compiling at all shows nothing in nsa() reads the device outside the ops. Varlen calls
pass host_cu_seqlens (without it compile is refused, clearly). The ops themselves are checked by
torch.library.opcheck (schema, fake implementation against the real one, autograd registration).
"""

import pytest
import torch
from torch import nn

import nsa.ops  # noqa: F401  (registers torch.ops.nsa_cute)
from nsa import nsa
from nsa.ops import config_arguments
from nsa.validation import validate_nsa_call
from nsa_testing import SMALL, random_inputs
from gpu_marks import requires_sm90

LENGTHS = [40, 17, 29]
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
HOST_CU_SEQLENS = (0, 40, 57, 86)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # every test compiles from scratch: no cache hit hides a failure
    yield
    torch._dynamo.reset()


def _leaves(names, inputs: dict) -> dict:
    return {n: inputs[n].detach().clone().requires_grad_() for n in names}


def _loss_and_grads(fn, leaves: dict, *args):
    out = fn(*leaves.values(), *args)
    # A dO that is not all ones and differs per row: every gradient path is exercised.
    dout = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    out.backward(dout)
    return out.detach(), {n: x.grad for n, x in leaves.items()}


def _assert_same(eager, compiled, rtol=1e-5, atol=1e-6):
    (out_e, grads_e), (out_c, grads_c) = eager, compiled
    torch.testing.assert_close(out_c, out_e, rtol=rtol, atol=atol)
    assert grads_c.keys() == grads_e.keys()
    for name in grads_e:
        assert grads_c[name] is not None, name
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=rtol, atol=atol,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("options", [
    dict(SMALL),
    dict(SMALL, num_cmp_selected_blocks=1, window_size=0),
], ids=["dense-window", "sparse-no-window"])
def test_varlen_nsa_compiles_fullgraph_and_matches_eager(backend, options):
    inputs = random_inputs(LENGTHS, HEADS, KV_HEADS, HEAD_DIM, seed=0, dtype=torch.float32)
    cu_seqlens = inputs["cu_seqlens"]
    assert tuple(cu_seqlens.tolist()) == HOST_CU_SEQLENS

    def call(q, k, v, W_k, W_v, W_gate, cu_seqlens):
        return nsa(q, k, v, cu_seqlens=cu_seqlens, host_cu_seqlens=HOST_CU_SEQLENS, W_k=W_k,
                   W_v=W_v, W_gate=W_gate, **options)

    names = ("q", "k", "v", "W_k", "W_v", "W_gate")
    eager = _loss_and_grads(call, _leaves(names, inputs), cu_seqlens)
    compiled_call = torch.compile(call, fullgraph=True, backend=backend)
    _assert_same(eager, _loss_and_grads(compiled_call, _leaves(names, inputs), cu_seqlens))


class _NSALayer(nn.Module):
    """Projections to q, k, v, NSA with a learned gate, and an output projection."""

    def __init__(self, dim: int):
        super().__init__()
        self.to_q = nn.Linear(dim, HEADS * HEAD_DIM)
        self.to_kv = nn.Linear(dim, 2 * KV_HEADS * HEAD_DIM)
        self.W_gate = nn.Parameter(torch.randn(HEADS, 3, HEAD_DIM) * HEAD_DIM ** -0.5)
        self.out = nn.Linear(HEADS * HEAD_DIM, dim)

    def forward(self, x):  # x (B, N, dim): the padded layout, bounds from the shape
        batch, seqlen, _ = x.shape
        q = self.to_q(x).view(batch, seqlen, HEADS, HEAD_DIM)
        k, v = self.to_kv(x).view(batch, seqlen, 2, KV_HEADS, HEAD_DIM).unbind(2)
        o = nsa(q, k, v, W_gate=self.W_gate, **SMALL)
        return self.out(o.reshape(batch, seqlen, -1))


def test_padded_module_compiles_fullgraph_with_inductor_and_matches_eager():
    torch.manual_seed(0)
    model = _NSALayer(dim=16)
    x = torch.randn(2, 43, 16)

    def run(module):
        model.zero_grad(set_to_none=True)
        leaves = {"x": x.clone().requires_grad_()}
        out, grads = _loss_and_grads(module, leaves)
        grads.update({name: p.grad.clone() for name, p in model.named_parameters()})
        return out, grads

    eager = run(model)
    # Inductor fuses the projections' float32 sums in another order (the bias gradients differ
    # in the last bits); nsa() itself runs the same code either way.
    _assert_same(eager, run(torch.compile(model, fullgraph=True)), rtol=1e-4, atol=1e-5)


def test_padded_nsa_compiled_with_dynamic_shapes_matches_eager_at_two_lengths():
    """With dynamic=True the sequence bounds reach the op as symbolic ints (SymInt[] in its
    schema); each length still gives eager's values."""
    def call(q, k, v, W_gate):
        return nsa(q, k, v, W_gate=W_gate, **SMALL)

    compiled_call = torch.compile(call, fullgraph=True, backend="aot_eager", dynamic=True)
    for seqlen in (43, 50):
        gen = torch.Generator().manual_seed(seqlen)
        inputs = {"q": torch.randn(2, seqlen, HEADS, HEAD_DIM, generator=gen),
                  "k": torch.randn(2, seqlen, KV_HEADS, HEAD_DIM, generator=gen),
                  "v": torch.randn(2, seqlen, KV_HEADS, HEAD_DIM, generator=gen),
                  "W_gate": torch.randn(HEADS, 3, HEAD_DIM, generator=gen) * 0.3}
        eager = _loss_and_grads(call, _leaves(inputs, inputs))
        _assert_same(eager, _loss_and_grads(compiled_call, _leaves(inputs, inputs)))


def test_compile_without_host_cu_seqlens_is_refused_naming_it():
    inputs = random_inputs(LENGTHS, HEADS, KV_HEADS, HEAD_DIM, seed=0, dtype=torch.float32)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def call(q, k, v, cu_seqlens):
        return nsa(q, k, v, cu_seqlens=cu_seqlens, **SMALL)

    # Dynamo may wrap the error it traced; its message is nsa()'s either way.
    with pytest.raises(Exception, match="host_cu_seqlens is required with cu_seqlens under "
                                        "torch.compile"):
        call(inputs["q"], inputs["k"], inputs["v"], inputs["cu_seqlens"])


def _op_arguments(options: dict, *, weights: bool, recompute: bool | None = None):
    inputs = random_inputs(LENGTHS, HEADS, KV_HEADS, HEAD_DIM, seed=1, dtype=torch.float32)
    q, k, v = (inputs[n].requires_grad_() for n in ("q", "k", "v"))
    W_k, W_v, W_gate = ((inputs[n].requires_grad_() if weights else None)
                        for n in ("W_k", "W_v", "W_gate"))
    test_only = {"q_tile": options.pop("_q_tile"), "cmp_kv_block": options.pop("_cmp_kv_block")}
    config, sequences = validate_nsa_call(
        q, k, v, cu_seqlens=inputs["cu_seqlens"], max_seqlen=None, W_k=W_k, W_v=W_v,
        W_gate=W_gate, causal=True, softmax_scale=None, num_cmp_selected_blocks=None,
        **test_only, **options)
    return (q, k, v, W_k, W_v, W_gate, inputs["cu_seqlens"], list(sequences.cu_seqlens),
            sequences.max_seqlen, *config_arguments(config), recompute)


@pytest.mark.parametrize("weights", [True, False])
@pytest.mark.parametrize("window_size", [12, 0])
@pytest.mark.parametrize("recompute", [True, False])
def test_the_ops_pass_opcheck(weights, window_size, recompute):
    args = _op_arguments(dict(SMALL, window_size=window_size), weights=weights,
                         recompute=recompute)
    torch.library.opcheck(torch.ops.nsa_cute.nsa_forward.default, args)
    out, *rest = torch.ops.nsa_cute.nsa_forward(*args)
    lses, outputs = rest[:3], rest[3:]
    assert lses[2].numel() == (0 if window_size == 0 else lses[0].numel())
    kept = 0 if recompute else (2 if window_size == 0 else 3)
    assert [o.shape == out.shape for o in outputs] == [True] * kept + [False] * (3 - kept)
    dout = torch.randn_like(out)
    tensors, primitives = args[:7], args[7:]
    backward_args = (dout, *(t.detach() if t is not None else None for t in tensors),
                     *(x.detach() for x in lses + outputs), *primitives)
    torch.library.opcheck(torch.ops.nsa_cute.nsa_backward.default, backward_args)


@pytest.mark.parametrize("recompute", [True, False])
def test_the_ops_compute_what_eager_nsa_computes(recompute):
    """The ops outside compile, against NSAFunction (what eager nsa() runs): the same values,
    with the branch outputs recomputed or kept."""
    args = _op_arguments(dict(SMALL), weights=True, recompute=recompute)
    q, k, v, W_k, W_v, W_gate, cu_seqlens = args[:7]
    leaves = (q, k, v, W_k, W_v, W_gate)
    out = torch.ops.nsa_cute.nsa_forward(*args)[0]
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    expected = nsa(q, k, v, cu_seqlens=cu_seqlens, W_k=W_k, W_v=W_v, W_gate=W_gate, **SMALL)
    expected_grads = torch.autograd.grad(expected, leaves, dout)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)


def test_host_cu_seqlens_gives_eager_nsa_the_same_result_and_checks_read_no_tensor(
        monkeypatch):
    inputs = random_inputs(LENGTHS, HEADS, KV_HEADS, HEAD_DIM, seed=2, dtype=torch.float32)
    q, k, v, cu_seqlens = (inputs[n] for n in ("q", "k", "v", "cu_seqlens"))
    expected = nsa(q, k, v, cu_seqlens=cu_seqlens, W_gate=inputs["W_gate"], **SMALL)
    out = nsa(q, k, v, cu_seqlens=cu_seqlens, host_cu_seqlens=list(HOST_CU_SEQLENS),
              W_gate=inputs["W_gate"], **SMALL)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)

    def no_read(*_):
        raise AssertionError("the checks read a tensor to the host")

    for read in ("tolist", "item", "__bool__", "__int__"):
        monkeypatch.setattr(torch.Tensor, read, no_read)
    options = {n: x for n, x in SMALL.items() if not n.startswith("_")}
    _, sequences = validate_nsa_call(
        q, k, v, cu_seqlens=cu_seqlens, max_seqlen=None, W_k=None, W_v=None,
        W_gate=inputs["W_gate"], causal=True, softmax_scale=None, num_cmp_selected_blocks=None,
        q_tile=SMALL["_q_tile"], cmp_kv_block=SMALL["_cmp_kv_block"],
        host_cu_seqlens=HOST_CU_SEQLENS, **options)
    assert sequences.cu_seqlens == HOST_CU_SEQLENS and sequences.max_seqlen == 40


@pytest.mark.parametrize("host, error, match", [
    ((0, 40, 57), ValueError, "host_cu_seqlens must have one entry per entry of cu_seqlens"),
    ((1, 40, 57, 86), ValueError, "host_cu_seqlens must start at 0"),
    ((0, 57, 40, 86), ValueError, "host_cu_seqlens must be non-decreasing"),
    ((0, 40, 57, 85), ValueError, "host_cu_seqlens must end at q's number of rows"),
    (torch.tensor(HOST_CU_SEQLENS), TypeError, "host_cu_seqlens must be a tuple or list"),
    ((0, 40.0, 57, 86), TypeError, "host_cu_seqlens"),
])
def test_bad_host_cu_seqlens_is_refused_naming_it(host, error, match):
    inputs = random_inputs(LENGTHS, HEADS, KV_HEADS, HEAD_DIM, seed=0, dtype=torch.float32)
    with pytest.raises(error, match=match):
        nsa(inputs["q"], inputs["k"], inputs["v"], cu_seqlens=inputs["cu_seqlens"],
            host_cu_seqlens=host, **SMALL)


def test_host_cu_seqlens_without_cu_seqlens_is_refused():
    q = torch.randn(2, 43, HEADS, HEAD_DIM)
    k = v = torch.randn(2, 43, KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="host_cu_seqlens must be None without cu_seqlens"):
        nsa(q, k, v, host_cu_seqlens=(0, 43, 86), **SMALL)


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
def test_compiled_nsa_on_the_kernels_matches_eager(varlen):
    """torch.compile(fullgraph=True, inductor) of nsa() on the sm90 kernels (bf16, D=128, the
    library's default block sizes), forward and backward incl. the gate weights, against eager."""
    from kernels import which_backend

    lengths = [700, 1300, 300] if varlen else [1024, 1024]
    inputs = random_inputs(lengths, 4, 1, 128, seed=1, dtype=torch.bfloat16)
    inputs = {n: (x.cuda() if x is not None else None) for n, x in inputs.items()}
    host = tuple(inputs["cu_seqlens"].tolist())
    assert which_backend(*(inputs[n][None] for n in ("q", "k", "v")), causal=True,
                         backward=True).startswith("sm90")

    def call(q, k, v, W_gate, cu_seqlens):
        if varlen:
            return nsa(q, k, v, cu_seqlens=cu_seqlens, host_cu_seqlens=host, W_gate=W_gate,
                       window_size=256)
        shape = (len(lengths), lengths[0])
        out = nsa(q.unflatten(0, shape), k.unflatten(0, shape), v.unflatten(0, shape),
                  W_gate=W_gate, window_size=256)
        return out.flatten(0, 1)

    names = ("q", "k", "v", "W_gate")

    def loss_and_grads(fn):
        leaves = _leaves(names, inputs)
        out = fn(*leaves.values(), inputs["cu_seqlens"])
        dout = torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape)
        out.backward(dout.to(out.dtype))
        return out.detach().float(), {n: x.grad.float() for n, x in leaves.items()}

    eager = loss_and_grads(call)
    compiled = loss_and_grads(torch.compile(call, fullgraph=True, backend="inductor"))
    # The same kernels run either way; the tolerance covers Inductor's own float32 sums of the
    # gate logits and their gradients.
    _assert_same(eager, compiled, rtol=2e-2, atol=2e-2)


def test_resolved_config_keeps_every_other_field():
    """NSAConfig.resolved spells its fields out (for Dynamo in torch 2.11): a field added later
    and not carried over fails here."""
    import dataclasses

    from nsa.config import NSAConfig

    config = NSAConfig(compress_block_size=32, selected_block_size=64, num_selected_blocks=9,
                       window_size=100, causal=False, softmax_scale=0.3,
                       num_cmp_selected_blocks=2, q_tile=64, cmp_kv_block=16, deterministic=True)
    resolved = config.resolved(softmax_scale=0.7, num_selected_blocks=4)
    assert (resolved.softmax_scale, resolved.num_selected_blocks) == (0.7, 4)
    for field in dataclasses.fields(NSAConfig):
        if field.name not in ("softmax_scale", "num_selected_blocks"):
            assert getattr(resolved, field.name) == getattr(config, field.name), field.name
