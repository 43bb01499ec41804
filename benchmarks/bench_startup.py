"""Benchmark: what a fresh process pays before its first step (numba on a CPU), warm and cold numba cache.

Each run is a fresh interpreter that times, with ``time.perf_counter``, the
phases of a first scheduler step: ``import torch``, ``import tpool``, a
``PagePool``, its first ``alloc``, a ``PageTable`` and its first ``step``;
``launch to first step`` is the wall time from the parent starting the
process to the step's end (the interpreter's own start-up included).
Warm runs find every kernel in numba's disk cache (one untimed run fills it
first, and Python's bytecode cache too: children run without
``PYTHONDONTWRITEBYTECODE``, as a user's Python does); cold runs start with an
empty numba cache directory and compile every kernel they use. Baseline, in the same run: as many fresh
interpreters that only ``import torch``, the floor under any library built on torch; the ratio
is tpool's launch-to-first-step over torch's launch-to-import. After its timed
phases each process makes 20,000 small objects (``next 20,000 objects``), as its
next work would: a garbage collection that start-up made due but put off (under
a paused collector, as tpool did until session 31) lands there, not out of sight.

    python benchmarks/bench_startup.py                 # about a minute: 10 warm, 10 torch-only, 1 cold
    python benchmarks/bench_startup.py --runs 30 --cold 3 --json startup.json
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import (HelpFormatter, non_negative_int, out_path, positive_int, print_table, progress,  # noqa: E402
                     quantiles, writable_dir, write_json)

# The child process: prints one JSON line of phase times (seconds) and the wall-clock end of its first step.
# Then it makes 20,000 objects, as the process's next work would: a collection that start-up made due but
# put off (a paused collector) runs there, so it shows there rather than vanish from the figures.
CHILD = """
import json, sys, time


def next_objects():
    t0 = time.perf_counter()
    made = [dict(i=i) for i in range(20000)]
    return time.perf_counter() - t0


t = [time.perf_counter()]
import torch
torch.set_num_threads(1)
t.append(time.perf_counter())
if {torch_only}:
    phases = dict(torch=t[1] - t[0], **{{"CPU time (process)": time.process_time()}})
    end = time.time()
    phases["next 20,000 objects"] = next_objects()
    print(json.dumps(dict(end=end, phases=phases)))
    sys.exit()
import tpool
t.append(time.perf_counter())
pool = tpool.PagePool({num_pages}, {page_size}, device="cpu", backend="numba")
t.append(time.perf_counter())
counts = torch.ones({batch}, dtype=torch.int32)
got = pool.alloc(counts)
t.append(time.perf_counter())
table = tpool.PageTable(pool, max_requests={batch}, max_pages_per_request=64)
t.append(time.perf_counter())
res = table.step(torch.arange({batch}, dtype=torch.int32), counts)
t.append(time.perf_counter())
end = time.time()
names = ("torch", "import tpool", "PagePool", "first alloc", "PageTable", "first step")
phases = dict(zip(names, (b - a for a, b in zip(t, t[1:]))))
phases["in-process total"] = t[-1] - t[0]
phases["CPU time (process)"] = time.process_time()  # less sensitive than wall time to other processes' load
phases["next 20,000 objects"] = next_objects()
refused = not (bool(got.ok.all()) and bool(res.ok.all()))  # (read after the timed phases)
print(json.dumps(dict(end=end, phases=phases, triton="triton" in sys.modules, tpool=tpool.__file__, refused=refused)))
"""


def parser() -> argparse.ArgumentParser:
    """The command line: every option with its help and default."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="Progress goes to stderr, one line per process.",
                                 formatter_class=HelpFormatter)
    ap.add_argument("--runs", type=positive_int, default=10,
                    help="warm-cache processes timed, and as many torch-only processes (the baseline)")
    ap.add_argument("--cold", type=non_negative_int, default=1,
                    help="processes timed with an empty numba cache (each compiles every kernel it uses, "
                         "about 20 s on a 2-core machine); 0 skips them")
    ap.add_argument("--num-pages", type=positive_int, default=65536, help="pages in the pool")
    ap.add_argument("--page-size", type=positive_int, default=16, help="tokens per page")
    ap.add_argument("--batch", type=positive_int, default=8, help="requests in the first alloc and the first step")
    ap.add_argument("--cache-dir", type=writable_dir, default="", metavar="DIR",
                    help="numba cache directory (NUMBA_CACHE_DIR) of the warm runs, made if missing; it must be "
                         "writable, else numba would quietly cache elsewhere (default: numba's usual place, "
                         "the one a user gets: __pycache__ beside tpool's modules, or a per-user directory "
                         "when those are read-only)")
    ap.add_argument("--json", type=out_path, default="", metavar="PATH", help="also write the rows as JSON")
    return ap


def run_child(code: str, cache_dir: str) -> dict:
    # as a user's Python runs: bytecode cached (PYTHONDONTWRITEBYTECODE would recompile tpool's sources every time)
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "TPOOL_BACKEND", "NUMBA_CACHE_DIR", "PYTHONDONTWRITEBYTECODE")}
    if cache_dir:
        env["NUMBA_CACHE_DIR"] = cache_dir
    start = time.time()
    # cwd: a neutral directory, so that ``python -c`` (which puts the working directory first on sys.path)
    # imports the installed tpool, not a source tree the benchmark happens to be started from
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900,
                          cwd=tempfile.gettempdir())
    if proc.returncode != 0:
        raise SystemExit(f"the child process failed:\n{proc.stdout}{proc.stderr}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if out.get("refused"):  # a refused alloc or step returns at once: its phases would time less work
        raise SystemExit("the child process's first alloc or step was refused (the pool ran out of pages)")
    out["phases"]["launch to first step" if "first step" in out["phases"] else "launch to import"] = out["end"] - start
    return out


def summarize(label: str, runs: list, base: float | None, rows: list, table: list) -> None:
    for phase in runs[0]["phases"]:
        ms = [r["phases"][phase] * 1e3 for r in runs]
        med, p20, p80 = quantiles(ms)
        ratio = f"{med / base:.2f}x" if base and phase.startswith("launch") else ""
        rows.append(dict(cache=label, phase=phase, runs=len(ms), median_ms=med, p20_ms=p20, p80_ms=p80,
                         vs_torch_import=med / base if ratio else None))
        table.append([label, phase, f"{med:.0f}", f"{p20:.0f}", f"{p80:.0f}", ratio])


def main(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    if args.num_pages < 2 * args.batch:  # the alloc keeps its --batch pages; the step's new requests take as many
        ap.error(f"argument --num-pages: expected at least {2 * args.batch} pages (2 x --batch {args.batch}: the "
                 f"first alloc holds one page per request, the first step takes one more each), got {args.num_pages}")
    code = CHILD.format(num_pages=args.num_pages, page_size=args.page_size, batch=args.batch, torch_only=False)
    torch_code = CHILD.format(num_pages=0, page_size=0, batch=0, torch_only=True)
    progress("one untimed run fills the numba cache the warm runs load from")
    first = run_child(code, args.cache_dir)
    progress(f"tpool measured: {os.path.dirname(first['tpool'])}")
    warm, base_runs = [], []
    for i in range(args.runs):  # interleaved, so both see the same machine load
        progress(f"warm run {i + 1}/{args.runs}, then torch-only run {i + 1}/{args.runs}")
        warm.append(run_child(code, args.cache_dir))
        base_runs.append(run_child(torch_code, args.cache_dir))
    cold = []
    for i in range(args.cold):
        progress(f"cold run {i + 1}/{args.cold} (empty numba cache: compiles every kernel it uses)")
        with tempfile.TemporaryDirectory(prefix="tpool-cold-cache-") as empty:
            cold.append(run_child(code, empty))
    rows, table = [], []
    summarize("torch only", base_runs, None, rows, table)
    base = rows[-1]["median_ms"]  # launch to import torch
    summarize("warm", warm, base, rows, table)
    if cold:
        summarize("cold", cold, base, rows, table)
    print_table(f"a fresh process to its first step: pool of {args.num_pages:,} pages, batch {args.batch}, numba "
                f"(ms; ratio: launch to first step over launch to import torch)",
                ["cache", "phase", "median", "p20", "p80", "vs torch"], table)
    if any(r.get("triton") for r in warm + cold):
        print("note: triton was imported on the numba path")
    write_json(args.json, "bench_startup", rows)


if __name__ == "__main__":
    main()
