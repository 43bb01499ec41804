"""Table-owned output buffers: one set per call shape, a bounded number of shapes kept.

Note (what a loop should know):

* A call of a new shape (batch size, ``max_tokens``, ``capacity``) makes its
  output buffers and binds the backend's call to them; later calls of that
  shape reuse them, which is what a CUDA graph needs (the addresses it
  recorded stay valid). A loop should bucket its shapes: pad the batch to a
  few sizes (e.g. powers of two, or the sizes it captured graphs for) and
  pass a fixed ``max_tokens`` per bucket, so a handful of shapes serve it.
* At most ``max_shapes`` shapes are kept (least recently used first out).
  A shape used while a CUDA graph was being captured is pinned: it is never
  dropped, since the graph writes its buffers on every replay. A dropped
  shape's buffers stay alive as long as something else holds them (a
  :class:`~tpool.bound_step.BoundStep`, a result the caller kept). A
  ``HostMirror`` hears of each dropped shape (``on_drop``) and lets its decode
  steps of that shape go, so they never write buffers the table no longer returns;
  so does the table itself, for the binding of a repeated ``step``.
* Every entry also knows the storages its call writes (the pool's and the
  table's state, and its own buffers), so an input that shares memory with
  one of them is refused before the call (``_checks.check_not_written``).
* Threads: what changes the set of shapes (making a shape's buffers, dropping
  shapes, pinning, the memo set) runs under the pool's lock (``lock``, the
  reentrant ``PoolState.lock``). The hit path (:meth:`ShapeBuffers.get` of a
  kept shape, a table call's common case) takes no lock: it is single dict
  operations, atomic under the GIL, and a shape another thread dropped meanwhile
  is no error (the call runs on the entry it found, which holds its buffers).
"""

import collections
import weakref

import torch

from tpool import _checks

DEFAULT_MAX_SHAPES = 64  # call shapes a table keeps buffers for


class Entry(tuple):
    """``(result, call, memo, written)``: the output buffers, the backend call bound to them (or
    None), their :class:`~tpool.state.CsrMemo` (or None), and the storages the call writes."""

    __slots__ = ()

    def __new__(cls, result, call, memo, written):
        return super().__new__(cls, (result, call, memo, written))


class ShapeBuffers:
    """The output buffers of one table (see the module note)."""

    def __init__(self, device: torch.device, max_shapes: int, written: "_checks.Written", lock):
        self.device, self.max_shapes, self.written, self.lock = device, max_shapes, written, lock
        self._cuda = device.type == "cuda"
        self.entries = collections.OrderedDict()  # call key -> Entry, least recently used first
        self.buffers = {}                         # buffer key -> buffers (shared by call shapes)
        self.uses = {}                            # call key -> the buffer keys its entry uses
        self.pinned = set()                       # call keys used inside CUDA graph capture
        self.memos = weakref.WeakSet()            # every CSR memo still alive (invalidate_csr reaches all)
        self.listeners = []                       # weak methods told each call key dropped (on_drop)

    def get(self, key):
        """The entry of call shape ``key``, or None; marks it most recently used. No lock: see the
        module note (a call of a new shape then goes to :meth:`make`, which takes it)."""
        entry = self.entries.get(key)
        if entry is not None:
            try:
                self.entries.move_to_end(key)
            except KeyError:  # another thread dropped it since: the entry still holds its buffers
                pass
            if self._cuda and torch.cuda.is_current_stream_capturing():
                self.pin(key)
        return entry

    def make(self, key, build):
        """The entry of call shape ``key``: :meth:`get`'s, or ``build()``'s (which calls :meth:`buffer`
        and :meth:`add`), under the lock, so another thread neither makes it twice nor drops the
        buffers ``build`` takes before its entry holds them."""
        with self.lock:
            entry = self.get(key)
            return build() if entry is None else entry

    def pin(self, key) -> None:
        """Never drop call shape ``key`` (used inside CUDA graph capture), if it is kept now."""
        with self.lock:
            if key in self.entries:
                self.pinned.add(key)

    def buffer(self, key, make):
        """The buffer set ``key``, made by ``make()`` on first use (never inside graph capture).
        Called under the lock (from :meth:`make`'s ``build``)."""
        bufs = self.buffers.get(key)
        if bufs is None:
            if self._cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"PageTable: the first call of shape {key} is inside CUDA graph capture; run "
                                   "each call shape once before capturing (tpool.graphs.capture does that)")
            bufs = self.buffers[key] = make()
        return bufs

    def add(self, key, uses, result, call=None, memo=None) -> Entry:
        """Record the entry of call shape ``key`` built on the buffer sets ``uses``; drop the least
        recently used unpinned shapes past ``max_shapes``. Called under the lock (:meth:`make`)."""
        if memo is not None:
            self.memos.add(memo)
        tensors = [t for k in uses for t in _tensors(self.buffers[k])]
        entry = self.entries[key] = Entry(result, call, memo, self.written | _checks.written_storages(tensors))
        self.uses[key] = uses
        if self._cuda and torch.cuda.is_current_stream_capturing():
            # a new entry over buffers other shapes made first (a step over existing CSR and output sets)
            # is captured as well: never drop it, as get() pins one captured again (helper-110's audit)
            self.pinned.add(key)
        self._shrink(keep=key)
        return entry

    def add_memo(self, memo) -> None:
        """Let :meth:`memo_list` reach ``memo`` (a ``StepOut``'s) while it lives."""
        with self.lock:
            self.memos.add(memo)

    def memo_list(self) -> list:
        """Every CSR memo alive now (the table's, and every live ``StepOut``'s and ``BoundStep``'s)."""
        with self.lock:  # a WeakSet changed while another thread iterates it raises
            return list(self.memos)

    def on_drop(self, method) -> None:
        """Call ``method(key)`` (a bound method, held weakly) for every call shape dropped from now on,
        under the lock."""
        with self.lock:
            self.listeners.append(weakref.WeakMethod(method))

    def pin_all(self) -> None:
        """Pin every shape kept now (``tpool.graphs.capture`` does this after capturing)."""
        with self.lock:
            self.pinned.update(self.entries)

    def _shrink(self, keep):
        # Under the lock; list() copies the keys in one C call: a get() on another thread may reorder
        # them meanwhile (move_to_end), which would break an iteration of the dict itself.
        for key in [k for k in list(self.entries) if k not in self.pinned and k != keep]:
            if len(self.entries) <= self.max_shapes:
                break
            del self.entries[key]
            self.uses.pop(key)
            for ref in list(self.listeners):
                method = ref()
                if method is None:
                    self.listeners.remove(ref)
                else:
                    method(key)
        live = {b for uses in self.uses.values() for b in uses}
        for b in [b for b in self.buffers if b not in live]:
            del self.buffers[b]


def _tensors(bufs):
    if isinstance(bufs, torch.Tensor):
        return [bufs]
    if hasattr(bufs, "tensor"):  # a CsrMemo
        return [bufs.tensor]
    return [t for x in bufs for t in _tensors(x)]
