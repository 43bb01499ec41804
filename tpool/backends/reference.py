"""Reference backend: the pool's semantics in plain torch ops. The oracle.

Note: every function here is fixed-shape and reads nothing back on the host,
so it runs on any device (and could be captured in a CUDA graph), but it is
written to be read, not to be fast. The numba and Triton backends must give
the same outputs and the same state, bit for bit. The rules:

* Every call first advances the device clock by one; stamps written by a call
  carry the new clock value.
* ``alloc``: request ``i`` is granted iff no count in ``counts[:i+1]`` is
  negative and ``counts[0] + ... + counts[i]`` is at most the pages available
  (free, plus cached when ``evict``) and at most the output capacity. Granted
  pages are popped from the top of the free stack in request order. With
  ``evict``, the shortfall ``max(0, granted - free)`` is evicted first (see
  ``evict``), then popped like any free page.
* ``free`` / ``incref`` / ``touch`` act per distinct page; a page named ``k``
  times counts ``k`` times. ``-1`` is padding; any other id outside
  ``[0, num_pages)`` is an ``invalid_page`` error. Releasing more references
  than a page holds is a ``double_free`` per excess entry. Pages whose count
  reaches 0 are pushed on the free stack in the order of their first
  occurrence in the input, or become CACHED with the call's stamp and go on
  the LRU queue's tail in the order of their LAST occurrence (a page shared by
  rows released together is queued after every row's deeper pages, so
  eviction takes leaves before the prefix they hang from).
* The LRU queue (``lru_queue``, a ring of positions ``[LRU_HEAD, LRU_HOLE)`` and
  ``[LRU_SCAN, LRU_TAIL)``, see :mod:`tpool.kernels.layout`): a page gets an entry at
  the tail when it becomes CACHED or is touched while CACHED (``lru_pos[p]`` notes
  where); an entry is live while its page is CACHED and the entry is the page's
  latest. Every call that may push (``free``/``release`` with ``cache``, ``touch``)
  first checks the queue (``lru_prepare``: compacted whole when it spans more than
  ``Q - P`` positions) and, after its pushes, cleans a bounded stretch of it
  (``lru_clean``: at most ``LRU_CLEAN_RATE`` entries per entry pushed, once the queue
  spans more than ``LRU_CLEAN_AT * P``).
* Every page that becomes FREE (a last reference dropped without ``cache``, an
  eviction) has its generation bumped: ``page_gen = (page_gen + 1) & GEN_MASK``;
  nothing else changes a generation.
* ``evict``: the first live entries of the LRU queue go first (least recently
  cached or touched; with stamps from the clock alone, ascending stamp, ties in
  the order their call queued them); they are returned oldest first and pushed on the
  free stack in that order, and the queue's head moves past the last one.
* ``incref`` saturates: a count that would pass INT32_MAX stays at INT32_MAX;
  each reference that could not be added counts one ``refcount_overflow``.

Corrupt state (hand edits; every value used as an index is bounded first, and
each case counts ``corrupt_state``):

* the free count ``F`` outside ``[0, P]`` or the cached count ``C`` outside
  ``[0, P - F]``: ``alloc`` sees an empty pool (one count per call);
* a pop (alloc, extend, fork) whose stack position is below 0, or whose entry
  is outside ``[0, P)``, yields -1 without touching any page (one count each):
  no id outside the pool is handed out;
* a page whose last reference is dropped when the stack is full (or ``F < 0``)
  becomes FREE without being pushed (one count each);
* an eviction of ``m = min(n, C, out)`` pages that cannot be pushed
  (``F < 0`` or ``F > P - m``) or finds fewer than ``m`` live entries in the
  LRU queue (none when its positions are out of bounds: not
  ``0 <= head <= hole <= scan <= tail <= head + Q``, or ``tail > LRU_POS_LIMIT``)
  evicts nothing (one count);
* a call that may push and finds the queue's positions out of bounds empties it
  (all four 0, one count); a push that would pass ``head + Q`` (none can after
  ``lru_prepare``) leaves the page without an entry (one count each).
"""

import torch

from tpool.backends.contract import BoundByTensors, PoolByFunctions, locked
from tpool.kernels import layout as L
from tpool.kernels.layout import INT32_MAX


def _put(dst: torch.Tensor, idx: torch.Tensor, val, mask: torch.Tensor) -> None:
    """``dst[idx[mask]] = val[mask]`` with fixed shapes (masked lanes hit a spare slot)."""
    n = dst.numel()
    ext = torch.cat([dst, dst.new_zeros(1)])
    # A Python number becomes a device tensor by a fill, never by a host-to-device copy (on
    # CUDA, torch.as_tensor of an int copies pageable memory and syncs the stream).
    val = (val.to(dst.device, dst.dtype).expand(idx.shape) if isinstance(val, torch.Tensor)
           else torch.full(idx.shape, val, dtype=dst.dtype, device=dst.device))
    ext.index_put_((torch.where(mask, idx.long(), n),), val)
    dst.copy_(ext[:n])


def count_overflow(c: torch.Tensor, source: int, n) -> None:
    """``n`` more ``out_overflow`` in the counters ``c``, counted again in slot ``source`` (the buffer)."""
    c[L.ERR_OUT_OVERFLOW] += n
    c[source] += n


def raise_peaks(st) -> None:
    c = st.counters
    used = st.num_pages - c[L.FREE_COUNT] - c[L.CACHED_COUNT]
    c[L.USED_PEAK] = torch.maximum(c[L.USED_PEAK], used)
    c[L.CACHED_PEAK] = torch.maximum(c[L.CACHED_PEAK], c[L.CACHED_COUNT])


def count_pages(st, pages: torch.Tensor, last: bool = False):
    """Per input lane: page index (clamped), first-occurrence flag (``last``: last-occurrence flag),
    occurrences, invalid flag."""
    P, N = st.num_pages, pages.numel()
    p = pages.long()
    valid = (p >= 0) & (p < P)
    invalid = (p != L.NULL_PAGE) & ~valid
    idx = torch.where(valid, p, P)
    lane = torch.arange(N, device=p.device)
    occ = torch.zeros(P + 1, dtype=torch.int64, device=p.device).scatter_add_(0, idx, torch.ones_like(idx))
    init, how = (-1, "amax") if last else (N, "amin")
    pick = torch.full((P + 1,), init, dtype=torch.int64, device=p.device).scatter_reduce_(0, idx, lane, how)
    is_first = valid & (pick[idx] == lane)
    return idx.clamp(max=P - 1), is_first, occ[idx], invalid


def _push(st, pages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Push ``pages[mask]`` (distinct) on the free stack in lane order; mark them FREE, bump their
    generations. Returns how many.

    A page whose stack slot would fall outside ``[0, P)`` (a corrupt free count) becomes
    FREE unpushed and counts ``corrupt_state``."""
    c = st.counters
    top = c[L.FREE_COUNT]
    pos = top + torch.cumsum(mask.long(), 0) - mask.long()
    fit = mask & (pos >= 0) & (pos < st.num_pages)
    _put(st.free_stack, pos.clamp(min=0, max=st.num_pages - 1), pages, fit)
    _put(st.page_state, pages, L.FREE, mask)
    _put(st.page_gen, pages, (st.page_gen[pages] + 1) & L.GEN_MASK, mask)
    n = mask.sum()
    c[L.FREE_COUNT] += fit.sum()
    c[L.ERR_CORRUPT_STATE] += (mask & ~fit).sum()
    return n


def pool_gate(st):
    """``(ok, free, cached)``: the free and cached counts if they are within bounds, else zeros."""
    c, P = st.counters, st.num_pages
    f, k = c[L.FREE_COUNT], c[L.CACHED_COUNT]
    ok = (f >= 0) & (f <= P) & (k >= 0) & (k <= P - f)
    return ok, torch.where(ok, f, 0), torch.where(ok, k, 0)


def free_gate(st):
    """``(ok, free)``: the free count if it is within ``[0, P]``, else 0."""
    f = st.counters[L.FREE_COUNT]
    ok = (f >= 0) & (f <= st.num_pages)
    return ok, torch.where(ok, f, 0)


def pop_pages(st, depth: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Pages at ``depth`` below the stack top (masked; -1 elsewhere), marked USED with one reference.

    A position below 0 and an entry outside ``[0, P)`` yield -1 without touching any page (no
    id outside the pool is handed out); each counts ``corrupt_state``."""
    P = st.num_pages
    q = st.counters[L.FREE_COUNT] - 1 - depth
    inpos = mask & (q >= 0) & (q < P)
    pages = torch.where(inpos, st.free_stack[q.clamp(min=0, max=P - 1)].long(), L.NULL_PAGE)
    good = mask & (pages >= 0) & (pages < P)
    st.counters[L.ERR_CORRUPT_STATE] += (mask & ~good).sum()
    idx = pages.clamp(min=0, max=P - 1)
    _put(st.refcount, idx, 1, good)
    _put(st.page_state, idx, L.USED, good)
    return torch.where(good, pages, L.NULL_PAGE)


def lru_bounds(st) -> tuple:
    """``(ok, head, hole, scan, tail)``: the LRU queue's positions, and whether they are in bounds
    (``0 <= head <= hole <= scan <= tail <= head + Q``, ``tail <= LRU_POS_LIMIT``)."""
    c, Q = st.counters, st.lru_queue.numel()
    h, t, w, s = c[L.LRU_HEAD:L.LRU_SCAN + 1].clone()  # (slots HEAD, TAIL, HOLE, SCAN; copies)
    ok = (h >= 0) & (h <= w) & (w <= s) & (s <= t) & (t <= L.LRU_POS_LIMIT) & (t - h <= Q)
    return ok, h, w, s, t


def lru_live(st, checked: bool = False) -> tuple:
    """``(live, pages, pos)`` over the LRU queue in position order (``pos = head + arange(Q)``, slot
    ``pos % Q``): which entries are live (``kernels.layout``), the page each names (clamped into
    ``[0, P)``), and the positions; none live when the bounds are broken, unless ``checked``: the
    call checked them first (``lru_prepare``) and only its pushes moved the tail since, maybe past
    ``LRU_POS_LIMIT`` (the next call that may push empties the queue; this one's clean reads its
    stretch as the other backends do)."""
    P, q = st.num_pages, st.lru_queue
    ok, h, w, s, t = lru_bounds(st)
    ok = ok | checked
    pos = h.clamp(min=0, max=L.LRU_POS_LIMIT) + torch.arange(q.numel(), device=q.device)
    p = q[pos % q.numel()].long()
    idx = p.clamp(min=0, max=P - 1)
    live = (ok & ((pos < w) | (pos >= s)) & (pos < t) & (p >= 0) & (p < P)
            & (st.page_state[idx] == L.CACHED) & (st.lru_pos[idx] == pos))
    return live, idx, pos


def _lru_move(st, move: torch.Tensor, idx: torch.Tensor, to) -> torch.Tensor:
    """The entries ``move`` (live, in position order) go to positions ``to, to + 1, ...``, in order
    (each at or below where it was); returns how many moved."""
    q, w = st.lru_queue, move.long()
    dst = to + torch.cumsum(w, 0) - w
    _put(q, dst % q.numel(), idx, move)
    _put(st.lru_pos, idx, dst, move)
    return w.sum()


def lru_prepare(st) -> None:
    """First in every call that may push: a queue out of bounds is emptied (all positions 0, one
    ``corrupt_state``); one spanning more than ``Q - P`` positions is compacted at once (the live
    entries moved down to the head, in order; no gap)."""
    c, P, Q = st.counters, st.num_pages, st.lru_queue.numel()
    ok, h, w, s, t = lru_bounds(st)
    c[L.ERR_CORRUPT_STATE] += (~ok).long()
    full = ok & (t - h > Q - P)
    live, idx, _ = lru_live(st)
    n = _lru_move(st, live & full, idx, h)
    c[L.LRU_TAIL] = torch.where(ok, torch.where(full, h + n, t), 0)
    c[L.LRU_HOLE] = torch.where(ok, torch.where(full, h, w), 0)
    c[L.LRU_SCAN] = torch.where(ok, torch.where(full, h, s), 0)
    c[L.LRU_HEAD] = torch.where(ok, h, 0)


def lru_push(st, idx: torch.Tensor, mask: torch.Tensor) -> None:
    """Pages ``idx[mask]`` (distinct, in ``[0, P)``) get entries at the LRU queue's tail, in lane order
    (after ``lru_prepare``); one that would pass ``head + Q`` gets none (one ``corrupt_state``)."""
    c, q = st.counters, st.lru_queue
    w = mask.long()
    pos = c[L.LRU_TAIL] + torch.cumsum(w, 0) - w
    fit = mask & (pos - c[L.LRU_HEAD] < q.numel())
    _put(q, pos % q.numel(), idx, fit)
    _put(st.lru_pos, idx, pos, fit)
    c[L.ERR_CORRUPT_STATE] += (mask & ~fit).sum()
    c[L.LRU_TAIL] += fit.sum()


def lru_clean(st, pushed) -> None:
    """Last in every call that pushed ``pushed`` entries: when the queue spans more than
    ``LRU_CLEAN_AT * P`` positions, the entries in ``[scan, scan + LRU_CLEAN_RATE * pushed)`` are read
    and the live ones move down to the hole, in order; a scan that reaches the tail brings the tail
    back to the hole, and the next pass starts at the head."""
    c = st.counters
    _, h, w, s, t = lru_bounds(st)
    due = t - h > L.LRU_CLEAN_AT * st.num_pages
    end = torch.where(due, torch.minimum(t, s + L.LRU_CLEAN_RATE * pushed), s)
    live, idx, pos = lru_live(st, checked=True)
    w = w + _lru_move(st, live & (pos >= s) & (pos < end), idx, w)
    done = due & (end == t)
    c[L.LRU_TAIL] = torch.where(done, w, t)
    c[L.LRU_HOLE] = torch.where(done, h, w)
    c[L.LRU_SCAN] = torch.where(done, h, end)


def evict_oldest(st, out: torch.Tensor, n) -> None:
    """Evict the ``min(n, cached)`` oldest cached pages (the LRU queue's first live entries) into ``out``
    (padded with -1); the head moves past the last one (the hole and the scan with it, when behind)."""
    P, c = st.num_pages, st.counters
    live, idx, pos = lru_live(st)
    rank = torch.cumsum(live.long(), 0) - live.long()
    f = c[L.FREE_COUNT]
    n = n.long() if isinstance(n, torch.Tensor) else torch.full((), n, dtype=torch.int64, device=out.device)
    m = torch.minimum(n, c[L.CACHED_COUNT]).clamp(min=0, max=out.numel())
    bad = (m > 0) & ((f < 0) | (f > P - m) | (live.sum() < m))  # no sum: it could wrap
    c[L.ERR_CORRUPT_STATE] += bad.long()
    m = torch.where(bad, 0, m)
    take = live & (rank < m)
    out.fill_(L.NULL_PAGE)
    _put(out, rank.clamp(max=out.numel() - 1), idx, take)
    h = torch.where(m > 0, torch.where(take, pos + 1, 0).amax(), c[L.LRU_HEAD])
    c[L.LRU_HOLE] = torch.where(m > 0, torch.maximum(c[L.LRU_HOLE], h), c[L.LRU_HOLE])
    c[L.LRU_SCAN] = torch.where(m > 0, torch.maximum(c[L.LRU_SCAN], h), c[L.LRU_SCAN])
    c[L.LRU_HEAD] = h
    lanes = torch.arange(out.numel(), device=out.device)
    m = _push(st, out.long().clamp(min=0), lanes < m)
    c[L.CACHED_COUNT] -= m
    c[L.EVICTED] += m


def alloc(st, counts, out_pages, out_indptr, out_ok, out_evicted, evict: bool) -> None:
    """Grant ``counts[i]`` pages per request, first come first served (see module note)."""
    c = st.counters
    c[L.CLOCK] += 1
    B, M, BO = counts.numel(), out_pages.numel(), out_ok.numel()
    if B > BO:  # more requests than the outputs have lanes (the façade refuses it): those past BO fail
        count_overflow(c, L.OVERFLOW_PAGES, 1)
        c[L.FAILED_REQUESTS] += B - BO
        B, counts = BO, counts[:BO]
    n = counts.long()
    neg = n < 0
    bad = torch.cumsum(neg.long(), 0) > 0
    csum = torch.cumsum(n.clamp(min=0), 0)
    gate, free, cached = pool_gate(st)
    c[L.ERR_CORRUPT_STATE] += (~gate).long()
    avail = free + cached if evict else free
    fits = ~bad & (csum <= avail)
    ok = fits & (csum <= M)
    granted = torch.where(ok, n, 0)
    total = granted.sum()
    c[L.ERR_BAD_COUNT] += neg.sum()
    count_overflow(c, L.OVERFLOW_PAGES, (fits & ~ok).sum())
    c[L.FAILED_REQUESTS] += (~ok).sum()
    out_ok.fill_(False)
    out_ok[:B] = ok
    out_indptr.fill_(0)
    out_indptr[1:B + 1] = torch.cumsum(granted, 0)
    out_indptr[B + 1:] = total
    if evict:
        evict_oldest(st, out_evicted, (total - free).clamp(min=0))
    else:
        out_evicted.fill_(L.NULL_PAGE)
    j = torch.arange(M, device=out_pages.device)
    out_pages.copy_(pop_pages(st, j, j < total))
    c[L.FREE_COUNT] -= total
    c[L.ALLOCATED] += total
    raise_peaks(st)


def free(st, pages, cache: bool) -> None:
    """Drop one reference per entry; pages reaching 0 go FREE (or CACHED with ``cache``)."""
    st.counters[L.CLOCK] += 1
    apply_free(st, pages, cache)


def apply_free(st, pages, cache: bool) -> None:
    """``free`` without the clock tick (page tables call it inside their own step). Each distinct
    page is applied at one lane: its first occurrence (the free stack's order), or with ``cache`` its
    last (the LRU queue's order: a page shared by rows released together goes after all of them)."""
    c = st.counters
    if cache:
        lru_prepare(st)
        tail = c[L.LRU_TAIL].clone()
    idx, lead, k, invalid = count_pages(st, pages, last=cache)
    c[L.ERR_INVALID_PAGE] += invalid.sum()
    used = lead & (st.page_state[idx] == L.USED)
    rc = st.refcount[idx].long()
    d = torch.where(used, torch.minimum(k, rc), 0)
    c[L.ERR_DOUBLE_FREE] += torch.where(lead, k - d, 0).sum()
    _put(st.refcount, idx, rc - d, used)
    zero = used & (rc == d)
    c[L.FREED] += zero.sum()
    if cache:
        _put(st.page_state, idx, L.CACHED, zero)
        _put(st.stamp, idx, c[L.CLOCK], zero)
        lru_push(st, idx, zero)
        lru_clean(st, c[L.LRU_TAIL] - tail)
        c[L.CACHED_COUNT] += zero.sum()
    else:
        _push(st, idx, zero)
    raise_peaks(st)


def incref(st, pages) -> None:
    """Add one reference per entry; a CACHED page is revived, a FREE page is an error."""
    st.counters[L.CLOCK] += 1
    apply_incref(st, pages)


def apply_incref(st, pages) -> None:
    """``incref`` without the clock tick."""
    c = st.counters
    idx, first, k, invalid = count_pages(st, pages)
    c[L.ERR_INVALID_PAGE] += invalid.sum()
    state = st.page_state[idx]
    used, cached = first & (state == L.USED), first & (state == L.CACHED)
    c[L.ERR_USE_AFTER_FREE] += torch.where(first & (state == L.FREE), k, 0).sum()
    unknown = first & (state != L.FREE) & (state != L.USED) & (state != L.CACHED)
    c[L.ERR_CORRUPT_STATE] += torch.where(unknown, k, 0).sum()
    rc = st.refcount[idx].long() + k
    c[L.ERR_REFCOUNT_OVERFLOW] += torch.where(used | cached, (rc - INT32_MAX).clamp(min=0), 0).sum()
    _put(st.refcount, idx, rc.clamp(max=INT32_MAX), used | cached)
    _put(st.page_state, idx, L.USED, cached)
    c[L.CACHED_COUNT] -= cached.sum()
    c[L.REVIVED] += cached.sum()
    raise_peaks(st)


def touch(st, pages) -> None:
    """Stamp USED and CACHED pages with the clock (LRU refresh); a FREE page, or one in no known state, is an error."""
    c = st.counters
    c[L.CLOCK] += 1
    lru_prepare(st)
    tail = c[L.LRU_TAIL].clone()
    idx, first, k, invalid = count_pages(st, pages)
    c[L.ERR_INVALID_PAGE] += invalid.sum()
    state = st.page_state[idx]
    known = (state == L.USED) | (state == L.CACHED)
    c[L.ERR_USE_AFTER_FREE] += torch.where(first & (state == L.FREE), k, 0).sum()
    c[L.ERR_CORRUPT_STATE] += torch.where(first & (state != L.FREE) & ~known, k, 0).sum()
    _put(st.stamp, idx, c[L.CLOCK], first & known)
    lru_push(st, idx, first & (state == L.CACHED))
    lru_clean(st, c[L.LRU_TAIL] - tail)


def evict(st, out) -> None:
    """Evict up to ``out.numel()`` cached pages, oldest first, into ``out``."""
    st.counters[L.CLOCK] += 1
    evict_oldest(st, out, out.numel())


# ------------------------------------------------------------------ the backend
class Pool(PoolByFunctions):
    """The pool's operations as plain torch calls (the contract: ``tpool.backends.contract.PoolOps``)."""

    name = "reference"

    def __init__(self, st):
        super().__init__(st, alloc, free, incref, touch, evict)


class Table(BoundByTensors):
    """A page table's operations as plain torch calls (rules: :mod:`tpool.backends.reference_table`)."""

    name = "reference"

    def __init__(self, st, ts):
        self.st, self.ts = st, ts

    @locked
    def extend(self, req_ids, num_tokens, slots, ok, meta=None):
        reference_table.extend(self.st, self.ts, req_ids, num_tokens, slots, ok, meta)

    @locked
    def release(self, req_ids, cache):
        reference_table.release(self.st, self.ts, req_ids, cache)

    @locked
    def truncate(self, req_ids, new_lens, drop=False):
        reference_table.truncate(self.st, self.ts, req_ids, new_lens, drop)

    @locked
    def fork(self, src_ids, dst_ids, lens, ok, cow_src, cow_dst):
        reference_table.fork(self.st, self.ts, src_ids, dst_ids, lens, ok, cow_src, cow_dst)

    @locked
    def flashinfer_csr(self, req_ids, indptr, indices, last_page_len, count=True, kv_lens=None):
        reference_table.flashinfer_csr(self.st, self.ts, req_ids, indptr, indices, last_page_len, count, kv_lens)

    @locked
    def revive(self, row, pages, memos=(), gens=None):  # (no run is kept: the memos need nothing)
        reference_table.revive(self.st, self.ts, row, pages, gens)

    @locked
    def block_table_rows(self, req_ids, out):
        reference_table.block_table_rows(self.st, self.ts, req_ids, out)


from tpool.backends import reference_table  # noqa: E402  (it imports the pool rules above)
