"""Byte counting and view-to-owned compaction (tpool.memory.accounting and tpool.memory.ownership)."""

import collections
import dataclasses
import functools
import gc
import sys
import types
import weakref

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.multiprocessing.reductions import StorageWeakRef

from tpool.memory import ownership, values
from tpool.memory.accounting import compact_bytes, payload_bytes, retained_bytes, storage_bytes, storage_key
from tpool.memory.ownership import map_tensors, needs_compaction, own, plan_ownership

BATCH_BYTES = 1000 * 4096 * 2  # a [1000, 4096] bf16 batch: 8_192_000 B = 7.81 MiB
ITEM_BYTES = 100 * 4096 * 2  # one [100, 4096] item of it: 819_200 B = 0.78 MiB


def _base():
    return torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)


def _inference_slice():
    with torch.inference_mode():
        return _base()[1:3]


def _resized():
    t = torch.arange(10, dtype=torch.float32)
    return t.resize_(5)  # storage keeps 40 B for a 20 B payload


# name -> (make tensor, whether own() must copy it)
KINDS = {
    "whole": (_base, False),
    "split item": (lambda: _base().split(2)[1], True),
    "row slice": (lambda: _base()[2:4], True),
    "column stride": (lambda: _base()[:, ::2], True),
    "transposed whole": (lambda: _base().t(), False),
    "transposed slice": (lambda: _base()[1:4].t(), True),
    "expanded whole": (lambda: torch.arange(8.0).expand(5, 8), False),
    "expanded row of a batch": (lambda: _base()[2:3].expand(50, 8), True),
    "unfolded windows (overlap)": (lambda: torch.arange(16.0).unfold(0, 4, 2), False),
    "detached slice": (lambda: _base().detach()[3:], True),
    "detached whole": (lambda: _base().detach(), False),
    "inference-mode slice": (_inference_slice, True),
    "zero-size slice": (lambda: _base()[3:3], True),
    "zero-size whole": (lambda: torch.empty(0, 4), False),
    "view of view": (lambda: _base()[1:5][1:3, ::2], True),
    "flat view of whole": (lambda: _base().view(-1), False),
    "0-dim element": (lambda: _base()[2, 3], True),
    "0-dim whole": (lambda: torch.tensor(3.5), False),
    "resized smaller": (_resized, True),
    "channels_last whole": (lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last), False),
    "conj slice": (lambda: torch.randn(4, 3, dtype=torch.complex64)[1:3].conj(), True),
    "bool slice": (lambda: (torch.arange(20) % 3 == 0)[5:9], True),
    "int8 strided": (lambda: torch.arange(64, dtype=torch.int8).reshape(8, 8)[::2, 1::3], True),
    "bf16 slice": (lambda: torch.randn(10, 7, dtype=torch.bfloat16)[3:], True),
    "expanded column of a batch": (lambda: _base()[:, 3:4].expand(-1, 50), True),
    "numpy whole": (lambda: torch.from_numpy(np.arange(12.0)), True),
    "numpy row": (lambda: torch.from_numpy(np.arange(12.0).reshape(3, 4)[1]), True),
    "frombuffer": (lambda: torch.frombuffer(bytearray(64), dtype=torch.float32), True),
    "dlpack of a whole tensor": (lambda: torch.from_dlpack(_base()), True),
    "shared memory whole": (lambda: _base().share_memory_(), False),
}


@pytest.mark.parametrize("name", list(KINDS))
def test_own_every_kind(name):
    make, copies = KINDS[name]
    t = make()
    assert needs_compaction(t) is copies
    o = own(t)
    assert (o is not t) is copies
    assert o.dtype == t.dtype and o.device == t.device and o.shape == t.shape
    assert torch.equal(o.resolve_conj(), t.resolve_conj())
    if copies:
        assert storage_bytes(o) == compact_bytes(t) <= storage_bytes(t)
        assert storage_bytes(o) < storage_bytes(t) or not t.untyped_storage().resizable()
        assert o.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    assert not needs_compaction(o) and own(o) is o  # idempotent


def test_split_item_is_compacted_to_its_payload():
    batch = torch.randn(1000, 4096, dtype=torch.bfloat16)
    item = batch.split(100)[3]
    assert (payload_bytes(item), storage_bytes(item)) == (ITEM_BYTES, BATCH_BYTES)
    assert retained_bytes([item]) == BATCH_BYTES
    owned = own(item)
    assert storage_bytes(owned) == ITEM_BYTES and owned.is_contiguous()
    alive = StorageWeakRef(batch.untyped_storage())
    del batch, item
    gc.collect()
    assert alive.expired() and torch.isfinite(owned.float()).all()


def test_expanded_whole_is_not_copied():
    row = torch.randn(1, 4096)
    e = row.expand(1000, 4096)
    assert payload_bytes(e) == 1000 * storage_bytes(e)
    o = own(e)
    assert o is e and o.data_ptr() == row.data_ptr()


def test_expanded_row_of_batch_keeps_stride_zero():
    batch = torch.randn(1000, 64)
    e = batch[7:8].expand(2000, 64)  # payload (2000 rows) > storage (1000 rows), reaches 1 row
    o = own(e)
    assert o.stride() == (0, 1) and storage_bytes(o) == 64 * 4
    assert torch.equal(o, e)


def test_requires_grad_kept_and_copy_is_a_leaf():
    w = torch.randn(10, 4, requires_grad=True)
    o = own((w * 2)[2:5])
    assert o.requires_grad and o.is_leaf and o.grad_fn is None
    assert own(w) is w
    assert not own(torch.randn(10, 4)[2:5]).requires_grad


def test_offset_view_of_whole_storage_with_equal_payload_is_owned():
    flat = torch.arange(12.0)
    v = flat.view(3, 4)  # offset 0, payload == storage
    assert own(v) is v
    shifted = torch.arange(13.0)[1:]  # same payload, but storage one element larger
    assert needs_compaction(shifted) and storage_bytes(own(shifted)) == 48


class _FakeDispatch(torch.Tensor):
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("make, kind", [
    (lambda: torch.randn(3, 3).to_sparse(), "layout"),
    (lambda: torch.empty(3, device="meta"), "meta"),
    (lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)], layout=torch.jagged), "nested"),
    (lambda: torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8), "quantized"),
    (lambda: torch.zeros(64, dtype=torch.uint8).view(torch.qint8)[1:20], "quantized dtype torch.qint8"),
    (lambda: torch.randn(4).as_subclass(_FakeDispatch), "__torch_dispatch__"),
    (lambda: torch._efficientzerotensor(10), "zero tensor"),   # storage_bytes said 40 B that do not exist
    (lambda: np.zeros(3), "torch.Tensor"),
    (lambda: [torch.zeros(3)], "torch.Tensor"),
])
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_unownable_raise_typeerror(make, kind):
    t = make()
    for fn in (own, needs_compaction, storage_bytes, payload_bytes):
        with pytest.raises(TypeError, match=kind):
            fn(t)


def test_retained_bytes_counts_each_storage_once():
    batch = torch.zeros(1000, 4096, dtype=torch.bfloat16)
    items = batch.split(100)
    assert retained_bytes(items) == BATCH_BYTES
    assert retained_bytes(t for t in items) == BATCH_BYTES  # generator
    other = torch.zeros(10)
    assert retained_bytes([items[0], other, items[9].t(), other[2:]]) == BATCH_BYTES + 40
    assert retained_bytes(batch) == BATCH_BYTES
    assert retained_bytes([]) == 0


@dataclasses.dataclass(frozen=True)
class _Item:
    emb: torch.Tensor
    extra: dict
    label: str = "x"


def test_retained_bytes_nested_containers_and_errors():
    a, b = torch.zeros(100), torch.zeros(50)
    value = _Item(a[10:20], {"k": (b, [a[:5], "text", 3])})
    assert retained_bytes(value) == 600
    assert retained_bytes([value, {"again": b}]) == 600
    for bad in (3, "abc", None):
        with pytest.raises(TypeError):
            retained_bytes(bad)


def test_storage_key_identity():
    a = torch.zeros(8)
    assert storage_key(a[2:]) == storage_key(a.view(2, 4).t()) != storage_key(a.clone())
    assert storage_key(a)[:2] == ("cpu", -1)


def test_map_tensors_rebuilds_and_rejects_unknown_leaves():
    a = torch.zeros(3)
    value = {"x": (a, [a, 1.5, None]), "y": _Item(a, {})}
    doubled = map_tensors(value, lambda t: t + 1)
    assert doubled["y"].label == "x" and torch.equal(doubled["x"][1][0], a + 1)
    assert value["x"][0] is a  # the input is not mutated
    with pytest.raises(TypeError, match="ndarray"):
        map_tensors({"x": np.zeros(3)}, lambda t: t)


def test_plan_ownership_prices_before_copying(monkeypatch):
    batch = torch.zeros(1000, 4096, dtype=torch.bfloat16)
    items = batch.split(100)
    calls = []
    real = ownership.compact
    monkeypatch.setattr(ownership, "compact", lambda t, out=None: calls.append(t) or real(t, out=out))
    whole = plan_ownership({"all": list(items)})  # the views cover the storage: keep it
    assert (whole.copy, whole.copy_bytes, whole.keep) == ((), 0, {storage_key(batch): BATCH_BYTES})
    two = plan_ownership((items[0], items[7], items[0]), align=1024)
    assert len(two.copy) == 2 and two.copy_bytes == 2 * ITEM_BYTES and two.keep == {}
    assert (two.retained_bytes, two.payload_bytes) == (BATCH_BYTES, 2 * ITEM_BYTES)
    assert calls == []  # planning copies nothing
    a, b, c = two.apply()
    assert len(calls) == 2 and a is c and torch.equal(b, items[7]) and retained_bytes([a, b]) == 2 * ITEM_BYTES
    odd = plan_ownership([torch.zeros(3), torch.zeros(5)], copy_all=True, align=16)
    assert odd.copy_bytes == 16 + 32  # 12 B and 20 B, each rounded up to a multiple of 16
    packed = odd.apply(torch.empty(48, dtype=torch.uint8))
    assert packed[1].data_ptr() - packed[0].data_ptr() == 16


@st.composite
def _views(draw):
    shape = draw(st.lists(st.integers(0, 5), min_size=1, max_size=3))
    t = torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape)
    for _ in range(draw(st.integers(0, 3))):
        d = draw(st.integers(0, t.dim() - 1))
        op = draw(st.sampled_from(["slice", "step", "transpose", "expand", "select"]))
        n = t.shape[d]
        if op == "slice" and n:
            lo = draw(st.integers(0, n - 1))
            t = t.narrow(d, lo, draw(st.integers(0, n - lo)))
        elif op == "step" and n:
            t = t[(slice(None),) * d + (slice(None, None, draw(st.integers(1, 3))),)]
        elif op == "transpose" and t.dim() >= 2:
            t = t.transpose(0, d if d else 1)
        elif op == "expand" and t.dim() < 4:
            t = t.unsqueeze(d).expand(*t.shape[:d], draw(st.integers(0, 4)), *t.shape[d:])
        elif op == "select" and n and t.dim() > 1:
            t = t.select(d, draw(st.integers(0, n - 1)))
    return t


@settings(max_examples=300, deadline=None)
@given(_views())
def test_own_property(t):
    o = own(t)
    assert torch.equal(o, t) and o.shape == t.shape
    if needs_compaction(t):
        assert storage_bytes(o) == min(payload_bytes(t), compact_bytes(t)) < storage_bytes(t)
    else:
        assert o is t
    assert storage_bytes(o) <= storage_bytes(t)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_own_and_devices_counted_apart():
    batch = torch.randn(1000, 4096, dtype=torch.bfloat16, device="cuda")
    item = own(batch.split(100)[3])
    assert item.device == batch.device and storage_bytes(item) == ITEM_BYTES
    assert torch.equal(item, batch[300:400])
    cpu = torch.zeros(100)
    assert retained_bytes([batch[:1], batch[5:], cpu, cpu[3:]]) == BATCH_BYTES + 400
    assert storage_key(batch)[:2] == ("cuda", batch.device.index)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_one_out_for_views_on_two_devices_is_refused():
    """One ``out`` cannot hold copies from a CPU and a CUDA storage: refused before any copy."""
    value = [torch.zeros(1000)[:10], torch.zeros(1000, device="cuda")[:10]]
    plan = plan_ownership(value)
    for device in ("cpu", "cuda"):
        out = torch.zeros(plan.copy_bytes, dtype=torch.uint8, device=device)
        with pytest.raises(ValueError, match="expected the views to copy on one device"):
            plan.apply(out=out)
        assert not out.any()
    assert all(torch.equal(o, v) and o.device == v.device for o, v in zip(plan.apply(), value))


# -- memory torch did not allocate, storage identity, history, reach -------------------
def test_memory_torch_did_not_allocate_is_copied_and_the_owner_freed():
    big = np.zeros((1000, 4096), dtype=np.float32)  # 16_384_000 B
    item = torch.from_numpy(big[300:400])  # its storage: the 1_638_400 B it wraps
    assert not item.untyped_storage().resizable() and storage_bytes(item) == 1_638_400  # torch sees the part
    assert needs_compaction(item) and plan_ownership(item).keep == {}
    owned = own(item)
    assert owned is not item and owned.untyped_storage().resizable() and storage_bytes(owned) == 1_638_400
    assert torch.equal(owned, item) and own(owned) is owned
    alive = weakref.ref(big)
    del big, item
    gc.collect()
    assert alive() is None  # the copy keeps no reference to the numpy array


def test_what_resizable_says_for_torch_allocated_storages():
    assert torch.empty(3).untyped_storage().resizable() and torch.tensor([1.0]).untyped_storage().resizable()
    shared = torch.zeros(8).share_memory_()
    assert shared.is_shared() and shared.untyped_storage().resizable() and own(shared) is shared
    try:
        pinned = torch.zeros(8).pin_memory()
    except RuntimeError:  # a torch without an accelerator has no pinned-memory allocator
        pytest.skip("pin_memory() needs an accelerator")
    # torch's _pin_memory: not resizable, but torch's own memory of exactly the tensor's bytes: kept
    assert not pinned.untyped_storage().resizable() and not needs_compaction(pinned) and own(pinned) is pinned
    assert needs_compaction(pinned[2:4])  # a pinned view is judged by its size like any other


def test_a_copy_of_a_pinned_view_is_pinned(monkeypatch):
    """A pinned view that needs compaction (a slice of a pinned host batch: a host KV tier, say) was copied
    into pageable memory, so a later ``.to("cuda", non_blocking=True)`` of what own() or an OwnedCache
    returned waited on the host. The copy is pinned too, alone (compact) or as a cluster's range. On a
    machine without an accelerator pinned memory is faked: storages report pinned, and torch.empty records
    what it was asked for."""
    asked = []
    try:
        batch = torch.arange(64.0).pin_memory()
    except RuntimeError:  # no accelerator: fake one whose every host storage is pinned
        batch = torch.arange(64.0)
        empty = torch.empty

        def recording_empty(*args, pin_memory=False, **kwargs):
            asked.append(pin_memory)
            return empty(*args, **kwargs)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.UntypedStorage, "is_pinned", lambda self, device="cuda": True)
        monkeypatch.setattr(torch, "empty", recording_empty)
    item = own(batch[8:12])                                     # compact: one view
    windows = plan_ownership([batch[0:10], batch[5:15]]).apply()  # one range, both views on it
    assert torch.equal(item, batch[8:12]) and item.untyped_storage().data_ptr() != batch.untyped_storage().data_ptr()
    assert torch.equal(windows[1], batch[5:15]) and windows[0][5].data_ptr() == windows[1][0].data_ptr()
    if asked:
        assert asked[:1] == [True] and True in asked[1:], asked   # (the cluster's other empties are set_ shells)
    else:
        assert item.is_pinned() and windows[0].is_pinned()


def test_own_works_where_the_cuda_runtime_cannot_be_asked(monkeypatch):
    """A worker forked from a process that used CUDA cannot ask the runtime whether memory is pinned (torch
    raises): since every compaction asks, own() would fail there. Nothing counts as pinned: a from_numpy view is
    copied (its size unknown), a copy of a torch-allocated view is made pageable."""
    import numpy as np

    def asked(self, device="cuda"):
        raise RuntimeError("CUDA error: initialization error")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)     # a GPU machine, in a forked worker
    monkeypatch.setattr(torch.UntypedStorage, "is_pinned", asked)
    x = torch.arange(64.0)
    assert torch.equal(own(x[3:9]), x[3:9]) and torch.equal(own(torch.from_numpy(np.arange(8.0))[2:5]), x[2:5].double())
    assert torch.equal(plan_ownership([x[0:10], x[5:15]]).apply()[1], x[5:15])


def test_storage_key_is_the_storage_object_not_its_address():
    arr = np.zeros((1000, 1024), dtype=np.float32)  # 4_096_000 B
    head, whole = torch.from_numpy(arr[:1]), torch.from_numpy(arr)  # two storages at one address
    assert head.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
    assert storage_key(head) != storage_key(whole)
    both = plan_ownership([head, whole])
    assert len(both.views) == 2 and len(both.copy) == 2  # two storages (neither resizable: both copied)
    # ... over one memory, counted once by address
    assert retained_bytes([head, whole]) == both.retained_bytes == 4_096_000
    assert retained_bytes([whole, head]) == plan_ownership([whole, head]).retained_bytes == 4_096_000
    t = torch.zeros(1024)
    key = storage_key(t)
    t.resize_(100_000)  # the bytes move, the storage object stays
    assert storage_key(t) == key == storage_key(t[5:])


def test_kept_tensor_with_history_is_detached_so_saved_activations_are_freed():
    w = torch.randn(64, requires_grad=True)
    act = torch.randn(1000, 64) * w  # saved by the mul below
    alive = StorageWeakRef(act.untyped_storage())
    emb = (act * act).mean(0)  # owns its 256 B storage, but its grad_fn holds act
    o = own(emb)
    assert o is not emb and o.grad_fn is None and o.is_leaf and o.requires_grad
    assert o.untyped_storage().data_ptr() == emb.untyped_storage().data_ptr()  # no copy
    a, b, c = plan_ownership([emb, emb, w]).apply()
    assert a is b and a.grad_fn is None and a.data_ptr() == emb.data_ptr() and c is w
    del act, emb, a, b
    gc.collect()
    assert alive.expired()
    no_grad = (torch.randn(4) * torch.randn(4, requires_grad=True)).detach()
    assert own(no_grad) is no_grad


def test_expand_of_a_strided_view_copies_its_distinct_values():
    x = torch.randn(1000, 64)
    col = x[:, 3:4].expand(-1, 64)  # 1000 distinct floats, strides (64, 0)
    assert compact_bytes(col) == 4000 and needs_compaction(col)
    o = own(col)
    assert storage_bytes(o) == 4000 and o.stride() == (1, 0) and torch.equal(o, col)
    plan = plan_ownership([col], copy_all=True, align=16)  # the arena path sizes it the same
    assert plan.copy_bytes == 4000
    (packed,) = plan.apply(torch.empty(4000, dtype=torch.uint8))
    assert torch.equal(packed, col) and packed.stride() == (1, 0)
    windows = torch.arange(16.0).unfold(0, 4, 2)[None].expand(3, -1, -1)  # overlap and expand
    assert compact_bytes(windows) == 64 and torch.equal(own(windows), windows)


@pytest.mark.parametrize("make, need, have", [
    (lambda: torch.randn(100, 8), 3200, 0),  # freed under it (FSDP-style resize_(0))
    (lambda: torch.randn(100, 8)[10:20], 640, 64),  # a view past a shrunk storage
    (lambda: torch.randn(100, 8)[10:20], 640, 636),  # one element short: its last value is not there
])
def test_tensor_reaching_past_its_storage_raises(make, need, have):
    t = make()
    t.untyped_storage().resize_(have)
    for fn in (own, needs_compaction, storage_bytes, compact_bytes, storage_key, plan_ownership):
        with pytest.raises(ValueError, match=f"at least {need} bytes.*got a storage of {have} bytes"):
            fn(t)
    empty = t[:0]  # reads nothing: still countable
    assert storage_bytes(empty) == have and compact_bytes(empty) == 0


def test_tensor_ending_exactly_at_its_shrunk_storages_end_is_countable():
    t = torch.randn(100, 8)[10:20]  # bytes [320, 640) of the storage
    t.untyped_storage().resize_(640)
    assert storage_bytes(t) == 640 and compact_bytes(t) == 320 and torch.equal(own(t), t)


class _Batch(collections.UserDict):
    """Like transformers' BatchFeature / BatchEncoding: a UserDict with attributes."""

    def __init__(self, data, tag):
        super().__init__(data)
        self.tag = tag


def test_map_tensors_rebuilds_a_userdict_and_refuses_other_mappings():
    x = torch.arange(10.0)
    value = _Batch({"pixels": x[2:5], "n": 3}, tag="img")
    new = map_tensors(value, own)
    assert type(new) is _Batch and new.tag == "img" and new["n"] == 3
    assert torch.equal(new["pixels"], x[2:5]) and storage_bytes(new["pixels"]) == 12
    assert value["pixels"].untyped_storage().nbytes() == 40  # the caller's dict is untouched
    with pytest.raises(TypeError, match=r"mappingproxy.*dict\(value\)"):
        map_tensors(types.MappingProxyType({"x": x}), own)


@pytest.mark.parametrize("align", [0, -16, True, 1.5, "16"])
def test_plan_ownership_bad_align(align):
    with pytest.raises(ValueError, match=r"align: expected a positive int, got"):
        plan_ownership(torch.zeros(4)[1:], align=align)


# -- overlapping views, attributes outside fields, one walker rule, .grad, out, one memory --------
def test_overlapping_views_are_copied_as_one_range_and_stay_aliased():
    batch = torch.randn(1000, 1024)  # 4_096_000 B
    windows = [batch[i:i + 100] for i in range(20)]  # rows 0..118: 487_424 B, 20 views of 409_600 B
    plan = plan_ownership(windows)
    assert (plan.copy_bytes, plan.keep, len(plan.copy), len(plan.pieces)) == (119 * 4096, {}, 20, 1)
    owned = plan.apply()
    assert all(torch.equal(o, w) for o, w in zip(owned, windows)) and retained_bytes(owned) == 119 * 4096
    assert owned[0][5].data_ptr() == owned[5][0].data_ptr()

    kv = torch.randn(1000, 256)  # 1_024_000 B
    a, b = plan_ownership((kv[:400], kv[300:700])).apply()  # rows 300..399 shared
    assert storage_key(a) == storage_key(b) and storage_bytes(a) == 700 * 1024 and torch.equal(b, kv[300:700])
    a[300, 0] = 123.0
    assert b[0, 0] == 123.0  # a write through one is seen through the other, as before

    x = torch.randn(100, 256)  # 102_400 B; into an arena every view is copied: x, x[0], x.t() once
    arena_plan = plan_ownership({"x": x, "x0": x[0], "xT": x.t()}, copy_all=True, align=256)
    assert arena_plan.copy_bytes == 102_400 and len(arena_plan.pieces) == 1
    got = arena_plan.apply(torch.empty(102_400, dtype=torch.uint8))
    assert torch.equal(got["xT"], x.t()) and got["xT"].stride() == (1, 256) and torch.equal(got["x0"], x[0])
    assert got["x"].data_ptr() == got["x0"].data_ptr() == got["xT"].data_ptr()
    assert plan_ownership([x, x.t()]).keep == {storage_key(x): 102_400}  # the storage itself is no larger: kept


def test_overlapping_views_fall_back_to_copies_of_their_own():
    x = torch.randn(1000, 64)
    cols = [x[:, 0], x[:, 1]]  # their spans interleave, but their union is the whole batch
    plan = plan_ownership(cols)
    assert plan.copy_bytes == 2 * 4000 and len(plan.pieces) == 2
    c = plan.apply()
    assert torch.equal(c[0], x[:, 0]) and storage_key(c[0]) != storage_key(c[1])
    z = torch.randn(1000, 4, dtype=torch.complex64)
    conj = plan_ownership([z[:50], z[10:60].conj()])  # a conj bit: its bytes are not its values
    assert len(conj.pieces) == 2 and conj.copy_bytes == 100 * 4 * 8
    p, q = conj.apply()
    assert torch.equal(p, z[:50]) and torch.equal(q.resolve_conj(), z[10:60].conj().resolve_conj())
    w = torch.randn(10, 8, requires_grad=True)
    r, s = plan_ownership([w[:6] * 1, (w[:6] * 1)[2:]]).apply()  # history dropped, requires_grad kept
    assert r.is_leaf and s.is_leaf and r.requires_grad and s.requires_grad


def test_overlapping_views_of_several_dtypes_share_one_copy():
    raw = torch.arange(64, dtype=torch.uint8)
    words = torch.empty(0, dtype=torch.int32).set_(raw.untyped_storage(), 3, (4,), (1,))  # bytes 12..27
    plan = plan_ownership([raw[13:20], words, raw[40:42]], align=1)
    assert [p.nbytes for p in plan.pieces] == [16, 2] and plan.copy_bytes == 18  # one range, 4-aligned
    b, w, tail = plan.apply()
    assert torch.equal(w, words) and torch.equal(b, raw[13:20]) and torch.equal(tail, raw[40:42])
    assert b.data_ptr() - w.data_ptr() == 1 and w.data_ptr() % 4 == 0


@dataclasses.dataclass
class _Derived:
    pixels: torch.Tensor

    def __post_init__(self):
        self.first_row = self.pixels[0]  # not a field: set after __init__

    @functools.cached_property
    def mask(self):
        return torch.ones(100, 100)  # 40_000 B, in the instance __dict__ once read


def test_dataclass_attributes_outside_its_fields_are_owned_and_counted():
    batch = torch.randn(1000, 1024)  # 4_096_000 B
    item = _Derived(batch[:10])
    item.mask
    assert retained_bytes(item) == 4_096_000 + 40_000
    plan = plan_ownership(item)
    assert plan.copy_bytes == 40_960 and plan.keep == {storage_key(item.mask): 40_000}
    new = plan.apply()
    assert type(new) is _Derived and storage_bytes(new.first_row) == 40_960 and new.mask is item.mask
    assert new.first_row.data_ptr() == new.pixels.data_ptr() and torch.equal(new.first_row, batch[0])
    assert item.first_row.untyped_storage().nbytes() == 4_096_000  # the caller's item is untouched
    assert retained_bytes(new) == 40_960 + 40_000
    item.extra = np.zeros(3)
    with pytest.raises(TypeError, match="ndarray"):  # refused, as a field holding it is
        plan_ownership(item)


@pytest.mark.parametrize("make, name", [
    (lambda t: {"q": collections.deque([t])}, "deque"),
    (lambda t: [collections.UserList([t])], "UserList"),
    (lambda t: torch.nn.ModuleList([torch.nn.Linear(4, 4)]), "ModuleList"),
    (lambda t: {"v": {"a": t}.values()}, "dict_values"),
    (lambda t: t.numpy(), "ndarray"),
    (lambda t: [t, t.numpy()], "ndarray"),
])
def test_retained_bytes_refuses_what_map_tensors_refuses(make, name):
    value = make(torch.randn(1000, 256))
    for fn in (retained_bytes, lambda v: map_tensors(v, own), plan_ownership):
        with pytest.raises(TypeError, match=f"cannot count the bytes held by a {name}"):
            fn(value)


def test_retained_bytes_still_reads_a_generator_or_dict_values_at_the_top():
    t = torch.randn(1000, 256)
    assert retained_bytes(x for x in [t, t[:1]]) == retained_bytes({"a": t}.values()) == 1_024_000


def test_a_leafs_grad_counts_as_retained_and_owning_leaves_it_behind():
    """retained_bytes counted a parameter after backward at half what it kept alive: its .grad too."""
    import warnings
    p = torch.randn(1000, requires_grad=True)
    (p * 2).sum().backward()
    assert p.grad is not None and retained_bytes([p]) == 8000 == plan_ownership([p]).retained_bytes
    assert retained_bytes([p, p.grad]) == 8000                       # each storage once
    with warnings.catch_warnings():
        warnings.simplefilter("error")                               # a non-leaf's .grad is never asked
        y = p * 3
        assert retained_bytes([y]) == 4000 and plan_ownership([y]).retained_bytes == 4000
    owned = own(p)
    assert owned.grad is None and retained_bytes([owned]) == 4000    # what own() leaves behind


def test_a_kept_tensor_does_not_carry_its_grad():
    p = torch.nn.Parameter(torch.randn(1000, 256))  # 1_024_000 B
    (p * 2).sum().backward()  # p.grad: another 1_024_000 B
    for kept in (own(p), plan_ownership([p]).apply()[0], plan_ownership({"p": p}).apply()["p"]):
        assert kept is not p and kept.grad is None and kept.is_leaf and kept.requires_grad
        assert kept.data_ptr() == p.data_ptr() and retained_bytes(kept) == 1_024_000
    assert p.grad is not None  # the caller's parameter keeps it
    plain = torch.randn(8, requires_grad=True)
    assert own(plain) is plain  # no .grad, no history: the same object


def test_apply_out_aligns_every_copy_and_checks_out_before_copying():
    x8, x32 = torch.arange(300, dtype=torch.uint8), torch.arange(300, dtype=torch.float32)
    plan = plan_ownership([x8[:3], x32[:5]])  # align 1: float32 first, at a multiple of 4
    assert plan.copy_bytes == 23 and [p.offset for p in plan.pieces] == [0, 20]
    a, b = plan.apply(torch.zeros(23, dtype=torch.uint8))
    assert torch.equal(a, x8[:3]) and torch.equal(b, x32[:5]) and b.data_ptr() % 4 == 0
    plan = plan_ownership([x32[:5], x32[10:15], x32[20:25]])
    for out, got in [
        (torch.zeros(56, dtype=torch.uint8), r"torch.uint8 \[56\]"),  # too short
        (torch.zeros(59, dtype=torch.uint8), r"torch.uint8 \[59\]"),  # one byte short: the last copy's end
        (torch.zeros(60, dtype=torch.float32), "torch.float32"),
        (torch.zeros(120, dtype=torch.uint8)[::2], r"strides \(2,\)"),
        (torch.zeros(64, dtype=torch.uint8)[2:], "storage offset 2"),
        (torch.zeros(60, dtype=torch.uint8, device="meta"), "on meta"),
    ]:
        with pytest.raises(ValueError, match=r"out: expected uint8 of shape \[n >= 60\], contiguous, on cpu, "
                                             r"at a storage offset that is a multiple of 4 \(the largest "
                                             r"element size copied\); got .*" + got):
            plan.apply(out)
        assert out.device.type == "meta" or not out.any()  # nothing was copied
    longer = torch.zeros(64, dtype=torch.uint8)[4:]
    assert torch.equal(plan.apply(longer)[2], x32[20:25])


def test_memory_seen_through_two_storages_counts_once():
    t = torch.randn(1000, 256)  # 1_024_000 B
    again = torch.from_numpy(t.numpy())
    assert storage_key(again) != storage_key(t)
    assert retained_bytes([t, again]) == retained_bytes([t, torch.from_dlpack(t)]) == 1_024_000
    assert retained_bytes([t, torch.from_numpy(t.numpy()[:1])]) == 1_024_000
    assert retained_bytes([t[:10], torch.from_numpy(t.numpy()[500:])]) == 1_024_000  # one range each
    assert plan_ownership([t, again]).retained_bytes == 1_024_000
    assert retained_bytes([t, torch.randn(10)]) == 1_024_040


def test_the_exact_type_shortcut_answers_as_the_isinstance_chain(monkeypatch):
    samples = [torch.zeros(2), {"a": 1}, [1], (1,), {1}, frozenset({1}), None, True, 3, 2.5, 1j, "s", b"b"]
    assert {type(x) for x in samples} == set(values._EXACT_KINDS)  # one sample per shortcut type
    fast = [values._kind(x) for x in samples]
    monkeypatch.setattr(values, "_EXACT_KINDS", {})
    assert [values._kind(x) for x in samples] == fast


class _Output(dict):
    """A dict subclass keeping each item as an attribute too, as transformers' ModelOutput does."""


def test_map_tensors_rebuilds_an_attribute_that_holds_the_containers_own_item():
    """An attribute that IS one of the container's items is walked (and charged) as that item; the
    rebuild points it at the item's rebuild, so it never keeps the replaced tensor alive. An
    attribute holding a tensor that is not an item, or one inside an item, is still refused."""
    batch = torch.randn(100, 64)
    out = _Output(last=batch[3:5], layers=(batch[0], batch[1]))
    out.last, out.layers, out.n = out["last"], out["layers"], 2
    assert retained_bytes(out) == 100 * 64 * 4
    alive = StorageWeakRef(batch.untyped_storage())
    new = map_tensors(out, own)
    assert type(new) is _Output and new.n == 2
    assert new.last is new["last"] and new.layers is new["layers"] and storage_bytes(new.last) == 2 * 64 * 4
    assert out.last is out["last"] and storage_bytes(out.last) == 100 * 64 * 4   # the caller's is untouched
    del batch, out
    gc.collect()
    assert alive.expired()                    # the attributes no longer hold the batch: only the copies live
    for stray in (torch.zeros(4), new["layers"][0]):  # not an item itself (an item's part is not)
        new.extra = stray
        with pytest.raises(TypeError, match=r"attributes \('extra' holds a Tensor\)"):
            map_tensors(new, own)
    key = torch.zeros(2)
    keyed = _Output({key: torch.ones(1)})
    keyed.one = keyed[key]                    # an attribute holding an item does not hide a tensor key
    with pytest.raises(TypeError, match="dict key"):
        retained_bytes(keyed)
    rows = _Rows([torch.arange(8.0)[2:6]])
    rows.first = rows[0]
    new_rows = map_tensors(rows, own)
    assert new_rows.first is new_rows[0] and storage_bytes(new_rows.first) == 16


class _Rows(list):
    pass


# --- Pinned by helper-141's mutation run over tpool/memory (session 39) ---------------------------------------------


def test_three_storages_over_one_memory_count_once():
    """Byte ranges merge up to the furthest end seen, not the last one: ``b`` lies inside ``t`` past ``a``."""
    t = torch.zeros(1000, 256)  # 1,024,000 bytes
    a, b = torch.from_numpy(t.numpy()[10:20]), torch.from_numpy(t.numpy()[500:510])
    assert retained_bytes([t, a, b]) == retained_bytes([t, b, a]) == 1_024_000


def test_leaf_bytes_charges_ints_over_128_bytes_not_at_128():
    at, over = 2 ** 750, 2 ** 780
    assert (sys.getsizeof(at), sys.getsizeof(over)) == (128, 132)
    t = torch.zeros(1)  # (beside a tensor: the list is the value's structure, its ints leaves)
    assert values.leaf_bytes([at, t]) == 0 and values.leaf_bytes([over, t]) == 132


def test_map_tensors_copies_a_list_of_numbers_once_and_keeps_a_tuple_of_them():
    """A list of numbers held twice is rebuilt as one copy (what a cache stores is charged once, as it holds it
    once); a tuple of numbers cannot change, so it is kept as it is, as text is; a plan prices the rebuild."""
    ids, pair = [1000, 2000], (1000, 2000)
    value = {"a": ids, "b": ids, "c": pair, "d": [ids, torch.zeros(1)]}
    out = map_tensors(value, lambda t: t)
    assert out["a"] is out["b"] is out["d"][0] and out["a"] == ids and out["a"] is not ids and out["c"] is pair
    grown = []
    for i in range(1000, 1100):
        grown.append(i)  # (spare room a copy does not have)
    assert sys.getsizeof(grown) > sys.getsizeof(list(grown))
    assert plan_ownership({"ids": grown}).leaf_bytes == values.leaf_bytes(map_tensors({"ids": grown}, lambda t: t))
    assert plan_ownership({"ids": grown}).leaf_bytes < values.leaf_bytes({"ids": grown})


def test_map_tensors_itself_refuses_a_dict_key_holding_a_tensor():
    with pytest.raises(TypeError, match="dict key"):
        map_tensors({(torch.zeros(2),): torch.ones(1)}, lambda t: t)


def test_a_key_holding_a_numpy_scalar_over_1024_bytes_is_refused():
    @dataclasses.dataclass(eq=False)  # hashes by id: a key
    class IdKey:
        v: object

    big = np.frombuffer(bytes(2000), dtype="V2000").reshape(())[()]
    assert isinstance(big, np.void) and big.base is None and big.nbytes == 2000
    with pytest.raises(TypeError, match="numpy void of 2000 bytes"):
        retained_bytes({IdKey(big): torch.zeros(1)})


def test_a_key_nested_a_few_dozen_levels_is_accepted_and_past_100_refused():
    def nest(n):
        k = "leaf"
        for _ in range(n):
            k = (k,)
        return k

    assert retained_bytes({nest(50): torch.zeros(1)}) == 4
    with pytest.raises(TypeError, match="nested over 100 levels"):
        retained_bytes({nest(150): torch.zeros(1)})


def test_compact_of_a_permuted_dense_view_is_contiguous():
    """A view whose span equals its distinct elements is copied contiguous, not with its strides."""
    view = torch.arange(4000.0).reshape(1000, 4)[:10].t()  # [4, 10], strides (1, 4)
    for c in (ownership.compact(view), own(view)):
        assert c.is_contiguous() and torch.equal(c, view)


def test_compact_refuses_an_out_of_the_wrong_size():
    t = torch.arange(100.0)[10:20]
    want = compact_bytes(t)
    for n in (want - 4, want + 4, want + 64):
        with pytest.raises(ValueError, match="out must be uint8"):
            ownership.compact(t, out=torch.empty(n, dtype=torch.uint8))


def test_a_tensor_with_a_post_accumulate_grad_hook_is_kept_detached():
    t = torch.zeros(8, requires_grad=True)
    t.register_post_accumulate_grad_hook(lambda p: None)
    o = own(t)
    assert o is not t and o.requires_grad and o.data_ptr() == t.data_ptr()


def test_a_conj_or_neg_view_beside_its_tensor_keeps_its_bit_when_copied():
    """Views of one range that differ only in their conj or neg bit are not merged into one copy."""
    z = torch.randn(100, dtype=torch.complex64)[:2]  # 2 of 100 elements: copied
    for value in ([z, z.conj()], [z.conj(), z], [z, z.conj().imag], [z.conj().imag, z]):
        out = plan_ownership(value).apply()
        assert all(torch.equal(o, v.resolve_conj().resolve_neg()) for o, v in zip(out, value))


def test_a_view_that_requires_grad_and_one_that_does_not_are_not_merged():
    leaf = torch.zeros(100)
    a, b = leaf[:10], leaf[:10].detach().requires_grad_(True)
    assert [o.requires_grad for o in plan_ownership([a, b]).apply()] == [False, True]
    assert [o.requires_grad for o in plan_ownership([b, a]).apply()] == [True, False]


def test_a_cluster_is_not_copied_as_one_range_when_its_slot_would_be_larger():
    """``copy_bytes`` is never above the views' separate copies: with ``align=3``, lcm(3, 8) rounds the
    cluster's 29 bytes up to a 48-byte slot, more than 24 + 9."""
    buf = torch.zeros(1000, dtype=torch.uint8)
    f, u = buf[:24].view(torch.float64), buf[20:29]  # bytes [0, 24) and [20, 29)
    alone = plan_ownership([f], align=3).copy_bytes + plan_ownership([u], align=3).copy_bytes
    plan = plan_ownership([f, u], align=3)
    assert alone == 33 and plan.copy_bytes <= alone
    out = plan.apply()
    assert torch.equal(out[0], f) and torch.equal(out[1], u)


def test_a_plans_payload_counts_every_element_of_an_expand():
    value = [torch.ones(4096).expand(1000, 4096), torch.arange(16.0).unfold(0, 4, 2)]
    assert plan_ownership(value).payload_bytes == payload_bytes(value[0]) + payload_bytes(value[1]) == 16_384_112


def test_a_cluster_whose_rounded_range_ends_past_the_storage_is_copied_without_touching_it():
    """The cluster's 17 bytes round up to 24, past the 1001-byte storage: copying 24 bytes made ``set_``
    grow (and move) the caller's storage, or raise for memory torch did not allocate."""
    for buf in (torch.arange(1001).to(torch.uint8), torch.from_numpy(np.arange(1001, dtype=np.uint8))):
        f, u = buf[984:1000].view(torch.float64), buf[985:1001]  # bytes [984, 1000) and [985, 1001)
        ptr = buf.data_ptr()
        plan = plan_ownership([f, u])
        assert [(p.start, p.nbytes) for p in plan.pieces] == [(984, 24)]
        out = plan.apply()
        assert torch.equal(out[0], f) and torch.equal(out[1], u)
        assert out[0].untyped_storage().data_ptr() == out[1].untyped_storage().data_ptr()  # still aliased
        assert (buf.untyped_storage().nbytes(), buf.data_ptr()) == (1001, ptr)  # the caller's storage as it was


def test_a_bool_view_of_raw_bytes_comes_back_byte_for_byte():
    # torch's bool copy writes 1 for any nonzero byte: a mask read from raw bytes (.view(torch.bool)) and viewed
    # back as uint8 after caching would have changed, and differently from a cluster's copy, which moves bytes.
    raw = torch.tensor([[0, 1, 2, 255], [7, 0, 1, 128]] * 4, dtype=torch.uint8)
    mask = raw.view(torch.bool)
    assert torch.equal(own(mask[1:3]).view(torch.uint8), raw[1:3])
    assert torch.equal(own(mask[1:2].expand(3, -1)).view(torch.uint8), raw[1:2].expand(3, -1))
    alone, cluster = plan_ownership([mask[1:3].t()]).apply(), plan_ownership([mask[1:3], mask[2:4]]).apply()
    assert torch.equal(alone[0].view(torch.uint8), raw[1:3].t())
    assert [c.view(torch.uint8).tolist() for c in cluster] == [raw[1:3].tolist(), raw[2:4].tolist()]


def test_apply_refuses_a_tensor_changed_since_the_plan_before_copying():
    # A plan keeps its views: one given another storage (t.data = ..., t.set_) or shrunk under it before apply()
    # made the cluster's copy read the wrong storage (the other view got 7s and uninitialised bytes, not 5..14).
    x = torch.arange(1000.0)
    v = x[0:10]
    plan = plan_ownership([v, x[5:15]])
    assert len(plan.pieces) == 1  # one cluster: one range copied
    v.data = torch.full((10,), 7.0)
    with pytest.raises(ValueError, match="changed since plan_ownership"):
        plan.apply()
    y = torch.arange(1000.0)
    w = y[0:10]
    plan = plan_ownership([w, y[5:15]])
    w.set_(torch.arange(20.0).untyped_storage(), 0, (10,))
    with pytest.raises(ValueError, match="changed since plan_ownership"):
        plan.apply(torch.empty(plan.copy_bytes, dtype=torch.uint8))
    z = torch.arange(1000.0)
    plan = plan_ownership([z[0:10], z[5:15]])
    z.untyped_storage().resize_(8)
    with pytest.raises(ValueError, match="expected a storage of at least"):
        plan.apply()
    fresh = plan_ownership([y[0:10], y[5:15]]).apply()  # unchanged: copied as before
    assert [f.tolist() for f in fresh] == [list(range(10)), list(range(5, 15))]


def test_copies_made_under_inference_mode_are_normal_tensors():
    # A view of a normal tensor is a normal tensor even when made under torch.inference_mode(); its copy was an
    # inference tensor, which torch refuses an in-place write (and a place in autograd) outside the mode.
    batch = torch.arange(40.0).reshape(10, 4)
    with torch.inference_mode():
        item = batch[2:4]
        alone, pair = own(item), plan_ownership([batch[1:3], batch[2:5]]).apply()
    assert not item.is_inference() and storage_bytes(alone) == 32
    for t in [alone, *pair]:
        assert not t.is_inference()
        t.add_(1)  # outside the mode, as the caller could with the view
    assert alone.tolist() == [[9.0, 10.0, 11.0, 12.0], [13.0, 14.0, 15.0, 16.0]]
    assert pair[0][1].tolist() == pair[1][0].tolist() == [10.0, 11.0, 12.0, 13.0]  # one copy: both adds


def test_compact_refuses_an_out_that_is_not_contiguous():
    # An overlapping view is rebuilt with its own strides on out's storage: over a strided out (every other byte)
    # it read bytes the copy never wrote, [[0, 0, 1, 0], ...] for [[0, 1, 2, 3], ...], and nothing said so.
    windows = torch.arange(16, dtype=torch.uint8).unfold(0, 4, 2)
    n = compact_bytes(windows)
    with pytest.raises(ValueError, match=r"contiguous, on cpu, got torch.uint8 \[16\] strides \(2,\)"):
        ownership.compact(windows, out=torch.zeros(2 * n, dtype=torch.uint8)[::2])
    assert ownership.compact(windows, out=torch.zeros(n, dtype=torch.uint8)).tolist() == windows.tolist()


def test_a_fake_tensor_is_refused_for_having_no_storage_not_for_its_attributes():
    # A FakeTensor keeps its mode in an attribute: retained_bytes and plan_ownership (OwnedCache.put) named that
    # ("'fake_mode' holds a FakeTensorMode"), sending the caller after its attributes; it has no storage at all.
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        fake = torch.empty(10, 10)
    for fn in (retained_bytes, plan_ownership, own):
        with pytest.raises(TypeError, match="tensor subclass FakeTensor with __torch_dispatch__"):
            fn(fake)
    shrunk = torch.randn(8)
    shrunk.tag = "kept"  # small plain data: fine; the storage freed under it is what is wrong
    shrunk.untyped_storage().resize_(0)
    with pytest.raises(ValueError, match="got a storage of 0 bytes"):
        retained_bytes([shrunk])


def test_an_inference_out_given_under_inference_mode_is_still_written():
    # Copies leave inference mode to be normal tensors, but not into a caller's inference tensor: torch refuses
    # that write outside the mode (plan.apply(out) raised RuntimeError for an out made under it).
    batch = torch.arange(40.0).reshape(10, 4)
    with torch.inference_mode():
        out = torch.zeros(256, dtype=torch.uint8)
        pair = plan_ownership([batch[1:3], batch[2:5]]).apply(out)
        alone = ownership.compact(batch[2:4], out=out[128:160])
    assert pair[0].data_ptr() == out.data_ptr() and pair[1][0].tolist() == [8.0, 9.0, 10.0, 11.0]
    assert alone.tolist() == batch[2:4].tolist()


def test_apply_refuses_an_out_that_overlaps_the_views_it_copies():
    # out a slice of the batch the views are of: the first copy (b[10:20], at out's start) overwrote b[0:5] before
    # the second copy read it, and apply returned [10.0, ..., 14.0] for b[0:5] without a word.
    b = torch.arange(100, dtype=torch.float32)
    plan = plan_ownership([b[10:20], b[0:5]], copy_all=True)
    for out in (b.view(torch.uint8)[:plan.copy_bytes], b.view(torch.uint8)[40:40 + plan.copy_bytes]):
        with pytest.raises(ValueError, match=r"out: expected memory apart from the views it copies, got out's 60 "
                                             r"bytes at 0x[0-9a-f]+ overlapping the \d+ bytes"):
            plan.apply(out)
        assert torch.equal(b, torch.arange(100, dtype=torch.float32))  # checked before anything was copied
    windows = plan_ownership([b[30:34], b[32:36]], copy_all=True)  # a cluster: its copied range is what counts
    with pytest.raises(ValueError, match="overlapping the 24 bytes"):
        windows.apply(b.view(torch.uint8)[136:136 + windows.copy_bytes])
    a, c = plan.apply(b.view(torch.uint8)[200:200 + plan.copy_bytes])  # the same batch, other bytes: fine
    assert a.tolist() == list(range(10, 20)) and c.tolist() == list(range(5))
    assert a.data_ptr() == b[50:].data_ptr()
    kept = torch.zeros(100)  # kept as it is (owns its storage): a copy into it changed the value apply returned
    plan = plan_ownership([kept, b[2:5]])
    assert plan.copy_bytes == 12 and plan.keep
    with pytest.raises(ValueError, match="overlapping the 400 bytes at 0x[0-9a-f]+ that a copy reads or the value"):
        plan.apply(kept.view(torch.uint8)[388:])
    assert not kept.any()


def test_compact_refuses_an_out_that_is_not_a_tensor_or_overlaps_what_it_copies():
    b = torch.arange(100, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"out must be a uint8 tensor of shape \[40\], got a list"):
        ownership.compact(b[10:20], out=[0] * 40)  # (an AttributeError: 'list' object has no attribute ...)
    with pytest.raises(ValueError, match="out must be a uint8 tensor of shape \\[40\\], got a ndarray"):
        ownership.compact(b[10:20], out=np.zeros(40, dtype=np.uint8))
    with pytest.raises(ValueError, match="out: expected memory apart from the views it copies"):
        ownership.compact(b[10:20], out=b.view(torch.uint8)[20:60])  # (torch's RuntimeError, partial overlap)
    assert torch.equal(b, torch.arange(100, dtype=torch.float32))
    assert ownership.compact(b[10:20], out=b.view(torch.uint8)[80:120]).tolist() == list(range(10, 20))


@pytest.mark.parametrize("start", [31, 49])
def test_compact_refuses_an_out_that_overlaps_what_it_copies_by_one_byte(start):
    # out's last byte on the view's first, or out's first byte on the view's last: one value overwritten
    b = torch.arange(100, dtype=torch.uint8)
    with pytest.raises(ValueError, match="out: expected memory apart from the views it copies"):
        ownership.compact(b[40:50], out=b[start:start + 10])
    assert torch.equal(b, torch.arange(100, dtype=torch.uint8))
    for apart in (30, 50):  # touching, not overlapping: fine
        b = torch.arange(100, dtype=torch.uint8)
        assert ownership.compact(b[40:50], out=b[apart:apart + 10]).tolist() == list(range(40, 50))


@pytest.mark.parametrize("copy_all", ["no", 0, 1.0, None])
def test_plan_ownership_refuses_a_copy_all_that_is_not_a_bool(copy_all):
    # "no" was read as True: every view copied, nothing said
    with pytest.raises(ValueError, match=r"copy_all: expected a bool, got a \w+"):
        plan_ownership(torch.arange(10.0)[2:5], copy_all=copy_all)
    assert plan_ownership(torch.arange(10.0), copy_all=np.bool_(True)).copy_bytes == 40
