"""A race check for Triton's interpreter: what the lanes of one program could do differently on a GPU.

Every tpool kernel is one program whose phases are separated by ``tl.debug_barrier()``
(``kernels/_triton_util.py``'s note). The interpreter runs a program's ops one after another over
whole blocks, so a lane always sees what another lane stored earlier in program order and never
what one stores later; on a GPU, warps (and the threads of one op, whose layouts may differ from op
to op) run out of step between two barriers. After :func:`install`, every interpreted launch records,
between two barriers, per address, the lanes (flat positions in the op's block; -1 for a 0-d op,
which every thread runs) that loaded it, stored it (and the value) or updated it atomically, and
raises :class:`PhaseHazard` (noted in :data:`found` too) at the first access that another lane's
access in the same phase makes order-dependent:

* RAW: a load of an address another lane stored;
* WAR: a store to an address another lane loaded;
* WAW: a store of another value than another lane stored there (equal values are benign);
* ATOM: a plain load or store of an address an atomic updated, or an atomic after a plain access.

A lane's own load and store of one address are left out: they are ordered by program order or, when
Triton lays the two ops out on different threads, by the data dependency when the store's value or
mask comes from the load; a store that does not depend on the load (``release``'s table clear) needs
a barrier this check cannot ask for. It patches private parts of the interpreter, as
``tests/triton_guard.py`` does (and composes with it).
"""

import collections

import numpy as np

_phase = {"reads": collections.defaultdict(set), "writes": collections.defaultdict(dict), "atoms": set()}
_launch = ["?"]
_installed = [False]
found = []  # every hazard's message, also kept here (a caller that catches exceptions still sees them)


class PhaseHazard(Exception):
    """Two lanes of one program accessed one address between two barriers in an order a GPU may change."""


def _reset() -> None:
    for v in _phase.values():
        v.clear()


def _lanes(ptrs, mask):
    """``(addresses, lanes)`` of the lanes the mask leaves on."""
    p = np.asarray(ptrs.data)
    m = np.broadcast_to(np.asarray(mask.data).astype(bool), p.shape) if mask is not None else np.ones(p.shape, bool)
    if p.ndim == 0:
        return ([int(p)], [-1]) if bool(m) else ([], [])
    on = np.flatnonzero(m.reshape(-1))
    return [int(a) for a in p.reshape(-1)[on]], [int(i) for i in on]


def _others(lanes, lane) -> bool:
    """Whether ``lanes`` hold a lane other than ``lane`` (a 0-d op's -1 is every thread)."""
    return any(x != lane or x == -1 for x in lanes)


def _hazard(kind: str, addr: int, lane: int, detail) -> None:
    found.append(f"{_launch[0]}: {kind} at {addr:#x}, lane {lane} after {detail} in the same phase "
                 "(no barrier between them)")
    raise PhaseHazard(found[-1])


def _on_load(ptrs, mask) -> None:
    for a, lane in zip(*_lanes(ptrs, mask)):
        w = _phase["writes"].get(a)
        if w and _others(w, lane):
            _hazard("RAW", a, lane, f"stores by lanes {sorted(w)[:4]}")
        if a in _phase["atoms"]:
            _hazard("ATOM", a, lane, "an atomic")
        _phase["reads"][a].add(lane)


def _on_store(ptrs, value, mask) -> None:
    addrs, lanes = _lanes(ptrs, mask)
    v = np.broadcast_to(np.asarray(value.data), np.asarray(ptrs.data).shape)
    m = np.broadcast_to(np.asarray(mask.data).astype(bool), v.shape)
    values = [v.item()] if v.ndim == 0 else [x.item() for x in v.reshape(-1)[np.flatnonzero(m.reshape(-1))]]
    for a, lane, val in zip(addrs, lanes, values):
        r = _phase["reads"].get(a)
        if r and _others(r, lane):
            _hazard("WAR", a, lane, f"loads by lanes {sorted(r)[:4]}")
        w = _phase["writes"][a]
        if any(x != lane and wv != val for x, wv in w.items()):
            _hazard("WAW", a, lane, f"stores of other values by lanes {sorted(w)[:4]}")
        if a in _phase["atoms"]:
            _hazard("ATOM", a, lane, "an atomic")
        w[lane] = val


def _on_atomic(ptr, mask) -> None:
    for a, lane in zip(*_lanes(ptr, mask)):
        if a in _phase["reads"] or a in _phase["writes"]:
            _hazard("ATOM", a, lane, "a plain load or store")
        _phase["atoms"].add(a)


def install() -> None:
    """Check every later interpreted launch (idempotent)."""
    if _installed[0]:
        return
    import triton.runtime.interpreter as interp
    executor, builder = interp.GridExecutor, interp.InterpreterBuilder
    needed = ("create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas", "create_barrier")
    if not all(hasattr(builder, n) for n in needed) or not hasattr(executor, "__call__"):
        raise RuntimeError(f"tests/triton_phases.py: this triton's interpreter lacks {', '.join(needed)}; update it")
    call, barrier = executor.__call__, builder.create_barrier
    load, store = builder.create_masked_load, builder.create_masked_store
    rmw, cas = builder.create_atomic_rmw, builder.create_atomic_cas

    def __call__(self, *args, **kwargs):
        _reset()
        _launch[0] = getattr(self.fn, "__name__", "?")
        try:
            return call(self, *args, **kwargs)
        finally:
            _reset()

    def create_barrier(self):
        _reset()
        return barrier(self)

    def create_masked_load(self, ptrs, mask, *args):
        _on_load(ptrs, mask)
        return load(self, ptrs, mask, *args)

    def create_masked_store(self, ptrs, value, mask, *args):
        _on_store(ptrs, value, mask)
        return store(self, ptrs, value, mask, *args)

    def create_atomic_rmw(self, op, ptr, val, mask, *args):
        _on_atomic(ptr, mask)
        return rmw(self, op, ptr, val, mask, *args)

    def create_atomic_cas(self, ptr, cmp, val, *args):
        _on_atomic(ptr, None)
        return cas(self, ptr, cmp, val, *args)

    executor.__call__, builder.create_barrier = __call__, create_barrier
    builder.create_masked_load, builder.create_masked_store = create_masked_load, create_masked_store
    builder.create_atomic_rmw, builder.create_atomic_cas = create_atomic_rmw, create_atomic_cas
    _installed[0] = True
