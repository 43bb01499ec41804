"""Free groups: deferred frees that own their input.

Note (ownership rule): a deferred free COPIES its page ids into a
pool-owned, fixed-capacity device buffer the moment ``free`` is called; no
code path keeps the caller's tensor. A caller may pass a view of a table row
and overwrite that row before the group ends: the pages freed are the ones
that were passed. (SGLang's PR #34067 fixed the bug this prevents: its
deferred queue held views of ``req_to_token`` rows that were later
overwritten, so the wrong pages were freed.)

Order and overflow: the host always knows how many ids the buffer holds (the
sum of the shapes enqueued), so overflow needs no device read. At exit, and
whenever an enqueue would not fit, the buffered frees are applied: first all
plain frees in enqueue order as one pass, then all ``cache=True`` frees as
another. An enqueue larger than the whole buffer is applied at once (after
flushing what is buffered). An ``incref`` or ``touch`` in the group's thread
flushes it first: they read page states, and a page freed earlier in the group
must be FREE there (a use after free counted, as without the group). So do a
table's ``fork`` and ``revive`` (they take references), ``truncate`` (it reads
reference counts: a page whose other reference was freed in the group is no
longer shared) and ``release`` with ``cache=True`` (or a ``step`` releasing with
``release_cache=True``: which call drops a page's last reference decides whether
it ends CACHED or FREE). A step bound with ``release_cache=True`` (``bind_step``)
does not flush (a bound call runs no host work beyond its launch: call
``flush()`` before it inside a group), and neither does a plain release: a page
whose ``cache=True`` free is still buffered then ends CACHED, where the same
calls without the group leave it FREE (as mixed frees inside a group do, see
Order). No free is ever lost, and the schedule of flushes depends only on shapes and calls,
so it is deterministic.

``tpool.graphs.preserved`` (and ``capture``, which uses it) is refused in the
thread of an open group: the frees it would queue lie outside the state it
restores and would be applied at the group's exit.

Threads: a group belongs to the thread that entered it (``with``), wherever
it was made. Frees from other threads while it is open are applied at once,
as if no group were open. A pool has one open group at a time: entering one
while another thread's is open raises ``RuntimeError``; a group closes (its
last flush done) before another can open.

Order: the buffered frees are applied as two passes, so a group may end
differently from the same frees made one by one: a page with two references
freed once with ``cache=True`` and then once plainly ends CACHED in a group
(the plain pass drops one reference, the cached pass the last) and FREE
without one; and the free stack's order, hence which pages later allocations
get, follows the passes. Mix ``cache=True`` and plain frees of one page
outside a group when the final state matters.

Buffers: a group's buffer is pool-owned and kept for later groups of the
same capacity (a captured graph keeps its address); a pool keeps at most
``MAX_CAPACITIES`` of them, and a capacity past ``max(4096, 2 * num_pages)``
would only make a later flush, so it is refused. A group entered inside CUDA
graph capture gets a buffer of its own, apart from the one that groups entered
outside capture use: every replay of that graph writes its buffer (the copies,
then -1 after the flush), and a replay issued while an eager group of the same
capacity holds frees would otherwise overwrite them (lost, or applied twice).
"""

import threading

import torch

from tpool._checks import check_size
from tpool.kernels import layout as L
from tpool.state import fixed_full

MAX_CAPACITIES = 8  # distinct group capacities (buffers) one pool keeps


class FreeGroup:
    """Context manager made by :meth:`PagePool.free_group`; see the module note.

    Parameters
    ----------
    pool : PagePool
        The pool whose ``free`` calls are deferred while the group is open.
    capacity : int
        Page ids the buffer holds, > 0; groups of one capacity share one
        pool-owned buffer (int32 ``[2, capacity]`` on the pool's device), and
        those entered inside CUDA graph capture another (see the module note).

    Attributes
    ----------
    buffer : torch.Tensor
        shape ``[2, capacity]``, int32, on the pool's device: row 0 the
        plain frees, row 1 the ``cache=True`` frees, -1 where empty.
    flushes : int
        Passes applied so far (host-side count).

    Raises
    ------
    ValueError
        ``capacity`` is not a positive int, is past ``max(4096, 2 * num_pages)``,
        or would be the pool's ``MAX_CAPACITIES + 1``-th buffer (distinct capacities, those of
        groups entered inside CUDA graph capture counted apart).
    RuntimeError
        On entering, when the pool already has an open group (groups do not
        nest, and another thread's blocks this one); on CUDA, at a ``free``
        inside the group when the group opened on the other side of a CUDA
        graph capture (its buffer positions are decided on the host).

    Example
    -------
    >>> pool = PagePool(8, device="cpu", backend="reference")
    >>> row = pool.alloc(torch.tensor([3], dtype=torch.int32)).pages[:3]
    >>> with pool.free_group(capacity=4) as group:
    ...     pool.free(row)
    ...     _ = row.fill_(-1)      # the ids were copied: overwriting is safe
    >>> pool.available(), group.flushes
    (8, 1)
    """

    def __init__(self, pool, capacity: int):
        capacity = check_size(capacity, "capacity", 1)
        if capacity > (most := max(4096, 2 * pool.num_pages)):
            raise ValueError(f"capacity: expected at most {most} (max(4096, 2 * num_pages); a larger group "
                             f"would only flush later), got {capacity}")
        self.thread = None  # the thread that entered it (__enter__)
        self.pool, self.capacity = pool, capacity
        self._fill = [0, 0]
        self._cuda = pool.device.type == "cuda"
        self._capturing = self._cuda and torch.cuda.is_current_stream_capturing()  # set again on entering
        self.buffer = self._buffer()
        self.flushes = 0  # how many passes were applied (host-side, for tests and stats)

    def _buffer(self) -> torch.Tensor:
        """The pool's buffer for this group's capacity, on this group's side of a CUDA graph capture.

        ``buffer``: int32 [2, capacity]; row 0: plain frees, row 1: cached frees. Pool-owned and kept
        across groups of the same capacity: no allocation per group, and a graph that captured a group
        keeps valid addresses. -1 between groups (but after a flush that raised: nothing reads past a
        group's fill, so what it left there is never applied). Groups entered inside capture have their
        own (key ``(capacity, "captured")``): a replay writes it whenever it runs, also while an eager
        group of the same capacity holds frees in the other.
        """
        pool, capacity = self.pool, self.capacity
        key = (capacity, "captured") if self._capturing else capacity
        with pool.state.lock:  # two threads never both make a buffer past MAX_CAPACITIES, or one twice
            if key not in pool._group_buffers and len(pool._group_buffers) >= MAX_CAPACITIES:
                have = [k if isinstance(k, int) else f"{k[0]} captured"
                        for k in sorted(pool._group_buffers, key=lambda k: (k, "") if isinstance(k, int) else k)]
                raise ValueError(f"capacity: expected one of this pool's {MAX_CAPACITIES} group capacities so far "
                                 f"{have} (each keeps a buffer; groups entered inside CUDA graph capture another), "
                                 f"got {capacity}{' inside capture' if self._capturing else ''}")
            buffer = pool._group_buffers.get(key)
            if buffer is None:
                buffer = pool._group_buffers[key] = fixed_full((2, capacity), L.NULL_PAGE, torch.int32, pool.device)
        return buffer

    def owned_here(self) -> bool:
        """Whether the calling thread entered this group (its frees are deferred; others' are not)."""
        return threading.get_ident() == self.thread

    def __enter__(self):
        with self.pool.state.lock:  # two threads never both open a group
            if (open_now := self.pool._group) is not None:
                raise RuntimeError("free groups do not nest: this pool already has an open group" if
                                   open_now.owned_here() else "another thread's free group is open on this pool "
                                   "(a pool has one open group at a time)")
            # whether the group opened inside CUDA graph capture: its buffer positions are decided on the
            # host, so a group must open and close on the same side of a capture (enqueue checks); and
            # that side's buffer (made on the other side, or entered on the other: the other's buffer)
            capturing = self._cuda and torch.cuda.is_current_stream_capturing()
            if capturing != self._capturing:
                self._capturing = capturing
                self.buffer = self._buffer()
            self.thread = threading.get_ident()
            self.pool._group = self
        return self

    def __exit__(self, *exc):
        with self.pool.state.lock:  # flushed before another thread can open a group on the same buffer
            try:
                self.flush()
            except BaseException as e:   # (an interrupt, a capture): say so and close, with no device work
                left, self._fill = sum(self._fill), [0, 0]   # (a later group overwrites the buffer from 0)
                if left:
                    e.add_note(f"tpool: the free group closed with {left} buffered frees that may not have been "
                               f"applied (its flush raised): their pages may stay USED; pool.check_invariants() "
                               f"and stats() show what the pool holds")
                raise
            finally:   # a flush that raised must not leave the pool deferring every later free
                self.pool._group = None
        return False

    def enqueue(self, pages: torch.Tensor, cache: bool) -> None:
        """Copy ``pages`` into the buffer; called by ``pool.free`` inside the group.

        If the ids would overflow the buffer, what it holds is applied first
        (:meth:`flush`); ``pages`` longer than ``capacity`` are then applied
        at once instead of being buffered.

        Parameters
        ----------
        pages : torch.Tensor
            shape ``[N]``, int32, on the pool's device (checked by
            :meth:`PagePool.free`, not here); -1 entries are ignored when
            applied. Copied, never kept.
        cache : bool
            Free into the CACHED state (see :meth:`PagePool.free`).
        """
        n, flag = pages.numel(), int(bool(cache))
        if self._cuda and torch.cuda.is_current_stream_capturing() != self._capturing:
            # Captured, the copy would write the same positions at every replay and the flush after the
            # capture free one replay's pages: the others would leak (helper-110's audit).
            raise RuntimeError("pool.free inside a free group opened outside the CUDA graph being captured (or "
                               "the other way round): open and close the group inside the captured region, or "
                               "free outside the group")
        if self._fill[0] + self._fill[1] + n > self.capacity:
            self.flush()
        if n > self.capacity:
            self.pool._apply_free(pages, bool(cache))  # applied now: nothing is kept
            self.flushes += 1
            return
        start = self._fill[flag]
        self.buffer[flag, start:start + n].copy_(pages)
        self._fill[flag] = start + n

    def flush(self) -> None:
        """Apply every buffered free now (plain frees first, then cached ones). Refused (``RuntimeError``)
        on the other side of a CUDA-graph capture than the group was opened on, when it has frees to
        apply (a captured flush would free whatever the buffer holds at each replay, and not these)."""
        if self._cuda and any(self._fill) and torch.cuda.is_current_stream_capturing() != self._capturing:
            raise RuntimeError("a free group's flush (at an incref, touch, revive, fork, truncate or release with "
                               "cache=True of this thread, or its exit) inside a CUDA graph capture the group was "
                               "opened outside of (or the other way round): open and close the group inside the "
                               "captured region, or make these calls outside it")
        for flag in (0, 1):
            n = self._fill[flag]
            if n:
                self.pool._apply_free(self.buffer[flag, :n], bool(flag))
                self.buffer[flag, :n].fill_(L.NULL_PAGE)
                self._fill[flag] = 0
                self.flushes += 1
