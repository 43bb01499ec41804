"""What the engines tpool is compared with do, modelled on the host for the benchmarks' baselines.

The engines are not dependencies: these classes do the work their sources do per call, with
the same data structures, so a baseline row times that work and not a shortcut of it
(``tests/test_bench_baselines.py`` checks each model against tpool and against rules stated
by hand). Only the parts a benchmark times are here, and they leave out the engines' per-block
metrics hooks and property accessors: if anything, a model is faster than its engine.

vLLM V1 (``vllm/v1/core/kv_cache_utils.py``, ``vllm/v1/core/block_pool.py``,
``vllm/v1/worker/block_table.py``):

* :class:`KVCacheBlock`: a page as a Python object: id, reference count, the hash it is
  cached under, links in the free queue, and whether it is the null block.
* :class:`FreeKVCacheBlockQueue`: the unreferenced blocks as a doubly linked list between two
  sentinels, in id order at first. Allocation pops from the head; a block can be taken out of
  the middle in O(1) (a prefix hit).
* :class:`BlockHashToBlockMap`: the prefix cache's index, hash -> block (or several blocks).
* :class:`VllmBlockPool`: ``get_new_blocks`` (pops, drops a popped block's hash: that is
  vLLM's eviction, then references), ``touch`` (a prefix hit), ``free_blocks`` (dereferences;
  blocks no hit can use go back at the head, reused first, cached ones at the tail, evicted
  last), ``cache_block``. Block 0 is the null block, never handed out: a model with ``P + 1``
  blocks has tpool's ``P`` pages, block ``i + 1`` standing for page ``i``.
* :class:`KVCacheBlocks`: the blocks handed to the scheduler, and their ids.
* :class:`VllmBlockTable`: the worker's numpy block table (``append_row``, ``add_row``).

SGLang (``python/sglang/srt/mem_cache/allocator``): :class:`SGLangPagedPool`, the paged
token-to-KV allocator (a tensor of free pages; page 0 is its padding page).
"""

import numpy as np
import torch

# A model of vLLM's pool holds a Python object per page (~2 s to build a million): the benchmarks leave it
# out of pools larger than this.
VLLM_MAX_PAGES = 1 << 22


class KVCacheBlock:
    """vLLM's page object."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block", "is_null")

    def __init__(self, block_id):
        self.block_id, self.ref_cnt, self.block_hash = block_id, 0, None
        self.prev_free_block = self.next_free_block = None
        self.is_null = False


class FreeKVCacheBlockQueue:
    """vLLM's free queue: ``blocks`` linked head to tail between two sentinel blocks, with a count."""

    def __init__(self, blocks):
        self.head, self.tail = KVCacheBlock(-1), KVCacheBlock(-1)
        self.relink(blocks)

    def relink(self, blocks):
        """Make ``blocks`` (in queue order) the whole queue (a benchmark's reset; vLLM's constructor)."""
        prev = self.head
        for b in blocks:
            prev.next_free_block, b.prev_free_block = b, prev
            prev = b
        prev.next_free_block, self.tail.prev_free_block = self.tail, prev
        self.num_free_blocks = len(blocks)

    def popleft(self):
        """The head block, unlinked."""
        return self.popleft_n(1)[0]

    def popleft_n(self, n):
        """The first ``n`` blocks, unlinked (``ValueError`` when fewer are free)."""
        if n > self.num_free_blocks:
            raise ValueError(f"{n} blocks asked, {self.num_free_blocks} free")
        out, cur = [], self.head.next_free_block
        for _ in range(n):
            out.append(cur)
            nxt = cur.next_free_block
            cur.prev_free_block = cur.next_free_block = None
            cur = nxt
        self.head.next_free_block, cur.prev_free_block = cur, self.head
        self.num_free_blocks -= n
        return out

    def remove(self, block):
        """Unlink ``block`` from the middle of the queue (``RuntimeError`` when it is not on it)."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"block {block.block_id} is not on the free queue")
        prev.next_free_block, nxt.prev_free_block = nxt, prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def prepend_n(self, blocks):
        """Link ``blocks`` at the head, in order (the first is handed out first)."""
        self._link_after(self.head, blocks)

    def append_n(self, blocks):
        """Link ``blocks`` at the tail, in order."""
        self._link_after(self.tail.prev_free_block, blocks)

    def _link_after(self, prev, blocks):
        after = prev.next_free_block
        for b in blocks:
            prev.next_free_block, b.prev_free_block = b, prev
            prev = b
        prev.next_free_block, after.prev_free_block = after, prev
        self.num_free_blocks += len(blocks)

    def blocks(self):
        """The free blocks, head to tail (a walk of the queue, checking its back links: untimed)."""
        out, b = [], self.head.next_free_block
        while b is not self.tail:
            assert b.next_free_block.prev_free_block is b, f"a broken link after block {b.block_id}"
            out.append(b)
            b = b.next_free_block
        return out

    def block_ids(self):
        """The free blocks' ids, head to tail (untimed)."""
        return [b.block_id for b in self.blocks()]


class BlockHashToBlockMap:
    """vLLM's prefix-cache index: a hash maps to one block, or to a dict of blocks by id when several
    blocks were cached under the same hash."""

    def __init__(self):
        self._cache = {}

    def insert(self, key, block):
        held = self._cache.get(key)
        if held is None:
            self._cache[key] = block
        elif isinstance(held, dict):
            held[block.block_id] = block
        else:
            self._cache[key] = {held.block_id: held, block.block_id: block}

    def pop(self, key, block_id):
        """The block ``block_id`` cached under ``key``, taken out of the index; None if it is not there."""
        held = self._cache.pop(key, None)
        if held is None:
            return None
        if isinstance(held, dict):
            block = held.pop(block_id, None)
            if held:
                self._cache[key] = held
            return block
        if held.block_id == block_id:
            return held
        self._cache[key] = held
        return None

    def __len__(self):
        return len(self._cache)


def block_hash_key(i: int) -> bytes:
    """A distinct key shaped as vLLM's (a 32-byte hash, then the KV cache group's id, 0)."""
    return i.to_bytes(32, "big") + bytes(4)


class VllmBlockPool:
    """vLLM's ``BlockPool`` of ``num_blocks`` blocks, one KV cache group, no events or metrics.

    ``enable_caching``: prefix caching (vLLM's default), under which a block popped for reuse
    loses its hash and its index entry as it goes.
    """

    def __init__(self, num_blocks, enable_caching=True):
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    def get_num_free_blocks(self):
        return self.free_block_queue.num_free_blocks

    def get_new_blocks(self, n):
        """``n`` blocks off the head of the free queue, each referenced once; with caching, a popped
        block's hash and index entry are dropped first (vLLM evicts as it allocates)."""
        blocks = self.free_block_queue.popleft_n(n)
        for b in blocks:
            if self.enable_caching and b.block_hash is not None:
                if self.cached_block_hash_to_block.pop(b.block_hash, b.block_id) is not None:
                    b.block_hash = None
            assert b.ref_cnt == 0, f"block {b.block_id} was on the free queue with references"
            b.ref_cnt += 1
        return blocks

    def touch(self, blocks):
        """A prefix hit: each block taken off the free queue if unreferenced (never the null block), then
        referenced."""
        for b in blocks:
            if b.ref_cnt == 0 and not b.is_null:
                self.free_block_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, ordered_blocks):
        """Each block dereferenced; those left unreferenced go back on the queue. With caching, a block no
        prefix hit can use (no hash) goes to the head, reused first, and a cached one to the tail, evicted
        last; without, every block goes to the tail (the rule of the vLLM sources read for this model; some
        versions send every unhashed block to the head, caching or not: the same work). A request's blocks
        come last block first, so its tail is reused (or evicted) first."""
        blocks = list(ordered_blocks)
        reuse_first, reuse_last = [], []
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0 and not b.is_null:
                (reuse_first if b.block_hash is None and self.enable_caching else reuse_last).append(b)
        self.free_block_queue.prepend_n(reuse_first)
        self.free_block_queue.append_n(reuse_last)

    def cache_block(self, block, key):
        """A full block entered in the prefix cache under ``key`` (what ``cache_full_blocks`` does for it)."""
        assert block.block_hash is None, f"block {block.block_id} is cached already"
        block.block_hash = key
        self.cached_block_hash_to_block.insert(key, block)


class KVCacheBlocks:
    """vLLM's allocation result, handed from the KV cache manager to the scheduler: blocks per group."""

    def __init__(self, blocks):
        self.blocks = blocks

    def get_block_ids(self):
        return tuple([b.block_id for b in group] for group in self.blocks)


class VllmBlockTable:
    """vLLM's worker-side ``BlockTable`` for one KV cache group: block ids per row of the persistent batch
    in a numpy int32 array (the host side of what is copied to the GPU), and a block count per row."""

    def __init__(self, max_num_reqs, max_num_blocks_per_req):
        self.block_table_np = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)

    def append_row(self, block_ids, row):
        """``block_ids`` (a list) after the row's blocks."""
        if not block_ids:
            return
        start = self.num_blocks_per_row[row]
        self.num_blocks_per_row[row] = start + len(block_ids)
        self.block_table_np[row, start:start + len(block_ids)] = block_ids

    def add_row(self, block_ids, row):
        """The row's blocks replaced by ``block_ids`` (a new request in that row)."""
        self.num_blocks_per_row[row] = 0
        self.append_row(block_ids, row)


class SGLangPagedPool:
    """SGLang's paged token-to-KV allocator: pages ``1..num_pages`` free in an int64 tensor on ``device``
    (page 0 is its padding page). ``alloc`` takes a token count (a multiple of ``page_size``) and returns
    the pages' token slots, ``page * page_size + offset``; ``free`` takes slots, finds their pages
    (``torch.unique``, sorted) and puts them in front of the free pages, to be handed out first."""

    def __init__(self, num_pages, page_size, device):
        self.page_size, self.device = page_size, device
        self.free_pages = torch.arange(1, num_pages + 1, dtype=torch.int64, device=device)

    def alloc(self, need_size):
        n = need_size // self.page_size
        if n > len(self.free_pages):
            return None
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        return (pages[:, None] * self.page_size + torch.arange(self.page_size, device=self.device)).reshape(-1)

    def free(self, slots):
        if slots.numel():
            self.free_pages = torch.cat((torch.unique(slots // self.page_size), self.free_pages))
