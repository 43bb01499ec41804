"""Exceptions raised at tpool's sync points.

Note: misuse on the hot path (double free, unknown page, ...) is never raised
where it happens, since that would need a host read. It is counted on the
device and raised by the next ``check()`` as the subclass named below.
"""

from tpool.kernels import layout as L


class PoolError(RuntimeError):
    """Base class. ``counts`` maps every error kind seen since the last check to its count."""

    def __init__(self, message: str, counts: dict | None = None):
        super().__init__(message)
        self.counts = dict(counts or {})


class InvalidPage(PoolError):
    """A page id outside ``[0, num_pages)`` (and not the padding id -1)."""


class DoubleFree(PoolError):
    """A reference was released from a page that held none."""


class UseAfterFree(PoolError):
    """``incref`` or ``touch`` named a FREE page."""


class InvalidCount(PoolError):
    """``alloc`` or ``extend`` received a negative count."""


class OutputOverflow(PoolError):
    """An alloc output buffer was too small for requests the pool could grant."""


class InvalidRequest(PoolError):
    """A page-table request id outside ``[0, max_requests)`` (and not -1)."""


class TableOverflow(PoolError):
    """A request would need more than ``max_pages_per_request`` pages."""


class InvalidLength(PoolError):
    """``truncate`` or ``fork`` asked for a length the request does not have."""


class CorruptState(PoolError):
    """A stored value (a request's length, the free or cached count, a free-stack entry, a table
    entry a fork shares) was outside its static bounds, so the lane or call using it was skipped.
    Only hand edits of the state (or a bug) produce it; no kernel reads or writes past its tensors."""


class RefcountOverflow(PoolError):
    """An ``incref`` or a ``fork`` would have taken a page's reference count past INT32_MAX; the
    count stays at INT32_MAX."""


class InvariantViolation(PoolError):
    """``check_invariants()`` found the state inconsistent (a bug, please report)."""


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


def raise_for_errors(delta: dict) -> None:
    """Raise the class of the first kind (in slot order) with a nonzero count; list all kinds."""
    seen = {slot: n for slot, n in sorted(delta.items()) if n}
    if not seen:
        return
    names = {L.ERROR_NAMES[slot]: n for slot, n in seen.items()}
    text = ", ".join(f"{name}: {n}" for name, n in names.items())
    cls = ERROR_CLASSES[next(iter(seen))]
    raise cls(f"tpool: errors since the last check: {text}", names)
