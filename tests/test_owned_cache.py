"""OwnedCache: admission order, LRU, pins, counting (tpool.memory.owned_cache)."""

import collections
import copy
import dataclasses
import enum
import datetime
import decimal
import fractions
import gc
import pathlib
import pickle
import sys
import threading
import uuid
import weakref

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.multiprocessing.reductions import StorageWeakRef

from tpool.memory import accounting, ownership, values
from tpool.memory.arena import Arena
from tpool.errors import InvariantViolation
from tpool.memory.owned_cache import OwnedCache
from tpool.memory.accounting import retained_bytes, storage_bytes


def _keys(*names) -> int:
    """What dict keys ``names`` are charged: their text (keys stay alive with the value)."""
    return sum(sys.getsizeof(n) for n in names)


BATCH_BYTES = 8_192_000  # [1000, 4096] bf16 = 7.81 MiB
ITEM_BYTES = 819_200  # [100, 4096] bf16 = 0.78 MiB
UNIT = 1024  # bytes: one [256] float32 tensor


def full(units=1):
    """A tensor that owns its storage: units * UNIT bytes."""
    return torch.randn(units * 256)


def sliced(units=1):
    """A view that needs a copy: payload units * UNIT, storage twice that."""
    return torch.randn(2 * units * 256)[units * 256:]


class CopyLog(list):
    """(cache charge at the moment of the copy, bytes copied) per copy."""

    cache = None


@pytest.fixture
def copies(monkeypatch):
    """Record every copy the cache makes, through the helper it calls."""
    log, real = CopyLog(), ownership.compact

    def spy(t, out=None):
        log.append((log.cache.stats().current_bytes if log.cache else None, accounting.compact_bytes(t)))
        return real(t, out=out)

    monkeypatch.setattr(ownership, "compact", spy)
    return log


def test_split_item_end_to_end():
    batch = torch.randn(1000, 4096, dtype=torch.bfloat16)
    items = batch.split(100)
    assert retained_bytes([items[3]]) == BATCH_BYTES  # without compaction
    expected = items[3].clone()
    alive = StorageWeakRef(batch.untyped_storage())
    cache = OwnedCache(budget_bytes=2 * ITEM_BYTES)
    assert cache.put("img", items[3])
    del batch, items
    gc.collect()
    assert alive.expired()
    s = cache.stats()
    assert (s.current_bytes, s.compactions, s.bytes_saved) == (ITEM_BYTES, 1, BATCH_BYTES - ITEM_BYTES)
    assert torch.equal(cache.get("img"), expected)
    assert retained_bytes([cache.get("img")]) == ITEM_BYTES
    cache.check_invariants()


def test_owned_tensor_is_stored_without_copy(copies):
    t = full(2)
    cache = OwnedCache(4 * UNIT)
    assert cache.put("a", t) and cache.get("a") is t
    assert copies == [] and cache.stats().current_bytes == 2 * UNIT


def test_duplicate_key_is_a_noop_without_copy(copies):
    cache = OwnedCache(4 * UNIT)
    first = sliced()
    cache.put("a", first)
    cache.put("b", full())
    assert len(copies) == 1
    assert cache.put("a", sliced(3))  # different value, same key: kept, no copy
    assert len(copies) == 1 and torch.equal(cache.get("a"), first)
    assert cache.keys() == ["b", "a"]  # recency refreshed
    assert cache.stats().duplicates == 1 and cache.stats().current_bytes == 2 * UNIT


def test_too_large_is_rejected_without_copy_or_eviction(copies):
    cache = OwnedCache(4 * UNIT)
    cache.put("a", full())
    cache.put("b", full())
    assert not cache.put("big", sliced(5))
    assert copies == [] and cache.keys() == ["a", "b"]
    s = cache.stats()
    assert (s.rejections, s.evictions, s.current_bytes) == (1, 0, 2 * UNIT)


def test_pinned_entries_block_admission_without_eviction(copies):
    cache = OwnedCache(3 * UNIT)
    cache.put("pinned", full(2))
    cache.put("free", full())
    cache.pin("pinned")
    assert not cache.put("c", sliced(2))  # would need evicting the pinned entry
    assert cache.keys() == ["pinned", "free"] and copies == []
    assert cache.put("d", sliced(1))  # fits after evicting "free"
    assert cache.keys() == ["pinned", "d"] and cache.stats().evictions == 1


def test_max_entries_bounds_the_entries_as_the_budget_bounds_their_bytes():
    """Empty values are charged 0 B, so the budget alone admits any number of them (each ~1.5 KB of
    host objects, uncharged): max_entries bounds them, evicting the least recently used unpinned entry."""
    cache = OwnedCache(0, max_entries=3)
    assert cache.max_entries == 3
    for i in range(1000):
        assert cache.put(i, torch.empty(0))
    assert cache.keys() == [997, 998, 999] and cache.stats().evictions == 997
    cache.get(997)
    cache.pin(998)
    assert cache.put("new", torch.empty(0)) and cache.keys() == [998, 997, "new"]  # 999: least recent, unpinned
    assert cache.put(997, torch.empty(0)) and len(cache) == 3  # a duplicate evicts nothing
    cache.pin(997)
    cache.pin("new")
    s = cache.stats()
    assert not cache.put("refused", torch.empty(0))  # every entry pinned: refused, nothing evicted
    assert cache.keys() == [998, "new", 997]
    assert (cache.stats().rejections, cache.stats().evictions) == (s.rejections + 1, s.evictions)
    assert cache.stats().fragmentation_evictions == 0  # an eviction for the count is not one for the arena's room
    cache.check_invariants()


def test_max_entries_with_an_arena_and_the_budget_together():
    cache = OwnedCache(4 * UNIT, max_entries=2, arena=Arena(8 * UNIT, "cpu", alignment=256))
    assert cache.put("a", full()) and cache.put("b", full())
    assert cache.put("c", full()) and cache.keys() == ["b", "c"]  # the count, not the bytes, evicted "a"
    assert cache.put("d", full(4)) and cache.keys() == ["d"]  # the bytes evicted both
    assert cache.stats().evictions == 3 and cache.arena.num_blocks == 1
    cache.check_invariants()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_max_entries_must_be_a_count(bad):
    with pytest.raises(ValueError, match="max_entries"):
        OwnedCache(UNIT, max_entries=bad)


def test_check_invariants_counts_the_entries_against_max_entries():
    cache = OwnedCache(4 * UNIT, max_entries=2)
    cache.put("a", full())
    cache.put("b", full())
    cache._max_entries = 1  # hand-edited state: the entries outgrew it
    with pytest.raises(InvariantViolation, match="2 entries, max_entries 1"):
        cache.check_invariants()


def test_evicts_before_copying(copies):
    cache = OwnedCache(4 * UNIT)
    copies.cache = cache
    for k in "abcd":
        cache.put(k, full())
    assert cache.put("e", sliced(3))
    assert copies == [(UNIT, 3 * UNIT)]  # a, b, c gone before the copy was made
    assert cache.keys() == ["d", "e"] and cache.stats().evictions == 3
    assert cache.stats().peak_bytes == 4 * UNIT


def test_lru_order_follows_get():
    cache = OwnedCache(3 * UNIT)
    for k in "abc":
        cache.put(k, full())
    assert cache.get("a") is not None and cache.get("zz") is None
    cache.put("d", full())
    assert cache.keys() == ["c", "a", "d"]  # b was least recently used
    s = cache.stats()
    assert (s.hits, s.misses, s.evictions) == (1, 1, 1)


def test_pins_are_reference_counts():
    cache = OwnedCache(2 * UNIT)
    cache.put("a", full())
    cache.pin("a")
    cache.pin("a")
    cache.unpin("a")
    assert cache.pins("a") == 1
    cache.put("b", full())
    cache.put("c", full())  # evicts b, never the pinned a
    assert cache.keys() == ["a", "c"]
    cache.unpin("a")
    with pytest.raises(ValueError, match="0 pins"):
        cache.unpin("a")
    with pytest.raises(KeyError):
        cache.pin("missing")
    with cache.pinned("c") as value:
        assert cache.pins("c") == 1 and value is cache.get("c")
    assert cache.pins("c") == 0


def test_pop_remove_clear():
    cache = OwnedCache(4 * UNIT)
    a = full()
    cache.put("a", a)
    cache.put("b", full())
    cache.put("c", full())
    assert cache.pop("a") is a and "a" not in cache
    assert cache.pop("a", None) is None
    with pytest.raises(KeyError):
        cache.pop("a")
    cache.pin("b")
    with pytest.raises(ValueError, match="pinned"):
        cache.remove("b")
    with pytest.raises(ValueError, match="pinned"):
        cache.clear()
    assert len(cache) == 2  # clear removed nothing
    cache.unpin("b")
    cache.remove("c")
    cache.clear()
    assert len(cache) == 0 and cache.stats().current_bytes == 0
    cache.check_invariants()


@dataclasses.dataclass(frozen=True)
class Features:
    pixels: torch.Tensor
    tokens: list
    name: str = "img"


Pair = collections.namedtuple("Pair", "left right")


@pytest.mark.parametrize("wrap", [
    lambda x, y: Features(x, [y, 3]),
    lambda x, y: {"x": x, "nested": {"y": (y, None)}},
    lambda x, y: Pair(x, y),
    lambda x, y: [x, y],
])
def test_containers_are_rebuilt_around_owned_tensors(wrap):
    base = torch.randn(4096)
    x, y = base[:256], full()
    value = wrap(x, y)
    cache = OwnedCache(8 * UNIT)
    assert cache.put("k", value)
    stored = cache.get("k")
    assert type(stored) is type(value) and stored is not value
    got = list(accounting.iter_tensors(stored))
    assert torch.equal(got[0], x) and storage_bytes(got[0]) == UNIT and got[1] is y
    assert list(accounting.iter_tensors(value))[0] is x  # the caller's value is untouched
    assert retained_bytes(stored) == 2 * UNIT  # Features' name "img" is charged too
    assert cache.stats().current_bytes == 2 * UNIT + accounting.leaf_bytes(value)  # "img", and dict keys' text
    cache.check_invariants()


def test_shared_storage_within_an_entry():
    batch = torch.randn(1000, 4096, dtype=torch.bfloat16)
    items = batch.split(100)
    cache = OwnedCache(4 * BATCH_BYTES)
    assert cache.put("all", list(items))  # together they cover the storage: no copy
    assert cache.stats().compactions == 0 and cache.stats().current_bytes == BATCH_BYTES
    assert cache.put("two", (items[0], items[5]))  # two small views: copied each
    assert cache.stats().current_bytes == BATCH_BYTES + 2 * ITEM_BYTES
    t = sliced()
    assert cache.put("twice", (t, t))  # the same view twice: one copy, shared
    stored = cache.get("twice")
    assert stored[0] is stored[1] and cache.stats().compactions == 3
    cache.check_invariants()


def test_same_storage_under_two_keys_counts_once():
    t = full(2)
    cache = OwnedCache(3 * UNIT + _keys("again"))  # (the key's text is charged too)
    assert cache.put("a", t) and cache.put("b", {"again": t})
    assert cache.stats().current_bytes == 2 * UNIT + _keys("again")
    assert cache.put("c", full())  # 3 units fit because t is counted once
    cache.remove("a")
    assert cache.stats().current_bytes == 3 * UNIT + _keys("again")  # b still holds t
    cache.remove("b")
    assert cache.stats().current_bytes == UNIT
    cache.check_invariants()


def test_a_view_under_two_keys_is_copied_and_charged_per_key(copies):
    t = sliced(2)  # needs a copy: the module note's exception to "counts once"
    cache = OwnedCache(8 * UNIT)
    assert cache.put("a", t) and cache.put("b", t)
    assert len(copies) == 2 and cache.get("a") is not cache.get("b")
    assert cache.stats().current_bytes == 4 * UNIT
    cache.check_invariants()


def test_memory_torch_did_not_allocate_is_copied_and_the_owner_freed():
    big = np.zeros((1000, 4096), dtype=np.float32)  # 16_384_000 B
    item = torch.from_numpy(big[300:400])  # storage_bytes sees 1_638_400 B of it
    alive = weakref.ref(big)
    cache = OwnedCache(budget_bytes=2 << 20)
    assert cache.put("img", item) and cache.stats().compactions == 1
    del big, item
    gc.collect()
    assert alive() is None and cache.stats().current_bytes == 1_638_400
    cache.check_invariants()


def test_two_storages_at_one_address_are_priced_apart():
    arr = np.zeros((1000, 1024), dtype=np.float32)  # 4_096_000 B
    head, whole = torch.from_numpy(arr[:1]), torch.from_numpy(arr)  # one address, two storages
    cache = OwnedCache(budget_bytes=1 << 20)
    assert cache.put("head", head) and cache.stats().current_bytes == 4096
    assert not cache.put("k", [head, whole]) and not cache.put("whole", whole)  # 4 MB > 1 MiB
    assert cache.stats().current_bytes == 4096
    cache.check_invariants()


def test_a_kept_tensor_resized_by_its_caller_leaves_no_stale_key():
    big = 10 << 20  # float32: 40 MiB, above glibc's largest mmap threshold, so its bytes come back by address
    cache = OwnedCache(budget_bytes=8 * big)
    buf = torch.empty(big)
    old = buf.data_ptr()
    assert cache.put("a", buf) and cache.get("a") is buf  # owns its storage: kept, not copied
    buf.resize_(big + 1024)  # the caller reuses its buffer (outside the budget promise): its bytes move
    fresh = torch.empty(big)
    if fresh.data_ptr() != old:  # test_storage_key_is_the_storage_object_not_its_address checks the keys
        pytest.skip("the allocator did not reuse the freed address")
    assert cache.put("b", fresh) and cache.stats().current_bytes == 2 * 4 * big  # charged, not taken for a's
    with pytest.raises(InvariantViolation, match=str(4 * (big + 1024))):  # the resize: check_invariants sees it
        cache.check_invariants()


def test_a_tensor_with_history_is_stored_detached_and_its_activations_freed():
    w = torch.randn(64, requires_grad=True)
    act = torch.randn(1000, 64) * w  # 256_000 B, saved by the mul below
    alive = StorageWeakRef(act.untyped_storage())
    emb = (act * act).mean(0)  # 256 B, owns its storage
    cache = OwnedCache(budget_bytes=UNIT)
    assert cache.put("emb", emb) and cache.stats().compactions == 0
    stored = cache.get("emb")
    assert stored.grad_fn is None and stored.requires_grad and stored.data_ptr() == emb.data_ptr()
    del act, emb
    gc.collect()
    assert alive.expired() and cache.stats().current_bytes == 256
    cache.check_invariants()


def test_a_tensor_past_its_storage_is_refused_before_anything(copies):
    cache = OwnedCache(4 * UNIT)
    cache.put("a", full())
    t = full(2)
    t.untyped_storage().resize_(0)  # freed under the tensor, FSDP-style
    with pytest.raises(ValueError, match="at least 2048 bytes.*got a storage of 0 bytes"):
        cache.put("b", [sliced(), t])
    assert copies == [] and cache.keys() == ["a"] and cache.stats().current_bytes == UNIT


class Batch(collections.UserDict):
    """Like transformers' BatchFeature / BatchEncoding: a UserDict with attributes."""

    def __init__(self, data, tensor_type=None):
        super().__init__(data)
        self.tensor_type = tensor_type


def test_userdict_values_are_rebuilt():
    value = Batch({"pixel_values": sliced(), "input_ids": full()}, tensor_type="pt")
    cache = OwnedCache(4 * UNIT)
    assert cache.put("k", value)
    stored = cache.get("k")
    assert type(stored) is Batch and stored.tensor_type == "pt" and stored is not value
    assert storage_bytes(stored["pixel_values"]) == UNIT and stored["input_ids"] is value["input_ids"]
    assert storage_bytes(value["pixel_values"]) == 2 * UNIT  # the caller's value is untouched
    assert cache.stats().current_bytes == 2 * UNIT + _keys("pixel_values", "input_ids")
    cache.check_invariants()


@pytest.mark.parametrize("budget", [True, -1, 1.5, "64", None])
def test_bad_budget_raises(budget):
    with pytest.raises(ValueError, match="budget_bytes: expected a non-negative int, got"):
        OwnedCache(budget)


def test_unsupported_values_raise_before_anything(copies):
    cache = OwnedCache(4 * UNIT)
    cache.put("a", full())
    with pytest.raises(TypeError, match="ndarray"):
        cache.put("b", [sliced(), np.zeros(3)])
    with pytest.raises(TypeError, match="layout"):
        cache.put("b", torch.randn(3, 3).to_sparse())
    raw = torch.zeros(4 * UNIT, dtype=torch.uint8)
    with pytest.raises(TypeError, match="quantized dtype torch.qint8"):   # torch's copy of it raised RuntimeError,
        cache.put("b", raw.view(torch.qint8)[1:])                       # after "a" was evicted for it
    assert copies == [] and cache.keys() == ["a"]
    with pytest.raises(ValueError):
        OwnedCache(-1)


def test_check_invariants_detects_tampering():
    cache = OwnedCache(4 * UNIT)
    t = full()
    cache.put("a", t)
    t.resize_(512)  # the caller grows the cached tensor's storage behind the cache's back
    with pytest.raises(InvariantViolation, match="storages"):
        cache.check_invariants()


@pytest.mark.parametrize("arena", [False, True])
def test_check_invariants_names_the_key_of_a_tensor_whose_storage_was_freed_under_it(arena):
    # The caller frees a stored tensor's storage under it (FSDP-style): check_invariants raised check_ownable's
    # plain ValueError, not the InvariantViolation naming the entry that it promises for any mismatch.
    cache = OwnedCache(4 * UNIT, arena=Arena(8 * UNIT, "cpu") if arena else None)
    cache.put("a", full())
    cache.get("a").untyped_storage().resize_(0)
    with pytest.raises(InvariantViolation, match="'a' holds what put refuses.*got a storage of 0 bytes"):
        cache.check_invariants()


def test_get_returns_a_fresh_container_so_replacing_items_leaves_the_cache_alone():
    x, y = full(), full()
    cache = OwnedCache(4 * UNIT)
    assert cache.put("k", {"x": x, "nested": {"y": [y]}})
    got = cache.get("k")
    alive = StorageWeakRef(x.untyped_storage())
    got["x"] = full(3)  # e.g. an engine swapping in its processed tensor
    got["nested"]["y"][0] = full(3)
    del x, got
    gc.collect()
    again = cache.get("k")
    assert not alive.expired() and again["nested"]["y"][0] is y  # what the cache holds is unchanged
    assert cache.stats().current_bytes - accounting.leaf_bytes(again) == retained_bytes(again) == 2 * UNIT
    again["x"].fill_(7.0)  # the tensors are the stored objects: in-place writes reach the cache
    assert bool((cache.get("k")["x"] == 7.0).all())
    with cache.pinned("k") as value:
        value["x"] = full(3)
    assert cache.get("k")["x"] is again["x"]
    cache.check_invariants()


@pytest.mark.parametrize("wrap, inner", [
    (lambda x, y: Features(x, [y, 3]), lambda v: v.tokens),
    (lambda x, y: Pair(x, [y]), lambda v: v.right),
    (lambda x, y: Batch({"x": x, "y": [y]}, tensor_type="pt"), lambda v: v["y"]),
    (lambda x, y: [x, [y]], lambda v: v[1]),
    (lambda x, y: (x, [y]), lambda v: v[1]),
], ids=["dataclass", "namedtuple", "userdict", "list", "tuple"])
def test_get_rebuilds_every_container_kind(wrap, inner):
    cache = OwnedCache(4 * UNIT)
    assert cache.put("k", wrap(full(), full()))
    a, b = cache.get("k"), cache.get("k")
    assert type(a) is type(b) and a is not b and inner(a) is not inner(b)  # nested containers too
    ta, tb = list(accounting.iter_tensors(a)), list(accounting.iter_tensors(b))
    assert len(ta) == 2 and all(p is q for p, q in zip(ta, tb))  # the same tensor objects
    inner(a)[0] = full(3)
    assert all(p is q for p, q in zip(accounting.iter_tensors(cache.get("k")), tb))
    assert getattr(a, "tensor_type", "pt") == "pt"  # a UserDict's attributes are kept
    cache.check_invariants()


def test_batch_encoding_to_does_not_move_what_the_cache_holds():
    transformers = pytest.importorskip("transformers")
    cache = OwnedCache(4 * UNIT)
    assert cache.put("enc", transformers.BatchEncoding({"input_ids": torch.zeros(256, dtype=torch.int32)}))
    enc = cache.get("enc")
    assert enc.to("meta") is enc  # BatchEncoding.to replaces its items in place and returns itself
    assert enc["input_ids"].device.type == "meta" and cache.get("enc")["input_ids"].device.type == "cpu"
    assert cache.stats().current_bytes == UNIT + _keys("input_ids")
    cache.check_invariants()


def test_the_ledger_holds_a_charged_storage_so_its_key_cannot_be_reused():
    cache = OwnedCache(budget_bytes=300_000)
    assert cache.put("a", torch.randn(1000, 64))  # 256_000 B, kept as is
    t = cache.get("a")
    alive = StorageWeakRef(t.untyped_storage())
    t.set_(torch.empty(0))  # the caller repoints the cached tensor (outside the budget promise)
    del t
    gc.collect()
    assert not alive.expired()  # still charged, so still alive: no new storage can take its key
    with pytest.raises(InvariantViolation, match="storages"):  # and the set_ is seen
        cache.check_invariants()
    fresh = torch.randn(1000, 64)  # would often reuse a freed key: then it was admitted free
    assert cache.put("b", fresh) and cache.keys() == ["b"] and cache.stats().evictions == 1
    gc.collect()
    assert alive.expired() and cache.stats().current_bytes == 256_000  # released with its entry
    cache.check_invariants()


@pytest.mark.parametrize("copy", [False, True], ids=["kept", "copied"])
def test_plain_put_of_values_read_from_the_cache_may_evict_their_entries(copy):
    cache = OwnedCache(2 * UNIT)  # without an arena the caller's tensors keep the sources alive
    cache.put("p", torch.full((256,), 1.0))
    cache.put("q", torch.full((256,), 2.0))
    pair = (cache.get("q")[:128], cache.get("p")[:128]) if copy else (cache.get("q"), cache.get("p"))
    cache.put("x", full(2))  # evicts p and q
    assert cache.keys() == ["x"]
    assert cache.put("qp", pair)  # kept: charged 2 units, evicts x; copied: 1 unit, evicts x
    q2, p2 = cache.get("qp")
    assert bool((q2 == 2.0).all()) and bool((p2 == 1.0).all()) and cache.keys() == ["qp"]
    cache.put("p", torch.full((256,), 1.0))
    cache.put("q", torch.full((512,), 2.0)[:256])  # a copy: its source is the caller's, 2 units
    pair = (cache.get("q")[:128], cache.get("p")[:128])
    assert cache.put("pq2", pair)  # evicts from the LRU end, sources included; copies still right
    q3, p3 = cache.get("pq2")
    assert bool((q3 == 2.0).all()) and bool((p3 == 1.0).all())
    cache.check_invariants()


def test_eviction_skips_entries_that_free_nothing_for_the_new_value():
    """An entry holding only storages the new value keeps as they are (the same owned tensor under two
    keys) frees no bytes when evicted: the storage stays alive, charged to the new entry. It was evicted
    anyway, least recently used first, and lost for nothing. An entry of 0 bytes is evicted in its turn."""
    shared = torch.zeros(2 * UNIT // 4)  # 2 units, owns its storage: kept as it is, charged once
    cache = OwnedCache(4 * UNIT)
    cache.put("shared", shared)
    cache.put("empty", torch.zeros(0))
    cache.put("other", full(2))
    assert cache.stats().current_bytes == 4 * UNIT
    assert cache.put("new", [shared, full(1)])  # 3 units with "shared" or without it: "other" must go
    assert cache.keys() == ["shared", "new"] and cache.stats().evictions == 2  # "empty" went in its turn
    assert cache.stats().current_bytes == 3 * UNIT
    cache.check_invariants()
    cache.set_budget(0)  # every byte goes: "new" holds "shared"'s storage unpinned, so both go
    assert cache.keys() == [] and cache.stats().current_bytes == 0
    cache.check_invariants()
    # When the count is what binds, any entry makes room, least recently used first
    counted = OwnedCache(4 * UNIT, max_entries=2)
    counted.put("shared", shared)
    counted.put("other", full(1))
    assert counted.put("new", [shared, full(1)])
    assert counted.keys() == ["other", "new"]
    counted.check_invariants()


def test_eviction_takes_an_entry_the_new_value_shares_only_some_storages_with():
    """An entry of which the new value keeps only some storages frees the others when evicted: it is no
    entry that frees nothing, and goes in its turn, least recently used first, before a more recent one."""
    shared = full(1)
    cache = OwnedCache(3 * UNIT)
    cache.put("pair", [shared, full(1)])  # 2 units: "shared" and one only it holds
    cache.put("other", full(1))
    assert cache.put("new", [shared, full(1)])  # 2 units, 1 while "pair" holds "shared": one entry must go
    assert cache.keys() == ["other", "new"] and cache.stats().evictions == 1
    assert cache.stats().current_bytes == 3 * UNIT
    cache.check_invariants()


def test_entries_of_0_bytes_do_not_pile_up_in_a_cache_bounded_by_bytes():
    """Entries of 0 bytes (an empty tensor, an empty list) free nothing when evicted, but passed over they
    would never leave a cache without max_entries, and every eviction would look at each of them: they
    are evicted in their turn, least recently used first, by put and by set_budget."""
    cache = OwnedCache(4 * UNIT)
    for i in range(50):
        cache.put(("empty", i), [torch.zeros(0)] if i % 2 else [])
    for i in range(8):
        assert cache.put(i, full(1))
    assert cache.keys() == [4, 5, 6, 7] and cache.stats().evictions == 54
    cache.put("empty", torch.zeros(0))  # (no eviction: it fits)
    cache.set_budget(0)  # evicts until the charge fits: 4 to 7; "empty", used after them, stays
    assert cache.keys() == ["empty"] and cache.stats().evictions == 58
    cache.check_invariants()


def test_eviction_skips_entries_whose_storages_a_pinned_entry_holds():
    """An entry holding only what a pinned entry holds too frees nothing when evicted, by put or by
    set_budget: it stays."""
    shared = torch.zeros(2 * UNIT // 4)
    cache = OwnedCache(4 * UNIT)
    cache.put("alias", shared)
    cache.put("pinned", shared)
    cache.pin("pinned")
    cache.put("other", full(2))
    assert cache.stats().current_bytes == 4 * UNIT
    assert cache.put("new", full(1))
    assert cache.keys() == ["alias", "pinned", "new"] and cache.stats().current_bytes == 3 * UNIT
    cache.set_budget(2 * UNIT)  # "new" goes; "alias" frees nothing
    assert cache.keys() == ["alias", "pinned"] and cache.stats().current_bytes == 2 * UNIT
    assert cache.stats().evictions == 2
    cache.check_invariants()


# -- arena-backed ------------------------------------------------------------
def test_arena_entries_live_in_the_arena_and_count_block_size():
    arena = Arena(4096, "cpu", alignment=256)
    cache = OwnedCache(4096, arena=arena)
    x = torch.randn(25)  # 100 B: owned, still copied in
    e = torch.randn(1, 8).expand(4, 8)
    assert cache.put("k", {"x": x, "e": e})
    stored = cache.get("k")
    assert all(t.untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr() for t in stored.values())
    assert torch.equal(stored["x"], x) and torch.equal(stored["e"], e) and stored["e"].stride() == (0, 1)
    assert cache.stats().current_bytes - _keys("x", "e") == arena.allocated_bytes == 512  # 256 + 256 (32 B aligned)
    popped = cache.pop("k")
    assert torch.equal(popped["x"], x) and storage_bytes(popped["x"]) == 100  # copied out
    assert arena.allocated_bytes == 0
    cache.check_invariants()


def test_arena_packs_mixed_dtypes_at_aligned_offsets():
    arena = Arena(1 << 16, "cpu", alignment=64)
    cache = OwnedCache(1 << 16, arena=arena)
    value = [torch.arange(3, dtype=torch.int8), torch.randn(5, dtype=torch.complex128),
             torch.randn(7, 3, dtype=torch.bfloat16)[2:5], torch.tensor([True, False, True]),
             torch.randn(0, 4), torch.randn(2, 9, dtype=torch.float64).t()]
    assert cache.put("mix", value)
    stored = cache.get("mix")
    base = arena.buffer.data_ptr()
    for got, want in zip(stored, value):
        assert torch.equal(got, want) and got.dtype == want.dtype
        assert (got.data_ptr() - base) % 64 == 0
    # 3 B -> 64, 80 B -> 128, 18 B -> 64, 3 B -> 64, 0 B -> 0, 144 B -> 192
    assert cache.stats().current_bytes == arena.allocated_bytes == 512
    cache.check_invariants()
    with pytest.raises(ValueError, match="alignment"):
        OwnedCache(100, arena=Arena(1024, "cpu", alignment=8))


def test_arena_fragmentation_evicts_further():
    arena = Arena(1024, "cpu", alignment=256)
    cache = OwnedCache(1024, arena=arena)
    for k in "abcd":
        cache.put(k, torch.randn(64))  # 256 B each
    cache.remove("a")
    cache.remove("c")  # free: [0, 256) and [512, 768): 512 B, fragmented
    assert arena.fragmentation == 0.5
    assert cache.put("e", torch.randn(128))  # 512 B: bytes fit, no range does: evict b
    assert cache.keys() == ["d", "e"] and arena.free_ranges() == [(512, 256)]
    s = cache.stats()
    assert (s.evictions, s.fragmentation_evictions) == (1, 1)
    cache.check_invariants()


def test_a_value_read_from_the_arena_and_put_back_saves_only_what_it_kept_alive_elsewhere():
    """bytes_saved counted the whole arena buffer (alive anyway) for a value read from it and put back:
    1,048,320 bytes "saved" for a 256-byte entry."""
    cache = OwnedCache(1 << 20, arena=Arena(1 << 20, "cpu"))
    cache.put("a", torch.zeros(64))
    cache.put("b", cache.get("a"))
    assert cache.stats().bytes_saved == 0
    batch = torch.zeros(1000)                  # a view of a 4,000-byte batch: 3,744 bytes it no longer holds
    cache.put("c", batch[:64])
    assert cache.stats().bytes_saved == 4000 - 256
    cache.check_invariants()


def test_arena_rejects_when_pinned_blocks_leave_no_range(copies):
    arena = Arena(1024, "cpu", alignment=256)
    cache = OwnedCache(4096, arena=arena)  # the budget is not what binds here
    for k in "abc":
        cache.put(k, torch.randn(64))  # a [0, 256), b [256, 512), c [512, 768)
    cache.pin("a")
    cache.pin("c")
    n = len(copies)
    assert not cache.put("f", torch.randn(128))  # 512 B free even without b, in two pieces
    assert len(copies) == n and cache.keys() == ["a", "b", "c"]  # b was not evicted for nothing
    assert cache.stats().rejections == 1
    cache.unpin("c")
    assert cache.put("f", torch.randn(128)) and cache.keys() == ["a", "f"]  # b and c go, in LRU order
    cache.check_invariants()


@pytest.mark.parametrize("seed", range(4))
def test_arena_room_without_unpinned_entries_is_the_gaps_between_pinned_blocks(seed):
    """put asks whether a value fits once every unpinned entry is gone from the pinned blocks alone
    (gaps between them, O(pins)); the arena's own answer, with every other block freed, must agree
    in random states, and each put must then be admitted exactly when it says so."""
    rng = np.random.default_rng(seed)
    arena = Arena(4096, "cpu", alignment=64)
    cache = OwnedCache(4096, arena=arena)
    for i in range(300):
        keys = cache.keys()
        if keys and rng.random() < 0.3:
            k = keys[rng.integers(len(keys))]
            if cache.pins(k) and rng.random() < 0.6:
                cache.unpin(k)
            elif rng.random() < 0.5:
                cache.pin(k)
        value = torch.zeros(int(rng.integers(1, 300)))          # 4 B to 1.2 KiB: 64 B to 1.2 KiB blocks
        plan = cache._plan(value)
        stay = {k for k in keys if cache.pins(k)}
        others = [e.block for k, e in cache._entries.items() if k not in stay]
        expected = arena.can_alloc(plan.copy_bytes, also_free=others)
        assert cache._fits(plan, stay=stay) == expected
        evictions = cache.stats().evictions
        assert cache.put(i, value) == expected
        assert expected or (cache.stats().evictions == evictions and i not in cache)
    cache.check_invariants()


def test_arena_put_of_values_read_from_the_cache_never_evicts_their_blocks():
    arena = Arena(1024, "cpu", alignment=256)
    cache = OwnedCache(1024, arena=arena)
    cache.put("p", torch.full((64,), 1.0))  # [0, 256)
    cache.put("q", torch.full((64,), 2.0))  # [256, 512)
    cache.put("r", torch.full((64,), 3.0))  # [512, 768)
    pair = (cache.get("q"), cache.get("p"))
    cache.get("r")  # q, p least recently used, and read by the put
    assert cache.put("qp", pair)  # 512 B: evicts r, not q and p, whose blocks it reads
    assert cache.keys() == ["q", "p", "qp"] and cache.stats().evictions == 1
    q2, p2 = cache.get("qp")
    assert bool((q2 == 2.0).all()) and bool((p2 == 1.0).all())
    assert bool((cache.get("p") == 1.0).all()) and bool((cache.get("q") == 2.0).all())
    cache.check_invariants()


def test_arena_put_of_views_starting_inside_blocks_never_evicts_those_blocks():
    """A view read from an entry need not start at its block's start: the block is read all the same."""
    arena = Arena(1024, "cpu", alignment=256)
    cache = OwnedCache(1024, arena=arena)
    cache.put("p", torch.arange(64.0))  # [0, 256)
    cache.put("q", torch.arange(64.0) + 100)  # [256, 512)
    cache.put("r", torch.full((64,), 3.0))  # [512, 768)
    pair = (cache.get("q")[32:], cache.get("p")[16:])  # from bytes 128 and 64 of their blocks
    cache.get("r")  # q, p least recently used, and read by the put
    assert cache.put("qp", pair)
    assert cache.keys() == ["q", "p", "qp"] and cache.stats().evictions == 1
    q2, p2 = cache.get("qp")
    assert q2.tolist() == list(range(132, 164)) and p2.tolist() == list(range(16, 64))
    cache.check_invariants()


def test_arena_put_that_fits_only_by_evicting_its_sources_is_refused(copies):
    arena = Arena(512, "cpu", alignment=256)
    cache = OwnedCache(512, arena=arena)
    cache.put("p", torch.full((64,), 1.0))  # [0, 256)
    cache.put("q", torch.full((64,), 2.0))  # [256, 512): full
    n = len(copies)
    assert not cache.put("qp", (cache.get("q"), cache.get("p")))  # 512 B only over its own sources
    assert len(copies) == n and cache.keys() == ["q", "p"]
    assert bool((cache.get("p") == 1.0).all()) and bool((cache.get("q") == 2.0).all())
    s = cache.stats()
    assert (s.rejections, s.evictions, s.current_bytes) == (1, 0, 512)
    big = Arena(1024, "cpu", alignment=256)
    cache = OwnedCache(1024, arena=big)
    cache.put("x", torch.zeros(64))  # [0, 256)
    cache.put("a", torch.arange(128.0))  # [256, 768)
    assert not cache.put("b", cache.get("a"))  # no 512 B range without a's own block
    assert cache.keys() == ["x", "a"] and torch.equal(cache.get("a"), torch.arange(128.0))
    assert big.allocated_bytes == 768
    cache.check_invariants()


def test_arena_put_of_a_view_of_an_evicted_entry_raises_before_anything():
    arena = Arena(1024, "cpu", alignment=256)
    cache = OwnedCache(1024, arena=arena)
    cache.put("a", torch.arange(64.0))
    cache.put("b", torch.zeros(64))
    stale = cache.get("a")
    cache.remove("a")  # its block is free: the next block may be carved over the view
    with pytest.raises(ValueError, match="free arena bytes"):
        cache.put("c", {"s": stale})
    assert cache.keys() == ["b"] and arena.allocated_bytes == 256
    cache.check_invariants()


def test_arena_copy_that_raises_frees_its_block(monkeypatch):
    arena = Arena(1024, "cpu", alignment=256)
    cache = OwnedCache(1024, arena=arena)
    cache.put("a", torch.randn(64))

    def fail(t, out=None):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(ownership, "compact", fail)
    with pytest.raises(RuntimeError, match="copy failed"):
        cache.put("b", torch.randn(64))
    assert arena.allocated_bytes == 256 and arena.num_blocks == 1 and cache.keys() == ["a"]
    cache.check_invariants()


def test_check_invariants_finds_an_arena_block_no_entry_holds():
    arena = Arena(1024, "cpu", alignment=256)
    cache = OwnedCache(1024, arena=arena)
    cache.put("a", torch.randn(64))
    cache.check_invariants()
    arena.alloc(100)  # a leaked block
    with pytest.raises(InvariantViolation, match="leaked"):
        cache.check_invariants()


# -- random operation sequences against a model ------------------------------
OPS = st.lists(st.tuples(st.sampled_from(["put", "put", "get", "pin", "unpin", "pop"]),
                         st.integers(0, 5), st.integers(0, 5), st.booleans()), max_size=40)


@settings(max_examples=150, deadline=None)
@given(OPS, st.sampled_from([None, None, 0, 1, 2, 4]))
def test_random_ops_match_an_lru_model(ops, max_entries):
    budget = 6 * UNIT
    cache = OwnedCache(budget, max_entries=max_entries)
    order, size, pins = [], {}, {}  # the model
    evictions = rejections = 0
    for op, k, units, view in ops:
        if op == "put":
            ok = cache.put(k, (sliced if view else full)(units))
            if k in size:
                order.remove(k)
                order.append(k)
            elif units * UNIT + sum(size[p] for p in order if pins[p]) > budget or (
                    max_entries is not None and sum(1 for p in order if pins[p]) >= max_entries):
                rejections += 1
            else:
                while sum(size.values()) + units * UNIT > budget or (
                        max_entries is not None and len(size) >= max_entries):
                    victim = next(p for p in order if not pins[p])
                    order.remove(victim)
                    del size[victim], pins[victim]
                    evictions += 1
                order.append(k)
                size[k], pins[k] = units * UNIT, 0
            assert ok == (k in size)
        elif op == "get":
            assert (cache.get(k) is None) == (k not in size)
            if k in size:
                order.remove(k)
                order.append(k)
        elif op == "pin" and k in size:
            cache.pin(k)
            pins[k] += 1
        elif op == "unpin" and k in size and pins[k]:
            cache.unpin(k)
            pins[k] -= 1
        elif op == "pop" and k in size and not pins[k]:
            cache.pop(k)
            order.remove(k)
            del size[k], pins[k]
        cache.check_invariants()
        assert cache.keys() == order
        s = cache.stats()
        assert (s.current_bytes, s.evictions, s.rejections) == (sum(size.values()), evictions, rejections)


ARENA_OPS = st.lists(st.tuples(st.sampled_from(["put", "put", "get", "pin", "unpin", "pop", "reput"]),
                               st.integers(0, 5), st.integers(0, 5), st.booleans()), max_size=40)


@settings(max_examples=100, deadline=None)
@given(ARENA_OPS)
def test_random_ops_with_an_arena_keep_invariants(ops):
    arena = Arena(8 * UNIT, "cpu", alignment=256)
    cache = OwnedCache(6 * UNIT, arena=arena)
    for op, k, units, view in ops:
        if op == "put":
            t, new = (sliced if view else full)(units), k not in cache
            ok = cache.put(k, t)
            assert ok == (k in cache) and cache.keys()[-1:] == ([k] if ok else cache.keys()[-1:])
            if ok and new:
                assert torch.equal(cache.get(k), t)
        elif op == "reput" and k in cache:  # a value read from the cache, put back under key `units`
            src = cache.get(k)
            if view:  # the entry's first tensor and a view of its second half (an entry may be such a pair)
                t = next(iter(accounting.iter_tensors(src)))
                src = (t, t[t.numel() // 2:])
            want, new = [x.clone() for x in accounting.iter_tensors(src)], units not in cache
            if cache.put(units, src) and new:
                assert all(torch.equal(a, b) for a, b in zip(accounting.iter_tensors(cache.get(units)), want))
        elif op == "get":
            cache.get(k)
        elif op == "pin" and k in cache:
            cache.pin(k)
        elif op == "unpin" and k in cache and cache.pins(k):
            cache.unpin(k)
        elif op == "pop" and k in cache and not cache.pins(k):
            cache.pop(k)
        cache.check_invariants()
        assert cache.stats().current_bytes == arena.allocated_bytes <= 6 * UNIT


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_arena_cache_does_not_grow_reserved_memory():
    arena = Arena(64 << 20, "cuda")
    cache = OwnedCache(64 << 20, arena=arena)
    batch = torch.randn(1000, 4096, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    for i, item in enumerate(batch.split(100) * 20):
        assert cache.put(i, item)
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() == reserved
    assert torch.equal(cache.get(199), batch[900:])
    cache.check_invariants()
    with pytest.raises(ValueError, match="cannot enter an arena"):
        cache.put("cpu", torch.zeros(4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_split_item_end_to_end():
    batch = torch.randn(1000, 4096, dtype=torch.bfloat16, device="cuda")
    cache = OwnedCache(2 * ITEM_BYTES)
    cache.put("img", batch.split(100)[3])
    gc.collect()  # (what earlier tests left for the collector would be freed below, inside the delta)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    del batch
    gc.collect()
    assert torch.cuda.memory_allocated() == before - BATCH_BYTES
    assert cache.stats().current_bytes == ITEM_BYTES


def test_str_and_bytes_leaves_are_charged():
    # An image file's bytes cached beside its pixels keep 4 MiB alive: the budget sees them.
    blob, text = bytes(4 << 20), "a prompt " * 1000
    value = {"pixels": torch.zeros(16), "jpeg": blob, "text": text, "again": blob}
    cache = OwnedCache(8 << 20)
    assert cache.put("a", value)
    leaves = sys.getsizeof(blob) + sys.getsizeof(text) + _keys(*value)  # the same bytes object twice counts once
    assert cache.stats().current_bytes == 64 + leaves
    cache.check_invariants()
    other = bytes(5 << 20)
    assert cache.put("b", {"jpeg": other}) and "a" not in cache  # 4 + 5 MiB > 8 MiB: "a" is evicted for it
    assert cache.stats().current_bytes == sys.getsizeof(other) + _keys("jpeg")
    cache.check_invariants()
    assert not cache.put("c", "x" * (9 << 20))  # a str alone over the budget: refused
    cache.pop("b")
    assert cache.stats().current_bytes == 0


def test_str_and_bytes_leaves_are_charged_with_an_arena():
    arena = Arena(1 << 16, "cpu", alignment=256)
    cache = OwnedCache(1 << 20, arena=arena)
    assert cache.put("a", {"x": torch.zeros(16), "name": "x" * 1000})
    assert cache.stats().current_bytes == arena.allocated_bytes + sys.getsizeof("x" * 1000) + _keys("x", "name")
    cache.check_invariants()
    assert not cache.put("b", {"blob": bytes(2 << 20)})  # larger than the budget: refused
    cache.pop("a")
    assert cache.stats().current_bytes == 0 == arena.allocated_bytes
    cache.check_invariants()


def test_tensors_the_walkers_would_not_reach_are_refused_before_anything_is_evicted():
    """A tensor kept in a tensor's attributes or used as a dict key stays alive with the value but
    no walker counts it: put refuses it (TypeError) with the cache unchanged, as retained_bytes does."""
    cache = OwnedCache(3 * UNIT)
    assert cache.put("old", full(2))
    big = torch.zeros(1 << 20)  # 4 MiB the cache would keep alive uncharged
    tagged = full(1)
    tagged.scales = big
    stored = full(1)
    stored.untyped_storage().scales = big  # torch keeps the storage's Python object, and what it holds
    for value, what in [({big: 1}, "dict key"), ({"w": tagged}, "attributes"), ([{(1, big): "x"}], "dict key"),
                        ([stored], "the tensor's storage's attributes")]:
        with pytest.raises(TypeError, match=what):
            cache.put("new", value)
        with pytest.raises(TypeError, match=what):
            retained_bytes(value)
        assert cache.keys() == ["old"] and cache.stats().current_bytes == 2 * UNIT
    tagged.label = "w"  # a scalar attribute holds no bytes worth counting
    del tagged.scales
    assert cache.put("new", {"w": tagged, 7: full(0)})
    cache.check_invariants()


def test_threads_sharing_a_cache_keep_its_charge_exact():
    """Two threads putting, reading and popping (an encoder thread beside the scheduler): every call
    holds the cache's lock, so no exception escapes and emptied, the cache charges nothing. Without
    the lock this lost or doubled charges (a cache emptied still charged megabytes) and raised
    KeyError or StopIteration out of put and pop."""
    cache = OwnedCache(32 * UNIT)
    base = torch.randn(64, UNIT // 4)                      # rows of UNIT bytes, copied at put
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(2000):
                k = int(rng.integers(100))
                if rng.random() < 0.5:
                    cache.put(k, base[k % 64])
                elif rng.random() < 0.5:
                    cache.get(k)
                else:
                    cache.pop(k, None)
        except Exception as e:  # re-raised in the test's thread below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(2)]
    sys.setswitchinterval(1e-6)                            # switch threads as often as CPython allows
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sys.setswitchinterval(0.005)
    assert not any(t.is_alive() for t in threads) and not errors, errors[:1]
    cache.check_invariants()
    for k in cache.keys():
        cache.pop(k)
    assert cache.stats().current_bytes == 0 and len(cache) == 0


class _Tagged(dict):
    """A dict subclass with instance attributes (as some processors' outputs are)."""


class _Rows(list):
    pass


def test_attributes_hold_plain_data_only_and_come_back():
    """A tensor's or a container subclass's attributes stay alive with the value, and no walker
    charges them: anything but small plain data there (a tensor, an array, 64 KiB of bytes, a list
    holding a tensor, an object) is refused before the cache changes; scalar attributes are kept, a
    list subclass's too."""
    cache = OwnedCache(8 * UNIT)
    assert cache.put("old", full(1))
    before = (cache.keys(), cache.stats().current_bytes)
    big = bytes(64 << 10)
    for attr in (torch.zeros(1 << 16), np.zeros(1 << 16), big, "x" * 2000, [torch.zeros(4)], _Tagged()):
        t = full(1)
        t.extra = attr
        d = _Tagged(x=full(1))
        d.extra = attr
        rows = _Rows([full(1)])
        rows.extra = attr
        b = collections.UserDict({"x": full(1)})
        b.extra = attr
        for value in (t, {"w": t}, d, rows, b):
            with pytest.raises(TypeError, match="attributes \\('extra' holds"):
                cache.put("new", value)
            with pytest.raises(TypeError, match="attributes"):
                retained_bytes(value)
            assert (cache.keys(), cache.stats().current_bytes) == before
    rows = _Rows([torch.arange(8.0)[2:6], 3])
    rows.tag, rows.n = "img", np.int64(2)
    assert cache.put("rows", rows)
    got = cache.get("rows")
    assert type(got) is _Rows and (got.tag, got.n) == ("img", 2) and got[1] == 3
    assert torch.equal(got[0], torch.arange(2.0, 6.0)) and storage_bytes(got[0]) == 16
    cache.check_invariants()


def test_check_invariants_reports_a_grad_left_on_an_entry():
    cache = OwnedCache(4 * UNIT)
    cache.put("a", full(1))
    x = cache.get("a")  # the stored object itself
    x.requires_grad_(True)
    (x * 2).sum().backward()  # its .grad stays with the entry, uncharged
    with pytest.raises(InvariantViolation, match=r"'a' holds a tensor with a \.grad"):
        cache.check_invariants()


@pytest.mark.parametrize("dtype", [torch.uint4, torch.int2, torch.bits8, torch.bits16])
def test_views_of_dtypes_without_a_copy_kernel_are_copied_as_their_bytes(dtype):
    """torch has no copy_ for sub-byte and bit dtypes: a view of one needs a copy, which used to raise
    after the entries making room for it were evicted."""
    raw = torch.arange(256, dtype=torch.uint8 if torch.empty(0, dtype=dtype).element_size() == 1 else torch.int16)
    view = raw.view(dtype)[3:100:3]
    cache = OwnedCache(3 * UNIT + 8)
    for i in range(3):
        cache.put(i, full(1))
    assert cache.put("v", view) and cache.keys() == [1, 2, "v"]  # one entry evicted for it, then stored
    stored = cache.get("v")
    as_int = raw.dtype
    assert stored.dtype == dtype and storage_bytes(stored) == view.numel() * view.element_size()
    assert torch.equal(stored.view(as_int), view.view(as_int))
    cache.check_invariants()


def test_set_budget_evicts_down_to_it_and_refuses_below_the_pinned_entries():
    cache = OwnedCache(4 * UNIT)
    for k in "abcd":
        cache.put(k, full(1))
    cache.pin("a")
    cache.get("b")  # recency: c, d, a, b (a pinned)
    with pytest.raises(ValueError, match=r"expected at least the 1024 B the pinned entries are charged, got 1000"):
        cache.set_budget(1000)
    assert cache.budget_bytes == 4 * UNIT and len(cache) == 4  # nothing changed
    cache.set_budget(2 * UNIT)
    assert cache.keys() == ["a", "b"] and cache.stats().evictions == 2 and cache.stats().current_bytes == 2 * UNIT
    cache.check_invariants()
    assert cache.memory_bytes()["payload_bytes"] == 2 * UNIT
    with pytest.raises(AttributeError):
        cache.budget_bytes = 10 * UNIT  # through set_budget only: a plain assignment would skip the evictions
    cache.set_budget(10 * UNIT)
    assert cache.put("e", full(6)) and cache.stats().current_bytes == 8 * UNIT


def test_transformers_model_outputs_and_batch_features_are_cached_as_they_work():
    """A ModelOutput (an OrderedDict subclass that keeps each item as an attribute too) was refused:
    its attributes hold tensors. They are its own items, walked and charged as such; the copy comes
    back a working ModelOutput whose attributes and items are the same new tensors."""
    modeling_outputs = pytest.importorskip("transformers.modeling_outputs")
    from transformers import BatchFeature
    batch = torch.randn(10, 8, 16)                          # 5120 B
    out = modeling_outputs.BaseModelOutput(last_hidden_state=batch[2:4], hidden_states=(batch[0], batch[1]))
    assert retained_bytes(out) == 5120
    alive = StorageWeakRef(batch.untyped_storage())
    cache = OwnedCache(4 * UNIT)
    assert cache.put("out", out)
    assert cache.stats().current_bytes == 1024 + 2 * 512 + accounting.leaf_bytes(out) and cache.stats().compactions == 3
    del batch, out
    gc.collect()
    assert alive.expired()                                  # no attribute of the stored copy holds the batch
    got = cache.get("out")
    assert type(got) is modeling_outputs.BaseModelOutput and got.attentions is None
    assert got.last_hidden_state is got["last_hidden_state"] is got[0] and got.hidden_states is got["hidden_states"]
    assert storage_bytes(got.last_hidden_state) == 1024 and got.to_tuple()[1][1] is got.hidden_states[1]
    got["last_hidden_state"] = torch.zeros(1)               # replacing an item of what get returns ...
    assert cache.get("out").last_hidden_state.shape == (2, 8, 16)   # ... leaves the cache alone
    features = BatchFeature({"pixel_values": torch.randn(4, 3, 8, 8)[1:2]}, tensor_type="pt")
    assert cache.put("img", features)
    img = cache.get("img")
    assert type(img) is BatchFeature and storage_bytes(img["pixel_values"]) == 768 and img.pixel_values.shape[0] == 1
    cache.check_invariants()
    arena = Arena(4096, "cpu")
    in_arena = OwnedCache(4096, arena=arena)
    got = cache.get("out")
    assert in_arena.put("out", got)                        # every tensor copied into one block
    back = in_arena.get("out")
    assert back.last_hidden_state is back[0] and back.hidden_states is back["hidden_states"]
    assert back.last_hidden_state.untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr()
    assert torch.equal(back.last_hidden_state, got.last_hidden_state)
    assert in_arena.stats().current_bytes == 2048 + accounting.leaf_bytes(got)
    in_arena.check_invariants()


def test_a_tensor_marked_dynamic_by_torch_dynamo_is_cached():
    """torch._dynamo.mark_dynamic leaves sets, dicts and a set of small dataclasses in a tensor's
    attributes; they were refused (not scalars). Small plain containers are allowed now."""
    t = torch.randn(4, 8)
    torch._dynamo.mark_dynamic(t, 0, min=2, max=64)
    torch._dynamo.maybe_mark_dynamic(t, 1)
    assert any(isinstance(v, set) for v in vars(t).values())
    cache = OwnedCache(4 * UNIT)
    assert cache.put("x", t) and retained_bytes(t) == 128
    assert cache.get("x") is t and cache.get("x")._dynamo_dynamic_indices == {0}   # kept as is, marks too
    cache.check_invariants()


_Range = collections.namedtuple("_Range", "lo hi")


@dataclasses.dataclass(frozen=True, slots=True)
class _Span:  # as torch._dynamo's _DimRange: no __dict__, its fields in slots
    lo: object
    hi: object


@dataclasses.dataclass
class _ListRecord(list):
    """A dataclass that is also a list: its items are no field."""
    name: str = "r"


class _Slots:
    __slots__ = ("payload",)


@dataclasses.dataclass
class _SlottedRecord(_Slots):
    """A dataclass whose base's slot holds what no field names."""
    n: int

    def __post_init__(self):
        self.payload = torch.zeros(1 << 20)


def test_a_container_attribute_is_the_caches_own_copy():
    """An attribute list of a dict subclass was the caller's object in the cache and in every get: a
    tensor appended to it after put stayed alive through the cache, uncharged. The rebuilt container
    holds a deep copy of such small plain data: nothing added to the caller's or a get's reaches it."""
    cache = OwnedCache(8 * UNIT)
    value = _Tagged(x=full(1))
    value.meta = [1, 2]
    assert cache.put("k", value)
    got = cache.get("k")
    assert got.meta == [1, 2] and got.meta is not value.meta
    big = torch.zeros(1 << 20)
    alive = weakref.ref(big)
    value.meta.append(big)
    got.meta.append(big)
    del value, got, big
    gc.collect()
    assert alive() is None and cache.get("k").meta == [1, 2]
    assert cache.stats().current_bytes == UNIT + accounting.leaf_bytes(cache.get("k"))
    cache.check_invariants()


def test_attributes_may_hold_numpy_scalars_and_small_containers_of_scalars():
    """A numpy scalar (np.bool_ is no numbers.Number), a shape tuple, a torch.Size, a set of dims:
    small plain data, allowed. A container holding a tensor, over 64 items, nested over 2 levels,
    over 1,024 characters of text in all, or a large numpy scalar is still refused: it would stay
    alive uncharged."""
    cache = OwnedCache(8 * UNIT)
    allowed = [np.bool_(True), np.float32(0.5), np.datetime64("2024-01-01"), (2, 3), torch.Size([2, 3]),
               {0, 1}, frozenset("ab"), [1.5, None, "tag"], _Range(1, 2), _Span(0, None), {"dims": [0, 1], 3: (4, 5)},
               list(range(64)), ["x" * 512, "y" * 512], 2 ** 750, _Int(2 ** 640), np.void(bytes(1024))]
    for i, attr in enumerate(allowed):
        t = full(1)
        t.extra = attr
        rows = _Rows([full(1)])
        rows.extra = attr
        for value in (t, rows):
            assert retained_bytes(value) == UNIT
            assert cache.put((i, type(value).__name__), value)
            got = cache.get((i, type(value).__name__)).extra
            assert got == attr and type(got) is type(attr)
            # the rebuilt container's copy is its own: nothing added to the caller's reaches the cache
            if value is rows and isinstance(attr, (list, set, dict)):
                assert got is not attr
    cache.check_invariants()
    before = (cache.keys(), cache.stats().current_bytes)
    refused = [((torch.zeros(4),), "a tuple holding a Tensor"), ([np.zeros(3)], "a list holding a ndarray"),
               ({"w": torch.zeros(4)}, "a dict holding a Tensor"), (list(range(65)), "over 64"),
               ([[[1]]], "nested over 2"), (["x" * 600, "y" * 600], "over 1024"),
               (np.void(bytes(2048)), "numpy void of 2048 bytes"), (np.void(bytes(1025)), "numpy void of 1025"),
               (2 ** 780, "an int of 132 bytes"), (_Int(2 ** 670), "a _Int of 132 bytes"),
               (np.zeros(1 << 20, dtype="i4,i4")[0], "a numpy void viewing an array"),
               ([np.str_("x" * 600), np.str_("y" * 600)], "over 1024"),
               (_ListRecord([torch.zeros(4)]), "a dataclass that is also a container"),
               (_SlottedRecord(1), "a _SlottedRecord holding a Tensor"),
               ({_Span(torch.zeros(1), 2)}, "a set holding a _Span holding a Tensor"),
               ((1, _Rows()), "a tuple holding a _Rows")]
    for attr, why in refused:
        t = full(1)
        t.extra = attr
        for value in (t, {"w": t}):
            with pytest.raises(TypeError, match=f"attributes \\('extra' holds .*{why}"):
                cache.put("new", value)
            with pytest.raises(TypeError, match="attributes"):
                retained_bytes(value)
        assert (cache.keys(), cache.stats().current_bytes) == before


def test_arena_shared_with_another_user_refuses_what_does_not_fit_without_evicting():
    """With blocks of the arena held by another user, the room put computed from its own blocks'
    gaps over-promised: it evicted every entry, then StopIteration escaped. A foreign block is
    noticed (the arena has more blocks than the cache holds) and the arena's own check decides."""
    arena = Arena(4096, "cpu", alignment=256)
    a, b = OwnedCache(8192, arena=arena), OwnedCache(8192, arena=arena)   # a misuse: two users
    a.put(0, torch.zeros(64))
    a.put(1, torch.zeros(64))                             # [0, 512)
    b.put("b", torch.zeros(64))                           # [512, 768)
    a.put(2, torch.zeros(64))                             # [768, 1024)
    assert not a.put("x", torch.zeros(896))               # 3584 B: fits only if b's block were gone
    assert a.keys() == [0, 1, 2] and a.stats().evictions == 0 and a.stats().rejections == 1
    assert a.put("y", torch.zeros(768))                   # 3072 B: [1024, 4096), nothing evicted; arena full
    assert a.keys() == [0, 1, 2, "y"] and a.stats().evictions == 0 and not arena.can_alloc(1)
    assert a.put("z", torch.zeros(128))                   # 512 B: evicts 0 and 1 (LRU), not 2 (b's block between)
    assert a.keys() == [2, "y", "z"] and a.stats().evictions == a.stats().fragmentation_evictions == 2
    assert a._entries["z"].block.offset == 0 and b.keys() == ["b"] and torch.equal(b.get("b"), torch.zeros(64))
    with pytest.raises(InvariantViolation, match="another user of the arena"):
        a.check_invariants()


def test_put_whose_room_check_over_promised_refuses_instead_of_raising(monkeypatch):
    """Should the room check ever say a value fits once the unpinned entries are gone when it does
    not, put runs out of entries to evict: it refuses (False) instead of raising StopIteration."""
    cache = OwnedCache(2 * UNIT)
    cache.put("a", full(1))
    cache.pin("a")
    real = OwnedCache._fits
    monkeypatch.setattr(OwnedCache, "_fits", lambda self, plan, stay=None: stay is not None or real(self, plan))
    assert not cache.put("big", full(3))
    assert cache.keys() == ["a"] and cache.stats().rejections == 1
    cache.check_invariants()


def test_a_cache_cannot_be_copied_or_pickled():
    """A deepcopy or an unpickled cache charged storages it did not hold (its ledger keyed by the
    original's storages) and a shallow copy shared the original's entries; with the lock, deepcopy
    and pickle raised "cannot pickle '_thread.RLock' object". All three now say why, and the cache
    is unchanged."""
    for arena in (None, Arena(1024, "cpu")):
        cache = OwnedCache(4 * UNIT, arena=arena)
        cache.put("a", full(1))
        for clone in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match="an OwnedCache cannot be copied or pickled: its charge is keyed"):
                clone(cache)
        assert cache.keys() == ["a"] and cache.put("b", full(0)) and cache.get("b").numel() == 0
        cache.check_invariants()


class _Int(int):
    """An int subclass: its instances have a __dict__ of their own."""


class _Float(float):
    __slots__ = ("x",)


class _Text(str):
    pass


class _Colour(enum.Enum):
    RED = 1


def test_a_scalar_subclass_that_holds_a_tensor_is_refused_before_anything_is_evicted():
    """A subclass of int, float or str was a leaf: a tensor in its __dict__ or __slots__ stayed
    alive with the value, uncharged (16 MiB alive, 0 charged), as a value or inside a tensor's
    attribute. Its own attributes are held to the attribute rule now; small plain ones are kept."""
    cache = OwnedCache(3 * UNIT)
    assert cache.put("old", full(2))
    before = (cache.keys(), cache.stats().current_bytes)
    for cls, v in ((_Int, 3), (_Float, 1.5), (_Text, "a")):
        scalar = cls(v)
        if cls is _Float:
            scalar.x = torch.zeros(1 << 20)
        else:
            scalar.payload = torch.zeros(1 << 20)
        tagged = full(1)
        tagged.n = scalar
        for value, what in (({"n": scalar}, f"a {cls.__name__}'s attributes"), ([scalar], "attributes"),
                            (tagged, f"holds a {cls.__name__} holding a Tensor")):
            with pytest.raises(TypeError, match=what):
                cache.put("new", value)
            with pytest.raises(TypeError, match=what):
                retained_bytes(value)
            assert (cache.keys(), cache.stats().current_bytes) == before
    small = _Int(7)
    small.unit = "tokens"
    assert cache.put("new", {"n": small, "x": full(0)}) and cache.get("new")["n"].unit == "tokens"
    cache.check_invariants()


class _Key:
    def __init__(self, t):
        self.t = t

    def __hash__(self):
        return 1


@dataclasses.dataclass(frozen=True)
class _NamedKey:
    name: str
    emb: object = None


def test_dict_keys_are_charged_and_only_keys_that_cannot_be_are_refused():
    """A tensor in a dict key (an object or a dataclass used as a key, a tuple holding one) stayed alive
    with the value, uncharged; then keys were held to the attribute rule, which refused common keys (a
    token-id prefix of 100 ids, a 2,000-character prompt, a UUID, a date, a class, a path) and still
    charged none of their text (10,000 keys of 1,000 characters: 10 MB alive, 0 charged). Keys are
    charged like leaves now (their str, bytes and big ints, a path's text; tuples of any size), and only
    a key that cannot be charged is refused, before the cache changes; so is such a cache key."""
    cache = OwnedCache(3 * UNIT)
    assert cache.put("old", full(2))
    before = (cache.keys(), cache.stats().current_bytes, cache.stats().duplicates)
    big = torch.zeros(1 << 20)
    for key, what in ((_Key(big), r"\(a _Key\)"), (_NamedKey("a", big), "a _NamedKey holding a Tensor"),
                      (("a", (1, big)), "a tuple holding a tuple holding a Tensor"), (big, r"\(a Tensor\)"),
                      (decimal.Decimal("1" * 1000), "a Decimal of")):
        for value in ({key: full(0)}, [collections.UserDict({key: 1})]):
            with pytest.raises(TypeError, match=f"dict key.*{what}"):
                cache.put("new", value)
            with pytest.raises(TypeError, match="dict key"):
                retained_bytes(value)
            assert (cache.keys(), cache.stats().current_bytes, cache.stats().duplicates) == before
        if key is not big:
            continue
        for cache_key in (big, (big,), ("old", big)):   # the cache's own key stays alive with the entry too
            with pytest.raises(TypeError, match="the cache key"):
                cache.put(cache_key, full(0))
            assert (cache.keys(), cache.stats().current_bytes, cache.stats().duplicates) == before
    with pytest.raises(TypeError, match=r"key: expected a hashable key, as a dict's, got a list \(unhashable type"):
        cache.put([1, 2], full(0))                   # (it said the key's bytes could not be counted)
    assert (cache.keys(), cache.stats().current_bytes, cache.stats().duplicates) == before
    prompt, path = "p" * 2000, pathlib.Path("images") / "a.png"
    keys = {tuple(range(100)): 1, prompt: 2, uuid.uuid4(): 3, datetime.date(2024, 1, 1): 4, torch.Tensor: 5,
            path: 6, datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone.utc): 7, datetime.timedelta(3): 8,
            datetime.time(1, 2): 9, decimal.Decimal("1.5"): 10, fractions.Fraction(1, 3): 11, np.int64(3): 12,
            7: 13, 2.5: 14, None: 15, True: 16, b"k": 17, ("layer", 3): 18, frozenset("ab"): 19, _Colour.RED: 20,
            torch.float16: 21, _NamedKey("a"): full(0), (prompt, 10**1000): 22}
    charged = _keys(prompt, str(path), b"k", "layer", "a", "b", "a", 10**1000)   # prompt once: one object
    assert accounting.leaf_bytes(keys) >= charged
    cache.set_budget(64 << 10)
    assert cache.put("new", keys) and cache.get("new") == keys
    assert cache.stats().current_bytes == 2 * UNIT + accounting.leaf_bytes(keys)
    assert cache.put((uuid.uuid4(), "prefix", 3), full(0))   # a chargeable cache key is fine
    texts = {"p" * 1000 + str(i): 0 for i in range(100)}
    assert accounting.leaf_bytes(texts) == _keys(*texts) > 100_000
    cache.check_invariants()



def _run_time_class(payload):
    """A class made at run time, holding ``payload`` in a class attribute: no module holds it."""
    return type("RunTime", (), {"payload": payload})


def test_a_dict_key_that_is_a_class_made_at_run_time_is_refused():
    """Classes were accepted as keys, charged nothing: one made at run time (type(...), a local class) lives
    only as long as the key, with its class attributes (a 4 MiB tensor here stayed alive, 4 B charged). A class
    its module holds is fine, as before, and so is a member of an enum made at run time (its attributes read)."""
    big = torch.zeros(1 << 20)
    key = _run_time_class(big)
    cache = OwnedCache(64 << 10)
    for value in ({key: full(0)}, {(1, key): full(0)}, [collections.UserDict({key: 1})]):
        with pytest.raises(TypeError, match=r"dict key \((a tuple holding )?a class made at run time \(RunTime"):
            cache.put("new", value)
        with pytest.raises(TypeError, match="a class made at run time"):
            retained_bytes(value)
    with pytest.raises(TypeError, match=r"the cache key \(a class made at run time"):
        cache.put(key, full(0))
    assert len(cache) == 0 and cache.stats().current_bytes == 0
    assert cache.put("ok", {int: 1, type(None): 2, torch.Tensor: 3, _Colour: 4, OwnedCache: 5, _NamedKey: 6})
    member = enum.Enum("RunTimeEnum", "A B").A  # its attributes are read, and it is not remembered
    assert cache.put("enum", {member: 1, "m": member})
    cache.check_invariants()
    ref = weakref.ref(key)
    del key, value
    gc.collect()
    assert ref() is None  # nothing kept the refused class (a memo of the classes found unreachable would)


def test_a_class_its_module_no_longer_holds_is_refused_as_a_key(monkeypatch):
    """A class its module held when first seen was remembered as reachable for good: once the module dropped
    it (redefined, as a notebook cell run again does), it was still accepted as a key, charged nothing, and
    the memo kept it alive with its class attributes (a 4 MiB tensor here)."""
    module = type(sys)("_tpool_redefined")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    source = "import torch\nclass Key:\n    held = torch.zeros(1 << 20)\n"
    exec(source, module.__dict__)
    old = module.Key
    assert retained_bytes({old: 1}) >= 0  # held by its module: fine
    held = weakref.ref(old.held)
    exec(source, module.__dict__)  # redefined: the module holds another Key
    with pytest.raises(TypeError, match=r"a class made at run time \(Key"):
        retained_bytes({old: 1})
    assert retained_bytes({module.Key: 1}) >= 0
    del old
    gc.collect()
    assert held() is None  # nothing of tpool's kept the dropped class


def test_a_c_extensions_class_is_a_key_even_where_its_module_does_not_name_it():
    """A C extension's heap type (_thread.lock, re's scanner) is made once by the extension, not at run time,
    but its module holds no attribute of its qualified name: it was refused as "a class made at run time"
    (accepted before classes were checked). An immutable type is never a class statement's."""
    import re
    for cls in (type(threading.Lock()), type(re.compile("a").scanner("a"))):
        assert retained_bytes({cls: 1}) >= 0 and values._class_reachable(cls)
    assert not values._class_reachable(type("K", (), {}))


def _classes_made_at_run_time(payload):
    """A dataclass whose field default is ``payload`` and a slotted list subclass holding it as a class attribute,
    made in a function: no module holds them."""
    @dataclasses.dataclass
    class Request:
        x: torch.Tensor = payload

    class Slotted(list):
        __slots__ = ("tag",)
        held = payload

    return Request, Slotted


def test_the_walkers_memos_do_not_keep_a_class_made_at_run_time_alive():
    """The walkers remember each class's slots and a dataclass's field names; the memo (256 dataclasses, 4,096
    classes) held classes made at run time too, so once the cache let a value go, its class and all the class
    held (a 4 MiB field default here) stayed alive in the memo. Only classes a module holds are remembered now."""
    big = torch.zeros(1 << 20)
    ref = weakref.ref(big)
    request, slotted = _classes_made_at_run_time(big)
    del big
    cache = OwnedCache(64 << 10)
    value = slotted([request(full(1))])
    value.tag = "t"
    assert cache.put("r", value)
    assert cache.get("r")[0].x.shape == (256,) and cache.get("r").tag == "t"
    cache.check_invariants()
    cache.remove("r")
    del request, slotted, value
    gc.collect()
    assert ref() is None

class _SlottedList(list):
    __slots__ = ("x",)


class _SlottedDict(dict):
    __slots__ = ("x",)


class _SlottedSet(set):
    __slots__ = ("x",)


def test_a_container_subclass_slots_are_read_as_its_attributes():
    """A list, dict or set subclass's __slots__ were not read: a tensor there stayed alive with the
    value, uncharged (a dict subclass's, copied by copy.copy), or was dropped on the rebuild (a list's,
    a set's: get returned it without). They are held to the attribute rule now and come back from get.
    A dataclass's base slot (no field names it) is walked and charged like its other attributes."""
    cache = OwnedCache(3 * UNIT)
    assert cache.put("old", full(2))
    for cls, items in ((_SlottedList, [full(0)]), (_SlottedDict, {"a": full(0)}), (_SlottedSet, {1})):
        before = (cache.keys(), cache.stats().current_bytes)
        value = cls(items)
        value.x = torch.zeros(1 << 20)
        with pytest.raises(TypeError, match=f"a {cls.__name__}'s attributes \\('x' holds a Tensor"):
            cache.put("new", value)
        with pytest.raises(TypeError, match="attributes"):
            retained_bytes(value)
        assert (cache.keys(), cache.stats().current_bytes) == before
        value.x = [1, 2]
        assert cache.put(cls.__name__, value)
        got = cache.get(cls.__name__)
        assert type(got) is cls and got.x == [1, 2] and got.x is not value.x   # the cache's own copy
    record = _SlottedRecord(1)                         # a 4 MiB tensor in a base's slot
    assert retained_bytes([record]) == 4 << 20
    cache.set_budget(8 << 20)
    assert cache.put("record", record) and cache.stats().current_bytes == (4 << 20) + 2 * UNIT + _keys("a")
    assert cache.get("record").payload is record.payload
    cache.check_invariants()


def test_check_invariants_names_the_key_and_the_attribute_a_caller_added_after_put():
    """A tensor added to the attributes of a stored tensor after put (through the tensor get returns)
    stays alive uncharged; check_invariants raised the walker's TypeError. It reports it as the broken
    invariant it is, naming the key and the attribute; get still reads the entry."""
    cache = OwnedCache(4 * UNIT)
    assert cache.put("t", full(1)) and cache.put("d", {"w": full(1)})
    cache.check_invariants()
    cache.get("d")["w"].extra = torch.zeros(1 << 20)
    with pytest.raises(InvariantViolation, match=r"'d' holds what put refuses.*\('extra' holds a Tensor\)"):
        cache.check_invariants()
    del cache.get("d")["w"].extra
    cache.get("t").extra = torch.zeros(1 << 20)
    with pytest.raises(InvariantViolation, match=r"'t' holds what put refuses.*\('extra' holds a Tensor\)"):
        cache.check_invariants()
    assert cache.get("t") is cache.get("t") and cache.stats().current_bytes == 2 * UNIT + _keys("w")


def test_large_numbers_are_bounded_in_attributes_and_charged_as_values():
    """64 ints of 41 KiB each in a tensor's attribute passed the item count (64) and stayed alive,
    2.7 MiB uncharged; an int of 41 KiB as a value was charged nothing. A number in an attribute or a
    key may take 128 bytes (sys.getsizeof) at most, a Fraction's parts too; a large int leaf is
    charged its size, as a str or bytes leaf is."""
    cache = OwnedCache(4 * UNIT)
    assert cache.put("old", full(1))
    before = (cache.keys(), cache.stats().current_bytes)
    huge = 10**100000
    for attr, what in ((tuple(huge for _ in range(64)), "a tuple holding an int of"), (huge, "an int of"),
                       (fractions.Fraction(huge, 3), "a Fraction holding an int of"), (_Int(huge), "a _Int of")):
        t = full(1)
        t.extra = attr
        for value in (t, {"w": t}):
            with pytest.raises(TypeError, match=f"'extra' holds {what} \\d+ bytes \\(over 128\\)"):
                cache.put("new", value)
            assert (cache.keys(), cache.stats().current_bytes) == before
    t = full(1)
    t.extra = (2**700, -2**700, fractions.Fraction(1, 3), 2.5, 3j)   # under 128 bytes each
    assert cache.put("small", t)
    cache.set_budget(64 << 10)
    assert cache.put("n", {"n": huge, "m": 2**80})
    assert cache.stats().current_bytes == 2 * UNIT + sys.getsizeof(huge) + _keys("n", "m")
    cache.check_invariants()


def test_get_does_not_read_a_stored_tensors_attributes_again():
    """put checks a tensor's attributes (torch._dynamo's marks: sets and dataclasses, ~7 µs to read);
    get read them again on every call. A stored value was checked when it was put and the cache
    never changes it, so get returns it without reading them; a change by the caller since is
    check_invariants' to find (test above)."""
    t = torch.randn(8, 4)
    torch._dynamo.mark_dynamic(t, 0, min=2, max=64)
    cache = OwnedCache(4 * UNIT)
    assert cache.put("x", t) and cache.put("d", {"x": t, 3: 1})
    reads = []
    real = values._check_attrs
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(values, "_check_attrs", lambda *a, **k: reads.append(a[1]) or real(*a, **k))
        assert cache.get("x") is t and cache.get("d")["x"] is t
        with cache.pinned("d") as d:
            assert d["x"] is t
        assert reads == []
        cache.check_invariants()
        assert reads and set(reads) == {"a tensor"}   # check_invariants reads them


class _SlottedTensor(torch.Tensor):
    __slots__ = ("scales",)


class _(dict):  # an all-underscore name: Python does not mangle ``__x``
    __slots__ = ("__x",)


class _SlotBase(list):
    __slots__ = ("x",)


class _Shadowed(_SlotBase):
    __slots__ = ()
    x = None  # a class attribute over the base's slot


class _Lookup(list):
    __slots__ = ("tag", "__dict__")

    def __getattr__(self, name):
        return self.__dict__["extra"][name]  # KeyError, not AttributeError, for an unset slot


class _Default(list):
    __slots__ = ("tag",)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return "default"


class _OuterSlots(list):
    __slots__ = ("tag",)


class _InnerList(list):
    pass


def test_slots_are_read_and_written_through_their_descriptors():
    """Slot names were rebuilt from ``__slots__``: a tensor subclass's slots were not read (16 MiB alive,
    16 B charged), a ``__x`` slot of a class named ``_`` was mangled wrongly (not read), a slot shadowed
    by a class attribute raised AttributeError, a ``__getattr__`` fallback raised KeyError from put or
    was read as the value of an unset slot, and a memo cleared while a value was walked lost a
    container's slots from get. Slots are the member descriptors along the MRO, read and set through them."""
    cache = OwnedCache(8 * UNIT)
    t = torch.zeros(4).as_subclass(_SlottedTensor)
    t.scales = torch.zeros(1 << 20)
    u = _(a=full(0))
    setattr(u, "__x", torch.zeros(1 << 20))
    for value, what in ((t, r"a tensor's attributes \('scales' holds a Tensor"), (u, r"\('__x' holds a Tensor")):
        with pytest.raises(TypeError, match=what):
            cache.put("k", value)
        with pytest.raises(TypeError, match=what):
            retained_bytes(value)
    t.scales = (1, 2)
    assert cache.put("t", t) and cache.get("t").scales == (1, 2)
    shadowed = _Shadowed([full(0)])
    _SlotBase.x.__set__(shadowed, [3])
    assert cache.put("shadowed", shadowed) and _SlotBase.x.__get__(cache.get("shadowed")) == [3]
    lookup = _Lookup([full(0)])
    lookup.extra = {}
    assert cache.put("lookup", lookup) and cache.get("lookup").extra == {}
    assert cache.put("default", _Default([full(0)]))
    with pytest.raises(AttributeError):
        _Default.tag.__get__(cache.get("default"))  # still unset: "default" came from __getattr__
    outer = _OuterSlots([_InnerList([full(0)])])
    outer.tag = "keep me"
    assert cache.put("outer", outer)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(values, "_SLOTS_MAX", 1)  # every new class clears the memo: walking the inner list does
        values._SLOTS.clear()
        assert cache.get("outer").tag == "keep me"
    cache.check_invariants()


class _F64(np.float64):
    pass


def test_numpy_scalar_subclasses_and_enums_made_at_run_time_are_read():
    """A numpy scalar subclass's attributes were not read (a tensor there, in a key or in a tensor's
    attribute, stayed alive uncharged), and an enum member was always plain, though one of a class made
    at run time lives only in its members (``Enum("E", [("A", t)])``: 16 MiB alive, 0 charged). A numpy
    scalar subclass's attributes are read like any scalar subclass's; an enum member whose class its
    module does not hold is checked by its value and attributes."""
    cache = OwnedCache(4 * UNIT)
    big = torch.zeros(1 << 20)
    key = _F64(1.0)
    key.x = big
    scale = _F64(0.5)
    scale.x = big
    tagged = full(1)
    tagged.scale = scale
    run_time = enum.Enum("RunTime", [("A", big)])

    class Mode(enum.Enum):
        A = 1
        B = 2
    Mode.A.cache = big
    with_mode = full(1)
    with_mode.mode = Mode.A
    for value, what in (({key: 1}, "dict key.*a _F64 holding a Tensor"), (tagged, "'scale' holds a _F64 holding"),
                        ({"mode": run_time.A}, "RunTime member"), ({Mode.A: 1}, "dict key.*a Mode holding a Tensor"),
                        ({"m": [Mode.A]}, "Mode member"), (with_mode, "'mode' holds a Mode holding a Tensor")):
        with pytest.raises(TypeError, match=what):
            cache.put("k", value)
    assert cache.keys() == [] and cache.stats().current_bytes == 0
    scale.x = "fine"
    assert cache.put("scale", tagged) and cache.get("scale").scale.x == "fine"
    assert cache.put("plain", {Mode.B: [Mode.B], _Colour.RED: _Colour.RED, "e": enum.Enum("E", "X Y").X})
    cache.check_invariants()


def test_get_never_checks_and_check_invariants_raises_only_invariant_violation():
    """get re-checked a container subclass's attributes and raised TypeError after a caller's change; an
    int or str subclass instance in such an attribute was shared with the caller as immutable, though
    its __dict__ is not (a tensor added to it later was kept alive by the cache, uncharged); and
    check_invariants let a ZeroDivisionError out of a property. An attribute is shared only when its
    exact type is immutable (else the cache keeps its own copy), get reads without checking, and
    check_invariants reports any error of a re-walk as an InvariantViolation naming the key."""
    cache = OwnedCache(4 * UNIT)
    n = _Int(3)
    n.tag = "x"
    value = _Rows([full(0)])
    value.n = n
    assert cache.put("rows", value)
    n.extra = alive = torch.zeros(1 << 20)
    ref = weakref.ref(alive)
    del alive, value, n
    gc.collect()
    assert ref() is None                                     # the cache's copy of n holds no tensor
    cache._entries["rows"].value.n.extra = torch.zeros(1)    # a change to what the cache holds...
    assert cache.get("rows").n == 3                         # ...is not get's to report
    with pytest.raises(InvariantViolation, match="'rows' holds what put refuses"):
        cache.check_invariants()
    del cache._entries["rows"].value.n.extra

    @dataclasses.dataclass
    class Meta:
        a: int = 1
    t = full(1)
    t.meta = Meta()
    assert cache.put("t", t)
    cache.check_invariants()
    Meta.a = property(lambda self: 1 / 0)
    with pytest.raises(InvariantViolation, match="'t' holds what put refuses.*ZeroDivisionError"):
        cache.check_invariants()


def test_a_list_of_token_ids_is_walked_without_asking_each_id_its_kind():
    """put and get of 1,000 token ids got 18-20% slower: each int went through the kind dispatch (and a
    generator) of the walkers. An exact scalar in a container is taken as it is."""
    cache = OwnedCache(64 * UNIT)  # (the ids are charged: the list's 8 KB and 743 int objects of 28 B)
    value = {"ids": list(range(1000)), "t": full(1)}
    calls = []
    real = values._kind
    with pytest.MonkeyPatch.context() as mp:
        counting = lambda obj, check=True: calls.append(type(obj)) or real(obj, check)  # noqa: E731
        mp.setattr(values, "_kind", counting)
        mp.setattr(ownership, "_kind", counting)
        assert cache.put("k", value) and cache.get("k")["ids"] == value["ids"]
    assert int not in calls


IDS = 100_000  # token ids of one request
IDS_LIST = 800_056  # bytes: sys.getsizeof(list(range(IDS))), a list copied without spare room (64-bit CPython)
IDS_TUPLE = 800_040  # bytes: sys.getsizeof(tuple(range(IDS)))
INT = 28  # bytes: sys.getsizeof(1000), an int of up to 30 bits


def test_a_list_of_token_ids_is_charged_its_list_and_its_ints():
    """A value holding 100,000 token ids as a Python list kept ~3.6 MB alive (the list, 800 KB, and 2.8 MB of
    int objects) and was charged only its tensor and its keys' text: 20 such entries were charged 2,520 B while
    the process grew by 86 MB. A list of numbers is charged its sys.getsizeof and its int objects'."""
    ids = list(range(1000, 1000 + IDS))  # (no shared small int: 100,000 int objects of 28 B)
    assert (sys.getsizeof(ids), sys.getsizeof(ids[0]), sys.getsizeof(1000 + IDS)) == (IDS_LIST, INT, INT)
    cache = OwnedCache(16 << 20)
    assert cache.put("r", {"input_ids": ids, "emb": torch.zeros(4)})
    charge = _keys("input_ids", "emb") + IDS_LIST + IDS * INT
    assert cache.stats().current_bytes == 16 + charge == 3_600_182
    stored = cache._entries["r"].value["input_ids"]
    assert stored == ids and stored is not ids  # a copy: the caller's list may still change
    ids.append(7)
    got = cache.get("r")["input_ids"]
    got.append(8)  # (get returns a copy too)
    assert cache.stats().current_bytes == 16 + charge
    cache.check_invariants()
    assert cache.put("r2", {"input_ids": list(range(5000, 5000 + IDS)), "emb": torch.zeros(4)})
    assert cache.stats().current_bytes == 32 + 2 * charge  # (another tensor, other ids)
    cache.set_budget(4 << 20)  # room for one: the least recently used goes, and its charge with it
    assert cache.keys() == ["r2"] and cache.stats().current_bytes == 16 + charge
    cache.check_invariants()
    assert cache.pop("r2") is not None and cache.stats().current_bytes == 0
    cache.check_invariants()


def test_a_list_of_token_ids_over_the_budget_is_refused():
    """The charge is what admission prices: 100,000 ids do not fit in 1 MB, whatever tensor they come with."""
    cache = OwnedCache(1 << 20)
    assert not cache.put("r", {"input_ids": list(range(1000, 1000 + IDS)), "emb": torch.zeros(4)})
    assert cache.put("r", {"input_ids": torch.arange(1000, 1000 + IDS), "emb": torch.zeros(4)})  # 800 KB, charged
    cache.check_invariants()


def test_a_tuple_of_token_ids_as_a_dict_key_is_charged_its_tuple_and_its_ints():
    """A dict key of 100,000 ids (a prefix) kept its tuple and its ints alive, charged ~0."""
    prefix = tuple(range(1000, 1000 + IDS))
    cache = OwnedCache(16 << 20)
    assert cache.put("p", {prefix: torch.zeros(4)}) and cache.put("q", {("layer", prefix): torch.zeros(4)})
    assert cache.stats().current_bytes == 2 * 16 + 2 * (IDS_TUPLE + IDS * INT) + _keys("layer")
    assert next(iter(cache._entries["p"].value)) is prefix  # (a key is kept as it is)
    assert accounting.leaf_bytes({prefix: 1, (prefix, 2): 3}) == IDS_TUPLE + IDS * INT  # the same tuple: once
    cache.check_invariants()
    cache.clear()
    assert cache.stats().current_bytes == 0


def test_a_tuple_of_numpy_ids_as_a_dict_key_is_charged_its_tuple_and_its_scalars():
    """A prefix key made of a numpy array's ids (``tuple(ids)``: one np.int64 object per id, which a value's
    list could not hold) is charged as a tuple of ints is, its tuple and each scalar (helper-204's mutation
    run: reading keys with the value's number types charged this one 0 and no test failed)."""
    prefix = tuple(np.arange(1000, 2000, dtype=np.int64))
    want = sys.getsizeof(prefix) + sum(map(sys.getsizeof, prefix))  # 8,040 + 1,000 * 32
    assert accounting.leaf_bytes({prefix: torch.zeros(4)}) == want
    cache = OwnedCache(1 << 20)
    assert cache.put("p", {prefix: torch.zeros(4)})
    assert cache.stats().current_bytes == 16 + want
    cache.check_invariants()


def test_a_tuple_of_numpy_bools_as_a_dict_key_is_charged_its_tuple_only():
    """A dict key of numpy bools (a mask as a tuple) is a tuple of numbers: its tuple is charged, and never
    numpy's two bools, one object each that every such key shares (helper-204's mutation run: numpy's bools
    dropped from the numbers or from the shared objects, and no test failed)."""
    mask = tuple(np.array([True, False, True, True]))
    assert mask[0] is np.True_ and mask[1] is np.False_
    assert accounting.leaf_bytes({mask: torch.zeros(4)}) == sys.getsizeof(mask)
    cache = OwnedCache(1 << 20)
    assert cache.put("m", {mask: torch.zeros(4)})
    assert cache.stats().current_bytes == 16 + sys.getsizeof(mask)
    cache.check_invariants()


def test_a_list_of_numbers_held_twice_and_a_number_in_two_lists_are_charged_once():
    """Each object once, by identity: a list held under two keys of a value is stored as one copy (still one
    object) and charged once; an int in two lists, once; the shared small ints and bools, never."""
    big = int("1000000")  # (made at run time: no constant of the test's code shares it)
    ids = [big, 2000, 3000]
    value = {"a": ids, "b": ids, "c": [big, 7, True], "d": (big, 4000)}
    cache = OwnedCache(1 << 20)
    assert cache.put("k", value)
    stored = cache._entries["k"].value
    assert stored["a"] is stored["b"] and stored["a"] is not ids and stored["d"] is value["d"]
    lists = sys.getsizeof(list(ids)) + sys.getsizeof(list(value["c"])) + sys.getsizeof(value["d"])
    assert cache.stats().current_bytes == _keys("a", "b", "c", "d") + lists + 4 * INT  # big, 2000, 3000, 4000
    got = cache.get("k")
    assert got["a"] is got["b"] and got == value
    cache.check_invariants()


def test_a_list_of_small_ints_is_charged_its_container_only():
    """The ints -5..256 are objects CPython shares: never charged. An empty list is charged (it stays alive),
    the empty tuple, one object the interpreter shares, is not."""
    cache = OwnedCache(1 << 20)
    ids = [1, 2, 3, 256, -5]
    assert cache.put("k", {"ids": ids, "none": [], "nil": ()})
    assert cache.stats().current_bytes == _keys("ids", "none", "nil") + sys.getsizeof(list(ids)) + 56
    bools = [True, False, 0]
    assert accounting.leaf_bytes(bools) == sys.getsizeof(bools)
    cache.check_invariants()


def test_a_batch_of_id_lists_padded_with_none_is_charged_its_ids():
    """A batch of token-id rows padded with None to one length (`[ids..., None, None]`) was structure, charged
    0, though it kept its ids alive (100,000 ids and one None: 3.6 MB, charged 0). None is a padding among
    numbers, one object CPython shares: the row is charged its list and its ints, never the None."""
    ids = list(range(1000, 1000 + IDS))
    assert accounting.leaf_bytes(ids + [None]) == sys.getsizeof(ids + [None]) + IDS * INT
    rows = [list(range(1000, 1100)) + [None] * 4, list(range(2000, 2104))]
    cache = OwnedCache(1 << 20)
    assert cache.put("k", {"ids": rows})
    assert cache.stats().current_bytes == _keys("ids") + sum(sys.getsizeof(list(r)) for r in rows) + 204 * INT
    got = cache.get("k")["ids"]
    assert got == rows and got[0] is not rows[0]
    assert accounting.leaf_bytes([None, None]) == sys.getsizeof([None, None])  # the list; the None, never
    assert accounting.leaf_bytes({(1000, None): 1}) == sys.getsizeof((1000, None)) + INT  # a padded prefix key
    cache.check_invariants()


def test_floats_and_complex_numbers_in_a_list_are_charged():
    half = float("0.5")
    scores = [half, half, 1.5]
    assert accounting.leaf_bytes(scores) == sys.getsizeof(scores) + 2 * 24  # the list, and two float objects
    assert accounting.leaf_bytes({1j, 2.0}) == sys.getsizeof({1j, 2.0}) + 32 + 24
    assert accounting.leaf_bytes(frozenset((np.float64(1.5),))) == sys.getsizeof(frozenset((1,))) + 32
    cache = OwnedCache(1 << 20)
    assert cache.put("k", {"scores": scores})
    assert cache.stats().current_bytes == _keys("scores") + sys.getsizeof(list(scores)) + 2 * 24  # (its copy)
    cache.check_invariants()


def test_a_list_holding_a_tensor_or_text_is_structure_not_charged():
    """A list that holds a tensor, text or another container is the value's structure, uncharged as before
    (its text, big ints and lists of numbers are charged as leaves; its small ints are not)."""
    t = torch.zeros(4)
    cache = OwnedCache(1 << 20)
    assert cache.put("k", [t, 1000, 2000])
    assert cache.stats().current_bytes == 16
    assert accounting.leaf_bytes(["a", 1000]) == _keys("a")
    batch = [[1000, 2000], [3000]]
    assert accounting.leaf_bytes(batch) == sum(map(sys.getsizeof, batch)) + 3 * INT  # its rows are charged
    cache.check_invariants()


def _model_leaf_charge(value) -> int:
    """leaf_bytes by a plain recursive reading of its rule (shared small ints and bools by value, not by id)."""
    seen = {}

    def items(x):
        if all(type(y) in (int, float, complex, bool) for y in x):
            if x != ():
                seen[id(x)] = x
            seen.update((id(y), y) for y in x if type(y) is not bool and not (type(y) is int and -5 <= y <= 256))
        else:
            for y in x:
                walk(y)

    def walk(x):
        if type(x) in (str, bytes) or type(x) is int and sys.getsizeof(x) > 128:
            seen[id(x)] = x
        elif type(x) in (list, tuple, set, frozenset):
            items(x)
        elif type(x) is dict:
            for k, v in x.items():
                walk(k)
                walk(v)

    walk(value)
    return sum(sys.getsizeof(x) for x in seen.values())


@pytest.mark.parametrize("seed", range(12))
def test_random_values_are_charged_their_text_and_lists_of_numbers(seed):
    """Random nests of dicts, lists, tuples and sets with shared lists, shared big ints, floats, small ints,
    text and tensors: the cache charges what the model reads in what it stores, and check_invariants agrees."""
    rng = np.random.default_rng(seed)
    pool = [int(rng.integers(257, 1 << 40)), 10 ** 50, 0.5, "w"]  # objects a value may hold twice

    def number():
        return [lambda: int(rng.integers(-10, 300)), lambda: int(rng.integers(1 << 20)), lambda: float(rng.random()),
                lambda: bool(rng.integers(2)), lambda: pool[int(rng.integers(3))]][int(rng.integers(5))]()

    def make(depth):
        kind = int(rng.integers(7 if depth < 3 else 2))
        if kind == 0:
            return [number() for _ in range(int(rng.integers(0, 6)))]
        if kind == 1:
            return tuple(number() for _ in range(int(rng.integers(0, 4))))
        if kind == 2:
            return torch.zeros(int(rng.integers(1, 4)))
        if kind == 3:
            return "t" * int(rng.integers(1, 5))
        if kind == 4:
            shared = make(depth + 1)
            return [shared, make(depth + 1), shared]
        if kind == 5:
            return {(f"k{i}" if i % 2 else tuple(number() for _ in range(2))): make(depth + 1) for i in range(3)}
        return {number() for _ in range(int(rng.integers(1, 4)))}

    cache = OwnedCache(1 << 30)
    for i in range(6):
        value = {"v": make(0)}
        assert cache.put(i, value)
        stored = cache._entries[i].value
        assert cache._entries[i].leaf_bytes == _model_leaf_charge(stored)
        assert accounting.leaf_bytes(value) == _model_leaf_charge(value)
    cache.check_invariants()
    cache.clear()
    assert cache.stats().current_bytes == 0


def _dies_with(make_value, put=True):
    """``(alive, cache)``: a weak reference to what ``make_value()`` (``(value, extra)``) holds beside its
    storages, after the value was put (or not) and every other reference dropped."""
    value, extra = make_value()
    ref, cache = weakref.ref(extra), OwnedCache(1 << 20)
    if put:
        assert cache.put("k", value)
    del value, extra
    gc.collect()
    return ref() is not None, cache


def test_a_kept_view_does_not_keep_the_viewed_tensors_grad_alive():
    """A no-grad view of a leaf with a ``.grad`` keeps the leaf alive (``_base``): kept as given, the
    cache kept the gradient alive, uncharged, and ``retained_bytes`` did not count it."""
    def make():
        x = torch.zeros(1000, requires_grad=True)
        x.grad = torch.ones(1000)
        with torch.no_grad():
            v = x.view(10, 100)
        assert v.grad_fn is None and v._base is x
        return v, x.grad

    value, grad = make()
    assert retained_bytes([value]) == 8000                      # the storage and the viewed tensor's .grad
    o = ownership.own(value)
    assert o._base is None and o.data_ptr() == value.data_ptr() and o.stride() == value.stride()
    alive, cache = _dies_with(make)
    assert not alive and cache.stats().current_bytes == 4000
    cache.check_invariants()


def test_a_view_of_a_tensor_with_attributes():
    """What a view keeps alive through the tensor it views is its attributes too: more than small plain
    data there is refused, as on the tensor itself; a small tag is dropped with the view's detach."""
    x = torch.zeros(1000)
    x.extra = torch.zeros(1000)
    with pytest.raises(TypeError, match=r"viewed tensor's attributes \('extra' holds a Tensor\)"):
        OwnedCache(1 << 20).put("k", x.view(10, 100))
    with pytest.raises(TypeError, match="viewed tensor's attributes"):
        retained_bytes([x[:]])
    y = torch.zeros(1000)
    y.tag = "small"
    cache = OwnedCache(1 << 20)
    assert cache.put("k", y.view(10, 100)) and cache.get("k")._base is None


def test_a_hook_on_a_kept_leaf_does_not_keep_its_closure_alive():
    def make():
        t, big = torch.zeros(1000, requires_grad=True), torch.zeros(10**5)
        t.register_hook(lambda g: g + big[:1000])
        return t, big

    alive, cache = _dies_with(make)
    assert not alive and cache.stats().current_bytes == 4000
    assert cache.get("k").requires_grad and cache.get("k")._backward_hooks is None
    t, q = torch.zeros(4, requires_grad=True), torch.nn.Parameter(torch.zeros(4))
    t.register_hook(lambda g: g).remove()                 # a removed hook leaves an empty dict behind
    q.register_post_accumulate_grad_hook(lambda p: None).remove()
    assert ownership.own(t) is t and ownership.own(q) is q


def test_a_defaultdicts_factory_is_refused_unless_a_class():
    big = torch.zeros(10)
    d = collections.defaultdict(lambda: big, ids=torch.zeros(4))
    for call in (lambda: retained_bytes(d), lambda: OwnedCache(1 << 20).put("k", d)):
        with pytest.raises(TypeError, match=r"defaultdict's default_factory \(a function\)"):
            call()
    cache = OwnedCache(1 << 20)
    assert cache.put("k", collections.defaultdict(list, ids=torch.zeros(4)))
    got = cache.get("k")
    assert type(got) is collections.defaultdict and got["missing"] == []


def test_gradients_a_value_keeps_alive_are_counted_sparse_and_retained_ones_too():
    emb = torch.nn.Embedding(100, 8, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    g = emb.weight.grad.coalesce()
    emb.weight.grad = g
    parts = g._indices().untyped_storage().nbytes() + g._values().untyped_storage().nbytes()
    assert retained_bytes([emb.weight]) == 100 * 8 * 4 + parts   # refused before: a sparse tensor
    assert OwnedCache(1 << 20).put("w", emb.weight)
    x = torch.zeros(1000, requires_grad=True)
    y = x * 2
    y.retain_grad()
    y.sum().backward()
    assert retained_bytes([y]) == 8000                          # y and its retained .grad (was 4000)


def test_a_value_that_holds_itself_is_a_type_error():
    loop = [torch.zeros(4)]
    loop.append(loop)
    d = {"t": torch.zeros(4)}
    d["self"] = d
    for value in (loop, d):
        for call in (retained_bytes, values.leaf_bytes, lambda v: ownership.map_tensors(v, lambda t: t),
                     lambda v: OwnedCache(1 << 20).put("k", v)):
            with pytest.raises(TypeError, match="holds itself"):
                call(value)


def test_arena_bytes_saved_subtracts_the_block_not_the_payload():
    """bytes_saved is what the value kept alive less what the cache charges: with an arena, the block size."""
    cache = OwnedCache(1 << 16, arena=Arena(1 << 16, "cpu", alignment=256))
    batch = torch.zeros(1000)                 # 4,000-byte storage
    assert cache.put("c", batch[:3])          # 12 B payload in a 256 B block
    assert cache.stats().current_bytes == 256
    assert cache.stats().bytes_saved == 4000 - 256
    cache.check_invariants()


def test_arena_payload_bytes_are_the_values_not_the_blocks():
    """memory_bytes() reports the payload (what the tensors need) apart from the block bytes charged."""
    cache = OwnedCache(1 << 16, arena=Arena(1 << 16, "cpu", alignment=256))
    assert cache.put("a", torch.ones(3))      # 12 B in a 256 B block
    m = cache.memory_bytes()
    assert (m["payload_bytes"], m["storage_bytes"]) == (12, 256)
    cache.remove("a")
    m = cache.memory_bytes()
    assert (m["payload_bytes"], m["storage_bytes"]) == (0, 0)
    cache.check_invariants()


def test_memory_bytes_peak_is_the_peak_not_the_current_charge():
    """memory_bytes()["peak_bytes"] keeps the high-water mark after entries go, as stats() does."""
    cache = OwnedCache(1 << 20)
    cache.put("a", torch.ones(256))
    cache.put("b", torch.ones(512))
    cache.remove("a")
    cache.remove("b")
    m = cache.memory_bytes()
    assert m["storage_bytes"] == 0
    assert m["peak_bytes"] == cache.stats().peak_bytes == 3 * 1024


def test_pop_of_a_pinned_entry_is_refused_and_keeps_it():
    """pop, like remove and clear, never removes a pinned entry: ValueError, nothing removed."""
    cache = OwnedCache(1 << 20)
    t = torch.arange(8.0)
    cache.put("a", t)
    cache.pin("a")
    charge = cache.stats().current_bytes
    with pytest.raises(ValueError, match="pinned"):
        cache.pop("a")
    with pytest.raises(ValueError, match="pinned"):
        cache.pop("a", None)
    assert "a" in cache and cache.pins("a") == 1 and cache.stats().current_bytes == charge
    assert torch.equal(cache.get("a"), t)
    cache.unpin("a")
    assert torch.equal(cache.pop("a"), t) and len(cache) == 0
    cache.check_invariants()


def test_pinned_entries_counts_entries_not_pins():
    """stats().pinned_entries is the number of pinned entries, however many pins each has."""
    cache = OwnedCache(1 << 20)
    cache.put("a", torch.ones(4))
    cache.put("b", torch.ones(4))
    for _ in range(3):
        cache.pin("a")
    assert cache.pins("a") == 3 and cache.stats().pinned_entries == 1
    cache.pin("b")
    assert cache.stats().pinned_entries == 2


def test_pinned_block_is_no_hit_and_keeps_recency():
    """with cache.pinned(key): neither a hit nor a recency refresh (the next eviction candidate stays)."""
    cache = OwnedCache(1 << 20)
    cache.put("a", torch.ones(4))
    cache.put("b", torch.ones(4))
    with cache.pinned("a") as value:
        assert torch.equal(value, torch.ones(4))
        assert cache.pins("a") == 1
    s = cache.stats()
    assert (s.hits, s.misses) == (0, 0)
    assert cache.keys() == ["a", "b"] and cache.pins("a") == 0


def test_check_invariants_detects_an_overcharge():
    """A charge above what the entries hold is a broken invariant, not only one below it."""
    cache = OwnedCache(1 << 20)
    cache.put("a", torch.ones(256))
    cache.check_invariants()
    cache._current += 1     # the ledger counts one byte more than the entries hold
    cache._peak += 1        # (so only the recount can see it)
    with pytest.raises(InvariantViolation, match="current_bytes"):
        cache.check_invariants()


def test_pinned_str_leaves_count_in_the_room_check():
    """A pinned entry's str leaves are charged, so a put that cannot fit beside them is refused with
    nothing evicted, and the budget cannot go below them."""
    cache = OwnedCache(1 << 20)
    cache.put("a", {"t": torch.ones(256), "s": "x" * 2000})
    cache.pin("a")
    charge_a = cache.stats().current_bytes
    assert charge_a > 1024 + 2000
    cache.put("b", torch.ones(256))                          # 1024 B, unpinned
    cache.set_budget(charge_a + 1024)                        # a and b exactly
    assert not cache.put("c", torch.ones(512))               # 2048 B: does not fit even without b
    assert cache.keys() == ["a", "b"] and cache.stats().evictions == 0
    with pytest.raises(ValueError, match="pinned entries are charged"):
        cache.set_budget(charge_a - 1)
    assert cache.keys() == ["a", "b"] and cache.budget_bytes == charge_a + 1024
    cache.check_invariants()


def test_arena_pinned_blocks_count_in_the_room_check():
    """With an arena a pinned entry is charged its block: a put that cannot fit in the budget beside it
    is refused with nothing evicted, and the budget cannot go below it."""
    cache = OwnedCache(700, arena=Arena(4096, "cpu", alignment=256))
    cache.put("a", torch.ones(64))                           # 256 B block
    cache.pin("a")
    cache.put("x", torch.ones(64))                           # 256 B block, unpinned
    assert not cache.put("c", torch.ones(128))               # 512 B: 256 + 512 > 700 even without x
    assert cache.keys() == ["a", "x"] and cache.stats().evictions == 0
    with pytest.raises(ValueError, match="pinned entries are charged"):
        cache.set_budget(255)
    assert cache.keys() == ["a", "x"] and cache.budget_bytes == 700
    cache.check_invariants()


def test_arena_put_over_budget_without_its_sources_evicts_nothing():
    """A value read from the cache and put back, that fits the byte budget only by evicting its own
    source, is refused before anything (another entry) is evicted."""
    cache = OwnedCache(768, arena=Arena(4096, "cpu", alignment=256))
    cache.put("x", torch.zeros(64))                          # 256 B
    cache.put("a", torch.arange(128.0))                      # 512 B
    assert not cache.put("b", cache.get("a"))                # 512 + 512 > 768 with a kept
    assert cache.keys() == ["x", "a"]
    s = cache.stats()
    assert (s.evictions, s.rejections, s.current_bytes) == (0, 1, 768)
    cache.check_invariants()


def test_arena_put_back_does_not_protect_the_block_just_before_its_source():
    """Only the blocks a put-back value reads are kept for it: the entry whose block ends where the
    source's starts may be evicted to make room."""
    cache = OwnedCache(512, arena=Arena(1024, "cpu", alignment=256))
    cache.put("a", torch.zeros(64))                          # [0, 256)
    cache.put("b", torch.full((64,), 2.0))                   # [256, 512)
    assert cache.put("c", cache.get("b"))                    # evicts a, keeps b (read)
    assert cache.keys() == ["b", "c"] and cache.stats().evictions == 1
    assert bool((cache.get("c") == 2.0).all()) and bool((cache.get("b") == 2.0).all())
    cache.check_invariants()


def test_arena_put_back_of_an_expanded_view_reads_only_its_span():
    """An expanded (stride 0) view of an entry reads its span, not numel() elements: free arena bytes
    past the block are not read, and the put is admitted."""
    arena = Arena(4096, "cpu", alignment=256)
    cache = OwnedCache(4096, arena=arena)
    cache.put("a", torch.arange(4.0))                        # [0, 256); the rest free
    v = cache.get("a")[:1].expand(512)                       # 512 elements over 4 bytes
    assert cache.put("b", v)
    assert torch.equal(cache.get("b"), v) and cache.keys() == ["a", "b"]
    cache.check_invariants()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_a_tensor_on_another_device_than_the_arena_is_refused():
    """A CUDA tensor cannot enter a CPU arena: ValueError naming both devices, before anything changes."""
    cache = OwnedCache(1 << 16, arena=Arena(1 << 16, "cpu"))
    cache.put("a", torch.ones(4))
    with pytest.raises(ValueError, match="tensor on cuda:0 cannot enter an arena on cpu"):
        cache.put("g", torch.ones(4, device="cuda"))
    assert cache.keys() == ["a"] and cache.stats().rejections == 0
    cache.check_invariants()


@pytest.mark.parametrize("arena", [False, True])
def test_a_value_put_under_inference_mode_is_written_in_place_outside_it(arena):
    # README: in-place writes to what get returns reach the cache. A copy made under torch.inference_mode() (a
    # serving loop's usual mode) was an inference tensor, and such a write outside the mode raised RuntimeError.
    with torch.inference_mode():
        cache = OwnedCache(4 * UNIT, arena=Arena(8 * UNIT, "cpu") if arena else None)
        batch = torch.arange(512.0)
        assert cache.put("k", {"x": batch[256:], "y": batch[300:310]})
    got = cache.get("k")
    got["x"].mul_(2)
    assert cache.get("k")["x"][:2].tolist() == [512.0, 514.0] and not got["y"].is_inference()
    cache.check_invariants()
