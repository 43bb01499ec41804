"""What a :class:`~tpool.page_table.PageTable`'s calls return, and the outputs a caller owns.

``ExtendResult``, ``ForkResult``, ``PagedKVCSR`` and ``StepResult`` are the named tuples
of tensors the table's calls return; ``StepOut`` is a set of step outputs the caller
makes (``table.step_out``) and owns, for ``table.step(..., out=)``. Their tensors are
buffers that the next call of the same shape (or the next step into the same StepOut)
writes again: treat them as read-only and clone a result to keep or edit it.
"""

from typing import TYPE_CHECKING, NamedTuple

import torch

from tpool import _checks
from tpool.state import SetOnce

if TYPE_CHECKING:  # StepOut takes its table as an argument; page_table imports this module
    from tpool.page_table import PageTable


class ExtendResult(NamedTuple):
    """slots : int32 ``[max_tokens]``: slot of every new token in lane order, -1 for padding,
    failures and unused capacity (vLLM's ``slot_mapping``). ok : bool ``[B]``."""

    slots: torch.Tensor
    ok: torch.Tensor


class ForkResult(NamedTuple):
    """ok : bool ``[B]``; cow_src, cow_dst : int32 ``[B]``: for a fork that ends inside a
    page, copy the KV of page ``cow_src[i]`` into the fresh page ``cow_dst[i]`` (-1 otherwise)."""

    ok: torch.Tensor
    cow_src: torch.Tensor
    cow_dst: torch.Tensor


class PagedKVCSR(NamedTuple):
    """FlashInfer's paged-KV layout for a batch: ``indptr`` int32 ``[B+1]``, ``indices`` int32
    ``[capacity]`` (pages in request order, -1 past ``indptr[B]``), ``last_page_len`` int32 ``[B]``."""

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor


class StepResult(NamedTuple):
    """One scheduler step (:meth:`PageTable.step`), everything attention needs, all written
    by the step's one pass, on the table's device:

    slots : int32 ``[max_tokens]``
        Slot of every new token in lane order, -1 for padding, failed lanes and unused
        capacity (vLLM's ``slot_mapping``), as in :class:`ExtendResult`.
    ok : bool ``[B]``
        Lane granted.
    csr : PagedKVCSR
        The batch's pages after the extend (FlashInfer's ``paged_kv_indptr``,
        ``paged_kv_indices``, ``paged_kv_last_page_len``): each lane's ``kv_lens`` tokens.
    positions : int32 ``[max_tokens]``
        Position in its sequence of each slot's token; -1 wherever ``slots`` is -1.
    qo_indptr : int32 ``[B+1]``
        Lane ``i``'s new tokens are ``slots[qo_indptr[i]:qo_indptr[i+1]]`` (FlashInfer's
        ``qo_indptr``, vLLM's ``query_start_loc``): a running sum of ``max(num_tokens, 0)``
        over every lane (failed and padding lanes included), capped at ``max_tokens``.
    kv_lens : int32 ``[B]``
        Each lane's length after the step; a failed lane keeps its length; padding, a bad
        or repeated request id and a corrupt row (a length outside the row, or a page id
        outside the pool among its pages: its CSR run is empty too) give 0.
    """

    slots: torch.Tensor
    ok: torch.Tensor
    csr: PagedKVCSR
    positions: torch.Tensor
    qo_indptr: torch.Tensor
    kv_lens: torch.Tensor

    @property
    def metadata(self) -> tuple:
        """``(positions, qo_indptr, kv_lens)``."""
        return self.positions, self.qo_indptr, self.kv_lens


class StepOut(SetOnce):
    """Caller-owned outputs for :meth:`PageTable.step` (``out=``), made by :meth:`PageTable.step_out`.

    A scheduler that prepares step N+1 while the forward pass still reads step N's
    outputs (overlap scheduling) makes two and alternates; each is a :class:`StepResult`
    in ``result`` with its own CSR memo and its own bound backend call. The table never
    drops them (they live as long as the caller holds them), so they also bound the
    caller's memory themselves.
    """

    def __init__(self, table: "PageTable", batch: int, max_tokens: int, capacity: int):
        self.table, self.batch, self.max_tokens, self.capacity = table, batch, max_tokens, capacity
        slots, ok, *meta = table._step_out(batch, max_tokens)
        csr, self.memo = table._csr_out(batch, capacity)
        self.result = StepResult(slots, ok, csr, *meta)
        table._shapes.add_memo(self.memo)  # invalidate_csr reaches it
        self._written = table._written | _checks.written_storages([slots, ok, *csr, *meta, self.memo.tensor])
        self._run = table.ops.step_into(self.result, self.memo)

    def __repr__(self):
        return f"StepOut(batch={self.batch}, max_tokens={self.max_tokens}, capacity={self.capacity})"
