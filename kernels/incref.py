"""incref: add one reference per entry (prefix sharing, prefix-cache hits).

A USED page gains ``k`` references; a CACHED page is revived (USED with
``k`` references, counted in ``revived``); a FREE page is ``use_after_free``
per entry. ``-1`` is padding; other ids outside ``[0, P)`` count ``invalid_page``.
"""

import numba

from . import layout as L
from ._numba_util import count_lanes, i32_array, update_peaks


@numba.njit(nogil=True)
def incref_numba(
    pages_ptr,   # address of int32 [N], pages to reference, -1 padded
    N,           # number of entries
    refcount,    # int32 [P]
    page_state,  # int8 [P]
    counters,    # int64 [NUM_COUNTERS]
    occur,       # int32 [P] scratch, zero between calls
):
    pages = i32_array(pages_ptr, N)
    P = refcount.shape[0]
    counters[L.CLOCK] += 1
    count_lanes(pages, P, occur, counters)
    for i in range(N):
        p = pages[i]
        if p < 0 or p >= P or occur[p] == 0:
            continue
        k = occur[p]
        occur[p] = 0
        state = page_state[p]
        if state == L.FREE:
            counters[L.ERR_USE_AFTER_FREE] += k
            continue
        if state == L.CACHED:
            page_state[p] = L.USED
            counters[L.CACHED_COUNT] -= 1
            counters[L.REVIVED] += 1
        refcount[p] += k
    update_peaks(counters, P)
