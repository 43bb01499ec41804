"""The benchmarks' engine models hand out, evict and revive the pages tpool does, as the engines would.

_engines.py's ``VllmBlockPool`` (vLLM's BlockPool and FreeKVCacheBlockQueue) and
``SGLangPagedPool`` (SGLang's PagedTokenToKVPoolAllocator), bench_evict.py's ``VllmEvict``
and bench_revive.py's ``VllmRevive`` are timed against tpool as "what the engine does".
Each test runs a model and tpool (or the older baseline) on the benchmark's workload and
compares what they return, id for id, so a model that does other work than its engine
(fresh blocks freed to the tail, a refill in the wrong order, a hit left on the free
queue) fails here; the last test makes such mistakes on purpose and checks they are caught.
The tests after it check _baselines.py's host block tables (bench_page_table.py's ``numpy-blocks``
and ``vllm-blocks``) step for step against the table.
Both engines keep id 0 out of use (vLLM's null block, SGLang's padding page): their ids
are tpool's plus one.
"""

import os
import random
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import _baselines  # noqa: E402
import bench_evict  # noqa: E402
import _engines  # noqa: E402
import bench_page_table  # noqa: E402
import bench_pool  # noqa: E402
import bench_revive  # noqa: E402

PAGE = bench_pool.PAGE_SIZE


def _no_sync():
    pass


def test_vllm_block_pool_by_hand():
    """A worked example of vLLM's rules: block 0 is the null block; get_new_blocks pops the queue's head and
    drops a cached block's hash; free_blocks puts a block without a hash back at the head, a cached one at
    the tail; touch takes an unreferenced block out of the middle and leaves the null block alone."""
    v = _engines.VllmBlockPool(6)
    q = v.free_block_queue
    assert v.null_block.block_id == 0 and v.null_block.is_null and q.block_ids() == [1, 2, 3, 4, 5]
    a = v.get_new_blocks(2)
    assert [b.block_id for b in a] == [1, 2] and [b.ref_cnt for b in a] == [1, 1] and q.num_free_blocks == 3
    v.cache_block(a[1], _engines.block_hash_key(7))  # block 2 filled and hashed, block 1 not
    v.free_blocks(reversed(a))
    assert q.block_ids() == [1, 3, 4, 5, 2] and q.num_free_blocks == 5 and a[1].ref_cnt == 0
    v.touch([a[1], v.null_block])  # a prefix hit on block 2 (and a null block, as sliding windows pass)
    assert q.block_ids() == [1, 3, 4, 5] and q.num_free_blocks == 4 and a[1].ref_cnt == 1
    assert v.null_block.ref_cnt == 1  # counted, never queued
    v.free_blocks([a[1]])
    assert q.block_ids() == [1, 3, 4, 5, 2] and len(v.cached_block_hash_to_block) == 1
    got = v.get_new_blocks(5)
    assert [b.block_id for b in got] == [1, 3, 4, 5, 2] and q.num_free_blocks == 0
    assert a[1].block_hash is None and len(v.cached_block_hash_to_block) == 0  # evicted as it was popped
    with pytest.raises(ValueError):
        v.get_new_blocks(1)
    with pytest.raises(RuntimeError):
        q.remove(a[0])  # not on the queue: vLLM's check refuses it


def test_sglang_paged_pool_by_hand():
    """SGLang's paged allocator: pages 1..P free; alloc returns the pages' token slots; free finds the pages
    (slot // page size, unique, sorted) and puts them in front."""
    s = _engines.SGLangPagedPool(5, 4, "cpu")
    assert s.alloc(3 * 4).tolist() == list(range(4, 16))  # pages 1, 2, 3
    assert s.alloc(2 * 4).tolist() == list(range(16, 24)) and s.alloc(4) is None
    s.free(torch.tensor([13, 12, 5, 6, 4, 14, 15, 7], dtype=torch.int64))  # pages 3 and 1, out of order
    assert s.free_pages.tolist() == [1, 3]


def pool_rounds(n, num_pages, rounds=3):
    """Per round of the benchmark's workload (alloc n pages, free them): the pages each implementation handed
    out, as sorted tpool page ids (an engine's ids less one)."""
    pool = tpool_pool = bench_pool.tpool.PagePool(num_pages, device="cpu", backend="numba", max_alloc_pages=n)
    counts = torch.tensor([n], dtype=torch.int32)
    vllm = _engines.VllmBlockPool(num_pages + 1)
    sgl = _engines.SGLangPagedPool(num_pages, PAGE, "cpu")
    host, sl = bench_pool.HostListPool(num_pages), bench_pool.TorchSlicePool(num_pages, "cpu")
    out = {name: [] for name in ("tpool", "vllm-queue", "sglang-paged", "host-list", "torch-slice")}
    for _ in range(rounds):
        res = pool.alloc(counts)
        out["tpool"].append(sorted(res.pages[:n].tolist()))
        pool.free(res.pages)
        blocks = vllm.get_new_blocks(n)
        assert all(b.ref_cnt == 1 for b in blocks)
        out["vllm-queue"].append(sorted(b.block_id - 1 for b in blocks))
        vllm.free_blocks(blocks)
        assert all(b.ref_cnt == 0 for b in blocks) and vllm.get_num_free_blocks() == num_pages
        slots = sgl.alloc(n * PAGE)
        pages = slots.view(n, PAGE) // PAGE
        assert (pages == pages[:, :1]).all() and (slots.view(n, PAGE) % PAGE == torch.arange(PAGE)).all()
        out["sglang-paged"].append(sorted((pages[:, 0] - 1).tolist()))
        sgl.free(slots)
        got = host.alloc(n)
        out["host-list"].append(sorted(got))
        host.free(got)
        got = sl.alloc(n)
        out["torch-slice"].append(sorted(got.tolist()))
        sl.free(got)
    tpool_pool.check()
    return out


@pytest.mark.parametrize("n, num_pages", [(1, 7), (5, 67), (64, 64), (129, 300)])
def test_pool_baselines_hand_out_tpool_pages(n, num_pages):
    """bench_pool.py's page baselines hand out the pages tpool does, round after round: vLLM because
    free_blocks puts blocks without a hash back at the head of its queue, SGLang's paged allocator because
    free puts the pages in front of its free tensor. torch-slice, SGLang's token allocator, gives freed
    slots back at the end of its tensor: it walks through the pool, n slots a round."""
    out = pool_rounds(n, num_pages)
    assert out["tpool"] == [list(range(n))] * 3
    for name in ("vllm-queue", "sglang-paged", "host-list"):
        assert out[name] == out["tpool"], name
    assert out["torch-slice"] == [sorted((r * n + i) % num_pages for i in range(n)) for r in range(3)]


def test_pool_rows_run_and_verify():
    """bench_pool.py's rows for the new baselines run and their verify() holds; one that loses a page fails."""
    fns = bench_pool.pair_fns(9, 40, torch.device("cpu"), [], only=["vllm-queue", "sglang-paged"])
    assert set(fns) == {"vllm-queue", "sglang-paged"}
    for fn in fns.values():
        fn()
        fn()
        fn.verify()
    leaky = bench_pool.pair_fns(9, 40, torch.device("cpu"), [], only=["vllm-queue"])["vllm-queue"]
    leaky.model.get_new_blocks(1)  # a block never freed
    with pytest.raises(AssertionError, match="lost"):
        leaky.verify()


def evict_rounds(P, k, rounds):
    """(tpool's, vllm-queue's) evicted pages per sample of bench_evict.py's workload, oldest first."""
    pool = bench_evict.cached_pools(P, ["numba"], torch.device("cpu"))["numba"]
    tp = bench_evict.tpool_sampler(pool, k, _no_sync)  # its first (untimed) sample evicts and refills
    model = bench_evict.VllmEvict(pool)
    assert model.vllm.free_block_queue.block_ids() == [p + 1 for p in bench_evict.lru_order(pool)]
    vs = bench_evict.vllm_sampler(model, k)
    got_t, got_v = [], []
    for _ in range(rounds):
        tp()
        vs()
        got_t.append(tp.out.tolist())
        got_v.append(vs.evicted)
    pool.check()
    return got_t, got_v


@pytest.mark.parametrize("k", [1, 7, 200])
def test_vllm_eviction_evicts_tpool_pages_in_order(k):
    """vllm-queue evicts the pages tpool evicts, in the same order, sample after sample, past the point where
    the refilled pages come up for eviction again (so the refill's order counts too)."""
    rounds = 512 // k + 3
    got_t, got_v = evict_rounds(1024, k, rounds)
    assert all(len(e) == k for e in got_v)
    assert got_v == got_t
    assert len({p for e in got_t for p in e}) < k * rounds  # some page came round again


def revive_state(k):
    """tpool's and vLLM's state after bench_revive's revive of k cached pages into row 1."""
    table, pages = bench_revive.cached_table(k, "numba", torch.device("cpu"))
    table.revive(1, pages, k * bench_revive.PAGE_SIZE)
    s = table.pool.stats()
    model = bench_revive.VllmRevive(k)
    hit = [b.block_id - 1 for b in model.hit]
    model.revive("req-1", 1)
    return dict(
        tpool=dict(hit=pages.tolist(), row=table.block_table[1, :k].tolist(),
                   unreferenced=s["pages.free.current"] + s["pages.cached.current"]),
        vllm=dict(hit=hit, row=(model.block_tables[0].block_table_np[1, :k] - 1).tolist(),
                  unreferenced=model.pool.get_num_free_blocks())), model


@pytest.mark.parametrize("k", [1, 8, 33])
def test_vllm_revive_fills_tpool_row(k):
    """vllm-touch revives the pages tpool revives into the same row, and leaves as many pages unreferenced;
    its hit blocks are off the free queue, referenced once, and back on its tail once the request ends."""
    state, model = revive_state(k)
    assert state["vllm"] == state["tpool"]
    assert state["tpool"]["unreferenced"] == 3 * k
    hit_ids = {b.block_id for b in model.hit}
    assert all(b.ref_cnt == 1 for b in model.hit)
    assert hit_ids.isdisjoint(model.pool.free_block_queue.block_ids())
    assert model.block_tables[0].num_blocks_per_row[1] == k
    model.release("req-1")
    assert model.pool.free_block_queue.block_ids()[-k:] == [b.block_id for b in reversed(model.hit)]
    sample = bench_revive.vllm_sampler(k)
    assert all(sample() > 0 for _ in range(3))  # its own checks hold sample after sample


def _fresh_to_tail(self, ordered_blocks):
    """vLLM's free_blocks as it is not: every freed block appended, fresh ones too."""
    blocks = list(ordered_blocks)
    for b in blocks:
        b.ref_cnt -= 1
    self.free_block_queue.append_n([b for b in blocks if b.ref_cnt == 0 and not b.is_null])


def _refill_in_order(self, blocks):
    """A refill that frees the blocks first to last (vLLM frees a request's blocks last first)."""
    for block in blocks:
        self.vllm.cache_block(block, _engines.block_hash_key(next(self.hashes)))
    self.vllm.free_blocks(blocks)


def _touch_without_remove(self, blocks):
    """touch that references the blocks but leaves them on the free queue."""
    for block in blocks:
        block.ref_cnt += 1


@pytest.mark.parametrize("mistake", ["fresh blocks to the tail", "refill in order", "touch without remove",
                                     "sglang pages at the back"])
def test_a_wrong_model_is_caught(mistake, monkeypatch):
    """Each comparison above fails for a model that gets one of the engine's rules wrong."""
    if mistake == "fresh blocks to the tail":
        monkeypatch.setattr(_engines.VllmBlockPool, "free_blocks", _fresh_to_tail)
        out = pool_rounds(5, 67)
        assert out["vllm-queue"] != out["tpool"]
    elif mistake == "refill in order":
        monkeypatch.setattr(bench_evict.VllmEvict, "refill", _refill_in_order)
        got_t, got_v = evict_rounds(1024, 200, 5)
        assert got_v != got_t
    elif mistake == "touch without remove":
        monkeypatch.setattr(_engines.VllmBlockPool, "touch", _touch_without_remove)
        state, _ = revive_state(8)
        assert state["vllm"] != state["tpool"]
    else:
        monkeypatch.setattr(_engines.SGLangPagedPool, "free", lambda self, idx: setattr(
            self, "free_pages", torch.cat((self.free_pages, torch.unique(idx // self.page_size)))))
        out = pool_rounds(5, 67)
        assert out["sglang-paged"] != out["tpool"]


# ------------------------------------------------ _baselines.py: bench_page_table.py's host block tables
def test_the_two_host_baselines_step_as_the_table_does():
    """numpy-blocks (vectorised, a free stack) and vllm-blocks (vLLM's free queue of block objects, a loop per
    request) from the table's prompts, through decode steps and turnover phases (releases, admissions with
    prompts): every step's outputs are the table's own. numpy-blocks' page for page (a stack, as the
    table's); vllm-blocks' page for page until the first release (vLLM's block ids are the pages plus one,
    block 0 being its null block), then other pages (without prefix caching vLLM frees to its queue's
    tail), but each token at its offset on the page its request's run holds at that position, no page in
    two runs or in a run and free, as many pages free as the table has. vllm-blocks hands over the batch's
    block-table rows, from which the CSR's page ids are read here (vLLM gathers them on the GPU)."""
    bpt = bench_page_table
    B, cpu, ps = 5, torch.device("cpu"), bpt.PAGE_SIZE
    _, table, _ = bpt.setup(B, "numba", cpu, random.Random(B))
    nb, vb = bpt.baseline(bpt.NumpyBlocks, B, cpu), bpt.baseline(bpt.VllmBlocks, B, cpu)
    t32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    steps = [([], list(range(B)), [1] * B)] * 20 + bpt.turnover_phases(B, random.Random(3)) * 2
    released = False
    for gone, batch, ntok in steps:
        if gone:
            table.release(t32(gone))
        s = table.step(t32(batch), t32(ntok), max_tokens=sum(ntok))
        want = (s.slots[:sum(ntok)], s.csr.indptr, s.csr.last_page_len, s.csr.indices[:int(s.csr.indptr[-1])])
        got_nb = bpt.release_then_step(nb, gone, np.array(batch), np.array(ntok))
        slots, indptr, last, rows = bpt.release_then_step(vb, gone, batch, ntok)
        pages = indptr[1:] - indptr[:-1]
        indices = rows.view(B, -1)[torch.arange(rows.numel() // B) < pages[:, None]]  # (vLLM: on the GPU)
        got_vb = (slots - ps, indptr, last, indices - 1)  # vLLM's block i + 1 is page i
        released |= bool(gone)
        for got, same_pages in ((got_nb, True), (got_vb, not released)):
            slots, indptr, last, indices = got
            assert torch.equal(indptr, want[1]) and torch.equal(last, want[2]), (gone, batch, ntok)
            assert torch.equal(slots % ps, want[0] % ps)  # each token at its offset
            # each token on the page its request's run holds at that token's position
            lane = torch.repeat_interleave(torch.arange(B), t32(ntok))
            pos = torch.cat([torch.arange(int(L) - n, int(L)) for L, n in zip(s.kv_lens, ntok)])
            assert torch.equal(slots // ps, indices[indptr[lane] + pos // ps]), (gone, batch, ntok)
            assert len(set(indices.tolist())) == len(indices)
            if same_pages:
                assert torch.equal(indices, want[3]) and torch.equal(slots, want[0])
        queue = vb.pool.free_block_queue
        assert not set(got_vb[3].tolist()) & {b - 1 for b in queue.block_ids()}
        assert queue.num_free_blocks == len(queue.block_ids()) == nb.top == table.pool.available()
    assert released


def test_the_baselines_resets_repeat_their_steps():
    """A baseline's snapshot, taken mid-turnover and reset after more steps, puts it back exactly: the same
    steps then give the same outputs, and vLLM's free queue and reference counts are as they were."""
    bpt = bench_page_table
    B, cpu = 5, torch.device("cpu")
    steps = ([([], list(range(B)), [1] * B)] * 7 + bpt.turnover_phases(B, random.Random(3))) * 2
    for cls in (bpt.NumpyBlocks, bpt.VllmBlocks):
        blocks = bpt.baseline(cls, B, cpu)
        args = (lambda b, n: (np.array(b), np.array(n))) if cls is bpt.NumpyBlocks else (lambda b, n: (b, n))
        for at in (3, 9, 20):
            for gone, batch, ntok in steps[:at]:
                bpt.release_then_step(blocks, gone, *args(batch, ntok))
            reset = blocks.snapshot()
            state = (blocks.pool.free_block_queue.block_ids(), [b.ref_cnt for b in blocks.pool.blocks]) \
                if cls is bpt.VllmBlocks else None
            runs = []
            for _ in range(2):
                runs.append([[t.clone() for t in bpt.release_then_step(blocks, gone, *args(batch, ntok))]
                             for gone, batch, ntok in steps[at:]])
                reset()
            assert all(torch.equal(x, y) for a, b in zip(*runs) for x, y in zip(a, b)), (cls.__name__, at)
            if state:
                assert (blocks.pool.free_block_queue.block_ids(), [b.ref_cnt for b in blocks.pool.blocks]) == state


def test_the_baselines_staged_copies_hand_over_each_steps_values():
    """DeviceOutputs as on CUDA (buffers kept from step to step, grown when an output outgrows them), run
    on the CPU: every call hands over its own values, whatever the step before wrote."""
    out = _baselines.DeviceOutputs(torch.device("cpu"), staged=True)
    for n in (3, 1, 9, 40, 2):
        vals = [np.arange(n, dtype=np.int64) * 7, list(range(n, 0, -1))]
        got = out(*vals)
        assert [g.tolist() for g in got] == [list(v) for v in vals] and got[0].dtype == torch.int32
    assert out.dev[0].numel() == 80  # grown twice: 6 -> 18 -> 80 entries



def test_vllm_blocks_frees_last_block_first_and_reuses_the_smallest_row():
    """VllmBlocks.release frees a request's blocks last first, to the free queue's tail (no prefix caching);
    a new request takes the smallest freed row of the batch."""
    bl = _baselines
    vb = bl.VllmBlocks(20, 3, 8, torch.device("cpu"))
    vb.step([0, 1], [40, 1])  # request 0: blocks 1, 2, 3; request 1: block 4
    vb.release(0)
    vb.release(1)
    assert vb.pool.free_block_queue.block_ids()[-4:] == [3, 2, 1, 4]
    vb.step([2, 1], [1, 1])  # rows 0 and 1 freed in that order: request 2 takes row 0, request 1 row 1
    assert vb.index[2] == 0 and vb.index[1] == 1


def test_device_outputs_on_a_cpu_are_int32_and_not_overwritten():
    """DeviceOutputs on a CPU (not staged by default): int32 tensors a later call does not overwrite;
    staged, a kept buffer grows only when an output outgrows it."""
    bl = _baselines
    out = bl.DeviceOutputs(torch.device("cpu"))
    assert out.staged is False
    first = out(np.arange(3, dtype=np.int64))[0]
    out(np.arange(3, dtype=np.int64) + 10)
    assert first.tolist() == [0, 1, 2] and first.dtype == torch.int32
    staged = bl.DeviceOutputs(torch.device("cpu"), staged=True)
    staged(np.arange(3))
    kept = staged.dev[0]
    assert staged(np.arange(6))[0].tolist() == list(range(6)) and staged.dev[0] is kept  # 6 fits 2 * 3
