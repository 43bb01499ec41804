"""Asynchronous reads of device tensors: start a copy now, read it later without a stall.

Note: on CUDA, :class:`AsyncRead` copies each tensor into pinned host memory with
``non_blocking=True`` on the current stream and records an event after the
copies; ``ready()`` asks the event (``cudaEventQuery``, never a wait) and
``values()`` reads the host copies, waiting on the event only if they are not
ready yet (the one case that stalls: ask ``ready()`` first). On a CPU the copy
is done at once and ``ready()`` is always True. The copies are taken in stream
order: they show the state after every call issued before the read started,
and none issued after it. A read of CUDA tensors is refused (``RuntimeError``) while the
current stream captures a CUDA graph: start it between replays.

The host copies carry the attribute :data:`HOST_SNAPSHOT_ATTR`, a one-item
list that ``ready()`` sets to True once it has said so, so the test guards in
:mod:`tpool.testing` know that reading them is a read of host memory filled by
a finished copy, not a read of device data, and that a read before ``ready()``
said True would wait for the copy on CUDA (a stall the guards report).
"""

import torch

from tpool.kernels import layout as L
from tpool.state import clones_between_calls

HOST_SNAPSHOT_ATTR = "_tpool_host_snapshot"  # on host copies AsyncRead filled: [whether ready() said True]


class AsyncRead:
    """A non-blocking device-to-host copy of some tensors.

    Parameters
    ----------
    tensors : sequence of torch.Tensor
        Any shapes and dtypes, contiguous, all on one device (CUDA or CPU).

    Raises
    ------
    ValueError
        ``tensors`` is a tensor itself (pass ``[t]``), is empty, holds something that is not a
        tensor, or tensors that are not contiguous or not on one device.
    RuntimeError
        CUDA tensors while the current stream is capturing a CUDA graph (start the read between
        replays: a captured copy would land at each replay, not now).

    Example
    -------
    >>> r = AsyncRead([torch.arange(3)])
    >>> r.ready(), r.values()
    (True, [[0, 1, 2]])
    """

    def __init__(self, tensors):
        if isinstance(tensors, torch.Tensor):  # (list() would make one 0-d tensor of each entry)
            raise ValueError(f"tensors: expected a sequence of tensors, got a {type(tensors).__name__}; pass [t]")
        tensors = list(tensors)
        if not tensors:
            raise ValueError("tensors: expected at least one tensor, got none")
        if not isinstance(tensors[0], torch.Tensor):
            raise ValueError(f"tensors: expected tensors, got {type(tensors[0]).__name__}")
        device = tensors[0].device
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device != device:
                raise ValueError(f"tensors: expected tensors on one device ({device}), got "
                                 f"{t.device if isinstance(t, torch.Tensor) else type(t).__name__}")
            if not t.is_contiguous():  # (a CPU copy between two pool calls copies whole byte spans)
                raise ValueError(f"tensors: expected contiguous tensors, got shape {tuple(t.shape)} with stride "
                                 f"{t.stride()}; pass .contiguous()")
        self.device = device
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # Captured, the copy and the event would run only at replays, into pinned memory this handle
            # may no longer hold, and an event recorded in a capture cannot be asked (cudaEventQuery).
            raise RuntimeError("AsyncRead inside CUDA graph capture (pool.stats_async(), a mirror's snapshot()): "
                               "the graph would repeat the copy at every replay, into host memory this read may "
                               "no longer own, and nothing would be read now; start it between replays")
        if device.type == "cuda":
            self._host = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True) for t in tensors]
            with torch.cuda.device(device):  # the copies and the event on the tensors' device's stream
                for h, t in zip(self._host, tensors):
                    h.copy_(t, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record()
        else:
            self._host = clones_between_calls(tensors)  # (no numba call of another thread lands between)
            self._event = None
        self._asked = [False]  # ready() said True (the guards read it through each host copy)
        for h in self._host:
            setattr(h, HOST_SNAPSHOT_ATTR, self._asked)

    def ready(self) -> bool:
        """True once the copies have landed (never waits)."""
        landed = self._event is None or self._event.query()
        self._asked[0] = self._asked[0] or landed
        return landed

    def values(self) -> list:
        """The copied tensors as nested Python lists; waits for the copy if it is not ready."""
        return [h.tolist() for h in self.host()]

    def host(self) -> list:
        """The host copies (CPU tensors: ``.numpy()`` reads them without a copy); waits for the copy if
        it is not ready."""
        if self._event is not None and not self._event.query():
            self._event.synchronize()
        return self._host


def stats_from_counters(num_pages: int, c: list) -> dict:
    """The dict of :meth:`tpool.PagePool.stats` from a list of the pool's counters."""
    used = num_pages - c[L.FREE_COUNT] - c[L.CACHED_COUNT]
    s = {
        "pages.total": num_pages,
        "pages.free.current": c[L.FREE_COUNT],
        "pages.used.current": used,
        "pages.used.peak": c[L.USED_PEAK],
        "pages.cached.current": c[L.CACHED_COUNT],
        "pages.cached.peak": c[L.CACHED_PEAK],
        "pages.allocated": c[L.ALLOCATED],
        "pages.freed": c[L.FREED],
        "pages.evicted": c[L.EVICTED],
        "pages.revived": c[L.REVIVED],
        "requests.failed": c[L.FAILED_REQUESTS],
        "clock": c[L.CLOCK],
    }
    for slot, name in L.ERROR_NAMES.items():
        s[f"errors.{name}"] = c[slot]
    for slot, name in L.OVERFLOW_NAMES.items():  # the buffers behind errors.out_overflow (not errors themselves)
        s[f"overflows.{name}"] = c[slot]
    return s


class StatsHandle:
    """What :meth:`tpool.PagePool.stats_async` returns: ``ready()`` and ``get()``.

    ``get()`` returns the dict :meth:`~tpool.PagePool.stats` would have returned
    when ``stats_async()`` was called (later calls do not show in it). On a CPU
    it is ready at once; on CUDA ask ``ready()`` before ``get()`` to never stall.
    """

    def __init__(self, pool):
        self.num_pages = pool.num_pages
        with pool.state.lock:  # the copy starts between two calls (reference, triton), never inside one
            self._read = AsyncRead([pool.state.counters])

    def ready(self) -> bool:
        return self._read.ready()

    def get(self) -> dict:
        return stats_from_counters(self.num_pages, self._read.values()[0])
