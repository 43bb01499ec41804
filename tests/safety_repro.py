"""The smallest reproducers of issue 11's kernel findings, run on one backend; prints JSON.

Run as ``python tests/safety_repro.py BACKEND`` (``TRITON_INTERPRET=1`` for Triton without a
GPU). Several of these crashed the process before the fix (a numba kernel reading or
writing past its tensors), so ``tests/test_safety.py`` runs this in a subprocess: a
crash fails the test instead of killing pytest.
"""

import json
import sys

import torch


def i32(v):
    return torch.tensor(v, dtype=torch.int32)


def main(backend: str) -> dict:
    import tpool
    from tpool.kernels import layout as L
    from tpool.testing import no_host_sync
    torch.set_num_threads(1)
    out = {}

    def table(P=16, ps=4, R=4, MP=4):
        pool = tpool.PagePool(P, ps, device="cpu", backend=backend)
        return pool, tpool.PageTable(pool, R, MP)

    def err(pool, slot):
        return int(pool.state.counters[slot])

    # Finding 3a: a length past the row, then the CSR export (numba read past block_table).
    for bad in (1_000_000, 2**31 - 1):
        pool, t = table()
        t.extend(i32([0, 1]), i32([5, 3]), max_tokens=8)
        t.seq_lens[0] = bad
        t.invalidate_csr()
        with no_host_sync():
            csr = t.flashinfer_csr(i32([0, 1]))
        out[f"csr_{bad}"] = dict(indptr=csr.indptr.tolist(), indices=csr.indices.tolist(),
                                 last=csr.last_page_len.tolist(), corrupt=err(pool, L.ERR_CORRUPT_STATE))
    # Finding 3b: a negative length, then extend (numba wrote into request 0's row).
    for bad in (-6, -10**9):
        pool, t = table()
        t.extend(i32([0, 1]), i32([5, 3]), max_tokens=8)
        t.seq_lens[1] = bad
        t.invalidate_csr()
        with no_host_sync():
            r = t.extend(i32([1]), i32([3]), max_tokens=3)
            s = t.step(i32([1, 0]), i32([1, 1]))
        out[f"extend_{bad}"] = dict(ok=r.ok.tolist(), slots=r.slots.tolist(), step_ok=s.ok.tolist(),
                                    step_indptr=s.csr.indptr.tolist(), rows=t.block_table.tolist(),
                                    lens=t.seq_lens.tolist(), corrupt=err(pool, L.ERR_CORRUPT_STATE),
                                    free=pool.available())
    # Corrupt free count / free-stack entry: alloc pops nothing past the stack.
    pool = tpool.PagePool(4, 1, device="cpu", backend=backend)
    pool.state.counters[L.FREE_COUNT] = 100
    with no_host_sync():
        a = pool.alloc(i32([1]))
    pool.state.counters[L.FREE_COUNT] = 4
    pool.state.free_stack[3] = 99
    with no_host_sync():
        b = pool.alloc(i32([2]))
    out["stack"] = dict(first_ok=a.ok[:1].tolist(), pages=b.pages.tolist(), corrupt=err(pool, L.ERR_CORRUPT_STATE),
                        free=int(pool.state.counters[L.FREE_COUNT]))
    # Session 25: a free of a page whose refcount is near INT32_MIN (a hand edit): Triton's k - d wrapped in
    # int32 and stored a negative double_free that check() did not raise.
    pool = tpool.PagePool(4, 1, device="cpu", backend=backend)
    pool.alloc(i32([2]))  # pages 0 and 1 in use
    pool.state.refcount[0] = -2**31
    with no_host_sync():
        pool.free(i32([0, 0]))
    out["free_wrapped_refcount"] = dict(double=err(pool, L.ERR_DOUBLE_FREE), rc=pool.state.refcount.tolist())
    # Session 25: touch of a page in no known state stamped it and counted nothing (incref counts it).
    pool = tpool.PagePool(4, 1, device="cpu", backend=backend)
    pool.alloc(i32([2]))
    pool.state.page_state[1] = 7
    before = pool.state.stamp.tolist()
    with no_host_sync():
        pool.touch(i32([0, 1, 1, -1]))
    out["touch_unknown"] = dict(corrupt=err(pool, L.ERR_CORRUPT_STATE), stamp=pool.state.stamp.tolist(),
                                before=before, clock=int(pool.state.counters[L.CLOCK]))
    # A cached page's stamp outside [0, clock]: numba's radix select (before the LRU queue) read past its histogram.
    pool = tpool.PagePool(8, 1, device="cpu", backend=backend)
    a = pool.alloc(i32([3]))
    pool.free(a.pages[:3].clone(), cache=True)
    pool.state.stamp[0], pool.state.stamp[1] = -2**62, 2**62
    with no_host_sync():
        ev = pool.evict(2)
    out["stamp"] = dict(evicted=ev.tolist(), corrupt=err(pool, L.ERR_CORRUPT_STATE),
                        cached=pool.stats()["pages.cached.current"])
    # Finding 4: fork from a row holding a page freed through the pool (page size 1).
    pool = tpool.PagePool(8, 1, device="cpu", backend=backend)
    t = tpool.PageTable(pool, 4, 4)
    t.extend(i32([0]), i32([2]), max_tokens=2)
    pool.free(i32([0]))
    with no_host_sync():
        f = t.fork(i32([0]), i32([1]), i32([2]))
    out["fork"] = dict(ok=f.ok.tolist(), row=t.block_table[1].tolist(), lens=t.seq_lens.tolist(),
                       uaf=err(pool, L.ERR_USE_AFTER_FREE), refcount=pool.state.refcount[:2].tolist())
    # Finding 7: reference counts saturate at INT32_MAX instead of wrapping.
    pool = tpool.PagePool(4, 1, device="cpu", backend=backend)
    pool.alloc(i32([1]))
    pool.state.refcount[0] = 2**31 - 6  # as if after 2**31 - 7 increfs
    with no_host_sync():
        pool.incref(i32([0] * 10))
        pool.free(i32([0]))
    out["saturate"] = dict(refcount=int(pool.state.refcount[0]), state=int(pool.state.page_state[0]),
                           overflow=err(pool, L.ERR_REFCOUNT_OVERFLOW), free=pool.available())
    pool = tpool.PagePool(8, 2, device="cpu", backend=backend)
    t = tpool.PageTable(pool, 4, 4)
    t.extend(i32([0]), i32([3]), max_tokens=3)
    pool.state.refcount[int(t.block_table[0, 0])] = 2**31 - 1
    with no_host_sync():
        f = t.fork(i32([0, 0]), i32([1, 2]), i32([2, 3]))
    out["fork_saturate"] = dict(ok=f.ok.tolist(), refcount=pool.state.refcount[:3].tolist(),
                                overflow=err(pool, L.ERR_REFCOUNT_OVERFLOW))
    # A page id outside the pool in a row (or the step's memo): its tokens get no slot (slots drive K/V
    # writes), one corrupt_state each; decode (twice: numba's second step reads its memo), a prefill lane
    # across the bad page, and a plain extend.
    pool, t = table(P=16, ps=4, R=4, MP=8)
    t.extend(i32([0, 1]), i32([5, 3]), max_tokens=8)  # row 0: pages 0, 1; row 1: page 2
    t.block_table[0, 1], t.block_table[1, 0] = 10**6, -7
    t.invalidate_csr()
    seen = dict(slots=[], pos=[], ok=[], indptr=[], indices=[], kv_lens=[])
    for ids, ntok, mt in (([0, 1], [1, 1], None), ([0, 1], [1, 1], None), ([0, 2], [5, 6], 16)):
        with no_host_sync():
            s = t.step(i32(ids), i32(ntok), max_tokens=mt)
        seen["slots"].append(s.slots.tolist())  # before the next step rewrites the buffers
        seen["pos"].append(s.positions.tolist())
        seen["ok"].append(s.ok.tolist())
        seen["indptr"].append(s.csr.indptr.tolist())
        seen["indices"].append(s.csr.indices[:4].tolist())
        seen["kv_lens"].append(s.kv_lens.tolist())
    with no_host_sync():
        ex = t.extend(i32([1]), i32([2]), max_tokens=2)
    out["bad_page_slots"] = dict(**seen, extend=ex.slots.tolist(), corrupt=err(pool, L.ERR_CORRUPT_STATE))
    # The same in the CSR an attention kernel reads: a request whose pages hold an id outside the pool is
    # exported as empty (kv_lens 0 in a step), one corrupt_state each. On numba the steps below take the
    # three ways a step makes its CSR: kept runs and a new request's row copied (2), a rebuild (3), and
    # growth in place (4, whose page comes from a wild free-stack entry).
    pool, t = table(P=16, ps=4, R=4, MP=8)
    t.extend(i32([0, 1, 2]), i32([3, 2, 2]), max_tokens=8)  # pages 0, 1, 2
    t.block_table[1, 0] = -7
    t.invalidate_csr()
    with no_host_sync():
        c = t.flashinfer_csr(i32([1, 0, -1]))
    csr = dict(indptr=c.indptr.tolist(), indices=c.indices[:4].tolist(), last=c.last_page_len.tolist(),
               corrupt=err(pool, L.ERR_CORRUPT_STATE))
    t.block_table[1, 0] = 1
    t.invalidate_csr()
    steps = []
    for k, ids in enumerate(([0, 1], [0, 2], [0, 2], [0, 2])):
        if k == 1:
            t.block_table[2, 0] = 10**6
            t.invalidate_csr(i32([2]))
        if k == 2:
            t.block_table[2, 0] = 2
            t.invalidate_csr(i32([2]))
        if k == 3:
            pool.state.free_stack[int(pool.state.counters[L.FREE_COUNT]) - 1] = 10**6
        with no_host_sync():
            s = t.step(i32(ids), i32([1, 1]))
        steps.append(dict(indptr=s.csr.indptr.tolist(), indices=s.csr.indices[:5].tolist(),
                          last=s.csr.last_page_len.tolist(), kv_lens=s.kv_lens.tolist(), slots=s.slots.tolist(),
                          corrupt=err(pool, L.ERR_CORRUPT_STATE)))
    out["bad_page_csr"] = dict(csr=csr, steps=steps)
    # Two StepOuts taking turns (numba grows the CSR one step behind in place): a step that pops a wild
    # entry leaves no CSR that the other buffer's next step could grow with that page.
    pool, t = table(P=16, ps=4, R=4, MP=8)
    t.extend(i32([0, 1]), i32([2, 2]), max_tokens=8)  # pages 0, 1
    outs = [t.step_out(2, max_tokens=2), t.step_out(2, max_tokens=2)]
    turns = []
    for k in range(4):  # lengths 3, 4, then 5 (both lanes pop a page: the first the wild entry), 6
        if k == 2:
            pool.state.free_stack[int(pool.state.counters[L.FREE_COUNT]) - 1] = 10**6
        with no_host_sync():
            s = t.step(i32([0, 1]), i32([1, 1]), out=outs[k % 2])
        turns.append(dict(indptr=s.csr.indptr.tolist(), indices=s.csr.indices[:5].tolist(),
                          kv_lens=s.kv_lens.tolist(), corrupt=err(pool, L.ERR_CORRUPT_STATE)))
    out["bad_page_turns"] = turns
    # Past the capacity: a CSR that overflows its capacity exports the requests that fit, and a wild id
    # in a request that does not fit is still counted (each backend scans every row it was asked for). A
    # length past the row together with a wild id counts once: the request is exported empty once.
    pool, t = table(P=16, ps=2, R=4, MP=6)
    t.extend(i32([0, 1, 2]), i32([6, 5, 3]), max_tokens=16)  # pages 0-2, 3-5, 6-7
    t.block_table[1, 2] = 99
    t.invalidate_csr()
    past = []
    for ids, cap in (([0, 1], 4), ([2, 1], 8)):
        with no_host_sync():
            c = t.flashinfer_csr(i32(ids), capacity=cap)
        past.append(dict(indptr=c.indptr.tolist(), indices=c.indices.tolist(), last=c.last_page_len.tolist(),
                         corrupt=err(pool, L.ERR_CORRUPT_STATE), overflow=err(pool, L.ERR_OUT_OVERFLOW)))
    with no_host_sync():
        s = t.step(i32([2, 1]), i32([1, 1]), capacity=3)
    past.append(dict(indptr=s.csr.indptr.tolist(), indices=s.csr.indices.tolist(), kv_lens=s.kv_lens.tolist(),
                     corrupt=err(pool, L.ERR_CORRUPT_STATE), overflow=err(pool, L.ERR_OUT_OVERFLOW)))
    t.seq_lens[1] = 10**6  # row 1 now has a wild id and a length past the row
    t.invalidate_csr()
    with no_host_sync():
        c = t.flashinfer_csr(i32([1, 0]))
    past.append(dict(indptr=c.indptr.tolist(), indices=c.indices[:4].tolist(), last=c.last_page_len.tolist(),
                     corrupt=err(pool, L.ERR_CORRUPT_STATE)))
    out["bad_page_past_capacity"] = past
    # A fork's copy-on-write pair drives a K/V copy: only between page ids of the pool. A wild source
    # (the src row's partial page) fails its lane, one corrupt_state, before any pop; a wild popped
    # page is counted by the pop and makes no pair.
    pool, t = table(P=16, ps=4, R=6, MP=4)
    t.extend(i32([0, 1]), i32([6, 7]), max_tokens=16)  # row 0: pages 0, 1; row 1: pages 2, 3
    t.block_table[1, 1] = 10**6
    t.invalidate_csr()
    pool.state.free_stack[int(pool.state.counters[L.FREE_COUNT]) - 2] = 777  # the fork's second pop
    with no_host_sync():
        f = t.fork(i32([0, 1, 0]), i32([2, 3, 4]), i32([6, 7, 5]))
    out["fork_cow"] = dict(ok=f.ok.tolist(), src=f.cow_src.tolist(), dst=f.cow_dst.tolist(),
                           corrupt=err(pool, L.ERR_CORRUPT_STATE), rows=t.block_table[2:5, :2].tolist())
    # A free-stack entry naming a USED page (a hand edit: not detected) popped by one fork lane and
    # shared by a later one: every backend does all the increfs first, then the pops (numba popped and
    # increfed lane by lane, so its reference counts differed).
    pool, t = table(P=8, ps=4, R=6, MP=4)
    t.extend(i32([0, 1]), i32([10, 8]), max_tokens=18)  # row 0: pages 0, 1, 2 (2 partial); row 1: pages 3, 4
    pool.state.free_stack[int(pool.state.counters[L.FREE_COUNT]) - 1] = 3
    t.invalidate_csr()
    with no_host_sync():
        f = t.fork(i32([0, 1]), i32([2, 3]), i32([9, 8]))  # lane 0 copies (pops page 3), lane 1 shares 3 and 4
    out["fork_pops_a_used_page"] = dict(ok=f.ok.tolist(), src=f.cow_src.tolist(), dst=f.cow_dst.tolist(),
                                        refcount=pool.state.refcount.tolist())
    # A free count near INT64_MAX: ``count + pages`` wrapped negative and passed numba's "every push
    # fits" test, so the free rule wrote before and past the stack (through a bound release step, a
    # free and an eviction). Each push is refused and counted instead.
    pool = tpool.PagePool(8, 1, device="cpu", backend=backend)
    t = tpool.PageTable(pool, 4, 4)
    run = t.bind_step(batch=2, max_tokens=8, release=1)
    run.req_ids[:] = torch.tensor([0, 1], dtype=torch.int32)
    run.num_tokens[:] = torch.tensor([2, 2], dtype=torch.int32)
    run()  # request 0: pages 0, 1; request 1: pages 2, 3
    pool.state.counters[L.FREE_COUNT] = 2**63 - 1
    run.req_ids[:] = -1
    run.release[0] = 1
    with no_host_sync():
        run()  # releases request 1: pages 2 and 3 reach 0 references
    stack_after_release = pool.state.free_stack.tolist()
    pool.state.counters[L.FREE_COUNT] = 2**63 - 2  # pages 0 and 1: count + 2 wraps
    with no_host_sync():
        pool.free(t.block_table[0, :2].clone())
    stack_after_free = pool.state.free_stack.tolist()
    pool.state.counters[L.FREE_COUNT] = 4
    a = pool.alloc(i32([2]))  # pages 4 and 5 (stack entries 3 and 2)
    pool.free(a.pages[:2].clone(), cache=True)
    pool.state.counters[L.FREE_COUNT] = 2**63 - 1
    with no_host_sync():
        ev = pool.evict(2)
    out["free_count_overflow"] = dict(stack_after_release=stack_after_release, stack_after_free=stack_after_free,
                                      stack=pool.state.free_stack.tolist(), evicted=ev.tolist(),
                                      free=int(pool.state.counters[L.FREE_COUNT]),
                                      corrupt=err(pool, L.ERR_CORRUPT_STATE), states=pool.state.page_state.tolist(),
                                      gens=pool.state.page_gen.tolist())
    del run, t, pool, a  # a clobbered allocator header aborts the process here (a crash fails the test)
    import gc
    gc.collect()
    # Hand edits without invalidate_csr (tests/fuzz_corrupt.py found these): a length raised, or the page the
    # last step added made wild, then a step whose StepOut holds the CSR one step behind (numba grew it in
    # place from the row, unchecked); a version cell set to -1, matching a memo that holds no CSR.
    stale = {}
    for edit in ("length", "page"):
        pool, t = table(P=16, ps=2, R=1, MP=6)
        a, b = t.step_out(1, max_tokens=4), t.step_out(1, max_tokens=4)
        t.step(i32([0]), i32([3]), out=a)
        t.step(i32([0]), i32([1]), out=b)
        t.step(i32([0]), i32([1]), out=a)  # length 5 on pages 0, 1, 2
        if edit == "length":
            t.seq_lens[0] += 4
        else:
            t.block_table[0, 2] = 2**31 - 1
        with no_host_sync():
            s = t.step(i32([0]), i32([1]), out=b)
        stale[edit] = dict(indptr=s.csr.indptr.tolist(), indices=s.csr.indices.tolist(), kv_lens=s.kv_lens.tolist(),
                           slots=s.slots.tolist(), corrupt=err(pool, L.ERR_CORRUPT_STATE))
    pool, t = table(P=8, ps=1, R=1, MP=2)
    t.seq_lens[0] = 2  # a length with no pages: exported empty, the memo left holding no CSR
    t.invalidate_csr()
    t.step(i32([0]), i32([0]))
    t.state.version[0] = -1
    with no_host_sync():
        s = t.step(i32([0]), i32([0]))
    stale["version"] = dict(indptr=s.csr.indptr.tolist(), indices=s.csr.indices.tolist(), kv_lens=s.kv_lens.tolist(),
                            corrupt=err(pool, L.ERR_CORRUPT_STATE))
    out["stale_csr"] = stale
    out["re_pointed"] = re_pointed(backend)
    out["memo_names_a_request_twice"] = memo_names_a_request_twice(backend)
    return out


def re_pointed(backend: str) -> dict:
    """State tensors, a StepOut's buffers and its memo, the table's fork and rows buffers re-pointed by
    hand (``set_``) at one entry of a larger canary buffer, then a step, a fork, a rows copy, an incref
    and a revive: every backend keeps the memory it was
    given (Triton took the sizes from the pool and wrote past the one entry; numba's revive followed
    the memo's new address). Returns the canary entries changed and what the calls wrote, read
    through views taken before the edit, next to an untouched twin's."""
    import tpool
    from tpool.kernels import layout as L

    def run(edit):
        pool = tpool.PagePool(64, 4, device="cpu", backend=backend)
        t = tpool.PageTable(pool, 8, 8)
        out = t.step_out(4, max_tokens=8, capacity=16)
        t.step(i32([0, 1, 2, 3]), i32([2, 2, 2, 2]), out=out)
        a = pool.alloc(i32([2]))
        pool.free(a.pages[:2].clone(), cache=True)
        fork = t.fork(i32([0, 1]), i32([6, 7]), i32([2, 2]))  # the table's own fork and rows buffers
        rows = t.block_table_rows(i32([0, 1, 2]))
        t.release(i32([6, 7]))
        res = out.result
        named = dict(refcount=pool.state.refcount, page_state=pool.state.page_state, stack=pool.state.free_stack,
                     counters=pool.state.counters, lens=t.seq_lens, rows=t.block_table,
                     row_version=t.state.row_version, slots=res.slots, ok=res.ok, indptr=res.csr.indptr,
                     indices=res.csr.indices, kv_lens=res.kv_lens, positions=res.positions, fork_ok=fork.ok,
                     cow_src=fork.cow_src, cow_dst=fork.cow_dst, row_copy=rows, memo=out.memo.tensor)
        views = {k: x.view(x.shape) for k, x in named.items()}
        canaries = []
        if edit:
            for x in named.values():
                c = torch.full((4096,), 5, dtype=x.dtype)  # 5: the revived row's id, a memo forgets its lanes
                x.set_(c.untyped_storage(), 0, (1,) * x.dim())
                canaries.append((c, c.clone()))
        t.step(i32([0, 1, 2, 3]), i32([1, 1, 1, 1]), out=out)
        t.fork(i32([0, 1]), i32([6, 7]), i32([3, 4]))  # (3: a copy-on-write pair)
        t.block_table_rows(i32([0, 1, 2]))
        pool.incref(i32([5]))
        t.revive(5, a.pages[:2].clone(), 8)
        changed = sum(int((c[1:] != was[1:]).sum()) for c, was in canaries)
        # (row versions, drawn per table, and the memo's bookkeeping are not compared)
        return changed, {k: v.tolist() for k, v in views.items() if k not in ("row_version", "memo")}
    changed, after = run(True)
    _, twin = run(False)
    # A memo re-pointed before any step, at a buffer of zeros (row 0 in every lane, the fresh table's
    # version 0): numba's revive of row 0 wrote the memo's length of entries from the new address.
    pool = tpool.PagePool(16, 1, device="cpu", backend=backend)
    t = tpool.PageTable(pool, 4, 4)
    out = t.step_out(64)
    zeros = torch.zeros(L.memo_len(64) + 64, dtype=torch.int64)
    out.memo.tensor.set_(zeros.untyped_storage(), 0, (3,))
    a = pool.alloc(i32([2]))
    pool.free(a.pages[:2].clone(), cache=True)
    t.revive(0, a.pages[:2].clone(), 2)
    changed += int((zeros[3:] != 0).sum())
    return dict(canary_changed=changed, same_as_untouched=after == twin, free=after["counters"][L.FREE_COUNT],
                rows=after["rows"][5])


def memo_names_a_request_twice(backend: str) -> dict:
    """A step memo edited by hand so its batch names one request in every lane, one step behind (no
    step leaves one so: a batch with a request twice leaves the memo holding no CSR). numba's
    one-behind decode read the row's length again per lane and wrote past the CSR's capacity; now a
    step whose lanes hold more pages than its first pass counted rebuilds the CSR within the capacity,
    counted as corrupt state."""
    import tpool
    from tpool.kernels import layout as L
    B = 16
    pool = tpool.PagePool(256, 1, device="cpu", backend=backend, max_batch=B)
    t = tpool.PageTable(pool, B, 64)
    a, c = t.step_out(B, max_tokens=B, capacity=2 * B), t.step_out(B, max_tokens=B, capacity=2 * B)
    t.step(i32([0] + [-1] * (B - 1)), i32([0] * B), out=a)
    t.step(i32([0] + [-1] * (B - 1)), i32([1] + [0] * (B - 1)), out=c)  # a is one step behind
    m = a.memo.tensor
    m[L.MEMO_IDS:L.MEMO_IDS + B] = 0
    m[L.memo_tails(B):L.memo_tails(B) + B] = m[L.memo_tails(B)].clone()
    s = t.step(i32([0] * B), i32([1] * B), out=a)
    return dict(end=int(s.csr.indptr[-1]), capacity=s.csr.indices.numel(), ok=s.ok.tolist(),
                corrupt=int(pool.state.counters[L.ERR_CORRUPT_STATE]))


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
