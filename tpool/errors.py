"""Exceptions raised at tpool's sync points.

Note: misuse on the hot path (double free, unknown page, ...) is never raised
where it happens, since that would need a host read. It is counted on the
device and raised by the next ``check()`` as the subclass named below.
"""

from tpool.kernels import layout as L


class PoolError(RuntimeError):
    """Base class. ``counts`` maps every error kind seen since the last check to its count;
    ``overflows`` the buffers behind an ``out_overflow`` (``alloc_pages``: requests, ``slots``:
    lanes, ``csr_indices``: calls) to theirs, empty when none was counted."""

    def __init__(self, message: str, counts: dict | None = None, overflows: dict | None = None):
        super().__init__(message)
        self.counts = dict(counts or {})
        self.overflows = dict(overflows or {})


class InvalidPage(PoolError):
    """A page id outside ``[0, num_pages)`` (and not the padding id -1) was passed to
    ``free``, ``incref``, ``touch`` or a table's ``revive``; the entry was skipped. A ``revive`` counts a
    -1 too (a prefix has no padding), and a page an earlier entry of its call names, and then takes none of
    its pages. A ``PagedKVCache``'s ``check`` raises it too, for slots or pages outside the cache given to
    ``write`` or ``copy_pages``."""


class DoubleFree(PoolError):
    """A reference was released from a page that held none (``free`` or a table's
    ``release``/``truncate``); the extra release was skipped."""


class UseAfterFree(PoolError):
    """``incref``, ``touch`` or a table's ``revive`` named a FREE page (the entry was skipped; a revive
    takes none of its pages), a ``revive`` with generations named a page freed since they were recorded,
    or a ``fork`` met a page of its source row that is no longer USED (freed or cached through the pool
    while the row named it; that lane failed)."""


class InvalidCount(PoolError):
    """``alloc`` or a page table's ``extend``/``step`` received a negative count: alloc failed
    that request and all later ones in the call, extend and step that lane only."""


class OutputOverflow(PoolError):
    """An output buffer was too small: pages or slots (the requests that did not fit failed,
    unchanged), or a CSR's page ids (the requests past ``capacity`` were exported with no pages;
    a step appended their tokens). ``overflows`` says which: ``alloc_pages`` (requests; pass a
    larger ``max_alloc_pages`` or ``out=pool.alloc_out(max_pages=...)``), ``slots`` (lanes;
    ``max_tokens``), ``csr_indices`` (calls; ``capacity``)."""


class InvalidRequest(PoolError):
    """A page-table lane named a request it may not: an id outside ``[0, max_requests)`` (and not -1),
    an id named twice in one call (every lane after its first), a ``fork`` into a request that is not
    empty (or from itself), or a ``revive`` into a row that is not empty; the lane was skipped."""


class TableOverflow(PoolError):
    """A request would need more than ``max_pages_per_request`` pages; it failed, unchanged."""


class InvalidLength(PoolError):
    """``truncate`` or ``fork`` asked for a length the request does not have; the lane was skipped."""


class CorruptState(PoolError):
    """A stored value (a request's length, the free or cached count, a free-stack entry, a table
    entry a fork shares) was outside its static bounds, so the lane or call using it was skipped.
    Only hand edits of the state (or a bug) produce it; no kernel reads or writes past its tensors."""


class RefcountOverflow(PoolError):
    """An ``incref`` or a ``fork`` would have taken a page's reference count past INT32_MAX; the
    count stays at INT32_MAX."""


class InvariantViolation(PoolError):
    """``check_invariants()`` found the state inconsistent (a bug, please report)."""


def first_breach(broken):
    """Where a rule of ``check_invariants`` broke first: the index of the first True of the bool tensor
    ``broken`` (an int; a list of ints for more dimensions), or None when the rule holds everywhere."""
    at = broken.nonzero()
    if not at.shape[0]:
        return None
    return at[0].tolist() if broken.dim() > 1 else int(at[0, 0])


ERROR_CLASSES = {
    L.ERR_INVALID_PAGE: InvalidPage,
    L.ERR_DOUBLE_FREE: DoubleFree,
    L.ERR_USE_AFTER_FREE: UseAfterFree,
    L.ERR_BAD_COUNT: InvalidCount,
    L.ERR_OUT_OVERFLOW: OutputOverflow,
    L.ERR_BAD_REQUEST: InvalidRequest,
    L.ERR_TABLE_OVERFLOW: TableOverflow,
    L.ERR_BAD_LENGTH: InvalidLength,
    L.ERR_CORRUPT_STATE: CorruptState,
    L.ERR_REFCOUNT_OVERFLOW: RefcountOverflow,
}


# What each kind means and which argument to change, shown under the counts by check().
HINTS = {
    L.ERR_INVALID_PAGE: (
        "a page id outside [0, num_pages) (and not the padding id -1) was passed to free, incref, touch or a "
        "table's revive, or a revive named -1 (a prefix has no padding) or one page twice; the entry was skipped "
        "(a revive then takes none of its pages). Pass only ids this pool's alloc returned, or -1 for padding "
        "(not to revive: its pages are a prefix's, each once)."),
    L.ERR_DOUBLE_FREE: (
        "a page lost more references than it held (free or a table's release/truncate of a page already "
        "freed); the extra release was skipped. Free each granted page once per reference (incref adds one), "
        "and do not free pages a PageTable holds: release the request instead."),
    L.ERR_USE_AFTER_FREE: (
        "incref, touch or a revive named a FREE page (freed earlier, or never allocated), or a revive with "
        "generations named a page whose generation changed since it was recorded (evicted or freed, perhaps "
        "handed to another request since); the entry was skipped (a revive then takes none of its pages). Or a "
        "fork met a page of its source row that is not USED (freed or cached through the pool while the row "
        "named it); that lane failed (ok False, nothing shared). Keep a reference (or cache=True on free) while "
        "the page is in use, do not free pages a PageTable holds (release the request instead); record "
        "pool.generations(pages) when a prefix-cache entry is made."),
    L.ERR_BAD_COUNT: (
        "alloc, or a page table's extend or step, received a negative count. alloc failed that request and "
        "every later one in the call; extend and step failed that lane only (ok False, nothing appended), the "
        "other lanes took their tokens. Pass counts and num_tokens >= 0 (0 for padding lanes)."),
    L.ERR_OUT_OVERFLOW: "an output buffer was too small",  # then what OVERFLOW_HINTS says of each buffer
    L.ERR_BAD_REQUEST: (
        "a page-table lane named a request it may not: an id outside [0, max_requests) (and not the padding "
        "id -1), an id named twice in one call (every lane after its first), a fork into a request "
        "that is not empty (or from itself), or a revive into a row that is not empty; the lane was skipped. "
        "Pass ids below max_requests (or make the PageTable with a larger max_requests), each id once per "
        "call, and fork or revive into released rows."),
    L.ERR_TABLE_OVERFLOW: (
        "a request would need more than max_pages_per_request pages; it failed and is unchanged. Make the "
        "PageTable with a larger max_pages_per_request (at least ceil(longest sequence / page_size)), or "
        "stop the request before it reaches that length."),
    L.ERR_BAD_LENGTH: (
        "truncate or fork asked for a length the request does not have (negative, or longer than it is), "
        "or a truncate would end inside a page another request also holds (a fork's shared prefix, a "
        "revived page: the next token would overwrite that request's K/V); the lane was skipped. Pass "
        "0 <= length <= the request's current length (seq_lens), and truncate a request that shares "
        "pages only to a page boundary or past the shared pages."),
    L.ERR_CORRUPT_STATE: (
        "a stored value (a request length, a free or cached count, a free-stack entry, a page state, the "
        "LRU queue's head or tail, or fewer live LRU-queue entries than CACHED pages) was outside its "
        "bounds, so the lane or call that met it was skipped: the state was edited by hand or overwritten. "
        "Restore a snapshot (tpool.graphs.preserved) or rebuild the pool; "
        "check_invariants() names the broken invariant. After a deliberate edit of block_table or seq_lens, "
        "call table.invalidate_csr()."),
    L.ERR_REFCOUNT_OVERFLOW: (
        "an incref (or a fork's sharing) would take a page's reference count past 2**31 - 1; the count "
        "stays there and those references were not added. Drop references you no longer need (free) "
        "before adding more."),
}


# The buffers behind out_overflow (each counts in its own slot too): what one count is, what overflowed and
# what it did, what to pass.
OVERFLOW_HINTS = {
    "alloc_pages": ("request", (
        "PagePool.alloc needed more pages than its output holds: without out= at most max_alloc_pages "
        "(default min(num_pages, 4096)), with out= that buffer's max_pages. Pass PagePool(..., "
        "max_alloc_pages=N), or out=pool.alloc_out(max_pages=N). The requests that did not fit failed and "
        "are unchanged")),
    "slots": ("lane", (
        "PageTable.extend/step had more tokens than its slot buffer holds: max_tokens (default one per "
        "lane, a decode step; for bind_step and step_out the max_tokens they were made with). For a "
        "prefill pass max_tokens= the batch's total tokens. The requests that did not fit failed and are "
        "unchanged")),
    "csr_indices": ("call", (
        "flashinfer_csr or a step had more page ids than the CSR's capacity: pass a larger capacity (or "
        "None, always enough). The first request whose pages did not fit and every later one were "
        "exported with no pages (last_page_len page_size; a step's kv_lens 0), though a step appended "
        "their tokens")),
}


def _advice(name: str, n: int, overflows: dict) -> str:
    """What kind ``name`` (counted ``n`` times) means and which argument to change; for out_overflow,
    of each buffer in ``overflows`` (all three when none is: the counters were edited by hand)."""
    if name != "out_overflow":
        return HINTS[L.ERROR_SLOTS[name]]
    if not overflows:
        each = "; ".join(f"{b}: {hint}" for b, (_, hint) in OVERFLOW_HINTS.items())
        return f"{HINTS[L.ERR_OUT_OVERFLOW]}, which one was not recorded (counters edited by hand?): {each}."
    parts = [f"{b} ({k} {unit}{'s' * (k != 1)}): {hint}" for b, k in overflows.items()
             for unit, hint in [OVERFLOW_HINTS[b]]]
    if sum(overflows.values()) != n:
        parts.append(f"the buffers' counts add up to {sum(overflows.values())}, not {n} (counters edited by hand?)")
    return f"{HINTS[L.ERR_OUT_OVERFLOW]}: {'; '.join(parts)}."


def describe(counts: dict, overflows: dict | None = None) -> str:
    """The message for ``counts`` (kind name -> count) and ``overflows`` (the buffers behind an
    out_overflow -> count): one line of counts, then one line per kind."""
    head = ", ".join(f"{name}: {n}" for name, n in counts.items())
    lines = [f"tpool: errors since the last check: {head}"]
    lines += [f"  {name} ({n}): {_advice(name, n, overflows or {})}" for name, n in counts.items()]
    return "\n".join(lines)


def raise_for_errors(delta: dict) -> None:
    """Raise the class of the first kind (in slot order) with a nonzero count; describe all kinds.
    ``delta``: counter slot -> count since the last check, for ``ERROR_NAMES`` and ``OVERFLOW_NAMES``."""
    seen = {slot: n for slot, n in sorted(delta.items()) if n and slot in L.ERROR_NAMES}
    if not seen:
        return
    names = {L.ERROR_NAMES[slot]: n for slot, n in seen.items()}
    overflows = {}
    if "out_overflow" in names:
        overflows = {b: delta[slot] for slot, b in L.OVERFLOW_NAMES.items() if delta.get(slot)}
    cls = ERROR_CLASSES[next(iter(seen))]
    raise cls(describe(names, overflows), names, overflows)


class StaleBinding(ValueError):
    """A bound call's input tensors no longer have the memory or length they were bound with
    (``PageTable.bind_step``, ``PagePool.bind_alloc``, ``PagePool.bind_free``)."""
