"""prefix_cache: the device updates of ``tpool.scheduling.PrefixCache`` on the triton backend, one launch each.

Their numba twins are ``tpool.scheduling._prefix`` (the same arguments in the same order, the
same writes); the reference backend runs the torch code in ``PrefixCache``, the spec of both.
``insert_pages`` names the leading pages of a table row by the cache's slots (a slot that named
another page lets it go first), ``forget_pages``
reads and clears the slots that named an eviction's pages, ``gather_slots`` reads slots' pages
and generations for a revive (a generation -1 where the page does not name its slot back: a
hand-edited ``slot_page``, refused by the revive). Every index is bounded before use: a page id outside the pool (a
hand-edited row, padding) is aimed at ``page_slot``'s spare last entry, which keeps its -1; an
insert whose row, run of pages or slots lie outside the arrays writes nothing (its twin returns
-1); a gathered slot outside the cache reads -1 (its twin refuses the call; the host refuses
such a slot first).
"""

import torch
from ._triton_shim import tl, triton

from ._triton_util import NULL_PAGE, settings

INSERT_BLOCK = 64  # lanes per chunk of insert_pages, at most: its duplicate check is a [BLOCK, BLOCK] tile


# ---------------------------------------------------------------------- Triton
# One program each. insert_pages matches its twin's sequential loop where two lanes
# name one slot or page (a hand-edited row): within a chunk a lane writes only if no
# later lane names the same, and a barrier puts each chunk's writes after the last's. Before
# those writes, a first pass lets go of the pages the slots named (where they still name them),
# in any order: it only writes -1.
# forget_pages reads every slot before it clears any (a page evicted twice reads its
# slot in both lanes).


# Not specialised on the row or the count (values, not shapes: see revive_kernel).
@triton.jit(do_not_specialize=["row", "N", "need", "known", "first"])
def insert_pages_kernel(
    block_table_ptr,  # *int32 [R, MP]
    R,                # rows of block_table
    MP,               # columns of block_table
    row,              # the table row
    slots_ptr,        # *int64 [N]: the slot naming the row's page i
    N,                # number of pages
    page_gen_ptr,     # *int32 [P]
    num_pages,        # P
    slot_page_ptr,    # *int32 [C]
    slot_gen_ptr,     # *int32 [C]
    page_slot_ptr,    # *int32 [P + 1]: the last entry spare, -1
    capacity,         # C: the cache's slots
    seq_lens_ptr,     # *int32 [R]: the rows' device lengths
    need,             # the row's sure length (the host mirror's): shorter on the device, its pages hold other tokens
    known,            # the leading slots that are live entries (kept as they are when the row falls short)
    first,            # the row's page slots[0] names (the pages before it are not named here)
    # Meta-parameters
    BLOCK: tl.constexpr,  # lanes per chunk
):
    """For p_i = block_table[row, first + i], i < N: slot_page[slots[i]] = p_i, slot_gen[slots[i]] =
    page_gen[p_i] and page_slot[p_i] = slots[i], or for p_i outside [0, P) slot_gen -1 and page_slot[P] = -1;
    before any of that, for o_i = slot_page[slots[i]] (the page the slot named; outside [0, P): P),
    page_slot[o_i] = -1 where it is slots[i]. Only if seq_lens[row] >= need: else (the row shorter than the
    host counts) slot_page and slot_gen of slots[i], i >= known, are -1, and nothing else is written."""
    lanes = tl.arange(0, BLOCK)
    bad = tl.zeros((), tl.int32)  # slots outside the cache
    for start in range(0, N, BLOCK):
        i = start + lanes
        s = tl.load(slots_ptr + i, mask=i < N, other=0)
        bad += tl.sum(((i < N) & ((s < 0) | (s >= capacity))).to(tl.int32))
    fits = (row >= 0) & (row < R) & (first >= 0) & (first + N <= MP) & (known >= 0) & (known <= N) & (bad == 0)
    n = tl.where(fits, N, 0)  # a call outside the arrays writes nothing (as its twin)
    # the row's device length, at the bounded row (read in every lane: a block, as the masks it joins):
    # short of ``need``, no page is named (as its twin)
    r = row + tl.zeros((BLOCK,), tl.int64)
    in_rows = (r >= 0) & (r < R)
    held = tl.load(seq_lens_ptr + tl.where(in_rows, r, 0), mask=in_rows, other=0) >= need
    base = tl.where(fits, row, 0).to(tl.int64) * MP + tl.where(fits, first, 0)
    # The pages the slots named (a live entry's slot: re-pointed to the row's copy) are let go first:
    # a clear only where page_slot still names the lane's slot, so the lanes' order does not matter
    # (two lanes on one old page: at most one matches, and both would write -1).
    for start in range(0, n, BLOCK):
        i = start + lanes
        live = i < n
        s = tl.load(slots_ptr + i, mask=live, other=-1)
        own = live & (s >= 0) & (s < capacity)
        old = tl.load(slot_page_ptr + s, mask=own, other=NULL_PAGE)
        at = tl.where((old >= 0) & (old < num_pages), old, num_pages)
        named = held & own & (tl.load(page_slot_ptr + at, mask=own, other=NULL_PAGE) == s)
        tl.store(page_slot_ptr + at, tl.full((BLOCK,), NULL_PAGE, tl.int32), mask=named)
    tl.debug_barrier()
    after = lanes[None, :] > lanes[:, None]  # [i, j]: lane j comes after lane i
    for start in range(0, n, BLOCK):
        i = start + lanes
        live = i < n
        s = tl.load(slots_ptr + i, mask=live, other=-1)
        p = tl.load(block_table_ptr + base + i, mask=live & held, other=NULL_PAGE)
        own = live & (s >= 0) & (s < capacity)
        valid = held & live & (p >= 0) & (p < num_pages)
        s_last = own & (tl.sum((after & own[None, :] & (s[None, :] == s[:, None])).to(tl.int32), axis=1) == 0)
        p_last = valid & (tl.sum((after & valid[None, :] & (p[None, :] == p[:, None])).to(tl.int32), axis=1) == 0)
        gen = tl.load(page_gen_ptr + p, mask=valid, other=NULL_PAGE)
        # short of ``need``: the known slots kept, the new ones named nothing (p, gen: -1)
        write = s_last & (held | (i >= known))
        tl.store(slot_page_ptr + s, p, mask=write)
        tl.store(slot_gen_ptr + s, gen, mask=write)
        # a page outside the pool: -1 into the spare entry, as its twin writes
        at = tl.where(valid, p, num_pages)
        tl.store(page_slot_ptr + at, tl.where(valid, s, NULL_PAGE).to(tl.int32),
                 mask=held & ((p_last & own) | (live & ~valid)))
        tl.debug_barrier()


@triton.jit
def forget_pages_kernel(
    ev_ptr,         # *int32 [K]: evicted page ids, -1 padded
    K,              # number of entries
    page_slot_ptr,  # *int32 [P + 1]: the last entry spare, -1
    out_ptr,        # *int32 [K]: the slot that named each page, -1 for none
    num_pages,      # P
    # Meta-parameters
    BLOCK: tl.constexpr,  # lanes per chunk
):
    """out[i] = page_slot[a_i] (-1 for padding, whatever the spare entry holds), then page_slot[a_i] = -1,
    for a_i = ev[i] if in [0, P), else P."""
    lanes = tl.arange(0, BLOCK)
    for start in range(0, K, BLOCK):
        i = start + lanes
        p = tl.load(ev_ptr + i, mask=i < K, other=NULL_PAGE)
        inside = (p >= 0) & (p < num_pages)
        at = tl.where(inside, p, num_pages)
        tl.store(out_ptr + i, tl.load(page_slot_ptr + at, mask=(i < K) & inside, other=NULL_PAGE), mask=i < K)
    tl.debug_barrier()
    for start in range(0, K, BLOCK):
        i = start + lanes
        p = tl.load(ev_ptr + i, mask=i < K, other=NULL_PAGE)
        at = tl.where((p >= 0) & (p < num_pages), p, num_pages)
        tl.store(page_slot_ptr + at, tl.full((BLOCK,), NULL_PAGE, tl.int32), mask=i < K)


@triton.jit
def gather_slots_kernel(
    slots_ptr,      # *int64 [N]
    N,              # number of slots
    slot_page_ptr,  # *int32 [C]
    slot_gen_ptr,   # *int32 [C]
    page_slot_ptr,  # *int32 [P + 1]: the last entry spare, -1
    pages_ptr,      # *int32 [N] out
    gens_ptr,       # *int32 [N] out
    capacity,       # C
    num_pages,      # P
    # Meta-parameters
    BLOCK: tl.constexpr,  # lanes per chunk
):
    """pages[i], gens[i] = slot_page[slots[i]], slot_gen[slots[i]]; -1, -1 for a slot outside [0, C); gens[i]
    -1 where page_slot[pages[i]] (P for a page outside [0, P)) is not slots[i] (the page does not name it back)."""
    lanes = tl.arange(0, BLOCK)
    for start in range(0, N, BLOCK):
        i = start + lanes
        s = tl.load(slots_ptr + i, mask=i < N, other=-1)
        own = (i < N) & (s >= 0) & (s < capacity)
        p = tl.load(slot_page_ptr + s, mask=own, other=NULL_PAGE)
        at = tl.where((p >= 0) & (p < num_pages), p, num_pages)
        back = own & (tl.load(page_slot_ptr + at, mask=own, other=NULL_PAGE) == s)
        tl.store(pages_ptr + i, p, mask=i < N)
        tl.store(gens_ptr + i, tl.load(slot_gen_ptr + s, mask=back, other=NULL_PAGE), mask=i < N)


def _check(t, n, name, dtype=torch.int32):
    """The kernels take their bounds from the sizes the cache made its tensors with: a tensor changed
    since (``set_``, a rebound attribute) is refused before a launch could read or write past it."""
    if not (type(t) is torch.Tensor and t.dtype is dtype and t.dim() == 1 and t.numel() == n and t.is_contiguous()):
        raise ValueError(f"PrefixCache: expected its {name} as it made it (contiguous {dtype} [{n}]), got "
                         f"{type(t).__name__} {getattr(t, 'dtype', '')} {tuple(getattr(t, 'shape', ()))}: a tensor of "
                         f"the cache was changed in place (set_, resize_) or rebound; make a new PrefixCache")


def insert_pages_triton(block_table, row, slots, page_gen, slot_page, slot_gen, page_slot, seq_lens, need,
                        known, first=0) -> None:
    """Name pages ``first .. first + n - 1`` of ``block_table`` (int32 ``[R, MP]``, contiguous) row ``row``
    (host ints) by ``slots`` (int64 ``[n]``), with ``page_gen``'s (int32 ``[P]``) generations (one launch), if the
    row's length in ``seq_lens`` (int32 ``[R]``) is at least ``need``; else the slots after the first
    ``known`` name nothing (page and generation -1) and nothing else is written."""
    R, MP = block_table.shape
    n = slots.numel()
    _check(slot_gen, slot_page.numel(), "slot_gen")
    _check(page_slot, page_gen.numel() + 1, "page_slot")
    _check(seq_lens, R, "seq_lens")
    if not n:
        return
    insert_pages_kernel[(1,)](
        block_table, R, MP, row, slots, n, page_gen, page_gen.numel(), slot_page, slot_gen, page_slot,
        slot_page.numel(), seq_lens, need, known, first, **settings(min(n, INSERT_BLOCK)),
    )


def forget_pages_triton(ev, page_slot) -> torch.Tensor:
    """The slots (int32 ``[k]``, -1 for none) that named the pages of ``ev`` (int32 ``[k]``, -1 padded),
    which name nothing from now on (one launch)."""
    out = torch.empty_like(ev)
    _check(page_slot, page_slot.numel(), "page_slot")
    if not ev.numel():
        return out  # (no launch over an empty tensor, whose address may be null)
    forget_pages_kernel[(1,)](ev, ev.numel(), page_slot, out, page_slot.numel() - 1, **settings(ev.numel()))
    return out


def gather_slots_triton(slots, slot_page, slot_gen, page_slot) -> tuple:
    """``(pages, gens)``, int32 ``[n]`` each: the pages and generations of ``slots`` (int64 ``[n]``), a
    generation -1 where ``page_slot`` (int32 ``[P + 1]``) does not name the slot back (one launch)."""
    pages = torch.empty(slots.numel(), dtype=torch.int32, device=slots.device)
    gens = torch.empty_like(pages)
    _check(slot_gen, slot_page.numel(), "slot_gen")
    _check(page_slot, page_slot.numel(), "page_slot")
    if not slots.numel():
        return pages, gens
    gather_slots_kernel[(1,)](slots, slots.numel(), slot_page, slot_gen, page_slot, pages, gens, slot_page.numel(),
                              page_slot.numel() - 1, **settings(slots.numel()))
    return pages, gens
