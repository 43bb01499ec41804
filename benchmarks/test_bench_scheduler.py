"""pytest-benchmark suite: one step of the churn workload (bench_scheduler.py), warm and cold.

    pytest benchmarks/test_bench_scheduler.py --benchmark-only
    pytest benchmarks/test_bench_scheduler.py --benchmark-disable   # each workload once (smoke)

Churn: 256 running requests, prompts of 512-2048 tokens, 2 finish and 2 are
admitted every 8 steps. A round is one step (a decode step, or every 8th a
turnover then the decode step), so the rounds of one benchmark walk through
the workload as a serving loop does; 64 untimed steps first. Scheduled by a
``HostMirror`` (``mirror-plain``) or, the baseline in the same group, by
``read-ok`` (direct table calls, ``ok`` read after each). Cold rounds write 64
MiB into a numpy buffer before each step (untimed). ``python
benchmarks/bench_scheduler.py --cold`` prints the same workloads as one table.
"""

import itertools
import random

import pytest

from _common import CacheFlusher, default_device
from bench_scheduler import MirrorChurn, ReadOkChurn, parser

DEVICE = default_device()
ROUNDS, COLD_ROUNDS, WARMUP = 2000, 400, 64
_flush = None


def churn_of(impl):
    args = parser().parse_args([])
    rng = random.Random(args.seed)
    churn = MirrorChurn(args, "plain", DEVICE, rng) if impl == "mirror-plain" else ReadOkChurn(args, DEVICE, rng)
    steps = itertools.count()
    for _ in range(WARMUP):
        i = next(steps)
        churn.step(i)
        churn.after(i)

    def step():
        i = next(steps)
        churn.step(i)
        churn.after(i)  # snapshots and reconciliation: small, and part of the loop
    return churn, step


@pytest.mark.parametrize("impl", ["read-ok", "mirror-plain"])
def test_churn_step_warm(benchmark, impl):
    churn, step = churn_of(impl)
    benchmark.group = "churn step (256 running, 2 out / 2 in every 8 steps)"
    benchmark.extra_info.update(impl=impl, device=DEVICE)
    benchmark.pedantic(step, rounds=ROUNDS, iterations=1)
    churn.pool.check()


@pytest.mark.parametrize("impl", ["read-ok", "mirror-plain"])
def test_churn_step_cold(benchmark, impl):
    global _flush
    _flush = _flush or CacheFlusher()
    churn, step = churn_of(impl)
    benchmark.group = "churn step, cold (64 MiB written before each step)"
    benchmark.extra_info.update(impl=impl, device=DEVICE, cold_bytes=len(_flush.buf) * 8)
    benchmark.pedantic(step, setup=_flush, rounds=COLD_ROUNDS, iterations=1)
    churn.pool.check()
