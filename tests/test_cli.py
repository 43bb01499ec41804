"""The command line as a user meets it: help, version, an early-closed pipe, unknown commands."""

import io
import os
import subprocess
import sys

import pytest

import tpool

ROOT = os.path.join(os.path.dirname(__file__), "..")


def tpool_cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "tpool", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, **kw)


def test_help_describes_each_command_and_option():
    r = tpool_cli("--help")
    assert r.returncode == 0 and r.stderr == ""
    for words in ("demo", "decode loop", "PageTable", "256 requests", "4,096 pages", "report", "--json",
                  "--device", "--version", "--help"):
        assert words in r.stdout


def test_version():
    r = tpool_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"tpool {tpool.__version__}"


@pytest.mark.parametrize("command", [[], ["demo"], ["report"], ["demo", "--model", "llama"]])
def test_usage_names_the_command_as_it_was_typed(command):
    """``python -m tpool ...`` says so in its usage line; the installed ``tpool`` script says ``tpool ...``.
    (The model demo's usage named ``--model`` twice: once in its name, once among its options.)"""
    r = tpool_cli(*command, "--help")
    assert r.stdout.startswith("usage: " + " ".join(["python -m tpool", *command[:1]]) + " ")
    if command[:1] == ["demo"]:   # both demos take --model, listed once
        assert r.stdout.split("\n\n")[0].count("--model") == 1
    script = os.path.join(os.path.dirname(sys.executable), "tpool")
    if not os.path.exists(script):
        pytest.skip("the tpool script is not installed beside this python")
    r = subprocess.run([script, *command, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("usage: " + " ".join(["tpool", *command[:1]]) + " ")


# Each subcommand's options, each with a help text.
@pytest.mark.parametrize("command", ["report", "demo"])
def test_subcommand_help_explains_every_option(command):
    r = tpool_cli(command, "--help")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    options = [i for i, line in enumerate(lines) if line.strip().startswith("--")]
    assert options
    for i in options:  # argparse puts the help on the option's line or the next, more indented one
        line = lines[i].strip()
        has_text = len(line.split("  ", 1)) == 2 and line.split("  ", 1)[1].strip()
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        assert has_text or (nxt.startswith(" " * 10) and not nxt.strip().startswith("-")), line


def _into_a_closed_pipe(*args):
    """``python -m tpool ARGS`` writing into a pipe whose reader is gone before it starts (deterministic)."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write into the pipe now fails with EPIPE
    try:
        return subprocess.run([sys.executable, "-m", "tpool", *args], cwd=ROOT, stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=600)
    finally:
        os.close(write_end)


def test_report_into_a_closed_pipe_ends_quietly():
    """`tpool report | head -3`: the reader is gone before the report is written."""
    r = _into_a_closed_pipe("report")
    assert "Traceback" not in r.stderr and "BrokenPipeError" not in r.stderr, r.stderr
    assert r.stderr == "" and r.returncode == 141


def test_an_output_that_cannot_be_written_is_one_line():
    """`tpool demo > /dev/full` ended in an OSError traceback; a closed pipe under the demo ends as the
    report's does (exit status 141, nothing on stderr but the kernels' compile notice)."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # (unbuffered, --help's write failed
    for args in (["--requests", "2", "--backend", "numba"], ["--help"]):       # at once, not at exit: exit 120)
        with open("/dev/full", "w") as full:
            r = subprocess.run([sys.executable, "-m", "tpool", "demo", *args], cwd=ROOT, env=env, stdout=full,
                               stderr=subprocess.PIPE, text=True, timeout=600)
        assert "Traceback" not in r.stderr and r.returncode == 1, (args, r.stderr)
        assert r.stderr.splitlines()[-1] == "tpool: cannot write the output: No space left on device"
    r = _into_a_closed_pipe("demo", "--requests", "2", "--backend", "numba")
    assert r.returncode == 141 and "Traceback" not in r.stderr, r.stderr


def test_only_the_outputs_own_errors_end_a_command_quietly(monkeypatch):
    """A full disk under something else the command writes (numba's cache) is that error, not "cannot
    write the output" with the output dropped."""
    import errno
    import tpool.__main__ as cli

    def elsewhere(argv):
        print("a row")
        raise OSError(errno.ENOSPC, "No space left on device", "/some/cache/index.nbi")

    monkeypatch.setattr(cli, "_dispatch", elsewhere)
    with pytest.raises(OSError, match="index.nbi"):
        cli.main(["demo"])


def test_report_piped_into_head():
    r = subprocess.run(f"{sys.executable} -m tpool report | head -3", shell=True, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.splitlines()[0].startswith("tpool memory report:") and len(r.stdout.splitlines()) == 3


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_report_is_one_write(monkeypatch, json_flag):
    """The report reaches stdout in one write, its newline included: with an unbuffered stdout
    (PYTHONUNBUFFERED=1) print's separate newline write could meet the pipe `head -3` had closed
    (exit status 141 instead of the README's 0)."""
    from tpool.memory import report

    class Writes(io.StringIO):
        calls = 0

        def write(self, text):
            Writes.calls += 1
            return super().write(text)

    out = Writes()
    monkeypatch.setattr(sys, "stdout", out)
    assert report.main(["--device", "cpu", *json_flag]) == 0
    assert Writes.calls == 1 and out.getvalue().endswith("\n") and not out.getvalue().endswith("\n\n")


def test_report_on_a_cpu_says_what_it_measured():
    r = tpool_cli("report", "--device", "cpu")
    assert r.returncode == 0 and r.stdout.splitlines()[-1].startswith("note: on a CPU only the process ledger")
    assert "CUDA" not in r.stdout


def test_no_command_is_an_error_with_the_usage():
    r = tpool_cli()
    assert r.returncode == 2 and r.stdout == "" and r.stderr.startswith("usage: python -m tpool ")
    assert r.stderr.splitlines()[1:] == ["python -m tpool: error: a command is required (demo or report)"]


def test_unknown_command_is_an_error_with_the_usage():
    r = tpool_cli("frobnicate")
    assert r.returncode == 2 and r.stdout == "" and r.stderr.startswith("usage: python -m tpool ")
    assert r.stderr.splitlines()[1:] == ["python -m tpool: error: unknown command 'frobnicate' (demo or report)"]


def test_an_abbreviated_model_option_is_an_error_not_the_simulation():
    """``tpool demo --mod llama``: argparse took ``--mod`` for ``--model`` and the simulation ran, the
    model ignored; the demos take no abbreviations now."""
    r = tpool_cli("demo", "--mod", "llama", "--requests", "2")
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert "error: unrecognized arguments: --mod llama" in r.stderr, r.stderr


def test_a_demo_where_no_request_fits_exits_1():
    """`demo --num-pages 10`: every request is rejected and nothing runs; a script sees a failure."""
    r = tpool_cli("demo", "--num-pages", "10", "--backend", "reference")
    assert r.returncode == 1 and "nothing to run" in r.stdout, r.stdout + r.stderr


# --- Pinned by helper-150's mutation run over tpool/__main__.py ---------------------------------------------

def test_dash_h_is_help_too(capsys):
    from tpool.__main__ import main
    assert main(["-h"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("usage: ") and "commands:" in out and err == ""


def test_main_returns_the_commands_exit_status(capsys):
    """``main`` returns 0 for a demo that ran (``demo.main`` returns None then) and the report's 2 for a
    device it cannot measure: a script calling ``main`` sees what the process would exit with."""
    from tpool.__main__ import main
    assert main(["demo", "--requests", "2", "--backend", "numba"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith("no errors, invariants hold")
    assert main(["report", "--device", "bogus"]) == 2
    assert "error:" in capsys.readouterr().err


def test_version_only_as_the_first_argument(capsys):
    """``tpool report --version`` is the report's unknown option, not tpool's version."""
    from tpool.__main__ import main
    with pytest.raises(SystemExit) as e:
        main(["report", "--version"])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and "unrecognized arguments: --version" in err and tpool.__version__ not in out


def test_main_puts_sys_stdout_back(capsys):
    from tpool.__main__ import main
    before = sys.stdout
    assert main(["--version"]) == 0
    assert sys.stdout is before and capsys.readouterr().out.strip() == f"tpool {tpool.__version__}"


class _Output(io.TextIOBase):
    """An output with no descriptor (``fileno`` raises ``no_fd``) whose writes or flushes raise the
    errors given (None: they succeed; the text is kept)."""

    def __init__(self, no_fd=io.UnsupportedOperation, write=None, flush=None):
        self.no_fd, self.write_error, self.flush_error, self.text = no_fd, write, flush, ""

    def write(self, text):
        if self.write_error:
            raise self.write_error
        self.text += text
        return len(text)

    def flush(self):
        if self.flush_error:
            raise self.flush_error

    def fileno(self):
        raise self.no_fd("no descriptor")


@pytest.mark.parametrize("error", [io.UnsupportedOperation, ValueError])
def test_a_broken_output_without_a_descriptor_is_replaced_by_devnull(monkeypatch, error):
    """An stdout with no descriptor (``io.UnsupportedOperation``; ``ValueError`` from a closed file) whose
    reader is gone: exit status 141, and ``sys.stdout`` is then a stream on devnull, so the flush at exit
    has nowhere to fail (the broken stream put back would raise there)."""
    from tpool.__main__ import main
    gone = BrokenPipeError(32, "Broken pipe")
    broken = _Output(error, write=gone, flush=gone)
    monkeypatch.setattr(sys, "stdout", broken)
    assert main(["--version"]) == 141
    now = sys.stdout
    assert now is not broken
    now.write("dropped\n")
    now.flush()
    now.close()


def test_a_closed_stdout_is_no_error():
    """``tpool --version >&-``: Python's ``sys.stdout`` is None; the command prints nothing and exits 0."""
    r = subprocess.run(f"{sys.executable} -m tpool --version >&-", shell=True, cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stderr == "", r.stderr


@pytest.mark.parametrize("at", ["write", "flush"])
def test_an_output_error_at_a_write_or_at_the_last_flush_ends_the_command_as_the_output_said(capsys, monkeypatch,
                                                                                             at):
    """A write that fails (a full disk, not only a broken pipe) is the one-line error and status 1; a
    broken pipe met only by the flush after the command (the output was buffered) is still status 141
    in the handler, not a traceback when the interpreter flushes at exit."""
    from tpool.__main__ import main
    full, gone = OSError(28, "No space left on device"), BrokenPipeError(32, "Broken pipe")
    monkeypatch.setattr(sys, "stdout", _Output(write=full) if at == "write" else _Output(flush=gone))
    status = main(["--version"])
    sys.stdout.close()  # (devnull, opened by main: the output had no descriptor)
    err = capsys.readouterr().err
    if at == "write":
        assert status == 1 and err == "tpool: cannot write the output: No space left on device\n", err
    else:
        assert status == 141 and err == "", err


def test_ctrl_c_is_one_line_and_status_130(monkeypatch, capsys):
    """Ctrl-C in a long demo (``--backend reference`` runs ~1 min) printed a traceback from wherever the
    loop was; it is one line on stderr now, after the rows already written, and status 130."""
    import tpool.__main__ as cli

    def interrupted(argv):
        print("a row")
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_dispatch", interrupted)
    try:
        status = cli.main(["demo"])
    except KeyboardInterrupt:  # (escaping, it would stop pytest itself)
        pytest.fail("KeyboardInterrupt escaped main")
    assert status == 130
    out, err = capsys.readouterr()
    assert out == "a row\n" and err == "tpool: interrupted\n", err


def test_ctrl_c_during_the_demo_ends_it_without_a_traceback():
    """SIGINT sent to a running demo once its first row is out."""
    import signal
    p = subprocess.Popen([sys.executable, "-m", "tpool", "demo", "--backend", "reference", "--every", "1"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # (not ignored, as `&` is)
    try:
        while not p.stdout.readline().lstrip().startswith("1 "):  # row 1: the loop is running
            assert p.poll() is None, p.stderr.read()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 130 and "Traceback" not in err, err
    assert err.splitlines()[-1] == "tpool: interrupted"


def test_the_reports_help_says_its_process_holds_no_pools():
    """The usage said the report prints "what tpool's caches and pools hold"; the command's own process
    holds none (its table says n/a): the help now names memory_report() in the engine's process."""
    for args in (["--help"], ["report", "--help"]):
        text = " ".join(tpool_cli(*args).stdout.split())
        assert "what tpool's caches and pools hold, the caching" not in text
        assert "memory_report(" in text and "in the engine's process" in text, text


def test_both_demos_say_triton_on_a_cpu_needs_the_interpreter():
    for args in (["demo", "--help"], ["demo", "--model", "llama", "--help"]):
        text = " ".join(tpool_cli(*args).stdout.split())
        assert "triton on a CPU needs TRITON_INTERPRET=1" in text, args


def test_report_report_is_a_usage_error(capsys):
    """``tpool report report`` ran the report: the command's word went to ``report.main``, which drops one
    leading ``report``, and the second one was dropped with it. Now the extra word is the report's error."""
    from tpool.__main__ import main
    with pytest.raises(SystemExit) as e:
        main(["report", "report"])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "" and "report: error: unrecognized arguments: report" in err, err
    assert main(["report", "--device", "cpu"]) == 0 and capsys.readouterr().out.startswith("tpool memory report")


@pytest.mark.parametrize("argv, error", [
    (["--version", "anything"], "unrecognized arguments: anything"),
    (["--version", "demo", "-x"], "unrecognized arguments: demo -x"),
    (["--bogus"], "unknown option '--bogus' (-h, --help or --version; or a command: demo or report)"),
    (["-v", "demo"], "unknown option '-v' (-h, --help or --version; or a command: demo or report)"),
    (["-"], "unknown command '-' (demo or report)"),
])
def test_extra_arguments_after_version_and_an_unknown_option_are_usage_errors(capsys, argv, error):
    """``tpool --version anything`` printed the version, dropping the rest; ``tpool --bogus`` said "unknown
    command". Both are usage errors now, worded as what they are; nothing goes to stdout."""
    from tpool.__main__ import main
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[1:] == [f"python -m tpool: error: {error}"], err


@pytest.mark.parametrize("args", ["--bogus", "report --device bogus", "report --js", "demo --requests 0"])
def test_with_stderr_closed_no_error_line_goes_to_stdout(args):
    """``2>&-``: ``sys.stderr`` is None, and ``print(..., file=sys.stderr)`` writes to stdout, as does
    argparse's usage line (``print_usage(None)``): the error went into the data a reader of stdout takes.
    The lines meant for stderr go nowhere now; the exit status still says what happened."""
    r = subprocess.run(f"{sys.executable} -m tpool {args} 2>&-", shell=True, cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and r.stdout == "", r.stdout


def test_with_stderr_closed_main_puts_none_back(monkeypatch, capsys):
    import tpool.__main__ as cli

    def interrupted(argv):
        print("a row")
        raise KeyboardInterrupt

    monkeypatch.setattr(sys, "stderr", None)
    assert cli.main(["--bogus"]) == 2 and sys.stderr is None
    monkeypatch.setattr(cli, "_dispatch", interrupted)
    assert cli.main(["demo"]) == 130 and sys.stderr is None
    assert capsys.readouterr().out == "a row\n"


@pytest.mark.parametrize("at", ["write", "flush"])
def test_an_stderr_that_cannot_be_written_keeps_the_commands_exit_status(monkeypatch, at):
    """``tpool --bogus 2>/dev/full`` exited 1 with a traceback nobody could read: the usage error's own
    line raised. The line is dropped now, as argparse drops its own, and the status stays 2 (130 for
    Ctrl-C, 1 for an output that cannot be written)."""
    import tpool.__main__ as cli
    full = OSError(28, "No space left on device")
    monkeypatch.setattr(sys, "stderr", _Output(write=full) if at == "write" else _Output(flush=full))
    assert cli.main(["--bogus"]) == 2
    monkeypatch.setattr(sys, "stdout", _Output(write=full))
    assert cli.main(["--version"]) == 1
    sys.stdout.close()  # (devnull, opened by main: the output had no descriptor)
    monkeypatch.setattr(sys, "stdout", _Output())

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_dispatch", interrupted)
    assert cli.main(["demo"]) == 130


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_usage_error_into_a_full_stderr_exits_2():
    r = subprocess.run(f"{sys.executable} -m tpool --bogus 2>/dev/full", shell=True, cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout)
