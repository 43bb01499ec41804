"""A BoundStep's call (``functools.partial`` over ``bound_step._bound_step``): it takes no
arguments of its own, and a stale binding raises before the step touches the table."""

import ctypes
import gc

import numpy as np
import pytest
import torch

import tpool
from conftest import i32, same_table_state


@pytest.fixture
def table(backend):
    return tpool.PageTable(tpool.PagePool(64, 4, device="cpu", backend=backend), 4, 8)


def test_bound_step_takes_no_arguments_of_its_own(table, guard):
    ids, ntok = i32([0, 1]), i32([3, 5])
    run = table.bind_step(ids, ntok, max_tokens=8)
    for extra in ((ids.data_ptr,), (1,), (ids, ntok)):  # never taken as the bound values
        with pytest.raises(TypeError):
            run(*extra)
    assert table.seq_lens.tolist()[:2] == [0, 0]  # nothing ran
    with guard():
        res = run()
    assert res is run.result and res.ok.tolist() == [True, True]
    assert table.seq_lens.tolist()[:2] == [3, 5]


def test_stale_bound_step_leaves_the_table_as_it_was(table):
    ids, ntok = i32([0, 1]), i32([3, 5])
    run = table.bind_step(ids, ntok, max_tokens=8)
    run()
    before = [t.clone() for t in (table.seq_lens, table.block_table)]
    ntok.set_(i32([1, 1]).untyped_storage())   # new memory: the binding is stale
    with pytest.raises(tpool.StaleBinding):
        run()
    assert all(torch.equal(a, b) for a, b in zip(before, (table.seq_lens, table.block_table)))


def test_a_step_bound_to_inputs_the_table_makes_matches_plain_steps(backend, guard):
    """``bind_step(batch=B)``: the table makes the inputs; run() checks nothing and steps as table.step does."""
    tables = [tpool.PageTable(tpool.PagePool(64, 4, device="cpu", backend=backend), 4, 8) for _ in range(2)]
    run = tables[0].bind_step(batch=3, max_tokens=8)
    assert isinstance(run.req_ids, np.ndarray) and run.req_ids.dtype == run.num_tokens.dtype == np.int32
    assert run.req_ids.tolist() == [-1, -1, -1] and run.num_tokens.tolist() == [0, 0, 0]
    for ids, ntok in (([0, 1, 2], [5, 1, 2]), ([0, 1, 2], [1, 1, 1]), ([2, -1, 0], [4, 0, 1]), ([0, 1, 2], [1] * 3)):
        run.req_ids[:] = ids
        run.num_tokens[:] = ntok
        with guard():
            got = run()
            want = tables[1].step(i32(ids), i32(ntok), max_tokens=8)
        assert got is run.result
        for a, b in zip((got.slots, got.ok, *got.csr, got.positions, got.qo_indptr, got.kv_lens),
                        (want.slots, want.ok, *want.csr, want.positions, want.qo_indptr, want.kv_lens)):
            assert a.tolist() == b.tolist()
    assert tables[0].seq_lens.tolist() == tables[1].seq_lens.tolist() == [8, 3, 8, 0]
    tables[0].check_invariants()
    tables[0].pool.check()


def test_the_inputs_the_table_makes_keep_their_memory_whatever_is_done_to_them(backend):
    table = tpool.PageTable(tpool.PagePool(64, 4, device="cpu", backend=backend), 4, 8)
    run = table.bind_step(batch=2, release=2)
    run.req_ids[:] = [0, 1]
    run.num_tokens[:] = 1
    for made in (run.req_ids, run.num_tokens, run.release):
        for refcheck in (True, False):  # refcheck=False would free memory the step still writes
            with pytest.raises(ValueError, match="does not own its data"):
                made.resize(1 << 20, refcheck=refcheck)  # numpy refuses: an array over what the binding keeps
        # nor what its .base views, a ctypes array over the table's memory, which owns none of it (an owner of
        # numpy's own, reachable as .base, was reallocated with refcheck=False until session 25)
        with pytest.raises(ValueError, match="doesn't own it"):
            ctypes.resize(made.base.obj, 1 << 20)
    ids = run.req_ids
    del run.req_ids, run.num_tokens, ids, table       # the step holds its memory and its table
    assert run().ok.tolist() == [True, True]
    assert run().kv_lens.tolist() == [2, 2]
    run.table.pool.check()


def test_no_array_reachable_from_the_inputs_the_table_makes_owns_their_memory(backend):
    """numpy < 2 lets ``data`` be assigned (deprecated; numpy 2 refuses): on an array that owns its memory, numpy
    frees that memory at once, whoever points into it. The owners the table made were reachable as ``.base``, so
    ``run.release.base.data = ...`` left the step writing its release ids' -1s into freed memory. Now no numpy
    array reachable from the inputs owns their memory (it is a table-made tensor's, whose storage the step holds);
    with numpy < 2 the assignment itself is tried too."""
    table = tpool.PageTable(tpool.PagePool(64, 4, device="cpu", backend=backend), 4, 8)
    run = table.bind_step(batch=2, release=2)
    for made in (run.req_ids, run.num_tokens, run.release):
        chain = [made]
        while isinstance(chain[-1].base, np.ndarray):
            chain.append(chain[-1].base)
        assert not any(a.flags.owndata for a in chain)
    run.req_ids[:], run.num_tokens[:], run.release[:] = [0, 1], 1, -1
    assert run().kv_lens.tolist() == [1, 1]
    if np.lib.NumpyVersion(np.__version__) < "2.0.0":
        with pytest.warns(DeprecationWarning):
            run.release.data = np.full(2, 5, np.int32).data  # re-points this view; frees nothing
        victims = [np.full(2, 7, np.int32) for _ in range(64)]
        run.req_ids[:] = [0, 1]
        assert run().kv_lens.tolist() == [2, 2]
        assert all(v.tolist() == [7, 7] for v in victims)  # the step wrote into no memory numpy handed out again
    run.table.pool.check()


def test_assigning_a_bound_input_raises_instead_of_being_ignored(backend):
    """``run.req_ids = new`` would leave the step reading the old memory: it raises, and names the fix."""
    table = tpool.PageTable(tpool.PagePool(64, 4, device="cpu", backend=backend), 4, 8)
    made = table.bind_step(batch=2, release=1)
    given = table.bind_step(i32([0, 1]), i32([1, 1]), max_tokens=4)
    for run, name, value in ((made, "req_ids", np.array([0, 1], np.int32)), (made, "num_tokens", np.ones(2, np.int32)),
                             (made, "release", np.array([0], np.int32)), (given, "req_ids", i32([2, 3]))):
        with pytest.raises(AttributeError, match=rf"fill it in place \(run.{name}\[:\] = ...\)"):
            setattr(run, name, value)
    made.req_ids[:], made.num_tokens[:] = [0, 1], 1
    assert made().kv_lens.tolist() == [1, 1]          # in place, as the message says


def test_two_bound_steps_into_two_step_outs_alternate_as_plain_steps(backend, guard):
    """Overlap scheduling, bound: two input sets, two StepOuts; each run writes its own outputs,
    leaves the other's alone, and gives what plain steps of the same batches give."""
    table = tpool.PageTable(tpool.PagePool(64, 4, device="cpu", backend=backend), 4, 8)
    ref = tpool.PageTable(tpool.PagePool(64, 4, device="cpu", backend="reference"), 4, 8)
    outs = [table.step_out(2, max_tokens=8) for _ in range(2)]
    ids = [i32([0, 1]), i32([2, -1])]
    ntok = [i32([3, 5]), i32([6, 0])]
    runs = [table.bind_step(ids[0], ntok[0], out=outs[0]), table.bind_step(batch=2, out=outs[1], release=1)]
    runs[1].req_ids[:], runs[1].num_tokens[:] = [2, -1], [6, 0]
    fields = lambda r: [t.tolist() for t in (r.slots, r.ok, *r.csr, r.positions, r.qo_indptr, r.kv_lens)]
    for k in range(8):
        i = k % 2
        if k == 5:  # request 0 finishes; request 3 joins in its lane of the other input set
            runs[1].release[0] = 0
            runs[1].req_ids[1], runs[1].num_tokens[1] = 3, 2
            ref.release(i32([0]))
        other = fields(outs[1 - i].result)
        with guard():
            got = runs[i]()
        lanes = (ids[0], ntok[0]) if i == 0 else tuple(map(torch.from_numpy, (runs[1].req_ids, runs[1].num_tokens)))
        want = ref.step(lanes[0].clone(), lanes[1].clone(), max_tokens=8)
        assert got is outs[i].result and fields(got) == fields(want)
        assert fields(outs[1 - i].result) == other          # the other StepOut is as the forward left it
        ntok[0].fill_(1)
        if k >= 1:
            runs[1].num_tokens[:] = [1, 1 if k >= 5 else 0]
    assert table.seq_lens.tolist() == ref.seq_lens.tolist()
    with pytest.raises(ValueError, match=r"max_tokens: expected 8 \(the StepOut's\), got 16"):
        table.bind_step(ids[0], ntok[0], max_tokens=16, out=outs[0])
    with pytest.raises(ValueError, match=r"batch: expected 2 \(the StepOut's\), got 3"):
        table.bind_step(batch=3, out=outs[0])
    other = tpool.PageTable(table.pool, 4, 8)
    with pytest.raises(ValueError, match="one from another table"):
        other.bind_step(batch=2, out=outs[0])


@pytest.mark.parametrize("drop", ["step_out", "shape"])
def test_a_bound_step_keeps_its_csr_memo_where_invalidate_csr_finds_it(backend, drop):
    """The table reaches CSR memos through a weak set: a bound step whose StepOut the caller
    dropped, or whose shape the table let go (max_shapes=1), must keep its memo in it, or an
    invalidate_csr after a hand edit misses it and a restored snapshot grows a stale CSR."""
    import gc
    from tpool.graphs import state_tensors
    fields = lambda r: [t.tolist() for t in (r.slots, r.ok, *r.csr, r.positions, r.qo_indptr, r.kv_lens)]
    table = tpool.PageTable(tpool.PagePool(64, 4, device="cpu", backend=backend), 4, 8, max_shapes=1)
    ref = tpool.PageTable(tpool.PagePool(64, 4, device="cpu", backend="reference"), 4, 8)
    ids, ntok = i32([0, 1]), i32([3, 5])
    run = table.bind_step(ids, ntok, **({"out": table.step_out(2, max_tokens=8)} if drop == "step_out" else {}))
    if drop == "shape":
        table.step(i32([2]), i32([1]))   # another shape: the bound one is dropped from the table's buffers
        ref.step(i32([2]), i32([1]))
    gc.collect()
    for _ in range(3):
        got, want = run(), ref.step(ids.clone(), ntok.clone(), max_tokens=8 if drop == "step_out" else None)
        ntok.fill_(1)
    for t in (table, ref):               # a prefix-cache hit written into row 0, then named to the table
        t.block_table[0, 0] = 40
        snap = [x.clone() for x in state_tensors(t)]
        t.invalidate_csr(i32([0]))
        for x, y in zip(state_tensors(t), snap, strict=True):
            x.copy_(y)                   # a snapshot from after the edit, before invalidate_csr
    got, want = run(), ref.step(ids.clone(), ntok.clone(), max_tokens=8 if drop == "step_out" else None)
    assert fields(got) == fields(want)


def test_bind_step_takes_the_tensors_or_a_batch():
    table = tpool.PageTable(tpool.PagePool(16, 4, device="cpu", backend="reference", max_batch=8), 2, 4)
    for args, kw in (((), {}), ((i32([0]),), {}), ((i32([0]), i32([1])), {"batch": 1}), ((), {"batch": -1}),
                     ((), {"batch": True}), ((), {"batch": 9})):
        with pytest.raises(ValueError):
            table.bind_step(*args, **kw)


def _outputs(res):
    return [t.tolist() for t in (res.slots, res.ok, *res.csr, res.positions, res.qo_indptr, res.kv_lens)]


@pytest.mark.parametrize("made", [True, False], ids=["batch", "tensors"])
@pytest.mark.parametrize("cache", [False, True])
def test_a_bound_step_with_release_equals_release_then_step(backend, guard, made, cache):
    """``bind_step(..., release=)``: each call is ``release(ids)`` then ``step(...)``, and leaves the
    release ids at -1. Repeated, out-of-range and padding-only ids, and a request released and
    admitted again in the same call, as the two calls do (errors counted alike)."""
    one, two = (tpool.PageTable(tpool.PagePool(64, 4, device="cpu", backend=backend), 6, 8) for _ in range(2))
    for t in (one, two):
        t.extend(i32([0, 1, 2, 3]), i32([5, 9, 2, 7]), max_tokens=23)
    if made:
        run = two.bind_step(batch=4, max_tokens=12, release=3, release_cache=cache)
        ids, ntok_t, rel = run.req_ids, run.num_tokens, run.release
        assert isinstance(rel, np.ndarray) and rel.dtype == np.int32 and rel.tolist() == [-1, -1, -1]
    else:
        ids, ntok_t, rel = i32([0] * 4), i32([0] * 4), i32([-1] * 3)
        run = two.bind_step(ids, ntok_t, max_tokens=12, release=rel, release_cache=cache)
    assert run.release is rel and "release=3" in repr(run)
    fill = (lambda a, v: a.__setitem__(slice(None), v)) if made else (lambda a, v: a.copy_(i32(v)))
    # (finished, batch, tokens): a new request takes a freed lane with a prompt, or the same id again
    for gone, batch, ntok in (([-1, -1, -1], [0, 1, 2, 3], [1, 1, 1, 1]), ([1, -1, -1], [0, 4, 2, 3], [1, 3, 1, 1]),
                              ([-1, 3, -1], [0, 4, 2, 5], [1, 1, 1, 2]), ([4, 4, -1], [0, 1, 2, 5], [1, 6, 1, 1]),
                              ([9, -7, 0], [0, 1, 2, 5], [2, 1, 1, 1]), ([5, 2, 1], [0, -1, 2, -1], [1, 0, 3, 0])):
        one.release(i32(gone), cache=cache)
        want = one.step(i32(batch), i32(ntok), max_tokens=12)
        fill(ids, batch), fill(ntok_in := ntok_t, ntok), fill(rel, gone)
        with guard():
            got = run()
        assert got is run.result and _outputs(got) == _outputs(want)
        assert rel.tolist() == [-1, -1, -1]                       # consumed
        same_table_state(one, two)
        decode = [1 if r >= 0 else 0 for r in batch]
        fill(ntok_in, decode)
        for _ in range(2):                                         # nothing written: plain steps
            one.release(i32([-1, -1, -1]), cache=cache)
            want = one.step(i32(batch), i32(decode), max_tokens=12)
            with guard():
                got = run()
            assert _outputs(got) == _outputs(want)
            same_table_state(one, two)
    same_table_state(one, two)
    two.check_invariants(exclusive=False)
    assert one.pool.stats() == two.pool.stats()


def test_a_bound_release_is_consumed_so_a_readmitted_request_keeps_its_pages(backend):
    """The id of a finished request, written once, releases it once: the next call does not release
    the new request admitted under the same id (which reusing the ids would do)."""
    table = tpool.PageTable(tpool.PagePool(32, 4, device="cpu", backend=backend), 2, 8)
    run = table.bind_step(batch=2, max_tokens=8, release=1)
    run.req_ids[:], run.num_tokens[:] = [0, 1], [6, 6]
    run()
    run.release[0] = 1
    run.num_tokens[:] = [1, 5]                         # request 1 ends; a 5-token prompt takes row 1
    assert run().kv_lens.tolist() == [7, 5]
    run.num_tokens[:] = 1
    assert run().kv_lens.tolist() == [8, 6]            # row 1 kept its pages
    assert table.seq_lens.tolist() == [8, 6] and table.pool.stats()["pages.used.current"] == 4
    table.check_invariants()


def test_a_release_made_under_inference_mode_is_consumed_outside_it(backend):
    """Inputs made under ``torch.inference_mode()`` (an engine's set-up often is), bound and run outside it:
    the reference and Triton backends reset the release ids with ``fill_``, which torch refuses on an
    inference tensor outside that mode, and raised after the release and the step had run, leaving the id
    unconsumed (the next call released the row again); numba wrote the memory. Now every backend consumes it."""
    table = tpool.PageTable(tpool.PagePool(32, 4, device="cpu", backend=backend), 2, 8)
    with torch.inference_mode():
        ids, ntok, gone = i32([0, 1]), i32([6, 6]), i32([-1])
    run = table.bind_step(ids, ntok, max_tokens=8, release=gone)
    run()
    with torch.inference_mode():
        gone[0], ntok[0], ntok[1] = 1, 1, 5            # request 1 ends; a 5-token prompt takes row 1
    assert run().kv_lens.tolist() == [7, 5] and gone.tolist() == [-1]
    with torch.inference_mode():
        ntok.fill_(1)
    assert run().kv_lens.tolist() == [8, 6]            # row 1 kept its pages: the id was released once
    assert table.seq_lens.tolist() == [8, 6] and table.pool.stats()["pages.used.current"] == 4
    table.check_invariants()


def test_a_stale_bound_release_leaves_the_table_as_it_was(backend):
    table = tpool.PageTable(tpool.PagePool(64, 4, device="cpu", backend=backend), 4, 8)
    ids, ntok, rel = i32([0, 1]), i32([3, 5]), i32([-1])
    run = table.bind_step(ids, ntok, max_tokens=8, release=rel)
    run()
    before = [t.clone() for t in (table.seq_lens, table.block_table)]
    rel.set_(i32([0]).untyped_storage())               # new memory: the binding is stale
    with pytest.raises(tpool.StaleBinding, match="release"):
        run()
    assert all(torch.equal(a, b) for a, b in zip(before, (table.seq_lens, table.block_table)))
    assert rel.tolist() == [0]                          # not consumed either


def test_bind_step_refuses_a_bad_release_before_any_change(backend):
    table = tpool.PageTable(tpool.PagePool(64, 4, device="cpu", backend=backend, max_batch=8), 4, 8)
    ids, ntok = i32([0, 1]), i32([1, 1])
    table.step(ids, ntok)
    before = [x.clone() for x in (table.block_table, table.seq_lens, table.pool.state.counters)]
    for kw, match in ((dict(batch=2, release=i32([1])), "release: with batch=B, expected the number K"),
                      (dict(batch=2, release=9), "release: expected at most max_batch=8"),
                      (dict(batch=2, release=-1), "release"),
                      (dict(batch=2, release=1, release_cache=1), "release_cache: expected a bool, got 1"),
                      (dict(req_ids=ids, num_tokens=ntok, release=2), "release: expected an int32 tensor"),
                      (dict(req_ids=ids, num_tokens=ntok, release=torch.tensor([1])), "release: expected .*int32"),
                      (dict(req_ids=ids, num_tokens=ntok, release=ids[1:]), "release: shares memory"),
                      (dict(req_ids=ids, num_tokens=ntok, release=ntok), "release: shares memory"),
                      (dict(req_ids=ids, num_tokens=ntok, release=table.seq_lens[:1]), "release: shares memory")):
        with pytest.raises(ValueError, match=match):
            table.bind_step(**kw)
    for x, y in zip((table.block_table, table.seq_lens, table.pool.state.counters), before):
        assert x.tolist() == y.tolist()


def _alias(t, lo, hi):
    """Another storage over ``t[lo:hi]``'s memory (a numpy view taken back into torch)."""
    return torch.from_numpy(t.numpy()[lo:hi])


def test_inputs_over_the_memory_of_written_buffers_are_refused_through_another_storage(backend):
    """An input on a storage of its own that lies over a buffer the call writes (table state, an
    output) is refused at binding as it is on the same storage: binding, and the second plain
    step on the same tensors (which binds them), check memory ranges, not storage identity."""
    table = tpool.PageTable(tpool.PagePool(64, 4, device="cpu", backend=backend), 4, 8)
    res = table.step(i32([0, 1, 2]), i32([5, 3, 2]), max_tokens=10)
    ids, ntok = i32([0, 1, 2]), i32([1, 1, 1])
    before = [x.clone() for x in (table.block_table, table.seq_lens, table.pool.state.counters)]
    for kw, match in ((dict(release=_alias(table.seq_lens, 1, 3)), "release: shares memory"),
                      (dict(release=_alias(res.csr.indptr, 1, 2)), "release: shares memory")):
        with pytest.raises(ValueError, match=match):
            table.bind_step(ids, ntok, max_tokens=10, **kw)
    for bad_ids in (_alias(res.csr.indptr, 1, 4), _alias(table.block_table.view(-1), 0, 3)):
        with pytest.raises(ValueError, match="req_ids: shares memory"):
            table.bind_step(bad_ids, ntok, max_tokens=10)
        with pytest.raises(ValueError, match="req_ids: shares memory"):
            for _ in range(2):                      # the second call binds the tensors
                table.step(bad_ids, ntok, max_tokens=10)
    for x, y in zip((table.block_table, table.seq_lens, table.pool.state.counters), before):
        assert x.tolist() == y.tolist()
    table.check_invariants()


def test_a_release_over_the_ids_is_refused_whatever_storages_the_inputs_nest_in(backend):
    """The caller's own inputs may overlap one another (views of one numpy array, each its own
    storage, one nested in another): a release over the ids is still refused."""
    table = tpool.PageTable(tpool.PagePool(16, 4, device="cpu", backend=backend, max_batch=8), 8, 4)
    big = np.zeros(64, dtype=np.int32)
    req_ids, num_tokens = torch.from_numpy(big)[10:14], torch.from_numpy(big[1:5])  # the second inside the first
    with pytest.raises(ValueError, match="release: shares memory"):
        table.bind_step(req_ids, num_tokens, release=torch.from_numpy(big[10:12]))


def test_written_ranges_find_an_overlap_through_any_storage():
    from tpool._checks import written_storages
    a, b = torch.zeros(16, dtype=torch.int32), torch.zeros(8, dtype=torch.int64)
    w = written_storages([a]) | written_storages([b, a])
    assert w.hit(a) and w.hit(b[2:]) and w.hit(_alias(a, 15, 16)) and w.hit(_alias(b, 0, 1))
    assert not w.hit(torch.zeros(4, dtype=torch.int32)) and not w.hit(a.clone())
    assert not w.hit(torch.zeros(0, dtype=torch.int32))
    big = np.zeros(64, dtype=np.int32)                 # ranges that overlap: one storage inside another
    w = written_storages([torch.from_numpy(big), torch.from_numpy(big[1:5])])
    assert w.hit(torch.from_numpy(big[40:42])) and w.hit(torch.from_numpy(big[2:3]))


def test_a_bound_step_with_no_release_lanes_is_a_step_with_an_empty_release(backend, guard):
    """``release=0``: each call is ``step(..., release=<empty>)`` (which, as ``release`` of an empty
    batch, still ticks the pool's clock)."""
    one, two = (tpool.PageTable(tpool.PagePool(32, 4, device="cpu", backend=backend), 2, 8) for _ in range(2))
    run = one.bind_step(batch=2, max_tokens=4, release=0)
    assert run.release.shape == (0,)
    for ntok in ([3, 4], [1, 1], [1, 1]):
        run.req_ids[:], run.num_tokens[:] = [0, 1], ntok
        with guard():
            got = run()
        want = two.step(i32([0, 1]), i32(ntok), max_tokens=4, release=i32([]))
        assert _outputs(got) == _outputs(want)
        same_table_state(one, two)


def test_a_bound_step_called_inside_capture_pins_its_shape(backend, monkeypatch):
    """A step inside CUDA graph capture pins its call shape (the graph writes those buffers at every replay);
    a BoundStep called there did not, so once the caller let go of it (keeping the graph), a table that
    dropped the shape (max_shapes) let go of buffers the graph still writes. Simulated on a CPU table that
    says it is on CUDA: an eager call pins nothing, a call inside capture pins, and only its own buffers."""
    table = tpool.PageTable(tpool.PagePool(64, 4, device="cpu", backend=backend), 4, 8, max_shapes=1)
    table._shapes._cuda = True
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    runs = [table.bind_step(i32([0, 1]), i32([1, 1])), table.bind_step(batch=2, max_tokens=4, release=1)]
    keys = [run._key for run in runs]
    assert keys[1] in table._shapes.entries and keys[0] not in table._shapes.entries  # (max_shapes=1)
    for run in runs:
        run()
    assert not table._shapes.pinned
    capturing[0] = True
    for run in runs:
        run()
    capturing[0] = False
    assert table._shapes.pinned == {keys[1]}   # keys[0]'s buffers are the first binding's own, not the table's
    table.step(i32([2]), i32([1]))             # another shape: the pinned one stays
    assert keys[1] in table._shapes.entries and table._shapes.entries[keys[1]][0] is runs[1].result
    assert table.seq_lens.tolist() == [2, 2, 1, 0]     # (the second binding's lanes are padding)


def test_bound_calls_refuse_copies(table):
    """``copy.copy`` of a BoundStep or BoundCall failed with "__new__() missing N required positional
    arguments"; they refuse copies as pools and tables do, saying why."""
    import copy
    import pickle
    pool = table.pool
    out = pool.alloc_out(2, 4)
    bound = {"BoundStep": [table.bind_step(batch=2), table.bind_step(i32([0]), i32([1])),
                           table.bind_step(batch=1, release=1)],
             "BoundCall": [pool.bind_free(out.pages), pool.bind_alloc(i32([1]), out=out)]}
    for name, runs in bound.items():
        for run in runs:
            for clone in (copy.copy, copy.deepcopy, pickle.dumps):
                with pytest.raises(TypeError, match=f"a {name} cannot be copied or pickled: its call is bound to "
                                                    "the addresses of its input"):
                    clone(run)


def test_an_input_the_table_made_keeps_its_memory_after_the_step_is_dropped(backend):
    """``run.req_ids`` (and the other inputs the table makes) kept past its step: the array holds the memory it
    is over, so filling it writes into no memory numpy has handed out again (it did: the step alone held the
    storages, and the array wrote into arrays made after the step was dropped)."""
    table = tpool.PageTable(tpool.PagePool(64, 4, device="cpu", backend=backend), 4, 8)
    run = table.bind_step(batch=4, release=4)
    kept = (run.req_ids, run.num_tokens, run.release)
    del run
    gc.collect()
    victims = [np.full(4, 7, np.int32) for _ in range(256)]
    for made in kept:
        made[:] = 3
    assert all(v.tolist() == [7] * 4 for v in victims)
    assert [made.tolist() for made in kept] == [[3] * 4] * 3
