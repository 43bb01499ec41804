"""What bytes a tensor keeps alive, and how they are counted.

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

    A storage that is not resizable (``untyped_storage().resizable()`` is
    False) wraps memory torch did not allocate: ``torch.from_numpy``,
    ``torch.frombuffer``, ``torch.from_dlpack``, ``torch.load(mmap=True)``.
    Its ``nbytes`` covers only the wrapped part while the owner's whole
    buffer stays alive (a row of a numpy array keeps the array), so its true
    size is unknown. ``torch.empty`` and ``share_memory_()`` storages are
    resizable. ``pin_memory()`` makes a pinned storage that is not resizable
    but is torch's own, sized to the tensor.

    Storage identity is the storage object (``untyped_storage()._cdata``),
    not its address: two live storages can start at one address
    (``torch.from_numpy(a[:1])`` and ``torch.from_numpy(a)``). A tensor whose
    offset and strides reach past its storage (shrunk or freed under it by
    ``untyped_storage().resize_``) raises ``ValueError``. Tensors without
    ordinary storage (sparse, mkldnn, meta, nested, quantized, dispatch
    subclasses) raise ``TypeError``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["payload_bytes", "storage_bytes", "compact_bytes", "storage_key", "retained_bytes", "iter_tensors",
           "check_ownable"]

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


def _distinct_elems(t: torch.Tensor) -> int:
    """Elements of ``t`` with every stride-0 dimension cut to size 1 (what an ``expand`` repeats), from the
    metadata alone: ``tpool.memory.ownership._distinct(t).numel()``."""
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


def _is_dataclass(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Yield every tensor in ``obj``, depth first, in container order.

    Parameters
    ----------
    obj : Any
        A tensor, or nested mappings (their values), lists, tuples, sets and
        dataclass instances holding tensors. Other leaves are skipped, never
        raised on (unlike :func:`~tpool.memory.ownership.map_tensors`).

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
        ``nbytes``, as :func:`~tpool.memory.ownership.plan_ownership` counts
        ``retained_bytes``. A storage over memory torch did not allocate counts
        what torch sees of it (see :func:`storage_bytes`).

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
