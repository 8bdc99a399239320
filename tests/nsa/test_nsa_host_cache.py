"""nsa() keeps the device tensors that depend on the sequence bounds only across calls
(sparsity/host_cache.py): a repeated packing launches fewer ops and gives the same bits."""
import pytest
import torch

from nsa import nsa
from nsa_testing import SMALL, random_inputs
from op_counting import OpCounter
from sparsity import host_cache


@pytest.mark.parametrize("layout", ["varlen", "padded"])
def test_a_repeated_packing_launches_fewer_ops_and_gives_the_same_bits(layout, monkeypatch):
    host_cache.clear()
    x = random_inputs([40, 17, 29], 4, 2, 8, seed=4, dtype=torch.float32, weights=False)
    if layout == "varlen":
        args = dict(cu_seqlens=x["cu_seqlens"], max_seqlen=40,
                    host_cu_seqlens=tuple(x["cu_seqlens"].tolist()))
        q, k, v = x["q"], x["k"], x["v"]
    else:
        args = {}
        q, k, v = (x[n][:80].reshape(2, 40, *x[n].shape[1:]) for n in "qkv")
    options = dict(SMALL, num_cmp_selected_blocks=None)
    counts, outputs = [], []
    for _ in range(2):
        counter = OpCounter(monkeypatch)
        with counter, torch.no_grad():
            outputs.append(nsa(q, k, v, **args, **options))
        counts.append(sum(counter.ops.values()))
    assert torch.equal(outputs[0], outputs[1])
    assert counts[1] < counts[0] - 20, counts  # layouts, ranges, geometry, compression rows
    host_cache.clear()
