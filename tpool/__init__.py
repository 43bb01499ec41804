"""tpool: a device-resident page pool for LLM inference engines.

The allocator state (free stack, reference counts, page states, LRU stamps,
counters) lives in tensors on the pool's device and is updated by fixed-shape
kernel passes that never read device memory back on the host.
"""

from tpool.errors import CorruptState, RefcountOverflow  # noqa: F401  (issue 11: corrupt state, saturated counts)
from tpool.errors import (DoubleFree, InvalidCount, InvalidLength, InvalidPage, InvalidRequest,
                          InvariantViolation, OutputOverflow, PoolError, TableOverflow, UseAfterFree)
from tpool.free_group import FreeGroup
from tpool.memory.arena import Arena, Block
from tpool.memory.owned_cache import CacheStats, OwnedCache
from tpool.memory.ownership import (OwnershipPlan, compact_bytes, needs_compaction, own, payload_bytes,
                                    plan_ownership, retained_bytes, storage_bytes)
from tpool.memory.planner import PagePlan, PlanError, plan_pages
from tpool.memory.report import MemoryReport, format_report, memory_report
from tpool.page_table import BoundStep, ExtendResult, ForkResult, PagedKVCSR, PageTable, StaleBinding, StepResult
from tpool.pool import AllocOut, AllocResult, PagePool

__all__ = [
    "PagePool", "AllocOut", "AllocResult", "FreeGroup",
    "PageTable", "ExtendResult", "StepResult", "BoundStep", "StaleBinding", "ForkResult", "PagedKVCSR",
    "PoolError", "InvalidPage", "DoubleFree", "UseAfterFree", "InvalidCount", "OutputOverflow",
    "InvalidRequest", "TableOverflow", "InvalidLength", "InvariantViolation",
    "payload_bytes", "storage_bytes", "compact_bytes", "retained_bytes", "needs_compaction", "own",
    "plan_ownership", "OwnershipPlan", "OwnedCache", "CacheStats", "Arena", "Block",
    "memory_report", "format_report", "MemoryReport", "plan_pages", "PagePlan", "PlanError",
]
