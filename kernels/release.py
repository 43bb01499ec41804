"""release / truncate: free the pages of requests past a new length (0 for release).

The pages dropped by one call are freed as ONE ``free`` over the lanes' pages,
lane by lane in table order (so a page shared by two released requests loses
two references, and pushes follow first occurrence); a release into the cache
takes each lane's pages from its row's last page down and queues each page at
its last occurrence, so the LRU queue evicts a request's tail before its head,
and a head page shared by several requests released together after all their
tails (leaves first). Their table entries
become -1 and the length is set. Truncating to a length above the current one
(or below 0), or to a length that ends inside a page another request also holds
(its next token would overwrite that request's K/V), is ``bad_length`` and leaves
that request unchanged.
"""

import numba
import numpy as np
from ._triton_shim import tl, triton

from . import layout as L
from . import _numba_util as nu
from ._numba_util import i32_array, lane_valid, page_gens, stamp_rows, state_arrays, table_arrays
from .layout import CD_OUT, CD_STATE
from ._triton_table_util import (ERR_BAD_LENGTH, ERR_BAD_REQUEST, cdiv, claim_pages, claim_requests,
                                 check_lane_scratch, first_pages, list_lane, request_lanes, reset_pages,
                                 reset_requests)
from ._triton_util import (ERR_CORRUPT_STATE, FREE_COUNT, LRU_HEAD, LRU_TAIL, NULL_PAGE, apply_free,
                           count_freed, counter_add, counter_get, load_counters, lru_prepare, queue_settings,
                           store_counters, tick)


@numba.njit(nogil=True, inline="always")
def _new_len(new_lens, i, length, drop):
    """Lane ``i``'s length after the call: ``new_lens[i]``, or with ``drop`` the row's ``length``
    less ``new_lens[i]`` tokens (int64: no wrap whatever the drop)."""
    return np.int64(length) - new_lens[i] if drop else np.int64(new_lens[i])


@numba.njit(nogil=True)
def _drop_tail(ids, new_lens, use_lens, cache, page_size, block_table, seq_lens, claim,
               free_stack, refcount, page_state, stamp, page_gen, counters, occur, keys, lru, drop=False):
    R = block_table.shape[0]
    counters[L.CLOCK] += 1
    clock = counters[L.CLOCK]
    nu.claim_requests(ids, R, claim, counters, True)
    B = ids.shape[0]
    limit = block_table.shape[1] * page_size
    for i in range(B):  # decide each lane; mark rejected lanes by dropping their claim
        if lane_valid(ids, i, R, claim) and not nu.length_ok(seq_lens[ids[i]], limit):
            counters[L.ERR_CORRUPT_STATE] += 1  # a corrupt length: the row is left alone
            claim[ids[i]] = -1
        elif lane_valid(ids, i, R, claim) and use_lens:
            length = seq_lens[ids[i]]
            n = _new_len(new_lens, i, length, drop)
            if n < 0 or n > length:
                counters[L.ERR_BAD_LENGTH] += 1
                claim[ids[i]] = -1
            elif n < length and n % page_size != 0:
                # Ending inside a page another request holds: the next token would overwrite
                # its K/V. A bad length (as the reference's ends_in_shared_page).
                # n // page_size < MP: n < length <= limit.
                page = block_table[ids[i], n // page_size]
                if 0 <= page < refcount.shape[0] and refcount[page] > 1:
                    counters[L.ERR_BAD_LENGTH] += 1
                    claim[ids[i]] = -1
    count = 0
    for i in range(B):  # how many entries are dropped
        if lane_valid(ids, i, R, claim):
            keep = (_new_len(new_lens, i, seq_lens[ids[i]], drop) + page_size - 1) // page_size if use_lens else 0
            count += max(0, (seq_lens[ids[i]] + page_size - 1) // page_size - keep)
    # The pool's eviction scratch holds the dropped entries unless pages shared between
    # the released rows make them more than the pool has pages.
    dropped = keys[:count] if count <= keys.shape[0] else np.empty(count, np.int64)
    j = 0
    for i in range(B):  # gather them lane by lane, in table order (cached: each row reversed); reset the entries
        if lane_valid(ids, i, R, claim):
            r = ids[i]
            keep_tokens = _new_len(new_lens, i, seq_lens[r], drop) if use_lens else 0
            lo, hi = (keep_tokens + page_size - 1) // page_size, (seq_lens[r] + page_size - 1) // page_size
            for k in range(lo, hi):
                col = hi - 1 - (k - lo) if cache else k  # cached: the row's last page first (evicted first)
                dropped[j] = block_table[r, col]
                block_table[r, col] = L.NULL_PAGE
                j += 1
            seq_lens[r] = keep_tokens
    nu.reset_requests(ids, R, claim)
    if B > 0:  # an empty batch touches nothing (as the reference and Triton)
        nu.apply_free(dropped, cache, clock, free_stack, refcount, page_state, stamp, page_gen, counters, occur, *lru)


@numba.njit(nogil=True)
def release_numba(
    req_ids_ptr,  # address of int32 [B], request ids, -1 = padding
    B,            # batch size
    cache,        # bool, keep released pages as CACHED
    page_size,    # tokens per page
    block_table,  # int32 [R, MP]
    seq_lens,     # int32 [R]
    claim,        # int32 [R] scratch
    free_stack,   # int32 [P]
    refcount,     # int32 [P]
    page_state,   # int8 [P]
    stamp,        # int64 [P]
    page_gen,     # int32 [P]
    counters,     # int64 [NUM_COUNTERS]
    occur,        # int32 [P] scratch
    keys,         # int64 [P] scratch
    lru,          # (lru_queue int32 [LRU_FACTOR * P], lru_pos int64 [P])
):
    ids = i32_array(req_ids_ptr, B)
    _drop_tail(ids, ids, False, cache, page_size, block_table, seq_lens, claim,
               free_stack, refcount, page_state, stamp, page_gen, counters, occur, keys, lru)


@numba.njit(nogil=True)
def truncate_numba(
    req_ids_ptr,  # address of int32 [B], request ids, -1 = padding
    lens_ptr,     # address of int32 [B], new lengths (with ``drop``: tokens to remove)
    B,            # batch size
    drop,         # bool: lens are tokens to remove from each request's end
    page_size,    # tokens per page
    block_table,  # int32 [R, MP]
    seq_lens,     # int32 [R]
    claim,        # int32 [R] scratch
    free_stack,   # int32 [P]
    refcount,     # int32 [P]
    page_state,   # int8 [P]
    stamp,        # int64 [P]
    page_gen,     # int32 [P]
    counters,     # int64 [NUM_COUNTERS]
    occur,        # int32 [P] scratch
    keys,         # int64 [P] scratch
    lru,          # (lru_queue int32 [LRU_FACTOR * P], lru_pos int64 [P])
):
    _drop_tail(i32_array(req_ids_ptr, B), i32_array(lens_ptr, B), True, False, page_size, block_table,
               seq_lens, claim, free_stack, refcount, page_state, stamp, page_gen, counters, occur, keys, lru, drop)


@numba.njit(nogil=True)
def release_numba_entry(req_ids_ptr, B, cache, cd):
    """``release_numba`` with table and pool state in the call descriptor ``cd`` (fast dispatch)."""
    bt, lens, claim, ps = table_arrays(cd[:CD_STATE])
    stamp_rows(cd[:CD_STATE], req_ids_ptr, B)
    stack, rc, state, stamp, counters, occur, keys = state_arrays(cd[CD_STATE:CD_OUT])
    release_numba(req_ids_ptr, B, cache, ps, bt, lens, claim, stack, rc, state, stamp,
                  page_gens(cd[CD_STATE:CD_OUT]), counters, occur, keys, nu.lru_arrays(cd[CD_STATE:CD_OUT]))


@numba.njit(nogil=True)
def truncate_numba_entry(req_ids_ptr, lens_ptr, B, drop, cd):
    """``truncate_numba`` with table and pool state in the call descriptor ``cd`` (fast dispatch)."""
    bt, lens, claim, ps = table_arrays(cd[:CD_STATE])
    stamp_rows(cd[:CD_STATE], req_ids_ptr, B)
    stack, rc, state, stamp, counters, occur, keys = state_arrays(cd[CD_STATE:CD_OUT])
    truncate_numba(req_ids_ptr, lens_ptr, B, drop, ps, bt, lens, claim, stack, rc, state, stamp,
                   page_gens(cd[CD_STATE:CD_OUT]), counters, occur, keys, nu.lru_arrays(cd[CD_STATE:CD_OUT]))


# ---------------------------------------------------------------------- Triton
# One program. Lanes: claim the rows, decide each lane (valid = the row's
# first lane; truncate: new length in [0, L]) and write its running end in
# the dropped-page list to ``lane_end``. Entry f of the list is column
# ``ceil(keep_i / ps) + f - start_i`` of lane i's row (``list_lane``), or with
# ``cache`` column ``ceil(L_i / ps) - 1 - (f - start_i)`` (the row's last page
# first), so list order is the reference's (lane, column) order; each pass recomputes an entry
# from the inputs, the claims and the lengths, which change only in the last
# pass. Four passes over the
# entries run the pool's ``free`` (reset the pages' scratch; claim; apply to
# first occurrences, with ``cache`` last ones, pushes placed by a running prefix sum; restore the scratch
# and reset the entries), then each valid lane writes its length and, after a
# barrier, every named row's claim is restored (write-only).


@triton.jit
def _lanes(ids_ptr, new_lens_ptr, i, B, claim_ptr, seq_lens_ptr, R, limit, HAS_LENS: tl.constexpr):
    """``(row, valid, pad, live, length, act, keep, corrupt)``: act = the lane drops its tail past
    ``keep`` tokens; corrupt = a valid lane whose length is outside ``[0, limit]`` (left alone)."""
    r, valid, pad, live = request_lanes(ids_ptr, i, B, claim_ptr, R)
    length = tl.load(seq_lens_ptr + r, mask=valid, other=0)
    corrupt = valid & ((length < 0) | (length > limit))
    if HAS_LENS:
        keep = tl.load(new_lens_ptr + i, mask=valid, other=0)
        act = valid & ~corrupt & (keep >= 0) & (keep <= length)
    else:
        keep = tl.zeros_like(length)
        act = valid & ~corrupt
    return r, valid, pad, live, length, act, keep, corrupt


@triton.jit
def _dropped(f, total, lane_end_ptr, SEARCH, ids_ptr, new_lens_ptr, B, claim_ptr, seq_lens_ptr, block_table_ptr,
             R, MP, page_size, HAS_LENS: tl.constexpr, REVERSE: tl.constexpr):
    """List entries ``f``: ``(table cell, page, dropped?)``; cell = row * MP + column, int64. REVERSE: each
    lane's entries from its row's last page down (a release into the cache, so the last pages are evicted
    first)."""
    live = f < total
    i, start = list_lane(f, live, lane_end_ptr, B, SEARCH)
    r, _, _, _, length, act, keep, _c = _lanes(ids_ptr, new_lens_ptr, i, B, claim_ptr, seq_lens_ptr, R,
                                                MP * page_size, HAS_LENS)
    if REVERSE:
        k = cdiv(length, page_size) - 1 - (f - start)
    else:
        k = cdiv(keep, page_size) + f - start
    drop = live & act & (k < cdiv(length, page_size)) & (k < MP)
    cell = r.to(tl.int64) * MP + k
    return cell, tl.load(block_table_ptr + cell, mask=drop, other=NULL_PAGE), drop


@triton.jit
def release_kernel(
    req_ids_ptr,      # *int32 [B]: request ids, -1 = padding
    new_lens_ptr,     # *int32 [B]: new lengths (HAS_LENS only)
    B,                # batch size
    block_table_ptr,  # *int32 [R, MP]
    seq_lens_ptr,     # *int32 [R]
    claim_ptr,        # *int32 [R] scratch, INT32_MAX between calls
    free_stack_ptr,   # *int32 [P]
    refcount_ptr,     # *int32 [P]
    page_state_ptr,   # *int8 [P]
    stamp_ptr,        # *int64 [P]
    page_gen_ptr,     # *int32 [P]
    counters_ptr,     # *int64 [NUM_COUNTERS]
    page_claim_ptr,   # *int32 [P] scratch, INT32_MAX between calls
    occur_ptr,        # *int32 [P] scratch, 0 between calls
    lane_end_ptr,     # *int32 [>= B] scratch: running end of each lane's dropped pages
    lru_queue_ptr,    # *int32 [Q]: the LRU queue (CACHE)
    lru_pos_ptr,      # *int64 [P]
    R,                # rows of block_table
    MP,               # columns of block_table
    num_pages,        # P
    queue_len,        # Q = LRU_FACTOR * P
    page_size,        # tokens per page
    SEARCH,           # B.bit_length(): steps of the lane search
    # Meta-parameters
    HAS_LENS: tl.constexpr,  # truncate to new_lens (else release: length 0)
    CACHE: tl.constexpr,     # pages reaching 0 references become CACHED (else FREE)
    BLOCK: tl.constexpr,     # lanes / entries per chunk
):
    """Free block_table[r_i, cdiv(keep_i, ps):cdiv(L_i, ps)] as one pool free in (lane, column) order (CACHE:
    each lane's columns descending); L_i = keep_i."""
    lanes = tl.arange(0, BLOCK)
    c = load_counters(counters_ptr)
    c, clock = tick(c)
    if CACHE:
        if B > 0:  # (an empty batch touches nothing)
            c = lru_prepare(c, lru_queue_ptr, lru_pos_ptr, page_state_ptr, num_pages, queue_len, BLOCK)
    head = counter_get(c, LRU_HEAD)
    tail = counter_get(c, LRU_TAIL)
    lost = tl.zeros((), tl.int64)
    claim_requests(req_ids_ptr, B, claim_ptr, R, BLOCK)
    tl.debug_barrier()
    bad = tl.zeros((), tl.int64)
    bad_len = tl.zeros((), tl.int64)
    wrong = tl.zeros((), tl.int64)  # lanes with a corrupt length
    total = tl.zeros((), tl.int32)  # entries of the dropped-page list
    for start in range(0, B, BLOCK):
        i = start + lanes
        _, valid, pad, live, length, act, keep, corrupt = _lanes(req_ids_ptr, new_lens_ptr, i, B, claim_ptr,
                                                                 seq_lens_ptr, R, MP * page_size, HAS_LENS)
        bad += tl.sum((live & ~pad & ~valid).to(tl.int64))
        bad_len += tl.sum((valid & ~corrupt & ~act).to(tl.int64))
        wrong += tl.sum(corrupt.to(tl.int64))
        n = tl.where(act, cdiv(length, page_size) - cdiv(keep, page_size), 0)
        tl.store(lane_end_ptr + i, total + tl.cumsum(n, 0), mask=live)
        total += tl.sum(n)
    tl.debug_barrier()
    for start in range(0, total, BLOCK):  # the pages' scratch reset first (see _triton_util's module note)
        f = start + lanes
        _, p, drop = _dropped(f, total, lane_end_ptr, SEARCH, req_ids_ptr, new_lens_ptr, B, claim_ptr,
                              seq_lens_ptr, block_table_ptr, R, MP, page_size, HAS_LENS, CACHE)
        reset_pages(p, drop, page_claim_ptr, occur_ptr, num_pages)
    tl.debug_barrier()
    invalid = tl.zeros((), tl.int64)
    for start in range(0, total, BLOCK):
        f = start + lanes
        _, p, drop = _dropped(f, total, lane_end_ptr, SEARCH, req_ids_ptr, new_lens_ptr, B, claim_ptr,
                              seq_lens_ptr, block_table_ptr, R, MP, page_size, HAS_LENS, CACHE)
        invalid += claim_pages(p, f, drop, page_claim_ptr, occur_ptr, num_pages, CACHE)
    tl.debug_barrier()
    top = counter_get(c, FREE_COUNT)
    double = tl.zeros((), tl.int64)
    released = tl.zeros((), tl.int64)
    pushed = tl.zeros((), tl.int64)
    for start in range(0, total, BLOCK):
        f = start + lanes
        _, p, drop = _dropped(f, total, lane_end_ptr, SEARCH, req_ids_ptr, new_lens_ptr, B, claim_ptr,
                              seq_lens_ptr, block_table_ptr, R, MP, page_size, HAS_LENS, CACHE)
        first, k = first_pages(p, f, drop, page_claim_ptr, occur_ptr, num_pages, CACHE)
        dbl, rel, push, tail, gone = apply_free(p, first, k, top + released, clock, free_stack_ptr, refcount_ptr,
                                                page_state_ptr, stamp_ptr, page_gen_ptr, num_pages, head, tail,
                                                lru_queue_ptr, lru_pos_ptr, queue_len, CACHE, BLOCK)
        lost += gone
        double += dbl
        released += rel
        pushed += push
    tl.debug_barrier()
    for start in range(0, total, BLOCK):
        f = start + lanes
        cell, p, drop = _dropped(f, total, lane_end_ptr, SEARCH, req_ids_ptr, new_lens_ptr, B, claim_ptr,
                                 seq_lens_ptr, block_table_ptr, R, MP, page_size, HAS_LENS, CACHE)
        reset_pages(p, drop, page_claim_ptr, occur_ptr, num_pages)
        # Every lane has read its cell (in _dropped) before any is cleared: a lane's load and its store
        # may run on two threads (Triton lays them out differently), which only a barrier orders.
        tl.debug_barrier()
        tl.store(block_table_ptr + cell, tl.full((BLOCK,), NULL_PAGE, tl.int32), mask=drop)
    tl.debug_barrier()  # every pass above reads the claims and the lengths
    for start in range(0, B, BLOCK):
        i = start + lanes
        r, valid, _, _, _, act, keep, _c = _lanes(req_ids_ptr, new_lens_ptr, i, B, claim_ptr, seq_lens_ptr, R,
                                                  MP * page_size, HAS_LENS)
        tl.store(seq_lens_ptr + r, keep, mask=act)
    tl.debug_barrier()  # every lane has read its claim (in _lanes) before any is reset
    reset_requests(req_ids_ptr, B, claim_ptr, R, BLOCK)
    c = counter_add(c, ERR_BAD_REQUEST, bad)
    c = counter_add(c, ERR_BAD_LENGTH, bad_len)
    c = counter_add(c, ERR_CORRUPT_STATE, wrong)
    c = count_freed(c, invalid, double, released, pushed, tail, lost, B > 0, lru_queue_ptr, lru_pos_ptr,
                    page_state_ptr, num_pages, queue_len, CACHE, BLOCK)
    store_counters(counters_ptr, c)


def _launch(req_ids, new_lens, cache, st, ts) -> None:
    B = req_ids.numel()
    check_lane_scratch(B, ts)
    R, MP = ts.block_table.shape
    release_kernel[(1,)](
        req_ids, req_ids if new_lens is None else new_lens, B, ts.block_table, ts.seq_lens, ts.claim,
        st.free_stack, st.refcount, st.page_state, st.stamp, st.page_gen, st.counters, st.claim, st.occur,
        ts.lane_end, st.lru_queue, st.lru_pos,
        R, MP, st.num_pages, st.lru_queue.numel(), ts.page_size, B.bit_length(),
        HAS_LENS=new_lens is not None, CACHE=bool(cache), **queue_settings(max(B, B * MP), st, cache),
    )


def release_triton(req_ids, cache, st, ts) -> None:
    """Drop every page of requests ``req_ids``, lengths to 0 (one launch; see module note)."""
    _launch(req_ids, None, cache, st, ts)


def truncate_triton(req_ids, new_lens, st, ts) -> None:
    """Roll requests ``req_ids`` back to ``new_lens`` tokens (one launch; see module note).

    The caller refuses lanes that would end inside a shared page beforehand (the triton
    backend gives them length -1), since the kernel's own frees change the reference counts.
    """
    _launch(req_ids, new_lens, False, st, ts)
