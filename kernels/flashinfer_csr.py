"""flashinfer_csr: FlashInfer's paged-KV CSR of a batch, the layout attention kernels read.

``indptr[i+1] - indptr[i] = ceil(len / page_size)``, ``indices`` holds
the pages in request order (-1 past ``indptr[B]``), ``last_page_len = len -
(num_pages - 1) * page_size`` in ``[1, page_size]``; an empty or padding
request has no pages and ``last_page_len = page_size``. Read-only: no clock
step. Out-of-range ids count ``bad_request``; ``indices`` too small for the
batch counts ``out_overflow`` (entries past the capacity are dropped).
"""

import numba
from ._triton_shim import tl, triton

from . import layout as L
from ._numba_util import (copy8_i32, copy_i32, fill_null_range, i32_array, i64_cell, page_shift, pages_for,
                          state_arrays, table_arrays)
from .layout import CD_CSR_MEMO, CD_INDICES, CD_INDICES_LEN, CD_INDPTR, CD_LAST_PAGE_LEN, CD_OUT, CD_STATE
from ._triton_table_util import ERR_BAD_REQUEST, cdiv
from ._triton_util import (ERR_CORRUPT_STATE, ERR_OUT_OVERFLOW, NULL_PAGE, counter_add, load_counters, settings,
                           store_counters)


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
):
    """Returns how many entries of ``indices`` it wrote (pass it as ``written`` next time).

    Only ``indices[total:written]`` needs padding again, so a decode step costs
    O(pages in the batch), not O(capacity). Rows are copied in blocks of 8 ids
    (a vector move each, no libc call per request); the last block of a row may
    run past the row's pages into entries the next row (or the padding) rewrites.
    """
    ids, indptr = i32_array(req_ids_ptr, B), i32_array(indptr_ptr, B + 1)
    last = i32_array(last_page_len_ptr, B)
    R, MP = block_table.shape[0], block_table.shape[1]
    table_addr = block_table.ctypes.data
    shift = page_shift(page_size)
    limit = MP * page_size  # a longer (or negative) length is corrupt state: exported as empty
    pos = 0
    reach = 0  # end of what the block copies wrote
    indptr[0] = 0
    for i in range(B):
        r = ids[i]
        n = 0
        length = 0
        if r >= 0 and r < R:
            length = seq_lens[r]
            if length < 0 or length > limit:
                counters[L.ERR_CORRUPT_STATE] += count
                length = 0
            n = pages_for(length, page_size, shift)
            k = max(0, min(n, cap - pos))
            dst, src = indices_ptr + 4 * pos, table_addr + 4 * r * MP
            k8 = (k + 7) & ~7
            if k8 <= MP and pos + k8 <= cap:  # the blocks stay inside the row and the buffer
                for c in range(0, k8, 8):
                    copy8_i32(dst + 4 * c, src + 4 * c)
                reach = max(reach, pos + k8)
            else:
                copy_i32(dst, src, k)
        elif r != L.NULL_PAGE:
            counters[L.ERR_BAD_REQUEST] += count
        pos += n
        indptr[i + 1] = pos
        last[i] = length - (n - 1) * page_size
    if pos > cap:
        counters[L.ERR_OUT_OVERFLOW] += 1
    total = min(pos, cap)
    fill_null_range(indices_ptr, total, min(max(written, reach), cap))
    return total


@numba.njit(nogil=True)
def flashinfer_csr_numba_entry(req_ids_ptr, B, cd):
    """``flashinfer_csr_numba`` for a bound call: outputs, table and pool state in the call descriptor ``cd``."""
    bt, lens, _, ps = table_arrays(cd[:CD_STATE])
    counters = state_arrays(cd[CD_STATE:CD_OUT])[4]
    written = i64_cell(cd[CD_CSR_MEMO])  # its MEMO_WRITTEN slot
    written[0] = flashinfer_csr_numba(req_ids_ptr, B, cd[CD_INDPTR], cd[CD_INDICES], cd[CD_INDICES_LEN],
                                      cd[CD_LAST_PAGE_LEN], ps, bt, lens, counters, written[0], True)


# ---------------------------------------------------------------------- Triton
# One program, two phases: the lanes (indptr as a running prefix sum,
# last_page_len), then the entries: output position u < total belongs to lane
# i, the last one with indptr[i] <= u (a binary search over indptr, SEARCH
# steps), and takes block_table[r_i, u - indptr[i]]. The work is linear in the
# batch's pages, whatever the widest request; positions past the total are -1.


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
    R,                  # rows of block_table
    MP,                 # columns of block_table
    page_size,          # tokens per page
    SEARCH,             # steps of the binary search over indptr: B.bit_length()
    # Meta-parameters
    BLOCK: tl.constexpr,  # lanes / entries / positions per chunk
    COUNT: tl.constexpr = True,  # count bad ids and corrupt lengths (False in a step: its extend counted them)
):
    """indptr[i+1] = sum_{j<=i} cdiv(L_j, ps); indices[indptr[i] + k] = block_table[r_i, k]; last = L - (n-1)*ps.

    The body of ``flashinfer_csr_kernel``, also run by ``step_kernel`` after the extend."""
    lanes = tl.arange(0, BLOCK)
    # Read before the barrier below: the store at the end must not overtake any thread's read.
    written = tl.minimum(tl.load(written_ptr), cap).to(tl.int32)
    tl.store(indptr_ptr + lanes, tl.zeros((BLOCK,), tl.int32), mask=lanes < 1)
    end = tl.zeros((), tl.int64)
    bad = tl.zeros((), tl.int64)
    wrong = tl.zeros((), tl.int64)
    for start in range(0, B, BLOCK):
        i = start + lanes
        live = i < B
        r = tl.load(req_ids_ptr + i, mask=live, other=NULL_PAGE)
        valid = live & (r >= 0) & (r < R)
        bad += tl.sum((live & (r != NULL_PAGE) & ~valid).to(tl.int64))
        length = tl.load(seq_lens_ptr + r, mask=valid, other=0).to(tl.int64)
        corrupt = valid & ((length < 0) | (length > MP * page_size))  # exported as empty
        wrong += tl.sum(corrupt.to(tl.int64))
        length = tl.where(corrupt, 0, length)
        n = cdiv(length, page_size)
        tl.store(indptr_ptr + i + 1, (end + tl.cumsum(n, 0)).to(tl.int32), mask=live)
        tl.store(last_page_len_ptr + i, (length - (n - 1) * page_size).to(tl.int32), mask=live)
        end += tl.sum(n)
    tl.debug_barrier()
    total = tl.minimum(end, cap).to(tl.int32)
    for start in range(0, total, BLOCK):
        u = start + lanes
        live = u < total
        # indptr[lo] <= u < indptr[hi] holds throughout (indptr[0] = 0, indptr[B] = end > u).
        lo = tl.zeros((BLOCK,), tl.int32)
        hi = tl.full((BLOCK,), B, tl.int32)
        for _ in range(SEARCH):
            mid = (lo + hi) // 2
            go = tl.load(indptr_ptr + mid, mask=live, other=0) <= u
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        k = u - tl.load(indptr_ptr + lo, mask=live, other=0)
        r = tl.load(req_ids_ptr + lo, mask=live, other=0).to(tl.int64)
        page = tl.load(block_table_ptr + r * MP + tl.minimum(k, MP - 1), mask=live, other=NULL_PAGE)
        tl.store(indices_ptr + u, page, mask=live)
    # Only what the last call on this buffer wrote past this total needs -1 again.
    for start in range((total // BLOCK) * BLOCK, written, BLOCK):
        u = start + lanes
        tl.store(indices_ptr + u, tl.full((BLOCK,), NULL_PAGE, tl.int32), mask=(u >= total) & (u < written))
    tl.store(written_ptr, total.to(tl.int64))
    c = load_counters(counters_ptr)
    if COUNT:
        c = counter_add(c, ERR_BAD_REQUEST, bad)
        c = counter_add(c, ERR_CORRUPT_STATE, wrong)
    c = counter_add(c, ERR_OUT_OVERFLOW, (end > cap).to(tl.int64))
    store_counters(counters_ptr, c)


@triton.jit
def flashinfer_csr_kernel(req_ids_ptr, B, indptr_ptr, indices_ptr, cap, last_page_len_ptr, block_table_ptr, seq_lens_ptr,
               counters_ptr, written_ptr, R, MP, page_size, SEARCH, BLOCK: tl.constexpr):
    """One launch of ``flashinfer_csr_body`` (arguments documented there)."""
    flashinfer_csr_body(req_ids_ptr, B, indptr_ptr, indices_ptr, cap, last_page_len_ptr, block_table_ptr, seq_lens_ptr,
             counters_ptr, written_ptr, R, MP, page_size, SEARCH, BLOCK)


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
        R, MP, ts.page_size, B.bit_length(),
        **settings(max(B, cap)),
    )
