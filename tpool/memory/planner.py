"""Capacity planning: how many pages fit, from a static memory fraction.

Note:
    The arithmetic follows SGLang's ``mem_fraction_static``: a fraction of
    the device's TOTAL memory is the static budget for weights and the KV
    pool; the rest is the runtime reserve (activations, workspaces, CUDA
    graph pools) that the engine allocates later. Free memory is measured
    after the weights are loaded, so everything in use then (weights, CUDA
    context, other libraries and processes) comes out of the static budget::

        in use        U = total - free + pending      (pending: weights not loaded yet)
        static        S = floor(total * fraction)
        reserve       R = total - S                   (runtime reserve)
        pool budget   P = S - U - extra_reserve       ( = free - pending - R - extra )
        pages         N = min(P // bytes_per_page, max_pages)

    The fraction is read as the decimal it is written as (0.88 is 22/25),
    so the numbers are exact. When ``N < min_pages`` (the weights already
    fill the static budget) :class:`PlanError` names the smallest fraction,
    rounded up to 0.01, that would give ``min_pages`` pages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch

from tpool._checks import check_size

__all__ = ["plan_pages", "PagePlan", "PlanError"]

GIB = 1 << 30  # bytes in a GiB, for explain()
FRACTION_STEP = 100  # suggested fractions are rounded up to 1 / FRACTION_STEP


class PlanError(ValueError):
    """The static budget leaves too little for the pool; ``suggested_fraction`` fixes it (None if nothing can)."""

    def __init__(self, message: str, suggested_fraction: float | None):
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
    pool_budget_bytes: int  # static budget - used - extra reserve
    num_pages: int
    pool_bytes: int  # num_pages * bytes_per_page
    source: str  # where total and free came from

    def explain(self) -> str:
        """The arithmetic, one line per step, with bytes and GiB.

        Returns
        -------
        str
            Eight lines: total, free, in use, static budget, runtime reserve,
            extra reserve, pool budget, pool; each with its bytes, GiB and
            where it comes from.

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
        """
        rows = [
            ("total", self.total_bytes, self.source),
            ("free", self.free_bytes, "with the weights loaded" if not self.pending_weights_bytes
             else f"before {self.pending_weights_bytes:,} B of weights are loaded"),
            ("in use", self.used_bytes, "total - free + pending weights (weights, context, other)"),
            ("static budget", self.static_budget_bytes, f"total x {self.mem_fraction_static}"),
            ("runtime reserve", self.runtime_reserve_bytes, "total - static budget (activations, graphs)"),
            ("extra reserve", self.extra_reserve_bytes, "kept back inside the static budget"),
            ("pool budget", self.pool_budget_bytes, "static budget - in use - extra reserve"),
            ("pool", self.pool_bytes, f"{self.num_pages:,} pages x {self.bytes_per_page:,} B"),
        ]
        return "\n".join(f"{name:<16} {value:>20,} B {value / GIB:>9.2f} GiB   {why}" for name, value, why in rows)


def _measure(device, total_bytes, free_bytes) -> tuple[int, int, str]:
    if total_bytes is not None and free_bytes is not None:
        return total_bytes, free_bytes, "given"
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"total_bytes and free_bytes are required on {device} (no driver to ask), "
                         f"got total_bytes={total_bytes!r}, free_bytes={free_bytes!r}")
    free, total = torch.cuda.mem_get_info(device)
    return (total if total_bytes is None else total_bytes, free if free_bytes is None else free_bytes,
            f"torch.cuda.mem_get_info({device})")


def plan_pages(bytes_per_page: int, mem_fraction_static: float, *, device=None, total_bytes: int | None = None,
               free_bytes: int | None = None, reserve_bytes: int = 0, weights_bytes: int | None = None,
               min_pages: int = 1, max_pages: int | None = None) -> PagePlan:
    """Plan the page count of a KV pool.

    Parameters
    ----------
    bytes_per_page : int
        Bytes one page takes on the device (all layers, K and V), > 0.
    mem_fraction_static : float
        In (0, 1]: share of total device memory for weights + pool (a
        Python float, int or ``Fraction``; a bool is refused, and so is a
        numpy float32, which cannot hold a decimal such as 0.8 exactly).
    device : torch.device or str, optional
        CUDA device to measure (``torch.cuda.mem_get_info``) when total or
        free is not given; default the current CUDA device. Unused when both
        are given.
    total_bytes, free_bytes : int, optional
        Device total (>= 1) and free (>= 0, <= total) memory in bytes; each
        one not given is measured. Both are required without CUDA.
    reserve_bytes : int
        Extra memory kept back inside the static budget, >= 0 (default 0).
    weights_bytes : int, optional
        Weights NOT yet loaded when ``free_bytes`` was measured, >= 0
        (None: loaded).
    min_pages : int
        Fewest pages accepted, >= 0 (else :class:`PlanError`); default 1.
    max_pages : int, optional
        Most pages wanted, >= ``min_pages``; default no cap.

    Returns
    -------
    PagePlan
        Every number of the arithmetic in the module note; ``num_pages`` is
        the answer and :meth:`PagePlan.explain` prints the steps.

    Raises
    ------
    PlanError
        Fewer than ``min_pages`` pages fit; its ``suggested_fraction`` is the
        smallest fraction (rounded up to 0.01) that gives ``min_pages``, or
        None if even 1.0 does not. A subclass of ``ValueError``.
    ValueError
        An argument of the wrong type (a bool is not a size or a fraction)
        or out of its range, ``free_bytes > total_bytes``, or total or free
        not given and no CUDA device to measure them on.

    Example
    -------
    80 GiB device, 60 GiB free after the weights, fraction 0.8, 2 MiB pages:
    S = 64 GiB, U = 20 GiB, P = 44 GiB, N = 22_528.

    >>> plan_pages(2 << 20, 0.8, total_bytes=80 << 30, free_bytes=60 << 30).num_pages
    22528
    """
    bytes_per_page = check_size(bytes_per_page, "bytes_per_page", 1)
    reserve_bytes = check_size(reserve_bytes, "reserve_bytes", 0)
    min_pages = check_size(min_pages, "min_pages", 0)
    if max_pages is not None:
        max_pages = check_size(max_pages, "max_pages", min_pages)
    if isinstance(mem_fraction_static, bool) or not isinstance(mem_fraction_static, (int, float, Fraction)):
        raise ValueError(f"mem_fraction_static: expected a float in (0, 1], got a {type(mem_fraction_static).__name__} "
                         f"({mem_fraction_static!r}); pass a Python float such as 0.8")
    if not 0 < mem_fraction_static <= 1:
        raise ValueError(f"mem_fraction_static: expected a float in (0, 1], got {mem_fraction_static!r}")
    total, free, source = _measure(device, total_bytes, free_bytes)
    total = check_size(total, "total_bytes", 1)
    free = check_size(free, "free_bytes", 0)
    if free > total:
        raise ValueError(f"free_bytes must be <= total_bytes ({total}), got {free}")
    pending = 0 if weights_bytes is None else check_size(weights_bytes, "weights_bytes", 0)

    fraction = Fraction(str(mem_fraction_static)) if isinstance(mem_fraction_static, float) \
        else Fraction(mem_fraction_static)
    used = total - free + pending
    static = math.floor(total * fraction)
    pool_budget = static - used - reserve_bytes
    pages = max(pool_budget, 0) // bytes_per_page
    if max_pages is not None:
        pages = min(pages, max_pages)
    if pages < min_pages:
        need = used + reserve_bytes + min_pages * bytes_per_page
        step = math.ceil(Fraction(need, total) * FRACTION_STEP)
        suggested = step / FRACTION_STEP if step <= FRACTION_STEP else None
        fix = (f"use mem_fraction_static >= {suggested:.2f}" if suggested is not None
               else f"even mem_fraction_static=1.0 is short by {need - total:,} B; use a bigger device "
                    "or fewer weights per device")
        raise PlanError(
            f"the static budget ({static:,} B = {total:,} B x {mem_fraction_static}) leaves "
            f"{pool_budget:,} B for the pool after {used:,} B in use (weights, context, other) and "
            f"{reserve_bytes:,} B extra reserve; {min_pages} page(s) of {bytes_per_page:,} B need "
            f"{min_pages * bytes_per_page:,} B: {fix}", suggested)
    return PagePlan(bytes_per_page, float(mem_fraction_static), total, free, pending, used, static,
                    total - static, reserve_bytes, pool_budget, pages, pages * bytes_per_page, source)
