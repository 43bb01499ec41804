"""Shared fixtures. Triton runs under its interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton is imported (kernels are
decorated at import), so it is set here, before any test module loads tpool.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util  # noqa: E402

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests draw the same examples on every run (a CI failure is one a rerun shows again, and no
# example database in .hypothesis/ replays a developer's old failures); `--hypothesis-profile explore`
# draws new ones on every run, to look for bugs on purpose.
settings.register_profile("tpool", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile("tpool")

import tpool  # noqa: E402
from tpool.kernels import _triton_shim  # noqa: E402
from tpool.testing import no_host_sync  # noqa: E402


def _triton_ready() -> bool:
    """Whether triton is installed; if so it is loaded now (the kernel modules import it only at
    first use), so that ``no_host_sync`` finds the interpreter's launcher from the first test on."""
    if importlib.util.find_spec("triton") is None:
        return False
    _triton_shim.load()
    return True


HAS_TRITON = _triton_ready()
HAS_CUDA = torch.cuda.is_available()
# Where the Triton differential tests run: compiled on a GPU, else interpreted on the CPU.
TRITON_DEVICE = ("cuda" if HAS_CUDA else "cpu" if _triton_shim.interpreting() else None) \
    if HAS_TRITON else None
# Triton runs on CPU pools only under its interpreter; on a GPU machine the Triton
# differential tests (test_triton_*.py) run it compiled on CUDA instead.
CPU_BACKENDS = ["reference", "numba"] + (["triton"] if HAS_TRITON and _triton_shim.interpreting() else [])


def i32(values, device="cpu"):
    return torch.tensor(values, dtype=torch.int32, device=device)


def hot_path_calls(backend, device="cpu"):
    """Every hot-path call of a pool and a page table, bound forms, revive and generations included, as
    one repeatable sequence (it ends with the table's rows released): ``(run, pool, table)``. Run it
    once unguarded (the first call of a shape makes its buffers, and compiles), then under a guard:
    ``no_host_sync(host_data=True)`` on a CPU, ``set_sync_debug_mode("error")`` on CUDA. Its inputs are
    made here, so nothing in ``run`` copies a host value to the device."""
    pool = tpool.PagePool(32, 4, device=device, backend=backend)
    table = tpool.PageTable(pool, 4, 8)
    counts, rows = i32([2, 1], device), i32([0, 1, 2], device)
    ids, ntok, prompts, lens, drop = (i32(v, device) for v in ([0, 1], [1, 1], [6, 9], [5, 8], [1, 1]))
    src, dst, flen, row0 = i32([0], device), i32([2], device), i32([4], device), i32([0], device)
    out, evicted = pool.alloc_out(2, 8), torch.empty(2, dtype=torch.int32, device=device)

    def run():
        r = pool.alloc(counts, out=out)
        pool.incref(r.pages[:2])
        pool.touch(r.pages[:2])
        pool.free(r.pages[:2], cache=True)
        pool.free(r.pages[:3], cache=True)
        pool.evict(2)
        pool.evict(2, out=evicted)
        pool.alloc(counts, out=out, evict=True)
        pool.free(out.pages)
        table.extend(ids, prompts, max_tokens=15)
        table.step(ids, ntok)
        table.truncate(ids, lens)
        table.truncate(ids, drop=drop)
        table.fork(src, dst, flen)
        table.flashinfer_csr(ids)
        table.block_table_rows(ids)
        first = table.block_table[0, :1].clone()         # row 0's first page (4 tokens), kept CACHED
        table.release(rows, cache=True)
        table.revive(0, first, 4)                        # a prefix-cache hit
        table.release(row0, cache=True)
        table.revive(0, first, 4, generations=pool.generations(first))
        pool.bind_alloc(counts, out=out)()               # the bound forms: made and called
        pool.bind_free(out.pages)()
        table.bind_step(ids, ntok)()
        bound = table.bind_step(batch=2, release=1)
        bound()
        table.release(rows)

    return run, pool, table


def same_table_state(a, b):
    """Two tables (and their pools) hold the same state: rows, lengths, the live part of the free
    stack, reference counts, page states and counters."""
    from tpool.kernels import layout as L
    assert a.block_table.tolist() == b.block_table.tolist() and a.seq_lens.tolist() == b.seq_lens.tolist()
    for name in ("free_stack", "refcount", "page_state", "counters"):
        x, y = getattr(a.pool.state, name), getattr(b.pool.state, name)
        if name == "free_stack":  # only the live part of the stack is state
            n = int(a.pool.state.counters[L.FREE_COUNT])
            x, y = x[:n], y[:n]
        assert x.tolist() == y.tolist(), name


@pytest.fixture(params=CPU_BACKENDS)
def backend(request):
    return request.param


@pytest.fixture
def make_pool(backend):
    """Build a CPU pool on the test's backend."""
    def make(num_pages, **kwargs):
        return tpool.PagePool(num_pages, device="cpu", backend=backend, **kwargs)
    return make


@pytest.fixture
def guard():
    """The host-sync guard; every hot-path call in the tests runs inside it."""
    return no_host_sync


@pytest.fixture
def seed():
    torch.manual_seed(1234)
    return 1234


requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def pytest_collection_modifyitems(config, items):
    """``stress`` runs (a million fuzzed operations) only when asked for: ``-m stress``."""
    if "stress" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="stress run: select it with -m stress")
    for item in items:
        if "stress" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _torch_threads():
    """Put torch's thread count back after each test: a benchmark script loaded by a test sets it to 1
    (as its timing runs need), which would otherwise hold for every test after it."""
    n = torch.get_num_threads()
    yield
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
