"""``python -m tpool demo``: a decode loop scheduled on a host mirror of the pool, never reading the device.

Requests (prompt and output lengths from a fixed seed) wait in a queue; up to
``--batch`` run at once. Each step admits waiting requests in arrival order
while the mirror says their prompts and reservations fit (a prefill
``extend``), preempts the newest running requests if the mirror says the
decode step would not fit (released before the step, requeued, recomputed
later, as vLLM does), decodes one token for the running batch (``step``:
extend + FlashInfer CSR) and releases the requests that finished. Every
decision is made on host integers (:class:`tpool.scheduling.HostMirror`):
no step reads the device. A report row every ``--every`` steps is the
loop's one sync point (an async snapshot of the counters, read at once); the
run ends with ``pool.check()`` and ``check_invariants()``. A request that
could never fit (more pages than the pool or a table row holds) is rejected
with a message instead of waiting forever.
"""

import argparse
import collections
import itertools
import random
import statistics
import sys
import time

from tpool import _checks
from tpool._prog import prog
from tpool.kernels.layout import INT32_MAX
from tpool.page_table import PageTable
from tpool.pool import PagePool
from tpool.scheduling import HostMirror

ADMIT_PER_STEP = 4   # most requests admitted in one step (one prefill extend)
LOOKAHEAD = 1        # tokens of growth reserved for every running request
SHOW_REJECTED = 3    # rejected requests named one by one; the rest are counted

HEADER = (f"{'step':>6} {'running':>7} {'waiting':>7} {'done':>5} {'rejected':>8} {'used':>6} {'free':>6} "
          f"{'mirror':>6} {'reserved':>8} {'preempted':>9} {'step us':>8} {'progress':>8}")
LEGEND = """columns: running / waiting / done / rejected = requests; used, free = pages on the device,
read at this row (the loop's only sync point); mirror = free pages the scheduler counts on the host
(never read from the device; equal to free here, since nothing is shared or cached); reserved = pages
set aside for the running requests' next token (only a request whose last page is full needs one);
preempted = requests released to make room, total; step us = median host time of a scheduler step
since the last row (admit + plan + decode + finish, no device sync: on CUDA the kernels run behind
it; row 0 is the first step alone, with its admissions); progress = requests done or rejected, of all
(rounded down: 100% only once every request is settled)."""


def request_lengths(requests: int, seed: int = 0) -> tuple:
    """The demo's requests: ``(prompts, outputs)``, each a list of token counts drawn from ``seed``
    (prompts of 128-2048 tokens, outputs of 16-384)."""
    rng = random.Random(seed)
    prompts = [rng.randint(128, 2048) for _ in range(requests)]
    return prompts, [rng.randint(16, 384) for _ in range(requests)]


def run(requests=256, batch=64, num_pages=4096, page_size=16, seed=0, device=None, backend="auto",
        every=None, out=print):
    """Run the demo; returns the pool's final ``stats()``. ``out`` prints a line (``flush=`` accepted).

    ``every``: steps between report rows; None picks a multiple of 25 that prints about
    50 rows (:func:`auto_every`). A count below 1 (``requests``, ``page_size``, ``every``; the pool
    and the table check ``num_pages`` and ``batch``) is an :class:`OptionError` naming it.
    """
    try:  # (the command line's types check these; a caller of run has only this)
        requests = _checks.check_size(requests, "requests", 1)       # 0: the longest of no requests below
        page_size = _checks.check_size(page_size, "page_size", 1)    # divides below, before the pool checks it
        every = None if every is None else _checks.check_size(every, "every", 1)
    except ValueError as e:
        raise OptionError(str(e)) from None
    prompts, outputs = request_lengths(requests, seed)
    max_pages = (max(prompts) + max(outputs)) // page_size + 1
    pool, table = _build(num_pages, page_size, device, backend, batch, max_pages)
    out(f"tpool demo: {requests} requests, up to {batch} running, {pool!r}", flush=True)

    # Warm up every kernel once (compilation: the table's and the mirror's), leaving no trace in the state.
    # The warm request may grow past its first page, but never past a row of the table (max_pages == 1
    # when a page holds the longest request) nor past the pool (--num-pages 1): the mirror's capacity. A
    # capacity of one token (--num-pages 1 --page-size 1) leaves it no token to decode.
    from tpool.graphs import preserved
    with preserved(table):
        warm = HostMirror(table, lookahead=LOOKAHEAD, free=num_pages, cached=0)
        rows = warm.admit([1], [min(page_size + 2, warm.capacity)])
        if warm.capacity > 1:
            warm.preemption(rows, [0])
            warm.decode(rows)
        warm.finish(rows)
    mirror = HostMirror(table, lookahead=LOOKAHEAD, free=num_pages, cached=0)  # a fresh pool: nothing to read

    limit = min(num_pages, max_pages) * page_size
    rejected = [q for q in range(requests) if prompts[q] + outputs[q] > limit]
    # Arrival order = priority. A deque: admissions take its head and preempted requests (older than
    # every waiting one) go back at its head, so a step costs the same with 1,000,000 requests waiting
    # (a list's head deleted and the whole queue re-sorted took most of such a run's time).
    waiting = collections.deque(sorted(set(range(requests)) - set(rejected)))
    if every is None:
        every = auto_every([prompts[q] for q in waiting], [outputs[q] for q in waiting], batch,
                           num_pages * page_size)
    for q in rejected[:SHOW_REJECTED]:
        out(f"rejected request {q}: it needs {mirror.pages_for(prompts[q] + outputs[q])} pages (prompt {prompts[q]} "
            f"+ output {outputs[q]} tokens, {page_size} a page), the pool has {num_pages}")
    if len(rejected) > SHOW_REJECTED:
        out(f"... and {len(rejected) - SHOW_REJECTED} more requests rejected for the same reason")
    if len(rejected) < requests:
        out(LEGEND + "\n")
        out(HEADER)
    row_of, req_of, generated = {}, {}, {}
    finished = preempted = step = 0
    step_us, window = [], []
    while waiting or row_of:
        t0 = time.perf_counter()
        # Admit in arrival order while the prompts and their reservations fit.
        head = list(itertools.islice(waiting, min(ADMIT_PER_STEP, mirror.rows_free)))
        k = mirror.can_admit([prompts[q] for q in head], [prompts[q] + outputs[q] for q in head])
        if k:
            for q, r in zip(head[:k], mirror.admit([prompts[q] for q in head[:k]],
                                                   [prompts[q] + outputs[q] for q in head[:k]])):
                row_of[q], req_of[r], generated[q] = r, q, 0
            for _ in range(k):
                waiting.popleft()
        # Plan the decode step on the host; preempt the newest requests if it would not fit.
        running = sorted(row_of)                       # oldest first
        rows = [row_of[q] for q in running]
        victims = mirror.preemption(rows, [-q for q in running])
        if victims:
            back = [req_of.pop(r) for r in victims]
            mirror.finish(victims)
            for q in back:
                del row_of[q]
                generated[q] = 0                       # recomputed from the prompt when readmitted
            _requeue(waiting, back)
            preempted += len(victims)
            rows = [r for r in rows if r in req_of]
        if rows:
            mirror.decode(rows)                        # every lane fits: the mirror proved it
            for r in rows:
                generated[req_of[r]] += 1
        # Finish the requests that produced all their tokens.
        done = [r for r in rows if generated[req_of[r]] >= outputs[req_of[r]]]
        if done:
            mirror.finish(done)
            for r in done:
                del row_of[req_of.pop(r)]
            finished += len(done)
        window.append((time.perf_counter() - t0) * 1e6)
        if step % every == 0 or not (waiting or row_of):
            _report(out, mirror, step, len(row_of), len(waiting), finished, len(rejected), preempted, window,
                    100 * (finished + len(rejected)) // requests)
            step_us += window
            window = []
        step += 1
    s = _final_check(pool, table, mirror)
    if step == 0:
        out(f"\nno request fits this pool: nothing to run (it holds --num-pages x --page-size = "
            f"{num_pages * page_size} tokens: raise either)")
    else:
        q = statistics.quantiles(step_us, n=10) if len(step_us) > 1 else step_us * 9
        out(f"\n{step} steps; scheduler step median {statistics.median(step_us):.1f} us "
            f"(p20 {q[1]:.1f}, p80 {q[7]:.1f}), no device read inside a step")
    out(f"pages allocated {s['pages.allocated']}, freed {s['pages.freed']}, peak in use {s['pages.used.peak']} "
        f"of {num_pages}; requests done {finished}, rejected {len(rejected)}, preemptions {preempted} "
        f"(requeued, recomputed); failed extends {s['requests.failed']}; no errors, invariants hold")
    return s


def _requeue(waiting, back):
    """Put the preempted requests ``back`` into ``waiting`` in arrival order: at its head when all are older
    than its first (always, when the newest running requests are the ones preempted), else by sorting."""
    back = sorted(back)
    if not waiting or back[-1] < waiting[0]:
        waiting.extendleft(reversed(back))
    else:
        merged = sorted([*waiting, *back])
        waiting.clear()
        waiting.extend(merged)


def auto_every(prompts, outputs, batch, pool_tokens, rows=50):
    """Steps between report rows for about ``rows`` rows: a multiple of 25, at least 25.

    The run's length is estimated from the decode tokens over the requests that run at
    once (the batch, or fewer when the pool holds fewer whole requests); the default
    demo (~1,230 steps) gets 25.
    """
    if not prompts:
        return 25
    running = max(1, min(batch, pool_tokens * len(prompts) // sum(p + o for p, o in zip(prompts, outputs))))
    steps = sum(outputs) / running
    return 25 * max(1, round(steps / rows / 25))


def _report(out, mirror, step, running, waiting, done, rejected, preempted, window, percent):
    """One report row: the loop's sync point (the snapshot is read at once), which also reconciles.
    ``percent``: the requests settled, rounded down, so that 100% means all (995 of 1,000 rounded is 100%).

    The mirror column is the free count the scheduler kept, taken before the reconciliation (which
    would set it to the device's), and must equal the device's: nothing is shared or cached, so the
    mirror is exact; one counting fewer (safe, but pages lost to the scheduler) fails the run here,
    as one counting more fails ``reconcile``."""
    counted = mirror.free
    s = mirror.reconcile(mirror.snapshot())
    if counted != s["pages.free.current"]:
        raise AssertionError(f"step {step}: mirror {counted} free pages, device {s['pages.free.current']}")
    med = statistics.median(window) if window else 0.0
    out(f"{step:>6} {running:>7} {waiting:>7} {done:>5} {rejected:>8} {s['pages.used.current']:>6} "
        f"{s['pages.free.current']:>6} {counted:>6} {mirror.reserved:>8} {preempted:>9} {med:>8.1f} "
        f"{percent:>7}%", flush=True)


def _final_check(pool, table, mirror):
    """The end of the run: device errors, invariants, and the mirror against the device."""
    pool.check()
    table.check_invariants()
    s = pool.stats()
    if mirror.free != s["pages.free.current"] or s["requests.failed"]:
        raise AssertionError(f"mirror {mirror.free} free pages, device {s['pages.free.current']}; "
                             f"failed extends {s['requests.failed']}")
    return s


def _int(text, what: str) -> int:
    """``text`` as an int, or the argparse error saying ``what`` was expected: argparse words a
    ``ValueError`` from a type function with the function's own name (``invalid parse value: '1e3'``)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def positive_int(text):
    """argparse type of the demos' counts: an int of at least 1."""
    v = _int(text, "a positive int")
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text}")
    return v


def at_most(hi: int, why: str):
    """argparse type of a demo count of at least 1 and at most ``hi`` (``why``: what a larger one would
    cost, for the message)."""
    def parse(text):
        v = positive_int(text)
        if v > hi:
            raise argparse.ArgumentTypeError(f"expected at most {hi:,} ({why}), got {text}")
        return v
    return parse


MAX_REQUESTS = 1_000_000      # the queue's lengths are host lists made up front
MAX_PAGES = 1 << 24           # 16,777,216 pages: ~1 GiB of pool state; the library itself takes more
MAX_BATCH = 1 << 16           # 65,536 table rows
MAX_POOL_TOKENS = INT32_MAX   # num_pages x page_size: slot indices are int32 (PageTable's own bound)


def count_int(text):
    """argparse type of the demos' sizes that may be 0: an int of at least 0."""
    v = _int(text, "an int of at least 0")
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an int of at least 0, got {text}")
    return v


SEED_MAX = 2**64 - 1   # torch.manual_seed's largest seed (the serving demo seeds torch with it)


def seed_int(text):
    """argparse type of the demos' ``--seed``: an int from 0 to ``SEED_MAX`` (what ``torch.manual_seed`` takes)."""
    v = _int(text, f"an int from 0 to {SEED_MAX} (2**64 - 1)")
    if not 0 <= v <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"expected an int from 0 to {SEED_MAX} (2**64 - 1), got {text}")
    return v


def wants_model(argv) -> bool:
    """Whether demo options ``argv`` name a model (``--model NAME`` or ``--model=NAME``, the only spellings
    the demos' parsers accept: they take no abbreviations), so the serving demo runs instead."""
    argv = list(argv)
    argv = argv[:argv.index("--")] if "--" in argv else argv
    return any(a == "--model" or a.startswith("--model=") for a in argv)


class OptionError(ValueError):
    """A demo's options describe something that cannot be made: a pool, table, model or request
    (the message says why). Both demos (this one and ``tpool.serving.engine``'s) raise it."""


def _build(num_pages, page_size, device, backend, batch, max_pages):
    try:
        pool = PagePool(num_pages, page_size, device=device, backend=backend)
        return pool, PageTable(pool, batch, max_pages)
    except (ValueError, ImportError) as e:  # ImportError: backend="triton" without triton installed
        raise OptionError(str(e)) from e


def main(argv=None):
    """``python -m tpool demo [options]``; with ``--model NAME`` the serving demo (:func:`tpool.serving.cli.main`)
    parses the options and runs instead."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if wants_model(argv):
        from tpool.serving.cli import main as serve_main  # transformers is imported after the options are parsed
        return serve_main(argv)
    ap = argparse.ArgumentParser(
        prog=prog("demo"), allow_abbrev=False,
        description="A decode loop scheduled on a host mirror of the pool: admissions, preemptions, decode steps "
                    "and finishes decided on host integers, never reading the device inside a step.")
    ap.add_argument("--requests", type=at_most(MAX_REQUESTS, "the demo makes every request's lengths up front"),
                    default=256, help=f"requests in the queue, at most {MAX_REQUESTS:,} (default 256)")
    ap.add_argument("--batch", type=at_most(MAX_BATCH, "a table row each, sized for the longest request"), default=64,
                    help=f"most requests running at once, the table's rows, at most {MAX_BATCH:,} (default 64)")
    ap.add_argument("--num-pages", type=at_most(MAX_PAGES, "~64 B of pool state a page; PagePool itself takes more"),
                    default=4096, help=f"pages in the pool, at most {MAX_PAGES:,} (default 4096)")
    ap.add_argument("--page-size", type=positive_int, default=16,
                    help=f"tokens per page (default 16); --num-pages x --page-size at most {MAX_POOL_TOKENS:,}")
    ap.add_argument("--seed", type=seed_int, default=0, help="seed of the prompt (128-2048) and output (16-384) "
                    "lengths, 0 to 2**64 - 1 (default 0)")
    ap.add_argument("--device", default=None, help="torch device of the pool, e.g. cpu, cuda, cuda:1 "
                    "(default: cuda if available, else cpu; cpu with the numba backend)")
    ap.add_argument("--backend", default="auto", choices=["auto", "reference", "numba", "triton"],
                    help="kernels (default auto: triton on CUDA, numba on a CPU; triton on a CPU "
                         "needs TRITON_INTERPRET=1)")
    ap.add_argument("--every", type=positive_int, default=None, help="print a report row every N steps (default: "
                    "a multiple of 25 that prints about 50 rows; 25 for the default run)")
    ap.add_argument("--model", choices=["llama", "gpt-neox"], default=None,
                    help="serve a tiny random-weight transformers model on tpool pages instead and check its "
                         "tokens against generate (needs transformers: the hf extra; its own options are listed by "
                         "`demo --model llama --help`; "
                         "default: none, the simulation)")
    a = ap.parse_args(argv)
    if a.num_pages * a.page_size > MAX_POOL_TOKENS:  # (else the pool's or the table's own check, naming neither)
        ap.error(f"--num-pages x --page-size: expected at most {MAX_POOL_TOKENS:,} tokens (slot indices are int32), "
                 f"got {a.num_pages:,} x {a.page_size:,} = {a.num_pages * a.page_size:,}")
    if a.device is not None:
        try:
            _checks.resolve_device(a.device, "--device")
        except ValueError as e:
            ap.error(str(e))
    try:
        s = run(a.requests, a.batch, a.num_pages, a.page_size, a.seed, a.device, a.backend, a.every)
        if s["pages.allocated"] == 0:
            return 1      # no request fitted the pool: nothing ran (said above), a failed run for a script
    except OptionError as e:
        ap.error(str(e))

if __name__ == "__main__":  # `python -m tpool.demo`: as `python -m tpool demo` (its pipe and output errors)
    from tpool.__main__ import main as cli
    sys.exit(cli(["demo", *sys.argv[1:]]))
