"""Capacity planning: how many pages fit, from a static memory fraction.

Note:
    A fraction of the device's TOTAL memory (``torch.cuda.mem_get_info``'s
    total, or ``total_bytes``) is the static budget for weights and the KV
    pool; the rest is the runtime reserve (activations, workspaces, CUDA
    graph pools) that the engine allocates later. Free memory is measured
    after the weights are loaded (after ``torch.cuda.empty_cache()``, so
    blocks PyTorch freed but still caches count as free), and everything in
    use then (weights, CUDA context, other libraries and processes) comes
    out of the static budget::

        in use        U = total - free + pending      (pending: weights not loaded yet)
        static        S = floor(total * fraction)
        reserve       R = total - S                   (runtime reserve)
        page table    T = PageTable state bytes       (0 unless max_requests, max_len, page_size are given)
        pool budget   P = S - U - extra_reserve - T   ( = free - pending - R - extra - T )
        pages         N = min(P // bytes_per_page, max_pages, MAX_INDEXED)

    ``T`` is what ``PageTable(pool, max_requests, ceil(max_len / page_size))`` on a
    pool of ``max_batch`` allocates when it is made (``tpool.state.table_state_bytes``,
    read off its layout): the block table, ``max_requests x max_pages_per_request``
    int32 (128 MiB for 256 requests of 128k tokens at page_size 1), the lengths and
    the per-row and per-lane scratch. It is as static as the pool, so the static
    budget holds it; pass it only when the table is not made yet when ``free`` is
    measured (as ``weights_bytes`` for weights not loaded yet). The output buffers
    of the table's call shapes (slots, CSR) depend on the batches an engine runs
    and come out of the runtime reserve. With a table planned, ``N`` also stops at
    ``INT32_MAX // page_size``: a table refuses a pool whose slots pass int32.

    The base differs from the engines' knobs of the same name:

    * SGLang's ``mem_fraction_static`` applies to the free memory measured
      BEFORE the weights load (after distributed init, the minimum across TP
      ranks), not to the total: its pool gets
      ``free_after_load - free_before_load * (1 - fraction)``. Here the pool
      gets ``free_after_load - total * (1 - fraction)``, which is
      ``(1 - fraction) * (CUDA context + other processes' memory)`` less
      (at 0.88: 0.12 x 0.5 GiB = 61 MiB for a CUDA context; 0.12 x 20.5 GiB
      = 2.46 GiB with another process holding 20 GiB as well). Pass ``total_bytes`` = the free memory before
      the weights to get SGLang's number.
    * vLLM's ``gpu_memory_utilization`` is also a share of the total, but
      its budget must hold the profiled activation peak and the non-torch
      memory too, which here come out of the runtime reserve instead.

    The fraction is read as the decimal it is written as (0.88 is 22/25),
    so the numbers are exact. When ``N < min_pages`` (the weights already
    fill the static budget) :class:`PlanError` names the smallest fraction,
    rounded up to 0.01, that would give ``min_pages`` pages and leave room
    beside them (to 0.001 or 0.0001 when no multiple of 0.01 does: rounding
    up by up to 0.01 of a device adds pages that can take that room).

    ``N`` is the number of pages to ask for, and ``pool`` = ``N x
    bytes_per_page`` their K/V only: ``PagedKVCache.from_pool`` of an
    ``N``-page ``PagePool`` allocates ``N + 1`` pages (one scratch page), and
    the pool keeps its state (``pool.memory_bytes()["state_bytes"]``, 61
    bytes a page today); these come out of the runtime reserve, not the pool
    budget (:meth:`PagePlan.explain` says so, with the state's bytes for ``N``
    pages read off the pool's layout).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch

from tpool._checks import check_page_size, check_size, check_table_bounds, most_table_pages, resolve_device
from tpool.kernels.layout import MAX_INDEXED
from tpool.pool import DEFAULT_MAX_BATCH
from tpool.state import pool_state_bytes, table_state_bytes

__all__ = ["plan_pages", "PagePlan", "PlanError"]

GIB = 1 << 30  # bytes in a GiB, for explain()
FRACTION_STEP = 100  # suggested fractions are rounded to 1 / FRACTION_STEP ...
FINER_STEPS = (1000, 10000)  # ... or, where no such fraction works, to the coarsest of these that does


class PlanError(ValueError):
    """The static budget leaves too little for the pool; ``suggested_fraction`` fixes it (None if nothing can).

    ``suggested_fraction`` has a default so that the error survives ``pickle`` and ``copy``, which rebuild an
    exception from its message alone and then restore its attributes (an engine's worker process sends its
    exceptions to the driver pickled)."""

    def __init__(self, message: str, suggested_fraction: float | None = None):
        super().__init__(message)
        self.suggested_fraction = suggested_fraction


@dataclass(frozen=True)
class PagePlan:
    """Every number of the plan (bytes unless named otherwise)."""

    bytes_per_page: int
    mem_fraction_static: float
    total_bytes: int
    free_bytes: int  # as measured or given
    pending_weights_bytes: int  # weights still to load when free_bytes was measured
    used_bytes: int  # total - free + pending weights
    static_budget_bytes: int  # floor(total * fraction)
    runtime_reserve_bytes: int  # total - static budget
    extra_reserve_bytes: int  # kept back inside the static budget
    table_bytes: int  # the state a PageTable of max_requests x max_pages_per_request allocates (0: none planned)
    max_requests: int | None  # the table's rows (None: no table planned)
    max_pages_per_request: int | None  # ceil(max_len / page_size): PageTable's third argument (None: no table)
    page_size: int | None  # tokens a page, as given for the table: PagePool's page_size (None: no table)
    max_batch: int | None  # the pool's max_batch the table's lane scratch is sized for (None: no table)
    pool_budget_bytes: int  # static budget - used - extra reserve - table
    num_pages: int
    pool_bytes: int  # num_pages * bytes_per_page
    source: str  # where total and free came from ("given", measured, or which of the two was given)

    def explain(self) -> str:
        """The arithmetic, one line per step, with bytes and GiB.

        Returns
        -------
        str
            Eight lines: total, free, in use, static budget, runtime reserve,
            extra reserve, pool budget, pool; each with its bytes, GiB and
            where it comes from, and a ninth, page table, before the pool
            budget when the plan counts one. Then one note: a
            ``PagedKVCache`` built on a pool of ``num_pages`` pages also takes
            one scratch page, and the pool its state (its bytes read off the
            layout), from the runtime reserve (and a planned table the output
            buffers of its call shapes). With no page planned (``min_pages=0``)
            the note says instead why no pool fits: by how many bytes the static
            budget is short of what it must hold first (weights or a table alike),
            or that the pool budget holds no page.

        Example
        -------
        >>> plan = plan_pages(2 << 20, 0.8, total_bytes=80 << 30, free_bytes=60 << 30)
        >>> print(plan.explain())
        total                  85,899,345,920 B     80.00 GiB   given
        free                   64,424,509,440 B     60.00 GiB   with the weights loaded
        in use                 21,474,836,480 B     20.00 GiB   total - free + pending weights (weights, context, other)
        static budget          68,719,476,736 B     64.00 GiB   total x 0.8
        runtime reserve        17,179,869,184 B     16.00 GiB   total - static budget (activations, graphs)
        extra reserve                       0 B      0.00 GiB   kept back inside the static budget
        pool budget            47,244,640,256 B     44.00 GiB   static budget - in use - extra reserve
        pool                   47,244,640,256 B     44.00 GiB   22,528 pages x 2,097,152 B
        note: PagedKVCache.from_pool adds 1 scratch page (2,097,152 B), PagePool state 1,374,640 B: from the reserve
        """
        table = self.max_requests is not None
        block = self.max_requests * self.max_pages_per_request * 4 if table else 0  # int32 entries
        rows = [
            ("total", self.total_bytes, self.source),
            ("free", self.free_bytes, "with the weights loaded" if not self.pending_weights_bytes
             else f"before {self.pending_weights_bytes:,} B of weights are loaded"),
            ("in use", self.used_bytes, "total - free + pending weights (weights, context, other)"),
            ("static budget", self.static_budget_bytes, f"total x {self.mem_fraction_static}"),
            ("runtime reserve", self.runtime_reserve_bytes, "total - static budget (activations, graphs)"),
            ("extra reserve", self.extra_reserve_bytes, "kept back inside the static budget"),
            *([("page table", self.table_bytes, f"PageTable({self.max_requests:,} x {self.max_pages_per_request:,}): "
                f"block table {block:,} B + lengths and scratch (page_size {self.page_size:,}, max_batch "
                f"{self.max_batch:,})")] if table else []),
            ("pool budget", self.pool_budget_bytes, "static budget - in use - extra reserve"
             + (" - page table" if table else "")),
            ("pool", self.pool_bytes, f"{self.num_pages:,} pages x {self.bytes_per_page:,} B"),
        ]
        lines = [f"{name:<16} {value:>20,} B {value / GIB:>9.2f} GiB   {why}" for name, value, why in rows]
        if not self.num_pages:  # (min_pages=0: no pool, so nothing beside it either)
            if self.pool_budget_bytes >= self.bytes_per_page:
                lines.append("note: no pool (max_pages=0)")
                return "\n".join(lines)
            kept = "what is in use, the extra reserve and the page table" if table else \
                "what is in use and the extra reserve"
            why = f"the static budget is {-self.pool_budget_bytes:,} B short of {kept}" \
                if self.pool_budget_bytes < 0 else f"the pool budget holds no page of {self.bytes_per_page:,} B"
            lines.append(f"note: no pool fits ({why}); plan_pages(..., min_pages=1) raises a PlanError naming the "
                         "fraction that gives one, if any")
            return "\n".join(lines)
        # (not in the pool line: see the module note)
        shapes = ", the PageTable's call-shape buffers (slots, CSR)" if table else ""
        lines.append(f"note: PagedKVCache.from_pool adds 1 scratch page ({self.bytes_per_page:,} B), PagePool "
                     f"state {pool_state_bytes(self.num_pages):,} B{shapes}: from the reserve")
        return "\n".join(lines)


def _measure(device, total_bytes, free_bytes) -> tuple[int, int, str]:
    if total_bytes is not None and free_bytes is not None:
        return total_bytes, free_bytes, "given"
    given = f"got total_bytes={total_bytes!r}, free_bytes={free_bytes!r}"
    try:
        device = resolve_device(device)
    except ValueError as e:
        raise ValueError(f"{e}; or pass both total_bytes and free_bytes ({given})") from None
    if device.type != "cuda":
        raise ValueError(f"total_bytes and free_bytes are required on {device} (no driver to ask), {given}")
    with torch.cuda.device(device):
        # Blocks PyTorch freed but still caches are reusable by the pool: return them to the driver
        # first, or mem_get_info counts them as in use (as SGLang's get_available_gpu_memory does).
        torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    measured = f"torch.cuda.mem_get_info({device}) after empty_cache()"
    # One of the two may be given (total_bytes = the free memory before the weights, SGLang's base): say which.
    source = measured if total_bytes is None and free_bytes is None else \
        f"given; free: {measured}" if free_bytes is None else f"{measured}; free given"
    return (total if total_bytes is None else total_bytes, free if free_bytes is None else free_bytes, source)


def _decimal(fraction: Fraction) -> str:
    """A suggested fraction (a multiple of 0.01, 0.001 or 0.0001) written exactly: 0.94, 0.90, 0.994."""
    digits = next(d for d in range(2, 5) if (fraction * 10 ** d).denominator == 1)
    return f"{float(fraction):.{digits}f}"


def _table(max_requests, max_len, page_size, max_batch) -> tuple:
    """``(bytes, max_requests, max_pages_per_request, page_size, max_batch, most pages)`` of the PageTable
    the arguments describe (``max_batch`` PagePool's default when not given), checked as ``PagePool`` and
    ``PageTable`` check theirs; ``(0, None, None, None, None, MAX_INDEXED)`` when none is given."""
    given = {"max_requests": max_requests, "max_len": max_len, "page_size": page_size}
    if all(v is None for v in given.values()):
        if max_batch is not None:
            raise ValueError(f"max_batch sizes a PageTable's scratch: expected max_requests, max_len and page_size "
                             f"with it, got max_batch={max_batch!r} alone")
        return 0, None, None, None, None, MAX_INDEXED
    if any(v is None for v in given.values()):
        got = ", ".join(f"{k}={v!r}" for k, v in given.items())
        missing = ", ".join(k for k, v in given.items() if v is None)
        raise ValueError(f"a PageTable is planned from max_requests, max_len and page_size together: expected all "
                         f"three, got {got} (missing {missing})")
    max_requests, max_len, page_size = (check_size(v, k, 1) for k, v in given.items())
    max_batch = DEFAULT_MAX_BATCH if max_batch is None else check_size(max_batch, "max_batch", 1)
    if max_batch > MAX_INDEXED:
        raise ValueError(f"max_batch: expected at most {MAX_INDEXED} (the most a PagePool takes), got {max_batch}")
    check_page_size(page_size)  # PagePool's check
    pages = -(-max_len // page_size)
    # PageTable's checks, naming the planner's arguments; its pool's slots (num_pages * page_size) are int32
    # too, which the plan meets by stopping the pages at most_table_pages(page_size)
    check_table_bounds(max_requests, pages, page_size, named="max_len", pages_is="ceil(max_len / page_size)",
                       given=f" (max_len={max_len})")
    return (table_state_bytes(max_requests, pages, max_batch), max_requests, pages, page_size, max_batch,
            most_table_pages(page_size))


def plan_pages(bytes_per_page: int, mem_fraction_static: float, *, device=None, total_bytes: int | None = None,
               free_bytes: int | None = None, reserve_bytes: int = 0, weights_bytes: int | None = None,
               min_pages: int = 1, max_pages: int | None = None, max_requests: int | None = None,
               max_len: int | None = None, page_size: int | None = None, max_batch: int | None = None) -> PagePlan:
    """Plan the page count of a KV pool.

    Parameters
    ----------
    bytes_per_page : int
        Bytes one page takes on the device (all layers, K and V), > 0.
    mem_fraction_static : float
        In (0, 1]: share of total device memory for weights + pool (a
        Python or numpy float, read as the decimal it prints as, so
        ``np.float32(0.8)`` is 4/5; a Python or numpy int; a ``Fraction``;
        a bool is refused).
    device : torch.device, str or int, optional
        CUDA device to measure when total or free is not given: after
        ``torch.cuda.empty_cache()`` (so memory PyTorch freed but still
        caches counts as free), ``torch.cuda.mem_get_info``; default the
        current CUDA device. Unused when both are given.
    total_bytes, free_bytes : int, optional
        Device total (>= 1) and free (>= 0, <= total) memory in bytes; each
        one not given is measured. Both are required without CUDA.
    reserve_bytes : int
        Extra memory kept back inside the static budget, >= 0 (default 0).
    weights_bytes : int, optional
        Weights NOT yet loaded when ``free_bytes`` was measured, >= 0
        (None: loaded).
    min_pages : int
        Fewest pages accepted (fewer fit: :class:`PlanError`), >= 0 and at
        most ``MAX_INDEXED``; default 1. With 0, a plan of 0 pages is an
        answer, not an error, even where what is in use (or a planned table)
        passes the static budget: ``pool_budget_bytes`` is then negative and
        :meth:`PagePlan.explain` says by how much.
    max_pages : int, optional
        Most pages wanted, >= ``min_pages``; default, and at most, the most
        a ``PagePool`` takes (``MAX_INDEXED``, 2**31 - 2**16), and with a
        table planned at most ``INT32_MAX // page_size`` (its slots are int32).
    max_requests, max_len, page_size : int, optional
        The ``PageTable`` to plan for, all three or none: its rows (the most
        requests holding pages at once), the longest request in tokens, and
        the pool's page size (the page ``bytes_per_page`` describes), each
        >= 1. The table's state, with ``max_pages_per_request =
        ceil(max_len / page_size)``, comes out of the static budget (module
        note); leave them out if the table exists when ``free_bytes`` is
        measured. None: no table counted, as before.
    max_batch : int, optional
        The pool's ``max_batch`` (``PagePool(..., max_batch=)``), which sizes
        the table's per-lane scratch (int32 ``[max_batch]``); only with a
        table; default ``PagePool``'s, 4096.

    Returns
    -------
    PagePlan
        Every number of the arithmetic in the module note; ``num_pages`` is
        the answer and :meth:`PagePlan.explain` prints the steps. With a
        table planned, ``page_size`` and ``max_batch`` (``PagePool``'s default
        when not given) are recorded too: ``PagePool(plan.num_pages,
        plan.page_size, max_batch=plan.max_batch)`` and ``PageTable(pool,
        plan.max_requests, plan.max_pages_per_request)`` are what was planned.

    Raises
    ------
    PlanError
        Fewer than ``min_pages`` pages fit; its ``suggested_fraction`` is the
        smallest fraction (rounded up to 0.01, or to 0.001 or 0.0001 when no
        multiple of 0.01 works) that gives ``min_pages`` and room beside them,
        or None if none does (a table planned counts in both). Or the memory left beside the pool (the
        runtime reserve, at a fraction near 1) cannot hold its scratch page
        and state; ``suggested_fraction`` is then the largest smaller fraction
        that can (the same steps). A subclass of ``ValueError``.
    ValueError
        An argument of the wrong type (a bool is not a size or a fraction)
        or out of its range, ``free_bytes > total_bytes``, or total or free
        not given and no CUDA device to measure them on (``device`` not a
        cpu or cuda device, CUDA unavailable, an index out of range, or the
        CPU); some but not all of ``max_requests``, ``max_len`` and
        ``page_size``, or ``max_batch`` without them; a table that
        ``PageTable`` or ``PagePool`` refuses (``max_pages_per_request *
        page_size`` over ``INT32_MAX``, more than ``MAX_INDEXED`` entries,
        ``max_batch`` over ``MAX_INDEXED``), or ``min_pages`` over
        ``INT32_MAX // page_size``.

    Example
    -------
    80 GiB device, 60 GiB free after the weights, fraction 0.8, 2 MiB pages:
    S = 64 GiB, U = 20 GiB, P = 44 GiB, N = 22_528.

    >>> plan_pages(2 << 20, 0.8, total_bytes=80 << 30, free_bytes=60 << 30).num_pages
    22528

    The same device with a table for 256 requests of 128k tokens at page_size 16
    (8,192 pages a request): its block table is 256 x 8,192 x 4 B = 8 MiB, and
    with the lengths and scratch (256 x 16 B a row, 4,096 x 4 B a lane, 16 B)
    the table takes 8,409,104 B of the pool budget, just over four pages: five pages fewer.

    >>> p = plan_pages(2 << 20, 0.8, total_bytes=80 << 30, free_bytes=60 << 30,
    ...                max_requests=256, max_len=128 << 10, page_size=16)
    >>> p.table_bytes, p.max_pages_per_request, p.num_pages
    (8409104, 8192, 22523)
    """
    bytes_per_page = check_size(bytes_per_page, "bytes_per_page", 1)
    reserve_bytes = check_size(reserve_bytes, "reserve_bytes", 0)
    min_pages = check_size(min_pages, "min_pages", 0)
    if min_pages > MAX_INDEXED:  # (PagePool refuses more pages: its kernels' chunk offsets are int32)
        raise ValueError(f"min_pages: expected at most {MAX_INDEXED} (the most pages a PagePool takes), "
                         f"got {min_pages}")
    table_bytes, max_requests, pages_per_request, page_size, max_batch, most = _table(max_requests, max_len,
                                                                                      page_size, max_batch)
    if min_pages > most:
        raise ValueError(f"min_pages: expected at most {most} (INT32_MAX // page_size: a PageTable refuses a pool "
                         f"whose slots pass int32), got {min_pages}")
    max_pages = most if max_pages is None else min(check_size(max_pages, "max_pages", min_pages), most)
    if isinstance(mem_fraction_static, (bool, np.bool_)) or \
            not isinstance(mem_fraction_static, (numbers.Integral, float, np.floating, Fraction)):
        raise ValueError(f"mem_fraction_static: expected a float in (0, 1], got a {type(mem_fraction_static).__name__} "
                         f"({mem_fraction_static!r}); pass a float such as 0.8")
    if not 0 < mem_fraction_static <= 1:
        raise ValueError(f"mem_fraction_static: expected a float in (0, 1], got {mem_fraction_static!r}")
    total, free, source = _measure(device, total_bytes, free_bytes)
    total = check_size(total, "total_bytes", 1)
    free = check_size(free, "free_bytes", 0)
    if free > total:
        raise ValueError(f"free_bytes must be <= total_bytes ({total}), got {free}")
    pending = 0 if weights_bytes is None else check_size(weights_bytes, "weights_bytes", 0)

    # A float (numpy's too: str() is its shortest round-tripping decimal) is read as that decimal.
    fraction = Fraction(str(mem_fraction_static)) if isinstance(mem_fraction_static, (float, np.floating)) \
        else Fraction(int(mem_fraction_static)) if isinstance(mem_fraction_static, numbers.Integral) \
        else Fraction(mem_fraction_static)
    used = total - free + pending

    kept = reserve_bytes + table_bytes  # what the static budget keeps back beside what is in use

    def pages_at(fraction):
        static = math.floor(total * fraction)
        pool_budget = static - used - kept
        pages = max(pool_budget, 0) // bytes_per_page
        return static, pool_budget, min(pages, max_pages)

    def left_after(pages):
        """The memory left after the pool, the memory in use, the extra reserve and the table."""
        return total - used - kept - pages * bytes_per_page

    def beside(pages):
        """What the pool takes beside its pages (from_pool's scratch page, the PagePool state), and whether
        :func:`left_after` its pages holds it."""
        need = bytes_per_page + pool_state_bytes(pages)
        return need, pages == 0 or left_after(pages) >= need   # (0: no pool)

    def smallest_that_fits(need):
        """The smallest fraction, at the coarsest step that has one, whose pages (>= min_pages: its static
        budget holds ``need``) leave room beside them; None if none does. At exactly ``need`` what is left
        beside min_pages pages is fixed; a fraction rounded up past it adds pages, which a fine enough
        step keeps from eating that room."""
        for resolution in (FRACTION_STEP, *FINER_STEPS):
            step = math.ceil(Fraction(need, total) * resolution)
            if step <= resolution and beside(pages_at(Fraction(step, resolution))[2])[1]:
                return Fraction(step, resolution)
        return None

    def largest_that_fits():
        """The largest fraction below ``fraction``, at the coarsest step that has one, that still gives
        min_pages pages and leaves room beside them; None if none does. Fewer pages leave more room, so
        each step's search goes down until a fraction fits or gives fewer than min_pages."""
        for resolution in (FRACTION_STEP, *FINER_STEPS):
            step = math.ceil(fraction * resolution) - 1
            while step > 0 and (p := pages_at(Fraction(step, resolution))[2]) >= min_pages:
                if beside(p)[1]:
                    return Fraction(step, resolution)
                step -= 1
        return None

    static, pool_budget, pages = pages_at(fraction)
    if pages < min_pages:
        need = used + kept + min_pages * bytes_per_page
        suggested = smallest_that_fits(need) if need <= total else None
        fix = (f"use mem_fraction_static >= {_decimal(suggested)}" if suggested is not None
               else f"even mem_fraction_static=1.0 is short by {need - total:,} B; use a bigger device "
                    "or fewer weights per device" if need > total
               else "no fraction leaves room for them and for the pool's scratch page and state beside them; "
                    "use a bigger device or fewer weights per device")
        besides = f" and {reserve_bytes:,} B extra reserve" if max_requests is None else \
            f", {reserve_bytes:,} B extra reserve and {table_bytes:,} B of page table"
        raise PlanError(
            f"the static budget ({static:,} B = {total:,} B x {mem_fraction_static}) leaves "
            f"{pool_budget:,} B for the pool after {used:,} B in use (weights, context, other){besides}; "
            f"{min_pages} page(s) of {bytes_per_page:,} B need "
            f"{min_pages * bytes_per_page:,} B: {fix}", None if suggested is None else float(suggested))
    need, fits = beside(pages)
    if not fits:
        # At a fraction near 1 the runtime reserve is smaller than the scratch page and the state the pool
        # takes from it: the plan could not be allocated at its own numbers. The largest fraction below
        # that leaves room (and still gives min_pages), if any.
        suggested = largest_that_fits()
        fix = f"use mem_fraction_static <= {_decimal(suggested)}" if suggested is not None else \
            "no fraction leaves room for both; use a bigger device or fewer weights per device"
        raise PlanError(
            f"the runtime reserve ({total - static:,} B = total - static budget) cannot hold what the pool takes "
            f"beside its {pages:,} pages: PagedKVCache.from_pool's scratch page and the PagePool state, {need:,} "
            f"B (after the pool, {left_after(pages):,} B would be left): "
            f"{fix}", None if suggested is None else float(suggested))
    return PagePlan(bytes_per_page=bytes_per_page, mem_fraction_static=float(fraction), total_bytes=total,
                    free_bytes=free, pending_weights_bytes=pending, used_bytes=used, static_budget_bytes=static,
                    runtime_reserve_bytes=total - static, extra_reserve_bytes=reserve_bytes, table_bytes=table_bytes,
                    max_requests=max_requests, max_pages_per_request=pages_per_request, page_size=page_size,
                    max_batch=max_batch,
                    pool_budget_bytes=pool_budget, num_pages=pages, pool_bytes=pages * bytes_per_page, source=source)
