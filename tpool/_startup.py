"""What a process pays once: the notice that numba is compiling kernels its cache does not hold.

Note: tpool does not pause Python's cyclic collector around its imports and cache loads
(sessions 11-30 did). ``import torch`` leaves one full collection over its objects due
(~70-100 ms on the development machine), and importing numba sets it off; paused, that
collection was not skipped but moved into whatever the process ran next (its first
~20,000 allocations: a serving loop's first steps), a little larger for the grown heap,
while ``bench_startup.py`` counted it out. It now runs where it falls due, inside
``PagePool(...)``'s import of numba. An application that wants no full collection over its
startup objects while it serves can call ``gc.freeze()`` once they are made; called right
after ``import torch``, it leaves numba's import no full collection to run (one of ~10-20 ms
comes later instead).
"""

import logging
import sys
import time


_compile_announced = None  # perf_counter of the last line said, None before the first
_STILL_AFTER_S = 5.0       # a later compile is named when the last line is older than this


def announce_compile(cache_dir: str, name: str = "") -> None:
    """Say that numba is compiling kernels its cache does not hold yet: the whole notice at the
    first compile of a process, then a short line naming the kernel when the last line is more
    than ``_STILL_AFTER_S`` old (a chain of compiles, such as a benchmark's first run of a new
    call, would otherwise be silent for tens of seconds).

    A first process on a machine (or after an upgrade of tpool or numba) spends seconds
    in each kernel's first call, ~30 s for a first alloc and step on a 2-core machine;
    without a word it looks hung. The line goes to the ``tpool`` logger (INFO) when the
    application has configured logging, else straight to stderr.
    """
    global _compile_announced
    now = time.perf_counter()
    if _compile_announced is None:
        msg = ("tpool: compiling numba kernels that are not cached yet (first use on this machine, or after an "
               f"upgrade): seconds per kernel, ~30 s for a first alloc and step on 2 cores, once; cache: {cache_dir}")
    elif now - _compile_announced > _STILL_AFTER_S:
        msg = f"tpool: still compiling numba kernels ({name or 'another'}, not cached yet)"
    else:
        return
    _compile_announced = now
    _say(msg)


_no_cache_announced = False


def announce_no_cache() -> None:
    """Say, once a process, that no cache location is writable, so every process compiles tpool's
    kernels again (numba tries ``NUMBA_CACHE_DIR``, ``__pycache__`` beside the code, then the user's
    cache directory)."""
    global _no_cache_announced
    if not _no_cache_announced:
        _no_cache_announced = True
        _say("tpool: no writable place to cache numba kernels (NUMBA_CACHE_DIR unset or not writable, tpool's "
             "package directory read-only, the user's cache directory (~/.cache/numba) not writable): every "
             "process compiles them again, ~30 s for a first alloc and step on 2 cores; set NUMBA_CACHE_DIR to a "
             "writable directory to keep them")


def _say(msg: str) -> None:
    """A line to the ``tpool`` logger (INFO) when the application has configured logging, else stderr;
    nowhere when stderr is closed (``2>&-``: ``sys.stderr`` is None, and ``print`` would write to stdout,
    into the data a command such as ``tpool demo`` or a caller's own writes there)."""
    log = logging.getLogger("tpool")
    if log.hasHandlers():
        log.info(msg)
    elif sys.stderr is not None:
        print(msg, file=sys.stderr, flush=True)
