"""pytest-benchmark suite: evict the k oldest cached pages (half the pool cached), tpool and its baselines.

    pytest benchmarks/test_bench_evict.py --benchmark-only
    pytest benchmarks/ --benchmark-disable          # each workload once (smoke)

Each round is one ``evict(k)``; the evicted pages are allocated again and
cached (untimed, after the round), so every round sees as many cached pages.
Baselines in the same groups, on the same state (see bench_evict.py):
``vllm-queue``, vLLM's eviction (k blocks off the head of its free queue, their
hashes dropped), and ``numpy-argpartition``, tpool's old O(P) scan. tpool's eviction
and vLLM's are flat in the pool size; the scan's is linear.
"""

import pytest
import torch

from _common import default_device, device_timed_benchmark
from bench_evict import VllmEvict, cached_pools, malloc_keeps_memory, numpy_select

DEVICE = default_device()
benchmark = device_timed_benchmark()  # on CUDA its clock waits for the device (_common)
BACKENDS = ["triton", "reference"] if DEVICE == "cuda" else ["numba", "reference"]
POOL_SIZES = [65536, 1048576, 16777216]
ROUNDS = 20


def evict_one(benchmark, impl, P, k, group):
    benchmark.group = group
    benchmark.extra_info.update(device=DEVICE, num_pages=P, k=k, impl=impl)
    backend = impl.removeprefix("tpool-") if impl.startswith("tpool-") else BACKENDS[0]
    pool = cached_pools(P, list(dict.fromkeys([BACKENDS[0], backend])), DEVICE)[backend]  # built fast, copied
    if impl == "numpy-argpartition":
        st, sp = pool.state.page_state.cpu().numpy(), pool.state.stamp.cpu().numpy()
        with malloc_keeps_memory():  # its temporaries reuse mapped memory: no page faults by chance (bench_evict)
            benchmark.pedantic(numpy_select, args=(st, sp, k), rounds=ROUNDS, warmup_rounds=1)
        return
    if impl == "vllm-queue":
        model, evicted = VllmEvict(pool), []

        def refill_vllm():  # untimed, after each round: the blocks hashed again and freed to the tail
            assert len(evicted[-1]) == k, "evicted fewer than k pages"
            model.refill(evicted.pop())
        benchmark.pedantic(lambda: evicted.append(model.evict(k)), teardown=refill_vllm, rounds=ROUNDS,
                           warmup_rounds=1)
        return
    out = torch.empty(k, dtype=torch.int32, device=DEVICE)
    counts = torch.tensor([k], dtype=torch.int32, device=DEVICE)
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)

    def evict():
        pool.evict(k, out=out)
        sync()

    refill_out = pool.alloc_out(max_batch=1, max_pages=k)

    def refill():  # untimed: a check that k pages were evicted, then they come back as the newest cached ones
        assert int(out[-1]) >= 0, "evicted fewer than k pages"
        res = pool.alloc(counts, out=refill_out)
        assert bool(res.ok[0]), "the refill failed"
        pool.free(res.pages, cache=True)

    rounds = ROUNDS if impl != "tpool-reference" else 5
    benchmark.pedantic(evict, teardown=refill, rounds=rounds, warmup_rounds=1)
    pool.check()


@pytest.mark.parametrize("impl", ["vllm-queue", "numpy-argpartition"] + [f"tpool-{be}" for be in BACKENDS])
@pytest.mark.parametrize("k", [1, 64, 4096])
def test_evict(benchmark, impl, k):
    evict_one(benchmark, impl, 65536, k, f"evict k={k}, pool of 65536 pages")


@pytest.mark.parametrize("impl", ["numpy-argpartition", f"tpool-{BACKENDS[0]}"])  # vllm-queue: 16M objects
@pytest.mark.parametrize("P", POOL_SIZES)
def test_evict_against_pool_size(benchmark, impl, P):
    evict_one(benchmark, impl, P, 64, "evict k=64 against pool size")
