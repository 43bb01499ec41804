"""``triton`` and ``triton.language`` for the kernel modules, imported at the first Triton use.

Note: every kernel module holds a numba kernel and its Triton twin, and imports
``from ._triton_shim import triton, tl`` instead of triton itself, so that the
numba backend (CPU) neither needs triton installed nor pays for importing it
(about 0.1 s: the import and ``@triton.jit`` reading the source of every kernel).

Until Triton is needed, ``triton`` and ``tl`` are stand-ins that do what the
kernel modules do at import time and nothing more:

* ``@triton.jit`` returns a :class:`LazyKernel` that remembers the function;
* ``tl.constexpr(v)`` makes a :class:`Constexpr` holding ``v`` (module constants)
  and ``tl.constexpr`` itself serves as an annotation (``BLOCK: tl.constexpr``);
* ``triton.next_power_of_2`` and ``triton.cdiv`` compute what triton's do.

Any other attribute raises ``AttributeError`` naming this module, so a new
import-time use shows up at once (add it to the stand-in). :func:`load`
imports the real triton (the triton backend calls it when it is imported; a
launch through a stand-in kernel, ``kernel[grid](...)``, calls it too) and then
swaps, in every loaded kernel module, each stand-in for the real thing: the
modules' ``triton`` and ``tl``, ``triton.jit`` of each function (its
``tl.constexpr`` annotations made real first), ``tl.constexpr`` of each
constant. Kernel modules loaded afterwards get the real modules directly. If
triton is already imported when this module loads, the real modules are used
from the start. Without triton installed, :func:`load` raises
:class:`ImportError` naming the extra to install (:data:`INSTALL_HINT`).
"""

import functools
import importlib.util
import os
import sys
import threading
import types

# What the `triton` extra brings (pyproject.toml), named directly: "tpool" on PyPI is another project.
INSTALL_HINT = "pip install 'triton>=3.0' (the triton extra; pip install -e '.[triton]' in a checkout)"
_PACKAGE = __name__.rpartition(".")[0]         # the kernels' package: tpool.kernels when installed
_lock = threading.Lock()


def available() -> bool:
    """Whether triton can be imported (imports nothing)."""
    try:
        return "triton" in sys.modules or importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a finder that refuses triton
        return False


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for triton's interpreter, read as triton reads it: ``1``, ``true``,
    ``on``, ``yes`` or ``y`` in any case (imports nothing)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes", "y")


def loaded() -> bool:
    """Whether the kernel modules use the real triton (:func:`load` ran, or triton was imported first)."""
    return not isinstance(triton, _StandIn)


class Constexpr:
    """Stand-in for ``tl.constexpr``: a module constant (``.value``), or an annotation."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value.value if isinstance(value, Constexpr) else value

    def __repr__(self):
        return f"constexpr[{self.value!r}] (stand-in: triton not loaded)"


Constexpr.__name__ = Constexpr.__qualname__ = "constexpr"  # triton tells constexpr parameters by this name


class LazyKernel:
    """What the stand-in ``@triton.jit`` returns: the function, made a Triton kernel by :func:`load`
    (with ``options``, the keywords of ``@triton.jit(...)``, such as ``do_not_specialize``).

    ``kernel[grid](...)`` loads triton (or raises its :class:`ImportError`) and launches the real
    kernel; calling it directly raises, as calling a Triton kernel outside a kernel does.
    """

    def __init__(self, fn, options=None):
        self.fn, self.options = fn, dict(options or {})
        functools.update_wrapper(self, fn)

    def __getitem__(self, grid):
        load()
        return _real[self][grid]

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.__name__} is a Triton kernel: launch it as {self.__name__}[grid](...)")

    def __repr__(self):
        return f"<LazyKernel {self.__module__}.{self.__name__} (triton not loaded)>"


class _StandIn(types.ModuleType):
    def __getattr__(self, name):
        raise AttributeError(f"{self.__name__}.{name} is not in the stand-in of {__name__} (triton is not loaded); "
                             "kernel modules may use only jit, next_power_of_2, cdiv and tl.constexpr at import time")


def _next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def _cdiv(x: int, y: int) -> int:
    return (x + y - 1) // y


def _jit(fn=None, **options):
    """The stand-in ``triton.jit``, as ``@triton.jit`` or ``@triton.jit(do_not_specialize=[...])``."""
    return LazyKernel(fn, options) if fn is not None else lambda f: LazyKernel(f, options)


def _stand_ins():
    tr, lang = _StandIn("triton"), _StandIn("triton.language")
    tr.jit, tr.next_power_of_2, tr.cdiv, tr.language = _jit, _next_power_of_2, _cdiv, lang
    lang.constexpr = Constexpr
    return tr, lang


_real = {}  # stand-in -> its real counterpart (the stand-ins hash by identity), filled by load()

if "triton" in sys.modules:  # already paid for: use it from the start
    import triton
    import triton.language as tl
else:
    triton, tl = _stand_ins()


def load():
    """Import triton and make every loaded kernel module use it; returns the ``triton`` module.

    Idempotent and thread-safe. Raises :class:`ImportError` naming :data:`INSTALL_HINT`
    when triton is not installed.
    """
    global triton, tl
    with _lock:
        if loaded():
            return triton
        try:
            import triton as real
            import triton.language as real_tl
        except ImportError as e:
            raise ImportError(f"tpool's Triton kernels need triton, which is not installed: {INSTALL_HINT} "
                              f"(the numba backend runs on a CPU without it)") from e
        _real.update({triton: real, tl: real_tl})
        for name, m in list(sys.modules.items()):
            if m is None or not name.startswith(_PACKAGE + ".") or name == __name__:
                continue
            for attr, value in list(vars(m).items()):
                if isinstance(value, (_StandIn, Constexpr, LazyKernel)):
                    setattr(m, attr, _real_of(value, real, real_tl))
        triton, tl = real, real_tl
        return triton


def _real_of(stand_in, real, real_tl):
    if stand_in not in _real:
        if isinstance(stand_in, Constexpr):
            _real[stand_in] = real_tl.constexpr(stand_in.value)
        else:
            fn = stand_in.fn
            fn.__annotations__ = {k: real_tl.constexpr if v is Constexpr else v for k, v in fn.__annotations__.items()}
            _real[stand_in] = real.jit(fn, **stand_in.options)
    return _real[stand_in]
