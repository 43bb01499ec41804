"""Benchmark: the serving engine's prefix cache, a shared system prompt served with and without it.

Every prompt starts with the same ``--system-len`` tokens (a system prompt) and goes on with
its own; ``--requests`` of them arrive a few per step, on a pool of ``--num-pages`` pages,
small enough that pages are reused. The same requests run through ``Engine.run`` twice per
repeat, in the same process, taking turns: with the prefix cache (a finished or preempted
request's whole pages stay CACHED, and a later prompt that starts with them revives them
instead of computing them again) and without it (``prefix_cache=False``: the baseline).
The model is a random-weight Llama built from a config (bench_e2e.py's sizes), on the
``tpool_paged`` attention. Reported per configuration: the wall time of ``run`` (median,
p20/p80 over ``--repeats``; a first pair, untimed, compiles and warms up), output tokens/s,
prompt tokens computed against revived, cache hits, pages evicted, preemptions, steps,
tpool and forward time per step (``Engine.stats``), and the ratio of tokens/s (with the
cache over without). Each run ends with ``Engine.check()``; every run's tokens must equal
the first run's (greedy decoding: the cache must not change a token), or the script fails.

    python benchmarks/bench_prefix.py                   # about a minute
    python benchmarks/bench_prefix.py --quick           # ~15 s on 2 cores
    python benchmarks/bench_prefix.py --calls           # and the tpool calls of the loop, one row each
    python benchmarks/bench_prefix.py --system-len 256 --requests 128 --num-pages 96 --json prefix.json
"""

import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import (HelpFormatter, check_backends, check_model, non_negative_int, out_path, positive_int,  # noqa: E402
                     need_transformers, print_table, progress, quantiles, seed_int, write_json)
from bench_e2e import POSITIONS, build_model as build_llama  # noqa: E402

QUICK = dict(requests=16, repeats=2)   # --quick: what it changes, where the option is not given
FULL = dict(requests=64, repeats=7)


def parser() -> argparse.ArgumentParser:
    """The command line: every option with its help and default."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="Progress goes to stderr, one line "
                                 "per run of the engine.", formatter_class=HelpFormatter)
    ap.add_argument("--system-len", type=positive_int, default=64, help="system prompt tokens, shared by every prompt")
    ap.add_argument("--prompt-len", type=positive_int, nargs=2, default=[8, 32], metavar=("MIN", "MAX"),
                    help="each prompt's own tokens after the system prompt, drawn from MIN to MAX")
    ap.add_argument("--max-new", type=positive_int, nargs=2, default=[8, 24], metavar=("MIN", "MAX"),
                    help="new tokens per request, drawn from MIN to MAX")
    ap.add_argument("--requests", type=positive_int, default=None,
                    help=f"requests served per run (default {FULL['requests']}; {QUICK['requests']} with --quick)")
    ap.add_argument("--num-pages", type=positive_int, default=48,
                    help="pages in the pool (small enough that pages are reused)")
    ap.add_argument("--page-size", type=positive_int, default=16, help="tokens per page")
    ap.add_argument("--max-batch", type=positive_int, default=8, help="requests running at once (the table's rows)")
    ap.add_argument("--repeats", type=positive_int, default=None,
                    help=f"timed runs of each configuration (with the prefix cache, without it: the two take turns), "
                         f"after an untimed pair "
                         f"(default {FULL['repeats']}; {QUICK['repeats']} with --quick)")
    ap.add_argument("--quick", action="store_true",
                    help=f"~15 s on 2 cores: {QUICK['requests']} requests, {QUICK['repeats']} repeats (unless given)")
    ap.add_argument("--backend", default="numba", help="pool backend")
    ap.add_argument("--spec-every", type=non_negative_int, default=0,
                    help="requests whose id is a multiple of this decode speculatively (0: none)")
    ap.add_argument("--draft-len", type=positive_int, default=3, help="drafted tokens per speculative step")
    ap.add_argument("--hidden", type=positive_int, default=256, help="model hidden size")
    ap.add_argument("--layers", type=positive_int, default=4, help="decoder layers")
    ap.add_argument("--heads", type=positive_int, default=8, help="query heads: divide --hidden into even head sizes")
    ap.add_argument("--kv-heads", type=positive_int, default=2, help="key/value heads (grouped-query): divide --heads")
    ap.add_argument("--vocab", type=positive_int, default=1024, help="vocabulary size, at least 2")
    ap.add_argument("--seed", type=seed_int, default=0, help="seed of the weights and the requests, 0 to 2**64 - 1")
    ap.add_argument("--threads", type=positive_int, default=1, help="torch threads (more stall on a 2-core machine)")
    ap.add_argument("--calls", action="store_true",
                    help="also print the tpool calls of the loop, one row each per configuration: calls per step, "
                         "µs per call and per step (Engine.stats.calls; medians over the runs)")
    ap.add_argument("--json", type=out_path, default="", metavar="PATH", help="also write the rows as JSON")
    return ap


def build_model(a):
    """bench_e2e.py's random Llama, with ``tiny_model``'s weight spread, so that a wrong K/V changes
    tokens and the tokens check means something."""
    from tpool.serving.engine import INITIALIZER_RANGE
    return build_llama(a.hidden, a.layers, a.heads, a.kv_heads, a.vocab, seed=a.seed,
                       initializer_range=INITIALIZER_RANGE)


def requests(a):
    """The workload, fresh (``run`` writes into its requests): system prompt + own tokens, no forks."""
    from tpool.serving.engine import make_requests
    return make_requests(a.requests, seed=a.seed, vocab_size=a.vocab, max_new=tuple(a.max_new),
                         prompt_len=tuple(a.prompt_len), share_every=0, system_len=a.system_len)


def held(a) -> int:
    """The most tokens a request of the workload ever holds in a row."""
    from tpool.serving.engine import max_len
    return max(max_len(r) for r in requests(a))


def check_args(ap, a) -> None:
    """Refuse, before any work, what the engine would refuse after the model is built."""
    for opt, (lo, hi) in (("--prompt-len", a.prompt_len), ("--max-new", a.max_new)):
        if lo > hi:
            ap.error(f"argument {opt}: expected MIN <= MAX, got {lo} {hi}")
    check_model(ap, a)
    check_backends(ap, "--backend", [a.backend], "cpu")
    n = held(a)
    if n > POSITIONS:
        ap.error(f"argument --system-len: a request would hold {n} tokens, past the model's {POSITIONS} positions")
    if n > a.num_pages * a.page_size:
        ap.error(f"argument --num-pages: a request holds up to {n} tokens, more than {a.num_pages} pages of "
                 f"{a.page_size} tokens")


def run_once(model, a, prefix_cache: bool) -> dict:
    """One ``Engine.run`` of a fresh workload on a fresh engine: its tokens, wall time and stats."""
    from tpool.serving.engine import Engine
    reqs = requests(a)
    eng = Engine(model, num_pages=a.num_pages, page_size=a.page_size, max_batch=a.max_batch,
                 max_pages=-(-held(a) // a.page_size), backend=a.backend, spec_every=a.spec_every,
                 draft_len=a.draft_len, prefix_cache=prefix_cache)
    gc.collect()
    t0 = time.perf_counter()
    got = eng.run(reqs)
    wall = time.perf_counter() - t0
    eng.check()
    s = eng.stats
    return dict(tokens=got, wall_s=wall, tokens_out=s.tokens_out, prompt_computed=s.prompt_tokens,
                tokens_fed=s.fed_tokens, revived=s.cached_tokens, cache_hits=s.cache_hits, evicted=s.evicted,
                preemptions=s.preemptions, steps=s.steps, tpool_us_per_step=s.tpool_s / s.steps * 1e6,
                forward_ms_per_step=s.forward_s / s.steps * 1e3,
                calls={name: (t / n * 1e6, n / s.steps) for name, (t, n) in s.calls.items()})


def same_tokens(want: dict, got: dict, what: str) -> None:
    bad = [rid for rid in want if want[rid] != got[rid]]
    if bad:
        raise AssertionError(f"{what}: requests {bad[:10]}{' ...' if len(bad) > 10 else ''} ({len(bad)} of "
                             f"{len(want)}) got other tokens than the first run: greedy decoding must not "
                             f"depend on the prefix cache")


def main(argv=None):
    ap = parser()
    a = ap.parse_args(argv)
    for k, v in (QUICK if a.quick else FULL).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    need_transformers(ap)
    check_args(ap, a)
    torch.set_num_threads(a.threads)
    progress(f"building a random Llama {a.layers}x{a.hidden} (importing transformers) ...")
    model = build_model(a)
    configs = {"prefix cache": True, "no prefix cache": False}
    runs = {name: [] for name in configs}
    first = None
    for rep in range(a.repeats + 1):           # repeat 0: an untimed pair (compiles, warms up)
        for name, pc in configs.items():
            r = run_once(model, a, pc)
            if first is None:
                first = r["tokens"]
            same_tokens(first, r["tokens"], f"{name}, run {rep}")
            progress(f"{name:>15}, {'warm-up' if rep == 0 else f'run {rep}/{a.repeats}'}: {r['wall_s']:.2f} s, "
                     f"{r['steps']} steps, {r['cache_hits']} hits, {r['evicted']} evicted, "
                     f"{r['preemptions']} preemptions")
            if rep:
                runs[name].append(r)
    rows = []
    for name, rs in runs.items():
        wall, p20, p80 = quantiles([r["wall_s"] for r in rs])
        row = dict(config=name, prefix_cache=configs[name], wall_s=wall, wall_p20_s=p20, wall_p80_s=p80,
                   tokens_per_s=rs[0]["tokens_out"] / wall, walls_s=[r["wall_s"] for r in rs])
        for k in ("tokens_out", "prompt_computed", "tokens_fed", "revived", "cache_hits", "evicted", "preemptions",
                  "steps"):
            row[k] = statistics.median_low(r[k] for r in rs)   # the same every run, unless a snapshot lands late
        for k in ("tpool_us_per_step", "forward_ms_per_step"):
            row[k] = statistics.median(r[k] for r in rs)
        names = sorted({c for r in rs for c in r["calls"]})
        row["calls"] = {c: dict(us_per_call=statistics.median(r["calls"][c][0] for r in rs if c in r["calls"]),
                                per_step=statistics.median(r["calls"].get(c, (0, 0))[1] for r in rs)) for c in names}
        rows.append(row)
    base = rows[1]["tokens_per_s"]
    for row in rows:
        row["ratio"] = row["tokens_per_s"] / base
    spec = f", ids divisible by {a.spec_every} speculative ({a.draft_len} drafts)" if a.spec_every else ""
    print_table(f"prefix cache: {a.requests} requests, system prompt {a.system_len} + {a.prompt_len[0]}-"
                f"{a.prompt_len[1]} own tokens, {a.max_new[0]}-{a.max_new[1]} new; {a.num_pages} pages of "
                f"{a.page_size}, max batch {a.max_batch}{spec}, {a.backend}, Llama {a.layers}x{a.hidden}, {a.threads} "
                f"thread; median of {a.repeats} runs, p20/p80 of the wall time",
                ["config", "wall s", "p20 / p80", "tok/s", "prompt computed", "revived", "hits", "evicted",
                 "preempt", "steps", "tpool us/step", "forward ms/step", "ratio"],
                [[r["config"], f"{r['wall_s']:.2f}", f"{r['wall_p20_s']:.2f} / {r['wall_p80_s']:.2f}",
                  f"{r['tokens_per_s']:.0f}", r["prompt_computed"], r["revived"], r["cache_hits"], r["evicted"],
                  r["preemptions"], r["steps"], f"{r['tpool_us_per_step']:.0f}", f"{r['forward_ms_per_step']:.2f}",
                  f"{r['ratio']:.2f}x"] for r in rows],
                note="ratio: tok/s over the no-prefix-cache run's (above 1: the cache is faster). prompt computed: "
                     "prompt tokens the forward computed (again after a preemption); revived: prompt tokens taken "
                     "from CACHED pages instead. tpool us/step: the engine's scheduler and table calls; the tokens "
                     "of every run are checked equal, and Engine.check() passes after each.")
    if a.calls:
        print_table("tpool calls in the loop (Engine.stats.calls): medians over the runs; a call's µs include "
                    "the table and pool calls it makes",
                    ["config", "call", "calls/step", "us/call", "us/step"],
                    [[r["config"], c, f"{v['per_step']:.2f}", f"{v['us_per_call']:.1f}",
                      f"{v['per_step'] * v['us_per_call']:.1f}"]
                     for r in rows for c, v in sorted(r["calls"].items(), key=lambda kv: -kv[1]["per_step"] *
                                                      kv[1]["us_per_call"])],
                    note="Each call is timed where the loop makes it, after the model's forward pass has cooled "
                         "the caches (what a serving loop pays), not in a loop of its own.")
    write_json(a.json, "bench_prefix", rows)
    return rows


if __name__ == "__main__":
    main()
