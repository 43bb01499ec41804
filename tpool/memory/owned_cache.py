"""A byte-budgeted key -> tensor cache that owns (compacts) what it admits.

Note:
    Admission (``put``) runs in this order, so memory never peaks at
    budget + entry + copy and nothing is copied for an entry that is refused:

    1. duplicate key: no-op (no copy, old value kept), recency refreshed;
    2. plan (:func:`tpool.memory.ownership.plan_ownership`): check every leaf and
       price the entry, copying nothing;
    3. reject, evicting nothing, if it cannot fit even with every unpinned
       entry gone (budget and ``max_entries``; with an arena also a free
       range between pinned blocks). With an arena, an entry whose block the value reads (a
       value from ``get``, put back) counts as pinned for this put: its
       block must outlive the copy;
    4. evict unpinned entries, least recently used first, until it fits; for bytes
       an entry whose storages stay charged anyway is passed over (every storage
       of it that has bytes the new value keeps as it is or a pinned entry holds:
       evicting it would free nothing). An entry of 0 bytes is evicted in its
       turn, as any other: kept, such entries would pile up uncharged;
    5. copy what does not own its storage, rebuild the container, insert
       (with an arena, a copy that raises frees the new block again).

    Without an arena the cache charges the storage bytes it keeps alive,
    each storage once across the cache (reference counted by storage
    identity, :func:`~tpool.memory.accounting.storage_key`): a tensor that
    owns its storage, cached under two keys, counts once; a view that needs
    a copy is copied, and charged, once per key. A tensor kept as is stays
    the caller's object (or a ``detach()`` of it, if it holds more than its
    storage: autograd history, a ``.grad``, hooks, a viewed tensor with any of
    these or with attributes; see :func:`~tpool.memory.ownership.own`): a
    ``resize_`` or ``set_`` of it by the caller changes what the cache keeps
    alive behind its back, which is outside the budget promise
    (:meth:`OwnedCache.check_invariants` detects it). With an arena every tensor
    is copied into ONE block per entry; its storage is then the whole arena
    buffer, so an entry is charged its block size instead, and a tensor from
    ``get`` is a view of a block that is reused once the entry is evicted:
    pin (``pin``/``unpin`` count in-flight readers) while reading it. In both
    modes an entry's ``str`` and ``bytes`` leaves (a prompt's text, an image
    file's bytes), its ints of over 128 bytes and its lists, tuples, sets and
    frozensets of numbers (a request's token ids: the container and its
    number objects, but CPython's shared small ints) are charged too, their
    ``sys.getsizeof``, each object once per entry, as the entry holds them
    (:func:`~tpool.memory.values.leaf_bytes`); the value's other containers
    (its dicts, its lists of tensors) are not. Pinned
    entries are never evicted, popped or cleared. The cache must be the
    arena's only user (:meth:`OwnedCache.check_invariants` counts every
    live block of it as the cache's): a ``put`` finds the room that
    evictions would leave from the gaps between the blocks it keeps, and
    only when the arena has blocks the cache does not hold does it ask the
    arena instead (exact, but it walks every entry). A cache cannot be
    copied or pickled (``TypeError``): its charge is keyed by the identity
    of what it holds.

    ``get`` returns a new container each call (the stored tensors in it), so
    replacing an item of what it returns (``d["x"] = y``, transformers'
    ``BatchEncoding.to``) never changes what the cache holds or charges; a
    tensor is the stored object itself, so an in-place write to its values
    reaches the cache. Without an arena the ledger holds each charged
    storage (not only its key), so it cannot be freed, and its key reused by
    a new storage, while it is charged. Thread-safe: every public call holds
    the cache's lock (a ``get`` costs ~0.2 µs more for it: 0.27 -> 0.46 on a 2-core Xeon guest); a tensor read is
    shared with the cache, so writing to it while another thread reads it is
    the caller's to order.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from tpool._checks import check_size
from tpool.memory import accounting, ownership, values
from tpool.memory.arena import Arena, Block
from tpool.errors import InvariantViolation
from tpool.memory.accounting import StorageKey
from tpool.memory.ownership import OwnershipPlan

__all__ = ["OwnedCache", "CacheStats"]

_MISSING = object()
MIN_ARENA_ALIGNMENT = 16  # bytes: the largest element size (complex128), so any dtype can be viewed


def _locked(method):
    """Run ``method`` under the cache's lock (re-entrant: a locked call may make another)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return call


@dataclass(frozen=True)
class CacheStats:
    """Counters of an :class:`OwnedCache` (bytes are storage bytes charged)."""

    hits: int
    misses: int
    insertions: int
    duplicates: int  # puts of a key already present
    rejections: int
    evictions: int  # LRU evictions to make room (all causes)
    fragmentation_evictions: int  # of those, made when bytes fit but no arena range did
    compactions: int  # tensors copied at admission
    bytes_saved: int  # storage the admitted values kept alive (an arena's own buffer aside) minus the cache's charge
    current_bytes: int
    peak_bytes: int
    budget_bytes: int
    entries: int
    pinned_entries: int

    def to_dict(self) -> dict[str, int]:
        """The fields as a plain dict.

        Returns
        -------
        dict of str to int
            Field name -> value, in field order.
        """
        return asdict(self)


@dataclass
class _Charged:
    storage: torch.UntypedStorage  # held: a storage freed while charged would leave its key to a new one
    nbytes: int  # charged once, however many entries hold it
    refs: int = 0  # entries holding it


@dataclass
class _Entry:
    value: Any
    nbytes: int  # charged: this entry's storages (plain) or block size (arena)
    payload: int
    storages: dict[StorageKey, int]  # plain mode: storage key -> nbytes held
    block: Block | None = None
    pins: int = 0
    leaf_bytes: int = 0  # its text, big ints and lists of numbers (accounting.leaf_bytes), charged besides storages


class OwnedCache:
    """Key -> tensor (or dataclass/dict/tuple/list of tensors) with a byte budget.

    Parameters
    ----------
    budget_bytes : int
        Most storage bytes the cache may charge, >= 0: the storages that stay
        alive and the values' text leaves and lists of numbers (token ids kept
        as Python lists: :func:`~tpool.memory.values.leaf_bytes`), not an
        entry's host objects (~1.5 KB of Python objects and records an entry,
        uncharged: a value of 0 bytes is charged 0) nor, on CUDA, the caching allocator's rounding of a copy up to
        512 B: bound those with ``max_entries`` where entries are tiny.
    max_entries : int, optional
        Most entries the cache holds, >= 0; None (the default) bounds them by
        ``budget_bytes`` alone. A ``put`` of a new key into a full cache evicts
        the least recently used unpinned entry, as the budget does, or is
        refused when every entry is pinned.
    arena : Arena, optional
        Store entries in this arena (tensors must be on ``arena.device``); its
        alignment must be at least ``MIN_ARENA_ALIGNMENT`` (16 bytes). The
        cache must be its only user.

    Raises
    ------
    ValueError
        ``budget_bytes`` or ``max_entries`` is not an int >= 0 (a bool is not),
        or the arena's alignment is below 16 bytes.
    TypeError
        ``arena`` is not an :class:`~tpool.memory.arena.Arena`.

    Example
    -------
    >>> batch = torch.randn(1000, 4096, dtype=torch.bfloat16)     # 8_192_000 B
    >>> cache = OwnedCache(budget_bytes=2 << 20)
    >>> cache.put("img0", batch.split(100)[3])                   # copies 819_200 B
    True
    >>> cache.stats().current_bytes
    819200
    """

    def __init__(self, budget_bytes: int, *, max_entries: int | None = None, arena: Arena | None = None):
        budget_bytes = check_size(budget_bytes, "budget_bytes", 0)
        if max_entries is not None:
            max_entries = check_size(max_entries, "max_entries", 0)
        if arena is not None and not isinstance(arena, Arena):
            raise TypeError(f"arena must be an Arena, got {type(arena).__name__}")
        if arena is not None and arena.alignment < MIN_ARENA_ALIGNMENT:
            raise ValueError(f"arena.alignment must be >= {MIN_ARENA_ALIGNMENT}, got {arena.alignment}")
        self._budget = budget_bytes
        self._max_entries = max_entries
        self.arena = arena
        self._lock = threading.RLock()  # every public call holds it: threads may share one cache
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()  # LRU first
        self._pinned: dict[Hashable, None] = {}  # the keys with pins > 0 (a put never walks every entry)
        self._ledger: dict[StorageKey, _Charged] = {}  # plain mode: each storage charged
        self._current = self._peak = 0
        self._payload = 0  # the entries' payload bytes, kept as they come and go (memory_bytes reads it)
        self._blocks = 0  # arena blocks the entries hold: fewer than the arena's means another user has some
        self._counts = dict.fromkeys(
            ("hits", "misses", "insertions", "duplicates", "rejections", "evictions",
             "fragmentation_evictions", "compactions", "bytes_saved"), 0)

    # -- admission ----------------------------------------------------------
    @_locked
    def put(self, key: Hashable, value: Any) -> bool:
        """Admit ``value`` under ``key``; return whether ``key`` is cached afterwards.

        Runs the admission order of the module note: a duplicate ``key`` keeps
        the old value (nothing copied) and refreshes its recency; a value that
        cannot fit even with every unpinned entry gone (in the budget, and
        below ``max_entries``) is refused with nothing evicted; otherwise
        unpinned entries are evicted, least recently used first, until it
        fits (for bytes, passing over an entry whose storages stay charged
        anyway: every storage of it with bytes is one ``value`` keeps as it is
        or a pinned entry holds; an entry of 0 bytes is evicted in its turn).
        With an arena an entry whose block ``value`` reads (a value from :meth:`get` put back under another key) is
        never evicted for it: if it cannot fit without that block, it is
        refused. What is stored is ``value`` rebuilt (new containers) around
        owned copies of the views that do not own their storage
        (:func:`~tpool.memory.ownership.plan_ownership`; with an arena every
        tensor is copied); a tensor kept as it is stays the caller's object
        (a ``detach()`` of it, on the same storage, if it holds more than its
        storage, as :func:`~tpool.memory.ownership.own` tells), so in-place
        writes to it reach the cache;
        its ``str`` and ``bytes`` leaves, ints of over 128 bytes and lists,
        tuples, sets and frozensets of numbers (with their numbers) are
        charged their size (:func:`~tpool.memory.values.leaf_bytes`).

        Parameters
        ----------
        key : Hashable
            The entry's key.
        value : Any
            A tensor (any shape and dtype; dense strided; any device, or
            ``arena.device`` with an arena) or a dataclass / dict /
            ``UserDict`` / list / tuple / set holding tensors and plain
            scalars.

        Returns
        -------
        bool
            True if ``key`` is cached afterwards (admitted now, or already
            present); False if the value was refused.

        Raises
        ------
        TypeError
            ``key`` holds a tensor, an array or another object (it would stay
            alive with the entry, uncharged); a leaf that is neither a tensor
            nor a plain scalar, a tensor without ordinary storage, a dict key
            in ``value`` that cannot be charged (a tensor, an array, an
            object, a tuple or dataclass holding one), or an attribute (``__dict__`` or ``__slots__``) of a
            tensor, of a scalar subclass (``class I(int)``) or of a container
            subclass that holds more than small plain data (a tensor, an
            array, an object, an int of over 128 bytes, a string of over
            1,024, a container of over 64 items or holding any of those; a
            container subclass's attribute may hold one of its own items, as
            a ``ModelOutput``'s do): nothing would charge what it keeps
            alive. Checked before anything is evicted.
        ValueError
            With an arena, a tensor on another device than ``arena.device``,
            or one that reads free arena bytes (a view of an evicted or
            popped entry); or a tensor that reaches past its storage
            (checked before anything is evicted).
        torch.OutOfMemoryError
            The copies did not fit in the device's memory. The evictions made
            room for them are done (those entries are gone) and ``value`` is
            not stored; the cache's charge is still exact.
        """
        if type(key) is not str and type(key) is not int:  # (the common keys at two tests)
            try:
                hash(key)
            except TypeError as e:
                raise TypeError(f"key: expected a hashable key, as a dict's, got a {type(key).__name__} ({e}); "
                                "a tuple for a list of token ids") from None
            # The key stays alive with the entry: one holding a tensor is refused, before anything changes. Its
            # text is not charged (a key is the caller's name for the entry, as in any dict; a value's is).
            values._check_key(key, "the cache key")
        if key in self._entries:
            self._entries.move_to_end(key)
            self._counts["duplicates"] += 1
            return True
        plan = self._plan(value)
        stay = self._read_by(plan) | self._pinned.keys()
        if not self._fits(plan, stay=stay) or self._full(len(stay)):
            self._counts["rejections"] += 1
            return False
        alive = None  # storages charged whatever is evicted: the plan keeps them, or entries in stay hold them
        while (short := not self._fits(plan)) or self._full(len(self._entries)):
            if short and alive is None:
                alive = plan.keep.keys() | self._charge_of(stay)[0].keys()
            victim = next((k for k in self._entries if k not in stay and not self._frees_nothing(k, alive)), None) \
                if short else None
            if victim is None and self._full(len(self._entries)):  # (a count: any entry makes room)
                victim = next((k for k in self._entries if k not in stay), None)
            if victim is None:  # (not reached while the room check above is exact; refuse, never raise)
                self._counts["rejections"] += 1
                return False
            if self._current + self._cost(plan) <= self.budget_bytes and not self._full(len(self._entries)):
                self._counts["fragmentation_evictions"] += 1
            self._drop(victim)
            self._counts["evictions"] += 1
        entry = self._materialize(plan)
        self._entries[key] = entry
        self._payload += entry.payload
        self._counts["insertions"] += 1
        self._counts["compactions"] += len(plan.copy)
        self._counts["bytes_saved"] += max(0, self._retained_elsewhere(plan) - entry.nbytes)
        self._peak = max(self._peak, self._current)
        return True

    def _frees_nothing(self, key: Hashable, alive) -> bool:
        """Whether evicting ``key`` frees no bytes although it holds some: no block, no text, at least one
        storage with bytes, and every such storage in ``alive`` (storage keys that stay charged: a new value
        keeps them as they are, or entries that are not evicted, pinned ones, hold them). An entry of 0 bytes
        is not one of these: eviction takes it in its turn (passed over, such entries would never leave a
        cache bounded by bytes alone, and each would cost every eviction a look)."""
        e = self._entries[key]
        sized = [k for k, n in e.storages.items() if n]
        return e.block is None and not e.leaf_bytes and bool(sized) and all(k in alive for k in sized)

    def _full(self, entries: int) -> bool:
        """Whether a cache holding ``entries`` entries has no room for one more."""
        return self._max_entries is not None and entries >= self._max_entries

    def _retained_elsewhere(self, plan: OwnershipPlan) -> int:
        """What ``plan``'s value kept alive as given, less the arena's own buffer: a value read from
        the arena (a :meth:`get` put back) keeps the buffer alive, which the arena does anyway."""
        if self.arena is None:
            return plan.retained_bytes
        buf = self.arena.buffer.untyped_storage()
        inside = any(t.untyped_storage().data_ptr() == buf.data_ptr() for t in plan.views.values())
        return plan.retained_bytes - buf.nbytes() if inside else plan.retained_bytes

    def _plan(self, value: Any) -> OwnershipPlan:
        """Check every leaf and price the entry; copies nothing."""
        align = 1 if self.arena is None else self.arena.alignment
        plan = ownership.plan_ownership(value, copy_all=self.arena is not None, align=align)
        for t in plan.views.values():
            if self.arena is not None and t.device != self.arena.device:
                raise ValueError(f"tensor on {t.device} cannot enter an arena on {self.arena.device}")
        return plan

    def _read_by(self, plan: OwnershipPlan) -> set[Hashable]:
        """With an arena, the keys of the entries whose blocks the copies of ``plan`` read.

        Raises ValueError if a copy would read free arena bytes (a view of an
        entry evicted or popped since): a new block may be carved over them.
        """
        if self.arena is None:
            return set()
        base = self.arena.buffer.data_ptr()
        spans = []  # byte ranges of the arena the views read
        for t in plan.views.values():
            lo = t.data_ptr() - base
            hi = lo + accounting._span_elems(t) * t.element_size()
            if lo < hi and hi > 0 and lo < self.arena.capacity_bytes:
                spans.append((lo, hi))
        if not spans:
            return set()
        for start, size in self.arena.free_ranges():
            if any(lo < start + size and start < hi for lo, hi in spans):
                raise ValueError(f"the value reads free arena bytes [{start}, {start + size}): a view of an "
                                 "entry evicted or popped since it was read (pin entries while reading them)")
        return {k for k, e in self._entries.items() if e.block is not None and any(
                lo < e.block.offset + e.block.size and e.block.offset < hi for lo, hi in spans)}

    def _cost(self, plan: OwnershipPlan, held: dict | None = None) -> int:
        """Bytes ``plan`` adds to the charge when the storages in ``held`` are already counted."""
        held = self._ledger if held is None else held
        return plan.copy_bytes + plan.leaf_bytes + sum(n for k, n in plan.keep.items() if k not in held)

    def _fits(self, plan: OwnershipPlan, *, stay: set[Hashable] | None = None) -> bool:
        """Whether ``plan`` fits now, or once every entry not in ``stay`` is gone."""
        held, base = self._ledger, self._current
        if stay is not None:
            held, base = self._charge_of(stay)
        if base + self._cost(plan, held) > self.budget_bytes:
            return False
        if self.arena is None or plan.copy_bytes == 0:
            return True
        if stay is None:
            return self.arena.can_alloc(plan.copy_bytes)
        if self._blocks != self.arena.num_blocks:  # another user holds blocks: ask the arena (O(entries))
            return self.arena.can_alloc(plan.copy_bytes, also_free=[
                e.block for k, e in self._entries.items() if e.block is not None and k not in stay])
        # The cache is the arena's only user: with only the blocks of ``stay`` live, a block fits in a
        # gap between them (their ranges sorted; O(len(stay)), however many entries there are).
        size, end = self.arena.block_size(plan.copy_bytes), 0
        for lo, hi in sorted((e.block.offset, e.block.offset + e.block.size) for k in stay
                             if (e := self._entries[k]).block is not None):
            if lo - end >= size:
                return True
            end = max(end, hi)
        return self.arena.capacity_bytes - end >= size

    def _charge_of(self, keys) -> tuple[dict, int]:
        """The storages the entries under ``keys`` hold (key -> bytes) and what those entries alone are charged."""
        kept = [self._entries[k] for k in keys]
        held = {k: n for e in kept for k, n in e.storages.items()}
        return held, sum(held.values()) + sum(e.nbytes for e in kept if e.block) + sum(e.leaf_bytes for e in kept)

    @property
    def budget_bytes(self) -> int:
        """The most bytes the cache charges; change it with :meth:`set_budget`."""
        return self._budget

    @property
    def max_entries(self) -> int | None:
        """The most entries the cache holds (None: bounded by ``budget_bytes`` alone)."""
        return self._max_entries

    @_locked
    def set_budget(self, budget_bytes: int) -> None:
        """Change the budget; unpinned entries are evicted, least recently used first, until the
        charge fits it (counted as evictions), passing over an entry whose storages with bytes pinned
        entries all hold too (evicting it would free nothing); an entry of 0 bytes goes in its turn.

        Parameters
        ----------
        budget_bytes : int
            The new budget, >= 0.

        Raises
        ------
        ValueError
            ``budget_bytes`` is not an int >= 0, or the pinned entries alone are charged more
            (nothing changed).
        """
        budget = check_size(budget_bytes, "budget_bytes", 0)
        pinned = set(self._pinned)
        alive, charged = self._charge_of(pinned)  # (an entry holding only storages in alive frees nothing)
        if charged > budget:
            raise ValueError(f"budget_bytes: expected at least the {charged} B the pinned entries are charged, "
                             f"got {budget}")
        self._budget = budget
        while self._current > budget:
            self._drop(next(k for k in self._entries if k not in pinned and not self._frees_nothing(k, alive)))
            self._counts["evictions"] += 1

    def _materialize(self, plan: OwnershipPlan) -> _Entry:
        """Make the copies (into a new arena block, freed again if a copy raises) and charge them."""
        if self.arena is not None and plan.copy_bytes:
            block = self.arena.alloc(plan.copy_bytes)
            try:
                value = plan._apply(self.arena.bytes_of(block, plan.copy_bytes))
            except BaseException:
                self.arena.free(block)
                raise
            self._current += block.size + plan.leaf_bytes
            self._blocks += 1
            return _Entry(value, block.size, plan.payload_bytes, {}, block, leaf_bytes=plan.leaf_bytes)
        value = plan._apply()  # (planned just now, under the lock: nothing to check again)
        storages = {accounting.storage_key(t): t.untyped_storage() for t in accounting.iter_tensors(value)}
        for skey, storage in storages.items():
            charged = self._ledger.setdefault(skey, _Charged(storage, storage.nbytes()))
            self._current += charged.nbytes if charged.refs == 0 else 0
            charged.refs += 1
        sizes = {skey: storage.nbytes() for skey, storage in storages.items()}
        self._current += plan.leaf_bytes
        return _Entry(value, sum(sizes.values()), plan.payload_bytes, sizes, leaf_bytes=plan.leaf_bytes)

    def _drop(self, key: Hashable) -> _Entry:
        entry = self._entries.pop(key)
        self._payload -= entry.payload
        for skey in entry.storages:
            charged = self._ledger[skey]
            charged.refs -= 1
            if charged.refs == 0:
                del self._ledger[skey]
                self._current -= charged.nbytes
        if entry.block is not None:
            self.arena.free(entry.block)
            self._current -= entry.block.size
            self._blocks -= 1
        self._current -= entry.leaf_bytes
        return entry

    # -- lookup, pins, removal ----------------------------------------------
    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value under ``key`` (refreshing its recency), or ``default``.

        Parameters
        ----------
        key : Hashable
            The entry's key.
        default : Any
            Returned when ``key`` is absent (counted as a miss).

        Returns
        -------
        Any
            The stored value, or ``default``: a stored tensor itself, or a
            new container each call (rebuilt like the stored one, nested
            containers too, by :func:`~tpool.memory.ownership.map_tensors`)
            holding the stored tensor objects. Replacing its items leaves
            the cache unchanged; in-place writes to its tensors' values reach
            the cache, and so does autograd: a backward through a stored
            tensor leaves its ``.grad`` on the entry, alive and uncharged
            (:meth:`check_invariants` reports it); ``detach()`` what you read
            before running autograd on it. With an arena its tensors are views of the entry's
            block, reused once the entry is evicted: :meth:`pin` (or
            :meth:`pinned`) while reading them.
        """
        with self._lock:  # (not @_locked: the wrapper's call would cost as much as the lock)
            entry = self._entries.get(key)
            if entry is None:
                self._counts["misses"] += 1
                return default
            self._counts["hits"] += 1
            self._entries.move_to_end(key)
            value = entry.value
        return ownership._map(value, _same, False, {})  # (what put checked is not read again: check_invariants does)

    @_locked
    def pin(self, key: Hashable) -> None:
        """Add one in-flight reader of ``key``; a pinned entry is never evicted.

        Pinned entries are also never popped, removed or cleared. Recency and
        the hit counter are unchanged.

        Parameters
        ----------
        key : Hashable
            The entry's key.

        Raises
        ------
        KeyError
            ``key`` is not in the cache.
        """
        entry = self._entry(key)
        entry.pins += 1
        self._pinned[key] = None

    @_locked
    def unpin(self, key: Hashable) -> None:
        """Remove one in-flight reader of ``key``.

        Parameters
        ----------
        key : Hashable
            The entry's key.

        Raises
        ------
        KeyError
            ``key`` is not in the cache.
        ValueError
            The entry has no pins.
        """
        entry = self._entry(key)
        if entry.pins == 0:
            raise ValueError(f"unpin({key!r}): the entry has 0 pins")
        entry.pins -= 1
        if entry.pins == 0:
            del self._pinned[key]

    @contextlib.contextmanager
    def pinned(self, key: Hashable) -> Iterator[Any]:
        """``with cache.pinned(key) as value:`` pins ``key`` for the block (no recency change).

        Parameters
        ----------
        key : Hashable
            The entry's key.

        Yields
        ------
        Any
            The stored value, as :meth:`get` returns it (not counted as a hit).

        Raises
        ------
        KeyError
            ``key`` is not in the cache (on entering the block).
        """
        self.pin(key)
        try:
            yield ownership._map(self._entries[key].value, _same, False, {})
        finally:
            self.unpin(key)

    @_locked
    def pins(self, key: Hashable) -> int:
        """Current pin count of ``key``.

        Parameters
        ----------
        key : Hashable
            The entry's key.

        Returns
        -------
        int
            Pins minus unpins so far, >= 0.

        Raises
        ------
        KeyError
            ``key`` is not in the cache.
        """
        return self._entry(key).pins

    @_locked
    def pop(self, key: Hashable, default: Any = _MISSING) -> Any:
        """Remove ``key`` and return its value (with an arena: a copy out of it).

        Not counted as a hit or a miss.

        Parameters
        ----------
        key : Hashable
            The entry's key.
        default : Any, optional
            Returned when ``key`` is absent; without it an absent key raises.

        Returns
        -------
        Any
            The stored value; with an arena, the same structure rebuilt with
            each tensor copied out of the block into its own compact storage
            (same shapes, dtypes, device and values), since the block is
            reused. Or ``default``.

        Raises
        ------
        KeyError
            ``key`` is absent and no ``default`` was given.
        ValueError
            The entry is pinned (nothing removed).
        """
        if key not in self._entries:
            if default is _MISSING:
                raise KeyError(key)
            return default
        entry = self._entries[key]
        self._check_unpinned([key])
        value = entry.value
        if entry.block is not None:  # copy out of the block before it is reused
            value = ownership.plan_ownership(value, copy_all=True).apply()
        self._drop(key)
        return value

    @_locked
    def remove(self, key: Hashable) -> None:
        """Remove ``key`` and release what it holds.

        Parameters
        ----------
        key : Hashable
            The entry's key.

        Raises
        ------
        KeyError
            ``key`` is not in the cache.
        ValueError
            The entry is pinned (nothing removed).
        """
        self._entry(key)
        self._check_unpinned([key])
        self._drop(key)

    @_locked
    def clear(self) -> None:
        """Remove every entry.

        Raises
        ------
        ValueError
            Some entry is pinned (nothing removed).
        """
        self._check_unpinned(list(self._entries))
        for key in list(self._entries):
            self._drop(key)

    def _entry(self, key: Hashable) -> _Entry:
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(f"{key!r} is not in the cache") from None

    def _check_unpinned(self, keys: list) -> None:
        pinned = [k for k in keys if k in self._pinned]
        if pinned:
            raise ValueError(f"entries {pinned!r} are pinned (in-flight readers); unpin them first")

    def __reduce_ex__(self, protocol):
        raise TypeError("an OwnedCache cannot be copied or pickled: its charge is keyed by the identity of the "
                        "storages (or arena blocks) it holds, which a copy would not hold, and a shallow copy "
                        "would share its entries; make a new cache and put the values in it "
                        "(for k in cache.keys(): new.put(k, cache.get(k)))")

    @_locked
    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    @_locked
    def __len__(self) -> int:
        return len(self._entries)

    @_locked
    def keys(self) -> list[Hashable]:
        """Keys from least to most recently used.

        Returns
        -------
        list of Hashable
            A new list; the first key is the next eviction candidate (unless
            pinned).
        """
        return list(self._entries)

    # -- accounting ---------------------------------------------------------
    @_locked
    def stats(self) -> CacheStats:
        """A snapshot of the counters and byte counts.

        Returns
        -------
        CacheStats
            Frozen; later cache operations do not change it.
        """
        pinned = len(self._pinned)
        return CacheStats(**self._counts, current_bytes=self._current, peak_bytes=self._peak,
                          budget_bytes=self.budget_bytes, entries=len(self._entries), pinned_entries=pinned)

    @_locked
    def memory_bytes(self) -> dict[str, int]:
        """Payload vs charged storage bytes (the protocol :func:`tpool.memory_report` reads).

        Returns
        -------
        dict of str to int
            ``entries``; ``payload_bytes`` (what the values need);
            ``storage_bytes`` (what the cache charges: storages held, or
            block sizes with an arena, and the entries' ``str`` and ``bytes``
            leaves, big ints and lists of numbers); ``budget_bytes``; ``peak_bytes``; and with an arena,
            ``arena_bytes``: what the arena's buffer keeps alive, whatever is
            in it (its ``memory_bytes()["storage_bytes"]``).
        """
        out = {"entries": len(self._entries), "payload_bytes": self._payload, "storage_bytes": self._current,
               "budget_bytes": self.budget_bytes, "peak_bytes": self._peak}
        if self.arena is not None:
            out["arena_bytes"] = self.arena.memory_bytes()["storage_bytes"]
        return out

    @_locked
    def check_invariants(self) -> None:
        """Recount everything held; raise :class:`InvariantViolation` on any mismatch.

        Checks each entry's storages (or, with an arena, that its block is live,
        of the charged size and holds its tensors, and that the arena has no
        other live block: a block no entry holds is leaked), the storage
        ledger, the storages it holds and its reference counts,
        ``0 <= current <= peak``, ``current <= budget``, the entries against ``max_entries``,
        that no counter is negative, and that
        every entry still holds only what ``put`` admits (a caller may add a tensor to the
        attributes of a tensor it shares with the cache: ``cache.get("t").extra = big``).

        Raises
        ------
        InvariantViolation
            Names the first broken invariant (the key, and the attribute or dict key that
            now holds what ``put`` refuses).
        """
        held: dict[StorageKey, int] = {}
        refs: dict[StorageKey, int] = {}
        in_blocks = leaves = 0
        buf = None if self.arena is None else self.arena.buffer
        for key, e in self._entries.items():
            try:  # what put checked: a caller may change it since (c.get("t").extra = big)
                tensors = list(accounting.iter_tensors(e.value))
                for t in tensors:  # (a storage shrunk under a stored tensor: t.untyped_storage().resize_(0))
                    accounting.check_ownable(t)
                leaf_bytes = accounting.leaf_bytes(e.value)
            except Exception as err:  # (any: a caller's change may make a read raise anything)
                raise InvariantViolation(f"OwnedCache invariant broken: {key!r} holds what put refuses, "
                                         f"changed after put: {type(err).__name__}: {err}") from err
            _require(e.pins >= 0 and (e.pins > 0) == (key in self._pinned),
                     f"{key!r} has {e.pins} pins, {'' if key in self._pinned else 'not '}listed as pinned")
            _require(e.leaf_bytes == leaf_bytes,
                     f"{key!r} was charged {e.leaf_bytes} B of text, big ints and lists of numbers, holds {leaf_bytes}")
            leaves += e.leaf_bytes
            _require(not any(t.grad is not None for t in tensors if t.is_leaf),
                     f"{key!r} holds a tensor with a .grad (a backward through a value from get): alive and "
                     "uncharged; detach() what you read before running autograd on it")
            if e.block is None:
                storages = {accounting.storage_key(t): t.untyped_storage().nbytes() for t in tensors}
                _require(storages == e.storages and e.nbytes == sum(storages.values()),
                         f"{key!r} holds storages {storages}, recorded {e.storages} ({e.nbytes} B)")
                held.update(storages)
                for skey in storages:
                    refs[skey] = refs.get(skey, 0) + 1
                continue
            lo = buf.data_ptr() + e.block.offset
            _require(self.arena.is_live(e.block) and e.nbytes == e.block.size and all(
                t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
                and (t.numel() == 0 or  # (an empty tensor's data_ptr() is 0)
                lo <= t.data_ptr() <= t.data_ptr() + accounting.compact_bytes(t) <= lo + e.block.size)
                for t in tensors), f"{key!r}: its block {e.block} is dead, mis-sized or not where its tensors are")
            in_blocks += e.nbytes
        ledger = {k: [c.nbytes, c.refs] for k, c in self._ledger.items()}
        _require(ledger == {k: [n, refs[k]] for k, n in held.items()},
                 f"ledger {ledger} != storages held {held} with references {refs}")
        _require(all(c.storage._cdata == k[2] for k, c in self._ledger.items()),
                 "a ledger key is not the address of the storage it holds")
        if self.arena is not None:
            blocks = sum(1 for e in self._entries.values() if e.block is not None)
            _require((self.arena.num_blocks, self.arena.allocated_bytes, self._blocks) == (blocks, in_blocks, blocks),
                     f"the arena has {self.arena.num_blocks} live blocks of {self.arena.allocated_bytes} B, "
                     f"the entries hold {blocks} of {in_blocks} B, {self._blocks} counted (a leaked block, or "
                     "another user of the arena?)")
        _require(self._payload == sum(e.payload for e in self._entries.values()),
                 f"payload_bytes {self._payload} != the entries' {sum(e.payload for e in self._entries.values())}")
        _require(self._current == sum(held.values()) + in_blocks + leaves,
                 f"current_bytes {self._current} != recounted {sum(held.values()) + in_blocks + leaves}")
        _require(0 <= self._current <= min(self._peak, self.budget_bytes),  # (set_budget may lower it below peak)
                 f"not 0 <= current {self._current} <= peak {self._peak} and budget {self.budget_bytes}")
        _require(not self._full(len(self._entries) - 1),
                 f"{len(self._entries)} entries, max_entries {self._max_entries}")
        _require(min(self._counts.values()) >= 0, f"negative counter in {self._counts}")
        _require(all(k in self._entries for k in self._pinned), f"pinned keys not in the cache: "
                 f"{[k for k in self._pinned if k not in self._entries][:8]}")


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise InvariantViolation(f"OwnedCache invariant broken: {what}")
