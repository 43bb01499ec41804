"""Triton kernels against the reference backend, bit for bit, at the kernel level.

Every case runs the same operation on two ``PoolState`` objects, one through
``tpool.backends.reference`` and one through the ``*_triton`` launchers, and compares
every output and every state tensor (scratch included) with ``==``. Output
buffers start filled with a sentinel, so a lane a kernel forgets to write
shows up as a mismatch. On a CPU the kernels run under Triton's interpreter.
"""

import random

import pytest
import torch

from conftest import TRITON_DEVICE

if TRITON_DEVICE is None:
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from tpool.backends import reference  # noqa: E402
from tpool.kernels import _triton_util, alloc, evict, free, incref, touch  # noqa: E402
from tpool.kernels import layout as L  # noqa: E402
from tpool.state import PoolState  # noqa: E402
from tpool.testing import no_host_sync  # noqa: E402

DEVICE = TRITON_DEVICE
SENTINEL = 12345  # written into output buffers before a call; must never survive it


def i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


class Twin:
    """A reference pool and a Triton pool driven in lockstep; every call is compared."""

    def __init__(self, num_pages):
        self.P = num_pages
        self.ref = PoolState.create(num_pages, torch.device(DEVICE))
        self.tri = PoolState.create(num_pages, torch.device(DEVICE))

    def compare(self, what=""):
        for name, r in self.ref.tensors().items():
            t = self.tri.tensors()[name]
            assert torch.equal(r, t), f"{what}: state {name} differs\nreference {r.tolist()}\ntriton    {t.tolist()}"

    @staticmethod
    def _same(what, name, r, t):
        assert torch.equal(r, t), f"{what}: output {name} differs\nreference {r.tolist()}\ntriton    {t.tolist()}"

    def alloc(self, counts, max_pages=None, max_batch=None, evict=False):
        counts = i32(counts)
        M = self.P if max_pages is None else max_pages
        BO = counts.numel() if max_batch is None else max_batch
        outs = []
        for st, fn in ((self.ref, reference.alloc), (self.tri, None)):
            pages = torch.full((M,), SENTINEL, dtype=torch.int32, device=DEVICE)
            indptr = torch.full((BO + 1,), SENTINEL, dtype=torch.int32, device=DEVICE)
            ok = torch.ones(BO, dtype=torch.bool, device=DEVICE)
            evicted = torch.full((M,), SENTINEL, dtype=torch.int32, device=DEVICE)
            if fn is not None:
                fn(st, counts, pages, indptr, ok, evicted, evict)
            else:
                with no_host_sync():
                    alloc.alloc_triton(st, counts, pages, indptr, ok, evicted, evict)
            outs.append((pages, indptr, ok, evicted))
        what = f"alloc({counts.tolist()}, M={M}, BO={BO}, evict={evict})"
        for name, r, t in zip(("pages", "indptr", "ok", "evicted"), *outs):
            self._same(what, name, r, t)
        self.compare(what)
        return outs[0]

    def _pages_op(self, name, pages, ref_fn, tri_fn):
        pages = i32(pages)
        ref_fn(self.ref, pages.clone())
        with no_host_sync():
            tri_fn(self.tri, pages)
        self.compare(f"{name}({pages.tolist()})")

    def free(self, pages, cache=False):
        self._pages_op(f"free[cache={cache}]", pages, lambda st, p: reference.free(st, p, cache),
                       lambda st, p: free.free_triton(st, p, cache))

    def incref(self, pages):
        self._pages_op("incref", pages, reference.incref, incref.incref_triton)

    def touch(self, pages):
        self._pages_op("touch", pages, reference.touch, touch.touch_triton)

    def evict(self, k):
        outs = []
        for st in (self.ref, self.tri):
            out = torch.full((k,), SENTINEL, dtype=torch.int32, device=DEVICE)
            if st is self.ref:
                reference.evict(st, out)
            else:
                with no_host_sync():
                    evict.evict_triton(st, out)
            outs.append(out)
        self._same(f"evict({k})", "out", *outs)
        self.compare(f"evict({k})")
        return outs[0].tolist()

    def counter(self, slot):
        return int(self.tri.counters[slot])


@pytest.fixture(params=["wide", "chunked"])
def chunking(request, monkeypatch):
    """``wide``: one chunk holds everything; ``chunked``: 32-lane chunks, so carries across chunks
    (prefix sums, stack top, the LRU queue's tail and ranks) are exercised at small sizes."""
    if request.param == "chunked":
        monkeypatch.setattr(_triton_util, "MAX_BLOCK", 32)
    return request.param


# ------------------------------------------------------------------ alloc
def test_alloc_exhaustion_and_exact_fit(chunking):
    tw = Twin(8)
    pages, indptr, ok, _ = tw.alloc([2, 3, 9])
    assert pages.tolist() == [0, 1, 2, 3, 4, -1, -1, -1] and indptr.tolist() == [0, 2, 5, 5]
    assert ok.tolist() == [True, True, False]
    tw.alloc([3])                       # exact fit: the last three pages
    _, _, ok, _ = tw.alloc([1, 0])      # exhausted: everything after fails, zero included
    assert ok.tolist() == [False, False]
    assert tw.counter(L.FAILED_REQUESTS) == 3 and tw.counter(L.FREE_COUNT) == 0


def test_alloc_zero_and_negative_counts(chunking):
    tw = Twin(8)
    _, indptr, ok, _ = tw.alloc([0, 2, 0, 0])
    assert indptr.tolist() == [0, 0, 2, 2, 2] and ok.tolist() == [True] * 4
    _, _, ok, _ = tw.alloc([1, -1, 2, -3, 0])
    assert ok.tolist() == [True, False, False, False, False]
    assert tw.counter(L.ERR_BAD_COUNT) == 2
    tw.alloc([-5])


def test_alloc_out_overflow_and_padding(chunking):
    tw = Twin(16)
    pages, indptr, ok, _ = tw.alloc([2, 3, 1], max_pages=4, max_batch=6)
    assert ok.tolist() == [True, False, False, False, False, False]
    assert indptr.tolist() == [0, 2, 2, 2, 2, 2, 2] and pages.tolist() == [0, 1, -1, -1]
    assert tw.counter(L.ERR_OUT_OVERFLOW) == 2 and tw.counter(L.FAILED_REQUESTS) == 2
    tw.alloc([], max_pages=3, max_batch=2)   # B = 0: only padding
    tw.alloc([], max_pages=0, max_batch=0)   # nothing at all; the clock still moves
    tw.alloc([1], max_pages=0)                # out too small for any page


def test_alloc_large_batch_spans_chunks(chunking):
    tw = Twin(64)
    rng = random.Random(7)
    tw.alloc([rng.randrange(0, 3) for _ in range(70)], max_batch=75)
    tw.free(list(range(0, 64, 3)))
    tw.alloc([1] * 40, max_pages=64)
    tw.free(list(range(64)))
    _, _, ok, _ = tw.alloc([1] * 35 + [-1] + [0] * 30)  # a negative in chunk 2 fails chunks 2 and 3
    assert ok.tolist() == [True] * 35 + [False] * 31


def test_many_duplicates_across_chunks(chunking):
    """Thousands of entries naming a few pages: first occurrences and counts must not depend on chunking."""
    tw = Twin(64)
    rng = random.Random(5)
    tw.alloc([64])
    tw.incref([rng.randrange(-1, 64) for _ in range(2500)])
    tw.touch([rng.randrange(-3, 70) for _ in range(2100)])
    tw.free([rng.randrange(-1, 64) for _ in range(3000)], cache=True)
    tw.free([rng.randrange(-1, 64) for _ in range(3000)])
    tw.alloc([rng.randrange(0, 3) for _ in range(40)], evict=True)


def test_free_into_the_cache_queues_at_the_last_occurrence_across_chunks(chunking):
    """A free into the cache queues each page it caches at its last occurrence, wherever its occurrences
    fall among the 32-lane chunks; pages that keep a reference or run out of them (double frees) too."""
    P, rng = 48, random.Random(7)
    tw = Twin(P)
    tw.alloc([P])
    pages = [rng.randrange(P) for _ in range(150)] + [-1, 60]
    k = {p: pages.count(p) for p in range(P)}
    refs = {p: k[p] + 1 if p % 5 == 0 else max(k[p] - (p % 5 == 1), 1) for p in range(P)}
    tw.incref([p for p in range(P) for _ in range(refs[p] - 1)])
    tw.free(pages, cache=True)
    cached = [p for p in range(P) if 0 < k[p] and refs[p] <= k[p]]
    assert tw.counter(L.ERR_DOUBLE_FREE) == sum(k[p] - refs[p] for p in cached)
    last = {p: i for i, p in enumerate(pages)}
    assert tw.evict(P) == sorted(cached, key=last.__getitem__) + [-1] * (P - len(cached))


# ------------------------------------------------------------------- free
def test_free_duplicates_double_free_invalid(chunking):
    tw = Twin(8)
    tw.alloc([4])                       # pages 0..3
    tw.incref([1])                      # page 1 holds 2 references
    tw.free([1, 1, 1, 2, -1, 9, -7, 2])  # 1: two dropped + one double free; 2: one + one
    assert tw.counter(L.ERR_DOUBLE_FREE) == 2 and tw.counter(L.ERR_INVALID_PAGE) == 2
    tw.free([1, 5, 5])                  # already free / never allocated
    assert tw.counter(L.ERR_DOUBLE_FREE) == 5
    tw.free([3, 0])                     # pushed in first-occurrence order
    assert tw.tri.free_stack.tolist()[:8][-2:] == [3, 0]
    tw.free([])


def test_free_cache_touch_incref_revive(chunking):
    tw = Twin(8)
    tw.alloc([6])
    tw.free([4, 2, 4], cache=True)      # 4: cached, one double free; 2: cached
    tw.free([2], cache=True)            # double free of a cached page
    tw.touch([2, 2, 7, -1, 11, 0])      # 7 is FREE: use after free; 11 invalid
    tw.incref([4, 4, 4, 7, 7])          # revive 4 with three references; 7: two use-after-free
    assert tw.counter(L.REVIVED) == 1 and tw.counter(L.ERR_USE_AFTER_FREE) == 3
    tw.free([4, 4, 4, 5], cache=True)
    tw.incref([])
    tw.touch([])


# ------------------------------------------------------------------ evict
def test_evict_oldest_first_ties_in_last_occurrence_order(chunking):
    tw = Twin(8)
    tw.alloc([6])                       # clock 1
    tw.free([5, 2], cache=True)         # clock 2
    tw.free([4], cache=True)            # clock 3
    tw.free([3, 0, 3], cache=True)      # clock 4: 0 first, then 3
    tw.touch([2])                       # clock 5
    assert tw.evict(2) == [5, 4]
    assert tw.evict(1) == [0]           # a tie group split across calls: 0, then 3 (its last occurrence)
    assert tw.evict(0) == []
    assert tw.evict(20) == [3, 2] + [-1] * 18   # K > P
    assert tw.evict(3) == [-1, -1, -1]


def test_evict_through_stale_entries_and_cleaning(chunking):
    """Touches and revives of cached pages leave stale entries (skipped by eviction, dropped by the
    cleaner); enough pushes take the cleaner through several passes; every call compared, queue
    included."""
    P = 48
    tw = Twin(P)
    tw.alloc([P])
    rng = random.Random(3)
    used, passes = list(range(P)), 0
    for _ in range(12):
        rng.shuffle(used)
        k = rng.randint(len(used) // 2, len(used))
        tail = tw.counter(L.LRU_TAIL)
        tw.free(used[:k], cache=True)
        passes += tw.counter(L.LRU_TAIL) < tail
        used = used[k:]
        cached = [p for p in range(P) if int(tw.tri.page_state[p]) == L.CACHED]
        for _ in range(4):
            tail = tw.counter(L.LRU_TAIL)
            tw.touch(rng.sample(cached, len(cached) // 2) + [rng.randrange(P)])
            passes += tw.counter(L.LRU_TAIL) < tail
        back = rng.sample(cached, len(cached) // 5)
        tw.incref(back)
        used += back
        for k in (1, 5, 0, 9):
            tw.evict(k)
        pages, _, ok, _ = tw.alloc([rng.randint(1, P // 2)], evict=True)
        used += [p for p in pages.tolist() if p >= 0]
    assert passes >= 2, passes


def test_evict_single_stamp_partial(chunking):
    tw = Twin(40)
    tw.alloc([40])
    tw.free(list(range(39, -1, -1)), cache=True)   # all 40 share one stamp: in the order given
    assert tw.evict(5) == [39, 38, 37, 36, 35]
    tw.evict(35)


# ------------------------------------------------------------ alloc + evict
def test_alloc_with_evict(chunking):
    tw = Twin(10)
    tw.alloc([8])                       # clock 1: pages 0..7, 8 and 9 free
    tw.free([6, 1], cache=True)         # clock 2
    tw.free([3, 7, 0], cache=True)      # clock 3
    tw.touch([1])                       # clock 4
    _, _, ok, ev = tw.alloc([1], evict=True)          # no shortfall: nothing evicted
    assert ok.tolist() == [True] and ev.tolist() == [-1] * 10
    pages, _, ok, ev = tw.alloc([2, 1], evict=True)   # 1 free left: shortfall 2
    assert ok.tolist() == [True, True] and ev.tolist()[:3] == [6, 3, -1]
    assert pages.tolist()[:3] == [3, 6, 9]  # evicted pages are popped last-pushed first
    tw.alloc([2, 5], evict=True)        # 3 cached left: first fits, second fails
    tw.alloc([3], evict=True)           # exactly the cached pages
    tw.alloc([1], evict=True)           # nothing left


def test_alloc_with_evict_tie_group_and_small_out(chunking):
    tw = Twin(40)
    tw.alloc([40])
    tw.free(list(range(0, 40, 2)), cache=True)
    tw.free(list(range(1, 40, 2)), cache=True)
    tw.touch([10, 11, 12])
    tw.alloc([3, 4], evict=True)                     # shortfall 7 inside the first tie group
    tw.alloc([20, 20], max_pages=25, evict=True)     # second request overflows the output
    tw.alloc([5, -1, 2], evict=True)


# ------------------------------------------------------------ random mix
def _random_pages(rng, P, n):
    pool = list(range(P)) + [-1, -1, P, P + 3, -2]
    return [rng.choice(pool) for _ in range(n)]


@pytest.mark.parametrize("num_pages,seed", [(1, 0), (5, 1), (17, 2), (64, 3)])
def test_random_mixed_sequence(chunking, num_pages, seed):
    rng = random.Random(seed)
    tw = Twin(num_pages)
    P = num_pages
    for step in range(120):
        op = rng.random()
        if op < 0.3:
            B = rng.randrange(0, 7)
            counts = [rng.choice([0, 1, 1, 2, 3, P // 2 + 1, -1]) if rng.random() < 0.95 else -1
                      for _ in range(B)]
            tw.alloc(counts, max_pages=rng.choice([P, P + 2, max(P // 2, 1), 0]),
                     max_batch=B + rng.randrange(0, 3), evict=rng.random() < 0.5)
        elif op < 0.55:
            tw.free(_random_pages(rng, P, rng.randrange(0, 2 * P + 4)), cache=rng.random() < 0.6)
        elif op < 0.7:
            tw.incref(_random_pages(rng, P, rng.randrange(0, P + 3)))
        elif op < 0.85:
            tw.touch(_random_pages(rng, P, rng.randrange(0, P + 3)))
        else:
            tw.evict(rng.randrange(0, P + 4))
