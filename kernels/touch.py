"""touch: stamp USED and CACHED pages with the clock (LRU refresh); CACHED ones go to the LRU queue's tail.

A FREE page is ``use_after_free`` per entry, a page in no known state
``corrupt_state`` per entry (not stamped); ``-1`` is padding; other ids
outside ``[0, P)`` count ``invalid_page``.
"""

import numba
from ._triton_shim import tl, triton

from . import layout as L
from . import _numba_util as nu
from ._numba_util import i32_array, state_arrays
from ._triton_util import (CACHED, ERR_CORRUPT_STATE, ERR_INVALID_PAGE, ERR_USE_AFTER_FREE, FREE, LRU_HEAD,
                           LRU_TAIL, USED, count_pages, counter_add, counter_get, first_lanes, load_counters,
                           lru_prepare, lru_push, lru_pushed, queue_settings, reset_lanes, store_counters, tick)


@numba.njit(nogil=True)
def touch_numba(
    pages_ptr,   # address of int32 [N], pages to stamp, -1 padded
    N,           # number of entries
    page_state,  # int8 [P]
    stamp,       # int64 [P]
    counters,    # int64 [NUM_COUNTERS]
    occur,       # int32 [P] scratch, zero between calls
    lru_queue,   # int32 [LRU_FACTOR * P]
    lru_pos,     # int64 [P]
):
    pages = i32_array(pages_ptr, N)
    P = page_state.shape[0]
    counters[L.CLOCK] += 1
    clock = counters[L.CLOCK]
    tail = nu.lru_prepare(lru_queue, lru_pos, page_state, counters)
    nu.count_pages(pages, P, occur, counters)
    for i in range(N):
        p = pages[i]
        if p < 0 or p >= P or occur[p] == 0:
            continue
        k = occur[p]
        occur[p] = 0
        if page_state[p] == L.FREE:
            counters[L.ERR_USE_AFTER_FREE] += k
        elif page_state[p] == L.USED:
            stamp[p] = clock
        elif page_state[p] == L.CACHED:
            stamp[p] = clock
            nu.lru_push(p, lru_queue, lru_pos, counters)
        else:
            counters[L.ERR_CORRUPT_STATE] += k
    nu.lru_clean(lru_queue, lru_pos, page_state, counters, counters[L.LRU_TAIL] - tail)


@numba.njit(nogil=True)
def touch_numba_entry(pages_ptr, N, sd):
    """``touch_numba`` with the state passed as a descriptor (fast dispatch)."""
    _, _, state, stamp, counters, occur, _ = state_arrays(sd)
    touch_numba(pages_ptr, N, state, stamp, counters, occur, *nu.lru_arrays(sd))


# ---------------------------------------------------------------------- Triton
# One program: claim / apply (first occurrences only) / release, as in free.


@triton.jit
def touch_kernel(
    pages_ptr,       # *int32 [N]: pages to stamp, -1 padded
    n_pages,         # N
    page_state_ptr,  # *int8 [P]
    stamp_ptr,       # *int64 [P]
    counters_ptr,    # *int64 [NUM_COUNTERS]
    claim_ptr,       # *int32 [P] scratch, INT32_MAX between calls
    occur_ptr,       # *int32 [P] scratch, 0 between calls
    lru_queue_ptr,   # *int32 [Q]: the LRU queue
    lru_pos_ptr,     # *int64 [P]
    num_pages,       # P
    queue_len,       # Q = LRU_FACTOR * P
    # Meta-parameters
    BLOCK: tl.constexpr,  # lanes per chunk
):
    """stamp[p] = clock for each distinct USED/CACHED page named, CACHED ones queued again at the LRU tail;
    a FREE page named k times: k use-after-free; a page in no known state named k times: k corrupt_state."""
    c = load_counters(counters_ptr)
    c, clock = tick(c)
    c = lru_prepare(c, lru_queue_ptr, lru_pos_ptr, page_state_ptr, num_pages, queue_len, BLOCK)
    head = counter_get(c, LRU_HEAD)
    tail = counter_get(c, LRU_TAIL)
    lost = tl.zeros((), tl.int64)
    invalid = count_pages(pages_ptr, n_pages, claim_ptr, occur_ptr, num_pages, BLOCK, False)
    tl.debug_barrier()
    uaf = tl.zeros((), tl.int64)
    wrong = tl.zeros((), tl.int64)
    for start in range(0, n_pages, BLOCK):
        p, first, k = first_lanes(pages_ptr, start, n_pages, claim_ptr, occur_ptr, num_pages, BLOCK, False)
        state = tl.load(page_state_ptr + p, mask=first, other=FREE)
        known = (state == USED) | (state == CACHED)
        uaf += tl.sum(tl.where(first & (state == FREE), k, 0).to(tl.int64))
        wrong += tl.sum(tl.where(first & (state != FREE) & ~known, k, 0).to(tl.int64))
        tl.store(stamp_ptr + p, tl.zeros((BLOCK,), tl.int64) + clock, mask=first & known)
        tail, gone = lru_push(p, first & (state == CACHED), head, tail, lru_queue_ptr, lru_pos_ptr, queue_len)
        lost += gone
    tl.debug_barrier()
    reset_lanes(pages_ptr, n_pages, claim_ptr, occur_ptr, num_pages, BLOCK)
    c = counter_add(c, ERR_INVALID_PAGE, invalid)
    c = counter_add(c, ERR_USE_AFTER_FREE, uaf)
    c = counter_add(c, ERR_CORRUPT_STATE, wrong)
    c = lru_pushed(c, tail, lost, True, lru_queue_ptr, lru_pos_ptr, page_state_ptr, num_pages, queue_len, BLOCK)
    store_counters(counters_ptr, c)


def touch_triton(st, pages) -> None:
    """Stamp the USED and CACHED pages of ``pages`` with the clock (one launch; see module note)."""
    touch_kernel[(1,)](
        pages, pages.numel(), st.page_state, st.stamp, st.counters, st.claim, st.occur, st.lru_queue, st.lru_pos,
        st.num_pages, st.lru_queue.numel(), **queue_settings(pages.numel(), st),
    )
