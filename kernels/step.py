"""step: one scheduler step on a page table: extend, then the FlashInfer CSR of the batch.

The two passes of :mod:`extend` and :mod:`csr` in one numba call, so a decode
loop pays one dispatch and one façade call per step. The CSR is built after
the extend, so it lists the pages the step just added: the semantics are those
of the two calls made one after the other. The Triton and reference backends
run the two ops in turn (two launches, which a CUDA graph captures together).
"""

import numba

from .csr import csr_numba_entry
from .extend import extend_numba_entry


@numba.njit(nogil=True)
def step_numba_entry(req_ids_ptr, ntok_ptr, B, cd):
    """extend then csr for a bound call (outputs, table and pool state in the call descriptor ``cd``)."""
    extend_numba_entry(req_ids_ptr, ntok_ptr, B, cd)
    csr_numba_entry(req_ids_ptr, B, cd)
