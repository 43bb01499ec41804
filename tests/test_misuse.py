"""Issue 11's façade findings: every way in that could make a kernel touch memory it was not
given, or make the backends disagree, is refused with a ValueError before any kernel runs.

Crash-prone reproducers run in a subprocess, so a segfault fails the test instead of pytest.
"""

import functools
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

import tpool
from conftest import CPU_BACKENDS, i32
from tpool.testing import no_host_sync


def run_isolated(code: str, backend: str) -> subprocess.CompletedProcess:
    env_code = "import os; os.environ.setdefault('TRITON_INTERPRET', '1')\n" + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", env_code, backend], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_bound_step_keeps_its_table_alive(backend):
    """Finding 1: the last reference to a table is a bound step; its state must outlive the scope."""
    proc = run_isolated("""
        import gc, sys, torch, tpool
        i32 = lambda v: torch.tensor(v, dtype=torch.int32)
        def make():
            pool = tpool.PagePool(256, 4, device="cpu", backend=sys.argv[1])
            table = tpool.PageTable(pool, 8, 16)
            ids, ntok = i32([0, 1, 2, 3]), i32([5, 5, 5, 5])
            return table.bind_step(ids, ntok, max_tokens=20), ids, ntok
        run, ids, ntok = make()
        gc.collect()
        junk = [torch.full((4096,), 7, dtype=torch.int32) for _ in range(64)]  # reuse freed memory
        res = run()
        ntok.fill_(1)
        res = run()
        assert res.ok.tolist() == [True] * 4 and res.csr.indptr.tolist() == [0, 2, 4, 6, 8], res
        run.table.pool.check()
        print("ok")
    """, backend)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_alloc_out_run_is_not_public_and_batch_is_checked(backend):
    """Finding 2: ``AllocOut.run(counts, B)`` with B > max_batch wrote past ``ok``; the bound call
    is private now and the pool checks B against the buffers."""
    pool = tpool.PagePool(16, device="cpu", backend=backend)
    out = pool.alloc_out(max_batch=2, max_pages=4)
    assert not hasattr(out, "run")
    with pytest.raises(ValueError, match=r"counts: expected at most 2 entries \(.*\), got 3"):
        pool.alloc(i32([1, 1, 1]), out=out)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_the_sizes_a_call_is_checked_against_cannot_be_reassigned(backend):
    """Session 25: ``StepOut.batch``, ``AllocOut.max_batch`` and ``CsrMemo.batch`` were plain attributes
    that the façade checked a call's batch against, while the buffers kept the old size: a 4,096-lane
    step into a 2-lane StepOut crashed the process. The public attributes of these objects are set once."""
    pool = tpool.PagePool(64, page_size=1, device="cpu", backend=backend)
    table = tpool.PageTable(pool, max_requests=64, max_pages_per_request=1)
    step_out, alloc_out = table.step_out(2, max_tokens=8, capacity=64), pool.alloc_out(max_batch=2, max_pages=8)
    for obj, names in ((step_out, ("batch", "max_tokens", "capacity", "memo", "result", "table")),
                       (alloc_out, ("max_batch", "max_pages", "pages", "ok", "indptr", "result", "pool")),
                       (step_out.memo, ("batch", "tensor", "csr"))):
        for name in names:
            with pytest.raises(AttributeError, match=rf"{type(obj).__name__}.{name} is read-only"):
                setattr(obj, name, 4096)
    with pytest.raises(ValueError, match="batch: expected 2"):
        table.step(torch.arange(64, dtype=torch.int32), torch.ones(64, dtype=torch.int32), out=step_out)
    with pytest.raises(ValueError, match=r"counts: expected at most 2 entries \(.*\), got 64"):
        pool.alloc(torch.ones(64, dtype=torch.int32), out=alloc_out)
    table.step(i32([0, 1]), i32([1, 1]), out=step_out)
    assert step_out.result.ok.tolist() == [True, True]
    pool.check()


def test_the_numba_alloc_bounds_its_batch_by_its_outputs():
    """Behind the façade, the numba alloc takes no more requests than its outputs have lanes (a raw
    address kernel bounds what it writes itself): those past them fail and count out_overflow."""
    pool = tpool.PagePool(64, page_size=1, device="cpu", backend="numba")
    out = pool.alloc_out(max_batch=2, max_pages=8)
    before = out.indptr.clone()
    junk = torch.full((4096,), 7, dtype=torch.int32)
    out._run(torch.ones(50, dtype=torch.int32), 50, False)  # around the façade's check
    assert out.ok.tolist() == [True, True] and out.indptr.tolist() == [0, 1, 2] != before.tolist()
    assert pool.available() == 62 and bool((junk == 7).all())
    with pytest.raises(tpool.OutputOverflow):
        pool.check()
    assert pool.stats()["requests.failed"] == 48


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_page_vectors_longer_than_a_kernel_indexes_are_refused(backend):
    """Session 25: free/incref/touch took any length; past MAX_INDEXED entries Triton's int32 claim cells
    truncated the lane index and a free of a page named twice went unseen (an H200: the page stayed USED,
    nothing counted). The vector is refused before any kernel (its memory is never touched: torch.empty)."""
    from tpool.kernels.layout import MAX_INDEXED
    pool = tpool.PagePool(8, device="cpu", backend=backend)
    long = torch.empty(MAX_INDEXED + 1, dtype=torch.int32)
    for call in (pool.free, pool.incref, pool.touch, pool.generations):
        with pytest.raises(ValueError, match=f"pages: expected at most {MAX_INDEXED} entries"):
            call(long)
    assert pool.stats()["clock"] == 0


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_tensors_without_real_memory_are_refused(backend):
    """Finding 2: a FakeTensor or a wrapper subclass has no memory to read (data_ptr 0)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    pool = tpool.PagePool(16, 4, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 4, 4)
    with FakeTensorMode():
        fake = torch.zeros(3, dtype=torch.int32)

    class Wrapped(torch.Tensor):
        pass

    wrapped = i32([0, 1]).as_subclass(Wrapped)
    for bad, name in ((fake, "FakeTensor"), (wrapped, "Wrapped"), (torch.nn.Parameter(i32([1]), False), "Parameter")):
        for call in (lambda: pool.free(bad), lambda: pool.alloc(bad), lambda: pool.incref(bad),
                     lambda: table.extend(bad, bad), lambda: table.flashinfer_csr(bad), lambda: table.release(bad)):
            with pytest.raises(ValueError, match=f"expected a plain torch.Tensor, got {name}, a subclass "):
                call()
    pool.check()
    assert pool.available() == 16


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_outputs_passed_back_as_inputs_are_refused(backend):
    """Finding 5: an input that shares memory with a buffer the call writes (its own outputs, the
    pool's or the table's state) is refused, so no backend reads what it is overwriting."""
    pool = tpool.PagePool(32, 1, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 4, 8)
    out = pool.alloc_out(max_batch=4, max_pages=8)
    pool.alloc(i32([1, 2, 3]), out=out)
    with pytest.raises(ValueError, match="counts: shares memory with a buffer this call writes"):
        pool.alloc(out.indptr[:3], out=out)
    with pytest.raises(ValueError, match="pages: shares memory"):
        pool.free(pool.state.free_stack[:2])
    with pytest.raises(ValueError, match="pages: shares memory"):
        pool.incref(pool.state.free_stack[:2])
    with pytest.raises(ValueError, match="out: shares memory"):
        pool.evict(2, out=pool.state.free_stack[:2])
    pool.free(out.pages)                           # reading an alloc's output is fine: free does not write it
    table.extend(i32([0, 1]), i32([2, 2]), max_tokens=4)
    res = table.fork(i32([0]), i32([2]), i32([1]))
    with pytest.raises(ValueError, match="dst_ids: shares memory"):
        table.fork(i32([0]), res.cow_dst, i32([1]))
    with pytest.raises(ValueError, match="num_tokens: shares memory"):
        table.extend(i32([0, 1]), table.seq_lens[:2])
    step = table.step(i32([0, 1]), i32([1, 1]))
    with pytest.raises(ValueError, match="num_tokens: shares memory"):
        table.step(i32([0, 1]), step.slots)
    with pytest.raises(ValueError, match="req_ids: shares memory"):
        table.bind_step(step.csr.indptr[:2], i32([1, 1]))
    with pytest.raises(ValueError, match="req_ids: shares memory"):
        table.block_table_rows(table.block_table[0, :2])
    pool.check()                                   # nothing ran: no error, no dirty scratch
    table.check_invariants()
    assert table.extend(i32([0, 1]), i32([1, 1])).ok.tolist() == [True, True]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_two_threads_one_pool(backend):
    """Finding 6: every call is atomic with respect to other threads (lock, or the GIL on numba)."""
    pool = tpool.PagePool(64, device="cpu", backend=backend)
    pairs = 20_000 if backend == "numba" else 300
    failures = []

    def work():
        out = pool.alloc_out(max_batch=1, max_pages=2)
        counts = i32([2])
        try:
            for _ in range(pairs):
                pool.free(pool.alloc(counts, out=out).pages)
        except Exception as e:  # pragma: no cover - reported below
            failures.append(e)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    pool.check()
    pool.check_invariants()
    stats = pool.stats()
    assert pool.available() == 64 and stats["pages.allocated"] == stats["pages.freed"] == 2 * 2 * pairs


def test_sync_points_and_preserved_copy_between_two_calls_of_another_thread():
    """Session 25: numba calls take no lock (they keep the GIL), while torch's copies release it, so
    check_invariants() read the state with another thread's calls landing between two tensors (false
    InvariantViolations: 39 of 59 checks on one machine), and ``preserved`` restored a state mixed from
    two moments (a page on the free stack twice). Their copies are one call that keeps the GIL now."""
    from tpool.graphs import preserved
    pool = tpool.PagePool(1 << 12, page_size=1, device="cpu", backend="numba")
    # (a restore rewinds the other thread's requests by up to a cycle: rows of 16 pages never overflow)
    table = tpool.PageTable(pool, max_requests=4, max_pages_per_request=16)
    out = pool.alloc_out(1, 1)
    alloc, free = pool.bind_alloc(i32([1]), out=out), pool.bind_free(out.pages)
    step = table.bind_step(i32([0, 1]), i32([1, 1]), max_tokens=2)
    release = torch.tensor([0, 1], dtype=torch.int32)
    alloc(), free(), step(), table.release(release)
    stop, failures = threading.Event(), []

    def churn():
        while not stop.is_set():
            alloc(), free()
            for _ in range(8):
                step()
            table.release(release)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # many thread switches: the calls land anywhere they can
    worker = threading.Thread(target=churn)
    worker.start()
    try:
        for _ in range(10):
            # (not exclusive: the other thread's alloc holds a page outside the table between its calls)
            for check in (pool.check_invariants, functools.partial(table.check_invariants, exclusive=False),
                          pool.stats):
                try:
                    check()
                except tpool.PoolError as e:
                    failures.append(e)
            with preserved(table):
                pass
    finally:
        stop.set()
        worker.join()
        sys.setswitchinterval(interval)
    assert not failures, failures[:3]
    # quiet: every restore put back a state from between two calls (the other thread's own calls may
    # count errors after a restore rewound them, a free of a page the restore made FREE again: not checked)
    table.check_invariants(exclusive=False)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_free_group_belongs_to_its_thread(backend):
    pool = tpool.PagePool(8, device="cpu", backend=backend)
    pages = pool.alloc(i32([4])).pages[:4].clone()
    with pool.free_group():
        t = threading.Thread(target=lambda: pool.free(pages[2:].clone()))
        t.start()
        t.join()
        assert pool.available() == 6               # the other thread's free was applied at once
        pool.free(pages[:2].clone())
        assert pool.available() == 6               # this thread's is deferred
    assert pool.available() == 8


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_output_buffers_are_bounded(backend):
    """Finding 8: one buffer set per call shape, at most max_shapes of them, least recently used first out."""
    pool = tpool.PagePool(64, 1, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 8, 4, max_shapes=4)
    hot = table.extend(i32([0]), i32([1]))
    for b in range(2, 12):
        table.extend(i32([-1] * b), i32([0] * b))
        assert table.extend(i32([0]), i32([1])) is hot     # the hot shape stays: it is used every round
        keys, n_buffers = table.kept_shapes()
        assert len(keys) <= 4 and n_buffers <= 4
    table.step(i32([0]), i32([1]))
    table.pin_shapes()
    for b in range(2, 12):
        table.step(i32([-1] * b), i32([0] * b))
    assert ("step", 1, 1, 4) in table.kept_shapes()[0]     # pinned shapes are never dropped
    table.check_invariants()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
@pytest.mark.parametrize("backend", ["auto", "reference", "triton"])
def test_cuda_device_without_cuda_is_a_value_error(backend):
    """Not torch's AssertionError from deep inside, nor a message about triton: the device is named
    first, on every backend, and the KV cache and the memory report say the same."""
    for device in ("cuda", "cuda:0", 0):
        with pytest.raises(ValueError, match=r"device: expected cpu, got cuda(:0)?: CUDA is not available here"):
            tpool.PagePool(4, device=device, backend=backend)
    from tpool.memory.report import memory_report
    from tpool.serving.kv import PagedKVCache
    with pytest.raises(ValueError, match="device: expected cpu, got cuda:1: CUDA is not available here"):
        PagedKVCache(1, 4, 2, 1, 4, dtype=torch.float32, device="cuda:1")
    with pytest.raises(ValueError, match="device: expected cpu, got cuda:0: CUDA is not available here"):
        memory_report(0)
    with pytest.raises(ValueError, match="device: expected a cpu or cuda device, got 'gpu'"):
        tpool.PagePool(4, device="gpu", backend=backend)


def test_the_default_device_is_the_cpu_for_numba_and_cuda_otherwise_when_there_is_one(monkeypatch):
    """``device=None`` on a machine with CUDA: the current CUDA device, but the CPU for the numba backend,
    which runs on host memory only (``PagePool(n, backend="numba")`` and ``demo --backend numba`` on a
    GPU machine were an error that named neither option)."""
    from tpool import _checks
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert _checks.resolve_device(None) == _checks.resolve_device(None, backend="triton") == torch.device("cuda", 0)
    assert _checks.resolve_device(None, backend="numba") == torch.device("cpu")
    assert tpool.PagePool(4, backend="numba").device == torch.device("cpu")
    monkeypatch.setenv("TPOOL_BACKEND", "numba")   # numba named by the environment: the CPU too
    assert tpool.PagePool(4).device == torch.device("cpu") and tpool.PagePool(4).backend == "numba"


def test_small_input_checks():
    """Finding 9."""
    with pytest.raises(ValueError, match="num_pages: expected a positive int, got True"):
        tpool.PagePool(True, device="cpu")
    pool = tpool.PagePool(np.int64(16), np.int32(4), device="cpu", max_batch=np.int16(8))  # numpy ints: accepted
    assert (pool.num_pages, pool.page_size, pool.max_batch) == (16, 4, 8) and type(pool.num_pages) is int
    table = tpool.PageTable(pool, np.int64(4), np.int64(4), max_shapes=np.int8(3))
    with pytest.raises(ValueError, match="device: expected a cpu or cuda device, got meta"):
        tpool.PagePool(4, device="meta")
    assert pool.evict(2**40).shape == (16,)                # clamped to the pool, not 2**40 entries
    with pytest.raises(ValueError, match="max_alloc_pages: expected at most num_pages = 16"):
        tpool.PagePool(16, device="cpu", max_alloc_pages=10**9)
    with pytest.raises(ValueError, match="max_pages: expected at most num_pages = 16"):
        pool.alloc_out(max_pages=17)
    with no_host_sync():                                   # a tensor as a size: ValueError, never a sync
        with pytest.raises(ValueError, match="max_tokens: expected a non-negative int, got a Tensor"):
            table.extend(i32([0]), i32([1]), max_tokens=torch.tensor(4))
        with pytest.raises(ValueError, match="capacity: expected a non-negative int, got a Tensor"):
            table.flashinfer_csr(i32([0]), capacity=torch.tensor(4))


def _over_foreign_ids(first, then):
    """An int32 input over the first 4 entries of a numpy array whose next 4 hold ``then``: ids
    that belong to no input (a kernel reading past the input's storage would find them)."""
    a = np.full(64, -1, dtype=np.int32)
    a[:4], a[4:8] = first, then
    return a, torch.from_numpy(a[:4])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_an_input_viewed_at_another_length_in_place_is_checked_again(backend):
    """``t.data = t.view(torch.uint8)`` keeps the tensor object, its address and its storage, and
    multiplies its length by 4: a cached check that compared only those let the kernels read 16
    bytes per entry, past the input (rows released and pages freed that were never passed, or
    a crash). The second call is now checked as a new input: a ValueError naming the dtype."""
    pool = tpool.PagePool(64, 1, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 8, 8)
    table.extend(i32([0, 1, 2, 3]), i32([2, 2, 2, 2]), max_tokens=8)
    held = pool.alloc(i32([8])).pages[:8].clone()
    out = pool.alloc_out(64, 64)
    a, pages = _over_foreign_ids(held[:2].tolist() + [-1, -1], held[4:8].tolist())
    b, ids = _over_foreign_ids([0, -1, -1, -1], [1, 2, 3, -1])
    c, ntok = _over_foreign_ids([1, 0, 0, 0], [3, 3, 3, 0])
    d, counts = _over_foreign_ids([1, 0, 0, 0], [5, 5, 5, 5])
    calls = [("pages", pages, lambda: pool.free(pages)), ("counts", counts, lambda: pool.alloc(counts, out=out)),
             ("req_ids", ids, lambda: table.extend(ids, ntok, max_tokens=8)),
             ("req_ids", ids, lambda: table.step(ids, ntok, max_tokens=8)),
             ("req_ids", ids, lambda: table.release(ids))]
    for name, t, call in calls:
        call()  # checked, and remembered as checked
        t.data = t.view(torch.uint8)
        if t is ids:
            ntok.data = ntok.view(torch.uint8)
        with pytest.raises(ValueError, match=f"{name}: expected dtype torch.int32, got torch.uint8"):
            call()
        t.data = t.view(torch.int32)
        if t is ids:
            ntok.data = ntok.view(torch.int32)
    assert table.seq_lens[1:4].tolist() == [2, 2, 2]  # rows 1-3 were never named
    assert pool.state.refcount[held[4:8].long()].tolist() == [1, 1, 1, 1]  # pages 4-7 never freed


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_lane_lengths_are_compared_when_the_ids_were_checked_by_another_call(backend, guard):
    """The ids a release checked and the num_tokens a step checked are each remembered; a later
    step pairing them compares their lengths (4 ids, 2 counts: a kernel would read 4 counts)."""
    pool = tpool.PagePool(64, 1, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 8, 8)
    two, four, ntok = i32([0, 1]), i32([0, 1, 2, 3]), i32([1, 1])
    with guard():
        table.extend(two, ntok, max_tokens=2)
        table.release(four)
    with pytest.raises(ValueError, match="num_tokens: expected 4 entries"):
        table.extend(four, ntok, max_tokens=4)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_check_after_a_restored_snapshot_reports_what_happened_since(backend):
    """What check() has seen is kept with the state: a snapshot restored (a warm-up that checked its
    own calls) brings back the counters and the baseline together, so no negative count is raised
    and a real double free afterwards is still raised."""
    from tpool.graphs import preserved
    pool = tpool.PagePool(8, 1, device="cpu", backend=backend)
    with preserved(pool):
        pool.free(i32([3]))  # double free, checked inside
        with pytest.raises(tpool.DoubleFree):
            pool.check()
    pool.check()  # nothing since: nothing raised
    pool.free(i32([4]))
    with pytest.raises(tpool.DoubleFree) as e:
        pool.check()
    assert e.value.counts == {"double_free": 1}


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_free_group_belongs_to_the_thread_that_entered_it(backend):
    """Made in one thread, entered in another: the entering thread's frees are deferred, the
    maker's are applied at once (they used to be deferred into a buffer the other thread flushed)."""
    pool = tpool.PagePool(8, device="cpu", backend=backend)
    pages = pool.alloc(i32([4])).pages[:4].clone()
    group = pool.free_group(capacity=8)
    seen = []

    def worker():
        with group:
            pool.free(pages[:2].clone())
            seen.append(pool.available())
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [4] and pool.available() == 6  # deferred inside, applied at the worker's exit


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_free_group_buffers_are_bounded_and_counted(backend):
    pool = tpool.PagePool(8, device="cpu", backend=backend)
    before = pool.memory_bytes()["state_bytes"]
    with pytest.raises(ValueError, match=r"capacity: expected at most 4096 \(max\(4096, 2 \* num_pages\)"):
        pool.free_group(capacity=2**40)
    for cap in range(1, 9):
        pool.free_group(capacity=cap)
    assert pool.memory_bytes()["state_bytes"] == before + sum(2 * 4 * cap for cap in range(1, 9))
    with pytest.raises(ValueError, match="capacity: expected one of this pool's 8 group capacities"):
        pool.free_group(capacity=9)
    pool.free_group(capacity=3)  # one it has: its buffer again
    with pytest.raises(RuntimeError):  # a pool-owned buffer: its storage cannot be freed under the group
        pool._group_buffers[3].untyped_storage().resize_(0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_flags_are_bools_and_sizes_are_bounded(backend):
    """``cache="no"`` used to cache (read by truthiness), a tensor flag raised torch's error; a
    max_tokens or capacity of 10**12 ran out of memory instead of naming the bound."""
    pool = tpool.PagePool(8, 1, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 4, 4)
    pages = pool.alloc(i32([1])).pages[:1].clone()
    for call, name in ((lambda v: pool.free(pages, cache=v), "cache"),
                       (lambda v: pool.alloc(i32([1]), evict=v), "evict"),
                       (lambda v: table.release(i32([0]), cache=v), "cache"),
                       (lambda v: pool.bind_free(pages, cache=v), "cache"),
                       (lambda v: table.check_invariants(exclusive=v), "exclusive")):
        for bad in ("no", None, 2.5, torch.tensor([True, False])):
            with pytest.raises(ValueError, match=f"{name}: expected a bool, got"):
                call(bad)
    assert pool.available() == 7  # nothing freed or allocated by the refused calls
    pool.free(pages, cache=np.bool_(True))  # a numpy bool is a bool
    assert pool.stats()["pages.cached.current"] == 1
    most = pool.max_batch * 4 * 1
    with pytest.raises(ValueError, match=f"max_tokens: expected at most {most}"):
        table.step(i32([0]), i32([1]), max_tokens=10**12)
    with pytest.raises(ValueError, match=f"capacity: expected at most {pool.max_batch * 4}"):
        table.step_out(1, capacity=10**12)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_step_grows_and_keeps_csr_check_their_sizes(backend):
    """``step_grows_csr`` and ``step_keeps_csr`` take ``max_tokens`` so a call can pass a step's own
    arguments, but never checked it: -1, True or 2.5 passed where the step they describe raises."""
    pool = tpool.PagePool(8, 2, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 4, 2)
    table.step(i32([0]), i32([1]), max_tokens=1)
    for call in (table.step_grows_csr, table.step_keeps_csr):
        for bad in (-1, True, 2.5, torch.tensor(1)):
            for name in ("max_tokens", "capacity"):
                with pytest.raises(ValueError, match=f"{name}: expected a non-negative int"):
                    call(i32([0]), **{name: bad})
        assert call(i32([0]), max_tokens=1) == call(i32([0]))  # the step's own arguments: the same answer


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_invalidate_csr_counts_an_id_outside_the_table(backend):
    """``invalidate_csr(rows)`` skipped an id outside ``[0, max_requests)`` without a word, so a row named
    wrong after a hand edit kept its old CSR run on numba unseen; it now counts ``bad_request``, as every
    table call does, on every backend."""
    pool = tpool.PagePool(8, 2, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 4, 2)
    table.extend(i32([0, 3]), i32([3, 1]), max_tokens=4)
    table.invalidate_csr(i32([-1, 0, 3]))  # padding and rows: nothing counted
    table.invalidate_csr(i32([]))
    table.invalidate_csr()
    pool.check()
    table.invalidate_csr(i32([4, -2, 2**31 - 1, -2**31, 1]))
    with pytest.raises(tpool.InvalidRequest, match="bad_request: 4"):
        pool.check()
    assert table.seq_lens.tolist() == [3, 0, 0, 1]  # nothing else changed
    table.check_invariants()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_alloc_counts_sharing_the_pool_state_are_refused_without_out(backend):
    pool = tpool.PagePool(8, 1, device="cpu", backend=backend)
    with pytest.raises(ValueError, match="counts: shares memory"):
        pool.alloc(pool.state.refcount[:1])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_zero_tensor_is_refused_by_every_call(backend):
    """``torch._efficientzerotensor(2, dtype=torch.int32)`` is 1-D, contiguous, int32, its storage
    says 8 bytes, and its ``data_ptr()`` is 0: it passed the checks, and the numba kernels read
    address 0 (a crash; the reference backend raised a RuntimeError). Every call refuses it now,
    naming what was expected. In a subprocess: a crash fails the test instead of killing pytest."""
    proc = run_isolated("""
        import sys, torch, tpool
        pool = tpool.PagePool(8, 2, device="cpu", backend=sys.argv[1])
        table = tpool.PageTable(pool, 4, 4)
        z = torch._efficientzerotensor(2, dtype=torch.int32)
        ok = torch.tensor([1, 1], dtype=torch.int32)
        for name, call in [("alloc", lambda: pool.alloc(z)),
                           ("alloc out=", lambda: pool.alloc(z, out=pool.alloc_out(2))),
                           ("bind_alloc", lambda: pool.bind_alloc(z, out=pool.alloc_out(2))),
                           ("free", lambda: pool.free(z)), ("incref", lambda: pool.incref(z)),
                           ("touch", lambda: pool.touch(z)), ("extend", lambda: table.extend(z, ok)),
                           ("extend ntok", lambda: table.extend(ok - 1, z)), ("step", lambda: table.step(ok - 1, z)),
                           ("bind_step", lambda: table.bind_step(z, ok)), ("csr", lambda: table.flashinfer_csr(z)),
                           ("release", lambda: table.release(z)), ("truncate", lambda: table.truncate(ok - 1, z)),
                           ("step release", lambda: table.step(ok - 1, ok, release=z))]:
            try:
                call()
                print(name, "accepted")
            except ValueError as e:
                print(name, "ZeroTensor" in str(e) and "expected a tensor whose memory holds its values" in str(e))
        print("done", table.seq_lens.tolist(), pool.available())
    """, backend)
    lines = proc.stdout.split("\n")
    assert proc.returncode == 0 and len(lines) == 16 and all(x.endswith(" True") for x in lines[:14]), \
        proc.stdout + proc.stderr[-2000:]
    assert lines[14] == "done [0, 0, 0, 0] 8"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_negative_view_is_refused(backend):
    """``torch._neg_view(t)`` keeps ``t``'s bytes and reads them negated: numba's kernels read the
    bytes (id 1), the reference backend the values (-1, padding): the backends disagreed. Refused now."""
    pool = tpool.PagePool(8, 2, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 4, 4)
    held = pool.alloc(i32([2])).pages[:2].clone()
    neg = torch._neg_view(i32([1]))
    assert neg.is_neg() and neg.tolist() == [-1]
    out = pool.alloc_out(1)
    for call in (lambda: pool.free(neg), lambda: pool.alloc(neg, out=out), lambda: pool.incref(neg),
                 lambda: table.extend(neg, i32([1])), lambda: table.step(i32([0]), neg),
                 lambda: table.flashinfer_csr(neg), lambda: table.release(neg), lambda: table.bind_step(neg, i32([1]))):
        with pytest.raises(ValueError, match=r"expected a tensor whose memory holds its values, got a negative "
                                             r"view \(torch._neg_view\); pass .resolve_neg\(\)"):
            call()
    assert pool.state.refcount.tolist()[:2] == [1, 1] and table.seq_lens.tolist() == [0] * 4
    pool.free(neg.resolve_neg())                   # -1: padding
    pool.free(held)
    assert pool.available() == 8
    pool.check()
    empty = torch._efficientzerotensor(0, dtype=torch.int32)  # nothing to read: an empty batch
    assert table.step(empty, empty).csr.indptr.tolist() == [0]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_release_cache_is_checked_without_release(backend):
    """README: anything but a bool as ``release_cache=`` is a ValueError on every call. It was checked
    only with ``release=`` (``release_cache="no"`` went through otherwise)."""
    table = tpool.PageTable(tpool.PagePool(16, 4, device="cpu", backend=backend), 4, 4)
    ids, ones = i32([0]), i32([1])
    out = table.step_out(1)
    for bad in ("no", torch.tensor(False), [], None, 0):
        for call in (lambda: table.step(ids, ones, release_cache=bad),
                     lambda: table.step(ids, ones, out=out, release_cache=bad),
                     lambda: table.bind_step(ids, ones, release_cache=bad),
                     lambda: table.bind_step(batch=1, release_cache=bad)):
            with pytest.raises(ValueError, match="release_cache: expected a bool, got"):
                call()
    assert table.seq_lens.tolist() == [0] * 4
    for good in (False, np.bool_(True)):
        assert table.step(ids, ones, release_cache=good).kv_lens.tolist() == [1 + (good is not False)]
        table.bind_step(ids, ones, release_cache=good)


def test_copy_between_calls_refuses_tensors_of_one_dtype_and_different_shapes():
    """The numba copy writes ``src``'s bytes into ``dst``: a smaller ``dst`` would be written past its end."""
    from tpool.state import copy_between_calls
    dst, src = torch.zeros(2, dtype=torch.int64), torch.arange(3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"expected contiguous tensors of one dtype and shape, got "
                                         r"torch.int64 \(2,\) and torch.int64 \(3,\)"):
        copy_between_calls([(dst, src)])
    assert dst.tolist() == [0, 0]



# --- Pinned by helper-143's mutation run over the pool and page-table façade (session 39) ----------------------------

def test_evict_out_shorter_than_k_is_refused(backend):
    """evict(k, out=) with fewer than k entries: ValueError naming both, nothing evicted (not len(out) pages
    evicted silently)."""
    pool = tpool.PagePool(8, device="cpu", backend=backend)
    r = pool.alloc(i32([4]))
    pool.free(r.pages[:4], cache=True)
    with pytest.raises(ValueError, match=r"out: expected 3 entries \(k\), got 2"):
        pool.evict(3, out=torch.empty(2, dtype=torch.int32))
    assert pool.stats()["pages.cached.current"] == 4


def test_a_hot_path_input_past_a_shrunk_storage_is_refused(backend):
    """A view at storage offset 4 whose storage was shrunk to 4 entries: its 4 entries lie past the storage
    although nbytes >= 4 * numel. free refuses it before any kernel, on the hot path's check
    and the full one (both must count the storage offset: a kernel would read past the allocation)."""
    pool = tpool.PagePool(8, device="cpu", backend=backend)
    base = torch.full((8,), -1, dtype=torch.int32)
    view = base[4:]
    base.untyped_storage().resize_(16)
    with pytest.raises(ValueError, match="expected a storage holding its 4 entries"):
        pool.free(view)


def test_release_of_ids_over_the_pool_state_is_refused(backend):
    """table.release(req_ids) with req_ids over a pool state tensor: ValueError before any change
    (without the check the reference backend released whatever ids the free stack held)."""
    pool = tpool.PagePool(8, 1, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 8, 4)
    table.extend(i32([0, 1]), i32([2, 2]), max_tokens=4)
    before = table.seq_lens.clone()
    with pytest.raises(ValueError, match="req_ids: shares memory with a buffer this call writes"):
        table.release(pool.state.free_stack[:2])
    assert torch.equal(table.seq_lens, before)


@pytest.mark.parametrize("lens, msg", [(torch.tensor([2, 2], dtype=torch.int64), "lens: expected dtype torch.int32"),
                                       (i32([2]), r"lens: expected 2 entries \(one per request id\), got 1")])
def test_fork_checks_its_lens_before_any_change(backend, lens, msg):
    """fork's lens of another dtype or length: ValueError naming expected and actual, table unchanged."""
    pool = tpool.PagePool(16, 4, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 4, 4)
    table.extend(i32([0]), i32([8]), max_tokens=8)
    before = [t.clone() for t in (table.seq_lens, table.block_table, pool.state.refcount)]
    with pytest.raises(ValueError, match=msg):
        table.fork(i32([0, 0]), i32([1, 2]), lens)
    assert all(torch.equal(a, b) for a, b in zip(before, (table.seq_lens, table.block_table, pool.state.refcount)))


def test_a_per_lane_vector_longer_than_max_batch_names_the_batch(backend):
    """num_tokens (new_lens, drop, src_ids, lens) must have one entry per request id; one longer than the
    pool's max_batch was refused as "expected at most max_batch entries", which a caller with a batch of 2
    could only read as a limit it had not reached."""
    pool = tpool.PagePool(16, 4, device="cpu", backend=backend, max_batch=8)
    table = tpool.PageTable(pool, 4, 4)
    ids, long = i32([0, 1]), torch.ones(9, dtype=torch.int32)
    calls = {"num_tokens": lambda: table.extend(ids, long), "new_lens": lambda: table.truncate(ids, long),
             "drop": lambda: table.truncate(ids, drop=long), "src_ids": lambda: table.fork(long, ids, ids),
             "lens": lambda: table.fork(ids, ids, long)}
    for name, call in calls.items():
        with pytest.raises(ValueError, match=rf"{name}: expected 2 entries \(one per request id\), got 9"):
            call()
    assert table.seq_lens.tolist() == [0, 0, 0, 0] and pool.available() == 16


def test_bind_alloc_refuses_an_out_of_another_pool_or_type(backend):
    """As alloc(out=) does: another pool's AllocOut is named so (bind_alloc said "got AllocOut", the type
    it expected)."""
    pool = tpool.PagePool(8, device="cpu", backend=backend)
    other = tpool.PagePool(8, device="cpu", backend=backend)
    for out, got in ((other.alloc_out(2, 4), "one from another pool$"), (pool.alloc_out(2, 4).result, "AllocResult")):
        with pytest.raises(ValueError, match=f"out: expected an AllocOut from this pool's alloc_out\\(\\), got {got}"):
            pool.bind_alloc(i32([1, 1]), out=out)
    assert pool.available() == other.available() == 8
