"""The lockstep differential fuzzer (``tests/fuzz_lockstep.py``) in CI, in a subprocess.

A divergence exits 1 and prints the shrunk reproducer; a crash (a kernel touching
memory it was not given) ends the subprocess with a signal. Either fails the test.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HAS_TRITON

FUZZ = Path(__file__).parent / "fuzz_lockstep.py"


def fuzz(*args, timeout=900, triton=False):
    env = dict(os.environ, TRITON_INTERPRET="1") if triton else dict(os.environ)
    p = subprocess.run([sys.executable, str(FUZZ), *args], capture_output=True, text=True, env=env, timeout=timeout)
    assert p.returncode == 0, \
        f"exit {p.returncode} (negative: killed by a signal)\n{p.stdout[-4000:]}\n{p.stderr[-3000:]}"
    assert p.stdout.startswith("ok:"), p.stdout


def test_fuzz_numba_20000_ops():
    fuzz("--ops", "20000", "--backends", "reference,numba", "--seed", "0")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_fuzz_interpreted_triton_1000_ops():
    fuzz("--ops", "1000", "--episode", "60", "--backends", "reference,numba,triton", "--seed", "0", triton=True)


@pytest.mark.stress
def test_fuzz_numba_1000000_ops():
    fuzz("--ops", "1000000", "--backends", "reference,numba", "--seed", "1000000", timeout=6 * 3600)


def test_fuzz_shrinks_a_divergence_to_a_minimal_reproducer():
    """The shrinker on a planted divergence (the second backend ignores every free)."""
    import fuzz_lockstep as fz
    ops = [("alloc", [1], False), ("touch", [0], False), ("alloc", [2, 1], False), ("free", [0], False),
           ("evict", 2), ("alloc", [1], False)]
    cfg = dict(num_pages=6, page_size=1, max_requests=3, max_pages=2, max_batch=8)
    real = fz.System.apply

    def flaky(self, op):  # the second system ignores every free: the states part after op 3
        if op[0] == "free" and self.pool.backend == "numba":
            return []
        return real(self, op)
    fz.System.apply = flaky
    try:
        small = fz.shrink(["reference", "numba"], cfg, ops)
    finally:
        fz.System.apply = real
    assert small == [("free", [0], False)]  # a free alone already differs (a double free, counted)
    assert fz.run_ops(["reference", "numba"], cfg, small) is None  # the planted fault is gone again
