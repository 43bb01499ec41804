"""A BoundStep's call (``functools.partial`` over ``page_table._bound_step``): it takes no
arguments of its own, and a stale binding raises before the step touches the table."""

import numpy as np
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
    run = table.bind_step(batch=2)
    run.req_ids[:] = [0, 1]
    run.num_tokens[:] = 1
    with pytest.raises(ValueError):
        run.req_ids.resize(1 << 20)                     # numpy refuses: the step's tensors use the memory
    ids = run.req_ids
    del run.req_ids, run.num_tokens, ids, table       # the step holds its memory and its table
    assert run().ok.tolist() == [True, True]
    assert run().kv_lens.tolist() == [2, 2]
    run.table.pool.check()


def test_bind_step_takes_the_tensors_or_a_batch():
    table = tpool.PageTable(tpool.PagePool(16, 4, device="cpu", backend="reference", max_batch=8), 2, 4)
    for args, kw in (((), {}), ((i32([0]),), {}), ((i32([0]), i32([1])), {"batch": 1}), ((), {"batch": -1}),
                     ((), {"batch": True}), ((), {"batch": 9})):
        with pytest.raises(ValueError):
            table.bind_step(*args, **kw)
