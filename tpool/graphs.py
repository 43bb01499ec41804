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


def state_tensors(*owners) -> list:
    """Every state tensor of the given pools and tables (tables include their pool's)."""
    out, seen = [], set()
    for owner in owners:
        parts = [owner.state] + ([owner.pool.state] if hasattr(owner, "pool") else [])
        for st in parts:
            for f in dataclasses.fields(st):
                t = getattr(st, f.name)
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
    return out


@contextlib.contextmanager
def preserved(*owners):
    """Run the block, then put every state tensor of ``owners`` back as it was (in place)."""
    tensors = state_tensors(*owners)
    saved = [t.clone() for t in tensors]
    try:
        yield
    finally:
        for t, s in zip(tensors, saved):
            t.copy_(s)


def capture(step, *owners, warmup: int = 2) -> "torch.cuda.CUDAGraph":
    """Warm ``step`` up (state restored afterwards), then capture it into a CUDA graph.

    Parameters
    ----------
    step : callable
        The hot-path calls to capture, e.g. ``lambda: table.extend(ids, ones)``. Its
        inputs must be tensors that live as long as the graph (fill them before
        each replay).
    owners : PagePool or PageTable
        Whose state the warm-up may change (restored before capture).

    Returns
    -------
    torch.cuda.CUDAGraph; call ``.replay()`` once per step.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("tpool.graphs.capture needs CUDA; on a CPU call the step directly")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())      # the snapshot is taken first
    with preserved(*owners):
        with torch.cuda.stream(side):
            for _ in range(warmup):
                step()
        torch.cuda.current_stream().wait_stream(side)  # restore only after the warm-up ran
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for owner in owners:  # the graph writes these buffers on every replay: never drop them
        if hasattr(owner, "pin_shapes"):
            owner.pin_shapes()
    return graph
