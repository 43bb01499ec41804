"""Benchmark: evict the k least recently used cached pages from a pool where half the pages are cached.

Each sample: one ``evict(k)`` timed alone; then, untimed, the evicted pages are
allocated again and released to the cache (newest stamps), so every sample
sees the same number of cached pages. Baseline, in the same run:
``numpy-argpartition``, the vectorised host answer without a queue (select the
k smallest (stamp, id) keys among the cached pages with ``np.argpartition``,
then sort those k: a pass over the pool, as tpool's eviction was before session
28), run on the same state. tpool reads its LRU queue from the head instead, so
its cost follows k, not the pool. A sweep (several ``--pool-sizes``) builds every
size at once and takes turns between them sample by sample.

The numpy baseline allocates ~20 bytes per page of temporaries each call (10 MB at
1M pages): glibc hands blocks that large out with a fresh ``mmap`` and returns them
on ``free``, so each call would pay its page faults, or not, as the allocator's
dynamic threshold drifts (1.7 ms or 4 ms at 1M pages, run to run). While it times,
the script turns that off (``mallopt``: no ``mmap`` for large blocks, no trimming
of the heap), so every call reuses memory already mapped, as a long-running
server's allocator does; the previous settings are restored at the end.

    python benchmarks/bench_evict.py                   # the table, about 10 s
    python benchmarks/bench_evict.py --pool-sizes 65536 262144 1048576 4194304 16777216 \
        --backends numba --plot evict.png                # flat in the pool size (numpy: linear)
"""

import argparse
import contextlib
import ctypes
import functools
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import (HelpFormatter, check_backends, default_device, device_arg, multiple_of, out_path,  # noqa: E402
                     parse_args_for_plot, plot_lines, positive_int, print_table, progress, quantiles, write_json)

import tpool  # noqa: E402
from tpool.graphs import state_tensors  # noqa: E402
from tpool.kernels import layout as L  # noqa: E402

CACHE_CALLS = 256  # distinct stamps among the cached pages


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
            for dst, src in zip(state_tensors(pool), state_tensors(first)):
                dst.copy_(src)
        pool.check_invariants()
    return pools


def numpy_select(state, stamp, k):
    ids = np.flatnonzero(state == L.CACHED)
    keys = stamp[ids] * len(state) + ids
    k = min(k, len(ids))
    part = np.argpartition(keys, k - 1)[:k]
    return ids[part[np.argsort(keys[part])]]


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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="Progress goes to stderr, one line per row. Every --k must be at most half "
                                        "the smallest pool size (the cached pages), or a sample would evict fewer.",
                                 formatter_class=HelpFormatter)
    ap.add_argument("--pool-sizes", "--pages", dest="pages", nargs="+", default=[65536, 1048576], metavar="P",
                    type=multiple_of(2 * CACHE_CALLS, f"half the pool is cached in {CACHE_CALLS} equal frees"),
                    help=f"pages in the pool, a multiple of {2 * CACHE_CALLS}, half of them cached (tpool's eviction "
                         "is flat in P, the numpy baseline's linear); several sizes are built at once and take "
                         "turns sample by sample")
    ap.add_argument("--k", type=positive_int, nargs="+", default=[1, 64, 4096],
                    help="pages evicted per call, each at most half the smallest --pool-sizes")
    ap.add_argument("--device", default=default_device(), type=device_arg, help="torch device of the pools")
    ap.add_argument("--backends", nargs="+", default=None,
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
    for P in args.pages:
        progress(f"pool {P:,} pages: caching half of them")
        pools[P] = cached_pools(P, backends, device)
    with malloc_keeps_memory():
        for k in args.k:
            sizes = "pool sizes taking turns" if len(pools) > 1 else f"pool {args.pages[0]:,} pages"
            samplers = {"numpy-argpartition": {P: numpy_sampler(p[backends[0]], k) for P, p in pools.items()}}
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
                base = None
                for name, ts in times.items():
                    med, p20, p80 = quantiles(ts[P])
                    base = base or med
                    rows.append(dict(pages=P, k=k, impl=name, median_us=med, p20_us=p20, p80_us=p80,
                                     vs_numpy=base / med, device=str(device)))
    del pools
    rows.sort(key=lambda r: (r["pages"], args.k.index(r["k"])))  # stable: the implementations keep their order
    table = [[f"{r['pages']:,}", r["k"], r["impl"], f"{r['median_us']:.1f}", f"{r['p20_us']:.1f}",
              f"{r['p80_us']:.1f}", f"{r['vs_numpy']:.2f}x"] for r in rows]
    print_table(f"evict k of the oldest cached pages (half the pool cached), on {device} (us per call)",
                ["pages", "k", "impl", "median", "p20", "p80", "vs numpy"], table)
    write_json(args.json, "bench_evict", rows)
    series = {}
    for r in rows:
        series.setdefault(f"{r['impl']}, k={r['k']}", []).append((r["pages"], r["median_us"], r["p20_us"], r["p80_us"]))
    plot_lines(args.plot, series, xlabel="pool size (pages, half cached)",
               title=f"evict k oldest cached pages on {device} against pool size")

if __name__ == "__main__":
    main()
