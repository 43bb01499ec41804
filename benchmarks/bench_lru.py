"""Benchmark: an LRU churn under a full cache, step by step, worst steps included.

Every page of the pool is CACHED (what a prefix cache leaves in a full pool). Each
step touches ``--touch`` cached pages (prefix hits refreshing their pages: each
leaves a stale entry in the LRU queue), evicts ``--k`` pages through
``alloc(..., evict=True)`` and caches them again (``free(..., cache=True)``): the
queue gets ``touch + k`` entries a step, and once it spans more than twice the
pool each call that pushes also cleans a bounded stretch of it (at most 4 entries
read per entry pushed; ``kernels/layout.py``). A step's time is the three calls;
the table shows the median, p20/p80, p99 and the worst step, how many steps
cleaned and how many cleaning passes ended (the tail brought back), and the
widest the queue got (positions from head to tail, in pool sizes: a call finding
it past 3 would compact it whole). Baseline, in the same run:
``host-ordereddict``, the same steps
(the two taking turns in blocks of 256 steps) on a Python ``OrderedDict`` kept in LRU
order (``move_to_end`` per touched page,
``popitem(last=False)`` per evicted page, an insert per re-cached page), what a
scheduler without a device pool would keep.

    python benchmarks/bench_lru.py                                   # 65,536 pages, about 10 s
    python benchmarks/bench_lru.py --pool-sizes 1048576 --steps 12000  # whole cleaning passes at 1M pages
"""

import argparse
import collections
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import (Distinct, HelpFormatter, check_backends, default_device, device_arg, out_path,  # noqa: E402
                     in_turns, positive_int, print_table, progress, quantiles, seed_int, write_json)

import tpool  # noqa: E402
from tpool.kernels import layout as L  # noqa: E402


def parser() -> argparse.ArgumentParser:
    """The command line: every option with its help and default."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter,
                                 epilog="Progress goes to stderr, two lines per pool size. The OrderedDict and "
                                        f"tpool take turns in blocks of {BLOCK} steps.")
    ap.add_argument("--pool-sizes", "--pages", dest="pages", nargs="+", action=Distinct,
                    type=positive_int, default=[65536],
                    metavar="P", help="pages in the pool, every one of them cached before the first step")
    ap.add_argument("--steps", type=positive_int, default=4000, help="steps timed per pool size and implementation")
    ap.add_argument("--touch", type=positive_int, default=256,
                    help="cached pages touched per step, at most the smallest pool size")
    ap.add_argument("--k", type=positive_int, default=64,
                    help="pages evicted (and cached again) per step, at most the smallest pool size")
    ap.add_argument("--device", default=default_device(), type=device_arg, help="torch device of the pools")
    ap.add_argument("--backend", default=None, help="tpool backend (default: numba on CPU, triton on CUDA)")
    ap.add_argument("--seed", type=seed_int, default=0, help="seed of the pages touched, 0 to 2**64 - 1")
    ap.add_argument("--json", type=out_path, default="", metavar="PATH", help="also write the rows as JSON")
    return ap


def touched_pages(P, steps, touch, seed) -> np.ndarray:
    """int32 ``[steps, touch]``: the pages each step touches (any page: every page stays cached)."""
    return np.random.default_rng(seed).integers(0, P, (steps, touch), dtype=np.int32)


BLOCK = 256  # steps one implementation runs before the other takes its turn (as bench_scheduler.py's)


def run_tpool(P, args, device, backend, touched) -> tuple:
    """Per-step µs of touch + alloc(evict) + free(cache) on a pool whose every page is cached, and what the
    LRU queue's cleaner did: ``{"cleaned": steps that began with the queue spanning more than twice the pool
    (each call in them that pushes cleans) or ended a pass, "passes": passes that ended (the tail went down),
    "span": the widest the queue was after a step, in positions}``."""
    seen = {}
    return list(tpool_steps(P, args, device, backend, touched, seen)), seen


def tpool_steps(P, args, device, backend, touched, seen):
    """:func:`run_tpool`'s per-step µs one step at a time (the untimed first step made before the first), what
    the cleaner did written into ``seen``; the pool is checked after the last step."""
    i32 = dict(dtype=torch.int32, device=device)
    pool = tpool.PagePool(P, device=device, backend=backend, max_alloc_pages=max(P, args.k))
    pool.free(pool.alloc(torch.tensor([P], **i32)).pages, cache=True)
    out = pool.alloc_out(max_batch=1, max_pages=args.k)
    counts = torch.tensor([args.k], **i32)
    pages = torch.from_numpy(touched).to(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    c = pool.state.counters
    seen.update(cleaned=0, passes=0, span=0)
    for step in range(-1, len(touched)):  # step -1: untimed (compiles)
        tail = int(c[L.LRU_TAIL])
        span = tail - int(c[L.LRU_HEAD])
        sync()
        t0 = time.perf_counter_ns()
        pool.touch(pages[max(step, 0)])
        res = pool.alloc(counts, out=out, evict=True)
        pool.free(res.pages, cache=True)
        sync()
        us = (time.perf_counter_ns() - t0) / 1e3
        if step >= 0:
            passed = int(c[L.LRU_TAIL]) < tail
            seen["passes"] += passed
            seen["cleaned"] += passed or span > 2 * P
            seen["span"] = max(seen["span"], int(c[L.LRU_TAIL] - c[L.LRU_HEAD]))
            yield us
    pool.check()
    pool.check_invariants()
    if pool.stats()["pages.evicted"] != args.k * (len(touched) + 1):
        raise AssertionError("a step evicted fewer pages than asked")


def run_host(P, args, touched) -> list:
    """Per-step µs of the same steps on an OrderedDict in LRU order."""
    return list(host_steps(P, args, touched))


def host_steps(P, args, touched):
    """:func:`run_host`'s per-step µs one step at a time."""
    lru = collections.OrderedDict.fromkeys(range(P))
    for row in touched:
        row = row.tolist()  # (untimed: the device pool takes a tensor it already has)
        t0 = time.perf_counter_ns()
        for p in row:
            lru.move_to_end(p)
        gone = [lru.popitem(last=False)[0] for _ in range(args.k)]
        for p in gone:
            lru[p] = None
        yield (time.perf_counter_ns() - t0) / 1e3


def main(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    backend = args.backend or ("triton" if device.type == "cuda" else "numba")
    check_backends(ap, "--backend", [backend], device)
    for opt, n in (("--touch", args.touch), ("--k", args.k)):
        if n > min(args.pages):  # every page is cached: a step touches or evicts at most the pool
            ap.error(f"argument {opt}: expected at most the smallest pool's {min(args.pages)} pages (--pool-sizes "
                     f"{' '.join(map(str, args.pages))}), got {n}")
    torch.set_num_threads(1)
    rows = []
    for P in args.pages:
        touched = touched_pages(P, args.steps, args.touch, args.seed)
        progress(f"pool {P:,} pages: host OrderedDict and tpool-{backend}, {args.steps} steps, taking turns "
                 f"in blocks of {BLOCK}")
        seen = {}
        host, mine = in_turns([host_steps(P, args, touched), tpool_steps(P, args, device, backend, touched, seen)],
                              args.steps, BLOCK)
        progress(f"pool {P:,} pages: done, the pool checked")
        base = statistics.median(host)
        for name, ts, cleaner in (("host-ordereddict", host, None), (f"tpool-{backend}", mine, seen)):
            med, p20, p80 = quantiles(ts)
            rows.append(dict(pages=P, impl=name, steps=len(ts), median_us=med, p20_us=p20, p80_us=p80,
                             p99_us=float(np.percentile(ts, 99)), max_us=max(ts),
                             cleaned_steps=cleaner["cleaned"] if cleaner else 0,
                             passes=cleaner["passes"] if cleaner else 0,
                             max_span=cleaner["span"] / P if cleaner else 0.0, vs_host=base / med, device=str(device)))
    table = [[f"{r['pages']:,}", r["impl"], f"{r['median_us']:.1f}", f"{r['p20_us']:.1f}", f"{r['p80_us']:.1f}",
              f"{r['p99_us']:.1f}", f"{r['max_us']:.1f}",
              *((r["cleaned_steps"], r["passes"], f"{r['max_span']:.2f}") if r["impl"] != "host-ordereddict"
                else ("-", "-", "-")),
              f"{r['vs_host']:.2f}x"] for r in rows]
    print_table(f"LRU churn, every page cached: a step touches {args.touch}, evicts {args.k} and caches them again, "
                f"on {device} (us per step)",
                ["pages", "impl", "median", "p20", "p80", "p99", "max", "cleaned", "passes", "span", "vs host"], table,
                note="cleaned: steps in which the LRU queue's cleaner ran (the queue spanned more than 2 pools); "
                     "passes: cleaning passes that ended (the tail brought back); span: the widest the queue was "
                     "after a step, in pool sizes (past 3, the next call that pushes compacts it whole). vs host: "
                     "the OrderedDict's median over tpool's (above 1, tpool is faster).")
    write_json(args.json, "bench_lru", rows)


if __name__ == "__main__":
    main()
