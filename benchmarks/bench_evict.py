"""Benchmark: evict the k least recently used cached pages from a pool where half the pages are cached.

Each sample: one ``evict(k)`` timed alone; then, untimed, the evicted pages are
allocated again and released to the cache (newest stamps), so every sample
sees the same number of cached pages. Baseline, in the same run:
``numpy-argpartition``, the vectorised host answer (select the k smallest
(stamp, id) keys among the cached pages with ``np.argpartition``, then sort
those k), run on the same state.

    python benchmarks/bench_evict.py                   # the table, about 10 s
    python benchmarks/bench_evict.py --pool-sizes 65536 262144 1048576 4194304 16777216 \
        --backends numba --plot evict.png                # linear in the pool size
"""

import argparse
import functools
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import (HelpFormatter, default_device, parse_args_for_plot, plot_lines, positive_int,  # noqa: E402
                     print_table, progress, quantiles, write_json)

import tpool  # noqa: E402
from tpool.kernels import layout as L  # noqa: E402

CACHE_CALLS = 256  # distinct stamps among the cached pages


def cached_pool(P, backend, device):
    pool = tpool.PagePool(P, device=device, backend=backend, max_alloc_pages=P)
    pages = pool.alloc(torch.tensor([P], dtype=torch.int32, device=device)).pages
    half = pages[: P // 2].view(CACHE_CALLS, -1)
    for row in half[torch.randperm(CACHE_CALLS, generator=torch.Generator().manual_seed(0))]:
        pool.free(row.contiguous(), cache=True)
    return pool


def numpy_select(state, stamp, k):
    ids = np.flatnonzero(state == L.CACHED)
    keys = stamp[ids] * len(state) + ids
    k = min(k, len(ids))
    part = np.argpartition(keys, k - 1)[:k]
    return ids[part[np.argsort(keys[part])]]


def parser() -> argparse.ArgumentParser:
    """The command line: every option with its help and default."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="Progress goes to stderr, one line per row.",
                                 formatter_class=HelpFormatter)
    ap.add_argument("--pool-sizes", "--pages", dest="pages", type=int, nargs="+", default=[65536, 1048576],
                    metavar="P", help="pages in the pool, half of them cached (eviction is linear in P)")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 64, 4096], help="pages evicted per call")
    ap.add_argument("--device", default=default_device(), help="torch device of the pools")
    ap.add_argument("--backends", nargs="+", default=None,
                    help="tpool backends to time (default: numba and reference on CPU; triton and reference on CUDA)")
    ap.add_argument("--samples", type=positive_int, default=20,
                    help="calls timed per row, one call each (the reference backend: a fifth, at least 3)")
    ap.add_argument("--json", default="", metavar="PATH", help="also write the rows as JSON")
    ap.add_argument("--plot", default="", metavar="PATH", help="also write a PNG: us against the pool size")
    return ap


def main(argv=None):
    args = parse_args_for_plot(parser(), argv)
    device = torch.device(args.device)
    backends = args.backends or (["triton", "reference"] if device.type == "cuda" else ["numba", "reference"])
    sync = functools.partial(torch.cuda.synchronize, device) if device.type == "cuda" else (lambda: None)
    rows, table = [], []
    for P in args.pages:
        progress(f"pool {P:,} pages: caching half of them")
        pools = {be: cached_pool(P, be, device) for be in backends}
        for k in args.k:
            progress(f"pool {P:,} pages, k={k}")
            ref_pool = pools[backends[0]]
            st = ref_pool.state.page_state.cpu().numpy()
            sp = ref_pool.state.stamp.cpu().numpy()
            times = {"numpy-argpartition": []}
            for _ in range(args.samples):
                t0 = time.perf_counter_ns()
                numpy_select(st, sp, k)
                times["numpy-argpartition"].append((time.perf_counter_ns() - t0) / 1e3)
            for be, pool in pools.items():
                out = torch.empty(k, dtype=torch.int32, device=device)
                counts = torch.tensor([k], dtype=torch.int32, device=device)
                ts = times[f"tpool-{be}"] = []
                samples = args.samples if be != "reference" else max(3, args.samples // 5)
                for i in range(samples + 1):
                    sync()
                    t0 = time.perf_counter_ns()
                    pool.evict(k, out=out)
                    sync()
                    if i:  # the first call compiles
                        ts.append((time.perf_counter_ns() - t0) / 1e3)
                    pool.free(pool.alloc(counts).pages, cache=True)
                pool.check()
            base = None
            for name, ts in times.items():
                med, p20, p80 = quantiles(ts)
                base = base or med
                rows.append(dict(pages=P, k=k, impl=name, median_us=med, p20_us=p20, p80_us=p80,
                                 vs_numpy=base / med, device=str(device)))
                table.append([f"{P:,}", k, name, f"{med:.1f}", f"{p20:.1f}", f"{p80:.1f}", f"{base / med:.2f}x"])
        del pools
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
