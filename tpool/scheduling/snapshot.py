"""Reconciling a HostMirror with the device, without a stall.

Note: what "truth" is. A snapshot copies, without waiting, the pool's counters
and the table's ``seq_lens`` as they are after every call issued before it
(stream order), and notes the mirror's own numbers at that moment. The truth
it brings back:

* ``free``: pages on the pool's free stack (``pages.free.current``), what
  ``extend`` and ``fork`` can take. Cached pages are not in it, and a page
  shared by several requests is one USED page until its last holder lets go.
* ``cached``: pages in state CACHED (``pages.cached.current``), which only an
  eviction turns FREE.
* per request: its true length, which settles a device-decided ``rollback``.

``reconcile`` sets each number to ``truth at the snapshot + what the mirror
itself changed since`` (the changes since are bounds of the same kind, so the
result is still a safe bound, and exact when nothing inexact was asked since).
"What the mirror changed since" leaves out the corrections other reconciliations
made since (of snapshots taken before this one, whose truth this one's already
holds): the mirror keeps running totals of the corrections it applied (to
``free``, and to each row's ``hi``), a snapshot notes them, and a reconciliation
takes back those applied since its snapshot before it applies its own. So
several snapshots may be in flight (one per step, as an overlap loop takes
them) and be reconciled in order. A snapshot taken no later than the last one
reconciled (that one again, an older one, or another taken before the next
mirror call) changes nothing: snapshots may be applied in any order, any
number of times.
It does not learn which pages are shared (that would take the reference
counts): a request's possibly-shared prefix stays as it was, so its release
keeps under-crediting until the next reconciliation. A truth below the
mirror's number means the mirror over-promised (a bug, or a broken contract:
a ``rollback`` below its ``min_lens``, a ``revive`` that named a page neither
USED nor CACHED, or one page twice, which leaves its row empty, a release
crediting a page that a revive of it still holds, a table call made around the
mirror); ``reconcile`` raises :class:`MirrorError`. A revived page that was
evicted and handed to another request since is not found here (see
``HostMirror.revive``).
A reconciliation that settles a row's length trims the reservation that was
sized from its wider bounds, but never below the pages its next ``lookahead``
tokens need nor those a ``reserve`` set aside.
"""

import weakref

import numpy as np

from tpool.kernels import layout as L
from tpool.scheduling._decode import HI, LO, reconcile_check, reconcile_rows, snapshot_copy
from tpool.stats_async import AsyncRead, stats_from_counters


_RECOVER = ("The mirror is left as it was, but its promises are wrong: call pool.check() (it raises the "
            "device-counted error behind most of these), stop admitting, finish the running rows (and "
            "table.release any row a call around the mirror filled), and make a new HostMirror(table) once the "
            "table is empty (it reads the pool's counts then).")


class MirrorError(RuntimeError):
    """The device holds less than the mirror promised (found at reconciliation). The message says what
    differs and how to recover (``pool.check()``; finish the rows named, or all of them and make a new mirror)."""


class MirrorSnapshot:
    """A started copy of the pool's counters and the table's lengths (:meth:`HostMirror.snapshot`).

    ``ready()`` never waits; ``stats()`` is the pool's ``stats()`` dict at the snapshot.
    """

    def __init__(self, mirror):
        self.mirror = weakref.ref(mirror)   # reconcile takes it on this mirror only
        self.num_pages = mirror.pool.num_pages
        self.seq, self.free, self.cached = mirror._seq, mirror.free, mirror.cached
        self.cached_flow = mirror._cached_flow
        self.free_fix = mirror._free_fix  # corrections applied so far (and hi_fix, per row)
        self._values = None
        if mirror._snap_at is not None:  # the numba backend: one compiled copy of everything, done at once
            with mirror.pool.state.lock:
                counters, lens, self.st, self.live, self.hi_fix = snapshot_copy(*mirror._snap_at, mirror._st,
                                                                                mirror.live, mirror._hi_fix)
            self._read, self._values = None, (counters.tolist(), lens)
            return
        with mirror.pool.state.lock:  # both copies between two calls, as the pool's sync points read
            self._read = AsyncRead([mirror.pool.state.counters, mirror.table.seq_lens])
        self.hi_fix = mirror._hi_fix.copy()
        self.st, self.live = mirror._st.copy(), mirror.live.copy()  # every row's record (lo, hi, ..., gen)

    def ready(self) -> bool:
        return self._read is None or self._read.ready()

    def _get(self):
        """``(counters, lens)``: the pool's counters (a list of ints) and the table's lengths (numpy, int32)."""
        if self._values is None:
            counters, lens = self._read.host()
            self._values = counters.tolist(), lens.numpy()
        return self._values

    def stats(self) -> dict:
        return stats_from_counters(self.num_pages, self._get()[0])


def reconcile(m, snap: MirrorSnapshot) -> dict:
    """Correct mirror ``m`` from ``snap`` (see the module note); returns the snapshot's stats.

    Checks everything before it changes anything: a ``MirrorError`` leaves the mirror as it was.
    """
    if not isinstance(snap, MirrorSnapshot) or snap.mirror() is not m:
        # Another mirror's op numbers and bounds (a new mirror made while the old one's snapshot was on
        # its way): taken here, its truth would pass as this mirror's and leave it promising pages
        # the device does not have, still "exact".
        got = type(snap).__name__ if not isinstance(snap, MirrorSnapshot) else "a snapshot of another mirror"
        raise ValueError(f"snap: expected a snapshot this mirror took (mirror.snapshot()), got {got}")
    counters, lens = snap._get()
    if snap.seq <= m._reconciled_at:
        # Taken no later than the last snapshot reconciled (that one again, an older one, or another
        # taken at the same mirror call): its truth is in the mirror already.
        return stats_from_counters(snap.num_pages, counters)
    true_free, true_cached = int(counters[L.FREE_COUNT]), int(counters[L.CACHED_COUNT])
    # The mirror's numbers at the snapshot, with the corrections made since (of older snapshots,
    # whose truth this one's holds): what it promised then, by what it knows now.
    free_then = snap.free + (m._free_fix - snap.free_fix)
    if true_free < free_then or true_cached < snap.cached:
        raise MirrorError(f"the mirror promised {free_then} free and {snap.cached} cached pages, the device had "
                          f"{true_free} and {true_cached} (a call made around the mirror, or a broken contract). "
                          + _RECOVER)
    # Lengths: every row must lie within the bounds the mirror had at the snapshot (0 for a row
    # not running then), its upper bound corrected since as above. (One compiled loop per pass:
    # the numpy version took ~15 array operations, ~100 us when a forward pass has cooled the caches.)
    bad = reconcile_check(snap.st, snap.live, m._hi_fix, snap.hi_fix, lens)
    if bad != -1:
        lo = np.where(snap.live, snap.st[:, LO], 0)
        hi = np.where(snap.live, snap.st[:, HI] + m._hi_fix - snap.hi_fix, 0)
        bad = np.flatnonzero((lens < lo) | (lens > hi)) if lens.shape == lo.shape else np.arange(0)
        raise MirrorError(f"rows {bad.tolist()[:8]}: true lengths {lens[bad].tolist()[:8]} outside the mirror's "
                          f"bounds [{lo[bad].tolist()[:8]}, {hi[bad].tolist()[:8]}] (a rollback below min_lens, a "
                          f"revive naming a page neither USED nor CACHED, one twice, or one of another generation "
                          f"than recorded, which leaves its row empty, or a table call made around the mirror?). "
                          f"Call pool.check() (the device-counted error behind it), finish those rows (their tokens "
                          f"since are wrong: prefill them again) and reconcile a snapshot taken after that"
                          if bad.size else f"lengths: expected one per table row ({lo.size}), got {lens.shape}")
    m._reconciled_at = snap.seq
    fix = true_free - free_then
    m.free += fix
    m._free_fix += fix
    m._full = None
    m.cached = max(true_cached + m._cached_flow - snap.cached_flow, 0)
    if m._free_inexact_at <= snap.seq:
        m._free_inexact_at = -1
    if m._cached_inexact_at <= snap.seq:
        m._cached_inexact_at = -1
    # The rows running then and now, not set outright since, with a bound to settle: hi becomes
    # the truth plus what was asked since; those not rolled back since are settled (lo = hi), their
    # reservations, sized from the wider bounds, trimmed to what their next lookahead tokens and
    # the tokens a reserve() set pages aside for need.
    back = reconcile_rows(m._st, m.live, m.exact_at, m.uncertain_at, m.reserved_to, m._hi_fix, snap.st, snap.live,
                          snap.hi_fix, lens, snap.seq, m.page_size, m.lookahead)
    if back < 0:
        raise AssertionError("reconcile: the snapshot's rows are not the mirror's (checked before: a bug)")
    m.reserved -= back
    return stats_from_counters(snap.num_pages, counters)
