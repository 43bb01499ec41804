"""The repository's ``kernels/`` folder against the ``kernels`` package that transformers imports.

Note: tpool's kernels live in a top-level ``kernels/`` folder of the repository, installed
as ``tpool.kernels``. Python started in the repository's root (``python -m pytest``,
``python -m tpool``, ``python -c``) puts that root first on ``sys.path``, where the folder
shadows Hugging Face's ``kernels`` package, which transformers 5.25 and later requires and
imports with its models: ``ImportError: cannot import name 'CUDAProperties' from 'kernels'``.
``import tpool`` puts :class:`HubKernelsFinder` first on ``sys.meta_path``: a top-level
``import kernels`` that would load tpool's folder loads the installed ``kernels``
distribution's package instead. It does nothing until something imports ``kernels``, and
nothing when the name resolves elsewhere or no ``kernels`` distribution is installed.
``import tpool.kernels`` is not a top-level import and never reaches it.
"""

import importlib.abc
import importlib.util
import sys
from importlib.machinery import PathFinder
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

NAME = "kernels"
MARKERS = ("layout.py", "_numba_util.py")  # files that mark a folder as tpool's kernels


def _tpool_folder(spec) -> bool:
    """Whether ``spec`` (or None) is a package made from tpool's ``kernels/`` folder."""
    if spec is None or spec.origin is None:
        return False
    folder = Path(spec.origin).parent
    return all((folder / marker).is_file() for marker in MARKERS)


class HubKernelsFinder(importlib.abc.MetaPathFinder):
    """Resolves a top-level ``kernels`` to the installed distribution when tpool's folder would shadow it."""

    def find_spec(self, name, path=None, target=None):
        if name != NAME or path is not None:
            return None
        if not _tpool_folder(PathFinder.find_spec(name)):
            return None  # the name resolves to something else: leave it to the usual finders
        try:
            init = Path(distribution(NAME).locate_file(f"{NAME}/__init__.py"))
        except PackageNotFoundError:
            return None
        if not init.is_file() or all((init.parent / marker).is_file() for marker in MARKERS):
            return None
        return importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])


def install() -> None:
    """Put one :class:`HubKernelsFinder` first on ``sys.meta_path`` (again: nothing)."""
    if not any(isinstance(finder, HubKernelsFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, HubKernelsFinder())
