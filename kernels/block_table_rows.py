"""block_table_rows: vLLM-style block-table rows of a batch.

``out[i] = block_table[req_ids[i]]`` (int32 ``[B, max_pages_per_request]``), a
row of -1 for padding and for ids outside ``[0, R)``. Read-only: no clock step,
no error counted (the rows of bad ids are simply -1).
"""

import numba
from ._triton_shim import tl, triton

from . import layout as L
from ._numba_util import copy_i32, i32_array, table_arrays
from ._triton_util import NULL_PAGE, settings
from .layout import CD_STATE


@numba.njit(nogil=True)
def block_table_rows_numba(
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
        if r >= 0 and r < R:
            copy_i32(out_ptr + 4 * i * MP, block_table.ctypes.data + 4 * r * MP, MP)
        else:
            out[i * MP:(i + 1) * MP] = L.NULL_PAGE


@numba.njit(nogil=True)
def block_table_rows_numba_entry(req_ids_ptr, B, out_ptr, cd):
    """``block_table_rows_numba`` with the table in the call descriptor ``cd`` (fast dispatch)."""
    block_table_rows_numba(req_ids_ptr, B, out_ptr, table_arrays(cd[:CD_STATE])[0])


# ---------------------------------------------------------------------- Triton
# One pass over the B * MP output cells.


@triton.jit
def block_table_rows_kernel(
    req_ids_ptr,      # *int32 [B]: request ids, -1 = padding
    n_cells,          # B * MP
    out_ptr,          # *int32 [B, MP]: rows, -1 for padding and bad ids
    block_table_ptr,  # *int32 [R, MP]
    R,                # rows of block_table
    MP,               # columns of block_table
    # Meta-parameters
    BLOCK: tl.constexpr,  # cells per chunk
):
    """out[i, k] = block_table[r_i, k] for r_i in [0, R), else -1."""
    lanes = tl.arange(0, BLOCK)
    for start in range(0, n_cells, BLOCK):
        f = lanes.to(tl.int64) + start  # (widened before the add: B * MP may be near INT32_MAX)
        live = f < n_cells
        r = tl.load(req_ids_ptr + f // MP, mask=live, other=NULL_PAGE)
        valid = live & (r >= 0) & (r < R)
        page = tl.load(block_table_ptr + r.to(tl.int64) * MP + f % MP, mask=valid, other=NULL_PAGE)
        tl.store(out_ptr + f, page, mask=live)


def block_table_rows_triton(req_ids, out, ts) -> None:
    """vLLM-style block-table rows for the batch ``req_ids`` into ``out`` (one launch)."""
    R, MP = ts.block_table.shape
    block_table_rows_kernel[(1,)](req_ids, out.numel(), out, ts.block_table, R, MP, **settings(out.numel()))
