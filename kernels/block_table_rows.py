"""block_table_rows: vLLM-style block-table rows of a batch.

``out[i] = block_table[req_ids[i]]`` (int32 ``[B, max_pages_per_request]``), a
row of -1 for padding and for ids outside ``[0, R)``; each such id but padding
counts ``bad_request``, as in ``flashinfer_csr``. Read-only but for that
counter: no clock step. A repeated id is copied again (nothing is claimed).
"""

import numba
from ._triton_shim import tl, triton

from . import layout as L
from ._numba_util import copy_i32, i32_array, state_arrays, table_arrays
from ._triton_table_util import ERR_BAD_REQUEST
from ._triton_util import NULL_PAGE, counter_add, load_counters, settings, store_counters
from .layout import CD_OUT, CD_STATE


@numba.njit(nogil=True)
def block_table_rows_numba(
    req_ids_ptr,  # address of int32 [B], request ids, -1 = padding
    B,            # batch size
    out_ptr,      # address of int32 [B, MP], rows, -1 for padding and bad ids
    block_table,  # int32 [R, MP]
    counters,     # int64 [NUM_COUNTERS]
):
    ids = i32_array(req_ids_ptr, B)
    R, MP = block_table.shape[0], block_table.shape[1]
    out = i32_array(out_ptr, B * MP)
    bad = 0
    for i in range(B):
        r = ids[i]
        if r >= 0 and r < R:
            copy_i32(out_ptr + 4 * i * MP, block_table.ctypes.data + 4 * r * MP, MP)
        else:
            out[i * MP:(i + 1) * MP] = L.NULL_PAGE
            if r != L.NULL_PAGE:
                bad += 1
    counters[L.ERR_BAD_REQUEST] += bad


@numba.njit(nogil=True)
def block_table_rows_numba_entry(req_ids_ptr, B, out_ptr, cd):
    """``block_table_rows_numba`` with the table and the pool's state in the call descriptor ``cd`` (fast
    dispatch)."""
    counters = state_arrays(cd[CD_STATE:CD_OUT])[4]
    block_table_rows_numba(req_ids_ptr, B, out_ptr, table_arrays(cd[:CD_STATE])[0], counters)


# ---------------------------------------------------------------------- Triton
# One pass over the B * MP output cells.


@triton.jit
def block_table_rows_kernel(
    req_ids_ptr,      # *int32 [B]: request ids, -1 = padding
    n_cells,          # B * MP
    out_ptr,          # *int32 [B, MP]: rows, -1 for padding and bad ids
    block_table_ptr,  # *int32 [R, MP]
    counters_ptr,     # *int64 [NUM_COUNTERS]
    R,                # rows of block_table
    MP,               # columns of block_table
    # Meta-parameters
    BLOCK: tl.constexpr,  # cells per chunk
):
    """out[i, k] = block_table[r_i, k] for r_i in [0, R), else -1; one bad_request per id outside
    [0, R) but -1 (counted at its row's first cell)."""
    lanes = tl.arange(0, BLOCK)
    bad = tl.zeros((), tl.int64)
    for start in range(0, n_cells, BLOCK):
        f = lanes.to(tl.int64) + start  # (widened before the add: B * MP may be near INT32_MAX)
        live = f < n_cells
        r = tl.load(req_ids_ptr + f // MP, mask=live, other=NULL_PAGE)
        valid = live & (r >= 0) & (r < R)
        col = f % MP
        page = tl.load(block_table_ptr + r.to(tl.int64) * MP + col, mask=valid, other=NULL_PAGE)
        tl.store(out_ptr + f, page, mask=live)
        bad += tl.sum((live & (col == 0) & ~valid & (r != NULL_PAGE)).to(tl.int64), axis=0)
    store_counters(counters_ptr, counter_add(load_counters(counters_ptr), ERR_BAD_REQUEST, bad))


def block_table_rows_triton(req_ids, out, st, ts) -> None:
    """vLLM-style block-table rows for the batch ``req_ids`` into ``out`` (one launch)."""
    R, MP = ts.block_table.shape
    block_table_rows_kernel[(1,)](req_ids, out.numel(), out, ts.block_table, st.counters, R, MP,
                                  **settings(out.numel()))
