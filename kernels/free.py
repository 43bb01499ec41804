"""free: drop one reference per entry; pages reaching 0 go FREE or CACHED.

Per distinct page named ``k`` times: ``d = min(k, refcount)`` references are
dropped and ``k - d`` entries count as ``double_free`` (all ``k`` when the page
is not USED). Pages reaching 0 are pushed on the free stack in the order of
their first occurrence (FREE, their generation bumped), or with ``cache`` become
CACHED stamped with the clock, on the LRU queue in the order of their LAST
occurrence (a page shared by rows released together after every row's deeper
pages: leaves are evicted first). ``-1`` is padding; other ids
outside ``[0, P)`` count ``invalid_page``.
"""

import numba
from ._triton_shim import tl, triton

from . import layout as L
from . import _numba_util as nu
from ._numba_util import i32_array, page_gens, state_arrays
from ._triton_util import (FREE_COUNT, LRU_HEAD, LRU_TAIL, apply_free, count_freed, count_pages, counter_get,
                           first_lanes, load_counters, lru_prepare, queue_settings, reset_lanes, store_counters,
                           tick)


@numba.njit(nogil=True)
def free_numba(
    pages_ptr,   # address of int32 [N], pages to release, -1 padded
    N,           # number of entries
    cache,       # bool, keep released pages as CACHED
    free_stack,  # int32 [P]
    refcount,    # int32 [P]
    page_state,  # int8 [P]
    stamp,       # int64 [P]
    page_gen,    # int32 [P]
    counters,    # int64 [NUM_COUNTERS]
    occur,       # int32 [P] scratch, zero between calls
    lru_queue,   # int32 [LRU_FACTOR * P]
    lru_pos,     # int64 [P]
):
    counters[L.CLOCK] += 1
    n = nu.padded_tail_start(i32_array(pages_ptr, N)) if N >= nu.TAIL_BLOCK else N
    nu.apply_free(i32_array(pages_ptr, n), cache, counters[L.CLOCK], free_stack, refcount, page_state, stamp,
                  page_gen, counters, occur, lru_queue, lru_pos)


@numba.njit(nogil=True)
def free_numba_entry(pages_ptr, N, cache, sd):
    """``free_numba`` with the state passed as a descriptor (fast dispatch)."""
    stack, rc, state, stamp, counters, occur, _ = state_arrays(sd)
    free_numba(pages_ptr, N, cache, stack, rc, state, stamp, page_gens(sd), counters, occur, *nu.lru_arrays(sd))


# ---------------------------------------------------------------------- Triton
# One program, three passes over the entries: claim (the pages' scratch reset,
# then first lane, with CACHE last lane, and occurrences per page), apply (those
# lanes only; released pages take stack slots from a running prefix sum, in
# first-occurrence order, or LRU entries from the tail in last-occurrence order),
# release (scratch back to INT32_MAX / 0). Barriers
# separate the passes.


@triton.jit
def free_kernel(
    pages_ptr,       # *int32 [N]: pages to release, -1 padded
    n_pages,         # N
    free_stack_ptr,  # *int32 [P]
    refcount_ptr,    # *int32 [P]
    page_state_ptr,  # *int8 [P]
    stamp_ptr,       # *int64 [P]
    page_gen_ptr,    # *int32 [P]
    counters_ptr,    # *int64 [NUM_COUNTERS]
    claim_ptr,       # *int32 [P] scratch, INT32_MAX between calls
    occur_ptr,       # *int32 [P] scratch, 0 between calls
    lru_queue_ptr,   # *int32 [Q]: the LRU queue (CACHE)
    lru_pos_ptr,     # *int64 [P]
    num_pages,       # P
    queue_len,       # Q = LRU_FACTOR * P
    # Meta-parameters
    CACHE: tl.constexpr,  # released pages become CACHED (stamped, queued) instead of FREE
    BLOCK: tl.constexpr,  # lanes per chunk
):
    """Per distinct page named k times: refcount -= d = min(k, refcount); k - d double frees; 0 -> FREE/CACHED."""
    c = load_counters(counters_ptr)
    c, clock = tick(c)
    if CACHE:
        c = lru_prepare(c, lru_queue_ptr, lru_pos_ptr, page_state_ptr, num_pages, queue_len, BLOCK)
    head = counter_get(c, LRU_HEAD)
    tail = counter_get(c, LRU_TAIL)
    lost = tl.zeros((), tl.int64)
    invalid = count_pages(pages_ptr, n_pages, claim_ptr, occur_ptr, num_pages, BLOCK, CACHE)
    tl.debug_barrier()
    top = counter_get(c, FREE_COUNT)
    double = tl.zeros((), tl.int64)
    released = tl.zeros((), tl.int64)
    pushed = tl.zeros((), tl.int64)
    for start in range(0, n_pages, BLOCK):
        p, first, k = first_lanes(pages_ptr, start, n_pages, claim_ptr, occur_ptr, num_pages, BLOCK, CACHE)
        dbl, rel, push, tail, gone = apply_free(p, first, k, top + released, clock, free_stack_ptr, refcount_ptr,
                                                page_state_ptr, stamp_ptr, page_gen_ptr, num_pages, head, tail,
                                                lru_queue_ptr, lru_pos_ptr, queue_len, CACHE, BLOCK)
        lost += gone
        double += dbl
        released += rel
        pushed += push
    tl.debug_barrier()
    reset_lanes(pages_ptr, n_pages, claim_ptr, occur_ptr, num_pages, BLOCK)
    c = count_freed(c, invalid, double, released, pushed, tail, lost, True, lru_queue_ptr, lru_pos_ptr,
                    page_state_ptr, num_pages, queue_len, CACHE, BLOCK)
    store_counters(counters_ptr, c)


def free_triton(st, pages, cache) -> None:
    """Drop one reference per entry of ``pages`` (one launch; see module note)."""
    free_kernel[(1,)](
        pages, pages.numel(), st.free_stack, st.refcount, st.page_state, st.stamp, st.page_gen, st.counters,
        st.claim, st.occur, st.lru_queue, st.lru_pos, st.num_pages, st.lru_queue.numel(),
        CACHE=bool(cache), **queue_settings(pages.numel(), st, cache),
    )
