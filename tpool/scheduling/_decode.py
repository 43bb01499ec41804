"""The mirror's per-batch accounting (a decode step, a truncate, a step's extra pages, the row
checks), each as one compiled loop over the batch.

Note: the same arithmetic in numpy takes ~25 array operations (~30 us at B=256
on a CPU, ten times the step it accounts for); one numba loop takes ~1 us.
At the small batches of a model loop the numpy versions cost 10-20 us each
too, one array operation being ~1 us whatever its length.
Records are the rows of ``HostMirror._st``: ``lo, hi, limit, shared, res, gen``.
"""

import numba
import numpy as np

from tpool.backends.numba import cached_njit  # compiled once per machine, loaded after (as the kernels)
from tpool.kernels._numba_util import i32_array, i64_array

LO, HI, LIMIT, SHARED, RES, GEN = 0, 1, 2, 3, 4, 5

# Return codes of decode_accounting
FITS, PAST_MAX_LEN, NO_ROOM, BAD_INPUT = 0, 1, 2, 3


@numba.njit(inline="always")
def _rows_inside(st, rows, n, per_row, out_len, out):
    """Whether every row of ``rows`` is a row of records ``st`` (of at least 6 columns), ``n`` has one
    entry per row when ``per_row``, and ``out`` at least ``out_len`` entries: numba does not bound an
    index, so a loop that indexes the records by its rows checks them first."""
    if st.shape[1] <= GEN or out.shape[0] < out_len or (per_row and n.shape[0] != rows.shape[0]):
        return False
    for i in range(rows.shape[0]):
        if rows[i] < 0 or rows[i] >= st.shape[0]:
            return False
    return True


@numba.njit(inline="always")
def _cdiv(a, ps, shift):
    """ceil(a / ps) for a >= 0; a shift when ``ps`` is a power of two (``shift >= 0``)."""
    return (a + ps - 1) >> shift if shift >= 0 else (a + ps - 1) // ps


@numba.njit(inline="always")
def _shift(ps):
    """log2(ps) when ``ps`` is a power of two, else -1 (``_cdiv`` divides)."""
    shift = -1
    if ps & (ps - 1) == 0:
        shift = 0
        while (1 << shift) < ps:
            shift += 1
    return shift


@cached_njit(nogil=True)
def decode_accounting(st, rows, n, n_scalar, ps, lookahead, unreserved, out):
    """Account ``n`` more tokens for each row of ``rows`` (int64 ``[B]``) in records ``st``.

    ``n`` is int64 ``[B]`` or, when empty, every row takes ``n_scalar``. Pass 1 checks
    (``PAST_MAX_LEN``: a row would pass its limit; ``NO_ROOM``: more pages than its
    reservation plus ``unreserved`` pages); nothing is written unless it FITS. Pass 2
    takes each row's pages from its reservation first, advances ``lo``/``hi`` and tops
    the reservation back up to the next ``lookahead`` tokens, in row order, from what
    is left unreserved. ``out`` (int64 ``[5]``) gets: pages taken, reserved pages used,
    reserved pages granted, 1 if every row got its full reservation and has room for
    ``lookahead`` more tokens before its limit (else 0: ``preemption``'s O(1) answer
    for the next step needs both), and 1 if some row has ``lo != hi`` (else 0). Returns
    ``BAD_INPUT`` (nothing written) when a row lies outside the records or the arrays do not match.
    """
    B = rows.shape[0]
    shift = _shift(ps)
    per_row = n.shape[0] > 0
    if not _rows_inside(st, rows, n, per_row, 5, out):
        return BAD_INPUT
    taken = used = 0
    uncertain = 0
    for i in range(B):
        q = rows[i]
        k = n[i] if per_row else n_scalar
        lo, hi, res = st[q, LO], st[q, HI], st[q, RES]
        if hi + k > st[q, LIMIT]:
            return PAST_MAX_LEN
        need = min(_cdiv(hi + k, ps, shift) - _cdiv(lo, ps, shift), _cdiv(k, ps, shift))
        taken += need
        used += min(need, res)
        if lo != hi:
            uncertain = 1
    if taken - used > unreserved:
        return NO_ROOM
    room = unreserved - (taken - used)
    granted = 0
    full = 1
    for i in range(B):
        q = rows[i]
        k = n[i] if per_row else n_scalar
        lo0, hi = st[q, LO], st[q, HI] + k
        lo = lo0 + k
        need = min(_cdiv(hi, ps, shift) - _cdiv(lo0, ps, shift), _cdiv(k, ps, shift))
        res = st[q, RES]
        res -= min(need, res)
        ahead = min(st[q, LIMIT] - hi, lookahead)
        target = min(_cdiv(hi + ahead, ps, shift) - _cdiv(lo, ps, shift), _cdiv(ahead, ps, shift))
        want = max(target - res, 0)
        got = min(want, room)
        if got < want or ahead < lookahead:
            full = 0
        room -= got
        granted += got
        st[q, LO], st[q, HI], st[q, RES] = lo, hi, res + got
    out[0], out[1], out[2], out[3], out[4] = taken, used, granted, full, uncertain
    return FITS


@cached_njit(nogil=True)
def extra_pages(st, rows, n, n_scalar, ps):
    """Pages ``n`` more tokens of each row need beyond the row's reservation (``n`` as for
    :func:`decode_accounting`), or -1 if a row would pass its limit, -2 if a row lies outside the
    records or ``n`` is not one per row. Writes nothing."""
    shift = _shift(ps)
    per_row = n.shape[0] > 0
    if not _rows_inside(st, rows, n, per_row, 0, n):
        return -2
    extra = 0
    for i in range(rows.shape[0]):
        q = rows[i]
        k = n[i] if per_row else n_scalar
        hi = st[q, HI]
        if hi + k > st[q, LIMIT]:
            return -1
        need = min(_cdiv(hi + k, ps, shift) - _cdiv(st[q, LO], ps, shift), _cdiv(k, ps, shift))
        extra += max(need - st[q, RES], 0)
    return extra


@cached_njit(nogil=True)
def check_rows(rows, live, scratch):
    """0 if ``rows`` are distinct running rows; 1 if one is out of range or not running; 2 if
    one repeats. ``scratch`` (int64 ``[R]``, private: as many rows as the records) is overwritten.
    Rows are bounded by it too: ``live`` is a public attribute, which a caller may rebind to a
    longer array, and the accounting kernels index the records with the rows checked here."""
    R = min(live.shape[0], scratch.shape[0])
    for i in range(rows.shape[0]):
        q = rows[i]
        if q < 0 or q >= R or not live[q]:
            return 1
        scratch[q] = i
    for i in range(rows.shape[0]):
        if scratch[rows[i]] != i:
            return 2
    return 0


@cached_njit(nogil=True)
def truncate_accounting(st, rows, new_lens, ps, lookahead, unreserved, out):
    """Roll rows back to ``new_lens`` (int64 ``[B]``, each within ``[0, lo]``).

    Returns 1 (nothing written) when a length is out of that range, 2 (nothing written)
    when a row would end inside one of its possibly-shared pages (``new_len < hi``, not a
    multiple of ``ps``, within its first ``shared`` pages), else 0: it credits the pages
    past each new length that are surely the row's alone (past its possibly-shared
    prefix), sets ``lo = hi = new length``, trims the shared prefix, then tops the
    reservations back up to the next ``lookahead`` tokens, in row order, from
    ``unreserved`` plus the pages credited. ``out`` (int64 ``[5]``) gets: pages credited,
    reserved pages granted, 1 if a credit may be short (a length was uncertain or a shared
    prefix was cut). Returns 3 (nothing written) when a row lies outside the records or the
    arrays do not match.
    """
    B = rows.shape[0]
    shift = _shift(ps)
    if not _rows_inside(st, rows, new_lens, True, 3, out):
        return 3
    for i in range(B):
        k, q = new_lens[i], rows[i]
        if k < 0 or k > st[q, LO]:
            return 1
        if k < st[q, HI] and k % ps != 0 and k // ps < st[q, SHARED]:
            return 2
    back = 0
    unsure = 0
    for i in range(B):
        q = rows[i]
        keep = new_lens[i]
        kp = _cdiv(keep, ps, shift)
        shared = st[q, SHARED]
        lo = st[q, LO]
        back += max(_cdiv(lo, ps, shift) - max(kp, shared), 0)
        if lo != st[q, HI] or shared > kp:
            unsure = 1
        st[q, LO] = keep
        st[q, HI] = keep
        st[q, SHARED] = min(shared, kp)
    room = unreserved + back
    granted = 0
    for i in range(B):
        q = rows[i]
        keep = st[q, HI]
        ahead = min(st[q, LIMIT] - keep, lookahead)
        target = min(_cdiv(keep + ahead, ps, shift) - _cdiv(keep, ps, shift), _cdiv(ahead, ps, shift))
        want = max(target - st[q, RES], 0)
        got = min(want, max(room, 0))
        room -= got
        granted += got
        st[q, RES] += got
    out[0], out[1], out[2] = back, granted, unsure
    return 0



@cached_njit(nogil=True)
def count_total(n, cap):
    """The sum of ``n`` (int64 ``[B]``: tokens per row) if every entry is within ``[0, cap]``, else -1."""
    total = 0
    for i in range(n.shape[0]):
        k = n[i]
        if k < 0 or k > cap:
            return -1
        total += k
    return total


@cached_njit(nogil=True)
def fill_lanes(ids, ntok, rows, n, n_scalar, prompts, new):
    """Write a step's lanes into its inputs ``ids`` and ``ntok`` (int32 ``[w]``): the decode ``rows``
    (int64) with ``n`` tokens each (``n`` as for :func:`decode_accounting`), then the ``new`` rows
    (int64) with their ``prompts``, then padding (-1, 0 tokens). Returns 0, or -1 (nothing written) when
    the lanes do not fit ``w`` or the arrays disagree in length: it never writes past what it was given."""
    b, k = rows.shape[0], new.shape[0]
    per_row = n.shape[0] > 0
    if b + k > ids.shape[0] or ntok.shape[0] != ids.shape[0] or (per_row and n.shape[0] != b) \
            or prompts.shape[0] != k:
        return -1
    for i in range(b):
        ids[i] = rows[i]
        ntok[i] = n[i] if per_row else n_scalar
    for i in range(k):
        ids[b + i] = new[i]
        ntok[b + i] = prompts[i]
    for i in range(b + k, ids.shape[0]):
        ids[i] = -1
        ntok[i] = 0
    return 0



@cached_njit(nogil=True)
def finish_accounting(st, live, named, rows, ps, ids, out):
    """End the requests of ``rows`` (int64 ``[B]``, distinct running rows) in records ``st``: zero their
    reservations and ``named`` pages, bump their generation, mark them not ``live``, and write them
    into ``ids`` (int32 ``[B]``: the release's input). ``out`` (int64 ``[3]``) gets: the pages surely
    theirs alone (past their possibly-shared prefix: what their release credits), the reserved pages
    given back, and 1 if a credit may be short (a length was uncertain or a prefix shared). Returns 0,
    or -1 (nothing written) when a row is outside the records, ``ids`` is not ``[B]``, the records
    have fewer than 6 columns or ``out`` fewer than 3 entries."""
    B = rows.shape[0]
    if ids.shape[0] != B or live.shape[0] != st.shape[0] or named.shape[0] != st.shape[0] or st.shape[1] <= GEN \
            or out.shape[0] < 3:
        return -1
    for i in range(B):
        if rows[i] < 0 or rows[i] >= st.shape[0]:
            return -1
    shift = _shift(ps)
    back = res = unsure = 0
    for i in range(B):
        q = rows[i]
        lo, shared = st[q, LO], st[q, SHARED]
        back += max(_cdiv(lo, ps, shift) - shared, 0)
        if lo != st[q, HI] or shared > 0:
            unsure = 1
        res += st[q, RES]
        st[q, RES] = 0
        st[q, GEN] += 1
        named[q] = 0
        live[q] = False
        ids[i] = q
    out[0], out[1], out[2] = back, res, unsure
    return 0



@numba.njit(inline="always")
def _need(st, q, k, ps, shift):
    """Pages ``k`` more tokens of row ``q`` may need (``Accounting._need``: from ``hi``, at most ``ceil(k / ps)``)."""
    return min(_cdiv(st[q, HI] + k, ps, shift) - _cdiv(st[q, LO], ps, shift), _cdiv(k, ps, shift))


@cached_njit(nogil=True)
def reconcile_check(st_then, live_then, hi_fix, hi_fix_then, lens):
    """The first row whose true length ``lens[q]`` lies outside the mirror's bounds at a snapshot
    (records ``st_then``, running rows ``live_then``; ``hi`` corrected by the reconciliations made
    since, ``hi_fix - hi_fix_then``; ``[0, 0]`` for a row not running then), -1 if none, -2 if the
    arrays do not have one entry per row."""
    R = st_then.shape[0]
    if live_then.shape[0] != R or hi_fix.shape[0] != R or hi_fix_then.shape[0] != R or lens.shape[0] != R \
            or st_then.shape[1] <= HI:
        return -2
    for q in range(R):
        lo = hi = 0
        if live_then[q]:
            lo, hi = st_then[q, LO], st_then[q, HI] + hi_fix[q] - hi_fix_then[q]
        if lens[q] < lo or lens[q] > hi:
            return q
    return -1


@cached_njit(nogil=True)
def reconcile_rows(st, live, exact_at, uncertain_at, reserved_to, hi_fix, st_then, live_then, hi_fix_then, lens,
                   seq, ps, lookahead):
    """Settle the rows of records ``st`` from a snapshot that ``reconcile_check`` passed (its arguments
    as there; ``seq``: the snapshot's op number). A row running then and now, of the same request
    (generation), not set outright since (``exact_at``) and with bounds to settle then (``lo != hi``)
    gets ``hi`` = its true length plus what was asked since (the change also added to ``hi_fix``
    and to a ``reserve``'s ``reserved_to``); if it was not rolled back since (``uncertain_at``),
    ``lo = hi`` and its reservation is trimmed to what its next ``lookahead`` tokens and its
    ``reserved_to`` need, never grown. Returns the reserved pages given back, or -1 (nothing
    written) when the arrays do not all have one entry per row."""
    R = st.shape[0]
    for a in (live, live_then):
        if a.shape[0] != R:
            return -1
    for b in (exact_at, uncertain_at, reserved_to, hi_fix, hi_fix_then):
        if b.shape[0] != R:
            return -1
    if st_then.shape[0] != R or lens.shape[0] != R or st.shape[1] <= GEN or st_then.shape[1] <= GEN:
        return -1
    shift = _shift(ps)
    back = 0
    for q in range(R):
        if not (live_then[q] and live[q] and st_then[q, GEN] == st[q, GEN] and exact_at[q] <= seq
                and st_then[q, LO] != st_then[q, HI]):
            continue
        fix = lens[q] - (st_then[q, HI] + hi_fix[q] - hi_fix_then[q])
        st[q, HI] += fix
        hi_fix[q] += fix
        reserved_to[q] = reserved_to[q] + fix if reserved_to[q] > 0 else 0
        if uncertain_at[q] <= seq:
            st[q, LO] = st[q, HI]
            ahead = max(reserved_to[q] - st[q, HI], 0)
            target = _need(st, q, min(lookahead, st[q, LIMIT] - st[q, HI]), ps, shift)
            keep = min(st[q, RES], max(target, _need(st, q, ahead, ps, shift)))
            back += st[q, RES] - keep
            st[q, RES] = keep
    return back



@cached_njit(nogil=True)
def check_prompts(prompts, lims, cap):
    """The tokens of ``prompts`` (int64 ``[k]``) if each is within ``[0, lims[i]]`` and each of ``lims``
    (int64 ``[k]``: max_lens) within ``[0, cap]``, else -1."""
    if lims.shape[0] != prompts.shape[0]:
        return -1
    total = 0
    for i in range(prompts.shape[0]):
        q, m = prompts[i], lims[i]
        if q < 0 or q > m or m > cap:
            return -1
        total += q
    return total


@cached_njit(nogil=True)
def start_rows(st, live, reserved_to, uncertain_at, exact_at, rows, lens, lims, seq, ps, lookahead, unreserved,
               out):
    """Start a request in each of ``rows`` (int64 ``[k]``, free rows, distinct): ``lo = hi = lens[i]``
    tokens, limit ``lims[i]``, nothing shared, running (``live``), set outright at op ``seq``. Their
    pages (``ceil(len / ps)`` each) come out of ``unreserved``; then each row's reservation (0: a
    free row holds none) is topped up to its next ``lookahead`` tokens, in order, from what is left.
    ``out`` (int64 ``[5]``) gets: pages taken, reserved pages granted, 1 if every row got its full
    reservation. Returns 0, or -1 (nothing written) when a row is outside the records or the arrays
    disagree in length (records of fewer than 6 columns, ``out`` of fewer than 3)."""
    k, R = rows.shape[0], st.shape[0]
    if lens.shape[0] != k or lims.shape[0] != k or live.shape[0] != R or reserved_to.shape[0] != R \
            or uncertain_at.shape[0] != R or exact_at.shape[0] != R or st.shape[1] <= GEN or out.shape[0] < 3:
        return -1
    for i in range(k):
        if rows[i] < 0 or rows[i] >= R:
            return -1
    shift = _shift(ps)
    taken = 0
    for i in range(k):
        q = rows[i]
        st[q, LO] = st[q, HI] = lens[i]
        st[q, LIMIT], st[q, SHARED] = lims[i], 0
        live[q] = True
        reserved_to[q] = 0
        uncertain_at[q] = -1
        exact_at[q] = seq
        taken += _cdiv(lens[i], ps, shift)
    room = unreserved - taken
    granted = 0
    full = 1
    for i in range(k):
        q = rows[i]
        want = max(_need(st, q, min(lookahead, st[q, LIMIT] - st[q, HI]), ps, shift) - st[q, RES], 0)
        got = min(want, max(room, 0))
        if got < want:
            full = 0
        room -= got
        granted += got
        st[q, RES] += got
    out[0], out[1], out[2] = taken, granted, full
    return 0



@cached_njit
def snapshot_copy(counters_addr, n_counters, lens_addr, n_lens, st, live, hi_fix):
    """A mirror snapshot on the numba backend, in one call that keeps the GIL (no numba call of another
    thread lands inside it): copies of the pool's counters (int64 ``[n_counters]`` at
    ``counters_addr``), of the table's lengths (int32 ``[n_lens]`` at ``lens_addr``: both at the
    addresses of the backend's descriptors) and of the mirror's records, running rows and corrections."""
    return (i64_array(counters_addr, n_counters).copy(), i32_array(lens_addr, n_lens).copy(), st.copy(), live.copy(),
            hi_fix.copy())


EMPTY = np.zeros(0, dtype=np.int64)
