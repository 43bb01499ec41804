"""PageTable: per-request page maps on the pool's device, updated without host syncs.

Note: the table holds one pool reference per entry of ``block_table``.
``block_table[r, :ceil(seq_lens[r] / page_size)]`` are request ``r``'s pages
in token order and every entry past that is -1. Slot of token ``t`` of
request ``r``: ``block_table[r, t // page_size] * page_size + t % page_size``.
Hot-path calls take ``req_ids`` int32 ``[B]`` with -1 as padding, so a
captured graph can run a partly empty batch. Outputs live in buffers owned
by the table, one set per call shape, reused by the next call of the same
shape (what a CUDA graph needs); treat them as read-only and clone a result
to keep or edit it. Misuse is
counted in the pool's error counters and raised by ``pool.check()``. The
exact rules are in :mod:`tpool.backends.reference_table`. What the calls return
is in :mod:`tpool.table_results`; a step bound to fixed inputs in :mod:`tpool.bound_step`;
the checks at a sync point (``check_invariants``) in :mod:`tpool.table_checks`.
"""

import ctypes

import numpy as np
import torch

from tpool import _checks, table_checks
from tpool._checks import i32_len
from tpool.backends import make_table_ops
from tpool.bound_step import BoundStep
from tpool.buffers import DEFAULT_MAX_SHAPES, ShapeBuffers, _tensors
from tpool.errors import StaleBinding
from tpool.kernels import layout as L
from tpool.kernels.layout import MAX_INDEXED
from tpool.pool import PagePool
from tpool.state import CsrMemo, TableState, fixed_full, held_view
from tpool.table_results import ExtendResult, ForkResult, PagedKVCSR, StepOut, StepResult

# Where the most lanes one table call takes comes from, for the error of a longer id vector.
_LANES = "one per lane; the pool's max_batch, PagePool(..., max_batch=N)"


def _array_over(t: torch.Tensor) -> np.ndarray:
    """A numpy int32 array over the memory of ``t`` (int32, contiguous, on the CPU) that owns none of it: its
    ``.base`` is a memoryview of a ctypes array made from the address, which owns nothing either (Tensor.numpy()
    would do, but the sync guard counts it as a host read, and the array may be made on a scheduler's hot path).
    The ctypes array holds ``t``, so the memory lives as long as the array does (a caller that keeps only
    ``run.req_ids`` of a dropped step writes into memory nobody else is handed)."""
    view = (ctypes.c_int32 * t.numel()).from_address(t.data_ptr())
    view._tpool_owner = t   # (.base.obj._tpool_owner: the array keeps t, and so its memory, alive)
    return np.ctypeslib.as_array(view)


class PageTable:
    """Page maps for up to ``max_requests`` requests of ``max_pages_per_request`` pages each.

    Parameters
    ----------
    pool : PagePool
        Where pages come from; the table uses the pool's device and backend.
    max_requests : int
        Rows of ``block_table``; request ids are ``0 .. max_requests - 1``.
    max_pages_per_request : int
        Columns of ``block_table``: ``ceil(longest sequence / page_size)``. A row's pages are
        distinct pages of the pool, so columns past the pool's ``num_pages`` are never used;
        they still cost memory (``block_table`` and the CSR buffers are sized by this).
    max_shapes : int
        Call shapes (batch size, ``max_tokens``, ``capacity``) whose output buffers the
        table keeps, least recently used dropped first; shapes used in a captured CUDA
        graph are never dropped (see :mod:`tpool.buffers`). Bucket a loop's shapes.

    Example
    -------
    >>> i32 = lambda v: torch.tensor(v, dtype=torch.int32)
    >>> pool = PagePool(16, page_size=4, device="cpu", backend="reference")
    >>> table = PageTable(pool, max_requests=2, max_pages_per_request=4)
    >>> r = table.extend(i32([0, 1]), i32([6, 1]), max_tokens=8)   # two prefills
    >>> r.slots.tolist(), r.ok.tolist()        # request 0: pages 0, 1; request 1: page 2
    ([0, 1, 2, 3, 4, 5, 8, -1], [True, True])
    >>> table.extend(i32([0, 1]), i32([1, 1])).slots.tolist()    # a decode step
    [6, 9]
    >>> s = table.step(i32([0, 1]), i32([1, 1]))                  # the next one, with its CSR
    >>> s.slots.tolist(), s.csr.indptr.tolist(), s.csr.indices[:3].tolist()
    ([7, 10], [0, 2, 3], [0, 1, 2])
    """

    def __init__(self, pool, max_requests: int, max_pages_per_request: int, *,
                 max_shapes: int = DEFAULT_MAX_SHAPES):
        if not isinstance(pool, PagePool):
            raise ValueError(f"pool: expected a tpool.PagePool, got {type(pool).__name__}")
        max_requests, max_pages_per_request, max_shapes = (_checks.check_size(v, name, 1) for name, v in (
            ("max_requests", max_requests), ("max_pages_per_request", max_pages_per_request),
            ("max_shapes", max_shapes)))
        # (plan_pages checks the same, naming its own arguments)
        _checks.check_table_bounds(max_requests, max_pages_per_request, pool.page_size, pool.num_pages)
        self.pool, self.device = pool, pool.device
        self.max_requests, self.max_pages, self.page_size = max_requests, max_pages_per_request, pool.page_size
        # the most one call appends (within what a kernel indexes: a slot buffer is int32-indexed)
        self.most_tokens = min(pool.max_batch * max_pages_per_request * pool.page_size, MAX_INDEXED)
        self.state = self._empty_state()
        self.block_table, self.seq_lens = self.state.block_table, self.state.seq_lens
        self.ops = make_table_ops(pool.backend, pool.state, self.state)  # the backend's TableOps (tpool.backends)
        # Output buffers per call shape, at most max_shapes of them (tpool.buffers); every call
        # writes the pool's and the table's state, so no input may share memory with those.
        self._written = pool._written | _checks.written_storages(self.state.tensors().values())
        self._shapes = ShapeBuffers(self.device, max_shapes, self._written, pool.state.lock)
        self._check_written = not self.ops.checks_overlap  # numba's compiled hot calls check it themselves
        # The inputs the last call checked (see _ids, _lanes), and the last step's (req_ids, num_tokens,
        # max_tokens, capacity, BoundStep or None, what a repeated step calls or None) (see step). Each is
        # one tuple, replaced whole: another thread reads the old tuple or the new, never a mix; and what
        # a memo says holds of the tensors it names, whichever thread's call checked them.
        self._seen_ids, self._seen_nums = _checks.NOT_SEEN, _checks.NOT_SEEN  # the last inputs checked (_lanes)
        self._repeat = (*(_checks.UNCHECKED,) * 4, None)  # None: no BoundStep yet (step_binding)
        self._shapes.on_drop(self._shape_dropped)
        with pool.state.lock:  # (tpool.graphs.state_tensors lists them under it)
            pool._tables[id(self)] = self

    def _empty_state(self) -> TableState:
        """A new, empty ``TableState`` of this table's sizes on its device (every row unused, no pages):
        the state the table is made with, and what :func:`tpool.graphs.preserved` puts back in a table
        made inside its block."""
        return TableState.create(self.max_requests, self.max_pages, self.page_size, self.pool.max_batch, self.device)

    def __reduce_ex__(self, protocol):
        raise TypeError("a PageTable cannot be copied or pickled: its kernels are bound to the addresses of "
                        "its state and output tensors; make a new PageTable")

    def __repr__(self):
        return (f"PageTable(max_requests={self.max_requests}, max_pages_per_request={self.max_pages}, "
                f"page_size={self.page_size}, pool={self.pool!r})")

    def _ids(self, t, name="req_ids"):
        """Length of a request-id vector, checked (at most the pool's ``max_batch``)."""
        if _checks.still_seen(t, seen := self._seen_ids):  # (read once: another thread may replace it)
            return seen[2]  # the tensor the last call checked, as it was (see _lanes)
        if not 0 <= (n := i32_len(t, self.device)) <= self.pool.max_batch:
            n = _checks.check_vector(t, name, torch.int32, self.device, self.pool.max_batch, _LANES)
        self._seen_ids = _checks.seen(t)
        return n

    def _lane_vector(self, t, name, b):
        """Check a per-lane int32 vector of ``b`` entries."""
        if i32_len(t, self.device) != b:
            n = _checks.check_vector(t, name, torch.int32, self.device)  # (no cap: its length must be b)
            if n != b:
                raise ValueError(f"{name}: expected {_checks.entries(b)} (one per request id), got {n}")

    def _lanes(self, req_ids, num_tokens) -> int:
        """Batch size of an (ids, per-lane int32) pair, both checked.

        The pair the last call checked, as it was (object, address, length, storage size:
        :func:`tpool._checks.still_seen`), is not checked again (a loop refilling its
        inputs in place, as ``step`` binds them). What goes unnoticed is a view over the same
        bytes of the same length (``as_strided_``): the kernel reads the bytes it checked.
        """
        ids, nums = self._seen_ids, self._seen_nums  # checked by this call or another (_ids): lengths compared
        if (req_ids is ids[0] and num_tokens is nums[0] and req_ids.data_ptr() == ids[1]  # _checks.still_seen of
                and num_tokens.data_ptr() == nums[1] and req_ids.numel() == ids[2] == nums[2] == num_tokens.numel()
                and ids[3]() == ids[4] and nums[3]() == nums[4]):  # both, inline: a step's hot path
            return ids[2]
        b = self._ids(req_ids)
        self._lane_vector(num_tokens, "num_tokens", b)
        self._seen_nums = _checks.seen(num_tokens)
        return b

    def _extend_out(self, b, t):
        t = _checks.check_size(t, "max_tokens")
        if t > self.most_tokens:
            raise ValueError(f"max_tokens: expected at most {self.most_tokens} (max_batch * max_pages_per_request * "
                             f"page_size, no call appends more; at most {MAX_INDEXED}), got {t}")
        return fixed_full(t, L.NULL_PAGE, torch.int32, self.device), fixed_full(b, False, torch.bool, self.device)

    def _step_out(self, b, t):
        """A step's ``slots``, ``ok``, ``positions``, ``qo_indptr``, ``kv_lens`` for ``(B, max_tokens)``."""
        slots, ok = self._extend_out(b, t)
        return (slots, ok, fixed_full(slots.numel(), L.NULL_PAGE, torch.int32, self.device),
                fixed_full(b + 1, 0, torch.int32, self.device), fixed_full(b, 0, torch.int32, self.device))

    def _csr_out(self, b, cap):
        """CSR buffers of one shape and their :class:`~tpool.state.CsrMemo`."""
        cap = _checks.check_size(cap, "capacity")
        if cap > (most := min(self.pool.max_batch * self.max_pages, MAX_INDEXED)):
            raise ValueError(f"capacity: expected at most {most} (max_batch * max_pages_per_request: no batch "
                             f"has more pages; at most {MAX_INDEXED}), got {cap}")
        csr = PagedKVCSR(fixed_full(b + 1, 0, torch.int32, self.device),
                         fixed_full(cap, L.NULL_PAGE, torch.int32, self.device),
                         fixed_full(b, 0, torch.int32, self.device))
        return csr, CsrMemo(b, cap, self.device, csr)

    @staticmethod
    def _not_written(entry, *inputs):
        """Refuse inputs that share memory with what the call of ``entry`` writes (``ValueError``)."""
        for name, t in inputs:
            _checks.check_not_written(t, name, entry[3])

    # ------------------------------------------------------------ hot path
    def extend(self, req_ids: torch.Tensor, num_tokens: torch.Tensor, *, max_tokens: int | None = None) -> ExtendResult:
        """Append ``num_tokens[i]`` tokens to request ``req_ids[i]``; allocate pages as needed.

        A request that crosses page boundaries takes its new pages from the pool
        in the same pass, first come first served over the lanes that need pages;
        one that cannot get them (or would exceed ``max_pages_per_request``) is left
        unchanged and reported in ``ok``. A lane that needs no new page is never
        refused because an earlier lane could not get its pages.

        Parameters
        ----------
        req_ids : torch.Tensor
            shape ``[B]``, int32, on the table's device; -1 = padding.
        num_tokens : torch.Tensor
            shape ``[B]``, int32, on the table's device: tokens to append per lane.
        max_tokens : int, optional
            Length of ``slots`` (the batch's token budget, known to the scheduler);
            default ``B`` (one token per request: a decode step).

        Returns
        -------
        ExtendResult
            ``slots`` int32 ``[max_tokens]`` and ``ok`` bool ``[B]``, on the table's device,
            in table-owned buffers overwritten by the next call of the same shape.
        """
        b = self._lanes(req_ids, num_tokens)
        t = b if max_tokens is None else _checks.check_size(max_tokens, "max_tokens")  # (a key holds ints)
        key = ("extend", b, t)
        entry = self._shapes.get(key)
        if entry is None:
            def build():
                res = self._shapes.buffer(key, lambda: ExtendResult(*self._extend_out(b, t)))
                return self._shapes.add(key, (key,), res, self.ops.extend_into(res))
            entry = self._shapes.make(key, build)
        if self._check_written:
            self._not_written(entry, ("req_ids", req_ids), ("num_tokens", num_tokens))
        entry[1](req_ids, num_tokens, b)
        return entry[0]

    def step(self, req_ids: torch.Tensor, num_tokens: torch.Tensor, *, max_tokens: int | None = None,
             capacity: int | None = None, out: StepOut | None = None, release: torch.Tensor | None = None,
             release_cache: bool = False) -> StepResult:
        """One scheduler step: :meth:`extend`, then :meth:`flashinfer_csr` of the same batch.

        Same results as the two calls one after the other (the CSR includes the pages
        the extend just added), in one call: on numba one kernel call, on triton one
        launch. A decode step is ``table.step(ids, ones)``.

        Parameters
        ----------
        req_ids : torch.Tensor
            shape ``[B]``, int32, on the table's device; -1 = padding.
        num_tokens : torch.Tensor
            shape ``[B]``, int32, on the table's device: tokens to append per lane.
        max_tokens : int, optional
            Length of ``slots``, as in :meth:`extend`; default ``B``.
        capacity : int, optional
            Length of ``csr.indices``, as in :meth:`flashinfer_csr`.
        out : StepOut, optional
            Caller-owned outputs from :meth:`step_out` to write instead of the table's
            (overlap scheduling: alternate two, so step N+1 never overwrites what the
            forward of step N still reads).
        release : torch.Tensor, optional
            shape ``[K]``, int32, on the table's device (-1 = padding): requests to
            :meth:`release` first, in the same call (the finished requests of a scheduler
            step, padded to a fixed ``K``). The same as ``release(release)`` then ``step(...)``,
            but one façade call and, on numba, one kernel call: a call costs microseconds of
            Python when a forward pass has cooled the caches. Such a step is checked every
            call (it is not bound as repeated steps are: :meth:`bind_step` with ``release=``
            binds it), and on triton the release is a launch of its own. Padding only (nothing
            finished) changes no row (the clock ticks, as for any release), and the step still grows
            its CSR in place on numba;
            ``None`` saves the checks.
        release_cache : bool
            As ``cache`` in :meth:`release`: pages whose last reference goes become CACHED.

        Returns
        -------
        StepResult
            ``slots`` int32 ``[max_tokens]``, ``ok`` bool ``[B]``, ``csr`` (a
            :class:`PagedKVCSR`) and the attention metadata ``positions`` int32
            ``[max_tokens]``, ``qo_indptr`` int32 ``[B+1]``, ``kv_lens`` int32 ``[B]``, on the
            table's device, in table-owned buffers: all but ``csr`` are shared by steps of
            the same ``(B, max_tokens)``, ``csr`` by steps of the same ``(B, capacity)``;
            the next such step overwrites them.

        Examples
        --------
        Request 0 holds 3 tokens; lane 0 decodes it, lane 1 prefills request 1 with
        2 tokens, lane 2 is padding; ``max_tokens=4`` leaves one slot unused:

        >>> i32 = lambda v: torch.tensor(v, dtype=torch.int32)
        >>> table = PageTable(PagePool(8, page_size=4, device="cpu"), max_requests=4, max_pages_per_request=4)
        >>> _ = table.extend(i32([0]), i32([3]), max_tokens=3)
        >>> r = table.step(i32([0, 1, -1]), i32([1, 2, 0]), max_tokens=4)
        >>> r.positions.tolist(), r.qo_indptr.tolist(), r.kv_lens.tolist()
        ([3, 0, 1, -1], [0, 1, 3, 3], [4, 2, 0])

        Notes
        -----
        A decode loop that passes the same two tensor objects every step (filled in
        place) gets :meth:`bind_step`'s speed without asking: from the second such step
        on, the table keeps them bound (:attr:`step_binding`) and a step only checks
        that they still have their memory and length, as a bound step does (with the
        same ``max_tokens`` and ``capacity``: equal ints, or None). What goes unnoticed
        is a view over the same bytes with the same length (``t.data = t.view(torch.float32)``,
        ``as_strided_``): on numba the kernel then reads the bytes it checked as int32 and
        range-checks them as ids, never out of bounds (the reference backend converts the
        values); a view of another length
        (``t.view(torch.uint8)``) is checked as a new input.
        The table holds a reference to the last step's inputs. When it drops their call
        shape (``max_shapes``) it lets the binding go too: the next step makes the shape's
        buffers again and binds them, so a step always writes buffers the table keeps.
        """
        if out is not None or release is not None or release_cache is not False:  # (checked there, always)
            return self._step_into(req_ids, num_tokens, max_tokens, capacity, out, release, release_cache)
        last = self._repeat
        if (req_ids is last[0] and num_tokens is last[1]
                and (max_tokens is last[2] or (type(max_tokens) is int and max_tokens == last[2]))
                and (capacity is last[3] or (type(capacity) is int and capacity == last[3]))):
            run = last[4]
            if run is None:  # the second step in a row on these tensors: bind them (checked once, there)
                run = self._bind_repeat(req_ids, num_tokens, last[2], last[3])
            try:
                return run()
            except StaleBinding:  # reassigned or resized since: check them as new inputs
                pass
        b, entry = self._step_shape(req_ids, num_tokens, max_tokens, capacity)
        self._repeat = (req_ids, num_tokens, max_tokens, capacity, None)
        entry[1](req_ids, num_tokens, b)
        return entry[0]

    def _bind_repeat(self, req_ids, num_tokens, max_tokens, capacity):
        """Bind a step's inputs given twice in a row (:meth:`step`); what its next steps call.

        Made and noted under the pool's lock, so a drop of its shape (``max_shapes``, on any
        thread) comes before, and the binding writes the buffers made again, or after, and
        :meth:`_shape_dropped` forgets it: a repeated step never writes buffers the table no
        longer keeps (which capture would neither pin nor refuse). On CUDA the BoundStep pins its
        shape when it runs inside graph capture, as an unbound call of that shape does."""
        with self.pool.state.lock:
            run = BoundStep(self, req_ids, num_tokens, max_tokens, capacity)
            self._repeat = (req_ids, num_tokens, max_tokens, capacity, run)
        return run

    def _shape_dropped(self, key):
        """The table dropped call shape ``key`` (``max_shapes``; under the lock): forget the binding of
        :meth:`step` that writes its buffers. The inputs stay noted, so the next step binds them again."""
        last = self._repeat
        if last[4] is not None and last[4]._key == key:
            self._repeat = (*last[:4], None)

    def _step_into(self, req_ids, num_tokens, max_tokens, capacity, out, release=None, release_cache=False):
        """:meth:`step` into caller-owned outputs (``out``), or releasing requests first (``release``)."""
        if type(release_cache) is not bool:  # checked with or without release
            release_cache = _checks.flag(release_cache, "release_cache")
        if out is None:
            b, entry = self._step_shape(req_ids, num_tokens, max_tokens, capacity)
            run, result, written = entry[1], entry[0], entry[3]
        else:
            b = self._into_out(req_ids, num_tokens, max_tokens, capacity, out)
            run, result, written = out._run, out.result, out._written
        if release is None:
            run(req_ids, num_tokens, b)
            return result
        if not 0 <= i32_len(release, self.device) <= self.pool.max_batch:
            _checks.check_vector(release, "release", torch.int32, self.device, self.pool.max_batch, _LANES)
        if self._check_written:  # numba's compiled step checks it itself
            _checks.check_not_written(release, "release", written)
        if release_cache:  # as release(cache=True): this thread's open free group's frees first
            self.pool._flush_group()
        run(req_ids, num_tokens, b, release, release_cache)
        return result

    def _into_out(self, req_ids, num_tokens, max_tokens, capacity, out) -> int:
        """The batch size of a step into ``out`` (a :class:`StepOut` of this table), its inputs checked
        against it: the batch, and ``max_tokens`` and ``capacity`` when given, are the StepOut's, and
        no input shares memory with what the step writes."""
        if type(out) is not StepOut or out.table is not self:
            raise ValueError(f"out: expected a StepOut from this table's step_out(), got "
                             f"{'one from another table' if type(out) is StepOut else type(out).__name__}")
        b = self._lanes(req_ids, num_tokens)
        for name, given, have in (("batch", b, out.batch), ("max_tokens", max_tokens, out.max_tokens),
                                  ("capacity", capacity, out.capacity)):
            if given is not None and type(given) is not int:
                given = _checks.check_size(given, name)  # (True or 4.0 is no size)
            if given is not None and given != have:
                raise ValueError(f"{name}: expected {have} (the StepOut's), got {given}")
        for name, t in (("req_ids", req_ids), ("num_tokens", num_tokens)):
            _checks.check_not_written(t, name, out._written)
        return b

    def step_out(self, batch: int, *, max_tokens: int | None = None, capacity: int | None = None) -> StepOut:
        """Caller-owned outputs for ``step(..., out=)``: make two to overlap scheduling with the forward.

        Parameters
        ----------
        batch : int
            ``B``, the number of lanes of the steps that will write it.
        max_tokens : int, optional
            Length of ``slots``; default ``B``.
        capacity : int, optional
            Length of ``csr.indices``; default ``B * max_pages_per_request``.

        Returns
        -------
        StepOut
            ``out.result`` is the :class:`StepResult` every ``step(..., out=out)`` writes.
        """
        b = _checks.check_size(batch, "batch", 0)
        if b > self.pool.max_batch:
            raise ValueError(f"batch: expected at most {self.pool.max_batch} (the pool's max_batch), got {b}")
        _, _, t, cap = self._step_key(b, max_tokens, capacity)
        return StepOut(self, b, t, cap)

    def _step_shape(self, req_ids, num_tokens, max_tokens, capacity):
        """``(B, Entry)`` of a step, its inputs checked: slots/ok per (B, max_tokens) and the CSR
        per (B, capacity), each buffer set shared by the steps of that shape."""
        b = self._lanes(req_ids, num_tokens)
        key = self._step_key(b, max_tokens, capacity)
        entry = self._shapes.get(key)
        if entry is None:
            def build():
                _, _, t, cap = key
                csr_key, out_key = ("step-csr", b, cap), ("step", b, t)
                csr, memo = self._shapes.buffer(csr_key, lambda: self._csr_out(b, cap))
                slots, ok, *meta = self._shapes.buffer(out_key, lambda: self._step_out(b, t))
                res = StepResult(slots, ok, csr, *meta)
                return self._shapes.add(key, (out_key, csr_key), res, self.ops.step_into(res, memo), memo)
            entry = self._shapes.make(key, build)
        if self._check_written:
            self._not_written(entry, ("req_ids", req_ids), ("num_tokens", num_tokens))
        return b, entry

    def _step_key(self, b, max_tokens, capacity):
        """The call shape of a step of ``b`` lanes: its key among the table's output buffers (sizes as ints)."""
        t = b if max_tokens is None else _checks.check_size(max_tokens, "max_tokens")
        cap = b * self.max_pages if capacity is None else _checks.check_size(capacity, "capacity")
        return ("step", b, t, cap)

    def bind_step(self, req_ids: torch.Tensor | None = None, num_tokens: torch.Tensor | None = None, *,
                  batch: int | None = None, max_tokens: int | None = None, capacity: int | None = None,
                  release: "torch.Tensor | int | None" = None, release_cache: bool = False,
                  out: StepOut | None = None) -> "BoundStep":
        """:meth:`step` on fixed input tensors, checked once; call the result every step.

        For a decode loop that keeps its inputs in persistent tensors and fills them in
        place each step (as a CUDA graph's static inputs). ``run = table.bind_step(ids,
        ntok)`` checks dtype, device and shape here; ``run()`` then only checks that the
        two tensors still have the same memory and length (:class:`StaleBinding`, a
        ``ValueError``, if not) and runs the step: on numba that saves the per-call
        argument checks.

        ``run = table.bind_step(batch=B)`` makes the two inputs itself (``run.req_ids``
        filled with -1, ``run.num_tokens`` with 0; fill them in place). On a CPU they
        are numpy int32 arrays ``[B]`` held by ``run``, over tensors whose storages the binding
        keeps: numpy resizes no array that does not own its memory (``refcheck=False`` too),
        and none can free it, so the memory stays put and ``run()`` checks nothing at all
        and makes no torch call, the fastest step when the caches are cold (a forward
        pass between two steps). Every call runs exactly ``B`` lanes from that memory,
        as a captured graph reads its static inputs. On CUDA they are tensors under the
        checked binding above.

        Parameters
        ----------
        req_ids : torch.Tensor, optional
            shape ``[B]``, int32, on the table's device; -1 = padding. Filled in place
            before each ``run()``.
        num_tokens : torch.Tensor, optional
            shape ``[B]``, int32, on the table's device. Filled in place before each ``run()``.
        batch : int, optional
            Instead of the two tensors: ``B`` (at most the pool's ``max_batch``), and the
            table makes them: numpy int32 arrays on a CPU, int32 tensors on CUDA.
        max_tokens, capacity : int, optional
            As in :meth:`step`.
        release : torch.Tensor or int, optional
            Requests to release first in each call, as ``step(..., release=)``: with the two
            tensors, a tensor ``[K]`` (int32, on the table's device) bound as they are; with
            ``batch=B``, the number ``K`` of release lanes, and the table makes ``run.release``
            (a numpy int32 array on a CPU, a tensor on CUDA). Each ``run()`` releases the ids
            there (-1 = padding), sets all ``K`` entries to -1, then steps, in one call: write
            the ids of the requests that finished, and a step where none did releases nothing.
            Because the call consumes them, an id written once is released once, never again
            after a new request took its row. ``K`` is at most the pool's ``max_batch``; a
            tensor given here must be writable memory (each call writes it) and share none
            with the other inputs or with what the step writes.
        release_cache : bool
            As in :meth:`step`.
        out : StepOut, optional
            Write into these caller-owned outputs (:meth:`step_out`) instead of the table's
            buffers of this shape: bind two steps on two input sets and two StepOuts and
            alternate them, so step N+1 is prepared while the forward still reads step N's
            outputs (overlap scheduling, bound). Its batch, and ``max_tokens`` and
            ``capacity`` when given, must be the StepOut's.

        Returns
        -------
        BoundStep
            ``run()`` performs the step and returns the table-owned :class:`StepResult`
            of this shape (the same buffers as ``step`` returns), or ``out.result``.

        Example
        -------
        >>> pool = PagePool(16, page_size=4, device="cpu", backend="numba")
        >>> table = PageTable(pool, max_requests=2, max_pages_per_request=4)
        >>> run = table.bind_step(batch=2)
        >>> run.req_ids[:] = [0, 1]                          # numpy arrays on a CPU
        >>> run.num_tokens[:] = 1
        >>> run().slots.tolist(), run().slots.tolist()      # two decode steps
        ([0, 4], [1, 5])

        A scheduler's step, where requests finish and others join, in one call:

        >>> run = table.bind_step(batch=2, max_tokens=4, release=1)
        >>> run.req_ids[:], run.num_tokens[:] = [0, 1], 1
        >>> run().kv_lens.tolist()
        [3, 3]
        >>> run.release[0] = 1                              # request 1 finished ...
        >>> run.num_tokens[1] = 3                           # ... and a new one takes its row
        >>> r = run()
        >>> r.kv_lens.tolist(), run.release.tolist()        # release ids consumed
        ([4, 3], [-1])
        """
        if batch is None:
            if req_ids is None or num_tokens is None:
                raise ValueError("bind_step: expected req_ids and num_tokens, or batch=B alone")
            if release is not None and not isinstance(release, torch.Tensor):
                raise ValueError(f"release: expected an int32 tensor with req_ids and num_tokens (an int K with "
                                 f"batch=B), got {_checks._describe(release)}")
            return BoundStep(self, req_ids, num_tokens, max_tokens, capacity, release=release,
                             release_cache=release_cache, out=out)
        if req_ids is not None or num_tokens is not None:
            raise ValueError("bind_step: expected req_ids and num_tokens, or batch=B alone, got both")
        b = _checks.check_size(batch, "batch", 0)
        if b > self.pool.max_batch:  # before allocating anything
            raise ValueError(f"batch: expected at most max_batch={self.pool.max_batch} lanes, got {b}")
        k = None
        if release is not None:
            if isinstance(release, torch.Tensor):
                raise ValueError("release: with batch=B, expected the number K of release lanes (the table "
                                 "makes them), got a tensor")
            k = _checks.check_size(release, "release", 0)
            if k > self.pool.max_batch:
                raise ValueError(f"release: expected at most max_batch={self.pool.max_batch} lanes, got {k}")
        if self.device.type == "cpu":
            # numpy arrays over table-made tensors (fixed_full: storages that cannot be resized), whose storages
            # the step holds: an array that does not own its memory is never resized by numpy (refcheck=False
            # too), and nothing reachable from it owns that memory (_array_over), so no numpy call frees it:
            # numpy < 2 frees an owning array's memory at once when its ``data`` is assigned, whoever points
            # into it (the release ids' -1s were then written into freed memory).
            owners = [fixed_full(b, -1, torch.int32, self.device), fixed_full(b, 0, torch.int32, self.device)]
            owners += [] if k is None else [fixed_full(k, -1, torch.int32, self.device)]
            ids, ntok, rel = [_array_over(o) for o in owners] + [None] * (k is None)
            return BoundStep(self, ids, ntok, max_tokens, capacity, fixed=tuple(o.untyped_storage() for o in owners),
                             release=rel, release_cache=release_cache, out=out)
        rel = None if k is None else fixed_full(k, -1, torch.int32, self.device)
        return BoundStep(self, fixed_full(b, -1, torch.int32, self.device), fixed_full(b, 0, torch.int32, self.device),
                         max_tokens, capacity, release=rel, release_cache=release_cache, out=out)

    def release(self, req_ids: torch.Tensor, *, cache: bool = False) -> None:
        """Drop every page reference of these requests and reset their rows.

        Pages shared with other requests survive while others hold them; with
        ``cache=True`` pages whose last reference goes become CACHED (a prefix cache
        keeps them), else FREE. Cached, each row's pages go on the pool's LRU queue last
        page first, so eviction takes a request's tail before its head (a prefix cache
        can only reuse a prefix); a page shared by rows released in this call goes at
        its last occurrence, after every one of those rows' deeper pages.

        Parameters
        ----------
        req_ids : torch.Tensor
            shape ``[B]``, int32, on the table's device; -1 = padding.
        cache : bool
            Keep pages whose last reference goes as CACHED.
        """
        self._ids(req_ids)
        cache = _checks.flag(cache, "cache")
        _checks.check_not_written(req_ids, "req_ids", self._written)
        self._release(req_ids, cache)

    def _release(self, req_ids, cache: bool) -> None:
        """:meth:`release` of inputs that pass its checks by construction: a plain int32 vector of at most
        ``max_batch`` ids on the table's device, on memory no table call writes (``HostMirror``'s kept
        inputs: its own tensors, their checks a few microseconds each once a forward pass cooled the caches)."""
        if cache:  # which call drops a page's last reference decides CACHED or FREE: this thread's open free
            self.pool._flush_group()  # group's frees come first, as without the group
        self.ops.release(req_ids, cache)

    def truncate(self, req_ids: torch.Tensor, new_lens: torch.Tensor | None = None, *,
                 drop: torch.Tensor | None = None) -> None:
        """Roll requests back to ``new_lens[i]`` tokens, or by ``drop[i]`` tokens (rejected speculative tokens).

        Pages past the new length are freed. A new length above the current one
        (or below 0) is a ``bad_length`` error and leaves that request unchanged, and so
        is a new length that ends inside a page another request also holds (a page shared
        by ``fork`` or :meth:`revive`, or revived by ``pool.incref``): the request's next token would be
        written into that page, over the other holder's K/V. Rolling a fork back to its
        fork point never meets this (``fork`` shares whole pages and copies a partial one).

        Parameters
        ----------
        req_ids : torch.Tensor
            shape ``[B]``, int32, on the table's device; -1 = padding.
        new_lens : torch.Tensor, optional
            shape ``[B]``, int32, on the table's device: each request's length after the call.
        drop : torch.Tensor, optional
            shape ``[B]``, int32, on the table's device: tokens to remove from the end of each
            request (what speculative decoding knows: how many drafts it rejected). Give
            exactly one of ``new_lens`` and ``drop``. The new lengths are worked out in the
            same call (``seq_lens[req_ids] - drop``, no sync, no extra launch on numba); a drop
            larger than the length, or negative, is a ``bad_length``.
        """
        b = self._ids(req_ids)
        if (new_lens is None) == (drop is None):
            raise ValueError("truncate: expected exactly one of new_lens and drop")
        name, lens = ("new_lens", new_lens) if drop is None else ("drop", drop)
        self._lane_vector(lens, name, b)
        _checks.check_not_written(lens, name, self._written)
        _checks.check_not_written(req_ids, "req_ids", self._written)
        self._truncate(req_ids, lens, drop is not None)

    def _truncate(self, req_ids, lens, drop: bool) -> None:
        """:meth:`truncate` of inputs that pass its checks by construction (as :meth:`_release`'s: two
        such vectors of one length, the lengths or the drops as ``drop`` says)."""
        self.pool._flush_group()  # it reads reference counts (a shared page): this thread's group's frees first
        self.ops.truncate(req_ids, lens, drop)

    def fork(self, src_ids: torch.Tensor, dst_ids: torch.Tensor, lens: torch.Tensor) -> ForkResult:
        """Let empty request ``dst_ids[i]`` share the first ``lens[i]`` tokens of ``src_ids[i]``.

        Whole pages are shared (reference counts go up). If ``lens[i]`` ends inside a
        page, ``dst`` gets a fresh page for it and the pair is returned so the caller
        copies the KV data (copy-on-write).

        Parameters
        ----------
        src_ids : torch.Tensor
            shape ``[B]``, int32, on the table's device: the requests to share from.
        dst_ids : torch.Tensor
            shape ``[B]``, int32, on the table's device: empty requests; -1 = padding.
        lens : torch.Tensor
            shape ``[B]``, int32, on the table's device: tokens to share, at most ``src``'s length.

        Returns
        -------
        ForkResult
            ``ok`` bool ``[B]``, ``cow_src`` and ``cow_dst`` int32 ``[B]`` (-1 where no copy is
            needed), on the table's device, in table-owned buffers.
        """
        b = self._ids(dst_ids, "dst_ids")
        self._lane_vector(src_ids, "src_ids", b)
        self._lane_vector(lens, "lens", b)
        key = ("fork", b)
        entry = self._shapes.get(key)
        if entry is None:
            def build():
                res = self._shapes.buffer(key, lambda: ForkResult(
                    fixed_full(b, False, torch.bool, self.device), fixed_full(b, L.NULL_PAGE, torch.int32, self.device),
                    fixed_full(b, L.NULL_PAGE, torch.int32, self.device)))
                fork, held = self.ops.fork, tuple(map(held_view, res))  # (a buffer re-pointed by hand: not followed)
                return self._shapes.add(key, (key,), res, lambda src, dst, n: fork(src, dst, n, *held))
            entry = self._shapes.make(key, build)
        self._not_written(entry, ("src_ids", src_ids), ("dst_ids", dst_ids), ("lens", lens))
        self.pool._flush_group()   # it takes references, as incref: a page freed in an open group is FREE here
        entry[1](src_ids, dst_ids, lens)
        return entry[0]

    def revive(self, req_id: int, pages: torch.Tensor, n_tokens: int, *,
               generations: torch.Tensor | None = None) -> None:
        """Let empty request ``req_id`` hold ``pages`` as its first ``n_tokens`` tokens (a prefix-cache hit).

        All or none, in one call: when every page is USED or CACHED and named once (and, with
        ``generations``, still has the generation recorded for it), each gains one reference
        (a CACHED page is revived, as by ``pool.incref``, and counted in ``pages.revived``),
        the row holds them in order and its length is ``n_tokens``.
        Otherwise no page is taken and the row stays empty (its first ``k`` entries -1, length
        0), so nothing later can be handed a page it holds; the entries that could not be
        taken are counted as ``pool.incref`` counts them: a FREE page (evicted since it was
        cached) as ``use_after_free``, an id outside the pool as ``invalid_page``, a page in
        no known state as ``corrupt_state``, once per entry, and with ``generations`` a USED or
        CACHED page of another generation than recorded as ``use_after_free`` too. A prefix has no
        padding and names each page once: a -1 (not padding here) counts one ``invalid_page``, and
        so does each entry naming a page an earlier entry names, where it would be taken otherwise
        (an entry counts one error at most, a refused call at least one: ``pool.check()`` raises
        them). A row that is not empty (length not 0, on the device) is a ``bad_request`` and changes
        nothing. Only whole pages are revived: the request's next token goes to a fresh page,
        never into a page another revive of the same prefix also holds. The row's CSR runs are forgotten as
        :meth:`invalidate_csr` of that row forgets them (no step keeps or grows a run of it
        noted before). No host read; on numba one kernel call (and a short pass per CSR buffer
        set the table keeps, forgetting the row), on triton one launch.

        The caller's contract: every page is CACHED (released with ``cache=True`` and not
        evicted since: the pool hands out only FREE pages, so a CACHED page keeps its
        content), or USED only by requests that themselves came from ``revive`` or
        :meth:`fork` of it, or that a fork shared it from. A page that a running request holds
        alone must not be revived:
        that request may still write into it, and a scheduler counting its pages would credit
        them at its release. A page evicted and then handed to another request is USED again, which its
        state cannot tell from a shared one; its generation can: a page's generation
        (:meth:`PagePool.generations`) grows each time it becomes FREE. Record them with the
        entry (while a request holds its pages, or while they are CACHED) and pass them as
        ``generations``: a stale entry (one of its pages evicted since, or freed, whether or not
        it was handed out again) is then refused, row empty, each such page counted as
        ``use_after_free``, and the request that holds the page now is untouched. Without
        ``generations`` such a page is revived and two requests share it: drop a prefix-cache
        entry when ``pool.evict`` returns one of its pages (evict picks pages on the device, so
        a scheduler learns which only at its next host read; pass ``generations`` to be safe
        in between).

        A refused stale entry is an error on purpose, not a status: the scheduler went on as if
        the row held ``n_tokens`` tokens (it cannot know otherwise without a host read), so the
        request's next tokens are computed without its prefix and must not be trusted.
        ``pool.check()`` at the next sync point raises ``UseAfterFree`` (a ``HostMirror``'s next
        ``reconcile`` names the row, its length 0); the row's length is the status
        (``seq_lens[req_id] == 0``): finish the request, drop the entry and prefill it again.
        A generation changes only when a page goes FREE, not when a holder rewrites it in
        place: a request truncated into a page and extended again rewrites that page's tail
        under the same generation, so record an entry's generations only for pages no
        rollback will reach (or drop the entry on a truncate).

        Parameters
        ----------
        req_id : int
            The row, in ``[0, max_requests)``; empty (``seq_lens[req_id] == 0``).
        pages : torch.Tensor
            shape ``[n_tokens // page_size]``, int32, contiguous, on the table's device: the
            pages of the prefix in token order, each once and no -1 (no padding: each entry is
            one of the row's pages; a -1 or a repeat is counted as ``invalid_page``). Read, never
            written (it must not share memory with the pool's or the table's state).
        n_tokens : int
            The tokens they hold: a multiple of ``page_size``, at most
            ``max_pages_per_request * page_size``.
        generations : torch.Tensor, optional
            shape ``[n_tokens // page_size]``, int32, contiguous, on the table's device: each
            page's generation as :meth:`PagePool.generations` gave it when the entry was made.
            Read, never written. Default: not compared (the behaviour without generations).

        Raises
        ------
        ValueError
            Before any device work, naming the expected and the actual value: ``req_id`` or
            ``n_tokens`` not an int in range, ``n_tokens`` not a multiple of ``page_size``,
            ``pages`` or ``generations`` of another length, dtype, device or layout, or sharing
            memory with state.

        Example
        -------
        >>> i32 = lambda v: torch.tensor(v, dtype=torch.int32)
        >>> pool = PagePool(8, page_size=4, device="cpu", backend="reference")
        >>> table = PageTable(pool, max_requests=2, max_pages_per_request=4)
        >>> _ = table.extend(i32([0]), i32([8]), max_tokens=8)   # request 0: pages 0, 1
        >>> table.release(i32([0]), cache=True)                   # both CACHED now
        >>> table.revive(1, i32([0, 1]), 8)                       # a hit: request 1 holds them
        >>> table.block_table[1].tolist(), table.seq_lens.tolist(), pool.stats()["pages.revived"]
        ([0, 1, -1, -1], [0, 8], 2)
        >>> table.revive(0, i32([1, 1]), 8)       # a page named twice: refused, row 0 stays empty
        >>> table.block_table[0].tolist(), table.seq_lens.tolist(), pool.state.refcount[:2].tolist()
        ([-1, -1, -1, -1], [0, 8], [1, 1])
        >>> pool.stats()["errors.invalid_page"]   # its second entry (pool.check() raises InvalidPage)
        1

        With generations, a stale entry is refused:

        >>> table.release(i32([1]), cache=True)           # pages 0, 1 CACHED again
        >>> gens = pool.generations(i32([0, 1]))          # recorded with the prefix-cache entry
        >>> gens.tolist(), pool.evict(1).tolist()         # the row's last page goes first: page 1, generation 1
        ([0, 0], [1])
        >>> _ = table.extend(i32([1]), i32([4]), max_tokens=4)   # page 1 handed to request 1
        >>> table.revive(0, i32([0, 1]), 8, generations=gens)    # stale: refused, row 0 stays empty
        >>> table.block_table[:, 0].tolist(), pool.generations(i32([0, 1])).tolist()
        ([-1, 1], [0, 1])
        >>> pool.stats()["errors.use_after_free"]
        1
        """
        req_id = _checks.check_size(req_id, "req_id")
        if req_id >= self.max_requests:
            raise ValueError(f"req_id: expected a row in [0, {self.max_requests}), got {req_id}")
        self._revive_inputs(pages, n_tokens, generations)
        self._revive(req_id, pages, generations)

    def _revive_inputs(self, pages, n_tokens, generations=None) -> int:
        """:meth:`revive`'s checks of ``pages``, ``n_tokens`` and ``generations`` (metadata only); returns
        ``k``, the pages."""
        ps, n_tokens = self.page_size, _checks.check_size(n_tokens, "n_tokens")
        if n_tokens % ps or n_tokens > self.max_pages * ps:
            raise ValueError(f"n_tokens: expected a multiple of page_size {ps} up to max_pages_per_request * "
                             f"page_size = {self.max_pages * ps} (whole pages only), got {n_tokens}")
        k, dev, written = n_tokens // ps, self.device, self._written
        if _checks.input_len(pages, dev, written) != k or (
                generations is not None and _checks.input_len(generations, dev, written) != k):
            self._revive_vectors(pages, generations, k)  # the full checks, in order: raise (or accept a rare valid one)
        return k

    def _revive_vectors(self, pages, generations, k) -> None:
        """The full checks of :meth:`revive`'s vectors, ``pages`` first: the error names the first one wrong."""
        checked = [("pages", pages, "n_tokens / page_size")]
        if generations is not None:
            checked.append(("generations", generations, "as pages"))
        for name, t, why in checked:
            if i32_len(t, self.device) != k and _checks.check_vector(t, name, torch.int32, self.device) != k:
                raise ValueError(f"{name}: expected {_checks.entries(k)} ({why}), got {t.numel()}")
            _checks.check_not_written(t, name, self._written)

    def _revive(self, req_id: int, pages, generations=None) -> None:
        """:meth:`revive` of checked inputs: the one backend call, with the memos to forget the row in."""
        self.pool._flush_group()   # as incref: a page freed in this thread's open group is FREE to it
        with self.pool.state.lock:  # the memos and the call: as invalidate_csr of the row, atomic
            # (the memos are added under this lock; listing none costs ~1 us, asking whether there are none ~60 ns)
            self.ops.revive(req_id, pages, self._shapes.memo_list() if self._shapes.memos else (), generations)

    # -------------------------------------------------------------- layouts
    def flashinfer_csr(self, req_ids: torch.Tensor, *, capacity: int | None = None) -> PagedKVCSR:
        """FlashInfer's paged-KV CSR for the batch ``req_ids`` (see the README's layouts).

        ``indptr[i+1] - indptr[i] = ceil(seq_len / page_size)``;
        ``last_page_len = seq_len - (num_pages - 1) * page_size``, in ``[1, page_size]``;
        an empty or padding request has no pages and ``last_page_len = page_size``, so
        ``(num_pages - 1) * page_size + last_page_len = 0`` still gives its length. A
        request whose length is outside its row, or whose pages include an id outside
        ``[0, num_pages)`` (hand edits), is exported as empty and counts ``corrupt_state``
        once per batch lane: every id in ``indices[:indptr[B]]`` is a page of the pool.
        Read-only: no clock step.

        Parameters
        ----------
        req_ids : torch.Tensor
            shape ``[B]``, int32, on the table's device; -1 = padding.
        capacity : int, optional
            Length of ``indices``; default ``B * max_pages_per_request``, always enough. A
            batch with more pages counts ``out_overflow``: the first request whose pages do not
            all fit and every later one are exported with no pages (``indptr`` never points past
            ``indices``).

        Returns
        -------
        PagedKVCSR
            ``indptr`` int32 ``[B + 1]``, ``indices`` int32 ``[capacity]`` (-1 past
            ``indptr[B]``), ``last_page_len`` int32 ``[B]``, on the table's device, in
            table-owned buffers.
        """
        b = self._ids(req_ids)
        cap = b * self.max_pages if capacity is None else _checks.check_size(capacity, "capacity")  # (a key: ints)
        key = ("csr", b, cap)
        entry = self._shapes.get(key)
        if entry is None:
            def build():
                csr, memo = self._shapes.buffer(key, lambda: self._csr_out(b, cap))
                return self._shapes.add(key, (key,), csr, self.ops.flashinfer_csr_into(csr, memo), memo)
            entry = self._shapes.make(key, build)
        if self._check_written:
            self._not_written(entry, ("req_ids", req_ids))
        entry[1](req_ids, b)
        return entry[0]

    def block_table_rows(self, req_ids: torch.Tensor) -> torch.Tensor:
        """vLLM-style block table for the batch: each request's row, -1 padded.

        Parameters
        ----------
        req_ids : torch.Tensor
            shape ``[B]``, int32, on the table's device; -1 = padding.

        Returns
        -------
        torch.Tensor
            shape ``[B, max_pages_per_request]``, int32, on the table's device (a table-owned
            buffer); a row of -1 for padding and for ids outside ``[0, max_requests)``, each of
            those but padding one ``bad_request`` (raised by the next ``check()``). Rows are
            copied as they are: bound what you read of row ``i`` by a step's ``kv_lens[i]``,
            0 for a corrupt row (whose entries may not be page ids). Read-only but for that
            counter: no clock step.
        """
        b = self._ids(req_ids)
        key = ("rows", b)
        entry = self._shapes.get(key)
        if entry is None:
            def build():
                rows = self._shapes.buffer(key, lambda: fixed_full((b, self.max_pages), L.NULL_PAGE, torch.int32,
                                                                   self.device))
                copy, held = self.ops.block_table_rows, held_view(rows)  # (re-pointed by hand: not followed)
                return self._shapes.add(key, (key,), rows, lambda ids: copy(ids, held))
            entry = self._shapes.make(key, build)
        self._not_written(entry, ("req_ids", req_ids))
        entry[1](req_ids)
        return entry[0]

    @property
    def step_binding(self) -> "BoundStep | None":
        """The :class:`BoundStep` that :meth:`step` runs for the inputs it was given twice in a row
        (see the note in :meth:`step`), or None when the last step's inputs are not bound."""
        return self._repeat[4]

    def step_grows_csr(self, req_ids: torch.Tensor, *, max_tokens: int | None = None,
                       capacity: int | None = None) -> bool:
        """Whether a :meth:`step` of this batch and shape would grow its CSR in place (numba) rather
        than rebuild it: the buffers of that shape hold this batch's CSR at the table's current
        version (any step grows it), or at the version the step that made the current one came
        from (two :class:`StepOut` buffers taking turns: a step only appends, and a decode step,
        one token a lane on a power-of-two page size, grows that CSR too; another step keeps
        runs of it, :meth:`step_keeps_csr`). A sync point (reads the memo and the batch), for
        tests and profiling.

        Parameters
        ----------
        req_ids : torch.Tensor
            shape ``[B]``, int32, on the table's device: the batch the step would run.
        max_tokens, capacity : int, optional
            As in :meth:`step`; the CSR buffers depend on the batch size and ``capacity`` only
            (``max_tokens`` is taken so a call can pass the step's own arguments).

        Returns
        -------
        bool
        """
        return table_checks.grows_csr(self, req_ids, capacity, max_tokens)

    def step_keeps_csr(self, req_ids: torch.Tensor, *, max_tokens: int | None = None,
                       capacity: int | None = None) -> int:
        """How many lanes of a :meth:`step` of this batch would keep their run of the CSR its buffers
        hold (numba), moving it instead of copying it from the table; 0 when the buffers hold no
        CSR a step may reuse, or any step would grow it in place (the buffers hold this batch's CSR
        at the table's version: :meth:`step_grows_csr`). A lane
        keeps its run when its request is found in that CSR's batch (in order, at most
        ``KEEP_LOOKAHEAD`` old lanes past the previous one found) and the request's row has not
        changed since (a release, truncate, fork or extend changes the rows it names; a step,
        those it gives pages). The count assumes a clean step (no repeated or unknown id) whose
        CSR fits; the step rebuilds otherwise. A sync point, for tests and
        profiling; arguments and shapes as in :meth:`step_grows_csr`.
        """
        return table_checks.keeps_csr(self, req_ids, capacity, max_tokens)

    def invalidate_csr(self, req_ids: torch.Tensor | None = None) -> None:
        """After a hand edit of ``block_table``, ``seq_lens`` or ``state.claim``: the next steps read the edited rows.

        Only needed after such an edit: tpool's own calls, and restoring a whole snapshot of
        the table's state (``tpool.graphs.state_tensors``, ``version`` and ``row_version``
        included), are tracked by the table's version and its rows' stamps.

        Without ``req_ids`` the next step of every shape rebuilds its CSR from every row, and
        on numba every row gets a fresh stamp, so that a run noted after the edit is not kept
        once a snapshot from before it is restored (its stamps are older). With ``req_ids``
        (int32 ``[K]``, on the table's device, -1 = padding), the rows edited and no others:
        on numba those rows get a fresh stamp and the table a fresh version, so the next step
        copies their runs from the rows and keeps every other run (a prefix-cache hit written
        into one row then costs the step one row, not the whole CSR), and every CSR memo
        forgets those rows, so the buffers alive now never keep or grow their old runs, even
        once a snapshot taken between the edit and this call is restored. Such a snapshot
        still holds the edited rows under their old stamps: after restoring it, call this
        again with the same rows before the next step (a step would note the edited pages
        under stamps that a snapshot from before the edit shares). Name every row you edited:
        an id outside ``[0, max_requests)`` (not -1) names no row and counts ``bad_request``
        (raised by the next ``pool.check()``), on every backend, as every table call counts it.
        Not a hot-path call.
        """
        if req_ids is not None:
            _checks.check_vector(req_ids, "req_ids", torch.int32, self.device)
        with self.pool.state.lock:
            if req_ids is not None:  # no host read: the count is a device op, as the table calls' own
                bad = (req_ids != L.NULL_PAGE) & ((req_ids < 0) | (req_ids >= self.max_requests))
                self.pool.state.counters.narrow(0, L.ERR_BAD_REQUEST, 1).add_(bad.sum())
            memos = self._shapes.memo_list()  # every memo alive, kept by the table, a BoundStep or a StepOut
            self.ops.restamp_rows(req_ids, memos)
            if req_ids is None:
                for memo in memos:
                    memo.invalidate()

    # ---------------------------------------------------------- sync points
    def check_invariants(self, *, exclusive: bool = True) -> None:
        """Verify the table against the pool (a sync point, for tests and debugging).

        Entries past each length are -1, entries before it are USED pages, each
        page's reference count is at least (``exclusive``: exactly) the number of
        table entries naming it, and a request's partial last page is named by no
        other entry. A step's CSR buffers that the next step of the same
        batch would grow in place (numba) still hold that batch's CSR, and every run a
        step of another batch would keep (its row still has the stamp the memo noted) is
        still that row's pages.

        Parameters
        ----------
        exclusive : bool
            The table holds every reference (no other owner of pages): counts must match exactly.

        Raises
        ------
        InvariantViolation
        ValueError
            ``exclusive`` not a bool (``"no"`` would read as True, None as False).
        """
        exclusive = _checks.flag(exclusive, "exclusive")
        with self.pool.state.lock:  # the state between two calls, never inside one (reference, triton)
            table_checks.check_table(self, exclusive)

    def kept_shapes(self) -> tuple:
        """The call shapes whose output buffers the table keeps now, least recently used first, and how
        many buffer sets they use: ``(keys, n_buffer_sets)``; a key is ``(op, B, ...)``."""
        return tuple(self._shapes.entries), len(self._shapes.buffers)

    def memory_bytes(self) -> dict:
        """Bytes held by the table's own tensors (for :func:`tpool.memory_report`).

        Read from the tensors' metadata (``untyped_storage().nbytes()``), with no
        device read. Each storage counts once, under the first key that holds it
        (in the order below); memory two storage objects share counts once in
        ``total_bytes``. The pool's state is the pool's (``PagePool.memory_bytes``),
        and a :class:`~tpool.table_results.StepOut` or
        :class:`~tpool.bound_step.BoundStep` holds buffers of its own, not counted here.

        Returns
        -------
        dict
            ``{"name": repr(self), "block_table_bytes": int, "seq_lens_bytes": int,
            "other_state_bytes": int, "buffer_bytes": int, "csr_memo_bytes": int,
            "kept_shapes": int, "total_bytes": int}``: the block table; the lengths;
            the rest of the table's state (``claim``, ``lane_end``, ``version``,
            ``row_version``); the output buffers of every call shape kept now
            (:meth:`kept_shapes`), their CSR memos apart in ``csr_memo_bytes``; the
            number of shapes kept; and the total, every byte counted once.
        """
        from tpool.memory.accounting import retained_bytes, storage_key  # (not at import: start-up cost)

        with self._shapes.lock:  # (what changes the kept shapes holds it: see tpool.buffers)
            entries = list(self._shapes.entries.values())
            bufs = [t for b in list(self._shapes.buffers.values()) for t in _tensors(b)]
        state = self.state.tensors()
        groups = {"block_table_bytes": [state.pop("block_table")], "seq_lens_bytes": [state.pop("seq_lens")],
                  "other_state_bytes": list(state.values()),
                  "csr_memo_bytes": [e[2].tensor for e in entries if e[2] is not None],
                  "buffer_bytes": bufs}
        seen: dict = {}
        out = {"name": repr(self)}
        for key, tensors in groups.items():  # each storage under the first key that holds it
            fresh = {}
            for t in tensors:
                sk = storage_key(t)
                if sk not in seen:
                    seen[sk] = fresh[sk] = t
            out[key] = retained_bytes(list(fresh.values()))
        out = {k: out[k] for k in ("name", "block_table_bytes", "seq_lens_bytes", "other_state_bytes",
                                   "buffer_bytes", "csr_memo_bytes")}
        out["kept_shapes"] = len(entries)
        out["total_bytes"] = retained_bytes(list(seen.values()))
        return out

    def pin_shapes(self) -> None:
        """Keep the buffers of every call shape made so far for the table's lifetime.

        Shapes used inside CUDA graph capture are pinned when the call is made;
        :func:`tpool.graphs.capture` also pins every shape after capturing. Call this after
        capturing a graph by other means if any shape the graph uses ran only before capture.
        """
        self._shapes.pin_all()
