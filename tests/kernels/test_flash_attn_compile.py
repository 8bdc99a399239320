"""torch.compile(fullgraph=True) of models calling kernels.flash_attn_func, on the CPU: compiles,
forward and backward, and matches eager; the custom ops of kernels/ops.py pass
torch.library.opcheck; what is not supported under compile yet is refused by name.
"""
import pytest
import torch
from torch import nn

import kernels
from kernels import ops


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # every test compiles from scratch: no cache hit hides a failure
    yield
    torch._dynamo.reset()


OPTIONS = {
    "causal": dict(causal=True),
    "window": dict(causal=True, window_size=(5, 0)),
    "compressed": dict(causal=True, compress_factor=4),
    "non-causal-scaled": dict(softmax_scale=0.3),
}


def _inputs(options: dict, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    keys = 24 // options.get("compress_factor", 1)
    q = torch.randn(2, 24, 4, 16, generator=generator)
    k = torch.randn(2, keys, 2, 16, generator=generator)
    v = torch.randn(2, keys, 2, 16, generator=generator)
    return [t.requires_grad_() for t in (q, k, v)]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_flash_attn_func_compiles_fullgraph_and_matches_eager(name, backend):
    options = OPTIONS[name]

    def attend(q, k, v):
        out, lse = kernels.flash_attn_func(q, k, v, return_lse=True, **options)
        return out.square().sum() + lse.sum().detach()

    eager_inputs, compiled_inputs = _inputs(options), _inputs(options)
    eager = attend(*eager_inputs)
    eager.backward()
    compiled = torch.compile(attend, fullgraph=True, backend=backend)(*compiled_inputs)
    compiled.backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    for got, want in zip(compiled_inputs, eager_inputs):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-5)


def test_a_compiled_module_with_projections_matches_eager():
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(32, 3 * 32)
            self.out = nn.Linear(32, 32)

        def forward(self, x):
            q, k, v = self.qkv(x).view(*x.shape[:2], 3, 2, 16).unbind(2)
            return self.out(kernels.flash_attn_func(q, k, v, causal=True).flatten(2))

    torch.manual_seed(0)
    layer = Layer()
    x = torch.randn(2, 20, 32)
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x), rtol=1e-5, atol=1e-5)
    compiled(x).square().sum().backward()
    grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    layer(x).square().sum().backward()
    for got, param in zip(grads, layer.parameters()):
        torch.testing.assert_close(got, param.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_ops_pass_opcheck(deterministic):
    q, k, v = (t.detach() for t in _inputs({}))
    ops_args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), None, True, 7, 0, 1,
                deterministic)
    torch.library.opcheck(ops.attention_forward_op, ops_args)
    out, lse = ops.attention_forward_op(*(t.detach() for t in ops_args[:3]), *ops_args[3:])
    torch.library.opcheck(ops.attention_backward_op,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse,
                           None, True, 7, 0, 1, deterministic))


def test_what_does_not_compile_yet_is_refused_by_name():
    q, k, v = _inputs({})
    from sparsity import build_block_sparse_from_mask

    mask = torch.ones(1, 1, 24, 24, dtype=torch.bool).tril()
    lists = build_block_sparse_from_mask(mask, q_tile=8, kv_block=8)

    def sparse(q, k, v):
        return kernels.flash_attn_func(q, k, v, block_sparse=lists)

    with pytest.raises(Exception, match="block_sparse: not supported under torch.compile"):
        torch.compile(sparse, fullgraph=True, backend="aot_eager")(q, k, v)

    cu = torch.tensor([0, 10, 24], dtype=torch.int32)

    def varlen(q, k, v):
        return kernels.flash_attn_varlen_func(q, k, v, cu, cu, 14, 14)

    with pytest.raises(Exception, match="flash_attn_varlen_func: not supported under torch"):
        torch.compile(varlen, fullgraph=True, backend="aot_eager")(q[0], k[0], v[0])
