"""The backend contract: every operation a backend runs, and its bound form.

Note: the façade (``PagePool``, ``PageTable``) checks every input from
tensor metadata, owns every output buffer, and then calls one of these
methods; a backend never allocates on the hot path, and validates only what
the façade leaves to it (numba's hot calls check in compiled code that an
input shares no memory with what they write: ``checks_overlap``).
All tensors are on the pool's device; ids and counts are int32 ``[B]``
vectors, contiguous, with -1 as padding.

An operation whose outputs are buffers owned by the façade also has a
*bound form* ``<op>_into(outputs)``: the backend takes the buffers once and
returns a call that writes them (numba packs their addresses into a
descriptor at that point, so a call passes one array instead of many). A
*bound step* (``bind_step``) also takes the step's input tensors, as
``PageTable.bind_step`` does at the façade: its call takes no argument.
"""

import functools
from typing import Callable, Protocol

import torch

from tpool.kernels import layout as L
from tpool.state import PoolState, TableState, held_view

Tensor = torch.Tensor


def locked(op):
    """Run the backend method ``op`` holding its pool's ``state.lock``: a call on a pool or its
    tables is atomic with respect to other threads (reference and triton; numba holds the GIL)."""
    @functools.wraps(op)
    def call(self, *args):
        with self.st.lock:
            return op(self, *args)
    return call


class PoolOps(Protocol):
    """The pool's operations (rules: :mod:`tpool.backends.reference`)."""

    name: str
    checks_overlap: bool  # its hot calls refuse (ValueError) an input sharing memory with what they write
    st: PoolState  # the state it runs on: held views (PoolState.held), what a re-pointed tensor leaves alone

    def alloc_into(self, out) -> Callable[[Tensor, int, bool], None]:
        """``alloc`` bound to an ``AllocOut``'s buffers; the call takes ``(counts, B, evict)``."""

    def bind_alloc(self, out, counts: Tensor, b: int, evict: bool) -> Callable[[], None]:
        """``alloc_into(out)`` bound to its input too (``PagePool.bind_alloc``): the call takes nothing."""

    def alloc_once(self, result, counts: Tensor, b: int, evict: bool) -> None:
        """``alloc`` into an ``AllocResult`` made for this one call (``PagePool.alloc`` without ``out=``):
        fresh tensors that share memory with nothing (pages and evicted int32 ``[max_alloc_pages]``,
        indptr int32 ``[b + 1]``, ok bool ``[b]``), uninitialised: the call writes every entry."""

    def free(self, pages: Tensor, cache: bool) -> None:
        """Drop one reference per entry; pages reaching 0 become FREE (CACHED with ``cache``)."""

    def bind_free(self, pages: Tensor, cache: bool) -> Callable[[], None]:
        """``free`` bound to its input (``PagePool.bind_free``): the call takes nothing."""

    def incref(self, pages: Tensor) -> None:
        """Add one reference per entry; a CACHED page is revived."""

    def touch(self, pages: Tensor) -> None:
        """Stamp USED or CACHED pages with the clock."""

    def evict(self, out: Tensor) -> None:
        """Free up to ``out.numel()`` CACHED pages, oldest first, and write them to ``out``."""


class TableOps(Protocol):
    """A page table's operations (rules: :mod:`tpool.backends.reference_table`)."""

    name: str
    checks_overlap: bool  # extend_into, flashinfer_csr_into and step_into refuse overlapping inputs
    st: PoolState  # its pool's state and its own, as held views (PoolState.held, TableState.held): what
    ts: TableState  # a caller reading the table beside its kernels (the prefix cache) reads

    def extend(self, req_ids: Tensor, num_tokens: Tensor, slots: Tensor, ok: Tensor) -> None:
        """Append tokens, taking pages as lanes cross page boundaries; write ``slots`` and ``ok``."""

    def extend_into(self, res) -> Callable[[Tensor, Tensor, int], None]:
        """``extend`` bound to an ``ExtendResult``'s buffers; the call takes ``(req_ids, num_tokens, B)``."""

    def flashinfer_csr(self, req_ids: Tensor, indptr: Tensor, indices: Tensor, last_page_len: Tensor) -> None:
        """The batch's FlashInfer CSR into any buffers (``indices`` re-padded whole)."""

    def flashinfer_csr_into(self, csr, memo) -> Callable[[Tensor, int], None]:
        """The CSR export bound to a ``PagedKVCSR``'s buffers and their ``CsrMemo``; the call takes
        ``(req_ids, B)`` and re-pads ``indices`` only as far as the previous export wrote."""

    def step_into(self, res, memo) -> Callable[..., None]:
        """``extend`` (with the attention metadata) then the CSR export, bound to a ``StepResult``'s
        buffers; the call takes ``(req_ids, num_tokens, B)``, and ``release=`` (int32 ``[K]``) and
        ``cache=`` to ``release`` those requests first, in the same call."""

    def bind_step(self, res, memo, req_ids: Tensor, num_tokens: Tensor, b: int, release: Tensor | None = None,
                  cache: bool = False) -> Callable[[], None]:
        """``step_into(res, memo)`` bound to its input tensors too: the call takes nothing. With
        ``release`` (int32 ``[K]``), each call releases those requests first (``cache`` as in
        ``release``) and then sets every entry of ``release`` to -1, in the same call."""

    def release(self, req_ids: Tensor, cache: bool) -> None:
        """Drop every page reference of these requests and reset their rows."""

    def truncate(self, req_ids: Tensor, new_lens: Tensor, drop: bool = False) -> None:
        """Roll requests back to ``new_lens`` tokens (with ``drop``: by ``new_lens`` tokens, from the
        length each has as the call starts), freeing the pages past them."""

    def fork(self, src_ids: Tensor, dst_ids: Tensor, lens: Tensor, ok: Tensor, cow_src: Tensor,
             cow_dst: Tensor) -> None:
        """Let empty ``dst`` share the first ``lens`` tokens of ``src``; write the copy-on-write pairs."""

    def revive(self, row: int, pages: Tensor, memos=(), gens: Tensor | None = None) -> None:
        """Empty row ``row`` takes ``pages`` (int32 ``[k]``, a prefix-cache hit) and ``k * page_size``
        tokens, all or none, one reference each (with ``gens``, int32 ``[k]``: only if every page still
        has the generation recorded there, else each stale entry is a ``use_after_free``); then, as
        ``restamp_rows`` of that row (numba), the CSR ``memos`` forget it and it gets a fresh stamp. One call (numba:
        one kernel call besides the memos'; triton: one launch)."""

    def block_table_rows(self, req_ids: Tensor, out: Tensor) -> None:
        """vLLM-style rows of the batch into ``out`` (int32 ``[B, max_pages]``)."""

    def restamp_rows(self, req_ids: Tensor | None = None, memos=()) -> None:
        """After rows were written by hand: fresh row stamps (of every row, or of the rows
        ``req_ids`` names, which the CSR ``memos`` then forget) and a fresh table version, so
        no step keeps or grows a run noted before the edit, nor one noted after it once a
        snapshot from before it is restored (numba; the other backends keep no run)."""


class PoolByFunctions:
    """The pool operations of a backend made of functions of the state (reference, triton):
    ``alloc(st, counts, pages, indptr, ok, evicted, evict)``, ``free(st, pages, cache)``,
    ``incref(st, pages)``, ``touch(st, pages)``, ``evict(st, out)``."""

    checks_overlap = False  # the façade checks that inputs share no memory with what a call writes

    def __init__(self, st, alloc, free, incref, touch, evict):
        self.st = st
        self._alloc, self._free, self._incref, self._touch, self._evict = alloc, free, incref, touch, evict

    def alloc_into(self, out):
        alloc, st = self._alloc, self.st
        pages, indptr, ok, evicted = map(held_view, (out.pages, out.indptr, out.ok, out.evicted))

        def run(counts, b, evict):
            with st.lock:
                alloc(st, counts, pages, indptr, ok, evicted, evict)
        return run

    def bind_alloc(self, out, counts, b, evict):
        run = self.alloc_into(out)
        return lambda: run(counts, b, evict)

    @locked
    def alloc_once(self, result, counts, b, evict):
        self._alloc(self.st, counts, *result, evict)

    @locked
    def free(self, pages, cache):
        self._free(self.st, pages, cache)

    def bind_free(self, pages, cache):
        return lambda: self.free(pages, cache)

    @locked
    def incref(self, pages):
        self._incref(self.st, pages)

    @locked
    def touch(self, pages):
        self._touch(self.st, pages)

    @locked
    def evict(self, out):
        self._evict(self.st, out)


class BoundByTensors:
    """The bound forms of a table backend whose unbound ops take the output tensors themselves
    (reference, triton): each bound call closes over the buffers and calls the unbound op.
    Their unbound ops are ``@locked``; their ``extend`` also takes ``meta``, a step's
    ``(positions, qo_indptr, kv_lens)`` to write in the same pass, and their ``flashinfer_csr``
    two last arguments: ``count``, False in a step's export, whose extend already counted the
    bad ids and corrupt lengths, and ``kv_lens``, the step's, zeroed where a request is exported
    empty for a page id outside the pool."""

    checks_overlap = False  # the façade checks that inputs share no memory with what a call writes

    def restamp_rows(self, req_ids=None, memos=()):  # these backends rebuild the CSR every step: no run is kept
        pass

    def extend_into(self, res):
        extend, slots, ok = self.extend, held_view(res.slots), held_view(res.ok)
        return lambda req_ids, num_tokens, b: extend(req_ids, num_tokens, slots, ok)

    def flashinfer_csr_into(self, csr, memo):
        export, lock = self._csr_call(csr, memo), self.st.lock

        def run(req_ids, b):
            with lock:
                export(req_ids)
        return run

    def _csr_call(self, csr, memo, count=True, kv_lens=None):
        """The export into ``csr``; ``memo`` (how far it wrote) is bookkeeping a full re-pad does without.
        ``count``, ``kv_lens``: ``flashinfer_csr``'s last arguments."""
        export, csr, kv_lens = self.flashinfer_csr, tuple(map(held_view, csr)), held_view(kv_lens)
        return lambda req_ids: export(req_ids, *csr, count, kv_lens)

    def step_into(self, res, memo):
        # count False: the step's extend counted its bad ids and corrupt lengths, once per lane;
        # kv_lens: 0 for a lane exported empty for a page id outside the pool
        export = self._csr_call(res.csr, memo, False, res.metadata[2])
        extend, lock, release_ = self.extend, self.st.lock, self.release
        slots, ok, meta = held_view(res.slots), held_view(res.ok), tuple(map(held_view, res.metadata))

        def step(req_ids, num_tokens, b, release=None, cache=False):
            with lock:  # one call: no other thread's change between the release, the extend and the export
                if release is not None:
                    release_(release, cache)
                extend(req_ids, num_tokens, slots, ok, meta)
                export(req_ids)
        return step

    def bind_step(self, res, memo, req_ids, num_tokens, b, release=None, cache=False):
        step, lock = self.step_into(res, memo), self.st.lock
        if release is None:
            return lambda: step(req_ids, num_tokens, b)

        def in_inference_mode(value, fill=release.fill_):
            with torch.inference_mode():
                fill(value)

        # A release made under torch.inference_mode(): torch refuses its in-place update outside that mode, and
        # would raise after the release and the step had run (numba writes the memory as it is).
        reset = in_inference_mode if release.is_inference() else release.fill_

        def run():
            with lock:  # re-entrant: the release, its reset and the step are one call
                step(req_ids, num_tokens, b, release, cache)
                reset(L.NULL_PAGE)
        return run
