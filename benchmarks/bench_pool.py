"""Benchmark: one alloc of N pages followed by one free of them, per backend.

Baselines, measured in the same run and re-implemented here (the engines are
not dependencies): ``host-list``, a Python list used as a free stack on the
host, the shape of vLLM's free-block queue; ``torch-slice``, a device tensor
of free pages sliced on alloc and concatenated on free, the shape of SGLang's
paged allocator without its ``torch.unique``. The ratio column is the
baseline's time over the row's time (above 1: faster than the baseline).

    python benchmarks/bench_pool.py                      # the table, a few seconds
    python benchmarks/bench_pool.py --pool-sizes 65536 1048576 16777216 --sizes 1 256 --plot pool.png
"""

import argparse
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import (HelpFormatter, calibrate, check_backends, default_device, device_arg, gc_quiet,  # noqa: E402
                     out_path, parse_args_for_plot, plot_lines, positive_int, print_table, progress, quantiles, sync_of,
                     time_calls_us, write_json)

import tpool  # noqa: E402

EPILOG = ("Progress goes to stderr, one line per row. The tpool rows pass out=pool.alloc_out(...) "
          "(the hot path); 'tpool-numba (no out=)' is the default alloc, which makes fresh output "
          "tensors of max_alloc_pages each call; 'tpool-numba bound' binds the alloc and the free to "
          "their tensors once (pool.bind_alloc / pool.bind_free) and calls them.")


class HostListPool:
    """A Python list as the free stack (vLLM-style host truth)."""

    def __init__(self, num_pages):
        self.free_ids = list(range(num_pages - 1, -1, -1))

    def alloc(self, n):
        out = self.free_ids[-n:]
        del self.free_ids[-n:]
        return out

    def free(self, pages):
        self.free_ids.extend(pages)


class TorchSlicePool:
    """A tensor of free pages, sliced on alloc and concatenated on free (SGLang-style)."""

    def __init__(self, num_pages, device):
        self.free_pages = torch.arange(num_pages, dtype=torch.int32, device=device)

    def alloc(self, n):
        out, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        return out

    def free(self, pages):
        self.free_pages = torch.cat((self.free_pages, pages))


def pair_fns(n, num_pages, device, backends):
    """name -> zero-arg function doing one alloc of n pages and one free of them.

    Each function has a ``verify()`` (untimed, after a row's samples): it raises if an alloc
    failed (a pool's ``requests.failed`` or an error counted) or the free list lost pages, so
    a row can never time allocs that fail (they return at once, and would look fast).
    """
    fns = {}
    host = HostListPool(num_pages)
    fns["host-list"] = lambda: host.free(host.alloc(n))
    fns["host-list"].verify = lambda: _assert(len(host.free_ids) == num_pages, "host-list lost pages")
    sl = TorchSlicePool(num_pages, device)
    fns["torch-slice"] = lambda: sl.free(sl.alloc(n))
    fns["torch-slice"].verify = lambda: _assert(sl.free_pages.numel() == num_pages, "torch-slice lost pages")
    counts = torch.tensor([n], dtype=torch.int32, device=device)
    for be in backends:
        pool = tpool.PagePool(num_pages, device=device, backend=be, max_alloc_pages=max(n, 1))
        out = pool.alloc_out(max_batch=1, max_pages=n)

        def pair(pool=pool, out=out):
            pool.free(pool.alloc(counts, out=out).pages)
        fns[f"tpool-{be}"] = _verified(pair, pool)
        if be != "reference":  # the default alloc: fresh output tensors of max_alloc_pages each call
            # max_alloc_pages at least n: the default (4096) would refuse every alloc of more pages
            pool2 = tpool.PagePool(num_pages, device=device, backend=be, max_alloc_pages=max(n, min(4096, num_pages)))

            def fresh(pool=pool2):
                pool.free(pool.alloc(counts).pages)
            fns[f"tpool-{be} (no out=)"] = _verified(fresh, pool2)
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
    ap.add_argument("--sizes", type=positive_int, nargs="+", default=[1, 16, 256, 4096], metavar="N",
                    help="pages per alloc (one row per size and implementation), each at most the smallest pool "
                         "size")
    ap.add_argument("--num-pages", type=positive_int, default=65536, help="pages in the pool (without --pool-sizes)")
    ap.add_argument("--pool-sizes", type=positive_int, nargs="+", default=None, metavar="P",
                    help="sweep the pool size instead of --num-pages, e.g. 65536 262144 1048576 4194304 "
                         "16777216: every size is built at once and they take turns sample by sample "
                         "(alloc/free should stay flat; default: --num-pages alone)")
    ap.add_argument("--device", default=default_device(), type=device_arg, help="torch device of the pools")
    ap.add_argument("--backends", nargs="+", default=None,
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
    for n in args.sizes:
        configs = {P: pair_fns(n, P, device, backends) for P in pool_sizes}  # every size at once (n <= P: main)
        gc_quiet()  # the baselines' P-element Python lists must not slow every GC pass
        med_of = {P: {} for P in configs}
        for name in next(iter(configs.values())):
            progress(f"N={n}: {name}" + (", pool sizes taking turns" if len(configs) > 1 else
                                         f", pool {next(iter(configs)):,} pages"))
            timed = time_row({P: fns[name] for P, fns in configs.items()}, args.inner, args.samples, sync)
            for P, us in timed.items():
                med, p20, p80 = quantiles(us)
                med_of[P][name] = med
                rows.append(dict(num_pages=P, pages=n, impl=name, median_us=med, p20_us=p20, p80_us=p80,
                                 pages_per_s=2 * n / med * 1e6, device=str(device)))
        del configs
        gc.unfreeze()
        for r in rows:
            if r["pages"] == n:
                r["vs_host_list"] = med_of[r["num_pages"]]["host-list"] / r["median_us"]
                r["vs_torch_slice"] = med_of[r["num_pages"]]["torch-slice"] / r["median_us"]
    rows.sort(key=lambda r: (r["num_pages"], r["pages"]))  # stable: the implementations keep their order
    for r in rows:
        table.append([f"{r['num_pages']:,}", r["pages"], r["impl"], f"{r['median_us']:.2f}", f"{r['p20_us']:.2f}",
                      f"{r['p80_us']:.2f}", f"{r['pages_per_s'] / 1e6:.1f}", f"{r['vs_host_list']:.2f}x",
                      f"{r['vs_torch_slice']:.2f}x"])
    print_table(f"alloc + free of N pages on {device} (us per pair; ratio = baseline's median / row's median)",
                ["pool pages", "N", "impl", "median", "p20", "p80", "Mpages/s", "vs host-list", "vs torch-slice"],
                table, note="Baselines: torch-slice keeps the free pages in a device tensor, sliced on alloc and "
                            "concatenated on free (SGLang's paged allocator): the like-for-like one, state on the "
                            "device. host-list is a Python list on the host (vLLM's free-block queue): the floor of "
                            "a host-side free list, which a pool whose state lives on the device and never syncs is "
                            "not built to beat on a CPU. Ratios: the baseline's median over the row's (above 1: "
                            "faster).")
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
