"""Benchmark: the churn workload scheduled by a HostMirror, against a scheduler that reads ``ok``.

Churn: 256 running requests, prompts of 512-2048 tokens, pages of 16 tokens;
every step decodes one token for every running request, and every 8 steps 2
requests finish and 2 are admitted (a prefill). Scheduled by
:class:`tpool.scheduling.HostMirror`: admission, reservations, preemption
and the decode step decided on host integers, no device read inside a step.

Scenarios (each on a fresh pool):
* ``plain``: the churn as stated; the mirror is exact, so its gap to the
  device's free count is 0 at every snapshot.
* ``shared``: a quarter of admissions fork a prefix of a running request
  instead of a prefill (shared pages), a quarter of finishes release with
  ``cache=True`` (cached pages, evicted when room is short). The mirror then
  under-promises; a snapshot every ``--snapshot-every`` steps measures the gap
  (device free - mirror free), and every ``--reconcile-every`` steps the latest
  ready snapshot reconciles it.

Baseline, same workload, same run: ``read-ok``, the scheduler the demo used to
be: host lengths, ``table.step`` called directly, and ``ok`` read back after
every admission and every step (one host read each). On a CPU that read is
cheap; on a GPU each one waits for the queue to drain, which is what the mirror
removes. Reported: host µs per step (median, p20, p80; the step's kernels
included on a CPU, since numba runs them inline), the ratio to the baseline,
device reads per step (blocking reads of ``ok``; the mirror's
snapshots do not wait and are not counted), admissions per second (timed
admission blocks: ``can_admit`` + ``admit``, 2 prompts), failed extends
(``requests.failed`` on the device at the end: must be 0), and the gap over time (``--plot PATH`` draws it with matplotlib, if
installed).

    python benchmarks/bench_scheduler.py [--steps 4000] [--plot gap.png] [--json out.json]
"""

import argparse
import os
import random
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import print_table, quantiles, write_json  # noqa: E402

import tpool  # noqa: E402
from tpool.scheduling import HostMirror  # noqa: E402

PAGE_SIZE = 16        # tokens per page
PROMPTS = (512, 2048)  # tokens, uniform
OUTPUT_ROOM = 4096    # tokens a request may grow by (sizes the table's rows)
SHARE, CACHE = 0.25, 0.25  # "shared" scenario: fraction of admissions that fork, of finishes that cache


def setup(args, device):
    pool = tpool.PagePool(args.num_pages, PAGE_SIZE, device=device, backend=args.backend)
    max_pages = (PROMPTS[1] + OUTPUT_ROOM) // PAGE_SIZE
    table = tpool.PageTable(pool, args.requests + 2 * args.turnover, max_pages)
    return pool, table


def run_mirror(args, scenario, device, rng, progress):
    pool, table = setup(args, device)
    m = HostMirror(table, lookahead=args.lookahead, free=args.num_pages, cached=0)
    prompts = lambda k: [rng.randint(*PROMPTS) for _ in range(k)]  # noqa: E731
    rows = []
    while len(rows) < args.requests:
        rows += m.admit(prompts(min(16, args.requests - len(rows))))
    step_us, admit_us, gaps, snaps = [], [], [], []
    evicted = forked = 0
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter_ns()
        if step % args.every == 0:
            done = rng.sample(rows, args.turnover)
            cache = scenario == "shared" and rng.random() < CACHE
            m.finish(done, cache=cache)
            rows = [r for r in rows if r not in done]
            ta = time.perf_counter_ns()
            new = []
            for p in prompts(args.turnover):
                if scenario == "shared" and rng.random() < SHARE:
                    src = rng.choice(rows)
                    new.append(m.fork(src, min(p, int(m.lo[src]))))
                    forked += 1
                    continue
                if m.can_admit([p]) == 0 and m.cached:   # room is short: evict cached pages first
                    m.evict(m.pages_for(p) + 1)
                    evicted += 1
                new += m.admit([p])
            rows += new
            if step >= args.warmup:
                admit_us.append((time.perf_counter_ns() - ta) / 1e3)
        if step % args.every == 0:                    # the batch changed: new arrays (kept between turnovers)
            batch, prio = np.asarray(rows, dtype=np.int64), -np.arange(len(rows))
        if m.preemption(batch, prio):
            raise SystemExit(f"the pool is too small for the churn ({args.num_pages} pages): raise --num-pages")
        m.decode(batch)
        if step >= args.warmup:
            step_us.append((time.perf_counter_ns() - t0) / 1e3)
        if step % args.snapshot_every == 0:
            snaps.append((step, m.snapshot()))
        while snaps and snaps[0][1].ready():
            s_step, snap = snaps.pop(0)
            gaps.append((s_step, snap.stats()["pages.free.current"] - snap.free))
            if s_step % args.reconcile_every == 0:
                m.reconcile(snap)
        if step % 500 == 0:
            progress(f"  {scenario}: step {step}/{args.warmup + args.steps}")
    s = pool.stats()
    pool.check()
    return dict(step_us=step_us, admit_us=admit_us, gaps=gaps, failed=s["requests.failed"], reads=0, forked=forked,
                evictions=evicted, cached=s["pages.cached.current"])


def run_read_ok(args, device, rng, progress):
    """The baseline: host lengths, direct table calls, ``ok`` read after every call."""
    pool, table = setup(args, device)
    t32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    free_rows = list(range(table.max_requests - 1, -1, -1))
    rows, failed = [], 0

    def admit(ps):
        nonlocal failed
        got = [free_rows.pop() for _ in ps]
        res = table.extend(t32(got), t32(ps), max_tokens=sum(ps))
        for r, ok in zip(got, res.ok.tolist()):   # a host read
            if ok:
                rows.append(r)
            else:
                failed += 1
                free_rows.append(r)
    while len(rows) < args.requests:
        admit([rng.randint(*PROMPTS) for _ in range(min(16, args.requests - len(rows)))])
    step_us, admit_us = [], []
    ids = ones = None
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter_ns()
        if step % args.every == 0:
            done = rng.sample(rows, args.turnover)
            table.release(t32(done))
            free_rows.extend(done)
            rows[:] = [r for r in rows if r not in done]
            ta = time.perf_counter_ns()
            admit([rng.randint(*PROMPTS) for _ in range(args.turnover)])
            if step >= args.warmup:
                admit_us.append((time.perf_counter_ns() - ta) / 1e3)
            ids, ones = t32(rows), torch.ones(len(rows), dtype=torch.int32, device=device)
        res = table.step(ids, ones)
        failed += len(rows) - sum(res.ok.tolist())   # a host read every step
        if step >= args.warmup:
            step_us.append((time.perf_counter_ns() - t0) / 1e3)
        if step % 500 == 0:
            progress(f"  read-ok: step {step}/{args.warmup + args.steps}")
    pool.check()
    reads = args.warmup + args.steps + len(range(0, args.warmup + args.steps, args.every))
    return dict(step_us=step_us, admit_us=admit_us, gaps=[], failed=failed, reads=reads)


def plot(path, results):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"\nmatplotlib is not installed: no plot written to {path} (pip install matplotlib)")
        return
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 7))
    for name, r in results.items():
        if r["gaps"]:
            a.plot([g[0] for g in r["gaps"]], [g[1] for g in r["gaps"]], label=name)
        xs = r["step_us"]
        w = 64   # a rolling median over 64 steps: one turnover in 8 is a prefill, the rest are decode steps
        b.plot(range(w, len(xs) + 1), [statistics.median(xs[i - w:i]) for i in range(w, len(xs) + 1)], label=name)
    a.set(xlabel="step", ylabel="device free - mirror free (pages)", title="the mirror's gap to the device")
    b.set(xlabel="step", ylabel="host µs per step", title="step time, median of the last 64 steps")
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nwrote {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Each option's default is in its help text.")
    ap.add_argument("--steps", type=int, default=4000, help="timed steps per scheduler (default 4000)")
    ap.add_argument("--warmup", type=int, default=64, help="untimed steps first, for compilation (default 64)")
    ap.add_argument("--requests", type=int, default=256, help="running requests (default 256)")
    ap.add_argument("--turnover", type=int, default=2, help="requests finished and admitted each --every steps "
                    "(default 2)")
    ap.add_argument("--every", type=int, default=8, help="steps between turnovers (default 8)")
    ap.add_argument("--num-pages", type=int, default=65536, help="pages in the pool (default 65536)")
    ap.add_argument("--lookahead", type=int, default=1, help="tokens reserved per running request (default 1)")
    ap.add_argument("--snapshot-every", type=int, default=16, help="steps between async snapshots (default 16)")
    ap.add_argument("--reconcile-every", type=int, default=256, help="steps between reconciliations; a multiple of "
                    "--snapshot-every (default 256)")
    ap.add_argument("--scenarios", nargs="+", default=["plain", "shared"], choices=["plain", "shared"],
                    help="mirror scenarios to run (default: plain shared)")
    ap.add_argument("--backend", default="auto", help="pool backend (default auto: numba on a CPU, triton on CUDA)")
    ap.add_argument("--device", default=None, help="device (default cuda if available, else cpu)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the workload (default 0)")
    ap.add_argument("--plot", default=None, help="write the gap and step-time plot to this PNG (default: none)")
    ap.add_argument("--json", default=None, help="write the result rows to this JSON file (default: none)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    progress = lambda s: print(s, flush=True)  # noqa: E731
    results = {"read-ok": run_read_ok(args, device, random.Random(args.seed), progress)}
    for sc in args.scenarios:
        results[f"mirror-{sc}"] = run_mirror(args, sc, device, random.Random(args.seed), progress)
    base = statistics.median(results["read-ok"]["step_us"])
    rows, out = [], []
    for name, r in results.items():
        med, p20, p80 = quantiles(r["step_us"])
        amed = statistics.median(r["admit_us"])
        gaps = [g for _, g in r["gaps"]]
        gap = f"{statistics.median(gaps):.0f} / {max(gaps)}" if gaps else "-"
        rows.append([name, f"{med:.1f}", f"{p20:.1f}", f"{p80:.1f}", f"{med / base:.2f}",
                     f"{r['reads'] / (args.warmup + args.steps):.3f}",
                     f"{args.turnover / amed * 1e6:,.0f}", r["failed"], gap])
        out.append(dict(name=name, step_us_median=med, step_us_p20=p20, step_us_p80=p80, ratio_to_read_ok=med / base,
                        admissions_per_s=args.turnover / amed * 1e6, failed_extends=r["failed"],
                        device_reads=r["reads"],
                        gap=r["gaps"], **{k: r[k] for k in ("forked", "evictions", "cached") if k in r}))
    print_table(f"churn: {args.requests} running, prompts {PROMPTS[0]}-{PROMPTS[1]} tokens, pages of {PAGE_SIZE}, "
                f"{args.turnover} out / {args.turnover} in every {args.every} steps, {args.steps} steps, "
                f"{args.backend} on {device}",
                ["scheduler", "median us", "p20", "p80", "x read-ok", "device reads/step", "admissions/s",
                 "failed extends", "gap median / max"], rows)
    if args.plot:
        plot(args.plot, results)
    write_json(args.json, "bench_scheduler", out)


if __name__ == "__main__":
    main()
