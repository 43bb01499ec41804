"""A pure-Python model of PageTable on top of PoolModel, from the documented rules only."""

from pool_model import USED, PoolModel


def cdiv(a, b):
    return -(-a // b)


class TableModel:
    def __init__(self, pool: PoolModel, R, MP, ps):
        self.pool, self.R, self.MP, self.ps = pool, R, MP, ps
        self.rows = [[] for _ in range(R)]
        self.lens = [0] * R

    def _lanes(self, ids, dedupe=True):
        """(lane, request or None) with bad ids counted; None = padding or bad."""
        seen, out = set(), []
        for r in ids:
            if r == -1:
                out.append(None)
            elif not (0 <= r < self.R) or (dedupe and r in seen):
                self.pool.errors["bad_request"] = self.pool.errors.get("bad_request", 0) + 1
                out.append(None)
            else:
                seen.add(r)
                out.append(r)
        return out

    def _err(self, kind):
        self.pool.errors[kind] = self.pool.errors.get(kind, 0) + 1

    def _overflow(self, buffer):
        """An out_overflow, counted again under the buffer that overflowed."""
        self._err("out_overflow")
        self.pool.overflows[buffer] += 1

    def _pop(self, n):
        pages = [self.pool.stack.pop() for _ in range(n)]
        for p in pages:
            self.pool.rc[p], self.pool.state[p] = 1, USED
        self.pool.allocated += n
        return pages

    def extend(self, ids, ntok, max_tokens):
        P = self.pool
        P.clock += 1
        lanes = self._lanes(ids)
        ok, slots, csum, tok_end, free = [], [], 0, 0, len(P.stack)
        plan = []
        for r, n in zip(lanes, ntok):
            tok_end += max(n, 0)
            good = r is not None
            if good and n < 0:
                self._err("bad_count")
                good = False
            if good and cdiv(self.lens[r] + n, self.ps) > self.MP:
                self._err("table_overflow")
                good = False
            need = cdiv(self.lens[r] + n, self.ps) - cdiv(self.lens[r], self.ps) if good else 0
            csum += need
            fits = good and (need == 0 or csum <= free)  # a lane needing no page never waits on others
            granted = fits and (n == 0 or tok_end <= max_tokens)  # a lane of no tokens has none to overflow
            if fits and not granted:
                self._overflow("slots")
            if ids[len(ok)] != -1 and not granted:
                P.failed += 1
            ok.append(granted)
            plan.append((r, max(n, 0), need, granted))
        positions, qo_indptr, kv_lens = [], [0], []
        for r, n, need, granted in plan:
            if granted:
                self.rows[r] += self._pop(need)
                L = self.lens[r]
                slots += [self.rows[r][(L + t) // self.ps] * self.ps + (L + t) % self.ps for t in range(n)]
                positions += [L + t for t in range(n)]
                self.lens[r] = L + n
            else:
                slots += [-1] * n
                positions += [-1] * n
            qo_indptr.append(min(len(slots), max_tokens))
            kv_lens.append(self.lens[r] if r is not None else 0)
        P._peaks()
        slots = (slots + [-1] * max_tokens)[:max_tokens]
        # A step's attention metadata (see StepResult)
        self.meta = ((positions + [-1] * max_tokens)[:max_tokens], qo_indptr, kv_lens)
        return slots, ok

    def _free_flat(self, flat, cache):
        clock = self.pool.clock
        self.pool.clock -= 1          # free() ticks; the table call already did
        self.pool.free(flat, cache)
        assert self.pool.clock == clock

    def release(self, ids, cache=False):
        self.pool.clock += 1
        flat = []
        for r in self._lanes(ids):
            if r is not None:
                flat += self.rows[r][::-1] if cache else self.rows[r]  # cached: each row's last page first
                self.rows[r], self.lens[r] = [], 0
        self._free_flat(flat, cache)

    def truncate(self, ids, new_lens):
        self.pool.clock += 1
        flat = []
        for r, n in zip(self._lanes(ids), new_lens):
            if r is None:
                continue
            if n < 0 or n > self.lens[r]:
                self._err("bad_length")
                continue
            if n < self.lens[r] and n % self.ps and self.pool.rc[self.rows[r][n // self.ps]] > 1:
                self._err("bad_length")  # it would end inside a page another request holds
                continue
            keep = cdiv(n, self.ps)
            flat += self.rows[r][keep:]
            self.rows[r], self.lens[r] = self.rows[r][:keep], n
        self._free_flat(flat, False)

    def fork(self, src, dst, lens):
        P = self.pool
        P.clock += 1
        dl = self._lanes(dst)
        lanes, csum, free = [], 0, len(P.stack)
        start_lens = list(self.lens)
        for i, (s, d, n) in enumerate(zip(src, dst, lens)):
            if d == -1:
                lanes.append(None)
                continue
            if dl[i] is None or not (0 <= s < self.R) or s == d or start_lens[d] != 0:
                if dl[i] is not None:  # bad ids were counted by _lanes already
                    self._err("bad_request")
                P.failed += 1
                lanes.append(None)
                continue
            if n < 0 or n > start_lens[s]:
                self._err("bad_length")
                P.failed += 1
                lanes.append(None)
                continue
            stale = sum(P.state[p] != 1 for p in self.rows[s][:cdiv(n, self.ps)])  # not USED, copied page too
            if stale:  # a page freed or cached under the row: use after free, the lane fails
                P.errors["use_after_free"] = P.errors.get("use_after_free", 0) + stale
                P.failed += 1
                lanes.append(None)
                continue
            part = n % self.ps != 0
            csum += part
            if part and csum > free:  # a lane sharing whole pages only needs no page
                P.failed += 1
                lanes.append(None)
                continue
            lanes.append((s, d, n, part))
        src_rows = [list(row) for row in self.rows]
        shared = []
        for lane in lanes:
            if lane:
                s, d, n, part = lane
                shared += src_rows[s][:n // self.ps]
        clock = P.clock
        P.clock -= 1
        P.incref(shared)
        assert P.clock == clock
        ok, cow_src, cow_dst = [], [], []
        for lane in lanes:
            if not lane:
                ok.append(False), cow_src.append(-1), cow_dst.append(-1)
                continue
            s, d, n, part = lane
            row = src_rows[s][:n // self.ps]
            if part:
                new = self._pop(1)[0]
                cow_src.append(src_rows[s][n // self.ps]), cow_dst.append(new)
                row = row + [new]
            else:
                cow_src.append(-1), cow_dst.append(-1)
            self.rows[d], self.lens[d] = row, n
            ok.append(True)
        P._peaks()
        return ok, cow_src, cow_dst

    def csr(self, ids, cap=None, count=True, step=False):
        """(indptr, indices, last_page_len); with ``cap``, indices is the whole buffer of that
        length: the pages that fit, then -1. More pages than fit is an ``out_overflow``, and the
        first request whose pages do not all fit and every later one are exported as empty
        (``step``: their ``kv_lens`` in ``self.meta`` become 0). ``count``: count out-of-range ids
        (a step's export does not: its extend counted them)."""
        indptr, indices, last, end = [0], [], [], 0
        for i, r in enumerate(ids):
            good = 0 <= r < self.R
            if r != -1 and not good and count:
                self._err("bad_request")
            L = self.lens[r] if good else 0
            if step:  # a step lists each lane's kv_lens tokens: none for a repeated id
                L = self.meta[2][i]
            n = cdiv(L, self.ps)
            end += n
            if cap is not None and end > cap:  # past the capacity: exported as empty
                L = n = 0
                if step:
                    self.meta[2][i] = 0
            indices += self.rows[r][:n] if good else []
            indptr.append(indptr[-1] + n)
            last.append(L - (n - 1) * self.ps)
        if cap is not None:
            if end > cap:
                self._overflow("csr_indices")
            indices = indices + [-1] * (cap - len(indices))
        return indptr, indices, last

    def rows_of(self, ids):
        """``block_table_rows``: each request's row, -1 padded; a row of -1 for padding and for ids out of
        range, each of those but padding one ``bad_request`` (a repeated id is copied again)."""
        out = []
        for r in ids:
            if r != -1 and not 0 <= r < self.R:
                self._err("bad_request")
            row = self.rows[r] if 0 <= r < self.R else []
            out.append(row + [-1] * (self.MP - len(row)))
        return out

    def assert_matches(self, table):
        assert table.seq_lens.tolist() == self.lens
        expect = [row + [-1] * (self.MP - len(row)) for row in self.rows]
        assert table.block_table.tolist() == expect
        self.pool.assert_matches(table.pool)
