"""Benchmark: how often the serving engine reconciles its mirror, against how often it preempts.

The engine schedules on a host mirror that under-promises (counts fewer free or cached pages
than the device holds) after a forked prefix is released or the prefix cache revives pages,
until a snapshot of the pool is reconciled. ``Engine(reconcile_every=N)`` starts that snapshot
only on every N-th step. The same fixed-seed requests (``make_requests``: a shared system
prompt, every fifth request sharing the previous one's prompt) are served once per value of
``--reconcile-every`` by the demo's tiny random Llama (``tiny_model``), with the prefix cache
and speculative decoding (every third request drafts 3 tokens), on the same small pool.
Reported per value, all counts (nothing here is timed): steps, requests preempted, forks,
prefix-cache hits, CACHED pages evicted, snapshots taken, and output tokens. Each run ends
with ``Engine.check()``, and every run's tokens must equal the first run's (greedy decoding:
how often the loop reconciles must not change a token), or the script fails.

    python benchmarks/bench_reconcile.py                          # about 20 s on 2 cores
    python benchmarks/bench_reconcile.py --reconcile-every 1 4 16 64
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import (Distinct, HelpFormatter, check_backends, out_path, positive_int, print_table,  # noqa: E402
                     need_transformers, progress, seed_int, write_json)



def parser() -> argparse.ArgumentParser:
    """The command line: every option with its help and default."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="Progress goes to stderr, one line "
                                 "per run of the engine.", formatter_class=HelpFormatter)
    ap.add_argument("--reconcile-every", type=positive_int, nargs="+", action=Distinct, default=[1, 16],
                    metavar="N", help="steps between the snapshots the engine starts (one run per value)")
    ap.add_argument("--requests", type=positive_int, default=1000, help="requests served per run")
    ap.add_argument("--num-pages", type=positive_int, default=128, help="pages in the pool (small: the loop preempts)")
    ap.add_argument("--page-size", type=positive_int, default=4, help="tokens per page")
    ap.add_argument("--max-batch", type=positive_int, default=32, help="requests running at once (the table's rows)")
    ap.add_argument("--system-len", type=positive_int, default=8, help="system prompt tokens, shared by every prompt")
    ap.add_argument("--backend", default="numba", help="pool backend")
    ap.add_argument("--seed", type=seed_int, default=0, help="seed of the weights and the requests, 0 to 2**64 - 1")
    ap.add_argument("--json", type=out_path, default=None, metavar="PATH", help="also write the rows as JSON")
    return ap


def run_once(model, a, every: int) -> tuple:
    """Serve ``a``'s requests with ``reconcile_every=every``; returns ``(stats, tokens)``."""
    from tpool.serving.engine import Engine, make_requests, max_len
    reqs = make_requests(a.requests, seed=a.seed, vocab_size=model.config.vocab_size, system_len=a.system_len)
    max_pages = -(-max(max_len(r) for r in reqs) // a.page_size)
    eng = Engine(model, num_pages=a.num_pages, page_size=a.page_size, max_batch=a.max_batch, max_pages=max_pages,
                 backend=a.backend, reconcile_every=every)
    tokens = eng.run(reqs)
    eng.check()
    return eng.stats, tokens


def main(argv=None):
    ap = parser()
    a = ap.parse_args(argv)
    check_backends(ap, "--backend", [a.backend], "cpu")
    need_transformers(ap)
    from tpool.serving.engine import make_requests, max_len, tiny_model  # (transformers: --help works without it)
    torch.set_num_threads(1)
    model = tiny_model("llama", seed=a.seed)
    longest = max(max_len(r) for r in make_requests(a.requests, seed=a.seed, vocab_size=model.config.vocab_size,
                                                     system_len=a.system_len))
    if (pages := -(-longest // a.page_size)) > a.num_pages:  # (before any run: a usage error, not a failed run)
        ap.error(f"argument --num-pages: expected at least {pages}, the pages of the longest request, "
                 f"got {a.num_pages}")
    rows, out, first = [], [], None
    for every in a.reconcile_every:
        s, tokens = run_once(model, a, every)
        progress(f"reconcile every {every}: {s.steps} steps, {s.preemptions} preemptions")
        if first is None:
            first = tokens
        elif tokens != first:
            bad = sorted(rid for rid in first if tokens[rid] != first[rid])
            raise SystemExit(f"reconcile every {every}: requests {bad[:10]} got other tokens than the first run's")
        snaps = s.calls.get("HostMirror.snapshot", [0.0, 0])[1]
        row = dict(reconcile_every=every, steps=s.steps, preemptions=s.preemptions, forks=s.forks,
                   cache_hits=s.cache_hits, evicted=s.evicted, snapshots=snaps, tokens=s.tokens_out)
        out.append(row)
        rows.append(list(row.values()))
    print_table(f"serving engine: {a.requests} requests, {a.num_pages} pages of {a.page_size} tokens, "
                f"{a.max_batch} rows, system prompt {a.system_len} tokens, prefix cache, speculative decoding, "
                f"{a.backend}, seed {a.seed} (counts, the same tokens in every run)",
                ["reconcile every", "steps", "preemptions", "forks", "cache hits", "evicted", "snapshots",
                 "tokens"], rows)
    write_json(a.json, "bench_reconcile", out)


if __name__ == "__main__":
    main()
