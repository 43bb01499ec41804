"""``python -m tpool demo``: batched alloc/free rounds on a pool, with a table of what happened.

Every round, a batch of requests asks for pages (sizes from a fixed seed),
the oldest live requests release theirs, and the host reads nothing back
until the end of the round's timing: ``ok`` and the counters are device data.
"""

import argparse
import statistics
import time

import torch

from tpool.pool import PagePool


def run(num_pages=4096, rounds=12, batch=32, seed=0, device=None, backend="auto", out=print):
    pool = PagePool(num_pages, device=device, backend=backend)
    g = torch.Generator().manual_seed(seed)
    alloc_out = pool.alloc_out(max_batch=batch, max_pages=num_pages)
    live = []  # (round, pages tensor) of requests still holding pages
    sync = torch.cuda.synchronize if pool.device.type == "cuda" else (lambda: None)
    out(f"tpool demo: {pool!r}, {rounds} rounds of {batch} requests\n")
    out(f"{'round':>5} {'asked':>6} {'granted':>7} {'failed':>6} {'in use':>6} {'free':>6} "
        f"{'alloc us':>9} {'free us':>8}")
    alloc_us, free_us = [], []
    for r in range(rounds):
        counts = torch.randint(1, 2 * num_pages // (batch * 3), (batch,), generator=g, dtype=torch.int32)
        counts = counts.to(pool.device)
        sync()
        t0 = time.perf_counter()
        res = pool.alloc(counts, out=alloc_out)
        sync()
        t1 = time.perf_counter()
        live.append(res.pages.clone())        # the owner keeps its pages (the buffer is reused)
        t2 = time.perf_counter()
        if len(live) > 3:                     # requests finish after three rounds
            pool.free(live.pop(0))
        sync()
        t3 = time.perf_counter()
        alloc_us.append((t1 - t0) * 1e6)
        free_us.append((t3 - t2) * 1e6)
        ok = res.ok[:batch]                   # reading results: after the timed calls
        s = pool.stats()
        out(f"{r:>5} {int(counts.sum()):>6} {int(res.indptr[batch]):>7} {int((~ok).sum()):>6} "
            f"{s['pages.used.current']:>6} {s['pages.free.current']:>6} {alloc_us[-1]:>9.1f} {free_us[-1]:>8.1f}")
    pool.check()
    pool.check_invariants()
    s = pool.stats()
    out(f"\nmedian alloc {statistics.median(alloc_us):.1f} us, median free {statistics.median(free_us):.1f} us "
        f"(first round includes JIT compilation)")
    out(f"pages allocated {s['pages.allocated']}, freed {s['pages.freed']}, peak in use {s['pages.used.peak']}, "
        f"failed requests {s['requests.failed']}; invariants hold, no errors")
    return s


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tpool demo", description=__doc__.splitlines()[0])
    ap.add_argument("--num-pages", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--backend", default="auto")
    a = ap.parse_args(argv)
    run(a.num_pages, a.rounds, a.batch, a.seed, a.device, a.backend)


if __name__ == "__main__":
    main()
