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
exact rules are in :mod:`tpool.reference_table`.
"""

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from tpool import _checks
from tpool.backends import make_table_backend
from tpool.errors import InvariantViolation
from tpool.kernels import layout as L
from tpool.state import INT32_MAX

_Tensor, _int32 = torch.Tensor, torch.int32
_UNIT_STRIDE = (1,)  # see tpool.pool: 1-D and contiguous in one metadata call


@dataclass(frozen=True)
class TableState:
    """Tensors of one table, on the pool's device."""

    max_requests: int
    max_pages: int
    page_size: int
    block_table: torch.Tensor  # int32 [max_requests, max_pages], -1 past each length
    seq_lens: torch.Tensor     # int32 [max_requests], tokens per request
    claim: torch.Tensor        # int32 [max_requests] scratch, INT32_MAX between calls
    lane_end: torch.Tensor     # int32 [max_batch] scratch (triton): per-lane ends of a call's page list
    version: torch.Tensor      # int64 [1] (numba): which contents the table has; a step's CSR memo names it


class ExtendResult(NamedTuple):
    """slots : int32 ``[max_tokens]``: slot of every new token in lane order, -1 for padding,
    failures and unused capacity (vLLM's ``slot_mapping``). ok : bool ``[B]``."""

    slots: torch.Tensor
    ok: torch.Tensor


class ForkResult(NamedTuple):
    """ok : bool ``[B]``; cow_src, cow_dst : int32 ``[B]``: for a fork that ends inside a
    page, copy the KV of page ``cow_src[i]`` into the fresh page ``cow_dst[i]`` (-1 otherwise)."""

    ok: torch.Tensor
    cow_src: torch.Tensor
    cow_dst: torch.Tensor


class PagedKVCSR(NamedTuple):
    """FlashInfer's paged-KV layout for a batch: ``indptr`` int32 ``[B+1]``, ``indices`` int32
    ``[capacity]`` (pages in request order, -1 past ``indptr[B]``), ``last_page_len`` int32 ``[B]``."""

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor


class StepResult(NamedTuple):
    """One scheduler step (:meth:`PageTable.step`): ``slots`` int32 ``[max_tokens]`` and ``ok``
    bool ``[B]`` as in :class:`ExtendResult`, and ``csr``, the batch's :class:`PagedKVCSR`
    after the extend."""

    slots: torch.Tensor
    ok: torch.Tensor
    csr: PagedKVCSR


class StaleBinding(ValueError):
    """A bound step's input tensors no longer have the memory or length they were bound with."""


class BoundStep(functools.partial):
    """``PageTable.step`` bound to fixed input tensors (see :meth:`PageTable.bind_step`).

    Calling it checks that ``req_ids`` and ``num_tokens`` keep the memory and length they
    were bound with (``StaleBinding``, a ValueError, if not) and runs the step; it returns
    ``result``, the table-owned ``StepResult`` of this shape. The call is a closure over
    local values behind ``functools.partial``'s C call: a decode step is ~3 us on a CPU,
    and a Python method with attribute lookups would add a tenth to it.
    """

    def __new__(cls, table, req_ids, num_tokens, max_tokens, capacity):
        b, (result, _, memo) = table._step_shape(req_ids, num_tokens, max_tokens, capacity)
        run = table._impl.bind_step_inputs(result, memo, req_ids, num_tokens, b)
        ids_at, ntok_at, ids_len, ntok_len = req_ids.data_ptr, num_tokens.data_ptr, req_ids.numel, num_tokens.numel
        at_ids, at_ntok = ids_at(), ntok_at()

        def step():
            if ids_at() != at_ids or ntok_at() != at_ntok or ids_len() != b or ntok_len() != b:
                raise StaleBinding("bind_step: req_ids or num_tokens no longer have the memory or the length they "
                                   "were bound with (reassigned or resized); fill them in place, or bind again")
            run()
            return result

        self = super().__new__(cls, step)
        # The compiled step holds raw addresses of the table's and pool's tensors: keep them alive.
        self.result, self.req_ids, self.num_tokens, self.table = result, req_ids, num_tokens, table
        return self

    def __repr__(self):
        return f"BoundStep(batch={self.result.ok.numel()}, max_tokens={self.result.slots.numel()})"


class PageTable:
    """Page maps for up to ``max_requests`` requests of ``max_pages_per_request`` pages each.

    Parameters
    ----------
    pool : PagePool
        Where pages come from; the table uses the pool's device and backend.
    max_requests : int
        Rows of ``block_table``; request ids are ``0 .. max_requests - 1``.
    max_pages_per_request : int
        Columns of ``block_table``.

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

    def __init__(self, pool, max_requests: int, max_pages_per_request: int):
        for name, v in (("max_requests", max_requests), ("max_pages_per_request", max_pages_per_request)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        if pool.num_pages * pool.page_size > INT32_MAX:
            raise ValueError(f"pool: slots are int32, so num_pages * page_size must be at most {INT32_MAX}, "
                             f"got {pool.num_pages} * {pool.page_size}")
        self.pool, self.device = pool, pool.device
        self.max_requests, self.max_pages, self.page_size = max_requests, max_pages_per_request, pool.page_size
        i32 = dict(dtype=torch.int32, device=self.device)
        self.state = TableState(
            max_requests=max_requests, max_pages=max_pages_per_request, page_size=pool.page_size,
            block_table=torch.full((max_requests, max_pages_per_request), L.NULL_PAGE, **i32),
            seq_lens=torch.zeros(max_requests, **i32),
            claim=torch.full((max_requests,), INT32_MAX, **i32),
            lane_end=torch.zeros(max(pool.max_batch, 1), **i32),
            version=torch.zeros(1, dtype=torch.int64, device=self.device),
        )
        self.block_table, self.seq_lens = self.state.block_table, self.state.seq_lens
        self._impl = make_table_backend(pool.backend, pool.state, self.state)
        self._bufs = {}   # (op, shape) -> output buffers
        self._bound = {}  # (op, shape) -> (output buffers, backend call bound to them[, CSR memo])
        self._repeat = (None,) * 5  # the last step's (req_ids, num_tokens, max_tokens, capacity, BoundStep or None)

    def __reduce_ex__(self, protocol):
        raise TypeError("a PageTable cannot be copied or pickled: its kernels are bound to the addresses of "
                        "its state and output tensors; make a new PageTable")

    def __repr__(self):
        return (f"PageTable(max_requests={self.max_requests}, max_pages_per_request={self.max_pages}, "
                f"page_size={self.page_size}, pool={self.pool!r})")

    def _ids(self, t, name="req_ids"):
        """Length of a request-id vector; the common case is one inline condition."""
        if self.pool._pages_ok(t):
            n = t.numel()
            if n <= self.pool.max_batch:
                return n
        return _checks.check_vector(t, name, torch.int32, self.device, self.pool.max_batch)

    def _lane_vector(self, t, name, b):
        if not (self.pool._pages_ok(t) and t.numel() == b):
            n = _checks.check_vector(t, name, torch.int32, self.device, self.pool.max_batch)
            if n != b:
                raise ValueError(f"{name}: expected {b} entries (one per request id), got {n}")

    def _lanes(self, req_ids, num_tokens) -> int:
        """Batch size of an (ids, per-lane int32) pair, both checked; the valid case is inline."""
        if (type(req_ids) is _Tensor and type(num_tokens) is _Tensor and req_ids.dtype is _int32
                and num_tokens.dtype is _int32 and req_ids.device == self.device and num_tokens.device == self.device
                and req_ids.stride() == _UNIT_STRIDE and num_tokens.stride() == _UNIT_STRIDE
                and (b := req_ids.numel()) == num_tokens.numel()
                and b <= self.pool.max_batch):
            return b  # the common case: this runs every decode step
        b = self._ids(req_ids)
        self._lane_vector(num_tokens, "num_tokens", b)
        return b

    def _extend_out(self, b, t):
        t = _checks.check_size(t, "max_tokens")
        return (torch.full((t,), L.NULL_PAGE, dtype=torch.int32, device=self.device),
                torch.zeros(b, dtype=torch.bool, device=self.device))

    def _csr_out(self, b, cap):
        """CSR buffers of one shape and their memo, int64 ``[L.memo_len(b)]`` on the device:
        ``memo[0]`` is how far the last export into them wrote ``indices``, so the next
        export re-pads only that far; the numba step keeps there which batch and table
        version the buffers hold, to grow the CSR in place (see ``tpool.kernels.step``)."""
        cap = _checks.check_size(cap, "capacity")
        memo = torch.full((L.memo_len(b),), -1, dtype=torch.int64, device=self.device)
        memo[L.MEMO_WRITTEN] = cap
        return (PagedKVCSR(torch.zeros(b + 1, dtype=torch.int32, device=self.device),
                           torch.full((cap,), L.NULL_PAGE, dtype=torch.int32, device=self.device),
                           torch.zeros(b, dtype=torch.int32, device=self.device)),
                memo)

    def _buffers(self, key, make):
        bufs = self._bufs.get(key)
        if bufs is None:
            self._not_capturing(key)
            bufs = self._bufs[key] = make()
        return bufs

    def _not_capturing(self, key):
        """New output buffers (and their bookkeeping) must be made and filled outside graph capture."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"PageTable: the first call of shape {key} is inside CUDA graph capture; run each "
                               "call shape once before capturing (tpool.graphs.capture does that)")

    # ------------------------------------------------------------ hot path
    def extend(self, req_ids: torch.Tensor, num_tokens: torch.Tensor, *, max_tokens: int | None = None) -> ExtendResult:
        """Append ``num_tokens[i]`` tokens to request ``req_ids[i]``; allocate pages as needed.

        A request that crosses page boundaries takes its new pages from the pool
        in the same pass, first come first served over the lanes; one that cannot
        get them (or would exceed ``max_pages_per_request``) is left unchanged and
        reported in ``ok``.

        Parameters
        ----------
        req_ids : torch.Tensor  shape ``[B]``, int32, on the table's device; -1 = padding.
        num_tokens : torch.Tensor  shape ``[B]``, int32, on the table's device.
        max_tokens : int, optional
            Length of ``slots`` (the batch's token budget, known to the scheduler);
            default ``B`` (one token per request: a decode step).

        Returns
        -------
        ExtendResult ``(slots, ok)`` in table-owned buffers (overwritten by the next
        call of the same shape).
        """
        b = self._lanes(req_ids, num_tokens)
        t = b if max_tokens is None else max_tokens
        bound = self._bound.get(("extend", b, t))
        if bound is None:
            res = self._buffers(("extend", b, t), lambda: ExtendResult(*self._extend_out(b, t)))
            bound = self._bound[("extend", b, t)] = (res, self._impl.bind_extend(res))
        bound[1](req_ids, num_tokens, b)
        return bound[0]

    def step(self, req_ids: torch.Tensor, num_tokens: torch.Tensor, *, max_tokens: int | None = None,
             capacity: int | None = None) -> StepResult:
        """One scheduler step: :meth:`extend`, then :meth:`flashinfer_csr` of the same batch.

        Same results as the two calls one after the other (the CSR includes the pages
        the extend just added), in one call: on numba one kernel call, on triton one
        launch. A decode step is ``table.step(ids, ones)``.

        Parameters
        ----------
        req_ids, num_tokens, max_tokens : as in :meth:`extend`.
        capacity : int, optional
            Length of ``csr.indices``, as in :meth:`flashinfer_csr`.

        Returns
        -------
        StepResult ``(slots, ok, csr)`` in table-owned buffers: ``slots``/``ok`` are
        shared by steps of the same ``(B, max_tokens)``, ``csr`` by steps of the same
        ``(B, capacity)``; the next such step overwrites them.

        Note: a decode loop that passes the same two tensor objects every step (filled
        in place) gets :meth:`bind_step`'s speed without asking: from the second such
        step on, the table keeps them bound and a step only checks that they still
        have their memory and length, as a bound step does (``max_tokens`` and
        ``capacity`` must be the same objects too, as a constant or None is). What
        goes unnoticed is a tensor reinterpreted in place over the same memory
        (``t.data = t.view(dtype)``, ``as_strided_``): on numba the kernel then reads
        the same bits as int32 and range-checks them as ids, never out of bounds. The
        table holds a reference to the last step's inputs.
        """
        last = self._repeat
        if req_ids is last[0] and num_tokens is last[1] and max_tokens is last[2] and capacity is last[3]:
            run = last[4]
            if run is None:  # the second step in a row on these tensors: bind them (checked once, there)
                run = BoundStep(self, req_ids, num_tokens, max_tokens, capacity)
                self._repeat = (req_ids, num_tokens, max_tokens, capacity, run)
            try:
                return run()
            except StaleBinding:  # reassigned or resized since: check them as new inputs
                pass
        b, bound = self._step_shape(req_ids, num_tokens, max_tokens, capacity)
        self._repeat = (req_ids, num_tokens, max_tokens, capacity, None)
        bound[1](req_ids, num_tokens, b)
        return bound[0]

    def _step_shape(self, req_ids, num_tokens, max_tokens, capacity):
        """``(B, (buffers, bound call, CSR memo))`` of a step: slots/ok per (B, max_tokens) and
        the CSR per (B, capacity), shared by the steps of that shape."""
        b = self._lanes(req_ids, num_tokens)
        t = b if max_tokens is None else max_tokens
        cap = b * self.max_pages if capacity is None else capacity
        bound = self._bound.get(("step", b, t, cap))
        if bound is None:
            csr, memo = self._buffers(("step-csr", b, cap), lambda: self._csr_out(b, cap))
            res = StepResult(*self._buffers(("step", b, t), lambda: self._extend_out(b, t)), csr)
            bound = self._bound[("step", b, t, cap)] = (res, self._impl.bind_step(res, memo), memo)
        return b, bound

    def bind_step(self, req_ids: torch.Tensor, num_tokens: torch.Tensor, *, max_tokens: int | None = None,
                  capacity: int | None = None) -> "BoundStep":
        """:meth:`step` on fixed input tensors, checked once; call the result every step.

        For a decode loop that keeps its inputs in persistent tensors and fills them in
        place each step (as a CUDA graph's static inputs). ``run = table.bind_step(ids,
        ntok)`` checks dtype, device and shape here; ``run()`` then only checks that the
        two tensors still have the same memory and length (``StaleBinding``, a
        ``ValueError``, if not) and runs the step: on numba that saves the per-call argument checks (~1 us per step on a
        CPU). It returns the same table-owned buffers as ``step`` for this shape.
        """
        return BoundStep(self, req_ids, num_tokens, max_tokens, capacity)

    def release(self, req_ids: torch.Tensor, *, cache: bool = False) -> None:
        """Drop every page reference of these requests and reset their rows.

        Pages shared with other requests survive while others hold them; with
        ``cache=True`` pages whose last reference goes become CACHED (a prefix cache
        keeps them), else FREE.

        req_ids : torch.Tensor  shape ``[B]``, int32, on the table's device; -1 = padding.
        """
        self._ids(req_ids)
        self._impl.release(req_ids, cache)

    def truncate(self, req_ids: torch.Tensor, new_lens: torch.Tensor) -> None:
        """Roll requests back to ``new_lens[i]`` tokens (rejected speculative tokens).

        Pages past the new length are freed. A new length above the current one
        (or below 0) is a ``bad_length`` error and leaves that request unchanged.

        req_ids, new_lens : torch.Tensor  shape ``[B]``, int32, on the table's device.
        """
        b = self._ids(req_ids)
        self._lane_vector(new_lens, "new_lens", b)
        self._impl.truncate(req_ids, new_lens)

    def fork(self, src_ids: torch.Tensor, dst_ids: torch.Tensor, lens: torch.Tensor) -> ForkResult:
        """Let empty request ``dst_ids[i]`` share the first ``lens[i]`` tokens of ``src_ids[i]``.

        Whole pages are shared (reference counts go up). If ``lens[i]`` ends inside a
        page, ``dst`` gets a fresh page for it and the pair is returned so the caller
        copies the KV data (copy-on-write). Padding: ``dst_ids[i] == -1``.

        src_ids, dst_ids, lens : torch.Tensor  shape ``[B]``, int32, on the table's device.
        """
        b = self._ids(dst_ids, "dst_ids")
        self._lane_vector(src_ids, "src_ids", b)
        self._lane_vector(lens, "lens", b)
        res = self._buffers(("fork", b), lambda: ForkResult(
            torch.zeros(b, dtype=torch.bool, device=self.device),
            torch.full((b,), L.NULL_PAGE, dtype=torch.int32, device=self.device),
            torch.full((b,), L.NULL_PAGE, dtype=torch.int32, device=self.device)))
        self._impl.fork(src_ids, dst_ids, lens, res.ok, res.cow_src, res.cow_dst)
        return res

    # -------------------------------------------------------------- layouts
    def flashinfer_csr(self, req_ids: torch.Tensor, *, capacity: int | None = None) -> PagedKVCSR:
        """FlashInfer's paged-KV CSR for the batch ``req_ids`` (see the README's layouts).

        ``indptr[i+1] - indptr[i] = ceil(seq_len / page_size)``;
        ``last_page_len = seq_len - (num_pages - 1) * page_size``, in ``[1, page_size]``;
        an empty or padding request has no pages and ``last_page_len = page_size``, so
        ``(num_pages - 1) * page_size + last_page_len = 0`` still gives its length.
        ``capacity`` (default ``B * max_pages_per_request``, always enough) sizes ``indices``.
        """
        b = self._ids(req_ids)
        cap = b * self.max_pages if capacity is None else capacity
        bound = self._bound.get(("csr", b, cap))
        if bound is None:
            csr, memo = self._buffers(("csr", b, cap), lambda: self._csr_out(b, cap))
            bound = self._bound[("csr", b, cap)] = (csr, self._impl.bind_csr(csr, memo))
        bound[1](req_ids, b)
        return bound[0]

    def block_table_rows(self, req_ids: torch.Tensor) -> torch.Tensor:
        """vLLM-style block table for the batch: int32 ``[B, max_pages_per_request]``, -1 padded."""
        b = self._ids(req_ids)
        out = self._buffers(("rows", b), lambda: torch.full(
            (b, self.max_pages), L.NULL_PAGE, dtype=torch.int32, device=self.device))
        self._impl.rows(req_ids, out)
        return out

    def invalidate_csr(self) -> None:
        """Make the next step of every shape rebuild its CSR instead of growing the last one.

        Only needed after writing ``block_table`` or ``seq_lens`` by hand: tpool's own calls,
        and restoring a whole snapshot of the table's state (``tpool.graphs.state_tensors``,
        ``version`` included), are tracked by the table's version. Not a hot-path call.
        """
        for key, bufs in self._bufs.items():
            if key[0] == "step-csr":
                bufs[1][L.MEMO_VERSION] = -1

    # ---------------------------------------------------------- sync points
    def check_invariants(self, *, exclusive: bool = True) -> None:
        """Verify the table against the pool (a sync point, for tests and debugging).

        Entries past each length are -1, entries before it are USED pages, and each
        page's reference count is at least (``exclusive``: exactly) the number of
        table entries naming it. A step's CSR buffers that the next step of the same
        batch would grow in place (numba) still hold that batch's CSR.
        """
        self.pool.check_invariants()
        bt, lens = self.block_table.cpu().long(), self.seq_lens.cpu().long()
        npages = (lens + self.page_size - 1) // self.page_size
        col = torch.arange(self.max_pages)
        inside = col[None, :] < npages[:, None]
        if not bool((lens >= 0).all()) or not bool((npages <= self.max_pages).all()):
            raise InvariantViolation("invariant broken: seq_lens within [0, max_pages * page_size]")
        if not bool((bt[~inside] == L.NULL_PAGE).all()):
            raise InvariantViolation("invariant broken: entries past a request's length are -1")
        pages = bt[inside]
        if not bool(((pages >= 0) & (pages < self.pool.num_pages)).all()):
            raise InvariantViolation("invariant broken: entries within a request's length are page ids")
        held = torch.zeros(self.pool.num_pages, dtype=torch.long).scatter_add_(0, pages, torch.ones_like(pages))
        rc = self.pool.state.refcount.cpu().long()
        if not bool((rc >= held).all() if not exclusive else (rc == held).all()):
            raise InvariantViolation("invariant broken: reference counts match table entries")
        # A step's CSR that the next step of its batch may grow in place (its memo names the
        # table's current version, numba only) must still be that batch's CSR.
        version = int(self.state.version[0])
        for key, (csr, memo) in ((k, v) for k, v in self._bufs.items() if k[0] == "step-csr"):
            b = key[1]
            if int(memo[L.MEMO_VERSION]) != version:
                continue
            rows = [bt[r, :int(npages[r])].tolist() for r in memo[L.MEMO_IDS:L.MEMO_IDS + b].tolist() if r >= 0]
            want = [p for row in rows for p in row]
            if csr.indices[:len(want)].tolist() != want:
                raise InvariantViolation(f"invariant broken: the CSR of step shape {key[1:]} is its batch's CSR (the "
                                         "next step grows it in place: were its indices written to, or the table's "
                                         "state edited by hand without invalidate_csr()?)")
