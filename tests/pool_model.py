"""A pure-Python model of the pool, written from the documented rules only.

It shares no code with tpool: the reference backend, the numba twins and the
Triton kernels are all checked against it.
"""

FREE, USED, CACHED = 0, 1, 2


class PoolModel:
    def __init__(self, num_pages):
        self.P = num_pages
        self.stack = list(range(num_pages - 1, -1, -1))  # top is the end
        self.rc = [0] * num_pages
        self.state = [FREE] * num_pages
        self.stamp = [0] * num_pages
        self.gen = [0] * num_pages  # +1 (mod 2**31) each time the page becomes FREE
        self.lru = {}  # the CACHED pages, least recently cached or touched first (dicts keep insertion order)
        self.clock = 0
        self.errors = dict(invalid_page=0, double_free=0, use_after_free=0, bad_count=0, out_overflow=0,
                           bad_request=0, table_overflow=0, bad_length=0, corrupt_state=0, refcount_overflow=0)
        self.overflows = dict(alloc_pages=0, slots=0, csr_indices=0)  # the buffer behind each out_overflow
        self.failed = self.allocated = self.freed = self.evicted = self.revived = 0
        self.used_peak = self.cached_peak = 0

    # helpers -------------------------------------------------------------
    def _groups(self, pages):
        """Distinct valid pages in first-occurrence order with their counts; count invalid ids."""
        counts = {}
        for p in pages:
            if 0 <= p < self.P:
                counts[p] = counts.get(p, 0) + 1
            elif p != -1:
                self.errors["invalid_page"] += 1
        return counts.items()  # dicts keep insertion order

    def cached(self):
        return sum(s == CACHED for s in self.state)

    def _peaks(self):
        used = sum(s == USED for s in self.state)
        self.used_peak = max(self.used_peak, used)
        self.cached_peak = max(self.cached_peak, self.cached())

    def _bump(self, p):
        self.gen[p] = (self.gen[p] + 1) % 2**31

    def _evict(self, n):
        out = list(self.lru)[:max(n, 0)]
        for p in out:
            del self.lru[p]
            self.state[p] = FREE
            self._bump(p)
            self.stack.append(p)
        self.evicted += len(out)
        return out

    # operations ----------------------------------------------------------
    def alloc(self, counts, max_pages, max_batch=None, evict=False):
        self.clock += 1
        max_batch = len(counts) if max_batch is None else max_batch
        free = len(self.stack)
        avail = free + (self.cached() if evict else 0)
        ok, indptr, bad, csum, total = [], [0], False, 0, 0
        for n in counts:
            if n < 0:
                self.errors["bad_count"] += 1
                bad = True
            else:
                csum += n
            fits = not bad and csum <= avail
            granted = fits and csum <= max_pages
            if granted:
                total = csum
            else:
                self.failed += 1
                self.errors["out_overflow"] += fits
                self.overflows["alloc_pages"] += fits
            ok.append(granted)
            indptr.append(total)
        evicted = self._evict(total - free) if evict else []
        pages = [self.stack.pop() for _ in range(total)]
        for p in pages:
            self.rc[p], self.state[p] = 1, USED
        self.allocated += total
        self._peaks()
        pad = max_batch - len(counts)
        return (pages + [-1] * (max_pages - total), indptr + [total] * pad, ok + [False] * pad,
                evicted + [-1] * (max_pages - len(evicted)))

    def free(self, pages, cache=False):
        self.clock += 1
        cached = []
        for p, k in self._groups(pages):
            if self.state[p] != USED:
                self.errors["double_free"] += k
                continue
            d = min(k, self.rc[p])
            self.errors["double_free"] += k - d
            self.rc[p] -= d
            if self.rc[p] == 0:
                self.freed += 1
                if cache:
                    self.state[p], self.stamp[p] = CACHED, self.clock
                    cached.append(p)
                else:
                    self.state[p] = FREE
                    self._bump(p)
                    self.stack.append(p)
        last = {p: i for i, p in enumerate(pages)}
        for p in sorted(cached, key=last.__getitem__):  # queued in the order of their last occurrence
            self.lru[p] = None
        self._peaks()

    def incref(self, pages):
        self.clock += 1
        for p, k in self._groups(pages):
            if self.state[p] == FREE:
                self.errors["use_after_free"] += k
                continue
            if self.state[p] == CACHED:
                self.state[p] = USED
                del self.lru[p]
                self.revived += 1
            self.rc[p] += k
        self._peaks()

    def touch(self, pages):
        self.clock += 1
        for p, k in self._groups(pages):
            if self.state[p] == FREE:
                self.errors["use_after_free"] += k
            else:
                self.stamp[p] = self.clock
                if self.state[p] == CACHED:  # to the back of the eviction order
                    self.lru[p] = self.lru.pop(p)

    def evict(self, k):
        self.clock += 1
        out = self._evict(k)
        return out + [-1] * (k - len(out))

    # comparison ------------------------------------------------------------
    def stats(self):
        s = {
            "pages.free.current": len(self.stack), "pages.cached.current": self.cached(),
            "pages.used.current": sum(s == USED for s in self.state),
            "pages.used.peak": self.used_peak, "pages.cached.peak": self.cached_peak,
            "pages.allocated": self.allocated, "pages.freed": self.freed, "pages.evicted": self.evicted,
            "pages.revived": self.revived, "requests.failed": self.failed, "clock": self.clock,
        }
        s.update({f"errors.{k}": v for k, v in self.errors.items()})
        s.update({f"overflows.{k}": v for k, v in self.overflows.items()})
        return s

    def assert_matches(self, pool):
        """Compare every piece of the pool's state with the model (a sync point, tests only)."""
        st = pool.state
        fc = int(st.counters[0])
        assert st.free_stack[:fc].tolist() == self.stack
        assert st.refcount.tolist() == self.rc
        assert st.page_state.tolist() == self.state
        assert st.stamp.tolist() == self.stamp
        assert st.page_gen.tolist() == self.gen
        stats = pool.stats()
        for key, value in self.stats().items():
            assert stats[key] == value, (key, stats[key], value)
