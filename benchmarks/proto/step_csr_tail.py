"""PROTOTYPE (benchmarks only, not used by tpool): a decode step that reads no block-table row
and keeps no new state: each lane's length and last page come from the CSR the step before left.

A copy of ``kernels/extend.py: extend_numba`` and ``kernels/step.py: step_numba_entry`` with
one change. When the memo says the buffers hold this batch's CSR at the table's version
(``same``: nothing changed the table since the last step of this batch, the condition under
which the step already grows ``indices`` in place), the previous step's outputs describe
every lane exactly: ``pages = indptr[i+1] - indptr[i]``, ``length = (pages - 1) * page_size +
last_page_len[i]`` and the last page is ``indices[indptr[i+1] - 1]``. A decode lane reads
those (lines the step rewrites, or moves, anyway) instead of ``seq_lens[r]`` and the row
``block_table[r]``. The memo keeps its current layout. See ``cold_breakdown.py``.
"""

import numba
import numpy as np

from tpool.kernels import layout as L
from tpool.kernels import _numba_util as nu
from tpool.kernels._numba_util import (fill_null_range, i32_array, i64_array, i64_cell, new_version, page_shift,
                                       pages_for, pop_page, stack_run_ok, state_arrays, table_arrays, u8_array)
from tpool.kernels.extend import list_growth
from tpool.kernels.flashinfer_csr import flashinfer_csr_numba
from tpool.kernels.layout import (CALL_DESC_LEN, CD_CSR_MEMO, CD_IDS, CD_INDICES, CD_INDICES_LEN, CD_INDPTR,
                                  CD_LANES, CD_LAST_PAGE_LEN, CD_NTOK, CD_OK, CD_OUT, CD_SLOTS, CD_SLOTS_LEN,
                                  CD_STATE, INT32_MAX, TD_VERSION)
from tpool.kernels.step import grow_csr

_memo_len = numba.njit(nogil=True, inline="always")(L.memo_len)




@numba.njit(nogil=True)
def extend_csr_tail_numba(
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
    track,        # also write the CSR's indptr and last_page_len (a step) and list the lanes given pages
    distinct,     # the caller knows every id is -1 or a distinct request id in range: no claims
    indptr,       # int32 [B + 1] when track
    last,         # int32 [B] when track
    ins,          # int64 [MEMO_INS_WIDTH * B] when track: (lane, old CSR end, pages before, after) per grown lane
    indices,      # int32 [cap]: the CSR's page ids; with ``distinct`` (same memo), the previous step's
):
    """The extend of a batch; with ``track``, also a step's CSR bookkeeping, in the same pass.

    The one lane pass grants pages (first come first served), writes the table, the
    lengths, ``ok`` and the slots. With ``track`` (a step) it also writes the CSR's
    lane side as it goes, since each lane's page count after the call is known there:
    ``indptr[i + 1]`` (a running sum of the lanes' pages after the call) and
    ``last[i]``, and it lists in ``ins`` every lane that was given pages: its lane,
    where its run ended in the previous CSR (``pos - gained``: pages of the lanes
    before it, minus those they gained in this call), its pages before and after. The
    step then only moves those runs (``kernels/step.py``) instead of rebuilding
    ``indices``. ``distinct`` (the step's memo already knows the batch has no repeated
    or unknown id) skips the claim passes.

    Returns ``(clean, pages, grown)``: ``clean`` when every lane is padding or a
    request's first lane, ``pages`` the batch's pages after the call (the CSR's total),
    ``grown`` the entries listed in ``ins``. Untracked calls ignore them.
    """
    ids, ntok = i32_array(req_ids_ptr, B), i32_array(ntok_ptr, B)
    slots, ok = i32_array(slots_ptr, T), u8_array(ok_ptr, B)
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
    bad_ids = bad_count = overflow = out_over = failed = corrupt = 0
    csum = 0      # pages asked for by the lanes so far (first come first served)
    tok = 0       # slots of the lanes so far
    clean = True
    pos = 0       # pages of the lanes so far, after the call (tracked)
    gained = 0    # pages the lanes so far were given (so pos - gained is the same before the call)
    grown = 0
    old_end = 0   # indptr[i + 1] as the step before left it (read before this step overwrites it)
    for i in range(B):
        old_start = old_end
        if distinct:
            old_end = indptr[i + 1]
        r = ids[i]
        n = ntok[i]
        if r >= 0 and r < R and (distinct or claim[r] == INT32_MAX):  # a request's first lane
            if not distinct:
                claim[r] = i
                length = seq_lens[r]
                tail_page = -1
            else:  # PROTOTYPE: the previous step's CSR holds the lane's length and last page
                npages = old_end - old_start
                length = (npages - 1) * page_size + last[i]
                tail_page = np.int64(indices[old_end - 1]) if npages > 0 else np.int64(-1)
            if shift >= 0:
                k, off = length >> shift, length & (page_size - 1)
            else:
                k = length // page_size
                off = length - k * page_size
            # 0 < length < limit in one unsigned compare (a length <= 0 here is a corrupt row)
            if n == 1 and off != 0 and np.uint64(length - 1) < np.uint64(limit - 1) and csum <= free and tok < T:
                # A decode lane inside its last page: no new page, one slot (most lanes of most steps).
                # Unsigned indices (all are known >= 0 here) spare numba's negative-index fixups.
                ur, uk, ui = np.uint64(r), np.uint64(k), np.uint64(i)
                page = tail_page if distinct else np.int64(block_table[ur, uk])
                slots[np.uint64(tok)] = page * page_size + off
                seq_lens[ur] = length + 1
                ok[ui] = True
                tok += 1
                if track:
                    pos += k + 1
                    indptr[ui + np.uint64(1)] = pos
                    last[ui] = off + 1
                continue
            start = tok
            if length < 0 or length > limit:  # corrupt state: the lane fails, the row is left alone
                corrupt += 1
                failed += 1
                clean = False
                tok += max(n, 0)
                fill_null_range(slots_ptr, start, min(tok, T))
                ok[i] = False
                if track:
                    indptr[i + 1] = pos
                    last[i] = page_size
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
                    if csum <= free:
                        if tok <= T:
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
                        refcount[p] = 1
                        page_state[p] = L.USED
                        block_table[r, k] = p
                    else:
                        block_table[r, k] = pop_page(top, free_stack, refcount, page_state, counters)
                pos_t, u = length, start
                while pos_t < length + n:  # page by page: the inner loop is base + offset
                    k = pos_t >> shift if shift >= 0 else pos_t // page_size
                    base = block_table[r, k] * page_size - k * page_size
                    stop = min(length + n, (k + 1) * page_size)
                    for q in range(pos_t, stop):
                        slots[u + q - pos_t] = base + q
                    u += stop - pos_t
                    pos_t = stop
                length += n
                seq_lens[r] = length
            else:
                want = have
                failed += 1
                fill_null_range(slots_ptr, start, min(tok, T))
            ok[i] = granted
            if track:
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
            fill_null_range(slots_ptr, start, min(tok, T))
            ok[i] = False
            if track:
                indptr[i + 1] = pos
                last[i] = page_size
    fill_null_range(slots_ptr, tok, T)
    if not distinct:
        nu.reset_requests(ids, R, claim)
    popped = free - top
    counters[L.ERR_BAD_REQUEST] += bad_ids
    counters[L.ERR_BAD_COUNT] += bad_count
    counters[L.ERR_TABLE_OVERFLOW] += overflow
    counters[L.ERR_OUT_OVERFLOW] += out_over
    counters[L.FAILED_REQUESTS] += failed
    counters[L.ERR_CORRUPT_STATE] += corrupt
    counters[L.FREE_COUNT] -= popped
    counters[L.ALLOCATED] += popped
    if B > 0:  # an empty batch touches nothing (as the reference and Triton)
        nu.raise_peaks(counters, refcount.shape[0])
    if track:
        indptr[0] = 0
    return clean, pos, grown




@numba.njit(nogil=True)
def step_csr_tail_numba_entry(req_ids_ptr, ntok_ptr, B, cd, stop=0):
    """``step_numba_entry`` reading each lane's length and last page from the previous CSR when the memo
    allows it (module note). ``stop`` (for the cold
    breakdown only; the table is left inconsistent): 1 returns after the memo check, 2 after the extend."""
    td = cd[:CD_STATE]
    bt, lens, claim, ps = table_arrays(td)
    stack, rc, state, _, counters, _, _ = state_arrays(cd[CD_STATE:CD_OUT])
    ids = i32_array(req_ids_ptr, B)
    n_memo = _memo_len(B)
    memo = i64_array(cd[CD_CSR_MEMO], n_memo)
    same = memo[L.MEMO_VERSION] == i64_cell(td[TD_VERSION])[0]
    if same:
        diff = 0
        for i in range(B):
            diff |= memo[L.MEMO_IDS + i] ^ ids[i]
        same = diff == 0
    if stop == 1:
        return
    version = new_version(td)
    indptr, last = i32_array(cd[CD_INDPTR], B + 1), i32_array(cd[CD_LAST_PAGE_LEN], B)
    ins = memo[L.MEMO_IDS + B:n_memo]
    indices = i32_array(cd[CD_INDICES], cd[CD_INDICES_LEN])
    clean, total, grown = extend_csr_tail_numba(req_ids_ptr, ntok_ptr, B, cd[CD_SLOTS], cd[CD_SLOTS_LEN], cd[CD_OK], ps,
                                            bt, lens, claim, stack, rc, state, counters, True, same, indptr, last,
                                            ins, indices)
    if stop == 2:
        return
    cap = cd[CD_INDICES_LEN]
    if same and clean and total <= cap:
        grow_csr(cd[CD_INDICES], ins, grown, total, ids, bt)
        memo[L.MEMO_WRITTEN] = max(memo[L.MEMO_WRITTEN], total)
    else:
        memo[L.MEMO_WRITTEN] = flashinfer_csr_numba(req_ids_ptr, B, cd[CD_INDPTR], cd[CD_INDICES], cap,
                                                    cd[CD_LAST_PAGE_LEN], ps, bt, lens, counters, memo[L.MEMO_WRITTEN])
        for i in range(B):
            memo[L.MEMO_IDS + i] = ids[i]
    memo[L.MEMO_VERSION] = version if clean and total <= cap else -1


@numba.njit(nogil=True)
def step_csr_tail_bound_entry(cd_addr, stop=0):
    """``step_csr_tail_numba_entry`` for a call bound to its inputs (everything in the descriptor at ``cd_addr``)."""
    cd = i64_array(cd_addr, CALL_DESC_LEN)
    step_csr_tail_numba_entry(cd[CD_IDS], cd[CD_NTOK], cd[CD_LANES], cd, stop)
