"""Layouts for attention kernels: FlashInfer's paged-KV CSR and vLLM-style block-table rows.

CSR: ``indptr[i+1] - indptr[i] = ceil(len / page_size)``, ``indices`` holds
the pages in request order (-1 past ``indptr[B]``), ``last_page_len = len -
(num_pages - 1) * page_size`` in ``[1, page_size]``; an empty or padding
request has no pages and ``last_page_len = page_size``. Read-only: no clock
step. Out-of-range ids count ``bad_request``; ``indices`` too small for the
batch counts ``out_overflow`` (entries past the capacity are dropped).
"""

import numba

from . import layout as L
from ._numba_util import i32_array


@numba.njit(nogil=True)
def csr_numba(
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
):
    ids, indptr = i32_array(req_ids_ptr, B), i32_array(indptr_ptr, B + 1)
    indices, last = i32_array(indices_ptr, cap), i32_array(last_page_len_ptr, B)
    R = block_table.shape[0]
    pos = 0
    indptr[0] = 0
    for i in range(B):
        r = ids[i]
        n = 0
        length = 0
        if r >= 0 and r < R:
            length = seq_lens[r]
            n = (length + page_size - 1) // page_size
            for k in range(n):
                if pos + k < cap:
                    indices[pos + k] = block_table[r, k]
        elif r != L.NULL_PAGE:
            counters[L.ERR_BAD_REQUEST] += 1
        pos += n
        indptr[i + 1] = pos
        last[i] = length - (n - 1) * page_size
    if pos > cap:
        counters[L.ERR_OUT_OVERFLOW] += 1
    for u in range(pos, cap):
        indices[u] = L.NULL_PAGE


@numba.njit(nogil=True)
def rows_numba(
    req_ids_ptr,  # address of int32 [B], request ids, -1 = padding
    B,            # batch size
    out_ptr,      # address of int32 [B, MP], rows, -1 for padding and bad ids
    block_table,  # int32 [R, MP]
):
    ids = i32_array(req_ids_ptr, B)
    R, MP = block_table.shape[0], block_table.shape[1]
    out = i32_array(out_ptr, B * MP)
    for i in range(B):
        r = ids[i]
        for k in range(MP):
            out[i * MP + k] = block_table[r, k] if (r >= 0 and r < R) else L.NULL_PAGE
