"""pytest-benchmark suite: one alloc of N pages + one free of them, tpool and its baselines.

    pytest benchmarks/test_bench_pool.py --benchmark-only                 # calibrated timings
    pytest benchmarks/ --benchmark-only --benchmark-autosave              # save, then later:
    pytest benchmarks/ --benchmark-only --benchmark-compare               # compare with the last save
    pytest benchmarks/ --benchmark-only --benchmark-histogram=hist        # SVG histograms per group
    pytest benchmarks/ --benchmark-disable                                # each workload once (smoke)

Baselines are separate benchmarks in the same group (``vllm-queue``, vLLM's
BlockPool; ``sglang-paged``, SGLang's PagedTokenToKVPoolAllocator; ``torch-slice``,
SGLang's page_size-1 allocator; ``host-list``, a Python list, the floor of a host
free list; see bench_pool.py), so the table, comparisons and histograms show them
side by side. ``python benchmarks/bench_pool.py`` prints the same
workloads as one table with ratios.
"""

import pytest

import torch

from _common import calibrate, default_device, device_timed_benchmark, sync_of
from bench_pool import pair_fns

DEVICE = default_device()
benchmark = device_timed_benchmark()  # on CUDA its clock waits for the device (_common)
BACKENDS = ["triton", "reference"] if DEVICE == "cuda" else ["numba", "reference"]
FAST = BACKENDS[0]
IMPLS = (["vllm-queue", "sglang-paged", "torch-slice", "host-list"] + [f"tpool-{be}" for be in BACKENDS]
         + [f"tpool-{FAST} (no out=)", f"tpool-{FAST} bound"])
NUM_PAGES = 65536
POOL_SIZES = [65536, 1048576, 16777216]  # alloc/free should stay flat
ROUNDS = 30


def run(benchmark, impl, n, num_pages, group):
    fn = pair_fns(n, num_pages, DEVICE, BACKENDS, only=[impl])[impl]
    benchmark.group = group
    benchmark.extra_info.update(pages=n, num_pages=num_pages, impl=impl, device=DEVICE)
    # Warm-up and calls per round as bench_pool.py's samples (_common.calibrate: about 2 ms a round): a plain
    # benchmark(fn) calibrates on a slow first call and may time one call per round, mostly the clock's own cost.
    iterations = calibrate(fn, sync=sync_of(torch.device(DEVICE)))
    benchmark.pedantic(fn, rounds=ROUNDS, iterations=iterations, warmup_rounds=1)
    fn.verify()  # no alloc failed: a failing alloc returns at once and would look fast


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", [1, 256, 4096])
def test_alloc_free(benchmark, impl, n):
    run(benchmark, impl, n, NUM_PAGES, f"alloc+free N={n}, pool of {NUM_PAGES} pages")


@pytest.mark.parametrize("impl", ["host-list", f"tpool-{FAST}", f"tpool-{FAST} bound"])  # vllm-queue: 16M objects
@pytest.mark.parametrize("num_pages", POOL_SIZES)
@pytest.mark.parametrize("n", [1, 256])
def test_alloc_free_against_pool_size(benchmark, impl, num_pages, n):
    run(benchmark, impl, n, num_pages, f"alloc+free N={n} against pool size")
