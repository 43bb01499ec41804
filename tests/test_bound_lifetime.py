"""Bound calls keep what their compiled code points at alive.

A BoundStep's numba step holds raw addresses of its table's and pool's tensors;
when it was the only thing left referring to them, they were freed and the next
call wrote into freed memory (a segfault or heap corruption). Run in a
subprocess, so a regression fails this test instead of killing the test run.
"""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import gc, torch, tpool
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)

    def bound_step():
        pool = tpool.PagePool(4096, 16, device="cpu", backend="numba")
        table = tpool.PageTable(pool, 4, 64)
        table.extend(i32([0, 1]), i32([100, 200]), max_tokens=300)
        return table.bind_step(i32([0, 1]), i32([1, 1]))

    def alloc_out():
        return tpool.PagePool(4096, device="cpu", backend="numba").alloc_out(max_batch=1, max_pages=8)

    step, out = bound_step(), alloc_out()
    gc.collect()
    junk = [torch.full((4096,), 7, dtype=torch.int32) for _ in range(200)]  # takes any freed memory
    for _ in range(100):
        res = step()
    r = out.pool.alloc(i32([3]), out=out)
    assert all(bool((j == 7).all()) for j in junk), "a bound call wrote into memory it does not own"
    print(res.slots.tolist(), res.csr.indptr.tolist(), r.pages[:3].tolist())
""")


def test_bound_step_and_alloc_out_outlive_the_names_of_their_table_and_pool():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
    # 100 decode steps after prompts of 100 and 200 tokens: lengths 200 and 300, pages 13 and 19.
    assert r.stdout.split() == ["[503,", "491]", "[0,", "13,", "32]", "[0,", "1,", "2]"]


HAND_EDITS = textwrap.dedent("""
    import gc, numpy as np, torch, tpool
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)
    pool = tpool.PagePool(4096, 16, device="cpu", backend="numba")
    table = tpool.PageTable(pool, 4, 1024)  # block_table: 4 x 1024 int32, 16 KiB
    table.extend(i32([0, 1]), i32([100, 200]), max_tokens=300)
    step = table.bind_step(i32([0, 1]), i32([1, 1]))
    res = step()
    # Resizing what the kernels point into is refused (it would free that memory).
    refused = []
    for name, t, edit in [("block_table", table.block_table, lambda t: t.resize_(8, 1024)),
                          ("free_stack", pool.state.free_stack, lambda t: t.untyped_storage().resize_(0)),
                          ("slots", res.slots, lambda t: t.resize_(10**6)),
                          ("indices", res.csr.indices, lambda t: t.untyped_storage().resize_(0))]:
        try:
            edit(t)
        except RuntimeError:
            refused.append(name)
    print(" ".join(refused))
    # Re-pointing them (set_) leaves the memory alive: the kernels keep writing it, nothing else.
    for t in (table.block_table, table.seq_lens, table.state.row_version, res.csr.indices, res.slots,
              pool.state.refcount, pool.state.page_state):
        t.set_(torch.zeros(1, dtype=t.dtype))
    gc.collect()
    junk = [torch.full((n,), 7, dtype=torch.int32) for n in (4096, 4, 1, 300, 512) for _ in range(50)]
    junk += [np.full(n, 7, dtype=np.int32) for n in (4096, 4, 1, 300, 512, 8192) for _ in range(50)]
    for _ in range(100):
        step()
    assert all(bool((j == 7).all()) for j in junk), "a kernel wrote into memory it does not own"
    # An input whose storage was shrunk or freed under it: refused before any call.
    ids, ntok = i32([2, 3]), i32([1, 1])
    for shrink in (0, 4):
        ids.untyped_storage().resize_(shrink)
        try:
            table.step(ids, ntok)
        except ValueError as e:
            print("storage" in str(e))
    counts = i32([1, 1])
    counts.untyped_storage().resize_(4)
    try:
        pool.alloc(counts)
    except ValueError as e:
        print("storage" in str(e))
""")


def test_hand_edits_of_storage_cannot_free_what_kernels_point_into():
    """Resizing a pool's or table's tensor is refused (their storages are fixed on a CPU); a tensor
    re-pointed with ``set_`` leaves its memory alive for the kernels; an input whose storage was
    shrunk under it is refused with a ValueError. In a subprocess: a regression is a crash."""
    r = subprocess.run([sys.executable, "-c", HAND_EDITS], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
    assert r.stdout.split("\n")[:4] == ["block_table free_stack slots indices", "True", "True", "True"]


def _shrunk_at_the_same_address(make):
    """A tensor from ``make()`` whose storage was shrunk in place and came back at its old address (tries
    fresh tensors until the allocator obliges), with what was bound or checked on it first; or None."""
    for _ in range(40):
        for small in (128, 192, 240, 252):
            t, bound = make()
            at, storage = t.data_ptr(), t.untyped_storage()
            storage.resize_(4)
            storage.resize_(small)
            if t.data_ptr() == at:
                return t, bound
    return None


def test_a_storage_shrunk_in_place_at_the_same_address_is_stale():
    """Address and length alone miss a storage resized in place that the allocator gave back at the same
    address: bound calls and the checks cached for the last inputs compare its size too."""
    import pytest
    import torch
    import tpool
    from tpool.errors import StaleBinding
    pool = tpool.PagePool(256, 1, device="cpu", backend="numba", max_batch=64)
    table = tpool.PageTable(pool, 64, 8)
    ntok = torch.zeros(64, dtype=torch.int32)

    def bound_step():
        ids = torch.full((64,), -1, dtype=torch.int32)
        table.step(ids, ntok)  # the façade now remembers these two as checked
        run = table.bind_step(ids, ntok)
        run()
        return ids, run

    def bound_step_tokens():
        ids, tokens = torch.full((64,), -1, dtype=torch.int32), torch.zeros(64, dtype=torch.int32)
        run = table.bind_step(ids, tokens)
        run()
        return tokens, run

    def bound_free():
        pages = torch.full((64,), -1, dtype=torch.int32)
        pool.free(pages)  # remembered as checked
        run = pool.bind_free(pages)
        run()
        return pages, run

    padding = torch.full((64,), -1, dtype=torch.int32)
    for make, unbound in ((bound_step, lambda t: table.step(t, ntok)),
                          (bound_step_tokens, lambda t: table.step(padding, t)), (bound_free, pool.free)):
        found = _shrunk_at_the_same_address(make)
        if found is None:
            pytest.skip("the allocator never gave a shrunk storage its old address back")
        t, run = found
        with pytest.raises(StaleBinding):
            run()
        with pytest.raises(ValueError, match="storage"):
            unbound(t)


def test_a_bound_input_given_other_memory_or_a_shorter_view_is_stale(backend):
    """Every input of a bound alloc, free and step, given other memory of its size (``set_`` to a copy:
    another address) or viewed shorter at its address (``set_`` over its own storage): StaleBinding before
    any kernel runs, nothing changed."""
    import pytest
    import torch
    import tpool
    from tpool.errors import StaleBinding
    for edit in ("elsewhere", "shorter"):
        for name in ("counts", "pages", "req_ids", "num_tokens"):
            pool = tpool.PagePool(64, 1, device="cpu", backend=backend)
            table = tpool.PageTable(pool, 8, 8)
            counts, pages = torch.ones(2, dtype=torch.int32), torch.tensor([0, 1, -1, -1], dtype=torch.int32)
            ids, tokens = torch.tensor([0, 1], dtype=torch.int32), torch.ones(2, dtype=torch.int32)
            table.extend(ids, tokens)
            inputs = {"counts": counts, "pages": pages, "req_ids": ids, "num_tokens": tokens}
            run = (pool.bind_alloc(counts, out=pool.alloc_out(2, 4)) if name == "counts" else
                   pool.bind_free(pages) if name == "pages" else table.bind_step(ids, tokens))
            t = inputs[name]
            if edit == "elsewhere":
                t.set_(t.clone())
            else:
                t.set_(t.untyped_storage(), 0, (t.numel() - 1,))
            with pytest.raises(StaleBinding):
                run()
            assert pool.available() == 62 and table.seq_lens.tolist()[:2] == [1, 1], (edit, name)


SHRUNK_RELEASE = textwrap.dedent("""
    import sys, torch, tpool
    sys.path.insert(0, sys.argv[1])
    from test_bound_lifetime import _shrunk_at_the_same_address
    table = tpool.PageTable(tpool.PagePool(256, 1, device="cpu", backend="reference", max_batch=64), 64, 8)
    ids, ntok = torch.full((2,), -1, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)

    def bound_release():
        release = torch.full((64,), -1, dtype=torch.int32)
        run = table.bind_step(ids, ntok, release=release)
        run()
        return release, run

    found = _shrunk_at_the_same_address(bound_release)
    if found is None:
        print("skip")
    else:
        try:
            found[1]()
            print("ran")
        except tpool.StaleBinding as e:
            print("stale" if "release" in str(e) else "other")
""")


def test_a_bound_release_whose_storage_shrank_at_the_same_address_is_stale():
    """A bound step's release ids, their storage shrunk in place and back at its old address: stale, as its
    other inputs are above (without comparing the storage's size the call wrote -1 past the storage and the
    process aborted). In a subprocess: a regression is a crash."""
    import pytest
    r = subprocess.run([sys.executable, "-c", SHRUNK_RELEASE, os.path.dirname(os.path.abspath(__file__))],
                       capture_output=True, text=True, timeout=120)
    if r.returncode == 0 and r.stdout.strip() == "skip":
        pytest.skip("the allocator never gave a shrunk storage its old address back")
    assert r.returncode == 0 and r.stdout.strip() == "stale", (r.returncode, r.stdout, r.stderr[-1000:])
