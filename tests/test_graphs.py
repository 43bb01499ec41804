"""Graph helpers: warm-up leaves no trace (CPU); capture and replay (GPU only)."""

import pytest
import torch

import tpool
from conftest import hot_path_calls, i32, requires_cuda
from tpool.graphs import capture, preserved, state_tensors


def test_preserved_restores_pool_and_table_state(make_pool):
    pool = make_pool(16)
    table = tpool.PageTable(pool, 4, 4)
    table.extend(i32([0, 1]), i32([1, 1]))
    before = [t.clone() for t in state_tensors(table)]
    with preserved(table):
        table.extend(i32([0, 1, 2]), i32([3, 3, 3]), max_tokens=9)
        pool.alloc(i32([5]))
        assert not torch.equal(table.seq_lens, before[1])
    after = state_tensors(table)
    # block_table, seq_lens, 2 scratch, 2 versions; the pool brings its table's too
    assert len(after) == len(before) == len(pool.state.tensors()) + 6 == len(tpool.graphs.state_tensors(pool))
    assert all(torch.equal(a, b) for a, b in zip(after, before))


def test_preserved_restores_every_table_of_a_pool_it_restores(make_pool):
    """``preserved(a)`` (and ``capture(step, a)``, whose warm-up it wraps) restored the pool with table ``a``
    only: a table ``b`` on the same pool kept the pages the block gave it, which the restored pool held FREE
    (the next alloc handed them out again: two requests on one page). ``preserved(pool)`` left every table
    so. A pool's state and its tables' hold each other's page references: they are restored together,
    whichever of them is named."""
    import gc
    pool = make_pool(16, page_size=4)
    a, b = tpool.PageTable(pool, 2, 4), tpool.PageTable(pool, 2, 4)
    b.step(i32([1]), i32([3]), max_tokens=3)                 # b holds a row before
    for owner in (a, pool):
        before = [t.clone() for t in state_tensors(a, b)]
        with preserved(owner):
            a.step(i32([0]), i32([4]), max_tokens=4)
            b.step(i32([0, 1]), i32([4, 2]), max_tokens=6)
        assert all(torch.equal(x, y) for x, y in zip(state_tensors(a, b), before, strict=True))
        a.check_invariants(exclusive=False)
        b.check_invariants(exclusive=False)
    assert len(state_tensors(a)) == len(state_tensors(pool)) == len(state_tensors(b, a)) == len(before)
    del b
    gc.collect()                                             # a table dropped is no longer restored
    assert len(state_tensors(pool)) == len(state_tensors(a)) < len(before)
    pool.check()


def test_preserved_empties_a_table_made_on_its_pool_inside_the_block(make_pool):
    """A table made inside ``preserved(pool)`` (or ``preserved(table)`` of that pool) kept the pages the
    block gave it, which the restored pool held FREE: the next alloc handed them out again, to another
    table (two requests on one page), the table broke its invariants. Such a table is put back as it was
    made, empty, as the pool is put back: the block leaves no trace."""
    pool = make_pool(16, page_size=4)
    a = tpool.PageTable(pool, 2, 4)
    a.step(i32([1]), i32([3]), max_tokens=3)
    for owner in (pool, a):
        before = [t.clone() for t in state_tensors(pool)]
        with preserved(owner):
            c = tpool.PageTable(pool, 2, 4)
            c.step(i32([0, 1]), i32([8, 5]), max_tokens=13)
        assert c.seq_lens.tolist() == [0, 0] and (c.block_table == -1).all()
        assert all(torch.equal(x, y) for x, y in zip(state_tensors(pool)[:len(before)], before, strict=True))  # (+ c's)
        c.check_invariants(exclusive=False)
        a.step(i32([0]), i32([8]), max_tokens=8)
        c.step(i32([0]), i32([8]), max_tokens=8)
        pages = a.block_table[:, :2].flatten().tolist() + c.block_table[0, :2].tolist()
        assert len({p for p in pages if p >= 0}) == 5, pages
        a.check_invariants(exclusive=False)
        c.check_invariants(exclusive=False)
        a.release(i32([0]))
        del c
    pool.check()



def test_state_tensors_lists_an_owner_then_its_pool_then_the_pools_tables(make_pool):
    """The order its docstring gives (helper-204's mutation run: the pool's state listed before a table's own
    passed every test): an owner's own state, its pool's, then every table on the pool, oldest first, each
    tensor once."""
    pool = make_pool(8)
    a, b = tpool.PageTable(pool, 2, 4), tpool.PageTable(pool, 2, 4)
    mine = {name: list(st.tensors().values()) for name, st in (("pool", pool.state), ("a", a.state),
                                                                ("b", b.state))}
    assert [id(t) for t in state_tensors(b)] == [id(t) for t in mine["b"] + mine["pool"] + mine["a"]]
    assert [id(t) for t in state_tensors(pool)] == [id(t) for t in mine["pool"] + mine["a"] + mine["b"]]
    assert [id(t) for t in state_tensors(a, b)] == [id(t) for t in mine["a"] + mine["pool"] + mine["b"]]

def test_preserved_and_state_tensors_refuse_what_is_not_a_pool_or_table(make_pool):
    """An owner without a pool's or table's state was an AttributeError from deep inside (a HostMirror's
    host bookkeeping, which nothing would restore, or the PoolState itself)."""
    from tpool.scheduling import HostMirror
    pool = make_pool(8)
    mirror = HostMirror(tpool.PageTable(pool, 2, 4), free=8, cached=0)
    for owner in (mirror, pool.state, None):
        with pytest.raises(ValueError, match=rf"owners\[1\]: expected a PagePool or PageTable, got "
                                             rf"{type(owner).__name__}$"):
            with preserved(pool, owner):
                pool.alloc(i32([3]))
        with pytest.raises(ValueError, match=r"owners\[0\]: expected a PagePool or PageTable"):
            state_tensors(owner)
    assert pool.available() == 8


def test_preserved_takes_the_locks_of_two_pools_in_one_order_whatever_order_they_come_in(make_pool, monkeypatch):
    """preserved(a, b) in one thread and preserved(b, a) in another each took one pool's lock and waited
    for the other's, for ever (capture too)."""
    import threading

    from tpool.state import CallLock
    a, b = make_pool(8), make_pool(8)
    taken, enter = [], CallLock.__enter__

    def recording(self):
        taken.append(self)
        return enter(self)
    monkeypatch.setattr(CallLock, "__enter__", recording)
    orders = []
    for owners in ((a, b), (b, a)):
        taken.clear()
        with tpool.graphs._locked(owners):
            orders.append(list(taken))
    assert orders[0] == orders[1] and len(orders[0]) == 2
    monkeypatch.undo()

    def loop(owners, done):
        for _ in range(300):
            with preserved(*owners):
                pass
        done.append(owners)
    done = []
    threads = [threading.Thread(target=loop, args=(o, done), daemon=True) for o in ((a, b), (b, a))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(done) == 2, "preserved deadlocked"


def test_capture_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(RuntimeError, match="needs CUDA"):
        capture(lambda: None)


@pytest.mark.parametrize("warmup", [-1, True, 1.0, "2"])
def test_capture_refuses_a_warmup_that_is_no_count(warmup):
    """range(warmup) took -1 as no warm-up and True as one, and "2" raised TypeError after the checks."""
    with pytest.raises(ValueError, match=f"warmup: expected a non-negative int, got {warmup!r}"):
        capture(lambda: None, warmup=warmup)



def test_capture_refuses_owners_off_cuda_before_running_anything(make_pool, monkeypatch):
    """On a machine with CUDA, capture over a CPU pool (a host tier on numba, say) ran the step for real
    while "capturing" (a CPU kernel does not wait for a replay), left that call's changes in the state
    (nothing restores after the capture) and returned a graph that replays nothing. It is refused first."""
    import types
    pool = make_pool(8)
    table = tpool.PageTable(pool, 2, 4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine, as far as capture asks
    ran = []

    def step():
        ran.append(1)
        table.extend(i32([0]), i32([1]))
    before = [t.clone() for t in state_tensors(table)]
    with pytest.raises(ValueError, match=r"owners\[0\]: expected a PagePool or PageTable on a CUDA device, got "
                                         r"PageTable on cpu"):
        capture(step, table)
    with pytest.raises(ValueError, match=r"owners\[1\]: .* got PagePool on cpu"):
        capture(step, types.SimpleNamespace(device=torch.device("cuda", 0)), pool)
    with pytest.raises(ValueError, match="one CUDA device, got cuda:0, cuda:1"):
        capture(step, *(types.SimpleNamespace(device=torch.device("cuda", i)) for i in (0, 1)))
    assert not ran and all(torch.equal(a, b) for a, b in zip(state_tensors(table), before, strict=True))


def test_capture_refuses_no_owners_before_running_anything(monkeypatch):
    """``capture(step)`` with no owners ran the warm-up for real and restored nothing: two decode steps
    the scheduler never asked for stayed in the table (README: "the warm-up leaves no trace"). It is
    refused before the step runs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine, as far as capture asks
    ran = []
    with pytest.raises(ValueError, match=r"owners: expected at least one PagePool or PageTable .*got none"):
        capture(lambda: ran.append(1))
    assert not ran


# ----------------------------------------------------------------- GPU only
GPU_BACKENDS = ["triton", "reference"]


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_graph_alloc_free_replay_matches_eager(backend):
    dev = "cuda"
    pools = [tpool.PagePool(1024, device=dev, backend=backend) for _ in range(2)]
    counts = torch.tensor([3, 5, 0, 7], dtype=torch.int32, device=dev)
    outs = [p.alloc_out(max_batch=4, max_pages=16) for p in pools]
    hold = [torch.full((16,), -1, dtype=torch.int32, device=dev) for _ in pools]

    def step(i):
        pool, out = pools[i], outs[i]
        pool.free(hold[i])                 # last step's pages
        pool.alloc(counts, out=out)
        hold[i].copy_(out.pages)           # keep this step's pages for the next free
    graph = capture(lambda: step(0), pools[0])
    hold[0].fill_(-1)  # the caller's own tensor: capture restores the pool, not what the warm-up wrote here
    for _ in range(300):
        graph.replay()
        step(1)
    torch.cuda.synchronize()
    for a, b in zip(state_tensors(pools[0]), state_tensors(pools[1]), strict=True):
        assert torch.equal(a, b)
    for p in pools:
        p.check()
        p.check_invariants()
    assert pools[0].stats()["pages.allocated"] == 300 * 15


def _twin_tables(backend, num_pages, B, max_pages, seed):
    """Two identical tables on CUDA with B - 4 prefilled requests (a partly empty batch of B)."""
    dev = "cuda"
    tables = []
    for _ in range(2):
        pool = tpool.PagePool(num_pages, page_size=16, device=dev, backend=backend)
        tables.append(tpool.PageTable(pool, B, max_pages))
    ids = torch.arange(B, dtype=torch.int32, device=dev)
    ids[B - 4:] = -1
    prompts = torch.randint(1, 300, (B,), dtype=torch.int32, generator=torch.Generator().manual_seed(seed)).to(dev)
    for t in tables:
        t.extend(ids, prompts, max_tokens=B * 300)
    return tables, ids, torch.ones(B, dtype=torch.int32, device=dev)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_graph_decode_step_1000_replays_match_eager(backend):
    tables, ids, ones = _twin_tables(backend, 8192, 64, 128, seed=0)

    def step(t):
        t.extend(ids, ones)
        t.flashinfer_csr(ids)
    graph = capture(lambda: step(tables[0]), tables[0])
    for _ in range(1000):
        graph.replay()
        step(tables[1])
    torch.cuda.synchronize()
    for a, b in zip(state_tensors(tables[0]), state_tensors(tables[1]), strict=True):
        assert torch.equal(a, b)
    for x, y in zip(tables[0].flashinfer_csr(ids), tables[1].flashinfer_csr(ids)):
        assert torch.equal(x, y)
    tables[0].pool.check()
    tables[0].check_invariants()


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_graph_bound_step_with_release_replays_match_eager(backend):
    """A scheduler's step captured once: ``bind_step(batch=B, release=2)`` replayed, the finished ids
    written into ``run.release`` before a replay, equals ``step(..., release=gone)`` run eagerly, and
    each replay consumes the ids (they read -1 after it)."""
    B, T, dev = 8, 8 + 2 * 64, "cuda"
    tables = [tpool.PageTable(tpool.PagePool(4096, page_size=16, device=dev, backend=backend), 16, 64)
              for _ in range(2)]
    for t in tables:
        t.extend(i32(list(range(B)), dev), i32([100 + 37 * i for i in range(B)], dev), max_tokens=B * 400)
    run = tables[0].bind_step(batch=B, max_tokens=T, release=2)
    run.req_ids.copy_(torch.arange(B, dtype=torch.int32))
    run.num_tokens.fill_(1)
    graph = capture(run, tables[0])           # the warm-up's release ids are padding: nothing released
    batch, spare = list(range(B)), [B, B + 1]
    for j in range(40):
        gone, ntok = [-1, -1], [1] * B
        if j % 4 == 1:                        # two requests finish, two new ones take their lanes
            gone, batch[:2], spare = batch[:2], spare, batch[:2]
            ntok[:2] = [64, 64]
        run.release.copy_(torch.tensor(gone, dtype=torch.int32))
        run.req_ids.copy_(torch.tensor(batch, dtype=torch.int32))
        run.num_tokens.copy_(torch.tensor(ntok, dtype=torch.int32))
        graph.replay()
        want = tables[1].step(i32(batch, dev), i32(ntok, dev), max_tokens=T, release=i32(gone, dev))
        torch.cuda.synchronize()
        got = run.result
        assert run.release.tolist() == [-1, -1]
        for x, y in zip((got.slots, got.ok, *got.csr, *got.metadata), (want.slots, want.ok, *want.csr, *want.metadata)):
            assert torch.equal(x, y)
    for a, b in zip(state_tensors(tables[0]), state_tensors(tables[1]), strict=True):
        assert torch.equal(a, b)
    tables[0].pool.check()
    tables[0].check_invariants()


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_graph_k_replays_booked_on_a_host_mirror(backend):
    """Multi-step scheduling: a decode step captured once, k replays between two mirror calls, each k
    booked first with ``decode(rows, k, run=False)``: the device ends where the mirror says."""
    from tpool.scheduling import HostMirror
    pool = tpool.PagePool(512, page_size=16, device="cuda", backend=backend)
    table = tpool.PageTable(pool, 8, 32)
    k = 4
    m = HostMirror(table, lookahead=k, free=512, cached=0)
    rows = m.admit([100 + 37 * i for i in range(6)])
    run = table.bind_step(i32(rows, "cuda"), i32([1] * len(rows), "cuda"))
    graph = capture(run, table)           # the warm-up's step is undone: the table is as admitted
    for _ in range(10):
        assert m.decode(rows, k, run=False) is None
        for _ in range(k):
            graph.replay()
        torch.cuda.synchronize()
        assert run.result.ok.all().item()
        assert table.seq_lens[rows].tolist() == m.lo[rows].tolist() == m.hi[rows].tolist()
        assert m.free == pool.available()
    pool.check()
    table.check_invariants()


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_graph_fused_step_replays_match_two_eager_calls(backend):
    """``table.step`` captured once and replayed = ``extend`` + ``flashinfer_csr`` run eagerly."""
    tables, ids, ones = _twin_tables(backend, 4096, 32, 64, seed=1)
    graph = capture(lambda: tables[0].step(ids, ones), tables[0])
    with preserved(tables[0]):   # the buffers the graph writes (table-owned, one set per shape)
        res = tables[0].step(ids, ones)
    for _ in range(300):
        graph.replay()
        e = tables[1].extend(ids, ones)
        c = tables[1].flashinfer_csr(ids)
        torch.cuda.synchronize()
        assert torch.equal(res.slots, e.slots) and torch.equal(res.ok, e.ok)
        for x, y in zip(res.csr, c):
            assert torch.equal(x, y)
    tables[0].pool.check()
    tables[0].check_invariants()


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_first_call_of_a_shape_inside_capture_is_refused(backend):
    """Output buffers made inside capture would hold garbage until the first replay."""
    pool = tpool.PagePool(64, page_size=4, device="cuda", backend=backend)
    table = tpool.PageTable(pool, 4, 4)
    ids = torch.arange(4, dtype=torch.int32, device="cuda")
    ones = torch.ones_like(ids)
    with preserved(table):
        table.extend(ids, ones)                      # compiles the kernel; shape (B=4, max_tokens=4)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="inside CUDA graph capture"):
        with torch.cuda.graph(graph):
            table.extend(ids, ones, max_tokens=8)    # a shape never run before
    assert table.seq_lens.tolist() == [0, 0, 0, 0]


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_a_shape_first_made_inside_capture_over_existing_buffers_is_pinned(backend):
    """A step shape dropped (max_shapes) while other shapes keep both its buffer sets, then run inside
    capture, is a new entry made there: pinned, so dropping shapes later never frees what the graph writes."""
    pool = tpool.PagePool(64, page_size=4, device="cuda", backend=backend)
    table = tpool.PageTable(pool, 4, 4, max_shapes=2)
    ids = torch.arange(4, dtype=torch.int32, device="cuda")
    ones = torch.ones_like(ids)
    with preserved(table):
        table.step(ids, ones, max_tokens=4, capacity=16)  # shape A: outputs ("step", 4, 4), CSR ("step-csr", 4, 16)
        table.step(ids, ones, max_tokens=8, capacity=16)  # B shares A's CSR
        table.step(ids, ones, max_tokens=4, capacity=32)  # C shares A's outputs; A is dropped, its buffers kept
    assert ("step", 4, 4, 16) not in table._shapes.entries
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with preserved(table), torch.cuda.graph(graph):
        table.step(ids, ones, max_tokens=4, capacity=16)
    assert ("step", 4, 4, 16) in table._shapes.pinned


@requires_cuda
@pytest.mark.gpu
def test_a_free_inside_capture_in_a_group_opened_outside_it_is_refused():
    """The group's buffer positions are decided on the host: captured, every replay would fill the same
    ones and the flush after the capture free one replay's pages."""
    pool = tpool.PagePool(64, page_size=4, device="cuda", backend="reference")
    pages = pool.alloc(torch.tensor([2], dtype=torch.int32, device="cuda")).pages[:2].clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pool.free_group(capacity=8):
        with pytest.raises(RuntimeError, match="free group opened outside the CUDA graph"):
            with torch.cuda.graph(graph):
                pool.free(pages)
    assert pool.available() == 62  # refused before the copy: the group's flush found nothing to free
    pool.free(pages)
    assert pool.available() == 64


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_hot_path_under_cuda_sync_debug_error(backend):
    """The CPU guard's sequence of hot-path calls (``conftest.hot_path_calls``: every pool and table call,
    the bound forms, revive with and without generations) makes no host sync on CUDA."""
    run, pool, table = hot_path_calls(backend, "cuda")
    run()                                       # the first calls compile and make buffers: they may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    pool.check()
    table.check_invariants()
    assert pool.stats()["pages.revived"] == 4


def test_preserved_restores_the_state_when_the_block_raises(make_pool):
    pool = make_pool(8)
    table = tpool.PageTable(pool, max_requests=2, max_pages_per_request=4)
    before = [t.clone() for t in state_tensors(table)]
    with pytest.raises(RuntimeError, match="boom"):
        with preserved(table):
            pool.alloc(i32([3]))
            assert table.extend(i32([0]), i32([3]), max_tokens=3).ok.tolist() == [True]
            raise RuntimeError("boom")
    assert all(torch.equal(a, b) for a, b in zip(state_tensors(table), before, strict=True))
    assert pool.available() == 8 and table.seq_lens.tolist() == [0, 0]
    pool.check()
