"""View-to-owned compaction: copy a tensor into the bytes its values need.

Note:
    A tensor *owns* its storage when storage <= compact (the byte counts of
    :mod:`tpool.memory.accounting`) and torch allocated that storage (a whole
    tensor, its transpose, ``x.view(-1)``, an ``expand`` of a whole tensor)
    and is kept as is. Otherwise :func:`own` copies it into exactly
    ``compact`` bytes: the distinct part, contiguous, expanded back to the
    shape (an expanded row stays one row), or for an overlapping view the
    reachable range with its strides. A copy is never larger than the
    storage it replaces.

    A storage torch did not allocate (not resizable, see
    :mod:`tpool.memory.accounting`) has an unknown true size, so it is always
    copied. A pinned storage (``pin_memory()``) is torch's own and is judged
    by its size like any other (a copy would be pageable, and a later
    ``non_blocking`` copy to the GPU would then wait).

    Copies are new autograd leaves (``requires_grad`` kept, history dropped:
    it could keep saved activations alive, uncharged); a tensor kept as is
    but with a ``grad_fn`` is kept as ``t.detach()`` (same storage) for the
    same reason. Every tensor is first checked by
    :func:`~tpool.memory.accounting.check_ownable`.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from collections import UserDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from tpool._checks import check_size
from tpool.memory.accounting import (StorageKey, _distinct_elems, _is_dataclass, _span_elems, check_ownable,
                                     compact_bytes, storage_bytes, storage_key)

__all__ = ["needs_compaction", "own", "compact", "map_tensors", "plan_ownership", "OwnershipPlan"]


def needs_compaction(t: torch.Tensor) -> bool:
    """Whether :func:`own` copies ``t``: its storage exceeds :func:`compact_bytes`, or is not torch's.

    A storage torch did not allocate (not resizable, and not pinned) has an
    unknown true size, so it is always copied.

    Parameters
    ----------
    t : torch.Tensor
        any shape and dtype, any device; dense strided.

    Returns
    -------
    bool
        True when :func:`own` would copy ``t``: always for a storage that is
        not resizable (``torch.from_numpy``, ``torch.frombuffer``,
        ``from_dlpack``; see the module note).

    Raises
    ------
    TypeError
        ``t`` has no ordinary storage (see :func:`check_ownable`).
    ValueError
        ``t`` reaches past its storage (see :func:`check_ownable`).

    Example
    -------
    An item ``[100, 4096]`` of a split ``[1000, 4096]`` bf16 batch has storage
    8_192_000 and compact 819_200 bytes; the batch itself, its transpose and an
    ``expand`` of a whole tensor own their storage. A whole numpy array seen
    through ``torch.from_numpy`` is copied: torch cannot see the array's size.

    >>> batch = torch.zeros(1000, 4096, dtype=torch.bfloat16)
    >>> needs_compaction(batch.split(100)[3])
    True
    >>> needs_compaction(batch), needs_compaction(batch.t())
    (False, False)
    >>> needs_compaction(torch.ones(4096).expand(1000, 4096))
    False
    >>> import numpy as np
    >>> needs_compaction(torch.from_numpy(np.zeros(4096)))
    True
    """
    t = check_ownable(t)
    return not _torch_sized(t.untyped_storage()) or storage_bytes(t) > compact_bytes(t)


def _distinct(t: torch.Tensor) -> torch.Tensor:
    """``t`` with every stride-0 dimension cut to size 1: the values an ``expand`` repeats."""
    for d, (n, s) in enumerate(zip(t.shape, t.stride())):
        if s == 0 and n > 1:
            t = t.narrow(d, 0, 1)
    return t


def compact(t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy ``t`` into storage of exactly :func:`compact_bytes` bytes.

    Parameters
    ----------
    t : torch.Tensor
        Any shape and dtype; dense strided.
    out : torch.Tensor, optional
        Shape ``[compact_bytes(t)]``, uint8, on ``t.device``, its start
        aligned to ``t.element_size()``: where to put the copy (an arena
        block). By default a fresh tensor is allocated.

    Returns
    -------
    torch.Tensor
        Same shape, dtype, device, values and ``requires_grad`` as ``t``; a
        new autograd leaf. The distinct part of ``t`` (every stride-0
        dimension cut to size 1) copied contiguous and expanded back to the
        shape (stride 0 where ``t`` has it), or for an overlapping view the
        strides of ``t`` over a copy of its reachable range. With ``out``, a
        view of ``out``'s storage.

    Raises
    ------
    TypeError
        ``t`` has no ordinary storage (see :func:`check_ownable`).
    ValueError
        ``t`` reaches past its storage (see :func:`check_ownable`), or ``out``
        is not uint8 of shape ``[compact_bytes(t)]`` on ``t.device``. (A
        start of ``out`` not aligned to ``t.element_size()`` is not checked
        here; torch's ``view(dtype)`` raises ``RuntimeError`` for it.)
    """
    t = check_ownable(t)
    span, distinct = _span_elems(t), _distinct_elems(t)
    keep_strides = span < distinct
    n = span if keep_strides else distinct
    if out is None:
        flat = torch.empty(n, dtype=t.dtype, device=t.device)
    else:
        want = n * t.element_size()
        if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != want or out.device != t.device:
            raise ValueError(
                f"out must be uint8 of shape [{want}] on {t.device}, "
                f"got {out.dtype} {list(out.shape)} on {out.device}"
            )
        flat = out.view(t.dtype)
    with torch.no_grad():
        if keep_strides:
            flat.copy_(t.as_strided((span,), (1,), t.storage_offset()))
            result = flat.as_strided(t.shape, t.stride(), flat.storage_offset())
        else:
            part = _distinct(t)
            result = flat.view(part.shape)
            result.copy_(part)
            result = result.expand(t.shape)
    if t.requires_grad:
        result.requires_grad_(True)
    return result


def _torch_sized(storage: torch.UntypedStorage) -> bool:
    """Whether ``storage.nbytes()`` is all the memory behind it: torch allocated it (resizable), or
    pinned it (``pin_memory()`` allocates exactly the tensor's bytes; asked only where CUDA exists,
    since without it nothing is pinned)."""
    return storage.resizable() or (storage.device.type == "cpu" and torch.cuda.is_available()
                                   and storage.is_pinned())


def _without_history(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the same storage, no copy, without its autograd history (which could keep
    saved activations alive); ``t`` itself when it has none."""
    return t if t.grad_fn is None else t.detach().requires_grad_(t.requires_grad)


def own(t: torch.Tensor) -> torch.Tensor:
    """Return ``t`` if it owns its storage (without its autograd history), else :func:`compact` of it.

    Parameters
    ----------
    t : torch.Tensor
        Any shape and dtype, any device; dense strided.

    Returns
    -------
    torch.Tensor
        When ``t`` owns its storage (``not needs_compaction(t)``): ``t``
        itself if it has no autograd history (``grad_fn`` None), else
        ``t.detach()`` with ``t``'s ``requires_grad`` (same storage, no
        copy; the history could keep saved activations alive). Otherwise a
        new tensor of ``t``'s shape, dtype, device and values, in exactly
        :func:`compact_bytes` bytes (see :func:`compact`).

    Raises
    ------
    TypeError
        ``t`` has no ordinary storage (see :func:`check_ownable`).
    ValueError
        ``t`` reaches past its storage (see :func:`check_ownable`).

    Example
    -------
    >>> batch = torch.zeros(1000, 4096, dtype=torch.bfloat16)   # 8_192_000 B
    >>> item = own(batch.split(100)[3])
    >>> storage_bytes(item)
    819200
    >>> own(batch) is batch
    True
    """
    return compact(t) if needs_compaction(t) else _without_history(t)


_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Rebuild ``obj`` with every tensor ``t`` replaced by ``fn(t)``.

    Parameters
    ----------
    obj : Any
        Containers: dicts and ``collections.UserDict`` (values; copied with
        ``copy.copy``, then items set, so subclasses such as transformers'
        ``BatchEncoding`` keep their type and attributes), lists, tuples
        (named tuples too), sets, and dataclass instances (copied, fields set
        directly, so frozen ones work). Leaves: tensors and plain scalars
        (None, bool, int, float, complex, str, bytes, dtype, device, Enum).
    fn : callable
        ``torch.Tensor -> torch.Tensor``, called once per tensor occurrence.

    Returns
    -------
    Any
        ``fn(obj)`` for a tensor; the scalar itself for a scalar leaf; else a
        new container of the same type (``obj`` is not modified).

    Raises
    ------
    TypeError
        A leaf of another type: its bytes could not be counted; or another
        mapping, whose copy could share the caller's items (pass a dict of it).
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, _LEAVES):
        return obj
    if isinstance(obj, (dict, UserDict)):  # a shallow copy of either has its own items
        new = copy.copy(obj)
        for k, v in obj.items():
            new[k] = map_tensors(v, fn)
        return new
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = [map_tensors(v, fn) for v in obj]
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return type(obj)(*items)
        return type(obj)(items)
    if _is_dataclass(obj):
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(new, f.name, map_tensors(getattr(obj, f.name), fn))
        return new
    if isinstance(obj, Mapping):
        raise TypeError(f"cannot rebuild a {type(obj).__name__}: expected a dict or a collections.UserDict "
                        "(a copy of another mapping could share the caller's items); pass dict(value)")
    raise TypeError(
        f"cannot count the bytes held by a {type(obj).__name__}; expected tensors in dicts, "
        "lists, tuples, sets or dataclasses, with scalar leaves"
    )


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _signature(t: torch.Tensor) -> tuple:
    """What makes two views read the same values: storage, offset, shape, strides, dtype, flags."""
    return (storage_key(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype,
            t.requires_grad, t.is_conj(), t.is_neg())


@dataclasses.dataclass(frozen=True)
class OwnershipPlan:
    """What owning every tensor of ``value`` costs, known before anything is copied.

    Made by :func:`plan_ownership`; :meth:`apply` makes the copies. Views are
    keyed by a signature (storage, offset, shape, strides, dtype and flags),
    so identical views count and copy once.
    """

    value: Any
    views: dict[tuple, torch.Tensor]  # signature -> tensor: the distinct views, in value order
    copy: tuple[tuple, ...]  # signatures of the views to copy
    keep: dict[StorageKey, int]  # storages kept as they are (torch allocated them) -> their nbytes
    copy_bytes: int  # bytes of the copies, each rounded up to ``align``
    retained_bytes: int  # storage the value keeps alive as given
    payload_bytes: int
    align: int  # bytes

    def apply(self, out: torch.Tensor | None = None) -> Any:
        """Make the copies and return ``value`` rebuilt around them (:func:`map_tensors`).

        Parameters
        ----------
        out : torch.Tensor, optional
            Shape ``[copy_bytes]``, uint8, on the tensors' device, start
            aligned to ``align``: the copies are packed in it at offsets that
            are multiples of ``align``. By default each copy is a fresh tensor.

        Returns
        -------
        Any
            ``value`` rebuilt by :func:`map_tensors`: each view in ``copy``
            replaced by its owned copy (one copy per distinct view, shared by
            its occurrences); every other tensor kept as the same object, or,
            if it has autograd history, as one ``detach()`` of it per
            distinct view (same storage, ``requires_grad`` kept), as
            :func:`own` does.

        Raises
        ------
        ValueError
            ``out`` is not uint8, 1-D, on the tensors' device, or too short
            to hold ``copy_bytes``.
        """
        owned, offset = {}, 0
        for sig in self.copy:
            t = self.views[sig]
            n = compact_bytes(t)
            owned[sig] = compact(t, out=None if out is None else out[offset:offset + n])
            offset += _round_up(n, self.align)

        def swap(t: torch.Tensor) -> torch.Tensor:
            sig = _signature(t)
            if sig not in owned and t.grad_fn is not None:
                owned[sig] = _without_history(t)
            return owned.get(sig, t)

        return map_tensors(self.value, swap)


def plan_ownership(value: Any, *, copy_all: bool = False, align: int = 1) -> OwnershipPlan:
    """Decide which tensors of ``value`` to copy so that it owns its memory.

    Identical views are copied once and stay shared. Views that share a
    storage are copied only if their compact copies are together smaller than
    the storage (all ten items of a split batch: kept; two of them: copied),
    or if torch did not allocate the storage (not resizable, see the module
    note).
    ``copy_all`` copies every view (to move a value into an arena). Nothing is
    copied until :meth:`OwnershipPlan.apply`; every leaf is checked here.

    Parameters
    ----------
    value : Any
        A tensor (any shape and dtype, any device; dense strided) or a
        container of them as :func:`map_tensors` accepts.
    copy_all : bool
        Copy every view, even those that own their storage.
    align : int
        Positive int, in bytes: each copy's size is rounded up to a multiple
        of it in ``copy_bytes`` (an arena's alignment; 1 packs them tight).

    Returns
    -------
    OwnershipPlan
        The distinct views, those to copy, the storages kept, and the bytes:
        ``copy_bytes`` the copies need, ``retained_bytes`` the value keeps
        alive as given, ``payload_bytes`` its values need.

    Raises
    ------
    TypeError
        A leaf that is neither a tensor nor a plain scalar
        (:func:`map_tensors`), or a tensor without ordinary storage
        (:func:`check_ownable`).
    ValueError
        ``align`` is not a positive int, or a tensor reaches past its storage
        (:func:`check_ownable`).

    Example
    -------
    >>> batch = torch.zeros(1000, 4096, dtype=torch.bfloat16)   # 8_192_000 B
    >>> plan = plan_ownership(batch.split(100)[:2])              # two items
    >>> plan.copy_bytes, plan.retained_bytes
    (1638400, 8192000)
    >>> plan_ownership(batch.split(100)).copy_bytes              # all ten: kept
    0
    """
    align = check_size(align, "align", 1)
    views: dict[tuple, torch.Tensor] = {}
    map_tensors(value, lambda t: views.setdefault(_signature(t), t))
    groups: dict[StorageKey, list[tuple]] = {}
    for sig in views:
        groups.setdefault(sig[0], []).append(sig)
    to_copy, keep, copy_bytes, retained = [], {}, 0, 0
    for skey, sigs in groups.items():
        storage = views[sigs[0]].untyped_storage()  # the one storage of every view in the group
        nbytes = storage.nbytes()
        sizes = [compact_bytes(views[s]) for s in sigs]
        retained += nbytes
        if not copy_all and _torch_sized(storage) and nbytes <= sum(sizes):
            keep[skey] = nbytes
        else:
            to_copy += sigs
            copy_bytes += sum(_round_up(n, align) for n in sizes)
    payload = sum(t.numel() * t.element_size() for t in views.values())
    return OwnershipPlan(value, views, tuple(to_copy), keep, copy_bytes, retained, payload, align)
