"""PagePool: a fixed set of pages whose allocator state lives in device tensors.

Note: the hot-path calls (``alloc``, ``free``, ``incref``, ``touch``,
``evict``) check their inputs from tensor metadata, launch a fixed-shape
kernel pass, and return without reading device memory on the host. Whether a
request succeeded is device data (``ok``); misuse is counted on the device.
The host learns results only at the sync points ``available()``, ``stats()``,
``check()`` and ``check_invariants()``, or without a stall from
``stats_async()``. The device clock advances by one per hot-path call (a
call's LRU stamps all carry the same value; eviction breaks ties by page id).
"""

from typing import NamedTuple

import numpy as np
import torch

from tpool import _checks
from tpool.backends import make_backend, resolve_backend
from tpool.errors import InvariantViolation, raise_for_errors
from tpool.free_group import FreeGroup
from tpool.kernels import layout as L
from tpool.state import INT32_MAX, PoolState
from tpool.stats_async import StatsHandle, stats_from_counters

_Tensor, _int32 = torch.Tensor, torch.int32  # module globals: read on every hot-path call
# ``t.stride() == (1,)``: 1-D and contiguous in one metadata call. It misses only 1-D
# tensors of at most one element with another stride; those take the full check.
_UNIT_STRIDE = (1,)

DEFAULT_MAX_BATCH = 4096        # requests per alloc call
DEFAULT_MAX_ALLOC_PAGES = 4096  # pages per alloc call without an out= buffer


class AllocResult(NamedTuple):
    """Outputs of :meth:`PagePool.alloc`, all on the pool's device.

    pages : int32 ``[max_pages]``: granted pages, request by request, -1 padded.
    indptr : int32 ``[max_batch + 1]``: request ``i`` got ``pages[indptr[i]:indptr[i+1]]``.
    ok : bool ``[max_batch]``: request granted (False past the batch).
    evicted : int32 ``[max_pages]``: cached pages evicted by this call, oldest first, -1 padded.
    """

    pages: torch.Tensor
    indptr: torch.Tensor
    ok: torch.Tensor
    evicted: torch.Tensor


class AllocOut:
    """Preallocated, reusable outputs for :meth:`PagePool.alloc` (``out=``).

    Made by :meth:`PagePool.alloc_out`. Its tensors never change identity, so a
    CUDA graph can capture an alloc that writes them; each call overwrites them.
    """

    def __init__(self, pool: "PagePool", max_batch: int, max_pages: int):
        device = pool.device
        i32 = dict(dtype=torch.int32, device=device)
        self.pool, self.max_batch, self.max_pages, self.device = pool, max_batch, max_pages, device
        self.result = AllocResult(
            pages=torch.full((max_pages,), L.NULL_PAGE, **i32),
            indptr=torch.zeros(max_batch + 1, **i32),
            ok=torch.zeros(max_batch, dtype=torch.bool, device=device),
            evicted=torch.full((max_pages,), L.NULL_PAGE, **i32),
        )
        self.pages, self.indptr, self.ok, self.evicted = self.result
        # The pool's alloc bound to these buffers: run(counts, B, evict).
        self.run = pool._impl.bind_alloc(self)


class PagePool:
    """A pool of ``num_pages`` pages of ``page_size`` tokens, managed on ``device``.

    Parameters
    ----------
    num_pages : int
        Pages in the pool; ids are ``0 .. num_pages - 1``.
    page_size : int
        Tokens per page (used by page tables for slot indices).
    device : torch.device or str, optional
        Where the state lives; default CUDA if available, else CPU.
    backend : {"auto", "reference", "numba", "triton"}
        ``auto`` is triton on CUDA and numba on CPU; ``TPOOL_BACKEND`` overrides it.
    max_batch : int
        Most requests in one ``alloc`` call.
    max_alloc_pages : int, optional
        Length of ``pages`` returned by ``alloc`` without ``out=``
        (default ``min(num_pages, 4096)``).

    Example
    -------
    >>> pool = PagePool(8, device="cpu", backend="reference")
    >>> r = pool.alloc(torch.tensor([2, 3, 9], dtype=torch.int32))
    >>> r.pages[:6].tolist(), r.indptr.tolist(), r.ok.tolist()
    ([0, 1, 2, 3, 4, -1], [0, 2, 5, 5], [True, True, False])
    >>> pool.free(r.pages)          # -1 entries are ignored
    >>> pool.available()            # a sync point
    8
    """

    def __init__(self, num_pages: int, page_size: int = 1, *, device=None, backend: str = "auto",
                 max_batch: int = DEFAULT_MAX_BATCH, max_alloc_pages: int | None = None):
        for name, v in (("num_pages", num_pages), ("page_size", page_size), ("max_batch", max_batch)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        if num_pages >= INT32_MAX:
            raise ValueError(f"num_pages: expected < {INT32_MAX}, got {num_pages}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_pages, self.page_size, self.max_batch = num_pages, page_size, max_batch
        if max_alloc_pages is not None and (not isinstance(max_alloc_pages, int) or max_alloc_pages < 1):
            raise ValueError(f"max_alloc_pages: expected a positive int or None, got {max_alloc_pages!r}")
        self.max_alloc_pages = max_alloc_pages or min(num_pages, DEFAULT_MAX_ALLOC_PAGES)
        self.backend = resolve_backend(backend, self.device)
        self.state = PoolState.create(num_pages, self.device)
        self._impl = make_backend(self.backend, self.state)
        self._errors_seen = [0] * L.NUM_COUNTERS
        self._group = None
        self._group_buffers = {}  # capacity -> int32 [2, capacity], see FreeGroup

    def __reduce_ex__(self, protocol):
        raise TypeError("a PagePool cannot be copied or pickled: its kernels are bound to the addresses of "
                        "its state tensors; make a new PagePool (tpool.graphs.preserved snapshots state)")

    def __repr__(self):
        return (f"PagePool(num_pages={self.num_pages}, page_size={self.page_size}, "
                f"device={self.device}, backend={self.backend!r})")

    # ------------------------------------------------------------ hot path
    def _vector(self, t, name, max_len=None, dtype=torch.int32):
        return _checks.check_vector(t, name, dtype, self.device, max_len)

    def _pages_ok(self, t) -> bool:
        """The common case of the ``pages`` check (it runs on every call); False sends a
        tensor to the full check, which decides."""
        return (type(t) is _Tensor and t.dtype is _int32 and t.device == self.device
                and t.stride() == _UNIT_STRIDE)

    def alloc_out(self, max_batch: int | None = None, max_pages: int | None = None) -> AllocOut:
        """Preallocate outputs for ``alloc(..., out=)`` (graph capture, no per-call allocation).

        ``max_batch`` (default ``self.max_batch``) sizes ``indptr``/``ok``, which are
        padded past the batch on every call: size it to the batches you run.
        ``max_pages`` (default ``self.max_alloc_pages``) sizes ``pages``/``evicted``.
        """
        for name, v in (("max_batch", max_batch), ("max_pages", max_pages)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name}: expected a positive int or None, got {v!r}")
        return AllocOut(self, max_batch or self.max_batch, max_pages or self.max_alloc_pages)

    def alloc(self, counts: torch.Tensor, *, out: AllocOut | None = None, evict: bool = False) -> AllocResult:
        """Grant ``counts[i]`` pages to each request, first come first served.

        Request ``i`` is granted iff no count in ``counts[:i+1]`` is negative and
        ``counts[0] + ... + counts[i]`` is at most the free pages (free plus cached
        with ``evict=True``) and at most ``len(pages)``; so once a request fails,
        all later ones fail. Pages are popped from the top of the free stack in
        request order and start with reference count 1. With ``evict=True`` only
        the shortfall is evicted, oldest first, and reported in ``evicted``.

        Parameters
        ----------
        counts : torch.Tensor
            shape ``[B]``, int32, on the pool's device, ``B <= out.max_batch``.
        out : AllocOut, optional
            Buffers to write, made by this pool's :meth:`alloc_out` (the pool's kernel
            is bound to them); default fresh tensors with ``max_batch = B`` and
            ``max_pages = self.max_alloc_pages``.
        evict : bool
            May evict cached pages to cover the request.

        Returns
        -------
        AllocResult ``(pages, indptr, ok, evicted)``; see :class:`AllocResult`.
        """
        if out is None:
            b = self._vector(counts, "counts", self.max_batch)
            out = AllocOut(self, b, self.max_alloc_pages)
        elif type(out) is not AllocOut or out.pool is not self:
            raise ValueError(f"out: expected an AllocOut from this pool's alloc_out(), got "
                             f"{'one from another pool' if type(out) is AllocOut else type(out).__name__}")
        elif not (type(counts) is _Tensor and counts.dtype is _int32 and counts.device == self.device
                  and counts.stride() == _UNIT_STRIDE and (b := counts.numel()) <= out.max_batch):
            b = self._vector(counts, "counts", out.max_batch)  # raises with the expected and actual values
        out.run(counts, b, evict)
        return out.result

    def free(self, pages: torch.Tensor, *, cache: bool = False) -> None:
        """Drop one reference per entry of ``pages``; pages reaching 0 become FREE.

        With ``cache=True`` they become CACHED instead: content kept, evictable,
        stamped with the clock. Inside a :meth:`free_group` the call is
        deferred (its ids are copied at once). ``-1`` entries are ignored; a
        page without references counts as ``double_free``, an id outside
        ``[0, num_pages)`` as ``invalid_page`` (raised by :meth:`check`).

        pages : torch.Tensor  shape ``[N]``, int32, on the pool's device.
        """
        if not (type(pages) is _Tensor and pages.dtype is _int32 and pages.device == self.device
                and pages.stride() == _UNIT_STRIDE):
            self._vector(pages, "pages")  # raises with the expected and actual values
        if self._group is None:
            self._impl.free(pages, cache)
        else:
            self._group.enqueue(pages, cache)

    def _apply_free(self, pages: torch.Tensor, cache: bool) -> None:
        self._impl.free(pages, cache)

    def incref(self, pages: torch.Tensor) -> None:
        """Add one reference per entry (prefix sharing). A CACHED page is revived.

        pages : torch.Tensor  shape ``[N]``, int32, on the pool's device.
        """
        self._vector(pages, "pages")
        self._impl.incref(pages)

    def touch(self, pages: torch.Tensor) -> None:
        """Stamp USED or CACHED pages with the current clock (LRU refresh).

        pages : torch.Tensor  shape ``[N]``, int32, on the pool's device.
        """
        self._vector(pages, "pages")
        self._impl.touch(pages)

    def evict(self, k: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Free up to ``k`` CACHED pages, least recently stamped first (ties by id).

        Returns int32 ``[k]`` on the pool's device: the evicted ids oldest first,
        padded with -1, so a prefix cache can drop their keys. ``out`` (int32
        ``[k]``) may be passed for graph capture.
        """
        k = _checks.check_size(k, "k")
        if out is None:
            out = torch.empty(k, dtype=torch.int32, device=self.device)
        elif self._vector(out, "out") != k:
            raise ValueError(f"out: expected {k} entries (k), got {out.numel()}")
        self._impl.evict(out)
        return out

    def free_group(self, capacity: int = 4096) -> FreeGroup:
        """A context in which ``free`` calls are deferred and applied in one pass at exit.

        Every deferred ``pages`` tensor is copied into a pool-owned buffer of
        ``capacity`` ids when ``free`` is called, so callers may overwrite the
        tensors they passed. See :class:`tpool.free_group.FreeGroup`.
        """
        return FreeGroup(self, capacity)

    # ---------------------------------------------------------- sync points
    def _read_counters(self) -> list:
        return self.state.counters.tolist()

    def available(self) -> int:
        """Pages on the free stack. A sync point: reads the device."""
        return int(self.state.counters[L.FREE_COUNT])

    def stats(self) -> dict:
        """Counters in the style of ``torch.cuda.memory_stats``. A sync point."""
        return stats_from_counters(self.num_pages, self._read_counters())

    def stats_async(self) -> StatsHandle:
        """Start a non-blocking copy of the counters; the handle's ``get()`` is :meth:`stats` as of now.

        Not a sync point: on CUDA the counters go to pinned host memory with a recorded
        event (``handle.ready()`` asks it without waiting); on a CPU the copy is done
        at once. ``get()`` waits only if called before ``ready()``. See
        :mod:`tpool.stats_async`.
        """
        return StatsHandle(self)

    def check(self) -> None:
        """Raise the :class:`tpool.PoolError` subclass for errors counted since the last check.

        A sync point. The exception's ``counts`` names every kind seen and its count.
        """
        c = self._read_counters()
        delta = {slot: c[slot] - self._errors_seen[slot] for slot in L.ERROR_NAMES}
        self._errors_seen = c
        raise_for_errors(delta)

    def check_invariants(self) -> None:
        """Verify the whole state; raise :class:`InvariantViolation` on the first breach.

        A sync point meant for tests and debugging (reads every state tensor).
        """
        st = {k: v.cpu() for k, v in self.state.tensors().items()}
        c = st["counters"].tolist()
        P, fc, cc = self.num_pages, c[L.FREE_COUNT], c[L.CACHED_COUNT]
        state, rc = st["page_state"].long(), st["refcount"].long()

        def need(cond, what):
            if not cond:
                raise InvariantViolation(f"invariant broken: {what}")

        need(0 <= fc <= P and 0 <= cc <= P - fc, f"counts in range (free={fc}, cached={cc}, pages={P})")
        stack = st["free_stack"][:fc].long()
        need(bool(((stack >= 0) & (stack < P)).all()), "free stack ids in range")
        need(stack.unique().numel() == fc, "free stack ids distinct")
        need(bool((state[stack] == L.FREE).all()), "every id on the free stack is FREE")
        need(int((state == L.FREE).sum()) == fc, "every FREE page is on the free stack")
        need(int((state == L.CACHED).sum()) == cc, "cached count matches CACHED pages")
        need(bool(((rc > 0) == (state == L.USED)).all()), "refcount > 0 iff USED")
        need(bool((rc >= 0).all()), "refcounts non-negative")
        need(bool((st["claim"] == INT32_MAX).all()) and bool((st["occur"] == 0).all()), "scratch reset")
        need(all(v >= 0 for v in c), "counters non-negative")
        need(c[L.USED_PEAK] >= P - fc - cc and c[L.CACHED_PEAK] >= cc, "peaks >= current")
        need(c[L.ALLOCATED] + c[L.REVIVED] - c[L.FREED] == P - fc - cc,
             "allocated + revived - freed == used")

    def memory_bytes(self) -> dict:
        """Bytes held by the pool's state tensors (for ``tpool.memory_report``)."""
        n = sum(t.untyped_storage().nbytes() for t in self.state.tensors().values())
        return {"name": repr(self), "state_bytes": n}
