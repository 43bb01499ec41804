"""The hand-worked examples in the public docstrings run and give the numbers they show."""

import doctest

import pytest
import torch

import tpool
from tpool import page_table, pool


@pytest.mark.parametrize("module", [pool, page_table])
def test_docstring_examples(module):
    globs = {"torch": torch, "PagePool": tpool.PagePool, "PageTable": tpool.PageTable}
    result = doctest.testmod(module, extraglobs=globs, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 5 and result.failed == 0
