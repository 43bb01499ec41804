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
