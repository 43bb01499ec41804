"""touch: stamp USED and CACHED pages with the clock (LRU refresh).

A FREE page is ``use_after_free`` per entry; ``-1`` is padding; other ids
outside ``[0, P)`` count ``invalid_page``.
"""

import numba

from . import layout as L
from ._numba_util import count_lanes, i32_array


@numba.njit(nogil=True)
def touch_numba(
    pages_ptr,   # address of int32 [N], pages to stamp, -1 padded
    N,           # number of entries
    page_state,  # int8 [P]
    stamp,       # int64 [P]
    counters,    # int64 [NUM_COUNTERS]
    occur,       # int32 [P] scratch, zero between calls
):
    pages = i32_array(pages_ptr, N)
    P = page_state.shape[0]
    counters[L.CLOCK] += 1
    clock = counters[L.CLOCK]
    count_lanes(pages, P, occur, counters)
    for i in range(N):
        p = pages[i]
        if p < 0 or p >= P or occur[p] == 0:
            continue
        k = occur[p]
        occur[p] = 0
        if page_state[p] == L.FREE:
            counters[L.ERR_USE_AFTER_FREE] += k
        else:
            stamp[p] = clock
