"""fork: an empty request ``dst`` shares the first ``lens`` tokens of ``src``.

Whole pages are shared (one more reference each); a partial last page gets a
fresh page, popped from the free stack in lane order (first come first
served over the lanes that need one), and ``(src page, dst page)`` is returned
for the KV copy. Padding: ``dst == -1``. A bad ``src``/``dst`` (out of range,
``dst`` repeated, not empty, or equal to ``src``) is ``bad_request``; ``lens``
outside ``[0, len(src)]`` is ``bad_length``. A page the lane reads (the shared
ones and the partial one it copies) that is not USED is ``use_after_free``, one
outside the pool ``corrupt_state``: the lane fails.
"""

import numba
from ._triton_shim import tl, triton

from . import layout as L
from . import _numba_util as nu
from ._numba_util import (i32_array, lane_valid, pop_page, stamp_rows, state_arrays, table_arrays,
                          u8_array)
from .layout import CD_OUT, CD_STATE
from ._triton_table_util import (ERR_BAD_LENGTH, ERR_BAD_REQUEST, cdiv, check_lane_scratch, claim_pages,
                                 claim_requests, first_pages, list_lane, reset_requests, request_lanes, reset_pages)
from ._triton_util import (ALLOCATED, CACHED, CACHED_COUNT, ERR_CORRUPT_STATE, ERR_INVALID_PAGE,
                           ERR_REFCOUNT_OVERFLOW, ERR_USE_AFTER_FREE, FAILED_REQUESTS, FREE, FREE_COUNT,
                           NULL_PAGE, REVIVED, USED, add_references, counter_add, gate_free, load_counters,
                           pop_check, raise_peaks, settings, store_counters, tick)


@numba.njit(nogil=True, inline="always")
def granted_lane(ok, src, dst, lens, i, R, limit):
    """Lane ``i``'s ``(src, dst, tokens)`` read again from the caller's memory, and whether the first
    pass granted it and they are still in bounds (only a write from outside the call changes them)."""
    s, d, n = src[i], dst[i], lens[i]
    return s, d, n, ok[i] != 0 and s >= 0 and s < R and d >= 0 and d < R and n >= 0 and n <= limit


@numba.njit(nogil=True)
def fork_numba(
    src_ptr,      # address of int32 [B], source requests
    dst_ptr,      # address of int32 [B], destination requests, -1 = padding
    lens_ptr,     # address of int32 [B], tokens to share
    B,            # batch size
    ok_ptr,       # address of bool [B]
    cow_src_ptr,  # address of int32 [B], page to copy from, -1 if none
    cow_dst_ptr,  # address of int32 [B], fresh page to copy into, -1 if none
    page_size,    # tokens per page
    block_table,  # int32 [R, MP]
    seq_lens,     # int32 [R]
    claim,        # int32 [R] scratch
    free_stack,   # int32 [P]
    refcount,     # int32 [P]
    page_state,   # int8 [P]
    counters,     # int64 [NUM_COUNTERS]
):
    src, dst, lens = i32_array(src_ptr, B), i32_array(dst_ptr, B), i32_array(lens_ptr, B)
    ok, cow_src, cow_dst = u8_array(ok_ptr, B), i32_array(cow_src_ptr, B), i32_array(cow_dst_ptr, B)
    R, P = block_table.shape[0], refcount.shape[0]
    limit = block_table.shape[1] * page_size
    counters[L.CLOCK] += 1
    nu.claim_requests(dst, R, claim, counters, False)
    free = nu.gated_free(counters, P) if B > 0 else 0  # a corrupt free count: an empty stack
    csum = 0
    for i in range(B):  # decide every lane on the state at call start
        granted = False
        d, s, n = dst[i], src[i], lens[i]
        if d != L.NULL_PAGE:
            if not (lane_valid(dst, i, R, claim) and s >= 0 and s < R and s != d and seq_lens[d] == 0):
                counters[L.ERR_BAD_REQUEST] += 1
            elif not nu.length_ok(seq_lens[s], limit):
                counters[L.ERR_CORRUPT_STATE] += 1
            elif n < 0 or n > seq_lens[s]:
                counters[L.ERR_BAD_LENGTH] += 1
            else:
                wild = False  # an id outside [0, P) among the pages read: corrupt state
                stale = 0     # pages read (shared, or the partial one copied) that are not USED: freed under the row
                for k in range((n + page_size - 1) // page_size):
                    p = block_table[s, k]
                    if p < 0 or p >= P:
                        wild = True
                    elif page_state[p] != L.USED:
                        stale += 1
                counters[L.ERR_CORRUPT_STATE] += wild
                counters[L.ERR_USE_AFTER_FREE] += stale
                if not wild and stale == 0:
                    part = n % page_size != 0
                    csum += part
                    granted = not part or csum <= free  # a lane sharing whole pages only needs no page
            if not granted:
                counters[L.FAILED_REQUESTS] += 1
        ok[i] = granted
    for i in range(B):  # every granted lane's shared pages first, as the reference does, then the pops
        s, d, n, good = granted_lane(ok, src, dst, lens, i, R, limit)
        if not good:
            continue
        for k in range(n // page_size):
            p = block_table[s, k]
            if p < 0 or p >= P:  # checked by the first pass: only a write from outside the call
                continue
            state = page_state[p]
            if state == L.FREE:
                counters[L.ERR_USE_AFTER_FREE] += 1
                continue
            nu.add_references(p, 1, refcount, page_state, counters)
            block_table[d, k] = p
    popped = 0
    for i in range(B):
        cow_src[i] = L.NULL_PAGE
        cow_dst[i] = L.NULL_PAGE
        s, d, n, good = granted_lane(ok, src, dst, lens, i, R, limit)
        if not good:
            continue
        full = n // page_size
        if n % page_size != 0:
            new = pop_page(free - 1 - popped, free_stack, refcount, page_state, counters)
            popped += 1
            block_table[d, full] = new
            # A copy-on-write pair only between page ids of the pool (a consumer copies K/V by them): the
            # source page was checked with the shared range, a wild popped page was counted by the pop.
            if new >= 0 and new < P:
                cow_src[i] = block_table[s, full]
                cow_dst[i] = new
        seq_lens[d] = n
    nu.reset_requests(dst, R, claim)
    counters[L.FREE_COUNT] -= popped
    counters[L.ALLOCATED] += popped
    if B > 0:  # an empty batch touches nothing (as the reference and Triton)
        nu.raise_peaks(counters, refcount.shape[0])


@numba.njit(nogil=True)
def fork_numba_entry(src_ptr, dst_ptr, lens_ptr, B, ok_ptr, cow_src_ptr, cow_dst_ptr, cd):
    """``fork_numba`` with table and pool state in the call descriptor ``cd`` (fast dispatch)."""
    bt, lens, claim, ps = table_arrays(cd[:CD_STATE])
    stamp_rows(cd[:CD_STATE], dst_ptr, B)  # the sources' rows do not change
    stack, rc, state, _, counters, _, _ = state_arrays(cd[CD_STATE:CD_OUT])
    fork_numba(src_ptr, dst_ptr, lens_ptr, B, ok_ptr, cow_src_ptr, cow_dst_ptr, ps, bt, lens, claim,
               stack, rc, state, counters)


# ---------------------------------------------------------------------- Triton
# One program. Lanes: claim the dst rows, decide every lane on the state at
# call start (FCFS prefix sum of the partial pages against the free count) and
# write ``ok``, which later phases read back, and each lane's running end in
# the shared-page list to ``lane_end``. Entry f of the list is column
# ``f - start_i`` (< lens_i // ps) of src_i's row (``list_lane``); four passes
# run the pool's ``incref`` over them (reset the pages' scratch; claim; apply to
# first occurrences and copy the entries into the dst rows; restore the
# scratch). Last, lanes ending inside a page pop a fresh page (offsets from a
# prefix sum), the copy pairs and lengths are written and the claims restored.


@triton.jit
def _shared(f, total, lane_end_ptr, SEARCH, src_ptr, dst_ptr, lens_ptr, B, ok_ptr, block_table_ptr, MP,
            page_size):
    """List entries ``f``: ``(dst cell, page, shared?)``; a shared entry is a whole page of the src row."""
    live = f < total
    i, start = list_lane(f, live, lane_end_ptr, B, SEARCH)
    ok = tl.load(ok_ptr + i, mask=live, other=0).to(tl.int1) & live
    s = tl.load(src_ptr + i, mask=ok, other=0).to(tl.int64)
    d = tl.load(dst_ptr + i, mask=ok, other=0).to(tl.int64)
    k = f - start
    shared = ok & (k < tl.load(lens_ptr + i, mask=ok, other=0) // page_size)
    p = tl.load(block_table_ptr + s * MP + k, mask=shared, other=NULL_PAGE)
    return d * MP + k, p, shared


@triton.jit
def fork_kernel(
    src_ptr,          # *int32 [B]: source requests
    dst_ptr,          # *int32 [B]: destination requests, -1 = padding
    lens_ptr,         # *int32 [B]: tokens to share
    B,                # batch size
    ok_ptr,           # *bool [B]: lane granted
    cow_src_ptr,      # *int32 [B]: page to copy from, -1 if none
    cow_dst_ptr,      # *int32 [B]: fresh page to copy into, -1 if none
    block_table_ptr,  # *int32 [R, MP]
    seq_lens_ptr,     # *int32 [R]
    claim_ptr,        # *int32 [R] scratch, INT32_MAX between calls
    free_stack_ptr,   # *int32 [P]
    refcount_ptr,     # *int32 [P]
    page_state_ptr,   # *int8 [P]
    counters_ptr,     # *int64 [NUM_COUNTERS]
    page_claim_ptr,   # *int32 [P] scratch, INT32_MAX between calls
    occur_ptr,        # *int32 [P] scratch, 0 between calls
    lane_end_ptr,     # *int32 [>= B] scratch: running end of each lane's shared pages
    R,                # rows of block_table
    MP,               # columns of block_table
    num_pages,        # P
    page_size,        # tokens per page
    SEARCH,           # B.bit_length(): steps of the lane search
    # Meta-parameters
    BLOCK: tl.constexpr,  # lanes / entries per chunk
):
    """dst_i shares the lens_i // ps whole pages of src_i (incref) and pops a page for a partial one, FCFS."""
    lanes = tl.arange(0, BLOCK)
    c = load_counters(counters_ptr)
    c, _clock = tick(c)  # (not "_": a loop below rebinds "_" to a block, which Triton rejects)
    c, free = gate_free(c, num_pages, B > 0)  # a corrupt free count: an empty stack
    claim_requests(dst_ptr, B, claim_ptr, R, BLOCK)
    tl.debug_barrier()
    csum = tl.zeros((), tl.int64)  # partial pages wanted by candidate lanes so far
    total = tl.zeros((), tl.int32)  # entries of the shared-page list
    bad = tl.zeros((), tl.int64)
    bad_len = tl.zeros((), tl.int64)
    failed = tl.zeros((), tl.int64)
    wrong_state = tl.zeros((), tl.int64)  # corrupt src lengths and shared ranges with wild ids
    uaf = tl.zeros((), tl.int64)          # shared-range pages that are not USED (the lane fails)
    for start in range(0, B, BLOCK):
        i = start + lanes
        d, vd, pad, live = request_lanes(dst_ptr, i, B, claim_ptr, R)
        s = tl.load(src_ptr + i, mask=live, other=NULL_PAGE)
        vs = (s >= 0) & (s < R)
        empty = tl.load(seq_lens_ptr + d, mask=vd, other=1) == 0
        good = vd & vs & (s != d) & empty
        n = tl.load(lens_ptr + i, mask=live, other=0).to(tl.int64)
        src_len = tl.load(seq_lens_ptr + s, mask=good, other=0)
        corrupt = live & ~pad & good & ((src_len < 0) | (src_len > MP * page_size))
        wrong = live & ~pad & good & ~corrupt & ((n < 0) | (n > src_len))
        cand = live & ~pad & good & ~corrupt & ~wrong
        n = tl.maximum(n, 0)
        # The pages read (the shared range, and a partial last page, which is copied) must be live:
        # a wild id is corrupt state, a page that is not USED was freed under the row (use after
        # free); either fails the lane.
        read = tl.where(cand, cdiv(n, page_size), 0)
        wild = cand & False
        stale = tl.zeros((BLOCK,), tl.int64)
        srow = s.to(tl.int64) * MP
        for k in range(0, tl.max(read)):
            m = k < read
            p = tl.load(block_table_ptr + srow + k, mask=m, other=0)
            pid_ok = (p >= 0) & (p < num_pages)
            wild = wild | (m & ~pid_ok)
            held = tl.load(page_state_ptr + p, mask=m & pid_ok, other=USED) == USED
            stale += (m & pid_ok & ~held).to(tl.int64)
        wrong_state += tl.sum(corrupt.to(tl.int64)) + tl.sum(wild.to(tl.int64))
        uaf += tl.sum(stale)
        cand = cand & ~wild & (stale == 0)
        part = (cand & (n % page_size != 0)).to(tl.int64)
        ok = cand & ((part == 0) | (csum + tl.cumsum(part, 0) <= free))  # no page needed: never refused for one
        tl.store(ok_ptr + i, ok, mask=live)
        shares = tl.where(ok, n // page_size, 0).to(tl.int32)
        tl.store(lane_end_ptr + i, total + tl.cumsum(shares, 0), mask=live)
        total += tl.sum(shares)
        csum += tl.sum(part)
        bad += tl.sum((live & ~pad & ~good).to(tl.int64))
        bad_len += tl.sum(wrong.to(tl.int64))
        failed += tl.sum((live & ~pad & ~ok).to(tl.int64))
    tl.debug_barrier()
    for start in range(0, total, BLOCK):  # the pages' scratch reset first (see _triton_util's module note)
        f = start + lanes
        _, p, shared = _shared(f, total, lane_end_ptr, SEARCH, src_ptr, dst_ptr, lens_ptr, B, ok_ptr,
                               block_table_ptr, MP, page_size)
        reset_pages(p, shared, page_claim_ptr, occur_ptr, num_pages)
    tl.debug_barrier()
    invalid = tl.zeros((), tl.int64)
    for start in range(0, total, BLOCK):
        f = start + lanes
        _, p, shared = _shared(f, total, lane_end_ptr, SEARCH, src_ptr, dst_ptr, lens_ptr, B, ok_ptr,
                               block_table_ptr, MP, page_size)
        invalid += claim_pages(p, f, shared, page_claim_ptr, occur_ptr, num_pages, False)
    tl.debug_barrier()
    revived = tl.zeros((), tl.int64)
    over = tl.zeros((), tl.int64)
    for start in range(0, total, BLOCK):
        f = start + lanes
        cell, p, shared = _shared(f, total, lane_end_ptr, SEARCH, src_ptr, dst_ptr, lens_ptr, B, ok_ptr,
                                  block_table_ptr, MP, page_size)
        first, k = first_pages(p, f, shared, page_claim_ptr, occur_ptr, num_pages, False)
        state = tl.load(page_state_ptr + p, mask=first, other=FREE)
        uaf += tl.sum(tl.where(first & (state == FREE), k, 0).to(tl.int64))
        cached = first & (state == CACHED)
        more, back = add_references(p, (first & (state == USED)) | cached, cached, k, refcount_ptr, page_state_ptr,
                                    BLOCK)
        over += more
        revived += back
        tl.store(block_table_ptr + cell, p, mask=shared)  # dst rows were empty: no lane reads them
    tl.debug_barrier()
    for start in range(0, total, BLOCK):
        f = start + lanes
        _, p, shared = _shared(f, total, lane_end_ptr, SEARCH, src_ptr, dst_ptr, lens_ptr, B, ok_ptr,
                               block_table_ptr, MP, page_size)
        reset_pages(p, shared, page_claim_ptr, occur_ptr, num_pages)
    popped = tl.zeros((), tl.int64)
    for start in range(0, B, BLOCK):
        i = start + lanes
        live = i < B
        ok = tl.load(ok_ptr + i, mask=live, other=0).to(tl.int1) & live
        s = tl.load(src_ptr + i, mask=ok, other=0).to(tl.int64)
        d = tl.load(dst_ptr + i, mask=ok, other=0).to(tl.int64)
        n = tl.load(lens_ptr + i, mask=ok, other=0)
        col = tl.minimum(n // page_size, MP - 1)
        copy = ok & (n % page_size != 0)
        z = copy.to(tl.int64)
        off = popped + tl.cumsum(z, 0) - z
        new, bad_pop = pop_check(free - 1 - off, copy, free_stack_ptr, refcount_ptr, page_state_ptr, num_pages)
        wrong_state += bad_pop
        tl.store(block_table_ptr + d * MP + col, new, mask=copy)
        old = tl.load(block_table_ptr + s * MP + col, mask=copy, other=NULL_PAGE)
        # a copy only between page ids of the pool: the source page was checked above, a wild pop counted itself
        pair = copy & (new >= 0) & (new < num_pages)
        tl.store(cow_src_ptr + i, tl.where(pair, old, NULL_PAGE), mask=live)
        tl.store(cow_dst_ptr + i, tl.where(pair, new, NULL_PAGE), mask=live)
        tl.store(seq_lens_ptr + d, n, mask=ok)
        popped += tl.sum(z)
    reset_requests(dst_ptr, B, claim_ptr, R, BLOCK)
    c = counter_add(c, ERR_BAD_REQUEST, bad)
    c = counter_add(c, ERR_BAD_LENGTH, bad_len)
    c = counter_add(c, FAILED_REQUESTS, failed)
    c = counter_add(c, ERR_INVALID_PAGE, invalid)
    c = counter_add(c, ERR_USE_AFTER_FREE, uaf)
    c = counter_add(c, ERR_CORRUPT_STATE, wrong_state)
    c = counter_add(c, ERR_REFCOUNT_OVERFLOW, over)
    c = counter_add(c, CACHED_COUNT, -revived)
    c = counter_add(c, REVIVED, revived)
    c = counter_add(c, FREE_COUNT, -popped)
    c = counter_add(c, ALLOCATED, popped)
    if B > 0:
        c = raise_peaks(c, num_pages)
    store_counters(counters_ptr, c)


def fork_triton(src_ids, dst_ids, lens, ok, cow_src, cow_dst, st, ts) -> None:
    """Let empty requests ``dst_ids`` share the first ``lens`` tokens of ``src_ids`` (one launch)."""
    B = dst_ids.numel()
    check_lane_scratch(B, ts)
    R, MP = ts.block_table.shape
    fork_kernel[(1,)](
        src_ids, dst_ids, lens, B, ok, cow_src, cow_dst, ts.block_table, ts.seq_lens, ts.claim,
        st.free_stack, st.refcount, st.page_state, st.counters, st.claim, st.occur, ts.lane_end,
        R, MP, st.num_pages, ts.page_size, B.bit_length(),
        **settings(max(B, B * MP)),
    )
