"""pytest-benchmark suite: the decode step and the turnover step, warm and cold, with the host baselines.

    pytest benchmarks/test_bench_page_table.py --benchmark-only
    pytest benchmarks/ --benchmark-disable          # each workload once (smoke)

Every warm round starts from the same table (restored untimed after each round and
stepped once, as bench_page_table.py does before each sample), so the requests
do not grow and a warm round times the steady state.
Cold rounds are one call each, after one untimed call and 64 MiB written into a
numpy buffer (the table is restored once before them, not before each: see
``_common.sample_cold_us``): the CPU caches are cold, as after a forward pass. Baselines
(``numpy-blocks`` and ``vllm-blocks``, each with its turnover) are separate benchmarks
in the same groups. ``python benchmarks/bench_page_table.py [--cold]`` prints the same
workloads as one table with ratios.
"""

import pytest

from _common import CacheFlusher, calibrate, default_device, device_timed_benchmark, sync_of
from bench_page_table import WARM_INNER, make_reset, workloads
import torch

DEVICE = default_device()
benchmark = device_timed_benchmark()  # on CUDA its clock waits for the device (_common)
BACKEND = "triton" if DEVICE == "cuda" else "numba"
DECODE = ["numpy-blocks", "vllm-blocks", f"tpool-{BACKEND} step", f"tpool-{BACKEND} bound step",
          f"tpool-{BACKEND} bound step, two StepOuts taking turns"] + (
    [f"tpool-{BACKEND} bound step, table-made inputs"] if DEVICE == "cpu" else [])
TURNOVER = ["numpy-blocks turnover", "vllm-blocks turnover", f"tpool-{BACKEND} turnover",
            f"tpool-{BACKEND} turnover, one call"] + ([f"tpool-{BACKEND} turnover, bound"] if DEVICE == "cpu" else [])
# the pool-size group: the plain calls, and on a CPU the bound ones the targets are for
SIZED = [f"tpool-{BACKEND} step", f"tpool-{BACKEND} turnover"] + (
    [f"tpool-{BACKEND} bound step, table-made inputs", f"tpool-{BACKEND} turnover, bound"] if DEVICE == "cpu" else [])
POOL_SIZES = [65536, 1048576, 16777216]  # the decode step should stay flat
ROUNDS, COLD_ROUNDS = 30, 100

_flush = None


def workload(B, impl, num_pages=None):
    fn, owner, kind = workloads(B, [BACKEND], torch.device(DEVICE), num_pages=num_pages, extras=False)[impl]
    return fn, make_reset(fn, owner)


def warm(benchmark, fn, reset, group, **info):
    benchmark.group = group
    benchmark.extra_info.update(device=DEVICE, **info)
    sync = sync_of(torch.device(DEVICE))
    iterations = calibrate(fn, sync=sync, reset=reset, max_inner=WARM_INNER)

    def settle():  # untimed, after each round: the same state, then one call (see _common.sample_us)
        reset()
        fn()
    settle()
    benchmark.pedantic(fn, teardown=settle, rounds=ROUNDS, iterations=iterations, warmup_rounds=1)


@pytest.mark.parametrize("impl", DECODE + TURNOVER)
@pytest.mark.parametrize("B", [1, 64, 256])
def test_step_warm(benchmark, impl, B):
    kind = "turnover" if impl in TURNOVER else "decode step"
    warm(benchmark, *workload(B, impl), f"{kind} B={B}", batch=B, impl=impl)


@pytest.mark.parametrize("impl", DECODE + TURNOVER)
@pytest.mark.parametrize("B", [256])
def test_step_cold(benchmark, impl, B):
    global _flush
    _flush = _flush or CacheFlusher()
    fn, reset = workload(B, impl)
    sync = sync_of(torch.device(DEVICE))

    def setup():  # untimed: one step (the timed one grows its CSR), then 64 MiB written
        fn()
        _flush()
        if sync:
            sync()

    reset()  # once: restoring the state before every round would slow the timed call (_common.sample_cold_us)

    kind = "turnover" if impl in TURNOVER else "decode step"
    benchmark.group = f"{kind} B={B}, cold (64 MiB written before each call)"
    benchmark.extra_info.update(device=DEVICE, batch=B, impl=impl, cold_bytes=len(_flush.buf) * 8)
    benchmark.pedantic(fn, setup=setup, rounds=COLD_ROUNDS, iterations=1, warmup_rounds=1)
    reset()


@pytest.mark.parametrize("impl", SIZED)
@pytest.mark.parametrize("num_pages", POOL_SIZES)
def test_step_against_pool_size(benchmark, impl, num_pages):
    warm(benchmark, *workload(256, impl, num_pages), "decode and turnover step B=256 against pool size",
         batch=256, impl=impl, num_pages=num_pages)
