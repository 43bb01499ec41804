"""Byte counting and view-to-owned compaction (tpool.memory.accounting and tpool.memory.ownership)."""

import collections
import dataclasses
import gc
import types
import weakref

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.multiprocessing.reductions import StorageWeakRef

from tpool.memory import ownership
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
    (lambda: torch.randn(4).as_subclass(_FakeDispatch), "__torch_dispatch__"),
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


def test_storage_key_is_the_storage_object_not_its_address():
    arr = np.zeros((1000, 1024), dtype=np.float32)  # 4_096_000 B
    head, whole = torch.from_numpy(arr[:1]), torch.from_numpy(arr)  # two storages at one address
    assert head.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
    assert storage_key(head) != storage_key(whole)
    both = 4096 + 4_096_000
    assert retained_bytes([head, whole]) == plan_ownership([head, whole]).retained_bytes == both
    assert retained_bytes([whole, head]) == plan_ownership([whole, head]).retained_bytes == both
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
])
def test_tensor_reaching_past_its_storage_raises(make, need, have):
    t = make()
    t.untyped_storage().resize_(have)
    for fn in (own, needs_compaction, storage_bytes, compact_bytes, storage_key, plan_ownership):
        with pytest.raises(ValueError, match=f"at least {need} bytes.*got a storage of {have} bytes"):
            fn(t)
    empty = t[:0]  # reads nothing: still countable
    assert storage_bytes(empty) == have and compact_bytes(empty) == 0


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
