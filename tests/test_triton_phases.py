"""The Triton kernels' phases are race-free between lanes: what a GPU could order differently, checked on a CPU.

The interpreter runs a program's lanes in step, so a kernel that lets one lane read what another
lane writes between two barriers gives the right answer here and a scheduling-dependent one on a
GPU. ``tests/triton_phases.py`` raises on such an access; these tests run the library's every kernel
(the compile check's workload, and randomized lockstep episodes in 4-lane chunks, so that the chunk
loops run their carries across chunks) under it, in a subprocess (the check patches the interpreter).
"""

import os
import subprocess
import sys

import pytest

from conftest import TRITON_DEVICE

pytestmark = pytest.mark.skipif(TRITON_DEVICE != "cpu", reason="checks interpreted launches")

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(code: str, tmp_path=None):
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([HERE] + ([str(tmp_path)] if tmp_path else []) + [env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1200)


def test_the_check_finds_a_lane_writing_what_another_lane_reads(tmp_path):
    """A planted race: each lane stores its value into its neighbour's slot, which the neighbour loads in
    the same phase (a GPU may run the store first). With a barrier between the load and the store, clean."""
    (tmp_path / "toy_race.py").write_text(
        "import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
        "def shift(x, BLOCK: tl.constexpr, BARRIER: tl.constexpr):\n"
        "    i = tl.arange(0, BLOCK)\n    v = tl.load(x + i)\n    if BARRIER:\n        tl.debug_barrier()\n"
        "    tl.store(x + (i + 1) % BLOCK, v)\n")
    code = ("import torch, triton_phases, toy_race\ntriton_phases.install()\n"
            "x = torch.arange(8, dtype=torch.int32)\ntoy_race.shift[(1,)](x, BLOCK=8, BARRIER=True)\n"
            "print('barrier:', x.tolist())\ntoy_race.shift[(1,)](x, BLOCK=8, BARRIER=False)\n")
    proc = _run(code, tmp_path)
    assert "barrier: [7, 0, 1, 2, 3, 4, 5, 6]" in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode != 0 and "PhaseHazard" in proc.stderr and "shift: WAR" in proc.stderr, proc.stderr[-2000:]


def test_every_kernel_is_race_free_between_lanes():
    """Every kernel the library launches, on the compile check's workload, touches that make the LRU cleaner
    move live entries past stale ones, and randomized lockstep episodes (valid calls, misuse, hand edits,
    LRU-heavy mixes, batches past the pool's pages) in 4-lane chunks: no lane reads or overwrites what another
    lane of its program wrote or read since the last barrier, and no atomic meets a plain access there."""
    code = (
        "import random, torch\ntorch.set_num_threads(1)\n"
        "import tpool.backends.triton\nimport triton_phases, triton_guard\n"
        "triton_phases.install()\ntriton_guard.force_block(4)\n"
        "import test_triton_compile\ntest_triton_compile._workload()\n"
        # the LRU cleaner moving live entries down past stale ones of the same pages (touches of cached pages)
        "import tpool\npool = tpool.PagePool(8, page_size=1, device='cpu', backend='triton')\n"
        "pages = pool.alloc(torch.tensor([8], dtype=torch.int32)).pages\npool.free(pages, cache=True)\n"
        "for k in range(40):\n    pool.touch(pages[[k % 8, (3 * k + 1) % 8]].clone())\n"
        "pool.evict(3)\n"
        "import fuzz_lockstep as F\n"
        "for seed, mix in ((0, 'all'), (1, 'lru')):\n"
        "    rng = random.Random(seed)\n"
        "    cfg = F.episode_config(rng)\n"
        "    cfg.update(num_pages=12, max_batch=14, wide=True)\n"
        "    F.run_ops(['triton'], cfg, [F.gen_op(rng, cfg, True, mix) for _ in range(60)])\n"
        "print('hazards:', triton_phases.found)\n")
    proc = _run(code)
    assert proc.returncode == 0 and "hazards: []" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
