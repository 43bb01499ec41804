"""PrefixCache: whole pages of finished requests kept CACHED and found again by their tokens.

Note: this is automatic prefix caching (vLLM's, SGLang's radix cache) on a
:class:`~tpool.scheduling.HostMirror`. A request leaving the loop (finished or
preempted) is ``insert``-ed before its ``finish(..., cache=True)``: each of its
whole pages becomes an entry, keyed by (the entry of the page before it, the
page's tokens), so a key stands for the whole prefix up to the end of its page
and keys are compared exactly (no hash collision can hand out another prefix's
K/V). A new request whose tokens start with entries ``revive``-s their pages
into its row (one table call) and computes only the rest.

The host never learns a page id, so nothing here reads the device. An entry is
a slot of three device tensors: the slot's page and its generation when the
entry was made (``slot_page``, ``slot_gen``), and for each page the slot that
names it (``page_slot``). ``insert`` fills them by device copies from the
table's row; ``revive`` gathers them. The pool evicts (least recently released
first, decided on the device): ``evict`` turns CACHED pages FREE and, on the
device, gathers and forgets the slots that named them; the caller reads those
slots (``unread``) at its next host read, packed into the same copy, and hands
them to ``drop``. Until then the host index still names evicted pages, so no
hit may be revived between an ``evict`` and that read: ``match`` finds nothing
while an eviction is unread. A loop that evicts after its revives, right before
its step, loses no hit. Generations are the second line: a revive of a page
freed since its entry was made is refused on the device (``use_after_free``,
raised by the next ``pool.check()``), never shared; so is one whose page does not
name the entry's slot back (``page_slot``: a hand-edited ``slot_page``).

An entry is dropped with every entry under it (a lookup walks from the first
page, so they could never be reached again), and a page is named by one entry at
most. A request that computed a known prefix apart (two requests with one system
prompt prefilled in one step), or revived it, names its own copy: its ``insert``
re-points the prefix's entries to its pages (the same K/V; the entries keep their
slots and ids, so the entries under them and matches made before stay valid).
The copy named is the one inserted last, released last when requests are inserted
in the order they finish, so the copies named by nothing are evicted first, and
the prefix, with every entry under it, stays while the named copy does. But an
insert leaves alone the leading entries a running reviver holds (a row that revived
them and was not inserted since: the host records it at ``revive``, and its own insert
ends the hold): the reviver's copy stays named, and the inserted row's, named by
nothing, is evicted first, so the prefix stays matchable while the reviver runs.

The caller's contract: ``insert`` a request just before its ``finish(...,
cache=True)`` and with the tokens its pages hold (host ints). A named page going
FREE any other way would leave a stale entry, whose next hit the generations refuse
on the device (``use_after_free``: that request's tokens are then computed without
its prefix), so the mirror, once a cache is on it, refuses before any work: cutting
a row below pages it revived, forked or was forked from (``truncate``, ``rollback``),
``finish`` without ``cache=True`` of such a row or one inserted here, and its own
``evict`` (evict through :meth:`evict`). One mirror takes one cache (:meth:`detach`
takes it off). A row inserted while it keeps running is counted as possibly sharing
its named pages from the next revive on (which may take them), as a forked-from row.
A :class:`PrefixMatch` is used at once: ``revive`` refuses one whose entries were
dropped since (their slots may name other pages by then).
"""

import collections.abc
import itertools
import operator
from dataclasses import dataclass

import numpy as np
import torch

from tpool import _checks
from tpool.kernels import layout as L
from tpool.scheduling._decode import GEN
from tpool.scheduling._prefix import forget_pages, gather_slots, insert_pages
from tpool.scheduling.accounting import _head
from tpool.scheduling.mirror import HostMirror
from tpool.state import fixed_full

__all__ = ["PrefixCache", "PrefixMatch"]

_ROOT = 0  # the entry id before a prompt's first page
# Entry ids, drawn by every cache from one count: a match made by one cache never names another's entries
# (a cache made again on the same mirror hands out the same slots in the same order).
_EIDS = itertools.count(_ROOT + 1)


_INTS = frozenset((int,))  # token types whose pages need no closer look (numpy scalars take the slow check)


def _host_ints(tokens, what) -> list:
    """``tokens`` (a list or tuple whose items are not all ``int``) as Python ints (``operator.index``:
    numpy integers and bools pass), or ``ValueError``: a tensor, a float (``2.0`` too: token ids are
    integers, as a float numpy array is refused), an array or anything else that is not an integer.
    An array failed to hash half-way through an ``insert``, after the pages before it were named."""
    if any(isinstance(t, torch.Tensor) for t in tokens):
        raise _tensor_tokens(what)
    out = []
    for t in tokens:
        try:
            out.append(operator.index(t))
        except TypeError:
            kind = type(t).__name__ if type(t).__module__ == "builtins" else f"{type(t).__module__}.{type(t).__name__}"
            raise ValueError(f"{what}: expected the tokens as host ints (a list, tuple or numpy int array), got "
                             f"{kind} {t!r:.60}") from None
    return out


def _tensor_tokens(what):
    return ValueError(f"{what}: expected the tokens as host ints (a list, tuple or numpy int array), got tensors: "
                      f"pass tokens.tolist() (a host read if it is on a device)")


@dataclass(frozen=True)
class PrefixMatch:
    """The entries a request's tokens start with: ``slots`` in page order, ``n_tokens`` they hold,
    ``eids`` the entries' ids (``revive`` checks them: a slot may be reused after a drop)."""

    slots: tuple = ()
    n_tokens: int = 0
    eids: tuple = ()

    def __bool__(self):
        return bool(self.slots)


class PrefixCache:
    """A prefix cache of whole pages for a loop that schedules on ``mirror``.

    Driven from one thread, the loop's, as its mirror is: the host index and the buffers a
    revive gathers into on the numba backend are not locked (the device updates run under the
    pool's lock, as every table call does).

    Parameters
    ----------
    mirror : HostMirror
        The loop's mirror: ``revive`` and ``evict`` go through it, so its counts stay true.
    capacity : int, optional
        Entries (one page each) the index holds; default the pool's ``num_pages`` (a page is
        named by at most one entry, so no more can be live).

    Example
    -------
    >>> pool = PagePool(16, page_size=4, device="cpu", backend="reference")
    >>> m = HostMirror(PageTable(pool, 4, 8), free=16, cached=0)
    >>> cache = PrefixCache(m)
    >>> tokens = list(range(10))
    >>> row = m.admit([10])[0]                     # prefill 10 tokens (their K/V written by the model)
    >>> cache.insert(row, tokens)                  # its 2 whole pages become entries ...
    2
    >>> m.finish([row], cache=True)                # ... and stay CACHED
    >>> hit = cache.match(tokens + [7, 7])         # a later request that starts with them
    >>> hit.n_tokens
    8
    >>> row = cache.revive(hit, max_len=16)        # its first 8 tokens' pages, no prefill
    """

    def __init__(self, mirror, capacity: int | None = None):
        if not isinstance(mirror, HostMirror):
            raise ValueError(f"mirror: expected a HostMirror, got {type(mirror).__name__} {mirror!r:.60}")
        table = mirror.table
        if mirror.prefix_cache is not None:
            raise ValueError("mirror: expected a HostMirror without a prefix cache, got one that has one (its "
                             "evictions would leave this cache's entries stale)")
        self.mirror, self.table, self.pool = mirror, table, table.pool
        self.page_size, self.device = table.page_size, table.device
        n = self.pool.num_pages if capacity is None else _checks.check_size(capacity, "capacity")
        # slot_page: each live slot's page (a dropped slot keeps its last); slot_gen: the page's generation
        # when the entry was made; page_slot: each page's slot, -1 for none, and one more entry, for the
        # -1 padding of an evict result. On the numba backend they are views of numpy arrays the compiled
        # updates take (``_prefix``), which read the table's block_table and the pool's page_gen where the
        # backend's own kernels do: at the addresses of its descriptors (checked and held when the table
        # was made; a tensor re-pointed since, by ``set_`` or assignment, is not followed by either).
        sizes = (n, n, self.pool.num_pages + 1)
        # Elsewhere (reference, triton) the updates read the block table and page_gen the table's backend
        # holds (tpool.state.held_view: a tensor re-pointed by hand is followed by neither).
        self._bt, self._gen, self._sl = table.ops.ts.block_table, table.ops.st.page_gen, table.ops.ts.seq_lens
        self._np = self._at = None
        at = getattr(table.ops, "addresses", None)
        # (fixed_full: as the pool's state, never an inference tensor, whatever mode the cache is made in)
        self.slot_page, self.slot_gen, self.page_slot = (fixed_full(k, -1, torch.int32, self.device) for k in sizes)
        if self.pool.backend == "numba" and at is not None and at("SD_PAGES") == (self.pool.num_pages,):
            self._np = (self.slot_page.numpy(), self.slot_gen.numpy(), self.page_slot.numpy())
            self._at = at("TD_BLOCK_TABLE", "TD_REQUESTS", "TD_MAX_PAGES", "SD_PAGE_GEN", "SD_PAGES", "TD_SEQ_LENS")
            # revive's gather: its pages and generations, one pair of int32 views per length (made once)
            self._gather_np, self._gathered = np.empty((2, table.max_pages), dtype=np.int32), {}
        # Every update gets the tensors the cache made, not whatever its attributes name later, their
        # sizes checked first (_made): the kernels, the torch code (a drop's let-go on every backend).
        self._dev = (self.slot_page, self.slot_gen, self.page_slot)
        self._ptrs = tuple(t.data_ptr() for t in self._dev)  # (numba's _np stay on this memory: _made)
        # On the triton backend each update is one launch (tpool.kernels.prefix_cache), imported only
        # there: the numba backend runs without triton installed.
        self._kernels = None
        if self.pool.backend == "triton":
            from tpool.kernels import prefix_cache as kernels
            self._kernels = kernels
        self._index = {}                  # (parent entry id, page tokens) -> slot
        self._keys = [None] * n           # slot -> its key (None: free)
        self._eid = [_ROOT] * n           # slot -> its entry id (never reused: a match made before a drop is seen)
        self._free = list(range(n - 1, -1, -1))
        self._held = []                   # slots dropped while an eviction is outstanding: reused after it
        self._moved = set()               # known slots an insert re-pointed while an eviction was outstanding
        self._children = {}               # entry id -> {slot: None} of the entries keyed under it
        self._revivers = {}               # row -> (its generation on the mirror, slots, ids) it revived: not
        #                                   inserted since (an insert of another row leaves those entries alone)
        self._unread = []                 # device slots of evictions not handed to unread() yet
        self._inflight = 0                # unread() results not dropped yet
        self.hits = self.hit_tokens = self.inserted = self.dropped = 0
        self._detached = False
        mirror.prefix_cache = self   # its truncate and rollback now keep rows' possibly-shared pages

    def __len__(self):
        """Live entries."""
        return len(self._index)

    def __repr__(self):
        return (f"PrefixCache({len(self)} entries of {len(self._keys)}, page_size={self.page_size}, "
                f"hits={self.hits}, hit_tokens={self.hit_tokens}, dropped={self.dropped})")

    @property
    def closed(self) -> bool:
        """An eviction is not dropped yet: :meth:`match` finds nothing until :meth:`drop`."""
        return bool(self._unread) or self._inflight > 0

    def detach(self) -> None:
        """Take this cache off its mirror (``mirror.prefix_cache`` back to None), so that the mirror
        can evict and finish without it, or take another cache. Refused while an eviction is not
        dropped (:attr:`closed`: :meth:`sync` first). A detached cache refuses every call (match,
        revive, insert, evict, unread, drop, sync, check_invariants, detach: ``ValueError``): its
        entries may name pages freed since."""
        self._attached("detach")
        if self.closed:
            raise ValueError("detach: an eviction is not dropped yet (sync() first): its slots name entries "
                             "whose pages are FREE now")
        self.mirror.prefix_cache = None
        self.mirror.named[:] = 0
        self._detached = True

    def _attached(self, what):
        if self._detached:
            raise ValueError(f"{what}: this PrefixCache was detached from its mirror (detach()): its entries "
                             f"may name pages freed since; make a new PrefixCache")

    @staticmethod
    def _tokens(tokens, what):
        """``tokens`` as given, checked to be host ints (each page's tokens again in :meth:`_key`, as
        far as a lookup walks): a tensor is refused (a 0-d tensor hashes by identity, so its keys
        would never match; and reading a device tensor is a sync)."""
        if isinstance(tokens, torch.Tensor):
            raise _tensor_tokens(what)
        if isinstance(tokens, np.ndarray):
            if tokens.dtype.kind not in "iu":
                raise ValueError(f"{what}: expected an integer numpy array of tokens, got dtype {tokens.dtype}")
            return tokens.tolist()   # Python ints at C speed (numpy scalars would take the slow check per page)
        if not isinstance(tokens, collections.abc.Sequence):  # (an int, None, a set or a dict has no pages to key)
            raise ValueError(f"{what}: expected the tokens as host ints (a list, tuple or numpy int array), got "
                             f"{type(tokens).__name__} {tokens!r:.60}")
        return tokens

    def _key(self, eid, tokens, i, what=None):
        """The key of page ``i`` of ``tokens`` after entry ``eid``; with ``what``, tokens other than
        ints are taken as ints or refused (``match``: only the pages it walks; ``insert`` checks them
        all first)."""
        page = tuple(tokens[i * self.page_size:(i + 1) * self.page_size])
        if what is not None and not _INTS.issuperset(map(type, page)):
            page = tuple(_host_ints(page, what))
        return eid, page

    def match(self, tokens, max_pages: int | None = None) -> PrefixMatch:
        """The longest run of entries ``tokens`` starts with, at most ``max_pages`` pages (default:
        ``(len(tokens) - 1) // page_size``, so at least one token is left to compute, the one
        whose logits come next). Host only; nothing while an eviction is unread (:attr:`closed`).
        """
        self._attached("match")
        tokens = self._tokens(tokens, "match")
        limit = (len(tokens) - 1) // self.page_size if max_pages is None else _checks.check_size(max_pages,
                                                                                                 "max_pages")
        limit = min(limit, len(tokens) // self.page_size)
        if self.closed or limit <= 0:
            return PrefixMatch()
        slots, eids, eid = [], [], _ROOT
        for i in range(limit):
            slot = self._index.get(self._key(eid, tokens, i, "match"))
            if slot is None:
                break
            eid = self._eid[slot]
            slots.append(slot)
            eids.append(eid)
        return PrefixMatch(tuple(slots), len(slots) * self.page_size, tuple(eids))

    def revive(self, match: PrefixMatch, max_len: int | None = None, *, count_cached: bool = False) -> int:
        """A new request on ``match``'s pages (``HostMirror.revive`` with the entries' generations and
        ``count_cached``); returns its row. Raises as ``HostMirror.revive`` does (``WouldNotFit``
        without a row or room), and ``ValueError`` for an empty match, while an eviction is not
        dropped, or for a match whose entries were dropped since it was made."""
        if not isinstance(match, PrefixMatch):
            raise ValueError(f"revive: expected a PrefixMatch (made by match()), got {type(match).__name__} "
                             f"{match!r:.60}")
        if not match:
            raise ValueError("revive: expected a match of at least one page, got an empty PrefixMatch")
        self._attached("revive")
        if self.closed:
            raise ValueError("revive: an eviction is not dropped yet (drop its slots first): the match may "
                             "name an evicted page")
        slots = match.slots  # (map: no Python frame per entry, as a generator has)
        if min(slots) < 0 or max(slots) >= len(self._keys):  # (a list takes -1; the kernels' reads are bounded too)
            raise self._bad_slots(slots)
        keys = list(map(self._keys.__getitem__, slots))
        if len(match.eids) != len(slots) or None in keys or list(map(self._eid.__getitem__, slots)) != list(match.eids):
            raise ValueError("revive: a stale match: entries it names were dropped since match() (their slots "
                             "may name other pages now), or made by another cache; match again")
        if [key[0] for key in keys] != [_ROOT, *match.eids[:-1]]:
            raise ValueError("revive: expected a chain of entries from a prompt's first page, each under the one "
                             "before it (a PrefixMatch not made by match())")
        n_tokens, m = self.mirror._revive_lengths(match.n_tokens, max_len)
        k = len(slots)
        if n_tokens != k * self.page_size:
            raise ValueError(f"revive: expected a match of {k} pages to hold {k * self.page_size} tokens, got "
                             f"n_tokens {n_tokens} (a PrefixMatch not made by match())")
        made = self._made()
        if self._np is not None:  # (the numba backend: one compiled gather into buffers of the cache's own)
            if (got := self._gathered.get(k)) is None:
                got = self._gathered[k] = (self._gather_np[0, :k], self._gather_np[1, :k],
                                           torch.from_numpy(self._gather_np[0, :k]),
                                           torch.from_numpy(self._gather_np[1, :k]))
            if gather_slots(np.array(slots, dtype=np.int64), *self._np, got[0], got[1]):
                raise AssertionError(f"revive: slots {slots} outside the arrays (checked before: a bug)")
            # The buffers are plain int32 [k] CPU tensors no table writes: the table's checks are known to pass.
            row = self.mirror._revive(got[2], n_tokens, m, k, got[3], count_cached)
        else:
            idx = self._to_device(slots)
            if self._kernels is not None:  # (the triton backend: one launch, on the pool's device)
                with self.pool.state.lock:
                    pages, gens = self._kernels.gather_slots_triton(idx, *made)
            else:
                pages, gens = made[0].index_select(0, idx), made[1].index_select(0, idx)
                # a page that does not name its slot back (a hand-edited slot_page: it may name another
                # page of the same generation, whose K/V are another prefix's) gets generation -1, which
                # the table's revive refuses on the device (use_after_free), as the kernels do
                gens.masked_fill_(made[2].index_select(0, self._bounded(pages)[0]) != idx, -1)
            # (the lengths are checked above; the table checks these fresh tensors, as mirror.revive would)
            row = self.mirror._revive(pages, n_tokens, m, self.table._revive_inputs(pages, n_tokens, gens), gens,
                                      count_cached)
        self._revivers[row] = (int(self.mirror._st[row, GEN]), slots, match.eids)
        self.hits += 1
        self.hit_tokens += match.n_tokens
        return row

    def insert(self, row: int, tokens) -> int:
        """Name the whole pages of running ``row`` by ``tokens`` (the tokens its pages hold, in order;
        at most its sure length), before the caller's ``finish(..., cache=True)``. Pages whose
        key is known already (the same prefix computed apart, or revived or forked from the
        entries) keep their entries, re-pointed to this row's pages: an entry that named
        another copy of the prefix (the same K/V) names the row's now, and the other copy,
        named by nothing, is evicted as any CACHED page (released earlier, so before the
        row's). The leading entries another running row revived (and was not inserted since)
        are not re-pointed: that row holds their pages, and this row's copy is the one named
        by nothing. Matches made before stay valid (entries keep their slots and ids). Returns
        the entries made. Device copies only (the row's pages and their generations): no
        host read."""
        self._attached("insert")
        made = self._made()  # (before the index changes)
        m, tokens = self.mirror, self._tokens(tokens, "insert")
        row = _checks.check_size(row, "row")
        if not (row < m.live.size and m.live[row]):
            raise ValueError(f"insert: expected a running row (an int in [0, {m.live.size}) that holds a "
                             f"request), got {row}")
        if len(tokens) > m.lo[row]:
            raise ValueError(f"insert: expected at most the row's sure length ({int(m.lo[row])}) tokens, got "
                             f"{len(tokens)}")
        n = len(tokens) // self.page_size
        tokens = tokens[:n * self.page_size]
        if not _INTS.issuperset(map(type, tokens)):
            # (before the index changes: a token that failed to hash at page i > 0 left the pages
            # before it named, over a slot whose old page and generation a revive then took)
            tokens = _host_ints(tokens, "insert")
        # slots: the entries of pages 0 .. in order, the known ones (found by their keys) first, then
        # the new ones from ``first`` on. One run: a key missed makes a new entry id, under which
        # nothing is known yet, so every deeper key misses too.
        first, slots, eid = None, [], _ROOT
        for i in range(n):
            key = self._key(eid, tokens, i)
            slot = self._index.get(key)
            if slot is None:
                if not self._free:
                    break               # full: deeper entries would be unreachable anyway
                slot = self._free.pop()
                self._eid[slot] = next(_EIDS)
                self._index[key], self._keys[slot] = slot, key
                self._children.setdefault(eid, {})[slot] = None
                first = i if first is None else first
            slots.append(slot)
            eid = self._eid[slot]
        known = len(slots) if first is None else first
        # The leading known entries a running reviver holds stay on its pages (its own insert names them
        # later): re-pointed here, they would leave the reviver's copy named by nothing while this row's
        # copy, once evicted, took them and every entry under them with it.
        keep = self._kept(row, slots, known) if known and self._revivers else 0
        if known > keep and self.closed:
            # An entry an unread eviction took (its page forgotten on the device) may be re-pointed
            # here: its drop must let the page it names now go (drop takes an evicted entry's page
            # as forgotten already).
            self._moved.update(slots[keep:known])
        # Every slot from ``keep`` on, known or new, is written with the row's page at its position (one
        # call from page ``keep``), after the page it named before is let go where it still names the
        # slot: a known entry that named the row's page (revived, forked) ends as it was; one that named
        # another copy of its prefix (computed apart: the same K/V) names the row's, released after that
        # copy (as the loop inserts a request just before its finish), so the copy named by nothing goes
        # first.
        # Only if the row's device length is at least its sure length (``need``, the mirror's lo, which
        # bounds the tokens named): a row a refused revive left empty (a broken contract: its pages freed
        # behind the cache) is shorter on the device by the revived tokens, and has other tokens' pages
        # there, so on the device nothing is named: the known entries keep what they name (their next hit
        # is refused again, as use_after_free) and the new ones name page -1, generation -1 (refused as
        # invalid_page). Decided on the device; normal operation always holds them (lo <= seq_lens). The
        # sure length, not the tokens named: a row that decoded past the revived tokens' count since would
        # hold as many tokens on the device as a shorter insert names (helper-163).
        # The update writes the slots from page ``keep`` on (the row's pages keep.., ``known - keep`` of
        # them known).
        need, write = int(m.lo[row]), slots[keep:]
        if write and self._np is not None:  # (the numba backend: one compiled call, as below)
            bt, rows, width, gen, P, sl = self._at
            with self.pool.state.lock:
                if insert_pages(bt, rows, width, row, np.array(write, dtype=np.int64), gen, P, *self._np,
                                sl, need, known - keep, keep):
                    raise AssertionError(f"insert: row {row} pages {keep}..{len(slots)} or slots {write} "
                                         f"outside the arrays (checked before: a bug)")
        elif write and self._kernels is not None:  # (the triton backend: one copy of the slots, one launch)
            idx = self._to_device(write)
            with self.pool.state.lock:
                self._kernels.insert_pages_triton(self._bt, row, idx, self._gen, *made, self._sl, need,
                                                  known - keep, keep)
        elif write:
            idx, P = self._to_device(write), self.pool.num_pages
            with self.pool.state.lock:   # between two calls, never inside one
                held = self._sl[row] >= need   # (0-d, on the device; row: a running row, checked above)
                new = torch.arange(len(write), device=self.device) >= known - keep
                pages = self._bt[row, keep:len(slots)]
                # A page id outside the pool (a hand-edited row) names nothing: it is aimed at the
                # spare last entry of page_slot, which keeps its -1, and its generation is -1 (a
                # revive of the entry is refused on the device, as invalid_page).
                at, inside = self._bounded(pages)
                bad = ~inside
                gens = self._gen.index_select(0, at.clamp(max=P - 1)).masked_fill_(bad, -1)
                self._let_go(idx, held)   # the pages the slots named, before any slot is written
                # short of ``need``: the known slots as they are, the new ones -1
                pages = torch.where(held, pages, torch.where(new, -1, made[0].index_select(0, idx)))
                gens = torch.where(held, gens, torch.where(new, -1, made[1].index_select(0, idx)))
                made[0].index_copy_(0, idx, pages)
            made[1].index_copy_(0, idx, gens)
            made[2].index_copy_(0, torch.where(held, at, P), idx.int().masked_fill_(bad | ~held, -1))
        if slots:
            self.inserted += len(slots) - known
            m.named[row] = max(int(m.named[row]), len(slots))  # (from page 0; finish: cache=True only)
        self._revivers.pop(row, None)   # its entries are named by this insert: its hold ends
        return len(slots) - known

    def _kept(self, row, slots, known) -> int:
        """How many of the leading ``known`` entries of ``slots`` (an insert of ``row``) a running reviver
        other than ``row`` holds: the longest run it revived, by the same entries (ids: a slot may be reused
        since). A reviver whose row finished since (its generation moved on) is forgotten here."""
        m, keep = self.mirror, 0
        for q, (gen, held, eids) in list(self._revivers.items()):
            if not (m.live[q] and m._st[q, GEN] == gen):
                del self._revivers[q]       # finished (its row may hold another request now)
                continue
            j, end = 0, min(known, len(held)) if q != row else 0
            while j < end and slots[j] == held[j] and self._eid[held[j]] == eids[j]:
                j += 1
            keep = max(keep, j)
        return keep

    def evict(self, k: int) -> torch.Tensor:
        """``mirror.evict(k)``, and on the device the slots that named the evicted pages (-1 for a page
        no entry named and for padding), which it forgets; they are kept for :meth:`unread`, and
        :meth:`match` finds nothing until they are dropped. Returns the evicted page ids (device)."""
        self._attached("evict")
        made = self._made()
        ev = self.mirror._evict(k)
        if not ev.shape[0]:       # evict(0): nothing to forget, and match stays open
            return ev
        if self._np is not None:  # (the numba backend: one compiled call; the pool's result is int32, contiguous)
            slots = np.empty(ev.shape[0], dtype=np.int32)
            if forget_pages(ev.data_ptr(), ev.shape[0], self._np[2], slots):
                raise AssertionError("evict: the slots do not match the evicted pages (a bug)")
            self._unread.append(torch.from_numpy(slots))
            return ev
        if self._kernels is not None:  # (the triton backend: one launch, on the pool's device)
            with self.pool.state.lock:
                self._unread.append(self._kernels.forget_pages_triton(ev, made[2]))
            return ev
        at, inside = self._bounded(ev)        # padding: the spare last entry, read as -1
        self._unread.append(made[2].index_select(0, at).masked_fill_(~inside, -1))
        made[2].index_fill_(0, at, -1)
        return ev

    def unread(self) -> torch.Tensor | None:
        """The slots of the evictions not handed out yet, one int32 device tensor (None if none): read
        it at the loop's next host read (in the same copy) and pass the values to :meth:`drop`. Until
        then (and until every ``unread`` is dropped, in any order) :meth:`match` finds nothing."""
        self._attached("unread")
        if not self._unread:
            return None
        out = self._unread[0] if len(self._unread) == 1 else torch.cat(self._unread)
        self._unread.clear()
        self._inflight += 1
        return out

    def drop(self, slots) -> int:
        """Forget the entries of ``slots`` (host ints: the values of an :meth:`unread` not
        dropped yet; -1 skipped) and every entry under them, and reopen :meth:`match` once no
        eviction is outstanding. Returns the entries dropped."""
        self._attached("drop")
        if self._inflight <= 0:
            raise ValueError("drop: expected the values of an unread() not dropped yet, but none is outstanding")
        if isinstance(slots, torch.Tensor):
            raise ValueError("drop: expected the unread() values as host ints, got a tensor: pass slots.tolist() "
                             "(read in the loop's next host copy)")
        try:
            slots = [operator.index(s) for s in slots]   # (a 0-d tensor would hash by identity)
        except TypeError as e:
            raise ValueError(f"drop: expected host ints, got {e}") from None
        n = len(self._keys)
        if any(s < -1 or s >= n for s in slots):         # before anything changes
            raise ValueError(f"drop: expected slots in [-1, {n}) (the unread() values), got "
                             f"{_head(np.asarray(slots))}")
        self._made()                                     # (the let-go below indexes them)
        gone = [s for s in dict.fromkeys(slots) if s >= 0 and self._keys[s] is not None]
        # All or nothing: the entries under the evicted ones are found without changing the index, the
        # device is written, and only then does the host forget them (a device error in between leaves
        # the cache as it was, the eviction still outstanding: the same drop may be retried).
        evicted = set(gone)                  # (the eviction forgot their pages on the device)
        stack = [c for s in gone for c in self._children.get(self._eid[s], ())]
        under = []
        while stack:
            s = stack.pop()
            if s not in evicted:             # (an entry evicted too is walked from ``gone``)
                under.append(s)
                stack.extend(self._children.get(self._eid[s], ()))
        # Entries under an evicted one: their pages stay, named by nothing. An evicted entry an insert
        # re-pointed after its eviction (while it was unread) names a page the eviction did not forget.
        fix = under + [s for s in gone if s in self._moved] if self._moved else under
        if fix:
            self._let_go(self._to_device(fix))
        for s in gone + under:
            self._forget(s)
        self._inflight -= 1
        self._held.extend(gone + under)
        if not self.closed:              # no eviction outstanding can name a held slot any more
            self._free.extend(self._held)
            self._held.clear()
            self._moved.clear()          # (nor a slot re-pointed since it took it)
        self.dropped += len(gone) + len(under)
        return len(gone) + len(under)

    def _forget(self, s) -> None:
        """Drop entry ``s`` from the host index (the entries under it are dropped by the caller)."""
        key = self._keys[s]
        del self._index[key]
        self._keys[s] = None
        siblings = self._children.get(key[0])
        if siblings is not None:        # (None: its parent was dropped first)
            del siblings[s]
        self._children.pop(self._eid[s], None)

    def sync(self) -> int:
        """Read the unread evictions' slots and drop them (a sync point); returns the entries dropped."""
        self._attached("sync")
        self._made()              # (drop's check, before unread() hands the eviction out)
        ev = self.unread()
        return 0 if ev is None else self.drop(ev.tolist())

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` unless the device tensors and the host index agree (a sync point).

        Every live slot names a distinct page, the page names it back, and the page is USED
        or CACHED with the generation recorded; every free slot and every other page names
        nothing. Call it with no eviction unread (:meth:`sync` first). A detached cache refuses
        (``ValueError``), as it refuses every call: its entries may name pages freed since.
        """
        self._attached("check_invariants")
        if self.closed:
            raise AssertionError("check_invariants: an eviction is not dropped yet (sync() first)")
        live = [s for s, k in enumerate(self._keys) if k is not None]
        idle = self._free + self._held
        assert len(live) + len(idle) == len(self._keys) and not set(live) & set(idle), \
            f"slots lost or doubled: {len(live)} live, {len(self._free)} free, {len(self._held)} held, of " \
            f"{len(self._keys)}"
        under = {}
        for s in live:
            under.setdefault(self._keys[s][0], set()).add(s)
        eids = {self._eid[s] for s in live} | {_ROOT}
        assert set(under) <= eids, f"entries under dropped ones: {sorted(set(under) - eids)[:8]}"
        kept = {e: set(c) for e, c in self._children.items() if c}
        assert kept == under, "the children map disagrees with the entries"
        sp, sg, ps = (t.tolist() for t in self._made())
        pages = [sp[s] for s in live]
        assert len(set(pages)) == len(pages), f"two entries name one page: {sorted(pages)}"
        assert all(0 <= p < self.pool.num_pages for p in pages), f"entries name pages outside the pool: {pages}"
        named = {p: s for s, p in zip(live, pages)}
        wrong = [(p, s) for p, s in enumerate(ps[:-1]) if s != named.get(p, -1) and (s >= 0 or p in named)]
        assert not wrong and ps[-1] == -1, f"page_slot disagrees with the entries: (page, slot) {wrong[:8]}"
        if live:
            idx = torch.tensor(pages, dtype=torch.int32, device=self.device)
            gens = self.pool.generations(idx).tolist()
            stale = [(s, p) for s, p, g in zip(live, pages, gens) if g != sg[s]]
            assert not stale, f"entries whose page was freed since: (slot, page) {stale[:8]}"
            with self.pool.state.lock:
                states = self.pool.state.page_state.index_select(0, idx.long()).tolist()
            bad = [(s, p, st) for s, p, st in zip(live, pages, states) if st not in (L.USED, L.CACHED)]
            assert not bad, f"entries whose page is neither USED nor CACHED: (slot, page, state) {bad[:8]}"

    def _let_go(self, idx, where=None) -> None:
        """Clear ``page_slot`` of the pages the slots ``idx`` name, only where it still names the slot (a
        page named again since keeps its new slot) and ``where`` (a device mask) holds. Two of the slots
        may name one page (one evicted since, named again), so only -1 is written; an id outside the pool
        (a hand-edited one) is aimed at the spare last entry, which never names a slot."""
        slot_page, _, page_slot = self._dev   # (checked by the caller: _made)
        pages, valid = self._bounded(slot_page.index_select(0, idx))
        named = valid & (page_slot.index_select(0, pages) == idx.int())
        if where is not None:
            named &= where
        page_slot.index_fill_(0, torch.where(named, pages, self.pool.num_pages), -1)

    def _bounded(self, pages):
        """``(at, valid)``: ``pages`` as int64 indices into ``page_slot``, an id outside the pool (a
        hand-edited row) aimed at the spare last entry, and which ones were inside."""
        valid = (pages >= 0) & (pages < self.pool.num_pages)
        return torch.where(valid, pages.long(), self.pool.num_pages), valid

    def _made(self) -> tuple:
        """The index tensors as the cache made them, checked to keep their sizes (before any state changes):
        every backend indexes them (the torch code of a drop's let-go and of the reference backend, the
        triton kernels, whose wrappers check them against each other and the pool again), so one changed in
        place since (``set_``, ``resize_``) is a ``ValueError`` here, not an index out of range (an
        ``IndexError`` half-way through a call on a CPU, a device assert on CUDA). One re-pointed to other
        memory of the same size is refused too: numba's compiled updates keep the memory the cache made (its
        numpy views) while the torch code would follow the tensor, and the two would disagree."""
        for t, n, name, ptr in zip(self._dev, (len(self._keys), len(self._keys), self.pool.num_pages + 1),
                                   ("slot_page", "slot_gen", "page_slot"), self._ptrs):
            if not (type(t) is torch.Tensor and t.dtype is torch.int32 and t.dim() == 1 and t.numel() == n
                    and t.is_contiguous() and t.data_ptr() == ptr):
                where = "" if type(t) is not torch.Tensor or t.data_ptr() == ptr else " over other memory"
                raise ValueError(f"PrefixCache: expected its {name} as it made it (contiguous torch.int32 [{n}]), "
                                 f"got {type(t).__name__} {t.dtype} {tuple(t.shape)}{where}: a tensor of the cache "
                                 f"was changed in place (set_, resize_); make a new PrefixCache")
        return self._dev

    def _bad_slots(self, slots) -> ValueError:
        """A revive's refusal of a match whose slots lie outside the cache (one not made by :meth:`match`)."""
        return ValueError(f"revive: expected slots in [0, {len(self._keys)}), got {_head(np.asarray(slots))} (a "
                          f"PrefixMatch not made by match())")

    def _to_device(self, values) -> torch.Tensor:
        """Host ints as an int64 index tensor on the device, as the mirror moves its inputs."""
        return self.mirror._tensor(values, np.int64)
