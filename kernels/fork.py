"""fork: an empty request ``dst`` shares the first ``lens`` tokens of ``src``.

Whole pages are shared (one more reference each); a partial last page gets a
fresh page, popped from the free stack in lane order (first come first
served), and ``(src page, dst page)`` is returned for the KV copy. Padding:
``dst == -1``. A bad ``src``/``dst`` (out of range, ``dst`` repeated, not
empty, or equal to ``src``) is ``bad_request``; ``lens`` outside
``[0, len(src)]`` is ``bad_length``.
"""

import numba

from . import layout as L
from ._numba_util import claim_requests, i32_array, lane_valid, pop_page, reset_claims, u8_array, update_peaks


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
    R = block_table.shape[0]
    counters[L.CLOCK] += 1
    claim_requests(dst, R, claim, counters, False)
    free = counters[L.FREE_COUNT]
    csum = 0
    for i in range(B):  # decide every lane on the state at call start
        granted = False
        d, s, n = dst[i], src[i], lens[i]
        if d != L.NULL_PAGE:
            if not (lane_valid(dst, i, R, claim) and s >= 0 and s < R and s != d and seq_lens[d] == 0):
                counters[L.ERR_BAD_REQUEST] += 1
            elif n < 0 or n > seq_lens[s]:
                counters[L.ERR_BAD_LENGTH] += 1
            else:
                csum += 1 if n % page_size != 0 else 0
                granted = csum <= free
            if not granted:
                counters[L.FAILED_REQUESTS] += 1
        ok[i] = granted
    popped = 0
    for i in range(B):
        cow_src[i] = L.NULL_PAGE
        cow_dst[i] = L.NULL_PAGE
        if not ok[i]:
            continue
        d, s, n = dst[i], src[i], lens[i]
        full = n // page_size
        for k in range(full):
            p = block_table[s, k]
            state = page_state[p]
            if state == L.FREE:
                counters[L.ERR_USE_AFTER_FREE] += 1
                continue
            if state == L.CACHED:
                page_state[p] = L.USED
                counters[L.CACHED_COUNT] -= 1
                counters[L.REVIVED] += 1
            refcount[p] += 1
            block_table[d, k] = p
        if n % page_size != 0:
            new = pop_page(popped, free_stack, refcount, page_state, counters)
            popped += 1
            block_table[d, full] = new
            cow_src[i] = block_table[s, full]
            cow_dst[i] = new
        seq_lens[d] = n
    reset_claims(dst, R, claim)
    counters[L.FREE_COUNT] -= popped
    counters[L.ALLOCATED] += popped
    update_peaks(counters, refcount.shape[0])
