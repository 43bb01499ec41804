"""Helpers for the Triton kernels: launch settings, counters in registers, lane passes.

Note: every tpool kernel runs as ONE program (grid ``(1,)``) that loops over
fixed-size chunks and separates its phases with ``tl.debug_barrier()``.
Programs of one launch cannot wait for each other, and a single program
carries running offsets (stack top, prefix sums) from chunk to chunk, so the
result never depends on scheduling or on the order in which atomics land.
The ``counters`` vector is loaded once into registers, updated with
``counter_add`` / ``counter_set`` and stored once at the end.

Duplicates in a batch (``count_pages`` / ``reset_lanes``): lane ``i``
naming page ``p`` does ``atomic_min(claim[p], i)`` and
``atomic_add(occur[p], 1)``; after a barrier, the lane with
``claim[p] == i`` is the page's first occurrence and ``occur[p]`` its number
of occurrences. With ``LAST`` (a free into the cache, which queues each page
at its last occurrence) the key is ``-i`` instead (``lane_key``), so the
minimum names the last lane. Both are order-free (a minimum and a count), and
their returned old values are never used. ``reset_lanes`` restores
``claim = INT32_MAX`` and ``occur = 0``; ``count_pages`` runs it first too, so
a value a hand edit left in the scratch changes nothing (a stale ``claim``
below every lane would leave a page with no first lane, a stale ``occur`` a
wrong count: a free that raises a reference count).
"""

from ._triton_shim import tl, triton

from . import layout as L

MIN_BLOCK = 32     # lanes per chunk, at least one warp's worth
MAX_BLOCK = 2048   # lanes per chunk, at most (16 warps x 4 lanes per thread)

# Layout constants as constexpr globals (jit code may only read constexpr globals).
FREE = tl.constexpr(L.FREE)
USED = tl.constexpr(L.USED)
CACHED = tl.constexpr(L.CACHED)
NULL_PAGE = tl.constexpr(L.NULL_PAGE)
FREE_COUNT = tl.constexpr(L.FREE_COUNT)
CACHED_COUNT = tl.constexpr(L.CACHED_COUNT)
CLOCK = tl.constexpr(L.CLOCK)
USED_PEAK = tl.constexpr(L.USED_PEAK)
CACHED_PEAK = tl.constexpr(L.CACHED_PEAK)
ALLOCATED = tl.constexpr(L.ALLOCATED)
FREED = tl.constexpr(L.FREED)
FAILED_REQUESTS = tl.constexpr(L.FAILED_REQUESTS)
EVICTED = tl.constexpr(L.EVICTED)
REVIVED = tl.constexpr(L.REVIVED)
ERR_INVALID_PAGE = tl.constexpr(L.ERR_INVALID_PAGE)
ERR_DOUBLE_FREE = tl.constexpr(L.ERR_DOUBLE_FREE)
ERR_USE_AFTER_FREE = tl.constexpr(L.ERR_USE_AFTER_FREE)
ERR_BAD_COUNT = tl.constexpr(L.ERR_BAD_COUNT)
ERR_OUT_OVERFLOW = tl.constexpr(L.ERR_OUT_OVERFLOW)
OVERFLOW_PAGES = tl.constexpr(L.OVERFLOW_PAGES)
OVERFLOW_SLOTS = tl.constexpr(L.OVERFLOW_SLOTS)
OVERFLOW_CSR = tl.constexpr(L.OVERFLOW_CSR)
ERR_CORRUPT_STATE = tl.constexpr(L.ERR_CORRUPT_STATE)
ERR_REFCOUNT_OVERFLOW = tl.constexpr(L.ERR_REFCOUNT_OVERFLOW)
NUM_COUNTERS = tl.constexpr(L.NUM_COUNTERS)
COUNTER_BLOCK = tl.constexpr(triton.next_power_of_2(L.NUM_COUNTERS))
INT32_MAX = tl.constexpr(L.INT32_MAX)
INT64_MAX = tl.constexpr(L.INT64_MAX)
GEN_MASK = tl.constexpr(L.GEN_MASK)
LRU_HEAD = tl.constexpr(L.LRU_HEAD)
LRU_TAIL = tl.constexpr(L.LRU_TAIL)
LRU_HOLE = tl.constexpr(L.LRU_HOLE)
LRU_SCAN = tl.constexpr(L.LRU_SCAN)
LRU_CLEAN_AT = tl.constexpr(L.LRU_CLEAN_AT)
LRU_CLEAN_RATE = tl.constexpr(L.LRU_CLEAN_RATE)
LRU_POS_LIMIT = tl.constexpr(L.LRU_POS_LIMIT)


def settings(n: int) -> dict:
    """Launch settings for chunks over ``n`` lanes: ``BLOCK`` (next power of two in
    [MIN_BLOCK, MAX_BLOCK]) and ``num_warps`` (4 lanes per thread, 1 to 16 warps).
    Deterministic; no autotuning (graph capture)."""
    block = min(max(triton.next_power_of_2(max(n, 1)), MIN_BLOCK), MAX_BLOCK)
    return dict(BLOCK=block, num_warps=min(max(block // 128, 1), 16))


def queue_settings(n: int, st, walks: bool = True) -> dict:
    """``settings`` for a kernel over ``n`` lanes that may walk pool ``st``'s LRU queue (``walks``: a
    compaction, an eviction past stale entries): sized by the queue too, so a call with a small input
    does not walk a large queue 32 entries at a time."""
    return settings(max(n, st.lru_queue.numel() if walks else 1))


# ------------------------------------------------------------------ counters
@triton.jit
def load_counters(counters_ptr):
    """The int64 ``counters`` vector as a register block of COUNTER_BLOCK slots."""
    slots = tl.arange(0, COUNTER_BLOCK)
    return tl.load(counters_ptr + slots, mask=slots < NUM_COUNTERS, other=0)


@triton.jit
def store_counters(counters_ptr, c):
    """Write the register block back to ``counters`` (called once, at a kernel's end, on a uniform path).
    The barrier orders every thread's load of the counters before the store, which the compiled code
    makes from one warp's copy: not left to the barriers the kernel's reductions happen to bring."""
    tl.debug_barrier()
    slots = tl.arange(0, COUNTER_BLOCK)
    tl.store(counters_ptr + slots, c, mask=slots < NUM_COUNTERS)


@triton.jit
def counter_get(c, SLOT: tl.constexpr):
    """Slot ``SLOT`` of the register block, as an int64 scalar."""
    slots = tl.arange(0, COUNTER_BLOCK)
    return tl.sum(tl.where(slots == SLOT, c, 0))


@triton.jit
def counter_add(c, SLOT: tl.constexpr, delta):
    """``c[SLOT] += delta``, returned as a new block."""
    slots = tl.arange(0, COUNTER_BLOCK)
    return tl.where(slots == SLOT, c + delta.to(tl.int64), c)


@triton.jit
def count_overflow(c, SOURCE: tl.constexpr, n):
    """``n`` more ``out_overflow``, counted again in ``SOURCE`` (the buffer it overflowed)."""
    return counter_add(counter_add(c, ERR_OUT_OVERFLOW, n), SOURCE, n)


@triton.jit
def counter_set(c, SLOT: tl.constexpr, value):
    """``c[SLOT] = value``, returned as a new block."""
    slots = tl.arange(0, COUNTER_BLOCK)
    return tl.where(slots == SLOT, value.to(tl.int64), c)


@triton.jit
def tick(c):
    """Advance the device clock by one; return ``(c, clock)``."""
    c = counter_add(c, CLOCK, tl.full((), 1, tl.int64))
    return c, counter_get(c, CLOCK)


@triton.jit
def add_references(p, live, cached, k, refcount_ptr, page_state_ptr, BLOCK: tl.constexpr):
    """Pages ``p`` (lanes ``live``, distinct, each USED or CACHED) gain ``k`` references; lanes ``cached``
    are revived (USED). Returns (references that did not fit: the count saturates at INT32_MAX, pages revived)."""
    rc = tl.load(refcount_ptr + p, mask=live, other=0).to(tl.int64) + k
    over = tl.sum(tl.where(live, tl.maximum(rc - INT32_MAX, 0), 0))
    tl.store(refcount_ptr + p, tl.minimum(rc, INT32_MAX).to(tl.int32), mask=live)  # saturated
    tl.store(page_state_ptr + p, tl.full((BLOCK,), USED, tl.int8), mask=cached)
    return over, tl.sum(cached.to(tl.int64))


@triton.jit
def raise_peaks(c, num_pages):
    """Raise USED_PEAK and CACHED_PEAK to the current used and cached counts."""
    cached = counter_get(c, CACHED_COUNT)
    used = num_pages - counter_get(c, FREE_COUNT) - cached
    c = counter_set(c, USED_PEAK, tl.maximum(counter_get(c, USED_PEAK), used))
    return counter_set(c, CACHED_PEAK, tl.maximum(counter_get(c, CACHED_PEAK), cached))


# --------------------------------------------------------------- lane passes
@triton.jit
def lane_key(i, LAST: tl.constexpr):
    """The claim key of lanes (or list entries) ``i``: ``atomic_min`` over it picks a page's first
    lane, or with ``LAST`` its last (``-i``)."""
    if LAST:
        return -i
    else:
        return i


@triton.jit
def count_pages(pages_ptr, n_pages, claim_ptr, occur_ptr, num_pages, BLOCK: tl.constexpr, LAST: tl.constexpr):
    """Pass 1 of free/incref/touch/revive: first lane (``LAST``: last lane) and occurrences per page;
    returns #invalid ids. The lanes' scratch entries are reset first (see the module note)."""
    reset_lanes(pages_ptr, n_pages, claim_ptr, occur_ptr, num_pages, BLOCK)
    tl.debug_barrier()
    lanes = tl.arange(0, BLOCK)
    invalid = tl.zeros((), tl.int32)
    for start in range(0, n_pages, BLOCK):
        i = start + lanes
        p = tl.load(pages_ptr + i, mask=i < n_pages, other=NULL_PAGE)
        valid = (p >= 0) & (p < num_pages)
        invalid += tl.sum(((p != NULL_PAGE) & ~valid).to(tl.int32))
        tl.atomic_min(claim_ptr + p, lane_key(i, LAST), mask=valid, sem="relaxed")
        tl.atomic_add(occur_ptr + p, 1, mask=valid, sem="relaxed")
    return invalid


@triton.jit
def first_lanes(pages_ptr, start, n_pages, claim_ptr, occur_ptr, num_pages, BLOCK: tl.constexpr,
                LAST: tl.constexpr):
    """Pass 2 helper: ``(page, first occurrence? (LAST: last occurrence?), occurrences)`` for one chunk
    of lanes."""
    i = start + tl.arange(0, BLOCK)
    p = tl.load(pages_ptr + i, mask=i < n_pages, other=NULL_PAGE)
    valid = (p >= 0) & (p < num_pages)
    first = valid & (tl.load(claim_ptr + p, mask=valid, other=-1) == lane_key(i, LAST))
    k = tl.load(occur_ptr + p, mask=first, other=0)
    return p, first, k


@triton.jit
def reset_lanes(pages_ptr, n_pages, claim_ptr, occur_ptr, num_pages, BLOCK: tl.constexpr):
    """Pass 3 of free/incref/touch: restore ``claim = INT32_MAX`` and ``occur = 0``."""
    lanes = tl.arange(0, BLOCK)
    for start in range(0, n_pages, BLOCK):
        i = start + lanes
        p = tl.load(pages_ptr + i, mask=i < n_pages, other=NULL_PAGE)
        valid = (p >= 0) & (p < num_pages)
        tl.store(claim_ptr + p, tl.full((BLOCK,), INT32_MAX, tl.int32), mask=valid)
        tl.store(occur_ptr + p, tl.zeros((BLOCK,), tl.int32), mask=valid)


# --------------------------------------------------------------- LRU queue
@triton.jit
def lru_live(j, in_queue, lru_queue_ptr, lru_pos_ptr, page_state_ptr, num_pages, queue_len):
    """``(page, live)`` of the LRU queue's entries at positions ``j`` (lanes ``in_queue``, at or above 0;
    slot ``j % Q``): live while the page is in ``[0, P)``, CACHED, and the entry is its latest
    (``kernels.layout``)."""
    p = tl.load(lru_queue_ptr + j % queue_len, mask=in_queue, other=NULL_PAGE)
    inpool = in_queue & (p >= 0) & (p < num_pages)
    live = inpool & (tl.load(page_state_ptr + p, mask=inpool, other=FREE) == CACHED)
    live = live & (tl.load(lru_pos_ptr + p, mask=inpool, other=-1) == j)
    return p, live


@triton.jit
def lru_in_bounds(head, hole, scan, tail, queue_len):
    """Whether the LRU queue's positions are in bounds (``kernels.layout``)."""
    return ((head >= 0) & (head <= hole) & (hole <= scan) & (scan <= tail) & (tail <= LRU_POS_LIMIT)
            & (tail - head <= queue_len))


@triton.jit
def lru_move_down(lo, hi, v, lru_queue_ptr, lru_pos_ptr, page_state_ptr, num_pages, queue_len,
                  BLOCK: tl.constexpr):
    """The live entries at positions ``[lo, hi)`` move to ``v, v + 1, ...`` in order (``v <= lo``: each
    lands at or below where it was, on a slot already read); returns ``v`` after them."""
    lanes = tl.arange(0, BLOCK)
    start = lo  # (an int64 loop-carried value: positions pass 2**31 on a long run)
    while start < hi:
        j = start + lanes
        p, live = lru_live(j, j < hi, lru_queue_ptr, lru_pos_ptr, page_state_ptr, num_pages, queue_len)
        tl.debug_barrier()  # every lane has read its entry before one is moved over it
        w = live.to(tl.int64)
        dst = v + tl.cumsum(w, 0) - w
        tl.store(lru_queue_ptr + dst % queue_len, p, mask=live)
        tl.store(lru_pos_ptr + p, dst, mask=live)
        v += tl.sum(w)
        start += BLOCK
        tl.debug_barrier()
    return v


@triton.jit
def lru_prepare(c, lru_queue_ptr, lru_pos_ptr, page_state_ptr, num_pages, queue_len, BLOCK: tl.constexpr):
    """Run first by every kernel that may push on the LRU queue: a queue out of bounds is emptied (all
    positions 0, one ``corrupt_state``); one spanning more than ``Q - P`` positions is compacted at
    once (live entries down to the head, in order, a running prefix sum over chunks). Returns the
    counters."""
    h = counter_get(c, LRU_HEAD)
    t = counter_get(c, LRU_TAIL)
    w = counter_get(c, LRU_HOLE)
    s = counter_get(c, LRU_SCAN)
    ok = lru_in_bounds(h, w, s, t, queue_len)
    full = ok & (t - h > queue_len - num_pages)
    v = lru_move_down(h, tl.where(full, w, h), h, lru_queue_ptr, lru_pos_ptr, page_state_ptr, num_pages,
                      queue_len, BLOCK)
    v = lru_move_down(s, tl.where(full, t, s), v, lru_queue_ptr, lru_pos_ptr, page_state_ptr, num_pages,
                      queue_len, BLOCK)
    c = counter_add(c, ERR_CORRUPT_STATE, (~ok).to(tl.int64))
    c = counter_set(c, LRU_TAIL, tl.where(ok, tl.where(full, v, t), 0))
    c = counter_set(c, LRU_HOLE, tl.where(ok, tl.where(full, h, w), 0))
    c = counter_set(c, LRU_SCAN, tl.where(ok, tl.where(full, h, s), 0))
    return counter_set(c, LRU_HEAD, tl.where(ok, h, 0))


@triton.jit
def lru_push(p, mask, head, tail, lru_queue_ptr, lru_pos_ptr, queue_len):
    """Pages ``p`` (lanes ``mask``, distinct, in ``[0, P)``) get entries at ``tail`` on, in lane order
    (after ``lru_prepare``); one that would pass ``head + Q`` gets none. Returns ``(tail after them,
    pages left out)``."""
    w = mask.to(tl.int64)
    pos = tail + tl.cumsum(w, 0) - w
    fit = mask & (pos - head < queue_len)
    tl.store(lru_queue_ptr + pos % queue_len, p, mask=fit)
    tl.store(lru_pos_ptr + p, pos, mask=fit)
    return tail + tl.sum(fit.to(tl.int64)), tl.sum((mask & ~fit).to(tl.int64))


@triton.jit
def lru_clean(c, pushed, lru_queue_ptr, lru_pos_ptr, page_state_ptr, num_pages, queue_len, BLOCK: tl.constexpr):
    """Run last by every kernel that pushed ``pushed`` entries (the counters hold the tail after them):
    when the queue spans more than ``LRU_CLEAN_AT * P`` positions, the entries from the scan up to
    ``LRU_CLEAN_RATE * pushed`` on are read and the live ones move down to the hole; a scan that
    reaches the tail brings the tail back to the hole, and the next pass starts at the head.
    Returns the counters."""
    tl.debug_barrier()  # the pushes and the pages' new states are visible to every lane
    h = counter_get(c, LRU_HEAD)
    t = counter_get(c, LRU_TAIL)
    s = counter_get(c, LRU_SCAN)
    due = t - h > (tl.zeros((), tl.int64) + num_pages) * LRU_CLEAN_AT
    end = tl.where(due, tl.minimum(t, s + pushed * LRU_CLEAN_RATE), s)
    w = lru_move_down(s, end, counter_get(c, LRU_HOLE), lru_queue_ptr, lru_pos_ptr, page_state_ptr, num_pages,
                      queue_len, BLOCK)
    done = due & (end == t)
    c = counter_set(c, LRU_TAIL, tl.where(done, w, t))
    c = counter_set(c, LRU_HOLE, tl.where(done, h, w))
    return counter_set(c, LRU_SCAN, tl.where(done, h, end))


@triton.jit
def lru_pushed(c, tail, lost, ACTIVE, lru_queue_ptr, lru_pos_ptr, page_state_ptr, num_pages, queue_len,
               BLOCK: tl.constexpr):
    """The end of a kernel that pushed entries (``lru_push``) from the counters' tail up to ``tail``:
    the counters take ``tail``, the ``lost`` pages the queue left out count as ``corrupt_state``,
    and ``lru_clean`` runs (only when ``ACTIVE``: a call with no lanes changes nothing). Returns
    the counters."""
    pushed = tail - counter_get(c, LRU_TAIL)
    c = counter_set(c, LRU_TAIL, tail)
    c = counter_add(c, ERR_CORRUPT_STATE, lost)
    if ACTIVE:
        c = lru_clean(c, pushed, lru_queue_ptr, lru_pos_ptr, page_state_ptr, num_pages, queue_len, BLOCK)
    return c


@triton.jit
def count_freed(c, invalid, double, released, pushed, tail, lost, ACTIVE, lru_queue_ptr, lru_pos_ptr,
                page_state_ptr, num_pages, queue_len, CACHE: tl.constexpr, BLOCK: tl.constexpr):
    """The counters after a free's chunks (``apply_free``'s sums over them; ``invalid`` page ids
    from ``count_pages``/``claim_pages``): released pages counted FREE as pushed (a release the
    stack could not take, ``corrupt_state``) or, with ``CACHE``, CACHED with the LRU queue's new
    tail (``lru_pushed``); the peaks raised when ``ACTIVE``. The one free rule of ``free`` and
    ``release``/``truncate``. Returns the counters."""
    c = counter_add(c, ERR_INVALID_PAGE, invalid)
    c = counter_add(c, ERR_DOUBLE_FREE, double)
    c = counter_add(c, FREED, released)
    if CACHE:
        c = counter_add(c, CACHED_COUNT, released)
        c = lru_pushed(c, tail, lost, ACTIVE, lru_queue_ptr, lru_pos_ptr, page_state_ptr, num_pages, queue_len,
                       BLOCK)
    else:
        c = counter_add(c, FREE_COUNT, pushed)
        c = counter_add(c, ERR_CORRUPT_STATE, released - pushed)
    if ACTIVE:
        c = raise_peaks(c, num_pages)
    return c


@triton.jit
def apply_free(p, first, k, top, clock, free_stack_ptr, refcount_ptr, page_state_ptr, stamp_ptr, page_gen_ptr,
               num_pages, head, tail, lru_queue_ptr, lru_pos_ptr, queue_len, CACHE: tl.constexpr,
               BLOCK: tl.constexpr):
    """Drop k references of each distinct page p (lanes ``first``: each page's first occurrence, or
    with CACHE its last): the pool's free rule for one chunk.

    Pages reaching 0 become CACHED stamped ``clock``, with entries on the LRU queue from ``tail``
    on in lane order (CACHE: so a page is queued at its last occurrence, after every row's deeper
    pages when rows sharing it are released together), or FREE, their generation bumped, pushed at
    ``top + rank`` in lane order; a slot outside ``[0, P)`` (a corrupt free count) leaves the page
    FREE unpushed. Returns
    (double frees, pages released, pages pushed, the LRU tail after them, pages the queue left out).
    """
    used = first & (tl.load(page_state_ptr + p, mask=first, other=FREE) == USED)
    rc = tl.load(refcount_ptr + p, mask=used, other=0)
    d = tl.where(used, tl.minimum(k, rc), 0)
    # (in int64: k - d wraps in int32 when a corrupt refcount is near INT32_MIN)
    double = tl.sum(tl.where(first, k.to(tl.int64) - d.to(tl.int64), 0))
    tl.store(refcount_ptr + p, rc - d, mask=used)
    zero = used & (rc == d)
    z = zero.to(tl.int64)
    lost = tl.zeros((), tl.int64)
    if CACHE:
        tl.store(page_state_ptr + p, tl.full((BLOCK,), CACHED, tl.int8), mask=zero)
        tl.store(stamp_ptr + p, tl.zeros((BLOCK,), tl.int64) + clock, mask=zero)
        tail, lost = lru_push(p, zero, head, tail, lru_queue_ptr, lru_pos_ptr, queue_len)
        pushed = tl.sum(z)
    else:
        pos = top + tl.cumsum(z, 0) - z
        fit = zero & (pos >= 0) & (pos < num_pages)
        tl.store(free_stack_ptr + pos, p, mask=fit)
        tl.store(page_state_ptr + p, tl.full((BLOCK,), FREE, tl.int8), mask=zero)
        bump_gen(page_gen_ptr, p, zero)
        pushed = tl.sum(fit.to(tl.int64))
    return double, tl.sum(z), pushed, tail, lost


@triton.jit
def bump_gen(page_gen_ptr, p, mask):
    """Pages ``p`` (lanes ``mask``, distinct) just became FREE: generation +1, wrapping within the
    non-negative int32."""
    g = tl.load(page_gen_ptr + p, mask=mask, other=0)
    tl.store(page_gen_ptr + p, (g + 1) & GEN_MASK, mask=mask)


@triton.jit
def gate_free(c, num_pages, ACTIVE):
    """``(c, free)``: the free count if it is within ``[0, P]``, else 0 and one ``corrupt_state``
    (counted only when ``ACTIVE``, a call with lanes)."""
    free = counter_get(c, FREE_COUNT)
    good = (free >= 0) & (free <= num_pages)
    c = counter_add(c, ERR_CORRUPT_STATE, (~good & ACTIVE).to(tl.int64))
    return c, tl.where(good, free, 0)


@triton.jit
def pop_check(pos, take, free_stack_ptr, refcount_ptr, page_state_ptr, num_pages):
    """Pop the stack entries at ``pos`` (lanes ``take``), marking them USED with one reference.

    Returns ``(pages, corrupt)``: a position below 0 and an entry outside ``[0, P)`` yield -1
    without touching a page (no id outside the pool is handed out); each counts in ``corrupt``."""
    inpos = take & (pos >= 0)
    p = tl.load(free_stack_ptr + pos, mask=inpos, other=NULL_PAGE)
    good = take & (p >= 0) & (p < num_pages)
    tl.store(refcount_ptr + p, tl.zeros_like(p) + 1, mask=good)
    tl.store(page_state_ptr + p, tl.full(p.shape, USED, tl.int8), mask=good)
    return tl.where(take & ~good, NULL_PAGE, p), tl.sum((take & ~good).to(tl.int64))
