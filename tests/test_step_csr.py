"""The numba step's CSR grows in place between steps of the same batch: it must always equal a rebuilt one.

The oracle is a reference table fed the same calls. The workloads mix what
must make the next step rebuild (a release, a truncate, a fork, a plain
extend, another shape's step, a restored snapshot, a new batch, a repeated or
unknown id, a CSR too small) with runs of steps on one batch, the case that
grows the CSR; the test checks that those runs happened.
"""

import random

import pytest
import torch

import tpool
from conftest import i32, same_table_state
from tpool.graphs import state_tensors
from tpool.kernels import layout as L

R, MP, PS, B = 12, 10, 4, 6


def twins(num_pages):
    """A numba table and the reference table it must match."""
    return [tpool.PageTable(tpool.PagePool(num_pages, PS, device="cpu", backend=be), R, MP)
            for be in ("numba", "reference")]


def will_grow(table, ids, cap):
    """True when the numba step about to run may grow the CSR it made last time (its memo says so)."""
    return table.step_grows_csr(i32(ids), max_tokens=len(ids), capacity=cap)


def will_keep(table, ids, cap):
    """Lanes whose run the numba step about to run keeps from the CSR its buffers hold (0: none)."""
    return table.step_keeps_csr(i32(ids), max_tokens=len(ids), capacity=cap)


def turn_over(tables, batch, rng, compact):
    """A request of the batch finishes and a new one takes its place, with a prompt: in its lane
    (a persistent batch), or at the end after the others move up one lane (a compacted batch).
    The finished one is released here, or (half the time) by the step: returns the new batch,
    each lane's tokens and the ids the step releases (or None)."""
    lanes = [i for i, r in enumerate(batch) if r >= 0]
    i = rng.choice(lanes)
    free_rows = [d for d in range(R) if d not in batch and int(tables[1].seq_lens[d]) == 0]
    gone = [batch[i], -1]
    if rng.random() < 0.5 or not free_rows:
        for t in tables:
            t.release(i32(gone))
        gone = None
    if not free_rows:
        return batch, [0 if r < 0 else 1 for r in batch], None
    new = free_rows[0]
    batch = batch[:i] + batch[i + 1:] + [new] if compact else batch[:i] + [new] + batch[i + 1:]
    return batch, [0 if r < 0 else (rng.randint(1, 2) if r == new else 1) for r in batch], gone


def step_both(tables, ids, ntok, cap, guard, release=None):
    outs = []
    for t in tables:
        with guard():
            outs.append(t.step(i32(ids), i32(ntok), max_tokens=len(ids), capacity=cap,
                               release=None if release is None else i32(release)))
    got, want = outs
    names = ("slots", "ok", "indptr", "indices", "last_page_len", "positions", "qo_indptr", "kv_lens")
    fields = [(r.slots, r.ok, *r.csr, *r.metadata) for r in (got, want)]
    for x, y, name in zip(*fields, names):
        assert x.tolist() == y.tolist(), name
    same_table_state(*tables)
    tables[0].check_invariants()  # also: a CSR the next step may grow is its batch's CSR
    return got


@pytest.mark.parametrize("seed", range(6))
def test_grown_csr_equals_rebuilt_csr_over_random_workloads(seed, guard):
    rng = random.Random(seed)
    tables = twins(num_pages=rng.choice([40, 70, 120]))
    batch = [0, 1, 2, 3, 4, -1]
    for r in range(5):
        n = rng.randint(1, 14)
        for t in tables:
            t.extend(i32([r]), i32([n]), max_tokens=14)
    snapshots = []
    grown = kept = 0
    for _ in range(160):
        op = rng.choices(["decode", "prefill", "batch", "release", "truncate", "extend", "fork", "snapshot",
                          "restore", "other", "dup", "bad", "small", "replace", "compact"],
                         [40, 6, 5, 4, 4, 4, 3, 4, 5, 3, 2, 2, 3, 10, 6])[0]
        if op in ("replace", "compact"):  # a finished request leaves, a new one joins: the kept runs move
            batch, ntok, gone = turn_over(tables, batch, rng, op == "compact")
            kept += gone is None and will_keep(tables[0], batch, B * MP) > 0
            step_both(tables, batch, ntok, B * MP, guard, release=gone)
        elif op in ("decode", "prefill"):
            ntok = [0 if r < 0 else 1 for r in batch]
            if op == "prefill":  # some lanes take several pages in one step
                ntok = [n * rng.choice([1, 5, 9]) for n in ntok]
            grown += will_grow(tables[0], batch, B * MP)
            step_both(tables, batch, ntok, B * MP, guard)
        elif op == "batch":
            batch = rng.sample(range(R), B - 1) + [-1]
            rng.shuffle(batch)
        elif op in ("dup", "bad", "small"):  # rebuilds: a repeated id, an unknown id, a CSR too small
            ids = list(batch)
            ids[rng.randrange(B)] = rng.choice([r for r in ids if r >= 0]) if op == "dup" else R + 3
            cap = B * MP if op != "small" else 9
            for _ in range(2):  # twice: the second step must rebuild as well
                step_both(tables, batch if op == "small" else ids, [1] * B, cap, guard)
        elif op == "other":  # another shape's step, on rows the batch may hold
            ids = rng.sample(range(R), 2)
            step_both(tables, ids, [1, 1], 2 * MP, guard)
        elif op == "snapshot":
            snapshots.append([[x.clone() for x in state_tensors(t)] for t in tables])
        elif op == "restore" and snapshots:
            saved = rng.choice(snapshots)
            for t, s in zip(tables, saved):
                for x, y in zip(state_tensors(t), s, strict=True):
                    x.copy_(y)
        else:
            r = rng.choice([r for r in batch if r >= 0])
            length = int(tables[1].seq_lens[r])
            new_len, n = rng.randint(0, length), rng.randint(1, 6)
            free_rows = [d for d in range(R) if int(tables[1].seq_lens[d]) == 0 and d != r]
            for t in tables:
                with guard():
                    if op == "release":
                        t.release(i32([r]))
                    elif op == "truncate":
                        t.truncate(i32([r]), i32([new_len]))
                    elif op == "extend":
                        t.extend(i32([r]), i32([n]), max_tokens=6)
                    elif free_rows:  # fork into an empty row, so a later batch may hold it
                        t.fork(i32([r]), i32([free_rows[0]]), i32([length]))
            same_table_state(*tables)
    assert grown >= 20  # the in-place path ran, not only rebuilds
    assert kept >= 5    # and steps on a changed batch or changed rows kept the runs of unchanged rows
    assert tables[0].pool.stats() == tables[1].pool.stats()  # the errors the workload made, counted alike
    for t in tables:
        t.check_invariants()


def test_a_restored_snapshot_then_another_change_rebuilds(guard):
    """The case a version kept only in the table's state would get wrong: after a restore,
    one other change brings the table to as many changes as the CSR was made after."""
    tables = twins(num_pages=60)
    batch, ones = [0, 1, 2], [1, 1, 1]
    for t in tables:
        t.extend(i32(batch), i32([4, 8, 3]), max_tokens=15)
    saved = [[x.clone() for x in state_tensors(t)] for t in tables]
    step_both(tables, batch, ones, 3 * MP, guard)      # lengths 5, 9, 4: the CSR of that table
    for t, s in zip(tables, saved):                     # back to 4, 8, 3 ...
        for x, y in zip(state_tensors(t), s, strict=True):
            x.copy_(y)
    for t in tables:                                    # ... and one other change: 5, 9, 5
        t.extend(i32(batch), i32([1, 1, 2]), max_tokens=4)
    got = step_both(tables, batch, ones, 3 * MP, guard)
    assert got.csr.indptr.tolist() == [0, 2, 5, 7]


def test_decode_run_grows_pages_at_every_boundary(guard):
    """A long run of decode steps on one batch: every step after the first grows the CSR."""
    tables = twins(num_pages=80)
    batch = [3, -1, 0, 7, 5, 1]
    for t in tables:
        t.extend(i32([r for r in batch if r >= 0]), i32([1, 4, 7, 2, 5]), max_tokens=19)
    ntok = [0 if r < 0 else 1 for r in batch]
    for i in range(24):
        assert will_grow(tables[0], batch, B * MP) == (i > 0)
        got = step_both(tables, batch, ntok, B * MP, guard)
    assert got.csr.indptr.tolist()[-1] == sum(-(-(n + 24) // PS) for n in (1, 4, 7, 2, 5))


@pytest.mark.parametrize("page_size", [PS, 3])
def test_decode_steps_at_the_edges_match_the_reference(page_size, guard):
    """A decode step of an unchanged batch takes a short path in numba (``decode_in_place``) and
    falls back to the full step whenever it is not that simple. At each edge the two tables must
    still agree: a CSR that outgrows its buffer, padding lanes with 0, 2, 3 or -1 tokens (more slots
    than the step has), a request appending nothing, a request at its last page (overflow) while
    the pool has pages, two lanes at a page boundary with one free page (first come, first served),
    a free count or a free-stack entry edited out of range, a non-power-of-two page size."""
    ps = page_size
    tables = [tpool.PageTable(tpool.PagePool(40, ps, device="cpu", backend=be), R, 4) for be in ("numba", "reference")]
    batch = [3, -1, 0, 7, 5, -1]
    for t in tables:
        t.extend(i32([3, 0, 7, 5]), i32([ps, ps, 3 * ps - 1, 1]), max_tokens=6 * ps)

    def decode(steps, pads, idle=1):
        for i in range(steps):
            pad = pads[i % len(pads)]
            for _ in range(2):  # twice: the second step finds its batch in the memo
                step_both(tables, batch, [1, pad[0], 1, 1, idle, pad[1]], B * MP, guard)

    for _ in range(2):  # a CSR buffer of 8 pages: the first step fills it, the second outgrows it
        step_both(tables, batch, [1, 0, 1, 1, 1, 0], 8, guard)
    decode(1, [(3, -1)])  # more slots than the step has (max_tokens=B): the last lanes fail, out_overflow
    decode(1, [(0, 0)], idle=0)  # a request that appends nothing this step
    decode(-(-(ps + 2) // 2), [(0, 0), (2, 0), (-1, 1)])  # request 7 reaches its 4 pages, then overflows
    stats = tables[1].pool.stats()
    assert stats["errors.table_overflow"] > 0 and stats["pages.free.current"] > 2
    hold = int(stats["pages.free.current"]) - 1  # one free page left; requests 3 and 0 reach a boundary together
    for r in (1, 2, 4, 6, 8, 9, 10, 11):  # rows outside the batch take the others
        for t in tables:
            t.extend(i32([r]), i32([min(hold, 4) * ps]), max_tokens=4 * ps)
        hold -= min(hold, 4)
    decode(ps, [(0, 0)])
    stats = tables[1].pool.stats()
    assert stats["pages.free.current"] == 0 and stats["requests.failed"] > stats["errors.table_overflow"]

    for t in tables:  # every page back; the batch starts again inside its first pages
        t.release(i32([1, 2, 4, 6, 8, 9, 10, 11, 3, 0, 7, 5]))
        t.extend(i32([3, 0, 7, 5]), i32([1, 1, max(ps - 2, 1), 1]), max_tokens=4 * ps)
    step_both(tables, batch, [1, 0, 1, 1, 1, 0], B * MP, guard)

    def step_edited(edit):  # not step_both: it checks the invariants, which an edit breaks
        before = tables[1].pool.stats()["errors.corrupt_state"]
        for t in tables:
            edit(t.pool.state)
        got, want = (t.step(i32(batch), i32([1, 0, 1, 1, 1, 0]), max_tokens=B, capacity=B * MP) for t in tables)
        for x, y in zip((got.slots, got.ok, *got.csr, *got.metadata), (want.slots, want.ok, *want.csr, *want.metadata)):
            assert x.tolist() == y.tolist()
        assert tables[0].pool.stats() == tables[1].pool.stats()
        assert tables[1].pool.stats()["errors.corrupt_state"] > before

    free = int(tables[1].pool.state.counters[0])
    step_edited(lambda st: st.counters.__setitem__(0, 41))  # a free count past the pool (no lane needs a page)
    for t in tables:
        t.pool.state.counters[0] = free
    assert int(tables[1].seq_lens[7]) % ps == 0  # request 7 takes a page next: the one on top of the stack is no page
    step_edited(lambda st: st.free_stack.__setitem__(free - 1, 1000))


def test_check_invariants_catches_a_step_csr_written_to(guard):
    """The next step would grow a CSR a caller wrote into: check_invariants says so."""
    table = twins(num_pages=40)[0]
    table.extend(i32([0, 1]), i32([9, 3]), max_tokens=12)
    for _ in range(2):
        with guard():
            s = table.step(i32([0, 1]), i32([1, 1]))
    table.check_invariants()
    s.csr.indices[1] = 39
    with pytest.raises(tpool.InvariantViolation, match="the CSR of step shape"):
        table.check_invariants()


def test_state_copied_from_another_table_or_edited_by_hand(guard):
    """Versions do not repeat across tables (a state copied in rebuilds the CSR); edits by hand
    need invalidate_csr(), and check_invariants catches them without it."""
    a, ref = twins(num_pages=40)
    b = tpool.PageTable(tpool.PagePool(40, PS, device="cpu", backend="numba"), R, MP)
    for t, lens in ((a, [3, 5]), (ref, [3, 5]), (b, [2, 9])):
        t.extend(i32([0, 1]), i32(lens), max_tokens=11)
    for t in (a, b):
        t.step(i32([0, 1]), i32([1, 1]))   # a's CSR memo names a's version; b does as many changes
    for x, y in zip(state_tensors(a), state_tensors(b), strict=True):
        x.copy_(y)
    for x, y in zip(state_tensors(ref), state_tensors(b), strict=True):
        x.copy_(y)
    want = ref.step(i32([0, 1]), i32([1, 1]))    # the reference already stands at b's contents; align a
    with guard():
        got = a.step(i32([0, 1]), i32([1, 1]))
    assert got.csr.indices.tolist() == want.csr.indices.tolist()

    saved = [x.clone() for x in (a.block_table, a.seq_lens)]
    a.step(i32([0, 1]), i32([1, 1]))
    for x, y in zip((a.block_table, a.seq_lens), saved):  # a hand edit: the version stays
        x.copy_(y)
    with pytest.raises(tpool.InvariantViolation, match="edited by hand"):
        a.check_invariants(exclusive=False)
    a.invalidate_csr()
    a.check_invariants(exclusive=False)
    with guard():
        got = a.step(i32([0, 1]), i32([1, 1]))
    want = [p for r in (0, 1) for p in a.block_table[r, :-(-int(a.seq_lens[r]) // PS)].tolist()]
    assert got.csr.indices.tolist()[:len(want)] == want


def test_version_counter_is_atomic_across_threads():
    """numba kernels run without the GIL: two threads taking versions at once must never get the
    same one (a lost update could hand a table a version it had already used)."""
    import threading

    import numba
    import numpy as np

    from tpool.kernels._numba_util import fetch_add_i64

    @numba.njit(nogil=True)
    def take(addr, seen, n):
        for _ in range(n):  # the store may alias the counter, so the loop is not folded into one add
            seen[fetch_add_i64(addr, 1) & 1023] += 1

    cell = np.zeros(1, np.int64)
    take(cell.ctypes.data, np.zeros(1024, np.int64), 1)
    start = threading.Barrier(2)

    def run():
        seen = np.zeros(1024, np.int64)
        start.wait()  # both threads enter the kernel together
        take(cell.ctypes.data, seen, 10_000_000)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cell[0] == 1 + 20_000_000


@pytest.mark.parametrize("caller_owned", [False, True])
def test_check_invariants_finds_a_hand_edit_the_next_step_would_trust(caller_owned, guard):
    """A numba step reads each lane's length from its memo: a hand edit without invalidate_csr()
    makes that stale, for the table's own buffers and for caller-owned ones (step(out=)) alike."""
    table = twins(num_pages=60)[0]
    out = table.step_out(2, max_tokens=2) if caller_owned else None
    with guard():
        table.extend(i32([0, 1]), i32([3, 6]), max_tokens=9)
        for _ in range(2):
            table.step(i32([0, 1]), i32([1, 1]), out=out)
    table.check_invariants()
    table.seq_lens[1] = 5                      # same page count: only the memo's tail is stale now
    with pytest.raises(tpool.InvariantViolation, match="invalidate_csr"):
        table.check_invariants()
    table.invalidate_csr()
    table.check_invariants()
    with guard():
        r = table.step(i32([0, 1]), i32([1, 1]), out=out)
    assert r.slots.tolist()[1] == int(table.block_table[1, 1]) * PS + 1   # position 5 of request 1


def test_a_turnover_step_keeps_the_runs_of_the_requests_that_stay(guard):
    """A request finishes and a new one takes its lane (a persistent batch), or the others move up
    one lane and it joins at the end (a compacted batch): the step after keeps every other run."""
    for compact in (False, True):
        tables = twins(num_pages=90)
        batch = [0, 1, 2, 3, 4, 5]
        for t in tables:
            t.extend(i32(batch), i32([5, 9, 2, 12, 7, 4]), max_tokens=39)
        for _ in range(3):
            step_both(tables, batch, [1] * B, B * MP, guard)
        for t in tables:
            t.release(i32([2]))
        batch = [0, 1, 3, 4, 5, 6] if compact else [0, 1, 6, 3, 4, 5]
        assert will_keep(tables[0], batch, B * MP) == 5
        got = step_both(tables, batch, [1] * B, B * MP, guard)  # the new request's first token: a new page
        assert got.csr.indptr.tolist()[-1] == sum(-(-(n + 4) // PS) for n in (5, 9, 12, 7, 4)) + 1


def test_step_outs_in_rotation_keep_the_rows_the_steps_in_between_did_not_grow(guard):
    """Three StepOuts written in turn: each step finds the CSR of three steps ago, two steps behind
    the table, and keeps the run of every request the steps in between gave no page."""
    tables = twins(num_pages=90)
    batch = [0, 1, 2, 3, 4, 5]
    for t in tables:
        t.extend(i32(batch), i32([5, 9, 2, 12, 7, 4]), max_tokens=39)
    outs = [[t.step_out(B, capacity=B * MP) for t in tables] for _ in range(3)]
    pages = []  # each request's pages before each step
    for n in range(14):
        ids, ones = i32(batch), i32([1] * B)
        out = outs[n % 3]
        kept = len(out[0].memo.kept_lanes(batch, tables[0].state.row_version.tolist()))
        pages.append([-(-int(x) // PS) for x in tables[1].seq_lens[:B].tolist()])
        assert out[0].memo.growable_batch(*tables[0].state.version.tolist()) is None  # two steps behind
        res = []
        for t, o in zip(tables, out):
            with guard():
                res.append(t.step(ids, ones, out=o))
        got, want = res
        for x, y in zip(got.csr, want.csr):
            assert x.tolist() == y.tolist()
        same_table_state(*tables)
        tables[0].check_invariants()
        if n >= 3:  # the lanes whose pages the two steps in between did not change keep their runs
            assert kept == sum(1 for r in batch if pages[-3][r] == pages[-1][r]) and kept > 0


@pytest.mark.parametrize("page_size", [4, 3, 1])
def test_step_outs_taking_turns_grow_in_place_and_match_the_reference(page_size, guard):
    """Overlap scheduling: steps take turns between two StepOuts, so each finds the CSR it holds one
    step behind the table. A step only appends, so the numba step still grows that CSR in place (the
    pages the step before gave its lanes, then its own; a power-of-two page size only). Checked
    against the reference after every step, with in between: steps of several tokens a lane (the
    next turn inserts several pages a lane), padding lanes, a release and re-admission of a request
    outside the
    batch, or of a request in it (its row gets new pages, at least as many: not a step, so the next
    turn keeps the other runs instead), restored snapshots, and another table stepping on the same
    pool (versions move on, this table's do not)."""
    rng = random.Random(page_size)
    mp = 48
    tables = [tpool.PageTable(tpool.PagePool(600, page_size, device="cpu", backend=be), R, mp)
              for be in ("numba", "reference")]
    others = [tpool.PageTable(t.pool, 2, mp) for t in tables]
    batch = [0, 1, -1, 2, 3, 4, 5, -1]
    b, cap, T = len(batch), len(batch) * mp, 4 * len(batch)
    prompts = [page_size * k + j for k, j in zip((1, 2, 0, 3, 1, 2), (0, 1, 2, 3, 0, 1))]  # some at a boundary
    for t in tables:
        t.extend(i32([0, 1, 2, 3, 4, 5]), i32(prompts), max_tokens=64)
    outs = [[t.step_out(b, max_tokens=T, capacity=cap) for t in tables] for _ in range(2)]
    snapshots, grown = [], 0
    for n in range(70):
        op = rng.choices(["decode", "chunk", "release", "readmit", "snapshot", "restore", "other"],
                         [30, 4, 2, 2, 2, 2, 3])[0]
        if op in ("release", "readmit"):  # a request leaves and comes back as long or longer, new pages:
            r = 7 if op == "release" else rng.choice([r for r in batch if r >= 0])  # outside the batch, in it
            n_tok = int(tables[1].seq_lens[r]) + rng.randint(0, 9)
            for t in tables:
                t.release(i32([r]))
                t.extend(i32([r]), i32([max(n_tok, 1)]), max_tokens=max(n_tok, 1))
        elif op == "snapshot":
            snapshots.append([[x.clone() for x in state_tensors(t)] for t in tables])
        elif op == "restore" and snapshots:
            for t, saved in zip(tables, rng.choice(snapshots)):
                for x, y in zip(state_tensors(t), saved, strict=True):
                    x.copy_(y)
        elif op == "other":
            for o in others:
                o.step(i32([0, 1]), i32([1, 1]))
        if op not in ("decode", "chunk"):
            continue
        if max(int(x) for x in tables[1].seq_lens.tolist()) + 4 > mp * page_size:
            break
        ntok = [0 if r < 0 else (1 if op == "decode" else rng.choice([1, 2, 4])) for r in batch]
        out = outs[n % 2]
        cells = tables[0].state.version.tolist()
        memo = out[0].memo
        if op == "decode" and memo.growable_batch(*cells) is not None and int(memo.tensor[L.MEMO_VERSION]) != cells[0]:
            grown += 1  # one step behind, a step of one token a lane: the CSR grows in place
        res = []
        for t, o in zip(tables, out):
            with guard():
                res.append(t.step(i32(batch), i32(ntok), out=o))
        got, want = res
        names = ("slots", "ok", "indptr", "indices", "last_page_len", "positions", "qo_indptr", "kv_lens")
        for x, y, name in zip((got.slots, got.ok, *got.csr, *got.metadata),
                              (want.slots, want.ok, *want.csr, *want.metadata), names):
            assert x.tolist() == y.tolist(), (n, op, name)
        same_table_state(*tables)
        tables[0].check_invariants(exclusive=False)  # the other table holds pages of the pool too
    assert grown >= 15


def test_check_invariants_catches_a_kept_run_edited_by_hand(guard):
    """After a release the next step keeps the other runs: a row edited by hand without
    invalidate_csr() would be exported stale, and check_invariants says so."""
    table = twins(num_pages=40)[0]
    table.extend(i32([0, 1, 2]), i32([9, 3, 6]), max_tokens=18)
    with guard():
        table.step(i32([0, 1, 2]), i32([1, 1, 1]))
    table.release(i32([1]))
    table.check_invariants()
    table.block_table[2, 0], table.block_table[2, 1] = table.block_table[2, 1].item(), table.block_table[2, 0].item()
    with pytest.raises(tpool.InvariantViolation, match="stamp says they are unchanged"):
        table.check_invariants()
    table.invalidate_csr()
    table.check_invariants()
    assert table.step_keeps_csr(i32([0, 3, 2])) == 0


def test_a_snapshot_from_before_a_hand_edit_restored_after_invalidate_keeps_nothing(guard):
    """invalidate_csr() after a hand edit gives every row a fresh stamp: a snapshot from before the
    edit, restored later, carries stamps no memo noted, so the step copies its rows again."""
    table, ref = twins(num_pages=40)
    for t in (table, ref):
        t.extend(i32([0]), i32([5]), max_tokens=5)
    saved = [x.clone() for x in state_tensors(table)]
    bt = table.block_table
    bt[0, 0], bt[0, 1] = bt[0, 1].item(), bt[0, 0].item()   # a hand edit ...
    table.invalidate_csr()                                    # ... made known
    with guard():
        table.step(i32([0]), i32([1]))                        # notes the edited row's pages
    for x, y in zip(state_tensors(table), saved, strict=True):             # back to before the edit
        x.copy_(y)
    assert table.step_keeps_csr(i32([0])) == 0
    with guard():
        got = table.step(i32([0]), i32([1]))
    want = ref.step(i32([0]), i32([1]))
    assert got.csr.indices.tolist() == want.csr.indices.tolist()
    table.check_invariants()


def test_rows_stamped_zero_are_never_kept(guard):
    """A state made by another backend has every row's stamp 0, whatever the rows hold: a numba
    table that takes in two such states one after the other must not keep the first one's runs."""
    table = twins(num_pages=40)[0]
    refs = [tpool.PageTable(tpool.PagePool(40, PS, device="cpu", backend="reference"), R, MP) for _ in range(2)]
    refs[0].extend(i32([0]), i32([5]), max_tokens=5)
    refs[1].extend(i32([1, 0]), i32([4, 5]), max_tokens=9)    # request 0 holds other pages here
    for ref in refs:
        for x, y in zip(state_tensors(table), state_tensors(ref), strict=True):
            x.copy_(y)
        assert table.step_keeps_csr(i32([0])) == 0
        with guard():
            got = table.step(i32([0]), i32([1]))
        assert got.csr.indices.tolist()[:2] == ref.block_table[0, :2].tolist()


def test_invalidating_the_rows_edited_keeps_every_other_run(guard):
    """``invalidate_csr(rows)``: a row written by hand (a prefix-cache hit revived into an empty row)
    gets a fresh stamp and the table a fresh version; the next step copies that row and keeps the
    other runs, matches the reference, and a snapshot from before the edit restored later keeps
    nothing of it. Without naming the row, check_invariants says the kept run is stale."""
    table, ref = twins(num_pages=60)
    for t in (table, ref):
        t.extend(i32([0, 1, 2]), i32([9, 3, 6]), max_tokens=18)
        t.step(i32([0, 1, 2]), i32([1, 1, 1]))
    saved = [x.clone() for x in state_tensors(table)]
    for t in (table, ref):                         # request 1's row rewritten by hand: request 0's whole pages
        t.block_table[1, :2] = t.block_table[0, :2]
        t.seq_lens[1] = 8
        t.pool.incref(t.block_table[0, :2].clone())
    assert table.step_grows_csr(i32([0, 1, 2]))   # the memo cannot see the edit ...
    with pytest.raises(tpool.InvariantViolation):
        table.check_invariants(exclusive=False)
    table.invalidate_csr(i32([1, -1]))            # ... until the row is named
    table.check_invariants(exclusive=False)
    assert not table.step_grows_csr(i32([0, 1, 2])) and table.step_keeps_csr(i32([0, 1, 2])) == 2
    for _ in range(3):
        with guard():
            got = table.step(i32([0, 1, 2]), i32([1, 1, 1]))
        want = ref.step(i32([0, 1, 2]), i32([1, 1, 1]))
        for x, y in zip((got.slots, *got.csr), (want.slots, *want.csr)):
            assert x.tolist() == y.tolist()
    same_table_state(table, ref)
    for x, y in zip(state_tensors(table), saved, strict=True):  # back to before the edit
        x.copy_(y)
    with guard():
        got = table.step(i32([0, 1, 2]), i32([1, 1, 1]))
    assert got.csr.indices[:got.csr.indptr[3]].tolist() == [
        p for r in range(3) for p in table.block_table[r, :(int(table.seq_lens[r]) + PS - 1) // PS].tolist()]
    table.check_invariants()
    with pytest.raises(ValueError, match="req_ids"):
        table.invalidate_csr(torch.tensor([1]))


def test_a_snapshot_between_a_hand_edit_and_naming_its_rows_is_safe_to_restore(guard):
    """A snapshot taken after a hand edit but before ``invalidate_csr(rows)`` holds the edited pages
    under the old stamps and version; restored later, no memo (here a StepOut's, untouched since
    before the edit) may grow or keep the old runs of the rows named."""
    table, ref = twins(num_pages=48)
    outs = {}
    for t in (table, ref):
        a, b = t.step_out(4, max_tokens=32), t.step_out(4, max_tokens=32)
        t.step(i32([0, 1, 2, 3]), i32([6, 6, 6, 6]), out=a)
        t.step(i32([0, 1, 2, 3]), i32([1, 1, 1, 1]), out=b)
        x, y = int(t.block_table[0, 1]), int(t.block_table[2, 1])
        t.block_table[0, 1], t.block_table[2, 1] = y, x            # a hand edit: two pages swapped
        snap = [s.clone() for s in state_tensors(t)]                # taken before the rows are named
        t.invalidate_csr(i32([0, 2]))
        t.step(i32([0, 1, 2, 3]), i32([1, 1, 1, 1]), out=a)
        for s, v in zip(state_tensors(t), snap, strict=True):
            s.copy_(v)
        with guard():
            res = t.step(i32([0, 1, 2, 3]), i32([1, 1, 1, 1]), out=b)  # b's memo is from before the edit
        outs[t.pool.backend] = [v.tolist() for v in (res.slots, *res.csr)]
    assert outs["numba"] == outs["reference"]
    table.check_invariants()


def one_step_behind(t, first, max_tokens):
    """Two StepOuts of the batch 0-3 on ``t``: a step of ``first`` tokens a lane into one, then a decode
    step into the other. Returns them; the first now holds a CSR one step behind the table."""
    a, b = t.step_out(4, max_tokens=max_tokens), t.step_out(4, max_tokens=max_tokens)
    t.step(i32([0, 1, 2, 3]), i32(first), out=a)
    t.step(i32([0, 1, 2, 3]), i32([1, 1, 1, 1]), out=b)
    return a, b


def test_a_snapshot_between_a_hand_edit_and_naming_its_rows_is_safe_to_restore_one_step_behind(guard):
    """As above, with the memo one step behind the snapshot's version (a StepOut written just before
    the step that made that version): a CSR the next step would grow in place, unless naming the
    rows forgot it."""
    table, ref = twins(num_pages=48)
    outs = {}
    ids, ones = i32([0, 1, 2, 3]), i32([1, 1, 1, 1])
    for t in (table, ref):
        a, _ = one_step_behind(t, [6, 6, 6, 6], 32)
        x, y = int(t.block_table[0, 1]), int(t.block_table[2, 1])
        t.block_table[0, 1], t.block_table[2, 1] = y, x            # a hand edit: two pages swapped
        snap = [s.clone() for s in state_tensors(t)]                # taken before the rows are named
        t.invalidate_csr(i32([0, 2]))
        t.step(ids, ones)                                           # the table's buffers: a, b untouched
        for s, v in zip(state_tensors(t), snap, strict=True):
            s.copy_(v)
        with guard():
            res = t.step(ids, ones, out=a)  # a's memo names the version the snapshot's step came from
        outs[t.pool.backend] = [v.tolist() for v in (res.slots, *res.csr)]
    assert outs["numba"] == outs["reference"]
    table.check_invariants()


def test_a_row_shortened_by_hand_under_a_memo_one_step_behind_is_not_grown(guard):
    """A memo one step behind trusts that the rows only grew since (a step only appends). A row
    shortened by hand, without ``invalidate_csr``, breaks that: the short path must decline rather
    than move runs by lengths the rows no longer have (positions past the CSR it sized), and the
    full step then builds the CSR from the rows, as the reference does."""
    table, ref = twins(num_pages=48)
    outs = {}
    ids, ones = i32([0, 1, 2, 3]), i32([1, 1, 1, 1])
    for t in (table, ref):
        a, _ = one_step_behind(t, [12, 9, 14, 6], 48)
        t.seq_lens[0] = 2                           # row 0 cut from 13 tokens to 2 by hand: pages 1.. dropped
        t.block_table[0, 1:] = -1
        with guard():
            res = t.step(ids, ones, out=a)
        outs[t.pool.backend] = [v.tolist() for v in (res.slots, *res.csr, *res.metadata)]
    assert outs["numba"] == outs["reference"]
    assert outs["numba"][1] == [0, 1, 4, 8, 10]  # indptr: row 0 has one page, not four


def test_naming_rows_leaves_a_memo_without_a_csr_without_one(guard):
    """``invalidate_csr(rows)`` after a call that is not a step (the table's second version cell is
    then -1) must not turn a memo that holds no reusable CSR (-1, here after a step with a repeated
    id) into one whose runs a step keeps: its tails are stale (found by helper-16's fuzzer)."""
    outs = {}
    for be in ("numba", "reference"):
        t = tpool.PageTable(tpool.PagePool(64, 4, device="cpu", backend=be), 8, 8)
        t.extend(i32([0, 1, 2]), i32([9, 5, 6]), max_tokens=20)
        out = t.step_out(3, max_tokens=3)
        t.step(i32([0, 1, 2]), i32([1, 1, 1]), out=out)
        t.step(i32([0, 0, 1]), i32([1, 1, 1]), out=out)  # a repeated id: the memo holds no CSR to reuse
        t.release(i32([5]))                               # not a step
        t.invalidate_csr(i32([5]))
        with guard():
            r = t.step(i32([1, 2, -1]), i32([1, 1, 0]), out=out)
        outs[be] = [v.tolist() for v in (r.slots, *r.csr)]
        t.check_invariants()
    assert outs["numba"] == outs["reference"]


def test_step_keeps_csr_looks_exactly_keep_lookahead_lanes_ahead():
    """A row moved KEEP_LOOKAHEAD - 1 lanes is still found (its run kept), one moved KEEP_LOOKAHEAD is not:
    the host-side answer agrees with the kernel's plan_kept_runs."""
    n = L.KEEP_LOOKAHEAD + 2
    pool = tpool.PagePool(64, 16, device="cpu", backend="numba")
    table = tpool.PageTable(pool, max_requests=16, max_pages_per_request=4)
    ids = i32(list(range(n)))
    table.extend(ids, torch.ones(n, dtype=torch.int32))
    table.step(ids, torch.ones(n, dtype=torch.int32))
    pad = [-1] * (n - 1)
    assert table.step_keeps_csr(i32([L.KEEP_LOOKAHEAD - 1] + pad)) == 1
    assert table.step_keeps_csr(i32([L.KEEP_LOOKAHEAD] + pad)) == 0


def test_the_backends_csr_export_into_new_buffers_pads_indices_whole(backend):
    """``ops.flashinfer_csr`` into buffers it has not seen writes -1 past the CSR's end, over whatever
    they held (numba keeps a memo per buffer: a fresh memo must count the whole buffer as written)."""
    pool = tpool.PagePool(8, 4, device="cpu", backend=backend)
    table = tpool.PageTable(pool, max_requests=2, max_pages_per_request=4)
    table.extend(i32([0]), i32([5]), max_tokens=5)
    indptr, last = torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    indices = torch.full((6,), 7, dtype=torch.int32)
    table.ops.flashinfer_csr(i32([0]), indptr, indices, last)
    assert indptr.tolist() == [0, 2] and last.tolist() == [1] and indices.tolist() == [0, 1, -1, -1, -1, -1]


def test_step_keeps_csr_is_zero_when_the_step_would_grow_the_csr():
    """After a step, the buffers hold this batch's CSR at the table's version: the next step grows it in
    place (``step_grows_csr``), so ``step_keeps_csr`` says 0, not every lane; another batch keeps runs."""
    pool = tpool.PagePool(64, 16, device="cpu", backend="numba")
    table = tpool.PageTable(pool, max_requests=8, max_pages_per_request=4)
    ids, ones = i32([0, 1, 2]), torch.ones(3, dtype=torch.int32)
    table.extend(ids, ones)
    table.step(ids, ones)
    assert table.step_grows_csr(ids) and table.step_keeps_csr(ids) == 0
    assert not table.step_grows_csr(i32([0, 2, -1])) and table.step_keeps_csr(i32([0, 2, -1])) == 2


@pytest.mark.parametrize("cache", [False, True])
def test_a_request_released_and_stepped_again_in_its_lane_keeps_no_run(cache, guard):
    """A request released (its row now empty) and stepped again in the same lane of the same batch, with 0
    tokens and then one: the step's memo must not keep the run the released row had. (A numba release that
    did not stamp its rows let the next step keep it; helper-207's mutation run found test_fuzz.py's seeds
    missing that.)"""
    tables = twins(num_pages=40)
    batch = [0, 1, 2]
    for t in tables:
        t.extend(i32(batch), i32([5, 9, 2]), max_tokens=16)
    for _ in range(3):
        step_both(tables, batch, [1, 1, 1], B * MP, guard)
    for t in tables:
        t.release(i32([1]), cache=cache)
    step_both(tables, batch, [1, 0, 1], B * MP, guard)
    step_both(tables, batch, [1, 1, 1], B * MP, guard)
    tables[0].pool.check()
