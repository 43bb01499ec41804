"""Start-up: a second process loads the compiled kernels from numba's disk cache instead of compiling them.

Each test runs fresh interpreters (a process's first calls are the point) on the
numba path: a pool, its first alloc, a table and its first step, a HostMirror's first
decode (its accounting is compiled by numba too). The first
process compiles and writes the cache; the second must load every kernel it
uses from it (numba's per-dispatcher ``stats``: hits, no misses) and compute
the same results. Where the cache goes is numba's choice, which tpool's
locators keep (``tpool.backends.numba``): ``NUMBA_CACHE_DIR`` when set, else
``__pycache__`` beside the code, else a per-user directory when the package
directory is read-only (an installed wheel in a system site-packages), else
nowhere: each process compiles (said once on stderr).
Timings are never asserted (``benchmarks/bench_startup.py`` measures them).
"""

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

FIRST_STEP = textwrap.dedent("""
    import gc, json, sys
    touched = []  # tpool leaves the collector alone (tpool._startup): a pause only moved its work later
    for name in ("disable", "freeze", "set_threshold"):
        setattr(gc, name, lambda *a, f=getattr(gc, name), n=name: (touched.append(n), f(*a))[1])
    import torch
    import tpool
    from tpool.backends import numba as nb
    from tpool.kernels import release

    i32 = lambda v: torch.tensor(v, dtype=torch.int32)
    pool = tpool.PagePool(256, 16, device="cpu", backend="numba")
    a = pool.alloc(i32([2, 3]))
    table = tpool.PageTable(pool, max_requests=4, max_pages_per_request=8)
    s = table.step(i32([0, 1]), i32([20, 3]))
    table.release(i32([0]))
    from tpool.scheduling import HostMirror, _decode
    mirror = HostMirror(tpool.PageTable(pool, 2, 4), free=pool.available(), cached=0)
    mirror.decode(mirror.admit([5]))
    used = {"alloc_guarded": nb.alloc_guarded, "step_guarded": nb.step_guarded,
            "release": nb.kernel(release.release_numba_entry), "decode_accounting": _decode.decode_accounting}
    print(json.dumps(dict(
        file=tpool.__file__,
        triton="triton" in sys.modules,
        gc=gc.isenabled() and not touched,
        results=[a.pages.tolist(), a.indptr.tolist(), s.slots.tolist(), [t.tolist() for t in s.csr],
                 pool.stats(), [mirror.free, mirror.reserved]],
        stats={k: dict(path=d.stats.cache_path, hits=sum(d.stats.cache_hits.values()),
                       misses=sum(d.stats.cache_misses.values())) for k, d in used.items()})))
""")


def _first_step(env_changes, cwd=None):
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "TRITON_INTERPRET", "TPOOL_BACKEND")}
    env.update(env_changes)
    proc = subprocess.run([sys.executable, "-c", FIRST_STEP], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]), stderr=proc.stderr)


def _cold_then_warm(env, cwd=None):
    """Two processes in a row: the first compiles (misses), the second loads everything (hits)."""
    cold, warm = _first_step(env, cwd), _first_step(env, cwd)
    assert all(s["misses"] == 1 and s["hits"] == 0 for s in cold["stats"].values()), cold["stats"]
    assert all(s["misses"] == 0 and s["hits"] == 1 for s in warm["stats"].values()), warm["stats"]
    assert warm["results"] == cold["results"] and not warm["triton"]
    assert cold["gc"] and warm["gc"]  # tpool's imports, compiles and loads never paused the collector
    # the compiling process says so once, naming the cache; a process that only loads says nothing
    notices = [ln for ln in cold["stderr"].splitlines() if ln.startswith("tpool: compiling numba kernels")]
    assert len(notices) == 1 and notices[0].endswith(cold["stats"]["step_guarded"]["path"]), cold["stderr"]
    assert "tpool: compiling" not in warm["stderr"], warm["stderr"]
    return warm


def _cache_files(directory):
    return [os.path.join(d, f) for d, _, fs in os.walk(directory) for f in fs if f.endswith((".nbi", ".nbc"))]


def test_a_second_process_loads_the_kernels_from_numba_cache_dir(tmp_path):
    warm = _cold_then_warm({"NUMBA_CACHE_DIR": str(tmp_path)})
    assert all(s["path"].startswith(str(tmp_path)) for s in warm["stats"].values())
    assert {os.path.basename(p).split("-")[0] for p in _cache_files(tmp_path)} >= {
        "numba.alloc_guarded", "numba.step_guarded", "release.release_numba_entry", "_decode.decode_accounting"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """tpool built as a wheel and installed (not editable) into a fresh directory."""
    pytest.importorskip("setuptools")  # --no-build-isolation builds with the installed setuptools
    base = tmp_path_factory.mktemp("wheel")
    run = dict(check=True, capture_output=True, timeout=600)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", ROOT,
                    "-w", str(base / "dist")], **run)
    (wheel,) = (base / "dist").glob("tpool-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(base / "site"),
                    str(wheel)], **run)
    return base / "site"


def test_an_installed_wheel_caches_beside_its_kernels(installed, tmp_path):
    warm = _cold_then_warm({"PYTHONPATH": str(installed), "XDG_CACHE_HOME": str(tmp_path / "user")}, cwd=tmp_path)
    assert warm["file"] == str(installed / "tpool" / "__init__.py")
    paths = {k: s["path"] for k, s in warm["stats"].items()}
    assert paths["release"] == str(installed / "tpool" / "kernels" / "__pycache__")
    assert paths["alloc_guarded"] == str(installed / "tpool" / "backends" / "__pycache__")
    assert paths["decode_accounting"] == str(installed / "tpool" / "scheduling" / "__pycache__")
    assert not _cache_files(tmp_path / "user")


@contextlib.contextmanager
def _read_only(directories):
    """The directories refuse writes: mode 555, and for root (who writes anyway) the immutable attribute."""
    root = hasattr(os, "geteuid") and os.geteuid() == 0
    for d in directories:
        os.chmod(d, 0o555)
        if root:
            subprocess.run(["chattr", "+i", str(d)], capture_output=True)
    try:
        probe = directories[0] / "probe"
        try:
            probe.write_text("")
        except OSError:
            pass
        else:
            probe.unlink()
            pytest.skip("cannot make a directory read-only here (root without chattr)")
        yield
    finally:
        for d in directories:
            if root:
                subprocess.run(["chattr", "-i", str(d)], capture_output=True)
            os.chmod(d, 0o755)


def _compiled_dirs(installed):
    """The installed package's folders of compiled modules and their ``__pycache__`` (emptied of cache
    entries an earlier test wrote there, which would be found): what a read-only install keeps fixed."""
    package = installed / "tpool"
    subs = [package / sub for sub in ("kernels", "backends", "scheduling")]
    caches = [sub / "__pycache__" for sub in subs]
    for d in caches:
        d.mkdir(exist_ok=True)
        for f in _cache_files(d):
            os.remove(f)
    return [*caches, *subs]


def test_a_read_only_installed_wheel_caches_per_user(installed, tmp_path):
    with _read_only(_compiled_dirs(installed)):
        user = tmp_path / "user"
        warm = _cold_then_warm({"PYTHONPATH": str(installed), "XDG_CACHE_HOME": str(user)}, cwd=tmp_path)
        assert all(s["path"].startswith(str(user)) for s in warm["stats"].values()), warm["stats"]
        assert _cache_files(user)


def test_with_no_writable_cache_location_the_kernels_compile_uncached(installed, tmp_path):
    """A read-only package directory and an unwritable user cache directory (a read-only root file
    system, as in many containers): numba found no cache location and refused to decorate, so even
    ``import tpool.scheduling`` failed. Each process compiles instead, said once on stderr."""
    (tmp_path / "a-file").write_text("")
    env = {"PYTHONPATH": str(installed), "XDG_CACHE_HOME": str(tmp_path / "a-file" / "cache")}
    dirs = _compiled_dirs(installed)
    with _read_only(dirs):
        runs = [_first_step(env, cwd=tmp_path) for _ in range(2)]
    for run in runs:
        assert all(s["misses"] == 1 and s["hits"] == 0 and s["path"] is None for s in run["stats"].values())
        notices = [ln for ln in run["stderr"].splitlines() if ln.startswith("tpool: no writable place to cache")]
        assert len(notices) == 1 and "set NUMBA_CACHE_DIR" in notices[0], run["stderr"]
    assert runs[0]["results"] == runs[1]["results"]
    assert not [f for d in dirs for f in _cache_files(d)] and not _cache_files(tmp_path)


def test_the_startup_benchmark_prints_its_table(tmp_path, capsys):
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_startup", os.path.join(ROOT, "benchmarks", "bench_startup.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "startup.json"
    bench.main(["--runs", "1", "--cold", "0", "--num-pages", "256", "--cache-dir", str(tmp_path / "cache"),
                "--json", str(out)])
    captured = capsys.readouterr()
    assert "launch to first step" in captured.out and "median" in captured.out and "vs torch" in captured.out
    assert " s] warm run 1/1" in captured.err
    rows = json.loads(out.read_text())["rows"]
    assert {r["cache"] for r in rows} == {"torch only", "warm"}
    (ratio,) = [r["vs_torch_import"] for r in rows if r["phase"] == "launch to first step"]
    assert ratio > 0


def _module(path, source):
    """``source`` run as a module from the file ``path`` (its numba cache sits beside it), kept out of
    ``sys.modules``."""
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_function_of_another_module_cached_through_tpool_carries_the_kernels_stamp(tmp_path):
    """numba's cache checks only a function's own file. A probe outside ``tpool.kernels`` compiled
    through ``cached_njit`` (``cold_breakdown.py``'s, through ``entry_point``) compiles in tpool's
    helpers and layout constants: its entries carry the kernels' stamp too, or a layout change loads
    machine code built on the old offsets (cold_breakdown.py crashed so after the pool gained a state
    tensor). A kernel module's function keeps the kernels' stamp alone."""
    from tpool.backends import numba as nb
    from tpool.kernels import alloc
    probe_mod = _module(tmp_path / "probe_mod.py", "from tpool.kernels import layout as L\n\n\n"
                                                   "def probe(x):\n    return x + L.STATE_DESC_LEN\n")
    probe = nb.cached_njit(probe_mod.probe)
    stamp = probe._cache._impl.locator.get_source_stamp()
    assert stamp[0] == nb.kernels_stamp() and stamp[1]  # and the probe's own file's stamp
    assert nb.kernel(alloc.alloc_numba_entry)._cache._impl.locator.get_source_stamp() == nb.kernels_stamp()


def test_a_plain_numba_function_of_another_module_keeps_numbas_own_cache(tmp_path):
    """tpool's locators take tpool's kernels and what goes through ``cached_njit`` only: a user's
    ``numba.njit(cache=True)`` function in its own module keeps numba's locator and stamp (its cache
    is not invalidated by every change to tpool's kernels)."""
    import numba

    from tpool.backends import numba as nb
    user_mod = _module(tmp_path / "user_mod.py", "def twice(x):\n    return 2 * x\n")
    locator = numba.njit(cache=True)(user_mod.twice)._cache._impl.locator
    assert not type(locator).__name__.startswith("Kernel"), type(locator)
    stamp = locator.get_source_stamp()
    assert not isinstance(stamp, tuple) and stamp != nb.kernels_stamp(), stamp  # numba's: its file's alone


@pytest.fixture
def stamp_sources(tmp_path, monkeypatch):
    """Copies of the kernel modules and of ``tpool/backends/numba.py`` that :func:`kernels_stamp` reads
    instead; its memo is cleared before and after (the next call stamps the real sources again)."""
    from tpool.backends import numba as nb
    kernels = tmp_path / "kernels"
    shutil.copytree(nb._KERNELS_DIR, kernels, ignore=shutil.ignore_patterns("__pycache__"))
    backend = tmp_path / "numba.py"
    shutil.copy(nb.__file__, backend)
    monkeypatch.setattr(nb, "_KERNELS_DIR", str(kernels))
    monkeypatch.setattr(nb, "__file__", str(backend))
    nb.kernels_stamp.cache_clear()
    yield kernels, backend
    nb.kernels_stamp.cache_clear()


@pytest.mark.parametrize("edited", ["a kernel module", "the numba backend"])
def test_the_kernels_stamp_changes_with_every_kernel_module_and_the_numba_backend(stamp_sources, edited):
    """The numba backend compiles its guards and calls in itself (``alloc_guarded`` ...): an edit to it,
    as to any kernel module, must recompile every cached entry, or a process loads stale machine code."""
    from tpool.backends import numba as nb
    kernels, backend = stamp_sources
    before = nb.kernels_stamp()
    path = kernels / "_numba_util.py" if edited == "a kernel module" else backend
    path.write_text(path.read_text() + "\n# edited\n")
    nb.kernels_stamp.cache_clear()
    assert nb.kernels_stamp() != before


def test_cached_njit_compiles_uncached_only_where_numba_finds_no_cache_location(monkeypatch, capsys):
    """numba's "no locator available" means nowhere writable to cache: the function compiles uncached,
    said once. Any other error making the cache is raised, not taken for that."""
    from tpool.backends import numba as nb
    said = []
    monkeypatch.setattr(nb, "announce_no_cache", lambda: said.append(1))

    def fails(message):
        def make(py_func):
            raise RuntimeError(message)
        return make

    monkeypatch.setattr(nb, "KernelCache", fails("cannot cache function 'f': no locator available for file 'f.py'"))
    f = nb.cached_njit(lambda x: x + 1)
    assert f(1) == 2 and f._cache.__class__.__name__ == "NullCache" and said == [1]
    monkeypatch.setattr(nb, "KernelCache", fails("disk full"))
    with pytest.raises(RuntimeError, match="disk full"):
        nb.cached_njit(lambda x: x + 1)


def test_a_cache_miss_names_its_kernel_by_name(monkeypatch):
    """A kernel cache's miss announces the function's name, not numba's repr of it (with an address)."""
    import tpool.backends.numba as nb
    from tpool.kernels import alloc
    heard = []
    cache = nb.kernel(alloc.alloc_numba_entry)._cache
    monkeypatch.setattr(cache, "_load_overload", lambda sig, ctx: None)  # a miss
    monkeypatch.setattr(nb, "announce_compile", lambda path, name: heard.append((path, name)))
    from numba.core.registry import cpu_target
    assert cache.load_overload(None, cpu_target.target_context) is None
    assert heard == [(cache.cache_path, "alloc_numba_entry")]


def _compile_lines(monkeypatch, caplog, steps, name="k"):
    """``announce_compile`` of kernel ``name`` (or one name per call) at a fake clock: 100 s, then each of
    ``steps`` seconds later. Returns whether each call said a line, and the lines said."""
    from tpool import _startup
    caplog.set_level("INFO", logger="tpool")   # (under pytest the lines go to the logger, which has handlers)
    clock = [100.0]
    monkeypatch.setattr(_startup, "_compile_announced", None)
    monkeypatch.setattr(_startup.time, "perf_counter", lambda: clock[0])
    said = []
    names = [name] * (len(steps) + 1) if isinstance(name, str) else name
    for step, kernel in zip([0.0, *steps], names):
        clock[0] += step
        before = len(caplog.records)
        _startup.announce_compile("/cache", kernel)
        said.append(len(caplog.records) > before)
    return said, [r.getMessage() for r in caplog.records if r.name == "tpool"]


def test_a_chain_of_compiles_is_named_when_the_last_line_is_old(monkeypatch, caplog):
    """The whole notice at a process's first compile; a compile within ``_STILL_AFTER_S`` of the last
    line says nothing; a later one names its kernel (a benchmark's first run of a new call compiled
    for 16 s without a word)."""
    from tpool import _startup
    _, lines = _compile_lines(monkeypatch, caplog, [1.0, _startup._STILL_AFTER_S + 0.5],
                              ["alloc_numba_entry", "free_numba_entry", "step_release_bound_numba_entry"])
    assert len(lines) == 2 and lines[0].startswith("tpool: compiling numba kernels") and lines[0].endswith("/cache")
    assert lines[1] == "tpool: still compiling numba kernels (step_release_bound_numba_entry, not cached yet)"


# --- Pinned by helper-150's mutation run over tpool/_startup.py ---------------------------------------------

def test_a_compile_is_named_only_when_the_last_line_is_more_than_still_after_s_old(monkeypatch, caplog):
    """Exactly ``_STILL_AFTER_S`` after the last line is not "more than": silent; ten seconds is (a chain of
    compiles is never silent for tens of seconds)."""
    from tpool import _startup
    said, _ = _compile_lines(monkeypatch, caplog, [_startup._STILL_AFTER_S])
    assert said == [True, False]
    said, _ = _compile_lines(monkeypatch, caplog, [10.0])
    assert said == [True, True]


def test_the_clock_restarts_at_each_still_compiling_line(monkeypatch, caplog):
    """A "still compiling" line is the last line said: the next compile within ``_STILL_AFTER_S`` of it is
    silent, though the first notice is older."""
    from tpool import _startup
    gap = _startup._STILL_AFTER_S
    said, lines = _compile_lines(monkeypatch, caplog, [gap + 1, gap - 1, 2.5, gap])
    assert said == [True, True, False, True, False]
    assert lines[1:] == ["tpool: still compiling numba kernels (k, not cached yet)"] * 2


def test_a_compile_without_a_name_is_another(monkeypatch, caplog):
    from tpool import _startup
    _, lines = _compile_lines(monkeypatch, caplog, [_startup._STILL_AFTER_S + 1], name="")
    assert lines[-1] == "tpool: still compiling numba kernels (another, not cached yet)"


def test_no_cache_is_said_once_a_process_naming_numba_cache_dir(monkeypatch, caplog):
    """``cached_njit`` calls it for every kernel it decorates: one line, whatever the count."""
    from tpool import _startup
    caplog.set_level("INFO", logger="tpool")
    monkeypatch.setattr(_startup, "_no_cache_announced", False)
    for _ in range(3):
        _startup.announce_no_cache()
    lines = [r.getMessage() for r in caplog.records if r.name == "tpool"]
    assert len(lines) == 1 and lines[0].startswith("tpool: no writable place to cache numba kernels"), lines
    assert "set NUMBA_CACHE_DIR to a writable directory" in lines[0]


def test_without_logging_configured_the_notice_goes_to_stderr():
    code = "from tpool import _startup; _startup.announce_compile('/the/cache', 'k')"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr.startswith("tpool: compiling numba kernels") and r.stderr.rstrip().endswith("/the/cache")


def test_with_stderr_closed_the_notice_goes_nowhere_not_to_stdout():
    """``tpool demo 2>&-``: Python's ``sys.stderr`` is None, and ``print(file=None)`` writes to stdout, so
    the compile notice landed among the demo's rows (or a caller's own output)."""
    code = ("from tpool import _startup; _startup.announce_compile('/the/cache', 'k'); "
            "_startup.announce_no_cache(); print('data')")
    r = subprocess.run(f"{sys.executable} -c \"{code}\" 2>&-", shell=True, cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout == "data\n", r.stdout
