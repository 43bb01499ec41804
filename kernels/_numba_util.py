"""Helpers for the numba twins: arrays over raw addresses, and the passes kernels share.

Note: the numba kernels take per-call tensors as (address, length) pairs, so
a call costs a ``data_ptr()`` instead of a ``.numpy()``. The façade checks
dtype, device and contiguity before it passes an address. The state of a pool
(and of a table) reaches the kernels as one int64 descriptor of addresses
(slots ``SD_*``, ``TD_*``, ``CD_*`` in :mod:`layout`), built once by
``tpool.backends.numba``, because numba checks every array argument on each
call. Helpers named like a Triton helper (``count_pages``, ``apply_free``,
``raise_peaks``, ``claim_requests``, ``reset_requests``) do the same thing on
the same data; kernel modules call these as ``nu.<name>``.
"""

import numba
import numpy as np
import llvmlite.ir as llvm_ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import layout as L
from .layout import (INT32_MAX, SD_COUNTERS, SD_FREE_STACK, SD_KEYS, SD_LRU_POS, SD_LRU_QUEUE, SD_OCCUR,
                     SD_PAGE_GEN, SD_PAGE_STATE, SD_PAGES, SD_REFCOUNT, SD_STAMP, TD_BLOCK_TABLE, TD_CLAIM,
                     TD_MAX_PAGES, TD_PAGE_SIZE, TD_REQUESTS, TD_ROW_VERSION, TD_SEQ_LENS, TD_VERSION,
                     TD_VERSION_SOURCE)

TAIL_BLOCK = 64  # ids per block when a free drops its trailing padding (``padded_tail_start``)


def _pointer_intrinsic(elem):
    ptr_type = types.CPointer(elem)

    @intrinsic
    def as_pointer(typingctx, addr):
        sig = ptr_type(types.int64)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(ptr_type))

        return sig, codegen

    return as_pointer


_i32_ptr = _pointer_intrinsic(types.int32)
_u8_ptr = _pointer_intrinsic(types.uint8)
_i8_ptr = _pointer_intrinsic(types.int8)
_i64_ptr = _pointer_intrinsic(types.int64)

def _int32_copy(raw_copy):
    """An intrinsic ``f(dst_addr, src_addr, n)`` copying ``n`` int32 with ``raw_copy``
    (``cgutils.raw_memcpy`` or ``raw_memmove``): one libc call."""

    @intrinsic
    def copy(typingctx, dst_addr, src_addr, n):
        sig = types.void(types.int64, types.int64, types.int64)

        def codegen(context, builder, signature, args):
            dst, src, count = args
            byte_ptr = llvm_ir.IntType(8).as_pointer()
            nbytes = builder.mul(count, llvm_ir.Constant(llvm_ir.IntType(64), 4))
            raw_copy(builder, builder.inttoptr(dst, byte_ptr), builder.inttoptr(src, byte_ptr), nbytes, 1)
            return context.get_dummy_value()

        return sig, codegen

    return copy


# memcpy of ``n`` int32 from address ``src_addr`` to ``dst_addr`` (non-overlapping).
# A copy between two arrays numba cannot prove apart: one libc call per block_table row
# (the CSR export copies its rows by a loop that also checks each page id).
copy_i32 = _int32_copy(cgutils.raw_memcpy)
# memmove of ``n`` int32 (the ranges may overlap): the step's CSR grows in place.
move_i32 = _int32_copy(cgutils.raw_memmove)


@intrinsic
def fetch_add_i64(typingctx, addr, n):
    """Atomically add ``n`` to the int64 at ``addr``; returns the value before. Two callers
    bumping the same counter at once (threads, or kernels compiled without the GIL) each get
    their own value."""
    sig = types.int64(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        cell = builder.inttoptr(args[0], llvm_ir.IntType(64).as_pointer())
        return builder.atomic_rmw("add", cell, args[1], "seq_cst")

    return sig, codegen


@intrinsic
def fill_null_i32(typingctx, addr, n):
    """Set ``n`` int32 at address ``addr`` to -1 (NULL_PAGE): a memset of 0xFF bytes.

    numba leaves such padding loops scalar; a memset is much faster.
    """
    assert L.NULL_PAGE == -1  # all bytes 0xFF
    sig = types.void(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        dst, count = args
        byte_ptr = llvm_ir.IntType(8).as_pointer()
        nbytes = builder.mul(count, llvm_ir.Constant(llvm_ir.IntType(64), 4))
        cgutils.memset(builder, builder.inttoptr(dst, byte_ptr), nbytes, 0xFF)
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(nogil=True, inline="always")
def fill_null_range(addr, start, stop):
    """Set the int32 entries ``[start, stop)`` of the array at ``addr`` to -1; nothing if ``stop <= start``."""
    if stop > start:
        fill_null_i32(addr + 4 * start, stop - start)


@numba.njit(nogil=True, inline="always")
def count_overflow(counters, source, n):
    """``n`` more ``out_overflow``, counted again in slot ``source`` (the buffer it overflowed). Only
    when ``n``: the source slots lie past every slot a decode step touches (a cache line more, cold)."""
    if n:
        counters[L.ERR_OUT_OVERFLOW] += n
        counters[source] += n


@numba.njit(nogil=True, inline="always")
def i32_array(addr, n):
    """int32 ``[n]`` array over a contiguous tensor's ``data_ptr()``."""
    return numba.carray(_i32_ptr(addr), (n,))


@numba.njit(nogil=True, inline="always")
def u8_array(addr, n):
    """uint8 ``[n]`` array over a contiguous bool tensor's ``data_ptr()``."""
    return numba.carray(_u8_ptr(addr), (n,))


@numba.njit(nogil=True, inline="always")
def state_arrays(sd):
    """(free_stack, refcount, page_state, stamp, counters, occur, keys) over a state descriptor."""
    P = sd[SD_PAGES]
    return (numba.carray(_i32_ptr(sd[SD_FREE_STACK]), (P,)), numba.carray(_i32_ptr(sd[SD_REFCOUNT]), (P,)),
            numba.carray(_i8_ptr(sd[SD_PAGE_STATE]), (P,)), numba.carray(_i64_ptr(sd[SD_STAMP]), (P,)),
            numba.carray(_i64_ptr(sd[SD_COUNTERS]), (L.NUM_COUNTERS,)),
            numba.carray(_i32_ptr(sd[SD_OCCUR]), (P,)), numba.carray(_i64_ptr(sd[SD_KEYS]), (P,)))


@numba.njit(nogil=True, inline="always")
def page_gens(sd):
    """int32 ``[P]``: the pages' generations over a state descriptor (only the calls that free or revive read it)."""
    return numba.carray(_i32_ptr(sd[SD_PAGE_GEN]), (sd[SD_PAGES],))


@numba.njit(nogil=True, inline="always")
def lru_arrays(sd):
    """``(lru_queue, lru_pos)`` over a state descriptor (only the calls that cache, touch or evict read them)."""
    P = sd[SD_PAGES]
    return (numba.carray(_i32_ptr(sd[SD_LRU_QUEUE]), (L.LRU_FACTOR * P,)),
            numba.carray(_i64_ptr(sd[SD_LRU_POS]), (P,)))


@numba.njit(nogil=True, inline="always")
def lru_live(queue, j, lru_pos, page_state):
    """The page of the LRU queue's entry at position ``j`` (the caller keeps ``j`` inside the queue,
    at or above 0) if that entry is live (a page in ``[0, P)``, CACHED, whose latest entry it is),
    else -1."""
    p = queue[j % queue.shape[0]]
    if p >= 0 and p < page_state.shape[0] and page_state[p] == L.CACHED and lru_pos[p] == j:
        return p
    return L.NULL_PAGE


@numba.njit(nogil=True, inline="always")
def lru_in_bounds(counters, Q):
    """Whether the LRU queue's positions are in bounds: ``0 <= head <= hole <= scan <= tail <= head + Q``
    and ``tail <= LRU_POS_LIMIT`` (layout)."""
    h, w, s, t = counters[L.LRU_HEAD], counters[L.LRU_HOLE], counters[L.LRU_SCAN], counters[L.LRU_TAIL]
    return h >= 0 and h <= w and w <= s and s <= t and t <= L.LRU_POS_LIMIT and t - h <= Q


@numba.njit(nogil=True, inline="always")
def lru_move(queue, lru_pos, p, v):
    """Live entry of page ``p`` to position ``v`` (at or below where it was); returns ``v + 1``."""
    queue[v % queue.shape[0]] = p
    lru_pos[p] = v
    return v + 1


@numba.njit(nogil=True, inline="always")
def lru_move_down(queue, lru_pos, page_state, lo, hi, v):
    """The live entries at positions ``[lo, hi)`` move to ``v, v + 1, ...`` in order (``v <= lo``: each
    lands at or below where it was, on a slot already read); returns ``v`` after them."""
    for j in range(lo, hi):
        p = lru_live(queue, j, lru_pos, page_state)
        if p >= 0:
            v = lru_move(queue, lru_pos, p, v)
    return v


@numba.njit(nogil=True)
def lru_prepare(queue, lru_pos, page_state, counters):
    """Run first by every call that may push on the LRU queue (layout.LRU_FACTOR): a queue out of
    bounds is emptied (all positions 0), counting ``corrupt_state``; one spanning more than ``Q - P``
    positions is compacted at once, its live entries moved down to the head, in order.
    Returns the tail."""
    Q, P = queue.shape[0], lru_pos.shape[0]
    h, t = counters[L.LRU_HEAD], counters[L.LRU_TAIL]
    if not lru_in_bounds(counters, Q):
        counters[L.ERR_CORRUPT_STATE] += 1
        h = t = 0
    elif t - h > Q - P:
        v = lru_move_down(queue, lru_pos, page_state, h, counters[L.LRU_HOLE], h)
        t = lru_move_down(queue, lru_pos, page_state, counters[L.LRU_SCAN], t, v)
    else:
        return t
    counters[L.LRU_HEAD] = counters[L.LRU_HOLE] = counters[L.LRU_SCAN] = h
    counters[L.LRU_TAIL] = t
    return t


@numba.njit(nogil=True, inline="always")
def lru_push(p, queue, lru_pos, counters):
    """Page ``p`` (in ``[0, P)``) became CACHED or was touched while CACHED: its entry goes at the tail
    (after ``lru_prepare``). One that would pass ``head + Q`` gets none, counting ``corrupt_state``."""
    t = counters[L.LRU_TAIL]
    if t - counters[L.LRU_HEAD] < queue.shape[0]:
        lru_move(queue, lru_pos, p, t)
        counters[L.LRU_TAIL] = t + 1
    else:
        counters[L.ERR_CORRUPT_STATE] += 1


@numba.njit(nogil=True)
def lru_clean(queue, lru_pos, page_state, counters, pushed):
    """Run last by every call that pushed ``pushed`` entries (after ``lru_prepare``): when the queue
    spans more than ``LRU_CLEAN_AT * P`` positions, read the next ``LRU_CLEAN_RATE * pushed`` entries
    from the scan and move the live ones down to the hole, in order; a scan that reaches the tail
    brings the tail back to the hole, and the next pass starts at the head."""
    h, t = counters[L.LRU_HEAD], counters[L.LRU_TAIL]
    if t - h <= L.LRU_CLEAN_AT * lru_pos.shape[0]:
        return
    w, s = counters[L.LRU_HOLE], counters[L.LRU_SCAN]
    end = min(t, s + L.LRU_CLEAN_RATE * pushed)
    w = lru_move_down(queue, lru_pos, page_state, s, end, w)
    if end == t:
        counters[L.LRU_TAIL] = w
        w = end = h
    counters[L.LRU_HOLE] = w
    counters[L.LRU_SCAN] = end


@numba.njit(nogil=True, inline="always")
def bump_gen(page_gen, p):
    """Page ``p`` just became FREE: its generation +1, wrapping within the non-negative int32."""
    page_gen[p] = (page_gen[p] + 1) & L.GEN_MASK


@numba.njit(nogil=True, inline="always")
def table_arrays(td):
    """(block_table [R, MP], seq_lens, claim, page_size) over a table descriptor."""
    R = td[TD_REQUESTS]
    return (numba.carray(_i32_ptr(td[TD_BLOCK_TABLE]), (R, td[TD_MAX_PAGES])),
            numba.carray(_i32_ptr(td[TD_SEQ_LENS]), (R,)), numba.carray(_i32_ptr(td[TD_CLAIM]), (R,)),
            td[TD_PAGE_SIZE])


@numba.njit(nogil=True, inline="always")
def new_version(td):
    """Give the table a version no table content had before; returns it.

    Called by every numba entry point that may change ``block_table`` or
    ``seq_lens``: directly by the step and ``restamp_table``, by extend, release,
    truncate and fork through ``stamp_rows`` when the call names a row. The source is not part of any table's state,
    so restoring a snapshot (which puts the old version back with the old contents) never
    makes two different contents share a version; a step's CSR memo relies on
    that (see ``kernels/step.py``). Contents changed by hand (not through
    tpool calls or a whole-state restore) keep their version: call
    ``PageTable.invalidate_csr`` after such edits.
    """
    version = fetch_add_i64(td[TD_VERSION_SOURCE], 1) + 1  # atomic: safe whether or not a kernel holds the GIL
    cells = version_cells(td)
    cells[L.APPENDED_FROM] = -1  # not made by a step (new_step_version says when it was)
    cells[L.VERSION_NOW] = version
    return version


@numba.njit(nogil=True, inline="always")
def version_cells(td):
    """int64 ``[VERSION_CELLS]``: the table's version and the one the step that made it started from
    (layout; -1 when another kind of call made it)."""
    return numba.carray(_i64_ptr(td[TD_VERSION]), (L.VERSION_CELLS,))


@numba.njit(nogil=True, inline="always")
def new_step_version(td):
    """``new_version`` for a step, which only appends to rows (tokens, and pages after the last):
    the table notes the version it came from, so a CSR of that version can still be grown in
    place (``kernels/step.py``: two ``StepOut`` buffers taking turns)."""
    before = version_cells(td)[L.VERSION_NOW]
    version = new_version(td)
    version_cells(td)[L.APPENDED_FROM] = before
    return version


@numba.njit(nogil=True, inline="always")
def row_versions(td):
    """int64 ``[R]``: the version of the call that last changed each row's pages (see ``stamp_rows``)."""
    return numba.carray(_i64_ptr(td[TD_ROW_VERSION]), (td[TD_REQUESTS],))


@numba.njit(nogil=True)
def stamp_rows(td, ids_ptr, B):
    """A fresh version for the table, and ``row_version[r]`` set to it for every request id ``r``
    of a call that may change rows; nothing when the call names no row (only padding or ids out
    of range: the contents stay as they are, so a step after it still grows its CSR in place).

    A step's CSR memo notes each lane's stamp; a later step keeps a request's run of the old
    CSR only while its row still has that stamp, so every numba call that may change a row's
    pages other than a step's growth (extend, release, truncate, fork's targets) stamps the
    rows it names, granted or not. Steps stamp the rows they grow themselves. Versions never
    repeat and are at least 1, so a restored snapshot brings back its rows' stamps with their
    contents, and a row with stamp 0 (no numba call changed it: a fresh table, or a state
    made by another backend) is never kept. Rows written by hand need ``restamp_table``.
    """
    stamps, ids, R = row_versions(td), i32_array(ids_ptr, B), td[TD_REQUESTS]
    version = -1
    for i in range(B):
        r = ids[i]
        if r >= 0 and r < R:
            if version < 0:
                version = new_version(td)
            stamps[r] = version


@numba.njit(nogil=True)
def restamp_table(td):
    """A fresh version for the table and every row, after rows were written by hand
    (``PageTable.invalidate_csr``, which also drops every memo): a run noted after the edit
    is not kept once a snapshot from before it is restored (its stamps are older)."""
    version = new_version(td)
    stamps = row_versions(td)
    for r in range(stamps.shape[0]):
        stamps[r] = version


@numba.njit(nogil=True)
def copy_spans(desc_addr, n):
    """Copy ``n`` byte spans, described by int64 ``[3n]`` at ``desc_addr``: (destination, source, bytes)
    each. Compiled by the numba backend to keep the GIL (``tpool.state.copy_between_calls``): several
    tensors copied in one call that no numba call of another thread can land in."""
    d = i64_array(desc_addr, 3 * n)
    for k in range(n):
        size = d[3 * k + 2]
        dst, src = u8_array(d[3 * k], size), u8_array(d[3 * k + 1], size)
        for j in range(size):
            dst[j] = src[j]


@numba.njit(nogil=True, inline="always")
def i64_cell(addr):
    """int64 ``[1]`` array over the cell at ``addr``."""
    return numba.carray(_i64_ptr(addr), (1,))


@numba.njit(nogil=True, inline="always")
def i64_array(addr, n):
    """int64 ``[n]`` array over a contiguous tensor's ``data_ptr()``."""
    return numba.carray(_i64_ptr(addr), (n,))


@numba.njit(nogil=True, inline="always")
def page_shift(page_size):
    """log2(page_size) when it is a power of two (the usual case), else -1."""
    if page_size & (page_size - 1) != 0:
        return -1
    s = 0
    while (1 << s) < page_size:
        s += 1
    return s


@numba.njit(nogil=True, inline="always")
def pages_for(tokens, page_size, shift):
    """ceil(tokens / page_size): a shift instead of an integer division when ``shift >= 0``.

    A division per request is a visible share of a decode step on a CPU.
    """
    if shift >= 0:
        return (tokens + page_size - 1) >> shift
    return (tokens + page_size - 1) // page_size


@numba.njit(nogil=True, inline="always")
def add_references(p, k, refcount, page_state, counters):
    """Page ``p`` (USED or CACHED, checked by the caller) gains ``k`` references: a CACHED page is revived
    (USED, counted in ``revived``); the count saturates at INT32_MAX, counting the references that did not fit."""
    if page_state[p] == L.CACHED:
        page_state[p] = L.USED
        counters[L.CACHED_COUNT] -= 1
        counters[L.REVIVED] += 1
    rc = refcount[p] + np.int64(k)
    if rc > INT32_MAX:
        counters[L.ERR_REFCOUNT_OVERFLOW] += rc - INT32_MAX
        rc = INT32_MAX
    refcount[p] = rc


@numba.njit(nogil=True)
def raise_peaks(counters, num_pages):
    used = num_pages - counters[L.FREE_COUNT] - counters[L.CACHED_COUNT]
    if used > counters[L.USED_PEAK]:
        counters[L.USED_PEAK] = used
    if counters[L.CACHED_COUNT] > counters[L.CACHED_PEAK]:
        counters[L.CACHED_PEAK] = counters[L.CACHED_COUNT]


@numba.njit(nogil=True, inline="always")
def padded_tail_start(pages):
    """Where the trailing -1 entries of ``pages`` (padding, which every pass skips) begin, in blocks
    of ``TAIL_BLOCK``: a grant's output is as long as the most it may grant, mostly padding (4,096
    ids for one page from ``alloc`` without ``out=``), and one AND over a block (a vector loop)
    tells that the block is all -1 (no other values AND to -1)."""
    n = pages.shape[0]
    while n >= TAIL_BLOCK:
        acc = np.int32(-1)
        at = np.uint64(n - TAIL_BLOCK)  # unsigned indices: no negative-index wraparound, the loop vectorises
        for i in range(TAIL_BLOCK):
            acc &= pages[at + np.uint64(i)]
        if acc != -1:
            break
        n -= TAIL_BLOCK
    return n


@numba.njit(nogil=True)
def count_pages(pages, num_pages, occur, counters):
    """Pass 1 of free/incref/touch/revive: occurrences per page into ``occur``; count invalid ids. ``occur`` is
    zeroed for the pages first: a value left there (a hand edit; 0 between calls) changes no count."""
    for i in range(pages.shape[0]):
        p = pages[i]
        if p >= 0 and p < num_pages:
            occur[p] = 0
    for i in range(pages.shape[0]):
        p = pages[i]
        if p >= 0 and p < num_pages:
            occur[p] += 1
        elif p != L.NULL_PAGE:
            counters[L.ERR_INVALID_PAGE] += 1



@numba.njit(nogil=True)
def claim_requests(ids, R, claim, counters, count_bad):
    """Mark each request's first lane in ``claim`` (scratch); count the other non-padding lanes as bad.

    ``claim[r] = min(claim[r], lanes naming r)``, as Triton's ``atomic_min``: a value a hand edit left
    below a request's first lane leaves that request without a valid lane."""
    for i in range(ids.shape[0]):
        r = ids[i]
        if r >= 0 and r < R and i <= claim[r]:
            claim[r] = i
    if count_bad:
        for i in range(ids.shape[0]):
            r = ids[i]
            if r != L.NULL_PAGE and not lane_valid(ids, i, R, claim):
                counters[L.ERR_BAD_REQUEST] += 1


@numba.njit(nogil=True, inline="always")
def lane_valid(ids, i, R, claim):
    r = ids[i]
    return r >= 0 and r < R and claim[r] == i


@numba.njit(nogil=True)
def reset_requests(ids, R, claim):
    for i in range(ids.shape[0]):
        r = ids[i]
        if r >= 0 and r < R:
            claim[r] = INT32_MAX


@numba.njit(nogil=True)
def apply_free(pages, cache, clock, free_stack, refcount, page_state, stamp, page_gen, counters, occur, lru_queue,
               lru_pos):
    """The pool's free rule over ``pages`` (any int array, -1 = padding), without the clock tick.

    Per distinct page named ``k`` times: ``d = min(k, refcount)`` references are
    dropped and ``k - d`` entries count as ``double_free`` (all ``k`` when the
    page is not USED); pages reaching 0 are pushed in the order of their first
    occurrence (FREE, their generation bumped), or with ``cache`` become CACHED
    stamped ``clock`` and go on the LRU queue in the order of their LAST
    occurrence (a page shared by rows released together goes after every row's
    deeper pages). Used by ``free`` and by the page table's ``release`` /
    ``truncate``. With ``cache``, a page released at its first occurrence keeps
    ``-(occurrences left)`` in ``occur`` until its last one queues it (0 again).
    """
    P = refcount.shape[0]
    tail = lru_prepare(lru_queue, lru_pos, page_state, counters) if cache else 0
    count_pages(pages, P, occur, counters)
    top = counters[L.FREE_COUNT]
    pos = top  # the slot of the next released page (a push needs 0 <= pos < P)
    # no push can leave the stack: skip the check (``top <= P - n``, not ``top + n <= P``: a corrupt count
    # near INT64_MAX would wrap the sum negative and pass)
    safe = top >= 0 and top <= P - pages.shape[0]
    released = 0
    double = 0
    lost = 0
    for i in range(pages.shape[0]):
        p = pages[i]
        if p < 0 or p >= P:
            continue  # padding or invalid
        k = occur[p]
        if k < 0:  # (cache) a later occurrence of a page this call released: queued at its last
            occur[p] = k + 1
            if k == -1:
                lru_push(p, lru_queue, lru_pos, counters)
            continue
        if k == 0:
            continue  # not the first occurrence
        occur[p] = 0
        if page_state[p] != L.USED:
            double += k
            continue
        rc = refcount[p]
        d = min(k, rc)
        double += k - d
        refcount[p] = rc - d
        if rc == d:
            released += 1
            if cache:
                page_state[p] = L.CACHED
                stamp[p] = clock
                if k == 1:
                    lru_push(p, lru_queue, lru_pos, counters)
                else:
                    occur[p] = 1 - k  # named again later: queued at its last occurrence
            else:
                page_state[p] = L.FREE
                bump_gen(page_gen, p)
                if safe or (pos >= 0 and pos < P):  # pushed; else a corrupt free count: FREE, unpushed
                    free_stack[pos] = p
                    top += 1
                else:
                    lost += 1
                pos += 1
    counters[L.ERR_DOUBLE_FREE] += double
    counters[L.ERR_CORRUPT_STATE] += lost
    counters[L.FREED] += released
    if cache:
        counters[L.CACHED_COUNT] += released
        lru_clean(lru_queue, lru_pos, page_state, counters, counters[L.LRU_TAIL] - tail)
    counters[L.FREE_COUNT] = top
    raise_peaks(counters, P)


@numba.njit(nogil=True, inline="always")
def mark_popped(p, refcount, page_state):
    """Page ``p``, just popped off the free stack: USED, with one reference. ``p`` must be a page
    id: callers check it first, one entry at a time (``pop_page``) or a whole run of the stack
    at once (``stack_run_ok``)."""
    refcount[p] = 1
    page_state[p] = L.USED


@numba.njit(nogil=True, inline="always")
def pop_page(at, free_stack, refcount, page_state, counters):
    """The page at ``free_stack[at]``, marked USED with one reference. Callers pop from the top
    (``at`` = free count - 1 - pages popped so far) and lower the free count once at the end.

    Corrupt state (counted): ``at < 0`` and an entry outside ``[0, P)`` yield -1 and touch no
    page: no id outside the pool is ever handed out."""
    if at < 0:
        counters[L.ERR_CORRUPT_STATE] += 1
        return L.NULL_PAGE
    p = free_stack[at]
    if p >= 0 and p < refcount.shape[0]:
        mark_popped(p, refcount, page_state)
        return p
    counters[L.ERR_CORRUPT_STATE] += 1
    return L.NULL_PAGE


@numba.njit(nogil=True, inline="always")
def stack_run_ok(free_stack, lo, hi, num_pages):
    """Whether ``free_stack[lo:hi]`` lies within the stack and holds page ids in ``[0, P)``: one
    vectorised min/max pass, so a pop of many pages checks them before it writes any."""
    if lo < 0 or hi > free_stack.shape[0]:
        return lo >= hi
    return run_in_pool(free_stack, lo, hi, num_pages)


@numba.njit(nogil=True, inline="always")
def run_in_pool(ids, lo, hi, num_pages):
    """Whether ``ids[lo:hi]`` (the caller keeps it inside ``ids``) holds page ids in ``[0, P)`` only:
    one vectorised min/max pass."""
    mn, mx = 0, 0
    for j in range(lo, hi):
        v = ids[j]
        mn = min(mn, v)
        mx = max(mx, v)
    return mn >= 0 and mx < num_pages


@numba.njit(nogil=True, inline="always")
def gated_free(counters, num_pages):
    """The free count if it is within ``[0, P]``; else 0, counting ``corrupt_state``."""
    f = counters[L.FREE_COUNT]
    if f < 0 or f > num_pages:
        counters[L.ERR_CORRUPT_STATE] += 1
        return 0
    return f


@numba.njit(nogil=True, inline="always")
def length_ok(length, limit):
    """A request length a row can hold: ``0 <= length <= limit`` (max_pages * page_size)."""
    return length >= 0 and length <= limit
