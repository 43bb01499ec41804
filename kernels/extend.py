"""extend: append tokens to requests, taking new pages from the pool in the same pass.

Lane ``i`` appends ``n_i`` tokens to request ``r_i``; it needs
``ceil((L+n)/ps) - ceil(L/ps)`` pages, granted first come first served over
the lanes and popped from the free stack in lane order. Slots are laid out in
lane order (``n_i`` per lane, -1 for padding and failed lanes, -1 past the
total). Misuse (bad or repeated request id, negative count, more than
``max_pages`` pages, too small a slot buffer) is counted and the lane fails.
"""

import numba

from . import layout as L
from ._numba_util import claim_requests, i32_array, lane_valid, pop_page, reset_claims, u8_array, update_peaks


@numba.njit(nogil=True)
def extend_numba(
    req_ids_ptr,  # address of int32 [B], request ids, -1 = padding
    ntok_ptr,     # address of int32 [B], tokens to append per lane
    B,            # batch size
    slots_ptr,    # address of int32 [T], slot of every new token, -1 padded
    T,            # slot capacity
    ok_ptr,       # address of bool [B], lane granted
    page_size,    # tokens per page
    block_table,  # int32 [R, MP]
    seq_lens,     # int32 [R]
    claim,        # int32 [R] scratch
    free_stack,   # int32 [P]
    refcount,     # int32 [P]
    page_state,   # int8 [P]
    counters,     # int64 [NUM_COUNTERS]
):
    ids, ntok = i32_array(req_ids_ptr, B), i32_array(ntok_ptr, B)
    slots, ok = i32_array(slots_ptr, T), u8_array(ok_ptr, B)
    R, MP = block_table.shape[0], block_table.shape[1]
    counters[L.CLOCK] += 1
    claim_requests(ids, R, claim, counters, True)
    free = counters[L.FREE_COUNT]
    csum = 0
    popped = 0
    tok = 0
    for i in range(B):
        n = ntok[i]
        valid = lane_valid(ids, i, R, claim)
        if valid and n < 0:
            counters[L.ERR_BAD_COUNT] += 1
            valid = False
        n = max(n, 0)
        start = tok
        tok += n
        granted = False
        if valid:
            r = ids[i]
            length = seq_lens[r]
            have = (length + page_size - 1) // page_size
            want = (length + n + page_size - 1) // page_size
            if want > MP:
                counters[L.ERR_TABLE_OVERFLOW] += 1
            else:
                csum += want - have
                if csum <= free:
                    if tok <= T:
                        granted = True
                    else:
                        counters[L.ERR_OUT_OVERFLOW] += 1
        if granted:
            for k in range(have, want):
                block_table[r, k] = pop_page(popped, free_stack, refcount, page_state, counters)
                popped += 1
            for t in range(n):
                pos = length + t
                slots[start + t] = block_table[r, pos // page_size] * page_size + pos % page_size
            seq_lens[r] = length + n
        else:
            if ids[i] != L.NULL_PAGE:
                counters[L.FAILED_REQUESTS] += 1
            for u in range(start, min(tok, T)):
                slots[u] = L.NULL_PAGE
        ok[i] = granted
    for u in range(tok, T):
        slots[u] = L.NULL_PAGE
    reset_claims(ids, R, claim)
    counters[L.FREE_COUNT] -= popped
    counters[L.ALLOCATED] += popped
    update_peaks(counters, refcount.shape[0])
