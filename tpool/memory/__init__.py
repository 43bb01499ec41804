"""The memory façade: the host-side memory problems that come with pooling.

* :mod:`~tpool.memory.accounting`: payload vs storage vs compact bytes, and which storages
  a value keeps alive;
* :mod:`~tpool.memory.ownership`: ``own`` (view-to-owned compaction) and ``plan_ownership``,
  so a cached view does not keep its whole batch alive;
* :mod:`~tpool.memory.owned_cache`: a byte-budgeted LRU cache of owned tensors, with pins;
* :mod:`~tpool.memory.arena`: one preallocated buffer the cache can store entries in;
* :mod:`~tpool.memory.report`: the three ledgers (references, caching allocator, driver);
* :mod:`~tpool.memory.planner`: sizing a KV pool from a memory fraction.

None of it touches the allocator's kernels; the names are exported from ``tpool``.
"""
