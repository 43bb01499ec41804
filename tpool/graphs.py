"""CUDA-graph helpers: warm up without side effects, then capture a step.

Note: a captured graph replays the kernels it recorded on the tensors it
recorded. tpool never reallocates or rebinds state tensors, ``AllocOut``
buffers or a table's output buffers (one set per call shape), so a step
such as ``table.extend(ids, ones)`` + ``table.flashinfer_csr(ids)`` can be
captured once and replayed every decode step. Kernels must be compiled
before capture (Triton compiles on first launch, and specialises on
argument values such as sizes divisible by 16), so the step is run for real
first, on a side stream, and the state it changed is restored afterwards:
warm-up leaves no trace.
"""

import contextlib
import dataclasses

import torch

from tpool._checks import check_size
from tpool.state import clones_between_calls, copy_between_calls


def state_tensors(*owners) -> list:
    """Every state tensor of the given pools and tables, and of each one's pool and every live table on it.

    A pool's state and its tables' hold each other's page references (a row's pages are USED in
    the pool): restoring the pool without one of its tables would leave that table naming pages
    the pool holds FREE, which the next alloc hands out again. So a table brings its pool's state
    and a pool every live ``PageTable``'s on it.

    Parameters
    ----------
    *owners : PagePool or PageTable
        Objects with a ``state`` dataclass; a table (an object with ``pool``)
        adds its pool's state, and a pool the states of the tables made on it.

    Returns
    -------
    list of torch.Tensor
        Each tensor field of each state, once (by identity) in the order
        met (an owner's own state, its pool's, then its pool's tables' in the order they were made);
        the tensors themselves, not copies (their shapes and dtypes
        are the state's own, see :mod:`tpool.state`), on the owners' devices.

    Example
    -------
    >>> pool = PagePool(8, device="cpu", backend="reference")
    >>> len(state_tensors(pool, pool)) == len(state_tensors(pool))
    True
    """
    _check_owners(owners)
    out, seen = [], set()
    for owner in owners:
        pool = getattr(owner, "pool", owner)
        for st in [owner.state, pool.state, *(t.state for t in _tables(pool))]:
            for f in dataclasses.fields(st):
                t = getattr(st, f.name)
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
    return out


@contextlib.contextmanager
def preserved(*owners):
    """Run the block, then put every state tensor of ``owners`` back as it was (in place).

    The state is cloned on entry and copied back at exit, also when the block
    raises; the tensors keep their addresses, so bound kernels and captured
    graphs stay valid. Both copies are made under the pools' locks (on a CPU, as one
    call that keeps the GIL, as numba calls do), so another thread's call lands
    before or after each, never between two tensors.
    Outputs the block wrote elsewhere are not restored, nor are inputs a call
    writes: a :class:`~tpool.BoundStep` bound with ``release`` consumes its
    release ids (sets them to -1), so warm it up with padding there (-1) and
    write the ids of finished requests after the block. Refused (``RuntimeError``)
    in the thread of an open free group of one of the pools: the frees it would
    queue lie outside the state restored. A ``PageTable`` made on one of the pools
    inside the block is put back as it was made, empty (the restored pool holds
    its pages FREE).

    Parameters
    ----------
    *owners : PagePool or PageTable
        Whose state to restore (see :func:`state_tensors`: a table's pool and every table on
        that pool are restored with it).

    Yields
    ------
    None

    Example
    -------
    >>> pool = PagePool(8, device="cpu", backend="reference")
    >>> with preserved(pool):
    ...     r = pool.alloc(torch.tensor([3], dtype=torch.int32))
    >>> pool.available()
    8
    """
    _check_owners(owners)  # (an owner that is not a pool or table first)
    pools = list({id(p): p for p in (getattr(o, "pool", o) for o in owners)}.values())
    for pool in pools:
        group = pool._group
        if group is not None and group.owned_here():
            raise RuntimeError("preserved: a free group of this pool is open in this thread; the frees it would "
                               "queue are not in the state preserved restores (they would be applied at the "
                               "group's exit): exit the free group first")
    with _locked(owners):  # (the tables listed and their states cloned with no table made in between)
        tensors = state_tensors(*owners)
        known = [t for pool in pools for t in _tables(pool)]  # (held: no id of theirs is reused meanwhile)
        saved = clones_between_calls(tensors)
    try:
        yield
    finally:
        with _locked(owners):
            # A table made on one of the pools inside the block holds pages the restored pool has FREE
            # again: it goes back to how it was made, empty (in the same copy: no call lands in between).
            ids, pairs = set(map(id, known)), list(zip(tensors, saved))
            for table in (t for pool in pools for t in _tables(pool) if id(t) not in ids):
                pairs += zip(table.state.tensors().values(), table._empty_state().tensors().values())
            copy_between_calls(pairs)


def _tables(pool) -> list:
    """The live ``PageTable`` s made on ``pool``, oldest first (another revision's pool keeps none)."""
    with pool.state.lock:  # (a table made meanwhile on another thread adds itself under it)
        return list(getattr(pool, "_tables", {}).values())


def _check_owners(owners) -> None:
    """Refuse (``ValueError``) an owner that is not a PagePool or a PageTable: its state would not be read
    (an AttributeError deep inside, or a HostMirror whose host bookkeeping nothing restores). Read by what
    is used (a ``state`` dataclass, and a pool's ``_group``), not by class: ``benchmarks/ab_compare.py``
    passes the pools and tables of another revision's copy of tpool."""
    for i, owner in enumerate(owners):
        pool = getattr(owner, "pool", owner)
        if not all(dataclasses.is_dataclass(getattr(o, "state", None)) for o in (owner, pool)) or \
                not hasattr(pool, "_group"):
            raise ValueError(f"owners[{i}]: expected a PagePool or PageTable, got {type(owner).__name__}")


def _locked(owners) -> contextlib.ExitStack:
    """Hold the lock of every pool among ``owners`` (a table's: its pool's), each once, taken in one
    order whatever order the owners come in (``preserved(a, b)`` in one thread and ``preserved(b, a)``
    in another each held one lock and waited for the other)."""
    stack, locks = contextlib.ExitStack(), {}
    for owner in owners:
        lock = getattr(owner, "pool", owner).state.lock
        locks.setdefault(id(lock), lock)
    for _, lock in sorted(locks.items()):
        stack.enter_context(lock)
    return stack


def capture(step, *owners, warmup: int = 2) -> "torch.cuda.CUDAGraph":
    """Warm ``step`` up (state restored afterwards), then capture it into a CUDA graph.

    Parameters
    ----------
    step : callable
        The hot-path calls to capture, e.g. ``lambda: table.extend(ids, ones)``. Its
        inputs must be tensors that live as long as the graph (fill them before
        each replay).
    *owners : PagePool or PageTable
        Whose state the warm-up may change (restored before capture, with their pools and every
        table on those pools: :func:`state_tensors`). Tensors of the
        caller's that ``step`` writes (a buffer holding last step's pages, say) keep
        what the warm-up wrote: reset them before the first replay.
    warmup : int
        How many times ``step`` runs for real, on a side stream, before the
        capture (compiles the kernels; 0 only for a step that ran before).

    Returns
    -------
    torch.cuda.CUDAGraph
        The captured step (capturing it does not run it); call ``.replay()``
        once per step.

    Raises
    ------
    RuntimeError
        CUDA is not available.
    ValueError
        ``warmup`` is not a non-negative int, no owner is given, an owner is not on a CUDA device (a CPU pool's
        calls would run for real while the graph is captured, changing its state, and the graph
        would replay nothing), or the owners are on more than one device.
    """
    warmup = check_size(warmup, "warmup")  # (range(-1) or range(True) would warm up quietly or not at all)
    if not torch.cuda.is_available():
        raise RuntimeError("tpool.graphs.capture needs CUDA; on a CPU call the step directly")
    if not owners:  # (the warm-up would run for real, with nothing to restore)
        raise ValueError("owners: expected at least one PagePool or PageTable whose state the step changes (the "
                         "warm-up runs it for real and capture restores their state), got none")
    devices = []
    for i, o in enumerate(owners):
        dev = getattr(o, "device", None)
        if not isinstance(dev, torch.device) or dev.type != "cuda":
            raise ValueError(f"owners[{i}]: expected a PagePool or PageTable on a CUDA device, got "
                             f"{type(o).__name__}{'' if dev is None else f' on {dev}'}: a CUDA graph records CUDA "
                             "work only; a CPU pool's calls would run for real during the capture (changing its "
                             "state, which nothing restores) and the graph would replay nothing. Call the step "
                             "directly on a CPU pool")
        if dev not in devices:
            devices.append(dev)
    if len(devices) > 1:
        raise ValueError(f"owners: expected pools and tables on one CUDA device, got {', '.join(map(str, devices))}: "
                         "one graph is captured on one device's stream")
    device = devices[0]
    with torch.cuda.device(device):  # the owners' device, whatever device is current
        side = torch.cuda.Stream()
        with preserved(*owners):  # queues the snapshot's clones on the current stream
            side.wait_stream(torch.cuda.current_stream())  # so the warm-up starts after the clones, not before
            try:
                with torch.cuda.stream(side):
                    for _ in range(warmup):
                        step()
            finally:  # restore only after the warm-up ran, also when it raised
                torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):  # torch's default capture stream may be another device's
            step()
    for owner in owners:  # the graph writes these buffers on every replay: never drop them
        if hasattr(owner, "pin_shapes"):
            owner.pin_shapes()
    return graph
