"""incref: add one reference per entry (prefix sharing, prefix-cache hits).

A USED page gains ``k`` references; a CACHED page is revived (USED with
``k`` references, counted in ``revived``); a FREE page is ``use_after_free``
per entry. ``-1`` is padding; other ids outside ``[0, P)`` count ``invalid_page``.
"""

import numba
from ._triton_shim import tl, triton

from . import layout as L
from . import _numba_util as nu
from ._numba_util import i32_array, state_arrays
from ._triton_util import (CACHED, CACHED_COUNT, ERR_CORRUPT_STATE, ERR_INVALID_PAGE, ERR_REFCOUNT_OVERFLOW,
                           ERR_USE_AFTER_FREE, FREE, REVIVED, USED, add_references, count_pages, counter_add,
                           first_lanes, load_counters, raise_peaks, reset_lanes, settings, store_counters, tick)


@numba.njit(nogil=True)
def incref_numba(
    pages_ptr,   # address of int32 [N], pages to reference, -1 padded
    N,           # number of entries
    refcount,    # int32 [P]
    page_state,  # int8 [P]
    counters,    # int64 [NUM_COUNTERS]
    occur,       # int32 [P] scratch, zero between calls
):
    pages = i32_array(pages_ptr, N)
    P = refcount.shape[0]
    counters[L.CLOCK] += 1
    nu.count_pages(pages, P, occur, counters)
    for i in range(N):
        p = pages[i]
        if p < 0 or p >= P or occur[p] == 0:
            continue
        k = occur[p]
        occur[p] = 0
        state = page_state[p]
        if state == L.FREE:
            counters[L.ERR_USE_AFTER_FREE] += k
            continue
        if state != L.USED and state != L.CACHED:  # no such state: corrupt, left alone
            counters[L.ERR_CORRUPT_STATE] += k
            continue
        nu.add_references(p, k, refcount, page_state, counters)
    nu.raise_peaks(counters, P)


@numba.njit(nogil=True)
def incref_numba_entry(pages_ptr, N, sd):
    """``incref_numba`` with the state passed as a descriptor (fast dispatch)."""
    _, rc, state, _, counters, occur, _ = state_arrays(sd)
    incref_numba(pages_ptr, N, rc, state, counters, occur)


# ---------------------------------------------------------------------- Triton
# One program: claim / apply (first occurrences only) / release, as in free.


@triton.jit
def incref_kernel(
    pages_ptr,       # *int32 [N]: pages to reference, -1 padded
    n_pages,         # N
    refcount_ptr,    # *int32 [P]
    page_state_ptr,  # *int8 [P]
    counters_ptr,    # *int64 [NUM_COUNTERS]
    claim_ptr,       # *int32 [P] scratch, INT32_MAX between calls
    occur_ptr,       # *int32 [P] scratch, 0 between calls
    num_pages,       # P
    # Meta-parameters
    BLOCK: tl.constexpr,  # lanes per chunk
):
    """Per distinct page named k times: USED/CACHED -> refcount += k (CACHED revived); FREE -> k use-after-free."""
    c = load_counters(counters_ptr)
    c, _clock = tick(c)
    invalid = count_pages(pages_ptr, n_pages, claim_ptr, occur_ptr, num_pages, BLOCK, False)
    tl.debug_barrier()
    uaf = tl.zeros((), tl.int64)
    revived = tl.zeros((), tl.int64)
    over = tl.zeros((), tl.int64)
    wrong = tl.zeros((), tl.int64)  # pages in no known state: corrupt, left alone
    for start in range(0, n_pages, BLOCK):
        p, first, k = first_lanes(pages_ptr, start, n_pages, claim_ptr, occur_ptr, num_pages, BLOCK, False)
        state = tl.load(page_state_ptr + p, mask=first, other=FREE)
        uaf += tl.sum(tl.where(first & (state == FREE), k, 0).to(tl.int64))
        wrong += tl.sum(tl.where(first & (state != FREE) & (state != USED) & (state != CACHED), k, 0).to(tl.int64))
        cached = first & (state == CACHED)
        more, back = add_references(p, (first & (state == USED)) | cached, cached, k, refcount_ptr, page_state_ptr,
                                    BLOCK)
        over += more
        revived += back
    tl.debug_barrier()
    reset_lanes(pages_ptr, n_pages, claim_ptr, occur_ptr, num_pages, BLOCK)
    c = counter_add(c, ERR_INVALID_PAGE, invalid)
    c = counter_add(c, ERR_USE_AFTER_FREE, uaf)
    c = counter_add(c, CACHED_COUNT, -revived)
    c = counter_add(c, REVIVED, revived)
    c = counter_add(c, ERR_REFCOUNT_OVERFLOW, over)
    c = counter_add(c, ERR_CORRUPT_STATE, wrong)
    c = raise_peaks(c, num_pages)
    store_counters(counters_ptr, c)


def incref_triton(st, pages) -> None:
    """Add one reference per entry of ``pages`` (one launch; see module note)."""
    incref_kernel[(1,)](
        pages, pages.numel(), st.refcount, st.page_state, st.counters, st.claim, st.occur, st.num_pages,
        **settings(pages.numel()),
    )
