"""Backends: one contract (:mod:`tpool.backends.contract`), three implementations, one registry.

Note: ``reference`` is plain torch (the oracle, :mod:`tpool.backends.reference`),
``numba`` runs the kernels' numba twins on host memory
(:mod:`tpool.backends.numba`), ``triton`` launches the Triton kernels
(:mod:`tpool.backends.triton`; on a CPU only under ``TRITON_INTERPRET=1``,
set before triton is imported). ``auto`` picks triton for CUDA pools and
numba for CPU pools; the environment variable ``TPOOL_BACKEND`` overrides
``auto`` (unset, empty or ``auto``: no override). A backend's module is
imported only when a pool asks for it, so a
CPU pool never imports the Triton launchers, nor triton itself: triton is an
optional dependency (``pip install 'triton>=3.0'``, the ``triton`` extra), and asking for the
triton backend without it raises :class:`ImportError` naming that extra.
"""

import importlib
import os

import torch

from tpool.backends.contract import PoolOps, TableOps
from tpool.state import PoolState, TableState

# name -> module defining ``Pool`` (a PoolOps) and ``Table`` (a TableOps)
REGISTRY = {
    "reference": "tpool.backends.reference",
    "numba": "tpool.backends.numba",
    "triton": "tpool.backends.triton",
}
BACKENDS = tuple(REGISTRY)

__all__ = ["BACKENDS", "REGISTRY", "PoolOps", "TableOps", "make_pool_ops", "make_table_ops", "requested_backend",
           "resolve_backend"]


def requested_backend(name: str) -> str:
    """``name``, or for ``auto`` the backend ``TPOOL_BACKEND`` names (``auto`` when it is unset or
    empty): what a pool was asked to run on before its device is known (``numba``: the CPU)."""
    return (os.environ.get("TPOOL_BACKEND", "auto") or "auto") if name == "auto" else name


def resolve_backend(name: str, device: torch.device) -> str:
    """The backend a pool on ``device`` uses for ``name`` (``auto`` or one of BACKENDS)."""
    asked = requested_backend(name)
    where = " (from TPOOL_BACKEND)" if asked != name else ""  # set in the environment: every refusal says so
    name = asked if asked != "auto" else ("triton" if device.type == "cuda" else "numba")  # auto: the device's
    if name not in REGISTRY:
        raise ValueError(f"backend: expected 'auto' or one of {BACKENDS}, got {name!r}{where}")
    if name == "numba" and device.type != "cpu":
        raise ValueError(f"backend 'numba'{where} runs on host memory: expected device cpu, got {device}")
    if name == "triton":
        from tpool.kernels import _triton_shim  # imports no triton
        if not _triton_installed():
            raise ImportError(f"backend 'triton'{where} needs triton, which is not installed: "
                              f"{_triton_shim.INSTALL_HINT} (or pass backend='reference'"
                              f"{'' if device.type == 'cuda' else ', or numba on a CPU'})")
        if device.type == "cpu" and not _triton_shim.interpreting():
            raise ValueError(f"backend 'triton'{where} on a CPU pool needs TRITON_INTERPRET=1 set before triton "
                             "is imported")
    return name


def _triton_installed() -> bool:
    from tpool.kernels import _triton_shim  # imports no triton
    return _triton_shim.available()


def make_pool_ops(name: str, st: PoolState) -> PoolOps:
    """The pool operations of backend ``name`` over the state ``st`` (over its held views:
    :meth:`tpool.state.PoolState.held`)."""
    return _backend(name).Pool(st.held())


def make_table_ops(name: str, st: PoolState, ts: TableState) -> TableOps:
    """The page-table operations of backend ``name`` over a table's state ``ts`` and its pool's ``st``
    (over their held views)."""
    return _backend(name).Table(st.held(), ts.held())


def _backend(name: str):
    """The module of backend ``name``, imported at its first use (numba's import, ~0.2 s, is paid only
    by a process that makes a numba pool)."""
    return importlib.import_module(REGISTRY[name])
