"""Benchmark: a prefix-cache hit, k cached pages revived into an empty row, three ways.

Each sample: one revive timed alone (an empty row takes k CACHED pages: each gains a
reference, the row holds them, its length is k pages); then, untimed, the row is checked
and released with ``cache=True``, so every sample revives the same CACHED pages into the
same empty row. Rows, on the same state, in one run:

* ``vllm-touch`` (the ratios' baseline): what vLLM does on a prefix hit between finding
  the blocks and the forward pass, on the blocks tpool revives (block ``i + 1`` is page
  ``i``; ``_engines.VllmBlockPool``). ``BlockPool.touch``: per block, the null-block
  test, ``FreeKVCacheBlockQueue.remove`` (its link checks, ``num_free_blocks -= 1``) when
  ``ref_cnt`` is 0, ``ref_cnt += 1``; the request's block list extended
  (``save_new_computed_blocks``); ``KVCacheBlocks.get_block_ids`` for the scheduler
  output; the worker's ``BlockTable.add_row`` into its numpy block table. Host Python
  objects, one KV cache group (vllm/v1/core/block_pool.py, kv_cache_utils.py,
  kv_cache_manager.py, single_type_kv_cache_manager.py, vllm/v1/worker/block_table.py).
  The hash lookup that found the blocks is not timed (tpool's revive takes the pages too).
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
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import (Distinct, HelpFormatter, check_backends, default_device, device_arg, out_path,  # noqa: E402
                     positive_int, print_table, progress, quantiles, ratio_text, write_json)
from _engines import VLLM_MAX_PAGES, KVCacheBlocks, VllmBlockPool, VllmBlockTable, block_hash_key  # noqa: E402

import tpool  # noqa: E402
from tpool.kernels import layout as L  # noqa: E402

PAGE_SIZE = 16
# Pages per hit at most: each k builds pools of 4 k pages, and the vLLM model of its pool a Python object per page
# (VLLM_MAX_PAGES at most, as the other scripts keep it); more hung building it before the first sample.
MAX_K = VLLM_MAX_PAGES // 4
EPILOG = ("Progress goes to stderr, one line per k. Rows: vllm-touch, vLLM's path on a prefix hit (BlockPool.touch "
          "with FreeKVCacheBlockQueue.remove's checks and free count and the null-block test, the request's block "
          "list, KVCacheBlocks.get_block_ids, the worker's BlockTable.add_row), the ratios' baseline; 'tpool-<backend> "
          "table.revive', PageTable.revive, one call, checked on the device; 'tpool-<backend> by hand', the same "
          "checks in a dozen torch ops. vllm-touch revives the pages tpool does into the same row. Ratio 'vs "
          "vllm-touch': vllm-touch's median over the row's, same k (above 1: the row is faster).")


class VllmRevive:
    """vLLM's pool of ``4 k + 1`` blocks (block 0: the null block) after request 0 ran a prefill of k blocks,
    filled and hashed them and finished: its blocks cached, freed (reversed) onto the free queue's tail, as
    bench_revive's tpool table after ``release(row 0, cache=True)``. Row 1 of the worker's table takes the hits.
    """

    def __init__(self, k):
        self.pool = VllmBlockPool(4 * k + 1)
        prefill = self.pool.get_new_blocks(k)
        for i, block in enumerate(prefill):
            self.pool.cache_block(block, block_hash_key(i))
        self.pool.free_blocks(reversed(prefill))
        self.hit = prefill  # what get_computed_blocks finds for the same prompt (the lookup is not timed)
        self.req_to_blocks = defaultdict(list)  # SingleTypeKVCacheManager's books
        self.num_cached_block = {}
        self.block_tables = [VllmBlockTable(2, k)]  # MultiGroupBlockTable, one group

    def revive(self, request_id, row_idx):
        """The timed call: touch, the request's blocks saved, their ids, the worker's row."""
        self.pool.touch(self.hit)
        if request_id not in self.num_cached_block:  # save_new_computed_blocks, a new request
            req_blocks = self.req_to_blocks[request_id]
            assert len(req_blocks) == 0
            req_blocks.extend(self.hit)
            self.num_cached_block[request_id] = len(self.hit)
        block_ids = KVCacheBlocks((self.req_to_blocks[request_id],)).get_block_ids()
        for i, block_table in enumerate(self.block_tables):
            block_table.add_row(block_ids[i], row_idx)

    def release(self, request_id):
        """Untimed: the request finishes; its blocks are freed, last block first (cached: to the tail)."""
        self.num_cached_block.pop(request_id)
        self.pool.free_blocks(reversed(self.req_to_blocks.pop(request_id)))


def vllm_sampler(k):
    """One timed ``VllmRevive.revive`` of the k cached blocks into row 1 (µs); then, untimed, checks the row
    and releases the request. ``sampler.model``: the VllmRevive."""
    model = VllmRevive(k)
    free = model.pool.get_num_free_blocks()

    def sample():
        t0 = time.perf_counter_ns()
        model.revive("req-1", 1)
        us = (time.perf_counter_ns() - t0) / 1e3
        if model.pool.get_num_free_blocks() != free - k or model.block_tables[0].num_blocks_per_row[1] != k:
            raise AssertionError(f"the vLLM revive of {k} cached blocks left the queue or the row wrong")
        model.release("req-1")
        return us
    sample.model = model
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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=EPILOG, formatter_class=HelpFormatter)
    ap.add_argument("--k", type=positive_int, nargs="+", action=Distinct, default=[8, 64, 512],
                    help=f"pages per hit (of {PAGE_SIZE} tokens), at most {MAX_K:,} (the pools hold 4 k pages, "
                         "the vLLM model's a Python object each)")
    ap.add_argument("--device", default=default_device(), type=device_arg, help="torch device of the pools")
    ap.add_argument("--backends", nargs="+", action=Distinct, default=None,
                    help="tpool backends to time (default: numba and reference on CPU; triton and reference on CUDA)")
    ap.add_argument("--samples", type=positive_int, default=200,
                    help="calls timed per row, one call each, the rows taking turns (the reference backend: a "
                         "tenth, at least 3)")
    ap.add_argument("--json", type=out_path, default="", metavar="PATH", help="also write the rows as JSON")
    return ap


def main(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    if max(args.k) > MAX_K:
        ap.error(f"argument --k: expected at most {MAX_K:,} pages per hit (pools of 4 k pages; the vLLM model holds "
                 f"a Python object per page), got {max(args.k)}")
    device = torch.device(args.device)
    backends = args.backends or (["triton", "reference"] if device.type == "cuda" else ["numba", "reference"])
    check_backends(ap, "--backends", backends, device)
    sync = functools.partial(torch.cuda.synchronize, device) if device.type == "cuda" else (lambda: None)
    rows = []
    for k in args.k:
        progress(f"k={k} pages")
        samplers = {"vllm-touch": vllm_sampler(k)}
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
        base = quantiles(times["vllm-touch"])[0]
        for name, ts in times.items():
            med, p20, p80 = quantiles(ts)
            rows.append(dict(k=k, impl=name, median_us=med, p20_us=p20, p80_us=p80, vs_vllm_touch=base / med,
                             samples=len(ts), device=str(device)))
    table = [[r["k"], r["impl"], f"{r['median_us']:.2f}", f"{r['p20_us']:.2f}", f"{r['p80_us']:.2f}",
              ratio_text(r["vs_vllm_touch"])] for r in rows]
    print_table(f"revive k cached pages into an empty row (a prefix-cache hit), pages of {PAGE_SIZE}, on {device} "
                "(us per call)", ["k", "impl", "median", "p20", "p80", "vs vllm-touch"], table,
                note="Ratios: vllm-touch's median over the row's (above 1: faster). vllm-touch: vLLM on a prefix "
                     "hit (BlockPool.touch with the free queue's checks and count, the request's block list, "
                     "get_block_ids, the worker's BlockTable.add_row), host Python objects and numpy. by hand: the "
                     "same device checks as table.revive in a dozen torch ops.")
    write_json(args.json, "bench_revive", rows)


if __name__ == "__main__":
    main()
