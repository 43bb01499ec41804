"""PageTable.revive on every CPU backend: the old torch-op sequence as the oracle, input checks, refusals."""

import random
import re

import pytest
import torch

import tpool
from conftest import CPU_BACKENDS, i32
from tpool.kernels import layout as L
from tpool.kernels.layout import INT32_MAX

SCRATCH = {"keys", "lane_end", "version", "row_version"}  # versions come from one process-wide counter


def old_revive(table, row, pages, n_tokens):
    """What ``HostMirror.revive`` did before ``PageTable.revive``: a dozen torch ops (the oracle), and
    the counts it did not make: a -1, and a page an earlier entry names (where it would be taken), one
    ``invalid_page`` each (a prefix has no padding and names each page once)."""
    pool, k = table.pool, n_tokens // table.page_size
    state = pool.state.page_state.index_select(0, pages.clamp(0, pool.num_pages - 1))
    taken = (pages >= 0) & (pages < pool.num_pages) & ((state == L.USED) | (state == L.CACHED))
    ids = pages.sort().values
    whole = taken.all() & (ids[1:] != ids[:-1]).all()
    pool.incref(torch.where(whole, pages, torch.where(taken, L.NULL_PAGE, pages)))
    again = (pages[:, None] == pages[None, :]).tril(-1).any(1)  # an earlier entry names the same page
    pool.state.counters[L.ERR_INVALID_PAGE] += ((pages == L.NULL_PAGE) | (taken & again)).sum()
    table.block_table[row, :k] = torch.where(whole, pages, L.NULL_PAGE)
    table.seq_lens[row:row + 1] = whole.to(torch.int32) * n_tokens
    table.invalidate_csr(i32([row]))


def state(table) -> dict:
    out = {}
    for prefix, st in (("pool.", table.pool.state), ("table.", table.state)):
        out.update({prefix + name: t.clone() for name, t in st.tensors().items() if name not in SCRATCH})
    return out


def assert_same(a: dict, b: dict):
    for name in a:
        assert torch.equal(a[name], b[name]), (name, a[name].tolist(), b[name].tolist())


def build(backend, seed):
    """A pool and table in a random state: rows held, a fork (pages USED by two rows), rows released
    into the cache, evictions (FREE again), hand edits. Rows 4 and 5 are empty (the revives' targets), and
    so is row 1. Returns ``(table, pages seen in rows, config)``; the same seed gives the same state."""
    rng = random.Random(seed)
    P, ps, R, MP = rng.choice([6, 9, 16]), rng.choice([1, 2, 4]), 6, 4
    pool = tpool.PagePool(P, ps, device="cpu", backend=backend)
    table = tpool.PageTable(pool, R, MP)
    lens = [rng.randint(0, MP * ps) for _ in range(3)]
    table.extend(i32([0, 1, 2]), i32(lens), max_tokens=3 * MP * ps)
    seen = sorted({p for p in table.block_table.view(-1).tolist() if p >= 0})
    table.fork(i32([0]), i32([3]), i32([(table.seq_lens[0].item() // ps) * ps]))
    table.release(i32([1, 2] if rng.random() < 0.3 else [1]), cache=True)
    pool.evict(rng.randint(0, 2))
    for _ in range(rng.randint(0, 3)):  # hand edits: a state tpool never makes
        p = rng.randrange(P)
        what = rng.choice(["refcount", "refcount_max", "page_state", "wild_entry"])
        if what == "refcount":
            pool.state.refcount[p] = rng.choice([-3, -1, 0, 7])
        elif what == "refcount_max":
            pool.state.refcount[p] = INT32_MAX
        elif what == "page_state":
            pool.state.page_state[p] = rng.choice([5, -1, L.FREE, L.USED, L.CACHED])
        else:  # a page id past the pool in a row (not the target)
            table.block_table[rng.choice([0, 2, 3]), rng.randrange(MP)] = P + 7
        table.invalidate_csr()
    return table, seen, (P, ps, MP)


def random_pages(rng, seen, P, MP):
    k = rng.randint(0, MP)
    if seen and rng.random() < 0.4:  # a clean hit, as a prefix cache would ask
        return rng.sample(seen, min(k, len(seen)))
    out = []
    for _ in range(k):
        c = rng.random()
        if out and c < 0.1:
            out.append(rng.choice(out))  # a page named twice
        elif c < 0.2:
            out.append(rng.choice([-1, P, P + 3, -5, INT32_MAX]))
        else:
            out.append(rng.choice(seen) if seen and c < 0.7 else rng.randrange(P))
    return out


@pytest.mark.parametrize("seed", range(60))
def test_revive_matches_the_old_torch_sequence(backend, guard, seed):
    old, seen, (P, ps, MP) = build(backend, seed)
    new, _, _ = build(backend, seed)
    assert_same(state(old), state(new))
    rng = random.Random(1000 + seed)
    for _ in range(3):  # a few revives in a row, each into an empty row
        pages = random_pages(rng, seen, P, MP)
        empty = [r for r in range(old.max_requests) if old.seq_lens[r].item() == 0]
        if not empty:
            break
        row = rng.choice(empty)
        before = new.state.row_version[row].item()
        old_revive(old, row, i32(pages), len(pages) * ps)
        t = i32(pages)
        with guard():
            new.revive(row, t, len(pages) * ps)
        assert_same(state(old), state(new))
        assert new.pool.state.occur.eq(0).all() and new.pool.state.claim.eq(INT32_MAX).all()  # scratch restored
        assert new.state.claim.eq(INT32_MAX).all()
        if backend == "numba":  # a fresh stamp for the row, as invalidate_csr(row) gives
            assert new.state.row_version[row].item() > before
        assert t.tolist() == pages  # read, never written


def test_revive_a_cached_prefix(backend, guard):
    pool = tpool.PagePool(8, 2, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 3, 4)
    table.extend(i32([0]), i32([5]), max_tokens=5)              # pages 0, 1, 2
    table.release(i32([0]), cache=True)
    with guard():
        table.revive(1, i32([0, 1]), 4)                          # the first two pages: a hit
        table.revive(2, i32([0, 1]), 4)                          # shared with another revive
    assert table.block_table.tolist() == [[-1] * 4, [0, 1, -1, -1], [0, 1, -1, -1]]
    assert table.seq_lens.tolist() == [0, 4, 4]
    assert pool.state.refcount[:3].tolist() == [2, 2, 0]
    assert pool.state.page_state[:3].tolist() == [L.USED, L.USED, L.CACHED]
    s = pool.stats()
    assert s["pages.revived"] == 2 and s["pages.cached.current"] == 1 and s["clock"] == 4
    pool.check()
    table.check_invariants(exclusive=False)
    with guard():
        r = table.extend(i32([1]), i32([1]))                     # the next token goes to a fresh page
    assert r.slots.tolist() == [3 * 2] and table.block_table[1].tolist() == [0, 1, 3, -1]
    table.release(i32([1, 2]), cache=True)
    assert pool.state.refcount[:4].tolist() == [0, 0, 0, 0]
    table.check_invariants(exclusive=False)


@pytest.mark.parametrize("pages, errors", [
    ([0, 0], {"invalid_page": 1}),        # named twice: the second entry (before: refused, nothing counted)
    ([0, -1], {"invalid_page": 1}),       # -1: a prefix has no padding (before: refused, nothing counted)
    ([-1, -1], {"invalid_page": 2}),
    ([1, 0, 1, 1], {"invalid_page": 2}),  # every entry after the first naming page 1
    ([0, 5], {"use_after_free": 1}),      # page 5 is FREE
    ([5, 5], {"use_after_free": 2}),      # a FREE page named twice: as incref counts it, once per entry
    ([0, 99], {"invalid_page": 1}),       # outside the pool
    ([99, 99], {"invalid_page": 2}),
    ([0, 99, -1, 0], {"invalid_page": 3}),
    ([-1, 5, 0, 0], {"invalid_page": 2, "use_after_free": 1}),
])
def test_a_refused_revive_leaves_the_row_empty(backend, guard, pages, errors):
    pool = tpool.PagePool(8, 2, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 3, 4)
    table.extend(i32([0]), i32([4]), max_tokens=4)
    table.release(i32([0]), cache=True)
    before = pool.state.refcount.clone(), pool.state.page_state.clone()
    with guard():
        table.revive(2, i32(pages), 2 * len(pages))
    assert table.block_table[2].tolist() == [-1] * 4 and table.seq_lens.tolist() == [0, 0, 0]
    assert torch.equal(pool.state.refcount, before[0]) and torch.equal(pool.state.page_state, before[1])
    counted = {k: v for k, v in pool.stats().items() if k.startswith("errors.") and v}
    assert counted == {f"errors.{kind}": n for kind, n in errors.items()}
    assert pool.stats()["pages.revived"] == 0
    table.check_invariants(exclusive=False)
    with pytest.raises(tpool.PoolError) as e:   # never silent: the next sync point raises
        pool.check()
    assert e.value.counts == errors


@pytest.mark.parametrize("pages", [[0, 1], [0, 0], [0, -1], [-1, 99], [6, 6]])  # (page 6 FREE)
def test_a_row_that_is_not_empty_is_a_bad_request(backend, guard, pages):
    """Only the bad_request: the pages are not looked at (a -1 or a repeat counts nothing more)."""
    pool = tpool.PagePool(8, 2, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 3, 4)
    table.extend(i32([0, 1]), i32([4, 3]), max_tokens=7)
    table.release(i32([0]), cache=True)
    before = state(table)
    with guard():
        table.revive(1, i32(pages), 4)
    after = state(table)
    grew = after.pop("pool.counters") - before.pop("pool.counters")
    # one bad_request and the clock's tick, nothing else (helper-204's mutation run: a revive counting the -1s
    # and repeats of a row that is not empty passed, its other counters unread)
    assert {i: n for i, n in enumerate(grew.tolist()) if n} == {L.CLOCK: 1, L.ERR_BAD_REQUEST: 1}
    assert_same(before, after)
    table.check_invariants(exclusive=False)


KINDS = {L.ERR_INVALID_PAGE: "invalid_page", L.ERR_USE_AFTER_FREE: "use_after_free",
         L.ERR_CORRUPT_STATE: "corrupt_state", L.ERR_BAD_REQUEST: "bad_request"}


def counts_by_entry(pages, gens, page_state, page_gen, P, empty):
    """The errors a revive counts, entry by entry in plain Python (the spec): ``{kind: count}``; none
    means every page is taken. A row that is not empty is one bad_request, its pages not looked at."""
    if not empty:
        return {"bad_request": 1}
    out, seen = {}, set()
    for i, p in enumerate(pages):
        kind = None
        if not 0 <= p < P:
            kind = "invalid_page"              # outside the pool, or -1: a prefix has no padding
        else:
            again, s = p in seen, page_state[p]
            seen.add(p)
            if s in (L.USED, L.CACHED):
                if gens is not None and gens[i] != page_gen[p]:
                    kind = "use_after_free"    # freed since its generation was recorded
                elif again:
                    kind = "invalid_page"      # an earlier entry names it: it would be taken twice
            else:
                kind = "use_after_free" if s == L.FREE else "corrupt_state"
        if kind:
            out[kind] = out.get(kind, 0) + 1
    return out


@pytest.mark.parametrize("seed", range(30))
def test_every_backend_counts_each_mix_alike(guard, seed):
    """Random mixes (valid, -1, repeats, stale generations, FREE, outside the pool, corrupt states, a row
    that is not empty) revived on every backend in lockstep (Triton, interpreted, on a few seeds): the
    same state and counts everywhere, the counts those of ``counts_by_entry``, and a refused revive
    always counts (before, a -1 or a repeat was refused without a count)."""
    backends = ["reference", "numba"] + (["triton"] if "triton" in CPU_BACKENDS and seed < 3 else [])
    built = [build(b, seed) for b in backends]
    tables, (_, seen, (P, ps, MP)) = [t for t, _, _ in built], built[0]
    rng = random.Random(2000 + seed)
    for _ in range(4):
        ref = tables[0]
        lens = ref.seq_lens.tolist()
        empty = [r for r in range(ref.max_requests) if lens[r] == 0]
        row = rng.choice(empty) if empty and rng.random() < 0.85 else rng.randrange(ref.max_requests)
        pages = random_pages(rng, seen, P, MP)
        if pages and rng.random() < 0.3:
            pages[rng.randrange(len(pages))] = rng.choice([-1, pages[0]])
        page_state, page_gen = ref.pool.state.page_state.tolist(), ref.pool.state.page_gen.tolist()
        gens = None
        if rng.random() < 0.6:  # recorded generations, some stale
            gens = [page_gen[p] if 0 <= p < P else 0 for p in pages]
            gens = [g + 1 if rng.random() < 0.15 else g for g in gens]
        want = counts_by_entry(pages, gens, page_state, page_gen, P, lens[row] == 0)
        before = ref.pool.state.counters.clone()
        for table in tables:
            with guard():
                table.revive(row, i32(pages), len(pages) * ps, generations=None if gens is None else i32(gens))
        got = ref.pool.state.counters - before
        assert {name: int(got[k]) for k, name in KINDS.items() if got[k]} == want, (pages, gens, row)
        taken = lens[row] == 0 and not want
        assert ref.seq_lens[row].item() == (len(pages) * ps if taken else lens[row])
        for other in tables[1:]:
            assert_same(state(ref), state(other))



@pytest.mark.parametrize("row", [-1, 3, 2**31 - 1])
def test_a_bad_row_reaching_the_backend_is_counted_and_touches_nothing(backend, row):
    pool = tpool.PagePool(8, 2, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 3, 4)
    table.extend(i32([0]), i32([4]), max_tokens=4)
    table.release(i32([0]), cache=True)
    before = state(table)
    table.ops.revive(row, i32([0, 1]), table._shapes.memo_list())  # past the façade's checks
    after = state(table)
    c = after.pop("pool.counters")
    assert c[L.ERR_BAD_REQUEST] == 1 and c[L.CLOCK] == before.pop("pool.counters")[L.CLOCK] + 1
    assert_same(before, after)


def test_more_pages_than_a_row_reaching_the_backend_is_a_table_overflow(backend):
    pool = tpool.PagePool(8, 2, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 3, 2)
    before = state(table)
    table.ops.revive(1, i32([0, 1, 2]), ())
    after = state(table)
    assert after.pop("pool.counters")[L.ERR_TABLE_OVERFLOW] == 1
    before.pop("pool.counters")
    assert_same(before, after)


def test_input_checks(backend):
    pool = tpool.PagePool(8, 2, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 3, 4)
    before = state(table)
    cases = [
        ((3, i32([0]), 2), "req_id: expected a row in [0, 3), got 3"),
        ((-1, i32([0]), 2), "req_id: expected a non-negative int, got -1"),
        ((True, i32([0]), 2), "req_id: expected a non-negative int, got True"),
        ((1.0, i32([0]), 2), "req_id: expected a non-negative int, got 1.0"),
        ((1, i32([0]), 3), "n_tokens: expected a multiple of page_size 2 up to max_pages_per_request * "
                           "page_size = 8 (whole pages only), got 3"),
        ((1, i32([0] * 5), 10), "got 10"),
        ((1, i32([0]), 2.0), "n_tokens: expected a non-negative int, got 2.0"),
        ((1, i32([0, 1]), 2), "pages: expected 1 entry (n_tokens / page_size), got 2"),
        ((1, torch.tensor([0], dtype=torch.int64), 2), "pages: expected dtype torch.int32, got torch.int64"),
        ((1, i32([[0]]), 2), "pages: expected a 1-D tensor, got shape (1, 1)"),
        ((1, i32([0, 9, 1, 9])[::2], 4), "pages: expected a contiguous tensor"),
        ((1, [0], 2), "pages: expected a torch.Tensor, got list"),
        ((1, table.block_table[2, :1], 2), "pages: shares memory with a buffer this call writes"),
        ((1, pool.state.refcount[:1], 2), "pages: shares memory with a buffer this call writes"),
        ((1, torch.from_numpy(table.block_table.numpy()[2, 1:2]), 2),  # another storage, inside the table's
         "pages: shares memory with a buffer this call writes"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError) as e:
            table.revive(*args)
        assert message in str(e.value), (args, str(e.value))
    assert_same(before, state(table))  # nothing ran


IN_PLACE = [  # a change made to a checked tensor in place (same object), and the error its new form gets
    (lambda t, table: setattr(t, "data", t.view(torch.float32)), "expected dtype torch.int32, got torch.float32"),
    (lambda t, table: t.unsqueeze_(0), "expected a 1-D tensor, got shape (1, 2)"),
    (lambda t, table: t.as_strided_((2,), (2,)), "expected a contiguous tensor, got stride (2,)"),
    (lambda t, table: setattr(t, "data", t._neg_view()), "got a negative view"),
    (lambda t, table: t.untyped_storage().resize_(4), "expected a storage holding its 2 entries"),
    (lambda t, table: t.set_(table.block_table.untyped_storage(), 8, (2,), (1,)), "shares memory"),
]


@pytest.mark.parametrize("change, message", IN_PLACE)
@pytest.mark.parametrize("name", ["pages", "generations"])
def test_a_tensor_changed_in_place_is_checked_again(backend, name, change, message):
    """No check of a revive's vectors is remembered across calls: a tensor that passed them, changed
    in place before the next call (same object, address and length where the change keeps them), is
    refused with the error its new form gets, before anything runs."""
    pool = tpool.PagePool(8, 2, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 3, 4)
    table.extend(i32([0]), i32([4]), max_tokens=4)
    table.release(i32([0]), cache=True)                                   # pages 0, 1 CACHED
    vectors = {"pages": i32([0, 1, 7, 7])[:2], "generations": i32(pool.generations(i32([0, 1])).tolist() + [7, 7])[:2]}
    table.revive(1, vectors["pages"], 4, generations=vectors["generations"])  # valid: a hit
    assert table.seq_lens.tolist() == [0, 4, 0]
    table.release(i32([1]), cache=True)
    table.revive(1, vectors["pages"], 4, generations=vectors["generations"])  # the same tensors again
    table.release(i32([1]), cache=True)
    before = state(table)
    change(vectors[name], table)
    with pytest.raises(ValueError, match=f"^{name}: .*{re.escape(message)}"):
        table.revive(1, vectors["pages"], 4, generations=vectors["generations"])
    assert_same(before, state(table))  # nothing ran


def test_valid_revives_keep_the_invariants(backend, guard):
    rng = random.Random(5)
    pool = tpool.PagePool(24, 2, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 6, 4)
    table.extend(i32([0, 1]), i32([8, 6]), max_tokens=14)
    cache = table.block_table[0].clone()
    table.release(i32([0]), cache=True)
    for _ in range(12):
        empty = [r for r in range(6) if table.seq_lens[r].item() == 0]
        if not empty:
            table.release(i32([rng.randrange(6)]), cache=True)
            continue
        row, k = rng.choice(empty), rng.randint(0, 4)
        with guard():
            table.revive(row, cache[:k].clone(), 2 * k)
            table.extend(i32([row]), i32([rng.randint(0, 3) if k < 4 else 0]), max_tokens=3)  # (4 pages: full)
        assert table.block_table[row, :k].tolist() == cache[:k].tolist()
        table.check_invariants(exclusive=False)
        pool.check()
        if rng.random() < 0.5:
            with guard():
                table.release(i32([row]), cache=True)
            table.check_invariants(exclusive=False)


def test_a_step_after_a_revive_reads_the_revived_row(backend, guard):
    """The steps' CSR buffers forget the revived row (numba keeps runs of unchanged rows): the
    CSR after a revive is the reference's, and check_invariants holds."""
    tables = []
    for b in dict.fromkeys(["reference", backend]):
        pool = tpool.PagePool(16, 2, device="cpu", backend=b)
        table = tpool.PageTable(pool, 4, 4)
        ids = i32([0, 1, 2])
        with guard():
            table.step(ids, i32([4, 3, 5]), max_tokens=12)
            table.step(ids, i32([1, 1, 1]))
        cache = table.block_table[1, :2].clone()
        table.release(i32([1]), cache=True)
        with guard():
            table.step(i32([0, 2]), i32([1, 1]))
            table.revive(1, cache, 4)
            r = table.step(ids, i32([1, 1, 1]))
        tables.append((table, [t.clone() for t in (r.slots, *r.csr, *r.metadata)]))
        table.check_invariants(exclusive=False)
    (ref, want), (got_table, got) = tables[0], tables[-1]
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert_same(state(ref), state(got_table))


def test_the_mirror_revives_through_the_table(backend, guard):
    from tpool.scheduling import HostMirror
    pool = tpool.PagePool(32, 4, device="cpu", backend=backend)
    m = HostMirror(tpool.PageTable(pool, 4, 8), free=32, cached=0)
    (row,) = m.admit([16])
    pages = m.table.block_table[row, :4].clone()
    m.finish([row], cache=True)
    with guard():
        hit = m.revive(pages, 16)
    assert m.table.block_table[hit, :4].tolist() == pages.tolist() and m.table.seq_lens[hit].item() == 16
    assert m.reconcile(m.snapshot())["pages.revived"] == 4
    m.table.check_invariants(exclusive=False)


@pytest.mark.parametrize("seed", range(20))
def test_the_numba_memo_forget_is_csr_memo_forget(seed):
    """numba's revive forgets the row in every CSR memo in compiled code: the same writes as
    ``CsrMemo.forget`` (what ``invalidate_csr(row)`` runs), on random memos and table versions."""
    from tpool.kernels.revive import forget_row_numba
    from tpool.state import CsrMemo
    rng = random.Random(seed)
    pool = tpool.PagePool(8, 2, device="cpu", backend="numba")
    table = tpool.PageTable(pool, 4, 4)
    b, row = rng.randint(1, 5), rng.randrange(4)
    table.state.version[:] = torch.tensor([rng.choice([-1, 0, 3, 7]), rng.choice([-1, 3, 5])])
    memos = [CsrMemo(b, 8, torch.device("cpu")) for _ in range(2)]
    values = [rng.choice([-2, -1, 0, 1, 2, 3, 5, 7]) for _ in range(memos[0].tensor.numel())]
    for memo in memos:
        memo.tensor[:] = torch.tensor(values)
    memos[0].forget(i32([row]), table.state.version)
    forget_row_numba(memos[1].tensor.data_ptr(), b, row, table.ops.td)
    assert memos[0].tensor.tolist() == memos[1].tensor.tolist()
