"""Byte counting and view-to-owned compaction.

Note:
    A view keeps its WHOLE storage alive: keep one ``[100, 4096]`` item of a
    split ``[1000, 4096]`` bf16 batch and 7.81 MiB stays resident for a
    0.78 MiB payload. Three numbers per tensor, in bytes:

    * payload = ``numel * element_size``: what the values need;
    * storage = ``untyped_storage().nbytes()``: what stays alive;
    * compact = ``min(distinct, span)``: the fewest bytes that hold the
      values. distinct counts the elements of ``t`` with every stride-0
      dimension cut to size 1 (what an ``expand`` repeats); span is the range
      the strides reach, below distinct only for overlapping views such as
      ``unfold``.

    A tensor *owns* its storage when storage <= compact and torch allocated
    that storage (a whole tensor, its transpose, ``x.view(-1)``, an
    ``expand`` of a whole tensor) and is kept as is. Otherwise :func:`own`
    copies it into exactly ``compact`` bytes: the distinct part, contiguous,
    expanded back to the shape (an expanded row stays one row), or for an
    overlapping view the reachable range with its strides. A copy is never
    larger than the storage it replaces.

    A storage that is not resizable (``untyped_storage().resizable()`` is
    False) wraps memory torch did not allocate: ``torch.from_numpy``,
    ``torch.frombuffer``, ``torch.from_dlpack``, ``torch.load(mmap=True)``.
    Its ``nbytes`` covers only the wrapped part while the owner's whole
    buffer stays alive (a row of a numpy array keeps the array), so its true
    size is unknown and it is always copied. ``torch.empty`` and
    ``share_memory_()`` storages are resizable. ``pin_memory()`` makes a
    pinned storage that is not resizable but is torch's own, sized to the
    tensor: pinned storages are judged by their size like any other (a copy
    would be pageable, and a later ``non_blocking`` copy to the GPU would
    then wait).

    Copies are new autograd leaves (``requires_grad`` kept, history dropped:
    it could keep saved activations alive, uncharged); a tensor kept as is
    but with a ``grad_fn`` is kept as ``t.detach()`` (same storage) for the
    same reason. Storage identity is the storage object
    (``untyped_storage()._cdata``), not its address: two live storages can
    start at one address (``torch.from_numpy(a[:1])`` and
    ``torch.from_numpy(a)``). A tensor whose offset and strides reach past
    its storage (shrunk or freed under it by ``untyped_storage().resize_``)
    raises ``ValueError``. Tensors without ordinary storage (sparse, mkldnn,
    meta, nested, quantized, dispatch subclasses) raise ``TypeError``.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from collections import UserDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from tpool._checks import check_size

__all__ = ["payload_bytes", "storage_bytes", "compact_bytes", "storage_key", "retained_bytes",
           "needs_compaction", "own", "compact", "iter_tensors", "map_tensors", "plan_ownership",
           "OwnershipPlan", "check_ownable"]

StorageKey = tuple[str, int, int]  # (device type, device index or -1, storage object id)


def check_ownable(t: Any) -> torch.Tensor:
    """Return ``t`` if it is a dense strided tensor with real storage, else raise.

    Parameters
    ----------
    t : Any
        The object to check; a tensor passes if it is dense and strided, of
        any shape and dtype, on any device, and empty or inside its storage.

    Returns
    -------
    torch.Tensor
        ``t`` itself.

    Raises
    ------
    TypeError
        ``t`` is not a tensor, or its kind has no countable storage (nested,
        sparse or another non-strided layout, quantized, meta, a subclass with
        ``__torch_dispatch__``, a functorch-wrapped tensor).
    ValueError
        ``t`` is not empty and its offset and strides reach past the end of
        its storage (shrunk or freed under it by ``untyped_storage().resize_``,
        as FSDP-style code does): its bytes cannot be counted or copied.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    kind = None
    if t.is_nested:
        kind = f"nested tensor (layout {t.layout})"
    elif t.layout != torch.strided:
        kind = f"layout {t.layout}"
    elif t.is_quantized:
        kind = "quantized tensor"
    elif t.is_meta:
        kind = "meta tensor (it holds no data)"
    elif type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        kind = f"tensor subclass {type(t).__name__} with __torch_dispatch__"
    elif torch._C._functorch.is_functorch_wrapped_tensor(t):
        kind = "functorch-wrapped tensor (vmap/grad)"
    if kind is not None:
        raise TypeError(f"expected a dense strided tensor with its own storage, got a {kind}")
    if t.numel():
        need = (t.storage_offset() + _span_elems(t)) * t.element_size()
        have = t.untyped_storage().nbytes()
        if need > have:
            raise ValueError(
                f"expected a storage of at least {need} bytes (what offset {t.storage_offset()} and strides "
                f"{t.stride()} of shape {list(t.shape)} reach), got a storage of {have} bytes (shrunk or freed "
                "under the tensor, e.g. by untyped_storage().resize_)")
    return t


def payload_bytes(t: torch.Tensor) -> int:
    """Bytes the values of ``t`` need: ``numel * element_size``.

    Parameters
    ----------
    t : torch.Tensor
        any shape and dtype, any device; dense strided.

    Returns
    -------
    int
        Bytes, whatever the strides: an ``expand`` counts every repeated
        element; 0 for an empty tensor.

    Raises
    ------
    TypeError
        ``t`` has no ordinary storage (see :func:`check_ownable`).
    ValueError
        ``t`` reaches past its storage (see :func:`check_ownable`).

    Example
    -------
    >>> batch = torch.zeros(1000, 4096, dtype=torch.bfloat16)
    >>> payload_bytes(batch.split(100)[3])      # 100 * 4096 * 2
    819200
    """
    t = check_ownable(t)
    return t.numel() * t.element_size()


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes of the backing storage that ``t`` keeps alive (``untyped_storage().nbytes()``).

    Parameters
    ----------
    t : torch.Tensor
        any shape and dtype, any device; dense strided.

    Returns
    -------
    int
        Bytes of the whole storage, however little of it ``t`` reads. For a
        storage over memory torch did not allocate (not resizable:
        ``torch.from_numpy`` of a numpy view, ``torch.frombuffer``,
        ``from_dlpack``) torch sees only the wrapped part, so this undercounts
        what stays alive: the owner's whole buffer.

    Raises
    ------
    TypeError
        ``t`` has no ordinary storage (see :func:`check_ownable`).
    ValueError
        ``t`` reaches past its storage (see :func:`check_ownable`).

    Example
    -------
    >>> batch = torch.zeros(1000, 4096, dtype=torch.bfloat16)
    >>> storage_bytes(batch.split(100)[3])      # the whole batch stays alive
    8192000
    """
    return check_ownable(t).untyped_storage().nbytes()


def _span_elems(t: torch.Tensor) -> int:
    """Elements from the first to the last one the strides can reach (0 if empty)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _distinct(t: torch.Tensor) -> torch.Tensor:
    """``t`` with every stride-0 dimension cut to size 1: the values an ``expand`` repeats."""
    for d, (n, s) in enumerate(zip(t.shape, t.stride())):
        if s == 0 and n > 1:
            t = t.narrow(d, 0, 1)
    return t


def _distinct_elems(t: torch.Tensor) -> int:
    """``_distinct(t).numel()`` from the metadata alone."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        n *= 1 if stride == 0 and size > 1 else size
    return n


def compact_bytes(t: torch.Tensor) -> int:
    """Fewest bytes an owned copy of ``t`` needs: ``min(distinct, span)`` elements.

    distinct counts the elements of ``t`` with every stride-0 dimension cut
    to size 1: a copy of that part, expanded back to the shape, repeats the
    values for free (an ``expand`` of a column of a batch needs one column).
    span counts the elements from the first to the last one the strides
    reach; it is below distinct only for overlapping views (``unfold``), and
    a copy of the span keeps the strides.

    Parameters
    ----------
    t : torch.Tensor
        any shape and dtype, any device; dense strided.

    Returns
    -------
    int
        Bytes; 0 for an empty tensor.

    Raises
    ------
    TypeError
        ``t`` has no ordinary storage (see :func:`check_ownable`).
    ValueError
        ``t`` reaches past its storage (see :func:`check_ownable`).

    Example
    -------
    >>> compact_bytes(torch.ones(4096).expand(1000, 4096))   # one float32 row
    16384
    >>> batch = torch.zeros(1000, 4096)
    >>> compact_bytes(batch[:, 3:4].expand(-1, 4096))         # one column: 1000 floats
    4000
    >>> compact_bytes(torch.arange(16.0).unfold(0, 4, 2))     # 7 windows of 4 over 16 floats
    64
    """
    t = check_ownable(t)
    return min(_distinct_elems(t), _span_elems(t)) * t.element_size()


def storage_key(t: torch.Tensor) -> StorageKey:
    """Identity of ``t``'s storage: ``(device type, device index or -1, storage object id)``.

    The id is ``untyped_storage()._cdata``, the address of torch's storage
    object, not of its bytes: two live storages can start at one address
    with different sizes (``torch.from_numpy(a[:1])`` and
    ``torch.from_numpy(a)``), and a storage resized in place
    (``resize_``) moves its bytes but stays the same object.

    Parameters
    ----------
    t : torch.Tensor
        any shape and dtype, any device; dense strided.

    Returns
    -------
    tuple of (str, int, int)
        Equal for all views of one storage, before and after a ``resize_``
        of it; different for two live storages. A freed storage's id can be
        reused by a later one, so compare keys of live tensors only.

    Raises
    ------
    TypeError
        ``t`` has no ordinary storage (see :func:`check_ownable`).
    ValueError
        ``t`` reaches past its storage (see :func:`check_ownable`).
    """
    t = check_ownable(t)
    index = -1 if t.device.index is None else t.device.index
    return (t.device.type, index, t.untyped_storage()._cdata)


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


def _is_dataclass(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Yield every tensor in ``obj``, depth first, in container order.

    Parameters
    ----------
    obj : Any
        A tensor, or nested mappings (their values), lists, tuples, sets and
        dataclass instances holding tensors. Other leaves are skipped, never
        raised on (unlike :func:`map_tensors`).

    Yields
    ------
    torch.Tensor
        Each tensor as it is found (any shape, dtype and device); a tensor
        held twice is yielded twice.
    """
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from iter_tensors(v)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            yield from iter_tensors(v)
    elif _is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name))


def retained_bytes(tensors: torch.Tensor | Iterable[Any]) -> int:
    """Bytes of storage kept alive by ``tensors``, each storage counted once.

    Parameters
    ----------
    tensors : torch.Tensor or iterable
        A tensor, or any iterable (list, generator, dict values, dataclass…)
        of tensors and nested containers; tensors may be on any devices.
        Non-tensor leaves are skipped.

    Returns
    -------
    int
        Sum over the distinct storages (by :func:`storage_key`) of their
        ``nbytes``, as :func:`plan_ownership` counts ``retained_bytes``. A
        storage over memory torch did not allocate counts what torch sees of
        it (see :func:`storage_bytes`).

    Raises
    ------
    TypeError
        ``tensors`` is a str or bytes, or neither iterable nor a dataclass
        instance; or a tensor in it has no ordinary storage.
    ValueError
        A tensor in it reaches past its storage (see :func:`check_ownable`).

    Example
    -------
    >>> batch = torch.zeros(1000, 4096, dtype=torch.bfloat16)
    >>> retained_bytes(batch.split(100)[:2])    # two views, one storage
    8192000
    """
    if isinstance(tensors, (str, bytes)) or not (isinstance(tensors, Iterable) or _is_dataclass(tensors)):
        raise TypeError(f"expected a tensor or an iterable of tensors, got {type(tensors).__name__}")
    if isinstance(tensors, Iterable) and not isinstance(tensors, (torch.Tensor, Mapping, list, tuple, set)):
        tensors = list(tensors)  # a generator or another one-shot iterable
    seen = {storage_key(t): t.untyped_storage().nbytes() for t in iter_tensors(tensors)}
    return sum(seen.values())


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
