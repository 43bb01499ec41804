"""PROTOTYPE (benchmarks only, not used by tpool): the current decode step after a prefetch pass.

Before calling ``kernels/step.py: step_numba_entry`` unchanged, one pass over the lanes
reads each request's length and issues a software prefetch (``llvm.prefetch``) of the
line of ``block_table[r]`` that holds its last page, so the 256 row misses of a cold
step overlap instead of waiting on each other in the extend loop. Compared with
``step_tail.py`` (no row read at all) in ``cold_breakdown.py``.
"""

import numba
import llvmlite.ir as llvm_ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from tpool.kernels._numba_util import i32_array, i64_array, page_shift, table_arrays
from tpool.kernels.layout import CALL_DESC_LEN, CD_IDS, CD_LANES, CD_NTOK, CD_STATE, TD_BLOCK_TABLE
from tpool.kernels.step import step_numba_entry


@intrinsic
def prefetch(typingctx, addr):
    """Prefetch the cache line at ``addr`` for reading (locality 3: keep it in every level)."""
    sig = types.void(types.int64)

    def codegen(context, builder, signature, args):
        ptr_t = llvm_ir.IntType(8).as_pointer()
        i32 = llvm_ir.IntType(32)
        fnty = llvm_ir.FunctionType(llvm_ir.VoidType(), [ptr_t, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [builder.inttoptr(args[0], ptr_t), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(nogil=True)
def prefetch_rows(ids_ptr, B, td):
    """Prefetch the line of each lane's row that holds its last page (or the next one)."""
    bt, lens, _, ps = table_arrays(td)
    R, MP = bt.shape[0], bt.shape[1]
    shift = page_shift(ps)
    ids = i32_array(ids_ptr, B)
    base = td[TD_BLOCK_TABLE]
    for i in range(B):
        r = ids[i]
        if r >= 0 and r < R:
            length = lens[r]
            k = length >> shift if shift >= 0 else length // ps
            if k >= 0 and k < MP:
                prefetch(base + 4 * (r * MP + k))


@numba.njit(nogil=True)
def step_prefetch_bound_entry(cd_addr):
    """``step_bound_numba_entry`` after :func:`prefetch_rows`."""
    cd = i64_array(cd_addr, CALL_DESC_LEN)
    prefetch_rows(cd[CD_IDS], cd[CD_LANES], cd[:CD_STATE])
    step_numba_entry(cd[CD_IDS], cd[CD_NTOK], cd[CD_LANES], cd)
