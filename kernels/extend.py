"""extend: append tokens to requests, taking new pages from the pool in the same pass.

Lane ``i`` appends ``n_i`` tokens to request ``r_i``; it needs
``ceil((L+n)/ps) - ceil(L/ps)`` pages, granted first come first served over
the lanes that need pages and popped from the free stack in lane order. A lane
that needs no page is never refused for want of pages (a decode lane inside its
last page runs even when an earlier prefill could not get its pages). Slots are
laid out in lane order (``n_i`` per lane, -1 for padding and failed lanes, -1
past the total). Misuse (bad or repeated request id, negative count, more than
``max_pages`` pages, too small a slot buffer for the lane's tokens) is counted and
the lane fails; a lane of no tokens never overflows the slots.

A step (``kernels/step.py``) also writes the attention metadata in the same
pass: ``positions`` (each slot's position in its sequence, -1 where the slot
is -1), ``qo_indptr`` (where each lane's tokens start in the packed batch,
capped at the slot buffer's length) and ``kv_lens`` (each lane's length after
the call; a failed lane keeps its length; padding, bad ids and corrupt rows 0).

A slot is only ever made from a page id in ``[0, num_pages)``: a token whose page
(from the row, the step's memo, or a corrupt free-stack entry just popped) is
outside gets slot -1 and position -1, and counts one ``corrupt_state``; the lane's
grant and the table are as they would be otherwise. Slots drive the K/V writes, so
no hand-edited state can make them point outside the K/V cache.
"""

import numba
import numpy as np
from ._triton_shim import tl, triton

from . import layout as L
from . import _numba_util as nu
from ._numba_util import (fill_null_range, i32_array, i64_array, mark_popped, page_shift, pages_for, pop_page,
                          stack_run_ok, stamp_rows, state_arrays, table_arrays, u8_array)
from .layout import CD_OK, CD_OUT, CD_SLOTS, CD_SLOTS_LEN, CD_STATE
from ._triton_table_util import (ERR_BAD_REQUEST, ERR_TABLE_OVERFLOW, cdiv, claim_requests, reset_requests,
                                 request_lanes)
from ._triton_util import (ALLOCATED, ERR_BAD_COUNT, ERR_CORRUPT_STATE, FAILED_REQUESTS, FREE_COUNT, NULL_PAGE,
                           OVERFLOW_SLOTS, count_overflow, counter_add, gate_free, load_counters, pop_check,
                           raise_peaks, settings, store_counters, tick)

MAX_TILE = 64  # side of the token x lane tiles of the prefill slot pass


@numba.njit(nogil=True, inline="always")
def list_growth(ins, grown, lane, old_end, have, want):
    """Entry ``grown`` of a step's growth list: lane ``lane`` went from ``have`` to ``want``
    pages, and its run ended at ``old_end`` in the previous CSR. Returns ``grown + 1``."""
    at = grown * L.MEMO_INS_WIDTH
    ins[at], ins[at + 1], ins[at + 2], ins[at + 3] = lane, old_end, have, want
    return grown + 1


@numba.njit(nogil=True, inline="always")
def decode_lane(i, tok, r, length, page, k, off, page_size, P, slots, seq_lens, ok, track, pos, tails, indptr, last,
                positions, qo, kvl):
    """The writes of a decode lane (one token appended to request ``r`` at ``length``, in page
    ``page``, the row's page ``k``, at offset ``off``) once its page is known; its slot is slot
    ``tok``. Returns ``(good, pos)``: whether the page id is in the pool (else the slot and the
    position are -1: module note) and, with ``track``, the CSR's pages after the lane."""
    ur, ui, ut = np.uint64(r), np.uint64(i), np.uint64(tok)  # all >= 0: no negative-index fix-ups
    good = np.uint64(page) < np.uint64(P)
    slots[ut] = page * page_size + off if good else L.NULL_PAGE
    seq_lens[ur] = length + 1
    ok[ui] = True
    if track:
        tails[ui] = (page << 32) | (length + 1)
        pos += k + 1
        indptr[ui + np.uint64(1)] = pos
        last[ui] = off + 1
        positions[ut] = length if good else L.NULL_PAGE
        qo[ui + np.uint64(1)] = tok + 1
        kvl[ui] = length + 1
    return good, pos


@numba.njit(nogil=True, inline="always")
def null_lane(i, start, tok, T, page_size, slots_ptr, ok, track, pos, indptr, last, pos_ptr, qo, kvl):
    """The writes of a lane that appends nothing (padding, a bad id, a failed or corrupt
    lane): its slots ``[start, min(tok, T))`` and their positions -1, ``ok`` False, no pages in the CSR."""
    fill_null_range(slots_ptr, start, min(tok, T))
    ok[i] = False
    if track:
        indptr[i + 1] = pos
        last[i] = page_size
        fill_null_range(pos_ptr, start, min(tok, T))
        qo[i + 1] = min(tok, T)
        kvl[i] = 0


@numba.njit(nogil=True)
def extend_numba(
    req_ids_ptr,  # address of int32 [B], request ids, -1 = padding
    ntok_ptr,     # address of int32 [B], tokens to append per lane
    B,            # batch size
    slots_ptr,    # address of int32 [T], slot of every new token, -1 padded
    T,            # slot capacity
    ok_ptr,       # address of bool [B], lane granted
    page_size,    # tokens per page
    block_table,  # int32 [R, MP]
    seq_lens,     # int32 [R]
    claim,        # int32 [R] scratch
    free_stack,   # int32 [P]
    refcount,     # int32 [P]
    page_state,   # int8 [P]
    counters,     # int64 [NUM_COUNTERS]
    track,        # a step: also the CSR's indptr and last_page_len, the attention metadata, the grown lanes
    distinct,     # the caller knows every id is -1 or a distinct request id in range: no claims
    indptr,       # int32 [B + 1] when track
    last,         # int32 [B] when track
    ins,          # int64 [MEMO_INS_WIDTH * B] when track: (lane, old CSR end, pages before, after) per grown lane
    pos_ptr,      # address of int32 [T] when track: position of every new token, -1 where its slot is -1
    qo,           # int32 [B + 1] when track: qo_indptr
    kvl,          # int32 [B] when track: kv_lens
    tails,        # int64 [B] when track: per lane (last page << 32) | length after the call; read when distinct
    kept,         # int64 [B] or [0]: per lane, (index << 32) | id of the last page of the run a step keeps, or -1
):
    """The extend of a batch; with ``track``, also a step's CSR bookkeeping, in the same pass.

    The one lane pass grants pages (first come first served), writes the table, the
    lengths, ``ok`` and the slots. With ``track`` (a step) it also writes the CSR's
    lane side as it goes, since each lane's page count after the call is known there:
    ``indptr[i + 1]`` (a running sum of the lanes' pages after the call) and
    ``last[i]``, the attention metadata (``positions`` at ``pos_ptr``, ``qo``, ``kvl``;
    module note), and it lists in ``ins`` every lane that was given pages: its lane,
    where its run ended in the previous CSR (``pos - gained``: pages of the lanes
    before it, minus those they gained in this call), its pages before and after. The
    step then only moves those runs (``kernels/step.py``) instead of rebuilding
    ``indices``. ``distinct`` (the step's memo already knows the batch has no repeated
    or unknown id) skips the claim passes.

    With ``track`` every request's lane also writes its word of ``tails``: the request's
    last page and length after the call. With ``distinct`` (the memo holds this batch at
    the table's version, so the words are exact) a lane reads its length there, and a
    decode lane inside its last page its page too, instead of ``seq_lens[r]`` and the row
    ``block_table[r]``: one contiguous read instead of a line per lane, which is most of
    a decode step's cost when a forward pass has cooled the caches. The table stays the
    truth (``seq_lens`` and the rows are still written). Without ``distinct``, a step that
    keeps runs of an older CSR (``kept`` has ``B`` entries) gives each lane whose run it
    keeps the run's last page and its index in the row (the row's pages are the run's): a
    decode lane inside that page takes its slot from there instead of reading the row, so a
    step after a release or an admission reads the rows of the changed lanes only.

    Returns ``(clean, pages, grown)``: ``clean`` when every lane is padding or a
    request's first lane, ``pages`` the batch's pages after the call (the CSR's total),
    ``grown`` the entries listed in ``ins``. Untracked calls ignore them.
    """
    ids, ntok = i32_array(req_ids_ptr, B), i32_array(ntok_ptr, B)
    slots, ok = i32_array(slots_ptr, T), u8_array(ok_ptr, B)
    use_kept = track and not distinct and kept.shape[0] >= B
    positions = i32_array(pos_ptr, T if track else 0)
    R, MP = block_table.shape[0], block_table.shape[1]
    # Powers of two (the usual page sizes) divide by shifting: an integer division per
    # lane and per token would cost more than the rest of a decode step.
    shift = page_shift(page_size)
    limit = MP * page_size  # a length at or past it has no page to write in (a corrupt row)
    counters[L.CLOCK] += 1
    free = nu.gated_free(counters, refcount.shape[0]) if B > 0 else 0  # a corrupt free count: empty
    top = free  # the stack top as pages are popped
    P = refcount.shape[0]
    checked = top  # stack slots [checked, free) are known to hold page ids in [0, P)
    bad_ids = bad_count = overflow = out_over = failed = corrupt = bad_slots = 0
    csum = 0      # pages asked for by the lanes so far (first come first served)
    tok = 0       # slots of the lanes so far
    clean = True
    pos = 0       # pages of the lanes so far, after the call (tracked)
    gained = 0    # pages the lanes so far were given (so pos - gained is the same before the call)
    grown = 0
    for i in range(B):
        r = ids[i]
        n = ntok[i]
        if r >= 0 and r < R and (distinct or i <= claim[r]):  # a request's first lane (claim_requests' rule)
            tail_at = np.int64(-1)  # the row's page index whose id tail_page is, without distinct
            if not distinct:
                claim[r] = i
                length = seq_lens[r]
                tail_page = np.int64(-1)
                if use_kept and kept[i] >= 0:  # a kept run: its last page is the row's
                    tail_page, tail_at = kept[i] & 0xFFFFFFFF, kept[i] >> 32
            else:  # the step before left this lane's length and last page in the memo
                packed = tails[i]
                length = np.int32(packed & 0xFFFFFFFF)
                tail_page = packed >> 32
            if shift >= 0:
                k, off = length >> shift, length & (page_size - 1)
            else:
                k = length // page_size
                off = length - k * page_size
            # 0 < length < limit in one unsigned compare (a length <= 0 here is a corrupt row)
            if n == 1 and off != 0 and np.uint64(length - 1) < np.uint64(limit - 1) and tok < T:
                # A decode lane inside its last page: no new page, one slot (most lanes of most steps).
                page = tail_page if distinct or k == tail_at else np.int64(block_table[np.uint64(r), np.uint64(k)])
                good, pos = decode_lane(i, tok, r, length, page, k, off, page_size, P, slots, seq_lens, ok, track,
                                        pos, tails, indptr, last, positions, qo, kvl)
                bad_slots += not good
                tok += 1
                continue
            start = tok
            if length < 0 or length > limit:  # corrupt state: the lane fails, the row is left alone
                corrupt += 1
                failed += 1
                clean = False
                tok += max(n, 0)
                null_lane(i, start, tok, T, page_size, slots_ptr, ok, track, pos, indptr, last, pos_ptr, qo, kvl)
                if track:
                    tails[i] = 0  # never read: a corrupt lane makes the call unclean (no memo)
                continue
            have = k + (off != 0)  # pages_for(length)
            want = have
            granted = False
            if n < 0:
                bad_count += 1
            else:
                tok += n
                want = pages_for(length + n, page_size, shift)
                if want > MP:
                    overflow += 1
                else:
                    csum += want - have
                    if want == have or csum <= free:  # a lane needing no page never waits on others
                        if n == 0 or tok <= T:  # a lane of no tokens has none to overflow
                            granted = True
                        else:
                            out_over += 1
            if granted:
                lo = top - (want - have)  # the lowest stack slot this lane pops
                fast = lo >= checked or stack_run_ok(free_stack, lo, checked, P)
                if fast:  # the slots down to lo hold page ids: no check per page
                    checked = min(checked, lo)
                for k in range(have, want):
                    top -= 1
                    if fast:
                        p = free_stack[top]
                        mark_popped(p, refcount, page_state)
                        block_table[r, k] = p
                    else:
                        block_table[r, k] = pop_page(top, free_stack, refcount, page_state, counters)
                # Token loops index with unsigned ints (all are >= 0 here and below T, the
                # grant checked tok <= T): numba's fix-up of negative indices would make LLVM
                # write each slot with a scatter instead of one vector store, ~3x slower.
                pos_t, u = length, np.uint64(start)
                lane_bad = 0
                while pos_t < length + n:  # page by page: the inner loop is base + offset
                    k = pos_t >> shift if shift >= 0 else pos_t // page_size
                    p = np.int64(block_table[r, k])
                    cnt = min(length + n, (k + 1) * page_size) - pos_t
                    if np.uint64(p) < np.uint64(P):
                        base = p * page_size + (pos_t - k * page_size)
                        for c in range(cnt):
                            slots[u + np.uint64(c)] = base + c
                    else:  # a page id outside the pool: no slots (module note)
                        fill_null_range(slots_ptr, np.int64(u), np.int64(u) + cnt)
                        lane_bad += cnt
                    u += np.uint64(cnt)
                    pos_t += cnt
                bad_slots += lane_bad
                if track:
                    us = np.uint64(start)
                    for c in range(n):
                        positions[us + np.uint64(c)] = length + c
                    if lane_bad:  # positions are -1 where slots are
                        for c in range(n):
                            if slots[us + np.uint64(c)] < 0:
                                positions[us + np.uint64(c)] = L.NULL_PAGE
                length += n
                seq_lens[r] = length
            else:
                want = have
                failed += 1
                fill_null_range(slots_ptr, start, min(tok, T))
                if track:
                    fill_null_range(pos_ptr, start, min(tok, T))
            ok[i] = granted
            if track:
                qo[i + 1] = min(tok, T)
                kvl[i] = length
                tails[i] = ((np.int64(block_table[r, want - 1]) if want > 0 else np.int64(-1)) << 32) | length
                if want > have:
                    grown = list_growth(ins, grown, i, pos - gained + have, have, want)
                    gained += want - have
                pos += want
                indptr[i + 1] = pos
                last[i] = length - (want - 1) * page_size
        else:  # padding, an unknown request, or a request's second lane
            start = tok
            tok += max(n, 0)
            if r != L.NULL_PAGE:
                bad_ids += 1
                failed += 1
                clean = False
            null_lane(i, start, tok, T, page_size, slots_ptr, ok, track, pos, indptr, last, pos_ptr, qo, kvl)
    fill_null_range(slots_ptr, tok, T)
    if not distinct:
        nu.reset_requests(ids, R, claim)
    popped = free - top
    counters[L.ERR_BAD_REQUEST] += bad_ids
    counters[L.ERR_BAD_COUNT] += bad_count
    counters[L.ERR_TABLE_OVERFLOW] += overflow
    nu.count_overflow(counters, L.OVERFLOW_SLOTS, out_over)
    counters[L.FAILED_REQUESTS] += failed
    counters[L.ERR_CORRUPT_STATE] += corrupt + bad_slots
    counters[L.FREE_COUNT] -= popped
    counters[L.ALLOCATED] += popped
    if B > 0:  # an empty batch touches nothing (as the reference and Triton)
        nu.raise_peaks(counters, refcount.shape[0])
    if track:
        indptr[0] = 0
        qo[0] = 0
        fill_null_range(pos_ptr, tok, T)
    return clean, pos, grown


@numba.njit(nogil=True)
def extend_numba_entry(req_ids_ptr, ntok_ptr, B, cd):
    """``extend_numba`` for a bound call: outputs, table and pool state in the call descriptor ``cd``."""
    bt, lens, claim, ps = table_arrays(cd[:CD_STATE])
    stack, rc, state, _, counters, _, _ = state_arrays(cd[CD_STATE:CD_OUT])
    stamp_rows(cd[:CD_STATE], req_ids_ptr, B)
    untracked = i32_array(0, 0)
    extend_numba(req_ids_ptr, ntok_ptr, B, cd[CD_SLOTS], cd[CD_SLOTS_LEN], cd[CD_OK], ps, bt, lens, claim,
                 stack, rc, state, counters, False, False, untracked, untracked, i64_array(0, 0), 0, untracked,
                 untracked, i64_array(0, 0), i64_array(0, 0))


# ---------------------------------------------------------------------- Triton
# One program. Claim the request rows. Plan the lanes in chunks (running
# carries make the FCFS page sum and the token offsets global prefix sums),
# pop each lane's pages at its stack offset, write the table, the lengths,
# ``ok`` and the slot of every one-token lane. If some lane has more tokens (a
# prefill), a second lane pass writes every token's slot: each chunk of TILE
# lanes walks its own token range in TILE x TILE tiles where token u takes the
# values of the lane with start <= u < end (a one-hot sum, no search, no
# atomics), so the work is linear in B + T. A decode step skips that pass.
# Last, the -1 tail and the claims.


@triton.jit
def extend_body(
    req_ids_ptr,      # *int32 [B]: request ids, -1 = padding
    num_tokens_ptr,   # *int32 [B]: tokens to append per lane
    B,                # batch size
    slots_ptr,        # *int32 [T]: slot of every new token in lane order, -1 padded
    T,                # slot capacity
    ok_ptr,           # *bool [B]: lane granted
    block_table_ptr,  # *int32 [R, MP]
    seq_lens_ptr,     # *int32 [R]
    claim_ptr,        # *int32 [R] scratch, INT32_MAX between calls
    free_stack_ptr,   # *int32 [P]
    refcount_ptr,     # *int32 [P]
    page_state_ptr,   # *int8 [P]
    counters_ptr,     # *int64 [NUM_COUNTERS]
    R,                # rows of block_table
    MP,               # columns of block_table
    num_pages,        # P
    page_size,        # tokens per page
    positions_ptr,    # *int32 [T]: a step's positions (META), -1 where the slot is -1
    qo_indptr_ptr,    # *int32 [B + 1]: a step's qo_indptr (META)
    kv_lens_ptr,      # *int32 [B]: a step's kv_lens (META)
    # Meta-parameters
    BLOCK: tl.constexpr,  # lanes per chunk (plan) and tokens per chunk (tail)
    TILE: tl.constexpr,   # side of the token x lane tiles of the prefill slot pass
    META: tl.constexpr,   # also write the attention metadata (a step)
):
    """Lane i appends n_i tokens to row r_i: pops cdiv(L+n, ps) - cdiv(L, ps) pages FCFS; slots in lane order.

    The body of ``extend_kernel``, also run by ``step_kernel`` before the CSR export."""
    lanes = tl.arange(0, BLOCK)
    c = load_counters(counters_ptr)
    c, _clock = tick(c)
    c, free = gate_free(c, num_pages, B > 0)  # a corrupt free count: an empty stack
    if META:
        tl.store(qo_indptr_ptr, 0)
    claim_requests(req_ids_ptr, B, claim_ptr, R, BLOCK)
    tl.debug_barrier()
    csum = tl.zeros((), tl.int64)    # pages needed by candidate lanes so far
    tok = tl.zeros((), tl.int64)     # tokens of all lanes so far
    popped = tl.zeros((), tl.int64)  # pages granted so far
    max_n = tl.zeros((), tl.int64)
    bad = tl.zeros((), tl.int64)
    neg_count = tl.zeros((), tl.int64)
    overflow = tl.zeros((), tl.int64)
    out_overflow = tl.zeros((), tl.int64)
    failed = tl.zeros((), tl.int64)
    wrong = tl.zeros((), tl.int64)  # corrupt state: lengths out of bounds, bad stack entries
    bad_one = tl.zeros((), tl.int64)    # slots of one-token lanes whose page is outside the pool
    bad_multi = tl.zeros((), tl.int64)  # the same over every token, when the prefill pass rewrites them all
    for start in range(0, B, BLOCK):
        i = start + lanes
        r, valid, pad, live = request_lanes(req_ids_ptr, i, B, claim_ptr, R)
        n = tl.load(num_tokens_ptr + i, mask=live, other=0).to(tl.int64)
        length = tl.load(seq_lens_ptr + r, mask=valid, other=0).to(tl.int64)
        corrupt = valid & ((length < 0) | (length > MP * page_size))  # the lane fails, its row is left alone
        wrong += tl.sum(corrupt.to(tl.int64))
        lv = valid & ~corrupt
        length = tl.where(corrupt, 0, length)
        neg = lv & (n < 0)
        n = tl.maximum(n, 0)
        have = cdiv(length, page_size)
        want = cdiv(length + n, page_size)
        over = lv & ~neg & (want > MP)
        cand = lv & ~neg & ~over
        need = tl.where(cand, want - have, 0)
        need_end = csum + tl.cumsum(need, 0)
        tok_end = tok + tl.cumsum(n, 0)
        fits = cand & ((need == 0) | (need_end <= free))  # a lane needing no page never waits on others
        ok = fits & ((n == 0) | (tok_end <= T))  # a lane of no tokens has none to overflow
        tl.store(ok_ptr + i, ok, mask=live)
        # Pop: lane i takes stack offsets need_end - need + k from the top, k < need.
        off = need_end - need
        grant = tl.where(ok, need, 0)
        row = r.to(tl.int64) * MP
        for k in range(0, tl.max(grant)):
            take = k < grant
            p, bad_pop = pop_check(free - 1 - off - k, take, free_stack_ptr, refcount_ptr, page_state_ptr,
                                   num_pages)
            tl.store(block_table_ptr + row + have + k, p, mask=take)
            wrong += bad_pop
        # One-token lanes: the slot comes from the table (old page) or the page just popped.
        one = live & (n == 1)
        col = length // page_size
        old = tl.load(block_table_ptr + row + col, mask=one & ok & (col < have), other=NULL_PAGE)
        new = tl.load(free_stack_ptr + (free - 1 - off), mask=one & ok & (col >= have), other=NULL_PAGE)
        page = tl.where(col < have, old, new).to(tl.int64)
        inr = (page >= 0) & (page < num_pages)  # a page id outside the pool makes no slot (module note)
        slot = tl.where(ok & inr, page * page_size + length % page_size, NULL_PAGE)
        bad_one += tl.sum((one & ok & ~inr).to(tl.int64))
        u = tok_end - n
        tl.store(slots_ptr + u, slot.to(tl.int32), mask=one & (u < T))
        tl.store(seq_lens_ptr + r, (length + n).to(tl.int32), mask=ok)
        if META:
            tl.store(positions_ptr + u, tl.where(ok & inr, length, NULL_PAGE).to(tl.int32), mask=one & (u < T))
            tl.store(qo_indptr_ptr + i + 1, tl.minimum(tok_end, T).to(tl.int32), mask=live)
            kv_len = tl.where(ok, length + n, tl.where(lv, length, 0))  # a failed lane keeps its length
            tl.store(kv_lens_ptr + i, kv_len.to(tl.int32), mask=live)
        csum += tl.sum(need)
        tok += tl.sum(n)
        popped += tl.sum(grant)
        max_n = tl.maximum(max_n, tl.max(n))
        bad += tl.sum((live & ~pad & ~valid).to(tl.int64))
        neg_count += tl.sum(neg.to(tl.int64))
        overflow += tl.sum(over.to(tl.int64))
        out_overflow += tl.sum((fits & ~ok).to(tl.int64))
        failed += tl.sum((live & ~pad & ~ok).to(tl.int64))
    tl.debug_barrier()
    if max_n > 1:
        tiles = tl.arange(0, TILE)
        end = tl.zeros((), tl.int64)  # tokens of the lanes before this chunk
        for start in range(0, B, TILE):
            j = start + tiles
            live = j < B
            n = tl.maximum(tl.load(num_tokens_ptr + j, mask=live, other=0).to(tl.int64), 0)
            lane_end = end + tl.cumsum(n, 0)
            lane_start = lane_end - n
            ok = tl.load(ok_ptr + j, mask=live, other=0).to(tl.int1) & live
            r = tl.load(req_ids_ptr + j, mask=ok, other=0).to(tl.int64)
            # Token u of lane j sits at position u + shift_j of row r_j (seq_lens already holds L + n).
            shift = tl.load(seq_lens_ptr + r, mask=ok, other=0) - n - lane_start
            chunk_end = end + tl.sum(n)
            for t0 in range((end // TILE) * TILE, tl.minimum(chunk_end, T), TILE):
                u = t0 + tiles
                own = (lane_start[None, :] <= u[:, None]) & (u[:, None] < lane_end[None, :])
                granted = tl.sum((own & ok[None, :]).to(tl.int32), axis=1) > 0
                row = tl.sum(tl.where(own, r[None, :], 0), axis=1)
                pos = u + tl.sum(tl.where(own, shift[None, :], 0), axis=1)
                page = tl.load(block_table_ptr + row * MP + pos // page_size, mask=granted,
                               other=NULL_PAGE).to(tl.int64)
                made = granted & (page >= 0) & (page < num_pages)
                slot = tl.where(made, page * page_size + pos % page_size, NULL_PAGE)
                mine = (u >= end) & (u < chunk_end) & (u < T)
                tl.store(slots_ptr + u, slot.to(tl.int32), mask=mine)
                bad_multi += tl.sum((mine & granted & ~made).to(tl.int64))
                if META:
                    tl.store(positions_ptr + u, tl.where(made, pos, NULL_PAGE).to(tl.int32), mask=mine)
            end = chunk_end
    # Every token below min(tok, T) is written; pad the rest.
    tail = tl.minimum(tok, T).to(tl.int32)
    for start in range((tail // BLOCK) * BLOCK, T, BLOCK):
        u = start + lanes
        tl.store(slots_ptr + u, tl.full((BLOCK,), NULL_PAGE, tl.int32), mask=(u >= tail) & (u < T))
        if META:
            tl.store(positions_ptr + u, tl.full((BLOCK,), NULL_PAGE, tl.int32), mask=(u >= tail) & (u < T))
    reset_requests(req_ids_ptr, B, claim_ptr, R, BLOCK)
    wrong += tl.where(max_n > 1, bad_multi, bad_one)  # the prefill pass rewrote every slot: count its
    c = counter_add(c, ERR_BAD_REQUEST, bad)
    c = counter_add(c, ERR_BAD_COUNT, neg_count)
    c = counter_add(c, ERR_TABLE_OVERFLOW, overflow)
    c = count_overflow(c, OVERFLOW_SLOTS, out_overflow)
    c = counter_add(c, FAILED_REQUESTS, failed)
    c = counter_add(c, ERR_CORRUPT_STATE, wrong)
    c = counter_add(c, FREE_COUNT, -popped)
    c = counter_add(c, ALLOCATED, popped)
    if B > 0:
        c = raise_peaks(c, num_pages)
    store_counters(counters_ptr, c)


@triton.jit
def extend_kernel(req_ids_ptr, num_tokens_ptr, B, slots_ptr, T, ok_ptr, block_table_ptr, seq_lens_ptr, claim_ptr,
                  free_stack_ptr, refcount_ptr, page_state_ptr, counters_ptr, R, MP, num_pages, page_size,
                  positions_ptr, qo_indptr_ptr, kv_lens_ptr,
                  BLOCK: tl.constexpr, TILE: tl.constexpr, META: tl.constexpr):
    """One launch of ``extend_body`` (arguments documented there)."""
    extend_body(req_ids_ptr, num_tokens_ptr, B, slots_ptr, T, ok_ptr, block_table_ptr, seq_lens_ptr, claim_ptr,
                free_stack_ptr, refcount_ptr, page_state_ptr, counters_ptr, R, MP, num_pages, page_size,
                positions_ptr, qo_indptr_ptr, kv_lens_ptr, BLOCK, TILE, META)


def extend_triton(req_ids, num_tokens, slots, ok, st, ts, meta=None) -> None:
    """Append ``num_tokens[i]`` tokens to request ``req_ids[i]`` (one launch; see module note);
    ``meta``: a step's ``(positions, qo_indptr, kv_lens)`` to write too, or None."""
    B, T = req_ids.numel(), slots.numel()
    R, MP = ts.block_table.shape
    config = settings(max(B, T))
    positions, qo_indptr, kv_lens = (slots, slots, slots) if meta is None else meta  # unused without META
    extend_kernel[(1,)](
        req_ids, num_tokens, B, slots, T, ok, ts.block_table, ts.seq_lens, ts.claim,
        st.free_stack, st.refcount, st.page_state, st.counters, R, MP, st.num_pages, ts.page_size,
        positions, qo_indptr, kv_lens, TILE=min(config["BLOCK"], MAX_TILE), META=meta is not None, **config,
    )
