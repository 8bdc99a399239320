"""nsa() keeps the device tensors that depend on the sequence bounds only across calls
(sparsity/host_cache.py): a repeated packing launches fewer ops and gives the same bits."""
import pytest
import torch

from nsa import nsa
from nsa_testing import SMALL, differentiable, random_inputs
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


def _flat(value) -> list:
    """Every tensor and every other leaf of a cached value, in host_cache's walk order."""
    leaves = []
    host_cache._map_tensors(value, lambda t: leaves.append(t) or t)
    return leaves


@pytest.mark.parametrize("cmp_selected", [None, 2], ids=["dense-compressed", "sparse-compressed"])
def test_each_host_build_equals_its_device_build(cmp_selected, monkeypatch):
    """Every entry with a CPU twin (`on_host`) that an nsa() forward+backward of a new packing
    asks for: the twin, built from the host bounds, equals the build from the call's tensors
    (dtype, shape, values, and every non-tensor part). On a GPU the twin's result is what the
    call reads (through `to_device`)."""
    host_cache.clear()
    pairs = []
    cached = host_cache.cached

    def recording(key, like, build, on_host=None):
        if on_host is not None:
            pairs.append((key[0], build, on_host))
        return cached(key, like, build, on_host)

    monkeypatch.setattr(host_cache, "cached", recording)
    for module in ("nsa.function", "nsa.selection", "sparsity.builders"):
        monkeypatch.setattr(f"{module}.cached", recording)
    x = differentiable(random_inputs([40, 17, 29, 3], 4, 2, 8, seed=5), torch.float32)
    out = nsa(x["q"], x["k"], x["v"], W_k=x["W_k"], W_v=x["W_v"], W_gate=x["W_gate"],
              cu_seqlens=x["cu_seqlens"], max_seqlen=40,
              host_cu_seqlens=tuple(x["cu_seqlens"].tolist()),
              **dict(SMALL, num_cmp_selected_blocks=cmp_selected))
    out.sum().backward()
    names = {name for name, _, _ in pairs}
    assert {"compressed cu_seqlens", "compressed block starts", "selection layout",
            "selected tile geometry"} <= names, names
    # Query rows from a position on (context parallelism's sequence mode): their twin too.
    from nsa.selection import select_blocks
    from sparsity import QueryRows

    lengths, starts = [40, 17, 29, 3], [16, 0, 16, 0]
    rows_bounds = [0]
    for n, p in zip(lengths, starts):
        rows_bounds.append(rows_bounds[-1] + n - p)
    queries = QueryRows(torch.tensor(rows_bounds, dtype=torch.int32), tuple(rows_bounds),
                        tuple(starts))
    cmp_bounds = [0]
    for n in lengths:
        cmp_bounds.append(cmp_bounds[-1] + n // SMALL["compress_block_size"])
    count = len(pairs)
    select_blocks(torch.randn(rows_bounds[-1], 4, 8), torch.randn(cmp_bounds[-1], 2, 8),
                  x["cu_seqlens"], torch.tensor(cmp_bounds, dtype=torch.int32),
                  compress_block_size=SMALL["compress_block_size"],
                  selected_block_size=SMALL["selected_block_size"], num_selected_blocks=2,
                  softmax_scale=0.3, q_tile=SMALL["_q_tile"],
                  host_bounds=(tuple(x["cu_seqlens"].tolist()), tuple(cmp_bounds)),
                  queries=queries)
    assert {name for name, _, _ in pairs[count:]} == {"selection layout",
                                                      "selected tile geometry"}
    for name, build, on_host in pairs:
        device_leaves, host_leaves = _flat(build()), _flat(on_host())
        assert len(device_leaves) == len(host_leaves), name
        for a, b in zip(device_leaves, host_leaves):
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
            else:
                assert type(a) is type(b) and a == b, name
    host_cache.clear()


def test_to_device_keeps_the_structure_and_copies_every_tensor():
    from nsa.selection import _BlockRanges
    from sparsity import QueryRows

    rows = QueryRows(torch.tensor([0, 5, 9], dtype=torch.int32), (0, 5, 9), (0, 16))
    strided = torch.arange(15).view(3, 5)[:, 2]  # a column: 64-bit elements 5 apart
    value = (strided, None, 3, [torch.ones(2, 3, dtype=torch.bool)[:, 1]],
             {"a": torch.empty(0, 4)}, _BlockRanges(torch.tensor([1, 2]),
                                                    torch.tensor([3.5]), float("inf")), rows)
    moved = host_cache.to_device(value, torch.device("cpu"))
    assert moved[1] is None and moved[2] == 3 and moved[5].block0 == float("inf")
    assert isinstance(moved[3], list) and isinstance(moved[5], _BlockRanges)
    assert isinstance(moved[6], QueryRows) and moved[6].start_positions == (0, 16)
    for a, b in zip(_flat(value), _flat(moved)):
        if isinstance(a, torch.Tensor):
            assert b is not a and b.is_contiguous() and b.dtype == a.dtype
            assert torch.equal(a, b)
    assert moved[4]["a"].shape == (0, 4)
