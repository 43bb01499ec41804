"""free: drop one reference per entry; pages reaching 0 go FREE or CACHED.

Per distinct page named ``k`` times: ``d = min(k, refcount)`` references are
dropped and ``k - d`` entries count as ``double_free`` (all ``k`` when the page
is not USED). Pages reaching 0 are pushed on the free stack in the order of
their first occurrence, or with ``cache`` become CACHED stamped with the
clock. ``-1`` is padding; other ids outside ``[0, P)`` count ``invalid_page``.
"""

import numba

from . import layout as L
from ._numba_util import count_lanes, i32_array, update_peaks


@numba.njit(nogil=True)
def free_numba(
    pages_ptr,   # address of int32 [N], pages to release, -1 padded
    N,           # number of entries
    cache,       # bool, keep released pages as CACHED
    free_stack,  # int32 [P]
    refcount,    # int32 [P]
    page_state,  # int8 [P]
    stamp,       # int64 [P]
    counters,    # int64 [NUM_COUNTERS]
    occur,       # int32 [P] scratch, zero between calls
):
    pages = i32_array(pages_ptr, N)
    P = refcount.shape[0]
    counters[L.CLOCK] += 1
    clock = counters[L.CLOCK]
    count_lanes(pages, P, occur, counters)
    top = counters[L.FREE_COUNT]
    released = 0
    for i in range(N):
        p = pages[i]
        if p < 0 or p >= P or occur[p] == 0:
            continue  # padding, invalid, or not the first occurrence
        k = occur[p]
        occur[p] = 0
        if page_state[p] != L.USED:
            counters[L.ERR_DOUBLE_FREE] += k
            continue
        rc = refcount[p]
        d = min(k, rc)
        counters[L.ERR_DOUBLE_FREE] += k - d
        refcount[p] = rc - d
        if rc == d:
            released += 1
            if cache:
                page_state[p] = L.CACHED
                stamp[p] = clock
            else:
                page_state[p] = L.FREE
                free_stack[top] = p
                top += 1
    counters[L.FREED] += released
    if cache:
        counters[L.CACHED_COUNT] += released
    counters[L.FREE_COUNT] = top
    update_peaks(counters, P)
