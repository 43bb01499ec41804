"""alloc: grant pages to a batch of requests, first come first served.

Request ``i`` is granted iff no count in ``counts[:i+1]`` is negative and the
inclusive prefix sum of counts is at most the available pages (free, plus
cached with ``evict``) and at most the output capacity ``M``. Granted pages
are popped from the top of the free stack in request order; entries of
``pages`` past the total are -1; ``indptr`` (``[BO+1]``) and ``ok``
(``[BO]``) are padded past ``B`` with the total and False. Requests past ``BO``
(a direct kernel call; the façade refuses it) fail, with one ``out_overflow``.
"""

import numba
from ._triton_shim import tl, triton

from . import layout as L
from . import _numba_util as nu
from ._numba_util import (fill_null_range, i32_array, mark_popped, page_gens, pop_page, stack_run_ok, state_arrays,
                          u8_array)
from .layout import AD_EVICTED, AD_INDPTR, AD_MAX_BATCH, AD_MAX_PAGES, AD_OK, AD_PAGES, STATE_DESC_LEN
from ._triton_util import (ALLOCATED, CACHED_COUNT, ERR_BAD_COUNT, ERR_CORRUPT_STATE, FAILED_REQUESTS,
                           FREE_COUNT, LRU_HEAD, LRU_HOLE, LRU_SCAN, LRU_TAIL, NULL_PAGE, OVERFLOW_PAGES,
                           count_overflow, counter_add, counter_get, load_counters, pop_check, queue_settings,
                           raise_peaks, store_counters, tick)
from .evict import evict_oldest_numba, evict_oldest_body, evicted


@numba.njit(nogil=True)
def alloc_numba(
    counts_ptr,   # address of int32 [B], pages wanted per request
    B,            # batch size
    pages_ptr,    # address of int32 [M], granted pages, -1 padded
    M,            # output capacity in pages
    indptr_ptr,   # address of int32 [BO + 1], offsets of each request's pages
    ok_ptr,       # address of bool [BO], request granted
    BO,           # output batch capacity (requests past it fail: the façade refuses B > BO)
    evicted_ptr,  # address of int32 [M], pages evicted to cover the shortfall
    evict,        # bool, may evict cached pages
    free_stack,   # int32 [P]
    refcount,     # int32 [P]
    page_state,   # int8 [P]
    page_gen,     # int32 [P]: bumped for each evicted page
    counters,     # int64 [NUM_COUNTERS]
    lru_queue,    # int32 [LRU_FACTOR * P]: read (and its head moved) by an eviction
    lru_pos,      # int64 [P]
):
    if B > BO:  # more requests than the outputs have lanes (the façade refuses it): those past BO fail
        nu.count_overflow(counters, L.OVERFLOW_PAGES, 1)
        counters[L.FAILED_REQUESTS] += B - BO
        B = BO
    counts = i32_array(counts_ptr, B)
    pages = i32_array(pages_ptr, M)
    indptr = i32_array(indptr_ptr, BO + 1)
    ok = u8_array(ok_ptr, BO)
    evicted = i32_array(evicted_ptr, M)
    counters[L.CLOCK] += 1
    P = page_state.shape[0]
    free, cached = counters[L.FREE_COUNT], counters[L.CACHED_COUNT]
    if free < 0 or free > P or cached < 0 or cached > P - free:  # corrupt counts: the pool looks empty
        counters[L.ERR_CORRUPT_STATE] += 1
        free = cached = 0
    avail = free + cached if evict else free
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
                nu.count_overflow(counters, L.OVERFLOW_PAGES, 1)
        ok[i] = granted
        indptr[i + 1] = total
    for i in range(B, BO):
        ok[i] = False
        indptr[i + 1] = total
    evict_oldest_numba(total - free if evict else 0, evicted, free_stack, page_state, page_gen, counters, lru_queue,
                       lru_pos)
    top = counters[L.FREE_COUNT] - 1
    P = refcount.shape[0]
    if stack_run_ok(free_stack, top - total + 1, top + 1, P):  # the usual case: no check per page
        for j in range(total):
            p = free_stack[top - j]
            mark_popped(p, refcount, page_state)
            pages[j] = p
    else:  # corrupt state on the way: the checked pop
        for j in range(total):
            pages[j] = pop_page(top - j, free_stack, refcount, page_state, counters)
    fill_null_range(pages_ptr, total, M)
    counters[L.FREE_COUNT] -= total
    counters[L.ALLOCATED] += total
    nu.raise_peaks(counters, page_state.shape[0])


@numba.njit(nogil=True)
def alloc_numba_entry(counts_ptr, B, ad, evict):
    """``alloc_numba`` bound to its outputs: state and output addresses in the descriptor ``ad``."""
    stack, rc, state, _, counters, _, _ = state_arrays(ad[:STATE_DESC_LEN])
    alloc_numba(counts_ptr, B, ad[AD_PAGES], ad[AD_MAX_PAGES], ad[AD_INDPTR], ad[AD_OK], ad[AD_MAX_BATCH],
                ad[AD_EVICTED], evict, stack, rc, state, page_gens(ad[:STATE_DESC_LEN]), counters,
                *nu.lru_arrays(ad[:STATE_DESC_LEN]))


# ---------------------------------------------------------------------- Triton
# One program: a plan pass over the requests (prefix sums give each request its
# offset; the stack top moves once, by the total), the eviction of the
# shortfall (see ``evict.evict_oldest_body``), then a pop pass over the output.


@triton.jit(do_not_specialize=["extra"])  # (a direct call past BO must not compile a variant of its own)
def alloc_kernel(
    counts_ptr,      # *int32 [B]: pages wanted per request
    B,               # batch size
    pages_ptr,       # *int32 [M]: granted pages, request by request, -1 padded
    M,               # output capacity in pages
    indptr_ptr,      # *int32 [BO + 1]: request i got pages[indptr[i]:indptr[i+1]]
    ok_ptr,          # *bool [BO]: request granted
    BO,              # output batch capacity (B is at most BO: the wrapper clamps it)
    extra,           # requests past BO (the façade refuses them): each fails, one out_overflow
    evicted_ptr,     # *int32 [M]: pages evicted to cover the shortfall, oldest first, -1 padded
    free_stack_ptr,  # *int32 [P]
    refcount_ptr,    # *int32 [P]
    page_state_ptr,  # *int8 [P]
    page_gen_ptr,    # *int32 [P]: bumped for each evicted page
    counters_ptr,    # *int64 [NUM_COUNTERS]
    lru_queue_ptr,   # *int32 [Q]: the LRU queue an eviction reads
    lru_pos_ptr,     # *int64 [P]
    num_pages,       # P
    queue_len,       # Q
    # Meta-parameters
    HAS_EVICT: tl.constexpr,   # cached pages may be evicted to cover the request
    BLOCK: tl.constexpr,       # lanes per chunk
):
    """ok[i] = no negative in counts[:i+1] and cumsum(counts)[i] <= min(avail, M); pop the granted total."""
    lanes = tl.arange(0, BLOCK)
    c = load_counters(counters_ptr)
    c, _clock = tick(c)
    free = counter_get(c, FREE_COUNT)
    cached = counter_get(c, CACHED_COUNT)
    gate = (free >= 0) & (free <= num_pages) & (cached >= 0) & (cached <= num_pages - free)
    c = counter_add(c, ERR_CORRUPT_STATE, (~gate).to(tl.int64))  # corrupt counts: the pool looks empty
    free = tl.where(gate, free, 0)
    cached = tl.where(gate, cached, 0)
    if HAS_EVICT:
        avail = free + cached
    else:
        avail = free
    # Plan: running carries across chunks make the prefix sums global.
    negs = tl.zeros((), tl.int32)      # negative counts so far
    csum = tl.zeros((), tl.int64)      # sum of non-negative counts so far
    total = tl.zeros((), tl.int64)     # pages granted so far
    failed = tl.zeros((), tl.int32) + extra
    overflow = (tl.zeros((), tl.int32) + extra > 0).to(tl.int32)
    tl.store(indptr_ptr + lanes, tl.zeros((BLOCK,), tl.int32), mask=lanes < 1)
    for start in range(0, B, BLOCK):
        i = start + lanes
        live = i < B
        n = tl.load(counts_ptr + i, mask=live, other=0).to(tl.int64)
        neg = (n < 0).to(tl.int32)
        cs = csum + tl.cumsum(tl.maximum(n, 0), 0)
        fits = (negs + tl.cumsum(neg, 0) == 0) & (cs <= avail)
        ok = fits & (cs <= M)
        granted = tl.where(ok, n, 0)
        tl.store(ok_ptr + i, ok, mask=live)
        tl.store(indptr_ptr + i + 1, (total + tl.cumsum(granted, 0)).to(tl.int32), mask=live)
        negs += tl.sum(neg)
        csum += tl.sum(tl.maximum(n, 0))
        total += tl.sum(granted)
        failed += tl.sum((live & ~ok).to(tl.int32))
        overflow += tl.sum((live & fits & ~ok).to(tl.int32))
    for start in range((B // BLOCK) * BLOCK, BO, BLOCK):
        i = start + lanes
        pad = (i >= B) & (i < BO)
        tl.store(ok_ptr + i, tl.zeros((BLOCK,), tl.int1), mask=pad)
        tl.store(indptr_ptr + i + 1, tl.zeros((BLOCK,), tl.int32) + total.to(tl.int32), mask=pad)
    if HAS_EVICT:
        m, bad_evict, head = evict_oldest_body(total - free, evicted_ptr, M, free_stack_ptr, page_state_ptr,
                                               page_gen_ptr, lru_queue_ptr, lru_pos_ptr, num_pages, queue_len,
                                               counter_get(c, FREE_COUNT), cached, counter_get(c, LRU_HEAD),
                                               counter_get(c, LRU_HOLE), counter_get(c, LRU_SCAN),
                                               counter_get(c, LRU_TAIL), BLOCK)
        c = evicted(c, m, bad_evict, head)
        tl.debug_barrier()  # the pop below reads stack slots the eviction wrote
    else:
        for start in range(0, M, BLOCK):
            j = start + lanes
            tl.store(evicted_ptr + j, tl.full((BLOCK,), NULL_PAGE, tl.int32), mask=j < M)
    # Pop: pages[j] = stack[top - 1 - j] for j < total.
    top = counter_get(c, FREE_COUNT)
    wrong = tl.zeros((), tl.int64)
    for start in range(0, M, BLOCK):
        j = start + lanes
        p, bad_pop = pop_check(top - 1 - j, j < total, free_stack_ptr, refcount_ptr, page_state_ptr, num_pages)
        tl.store(pages_ptr + j, p, mask=j < M)
        wrong += bad_pop
    c = counter_add(c, ERR_CORRUPT_STATE, wrong)
    c = counter_add(c, FREE_COUNT, -total)
    c = counter_add(c, ALLOCATED, total)
    c = counter_add(c, ERR_BAD_COUNT, negs)
    c = count_overflow(c, OVERFLOW_PAGES, overflow)
    c = counter_add(c, FAILED_REQUESTS, failed)
    c = raise_peaks(c, num_pages)
    store_counters(counters_ptr, c)


def alloc_triton(st, counts, pages, indptr, ok, evicted, evict) -> None:
    """Grant ``counts[i]`` pages per request, first come first served (one launch; see module note)."""
    B, M, BO = counts.numel(), pages.numel(), ok.numel()
    alloc_kernel[(1,)](  # requests past BO fail, as in alloc_numba: none of them takes a page
        counts, min(B, BO), pages, M, indptr, ok, BO, max(B - BO, 0), evicted,
        st.free_stack, st.refcount, st.page_state, st.page_gen, st.counters, st.lru_queue, st.lru_pos, st.num_pages,
        st.lru_queue.numel(), HAS_EVICT=bool(evict), **queue_settings(max(M, BO), st, evict),
    )
