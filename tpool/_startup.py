"""What a process pays once: imports and loading compiled kernels, with Python's collector paused.

Note: importing numba (or torch) and loading numba's cached kernels create tens of
thousands of objects that live as long as the process. Each allocation counts towards
Python's cyclic collector, which then runs over and over during the import, and in a
process that has imported torch each full collection walks torch's objects too: with the
collector paused, ``import numba`` after ``import torch`` takes ~90 ms instead of ~180 on
the development machine (``benchmarks/bench_startup.py``). Nothing of what these one-off
steps make is garbage, so pausing collection frees nothing later either.

The pause is process-wide (``gc`` has no other switch), lasts only the import or the load,
and restores what it found: a collector the caller disabled stays disabled.
"""

import contextlib
import gc
import logging
import sys
import time


@contextlib.contextmanager
def gc_paused():
    """Run the block with Python's cyclic garbage collector disabled, then restore its state."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


_compile_announced = None  # perf_counter of the last line said, None before the first
_STILL_AFTER_S = 5.0       # a later compile is named when the last line is older than this


def announce_compile(cache_dir: str, name: str = "") -> None:
    """Say that numba is compiling kernels its cache does not hold yet: the whole notice at the
    first compile of a process, then a short line naming the kernel when the last line is more
    than ``_STILL_AFTER_S`` old (a chain of compiles, such as a benchmark's first run of a new
    call, would otherwise be silent for tens of seconds).

    A first process on a machine (or after an upgrade of tpool or numba) spends seconds
    in each kernel's first call, ~20 s for a first alloc and step on a 2-core machine;
    without a word it looks hung. The line goes to the ``tpool`` logger (INFO) when the
    application has configured logging, else straight to stderr.
    """
    global _compile_announced
    now = time.perf_counter()
    if _compile_announced is None:
        msg = ("tpool: compiling numba kernels that are not cached yet (first use on this machine, or after an "
               f"upgrade): seconds per kernel, ~20 s for a first alloc and step on 2 cores, once; cache: {cache_dir}")
    elif now - _compile_announced > _STILL_AFTER_S:
        msg = f"tpool: still compiling numba kernels ({name or 'another'}, not cached yet)"
    else:
        return
    _compile_announced = now
    log = logging.getLogger("tpool")
    if log.hasHandlers():
        log.info(msg)
    else:
        print(msg, file=sys.stderr, flush=True)
