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


@pytest.mark.parametrize("pages", ["2", "13", "48"])
def test_fuzz_numba_lru_mix(pages):
    """The LRU-heavy mix (``--mix lru``: caching, touches, revivals and evictions, the queue shifted past
    int32 and near its position limit) on pools of ``pages`` pages, batches up to the pool: long episodes
    so the ring wraps and the cleaner runs passes. On 2 pages it found the reference's clean seeing no
    live entry after a push past ``LRU_POS_LIMIT`` (seed 1122)."""
    fuzz("--ops", "6000", "--episode", "1500", "--mix", "lru", "--pages", pages, "--backends", "reference,numba",
         "--seed", "1120")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_fuzz_interpreted_triton_lru_mix():
    fuzz("--ops", "600", "--episode", "300", "--mix", "lru", "--pages", "3", "--block", "4", "--backends",
         "reference,numba,triton", "--seed", "1120", triton=True)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_fuzz_interpreted_triton_1000_ops():
    fuzz("--ops", "1000", "--episode", "60", "--backends", "reference,numba,triton", "--seed", "0", triton=True)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_fuzz_interpreted_triton_in_chunks_of_4_lanes():
    """Every Triton kernel works in chunks of 4 lanes (``--block 4``): the fuzzer's batches (at most 16 lanes)
    run the multi-chunk paths (carries between chunks, chunk loops) that chunks of 32 and more never reach
    here, under the address check."""
    fuzz("--ops", "600", "--episode", "60", "--backends", "reference,triton", "--seed", "100", "--block", "4",
         triton=True)


GUARD_DEMO = """
import torch, triton, triton.language as tl
import triton_guard
GUARDED = True
triton_guard.install()

@triton.jit
def copy8(src, dst, N: tl.constexpr, M: tl.constexpr):
    i = tl.arange(0, 8)
    tl.store(dst + i, tl.load(src + i, mask=i < N, other=-1), mask=i < M)

big, out = torch.arange(16, dtype=torch.int32), torch.zeros(16, dtype=torch.int32)
copy8[(1,)](big[4:8], out[:4], 4, 4)                        # in bounds
print("ok", out[:5].tolist())
for name, n, m in (("load", 5, 4), ("store", 4, 5)):        # one lane past src (big[8]), past dst (out[4])
    try:
        copy8[(1,)](big[4:8], out[:4], n, m)
        print(name, "unseen")
    except Exception as e:
        print(name, "raised", type(e).__name__, "OutOfBounds" in repr(e), out[4:].tolist() == [0] * 12)

@triton.jit
def at(src, dst, off):
    tl.store(dst, tl.load(src + off.to(tl.int64)))

@triton.jit
def run_into(a, b, off):   # a: int32; off lands in b, an int64 argument (an index run past a)
    tl.store(a, tl.load(a + off.to(tl.int64)))

wide = torch.zeros(4, dtype=torch.int64)
try:
    run_into[(1,)](out, wide, (wide.data_ptr() - out.data_ptr()) // 4)
    print("dtype unseen")
except Exception as e:
    print("dtype raised", "OutOfBounds" in repr(e))

if GUARDED:   # an address 4 bytes below 2**64 (src + off wraps): checked without an addition that would wrap too
    try:
        at[(1,)](big, out, -(big.data_ptr() // 4) - 1)
        print("wrap unseen")
    except Exception as e:
        print("wrap raised", "OutOfBounds" in repr(e))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_the_triton_address_check_catches_an_access_past_a_view(tmp_path):
    """``tests/triton_guard.py`` on a planted kernel: reading one lane past a 4-element view of a larger
    tensor, and writing one past another, raise before the access (nothing past the view is written), and
    so does an int32 load that lands in an int64 argument (the wrong element size);
    the interpreter alone reads and writes the neighbouring elements without a word."""
    script = tmp_path / "guard_demo.py"
    script.write_text(GUARD_DEMO)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(FUZZ.parent))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines() == ["ok [4, 5, 6, 7, 0]", "load raised InterpreterError True True",
                                     "store raised InterpreterError True True", "dtype raised True",
                                     "wrap raised True"], \
        p.stdout + p.stderr[-2000:]
    unguarded = GUARD_DEMO.replace("GUARDED = True\ntriton_guard.install()", "GUARDED = False")
    assert unguarded != GUARD_DEMO
    script.write_text(unguarded)
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert p.stdout.splitlines()[1:] == ["load unseen", "store unseen", "dtype unseen"], \
        p.stdout + p.stderr[-2000:]


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
