"""PagePool: a fixed set of pages whose allocator state lives in device tensors.

Note: the hot-path calls (``alloc``, ``free``, ``incref``, ``touch``,
``evict``) check their inputs from tensor metadata, launch a fixed-shape
kernel pass, and return without reading device memory on the host. Whether a
request succeeded is device data (``ok``); misuse is counted on the device.
The host learns results only at the sync points ``available()``, ``stats()``,
``check()`` and ``check_invariants()``, or without a stall from
``stats_async()``. The device clock advances by one per hot-path call (a
call's LRU stamps all carry the same value). Eviction takes pages in LRU order from a queue on
the device (``PoolState.lru_queue``): the order pages became CACHED or were last touched, a
call's pages in the order of their last occurrence in a free into the cache, their first in a
touch; it reads what it evicts, not the pool.
"""

import functools
import weakref
from typing import NamedTuple

import torch

from tpool import _checks
from tpool.backends import make_pool_ops, requested_backend, resolve_backend
from tpool.errors import InvariantViolation, StaleBinding, first_breach, raise_for_errors
from tpool.free_group import FreeGroup
from tpool.kernels import layout as L
from tpool.kernels.layout import INT32_MAX, MAX_INDEXED
from tpool.state import PoolState, SetOnce, clones_between_calls, fixed_full
from tpool.stats_async import StatsHandle, stats_from_counters

DEFAULT_MAX_BATCH = 4096        # requests per alloc call
DEFAULT_MAX_ALLOC_PAGES = 4096  # pages per alloc call without an out= buffer
# Where the most requests one alloc takes comes from, for the error of a longer counts.
_POOL_BATCH = "one per request; the pool's max_batch, PagePool(..., max_batch=N)"
_OUT_BATCH = "one per request; out's max_batch, pool.alloc_out(max_batch=N)"


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


class AllocOut(SetOnce):
    """Preallocated, reusable outputs for :meth:`PagePool.alloc` (``out=``).

    Made by :meth:`PagePool.alloc_out`. Its tensors never change identity, so a
    CUDA graph can capture an alloc that writes them; each call overwrites them.
    """

    def __init__(self, pool: "PagePool", max_batch: int, max_pages: int):
        device = pool.device
        self.pool, self.max_batch, self.max_pages, self.device = pool, max_batch, max_pages, device
        self.result = AllocResult(  # (fixed_full: storages that cannot be resized under a kernel bound to them)
            pages=fixed_full(max_pages, L.NULL_PAGE, torch.int32, device),
            indptr=fixed_full(max_batch + 1, 0, torch.int32, device),
            ok=fixed_full(max_batch, False, torch.bool, device),
            evicted=fixed_full(max_pages, L.NULL_PAGE, torch.int32, device),
        )
        self.pages, self.indptr, self.ok, self.evicted = self.result
        # What an alloc into these buffers writes: counts must not share memory with any of it.
        self._written = pool._written | _checks.written_storages(self.result)
        self._seen = _checks.NOT_SEEN  # the last counts tensor checked (_checks.seen; see PagePool.free)
        # The pool's alloc bound to these buffers: _run(counts, B, evict), B checked by the pool.
        self._run = pool.ops.alloc_into(self)

    def __repr__(self):
        return f"AllocOut(max_batch={self.max_batch}, max_pages={self.max_pages}, device={self.device})"


class BoundCall(functools.partial):
    """A pool call bound to its input tensor (:meth:`PagePool.bind_alloc`, :meth:`PagePool.bind_free`).

    Calling it checks that the input keeps the memory and length it was bound with
    (:class:`~tpool.errors.StaleBinding`, a ``ValueError``, if not: a resized or
    reassigned tensor would leave the kernel an address it was not given) and runs the
    call; it returns ``result`` (the ``AllocResult`` for an alloc, None for a free). It
    holds the pool and the tensors the call points into.
    """

    def __new__(cls, pool, run, t, result):
        at, numel, addr, n = t.data_ptr, t.numel, t.data_ptr(), t.numel()
        nbytes, size = _checks.storage_size(t)

        def call():
            if at() != addr or numel() != n or nbytes() != size:
                raise StaleBinding("bound call: its input no longer has the memory or the length it was bound "
                                   "with (reassigned or resized); fill it in place, or bind again")
            run()
            return result

        self = super().__new__(cls, call)
        self.pool, self.input, self.result = pool, t, result
        return self

    def __repr__(self):
        return f"BoundCall({'alloc' if self.result is not None else 'free'}, input of {self.input.numel()})"

    def __reduce_ex__(self, protocol):
        raise TypeError("a BoundCall cannot be copied or pickled: its call is bound to the addresses of its "
                        "input and of its pool's state and buffers; bind again (pool.bind_alloc, pool.bind_free)")


def _counted_since(count: int, seen: int) -> int:
    """Errors counted since ``seen`` in an int64 counter now at ``count``: the difference modulo 2**64
    (the kernels' counters wrap), 0 when the counter went down (a hand edit, a difference of 2**63 or
    more). ``_counted_since(-2**63, 2**63 - 1) == 1``: one error past INT64_MAX."""
    d = (count - seen) % 2**64
    return d if d < 2**63 else 0


class PagePool:
    """A pool of ``num_pages`` pages of ``page_size`` tokens, managed on ``device``.

    Parameters
    ----------
    num_pages : int
        Pages in the pool; ids are ``0 .. num_pages - 1``.
    page_size : int
        Tokens per page, at most ``INT32_MAX`` (a page's offsets and slots are int32). The pool
        itself never reads it: its page tables and K/V caches do (a ``PageTable`` also needs
        ``num_pages * page_size <= INT32_MAX``, the slots of the whole pool).
    device : torch.device or str, optional
        Where the state lives; default CUDA if available, else CPU (the CPU for backend
        ``"numba"``, passed or from ``TPOOL_BACKEND``).
    backend : {"auto", "reference", "numba", "triton"}
        ``auto`` is triton on CUDA and numba on CPU; ``TPOOL_BACKEND`` overrides it.
    max_batch : int
        Most requests in one ``alloc`` call and lanes in one call of a ``PageTable`` on the
        pool, at most ``MAX_INDEXED``; default 4096. Like an engine's ``max_num_seqs`` it sizes
        buffers, so set it to the batches you run: ``alloc_out()``'s default ``indptr`` and
        ``ok`` take 5 bytes a lane, and every ``PageTable`` on the pool 4 bytes a lane of
        state (``plan_pages(..., max_batch=)`` counts those); ``max_batch=2**30`` would be
        5 GiB and 4 GiB. The pool itself allocates nothing for it.
    max_alloc_pages : int, optional
        Length of ``pages`` returned by ``alloc`` without ``out=``
        (default ``min(num_pages, 4096)``).

    On CUDA, issue every call on a pool and its tables on one stream (or order the
    streams yourself): the pool's lock orders launches, and each kernel runs on the
    caller's current stream.

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
        num_pages, page_size, max_batch = (_checks.check_size(v, name, 1) for name, v in (
            ("num_pages", num_pages), ("page_size", page_size), ("max_batch", max_batch)))
        for name, v in (("num_pages", num_pages), ("max_batch", max_batch)):
            if v > MAX_INDEXED:  # (a kernel's chunk offsets are int32)
                raise ValueError(f"{name}: expected at most {MAX_INDEXED}, got {v}")
        _checks.check_page_size(page_size)  # (no table could index a longer page: slots are int32)
        self.device = _checks.resolve_device(device, backend=requested_backend(backend))
        self.num_pages, self.page_size, self.max_batch = num_pages, page_size, max_batch
        if max_alloc_pages is None:
            max_alloc_pages = min(DEFAULT_MAX_ALLOC_PAGES, num_pages)
        self.max_alloc_pages = self._max_pages(max_alloc_pages, "max_alloc_pages")
        self.backend = resolve_backend(backend, self.device)
        self.state = PoolState.create(num_pages, self.device)
        self._written = _checks.written_storages(self.state.tensors().values())  # what every call may write
        self.ops = make_pool_ops(self.backend, self.state)  # the backend's PoolOps (tpool.backends)
        # The hot-path input check: with overlap too, unless the backend's compiled calls check that.
        self._input_len = _checks.i32_len if self.ops.checks_overlap else _checks.input_len
        # The last tensor free checked (_checks.seen): a loop freeing the same buffer (an AllocOut's
        # pages) skips the checks while the tensor keeps its object, memory, length and storage size
        # (_checks.still_seen). A view over the same bytes and length (as_strided_) goes unnoticed:
        # the kernel reads the bytes it checked as int32 ids and range-checks them.
        self._seen = _checks.NOT_SEEN
        self._group = None
        self._group_buffers = {}  # capacity (or (capacity, "captured")) -> int32 [2, capacity], see FreeGroup
        # The live PageTables on this pool, oldest first (id -> table, held weakly): their states and the pool's
        # hold each other's page references, so tpool.graphs.preserved restores them together.
        self._tables = weakref.WeakValueDictionary()

    def __reduce_ex__(self, protocol):
        raise TypeError("a PagePool cannot be copied or pickled: its kernels are bound to the addresses of "
                        "its state tensors; make a new PagePool (tpool.graphs.preserved snapshots state)")

    def __repr__(self):
        return (f"PagePool(num_pages={self.num_pages}, page_size={self.page_size}, "
                f"device={self.device}, backend={self.backend!r})")

    # ------------------------------------------------------------ hot path
    def _vector(self, t, name, max_len=None, dtype=torch.int32, bound=""):
        return _checks.check_vector(t, name, dtype, self.device, max_len, bound)

    def _pages(self, t, name="pages") -> int:
        """Check a page-id vector the call reads (never one of the buffers it writes); its length."""
        n = _checks.check_vector(t, name, torch.int32, self.device, MAX_INDEXED)  # (a kernel's lane offsets are int32)
        _checks.check_not_written(t, name, self._written)
        return n

    def alloc_out(self, max_batch: int | None = None, max_pages: int | None = None) -> AllocOut:
        """Preallocate outputs for ``alloc(..., out=)`` (graph capture, no per-call allocation).

        Parameters
        ----------
        max_batch : int, optional
            Sizes ``indptr`` (``[max_batch + 1]``) and ``ok`` (``[max_batch]``), 5 bytes a
            lane, which are padded past the batch on every call: size it to the batches you
            run. At most, and by default, ``self.max_batch`` (the most requests one ``alloc``
            takes).
        max_pages : int, optional
            Sizes ``pages`` and ``evicted`` (``[max_pages]``): the most pages one call can
            grant. Default ``self.max_alloc_pages``.

        Returns
        -------
        AllocOut
            Buffers on the pool's device, bound to this pool's kernel; every ``alloc`` that
            gets them overwrites them.
        """
        max_batch = self.max_batch if max_batch is None else _checks.check_size(max_batch, "max_batch", 1)
        if max_batch > self.max_batch:  # (the pool's is at most MAX_INDEXED)
            raise ValueError(f"max_batch: expected at most the pool's max_batch = {self.max_batch} (the most "
                             f"requests one alloc takes), got {max_batch}")
        max_pages = self.max_alloc_pages if max_pages is None else self._max_pages(max_pages, "max_pages")
        return AllocOut(self, max_batch, max_pages)

    def _max_pages(self, v, name) -> int:
        """An output length in pages: a call never grants more than the pool has, so a longer
        buffer would be memory for nothing (``max_alloc_pages=10**9`` would take GBs)."""
        v = _checks.check_size(v, name, 1)
        if v > self.num_pages:
            raise ValueError(f"{name}: expected at most num_pages = {self.num_pages} (no call grants more), "
                             f"got {v}")
        return v

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
        if out is None:  # fresh outputs, written whole by the call (AllocOut's would be bound to, ~3x the cost)
            b = self._vector(counts, "counts", self.max_batch, bound=_POOL_BATCH)
            if not self.ops.checks_overlap:  # (numba's compiled alloc refuses it itself)
                _checks.check_not_written(counts, "counts", self._written)
            M, dev = self.max_alloc_pages, self.device
            result = AllocResult(torch.empty(M, dtype=torch.int32, device=dev),
                                 torch.empty(b + 1, dtype=torch.int32, device=dev),
                                 torch.empty(b, dtype=torch.bool, device=dev),
                                 torch.empty(M, dtype=torch.int32, device=dev))
            self.ops.alloc_once(result, counts, b, evict if type(evict) is bool else _checks.flag(evict, "evict"))
            return result
        elif type(out) is AllocOut and out.pool is self and _checks.still_seen(counts, seen := out._seen):
            b = seen[2]  # the tensor the last call checked, as it was (a loop refilling its counts in place;
            #              the memo read once: another thread's alloc into ``out`` may replace it)
        elif type(out) is not AllocOut or out.pool is not self:
            raise ValueError(f"out: expected an AllocOut from this pool's alloc_out(), got "
                             f"{'one from another pool' if type(out) is AllocOut else type(out).__name__}")
        else:
            if not 0 <= (b := self._input_len(counts, self.device, out._written)) <= out.max_batch:
                b = self._vector(counts, "counts", out.max_batch, bound=_OUT_BATCH)  # raises, naming the bound
                _checks.check_not_written(counts, "counts", out._written)
            out._seen = _checks.seen(counts)
        out._run(counts, b, evict if type(evict) is bool else _checks.flag(evict, "evict"))
        return out.result

    def bind_alloc(self, counts: torch.Tensor, *, out: AllocOut, evict: bool = False) -> BoundCall:
        """:meth:`alloc` on a fixed ``counts`` tensor and ``out``, checked once; call the result each time.

        For a loop that refills ``counts`` in place (as a CUDA graph's static input): a call
        then only checks that ``counts`` keeps its memory and length.

        Parameters
        ----------
        counts : torch.Tensor
            shape ``[B]``, int32, on the pool's device, ``B <= out.max_batch``; filled in place
            before each call.
        out : AllocOut
            The buffers every call writes (from this pool's :meth:`alloc_out`).
        evict : bool
            May evict cached pages to cover the request.

        Returns
        -------
        BoundCall
            ``run()`` grants the pages and returns ``out.result`` (an :class:`AllocResult`).
        """
        if type(out) is not AllocOut or out.pool is not self:
            raise ValueError(f"out: expected an AllocOut from this pool's alloc_out(), got "
                             f"{'one from another pool' if type(out) is AllocOut else type(out).__name__}")
        b = self._vector(counts, "counts", out.max_batch, bound=_OUT_BATCH)
        _checks.check_not_written(counts, "counts", out._written)
        return BoundCall(self, self.ops.bind_alloc(out, counts, b, _checks.flag(evict, "evict")), counts, out.result)

    def bind_free(self, pages: torch.Tensor, *, cache: bool = False) -> BoundCall:
        """:meth:`free` on a fixed ``pages`` tensor, checked once; call the result each time.

        Bound frees are never deferred by a free group (their input is the caller's
        fixed tensor, which a group would have to copy anyway).

        Parameters
        ----------
        pages : torch.Tensor
            shape ``[N]``, int32, on the pool's device; -1 entries are padding. An
            ``AllocOut``'s ``pages`` is a good input: ``pool.bind_free(out.pages)``.
        cache : bool
            Keep freed pages as CACHED instead of FREE.

        Returns
        -------
        BoundCall
            ``run()`` frees the pages and returns None.
        """
        self._pages(pages)
        return BoundCall(self, self.ops.bind_free(pages, _checks.flag(cache, "cache")), pages, None)

    def free(self, pages: torch.Tensor, *, cache: bool = False) -> None:
        """Drop one reference per entry of ``pages``; pages reaching 0 become FREE.

        With ``cache=True`` they become CACHED instead: content kept, evictable,
        stamped with the clock. Inside a :meth:`free_group` the call is deferred
        (its ids are copied at once). A page without references counts as
        ``double_free``, an id outside ``[0, num_pages)`` as ``invalid_page``
        (raised by :meth:`check`).

        Parameters
        ----------
        pages : torch.Tensor
            shape ``[N]``, int32, on the pool's device; -1 entries are padding.
        cache : bool
            Keep freed pages as CACHED (a prefix cache) instead of FREE.
        """
        if not _checks.still_seen(pages, self._seen):  # (else: checked by the last free, as it is)
            if not 0 <= self._input_len(pages, self.device, self._written) <= MAX_INDEXED:
                self._pages(pages)  # raises with the expected and actual values
            self._seen = _checks.seen(pages)
        cache = cache if type(cache) is bool else _checks.flag(cache, "cache")  # (the common case inline)
        group = self._group  # read once: another thread may close its group meanwhile
        if group is None or not group.owned_here():
            self.ops.free(pages, cache)
        else:  # the group's flush frees a copy, which numba's compiled free cannot see overlap the state
            _checks.check_not_written(pages, "pages", self._written)
            group.enqueue(pages, cache)

    def _apply_free(self, pages: torch.Tensor, cache: bool) -> None:
        self.ops.free(pages, cache)

    def incref(self, pages: torch.Tensor) -> None:
        """Add one reference per entry (prefix sharing). A CACHED page is revived.

        A FREE page counts ``use_after_free`` and is left alone. Inside a :meth:`free_group`
        (in its thread) the frees it holds are applied first, so a page freed earlier in the
        group is FREE here, as without the group.

        Parameters
        ----------
        pages : torch.Tensor
            shape ``[N]``, int32, on the pool's device; -1 entries are padding.
        """
        self._pages(pages)
        self._flush_group()
        self.ops.incref(pages)

    def _flush_group(self) -> None:
        """Apply this thread's open free group's frees now: a call that reads page states or reference
        counts (incref, touch, a table's fork, revive, truncate, release with cache) must see them, or a
        use after free inside the group would pass uncounted (see :mod:`tpool.free_group`)."""
        group = self._group  # read once: another thread may close its group meanwhile
        if group is not None and group.owned_here():
            group.flush()

    def touch(self, pages: torch.Tensor) -> None:
        """Stamp USED or CACHED pages with the current clock (LRU refresh).

        A FREE page counts ``use_after_free``. Inside a :meth:`free_group` the frees it holds
        are applied first, as for :meth:`incref`.

        Parameters
        ----------
        pages : torch.Tensor
            shape ``[N]``, int32, on the pool's device; -1 entries are padding.
        """
        self._pages(pages)
        self._flush_group()
        self.ops.touch(pages)

    def generations(self, pages: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Each page's generation: how many times it became FREE (mod 2**31), for a prefix cache.

        A page's generation grows by one (wrapping within ``[0, INT32_MAX]``) each time the
        page becomes FREE: its last reference dropped without ``cache`` (``free``, a table's
        ``release``, ``truncate``, a step's release) or its eviction; nothing else changes it
        (a page popped by ``alloc`` keeps its own). Record them next to the page ids when a
        prefix-cache entry is made, while the request still holds its pages or while they are
        CACHED, and pass them to :meth:`PageTable.revive` (``generations=``): a page evicted
        and handed to another request since has another generation, and the revive is refused
        (``use_after_free``) instead of letting two requests share it. A gather on the device:
        no host read, the output's shape is the input's.

        Parameters
        ----------
        pages : torch.Tensor
            shape ``[N]``, int32, on the pool's device; -1 entries are padding.
        out : torch.Tensor, optional
            shape ``[N]``, int32, on the pool's device: where to write them (default a fresh tensor).

        Returns
        -------
        torch.Tensor
            ``out``, or shape ``[N]``, int32, on the pool's device: each page's generation, -1 for
            padding and for ids outside ``[0, num_pages)``.

        Example
        -------
        >>> i32 = lambda v: torch.tensor(v, dtype=torch.int32)
        >>> pool = PagePool(4, device="cpu", backend="reference")
        >>> r = pool.alloc(i32([2]))                        # pages 0, 1
        >>> pool.free(i32([0]))                             # page 0: FREE, generation 1
        >>> pool.free(i32([1]), cache=True)                 # page 1: CACHED, still 0
        >>> pool.generations(i32([0, 1, -1, 9])).tolist()
        [1, 0, -1, -1]
        """
        n = self._pages(pages)
        if out is not None and self._pages(out, "out") != n:
            raise ValueError(f"out: expected {_checks.entries(n)} (as pages), got {out.numel()}")
        p, P = pages.long(), self.num_pages
        with self.state.lock:  # between two calls, never inside one
            gens = self.state.page_gen.index_select(0, p.clamp(0, P - 1))
        gens = torch.where((p >= 0) & (p < P), gens, L.NULL_PAGE)
        if out is None:
            return gens
        out.copy_(gens)
        return out

    def evict(self, k: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Free up to ``k`` CACHED pages, least recently cached or touched first (one call's pages in the order
        of their last occurrence in its input when it cached them, of their first when it touched them).

        Parameters
        ----------
        k : int
            Most pages to evict.
        out : torch.Tensor, optional
            shape ``[k]``, int32, on the pool's device: where to write the result (for graph
            capture); default a fresh tensor of ``min(k, num_pages)`` entries (no call can
            evict more pages than the pool has).

        Returns
        -------
        torch.Tensor
            ``out``, or shape ``[min(k, num_pages)]``, int32, on the pool's device: the
            evicted ids oldest first, -1 padded, so a prefix cache can drop their keys.
        """
        k = _checks.check_size(k, "k")
        if out is None:
            out = torch.empty(min(k, self.num_pages), dtype=torch.int32, device=self.device)
        elif self._pages(out, "out") != k:
            raise ValueError(f"out: expected {_checks.entries(k)} (k), got {out.numel()}")
        self.ops.evict(out)
        return out

    def free_group(self, capacity: int = 4096) -> FreeGroup:
        """A context in which ``free`` calls are deferred and applied in one pass at exit.

        Every deferred ``pages`` tensor is copied into a pool-owned buffer when
        ``free`` is called, so callers may overwrite the tensors they passed. See
        :class:`tpool.free_group.FreeGroup`.

        Parameters
        ----------
        capacity : int
            Page ids the group buffers before it applies them (a fuller group flushes early).

        Returns
        -------
        FreeGroup
            The context manager; groups do not nest.
        """
        return FreeGroup(self, capacity)

    # ---------------------------------------------------------- sync points
    def _read_counters(self) -> list:
        with self.state.lock:  # never halfway through another thread's call (reference, triton)
            return clones_between_calls([self.state.counters])[0].tolist()

    def available(self) -> int:
        """Pages on the free stack. A sync point: reads the device.

        Returns
        -------
        int
        """
        with self.state.lock:  # never halfway through another thread's call (reference, triton)
            return int(self.state.counters[L.FREE_COUNT])

    def stats(self) -> dict:
        """Counters in the style of ``torch.cuda.memory_stats``. A sync point.

        Returns
        -------
        dict
            ``pages.total``, ``pages.{free,used,cached}.current``, ``pages.{used,cached}.peak``,
            ``pages.{allocated,freed,evicted,revived}`` (totals), ``requests.failed``, ``clock``,
            ``errors.<kind>`` for every error kind and ``overflows.<buffer>`` for the buffers
            behind ``errors.out_overflow`` (``alloc_pages``, ``slots``, ``csr_indices``: each
            of its counts is counted again under one of them), all ints.
        """
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

        A sync point. The exception's ``counts`` names every kind seen and its count. The read
        and the note of what it read are one call under the pool's lock: two threads checking
        at once never both raise the same errors.

        Raises
        ------
        PoolError
            The class of the first kind counted, in this order: ``InvalidPage``, ``DoubleFree``,
            ``UseAfterFree``, ``InvalidCount``, ``OutputOverflow``, ``InvalidRequest``,
            ``TableOverflow``, ``InvalidLength``, ``CorruptState``, ``RefcountOverflow``; its
            ``counts`` names every kind counted, its ``overflows`` the buffers behind an
            ``out_overflow`` (the message gives the advice for those only).
        """
        with self.state.lock:
            c, seen = torch.stack(clones_between_calls([self.state.counters, self.state.checked])).tolist()
            # The baseline lives in the state: a snapshot restored (tpool.graphs.preserved) brings back the
            # counters and what had been checked of them together. A count below it (a hand edit) is no error.
            # Counts are int64 that wrap: the difference is taken modulo 2**64, so errors counted past a
            # counter edited to near INT64_MAX are raised, not read as a count gone down.
            delta = {slot: _counted_since(c[slot], seen[slot]) for slot in (*L.ERROR_NAMES, *L.OVERFLOW_NAMES)}
            self.state.checked.copy_(torch.tensor(c, dtype=torch.int64, device="cpu"))
        raise_for_errors(delta)

    def check_invariants(self) -> None:
        """Verify the whole state; raise :class:`InvariantViolation` on the first breach.

        A sync point meant for tests and debugging (reads every state tensor):
        page states, counts, the free stack, reference counts, generations (non-negative),
        peaks, totals, the LRU queue (every CACHED page has one live entry, in stamp order), and
        that the scratch a later call relies on is reset.

        Raises
        ------
        InvariantViolation
        """
        with self.state.lock:  # a copy of the state between two calls, never inside one
            self.state.check_held(self.ops.st, "PagePool")
            names, tensors = zip(*self.state.tensors().items())
            self._check_state(dict(zip(names, clones_between_calls(tensors))))

    def _check_state(self, st: dict) -> None:
        """:meth:`check_invariants` on ``st``, a copy of every state tensor by name (taken between two calls)."""
        st = {k: v.cpu() for k, v in st.items()}
        c = st["counters"].tolist()
        P, fc, cc = self.num_pages, c[L.FREE_COUNT], c[L.CACHED_COUNT]
        state, rc = st["page_state"].long(), st["refcount"].long()

        def need(cond, what):
            if not cond:
                raise InvariantViolation(f"invariant broken: {what}")

        def page(i) -> str:  # what the state holds for page i (where a rule over pages broke first)
            name = {L.FREE: "FREE", L.USED: "USED", L.CACHED: "CACHED"}.get(int(state[i]), f"state {int(state[i])}")
            return f"page {i}: {name}, refcount {int(rc[i])}"

        def every(ok, what, at=lambda i: f"at {i}"):  # a rule over a vector: the first place it breaks, named
            i = first_breach(~ok)
            need(i is None, what if i is None else f"{what} ({at(i)})")

        need(0 <= fc <= P and 0 <= cc <= P - fc, f"counts in range (free={fc}, cached={cc}, pages={P})")
        stack = st["free_stack"][:fc].long()
        every((stack >= 0) & (stack < P), "free stack ids in range", lambda i: f"entry {i} is {int(stack[i])}")
        ids, first = torch.unique(stack, return_inverse=True)
        order = torch.arange(fc, device="cpu")   # (host tensors: not the default device)
        seen = torch.full((ids.numel(),), fc, device="cpu").scatter_reduce_(0, first, order, "amin")
        every(seen[first] == order, "free stack ids distinct",
              lambda i: f"entries {int(seen[first[i]])} and {i} are both page {int(stack[i])}")
        every(state[stack] == L.FREE, "every id on the free stack is FREE",
              lambda i: f"entry {i}, {page(int(stack[i]))}")
        on_stack = torch.zeros(P, dtype=torch.bool, device="cpu").index_fill_(0, stack, True)
        every(on_stack | (state != L.FREE), "every FREE page is on the free stack", page)
        n_cached = int((state == L.CACHED).sum())
        need(n_cached == cc, f"cached count matches CACHED pages (cached={cc}, CACHED pages={n_cached})")
        every((rc > 0) == (state == L.USED), "refcount > 0 iff USED", page)
        every(rc >= 0, "refcounts non-negative", page)
        every(st["page_gen"] >= 0, "generations non-negative",  # (any value, FREE or not)
              lambda i: f"page {i}: generation {int(st['page_gen'][i])}")
        need(bool((st["claim"] == INT32_MAX).all()) and bool((st["occur"] == 0).all()), "scratch reset")
        need(all(v >= 0 for v in c), "counters non-negative")
        need(c[L.USED_PEAK] >= P - fc - cc and c[L.CACHED_PEAK] >= cc, "peaks >= current")
        need(c[L.ALLOCATED] + c[L.REVIVED] - c[L.FREED] == P - fc - cc,
             "allocated + revived - freed == used")
        head, hole, scan, tail = (c[k] for k in (L.LRU_HEAD, L.LRU_HOLE, L.LRU_SCAN, L.LRU_TAIL))
        queue, pos = st["lru_queue"].long(), st["lru_pos"]
        Q = queue.numel()
        need(0 <= head <= hole <= scan <= tail <= min(head + Q, L.LRU_POS_LIMIT),
             f"LRU queue bounds (head={head}, hole={hole}, scan={scan}, tail={tail}, length={Q})")
        where = torch.cat([torch.arange(head, hole, device="cpu"),   # (the gap is never read)
                           torch.arange(scan, tail, device="cpu")])
        entries = queue[where % Q]
        need(bool(((entries >= 0) & (entries < P)).all()), "LRU queue entries are page ids")
        live = entries[(state[entries] == L.CACHED) & (pos[entries] == where)]
        cached = (state == L.CACHED).nonzero().flatten()
        at = pos[cached]
        need(live.numel() == cc and bool((queue[at.clamp(min=0) % Q] == cached).all())
             and bool((((at >= head) & (at < hole)) | ((at >= scan) & (at < tail))).all()),
             "every CACHED page has one live entry in the LRU queue")
        stamps = st["stamp"][live]
        need(bool((stamps[1:] >= stamps[:-1]).all()), "the LRU queue's live entries in stamp order")

    def memory_bytes(self) -> dict:
        """Bytes held by the pool's state tensors (for :func:`tpool.memory_report`).

        Returns
        -------
        dict
            ``{"name": repr(self), "state_bytes": int}``: the state and the free groups' buffers.
        """
        n = sum(t.untyped_storage().nbytes() for t in [*self.state.tensors().values(), *self._group_buffers.values()])
        return {"name": repr(self), "state_bytes": n}
