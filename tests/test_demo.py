"""The demo: runs to the end, schedules without reading the device, never loops forever, fails cleanly."""

import argparse
import inspect
import os
import re
import statistics
import subprocess
import sys
import types

import pytest
import torch

from tpool import demo
from tpool.page_table import PageTable
from tpool.pool import PagePool
from tpool.scheduling import HostMirror
from tpool.testing import count_host_reads


def test_demo_command_runs_to_completion():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # numba on a CPU, as a user runs it
    proc = subprocess.run([sys.executable, "-m", "tpool", "demo"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.endswith("no errors, invariants hold"), last
    allocated, freed = map(int, re.search(r"pages allocated (\d+), freed (\d+)", last).groups())
    assert allocated == freed > 0
    assert "failed extends 0" in last and int(re.search(r"preemptions (\d+)", last).group(1)) > 0
    assert demo.HEADER in proc.stdout and "columns:" in proc.stdout
    assert re.search(r"^\s*\d+\s+0\s+0\s+256\s+0\s+0\s+4096\s+4096\s", proc.stdout, re.M), \
        "the last row: nothing running or waiting, every page free on the device and in the mirror"


def _rows(lines):
    return [line for line in lines if re.match(r"^\s*\d+\s+\d+\s+\d+\s", line)]


@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_demo_reads_the_device_only_at_report_rows_and_the_final_check(backend):
    lines = []
    with count_host_reads() as seen:
        demo.run(requests=40, batch=12, num_pages=700, every=10, backend=backend, out=lambda s, **_: lines.append(s))
    rows = _rows(lines)
    steps = int(re.search(r"^(\d+) steps", lines[-2].strip()).group(1))
    assert steps > 100 and len(rows) == (steps - 1) // 10 + 2
    assert int(re.search(r"preemptions (\d+)", lines[-1]).group(1)) > 0, "the run exercises preemption"
    functions = lambda stack: {name for _, name in stack}  # noqa: E731
    # Device reads: only in the final check and at report rows. Each report row reads one snapshot at
    # once, before its ready() (the row's sync point: on CUDA it waits for the copy), nothing else.
    where = lambda stack: "_final_check" in functions(stack) or "_report" in functions(stack)  # noqa: E731
    assert seen.reads and all(where(stack) for _, stack in seen.reads), \
        [(what, stack[:3]) for what, stack in seen.reads if not where(stack)][:3]
    at_rows = [what for what, stack in seen.reads if "_report" in functions(stack)]
    # The reference backend's snapshot is an AsyncRead of the counters and the lengths, read at once; on
    # numba it is one compiled copy, done at once, that reads no tensor (HostMirror._snap_at).
    assert len(at_rows) == (2 * len(rows) if backend == "reference" else 0)
    assert all("host snapshot" in what for what in at_rows)
    assert not seen.snapshot_reads
    for row in rows:     # the mirror equals the device's free count at every row
        cols = row.split()
        assert cols[6] == cols[7], row


def test_a_pool_too_small_rejects_instead_of_looping():
    lines = []
    demo.run(num_pages=10, backend="numba", out=lambda s, **_: lines.append(s))
    text = "\n".join(lines)
    assert "rejected request 0: it needs" in text and "and 253 more requests rejected" in text
    assert "nothing to run" in text and lines[-1].endswith("no errors, invariants hold")
    lines.clear()   # one page, smaller than a warm-up request's max_len was: still a clean "nothing to run"
    demo.run(num_pages=1, requests=4, backend="numba", out=lambda s, **_: lines.append(s))
    assert "nothing to run" in "\n".join(lines) and lines[-1].endswith("no errors, invariants hold")
    lines.clear()   # one page of one token: a warm-up request with no token to decode (it asked for a second)
    demo.run(num_pages=1, page_size=1, requests=4, backend="numba", out=lambda s, **_: lines.append(s))
    assert "nothing to run" in "\n".join(lines) and lines[-1].endswith("no errors, invariants hold")


def test_some_requests_rejected_the_rest_finish():
    lines = []
    demo.run(requests=30, batch=8, num_pages=100, backend="numba", out=lambda s, **_: lines.append(s))
    done, rejected = map(int, re.search(r"requests done (\d+), rejected (\d+)", lines[-1]).groups())
    assert rejected > 0 and done > 0 and done + rejected == 30


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
@pytest.mark.parametrize("args, words", [(["--requests", "1000001"], "expected at most 1,000,000"),
                                         (["--num-pages", str((1 << 24) + 1)], "expected at most 16,777,216")])
def test_counts_past_the_demos_bounds_are_usage_errors(args, words, capsys):
    """``--requests 100000000`` took 16 GB making the queue's lengths before its first row."""
    with pytest.raises(SystemExit) as e:
        demo.main(args)
    assert e.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.parametrize("device, words", [
    pytest.param("cuda", "expected cpu, got cuda: CUDA is not available here",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")),
    ("cuda:x", "expected a cpu or cuda device, got 'cuda:x'")])
def test_cuda_without_cuda_is_a_clean_error(device, words, capsys):
    """Checked before the run, naming the option as typed."""
    with pytest.raises(SystemExit) as e:
        demo.main(["--device", device])
    assert e.value.code == 2 and f"error: --device: {words}" in capsys.readouterr().err


def test_help_gives_every_option_a_default(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--help"])
    text = capsys.readouterr().out
    options = re.findall(r"^\s+(--[a-z-]+)", text, re.M)
    assert len(options) == 9
    blocks = re.split(r"\n\s+(?=--[a-z])", text.split("options:")[1])[1:]
    assert all("default" in b for b in blocks), blocks


def test_triton_without_triton_is_a_clean_error(monkeypatch, capsys):
    """``--backend triton`` where triton is not installed: the ImportError naming the extra, as an option error."""
    import tpool.backends
    monkeypatch.setattr(tpool.backends, "_triton_installed", lambda: False)
    with pytest.raises(SystemExit) as e:
        demo.main(["--backend", "triton", "--requests", "2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "error: backend 'triton' needs triton" in err and "pip install 'triton>=3.0'" in err


def _without(monkeypatch, *names):
    """Imports of ``names`` fail (ModuleNotFoundError), the serving engine imported again."""
    for name in ("tpool.serving.engine", "tpool.serving.hf"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)


def test_model_demo_without_transformers_is_a_clean_error(monkeypatch, capsys):
    _without(monkeypatch, "transformers")
    from tpool.__main__ import main
    with pytest.raises(SystemExit) as e:
        main(["demo", "--model", "llama"])
    assert e.value.code == 2 and "pip install 'transformers>=5'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # its options still print: they are parsed before the import
        main(["demo", "--model", "llama", "--help"])
    help_text = capsys.readouterr().out
    assert e.value.code == 0 and "--num-pages" in help_text and "needs transformers" in help_text


@pytest.mark.parametrize("args, words", [(["--requests", "0"], "expected a positive int"),
                                         (["--backend", "bogus"], "invalid choice"),
                                         (["--batch", "0"], "argument --batch/--max-batch: expected a positive"),
                                         (["--num-pages", "1"], "request 0: expected prompt"),
                                         (["--num-pages", "10"], "raise --num-pages to at least 15 (pages of "
                                                                 "--page-size 4 tokens)")])
def test_model_demo_bad_options_are_clean_errors(args, words, capsys):
    pytest.importorskip("transformers")
    from tpool.serving.cli import main as serve_main
    with pytest.raises(SystemExit) as e:
        serve_main(["--model", "llama", *args])
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_a_page_holding_the_longest_request_runs(capsys):
    """``--page-size 4096`` (any page at least the longest request) makes rows of one page
    (max_pages 1): the warm-up asked for page_size + 2 tokens, past a row, and crashed."""
    lines = []
    s = demo.run(requests=6, page_size=4096, backend="numba", out=lambda s, **_: lines.append(s))
    assert lines[-1].endswith("no errors, invariants hold") and "requests done 6, rejected 0" in lines[-1]
    assert s["pages.used.current"] == 0
    demo.main(["--page-size", "2500", "--num-pages", "1", "--requests", "3", "--backend", "numba"])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].endswith("no errors, invariants hold") and "requests done 3, rejected 0" in out[-1]


@pytest.mark.parametrize("spelling", [["--model", "gpt-neox"], ["--model=gpt-neox"]])
def test_demo_main_with_a_model_runs_the_serving_demo(spelling, monkeypatch):
    """``demo.main`` hands every option to the serving demo when a model is named (it parsed
    ``--model`` and ran the simulation)."""
    import tpool.serving.cli
    seen = []
    monkeypatch.setattr(tpool.serving.cli, "main", lambda argv: seen.append(argv) or 0)
    args = ["--requests", "2", *spelling, "--max-batch", "4"]
    assert demo.main(args) == 0 and seen == [args]
    from tpool.__main__ import main
    assert main(["demo", *args]) == 0 and seen == [args, args]


@pytest.mark.parametrize("argv", [["--mod", "llama"], ["--mo=gpt-neox"], ["--req", "2"]])
def test_the_demos_take_no_abbreviated_options(argv, capsys):
    """``demo --mod llama`` ran the simulation (argparse took ``--mod`` for ``--model``, which only an
    exact ``--model`` hands to the serving demo): abbreviations are errors in both demos' parsers."""
    from tpool.__main__ import main
    from tpool.serving.cli import main as serve_main
    for call in (lambda: main(["demo", *argv]), lambda: demo.main(argv),
                 lambda: serve_main(["--model", "llama", *argv])):
        with pytest.raises(SystemExit) as e:
            call()
        err = capsys.readouterr().err
        assert e.value.code == 2 and "unrecognized arguments: " + " ".join(argv) in err, err


@pytest.mark.parametrize("seed", ["99999999999999999999999", str(2**64), "-1"])
def test_a_seed_out_of_range_is_an_error_naming_it(seed, capsys):
    """``--seed`` past what ``torch.manual_seed`` takes: an option error naming ``--seed`` and the range
    (the serving demo said only ``error: Overflow when unpacking long long``)."""
    from tpool.serving.cli import main as serve_main
    for call in (lambda: serve_main(["--model", "llama", "--seed", seed, "--requests", "1"]),
                 lambda: demo.main(["--seed", seed, "--requests", "1"])):
        with pytest.raises(SystemExit) as e:
            call()
        err = capsys.readouterr().err
        assert e.value.code == 2 and "argument --seed: expected an int from 0 to 18446744073709551615" in err, err
    assert demo.seed_int(str(2**64 - 1)) == 2**64 - 1 and demo.seed_int("0") == 0


# --- Pinned by helper-147's mutation run over tpool/demo.py (session 40) ---------------------------------------

def _run(**kw):
    lines = []
    s = demo.run(backend="numba", out=lambda x, **_: lines.append(x), **kw)
    return s, lines


def test_admits_in_arrival_order_preempts_the_newest_and_recomputes_them(monkeypatch):
    """Admissions take the oldest waiting requests (a preempted one goes back in arrival order, ahead of
    newer ones), preemption releases the newest running requests, a readmitted request decodes all its
    output again from its prompt, and the summary counts every request released as a preemption. The
    mirror names one victim a step in this run; the first time, the recording mirror names the next
    newest too, so that one step releases two, and the summary must count both."""
    requests, batch, num_pages = 256, 64, 4096
    prompts, outputs = demo.request_lengths(requests)
    pairs = [(p, p + o) for p, o in zip(prompts, outputs)]
    assert len(set(pairs)) == requests                      # each admission names its request
    mirrors = []

    class Recording(HostMirror):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.real = bool(mirrors)                       # the first one is the warm-up's
            self.waiting, self.running, self.decoded = list(range(requests)), {}, {}
            self.victims, self.preempted, self.done, self.most = [], 0, 0, 0
            mirrors.append(self)

        def admit(self, prompt_lens, max_lens=None):
            rows = super().admit(prompt_lens, max_lens)
            if not self.real:
                return rows
            got = [pairs.index((int(p), int(m))) for p, m in zip(prompt_lens, max_lens)]
            assert got == sorted(self.waiting)[:len(got)], (got, sorted(self.waiting)[:len(got)])
            for r, q in zip(rows, got):
                self.waiting.remove(q)
                self.running[r], self.decoded[r] = q, 0
            return rows

        def preemption(self, rows, priority, *a, **kw):
            self.victims = list(super().preemption(rows, priority, *a, **kw))
            if self.victims and self.real and not self.most:
                self.victims += [r for r in sorted(rows, key=self.running.get)[::-1] if r not in self.victims][:1]
            if self.victims and self.real:
                self.most = max(self.most, len(self.victims))
                newest = sorted(self.running.values())[-len(self.victims):]
                assert sorted(self.running[r] for r in self.victims) == newest
            return self.victims

        def decode(self, rows, *a, **kw):
            res = super().decode(rows, *a, **kw)
            for r in rows:
                if r in self.decoded:
                    self.decoded[r] += 1
            return res

        def finish(self, rows, *a, **kw):
            super().finish(rows, *a, **kw)
            rows = list(rows)
            if not self.real:
                return
            preempting = rows == self.victims
            for r in rows:
                q = self.running.pop(r)
                if preempting:
                    self.waiting.append(q)
                    self.preempted += 1
                else:
                    assert self.decoded[r] == outputs[q], (q, self.decoded[r], outputs[q])
                    self.done += 1
            self.victims = []

    monkeypatch.setattr(demo, "HostMirror", Recording)
    _, lines = _run(requests=requests, batch=batch, num_pages=num_pages, every=10)
    m = mirrors[-1]
    assert m.preempted > 0 and m.done == requests and not m.running and not m.waiting and m.most == 2
    assert f"requests done {requests}, rejected 0, preemptions {m.preempted} " in lines[-1], lines[-1]


def test_a_row_shows_the_pages_reserved_for_the_running_requests():
    """The reserved column: pages set aside for the running requests' next token, at most one each,
    none once nothing runs."""
    _, lines = _run(requests=40, batch=12, num_pages=700, every=10)
    rows = [line.split() for line in _rows(lines)]
    assert all(0 <= int(c[8]) <= int(c[1]) for c in rows), [c for c in rows if not 0 <= int(c[8]) <= int(c[1])][:3]
    assert any(int(c[8]) > 0 for c in rows) and rows[-1][8] == "0"


def test_progress_counts_rejected_requests_as_settled():
    """progress = requests done or rejected, of all: the last row of a run with rejections says 100%."""
    _, lines = _run(requests=30, batch=8, num_pages=100)
    rejected = int(re.search(r"rejected (\d+);?", lines[-1]).group(1))
    rows = _rows(lines)
    assert rejected > 0 and rows[-1].endswith("100%"), rows[-1]


def test_the_summary_names_the_peak_of_pages_in_use():
    """``peak in use N of P``: the pool's peak, not what is in use at the end (nothing)."""
    s, lines = _run(requests=30, batch=8, num_pages=100)
    peak = int(re.search(r"peak in use (\d+) of 100", lines[-1]).group(1))
    assert peak == s["pages.used.peak"] > 0 and s["pages.used.current"] == 0


def test_a_rejected_request_names_the_pages_its_prompt_and_output_need():
    """The rejection message's page count covers the whole request (prompt + output), rounded up."""
    _, lines = _run(requests=10, num_pages=84)
    msgs = [line for line in lines if line.startswith("rejected request")]
    assert len(msgs) == 3 and not any("more requests rejected" in line for line in lines)
    for line in msgs:
        need, p, o, ps = map(int, re.search(r"needs (\d+) pages \(prompt (\d+) \+ output (\d+) tokens, (\d+) a page\)",
                                            line).groups())
        assert need == -(-(p + o) // ps) > 84, line


def test_only_the_first_rejections_are_named_and_no_table_is_printed_when_nothing_runs():
    """Every request rejected: SHOW_REJECTED named, the rest counted, and no legend or header for an
    empty table."""
    _, lines = _run(num_pages=10)
    assert len([line for line in lines if line.startswith("rejected request")]) == demo.SHOW_REJECTED
    assert demo.HEADER not in lines and not any(line.startswith("columns:") for line in lines)


def test_a_request_that_fills_the_pool_exactly_runs():
    """A request of exactly the pool's tokens fits (only one past it is rejected)."""
    (p,), (o,) = demo.request_lengths(1)
    s, lines = _run(requests=1, page_size=1, num_pages=p + o)
    assert "requests done 1, rejected 0" in lines[-1] and s["pages.used.peak"] == p + o


def test_step_times_are_medians_of_the_steps_since_the_last_row(monkeypatch):
    """``step us``: row 0 is the first step alone, each later row the median of the steps since the
    row before; the summary gives the median, p20 and p80 of every step (a clock where step k takes
    k + 1 us)."""
    calls = [0]

    def perf_counter():
        n, calls[0] = calls[0], calls[0] + 1
        k = n // 2
        return float(k) if n % 2 == 0 else k + (k + 1) * 1e-6
    monkeypatch.setattr(demo, "time", types.SimpleNamespace(perf_counter=perf_counter))
    _, lines = _run(requests=40, batch=12, num_pages=700, every=10)
    rows = [line.split() for line in _rows(lines)]
    prev = None
    for c in rows:
        step = int(c[0])
        want = 1.0 if prev is None else (prev + 2 + step + 1) / 2
        assert float(c[10]) == pytest.approx(want, abs=0.051), (c, want)
        prev = step
    n = int(re.search(r"^(\d+) steps", lines[-2].strip()).group(1))
    times = list(range(1, n + 1))
    q = statistics.quantiles(times, n=10)
    assert f"median {statistics.median(times):.1f} us (p20 {q[1]:.1f}, p80 {q[7]:.1f})" in lines[-2], lines[-2]


def test_every_sets_the_steps_between_rows(capsys):
    """``--every N`` (the CLI option) prints a row at every N-th step and one at the end."""
    demo.main(["--requests", "3", "--every", "7", "--backend", "numba"])
    rows = _rows(capsys.readouterr().out.splitlines())
    steps = [int(r.split()[0]) for r in rows]
    assert len(steps) > 3 and all(s % 7 == 0 for s in steps[:-1]) and steps[:3] == [0, 7, 14], steps


@pytest.mark.parametrize("option, largest", [("--requests", demo.MAX_REQUESTS), ("--batch", demo.MAX_BATCH),
                                             ("--num-pages", demo.MAX_PAGES)])
def test_each_bound_itself_is_accepted(option, largest, capsys):
    """The bounds are inclusive: the largest count is parsed (``--help`` after it stops before a run)."""
    with pytest.raises(SystemExit) as e:
        demo.main([option, str(largest), "--help"])
    assert e.value.code == 0
    assert demo.at_most(5, "why")("5") == 5
    with pytest.raises(argparse.ArgumentTypeError, match="expected at most 5"):
        demo.at_most(5, "why")("6")


def test_a_model_named_after_a_double_dash_is_not_an_option():
    """``--model`` after ``--`` is an argument, not the option: the simulation's parser decides."""
    assert demo.wants_model(["--model", "llama"]) and demo.wants_model(["--model=llama"])
    assert not demo.wants_model(["--", "--model", "llama"])
    assert not demo.wants_model(["--requests", "2", "--", "--model=llama"])


def _small():
    pool = PagePool(8, 4, device="cpu", backend="numba")
    table = PageTable(pool, 2, 16)
    return pool, table, HostMirror(table, lookahead=1, free=8, cached=0)


def test_the_final_check_wants_the_mirror_equal_to_the_device():
    """The end of the run: a mirror counting fewer free pages than the device (a release made around it)
    is a failure too, not only one promising more."""
    pool, table, m = _small()
    rows = m.admit([8])
    table.release(torch.tensor(rows, dtype=torch.int32))   # the device frees 2 pages; the mirror does not know
    assert m.free == 6 and pool.available() == 8
    with pytest.raises(AssertionError, match="mirror 6 free pages, device 8"):
        demo._final_check(pool, table, m)


def test_the_final_check_fails_on_a_failed_extend():
    """A failed extend (out of pages: not an error pool.check() raises) fails the final check."""
    pool, table, m = _small()
    table.extend(torch.tensor([0], dtype=torch.int32), torch.tensor([40], dtype=torch.int32), max_tokens=40)
    pool.check()
    assert pool.stats()["requests.failed"] == 1 and m.free == pool.available()
    with pytest.raises(AssertionError, match="failed extends 1"):
        demo._final_check(pool, table, m)


def test_auto_every_estimates_the_run_from_the_requests_the_pool_holds_at_once():
    """The default demo gets 25; a pool holding 10 of 100 requests at once (batch 64) runs ~10,000 steps:
    a row every 200 for about 50 rows."""
    prompts, outputs = demo.request_lengths(256)
    assert demo.auto_every(prompts, outputs, 64, 4096 * 16) == 25
    assert demo.auto_every([1000] * 100, [1000] * 100, 64, 20_000) == 200
    assert demo.auto_every([1000] * 100, [1000] * 100, 5, 20_000) == 400     # the batch bounds it first


def test_sizes_that_may_be_zero_take_zero():
    """``count_int`` (the serving demo's ``--system-prompt``): 0 is a size, only a negative one is refused."""
    assert demo.count_int("0") == 0 and demo.count_int("7") == 7
    with pytest.raises(argparse.ArgumentTypeError, match="expected an int of at least 0, got -1"):
        demo.count_int("-1")
    assert demo.positive_int("1") == 1
    with pytest.raises(argparse.ArgumentTypeError, match="expected a positive int, got 0"):
        demo.positive_int("0")



@pytest.mark.parametrize("argv, option, expected", [
    (["--requests", "1e3"], "--requests", "expected a positive int, got '1e3'"),   # at_most: was "invalid parse value"
    (["--num-pages", "abc"], "--num-pages", "expected a positive int, got 'abc'"),
    (["--page-size", "x"], "--page-size", "expected a positive int, got 'x'"),
    (["--seed", "1.5"], "--seed", "expected an int from 0 to 18446744073709551615 (2**64 - 1), got '1.5'"),
])
def test_a_count_that_is_not_an_int_says_what_was_expected(argv, option, expected, capsys):
    """argparse words a ValueError from a type function with the function's name ("invalid parse value: '1e3'",
    naming at_most's inner function); the demos' types say what they expected instead."""
    with pytest.raises(SystemExit) as e:
        demo.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: {expected}" in err and "invalid" not in err, err
    with pytest.raises(argparse.ArgumentTypeError, match="expected an int of at least 0, got 'x'"):
        demo.count_int("x")

# --- Pinned by helper-150's mutation run over tpool/serving/cli.py ------------------------------------------

def _served(monkeypatch, argv):
    """``tpool.serving.cli.main(argv)`` with the serving demo replaced by a recorder: what it was asked to run."""
    pytest.importorskip("transformers")
    from tpool.serving import cli, engine
    seen = []
    monkeypatch.setattr(engine, "run_demo", lambda model, **kw: seen.append((model, kw)))
    assert cli.main(argv) == 0
    (call,) = seen
    return call


def test_the_model_demos_defaults_are_run_demos(monkeypatch):
    """No option given: the serving demo runs with ``run_demo``'s own defaults (llama, the prefix cache on),
    each as the option's help text says."""
    pytest.importorskip("transformers")
    from tpool.serving import engine
    defaults = {k: p.default for k, p in inspect.signature(engine.run_demo).parameters.items()}
    model, kw = _served(monkeypatch, [])
    assert model == defaults["model"] == "llama"
    assert kw == dict(requests=32, num_pages=48, page_size=4, max_batch=8, backend="auto", device=None, seed=0,
                      system_len=8, prefix_cache=True)
    assert all(kw[k] == defaults[k] for k in kw)


def test_every_model_demo_option_reaches_run_demo(monkeypatch):
    model, kw = _served(monkeypatch, ["--model", "gpt-neox", "--requests", "5", "--num-pages", "20", "--page-size",
                                      "2", "--batch", "3", "--system-prompt", "0", "--no-prefix-cache", "--backend",
                                      "reference", "--seed", "7", "--device", "cpu"])
    assert model == "gpt-neox"
    assert kw == dict(requests=5, num_pages=20, page_size=2, max_batch=3, backend="reference", device="cpu", seed=7,
                      system_len=0, prefix_cache=False)


@pytest.mark.parametrize("option, most", [("--requests", 10_000), ("--num-pages", 1 << 18), ("--batch", 1 << 10)])
def test_the_model_demos_limits_are_inclusive(option, most, capsys):
    from tpool.serving.cli import parser
    dest = {"--requests": "requests", "--num-pages": "num_pages", "--batch": "max_batch"}[option]
    assert getattr(parser().parse_args([option, str(most)]), dest) == most
    with pytest.raises(SystemExit) as e:
        parser().parse_args([option, str(most + 1)])
    assert e.value.code == 2 and f"expected at most {most:,} (" in capsys.readouterr().err


def test_the_model_demo_takes_each_backend_and_model_and_no_other(capsys):
    from tpool.serving.cli import parser
    for backend in ("auto", "reference", "numba", "triton"):
        assert parser().parse_args(["--backend", backend]).backend == backend
    for model in ("llama", "gpt-neox"):
        assert parser().parse_args(["--model", model]).model == model
    with pytest.raises(SystemExit) as e:
        parser().parse_args(["--model", "gpt2"])
    assert e.value.code == 2 and "argument --model: invalid choice: 'gpt2'" in capsys.readouterr().err


def test_a_bad_device_is_refused_before_transformers_is_needed_naming_the_model(monkeypatch, capsys):
    """``--device`` is checked before transformers is imported (a machine without it hears of its device
    first), and errors after the options are parsed name the model asked for."""
    from tpool.serving.cli import main as serve_main
    _without(monkeypatch, "transformers")
    with pytest.raises(SystemExit) as e:
        serve_main(["--model", "gpt-neox", "--device", "nonsense"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "demo --model gpt-neox: error: --device: " in err, err
    assert "transformers" not in err


def test_another_missing_module_is_not_called_transformers(monkeypatch):
    """Only transformers missing is the "needs transformers" option error; another module missing is raised."""
    from tpool.serving.cli import main as serve_main
    _without(monkeypatch, "tpool.serving.engine")
    with pytest.raises(ModuleNotFoundError) as e:
        serve_main(["--model", "llama"])
    assert e.value.name == "tpool.serving.engine"


def test_a_preemption_does_not_sort_the_whole_queue_again(monkeypatch):
    """With --requests 1,000,000 the run took about an hour, most of it re-sorting the waiting queue at
    every preemption and deleting a list's head at every admission; the queue is a deque now, and
    preempted requests (older than every waiting one) go back at its head. One sort of the whole queue,
    at the start."""
    big = []

    def counting(items, *a, **kw):
        out = sorted(items, *a, **kw)
        if len(out) > 12:
            big.append(len(out))
        return out

    monkeypatch.setattr(demo, "sorted", counting, raising=False)   # (module globals come before builtins)
    _, lines = _run(requests=300, batch=12, num_pages=700, every=50)
    assert int(re.search(r"preemptions (\d+)", lines[-1]).group(1)) > 0, "the run exercises preemption"
    assert "requests done 300, rejected 0" in lines[-1]
    assert big == [300], big


def test_requeue_keeps_arrival_order():
    """Preempted requests go back ahead of the waiting ones when older than all (the demo's case), and in
    arrival order among them otherwise."""
    import collections
    waiting = collections.deque([7, 9])
    demo._requeue(waiting, [5, 3])
    assert list(waiting) == [3, 5, 7, 9]
    demo._requeue(waiting, [8, 1])
    assert list(waiting) == [1, 3, 5, 7, 8, 9]
    empty = collections.deque()
    demo._requeue(empty, [4, 2])
    assert list(empty) == [2, 4]


@pytest.mark.parametrize("args", [["--page-size", "524288"], ["--num-pages", "1", "--page-size", str(2**31)],
                                  ["--page-size", "99999999999999999999"]])
def test_a_pool_of_more_tokens_than_int32_slots_is_an_error_naming_both_options(args, capsys):
    """``--page-size 2147483648`` was refused by the table's own check, naming ``max_pages_per_request``,
    which is no option of the demo; ``--page-size 524288`` by the pool's, naming neither option."""
    with pytest.raises(SystemExit) as e:
        demo.main(args)
    err = capsys.readouterr().err.splitlines()[-1]
    assert e.value.code == 2 and "error: --num-pages x --page-size: expected at most 2,147,483,647 tokens" in err, err
    pages = int(args[args.index("--num-pages") + 1]) if "--num-pages" in args else 4096
    size = int(args[args.index("--page-size") + 1])
    assert err.endswith(f"got {pages:,} x {size:,} = {pages * size:,}"), err


def test_a_pool_of_exactly_int32_slots_runs(capsys):
    """The product's bound is inclusive: one page of 2**31 - 1 tokens holds every request."""
    assert demo.main(["--num-pages", "1", "--page-size", str(2**31 - 1), "--requests", "3"]) is None
    assert capsys.readouterr().out.splitlines()[-1].startswith("pages allocated 3, freed 3, peak in use 1 of 1;")


def test_progress_says_100_only_when_every_request_is_settled():
    """255 of 256 requests done rounded to 100% while one still ran (with --requests 1000 five rows
    said 100% with requests running); the percentage is rounded down now."""
    _, lines = _run(requests=256, every=1)
    rows = [line.split() for line in _rows(lines)]
    assert [c[-1] for c in rows].count("100%") == 1 and rows[-1][-1] == "100%"
    assert all(c[-1] == f"{100 * (int(c[3]) + int(c[4])) // 256}%" for c in rows)
    assert any(c[-1] == "99%" and int(c[3]) == 255 for c in rows)


def test_the_readmes_sample_output_is_the_default_runs():
    """The README shows rows of a default run and says its counts are the same on every machine: its
    header, the counts of each row it shows (all but the step time) and the number of steps."""
    with open(os.path.join(os.path.dirname(__file__), "..", "README.md"), encoding="utf-8") as f:
        readme = f.read()
    sample = readme[readme.index("\n## The demo\n"):]
    sample = sample[:sample.index("(The counts are the same on every machine")]
    shown = [line.split() for line in _rows(sample.splitlines())]
    _, lines = _run()
    assert demo.HEADER.strip() in sample
    ran = {c[0]: c for c in (line.split() for line in _rows(lines))}
    assert len(shown) >= 3 and all(c[:10] == ran[c[0]][:10] and c[11] == ran[c[0]][11] for c in shown), \
        [(c, ran.get(c[0])) for c in shown]
    steps = re.search(r"^\s*(\d+) steps;", sample, re.M).group(1)
    assert any(line.strip().startswith(f"{steps} steps;") for line in lines), lines[-2:]


def test_the_readmes_model_demo_counts_are_the_default_runs():
    """The README gives the counts of a default model demo, with the prefix cache and without it; the
    scheduling is decided on host integers from fixed seeds, so they are the same on every run. They had
    gone stale (62 steps, 24 hits holding 212 tokens, 201 pages evicted, 5 forks) after the prefix cache
    began to leave a running reviver's entries on its pages."""
    pytest.importorskip("transformers")
    from tpool.serving import engine
    with open(os.path.join(os.path.dirname(__file__), "..", "README.md"), encoding="utf-8") as f:
        readme = " ".join(f.read().split())
    said = re.search(r"A default run \(the same counts on every run, from the fixed seeds\): (\d+) steps, "
                     r"(\d+) tokens, (\d+) prefix-cache hits holding (\d+) tokens, (\d+) pages evicted, (\d+) "
                     r"preemptions?, (\d+) forks?; with `--no-prefix-cache`, (\d+) steps and (\d+) preemptions?\.",
                     readme)
    assert said, "the README's sentence on a default model demo's counts moved"
    said = [int(g) for g in said.groups()]
    r = engine.run_demo("llama", backend="numba", out=None)
    plain = engine.run_demo("llama", backend="numba", out=None, prefix_cache=False)
    ran = [r["steps"], r["tokens"], r["cache_hits"], r["cached_tokens"], r["evicted"], r["preemptions"], r["forks"],
           plain["steps"], plain["preemptions"]]
    assert ran == said, (ran, said)


def test_the_model_demos_check_says_how_far_it_got(monkeypatch):
    """After its last step row the model demo checks every request against ``generate``, each alone
    (~0.3 s a request on 2 cores): ``--requests 300`` printed nothing for 98 s, ``--requests 10000`` would
    for most of an hour. It prints how many it has checked whenever its last line is older than
    ``CHECK_PROGRESS_S`` (here: always), and still checks them all."""
    pytest.importorskip("transformers")
    from tpool.serving import engine
    monkeypatch.setattr(engine, "CHECK_PROGRESS_S", -1.0)
    monkeypatch.setattr(engine, "CHECK_CHUNK", 2)
    lines = []
    r = engine.run_demo("llama", backend="numba", requests=6, num_pages=16, page_size=4, max_batch=4, system_len=0,
                        prefix_cache=False, out=lambda s, **_: lines.append(s))
    start = next(i for i, line in enumerate(lines) if line.startswith("checking the 6 requests"))
    assert lines[start + 1:start + 3] == ["  checked 2 of 6 requests", "  checked 4 of 6 requests"], lines[start:]
    assert lines[start + 3].endswith("requests matching generate: 6/6") and r["mismatches"] == 0


def test_the_model_demo_counts_apart_the_requests_not_arrived_yet():
    """Its step rows said "waiting 28" at step 0 for requests that arrive at later steps (arrival i // 4):
    waiting counts the arrived ones, and "+N to arrive" the rest; every request is in one column."""
    pytest.importorskip("transformers")
    from tpool.serving import engine
    lines = []
    engine.run_demo("llama", backend="numba", requests=12, num_pages=16, page_size=4, max_batch=4, system_len=0,
                    prefix_cache=False, out=lambda s, **_: lines.append(s))
    m = re.match(r"step    0: running +(\d+), waiting +(\d+) \(\+(\d+) to arrive\)", lines[1])
    assert m, lines[:3]
    running, waiting, later = map(int, m.groups())
    assert running + waiting == 4 and later == 8   # requests 0-3 arrive at step 0, 4-11 at steps 1 and 2


def test_a_mirror_counting_fewer_free_pages_than_the_device_fails_the_run(monkeypatch):
    """Each row reconciled the mirror before printing it, so the mirror column always showed the device's
    count, and the final check compared a mirror the last row had just set to the device's: a mirror that
    lost track of pages (counting fewer free than there are) ran to "no errors". The row now shows the
    count the scheduler kept and fails when it differs."""
    class Losing(HostMirror):
        lost = False

        def decode(self, rows, *a, **kw):
            res = super().decode(rows, *a, **kw)
            if not Losing.lost and len(rows) > 1:
                Losing.lost = True
                self.free -= 1          # a page the scheduler will never hand out again
            return res

    monkeypatch.setattr(demo, "HostMirror", Losing)
    with pytest.raises(AssertionError, match=r"step 0: mirror \d+ free pages, device \d+"):
        _run(requests=40, batch=12, num_pages=700, every=1)
    assert Losing.lost


@pytest.mark.parametrize("kw, words", [(dict(requests=0), "requests: expected a positive int, got 0"),
                                       (dict(requests=-1), "requests: expected a positive int, got -1"),
                                       (dict(page_size=0), "page_size: expected a positive int, got 0"),
                                       (dict(every=0), "every: expected a positive int, got 0"),
                                       (dict(every=-5), "every: expected a positive int, got -5")])
def test_run_refuses_counts_below_one_naming_them(kw, words):
    """``demo.run`` (the command's loop, callable alone) raised ``max() arg is an empty sequence`` for no
    requests and ``ZeroDivisionError`` for ``page_size=0`` or ``every=0``; ``every=-5`` ran. The command line's
    types never let them through; the function now says which count it expected, before a pool is made."""
    built = []
    with pytest.raises(demo.OptionError, match=f"^{words}$"):
        demo.run(**{"requests": 4, **kw}, out=built.append)
    assert built == []
