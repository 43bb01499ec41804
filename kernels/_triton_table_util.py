"""Helpers for the page-table Triton kernels: request claims and page lists.

Note: like the pool kernels (see ``_triton_util``), every table kernel is ONE
program that loops over fixed-size chunks and separates its phases with
``tl.debug_barrier()``. Three patterns recur:

* Request ids are deduplicated by ``atomic_min(claim[r], lane)``; after a
  barrier the lane with ``claim[r] == lane`` is ``r``'s first (valid) lane.
  Claims go back to INT32_MAX for every id, write-only (``reset_requests``),
  after a barrier behind the last phase that reads them, so no lane mistakes
  a reset claim for its own. A value a hand edit left in a claim acts as a
  lane: below a request's first lane, that request has no valid lane
  (its lanes count ``bad_request``); the reset then clears it. numba's
  ``claim_requests`` keeps the same rule (its step's decode fast path, from
  the memo, reads no claim).
* Pages a call frees or shares form a list in (lane, column) order. The lane
  pass writes each lane's running end into the ``lane_end`` scratch; entry
  ``f`` of the list belongs to the first lane whose end exceeds ``f``
  (``list_lane``, a binary search), so passes over the list cost its length,
  not the batch times its widest lane. Pages are deduplicated like the pool's
  ``free``: ``atomic_min(claim[p], f)`` picks the first occurrence (with
  ``LAST``, a release into the cache, the key is ``-f``: the last),
  ``atomic_add(occur[p], 1)`` counts them (both order-free).
* Besides ``lane_end``, no kernel keeps per-lane results in scratch: later
  phases read them back from the call's outputs (``ok``, ``indptr``) or
  recompute them from the inputs and from state that only the last phase
  writes.
"""

from ._triton_shim import tl, triton

from . import layout as L
from ._triton_util import INT32_MAX, NULL_PAGE, lane_key

ERR_BAD_REQUEST = tl.constexpr(L.ERR_BAD_REQUEST)
ERR_TABLE_OVERFLOW = tl.constexpr(L.ERR_TABLE_OVERFLOW)
ERR_BAD_LENGTH = tl.constexpr(L.ERR_BAD_LENGTH)


@triton.jit
def cdiv(a, b):
    """``ceil(a / b)`` for ``a >= 0``, ``b > 0``, with no ``a + b - 1`` that could pass INT32_MAX."""
    return a // b + (a % b > 0)


# ------------------------------------------------------------------- requests
@triton.jit
def claim_requests(ids_ptr, B, claim_ptr, R, BLOCK: tl.constexpr):
    """Claim pass: ``claim[r] = min(lanes naming r)`` for every in-range request id."""
    lanes = tl.arange(0, BLOCK)
    for start in range(0, B, BLOCK):
        i = start + lanes
        r = tl.load(ids_ptr + i, mask=i < B, other=NULL_PAGE)
        inr = (r >= 0) & (r < R)
        tl.atomic_min(claim_ptr + r, i, mask=inr, sem="relaxed")


@triton.jit
def request_lanes(ids_ptr, i, B, claim_ptr, R):
    """``(row, valid, pad, live)`` for lanes ``i``: valid = in range and the row's first lane."""
    live = i < B
    r = tl.load(ids_ptr + i, mask=live, other=NULL_PAGE)
    inr = (r >= 0) & (r < R)
    valid = inr & (tl.load(claim_ptr + r, mask=inr, other=-1) == i)
    return r, valid, live & (r == NULL_PAGE), live


@triton.jit
def reset_requests(ids_ptr, B, claim_ptr, R, BLOCK: tl.constexpr):
    """Restore ``claim = INT32_MAX`` for every in-range request id (write-only)."""
    lanes = tl.arange(0, BLOCK)
    for start in range(0, B, BLOCK):
        i = start + lanes
        r = tl.load(ids_ptr + i, mask=i < B, other=NULL_PAGE)
        tl.store(claim_ptr + r, tl.full((BLOCK,), INT32_MAX, tl.int32), mask=(r >= 0) & (r < R))


# ---------------------------------------------------------------- page lists
def check_lane_scratch(B: int, ts) -> None:
    """The lane pass writes B entries of ``lane_end`` (host-side check, before the launch)."""
    if B > ts.lane_end.numel():
        raise ValueError(f"req_ids: expected at most {ts.lane_end.numel()} entries (the pool's max_batch), got {B}")


@triton.jit
def list_lane(f, live, lane_end_ptr, B, SEARCH):
    """``(lane, first entry of that lane)`` of list entries ``f`` (``live``: ``f`` < the list's
    length): the smallest ``i`` with ``lane_end[i] > f``, by SEARCH = B.bit_length() halvings."""
    lo = tl.zeros(f.shape, tl.int32)
    hi = tl.zeros(f.shape, tl.int32) + B
    for _ in range(SEARCH):  # the answer stays in [lo, hi]; mid < hi <= B, so loads stay in range
        mid = lo + (hi - lo) // 2  # (lo + hi wraps in int32 past 2**30 lanes)
        active = live & (lo < hi)
        right = tl.load(lane_end_ptr + mid, mask=active, other=0) <= f
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & ~right, mid, hi)
    start = tl.load(lane_end_ptr + lo - 1, mask=live & (lo > 0), other=0)
    return lo, start


@triton.jit
def claim_pages(p, f, m, claim_ptr, occur_ptr, num_pages, LAST: tl.constexpr):
    """First entry (min ``f``; ``LAST``: last, max ``f``) and occurrences per page for entries ``m``;
    returns #invalid ids."""
    ok = m & (p >= 0) & (p < num_pages)
    tl.atomic_min(claim_ptr + p, lane_key(f.to(tl.int32), LAST), mask=ok, sem="relaxed")
    tl.atomic_add(occur_ptr + p, 1, mask=ok, sem="relaxed")
    return tl.sum((m & (p != NULL_PAGE) & ~ok).to(tl.int64))


@triton.jit
def first_pages(p, f, m, claim_ptr, occur_ptr, num_pages, LAST: tl.constexpr):
    """``(first occurrence? (LAST: last occurrence?), occurrences)`` of entries ``m`` (after
    ``claim_pages`` and a barrier)."""
    ok = m & (p >= 0) & (p < num_pages)
    first = ok & (tl.load(claim_ptr + p, mask=ok, other=-1) == lane_key(f.to(tl.int32), LAST))
    return first, tl.load(occur_ptr + p, mask=first, other=0)


@triton.jit
def reset_pages(p, m, claim_ptr, occur_ptr, num_pages):
    """Restore ``claim = INT32_MAX`` and ``occur = 0`` for the pages of entries ``m``."""
    ok = m & (p >= 0) & (p < num_pages)
    tl.store(claim_ptr + p, tl.zeros_like(p).to(tl.int32) + INT32_MAX, mask=ok)
    tl.store(occur_ptr + p, tl.zeros_like(p).to(tl.int32), mask=ok)
