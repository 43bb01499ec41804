"""Cached pages, LRU stamps, revival and eviction on every CPU backend."""

import pytest
import torch

import tpool
from conftest import i32
from pool_model import PoolModel


def test_cached_pages_are_not_free_and_keep_their_stamp(make_pool, guard):
    pool = make_pool(8)
    with guard():
        pool.alloc(i32([4]))            # clock 1
        pool.free(i32([1, 3]), cache=True)  # clock 2
    s = pool.stats()
    assert pool.available() == 4 and s["pages.cached.current"] == 2 and s["pages.used.current"] == 2
    assert pool.state.stamp[[1, 3]].tolist() == [2, 2]
    assert pool.state.page_state.tolist()[:4] == [1, 2, 1, 2]
    pool.check_invariants()


def test_evict_oldest_first_ties_by_page_id(make_pool, guard):
    pool = make_pool(8)
    with guard():
        pool.alloc(i32([6]))                     # clock 1: pages 0..5
        pool.free(i32([5, 2]), cache=True)       # clock 2: stamps 2
        pool.free(i32([4]), cache=True)          # clock 3
        pool.free(i32([0, 3]), cache=True)       # clock 4
        pool.touch(i32([2]))                     # clock 5: page 2 is now the youngest
        out = pool.evict(4)
    assert out.tolist() == [5, 4, 0, 3]
    with guard():
        rest = pool.evict(3)
    assert rest.tolist() == [2, -1, -1]
    assert pool.available() == 7 and pool.stats()["pages.evicted"] == 5
    pool.check_invariants()


def test_evicted_pages_are_pushed_oldest_first(make_pool, guard):
    pool = make_pool(4)
    with guard():
        pool.alloc(i32([4]))
        pool.free(i32([2]), cache=True)
        pool.free(i32([0]), cache=True)
        pool.evict(2)                    # pushes 2 then 0
        r = pool.alloc(i32([2]))
    assert r.pages.tolist()[:2] == [0, 2]


def test_used_pages_are_never_evicted(make_pool, guard):
    pool = make_pool(4)
    with guard():
        pool.alloc(i32([4]))
        pool.free(i32([0, 1]), cache=True)
        pool.incref(i32([0]))            # a prefix hit revives page 0: pinned again
        out = pool.evict(4)
    assert out.tolist() == [1, -1, -1, -1]
    s = pool.stats()
    assert s["pages.revived"] == 1 and s["pages.used.current"] == 3
    assert pool.state.refcount[0].item() == 1
    pool.check_invariants()


def test_evict_more_than_the_pool(make_pool, guard):
    pool = make_pool(3)
    with guard():
        pool.alloc(i32([3]))
        pool.free(i32([2, 1, 0]), cache=True)
        out = pool.evict(5)                    # never longer than the pool: [min(k, num_pages)]
        pool.alloc(i32([3]))
        pool.free(i32([0, 1, 2]), cache=True)
        given = pool.evict(5, out=torch.full((5,), 7, dtype=torch.int32))
    assert out.tolist() == [0, 1, 2] and given.tolist() == [0, 1, 2, -1, -1]


def test_alloc_with_evict_takes_only_the_shortfall(make_pool, guard):
    pool = make_pool(8)
    with guard():
        pool.alloc(i32([8]))                        # clock 1
        pool.free(i32([6, 7]))                      # 2 free
        pool.free(i32([3]), cache=True)             # clock 3
        pool.free(i32([1, 5]), cache=True)          # clock 4
        r = pool.alloc(i32([2, 2]), evict=True)     # needs 4: 2 free + 2 oldest cached
    assert r.ok.tolist() == [True, True]
    assert r.evicted.tolist() == [3, 1, -1, -1, -1, -1, -1, -1]
    # evicted 3, 1 pushed above the free 6, 7 ; pops: 1, 3, 7, 6
    assert r.pages.tolist()[:4] == [1, 3, 7, 6]
    s = pool.stats()
    assert s["pages.cached.current"] == 1 and s["pages.evicted"] == 2 and pool.available() == 0
    pool.check_invariants()


def test_alloc_without_evict_ignores_cached_pages(make_pool, guard):
    pool = make_pool(4)
    with guard():
        pool.alloc(i32([4]))
        pool.free(i32([0, 1]), cache=True)
        r = pool.alloc(i32([1]))
        r2 = pool.alloc(i32([3]), evict=True)   # 2 cached: not enough, nothing evicted
    assert r.ok.tolist() == [False] and r2.ok.tolist() == [False]
    assert r2.evicted.tolist() == [-1] * 4
    assert pool.stats()["pages.cached.current"] == 2


def test_free_of_cached_page_is_double_free(make_pool, guard):
    pool = make_pool(4)
    with guard():
        pool.alloc(i32([1]))
        pool.free(i32([0]), cache=True)
        pool.free(i32([0]))
    with pytest.raises(tpool.DoubleFree):
        pool.check()
    assert pool.stats()["pages.cached.current"] == 1


def test_random_cache_workload_matches_model(make_pool, guard, seed):
    import random
    rng = random.Random(seed)
    P = 24
    pool, model = make_pool(P, max_alloc_pages=P), PoolModel(P)
    live = []
    for _ in range(60):
        op = rng.choice(["alloc", "alloc_evict", "free", "free_cache", "incref", "touch", "evict"])
        if op.startswith("alloc"):
            counts = [rng.randint(0, 5) for _ in range(rng.randint(1, 3))]
            with guard():
                r = pool.alloc(i32(counts), evict=op == "alloc_evict")
            exp = model.alloc(counts, P, evict=op == "alloc_evict")
            assert (r.pages.tolist(), r.indptr.tolist(), r.ok.tolist(), r.evicted.tolist()) == exp
            live += [p for p in r.pages.tolist() if p >= 0]
        elif op == "evict":
            k = rng.randint(0, 6)
            with guard():
                out = pool.evict(k)
            assert out.tolist() == model.evict(k)
        else:
            ids = rng.sample(range(P), 3) + live[:2]
            call = {"free": pool.free, "free_cache": lambda t: pool.free(t, cache=True),
                    "incref": pool.incref, "touch": pool.touch}[op]
            with guard():
                call(i32(ids))
            {"free": model.free, "free_cache": lambda x: model.free(x, cache=True),
             "incref": model.incref, "touch": model.touch}[op](ids)
            if op.startswith("free"):
                live = live[2:]
        model.assert_matches(pool)
        pool.check_invariants()


@pytest.mark.parametrize("jump", [5000, 3 * 2**40])
def test_eviction_order_when_stamps_span_far(make_pool, guard, jump):
    """Stamps spread over more clock values than one histogram round covers (radix rounds)."""
    import random
    rng = random.Random(jump)
    P = 48
    pool, model = make_pool(P, max_alloc_pages=P), PoolModel(P)
    with guard():
        pool.alloc(i32([P]))
    model.alloc([P], P)
    pages = list(range(P))
    rng.shuffle(pages)
    for chunk in range(6):
        ids = pages[chunk * 7:(chunk + 1) * 7]
        with guard():
            pool.free(i32(ids), cache=True)
        model.free(ids, cache=True)
        pool.state.counters[2] += jump        # the clock (layout.CLOCK) moves far between releases
        model.clock += jump
    for k in (1, 5, 9, 40):
        with guard():
            out = pool.evict(k)
        assert out.tolist() == model.evict(k)
        model.assert_matches(pool)
        with guard():
            r = pool.alloc(i32([3]))
            pool.free(r.pages[:3].clone(), cache=True)
        exp = model.alloc([3], P)
        model.free(exp[0][:3], cache=True)
    pool.check_invariants()


def test_reused_alloc_out_is_repadded(make_pool, guard):
    """A reused AllocOut shows only this call's pages and evictions (numba pads only what it wrote)."""
    pool = make_pool(8)
    out = pool.alloc_out(max_batch=1, max_pages=8)
    with guard():
        pool.alloc(i32([8]))
        pool.free(i32([0, 1, 2, 3, 4]), cache=True)
        a = pool.alloc(i32([5]), out=out, evict=True)
    assert a.evicted.tolist()[:5] == [0, 1, 2, 3, 4] and a.pages.tolist()[5:] == [-1] * 3
    with guard():
        pool.free(i32([0, 1, 2, 3, 4]))
        b = pool.alloc(i32([2]), out=out, evict=True)     # free pages suffice: nothing evicted
    assert b.evicted.tolist() == [-1] * 8 and b.pages.tolist()[2:] == [-1] * 6
    with guard():
        c = pool.alloc(i32([1]), out=out)
    assert c.evicted.tolist() == [-1] * 8 and c.pages.tolist()[1:] == [-1] * 7


@pytest.mark.parametrize("span, chunks", [(2**24 + 3, "wide"), (2**32 + 1, "wide"), (2**62, "wide"),
                                          (2**32 + 1, "chunked")])
def test_eviction_order_many_ties_over_wide_stamps(make_pool, backend, guard, monkeypatch, span, chunks):
    """Thousands of cached pages, stamps over more than 2**24 clock values (up to 4, 5 and 8 radix
    passes of the Triton sort, fewer for small evictions) with many ties: evictions of various
    sizes, k beyond the cached count, every cached page at once, and an alloc that evicts, all
    bit for bit as the reference and in (stamp, id) order. ``chunked``: 32-lane chunks and
    16-item sort chunks (Triton only)."""
    import random
    from tpool.kernels import layout as L
    if chunks == "chunked":
        if backend != "triton":
            pytest.skip("chunk sizes are Triton launch settings")
        from tpool.kernels import _triton_util
        monkeypatch.setattr(_triton_util, "MAX_BLOCK", 32)
        monkeypatch.setattr(_triton_util, "RANK_BLOCK", 16)
    rng = random.Random(span)
    P = 320 if chunks == "chunked" else 5000
    pool = make_pool(P, max_alloc_pages=P)
    ref = tpool.PagePool(P, device="cpu", backend="reference", max_alloc_pages=P)
    pools = (pool, ref)

    def same_state():
        for name in ("refcount", "page_state", "stamp", "counters"):
            assert getattr(pool.state, name).tolist() == getattr(ref.state, name).tolist(), name
        n = int(ref.state.counters[L.FREE_COUNT])
        assert pool.state.free_stack[:n].tolist() == ref.state.free_stack[:n].tolist()

    def cache(ids):
        """Release ``ids`` into the cache, then stamp them by hand: few distinct values (ties)
        spread over [0, span], both ends included; the clock moves to span (no stamp is later)."""
        values = [0, span] + [rng.randint(0, span) for _ in range(len(ids) // 12)]
        stamps = [rng.choice(values) for _ in ids]
        for p in pools:
            with guard():
                p.free(i32(ids), cache=True)
            p.state.counters[L.CLOCK] = max(int(p.state.counters[L.CLOCK]), span)
            p.state.stamp[torch.tensor(ids, dtype=torch.long)] = torch.tensor(stamps, dtype=torch.int64)

    def evict(k):
        st = ref.state
        cached, stamps = (st.page_state == L.CACHED).nonzero().flatten().tolist(), st.stamp.tolist()
        expected = sorted(cached, key=lambda q: (stamps[q], q))[:k]
        top = int(st.counters[L.FREE_COUNT])
        outs = []
        for p in pools:
            with guard():
                outs.append(p.evict(k))
        got = outs[0].tolist()
        assert got == outs[1].tolist()
        assert got == (expected + [-1] * (k - len(expected)))[:P]
        assert pool.state.free_stack[top:top + len(expected)].tolist() == expected
        same_state()

    for p in pools:
        with guard():
            p.alloc(i32([P]))
    pages = list(range(P))
    rng.shuffle(pages)
    cache(pages[:P * 4 // 5])
    for k in (1, 7, 300, 64, 129, 1000):
        evict(k)
    left = int(ref.state.counters[L.CACHED_COUNT])
    evict(left + 50)                       # more than is cached: all of it, out padded
    evict(3)                               # nothing cached: all -1
    used = (ref.state.page_state == L.USED).nonzero().flatten().tolist()
    cache(used)
    evict(int(ref.state.counters[L.CACHED_COUNT]))   # exactly every cached page
    with guard():
        r = [p.alloc(i32([P])) for p in pools]        # every page: no cache to evict
    cache(list(range(0, P, 2)))
    cache(list(range(1, P, 4)))            # a second release: two stamp sets
    with guard():
        r = [p.alloc(i32([P // 2, P // 4]), evict=True) for p in pools]  # the free and then ~P/2 evicted
    assert r[0].evicted.tolist() == r[1].evicted.tolist() and r[0].pages.tolist() == r[1].pages.tolist()
    assert sum(q >= 0 for q in r[0].evicted.tolist()) > P // 3
    same_state()
    evict(P)                               # k = the pool, more than is cached
    pool.check_invariants()
