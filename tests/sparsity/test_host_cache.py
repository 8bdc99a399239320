"""sparsity.host_cache: device tensors of host values kept across calls."""
import weakref
from types import SimpleNamespace

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


def test_fake_tensors_bypass_the_cache_wrapped_or_not():
    """A fake tensor (torch.compile's tracing) is never kept, also inside a functional wrapper
    (its functionalization): each call builds. A wrapper of a real tensor (functionalize, vmap)
    is cached as the real one is; the plain-tensor shortcut decides only plain tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functionalize, vmap

    builds = []

    def build():
        builds.append(1)
        return torch.arange(2)

    def twice(x, key):
        for _ in range(2):
            host_cache.cached((key,), x, build)
        return x + 1
    with FakeTensorMode():
        fake = torch.zeros(3)
        twice(fake, "fake")
        functionalize(lambda x: twice(x, "fake"))(fake)
        twice(torch._to_functional_tensor(fake), "fake")  # a plain Tensor type around it
        vmap(lambda x: twice(x, "fake"))(torch.zeros(2, 3))  # a functorch wrapper of a fake
    assert len(builds) == 8
    functionalize(lambda x: twice(x, "real"))(torch.zeros(3))
    vmap(lambda x: twice(x, "real"))(torch.zeros(2, 3))
    assert len(builds) == 9  # built once, read by the wrapped calls after it
    assert host_cache._plain_tensor(torch.zeros(1))


def test_meta_tensors_bypass_the_cache():
    like = torch.empty(3, device="meta")
    builds = []
    for _ in range(2):
        host_cache.cached(("meta",), like, lambda: builds.append(1) or torch.empty(2,
                                                                                   device="meta"))
    assert len(builds) == 2


@pytest.fixture
def side_stream(monkeypatch):
    """A side stream on the CPU: not the default stream, not capturing, its id `stream[0]`
    (7; a test may change it); the stream operations of its reads recorded instead of made
    (`("default",)`: a build queued on the default stream; `("ordered", value, ready)`: a
    first read of the entry by this stream, made to wait for `ready`, the build's event (None:
    recorded now) and recorded on the entry's tensors)."""
    events, stream = [], [7]
    monkeypatch.setattr(host_cache, "on_default_stream", lambda like: False)
    monkeypatch.setattr(host_cache, "_capturing", lambda like: False)
    monkeypatch.setattr(host_cache, "current_stream_id", lambda like: (0, stream[0]))

    def on_default(index, work):
        events.append(("default",))
        return work()

    def order(index, value, ready):
        events.append(("ordered", value, ready))
        return ready or "event"
    monkeypatch.setattr(host_cache, "_queued_on_default_stream", on_default)
    monkeypatch.setattr(host_cache, "_order_side_read", order)
    return events, stream


def test_a_side_stream_reads_entries_and_stores_its_misses_built_on_the_default_stream(
        side_stream, monkeypatch):
    """A stream that is neither the default one nor capturing (a user's, or torch.cuda.graph's
    warm-up stream) reads what the default stream stored, and a miss is built on the default
    stream and stored there; a stream's first read of an entry waits for its build (one event
    per entry) and records the stream, its later reads do nothing more."""
    events, stream = side_stream
    like = torch.zeros(1)
    monkeypatch.setattr(host_cache, "on_default_stream", lambda like: True)
    kept = host_cache.cached(("kept",), like, lambda: torch.tensor([1]))
    monkeypatch.setattr(host_cache, "on_default_stream", lambda like: False)
    builds = []
    assert host_cache.cached(("kept",), like, lambda: builds.append(1)) is kept
    new = host_cache.cached(("new",), like, lambda: builds.append(1) or torch.tensor([3]))
    assert host_cache.cached(("new",), like, lambda: builds.append(1)) is new
    assert host_cache.cached(("kept",), like, lambda: builds.append(1)) is kept
    stream[0] = 8  # another side stream: its first read waits for the same event
    assert host_cache.cached(("new",), like, lambda: builds.append(1)) is new
    assert host_cache.cached(("new",), like, lambda: builds.append(1)) is new
    assert builds == [1]
    assert events == [("ordered", kept, None), ("default",), ("ordered", new, None),
                      ("ordered", new, "event")]
    assert host_cache._side_reads[(("new",), like.device)] == ("event", frozenset({7, 8}))
    monkeypatch.setattr(host_cache, "on_default_stream", lambda like: True)
    assert host_cache.cached(("new",), like, lambda: torch.tensor([4])) is new
    for n in range(host_cache.MAX_ENTRIES):  # evicts both, and what their reads recorded
        host_cache.cached(("n", n), like, lambda n=n: torch.tensor([n]))
    assert not host_cache._side_reads


def test_a_pinning_capture_reads_hits_and_pins_them(monkeypatch):
    """Inside `pinned_for_capture` (nsa()'s captured plans; the capture's stream faked here) a
    hit is read, not rebuilt, and goes into the owner's pins; a miss is built and not
    stored."""
    like = torch.zeros(1)
    kept = host_cache.cached(("kept",), like, lambda: torch.tensor([1]))
    monkeypatch.setattr(host_cache, "on_default_stream", lambda like: False)
    monkeypatch.setattr(host_cache, "_capturing", lambda like: True)
    builds, pins = [], []
    with host_cache.pinned_for_capture(pins):
        assert host_cache.cached(("kept",), like, lambda: builds.append(1)) is kept
        host_cache.cached(("new",), like, lambda: builds.append(1) or torch.tensor([3]))
    assert builds == [1] and len(pins) == 1 and pins[0] is kept
    assert not host_cache._captured_entries  # the owner keeps it, not the cache
    monkeypatch.setattr(host_cache, "on_default_stream", lambda like: True)
    builds.clear()
    host_cache.cached(("new",), like, lambda: builds.append(1) or torch.tensor([3]))
    assert builds == [1]  # the capture's miss was not stored


def test_a_capture_without_an_owner_keeps_what_it_read_past_eviction(monkeypatch):
    """A user's own capture (no `pinned_for_capture`) reads a hit too; the entry then stays
    alive past the cache's eviction (the graph may replay any time) until clear()."""
    like = torch.zeros(1)
    kept = host_cache.cached(("kept",), like, lambda: torch.tensor([1]))
    monkeypatch.setattr(host_cache, "on_default_stream", lambda like: False)
    monkeypatch.setattr(host_cache, "_capturing", lambda like: True)
    assert host_cache.cached(("kept",), like, lambda: torch.tensor([2])) is kept
    monkeypatch.setattr(host_cache, "on_default_stream", lambda like: True)
    for n in range(host_cache.MAX_ENTRIES + 1):  # evicts ("kept",) from the LRU entries
        host_cache.cached(("n", n), like, lambda n=n: torch.tensor([n]))
    assert list(host_cache._captured_entries.values()) == [kept]
    monkeypatch.setattr(host_cache, "on_default_stream", lambda like: False)
    assert host_cache.cached(("kept",), like, lambda: torch.tensor([3])) is kept
    host_cache.clear()
    assert not host_cache._captured_entries


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_pinning_capture_replays_without_rebuilding_the_entries():
    """On the GPU: a capture inside `pinned_for_capture` reads the default stream's entry; the
    graph replays against it (its values, not a copy made at capture)."""
    like = torch.zeros(1, device="cuda")
    kept = host_cache.cached(("kept",), like, lambda: like + 1)
    builds, pins = [], []
    out = torch.zeros(1, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with host_cache.pinned_for_capture(pins), torch.cuda.graph(graph):
        read = host_cache.cached(("kept",), like, lambda: builds.append(1) or like + 2)
        out.copy_(read * 10)
    assert builds == [] and read is kept and pins == [kept]
    graph.replay()
    torch.cuda.synchronize()
    assert out.item() == 10.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_capture_reads_hits_and_stores_nothing_and_a_side_stream_reads_and_stores():
    """On the GPU: a capture (torch.cuda.graph, on a stream of its own) reads an entry already
    built and builds its misses without storing them; a side stream that is not capturing
    reads the entries and stores its misses, built on the default stream (torch.cuda.graph's
    recipe: the warm-up on a side stream leaves what the capture reads)."""
    like = torch.zeros(1, device="cuda")
    kept = host_cache.cached(("kept",), like, lambda: like + 1)
    builds = []
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = host_cache.cached(("kept",), like, lambda: builds.append(1) or like + 2)
        host_cache.cached(("in capture",), like, lambda: builds.append(1) or like + 3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        stored = host_cache.cached(("on a side stream",), like,
                                   lambda: builds.append(1) or like + 4)
        read = host_cache.cached(("kept",), like, lambda: builds.append(1) or like + 5)
        doubled = stored * 2
    torch.cuda.current_stream().wait_stream(side)
    assert builds == [1, 1] and captured is kept and read is kept
    graph.replay()
    assert kept.item() == 1.0 and doubled.item() == 8.0
    builds.clear()
    assert host_cache.cached(("on a side stream",), like, lambda: like + 6) is stored
    host_cache.cached(("in capture",), like, lambda: builds.append(1) or like + 7)
    assert builds == [1]  # the capture's miss was not stored


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_side_stream_entry_is_built_after_its_stream_and_outlives_its_reads():
    """On the GPU: a side stream's miss is built on the default stream after the side stream's
    queued work (the build reads a tensor the side stream is still writing), and an entry it
    read, when evicted, keeps its memory from the default stream's allocations until the side
    stream's work queued until then is done: zeros written at once into new default-stream
    tensors never reach the side stream's pending read."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    source = torch.zeros(1 << 20, device="cuda")
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # tens of milliseconds of a busy side stream
        source.fill_(3.0)
        entry = host_cache.cached(("built after the side stream",), source, lambda: source * 2)
    torch.cuda.synchronize()
    assert entry.min().item() == 6.0  # the build saw the side stream's fill
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        total = entry.sum()  # read on the side stream, after the sleep
    del entry
    host_cache.clear()  # evicted while the side stream has not read it yet
    taken = [torch.zeros(1 << 20, device="cuda") for _ in range(4)]  # written at once
    torch.cuda.synchronize()
    assert total.item() == 6.0 * (1 << 20) and all(t.abs().sum().item() == 0 for t in taken)


def test_entries_built_under_inference_mode_serve_training_calls():
    """An entry stored by a call under torch.inference_mode() is a normal tensor: a later
    autograd call may save it for backward."""
    like = torch.empty(1)
    with torch.inference_mode():
        kept = host_cache.cached(("weights",), like, lambda: torch.full((3,), 0.5))
    assert not kept.is_inference()
    x = torch.ones(3, requires_grad=True)
    (x * host_cache.cached(("weights",), like, lambda: None)).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 0.5))


def test_entries_evicted_while_a_side_stream_is_forked_live_until_its_join():
    """Between `forked_side_stream`'s fork and its join, an entry the side stream may still
    read is not let go when evicted: only after `join()` (the default stream then waits for
    the side stream, so reusing the memory is ordered after the reads)."""
    like = torch.zeros(1)
    ref = weakref.ref(host_cache.cached(("first",), like, lambda: torch.tensor([1])))
    side = SimpleNamespace(device=torch.device("cuda", 0), stream_id=7)  # no GPU needed
    alive_at_join = []
    with host_cache.forked_side_stream(side, lambda: alive_at_join.append(ref() is not None)):
        assert host_cache._forked_stream == (0, 7)
        for n in range(host_cache.MAX_ENTRIES):  # evicts ("first",)
            host_cache.cached(("n", n), like, lambda n=n: torch.tensor([n]))
        assert all(key[0] != ("first",) for key in host_cache._entries)
        assert ref() is not None
    assert alive_at_join == [True]
    assert ref() is None and host_cache._forked_stream is None
    host_cache.clear()


def test_a_forked_side_stream_joins_even_when_its_work_raises():
    side = SimpleNamespace(device=torch.device("cuda", 0), stream_id=7)
    joins = []
    with pytest.raises(ValueError, match="inside"):
        with host_cache.forked_side_stream(side, lambda: joins.append(1)):
            raise ValueError("inside")
    assert joins == [1] and host_cache._forked_stream is None
