"""Helpers for the numba twins: arrays over raw addresses, shared passes.

Note: the numba kernels take per-call tensors as (address, length) pairs so
that a call costs a ``data_ptr()`` (~0.1 us) instead of a ``.numpy()``
(~0.7 us). The façade checks dtype, device and contiguity before it passes
an address. The state of a pool (and of a table) reaches the kernels as one
int64 descriptor of addresses, built once (``state_descriptor``,
``table_descriptor``), because numba checks every array argument on each call.
"""

import functools
import os

import numba
import numpy as np
import torch
import llvmlite.ir as llvm_ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import layout as L


def _pointer_intrinsic(elem):
    ptr_type = types.CPointer(elem)

    @intrinsic
    def as_pointer(typingctx, addr):
        sig = ptr_type(types.int64)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(ptr_type))

        return sig, codegen

    return as_pointer


_i32_ptr = _pointer_intrinsic(types.int32)
_u8_ptr = _pointer_intrinsic(types.uint8)
_i8_ptr = _pointer_intrinsic(types.int8)
_i64_ptr = _pointer_intrinsic(types.int64)

# Slots of a pool's state descriptor (int64 [STATE_DESC_LEN]): the addresses of its
# state tensors and the page count. One array argument instead of seven keeps
# numba's per-call dispatch short (~60 ns per array argument).
SD_FREE_STACK, SD_REFCOUNT, SD_PAGE_STATE, SD_STAMP, SD_COUNTERS, SD_OCCUR, SD_KEYS, SD_PAGES = range(8)
STATE_DESC_LEN = 8


def _int32_copy(raw_copy):
    """An intrinsic ``f(dst_addr, src_addr, n)`` copying ``n`` int32 with ``raw_copy``
    (``cgutils.raw_memcpy`` or ``raw_memmove``): one libc call."""

    @intrinsic
    def copy(typingctx, dst_addr, src_addr, n):
        sig = types.void(types.int64, types.int64, types.int64)

        def codegen(context, builder, signature, args):
            dst, src, count = args
            byte_ptr = llvm_ir.IntType(8).as_pointer()
            nbytes = builder.mul(count, llvm_ir.Constant(llvm_ir.IntType(64), 4))
            raw_copy(builder, builder.inttoptr(dst, byte_ptr), builder.inttoptr(src, byte_ptr), nbytes, 1)
            return context.get_dummy_value()

        return sig, codegen

    return copy


# memcpy of ``n`` int32 from address ``src_addr`` to ``dst_addr`` (non-overlapping).
# numba does not vectorise a copy between two arrays it cannot prove apart; the
# CSR export copies every page id of a batch, and this is ~4x faster.
copy_i32 = _int32_copy(cgutils.raw_memcpy)
# memmove of ``n`` int32 (the ranges may overlap): the step's CSR grows in place.
move_i32 = _int32_copy(cgutils.raw_memmove)


@intrinsic
def copy8_i32(typingctx, dst_addr, src_addr):
    """Copy 8 int32 (32 bytes) from ``src_addr`` to ``dst_addr``: a fixed-size memcpy,
    which LLVM turns into one vector load and store instead of a call into libc."""
    sig = types.void(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        dst, src = args
        byte_ptr = llvm_ir.IntType(8).as_pointer()
        cgutils.raw_memcpy(builder, builder.inttoptr(dst, byte_ptr), builder.inttoptr(src, byte_ptr),
                           llvm_ir.Constant(llvm_ir.IntType(64), 32), 1)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def fetch_add_i64(typingctx, addr, n):
    """Atomically add ``n`` to the int64 at ``addr``; returns the value before. Two threads
    bumping the same counter (numba kernels release the GIL) each get their own value."""
    sig = types.int64(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        cell = builder.inttoptr(args[0], llvm_ir.IntType(64).as_pointer())
        return builder.atomic_rmw("add", cell, args[1], "seq_cst")

    return sig, codegen


@intrinsic
def fill_null_i32(typingctx, addr, n):
    """Set ``n`` int32 at address ``addr`` to -1 (NULL_PAGE): a memset of 0xFF bytes.

    numba leaves such padding loops scalar (~0.4 ns per entry); a memset is ~10x faster.
    """
    assert L.NULL_PAGE == -1  # all bytes 0xFF
    sig = types.void(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        dst, count = args
        byte_ptr = llvm_ir.IntType(8).as_pointer()
        nbytes = builder.mul(count, llvm_ir.Constant(llvm_ir.IntType(64), 4))
        cgutils.memset(builder, builder.inttoptr(dst, byte_ptr), nbytes, 0xFF)
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(nogil=True, inline="always")
def fill_null_range(addr, start, stop):
    """Set the int32 entries ``[start, stop)`` of the array at ``addr`` to -1; nothing if ``stop <= start``."""
    if stop > start:
        fill_null_i32(addr + 4 * start, stop - start)


@numba.njit(nogil=True, inline="always")
def i32_array(addr, n):
    """int32 ``[n]`` array over a contiguous tensor's ``data_ptr()``."""
    return numba.carray(_i32_ptr(addr), (n,))


@numba.njit(nogil=True, inline="always")
def u8_array(addr, n):
    """uint8 ``[n]`` array over a contiguous bool tensor's ``data_ptr()``."""
    return numba.carray(_u8_ptr(addr), (n,))


@numba.njit(nogil=True, inline="always")
def state_arrays(sd):
    """(free_stack, refcount, page_state, stamp, counters, occur, keys) over a state descriptor."""
    P = sd[SD_PAGES]
    return (numba.carray(_i32_ptr(sd[SD_FREE_STACK]), (P,)), numba.carray(_i32_ptr(sd[SD_REFCOUNT]), (P,)),
            numba.carray(_i8_ptr(sd[SD_PAGE_STATE]), (P,)), numba.carray(_i64_ptr(sd[SD_STAMP]), (P,)),
            numba.carray(_i64_ptr(sd[SD_COUNTERS]), (L.NUM_COUNTERS,)),
            numba.carray(_i32_ptr(sd[SD_OCCUR]), (P,)), numba.carray(_i64_ptr(sd[SD_KEYS]), (P,)))


# Slots of a page table's descriptor (int64 [TABLE_DESC_LEN]). TD_VERSION is the address of
# the table's ``version`` cell (a state tensor, so a restored snapshot brings its version
# back) and TD_VERSION_SOURCE that of VERSION_SOURCE (see ``new_version``).
TD_BLOCK_TABLE, TD_REQUESTS, TD_MAX_PAGES, TD_SEQ_LENS, TD_CLAIM, TD_PAGE_SIZE, TD_VERSION, TD_VERSION_SOURCE = range(8)
TABLE_DESC_LEN = 8


@numba.njit(nogil=True, inline="always")
def table_arrays(td):
    """(block_table [R, MP], seq_lens, claim, page_size) over a table descriptor."""
    R = td[TD_REQUESTS]
    return (numba.carray(_i32_ptr(td[TD_BLOCK_TABLE]), (R, td[TD_MAX_PAGES])),
            numba.carray(_i32_ptr(td[TD_SEQ_LENS]), (R,)), numba.carray(_i32_ptr(td[TD_CLAIM]), (R,)),
            td[TD_PAGE_SIZE])


# The one version counter of all numba tables in the process: outside every table's state,
# so never restored, and started at a random 62-bit value, so versions do not repeat across
# tables or processes (a state copied in from another table or a checkpoint brings a version
# this process's tables have not used). int64 [1], read and bumped by ``new_version``.
VERSION_SOURCE = torch.tensor([int.from_bytes(os.urandom(8), "little") >> 2], dtype=torch.int64)


@numba.njit(nogil=True, inline="always")
def new_version(td):
    """Give the table a version no table content had before; returns it.

    Called by every numba entry point that may change ``block_table`` or
    ``seq_lens``. The source is not part of any table's state, so restoring a
    snapshot (which puts the old version back with the old contents) never
    makes two different contents share a version; a step's CSR memo relies on
    that (see ``kernels/step.py``). Contents changed by hand (not through
    tpool calls or a whole-state restore) keep their version: call
    ``PageTable.invalidate_csr`` after such edits.
    """
    version = fetch_add_i64(td[TD_VERSION_SOURCE], 1) + 1  # atomic: kernels run without the GIL
    i64_cell(td[TD_VERSION])[0] = version
    return version


@functools.cache
def entry_point(dispatcher, *argtypes):
    """The CPython entry point of ``dispatcher`` compiled for exactly ``argtypes``, compiled on the
    first request and remembered (``Dispatcher.compile`` itself costs ~12 us even when cached).

    Calling it skips numba's per-call type matching (~70 ns), and also its type checks: a
    caller passes exactly these types (Python ints for int64, bools, int64 C-contiguous arrays).
    """
    return dispatcher.compile(argtypes)


def table_descriptor(ts):
    """The int64 descriptor of a TableState (built once per table; see TD_* slots)."""
    for t in (ts.block_table, ts.seq_lens, ts.claim, ts.version):
        assert t.is_contiguous() and t.device.type == "cpu"
    assert ts.version.dtype == torch.int64
    return np.array([ts.block_table.data_ptr(), ts.max_requests, ts.max_pages, ts.seq_lens.data_ptr(),
                     ts.claim.data_ptr(), ts.page_size, ts.version.data_ptr(), VERSION_SOURCE.data_ptr()],
                    dtype=np.int64)


def state_descriptor(st):
    """The int64 descriptor of a PoolState (built once per pool; see SD_* slots)."""
    d = np.zeros(STATE_DESC_LEN, np.int64)
    for slot, t in ((SD_FREE_STACK, st.free_stack), (SD_REFCOUNT, st.refcount), (SD_PAGE_STATE, st.page_state),
                    (SD_STAMP, st.stamp), (SD_COUNTERS, st.counters), (SD_OCCUR, st.occur), (SD_KEYS, st.keys)):
        assert t.is_contiguous() and t.device.type == "cpu"
        d[slot] = t.data_ptr()
    d[SD_PAGES] = st.num_pages
    return d


# Slots of a bound call's descriptor (int64 [CALL_DESC_LEN]): the table descriptor,
# the pool's state descriptor, then the addresses of the output buffers the call
# writes (fixed: the buffers belong to the table). One array argument in place of
# ten keeps a call short (numba checks each array argument). CD_CSR_MEMO is the address of the CSR
# memo kept with the ``indices`` buffer (see MEMO_* in layout), shared by every call
# bound to it. A call bound to its input tensors too (``PageTable.bind_step``) keeps
# their addresses and the batch size in CD_IDS, CD_NTOK, CD_LANES and passes numba
# only the descriptor's address.
CD_STATE = TABLE_DESC_LEN
CD_OUT = TABLE_DESC_LEN + STATE_DESC_LEN
(CD_SLOTS, CD_SLOTS_LEN, CD_OK, CD_INDPTR, CD_INDICES, CD_INDICES_LEN, CD_LAST_PAGE_LEN,
 CD_CSR_MEMO, CD_IDS, CD_NTOK, CD_LANES) = range(CD_OUT, CD_OUT + 11)
CALL_DESC_LEN = CD_OUT + 11


def call_descriptor(td, sd, slots=None, ok=None, csr=None, memo=None, inputs=None):
    """The descriptor of one bound call (see CD_* slots): ``slots``/``ok`` for extend,
    ``csr`` = (indptr, indices, last_page_len) for the CSR export with ``memo``, the
    int64 tensor the table keeps with those buffers, ``inputs`` = (req_ids, num_tokens)
    for a call bound to its inputs; unused slots are 0."""
    d = np.zeros(CALL_DESC_LEN, np.int64)
    d[:CD_STATE], d[CD_STATE:CD_OUT] = td, sd
    if slots is not None:
        d[CD_SLOTS], d[CD_SLOTS_LEN], d[CD_OK] = slots.data_ptr(), slots.numel(), ok.data_ptr()
    if csr is not None:
        indptr, indices, last = csr
        assert memo.dtype == torch.int64 and memo.numel() == L.memo_len(last.numel()) and memo.device.type == "cpu"
        d[CD_INDPTR], d[CD_INDICES], d[CD_INDICES_LEN] = indptr.data_ptr(), indices.data_ptr(), indices.numel()
        d[CD_LAST_PAGE_LEN], d[CD_CSR_MEMO] = last.data_ptr(), memo.data_ptr()
    if inputs is not None:
        ids, ntok = inputs
        assert ids.numel() == ntok.numel() and ids.device.type == ntok.device.type == "cpu"
        d[CD_IDS], d[CD_NTOK], d[CD_LANES] = ids.data_ptr(), ntok.data_ptr(), ids.numel()
    return d


@numba.njit(nogil=True, inline="always")
def i64_cell(addr):
    """int64 ``[1]`` array over the cell at ``addr``."""
    return numba.carray(_i64_ptr(addr), (1,))


@numba.njit(nogil=True, inline="always")
def i64_array(addr, n):
    """int64 ``[n]`` array over a contiguous tensor's ``data_ptr()``."""
    return numba.carray(_i64_ptr(addr), (n,))


@numba.njit(nogil=True, inline="always")
def page_shift(page_size):
    """log2(page_size) when it is a power of two (the usual case), else -1."""
    if page_size & (page_size - 1) != 0:
        return -1
    s = 0
    while (1 << s) < page_size:
        s += 1
    return s


@numba.njit(nogil=True, inline="always")
def pages_for(tokens, page_size, shift):
    """ceil(tokens / page_size): a shift instead of an integer division when ``shift >= 0``.

    A division per request is a visible share of a decode step on a CPU.
    """
    if shift >= 0:
        return (tokens + page_size - 1) >> shift
    return (tokens + page_size - 1) // page_size


@numba.njit(nogil=True)
def update_peaks(counters, num_pages):
    used = num_pages - counters[L.FREE_COUNT] - counters[L.CACHED_COUNT]
    if used > counters[L.USED_PEAK]:
        counters[L.USED_PEAK] = used
    if counters[L.CACHED_COUNT] > counters[L.CACHED_PEAK]:
        counters[L.CACHED_PEAK] = counters[L.CACHED_COUNT]


@numba.njit(nogil=True)
def count_lanes(pages, num_pages, occur, counters):
    """Pass 1 of free/incref/touch: occurrences per page into ``occur``; count invalid ids."""
    for i in range(pages.shape[0]):
        p = pages[i]
        if p >= 0 and p < num_pages:
            occur[p] += 1
        elif p != L.NULL_PAGE:
            counters[L.ERR_INVALID_PAGE] += 1


INT32_MAX = 2**31 - 1


@numba.njit(nogil=True)
def claim_requests(ids, R, claim, counters, count_bad):
    """Mark each request's first lane in ``claim`` (scratch); count the other non-padding lanes as bad."""
    for i in range(ids.shape[0]):
        r = ids[i]
        if r >= 0 and r < R and claim[r] == INT32_MAX:
            claim[r] = i
    if count_bad:
        for i in range(ids.shape[0]):
            r = ids[i]
            if r != L.NULL_PAGE and not lane_valid(ids, i, R, claim):
                counters[L.ERR_BAD_REQUEST] += 1


@numba.njit(nogil=True, inline="always")
def lane_valid(ids, i, R, claim):
    r = ids[i]
    return r >= 0 and r < R and claim[r] == i


@numba.njit(nogil=True)
def reset_claims(ids, R, claim):
    for i in range(ids.shape[0]):
        r = ids[i]
        if r >= 0 and r < R:
            claim[r] = INT32_MAX


@numba.njit(nogil=True)
def free_list(pages, cache, clock, free_stack, refcount, page_state, stamp, counters, occur):
    """The pool's free rule over ``pages`` (any int array, -1 = padding), without the clock tick.

    Per distinct page named ``k`` times: ``d = min(k, refcount)`` references are
    dropped and ``k - d`` entries count as ``double_free`` (all ``k`` when the
    page is not USED); pages reaching 0 are pushed in the order of their first
    occurrence, or with ``cache`` become CACHED stamped ``clock``. Used by
    ``free`` and by the page table's ``release`` / ``truncate``.
    """
    P = refcount.shape[0]
    count_lanes(pages, P, occur, counters)
    top = counters[L.FREE_COUNT]
    released = 0
    double = 0
    for i in range(pages.shape[0]):
        p = pages[i]
        if p < 0 or p >= P or occur[p] == 0:
            continue  # padding, invalid, or not the first occurrence
        k = occur[p]
        occur[p] = 0
        if page_state[p] != L.USED:
            double += k
            continue
        rc = refcount[p]
        d = min(k, rc)
        double += k - d
        refcount[p] = rc - d
        if rc == d:
            released += 1
            if cache:
                page_state[p] = L.CACHED
                stamp[p] = clock
            else:
                page_state[p] = L.FREE
                free_stack[top] = p
                top += 1
    counters[L.ERR_DOUBLE_FREE] += double
    counters[L.FREED] += released
    if cache:
        counters[L.CACHED_COUNT] += released
    counters[L.FREE_COUNT] = top
    update_peaks(counters, P)


@numba.njit(nogil=True, inline="always")
def pop_page(at, free_stack, refcount, page_state):
    """The page at ``free_stack[at]``, marked USED with one reference. Callers pop from the top
    (``at`` = free count - 1 - pages popped so far) and lower the free count once at the end."""
    p = free_stack[at]
    refcount[p] = 1
    page_state[p] = L.USED
    return p
