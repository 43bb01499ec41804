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
    by its size like any other; a copy of a pinned view is made in pinned
    memory too (a pageable copy would make a later ``non_blocking`` copy to
    the GPU wait for it on the host).

    Several views of one storage (:func:`plan_ownership`): views whose byte
    ranges overlap (``x`` and ``x.t()``, sliding windows, overlapping
    slices) form a cluster, copied as ONE byte range with each view rebuilt
    on it (so they stay aliased) when that range is no larger than their
    separate copies; otherwise each view is copied on its own. The whole
    storage is kept instead when it is no larger than all those copies.

    Copies are new autograd leaves (``requires_grad`` kept, history dropped:
    it could keep saved activations alive, uncharged); a tensor kept as is
    but with a ``grad_fn``, a ``.grad`` or autograd hooks, or a view of a
    tensor with any of these or with Python attributes, is kept as
    ``t.detach()`` (same storage, ``requires_grad`` kept) for the same
    reason: the ``.grad``, the hooks' closures or the viewed tensor would
    stay alive, uncharged, and a cache holds values, not training state. Every tensor is first checked by
    :func:`~tpool.memory.accounting.check_ownable`.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
from collections import UserDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tpool._checks import check_size
from tpool.memory.accounting import (StorageKey, _alive_bytes, _distinct_elems, _span_elems, _with_grads, check_ownable,
                                     compact_bytes, storage_bytes, storage_key)
from tpool.memory.values import (_LEAF_TYPES, _NUMBERS, _field_names, _instance_dict, _kind, _numbers,
                                 _own_attrs, _slot_members, _slot_values, leaf_bytes, tensor_attrs, walking)

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


def _make_normal(out: torch.Tensor | None) -> bool:
    """Whether a copy into ``out`` (fresh memory if None) leaves inference mode first: when the caller has it on
    and ``out`` is not an inference tensor. What is made is kept (a cache's copy), and torch refuses an
    inference tensor an in-place write or a place in autograd outside the mode, which the caller's tensor (a
    view of a normal tensor is one, even made in the mode) had; a caller's inference ``out`` stays in it."""
    return torch.is_inference_mode_enabled() and (out is None or not out.is_inference())


def compact(t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy ``t`` into storage of exactly :func:`compact_bytes` bytes.

    Parameters
    ----------
    t : torch.Tensor
        Any shape and dtype; dense strided.
    out : torch.Tensor, optional
        Shape ``[compact_bytes(t)]``, uint8, contiguous, on ``t.device``,
        its start aligned to ``t.element_size()``: where to put the copy (an
        arena block). By default a fresh tensor is allocated (in pinned memory when
        ``t``'s storage is pinned).

    Returns
    -------
    torch.Tensor
        Same shape, dtype, device, values and ``requires_grad`` as ``t``
        (pinned if ``t`` is, without ``out``); a new autograd leaf, and a
        normal tensor even under ``torch.inference_mode()`` (an inference
        tensor could not be written in place or used in autograd outside it)
        unless ``out`` is an inference tensor. The
        distinct part of ``t`` (every stride-0 dimension cut to size 1) copied contiguous and expanded back to the
        shape (stride 0 where ``t`` has it), or for an overlapping view the
        strides of ``t`` over a copy of its reachable range. With ``out``, a
        view of ``out``'s storage.

    Raises
    ------
    TypeError
        ``t`` has no ordinary storage (see :func:`check_ownable`).
    ValueError
        ``t`` reaches past its storage (see :func:`check_ownable`), or ``out``
        is not a uint8 tensor of shape ``[compact_bytes(t)]``, contiguous, on
        ``t.device`` (an overlapping view is rebuilt with its own strides on
        ``out``'s storage, which a strided ``out`` does not hold in order), or
        it overlaps the memory ``t`` reads (a slice of ``t``'s batch). (A
        start of ``out`` not aligned to ``t.element_size()`` is not checked
        here; torch's ``view(dtype)`` raises ``RuntimeError`` for it.)
    """
    t = check_ownable(t)
    if out is not None and not isinstance(out, torch.Tensor):
        raise ValueError(f"out must be a uint8 tensor of shape [{compact_bytes(t)}], got a {type(out).__name__}")
    if _make_normal(out):  # (asked first: entering the mode costs more than the question)
        with torch.inference_mode(False):
            return compact(t, out)
    span, distinct = _span_elems(t), _distinct_elems(t)
    keep_strides = span < distinct
    n = span if keep_strides else distinct
    if out is None:  # (pinned memory stays pinned: a pageable copy would make non_blocking copies wait)
        flat = torch.empty(n, dtype=t.dtype, device=t.device, pin_memory=_pinned(t.untyped_storage()))
    else:
        want = n * t.element_size()
        if (out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != want or out.device != t.device
                or not out.is_contiguous()):
            raise ValueError(
                f"out must be uint8 of shape [{want}], contiguous, on {t.device}, "
                f"got {out.dtype} {list(out.shape)} strides {out.stride()} on {out.device}"
            )
        _check_apart(out, want, [(*_address_span(t), t)])
        flat = out.view(t.dtype)
    with torch.no_grad():
        if keep_strides:
            _copy_values(flat, t.as_strided((span,), (1,), t.storage_offset()))
            result = flat.as_strided(t.shape, t.stride(), flat.storage_offset())
        else:
            part = _distinct(t)
            result = flat.view(part.shape)
            _copy_values(result, part)
            result = result.expand(t.shape)
    if t.requires_grad:
        result.requires_grad_(True)
    return result


# Dtypes compact copies as an int of their size: those torch has no copy kernel for (sub-byte and bit shells), and
# bool, whose copy kernel writes 1 for any byte that is not 0 (a bool view of raw bytes would not come back as it was;
# a cluster's copy moves bytes, so the two paths agree).
_BYTE_COPIED = frozenset(d for d in (getattr(torch, f"{kind}{n}", None) for kind in ("uint", "int")
                                      for n in range(1, 8)) if isinstance(d, torch.dtype)) | frozenset(
    d for d in (getattr(torch, n, None) for n in ("bits1x8", "bits2x4", "bits4x2", "bits8", "bits16"))
    if isinstance(d, torch.dtype)) | {torch.bool}
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _copy_values(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` (same dtype and shape), through same-sized ints for the dtypes of ``_BYTE_COPIED``."""
    if src.dtype in _BYTE_COPIED:
        as_int = _INT_OF_SIZE[src.element_size()]
        dst, src = dst.view(as_int), src.view(as_int)
    dst.copy_(src)


def _torch_sized(storage: torch.UntypedStorage) -> bool:
    """Whether ``storage.nbytes()`` is taken as the memory behind it: torch allocated it (resizable), or
    it is pinned (``pin_memory()``; see :func:`_pinned`).
    The pinned case is approximate (the accounting module's note): torch rounds pinned blocks up to a
    power of two, and memory pinned by other code is pinned too."""
    return storage.resizable() or _pinned(storage)


def _pinned(storage: torch.UntypedStorage) -> bool:
    """Whether ``storage`` is pinned host memory. Asked only where CUDA exists (without it nothing is pinned);
    torch answers False without making a context while CUDA is not initialised (its ``isPinnedPtr``). Where
    the runtime cannot be asked (a worker forked from a process that used CUDA, which cannot use CUDA
    either) nothing counts as pinned. (Not ``torch.cuda.is_initialized()``: pinning initialises CUDA in
    C++ and may leave that Python flag False.)"""
    if storage.device.type != "cpu" or not torch.cuda.is_available():
        return False
    try:
        return storage.is_pinned()
    except RuntimeError:
        return False


def _holds_more(t: torch.Tensor) -> bool:
    """Whether ``t`` keeps more alive than its storage: autograd history (saved activations), a
    ``.grad``, autograd hooks (their closures), or a tensor it is a view of (``t._base``, which the
    view keeps alive) that holds any of these or Python attributes."""
    if _autograd_state(t):
        return True
    base = t._base
    return base is not None and (_autograd_state(base) or bool(tensor_attrs(base)))


def _autograd_state(t: torch.Tensor) -> bool:
    """Whether ``t`` holds autograd history, a ``.grad`` or hooks (``.grad`` is asked of leaves only:
    torch warns when a non-leaf's is read)."""
    return (t.grad_fn is not None or t.grad is not None or bool(t._backward_hooks)
            or bool(t._post_accumulate_grad_hooks))  # (a removed hook leaves an empty dict)


def _without_history(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the same storage, no copy, holding nothing more (:func:`_holds_more`): ``t.detach()``
    with ``requires_grad`` kept; ``t`` itself when it holds nothing more."""
    return t.detach().requires_grad_(t.requires_grad) if _holds_more(t) else t


def own(t: torch.Tensor) -> torch.Tensor:
    """Return ``t`` if it owns its storage (and holds nothing more), else :func:`compact` of it.

    Parameters
    ----------
    t : torch.Tensor
        Any shape and dtype, any device; dense strided.

    Returns
    -------
    torch.Tensor
        When ``t`` owns its storage (``not needs_compaction(t)``): ``t``
        itself if it has no autograd history (``grad_fn`` None), no
        ``.grad`` and no autograd hooks, and is no view of a tensor that
        has any of these or Python attributes (``t._base``, which a view
        keeps alive); else ``t.detach()`` with ``t``'s ``requires_grad``
        (same storage and strides, no copy): the history could keep saved
        activations alive, and the ``.grad``, the hooks' closures or the
        viewed tensor's attributes would stay alive uncharged; they stay
        with ``t``. An ``nn.Parameter`` detached or copied comes back a plain
        tensor; one that holds nothing more comes back itself (a later
        ``.grad`` on it would stay alive uncharged in an ``OwnedCache``, whose
        ``check_invariants()`` reports it).
        Otherwise a
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


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Rebuild ``obj`` with every tensor ``t`` replaced by ``fn(t)``.

    Parameters
    ----------
    obj : Any
        Containers: dicts and ``collections.UserDict`` (values; copied with
        ``copy.copy``, then items set, so subclasses such as transformers'
        ``BatchEncoding`` keep their type and attributes), lists, tuples
        (named tuples too), sets, and dataclass instances (copied, fields set
        directly, so frozen ones work; the other attributes in the
        instance's ``__dict__``, set in ``__post_init__`` or cached by
        ``functools.cached_property``, and a ``__slots__`` base's slots, are
        rebuilt too). A dict, list, tuple or set subclass keeps its
        attributes (``__dict__`` and ``__slots__``); one that holds one of its own
        items (a transformers ``ModelOutput`` keeps every item as an
        attribute too) is pointed at that item's rebuild. Leaves: tensors and
        plain scalars (None, bool, int, float, complex, str, bytes, dtype,
        device, Enum; a subclass's own attributes, and those of a member of
        an enum made at run time, must be small plain data). Dict keys are
        kept as they are and must be chargeable: numbers, str, bytes, None,
        enums, dtypes, devices, classes its module holds, numpy scalars, UUIDs, dates and
        times, paths, and tuples, frozensets and dataclasses of them (their
        text is charged, :func:`~tpool.memory.values.leaf_bytes`).
        :func:`~tpool.memory.accounting.retained_bytes` walks by the same
        rule.
    fn : callable
        ``torch.Tensor -> torch.Tensor``, called once per tensor occurrence.

    Returns
    -------
    Any
        ``fn(obj)`` for a tensor; the scalar itself for a scalar leaf; else a
        new container of the same type (``obj`` is not modified), but for a
        tuple or frozenset of numbers (int, float, complex, bool), kept as it
        is, as text is; a list or set of numbers that ``obj`` holds twice is
        copied once, both places holding the copy.

    Raises
    ------
    TypeError
        A leaf of another type (a numpy array, a deque, an ``nn.Module``,
        ...): its bytes could not be counted; or another mapping, whose copy
        could share the caller's items (pass a dict of it); or an attribute
        of a tensor, of a scalar subclass or of a container subclass
        (``__dict__`` or slots) holding more than small plain data or (for a
        container's attribute) one of its own items (a tensor, an array, an
        object, an int of over 128 bytes), or a dict key holding a tensor,
        an array or another object: it would stay alive uncharged; the
        attributes of the tensor a view is of (the view keeps it alive); a
        ``defaultdict`` whose ``default_factory`` is not a class; a value that
        holds itself (:func:`~tpool.memory.values.walking`).
    """
    with walking():
        return _map(obj, fn, True, {})


def _map(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor], check: bool, copies: dict) -> Any:
    """:func:`map_tensors`; ``check=False`` skips what ``put`` checked of a value the cache stored
    (attributes, dict keys: see :func:`~tpool.memory.values._kind`) and never raises for it, for ``get``.
    ``copies`` (empty at the top) maps the id of each list or set of numbers copied so far to its copy."""
    kind = _kind(obj, check)
    if kind == "tensor":
        return fn(obj)
    if kind == "leaf":
        return obj
    if kind == "dict":
        new = copy.copy(obj)
        for k, v in obj.items():
            new[k] = fn(v) if type(v) is torch.Tensor and not check else _map(v, fn, check, copies)  # (get: inline)
        if type(obj) is not dict and type(obj) is not UserDict:
            _rebuild_attrs(obj, new, _NO_ALIASES)  # a subclass's attributes: the copy gets its own
        return new
    if kind == "items" or kind == "items+attrs":
        if _numbers(obj, _NUMBERS):  # token ids: charged by leaf_bytes, as it is stored
            t = type(obj)
            if t is tuple or t is frozenset:
                return obj  # (nothing can be added to it: kept, as a str is)
            new = copies.get(id(obj))  # a list held twice is copied once: the charge counts it once
            if new is None:
                new = copies[id(obj)] = t(obj)
            return new
        items = [v if type(v) in _LEAF_TYPES else _map(v, fn, check, copies) for v in obj]
        new = type(obj)(*items) if isinstance(obj, tuple) and hasattr(obj, "_fields") else type(obj)(items)
        if type(obj) not in (list, tuple, set, frozenset):
            attrs = _instance_dict(obj)
            if attrs:
                vars(new).update(attrs)  # a subclass's attributes (_kind checked) come back too
            elif not _slot_members(type(obj)):  # (a torch.Size, a named tuple)
                return new
            _rebuild_attrs(obj, new, {id(v): m for v, m in zip(obj, items)} if kind == "items+attrs" else _NO_ALIASES)
        return new
    if kind == "dict+attrs":  # a ModelOutput: some attributes hold its own items
        new = copy.copy(obj)
        done = {}  # id(item) -> its rebuild
        for k, v in obj.items():
            new[k] = done[id(v)] = _map(v, fn, check, copies)
        _rebuild_attrs(obj, new, done)
        return new
    new = copy.copy(obj)  # a dataclass instance
    names, slots = _field_names(type(obj))
    for name in names:
        object.__setattr__(new, name, _map(getattr(obj, name), fn, check, copies))
    for name, v in (_instance_dict(obj) or {}).items():
        if name not in names:  # past any descriptor, as __post_init__ or cached_property stored it
            vars(new)[name] = _map(v, fn, check, copies)
    for d, v in _slot_values(obj, slots):  # a __slots__ base's (through its descriptor: no name to mangle)
        d.__set__(new, _map(v, fn, check, copies))
    return new


_NO_ALIASES: dict = {}  # no item is an attribute (read only)
# attribute values a copy may share, by exact type: nothing can be added to them (an instance of a subclass may have
# a __dict__ or slots: it is deep-copied, as small plain data that can change is)
_IMMUTABLE = frozenset((type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device))


def _shareable(v: Any) -> bool:
    """Whether an attribute value may be shared by the cache's copy and the caller's: nothing can be
    added to it (an exact immutable type, an enum member, a numpy scalar without attributes of its own)."""
    return type(v) in _IMMUTABLE or isinstance(v, enum.Enum) or isinstance(v, np.generic) and not _own_attrs(v)


def _rebuild_attrs(obj: Any, new: Any, done: dict[int, Any]) -> None:
    """Point each attribute of container subclass ``new`` (a copy of ``obj``) that holds one of
    ``obj``'s items itself at that item's rebuild (``done``: id of an item -> its rebuild), as
    :func:`~tpool.memory.values._check_attrs` allows: a ``ModelOutput``'s attribute and item
    then stay one object, and the attribute never keeps a replaced tensor alive. Every other
    attribute the copy still shares with ``obj`` and that is not a scalar (small plain data, as
    ``_check_attrs`` allows: a list, a set, a dict, a dataclass) is deep-copied, so that no one can
    add a tensor to the cache's copy through the caller's object (or another ``get``'s). Slots
    (``__slots__``) are set the same way, whether or not the copy carried them."""
    own = _instance_dict(new)
    for name, v in (_instance_dict(obj) or {}).items():  # (a UserDict's ``data``: new has its own)
        if id(v) in done:
            own[name] = done[id(v)]  # past any __setattr__ (a ModelOutput's __setitem__ set it already)
        elif own.get(name) is v and not _shareable(v):
            own[name] = copy.deepcopy(v)
    for d, v in _slot_values(obj, _slot_members(type(obj))):  # through the descriptors: no name to mangle
        d.__set__(new, done[id(v)] if id(v) in done else v if _shareable(v) else copy.deepcopy(v))


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _signature(t: torch.Tensor) -> tuple:
    """What makes two views read the same values: storage, offset, shape, strides, dtype, flags."""
    return (storage_key(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype,
            t.requires_grad, t.is_conj(), t.is_neg())


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """``[start, end)``: the bytes of its storage that ``t`` reaches (empty for an empty ``t``)."""
    e = t.element_size()
    return t.storage_offset() * e, (t.storage_offset() + _span_elems(t)) * e


def _address_span(t: torch.Tensor) -> tuple[int, int]:
    """``[start, end)``: the addresses of the bytes ``t`` reaches (:func:`_byte_span` from its storage's start)."""
    base = t.untyped_storage().data_ptr()
    start, end = _byte_span(t)
    return base + start, base + end


@dataclasses.dataclass(frozen=True)
class _Piece:
    """One copy an :class:`OwnershipPlan` makes: one view (by :func:`compact`), or the views of a
    cluster (overlapping views of one storage) rebuilt on one copy of their byte range."""

    sigs: tuple[tuple, ...]  # signatures of the views made from this copy, in value order
    start: int  # bytes: where the copied range starts in the storage; -1 for one view copied by compact()
    nbytes: int  # bytes copied
    align: int  # bytes; offset is a multiple of it: lcm(plan align, the largest element size)
    offset: int = 0  # bytes from the start of ``out`` (set by _place)

    @property
    def slot(self) -> int:
        """Bytes the piece takes in ``out``: ``nbytes`` rounded up to ``align``."""
        return _round_up(self.nbytes, self.align)


def _pieces(views: dict[tuple, torch.Tensor], sigs: list[tuple], align: int) -> list[_Piece]:
    """The copies of the views ``sigs`` (value order) of one storage, in value order.

    Views whose byte spans overlap form a cluster; a cluster of 2+ views is copied as one range
    (its start aligned down and its size rounded up to the largest element size in it, so the copy
    can hold every view's dtype) when that range is no larger than the views' own copies, both as
    bytes and as slots in ``out``. Empty views and views with a conj or neg bit are copied on their
    own (their bytes are not what they read).
    """
    rank = {s: i for i, s in enumerate(sigs)}

    def alone(s: tuple) -> _Piece:
        return _Piece((s,), -1, compact_bytes(views[s]), math.lcm(align, views[s].element_size()))

    def cluster(members: list[tuple]) -> list[_Piece]:
        single = [alone(s) for s in sorted(members, key=rank.__getitem__)]
        if len(members) < 2:
            return single
        e = max(views[s].element_size() for s in members)
        start = min(_byte_span(views[s])[0] for s in members) // e * e
        nbytes = _round_up(max(_byte_span(views[s])[1] for s in members) - start, e)
        span = _Piece(tuple(p.sigs[0] for p in single), start, nbytes, math.lcm(align, e))
        smaller = span.nbytes <= sum(p.nbytes for p in single) and span.slot <= sum(p.slot for p in single)
        return [span] if smaller else single

    spannable = {s for s in sigs if views[s].numel() and not views[s].is_conj() and not views[s].is_neg()}
    pieces = [alone(s) for s in sigs if s not in spannable]
    members: list[tuple] = []
    reach = 0
    for s in sorted(spannable, key=lambda s: _byte_span(views[s])):  # sweep by start: a gap closes a cluster
        lo, hi = _byte_span(views[s])
        if members and lo >= reach:
            pieces += cluster(members)
            members = []
        members.append(s)
        reach = max(reach, hi) if len(members) > 1 else hi
    pieces += cluster(members)
    return sorted(pieces, key=lambda p: rank[p.sigs[0]])


def _place(pieces: list[_Piece]) -> tuple[tuple[_Piece, ...], int]:
    """Give each piece its offset in ``out``, largest alignment first (ties in the given order); return
    them in that order and the bytes they take. Alignments are lcm(align, 2**k), so each divides the
    ones before it and every slot ends where the next piece may start: no padding between pieces."""
    placed, offset = [], 0
    for p in sorted(pieces, key=lambda p: -p.align):
        placed.append(dataclasses.replace(p, offset=offset))
        offset += p.slot
    return tuple(placed), offset


def _copy_span(piece: _Piece, views: dict[tuple, torch.Tensor], buf: torch.Tensor | None) -> dict[tuple, torch.Tensor]:
    """Copy ``piece``'s byte range into ``buf`` (``[piece.nbytes]`` uint8; fresh by default) and rebuild
    each of its views on the copy: same offset, shape, strides and dtype, relative to the range. The
    range may end past the storage (its size rounded up to an element): those bytes no view reads."""
    if _make_normal(buf):
        with torch.inference_mode(False):
            return _copy_span(piece, views, buf)
    first = views[piece.sigs[0]]
    storage = first.untyped_storage()
    n = min(piece.nbytes, storage.nbytes() - piece.start)
    src = torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, piece.start, (n,), (1,))
    if buf is None:  # (pinned stays pinned, as in compact)
        buf = torch.empty(piece.nbytes, dtype=torch.uint8, device=first.device, pin_memory=_pinned(storage))
    buf[:n].copy_(src)
    storage, shift = buf.untyped_storage(), buf.storage_offset() - piece.start  # source byte b is at b + shift
    rebuilt = {}
    for sig in piece.sigs:
        t = views[sig]
        start = t.storage_offset() + shift // t.element_size()  # exact: both terms are multiples of the size
        r = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, start, t.shape, t.stride())
        rebuilt[sig] = r.requires_grad_(True) if t.requires_grad else r
    return rebuilt


@dataclasses.dataclass(frozen=True)
class OwnershipPlan:
    """What owning every tensor of ``value`` costs, known before anything is copied.

    Made by :func:`plan_ownership`; :meth:`apply` makes the copies. Views are
    keyed by a signature (storage, offset, shape, strides, dtype and flags),
    so identical views count and copy once; ``pieces`` are the copies (one
    view, or a cluster of overlapping views of one storage on one copy of
    their byte range) with their offsets in ``out``. A plan holds ``value``
    and its views, so it keeps their storages alive until it is dropped.
    """

    value: Any
    views: dict[tuple, torch.Tensor]  # signature -> tensor: the distinct views, in value order
    copy: tuple[tuple, ...]  # signatures of the views to copy (alone or rebuilt on a cluster's copy)
    keep: dict[StorageKey, int]  # storages kept as they are (torch allocated them) -> their nbytes
    copy_bytes: int  # bytes of the copies, each at an offset aligned as ``pieces`` says, in multiples of ``align``
    retained_bytes: int  # storage the value keeps alive as given (memory behind two storages once)
    payload_bytes: int
    align: int  # bytes
    pieces: tuple[_Piece, ...] = ()  # the copies in ``out`` order, each with its views, bytes and offset
    leaf_bytes: int = 0  # its text, big ints and lists of numbers, as apply rebuilds it (accounting.leaf_bytes)

    def apply(self, out: torch.Tensor | None = None) -> Any:
        """Make the copies and return ``value`` rebuilt around them (:func:`map_tensors`).

        Parameters
        ----------
        out : torch.Tensor, optional
            Shape ``[n]`` with ``n >= copy_bytes``, uint8, contiguous, on the
            device of the views to copy, its storage offset a multiple of the
            largest element size copied (each copy lands ``align``-aligned
            relative to ``out``'s start: an ``out`` at an aligned address, as an
            :class:`~tpool.memory.arena.Arena`'s blocks are, gives aligned copies):
            the copies are packed in its first ``copy_bytes`` bytes, each at
            the offset ``pieces`` gives (a multiple of ``align`` and of its
            element size). By default each copy is a fresh tensor.

        Returns
        -------
        Any
            ``value`` rebuilt by :func:`map_tensors`: each view in ``copy``
            replaced by its owned copy (one copy per distinct view, shared by
            its occurrences; the views of a cluster rebuilt on one copy of
            their byte range, aliased as they were); every other tensor kept
            as the same object, or, if it holds more than its storage (as
            :func:`own` tells: autograd history, a ``.grad``, hooks, a viewed
            tensor holding any of these or attributes), as one ``detach()``
            of it per distinct view (same storage, ``requires_grad`` kept).

        Raises
        ------
        ValueError
            ``out`` is not uint8, 1-D and contiguous, on the copies' device,
            at least ``copy_bytes`` long, or its start is not aligned, or its
            first ``copy_bytes`` bytes overlap memory a copy reads or a tensor
            kept as it is holds (``out`` a slice of the batch the views are of:
            a copy would overwrite values a later one reads, or that the
            rebuilt value returns); or the
            views to copy are on several devices; or a tensor of ``value`` is
            no longer what the plan priced (its storage resized under it so
            that it reaches past its end, or another storage, offset, shape,
            strides, dtype or ``requires_grad`` since ``plan_ownership``, as
            ``t.data = ...`` or ``t.set_(...)`` make): the copies would read
            bytes that are not its values. Checked before anything is copied.
        """
        for sig, t in self.views.items():  # (put applies its plan at once, under its lock: it calls _apply)
            now = _signature(t)  # (ValueError if t reaches past its storage now)
            if now != sig:
                raise ValueError(f"a tensor of the plan changed since plan_ownership: expected storage, offset, "
                                 f"shape, strides, dtype and flags {sig}, got {now} (t.data = ..., t.set_(...)); "
                                 "plan again")
        return self._apply(out)

    def _apply(self, out: torch.Tensor | None = None) -> Any:
        """:meth:`apply` without checking that the tensors are still what the plan priced (a plan applied at once)."""
        if out is not None:
            self._check_out(out)
        owned = {}
        for p in self.pieces:
            buf = None if out is None else out[p.offset:p.offset + p.nbytes]
            if p.start < 0:
                owned[p.sigs[0]] = compact(self.views[p.sigs[0]], out=buf)
            else:
                owned.update(_copy_span(p, self.views, buf))

        def swap(t: torch.Tensor) -> torch.Tensor:
            sig = _signature(t)
            if sig not in owned and _holds_more(t):
                owned[sig] = _without_history(t)
            return owned.get(sig, t)

        return map_tensors(self.value, swap)

    def _sources(self) -> list[tuple[int, int, torch.Tensor]]:
        """``(start, end, view)``: the memory each copy reads (a view's span, or a cluster's copied range), and
        the memory of each view kept as it is (the rebuilt value holds it: a copy written there changes it)."""
        copied = set(self.copy)
        out = [(*_address_span(t), t) for s, t in self.views.items() if s not in copied]
        for p in self.pieces:
            t = self.views[p.sigs[0]]
            if p.start < 0:
                out.append((*_address_span(t), t))
            else:
                storage = t.untyped_storage()
                lo = storage.data_ptr() + p.start
                out.append((lo, lo + min(p.nbytes, storage.nbytes() - p.start), t))
        return out

    def _check_out(self, out: torch.Tensor) -> None:
        devices = sorted({str(self.views[s].device) for s in self.copy})
        if len(devices) > 1:
            raise ValueError(f"out: expected the views to copy on one device, got views on {devices}")
        device = torch.device(devices[0]) if devices else out.device
        # Typed views on out's storage need byte offsets in whole elements of every dtype copied.
        elem = max((self.views[s].element_size() for s in self.copy), default=1)
        if not (isinstance(out, torch.Tensor) and out.dtype == torch.uint8 and out.dim() == 1
                and out.is_contiguous() and out.numel() >= self.copy_bytes and out.device == device
                and out.storage_offset() % elem == 0):
            got = (f"{out.dtype} {list(out.shape)} strides {out.stride()} on {out.device} at storage offset "
                   f"{out.storage_offset()}" if isinstance(out, torch.Tensor) else type(out).__name__)
            raise ValueError(f"out: expected uint8 of shape [n >= {self.copy_bytes}], contiguous, on {device}, "
                             f"at a storage offset that is a multiple of {elem} (the largest element size "
                             f"copied); got {got}")
        _check_apart(out, self.copy_bytes, self._sources())


def _check_apart(out: torch.Tensor, nbytes: int, sources: list[tuple[int, int, torch.Tensor]]) -> None:
    """Raise ``ValueError`` if the first ``nbytes`` bytes of ``out`` overlap memory a copy reads (``sources``:
    ``(start, end, view)`` addresses): one copy would overwrite values that it or a later copy still reads (out a
    slice of the batch the views are of). Addresses are compared on cpu and cuda only, where they are addresses."""
    if out.device.type not in ("cpu", "cuda") or not nbytes:
        return
    lo, hi = out.data_ptr(), out.data_ptr() + nbytes
    for start, end, t in sources:
        if start < hi and lo < end and t.device == out.device:
            raise ValueError(f"out: expected memory apart from the views it copies, got out's {nbytes} bytes at "
                             f"{lo:#x} overlapping the {end - start} bytes at {start:#x} that a copy reads or the "
                             f"value keeps (a {t.dtype} view of shape {list(t.shape)}): a copy written there would "
                             "overwrite values still to be read or returned")


def plan_ownership(value: Any, *, copy_all: bool = False, align: int = 1) -> OwnershipPlan:
    """Decide which tensors of ``value`` to copy so that it owns its memory.

    Identical views are copied once and stay shared. Views of one storage
    whose byte ranges overlap (``x`` and ``x.t()``, sliding windows,
    overlapping slices) form a cluster: it is copied as ONE byte range (the
    union of their ranges, its start aligned down to the largest element
    size in it), each view rebuilt on that copy with its own offset, shape,
    strides and dtype, so the views stay aliased, when that range is no
    larger than the views' separate copies; otherwise (and for views with a
    conj or neg bit) each view is copied alone. So ``copy_bytes`` is never
    above the sum of the views' separate copies. A storage is kept whole,
    nothing copied, if it is no larger than those copies (as ``copy_bytes``
    counts them; all ten items of a split batch: kept; two of them: copied;
    twenty overlapping windows over a few rows: their rows copied once) and
    torch allocated it (resizable, see the module note).
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
        Positive int, in bytes: each copy starts at a multiple of ``align``
        and of its element size (the largest one for a cluster) and its size
        is rounded up to that in ``copy_bytes``; copies are laid out largest
        alignment first, so no other padding is needed (1 packs them tight).

    Returns
    -------
    OwnershipPlan
        The distinct views, those to copy, the storages kept, the copies
        (``pieces``: views, bytes, offset in ``out``) and the bytes:
        ``copy_bytes`` the copies need, ``retained_bytes`` the value keeps
        alive as given, ``payload_bytes`` its values need.

    Raises
    ------
    TypeError
        A leaf that is neither a tensor nor a plain scalar
        (:func:`map_tensors`), or a tensor without ordinary storage
        (:func:`check_ownable`).
    ValueError
        ``align`` is not a positive int, ``copy_all`` is not a bool, or a
        tensor reaches past its storage (:func:`check_ownable`).

    Example
    -------
    >>> batch = torch.zeros(1000, 4096, dtype=torch.bfloat16)   # 8_192_000 B
    >>> plan = plan_ownership(batch.split(100)[:2])              # two items
    >>> plan.copy_bytes, plan.retained_bytes
    (1638400, 8192000)
    >>> plan_ownership(batch.split(100)).copy_bytes              # all ten: kept
    0
    >>> windows = [batch[i:i + 100] for i in range(20)]         # rows 0..118, 20 overlapping views
    >>> plan = plan_ownership(windows)
    >>> plan.copy_bytes, len(plan.pieces)                        # 119 rows, copied once
    (974848, 1)
    >>> w = plan.apply()
    >>> w[0][5].data_ptr() == w[5][0].data_ptr()                 # still aliased
    True
    """
    align = check_size(align, "align", 1)
    if not isinstance(copy_all, (bool, np.bool_)):  # ("no" or 0.0 would read as a truth value, silently)
        raise ValueError(f"copy_all: expected a bool, got a {type(copy_all).__name__} ({copy_all!r})")
    views: dict[tuple, torch.Tensor] = {}
    rebuilt = map_tensors(value, lambda t: views.setdefault(_signature(t), t))  # (as apply will rebuild it)
    groups: dict[StorageKey, list[tuple]] = {}
    for sig in views:
        groups.setdefault(sig[0], []).append(sig)
    pieces, keep = [], {}
    for skey, sigs in groups.items():
        storage = views[sigs[0]].untyped_storage()  # the one storage of every view in the group
        mine = _pieces(views, sigs, align)
        if not copy_all and _torch_sized(storage) and storage.nbytes() <= sum(p.slot for p in mine):
            keep[skey] = storage.nbytes()
        else:
            pieces += mine
    placed, copy_bytes = _place(pieces)
    copied = {s for p in placed for s in p.sigs}
    alive = _with_grads(views.values())   # (each storage once below; a leaf's .grad stays alive with it)
    retained = _alive_bytes({storage_key(t): t for t in alive}.values())
    payload = sum(t.numel() * t.element_size() for t in views.values())
    return OwnershipPlan(value, views, tuple(s for s in views if s in copied), keep, copy_bytes, retained,
                         payload, align, placed, leaf_bytes(rebuilt))
