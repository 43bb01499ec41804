"""tpool: a device-resident page pool for LLM inference engines.

The allocator state (free stack, reference counts, page states, LRU stamps,
counters) lives in tensors on the pool's device and is updated by fixed-shape
kernel passes that never read device memory back on the host.
"""

from tpool.errors import (DoubleFree, InvalidCount, InvalidLength, InvalidPage, InvalidRequest,
                          InvariantViolation, OutputOverflow, PoolError, TableOverflow, UseAfterFree)
from tpool.free_group import FreeGroup
from tpool.pool import AllocOut, AllocResult, PagePool

__all__ = [
    "PagePool", "AllocOut", "AllocResult", "FreeGroup",
    "PoolError", "InvalidPage", "DoubleFree", "UseAfterFree", "InvalidCount", "OutputOverflow",
    "InvalidRequest", "TableOverflow", "InvalidLength", "InvariantViolation",
]
