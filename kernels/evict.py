"""evict: free the k least recently used cached pages, oldest first.

Order: the LRU queue's (``layout.LRU_FACTOR``): pages in the order they became
CACHED or were last touched while CACHED, the pages of one call in the order of
their last occurrence in its input when it cached them (``free``/``release``
with ``cache``), of their first when it touched them. With stamps from the clock
alone (no hand edits) that is ascending stamp, ties in that order. Evicted pages
are returned in that order (padded with -1) and pushed on the free stack in
that order; each one's generation is bumped (it became FREE).
"""

import numba
from ._triton_shim import tl, triton

from . import layout as L
from . import _numba_util as nu
from ._numba_util import bump_gen, fill_null_range, i32_array, page_gens, state_arrays
from ._triton_util import (CACHED_COUNT, ERR_CORRUPT_STATE, EVICTED, FREE, FREE_COUNT, LRU_HEAD, LRU_HOLE,
                           LRU_SCAN, LRU_TAIL, NULL_PAGE, bump_gen as t_bump_gen, counter_add, counter_get,
                           counter_set, load_counters, lru_in_bounds, lru_live, queue_settings, store_counters, tick)


@numba.njit(nogil=True)
def evict_oldest_numba(n, out, free_stack, page_state, page_gen, counters, lru_queue, lru_pos):
    """Evict ``min(n, cached, len(out))`` pages into ``out[:m]``; pad the rest of ``out`` with -1.

    The first ``m`` live entries of the LRU queue, read from its head: no pass over the pool.
    Nothing changes until all ``m`` are found; the head then moves past the last one.
    """
    P = page_state.shape[0]
    m = max(0, min(n, counters[L.CACHED_COUNT], out.shape[0])) if n > 0 else 0
    top = counters[L.FREE_COUNT]
    hole, scan, tail = counters[L.LRU_HOLE], counters[L.LRU_SCAN], counters[L.LRU_TAIL]
    found, j = 0, counters[L.LRU_HEAD]
    if m > 0:
        if nu.lru_in_bounds(counters, lru_queue.shape[0]):
            while found < m and j < tail:
                if j == hole and hole < scan:
                    j = scan  # the cleaner's gap is never read
                    continue
                p = nu.lru_live(lru_queue, j, lru_pos, page_state)
                if p >= 0:
                    out[found] = p
                    found += 1
                j += 1
        # Corrupt counts or queue bounds, or fewer live entries than CACHED pages: evict nothing.
        if top < 0 or top > P - m or found < m:  # no sum: it could wrap
            counters[L.ERR_CORRUPT_STATE] += 1
            m = 0
    if m > 0:
        for r in range(m):
            p = out[r]
            page_state[p] = L.FREE
            bump_gen(page_gen, p)
            free_stack[top + r] = p
        counters[L.FREE_COUNT] = top + m
        counters[L.CACHED_COUNT] -= m
        counters[L.EVICTED] += m
        counters[L.LRU_HEAD] = j
        counters[L.LRU_HOLE] = max(hole, j)
        counters[L.LRU_SCAN] = max(scan, j)
    fill_null_range(out.ctypes.data, m, out.shape[0])


@numba.njit(nogil=True)
def evict_numba(
    out_ptr,     # address of int32 [K], evicted ids oldest first, -1 padded
    K,           # number of pages to evict at most
    free_stack,  # int32 [P]
    page_state,  # int8 [P]
    page_gen,    # int32 [P]
    counters,    # int64 [NUM_COUNTERS]
    lru_queue,   # int32 [LRU_FACTOR * P]
    lru_pos,     # int64 [P]
):
    counters[L.CLOCK] += 1
    evict_oldest_numba(K, i32_array(out_ptr, K), free_stack, page_state, page_gen, counters, lru_queue, lru_pos)
    # no raise_peaks: an eviction only lowers the cached count (as the reference and Triton)


@numba.njit(nogil=True)
def evict_numba_entry(out_ptr, K, sd):
    """``evict_numba`` with the state passed as a descriptor (fast dispatch)."""
    stack, _, state, _, counters, _, _ = state_arrays(sd)
    evict_numba(out_ptr, K, stack, state, page_gens(sd), counters, *nu.lru_arrays(sd))


# ---------------------------------------------------------------------- Triton
# One program: a scan of the LRU queue from its head, chunk by chunk, until m
# live entries are found (each lands in out at its running rank, a prefix sum);
# nothing else changes until all m are found; then a pass over out marks them
# FREE and pushes them, and out is padded.


@triton.jit
def evict_oldest_body(
    n,               # int64 scalar: pages wanted
    out_ptr,         # *int32 [K]: evicted ids oldest first, -1 padded
    K,               # capacity of out
    free_stack_ptr,  # *int32 [P]: evicted pages pushed at [top, top + m)
    page_state_ptr,  # *int8 [P]
    page_gen_ptr,    # *int32 [P]: each evicted page's generation is bumped
    lru_queue_ptr,   # *int32 [Q]: the LRU queue
    lru_pos_ptr,     # *int64 [P]
    num_pages,       # P
    queue_len,       # Q
    top,             # int64 scalar: FREE_COUNT before the call
    cached_count,    # int64 scalar: CACHED_COUNT before the call
    head,            # int64 scalar: LRU_HEAD before the call
    hole,            # int64 scalar: LRU_HOLE (the cleaner's gap [hole, scan) is skipped)
    scan,            # int64 scalar: LRU_SCAN
    tail,            # int64 scalar: LRU_TAIL before the call
    # Meta-parameters
    BLOCK: tl.constexpr,  # entries per chunk
):
    """Evict the m = min(n, cached, K) first live entries of the LRU queue: out[:m], stack[top:top+m].

    Returns ``(m, corrupt, head)``: when the m pages cannot be pushed (``top < 0`` or
    ``top > P - m``), or the queue holds fewer than m live entries (none when its positions
    are out of bounds, ``kernels.layout``), nothing is evicted and ``corrupt`` is 1; ``head``
    is the queue's head after the call (past the last entry taken)."""
    lanes = tl.arange(0, BLOCK)
    m = tl.maximum(tl.minimum(tl.minimum(n, cached_count), K), 0)
    in_bounds = lru_in_bounds(head, hole, scan, tail, queue_len)
    stop = tl.where(in_bounds & (m > 0), tail, head)
    found = tl.zeros((), tl.int64)
    after = head  # one past the last entry taken
    start = tl.where(in_bounds & (head == hole), scan, head)  # (out of bounds: stop == head, no chunk)
    while (found < m) & (start < stop):
        j = start + lanes
        in_queue = (j < stop) & ((j < hole) | (j >= scan))
        p, live = lru_live(j, in_queue, lru_queue_ptr, lru_pos_ptr, page_state_ptr, num_pages, queue_len)
        v = live.to(tl.int64)
        rank = found + tl.cumsum(v, 0) - v
        take = live & (rank < m)
        tl.store(out_ptr + rank, p, mask=take)
        after = tl.maximum(after, tl.max(tl.where(take, j + 1, 0)))
        found += tl.sum(take.to(tl.int64))
        start += BLOCK
        start = tl.where((start >= hole) & (start < scan), scan, start)  # over the cleaner's gap
    corrupt = (m > 0) & ((top < 0) | (top > num_pages - m) | (found < m))
    m = tl.where(corrupt, 0, m)
    tl.debug_barrier()  # out[:m] is read back by other lanes
    for start in range(0, m, BLOCK):
        j = start + lanes
        p = tl.load(out_ptr + j, mask=j < m, other=0)
        tl.store(free_stack_ptr + top + j, p, mask=j < m)
        tl.store(page_state_ptr + p, tl.full((BLOCK,), FREE, tl.int8), mask=j < m)
        t_bump_gen(page_gen_ptr, p, j < m)
    for start in range((m // BLOCK) * BLOCK, K, BLOCK):
        j = start + lanes
        tl.store(out_ptr + j, tl.full((BLOCK,), NULL_PAGE, tl.int32), mask=(j >= m) & (j < K))
    return m, corrupt.to(tl.int64), tl.where(m > 0, after, head)


@triton.jit
def evict_kernel(
    out_ptr,         # *int32 [K]: evicted ids oldest first, -1 padded
    K,               # capacity of out: pages to evict at most
    free_stack_ptr,  # *int32 [P]
    page_state_ptr,  # *int8 [P]
    page_gen_ptr,    # *int32 [P]
    counters_ptr,    # *int64 [NUM_COUNTERS]
    lru_queue_ptr,   # *int32 [Q]
    lru_pos_ptr,     # *int64 [P]
    num_pages,       # P
    queue_len,       # Q
    # Meta-parameters
    BLOCK: tl.constexpr,  # lanes per chunk
):
    """out[:m] = the m = min(K, cached) least recently used CACHED pages (the LRU queue's order), pushed on the
    stack in that order."""
    c = load_counters(counters_ptr)
    c, _clock = tick(c)
    m, corrupt, head = evict_oldest_body(tl.zeros((), tl.int64) + K, out_ptr, K, free_stack_ptr, page_state_ptr,
                                         page_gen_ptr, lru_queue_ptr, lru_pos_ptr, num_pages, queue_len,
                                         counter_get(c, FREE_COUNT), counter_get(c, CACHED_COUNT),
                                         counter_get(c, LRU_HEAD), counter_get(c, LRU_HOLE),
                                         counter_get(c, LRU_SCAN), counter_get(c, LRU_TAIL), BLOCK)
    c = evicted(c, m, corrupt, head)
    store_counters(counters_ptr, c)


@triton.jit
def evicted(c, m, corrupt, head):
    """The counters after an eviction of ``m`` pages (``evict_oldest_body``'s results)."""
    c = counter_add(c, ERR_CORRUPT_STATE, corrupt)
    c = counter_add(c, FREE_COUNT, m)
    c = counter_add(c, CACHED_COUNT, -m)
    c = counter_add(c, EVICTED, m)
    # the hole and the scan move up with the head when it passes them
    hole, scan = counter_get(c, LRU_HOLE), counter_get(c, LRU_SCAN)
    c = counter_set(c, LRU_HOLE, tl.where(m > 0, tl.maximum(hole, head), hole))
    c = counter_set(c, LRU_SCAN, tl.where(m > 0, tl.maximum(scan, head), scan))
    return counter_set(c, LRU_HEAD, head)


def evict_triton(st, out) -> None:
    """Evict up to ``out.numel()`` cached pages, oldest first, into ``out`` (one launch)."""
    evict_kernel[(1,)](
        out, out.numel(), st.free_stack, st.page_state, st.page_gen, st.counters, st.lru_queue, st.lru_pos,
        st.num_pages, st.lru_queue.numel(), **queue_settings(out.numel(), st),
    )
