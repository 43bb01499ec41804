"""Command line: ``python -m tpool demo``, ``python -m tpool report`` (also installed as ``tpool``)."""

import os
import sys

USAGE = """usage: python -m tpool [-h] [--version] COMMAND [options]

commands:
  demo     simulate an inference server's decode loop on a PageTable, scheduled on a
           host mirror of the pool (tpool.scheduling.HostMirror): 256 requests share
           up to 64 rows and 4,096 pages of 16 tokens; each step admits, decodes one
           token for the running batch (mirror.decode: a bound table step) and
           releases finished requests, preempting before a step that would not fit,
           with no device read per step.
           Prints a row every few steps and checks the pool at the end.
           With --model llama|gpt-neox: serve a tiny random-weight transformers model
           on tpool pages and check its tokens against generate (needs transformers: the hf extra).
           `python -m tpool demo --help` lists its options.
  report   print the memory ledgers of a device as this command's own process sees
           them: the caching allocator, the driver and the process (--json for JSON,
           --device cuda:N or cpu); what tpool's pools and caches hold is counted by
           tpool.memory_report() in the engine's process. `python -m tpool report --help`.

options:
  -h, --help  show this message and exit
  --version   print tpool's version and exit
"""


def _usage():
    """USAGE with the command's name as it was typed (``tpool`` or ``python -m tpool``)."""
    from tpool._prog import prog
    return USAGE.replace("python -m tpool", prog())


def _usage_error(message):
    """The usage line, then ``<the command's name>: error: message``, on stderr, as argparse words its
    errors (the subcommands' too); returns 2, argparse's exit status."""
    from tpool._prog import prog
    usage = _usage().splitlines()[0]
    _to_stderr(f"{usage}\n{prog()}: error: {message}")
    return 2


def _to_stderr(line):
    """``line`` on stderr; an stderr that cannot be written (``2>/dev/full``, a closed pipe) drops it, as
    argparse drops its own error message, so the exit status is still the command's, not 1 for a traceback."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


def _dispatch(argv):
    if argv and argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if not argv:
        return _usage_error("a command is required (demo or report)")
    cmd, rest = argv[0], argv[1:]
    if cmd == "--version":
        if rest:  # (as the subcommands' argparse words arguments it does not take)
            return _usage_error(f"unrecognized arguments: {' '.join(rest)}")
        from tpool._version import __version__
        print(f"tpool {__version__}")
        return 0
    if cmd == "demo":  # with --model, demo.main hands the options to the serving demo (tpool.serving.cli)
        from tpool import demo
        return demo.main(rest) or 0
    if cmd == "report":  # (report.main drops one leading "report": this one, so `report report` is an error)
        from tpool.memory.report import main as report_main
        return report_main(argv) or 0
    if cmd.startswith("-") and cmd != "-":
        return _usage_error(f"unknown option {cmd!r} (-h, --help or --version; or a command: demo or report)")
    return _usage_error(f"unknown command {cmd!r} (demo or report)")


class _OutputError(Exception):
    """An ``OSError`` from writing or flushing the command's standard output (its ``args[0]``)."""


class _Stdout:
    """``sys.stdout`` while a command runs: an ``OSError`` of its own writes becomes :class:`_OutputError`,
    so that only the output's errors end the command quietly (a full disk elsewhere, such as under
    numba's cache, stays the error it is)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as e:
            raise _OutputError(e) from e

    def flush(self):
        try:
            return self._stream.flush()
        except OSError as e:
            raise _OutputError(e) from e

    def __getattr__(self, name):
        return getattr(self._stream, name)


def main(argv=None):
    """Run one command; returns the exit status.

    A reader that closes the pipe early (``python -m tpool report | head -3``)
    ends the command quietly: the rest of the output is dropped, no traceback,
    exit status 141 (as a process killed by SIGPIPE). An output that cannot be
    written (``> /dev/full``) is one line on stderr and exit status 1. Ctrl-C
    (``KeyboardInterrupt``) is one line on stderr and exit status 130 (128 + SIGINT,
    as shells report it): the rows printed so far show how far the run got. Errors
    of anything else (another file, a pipe the command opened) are raised. With stderr
    closed (``2>&-``) the lines meant for it go nowhere, never into stdout.
    """
    argv = sys.argv[1:] if argv is None else argv
    stdout, stderr = sys.stdout, sys.stderr
    if stdout is not None:  # (None: stdout closed, `>&-`)
        sys.stdout = _Stdout(stdout)
    sink = None  # stderr closed (`2>&-`): print(file=None) and argparse's usage line would go to stdout, into the
    if stderr is None:  # data; they go nowhere instead, as argparse's error message does
        sys.stderr = sink = open(os.devnull, "w")
    try:
        try:
            status = _dispatch(argv)
        except SystemExit:  # argparse's --help and usage errors: their output too is flushed here
            _flush()
            raise
        _flush()  # a broken pipe surfaces here, inside the handler, not at interpreter exit
        return status
    except _OutputError as out:
        # Python's recipe (docs: signal, "Note on SIGPIPE"): point stdout at devnull so the
        # flush at exit does not raise a second time, and exit as a process killed by SIGPIPE would.
        stdout = _drop_stdout(stdout)  # (what finally puts back)
        e = out.args[0]
        if isinstance(e, BrokenPipeError):
            return 141
        _to_stderr(f"tpool: cannot write the output: {e.strerror or e}")  # `tpool demo > /dev/full`
        return 1
    except KeyboardInterrupt:  # Ctrl-C in a long demo: one line, not a traceback from wherever the loop was
        try:
            _flush()
        except _OutputError:
            stdout = _drop_stdout(stdout)
        _to_stderr("tpool: interrupted")
        return 130
    finally:
        sys.stdout = stdout
        if sink is not None:
            sys.stderr = stderr
            sink.close()


def _flush():
    if sys.stdout is not None:  # (None: stdout closed; print writes nothing then)
        sys.stdout.flush()


def _drop_stdout(stream):
    """The process's stdout from now on, on devnull, so the flush at exit has nowhere to fail:
    ``stream`` with its descriptor pointed at devnull, or a stream on devnull if it has none."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError):
        return open(os.devnull, "w")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
    return stream


if __name__ == "__main__":
    sys.exit(main())
