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

The other way round, a checkout's ``tpool/`` imported where no editable install maps ``kernels/`` to
``tpool.kernels`` (a plain ``pip install .``, then Python started in the checkout's root) finds that
folder through :func:`map_checkout_kernels`.
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


def map_checkout_kernels(package_path: list) -> None:
    """Let ``tpool.kernels`` resolve to a source checkout's ``kernels/`` folder where no install maps it.

    Python started in a checkout's root (``python -m tpool``, ``python -m pytest``) imports the
    checkout's ``tpool/`` before an installed one. An editable install maps ``kernels/`` to
    ``tpool.kernels``; after a plain ``pip install .`` nothing does, and ``import tpool`` failed with
    ``No module named 'tpool.kernels'``. Then the checkout's root joins ``package_path`` (tpool's
    ``__path__``), where the import system finds ``kernels/``: the folder an editable install maps.
    An installed tpool (which holds ``kernels/``) and an editable one (which maps it) are left alone.
    """
    here = Path(package_path[0])
    if (here / NAME).is_dir() or importlib.util.find_spec(f"{__package__}.{NAME}") is not None:
        return
    root = here.parent
    if str(root) not in package_path and all((root / NAME / marker).is_file() for marker in MARKERS):
        package_path.append(str(root))
