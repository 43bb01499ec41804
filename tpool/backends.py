"""Backend dispatch: the same five operations over a PoolState, three ways.

Note: ``reference`` is plain torch (the oracle), ``numba`` runs the kernels'
numba twins on host memory, ``triton`` launches the Triton kernels (on a CPU
only under ``TRITON_INTERPRET=1``, set before triton is imported). ``auto``
picks triton for CUDA pools and numba for CPU pools; the environment variable
``TPOOL_BACKEND`` overrides ``auto``.
"""

import functools
import os

import torch

from tpool import reference
from tpool.state import PoolState

BACKENDS = ("reference", "numba", "triton")


def resolve_backend(name: str, device: torch.device) -> str:
    """The backend a pool on ``device`` uses for ``name`` (``auto`` or one of BACKENDS)."""
    if name == "auto":
        name = os.environ.get("TPOOL_BACKEND") or ("triton" if device.type == "cuda" else "numba")
    if name not in BACKENDS:
        raise ValueError(f"backend: expected 'auto' or one of {BACKENDS}, got {name!r}")
    if name == "numba" and device.type != "cpu":
        raise ValueError(f"backend 'numba' runs on host memory: expected device cpu, got {device}")
    if name == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend 'triton' on a CPU pool needs TRITON_INTERPRET=1 set before triton is imported")
    return name


class ReferenceBackend:
    name = "reference"

    def __init__(self, st: PoolState):
        self.st = st

    def bind_alloc(self, out):
        return lambda counts, b, evict: reference.alloc(self.st, counts, out.pages, out.indptr, out.ok,
                                                        out.evicted, evict)

    def free(self, pages, cache):
        reference.free(self.st, pages, cache)

    def incref(self, pages):
        reference.incref(self.st, pages)

    def touch(self, pages):
        reference.touch(self.st, pages)

    def evict(self, out):
        reference.evict(self.st, out)


class NumbaBackend:
    """Closures over the state descriptor: a call is one Python frame plus the kernel.

    The kernels' ``*_entry`` functions take the state as one int64 descriptor of
    addresses (built once, the tensors never move) and ``AllocOut`` buffers as
    another, so a call unboxes two arrays instead of eight. Note: the compiled
    entry points (``kernels._numba_util.entry_point``) do not check their
    arguments' types, so every call site passes exactly the compiled ones.
    """

    name = "numba"

    def __init__(self, st: PoolState):
        from numba import types

        from tpool.kernels import alloc, evict, free, incref, touch
        from tpool.kernels._numba_util import entry_point, state_descriptor

        self.st = st
        sd = self.sd = state_descriptor(st)
        # alloc and free, the calls a scheduler makes every step, go straight to their compiled
        # entry points for the argument types passed below (see ``entry_point``): no type
        # matching per call, ~70 ns each. Each is compiled at its first use (binding an AllocOut,
        # the first free), as numba's dispatch would, not when the pool is made. The others keep
        # numba's dispatch.
        i64, flag, desc = types.int64, types.boolean, types.int64[::1]
        free_k = None
        incref_k, touch_k, evict_k = incref.incref_numba_entry, touch.touch_numba_entry, evict.evict_numba_entry

        def bind_alloc(out):
            cd = alloc.alloc_descriptor(sd, out)
            alloc_k = entry_point(alloc.alloc_numba_entry, i64, i64, desc, flag)
            return lambda counts, b, evict: alloc_k(counts.data_ptr(), b, cd, evict)

        def free_(pages, cache):
            nonlocal free_k
            if free_k is None:
                free_k = entry_point(free.free_numba_entry, i64, i64, flag, desc)
            free_k(pages.data_ptr(), pages.numel(), cache, sd)

        def incref_(pages):
            incref_k(pages.data_ptr(), pages.numel(), sd)

        def touch_(pages):
            touch_k(pages.data_ptr(), pages.numel(), sd)

        def evict_(out):
            evict_k(out.data_ptr(), out.numel(), sd)

        self.bind_alloc, self.free, self.incref, self.touch, self.evict = bind_alloc, free_, incref_, touch_, evict_


class TritonBackend:
    name = "triton"

    def __init__(self, st: PoolState):
        from tpool.kernels import alloc, evict, free, incref, touch

        self.st = st
        self._alloc, self._free, self._incref = alloc.alloc_triton, free.free_triton, incref.incref_triton
        self._touch, self._evict = touch.touch_triton, evict.evict_triton

    def bind_alloc(self, out):
        return lambda counts, b, evict: self._alloc(counts, out.pages, out.indptr, out.ok, out.evicted, evict,
                                                    self.st)

    def free(self, pages, cache):
        self._free(pages, cache, self.st)

    def incref(self, pages):
        self._incref(pages, self.st)

    def touch(self, pages):
        self._touch(pages, self.st)

    def evict(self, out):
        self._evict(out, self.st)


def make_backend(name: str, st: PoolState):
    return {"reference": ReferenceBackend, "numba": NumbaBackend, "triton": TritonBackend}[name](st)


class _BoundByTensors:
    """Bound calls of a backend whose ops take the output tensors on every call."""

    def _csr_call(self, csr, memo):
        """The CSR export bound to the table-owned buffers ``csr`` (indptr, indices, last_page_len);
        ``memo`` is their bookkeeping (see ``PageTable._csr_out``), which a full re-pad does without."""
        return lambda req_ids: self.csr(req_ids, *csr)

    def bind_extend(self, res):
        return lambda req_ids, num_tokens, b: self.extend(req_ids, num_tokens, res.slots, res.ok)

    def bind_csr(self, res, memo):
        csr = self._csr_call(res, memo)
        return lambda req_ids, b: csr(req_ids)

    def bind_step(self, res, memo):
        csr = self._csr_call(res.csr, memo)

        def step(req_ids, num_tokens, b):
            self.extend(req_ids, num_tokens, res.slots, res.ok)
            csr(req_ids)
        return step

    def bind_step_inputs(self, res, memo, req_ids, num_tokens, b):
        step = self.bind_step(res, memo)
        return lambda: step(req_ids, num_tokens, b)


class ReferenceTableBackend(_BoundByTensors):
    name = "reference"

    def __init__(self, st: PoolState, ts):
        from tpool import reference_table
        self.st, self.ts, self._ops = st, ts, reference_table

    def extend(self, req_ids, num_tokens, slots, ok):
        self._ops.extend(self.st, self.ts, req_ids, num_tokens, slots, ok)

    def release(self, req_ids, cache):
        self._ops.release(self.st, self.ts, req_ids, cache)

    def truncate(self, req_ids, new_lens):
        self._ops.truncate(self.st, self.ts, req_ids, new_lens)

    def fork(self, src_ids, dst_ids, lens, ok, cow_src, cow_dst):
        self._ops.fork(self.st, self.ts, src_ids, dst_ids, lens, ok, cow_src, cow_dst)

    def csr(self, req_ids, indptr, indices, last_page_len):
        self._ops.csr(self.st, self.ts, req_ids, indptr, indices, last_page_len)

    def rows(self, req_ids, out):
        self._ops.rows(self.ts, req_ids, out)


TABLE_BACKENDS = {"reference": ReferenceTableBackend}


def make_table_backend(name: str, st: PoolState, ts):
    if name not in TABLE_BACKENDS:
        raise NotImplementedError(f"page tables are not implemented yet on the {name!r} backend")
    return TABLE_BACKENDS[name](st, ts)


class NumbaTableBackend:
    """Closures over the table and pool descriptors (see NumbaBackend).

    The hot calls (extend, the CSR export, the fused step) are bound to their
    output buffers once (``bind_*``): each bound call owns a call descriptor
    holding the output addresses, so a call passes two addresses, a length and
    one array to numba.
    """

    name = "numba"

    def __init__(self, st: PoolState, ts):
        import numba

        from tpool.kernels import csr, extend, fork, release, step
        from tpool.kernels._numba_util import call_descriptor, entry_point, state_descriptor, table_descriptor

        sd, td = state_descriptor(st), table_descriptor(ts)
        self.sd, self.td = sd, td
        # The per-step calls go straight to their compiled entry points for the argument types
        # passed below (see NumbaBackend), each compiled at its first use (the first binding of
        # its kind, the first release); truncate, fork and rows keep numba's dispatch.
        i64, flag, desc = numba.types.int64, numba.types.boolean, numba.types.int64[::1]
        release_k = None
        truncate_k, fork_k, rows_k = release.truncate_numba_entry, fork.fork_numba_entry, csr.rows_numba_entry

        def bind_extend(res):
            cd = call_descriptor(td, sd, slots=res.slots, ok=res.ok)
            extend_k = entry_point(extend.extend_numba_entry, i64, i64, i64, desc)
            return lambda req_ids, num_tokens, b: extend_k(req_ids.data_ptr(), num_tokens.data_ptr(), b, cd)

        def bind_csr(res, memo):
            cd = call_descriptor(td, sd, csr=res, memo=memo)
            csr_k = entry_point(csr.csr_numba_entry, i64, i64, desc)
            return lambda req_ids, b: csr_k(req_ids.data_ptr(), b, cd)

        def bind_step(res, memo):
            cd = call_descriptor(td, sd, slots=res.slots, ok=res.ok, csr=res.csr, memo=memo)
            step_k = entry_point(step.step_numba_entry, i64, i64, i64, desc)
            return lambda req_ids, num_tokens, b: step_k(req_ids.data_ptr(), num_tokens.data_ptr(), b, cd)

        def bind_step_inputs(res, memo, req_ids, num_tokens, b):  # the inputs' addresses baked in too
            cd = call_descriptor(td, sd, slots=res.slots, ok=res.ok, csr=res.csr, memo=memo,
                                 inputs=(req_ids, num_tokens))
            run = functools.partial(entry_point(step.step_bound_numba_entry, i64), cd.ctypes.data)  # one int
            run.descriptor = cd  # kept alive with the call
            return run

        cd = call_descriptor(td, sd)  # ops without table-owned outputs

        def release_(req_ids, cache):
            nonlocal release_k
            if release_k is None:
                release_k = entry_point(release.release_numba_entry, i64, i64, flag, desc)
            release_k(req_ids.data_ptr(), req_ids.numel(), cache, cd)

        def truncate_(req_ids, new_lens):
            truncate_k(req_ids.data_ptr(), new_lens.data_ptr(), req_ids.numel(), cd)

        def fork_(src_ids, dst_ids, lens, ok, cow_src, cow_dst):
            fork_k(src_ids.data_ptr(), dst_ids.data_ptr(), lens.data_ptr(), dst_ids.numel(), ok.data_ptr(),
                   cow_src.data_ptr(), cow_dst.data_ptr(), cd)

        def rows_(req_ids, out):
            rows_k(req_ids.data_ptr(), req_ids.numel(), out.data_ptr(), cd)

        self.bind_extend, self.bind_csr, self.bind_step = bind_extend, bind_csr, bind_step
        self.bind_step_inputs = bind_step_inputs
        self.release, self.truncate, self.fork, self.rows = release_, truncate_, fork_, rows_


TABLE_BACKENDS["numba"] = NumbaTableBackend


class TritonTableBackend(_BoundByTensors):
    name = "triton"

    def __init__(self, st: PoolState, ts):
        from tpool.kernels import csr, extend, fork, release, step

        self.st, self.ts = st, ts
        self._extend, self._fork, self._step = extend.extend_triton, fork.fork_triton, step.step_triton
        self._release, self._truncate = release.release_triton, release.truncate_triton
        self._csr, self._rows = csr.csr_triton, csr.rows_triton

    def extend(self, req_ids, num_tokens, slots, ok):
        self._extend(req_ids, num_tokens, slots, ok, self.st, self.ts)

    def release(self, req_ids, cache):
        self._release(req_ids, cache, self.st, self.ts)

    def truncate(self, req_ids, new_lens):
        self._truncate(req_ids, new_lens, self.st, self.ts)

    def fork(self, src_ids, dst_ids, lens, ok, cow_src, cow_dst):
        self._fork(src_ids, dst_ids, lens, ok, cow_src, cow_dst, self.st, self.ts)

    def csr(self, req_ids, indptr, indices, last_page_len):
        """Unbound export into any buffers: ``indices`` is padded whole."""
        written = torch.full((1,), indices.numel(), dtype=torch.int64, device=indices.device)
        self._csr(req_ids, indptr, indices, last_page_len, written, self.st, self.ts)

    def _csr_call(self, csr, memo):  # pads only as far as the last export into csr wrote (memo[0])
        indptr, indices, last = csr
        return lambda req_ids: self._csr(req_ids, indptr, indices, last, memo, self.st, self.ts)

    def bind_step(self, res, memo):  # one launch: extend, barrier, CSR
        indptr, indices, last = res.csr
        return lambda req_ids, num_tokens, b: self._step(req_ids, num_tokens, res.slots, res.ok, indptr, indices,
                                                         last, memo, self.st, self.ts)

    def rows(self, req_ids, out):
        self._rows(req_ids, out, self.ts)


TABLE_BACKENDS["triton"] = TritonTableBackend
