"""The prefix cache's device updates on the numba backend: one compiled call each instead of ~10 torch ops.

Note: on a CPU pool of the numba backend, :class:`tpool.scheduling.PrefixCache` keeps its
three index arrays (``slot_page``, ``slot_gen``, ``page_slot``) in numpy memory it made
(the tensors are views of it) and updates them here: a torch op costs ~5-20 us of dispatch
once a forward pass has cooled the caches, and ``insert`` made twelve. The table's
``block_table`` and the pool's ``page_gen`` are read at the addresses of the numba backend's
descriptors (the memory its own kernels read and write, checked and held when the table was
made), bounded by their sizes: a row, slot or page id outside them is refused (-1, nothing
written) or, for a page id (a hand-edited row), named by nothing, as the torch code does. Each call keeps the
GIL (a numba call of another thread cannot land inside it) and is made under the pool's
lock, as the torch code reads the pool's state. Other backends run the torch code
(``PrefixCache``), which this mirrors op for op.
"""

from tpool.backends.numba import cached_njit
from tpool.kernels._numba_util import i32_array


@cached_njit
def insert_pages(bt_addr, rows, width, row, slots, page_gen_addr, num_pages, slot_page, slot_gen, page_slot,
                 seq_lens_addr, need, known, first):
    """Name pages ``first .. first + n - 1`` of table row ``row`` by ``slots`` (int64 ``[n]``): each slot gets its
    page (``slot_page``) and the page's generation (``slot_gen``, read from the pool's ``page_gen``
    at ``page_gen_addr``), and the page gets its slot (``page_slot``). A page id outside the pool
    (a hand-edited row) gets generation -1 and is aimed at ``page_slot``'s spare last entry,
    which keeps its -1. ``block_table`` is int32 ``[rows, width]`` at ``bt_addr``.

    A slot may be a live entry's (``PrefixCache.insert`` passes the entries the row's leading pages
    were found by, from page ``first`` on: the ones before it, which a running reviver holds, are left
    as they are; then the new ones): first, for every slot, the page it named (``slot_page``, bounded
    as a row's page is: outside the pool, the spare entry) is let go if it still names that slot
    (``page_slot[old] = -1``), then every slot is written as above. A slot that names the row's page
    already ends as it was; one that named another copy of the same prefix names the row's now.

    Only where the row holds what the host counts: its device length (``seq_lens``, int32 ``[rows]`` at
    ``seq_lens_addr``, read at the bounded row) at least ``need`` (its sure length). Else (a row a refused revive left
    empty, whose pages hold other tokens) no page is named: the first ``known`` slots (live entries)
    keep what they name, the others get page -1 and generation -1 (a revive of them is refused,
    invalid_page), and ``page_slot`` is not written.

    Returns 0, or -1 (nothing written) when the pages, ``known`` or a slot lie outside the arrays."""
    n = slots.shape[0]
    cap = slot_page.shape[0]
    if row < 0 or row >= rows or first < 0 or first + n > width or known < 0 or known > n \
            or slot_gen.shape[0] != cap \
            or page_slot.shape[0] != num_pages + 1:
        return -1
    for i in range(n):
        if slots[i] < 0 or slots[i] >= cap:
            return -1
    if i32_array(seq_lens_addr, rows)[row] < need:   # (row bounded above)
        for i in range(known, n):
            slot_page[slots[i]] = -1
            slot_gen[slots[i]] = -1
        return 0
    bt = i32_array(bt_addr, rows * width)
    gens = i32_array(page_gen_addr, num_pages)
    base = row * width + first
    for i in range(n):  # the pages the slots named: let go first (every read of slot_page before a write)
        s = slots[i]
        old = slot_page[s]
        at = old if 0 <= old < num_pages else num_pages
        if page_slot[at] == s:
            page_slot[at] = -1
    for i in range(n):
        s = slots[i]
        p = bt[base + i]
        slot_page[s] = p
        if 0 <= p < num_pages:
            slot_gen[s] = gens[p]
            page_slot[p] = s
        else:
            slot_gen[s] = -1
            page_slot[num_pages] = -1
    return 0


@cached_njit
def forget_pages(ev_addr, k, page_slot, out):
    """For each page id of the evicted pages (int32 ``[k]`` at ``ev_addr``, -1 padding) write the slot
    that named it into ``out`` (int32 ``[k]``; -1 for none and for padding, whatever the spare entry
    holds), then name it by nothing. Returns 0, or -1 (nothing written) when ``out`` is not ``[k]``."""
    spare = page_slot.shape[0] - 1
    if out.shape[0] != k or k < 0 or spare < 0:
        return -1
    ev = i32_array(ev_addr, k)
    for i in range(k):
        p = ev[i]
        out[i] = page_slot[p] if 0 <= p < spare else -1
    for i in range(k):
        p = ev[i]
        page_slot[p if 0 <= p < spare else spare] = -1
    return 0


@cached_njit
def gather_slots(slots, slot_page, slot_gen, page_slot, pages, gens):
    """``pages[i], gens[i] = slot_page[slots[i]], slot_gen[slots[i]]`` (``slots`` int64 ``[n]``), the
    generation -1 where the page does not name the slot back (``page_slot``, int32 ``[P + 1]``; a page
    outside the pool reads its spare last entry, -1): a hand-edited ``slot_page`` naming another page of
    the same generation would otherwise hand out that page's K/V, and the table's revive refuses a
    generation -1 (``use_after_free``). Returns 0, or -1 (nothing written) when a slot lies outside the
    arrays or the outputs are not ``[n]``."""
    n, cap = slots.shape[0], slot_page.shape[0]
    spare = page_slot.shape[0] - 1
    if pages.shape[0] != n or gens.shape[0] != n or slot_gen.shape[0] != cap or spare < 0:
        return -1
    for i in range(n):
        if slots[i] < 0 or slots[i] >= cap:
            return -1
    for i in range(n):
        s = slots[i]
        p = slot_page[s]
        pages[i] = p
        gens[i] = slot_gen[s] if page_slot[p if 0 <= p < spare else spare] == s else -1
    return 0
