"""The backends' bound calls and the buffers they write (tpool/backends: numba, and the reference and
triton bindings of contract.py): a bound call keeps the flags and the memory it was made with, and the
compiled overlap guards cover every range the call writes, counting an input's bytes from its address;
the reference and Triton bindings hold the pool's state lock around each call.

Found unpinned by helper-148's and helper-149's mutation runs over tpool/backends (session 40).
"""

import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import tpool
from conftest import i32


@pytest.mark.parametrize("evict", [False, True])
def test_bind_alloc_keeps_its_evict_flag(backend, evict):
    """A bound alloc evicts cached pages only when bound with evict=True: with evict=False a
    request larger than the free pages fails and the cached pages stay cached."""
    pool = tpool.PagePool(4, 1, device="cpu", backend=backend)
    pool.free(pool.alloc(i32([4])).pages, cache=True)       # 4 cached pages, none free
    out = pool.alloc_out(max_batch=1, max_pages=4)
    res = pool.bind_alloc(i32([2]), out=out, evict=evict)()
    assert res.ok.tolist() == [evict]
    assert pool.stats()["pages.cached.current"] == (2 if evict else 4)


@pytest.mark.parametrize("cache", [False, True])
def test_bind_free_keeps_its_cache_flag(backend, cache):
    """A bound free with cache=True leaves its pages CACHED; with cache=False they go back FREE."""
    pool = tpool.PagePool(8, 1, device="cpu", backend=backend)
    pages = pool.alloc(i32([3])).pages[:3].clone()
    pool.bind_free(pages, cache=cache)()
    assert pool.stats()["pages.cached.current"] == (3 if cache else 0)
    assert pool.available() == (5 if cache else 8)  # cached pages are off the free stack
    pool.check()


def _repoint(tensors):
    """Re-point each of ``tensors`` by hand (``set_``) to new memory holding 99 (False for a bool: the
    calls below write True to every ``ok``); returns what they hold then, for checking that no later call
    writes them."""
    moved = [torch.full_like(t, False if t.dtype == torch.bool else 99) for t in tensors]
    for t, m in zip(tensors, moved):
        t.set_(m.clone())
    return moved


def test_an_alloc_out_whose_tensors_are_repointed_keeps_writing_the_memory_it_was_made_with(backend):
    """Re-pointing an AllocOut's tensors by hand (``set_``) is not followed: the alloc writes the
    memory the AllocOut was made with (still readable through a view taken before), and the
    tensors it was re-pointed to stay as they were."""
    pool = tpool.PagePool(8, 1, device="cpu", backend=backend)
    out = pool.alloc_out(max_batch=2, max_pages=4)
    kept = [t.view(t.shape) for t in out.result]            # the original memory
    moved = _repoint(out.result)
    pool.alloc(i32([1, 2]), out=out)
    pages, indptr, ok, _ = kept
    assert ok.tolist() == [True, True] and indptr.tolist() == [0, 1, 3]
    assert sorted(pages[:3].tolist()) == sorted(set(pages[:3].tolist())) and min(pages[:3].tolist()) >= 0
    for t, m in zip(out.result, moved):
        assert t.tolist() == m.tolist()                     # untouched


def _tensors(res):
    """A result's tensors, nested tuples (a step's CSR) flattened."""
    return [x for t in res for x in (_tensors(t) if isinstance(t, tuple) else [t])]


_TABLE_CALLS = {
    "extend": lambda table, ids, n: table.extend(ids, n, max_tokens=4),
    "flashinfer_csr": lambda table, ids, n: table.flashinfer_csr(ids),
    "step": lambda table, ids, n: table.step(ids, n, max_tokens=4),
}


@pytest.mark.parametrize("call", sorted(_TABLE_CALLS))
def test_a_table_owned_result_whose_tensors_are_repointed_keeps_writing_the_memory_it_was_made_with(backend,
                                                                                                   call):
    """Re-pointing a table-owned result's tensors by hand (``set_``) is not followed: the next call of
    that shape writes the memory the result was made with (what a table nobody re-pointed returns),
    and the tensors it was re-pointed to stay as they were."""
    run, got = _TABLE_CALLS[call], []
    for repoint in (False, True):                           # a twin table first, then the re-pointed one
        table = tpool.PageTable(tpool.PagePool(32, 4, device="cpu", backend=backend), 4, 8)
        table.extend(i32([0, 1, 2, 3]), i32([1, 6, 3, 5]), max_tokens=16)
        res = _tensors(run(table, i32([0, 1]), i32([1, 2])))
        first = [t.tolist() for t in res]
        kept = [t.view(t.shape) for t in res]
        if repoint:
            moved = _repoint(res)
        run(table, i32([2, 3]), i32([2, 1]))
        got.append([t.tolist() for t in kept])
        assert got[-1] != first                             # the second call wrote something else
    assert got[0] == got[1]
    for t, m in zip(res, moved):
        assert t.tolist() == m.tolist()                     # untouched


def test_alloc_into_out_refuses_counts_over_the_pool_state(backend):
    """An alloc into an AllocOut refuses counts that share memory with the pool's own state (which
    the call writes), as the alloc without out= does (on numba its compiled guard checks the state's
    ranges too, not only the outputs'). Nothing changes."""
    pool = tpool.PagePool(8, 1, device="cpu", backend=backend)
    out = pool.alloc_out(max_batch=2, max_pages=4)
    before = [t.clone() for t in (pool.state.refcount, pool.state.free_stack, pool.state.counters)]
    for counts in (pool.state.refcount[:1], pool.state.free_stack[:2]):
        with pytest.raises(ValueError, match="counts: shares memory"):
            pool.alloc(counts, out=out)
    for t, b in zip((pool.state.refcount, pool.state.free_stack, pool.state.counters), before):
        assert t.tolist() == b.tolist()
    assert pool.available() == 8


def test_extend_refuses_inputs_over_its_own_table_owned_outputs(backend):
    """An extend whose num_tokens lies over the slots buffer that call writes (the table-owned
    ExtendResult of the same shape, returned by the previous extend) is refused before any change."""
    pool = tpool.PagePool(64, 4, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 4, 8)
    res = table.extend(i32([0, 1]), i32([2, 3]), max_tokens=8)
    before = (table.seq_lens.clone(), table.block_table.clone(), pool.available())
    with pytest.raises(ValueError, match="num_tokens: shares memory"):
        table.extend(i32([0, 1]), res.slots[:2], max_tokens=8)
    with pytest.raises(ValueError, match="req_ids: shares memory"):
        table.extend(res.slots[2:4], i32([1, 1]), max_tokens=8)
    assert table.seq_lens.tolist() == before[0].tolist() and table.block_table.tolist() == before[1].tolist()
    assert pool.available() == before[2]
    table.check_invariants()


@pytest.mark.parametrize("field", ["positions", "qo_indptr", "kv_lens"])
def test_step_refuses_inputs_over_its_own_attention_metadata(backend, field):
    """A step whose num_tokens lies over the attention metadata that step writes (positions,
    qo_indptr, kv_lens of the table-owned StepResult of the same shape) is refused before any change."""
    pool = tpool.PagePool(64, 4, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 4, 8)
    ids = i32([0, 1])
    res = table.step(ids, i32([2, 3]), max_tokens=8)
    before = (table.seq_lens.clone(), table.block_table.clone(), pool.available())
    with pytest.raises(ValueError, match="num_tokens: shares memory"):
        table.step(ids, getattr(res, field)[:2], max_tokens=8)
    assert table.seq_lens.tolist() == before[0].tolist() and table.block_table.tolist() == before[1].tolist()
    assert pool.available() == before[2]
    table.check_invariants()


def test_invalidate_csr_restamps_the_rows_named_and_no_others():
    """invalidate_csr(req_ids) gives the rows it names a fresh stamp and leaves every other row's
    stamp as it was, even when the ids are a view whose memory goes on with other valid row ids."""
    pool = tpool.PagePool(64, 4, device="cpu", backend="numba")
    table = tpool.PageTable(pool, 4, 8)
    table.step(i32([0, 1, 2, 3]), i32([3, 3, 3, 3]))
    buf = i32([1, 2, 3, 0])
    for n in (1, 2, 3):
        before = table.state.row_version.tolist()
        table.invalidate_csr(buf[:n])
        after = table.state.row_version.tolist()
        named = set(buf[:n].tolist())
        assert all((a != b) == (r in named) for r, (a, b) in enumerate(zip(after, before))), (n, before, after)


# --- numba: the compiled calls hold addresses ------------------------------------------------------------


ALLOC_OUT_REPOINTED = """
import gc, numpy as np, torch, tpool
i32 = lambda v: torch.tensor(v, dtype=torch.int32)
pool = tpool.PagePool(4096, 1, device="cpu", backend="numba")
out = pool.alloc_out(max_batch=64, max_pages=4096)
for t in out.result:                      # re-pointed: the bound alloc still writes the old memory
    t.set_(torch.zeros(1, dtype=t.dtype))
gc.collect()
junk = [torch.full((n,), 7, dtype=torch.int32) for n in (4096, 1024, 65, 64) for _ in range(50)]
junk += [np.full(n, 7, dtype=np.int32) for n in (4096, 1024, 65, 64) for _ in range(50)]
counts = torch.full((64,), 2, dtype=torch.int32)
for _ in range(20):                       # 2560 of the 4096 pages
    pool.alloc(counts, out=out)
assert pool.available() == 4096 - 2560
assert all(bool((j == 7).all()) for j in junk), "an alloc into an AllocOut wrote into memory it does not own"
print("ok")
"""


def test_an_alloc_out_keeps_its_buffers_alive_when_its_tensors_are_repointed():
    """An AllocOut's compiled alloc holds the storages it writes: re-pointing the AllocOut's
    tensors (``set_``) leaves the old memory alive for the kernel, which writes nothing else.
    In a subprocess: a regression is a crash or a corrupted heap."""
    r = subprocess.run([sys.executable, "-c", ALLOC_OUT_REPOINTED], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
    assert r.stdout.split() == ["ok"]


def test_allocs_without_out_from_several_threads_each_write_their_own_result():
    """Allocs without out= racing in several threads: every call writes its own fresh result
    (ok, indptr, pages), never another call's, and every page is granted exactly once."""
    threads_n, calls = 4, 4000
    pool = tpool.PagePool(3 * threads_n * calls, 1, device="cpu", backend="numba")
    results = [[] for _ in range(threads_n)]

    def work(k):
        counts = i32([1, 2])
        for _ in range(calls):
            results[k].append(pool.alloc(counts))

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter lets them
    try:
        ts = [threading.Thread(target=work, args=(k,)) for k in range(threads_n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        sys.setswitchinterval(old)
    granted = []
    for res in (r for rs in results for r in rs):
        assert res.ok.tolist() == [True, True] and res.indptr.tolist() == [0, 1, 3]
        granted += res.pages[:3].tolist()
    assert sorted(granted) == list(range(3 * threads_n * calls))
    assert pool.available() == 0
    pool.check()


VERSION_OF_A_FRESH_PROCESS = """
import torch, tpool
table = tpool.PageTable(tpool.PagePool(16, 4, device="cpu", backend="numba"), 2, 4)
table.extend(torch.tensor([0], dtype=torch.int32), torch.tensor([3], dtype=torch.int32))
print(int(table.state.row_version[0]))
"""


def test_table_versions_do_not_repeat_across_processes():
    """The numba tables' version counter starts at a random value in each process (and stays
    below 2**62): the first version a table takes in two fresh processes differs, so a state
    brought in from another process never carries a version this process has used."""
    got = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", VERSION_OF_A_FRESH_PROCESS], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        got.append(int(r.stdout.split()[-1]))
    assert got[0] != got[1] and all(1 <= v < 2**62 for v in got), got


def test_addresses_refuses_any_name_that_is_not_a_table_or_state_entry():
    """Table.addresses takes only TD_* and SD_* descriptor entries: one other name among valid ones
    (a call-descriptor or alloc-descriptor slot, which would index the wrong descriptor) is a
    ValueError, not an address of something else."""
    table = tpool.PageTable(tpool.PagePool(16, 4, device="cpu", backend="numba"), 2, 4)
    ops = table.ops
    assert ops.addresses("TD_BLOCK_TABLE", "SD_REFCOUNT") == (table.block_table.data_ptr(),
                                                              table.pool.state.refcount.data_ptr())
    for names in (("TD_BLOCK_TABLE", "CD_STATE"), ("SD_REFCOUNT", "CD_OUT"), ("CD_STATE",),
                  ("TD_SEQ_LENS", "AD_PAGES")):
        with pytest.raises(ValueError, match="names"):
            ops.addresses(*names)


# ------------------------------------------------- the numba guards' byte arithmetic
# The pool's and table's own buffers are whole storages, which no input can start before, so the
# tests below put a scratch range first in every list of written ranges the numba backend builds:
# an input of n int32 lanes covers 4*n bytes from its address and overlaps a range [lo, hi) when
# it starts before hi and ends after lo, also when it starts before lo and when the range is the
# list's first; an input that only touches a range's end is not refused. The scratch memory is
# never written: it is in the ranges checked, not in the descriptor's slots.

@pytest.fixture
def scratch_range(monkeypatch):
    """``make(fill)``: 16 int32 lanes whose lanes [4, 8) are a written range of every numba pool
    and table built afterwards (first in each list of ranges)."""
    from tpool.backends import numba as nb
    extra, bufs, ranges = [], [], nb.storage_ranges
    monkeypatch.setattr(nb, "storage_ranges", lambda tensors: np.concatenate([*extra, ranges(tensors)]))

    def make(fill):
        buf = torch.full((16,), fill, dtype=torch.int32)
        bufs.append(buf)                                  # alive as long as the test
        extra.append(np.array([buf.data_ptr() + 16, buf.data_ptr() + 32], np.int64))
        return buf
    return make


def _numba_table():
    return tpool.PageTable(tpool.PagePool(64, 4, device="cpu", backend="numba"), 4, 8)


def test_numba_free_refuses_pages_that_start_before_a_written_range(scratch_range):
    buf = scratch_range(-1)
    pool = tpool.PagePool(32, 4, device="cpu", backend="numba")
    for inside in (buf[2:6], buf[5:6]):                   # 4*n bytes from lane 2 reach lane 4
        with pytest.raises(ValueError, match="pages: shares memory"):
            pool.free(inside)
    pool.free(buf[8:12])                                  # starts where the range ends
    pool.free(buf[0:4])                                   # ends where the range starts
    pool.check()


@pytest.mark.parametrize("with_out", [False, True])
def test_numba_alloc_refuses_counts_that_start_before_a_written_range(scratch_range, with_out):
    buf = scratch_range(0)
    pool = tpool.PagePool(32, 4, device="cpu", backend="numba")
    kw = {"out": pool.alloc_out(max_batch=4, max_pages=8)} if with_out else {}
    with pytest.raises(ValueError, match="counts: shares memory"):
        pool.alloc(buf[2:6], **kw)
    pool.alloc(buf[8:12], **kw)
    pool.alloc(buf[0:4], **kw)
    assert pool.available() == 32


def test_numba_extend_and_step_refuse_lanes_that_start_before_a_written_range(scratch_range):
    """req_ids and num_tokens are each checked over their 4*B bytes, in an extend and in a step."""
    ids, ntok = scratch_range(-1), scratch_range(0)
    table = _numba_table()
    pad, zeros = torch.full((4,), -1, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    for call in (table.extend, table.step):
        with pytest.raises(ValueError, match="req_ids: shares memory"):
            call(ids[2:6], zeros, max_tokens=4)
        with pytest.raises(ValueError, match="num_tokens: shares memory"):
            call(pad, ntok[2:6], max_tokens=4)
        call(ids[8:12], ntok[8:12], max_tokens=4)         # starting where the ranges end
        call(ids[0:4], ntok[0:4], max_tokens=4)           # ending where they start
    table.check_invariants()


def test_numba_step_refuses_a_release_longer_than_the_batch_that_reaches_a_written_range(scratch_range):
    """A release of K ids is checked over its 4*K bytes, not the batch's 4*B."""
    rel = scratch_range(-1)
    table = _numba_table()
    with pytest.raises(ValueError, match="release: shares memory"):   # K=4 from lane 1 reach lane 4; B=1
        table.step(i32([-1]), i32([0]), max_tokens=4, release=rel[1:5])
    table.step(i32([-1]), i32([0]), max_tokens=4, release=rel[0:4])


def test_numba_csr_refuses_ids_that_start_before_a_written_range(scratch_range):
    ids = scratch_range(-1)
    table = _numba_table()
    with pytest.raises(ValueError, match="req_ids: shares memory"):
        table.flashinfer_csr(ids[2:6])
    table.flashinfer_csr(ids[8:12])
    table.flashinfer_csr(ids[0:4])


# ---------------------------------------------------------------- the state lock
# The reference and Triton bindings hold the pool's state lock around each call (numba runs under
# the GIL). Dropping a lock changes no single-threaded result, so these tests watch the lock.

class _WatchedLock:
    """The pool's lock, counting: ``depth`` now, ``entries`` acquisitions from depth 0."""

    def __init__(self, inner):
        self.inner, self.depth, self.entries = inner, 0, 0

    def __enter__(self):
        self.inner.__enter__()
        self.depth += 1
        self.entries += self.depth == 1
        return self

    def __exit__(self, *exc):
        self.depth -= 1
        return self.inner.__exit__(*exc)


def _watched_pool(backend, num_pages, page_size):
    pool = tpool.PagePool(num_pages, page_size, device="cpu", backend=backend)
    lock = _WatchedLock(pool.state.lock)
    object.__setattr__(pool.state, "lock", lock)
    object.__setattr__(pool.ops.st, "lock", lock)
    return pool, lock


def _record_depth(monkeypatch, owner, name, lock, seen):
    fn = getattr(owner, name)

    def call(*args, **kwargs):
        seen.append((name, lock.depth))
        return fn(*args, **kwargs)
    monkeypatch.setattr(owner, name, call)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_pool_calls_run_their_state_function_under_the_state_lock(monkeypatch, backend):
    """alloc (fresh outputs, into an AllocOut, bound), free and evict."""
    pool, lock = _watched_pool(backend, 16, 1)
    seen = []
    for name in ("_alloc", "_free", "_evict"):
        _record_depth(monkeypatch, pool.ops, name, lock, seen)
    res = pool.alloc(i32([2]))
    out = pool.alloc_out(max_batch=1, max_pages=4)
    pool.alloc(i32([1]), out=out)
    pool.bind_alloc(i32([1]), out=out)()
    pool.free(res.pages[:2].clone(), cache=True)
    pool.evict(1)
    assert [n for n, _ in seen] == ["_alloc", "_alloc", "_alloc", "_free", "_evict"]
    assert all(depth >= 1 for _, depth in seen), seen


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_extend_and_step_hold_the_state_lock_once_per_call(monkeypatch, backend):
    """An extend is one acquisition; a step holds the lock from its release through its extend to
    its export (one acquisition: no other thread's call falls between), with or without a release.
    On Triton the step's kernel itself runs under it."""
    pool, lock = _watched_pool(backend, 64, 4)
    table = tpool.PageTable(pool, 4, 8)
    seen = []
    if backend == "triton":
        from tpool.kernels import step
        _record_depth(monkeypatch, step, "step_triton", lock, seen)
    table.extend(i32([0, 1]), i32([3, 5]), max_tokens=8)
    table.step(i32([2, 3]), i32([1, 1]), max_tokens=8, release=i32([0]))   # each shape's first call
    table.step(i32([2, 3]), i32([1, 1]), max_tokens=8)
    seen.clear()
    for call in (lambda: table.extend(i32([2, 3]), i32([1, 1]), max_tokens=8),
                 lambda: table.step(i32([2, 3]), i32([1, 1]), max_tokens=8),
                 lambda: table.step(i32([2, 3]), i32([1, 1]), max_tokens=8, release=i32([1]))):
        lock.entries = 0
        call()
        assert lock.entries == 1
    assert all(depth >= 1 for _, depth in seen) and len(seen) == (2 if backend == "triton" else 0), seen
