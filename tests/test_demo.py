"""The demo: runs to the end, schedules without reading the device, never loops forever, fails cleanly."""

import os
import re
import subprocess
import sys

import pytest
import torch

from tpool import demo
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


def test_cuda_without_cuda_is_a_clean_error(capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(["--device", "cuda"])
    assert e.value.code == 2 and "CUDA is not available here" in capsys.readouterr().err


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


def test_model_demo_without_transformers_is_a_clean_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)
    for name in ("tpool.serving.engine", "tpool.serving.hf"):
        monkeypatch.delitem(sys.modules, name, raising=False)
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
                                         (["--num-pages", "10"], "raise --num-pages to at least 16 (pages of "
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
