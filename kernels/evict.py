"""evict: free the k least recently stamped cached pages, oldest first.

Order: ascending ``(stamp, page id)``. Evicted pages are returned in that
order (padded with -1) and pushed on the free stack in that order; each one's
generation is bumped (it became FREE).
"""

import numba
import numpy as np
from ._triton_shim import tl, triton

from . import layout as L
from ._numba_util import bump_gen, fill_null_range, i32_array, page_gens, state_arrays
from ._triton_util import (CACHED, CACHED_COUNT, ERR_CORRUPT_STATE, EVICTED, FREE, FREE_COUNT, INT64_MAX,
                           NULL_PAGE, bump_gen as t_bump_gen, counter_add, counter_get, load_counters, settings,
                           store_counters, tick)


HIST_BINS = 4096  # histogram bins per radix round of the numba select


@numba.njit(nogil=True)
def _select_threshold(m, ids, c, lo, hi, stamp, hist):
    """Radix select over the ``c`` cached pages ``ids[:c]``: the stamp ``t`` of the ``m``-th oldest.

    Each round histograms ``(stamp - base) >> shift`` over the pages with stamps
    in ``[base, base + span]`` and narrows to the bucket holding the ``m``-th
    page. Returns ``(t, older, exact)``: ``older`` pages have stamps below
    ``t``; ``exact`` means one round settled it, and ``hist[:t - lo + 1]``
    then holds the count of every stamp up to ``t``.
    """
    H = hist.shape[0]
    base, span, older, rounds = lo, hi - lo, 0, 0
    while True:
        shift = 0
        while (span >> shift) >= H:
            shift += 1
        hist[:(span >> shift) + 1] = 0
        for j in range(c):
            d = stamp[ids[j]] - base
            if d >= 0 and d <= span:
                hist[d >> shift] += 1
        rounds += 1
        tb = 0
        while older + hist[tb] < m:
            older += hist[tb]
            tb += 1
        if shift == 0:
            return base + tb, older, rounds == 1
        base += tb << shift
        span = (1 << shift) - 1


@numba.njit(nogil=True)
def evict_oldest_numba(n, out, free_stack, page_state, stamp, page_gen, counters, keys):
    """Evict ``min(n, cached, len(out))`` pages into ``out[:m]``; pad the rest of ``out`` with -1.

    No sort of the pool: one branch-free pass lists the cached pages (in
    ``keys``), then a radix select over their stamps finds the threshold (one
    round when their stamps span fewer than HIST_BINS clock values). Pages are
    placed in ``(stamp, id)`` order by counting positions when one round
    settled it, else by a stable sort of the ``m`` chosen pages' stamps.
    """
    P = page_state.shape[0]
    m = max(0, min(n, counters[L.CACHED_COUNT], out.shape[0])) if n > 0 else 0
    top = counters[L.FREE_COUNT]
    if m > 0:
        ids = keys
        c = 0
        for i in range(P):  # branch-free compaction of the cached page ids
            ids[c] = i
            c += page_state[i] == L.CACHED
        lo = hi = stamp[ids[0]]
        for j in range(c):
            s = stamp[ids[j]]
            lo = min(lo, s)
            hi = max(hi, s)
        # Corrupt counts, or a stamp outside [0, clock] (its span could overflow): evict nothing.
        if top < 0 or top > P - m or c < m or lo < 0 or hi > counters[L.CLOCK]:  # no sum: it could wrap
            counters[L.ERR_CORRUPT_STATE] += 1
            m = 0
    if m > 0:
        hist = np.empty(min(c, HIST_BINS), np.int64)
        t, older, exact = _select_threshold(m, ids, c, lo, hi, stamp, hist)
        if exact:  # hist holds per-stamp counts up to t: turn them into start positions
            pos = 0
            for b in range(t - lo + 1):
                k = hist[b]
                hist[b] = pos
                pos += k
            for j in range(c):  # ids ascending: ties by id come out in order
                i = ids[j]
                if stamp[i] <= t:
                    b = stamp[i] - lo
                    if hist[b] < m:
                        out[hist[b]] = i
                    hist[b] += 1
        else:
            at_t, r = m - older, 0
            chosen, stamps = np.empty(m, np.int32), np.empty(m, np.int64)
            for j in range(c):  # ids ascending, so a stable sort by stamp orders by (stamp, id)
                i = ids[j]
                s = stamp[i]
                if s < t or (s == t and at_t > 0):
                    at_t -= s == t
                    chosen[r], stamps[r] = i, s  # (not one key stamp * P + id: that wraps for a late clock)
                    r += 1
            order = np.argsort(stamps, kind="mergesort")
            for r in range(m):
                out[r] = chosen[order[r]]
        for r in range(m):
            p = out[r]
            page_state[p] = L.FREE
            bump_gen(page_gen, p)
            free_stack[top + r] = p
        counters[L.FREE_COUNT] = top + m
        counters[L.CACHED_COUNT] -= m
        counters[L.EVICTED] += m
    fill_null_range(out.ctypes.data, m, out.shape[0])


@numba.njit(nogil=True)
def evict_numba(
    out_ptr,     # address of int32 [K], evicted ids oldest first, -1 padded
    K,           # number of pages to evict at most
    free_stack,  # int32 [P]
    page_state,  # int8 [P]
    stamp,       # int64 [P]
    page_gen,    # int32 [P]
    counters,    # int64 [NUM_COUNTERS]
    keys,        # int64 [P] scratch
):
    counters[L.CLOCK] += 1
    evict_oldest_numba(K, i32_array(out_ptr, K), free_stack, page_state, stamp, page_gen, counters, keys)
    # no raise_peaks: an eviction only lowers the cached count (as the reference and Triton)


@numba.njit(nogil=True)
def evict_numba_entry(out_ptr, K, sd):
    """``evict_numba`` with the state passed as a descriptor (fast dispatch)."""
    stack, _, state, stamp, counters, _, keys = state_arrays(sd)
    evict_numba(out_ptr, K, stack, state, stamp, page_gens(sd), counters, keys)


# ---------------------------------------------------------------------- Triton
# Selection without sorting the pool: a census pass (cached count, min/max
# stamp), radix rounds that histogram one 8-bit digit of ``stamp - min`` to find
# the threshold stamp ``t`` (everything older is taken whole; of the pages
# stamped ``t``, the lowest ids), a collect pass that lists the chosen pages in
# id order, and a stable LSD radix sort of only those ``m`` pages by
# ``stamp - min`` (one pass per 8-bit digit of ``t - min``; none when they share
# one stamp), which leaves them in ``(stamp, id)`` order. Positions come from
# histograms, prefix sums and in-chunk ranks, never atomics.


DIGIT_BITS = tl.constexpr(8)  # stamp bits settled per radix round / sort pass
RADIX = tl.constexpr(256)     # histogram bins per round (2**DIGIT_BITS)


@triton.jit
def radix_sort_pass(
    src_ptr,         # *int32 [m]: page ids, in (stamp - smin) order of the digits below `shift`
    dst_ptr,         # *int32 [m]: the same ids, stably reordered by the digit at `shift`
    m,               # int64 scalar: pages to sort
    stamp_ptr,       # *int64 [P]: stamps, loaded through the page ids
    smin,            # int64 scalar: the smallest stamp (digits are of stamp - smin >= 0)
    shift,           # bit offset of this pass's digit
    BLOCK: tl.constexpr,  # lanes per chunk of the histogram
    CHUNK: tl.constexpr,  # items per chunk of the scatter (its [CHUNK, RADIX] and [CHUNK, CHUNK] tiles)
):
    """One stable counting-sort pass: dst[base[d] + (earlier items with digit d)] = src[j].

    Work: m items histogrammed, then m items placed in chunks of CHUNK, each item's
    offset gathered from a [RADIX] vector by a [CHUNK, RADIX] select and its rank among
    the chunk's items with the same digit by a [CHUNK, CHUNK] comparison:
    O(m * (RADIX + CHUNK)) per pass, no atomics, the order of equal digits kept."""
    bins = tl.arange(0, RADIX)
    lanes = tl.arange(0, BLOCK)
    hist = tl.zeros((RADIX,), tl.int32)
    for start in range(0, m, BLOCK):
        j = start + lanes
        live = j < m
        p = tl.load(src_ptr + j, mask=live, other=0)
        d = (tl.load(stamp_ptr + p, mask=live, other=smin) - smin) >> shift
        hist += tl.histogram((d & (RADIX - 1)).to(tl.int32), RADIX, mask=live)
    # next[b]: where the next item with digit b goes (the exclusive prefix sum, then counted up).
    # (int32: positions are below m <= P < 2**31; the pointers carry the stack offset.)
    nxt = tl.cumsum(hist, 0) - hist
    rows = tl.arange(0, CHUNK)
    earlier = rows[None, :] < rows[:, None]  # [i, k]: item k comes before item i in the chunk
    for start in range(0, m, CHUNK):
        j = start + rows
        live = j < m
        p = tl.load(src_ptr + j, mask=live, other=0)
        d = (tl.load(stamp_ptr + p, mask=live, other=smin) - smin) >> shift
        digit = (d & (RADIX - 1)).to(tl.int32)
        base = tl.sum(tl.where(digit[:, None] == bins[None, :], nxt[None, :], 0), axis=1)
        same = (digit[:, None] == digit[None, :]) & earlier & live[None, :]
        pos = base + tl.sum(same.to(tl.int32), axis=1)
        tl.store(dst_ptr + pos, p, mask=live)
        nxt += tl.histogram(digit, RADIX, mask=live)


@triton.jit
def evict_oldest_body(
    n,               # int64 scalar: pages wanted
    out_ptr,         # *int32 [K]: evicted ids oldest first, -1 padded
    K,               # capacity of out
    free_stack_ptr,  # *int32 [P]
    page_state_ptr,  # *int8 [P]
    stamp_ptr,       # *int64 [P]
    page_gen_ptr,    # *int32 [P]: each evicted page's generation is bumped
    num_pages,       # P
    top,             # int64 scalar: FREE_COUNT before the call
    cached_count,    # int64 scalar: CACHED_COUNT before the call
    clock,           # int64 scalar: the call's clock (no stamp is later)
    # Meta-parameters
    BLOCK: tl.constexpr,       # pages per chunk
    RANK_BLOCK: tl.constexpr,  # items per chunk of a radix sort pass's scatter
):
    """Evict the m = min(n, cached, K) smallest (stamp, id) CACHED pages: out[:m], stack[top:top+m].

    Returns ``(m, corrupt)``: when the m pages cannot be pushed (``top < 0`` or ``top > P - m``)
    or fewer than m pages are CACHED, or a CACHED page's stamp is outside ``[0, clock]``, nothing
    is evicted and ``corrupt`` is 1."""
    lanes = tl.arange(0, BLOCK)
    # Census: how many pages are cached, and their stamp range.
    cnt = tl.zeros((), tl.int64)
    smin = tl.full((), INT64_MAX, tl.int64)
    smax = tl.zeros((), tl.int64)
    for start in range(0, tl.where(n > 0, num_pages, 0), BLOCK):
        i = start + lanes
        cached = tl.load(page_state_ptr + i, mask=i < num_pages, other=FREE) == CACHED
        s = tl.load(stamp_ptr + i, mask=cached, other=0)
        cnt += tl.sum(cached.to(tl.int64))
        smin = tl.minimum(smin, tl.min(tl.where(cached, s, INT64_MAX)))
        smax = tl.maximum(smax, tl.max(tl.where(cached, s, 0)))
    m = tl.maximum(tl.minimum(tl.minimum(n, cached_count), K), 0)
    corrupt = (m > 0) & ((top < 0) | (top > num_pages - m) | (cnt < m) | (smin < 0) | (smax > clock))
    m = tl.where(corrupt, 0, m)
    # Radix select of the threshold stamp t: #(stamp < t) < m <= #(stamp <= t);
    # afterwards `need` is how many pages stamped t are taken (lowest ids first).
    span = tl.where(m < cnt, smax - smin, 0)
    rounds = tl.zeros((), tl.int32)
    while span > 0:
        span = span >> DIGIT_BITS
        rounds += 1
    need = m
    prefix = tl.zeros((), tl.int64)  # digits of t - smin settled so far
    bins = tl.arange(0, RADIX)
    for r in range(rounds):
        shift = (rounds - 1 - r) * DIGIT_BITS
        hist = tl.zeros((RADIX,), tl.int32)
        for start in range(0, num_pages, BLOCK):
            i = start + lanes
            cached = tl.load(page_state_ptr + i, mask=i < num_pages, other=FREE) == CACHED
            d = (tl.load(stamp_ptr + i, mask=cached, other=0) - smin) >> shift
            match = cached & ((d >> DIGIT_BITS) == prefix)
            hist += tl.histogram((d & (RADIX - 1)).to(tl.int32), RADIX, mask=match)
        # The bucket holding the need-th oldest: first bin whose inclusive count reaches need.
        b = tl.sum((tl.cumsum(hist, 0) < need).to(tl.int32))
        need -= tl.sum(tl.where(bins < b, hist, 0))
        prefix = (prefix << DIGIT_BITS) + b
    t = tl.where(m < cnt, smin + prefix, smax)
    # Collect the chosen pages in id order into the stack slots they will occupy.
    taken = tl.zeros((), tl.int64)
    ties = tl.zeros((), tl.int64)
    for start in range(0, tl.where(m > 0, num_pages, 0), BLOCK):
        i = start + lanes
        cached = tl.load(page_state_ptr + i, mask=i < num_pages, other=FREE) == CACHED
        s = tl.load(stamp_ptr + i, mask=cached, other=0)
        eq = (cached & (s == t)).to(tl.int64)
        chosen = (cached & (s < t)) | ((eq != 0) & (ties + tl.cumsum(eq, 0) <= need))
        c = chosen.to(tl.int64)
        pos = top + taken + tl.cumsum(c, 0) - c
        tl.store(free_stack_ptr + pos, i, mask=chosen & (pos < num_pages))
        ties += tl.sum(eq)
        taken += tl.sum(c)
    tl.debug_barrier()
    # Stable LSD radix sort of the chosen pages by stamp - smin (all in [0, t - smin]): from id
    # order it yields (stamp, id) order. Passes ping-pong stack[top:top+m] -> out[:m] -> stack ...
    span = tl.where(m > 0, t, smin) - smin  # (no difference formed when nothing is evicted)
    passes = tl.zeros((), tl.int32)
    while span > 0:
        span = span >> DIGIT_BITS
        passes += 1
    for r in range(passes):
        if r % 2 == 0:
            radix_sort_pass(free_stack_ptr + top, out_ptr, m, stamp_ptr, smin, r * DIGIT_BITS, BLOCK, RANK_BLOCK)
        else:
            radix_sort_pass(out_ptr, free_stack_ptr + top, m, stamp_ptr, smin, r * DIGIT_BITS, BLOCK, RANK_BLOCK)
        tl.debug_barrier()
    # The order is in out after an odd number of passes, else on the stack: copy it to the
    # other one, mark the pages FREE (their generations bumped), pad out with -1.
    in_out = passes % 2 == 1
    m_out = tl.where(in_out, m, 0)    # items to read from out (and write to the stack)
    m_stack = tl.where(in_out, 0, m)  # items to read from the stack (and write to out)
    for start in range(0, m, BLOCK):
        j = start + lanes
        p = tl.where(j < m_out, tl.load(out_ptr + j, mask=j < m_out, other=0),
                     tl.load(free_stack_ptr + top + j, mask=j < m_stack, other=0))
        tl.store(free_stack_ptr + top + j, p, mask=j < m_out)
        tl.store(out_ptr + j, p, mask=j < m_stack)
        tl.store(page_state_ptr + p, tl.full((BLOCK,), FREE, tl.int8), mask=j < m)
        t_bump_gen(page_gen_ptr, p, j < m)
    for start in range((m // BLOCK) * BLOCK, K, BLOCK):
        j = start + lanes
        tl.store(out_ptr + j, tl.full((BLOCK,), NULL_PAGE, tl.int32), mask=(j >= m) & (j < K))
    return m, corrupt.to(tl.int64)


@triton.jit
def evict_kernel(
    out_ptr,         # *int32 [K]: evicted ids oldest first, -1 padded
    K,               # capacity of out: pages to evict at most
    free_stack_ptr,  # *int32 [P]
    page_state_ptr,  # *int8 [P]
    stamp_ptr,       # *int64 [P]
    page_gen_ptr,    # *int32 [P]
    counters_ptr,    # *int64 [NUM_COUNTERS]
    num_pages,       # P
    # Meta-parameters
    BLOCK: tl.constexpr,       # lanes per chunk
    RANK_BLOCK: tl.constexpr,  # items per chunk of a radix sort pass's scatter
):
    """out[:m] = the m = min(K, cached) oldest CACHED pages by (stamp, id), pushed on the stack in that order."""
    c = load_counters(counters_ptr)
    c, clock = tick(c)
    top = counter_get(c, FREE_COUNT)
    m, corrupt = evict_oldest_body(tl.zeros((), tl.int64) + K, out_ptr, K, free_stack_ptr, page_state_ptr,
                                   stamp_ptr, page_gen_ptr, num_pages, top, counter_get(c, CACHED_COUNT), clock, BLOCK,
                                   RANK_BLOCK)
    c = counter_add(c, ERR_CORRUPT_STATE, corrupt)
    c = counter_add(c, FREE_COUNT, m)
    c = counter_add(c, CACHED_COUNT, -m)
    c = counter_add(c, EVICTED, m)
    store_counters(counters_ptr, c)


def evict_triton(st, out) -> None:
    """Evict up to ``out.numel()`` cached pages, oldest first, into ``out`` (one launch)."""
    evict_kernel[(1,)](
        out, out.numel(), st.free_stack, st.page_state, st.stamp, st.page_gen, st.counters, st.num_pages,
        **settings(max(st.num_pages, out.numel()), rank=True),
    )
