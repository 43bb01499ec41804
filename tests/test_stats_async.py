"""AsyncRead (and ``PagePool.stats_async``, ``HostMirror.snapshot`` on it): what it refuses before any copy."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import tpool
from conftest import requires_cuda
from tpool.stats_async import AsyncRead


def test_a_bare_tensor_is_refused_not_read_as_a_sequence_of_its_entries():
    """``AsyncRead(t)`` iterated the tensor: its entries became 0-d tensors, each copied on its own, and
    ``values()`` answered ``[0, 1, 2]`` where ``AsyncRead([t])`` answers ``[[0, 1, 2]]``."""
    with pytest.raises(ValueError, match=r"tensors: expected a sequence of tensors, got a Tensor; pass \[t\]"):
        AsyncRead(torch.arange(3))
    assert AsyncRead([torch.arange(3)]).values() == [[0, 1, 2]]


def test_a_read_of_cuda_tensors_inside_graph_capture_is_refused_before_any_copy(monkeypatch):
    """A ``stats_async()`` (or a mirror's ``snapshot()``) inside a captured step recorded the copy into the
    graph: nothing was read at capture, every replay wrote pinned memory the handle may no longer own, and
    its event, recorded in the capture, cannot be asked afterwards. Simulated on a CPU: a fake CUDA tensor
    and a capture that is on as far as AsyncRead asks; the refusal comes before the pinned buffer is made."""
    with FakeTensorMode():
        on_cuda = torch.zeros(3, dtype=torch.int64, device="cuda")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"AsyncRead inside CUDA graph capture.*between replays"):
        AsyncRead([on_cuda])
    r = AsyncRead([torch.arange(3)])   # a CPU copy is made at once, not captured: as before
    assert r.ready() and r.values() == [[0, 1, 2]]


@requires_cuda
@pytest.mark.gpu
def test_stats_async_inside_a_real_capture_is_refused_and_works_between_replays():
    pool = tpool.PagePool(64, device="cuda", backend="reference")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="AsyncRead inside CUDA graph capture"):
        with torch.cuda.graph(graph):
            pool.stats_async()
    handle = pool.stats_async()
    torch.cuda.synchronize()
    assert handle.ready() and handle.get()["pages.free.current"] == 64
