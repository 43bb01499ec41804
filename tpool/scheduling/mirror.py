"""HostMirror: a page table a scheduler drives through a host mirror of the pool's capacity.

Note: the mirror is kept only from what the scheduler asks for, never from a
device read. Every call goes through it (``admit``, ``decode``, ``step``, ``finish``,
``truncate``, ``rollback``, ``fork``, ``revive``, ``evict``), which calls the
table and updates the host integers in the same place, so they cannot drift
from what was asked. Each call checks all of its input first and raises before
the mirror changes: a refused call changes nothing, on the host or the device.
The checks include the table's and the pool's, with their messages: a count,
length or row is an int (numpy's too), never a float or a bool; a list or
array of them must be what numpy reads as integers within int64, so floats,
an array of bools, a list of bools only and an int past int64 are refused (a
bool among ints reads as 0/1, numpy's promotion); tensors' dtype, device and
layout; a free row for a ``fork`` or a ``revive``. What the mirror promises:

* ``free`` is a lower bound on the pool's FREE pages (what ``extend`` and
  ``fork`` take; ``extend`` never evicts). It is exact (``exact`` is True and
  ``free == pool.available()``) while nothing is shared, cached-and-evicted,
  revived or rolled back by a device-known amount. Otherwise it may
  under-promise, never over-promise: a release credits only the pages past a
  request's possibly-shared prefix, a device-decided rollback credits none,
  an eviction credits at most the cached pages known for sure.
* ``cached`` is a lower bound on the CACHED pages (same rules).
* Per request, ``lo <= true length <= hi``; equal unless a rollback by a
  device-known count is not reconciled yet. Pages a request still needs are
  counted from ``hi`` (worst case), pages it frees from ``lo``.
* Reservations: ``reserved`` pages of ``free`` are set aside for the next
  ``lookahead`` tokens of every running request (capped by its ``max_len``).
  Admissions take only unreserved pages, so while every running request
  holds its full reservation, a ``decode`` of at most ``lookahead`` tokens
  per request cannot fail. ``decode`` refuses (``WouldNotFit``, before any
  device work) a step the mirror cannot prove fits; ``preemption`` names the
  requests to release first, lowest priority first. A row asked past its
  ``max_len`` is not such a step (no release makes it fit): ``preemption``,
  ``decode`` and ``step`` raise a plain ``ValueError`` naming it.
* Reconciliation (:meth:`snapshot`, :meth:`reconcile`) corrects the bounds to
  the device's truth at the snapshot plus what was asked since; see
  :mod:`tpool.scheduling.snapshot`.
"""

import numpy as np
import torch

from tpool import _checks
from tpool.kernels import layout as L
from tpool.scheduling._decode import (BAD_INPUT, EMPTY, NO_ROOM, PAST_MAX_LEN, decode_accounting, fill_lanes,
                                     finish_accounting, truncate_accounting)
from tpool.scheduling.accounting import Accounting, WouldNotFit, _bucket, _cdiv, _head, _int_array, _plain
from tpool.scheduling.mixed import MixedSteps
from tpool.scheduling.snapshot import MirrorSnapshot, reconcile

__all__ = ["HostMirror", "WouldNotFit"]


_WIDTHS_KEPT = 8  # step widths whose inputs a mirror keeps (HostMirror._lane_tensors, _lanes_run)


class HostMirror(MixedSteps, Accounting):
    """A :class:`tpool.PageTable` driven through a host mirror of the pool's capacity.

    Parameters
    ----------
    table : PageTable
        Empty when the mirror is made (checked when ``free`` is read here, the one sync
        point); afterwards change it, and its pool, only through the mirror: no other
        table on the pool, no pool call of your own.
    lookahead : int
        Tokens of growth reserved for every running request (k decode steps of one
        token = k; speculative steps of d drafts = k * (d + 1)). Default 1.
    free, cached : int, optional
        The pool's FREE and CACHED pages now. Default: read once here with
        ``pool.stats()`` (a sync point at construction, never again). Pass both for a
        fresh pool (``free=pool.num_pages, cached=0``) to read nothing at all.

    Example
    -------
    >>> pool = PagePool(8, page_size=4, device="cpu", backend="reference")
    >>> m = HostMirror(PageTable(pool, 4, 4), free=8, cached=0)
    >>> m.can_admit([8, 9, 9])         # 2 pages + 1 reserved, 3 + 0, then 3 more: no
    2
    >>> rows = m.admit([8, 9]); rows, m.free, m.reserved
    ([0, 1], 3, 1)
    >>> res = m.decode(rows)           # row 0 takes its reserved page; nothing new to reserve
    >>> m.free, m.reserved, m.pages_needed(0, 4), m.exact
    (2, 0, 1, True)
    >>> m.finish([1]); m.free          # its 3 pages are back
    5
    >>> m.free == pool.available()     # a sync point, to show the mirror is exact here
    True
    """

    def __init__(self, table, *, lookahead: int = 1, free: int | None = None, cached: int | None = None):
        lookahead = _checks.check_size(lookahead, "lookahead")
        if (free is None) != (cached is None):
            raise ValueError(f"free, cached: pass both or neither, got free={free!r}, cached={cached!r}")
        self.table, self.pool, self.device = table, table.pool, table.device
        self.last_fork = None  # the ForkResult of the last fork (its copy-on-write pair)
        self.last_admit = None  # the ExtendResult of the last admit (the prompts' slots)
        self.prefix_cache = None  # the PrefixCache on this mirror (set by it): its pages must not go FREE
        if free is None:  # the one sync point: read the counts, and check the table is empty
            s = self.pool.stats()
            free, cached = s["pages.free.current"], s["pages.cached.current"]
            if held := table.seq_lens.count_nonzero().item():
                raise ValueError(f"table: expected an empty table (the mirror counts every row from 0), got one "
                                 f"with {held} request(s) holding tokens")
        free, cached = _checks.check_size(free, "free"), _checks.check_size(cached, "cached")
        if free + cached > self.pool.num_pages:  # a mirror promising pages the pool lacks would over-promise
            raise ValueError(f"free, cached: expected the pool's FREE and CACHED pages, together at most its "
                             f"num_pages={self.pool.num_pages}, got free={free}, cached={cached}")
        # A request holds at most a row's pages and at most the pool's: past either it could never finish
        # (admitted, it would fill the pool, be preempted and never fit again), so its max_len is refused.
        ps, most, n = table.page_size, table.max_pages, self.pool.num_pages
        why = None if most <= n else (f"the pool's capacity ({n} page{'s' * (n != 1)} of {ps}: num_pages * "
                                      f"page_size; a row holds {most} pages)", "a PagePool with more pages")
        super().__init__(table.max_requests, ps, lookahead, min(most, n) * ps, free, cached, why)
        self.max_batch = self.pool.max_batch
        # Per running row, the leading pages a prefix cache may name (its insert: 0 for none). With the
        # cache on the mirror such rows, and those that may share pages (revived, forked, forked from),
        # are finished with cache=True only; a revive makes them possibly shared (it may take them).
        self.named = np.zeros(self.live.size, dtype=np.int64)
        # The inputs kept per width of admit and truncate (_lane_tensors) and finish (_kept_ids), and the
        # bound steps of decode and the mixed step per width, max_tokens and StepOut (_lanes_run), which
        # write the table's buffers of their shape: forgotten when the table drops that shape (_shape_dropped).
        self._decode_steps, self._truncate_inputs, self._release_inputs, self._extend_inputs = {}, {}, {}, {}
        table._shapes.on_drop(self._shape_dropped)
        # On the numba backend a snapshot is one compiled copy (``_decode.snapshot_copy``) of the pool's
        # counters and the table's lengths at the addresses of the backend's descriptors (what its kernels
        # write), with the lengths' count: (counters address, count, lengths address, count); else None.
        at = getattr(table.ops, "addresses", None)
        self._snap_at = None if at is None or self.pool.backend != "numba" else \
            (*at("SD_COUNTERS"), L.NUM_COUNTERS, *at("TD_SEQ_LENS", "TD_REQUESTS"))

    # ------------------------------------------------------ calls (table + mirror)
    def _tensor(self, values, dtype=np.int32):
        """Host ints as a ``dtype`` tensor on the table's device (pinned, non-blocking: no wait for the stream)."""
        t = torch.from_numpy(np.ascontiguousarray(values, dtype=dtype))
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _kept_ids(self, kept, w, n=1):
        """The ``n`` int32 arrays of ``w`` entries ``kept`` holds for width ``w`` (made the first time),
        and their tensors on the table's device (on a CPU, the same memory): ``(host, dev)`` tuples.

        Consecutive calls of one width then pass the table the same tensor objects, which it finds
        checked, instead of checking new tensors every call (``truncate``, ``finish``). The next call
        of that width rewrites them. At most ``_WIDTHS_KEPT`` widths are kept, the first made dropped first.
        """
        entry = kept.get(w)
        if entry is None:
            host = tuple(np.empty(w, np.int32) for _ in range(n))
            with torch.inference_mode(False):  # normal tensors whatever the caller's mode: later calls copy_ into them
                dev = tuple(map(torch.from_numpy, host)) if self.device.type == "cpu" else \
                    tuple(torch.empty(w, dtype=torch.int32, device=self.device) for _ in host)
            entry = self._keep(kept, w, (host, dev) if n > 1 else (host[0], dev[0]))
        return entry

    def _lane_tensors(self, kept, ids, values):
        """``ids`` and ``values`` (int64 numpy ``[w]``: a call's request ids and its per-lane lengths)
        written into the two int32 tensors ``kept`` holds for width ``w`` (``_kept_ids``), which it returns."""
        host, dev = self._kept_ids(kept, ids.shape[0], 2)
        self._fill(host, dev, ids, values, 0, EMPTY, EMPTY)
        return dev

    def _lanes_run(self, dkey, w, max_tokens, out, r, n, each, prompts=EMPTY, new=EMPTY):
        """The table's bound step of ``w`` lanes and ``max_tokens`` slots (writing ``out``, a checked
        ``StepOut``, or the table's buffers), its inputs holding these lanes: the decode rows ``r``
        taking ``n`` tokens each (``n`` int64 ``[b]``, or EMPTY and ``each``), then the ``new`` rows
        with their ``prompts``, then padding (``_decode.fill_lanes``, one compiled loop). Kept per
        ``(w, max_tokens, out)`` (``table.bind_step(batch=w, ...)``, at most ``_WIDTHS_KEPT``); on a
        CPU its inputs are numpy arrays the step reads, written here directly, so each ``run()``
        checks nothing and makes no torch call (the checks of two input tensors cost ~5 us a
        step when a forward pass has cooled the caches). ``dkey`` names the lanes (None: new ones
        every call): when it names those the bound step of ``out`` last ran, nothing is written.
        Returns ``(run, req_ids, num_tokens)``, the last two its inputs as tensors."""
        dkey = None if dkey is None else (w, max_tokens, dkey)
        last = self._decode_keys.get(out)  # per StepOut (None: the table's buffers): each keeps its batch
        if last is not None and dkey is not None and last[0] == dkey:
            return last[1]
        self._decode_keys.pop(out, None)  # the inputs are rewritten next: no key may name their old lanes
        key = (w, max_tokens, out)
        entry = self._decode_steps.get(key)
        if entry is None:
            run = self.table.bind_step(batch=w, max_tokens=max_tokens, out=out)
            with torch.inference_mode(False):  # (as _kept_ids': kept across calls of either mode)
                dev = tuple(torch.from_numpy(a) if isinstance(a, np.ndarray) else a
                            for a in (run.req_ids, run.num_tokens))
            host = (run.req_ids, run.num_tokens) if self.device.type == "cpu" else \
                tuple(np.empty(w, np.int32) for _ in dev)
            entry = self._keep(self._decode_steps, key, ((run, *dev), host))
        got, host = entry
        self._fill(host, got[1:], r, n, each, prompts, new)
        self._keep(self._decode_keys, out, (dkey, got))
        return got

    def _shape_dropped(self, key):
        """The table dropped call shape ``key`` (``max_shapes``): a decode bound step of that shape
        would keep writing buffers the table no longer returns, so it is made again when needed."""
        for k in [k for k, (got, _) in self._decode_steps.items() if got[0]._key == key]:
            del self._decode_steps[k]
        for out in [o for o, (_, got) in self._decode_keys.items() if got[0]._key == key]:
            del self._decode_keys[out]

    @staticmethod
    def _keep(kept, key, entry):
        """``entry`` kept under ``key`` among at most ``_WIDTHS_KEPT``, the first made dropped first."""
        if key not in kept and len(kept) >= _WIDTHS_KEPT:
            del kept[next(iter(kept))]
        kept[key] = entry
        return entry

    def _fill(self, host, dev, r, n, each, prompts, new):
        """The lanes (see ``_lanes_run``) written into the host arrays ``host``, then (off the CPU) into
        the device tensors ``dev``, from fresh pinned copies: a copy in flight never sees a later write."""
        if fill_lanes(host[0], host[1], r, n, each, prompts, new):
            raise AssertionError(f"HostMirror: {r.shape[0]} + {new.shape[0]} lanes do not fit a step of "
                                 f"{host[0].shape[0]} (checked before: a bug)")
        for h, d in zip(host, dev):
            self._to_device(h, d)

    def _to_device(self, host, dev):
        """Off the CPU, host array ``host`` copied into tensor ``dev`` from a fresh pinned copy (a copy in
        flight never sees a later write); on a CPU they are the same memory."""
        if self.device.type != "cpu":
            dev.copy_(torch.from_numpy(host).pin_memory(), non_blocking=True)

    def admit(self, prompt_lens, max_lens=None) -> list:
        """Admit requests with these prompts (one prefill ``extend``); returns their rows.

        Raises ``WouldNotFit`` unless ``can_admit`` says all of them fit. The prompts'
        pages and each request's reservation are taken from the unreserved pages. The table's
        :class:`~tpool.table_results.ExtendResult` is kept in :attr:`last_admit`: ``slots[:sum(prompt_lens)]``
        are where the prompts' K/V go, prompt after prompt, token after token (then ``-1``); device
        tensors, table-owned, overwritten by the next call of the same shape. A prompt
        that can never fit (longer than its max_len, or a max_len past ``capacity``: a row's
        tokens, or the pool's when it holds fewer pages than a row) or ``max_lens`` not one
        per prompt is a plain ``ValueError``, raised before anything changes.
        """
        p, lim = self._prompts(prompt_lens, max_lens)
        k = p.size
        costs = self._costs(p.tolist(), lim.tolist(), self.max_batch)  # (checked above)
        if self._fit(costs, self.unreserved) < k:
            need = f"{sum(costs)} pages with their reservations" if len(costs) == k else f"{k} rows"
            raise WouldNotFit(f"admit: prompts {_head(p)} do not all fit: they need {need}, {self.rows_free} "
                              f"rows and {self.unreserved} unreserved pages are free (ask can_admit first)")
        if k == 0:
            return []
        self._seq += 1
        self._full = None
        rows = self._take_rows(k)
        r = np.array(rows, dtype=np.int64)
        self._start_new(r, p, lim)
        ids, ntok = self._lane_tensors(self._extend_inputs, r, p)
        self.last_admit = self.table.extend(ids, ntok, max_tokens=_bucket(sum(p.tolist()), self.table.most_tokens))
        return rows

    def decode(self, rows, n=1, out=None, *, run: bool = True):
        """One table step appending ``n`` tokens (an int, or one per row) to each running row.

        Pages come from each row's reservation first, then from the unreserved ones;
        raises ``WouldNotFit`` (before any device work) when the mirror cannot prove the
        step fits, so every lane of the step succeeds and ``ok`` need not be read. Then
        tops reservations back up, in the order of ``rows``. The step is the table's
        ``bind_step(batch=len(rows))`` for that width (kept, see ``_lanes_run``): the same
        outputs as ``table.step`` of that shape. Returns the ``StepResult`` (None for no rows).
        A row that ``n`` more tokens would take past its max_len is a plain ``ValueError``
        naming the rows (no preemption makes it fit), raised before anything changes.

        ``out``: a ``StepOut`` of this table (``table.step_out``) to write instead of the
        table's buffers, the lanes padded to its batch: two taking turns keep step N's
        outputs intact while step N+1 is made (overlap scheduling). Rows more than its
        batch, tokens more than its ``max_tokens``, or pages more than its ``capacity``
        (the rows' pages after the step, from their upper bounds ``hi``) are a
        ``ValueError`` before the mirror changes. Returns ``out.result``, also for no rows
        (then a step of padding lanes only: ``out`` holds no lane of an earlier step).

        ``run=False`` books the tokens without making a step, for steps a captured CUDA graph
        replays (k replays of a one-token step: ``n=k``; with ``lookahead >= k`` their pages
        are set aside already). Same checks and the same accounting (``WouldNotFit`` before
        the replays, if it cannot prove they fit), then no device work; returns None. The
        caller's contract: the replays are this table's steps of exactly these rows and
        tokens, and they are launched before any other call on the mirror (more ``run=False``
        bookings excepted), ``snapshot`` and a prefix cache's calls included: the mirror
        counts the rows at their booked lengths from now on, so a ``finish``, ``truncate``,
        ``fork`` or snapshot between the booking and its replays would act on lengths the
        device does not have yet (``reconcile`` raises ``MirrorError``, or the replays step a
        row that was given to another request). A snapshot's reconciliation finds it only where
        the lengths show it: not for a row whose ``rollback`` is not reconciled yet when its
        bounds are ``n`` or more tokens apart (the length before the replays is then within
        them too), and the mirror then promises the pages the replays take. Reconcile such a
        row before booking its replays where the order is not certain.
        """
        run = _checks.flag(run, "run")
        r, n, key = self._batch(rows, n)
        if out is not None:
            if not run:
                raise ValueError("decode: out= writes the step the mirror makes; run=False makes none")
            self._out_lanes(out, r, n)
        elif not r.size:
            return None
        acct = self._acct
        per_row = n.ndim > 0
        each = 0 if per_row else int(n)  # the tokens of every row when n is one number
        code = decode_accounting(self._st, r, n if per_row else EMPTY, each, self.page_size, self.lookahead,
                                 self.unreserved, acct)
        if code == BAD_INPUT:
            raise AssertionError(f"HostMirror.decode: rows {_head(r)} outside the books (checked before: a bug)")
        if code == PAST_MAX_LEN:
            self._refuse_past_max_len("decode", r, n)
        if code == NO_ROOM:
            need = self._need(r, n)
            raise WouldNotFit(f"decode: needs {int((need - np.minimum(need, self.res[r])).sum())} pages beyond "
                              f"reservations, {self.unreserved} unreserved "
                              f"({self._no_room_hint('ask preemption first')})")
        self._seq += 1
        taken, used, granted, full, uncertain = acct.tolist()
        if uncertain:
            self._free_inexact_at = self._seq
        self.free -= taken
        self.reserved += granted - used
        self._full = key if full else None
        if not run:
            return None
        dkey = (key, n.tobytes()) if per_row else (key, each)  # the lanes (plain ints: no numpy call)
        if out is not None:
            w, max_tokens = out.batch, out.max_tokens
        else:
            w = r.shape[0]
            max_tokens = _bucket(self._tokens(n, w), self.table.most_tokens) if per_row or each != 1 else None
        return self._lanes_run(dkey, w, max_tokens, out, r, n if per_row else EMPTY, each)[0]()

    def _out_lanes(self, out, r, n, prompts=EMPTY):
        """Refuse (``ValueError``) a ``StepOut`` that is not this table's or that the step does not
        fit: its lanes (the decode rows ``r``, then the ``prompts``) and tokens (``n`` per row, an
        int or one each, and the prompts'), and the pages its CSR will list (each decode row at
        ``hi + n`` tokens, each prompt at its length; a row past the table counted at
        ``max_pages``, which its max_len refuses next). Called before the mirror changes."""
        if getattr(out, "table", None) is not self.table or not hasattr(out, "result"):
            raise ValueError(f"out: expected a StepOut of this mirror's table (table.step_out), got {out!r}")
        lanes = r.size + prompts.size
        tokens = self._tokens(n, r.size) + (int(prompts.sum()) if prompts.size else 0)
        if lanes > out.batch or tokens > out.max_tokens:
            raise ValueError(f"out: the step has {lanes} lanes and {tokens} tokens, {out!r} holds at most "
                             f"{out.batch} and {out.max_tokens}")
        most = self.table.max_pages
        if lanes * most > out.capacity:  # else every lane fits (a row holds at most max_pages): no count
            ps = self.page_size
            pages = int(np.minimum(_cdiv(self.hi[r] + n, ps), most).sum()) + int(_cdiv(prompts, ps).sum())
            if pages > out.capacity:
                raise ValueError(f"out: the step's lanes hold up to {pages} pages (ceil(length / page_size) each "
                                 f"after the step, from the mirror's upper bounds), {out!r} holds at most "
                                 f"{out.capacity} page ids (table.step_out(..., capacity=))")

    def finish(self, rows, cache: bool = False) -> None:
        """Release these requests (``table.release``) and free their rows and reservations.

        With ``cache=True`` their pages become CACHED (``free`` is unchanged; ``cached``
        grows by the pages surely theirs alone). ``cache`` not a bool is a ``ValueError``,
        raised (as every check of every call) before the mirror changes; so is ``cache=False``,
        with a :class:`PrefixCache` on the mirror, for a row it inserted or one that may share
        pages (revived, forked, forked from): its named pages would go FREE, its entries stale.
        """
        cache = _checks.flag(cache, "cache")  # (the table's check, first)
        r, _, _ = self._batch(rows, 0)
        if not r.size:
            return
        if not cache and self.prefix_cache is not None:
            named = (self.named[r] > 0) | (self.shared[r] > 0)
            if named.any():
                raise ValueError(f"finish: rows {r[named].tolist()} may hold pages the prefix cache on this mirror "
                                 f"names (inserted, revived, forked, or forked from): cache=False would free them "
                                 f"FREE and leave its entries stale. Finish them with cache=True (PrefixCache.evict "
                                 f"frees CACHED pages and drops their entries)")
        self._seq += 1
        self._full = None
        host, dev = self._kept_ids(self._release_inputs, r.shape[0])
        acct = self._acct  # (one compiled loop: the books of every row, and the release's input)
        if finish_accounting(self._st, self.live, self.named, r, self.page_size, host, acct):
            raise AssertionError(f"HostMirror.finish: rows {r.tolist()} outside the books (checked before: a bug)")
        back, res, unsure = acct[:3].tolist()
        if cache:
            self.cached += back
            self._cached_flow += back
            if unsure:
                self._cached_inexact_at = self._seq
        else:
            self.free += back
            if unsure:
                self._free_inexact_at = self._seq
        self.reserved -= res
        self._members += 1
        self._free_rows.extend(r[::-1].tolist())
        self._to_device(host, dev)
        self.table._release(dev, cache)  # (the table's checks pass: its own kept tensor, <= max_batch rows)

    def shared_prefix(self, row: int) -> int:
        """Tokens at the head of running ``row`` held in pages it may share (revived, forked, or forked
        from) or, with a :class:`PrefixCache` on the mirror, that the cache names (inserted): what
        :meth:`truncate` and :meth:`rollback` (its ``min_lens``) must keep in mind.

        A length may not end inside one of those pages (its next token would be written into another
        request's K/V); with a prefix cache on the mirror it may not go below them at all (finish
        the row instead). A multiple of ``page_size``; 0 when nothing is shared. A bound, not a
        count of holders: a page stays "possibly shared" after the others let go of it, until the
        row is finished or cut below it.
        """
        self.length_bounds(row)  # (checks row: a running row)
        return int(self._kept_pages(row)) * self.page_size

    def _kept_pages(self, r):
        """How many head pages of rows ``r`` bound a truncate (:meth:`shared_prefix`): the possibly-shared ones
        (no length may end inside them) or, with a prefix cache on the mirror, those and the ones it names
        (no length may go below them)."""
        return self.shared[r] if self.prefix_cache is None else np.maximum(self.shared[r], self.named[r])

    def truncate(self, rows, new_lens) -> None:
        """Roll rows back to host-known lengths (``new_lens[i] <= `` the row's sure length, ``length_bounds``).

        Refused (``ValueError``, before any work): a length inside one of the row's possibly-shared
        pages, and, with a :class:`PrefixCache` on the mirror, any length below them
        (:meth:`shared_prefix`).
        """
        r, _, _ = self._batch(rows, 0)
        nl = _plain(_int_array(new_lens, "new_lens").reshape(-1))
        out, ps = self._acct, self.page_size
        if nl.shape == r.shape and self.prefix_cache is not None and ((nl >= 0) & (nl <= self.lo[r])).all():
            self._refuse_below_shared(r, nl, "new_lens")
        code = 1 if nl.shape != r.shape else truncate_accounting(self._st, r, nl, ps, self.lookahead,
                                                                 self.unreserved, out)
        if code == 3:
            raise AssertionError(f"HostMirror.truncate: rows {_head(r)} outside the books (checked before: a bug)")
        if code == 2:  # nothing written: name the rows (the same test as the accounting's)
            self._refuse_shared_ends(r, (nl >= 0) & (nl < self.hi[r]) & (nl % ps != 0) & (nl // ps < self.shared[r]),
                                     "new_lens")
        if code:
            raise ValueError(f"new_lens: expected one per row within [0, lo], got {_head(nl)} (lo {_head(self.lo[r])})")
        self._seq += 1
        self._full = None
        back, granted, unsure = int(out[0]), int(out[1]), int(out[2])
        self.free += back
        self.reserved += granted
        if unsure:
            self._free_inexact_at = self._seq
        self.exact_at[r] = self._seq
        self.table._truncate(*self._lane_tensors(self._truncate_inputs, r, nl), False)  # (as finish's release)

    def rollback(self, rows, new_lens: torch.Tensor, min_lens) -> None:
        """Truncate to lengths known only on the device (accepted speculative tokens).

        new_lens : torch.Tensor  shape ``[B]``, int32, on the table's device; the caller
            promises ``min_lens[i] <= new_lens[i] <= `` the row's length, which
            :meth:`reconcile` checks. The mirror assumes the worst case (nothing freed,
            length still ``hi``) until the next reconciliation releases the difference.
        min_lens : sequence of int, host-known lower bounds.
        """
        r, _, _ = self._batch(rows, 0)
        ml = _int_array(min_lens, "min_lens").reshape(-1)
        if ml.shape != r.shape or (ml < 0).any() or (ml > self.hi[r]).any():
            raise ValueError(f"min_lens: expected one per row within [0, hi], got {_head(ml)} (hi {_head(self.hi[r])})")
        # The table's checks of new_lens (metadata only, no sync), before the mirror changes.
        self.table._lane_vector(new_lens, "new_lens", r.shape[0])
        _checks.check_not_written(new_lens, "new_lens", self.table._written)
        # Any length in [min_lens, hi] may come out: none may end inside a possibly-shared page.
        ps = self.page_size
        if self.prefix_cache is not None:
            self._refuse_below_shared(r, ml, "min_lens")
        self._refuse_shared_ends(r, (ps > 1) & (ml < self.hi[r]) & (ml < self.shared[r] * ps), "min_lens")
        if not r.size:
            return   # nothing to roll back: free stays exact (no snapshot needed)
        self._seq += 1
        self._full = None
        self._free_inexact_at = self._seq
        self.lo[r] = np.minimum(self.lo[r], ml)
        self.uncertain_at[r] = self._seq
        self.table.truncate(self._tensor(r), new_lens)

    def _refuse_below_shared(self, r, lens, what):
        """With a prefix cache on the mirror, raise before the table call if a row would drop (or end
        inside) one of its possibly-shared pages (revived, forked, or forked from) or of the pages the
        cache names (inserted): if no one else holds it, the truncate frees the page FREE, not CACHED,
        and an entry naming it goes stale (its next hit is refused on the device as
        ``use_after_free``); a named page written again would hold other K/V than its entry says.
        ``shared`` is a bound, so this may refuse a page whose other holders are gone; such a row
        is finished, never cut below its prefix."""
        keep = self._kept_pages(r)
        below = lens < keep * self.page_size
        if below.any():
            raise ValueError(f"{what}: rows {r[below].tolist()} would drop pages they may share or that the "
                             f"prefix cache on this mirror names (their first {keep[below].tolist()} pages came "
                             f"from a revive or a fork, were forked from, or were inserted): freed by a "
                             f"truncate, its entries would go stale. Keep at least those pages' tokens "
                             f"({(keep[below] * self.page_size).tolist()}), or finish the row "
                             f"(insert it first, then finish(..., cache=True))")

    def _refuse_shared_ends(self, r, into, what):
        """Raise before the table call if a row would end inside one of its possibly-shared pages.

        Its next token would be written into a page that a fork or a revive shares (another
        request's K/V); the table refuses such a truncate as a ``bad_length``, and the mirror,
        which does not read the device, refuses it here first. ``shared`` is a bound: a row
        stays "possibly shared" after the other holder lets go, until it is truncated below.
        """
        if into.any():
            raise ValueError(f"{what}: rows {r[into].tolist()} would end inside a page they may share with "
                             f"another request (their first {self.shared[r][into].tolist()} pages came from "
                             f"a fork or a revive; the next token would overwrite its K/V). Truncate to a "
                             f"multiple of page_size ({self.page_size}) there, or past the shared pages")

    def fork(self, src: int, n_tokens: int, max_len: int | None = None, *, count_cached: bool = False) -> int:
        """A new request sharing the first ``n_tokens`` tokens of running ``src``; returns its row.

        Whole pages are shared; a partial last page is copied into a fresh page: the
        table's :class:`~tpool.table_results.ForkResult` is kept in :attr:`last_fork` (device
        tensors, table-owned) so the caller copies the KV of ``cow_src`` into ``cow_dst``.
        ``n_tokens`` must be within ``src``'s sure length. ``count_cached``: its reservation may
        be covered by the ``cached`` pages, as for :meth:`revive`; unlike revive, it reserves only the
        pages unreserved now, so a later ``decode`` or ``step`` of the row counts the rest as any
        row's growth. The copy-on-write page (a partial last page) is taken by the fork itself, so it
        comes from ``free``: with ``count_cached`` that may be a page reserved for another row when
        none is unreserved, which leaves ``unreserved`` one lower (-1 from 0; lower still after a
        ``count_cached`` revive) until :meth:`shortfall` pages are evicted, and no step runs before
        (``decode`` and ``step`` refuse it, naming the eviction); without ``count_cached``
        ``unreserved`` stays >= 0. A loop that evicts once after its admissions, as for revive,
        repays it there.
        """
        src, n_tokens = _checks.check_size(src, "src"), _checks.check_size(n_tokens, "n_tokens")
        ps, m = self.page_size, self.capacity if max_len is None else _checks.check_size(max_len, "max_len")
        if not (0 <= src < self.live.size and self.live[src]):
            raise ValueError(f"fork: expected a running src (an int in [0, {self.live.size}) that holds a request), "
                             f"got src={src}")
        if not n_tokens <= self.lo[src]:
            raise ValueError(f"fork: expected n_tokens at most src's sure length ({int(self.lo[src])} tokens, "
                             f"length_bounds(src)[0]), got n_tokens={n_tokens}")
        if not n_tokens <= m <= self.capacity:
            raise ValueError(f"fork: expected n_tokens <= max_len <= {self.capacity} (the mirror's capacity), got "
                             f"n_tokens={n_tokens}, max_len={max_len}")
        cow = int(n_tokens % ps != 0)
        room = self.unreserved + self._evictable(count_cached)
        if cow > self.free or cow + int(self._target_new(n_tokens, m)) > room:
            raise WouldNotFit(f"fork: needs {cow} page(s) now and a reservation, {self.free} free, {self.unreserved} "
                              f"unreserved")
        (row,) = self._take_rows(1)  # (WouldNotFit without a free row, before anything changes)
        self._seq += 1
        self._full = None
        self._start(np.array([row]), n_tokens, m, n_tokens // ps)
        self.shared[src] = max(int(self.shared[src]), n_tokens // ps)
        self.free -= cow
        self._top_up(np.array([row]))
        self.last_fork = self.table.fork(self._tensor([src]), self._tensor([row]), self._tensor([n_tokens]))
        return row

    def revive(self, pages: torch.Tensor, n_tokens: int, max_len: int | None = None, *,
               generations: torch.Tensor | None = None, count_cached: bool = False) -> int:
        """A new request on cached pages (a prefix-cache hit): ``table.revive`` them into a fresh row.

        pages : torch.Tensor  shape ``[n_tokens / page_size]``, int32, on the table's
            device, each page once and no -1 (no padding). They are revived into the row by one
            table call (:meth:`PageTable.revive`: one kernel call on numba, one launch on triton);
            the mirror counts them as possibly shared.
        generations : torch.Tensor, optional  shape ``[n_tokens / page_size]``, int32, on the
            table's device: the pages' generations (``pool.generations``) recorded with the
            prefix-cache entry; a page whose generation changed since (freed) is not taken.
        count_cached : bool
            Its reservation may come from the ``cached`` pages (those it revives not counted):
            ``unreserved`` may then be negative until the caller evicts :meth:`shortfall` pages,
            and no step runs before (``decode`` and ``step`` refuse it: ``WouldNotFit``). For a
            loop whose admissions count CACHED pages as room (``can_admit(count_cached=True)``),
            which evicts once, after its revives.

        Only whole pages are revived (``n_tokens`` a multiple of ``page_size``), as a prefix
        cache shares only full blocks: the request's next token goes to a fresh page, never
        into a page another revive of the same prefix also holds.

        The caller's contract: every page is CACHED (released with ``cache=True`` and not
        evicted since: the pool hands out only FREE pages, so a CACHED page keeps its
        content), or USED only by requests that hold it within their possibly-shared prefix
        (those that came from ``revive`` or ``fork`` of it, and the ``src`` of such a fork). A
        page that a running request holds alone past that prefix must not be revived: that
        request's release would credit it. Drop a prefix-cache entry when ``evict`` returns
        one of its pages.

        What is found when the contract is broken, without a host read: the table call reads
        the pages' states on the device (and counts each page's occurrences, to find one
        named twice), and unless every page is USED or CACHED and named once, the revive
        takes none of them, and the row stays empty (length 0, no page), so no later
        admission can be handed a page this row holds. The refused entries are counted as
        ``pool.incref`` counts them: a page evicted and FREE now as ``use_after_free``, an id
        outside the pool as ``invalid_page``; a ``-1`` (a prefix has no padding) and each entry
        naming a page an earlier one names as ``invalid_page`` too (``pool.check()`` raises
        them). In every case the mirror, which cannot see it,
        counts the row at ``n_tokens``; the next :meth:`reconcile` raises ``MirrorError``
        naming the row (its true length 0 below its bounds). ``finish`` it: its release frees
        only what it appended since. A page evicted and then handed to another request is USED again, which its
        state cannot tell from a page shared by a ``revive`` or ``fork``; its generation can
        (each page's grows every time it becomes FREE). With ``generations`` such an entry is
        refused as above, each such page counted as ``use_after_free``, and the request that
        holds the page now is untouched. Without them it is revived, two requests share it,
        and that is found only if the other request releases it first (its release credits a
        page this row still holds: the next reconciliation raises ``MirrorError``), else not
        at all.
        """
        n_tokens, m = self._revive_lengths(n_tokens, max_len)
        k = self.table._revive_inputs(pages, n_tokens, generations)  # the table's checks, before the mirror changes
        return self._revive(pages, n_tokens, m, k, generations, count_cached)

    def _revive_lengths(self, n_tokens, max_len) -> tuple:
        """:meth:`revive`'s checks of ``n_tokens`` and ``max_len``; returns them as ints (``max_len``'s default
        filled in)."""
        n_tokens = _checks.check_size(n_tokens, "n_tokens")
        ps, m = self.page_size, self.capacity if max_len is None else _checks.check_size(max_len, "max_len")
        if not n_tokens <= m <= self.capacity:
            raise ValueError(f"revive: expected 0 <= n_tokens <= max_len <= {self.capacity}, got {n_tokens}, {m}")
        if n_tokens % ps:
            raise ValueError(f"revive: expected whole pages (n_tokens a multiple of page_size {ps}), got "
                             f"{n_tokens}: a revived page may be shared, and the next token would be written "
                             f"into a partial last one. Revive the whole pages and extend the rest")
        return n_tokens, m

    def _revive(self, pages, n_tokens, m, k, generations, count_cached) -> int:
        """:meth:`revive` of checked inputs (``m`` the max length, ``k = n_tokens / page_size`` the pages,
        the length of ``pages`` and ``generations``): a ``PrefixCache`` on a numba pool passes its own
        gather buffers, plain int32 tensors of its making that it need not check again."""
        room = self.unreserved + max(self._evictable(count_cached) - k, 0)
        if (need := self._target_new(n_tokens, m)) > room:
            cached = f" and {room - self.unreserved} of the CACHED pages it does not revive" if count_cached else ""
            raise WouldNotFit(f"revive: its reservation needs {need} page(s), {room} can be taken ({self.unreserved} "
                              f"unreserved{cached}): preempt, evict or wait")
        (row,) = self._take_rows(1)  # (WouldNotFit without a free row, before anything changes)
        self._seq += 1
        self._full = None
        if self.prefix_cache is not None:  # it may take pages a running row was inserted with: shared now
            np.maximum(self.shared, self.named, out=self.shared)
        self._start(row, n_tokens, m, k)  # (one row: scalar writes, no index array)
        self.cached = max(self.cached - k, 0)
        self._cached_flow -= k
        self._cached_inexact_at = self._seq
        # _top_up of the one new row, in ints: a free row reserves nothing (finish zeroes it), and its
        # target is ``need``, which fits (checked above).
        self.res[row] = need
        self.reserved += need
        self.table._revive(row, pages, generations)  # all or none, on the device; only this row's runs are forgotten
        return row

    def evict(self, k: int) -> torch.Tensor:
        """``pool.evict(k)``: turn up to ``k`` cached pages FREE; returns their ids (device, -1 padded).
        With a :class:`PrefixCache` on the mirror, refused (``ValueError``): evict through it, which
        forgets the entries naming the evicted pages."""
        if self.prefix_cache is not None:
            raise ValueError("evict: this mirror has a PrefixCache, whose entries would go on naming the "
                             "evicted pages: call its evict(k) instead (PrefixCache.detach() to go without one)")
        return self._evict(k)

    def _evict(self, k: int) -> torch.Tensor:
        """:meth:`evict` without the prefix-cache check (the cache's own evict)."""
        k = _checks.check_size(k, "k")  # before the mirror changes: a refused call changes nothing
        self._seq += 1
        self._full = None
        got = min(k, self.cached)
        self.free += got
        self.cached -= got
        if self.cached_exact:
            self._cached_flow -= got
        else:   # the device may evict up to k, more than the mirror knew of
            self._cached_flow -= k
            self._free_inexact_at = self._cached_inexact_at = self._seq
        return self.pool.evict(k)

    # ------------------------------------------------------ reconciliation
    def snapshot(self) -> MirrorSnapshot:
        """Start a non-blocking copy of the pool's counters and the table's lengths."""
        return MirrorSnapshot(self)

    def reconcile(self, snap: MirrorSnapshot) -> dict:
        """Correct the mirror to the truth of ``snap`` plus what was asked since; returns its stats."""
        return reconcile(self, snap)
