"""Test helpers for engines that embed tpool: a host-sync guard, and two aids for serving tests
(``peak_alloc_bytes``, ``without_logits_to_keep``).

Note: torch has no CPU equivalent of ``torch.cuda.set_sync_debug_mode``, so
``no_host_sync()`` builds one. Inside it, any construct that would make the
host wait for the device raises :class:`HostSyncError`:

* ops seen by a ``TorchDispatchMode``: ``aten._local_scalar_dense``
  (``.item()``, ``bool(t)``, ``int(t)``, ``float(t)``), ``is_nonzero``,
  ``nonzero``/``argwhere``, ``unique`` in all forms, ``masked_select``,
  boolean-mask indexing (``t[mask]``, ``t[mask] = v``), ``bincount``,
  ``repeat_interleave`` without ``output_size``, ``equal``, ``allclose``
  (a host bool), ``isin`` (its sorting path runs ``unique``) and ``histc``
  without a range (its CUDA kernel reads the min and max);
* methods that read memory without dispatch, patched while any guard is
  active: ``Tensor.tolist``, ``Tensor.numpy``, ``Tensor.cpu``,
  ``Tensor.item``, ``torch.tensor`` / ``torch.as_tensor`` / ``torch.asarray``
  / ``Tensor.new_tensor`` of a list or tuple holding tensors (each read one
  by one, past the dispatcher), and of any host data for a guard with
  ``host_data=True``. (The legacy constructors, ``torch.LongTensor(list)``,
  ``t.new(list)`` and the like, are not patched.)

An op whose own kernel reads the device inside (as ``isin`` and ``histc``
do) is seen only if listed here. ``t.to("cpu")`` is not refused: on a CPU it
cannot be told from ``t.to(device)`` of a tensor staying on its device (on
CUDA, ``set_sync_debug_mode("error")`` sees it). A host snapshot
(:class:`tpool.stats_async.AsyncRead`) read before its ``ready()`` said True
is reported: on CUDA ``values()`` would wait for the copy.

Wrap every hot-path call in it; read results after the block.
``count_host_reads()`` is the same guard counting reads instead of raising
(to check that a whole loop reads the device only at its sync points). Under
``TRITON_INTERPRET=1`` the interpreter stands in for the GPU and copies
kernel arguments to numpy around each launch; those copies are the simulated
device's, not the host's, so the guard is suspended inside a launch (but not in a
callable grid, which a GPU launch runs on the host).

Threads: a guard sees only the thread that entered it. The patches are
installed by the first guard entered in the process and removed by the last
one to exit (a count under a lock), whatever the order in which threads
leave; the patched functions ask the calling thread's stack of active guards
what to do. A thread with no active guard runs the original functions, and a
thread's innermost guard decides whether a read raises or is counted and
whether host data counts (a ``count_host_reads`` inside a ``no_host_sync``
counts; a ``no_host_sync`` inside it raises). The dispatch mode is entered
once per thread, by its outermost guard (torch keeps its mode stack per
thread), and the simulated-launch depth is per thread too.
"""

import contextlib
import functools
import os
import threading
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tpool.stats_async import HOST_SNAPSHOT_ATTR

aten = torch.ops.aten


class HostSyncError(RuntimeError):
    """A host read of device data happened inside ``no_host_sync()``."""


_BANNED = {
    aten._local_scalar_dense: "a scalar read (.item(), bool(t), int(t))",
    aten.is_nonzero: "bool(t)",
    aten.nonzero: "nonzero (data-dependent shape)",
    aten.masked_select: "masked_select (data-dependent shape)",
    aten.bincount: "bincount (data-dependent shape)",
    aten.equal: "torch.equal (returns a host bool)",
    aten.allclose: "torch.allclose (returns a host bool)",
    aten.isin: "isin (its sorting path runs unique)",
    aten._unique: "unique", aten._unique2: "unique", aten.unique_dim: "unique",
    aten.unique_consecutive: "unique_consecutive",
}
_MASK_INDEX = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
_METHODS = ("tolist", "numpy", "cpu", "item")  # Tensor methods that read memory without dispatch
_BUILDERS = ("tensor", "as_tensor", "asarray")  # torch functions that copy host data
_NEW = ("new_tensor",)                          # Tensor methods that do


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _histc_range(args, kwargs):
    """``(min, max)`` of an ``aten.histc`` call (defaults 0, 0: the data's own range)."""
    rest = list(args[2:4]) + [0, 0]
    return kwargs.get("min", rest[0]), kwargs.get("max", rest[1])


def _banned(func, args, kwargs):
    """What makes ``func`` a host sync (a phrase), or None."""
    packet = func.overloadpacket
    if packet in _BANNED:
        return _BANNED[packet]
    if packet is aten.repeat_interleave and kwargs.get("output_size") is None:
        return "repeat_interleave without output_size"
    if packet is aten.histc and _histc_range(args, kwargs) == (0, 0):
        return "histc without a range (reads the min and max)"
    if packet in _MASK_INDEX and _has_bool_index(args):
        return "boolean-mask indexing"
    return None


def _raise(what):
    raise HostSyncError(f"host sync on the hot path: {what}")


class _Active:
    """One active guard: how it reports a read, a snapshot read, and whether host data counts."""

    def __init__(self, report, on_snapshot, host_data):
        self.report, self.on_snapshot, self.host_data = report, on_snapshot, host_data


class _ThreadState(threading.local):
    def __init__(self):
        self.guards = []     # this thread's active guards, innermost last
        self.in_device = 0   # depth of simulated (interpreted) launches and of reads being made


_thread = _ThreadState()


def _innermost(guards):
    """The guard that decides for the calling thread, or None (no guard, or inside a launch or a read)."""
    return guards[-1] if guards and not _thread.in_device else None


class _Guard(TorchDispatchMode):
    """A thread's dispatch mode; its owner thread's innermost guard decides (also where torch carries
    the mode into a worker thread, as autograd does)."""

    def __init__(self, guards):
        super().__init__()
        self.guards = guards

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        guard = _innermost(self.guards)
        what = _banned(func, args, kwargs) if guard is not None else None
        if what is not None:
            guard.report(f"{what} ({func})")
        return func(*args, **kwargs)


def _read(name, original):
    """``Tensor.<name>`` reporting to the calling thread's innermost guard."""
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        guard = _innermost(_thread.guards)
        if guard is None:
            return original(self, *args, **kwargs)
        asked = getattr(self, HOST_SNAPSHOT_ATTR, None)  # host memory an AsyncRead filled: no device read
        if asked is not None and not asked[0]:
            guard.report(f"Tensor.{name}() of a host snapshot before its ready() said True (on CUDA it would "
                         f"wait for the copy)")
        elif asked is not None:
            if guard.on_snapshot is not None:
                guard.on_snapshot(f"Tensor.{name}() of a host snapshot")
        else:
            guard.report(f"Tensor.{name}()")
        _thread.in_device += 1  # the read itself (reached only when counting): its inner ops are not new reads
        try:
            return original(self, *args, **kwargs)
        finally:
            _thread.in_device -= 1
    return method


def _report_host_data(name, args, kwargs):
    """Report ``name`` (a builder) called with ``args`` and ``kwargs`` to the calling thread's innermost guard
    if its data (the first argument, or ``data=`` / ``obj=``, asarray's name) holds tensors it reads one by
    one, or if it is host data and that guard has ``host_data``."""
    guard = _innermost(_thread.guards)
    if guard is None or not (args or "data" in kwargs or "obj" in kwargs):
        return                                          # (no data: the builder's own TypeError follows)
    data = args[0] if args else kwargs.get("data", kwargs.get("obj"))
    if _holds_tensor(data):
        guard.report(f"{name}() of a list or tuple holding tensors (each is read to the host one by "
                     f"one, as .item() would; use torch.stack)")
    elif guard.host_data and not isinstance(data, torch.Tensor):
        guard.report(f"{name}() of host data (on CUDA a copy from pageable memory, which waits for "
                     f"the stream; use torch.full or a tensor made beforehand)")


def _from_host(owner: str, method: bool = False):
    """The wrapper of ``owner``'s builders (``torch.tensor`` / ``as_tensor`` / ``asarray``; with ``method``,
    ``Tensor.new_tensor``, whose first argument is the tensor it is called on) reporting a tensor built from
    Python data (not from a tensor) where the calling thread's innermost guard has ``host_data``."""
    def wrap(name, original):
        @functools.wraps(original)
        def build(*args, **kwargs):
            _report_host_data(f"{owner}.{name}", args[1:] if method else args, kwargs)
            return original(*args, **kwargs)
        return build
    return wrap


def _holds_tensor(data) -> bool:
    """Whether ``data``, a list or tuple (nested), holds a tensor: ``torch.tensor`` reads each to the host
    in C++, past the dispatcher the guard watches."""
    return isinstance(data, (list, tuple)) and any(
        isinstance(x, torch.Tensor) or isinstance(x, (list, tuple)) and _holds_tensor(x) for x in data)


def _device_region(name, original):
    """The interpreter's launch: the calling thread's guards are suspended inside it, except while it
    evaluates a callable grid (on a GPU the host does that, before the launch: a grid read from device
    data is a sync)."""
    @functools.wraps(original)
    def launch(executor, *args, **kwargs):
        grid = getattr(executor, "grid", None)   # (triton 3.x's name; another triton: the launch as it is)
        if callable(grid):
            executor.grid = _on_the_host(grid)
        _thread.in_device += 1
        try:
            return original(executor, *args, **kwargs)
        finally:
            _thread.in_device -= 1
            if callable(grid):
                executor.grid = grid
    return launch


def _on_the_host(grid):
    """A launch's grid callable, run with the calling thread's guards as they were before the launch."""
    @functools.wraps(grid)
    def evaluate(*args, **kwargs):
        _thread.in_device -= 1
        try:
            return grid(*args, **kwargs)
        finally:
            _thread.in_device += 1
    return evaluate


def _interpreter_executor():
    """Triton's interpreted launcher class when TRITON_INTERPRET asks for it and triton is loaded, else None."""
    import sys

    from tpool.kernels import _triton_shim
    if not _triton_shim.interpreting() or "triton" not in sys.modules:
        return None
    from triton.runtime import interpreter
    return interpreter.GridExecutor


_lock = threading.Lock()  # guards _users and _patched
_users = 0                # active guards, all threads together
_patched = {}             # (owner, name) -> what owner.__dict__ held before (_INHERITED: nothing)
_INHERITED = object()


def _patch_points():
    yield from ((torch.Tensor, name, _read) for name in _METHODS)
    yield from ((torch, name, _from_host("torch")) for name in _BUILDERS)
    yield from ((torch.Tensor, name, _from_host("Tensor", method=True)) for name in _NEW)
    executor = _interpreter_executor()
    if executor is not None:
        yield executor, "__call__", _device_region


def _install():
    """Count one more guard; patch what is not patched yet (triton may have loaded since the first)."""
    global _users
    with _lock:
        _users += 1
        for owner, name, wrap in _patch_points():
            if (owner, name) not in _patched:
                _patched[owner, name] = vars(owner).get(name, _INHERITED)
                setattr(owner, name, wrap(name, getattr(owner, name)))


def _uninstall():
    """Count one guard fewer; the last one out puts back what was there before the first one came in."""
    global _users
    with _lock:
        _users -= 1
        if _users:
            return
        for (owner, name), before in _patched.items():
            if before is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, before)
        _patched.clear()


@contextlib.contextmanager
def _guarded(report=_raise, on_snapshot=None, host_data=False):
    active = _Active(report, on_snapshot, host_data)
    guards = _thread.guards
    mode = contextlib.nullcontext() if guards else _Guard(guards)  # one mode per thread: its outermost guard's
    _install()
    guards.append(active)
    try:
        with mode:
            yield
    finally:
        guards.remove(active)
        _uninstall()


@contextlib.contextmanager
def no_host_sync(*, host_data: bool = False):
    """Raise :class:`HostSyncError` on any host read of tensor data inside the block.

    Sees the ops of the module note and the reads of ``Tensor.tolist``, ``numpy``,
    ``cpu`` and ``item`` made by the calling thread only: other threads, guarded or
    not, are not affected. Thread-safe and nestable: the innermost active guard of a
    thread decides (a :func:`count_host_reads` inside this block counts instead of
    raising, until it exits). The patches stay installed while any thread has a
    guard and the originals are back once the last one exits, also when a block
    raises. Reading a host snapshot that :class:`tpool.stats_async.AsyncRead` filled
    (what ``PagePool.stats_async().get()`` does) is a read of host memory and is
    allowed once its ``ready()`` has said True (before, on CUDA, it would wait).

    Parameters
    ----------
    host_data : bool, default False
        Also refuse ``torch.tensor`` / ``as_tensor`` / ``asarray`` and ``Tensor.new_tensor``
        of host data (a Python number, list or array; not of a tensor): free on a CPU, but on CUDA a copy
        from pageable memory that waits for the stream, so a CPU test sees the syncs
        a GPU would have. Build the call's inputs before the block.

    Yields
    ------
    None

    Raises
    ------
    HostSyncError
        From inside the block, at the first construct that would make the host
        wait for the device.

    Example
    -------
    >>> t = torch.arange(4)
    >>> with no_host_sync():
    ...     u = t + 1                   # device work only
    >>> u.tolist()                      # read after the block
    [1, 2, 3, 4]
    >>> with no_host_sync():
    ...     t.sum().item()
    Traceback (most recent call last):
    ...
    tpool.testing.HostSyncError: host sync on the hot path: Tensor.item()
    """
    with _guarded(host_data=host_data):
        yield


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep   # torch's own frames, left out of a read's stack


class HostReads:
    """What :func:`count_host_reads` saw: ``reads`` (device reads) and ``snapshot_reads``, each a
    list of ``(what, stack)``; ``stack`` names the ``(file, function)`` frames outside torch and
    this module, innermost first, so a test can say which call made each read."""

    def __init__(self):
        self.reads, self.snapshot_reads = [], []

    @staticmethod
    def _stack():
        return [(f.filename, f.name) for f in reversed(traceback.extract_stack())
                if not f.filename.startswith(_TORCH_DIR) and f.filename != __file__]

    def add(self, what):
        self.reads.append((what, self._stack()))

    def add_snapshot(self, what):
        self.snapshot_reads.append((what, self._stack()))


@contextlib.contextmanager
def count_host_reads(*, host_data: bool = False):
    """Like :func:`no_host_sync`, but count the reads (a :class:`HostReads`) instead of raising.

    Every construct that ``no_host_sync`` refuses counts once (``t.tolist()`` is one read,
    not one per element) and then runs. Like ``no_host_sync`` it sees only the calling
    thread, and the innermost guard decides: a ``no_host_sync`` inside this block raises.

    Parameters
    ----------
    host_data : bool, default False
        Also count ``torch.tensor`` / ``as_tensor`` / ``asarray`` and ``Tensor.new_tensor`` of host
        data (a Python number, list or array; not of a tensor) as reads, one per call: on CUDA each is a copy
        from pageable memory that waits for the stream.

    Yields
    ------
    HostReads
        Filled while the block runs.

    Example
    -------
    >>> t = torch.arange(4)
    >>> with count_host_reads(host_data=True) as seen:
    ...     n = t.sum().item()              # one read
    ...     u = torch.tensor([1, 2])        # host data: one read
    ...     v = torch.as_tensor(t)          # a tensor already: no read
    >>> [what.split()[0] for what, _ in seen.reads]
    ['Tensor.item()', 'torch.tensor()']
    """
    seen = HostReads()
    with _guarded(seen.add, seen.add_snapshot, host_data):
        yield seen


def peak_alloc_bytes(fn) -> int:
    """The most bytes the allocations made while ``fn()`` runs hold at once, on the CPU: torch's profiler
    records every allocation and free of the CPU allocator in order (einsum's internal copies included);
    tensors made before ``fn`` are not counted. At one timestamp allocations go first (an upper bound).
    What tests of ``paged_attention``'s ``chunk_bytes`` and ``benchmarks/bench_logits.py`` measure."""
    from torch._C._profiler import _EventType
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, -e.extra_fields.alloc_size))
        todo.extend(e.children)
    live = peak = 0
    for _, minus_n in sorted(events):
        live -= minus_n
        peak = max(peak, live)
    return peak


def without_logits_to_keep(model_class):
    """A subclass of a transformers causal LM class whose ``forward`` does not name ``logits_to_keep`` (it
    passes ``input_ids``, ``position_ids`` and the rest on, and the model computes every token's logits):
    the models :func:`tpool.serving.hf.forward_step` indexes after the forward, to test that path."""

    class WithoutLogitsToKeep(model_class):
        def forward(self, input_ids=None, position_ids=None, **kwargs):
            return super().forward(input_ids=input_ids, position_ids=position_ids, **kwargs)

    WithoutLogitsToKeep.__name__ = WithoutLogitsToKeep.__qualname__ = f"{model_class.__name__}WithoutLogitsToKeep"
    return WithoutLogitsToKeep
