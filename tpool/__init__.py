"""tpool: a device-resident page pool for LLM inference engines.

The allocator state (free stack, reference counts, page states, LRU stamps,
counters) lives in tensors on the pool's device and is updated by fixed-shape
kernel passes that never read device memory back on the host.
"""

from tpool._version import __version__
from tpool.errors import (CorruptState, DoubleFree, InvalidCount, InvalidLength, InvalidPage, InvalidRequest,
                          InvariantViolation, OutputOverflow, PoolError, RefcountOverflow, StaleBinding,
                          TableOverflow, UseAfterFree)
from tpool.free_group import FreeGroup
from tpool.memory.arena import Arena, Block
from tpool.memory.owned_cache import CacheStats, OwnedCache
from tpool.memory.ownership import (OwnershipPlan, compact_bytes, needs_compaction, own, payload_bytes,
                                    plan_ownership, retained_bytes, storage_bytes)
from tpool.memory.planner import PagePlan, PlanError, plan_pages
from tpool.memory.report import MemoryReport, format_report, memory_report
from tpool.page_table import (BoundStep, ExtendResult, ForkResult, PagedKVCSR, PageTable, StepOut,
                              StepResult)
from tpool.pool import AllocOut, AllocResult, BoundCall, PagePool

__all__ = [
    "__version__",
    "PagePool", "AllocOut", "AllocResult", "BoundCall", "FreeGroup",
    "PageTable", "ExtendResult", "StepResult", "BoundStep", "StaleBinding", "StepOut", "ForkResult", "PagedKVCSR",
    "PoolError", "InvalidPage", "DoubleFree", "UseAfterFree", "InvalidCount", "OutputOverflow",
    "InvalidRequest", "TableOverflow", "InvalidLength", "InvariantViolation", "CorruptState", "RefcountOverflow",
    "payload_bytes", "storage_bytes", "compact_bytes", "retained_bytes", "needs_compaction", "own",
    "plan_ownership", "OwnershipPlan", "OwnedCache", "CacheStats", "Arena", "Block",
    "memory_report", "format_report", "MemoryReport", "plan_pages", "PagePlan", "PlanError",
]
