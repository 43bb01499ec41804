"""A step's attention metadata (positions, qo_indptr, kv_lens), worked out by hand, on every
backend and through every form of the step (plain, bound, caller-owned outputs), and the rule
that a lane needing no new page never fails because an earlier lane could not get one."""

import pytest
import torch

import tpool
from conftest import CPU_BACKENDS, i32
from tpool.kernels import layout as L


@pytest.fixture(params=CPU_BACKENDS)
def table(request):
    pool = tpool.PagePool(8, 4, device="cpu", backend=request.param)
    t = tpool.PageTable(pool, 6, 4)
    t.extend(i32([0, 5]), i32([3, 5]), max_tokens=8)  # request 0: 3 tokens (1 page), 5: 5 tokens (2 pages)
    return t


def meta(r):
    return r.positions.tolist(), r.qo_indptr.tolist(), r.kv_lens.tolist()


# A mixed batch: a decode lane, a prefill crossing pages, padding with a count, an unknown id,
# a one-page prefill, a decode lane inside its page, a repeated id; 20 slots, 19 used.
MIXED = ([0, 1, -1, 7, 2, 5, 1], [1, 9, 2, 1, 4, 1, 1], 20)
MIXED_META = ([3, 0, 1, 2, 3, 4, 5, 6, 7, 8, -1, -1, -1, 0, 1, 2, 3, 5, -1, -1],
              [0, 1, 10, 12, 13, 17, 18, 19],
              [4, 9, 0, 0, 4, 6, 0])


def test_mixed_batch_metadata_by_hand(table, guard):
    ids, ntok, t = MIXED
    with guard():
        r = table.step(i32(ids), i32(ntok), max_tokens=t)
    assert r.ok.tolist() == [True, True, False, False, True, True, False]
    assert meta(r) == MIXED_META
    # positions and slots agree token by token: slot = page of (position // ps) * ps + position % ps
    for u, (p, s) in enumerate(zip(*[x.tolist() for x in (r.positions, r.slots)])):
        lane = max(i for i in range(len(ids)) if MIXED_META[1][i] <= u) if p >= 0 else None
        if lane is None:
            assert s == -1
        else:
            row = ids[lane]
            assert s == table.block_table[row, p // 4].item() * 4 + p % 4


def test_a_lane_needing_no_page_runs_after_a_lane_that_could_not_get_pages(table, guard):
    ids, ntok, t = MIXED
    table.step(i32(ids), i32(ntok), max_tokens=t)          # 7 of 8 pages taken: 1 free
    free_before = table.pool.available()
    assert free_before == 1
    with guard():
        # 2 wants 2 more pages (refused), 3 one (refused: first come first served among lanes that
        # need pages), 5 decodes inside its page (runs), 0 crosses into a new page (refused).
        r = table.step(i32([2, 3, 5, 0]), i32([8, 4, 1, 1]), max_tokens=14)
    assert r.ok.tolist() == [False, False, True, False]
    assert meta(r) == ([-1] * 12 + [6, -1], [0, 8, 12, 13, 14], [4, 0, 7, 4])
    assert r.slots.tolist() == [-1] * 12 + [table.block_table[5, 1].item() * 4 + 2, -1]
    assert table.seq_lens.tolist()[:6] == [4, 9, 4, 0, 0, 7]
    assert table.pool.available() == free_before
    assert table.pool.stats()["requests.failed"] == 2 + 3   # this step's 3, the mixed batch's 2
    with pytest.raises(tpool.PoolError):                       # the mixed batch's bad ids
        table.pool.check()


def test_out_of_slots_lane_keeps_its_length_and_qo_indptr_is_capped(table, guard):
    with guard():
        r = table.step(i32([0, 5]), i32([1, 3]), max_tokens=2)
    assert r.ok.tolist() == [True, False]
    assert meta(r) == ([3, -1], [0, 1, 2], [4, 5])


def test_bound_step_and_caller_owned_outputs_write_the_same_metadata(table, guard):
    ids, ntok, t = MIXED
    out = table.step_out(len(ids), max_tokens=t)
    with guard():
        r = table.step(i32(ids), i32(ntok), max_tokens=t, out=out)
    assert r is out.result and meta(r) == MIXED_META
    # Then decode every live request twice through a bound step (numba grows its CSR in place).
    # One page is left: 0 (4 tokens) takes it; 2 (4 tokens) needs one too and fails both times,
    # while 1 and 5 (inside their pages) run both times.
    dec_ids, dec_n = i32([0, 1, 2, 5, -1]), i32([1, 1, 1, 1, 0])
    run = table.bind_step(dec_ids, dec_n)
    for k in range(2):
        with guard():
            r = run()
        assert r.ok.tolist() == [True, True, False, True, False]
        assert meta(r) == ([4 + k, 9 + k, -1, 6 + k, -1], [0, 1, 2, 3, 4, 4], [5 + k, 10 + k, 4, 7 + k, 0])


def test_empty_batch(table, guard):
    with guard():
        r = table.step(i32([]), i32([]), max_tokens=3)
    assert meta(r) == ([-1, -1, -1], [0], [])


def test_corrupt_length_gives_zero_kv_len(table, guard):
    table.seq_lens[5] = 10_000                                 # a hand edit past max_pages * page_size
    table.invalidate_csr()
    with guard():
        r = table.step(i32([5, 0]), i32([1, 1]), max_tokens=2)
    assert r.ok.tolist() == [False, True]
    assert meta(r) == ([-1, 3], [0, 1, 2], [0, 4])
    assert table.pool.stats()["errors.corrupt_state"] == 1    # once: the extend's (the CSR export counts no lane again)


def test_metadata_buffers_are_int32_of_the_documented_shapes(table):
    r = table.step(i32([0, -1, 5]), i32([1, 0, 1]), max_tokens=5)
    assert [(x.dtype, tuple(x.shape)) for x in r.metadata] == [(torch.int32, (5,)), (torch.int32, (4,)),
                                                               (torch.int32, (3,))]
    assert L.NULL_PAGE == -1
