"""A BoundStep's call (``functools.partial`` over ``page_table._bound_step``): it takes no
arguments of its own, and a stale binding raises before the step touches the table."""

import pytest
import torch

import tpool
from conftest import i32


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
    assert run.req_ids.tolist() == [-1, -1, -1] and run.num_tokens.tolist() == [0, 0, 0]
    assert run.req_ids.dtype == run.num_tokens.dtype == torch.int32
    for ids, ntok in (([0, 1, 2], [5, 1, 2]), ([0, 1, 2], [1, 1, 1]), ([2, -1, 0], [4, 0, 1]), ([0, 1, 2], [1] * 3)):
        run.req_ids.copy_(i32(ids))
        run.num_tokens.copy_(i32(ntok))
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
    run = table.bind_step(batch=2)
    run.req_ids.copy_(i32([0, 1]))
    run.num_tokens.fill_(1)
    with pytest.raises(RuntimeError, match="not resizable"):
        run.req_ids.resize_(1 << 20)                    # torch refuses: the memory cannot move
    ids = run.req_ids
    ids.set_(i32([3, 3]).untyped_storage())           # re-pointed: the step still reads its own memory
    del ids
    assert run().ok.tolist() == [True, True]
    assert table.seq_lens.tolist() == [1, 1, 0, 0]
    table.pool.check()


def test_bind_step_takes_the_tensors_or_a_batch():
    table = tpool.PageTable(tpool.PagePool(16, 4, device="cpu", backend="reference"), 2, 4)
    for args, kw in (((), {}), ((i32([0]),), {}), ((i32([0]), i32([1])), {"batch": 1}), ((), {"batch": -1}),
                     ((), {"batch": True})):
        with pytest.raises(ValueError):
            table.bind_step(*args, **kw)
