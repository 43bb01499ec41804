"""tpool: a device-resident page pool for LLM inference engines.

The allocator state (free stack, reference counts, page states, LRU stamps,
counters) lives in tensors on the pool's device and is updated by fixed-shape
kernel passes that never read device memory back on the host.
"""

from typing import TYPE_CHECKING

from tpool import _hub_kernels

_hub_kernels.install()  # tpool's kernels/ folder must not shadow transformers' kernels (tpool._hub_kernels)
_hub_kernels.map_checkout_kernels(__path__)  # a checkout imported without an editable install finds its kernels/

from tpool._version import __version__  # noqa: E402
from tpool.errors import (CorruptState, DoubleFree, InvalidCount, InvalidLength, InvalidPage,  # noqa: E402
                          InvalidRequest, InvariantViolation, OutputOverflow, PoolError, RefcountOverflow,
                          StaleBinding, TableOverflow, UseAfterFree)
from tpool.free_group import FreeGroup  # noqa: E402
from tpool.bound_step import BoundStep  # noqa: E402
from tpool.page_table import PageTable  # noqa: E402
from tpool.table_results import ExtendResult, ForkResult, PagedKVCSR, StepOut, StepResult  # noqa: E402
from tpool.pool import AllocOut, AllocResult, BoundCall, PagePool  # noqa: E402

# The memory tools are imported at their first use (``tpool.Arena`` imports tpool.memory.arena),
# so that ``import tpool`` costs a process only what a pool and a table need.
_LAZY = {
    "tpool.memory.arena": ("Arena", "Block"),
    "tpool.memory.owned_cache": ("CacheStats", "OwnedCache"),
    "tpool.memory.accounting": ("compact_bytes", "payload_bytes", "retained_bytes", "storage_bytes"),
    "tpool.memory.ownership": ("OwnershipPlan", "needs_compaction", "own", "plan_ownership"),
    "tpool.memory.planner": ("PagePlan", "PlanError", "plan_pages"),
    "tpool.memory.report": ("MemoryReport", "format_report", "memory_report"),
}
_LAZY_NAMES = {name: module for module, names in _LAZY.items() for name in names}

if TYPE_CHECKING:  # what the names are, for type checkers and IDEs
    from tpool.memory.arena import Arena, Block
    from tpool.memory.owned_cache import CacheStats, OwnedCache
    from tpool.memory.accounting import compact_bytes, payload_bytes, retained_bytes, storage_bytes
    from tpool.memory.ownership import OwnershipPlan, needs_compaction, own, plan_ownership
    from tpool.memory.planner import PagePlan, PlanError, plan_pages
    from tpool.memory.report import MemoryReport, format_report, memory_report


def __getattr__(name):
    import importlib
    if name == "memory":  # the subpackage, an attribute of tpool as when it was imported eagerly
        return importlib.import_module("tpool.memory")
    module = _LAZY_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'tpool' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY_NAMES))


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
