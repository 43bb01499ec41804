"""Unit tests of PagePool on every CPU backend, with hand-worked expectations."""

import threading

import pytest
import torch

import tpool
from conftest import i32
from pool_model import PoolModel
from tpool.kernels import layout as L
from tpool.kernels.layout import MAX_INDEXED


def test_alloc_fcfs_hand_worked(make_pool, guard):
    pool = make_pool(8)
    with guard():
        r = pool.alloc(i32([2, 3, 9]))
    assert r.pages.tolist() == [0, 1, 2, 3, 4, -1, -1, -1]
    assert r.indptr.tolist() == [0, 2, 5, 5]
    assert r.ok.tolist() == [True, True, False]
    assert pool.available() == 3
    assert pool.stats()["requests.failed"] == 1
    pool.check_invariants()


def test_a_pool_made_under_inference_mode_works_outside_it(make_pool):
    """Engines often build their caches under torch.inference_mode(); the pool's and table's state, output
    buffers and memos were then inference tensors, which torch refuses to update in place outside that mode:
    on numba check() raised RuntimeError (so no counted error could ever be raised), on the reference backend
    every call did. They are made as normal tensors whatever the caller's mode."""
    with torch.inference_mode():
        pool = make_pool(8)
        table = tpool.PageTable(pool, 2, 4)
        out = pool.alloc_out(2, 4)
        table.step(i32([0]), i32([1]))             # a shape's buffers and memo made under the mode too
    r = pool.alloc(i32([2]), out=out)
    table.step(i32([0]), i32([1]))
    pool.free(r.pages)
    pool.free(i32([int(r.pages[0])]))           # a double free, counted ...
    with pytest.raises(tpool.DoubleFree):       # ... and raised
        pool.check()
    table.check_invariants()
    assert table.seq_lens.tolist() == [2, 0] and pool.available() == 6   # the row holds 2 pages (page_size 1)
    from tpool.graphs import state_tensors
    assert not any(t.is_inference() for t in state_tensors(table))


def test_sync_points_work_under_another_default_device(make_pool):
    """A loop run under ``with torch.device("cuda"):`` (model code often sets one) made the host tensors of
    check() and check_invariants() there, so a CPU pool's check failed (the meta device stands for it here)."""
    pool = make_pool(8)
    table = tpool.PageTable(pool, 2, 4)
    r = pool.alloc(i32([2]))
    table.extend(i32([0]), i32([3]))
    pool.free(r.pages)
    pool.free(r.pages[:1])                          # a double free, counted
    with torch.device("meta"):
        with pytest.raises(tpool.DoubleFree):
            pool.check()
        pool.check()                                # what it raised is not raised again
        pool.check_invariants()
        table.check_invariants()


@pytest.mark.parametrize("edit, said", [
    (lambda st: st.free_stack.__setitem__(3, st.free_stack[5]), r"free stack ids distinct \(entries 3 and 5 are "
                                                                 r"both page \d+\)"),
    (lambda st: st.free_stack.__setitem__(2, 99), r"free stack ids in range \(entry 2 is 99\)"),
    (lambda st: st.refcount.__setitem__(6, 3), r"refcount > 0 iff USED \(page 6: FREE, refcount 3\)"),
    (lambda st: st.page_state.__setitem__(int(st.free_stack[2]), 1),
     r"every id on the free stack is FREE \(entry 2, page \d+: USED, refcount 0\)"),
    (lambda st: st.page_state.__setitem__(5, 7), r"every id on the free stack is FREE \(entry \d+, page 5: state 7, "
                                                 r"refcount 0\)"),
    (lambda st: st.page_gen.__setitem__(4, -2), r"generations non-negative \(page 4: generation -2\)"),
])
def test_check_invariants_names_where_a_rule_broke(make_pool, edit, said):
    """A hand-edited state: check_invariants names the rule and the first entry or page that breaks it."""
    pool = make_pool(8)
    edit(pool.state)
    with pytest.raises(tpool.InvariantViolation, match=said):
        pool.check_invariants()


@pytest.mark.parametrize("evict", [False, True])
def test_alloc_writes_every_output_entry(make_pool, evict):
    """An alloc writes every entry of its outputs, whatever they held (alloc without ``out=`` hands the
    kernel uninitialised tensors): poisoned ``out=`` buffers come back fully defined."""
    pool = make_pool(16)
    pool.free(pool.alloc(i32([6])).pages, cache=True)     # 6 cached pages, 10 free: room to evict
    out = pool.alloc_out(max_batch=5, max_pages=14)
    for t in (out.pages, out.indptr, out.evicted):
        t.fill_(7777)
    out.ok.fill_(True)
    r = pool.alloc(i32([8, 0, 4, -1]), out=out, evict=evict)  # 12 pages: evicts 2 when it may
    granted = 12 if evict else 8
    assert r.ok.tolist() == [True, True, evict, False, False]
    assert r.indptr.tolist() == [0, 8, 8, granted, granted, granted]
    assert all(0 <= p < 16 for p in r.pages[:granted].tolist()) and r.pages[granted:].tolist() == [-1] * (14 - granted)
    n = 2 if evict else 0
    assert all(0 <= p < 16 for p in r.evicted[:n].tolist()) and r.evicted[n:].tolist() == [-1] * (14 - n)
    pool.check_invariants()


@pytest.mark.parametrize("evict", [False, True])
def test_alloc_without_out_defines_every_entry_of_its_fresh_outputs(make_pool, evict, monkeypatch):
    """alloc without ``out=`` hands the kernel uninitialised tensors (``alloc_once``): made here full of a
    pattern, every entry comes back defined."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(True if t.dtype == torch.bool else 0x7EADBEEF)
    pool = make_pool(16, max_alloc_pages=14)
    pool.free(pool.alloc(i32([6])).pages, cache=True)     # 6 cached pages, 10 free
    counts = i32([8, 0, 4, -1])
    monkeypatch.setattr(torch, "empty", poisoned)
    r = pool.alloc(counts, evict=evict)                    # 12 pages: evicts 2 when it may
    monkeypatch.undo()
    granted, n = (12, 2) if evict else (8, 0)
    assert r.ok.tolist() == [True, True, evict, False] and r.indptr.tolist() == [0, 8, 8, granted, granted]
    assert all(0 <= p < 16 for p in r.pages[:granted].tolist()) and r.pages[granted:].tolist() == [-1] * (14 - granted)
    assert all(0 <= p < 16 for p in r.evicted[:n].tolist()) and r.evicted[n:].tolist() == [-1] * (14 - n)
    pool.check_invariants()


def test_outputs_and_bound_calls_print_their_sizes(make_pool):
    pool = make_pool(16)
    out = pool.alloc_out(max_batch=4, max_pages=8)
    assert repr(out) == "AllocOut(max_batch=4, max_pages=8, device=cpu)"
    counts = i32([1, 2])
    assert repr(pool.bind_alloc(counts, out=out)) == "BoundCall(alloc, input of 2)"
    assert repr(pool.bind_free(out.pages)) == "BoundCall(free, input of 8)"


def test_exact_fit_then_exhaustion(make_pool, guard):
    pool = make_pool(8)
    with guard():
        a = pool.alloc(i32([3, 5]))
        b = pool.alloc(i32([1]))
    assert a.ok.tolist() == [True, True] and a.indptr.tolist() == [0, 3, 8]
    assert sorted(a.pages.tolist()) == list(range(8))
    assert b.ok.tolist() == [False] and b.pages.tolist() == [-1] * 8
    assert pool.available() == 0
    pool.check_invariants()


def test_once_a_request_fails_all_later_fail(make_pool, guard):
    pool = make_pool(6)
    with guard():
        r = pool.alloc(i32([5, 1, 2, 0]))
    # 5 + 1 = 6 fits; 8 does not; the zero-count request after it fails too.
    assert r.ok.tolist() == [True, True, False, False]
    assert r.indptr.tolist() == [0, 5, 6, 6, 6]
    assert pool.stats()["requests.failed"] == 2


def test_zero_counts(make_pool, guard):
    pool = make_pool(4)
    with guard():
        r = pool.alloc(i32([0, 2, 0]))
    assert r.ok.tolist() == [True, True, True]
    assert r.indptr.tolist() == [0, 0, 2, 2]
    assert r.pages.tolist() == [0, 1, -1, -1]


def test_empty_batch(make_pool, guard):
    pool = make_pool(4)
    with guard():
        r = pool.alloc(i32([]))
        pool.free(i32([]))
    assert r.indptr.tolist() == [0] and r.ok.tolist() == [] and r.pages.tolist() == [-1] * 4
    assert pool.available() == 4


def test_out_buffers_padding_and_reuse(make_pool, guard):
    pool = make_pool(16)
    out = pool.alloc_out(max_batch=4, max_pages=6)
    with guard():
        r1 = pool.alloc(i32([1, 2]), out=out)
    assert r1.pages.tolist() == [0, 1, 2, -1, -1, -1]
    assert r1.indptr.tolist() == [0, 1, 3, 3, 3]
    assert r1.ok.tolist() == [True, True, False, False]
    with guard():
        r2 = pool.alloc(i32([2]), out=out)
    assert r2.pages is r1.pages  # same tensors: graph-safe, overwritten per call
    assert r2.pages.tolist() == [3, 4, -1, -1, -1, -1]
    assert r2.indptr.tolist() == [0, 2, 2, 2, 2] and r2.ok.tolist() == [True, False, False, False]
    assert pool.stats()["requests.failed"] == 0  # padding lanes are not failures


def test_out_overflow_is_counted_and_raised(make_pool, guard):
    pool = make_pool(8)
    out = pool.alloc_out(max_batch=2, max_pages=4)
    with guard():
        r = pool.alloc(i32([3, 2]), out=out)
    assert r.ok.tolist() == [True, False]
    assert pool.available() == 5  # the failed request changed nothing
    with pytest.raises(tpool.OutputOverflow) as e:
        pool.check()
    assert e.value.counts == {"out_overflow": 1}


def test_negative_count(make_pool, guard):
    pool = make_pool(8)
    with guard():
        r = pool.alloc(i32([1, -1, 1]))
    assert r.ok.tolist() == [True, False, False]
    assert pool.available() == 7
    with pytest.raises(tpool.InvalidCount):
        pool.check()


def test_free_pushes_in_first_occurrence_order_lifo(make_pool, guard):
    pool = make_pool(8)
    with guard():
        pool.alloc(i32([4]))
        pool.free(i32([2, -1, 0]))
        r = pool.alloc(i32([3]))
    # 2 then 0 pushed; popping from the top gives 0, 2, then the untouched 4.
    assert r.pages.tolist()[:3] == [0, 2, 4]
    pool.check_invariants()


def test_double_free_in_one_call_and_across_calls(make_pool, guard):
    pool = make_pool(4)
    with guard():
        pool.alloc(i32([2]))
        pool.free(i32([1, 1]))   # refcount 1: one release, one double free
        pool.free(i32([1]))      # already free
    assert pool.available() == 3
    assert pool.stats()["errors.double_free"] == 2
    pool.check_invariants()
    with pytest.raises(tpool.DoubleFree) as e:
        pool.check()
    assert e.value.counts == {"double_free": 2}
    pool.check()  # errors are reported once


def test_shared_page_needs_every_reference_dropped(make_pool, guard):
    pool = make_pool(4)
    with guard():
        pool.alloc(i32([1]))
        pool.incref(i32([0, 0]))   # refcount 3
        pool.free(i32([0, 0]))
    assert pool.state.refcount[0].item() == 1 and pool.available() == 3
    with guard():
        pool.free(i32([0]))
    assert pool.available() == 4
    pool.check()
    pool.check_invariants()


def test_invalid_ids_are_counted_never_used(make_pool, guard):
    pool = make_pool(8)
    with guard():
        pool.alloc(i32([2]))
        pool.free(i32([-5, 8, 1000, -1, 1]))
        pool.incref(i32([2**31 - 1]))
    assert pool.available() == 7
    assert pool.stats()["errors.invalid_page"] == 4
    pool.check_invariants()
    with pytest.raises(tpool.InvalidPage):
        pool.check()


def test_incref_of_free_page_is_use_after_free(make_pool, guard):
    pool = make_pool(4)
    with guard():
        pool.incref(i32([3, 3]))
        pool.touch(i32([2]))
    assert pool.stats()["errors.use_after_free"] == 3
    assert pool.state.refcount.tolist() == [0, 0, 0, 0]
    with pytest.raises(tpool.UseAfterFree):
        pool.check()


def test_check_names_every_kind(make_pool, guard):
    pool = make_pool(4)
    with guard():
        pool.free(i32([9, 0]))
    with pytest.raises(tpool.InvalidPage) as e:  # first kind in slot order
        pool.check()
    assert e.value.counts == {"invalid_page": 1, "double_free": 1}
    assert "double_free: 1" in str(e.value)


def test_errors_counted_past_a_counter_that_wrapped_are_raised(make_pool):
    """A counter edited to INT64_MAX wraps at the next error; check() took the count below its baseline as
    "went down" (a hand edit, no error) and the double free went unreported. A count edited down is still
    no error."""
    pool = make_pool(4)
    top = 2**63 - 1
    pool.state.counters[L.ERR_DOUBLE_FREE] = top
    with pytest.raises(tpool.DoubleFree):   # the edit itself reads as errors counted
        pool.check()
    pool.free(i32([0]))                     # a real double free: the counter wraps to INT64_MIN
    assert pool.state.counters[L.ERR_DOUBLE_FREE].item() == -2**63
    with pytest.raises(tpool.DoubleFree) as e:
        pool.check()
    assert e.value.counts == {"double_free": 1}
    pool.state.counters[L.ERR_DOUBLE_FREE] -= 5   # down: no error
    pool.check()
    pool.free(i32([1]))
    with pytest.raises(tpool.DoubleFree) as e:
        pool.check()
    assert e.value.counts == {"double_free": 1}


def test_a_free_when_the_free_count_says_every_page_is_free_is_counted_not_pushed_past_the_stack(make_pool):
    """A mutation test (helper-127): the push bound of the free path (pos < P) could be off by one with no test
    failing: a free with the free count edited to P wrote free_stack[P], one int32 past the stack."""
    pool = make_pool(4)
    x = pool.alloc(i32([1])).pages[:1].clone()
    pool.state.counters[L.FREE_COUNT] = 4      # hand edit: the stack full while a page is USED
    pool.free(x)
    assert pool.state.counters[L.FREE_COUNT].item() == 4 and pool.stats()["errors.corrupt_state"] == 1


def test_evict_into_an_out_longer_than_k_is_refused(make_pool):
    """evict(1, out=<3 entries>) evicting 3 pages would drop cached prefixes the caller did not ask to drop."""
    pool = make_pool(8)
    pool.free(pool.alloc(i32([3])).pages[:3].clone(), cache=True)
    with pytest.raises(ValueError, match=r"out: expected 1 entry \(k\), got 3"):
        pool.evict(1, out=torch.empty(3, dtype=torch.int32))
    assert pool.stats()["pages.cached.current"] == 3


def test_an_error_counts_zero_entries_in_the_plural(make_pool):
    """A mutation test (helper-196): ``entries(n)`` said "1 entry" for 1 and "entries" otherwise, but no
    test had n = 0, so "0 entry" (``n <= 1``) passed; an ``evict(0)`` into a one-entry out names it."""
    pool = make_pool(4)
    with pytest.raises(ValueError, match=r"out: expected 0 entries \(k\), got 1"):
        pool.evict(0, out=torch.empty(1, dtype=torch.int32))


def test_stats_follow_a_sequence(make_pool, guard):
    pool = make_pool(10)
    with guard():
        pool.alloc(i32([3, 4]))
        pool.free(i32([0, 1, 2]))
        pool.alloc(i32([2]))
    s = pool.stats()
    assert (s["pages.allocated"], s["pages.freed"], s["pages.used.current"], s["pages.used.peak"]) == (9, 3, 6, 7)
    assert s["pages.free.current"] == 4 and s["clock"] == 3


@pytest.mark.parametrize("num_pages", [1, 3, 17, 64])
def test_random_ops_match_model(make_pool, guard, num_pages, seed):
    g = torch.Generator().manual_seed(seed + num_pages)
    pool, model = make_pool(num_pages, max_alloc_pages=num_pages), PoolModel(num_pages)
    live = []
    for step in range(40):
        op = int(torch.randint(0, 4, (1,), generator=g))
        if op == 0:
            counts = torch.randint(-1 if step % 7 == 0 else 0, 4, (int(torch.randint(0, 5, (1,), generator=g)),),
                                   generator=g, dtype=torch.int32)
            with guard():
                r = pool.alloc(counts)
            exp = model.alloc(counts.tolist(), num_pages)
            assert (r.pages.tolist(), r.indptr.tolist(), r.ok.tolist()) == exp[:3]
            live += [p for p in r.pages.tolist() if p >= 0]
        else:
            ids = torch.tensor(live[:4] + [num_pages, -1, 0], dtype=torch.int32)
            ids = ids[torch.randperm(len(ids), generator=g)]
            with guard():
                (pool.free if op == 1 else pool.incref if op == 2 else pool.touch)(ids)
            (model.free if op == 1 else model.incref if op == 2 else model.touch)(ids.tolist())
            live = live[2:] if op == 1 else live
        model.assert_matches(pool)
        pool.check_invariants()


# ------------------------------------------------------------- input checks
@pytest.mark.parametrize("bad, match", [
    (torch.zeros(2, dtype=torch.int64), r"expected dtype torch.int32, got torch.int64; pass \.to\(torch.int32\)"),
    (torch.zeros(2, dtype=torch.float32), "expected dtype torch.int32, got torch.float32$"),  # (no .to hint)
    (torch.zeros(2, 2, dtype=torch.int32), r"expected a 1-D tensor, got shape \(2, 2\)"),
    (torch.zeros(4, dtype=torch.int32)[::2], "expected a contiguous tensor"),
    (torch.zeros(2, dtype=torch.int32, device="meta"), "expected device cpu, got meta"),
    ([1, 2], "expected a torch.Tensor, got list"),
])
def test_bad_inputs_raise_before_launch(make_pool, bad, match):
    pool = make_pool(4)
    before = pool.state.counters.clone()
    for call in (pool.alloc, pool.free, pool.incref, pool.touch):
        with pytest.raises(ValueError, match=match):
            call(bad)
    assert torch.equal(pool.state.counters, before)  # nothing launched


def test_max_batch_costs_what_the_docstring_states():
    """PagePool(max_batch=2**30) is accepted and its default alloc_out() takes 5 GiB: the docstring and the
    README state the cost a lane (5 B there, 4 B of every PageTable's state, nothing in the pool itself)."""
    def nbytes(tensors):
        return sum(t.untyped_storage().nbytes() for t in tensors)
    sizes = {}
    for mb in (100, 1000):
        pool = tpool.PagePool(8, page_size=4, device="cpu", backend="reference", max_batch=mb)
        table = tpool.PageTable(pool, 3, 5)
        sizes[mb] = (pool.memory_bytes()["state_bytes"], nbytes(pool.alloc_out().result),
                     nbytes(table.state.tensors().values()))
    assert sizes[1000][0] == sizes[100][0]                                   # the pool: nothing a lane
    assert sizes[1000][1] == 5 * 1000 + 4 + 2 * 8 * 4                        # indptr, ok; pages, evicted
    assert sizes[1000][2] - sizes[100][2] == 4 * 900                         # a table: 4 B a lane
    for doc in (tpool.PagePool.__doc__, tpool.PagePool.alloc_out.__doc__):
        assert "5 bytes a lane" in " ".join(doc.split())


def test_capacity_checks(make_pool):
    # The error names where the bound comes from: "at most 1 entries" alone did not say which argument to change.
    pool = make_pool(4, max_batch=2)
    with pytest.raises(ValueError, match=r"counts: expected at most 2 entries \(one per request; the pool's "
                                         r"max_batch, PagePool\(\.\.\., max_batch=N\)\), got 3"):
        pool.alloc(i32([1, 1, 1]))
    out = pool.alloc_out(max_batch=1, max_pages=2)
    for call in (lambda: pool.alloc(i32([1, 1]), out=out), lambda: pool.bind_alloc(i32([1, 1]), out=out)):
        with pytest.raises(ValueError, match=r"counts: expected at most 1 entry \(one per request; out's "
                                             r"max_batch, pool.alloc_out\(max_batch=N\)\), got 2"):
            call()
    with pytest.raises(ValueError, match="expected an AllocOut"):
        pool.alloc(i32([1]), out=(torch.zeros(1),))


def test_constructor_checks():
    with pytest.raises(ValueError, match="num_pages: expected a positive int, got 0"):
        tpool.PagePool(0, device="cpu")
    with pytest.raises(ValueError, match="backend: expected 'auto' or one of"):
        tpool.PagePool(4, device="cpu", backend="cuda-magic")
    with pytest.raises(ValueError, match="device: expected a cpu or cuda device, got meta"):
        tpool.PagePool(4, device="meta", backend="numba")
    with pytest.raises(ValueError, match="max_alloc_pages: expected a positive int, got -3"):
        tpool.PagePool(4, device="cpu", max_alloc_pages=-3)
    with pytest.raises(ValueError, match="max_pages: expected a positive int, got 0"):
        tpool.PagePool(4, device="cpu").alloc_out(max_batch=2, max_pages=0)
    # A Triton kernel's chunk offsets are int32: counts stop short of INT32_MAX by room for a chunk.
    for kw in (dict(num_pages=MAX_INDEXED + 1), dict(num_pages=4, max_batch=MAX_INDEXED + 1)):
        with pytest.raises(ValueError, match=f"expected at most {MAX_INDEXED}, got {MAX_INDEXED + 1}"):
            tpool.PagePool(device="cpu", backend="reference", **kw)
    pool = tpool.PagePool(4, device="cpu", backend="reference", max_batch=2**20)
    with pytest.raises(ValueError, match="max_requests \\* max_pages_per_request: expected at most"):
        tpool.PageTable(pool, 2**16, 2**15)
    table = tpool.PageTable(pool, 2, 2**12)  # max_batch * max_pages 2**32: capped where kernels index
    assert table.most_tokens == MAX_INDEXED
    with pytest.raises(ValueError, match=f"capacity: expected at most {MAX_INDEXED}"):
        table.flashinfer_csr(torch.zeros(1, dtype=torch.int32), capacity=MAX_INDEXED + 1)


def test_alloc_out_belongs_to_its_pool(make_pool):
    a, b = make_pool(8), make_pool(8)
    out = a.alloc_out(max_batch=1, max_pages=2)
    with pytest.raises(ValueError, match=r"expected an AllocOut from this pool's alloc_out\(\), got one from another"):
        b.alloc(i32([2]), out=out)
    with pytest.raises(ValueError, match="got tuple"):
        b.alloc(i32([2]), out=(1, 2))
    assert a.alloc(i32([2]), out=out).pages.tolist() == [0, 1]


def test_auto_backend_and_env_override(monkeypatch):
    monkeypatch.delenv("TPOOL_BACKEND", raising=False)
    assert tpool.PagePool(4, device="cpu").backend == "numba"
    monkeypatch.setenv("TPOOL_BACKEND", "reference")
    assert tpool.PagePool(4, device="cpu").backend == "reference"


def test_state_tensors_never_rebound(make_pool, guard):
    pool = make_pool(8)
    ptrs = {k: v.data_ptr() for k, v in pool.state.tensors().items()}
    with guard():
        pool.alloc(i32([3]))
        pool.free(i32([0, 1]), cache=True)
        pool.evict(1)
        pool.alloc(i32([6]), evict=True)
    assert {k: v.data_ptr() for k, v in pool.state.tensors().items()} == ptrs


def test_bound_alloc_and_free_match_the_plain_calls(make_pool, guard):
    """bind_alloc / bind_free: inputs checked once, filled in place between calls, same results."""
    pool, ref = make_pool(16), make_pool(16)
    out, ref_out = pool.alloc_out(max_batch=2, max_pages=4), ref.alloc_out(max_batch=2, max_pages=4)
    counts = i32([1, 2])
    alloc, free = pool.bind_alloc(counts, out=out), pool.bind_free(out.pages)
    for n in ([1, 2], [3, 0], [0, 0], [2, 2], [3, 1]):
        counts.copy_(i32(n))
        with guard():
            got = alloc()
        want = ref.alloc(i32(n), out=ref_out)
        assert got is out.result and [t.tolist() for t in got] == [t.tolist() for t in want]
        with guard():
            assert free() is None
        ref.free(ref_out.pages)
        assert pool.available() == ref.available()
    counts.resize_(3)
    with pytest.raises(tpool.StaleBinding):
        alloc()
    with pytest.raises(ValueError, match="counts: shares memory"):
        pool.bind_alloc(out.indptr[:2], out=out)
    with pytest.raises(ValueError, match="pages: shares memory"):
        pool.bind_free(pool.state.free_stack[:2])
    pool.check()
    pool.check_invariants()


def test_call_lock_makes_a_cuda_pools_device_current_and_restores_it(monkeypatch):
    """Triton launches on the current device: a call on a pool on cuda:1 runs with cuda:1 current."""
    from tpool.state import CallLock
    current, calls = [0], []

    def set_device(i):
        calls.append(i)
        current[0] = i
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    lock = CallLock(torch.device("cuda", 1))
    with lock:
        assert current[0] == 1
        with lock:                       # reentrant (a step around its extend): already current
            assert current[0] == 1
        assert current[0] == 1
    assert current[0] == 0 and calls == [1, 0]
    with pytest.raises(KeyError):
        with lock:
            raise KeyError("a call that raises")
    assert current[0] == 0 and calls == [1, 0, 1, 0]
    with CallLock(torch.device("cpu")):  # a CPU pool touches no device
        pass
    assert calls == [1, 0, 1, 0]


def test_call_lock_is_released_when_the_device_switch_fails(monkeypatch):
    import threading
    from tpool.state import CallLock

    def broken(i):
        raise RuntimeError("a sticky CUDA error")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", broken)
    lock = CallLock(torch.device("cuda", 1))
    with pytest.raises(RuntimeError, match="sticky"):
        with lock:
            pass
    got = []
    t = threading.Thread(target=lambda: got.append(lock._lock.acquire(timeout=2)))
    t.start()
    t.join()
    assert got == [True]                 # another thread can take it


class _Watched:
    """A pool's lock standing in for its own: notes when a thread other than the test's asks for it."""

    def __init__(self, lock):
        self.lock, self.owner, self.asked = lock, threading.get_ident(), threading.Event()

    def __enter__(self):
        if threading.get_ident() != self.owner:
            self.asked.set()
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)


def _midway(pool, tensor, method, then):
    """Run ``then()`` on another thread the first time ``tensor.method`` is called (from inside the call
    under test), and go on once that thread asks for the pool's lock or is done, whichever comes first."""
    watched = _Watched(pool.state.lock)
    object.__setattr__(pool.state, "lock", watched)  # (the state is a frozen dataclass)
    real = getattr(tensor, method)

    def other():
        try:
            then()
        finally:
            watched.asked.set()
    thread = threading.Thread(target=other)

    def midway(*args, **kwargs):
        if not thread.is_alive() and thread.ident is None:
            thread.start()
            assert watched.asked.wait(timeout=60)
        return real(*args, **kwargs)
    setattr(tensor, method, midway)
    return thread


def test_two_threads_checking_raise_each_error_once(backend):
    """check() read the counters, then noted them as checked, outside the pool's lock: two threads
    checking at once both read the counters before either noted them, and both raised the same
    double free. The read and the note are now one step under the lock."""
    pool = tpool.PagePool(8, device="cpu", backend=backend)
    pool.free(i32([5]))                              # one double free counted
    raised = []

    def check():
        try:
            pool.check()
        except tpool.PoolError as e:
            raised.append(e.counts)
    thread = _midway(pool, pool.state.checked, "copy_", check)  # the other check, before this one notes
    try:
        check()
    finally:
        thread.join()
    assert raised == [{"double_free": 1}]
    pool.check()


@pytest.mark.parametrize("call", ["stats", "stats_async", "check_invariants"])
def test_stats_are_read_under_the_pool_lock(backend, call):
    """stats(), stats_async() and check_invariants() read the counters without the pool's lock: on the
    reference backend a snapshot taken during another thread's alloc broke ``allocated + revived -
    freed == used``. They read under the lock now, which the reference and triton backends hold
    around every call: another thread cannot take it while the read is under way."""
    pool = tpool.PagePool(64, device="cpu", backend=backend)
    pool.alloc(i32([8]))
    lock, taken = pool.state.lock._lock, []

    def probe():  # could a call run now, halfway through the read?
        taken.append(lock.acquire(blocking=False))
        if taken[-1]:
            lock.release()
    # (each reads the counters through tpool.state.copy_between_calls, which takes their address)
    thread = _midway(pool, pool.state.counters, "data_ptr", probe)
    try:
        s = getattr(pool, call)()
    finally:
        thread.join()
    assert taken == [False]
    if call != "check_invariants":
        s = s.get() if call == "stats_async" else s
        assert s["pages.allocated"] == s["pages.used.current"] == 8 and s["pages.free.current"] == 56


@pytest.mark.parametrize("device", ["cpu:0", torch.device("cpu", 0)])
def test_a_cpu_device_with_an_index_is_the_cpu(backend, device):
    """``device="cpu:0"`` made a pool on ``cpu:0`` that refused every input (CPU tensors are on ``cpu``)."""
    pool = tpool.PagePool(8, 2, device=device, backend=backend)
    assert pool.device == torch.device("cpu")
    assert pool.alloc(i32([2])).pages[:2].tolist() == [0, 1]
    table = tpool.PageTable(pool, 2, 2)
    assert table.step(i32([0]), i32([3]), max_tokens=3).kv_lens.tolist() == [3]


def test_tpool_backend_auto_is_no_override(monkeypatch):
    """``TPOOL_BACKEND=auto`` raised "expected 'auto' or one of (...), got 'auto'"."""
    for value in ("auto", ""):
        monkeypatch.setenv("TPOOL_BACKEND", value)
        assert tpool.PagePool(4, device="cpu").backend == "numba"
    monkeypatch.setenv("TPOOL_BACKEND", "reference")
    assert tpool.PagePool(4, device="cpu").backend == "reference"
    assert tpool.PagePool(4, device="cpu", backend="numba").backend == "numba"   # only auto is overridden
    monkeypatch.setenv("TPOOL_BACKEND", "cuda")
    with pytest.raises(ValueError, match=r"backend: expected 'auto' or one of .*, got 'cuda' \(from TPOOL_BACKEND\)"):
        tpool.PagePool(4, device="cpu")
    # a backend the environment names and the device cannot run says where it came from too
    monkeypatch.setenv("TPOOL_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"backend 'triton' \(from TPOOL_BACKEND\) on a CPU pool needs "
                                         "TRITON_INTERPRET=1"):
        tpool.PagePool(4, device="cpu")


@pytest.mark.parametrize("value, interprets", [("1", True), ("true", True), ("ON", True), ("yes", True),
                                               ("y", True), ("0", False), ("false", False), ("2", False),
                                               ("", False)])
def test_triton_interpret_is_read_as_triton_reads_it(monkeypatch, value, interprets):
    """TRITON_INTERPRET=true runs triton's interpreter, but tpool refused a CPU triton pool unless it was "1"."""
    from tpool.backends import resolve_backend
    from tpool.kernels import _triton_shim

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert _triton_shim.interpreting() is interprets
    if interprets and _triton_shim.available():
        assert resolve_backend("triton", torch.device("cpu")) == "triton"
    elif not interprets:
        with pytest.raises((ValueError, ImportError), match="TRITON_INTERPRET=1|needs triton"):
            resolve_backend("triton", torch.device("cpu"))


def test_alloc_out_is_bounded_by_the_pool_max_batch(backend):
    """``alloc_out(max_batch=)`` took any size (10**5, or 2**31 - 2: ~10 GB), so an alloc of more
    requests than the pool's ``max_batch`` went through with it; alloc without ``out=`` refuses them."""
    pool = tpool.PagePool(16, device="cpu", backend=backend, max_batch=8)
    for n in (9, 10**5, 2**31 - 2):
        with pytest.raises(ValueError, match="max_batch: expected at most the pool's max_batch = 8"):
            pool.alloc_out(max_batch=n)
    out = pool.alloc_out(max_batch=8)
    assert pool.alloc(torch.ones(8, dtype=torch.int32), out=out).ok.tolist() == [True] * 8
    assert pool.alloc_out().max_batch == 8
