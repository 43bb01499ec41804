"""The hand-worked examples in the public docstrings run and give the numbers they show."""

import doctest

import pytest
import torch

import tpool
from tpool import free_group, graphs, page_table, pool, stats_async, testing
from tpool.memory import accounting, arena, owned_cache, ownership, planner, values

# module -> fewest examples it must hold, so a dropped example is noticed
MODULES = [(pool, 5), (page_table, 5), (accounting, 10), (values, 2), (ownership, 14), (owned_cache, 4), (arena, 9),
           (planner, 3), (graphs, 5), (testing, 7), (free_group, 4), (stats_async, 2)]


@pytest.mark.parametrize("module, min_examples", MODULES, ids=[m.__name__ for m, _ in MODULES])
def test_docstring_examples(module, min_examples):
    globs = {"torch": torch, "PagePool": tpool.PagePool, "PageTable": tpool.PageTable}
    result = doctest.testmod(module, extraglobs=globs, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= min_examples and result.failed == 0
