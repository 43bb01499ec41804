"""step: one scheduler step on a page table: extend, then the FlashInfer CSR of the batch.

The two passes of :mod:`extend` and :mod:`csr` in one call, so a decode loop
pays one façade call and one numba dispatch, or one Triton launch, per step.
The CSR is built after the extend, so it lists the pages the step just added:
the semantics are those of the two calls made one after the other (the
reference backend makes them).
"""

import numba
import triton
import triton.language as tl

from ._triton_util import settings
from .csr import csr_body, csr_numba_entry
from .extend import MAX_TILE, extend_body, extend_numba_entry


@numba.njit(nogil=True)
def step_numba_entry(req_ids_ptr, ntok_ptr, B, cd):
    """extend then csr for a bound call (outputs, table and pool state in the call descriptor ``cd``)."""
    extend_numba_entry(req_ids_ptr, ntok_ptr, B, cd)
    csr_numba_entry(req_ids_ptr, B, cd)


@triton.jit
def step_kernel(req_ids_ptr, num_tokens_ptr, B, slots_ptr, T, ok_ptr, indptr_ptr, indices_ptr, cap, last_page_len_ptr,
                written_ptr, block_table_ptr, seq_lens_ptr, claim_ptr, free_stack_ptr, refcount_ptr, page_state_ptr,
                counters_ptr, R, MP, num_pages, page_size, SEARCH, BLOCK: tl.constexpr, TILE: tl.constexpr):
    """``extend_body`` then ``csr_body`` in one program (arguments documented there)."""
    extend_body(req_ids_ptr, num_tokens_ptr, B, slots_ptr, T, ok_ptr, block_table_ptr, seq_lens_ptr, claim_ptr,
                free_stack_ptr, refcount_ptr, page_state_ptr, counters_ptr, R, MP, num_pages, page_size, BLOCK, TILE)
    tl.debug_barrier()  # the export reads the lengths, rows and counters the extend wrote
    csr_body(req_ids_ptr, B, indptr_ptr, indices_ptr, cap, last_page_len_ptr, block_table_ptr, seq_lens_ptr,
             counters_ptr, written_ptr, R, MP, page_size, SEARCH, BLOCK)


def step_triton(req_ids, num_tokens, slots, ok, indptr, indices, last_page_len, written, st, ts) -> None:
    """extend then the CSR export in one launch; ``written`` as in ``csr_triton``."""
    B, T, cap = req_ids.numel(), slots.numel(), indices.numel()
    R, MP = ts.block_table.shape
    meta = settings(max(B, T, cap))
    step_kernel[(1,)](
        req_ids, num_tokens, B, slots, T, ok, indptr, indices, cap, last_page_len, written,
        ts.block_table, ts.seq_lens, ts.claim, st.free_stack, st.refcount, st.page_state, st.counters,
        R, MP, st.num_pages, ts.page_size, B.bit_length(),
        TILE=min(meta["BLOCK"], MAX_TILE), **meta,
    )
