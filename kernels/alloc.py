"""alloc: grant pages to a batch of requests, first come first served.

Request ``i`` is granted iff no count in ``counts[:i+1]`` is negative and the
inclusive prefix sum of counts is at most the available pages (free, plus
cached with ``evict``) and at most the output capacity ``M``. Granted pages
are popped from the top of the free stack in request order; entries of
``pages`` past the total are -1; ``indptr`` (``[BO+1]``) and ``ok``
(``[BO]``) are padded past ``B`` with the total and False.
"""

import numba

from . import layout as L
from ._numba_util import i32_array, u8_array, update_peaks
from .evict import evict_oldest


@numba.njit(nogil=True)
def alloc_numba(
    counts_ptr,   # address of int32 [B], pages wanted per request
    B,            # batch size
    pages_ptr,    # address of int32 [M], granted pages, -1 padded
    M,            # output capacity in pages
    indptr_ptr,   # address of int32 [BO + 1], offsets of each request's pages
    ok_ptr,       # address of bool [BO], request granted
    BO,           # output batch capacity, BO >= B
    evicted_ptr,  # address of int32 [M], pages evicted to cover the shortfall
    evict,        # bool, may evict cached pages
    free_stack,   # int32 [P]
    refcount,     # int32 [P]
    page_state,   # int8 [P]
    stamp,        # int64 [P]
    counters,     # int64 [NUM_COUNTERS]
    keys,         # int64 [P] scratch for eviction
):
    counts = i32_array(counts_ptr, B)
    pages = i32_array(pages_ptr, M)
    indptr = i32_array(indptr_ptr, BO + 1)
    ok = u8_array(ok_ptr, BO)
    evicted = i32_array(evicted_ptr, M)
    counters[L.CLOCK] += 1
    free = counters[L.FREE_COUNT]
    avail = free + counters[L.CACHED_COUNT] if evict else free
    bad = False
    csum = 0
    total = 0
    indptr[0] = 0
    for i in range(B):
        n = counts[i]
        if n < 0:
            counters[L.ERR_BAD_COUNT] += 1
            bad = True
        else:
            csum += n
        fits = (not bad) and csum <= avail
        granted = fits and csum <= M
        if granted:
            total = csum
        else:
            counters[L.FAILED_REQUESTS] += 1
            if fits:
                counters[L.ERR_OUT_OVERFLOW] += 1
        ok[i] = granted
        indptr[i + 1] = total
    for i in range(B, BO):
        ok[i] = False
        indptr[i + 1] = total
    evict_oldest(total - free if evict else 0, evicted, free_stack, page_state, stamp, counters, keys)
    top = counters[L.FREE_COUNT] - 1
    for j in range(total):
        p = free_stack[top - j]
        pages[j] = p
        refcount[p] = 1
        page_state[p] = L.USED
    for j in range(total, M):
        pages[j] = L.NULL_PAGE
    counters[L.FREE_COUNT] -= total
    counters[L.ALLOCATED] += total
    update_peaks(counters, page_state.shape[0])
