"""The numba backend: the kernels' numba twins on host memory, called through descriptors.

Note: a numba call checks every array argument it is given, so the
addresses a kernel needs are packed once into int64 descriptors (slots
``SD_*``, ``AD_*``, ``TD_*``, ``CD_*`` in :mod:`tpool.kernels.layout`) and
per-call tensors travel as ``data_ptr()`` integers. The per-step calls go
straight to the CPython entry point numba compiled for exactly the argument
types passed here (:func:`entry_point`), skipping numba's per-call type
matching, and each is compiled at its first use (the first binding of its
kind, the first free or release), not when a pool or table is made.

Lifetimes: descriptors hold addresses, so every call this module returns
holds the tensors its descriptor points into (the state and the output
buffers), and pools and tables refuse copy and pickle.

Threads: the kernels are compiled here to keep the GIL while they run
(:func:`kernel`), so one call on a pool or its tables is atomic with respect
to other Python threads (a call is one kernel call), at no cost: releasing
and taking back the GIL would cost more than these kernels' short runs gain.
"""

import functools
import hashlib
import os
from typing import NamedTuple

import numba
import numpy as np
import torch
from numba.core import caching
from numba.core.runtime import nrt

from tpool._checks import overlap_error, storage_spans
from tpool._startup import announce_compile, announce_no_cache
from tpool.kernels import alloc, block_table_rows, evict, extend, flashinfer_csr, fork, free, incref, release, step
from tpool.kernels import layout as L
from tpool.kernels import revive, touch
from tpool.kernels._numba_util import copy_spans as copy_spans_kernel
from tpool.kernels._numba_util import restamp_table, stamp_rows
from tpool.state import CsrMemo, fixed_full

_i64, _flag, _desc = numba.types.int64, numba.types.boolean, numba.types.int64[::1]

# The one version counter of all numba tables in the process (see ``kernels._numba_util.new_version``):
# outside every table's state, so never restored with a snapshot, and started at a random 62-bit
# value, so versions do not repeat across tables or processes (a state copied in from another
# table or a checkpoint brings a version this process's tables have not used). int64 [1].
# Over numpy memory (``fixed_full``): every table descriptor holds its address, so it must never be resized.
VERSION_SOURCE = fixed_full(1, int.from_bytes(os.urandom(8), "little") >> 2, torch.int64, torch.device("cpu"))


@functools.cache
def kernel(dispatcher):
    """The numba entry ``dispatcher`` (a ``*_numba_entry`` of ``tpool.kernels``) compiled to keep
    the GIL while it runs (a call is then atomic with respect to other Python threads), and
    cached on disk (a later process loads it instead of compiling; see :func:`kernels_stamp`)."""
    return cached_njit(dispatcher.py_func)


def copy_spans():
    """``kernels._numba_util.copy_spans`` compiled to keep the GIL, called as ``(desc_addr, n)`` (see
    :func:`tpool.state.copy_between_calls`)."""
    return entry_point(copy_spans_kernel, _i64, _i64)


class KernelCache(caching.FunctionCache):
    """numba's on-disk cache of one function, whose hits load without refreshing numba's target.

    numba refreshes its CPU target before every cache load, which imports and registers its
    whole library of typing and lowering rules (numpy, random, typed containers...): ~0.15 s,
    most of what a process's first kernel call costs when the cache is warm. Machine code
    loaded from the cache uses none of them; it may link against the numba runtime (NRT),
    whose symbols are registered here. A miss compiles as usual, and compiling refreshes
    the target itself (``numba.core.compiler``); the first miss of a process says so on
    stderr (:func:`tpool._startup.announce_compile`).
    """

    def load_overload(self, sig, target_context):
        nrt.rtsys.initialize(target_context)
        with self._guard_against_spurious_io_errors():
            loaded = self._load_overload(sig, target_context)
        if loaded is None:  # a miss: numba compiles next
            announce_compile(self.cache_path, self._py_func.__name__)  # (numba's _name is the function's repr)
        return loaded


def cached_njit(fn=None, **options):
    """``numba.njit(fn, cache=True, **options)``, its disk cache a :class:`KernelCache` (made here, as
    ``Dispatcher.enable_caching`` makes numba's); uncached where no cache location is writable (numba's
    own ``cache=True`` raises at import there: a read-only package directory and home, as in many
    containers)."""
    if fn is None:
        return functools.partial(cached_njit, **options)
    dispatcher = numba.njit(fn, **options)
    try:
        dispatcher._cache = KernelCache(dispatcher.py_func)
    except RuntimeError as e:  # numba's "no locator available": nowhere writable to cache
        if "no locator" not in str(e):
            raise
        announce_no_cache()    # compiled in every process instead (a shared temporary directory would be
        #                        code anyone there could plant: numba loads what a cache holds)
    return dispatcher


# ---------------------------------------------------------------- the compile cache
# numba's cache checks only the source file of the function it caches, but an entry point
# compiles in helpers from other kernel modules (_numba_util.py, ...). The kernels' cache
# entries are therefore stamped with a hash of every kernel module: any change to any of them
# recompiles every entry. Where the entries go is numba's usual choice (NUMBA_CACHE_DIR if
# set and writable, else __pycache__ beside the kernels, else a per-user cache directory when
# the package directory is read-only). Where none is writable the kernels compile uncached
# (cached_njit), said once: numba itself would refuse to decorate them.
_KERNELS_DIR = os.path.dirname(os.path.abspath(alloc.__file__))


@functools.cache
def kernels_stamp() -> str:
    """sha256 of every kernel module's source, of this module's, and of numba's version."""
    h = hashlib.sha256(numba.__version__.encode())
    paths = [os.path.join(_KERNELS_DIR, n) for n in sorted(os.listdir(_KERNELS_DIR)) if n.endswith(".py")]
    for path in paths + [os.path.abspath(__file__)]:
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + b"\0" + f.read())
    return h.hexdigest()


def _stamped(base, anyone=False):
    class KernelLocator(base):
        """numba's ``{base}`` for tpool's kernels, stamped with :func:`kernels_stamp`; with ``anyone``,
        also for a function of another module compiled through :func:`cached_njit` (a benchmark's
        probe calling tpool's helpers, whose layout constants it compiles in): stamped with
        :func:`kernels_stamp` and its own file's stamp."""

        def get_source_stamp(self):
            return kernels_stamp() if self.tpool_kernel else (kernels_stamp(), super().get_source_stamp())

        @classmethod
        def from_function(cls, py_func, py_file):
            ours = py_func.__module__.startswith(("tpool.kernels", __name__))
            if not (ours or anyone):
                return None
            self = super().from_function(py_func, py_file)
            if self is not None:
                self.tpool_kernel = ours
            return self

    KernelLocator.__name__ = KernelLocator.__qualname__ = ("KernelAny" if anyone else "Kernel") + base.__name__
    return KernelLocator


_BASES = (caching.UserProvidedCacheLocator, caching.InTreeCacheLocator, caching.UserWideCacheLocator)
if not any(c.__name__.startswith("Kernel") for c in caching.CacheImpl._locator_classes):
    caching.CacheImpl._locator_classes[:0] = [_stamped(b) for b in _BASES]


class _KernelCacheImpl(caching.CompileResultCacheImpl):
    """The cache of a function compiled through :func:`cached_njit`, whatever its module: its entries
    are stamped with :func:`kernels_stamp` too, so a change to a kernel module (a layout constant)
    never loads machine code compiled against the old one."""

    _locator_classes = [_stamped(b, anyone=True) for b in _BASES]


KernelCache._impl_class = _KernelCacheImpl  # (defined after it: the locators need kernels_stamp)


@functools.cache
def entry_point(dispatcher, *argtypes):
    """The CPython entry point of :func:`kernel` ``(dispatcher)`` compiled for exactly ``argtypes``,
    compiled on the first request and remembered (``Dispatcher.compile`` is not free even when cached).

    Calling it skips numba's per-call type matching, and also its type checks: a caller
    passes exactly these types (Python ints for int64, bools, int64 C-contiguous arrays).
    """
    return kernel(dispatcher).compile(argtypes)


def _storages(*tensors) -> tuple:
    """The storages of ``tensors`` (None skipped). Held beside a descriptor, they keep the memory it
    points into alive even if a tensor is re-pointed elsewhere (``set_``); resizing is refused by
    the storages themselves on a CPU (``tpool.state.fixed_full``)."""
    return tuple(t.untyped_storage() for t in tensors if t is not None)


def _addr(t: torch.Tensor) -> int:
    assert t.is_contiguous() and t.device.type == "cpu"
    return t.data_ptr()


def state_descriptor(st) -> np.ndarray:
    """The int64 descriptor of a ``PoolState`` (``SD_*`` slots; built once per pool)."""
    d = np.zeros(L.STATE_DESC_LEN, np.int64)
    for slot, t in ((L.SD_FREE_STACK, st.free_stack), (L.SD_REFCOUNT, st.refcount), (L.SD_PAGE_STATE, st.page_state),
                    (L.SD_STAMP, st.stamp), (L.SD_COUNTERS, st.counters), (L.SD_OCCUR, st.occur),
                    (L.SD_KEYS, st.keys), (L.SD_PAGE_GEN, st.page_gen), (L.SD_LRU_QUEUE, st.lru_queue),
                    (L.SD_LRU_POS, st.lru_pos)):
        d[slot] = _addr(t)
    d[L.SD_PAGES] = st.num_pages
    return d


def alloc_descriptor(sd: np.ndarray, out) -> np.ndarray:
    """The descriptor of ``alloc`` bound to the buffers of ``out`` (an ``AllocOut``; ``AD_*`` slots)."""
    d = np.zeros(L.AD_LEN, np.int64)
    d[:L.STATE_DESC_LEN] = sd
    alloc_outputs(d, out.result)
    return d


def alloc_outputs(d: np.ndarray, result, addr=_addr) -> None:
    """Write the output slots (``AD_PAGES`` .. ``AD_EVICTED``) of the alloc descriptor ``d`` for the tensors
    of the ``AllocResult`` ``result``; ``addr``: ``torch.Tensor.data_ptr`` for tensors made contiguous on the
    CPU a moment ago (``alloc_once``), which skips ``_addr``'s checks (~0.5 µs a tensor)."""
    pages, indptr, ok, evicted = result
    d[L.AD_PAGES], d[L.AD_MAX_PAGES], d[L.AD_INDPTR] = addr(pages), pages.numel(), addr(indptr)
    d[L.AD_OK], d[L.AD_MAX_BATCH], d[L.AD_EVICTED] = addr(ok), ok.numel(), addr(evicted)


def table_descriptor(ts) -> np.ndarray:
    """The int64 descriptor of a ``TableState`` (``TD_*`` slots; built once per table)."""
    assert ts.version.dtype == ts.row_version.dtype == torch.int64
    d = np.zeros(L.TABLE_DESC_LEN, np.int64)
    for slot, value in ((L.TD_BLOCK_TABLE, _addr(ts.block_table)), (L.TD_REQUESTS, ts.max_requests),
                        (L.TD_MAX_PAGES, ts.max_pages), (L.TD_SEQ_LENS, _addr(ts.seq_lens)),
                        (L.TD_CLAIM, _addr(ts.claim)), (L.TD_PAGE_SIZE, ts.page_size),
                        (L.TD_VERSION, _addr(ts.version)), (L.TD_VERSION_SOURCE, VERSION_SOURCE.data_ptr()),
                        (L.TD_ROW_VERSION, _addr(ts.row_version))):
        d[slot] = value
    return d


def call_descriptor(td, sd, slots=None, ok=None, csr=None, memo=None, inputs=None, meta=None) -> np.ndarray:
    """The descriptor of one table call (``CD_*`` slots): ``slots``/``ok`` for extend, ``csr`` =
    (indptr, indices, last_page_len) for the CSR export with its ``CsrMemo``, ``inputs`` =
    (req_ids, num_tokens) for a call bound to its inputs, ``meta`` = (positions, qo_indptr,
    kv_lens) for a step; unused slots are 0."""
    d = np.zeros(L.CALL_DESC_LEN, np.int64)
    d[:L.CD_STATE], d[L.CD_STATE:L.CD_OUT] = td, sd
    if slots is not None:
        d[L.CD_SLOTS], d[L.CD_SLOTS_LEN], d[L.CD_OK] = _addr(slots), slots.numel(), _addr(ok)
    if csr is not None:
        indptr, indices, last = csr
        assert memo.held.numel() == L.memo_len(last.numel())
        d[L.CD_INDPTR], d[L.CD_INDICES], d[L.CD_INDICES_LEN] = _addr(indptr), _addr(indices), indices.numel()
        d[L.CD_LAST_PAGE_LEN], d[L.CD_CSR_MEMO] = _addr(last), _addr(memo.held)
    if inputs is not None:
        ids, ntok = inputs
        assert ids.numel() == ntok.numel()
        d[L.CD_IDS], d[L.CD_NTOK], d[L.CD_LANES] = _addr(ids), _addr(ntok), ids.numel()
    if meta is not None:
        positions, qo_indptr, kv_lens = meta
        assert positions.numel() == slots.numel() and qo_indptr.numel() == kv_lens.numel() + 1
        d[L.CD_POSITIONS], d[L.CD_QO_INDPTR], d[L.CD_KV_LENS] = _addr(positions), _addr(qo_indptr), _addr(kv_lens)
    return d


# ------------------------------------------------------------- overlap guards
# The hot calls check in the compiled code that an input shares no memory with what the call
# writes (the façade's storage check would cost more than these calls' own work): the byte
# ranges [lo, hi) of every storage the call writes follow the call's descriptor, and a guard
# returns which input overlapped (0: none, the kernel ran). Other calls are checked by the façade.
def storage_ranges(tensors) -> np.ndarray:
    """int64 ``[2k]``: the byte ranges ``[lo, hi)`` of the distinct storages of ``tensors``."""
    spans = storage_spans(tensors)
    return np.array([x for lo in sorted(spans) for x in (lo, spans[lo])], dtype=np.int64)


def _with_ranges(desc, tensors) -> np.ndarray:
    return np.concatenate([desc, storage_ranges(tensors)])


class _ExtendBuffers(NamedTuple):
    """An extend's outputs, as ``extend_into`` takes them (an ``ExtendResult``'s fields)."""

    slots: torch.Tensor
    ok: torch.Tensor


def _raise_overlap(code, names):
    raise overlap_error(names[code - 1])


@numba.njit(inline="always")  # (compiled into each caller, cached with it)
def _overlaps(addr, nbytes, desc, start):
    for i in range(start, desc.shape[0], 2):
        if addr < desc[i + 1] and addr + nbytes > desc[i]:
            return True
    return False


@cached_njit
def alloc_guarded(counts_ptr, B, ad, evict):
    if _overlaps(counts_ptr, 4 * B, ad, L.AD_LEN):
        return 1
    alloc.alloc_numba_entry(counts_ptr, B, ad, evict)
    return 0


@cached_njit
def free_guarded(pages_ptr, N, cache, fd):
    if _overlaps(pages_ptr, 4 * N, fd, L.STATE_DESC_LEN):
        return 1
    free.free_numba_entry(pages_ptr, N, cache, fd)
    return 0


@numba.njit(inline="always")
def _lanes_overlap(ids_ptr, ntok_ptr, B, cd):
    """1 when ``req_ids`` overlaps what the table call of ``cd`` writes, 2 when ``num_tokens`` does, else 0."""
    if _overlaps(ids_ptr, 4 * B, cd, L.CALL_DESC_LEN):
        return 1
    if _overlaps(ntok_ptr, 4 * B, cd, L.CALL_DESC_LEN):
        return 2
    return 0


@cached_njit
def extend_guarded(ids_ptr, ntok_ptr, B, cd):
    code = _lanes_overlap(ids_ptr, ntok_ptr, B, cd)
    if code == 0:
        extend.extend_numba_entry(ids_ptr, ntok_ptr, B, cd)
    return code


@cached_njit
def step_guarded(ids_ptr, ntok_ptr, B, cd):
    code = _lanes_overlap(ids_ptr, ntok_ptr, B, cd)
    if code == 0:
        step.step_numba_entry(ids_ptr, ntok_ptr, B, cd)
    return code


@cached_njit
def step_release_guarded(release_ptr, K, cache, ids_ptr, ntok_ptr, B, cd):
    code = _lanes_overlap(ids_ptr, ntok_ptr, B, cd)
    if code == 0 and _overlaps(release_ptr, 4 * K, cd, L.CALL_DESC_LEN):
        code = 3
    if code == 0:
        step.step_release_numba_entry(release_ptr, K, cache, ids_ptr, ntok_ptr, B, cd)
    return code


@cached_njit
def csr_guarded(ids_ptr, B, cd):
    if _overlaps(ids_ptr, 4 * B, cd, L.CALL_DESC_LEN):
        return 1
    flashinfer_csr.flashinfer_csr_numba_entry(ids_ptr, B, cd)
    return 0


@functools.cache
def guard_point(dispatcher, *argtypes):
    """The CPython entry point of a guard compiled for exactly ``argtypes`` (see :func:`entry_point`)."""
    return dispatcher.compile(argtypes)


class Pool:
    """The pool's operations on numba (the contract: ``tpool.backends.contract.PoolOps``)."""

    name = "numba"
    checks_overlap = True  # alloc and free refuse overlapping inputs in the compiled code

    def __init__(self, st):
        self.st = st
        self.sd = state_descriptor(st)
        self._held = _storages(*st.tensors().values())  # what ``sd`` points into
        self._state_ranges = storage_ranges(st.tensors().values())  # the state's storages never change
        self._fd = np.concatenate([self.sd, self._state_ranges])  # free's: the state and what it writes
        self._free = None  # compiled at the first free
        self._once = None  # alloc_once's descriptor template and guard, made at the first

    def alloc_into(self, out):
        ad = np.concatenate([alloc_descriptor(self.sd, out), self._state_ranges, storage_ranges(out.result)])
        run, held = guard_point(alloc_guarded, _i64, _i64, _desc, _flag), (self._held, _storages(*out.result))

        def call(counts, b, evict_, held=held):  # ``held``: what ``ad`` points into stays alive with it
            if run(counts.data_ptr(), b, ad, evict_):
                _raise_overlap(1, ("counts",))
        return call

    def alloc_once(self, result, counts, b, evict_):
        # Fresh outputs share memory with nothing: the guard checks counts against the state only, and
        # the descriptor is the pool's template with the outputs' slots written in (~2 µs, not the ~10
        # of alloc_into's descriptor, ranges and held storages). The call returns before they can go.
        if self._once is None:
            head = np.zeros(L.AD_LEN, np.int64)  # the state's slots; the outputs' are written per call
            head[:L.STATE_DESC_LEN] = self.sd
            self._once = (np.concatenate([head, self._state_ranges]), guard_point(alloc_guarded, _i64, _i64, _desc,
                                                                                   _flag))
        template, run = self._once
        ad = template.copy()
        alloc_outputs(ad, result, torch.Tensor.data_ptr)  # (ok has b lanes)
        if run(counts.data_ptr(), b, ad, evict_):
            _raise_overlap(1, ("counts",))

    def bind_alloc(self, out, counts, b, evict_):
        ad = alloc_descriptor(self.sd, out)
        run = functools.partial(entry_point(alloc.alloc_numba_entry, _i64, _i64, _desc, _flag), counts.data_ptr(),
                                b, ad, bool(evict_))
        run.held = (self._held, _storages(*out.result, counts))  # everything the call's addresses point into
        return run

    def free(self, pages, cache):
        if self._free is None:
            self._free = guard_point(free_guarded, _i64, _i64, _flag, _desc)
        if self._free(pages.data_ptr(), pages.numel(), cache, self._fd):
            _raise_overlap(1, ("pages",))

    def bind_free(self, pages, cache):
        run = functools.partial(entry_point(free.free_numba_entry, _i64, _i64, _flag, _desc), pages.data_ptr(),
                                pages.numel(), bool(cache), self.sd)
        run.held = (self._held, _storages(pages))
        return run

    def incref(self, pages):
        kernel(incref.incref_numba_entry)(pages.data_ptr(), pages.numel(), self.sd)

    def touch(self, pages):
        kernel(touch.touch_numba_entry)(pages.data_ptr(), pages.numel(), self.sd)

    def evict(self, out):
        kernel(evict.evict_numba_entry)(out.data_ptr(), out.numel(), self.sd)


class Table:
    """A page table's operations on numba (the contract: ``tpool.backends.contract.TableOps``).

    The hot calls (extend, the CSR export, the step) are bound to their output buffers
    once: each bound call owns a call descriptor holding the output addresses, so a call
    passes two addresses, a length and one array.
    """

    name = "numba"
    checks_overlap = True  # extend, the CSR export and step refuse overlapping inputs in the compiled code

    def __init__(self, st, ts):
        self.st, self.ts = st, ts
        self.sd, self.td = state_descriptor(st), table_descriptor(ts)
        self._held = _storages(*st.tensors().values(), *ts.tensors().values())  # what ``sd`` and ``td`` point into
        self.cd = call_descriptor(self.td, self.sd)  # for the ops without table-owned outputs
        self._release = None  # compiled at the first release
        self._revive = None  # (forget, revive) entry points, compiled at the first revive

    def addresses(self, *names):
        """The descriptor entries named (``"TD_..."`` of the table's, ``"SD_..."`` of the pool state's) as ints:
        the addresses and sizes this backend's kernels use, for a compiled loop outside it (the mirror's
        snapshot, the prefix cache) to read where they do. What they point into is held by this object."""
        if not all(n[:3] in ("TD_", "SD_") for n in names):
            raise ValueError(f"names: expected TD_* or SD_* descriptor entries, got {names}")
        return tuple(int((self.td if n.startswith("TD_") else self.sd)[getattr(L, n)]) for n in names)

    def extend(self, req_ids, num_tokens, slots, ok):
        # The contract's unbound form (the façade binds its buffers): through the guarded call, as bound.
        self.extend_into(_ExtendBuffers(slots, ok))(req_ids, num_tokens, req_ids.numel())

    def _written(self, *outputs):
        return [*self.st.tensors().values(), *self.ts.tensors().values(), *outputs]

    def extend_into(self, res):
        cd = _with_ranges(call_descriptor(self.td, self.sd, slots=res.slots, ok=res.ok), self._written(*res))
        run, held = guard_point(extend_guarded, _i64, _i64, _i64, _desc), (self._held, _storages(*res))

        def call(req_ids, num_tokens, b, held=held):  # ``held``: what ``cd`` points into
            if code := run(req_ids.data_ptr(), num_tokens.data_ptr(), b, cd):
                _raise_overlap(code, ("req_ids", "num_tokens"))
        return call

    def flashinfer_csr(self, req_ids, indptr, indices, last_page_len):
        memo = CsrMemo(req_ids.numel(), indices.numel(), indices.device)  # a fresh memo: re-pads every entry
        self.flashinfer_csr_into((indptr, indices, last_page_len), memo)(req_ids, req_ids.numel())

    def flashinfer_csr_into(self, csr, memo):
        cd = _with_ranges(call_descriptor(self.td, self.sd, csr=csr, memo=memo), self._written(*csr, memo.held))
        run, held = guard_point(csr_guarded, _i64, _i64, _desc), (self._held, _storages(*csr, memo.held))

        def call(req_ids, b, held=held):  # ``held``: what ``cd`` points into
            if run(req_ids.data_ptr(), b, cd):
                _raise_overlap(1, ("req_ids",))
        return call

    def step_into(self, res, memo):
        cd = _with_ranges(call_descriptor(self.td, self.sd, slots=res.slots, ok=res.ok, csr=res.csr, memo=memo,
                                          meta=res.metadata),
                          self._written(res.slots, res.ok, *res.csr, *res.metadata, memo.held))
        run, held = guard_point(step_guarded, _i64, _i64, _i64, _desc), (
            self._held, _storages(res.slots, res.ok, *res.csr, *res.metadata, memo.held))
        with_release = []  # compiled at the first step that releases requests too

        def call(req_ids, num_tokens, b, release=None, cache=False, held=held):  # ``held``: what ``cd`` points into
            if release is None:
                code = run(req_ids.data_ptr(), num_tokens.data_ptr(), b, cd)
            else:
                if not with_release:
                    with_release.append(guard_point(step_release_guarded, _i64, _i64, _flag, _i64, _i64, _i64, _desc))
                code = with_release[0](release.data_ptr(), release.numel(), cache, req_ids.data_ptr(),
                                       num_tokens.data_ptr(), b, cd)
            if code:
                _raise_overlap(code, ("req_ids", "num_tokens", "release"))
        return call

    def bind_step(self, res, memo, req_ids, num_tokens, b, release=None, cache=False):
        cd = call_descriptor(self.td, self.sd, slots=res.slots, ok=res.ok, csr=res.csr, memo=memo,
                             inputs=(req_ids, num_tokens), meta=res.metadata)
        entry = step.step_bound_numba_entry
        if release is not None:  # released first, then set to -1, in the same kernel call
            cd[L.CD_RELEASE], cd[L.CD_RELEASE_LEN], cd[L.CD_RELEASE_CACHE] = _addr(release), release.numel(), cache
            entry = step.step_release_bound_numba_entry
        run = functools.partial(entry_point(entry, _i64), cd.ctypes.data)  # one int
        run.held = (cd, self._held, _storages(res.slots, res.ok, *res.csr, *res.metadata, memo.held, req_ids,
                                              num_tokens, release))  # everything cd points into
        return run

    def release(self, req_ids, cache):
        if self._release is None:
            self._release = entry_point(release.release_numba_entry, _i64, _i64, _flag, _desc)
        self._release(req_ids.data_ptr(), req_ids.numel(), cache, self.cd)

    def truncate(self, req_ids, new_lens, drop=False):
        kernel(release.truncate_numba_entry)(req_ids.data_ptr(), new_lens.data_ptr(), req_ids.numel(), bool(drop),
                                             self.cd)

    def fork(self, src_ids, dst_ids, lens, ok, cow_src, cow_dst):
        kernel(fork.fork_numba_entry)(src_ids.data_ptr(), dst_ids.data_ptr(), lens.data_ptr(), dst_ids.numel(),
                                      ok.data_ptr(), cow_src.data_ptr(), cow_dst.data_ptr(), self.cd)

    def revive(self, row, pages, memos=(), gens=None):
        if (calls := self._revive) is None:  # (entry_point's lookup costs ~1 us a call: looked up once)
            calls = self._revive = (entry_point(revive.forget_row_numba, _i64, _i64, _i64, _desc),
                                    entry_point(revive.revive_numba_entry, _i64, _i64, _i64, _i64, _desc))
        forget, run = calls
        if memos and 0 <= row < self.ts.max_requests:  # as restamp_rows(row): the memos forget it before its stamp
            for memo in memos:
                forget(memo.held.data_ptr(), memo.batch, row, self.td)
        run(row, pages.data_ptr(), 0 if gens is None else gens.data_ptr(), pages.numel(), self.cd)  # 0: no gens

    def block_table_rows(self, req_ids, out):
        kernel(block_table_rows.block_table_rows_numba_entry)(req_ids.data_ptr(), req_ids.numel(), out.data_ptr(),
                                                              self.cd)

    def restamp_rows(self, req_ids=None, memos=()):
        if req_ids is None:
            kernel(restamp_table)(self.td)
            return
        for memo in memos:  # before the version changes: forget() compares with the current one
            memo.forget(req_ids, self.ts.version)
        kernel(stamp_rows)(self.td, req_ids.data_ptr(), req_ids.numel())
