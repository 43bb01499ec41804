"""State edited by hand exactly one step past a bound: counted as an error, and nothing else touched.

A mutation run (session 37, helper-129) moved each bound the kernels check on stored values by one
(``<`` to ``<=``, ``limit`` to ``limit + 1``) and found these edits untested: each test below fails
on such a mutant (on the numba backend; the reference backend is checked alike), and passes on
every CPU backend as written. ``tests/test_safety.py`` covers edits far past the bounds. The page
scratch test is from session 38's review of the Triton kernels (helper-138).
"""

import pytest
import torch

import tpool
from tpool.kernels import layout as L
from tpool.serving import PagedKVCache

from conftest import i32


def _two_rows(backend):
    """A pool of 16 pages of 4 tokens and a table of 4 rows of 4 pages: row 0 holds 8 tokens, row 1 six."""
    pool = tpool.PagePool(16, 4, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 4, 4)
    table.extend(i32([0, 1]), i32([8, 6]), max_tokens=16)
    return pool, table


def _pool_state(pool):
    """Every pool state tensor as lists, but the page scratch (``claim``, ``occur``)."""
    return {name: t.tolist() for name, t in pool.state.tensors().items() if name not in ("claim", "occur")}


def _page_ops(table):
    """Each operation that counts a page's occurrences in the pool's scratch (``claim``/``occur``), called
    as ``op(pages, edit)``: ``edit()`` right before the operation (a revive's after the release it needs)."""
    pool, i = table.pool, i32
    return {
        "free": lambda p, edit: (edit(), pool.free(i([p[0], p[1], p[0]]))),
        "free-cache": lambda p, edit: (edit(), pool.free(i([p[0], p[1]]), cache=True)),
        "incref": lambda p, edit: (edit(), pool.incref(i([p[1], p[0], p[1]]))),
        "touch": lambda p, edit: (edit(), pool.touch(i([p[0], p[1], p[0]]))),
        "release": lambda p, edit: (edit(), table.release(i([0, 1]))),
        "release-cache": lambda p, edit: (edit(), table.release(i([0]), cache=True)),
        "truncate": lambda p, edit: (edit(), table.truncate(i([0]), i([3]))),
        "fork": lambda p, edit: (edit(), table.fork(i([0, 0]), i([2, 3]), i([8, 5]))),
        "revive": lambda p, edit: (table.release(i([0]), cache=True), edit(), table.revive(2, i([p[0], p[1]]), 8)),
        # refused: each repeat counts invalid_page (numba marks a page seen in occur, after its count)
        "revive-twice": lambda p, edit: (table.release(i([0]), cache=True), edit(),
                                         table.revive(2, i([p[1], p[0], p[1], p[1]]), 16)),
    }


@pytest.mark.parametrize("op", ["free", "free-cache", "incref", "touch", "release", "release-cache", "truncate",
                                "fork", "revive", "revive-twice"])
@pytest.mark.parametrize("edit", [("occur", -5), ("occur", -1), ("occur", 2), ("claim", 0), ("claim", -1)],
                         ids=["occur-5", "occur-1", "occur+2", "claim0", "claim-1"])
def test_a_value_left_in_the_page_scratch_changes_nothing(backend, op, edit):
    """The pool's scratch (``claim`` INT32_MAX, ``occur`` 0 between calls) edited for the pages an operation
    names: the operation does exactly what it does on a clean twin. Before session 38 a stale ``occur`` of -5
    made a free raise the page's reference count to 5 (numba and Triton), one of -1 made a page named once
    count 0 occurrences (skipped), and a stale ``claim`` below every lane left the page with no first lane,
    so a Triton free, touch, release or fork skipped it (helper-138). (The pool's ``claim`` is Triton's
    alone: numba and the reference backend never read it, nor reset it.)"""
    results = []
    for edited in (False, True):
        pool, table = _two_rows(backend)
        pages = table.block_table[0, :2].tolist()

        def edit_scratch():
            if edited:
                getattr(pool.state, edit[0])[pages] = edit[1]
        _page_ops(table)[op](pages, edit_scratch)
        results.append((_pool_state(pool), table.block_table.tolist(), table.seq_lens.tolist(), pool.stats()))
    clean, edited = results
    for name in clean[0]:
        assert clean[0][name] == edited[0][name], name
    assert clean[1:] == edited[1:]



@pytest.mark.parametrize("op", ["release", "release-cache", "truncate", "truncate-drop", "step-release"])
def test_a_value_left_in_the_pool_keys_scratch_changes_nothing(backend, op):
    """The pool's ``keys`` (numba's list of the pages a release or truncate drops; the other backends never
    read it) holds what the last such call left, not a value between calls: ``check_invariants()`` passes
    with it so, and any value written there by hand before the call changes no result, since the call
    writes every entry it reads first. (The README said a cell of it off its value between calls was
    found only by ``check_invariants()`` and made numba's outcome its own: it is neither.)"""
    calls = {
        "release": lambda table: table.release(i32([0, 1])),
        "release-cache": lambda table: table.release(i32([1, 0]), cache=True),
        "truncate": lambda table: table.truncate(i32([0, 1]), i32([3, 1])),
        "truncate-drop": lambda table: table.truncate(i32([1, 0]), drop=i32([5, 6])),
        "step-release": lambda table: table.step(i32([2]), i32([9]), release=i32([0, 1]), release_cache=True),
    }
    results = []
    for edited in (False, True):
        pool, table = _two_rows(backend)
        table.truncate(i32([1]), i32([4]))                 # a release before: keys holds what it dropped
        pool.check_invariants()
        if edited:
            pool.state.keys.copy_(torch.tensor([2**62, -1, -2**63, 2**31, 7, 15, 16, -5] * 2))
        calls[op](table)
        pool.check_invariants()
        results.append(({n: t.tolist() for n, t in pool.state.tensors().items() if n != "keys"},
                        table.block_table.tolist(), table.seq_lens.tolist(), pool.stats()))
    assert results[0] == results[1]


def _table_ops(table, ids):
    """Each table operation that deduplicates its requests through the table's claim scratch."""
    return {
        "extend": lambda: table.extend(i32(ids), i32([1, 3]), max_tokens=4),
        "release": lambda: table.release(i32(ids)),
        "truncate": lambda: table.truncate(i32(ids), i32([4, 4])),
        "fork": lambda: table.fork(i32([0, 1]), i32([2, 3 if ids[1] >= 0 else -1]), i32([8, 6])),
    }


@pytest.mark.parametrize("op", ["extend", "release", "truncate", "fork"])
@pytest.mark.parametrize("stale", [2, 1, 0, -7])
def test_a_value_left_in_a_table_claim_acts_as_a_lane_and_is_cleared(backend, op, stale):
    """A table's claim (INT32_MAX between calls) edited for the request of lane 1 (row 1; the fork's row 3)
    takes part in the call as a lane would, on every backend: at or above that lane (1, 2) the call is what
    it is on a clean table; below it (0, -7) the request has no valid lane, so that lane is one bad_request
    and the rest is what the call does with the lane as padding. Either way the claim is reset after it.
    Before session 38 numba refused the request for any value left there, Triton refused it only below
    its lane and, in a release, never reset it, and the reference backend ignored the scratch."""
    def run(ids, edit):
        pool, table = _two_rows(backend)
        if edit:
            table.state.claim[3 if op == "fork" else 1] = stale
        _table_ops(table, ids)[op]()
        assert table.state.claim.tolist() == [2**31 - 1] * 4
        return _pool_state(pool), table.block_table.tolist(), table.seq_lens.tolist(), \
            pool.stats()["errors.bad_request"]
    if stale >= 1:
        assert run([0, 1], True) == run([0, 1], False)
    else:
        got, want = run([0, 1], True), run([0, -1], False)
        assert got[3] == 1 and got[1:3] == want[1:3]
        for name in ("refcount", "page_state", "page_gen"):
            assert got[0][name] == want[0][name], name


def test_a_pop_below_the_free_stack_hands_out_no_page_and_is_counted(backend):
    """An alloc whose eviction finds none of the CACHED pages the (edited) count promised pops below the
    bottom of the free stack: those pops are -1 and counted. Unchecked, the index wraps to the top of the
    stack and hands out pages already USED (the first alloc's) a second time."""
    pool = tpool.PagePool(4, 4, device="cpu", backend=backend)
    first = pool.alloc(i32([2])).pages[:2].tolist()
    pool.state.counters[L.CACHED_COUNT] = 2               # 2 CACHED pages on no LRU queue
    got = pool.alloc(i32([4]), evict=True).pages[:4].tolist()
    assert not set(first) & {p for p in got if p >= 0}, (first, got)
    assert got[2:] == [-1, -1]
    assert pool.stats()["errors.corrupt_state"] == 3       # the eviction that found nothing, two pops below 0


@pytest.mark.parametrize("free, room", [(6, True), (0, True), (7, False), (-1, False), (-10**9, False),
                                        (2**63 - 1, False), (-2**63, False)])
def test_an_eviction_with_no_room_on_the_free_stack_evicts_nothing(backend, free, room):
    """An eviction of m pages pushes them at ``free_stack[F:F + m]``: with the free count F edited outside
    ``[0, P - m]`` (one past it, below 0, far out) it evicts nothing, counts ``corrupt_state`` once and leaves
    the stack, the pages and the queue as they are; at the bounds it evicts. numba pushed at ``F + r``
    unchecked for F below 0 (a negative index, wrapped or past the stack) and one slot past the stack for
    F = P - m + 1 with either of its two checks taken out, and no test saw it."""
    pool = tpool.PagePool(8, 4, device="cpu", backend=backend)
    pool.alloc(i32([8]))
    pool.free(i32([0, 1, 2, 3]), cache=True)                # 4 CACHED, queued 0, 1, 2, 3; the stack empty
    pool.state.counters[L.FREE_COUNT] = free
    before = {n: t.clone() for n, t in pool.state.tensors().items() if n not in ("counters", "checked")}
    out = pool.evict(2).tolist()                           # m = 2: room iff 0 <= F <= 6
    c = pool.state.counters
    if room:
        assert out == [0, 1] and pool.state.free_stack[free:free + 2].tolist() == [0, 1]
        assert int(c[L.FREE_COUNT]) == free + 2 and pool.stats()["errors.corrupt_state"] == 0
        return
    assert out == [-1, -1]
    assert int(c[L.FREE_COUNT]) == free and int(c[L.CACHED_COUNT]) == 4 and int(c[L.EVICTED]) == 0
    assert pool.stats()["errors.corrupt_state"] == 1
    for n, t in before.items():
        assert torch.equal(pool.state.tensors()[n], t), n


@pytest.mark.parametrize("cached, granted", [(7, True), (8, False), (-1, False)])
def test_alloc_sees_an_empty_pool_when_the_cached_count_passes_the_pages_not_free(backend, cached, granted):
    """The cached count C edited past ``P - F`` (the pages not free; one past it, or below 0): an
    ``alloc(..., evict=True)`` sees an empty pool, one ``corrupt_state``, and changes nothing but the clock
    and the failed count; at ``C = P - F`` it serves the request, evicting the shortfall. numba's check one
    past that bound (``C > P - F + 1``) served it, and no test saw it."""
    pool = tpool.PagePool(8, 4, device="cpu", backend=backend)
    pool.alloc(i32([8]))
    pool.free(i32([0, 1, 2, 3]), cache=True)                # 4 CACHED, queued 0, 1, 2, 3
    pool.free(i32([4]))                                    # F = 1: P - F = 7
    pool.state.counters[L.CACHED_COUNT] = cached
    before = {n: t.clone() for n, t in pool.state.tensors().items() if n not in ("counters", "checked")}
    r = pool.alloc(i32([2]), evict=True)
    if granted:
        assert r.ok.tolist() == [True] and r.pages[:2].tolist() == [0, 4] and r.evicted[:2].tolist() == [0, -1]
        assert pool.stats()["errors.corrupt_state"] == 0
        return
    assert r.ok.tolist() == [False] and r.pages.tolist() == [-1] * 8 and r.evicted.tolist() == [-1] * 8
    assert pool.stats()["errors.corrupt_state"] == 1 and pool.stats()["requests.failed"] == 1
    assert int(pool.state.counters[L.FREE_COUNT]) == 1 and int(pool.state.counters[L.CACHED_COUNT]) == cached
    for n, t in before.items():
        assert torch.equal(pool.state.tensors()[n], t), n



@pytest.mark.parametrize("state", [7, -1, 3])
def test_an_incref_of_a_page_in_no_known_state_counts_each_entry(backend, state):
    """``page_state`` edited to a value that is no state: an incref leaves that page alone (its count and
    state) and counts ``corrupt_state`` once per entry naming it, as touch does (``tests/test_safety.py``);
    the other pages gain their references. numba's incref counting such a page once per call passed every
    pool and safety test."""
    pool = tpool.PagePool(4, 4, device="cpu", backend=backend)
    pool.alloc(i32([2]))                                   # pages 0 and 1, one reference each
    pool.state.page_state[1] = state
    pool.incref(i32([1, 0, 1, -1, 1]))
    assert pool.stats()["errors.corrupt_state"] == 3
    assert pool.state.refcount[:2].tolist() == [2, 1] and pool.state.page_state[:2].tolist() == [L.USED, state]



def test_a_release_of_a_row_one_token_past_its_limit_counts_it_and_frees_nothing(backend):
    """A length of limit + 1 is corrupt: the release leaves the row alone and counts it. Taken as valid, it
    reads one block-table entry past the row (the next row's first page) and frees that page."""
    pool = tpool.PagePool(16, 4, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 4, 4)                    # a row holds 4 pages of 4 tokens
    table.extend(i32([0, 1]), i32([16, 4]), max_tokens=20)
    table.seq_lens[0] = 17
    table.release(i32([0]))
    assert int(pool.state.counters[L.ERR_CORRUPT_STATE]) == 1
    assert table.seq_lens[:2].tolist() == [17, 4]
    assert pool.stats()["pages.free.current"] == 11        # row 1's first page least of all


def test_an_extend_of_a_row_one_token_past_its_limit_is_corrupt_not_an_overflow(backend):
    pool = tpool.PagePool(16, 4, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 4, 4)
    table.extend(i32([0]), i32([16]), max_tokens=16)
    table.seq_lens[0] = 17
    res = table.extend(i32([0]), i32([0]), max_tokens=1)
    assert res.ok.tolist() == [False]
    c = pool.state.counters
    assert int(c[L.ERR_CORRUPT_STATE]) == 1 and int(c[L.ERR_TABLE_OVERFLOW]) == 0
    assert int(table.seq_lens[0]) == 17


def test_an_lru_queue_spanning_one_position_past_its_length_evicts_nothing(backend):
    """Queue positions spanning Q + 1 (an edited tail) are out of bounds: the eviction takes nothing and
    counts it."""
    pool = tpool.PagePool(4, 4, device="cpu", backend=backend)
    pool.free(pool.alloc(i32([1])).pages[:1].clone(), cache=True)  # one CACHED page, its entry at 0
    c = pool.state.counters
    assert [int(c[i]) for i in (L.LRU_HEAD, L.LRU_HOLE, L.LRU_SCAN, L.LRU_TAIL)] == [0, 0, 0, 1]
    c[L.LRU_TAIL] = L.LRU_FACTOR * 4 + 1
    pool.evict(1)
    assert int(c[L.ERR_CORRUPT_STATE]) == 1
    assert pool.stats()["pages.cached.current"] == 1


def test_a_release_counts_one_bad_request_per_bad_lane(backend):
    """Not an edit, but the same count: an id past the rows and a repeated id are one bad_request each
    (padding none), and the row is released once."""
    pool = tpool.PagePool(16, 4, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 4, 4)
    table.extend(i32([0]), i32([5]), max_tokens=5)
    table.release(i32([0, 9, 0, -1]))
    assert int(pool.state.counters[L.ERR_BAD_REQUEST]) == 2
    assert pool.stats()["pages.free.current"] == 16


def test_a_kv_copy_to_the_page_one_past_the_cache_is_counted_not_done():
    """A destination of num_pages is out of the cache: counted as invalid_copy_page. Off by one it was taken
    for a page (the scratch page) and copied into, unseen."""
    pool = tpool.PagePool(6, 4, device="cpu", backend="reference")
    kv = PagedKVCache.from_pool(pool, 2, 2, 3, dtype=torch.float32)
    kv.copy_pages(i32([1]), i32([6]))
    with pytest.raises(tpool.InvalidPage) as e:
        kv.check()
    assert e.value.counts == {"invalid_copy_page": 1}


def test_a_backend_alloc_past_its_output_pages_counts_an_alloc_pages_overflow(backend):
    """Two requests of one page into outputs of one lane and 4 pages (a direct backend call: the façade
    refuses it): the second fails as an ``alloc_pages`` overflow, not a slots one."""
    pool = tpool.PagePool(8, device="cpu", backend=backend)
    out = pool.alloc_out(1, 4)
    pool.ops.alloc_into(out)(i32([1, 1]), 2, False)
    c = pool.state.counters
    assert (int(c[L.OVERFLOW_PAGES]), int(c[L.OVERFLOW_SLOTS])) == (1, 0)
    assert (int(c[L.ERR_OUT_OVERFLOW]), int(c[L.FAILED_REQUESTS])) == (1, 1)
    assert out.ok.tolist() == [True] and out.pages.tolist()[0] == 0


def test_an_incref_of_a_cached_page_at_int32_max_counts_a_refcount_overflow(backend):
    pool = tpool.PagePool(4, device="cpu", backend=backend)
    pool.free(pool.alloc(i32([1])).pages, cache=True)
    pool.state.refcount[0] = 2**31 - 1
    pool.incref(i32([0]))
    assert int(pool.state.refcount[0]) == 2**31 - 1
    assert int(pool.state.counters[L.ERR_REFCOUNT_OVERFLOW]) == 1


@pytest.mark.parametrize("depth", [0, 1, 3])
@pytest.mark.parametrize("value", [16, -1, -2**31, 2**31 - 1])
def test_an_alloc_popping_a_page_id_outside_the_pool_at_any_depth_hands_out_minus_one(backend, depth, value):
    """A free-stack entry edited to an id outside ``[0, P)`` (one past the last page among them) at the top,
    in the middle or at the bottom of a four-page pop: that pop hands out -1 and marks no page, counting
    ``corrupt_state`` once; the other three are popped as usual. numba checks a whole run of the stack at
    once before a pop marks any page (``stack_run_ok``): with that run one entry short at its bottom, it
    wrote the reference count and state of page ``value`` (outside the arrays) and handed it out, and no
    other test saw it (the lockstep fuzzer's process crashed)."""
    pool = tpool.PagePool(16, 4, device="cpu", backend=backend)
    pool.alloc(i32([2]))                                   # pages 0 and 1; the next pops are 2, 3, 4, 5
    top = int(pool.state.counters[L.FREE_COUNT]) - 1
    pool.state.free_stack[top - depth] = value
    before = {n: pool.state.tensors()[n].clone() for n in ("refcount", "page_state")}
    pages = pool.alloc(i32([4])).pages[:5].tolist()
    want = [2, 3, 4, 5, -1]
    want[depth] = -1
    assert pages == want
    assert pool.stats()["errors.corrupt_state"] == 1
    gone = 2 + depth                                       # the page the edit took off the stack: untouched
    for n, t in before.items():
        assert int(pool.state.tensors()[n][gone]) == int(t[gone]), n
    assert pool.state.refcount[[p for p in want if p >= 0]].tolist() == [1, 1, 1]



def test_a_fork_popping_a_page_id_outside_the_pool_returns_no_half_copy_pair(backend):
    """A hand-edited stack entry of 99 popped for the fork's partial last page: no copy pair at all
    (never a source without a destination), and the state is counted corrupt."""
    pool = tpool.PagePool(8, 4, device="cpu", backend=backend)
    table = tpool.PageTable(pool, max_requests=2, max_pages_per_request=4)
    table.extend(i32([0]), i32([6]), max_tokens=6)
    pool.state.free_stack[int(pool.state.counters[L.FREE_COUNT]) - 1] = 99
    f = table.fork(i32([0]), i32([1]), i32([6]))
    assert f.cow_src.tolist() == [-1] and f.cow_dst.tolist() == [-1]
    assert pool.stats()["errors.corrupt_state"] == 1


# --- Pinned by helper-143's mutation run over the pool and page-table façade (session 39) ----------------------------

@pytest.mark.parametrize("name, index, value, rule", [
    ("counters", L.USED_PEAK, 1, "peaks >= current"),                 # a peak below the pages in use
    ("refcount", 5, -1, "refcounts non-negative"),                     # a FREE page: "rc > 0 iff USED" holds
    ("occur", 2, 1, "scratch reset"),                                  # 0 between calls
    ("claim", 2, 1, "scratch reset"),                                  # INT32_MAX between calls
    ("page_gen", 6, -1, "generations non-negative"),
    ("stamp", 3, "later", "stamp order"),                              # the older queue entry, the later stamp
])
def test_check_invariants_names_each_pool_rule_broken_alone(backend, name, index, value, rule):
    """One hand edit of a pool (pages 0-2 in use, 3 and 4 cached in two calls) breaks one rule, which
    ``check_invariants`` names."""
    pool = tpool.PagePool(8, device="cpu", backend=backend)
    pool.alloc(i32([5]))
    pool.free(i32([3]), cache=True)
    pool.free(i32([4]), cache=True)
    pool.check_invariants()
    if value == "later":
        value = int(pool.state.stamp[4]) + 5
    getattr(pool.state, name)[index] = value
    with pytest.raises(tpool.InvariantViolation, match=rule):
        pool.check_invariants()


@pytest.mark.parametrize("name, index, value, rule", [
    ("seq_lens", 2, -1, r"seq_lens within \[0, max_pages \* page_size\] \(request 2"),  # else unnamed
    ("block_table", (0, 2), 9, r"entries past a request's length are -1 \(request 0"),  # nothing else looks there
    ("claim", 0, 0, "the table's claim scratch is reset"),                               # INT32_MAX between calls
])
def test_check_invariants_names_each_table_rule_broken_alone(backend, name, index, value, rule):
    """One hand edit of a table (request 0 at 3 tokens, pages of 4) breaks one rule, which
    ``check_invariants`` names."""
    table = tpool.PageTable(tpool.PagePool(16, 4, device="cpu", backend=backend), 4, 4)
    table.extend(i32([0]), i32([3]), max_tokens=3)
    table.check_invariants()
    (table.state.claim if name == "claim" else getattr(table, name))[index] = value
    with pytest.raises(tpool.InvariantViolation, match=rule):
        table.check_invariants()

