"""Shared helpers for the benchmark scripts: timing (warm and cold), quantiles, progress, table, JSON, plots.

The scripts print a newcomer's table; ``benchmarks/test_bench_*.py`` run the same
workloads under pytest-benchmark (calibration, ``--benchmark-compare``, histograms).
"""

import argparse
import datetime
import functools
import gc
import importlib.util
import itertools
import json
import os
import platform
import statistics
import sys
import textwrap
import time
from tempfile import TemporaryFile

import numpy as np
import torch

from tpool.demo import count_int, positive_int, seed_int as _seed_int
from tpool import _checks
from tpool.backends import resolve_backend

SAMPLE_TARGET_US = 2000.0  # auto calibration: calls per sample so one sample takes about this long
MAX_INNER = 10_000         # at most this many calls per sample
COLD_BYTES = 64 << 20      # bytes written between two cold calls (64 MiB)


def _process_start() -> float:
    """``time.perf_counter()``'s reading when this process started (Linux: /proc), so progress lines count the
    seconds spent importing torch and transformers too; elsewhere the time this module was imported."""
    now = time.perf_counter()
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])   # field 22: clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return now - max(0.0, uptime - started / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return now


_T0 = _process_start()

# The scripts' counts, as the demo's: an int of at least 1 (positive_int) and one that may be 0 (0 skips
# something); a non-int is refused saying what was expected.
non_negative_int = count_int
# The --seed of the scripts that seed torch or numpy with it, as the demos': 0 to 2**64 - 1 (torch.manual_seed's
# range; numpy refuses a negative seed), else a usage error.
seed_int = _seed_int


def int_at_most(limit: int, why: str):
    """argparse type of a count from 1 to ``limit`` (``why``: what the limit comes from, said in the error)."""
    def parse(text):
        v = positive_int(text)
        if v > limit:
            raise argparse.ArgumentTypeError(f"at most {limit} ({why}), got {text}")
        return v
    return parse


def multiple_of(m: int, why: str):
    """argparse type of a positive count that is a multiple of ``m`` (``why``: the reason, said in the error)."""
    def parse(text):
        v = positive_int(text)
        if v % m:
            raise argparse.ArgumentTypeError(f"must be a multiple of {m} ({why}), got {text}")
        return v
    return parse


def _why_unwritable(d: str):
    """Why no file can be made in directory ``d`` (None: one can). Found by making one: as root,
    ``os.access`` says yes even on a read-only file system."""
    if not os.path.isdir(d):
        return f"{d} is not a directory" if os.path.exists(d) else f"directory {d} does not exist"
    try:
        with TemporaryFile(dir=d):
            pass
    except OSError as e:
        return f"directory {d} is not writable (making a file in it: {e.strerror})"
    return None


def out_path(text: str) -> str:
    """argparse type of an output file (``--json``, ``--plot``): its directory must exist and be writable,
    so a bad path is a usage error at once, not a crash after the whole run ("": no file)."""
    if text:
        if os.path.isdir(text):
            raise argparse.ArgumentTypeError(f"expected a file path, got the directory {text}")
        why = _why_unwritable(os.path.dirname(os.path.abspath(text)))
        if why:
            raise argparse.ArgumentTypeError(f"cannot write {text}: {why}")
    return text


def writable_dir(text: str) -> str:
    """argparse type of a directory the run writes into, made if missing: it, or else the nearest directory
    above it that exists, must be a writable directory ("": none)."""
    if text:
        d = os.path.abspath(text)
        while not os.path.exists(d):
            d = os.path.dirname(d)
        why = _why_unwritable(d)
        if why:
            raise argparse.ArgumentTypeError(f"cannot write into {text}: {why}")
    return text


def check_backends(ap: argparse.ArgumentParser, option: str, names, device) -> None:
    """A usage error naming ``option`` unless tpool runs a pool on ``device`` with each of ``names``
    (a backend name from ``tpool.backends.BACKENDS`` or ``auto``, that device's, installed)."""
    for name in names:
        try:
            resolve_backend(name, torch.device(device))
        except (ValueError, ImportError) as e:
            ap.error(f"argument {option}: {str(e).removeprefix('backend: ')}")


def need_transformers(ap: argparse.ArgumentParser) -> None:
    """A usage error when transformers (the ``hf`` extra) is not installed: the scripts that serve a model
    import it when a run starts, so that ``--help`` works without it."""
    if importlib.util.find_spec("transformers") is None:
        ap.error("needs transformers, which is not installed: pip install -e '.[hf]'")


def serving_hf():
    """``tpool.serving.hf`` (it imports transformers), imported when a run starts, after
    :func:`need_transformers`: ``--help`` and usage errors work without transformers."""
    from tpool.serving import hf
    return hf


def in_turns(samples: list, n: int, block: int = 1) -> list[list]:
    """The first ``n`` items of each iterator in ``samples`` (a tpool loop and its baseline, say), drawn in
    turns of ``block`` items each, so that a busy stretch of a shared machine falls on every one alike; then
    each iterator is run to its end (where a loop checks its pool). One list per iterator."""
    out = [[] for _ in samples]
    for start in range(0, n, block):
        for it, got in zip(samples, out):
            got.extend(itertools.islice(it, min(block, n - start)))
    for it in samples:
        for _ in it:
            pass
    return out


def check_model(ap: argparse.ArgumentParser, a) -> None:
    """Usage errors for a random Llama (``a.hidden``, ``a.heads``, ``a.kv_heads``, ``a.vocab``) its config
    refuses or its forward fails on: --heads must divide --hidden into an even head size (rotary embeddings
    rotate halves), --kv-heads divide --heads; and --vocab hold a token besides 0 (padding)."""
    hidden, heads, kv_heads = a.hidden, a.heads, a.kv_heads
    if hidden % heads:
        ap.error(f"argument --heads: expected a divisor of --hidden ({hidden}), got {heads}")
    if (hidden // heads) % 2:
        ap.error(f"argument --heads: expected the head size --hidden / --heads to be even (rotary embeddings), "
                 f"got {hidden} / {heads} = {hidden // heads}")
    if heads % kv_heads:
        ap.error(f"argument --kv-heads: expected a divisor of --heads ({heads}), got {kv_heads}")
    if a.vocab < 2:
        ap.error(f"argument --vocab: expected at least 2 (tokens are drawn from 1 to --vocab - 1), got {a.vocab}")


# One intra-op thread: timings of small torch ops on a shared machine are otherwise dominated by
# thread-pool wake-ups and by other processes competing for the cores.
torch.set_num_threads(1)


def progress(msg: str) -> None:
    """One line on stderr with the seconds since the process started (stdout keeps the table)."""
    print(f"[{time.perf_counter() - _T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, unless its help says it already or there is none."""

    def _get_help_string(self, action):
        text = action.help or ""
        d = action.default  # by identity: 0 == False, and a default of 0 is worth showing
        if "(default" in text or d is None or d is False or d == "" or d is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)

    def _split_lines(self, text, width):
        """The help wrapped as argparse wraps it, except that an option it names (``--x``) never starts
        a line, where it would read as an option of its own: it stays with the word before it."""
        glued = text.replace(" --", "\xa0--")  # argparse's and textwrap's whitespace is ASCII: not \xa0
        return [line.replace("\xa0", " ") for line in super()._split_lines(glued, width)]


def gc_quiet() -> None:
    """Move every object made so far out of the garbage collector's view (``gc.unfreeze()`` undoes it).

    A host baseline over a pool of 16M pages holds Python lists of 16M ids; each
    full collection would walk them, and that time would land on whichever row
    happened to allocate when it ran.
    """
    gc.collect()
    gc.freeze()


def time_calls_us(fn, n: int, sync=None) -> float:
    """Microseconds for ``n`` calls of ``fn`` in a row (``sync`` before and after, for a device)."""
    if sync:
        sync()
    if n == 1:  # a cold sample: the call alone between the two clock reads, no loop (its code is cold too)
        t0 = time.perf_counter_ns()
        fn()
        if sync:
            sync()
        return (time.perf_counter_ns() - t0) / 1e3
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    if sync:
        sync()
    return (time.perf_counter_ns() - t0) / 1e3


def calibrate(fn, *, sync=None, target_us: float = SAMPLE_TARGET_US, reset=None, max_inner: int = MAX_INNER) -> int:
    """Calls per sample so that a sample takes about ``target_us``.

    Three warm-up calls first: the first calls may compile or bind (``table.step``
    binds its inputs on the second call on them), and one slow call measured
    here would give a sample of one call, whose time is then mostly the first
    call after ``reset``. The search runs twice and the larger answer wins.
    """
    for _ in range(3):
        fn()
    best = 1
    for _ in range(2):
        if reset:
            reset()
        n = 1
        while True:
            elapsed = time_calls_us(fn, n, sync)
            if reset:
                reset()
            if elapsed >= target_us / 10 or n >= max_inner:
                break
            n = min(n * 10, max_inner)
        best = max(best, min(max_inner, round(n * target_us / max(elapsed, 1e-3))))
    return best


def sample_us(fn, *, inner: int | None, samples: int, sync=None, reset=None, max_inner: int = MAX_INNER,
              settle: bool = False) -> list:
    """Run ``fn`` ``inner`` times per sample; return per-call microseconds for each sample.

    ``inner=None`` calibrates it (:func:`calibrate`, at most ``max_inner``). ``reset`` (untimed) runs
    before each sample: steps that grow state (a decode step lengthens every
    request) then measure the same workload each sample instead of one that
    drifts as the samples go on; and once more at the end, so the state is left as
    it was found (rows sharing a table then each start from the same workload).
    ``settle`` adds one untimed call after each
    reset: a reset that rewrites a large state leaves the caches and TLB full of
    it, and a table restored under its CSR makes the next step rebuild the CSR;
    settled samples time the steady state alone, whatever the size of the pool.
    """
    if inner is None:
        inner = calibrate(fn, sync=sync, reset=reset, max_inner=max_inner)
    for _ in range(max(1, inner // 4)):  # warm-up (JIT compile, caches)
        fn()
    out = []
    for _ in range(samples):
        if reset:
            reset()
        if settle:
            fn()
        out.append(time_calls_us(fn, inner, sync) / inner)
    if reset:
        reset()
    return out


class CacheFlusher:
    """Writes ``nbytes`` of a numpy buffer: the CPU caches are cold after a call (as after a forward pass)."""

    def __init__(self, nbytes: int = COLD_BYTES):
        self.buf = np.zeros(max(1, nbytes // 8), dtype=np.int64)
        self.value = 0

    def __call__(self) -> None:
        self.value += 1
        self.buf.fill(self.value)


def size_text(nbytes: int) -> str:
    """A byte count for a title: "64 MiB" when it is a whole number of MiB, else the bytes ("1,000,000 bytes"),
    never a count rounded down to "0 MiB"."""
    return f"{nbytes >> 20} MiB" if nbytes and nbytes % (1 << 20) == 0 else f"{nbytes:,} bytes"


def sample_cold_us(fn, *, samples: int, flush: CacheFlusher, sync=None, reset=None, settle: bool = False) -> list:
    """Time ``fn`` once per sample, right after ``flush`` (untimed); microseconds per call.

    ``reset`` (untimed) runs once, before the first sample, and again at the end:
    not before each sample, because restoring a large state right before a timed
    call slows that call even after the flush (a 16M-page pool's state is ~1 GB:
    restored before each sample, a decode step measured 38 µs cold instead of 15),
    and a serving loop never rewrites its state between two steps. The samples
    then drift a little (a decode step adds a token per call), as a loop does.
    ``settle``: one untimed call before the flush of each sample, so the timed
    call is a steady-state call (for a decode step: one that grows the CSR the
    previous step left, not one that rebuilds it) that finds the caches cold.
    """
    fn()  # compile
    if reset:
        reset()
    out = []
    for _ in range(samples):
        if settle:
            fn()
        flush()
        out.append(time_calls_us(fn, 1, sync))
    if reset:
        reset()
    return out


def quantiles(xs: list) -> tuple:
    """(median, p20, p80) of ``xs``."""
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=10, method="inclusive")
    return statistics.median(xs), q[1], q[7]


def ratio_text(x) -> str:
    """A ratio for a table: two decimals ("1.50x"), or two significant digits below 0.01 ("0.0042x": a slow
    row, the reference backend's, would read "0.00x", which says nothing); "" for None (no ratio)."""
    return "" if x is None else f"{x:.2f}x" if x >= 0.01 else f"{x:.2g}x"


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_arg(value: str) -> str:
    """An argparse type for ``--device``: the value as given, once tpool would take it (a cpu or cuda
    device, CUDA available for a cuda one), else a usage error saying why (not a traceback later)."""
    try:
        _checks.resolve_device(value, "--device")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--device: ")) from None
    return value


def sync_of(device: torch.device):
    """What waits for ``device``'s work before a clock is read (None on a CPU): that device's, not the current one's."""
    return functools.partial(torch.cuda.synchronize, device) if device.type == "cuda" else None


class Distinct(argparse.Action):
    """A list option's values, each once, in the order given (``--sizes 1 1`` is ``--sizes 1``): a value
    given twice would run its rows twice, and the later rows' baselines would set the earlier rows' ratios."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, list(dict.fromkeys(values)))


def device_timed_benchmark():
    """A ``benchmark`` fixture for a pytest-benchmark suite's module (``benchmark = device_timed_benchmark()``):
    pytest-benchmark's, whose clock on CUDA waits for the device's work before each read
    (:func:`device_clock`), so the suite times what its calls do on the GPU, as the scripts' samples do. Not
    for a suite that times host work alone (``test_bench_scheduler.py``: the mirror never waits for the
    device, and its script reads the clock without a sync). A fixture of the module, not a ``conftest.py``:
    the tests import helpers from ``tests/conftest.py`` by that module name, which a second conftest would
    take over when both folders are collected in one run."""
    import pytest

    @pytest.fixture
    def benchmark(benchmark):
        device_clock(benchmark, torch.device(default_device()))
        return benchmark
    return benchmark


def device_clock(benchmark, device: torch.device) -> None:
    """On CUDA, make pytest-benchmark's ``benchmark`` fixture read its clock after waiting for ``device``'s
    work, so a round of calls times the work they launched, as :func:`time_calls_us` does, not only their
    launches (a round's calls run between two reads of its clock). Nothing on a CPU: there a call's work is
    done when it returns. pytest-benchmark keeps its clock in the fixture's ``_timer`` (its own option,
    ``--benchmark-timer``, takes only a dotted name, and a synchronize needs the device)."""
    sync = sync_of(device)
    if sync is None:
        return
    clock = benchmark._timer

    def synced():
        sync()
        return clock()
    benchmark._timer = synced


def _cache_sizes() -> dict:
    sizes = {}
    for level in ("LEVEL2_CACHE_SIZE", "LEVEL3_CACHE_SIZE"):
        try:
            sizes[level.split("_")[0].lower()] = os.sysconf(f"SC_{level}")
        except (ValueError, OSError):
            pass
    return sizes


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    versions = {}
    for name in ("numba", "triton"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    return {"cpu": cpu, "cores": os.cpu_count(), "caches": _cache_sizes(), "gpu": gpu,
            "python": platform.python_version(), "torch": torch.__version__, **versions,
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def print_table(title: str, header: list, rows: list, note: str = "") -> None:
    """``title``, the header and the rows right-aligned in columns, then ``note`` (what the baselines are)."""
    widths = [max([len(str(h))] + [len(str(r[i])) for r in rows]) for i, h in enumerate(header)]  # (rows may be [])
    print(f"\n{title}")
    print("  ".join(str(h).rjust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(str(v).rjust(w) for v, w in zip(r, widths)))
    if note:
        print(textwrap.fill(note, 110))


def write_json(path: str, name: str, rows: list) -> None:
    if not path:
        return
    with open(path, "w") as f:
        json.dump({"benchmark": name, "machine": machine(), "rows": rows}, f, indent=2)
    print(f"\nwrote {path}")


def parse_args_for_plot(ap: argparse.ArgumentParser, argv):
    """``ap.parse_args(argv)``, refusing ``--plot`` at once (not after the run) when matplotlib,
    the ``bench`` extra, is not installed."""
    args = ap.parse_args(argv)
    if getattr(args, "plot", "") and importlib.util.find_spec("matplotlib") is None:
        ap.error(f"--plot {args.plot}: needs matplotlib, which is not installed: pip install -e \".[bench]\"")
    return args


def plot_lines(path: str, series: dict, *, title: str, xlabel: str, ylabel: str = "µs per call",
               logx: bool = True, logy: bool = True) -> None:
    """One line per series with a p20-p80 band: ``series[name] = [(x, median, p20, p80), ...]``;
    a series named "X, cold" is dashed, in the colour of "X, warm".

    Writes a PNG at ``path`` (matplotlib, the ``bench`` extra: ``pip install -e ".[bench]"``).
    """
    if not path:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5), dpi=120)
    # A series named "X, cold" is drawn dashed in the colour of "X, warm" (or "X").
    bases = list(dict.fromkeys(n.removesuffix(", cold").removesuffix(", warm") for n in series))
    colors = plt.get_cmap("tab10" if len(bases) <= 10 else "tab20")
    for name, points in series.items():
        base = name.removesuffix(", cold").removesuffix(", warm")
        color = colors(bases.index(base) % colors.N)
        points = sorted(points)
        xs, med, lo, hi = (np.array(v, dtype=float) for v in zip(*points))
        style = "--" if name.endswith(", cold") else "-"
        ax.plot(xs, med, style, marker="o", color=color, label=name)
        ax.fill_between(xs, lo, hi, color=color, alpha=0.15)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"\nwrote {path}")
