"""State types: a pool's tensors, a table's tensors, and a CSR buffer set's memo.

Note: every tensor here is allocated once and never reallocated or rebound by
a hot-path call, so the addresses a captured CUDA graph (or a numba
descriptor) recorded stay valid for the owner's lifetime.

* Pool: page ``i`` is in exactly one state (``page_state[i]``): FREE (its id
  sits in ``free_stack[:counters[FREE_COUNT]]``), USED (``refcount[i] >= 1``)
  or CACHED (``refcount[i] == 0``, content kept, evictable, LRU stamp in
  ``stamp[i]``, and a live entry in the LRU queue ``lru_queue``, which eviction pops). The
  stack is popped from the top: a fresh pool hands out
  pages 0, 1, 2, ...
  ``page_gen[i]`` counts the times page ``i`` became FREE (mod 2**31): a prefix-cache entry
  that recorded it finds out whether its pages were freed (and maybe handed out again) since.
* Table: ``block_table[r, :ceil(seq_lens[r] / page_size)]`` are request
  ``r``'s pages in token order, every entry past them is -1; the table holds
  one pool reference per entry.
* Threads: every call on a pool or its tables is atomic with respect to other
  threads (``PoolState.lock`` on reference and triton, the GIL on numba). The sync
  points read under ``PoolState.lock`` on every backend, on a CPU through one copy that
  keeps the GIL (:func:`copy_between_calls`), and a table's books of its output buffers
  change under it (:mod:`tpool.buffers`).
* Scratch tensors (``claim``, ``occur``, ``keys``, ``lane_end``) carry nothing
  between calls: ``claim`` is INT32_MAX and ``occur`` 0 whenever no call runs. The pool's ``occur`` and
  ``claim`` are also reset for an operation's pages before it counts them, so a value left there
  changes no result; a table's ``claim`` takes part as a lane would (README, "Bad input and bad state").
* On a CPU every tensor here (and every output buffer a pool or table makes) is made by
  :func:`fixed_full`, over numpy memory: torch refuses to resize it, so no hand edit can
  free the memory a numba descriptor points into.
"""

import threading
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch

from tpool.errors import InvariantViolation
from tpool.kernels import layout as L
from tpool.kernels.layout import INT32_MAX


_NUMPY_DTYPES = {torch.int8: np.int8, torch.int32: np.int32, torch.int64: np.int64, torch.bool: np.bool_}


def set_cell(t: torch.Tensor, i: int, value) -> None:
    """``t[i] = value`` as a fill of a one-element view: one kernel that takes the value as its
    argument, the same inside CUDA-graph capture, whatever path torch's indexing takes for a
    Python number (on a device it makes the number there, ``at::scalar_tensor``, then copies)."""
    t.narrow(0, i, 1).fill_(value)


def held_view(t: torch.Tensor | None) -> torch.Tensor | None:
    """A new view of ``t``'s memory (None for None), for a backend to keep: re-pointing ``t`` by
    hand (``t.set_(...)``, ``t.data = ...``) moves ``t`` but not the view, so a kernel keeps the
    memory and the size it was given, on every backend (numba's descriptors hold addresses
    anyway). The view keeps that memory alive."""
    return None if t is None else t.view(t.shape)


class SetOnce:
    """Public attributes set once, in ``__init__``: kernels are bound to the buffers and sizes they
    name (a batch, a capacity), so assigning another value would make a later call check its inputs
    against a size its buffers do not have. Private (``_``) attributes stay writable."""

    __slots__ = ()

    def __setattr__(self, name, value):
        if name[0] != "_" and hasattr(self, name):
            raise AttributeError(f"{type(self).__name__}.{name} is read-only: the calls bound to this object "
                                 f"rely on it; make a new {type(self).__name__} for other sizes or buffers")
        object.__setattr__(self, name, value)


def fixed_full(shape, fill, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.full(shape, fill)`` for memory that kernels keep the address of.

    On a CPU the tensor is over a numpy array (``torch.from_numpy``): its storage is not
    resizable, so ``resize_`` past its size and ``untyped_storage().resize_`` raise instead
    of freeing the memory that numba descriptors (and the tensor's other views) point
    into. The numba backend also holds each such storage, so ``set_`` cannot free it
    either. On CUDA torch has no such storage: a plain ``torch.full`` (do not resize a
    pool's or table's tensors there: a captured graph holds their addresses).

    Never an inference tensor, whatever mode the caller is in: a pool or table made under
    ``torch.inference_mode()`` (an engine's set-up often is) is written in place by every
    later call, and torch refuses an in-place update of an inference tensor outside that mode.
    """
    device = torch.device(device)
    with torch.inference_mode(False):
        if device.type == "cpu":
            return torch.from_numpy(np.full(shape, fill, dtype=_NUMPY_DTYPES[dtype]))
        return torch.full(shape if isinstance(shape, tuple) else (shape,), fill, dtype=dtype, device=device)


@dataclass(frozen=True)
class _Tensors:
    def tensors(self) -> dict:
        """Every state tensor by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    def held(self):
        """The same state over :func:`held_view` s of its tensors (and the same lock): what a backend
        is made with, so a state tensor re-pointed by hand is not followed by any kernel."""
        return replace(self, **{name: held_view(t) for name, t in self.tensors().items()})

    def check_held(self, held: "_Tensors", owner: str) -> None:
        """Raise :class:`InvariantViolation` naming the first tensor re-pointed by hand (``set_``,
        ``.data =``) away from ``held`` (what the kernels run on, :meth:`held`): a sync point that
        checked it would check memory no call reads or writes."""
        for name, t in self.tensors().items():
            h = getattr(held, name)
            if _where(t) != _where(h):
                raise InvariantViolation(
                    f"invariant broken: {owner}'s state tensor {name!r} was re-pointed by hand (set_ or .data =): "
                    f"it is {_described(t)}, its calls run on {_described(h)} and never follow such an edit, "
                    f"so checking it would check memory no call uses")


def _where(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.dtype, t.device, tuple(t.shape), t.stride()


def _described(t: torch.Tensor) -> str:
    return f"{t.dtype} {tuple(t.shape)} at {t.data_ptr():#x} on {t.device}"


class CallLock:
    """The lock held around every call on a pool or its tables (reentrant: a step holds it
    around its extend and export). On a CUDA pool it also makes the pool's device the
    current one for the call: Triton launches on the current device, whatever device the
    tensors it is given live on, so a pool on ``cuda:1`` must not run with ``cuda:0`` current."""

    __slots__ = ("_lock", "_index", "_restore")

    def __init__(self, device: torch.device | None = None):
        self._lock = threading.RLock()
        self._index = device.index if device is not None and device.type == "cuda" else None
        self._restore = []  # per nesting level: the device to make current again, or None

    def __enter__(self):
        self._lock.acquire()
        try:  # a failing device switch must not leave the lock held (no __exit__ follows)
            prev = None
            if self._index is not None and torch.cuda.current_device() != self._index:
                prev = torch.cuda.current_device()
                torch.cuda.set_device(self._index)
            self._restore.append(prev)
        except BaseException:
            self._lock.release()
            raise
        return self

    def __exit__(self, *exc):
        prev = self._restore.pop()
        try:
            if prev is not None:
                torch.cuda.set_device(prev)
        finally:
            self._lock.release()


@dataclass(frozen=True)
class PoolState(_Tensors):
    """Tensors of one pool; all on one device, shapes fixed by ``num_pages``."""

    num_pages: int
    free_stack: torch.Tensor  # int32 [num_pages]
    refcount: torch.Tensor    # int32 [num_pages]
    page_state: torch.Tensor  # int8  [num_pages]: FREE / USED / CACHED
    stamp: torch.Tensor       # int64 [num_pages]: clock at last release or touch
    page_gen: torch.Tensor    # int32 [num_pages]: +1 (wrapping in [0, INT32_MAX]) whenever the page becomes FREE
    counters: torch.Tensor    # int64 [NUM_COUNTERS], slots in tpool.kernels.layout
    checked: torch.Tensor     # int64 [NUM_COUNTERS]: the counters as the last check() read them (no kernel
    #                           touches it; kept with the state, so a restored snapshot restores it too)
    claim: torch.Tensor       # int32 [num_pages] scratch, INT32_MAX between calls
    occur: torch.Tensor       # int32 [num_pages] scratch, 0 between calls
    keys: torch.Tensor        # int64 [num_pages] scratch (release and truncate on numba)
    lru_queue: torch.Tensor   # int32 [LRU_FACTOR * num_pages], a ring: CACHED pages in eviction order, with
    #                           stale entries between (positions in counters LRU_HEAD..LRU_SCAN, kernels.layout)
    lru_pos: torch.Tensor     # int64 [num_pages]: where each page's latest entry in lru_queue is (-1: none yet)
    # Held by the reference and triton backends around every call on this pool or its tables, so
    # two threads never interleave inside one; numba calls hold the GIL instead (tpool.backends).
    lock: CallLock = field(default_factory=CallLock, compare=False, repr=False)

    @classmethod
    def create(cls, num_pages: int, device: torch.device) -> "PoolState":
        i32 = dict(dtype=torch.int32, device=device)
        counters = fixed_full(L.NUM_COUNTERS, 0, torch.int64, device)
        set_cell(counters, L.FREE_COUNT, num_pages)
        free_stack = fixed_full(num_pages, 0, torch.int32, device)
        free_stack.copy_(torch.arange(num_pages - 1, -1, -1, **i32))  # popped from the top: pages 0, 1, 2, ...
        return cls(
            num_pages=num_pages,
            free_stack=free_stack,
            refcount=fixed_full(num_pages, 0, torch.int32, device),
            page_state=fixed_full(num_pages, 0, torch.int8, device),
            stamp=fixed_full(num_pages, 0, torch.int64, device),
            page_gen=fixed_full(num_pages, 0, torch.int32, device),
            counters=counters,
            checked=fixed_full(L.NUM_COUNTERS, 0, torch.int64, device),
            claim=fixed_full(num_pages, INT32_MAX, torch.int32, device),
            occur=fixed_full(num_pages, 0, torch.int32, device),
            keys=fixed_full(num_pages, 0, torch.int64, device),
            lru_queue=fixed_full(L.LRU_FACTOR * num_pages, L.NULL_PAGE, torch.int32, device),
            lru_pos=fixed_full(num_pages, -1, torch.int64, device),
            lock=CallLock(counters.device),
        )


def copy_between_calls(pairs) -> None:
    """``dst.copy_(src)`` for every ``(dst, src)`` pair of same-shape contiguous tensors, with no pool
    call of another thread landing between two copies or inside one.

    Callers hold the pools' locks, which every call on the reference and Triton backends takes.
    A numba call takes none: it keeps the GIL while it runs, and torch's copies release it. So on
    a CPU the copies are one numba call that keeps the GIL too (``kernels._numba_util.copy_spans``).
    """
    global _copy_spans
    pairs = list(pairs)
    if not all(d.is_cpu and s.is_cpu for d, s in pairs):
        for dst, src in pairs:
            dst.copy_(src)
        return
    for dst, src in pairs:
        if not (dst.is_contiguous() and src.is_contiguous() and dst.dtype == src.dtype and dst.shape == src.shape):
            raise ValueError(f"copy_between_calls: expected contiguous tensors of one dtype and shape, got "
                             f"{dst.dtype} {tuple(dst.shape)} and {src.dtype} {tuple(src.shape)}")
    if _copy_spans is None:
        from tpool.backends.numba import copy_spans  # (numba, imported when first needed)
        _copy_spans = copy_spans()
    desc = np.array([x for d, s in pairs for x in (d.data_ptr(), s.data_ptr(), s.nbytes)], dtype=np.int64)
    _copy_spans(desc.ctypes.data, len(pairs))


_copy_spans = None  # the compiled copy, fetched at the first copy_between_calls on a CPU


def clones_between_calls(tensors) -> list:
    """Copies of ``tensors``, all taken between two pool calls (:func:`copy_between_calls`)."""
    tensors = list(tensors)
    copies = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    copy_between_calls(zip(copies, tensors))
    return copies


def pool_state_bytes(num_pages: int) -> int:
    """Bytes of a ``num_pages``-page pool's state tensors (``PagePool.memory_bytes()["state_bytes"]``
    before any free group is made), read off the layout on the meta device: nothing is allocated."""
    return sum(t.nbytes for t in PoolState.create(num_pages, torch.device("meta")).tensors().values())


@dataclass(frozen=True)
class TableState(_Tensors):
    """Tensors of one page table, on its pool's device."""

    max_requests: int
    max_pages: int
    page_size: int
    block_table: torch.Tensor  # int32 [max_requests, max_pages], -1 past each length
    seq_lens: torch.Tensor     # int32 [max_requests], tokens per request
    claim: torch.Tensor        # int32 [max_requests] scratch, INT32_MAX between calls
    lane_end: torch.Tensor     # int32 [max_batch] scratch (triton): per-lane ends of a call's page list
    version: torch.Tensor      # int64 [2] (numba): which contents the table has (a step's CSR memo names it),
    #                            and the version a step made them from, else -1 (layout.VERSION_CELLS)
    row_version: torch.Tensor  # int64 [max_requests] (numba): version of the call that last changed each row's pages

    @classmethod
    def create(cls, max_requests: int, max_pages: int, page_size: int, max_batch: int,
               device: torch.device) -> "TableState":
        ts = cls(
            max_requests=max_requests, max_pages=max_pages, page_size=page_size,
            block_table=fixed_full((max_requests, max_pages), L.NULL_PAGE, torch.int32, device),
            seq_lens=fixed_full(max_requests, 0, torch.int32, device),
            claim=fixed_full(max_requests, INT32_MAX, torch.int32, device),
            lane_end=fixed_full(max(max_batch, 1), 0, torch.int32, device),
            version=fixed_full(L.VERSION_CELLS, -1, torch.int64, device),
            row_version=fixed_full(max_requests, 0, torch.int64, device),
        )
        set_cell(ts.version, L.VERSION_NOW, 0)  # a fresh table: version 0, made by no step
        return ts


def table_state_bytes(max_requests: int, max_pages: int, max_batch: int) -> int:
    """Bytes of the state tensors of a ``PageTable(pool, max_requests, max_pages)`` on a pool of
    ``max_batch`` (``TableState``: the block table, the lengths, per-row and per-lane scratch;
    ``PageTable.memory_bytes()`` of a fresh table), read off the layout on the meta device like
    :func:`pool_state_bytes`: nothing is allocated. Not its call shapes' output buffers."""
    ts = TableState.create(max_requests, max_pages, 1, max_batch, torch.device("meta"))
    return sum(t.nbytes for t in ts.tensors().values())


class CsrMemo(SetOnce):
    """The bookkeeping kept with one set of CSR output buffers (one per call shape).

    ``tensor`` is int64 ``[layout.memo_len(B)]`` on the table's device, read and
    written by the kernels (slots ``MEMO_*`` in :mod:`tpool.kernels.layout`):

    * ``MEMO_WRITTEN``: how far the last export into ``indices`` wrote, so the
      next export re-pads only that far (every backend);
    * ``MEMO_VERSION``: the table version whose CSR the buffers hold, -1 if none,
      and ``MEMO_IDS``: the batch it is for. A numba step whose batch and version
      match grows the CSR in place instead of rebuilding it (``kernels/step.py``);
    * then scratch where a numba step's extend notes the lanes it gave pages (and where a step
      that keeps runs of an older CSR then writes the blocks it moves);
    * then the tails (from ``memo_tails(B)``): each lane's ``(last page << 32) | length``
      after the last numba step, which the next step of the batch reads instead of the
      table's rows while the version and the batch match;
    * then the stamps (from ``memo_stamps(B)``): each lane's ``row_version`` when the
      step wrote the CSR. While ``MEMO_VERSION`` is not -1, a numba step of any batch on
      these buffers keeps (moves) the run of every request it finds in the old batch (in
      order, at most ``KEEP_LOOKAHEAD`` old lanes past the previous one found) whose row
      still has its stamp, and copies only the pages outside kept runs from the table (the
      old runs' lengths come from the tails);
    * then scratch for that step's plan, and for the last page of each run it keeps (from
      ``memo_kept(B)``), which its decode lanes inside that page take instead of reading the row.

    Everything but the kernels goes through this class. The kernels, and this class's own reads
    and writes, use ``held``, a view of ``tensor`` as made (:func:`held_view`): ``tensor``
    re-pointed by hand is not followed.
    """

    __slots__ = ("batch", "csr", "tensor", "held", "__weakref__")

    def __init__(self, batch: int, capacity: int, device: torch.device, csr=None):
        self.batch, self.csr = batch, csr  # csr: the buffers it describes (check_invariants reads them)
        self.tensor = fixed_full(L.memo_len(batch), -1, torch.int64, device)
        self.held = held_view(self.tensor)
        set_cell(self.tensor, L.MEMO_WRITTEN, capacity)  # a fresh indices buffer is -1 throughout

    @classmethod
    def over(cls, batch: int, tensor: torch.Tensor, csr=None) -> "CsrMemo":
        """A memo over the given tensors, allocating nothing (a copy that a check reads)."""
        memo = cls.__new__(cls)
        memo.batch, memo.csr, memo.tensor, memo.held = batch, csr, tensor, held_view(tensor)
        return memo

    def invalidate(self) -> None:
        """Make the next step on these buffers rebuild the CSR instead of growing it or keeping runs of it."""
        set_cell(self.held, L.MEMO_VERSION, -1)

    def forget(self, req_ids: torch.Tensor, version: torch.Tensor) -> None:
        """Keep no run of the rows ``req_ids`` (written by hand), whatever version comes back.

        A snapshot taken between the edit and ``PageTable.invalidate_csr(rows)`` carries the
        edited pages under their old stamps and version; restored, it must not let these
        buffers keep or grow the old runs of those rows. Their lanes' stamps become -1, and a
        memo version equal to either of the table's ``version`` cells (int64
        ``[VERSION_CELLS]``: the version, and the one the step that made it came from, whose
        CSR a step grows in place too, or -1 when no step made it) becomes -2, never a table
        version: no growth in place, while the other lanes' runs can still be kept. A memo at
        -1 (it holds no CSR a step may reuse) stays -1: as -2 its runs could be kept. Tensor ops
        only, no scalar read (``HostMirror.revive`` calls this on its hot path).
        """
        m, b = self.held, self.batch
        at = L.memo_stamps(b)
        named = (m[L.MEMO_IDS:L.MEMO_IDS + b, None] == req_ids.to(torch.int64)[None, :]).any(1)
        m[at:at + b].masked_fill_(named, -1)
        v = m[L.MEMO_VERSION:L.MEMO_VERSION + 1]
        named_version = ((v == version) & (version >= 0)).any(0, keepdim=True)  # -1: no version (layout)
        v.copy_(torch.where(named_version, torch.full_like(v, -2), v))

    def growable_batch(self, version: int, appended_from: int = -1) -> tuple[list, list] | None:
        """``(request ids, tails)`` the next step may grow the CSR of in place and read lengths
        and last pages from, if the buffers hold the CSR of table version ``version``, or of
        ``appended_from`` (>= 0), the version the step that made ``version`` came from (a step
        only appends: two ``StepOut`` buffers taking turns); else None. Each tail is
        ``(last page, length)``. A sync point (for ``check_invariants``)."""
        memo = self.held.tolist()
        if memo[L.MEMO_VERSION] != version and (appended_from < 0 or memo[L.MEMO_VERSION] != appended_from):
            return None
        at = L.memo_tails(self.batch)
        return memo[L.MEMO_IDS:L.MEMO_IDS + self.batch], [(w >> 32, w & 0xFFFFFFFF) for w in memo[at:at + self.batch]]

    def _reusable(self):
        """``(ids, tails, stamps)`` of the CSR these buffers hold, as lists, or None when no step may
        reuse it (``MEMO_VERSION`` is -1). A sync point."""
        memo, b = self.held.tolist(), self.batch
        if memo[L.MEMO_VERSION] == -1:
            return None
        tails, stamps = L.memo_tails(b), L.memo_stamps(b)
        return memo[L.MEMO_IDS:L.MEMO_IDS + b], memo[tails:tails + b], memo[stamps:stamps + b]

    def kept_lanes(self, ids: list, row_version: list) -> list:
        """The lanes of batch ``ids`` whose run a numba step would keep from the CSR these buffers
        hold, picked as ``kernels/step.py: plan_kept_runs`` picks them: the request was in the old
        batch at most ``KEEP_LOOKAHEAD`` lanes past the previous match, and its row still has its
        stamp. A sync point."""
        held = self._reusable()
        if held is None:
            return []
        old, _, stamps = held
        kept, j = [], 0
        for i, r in enumerate(ids):
            if not 0 <= r < len(row_version):
                continue
            for jj in range(j, min(j + L.KEEP_LOOKAHEAD, self.batch)):
                if old[jj] == r:
                    if stamps[jj] > 0 and stamps[jj] == row_version[r]:
                        kept.append(i)
                    j = jj + 1
                    break
        return kept

    def kept_runs(self, row_version: list, page_size: int) -> list:
        """``(request, start, pages)`` of every run of the CSR these buffers hold that a numba step
        would keep for a lane naming that request (its row still has the stamp the memo noted), in
        lane order; ``start`` is where the run begins in ``indices``. Empty when the buffers
        hold no CSR a step may reuse. A sync point (for ``check_invariants`` and tests)."""
        held = self._reusable()
        runs, start = [], 0
        for r, tail, stamp in zip(*held) if held is not None else ():
            if 0 <= r < len(row_version):
                pages = -(-(tail & 0xFFFFFFFF) // page_size)
                if stamp > 0 and stamp == row_version[r]:
                    runs.append((r, start, pages))
                start += pages
        return runs
