"""Random views of a few storages through plan_ownership / OwnershipPlan.apply, checked against a model.

The model: views of one storage whose byte spans overlap are a cluster (found here by union-find over
pairs, not by the sweep the code uses); a cluster of 2+ views (non-empty, no conj or neg bit) is copied
as one range, its start aligned down and its size rounded up to its largest element size, when that is
no larger than the views' own copies (as bytes, and as slots rounded to lcm(align, element size));
a storage is kept whole when torch allocated it and it is no larger than its copies.
"""

import math
import random

import numpy as np
import pytest
import torch

from tpool.memory.accounting import compact_bytes, retained_bytes, storage_key
from tpool.memory.ownership import _signature, _torch_sized, plan_ownership

DTYPES = [torch.uint8, torch.int16, torch.float16, torch.float32, torch.int64, torch.complex64]


def _round_up(n, a):
    return -(-n // a) * a


def _span(t):
    """[start, end) in bytes of t's storage; empty for an empty t."""
    e = t.element_size()
    if t.numel() == 0:
        return t.storage_offset() * e, t.storage_offset() * e
    return t.storage_offset() * e, (t.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * e


def _random_view(rng, storage):
    dtype = rng.choice(DTYPES)
    n = storage.nbytes() // dtype.itemsize
    typed = torch.empty(0, dtype=dtype).set_(storage, 0, (n,), (1,))
    while True:
        shape = [rng.randint(0, 6) for _ in range(rng.randint(0, 3))]
        stride = [rng.choice([0, 1, 1, 2, 3, 7, 16]) for _ in shape]
        reach = 1 + sum((a - 1) * b for a, b in zip(shape, stride)) if all(shape) else 0
        if reach <= n:
            v = typed.as_strided(shape, stride, rng.randint(0, n - reach))
            break
    if dtype.is_complex and rng.random() < 0.2:
        v = v.conj()
    elif dtype.is_floating_point and rng.random() < 0.1:
        v = torch._neg_view(v)
    elif dtype.is_floating_point and rng.random() < 0.2:
        v = v.detach().requires_grad_(True)  # a leaf that asks for gradients, on the same storage
    return v


def _value(rng):
    storages = [torch.randint(0, 256, (rng.choice([64, 200, 256]),), dtype=torch.uint8).untyped_storage()]
    if rng.random() < 0.5:
        raw = np.random.default_rng(rng.randint(0, 1 << 30)).integers(0, 256, 128, dtype=np.uint8)
        storages.append(torch.from_numpy(raw).untyped_storage())  # not resizable: always copied
    views = [_random_view(rng, rng.choice(storages)) for _ in range(rng.randint(1, 7))]
    if rng.random() < 0.3:
        views.append(views[0])  # the same view twice: one copy, shared
    return views


def _model_pieces(views, align):
    """The copies the model makes of ``views`` (distinct, one storage): lists of view indexes."""
    parent = list(range(len(views)))

    def root(i):
        while parent[i] != i:
            i = parent[i]
        return i

    spannable = [i for i, v in enumerate(views) if v.numel() and not v.is_conj() and not v.is_neg()]
    for i in spannable:
        for j in spannable:
            (a, b), (c, d) = _span(views[i]), _span(views[j])
            if a < d and c < b:
                parent[root(i)] = root(j)
    clusters = {}
    for i in spannable:
        clusters.setdefault(root(i), []).append(i)
    pieces = [[i] for i in range(len(views)) if i not in spannable]
    for members in clusters.values():
        e = max(views[i].element_size() for i in members)
        start = min(_span(views[i])[0] for i in members) // e * e
        nbytes = _round_up(max(_span(views[i])[1] for i in members) - start, e)
        own = [compact_bytes(views[i]) for i in members]
        slots = [_round_up(n, math.lcm(align, views[i].element_size())) for n, i in zip(own, members)]
        one = len(members) > 1 and nbytes <= sum(own) and _round_up(nbytes, math.lcm(align, e)) <= sum(slots)
        pieces += [members] if one else [[i] for i in members]
    return pieces


def _same(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype and a.requires_grad == b.requires_grad
    torch.testing.assert_close(a.detach().resolve_conj().resolve_neg(), b.detach().resolve_conj().resolve_neg(),
                               rtol=0, atol=0, equal_nan=True)


def _model(plan, align, copy_all):
    """What the model keeps ({storage key: nbytes}) and copies ([[signature, ...] per copy]), the bytes
    the copies take in out, what each view copied alone would take, and what the old rule charged."""
    groups = {}
    for sig in plan.views:
        groups.setdefault(sig[0], []).append(sig)
    keep, pieces, cost, per_view, old_charge = {}, [], 0, 0, 0
    for skey, sigs in groups.items():
        vs = [plan.views[s] for s in sigs]
        storage = vs[0].untyped_storage()
        mine = [[sigs[i] for i in members] for members in _model_pieces(vs, align)]
        mine_cost = 0
        for members in mine:
            e = max(plan.views[s].element_size() for s in members)
            if len(members) > 1:
                start = min(_span(plan.views[s])[0] for s in members) // e * e
                nbytes = _round_up(max(_span(plan.views[s])[1] for s in members) - start, e)
            else:
                nbytes = compact_bytes(plan.views[members[0]])
            mine_cost += _round_up(nbytes, math.lcm(align, e))
        sizes = [compact_bytes(v) for v in vs]
        slots = sum(_round_up(n, math.lcm(align, v.element_size())) for n, v in zip(sizes, vs))
        old_keep = not copy_all and _torch_sized(storage) and storage.nbytes() <= sum(sizes)
        old_charge += storage.nbytes() if old_keep else sum(_round_up(n, align) for n in sizes)
        if not copy_all and _torch_sized(storage) and storage.nbytes() <= mine_cost:
            keep[skey] = storage.nbytes()
        else:
            pieces += mine
            cost += mine_cost
            per_view += slots
    return keep, pieces, cost, per_view, old_charge


@pytest.mark.parametrize("seed", range(12))
def test_random_views_against_the_model(seed):
    rng = random.Random(seed)
    layouts = []
    for _ in range(60):
        value = _value(rng)
        align = rng.choice([1, 1, 2, 16, 256, 3, 48])
        copy_all = rng.random() < 0.4
        plan = plan_ownership(value, copy_all=copy_all, align=align)
        keep, pieces, cost, per_view, old_charge = _model(plan, align, copy_all)
        assert plan.keep == keep
        # bytes: never above the views' own copies; for an align that is a power of two, that is the old
        # sum, and the storages kept plus the copies never charge more than the old rule did (another align
        # now rounds each offset to lcm(align, element size), which the old layout did not, and could not apply)
        assert plan.copy_bytes == cost <= per_view
        if align & (align - 1) == 0:
            assert per_view == sum(_round_up(compact_bytes(plan.views[s]), align) for s in plan.copy)
            assert plan.copy_bytes + sum(plan.keep.values()) <= old_charge

        start = max((p.align for p in getattr(plan, "pieces", ())), default=16)
        buf = torch.full((plan.copy_bytes + start,), 7, dtype=torch.uint8)[start:]  # past its storage's start
        for out in (None, buf):
            got = plan.apply(out)
            assert len(got) == len(value)
            for v, o in zip(value, got):
                _same(o, v)
            if value[-1] is value[0]:
                assert got[-1] is got[0]
            by_sig = {_signature(v): o for v, o in zip(value, got)}
            for skey in plan.keep:  # kept: the same storage
                assert all(storage_key(o) == skey for s, o in by_sig.items() if s[0] == skey)
            copies = {storage_key(by_sig[s]) for members in pieces for s in members}
            for members in pieces:  # a cluster's views on one copy, as far apart as they were
                outs, ins = [by_sig[s] for s in members], [plan.views[s] for s in members]
                assert all(o.stride() == i.stride() for o, i in zip(outs, ins)) or len(outs) == 1
                assert all(o.data_ptr() - outs[0].data_ptr() == i.data_ptr() - ins[0].data_ptr()
                           for o, i in zip(outs, ins))
                assert len({storage_key(o) for o in outs}) == 1
            if out is None:  # one storage per copy, of the bytes charged (align 1: copy_bytes exactly)
                assert len(copies) == len(pieces)
                fresh = sum(retained_bytes([by_sig[members[0]]]) for members in pieces)
                assert fresh <= plan.copy_bytes and (align > 1 or fresh == plan.copy_bytes)
                if align == 1:
                    assert retained_bytes(got) == plan.copy_bytes + sum(plan.keep.values())

        layouts.append((plan, pieces, align, buf, by_sig))

    for plan, pieces, align, buf, by_sig in layouts:  # the layout apply followed (by_sig: the apply into buf)
        assert sorted(map(sorted, (map(str, p.sigs) for p in plan.pieces))) == sorted(
            sorted(map(str, members)) for members in pieces)  # the model's copies
        end = 0
        for p in sorted(plan.pieces, key=lambda p: p.offset):  # each at an aligned offset, inside copy_bytes
            assert p.offset % p.align == 0 and p.offset >= end and p.align % align == 0
            end = p.offset + p.slot
            lo = buf.data_ptr() + p.offset
            for o in (by_sig[s] for s in p.sigs):
                a, b = _span(o)
                base = o.untyped_storage().data_ptr()
                assert base == buf.untyped_storage().data_ptr()
                assert o.numel() == 0 or lo <= base + a <= base + b <= lo + p.nbytes
        assert end == plan.copy_bytes
