"""Where a decode step's GPU time goes: the extend, the CSR export and the step kernel, each timed alone.

The Triton backend runs a step as one kernel (``step_kernel``: the extend, a barrier, the FlashInfer
CSR export). This times the GPU work of each part on ``bench_page_table.py``'s workload (B requests,
prompts of 512-2048 tokens, pages of 16, one decode token each): ``table.extend``, ``table.flashinfer_csr``
and ``table.step``, each called ``--samples`` times under ``torch.profiler``, the state restored after
each burst (within a burst every call appends one more token, a new page every 16th; each burst starts
from the same table). A row is the kernel's own device time per call
(median, p20/p80), not the host's launch cost, and its share of the step's device time per call (the sum
of the medians of the kernels ``table.step`` launches: one on the Triton backend today).

On an NVIDIA H200 (session 25), B=256: extend 8.0 µs, CSR export 34.0 µs, step 51.0 µs: the
export's entries pass (one program searching indptr for each of ~20,000 page ids) is two thirds of
the step, the part to spread over many programs first.

    python benchmarks/gpu_step_phases.py                 # needs CUDA and triton
    python benchmarks/gpu_step_phases.py --batch 64 256 --samples 50
"""

import argparse
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import (Distinct, HelpFormatter, out_path, positive_int, print_table, progress, quantiles,  # noqa: E402
                     write_json)
from bench_page_table import setup  # noqa: E402

from tpool.graphs import preserved  # noqa: E402


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter,
                                 epilog="Progress goes to stderr, one line per batch size and part.")
    ap.add_argument("--batch", type=positive_int, nargs="+", action=Distinct,
                    default=[256], help="requests decoding at once (B)")
    ap.add_argument("--samples", type=positive_int, default=20, help="calls timed per part")
    ap.add_argument("--json", type=out_path, metavar="PATH", help="also write the rows as JSON to this path")
    return ap


def kernel_times(op, owner, samples: int) -> dict:
    """Device time (µs) of each kernel ``op`` launches, per call, over ``samples`` calls (state restored)."""
    with preserved(owner):
        for _ in range(3):  # compiled and warm
            op()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(samples):
                op()
            torch.cuda.synchronize()
    times = {}
    for e in prof.events():
        if e.device_time > 0:
            times.setdefault(e.name, []).append(e.device_time)
    return times


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_step_phases: needs CUDA (the Triton backend's kernels on a GPU)", file=sys.stderr)
        return 2
    rows = []
    for B in a.batch:
        pool, table, _ = setup(B, "triton", "cuda", random.Random(0))
        ids = torch.arange(B, dtype=torch.int32, device="cuda")
        ones = torch.ones(B, dtype=torch.int32, device="cuda")
        parts = {"step": lambda: table.step(ids, ones), "extend": lambda: table.extend(ids, ones),
                 "CSR export": lambda: table.flashinfer_csr(ids)}
        found = {}
        for name, op in parts.items():
            progress(f"B={B}: {name}")
            found[name] = kernel_times(op, table, a.samples)
        rows += phase_rows(B, found)
    print_table(f"GPU time per call, {torch.cuda.get_device_name()} (µs, torch.profiler device time)",
                ["B", "part", "kernel", "calls", "median", "p20", "p80", "share of step"],
                [[r["B"], r["part"], r["kernel"], r["calls"], f"{r['median_us']:.1f}", f"{r['p20_us']:.1f}",
                  f"{r['p80_us']:.1f}", f"{r['share_of_step']:.2f}"] for r in rows],
                "share of step: the row's median over the step's device time per call (the sum of its kernels' "
                "medians), measured in the same run.")
    write_json(a.json, "gpu_step_phases", rows)
    return 0


def phase_rows(B: int, found: dict) -> list:
    """The rows of one batch size: ``found[part][kernel]`` is that kernel's device times (µs) per call. A row's
    share is its median over the step's time per call, the sum of its kernels' medians (pooling their times
    into one median would take one kernel's time, or the middle of two). Numbers stay numbers (the JSON's
    too: the table formats them)."""
    step = sum(quantiles(sorted(ts))[0] for ts in found["step"].values())
    rows = []
    for name, kernels in found.items():
        for kernel, ts in kernels.items():
            med, p20, p80 = quantiles(sorted(ts))
            rows.append(dict(B=B, part=name, kernel=kernel, calls=len(ts), median_us=med, p20_us=p20, p80_us=p80,
                             share_of_step=med / step))
    return rows


if __name__ == "__main__":
    sys.exit(main())
