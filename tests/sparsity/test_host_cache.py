"""sparsity.host_cache: device tensors of host values kept across calls."""
import pytest
import torch

from sparsity import host_cache


@pytest.fixture(autouse=True)
def empty_cache():
    host_cache.clear()
    yield
    host_cache.clear()


def test_a_key_builds_once_and_returns_the_same_tensors():
    like = torch.zeros(3)
    builds = []

    def build():
        builds.append(1)
        return torch.arange(5)

    first = host_cache.cached(("rows", (0, 5), 4), like, build)
    again = host_cache.cached(("rows", (0, 5), 4), like, build)
    other = host_cache.cached(("rows", (0, 6), 4), like, build)
    assert first is again and other is not first and len(builds) == 2


def test_the_oldest_entries_go_first():
    like = torch.zeros(1)
    for n in range(host_cache.MAX_ENTRIES + 2):
        host_cache.cached(("n", n), like, lambda n=n: torch.tensor([n]))
    builds = []
    host_cache.cached(("n", 0), like, lambda: builds.append(1) or torch.tensor([0]))
    host_cache.cached(("n", host_cache.MAX_ENTRIES + 1), like,
                      lambda: builds.append(1) or torch.tensor([0]))
    assert builds == [1]  # key 0 was evicted, the newest key was kept


def test_meta_tensors_bypass_the_cache():
    like = torch.empty(3, device="meta")
    builds = []
    for _ in range(2):
        host_cache.cached(("meta",), like, lambda: builds.append(1) or torch.empty(2,
                                                                                   device="meta"))
    assert len(builds) == 2


def test_during_a_capture_nothing_is_stored_and_what_is_read_is_pinned(monkeypatch):
    """While a graph is captured (faked here): a miss builds without storing (its tensor has no
    values until replay); a hit pins the entry, which no later eviction may free (the graph
    reads its memory at every replay)."""
    like = torch.zeros(1)
    kept = host_cache.cached(("kept",), like, lambda: torch.tensor([1]))
    monkeypatch.setattr(host_cache, "_capturing", lambda like: True)
    assert host_cache.cached(("kept",), like, lambda: torch.tensor([2])) is kept
    host_cache.cached(("built in capture",), like, lambda: torch.tensor([3]))
    monkeypatch.setattr(host_cache, "_capturing", lambda like: False)
    builds = []
    host_cache.cached(("built in capture",), like, lambda: builds.append(1) or torch.tensor([3]))
    assert builds == [1]  # not stored during the capture: built again
    for n in range(3 * host_cache.MAX_ENTRIES):  # enough new keys to evict every unpinned one
        host_cache.cached(("n", n), like, lambda: torch.tensor([n]))
    assert host_cache.cached(("kept",), like, lambda: torch.tensor([4])) is kept


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nothing_built_during_a_graph_capture_is_kept():
    """A tensor built while a stream is captured holds no values until the graph replays: a
    later eager call must build its own, never find that one."""
    like = torch.zeros(1, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = host_cache.cached(("captured",), like, lambda: like + 1)
    builds = []
    eager = host_cache.cached(("captured",), like, lambda: builds.append(1) or like + 1)
    assert builds == [1] and eager is not captured
    assert eager.item() == 1.0
