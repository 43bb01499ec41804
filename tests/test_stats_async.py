"""AsyncRead (and ``PagePool.stats_async``, ``HostMirror.snapshot`` on it): what it refuses before any copy."""

import pytest
import torch

from tpool.stats_async import AsyncRead


def test_a_bare_tensor_is_refused_not_read_as_a_sequence_of_its_entries():
    """``AsyncRead(t)`` iterated the tensor: its entries became 0-d tensors, each copied on its own, and
    ``values()`` answered ``[0, 1, 2]`` where ``AsyncRead([t])`` answers ``[[0, 1, 2]]``."""
    with pytest.raises(ValueError, match=r"tensors: expected a sequence of tensors, got a Tensor; pass \[t\]"):
        AsyncRead(torch.arange(3))
    assert AsyncRead([torch.arange(3)]).values() == [[0, 1, 2]]

