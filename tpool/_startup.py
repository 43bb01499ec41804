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
