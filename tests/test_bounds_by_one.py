"""The façade's bounds at their edge: exactly at a bound passes, one past it is refused as documented.

Two mutation runs (session 37, helper-134 and -136) moved each of these checks by one and no test
noticed; each test below fails on its mutant (the name's prefix is the mutant's id in the reports).
k01 is from session 38's review of the Triton kernels: a kernel called one request past its outputs.
"""

import copy

import pytest
import torch

import tpool
from tpool.memory.owned_cache import OwnedCache
from tpool.memory.planner import PlanError, plan_pages
from tpool.scheduling import HostMirror, PrefixCache, WouldNotFit
from tpool.state import pool_state_bytes

from conftest import i32 as _i32

PS = 4


def test_k01_an_alloc_kernel_with_one_request_past_its_output_lanes_fails_that_request(backend):
    """Called directly with B = BO + 1 (the façade refuses it), every backend's alloc grants the first BO
    requests, fails the one past them (failed_requests, one out_overflow) and pops nothing for it. The
    Triton kernel popped its pages and left them USED with no owner (session 38, helper-138); the
    reference backend raised a shape error."""
    from tpool.backends import reference
    from tpool.kernels import alloc, layout as L
    pool = tpool.PagePool(16, page_size=PS, device="cpu", backend=backend)
    st = pool.state
    counts = _i32([1, 2, 3])
    pages, evicted = torch.full((8,), 7, dtype=torch.int32), torch.full((8,), 7, dtype=torch.int32)
    indptr, ok = torch.full((3,), 7, dtype=torch.int32), torch.zeros(2, dtype=torch.bool)
    if backend == "numba":
        alloc.alloc_numba(counts.data_ptr(), 3, pages.data_ptr(), 8, indptr.data_ptr(), ok.data_ptr(), 2,
                          evicted.data_ptr(), False, st.free_stack.numpy(), st.refcount.numpy(),
                          st.page_state.numpy(), st.page_gen.numpy(), st.counters.numpy(), st.lru_queue.numpy(),
                          st.lru_pos.numpy())
    else:
        (reference.alloc if backend == "reference" else alloc.alloc_triton)(st, counts, pages, indptr, ok,
                                                                             evicted, False)
    assert ok.tolist() == [True, True] and indptr.tolist() == [0, 1, 3]
    assert pages.tolist()[3:] == [-1] * 5 and evicted.tolist() == [-1] * 8
    c = st.counters
    assert int(c[L.FREE_COUNT]) == 13 and int(c[L.ALLOCATED]) == 3
    assert int(c[L.FAILED_REQUESTS]) == 1 and int(c[L.ERR_OUT_OVERFLOW]) == 1
    assert int((st.refcount > 0).sum()) == 3


def test_p08_insert_of_the_row_one_past_the_mirror_is_a_value_error(backend):
    """insert(row = number of rows): ValueError naming a running row (P08: row <= live.size let it
    through to live[row], an IndexError)."""
    pool = tpool.PagePool(16, page_size=PS, device="cpu", backend=backend)
    m = HostMirror(tpool.PageTable(pool, 4, 8), free=16, cached=0)
    cache = PrefixCache(m)
    m.admit([5])
    with pytest.raises(ValueError, match="expected a running row"):
        cache.insert(m.live.size, [1, 2, 3, 4])
    assert len(cache) == 0


def test_f02_free_group_capacity_one_past_the_limit_is_refused(backend):
    """capacity max(4096, 2 * num_pages) is accepted, one more refused (F02: > most + 1)."""
    pool = tpool.PagePool(8, page_size=PS, device="cpu", backend=backend)
    with pool.free_group(capacity=4096):
        pass
    with pytest.raises(ValueError, match="capacity: expected at most 4096"):
        pool.free_group(capacity=4097)
    big = tpool.PagePool(3000, page_size=PS, device="cpu", backend=backend)
    with big.free_group(capacity=6000):
        pass
    with pytest.raises(ValueError, match="capacity: expected at most 6000"):
        big.free_group(capacity=6001)


def test_f03_a_free_of_exactly_capacity_pages_is_deferred(backend):
    """A free of exactly `capacity` ids fits the buffer: deferred to the group's exit, not applied at
    once (F03: n >= capacity applied it in the group)."""
    pool = tpool.PagePool(8, page_size=PS, device="cpu", backend=backend)
    pages = pool.alloc(_i32([4])).pages[:4].clone()
    assert pool.available() == 4
    with pool.free_group(capacity=4) as group:
        pool.free(pages)
        assert pool.available() == 4 and group.flushes == 0   # still held: deferred
    assert pool.available() == 8 and group.flushes == 1


def test_f04_a_ninth_distinct_group_capacity_is_refused(backend):
    """A pool keeps MAX_CAPACITIES (8) group buffers: the 9th distinct capacity is refused, a known
    one still accepted (F04: > MAX_CAPACITIES let a 9th buffer in)."""
    from tpool.free_group import MAX_CAPACITIES
    pool = tpool.PagePool(8, page_size=PS, device="cpu", backend=backend)
    for c in range(1, MAX_CAPACITIES + 1):
        with pool.free_group(capacity=c):
            pass
    with pytest.raises(ValueError, match="group capacities"):
        pool.free_group(capacity=MAX_CAPACITIES + 1)
    assert len(pool._group_buffers) == MAX_CAPACITIES
    with pool.free_group(capacity=1):
        pass


def test_f05_an_enqueue_one_past_the_buffer_flushes_first(backend):
    """Buffered 2 of capacity 4, then 3 more (one past): what is buffered is applied first and the
    3 buffered (F05: > capacity + 1 skipped the flush and copied 3 ids into 2 places)."""
    pool = tpool.PagePool(8, page_size=PS, device="cpu", backend=backend)
    pages = pool.alloc(_i32([5])).pages[:5].clone()
    assert pool.available() == 3
    with pool.free_group(capacity=4) as group:
        pool.free(pages[:2].clone())
        pool.free(pages[2:].clone())
        assert pool.available() == 5 and group.flushes == 1
    assert pool.available() == 8 and group.flushes == 2
    pool.check_invariants()


def test_t04_bind_step_batch_one_past_max_batch_is_refused_as_batch(backend):
    """bind_step(batch=max_batch + 1) is refused naming batch, before any buffer is made (T04:
    > max_batch + 1 let it reach the req_ids check instead, after allocating)."""
    pool = tpool.PagePool(16, page_size=PS, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 4, 4)
    mb = pool.max_batch
    table.bind_step(batch=mb)
    kept = table.kept_shapes()
    with pytest.raises(ValueError, match=f"batch: expected at most max_batch={mb} lanes, got {mb + 1}"):
        table.bind_step(batch=mb + 1)
    assert table.kept_shapes() == kept


def test_t08_max_tokens_one_past_most_tokens_is_refused(backend):
    """max_tokens = most_tokens is accepted, one more refused (T08: > most_tokens + 1)."""
    pool = tpool.PagePool(16, page_size=PS, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 4, 4)
    assert table.most_tokens == pool.max_batch * 4 * PS  # every lane filling a row: tokens, not pages
    ids, n = _i32([0]), _i32([1])
    table.extend(ids, n, max_tokens=table.most_tokens)
    with pytest.raises(ValueError, match=f"max_tokens: expected at most {table.most_tokens}"):
        table.extend(_i32([1]), _i32([1]), max_tokens=table.most_tokens + 1)
    with pytest.raises(ValueError, match=f"max_tokens: expected at most {table.most_tokens}"):
        table.step(_i32([1]), _i32([1]), max_tokens=table.most_tokens + 1)
    assert table.seq_lens.tolist() == [1, 0, 0, 0]


def test_t10_step_release_one_past_max_batch_is_refused(backend):
    """step(release=) of max_batch + 1 ids is refused by the release check (T10: <= max_batch + 1
    let it through unchecked to the backend)."""
    pool = tpool.PagePool(16, page_size=PS, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 4, 4)
    table.extend(_i32([0]), _i32([3]), max_tokens=3)
    mb = pool.max_batch
    with pytest.raises(ValueError, match=rf"release: expected at most {mb} entries \(one per lane; the pool's "
                       rf"max_batch, PagePool\(\.\.\., max_batch=N\)\), got {mb + 1}"):
        table.step(_i32([1]), _i32([1]), release=torch.full((mb + 1,), -1, dtype=torch.int32))
    assert table.seq_lens.tolist() == [3, 0, 0, 0]


class _Storage:
    def __init__(self, lo, n):
        self.lo, self.n = lo, n

    def data_ptr(self):
        return self.lo

    def nbytes(self):
        return self.n


def test_c03_a_storage_starting_where_a_written_range_ends_does_not_overlap():
    """Byte ranges are half-open: [200, 250) does not overlap [100, 200) (C03: reach >= lo flagged it),
    [199, 250) does."""
    from tpool._checks import Written
    w = Written({100: 200})
    assert not w.storage_hit(_Storage(200, 50))
    assert w.storage_hit(_Storage(199, 50))
    assert not w.storage_hit(_Storage(50, 50))     # [50, 100): ends where the range starts
    assert w.storage_hit(_Storage(50, 51))
    # real tensors: two halves of one buffer, seen as separate storages over adjacent memory
    base = torch.zeros(8, dtype=torch.int32)
    a = torch.from_numpy(base.numpy()[:4])
    b = torch.from_numpy(base.numpy()[4:])
    from tpool._checks import written_storages
    assert not written_storages([a]).hit(b) and not written_storages([b]).hit(a)


def test_b01_a_bound_release_shrunk_in_place_is_stale(backend):
    """release.resize_(1) keeps the address and the storage's size but not the length: stale (B01:
    without the length compare the call ran and consumed 2 ids of a 1-id tensor)."""
    table = tpool.PageTable(tpool.PagePool(64, PS, device="cpu", backend=backend), 4, 8)
    ids, ntok, rel = _i32([0, 1]), _i32([3, 5]), _i32([-1, -1])
    run = table.bind_step(ids, ntok, max_tokens=8, release=rel)
    run()
    before = [t.clone() for t in (table.seq_lens, table.block_table)]
    rel.resize_(1)                       # same data_ptr, same storage nbytes, numel 1
    with pytest.raises(tpool.StaleBinding, match="release"):
        run()
    assert all(torch.equal(a, b) for a, b in zip(before, (table.seq_lens, table.block_table)))


def test_x01_an_entry_equal_to_num_pages_breaks_the_page_id_invariant(backend):
    """A hand-edited entry of num_pages (one past the last page) is an InvariantViolation naming it
    (X01: bt > num_pages let it through to a scatter out of bounds, a RuntimeError)."""
    from tpool.errors import InvariantViolation
    pool = tpool.PagePool(8, page_size=PS, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 4, 4)
    table.extend(_i32([0]), _i32([3]), max_tokens=3)
    table.block_table[0, 0] = pool.num_pages
    with pytest.raises(InvariantViolation, match="are page ids"):
        table.check_invariants()


# The planner, the owned cache, forward_step's checks and the mixed step (helper-136).

PAGE = 4096


def test_q01_a_zero_fraction_is_refused_as_a_fraction():
    """mem_fraction_static=0 is outside (0, 1] (Q01: 0 <= f let it through to a 0-page plan)."""
    for f in (0, 0.0):
        with pytest.raises(ValueError, match=r"mem_fraction_static: expected a float in \(0, 1\]"):
            plan_pages(PAGE, f, total_bytes=1 << 30, free_bytes=1 << 30, min_pages=0)


def test_q02_free_one_byte_past_total_is_refused():
    """free = total passes, total + 1 is refused (Q02: free > total + 1)."""
    plan_pages(PAGE, 0.5, total_bytes=1 << 30, free_bytes=1 << 30)
    with pytest.raises(ValueError, match="free_bytes must be <= total_bytes"):
        plan_pages(PAGE, 0.5, total_bytes=1 << 30, free_bytes=(1 << 30) + 1)


def test_q04_room_beside_the_pool_exactly_what_it_takes_fits():
    """left_after(pages) == scratch page + pool state is room enough (Q04: > need refused it)."""
    n = 1000
    total = n * PAGE + PAGE + pool_state_bytes(n)
    p = plan_pages(PAGE, 1.0, total_bytes=total, free_bytes=total, max_pages=n)
    assert p.num_pages == n
    with pytest.raises(PlanError):   # one byte less is refused
        plan_pages(PAGE, 1.0, total_bytes=total - 1, free_bytes=total - 1, max_pages=n)


def test_q06_a_suggested_fraction_of_exactly_one_is_suggested():
    """min_pages that only mem_fraction_static=1.0 gives: suggested 1.0 (Q06: step < 100 made it None)."""
    n, BIG = 1000, 1 << 20   # pages dwarf the pool state
    total = n * BIG + BIG + pool_state_bytes(n)
    assert n * BIG * 100 > 99 * total   # ceil(need / total * 100) == 100
    with pytest.raises(PlanError) as info:
        plan_pages(BIG, 0.5, total_bytes=total, free_bytes=total, min_pages=n, max_pages=n)
    assert info.value.suggested_fraction == 1.0
    assert plan_pages(BIG, 1.0, total_bytes=total, free_bytes=total, min_pages=n, max_pages=n).num_pages == n


def test_o01_a_budget_one_byte_below_the_pinned_charge_is_refused():
    """set_budget(pinned charge) passes, one byte less is a ValueError, nothing changed (O01: > budget + 1)."""
    cache = OwnedCache(1 << 20)
    cache.put("a", torch.ones(256))
    cache.pin("a")
    charged = cache.stats().current_bytes
    with pytest.raises(ValueError, match="pinned entries are charged"):
        cache.set_budget(charged - 1)
    assert cache.budget_bytes == 1 << 20 and cache.keys() == ["a"]
    cache.set_budget(charged)
    assert cache.budget_bytes == charged and cache.keys() == ["a"]


def test_h02_input_ids_one_short_of_max_tokens_are_refused():
    """input_ids of max_tokens - 1 ids: ValueError before the forward (H02: numel() > t let it through)."""
    pytest.importorskip("transformers")
    from test_serving_refusals import _ctx, _llama, _untouched
    from tpool.serving.hf import forward_step
    model = _llama()
    ctx = _ctx(model)   # max_tokens 8
    with pytest.raises(ValueError, match=r"input_ids: expected shape \(8,\)"):
        forward_step(model, torch.zeros(7, dtype=torch.long), ctx)
    assert _untouched(ctx)


def test_h03_a_model_with_one_of_two_layers_through_the_pages_is_refused():
    """Layer 1 attends eagerly (its own config), layer 0 through ctx: 'got 1' (H03: layers + 1 < layers)."""
    pytest.importorskip("transformers")
    from test_serving_refusals import _ctx, _llama
    from tpool.serving.hf import forward_step
    model = _llama()
    attn = model.model.layers[1].self_attn
    attn.config = copy.deepcopy(attn.config)
    attn.config._attn_implementation = "eager"
    ctx = _ctx(model)
    with pytest.raises(ValueError, match="model: expected all 2 layers to attend through tpool_paged, got 1"):
        forward_step(model, torch.zeros(8, dtype=torch.long), ctx)


def _mirror():
    pool = tpool.PagePool(16, page_size=4, device="cpu", backend="reference")
    return HostMirror(tpool.PageTable(pool, 2, 4), free=16, cached=0)


def _books(m):
    return m.free, m.reserved, m.rows_free, m.live.tolist(), m.hi.tolist()


def test_x03_max_tokens_one_past_most_tokens_is_refused_before_the_mirror_changes():
    """step(max_tokens=most_tokens + 1): ValueError, books unchanged (X03: > most + 1 left it to the table)."""
    m = _mirror()
    (a,) = m.admit([4])
    before = _books(m)
    with pytest.raises(ValueError, match="max_tokens: expected at most"):
        m.step([a], 1, [3], max_tokens=m.table.most_tokens + 1)
    assert _books(m) == before


def test_x05_one_prompt_more_than_the_free_rows_is_would_not_fit_unchanged():
    """All rows taken: step with one prompt is WouldNotFit, books unchanged (X05: rows_free + 1)."""
    m = _mirror()
    m.admit([4, 4])
    assert m.rows_free == 0
    before = _books(m)
    with pytest.raises(WouldNotFit, match="prompts need rows"):
        m.step([], 1, [3])
    assert _books(m) == before


# The mirror's fork, revive, out= and admission-only step (helper-136's list, run after its report).

def _full_mirror(backend):
    """4 pages of 4, rows of 4 pages: a and b admitted with 8 tokens each (max_len 8), b finished into the
    cache: 0 free, 2 CACHED (b's pages, returned too), capacity 16 tokens."""
    pool = tpool.PagePool(4, page_size=PS, device="cpu", backend=backend)
    m = HostMirror(tpool.PageTable(pool, 4, 4), free=4, cached=0)
    a, b = m.admit([8, 8], [8, 8])
    pages = m.table.block_table[b, :2].clone()
    m.finish([b], cache=True)
    assert (m.free, m.cached, m.unreserved, m.capacity) == (0, 2, 0, 16)
    return pool, m, a, pages


def test_y01_y04_fork_and_revive_take_max_len_up_to_the_capacity_and_no_further(backend):
    pool = tpool.PagePool(32, page_size=PS, device="cpu", backend=backend)
    m = HostMirror(tpool.PageTable(pool, 4, 4), free=32, cached=0)
    (a,) = m.admit([8])
    cap = m.capacity
    with pytest.raises(ValueError, match="fork: expected"):
        m.fork(a, 8, max_len=cap + 1)
    with pytest.raises(ValueError, match="revive: expected"):
        m.revive(m.table.block_table[a, :2].clone(), 8, max_len=cap + 1)
    m.fork(a, 8, max_len=cap)
    m.revive(m.table.block_table[a, :2].clone(), 8, max_len=cap)
    pool.check()


def test_y02_a_fork_needing_a_copy_page_with_none_free_is_refused_though_cached_pages_count(backend):
    """The copy-on-write page comes from free pages, which count_cached does not add to (Y02: cow > free + 1
    let the fork through with 0 free)."""
    pool, m, a, _ = _full_mirror(backend)
    before = _books(m)
    with pytest.raises(WouldNotFit, match="fork: needs 1 page"):
        m.fork(a, 6, max_len=6, count_cached=True)
    assert _books(m) == before


def test_y05_a_revive_counts_the_cached_pages_it_takes_out_of_its_room(backend):
    """Reviving both CACHED pages leaves none to evict for its reservation (Y05: evictable - k + 1 counted
    one)."""
    pool, m, a, pages = _full_mirror(backend)
    before = _books(m)
    with pytest.raises(WouldNotFit, match=r"revive: its reservation needs 1 page\(s\), 0 can be taken \(0 "
                                          r"unreserved and 0 of the CACHED pages it does not revive\)"):
        m.revive(pages, 8, max_len=9, count_cached=True)
    assert _books(m) == before
    m.revive(pages, 8, max_len=8, count_cached=True)      # no reservation needed: runs
    pool.check()


def test_a_revive_refused_for_room_counts_the_cached_pages_it_leaves_in_what_can_be_taken(backend):
    """Reviving one of two CACHED pages leaves the other to evict: the refusal's "can be taken" counts it
    beside the unreserved pages (helper-204's mutation run: the unreserved count alone passed, every
    refusal asked leaving no CACHED page)."""
    pool = tpool.PagePool(4, page_size=PS, device="cpu", backend=backend)
    m = HostMirror(tpool.PageTable(pool, 4, 4), free=4, cached=0, lookahead=8)
    _, b = m.admit([8, 8], [8, 8])
    pages = m.table.block_table[b, :1].clone()
    m.finish([b], cache=True)
    before = _books(m)
    with pytest.raises(WouldNotFit, match=r"revive: its reservation needs 2 page\(s\), 1 can be taken \(0 "
                                          r"unreserved and 1 of the CACHED pages it does not revive\)"):
        m.revive(pages, 4, max_len=16, count_cached=True)   # tokens 4..12 need 2 pages: 1 to evict
    assert _books(m) == before
    pool.check()


def test_y09_a_step_one_token_past_its_stepout_is_refused_before_the_mirror_changes(backend):
    pool = tpool.PagePool(32, page_size=PS, device="cpu", backend=backend)
    m = HostMirror(tpool.PageTable(pool, 4, 8), free=32, cached=0)
    rows = m.admit([4, 4])
    before = _books(m)
    with pytest.raises(ValueError, match="out: the step has 2 lanes and 4 tokens"):
        m.decode(rows, 2, out=m.table.step_out(2, max_tokens=3))
    assert _books(m) == before
    m.decode(rows, 2, out=m.table.step_out(2, max_tokens=4))
    pool.check()


def test_x06_an_admission_only_step_one_page_past_the_unreserved_ones_does_not_fit(backend):
    """No decode lanes: the prompts' pages and reservations against the unreserved pages (X06: admit >
    unreserved + 1 let one page too many through)."""
    pool = tpool.PagePool(5, page_size=PS, device="cpu", backend=backend)
    m = HostMirror(tpool.PageTable(pool, 4, 8), free=5, cached=0)
    m.admit([4], [4])                                     # 1 page, no reservation: 4 unreserved
    assert m.unreserved == 4 and m.capacity == 20
    before = _books(m)
    with pytest.raises(WouldNotFit):
        m.step([], 1, [17], [20])                         # 5 pages with its reservation
    assert _books(m) == before
    m.step([], 1, [16], [16])                             # 4: fits
    pool.check()


def test_a_table_of_one_entry_past_max_indexed_is_refused_before_allocating():
    """max_requests * max_pages_per_request = MAX_INDEXED + 1 table entries: a ValueError naming the product,
    raised before the table's state (gigabytes at that size) is allocated."""
    from tpool.kernels.layout import MAX_INDEXED
    pool = tpool.PagePool(16, page_size=1, device="cpu", backend="reference")
    with pytest.raises(ValueError, match=f"expected at most {MAX_INDEXED} table entries, got {MAX_INDEXED + 1} \\* 1"):
        tpool.PageTable(pool, MAX_INDEXED + 1, 1)


def test_the_default_max_alloc_pages_is_4096_or_the_pool():
    assert tpool.PagePool(65536, device="cpu", backend="reference").max_alloc_pages == 4096
    assert tpool.PagePool(100, device="cpu", backend="reference").max_alloc_pages == 100
