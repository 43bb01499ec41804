"""triton is optional: the numba (CPU) path runs without it, and does not import it when it is there.

Each test runs a fresh interpreter (what a process has imported is the point). The
first blocks ``import triton`` with a ``sys.meta_path`` finder, as on a machine
without triton wheels; the second lets triton be found and checks that only the
first Triton use loads it, and that the Triton kernels then work.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import HAS_TRITON

# A pool and a table on `backend`, through every call; returns every result as lists.
WORKLOAD = textwrap.dedent("""
    import contextlib

    import torch
    import tpool
    from tpool.testing import no_host_sync

    def i32(v):
        return torch.tensor(v, dtype=torch.int32)

    def workload(backend, guard=True):
        pool = tpool.PagePool(64, 4, device="cpu", backend=backend)
        table = tpool.PageTable(pool, max_requests=6, max_pages_per_request=8)
        seen = []
        with no_host_sync() if guard else contextlib.nullcontext():  # (the guard imports torch._dynamo,
            a = pool.alloc(i32([2, 3]))
            pages = a.pages.clone()                                    # which imports triton if it can)
            pool.incref(pages[:1])
            pool.touch(pages[:3])
            pool.free(pages[:5], cache=True)
            pool.free(pages[:1])
            ex = table.extend(i32([0, 1]), i32([6, 3]), max_tokens=16)
            st = table.step(i32([0, 1]), i32([1, 1]))
            fk = table.fork(i32([0]), i32([2]), i32([5]))
            table.release(i32([1]), cache=True)
            table.truncate(i32([2]), i32([2]))
            csr = table.flashinfer_csr(i32([0, 2]))
            ev = pool.evict(4)
        for t in (a.pages, a.indptr, a.ok, *ex, st.slots, st.ok, *st.csr, *fk, *csr, ev,
                  table.block_table_rows(i32([0, 2]))):
            seen.append(t.tolist())
        table.check_invariants()
        return seen, pool.stats()
""")

BLOCKED = WORKLOAD + textwrap.dedent("""
    import sys

    class NoTriton:  # a platform without triton: every import of it fails
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ImportError(f"blocked by the test: {name}")
            return None

    sys.meta_path.insert(0, NoTriton())
    assert workload("numba") == workload("reference") == workload("auto")
    from tpool import demo
    lines = []
    demo.run(requests=12, batch=4, num_pages=300, every=50, out=lambda s, **_: lines.append(s))
    assert lines[-1].endswith("no errors, invariants hold"), lines[-1]
    for ask in (dict(backend="triton"), dict(backend="auto", env="triton")):
        if "env" in ask:
            import os
            os.environ["TPOOL_BACKEND"] = ask.pop("env")
        try:
            tpool.PagePool(8, device="cpu", **ask)
        except ImportError as e:
            assert "pip install 'triton>=3.0'" in str(e), e
        else:
            raise AssertionError(f"{ask}: no ImportError without triton")
    from tpool.kernels import _triton_shim, touch
    assert not _triton_shim.available() and not _triton_shim.loaded()
    kernels = [v for v in vars(touch).values() if isinstance(v, _triton_shim.LazyKernel)]
    assert kernels
    try:
        kernels[0][(1,)]
    except ImportError as e:
        assert "pip install 'triton>=3.0'" in str(e), e
    else:
        raise AssertionError("a Triton launch without triton did not raise ImportError")
    assert not any(m == "triton" or m.startswith("triton.") for m in sys.modules), "triton was imported"
    print("numba path ran without triton")
""")

LAZY = WORKLOAD + textwrap.dedent("""
    import sys
    from tpool.kernels import _triton_shim, _triton_util, touch

    numba_run = workload("numba", guard=False)
    assert "triton" not in sys.modules, "the numba path imported triton"
    assert not _triton_shim.loaded()
    stale = [v for v in vars(touch).values() if isinstance(v, _triton_shim.LazyKernel)]
    assert numba_run == workload("triton") == workload("reference")
    assert _triton_shim.loaded() and "triton" in sys.modules
    import triton, triton.language as tl
    from triton.runtime.jit import JITFunction, KernelInterface

    # every kernel module now holds only real triton objects; constexpr parameters are seen as such
    for name, module in list(sys.modules.items()):
        if name.startswith("tpool.kernels."):
            for attr, value in vars(module).items():
                assert not isinstance(value, (_triton_shim.Constexpr, _triton_shim.LazyKernel)), (name, attr)
    assert _triton_util.triton is triton and _triton_util.tl is tl
    assert isinstance(_triton_util.NULL_PAGE, tl.constexpr) and _triton_util.NULL_PAGE.value == -1
    assert isinstance(_triton_util.count_pages, KernelInterface)  # an InterpretedFunction under TRITON_INTERPRET
    params = JITFunction(_triton_util.count_pages.fn).params
    assert [p.name for p in params if p.is_constexpr] == ["BLOCK", "LAST"]
    # a reference taken before the load launches the real kernel
    assert stale and all(type(k[(1,)]) is type(_triton_shim._real[k][(1,)]) for k in stale)
    print("triton loaded at its first use")
""")


def _run(script, **env):
    env = dict(os.environ, **env)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_the_numba_path_runs_without_triton_installed():
    env = {k: v for k, v in os.environ.items() if k not in ("TPOOL_BACKEND", "TRITON_INTERPRET")}
    proc = subprocess.run([sys.executable, "-c", BLOCKED], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "numba path ran without triton" in proc.stdout


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_is_imported_at_its_first_use_and_then_works():
    assert "triton loaded at its first use" in _run(LAZY, TRITON_INTERPRET="1")
