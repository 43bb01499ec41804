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
(``requests.failed`` on the device at the end: must be 0), and the gap over time.
A step's time includes the mirror's bookkeeping after it (snapshots, the gap,
reconciliation), as in ``test_bench_scheduler.py``. The schedulers take turns
in blocks of ``TURN`` steps (``TURN_COLD`` cold; an order shuffled every block), so the machine's
noise lands on all of them alike, not on whole rows (``run`` says why blocks).

``--cold``: in a serving loop the forward pass evicts the CPU caches between two
scheduler steps. This mode runs every scheduler again with 64 MiB written into a
numpy buffer before each step (outside the timed region) and reports warm and
cold side by side. ``--plot PATH`` (matplotlib, the ``bench`` extra) draws the
gap over time and the time of every step, warm and cold.

    python benchmarks/bench_scheduler.py                                   # warm, a few seconds
    python benchmarks/bench_scheduler.py --cold --plot churn.png           # warm and cold, about 10 s
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
from _common import (Distinct, COLD_BYTES, CacheFlusher, HelpFormatter, check_backends, device_arg,  # noqa: E402
                     non_negative_int, out_path, parse_args_for_plot, positive_int, print_table, progress, quantiles,
                     size_text, write_json)

import tpool  # noqa: E402
from tpool.backends import resolve_backend  # noqa: E402
from tpool.scheduling import HostMirror, WouldNotFit  # noqa: E402

PAGE_SIZE = 16        # tokens per page
PROMPTS = (512, 2048)  # tokens, uniform
OUTPUT_ROOM = 4096    # tokens a request may grow by (sizes the table's rows)
SHARE, CACHE = 0.25, 0.25  # "shared" scenario: fraction of admissions that fork, of finishes that cache


def startup_pages(args) -> int:
    """Pages the ``--requests`` admissions before the first step take: their prompts, drawn as both
    schedulers draw them (from ``--seed``), each with the mirror's reservation of ``--lookahead`` tokens."""
    rng, row = random.Random(args.seed), (PROMPTS[1] + OUTPUT_ROOM) // PAGE_SIZE * PAGE_SIZE
    return sum(-(-min(rng.randint(*PROMPTS) + args.lookahead, row) // PAGE_SIZE) for _ in range(args.requests))


def too_small(args) -> str:
    """What is wrong with a ``--num-pages`` the startup admissions do not fit in."""
    return (f"expected at least {startup_pages(args)} pages, what the {args.requests} requests (--requests) admitted "
            f"before the first step take (prompts of {PROMPTS[0]}-{PROMPTS[1]} tokens from --seed {args.seed} in "
            f"pages of {PAGE_SIZE}, each with --lookahead {args.lookahead} tokens more reserved), and more for the "
            f"churn; got {args.num_pages}")


def churn_too_big(args) -> str:
    """The error for a churn step the pool has no room for (its requests grow a token a step)."""
    return f"the pool is too small for the churn ({args.num_pages} pages): raise --num-pages"


def stalled(args):
    """The error for an admission at start-up that admitted nothing: the loop must not spin."""
    return SystemExit(f"the pool is too small for the admissions at the start: {too_small(args)}")


def setup(args, device):
    pool = tpool.PagePool(args.num_pages, PAGE_SIZE, device=device, backend=args.backend)
    max_pages = (PROMPTS[1] + OUTPUT_ROOM) // PAGE_SIZE
    table = tpool.PageTable(pool, args.requests + 2 * args.turnover, max_pages)
    return pool, table


class MirrorChurn:
    """The churn scheduled by a :class:`HostMirror`: ``step(i)`` runs step ``i`` (turnover every
    ``--every`` steps, then the decode step); ``timed`` in microseconds of its last call's scheduling part."""

    def __init__(self, args, scenario, device, rng):
        self.args, self.scenario, self.rng = args, scenario, rng
        self.pool, self.table = setup(args, device)
        self.m = HostMirror(self.table, lookahead=args.lookahead, free=args.num_pages, cached=0)
        self.rows = []
        while len(self.rows) < args.requests:
            try:  # (a prompt past the pool's capacity: ValueError; no room: WouldNotFit, or no rows)
                got = self.m.admit(self.prompts(min(16, args.requests - len(self.rows))))
            except (WouldNotFit, ValueError):
                got = []
            if not got:
                raise stalled(args)
            self.rows += got
        self.admit_us, self.gaps, self.snaps = None, [], []
        self.evicted = self.forked = 0
        self.batch = self.prio = None

    def prompts(self, k):
        return [self.rng.randint(*PROMPTS) for _ in range(k)]

    def fork(self, src, n):
        """``m.fork(src, n)``; when room is short, cached pages are evicted first, as for an admission (its
        copy-on-write page and its reservation: at most ``pages_for(lookahead) + 1``), and with no room
        left the run stops with ``churn_too_big`` (before, ``WouldNotFit`` ended it with a traceback)."""
        m = self.m
        try:
            return m.fork(src, n)
        except WouldNotFit:
            if not m.cached:
                raise SystemExit(churn_too_big(self.args)) from None
        m.evict(m.pages_for(self.args.lookahead) + 1)
        self.evicted += 1
        try:
            return m.fork(src, n)
        except WouldNotFit:
            raise SystemExit(churn_too_big(self.args)) from None

    def step(self, step):
        """One churn step (the timed part); returns the µs its admissions took, or None."""
        args, m, rng = self.args, self.m, self.rng
        admit_us = None
        if step % args.every == 0:
            done = rng.sample(self.rows, args.turnover)
            cache = self.scenario == "shared" and rng.random() < CACHE
            m.finish(done, cache=cache)
            self.rows = [r for r in self.rows if r not in done]
            ta = time.perf_counter_ns()
            new = []
            for p in self.prompts(args.turnover):
                # (a fork needs a running request: none is left when --turnover finished them all)
                if self.scenario == "shared" and self.rows and rng.random() < SHARE:
                    src = rng.choice(self.rows)
                    new.append(self.fork(src, min(p, int(m.lo[src]))))
                    self.forked += 1
                    continue
                if m.can_admit([p]) == 0 and m.cached:   # room is short: evict cached pages first
                    m.evict(m.pages_for(p) + 1)
                    self.evicted += 1
                try:
                    new += m.admit([p])
                except WouldNotFit:
                    raise SystemExit(churn_too_big(args)) from None
            self.rows += new
            admit_us = (time.perf_counter_ns() - ta) / 1e3
            # the batch changed: new arrays (kept between turnovers)
            self.batch, self.prio = np.asarray(self.rows, dtype=np.int64), -np.arange(len(self.rows))
        if m.preemption(self.batch, self.prio):
            raise SystemExit(churn_too_big(args))
        m.decode(self.batch)
        return admit_us

    def after(self, step):
        """Bookkeeping after step ``step`` (timed with it): snapshots, the gap, reconciliation."""
        args, m = self.args, self.m
        if step % args.snapshot_every == 0:
            self.snaps.append((step, m.snapshot()))
        while self.snaps and self.snaps[0][1].ready():
            s_step, snap = self.snaps.pop(0)
            self.gaps.append((s_step, snap.stats()["pages.free.current"] - snap.free))
            if s_step % args.reconcile_every == 0:
                m.reconcile(snap)


class ReadOkChurn:
    """The baseline: host lengths, direct table calls, ``ok`` read after every call (module note)."""

    def __init__(self, args, device, rng):
        self.args, self.device, self.rng = args, device, rng
        self.pool, self.table = setup(args, device)
        self.free_rows = list(range(self.table.max_requests - 1, -1, -1))
        self.rows, self.failed = [], 0
        self.ids = self.ones = None
        while len(self.rows) < args.requests:
            before = len(self.rows)
            self.admit([rng.randint(*PROMPTS) for _ in range(min(16, args.requests - len(self.rows)))])
            if len(self.rows) == before:
                raise stalled(args)

    def t32(self, v):
        return torch.tensor(v, dtype=torch.int32, device=self.device)

    def admit(self, ps):
        got = [self.free_rows.pop() for _ in ps]
        res = self.table.extend(self.t32(got), self.t32(ps), max_tokens=sum(ps))
        for r, ok in zip(got, res.ok.tolist()):   # a host read
            if ok:
                self.rows.append(r)
            else:
                self.failed += 1
                self.free_rows.append(r)

    def step(self, step):
        args, rng = self.args, self.rng
        admit_us = None
        if step % args.every == 0:
            done = rng.sample(self.rows, args.turnover)
            self.table.release(self.t32(done))
            self.free_rows.extend(done)
            self.rows[:] = [r for r in self.rows if r not in done]
            ta = time.perf_counter_ns()
            self.admit([rng.randint(*PROMPTS) for _ in range(args.turnover)])
            admit_us = (time.perf_counter_ns() - ta) / 1e3
            self.ids = self.t32(self.rows)
            self.ones = torch.ones(len(self.rows), dtype=torch.int32, device=self.device)
        res = self.table.step(self.ids, self.ones)
        self.failed += len(self.rows) - sum(res.ok.tolist())   # a host read every step
        return admit_us

    def after(self, step):
        pass


TURN = 256      # steps a scheduler runs before the next takes its turn (~2 ms warm: far below a busy spell)
TURN_COLD = 16  # the same with --cold, where each step also waits for 64 MiB written (~80 ms a turn)
PROGRESS_S = 5.0  # seconds: a progress line after the first block, the last, and a block ending this long after one


def run(churns, args, steps, flush=None, suffix=""):
    """Run every scheduler in ``churns`` (name -> churn) for ``--warmup`` + ``steps`` steps, taking turns in
    blocks of ``TURN`` steps (``TURN_COLD`` with ``flush``; in an order shuffled every block, seeded), so
    the machine's noise falls on every scheduler alike instead of on whichever ran during a busy second.
    Blocks, not single steps: a step after another scheduler's finds its caches, branch history and the
    interpreter's state taken by that one, and taking turns step by step made the warm rows ~25% slower
    and the cold ones ~2x (one run, against one scheduler after another), so neither measured a loop.

    A timed step is ``churn.step(i)`` and ``churn.after(i)``: the mirror's snapshots and reconciliation are
    part of its loop (as in ``test_bench_scheduler.py``). With ``flush``: the CPU caches are evicted before
    each step (untimed). Returns name -> (µs per step, µs per admission block), after the warm-up.
    """
    step_us = {name: [] for name in churns}
    admit_us = {name: [] for name in churns}
    names, order = list(churns), random.Random(args.seed + 1)
    total = args.warmup + steps
    turn = TURN_COLD if flush else TURN
    shown = time.perf_counter()
    for start in range(0, total, turn):
        order.shuffle(names)
        for name in names:
            churn = churns[name]
            for step in range(start, min(start + turn, total)):
                if flush:
                    flush()
                t0 = time.perf_counter_ns()
                a_us = churn.step(step)
                churn.after(step)
                t1 = time.perf_counter_ns()
                if step >= args.warmup:
                    step_us[name].append((t1 - t0) / 1e3)
                    if a_us is not None:
                        admit_us[name].append(a_us)
        done = min(start + turn, total)  # steps each scheduler has run (a cold one: ~10-30 ms a step)
        if start == 0 or done == total or time.perf_counter() - shown >= PROGRESS_S:
            progress(f"{', '.join(churns)}{suffix}, taking turns: {done}/{total} steps done")
            shown = time.perf_counter()
    return {name: (step_us[name], admit_us[name]) for name in churns}


def mirror_result(churn, step_us, admit_us):
    s = churn.pool.stats()
    churn.pool.check()
    return dict(step_us=step_us, admit_us=admit_us, gaps=churn.gaps, failed=s["requests.failed"], reads=0,
                forked=churn.forked, evictions=churn.evicted, cached=s["pages.cached.current"])


def read_ok_result(churn, args, steps, step_us, admit_us):
    churn.pool.check()
    total = args.warmup + steps
    reads = total + len(range(0, total, args.every))
    return dict(step_us=step_us, admit_us=admit_us, gaps=[], failed=churn.failed, reads=reads / total)


def rolling_median(xs, w):
    """(positions, medians) of the full windows of ``w`` steps."""
    return range(w, len(xs) + 1), [statistics.median(xs[i - w:i]) for i in range(w, len(xs) + 1)]


def plot(path, results, every):
    """Two panels: the mirror's gap over time; every step's time (dots) with a rolling median (line),
    warm solid and cold dashed, on a log scale (a turnover step, with its prefill, is the tall dots)."""
    import matplotlib  # present: main refuses --plot without it (parse_args_for_plot)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(2, 1, figsize=(10, 8), dpi=120, gridspec_kw=dict(height_ratios=[1, 2]))
    bases = list(dict.fromkeys(n.removesuffix(", cold") for n in results))
    colors = plt.get_cmap("tab10")
    for name, r in results.items():
        color = colors(bases.index(name.removesuffix(", cold")) % 10)
        cold = name.endswith(", cold")
        if r["gaps"] and not cold:
            a.plot([g[0] for g in r["gaps"]], [g[1] for g in r["gaps"]], color=color, label=name)
        xs = r["step_us"]
        b.plot(range(len(xs)), xs, ".", ms=1.5, alpha=0.25, color=color)
        b.plot(*rolling_median(xs, 8 * every), "--" if cold else "-", color=color,
               label=f"{name} (median of the last {8 * every} steps)")
    a.set(xlabel="step", ylabel="device free - mirror free (pages)", title="the mirror's gap to the device")
    b.set(xlabel="step (after the warm-up)", ylabel="host µs per step", yscale="log",
          title=f"time of every step (dots; a turnover every {every} steps is the upper band)")
    b.grid(True, which="both", alpha=0.3)
    if a.get_legend_handles_labels()[0]:
        a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"\nwrote {path}")


def parser():
    """The command line: every option with its help and default."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter,
                                 epilog=f"Progress goes to stderr. The schedulers take turns in blocks of {TURN} "
                                        f"steps ({TURN_COLD} cold; in an order shuffled every block). With --cold, "
                                        "they run twice: warm "
                                        "(--steps steps), then cold (--cold-steps steps, --cold-bytes written "
                                        "before each step, untimed).")
    ap.add_argument("--steps", type=positive_int, default=4000, help="timed steps per scheduler (warm)")
    ap.add_argument("--warmup", type=non_negative_int, default=64, help="untimed steps first, for compilation")
    ap.add_argument("--requests", type=positive_int, default=256, help="running requests")
    ap.add_argument("--turnover", type=positive_int, default=2,
                    help="requests finished and admitted each --every steps")
    ap.add_argument("--every", type=positive_int, default=8, help="steps between turnovers")
    ap.add_argument("--num-pages", type=positive_int, default=65536,
                    help="pages in the pool, at least what the --requests prompts admitted at the start take")
    ap.add_argument("--lookahead", type=non_negative_int, default=1, help="tokens reserved per running request")
    ap.add_argument("--snapshot-every", type=positive_int, default=16, help="steps between async snapshots")
    ap.add_argument("--reconcile-every", type=positive_int, default=256,
                    help="steps between reconciliations; a multiple of --snapshot-every")
    ap.add_argument("--scenarios", nargs="+", action=Distinct, default=["plain", "shared"], choices=["plain", "shared"],
                    help="mirror scenarios to run (default: plain shared)")
    ap.add_argument("--cold", action="store_true",
                    help="also run every scheduler with the CPU caches evicted before each step (a forward "
                         "pass's worth of memory written, outside the timed region); warm and cold side by side")
    ap.add_argument("--cold-steps", type=positive_int, default=1000, help="timed steps per scheduler in --cold mode")
    ap.add_argument("--cold-bytes", type=positive_int, default=COLD_BYTES, help="bytes written before each cold step")
    ap.add_argument("--backend", default="auto", help="pool backend (auto: numba on a CPU, triton on CUDA)")
    ap.add_argument("--device", default=None, type=device_arg, help="device (default cuda if available, else cpu)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the workload")
    ap.add_argument("--plot", type=out_path, default="", metavar="PATH",
                    help="write a PNG: the mirror's gap over time and the time of every step (warm solid, cold "
                         "dashed)")
    ap.add_argument("--json", type=out_path, default="", metavar="PATH", help="write the result rows to this JSON file")
    return ap


def main(argv=None):
    ap = parser()
    args = parse_args_for_plot(ap, argv)
    if args.turnover > args.requests:
        ap.error(f"argument --turnover: {args.turnover} is more than --requests ({args.requests})")
    if args.reconcile_every % args.snapshot_every:
        ap.error(f"argument --reconcile-every: {args.reconcile_every} is not a multiple of --snapshot-every "
                 f"({args.snapshot_every})")
    if startup_pages(args) > args.num_pages:
        ap.error(f"argument --num-pages: {too_small(args)}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_backends(ap, "--backend", [args.backend], device)
    backend = resolve_backend(args.backend, torch.device(device))  # what auto (or TPOOL_BACKEND) runs: the title's
    modes = [("", args.steps, None)]
    if args.cold:
        modes.append((", cold", args.cold_steps, CacheFlusher(args.cold_bytes)))
    results = {}
    for suffix, steps, flush in modes:
        churns = {"read-ok": ReadOkChurn(args, device, random.Random(args.seed))}
        for sc in args.scenarios:
            churns[f"mirror-{sc}"] = MirrorChurn(args, sc, device, random.Random(args.seed))
        for name, (step_us, admit_us) in run(churns, args, steps, flush, suffix).items():
            churn = churns[name]
            results[name + suffix] = (read_ok_result(churn, args, steps, step_us, admit_us) if name == "read-ok"
                                      else mirror_result(churn, step_us, admit_us))
        del churns
    rows, out = [], []
    for name, r in results.items():
        cold = name.endswith(", cold")
        base = statistics.median(results["read-ok" + (", cold" if cold else "")]["step_us"])
        med, p20, p80 = quantiles(r["step_us"])
        amed = statistics.median(r["admit_us"]) if r["admit_us"] else None  # none when --steps < --every
        gaps = [g for _, g in r["gaps"]]
        gap = f"{statistics.median(gaps):.0f} / {max(gaps)}" if gaps else "-"
        rows.append([name, f"{med:.1f}", f"{p20:.1f}", f"{p80:.1f}", f"{base / med:.2f}x", f"{r['reads']:.3f}",
                     f"{args.turnover / amed * 1e6:,.0f}" if amed else "-", r["failed"], gap])
        out.append(dict(name=name, cold=cold, step_us_median=med, step_us_p20=p20, step_us_p80=p80,
                        vs_read_ok=base / med, admissions_per_s=args.turnover / amed * 1e6 if amed else None,
                        failed_extends=r["failed"], device_reads_per_step=r["reads"], step_us=r["step_us"],
                        gap=r["gaps"], backend=backend, device=str(device),
                        **{k: r[k] for k in ("forked", "evictions", "cached") if k in r}))
    print_table(f"churn: {args.requests} running, prompts {PROMPTS[0]}-{PROMPTS[1]} tokens, pages of {PAGE_SIZE}, "
                f"{args.turnover} out / {args.turnover} in every {args.every} steps, {args.steps} steps"
                + (f" ({args.cold_steps} cold, {size_text(modes[-1][2].buf.nbytes)} written before each)" if args.cold
                   else "")
                + f", {backend} on {device} (host us per step; ratio = read-ok's median / row's median, "
                  "warm against warm, cold against cold)",
                ["scheduler", "median us", "p20", "p80", "vs read-ok", "device reads/step", "admissions/s",
                 "failed extends", "gap median / max"], rows)
    if args.plot:
        plot(args.plot, results, args.every)
    write_json(args.json, "bench_scheduler", out)


if __name__ == "__main__":
    main()
