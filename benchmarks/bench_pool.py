"""Benchmark: one alloc of N pages followed by one free of them, per backend.

Baselines, measured in the same run and re-implemented here (the engines are
not dependencies): ``host-list``, a Python list used as a free stack on the
host, the shape of vLLM's free-block queue; ``torch-slice``, a device tensor
of free pages sliced on alloc and concatenated on free, the shape of SGLang's
paged allocator without its ``torch.unique``. The ratio column is the
baseline's time over the row's time (above 1: faster than the baseline).

    python benchmarks/bench_pool.py [--sizes 1 16 256 4096] [--json out.json]
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import print_table, quantiles, sample_us, write_json  # noqa: E402

import tpool  # noqa: E402


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
    """name -> zero-arg function doing one alloc of n pages and one free of them."""
    fns = {}
    host = HostListPool(num_pages)
    fns["host-list"] = lambda: host.free(host.alloc(n))
    sl = TorchSlicePool(num_pages, device)
    fns["torch-slice"] = lambda: sl.free(sl.alloc(n))
    counts = torch.tensor([n], dtype=torch.int32, device=device)
    for be in backends:
        pool = tpool.PagePool(num_pages, device=device, backend=be)
        out = pool.alloc_out(max_batch=1, max_pages=n)

        def pair(pool=pool, out=out):
            pool.free(pool.alloc(counts, out=out).pages)
        fns[f"tpool-{be}"] = pair
    return fns


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 256, 4096])
    ap.add_argument("--num-pages", type=int, default=65536)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backends", nargs="+", default=None,
                    help="default: numba and reference on CPU; triton and reference on CUDA")
    ap.add_argument("--samples", type=int, default=30)
    ap.add_argument("--inner", type=int, default=200)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    backends = args.backends or (["triton", "reference"] if device.type == "cuda" else ["numba", "reference"])
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    rows, table = [], []
    for n in args.sizes:
        fns = pair_fns(n, args.num_pages, device, backends)
        base = {}
        for name, fn in fns.items():
            inner = max(1, args.inner // 20) if name == "tpool-reference" else args.inner
            med, p20, p80 = quantiles(sample_us(fn, inner=inner, samples=args.samples, sync=sync))
            base.setdefault("host-list", med)
            rows.append(dict(pages=n, impl=name, median_us=med, p20_us=p20, p80_us=p80,
                             pages_per_s=2 * n / med * 1e6, device=str(device)))
        host = next(r["median_us"] for r in rows if r["pages"] == n and r["impl"] == "host-list")
        sl = next(r["median_us"] for r in rows if r["pages"] == n and r["impl"] == "torch-slice")
        for r in rows:
            if r["pages"] == n:
                r["vs_host_list"], r["vs_torch_slice"] = host / r["median_us"], sl / r["median_us"]
                table.append([n, r["impl"], f"{r['median_us']:.2f}", f"{r['p20_us']:.2f}", f"{r['p80_us']:.2f}",
                              f"{r['pages_per_s'] / 1e6:.1f}", f"{r['vs_host_list']:.2f}x",
                              f"{r['vs_torch_slice']:.2f}x"])
    print_table(f"alloc + free of N pages, pool of {args.num_pages} pages on {device} (us per pair)",
                ["N", "impl", "median", "p20", "p80", "Mpages/s", "vs host-list", "vs torch-slice"], table)
    write_json(args.json, "bench_pool", rows)


if __name__ == "__main__":
    main()
