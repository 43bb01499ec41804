"""Benchmark: one alloc of N pages followed by one free of them, per backend.

Baselines, measured in the same run; the engines' models are in ``_engines.py`` (the
engines are not dependencies); vllm-queue, sglang-paged and host-list hand out the
pages tpool does (tests/test_bench_baselines.py checks it):

* ``vllm-queue`` (the first ratio column's baseline): vLLM's ``BlockPool`` with prefix
  caching on, its default. ``get_new_blocks`` pops ``KVCacheBlock`` objects off the head
  of ``FreeKVCacheBlockQueue`` (a doubly linked list, ``popleft_n``), checks each for a
  cached hash to drop and sets its ``ref_cnt``; ``free_blocks`` takes the references back
  and links the blocks without a hash back at the head (``prepend_n``), those with one at
  the tail (``append_n``). Host Python objects, no device
  (vllm/v1/core/block_pool.py, vllm/v1/core/kv_cache_utils.py).
* ``sglang-paged`` (the second ratio column's baseline): SGLang's
  ``PagedTokenToKVPoolAllocator`` with pages of 16 tokens: alloc slices the free-page
  tensor and expands the pages into token slots; free divides the slots by the page
  size, ``torch.unique`` s them and concatenates them in front of the free pages
  (python/sglang/srt/mem_cache/allocator/paged.py). State on the pool's device.
* ``torch-slice``: SGLang's ``TokenToKVPoolAllocator`` (page_size 1): N token slots, not
  pages, sliced off the front of a tensor and concatenated at its back (so it walks
  through the pool), no ``torch.unique`` (python/sglang/srt/mem_cache/allocator/token.py).
* ``host-list``: a Python list's slice and extend, the floor of any host-side free list;
  no engine's design (vLLM's queue is ``vllm-queue``).

Both engines keep id 0 out of use (vLLM's null block, SGLang's padding page): their
models get one page more than tpool's pool, so each has as many usable pages, and hand
out ids one above tpool's. The ratio columns are the baseline's median over the row's
(above 1: the row is faster).

    python benchmarks/bench_pool.py                      # the table, a few seconds
    python benchmarks/bench_pool.py --pool-sizes 65536 1048576 16777216 --sizes 1 256 --plot pool.png
"""

import argparse
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import (Distinct, HelpFormatter, calibrate, check_backends, default_device, device_arg,  # noqa: E402
                     gc_quiet, out_path, parse_args_for_plot, plot_lines, positive_int, print_table, progress,
                     quantiles, ratio_text, sync_of, time_calls_us, write_json)

from _engines import VLLM_MAX_PAGES, SGLangPagedPool, VllmBlockPool  # noqa: E402

import tpool  # noqa: E402

PAGE_SIZE = 16  # tokens per page of the sglang-paged row (tpool's pool hands out page ids alone)

EPILOG = ("Progress goes to stderr, one line per row. Rows: vllm-queue, vLLM's BlockPool (get_new_blocks: "
          "KVCacheBlock objects popped off its linked free queue, ref_cnt set; free_blocks: ref_cnt taken back, "
          "the blocks linked back in); sglang-paged, SGLang's PagedTokenToKVPoolAllocator (pages of 16 tokens: "
          "slice and expand to slots; free: torch.unique of slot // 16, concatenated back); torch-slice, "
          "SGLang's page_size-1 TokenToKVPoolAllocator (N token slots sliced and concatenated, no unique); "
          "host-list, a Python list's slice and extend (the floor of a host free list, no engine's design); "
          "tpool-<backend>, alloc(out=pool.alloc_out(...)) and free (the hot path); 'tpool-<backend> (no out=)', "
          "the default alloc, which makes fresh output tensors of max_alloc_pages each call; 'tpool-<backend> "
          "bound', the alloc and the free bound to their tensors once (pool.bind_alloc / pool.bind_free). "
          "Ratios: 'vs vllm-queue' and 'vs sglang-paged' are that baseline's median over the row's median, at "
          "the same N and pool size (above 1: the row is faster).")


class HostListPool:
    """A Python list as the free stack: the floor of any host-side free list (not vLLM's design: VllmBlockPool)."""

    def __init__(self, num_pages):
        self.free_ids = list(range(num_pages - 1, -1, -1))

    def alloc(self, n):
        out = self.free_ids[-n:]
        del self.free_ids[-n:]
        return out

    def free(self, pages):
        self.free_ids.extend(pages)


class TorchSlicePool:
    """SGLang's ``TokenToKVPoolAllocator`` (page_size 1): token slots sliced off a tensor, concatenated back."""

    def __init__(self, num_pages, device):
        self.free_pages = torch.arange(num_pages, dtype=torch.int32, device=device)

    def alloc(self, n):
        out, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        return out

    def free(self, pages):
        self.free_pages = torch.cat((self.free_pages, pages))


def pair_fns(n, num_pages, device, backends, only=None, skip=()):
    """name -> zero-arg function doing one alloc of n pages and one free of them (only the names in
    ``only``, when given, and none in ``skip``).

    Each function has a ``verify()`` (untimed, after a row's samples): it raises if an alloc
    failed (a pool's ``requests.failed`` or an error counted) or the free list lost pages, so
    a row can never time allocs that fail (they return at once, and would look fast).
    """
    def want(name):
        return (only is None or name in only) and name not in skip

    fns = {}
    if want("vllm-queue"):
        vllm = VllmBlockPool(num_pages + 1)  # block 0 is the null block: num_pages usable, as tpool's pool has
        fns["vllm-queue"] = lambda: vllm.free_blocks(vllm.get_new_blocks(n))
        fns["vllm-queue"].verify = lambda: _assert(vllm.get_num_free_blocks() == num_pages
                                                   and not vllm.blocks[1].ref_cnt, "vllm-queue lost blocks")
        fns["vllm-queue"].model = vllm
    if want("sglang-paged"):
        sgl = SGLangPagedPool(num_pages, PAGE_SIZE, device)
        fns["sglang-paged"] = lambda: sgl.free(sgl.alloc(n * PAGE_SIZE))
        fns["sglang-paged"].verify = lambda: _assert(sgl.free_pages.numel() == num_pages, "sglang-paged lost pages")
        fns["sglang-paged"].model = sgl
    if want("torch-slice"):
        sl = TorchSlicePool(num_pages, device)
        fns["torch-slice"] = lambda: sl.free(sl.alloc(n))
        fns["torch-slice"].verify = lambda: _assert(sl.free_pages.numel() == num_pages, "torch-slice lost pages")
    if want("host-list"):
        host = HostListPool(num_pages)
        fns["host-list"] = lambda: host.free(host.alloc(n))
        fns["host-list"].verify = lambda: _assert(len(host.free_ids) == num_pages, "host-list lost pages")
    counts = torch.tensor([n], dtype=torch.int32, device=device)
    for be in backends:
        if want(f"tpool-{be}"):
            pool = tpool.PagePool(num_pages, device=device, backend=be, max_alloc_pages=max(n, 1))
            out = pool.alloc_out(max_batch=1, max_pages=n)

            def pair(pool=pool, out=out):
                pool.free(pool.alloc(counts, out=out).pages)
            fns[f"tpool-{be}"] = _verified(pair, pool)
        if be == "reference":
            continue
        if want(f"tpool-{be} (no out=)"):  # the default alloc: fresh output tensors of max_alloc_pages each call
            # max_alloc_pages at least n: the default (4096) would refuse every alloc of more pages
            pool2 = tpool.PagePool(num_pages, device=device, backend=be, max_alloc_pages=max(n, min(4096, num_pages)))

            def fresh(pool=pool2):
                pool.free(pool.alloc(counts).pages)
            fns[f"tpool-{be} (no out=)"] = _verified(fresh, pool2)
        if want(f"tpool-{be} bound"):
            pool3 = tpool.PagePool(num_pages, device=device, backend=be, max_alloc_pages=max(n, 1))
            out3 = pool3.alloc_out(max_batch=1, max_pages=n)
            counts3 = torch.tensor([n], dtype=torch.int32, device=device)
            alloc, free = pool3.bind_alloc(counts3, out=out3), pool3.bind_free(out3.pages)

            def bound(alloc=alloc, free=free):  # inputs and outputs bound once (pool.bind_alloc / bind_free)
                alloc()
                free()
            fns[f"tpool-{be} bound"] = _verified(bound, pool3)
    return fns


def _assert(cond, msg):
    if not cond:
        raise AssertionError(msg)


def _verified(fn, pool):
    """``fn`` with a ``verify()``: no error counted, no alloc failed, every page given back."""
    def verify():
        pool.check()
        s = pool.stats()
        _assert(s["requests.failed"] == 0, f"{s['requests.failed']} allocs failed: the row timed failing allocs")
        _assert(s["pages.allocated"] > 0 and s["pages.free.current"] == pool.num_pages, "pages not given back")
    fn.verify = verify
    return fn


def time_row(runs, inner, samples, sync):
    """Per-call µs samples of one row for each pool size in ``runs`` (P -> fn), all alive at once.

    Calibrated (or ``inner`` calls per sample) and warmed up per size; then the sizes take
    turns sample by sample, the order rotating each turn, so the machine's noise falls on
    every size alike instead of on whichever ran during a busy second. Then each ``verify()``.
    """
    inners = {P: inner or calibrate(fn, sync=sync) for P, fn in runs.items()}
    for P, fn in runs.items():
        for _ in range(max(1, inners[P] // 4)):  # warm-up (JIT compile, caches)
            fn()
    out = {P: [] for P in runs}
    keys = list(runs)
    for t in range(samples):
        for P in keys[t % len(keys):] + keys[:t % len(keys)]:
            out[P].append(time_calls_us(runs[P], inners[P], sync) / inners[P])
    for fn in runs.values():
        fn.verify()
    return out


def parser() -> argparse.ArgumentParser:
    """The command line: every option with its help and default."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=EPILOG,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--sizes", type=positive_int, nargs="+", action=Distinct, default=[1, 16, 256, 4096], metavar="N",
                    help="pages per alloc (one row per size and implementation), each at most the smallest pool "
                         "size")
    ap.add_argument("--num-pages", type=positive_int, default=65536, help="pages in the pool (without --pool-sizes)")
    ap.add_argument("--pool-sizes", type=positive_int, nargs="+", action=Distinct, default=None, metavar="P",
                    help="sweep the pool size instead of --num-pages, e.g. 65536 262144 1048576 4194304 "
                         "16777216: every size is built at once and they take turns sample by sample "
                         "(alloc/free should stay flat; default: --num-pages alone)")
    ap.add_argument("--device", default=default_device(), type=device_arg, help="torch device of the pools")
    ap.add_argument("--backends", nargs="+", action=Distinct, default=None,
                    help="tpool backends to time (default: numba and reference on CPU; triton and reference on CUDA)")
    ap.add_argument("--samples", type=positive_int, default=30, help="samples per row (median, p20, p80 over them)")
    ap.add_argument("--inner", type=positive_int, default=None,
                    help="calls per sample (default: calibrated so a sample takes about 2 ms)")
    ap.add_argument("--json", type=out_path, default="", metavar="PATH", help="also write the rows as JSON")
    ap.add_argument("--plot", type=out_path, default="", metavar="PATH",
                    help="also write a PNG: us against N, or against the pool size with --pool-sizes")
    return ap


def main(argv=None):
    ap = parser()
    args = parse_args_for_plot(ap, argv)
    device = torch.device(args.device)
    backends = args.backends or (["triton", "reference"] if device.type == "cuda" else ["numba", "reference"])
    check_backends(ap, "--backends", backends, device)
    pool_sizes = args.pool_sizes or [args.num_pages]
    smallest = min(pool_sizes)
    if too_big := [n for n in args.sizes if n > smallest]:  # its rows could not run on every pool size
        src = "--pool-sizes" if args.pool_sizes else "--num-pages"
        ap.error(f"argument --sizes: expected pages per alloc at most the smallest pool's {smallest} pages ({src} "
                 f"{' '.join(map(str, pool_sizes))}), got {' '.join(map(str, too_big))}")
    sync = sync_of(device)
    rows, table = [], []
    if max(pool_sizes) > VLLM_MAX_PAGES:
        progress(f"vllm-queue left out of pools past {VLLM_MAX_PAGES:,} pages: that many Python objects")
    for n in args.sizes:
        # (the pools are built anew for each N: ~10 s for the baselines' and tpool's at 16M pages)
        progress(f"N={n}: building every row's pool ({', '.join(f'{P:,}' for P in pool_sizes)} pages)")
        configs = {P: pair_fns(n, P, device, backends, skip=("vllm-queue",) if P > VLLM_MAX_PAGES else ())
                   for P in pool_sizes}  # every size at once (n <= P: main)
        gc_quiet()  # the baselines' P-element Python lists must not slow every GC pass
        med_of = {P: {} for P in configs}
        for name in dict.fromkeys(name for fns in configs.values() for name in fns):  # (in order, once each)
            progress(f"N={n}: {name}" + (", pool sizes taking turns" if len(configs) > 1 else
                                         f", pool {next(iter(configs)):,} pages"))
            timed = time_row({P: fns[name] for P, fns in configs.items() if name in fns}, args.inner, args.samples,
                             sync)
            for P, us in timed.items():
                med, p20, p80 = quantiles(us)
                med_of[P][name] = med
                rows.append(dict(num_pages=P, pages=n, impl=name, median_us=med, p20_us=p20, p80_us=p80,
                                 pages_per_s=2 * n / med * 1e6, device=str(device)))
        del configs
        gc.unfreeze()
        for r in rows:
            for base, key in (("vllm-queue", "vs_vllm_queue"), ("sglang-paged", "vs_sglang_paged")):
                if r["pages"] == n and base in med_of[r["num_pages"]]:
                    r[key] = med_of[r["num_pages"]][base] / r["median_us"]
    rows.sort(key=lambda r: (r["num_pages"], r["pages"]))  # stable: the implementations keep their order
    for r in rows:
        table.append([f"{r['num_pages']:,}", r["pages"], r["impl"], f"{r['median_us']:.2f}", f"{r['p20_us']:.2f}",
                      f"{r['p80_us']:.2f}", f"{r['pages_per_s'] / 1e6:.1f}",
                      *(ratio_text(r.get(key)) for key in ("vs_vllm_queue", "vs_sglang_paged"))])
    print_table(f"alloc + free of N pages on {device} (us per pair; ratio = baseline's median / row's median)",
                ["pool pages", "N", "impl", "median", "p20", "p80", "Mpages/s", "vs vllm-queue", "vs sglang-paged"],
                table, note="Ratios: the baseline's median over the row's, same N and pool (above 1: the row is "
                            "faster). Mpages/s: pages allocated and freed per second (a pair moves 2 N). "
                            "vllm-queue: vLLM's BlockPool (get_new_blocks pops KVCacheBlock objects off "
                            "its linked free queue and sets ref_cnt; free_blocks links them back), host Python "
                            "objects, as vLLM's scheduler runs it. sglang-paged: SGLang's "
                            "PagedTokenToKVPoolAllocator, pages of 16 tokens, free through torch.unique, state on "
                            "the pool's device. torch-slice: SGLang's page_size-1 allocator (N token slots, not "
                            "pages). host-list: a Python list's slice and extend, the floor of a host free list "
                            "(no engine's design), which a pool whose state lives on the device and never syncs "
                            "is not built to beat on a CPU. sglang-paged and torch-slice free by concatenating onto "
                            "the whole free tensor, as SGLang does: their time grows with the pool. vllm-queue is left "
                            f"out of pools past {VLLM_MAX_PAGES:,} pages (a Python object per page).")
    write_json(args.json, "bench_pool", rows)
    if args.plot:
        sweep = len(pool_sizes) > 1
        series = {}
        for r in rows:
            key = f"{r['impl']}, N={r['pages']}" if sweep else r["impl"]
            series.setdefault(key, []).append((r["num_pages"] if sweep else r["pages"],
                                               r["median_us"], r["p20_us"], r["p80_us"]))
        plot_lines(args.plot, series, xlabel="pool size (pages)" if sweep else "N (pages per alloc)",
                   title=f"alloc + free on {device}" + (" against pool size" if sweep else
                                                         f", pool of {pool_sizes[0]:,} pages"))


if __name__ == "__main__":
    main()
