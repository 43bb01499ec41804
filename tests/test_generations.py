"""Page generations on every CPU backend: bumped exactly when a page becomes FREE, read by
``PagePool.generations``, compared by ``PageTable.revive(..., generations=)`` so a stale prefix-cache
entry (a page evicted and handed to another request since) is refused instead of shared."""

import pytest
import torch

import tpool
from conftest import i32
from tpool.errors import UseAfterFree
from tpool.kernels import layout as L
from tpool.scheduling import HostMirror

SCRATCH = {"keys", "lane_end", "version", "row_version"}  # versions come from one process-wide counter


def gens(pool):
    return pool.state.page_gen.tolist()


def uaf(pool):
    return pool.stats()["errors.use_after_free"]


def state(table) -> dict:
    out = {}
    for prefix, st in (("pool.", table.pool.state), ("table.", table.state)):
        out.update({prefix + name: t.clone() for name, t in st.tensors().items() if name not in SCRATCH})
    return out


def test_a_fresh_pool_is_generation_zero(make_pool):
    pool = make_pool(5)
    assert pool.state.page_gen.dtype == torch.int32 and gens(pool) == [0] * 5


def test_pool_calls_bump_only_pages_that_become_free(make_pool, guard):
    pool = make_pool(8, page_size=2)
    with guard():
        pool.alloc(i32([4]))                      # pages 0-3: popped, generations kept
        pool.incref(i32([0, 0]))                  # page 0: three references
        pool.touch(i32([0, 1, 2, 3]))
    assert gens(pool) == [0] * 8
    with guard():
        pool.free(i32([1]))                       # last reference, no cache: FREE
        pool.free(i32([2]), cache=True)           # CACHED, not FREE
        pool.free(i32([0]))                       # a shared page's non-last free
    assert gens(pool) == [0, 1, 0, 0, 0, 0, 0, 0]
    with guard():
        pool.free(i32([0, 0, 3, 3]))              # page 0's last two; page 3 once and a double free
    assert gens(pool) == [1, 1, 0, 1, 0, 0, 0, 0] and pool.stats()["errors.double_free"] == 1
    with guard():
        ev = pool.evict(4)                        # page 2, the one CACHED page: FREE
    assert ev.tolist() == [2, -1, -1, -1] and gens(pool) == [1, 1, 1, 1, 0, 0, 0, 0]
    with guard():
        a = pool.alloc(i32([8]))                  # every page, generations kept
        pool.free(a.pages[:4], cache=True)
        pool.incref(a.pages[:1])                  # a CACHED page revived: no change
    assert gens(pool) == [1, 1, 1, 1, 0, 0, 0, 0]
    first = a.pages[:4].tolist()
    with guard():
        b = pool.alloc(i32([3]), evict=True)      # the shortfall evicted: those pages bumped
    evicted = [p for p in b.evicted.tolist() if p >= 0]
    assert len(evicted) == 3 and set(evicted) <= set(first[1:])
    assert gens(pool) == [g + (p in evicted) for p, g in enumerate([1, 1, 1, 1, 0, 0, 0, 0])]
    pool.check_invariants()


def test_the_generation_wraps_within_non_negative_int32(make_pool, guard):
    pool = make_pool(3)
    pool.state.page_gen[0] = L.INT32_MAX
    pool.state.page_gen[1] = L.INT32_MAX - 1
    with guard():
        pool.alloc(i32([2]))
        pool.free(i32([0, 1]))
    assert gens(pool)[:2] == [0, L.INT32_MAX]


def test_table_calls_bump_only_pages_that_become_free(backend, guard):
    pool = tpool.PagePool(16, 2, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 6, 4)
    with guard():
        table.extend(i32([0, 1, 2]), i32([8, 4, 6]), max_tokens=18)   # rows 0: 0-3, 1: 4-5, 2: 6-8
        table.fork(i32([0]), i32([3]), i32([4]))                      # row 3 shares pages 0, 1
    assert gens(pool) == [0] * 16
    with guard():
        table.truncate(i32([0]), i32([2]))        # drops pages 1, 2, 3: 1 still held by row 3
    assert gens(pool)[:4] == [0, 0, 1, 1]
    with guard():
        table.release(i32([3]))                   # page 0 still held by row 0; page 1 FREE now
        table.release(i32([1]), cache=True)       # pages 4, 5: CACHED
    assert gens(pool)[:9] == [0, 1, 1, 1, 0, 0, 0, 0, 0]
    with guard():
        table.release(i32([2]))                   # pages 6, 7, 8: FREE
        table.step(i32([0]), i32([1]), release=i32([-1]))             # a decode step frees nothing
    assert gens(pool)[:9] == [0, 1, 1, 1, 0, 0, 1, 1, 1]
    new = table.block_table[0, 1].item()          # the decode step's page
    assert new >= 0
    with guard():
        table.step(i32([4]), i32([2]), release=i32([0]))              # a step's release: pages 0, new FREE
    assert gens(pool)[0] == 1 and gens(pool)[new] == 1 + (new in (1, 2, 3, 6, 7, 8))
    table.check_invariants()


def test_bound_step_release_bumps(backend, guard):
    pool = tpool.PagePool(8, 1, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 4, 4)
    run = table.bind_step(batch=2, max_tokens=4, release=1)
    run.req_ids[:] = torch.tensor([0, 1], dtype=torch.int32)
    run.num_tokens[:] = torch.tensor([2, 1], dtype=torch.int32)
    with guard():
        run()                                     # row 0: pages 0, 1; row 1: page 2
    run.req_ids[:] = torch.tensor([0, -1], dtype=torch.int32)
    run.num_tokens[:] = torch.tensor([1, 0], dtype=torch.int32)
    run.release[0] = 1
    with guard():
        run()                                     # releases row 1 (page 2), then row 0 takes page 2 again
    assert gens(pool)[:4] == [0, 0, 1, 0] and table.block_table[0, :3].tolist() == [0, 1, 2]


def test_generations_reads_them_on_the_device(make_pool, guard):
    pool = make_pool(4)
    pool.alloc(i32([2]))
    pool.free(i32([1]))
    out = torch.full((5,), 7, dtype=torch.int32)
    with guard():
        g = pool.generations(i32([1, -1, 0, 4, -9]))
        r = pool.generations(i32([1, -1, 0, 4, -9]), out=out)
    assert g.tolist() == [1, -1, 0, -1, -1] and g.dtype == torch.int32 and r is out and out.tolist() == g.tolist()
    assert pool.generations(i32([])).tolist() == []


@pytest.mark.parametrize("call, match", [
    (lambda p: p.generations(torch.tensor([0], dtype=torch.int64)), "pages: expected dtype torch.int32"),
    (lambda p: p.generations(i32([[0]])), "pages: expected a 1-D tensor"),
    (lambda p: p.generations(i32([0, 1, 2, 3])[::2]), "pages: expected a contiguous tensor"),
    (lambda p: p.generations(i32([0, 1]), out=torch.zeros(3, dtype=torch.int32)), "out: expected 2 entries"),
    (lambda p: p.generations(i32([0]), out=torch.zeros(1, dtype=torch.int64)), "out: expected dtype torch.int32"),
    (lambda p: p.generations(i32([0]), out=p.state.page_gen[:1]), "shares memory"),
])
def test_generations_checks_its_inputs(make_pool, call, match):
    pool = make_pool(4)
    with pytest.raises(ValueError, match=match):
        call(pool)


def _stale_setup(backend):
    """Row 0 held pages that went into the prefix cache (generations recorded), were evicted and handed
    to row 1. Returns (pool, table, the entry's pages, their recorded generations)."""
    pool = tpool.PagePool(4, 2, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 3, 2)
    table.extend(i32([0]), i32([4]), max_tokens=4)             # row 0: pages 0, 1
    pages = table.block_table[0].clone()
    recorded = pool.generations(pages)                          # while the request holds them
    table.release(i32([0]), cache=True)
    assert pool.generations(pages).tolist() == recorded.tolist() == [0, 0]  # CACHED: unchanged
    pool.evict(2)
    table.extend(i32([1]), i32([4]), max_tokens=4)             # the same two pages, for row 1
    assert sorted(table.block_table[1].tolist()) == sorted(pages.tolist())
    return pool, table, pages, recorded


def test_a_stale_entry_is_refused_and_counted(backend, guard):
    pool, table, pages, recorded = _stale_setup(backend)
    before_rows, before_rc = table.block_table[1].tolist(), pool.state.refcount.tolist()
    with guard():
        table.revive(2, pages, 4, generations=recorded)
    assert table.block_table[2].tolist() == [-1, -1] and table.seq_lens.tolist() == [0, 4, 0]
    assert table.block_table[1].tolist() == before_rows and pool.state.refcount.tolist() == before_rc
    assert uaf(pool) == 2 and pool.stats()["pages.revived"] == 0
    with pytest.raises(UseAfterFree):
        pool.check()
    table.check_invariants()
    with guard():                                               # the same entry, re-recorded: a (shared) hit
        table.revive(2, pages, 4, generations=pool.generations(pages))
    assert table.block_table[2].tolist() == pages.tolist() and pool.state.refcount[:2].tolist() == [2, 2]


def test_without_generations_a_stale_entry_is_shared(backend, guard):
    """The behaviour generations fix: the state alone cannot tell, the pages are shared."""
    pool, table, pages, _ = _stale_setup(backend)
    with guard():
        table.revive(2, pages, 4)
    assert table.block_table[2].tolist() == pages.tolist() and uaf(pool) == 0


def test_one_stale_page_refuses_the_whole_entry(backend, guard):
    pool = tpool.PagePool(6, 1, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 3, 3)
    table.extend(i32([0]), i32([3]), max_tokens=3)             # pages 0, 1, 2
    pages = table.block_table[0].clone()
    recorded = pool.generations(pages)
    table.release(i32([0]), cache=True)
    pool.touch(i32([0, 2]))                                    # page 1 the oldest: evicted next
    assert pool.evict(1).tolist() == [1]
    pool.alloc(i32([1]))                                       # ... and handed out again
    with guard():
        table.revive(1, pages, 3, generations=recorded)
    assert table.block_table[1].tolist() == [-1, -1, -1] and table.seq_lens.tolist() == [0, 0, 0]
    assert pool.state.page_state[:3].tolist() == [L.CACHED, L.USED, L.CACHED]  # nothing revived
    assert pool.state.refcount[:3].tolist() == [0, 1, 0] and uaf(pool) == 1
    with guard():                                              # the still-fresh pages alone: a hit
        table.revive(2, pages[[0, 2]].contiguous(), 2, generations=recorded[[0, 2]].contiguous())
    assert table.block_table[2].tolist() == [0, 2, -1] and pool.stats()["pages.revived"] == 2


def test_an_evicted_page_still_free_counts_once(backend, guard):
    """A FREE page counts use_after_free as without generations (once per entry), not twice."""
    pool = tpool.PagePool(4, 1, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 2, 2)
    table.extend(i32([0]), i32([2]), max_tokens=2)
    pages = table.block_table[0].clone()
    recorded = pool.generations(pages)
    table.release(i32([0]), cache=True)
    pool.evict(2)
    with guard():
        table.revive(1, pages, 2, generations=recorded)
    assert uaf(pool) == 2 and table.seq_lens.tolist() == [0, 0]


@pytest.mark.parametrize("seed", range(4))
def test_a_fresh_entry_revives_as_without(backend, guard, seed):
    def build():
        pool = tpool.PagePool(9, 2, device="cpu", backend=backend)
        table = tpool.PageTable(pool, 4, 3)
        table.extend(i32([0, 1]), i32([6, 3 + seed]), max_tokens=12)
        table.fork(i32([0]), i32([2]), i32([4]))
        table.release(i32([0]), cache=True)
        pool.evict(seed % 2)
        return pool, table
    pool_a, a = build()
    pool_b, b = build()
    pages = a.block_table[2, :2].clone()
    recorded = pool_a.generations(pages)
    assert torch.equal(recorded, pool_b.generations(pages))
    with guard():
        a.revive(3, pages, 4)
        b.revive(3, pages, 4, generations=recorded)
    sa, sb = state(a), state(b)
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    assert b.block_table[3, :2].tolist() == pages.tolist()
    pool_b.check()


def test_revive_checks_generations(backend):
    pool = tpool.PagePool(4, 2, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 2, 2)
    pages = i32([0, 1])
    for g, match in ((torch.zeros(2, dtype=torch.int64), "generations: expected dtype torch.int32"),
                     (i32([0]), "generations: expected 2 entries"),
                     (i32([0, 0, 0, 0])[::2], "generations: expected a contiguous tensor"),
                     (i32([[0, 0]]), "generations: expected a 1-D tensor"),
                     (pool.state.page_gen[:2], "generations.*shares memory"),
                     (table.seq_lens, "generations.*shares memory")):
        with pytest.raises(ValueError, match=match):
            table.revive(0, pages, 4, generations=g)
    assert pool.stats()["clock"] == 0  # refused before any device work


def test_the_mirror_passes_generations(backend, guard):
    pool = tpool.PagePool(8, 4, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 4, 4)
    m = HostMirror(table, lookahead=1, free=8, cached=0)
    (a,) = m.admit([8], [8])
    pages = table.block_table[a, :2].clone()
    recorded = pool.generations(pages)
    m.finish([a], cache=True)
    m.evict(2)
    (b,) = m.admit([16], [16])                                 # the evicted pages among its four
    assert set(pages.tolist()) <= set(table.block_table[b].tolist())
    with pytest.raises(ValueError, match="generations: expected 2 entries"):
        m.revive(pages, 8, generations=recorded[:1])
    with guard():
        c = m.revive(pages, 8, generations=recorded)
    assert table.seq_lens[c].item() == 0 and table.block_table[c, :2].tolist() == [-1, -1]
    assert table.seq_lens[b].item() == 16 and uaf(pool) == 2
