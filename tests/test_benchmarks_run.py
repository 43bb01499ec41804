"""The benchmark scripts run and print their tables (tiny sizes; timings are not checked)."""

import argparse
import errno
import importlib.util
import json
import os
import re
import subprocess
import sys
import types

import pytest
import torch

from bench_scripts import BENCH, TINY, FakeClock, load

SCRIPTS = ["bench_pool", "bench_page_table", "bench_evict", "bench_scheduler", "cold_breakdown", "bench_startup",
           "bench_revive", "bench_prefix", "bench_lru", "bench_reconcile", "bench_logits"]


@pytest.mark.parametrize("name, header", [
    ("bench_pool", "alloc + free of N pages"), ("bench_page_table", "decode step"), ("bench_evict", "evict k"),
    ("bench_revive", "revive k cached pages"), ("bench_lru", "LRU churn, every page cached"),
])
def test_benchmark_prints_its_table_and_progress(name, header, tmp_path, capsys):
    out = tmp_path / f"{name}.json"
    load(name).main(TINY[name] + ["--json", str(out)])
    captured = capsys.readouterr()
    assert header in captured.out and "median" in captured.out and "p20" in captured.out
    assert captured.err.count("\n") >= 2 and " s] " in captured.err  # a progress line per configuration
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["median_us"] > 0 for r in rows)


def test_logits_benchmark_keeps_the_rows_asked_and_says_which_path_ran(tmp_path, capsys):
    """bench_logits.py: per model, the logits of 32 tokens against 8 kept rows (the lanes' last tokens, then
    padding), the LM head's path (``nokeep``: its forward does not name logits_to_keep, so indexed), the
    kept rows those of the full logits, and a step that allocates the full logits at least."""
    pytest.importorskip("transformers")
    out = tmp_path / "logits.json"
    load("bench_logits").main(TINY["bench_logits"] + ["--json", str(out)])
    rows = {r["model"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"llama", "qwen2", "gpt-neox", "gemma2", "mistral", "nokeep"}
    assert {m for m, r in rows.items() if not r["takes_logits_to_keep"]} == {"nokeep"}
    assert all(r["full_logits_bytes"] == 32 * 64 * 4 and r["kept_logits_bytes"] == 8 * 64 * 4
               and r["max_abs_diff"] < 1e-5 and r["full_peak_bytes"] >= r["full_logits_bytes"] for r in rows.values())
    printed = capsys.readouterr().out
    assert "| nokeep | indexed |" in printed and "| llama | taken |" in printed and "p20 / p80" in printed


def test_logits_benchmark_times_the_two_ways_in_turns(monkeypatch):
    """bench_logits.py timed every sample of the full step, then every sample of the kept one, so a busy
    stretch of a shared machine fell on one way alone (a run gave the nokeep model, the same work both ways,
    0.73x); the two now take turns call by call, as the other scripts' rows do."""
    module = load("bench_logits")
    clock = FakeClock(module, monkeypatch)
    full, kept = module.timed_ms([lambda: clock.spend(10_000, "full"), lambda: clock.spend(4_000, "kept")], 3)
    assert clock.log == ["full", "kept"] * 3
    assert full == pytest.approx((10.0, 10.0, 10.0)) and kept == pytest.approx((4.0, 4.0, 4.0))


def test_lru_benchmark_counts_what_the_cleaner_did(tmp_path, capsys):
    """bench_lru.py on 512 pages, 36 pushes a step for 120 steps: the queue comes to span more than twice the
    pool, so the cleaner runs in some steps and ends at least one pass, and both are counted; the queue never
    spans 3 pools (the script also checks the pool's invariants)."""
    out = tmp_path / "lru.json"
    load("bench_lru").main(TINY["bench_lru"] + ["--json", str(out)])
    rows = {r["impl"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"host-ordereddict", "tpool-numba"} and rows["host-ordereddict"]["passes"] == 0
    mine = rows["tpool-numba"]
    assert mine["steps"] == 120 and 1 <= mine["passes"] < mine["cleaned_steps"] < 120
    assert 2 < mine["max_span"] <= 3
    assert "cleaned" in capsys.readouterr().out


def test_lru_benchmark_takes_turns_in_blocks(monkeypatch, capsys):
    """bench_lru.py ran every step of the OrderedDict and then every step of tpool, so a busy stretch of the
    shared machine fell on one of them alone; the two now take turns in blocks of BLOCK steps (the last block
    shorter), and tpool's steps run to their end (the pool's checks)."""
    module = load("bench_lru")
    log = []

    def host_steps(P, args, touched):
        for _ in touched:
            log.append("host")
            yield 1.0

    def tpool_steps(P, args, device, backend, touched, seen):
        seen.update(cleaned=0, passes=0, span=0)
        for _ in touched:
            log.append("tpool")
            yield 2.0
        log.append("tpool checked")
    monkeypatch.setattr(module, "host_steps", host_steps)
    monkeypatch.setattr(module, "tpool_steps", tpool_steps)
    n = module.BLOCK + 5
    module.main(["--pool-sizes", "512", "--steps", str(n), "--touch", "4", "--k", "2"])
    assert "0.50x" in capsys.readouterr().out
    block, rest = module.BLOCK, 5
    assert log == ["host"] * block + ["tpool"] * block + ["host"] * rest + ["tpool"] * rest + ["tpool checked"]


def test_prefix_benchmark_serves_with_and_without_the_cache(tmp_path, capsys):
    """bench_prefix.py: a table row with the prefix cache and one without, the same tokens out of both (the
    script checks them and Engine.check() after every run), the cache reviving the system prompt's pages
    (and only in its row), a progress line as the model is built, then one per run (an untimed pair, then 2
    repeats of each)."""
    pytest.importorskip("transformers")
    out = tmp_path / "prefix.json"
    load("bench_prefix").main(TINY["bench_prefix"] + ["--json", str(out)])
    captured = capsys.readouterr()
    assert "prefix cache: 10 requests, system prompt 8" in captured.out and "median of 2 runs" in captured.out
    assert "p20 / p80" in captured.out and "revived" in captured.out
    assert captured.err.count(" s] ") == 7 and "no prefix cache, run 2/2" in captured.err
    assert 0 <= captured.err.find("building a random Llama") < captured.err.find("warm-up")  # (silent ~10 s before)
    with_cache, without = json.loads(out.read_text())["rows"]
    assert (with_cache["prefix_cache"], without["prefix_cache"]) == (True, False)
    assert with_cache["cache_hits"] > 0 and with_cache["revived"] >= 8 * with_cache["cache_hits"]
    assert without["cache_hits"] == without["revived"] == without["evicted"] == 0
    assert with_cache["tokens_out"] == without["tokens_out"] > 0
    assert with_cache["prompt_computed"] < without["prompt_computed"]
    assert without["ratio"] == 1.0 and with_cache["ratio"] > 0 and all(w > 0 for w in with_cache["walls_s"])


def test_prefix_benchmark_lists_the_loops_tpool_calls(tmp_path, capsys):
    """``--calls``: one row per tpool call of the loop and configuration (Engine.stats.calls), the mixed
    step once per step, the prefix cache's calls only in its configuration."""
    pytest.importorskip("transformers")
    out = tmp_path / "prefix.json"
    load("bench_prefix").main(TINY["bench_prefix"] + ["--calls", "--json", str(out)])
    captured = capsys.readouterr()
    assert "tpool calls in the loop" in captured.out and "us/call" in captured.out
    with_cache, without = json.loads(out.read_text())["rows"]
    for row in (with_cache, without):
        assert row["calls"]["HostMirror.step"]["per_step"] == 1.0 and row["calls"]["step_metadata"]["per_step"] == 1.0
        assert all(c["us_per_call"] > 0 for c in row["calls"].values())
    assert "PrefixCache.insert" in with_cache["calls"]
    assert not any(c.startswith("PrefixCache") for c in without["calls"])


@pytest.mark.parametrize("extra", [[], ["--cold", "--cold-samples", "2"]])
def test_every_page_table_row_starts_from_the_same_workload(extra, monkeypatch, capsys):
    """Rows of one batch size share a table, and a decode step lengthens every request: each row
    must leave the table as it found it, or later rows time a grown workload (longer requests,
    refused lanes) against a baseline that was not grown."""
    import tpool
    module = load("bench_page_table")
    starts, alive, make = {}, [], module.make_reset

    def recording(fn, owner):  # called as each row starts: the table as that row finds it
        if isinstance(owner, tpool.PageTable):
            # Keyed by id, so every table is kept alive: a freed table's id can be reused by the next
            # batch size's table, which would mix two workloads under one key.
            alive.append(owner)
            starts.setdefault(id(owner), []).append((owner.seq_lens.tolist(), owner.block_table.tolist()))
        return make(fn, owner)

    monkeypatch.setattr(module, "make_reset", recording)
    module.main(TINY["bench_page_table"] + extra)
    capsys.readouterr()
    assert max(len(s) for s in starts.values()) >= 5  # the numba rows share one table per batch size
    for s in starts.values():
        assert all(x == s[0] for x in s)


LIST_VALUES = {"backends": ["numba", "reference"], "rows": ["tpool-numba step", "tpool-numba extend"]}


@pytest.mark.parametrize("name", sorted(set(SCRIPTS) - {"bench_startup", "bench_prefix"})
                         + ["ab_compare", "gpu_step_phases", "bench_e2e"])
def test_a_list_option_keeps_each_value_once(name):
    """Every option that takes a list (sizes, pool sizes, batches, k, backends, scenarios, rows) keeps a value
    given twice once, in the order given: bench_pool.py --sizes 1 1 ran its rows twice and the second run's
    baselines set the first rows' ratios (vllm-queue 0.22x against itself)."""
    parser = load(name).parser()
    lists = [a for a in parser._actions if a.nargs == "+"]
    assert lists
    for action in lists:
        default = action.default if isinstance(action.default, list) and len(action.default) > 1 else None
        values = [str(v) for v in (action.choices or LIST_VALUES.get(action.dest) or default or [4, 64])][:2]
        option = action.option_strings[:1] or ["--"]                  # (ab_compare's rows: positional)
        lead = ["tpool-numba step"] if name == "ab_compare" and action.dest != "rows" else []
        got = getattr(parser.parse_args(lead + option + values + values), action.dest)
        assert [str(v) for v in got] == values, (action.dest, got)


@pytest.mark.parametrize("name", SCRIPTS + ["ab_compare", "gpu_step_phases", "bench_e2e"])
def test_help_explains_every_option_and_its_default(name, monkeypatch):
    module = load(name)
    parser = module.parser()
    formatter = module.HelpFormatter(prog=name)
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help text"
        d = action.default  # by identity: a default of 0 (== False) must be shown too
        if not (d is None or d is False or d == "" or d is argparse.SUPPRESS):
            assert "(default" in formatter._get_help_string(action), action.option_strings
    for width in (60, 70, 80, 100, 120):  # an option a help text names never starts a wrapped line (reads as one)
        monkeypatch.setenv("COLUMNS", str(width))
        starts = [line for line in parser.format_help().splitlines() if line.startswith("   ")
                  and line.lstrip().startswith("--")]
        assert not starts, (width, starts)
    if name == "ab_compare":  # no table of its own: no --json
        return
    r = subprocess.run([sys.executable, os.path.join(BENCH, f"{name}.py"), "--help"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "--json" in r.stdout and "stderr" in r.stdout, r.stderr


_NO_TRANSFORMERS = """
import runpy, sys
class NoTransformers:  # as if it were not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "transformers":
            raise ModuleNotFoundError("No module named 'transformers'", name=name)
sys.meta_path.insert(0, NoTransformers())
sys.argv = [sys.argv[1], "--help"]
sys.path.insert(0, sys.argv[0].rsplit("/", 1)[0])
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("name", SCRIPTS + ["gpu_step_phases", "bench_e2e"])
def test_help_works_without_transformers(name):
    """--help (and a usage error) needs no model library: bench_logits imported tpool.serving.hf, hence
    transformers, at its top, so its --help failed with ModuleNotFoundError where transformers is not installed."""
    r = subprocess.run([sys.executable, "-c", _NO_TRANSFORMERS, os.path.join(BENCH, f"{name}.py")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "usage:" in r.stdout, r.stderr[-2000:]


_TRANSFORMERS_MISSING = """
import runpy, sys
sys.modules["transformers"] = None  # as where it is not installed: find_spec answers None, an import fails
sys.argv = sys.argv[1:]
sys.path.insert(0, sys.argv[0].rsplit("/", 1)[0])
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("name", ["bench_e2e", "bench_logits", "bench_prefix", "bench_reconcile"])
def test_a_run_without_transformers_is_a_usage_error(name):
    """The scripts that serve a model say what to install (need_transformers: a usage error, exit 2) where
    transformers is not installed, not a ModuleNotFoundError; bench_logits and bench_reconcile imported
    tpool.serving at their top, before it. (The --help test above makes find_spec itself raise, so it
    never reaches need_transformers.)"""
    r = subprocess.run([sys.executable, "-c", _TRANSFORMERS_MISSING, os.path.join(BENCH, f"{name}.py")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "error: needs transformers, which is not installed" in r.stderr, r.stderr[-2000:]


def test_page_table_cold_mode_reports_warm_and_cold(tmp_path, capsys):
    out = tmp_path / "pt.json"
    load("bench_page_table").main(TINY["bench_page_table"][:2] + [
        "--samples", "3", "--inner", "2", "--backends", "numba", "--cold", "--cold-samples", "3",
        "--cold-bytes", str(1 << 20), "--json", str(out)])
    text = capsys.readouterr().out
    assert "cold median" in text and "cold vs numpy-blocks" in text and "1 MiB written" in text
    rows = {(r["batch"], r["impl"]): r for r in json.loads(out.read_text())["rows"]}
    for impl in ("numpy-blocks", "numpy-blocks turnover", "vllm-blocks", "vllm-blocks turnover", "tpool-numba step",
                 "tpool-numba turnover"):
        assert rows[(1, impl)]["cold_median_us"] > 0
    assert "cold_median_us" not in rows[(1, "tpool-numba extend only")]
    assert rows[(1, "tpool-numba turnover")]["kind"] == "turnover" and "cold_vs_numpy_blocks" in rows[
        (1, "tpool-numba turnover")]
    assert rows[(1, "vllm-blocks")]["vs_numpy_blocks"] > 0  # every baseline row is against numpy-blocks too


def test_pool_size_sweeps_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    pool_png, step_png, evict_png = (tmp_path / f"{n}.png" for n in ("pool", "step", "evict"))
    load("bench_pool").main(["--sizes", "1", "--pool-sizes", "64", "256", "--samples", "3", "--inner", "2",
                             "--backends", "numba", "--plot", str(pool_png)])
    load("bench_page_table").main(["--batch", "1", "--pool-sizes", "512", "1024", "2048", "--samples", "3",
                                   "--inner", "2", "--backends", "numba", "--plot", str(step_png)])
    load("bench_evict").main(["--pool-sizes", "1024", "2048", "--k", "1", "--samples", "3", "--backends", "numba",
                              "--plot", str(evict_png)])
    text = capsys.readouterr().out
    assert "pool pages" in text and "1,024" in text
    for png in (pool_png, step_png, evict_png):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_a_sweep_past_the_vllm_models_size_keeps_its_ratios_for_the_smaller_pools(tmp_path, capsys):
    """vllm-queue is a Python object per page: left out of pools past VLLM_MAX_PAGES only (here 600), so the
    smaller pools of a sweep keep their ratio against it and the larger ones show none, not a wrong one."""
    for name, argv in (("bench_pool", ["--sizes", "1", "--pool-sizes", "512", "1024", "--inner", "2"]),
                       ("bench_evict", ["--pool-sizes", "512", "1024", "--k", "1"])):
        module, out = load(name), tmp_path / f"{name}.json"
        module.VLLM_MAX_PAGES = 600  # (the module's own name for it: a fresh copy of the module)
        module.main(argv + ["--samples", "3", "--backends", "numba", "--json", str(out)])
        rows = json.loads(out.read_text())["rows"]
        size = "num_pages" if name == "bench_pool" else "pages"
        assert {r[size] for r in rows if r["impl"] == "vllm-queue"} == {512}, name
        for r in rows:
            assert ("vs_vllm_queue" in r) == (r[size] == 512), (name, r)
    captured = capsys.readouterr()
    err = captured.err
    assert "left out of pools past 600 pages" in err
    assert "vllm-queue is left out of pools past 600 pages" in " ".join(captured.out.split())  # (bench_pool's note)
    # bench_pool says it builds the pools (~10 s silent at 16M pages) before its first row's line
    assert 0 <= err.find("N=1: building every row's pool (512, 1,024 pages)") < err.find("N=1: vllm-queue")


def test_churn_cold_mode_reports_warm_and_cold_and_plots_every_step(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "churn.json", tmp_path / "churn.png"
    load("bench_scheduler").main(["--requests", "8", "--steps", "40", "--warmup", "8", "--num-pages", "4096",
                                  "--scenarios", "plain", "--cold", "--cold-steps", "16", "--cold-bytes",
                                  str(1 << 20), "--json", str(out), "--plot", str(png)])
    captured = capsys.readouterr()
    assert "churn: 8 running" in captured.out and "1 MiB written" in captured.out
    assert " s] " in captured.err  # progress
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"read-ok", "mirror-plain", "read-ok, cold", "mirror-plain, cold"}
    assert len(rows["mirror-plain"]["step_us"]) == 40 and len(rows["mirror-plain, cold"]["step_us"]) == 16
    assert all(r["failed_extends"] == 0 and r["step_us_median"] > 0 for r in rows.values())
    assert rows["read-ok, cold"]["vs_read_ok"] == 1.0 and rows["mirror-plain"]["cold"] is False
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_cold_breakdown_prints_every_row(tmp_path, capsys):
    out = tmp_path / "cold.json"
    load("cold_breakdown").main(["--batch", "8", "--samples", "3", "--cold-bytes", str(1 << 20), "--json", str(out)])
    text = capsys.readouterr().out
    assert "cold decode step" in text
    rows = json.loads(out.read_text())["rows"]
    names = [r["row"] for r in rows]
    assert {"python call", "numba no-op", "touch: + lengths, outputs, memo", "touch: + CSR shift",
            "touch: + CSR shift + block-table rows", "kernel alone", "kernel alone, code warm", "façade only",
            "bound step", "step"} <= set(names)
    assert all(r["cold_median_us"] > 0 for r in rows)
    bound = next(r for r in rows if r["row"] == "bound step")  # the table's "x bound step" column, in the JSON too
    assert bound["x_bound_step"] == 1.0
    assert all(r["x_bound_step"] == pytest.approx(r["cold_median_us"] / bound["cold_median_us"]) for r in rows)


def test_ab_compare_runs_a_revision_beside_the_working_tree(tmp_path):
    """``ab_compare.py``: HEAD extracted as ``tpool_base`` and the working tree, one process, a table row
    per workload with both versions and the paired count (in a subprocess: it adds a package). The
    extracted revision is kept per commit, so a second run compiles nothing."""
    if subprocess.run(["git", "-C", BENCH, "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    cmd = [sys.executable, os.path.join(BENCH, "ab_compare.py"), "tpool-numba step", "tpool-numba turnover, bound",
           "--batch", "3", "--samples", "2", "--inner", "2"]
    cache = tmp_path / "cache"  # where it keeps the extracted revision
    env = dict(os.environ, TPOOL_AB_CACHE=str(cache))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "working tree against HEAD" in done.stdout and "new faster (paired)" in done.stdout
    assert done.stdout.count("/2") == 2 and "tpool-numba turnover, bound" in done.stdout
    assert "extracting HEAD (" in done.stderr and f"into {cache}" in done.stderr
    (kept,) = cache.iterdir()  # one folder for the commit, nothing half-extracted beside it
    assert (kept / "tpool_base" / "kernels").is_dir() and not list(kept.glob("*.tar"))
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert again.returncode == 0 and "already extracted" in again.stderr, again.stderr[-2000:]
    assert "compiling numba kernels" not in again.stderr  # both versions' kernels were cached by the first run
    # a misspelt row is refused before anything is extracted or compiled, with the list of rows
    cmd[2] = "tpool-numba turnover bound"
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert bad.returncode == 1 and "unknown row(s) 'tpool-numba turnover bound'" in bad.stderr
    assert "  tpool-numba turnover, bound\n" in bad.stderr and " s] " not in bad.stderr
    # so is a base revision git does not know, without a traceback
    bad = subprocess.run(cmd[:2] + ["tpool-numba step", "--base", "no-such-revision"], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path, env=env)
    assert bad.returncode == 1 and "--base: 'no-such-revision' is not a commit" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr and " s] " not in bad.stderr


@pytest.mark.parametrize("name", ["bench_pool", "bench_page_table", "bench_evict", "bench_scheduler"])
def test_plot_without_matplotlib_is_refused_before_the_run(name, monkeypatch, capsys):
    """``--plot`` without the bench extra: an argparse error at once, not a crash after the whole run."""
    module = load(name)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "matplotlib" else find_spec(n, *a))
    with pytest.raises(SystemExit) as e:
        module.main(["--plot", "out.png"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "needs matplotlib" in err and " s] " not in err  # no progress line: nothing ran


BAD_OPTIONS = [  # (script, argv, the option its error names): argparse refuses them before any work
    ("bench_pool", ["--sizes", "0"], "--sizes"),
    ("bench_pool", ["--num-pages", "0"], "--num-pages"),
    ("bench_pool", ["--pool-sizes", "-1"], "--pool-sizes"),
    ("bench_page_table", ["--batch", "0"], "--batch"),
    ("bench_page_table", ["--inner", "5000"], "--inner"),
    ("bench_page_table", ["--cold-samples", "1000"], "--cold-samples"),
    ("bench_page_table", ["--pool-sizes", "0"], "--pool-sizes"),
    ("bench_page_table", ["--batch", "1", "--pool-sizes", "100"], "--pool-sizes"),  # too small for any B: no row
    ("bench_evict", ["--pool-sizes", "100000"], "--pool-sizes"),
    ("bench_evict", ["--pool-sizes", "65536", "--k", "40000"], "--k"),
    ("bench_evict", ["--k", "0"], "--k"),
    ("bench_scheduler", ["--every", "0"], "--every"),
    ("bench_scheduler", ["--steps", "0"], "--steps"),
    ("bench_scheduler", ["--requests", "0"], "--requests"),
    ("bench_scheduler", ["--turnover", "300"], "--turnover"),
    ("bench_scheduler", ["--reconcile-every", "20"], "--reconcile-every"),
    ("bench_scheduler", ["--snapshot-every", "0"], "--snapshot-every"),
    ("bench_startup", ["--runs", "0"], "--runs"),
    ("bench_startup", ["--cold", "-1"], "--cold"),
    ("bench_startup", ["--num-pages", "15", "--batch", "8"], "--num-pages"),  # its first alloc and step: 16 pages
    ("cold_breakdown", ["--batch", "0"], "--batch"),
    ("bench_e2e", ["--layers", "0"], "--layers"),
    ("bench_prefix", ["--requests", "0"], "--requests"),
    ("bench_prefix", ["--num-pages", "2"], "--num-pages"),
    ("bench_reconcile", ["--num-pages", "2"], "--num-pages"),  # fewer than its longest request's pages
    ("bench_reconcile", ["--reconcile-every", "0"], "--reconcile-every"),
    ("bench_prefix", ["--prompt-len", "9", "3"], "--prompt-len"),
    ("ab_compare", ["tpool-numba step", "--batch", "0"], "--batch"),
    ("ab_compare", ["tpool-numba step", "--inner", "5000"], "--inner"),  # past the table's room: a TableOverflow
    # a pool too small for what the run asks of it: refused, not a hang, a crash or a row left out
    ("bench_scheduler", ["--num-pages", "16384", "--steps", "10", "--warmup", "0"], "--num-pages"),
    ("bench_scheduler", ["--num-pages", "10"], "--num-pages"),
    ("bench_pool", ["--sizes", "100000"], "--sizes"),
    ("bench_pool", ["--num-pages", "10", "--sizes", "16"], "--sizes"),
    ("bench_pool", ["--sizes", "16", "100000"], "--sizes"),
    ("bench_pool", ["--pool-sizes", "64", "256", "--sizes", "1", "100"], "--sizes"),
    ("bench_lru", ["--k", "100000"], "--k"),
    ("bench_revive", ["--k", "1048577"], "--k"),  # pools of 4 k pages: it hung building a vLLM model of 4M blocks
    # a seed numpy or torch.manual_seed refuses: a traceback after the run started (a model built), not a usage error
    ("bench_lru", ["--seed", "-1"], "--seed"),
    ("bench_reconcile", ["--seed", str(2**64)], "--seed"), ("bench_prefix", ["--seed", str(2**64)], "--seed"),
    ("bench_lru", ["--pool-sizes", "512", "1024", "--touch", "513"], "--touch"),
    # a backend tpool does not know (one among good ones too), a model shape the model refuses
    ("bench_page_table", ["--backends", "numba", "foo"], "--backends"),
    ("ab_compare", ["tpool-numba step", "--backend", "foo"], "--backend"),
    ("bench_e2e", ["--kv-heads", "3"], "--kv-heads"),
    ("bench_e2e", ["--heads", "3", "--kv-heads", "2"], "--heads"),
    ("bench_e2e", ["--hidden", "24"], "--heads"),  # a head size of 3: rotary embeddings need an even one
    ("bench_e2e", ["--vocab", "1"], "--vocab"),
    ("bench_e2e", ["--prompt", "4090", "--inner", "8"], "--prompt"),  # 4,098 tokens: past the 4,096 positions
    ("bench_prefix", ["--kv-heads", "3"], "--kv-heads"),
    ("bench_logits", ["--kv-heads", "3"], "--kv-heads"), ("bench_logits", ["--keep", "2"], "--keep"),
    ("bench_logits", ["--samples", "1"], "--samples"), ("bench_logits", ["--tokens", "0"], "--tokens"),
    # an output the run could not write at its end, or a cache directory numba could not write
    ("bench_startup", ["--cache-dir", os.path.join(__file__, "sub")], "--cache-dir"),  # under a file
    ("bench_pool", ["--json", BENCH], "--json"),  # a directory
] + [(name, [option, "foo"], option) for option, names in (
    ("--backends", ("bench_pool", "bench_evict", "bench_revive")),
    ("--backend", ("bench_lru", "bench_scheduler", "bench_e2e", "bench_prefix", "bench_reconcile")))
    for name in names
] + [(name, ["--device", device], "--device")  # a device tpool refuses (no CUDA here, no 100th GPU anywhere)
     for name in ("bench_pool", "bench_page_table", "bench_evict", "bench_lru", "bench_revive", "bench_scheduler")
     for device in ("cuda:99", "meta")
] + [(name, ["--json", "/nonexistent/x.json"], "--json") for name in SCRIPTS + ["bench_e2e", "gpu_step_phases"]
] + [(name, ["--plot", "/nonexistent/x.png"], "--plot")
     for name in ("bench_pool", "bench_page_table", "bench_evict", "bench_scheduler")]


@pytest.mark.parametrize("name, argv, option", BAD_OPTIONS, ids=[f"{n} {' '.join(a)}" for n, a, _ in BAD_OPTIONS])
def test_a_bad_count_is_an_argparse_error_naming_the_option(name, argv, option, capsys, monkeypatch, tmp_path):
    """Every count takes a positive int (and its limit, where it has one): a clean usage error (exit code 2)
    naming the option, not a traceback after minutes of work."""
    monkeypatch.setenv("TPOOL_AB_CACHE", str(tmp_path))  # (ab_compare: an option not refused extracts nowhere else)
    with pytest.raises(SystemExit) as e:
        load(name).main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {option}" in err and " s] " not in err, err


ON_THE_COMMAND_LINE = [case for case in BAD_OPTIONS if case[:2] in (  # one of each kind
    ("bench_pool", ["--sizes", "0"]), ("bench_evict", ["--pool-sizes", "65536", "--k", "40000"]),
    ("bench_scheduler", ["--every", "0"]),
    ("bench_scheduler", ["--num-pages", "16384", "--steps", "10", "--warmup", "0"]),  # it hung, printing nothing
    ("bench_pool", ["--sizes", "16", "100000"]), ("bench_lru", ["--k", "100000"]),
    ("bench_scheduler", ["--backend", "foo"]), ("bench_e2e", ["--kv-heads", "3"]),
    ("bench_startup", ["--json", "/nonexistent/x.json"]))]


@pytest.mark.parametrize("name, argv, option", ON_THE_COMMAND_LINE,
                         ids=[f"{n} {' '.join(a)}" for n, a, _ in ON_THE_COMMAND_LINE])
def test_a_bad_count_on_the_command_line_exits_2(name, argv, option):
    r = subprocess.run([sys.executable, os.path.join(BENCH, f"{name}.py"), *argv], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and f"argument {option}" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("name, argv, says", [
    ("bench_pool", ["--sizes", "16", "100000"], "at most the smallest pool's 65536 pages (--num-pages 65536), "
                                                "got 100000"),
    ("bench_pool", ["--pool-sizes", "64", "256", "--sizes", "1", "100"], "64 pages (--pool-sizes 64 256), got 100"),
    ("bench_lru", ["--k", "100000"], "at most the smallest pool's 65536 pages (--pool-sizes 65536), got 100000"),
    ("bench_revive", ["--k", "8", "1048577"], "expected at most 1,048,576 pages per hit (pools of 4 k pages; the "
                                             "vLLM model holds a Python object per page), got 1048577"),
    ("bench_scheduler", ["--backend", "foo"], "expected 'auto' or one of ('reference', 'numba', 'triton'), "
                                              "got 'foo'"),
    ("bench_e2e", ["--kv-heads", "3"], "expected a divisor of --heads (8), got 3"),
    ("bench_e2e", ["--json", "/nonexistent/x.json"], "cannot write /nonexistent/x.json: directory /nonexistent "
                                                     "does not exist"),
])
def test_a_refused_option_says_what_it_expected_and_got(name, argv, says, capsys):
    """The usage error says what the option takes and what it was given (and where a limit comes from)."""
    with pytest.raises(SystemExit) as e:
        load(name).main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err, err


def test_the_scheduler_refuses_a_pool_its_startup_admissions_do_not_fit(capsys):
    """bench_scheduler.py admits --requests prompts before the first step: a pool one page short of what they
    take (their pages and the mirror's reservations, as computed before the run) is refused, naming that
    count; at that count both schedulers start (the mirror with nothing left over)."""
    import torch
    bs = load("bench_scheduler")
    small = ["--requests", "20", "--num-pages", "100000"]
    need = bs.startup_pages(bs.parser().parse_args(small))
    small[-1] = str(need - 1)
    with pytest.raises(SystemExit) as e:
        bs.main(small)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument --num-pages: expected at least {need} pages" in err, err
    assert f"got {need - 1}" in err and " s] " not in err
    args = bs.parser().parse_args(small[:-1] + [str(need)])
    mirror = bs.MirrorChurn(args, "plain", torch.device("cpu"), bs.random.Random(args.seed))
    assert len(mirror.rows) == 20 and mirror.m.unreserved == 0
    assert len(bs.ReadOkChurn(args, torch.device("cpu"), bs.random.Random(args.seed)).rows) == 20


@pytest.mark.parametrize("scheduler", ["MirrorChurn", "ReadOkChurn"])
def test_a_scheduler_whose_startup_admits_nothing_stops(scheduler):
    """Past main's check (a caller building a scheduler itself): an admission at start-up that admits
    nothing ends the start-up with the reason, never loops on (an alarm fails the test if it hangs)."""
    import signal

    import torch
    bs = load("bench_scheduler")
    args = bs.parser().parse_args(["--num-pages", "10"])
    extra = ("plain",) if scheduler == "MirrorChurn" else ()

    def hung(*_):
        raise TimeoutError("the start-up admissions spin without progress")
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        with pytest.raises(SystemExit, match="too small for the admissions at the start"):
            getattr(bs, scheduler)(args, *extra, torch.device("cpu"), bs.random.Random(0))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_pool_rows_never_time_failing_allocs():
    """Allocs of more than 4096 pages (the default max_alloc_pages) succeed in every row, "no out=" too;
    and a row whose allocs fail is caught by its verify()."""
    import torch
    bp = load("bench_pool")
    for name, fn in bp.pair_fns(5000, 8192, torch.device("cpu"), ["numba"]).items():
        fn()
        fn()
        fn.verify()
    import tpool
    pool = tpool.PagePool(8192, device="cpu", backend="numba")  # max_alloc_pages 4096
    failing = bp._verified(lambda: pool.alloc(torch.tensor([5000], dtype=torch.int32)), pool)
    failing()
    with pytest.raises(Exception):
        failing.verify()


def test_evict_samples_check_they_evicted_k_and_refilled():
    import torch
    be = load("bench_evict")
    pools = be.cached_pools(1024, ["numba", "reference"], torch.device("cpu"))  # built on numba, copied
    for pool in pools.values():
        assert pool.stats()["pages.cached.current"] == 512
    for pool in pools.values():
        sample = be.tpool_sampler(pool, 512, lambda: None)  # the whole cached half: still k each sample
        for _ in range(3):
            assert sample() > 0
        pool.check()
        assert pool.stats()["pages.cached.current"] == 512
    assert torch.equal(*(p.evict(8) for p in pools.values()))  # the same state on both: the same oldest pages
    pool = pools["numba"]
    pool.free(pool.alloc(torch.tensor([8], dtype=torch.int32)).pages, cache=True)  # 512 cached again
    with pytest.raises(AssertionError, match="evicted 512 pages"):
        be.tpool_sampler(pool, 600, lambda: None)  # more than is cached: refused, not timed


def test_page_table_reset_refuses_samples_whose_lanes_were_refused():
    """A table row's reset checks the samples before restoring: a lane refused (out of pages) raises."""
    import torch
    bpt = load("bench_page_table")
    impls = bpt.workloads(1, ["numba"], torch.device("cpu"), num_pages=200, extras=False)
    fn, table, _ = impls["tpool-numba step"]
    reset = bpt.make_reset(fn, table)
    fn()
    reset()  # fine: nothing refused
    for _ in range(3000):  # 200 pages: the request (787 tokens, then 3,787) runs out of them
        fn()
    with pytest.raises(AssertionError, match="refused"):
        reset()


def test_scheduler_steps_take_turns_and_include_the_mirror_bookkeeping(monkeypatch, capsys):
    """The schedulers take turns in blocks of TURN steps (block k of each before block k + 1 of any), and
    after() (snapshots, reconciliation) is called inside the timed region, right after step()."""
    bs = load("bench_scheduler")
    calls = []
    for cls in (bs.MirrorChurn, bs.ReadOkChurn):
        step, after = cls.step, cls.after
        monkeypatch.setattr(cls, "step", lambda self, i, _s=step: (calls.append(("step", type(self).__name__, i)),
                                                                  _s(self, i))[1])
        monkeypatch.setattr(cls, "after", lambda self, i, _a=after: (calls.append(("after", type(self).__name__, i)),
                                                                    _a(self, i))[1])
    monkeypatch.setattr(bs, "TURN", 4)  # (TURN_COLD: --cold only)
    bs.main(["--requests", "8", "--steps", "24", "--warmup", "2", "--num-pages", "4096", "--scenarios", "plain"])
    capsys.readouterr()
    steps = [(i, who) for kind, who, i in calls if kind == "step"]
    assert len(steps) == 2 * 26
    blocks = [steps[j:j + 4] for j in range(0, 48, 4)]  # 26 steps: 6 full blocks of 4 each, then 2 and 2
    for k, (a, b) in enumerate(zip(blocks[::2], blocks[1::2])):
        assert [i for i, _ in a] == [i for i, _ in b] == list(range(4 * k, 4 * k + 4))  # block k of both, in turn
        assert len({w for _, w in a}) == 1 and {w for _, w in a} != {w for _, w in b}
    for a, b in zip(calls[::2], calls[1::2]):  # every step is followed by its after(), same scheduler and step
        assert a[0] == "step" and b[0] == "after" and a[1:] == b[1:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_the_gpu_step_profile_refuses_to_run_without_cuda(capsys):
    """gpu_step_phases.py times Triton kernels on a GPU: without CUDA it says so and exits 2."""
    assert load("gpu_step_phases").main([]) == 2
    assert "needs CUDA" in capsys.readouterr().err


# --- Pinned by helper-151's mutation run over benchmarks/_common.py and _baselines.py (session 41) ---------
# No timing is asserted: the timing helpers run on a fake clock that each call of the timed function
# advances by a given amount, so what is checked is their arithmetic and the order of their calls.

def test_the_count_types_take_their_bounds_and_say_why(capsys):
    """non_negative_int takes 0; int_at_most takes its limit and refuses one past it, saying why; multiple_of
    takes any multiple and refuses others, saying why; a non-int is refused as "expected a positive int"."""
    common = load("_common")
    assert common.non_negative_int("0") == 0 and common.non_negative_int("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="at least 0, got -1"):
        common.non_negative_int("-1")
    with pytest.raises(argparse.ArgumentTypeError, match="expected an int of at least 0, got 'x'"):
        common.non_negative_int("x")
    at_most = common.int_at_most(8, "the pool's pages")
    assert at_most("1") == 1 and at_most("8") == 8
    with pytest.raises(argparse.ArgumentTypeError, match=r"^at most 8 \(the pool's pages\), got 9$"):
        at_most("9")
    with pytest.raises(argparse.ArgumentTypeError):
        at_most("0")
    mult = common.multiple_of(4, "four equal frees")
    assert mult("4") == 4 and mult("12") == 12
    with pytest.raises(argparse.ArgumentTypeError, match=r"^must be a multiple of 4 \(four equal frees\), got 6$"):
        mult("6")
    ap = argparse.ArgumentParser(prog="x")
    ap.add_argument("--k", type=at_most)
    ap.add_argument("--m", type=mult)
    for option in ("--k", "--m"):
        with pytest.raises(SystemExit):
            ap.parse_args([option, "two"])
        assert f"argument {option}: expected a positive int, got 'two'" in capsys.readouterr().err


def test_output_paths_are_checked_by_making_a_file(tmp_path, monkeypatch):
    """out_path and writable_dir: a path under a file, a directory where no file can be made (a read-only
    file system, where root's os.access still says yes) are refused saying why; writable_dir takes a
    directory several levels below the nearest one that exists (it is made later)."""
    common = load("_common")
    assert common.out_path(str(tmp_path / "x.json")) == str(tmp_path / "x.json") and common.out_path("") == ""
    deep = str(tmp_path / "a" / "b" / "c")
    assert common.writable_dir(deep) == deep and common.writable_dir("") == ""
    a_file = tmp_path / "f"
    a_file.write_text("")
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(f"{a_file} is not a directory")):
        common.out_path(str(a_file / "x.json"))

    def read_only(*_, **__):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    monkeypatch.setattr(common, "TemporaryFile", read_only)
    says = f"directory {tmp_path} is not writable (making a file in it: {os.strerror(errno.EROFS)})"
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(f"cannot write {tmp_path / 'x.json'}: {says}")):
        common.out_path(str(tmp_path / "x.json"))
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(f"cannot write into {deep}: {says}")):
        common.writable_dir(deep)


def test_backend_model_and_device_errors_read_cleanly(capsys):
    """check_backends and device_arg drop the inner message's own prefix (no "--backend: backend:"),
    check_model says the --hidden it needs a divisor of, and takes a vocabulary of 2 (tokens 0 and 1)."""
    common = load("_common")
    ap = argparse.ArgumentParser(prog="x")
    with pytest.raises(SystemExit):
        common.check_backends(ap, "--backend", ["numba", "foo"], "cpu")
    err = capsys.readouterr().err
    assert "argument --backend: expected 'auto' or one of" in err and "--backend: backend:" not in err, err
    common.check_model(ap, argparse.Namespace(hidden=64, heads=8, kv_heads=4, vocab=2))  # accepted: no exit
    with pytest.raises(SystemExit):
        common.check_model(ap, argparse.Namespace(hidden=64, heads=7, kv_heads=7, vocab=64))
    assert "argument --heads: expected a divisor of --hidden (64), got 7" in capsys.readouterr().err
    ap.add_argument("--device", type=common.device_arg)
    with pytest.raises(SystemExit):
        ap.parse_args(["--device", "meta"])
    err = capsys.readouterr().err
    assert "argument --device: expected a cpu or cuda device" in err and "--device: --device" not in err, err


def test_help_shows_a_default_once_and_no_false_flag_default():
    """HelpFormatter: a flag (default False) shows no default; a help text that says its default gets no
    second one; a default of 0 is shown."""
    common = load("_common")
    ap = argparse.ArgumentParser(prog="x", formatter_class=common.HelpFormatter)
    ap.add_argument("--cold", action="store_true", help="time cold calls too")
    ap.add_argument("--inner", type=int, default=7, help="calls per sample (default: calibrated)")
    ap.add_argument("--warmup", type=int, default=0, help="untimed steps first")
    text = " ".join(ap.format_help().split())
    assert "time cold calls too (default" not in text
    assert text.count("(default") == 2 and "(default: calibrated)" in text
    assert "untimed steps first (default: 0)" in text


def test_time_calls_us_and_sample_us_on_a_fake_clock(monkeypatch):
    """time_calls_us: n calls between two clock reads, sync before and after (a cold call too); sample_us:
    per-call microseconds per sample, a warm-up of inner // 4 calls, reset before each sample and at the
    end, settle's untimed call after each reset."""
    common = load("_common")
    c = FakeClock(common, monkeypatch, lambda i: 10.0)
    assert common.time_calls_us(c.fn, 1, c.sync) == 10.0 and c.log == ["sync", "fn", "sync"]
    c.log.clear()
    assert common.time_calls_us(c.fn, 7, c.sync) == 70.0 and c.log == ["sync"] + ["fn"] * 7 + ["sync"]
    c.log.clear()
    assert common.sample_us(c.fn, inner=8, samples=3, reset=c.reset) == [10.0] * 3
    assert c.log == ["fn"] * 2 + (["reset"] + ["fn"] * 8) * 3 + ["reset"]
    c.log.clear()
    assert common.sample_us(c.fn, inner=2, samples=2, reset=c.reset, settle=True) == [10.0] * 2
    assert c.log == ["fn"] + (["reset", "fn"] + ["fn"] * 2) * 2 + ["reset"]


def test_calibrate_on_a_fake_clock(monkeypatch):
    """calibrate: three warm-up calls, then n = 1, 10, 100, ... until a sample takes a tenth of the target;
    n scaled to the target, at most max_inner; the search runs twice and the larger answer wins."""
    common = load("_common")
    c = FakeClock(common, monkeypatch, lambda i: 10.0)  # 10 us a call: 100 calls take 1 ms >= 2 ms / 10
    assert common.calibrate(c.fn) == 200
    assert c.calls == 3 + 2 * (1 + 10 + 100)
    c = FakeClock(common, monkeypatch, lambda i: 0.001)  # 1 ns a call: stops at max_inner
    assert common.calibrate(c.fn, max_inner=100) == 100 and c.calls == 3 + 2 * (1 + 10 + 100)
    # 20 us a call in the first search (3 warm-up calls, then 1 and 10), 10 us after: 100 vs 200 calls
    c = FakeClock(common, monkeypatch, lambda i: 20.0 if i < 14 else 10.0)
    assert common.calibrate(c.fn, reset=c.reset) == 200
    assert c.log[:3] == ["fn"] * 3 and c.log[3] == "reset"
    # the reverse, 10 us a call in the first search and 20 us in the second (1 and 10 calls): the first's
    # 200 wins over the second's, the last, 100
    c = FakeClock(common, monkeypatch, lambda i: 10.0 if i < 114 else 20.0)
    assert common.calibrate(c.fn) == 200 and c.calls == 3 + (1 + 10 + 100) + (1 + 10)


def test_sample_cold_us_flushes_before_every_timed_call(monkeypatch):
    """sample_cold_us: one untimed call, reset once before the first sample and once at the end (not before
    each), a flush right before each timed call, settle's call before the flush; a sample is that one call."""
    common = load("_common")
    c = FakeClock(common, monkeypatch, lambda i: 10.0)
    assert common.sample_cold_us(c.fn, samples=3, flush=c.flush, reset=c.reset) == [10.0] * 3
    assert c.log == ["fn", "reset"] + ["flush", "fn"] * 3 + ["reset"]
    c.log.clear()
    assert common.sample_cold_us(c.fn, samples=2, flush=c.flush, sync=c.sync, settle=True) == [10.0] * 2
    assert c.log == ["fn"] + ["fn", "flush", "sync", "fn", "sync"] * 2


def test_size_text_never_rounds_a_count_down_to_0_mib():
    common = load("_common")
    assert common.size_text(64 << 20) == "64 MiB" and common.size_text(1 << 20) == "1 MiB"
    assert common.size_text(1_000_000) == "1,000,000 bytes" and common.size_text(3 << 19) == "1,572,864 bytes"


def test_the_pytest_benchmark_suites_read_their_clock_after_the_device_work(monkeypatch):
    """device_clock (the suites' benchmark fixture, device_timed_benchmark): on CUDA each read of
    pytest-benchmark's clock waits for the device first, so a round's calls are timed with the GPU work
    they launched; on a CPU the clock is left as it is. Checked through pytest-benchmark's own runner, which
    reads the fixture's ``_timer`` around the calls it times."""
    from pytest_benchmark.fixture import BenchmarkFixture
    common = load("_common")
    reads = iter([10.0, 12.5])

    def clock():
        log.append("clock")
        return next(reads)
    log, bench = [], types.SimpleNamespace(_timer=clock, _disable_gc=False)
    common.device_clock(bench, torch.device("cpu"))
    assert bench._timer is clock
    monkeypatch.setattr(common, "sync_of", lambda device: lambda: log.append(("sync", str(device))))
    common.device_clock(bench, torch.device("cuda", 1))
    runner = BenchmarkFixture._make_runner(bench, lambda: log.append("call"), (), {})
    assert runner(None) == (2.5, None)
    assert log == [("sync", "cuda:1"), "clock", "call", ("sync", "cuda:1"), "clock"]


def test_cache_flusher_writes_its_whole_buffer_anew():
    common = load("_common")
    flush = common.CacheFlusher(1 << 20)
    assert flush.buf.nbytes == 1 << 20 and common.CacheFlusher().buf.nbytes == common.COLD_BYTES
    flush()
    before = flush.buf.copy()
    flush()
    assert (flush.buf != before).all()


def test_quantiles_are_the_median_p20_and_p80():
    common = load("_common")
    assert common.quantiles(list(range(1, 12))) == (6, 3, 9)  # inclusive: the 20th and 80th of 1..11
    assert common.quantiles([1.0, 2.0, 3.0, 100.0])[0] == 2.5  # the median, not the mean
    assert common.quantiles([4.5]) == (4.5, 4.5, 4.5)


def test_print_table_and_write_json(tmp_path, capsys):
    """print_table: the title, then the header and rows right-aligned in columns as wide as their widest
    cell, then the note; write_json: the benchmark's name, the machine and the rows."""
    common = load("_common")
    common.print_table("T", ["impl", "median"], [["a-long-name", 1.5], ["b", 22]], note="what the rows are")
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["", "T", "       impl  median", "a-long-name     1.5", "          b      22", "what the rows are"]
    path = tmp_path / "x.json"
    common.write_json(str(path), "bench_x", [{"impl": "a", "median_us": 1.5}])
    assert capsys.readouterr().out == f"\nwrote {path}\n"
    got = json.loads(path.read_text())
    assert set(got) == {"benchmark", "machine", "rows"} and got["benchmark"] == "bench_x"
    assert got["rows"] == [{"impl": "a", "median_us": 1.5}]
    assert {"cpu", "cores", "caches", "gpu", "python", "torch", "numba", "triton", "time"} <= set(got["machine"])
    assert got["machine"]["cores"] == os.cpu_count()


def test_plot_draws_a_cold_series_dashed_in_its_warm_series_colour(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    common = load("_common")
    figs = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (figs.append(fig), close(fig)))
    png = tmp_path / "p.png"
    common.plot_lines(str(png), {"a, warm": [(4, 2, 1, 3), (1, 3, 2, 4)], "a, cold": [(1, 5, 4, 6), (4, 6, 5, 7)],
                                 "b": [(1, 1, 1, 1), (4, 2, 2, 2)]}, title="t", xlabel="x")
    lines = {line.get_label(): line for line in figs[0].axes[0].lines}
    assert lines["a, cold"].get_linestyle() == "--" and lines["a, warm"].get_linestyle() == "-"
    assert lines["a, cold"].get_color() == lines["a, warm"].get_color() != lines["b"].get_color()
    assert list(lines["a, warm"].get_xdata()) == [1, 4]  # points sorted by x
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- Found by helper-172's review of the scripts' odd options (session 46) ----------------------------------

def test_print_table_with_no_rows_prints_its_header(capsys):
    """A run whose every configuration was skipped has no rows: the title and header alone, not a TypeError
    (``max`` of one int) after the run."""
    load("_common").print_table("T", ["impl", "median"], [])
    assert capsys.readouterr().out.splitlines() == ["", "T", "impl  median"]


def test_shared_churn_admits_prefills_when_every_running_request_finished(tmp_path, capsys):
    """--turnover equal to --requests: a turnover finishes every running request, so the shared scenario has
    none to fork from and admits a prefill instead (before, ``rng.choice([])`` raised IndexError mid-run)."""
    out = tmp_path / "churn.json"
    load("bench_scheduler").main(["--requests", "2", "--turnover", "2", "--steps", "40", "--warmup", "0",
                                  "--num-pages", "4096", "--scenarios", "shared", "--json", str(out)])
    capsys.readouterr()
    shared = {r["name"]: r for r in json.loads(out.read_text())["rows"]}["mirror-shared"]
    assert shared["forked"] == 0 and shared["failed_extends"] == 0 and shared["admissions_per_s"] > 0


def test_churn_progress_says_how_many_steps_are_done(monkeypatch, capsys):
    """A progress line after the first block, after the last (the total) and after any block ending
    PROGRESS_S after the line before, each with the steps every scheduler has run. Before, a line named the
    first step of a block already run, once per 1,024 steps: a cold run (~10-30 ms a step, three schedulers)
    went ~30-90 s without a line and never showed its total."""
    bs = load("bench_scheduler")
    monkeypatch.setattr(bs, "TURN", 4)
    argv = ["--requests", "8", "--steps", "8", "--warmup", "2", "--num-pages", "4096", "--scenarios", "plain"]

    def done_counts():
        return [line.rsplit(": ", 1)[-1] for line in capsys.readouterr().err.splitlines() if "taking turns" in line]
    monkeypatch.setattr(bs, "PROGRESS_S", 1e9)
    bs.main(argv)
    assert done_counts() == ["4/10 steps done", "10/10 steps done"]
    monkeypatch.setattr(bs, "PROGRESS_S", 0.0)
    bs.main(argv)
    assert done_counts() == ["4/10 steps done", "8/10 steps done", "10/10 steps done"]


def test_gpu_step_phases_rows_keep_numbers_as_numbers():
    """phase_rows, the rows of its table and JSON: medians and shares are numbers (the JSON held the table's
    strings, "51.0"), a kernel's share being its median over the step part's."""
    found = {"step": {"step_kernel": [50.0, 52.0, 51.0]}, "extend": {"extend_kernel": [8.0, 9.0, 8.0]},
             "CSR export": {"csr_kernel": [34.0, 33.0, 35.0]}}
    rows = load("gpu_step_phases").phase_rows(256, found)
    assert [(r["B"], r["part"], r["kernel"], r["calls"]) for r in rows] == [
        (256, "step", "step_kernel", 3), (256, "extend", "extend_kernel", 3), (256, "CSR export", "csr_kernel", 3)]
    step, extend, csr = rows
    assert step["median_us"] == 51.0 and step["share_of_step"] == 1.0 and extend["median_us"] == 8.0
    assert csr["share_of_step"] == pytest.approx(34 / 51)
    assert all(type(r[k]) is float for r in rows for k in ("median_us", "p20_us", "p80_us", "share_of_step"))


def test_gpu_step_phases_share_of_step_adds_the_step_kernels():
    """A step that launches two kernels (40 and 10 µs a call) takes 50 µs a call: each row's share is over 50,
    not over the median of the two kernels' times pooled (10 or 40, whichever the pooled middle lands on)."""
    found = {"step": {"step_kernel": [40.0, 40.0, 40.0], "memset": [10.0, 10.0, 10.0]},
             "extend": {"extend_kernel": [5.0, 5.0, 5.0]}}
    rows = {r["kernel"]: r for r in load("gpu_step_phases").phase_rows(256, found)}
    assert rows["step_kernel"]["share_of_step"] == pytest.approx(0.8)
    assert rows["memset"]["share_of_step"] == pytest.approx(0.2)
    assert rows["extend_kernel"]["share_of_step"] == pytest.approx(0.1)


def test_startup_refuses_a_child_whose_first_alloc_or_step_was_refused():
    """A child whose pool cannot hold its first alloc and step (8 requests: 16 pages) would time calls that
    return at once, refused: the parent stops, saying so. With 16 pages both succeed."""
    bst = load("bench_startup")
    child = dict(page_size=16, batch=8, torch_only=False)
    with pytest.raises(SystemExit, match="first alloc or step was refused"):
        bst.run_child(bst.CHILD.format(num_pages=15, **child), "")
    got = bst.run_child(bst.CHILD.format(num_pages=16, **child), "")
    assert got["refused"] is False and got["phases"]["launch to first step"] > 0


def test_the_extras_ask_for_a_pytest_benchmark_whose_pedantic_takes_a_teardown():
    """The page-table and eviction suites pass ``teardown=`` to ``benchmark.pedantic``, which pytest-benchmark
    takes since 5.2.0 (5.1.0's pedantic has no such argument: every such benchmark fails with a TypeError);
    the extras that bring pytest-benchmark must not allow an older one (they said >=4)."""
    import tomllib
    with open(os.path.join(BENCH, "..", "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    suites = [name for name in sorted(os.listdir(BENCH)) if name.startswith("test_bench_")]
    assert any("teardown=" in open(os.path.join(BENCH, name)).read() for name in suites)
    for extra in ("dev", "bench"):
        (req,) = [r for r in extras[extra] if r.startswith("pytest-benchmark")]
        assert re.fullmatch(r"pytest-benchmark(\[histogram\])?>=5\.2", req), (extra, req)


def test_churn_names_the_backend_auto_ran(tmp_path, monkeypatch, capsys):
    """bench_scheduler.py --backend auto (its default): the title and the JSON rows name the backend the pools
    ran on (here TPOOL_BACKEND's), not "auto"."""
    monkeypatch.setenv("TPOOL_BACKEND", "numba")
    out = tmp_path / "churn.json"
    load("bench_scheduler").main(["--requests", "8", "--steps", "16", "--warmup", "0", "--num-pages", "4096",
                                  "--scenarios", "plain", "--json", str(out)])
    assert ", numba on cpu (host us per step" in capsys.readouterr().out
    assert {(r["backend"], r["device"]) for r in json.loads(out.read_text())["rows"]} == {("numba", "cpu")}


def test_progress_counts_from_the_process_start():
    """The progress lines' clock starts when the process does, not when _common is imported: a process that
    spends 1 s (as importing torch and transformers does) before importing it prints at least 1.0 s."""
    code = ("import sys, time; time.sleep(1.0); sys.path.insert(0, sys.argv[1]); "
            "import _common; _common.progress('first')")
    run = subprocess.run([sys.executable, "-c", code, BENCH], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    seconds = float(re.search(r"\[\s*([\d.]+) s\] first", run.stderr).group(1))
    assert seconds >= 1.0, run.stderr


def test_reconcile_benchmark_counts_each_value_with_the_same_tokens(tmp_path, capsys):
    """bench_reconcile.py serves the same requests once per --reconcile-every value: a row each, the same
    output tokens in every run (the script fails otherwise), fewer snapshots when they are rarer."""
    pytest.importorskip("transformers")
    out = tmp_path / "reconcile.json"
    load("bench_reconcile").main(["--requests", "40", "--num-pages", "24", "--max-batch", "4", "--json", str(out)])
    assert "reconcile every" in capsys.readouterr().out
    every1, every16 = json.loads(out.read_text())["rows"]
    assert (every1["reconcile_every"], every16["reconcile_every"]) == (1, 16)
    assert every1["tokens"] == every16["tokens"] > 0 and every16["snapshots"] < every1["snapshots"]


def test_the_readmes_reconcile_counts_are_the_default_runs(tmp_path, capsys):
    """The README quotes a default bench_reconcile.py run (preemptions and steps, a snapshot every step and
    every 16): counts from fixed seeds and host-side decisions, the same on every run. They had gone stale
    (616 and 814 steps, 100 preemptions) as the engine changed."""
    pytest.importorskip("transformers")
    with open(os.path.join(BENCH, "..", "README.md"), encoding="utf-8") as f:
        readme = " ".join(f.read().split())
    said = re.search(r"`python benchmarks/bench_reconcile.py` serves .*? prints (\d+) preemptions in (\d+) steps "
                     r"with a snapshot every step, (\d+) in (\d+) steps with one every 16", readme)
    assert said, "the README's sentence on a default bench_reconcile.py run moved"
    out = tmp_path / "reconcile.json"
    load("bench_reconcile").main(["--json", str(out)])
    every1, every16 = json.loads(out.read_text())["rows"]
    ran = [every1["preemptions"], every1["steps"], every16["preemptions"], every16["steps"]]
    assert ran == [int(g) for g in said.groups()], (ran, said.groups())
