"""flashinfer_csr: FlashInfer's paged-KV CSR of a batch, the layout attention kernels read.

``indptr[i+1] - indptr[i] = ceil(len / page_size)``, ``indices`` holds
the pages in request order (-1 past ``indptr[B]``), ``last_page_len = len -
(num_pages - 1) * page_size`` in ``[1, page_size]``; an empty or padding
request has no pages and ``last_page_len = page_size``. Read-only: no clock
step. Out-of-range ids count ``bad_request``. ``indices`` too small for the batch
counts ``out_overflow``, and the first request whose pages do not all fit and every
later one are exported as empty (``kv_lens`` 0 in a step): ``indptr`` never points
past the buffer. A request whose pages include an id outside ``[0, P)`` (a hand
edit, or the -1 a pop of a wild free-stack entry put in its row) is exported as
empty and counts ``corrupt_state``, in a step too: no page id outside the pool
reaches an attention kernel. A step exports each lane's ``kv_lens`` tokens, which its
extend wrote (the row's length, or 0 for padding, a bad or repeated id and a corrupt
row): a repeated id has no pages.
"""

import numba
import numpy as np
from ._triton_shim import tl, triton

from . import layout as L
from . import _numba_util as nu
from ._numba_util import fill_null_range, i32_array, i64_cell, page_shift, pages_for, state_arrays, table_arrays
from .layout import CD_CSR_MEMO, CD_INDICES, CD_INDICES_LEN, CD_INDPTR, CD_LAST_PAGE_LEN, CD_OUT, CD_STATE
from ._triton_table_util import ERR_BAD_REQUEST, cdiv
from ._triton_util import (ERR_CORRUPT_STATE, INT32_MAX, NULL_PAGE, OVERFLOW_CSR, count_overflow, counter_add,
                           load_counters, settings, store_counters)


@numba.njit(nogil=True)
def flashinfer_csr_numba(
    req_ids_ptr,        # address of int32 [B], request ids, -1 = padding
    B,                  # batch size
    indptr_ptr,         # address of int32 [B + 1]
    indices_ptr,        # address of int32 [cap]
    cap,                # capacity of indices
    last_page_len_ptr,  # address of int32 [B]
    page_size,          # tokens per page
    block_table,        # int32 [R, MP]
    seq_lens,           # int32 [R]
    counters,           # int64 [NUM_COUNTERS]
    written,            # entries of indices that may be != -1 (from the last call on this buffer)
    count,              # count bad ids and corrupt lengths (False in a step: its extend counted them)
    num_pages,          # P: a request whose pages include an id outside [0, P) is exported as empty
    kv_lens,            # int32 [B]: a step's kv_lens, the lengths it exports (so none for a repeated id); else [0]
):
    """Returns how many entries of ``indices`` it wrote (pass it as ``written`` next time), how
    many requests it exported as empty for a page id outside the pool (each counted, ``count`` or
    not), and how many requests with pages it exported as empty for want of capacity: the first
    request whose pages do not all fit and every later one (one ``out_overflow`` for the call), so
    ``indptr`` never points past ``indices``.

    Only ``indices[total:written]`` needs padding again, so a decode step costs
    O(pages in the batch), not O(capacity). Each row is copied by a loop that also takes the
    largest of its ids as unsigned (a negative one is past every pool): one vectorised pass, with
    no libc call per request, copies and checks it.
    """
    ids, indptr = i32_array(req_ids_ptr, B), i32_array(indptr_ptr, B + 1)
    last = i32_array(last_page_len_ptr, B)
    R = block_table.shape[0]
    limit = block_table.shape[1] * page_size  # a longer (or negative) length is corrupt state: exported as empty
    shift = page_shift(page_size)
    pool = np.uint32(num_pages)
    pos = 0  # end of the runs, past the capacity too (a request out of the pool has none)
    fit = 0  # end of the runs exported: pos until the first request that does not fit
    reach = 0  # end of what the copies wrote
    stray = 0  # requests exported as empty for a page id outside the pool
    cut = 0  # requests with pages exported as empty for want of capacity
    indptr[0] = 0
    for i in range(B):
        r = ids[i]
        n = 0
        length = 0
        if r >= 0 and r < R:
            length = seq_lens[r] if kv_lens.shape[0] == 0 else kv_lens[i]
            if length < 0 or length > limit:
                counters[L.ERR_CORRUPT_STATE] += count
                length = 0
            n = pages_for(length, page_size, shift)  # at most the row's width: the length is at most limit
            k = n if pos + n <= cap else 0  # a run is copied whole or not at all
            row, dst = block_table[np.uint64(r)], i32_array(indices_ptr + 4 * pos, k)
            top = np.uint32(0)
            for c in range(k):
                page = row[np.uint64(c)]
                dst[np.uint64(c)] = page
                top = max(top, np.uint32(page))
            for c in range(k, n):  # past the capacity: checked, not copied
                top = max(top, np.uint32(row[np.uint64(c)]))
            reach = max(reach, pos + k)
            if top >= pool:
                stray += 1
                length = n = 0
            pos += n
            if k < n:  # past the capacity: exported as empty
                cut += 1
                length = n = 0
        elif r != L.NULL_PAGE:
            counters[L.ERR_BAD_REQUEST] += count
        fit += n
        indptr[i + 1] = fit
        last[i] = length - (n - 1) * page_size
    if pos > cap:
        nu.count_overflow(counters, L.OVERFLOW_CSR, 1)
    counters[L.ERR_CORRUPT_STATE] += stray
    fill_null_range(indices_ptr, fit, min(max(written, reach), cap))
    return fit, stray, cut


@numba.njit(nogil=True)
def flashinfer_csr_numba_entry(req_ids_ptr, B, cd):
    """``flashinfer_csr_numba`` for a bound call: outputs, table and pool state in the call descriptor ``cd``."""
    bt, lens, _, ps = table_arrays(cd[:CD_STATE])
    _, rc, _, _, counters, _, _ = state_arrays(cd[CD_STATE:CD_OUT])
    written = i64_cell(cd[CD_CSR_MEMO])  # its MEMO_WRITTEN slot
    written[0] = flashinfer_csr_numba(req_ids_ptr, B, cd[CD_INDPTR], cd[CD_INDICES], cd[CD_INDICES_LEN],
                                      cd[CD_LAST_PAGE_LEN], ps, bt, lens, counters, written[0], True, rc.shape[0],
                                      i32_array(0, 0))[0]


# ---------------------------------------------------------------------- Triton
# One program, two phases: the lanes (indptr as a running prefix sum,
# last_page_len), then the entries: output position u < total belongs to lane
# i, the last one with indptr[i] <= u (a binary search over indptr, SEARCH
# steps), and takes block_table[r_i, u - indptr[i]]. The work is linear in the
# batch's pages, whatever the widest request; positions past the total are -1.
# An entry outside [0, P) (corrupt state: rare) makes the program run both
# phases again, the first one now reading each lane's row to export such a
# request as empty.


@triton.jit
def _csr_lanes(req_ids_ptr, B, indptr_ptr, last_page_len_ptr, block_table_ptr, seq_lens_ptr, kv_lens_ptr, R, MP,
               num_pages, page_size, cap, BLOCK: tl.constexpr, SCAN: tl.constexpr, KV_LENS: tl.constexpr):
    """Phase one: indptr (past the capacity too) and last_page_len; returns the pages in all (uncapped),
    the pages of the requests that fit in ``cap`` (those before the first that does not), the bad ids,
    the corrupt lengths and (``SCAN``: each row read) the requests exported empty for a page outside the pool."""
    lanes = tl.arange(0, BLOCK)
    tl.store(indptr_ptr + lanes, tl.zeros((BLOCK,), tl.int32), mask=lanes < 1)
    end = tl.zeros((), tl.int64)
    fit = tl.zeros((), tl.int64)
    bad = tl.zeros((), tl.int64)
    wrong = tl.zeros((), tl.int64)
    stray = tl.zeros((), tl.int64)
    for start in range(0, B, BLOCK):
        i = start + lanes
        live = i < B
        r = tl.load(req_ids_ptr + i, mask=live, other=NULL_PAGE)
        valid = live & (r >= 0) & (r < R)
        bad += tl.sum((live & (r != NULL_PAGE) & ~valid).to(tl.int64))
        if KV_LENS:  # a step: each lane's kv_lens tokens, which its extend wrote (none for a repeated id)
            length = tl.load(kv_lens_ptr + i, mask=valid, other=0).to(tl.int64)
        else:
            length = tl.load(seq_lens_ptr + r, mask=valid, other=0).to(tl.int64)
        corrupt = valid & ((length < 0) | (length > MP * page_size))  # exported as empty
        wrong += tl.sum(corrupt.to(tl.int64))
        length = tl.where(corrupt, 0, length)
        n = cdiv(length, page_size)
        if SCAN:
            outside = tl.zeros((BLOCK,), tl.int1)
            for k in range(0, tl.max(n)):
                page = tl.load(block_table_ptr + r.to(tl.int64) * MP + k, mask=valid & (k < n), other=0)
                outside = outside | (page < 0) | (page >= num_pages)
            stray += tl.sum(outside.to(tl.int64))
            length = tl.where(outside, 0, length)
            n = tl.where(outside, 0, n)
            if KV_LENS:
                tl.store(kv_lens_ptr + i, tl.zeros((BLOCK,), tl.int32), mask=outside)
        ends = end + tl.cumsum(n, 0)
        # (repeated ids can sum past INT32_MAX: clamped, indptr stays non-decreasing; past cap, cut below)
        tl.store(indptr_ptr + i + 1, tl.minimum(ends, INT32_MAX).to(tl.int32), mask=live)
        tl.store(last_page_len_ptr + i, (length - (n - 1) * page_size).to(tl.int32), mask=live)
        end += tl.sum(n)
        fit += tl.sum(tl.where(ends <= cap, n, 0))
    return end, fit, bad, wrong, stray


@triton.jit
def _csr_cut(B, indptr_ptr, last_page_len_ptr, kv_lens_ptr, cap, fit, page_size, BLOCK: tl.constexpr,
             KV_LENS: tl.constexpr):
    """Phase three, when the pages pass the capacity: every request whose run would end past it (the
    first that does not fit and every later one) is exported as empty, so no indptr entry points past
    ``indices``; ``kv_lens`` 0 there in a step."""
    lanes = tl.arange(0, BLOCK)
    for start in range(0, B, BLOCK):
        i = start + lanes
        past = (i < B) & (tl.load(indptr_ptr + i + 1, mask=i < B, other=0) > cap)
        tl.store(indptr_ptr + i + 1, tl.zeros((BLOCK,), tl.int32) + fit.to(tl.int32), mask=past)
        tl.store(last_page_len_ptr + i, tl.zeros((BLOCK,), tl.int32) + page_size, mask=past)
        if KV_LENS:
            tl.store(kv_lens_ptr + i, tl.zeros((BLOCK,), tl.int32), mask=past)


@triton.jit
def _csr_entries(req_ids_ptr, B, indptr_ptr, indices_ptr, block_table_ptr, end, total, R, MP, num_pages, SEARCH,
                 BLOCK: tl.constexpr):
    """Phase two: ``indices[:total]`` from the rows; returns how many of the batch's ``end`` pages (past
    the capacity too: a request is checked whole) are outside the pool. Only the first INT32_MAX pages
    (indptr's range: repeated ids can sum past it) are searched; the caller scans the rows past that."""
    lanes = tl.arange(0, BLOCK)
    outside = tl.zeros((), tl.int64)
    searched = tl.minimum(end, INT32_MAX)
    for start in range(0, searched, BLOCK):
        u = start + lanes
        live = u < searched
        # indptr[lo] <= u < indptr[hi] holds throughout (indptr[0] = 0, indptr[B] = end > u).
        lo = tl.zeros((BLOCK,), tl.int32)
        hi = tl.full((BLOCK,), B, tl.int32)
        for _ in range(SEARCH):
            mid = lo + (hi - lo) // 2  # (lo + hi wraps in int32 past 2**30 lanes)
            go = tl.load(indptr_ptr + mid, mask=live, other=0) <= u
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        k = u - tl.load(indptr_ptr + lo, mask=live, other=0)
        r = tl.load(req_ids_ptr + lo, mask=live, other=0).to(tl.int64)
        # (a lane found by the search is a valid request with pages, but the row is read only inside the
        # table whatever indptr holds: the read is what must never leave it)
        inside = live & (r >= 0) & (r < R) & (k >= 0) & (k < MP)
        page = tl.load(block_table_ptr + r * MP + k, mask=inside, other=NULL_PAGE)
        tl.store(indices_ptr + u, page, mask=u < total)
        outside += tl.sum((live & ((page < 0) | (page >= num_pages))).to(tl.int64))
    return outside


@triton.jit
def flashinfer_csr_body(
    req_ids_ptr,        # *int32 [B]: request ids, -1 = padding
    B,                  # batch size
    indptr_ptr,         # *int32 [B + 1]
    indices_ptr,        # *int32 [cap]: pages in request order, -1 past indptr[B]
    cap,                # capacity of indices
    last_page_len_ptr,  # *int32 [B]
    block_table_ptr,    # *int32 [R, MP]
    seq_lens_ptr,       # *int32 [R]
    counters_ptr,       # *int64 [NUM_COUNTERS]
    written_ptr,        # *int64 [1]: entries of indices that may be != -1; this call sets it to its total
    kv_lens_ptr,        # *int32 [B]: a step's kv_lens (KV_LENS): the lengths exported, 0 where one is exported empty
    R,                  # rows of block_table
    MP,                 # columns of block_table
    num_pages,          # P: a request whose pages include an id outside [0, P) is exported as empty
    page_size,          # tokens per page
    SEARCH,             # steps of the binary search over indptr: B.bit_length()
    # Meta-parameters
    BLOCK: tl.constexpr,  # lanes / entries / positions per chunk
    COUNT: tl.constexpr = True,  # count bad ids and corrupt lengths (False in a step: its extend counted them)
    KV_LENS: tl.constexpr = False,  # kv_lens_ptr is a step's kv_lens
):
    """indptr[i+1] = sum_{j<=i} cdiv(L_j, ps); indices[indptr[i] + k] = block_table[r_i, k]; last = L - (n-1)*ps.

    The body of ``flashinfer_csr_kernel``, also run by ``step_kernel`` after the extend."""
    lanes = tl.arange(0, BLOCK)
    # Read before the barrier below: the store at the end must not overtake any thread's read.
    written = tl.minimum(tl.load(written_ptr), cap).to(tl.int32)
    end, fit, bad, wrong, stray = _csr_lanes(req_ids_ptr, B, indptr_ptr, last_page_len_ptr, block_table_ptr,
                                             seq_lens_ptr, kv_lens_ptr, R, MP, num_pages, page_size, cap, BLOCK,
                                             False, KV_LENS)
    tl.debug_barrier()
    total = fit.to(tl.int32)  # the requests that fit come first: their runs are where indptr says
    outside = _csr_entries(req_ids_ptr, B, indptr_ptr, indices_ptr, block_table_ptr, end, total, R, MP, num_pages,
                           SEARCH, BLOCK)
    if (outside > 0) | (end > INT32_MAX):  # a page outside the pool (or pages past the search): both phases
        #                                    again, reading the rows
        written = tl.maximum(written, total)
        tl.debug_barrier()
        end, fit, bad, wrong, stray = _csr_lanes(req_ids_ptr, B, indptr_ptr, last_page_len_ptr, block_table_ptr,
                                                 seq_lens_ptr, kv_lens_ptr, R, MP, num_pages, page_size, cap, BLOCK,
                                                 True, KV_LENS)
        tl.debug_barrier()
        total = fit.to(tl.int32)
        _csr_entries(req_ids_ptr, B, indptr_ptr, indices_ptr, block_table_ptr, end, total, R, MP, num_pages, SEARCH,
                     BLOCK)
    if end > cap:  # the runs past the capacity: exported empty (read above, through indptr, before this)
        tl.debug_barrier()
        _csr_cut(B, indptr_ptr, last_page_len_ptr, kv_lens_ptr, cap, fit, page_size, BLOCK, KV_LENS)
    # Only what the last call on this buffer wrote past this total needs -1 again.
    for start in range((total // BLOCK) * BLOCK, written, BLOCK):
        u = start + lanes
        tl.store(indices_ptr + u, tl.full((BLOCK,), NULL_PAGE, tl.int32), mask=(u >= total) & (u < written))
    tl.store(written_ptr, total.to(tl.int64))
    c = load_counters(counters_ptr)
    if COUNT:
        c = counter_add(c, ERR_BAD_REQUEST, bad)
        c = counter_add(c, ERR_CORRUPT_STATE, wrong)
    c = counter_add(c, ERR_CORRUPT_STATE, stray)
    c = count_overflow(c, OVERFLOW_CSR, (end > cap).to(tl.int64))
    store_counters(counters_ptr, c)


@triton.jit
def flashinfer_csr_kernel(req_ids_ptr, B, indptr_ptr, indices_ptr, cap, last_page_len_ptr, block_table_ptr,
                          seq_lens_ptr, counters_ptr, written_ptr, R, MP, num_pages, page_size, SEARCH,
                          BLOCK: tl.constexpr):
    """One launch of ``flashinfer_csr_body`` (arguments documented there)."""
    flashinfer_csr_body(req_ids_ptr, B, indptr_ptr, indices_ptr, cap, last_page_len_ptr, block_table_ptr, seq_lens_ptr,
             counters_ptr, written_ptr, indptr_ptr, R, MP, num_pages, page_size, SEARCH, BLOCK)


def flashinfer_csr_triton(req_ids, indptr, indices, last_page_len, written, st, ts) -> None:
    """FlashInfer's paged-KV CSR for the batch ``req_ids`` (one launch; read-only but for error counters).

    ``written`` (int64 ``[1]`` on the device, kept with ``indices``; start it at
    ``indices.numel()``) tracks how far ``indices`` holds pages, so a call pads
    only what the previous one wrote past its own total, not the whole capacity.
    """
    B, cap = req_ids.numel(), indices.numel()
    R, MP = ts.block_table.shape
    flashinfer_csr_kernel[(1,)](
        req_ids, B, indptr, indices, cap, last_page_len, ts.block_table, ts.seq_lens, st.counters, written,
        R, MP, st.num_pages, ts.page_size, B.bit_length(),
        **settings(max(B, cap)),
    )
