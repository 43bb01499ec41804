"""PageTable on every CPU backend: hand-worked cases, layouts, and random workloads vs the model."""

import collections
import gc
import random
import threading
import weakref

import numpy as np
import pytest
import torch

import tpool
from conftest import CPU_BACKENDS, i32, same_table_state
from pool_model import PoolModel
from table_model import TableModel

BACKENDS = CPU_BACKENDS


@pytest.fixture(params=BACKENDS)
def make_table(request):
    def make(num_pages, page_size, R, MP):
        pool = tpool.PagePool(num_pages, page_size, device="cpu", backend=request.param)
        return tpool.PageTable(pool, R, MP)
    return make


def test_prefill_then_decode_slots(make_table, guard):
    table = make_table(16, 4, 3, 4)
    with guard():
        r = table.extend(i32([0, 1]), i32([6, 1]), max_tokens=8)
    assert r.slots.tolist() == [0, 1, 2, 3, 4, 5, 8, -1]
    assert r.ok.tolist() == [True, True]
    with guard():
        d = table.extend(i32([0, 1, -1]), i32([1, 1, 0]))
    assert d.slots.tolist() == [6, 9, -1] and d.ok.tolist() == [True, True, False]
    assert table.block_table.tolist() == [[0, 1, -1, -1], [2, -1, -1, -1], [-1] * 4]
    assert table.seq_lens.tolist() == [7, 2, 0]
    table.pool.check()
    table.check_invariants()


def test_extend_crossing_a_boundary_allocates_in_the_same_call(make_table, guard):
    table = make_table(8, 2, 2, 4)
    with guard():
        table.extend(i32([0]), i32([2]), max_tokens=2)   # exactly one full page
        r = table.extend(i32([0]), i32([1]))      # crosses into a second page
    assert r.slots.tolist() == [2] and table.block_table[0].tolist() == [0, 1, -1, -1]


def test_extend_fcfs_failure_leaves_request_unchanged(make_table, guard):
    table = make_table(4, 2, 3, 8)
    with guard():
        r = table.extend(i32([0, 1, 2]), i32([4, 6, 1]), max_tokens=11)
    # 0 needs 2 pages, 1 needs 3 (5 > 4: fails), 2 needs 1 but comes after a failure.
    assert r.ok.tolist() == [True, False, False]
    assert r.slots.tolist() == [0, 1, 2, 3] + [-1] * 7
    assert table.seq_lens.tolist() == [4, 0, 0] and table.pool.available() == 2
    assert table.pool.stats()["requests.failed"] == 2
    table.check_invariants()


def test_misuse_is_counted_and_skipped(make_table, guard):
    table = make_table(8, 2, 2, 2)
    with guard():
        r = table.extend(i32([0, 0, 5, 1]), i32([1, 1, 1, 5]), max_tokens=8)
    # lane 1 repeats request 0, lane 2 is out of range, lane 3 needs 3 pages > 2.
    assert r.ok.tolist() == [True, False, False, False]
    s = table.pool.stats()
    assert (s["errors.bad_request"], s["errors.table_overflow"]) == (2, 1)
    with guard():
        table.truncate(i32([0]), i32([5]))        # longer than the request
    assert table.pool.stats()["errors.bad_length"] == 1
    with pytest.raises(tpool.InvalidRequest) as e:
        table.pool.check()
    assert e.value.counts == {"bad_request": 2, "table_overflow": 1, "bad_length": 1}
    table.check_invariants()


def test_release_keeps_shared_pages_alive(make_table, guard):
    table = make_table(16, 4, 3, 4)
    with guard():
        table.extend(i32([0]), i32([8]), max_tokens=8)   # pages 0, 1
        f = table.fork(i32([0]), i32([1]), i32([8]))     # whole pages shared
        table.release(i32([0]))
    assert f.ok.tolist() == [True] and f.cow_src.tolist() == [-1]
    assert table.block_table[1].tolist()[:2] == [0, 1] and table.pool.available() == 14
    with guard():
        table.release(i32([1]))
    assert table.pool.available() == 16
    table.check_invariants()


def test_fork_inside_a_page_returns_the_copy_pair(make_table, guard):
    table = make_table(16, 4, 3, 4)
    with guard():
        table.extend(i32([0]), i32([7]), max_tokens=7)   # pages 0, 1
        f = table.fork(i32([0, 0]), i32([1, 2]), i32([5, 4]))
    assert f.ok.tolist() == [True, True]
    assert f.cow_src.tolist() == [1, -1] and f.cow_dst.tolist() == [2, -1]
    assert table.block_table.tolist()[1][:2] == [0, 2] and table.block_table.tolist()[2][:1] == [0]
    assert table.seq_lens.tolist() == [7, 5, 4]
    assert table.pool.state.refcount[:3].tolist() == [3, 1, 1]
    table.check_invariants()


def test_truncate_frees_pages_past_the_new_length(make_table, guard):
    table = make_table(8, 2, 1, 4)
    with guard():
        table.extend(i32([0]), i32([7]), max_tokens=7)   # pages 0..3
        table.truncate(i32([0]), i32([3]))
    assert table.block_table[0].tolist() == [0, 1, -1, -1] and table.seq_lens.tolist() == [3]
    assert table.pool.available() == 6
    with guard():
        r = table.extend(i32([0]), i32([1]))
    assert r.slots.tolist() == [3]                       # continues inside page 1
    table.check_invariants()


def test_truncate_inside_a_shared_page_is_refused(make_table, guard):
    """A truncate may not end inside a page another request holds: the next token would land there."""
    table = make_table(16, 4, 3, 4)
    with guard():
        table.extend(i32([0]), i32([8]), max_tokens=8)   # pages 0, 1
        table.fork(i32([0]), i32([1]), i32([8]))          # request 1 shares both whole pages
        table.truncate(i32([0, 1]), i32([6, 4]))          # 0: inside shared page 1, refused; 1: a boundary
    with pytest.raises(tpool.InvalidLength, match="bad_length: 1"):
        table.pool.check()
    assert table.seq_lens.tolist() == [8, 4, 0]
    assert table.block_table[:2].tolist() == [[0, 1, -1, -1], [0, -1, -1, -1]]
    assert table.pool.state.refcount[:2].tolist() == [2, 1]
    with guard():
        table.truncate(i32([1]), drop=i32([2]))           # inside page 0, still shared: refused
        table.truncate(i32([0]), drop=i32([2]))           # page 1 is request 0's alone now
    with pytest.raises(tpool.InvalidLength, match="bad_length: 1"):
        table.pool.check()
    assert table.seq_lens.tolist() == [6, 4, 0]
    with guard():
        r = table.extend(i32([0]), i32([1]))
    assert r.slots.tolist() == [6]                       # continues inside its own page 1
    table.pool.check()
    table.check_invariants()


def test_release_with_cache_keeps_pages_cached(make_table, guard):
    table = make_table(8, 2, 2, 4)
    with guard():
        table.extend(i32([0]), i32([4]), max_tokens=4)
        table.release(i32([0]), cache=True)
    s = table.pool.stats()
    assert s["pages.cached.current"] == 2 and table.pool.available() == 6
    table.check_invariants()


def test_release_into_the_cache_queues_each_rows_last_page_first(make_table, guard):
    """A prefix can only be reused from its first page: a release with cache=True queues each row's pages
    last page first (lanes in batch order), so eviction takes requests' tails before their heads; a
    release without the cache pushes the pages on the free stack in token order, as before."""
    table = make_table(16, 2, 4, 4)
    with guard():
        table.extend(i32([0, 1, 2]), i32([6, 3, 7]), max_tokens=16)   # rows of 3, 2 and 4 pages
    rows = [table.block_table[r, :n].tolist() for r, n in ((0, 3), (1, 2), (2, 4))]
    with guard():
        table.release(i32([1, 0]), cache=True)
        out = table.pool.evict(5)
    assert out.tolist() == rows[1][::-1] + rows[0][::-1]
    with guard():
        table.release(i32([2]))                     # pushed 5, 6, 7, 8 in token order: popped 8, 7, 6, 5
        got = table.pool.alloc(i32([4])).pages
    assert got.tolist()[:4] == rows[2][::-1]
    table.check_invariants(exclusive=False)         # (the pool's alloc holds pages the table does not)


def test_release_into_the_cache_queues_shared_pages_after_every_rows_tail(make_table, guard):
    """Forked rows released into the cache in ONE call: a page they share is queued at its last
    occurrence, after every row's own pages, so eviction takes the leaves before the prefix they hang
    from, as when each row is released in a call of its own (before: at its first occurrence, between
    the first row's tail and the second's, so the shared prefix went before a tail that needs it)."""
    orders = []
    for one_call in (True, False):
        table = make_table(16, 4, 3, 4)
        with guard():
            table.extend(i32([0]), i32([8]), max_tokens=8)               # pages 0, 1: the shared head
            table.fork(i32([0, 0]), i32([1, 2]), i32([8, 8]))
            table.extend(i32([0, 1, 2]), i32([4, 4, 2]), max_tokens=12)  # tails 2, 3, 4
            if one_call:
                table.release(i32([0, 1, 2]), cache=True)
            else:
                for r in (0, 1, 2):
                    table.release(i32([r]), cache=True)
            out = table.pool.evict(5)
        table.pool.check()
        orders.append(out.tolist())
    assert orders[0] == orders[1] == [2, 3, 4, 1, 0]
    table.check_invariants()


def test_flashinfer_csr_matches_hand_built(make_table, guard):
    table = make_table(32, 4, 4, 4)
    with guard():
        table.extend(i32([0, 1, 2]), i32([5, 4, 9]), max_tokens=18)
        csr = table.flashinfer_csr(i32([2, -1, 0, 3, 1]))
    bt, lens = table.block_table.tolist(), table.seq_lens.tolist()
    indptr, indices, last = [0], [], []
    for r in [2, -1, 0, 3, 1]:                           # built by hand on the host
        n = (lens[r] + 3) // 4 if r >= 0 else 0
        indices += bt[r][:n]
        indptr.append(indptr[-1] + n)
        last.append(lens[r] - (n - 1) * 4 if n else 4)
    assert csr.indptr.tolist() == indptr == [0, 3, 3, 5, 5, 6]
    assert csr.indices.tolist()[:indptr[-1]] == indices
    assert csr.indices.tolist()[indptr[-1]:] == [-1] * (20 - indptr[-1])
    assert csr.last_page_len.tolist() == last == [1, 4, 1, 4, 4]
    with guard():
        rows = table.block_table_rows(i32([1, -1]))
    assert rows.tolist() == [bt[1], [-1] * 4]


def test_block_table_rows_counts_an_id_out_of_range_as_flashinfer_csr_does(make_table, guard):
    """An id outside ``[0, max_requests)`` gets a row of -1 and one ``bad_request`` (raised by the next
    ``check()``), as it does in ``flashinfer_csr``; padding (-1) and a repeated id count nothing."""
    table = make_table(32, 4, 3, 4)
    table.extend(i32([0, 1]), i32([5, 4]), max_tokens=9)
    bt = table.block_table.tolist()
    with guard():
        rows = table.block_table_rows(i32([1, -1, 1, 0]))
    assert rows.tolist() == [bt[1], [-1] * 4, bt[1], bt[0]] and table.pool.stats()["errors.bad_request"] == 0
    with guard():
        rows = table.block_table_rows(i32([3, 0, -2, 1 << 30]))
    assert rows.tolist() == [[-1] * 4, bt[0], [-1] * 4, [-1] * 4]
    with pytest.raises(tpool.InvalidRequest) as rows_error:
        table.pool.check()
    table.flashinfer_csr(i32([3, 0, -2, 1 << 30]))
    with pytest.raises(tpool.InvalidRequest) as csr_error:
        table.pool.check()                                                  # what came since the last check
    assert rows_error.value.counts == csr_error.value.counts == {"bad_request": 3}
    table.check_invariants()


def test_step_exports_the_pages_it_just_added(make_table, guard):
    table = make_table(16, 4, 2, 4)
    table.extend(i32([0, 1]), i32([4, 2]), max_tokens=6)   # request 0: page 0 (full); 1: page 1
    with guard():
        s = table.step(i32([0, 1]), i32([1, 1]))            # request 0 crosses into page 2
    assert s.slots.tolist() == [8, 6] and s.ok.tolist() == [True, True]
    assert s.csr.indptr.tolist() == [0, 2, 3]
    assert s.csr.indices.tolist() == [0, 2, 1, -1, -1, -1, -1, -1]
    assert s.csr.last_page_len.tolist() == [1, 3]
    with guard():
        again = table.step(i32([0, 1]), i32([1, 1]))
    assert again.csr.indices is s.csr.indices and again.slots.tolist() == [9, 7]
    table.check_invariants()


def test_a_csr_past_its_capacity_never_points_past_it(make_table, guard):
    """The first request whose pages do not all fit, and every later one, is exported with no pages
    (a step: kv_lens 0, its tokens appended all the same), counted once: an attention kernel bounded
    by indptr reads only indices and only the pages of its own request."""
    table = make_table(32, 4, 4, 8)
    table.extend(i32([0, 1, 2]), i32([9, 9, 2]), max_tokens=20)   # 3, 3 and 1 pages
    bt = table.block_table.tolist()
    with guard():
        c = table.flashinfer_csr(i32([0, 1, 2]), capacity=5)       # 3 fit; 1 does not, and 2 comes after it
    assert c.indptr.tolist() == [0, 3, 3, 3] and c.last_page_len.tolist() == [1, 4, 4]
    assert c.indices.tolist() == bt[0][:3] + [-1, -1]
    with guard():
        c = table.flashinfer_csr(i32([2, 0, 1]), capacity=5)
    assert c.indptr.tolist() == [0, 1, 4, 4] and c.indices.tolist() == bt[2][:1] + bt[0][:3] + [-1]
    assert table.pool.stats()["errors.out_overflow"] == 2
    with pytest.raises(tpool.OutputOverflow, match="exported with no pages"):
        table.pool.check()
    with guard():
        s = table.step(i32([0, 1]), i32([1, 1]), capacity=5)        # 3 + 3 pages after the step
    assert s.ok.tolist() == [True, True] and table.seq_lens[:2].tolist() == [10, 10]
    assert s.csr.indptr.tolist() == [0, 3, 3] and s.kv_lens.tolist() == [10, 0]
    assert s.csr.indices.tolist() == bt[0][:3] + [-1, -1]
    with guard():
        s = table.step(i32([0, 1]), i32([1, 1]))                    # room again: both, from the rows
    assert s.csr.indptr.tolist() == [0, 3, 6] and s.kv_lens.tolist() == [11, 11]
    assert s.csr.indices.tolist()[:6] == bt[0][:3] + bt[1][:3]
    with pytest.raises(tpool.OutputOverflow):
        table.pool.check()
    table.check_invariants()


def test_a_fork_sharing_whole_pages_only_is_never_refused_for_want_of_a_page(make_table, guard):
    """Only a lane that copies a partial page takes one from the stack (first come first served):
    a later lane sharing whole pages only runs even when an earlier lane's copy page did not fit,
    as an extend lane needing no page does (n-way sampling after one partial fork)."""
    table = make_table(4, 4, 5, 4)
    with guard():
        table.extend(i32([0]), i32([10]), max_tokens=10)              # pages 0, 1, 2; one page free
        f = table.fork(i32([0, 0, 0]), i32([1, 2, 3]), i32([10, 6, 8]))
    assert f.ok.tolist() == [True, False, True]                       # lane 1 wanted the second free page
    assert f.cow_src.tolist() == [2, -1, -1] and f.cow_dst.tolist() == [3, -1, -1]
    assert table.seq_lens.tolist() == [10, 10, 0, 8, 0]
    assert table.block_table[3].tolist() == [0, 1, -1, -1]
    assert table.pool.stats()["requests.failed"] == 1
    table.check_invariants()


def test_a_fork_checks_the_partial_page_it_copies(make_table, guard):
    """The partial page a fork copies is read like the shared ones: freed under the row (misuse), it
    is a use_after_free and the lane fails, with no copy pair (the fork would copy a free page,
    possibly onto itself); a hand-edited id outside the pool is corrupt state, the lane fails too."""
    table = make_table(8, 4, 5, 4)
    with guard():
        table.extend(i32([0]), i32([3]), max_tokens=3)                # page 0, partial
    table.pool.free(i32([0]))                                         # misuse: row 0 still names page 0
    with guard():
        f = table.fork(i32([0]), i32([1]), i32([3]))
    assert f.ok.tolist() == [False] and f.cow_src.tolist() == [-1] and f.cow_dst.tolist() == [-1]
    assert table.seq_lens[1].item() == 0 and table.pool.available() == 8
    with pytest.raises(tpool.UseAfterFree, match="use_after_free: 1"):
        table.pool.check()
    table = make_table(8, 4, 5, 4)
    with guard():
        table.extend(i32([0]), i32([6]), max_tokens=6)                # pages 0, 1
    table.block_table[0, 1] = 99                                      # a hand edit: the partial page is wild
    with guard():
        f = table.fork(i32([0, 0]), i32([1, 2]), i32([6, 4]))
    assert f.ok.tolist() == [False, True] and f.cow_src.tolist() == [-1, -1]
    assert table.seq_lens.tolist()[1:3] == [0, 4] and table.pool.available() == 6
    with pytest.raises(tpool.CorruptState, match="corrupt_state: 1"):
        table.pool.check()


def test_a_step_exports_no_pages_for_a_repeated_id(make_table, guard):
    """A request named twice in a step is a bad_request after its first lane: kv_lens 0, and its
    CSR lane has no pages either (an attention kernel reading the CSR would attend it twice)."""
    table = make_table(8, 4, 5, 4)
    with guard():
        table.extend(i32([0, 1]), i32([6, 3]), max_tokens=9)          # pages 0, 1 | 2
        s = table.step(i32([0, 0, 1]), i32([1, 1, 1]), max_tokens=3)
    assert s.ok.tolist() == [True, False, True] and s.kv_lens.tolist() == [7, 0, 4]
    assert s.csr.indptr.tolist() == [0, 2, 2, 3] and s.csr.last_page_len.tolist() == [3, 4, 4]
    assert s.csr.indices.tolist()[:3] == [0, 1, 2]
    with pytest.raises(tpool.InvalidRequest, match="bad_request: 1"):
        table.pool.check()
    with guard():
        c = table.flashinfer_csr(i32([0, 0]))                          # read-only: a repeated id is fine
    assert c.indptr.tolist() == [0, 2, 4]
    table.pool.check()
    table.check_invariants()


def test_a_lane_of_no_tokens_never_overflows_the_slots(make_table, guard):
    """A lane past the slot buffer fails with out_overflow; a later lane of no tokens has none to
    place and succeeds (its kv_lens is its length), in an extend and in a step."""
    table = make_table(8, 4, 5, 4)
    with guard():
        table.extend(i32([0, 1]), i32([2, 2]), max_tokens=4)
        r = table.extend(i32([0, 2, 1]), i32([1, 8, 0]), max_tokens=4)
    assert r.ok.tolist() == [True, False, True] and r.slots.tolist() == [2, -1, -1, -1]  # page 0, offset 2
    assert table.seq_lens.tolist()[:3] == [3, 2, 0]
    with pytest.raises(tpool.OutputOverflow, match="out_overflow: 1"):
        table.pool.check()
    with guard():
        s = table.step(i32([0, 2, 1]), i32([1, 8, 0]), max_tokens=4)
    assert s.ok.tolist() == [True, False, True] and s.kv_lens.tolist() == [4, 0, 2]
    assert s.qo_indptr.tolist() == [0, 1, 4, 4] and s.csr.indptr.tolist() == [0, 1, 1, 2]
    with pytest.raises(tpool.OutputOverflow, match="out_overflow: 1"):
        table.pool.check()
    table.check_invariants()


@pytest.mark.parametrize("other_len", [5, 8])
def test_check_invariants_finds_two_rows_naming_a_partial_last_page(make_table, other_len):
    """extend reads no reference count, so two rows naming one request's partial last page would
    append into the same slots. fork and truncate never make such a pair, a hand edit does (or a
    page freed under a row and popped by another), and check_invariants reports it; a pool incref of
    the page (another holder, not a row) is no such pair: the row appends past the tokens the holder has."""
    table = make_table(8, 4, 3, 4)
    table.extend(i32([0]), i32([6]), max_tokens=6)                    # pages 0 and 1 (partial)
    table.pool.incref(i32([1]))
    table.check_invariants(exclusive=False)
    table.pool.free(i32([1]))
    pages = table.block_table[0, :2].clone()
    table.block_table[1, :2] = pages                                  # a hand edit: row 1 names both pages
    table.seq_lens[1] = other_len                                     # page 1 partial there too, or whole
    table.pool.incref(pages)
    table.invalidate_csr()
    with pytest.raises(tpool.InvariantViolation, match=rf"partial last page.*request 0's page {int(pages[1])}, at "
                       r"\(request, entry\) \(0, 1\), \(1, 1\)"):  # the page, and every entry naming it
        table.check_invariants()


def test_check_invariants_names_the_page_freed_under_a_row(make_table):
    """A page freed through the pool while a row still names it: check_invariants names the page, its
    count and the entries naming it; once another request is given it, both rows."""
    table = make_table(16, 4, 4, 4)
    table.extend(i32([0, 1]), i32([6, 6]), max_tokens=12)
    page = int(table.block_table[1, 0])
    table.pool.free(table.block_table[1, :1].clone())                 # row 1 still names it
    with pytest.raises(tpool.InvariantViolation, match=rf"\(page {page}: refcount 0, table entries naming it 1: "
                       r"at \(request, entry\) \(1, 0\)\)"):
        table.check_invariants()
    table.extend(i32([2]), i32([4]), max_tokens=4)                    # the freed page is popped first
    assert int(table.block_table[2, 0]) == page
    with pytest.raises(tpool.InvariantViolation, match=rf"page {page}: refcount 1, table entries naming it 2: at "
                       r"\(request, entry\) \(1, 0\), \(2, 0\)"):
        table.check_invariants()


def test_bound_step_matches_step_with_inputs_filled_in_place(make_table, guard):
    tables = [make_table(64, 4, 4, 8) for _ in range(2)]
    ids, ntok = i32([0, 1, 2, -1]), i32([5, 2, 9, 0])
    run = tables[0].bind_step(ids, ntok, max_tokens=16)
    rng = random.Random(3)
    for _ in range(12):
        with guard():
            got = run()
        want = tables[1].step(ids, ntok, max_tokens=16)
        for x, y in zip((got.slots, got.ok, *got.csr), (want.slots, want.ok, *want.csr)):
            assert x.tolist() == y.tolist()
        ids.copy_(i32(rng.sample([0, 1, 2, 3, -1, -1], 4)))      # the scheduler refills the inputs
        ntok.copy_(i32([rng.randint(0, 3) for _ in range(4)]))
    assert tables[0].seq_lens.tolist() == tables[1].seq_lens.tolist()
    ntok.resize_(2)                                # same memory, fewer lanes: the binding is stale
    with pytest.raises(ValueError, match="the length or the storage size they were bound with"):
        run()
    ntok.resize_(4)
    run()
    ids.set_(torch.zeros(4, dtype=torch.int32).untyped_storage())  # new memory: stale again
    with pytest.raises(ValueError, match="no longer have the memory, the length or the storage size"):
        run()
    with pytest.raises(ValueError, match="num_tokens: expected 4 entries"):
        tables[0].bind_step(ids, i32([1]))


def test_step_on_the_same_tensors_binds_them_and_still_checks_them(make_table, guard):
    """table.step with the same two tensor objects each step (filled in place) runs bound from
    the second step on; resized, reassigned or retyped tensors are checked like new ones."""
    tables = [make_table(64, 4, 4, 8) for _ in range(2)]
    assert tables[0].step_binding is None           # no step yet
    ids, ntok = i32([0, 1, 2, -1]), i32([5, 2, 9, 0])
    rng = random.Random(5)
    for _ in range(10):
        with guard():
            got = tables[0].step(ids, ntok, max_tokens=16)
        want = tables[1].step(ids.clone(), ntok.clone(), max_tokens=16)   # new tensors: never bound
        for x, y in zip((got.slots, got.ok, *got.csr), (want.slots, want.ok, *want.csr)):
            assert x.tolist() == y.tolist()
        ids.copy_(i32(rng.sample([0, 1, 2, 3, -1, -1], 4)))
        ntok.copy_(i32([rng.randint(0, 3) for _ in range(4)]))
    assert tables[0].step_binding is not None  # it did bind them
    tables[0].step(ids, ntok, max_tokens=int("16"))  # an equal int, another object: still bound
    assert tables[0].step_binding is not None
    big = [tables[0].step(ids, ntok, max_tokens=int(v)) for v in ("300", "300")]  # ints not cached by Python
    assert tables[0].step_binding is not None and big[0].slots.numel() == 300
    tables[0].step(ids, ntok, max_tokens=16)
    ids.resize_(2)                              # fewer lanes, same memory: checked as new inputs
    with pytest.raises(ValueError, match="num_tokens: expected 2 entries"):
        tables[0].step(ids, ntok, max_tokens=16)
    ids.resize_(4)
    ids.set_(i32([3, -1, -1, -1]).untyped_storage())   # new memory: the step reads it
    with guard():
        got = tables[0].step(ids, ntok, max_tokens=16)
        tables[0].step(ids, ntok, max_tokens=16)  # bound again
    assert got.ok.tolist()[1:] == [False] * 3 and tables[0].step_binding is not None
    if tables[0].pool.backend == "numba":      # (the others hand the tensor itself to their ops)
        ids.copy_(i32([1, 2, -1, 1 << 20]))
        ids.data = ids.view(torch.float32)     # same memory and length, another dtype: not noticed,
        bad = tables[0].pool.stats()["errors.bad_request"]
        tables[0].step(ids, ntok, max_tokens=16)   # the kernel reads the same bits, and the id out
        assert tables[0].pool.stats()["errors.bad_request"] == bad + 1   # of range counts, once
        tables[0].check_invariants()


def test_step_buffers_per_shape_and_size_arguments(make_table, guard):
    import numpy as np
    table = make_table(32, 4, 2, 4)
    a = table.step(i32([0, 1]), i32([5, 1]), max_tokens=np.int64(6))   # numpy ints are sizes too
    assert a.slots.tolist() == [0, 1, 2, 3, 4, 8] and a.csr.indices.tolist()[:4] == [0, 1, 2, -1]
    b = table.step(i32([1, -1]), i32([1, 0]), max_tokens=2)
    assert a.csr.indices is b.csr.indices          # the CSR depends on (B, capacity) only,
    assert a.slots is not b.slots and b.slots.tolist() == [9, -1]
    assert b.csr.indices.tolist() == [2, -1, -1, -1, -1, -1, -1, -1]  # so the shorter export re-pads it
    assert b.csr.indptr.tolist() == [0, 1, 1] and b.csr.last_page_len.tolist() == [2, 4]
    for bad in (True, -1, 2.0):
        with pytest.raises(ValueError, match="max_tokens: expected a non-negative int"):
            table.step(i32([0]), i32([1]), max_tokens=bad)
    with pytest.raises(ValueError, match="capacity: expected a non-negative int"):
        table.flashinfer_csr(i32([0]), capacity=-3)


def test_outputs_are_table_owned_and_reused(make_table, guard):
    table = make_table(16, 4, 2, 4)
    with guard():
        a = table.extend(i32([0, 1]), i32([1, 1]))
        b = table.extend(i32([0, 1]), i32([1, 1]))
    assert a.slots is b.slots and b.slots.tolist() == [1, 5]


def test_table_and_pool_refuse_copies_and_oversized_slot_space():
    import copy
    import pickle
    pool = tpool.PagePool(8, page_size=2, device="cpu")
    table = tpool.PageTable(pool, 2, 2)
    for obj in (pool, table):
        for clone in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match="cannot be copied or pickled"):
                clone(obj)
    big = tpool.PagePool(2, page_size=2**30, device="cpu", backend="reference")  # 2**31 slots
    with pytest.raises(ValueError, match="slots are int32"):
        tpool.PageTable(big, 1, 1)
    wide = tpool.PagePool(16, page_size=2**12, device="cpu", backend="reference")
    with pytest.raises(ValueError, match="lengths are int32"):  # 2**19 pages of 2**12 tokens: 2**31 tokens a row
        tpool.PageTable(wide, 1, 2**19)
    with pytest.raises(ValueError, match="pool: expected a tpool.PagePool, got object"):  # was an AttributeError
        tpool.PageTable(object(), 1, 4)


def test_none_as_a_first_input_is_a_value_error(make_table):
    """Before any call the memos of the last input checked hold no argument (None included)."""
    table = make_table(8, 2, 2, 4)
    for call in (lambda: table.pool.free(None), lambda: table.release(None), lambda: table.extend(None, None),
                 lambda: table.step(None, None), lambda: table.pool.alloc(None)):
        with pytest.raises(ValueError, match="expected a torch.Tensor, got NoneType"):
            call()


def test_one_element_inputs_with_any_stride_are_accepted(make_table, guard):
    table = make_table(8, 2, 2, 4)
    odd = lambda v: i32([v, 0, 0, 0])[::3][:1]   # shape (1,), stride (3,): contiguous all the same
    assert odd(5).stride() == (3,) and odd(5).is_contiguous()
    with guard():
        r = table.extend(odd(1), odd(3), max_tokens=3)
        table.truncate(odd(1), odd(1))
    assert r.slots.tolist() == [0, 1, 2] and table.seq_lens.tolist() == [0, 1]
    with guard():
        table.pool.free(odd(7))                   # a FREE page: counted, not raised here
        table.pool.alloc(odd(1), out=table.pool.alloc_out(max_batch=1, max_pages=1))
    assert table.pool.stats()["errors.double_free"] == 1


def test_bad_inputs(make_table):
    table = make_table(8, 2, 2, 2)
    with pytest.raises(ValueError, match="num_tokens: expected 2 entries"):
        table.extend(i32([0, 1]), i32([1]))
    with pytest.raises(ValueError, match="req_ids: expected dtype torch.int32, got torch.int64"):
        table.release(torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"req_ids: expected at most 4096 entries \(one per lane; the pool's "
                       r"max_batch, PagePool\(\.\.\., max_batch=N\)\), got 4097"):
        table.truncate(torch.zeros(4097, dtype=torch.int32), torch.zeros(4097, dtype=torch.int32))


def _random_ids(rng, R):
    """A batch of 1-4 ids: distinct ids in ``[-1, R]`` mostly; a quarter of the time repeats and ids below -1."""
    if rng.random() < 0.75:
        return rng.sample(range(-1, R + 1), rng.randint(1, 4))
    return [rng.choice([-1, -2, R, R + 5] if rng.random() < 0.3 else range(R)) for _ in range(rng.randint(1, 4))]


@pytest.mark.parametrize("ps,MP", [(1, 5), (3, 5), (16, 5), (1, 12), (2, 10)])
def test_random_workload_matches_model(make_table, guard, ps, MP, seed):
    # MP >= 8 lets the numba CSR copy whole rows in blocks of 8 (and run past a row's end). Besides
    # valid calls: repeated ids and ids below -1, negative and too long truncates, truncates by a drop,
    # fork sources out of range, steps that release requests first, block_table_rows, and evictions
    # (the order a release into the cache queued its pages in).
    rng = random.Random(seed + ps + 100 * MP)
    P, R = 40, 6
    table = make_table(P, ps, R, MP)
    model = TableModel(PoolModel(P), R, MP, ps)
    for _ in range(50):
        op = rng.choice(["extend", "extend", "decode", "step", "release", "truncate", "fork", "csr", "rows", "evict"])
        ids = _random_ids(rng, R)
        # A CSR capacity: the default (always enough), or one near the batch's page count,
        # from too small to several entries spare. Buffers are reused per (B, capacity).
        pages = sum(-(-model.lens[r] // ps) for r in ids if 0 <= r < R)
        csr_cap = None if rng.random() < 0.5 else max(0, pages + rng.randint(-3, 9))
        if op in ("extend", "decode", "step"):
            ntok = [1] * len(ids) if op == "decode" else [rng.randint(-1, 2 * ps + 1) for _ in ids]
            cap = sum(max(n, 0) for n in ntok) + rng.randint(-1, 2)
            cap = max(cap, 0)
            gone = _random_ids(rng, R) if op == "step" and rng.random() < 0.3 else None
            gone_cache = gone is not None and rng.random() < 0.5  # released into the cache
            with guard():
                if op == "step":
                    r = table.step(i32(ids), i32(ntok), max_tokens=cap, capacity=csr_cap,
                                   release=None if gone is None else i32(gone), release_cache=gone_cache)
                else:
                    r = table.extend(i32(ids), i32(ntok), max_tokens=cap)
            if gone is not None:
                model.release(gone, gone_cache)
            assert (r.slots.tolist(), r.ok.tolist()) == model.extend(ids, ntok, cap)
            if op == "step":
                indptr, indices, last = model.csr(ids, csr_cap if csr_cap is not None else len(ids) * MP,
                                                  count=False, step=True)  # one count per bad lane, the extend's
                assert (r.positions.tolist(), r.qo_indptr.tolist(), r.kv_lens.tolist()) == model.meta
                assert (r.csr.indptr.tolist(), r.csr.indices.tolist(), r.csr.last_page_len.tolist()) == (
                    indptr, indices, last)
        elif op == "release":
            cache = rng.random() < 0.5
            with guard():
                table.release(i32(ids), cache=cache)
            model.release(ids, cache)
        elif op == "truncate":
            lens = [model.lens[r] - rng.randint(-1, 2 * ps) if 0 <= r < R else 0 for r in ids]
            if rng.random() < 0.5:  # the lengths as tokens to drop, worked out from the lengths before the call
                with guard():
                    table.truncate(i32(ids), drop=i32([model.lens[r] - n if 0 <= r < R else 0
                                                       for r, n in zip(ids, lens)]))
            else:
                with guard():
                    table.truncate(i32(ids), i32(lens))
            model.truncate(ids, lens)
        elif op == "fork":
            src = [rng.randrange(R) if rng.random() < 0.9 else rng.choice([-1, R]) for _ in ids]
            lens = [rng.randint(0, model.lens[s] + 1) if 0 <= s < R else 1 for s in src]
            with guard():
                f = table.fork(i32(src), i32(ids), i32(lens))
            assert (f.ok.tolist(), f.cow_src.tolist(), f.cow_dst.tolist()) == model.fork(src, ids, lens)
        elif op == "rows":
            if rng.random() < 0.5:  # each id twice, the last one twice in a row (each copied again)
                ids = ids + ids[::-1]
            with guard():
                rows = table.block_table_rows(i32(ids))
            assert rows.tolist() == model.rows_of(ids)
        elif op == "evict":  # the CACHED pages in the model's order: each released row's last page first
            k = rng.randint(0, 4)
            with guard():
                evicted = table.pool.evict(k)
            assert evicted.tolist() == model.pool.evict(k)
        else:
            with guard():
                c = table.flashinfer_csr(i32(ids), capacity=csr_cap)
            indptr, indices, last = model.csr(ids, csr_cap if csr_cap is not None else len(ids) * MP)
            assert (c.indptr.tolist(), c.indices.tolist(), c.last_page_len.tolist()) == (indptr, indices, last)
        model.assert_matches(table)
        assert table.pool.stats()["errors.bad_request"] == model.pool.errors.get("bad_request", 0), op
        table.check_invariants()


def test_truncate_by_tokens_to_drop_matches_the_absolute_form(make_table, guard):
    """Speculative decoding knows how many drafts it rejected, not the absolute length."""
    tables = [make_table(64, 4, 4, 8) for _ in range(2)]
    for t in tables:
        t.extend(i32([0, 1, 2]), i32([9, 5, 13]), max_tokens=27)
    with guard():
        tables[0].truncate(i32([0, -1, 2, 1]), drop=i32([3, 0, 13, 6]))   # 6 > request 1's 5 tokens
    tables[1].truncate(i32([0, -1, 2, 1]), i32([6, 0, 0, -1]))
    assert tables[0].seq_lens.tolist() == tables[1].seq_lens.tolist() == [6, 5, 0, 0]
    assert tables[0].block_table.tolist() == tables[1].block_table.tolist()
    for t in tables:
        with pytest.raises(tpool.InvalidLength):
            t.pool.check()
        t.check_invariants()
    with pytest.raises(ValueError, match="exactly one of new_lens and drop"):
        tables[0].truncate(i32([0]))
    with pytest.raises(ValueError, match="exactly one of new_lens and drop"):
        tables[0].truncate(i32([0]), i32([1]), drop=i32([1]))
    # A negative drop, one past int32 when subtracted, and a repeated id: bad lengths / a bad request,
    # the rows unchanged, on every backend (the new length is worked out in the call, in int64).
    for t in tables:
        t.pool.check_invariants()
        t.extend(i32([2]), i32([7]), max_tokens=7)
    with guard():
        tables[0].truncate(i32([0, 2, 2]), drop=i32([-1, -(2**31), 3]))
    assert tables[0].seq_lens.tolist() == [6, 5, 7, 0]
    with pytest.raises(tpool.PoolError) as err:
        tables[0].pool.check()
    assert "bad_length: 2" in str(err.value) and "bad_request: 1" in str(err.value)
    with pytest.raises(ValueError, match="drop: shares memory"):
        tables[0].truncate(i32([0]), drop=tables[0].seq_lens[:1])   # the call writes seq_lens


def test_step_into_caller_owned_outputs(make_table, guard):
    """Two StepOuts alternate (overlap scheduling): step N+1 leaves step N's outputs as they were."""
    table, ref = make_table(64, 4, 4, 8), make_table(64, 4, 4, 8)
    outs = [table.step_out(2, max_tokens=8), table.step_out(2, max_tokens=8)]
    ids = i32([0, 1])
    kept = None
    for n, ntok in enumerate(([5, 3], [1, 1], [1, 1], [4, 1], [1, 1])):
        with guard():
            got = table.step(ids, i32(ntok), max_tokens=8, out=outs[n % 2])
        want = ref.step(ids, i32(ntok), max_tokens=8)
        assert got is outs[n % 2].result
        for x, y in zip((got.slots, got.ok, *got.csr), (want.slots, want.ok, *want.csr)):
            assert x.tolist() == y.tolist()
        if kept is not None:   # the other buffer set still holds the previous step
            assert [x.tolist() for x in (outs[(n + 1) % 2].result.slots, *outs[(n + 1) % 2].result.csr)] == kept
        kept = [x.tolist() for x in (got.slots, *got.csr)]
    table.check_invariants()
    with pytest.raises(ValueError, match="max_tokens: expected 8"):
        table.step(ids, i32([1, 1]), max_tokens=4, out=outs[0])
    with pytest.raises(ValueError, match="batch: expected 2"):
        table.step(i32([0]), i32([1]), out=outs[0])
    with pytest.raises(ValueError, match="num_tokens: shares memory"):
        table.step(ids, outs[0].result.slots[:2], out=outs[0])
    table.step(ids, outs[1].result.slots[:2].clone(), out=outs[0])   # a copy is fine
    with pytest.raises(ValueError, match="one from another table"):
        ref.step(ids, i32([1, 1]), out=outs[0])


@pytest.mark.parametrize("cache", [False, True])
def test_step_with_release_equals_release_then_step(make_table, guard, cache):
    """``step(..., release=gone)`` is ``release(gone)`` then ``step(...)`` in one call: same outputs,
    same table and pool, on every backend; each such step is followed by decode steps."""
    one, two = make_table(64, 4, 6, 8), make_table(64, 4, 6, 8)
    for t in (one, two):
        t.extend(i32([0, 1, 2, 3]), i32([5, 9, 2, 7]), max_tokens=23)
    batch = [0, 1, 2, 3]
    for gone, new in ((None, None), ([1, -1], 4), ([-1, 3], 5), ([4, 0], 1)):
        ntok = [1] * 4
        if gone is not None:  # finished requests leave, a new one takes a lane with a prompt
            batch = [new if r in gone else r for r in batch]
            ntok = [3 if r == new else 1 for r in batch]
            one.release(i32(gone), cache=cache)
        for k in range(3):
            want = one.step(i32(batch), i32(ntok), max_tokens=12)
            with guard():
                got = two.step(i32(batch), i32(ntok), max_tokens=12, release_cache=cache,
                               release=i32(gone) if gone is not None and k == 0 else None)
            for x, y in zip((got.slots, got.ok, *got.csr, got.positions, got.kv_lens),
                            (want.slots, want.ok, *want.csr, want.positions, want.kv_lens)):
                assert x.tolist() == y.tolist()
            same_table_state(one, two)
            ntok = [1] * 4
    for t in (one, two):
        t.check_invariants()
    assert one.pool.stats() == two.pool.stats()


def test_step_with_release_into_a_step_out(make_table, guard):
    """The same through ``out=``: the release happens, then the step writes the StepOut."""
    one, two = make_table(64, 4, 6, 8), make_table(64, 4, 6, 8)
    out = two.step_out(2, max_tokens=6)
    for t in (one, two):
        t.extend(i32([0, 1, 2]), i32([5, 9, 2]), max_tokens=16)
    one.release(i32([1]))
    want = one.step(i32([0, 2]), i32([1, 4]), max_tokens=6)
    with guard():
        got = two.step(i32([0, 2]), i32([1, 4]), max_tokens=6, out=out, release=i32([1]))
    assert got is out.result
    for x, y in zip((got.slots, *got.csr), (want.slots, *want.csr)):
        assert x.tolist() == y.tolist()
    same_table_state(one, two)


def test_step_with_release_refuses_bad_release_before_any_change(make_table):
    table = make_table(32, 4, 4, 8)
    table.extend(i32([0, 1]), i32([5, 3]), max_tokens=8)
    res = table.step(i32([0, 1]), i32([1, 1]))
    before = [x.clone() for x in (table.block_table, table.seq_lens, table.pool.state.counters)]
    for bad, match in ((torch.tensor([1], dtype=torch.int64), "release: expected .*int32"),
                       (i32([[1]]), "release"),
                       (res.slots, "release: shares memory")):
        with pytest.raises(ValueError, match=match):
            table.step(i32([0, 1]), i32([1, 1]), release=bad)
    with pytest.raises(ValueError, match="release_cache: expected a bool, got 1"):
        table.step(i32([0, 1]), i32([1, 1]), release=i32([1]), release_cache=1)
    for x, y in zip((table.block_table, table.seq_lens, table.pool.state.counters), before):
        assert x.tolist() == y.tolist()


@pytest.mark.parametrize("gone", [[1, 1, -1], [7, -5, 100, 2], [], [-1, -1], [1]])
def test_step_with_release_edge_cases_match_the_two_calls(make_table, guard, gone):
    """Repeated, out-of-range, empty and padding-only releases, and a request released and admitted
    again in the same step with a prompt (request 1 here): as release() then step(), errors too."""
    one, two = make_table(64, 4, 6, 8), make_table(64, 4, 6, 8)
    for t in (one, two):
        t.extend(i32([0, 1, 2]), i32([5, 9, 2]), max_tokens=16)
        t.step(i32([0, 1, 2]), i32([1, 1, 1]))
    batch, ntok = i32([0, 1, 2]), i32([1, 5 if 1 in gone else 1, 1])
    one.release(i32(gone), cache=True)
    want = one.step(batch, ntok, max_tokens=8)
    with guard():
        got = two.step(batch, ntok, max_tokens=8, release=i32(gone), release_cache=np.bool_(True))
    for x, y in zip((got.slots, got.ok, *got.csr, got.positions, got.kv_lens),
                    (want.slots, want.ok, *want.csr, want.positions, want.kv_lens)):
        assert x.tolist() == y.tolist()
    same_table_state(one, two)
    assert one.pool.stats() == two.pool.stats()
    two.check_invariants(exclusive=False)


def test_a_padding_only_release_leaves_the_numba_csr_growable(guard):
    """Nothing finished: ``release=`` all padding changes no row, so the next step still grows
    its CSR in place (numba) instead of going the slower way."""
    table = tpool.PageTable(tpool.PagePool(64, 4, device="cpu", backend="numba"), 4, 8)
    ids, ones, pad = i32([0, 1, 2]), i32([1, 1, 1]), i32([-1, -1])
    table.extend(ids, i32([5, 9, 2]), max_tokens=16)
    for _ in range(3):
        with guard():
            table.step(ids, ones, release=pad)
        assert table.step_grows_csr(ids)
    table.release(pad)
    assert table.step_grows_csr(ids)
    table.release(i32([3]))  # a row outside the batch: the step keeps every run instead
    assert not table.step_grows_csr(ids) and table.step_keeps_csr(ids) == 3


# ------------------------------------------------------- threads, and the shapes a table keeps
class _Watched:
    """A lock standing in for the pool's: it notes when a thread other than the test's asks for it
    (``asked``), and how often any thread takes it (``taken``)."""

    def __init__(self, lock):
        self.lock, self.owner, self.asked, self.taken = lock, threading.get_ident(), threading.Event(), 0

    def __enter__(self):
        self.taken += 1
        if threading.get_ident() != self.owner:
            self.asked.set()
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_shape_made_while_another_thread_makes_one(backend):
    """README, Threads: every call on a table is atomic. A table keeping one shape (max_shapes=1),
    and a second thread's call of a new shape run while the first thread's call had made its
    buffers but not recorded them yet: the second dropped them (the first raised KeyError). A
    shape is now made under the pool's lock: the second thread waits, then drops the first's
    shape as it makes its own, and each call runs on its own buffers. A step of a kept shape, or
    repeated, takes no lock on numba (its kernel call holds the GIL)."""
    table = tpool.PageTable(tpool.PagePool(64, 4, device="cpu", backend=backend), 8, 8, max_shapes=1)
    table.extend(i32([0, 1, 2]), i32([5, 9, 1]), max_tokens=15)
    ids = i32([0, 1, 2])
    watched = table._shapes.lock = _Watched(table.pool.state.lock)  # (the old ShapeBuffers had no lock)
    got, errors = {}, []

    def other():
        try:
            got["other"] = table.flashinfer_csr(ids.clone(), capacity=9).indptr.tolist()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
        finally:
            watched.asked.set()  # done (a thread that never asks for the lock does not hang the test)

    thread = threading.Thread(target=other)
    bind = table.ops.flashinfer_csr_into

    def binding(csr, memo):  # the first call, between making its buffers and recording them
        if "started" not in got:
            got["started"] = True
            thread.start()
            assert watched.asked.wait(timeout=60)  # the other thread waits for the lock, or is done
        return bind(csr, memo)
    table.ops.flashinfer_csr_into = binding
    try:
        got["first"] = table.flashinfer_csr(ids, capacity=8).indptr.tolist()
    finally:
        thread.join()
    assert not errors and got["first"] == got["other"] == [0, 2, 5, 6]
    assert table.kept_shapes() == ((("csr", 3, 9),), 1)   # the second call's, made after the first's
    table.check_invariants()
    if backend == "numba":  # the hot path: no lock taken
        object.__setattr__(table.pool.state, "lock", watched)  # (the state is a frozen dataclass)
        ones = i32([1, 1, 1])
        table.step(ids, ones)
        run = table.bind_step(batch=3)
        run.req_ids[:], run.num_tokens[:] = [0, 1, 2], 1
        table.step(ids, ones)                            # binds the repeated inputs
        watched.taken = 0
        for _ in range(3):
            table.step(ids, ones)                        # repeated: the binding
        for _ in range(3):
            run()                                        # bound
            table.step(ids.clone(), ones.clone())        # new inputs, a kept shape
        assert watched.taken == 0 and table.seq_lens.tolist()[:3] == [16, 20, 12]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_shape_dropped_by_another_thread_between_its_lookup_and_its_use(backend):
    """The lookup of a kept shape takes no lock: another thread may drop the shape right after
    it (max_shapes). That is no error (it raised KeyError): the call runs on the buffers it found."""
    table = tpool.PageTable(tpool.PagePool(32, 4, device="cpu", backend=backend), 4, 4, max_shapes=2)
    ids, ones = i32([0, 1]), i32([1, 1])
    first = table.extend(ids, ones)
    shapes = table._shapes

    class DroppedAfterLookup(collections.OrderedDict):
        def get(self, key, default=None):  # another thread's drop of the shape, right after the lookup
            entry = super().get(key, default)
            if entry is not None:
                del self[key]
                shapes.uses.pop(key)
            return entry
    shapes.entries = DroppedAfterLookup(shapes.entries)
    r = table.extend(ids, ones)
    assert r is first and r.slots.tolist() == [1, 5]
    shapes.entries = collections.OrderedDict(shapes.entries)
    assert table.extend(ids, ones).slots.tolist() == [2, 6]  # the shape, made again
    assert table.kept_shapes()[0] == (("extend", 2, 2),)
    table.check_invariants()


@pytest.mark.parametrize("backend", BACKENDS)
def test_shapes_dropped_while_another_thread_reorders_them(backend):
    """Dropping shapes (max_shapes) read the kept shapes while another thread's lookup, which takes
    no lock, could reorder them: "OrderedDict mutated during iteration". The drop now reads a copy."""
    table = tpool.PageTable(tpool.PagePool(32, 4, device="cpu", backend=backend), 4, 4, max_shapes=2)
    table.extend(i32([0]), i32([1]))
    table.extend(i32([0, 1]), i32([1, 1]))
    shapes = table._shapes

    class ReorderedMidway(set):
        def __contains__(self, key):  # another thread's lookup of a kept shape, in the middle of the drop
            shapes.entries.move_to_end(("extend", 1, 1))
            return super().__contains__(key)
    shapes.pinned = ReorderedMidway()
    r = table.extend(i32([0, 1, 2]), i32([1, 1, 1]))    # a third shape: one of the others is dropped
    keys, n_buffers = table.kept_shapes()
    assert r.slots.tolist() == [2, 5, 8] and len(keys) == n_buffers == 2 and keys[-1] == ("extend", 3, 3)
    table.check_invariants()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_repeated_step_whose_shape_was_dropped_is_bound_again(backend):
    """``step`` binds the inputs given twice in a row (``step_binding``). When the table dropped that
    shape (max_shapes), the binding kept writing the dropped buffers: steps returned buffers the
    table no longer keeps, which pin_shapes (what capture does) could not reach and which died
    with the binding. The drop now forgets the binding: the next step makes the shape again and
    binds it, and returns the buffers the table keeps."""
    table = tpool.PageTable(tpool.PagePool(64, 4, device="cpu", backend=backend), 4, 8, max_shapes=1)
    ids, ones = i32([0, 1]), i32([1, 1])
    table.step(ids, ones)
    first = table.step(ids, ones)
    assert table.step_binding is not None
    table.extend(i32([2]), i32([1]))                  # another shape: the step's is dropped
    assert table.kept_shapes()[0] == (("extend", 1, 1),) and table.step_binding is None
    r = table.step(ids, ones)
    (key,), _ = table.kept_shapes()
    assert key == ("step", 2, 2, 16) and table._shapes.entries[key][0] is r and r.slots is not first.slots
    assert table.step_binding is not None and table.step_binding.result is r     # bound again at once
    assert r.kv_lens.tolist() == [3, 3] and table.step(ids, ones) is r
    table.pin_shapes()                                # what tpool.graphs.capture does after capturing
    alive = weakref.ref(r.slots)
    del r, first
    table.step(i32([3]), i32([1]))                    # another step: the binding goes, the pinned shape stays
    gc.collect()
    assert alive() is not None and key in table.kept_shapes()[0]
    table.check_invariants()


def test_sizes_are_checked_when_their_shape_exists(make_table, guard):
    """A size went unchecked once its call shape existed: ``max_tokens=True`` or ``1.0`` after a first
    call of ``max_tokens`` 1 found that shape (equal keys) and was accepted."""
    table = make_table(32, 4, 4, 4)
    ids, ones = i32([0]), i32([1])
    table.extend(ids, ones)
    table.flashinfer_csr(ids, capacity=1)
    table.step(ids, ones)
    table.step(ids, ones, capacity=1)
    out = table.step_out(1)
    for bad in (True, 1.0):      # equal to 1, the shapes' max_tokens and capacity
        for call in (lambda: table.extend(ids, ones, max_tokens=bad), lambda: table.step(ids, ones, max_tokens=bad),
                     lambda: table.step(ids, ones, out=out, max_tokens=bad)):
            with pytest.raises(ValueError, match="max_tokens: expected a non-negative int"):
                call()
        for call in (lambda: table.flashinfer_csr(ids, capacity=bad), lambda: table.step(ids, ones, capacity=bad)):
            with pytest.raises(ValueError, match="capacity: expected a non-negative int"):
                call()
    with pytest.raises(ValueError, match="capacity: expected a non-negative int"):
        table.step(ids, ones, out=out, capacity=4.0)   # equal to the StepOut's
    with guard():   # numpy ints are sizes, of the same shape as the int
        r = table.step(ids, ones, max_tokens=np.int64(1), capacity=np.int32(1))
    assert r is table.step(ids, ones, capacity=1) and table.seq_lens.tolist()[0] == 5
    # a StepOut one lane or one CSR entry past the bounds (helper-127: +1 went unseen)
    b = table.pool.max_batch
    with pytest.raises(ValueError, match=f"batch: expected at most {b}"):
        table.step_out(b + 1)
    with pytest.raises(ValueError, match=f"capacity: expected at most {b * 4}"):
        table.step_out(1, capacity=b * 4 + 1)
    table.step_out(1, capacity=b * 4)   # the bound itself is taken


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "numba"])  # (numba read past the input)
def test_the_memo_of_the_last_ids_checked_is_read_once(backend):
    """A table remembers the last request ids it checked (``_seen_ids``: the tensor and its length).
    A call read that memo twice, once to ask whether its ids are the tensor remembered, once for
    the length: another thread's check of a longer tensor in between gave the call that tensor's
    length (64 lanes read from a one-entry input). The memo is read once now."""
    table = tpool.PageTable(tpool.PagePool(32, 4, device="cpu", backend=backend), 4, 4)
    ids = i32([1])
    table.flashinfer_csr(ids)                      # the memo: ids, one entry
    longer = tpool._checks.seen(torch.full((64,), -1, dtype=torch.int32))

    class SwappedAfterOneRead(tpool.PageTable):
        reads = 0

        @property
        def _seen_ids(self):  # another thread's check of a longer tensor, right after the first read
            SwappedAfterOneRead.reads += 1
            return self.__dict__["_memo"] if SwappedAfterOneRead.reads == 1 else longer

        @_seen_ids.setter
        def _seen_ids(self, memo):
            self.__dict__["_memo"] = memo
    table.__dict__["_memo"] = table.__dict__.pop("_seen_ids")
    table.__class__ = SwappedAfterOneRead
    try:
        csr = table.flashinfer_csr(ids)
    finally:
        table.__class__ = tpool.PageTable
        table.__dict__["_seen_ids"] = table.__dict__.pop("_memo")
    assert csr.indptr.tolist() == [0, 0] and table.kept_shapes()[0] == (("csr", 1, 4),)


def test_memory_bytes_counts_the_tables_tensors_each_storage_once():
    from tpool.kernels import layout as L

    pool = tpool.PagePool(1 << 16, page_size=16, device="cpu", backend="reference")
    table = tpool.PageTable(pool, 1024, 2048)  # the reviewer's reproducer: block table + lengths = 8,392,704 B
    m = table.memory_bytes()
    assert m["name"] == repr(table)
    assert (m["block_table_bytes"], m["seq_lens_bytes"]) == (1024 * 2048 * 4, 1024 * 4)
    assert m["block_table_bytes"] + m["seq_lens_bytes"] == 8_392_704  # table.block_table IS state.block_table: once
    # claim int32 [1024], lane_end int32 [max_batch], version int64 [2], row_version int64 [1024]
    assert m["other_state_bytes"] == 1024 * 4 + pool.max_batch * 4 + L.VERSION_CELLS * 8 + 1024 * 8
    assert (m["buffer_bytes"], m["csr_memo_bytes"], m["kept_shapes"]) == (0, 0, 0)
    assert m["total_bytes"] == 8_392_704 + m["other_state_bytes"]
    table.step(i32([0, 1]), i32([5, 3]))                 # step (2, 2, 4096)
    table.step(i32([0, 1]), i32([1, 1]), capacity=8)     # step (2, 2, 8): shares slots/ok/positions/... with it
    table.extend(i32([0, 1]), i32([1, 1]))               # extend (2, 2)
    m = table.memory_bytes()
    out = 8 + 2 + 8 + 12 + 8                             # slots, ok, positions, qo_indptr, kv_lens: counted once
    csr = lambda cap: 12 + cap * 4 + 8                   # indptr [3], indices [cap], last_page_len [2]
    assert m["buffer_bytes"] == out + csr(4096) + csr(8) + (8 + 2)
    assert m["csr_memo_bytes"] == 2 * L.memo_len(2) * 8 and m["kept_shapes"] == 3
    parts = sum(v for k, v in m.items() if k.endswith("_bytes") and k != "total_bytes")
    state_bytes = tpool.memory.accounting.retained_bytes(table.state.tensors())
    assert m["total_bytes"] == parts == state_bytes + m["buffer_bytes"] + m["csr_memo_bytes"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_new_shape_beside_pinned_shapes_is_kept_and_reused(backend):
    """At ``max_shapes`` with every other shape pinned, a new shape is kept (not dropped at once), so its
    next call reuses its buffers."""
    pool = tpool.PagePool(16, 4, device="cpu", backend=backend)
    table = tpool.PageTable(pool, max_requests=4, max_pages_per_request=4, max_shapes=1)
    table.extend(i32([0]), i32([1]), max_tokens=1)
    table.pin_shapes()
    a = table.extend(i32([1, 2]), i32([1, 1]), max_tokens=2)
    b = table.extend(i32([1, 2]), i32([1, 1]), max_tokens=2)
    assert a.slots.data_ptr() == b.slots.data_ptr()
