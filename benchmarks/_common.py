"""Shared helpers for the benchmark scripts: timing, quantiles, table, JSON rows."""

import datetime
import json
import os
import platform
import statistics
import time

import torch


def sample_us(fn, *, inner: int, samples: int, sync=None, reset=None) -> list:
    """Run ``fn`` ``inner`` times per sample; return per-call microseconds for each sample.

    ``reset`` (untimed) runs before each sample: steps that grow state (a decode
    step lengthens every request) then measure the same workload each sample
    instead of one that drifts as the samples go on.
    """
    for _ in range(max(1, inner // 4)):  # warm-up (JIT compile, caches)
        fn()
    out = []
    for _ in range(samples):
        if reset:
            reset()
        if sync:
            sync()
        t0 = time.perf_counter_ns()
        for _ in range(inner):
            fn()
        if sync:
            sync()
        out.append((time.perf_counter_ns() - t0) / inner / 1e3)
    return out


def quantiles(xs: list) -> tuple:
    """(median, p20, p80) of ``xs``."""
    q = statistics.quantiles(xs, n=10, method="inclusive")
    return statistics.median(xs), q[1], q[7]


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    import numba
    import triton
    return {"cpu": cpu, "cores": os.cpu_count(), "gpu": gpu, "python": platform.python_version(),
            "torch": torch.__version__, "triton": triton.__version__, "numba": numba.__version__,
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def print_table(title: str, header: list, rows: list) -> None:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(str(h).rjust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(str(v).rjust(w) for v, w in zip(r, widths)))


def write_json(path: str, name: str, rows: list) -> None:
    if not path:
        return
    with open(path, "w") as f:
        json.dump({"benchmark": name, "machine": machine(), "rows": rows}, f, indent=2)
    print(f"\nwrote {path}")
