"""Triton page-table kernels against the reference, bit for bit, at the backend level.

Every case drives two tables in lockstep, one on a ``reference`` pool and one
on a ``triton`` pool, through their table backends, and compares every output
and every state tensor (pool state and scratch, block table, lengths, claims)
with ``==``. Output buffers start filled with a sentinel, so a lane a kernel
forgets to write shows up as a mismatch. On a CPU the kernels run under
Triton's interpreter.
"""

import random

import pytest
import torch

from conftest import TRITON_DEVICE

if TRITON_DEVICE is None:
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

import tpool  # noqa: E402
from tpool.kernels import _triton_util  # noqa: E402
from tpool.kernels import flashinfer_csr as _csr  # noqa: E402
from tpool.kernels import layout as L  # noqa: E402
from tpool.kernels._triton_shim import tl, triton  # noqa: E402
from tpool.kernels._triton_table_util import list_lane  # noqa: E402
from tpool.testing import no_host_sync  # noqa: E402

DEVICE = TRITON_DEVICE
SENTINEL = 12345  # written into output buffers before a call; must never survive it


def i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _full(n):
    return torch.full((n,), SENTINEL, dtype=torch.int32, device=DEVICE)


class Twin:
    """A reference table and a Triton table driven in lockstep; every call is compared."""

    def __init__(self, num_pages, page_size, R, MP):
        self.MP = MP
        self.tables = [tpool.PageTable(tpool.PagePool(num_pages, page_size, device=DEVICE, backend=b), R, MP)
                       for b in ("reference", "triton")]
        assert [t.ops.name for t in self.tables] == ["reference", "triton"]

    @property
    def tri(self):
        return self.tables[1]

    def _state(self, table):
        ts = table.state
        return {**table.pool.state.tensors(), "block_table": ts.block_table, "seq_lens": ts.seq_lens,
                "table_claim": ts.claim}

    def _run(self, what, call, make_outs):
        """``call(impl, *outs)`` on both tables with fresh sentinel outputs; compare outputs and state."""
        results = []
        for table in self.tables:
            outs = make_outs()
            if table.ops.name == "triton":
                with no_host_sync():
                    call(table.ops, *outs)
            else:
                call(table.ops, *outs)
            results.append(outs)
        for k, (r, t) in enumerate(zip(*results)):
            assert torch.equal(r, t), f"{what}: output {k} differs\nreference {r.tolist()}\ntriton    {t.tolist()}"
        ref, tri = (self._state(t) for t in self.tables)
        for name, r in ref.items():
            assert torch.equal(r, tri[name]), \
                f"{what}: state {name} differs\nreference {r.tolist()}\ntriton    {tri[name].tolist()}"
        return [o.tolist() for o in results[0]]

    # the six table operations ------------------------------------------------
    def extend(self, ids, ntok, T=None):
        T = len(ids) if T is None else T
        return self._run(f"extend({ids}, {ntok}, T={T})",
                         lambda impl, slots, ok: impl.extend(i32(ids), i32(ntok), slots, ok),
                         lambda: (_full(T), torch.ones(len(ids), dtype=torch.bool, device=DEVICE)))

    def release(self, ids, cache=False):
        self._run(f"release({ids}, cache={cache})", lambda impl: impl.release(i32(ids), cache), tuple)

    def truncate(self, ids, lens):
        self._run(f"truncate({ids}, {lens})", lambda impl: impl.truncate(i32(ids), i32(lens)), tuple)

    def fork(self, src, dst, lens):
        return self._run(f"fork({src}, {dst}, {lens})",
                         lambda impl, *outs: impl.fork(i32(src), i32(dst), i32(lens), *outs),
                         lambda: (torch.ones(len(dst), dtype=torch.bool, device=DEVICE),
                                  _full(len(dst)), _full(len(dst))))

    def csr(self, ids, cap=None):
        cap = len(ids) * self.MP if cap is None else cap
        return self._run(f"csr({ids}, cap={cap})",
                         lambda impl, *outs: impl.flashinfer_csr(i32(ids), *outs),
                         lambda: (_full(len(ids) + 1), _full(cap), _full(len(ids))))

    def rows(self, ids):
        out = self._run(f"rows({ids})", lambda impl, out: impl.block_table_rows(i32(ids), out.view(len(ids), self.MP)),
                        lambda: (_full(len(ids) * self.MP),))
        return [out[0][k * self.MP:(k + 1) * self.MP] for k in range(len(ids))]

    # pool-level misuse, applied to both pools ----------------------------------
    def pool_free(self, pages, cache=False):
        for t in self.tables:
            t.pool.free(i32(pages), cache=cache)

    def counter(self, slot):
        return int(self.tri.pool.state.counters[slot])

    def lens(self):
        return self.tri.seq_lens.tolist()

    def row(self, r):
        return self.tri.block_table[r].tolist()


@pytest.fixture(params=["wide", "chunked"])
def chunking(request, monkeypatch):
    """``wide``: one chunk holds everything; ``chunked``: 32-lane chunks, so carries across
    chunks (token offsets, FCFS sums, stack top, flat page-list indices) are exercised."""
    if request.param == "chunked":
        monkeypatch.setattr(_triton_util, "MAX_BLOCK", 32)
    return request.param


# ------------------------------------------------------------------ extend
def test_prefill_then_decode_crossing_pages():
    tw = Twin(16, 2, 3, 4)
    slots, ok = tw.extend([0, 1], [3, 1], T=6)
    assert slots == [0, 1, 2, 4, -1, -1] and ok == [True, True]
    slots, ok = tw.extend([0, 1, -1], [1, 1, 1])      # 0 fills page 1, 1 fills page 2, padding
    assert slots == [3, 5, -1] and ok == [True, True, False]
    slots, ok = tw.extend([1, 0, 2], [1, 1, 1])       # 1 and 0 cross into new pages, 2 starts one
    assert slots == [6, 8, 10] and tw.row(0) == [0, 1, 4, -1] and tw.row(1) == [2, 3, -1, -1]
    assert tw.lens() == [5, 3, 1]


def test_prefill_spanning_many_pages_and_lanes():
    tw = Twin(32, 3, 4, 5)
    tw.extend([2], [4], T=4)
    slots, ok = tw.extend([0, 2, 1, 3], [7, 5, 0, 2], T=16)  # 2 continues inside its page 1
    assert ok == [True] * 4
    assert slots[:14] == [6, 7, 8, 9, 10, 11, 12, 4, 5, 15, 16, 17, 18, 19] and slots[14:] == [-1, -1]
    tw.extend([3, 0], [13, 0], T=13)                      # exactly fills 3's five pages


def test_fcfs_failure_and_zero_need_after_it():
    tw = Twin(4, 2, 4, 8)
    slots, ok = tw.extend([0, 1, 2, 3], [4, 6, 1, 0], T=11)
    # 1 needs 3 pages of the 2 left, so 2 (1 page) is refused too; 3 needs none and runs
    assert ok == [True, False, False, True] and slots == [0, 1, 2, 3] + [-1] * 7
    assert tw.counter(L.FAILED_REQUESTS) == 2 and tw.counter(L.FREE_COUNT) == 2
    slots, ok = tw.extend([2, 0], [4, 1], T=5)            # 2 takes the last two pages; 0 needs a third
    assert ok == [True, False] and slots == [4, 5, 6, 7, -1] and tw.counter(L.FREE_COUNT) == 0
    slots, ok = tw.extend([1, 0], [0, 1], T=1)            # nothing needed, nothing left
    assert ok == [True, False] and slots == [-1]


def test_extend_misuse():
    tw = Twin(16, 2, 3, 2)
    slots, ok = tw.extend([0, 0, 5, 1, -7, 2, -1], [1, 1, 1, 5, 2, -3, 2], T=13)
    # lane 1 repeats 0, lanes 2 and 4 are out of range, lane 3 needs 3 pages > 2, lane 5 is negative.
    assert ok == [True] + [False] * 6 and slots == [0] + [-1] * 12
    assert (tw.counter(L.ERR_BAD_REQUEST), tw.counter(L.ERR_TABLE_OVERFLOW), tw.counter(L.ERR_BAD_COUNT)) == (3, 1, 1)
    slots, ok = tw.extend([1, 2, 0], [3, 2, 1], T=4)      # 2 and 0 end past the slot buffer
    assert ok == [True, False, False] and slots == [2, 3, 4, -1]
    assert tw.counter(L.ERR_OUT_OVERFLOW) == 2
    tw.extend([0, 1], [1, 1], T=0)                       # no slot buffer at all
    tw.extend([0, 1], [0, 0], T=0)


def test_empty_batches_tick_the_clock_only():
    tw = Twin(8, 2, 2, 2)
    tw.extend([0], [3], T=3)
    tw.extend([], [], T=3)
    tw.release([])
    tw.truncate([], [])
    tw.fork([], [], [])
    tw.csr([], cap=2)
    tw.rows([])
    assert tw.counter(L.CLOCK) == 5                       # csr and rows do not tick


# ---------------------------------------------------------- release / truncate
def test_release_shared_pages_and_cache():
    tw = Twin(16, 4, 4, 4)
    tw.extend([0, 3], [10, 2], T=12)                    # 0: pages 0, 1, 2; 3: page 3
    ok, _, _ = tw.fork([0, 0], [1, 2], [8, 9])           # 1 shares 0, 1; 2 shares 0, 1 + a copy of 2
    assert ok == [True, True]
    tw.release([0, 1])                                   # pages 0, 1 keep one reference (request 2)
    assert tw.tri.pool.state.refcount[:5].tolist() == [1, 1, 0, 1, 1]
    tw.release([2, 3], cache=True)                       # last references: CACHED, stamped
    assert tw.counter(L.CACHED_COUNT) == 4 and tw.lens() == [0, 0, 0, 0]
    tw.extend([1], [4], T=4)


def test_release_into_the_cache_queues_shared_pages_at_their_last_occurrence(chunking):
    """Twelve rows sharing a six-page head released into the cache in one call: 96 list entries, so a
    shared page's occurrences span 32-lane chunks; each page is queued at its last occurrence, so the
    rows' tails (row order, each last page first) are evicted before the head they share."""
    tw = Twin(64, 2, 12, 8)
    tw.extend([0], [12], T=12)                                 # pages 0..5
    tw.fork([0] * 11, list(range(1, 12)), [12] * 11)           # rows 1..11 share all six
    tw.extend(list(range(12)), [4] * 12, T=48)                 # row r's tail: pages 6 + 2r, 7 + 2r
    tw.release(list(range(12)), cache=True)
    assert tw.counter(L.CACHED_COUNT) == 30 and tw.counter(L.ERR_DOUBLE_FREE) == 0
    outs = [t.pool.evict(30).tolist() for t in tw.tables]
    want = [p for r in range(12) for p in (7 + 2 * r, 6 + 2 * r)] + [5, 4, 3, 2, 1, 0]
    assert outs[0] == outs[1] == want


def test_release_pushes_in_lane_then_column_order():
    tw = Twin(12, 1, 3, 4)
    tw.extend([0, 1, 2], [3, 2, 4], T=9)
    tw.release([2, -1, 0, 2, 9, 1])                      # dup and out of range are bad requests
    assert tw.tri.pool.state.free_stack.tolist()[3:] == [5, 6, 7, 8, 0, 1, 2, 3, 4]
    assert tw.counter(L.ERR_BAD_REQUEST) == 2


def test_truncate_and_bad_lengths():
    tw = Twin(16, 2, 3, 4)
    tw.extend([0, 1, 2], [7, 3, 4], T=14)
    tw.truncate([0, 1, 2, -1], [3, 4, -1, 0])             # 1: longer; 2: negative; padding
    assert tw.lens() == [3, 3, 4] and tw.counter(L.ERR_BAD_LENGTH) == 2
    assert tw.row(0) == [0, 1, -1, -1]
    tw.truncate([1, 2, 1], [3, 0, 0])                      # same length; to 0; repeated id
    assert tw.lens() == [3, 3, 0]
    slots, _ = tw.extend([0], [1])
    assert slots == [3]


def test_release_and_truncate_of_freed_pages():
    """Misuse: a table page freed behind the table's back; releasing it counts double frees."""
    tw = Twin(8, 2, 2, 4)
    tw.extend([0, 1], [6, 2], T=8)
    tw.pool_free([1, 3])
    tw.truncate([0], [1])                                 # drops pages 1 (already free) and 2
    tw.release([1, 0])
    assert tw.counter(L.ERR_DOUBLE_FREE) == 2


# -------------------------------------------------------------------- fork
def test_fork_partial_page_and_exhaustion():
    tw = Twin(6, 4, 5, 3)
    tw.extend([0], [10], T=10)                            # pages 0, 1, 2
    ok, cow_src, cow_dst = tw.fork([0, 0, 0, 0], [1, 2, 3, 4], [6, 8, 3, 5])
    # 1: share page 0, copy 1 -> 3; 2: share 0, 1; 3: copy 0 -> 4; 4: copy 1 -> 5.
    assert ok == [True] * 4 and cow_src == [1, -1, 0, 1] and cow_dst == [3, -1, 4, 5]
    assert tw.tri.pool.state.refcount.tolist() == [4, 2, 1, 1, 1, 1]
    tw.release([2, 3, 4])
    ok, _, cow_dst = tw.fork([0, 0, 1], [2, 3, 4], [2, 1, 4])  # pages 4, 5 came back (5 on top)
    assert ok == [True, True, True] and cow_dst == [5, 4, -1]
    tw.release([3, 4])
    ok, _, _ = tw.fork([0, 0, 0], [3, 4, 3], [5, 5, 0])      # one free page; lane 2 repeats dst 3
    assert ok == [True, False, False]


def test_fork_misuse():
    tw = Twin(16, 2, 5, 4)
    tw.extend([0, 1], [5, 2], T=7)
    ok, cow_src, cow_dst = tw.fork([0, 0, 7, 2, 0, 0, 0, 3], [1, 2, 3, 2, 4, -1, 3, 3], [2, 6, 1, 0, -1, 1, 0, 0])
    # 1 not empty; 2: lens > len(0); 3: src out of range; then dst 2 == src 2; 4: negative;
    # padding; 3 (first valid naming of 3 was lane 2) repeated; src == dst.
    assert ok == [False] * 8 and cow_src == [-1] * 8 and cow_dst == [-1] * 8
    assert (tw.counter(L.ERR_BAD_REQUEST), tw.counter(L.ERR_BAD_LENGTH)) == (5, 2)
    ok, _, _ = tw.fork([0, 2], [2, 3], [0, 0])               # empty forks are fine, even from an empty src
    assert ok == [True, True]


def test_fork_of_freed_and_cached_pages():
    """Misuse: src pages freed or cached behind the table's back fail the fork (issue 11, finding 4):
    one use_after_free per such page the lane reads (its shared range and the partial page it would
    copy), nothing shared, nothing copied, nothing revived."""
    tw = Twin(8, 2, 4, 4)
    tw.extend([0], [6], T=6)
    tw.pool_free([0])
    tw.pool_free([1], cache=True)
    ok, cow_src, _ = tw.fork([0, 0, 0], [1, 2, 3], [6, 4, 1])
    assert ok == [False, False, False] and cow_src == [-1, -1, -1]  # the third would copy freed page 0
    assert tw.counter(L.ERR_USE_AFTER_FREE) == 5 and tw.counter(L.REVIVED) == 0  # 2 + 2 + 1
    ok, _, _ = tw.fork([0], [3], [0])                      # an empty fork reads no page: fine
    assert ok == [True]


# ------------------------------------------------------------ csr and rows
def test_csr_padding_empty_bad_and_overflow():
    tw = Twin(32, 4, 5, 4)
    tw.extend([0, 1, 2], [5, 4, 9], T=18)
    indptr, indices, last = tw.csr([2, -1, 0, 3, 1, 8])
    assert indptr == [0, 3, 3, 5, 5, 6, 6] and last == [1, 4, 1, 4, 4, 4]
    assert indices[:6] == [3, 4, 5, 0, 1, 2] and indices[6:] == [-1] * 18
    assert tw.counter(L.ERR_BAD_REQUEST) == 1
    tw.csr([0, 2, 0], cap=4)                              # too small: out_overflow, truncated
    assert tw.counter(L.ERR_OUT_OVERFLOW) == 1
    tw.csr([3, -1], cap=0)


def test_rows():
    tw = Twin(16, 2, 3, 3)
    tw.extend([0, 2], [3, 6], T=9)
    rows = tw.rows([2, -1, 0, 5, 1])
    assert rows == [[2, 3, 4], [-1] * 3, [0, 1, -1], [-1] * 3, [-1] * 3]


# ------------------------------------------------------- chunks and launches
def test_large_batches_span_chunks(chunking):
    rng = random.Random(11)
    tw = Twin(48, 2, 6, 5)
    ids = [rng.choice([-1, -1, 0, 1, 2, 3, 4, 5, 7]) for _ in range(45)]
    ntok = [rng.randrange(-1, 4) for _ in ids]
    tw.extend(ids, ntok, T=sum(max(n, 0) for n in ntok) + 3)
    tw.extend([-1] * 40 + [0, 1, 2, 3, 4, 5], [1] * 46)    # decode lanes in the second chunk
    tw.fork([0] * 40, [-1] * 35 + [5, 4, 3, 2, 1], [rng.randrange(0, 5) for _ in range(40)])
    tw.csr([rng.randrange(-1, 6) for _ in range(40)])
    tw.rows([rng.randrange(-1, 7) for _ in range(12)])
    tw.truncate([-1] * 34 + [0, 1, 2, 3], [0] * 34 + [1, 0, 2, 9])
    tw.release([-1] * 33 + [5, 4, 3, 2, 1, 0], cache=True)


def test_csr_of_one_long_request_among_short_ones(chunking):
    """Each output position finds its lane by a search over indptr: a wide lane, empty and
    padding lanes, and lanes in different chunks must all land where the reference puts them."""
    tw = Twin(256, 2, 40, 64)
    tw.extend(list(range(40)), [1 + (r % 3) for r in range(40)], T=120)    # 1 or 2 pages each
    tw.extend([7], [120], T=120)                                           # request 7: 61 pages
    ids = [7 if k == 33 else (k if k % 5 else -1) for k in range(40)]     # padding; 7 late
    indptr, indices, _ = tw.csr(ids)
    assert indptr[34] - indptr[33] == 61 and indices[indptr[-1]:] == [-1] * (40 * 64 - indptr[-1])
    tw.csr(ids, cap=indptr[33] + 5)                       # overflow inside the long request


def test_page_lists_with_one_long_lane(chunking):
    """Fork, truncate and release walk a page list whose lanes are found by a search over their
    ends: one long lane among short, empty, padding and repeated lanes, across chunks."""
    tw = Twin(512, 2, 48, 64)
    tw.extend(list(range(40)), [1 + (r % 4) for r in range(40)], T=160)
    tw.extend([5], [110], T=110)                                            # request 5: 57 pages
    src = [5 if k == 30 else k % 40 for k in range(40)]
    dst = [40 + k // 5 if k % 5 == 0 else -1 for k in range(40)]
    dst[30] = 47
    tw.fork(src, dst, [2 * (k % 3) + 1 if k != 30 else 111 for k in range(40)])  # 30: 55 pages shared
    tw.truncate([-1] * 20 + [5, 47] + [-1] * 15 + [1, 2, 2], [0] * 20 + [9, 30] + [0] * 15 + [1, 0, 0])
    tw.release([k if k % 3 else -1 for k in range(48)] + [47, 5], cache=True)


def test_lane_scratch_bounds_the_batch_at_the_backend():
    """The façade caps B at the pool's max_batch; the kernels' lane_end scratch has that many
    entries, so a direct backend call with more lanes is refused before the launch."""
    table = tpool.PageTable(tpool.PagePool(16, 2, device=DEVICE, backend="triton", max_batch=2), 8, 4)
    for call in (lambda: table.ops.release(i32(list(range(3))), False),
                 lambda: table.ops.fork(i32([0, 1, 2]), i32([3, 4, 5]), i32([0, 0, 0]),
                                          torch.zeros(3, dtype=torch.bool, device=DEVICE), _full(3), _full(3))):
        with pytest.raises(ValueError, match="expected at most 2 entries"):
            call()


def test_pushes_and_pops_carry_across_chunks(chunking):
    """Valid lanes far apart: pages freed and popped by lanes in different chunks share one stack."""
    tw = Twin(40, 2, 6, 5)
    tw.extend([0, 1, 2, 3, 4, 5], [9, 7, 5, 3, 9, 1], T=34)
    gap = [-1] * 20
    tw.truncate([0] + gap + [1] + gap + [4], [1, *gap, 2, *gap, 3])      # 4 + 2 + 3 pages pushed
    ok, _, cow_dst = tw.fork([0] + gap + [2] + gap + [5], [1] + gap + [3] + gap + [4], [1, *gap, 3, *gap, 1])
    assert ok == [False] * 43                              # no dst is empty
    tw.release([1] + gap + [3] + gap + [4])
    ok, _, cow_dst = tw.fork([0] + gap + [2] + gap + [5], [1] + gap + [3] + gap + [4], [1, *gap, 3, *gap, 1])
    assert [ok[k] for k in (0, 21, 42)] == [True] * 3 and min(cow_dst[0], cow_dst[21], cow_dst[42]) >= 0
    tw.release([0] + gap + [2, 2] + gap + [5])


def test_every_call_is_one_launch(monkeypatch):
    if DEVICE != "cpu":
        pytest.skip("counts launches through the interpreter")
    from triton.runtime import interpreter
    launches = []
    original = interpreter.GridExecutor.__call__

    def counting(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", counting)
    tw = Twin(16, 2, 3, 4)
    tw.extend([0, 1, -1], [3, 1, 0], T=4)
    tw.extend([0, 1, 2], [1, 1, 1])                       # decode: dedupe, plan, pop, table, slots
    tw.fork([0], [2], [3])                                # shares a page, copies one
    tw.truncate([0], [2])
    tw.csr([0, 1])
    tw.rows([0, 1])
    tw.release([0, 1, 2])
    assert launches == ["extend_kernel", "extend_kernel", "fork_kernel", "release_kernel",
                        "flashinfer_csr_kernel", "block_table_rows_kernel", "release_kernel"]
    launches.clear()
    tw.tri.step(i32([0, 1]), i32([2, 1]), max_tokens=3)   # extend + CSR: one launch too
    assert launches == ["step_kernel"]


# ------------------------------------------------------------------ random
@pytest.mark.parametrize("seed, ps", [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5), (6, 16)])
def test_random_sequence_matches_reference(chunking, seed, ps):
    rng = random.Random(seed)
    P, R, MP = rng.randint(12, 48), rng.randint(2, 6), rng.randint(1, 5)
    tw = Twin(P, ps, R, MP)
    for _ in range(40):
        op = rng.choice(["extend", "extend", "decode", "release", "truncate", "fork", "csr", "rows"])
        B = rng.randint(0, 6) if chunking == "wide" else rng.randint(30, 40)
        ids = [rng.randrange(-1, R + 1) for _ in range(B)]
        lens = tw.lens()
        if op in ("extend", "decode"):
            ntok = [1] * B if op == "decode" else [rng.randint(-1, 2 * ps + 1) for _ in ids]
            T = max(sum(max(n, 0) for n in ntok) + rng.randint(-2, 2), 0)
            tw.extend(ids, ntok, T=T)
        elif op == "release":
            tw.release(ids, cache=rng.random() < 0.5)
        elif op == "truncate":
            tw.truncate(ids, [lens[r] - rng.randint(-1, 2 * ps) if 0 <= r < R else 0 for r in ids])
        elif op == "fork":
            src = [rng.randrange(-1, R + 1) for _ in ids]
            tw.fork(src, ids, [rng.randint(-1, lens[s] + 1) if 0 <= s < R else 1 for s in src])
        elif op == "csr":
            tw.csr(ids, cap=rng.choice([None, rng.randint(0, 8)]))
        else:
            tw.rows(ids)
    tw.tri.check_invariants()


def test_round_up_does_not_wrap_near_int32_max():
    """The tables' round-up (``cdiv``: lengths to pages) of a length near INT32_MAX, as int32 on a GPU:
    ``(a + b - 1) // b`` wrapped negative there (a release with a page size that is not a power of two
    then dropped none of the row's pages)."""
    from tpool.kernels import _triton_shim
    _triton_shim.load()
    import triton
    import triton.language as tl
    from tpool.kernels import _triton_table_util
    global _cdiv  # a jit function finds what it calls among its module's globals
    _cdiv = _triton_table_util.cdiv

    @triton.jit
    def round_up(a_ptr, out_ptr, b, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(out_ptr + i, _cdiv(tl.load(a_ptr + i), b))

    a = i32([0, 1, 2, 3, 7, 2**31 - 3, 2**31 - 2, 2**31 - 1])
    out = torch.empty_like(a)
    for b in (1, 3, 7, 2**30):
        round_up[(1,)](a, out, b, N=8)
        assert out.tolist() == [-(-v // b) for v in a.tolist()], b


# Session 25's review of the Triton kernels: kernel-level checks of two bounds.


@triton.jit
def _entries_only(req_ids_ptr, B, indptr_ptr, indices_ptr, bt_ptr, end, total, R, MP, P, SEARCH, res_ptr,
                  BLOCK: tl.constexpr):
    tl.store(res_ptr, _csr._csr_entries(req_ids_ptr, B, indptr_ptr, indices_ptr, bt_ptr, end.to(tl.int64), total,
                                        R, MP, P, SEARCH, BLOCK))


def test_csr_entries_never_read_outside_the_table():
    """Repeated ids can sum past INT32_MAX pages, where indptr is clamped: the search for an entry past
    the clamp lands on the last lane, here padding (-1), and the row read was masked only by ``u < end``
    (on an H200: an illegal address). The read is bounded by the table's rows and columns; the caller
    rescans the rows. Scaled down: indptr clamped at 6 of 8 pages."""
    MP = 4
    buf = torch.full((MP * 4,), SENTINEL, dtype=torch.int32, device=DEVICE)
    bt = buf[MP:3 * MP]  # block_table [2, 4] with sentinel rows before and after it
    bt[:] = torch.arange(2 * MP, dtype=torch.int32, device=DEVICE)
    indices = torch.full((8,), -1, dtype=torch.int32, device=DEVICE)
    res = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    _entries_only[(1,)](i32([0, 0, -1]), 3, i32([0, 4, 6, 6]), indices, bt, 8, 8, 2, MP, 100, 2, res, BLOCK=32)
    assert SENTINEL not in indices.tolist()
    assert indices.tolist()[:6] == [0, 1, 2, 3, 0, 1] and int(res[0]) == 2  # the two past the clamp: -1


@triton.jit
def _lane_of(f_ptr, lane_end_ptr, B, SEARCH, lane_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    f = tl.load(f_ptr + i)
    lane, _ = list_lane(f, i < BLOCK, lane_end_ptr, B, SEARCH)
    tl.store(lane_ptr + i, lane)


def test_list_lane_halves_without_wrapping():
    """``(lo + hi) // 2`` wrapped in int32 past 2**30 lanes (a negative index: the interpreter crashed, an
    H200 read garbage and leaked a page); ``lo + (hi - lo) // 2`` cannot. The search is checked on a
    small list, and the midpoint's arithmetic at the edge in int32 as the kernel does it."""
    lane_end = i32([2, 2, 5, 9])
    lanes = torch.full((4,), -7, dtype=torch.int32, device=DEVICE)
    _lane_of[(1,)](i32([0, 2, 4, 8]), lane_end, 4, 3, lanes, BLOCK=4)
    assert lanes.tolist() == [0, 2, 2, 3]
    lo, hi = torch.tensor([2**30], dtype=torch.int32), torch.tensor([2**30 + 16], dtype=torch.int32)
    assert int(lo + (hi - lo) // 2) == 2**30 + 8 and int((lo + hi) // 2) < 0
