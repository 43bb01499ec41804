"""The host-sync guard catches every construct it promises to, and lets fixed-shape code through."""

import contextlib

import pytest
import torch

import tpool
from conftest import i32
from tpool.backends import reference
from tpool.testing import HostSyncError, no_host_sync

t = torch.arange(6)
mask = t > 2

CONSTRUCTS = {
    "item": lambda: t[0].item(),
    "bool": lambda: bool(t[0]),
    "if on a tensor": lambda: 1 if t[1] else 0,
    "int": lambda: int(t[0]),
    "float": lambda: float(t[0]),
    "tolist": lambda: t.tolist(),
    "numpy": lambda: t.numpy(),
    "cpu": lambda: t.cpu(),
    "nonzero": lambda: torch.nonzero(t),
    "argwhere": lambda: torch.argwhere(t),
    "unique": lambda: torch.unique(t),
    "unique_consecutive": lambda: torch.unique_consecutive(t),
    "mask index": lambda: t[mask],
    "mask assign": lambda: t.clone().__setitem__(mask, 0),
    "masked_select": lambda: torch.masked_select(t, mask),
    "equal": lambda: torch.equal(t, t),
    "bincount": lambda: torch.bincount(t),
    "repeat_interleave": lambda: torch.repeat_interleave(t, t),
}


@pytest.mark.parametrize("name", list(CONSTRUCTS))
def test_guard_catches(name):
    with pytest.raises(HostSyncError):
        with no_host_sync():
            CONSTRUCTS[name]()


def test_guard_allows_fixed_shape_code_and_restores_methods():
    with no_host_sync():
        x = t[t.clamp(max=3)]                      # integer-tensor indexing
        y = torch.where(mask, t, 0).cumsum(0)
        z = torch.repeat_interleave(t, t, output_size=15)
        t.clone()[torch.tensor([1])] = 3
    assert x.tolist() == [0, 1, 2, 3, 3, 3] and y[-1].item() == 12 and z.numel() == 15
    assert t.numpy().shape == (6,)                 # patched methods are back


def test_guard_sees_a_sync_inside_pool_code(monkeypatch):
    """A host read slipped into a backend would be caught (checked by planting one)."""
    pool = tpool.PagePool(8, device="cpu", backend="reference")
    original = reference.Pool.alloc_into

    def leaky_into(ops, out):
        run = original(ops, out)

        def leaky(counts, *rest):
            if counts.sum() > 0:                   # a Python branch on device data
                run(counts, *rest)
        return leaky
    monkeypatch.setattr(reference.Pool, "alloc_into", leaky_into)
    with pytest.raises(HostSyncError):
        with no_host_sync():
            pool.alloc(i32([1]))



def test_host_data_mode_refuses_tensors_built_from_host_values():
    with no_host_sync():
        torch.tensor([1, 2])                           # allowed by default (free on a CPU)
    for build in (lambda: torch.tensor([1, 2]), lambda: torch.as_tensor(3)):
        with pytest.raises(HostSyncError, match="host data"):
            with no_host_sync(host_data=True):
                build()
    with no_host_sync(host_data=True):
        torch.full((3,), 5)                            # a fill on the device: no host data
        torch.as_tensor(t)                             # a tensor already: no copy
        t.clone()[0] = 7                               # a scalar set: a fill on CUDA too


def test_hot_paths_build_no_tensor_from_host_data(backend):
    """On CUDA a tensor made from a Python value is a pageable copy that syncs; no hot path makes one
    (the first call of a shape makes its buffers: the sequence runs once unguarded first)."""
    pool = tpool.PagePool(32, 4, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 4, 8)
    counts, rows = i32([2, 1]), i32([0, 1, 2])
    ids, ntok, prompts, lens, drop = i32([0, 1]), i32([1, 1]), i32([6, 9]), i32([5, 8]), i32([1, 1])
    src, dst, flen = i32([0]), i32([2]), i32([4])
    out = pool.alloc_out(2, 8)
    for guarded in (False, True):
        with no_host_sync(host_data=True) if guarded else contextlib.nullcontext():
            r = pool.alloc(counts, out=out)
            pool.incref(r.pages[:2])
            pool.touch(r.pages[:2])
            pool.free(r.pages[:2], cache=True)
            pool.free(r.pages[:3], cache=True)
            pool.evict(2)
            pool.alloc(counts, out=out, evict=True)
            pool.free(out.pages)
            table.extend(ids, prompts, max_tokens=15)
            table.step(ids, ntok)
            table.truncate(ids, lens)
            table.truncate(ids, drop=drop)
            table.fork(src, dst, flen)
            table.flashinfer_csr(ids)
            table.block_table_rows(ids)
            table.release(rows, cache=True)
        pool.check()
