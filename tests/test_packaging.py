"""Packaging basics: the license text, one version, py.typed and the license in the wheel, what the wheel and
the sdist hold."""

import importlib.metadata
import os
import subprocess
import sys
import zipfile

import pytest

import tpool

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_license_is_the_full_apache_2_text():
    text = open(os.path.join(ROOT, "LICENSE")).read()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    for section in ("1. Definitions.", "4. Redistribution.", "9. Accepting Warranty", "END OF TERMS AND CONDITIONS"):
        assert section in text
    assert 'license = "Apache-2.0"' in open(os.path.join(ROOT, "pyproject.toml")).read()


def test_version_is_single_sourced():
    assert tpool.__version__ == importlib.metadata.version("tpool")
    pyproject = open(os.path.join(ROOT, "pyproject.toml")).read()
    assert 'dynamic = ["version"]' in pyproject and 'attr = "tpool._version.__version__"' in pyproject
    assert f"## {tpool.__version__}" in open(os.path.join(ROOT, "CHANGELOG.md")).read()


def test_wheels_are_ignored_by_git():
    assert "*.whl" in open(os.path.join(ROOT, ".gitignore")).read().split()


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory):
    """The file names in the wheel ``pip wheel`` builds from the checkout, and its METADATA."""
    pytest.importorskip("setuptools")  # --no-build-isolation builds with the installed setuptools
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", ROOT, "-w", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("tpool-*.whl")
    with zipfile.ZipFile(wheel) as z:
        return z.namelist(), z.read(f"tpool-{tpool.__version__}.dist-info/METADATA").decode()


def test_wheel_ships_py_typed_license_and_version(wheel_names):
    names, meta = wheel_names
    assert "tpool/py.typed" in names and "tpool/kernels/layout.py" in names
    assert f"tpool-{tpool.__version__}.dist-info/licenses/LICENSE" in names
    assert "License-Expression: Apache-2.0" in meta and f"Version: {tpool.__version__}" in meta
    assert "tpool/kernels/_triton_shim.py" in names
    # triton is optional: required only by the extras that name it (the numba backend runs without it)
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    assert 'triton>=3.0; extra == "triton"' in requires
    assert [r for r in requires if r.startswith("triton")] == ['triton>=3.0; extra == "triton"',
                                                               'triton>=3.0; extra == "dev"']
    assert any(r.startswith("numba") and "extra" not in r for r in requires)


def _sources(folder, prefix):
    """The wheel names of the ``.py`` files under ``folder`` (caches skipped), as installed under ``prefix``."""
    top = os.path.join(ROOT, folder)
    return {prefix + os.path.relpath(os.path.join(d, f), top).replace(os.sep, "/")
            for d, dirs, files in os.walk(top) if "__pycache__" not in d.split(os.sep)
            for f in files if f.endswith(".py")}


def test_wheel_holds_every_module_of_the_source_tree_and_nothing_else(wheel_names):
    """pyproject.toml lists the packages by name: a new subpackage left off that list is missing from the
    wheel, while an editable install (which maps the folder) and so the whole suite still import it. And
    setuptools packs whatever its ``build/lib`` holds: a module removed or renamed after an earlier build in
    the same checkout ships on, stale, beside the new one."""
    names, _ = wheel_names
    shipped = {n for n in names if ".dist-info/" not in n}
    expected = _sources("tpool", "tpool/") | _sources("kernels", "tpool/kernels/") | {"tpool/py.typed"}
    assert not expected - shipped, f"left out of the wheel (a package missing from [tool.setuptools] packages " \
                                   f"in pyproject.toml?): {sorted(expected - shipped)}"
    assert not shipped - expected, f"in the wheel but not in the source tree (stale copies in {ROOT}/build/lib " \
                                   f"from an earlier build? remove build/): {sorted(shipped - expected)}"


def test_sdist_carries_the_whole_test_suite_and_no_cache(tmp_path):
    """setuptools' default sdist took tests/test*.py and nothing else: the test files without the
    conftest.py and helpers they import, nor the benchmarks and changelog they read (MANIFEST.in)."""
    pytest.importorskip("setuptools")
    cache = os.path.join(ROOT, "kernels", "__pycache__")
    planted = os.path.join(cache, "numba.tpool_test_planted-1.py311.nbi")  # as numba leaves in a dev tree
    os.makedirs(cache, exist_ok=True)
    open(planted, "w").close()
    try:
        # run as a script, as a build frontend runs the backend: with `python -c` the root's kernels/ would
        # shadow the hf extra's `kernels`, whose egg_info writer setuptools loads
        script = tmp_path / "build_sdist.py"
        script.write_text("import sys\nfrom setuptools import build_meta\nprint(build_meta.build_sdist(sys.argv[1]))\n")
        run = subprocess.run([sys.executable, str(script), str(tmp_path / "dist")], cwd=ROOT, capture_output=True,
                             text=True, timeout=300)
    finally:
        os.remove(planted)
    assert run.returncode == 0, run.stderr
    import tarfile
    with tarfile.open(tmp_path / "dist" / run.stdout.strip().splitlines()[-1]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    wanted = {f"{folder}/{f}" for folder in ("tests", "benchmarks") for f in os.listdir(os.path.join(ROOT, folder))
              if f.endswith((".py", ".md", ".sh"))}
    wanted |= {"CHANGELOG.md", "LICENSE", "README.md", "pyproject.toml", ".gitignore", "kernels/layout.py"}
    assert not wanted - names, sorted(wanted - names)
    assert not [n for n in names if n.endswith((".pyc", ".nbi", ".nbc")) or "__pycache__" in n]


def test_import_tpool_unshadows_the_kernels_package_transformers_imports(tmp_path):
    """Run from the repository's root, Python finds tpool's ``kernels/`` folder first for a top-level
    ``import kernels``; transformers 5.25+ imports Hugging Face's ``kernels`` distribution under that
    name. After ``import tpool`` the name goes to the installed distribution (here a stand-in)."""
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("from kernels.sub import WHERE\n")
    (site / "kernels" / "sub.py").write_text("WHERE = 'hub'\n")
    info = site / "kernels-9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 9.9\n")
    env = dict(os.environ, PYTHONPATH=str(site))
    env.pop("PYTHONSAFEPATH", None)

    def where(code):  # `python -c` puts the working directory, the repository's root, first on sys.path
        run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 0, run.stderr
        return run.stdout.strip()

    assert where("import kernels; print(getattr(kernels, 'WHERE', 'tpool'))") == "tpool"  # the shadowing
    assert where("import tpool, kernels; print(getattr(kernels, 'WHERE', 'tpool'))") == "hub"
    assert where("import tpool, kernels.sub, tpool.kernels.layout as L; print(kernels.sub.WHERE, L.FREE)") == "hub 0"


def test_a_checkout_imported_without_an_editable_install_finds_its_kernels():
    """After a plain ``pip install .`` (no editable finder maps ``kernels/``), Python started in the
    checkout's root imports the checkout's ``tpool/`` before the installed one: ``import tpool`` (so
    ``python -m tpool demo`` and ``python -m pytest``) failed with ``No module named 'tpool.kernels'``."""
    code = ("import sys\n"
            "sys.meta_path[:] = [f for f in sys.meta_path if not f.__module__.startswith('__editable__')]\n"
            "import tpool, tpool.kernels.layout as L\n"
            "print(tpool.__file__)\nprint(L.__file__)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    root = os.path.realpath(ROOT)
    found = [os.path.realpath(p) for p in run.stdout.splitlines()]
    assert found == [os.path.join(root, "tpool", "__init__.py"), os.path.join(root, "kernels", "layout.py")]


def test_an_installed_or_editable_tpool_keeps_its_path(tmp_path):
    """``map_checkout_kernels`` adds the checkout's root to tpool's path only where nothing else finds
    ``tpool.kernels``: not for an installed package (its own ``kernels/``), nor where an install maps it."""
    from tpool import _hub_kernels
    _package(tmp_path / "kernels", "layout.py", "_numba_util.py")  # a checkout's kernels/ beside tpool/
    (tmp_path / "tpool").mkdir()
    path = [str(tmp_path / "tpool")]
    _hub_kernels.map_checkout_kernels(path)   # this process finds tpool.kernels already (installed or editable)
    assert path == [str(tmp_path / "tpool")]
    (tmp_path / "tpool" / "kernels").mkdir()  # an installed tpool holds its kernels
    _hub_kernels.map_checkout_kernels(path)
    assert path == [str(tmp_path / "tpool")]


def _package(folder, *files):
    folder.mkdir(parents=True)
    for name in ("__init__.py", *files):
        (folder / name).write_text("")
    return folder / "__init__.py"


@pytest.fixture
def finder(monkeypatch):
    """A HubKernelsFinder whose view the test sets in ``seen``: ``origin``, what the path finders would
    load for any top-level name (None: nothing; "namespace": a folder without ``__init__.py``), and
    ``init``, the ``kernels`` distribution's ``__init__.py`` (None: not installed). Only the finder's
    module sees the stand-ins, not the process's imports."""
    import types

    from tpool import _hub_kernels
    seen = {"origin": None, "init": None}

    def path_spec(name, path=None, target=None):
        origin = seen["origin"]
        return None if origin is None else types.SimpleNamespace(origin=None if origin == "namespace" else str(origin))

    def distribution(name):
        if name != "kernels" or seen["init"] is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return types.SimpleNamespace(locate_file=lambda rel: seen["init"].parent.parent / rel)

    monkeypatch.setattr(_hub_kernels, "PathFinder", types.SimpleNamespace(find_spec=path_spec))
    monkeypatch.setattr(_hub_kernels, "distribution", distribution)
    return _hub_kernels.HubKernelsFinder(), seen


def test_the_hub_kernels_finder_takes_a_top_level_kernels_only_from_tpools_folder(finder, tmp_path):
    """It answers for a top-level ``kernels`` that would load tpool's folder, with the installed
    distribution's package (its folder the search path of its submodules); for anything else, None."""
    hub, seen = finder
    tpools = _package(tmp_path / "repo" / "kernels", "layout.py", "_numba_util.py")
    other = _package(tmp_path / "elsewhere" / "kernels", "layout.py")           # one marker only
    installed = _package(tmp_path / "site" / "kernels", "sub.py")
    seen.update(origin=tpools, init=installed)
    spec = hub.find_spec("kernels")
    assert spec.origin == str(installed) and spec.submodule_search_locations == [str(installed.parent)]
    assert hub.find_spec("kernels", path=[str(tmp_path)]) is None                 # a submodule named kernels
    assert hub.find_spec("numpy") is None                                          # whatever its folder holds
    seen.update(origin="namespace")
    assert hub.find_spec("kernels") is None
    seen.update(origin=other)
    assert hub.find_spec("kernels") is None                                        # not tpool's folder
    seen.update(origin=None)
    assert hub.find_spec("kernels") is None                                        # nothing to shadow
    seen.update(origin=tpools, init=None)
    assert hub.find_spec("kernels") is None                                        # no distribution
    seen.update(init=tmp_path / "gone" / "kernels" / "__init__.py")
    assert hub.find_spec("kernels") is None                                        # its files are gone
    seen.update(init=tpools)
    assert hub.find_spec("kernels") is None                                        # the distribution is tpool's


def test_installing_the_hub_kernels_finder_twice_puts_one_first(monkeypatch):
    from tpool import _hub_kernels
    others = [m for m in sys.meta_path if not isinstance(m, _hub_kernels.HubKernelsFinder)]
    monkeypatch.setattr(sys, "meta_path", others)
    rest = list(sys.meta_path)
    _hub_kernels.install()
    _hub_kernels.install()
    assert isinstance(sys.meta_path[0], _hub_kernels.HubKernelsFinder) and sys.meta_path[1:] == rest
