"""The host integers behind a HostMirror: per-request length bounds, reservations, and the
queries a scheduler asks of them (admission, pages needed, preemption). No table calls here:
:class:`tpool.scheduling.HostMirror` makes those and updates these numbers in the same place.
See :mod:`tpool.scheduling.mirror` for what the numbers promise.
"""

import array
import collections

import numpy as np
import torch

from tpool import _checks
from tpool.scheduling._decode import EMPTY, check_prompts, check_rows, count_total, extra_pages, start_rows


class WouldNotFit(ValueError):
    """The mirror cannot prove the call fits the pool (or the table); nothing was done."""


def _cdiv(a, ps):
    return (a + (ps - 1)) // ps


_I64 = np.dtype(np.int64)  # numpy's one int64 dtype object: ``a.dtype is _I64`` is a plain compare
_I64_MIN, _I64_MAX = -2 ** 63, 2 ** 63 - 1
_LONG_LIST = 16  # entries from which a list of ints is read through array.array (faster), not numpy's inference
_N64 = tuple(np.int64(n) for n in range(64))  # the usual token counts as numpy scalars, made once


def _as_array(values, name: str):
    """``values`` as a numpy array, as ``np.asarray`` reads it: int64 for a list of ints (a bool among
    them reads as 0/1, numpy's promotion), bool for a list of bools only, floats if one is a float.
    A tensor, or a list or tuple that starts with one, is a ``ValueError`` naming ``name``: the mirror
    plans on host ints, and numpy would read a tensor's values, a host sync on a GPU (the prefix cache
    refuses tensors too). So is a nested sequence or an array of more than one dimension: every int
    sequence a mirror call takes holds one int per request or row, and read flat, a list of token lists
    passed as ``prompt_lens`` would admit one request per token."""
    if type(values) is np.ndarray:
        return _flat(values, name)
    head = values[0] if type(values) in (list, tuple) and values else values
    if type(head) is not int and isinstance(head, torch.Tensor):
        got = f"a tensor on {head.device}" if head is values else f"a {type(values).__name__} of tensors"
        raise ValueError(f"{name}: expected host ints (a list, tuple or numpy int array), got {got}: the mirror "
                         f"plans on host integers (reading a tensor is a host sync)")
    if type(values) is list and len(values) > _LONG_LIST and type(values[0]) is not bool:
        # A C loop taking ints only (a float or a numpy bool raises): ~1 us less than numpy's inference
        # at 256. It would read a list of bools as 0/1 too: one starting with a bool goes to numpy (a
        # bool array if every entry is one), so both paths give what numpy gives (~30 ns, no scan).
        try:
            return np.frombuffer(array.array("q", values), dtype=np.int64)
        except (TypeError, OverflowError):
            pass  # numpy's inference tells what came
    try:
        a = np.asarray(values)
    except ValueError:  # (numpy: a ragged nested list, "inhomogeneous shape")
        raise ValueError(_nested(name, f"a ragged nested {type(values).__name__}")) from None
    return _flat(a, name)


def _nested(name: str, got: str) -> str:
    """The refusal of a nested sequence given as ``name``."""
    hint = " (lists of tokens? pass their lengths)" if name == "prompt_lens" else ""
    return f"{name}: expected a flat sequence of ints, one per request or row, got {got}{hint}"


def _flat(a, name: str):
    """Array ``a``, refused (a ``ValueError`` naming ``name``) when it has more than one dimension."""
    if a.ndim > 1:
        raise ValueError(_nested(name, f"a nested one of shape {a.shape}"))
    return a


def _plain(a):
    """Int64 array ``a`` as the compiled loops take it: contiguous and writable (a copy otherwise,
    such as a strided view or ``np.broadcast_to``), so that no other layout is compiled for them."""
    flags = a.flags
    return a if flags.c_contiguous and flags.writeable else a.copy()


def _head(a) -> str:
    """Array ``a`` for a message: its first 8 values, and how many there are when more."""
    head = a.reshape(-1)[:8].tolist()
    return f"{head}" if a.size <= 8 else f"{str(head)[:-1]}, ...] ({a.size} values)"


def _shown(a) -> str:
    """Array ``a`` for an error message: its dtype and first entries."""
    return f"{a.dtype} {_head(a)}"


def _int_array(values, name: str, what: str = "ints"):
    """``values`` (a sequence or an array of ints) as an int64 numpy array: the one rule for every int
    sequence a mirror call takes. Whatever numpy reads as other than integers is a ``ValueError`` naming
    ``what`` was expected and what came: an array of floats or bools, a list with a float in it, a list
    of bools only (a bool among ints reads as 0/1, numpy's promotion). ``asarray(..., dtype=int64)``
    would truncate ``1.9`` to ``1`` and read a mask as ids."""
    a = _as_array(values, name)
    if a.dtype is _I64:
        return a
    if a.dtype.kind == "u" and a.size and a.max() > _I64_MAX:  # (numpy reads [2 ** 63] as uint64: it would wrap)
        raise ValueError(f"{name}: expected {what} within int64, got {_shown(a)}")
    if a.dtype.kind in "iu" or a.size == 0:  # (an empty list comes as float64)
        return a.astype(np.int64)
    raise ValueError(f"{name}: expected {what}, got {_shown(a)}")


def _length(values, name: str) -> int:
    """``len(values)``; a ``ValueError`` naming ``name`` when ``values`` is no sequence (an int, None)."""
    try:
        return len(values)
    except TypeError:
        raise ValueError(f"{name}: expected a sequence, got {type(values).__name__} {values!r:.40}") from None


def _queue_head(values, k: int, name: str):
    """The first ``k`` of the prompts or max_lens ``values``: of a numpy array its first ``k`` (one of more
    than one dimension refused, as ``admit`` refuses it); of any other sequence its slice (the rest never
    read: a long waiting queue costs no more than its head); what slices not (a set, a dict) as numpy reads
    it (so a ``ValueError`` names it)."""
    if isinstance(values, np.ndarray):
        return _as_array(values, name).reshape(-1)[:k]
    try:
        return values[:k]
    except (TypeError, KeyError):
        return _int_array(values, name).reshape(-1)[:k]


def _count(values, name: str) -> int:
    """How many prompts or max_lens ``values`` holds, as ``admit`` counts them (an array's size; a 0-d
    array, as an int, is no sequence; a nested list or tuple, or an array of more than one dimension, is
    refused as ``admit`` refuses it, not counted by its outer length)."""
    if isinstance(values, np.ndarray) and values.ndim:
        return _as_array(values, name).size
    n = _length(values, name)
    if n and type(values) in (list, tuple) and isinstance(values[0], (list, tuple, np.ndarray)):
        _as_array(values, name)  # (raises: a nested sequence)
    return n


def _int_list(values, name: str) -> list:
    """``values`` as a list of Python ints, checked as :func:`_int_array` checks them; a list of ints
    is returned as it is (no numpy call: a scheduler asks with lists every step)."""
    if type(values) is list and _exact_ints(values) and (not values or _I64_MIN <= min(values) and
                                                          max(values) <= _I64_MAX):
        return values
    # (an int past int64 is refused there, as numpy reads it; so is a nested list)
    return _int_array(values, name).reshape(-1).tolist()


def _exact_ints(values) -> bool:
    """Every entry of list ``values`` is a Python int (no bool, no numpy scalar, no float)."""
    for v in values:
        if type(v) is not int:
            return False
    return True


def _same_ints(values, last) -> bool:
    """List ``values`` holds the ints of list ``last`` (a list of Python ints, or None), type for type:
    ``[1.0] == [1]`` and ``[True] == [1]`` in Python, so the entries' types are compared too."""
    return values == last and _exact_ints(values)


def _bad_rows(rows, live) -> str:
    """What is wrong with ``rows`` (a call's row ids): the ones out of range, not running, or repeated."""
    R, problems = len(live), []
    out = [q for q in rows if not 0 <= q < R]
    idle = [q for q in rows if 0 <= q < R and not live[q]]
    again = sorted(q for q, times in collections.Counter(rows).items() if times > 1)
    if out:
        problems.append(f"{out} out of range (rows are 0 to {R - 1})")
    if idle:
        problems.append(f"{idle} not running (never admitted, or finished or preempted since)")
    if again:
        problems.append(f"{again} more than once")
    return f"rows: expected distinct running rows, got {rows}: " + "; ".join(problems)


def _bucket(tokens, most):
    """A call's token budget rounded up to a power of two, at most ``most`` (the table's
    ``most_tokens``: no call appends more): the table keeps one set of output buffers
    per shape, so a few shapes serve every batch instead of one per total."""
    return min(1 << max(tokens - 1, 0).bit_length(), max(most, tokens))


class Accounting:
    """Host state of a mirror over ``R`` table rows of at most ``capacity`` tokens each.

    ``free``/``cached``: lower bounds on the pool's FREE/CACHED pages; ``reserved``: pages set
    aside from ``free``; per row ``lo <= length <= hi``, ``limit`` (max_len), ``shared``
    (leading pages possibly held by another request too), ``res`` (pages reserved).
    """

    def __init__(self, R, page_size, lookahead, capacity, free, cached, capacity_why=None):
        self.page_size, self.lookahead, self.capacity = page_size, lookahead, capacity
        # What bounds ``capacity``, and what a longer request needs, for the messages that name it.
        self.capacity_why = capacity_why or (f"a row's capacity ({capacity // page_size} pages of {page_size}: "
                                             f"max_pages_per_request * page_size)",
                                             "a PageTable with a larger max_pages_per_request")
        self.max_batch = R  # lanes one table call takes (a HostMirror sets its pool's max_batch)
        self.free, self.cached, self.reserved = int(free), int(cached), 0
        # Sum of the bounds on every change of the CACHED count (never floored at 0, unlike
        # ``cached``): what reconciliation adds to the truth at a snapshot.
        self._cached_flow = 0
        # Sums of the corrections reconciliations applied to ``free`` and to each row's ``hi``: a
        # snapshot notes them, its reconciliation takes back those applied since (snapshot.py).
        self._free_fix, self._hi_fix = 0, np.zeros(R, dtype=np.int64)
        # Per row, one int64 record (a decode gathers and scatters the batch's records once):
        # lo, hi (length bounds), limit (max_len), shared (leading pages possibly shared),
        # res (pages reserved), gen (bumped when the row's request ends).
        self._st = np.zeros((R, 6), dtype=np.int64)
        self.lo, self.hi, self.limit, self.shared, self.res, self.gen = (self._st[:, i] for i in range(6))
        self.live = np.zeros(R, dtype=bool)
        # Per row, the length through which ``reserve`` set pages aside (0: none): reconciliation keeps
        # them when it trims a reservation sized from bounds that were wider than the truth.
        self.reserved_to = np.zeros(R, dtype=np.int64)
        self.uncertain_at = np.full(R, -1, dtype=np.int64)  # op number of the row's last rollback
        self.exact_at = np.full(R, -1, dtype=np.int64)      # ... of the last call that set its length outright
        self._free_rows = list(range(R - 1, -1, -1))
        self._seq = 0                     # one number per mirror call, for reconciliation
        self._free_inexact_at = self._cached_inexact_at = -1
        self._decode_keys = {}            # per StepOut (None: the table's buffers): last decode's (rows, n), bound step
        self._members = 0                 # bumped whenever a row starts or stops running
        self._checked = (None, -1)        # (rows bytes, _members) of the last batch that passed the checks
        # The last list of row ids and of tokens per row that _batch converted: (the list's copy, its
        # int64 array (which no call writes), its bytes or its sum); and the last array of tokens _batch
        # checked, with its sum (_tokens).
        self._rows_memo, self._n_memo, self._n_total = (None, None, None), (None, None, 0), (None, 0)
        self._full = None                 # rows bytes of a batch whose every row holds its full reservation
        self._scratch = np.zeros(R, dtype=np.int64)
        self._caps = np.full(R, capacity, dtype=np.int64)  # max_lens of prompts given none (read only)
        self._acct = np.zeros(5, dtype=np.int64)  # decode_accounting's results
        self._reconciled_at = -1          # the op number of the last snapshot reconciled

    def _prompts(self, prompt_lens, max_lens):
        """``prompt_lens`` and ``max_lens`` (default the capacity) as int64 arrays, checked before a
        call changes anything: one max_len per prompt, ``0 <= prompt <= max_len <= capacity``."""
        try:  # (both read: numpy would take a lone int for a list of one)
            n_max = 0 if max_lens is None else len(max_lens)
            empty = not len(prompt_lens) and not n_max
        except TypeError:  # one is no sequence: say which
            _length(prompt_lens, "prompt_lens")
            _length(max_lens, "max_lens")
            raise
        if empty:
            return EMPTY, EMPTY  # a step with no admissions (most steps): nothing to check
        p = _plain(_int_array(prompt_lens, "prompt_lens").reshape(-1))
        lim = self._caps[:p.size] if max_lens is None and p.size <= self._caps.size else \
            np.full(p.size, self.capacity, dtype=np.int64) if max_lens is None else \
            _plain(_int_array(max_lens, "max_lens").reshape(-1))
        if lim.shape != p.shape or lim.ndim != 1 or check_prompts(p, lim, self.capacity) < 0:
            why, remedy = self.capacity_why
            cap = f"{self.capacity}, {why}"
            if max_lens is None:
                longer = f"; a longer prompt needs {remedy}" if p.size and p.max() > self.capacity else ""
                raise ValueError(f"prompt_lens: expected prompts of 0 to {cap}, got {_head(p)}{longer}")
            raise ValueError(f"prompt_lens, max_lens: expected one max_len per prompt, 0 <= prompt <= max_len <= "
                             f"{cap}, got {_head(p)}, {_head(lim)}")
        if p.size > self.max_batch:
            raise ValueError(f"prompt_lens: expected at most max_batch={self.max_batch} prompts in one call "
                             f"(the lanes of one table call), got {p.size}")
        return p, lim

    def _start_new(self, r, p, lim) -> None:
        """Start requests of ``p`` tokens and max_lens ``lim`` (checked, ``_prompts``) in free rows ``r``
        (int64, from ``_take_rows``): their pages come from ``free``, their reservations from the
        unreserved pages left, in order (``_decode.start_rows``, one compiled loop)."""
        acct = self._acct
        if start_rows(self._st, self.live, self.reserved_to, self.uncertain_at, self.exact_at, r, p, lim, self._seq,
                      self.page_size, self.lookahead, self.unreserved, acct):
            raise AssertionError(f"HostMirror: rows {r.tolist()} outside the books (taken from the free rows: a bug)")
        taken, granted = acct[:2].tolist()
        self._members += 1
        self.free -= taken
        self.reserved += granted

    def __repr__(self):
        """What a scheduler reads off it: rows, pages and whether the counts are exact (host only)."""
        if "live" not in self.__dict__:  # (a traceback of a failed __init__ shows self)
            return f"{type(self).__name__}(not made)"
        rows = len(self.live)
        word = {True: "exact", False: "inexact"}
        exact = "exact" if self.exact and self.cached_exact else \
            f"lower bounds: free {word[self.exact]}, cached {word[self.cached_exact]}"
        return (f"{type(self).__name__}({rows - self.rows_free} of {rows} rows running, free={self.free}, "
                f"cached={self.cached}, reserved={self.reserved}, unreserved={self.unreserved}, "
                f"lookahead={self.lookahead}, page_size={self.page_size}; {exact})")

    # ----------------------------------------------------------- queries (host only)
    @property
    def exact(self) -> bool:
        """``free`` equals the pool's FREE pages right now (else it is a lower bound)."""
        return self._free_inexact_at < 0

    @property
    def cached_exact(self) -> bool:
        """``cached`` equals the pool's CACHED pages right now (else it is a lower bound)."""
        return self._cached_inexact_at < 0

    @property
    def unreserved(self) -> int:
        """Pages an admission, fork or unreserved growth may take."""
        return self.free - self.reserved

    @property
    def rows_free(self) -> int:
        """Table rows no request holds (what ``admit``, ``fork`` and ``revive`` take)."""
        return len(self._free_rows)

    def _no_room_hint(self, ask: str) -> str:
        """What a refused step should do first: ``ask`` (preemption), or, while a ``count_cached``
        revive or fork has left ``unreserved`` negative, evict the CACHED pages that repay it: preempting
        a running request would not be needed."""
        if self.unreserved >= 0:
            return ask
        return (f"a count_cached revive or fork took {-self.unreserved} page(s) the CACHED pages are to repay: "
                f"evict shortfall() CACHED pages first (PrefixCache.evict), not preemption")

    def running(self) -> list:
        """The rows that hold a request, ascending (a host list: no device read)."""
        return np.flatnonzero(self.live).tolist()

    def length_bounds(self, row: int) -> tuple:
        """``(lo, hi)``: running ``row``'s length is at least ``lo`` (its sure length: what ``insert``,
        ``truncate`` and ``fork`` may count on) and at most ``hi`` (what its next tokens and its
        max_len are counted from). Equal unless a ``rollback`` is not reconciled yet."""
        row = _checks.check_size(row, "row")
        if not (row < self.live.size and self.live[row]):
            raise ValueError(f"row: expected a running row (an int in [0, {self.live.size}) that holds a request), "
                             f"got {row}")
        return int(self.lo[row]), int(self.hi[row])

    def pages_for(self, tokens: int) -> int:
        """Pages that ``tokens`` tokens fill: ``ceil(tokens / page_size)``. ``tokens`` a non-negative int
        (numpy's too), else a ``ValueError``."""
        return _cdiv(_checks.check_size(tokens, "tokens"), self.page_size)

    def pages_needed(self, row: int, n: int) -> int:
        """Pages request ``row`` may need for ``n`` more tokens (exact unless its length is uncertain).

        Parameters
        ----------
        row : int
            A running row.
        n : int
            Tokens to add, >= 0.

        Returns
        -------
        int
            Pages from its upper bound ``hi``, before its reservation is taken into account.
        """
        r, n = self._row(row, n, "pages_needed", "n")
        return int(self._need(r, n, exact=True)[0])

    def _row(self, row, n, what, n_name):
        """``row`` as a one-row array and ``n`` as an int, after checking that ``row`` is a running row
        and ``n`` a count (``_size``: ints, numpy's too, never a bool)."""
        row, n = _checks.check_size(row, f"{what}: row"), _checks.check_size(n, f"{what}: {n_name}")
        if not (row < self.live.size and self.live[row]):
            raise ValueError(f"{what}: expected a running row (an int in [0, {self.live.size}) that holds a "
                             f"request), got {row!r}")
        return np.array([row], dtype=np.int64), n

    def _need(self, r, n, exact=False):
        """Pages rows ``r`` may need for ``n`` more tokens (an int, or one per row): what their upper bound
        ``hi`` plus ``n`` fills past the pages their sure length ``lo`` fills, never more than ``n`` tokens
        fill. ``exact``: in Python ints (object arrays), for any ``n``, where int64 would wrap past
        ``2 ** 63 - hi``."""
        hi, lo, ps = self.hi[r], self.lo[r], self.page_size
        if exact:
            hi, lo = hi.astype(object), lo.astype(object)
        return np.minimum(_cdiv(hi + n, ps) - _cdiv(lo, ps), _cdiv(n, ps))

    def _target(self, r):
        """Pages the reservation of rows ``r`` should hold: their next ``lookahead`` tokens, capped."""
        k = np.minimum(self.lookahead, self.limit[r] - self.hi[r])
        return self._need(r, k)

    def can_admit(self, prompt_lens, max_lens=None, rows=None, n=1, *, count_cached: bool = False) -> int:
        """How many of these prompts, in order, fit now (rows, pages, reservations).

        Parameters
        ----------
        prompt_lens : sequence of int
            The waiting prompts' lengths, queue order.
        max_lens : sequence of int, optional
            ``max_lens[i]`` is the most tokens request ``i`` may reach (prompt + output);
            default ``capacity``, the tokens of a row or, when the pool holds fewer pages
            than a row, of the pool (a request past it could never finish: it counts as
            not fitting).
        rows, n : optional
            The prompts are to be admitted in the step that decodes ``n`` tokens (an int,
            or one per row) of each of these running rows (``step(rows, n, prompts)``):
            the pages those lanes need beyond their reservations come first (0 if one of
            those rows would pass its max_len: that step would be refused).
        count_cached : bool
            The ``cached`` pages count as room too: the caller evicts :meth:`shortfall` of them
            before the step (a loop with a prefix cache). A ``revive`` takes its pages from
            them, so ask with its whole prompt, as for a prefill.

        Returns
        -------
        int
            How many prompts from the head of the queue fit, in order.

        Lanes count too: one table call takes at most ``max_batch`` lanes, so at most
        ``max_batch - len(rows)`` prompts fit (``max_batch`` without ``rows``).

        Only the head of the queue is read and checked (one prompt per free row, at most
        ``max_batch``; ints as numpy reads them, an array by its dtype), so a long waiting
        queue costs no more than its head.
        """
        costs, room = self._admission(prompt_lens, max_lens, rows, n)
        return self._fit(costs, room + self._evictable(count_cached))

    def shortfall(self, prompt_lens=(), max_lens=None, rows=None, n=1) -> int:
        """Pages the pool must gain (``evict``) before the step of ``rows`` (``n`` tokens each) and
        the admission of these prompts fits: 0 when it fits already.

        The arguments are :meth:`can_admit`'s, and so is the head of the queue it counts (as
        many prompts as there are free rows and lanes, up to the first that could never be
        admitted); with no prompts it is the step's own need beyond the reservations, which
        :meth:`preemption` would otherwise take from running requests. A scheduler with a
        prefix cache evicts ``min(shortfall, cached)`` CACHED pages instead of preempting or
        waiting, and the mirror credits them to ``free`` at ``evict``. A step one of whose
        rows would pass its max_len fits no eviction: that is a ``ValueError`` naming the rows.
        """
        costs, room = self._admission(prompt_lens, max_lens, rows, n, refuse=True)
        return max(sum(costs) - room, 0)

    def _evictable(self, count_cached) -> int:
        """The ``cached`` pages when ``count_cached`` (a bool, checked), else 0."""
        return self.cached if _checks.flag(count_cached, "count_cached") else 0

    def _admission(self, prompt_lens, max_lens, rows, n, refuse=False):
        """``(costs, room)``: what each admissible prompt at the head of the queue takes (its pages and
        reservation, in order: one per free row and lane, up to the first that could never be
        admitted), and the unreserved pages left after the step's lanes (``rows``, ``n``): -1 when
        a row would pass its max_len (``refuse``: a ``ValueError`` naming it)."""
        k = _count(prompt_lens, "prompt_lens")
        if max_lens is not None and (got := _count(max_lens, "max_lens")) != k:
            raise ValueError(f"max_lens: expected one per prompt ({k}), got {got}")
        head = min(self.rows_free, self.max_batch)
        p = _int_list(_queue_head(prompt_lens, head, "prompt_lens"), "prompt_lens")  # (plain ints: read fastest)
        lim = None if max_lens is None else _int_list(_queue_head(max_lens, head, "max_lens"), "max_lens")
        room, lanes = self.unreserved, self.max_batch
        if rows is not None:
            r, nn, _ = self._batch(rows, n)
            extra = self._extra(r, nn)
            if extra < 0:          # a row would pass its max_len: the step would be refused
                if refuse:
                    self._refuse_past_max_len("shortfall", r, nn)
                return [], -1
            room -= extra
            lanes -= r.shape[0]
        return self._costs(p, lim, lanes), room

    def _costs(self, prompts, max_lens, lanes) -> list:
        """Unchecked: the pages (and reservation) each of ``prompts`` (ints) with ``max_lens`` (ints, or
        None: the capacity) takes, in order, for as many as the free rows and ``lanes`` allow, up to
        the first that could never be admitted."""
        ps, la, cap, costs = self.page_size, self.lookahead, self.capacity, []
        for i, q in enumerate(prompts[:min(self.rows_free, lanes)]):
            m = cap if max_lens is None else max_lens[i]
            if not 0 <= q <= m <= cap:
                break
            costs.append(_cdiv(min(q + la, m), ps))  # its pages and reservation: _cdiv(q, ps) + _target_new(q, m)
        return costs

    @staticmethod
    def _fit(costs, room) -> int:
        """How many of ``costs``, in order, fit ``room`` pages."""
        n_fit = 0
        for c in costs:
            room -= c
            if room < 0:
                break
            n_fit += 1
        return n_fit

    def fits(self, rows, n=1) -> bool:
        """Whether ``decode(rows, n)`` would run (True) or raise ``WouldNotFit`` (pages).

        Parameters
        ----------
        rows : sequence of int
            Running rows, at most ``max_batch``.
        n : int or sequence of int
            Tokens per row (one for all, or one per row), each at most ``capacity``.

        Returns
        -------
        bool
            False also when ``n`` more tokens would take a row past its max_len (counted from
            its upper bound), which no release makes fit: ``decode`` raises ``ValueError`` for it.

        Raises
        ------
        ValueError
            Bad ``rows`` / ``n``.
        """
        r, n, _ = self._batch(rows, n)
        return 0 <= self._extra(r, n) <= self.unreserved

    def _extra(self, r, n):
        """Pages beyond their reservations that ``n`` more tokens of rows ``r`` need; -1 if a row
        would pass its max_len."""
        per_row = n.ndim > 0
        extra = extra_pages(self._st, r, n if per_row else EMPTY, 0 if per_row else int(n), self.page_size)
        if extra == -2:
            raise AssertionError(f"HostMirror: rows {_head(r)} outside the books (checked before: a bug)")
        return extra

    def preemption(self, rows, priority, n=1, *, count_cached: bool = False) -> list:
        """Which of ``rows`` to release so that ``decode`` of the rest fits: lowest priority first.

        ``priority[i]`` (higher is more important) belongs to ``rows[i]``; ties go to the
        later row (the end of the running queue, as vLLM preempts). Empty when the step
        fits. Release them (``finish``, and requeue) before the step: plainly, since the pages
        of ``finish(victims, cache=True)`` become CACHED, which a step does not take (follow it
        with ``evict``). O(1) when every row of this batch holds its full reservation and
        ``n <= lookahead``.

        A row that ``n`` more tokens would take past its max_len can never fit, whatever
        is released: that is a ``ValueError`` naming the rows (as from ``decode`` and ``step``).

        Parameters
        ----------
        rows : sequence of int
            The running rows of the next step.
        priority : sequence
            One sortable value per row; higher is more important. Read only when a release is
            needed (a bad one is a ``ValueError`` then; an empty answer reads none).
        n : int or sequence of int
            Tokens the step adds per row, as in :meth:`fits`.
        count_cached : bool
            The ``cached`` pages count as room (the caller evicts :meth:`shortfall` of them
            before the step): only what evicting them all would not cover is preempted.

        Returns
        -------
        list of int
            The rows to release, in release order; empty when the step fits.
        """
        r, n, key = self._batch(rows, n)
        if _length(priority, "priority") != r.shape[0]:
            raise ValueError(f"priority: expected one per row ({r.shape[0]}), got {len(priority)}")
        room = self.unreserved + self._evictable(count_cached)
        if key == self._full and n.ndim == 0 and n <= self.lookahead:
            return []  # (``_full``: every row also has room for ``lookahead`` tokens before its max_len)
        extra = self._extra(r, n)
        if extra < 0:
            self._refuse_past_max_len("preemption", r, n)
        if extra <= room:
            return []
        need = self._need(r, n)
        extra = need - np.minimum(need, self.res[r])
        deficit = int(extra.sum()) - room
        out = []
        if deficit <= 0:
            return out
        back = np.maximum(_cdiv(self.lo[r], self.page_size) - self.shared[r], 0) + self.res[r] + extra
        try:
            keys = [(priority[i], -i) for i in range(len(r))]
            if any(p != p for p, _ in keys):  # (a nan compares false with everything: the sort would misplace it)
                raise TypeError
            order = sorted(range(len(r)), key=keys.__getitem__)
        except (TypeError, KeyError, IndexError):
            raise ValueError(f"priority: expected a sequence of values that compare with each other (numbers, "
                             f"no nan), got {priority!r:.80}") from None
        for i in order:
            out.append(int(r[i]))
            deficit -= int(back[i])
            if deficit <= 0:
                break
        return out

    def _refuse_past_max_len(self, what, r, n):
        """Raise the ``ValueError`` (not ``WouldNotFit``: no release makes room) naming the rows of ``r``
        that ``n`` more tokens take past their max_len; return if there is none."""
        past = self.hi[r] + n > self.limit[r]
        if not past.any():
            return
        lo, hi, lim = self.lo[r][past], self.hi[r][past], self.limit[r][past]
        asked = np.broadcast_to(n, r.shape)[past]
        unsure = (lo < hi) & (lo + asked <= lim)  # (past it even at the lower bound: sure)
        why = ("work that can never fit, whatever is released; finish them, or ask fewer tokens" if not unsure.any()
               else f"rows {r[past][unsure].tolist()} are counted at their upper bound after a rollback not "
                    f"reconciled yet (their (lo, hi) bounds: {list(zip(lo[unsure].tolist(), hi[unsure].tolist()))}): "
                    f"reconcile a snapshot taken after the rollback, or ask at most max_len - hi tokens "
                    f"(length_bounds(row)); no release makes room for the rest")
        raise ValueError(f"{what}: rows {r[past].tolist()} would pass their max_len ({lim.tolist()} tokens; "
                         f"{hi.tolist()} now, {asked.tolist()} more asked): {why}")

    def _batch(self, rows, n):
        """Rows as int64 numpy, n as int64 (0-d or one per row), and the rows' bytes; checked
        unless this is the batch checked last and no row started or stopped since."""
        # Every numpy call here costs microseconds when a forward pass has cooled the caches (a
        # scheduler step makes several): the checks are plain compares where they can be, and a
        # list of ints equal to the last one converted (a loop's batch, step after step) reuses that
        # conversion, found by Python compares only (``_same_ints``).
        memo = self._rows_memo
        if type(rows) is list and _same_ints(rows, memo[0]):
            r, key = memo[1], memo[2]
        else:
            r = rows if type(rows) is np.ndarray and rows.dtype is _I64 else _int_array(rows, "rows", "int row ids")
            if r.ndim != 1:
                r = _flat(r, "rows").reshape(-1)  # (a 0-d array: one row; more dimensions refused)
            r = _plain(r)
            key = r.tobytes()
            if type(rows) is list and _exact_ints(rows):
                self._rows_memo = (rows.copy(), r, key)
        if self._checked != (key, self._members):
            if r.shape[0] > self.max_batch:  # the table call would refuse it, after the mirror changed
                raise ValueError(f"rows: expected at most max_batch={self.max_batch} rows in one call (the lanes "
                                 f"of one table call), got {r.shape[0]}")
            if check_rows(r, self.live, self._scratch):
                raise ValueError(_bad_rows(r.tolist(), self.live[:self._st.shape[0]]))  # (rebound: check_rows)
            self._checked = (key, self._members)
        if type(n) is int and 0 <= n <= self.capacity:
            return r, _N64[n] if n < 64 else np.int64(n), key
        memo = self._n_memo
        if type(n) is list and len(n) == r.shape[0] and _same_ints(n, memo[0]):
            self._n_total = memo[1:]
            return r, memo[1], key
        a = _as_array(n, "n")
        if a.dtype is not _I64:  # (int64 as it came, the common case: the message is made only otherwise)
            a = _int_array(a, "n", f"a non-negative int or one int per row ({r.shape[0]})")
        if a.ndim == 1:
            a = _plain(a)
        # (past capacity no row fits it, and hi + n could wrap in int64: refused before the mirror changes)
        total = -1 if a.ndim != 1 or a.shape != r.shape else count_total(a, self.capacity)
        if a.ndim and total < 0 or a.ndim == 0 and not 0 <= a <= self.capacity:
            raise ValueError(f"n: expected a non-negative int or one int per row ({r.shape[0]}), each at most "
                             f"{self.capacity}, {self.capacity_why[0]}, got {_shown(a)}")
        if a.ndim:
            if type(n) is list and _exact_ints(n):
                self._n_memo = (n.copy(), a, total)
            self._n_total = (a, total)
        return r, a, key

    def _tokens(self, n, b) -> int:
        """The tokens of a batch of ``b`` rows taking ``n`` each, as the ``_batch`` call just before returned them."""
        if n.ndim == 0:
            return b * int(n)
        a, total = self._n_total
        return total if n is a else int(n.sum())

    # ------------------------------------------------------ reservations
    def reserve(self, row: int, tokens: int) -> int:
        """Set aside pages for ``tokens`` more tokens of ``row`` (at least its current ones);
        returns the pages it now holds reserved (less than asked if unreserved pages run out).
        Tokens past the row's ``max_len`` are not reserved for (it never grows past it).

        The pages are counted from the row's upper bound ``hi`` (its worst case). They stay
        set aside through reconciliations: one that settles the row's length (after a
        ``rollback``) trims its reservation to what those tokens need from the true length,
        never below (``decode`` takes from the reservation as the row grows into it;
        ``unreserve`` gives it back).

        Parameters
        ----------
        row : int
            A running row.
        tokens : int
            Tokens of growth to reserve for, past its upper bound ``hi``, >= 0.

        Returns
        -------
        int
            The pages the row holds reserved afterwards.
        """
        r, tokens = self._row(row, tokens, "reserve", "tokens")
        row = int(r[0])
        tokens = min(tokens, max(int(self.limit[row]) - int(self.hi[row]), 0))  # never past its max_len
        want = max(int(self._need(r, np.int64(tokens))[0]) - int(self.res[row]), 0)
        got = min(want, max(self.unreserved, 0))
        self.res[row] += got
        self.reserved += got
        self.reserved_to[row] = max(int(self.reserved_to[row]), int(self.hi[row]) + tokens)
        return int(self.res[row])

    def unreserve(self, row: int) -> None:
        """Give back ``row``'s reserved pages (a running row; they become unreserved)."""
        row = int(self._row(row, 0, "unreserve", "n")[0][0])
        self._full = None
        self.reserved -= int(self.res[row])
        self.res[row] = 0
        self.reserved_to[row] = 0

    def _top_up(self, r, res=None):
        """Raise the reservations of rows ``r`` toward their targets, in order, from unreserved
        pages; ``res`` is ``self.res[r]`` if the caller has it. True if every row got its target."""
        if res is None:
            res = self.res[r]
        want = self._target(r) - res
        np.maximum(want, 0, out=want)
        total = int(want.sum())
        if total == 0:
            self.res[r] = res
            return True
        room = self.unreserved
        if total <= room:
            self.res[r] = res + want
            self.reserved += total
            return True
        got = np.minimum(np.maximum(room - (np.cumsum(want) - want), 0), want)
        self.res[r] = res + got
        self.reserved += int(got.sum())
        return False

    def _take_rows(self, k):
        if k > len(self._free_rows):
            raise WouldNotFit(f"rows: {k} requests need rows, {len(self._free_rows)} are free")
        return [self._free_rows.pop() for _ in range(k)]

    def _start(self, rows, length, limit, shared):
        self.lo[rows] = self.hi[rows] = length
        self.limit[rows], self.shared[rows] = limit, shared
        self.live[rows] = True
        self._members += 1
        self.reserved_to[rows] = 0
        self.uncertain_at[rows] = -1
        self.exact_at[rows] = self._seq

    def _target_new(self, length, max_len):
        return _cdiv(min(length + self.lookahead, max_len), self.page_size) - _cdiv(length, self.page_size)
