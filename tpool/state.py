"""The pool's state: five device tensors and two scratch vectors, allocated once.

Note: no hot-path call reallocates or rebinds any of these tensors, so the
addresses a captured CUDA graph recorded stay valid for the pool's lifetime.
Page ``i`` is in exactly one state (``page_state[i]``): FREE (its id sits in
``free_stack[:counters[FREE_COUNT]]``), USED (``refcount[i] >= 1``) or CACHED
(``refcount[i] == 0``, content kept, evictable, LRU stamp in ``stamp[i]``).
The stack is popped from the top: a fresh pool hands out pages 0, 1, 2, ...
"""

from dataclasses import dataclass

import torch

from tpool.kernels import layout

INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class PoolState:
    """Tensors of one pool; all on ``device``, shapes fixed by ``num_pages``."""

    num_pages: int
    free_stack: torch.Tensor  # int32 [num_pages]
    refcount: torch.Tensor    # int32 [num_pages]
    page_state: torch.Tensor  # int8  [num_pages]: FREE / USED / CACHED
    stamp: torch.Tensor       # int64 [num_pages]: clock at last release or touch
    counters: torch.Tensor    # int64 [NUM_COUNTERS], slots in layout
    claim: torch.Tensor       # int32 [num_pages] scratch, INT32_MAX between calls
    occur: torch.Tensor       # int32 [num_pages] scratch, 0 between calls
    keys: torch.Tensor        # int64 [num_pages] scratch for eviction

    @classmethod
    def create(cls, num_pages: int, device: torch.device) -> "PoolState":
        i32 = dict(dtype=torch.int32, device=device)
        counters = torch.zeros(layout.NUM_COUNTERS, dtype=torch.int64, device=device)
        counters[layout.FREE_COUNT] = num_pages
        return cls(
            num_pages=num_pages,
            free_stack=torch.arange(num_pages - 1, -1, -1, **i32),
            refcount=torch.zeros(num_pages, **i32),
            page_state=torch.zeros(num_pages, dtype=torch.int8, device=device),
            stamp=torch.zeros(num_pages, dtype=torch.int64, device=device),
            counters=counters,
            claim=torch.full((num_pages,), INT32_MAX, **i32),
            occur=torch.zeros(num_pages, **i32),
            keys=torch.zeros(num_pages, dtype=torch.int64, device=device),
        )

    def tensors(self) -> dict:
        """Every state tensor by name."""
        return {name: getattr(self, name) for name in
                ("free_stack", "refcount", "page_state", "stamp", "counters", "claim", "occur", "keys")}
