"""Test helpers for engines that embed tpool: a host-sync guard.

Note: torch has no CPU equivalent of ``torch.cuda.set_sync_debug_mode``, so
``no_host_sync()`` builds one. Inside it, any construct that would make the
host wait for the device raises :class:`HostSyncError`:

* ops seen by a ``TorchDispatchMode``: ``aten._local_scalar_dense``
  (``.item()``, ``bool(t)``, ``int(t)``, ``float(t)``), ``is_nonzero``,
  ``nonzero``/``argwhere``, ``unique`` in all forms, ``masked_select``,
  boolean-mask indexing (``t[mask]``, ``t[mask] = v``), ``bincount``,
  ``repeat_interleave`` without ``output_size``, ``equal``;
* methods that read memory without dispatch, patched for the duration:
  ``Tensor.tolist``, ``Tensor.numpy``, ``Tensor.cpu``, ``Tensor.item``.

Wrap every hot-path call in it; read results after the block.
``count_host_reads()`` is the same guard counting reads instead of raising
(to check that a whole loop reads the device only at its sync points). Under
``TRITON_INTERPRET=1`` the interpreter stands in for the GPU and copies
kernel arguments to numpy around each launch; those copies are the simulated
device's, not the host's, so the guard is suspended inside a launch.
"""

import contextlib
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
    aten._unique: "unique", aten._unique2: "unique", aten.unique_dim: "unique",
    aten.unique_consecutive: "unique_consecutive",
}
_MASK_INDEX = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


_in_device = [0]  # depth of simulated (interpreted) kernel launches


def _raise(what):
    raise HostSyncError(f"host sync on the hot path: {what}")


class _Guard(TorchDispatchMode):
    def __init__(self, report=_raise):
        super().__init__()
        self.report = report

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _in_device[0]:
            return func(*args, **(kwargs or {}))
        packet = func.overloadpacket
        if packet in _BANNED:
            self.report(f"{_BANNED[packet]} ({func})")
        elif packet is aten.repeat_interleave and (kwargs or {}).get("output_size") is None:
            self.report(f"repeat_interleave without output_size ({func})")
        elif packet in _MASK_INDEX and _has_bool_index(args):
            self.report(f"boolean-mask indexing ({func})")
        return func(*args, **(kwargs or {}))


def _refuse(name, original, report=_raise, on_snapshot=None):
    def method(self, *args, **kwargs):
        if _in_device[0]:
            return original(self, *args, **kwargs)
        if getattr(self, HOST_SNAPSHOT_ATTR, False):  # host memory an AsyncRead filled: no device read
            if on_snapshot is not None:
                on_snapshot(f"Tensor.{name}() of a host snapshot")
        else:
            report(f"Tensor.{name}()")
        _in_device[0] += 1  # the read itself (reached only when counting): its inner ops are not new reads
        try:
            return original(self, *args, **kwargs)
        finally:
            _in_device[0] -= 1
    return method


def _from_host(name, original, report):
    """``torch.tensor`` / ``torch.as_tensor`` reporting a tensor built from Python data (not from a tensor)."""
    def build(data, *args, **kwargs):
        if not _in_device[0] and not isinstance(data, torch.Tensor):
            report(f"torch.{name}() of host data (on CUDA a copy from pageable memory, which waits for the "
                   f"stream; use torch.full or a tensor made beforehand)")
        return original(data, *args, **kwargs)
    return build


def _interpreter_executor():
    """Triton's interpreted launcher class when TRITON_INTERPRET=1 and triton is loaded, else None."""
    import os
    import sys
    if os.environ.get("TRITON_INTERPRET") != "1" or "triton" not in sys.modules:
        return None
    from triton.runtime import interpreter
    return interpreter.GridExecutor


def _device_region(call):
    def launch(*args, **kwargs):
        _in_device[0] += 1
        try:
            return call(*args, **kwargs)
        finally:
            _in_device[0] -= 1
    return launch


@contextlib.contextmanager
def _guarded(report=_raise, on_snapshot=None, host_data=False):
    names = ("tolist", "numpy", "cpu", "item")
    saved = {name: getattr(torch.Tensor, name) for name in names}
    built = {name: getattr(torch, name) for name in ("tensor", "as_tensor")}
    executor = _interpreter_executor()
    launch = executor.__call__ if executor is not None else None
    try:
        for name in names:
            setattr(torch.Tensor, name, _refuse(name, saved[name], report, on_snapshot))
        if executor is not None:
            executor.__call__ = _device_region(launch)
        if host_data:
            for name in ("tensor", "as_tensor"):
                setattr(torch, name, _from_host(name, built[name], report))
        with _Guard(report):
            yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
        for name, fn in built.items():
            setattr(torch, name, fn)
        if executor is not None:
            executor.__call__ = launch


@contextlib.contextmanager
def no_host_sync(*, host_data: bool = False):
    """Raise :class:`HostSyncError` on any host read of tensor data inside the block.

    Patches ``Tensor.tolist``, ``numpy``, ``cpu`` and ``item`` and enters a
    dispatch mode for the ops of the module note; both are undone at exit,
    also when the block raises. The method patches are process-wide: another
    thread calling them meanwhile raises too. Reading a host snapshot that
    :class:`tpool.stats_async.AsyncRead` filled (what ``PagePool.stats_async().get()``
    does) is a read of host memory and is allowed.

    With ``host_data=True`` it also refuses ``torch.tensor`` / ``torch.as_tensor``
    of host data (a Python number, list or array; patched for the duration): free on
    a CPU, but on CUDA a copy from pageable memory that waits for the stream, so a CPU
    test sees the syncs a GPU would have. Build the call's inputs before the block.

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


class HostReads:
    """What :func:`count_host_reads` saw: ``reads`` (device reads) and ``snapshot_reads``, each a
    list of ``(what, stack)``; ``stack`` names the ``(file, function)`` frames outside torch and
    this module, innermost first, so a test can say which call made each read."""

    def __init__(self):
        self.reads, self.snapshot_reads = [], []

    @staticmethod
    def _stack():
        return [(f.filename, f.name) for f in reversed(traceback.extract_stack())
                if "/torch/" not in f.filename and not f.filename.endswith("testing.py")]

    def add(self, what):
        self.reads.append((what, self._stack()))

    def add_snapshot(self, what):
        self.snapshot_reads.append((what, self._stack()))


@contextlib.contextmanager
def count_host_reads():
    """Like :func:`no_host_sync`, but count the reads (a :class:`HostReads`) instead of raising.

    Every construct that ``no_host_sync`` refuses counts once (``t.tolist()`` is one read,
    not one per element) and then runs. Example::

        with count_host_reads() as seen:
            run_the_loop()
        assert len(seen.reads) == expected_sync_points
    """
    seen = HostReads()
    with _guarded(seen.add, seen.add_snapshot):
        yield seen
