"""Benchmark: a prefix-cache hit, k cached pages revived into an empty row, three ways.

Each sample: one revive timed alone (an empty row takes k CACHED pages: each gains a
reference, the row holds them, its length is k pages); then, untimed, the row is checked
and released with ``cache=True``, so every sample revives the same CACHED pages into the
same empty row. Rows, on the same state, in one run:

* ``host-blocks`` (the ratios' baseline): vLLM's block pool on a prefix hit (``touch``):
  per block, taken off the doubly linked free queue when its ``ref_cnt`` is 0, then
  ``ref_cnt += 1``, and the blocks listed for the request; Python objects, no device.
* ``tpool-<backend> table.revive``: ``PageTable.revive``, one table call (one numba kernel
  call, one Triton launch), all or none, checked on the device.
* ``tpool-<backend> by hand``: what a scheduler writes without that call, the same checks
  in torch ops (what ``HostMirror.revive`` ran until session 19): the pages' states read,
  the ids sorted to find a repeat, an all-or-none ``pool.incref``, the row's
  ``block_table`` entries and length written, then ``table.invalidate_csr(row)``.

    python benchmarks/bench_revive.py                    # the table, a few seconds
    python benchmarks/bench_revive.py --k 32 --backends numba --samples 500
"""

import argparse
import functools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import (HelpFormatter, check_backends, default_device, device_arg, out_path, positive_int,  # noqa: E402
                     print_table, progress, quantiles, write_json)

import tpool  # noqa: E402
from tpool.kernels import layout as L  # noqa: E402

PAGE_SIZE = 16


class Block:
    """vLLM's ``KVCacheBlock``: an id, a reference count and free-queue links."""

    __slots__ = ("block_id", "ref_cnt", "prev", "next")

    def __init__(self, block_id):
        self.block_id, self.ref_cnt, self.prev, self.next = block_id, 0, None, None


class FreeQueue:
    """vLLM's ``FreeKVCacheBlockQueue``: a doubly linked list with O(1) removal from the middle."""

    def __init__(self, blocks):
        self.head, self.tail = Block(-1), Block(-1)
        self.head.next, self.tail.prev = self.tail, self.head
        for b in blocks:
            self.append(b)

    def remove(self, b):
        b.prev.next, b.next.prev = b.next, b.prev
        b.prev = b.next = None

    def append(self, b):
        last = self.tail.prev
        last.next, b.prev, b.next, self.tail.prev = b, last, self.tail, b


def host_sampler(k):
    """One timed prefix hit on vLLM-style blocks (µs); then, untimed, the request frees them (back on the queue)."""
    blocks = [Block(i) for i in range(4 * k)]
    queue = FreeQueue(blocks)
    hit = blocks[k:2 * k]  # cached blocks (ref_cnt 0, on the free queue, content kept)
    held = {}

    def sample():
        t0 = time.perf_counter_ns()
        for b in hit:  # BlockPool.touch
            if b.ref_cnt == 0:
                queue.remove(b)
            b.ref_cnt += 1
        held[1] = list(hit)  # the request's block list
        us = (time.perf_counter_ns() - t0) / 1e3
        for b in reversed(held.pop(1)):  # BlockPool.free_blocks: evictable again, newest last
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                queue.append(b)
        return us
    return sample


def by_hand(table, row, pages, n_tokens):
    """The revive in torch ops, as ``HostMirror.revive`` made it before ``PageTable.revive``."""
    pool, k = table.pool, pages.numel()
    state = pool.state.page_state.index_select(0, pages.clamp(0, pool.num_pages - 1))
    taken = (pages >= 0) & (pages < pool.num_pages) & ((state == L.USED) | (state == L.CACHED))
    ids = pages.sort().values
    whole = taken.all() & (ids[1:] != ids[:-1]).all()  # every page taken, or none is
    pool.incref(torch.where(whole, pages, torch.where(taken, L.NULL_PAGE, pages)))
    table.block_table[row, :k] = torch.where(whole, pages, L.NULL_PAGE)
    table.seq_lens[row:row + 1] = whole.to(torch.int32) * n_tokens
    table.invalidate_csr(torch.tensor([row], dtype=torch.int32, device=table.device))


def cached_table(k, backend, device):
    """A table whose row 0 held k pages, released with ``cache=True``; returns it and the pages."""
    pool = tpool.PagePool(4 * k, page_size=PAGE_SIZE, device=device, backend=backend)
    table = tpool.PageTable(pool, max_requests=2, max_pages_per_request=k)
    row0 = torch.tensor([0], dtype=torch.int32, device=device)
    res = table.extend(row0, torch.tensor([k * PAGE_SIZE], dtype=torch.int32, device=device),
                       max_tokens=k * PAGE_SIZE)
    if not bool(res.ok[0]):
        raise AssertionError(f"the prefill of {k} pages failed")
    pages = table.block_table[0, :k].clone()
    table.release(row0, cache=True)
    return table, pages


def tpool_sampler(k, backend, device, sync, hand):
    """One timed revive of the k cached pages into row 1 (µs); then, untimed, checks it and releases the row."""
    table, pages = cached_table(k, backend, device)
    row1 = torch.tensor([1], dtype=torch.int32, device=device)
    n = k * PAGE_SIZE
    revive = functools.partial(by_hand, table, 1, pages, n) if hand else functools.partial(table.revive, 1, pages, n)

    def sample():
        sync()
        t0 = time.perf_counter_ns()
        revive()
        sync()
        us = (time.perf_counter_ns() - t0) / 1e3
        if int(table.seq_lens[1]) != n:
            raise AssertionError(f"the revive of {k} cached pages was refused")
        table.release(row1, cache=True)
        return us
    sample()  # untimed: the first call compiles
    sampler = sample
    sampler.table = table
    return sampler


def parser() -> argparse.ArgumentParser:
    """The command line: every option with its help and default."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="Progress goes to stderr, one line "
                                 "per k.", formatter_class=HelpFormatter)
    ap.add_argument("--k", type=positive_int, nargs="+", default=[8, 64, 512],
                    help=f"pages per hit (of {PAGE_SIZE} tokens)")
    ap.add_argument("--device", default=default_device(), type=device_arg, help="torch device of the pools")
    ap.add_argument("--backends", nargs="+", default=None,
                    help="tpool backends to time (default: numba and reference on CPU; triton and reference on CUDA)")
    ap.add_argument("--samples", type=positive_int, default=200,
                    help="calls timed per row, one call each, the rows taking turns (the reference backend: a "
                         "tenth, at least 3)")
    ap.add_argument("--json", type=out_path, default="", metavar="PATH", help="also write the rows as JSON")
    return ap


def main(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    backends = args.backends or (["triton", "reference"] if device.type == "cuda" else ["numba", "reference"])
    check_backends(ap, "--backends", backends, device)
    sync = functools.partial(torch.cuda.synchronize, device) if device.type == "cuda" else (lambda: None)
    rows = []
    for k in args.k:
        progress(f"k={k} pages")
        samplers = {"host-blocks": host_sampler(k)}
        for be in backends:
            samplers[f"tpool-{be} table.revive"] = tpool_sampler(k, be, device, sync, hand=False)
            samplers[f"tpool-{be} by hand"] = tpool_sampler(k, be, device, sync, hand=True)
        times = {name: [] for name in samplers}
        for t in range(args.samples):  # the rows take turns, so the machine's noise lands on all alike
            for name, sample in samplers.items():
                if "reference" in name and t % 10 and t >= 3:
                    continue
                times[name].append(sample())
        for name, sample in samplers.items():
            if hasattr(sample, "table"):
                sample.table.pool.check()
                sample.table.check_invariants(exclusive=False)
        base = quantiles(times["host-blocks"])[0]
        for name, ts in times.items():
            med, p20, p80 = quantiles(ts)
            rows.append(dict(k=k, impl=name, median_us=med, p20_us=p20, p80_us=p80, vs_host_blocks=base / med,
                             samples=len(ts), device=str(device)))
    table = [[r["k"], r["impl"], f"{r['median_us']:.2f}", f"{r['p20_us']:.2f}", f"{r['p80_us']:.2f}",
              f"{r['vs_host_blocks']:.2f}x"] for r in rows]
    print_table(f"revive k cached pages into an empty row (a prefix-cache hit), pages of {PAGE_SIZE}, on {device} "
                "(us per call)", ["k", "impl", "median", "p20", "p80", "vs host-blocks"], table,
                note="Ratios: host-blocks' median over the row's (above 1: faster). host-blocks: vLLM's block pool "
                     "on a prefix hit (each block off the free queue if unreferenced, ref_cnt += 1), on the host, "
                     "unchecked. by hand: the same device checks as table.revive in a dozen torch ops.")
    write_json(args.json, "bench_revive", rows)


if __name__ == "__main__":
    main()
