"""Run tpool's hot paths on the meta device: the CUDA side of every branch, with no data to read.

A CPU has no ``torch.cuda.set_sync_debug_mode``, and the test guard (:mod:`tpool.testing`) sees
the host reads that go through the dispatcher or the methods it patches. A meta tensor holds no
data at all, so on the meta device a read of tensor data fails however it is made
(``.tolist()``, ``.to("cpu")``, ``copy_`` into a host buffer, a method captured before a guard
patched it, C++ paths), and tpool, which branches on ``device.type == "cpu"``, takes the branches
a CUDA pool takes. This module makes that possible for the reference backend (its calls are torch
ops, which meta runs on shapes alone):

* :func:`enable` lets ``resolve_device`` take ``"meta"``, gives each meta storage a distinct fake
  address (tpool's input checks compare addresses: all meta storages report 0), and makes
  ``pin_memory()`` / ``is_pinned()`` work (a tagged copy: the mirror pins its staging buffers);
* :class:`CopyWatch` (a dispatch mode) records host-to-device copies that would block on CUDA:
  ``copy_`` or ``.to()`` from host memory that is not pinned or not ``non_blocking``.

What it cannot see: a tensor built from host values with ``device=`` (``torch.tensor(list,
device=...)`` moves the data with the dispatch modes off), a read a ``try`` swallows, and ops
that meta runs on shapes alone but CUDA runs on data (``histc``, ``isin``). The runner
(``tests/_meta_hot_paths.py``) runs each part inside ``no_host_sync(host_data=True)`` as well,
whose patches see the first and the last of these.

It patches torch globally: run it in its own process (``tests/test_sync_guard.py`` does).
"""

import sys
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

META = torch.device("meta")
_PINNED = {}         # storage address -> the copy pin_memory() made (kept alive: no address reused)
_BASES = {}          # a meta storage -> its fake address


def _fake_base(storage) -> int:
    return _BASES.setdefault(storage._cdata, (len(_BASES) + 1) << 36)


def enable() -> None:
    """Patch torch and tpool so that pools and tables can live on the meta device (see the module note)."""
    import tpool._checks as checks
    real = checks.resolve_device

    def resolve_device(device, name="device", *, backend="auto"):
        if device is not None and torch.device(device).type == "meta":
            return META
        return real(device, name, backend=backend)
    checks.resolve_device = resolve_device
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("tpool") and getattr(module, "resolve_device", None) is real:
            module.resolve_device = resolve_device

    storage_ptr, tensor_ptr = torch.UntypedStorage.data_ptr, torch.Tensor.data_ptr
    torch.UntypedStorage.data_ptr = lambda s: _fake_base(s) if s.device.type == "meta" else storage_ptr(s)
    torch.Tensor.data_ptr = lambda t: (_fake_base(t.untyped_storage()) + t.storage_offset() * t.element_size()
                                       if t.device.type == "meta" else tensor_ptr(t))

    def pin_memory(t, *args, **kwargs):
        copy = t.clone()
        _PINNED[copy.untyped_storage().data_ptr()] = copy
        return copy
    torch.Tensor.pin_memory = pin_memory
    torch.Tensor.is_pinned = lambda t, *args: t.untyped_storage().data_ptr() in _PINNED


def _where() -> str:
    frames = [f for f in traceback.extract_stack() if "/tpool/" in f.filename or "/kernels/" in f.filename]
    return " <- ".join(f"{f.filename.rsplit('/', 2)[-2]}/{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"
                       for f in reversed(frames[-4:]))


class CopyWatch(TorchDispatchMode):
    """Records host-to-device copies a CUDA pool would block on (see the module note)."""

    aten = torch.ops.aten

    def __init__(self):
        super().__init__()
        self.events = []

    def report(self, what: str) -> None:
        self.events.append(f"{what} at {_where()}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        p = func.overloadpacket
        if p is self.aten._to_copy:
            dst = kwargs.get("device")
            src = args[0]
            if dst is not None and torch.device(dst).type == "meta" and src.device.type == "cpu":
                self._host_to_device(src, kwargs.get("non_blocking", False))
        elif p is self.aten.copy_:
            dst, src = args[0], args[1]
            if dst.device.type == "meta" and src.device.type == "cpu":
                self._host_to_device(src, args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        return func(*args, **kwargs)

    def _host_to_device(self, src, non_blocking) -> None:
        pinned = src.untyped_storage().data_ptr() in _PINNED
        if not (non_blocking and pinned):
            self.report(f"a host-to-device copy (non_blocking={bool(non_blocking)}, pinned={pinned})")
