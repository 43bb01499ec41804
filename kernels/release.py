"""release / truncate: free the pages of requests past a new length (0 for release).

The pages dropped by one call are freed as ONE ``free`` over the lanes' pages,
lane by lane in table order (so a page shared by two released requests loses
two references, and pushes follow first occurrence). Their table entries
become -1 and the length is set. Truncating to a length above the current one
(or below 0) is ``bad_length`` and leaves that request unchanged.
"""

import numba

from . import layout as L
from ._numba_util import (claim_requests, i32_array, lane_valid, release_page, reset_claims,
                          update_peaks)


@numba.njit(nogil=True)
def _drop_tail(ids, new_lens, use_lens, cache, page_size, block_table, seq_lens, claim,
               free_stack, refcount, page_state, stamp, counters, occur):
    R = block_table.shape[0]
    P = refcount.shape[0]
    counters[L.CLOCK] += 1
    clock = counters[L.CLOCK]
    claim_requests(ids, R, claim, counters, True)
    B = ids.shape[0]
    for i in range(B):  # decide each lane; mark rejected lanes by dropping their claim
        if lane_valid(ids, i, R, claim) and use_lens:
            n = new_lens[i]
            if n < 0 or n > seq_lens[ids[i]]:
                counters[L.ERR_BAD_LENGTH] += 1
                claim[ids[i]] = -1
    for i in range(B):  # pass 1: occurrences of every dropped page
        if lane_valid(ids, i, R, claim):
            r = ids[i]
            keep = (new_lens[i] + page_size - 1) // page_size if use_lens else 0
            for k in range(keep, (seq_lens[r] + page_size - 1) // page_size):
                p = block_table[r, k]
                if p >= 0 and p < P:
                    occur[p] += 1
                else:
                    counters[L.ERR_INVALID_PAGE] += 1
    top = counters[L.FREE_COUNT]
    for i in range(B):  # pass 2: release in order, reset entries
        if lane_valid(ids, i, R, claim):
            r = ids[i]
            keep_tokens = new_lens[i] if use_lens else 0
            keep = (keep_tokens + page_size - 1) // page_size
            for k in range(keep, (seq_lens[r] + page_size - 1) // page_size):
                p = block_table[r, k]
                block_table[r, k] = L.NULL_PAGE
                if p >= 0 and p < P and occur[p] > 0:
                    kk = occur[p]
                    occur[p] = 0
                    top = release_page(p, kk, cache, clock, top, free_stack, refcount, page_state, stamp, counters)
            seq_lens[r] = keep_tokens
    counters[L.FREE_COUNT] = top
    for i in range(B):
        r = ids[i]
        if r >= 0 and r < R:
            claim[r] = 2**31 - 1
    update_peaks(counters, P)


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
    counters,     # int64 [NUM_COUNTERS]
    occur,        # int32 [P] scratch
):
    ids = i32_array(req_ids_ptr, B)
    _drop_tail(ids, ids, False, cache, page_size, block_table, seq_lens, claim,
               free_stack, refcount, page_state, stamp, counters, occur)


@numba.njit(nogil=True)
def truncate_numba(
    req_ids_ptr,  # address of int32 [B], request ids, -1 = padding
    lens_ptr,     # address of int32 [B], new lengths
    B,            # batch size
    page_size,    # tokens per page
    block_table,  # int32 [R, MP]
    seq_lens,     # int32 [R]
    claim,        # int32 [R] scratch
    free_stack,   # int32 [P]
    refcount,     # int32 [P]
    page_state,   # int8 [P]
    stamp,        # int64 [P]
    counters,     # int64 [NUM_COUNTERS]
    occur,        # int32 [P] scratch
):
    _drop_tail(i32_array(req_ids_ptr, B), i32_array(lens_ptr, B), True, False, page_size, block_table,
               seq_lens, claim, free_stack, refcount, page_state, stamp, counters, occur)
