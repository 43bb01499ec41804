"""Lockstep driver: a random scheduler on a HostMirror, checked after every call against the device and
against a plain Python model of the pool.

The model keeps each page's state, reference count and generation, each request's pages, length and
tokens, and the tokens each page holds (written when a row appends them). It learns only which page ids
the device handed out (from ``block_table``, at the test's sync points) and checks everything else: that
a page handed out was FREE, that no token is written into a page another request holds, that a revived
page holds the tokens of the prompt it is revived for, that a call the mirror refuses changes nothing
(its books or the device), that every step the mirror let run succeeded (``ok``), that the mirror never
promises more than the device has (equal where it says it is exact, and after a reconciliation of a
snapshot with nothing asked since), and the pool's and table's state against the model. The model keeps
the LRU order too (a release queues each row's pages last page first, a page shared by rows of one call
at its last occurrence; a revive takes a page out): every eviction must take its oldest CACHED pages,
in that order. In ``cache`` mode it keeps the prefix cache's index as the README states it (``Index``):
with no eviction outstanding, every recent prompt must match exactly the pages the model names, no
fewer (a hit missed) and no others.

Modes: ``plain`` (admit, chunked prefill, decode with preemption, into StepOuts taking turns and booked
for replays, mixed steps, finish, truncate, reserve, snapshots reconciled in any order, refused calls),
``shared`` (also forks, rollbacks of speculative steps, finish into the cache, evictions, revives with
generations recorded) and ``cache`` (the same through a PrefixCache: insert before finish, match,
revive with count_cached, evict, drop).

Usage: ``python tests/mirror_lockstep.py --backends numba,reference --seeds 0-40 --steps 300``
(Triton needs ``TRITON_INTERPRET=1`` without a GPU; it is slow: a few seeds).
"""

import argparse
import random
import sys

import numpy as np
import torch

import tpool
from tpool.kernels import layout as L
from tpool.scheduling import HostMirror, PrefixCache, WouldNotFit

FREE, USED, CACHED = L.FREE, L.USED, L.CACHED


class Fail(AssertionError):
    pass


class Index:
    """The prefix cache's index as plain dicts (the README's rules): an entry per whole page, keyed by
    (the entry before it, the page's tokens); an insert re-points the entries it finds to its row's
    pages, but for the leading ones a running reviver (not inserted since its revive) holds, and adds the
    rest while slots are left; an eviction takes the entries naming its pages, which
    go (with every entry under them) at their drop, and an entry an insert re-pointed meanwhile lets its
    new page go then too; slots dropped while an eviction is outstanding are reused after it."""

    def __init__(self, ps, capacity):
        self.ps, self.free, self.held = ps, capacity, 0
        self.ids, self.key, self.page, self.kids, self.named = {}, {}, {}, {}, {}
        self.next, self.pending, self.inflight, self.moved = 1, [], [], set()
        self.revivers = {}   # row -> the entries it revived, while it runs and is not inserted

    def revive(self, row, tokens, k):
        ps, e, es = self.ps, 0, []
        for i in range(k):
            e = self.ids[(e, tuple(tokens[i * ps:(i + 1) * ps]))]
            es.append(e)
        self.revivers[row] = es

    @property
    def closed(self):
        return bool(self.pending or self.inflight)

    def insert(self, row, pages, tokens):
        ps, e, es, first = self.ps, 0, [], None
        for i in range(len(tokens) // ps):
            key = (e, tuple(tokens[i * ps:(i + 1) * ps]))
            if key not in self.ids:
                if not self.free:
                    break
                self.free -= 1
                self.ids[key] = self.next
                self.key[self.next] = key
                self.kids.setdefault(e, set()).add(self.next)
                self.next += 1
                first = i if first is None else first
            e = self.ids[key]
            es.append(e)
        known = len(es) if first is None else first
        keep = 0
        for q, held in self.revivers.items():
            j = 0
            while q != row and j < min(known, len(held)) and es[j] == held[j]:
                j += 1
            keep = max(keep, j)
        self.revivers.pop(row, None)
        if known > keep and self.closed:
            self.moved.update(es[keep:known])
        for e in es[keep:]:
            if self.named.get(self.page.get(e)) == e:
                del self.named[self.page[e]]
        for e, p in zip(es[keep:], pages[keep:]):
            self.page[e], self.named[p] = p, e
        return len(es) - known

    def evict(self, pages):
        self.pending.append([self.named.pop(p, None) for p in pages])

    def sync(self):
        self.inflight.append([e for ev in self.pending for e in ev])
        self.pending = []
        gone = [e for e in dict.fromkeys(self.inflight.pop(0)) if e in self.key]
        under, stack = [], [c for e in gone for c in self.kids.get(e, ())]
        while stack:
            e = stack.pop()
            if e not in gone:
                under.append(e)
                stack.extend(self.kids.get(e, ()))
        for e in under + [e for e in gone if e in self.moved]:
            if self.named.get(self.page.get(e)) == e:
                del self.named[self.page[e]]
        for e in gone + under:
            key = self.key.pop(e)
            del self.ids[key]
            self.kids.get(key[0], set()).discard(e)
            self.kids.pop(e, None)
            self.page.pop(e, None)
        self.held += len(gone) + len(under)
        if not self.closed:
            self.free, self.held = self.free + self.held, 0
            self.moved.clear()
        return len(gone) + len(under)

    def match(self, tokens):
        """The pages of the entries ``tokens`` starts with (at least one token left to compute)."""
        ps, e, pages = self.ps, 0, []
        for i in range((len(tokens) - 1) // ps):
            e = self.ids.get((e, tuple(tokens[i * ps:(i + 1) * ps])))
            if e is None:
                break
            pages.append(self.page[e])
        return pages


def need(cond, msg):
    if not cond:
        raise Fail(msg)


class Driver:
    def __init__(self, backend, seed, mode, log=None):
        self.rng = rng = random.Random(seed)
        self.mode, self.log = mode, log
        self.ps = ps = rng.choice([1, 2, 3, 4])
        self.P = rng.randint(8, 40)
        self.R = rng.choice([3, 4, 6, 8])
        self.maxp = rng.choice([3, 5, 8, 12])
        self.la = rng.randint(1, 4)
        self.pool = tpool.PagePool(self.P, ps, device="cpu", backend=backend)
        self.table = tpool.PageTable(self.pool, self.R, self.maxp)
        self.m = HostMirror(self.table, lookahead=self.la, free=self.P, cached=0)
        self.cache = PrefixCache(self.m) if mode == "cache" else None
        self.index = Index(ps, self.P) if mode == "cache" else None
        # the model
        self.state = [FREE] * self.P
        self.ref = [0] * self.P
        self.gen = [0] * self.P             # +1 each time a page goes FREE
        self.lru = {}                      # the CACHED pages, least recently released first
        self.ptok = [None] * self.P        # tokens each page holds (list of ps, None = not written)
        self.pages, self.lens, self.toks = {}, {}, {}
        self.prio, self.arrivals = {}, 0
        self.entries = []                  # (pages, n_tokens, tokens, generations) for plain revives
        self.finished = []                 # token lists of finished requests (prompts for later)
        self.oks = []                      # ok tensors to read at the next check
        self.snaps = []
        self.outs = [self.table.step_out(self.R, max_tokens=self.R * 8) for _ in range(2)]
        self.turn = 0
        self.replays = None
        self.ops_done = []
        self.hits = {}

    # ------------------------------------------------------------------ model
    def _grow(self, row, n, tokens=None):
        """Row ``row`` appended n new tokens (random values); learn its new pages from the device."""
        ps = self.ps
        old_len = self.lens[row]
        old_np = len(self.pages[row])
        new_len = old_len + n
        new_np = -(-new_len // ps)
        bt = self.table.block_table[row, :new_np].tolist()
        need(bt[:old_np] == self.pages[row], f"row {row}: pages changed under it {bt[:old_np]} vs {self.pages[row]}")
        for p in bt[old_np:]:
            need(0 <= p < self.P and self.state[p] == FREE, f"row {row} took page {p} in state {self.state[p]}")
            self.state[p], self.ref[p] = USED, 1
            self.ptok[p] = [None] * ps
        self.pages[row] = bt
        for j in range(old_len, new_len):
            p = bt[j // ps]
            need(self.ref[p] == 1, f"row {row} writes token {j} into page {p} held {self.ref[p]} times")
            t = self.rng.randrange(6) if tokens is None else tokens[j - old_len]
            self.ptok[p][j % ps] = t
            self.toks[row].append(t)
        self.lens[row] = new_len

    def _start(self, row, tokens_pages=(), length=0):
        need(row not in self.lens, f"row {row} started twice")
        self.pages[row], self.lens[row], self.toks[row] = list(tokens_pages), length, []
        self.arrivals += 1
        self.prio[row] = self.arrivals

    def _drop_pages(self, pages, cache):
        for p in pages:
            need(self.ref[p] >= 1 and self.state[p] == USED, f"page {p} released in state {self.state[p]}")
            self.ref[p] -= 1
            if self.ref[p] == 0:
                self.state[p] = CACHED if cache else FREE
                self.gen[p] += not cache
                if cache:
                    self.lru[p] = None   # (a page is queued at its last occurrence: where it goes to 0)

    def _end(self, row, cache):
        self._drop_pages(self.pages.pop(row)[::-1], cache)   # (a release queues a row's last page first)
        toks = self.toks.pop(row)
        del self.lens[row], self.prio[row]
        if self.index is not None:
            self.index.revivers.pop(row, None)   # (its row may hold another request next)
        if toks:
            self.finished.append(toks)

    def _cut(self, row, new_len):
        ps = self.ps
        keep = -(-new_len // ps)
        self._drop_pages(self.pages[row][keep:], False)
        self.pages[row] = self.pages[row][:keep]
        del self.toks[row][new_len:]
        self.lens[row] = new_len

    # ------------------------------------------------------------------ checks
    def books(self):
        m = self.m
        return (m.free, m.cached, m.reserved, m._seq, m._st.copy(), m.live.copy(), list(m._free_rows),
                m.named.copy(), m.reserved_to.copy(), m._free_inexact_at, m._cached_inexact_at)

    def device(self):
        st = self.pool.state
        return (self.table.seq_lens.clone(), self.table.block_table.clone(), st.refcount.clone(),
                st.page_state.clone(), st.counters.clone())

    def same(self, a, b, what):
        for i, (x, y) in enumerate(zip(a, b)):
            eq = torch.equal(x, y) if isinstance(x, torch.Tensor) else \
                (np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y)
            need(eq, f"{what}: entry {i} changed: {x} -> {y}")

    def hit(self, what):
        self.hits[what] = self.hits.get(what, 0) + 1

    def check(self, reconciled=False):
        m, pool, table = self.m, self.pool, self.table
        for ok in self.oks:
            need(bool(ok.all()), f"a step the mirror let run failed: ok {ok.tolist()}")
        self.oks = []
        pool.check()
        st = pool.state
        need(st.page_state.tolist() == self.state, f"page states {st.page_state.tolist()} vs model {self.state}")
        need(st.refcount.tolist() == self.ref, f"refcounts {st.refcount.tolist()} vs model {self.ref}")
        need(pool.generations(torch.arange(self.P, dtype=torch.int32)).tolist() == self.gen, "generations")
        s = pool.stats()
        free, cached = s["pages.free.current"], s["pages.cached.current"]
        need(free == self.state.count(FREE) and cached == self.state.count(CACHED), "counters vs states")
        lens = table.seq_lens.tolist()
        for r in range(self.R):
            need(lens[r] == self.lens.get(r, 0), f"row {r}: device length {lens[r]} vs model {self.lens.get(r, 0)}")
            if r in self.lens:
                k = len(self.pages[r])
                need(table.block_table[r, :k].tolist() == self.pages[r], f"row {r}: pages")
        # the mirror against the model
        need(sorted(m.running()) == sorted(self.lens), f"running {m.running()} vs model {sorted(self.lens)}")
        need(sorted(m._free_rows + m.running()) == list(range(self.R)), f"free rows {m._free_rows}")
        need(m.free <= free and m.cached <= cached, f"over-promise: mirror {m.free}/{m.cached} device {free}/{cached}")
        if m.exact or reconciled:
            need(m.free == free, f"exact free {m.free} vs {free}")
        if m.cached_exact or reconciled:
            need(m.cached == cached, f"exact cached {m.cached} vs {cached}")
        if self.cache is None:   # (only a count_cached revive or fork may leave it negative, until an eviction)
            need(m.unreserved >= 0, f"unreserved {m.unreserved} < 0")
        live = m.live
        need(m.reserved == int(m.res[live].sum()) and (m.res[~live] == 0).all() and (m.res >= 0).all(),
             f"reserved {m.reserved} vs rows {m.res.tolist()}")
        for r, n in self.lens.items():
            lo, hi = m.length_bounds(r)
            need(lo <= n <= hi <= m.limit[r], f"row {r}: length {n} outside [{lo}, {hi}] (limit {m.limit[r]})")
            if reconciled:
                need(lo == hi == n, f"row {r}: reconciled bounds {lo},{hi} vs {n}")
            # pages the row may share (bound): every page shared with another row lies in it
            for i, p in enumerate(self.pages[r]):
                if self.ref[p] > 1:
                    need(i < m.shared[r] or (self.cache is not None and i < m.named[r]),
                         f"row {r}: page {i} ({p}) held {self.ref[p]} times, shared bound {m.shared[r]}")
        need(sorted(self.lru) == [p for p in range(self.P) if self.state[p] == CACHED], "LRU vs cached pages")
        if self.cache is not None:
            need(self.cache.closed == self.index.closed, f"closed {self.cache.closed}")
        if self.cache is not None and not self.cache.closed:
            self.cache.check_invariants()
            sp = self.cache.slot_page.tolist()
            for toks in self.finished[-4:] + [self.toks[r] for r in self.lens]:
                got = [sp[s] for s in self.cache.match(toks).slots]
                want = self.index.match(toks)
                need(got == want, f"match of {toks}: pages {got}, the index model's {want}")
                self.hit("matched" if want else "no match")

    # ------------------------------------------------------------------ ops
    def running(self):
        return sorted(self.lens)

    def _evict_room(self):
        """Repay a count_cached revive/fork (unreserved < 0) before a step."""
        m = self.m
        if m.unreserved < 0:
            self._evict(m.shortfall())

    def _evict(self, k):
        if self.cache is not None:
            ev = self.cache.evict(k)
        else:
            ev = self.m.evict(k)
        ids = [p for p in ev.tolist() if p >= 0]
        self.hit("evicted" if ids else "evict none")
        need(len(ids) == min(k, self.state.count(CACHED)), f"evict({k}) took {len(ids)} of "
             f"{self.state.count(CACHED)} cached")
        need(ids == list(self.lru)[:k], f"evict({k}) took {ids}, the least recently released are "
             f"{list(self.lru)[:k]}")
        for p in ids:
            del self.lru[p]
        if self.index is not None and ev.shape[0]:   # (evict(0) leaves match open)
            self.index.evict(ids)
        for p in ids:
            need(self.state[p] == CACHED, f"evicted page {p} in state {self.state[p]}")
            self.state[p] = FREE
            self.gen[p] += 1
        self.entries = [e for e in self.entries if not set(e[0]) & set(ids)] if self.rng.random() < 0.5 \
            else self.entries  # (stale ones kept sometimes: revived with generations, refused)

    def op_evict(self):
        self._evict(self.rng.randint(0, 4))

    def op_sync(self):
        if self.cache is not None and self.cache.closed:
            need(self.cache.sync() == self.index.sync(), "entries dropped")

    def _prompt(self):
        rng = self.rng
        if self.finished and rng.random() < 0.5:   # a shared prefix
            base = rng.choice(self.finished)
            return base[:rng.randint(0, len(base))] + [rng.randrange(6) for _ in range(rng.randint(1, 6))]
        return [rng.randrange(6) for _ in range(rng.randint(0, 4 * self.ps + 3))]

    def _max_len(self, p):
        return min(p + self.rng.randint(0, 3 * self.ps + 2), self.m.capacity)

    def op_admit(self):
        m, rng = self.m, self.rng
        reqs = [self._prompt() for _ in range(rng.randint(1, 3))]
        chunk = [len(t) if rng.random() < 0.6 else rng.randint(0, len(t)) for t in reqs]  # chunked prefill
        lens = [min(len(t), m.capacity) for t in reqs]
        chunk = [min(c, n) for c, n in zip(chunk, lens)]
        mls = [self._max_len(n) for n in lens]
        k = m.can_admit(chunk, mls, count_cached=False)
        if k == 0:
            return
        rows = m.admit(chunk[:k], mls[:k])
        self.oks.append(m.last_admit.ok)
        for row, c, t in zip(rows, chunk, reqs):
            self._start(row)
            self._grow(row, c, t)

    def _lanes(self, each_max=3):
        m = self.m
        rows = [r for r in self.running() if m.hi[r] < m.limit[r]]
        rng = self.rng
        if rng.random() < 0.5:
            n = rng.randint(1, each_max)
            rows = [r for r in rows if m.hi[r] + n <= m.limit[r]]
            return rows, n if rows else 1
        return rows, [rng.randint(0, int(min(each_max + 3, m.limit[r] - m.hi[r]))) for r in rows]

    def _preempt(self, rows, n):
        m = self.m
        victims = m.preemption(rows, [self.prio[r] for r in rows], n)
        if victims:
            self.hit("preempted")
            self._finish(victims, cache=self.cache is not None or (self.mode != "plain" and self.rng.random() < 0.3))
            if isinstance(n, list):
                n = [k for r, k in zip(rows, n) if r not in victims]
            rows = [r for r in rows if r not in victims]
        return rows, n

    def op_decode(self):
        self._evict_room()
        rows, n = self._lanes()
        rows, n = self._preempt(rows, n)
        if not rows:
            return
        m = self.m
        if not m.fits(rows, n):   # preempted with cache=True: pages are CACHED, evict them
            need(m.unreserved < 0 or m.cached > 0 or self.mode == "plain", "fits after preemption")
            self._evict(m.shortfall(rows=rows, n=n))
            if not m.fits(rows, n):
                self.hit("decode: no fit after preempt+evict")
                return
        how = self.rng.random()
        ns = n if isinstance(n, list) else [n] * len(rows)
        if how < 0.25 and len(rows) <= self.R and sum(ns) <= self.R * 8:
            o = self.outs[self.turn]
            self.turn ^= 1
            try:
                res = m.decode(rows, n, out=o)
            except ValueError as e:
                need("capacity" in str(e) or "holds at most" in str(e), f"out= refused: {e}")
                return
            self.oks.append(res.ok[:len(rows)].clone())
            self.hit("decode out")
        elif how < 0.35 and isinstance(n, int) and n <= self.la:
            m.decode(rows, n, run=False)  # booked: n replays of a one-token step, launched next
            ids = torch.tensor(rows, dtype=torch.int32)
            for _ in range(n):
                self.oks.append(self.table.step(ids, torch.ones(len(rows), dtype=torch.int32)).ok.clone())
            self.hit("decode run=False")
        else:
            res = m.decode(rows, n)
            self.oks.append(res.ok.clone())
            self.hit("decode")
        for r, k in zip(rows, ns):
            self._grow(r, k)

    def op_step(self):
        self._evict_room()
        m, rng = self.m, self.rng
        rows, n = self._lanes(5)
        rows, n = self._preempt(rows, n)
        if not m.fits(rows, n) if rows else False:
            self._evict(m.shortfall(rows=rows, n=n))
            if not m.fits(rows, n):
                self.hit("step: no fit after preempt+evict")
                return
        reqs = [self._prompt() for _ in range(rng.randint(0, 3))]
        lens = [min(len(t), m.capacity) for t in reqs]
        mls = [self._max_len(q) for q in lens]
        k = m.can_admit(lens, mls, rows, n)
        if not rows and not k:
            return
        width = None if rng.random() < 0.5 else min(self.R, m.max_batch)
        if width is not None and len(rows) + k > width:
            width = None
        res = m.step(rows, n, lens[:k], mls[:k], width=width)
        self.hit(f"step rows={bool(rows)} admits={bool(k)}")
        self.oks.append(res.result.ok[:len(rows) + k].clone())
        ns = n if isinstance(n, list) else [n] * len(rows)
        for r, q in zip(rows, ns):
            self._grow(r, q)
        for row, q, t in zip(res.rows, lens[:k], reqs):
            self._start(row)
            self._grow(row, q, t)

    def _finish(self, rows, cache):
        m = self.m
        if self.cache is not None:
            # the contract: insert before finish(cache=True); named/shared rows finish cached only
            for r in rows:
                lo, hi = m.length_bounds(r)
                if cache or m.named[r] or m.shared[r]:
                    t = self.toks[r][:lo]
                    need(self.cache.insert(r, t) == self.index.insert(r, self.pages[r][:lo // self.ps], t),
                         "entries made")
            cache = cache or any(m.named[r] or m.shared[r] for r in rows)
        elif cache and self.rng.random() < 0.7:
            for r in rows:
                lo, hi = m.length_bounds(r)
                whole = lo // self.ps
                if whole and lo == hi:
                    pages = self.pages[r][:whole]
                    gens = self.pool.generations(torch.tensor(pages, dtype=torch.int32)).clone()
                    self.entries.append((pages, whole * self.ps, self.toks[r][:whole * self.ps], gens))
        m.finish(rows, cache=cache)
        for r in rows:
            self._end(r, cache)

    def op_finish(self):
        run = self.running()
        if run:
            rows = self.rng.sample(run, self.rng.randint(1, min(3, len(run))))
            self._finish(rows, cache=self.mode != "plain" and self.rng.random() < 0.6)

    def op_truncate(self):
        m, run = self.m, self.running()
        if not run:
            return
        rows = self.rng.sample(run, self.rng.randint(1, min(2, len(run))))
        lens = []
        for r in rows:
            lo = m.length_bounds(r)[0]
            keep = m.shared_prefix(r)
            if self.cache is not None:
                if keep > lo:
                    return
                k = self.rng.randint(keep, lo)
            else:
                k = self.rng.randint(0, lo)
                if k < keep and k % self.ps:
                    k -= k % self.ps
            lens.append(k)
        m.truncate(rows, lens)
        self.hit("truncate")
        for r, k in zip(rows, lens):
            self._cut(r, k)

    def op_speculate(self):
        m = self.m
        d = self.rng.randint(1, 3)
        self._evict_room()
        rows = [r for r in self.running() if m.hi[r] + d + 1 <= m.limit[r]]
        if not rows:
            return
        rows, _ = self._preempt(rows, d + 1)
        if not rows or not m.fits(rows, d + 1):
            return
        self.oks.append(m.decode(rows, d + 1).ok.clone())
        for r in rows:
            self._grow(r, d + 1)
        # the accepted lengths (on the device: the test knows them) and the promised lower bounds
        acc = [self.lens[r] - (d + 1) + self.rng.randint(1, d + 1) for r in rows]
        mins = [min(int(m.lo[r]) - d, a) for r, a in zip(rows, acc)]
        for r, a, lo in zip(rows, acc, mins):
            keep, shared = m.shared_prefix(r), int(m.shared[r]) * self.ps
            if self.cache is not None and lo < keep:   # no rollback below the pages the cache names
                return
            if any(x < shared and x % self.ps for x in (a, lo)):   # nor ending inside a shared page
                return
        m.rollback(rows, torch.tensor(acc, dtype=torch.int32), mins)
        self.hit("rollback")
        for r, a in zip(rows, acc):
            self._cut(r, a)

    def op_fork(self):
        m, run = self.m, [r for r in self.running() if self.m.lo[r] > 0]
        if not run or not m.rows_free:
            return
        src = self.rng.choice(run)
        lo = m.length_bounds(src)[0]
        n = self.rng.randint(0, lo)
        cc = self.cache is not None and self.rng.random() < 0.3
        try:
            row = m.fork(src, n, self._max_len(n), count_cached=cc)
        except WouldNotFit:
            return
        self.oks.append(m.last_fork.ok.clone())
        self.hit("fork")
        whole = n // self.ps
        self._start(row, self.pages[src][:whole], whole * self.ps)
        for p in self.pages[row]:
            self.ref[p] += 1
        self.toks[row] = self.toks[src][:whole * self.ps]
        if n % self.ps:   # the copy-on-write page
            bt = self.table.block_table[row, :whole + 1].tolist()
            p = bt[whole]
            need(self.state[p] == FREE, f"fork's cow page {p} in state {self.state[p]}")
            self.state[p], self.ref[p] = USED, 1
            src_p = self.pages[src][whole]
            self.ptok[p] = list(self.ptok[src_p])   # (the caller copies the K/V)
            self.pages[row].append(p)
            self.toks[row] = self.toks[src][:n]
            self.lens[row] = n

    def _valid_entry(self, pages, tokens):
        ps = self.ps
        if len(set(pages)) != len(pages):
            return False
        for i, p in enumerate(pages):
            if self.state[p] == FREE or self.ptok[p] != tokens[i * ps:(i + 1) * ps]:
                return False
            if self.state[p] == USED:
                for h, hp in self.pages.items():
                    if p in hp and hp.index(p) >= self.m.shared[h]:
                        return False
        return True

    def op_revive(self):
        m = self.m
        if not m.rows_free:
            return
        if self.cache is not None:
            if not self.finished:
                return
            toks = self._prompt()
            hit = self.cache.match(toks)
            if not hit:
                return
            cc = self.rng.random() < 0.5
            try:
                row = self.cache.revive(hit, self._max_len(len(toks)), count_cached=cc)
            except WouldNotFit:
                return
            k = hit.n_tokens // self.ps
            pages = self.table.block_table[row, :k].tolist()
            self.index.revive(row, toks, k)
            tokens = toks[:hit.n_tokens]
        else:
            if not self.entries:
                return
            i = self.rng.randrange(len(self.entries))
            pages, n_tok, tokens, gens = self.entries[i]
            if not self._valid_entry(pages, tokens) or gens.tolist() != [self.gen[p] for p in pages]:
                return
            try:
                row = m.revive(torch.tensor(pages, dtype=torch.int32), n_tok, self._max_len(n_tok),
                               generations=gens)
            except WouldNotFit:
                return
            need(self.table.block_table[row, :len(pages)].tolist() == pages, "revived pages")
        for j, p in enumerate(pages):
            need(self.state[p] in (USED, CACHED), f"revived page {p} in state {self.state[p]}")
            need(self.ptok[p] == tokens[j * self.ps:(j + 1) * self.ps],
                 f"revived page {p} holds {self.ptok[p]}, the prompt {tokens[j * self.ps:(j + 1) * self.ps]}")
            if self.state[p] == CACHED:
                self.state[p] = USED
                del self.lru[p]
            self.ref[p] += 1
        self._start(row, pages, len(tokens))
        self.hit("revive")
        self.toks[row] = list(tokens)

    def op_reserve(self):
        run = self.running()
        if run:
            r = self.rng.choice(run)
            if self.rng.random() < 0.6:
                self.m.reserve(r, self.rng.randint(0, 8))
            else:
                self.m.unreserve(r)

    def op_snapshot(self):
        if len(self.snaps) < 4:
            self.snaps.append(self.m.snapshot())

    def op_reconcile(self):
        if self.snaps:
            i = 0 if self.rng.random() < 0.6 else self.rng.randrange(len(self.snaps))
            snap = self.snaps.pop(i)
            assert snap.ready()
            self.m.reconcile(snap)
            self.hit("reconcile")
            if self.rng.random() < 0.3:
                self.op_sync()
                self.m.reconcile(self.m.snapshot())
                return True
        return False

    def op_refused(self):
        """A call the mirror must refuse: nothing may change, on the host or the device."""
        m, rng = self.m, self.rng
        before, dev = self.books(), self.device()
        run = self.running()
        kind = rng.randrange(12)
        ps = self.ps
        shared = [r for r in run if m.shared[r] and ps > 1 and m.lo[r] >= m.shared[r] * ps]
        try:
            if kind == 0 and run:
                r = rng.choice(run)
                m.decode([r], int(m.limit[r] - m.hi[r]) + 1)
            elif kind == 1:
                m.admit([m.capacity + 1])
            elif kind == 2 and run:
                r = rng.choice(run)
                m.truncate([r], [int(m.lo[r]) + 1])
            elif kind == 3:
                m.admit([1] * (m.rows_free + 1))
            elif kind == 4 and run:
                r = rng.choice(run)
                m.step([r], int(m.limit[r] - m.hi[r]) + 1, [1], [2])
            elif kind == 5:
                m.finish([r for r in range(self.R) if r not in self.lens][:1] or [self.R + 3])
            elif kind == 6 and run:
                n = [int(m.limit[r] - m.hi[r]) for r in run]
                if m.fits(run, n):
                    return
                m.decode(run, n)
            elif kind == 7 and shared:   # to the middle of a page the row may share
                r = rng.choice(shared)
                m.truncate([r], [int(m.shared[r]) * ps - 1])
            elif kind == 8 and self.cache is not None:
                named = [r for r in run if m.named[r] or m.shared[r]]
                if named and rng.random() < 0.5:
                    m.finish([rng.choice(named)])   # would leave the cache's entries naming FREE pages
                else:
                    m.evict(1)                      # through the cache only
            elif kind == 9 and run:
                r = rng.choice(run)
                m.rollback([r], self.table.seq_lens[r:r + 1].clone(), [int(m.hi[r]) + 1])
            elif kind == 10 and m.capacity > 0 and -(-m.capacity // ps) > m.unreserved:
                m.step([], 1, [m.capacity], [m.capacity])
            elif kind == 11 and run:
                r = rng.choice(run)
                m.fork(r, int(m.lo[r]) + 1)
            else:
                return
        except ValueError as e:   # WouldNotFit included
            if not str(e):
                raise Fail(f"empty message from refusal {kind}")
        else:
            raise Fail(f"refused call {kind} ran")
        self.hit(f"refused {kind}")
        self.same(before, self.books(), f"refused call {kind}: mirror")
        self.same(dev, self.device(), f"refused call {kind}: device")

    OPS = {"admit": 3, "decode": 4, "step": 3, "finish": 2, "truncate": 1, "speculate": 1, "fork": 1,
           "revive": 2, "evict": 1, "sync": 1, "reserve": 1, "snapshot": 2, "reconcile": 2, "refused": 1}
    PLAIN = {"admit", "decode", "step", "finish", "truncate", "reserve", "snapshot", "reconcile", "refused"}

    def run(self, steps):
        names = [k for k, w in self.OPS.items() for _ in range(w) if self.mode != "plain" or k in self.PLAIN]
        for i in range(steps):
            name = self.rng.choice(names)
            self.ops_done.append(name)
            got = getattr(self, "op_" + name)()
            self.check(reconciled=got is True)
            if self.mode == "plain":
                need(self.m.exact and self.m.cached == 0, "plain mode inexact")
        self.table.check_invariants(exclusive=False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="numba,reference")
    ap.add_argument("--seeds", default="0-20", help="a seed or a range, e.g. 0-20")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--modes", default="plain,shared,cache")
    a = ap.parse_args()
    lo, _, hi = a.seeds.partition("-")
    bad = 0
    for backend in a.backends.split(","):
        for mode in a.modes.split(","):
            total = {}
            for seed in range(int(lo), int(hi or lo) + 1):
                d = Driver(backend, seed, mode)
                try:
                    d.run(a.steps)
                except Exception as e:  # noqa: BLE001 (every failure is reported, then the next seed runs)
                    bad += 1
                    print(f"FAIL {backend} {mode} seed {seed} after {len(d.ops_done)} ops "
                          f"({d.ops_done[-6:]}): {type(e).__name__}: {str(e)[:600]}")
                for k, v in d.hits.items():
                    total[k] = total.get(k, 0) + v
            print(f"{backend} {mode}: {dict(sorted(total.items()))}", flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
