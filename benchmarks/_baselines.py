"""The host baselines of ``bench_page_table.py``: one scheduler step (decode, or release and admit) done
on the host and handed to the device, as an engine without tpool does it.

* :class:`VllmBlocks`: the KV-cache part of vLLM V1's step, on ``_engines``' models of its block pool
  and block table.
* :class:`NumpyBlocks`: the best case of a host block table, every step vectorised in numpy.
* :class:`DeviceOutputs`: how both hand their outputs to the device.
"""

import numpy as np
import torch

from _engines import VllmBlockPool, VllmBlockTable


class VllmBlocks:
    """The KV-cache part of vLLM V1's host work per step, as its scheduler and its GPU worker do it.

    Scheduler (``KVCacheManager.allocate_slots`` for each scheduled request, a Python loop): the pages
    its tokens need beyond the ones it holds come from ``BlockPool.get_new_blocks`` (``popleft_n`` on
    the free queue, each page's ``ref_cnt`` raised), are appended to the request's block list, and
    their ids go to the worker. Worker (``_update_states``): a new request takes a row of the
    persistent batch (the smallest freed one first, as the model runner fills the rows finished
    requests left), and each request's new ids are appended to its row of the numpy block table
    (``BlockTable.append_row``). Then ``_prepare_inputs``, vectorised in numpy: positions from the
    rows' computed tokens and the slot mapping read from the block table; of the FlashInfer CSR, the
    host computes ``indptr`` and the last page lengths (B entries each) and hands over the batch's rows
    of the block table (``block_table[:num_reqs]``, copied to the GPU on CUDA): vLLM gathers the CSR's
    page ids from them on the GPU, work not timed here (tpool's step writes them in its call). A
    finished request's blocks are freed as ``KVCacheManager.free`` does (last block first, each
    ``ref_cnt`` lowered; with prefix caching off every block goes to the tail of the queue) and its
    row of the batch is freed.

    Returns ``(slots, indptr, last_page_len, block_table_rows)`` (the rows flat, ``B * MP`` ids). The
    pool and the block table are ``_engines``' models of vLLM's, prefix caching off (no block hashes
    to compute). Left out: the scheduler's token budget and outputs. Block 0 is vLLM's null block, so
    block ``i + 1`` is tpool's page ``i``; ``tests/test_benchmarks_run.py`` checks the outputs against
    the table's step.
    """

    def __init__(self, num_pages, R, MP, device, page_size=16):
        self.ps = page_size
        self.pool = VllmBlockPool(num_pages + 1, enable_caching=False)   # num_pages besides the null block
        self.worker = VllmBlockTable(R, MP)
        self.table, self.num_blocks = self.worker.block_table_np, self.worker.num_blocks_per_row
        self.req_blocks, self.num_tokens = [[] for _ in range(R)], [0] * R  # the scheduler's, per request
        self.index, self.freed_rows, self.num_reqs = [-1] * R, [], 0          # request -> row of the batch
        self.computed, self.scheduled = np.zeros(R, dtype=np.int64), np.zeros(R, dtype=np.int64)
        self.arange = np.arange(R * MP * page_size)
        self.to_device = DeviceOutputs(device)

    def step(self, batch, ntoks):
        """One step: ``ntoks[i]`` tokens for request ``batch[i]`` (lists of ints, the scheduler's). The batch
        must be the persistent batch's rows in order (every running request, as in the benchmark)."""
        ps, pool, index, new = self.ps, self.pool, self.index, []
        for r, n in zip(batch, ntoks):                       # the scheduler: allocate_slots per request
            blocks = self.req_blocks[r]
            k = -(-(self.num_tokens[r] + n) // ps) - len(blocks)
            if k > 0:
                got = pool.get_new_blocks(k)                 # (ValueError when fewer are free)
                blocks.extend(got)
                new.append((r, [b.block_id for b in got]))
            self.num_tokens[r] += n
            i = index[r] if index[r] >= 0 else self._add(r)
            self.scheduled[i] = n                            # the worker's tokens per row, by row
        for r, ids in new:                                   # the worker: BlockTable.append_row
            self.worker.append_row(ids, index[r])
        B = len(batch)
        assert index[batch[0]] == 0 and index[batch[-1]] == B - 1 == self.num_reqs - 1, "not the persistent batch"
        nt = self.scheduled[:B]                              # _prepare_inputs, in numpy
        cu = np.cumsum(nt)
        req = np.repeat(self.arange[:B], nt)
        pos = self.computed[req] + self.arange[:cu[-1]] - np.repeat(cu - nt, nt)
        slots = self.table.ravel()[req * self.table.shape[1] + pos // ps] * ps + pos % ps
        self.computed[:B] += nt
        seq, pages = self.computed[:B], self.num_blocks[:B]
        indptr = np.zeros(B + 1, dtype=np.int32)
        np.cumsum(pages, out=indptr[1:])
        last = seq - (pages - 1) * ps
        return self.to_device(slots, indptr, last, self.table[:B].reshape(-1))

    def _add(self, r):
        """The worker's add_request: request ``r`` takes the smallest freed row, else the next one."""
        if self.freed_rows:
            self.freed_rows.sort(reverse=True)
            i = self.freed_rows.pop()
        else:
            i = self.num_reqs
        self.num_reqs += 1
        self.index[r] = i
        return i

    def release(self, r):
        """``KVCacheManager.free`` (the request's blocks, last first) and the worker's remove_request."""
        self.pool.free_blocks(reversed(self.req_blocks[r]))
        self.req_blocks[r], self.num_tokens[r] = [], 0
        i, self.index[r] = self.index[r], -1
        self.num_blocks[i] = self.computed[i] = 0
        self.freed_rows.append(i)
        self.num_reqs -= 1

    def snapshot(self):
        """A reset for the benchmark: puts the model back as it is now (the queue relinked, O(pages))."""
        queue = self.pool.free_block_queue
        order, live = queue.blocks(), [b for blocks in self.req_blocks for b in blocks]
        saved = ([list(b) for b in self.req_blocks], list(self.num_tokens), list(self.index), list(self.freed_rows),
                 self.num_reqs, self.table.copy(), self.num_blocks.copy(), self.computed.copy())

        def reset():
            for b in (b for blocks in self.req_blocks for b in blocks):
                b.ref_cnt = 0
            for b in live:  # (taken again: unlinked, one reference)
                b.ref_cnt, b.prev_free_block, b.next_free_block = 1, None, None
            queue.relink(order)
            self.req_blocks, self.num_tokens = [list(b) for b in saved[0]], list(saved[1])
            self.index, self.freed_rows, self.num_reqs = list(saved[2]), list(saved[3]), saved[4]
            for a, b in zip((self.table, self.num_blocks, self.computed), saved[5:]):
                np.copyto(a, b)
        return reset


class NumpyBlocks:
    """Host truth in numpy, every step vectorised: the best case of a host block table.

    A free stack (an int32 array and its top), a block table ``[R, MP]``, page counts and
    lengths per row. A step pops the pages the lanes need in one slice, scatters them into
    the rows, computes the slot mapping as vLLM V1's model runner does from its numpy
    block table (positions, then ``block_table[row, pos // page_size]``), and builds the
    whole CSR on the host, its page ids by a boolean mask over the batch's rows (vLLM
    gathers those on the GPU). No Python loop over requests, where vLLM's scheduler has one
    (``allocate_slots`` per request; ``VllmBlocks`` models it). A decode step of rows 0..B-1 in
    order (``persistent=True``, vLLM's persistent batch) reads the CSR from a view of the table's
    first rows; any other batch gathers its rows first. Returns ``(slots, indptr, last_page_len,
    indices)``. It hands out the table's pages (a stack, as tpool's; ``tests/test_benchmarks_run.py``).
    """

    def __init__(self, num_pages, R, MP, device, page_size=16):
        self.ps = page_size
        self.free, self.top = np.arange(num_pages - 1, -1, -1, dtype=np.int32), num_pages
        self.table = np.full((R, MP), -1, dtype=np.int32)
        self.pages, self.lens = np.zeros(R, dtype=np.int64), np.zeros(R, dtype=np.int64)
        self.cols = np.arange(MP)
        self.to_device = DeviceOutputs(device)

    def step(self, batch, ntoks, persistent=False):
        """One step of the lanes ``batch`` (row ids) growing by ``ntoks`` tokens (int64 arrays);
        ``persistent``: ``batch`` is rows 0..B-1 in order."""
        old, new = self.lens[batch], self.lens[batch] + ntoks
        ps = self.ps
        have, want = self.pages[batch], -(-new // ps)
        need = want - have
        n = int(need.sum())
        taken = self.free[self.top - n:self.top][::-1]  # the order list.pop() gives
        self.top -= n
        lane = np.repeat(np.arange(len(batch)), need)
        self.table[batch[lane], np.arange(n) - np.repeat(np.cumsum(need) - need, need) + have[lane]] = taken
        self.pages[batch], self.lens[batch] = want, new
        tok_lane = np.repeat(np.arange(len(batch)), ntoks)
        pos = np.arange(len(tok_lane)) - np.repeat(np.cumsum(ntoks) - ntoks, ntoks) + old[tok_lane]
        slots = self.table[batch[tok_lane], pos // ps] * ps + pos % ps
        indptr = np.zeros(len(batch) + 1, dtype=np.int32)
        np.cumsum(want, out=indptr[1:])
        indices = (self.table[:len(batch)] if persistent else self.table[batch])[self.cols < want[:, None]]
        last = new - (want - 1) * ps
        return self.to_device(slots, indptr, last, indices)

    def release(self, r):
        k = int(self.pages[r])
        self.free[self.top:self.top + k] = self.table[r, :k]
        self.top += k
        self.table[r, :k], self.pages[r], self.lens[r] = -1, 0, 0

    def snapshot(self):
        """A reset for the benchmark: puts the arrays back as they are now."""
        saved = (self.free.copy(), self.top, self.table.copy(), self.pages.copy(), self.lens.copy())

        def reset():
            np.copyto(self.free, saved[0])
            self.top = saved[1]
            for a, b in zip((self.table, self.pages, self.lens), saved[2:]):
                np.copyto(a, b)
        return reset


class DeviceOutputs:
    """A baseline's outputs (host arrays) as int32 tensors on ``device``, as vLLM hands its inputs to the GPU.

    On CUDA each output is written into a pinned buffer kept from step to step, then copied by one
    non-blocking copy into a device buffer kept too (vLLM's ``CpuGpuBuffer.copy_to_gpu``); a buffer
    grows when an output outgrows it. The benchmark does not wait for the copies, so a step may write
    a pinned buffer a copy of the step before still reads: only the time is read, not the values. On a
    CPU the arrays are handed over as they are (``torch.from_numpy``; int64 ones converted to int32).
    """

    def __init__(self, device, staged=None):
        """``staged``: through the kept buffers (default: on CUDA; on a CPU unpinned, for the tests)."""
        self.device, self.pinned, self.host, self.dev = device, [], [], []
        self.staged = device.type == "cuda" if staged is None else staged

    def __call__(self, *values):
        if not self.staged:
            return tuple(torch.from_numpy(np.asarray(v, dtype=np.int32)) for v in values)
        out = []
        for i, v in enumerate(values):
            n = len(v)
            if i == len(self.pinned) or self.host[i].size < n:
                pinned = torch.empty(2 * max(n, 1), dtype=torch.int32)
                pinned = pinned.pin_memory() if self.device.type == "cuda" else pinned
                bufs = (pinned, pinned.numpy(), torch.empty_like(pinned, device=self.device))
                for kept, buf in zip((self.pinned, self.host, self.dev), bufs):
                    kept[i:i + 1] = [buf]
            self.host[i][:n] = v
            self.dev[i][:n].copy_(self.pinned[i][:n], non_blocking=True)
            out.append(self.dev[i][:n])
        return tuple(out)
