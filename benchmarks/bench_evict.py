"""Benchmark: evict the k least recently used cached pages from a pool where half the pages are cached.

Each sample: one eviction of k pages timed alone; then, untimed, the evicted pages are
allocated again and released to the cache (newest), so every sample sees the same number of
cached pages. Rows, on the same state (the same pages cached, in the same LRU order):

* ``vllm-queue`` (the ratios' baseline): vLLM's eviction. Its free queue holds the cached
  blocks, least recently used at the head; ``BlockPool.get_new_blocks(k)`` pops k blocks off
  the head (``popleft_n``) and drops each one's hash from the prefix-cache map as it goes
  (``_maybe_evict_cached_block``): O(k), in Python objects on the host
  (vllm/v1/core/block_pool.py, vllm/v1/core/kv_cache_utils.py; the model is
  ``_engines.VllmBlockPool``). vLLM evicts only as it allocates, so the timed call also references
  the k blocks; the untimed refill hashes them again and frees them, latest-position first
  (``free_blocks(reversed(...))``, as vLLM frees a request), onto the tail.
* ``numpy-argpartition``: tpool's old O(P) scan (before session 28), not an engine: the k
  smallest (stamp, id) keys among the cached pages by ``np.argpartition``, then those k
  sorted, on a copy of the state taken when the row starts.
* ``tpool-<backend>``: ``pool.evict(k)``, which reads its LRU queue from the head, so its
  cost follows k, not the pool.

A sweep (several ``--pool-sizes``) builds every size at once and takes turns between them
sample by sample.

The numpy row allocates ~20 bytes per page of temporaries each call (10 MB at 1M pages):
glibc hands blocks that large out with a fresh ``mmap`` and returns them on ``free``, so
each call would pay its page faults, or not, as the allocator's dynamic threshold drifts
(1.7 ms or 4 ms at 1M pages, run to run). While it times, the script turns that off
(``mallopt``: no ``mmap`` for large blocks, no trimming of the heap), so every call reuses
memory already mapped, as a long-running server's allocator does; the previous settings
are restored at the end.

    python benchmarks/bench_evict.py                   # the table, about 15 s
    python benchmarks/bench_evict.py --pool-sizes 65536 262144 1048576 4194304 16777216 \
        --backends numba --plot evict.png                # flat in the pool size (numpy: linear)
"""

import argparse
import contextlib
import ctypes
import functools
import gc
import itertools
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import (Distinct, HelpFormatter, check_backends, default_device, device_arg, gc_quiet,  # noqa: E402
                     multiple_of, out_path, parse_args_for_plot, plot_lines, positive_int, print_table, progress,
                     quantiles, ratio_text, write_json)
from _engines import VLLM_MAX_PAGES, VllmBlockPool, block_hash_key  # noqa: E402

import tpool  # noqa: E402
from tpool.graphs import state_tensors  # noqa: E402
from tpool.kernels import layout as L  # noqa: E402

CACHE_CALLS = 256  # distinct stamps among the cached pages
EPILOG = ("Progress goes to stderr, one line per row. Rows: vllm-queue, vLLM's eviction "
          "(BlockPool.get_new_blocks(k): k blocks popped off the head of its linked free queue, each one's hash "
          "dropped from the prefix-cache map, each referenced), the ratios' baseline; numpy-argpartition, "
          "tpool's old O(P) scan (the k smallest (stamp, id) keys of the cached pages by np.argpartition, then "
          "sorted), not an engine; tpool-<backend>, pool.evict(k) from its LRU queue. vllm-queue evicts the "
          "pages tpool's first backend evicts, in the same order. Ratio 'vs vllm-queue': vllm-queue's median "
          "over the row's, same k and pool size (above 1: the row is faster). Every --k must be at most half "
          "the smallest pool size (the cached pages), or a sample would evict fewer.")


def cached_pools(P, backends, device):
    """``{backend: pool}`` of ``P`` pages, half of them cached in ``CACHE_CALLS`` frees of random order,
    the same state in every pool: built on the first backend, copied into the others (the reference
    backend's cached free rebuilds its whole LRU queue each call, ~0.6 s at 1M pages on a CPU)."""
    pools = {be: tpool.PagePool(P, device=device, backend=be, max_alloc_pages=P) for be in backends}
    first = pools[backends[0]]
    pages = first.alloc(torch.tensor([P], dtype=torch.int32, device=device)).pages
    half = pages[: P // 2].view(CACHE_CALLS, -1)
    for row in half[torch.randperm(CACHE_CALLS, generator=torch.Generator().manual_seed(0))]:
        first.free(row.contiguous(), cache=True)
    for pool in pools.values():
        if pool is not first:
            for dst, src in zip(state_tensors(pool), state_tensors(first), strict=True):
                dst.copy_(src)
        pool.check_invariants()
    return pools


def numpy_select(state, stamp, k):
    ids = np.flatnonzero(state == L.CACHED)
    keys = stamp[ids] * len(state) + ids
    k = min(k, len(ids))
    part = np.argpartition(keys, k - 1)[:k]
    return ids[part[np.argsort(keys[part])]]


def lru_order(pool) -> list:
    """``pool``'s CACHED pages, least recently used first: evicted, by the pool's own LRU queue, from a copy."""
    copy = tpool.PagePool(pool.num_pages, device=pool.device, backend=pool.backend, max_alloc_pages=pool.num_pages)
    for dst, src in zip(state_tensors(copy), state_tensors(pool), strict=True):
        dst.copy_(src)
    cached = copy.stats()["pages.cached.current"]
    return copy.evict(cached).tolist() if cached else []


class VllmEvict:
    """vLLM's block pool in the state of a tpool pool: every page held but the CACHED ones, which sit on the
    free queue in ``pool``'s LRU order with a hash each. Block ``i + 1`` is page ``i`` (block 0: the null block).
    """

    def __init__(self, pool):
        self.vllm = VllmBlockPool(pool.num_pages + 1)
        self.hashes = itertools.count()
        blocks = self.vllm.blocks
        self.vllm.get_new_blocks(pool.num_pages)  # every page held, as after cached_pools' alloc
        order = [blocks[page + 1] for page in lru_order(pool)]
        for block in order:
            self.vllm.cache_block(block, block_hash_key(next(self.hashes)))
        self.vllm.free_blocks(order)  # cached: appended to the tail in order, least recently used at the head

    def evict(self, k):
        """The timed call: k blocks off the head, their hashes dropped (vLLM's get_new_blocks)."""
        return self.vllm.get_new_blocks(k)

    def refill(self, blocks):
        """Untimed: the blocks filled and hashed again, then freed as vLLM frees a request (reversed)."""
        for block in blocks:
            self.vllm.cache_block(block, block_hash_key(next(self.hashes)))
        self.vllm.free_blocks(reversed(blocks))


def vllm_sampler(model, k):
    """One timed ``model.evict(k)`` per call (µs); then, untimed, checks it evicted k cached pages and refills
    them. ``sample.evicted``: the page ids the last call evicted, oldest first."""
    cached = len(model.vllm.cached_block_hash_to_block)

    def sample():
        t0 = time.perf_counter_ns()
        blocks = model.evict(k)
        us = (time.perf_counter_ns() - t0) / 1e3
        if len(blocks) != k or len(model.vllm.cached_block_hash_to_block) != cached - k:
            raise AssertionError(f"vllm-queue evicted {cached - len(model.vllm.cached_block_hash_to_block)} "
                                 f"cached pages of {k}")
        sample.evicted = [b.block_id - 1 for b in blocks]
        model.refill(blocks)
        return us
    return sample


@contextlib.contextmanager
def malloc_keeps_memory():
    """glibc only (elsewhere a no-op): large blocks from the heap, never given back (the module note)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt  # noqa: B018  (glibc has it; musl's libc.so.6 does not)
    except (OSError, AttributeError):
        yield False
        return
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    libc.mallopt(M_MMAP_MAX, 0)
    libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
    try:
        yield True
    finally:  # glibc's defaults (its dynamic mmap threshold stays off: fixed at its 128 KiB default)
        libc.mallopt(M_MMAP_MAX, 65536)
        libc.mallopt(M_TRIM_THRESHOLD, 128 * 1024)


def parser() -> argparse.ArgumentParser:
    """The command line: every option with its help and default."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=EPILOG, formatter_class=HelpFormatter)
    ap.add_argument("--pool-sizes", "--pages", dest="pages", nargs="+", action=Distinct,
                    default=[65536, 1048576], metavar="P",
                    type=multiple_of(2 * CACHE_CALLS, f"half the pool is cached in {CACHE_CALLS} equal frees"),
                    help=f"pages in the pool, a multiple of {2 * CACHE_CALLS}, half of them cached (tpool's eviction "
                         "is flat in P, the numpy baseline's linear); several sizes are built at once and take "
                         "turns sample by sample")
    ap.add_argument("--k", type=positive_int, nargs="+", action=Distinct, default=[1, 64, 4096],
                    help="pages evicted per call, each at most half the smallest --pool-sizes")
    ap.add_argument("--device", default=default_device(), type=device_arg, help="torch device of the pools")
    ap.add_argument("--backends", nargs="+", action=Distinct, default=None,
                    help="tpool backends to time (default: numba and reference on CPU; triton and reference on CUDA)")
    ap.add_argument("--samples", type=positive_int, default=20,
                    help="calls timed per row, one call each (the reference backend: a fifth, at least 3)")
    ap.add_argument("--json", type=out_path, default="", metavar="PATH", help="also write the rows as JSON")
    ap.add_argument("--plot", type=out_path, default="", metavar="PATH",
                    help="also write a PNG: us against the pool size")
    return ap


def numpy_sampler(pool, k):
    """One timed ``numpy_select`` on a copy of ``pool``'s state (taken now) per call; µs."""
    st, sp = pool.state.page_state.cpu().numpy().copy(), pool.state.stamp.cpu().numpy().copy()
    numpy_select(st, sp, k)  # untimed: the allocator maps its blocks once

    def sample():
        t0 = time.perf_counter_ns()
        numpy_select(st, sp, k)
        return (time.perf_counter_ns() - t0) / 1e3
    return sample


def tpool_sampler(pool, k, sync):
    """One timed ``pool.evict(k)`` per call (µs); then, untimed, checks it evicted k pages and puts k pages
    back in the cache (allocated through ``alloc_out`` and freed with ``cache=True``: the newest stamps)."""
    device = pool.device
    out = torch.empty(k, dtype=torch.int32, device=device)
    counts = torch.tensor([k], dtype=torch.int32, device=device)
    refill = pool.alloc_out(max_batch=1, max_pages=k)

    def sample():
        sync()
        t0 = time.perf_counter_ns()
        pool.evict(k, out=out)
        sync()
        us = (time.perf_counter_ns() - t0) / 1e3
        if int(out[-1]) < 0:  # -1 padded: fewer than k cached pages were left
            raise AssertionError(f"evict({k}) evicted {int((out >= 0).sum())} pages")
        res = pool.alloc(counts, out=refill)
        if not bool(res.ok[0]):
            raise AssertionError(f"the refill of {k} pages failed")
        pool.free(res.pages, cache=True)
        return us
    sample()  # untimed: the first call compiles
    sample.out = out  # the pages the last call evicted, oldest first
    return sample


def main(argv=None):
    ap = parser()
    args = parse_args_for_plot(ap, argv)
    for k in args.k:
        if k > min(args.pages) // 2:
            ap.error(f"argument --k: {k} is more than the cached half of the pool ({min(args.pages) // 2} pages "
                     f"of --pool-sizes {min(args.pages)}): at most {min(args.pages) // 2}")
    device = torch.device(args.device)
    backends = args.backends or (["triton", "reference"] if device.type == "cuda" else ["numba", "reference"])
    check_backends(ap, "--backends", backends, device)
    sync = functools.partial(torch.cuda.synchronize, device) if device.type == "cuda" else (lambda: None)
    rows = []
    pools = {}  # every size at once: the sizes take turns sample by sample
    vllm = {}  # vLLM's pool of each size, in the state of the first backend's: the two take the same samples
    if max(args.pages) > VLLM_MAX_PAGES:
        progress(f"vllm-queue left out of pools past {VLLM_MAX_PAGES:,} pages: that many Python objects")
    for P in args.pages:
        progress(f"pool {P:,} pages: caching half of them" + ("; the vLLM model of it" if P <= VLLM_MAX_PAGES else ""))
        pools[P] = cached_pools(P, backends, device)
        if P <= VLLM_MAX_PAGES:
            vllm[P] = VllmEvict(pools[P][backends[0]])
    gc_quiet()  # vLLM's blocks are a Python object per page: no GC pass may walk them while a row times
    with malloc_keeps_memory():
        for k in args.k:
            sizes = "pool sizes taking turns" if len(pools) > 1 else f"pool {args.pages[0]:,} pages"
            samplers = {"vllm-queue": {P: vllm_sampler(model, k) for P, model in vllm.items()}} if vllm else {}
            samplers["numpy-argpartition"] = {P: numpy_sampler(p[backends[0]], k) for P, p in pools.items()}
            for be in backends:
                samplers[f"tpool-{be}"] = {P: tpool_sampler(p[be], k, sync) for P, p in pools.items()}
            times = {}
            for name, by_size in samplers.items():
                samples = max(3, args.samples // 5) if name == "tpool-reference" else args.samples
                progress(f"k={k}, {name}: {samples} samples, {sizes}")
                ts = times[name] = {P: [] for P in by_size}
                keys = list(by_size)
                for t in range(samples):
                    for P in keys[t % len(keys):] + keys[:t % len(keys)]:  # the order rotates each turn
                        ts[P].append(by_size[P]())
            for p in pools.values():
                for pool in p.values():
                    pool.check()
            for P in pools:
                base = quantiles(times["vllm-queue"][P])[0] if P in vllm else None
                for name, ts in times.items():
                    if P not in ts:
                        continue
                    med, p20, p80 = quantiles(ts[P])
                    rows.append(dict(pages=P, k=k, impl=name, median_us=med, p20_us=p20, p80_us=p80,
                                     device=str(device)))
                    if base:
                        rows[-1]["vs_vllm_queue"] = base / med
    del pools, vllm
    gc.unfreeze()
    rows.sort(key=lambda r: (r["pages"], args.k.index(r["k"])))  # stable: the implementations keep their order
    table = [[f"{r['pages']:,}", r["k"], r["impl"], f"{r['median_us']:.1f}", f"{r['p20_us']:.1f}",
              f"{r['p80_us']:.1f}", ratio_text(r.get("vs_vllm_queue"))] for r in rows]
    print_table(f"evict k of the oldest cached pages (half the pool cached), on {device} (us per call)",
                ["pages", "k", "impl", "median", "p20", "p80", "vs vllm-queue"], table,
                note="Ratios: vllm-queue's median over the row's (above 1: faster). vllm-queue: vLLM's eviction, "
                     "k blocks popped off the head of its free queue, each one's hash dropped from the prefix-cache "
                     "map (get_new_blocks, which also references them), O(k), host Python objects. "
                     "numpy-argpartition: tpool's old O(P) scan, not an engine. vllm-queue evicts the pages tpool "
                     "evicts, in the same order.")
    write_json(args.json, "bench_evict", rows)
    series = {}
    for r in rows:
        series.setdefault(f"{r['impl']}, k={r['k']}", []).append((r["pages"], r["median_us"], r["p20_us"], r["p80_us"]))
    plot_lines(args.plot, series, xlabel="pool size (pages, half cached)",
               title=f"evict k oldest cached pages on {device} against pool size")

if __name__ == "__main__":
    main()
