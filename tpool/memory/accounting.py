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
    but is torch's own; it is counted at its ``nbytes``, though torch's
    pinned-memory allocator rounds each block up to a power of two (up to 2x
    behind it). Known gap (CUDA hosts): any pinned storage counts as torch's,
    so a ``from_numpy`` view into memory registered with
    ``cudaHostRegister`` is counted, and kept, at its own bytes.

    Storage identity is the storage object (``untyped_storage()._cdata``),
    not its address: two live storages can start at one address
    (``torch.from_numpy(a[:1])`` and ``torch.from_numpy(a)``). Bytes kept
    alive are counted by address, though: where two storage objects on one
    cpu or cuda device cover the same memory (``t`` and
    ``torch.from_numpy(t.numpy())``, ``torch.from_dlpack(t)``), their byte
    ranges are merged and the memory counts once. A tensor whose
    offset and strides reach past its storage (shrunk or freed under it by
    ``untyped_storage().resize_``) raises ``ValueError``. Tensors without
    ordinary storage (sparse, mkldnn, meta, nested, quantized, dispatch
    subclasses) raise ``TypeError``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import numbers
import sys
from collections import UserDict
from collections.abc import Iterable, Iterator, Mapping, MappingView, Sequence, Set
from typing import Any

import numpy as np
import torch

from tpool._checks import storage_spans

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


_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum)


# What ``_kind`` answers for these exact types (the isinstance chain gives the same, slower: an
# ``OwnedCache.get`` rebuilds its container through it on every call).
_EXACT_KINDS = {torch.Tensor: "tensor", dict: "dict", list: "items", tuple: "items", set: "items",
                frozenset: "items", **dict.fromkeys((type(None), bool, int, float, complex, str, bytes), "leaf")}


def _kind(obj: Any, check: bool = True) -> str:
    """How the walkers (:func:`iter_tensors`, hence :func:`retained_bytes`, and
    :func:`~tpool.memory.ownership.map_tensors`) treat ``obj``: ONE rule, so what one of them counts the
    other can rebuild. ``"tensor"``, ``"leaf"`` (a plain scalar), ``"dict"`` (dict or UserDict: its
    values), ``"items"`` (list, tuple, set, frozenset) or ``"dataclass"`` (its fields and the other
    attributes in its ``__dict__`` or slots, see :func:`_extra_attrs`); ``"dict+attrs"`` and ``"items+attrs"``
    for a subclass with an attribute that holds one of its own items (a ``ModelOutput``: walked as
    those, and the rebuild points the attribute at the item's rebuild); anything else raises ``TypeError``, and
    so do bytes the walkers would not reach: anything but small plain data in a tensor's attributes
    (``t.scales = s``), in a scalar subclass's or a container subclass's own attributes (``__dict__``
    and ``__slots__``) or in a dict's keys (:func:`_attr_problem`). ``check=False`` skips a tensor's and a
    scalar subclass's attributes and the dict keys: for a value the cache stored, checked when it was put
    (a later change of them is the caller's, found by ``OwnedCache.check_invariants``), so a ``get`` does
    not read them again (a container subclass's attributes are read still: the rebuild needs them)."""
    kind = _EXACT_KINDS.get(type(obj))  # the common types at one dict lookup (subclasses take the chain below)
    if kind is None:
        kind = _kind_of_subclass(obj, check)
    if kind == "tensor":
        if check and obj.__dict__:
            _check_attrs(obj.__dict__, "a tensor")
        return kind
    if kind == "dict" and check:
        for k in obj:
            if type(k) is not str or len(k) > _ATTR_TEXT_MAX:  # (a short str, the common key, at one test)
                _check_key(k)
    if kind in ("dict", "items") and type(obj) not in _EXACT_KINDS:
        slots = _SLOTS.get(type(obj))
        if slots is None:
            slots = _slot_names(type(obj))
        if (slots or getattr(obj, "__dict__", None)) and _check_attrs(  # (a torch.Size, a named tuple: neither)
                _subclass_attrs(obj), f"a {type(obj).__name__}", obj):
            kind += "+attrs"
    return kind


def _check_key(k: Any) -> None:
    """Raise ``TypeError`` unless dict key ``k`` is small plain data (:func:`_attr_problem`). A key stays
    alive with the value, and no walker reads keys: a tensor reachable from one (itself, in a tuple, in
    an object's attributes) would stay alive uncharged. Keys are names, so they are held to what an
    attribute may hold rather than walked."""
    problem = _attr_problem(k, [_ATTR_ITEMS_MAX, _ATTR_TEXT_MAX], _ATTR_DEPTH_MAX)
    if problem is not None:
        raise TypeError(f"cannot count the bytes held by a dict key ({problem}): a key stays alive with the "
                        "value, uncharged. Dict keys may be small plain data only, as attributes (numbers, numpy "
                        "scalars, None, enums, strings and tuples of them; no tensor, no other object); key by "
                        "something else (an id, a string) and keep the object as a value")


_ATTR_TEXT_MAX = 1024  # characters (or bytes) of a str (bytes) attribute, or of all those in one: a tag, not a payload
_ATTR_ITEMS_MAX = 64  # items in an attribute's containers, every level together: a shape or a set of dims
_ATTR_DEPTH_MAX = 2  # levels of containers in an attribute (torch._dynamo.mark_dynamic's: a set of _DimRange)
_ATTR_NUMBER_MAX = 128  # bytes (sys.getsizeof) of a number in an attribute or a key: an int of up to 780 bits
_ATTR_TUPLES = (tuple, list, set, frozenset, torch.Size)  # exact types: a subclass may hold more than its items
_FIXED_SCALARS = frozenset((type(None), bool, float, complex, torch.dtype, torch.device))  # exact types, fixed size
_SMALL_INT = 1 << 62  # an exact int below it in magnitude is small without asking its size
_UNSET = object()


def _check_attrs(attrs: dict, what: str, container: Any = None, hint: str = "") -> bool:
    """Python attributes of a tensor, of a scalar subclass or of a container subclass (``__dict__`` and
    ``__slots__``) stay alive with it but no walker charges them: only small plain data may be there
    (see :func:`_attr_problem`), or, for a ``container``, one of its own items (a dict's values)
    itself: a transformers ``ModelOutput`` keeps each item as an attribute too; the walk charges it as
    an item, and ``map_tensors`` rebuilds the attribute with it. Returns whether some attribute is one
    of those items. ``hint`` ends the error message (what to pass instead)."""
    own = None
    aliased = False
    for name, v in attrs.items():
        t = type(v)  # (the common cases first, at a set lookup or two compares: a flag, a count, a dtype)
        if t in _FIXED_SCALARS or t is int and -_SMALL_INT < v < _SMALL_INT:
            continue
        problem = _attr_problem(v, [_ATTR_ITEMS_MAX, _ATTR_TEXT_MAX], _ATTR_DEPTH_MAX)
        if problem is None:
            continue
        if container is not None:
            if own is None:
                own = {id(x) for x in (container.values() if isinstance(container, (dict, UserDict)) else container)}
            if id(v) in own:
                aliased = True
                continue
        if not hint and container is not None:
            hint = ", or pass dict(value) or list(value)"
        raise TypeError(f"cannot count the bytes held in {what}'s attributes ({name!r} holds {problem}): they "
                        f"would stay alive uncharged. Attributes may hold scalars (numbers of at most "
                        f"{_ATTR_NUMBER_MAX} bytes, numpy scalars, None, dtypes, devices, enums, strings of at most "
                        f"{_ATTR_TEXT_MAX}) and tuples, lists, sets, dicts and dataclasses of them ({_ATTR_ITEMS_MAX} "
                        f"items, {_ATTR_DEPTH_MAX} levels and {_ATTR_TEXT_MAX} characters at most)"
                        + ("" if container is None else ", or one of its own items")
                        + "; put the rest beside it in a dict or a dataclass" + hint)
    return aliased


def _attr_problem(v: Any, room: list[int], depth: int) -> str | None:
    """None if ``v`` is small plain data, else what it holds that is not. Plain: None, a bool, a float, a
    complex, a dtype, a device, an enum member; an int or another number of at most ``_ATTR_NUMBER_MAX``
    bytes (``sys.getsizeof``), a numpy scalar of at most ``_ATTR_TEXT_MAX`` bytes, a str or bytes; a
    subclass of one of those (or a ``Fraction``, any ``numbers.Number``) only if its own attributes
    (``__dict__`` and ``__slots__``) are plain too, read as one more level; or, ``depth`` levels deep at
    most, a tuple, list, set, frozenset, ``torch.Size``, named tuple, dict (keys and values) or dataclass
    instance (fields, slots and ``__dict__``) of them. ``room`` is what is left of the items and of the
    characters (or bytes) of text, shared by every level of one attribute; it shrinks as ``v`` is read."""
    t = type(v)
    if t in _FIXED_SCALARS:
        return None
    if t is int:
        n = sys.getsizeof(v)
        return None if n <= _ATTR_NUMBER_MAX else f"an int of {n} bytes (over {_ATTR_NUMBER_MAX})"
    if isinstance(v, enum.Enum):  # a member lives in its class, whatever the value holds
        return None
    if isinstance(v, (str, bytes)):  # (numpy's str_ and bytes_ too: text, counted as text)
        room[1] -= len(v)
        if room[1] < 0:
            return f"{len(v)} {type(v).__name__} (over {_ATTR_TEXT_MAX} in all)"
        return None if t is str or t is bytes else _scalar_attrs_problem(v, room, depth)
    if isinstance(v, np.generic):  # np.bool_, np.float32, np.datetime64, ...
        if isinstance(v, np.void) and (v.base is not None or v.dtype.hasobject):
            # a structured array's row is a view that keeps the whole array alive; an object field holds anything
            return "a numpy void " + ("viewing an array" if v.base is not None else "with object fields")
        return None if v.nbytes <= _ATTR_TEXT_MAX else f"a numpy {type(v).__name__} of {v.nbytes} bytes"
    if isinstance(v, numbers.Number):  # a subclass of int, float or complex, a Fraction, a Decimal, ...
        n = sys.getsizeof(v)
        if n > _ATTR_NUMBER_MAX:
            return f"a {type(v).__name__} of {n} bytes (over {_ATTR_NUMBER_MAX})"
        return _scalar_attrs_problem(v, room, depth)
    if t in _ATTR_TUPLES or isinstance(v, tuple) and hasattr(v, "_fields") and not hasattr(v, "__dict__"):
        items = v
    elif t is dict:
        items = [*v, *v.values()]
    elif _is_dataclass(v):  # its fields, its other slots, then its other attributes
        if isinstance(v, (list, tuple, set, frozenset, dict, UserDict)):
            return f"a {type(v).__name__} (a dataclass that is also a container: its items are not read)"
        names, slots = _field_names(type(v))
        items = [*(getattr(v, n) for n in names), *(getattr(v, n) for n in slots if hasattr(v, n)),
                 *(x for k, x in (getattr(v, "__dict__", None) or {}).items() if k not in names)]
    else:
        return f"a {type(v).__name__}"
    return _items_problem(v, items, room, depth)


def _items_problem(v: Any, items: Any, room: list[int], depth: int) -> str | None:
    """:func:`_attr_problem` of ``items``, what ``v`` holds, one level down."""
    if depth == 0:
        return f"a {type(v).__name__} nested over {_ATTR_DEPTH_MAX} levels"
    room[0] -= len(items)
    if room[0] < 0:
        return f"a {type(v).__name__} (its attribute holds over {_ATTR_ITEMS_MAX} items in all)"
    for x in items:
        problem = _attr_problem(x, room, depth - 1)
        if problem is not None:
            return f"a {type(v).__name__} holding {problem}"
    return None


def _scalar_attrs_problem(v: Any, room: list[int], depth: int) -> str | None:
    """:func:`_attr_problem` of the own attributes (``__dict__`` and ``__slots__``) of a scalar that is not
    of an exact plain type (``class I(int)``, a ``Fraction``'s numerator): None when it has none."""
    attrs = _own_attrs(v)
    return _items_problem(v, list(attrs.values()), room, depth) if attrs else None


_SLOTS: dict[type, tuple[str, ...]] = {}  # class -> _slot_names(class): a dict lookup on the get path
_SLOTS_MAX = 4096  # classes remembered; past it the memo starts again (classes made at run time)


def _slot_names(cls: type) -> tuple[str, ...]:
    """The names of the ``__slots__`` that ``cls`` and its bases declare (mangled as Python stores a
    ``__private`` one), ``__dict__`` and ``__weakref__`` left out; remembered in ``_SLOTS``."""
    names = _SLOTS.get(cls)
    if names is None:
        if len(_SLOTS) >= _SLOTS_MAX:
            _SLOTS.clear()
        names = _SLOTS[cls] = _declared_slots(cls)
    return names


def _declared_slots(cls: type) -> tuple[str, ...]:
    names: list[str] = []
    for c in cls.__mro__:
        declared = c.__dict__.get("__slots__", ())
        for n in (declared,) if isinstance(declared, str) else declared:
            if n.startswith("__") and not n.endswith("__"):
                n = f"_{c.__name__.lstrip('_')}{n}"
            if n not in ("__dict__", "__weakref__") and n not in names:
                names.append(n)
    return tuple(names)


def _own_attrs(obj: Any) -> dict:
    """The instance attributes of ``obj``: its ``__dict__`` and its set ``__slots__`` (name -> value)."""
    attrs = getattr(obj, "__dict__", None) or {}
    slots = _slot_names(type(obj))
    if slots:
        attrs = dict(attrs)
        for n in slots:
            x = getattr(obj, n, _UNSET)
            if x is not _UNSET:
                attrs[n] = x
    return attrs


@functools.lru_cache(maxsize=256)
def _field_names(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The field names of dataclass ``cls`` (``dataclasses.fields`` costs ~1 µs a call), and the names of
    its other slots (a ``__slots__`` base's: they hold values no field names)."""
    names = tuple(f.name for f in dataclasses.fields(cls))
    return names, tuple(n for n in _slot_names(cls) if n not in names)


def _subclass_attrs(obj: Any) -> dict:
    """The instance attributes (``__dict__`` and ``__slots__``) of a dict, UserDict, list, tuple or set
    subclass (a UserDict's items, ``data``, are walked as its values, not here)."""
    attrs = _own_attrs(obj)
    return {k: v for k, v in attrs.items() if k != "data"} if isinstance(obj, UserDict) else attrs


def _kind_of_subclass(obj: Any, check: bool = True) -> str:
    """:func:`_kind` of an object whose exact type is not in ``_EXACT_KINDS`` (``check``: read a scalar
    subclass's own attributes)."""
    if isinstance(obj, torch.Tensor):
        return "tensor"
    if isinstance(obj, _LEAVES):
        if check and not isinstance(obj, enum.Enum):  # (an enum member lives in its class, whatever it holds)
            attrs = _own_attrs(obj)  # a subclass of int, float, complex, str or bytes: its attributes stay too
            if attrs:
                base = next(b for b in (int, float, complex, str, bytes) if isinstance(obj, b))
                _check_attrs(attrs, f"a {type(obj).__name__}", hint=f", or pass {base.__name__}(value)")
        return "leaf"
    if isinstance(obj, (dict, UserDict)):  # a shallow copy of either has its own items
        return "dict"
    if isinstance(obj, (list, tuple, set, frozenset)):
        return "items"
    if _is_dataclass(obj):
        return "dataclass"
    if isinstance(obj, Mapping):
        raise TypeError(f"cannot rebuild a {type(obj).__name__}: expected a dict or a collections.UserDict "
                        "(a copy of another mapping could share the caller's items); pass dict(value)")
    raise TypeError(
        f"cannot count the bytes held by a {type(obj).__name__}; expected tensors in dicts, "
        "lists, tuples, sets or dataclasses, with scalar leaves"
        + ("; pass list(value)" if isinstance(obj, (Sequence, Set, MappingView)) else "")
    )


def _extra_attrs(obj: Any) -> dict[str, Any]:
    """The attributes of dataclass instance ``obj`` outside its fields: what ``__post_init__`` set, a
    ``functools.cached_property`` result (name -> value, from the instance ``__dict__``), then the set
    slots no field names (a ``__slots__`` base's); ``copy.copy`` carries them, so the walkers go into
    them like fields."""
    names, slots = _field_names(type(obj))
    extra = {k: v for k, v in (getattr(obj, "__dict__", None) or {}).items() if k not in names}
    for n in slots:
        x = getattr(obj, n, _UNSET)
        if x is not _UNSET:
            extra[n] = x
    return extra


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Yield every tensor in ``obj``, depth first, in container order.

    Parameters
    ----------
    obj : Any
        A tensor, a plain scalar, or a container as
        :func:`~tpool.memory.ownership.map_tensors` accepts: dicts and
        ``UserDict``s (their values), lists, tuples, sets and dataclass
        instances (their fields, then the other attributes in their
        ``__dict__``: set in ``__post_init__``, ``cached_property``
        results), nested.

    Yields
    ------
    torch.Tensor
        Each tensor as it is found (any shape, dtype and device); a tensor
        held twice is yielded twice.

    Raises
    ------
    TypeError
        A leaf or container that :func:`~tpool.memory.ownership.map_tensors`
        refuses (a numpy array, a deque, an ``nn.Module``, a mapping other
        than dict or ``UserDict``, ...): its bytes could not be counted.
    """
    return (x for x in _walk(obj) if isinstance(x, torch.Tensor))


def _walk(obj: Any) -> Iterator[Any]:
    """Every tensor and plain scalar in ``obj``, depth first, in container order (the rule of :func:`_kind`)."""
    kind = _kind(obj)
    if kind in ("tensor", "leaf"):
        yield obj
    elif kind == "dict" or kind == "dict+attrs":
        for v in obj.values():
            yield from _walk(v)
    elif kind == "items" or kind == "items+attrs":
        for v in obj:
            yield from _walk(v)
    elif kind == "dataclass":
        for f in dataclasses.fields(obj):
            yield from _walk(getattr(obj, f.name))
        for v in _extra_attrs(obj).values():
            yield from _walk(v)


def leaf_bytes(obj: Any) -> int:
    """Bytes of the ``str`` and ``bytes`` objects and of the ints over ``_ATTR_NUMBER_MAX`` bytes among
    the leaves of ``obj`` (``sys.getsizeof``, each object once): what a cache keeping ``obj`` keeps alive
    besides tensor storages. Other scalars (smaller ints, floats, None, dtypes, ...) are a few dozen
    bytes each and not counted.

    Parameters
    ----------
    obj : Any
        A tensor, a plain scalar, or a container as :func:`iter_tensors` takes.

    Returns
    -------
    int
        0 when ``obj`` holds no ``str`` or ``bytes``.

    Raises
    ------
    TypeError
        As :func:`iter_tensors`.

    Example
    -------
    >>> leaf_bytes({"ids": torch.zeros(4), "jpeg": bytes(1 << 20)}) >= 1 << 20
    True
    """
    sizes = {}
    for x in _walk(obj):
        if isinstance(x, (str, bytes)):
            sizes[id(x)] = sys.getsizeof(x)
        elif isinstance(x, int) and not -_SMALL_INT < x < _SMALL_INT and sys.getsizeof(x) > _ATTR_NUMBER_MAX:
            sizes[id(x)] = sys.getsizeof(x)  # 10**100000: 41 KiB
    return sum(sizes.values())


def _alive_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors`` (one tensor per storage object), memory that two
    storage objects cover counted once: on a cpu or cuda device the byte ranges are merged (a
    storage's range is where its bytes are now); elsewhere ``data_ptr`` need not be an address,
    so each storage counts whole."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    total = 0
    for t in tensors:
        if t.device.type in ("cpu", "cuda"):
            by_device.setdefault(t.device, []).append(t)
        else:
            total += t.untyped_storage().nbytes()
    for same_device in by_device.values():
        spans = storage_spans(same_device)  # start -> end, the longest per start
        reach = 0  # the furthest end so far: what lies before it is counted
        for lo in sorted(spans):
            total += max(0, spans[lo] - max(lo, reach))
            reach = max(reach, spans[lo])
    return total


def retained_bytes(tensors: torch.Tensor | Iterable[Any]) -> int:
    """Bytes of storage kept alive by ``tensors``, each storage (and each byte of memory) counted once.

    Parameters
    ----------
    tensors : torch.Tensor or iterable
        A tensor, or a container of tensors and plain scalars as
        :func:`~tpool.memory.ownership.map_tensors` accepts (dicts,
        ``UserDict``s, lists, tuples, sets, dataclasses, nested); at the top
        level also a generator or another iterator, or a dict view
        (``d.values()``), read into a list first. Tensors may be on any
        devices.

    Returns
    -------
    int
        Sum over the distinct storages (by :func:`storage_key`) of their
        ``nbytes``, as :func:`~tpool.memory.ownership.plan_ownership` counts
        ``retained_bytes``; where two storage objects cover the same memory
        of a cpu or cuda device (``t`` and ``torch.from_numpy(t.numpy())``,
        ``torch.from_dlpack(t)``) that memory counts once. A storage over
        memory torch did not allocate counts what torch sees of it (see
        :func:`storage_bytes`).

    Raises
    ------
    TypeError
        ``tensors`` is a plain scalar (str, bytes, int, None, ...); or a leaf
        or container in it that :func:`~tpool.memory.ownership.map_tensors`
        refuses (a numpy array, a deque, a ``UserList``, an ``nn.Module``,
        a dict view inside a container, ...), as ``OwnedCache.put`` refuses
        it; or a tensor in it has no ordinary storage.
    ValueError
        A tensor in it reaches past its storage (see :func:`check_ownable`).

    Example
    -------
    >>> batch = torch.zeros(1000, 4096, dtype=torch.bfloat16)
    >>> retained_bytes(batch.split(100)[:2])    # two views, one storage
    8192000
    >>> retained_bytes([batch, torch.from_numpy(batch.view(torch.int16).numpy())])  # one memory, two storages
    8192000
    """
    if isinstance(tensors, (Iterator, MappingView)):
        tensors = list(tensors)  # a generator or another one-shot iterable, or d.values()
    if isinstance(tensors, _LEAVES):
        raise TypeError(f"expected a tensor or an iterable of tensors, got {type(tensors).__name__}")
    seen = {storage_key(t): t for t in iter_tensors(tensors)}
    return _alive_bytes(seen.values())
