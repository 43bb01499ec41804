"""tests/test_sync_guard.py's subprocess: one part of the hot paths on the meta device (tests/meta_device.py),
the second round under its copy watch and no_host_sync(host_data=True) (which raises); prints what the
plants gave, then the copies recorded."""
import contextlib
import sys

import torch

import meta_device
meta_device.enable()

import tpool  # noqa: E402
from conftest import hot_path_calls, i32  # noqa: E402
from tpool.scheduling import HostMirror, PrefixCache  # noqa: E402
from tpool.testing import HostSyncError, no_host_sync  # noqa: E402

part = sys.argv[1]
watch = meta_device.CopyWatch()


@contextlib.contextmanager
def watched():
    with no_host_sync(host_data=True), watch:
        yield


if part == "plants":   # the harness can fail: a read of device data raises, a pageable copy is recorded
    t = torch.zeros(3, device="meta")
    for name, read in (("tolist", t.tolist), ("to cpu", lambda: t.to("cpu")), ("item", lambda: t[0].item()),
                       ("copy out", lambda: torch.empty(3).copy_(t))):
        try:
            read()
            print(name, "read")
        except (NotImplementedError, RuntimeError):
            print(name, "refused")
    try:
        with watched():
            torch.tensor([1, 2], device="meta")   # unseen by the copy watch (no dispatch): the guard sees it
        print("tensor(list, device=) built")
    except HostSyncError:
        print("tensor(list, device=) refused")
    with watch:
        t.copy_(torch.ones(3))
        t.copy_(torch.ones(3).pin_memory(), non_blocking=True)
elif part == "pool-and-table":
    run, pool, table = hot_path_calls("reference", device="meta")
    run()                                   # the first call of each shape makes its buffers
    ids, ntok, rel, pad = i32([0, 1], "meta"), i32([3, 2], "meta"), i32([-1], "meta"), i32([-1, -1], "meta")
    page, gen = i32([0], "meta"), torch.empty(1, dtype=torch.int32, device="meta")
    out = table.step_out(batch=2, max_tokens=8)
    more = (lambda: pool.free(pool.alloc(ids).pages),    # alloc without out=, a CSR with a capacity
            lambda: table.flashinfer_csr(ids, capacity=16))
    for call in more:       # (each shape's first call makes its buffers)
        call()
    with watched():
        run()
        for call in more:
            call()
        pool.stats_async()                  # the start of the copy (its get() is a read, after the block)
        table.step(ids, ntok, release=rel, release_cache=True)
        table.step(ids, ntok, release=rel)
        table.step(ids, ntok, out=out)
        table.bind_step(ids, ntok, out=out)()
        table.bind_step(batch=2, release=1, out=out)()
        with pool.free_group(capacity=8):
            pool.free(pad)
        pool.generations(page, out=gen)
        table.release(ids)
elif part == "mirror":
    pool = tpool.PagePool(64, page_size=4, device="meta", backend="reference")
    table = tpool.PageTable(pool, 8, 8)
    m = HostMirror(table, free=64, cached=0)
    cache = PrefixCache(m)
    for _ in range(2):                      # the second round under the watch
        with watched() if _ else contextlib.nullcontext():
            m.can_admit([9, 5])
            rows = m.admit([9, 5])
            m.decode(rows)
            m.decode(rows, [2, 1])
            m.step(rows, 1, [6], width=4)
            m.preemption(rows, [0, 1], n=1)
            m.fits(rows), m.shortfall([4])
            m.reserve(rows[0], 4), m.unreserve(rows[0])
            m.shared_prefix(rows[0]), m.length_bounds(rows[0]), m.pages_needed(rows[1], 3), m.running()
            m.snapshot()                    # the start of the copy (reconcile is the read, after the block)
            m.truncate([rows[0]], [8])
            m.rollback([rows[1]], torch.full((1,), 5, dtype=torch.int32, device="meta"), [4])
            forked = m.fork(rows[0], 6)
            m.decode(rows, out=table.step_out(batch=4, max_tokens=64))
            m.decode(rows, run=False)
            (r,) = m.admit([10])
            cache.insert(r, list(range(10)))
            m.finish([r, forked], cache=True)
            m.finish(rows, cache=True)
            hit = cache.match(list(range(10)) + [1])
            row = cache.revive(hit, max_len=16)
            m.decode([row])
            m.finish([row], cache=True)
    with watched():         # last: reading what an eviction took is a sync point (match stays closed until then)
        cache.evict(3)
        n = cache.unread().shape[0]         # the slots, on the device; their values are read at a sync point
        cache.drop([-1] * n)                # (meta holds none: -1 is skipped) host ints, reopening match
        cache.match(list(range(10)))
    other = tpool.PagePool(16, page_size=4, device="meta", backend="reference")
    plain = HostMirror(tpool.PageTable(other, 2, 8), free=16, cached=0)
    (r,) = plain.admit([8])
    first = plain.table.block_table[r, :2].clone()      # its two pages, CACHED once it finishes
    gens = other.generations(first)
    with watched():         # a mirror without a cache revives and evicts itself
        plain.finish([r], cache=True)
        r = plain.revive(first, 8, max_len=12, generations=gens)
        plain.finish([r], cache=True)
        r = plain.revive(first[:1], 4, count_cached=True)
        plain.finish([r], cache=True)
        plain.evict(1)
print("events:", *watch.events, sep="\n  ")
