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


def test_evict_oldest_first_ties_in_last_occurrence_order(make_pool, guard):
    pool = make_pool(8)
    with guard():
        pool.alloc(i32([6]))                     # clock 1: pages 0..5
        pool.incref(i32([3]))                    # clock 2: page 3 has two references
        pool.free(i32([5, 2]), cache=True)       # clock 3: stamps 3
        pool.free(i32([4]), cache=True)          # clock 4
        pool.free(i32([3, 0, 3]), cache=True)    # clock 5: 0 first, then 3 (its last occurrence)
        pool.touch(i32([2]))                     # clock 6: page 2 is now the youngest
        out = pool.evict(4)
    assert out.tolist() == [5, 4, 0, 3]
    with guard():
        rest = pool.evict(3)
    assert rest.tolist() == [2, -1, -1]
    assert pool.available() == 7 and pool.stats()["pages.evicted"] == 5
    pool.check_invariants()


def test_free_into_the_cache_queues_a_repeated_page_at_its_last_occurrence(make_pool, guard):
    """``free(pages, cache=True)`` queues each page it caches at its LAST occurrence in the input; the
    references dropped and the double frees are counted as before, and a free without the cache still
    pushes pages in the order of their first occurrence."""
    pages = [0, 1, 2, 1, 3, 4, 1, 5, 4, 4]      # page 1 three times (three references), page 4 three (two)
    model = PoolModel(8)
    for cache in (True, False):
        pool = make_pool(8)
        with guard():
            pool.alloc(i32([6]))                 # pages 0..5
            pool.incref(i32([1, 1, 4]))
            pool.free(i32(pages), cache=cache)
        assert pool.stats()["errors.double_free"] == 1
        if cache:
            model.alloc([6], 8)
            model.incref([1, 1, 4])
            model.free(pages, cache=True)
            model.assert_matches(pool)
        with guard():
            out = pool.evict(8) if cache else pool.alloc(i32([6])).pages[:6]
        if cache:
            assert out.tolist() == [0, 2, 3, 1, 5, 4] + [-1, -1] == model.evict(8)
            model.assert_matches(pool)
        else:                                    # pushed 0, 1, 2, 3, 4, 5: popped from the top
            assert out.tolist() == [5, 4, 3, 2, 1, 0]
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
    assert out.tolist() == [2, 1, 0] and given.tolist() == [0, 1, 2, -1, -1]


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
    """Stamps spread far apart (the clock moved by hand between releases): the order is still the
    order in which pages were cached."""
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


@pytest.mark.parametrize("chunks", ["wide", "chunked"])
def test_eviction_order_over_long_churn(make_pool, backend, guard, monkeypatch, chunks):
    """Thousands of pages through the cache: releases in shuffled order (ties in first-occurrence
    order), touches and revives of cached pages (stale queue entries), evictions of various sizes,
    k beyond the cached count, every cached page at once, allocs that evict, and enough pushes for
    the LRU queue's cleaner to run passes to the end (the tail brought back) and to leave gaps that
    evictions step over. Every eviction as the model's and as the reference's, bit for bit, queue
    included. ``chunked``: 32-lane chunks (Triton only)."""
    import random
    from tpool.kernels import layout as L
    if chunks == "chunked":
        if backend != "triton":
            pytest.skip("chunk sizes are Triton launch settings")
        from tpool.kernels import _triton_util
        monkeypatch.setattr(_triton_util, "MAX_BLOCK", 32)
    rng = random.Random(7)
    P = 320 if chunks == "chunked" or backend == "triton" else 3000
    pool = make_pool(P, max_alloc_pages=P)
    ref = tpool.PagePool(P, device="cpu", backend="reference", max_alloc_pages=P)
    model = PoolModel(P)
    pools = (pool, ref)
    seen = dict(passes=0, gaps=0, jumps=0)

    def run(call, model_call):
        c = ref.state.counters
        head, tail, hole, scan = (int(c[k]) for k in (L.LRU_HEAD, L.LRU_TAIL, L.LRU_HOLE, L.LRU_SCAN))
        outs = []
        for p in pools:
            with guard():
                outs.append(call(p))
        if int(c[L.LRU_HEAD]) == head and int(c[L.LRU_TAIL]) >= tail and int(c[L.LRU_SCAN]) >= scan:
            # (no eviction, no pass ended): the cleaner read no more than its share
            assert int(c[L.LRU_SCAN]) - scan <= L.LRU_CLEAN_RATE * (int(c[L.LRU_TAIL]) - tail)
        seen["passes"] += int(c[L.LRU_TAIL]) < tail                    # a cleaning pass ended
        seen["gaps"] += int(c[L.LRU_HOLE]) < int(c[L.LRU_SCAN])         # a gap was left
        seen["jumps"] += hole < scan and int(c[L.LRU_HEAD]) > scan     # an eviction stepped over one
        exp = model_call()
        for name in ("refcount", "page_state", "stamp", "counters", "free_stack", "lru_queue", "lru_pos"):
            assert torch.equal(getattr(pool.state, name), getattr(ref.state, name)), name
        model.assert_matches(pool)
        return outs, exp

    run(lambda p: p.alloc(i32([P])), lambda: model.alloc([P], P))
    used = list(range(P))
    for rnd in range(14):
        rng.shuffle(used)
        k = len(used) * rng.choice([1, 2, 3]) // 4
        ids, used = used[:k], used[k:]
        run(lambda p: p.free(i32(ids), cache=True), lambda: model.free(ids, cache=True))
        cached = [q for q in range(P) if model.state[q] == 2]
        for _ in range(3):
            hot = rng.sample(cached, len(cached) // 3) + rng.sample(range(P), 5)
            run(lambda p: p.touch(i32(hot)), lambda: model.touch(hot))
        back = rng.sample(cached, len(cached) // 6)
        run(lambda p: p.incref(i32(back)), lambda: model.incref(back))
        used += back
        for k in (1, 7, 64, 129):
            outs, exp = run(lambda p: p.evict(k), lambda: model.evict(k))
            assert outs[0].tolist() == outs[1].tolist() == exp[:P]
        n = rng.randint(1, P // 3)
        outs, exp = run(lambda p: p.alloc(i32([n, 2]), evict=True), lambda: model.alloc([n, 2], P, evict=True))
        assert outs[0].evicted.tolist() == outs[1].evicted.tolist() == exp[3]
        used += [q for q in outs[0].pages.tolist() if q >= 0]
    from tpool.backends.reference import lru_live
    run(lambda p: p.free(i32(used), cache=True), lambda: model.free(used, cache=True))  # every page cached
    c = ref.state.counters
    for _ in range(100):  # touch until the cleaner leaves a gap ...
        if int(c[L.LRU_HOLE]) < int(c[L.LRU_SCAN]):
            break
        hot = rng.sample(range(P), P // 3)
        run(lambda p: p.touch(i32(hot)), lambda: model.touch(hot))
    live, _, pos = lru_live(ref.state)
    k = int((live & (pos < c[L.LRU_HOLE])).sum()) + 1  # ... then evict up to the first entry past it
    outs, exp = run(lambda p: p.evict(k), lambda: model.evict(k))
    assert outs[0].tolist() == exp[:P]
    for _ in range(30):  # and on, through whole passes
        cached = [q for q in range(P) if model.state[q] == 2]
        hot = rng.sample(cached, len(cached) // 3)
        run(lambda p: p.touch(i32(hot)), lambda: model.touch(hot))
    left = model.cached()
    outs, exp = run(lambda p: p.evict(left + 50), lambda: model.evict(left + 50))  # all of it, padded
    assert outs[0].tolist()[:left] == exp[:left] and exp[left:] == [-1] * 50
    outs, exp = run(lambda p: p.evict(3), lambda: model.evict(3))                     # nothing cached
    assert outs[0].tolist() == [-1] * 3
    assert seen["passes"] >= 2 and seen["gaps"] >= 2 and seen["jumps"] >= 1, seen
    pool.check_invariants()


def test_a_queue_past_its_room_is_compacted_at_once(make_pool, backend, guard):
    """A queue built by hand (consistent: ``check_invariants`` passes) that spans more than ``Q - P``
    positions, with a gap: the next call that may push first compacts it whole (the live entries
    down to the head, in order, no gap left), on every backend as on the reference, and eviction
    order is kept."""
    import random
    from tpool.kernels import layout as L
    P = 16
    Q = L.LRU_FACTOR * P
    rng = random.Random(5)
    order = rng.sample(range(P), P)  # the eviction order the queue holds
    head, hole, scan, tail = 7, 7 + P + 1, 7 + 2 * P, 7 + Q - P + 3
    places = sorted(rng.sample([j for j in range(head, tail) if not hole <= j < scan], P))
    pools = (make_pool(P, max_alloc_pages=P), tpool.PagePool(P, device="cpu", backend="reference", max_alloc_pages=P))
    for pool in pools:
        pool.alloc(i32([P]))
        pool.free(i32(list(range(P))), cache=True)
        st = pool.state
        st.lru_queue.fill_(order[0])  # stale everywhere but at its own place (the gap is never read)
        for p, j in zip(order, places):
            st.lru_queue[j % Q] = p
            st.lru_pos[p] = j
        for slot, v in ((L.LRU_HEAD, head), (L.LRU_HOLE, hole), (L.LRU_SCAN, scan), (L.LRU_TAIL, tail)):
            st.counters[slot] = v
        pool.check_invariants()
        with guard():
            pool.touch(i32([order[0]]))
        c = st.counters
        assert [int(c[k]) for k in (L.LRU_HEAD, L.LRU_HOLE, L.LRU_SCAN, L.LRU_TAIL)] == [head, head, head,
                                                                                         head + P + 1]
        assert st.lru_queue[torch.arange(head, head + P + 1) % Q].tolist() == order + [order[0]]
        pool.check_invariants()
        pool.check()  # no error counted
    for name in ("lru_queue", "lru_pos", "counters"):
        assert torch.equal(getattr(pools[0].state, name), getattr(pools[1].state, name)), name
    for pool in pools:
        with guard():
            out = pool.evict(P)
        assert out.tolist() == order[1:] + [order[0]]


@pytest.mark.parametrize("span, compacted", [(3 * 4 + 1, True), (3 * 4, False)])
def test_a_queue_one_past_its_room_is_compacted_and_one_at_it_is_not(make_pool, backend, guard, span, compacted):
    """The room rule at its bound: a call that may push compacts the queue first when it spans more than
    ``Q - P`` positions (a call pushes at most P entries), not at ``Q - P``. A consistent queue of 4 pages
    (Q = 16) spanning ``Q - P + 1`` positions is compacted by an empty touch; one spanning ``Q - P`` is left
    as it is. Either way a touch of every cached page then finds room for its P entries: no
    ``corrupt_state``, every page keeps a live entry. numba's threshold moved to ``Q - P + 1`` left the
    longer queue as it was, and that touch's last push found no room (an entry lost, its page never
    evicted), and no test saw it."""
    from tpool.kernels import layout as L
    P, Q = 4, 4 * L.LRU_FACTOR
    order, places = [2, 0, 3, 1], [0, 5, 9, span - 1]       # live entries, oldest first; stale ones between
    for pool in (make_pool(P, max_alloc_pages=P), tpool.PagePool(P, device="cpu", backend="reference")):
        pool.alloc(i32([P]))
        pool.free(i32(list(range(P))), cache=True)
        st, c = pool.state, pool.state.counters
        st.lru_queue.fill_(order[0])                         # stale everywhere but at its own place
        for q, j in zip(order, places):
            st.lru_queue[j % Q] = q
            st.lru_pos[q] = j
        c[L.LRU_HEAD], c[L.LRU_HOLE], c[L.LRU_SCAN], c[L.LRU_TAIL] = 0, 0, 0, span
        pool.check_invariants()
        with guard():
            pool.touch(i32([]))
        bounds = [int(c[k]) for k in (L.LRU_HEAD, L.LRU_HOLE, L.LRU_SCAN, L.LRU_TAIL)]
        assert bounds == ([0, 0, 0, P] if compacted else [0, 0, 0, span])
        with guard():
            pool.touch(i32(order))                            # P pushes: they fit either way
        assert pool.stats()["errors.corrupt_state"] == 0
        pool.check_invariants()
        with guard():
            out = pool.evict(P)
        assert out.tolist() == order


@pytest.mark.parametrize("call", ["evict", "alloc"])
def test_an_eviction_never_takes_an_entry_inside_the_cleaners_gap(make_pool, backend, guard, call):
    """The LRU queue is ``[head, hole) + [scan, tail)``: the gap ``[hole, scan)`` the cleaner leaves is never
    read. A gap holds no live entry in a state the calls made (the cleaner moved its live entries down), so
    only a hand edit shows the skip: hole and scan moved inside the bounds over the entries of pages 2 and 3,
    whose ``lru_pos`` still names them there. An eviction (``evict``, ``alloc(..., evict=True)``) takes the
    pages outside the gap, oldest first, and never 2 or 3: those are left without a live entry (README, "Bad
    input and bad state"), so an eviction that needs them evicts nothing and counts ``corrupt_state``. On
    every backend as on the reference. (Before this test, numba's walk with its gap skip taken out passed
    every pool test and the lockstep fuzzer.)"""
    from tpool.kernels import layout as L
    P = 6
    pools = (make_pool(P, max_alloc_pages=P), tpool.PagePool(P, device="cpu", backend="reference", max_alloc_pages=P))
    for pool in pools:
        pool.alloc(i32([P]))
        pool.free(i32(list(range(P))), cache=True)           # queued at positions 0..5, in page order
        c = pool.state.counters
        assert [int(c[k]) for k in (L.LRU_HEAD, L.LRU_HOLE, L.LRU_SCAN, L.LRU_TAIL)] == [0, 0, 0, P]
        c[L.LRU_HOLE], c[L.LRU_SCAN] = 2, 4                   # pages 2 and 3 inside the gap
        with guard():
            if call == "evict":
                first, second = pool.evict(3), pool.evict(2)
            else:
                first = pool.alloc(i32([3]), evict=True).evicted[:3].clone()
                second = pool.alloc(i32([2]), evict=True).evicted[:2]
        first, second = first.tolist(), second.tolist()
        assert first == [0, 1, 4]
        assert second == [-1, -1]                             # page 5 and a page in the gap: nothing
        assert int(c[L.ERR_CORRUPT_STATE]) == (1 if call == "evict" else 3)  # (the alloc's 2 pops below 0)
        assert pool.stats()["pages.cached.current"] == 3
    for name in ("free_stack", "page_state", "page_gen", "lru_queue", "lru_pos", "counters"):
        assert torch.equal(getattr(pools[0].state, name), getattr(pools[1].state, name)), name


@pytest.mark.parametrize("bounds", [(0, 0, -2**40, 8), (3, 3, 2**62, 8), (5, 5, -7, 2), (0, 2, 1, 8),
                                    (0, 0, 0, 2**62 + 1), (-1, 0, 0, 8)])
def test_an_eviction_refuses_queue_bounds_out_of_order(make_pool, backend, guard, bounds):
    """Head, hole, scan and tail set by hand out of order or bounds (a scan far below the head among
    them, which a chunked walk would have started from): ``evict`` and ``alloc(..., evict=True)`` evict
    nothing and count ``corrupt_state``, promptly, on every backend as on the reference; a call that
    may push then empties the queue."""
    from tpool.kernels import layout as L
    P = 8
    pools = (make_pool(P, max_alloc_pages=P), tpool.PagePool(P, device="cpu", backend="reference", max_alloc_pages=P))
    for pool in pools:
        pool.alloc(i32([P]))
        pool.free(i32(list(range(P))), cache=True)
        for slot, v in zip((L.LRU_HEAD, L.LRU_HOLE, L.LRU_SCAN, L.LRU_TAIL), bounds):
            pool.state.counters[slot] = v
        with guard():
            out = pool.evict(3)
            res = pool.alloc(i32([2]), evict=True)
        assert out.tolist() == [-1] * 3 and res.evicted.tolist() == [-1] * P and res.pages.tolist() == [-1] * P
        # (one count per eviction; the alloc's two pops then find the stack empty: one count each)
        assert int(pool.state.counters[L.ERR_CORRUPT_STATE]) == 4 and pool.stats()["pages.cached.current"] == P
        with guard():
            pool.touch(i32([0]))
        c = pool.state.counters
        assert [int(c[k]) for k in (L.LRU_HEAD, L.LRU_HOLE, L.LRU_SCAN, L.LRU_TAIL)] == [0, 0, 0, 1]
    for name in ("lru_queue", "lru_pos", "counters"):
        assert torch.equal(getattr(pools[0].state, name), getattr(pools[1].state, name)), name


@pytest.mark.parametrize("base", [2**31 - 5, 2**40 + 3])
def test_queue_positions_past_int32(make_pool, backend, guard, base):
    """Positions only grow (a long run, a restored snapshot): a consistent queue whose positions start
    just under 2**31 (and at 2**40) is pushed past it, cleaned through whole passes and evicted from, on
    every backend as on the reference (the Triton walks carry int64 positions)."""
    from tpool.kernels import layout as L
    P = 8
    Q = L.LRU_FACTOR * P
    pools = (make_pool(P, max_alloc_pages=P), tpool.PagePool(P, device="cpu", backend="reference", max_alloc_pages=P))
    outs = []
    for pool in pools:
        pool.alloc(i32([P]))
        pool.free(i32(list(range(P))), cache=True)
        st = pool.state
        for i in range(P):
            st.lru_queue[(base + i) % Q] = i
            st.lru_pos[i] = base + i
        for slot, v in ((L.LRU_HEAD, base), (L.LRU_HOLE, base), (L.LRU_SCAN, base), (L.LRU_TAIL, base + P)):
            st.counters[slot] = v
        pool.check_invariants()
        tails = []
        for r in range(6):
            with guard():
                pool.touch(i32([(3 * r + i) % P for i in range(P)]))
            tails.append(int(st.counters[L.LRU_TAIL]))
        with guard():
            out = pool.evict(3)
        outs.append(out.tolist())
        assert any(b < a for a, b in zip(tails, tails[1:])), tails  # a cleaning pass ended
        pool.check_invariants()
    assert outs[0] == outs[1] == [15 % P, 16 % P, 17 % P]  # the last touch's order
    for name in ("lru_queue", "lru_pos", "counters"):
        assert torch.equal(getattr(pools[0].state, name), getattr(pools[1].state, name)), name


def test_a_clean_after_pushes_past_the_position_limit_moves_live_entries_as_below_it(make_pool, backend, guard):
    """A queue just under ``LRU_POS_LIMIT`` whose tail a touch's push takes past it: the clean that ends
    the call reads its stretch as any other (the bounds were checked when the call began; the next call
    that may push empties the queue), on every backend as on the reference. The reference's clean once
    saw no live entry there (its walk also checked the bounds), so page 1 kept its entry at ``base + 3``
    where numba and Triton moved it down to the hole."""
    from tpool.kernels import layout as L
    P, Q = 2, 2 * L.LRU_FACTOR
    base = L.LRU_POS_LIMIT - 4
    pools = (make_pool(P, max_alloc_pages=P), tpool.PagePool(P, device="cpu", backend="reference", max_alloc_pages=P))
    for pool in pools:
        pool.alloc(i32([P]))
        pool.free(i32([1, 0]), cache=True)
        st = pool.state
        # positions base .. base + 3: pages 1, 0 (stale), 0 (live), 1 (live)
        for j, p in enumerate((1, 0, 0, 1)):
            st.lru_queue[(base + j) % Q] = p
        st.lru_pos[0], st.lru_pos[1] = base + 2, base + 3
        for slot, v in ((L.LRU_HEAD, base), (L.LRU_HOLE, base), (L.LRU_SCAN, base), (L.LRU_TAIL, base + 4)):
            st.counters[slot] = v
        pool.check_invariants()
        with guard():
            pool.touch(i32([0]))          # page 0 pushed at base + 4: the tail is LRU_POS_LIMIT + 1
        c = st.counters
        # the clean read [base, base + 4): page 1's live entry moved down to base
        assert [int(c[k]) - base for k in (L.LRU_HEAD, L.LRU_HOLE, L.LRU_SCAN, L.LRU_TAIL)] == [0, 1, 4, 5]
        assert int(st.lru_pos[1]) == base and int(st.lru_queue[base % Q]) == 1
        assert int(c[L.ERR_CORRUPT_STATE]) == 0
    for name in ("lru_queue", "lru_pos", "counters"):
        assert torch.equal(getattr(pools[0].state, name), getattr(pools[1].state, name)), name
    for pool in pools:  # past the limit: an eviction is refused, the next push empties the queue
        with guard():
            out = pool.evict(1)
            pool.touch(i32([1]))
        assert out.tolist() == [-1]
        c = pool.state.counters
        assert [int(c[k]) for k in (L.LRU_HEAD, L.LRU_HOLE, L.LRU_SCAN, L.LRU_TAIL)] == [0, 0, 0, 1]
        assert int(c[L.ERR_CORRUPT_STATE]) == 2
    for name in ("lru_queue", "lru_pos", "counters"):
        assert torch.equal(getattr(pools[0].state, name), getattr(pools[1].state, name)), name
