"""step: one scheduler step on a page table: extend, then the FlashInfer CSR of the batch.

The two passes of :mod:`extend` and :mod:`flashinfer_csr` in one call, so a decode loop
pays one façade call and one numba kernel call, or one Triton launch, per step.
The CSR is built after the extend, so it lists the pages the step just added:
the semantics are those of the two calls made one after the other (the
reference backend makes them).

Note: on numba a step updates the CSR in place when it can. The CSR of a
decode batch holds every page of every request (tens of thousands of ids
at B=256), and copying them is most of a step on a CPU; from one step to the next, a
request only gains pages at the end of its run, so the previous CSR,
with runs shifted right and new pages written in, is the new one. A step
does that when the buffers hold the CSR of the same batch at the table's
current version (``MEMO_VERSION``, ``MEMO_IDS`` in :mod:`layout`; then each lane's
length and last page are in the memo's tails too, and the step reads no
block-table row for a decode lane inside its last page); every numba call that may
change the table gives it a fresh version first, and a restored snapshot
brings back its own.

A decode step of such a batch whose every lane is padding or appends one token, whose pages
are on the free stack and whose outputs have room (most steps of a decode loop) runs
``decode_in_place``: a pass that only reads (the inputs, the memo's batch and tails) decides,
then a second writes. Any other step, including one that pass declines having changed
nothing, runs the full step; the two write the same. Lanes inside their last page and
padding lanes go through the same helpers on both paths (``decode_lane``, ``null_lane`` in
:mod:`extend`); a lane at a page boundary has its own short copy of the pop (its page marked
by ``mark_popped``, as every pop is), the row write and the growth entry here, which must stay
in step with ``extend_numba``'s grant path
(``tests/test_step_csr.py`` checks both against the reference at every edge the first pass
declines). The short path is there for its code as much as for its work: with the caches
cold it fetches far less of it.

Two ``StepOut`` buffers taking turns (overlap scheduling) find the CSR they hold one step
behind the table: the other buffer's step came in between. A step only appends to rows
(tokens, and pages after the last), so each step notes in the table's version cells the
version it came from (``new_step_version``; any other call's ``new_version`` clears it), and a
decode step whose memo holds that version (``decode_one_behind``) grows the CSR in place by
the pages the step before gave each lane as well as its own: it reads each lane's length
from ``seq_lens`` (the memo's tail is a step old) and a row only where the step before added
the lane's last page. Any other step on such a memo keeps runs, as below.

After any other change in between (a release, a truncate, another shape's step,
a restore, a new batch) the step still keeps what it can: every call that may
change a row's pages stamps the row with its version (``row_version``; a step
stamps the rows it gives pages), and the memo notes each lane's stamp. A lane
that names the same request as in the CSR the buffers hold, whose row still has
that stamp, keeps its run: the runs move in place to their new starts
(``splice_csr``) and only the pages outside kept runs are copied from the table.
So when a request finishes and a new one takes its lane (a persistent batch) or
joins at the end after the others moved up (a compacted batch), or when two
``StepOut`` buffers alternate, the step copies the new request's pages and moves
the rest, instead of copying every page of the batch from 256 rows, which is most
of a step when a forward pass has cooled the caches. A request is looked for in
order, at most ``KEEP_LOOKAHEAD`` old lanes past the previous one found; one
further on, or ahead of it, counts as new. A batch with an unknown or repeated request
id, or one whose pages do not fit ``indices``, rebuilds the CSR. Triton rebuilds
it every step (a GPU copies it in little time) and writes no versions.

No page id outside the pool reaches the CSR (corrupt state: a hand edit, or the -1 a
pop of a wild free-stack entry put in a row). The in-place decode copies only pages of a checked
stack run and of the memo; the full step's growth and splice check the pages they copy
from rows, and on one outside ``[0, P)`` the step rebuilds, which exports that request
as empty (``flashinfer_csr_numba``), gives it ``kv_lens`` 0, and leaves no memo a later
step could grow from, this buffer's or (``APPENDED_FROM`` cleared) the other one's.
"""

import numba
import numpy as np
from ._triton_shim import tl, triton

from . import layout as L
from ._numba_util import (fill_null_range, i32_array, i64_array, mark_popped, move_i32, new_step_version,
                          page_shift, pages_for, raise_peaks, row_versions, run_in_pool, stack_run_ok, state_arrays,
                          table_arrays, u8_array, version_cells)
from .layout import (CALL_DESC_LEN, CD_CSR_MEMO, CD_IDS, CD_INDICES, CD_INDICES_LEN, CD_INDPTR, CD_KV_LENS,
                     CD_LANES, CD_LAST_PAGE_LEN, CD_NTOK, CD_OK, CD_OUT, CD_POSITIONS, CD_QO_INDPTR, CD_SLOTS,
                     CD_RELEASE, CD_RELEASE_CACHE, CD_RELEASE_LEN, CD_SLOTS_LEN, CD_STATE)
from ._triton_util import settings
from .flashinfer_csr import flashinfer_csr_body, flashinfer_csr_numba
from .extend import MAX_TILE, decode_lane, extend_body, extend_numba, list_growth, null_lane
from .release import release_numba_entry


_memo_len = numba.njit(nogil=True, inline="always")(L.memo_len)  # the table's own formulas, in numba
_memo_tails = numba.njit(nogil=True, inline="always")(L.memo_tails)
_memo_stamps = numba.njit(nogil=True, inline="always")(L.memo_stamps)
_memo_plan = numba.njit(nogil=True, inline="always")(L.memo_plan)
_memo_kept = numba.njit(nogil=True, inline="always")(L.memo_kept)
_LOW32 = 0xFFFFFFFF


@numba.njit(nogil=True)
def grow_csr(indices_ptr, ins, grown, total, ids, block_table):
    """Turn the CSR of the batch before a step into the one after it, in place.

    ``ins`` lists the lanes that gained pages, in lane order, with the end of
    their run in the old CSR and their page counts before and after; ``total``
    is the new length. From the last lane back, the entries past a lane's old
    run move right by the pages gained at or before it, then its new pages are
    copied in from its row. Every position is below ``total``. It copies the pages
    as they are: ``grown_in_pool`` says whether they are all in the pool.
    """
    indices = i32_array(indices_ptr, total)
    shift = 0
    for g in range(grown):
        shift += ins[g * L.MEMO_INS_WIDTH + 3] - ins[g * L.MEMO_INS_WIDTH + 2]
    end = total - shift  # the old CSR's length
    for g in range(grown - 1, -1, -1):
        lane, old_end = ins[g * L.MEMO_INS_WIDTH], ins[g * L.MEMO_INS_WIDTH + 1]
        have, want = ins[g * L.MEMO_INS_WIDTH + 2], ins[g * L.MEMO_INS_WIDTH + 3]
        if end > old_end:
            move_i32(indices_ptr + 4 * (old_end + shift), indices_ptr + 4 * old_end, end - old_end)
        shift -= want - have
        r = ids[lane]
        if r >= 0 and r < block_table.shape[0] and want <= block_table.shape[1]:  # it was when the extend read it
            for k in range(have, want):  # usually one page: a loop, not a libc call
                indices[old_end + shift + k - have] = block_table[r, k]
        end = old_end


@numba.njit(nogil=True)
def grown_in_pool(ins, grown, ids, block_table, num_pages):
    """Whether the pages ``grow_csr`` copied from the rows of the lanes in ``ins`` are page ids in
    ``[0, num_pages)`` (the full step's check: the in-place decode's pages come from a checked stack run)."""
    ok = True
    for g in range(grown):
        lane, have, want = ins[g * L.MEMO_INS_WIDTH], ins[g * L.MEMO_INS_WIDTH + 2], ins[g * L.MEMO_INS_WIDTH + 3]
        r = ids[lane]
        if r >= 0 and r < block_table.shape[0] and want <= block_table.shape[1]:  # as grow_csr read it
            ok &= run_in_pool(block_table[r], have, want, num_pages)
    return ok


@numba.njit(nogil=True)
def plan_kept_runs(ids, B, old_ids, old_tails, old_stamps, row_version, plan, kept, page_size, cap):
    """Before a step's extend: which runs of the CSR the buffers hold (batch ``old_ids``) the step keeps.

    Lane ``i`` keeps the run of its request when the request was in the old batch, at most
    ``KEEP_LOOKAHEAD`` (layout) lanes past the old lane of the previous kept run (requests that left the
    batch in between are skipped: a compacted batch), and its row still has the stamp the memo
    noted, a numba call's version (its pages are those of the run, and the step can only
    append to them). Kept runs keep their order, so they can be moved in place. ``plan[i]``
    is then ``(start << 32) | pages`` of that run in the old CSR, else -1, and ``kept[i]``
    ``((pages - 1) << 32) | last page`` (the old tail's page, the row's page ``pages - 1``:
    the row's pages are those of the run), else -1. Old runs start where the pages of the old
    lanes before them end (their lengths are the memo's tails).
    Returns the old CSR's length, or -1 when the memo cannot be right (then nothing is kept).
    """
    R = row_version.shape[0]
    shift = page_shift(page_size)
    j = 0          # the first old lane a later run may come from
    start = 0      # where old lane j's run starts
    for i in range(B):
        plan[i] = kept[i] = -1
        r = ids[i]
        if r < 0 or r >= R:
            continue
        skipped = 0  # pages of the old lanes between j and the match
        for jj in range(j, min(j + L.KEEP_LOOKAHEAD, B)):
            o = old_ids[jj]
            n = pages_for(old_tails[jj] & _LOW32, page_size, shift) if o >= 0 and o < R else 0
            if o == r:
                if old_stamps[jj] > 0 and old_stamps[jj] == row_version[r]:
                    plan[i] = ((start + skipped) << 32) | n
                    if n > 0:
                        kept[i] = ((n - 1) << 32) | ((old_tails[jj] >> 32) & _LOW32)
                j, start = jj + 1, start + skipped + n
                break
            skipped += n
    for jj in range(j, B):  # the old lanes after the last match: the old CSR's length
        o = old_ids[jj]
        if o >= 0 and o < R:
            start += pages_for(old_tails[jj] & _LOW32, page_size, shift)
    return start if start <= cap else -1


@numba.njit(nogil=True)
def splice_csr(indices_ptr, indptr, B, plan, blocks, old_total, total, ids, block_table, num_pages):
    """Turn the CSR the buffers hold into the batch's new one, in place, keeping the runs ``plan`` names.

    ``indptr`` is the new batch's (the extend wrote it). A kept run of ``k`` pages moves
    from its old start to its lane's new start (runs next to each other in both CSRs move
    as one block, listed in ``blocks``: source, destination, length); the entries of each
    lane past its kept pages are copied from its row. Blocks that move left go first, from
    the first one, then those that move right, from the last one: kept runs keep their
    order, so no block overwrites one that has not moved yet. What the old CSR had past
    the new total becomes -1. Every position is below ``max(old_total, total)``, which the
    caller checked against the buffer's capacity. Returns whether a page it copied from a row is
    outside ``[0, num_pages)`` (then the caller rebuilds the CSR, as after ``grow_csr``).
    """
    indices = i32_array(indices_ptr, max(old_total, total))
    n = 0
    for i in range(B):
        p = plan[i]
        if p >= 0:
            src, dst = p >> 32, np.int64(indptr[i])
            k = min(p & _LOW32, np.int64(indptr[i + 1]) - dst)
            if k > 0:
                at = 3 * (n - 1)
                if n > 0 and blocks[at] + blocks[at + 2] == src and blocks[at + 1] + blocks[at + 2] == dst:
                    blocks[at + 2] += k
                else:
                    blocks[3 * n], blocks[3 * n + 1], blocks[3 * n + 2] = src, dst, k
                    n += 1
    for b in range(n):  # left moves, first to last
        if blocks[3 * b + 1] < blocks[3 * b]:
            move_i32(indices_ptr + 4 * blocks[3 * b + 1], indices_ptr + 4 * blocks[3 * b], blocks[3 * b + 2])
    for b in range(n - 1, -1, -1):  # right moves, last to first
        if blocks[3 * b + 1] > blocks[3 * b]:
            move_i32(indices_ptr + 4 * blocks[3 * b + 1], indices_ptr + 4 * blocks[3 * b], blocks[3 * b + 2])
    mn = mx = 0  # of the pages copied from rows
    for i in range(B):
        start, stop = indptr[i], indptr[i + 1]
        k = 0
        if plan[i] >= 0:
            k = min(plan[i] & _LOW32, stop - start)
        r = ids[i]  # re-read: bounded again, in case the ids share memory with what the extend wrote
        if stop - start > k and r >= 0 and r < block_table.shape[0] and stop - start <= block_table.shape[1]:
            ur, us = np.uint64(r), np.uint64(start)  # the rest of the run, from its row (a vector copy)
            for c in range(k, stop - start):
                p = block_table[ur, np.uint64(c)]
                indices[us + np.uint64(c)] = p
                mn, mx = min(mn, p), max(mx, p)
    fill_null_range(indices_ptr, total, old_total)
    return mn < 0 or mx >= num_pages


@numba.njit(nogil=True)
def rebuild_csr(req_ids_ptr, B, cd, memo, ps, bt, lens, counters, P, indptr, kvl):
    """The step's CSR from the rows (``flashinfer_csr_numba``), after its extend: a request with a page
    outside the pool, or past the capacity, is exported empty and gets ``kv_lens`` 0. Returns whether
    every request was exported whole (else the caller leaves no memo); clears ``APPENDED_FROM`` after
    a page outside the pool, so no step grows the other buffer's CSR from such a row either."""
    written, empty, cut = flashinfer_csr_numba(req_ids_ptr, B, cd[CD_INDPTR], cd[CD_INDICES], cd[CD_INDICES_LEN],
                                               cd[CD_LAST_PAGE_LEN], ps, bt, lens, counters, memo[L.MEMO_WRITTEN],
                                               False, P, kvl)  # the extend counted the rest
    memo[L.MEMO_WRITTEN] = written
    if empty or cut:  # those lanes (a page outside the pool, or past the capacity) read no page
        for i in range(B):  # through kv_lens either
            if indptr[i + 1] == indptr[i]:
                kvl[i] = 0
    if empty:
        version_cells(cd[:CD_STATE])[L.APPENDED_FROM] = -1
    return not (empty or cut)


@numba.njit(nogil=True, inline="always")
def memo_holds(memo, td, ids, B):
    """Whether the CSR memo ``memo`` holds the batch ``ids`` at the table's version (module note); never
    a memo that holds no CSR (a negative version), even when a hand edit gave the table that version."""
    held = memo[L.MEMO_VERSION]
    if held < 0 or held != version_cells(td)[L.VERSION_NOW]:
        return False
    diff = 0
    for i in range(B):  # no early exit: the loop vectorises
        diff |= memo[L.MEMO_IDS + i] ^ ids[i]
    return diff == 0


@numba.njit(nogil=True, inline="always")
def decode_lanes(req_ids_ptr, ntok_ptr, B, cd, behind):
    """The step of a decode batch whose CSR the buffers hold at the table's version (``behind``:
    at the version the step before started from, module note), in two short passes; False,
    having changed nothing, when the step is not that simple (then the full step runs).

    The simple step: every lane is padding or a request appending one token, every length
    (from the memo's tails; ``behind``, from ``seq_lens``, and no shorter than the tail's)
    leaves room for that token in the row, the page size is a power of two, the slots and the
    CSR have room, and the free stack holds the pages the lanes at a page boundary need (its
    entries page ids). The first pass checks that, and that the memo holds this batch at that
    version, reading nothing but the inputs, the memo (its version, batch and tails), the
    lengths when ``behind``, the free count and the stack entries it would pop; the
    second writes what the full step
    (``extend_numba`` with ``distinct``, then ``grow_csr``) would, through the same lane
    helpers, with its code alone: a decode loop's step fetches little more code than this
    when a forward pass has cooled the caches. ``behind`` is a constant of each caller
    (``decode_in_place``, ``decode_one_behind``), so each compiles only its own case.
    """
    td = cd[:CD_STATE]
    ids, ntok = i32_array(req_ids_ptr, B), i32_array(ntok_ptr, B)
    memo = i64_array(cd[CD_CSR_MEMO], _memo_len(B))
    cells, held = version_cells(td), memo[L.MEMO_VERSION]
    if B <= 0 or held != (cells[L.APPENDED_FROM] if behind else cells[L.VERSION_NOW]) or held < 0:
        return False
    bt, lens, _, ps = table_arrays(td)
    stack, rc, state, _, counters, _, _ = state_arrays(cd[CD_STATE:CD_OUT])
    shift = page_shift(ps)
    T, cap = cd[CD_SLOTS_LEN], cd[CD_INDICES_LEN]
    R, MP = bt.shape[0], bt.shape[1]
    P = rc.shape[0]
    tails_at = _memo_tails(B)
    tails = memo[tails_at:tails_at + B]
    limit = np.int64(MP) * ps
    need = tok = total = 0
    bad = shift < 0
    for i in range(B):
        r, n = ids[i], ntok[i]
        bad |= memo[L.MEMO_IDS + i] != r  # the batch the memo holds (memo_holds, in this pass)
        if r == L.NULL_PAGE:
            tok += max(n, 0)
        else:
            # the length when the memo's CSR was made; a memo one step behind, the row's now (at least
            # that: a step only appends). A negative int32 reads as >= 2**31 > limit (PageTable
            # refuses a limit past INT32_MAX), or as below the old length.
            known = np.uint64(r) < np.uint64(R)
            old = tails[i] & _LOW32
            length = np.int64(lens[np.uint64(r) if known else np.uint64(0)]) if behind else old
            bad |= (not known) | (n != 1) | (length >= limit) | (length < old)
            need += (length & (ps - 1)) == 0
            total += (length >> max(shift, 0)) + 1
            tok += 1
    free = counters[L.FREE_COUNT]
    if bad or tok > T or total > cap or free < need or free > P or not stack_run_ok(stack, free - need, free, P):
        return False
    version = new_step_version(td)
    row_version = row_versions(td)
    counters[L.CLOCK] += 1
    ins, stamps = memo[L.MEMO_IDS + B:tails_at], memo[_memo_stamps(B):_memo_plan(B)]
    slots, ok, positions = i32_array(cd[CD_SLOTS], T), u8_array(cd[CD_OK], B), i32_array(cd[CD_POSITIONS], T)
    indptr, last = i32_array(cd[CD_INDPTR], B + 1), i32_array(cd[CD_LAST_PAGE_LEN], B)
    qo, kvl = i32_array(cd[CD_QO_INDPTR], B + 1), i32_array(cd[CD_KV_LENS], B)
    top = free
    tok = pos = old_pos = grown = bad_slots = changed = 0
    wild = False
    for i in range(B):
        r = ids[i]  # the caller's memory, read again: bounded again (another thread may have written it)
        if r == L.NULL_PAGE:
            start, tok = tok, tok + max(ntok[i], 0)
            null_lane(i, start, tok, T, ps, cd[CD_SLOTS], ok, True, pos, indptr, last, cd[CD_POSITIONS], qo, kvl)
            continue
        if np.uint64(r) >= np.uint64(R) or tok >= T:  # not what the first pass read: the lane is left alone
            changed = 1
            continue
        packed = tails[i]
        length = np.int32(packed & _LOW32)
        page = packed >> 32
        have = 0  # behind: the pages of the lane's run in the memo's CSR, which ends at old_pos + have
        if behind:  # the length is the row's: the row must be the one the first pass read
            old, have = length, (length + ps - 1) >> shift
            length = lens[np.uint64(r)]
            if r != memo[L.MEMO_IDS + i] or length < old or length >= limit or (
                    (length & (ps - 1)) == 0 and top <= free - need):  # not what the first pass read: left alone
                changed = 1
                continue
        k, off = length >> shift, length & (ps - 1)
        if off == 0:  # a new page, from the stack (checked above)
            top -= 1
            page = np.int64(stack[top])
            mark_popped(page, rc, state)
            bt[np.uint64(r), np.uint64(k)] = page
            row_version[r] = version
            if not behind:  # the run had k pages and gains this one
                grown = list_growth(ins, grown, i, pos - grown + k, k, k + 1)
                stamps[i] = version
        elif behind and k != have - 1:  # a page the step before added, past the memo's CSR: from the row
            page = np.int64(bt[np.uint64(r), np.uint64(k)])
        if behind and k >= have:  # the run gains this step's page, or the step before's, or both
            grown = list_growth(ins, grown, i, old_pos + have, have, k + 1)
            stamps[i] = row_version[r]
            # The step before's pages come from the row, where a hand edit without invalidate_csr may have
            # put any id: at k (when off != 0: read above as page; else this step's, from the checked stack
            # run), and at have..k - 1 (none in a decode loop's steps).
            wild |= (off != 0) & (np.uint64(page) >= np.uint64(P))
            if k > have:
                wild |= not run_in_pool(bt[np.uint64(r)], have, k, P)
        old_pos += have
        good, pos = decode_lane(i, tok, r, length, page, k, off, ps, P, slots, lens, ok, True, pos, tails, indptr,
                                last, positions, qo, kvl)
        bad_slots += not good
        tok += 1
    fill_null_range(cd[CD_SLOTS], tok, T)
    fill_null_range(cd[CD_POSITIONS], tok, T)
    indptr[0] = qo[0] = 0
    counters[L.ERR_CORRUPT_STATE] += bad_slots
    counters[L.FREE_COUNT] -= free - top
    counters[L.ALLOCATED] += free - top
    raise_peaks(counters, P)
    if pos > total:
        # More pages than the first pass counted (grow_csr would write past ``total``, the entries the
        # capacity was checked against): a row it read grew lane by lane, a request named twice in a
        # batch only a hand-edited memo holds (no step leaves one). Counted; the CSR rebuilt from the
        # rows within the capacity; the next step rebuilds too.
        counters[L.ERR_CORRUPT_STATE] += 1
        rebuild_csr(req_ids_ptr, B, cd, memo, ps, bt, lens, counters, P, indptr, kvl)
        memo[L.MEMO_VERSION] = -1
        return True
    grow_csr(cd[CD_INDICES], ins, grown, total, ids, bt)
    memo[L.MEMO_WRITTEN] = max(memo[L.MEMO_WRITTEN], total)
    # A page outside the pool copied in (behind: from a row, above): rebuild, as the full step does. (A
    # check in the first pass cost that pass its vectorisation, ~16% of a step taking turns.)
    if wild:
        changed |= not rebuild_csr(req_ids_ptr, B, cd, memo, ps, bt, lens, counters, P, indptr, kvl)
    memo[L.MEMO_VERSION] = version if changed == 0 else -1  # inputs changed under the call: the next step rebuilds
    return True


@numba.njit(nogil=True)
def decode_in_place(req_ids_ptr, ntok_ptr, B, cd):
    """``decode_lanes`` of a memo at the table's version (compiled on its own: the common case's code alone)."""
    return decode_lanes(req_ids_ptr, ntok_ptr, B, cd, False)


@numba.njit(nogil=True)
def decode_one_behind(req_ids_ptr, ntok_ptr, B, cd):
    """``decode_lanes`` of a memo one step behind the table (two ``StepOut`` buffers taking turns)."""
    return decode_lanes(req_ids_ptr, ntok_ptr, B, cd, True)


@numba.njit(nogil=True)
def step_numba_entry(req_ids_ptr, ntok_ptr, B, cd):
    """extend then the CSR for a bound call (outputs, table and pool state in the call descriptor ``cd``);
    the CSR grows in place when the buffers hold the batch's CSR at the table's version, and keeps
    the runs of unchanged rows when they hold another CSR (module note)."""
    if decode_in_place(req_ids_ptr, ntok_ptr, B, cd) or decode_one_behind(req_ids_ptr, ntok_ptr, B, cd):
        return
    td = cd[:CD_STATE]
    bt, lens, claim, ps = table_arrays(td)
    row_version = row_versions(td)
    stack, rc, state, _, counters, _, _ = state_arrays(cd[CD_STATE:CD_OUT])
    ids = i32_array(req_ids_ptr, B)
    memo = i64_array(cd[CD_CSR_MEMO], _memo_len(B))
    cap = cd[CD_INDICES_LEN]
    same = memo_holds(memo, td, ids, B)
    tails_at, stamps_at, plan_at, kept_at = _memo_tails(B), _memo_stamps(B), _memo_plan(B), _memo_kept(B)
    ins, tails = memo[L.MEMO_IDS + B:tails_at], memo[tails_at:stamps_at]
    stamps, plan, kept = memo[stamps_at:plan_at], memo[plan_at:kept_at], memo[kept_at:]
    old_total = -1  # the old CSR's length when the step keeps some of its runs
    if not same and memo[L.MEMO_VERSION] != -1 and B > 0:
        old_total = plan_kept_runs(ids, B, memo[L.MEMO_IDS:L.MEMO_IDS + B], tails, stamps, row_version, plan,
                                   kept, ps, cap)
    version = new_step_version(td)
    indptr, last = i32_array(cd[CD_INDPTR], B + 1), i32_array(cd[CD_LAST_PAGE_LEN], B)
    qo, kvl = i32_array(cd[CD_QO_INDPTR], B + 1), i32_array(cd[CD_KV_LENS], B)
    clean, total, grown = extend_numba(req_ids_ptr, ntok_ptr, B, cd[CD_SLOTS], cd[CD_SLOTS_LEN], cd[CD_OK], ps, bt,
                                       lens, claim, stack, rc, state, counters, True, same, indptr, last, ins,
                                       cd[CD_POSITIONS], qo, kvl, tails, kept[:B if old_total >= 0 else 0])
    for g in range(grown):  # the rows this step gave pages
        lane = ins[g * L.MEMO_INS_WIDTH]
        r = ids[lane]
        if r >= 0 and r < bt.shape[0]:  # it was when the extend read it
            row_version[r] = version
        stamps[lane] = version
    P = rc.shape[0]
    grew = same and clean and total <= cap
    if grew:  # indptr and last_page_len are written: grow indices
        grow_csr(cd[CD_INDICES], ins, grown, total, ids, bt)
        rebuild = not grown_in_pool(ins, grown, ids, bt, P)
        memo[L.MEMO_WRITTEN] = max(memo[L.MEMO_WRITTEN], total)
    elif old_total >= 0 and clean and total <= cap:  # keep the runs of unchanged rows, copy the rest
        rebuild = splice_csr(cd[CD_INDICES], indptr, B, plan, ins, old_total, total, ids, bt, P)
        memo[L.MEMO_WRITTEN] = max(memo[L.MEMO_WRITTEN], total)
    else:
        rebuild = True
    if rebuild:  # from the rows; also after a page outside the pool was copied in (exported empty here)
        clean &= rebuild_csr(req_ids_ptr, B, cd, memo, ps, bt, lens, counters, P, indptr, kvl)
    if not grew:
        for i in range(B):
            r = ids[i]
            memo[L.MEMO_IDS + i] = r
            stamps[i] = row_version[r] if r >= 0 and r < bt.shape[0] else -1
    memo[L.MEMO_VERSION] = version if clean and total <= cap else -1


@numba.njit(nogil=True)
def step_release_numba_entry(release_ptr, K, cache, req_ids_ptr, ntok_ptr, B, cd):
    """``release_numba_entry`` of the ``K`` request ids at ``release_ptr`` (-1 = padding), then
    ``step_numba_entry``: a scheduler step whose finished requests leave and whose new ones join
    in one call. The release stamps the rows it frees, so the step keeps every other run."""
    release_numba_entry(release_ptr, K, cache, cd)
    step_numba_entry(req_ids_ptr, ntok_ptr, B, cd)


@numba.njit(nogil=True)
def step_bound_numba_entry(cd_addr):
    """``step_numba_entry`` for a call bound to its inputs too: everything in the descriptor at ``cd_addr``."""
    cd = i64_array(cd_addr, CALL_DESC_LEN)
    step_numba_entry(cd[CD_IDS], cd[CD_NTOK], cd[CD_LANES], cd)


@numba.njit(nogil=True)
def step_release_bound_numba_entry(cd_addr):
    """``step_release_numba_entry`` for a call bound to its inputs, the release ids among them, which it
    consumes: after the release they are all -1 (padding), so a later call that finds no new
    ids there releases nothing, and never a request admitted again under a released id."""
    cd = i64_array(cd_addr, CALL_DESC_LEN)
    step_release_numba_entry(cd[CD_RELEASE], cd[CD_RELEASE_LEN], cd[CD_RELEASE_CACHE] != 0, cd[CD_IDS], cd[CD_NTOK],
                             cd[CD_LANES], cd)
    fill_null_range(cd[CD_RELEASE], 0, cd[CD_RELEASE_LEN])  # after the step, as on the other backends


@triton.jit
def step_kernel(req_ids_ptr, num_tokens_ptr, B, slots_ptr, T, ok_ptr, positions_ptr, qo_indptr_ptr, kv_lens_ptr,
                indptr_ptr, indices_ptr, cap, last_page_len_ptr, written_ptr, block_table_ptr, seq_lens_ptr, claim_ptr,
                free_stack_ptr, refcount_ptr, page_state_ptr, counters_ptr, R, MP, num_pages, page_size, SEARCH,
                BLOCK: tl.constexpr, TILE: tl.constexpr):
    """``extend_body`` (with the attention metadata) then ``flashinfer_csr_body`` in one program
    (arguments documented there)."""
    extend_body(req_ids_ptr, num_tokens_ptr, B, slots_ptr, T, ok_ptr, block_table_ptr, seq_lens_ptr, claim_ptr,
                free_stack_ptr, refcount_ptr, page_state_ptr, counters_ptr, R, MP, num_pages, page_size,
                positions_ptr, qo_indptr_ptr, kv_lens_ptr, BLOCK, TILE, True)
    tl.debug_barrier()  # the export reads the lengths, rows and counters the extend wrote
    flashinfer_csr_body(req_ids_ptr, B, indptr_ptr, indices_ptr, cap, last_page_len_ptr, block_table_ptr,
                        seq_lens_ptr, counters_ptr, written_ptr, kv_lens_ptr, R, MP, num_pages, page_size, SEARCH,
                        BLOCK, False, True)


def step_triton(req_ids, num_tokens, slots, ok, meta, indptr, indices, last_page_len, written, st, ts) -> None:
    """extend (``meta``: the ``(positions, qo_indptr, kv_lens)`` it writes too) then the CSR export
    in one launch; ``written`` as in ``flashinfer_csr_triton``."""
    B, T, cap = req_ids.numel(), slots.numel(), indices.numel()
    R, MP = ts.block_table.shape
    positions, qo_indptr, kv_lens = meta
    meta = settings(max(B, T, cap))
    step_kernel[(1,)](
        req_ids, num_tokens, B, slots, T, ok, positions, qo_indptr, kv_lens, indptr, indices, cap, last_page_len,
        written,
        ts.block_table, ts.seq_lens, ts.claim, st.free_stack, st.refcount, st.page_state, st.counters,
        R, MP, st.num_pages, ts.page_size, B.bit_length(),
        TILE=min(meta["BLOCK"], MAX_TILE), **meta,
    )
