"""Reference page-table operations in plain torch ops: the oracle for the table kernels.

Note: one call is one step of the device clock, whatever pool work it does
inside. Request ids are rows of ``block_table``; ``-1`` is padding (nothing
happens, ``ok`` is False, no error). An id outside ``[0, R)`` or named twice
in one call (after its first occurrence) is a ``bad_request`` and skipped; the
table's ``claim`` scratch takes part as the kernels' ``atomic_min`` (a value
below a request's first lane leaves it no valid lane) and is reset after.
Every state read happens before any write, so a call behaves as if all its
lanes saw the table as it was when the call began.

* ``extend``: lane ``i`` appends ``n_i`` tokens; it needs
  ``ceil((L+n)/ps) - ceil(L/ps)`` new pages, granted first come first served
  over the lanes that need pages (as ``PagePool.alloc``), popped from the free
  stack in lane order: once a lane's pages do not fit, no later lane that
  needs pages gets any, but a lane that needs none is never refused for want
  of pages. Tokens are laid out in lane order, ``n_i`` slots per lane
  including padding and failed lanes (their slots are -1); a lane whose tokens
  do not fit the slot buffer fails with ``out_overflow`` (a lane of no tokens
  always fits). A step also writes
  the attention metadata: ``positions`` (each slot's position in its
  sequence, -1 where the slot is -1), ``qo_indptr`` (the running sum of
  ``max(n_i, 0)``, capped at the slot buffer's length) and ``kv_lens`` (each
  lane's length after the call; a failed lane keeps its length; padding, bad
  ids and corrupt rows 0).
* ``flashinfer_csr`` (and a step's CSR, which lists each lane's ``kv_lens``
  tokens: none for a repeated id): requests in lane order; when their
  pages pass the capacity of ``indices``, the first request whose pages do
  not all fit and every later one are exported as empty (``kv_lens`` 0 in a
  step), one ``out_overflow`` per call: ``indptr`` never points past the
  buffer. A step's extend has happened for those lanes all the same.
* ``release`` / ``truncate``: the pages past the new length (all of them for
  release) are freed as ONE ``free`` over the lanes' pages, lane by lane, in
  table order (a release with ``cache``: each lane's pages from its row's last
  page down, so the LRU queue evicts a request's tail before its head); their
  entries become -1.
* ``fork``: ``dst`` (empty at call start) takes the first ``lens`` tokens of
  ``src``: whole pages are shared (one reference each), a partial last page
  gets a fresh page (popped in lane order, first come first served over the
  lanes that need one; a lane sharing whole pages only is never refused for
  want of pages) whose pair ``(src page, dst page)`` is returned for the KV
  copy. A page the lane reads (the shared range, and the partial page it
  copies) that is not USED (freed or cached through the pool while the row
  still names it) fails the lane: ``ok`` False, ``dst`` left empty, nothing
  increffed, one ``use_after_free`` per such entry. Sharing saturates
  reference counts like ``incref`` (``refcount_overflow``).

* ``revive``: an empty row ``r`` takes ``k`` given pages (a prefix-cache hit) and the
  length ``k * page_size``, all or none. Every page must be USED or CACHED (not
  FREE, not outside the pool, not -1) and named once, and, given recorded
  generations (int32 ``[k]``), have the one recorded for it (``page_gen``: a page
  of another one was freed since); then each gains one
  reference (a CACHED page is revived, as by ``incref``) and the row holds them.
  Otherwise no page is taken, the row stays empty (its first ``k`` entries -1,
  length 0), and the entries that could not be taken are counted as ``incref``
  counts them: ``invalid_page`` for an id outside the pool, ``use_after_free``
  for a FREE page or a USED / CACHED one of another generation than recorded,
  ``corrupt_state`` for a page in no known state, once per
  entry. A prefix has no padding and names each page once: a -1 (not padding
  here) counts one ``invalid_page``, and so does each entry naming a page an
  earlier entry names, where it would be taken otherwise (an entry counts one
  error at most; a refused call at least one). A row outside ``[0, R)``
  is a ``bad_request``, else ``k > max_pages`` a ``table_overflow``, else a
  row that is not empty (length not 0) a ``bad_request``: then nothing else
  happens (the clock ticks).

Corrupt state (hand edits), counted as ``corrupt_state`` and never used as an
index: a request length outside ``[0, max_pages * page_size]`` makes its lane
fail and leaves its row alone (every operation; ``flashinfer_csr`` exports it
as empty); a fork whose shared range or partial page holds an id outside ``[0, P)`` fails
(one count per lane); a free count outside ``[0, P]`` makes ``extend`` and
``fork`` see an empty stack (one count per call with lanes); a token of
``extend`` (or a step) whose page id is outside ``[0, P)`` gets slot and position
-1 (one count per such slot; the lane and the row are as otherwise), so slots
never point outside the K/V cache; a request whose pages hold such an id is exported
by ``flashinfer_csr`` (and a step's CSR) as empty, with ``kv_lens`` 0 in a step (one count
per request, in a step too), so no page id outside the pool reaches an attention kernel; pops and pushes
follow the pool's rules (:mod:`tpool.backends.reference`).
"""

import torch

from tpool.kernels import layout as L
from tpool.kernels.layout import INT32_MAX
from tpool.state import set_cell
from tpool.backends.reference import (_put, apply_free, apply_incref, count_overflow, count_pages, free_gate,
                                     pop_pages, raise_peaks)


def _cdiv(a, b):
    return (a + b - 1) // b


def claim_requests(ts, ids, dedupe=True):
    """Per lane: clamped row, valid flag, padding flag, bad flag (counted as bad_request)."""
    R, B = ts.max_requests, ids.numel()
    r = ids.long()
    pad = r == L.NULL_PAGE
    inr = (r >= 0) & (r < R)
    idx = torch.where(inr, r, R)
    valid = inr
    if dedupe:
        # The table's claim scratch (INT32_MAX between calls) takes part as the kernels' atomic_min: a
        # value a hand edit left below a request's first lane leaves it no valid lane. Then reset.
        lane = torch.arange(B, device=r.device)
        held = torch.cat([ts.claim, ts.claim.new_full((1,), B)])
        first = held.long().scatter_reduce_(0, idx, lane, "amin")
        valid = inr & (first[idx] == lane)
        ts.claim.copy_(held.scatter_(0, idx, INT32_MAX)[:R])
    return idx.clamp(max=R - 1), valid, pad, ~pad & ~valid


def _pop(st, offsets, mask):
    """Pages at stack offsets ``offsets`` from the top (masked), marked USED with one reference."""
    return pop_pages(st, offsets, mask)


def length_ok(ts, lengths):
    """Lengths a row can hold: ``[0, max_pages * page_size]`` (others are corrupt state)."""
    return (lengths >= 0) & (lengths <= ts.max_pages * ts.page_size)


def _take(st, n):
    c = st.counters
    c[L.FREE_COUNT] -= n
    c[L.ALLOCATED] += n
    raise_peaks(st)


def extend(st, ts, req_ids, num_tokens, slots, ok, meta=None):
    """``meta``: a step's ``(positions, qo_indptr, kv_lens)`` to write too, or None."""
    c, MP, ps = st.counters, ts.max_pages, ts.page_size
    c[L.CLOCK] += 1
    B, T, dev = req_ids.numel(), slots.numel(), slots.device
    if B == 0:
        slots.fill_(L.NULL_PAGE)
        if meta is not None:
            meta[0].fill_(L.NULL_PAGE)
            meta[1].zero_()
        return
    rr, valid, pad, bad = claim_requests(ts, req_ids)
    c[L.ERR_BAD_REQUEST] += bad.sum()
    Ln = ts.seq_lens[rr].long()
    lok = length_ok(ts, Ln)
    c[L.ERR_CORRUPT_STATE] += (valid & ~lok).sum()
    valid = valid & lok
    gate, free = free_gate(st)
    c[L.ERR_CORRUPT_STATE] += (~gate).long()
    n = num_tokens.long()
    neg = valid & (n < 0)
    c[L.ERR_BAD_COUNT] += neg.sum()
    n = n.clamp(min=0)
    have, want = _cdiv(Ln, ps), _cdiv(Ln + n, ps)
    over = valid & ~neg & (want > MP)
    c[L.ERR_TABLE_OVERFLOW] += over.sum()
    cand = valid & ~neg & ~over
    need = torch.where(cand, want - have, 0)
    csum = torch.cumsum(need, 0)
    tok_end = torch.cumsum(n, 0)
    fits = cand & ((need == 0) | (csum <= free))  # a lane needing no page never waits on others
    okv = fits & ((n == 0) | (tok_end <= T))  # a lane of no tokens has none to overflow
    count_overflow(c, L.OVERFLOW_SLOTS, (fits & ~okv).sum())
    c[L.FAILED_REQUESTS] += (~pad & ~okv).sum()
    # New pages, lane by lane: [B, MP] grid, lane i takes k < need_i.
    k = torch.arange(MP, device=dev)
    take = okv[:, None] & (k < need[:, None])
    pages = _pop(st, (csum - need)[:, None] + k, take)
    cell = rr[:, None] * MP + (have[:, None] + k).clamp(max=MP - 1)
    _put(ts.block_table.view(-1), cell.flatten(), pages.flatten(), take.flatten())
    _take(st, torch.where(okv, need, 0).sum())
    # Slots: token u belongs to the lane whose token range holds it.
    u = torch.arange(T, device=dev)
    lane = torch.searchsorted(tok_end, u, right=True).clamp(max=B - 1)
    t = u - (tok_end - n)[lane]
    s_ok = (u < tok_end[-1]) & okv[lane]
    pos = Ln[lane] + t
    page = ts.block_table[rr[lane], (pos // ps).clamp(min=0, max=MP - 1)].long()
    made = s_ok & (page >= 0) & (page < st.num_pages)  # no slot from a page id outside the pool
    c[L.ERR_CORRUPT_STATE] += (s_ok & ~made).sum()
    slots.copy_(torch.where(made, page * ps + pos % ps, L.NULL_PAGE))
    _put(ts.seq_lens, rr, Ln + n, okv)
    ok.copy_(okv)
    if meta is not None:
        positions, qo_indptr, kv_lens = meta
        positions.copy_(torch.where(made, pos, L.NULL_PAGE))
        set_cell(qo_indptr, 0, 0)  # (not qo_indptr[0] = 0: a host-to-device copy, refused inside graph capture)
        qo_indptr[1:] = tok_end.clamp(max=T)
        kv_lens.copy_(torch.where(okv, Ln + n, torch.where(valid, Ln, 0)))


def _drop_tail(st, ts, rr, act, keep_tokens, cache):
    """Free the pages of rows ``rr`` past ``keep_tokens`` (lanes in ``act``); reset those entries."""
    MP, ps = ts.max_pages, ts.page_size
    rows = ts.block_table[rr].long()
    have = _cdiv(ts.seq_lens[rr].long(), ps)
    k = torch.arange(MP, device=rows.device)
    drop = act[:, None] & (k >= _cdiv(keep_tokens, ps)[:, None]) & (k < have[:, None])
    # lane by lane, in column order; into the cache each row's last page first (so it is evicted first)
    dropped = torch.where(drop, rows, L.NULL_PAGE)
    apply_free(st, (dropped.flip(1) if cache else dropped).flatten(), cache)
    cell = (rr[:, None] * MP + k).flatten()
    _put(ts.block_table.view(-1), cell, L.NULL_PAGE, drop.flatten())
    _put(ts.seq_lens, rr, keep_tokens, act)
    raise_peaks(st)


def release(st, ts, req_ids, cache):
    st.counters[L.CLOCK] += 1
    if req_ids.numel() == 0:
        return
    rr, valid, _, bad = claim_requests(ts, req_ids)
    st.counters[L.ERR_BAD_REQUEST] += bad.sum()
    lok = length_ok(ts, ts.seq_lens[rr].long())
    st.counters[L.ERR_CORRUPT_STATE] += (valid & ~lok).sum()
    _drop_tail(st, ts, rr, valid & lok, torch.zeros_like(rr), cache)


def truncate(st, ts, req_ids, new_lens, drop=False):
    """``new_lens``: each lane's length after the call, or with ``drop`` the tokens to remove
    from its end (the new length is then the row's length less that, read as the call starts)."""
    c = st.counters
    c[L.CLOCK] += 1
    if req_ids.numel() == 0:
        return
    rr, valid, _, bad = claim_requests(ts, req_ids)
    c[L.ERR_BAD_REQUEST] += bad.sum()
    lok = length_ok(ts, ts.seq_lens[rr].long())
    c[L.ERR_CORRUPT_STATE] += (valid & ~lok).sum()
    valid = valid & lok
    length = ts.seq_lens[rr].long()
    n = length - new_lens.long() if drop else new_lens.long()
    badlen = valid & ((n < 0) | (n > length))
    badlen = badlen | (valid & ~badlen & ends_in_shared_page(st, ts, rr, n, length))
    c[L.ERR_BAD_LENGTH] += badlen.sum()
    _drop_tail(st, ts, rr, valid & ~badlen, n.clamp(min=0), False)


def ends_in_shared_page(st, ts, rr, n, length):
    """Lanes whose truncate to ``n`` would end inside a page another request also holds.

    The request's next token would be written into that page, over the other holder's
    K/V (a fork's shared prefix, a revived cached page): such a truncate is a
    ``bad_length`` and leaves the request unchanged. Lanes with ``0 <= n <= length``
    are the ones asked about; a page id outside the pool is not read (not shared).
    """
    ps, MP, P = ts.page_size, ts.max_pages, st.num_pages
    inside = (n >= 0) & (n < length) & (n % ps != 0)
    page = ts.block_table[rr, (n.clamp(min=0) // ps).clamp(max=MP - 1)].long()
    known = (page >= 0) & (page < P)
    return inside & known & (st.refcount[page.clamp(0, P - 1)] > 1)


def fork(st, ts, src_ids, dst_ids, lens, ok, cow_src, cow_dst):
    c, MP, ps = st.counters, ts.max_pages, ts.page_size
    c[L.CLOCK] += 1
    B = dst_ids.numel()
    if B == 0:
        return
    rd, vd, pad, _ = claim_requests(ts, dst_ids)
    rs, vs, _, _ = claim_requests(ts, src_ids, dedupe=False)
    bad = ~pad & ~(vd & vs & (rs != rd) & (ts.seq_lens[rd] == 0))
    c[L.ERR_BAD_REQUEST] += bad.sum()
    Ls = ts.seq_lens[rs].long()
    lok = length_ok(ts, Ls)
    c[L.ERR_CORRUPT_STATE] += (~pad & ~bad & ~lok).sum()
    n = lens.long()
    badlen = ~pad & ~bad & lok & ((n < 0) | (n > Ls))
    c[L.ERR_BAD_LENGTH] += badlen.sum()
    cand = ~pad & ~bad & lok & ~badlen
    n = n.clamp(min=0)
    full = n // ps
    src_rows = ts.block_table[rs].long()
    k = torch.arange(MP, device=src_rows.device)
    # The pages read (the shared range and a partial last page, which is copied) must be live:
    # an id outside [0, P) is corrupt state, a page that is not USED was freed under the row
    # (use after free); either fails the lane.
    inr = cand[:, None] & (k < _cdiv(n, ps)[:, None])
    pid_ok = (src_rows >= 0) & (src_rows < st.num_pages)
    wild = (inr & ~pid_ok).any(1)
    stale = inr & pid_ok & (st.page_state[src_rows.clamp(min=0, max=st.num_pages - 1)] != L.USED)
    c[L.ERR_CORRUPT_STATE] += wild.sum()
    c[L.ERR_USE_AFTER_FREE] += stale.sum()
    cand = cand & ~wild & ~stale.any(1)
    gate, free = free_gate(st)
    c[L.ERR_CORRUPT_STATE] += (~gate).long()
    part = cand & (n % ps != 0)
    need = part.long()
    csum = torch.cumsum(need, 0)
    okv = cand & ((need == 0) | (csum <= free))  # a lane needing no page never waits on others
    c[L.FAILED_REQUESTS] += (~pad & ~okv).sum()
    shared = okv[:, None] & (k < full[:, None])
    apply_incref(st, torch.where(shared, src_rows, L.NULL_PAGE).flatten())
    copy = okv & part
    new = _pop(st, csum - need, copy)
    dst_cells = (rd[:, None] * MP + k).flatten()
    _put(ts.block_table.view(-1), dst_cells, src_rows.flatten(), shared.flatten())
    _put(ts.block_table.view(-1), rd * MP + full.clamp(max=MP - 1), new, copy)
    _take(st, copy.sum())
    _put(ts.seq_lens, rd, n, okv)
    ok.copy_(okv)
    old = torch.where(copy, src_rows.gather(1, full.clamp(max=MP - 1)[:, None])[:, 0], L.NULL_PAGE)
    # a copy only between page ids of the pool: the source page was checked above, a wild pop counted itself
    pair = copy & (new >= 0) & (new < st.num_pages)
    cow_src.copy_(torch.where(pair, old, L.NULL_PAGE))
    cow_dst.copy_(torch.where(pair, new, L.NULL_PAGE))


def revive(st, ts, row, pages, gens=None):
    """Row ``row`` (a host int) takes ``pages`` (int32 ``[k]``) and ``k * page_size`` tokens, all or none;
    with ``gens`` (int32 ``[k]``) only pages whose generation is the one recorded there."""
    c, P, k = st.counters, st.num_pages, pages.numel()
    c[L.CLOCK] += 1
    if not 0 <= row < ts.max_requests or k > ts.max_pages:  # (host ints: no read of the device)
        c[L.ERR_BAD_REQUEST if not 0 <= row < ts.max_requests else L.ERR_TABLE_OVERFLOW] += 1
        raise_peaks(st)
        return
    empty = ts.seq_lens[row] == 0
    c[L.ERR_BAD_REQUEST] += (~empty).long()
    idx, first, _, _ = count_pages(st, pages)
    state = st.page_state[idx]
    live = (pages >= 0) & (pages < P) & ((state == L.USED) | (state == L.CACHED))
    # A live page of another generation than recorded was freed since (and maybe handed out again).
    stale = live & (gens != st.page_gen[idx]) if gens is not None else torch.zeros_like(live)
    taken = live & ~stale
    whole = empty & (taken & first).all()  # 0-d: every page taken and named once, or none is
    # The pool's incref of every page, or (refused) of the entries in no live state, which it counts
    # (and one use_after_free per stale entry); nothing for a row that is not empty. A prefix has no
    # padding and names each page once: a -1, and a page an earlier entry names (one that would be
    # taken otherwise), count one invalid_page each.
    apply_incref(st, torch.where(empty, torch.where(whole | ~live, pages, L.NULL_PAGE), L.NULL_PAGE))
    c[L.ERR_USE_AFTER_FREE] += torch.where(empty, stale.sum(), 0)
    c[L.ERR_INVALID_PAGE] += torch.where(empty, ((pages == L.NULL_PAGE) | (taken & ~first)).sum(), 0)
    cells = ts.block_table[row, :k]
    cells.copy_(torch.where(empty, torch.where(whole, pages, L.NULL_PAGE), cells))
    ts.seq_lens[row:row + 1] = torch.where(empty, whole.to(torch.int32) * (k * ts.page_size), ts.seq_lens[row])


def flashinfer_csr(st, ts, req_ids, indptr, indices, last_page_len, count=True, kv_lens=None):
    """FlashInfer's paged-KV CSR for a batch (read-only: no clock step). ``count``: count bad ids and
    corrupt lengths (a step passes False: its extend counted the same lanes). ``kv_lens`` (a step's, its
    extend wrote them) are the lengths exported, so a repeated id has no pages. A request whose pages
    include an id outside ``[0, P)`` is exported as empty (an attention kernel would read outside the
    cache), one ``corrupt_state`` each, counted also in a step; ``kv_lens`` (a step's) is 0 there. Requests
    past the capacity of ``indices`` are exported as empty too (module note), one ``out_overflow``."""
    c, MP, ps = st.counters, ts.max_pages, ts.page_size
    B, cap = req_ids.numel(), indices.numel()
    indptr.zero_()
    if B == 0:
        indices.fill_(L.NULL_PAGE)
        return
    rr, valid, pad, bad = claim_requests(ts, req_ids, dedupe=False)
    Ln = ts.seq_lens[rr].long()
    lok = length_ok(ts, Ln)
    if count:
        c[L.ERR_BAD_REQUEST] += bad.sum()
        c[L.ERR_CORRUPT_STATE] += (valid & ~lok).sum()
    # A step exports each lane's kv_lens tokens, which its extend wrote: the row's length, or 0 for
    # padding, a bad or repeated id and a corrupt row.
    Ln = kv_lens.long() if kv_lens is not None else torch.where(valid & lok, Ln, 0)
    rows = ts.block_table[rr]
    inside = torch.arange(MP, device=rows.device) < _cdiv(Ln, ps)[:, None]
    stray = (inside & ((rows < 0) | (rows >= st.num_pages))).any(1)
    c[L.ERR_CORRUPT_STATE] += stray.sum()
    # Past the capacity: the first request whose pages do not all fit, and every later one, is
    # exported as empty (kv_lens 0 in a step); no indptr entry points past the buffer.
    over = torch.cumsum(_cdiv(torch.where(stray, 0, Ln), ps), 0) > cap
    count_overflow(c, L.OVERFLOW_CSR, over[-1].long())
    if kv_lens is not None:
        kv_lens.masked_fill_(stray | over, 0)
    Ln = torch.where(stray | over, 0, Ln)
    npages = _cdiv(Ln, ps)
    end = torch.cumsum(npages, 0)
    indptr[1:] = end
    last_page_len.copy_(Ln - (npages - 1) * ps)
    u = torch.arange(cap, device=indices.device)
    lane = torch.searchsorted(end, u, right=True).clamp(max=B - 1)
    col = (u - (end - npages)[lane]).clamp(min=0, max=MP - 1)
    indices.copy_(torch.where(u < end[-1], ts.block_table[rr[lane], col], L.NULL_PAGE))


def block_table_rows(st, ts, req_ids, out):
    """vLLM-style block-table rows for a batch (``-1`` rows for padding and bad ids, each bad id one
    ``bad_request``)."""
    rr, valid, _, bad = claim_requests(ts, req_ids, dedupe=False)
    st.counters[L.ERR_BAD_REQUEST] += bad.sum()
    out.copy_(torch.where(valid[:, None], ts.block_table[rr], L.NULL_PAGE))
