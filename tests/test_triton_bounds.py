"""Bounds of the Triton kernels that only a hand edit reaches, one step past each.

A mutation run over the Triton kernels (session 38, helper-137; earlier runs used ``-k "not triton"``)
found these edits untested on the Triton path: each test fails on its mutant (named in the docstring)
and passes as written, on every CPU backend where it goes through the public API.
"""

from dataclasses import replace

import pytest
import torch

import tpool
from tpool.kernels import _triton_util
from tpool.kernels import layout as L

from conftest import TRITON_DEVICE, i32


def test_a_stack_entry_equal_to_num_pages_is_handed_out_as_minus_one(backend):
    """An edited free-stack entry of num_pages (one past the last page) is popped as -1 and counted, never
    handed out (``pop_check``: ``p < num_pages``; as ``<=`` page 4 came out and its refcount and state were
    written one past their tensors)."""
    pool = tpool.PagePool(4, 4, device="cpu", backend=backend)
    pool.state.free_stack[3] = 4                           # the top: the next page popped
    got = pool.alloc(i32([2])).pages[:2].tolist()
    assert got == [-1, 1]
    assert int(pool.state.counters[L.ERR_CORRUPT_STATE]) == 1


@pytest.mark.skipif(TRITON_DEVICE is None, reason="Triton needs a GPU or TRITON_INTERPRET=1")
def test_an_lru_entry_equal_to_num_pages_is_not_read_as_a_page():
    """An edited LRU queue entry of num_pages is no page: the eviction reads no state past the pool's tensors
    (``lru_live``: ``p < num_pages``; as ``<=`` it read page_state[P] and lru_pos[P], here canaries that make
    the entry look live, and evicted "page 4" into the stack, writing its state and generation past the
    tensors). Kernel level: the state tensors are views with a canary entry after them."""
    from tpool.kernels import evict
    from tpool.state import PoolState
    P, dev = 4, torch.device(TRITON_DEVICE)
    st = PoolState.create(P, dev)
    state, pos, gen = (torch.full((P + 1,), v, dtype=d, device=dev)
                       for v, d in ((L.FREE, torch.int8), (-1, torch.int64), (0, torch.int32)))
    state[P], pos[P] = L.CACHED, 0                         # canaries: "page P" is CACHED, its entry at 0
    st = replace(st, page_state=state[:P], lru_pos=pos[:P], page_gen=gen[:P])
    st.page_state[0] = L.USED                              # one page out, so the stack has room for one
    st.counters[L.FREE_COUNT] = P - 1
    st.counters[L.CACHED_COUNT] = 1                        # the count the (edited) queue entry promises
    st.counters[L.LRU_TAIL] = 1
    st.lru_queue[0] = P
    out = torch.full((1,), 7, dtype=torch.int32, device=dev)
    evict.evict_triton(st, out)
    assert out.tolist() == [-1]
    assert int(state[P]) == L.CACHED and int(gen[P]) == 0 and st.free_stack.tolist() == [3, 2, 1, 0]
    assert int(st.counters[L.ERR_CORRUPT_STATE]) == 1 and int(st.counters[L.FREE_COUNT]) == P - 1


@pytest.mark.skipif(TRITON_DEVICE is None, reason="Triton needs a GPU or TRITON_INTERPRET=1")
def test_a_free_below_the_stack_pushes_at_top_plus_rank_across_chunks(monkeypatch):
    """With an edited free count of -1 the first released page has no slot; every later one goes to
    ``top + rank`` (rank among all released pages), in every chunk: the position carried from chunk to chunk
    is the pages released, not the pages pushed (as pushed, chunk 2 overwrote the last slot of chunk 1).
    Triton in 32-lane chunks against the reference."""
    monkeypatch.setattr(_triton_util, "MAX_BLOCK", 32)
    pools = [tpool.PagePool(64, 4, device=TRITON_DEVICE, backend=b) for b in ("reference", "triton")]
    for pool in pools:
        pool.alloc(i32([64], TRITON_DEVICE))
        pool.state.counters[L.FREE_COUNT] = -1
        pool.free(i32(list(range(40)), TRITON_DEVICE))
    ref, tri = (p.state for p in pools)
    assert tri.free_stack[:39].tolist() == ref.free_stack[:39].tolist() == list(range(1, 40))
    assert tri.counters.tolist() == ref.counters.tolist()


def test_a_fork_from_a_row_one_token_past_its_limit_is_corrupt_and_shares_nothing(backend):
    """A source length of limit + 1 is corrupt: the fork fails that lane, counts it and changes no row. Taken
    as valid (``fork``: no ``src_len > MP * page_size`` check), the lane shared the source's four pages into
    the empty row and succeeded; with lens up to that length it reads past the source row."""
    pool = tpool.PagePool(16, 4, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 4, 4)                    # a row holds 4 pages of 4 tokens
    table.extend(i32([0, 1]), i32([16, 4]), max_tokens=20)
    table.seq_lens[0] = 17
    before = table.block_table.clone()
    res = table.fork(i32([0]), i32([2]), i32([16]))
    assert res.ok.tolist() == [False]
    assert int(pool.state.counters[L.ERR_CORRUPT_STATE]) == 1
    assert torch.equal(table.block_table, before) and table.seq_lens.tolist() == [17, 4, 0, 0]
    assert pool.state.refcount[:5].tolist() == [1] * 5


def test_a_step_counts_a_bad_request_id_once(backend):
    """A step is an extend and a CSR export of one batch: an id past the rows is one bad_request, counted by
    the extend (the export in a step counts none again; ``step_kernel`` passes ``COUNT=False``)."""
    pool = tpool.PagePool(16, 4, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 4, 4)
    table.extend(i32([0]), i32([5]), max_tokens=5)
    res = table.step(i32([0, 9]), i32([1, 1]))
    assert res.ok.tolist() == [True, False]
    assert int(pool.state.counters[L.ERR_BAD_REQUEST]) == 1


@pytest.mark.skipif(TRITON_DEVICE is None, reason="Triton needs a GPU or TRITON_INTERPRET=1")
def test_a_csr_memo_past_the_capacity_pads_only_inside_indices():
    """The export re-pads ``indices`` up to what its memo says the last call wrote, clamped to the capacity:
    a memo edited past it writes nothing past ``indices`` (without the clamp, -1 went into the four entries
    after it, here canaries). Kernel level: ``indices`` is a view with canaries after it."""
    from tpool.kernels import flashinfer_csr
    pool = tpool.PagePool(16, 4, device=TRITON_DEVICE, backend="triton")
    table = tpool.PageTable(pool, 4, 4)
    table.extend(i32([0], TRITON_DEVICE), i32([5], TRITON_DEVICE), max_tokens=5)
    cap = 8
    buf = torch.full((cap + 4,), 777, dtype=torch.int32, device=TRITON_DEVICE)
    indptr, last = (torch.full((n,), 777, dtype=torch.int32, device=TRITON_DEVICE) for n in (2, 1))
    written = torch.full((1,), cap + 4, dtype=torch.int64, device=TRITON_DEVICE)
    flashinfer_csr.flashinfer_csr_triton(i32([0], TRITON_DEVICE), indptr, buf[:cap], last, written, pool.state,
                                         table.state)
    assert buf.tolist() == [0, 1] + [-1] * (cap - 2) + [777] * 4
    assert indptr.tolist() == [0, 2] and last.tolist() == [1] and written.tolist() == [2]


def test_a_row_naming_num_pages_is_exported_empty(backend):
    """A row holding the id num_pages (one past the last page) is exported with no pages, counted once: the
    rows' rescan marks ``page >= num_pages`` (as ``>`` the request was exported with page 16 in ``indices``,
    one past the K/V cache an attention kernel indexes)."""
    pool = tpool.PagePool(16, 4, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 4, 4)
    table.extend(i32([0, 1]), i32([5, 3]), max_tokens=8)  # row 0: pages 0, 1; row 1: page 2
    table.block_table[0, 1] = 16
    table.invalidate_csr()
    csr = table.flashinfer_csr(i32([0, 1]))
    assert csr.indptr.tolist() == [0, 0, 1] and csr.indices.tolist() == [2] + [-1] * 7
    assert int(pool.state.counters[L.ERR_CORRUPT_STATE]) == 1


@pytest.mark.skipif(TRITON_DEVICE is None, reason="Triton needs a GPU or TRITON_INTERPRET=1")
def test_a_prefix_cache_insert_naming_slot_c_writes_nothing():
    """``insert_pages`` with one slot of C (one past the cache's slots) is a call outside the arrays: none of
    its pages is named, the good slot beside it included (as ``s > capacity`` the bad slot was not counted
    and slot 0 took page 1; slot C itself stays unwritten by the per-lane check)."""
    from tpool.kernels import prefix_cache as K
    dev, P, C = TRITON_DEVICE, 6, 8
    bt = i32([[3, 1, -1, -1]], dev)
    gen = torch.arange(10, 10 + P, dtype=torch.int32, device=dev)
    slot_page, slot_gen = (torch.full((C,), 77, dtype=torch.int32, device=dev) for _ in range(2))
    page_slot = torch.full((P + 1,), -1, dtype=torch.int32, device=dev)
    K.insert_pages_triton(bt, 0, torch.tensor([C, 0], dtype=torch.int64, device=dev), gen, slot_page,
                          slot_gen, page_slot, i32([8], dev), 8, 0)
    assert slot_page.tolist() == slot_gen.tolist() == [77] * C and page_slot.tolist() == [-1] * (P + 1)


def test_a_csr_of_a_row_one_token_past_its_limit_exports_it_empty(backend):
    """A length of limit + 1 is corrupt: the export gives the request no pages and counts it. (Without the
    check the request got five pages, the fifth read past its row; test_safety's far edits catch that only
    by a run over 250k pages that the interpreter does not finish.)"""
    pool = tpool.PagePool(16, 4, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 4, 4)
    table.extend(i32([0, 1]), i32([16, 4]), max_tokens=20)
    table.seq_lens[0] = 17
    table.invalidate_csr()
    csr = table.flashinfer_csr(i32([0, 1]))
    assert csr.indptr.tolist() == [0, 0, 1] and csr.indices.tolist()[:2] == [4, -1]
    assert int(pool.state.counters[L.ERR_CORRUPT_STATE]) == 1


@pytest.mark.skipif(TRITON_DEVICE is None, reason="Triton needs a GPU or TRITON_INTERPRET=1")
def test_a_free_with_the_stack_counted_full_pushes_nothing_past_it():
    """An edited free count of num_pages (the stack full) with a page still USED: freeing it has no slot, so
    the page becomes FREE unpushed and counts corrupt_state (``apply_free``: ``pos < num_pages``; as ``<=``
    it was written one past the stack, here a canary; before, only test_safety's ~30 s fuzz caught it).
    Kernel level: the free stack is a view with a canary entry after it."""
    from tpool.kernels import free
    from tpool.state import PoolState
    P, dev = 4, torch.device(TRITON_DEVICE)
    st = PoolState.create(P, dev)
    stack = torch.full((P + 1,), 99, dtype=torch.int32, device=dev)
    stack[:P] = st.free_stack
    st = replace(st, free_stack=stack[:P])
    st.page_state[2], st.refcount[2] = L.USED, 1           # page 2 held, yet the count says all are free
    free.free_triton(st, i32([2], TRITON_DEVICE), False)
    assert int(stack[P]) == 99
    assert int(st.page_state[2]) == L.FREE and int(st.counters[L.ERR_CORRUPT_STATE]) == 1
