"""What a cached value may hold, and how the walkers read it: one rule for counting and rebuilding.

Note:
    :func:`~tpool.memory.accounting.retained_bytes`, :func:`iter_tensors`,
    :func:`leaf_bytes` and :func:`~tpool.memory.ownership.map_tensors` (hence
    ``own`` and ``OwnedCache``) walk a value by :func:`_kind`: tensors, plain
    scalars, dicts and ``UserDict``s (their values), lists, tuples, sets and
    dataclasses (fields, other attributes, slots). What one walker counts, the
    other rebuilds: :func:`leaf_bytes` charges a list, tuple, set or frozenset
    of numbers (token ids) whole, and ``map_tensors`` copies such a list or set
    once per value and keeps such a tuple or frozenset, so the charge of the
    caller's value's rebuild is the charge of what a cache stores. Bytes no
    walker reaches would stay alive uncharged, so whatever could hide them is
    refused (``TypeError``) before a cache changes: a tensor (or anything but
    small plain data) in a tensor's, a scalar subclass's or a container
    subclass's attributes (``__dict__`` and slots), and dict keys that cannot be
    charged (keys are charged like leaves: their text, big ints and tuples of
    numbers). Slots are found as member descriptors along the class's MRO, so
    name mangling, shadowing class attributes and ``__getattr__`` fallbacks
    never mislead the walk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import decimal
import enum
import fractions
import numbers
import pathlib
import sys
import types
import uuid
import zoneinfo
from collections import UserDict, defaultdict
from collections.abc import Iterator, Mapping, MappingView, Sequence, Set
from typing import Any

import numpy as np
import torch

__all__ = ["iter_tensors", "leaf_bytes"]


def _is_dataclass(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum)


# What ``_kind`` answers for these exact types (the isinstance chain gives the same, slower: an
# ``OwnedCache.get`` rebuilds its container through it on every call).
_LEAF_TYPES = frozenset((type(None), bool, int, float, complex, str, bytes))  # exact types: "leaf", nothing to read
_EXACT_KINDS = {torch.Tensor: "tensor", dict: "dict", list: "items", tuple: "items", set: "items",
                frozenset: "items", **dict.fromkeys(_LEAF_TYPES, "leaf")}

# What small plain data is (attributes; dict keys are charged instead, see _key_problem).
_ATTR_TEXT_MAX = 1024  # characters (or bytes) of a str (bytes) attribute, or of all those in one: a tag, not a payload
_ATTR_ITEMS_MAX = 64  # items in an attribute's containers, every level together: a shape or a set of dims
_ATTR_DEPTH_MAX = 2  # levels of containers in an attribute (torch._dynamo.mark_dynamic's: a set of _DimRange)
_ATTR_NUMBER_MAX = 128  # bytes (sys.getsizeof) of a number in an attribute or a key: an int of up to 780 bits
_ATTR_TUPLES = (tuple, list, set, frozenset, torch.Size)  # exact types: a subclass may hold more than its items
_FIXED_SCALARS = frozenset((type(None), bool, float, complex, torch.dtype, torch.device))  # exact types, fixed size
_SMALL_INT = 1 << 62  # an exact int below it in magnitude is small without asking its size

# Numbers in a list, tuple, set or frozenset: such a container (a request's token ids) and its numbers are charged.
_NUMBER_ITEMS = frozenset((list, tuple, set, frozenset))  # exact types (a subclass's attributes may hold more)
# exact types a value's walk takes; None too, the padding of a batch of id lists ([5, 9, None]), never charged
_NUMBERS = frozenset((int, float, complex, bool, np.float64, np.complex128, type(None)))
_KEY_NUMBERS = _NUMBERS | frozenset(t for t in np.sctypeDict.values() if issubclass(t, (np.number, np.bool_)))
_SHARED = (*range(-5, 257), True, False, None, np.True_, np.False_, ())  # one object each: not charged
_SHARED_IDS = set(map(id, _SHARED))  # (a set, not a frozenset: `kept.keys() & it` then reads the smaller)


def _numbers(items: Any, types: frozenset) -> bool:
    """Whether ``items`` is an exact list, tuple, set or frozenset (``_NUMBER_ITEMS``) whose every item is of an
    exact type in ``types``: :func:`leaf_bytes` charges such a container and its items. An empty one is one too
    (a list with no ids yet: 56 B that stay alive), but ``()``, one object the interpreter shares, is never
    charged (``_SHARED``)."""
    return type(items) in _NUMBER_ITEMS and all(map(types.__contains__, map(type, items)))


class _Numbers:
    """What :func:`_walk` yields for a list, tuple, set or frozenset of numbers (:func:`_numbers`), instead of
    its items: :func:`leaf_bytes` charges the container and its numbers."""

    __slots__ = ("items",)

    def __init__(self, items: Any):
        self.items = items


def _kind(obj: Any, check: bool = True) -> str:
    """How the walkers (:func:`iter_tensors`, hence :func:`retained_bytes` and :func:`leaf_bytes`, and
    :func:`~tpool.memory.ownership.map_tensors`) treat ``obj``: ONE rule, so what one of them counts the
    other can rebuild. ``"tensor"``, ``"leaf"`` (a plain scalar), ``"dict"`` (dict or UserDict: its
    values, and its keys as :func:`_key_problem` reads them), ``"items"`` (list, tuple, set, frozenset)
    or ``"dataclass"`` (its fields and the other attributes in its ``__dict__`` or slots, see
    :func:`_extra_attrs`); ``"dict+attrs"`` and ``"items+attrs"`` for a subclass with an attribute that
    holds one of its own items (a ``ModelOutput``: walked as those, and the rebuild points the attribute
    at the item's rebuild). Anything else raises ``TypeError``, and so do bytes the walkers would not
    reach: anything but small plain data in a tensor's own attributes (``__dict__`` and slots:
    ``t.scales = s``), in a scalar subclass's, an enum member's whose class its module does not hold, or
    a container subclass's (:func:`_attr_problem`), and a dict key that cannot be charged
    (:func:`_check_key`).

    ``check=False`` is for ``get`` (a value the cache stored, checked when it was put; a later change
    is the caller's, found by ``OwnedCache.check_invariants``): it reads no attributes or keys to check
    them, and never raises for them; a container subclass's attributes are still looked at for the one
    thing the rebuild needs, which of them are its own items."""
    kind = _EXACT_KINDS.get(type(obj))  # the common types at one dict lookup (subclasses take the chain below)
    if kind == "leaf":
        return kind
    if kind is None:
        kind = _kind_of_subclass(obj, check)
    if kind == "tensor":
        if check:
            attrs = tensor_attrs(obj)
            if attrs:
                _check_storage(obj)  # (a FakeTensor's fake_mode, a DTensor's local tensor: no storage is the cause)
                _check_attrs(attrs, "a tensor")
            base = obj._base  # a view keeps the tensor it views alive, with its attributes
            if base is not None and (attrs := tensor_attrs(base)):
                _check_attrs(attrs, "the viewed tensor", hint=(", or pass a copy or a detach() of the view (a view "
                                                                     "keeps the tensor it views alive)"))
            if attrs := storage_attrs(obj):
                _check_attrs(attrs, "the tensor's storage", hint=", or pass a copy (a copy has a storage of its own)")
        return kind
    if kind == "dict" and check:
        for k in obj:
            if type(k) is not str and type(k) is not int:  # (the common keys at two tests: _walk charges them)
                _check_key(k)
    if (kind == "dict" or kind == "items") and type(obj) not in _EXACT_KINDS:
        if _slot_members(type(obj)) or _instance_dict(obj):  # (a torch.Size, a named tuple: neither)
            attrs = _subclass_attrs(obj)
            if _check_attrs(attrs, f"a {type(obj).__name__}", obj) if check else _aliases(attrs, obj):
                kind += "+attrs"
    return kind


def _check_storage(t: torch.Tensor) -> None:
    """:func:`~tpool.memory.accounting.check_ownable`, asked before a tensor's attributes are checked: a tensor
    without ordinary storage (a FakeTensor, a DTensor: dispatch subclasses that keep their state in attributes)
    is refused for that, not for what its attributes hold."""
    from tpool.memory.accounting import check_ownable  # (accounting imports this module)
    check_ownable(t)


def storage_attrs(t: torch.Tensor) -> dict:
    """The Python attributes set on ``t``'s storage (``t.untyped_storage().extra = ...``: torch keeps the
    storage's Python object, and what it holds, alive with the tensor); {} for a tensor without one."""
    try:
        return getattr(t.untyped_storage(), "__dict__", None) or {}
    except (NotImplementedError, RuntimeError):  # (sparse, nested: refused by check_ownable)
        return {}


def tensor_attrs(t: torch.Tensor) -> dict:
    """A tensor's own Python attributes: its ``__dict__`` (a subclass's slots too)."""
    return t.__dict__ if type(t) is torch.Tensor else _own_attrs(t)


def _check_key(k: Any, what: str = "a dict key") -> None:
    """Raise ``TypeError`` if ``k``, a dict key (or ``what``: the cache's own key), holds what cannot be
    charged (:func:`_key_problem`). A key stays alive with the value: its text is charged by
    :func:`leaf_bytes` (:func:`_walk` yields it), but a tensor, an array or an object reachable from it
    would stay alive uncharged."""
    problem = _key_problem(k, [], 0)
    if problem is not None:
        raise TypeError(f"cannot count the bytes held by {what} ({problem}): a key stays alive with the "
                        "value, uncharged. Keys may be numbers, strings, bytes, None, enums, dtypes, devices, "
                        "classes their module holds, numpy scalars, UUIDs, dates and times, paths, and "
                        "tuples, frozensets and dataclasses of them (their text charged); no tensor, no array, "
                        "no other object, no class made at run time or redefined; key by "
                        "something else (an id, a string) and keep the object as a value")


_KEY_DEPTH_MAX = 100  # levels of tuples, frozensets, dataclasses and attributes in a key (a cycle stops there)
_KEY_ATOMS = frozenset((uuid.UUID, datetime.date, datetime.timedelta, datetime.timezone, zoneinfo.ZoneInfo))
_KEY_TIMES = frozenset((datetime.time, datetime.datetime))  # plain when their tzinfo is
_PATHS = frozenset((pathlib.PurePath, pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.Path,
                    pathlib.PosixPath, pathlib.WindowsPath))


def _key_problem(k: Any, out: list, depth: int) -> str | None:
    """None if dict key ``k`` can be charged, else what it holds that cannot; appends to ``out`` the
    leaves :func:`leaf_bytes` charges (its str, bytes and ints; a path's text). Chargeable: what a
    value's leaf may be (None, bool, int, float, complex, str, bytes, dtype, device), a numpy scalar of at
    most ``_ATTR_TEXT_MAX`` bytes, an enum member (:func:`_class_reachable`, else its value and attributes
    read as one more level), a class its module holds (:func:`_class_reachable`), a ``uuid.UUID``, a
    ``datetime`` date, time, datetime or timedelta (a tzinfo of ``datetime.timezone`` or ``zoneinfo``), a
    ``pathlib`` path (its ``str`` charged), a
    ``Decimal`` or a ``Fraction`` of at most ``_ATTR_NUMBER_MAX`` bytes (each part of a Fraction); a
    subclass of one of those scalars, its own attributes read as one more level; a tuple, frozenset,
    named tuple or dataclass instance of them, any size, ``_KEY_DEPTH_MAX`` levels deep at most."""
    t = type(k)
    if t is str or t is bytes or t is int:
        out.append(k)
        return None
    if t in _FIXED_SCALARS or t in _KEY_ATOMS:
        return None
    if isinstance(k, type):  # (its class attributes live with it: nothing to charge while its module holds it)
        return None if _class_reachable(k) else (f"a class made at run time ({k.__qualname__}: its module does not "
                                                  "hold it, so it lives with the key, with all it holds)")
    if depth > _KEY_DEPTH_MAX:
        return f"a {t.__name__} nested over {_KEY_DEPTH_MAX} levels"
    if t in _KEY_TIMES:
        return None if k.tzinfo is None else _key_problem(k.tzinfo, out, depth + 1)
    if t in _PATHS:
        out.append(str(k))  # (cached in the path: the object it keeps)
        return None
    if t is decimal.Decimal:
        return _number_problem(k)
    if t is fractions.Fraction:
        return _attr_problem(k, [_ATTR_ITEMS_MAX, _ATTR_TEXT_MAX], _ATTR_DEPTH_MAX)
    if isinstance(k, enum.Enum):
        items = () if _class_reachable(t) else _enum_attrs(k).values()
    elif isinstance(k, np.generic):
        if (problem := _void_problem(k)) is not None:
            return problem
        if isinstance(k, (str, bytes)):  # (numpy's str_ and bytes_: text, charged as text)
            out.append(k)
        elif k.nbytes > _ATTR_TEXT_MAX:
            return f"a numpy {t.__name__} of {k.nbytes} bytes"
        items = _own_attrs(k).values()
    elif isinstance(k, (str, bytes, int)):  # a subclass: its text or its int is charged, its attributes read
        out.append(k)
        items = _own_attrs(k).values()
    elif isinstance(k, numbers.Number):  # a subclass of float or complex, of Fraction or Decimal, ...
        if (problem := _number_problem(k)) is not None:
            return problem
        items = _own_attrs(k).values()
    elif isinstance(k, (tuple, frozenset)):
        if _numbers(k, _KEY_NUMBERS):  # a token-id prefix: charged whole
            out.append(_Numbers(k))
            return None
        items = k if t is tuple or t is frozenset else [*k, *_own_attrs(k).values()]
    elif _is_dataclass(k) and not isinstance(k, (list, set, dict, UserDict)):
        names = _field_names(t)[0]
        items = [*(getattr(k, n) for n in names), *_extra_attrs(k).values()]
    else:
        return f"a {t.__name__}"
    for x in items:
        problem = _key_problem(x, out, depth + 1)
        if problem is not None:
            return f"a {t.__name__} holding {problem}"
    return None


def _key_leaves(k: Any) -> list:
    """The leaves of dict key ``k`` that :func:`leaf_bytes` charges (``TypeError`` as :func:`_check_key`)."""
    out: list = []
    if _key_problem(k, out, 0) is not None:
        _check_key(k)
    return out


def _class_reachable(cls: type) -> bool:
    """Whether class ``cls`` lives as long as the interpreter or its module whatever a cache holds: a type
    the interpreter or a C extension made (``int``, ``NoneType``, ``_thread.lock``: a class statement
    cannot make an immutable type), or one its module holds under its qualified name now. Its
    members (of an enum) and its class attributes then stay alive anyway, and a cache keeping the class
    or a member keeps nothing alive. A class made at run time (``enum.Enum("E", ...)``, ``type("K", (),
    {...})``, a local ``class``), or one its module no longer holds (redefined, as a notebook cell run again
    does), lives only as long as what refers to it: what it holds is the cache's to charge. Asked each time,
    not remembered (a few dict look-ups): a memo would answer True for a class its module has since dropped,
    and keep it alive with all it holds."""
    if not cls.__flags__ & _HEAPTYPE or cls.__flags__ & _IMMUTABLETYPE:  # (a C extension's: _thread.lock)
        return True
    x: Any = sys.modules.get(cls.__module__)
    try:
        for part in cls.__qualname__.split("."):
            x = getattr(x, part, None)
    except Exception:  # (a module's __getattr__ may raise anything)
        x = None
    return x is cls


def _enum_attrs(member: enum.Enum) -> dict:
    """The own attributes of an enum member that its class does not give every member: ``_value_``
    and whatever was set on it (not ``_name_``, ``__objclass__``, ``_sort_order_``)."""
    return {k: v for k, v in _own_attrs(member).items() if k not in ("_name_", "__objclass__", "_sort_order_")}


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
    if isinstance(v, enum.Enum):  # a member of a class its module holds lives there, whatever it holds
        return None if _class_reachable(t) else _items_problem(v, list(_enum_attrs(v).values()), room, depth)
    if isinstance(v, (str, bytes)):  # (numpy's str_ and bytes_ too: text, counted as text)
        room[1] -= len(v)
        if room[1] < 0:
            return f"{len(v)} {type(v).__name__} (over {_ATTR_TEXT_MAX} in all)"
        return None if t is str or t is bytes else _scalar_attrs_problem(v, room, depth)
    if isinstance(v, np.generic):  # np.bool_, np.float32, np.datetime64, ...
        if (problem := _void_problem(v)) is not None:
            return problem
        if v.nbytes > _ATTR_TEXT_MAX:
            return f"a numpy {type(v).__name__} of {v.nbytes} bytes"
        return _scalar_attrs_problem(v, room, depth)  # (a subclass's own attributes; none for numpy's types)
    if isinstance(v, numbers.Number):  # a subclass of int, float or complex, a Fraction, a Decimal, ...
        return _number_problem(v) or _scalar_attrs_problem(v, room, depth)
    if t in _ATTR_TUPLES or isinstance(v, tuple) and hasattr(v, "_fields") and not hasattr(v, "__dict__"):
        items = v
    elif t is dict:
        items = [*v, *v.values()]
    elif _is_dataclass(v):  # its fields, its other slots, then its other attributes
        if isinstance(v, (list, tuple, set, frozenset, dict, UserDict)):
            return f"a {type(v).__name__} (a dataclass that is also a container: its items are not read)"
        items = [*(getattr(v, n) for n in _field_names(type(v))[0]), *_extra_attrs(v).values()]
    else:
        return f"a {type(v).__name__}"
    return _items_problem(v, items, room, depth)


def _number_problem(v: Any) -> str | None:
    """None if number ``v`` takes at most ``_ATTR_NUMBER_MAX`` bytes (``sys.getsizeof``), else what it is."""
    n = sys.getsizeof(v)
    return None if n <= _ATTR_NUMBER_MAX else f"a {type(v).__name__} of {n} bytes (over {_ATTR_NUMBER_MAX})"


def _void_problem(v: np.generic) -> str | None:
    """What a numpy scalar holds that cannot be charged: a structured array's row is a view that keeps the
    whole array alive, and an object field holds anything; None for any other numpy scalar."""
    if isinstance(v, np.void) and (v.base is not None or v.dtype.hasobject):
        return "a numpy void " + ("viewing an array" if v.base is not None else "with object fields")
    return None


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
    """:func:`_attr_problem` of the own attributes (``__dict__`` and slots) of a scalar that is not of an
    exact plain type (an instance of ``class I(int)``, of a numpy scalar subclass; a ``Fraction``: its
    numerator and denominator, in slots): None when it has none."""
    attrs = _own_attrs(v)
    return _items_problem(v, list(attrs.values()), room, depth) if attrs else None


_SLOTS: dict[type, tuple] = {}  # class -> _slot_members(class): a dict lookup on the get path
_SLOTS_MAX = 4096  # classes remembered; past it the memo starts again (classes made at run time)
_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by a class statement (C types' members are fields)
_IMMUTABLETYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE: a C extension's heap type (never a class statement's)


def _slot_members(cls: type) -> tuple:
    """The slots of ``cls`` and its bases: the ``types.MemberDescriptorType`` objects in each class
    ``__dict__`` along the MRO that a class statement made (``__slots__``, ``dataclass(slots=True)``;
    not a C type's fields such as ``complex.real``). Read from the descriptors, not rebuilt from
    ``__slots__`` (an iterator, reassigned after the class was made, a ``__private`` name mangled by the
    class name, or shadowed by a subclass's class attribute). Read one with :func:`_slot_values`, write
    it with ``d.__set__(new, value)``. Remembered in ``_SLOTS`` for a class :func:`_class_reachable` finds
    (not one made at run time: the memo would keep it alive): always ask through this function, the memo
    may have been cleared since."""
    members = _SLOTS.get(cls)
    if members is None:
        members = _remember(_SLOTS, cls, tuple(d for c in cls.__mro__ if c.__flags__ & _HEAPTYPE
                                               for d in vars(c).values() if type(d) is types.MemberDescriptorType))
    return members


def _remember(memo: dict, cls: type, value: Any) -> Any:
    """``value``, kept in ``memo`` under ``cls`` if :func:`_class_reachable` finds the class (not one made at
    run time: the memo would keep it alive, with all it holds); a memo of ``_SLOTS_MAX`` classes starts again."""
    if _class_reachable(cls):
        if len(memo) >= _SLOTS_MAX:
            memo.clear()
        memo[cls] = value
    return value


def _slot_values(obj: Any, members: tuple) -> list[tuple[Any, Any]]:
    """``(descriptor, value)`` of each of ``members`` (:func:`_slot_members`) set on ``obj``; an unset slot
    (``AttributeError``) is left out. Read through the descriptor: no ``__getattr__`` fallback, no class
    attribute that shadows it."""
    found = []
    for d in members:
        try:
            found.append((d, d.__get__(obj, type(obj))))
        except AttributeError:
            pass
    return found


def _instance_dict(obj: Any) -> dict | None:
    """``obj.__dict__``, or None where it has none (read past ``__getattr__``, which may raise anything)."""
    try:
        return _getattribute(obj, "__dict__")
    except AttributeError:
        return None


_getattribute = object.__getattribute__


def _own_attrs(obj: Any) -> dict:
    """The instance attributes of ``obj``: its ``__dict__`` and its set slots (name -> value; a slot whose
    name the ``__dict__`` also has is named ``Class.name``)."""
    attrs = _instance_dict(obj) or {}
    members = _slot_members(type(obj))
    if members:
        attrs = dict(attrs)
        for d, x in _slot_values(obj, members):
            attrs[d.__name__ if d.__name__ not in attrs else f"{d.__objclass__.__qualname__}.{d.__name__}"] = x
    return attrs


_FIELDS: dict[type, tuple] = {}  # dataclass -> _field_names(class), for the classes its module holds


def _field_names(cls: type) -> tuple[tuple[str, ...], tuple]:
    """The field names of dataclass ``cls`` (``dataclasses.fields`` costs ~1 µs a call), and its other
    slots (:func:`_slot_members` no field names: a ``__slots__`` base's; they hold values no field names).
    Remembered for a class :func:`_class_reachable` finds (not one made at run time, which the memo would
    keep alive after the cache let it go, with its class attributes: a field's default)."""
    found = _FIELDS.get(cls)
    if found is None:
        names = tuple(f.name for f in dataclasses.fields(cls))
        found = _remember(_FIELDS, cls, (names, tuple(d for d in _slot_members(cls) if d.__name__ not in names)))
    return found


def _subclass_attrs(obj: Any) -> dict:
    """The instance attributes (``__dict__`` and slots) of a dict, UserDict, list, tuple or set subclass
    (a UserDict's items, ``data``, are walked as its values, not here)."""
    attrs = _own_attrs(obj)
    return {k: v for k, v in attrs.items() if k != "data"} if isinstance(obj, UserDict) else attrs


def _aliases(attrs: dict, container: Any) -> bool:
    """Whether an attribute in ``attrs`` of a container subclass is one of its own items (not a scalar):
    what :func:`_check_attrs` answers for a value it passed, without checking anything (``get``)."""
    own = None
    for v in attrs.values():
        t = type(v)
        if t in _FIXED_SCALARS or t is int or t is str or t is bytes:
            continue
        if own is None:
            own = {id(x) for x in (container.values() if isinstance(container, (dict, UserDict)) else container)}
        if id(v) in own:
            return True
    return False


def _kind_of_subclass(obj: Any, check: bool = True) -> str:
    """:func:`_kind` of an object whose exact type is not in ``_EXACT_KINDS`` (``check``: read a scalar
    subclass's own attributes)."""
    if isinstance(obj, torch.Tensor):
        return "tensor"
    if isinstance(obj, _LEAVES):
        if not check:
            return "leaf"
        if isinstance(obj, enum.Enum):  # a member of a class its module holds lives there, whatever it holds
            if not _class_reachable(type(obj)):
                attrs = _enum_attrs(obj)
                _check_attrs(attrs, f"a {type(obj).__name__} member (its class made at run time)",
                             hint=", or define the enum at module level")
            return "leaf"
        attrs = _own_attrs(obj)  # a subclass of int, float, complex, str or bytes: its attributes stay too
        if attrs:
            base = next(b for b in (int, float, complex, str, bytes) if isinstance(obj, b))
            _check_attrs(attrs, f"a {type(obj).__name__}", hint=f", or pass {base.__name__}(value)")
        return "leaf"
    if isinstance(obj, (dict, UserDict)):  # a shallow copy of either has its own items
        factory = getattr(obj, "default_factory", None) if isinstance(obj, defaultdict) else None
        if check and factory is not None and not isinstance(factory, type):  # (a copy keeps the factory too)
            raise TypeError(f"cannot count the bytes held by a {type(obj).__name__}'s default_factory (a "
                            f"{type(factory).__name__}): what it reaches would stay alive uncharged; pass "
                            "dict(value), or a class (list, int, ...) as the factory")
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
    extra = {k: v for k, v in (_instance_dict(obj) or {}).items() if k not in names}
    for d, x in _slot_values(obj, slots):
        extra[d.__name__ if d.__name__ not in extra else f"{d.__objclass__.__qualname__}.{d.__name__}"] = x
    return extra


@contextlib.contextmanager
def walking():
    """Around a walk of a value (:func:`_walk`, ``ownership._map``): a value that holds itself (a list
    inside itself), or is nested past Python's recursion limit, raises the walkers' ``TypeError``, not
    a ``RecursionError`` from deep inside."""
    try:
        yield
    except RecursionError:
        raise TypeError("cannot count the bytes of a value that holds itself (a container inside itself) or "
                        "is nested too deeply for Python's recursion limit") from None


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
        than dict or ``UserDict``, ...): its bytes could not be counted; a
        value that holds itself (:func:`walking`).
    """
    with walking():
        for x in _walk(obj):
            if isinstance(x, torch.Tensor):
                yield x


def _walk(obj: Any) -> Iterator[Any]:
    """Every tensor and plain scalar in ``obj``, depth first, in container order (the rule of :func:`_kind`),
    and the leaves of each dict key that :func:`leaf_bytes` charges (:func:`_key_problem`), before its value; a
    list, tuple, set or frozenset of numbers (:func:`_numbers`) as one :class:`_Numbers`, not its items."""
    kind = _kind(obj)
    if kind in ("tensor", "leaf"):
        yield obj
    elif kind == "dict" or kind == "dict+attrs":
        for k, v in obj.items():
            if type(k) is str or type(k) is int:  # a key stays alive with the value: its text is charged
                yield k
            else:
                yield from _key_leaves(k)
            if type(v) in _LEAF_TYPES:  # (a scalar at one set lookup, no generator)
                yield v
            else:
                yield from _walk(v)
    elif kind == "items" or kind == "items+attrs":
        if _numbers(obj, _NUMBERS):  # (100,000 token ids: one yield, not 100,000)
            yield _Numbers(obj)
            return
        for v in obj:
            if type(v) in _LEAF_TYPES:
                yield v
            else:
                yield from _walk(v)
    elif kind == "dataclass":
        for f in dataclasses.fields(obj):
            yield from _walk(getattr(obj, f.name))
        for v in _extra_attrs(obj).values():
            yield from _walk(v)


def leaf_bytes(obj: Any) -> int:
    """Bytes of what a cache keeping ``obj`` keeps alive besides tensor storages, ``sys.getsizeof``, each
    object once (by identity): among the leaves of ``obj`` and among its dict keys (a tuple of them, a path's
    text too: see :func:`_key_problem`), the ``str`` and ``bytes`` objects and the ints over
    ``_ATTR_NUMBER_MAX`` bytes; and each list, tuple, set or frozenset of numbers (every item an int, float,
    complex or bool, or a numpy scalar where a dict key may hold one: a request's token ids; None among them, a
    padding; an empty one too), with each of its numbers, except the objects CPython shares (the ints -5..256,
    True, False, None and ``()``; numpy's two bools). Other scalars (a smaller int, a float, None, a dtype
    alone, ...) are a few dozen bytes each, and the value's structure (its dicts, and its lists holding
    tensors, text or other containers) a few dozen per container: not counted.

    Parameters
    ----------
    obj : Any
        A tensor, a plain scalar, or a container as :func:`iter_tensors` takes.

    Returns
    -------
    int
        0 when ``obj`` holds none of those.

    Raises
    ------
    TypeError
        As :func:`iter_tensors`.

    Note
    ----
    ``OwnedCache`` charges the value it stores, a rebuild of ``obj`` (:func:`~tpool.memory.ownership.map_tensors`):
    its lists and sets are copies, each copied once however often ``obj`` holds it, sized as ``list(items)``
    sizes them (a list grown by ``append`` may hold more spare room: 800,984 B for 100,000 ids, its copy
    800,056), and its tuples and frozensets of numbers are ``obj``'s own objects.

    Example
    -------
    >>> leaf_bytes({"ids": torch.zeros(4), "jpeg": bytes(1 << 20)}) >= 1 << 20
    True
    >>> leaf_bytes({"ids": list(range(255, 259))})  # "ids" 52, the list 88, the ints 257 and 258 (28 each)
    196
    """
    kept = {}  # id -> the object (held, so that no id is reused while counting)
    numbers = False
    with walking():
        for x in _walk(obj):
            t = type(x)
            if t is int and -_SMALL_INT < x < _SMALL_INT or t is torch.Tensor:  # (the common leaves at two tests)
                continue
            if t is _Numbers:  # a list of 100,000 token ids: 800 KB, and 2.8 MB of int objects
                kept[id(x.items)] = x.items
                kept.update(zip(map(id, x.items), x.items))  # (at C speed; the shared objects are dropped below)
                numbers = True
            elif isinstance(x, (str, bytes)) or isinstance(x, int) and sys.getsizeof(x) > _ATTR_NUMBER_MAX:
                kept[id(x)] = x  # 10**100000: 41 KiB
    if numbers:
        for i in kept.keys() & _SHARED_IDS:
            del kept[i]
    return sum(map(sys.getsizeof, kept.values()))
