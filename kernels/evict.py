"""evict: free the k least recently stamped cached pages, oldest first.

Order: ascending ``(stamp, page id)``. Evicted pages are returned in that
order (padded with -1) and pushed on the free stack in that order.
"""

import numba
import numpy as np

from . import layout as L
from ._numba_util import i32_array, update_peaks


@numba.njit(nogil=True)
def evict_oldest(n, out, free_stack, page_state, stamp, counters, keys):
    """Evict ``min(n, cached)`` pages into ``out[:m]``; pad the rest of ``out`` with -1."""
    P = page_state.shape[0]
    m = 0
    if n > 0 and counters[L.CACHED_COUNT] > 0:
        cnt = 0
        for i in range(P):
            if page_state[i] == L.CACHED:
                keys[cnt] = stamp[i] * P + i
                cnt += 1
        m = min(n, cnt, out.shape[0])
        if m < cnt:
            sel = np.sort(np.partition(keys[:cnt], m - 1)[:m])
        else:
            sel = np.sort(keys[:cnt])
        top = counters[L.FREE_COUNT]
        for r in range(m):
            p = sel[r] % P
            out[r] = p
            page_state[p] = L.FREE
            free_stack[top + r] = p
        counters[L.FREE_COUNT] = top + m
        counters[L.CACHED_COUNT] -= m
        counters[L.EVICTED] += m
    for r in range(m, out.shape[0]):
        out[r] = L.NULL_PAGE


@numba.njit(nogil=True)
def evict_numba(
    out_ptr,     # address of int32 [K], evicted ids oldest first, -1 padded
    K,           # number of pages to evict at most
    free_stack,  # int32 [P]
    page_state,  # int8 [P]
    stamp,       # int64 [P]
    counters,    # int64 [NUM_COUNTERS]
    keys,        # int64 [P] scratch
):
    counters[L.CLOCK] += 1
    evict_oldest(K, i32_array(out_ptr, K), free_stack, page_state, stamp, counters, keys)
    update_peaks(counters, page_state.shape[0])
