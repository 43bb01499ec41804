"""revive: an empty row takes ``k`` given pages (a prefix-cache hit), all or none.

Every page must be USED or CACHED and named once, and with recorded generations
(``HAS_GENS``) still have the generation recorded for it; then each gains one reference
(a CACHED page is revived, counted in ``revived``), the row holds them and its
length is ``k * page_size``. Otherwise no page is taken, the row's first ``k``
entries are -1 and its length 0, and the entries that could not be taken are
counted as ``incref`` counts them, once per entry: ``invalid_page`` (an id
outside the pool), ``use_after_free`` (FREE, or USED / CACHED under another
generation than the recorded one: freed since), ``corrupt_state`` (no known
state). A prefix has no padding and names each page once: a -1 counts one
``invalid_page``, and so does each entry naming a page an earlier entry names,
where it would be taken otherwise. A row outside ``[0, R)`` is
``bad_request``, else ``k > max_pages`` ``table_overflow``, else a row that is
not empty ``bad_request``: nothing else happens. The clock ticks once.
"""

import numba
from ._triton_shim import tl, triton

from . import layout as L
from . import _numba_util as nu
from ._numba_util import (i32_array, i64_array, new_version, page_gens, row_versions, state_arrays, table_arrays,
                          version_cells)
from .layout import CD_OUT, CD_STATE
from .step import _memo_len, _memo_stamps
from ._triton_table_util import ERR_BAD_REQUEST, ERR_TABLE_OVERFLOW
from ._triton_util import (CACHED, CACHED_COUNT, ERR_CORRUPT_STATE, ERR_INVALID_PAGE, ERR_REFCOUNT_OVERFLOW,
                           ERR_USE_AFTER_FREE, FREE, NULL_PAGE, REVIVED, USED, add_references, count_pages,
                           counter_add, load_counters, raise_peaks, reset_lanes, settings, store_counters, tick)


@numba.njit(nogil=True)
def revive_numba(
    row,          # the row to fill
    pages_ptr,    # address of int32 [N], the pages to revive
    gens_ptr,     # address of int32 [N], their recorded generations, or 0: none (not compared)
    N,            # number of pages
    page_size,    # tokens per page
    block_table,  # int32 [R, MP]
    seq_lens,     # int32 [R]
    refcount,     # int32 [P]
    page_state,   # int8 [P]
    page_gen,     # int32 [P]
    counters,     # int64 [NUM_COUNTERS]
    occur,        # int32 [P] scratch, zero between calls
):
    pages = i32_array(pages_ptr, N)
    gens = i32_array(gens_ptr if gens_ptr != 0 else pages_ptr, N)  # (never read without gens_ptr)
    R, MP = block_table.shape
    P = refcount.shape[0]
    counters[L.CLOCK] += 1
    if row < 0 or row >= R:
        counters[L.ERR_BAD_REQUEST] += 1
    elif N > MP:
        counters[L.ERR_TABLE_OVERFLOW] += 1
    elif seq_lens[row] != 0:
        counters[L.ERR_BAD_REQUEST] += 1
    else:
        nu.count_pages(pages, P, occur, counters)  # occurrences per page (>= 1); counts the ids outside the pool
        whole = True  # every page USED or CACHED and named once
        for i in range(N):
            p = pages[i]
            if p < 0 or p >= P:  # outside the pool (counted above), or -1: no padding in a prefix
                whole = False
                if p == L.NULL_PAGE:
                    counters[L.ERR_INVALID_PAGE] += 1
                continue
            again = occur[p] < 0  # an earlier entry names it (-1: seen)
            occur[p] = -1
            state = page_state[p]
            if (state == L.USED or state == L.CACHED) and gens_ptr != 0 and gens[i] != page_gen[p]:
                whole = False  # freed since its generation was recorded (and maybe handed out again)
                counters[L.ERR_USE_AFTER_FREE] += 1
            elif state == L.USED or state == L.CACHED:
                if again:  # a page named twice: would be taken twice
                    whole = False
                    counters[L.ERR_INVALID_PAGE] += 1
            else:  # an entry that cannot be taken, counted as incref counts it
                whole = False
                if state == L.FREE:
                    counters[L.ERR_USE_AFTER_FREE] += 1
                else:
                    counters[L.ERR_CORRUPT_STATE] += 1
        for i in range(N):
            p = pages[i]
            block_table[row, i] = p if whole else L.NULL_PAGE
            if p < 0 or p >= P:
                continue
            occur[p] = 0
            if whole:  # distinct pages, each USED or CACHED: one reference each
                nu.add_references(p, 1, refcount, page_state, counters)
        seq_lens[row] = N * page_size if whole else 0
    nu.raise_peaks(counters, P)


@numba.njit(nogil=True)
def revive_numba_entry(row, pages_ptr, gens_ptr, N, cd):
    """``revive_numba`` with table and pool state in the call descriptor ``cd`` (fast dispatch); the row,
    if in range, gets a fresh stamp (as ``stamp_rows``: a step keeps no run of it noted before)."""
    bt, lens, _, ps = table_arrays(cd[:CD_STATE])
    if row >= 0 and row < bt.shape[0]:
        row_versions(cd[:CD_STATE])[row] = new_version(cd[:CD_STATE])
    _, rc, state, _, counters, occur, _ = state_arrays(cd[CD_STATE:CD_OUT])
    revive_numba(row, pages_ptr, gens_ptr, N, ps, bt, lens, rc, state, page_gens(cd[CD_STATE:CD_OUT]), counters,
                 occur)


@numba.njit(nogil=True)
def forget_row_numba(memo_ptr, b, row, td):
    """``CsrMemo.forget`` of the one row ``row`` (int64 memo ``[memo_len(b)]`` at ``memo_ptr``): the
    stamps of the lanes naming it become -1, and a memo version equal to one of the table's version
    cells (>= 0) becomes -2. Run before the row's new stamp (``revive_numba_entry``)."""
    m = i64_array(memo_ptr, _memo_len(b))
    at = _memo_stamps(b)
    for j in range(b):
        if m[L.MEMO_IDS + j] == row:
            m[at + j] = -1
    cells = version_cells(td)
    for w in range(L.VERSION_CELLS):
        if cells[w] >= 0 and m[L.MEMO_VERSION] == cells[w]:
            m[L.MEMO_VERSION] = -2


# ---------------------------------------------------------------------- Triton
# One program: the pool's claim pass over the pages (first entry per page), a barrier, a
# pass that decides ``whole`` (all taken, none repeated, none of another generation
# than recorded) and counts the entries
# that cannot be taken, a barrier, a pass that increfs the pages and writes the
# row (or -1s), then the scratch restored.


# Not specialised on a row number or a page count (Triton compiles a variant for an int argument that is
# 1 or a multiple of 16): a revive into row 16 or of one page would compile mid-serving.
@triton.jit(do_not_specialize=["N", "row"])
def revive_kernel(
    pages_ptr,        # *int32 [N]: the pages to revive
    gens_ptr,         # *int32 [N]: their recorded generations (HAS_GENS only)
    N,                # number of pages
    row,              # the row to fill
    block_table_ptr,  # *int32 [R, MP]
    seq_lens_ptr,     # *int32 [R]
    refcount_ptr,     # *int32 [P]
    page_state_ptr,   # *int8 [P]
    page_gen_ptr,     # *int32 [P]
    counters_ptr,     # *int64 [NUM_COUNTERS]
    claim_ptr,        # *int32 [P] scratch, INT32_MAX between calls
    occur_ptr,        # *int32 [P] scratch, 0 between calls
    R,                # rows of block_table
    MP,               # columns of block_table
    num_pages,        # P
    page_size,        # tokens per page
    # Meta-parameters
    HAS_GENS: tl.constexpr,  # a page is taken only if its generation equals gens[i]
    BLOCK: tl.constexpr,     # lanes per chunk
):
    """row takes pages[:N] (one reference each, CACHED revived) and N * page_size tokens, or none of them."""
    lanes = tl.arange(0, BLOCK)
    c = load_counters(counters_ptr)
    c, _clock = tick(c)
    inr = (row >= 0) & (row < R)
    r = tl.where(inr, row, 0).to(tl.int64)
    fits = inr & (N <= MP)
    empty = tl.load(seq_lens_ptr + r, mask=fits, other=1) == 0
    good = fits & empty
    n = tl.where(good, N, 0)  # lanes of the passes: none for a refused row
    invalid = count_pages(pages_ptr, n, claim_ptr, occur_ptr, num_pages, BLOCK, False)
    tl.debug_barrier()
    untaken = tl.zeros((), tl.int64)  # entries that cannot be taken, and taken pages named twice
    uaf = tl.zeros((), tl.int64)
    wrong = tl.zeros((), tl.int64)  # pages in no known state: corrupt
    misnamed = tl.zeros((), tl.int64)  # -1s (no padding in a prefix), and pages an earlier entry names
    for start in range(0, n, BLOCK):
        i = start + lanes
        live = i < n
        p = tl.load(pages_ptr + i, mask=live, other=NULL_PAGE)
        valid = live & (p >= 0) & (p < num_pages)
        state = tl.load(page_state_ptr + p, mask=valid, other=FREE)
        live_page = valid & ((state == USED) | (state == CACHED))
        if HAS_GENS:  # freed since its generation was recorded (and maybe handed out again): not taken
            stale = live_page & (tl.load(gens_ptr + i, mask=live_page, other=0)
                                 != tl.load(page_gen_ptr + p, mask=live_page, other=0))
        else:
            stale = tl.zeros((BLOCK,), tl.int1)
        taken = live_page & ~stale
        first = tl.load(claim_ptr + p, mask=taken, other=-1) == i  # the first entry naming p (count_pages)
        uaf += tl.sum((valid & (state == FREE)).to(tl.int64)) + tl.sum(stale.to(tl.int64))
        wrong += tl.sum((valid & ~live_page & (state != FREE)).to(tl.int64))
        misnamed += tl.sum(((live & (p == NULL_PAGE)) | (taken & ~first)).to(tl.int64))
        untaken += tl.sum((live & ~(taken & first)).to(tl.int64))
    whole = good & (untaken == 0)
    tl.debug_barrier()
    revived = tl.zeros((), tl.int64)
    over = tl.zeros((), tl.int64)
    for start in range(0, n, BLOCK):
        i = start + lanes
        live = i < n
        p = tl.load(pages_ptr + i, mask=live, other=NULL_PAGE)
        held = i < tl.where(whole, n, 0)  # distinct pages, each USED or CACHED (a block compare: no 0-d mask)
        cached = held & (tl.load(page_state_ptr + p, mask=held, other=FREE) == CACHED)
        more, back = add_references(p, held, cached, 1, refcount_ptr, page_state_ptr, BLOCK)
        over += more
        revived += back
        tl.store(block_table_ptr + r * MP + i, tl.where(held, p, NULL_PAGE), mask=live)
    tl.debug_barrier()
    reset_lanes(pages_ptr, n, claim_ptr, occur_ptr, num_pages, BLOCK)
    tl.store(seq_lens_ptr + r, tl.where(whole, n.to(tl.int64) * page_size, 0).to(tl.int32), mask=good)
    c = counter_add(c, ERR_BAD_REQUEST, (~inr | (fits & ~empty)).to(tl.int64))
    c = counter_add(c, ERR_TABLE_OVERFLOW, (inr & ~fits).to(tl.int64))
    c = counter_add(c, ERR_INVALID_PAGE, invalid.to(tl.int64) + misnamed)
    c = counter_add(c, ERR_USE_AFTER_FREE, uaf)
    c = counter_add(c, ERR_CORRUPT_STATE, wrong)
    c = counter_add(c, ERR_REFCOUNT_OVERFLOW, over)
    c = counter_add(c, CACHED_COUNT, -revived)
    c = counter_add(c, REVIVED, revived)
    c = raise_peaks(c, num_pages)
    store_counters(counters_ptr, c)


def revive_triton(row, pages, st, ts, gens=None) -> None:
    """Row ``row`` (a host int) takes ``pages`` (int32 ``[k]``), all or none, with ``gens`` (int32 ``[k]``)
    only pages of those generations (one launch; see module note)."""
    R, MP = ts.block_table.shape
    revive_kernel[(1,)](
        pages, pages if gens is None else gens, pages.numel(), row, ts.block_table, ts.seq_lens, st.refcount,
        st.page_state, st.page_gen, st.counters, st.claim, st.occur, R, MP, st.num_pages, ts.page_size,
        HAS_GENS=gens is not None, **settings(pages.numel()),
    )
