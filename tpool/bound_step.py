"""BoundStep: ``PageTable.step`` bound to fixed inputs (:meth:`~tpool.page_table.PageTable.bind_step`).

A BoundStep is a ``functools.partial`` of one of this module's functions (``_bound_step``,
``_bound_release_step``, ``_fixed_step``) with every value they need among the partial's
arguments: a call is partial's C call of a plain function, not a Python method (see
:class:`BoundStep` for why).
"""

import functools

import torch

from tpool import _checks
from tpool.errors import StaleBinding


class BoundStep(functools.partial):
    """``PageTable.step`` bound to fixed input tensors (see :meth:`PageTable.bind_step`).

    Calling it checks that ``req_ids`` and ``num_tokens`` (and ``release``, when bound with
    release ids, which each call consumes) keep the memory and length they were bound
    with (``StaleBinding``, a ValueError, if not) and runs the step; it returns
    ``result``, the table-owned ``StepResult`` of this shape. The call is ``functools.partial``'s
    C call of a module function (``_bound_step``) with every value stored in the partial's
    arguments: on a CPU a decode step costs only a few microseconds, and a Python method
    with attribute lookups, or a closure's cells, would add to it visibly (more so with
    cold caches). It holds the table, so the state it points into stays alive with it.
    """

    def __new__(cls, table, req_ids, num_tokens, max_tokens, capacity, fixed=False, release=None,
                release_cache=False, out=None):
        held = (req_ids, num_tokens, release)
        release_cache = _checks.flag(release_cache, "release_cache")  # checked with or without release
        if fixed:  # numpy arrays: the step reads tensors of its own over their memory
            req_ids, num_tokens = torch.from_numpy(req_ids), torch.from_numpy(num_tokens)
            release = None if release is None else torch.from_numpy(release)
        if release is not None:  # checked before any buffer is made for the shape
            table._ids(release, "release")
        key = None  # the table's call shape whose buffers it writes (None: the caller's, out=)
        if out is None:
            b, entry = table._step_shape(req_ids, num_tokens, max_tokens, capacity)
            result, memo, written = entry[0], entry[2], entry[3]
            key = table._step_key(b, max_tokens, capacity)
            if not table._check_written:  # numba checks each unbound step in compiled code, a bound one only here
                table._not_written(entry, ("req_ids", req_ids), ("num_tokens", num_tokens))
        else:  # the caller's buffers (checked against the inputs there)
            b = table._into_out(req_ids, num_tokens, max_tokens, capacity, out)
            result, memo, written = out.result, out.memo, out._written
        if release is not None:
            # Each call writes release (sets it to -1): it may share memory with nothing the step reads or writes.
            _checks.check_not_written(release, "release", written | _checks.written_storages([req_ids, num_tokens]))
        run = table.ops.bind_step(result, memo, req_ids, num_tokens, b, release, release_cache)
        if key is not None and table._shapes._cuda:  # a call inside graph capture pins its shape, as step's does
            run = functools.partial(_pin_in_capture, table._shapes, key, result, run)
        if fixed:  # memory that cannot move or go away: nothing to check per call
            run.fixed = held, fixed  # (fixed: the storages of the tensors the arrays are over)
            self = super().__new__(cls, _fixed_step, run, result)
        else:
            step = functools.partial(_bound_step, req_ids.data_ptr, num_tokens.data_ptr, req_ids.numel,
                                     num_tokens.numel, req_ids.data_ptr(), num_tokens.data_ptr(), b,
                                     *_checks.storage_size(req_ids), *_checks.storage_size(num_tokens), run, result)
            if release is None:
                self = super().__new__(cls, step.func, *step.args)
            else:  # the release ids are bound as the other two are: checked for memory and length each call
                self = super().__new__(cls, _bound_release_step, release.data_ptr, release.numel, release.data_ptr(),
                                       release.numel(), *_checks.storage_size(release), step)
        self.table, self.result, (self.req_ids, self.num_tokens, self.release) = table, result, held
        # The CSR memo it writes through, held: the table reaches memos through a weak set (invalidate_csr,
        # check_invariants), so a memo whose StepOut the caller dropped, or whose shape the table let go
        # (max_shapes), would otherwise leave it while the step still grows that CSR.
        # _key: the table's call shape whose buffers it writes (None with out=). When the table drops that
        # shape (max_shapes), later steps of the shape get new buffers while this one keeps the old; a
        # scheduler keeping it hears of the drop through the table's ShapeBuffers.on_drop (HostMirror).
        self.out, self._memo, self._key = out, memo, key
        return self

    def __reduce_ex__(self, protocol):
        raise TypeError("a BoundStep cannot be copied or pickled: its call is bound to the addresses of its "
                        "inputs and of its table's state and buffers; bind again (table.bind_step)")

    def __setattr__(self, name, value):
        if name in ("req_ids", "num_tokens", "release") and name in self.__dict__:
            raise AttributeError(f"BoundStep.{name}: the step reads the memory it was bound to; fill it in place "
                                 f"(run.{name}[:] = ...) instead of assigning a new array or tensor")
        super().__setattr__(name, value)

    def __repr__(self):
        k = "" if self.release is None else f", release={len(self.release)}"
        return f"BoundStep(batch={self.result.ok.numel()}, max_tokens={self.result.slots.numel()}{k})"


def _bound_step(ids_at, ntok_at, ids_len, ntok_len, at_ids, at_ntok, b, ids_nb, nb_ids, ntok_nb, nb_ntok, run,
                result):
    """What a :class:`BoundStep` runs: check the inputs' memory, length and storage size, ``run()``, return ``result``.

    Every value arrives as an argument that ``functools.partial`` stores in one tuple,
    not in nine closure cells: a call reads one object instead of nine, which shows
    when the caches are cold (a forward pass between two steps; about 0.9 µs a step
    in ``benchmarks/cold_breakdown.py``). A caller passing arguments of its own gets a
    ``TypeError`` (too many positional arguments), as with a closure.
    """
    if (ids_at() != at_ids or ntok_at() != at_ntok or ids_len() != b or ntok_len() != b or ids_nb() != nb_ids
            or ntok_nb() != nb_ntok):
        raise StaleBinding("bind_step: req_ids or num_tokens no longer have the memory, the length or the storage "
                           "size they were bound with (reassigned or resized); fill them in place, or bind again")
    run()
    return result


def _bound_release_step(rel_at, rel_len, at_rel, k, rel_nb, nb_rel, step):
    """What a :class:`BoundStep` with bound release ids runs: check their memory and length, then
    ``step()`` (a ``_bound_step`` partial), which checks the other two and runs the call."""
    if rel_at() != at_rel or rel_len() != k or rel_nb() != nb_rel:
        raise StaleBinding("bind_step: release no longer has the memory, the length or the storage size it was "
                           "bound with (reassigned or resized); fill it in place, or bind again")
    return step()


def _pin_in_capture(shapes, key, result, run):
    """What a CUDA :class:`BoundStep` on the table's buffers runs after its checks: ``run()``, pinning call
    shape ``key`` first when the call is inside CUDA graph capture and the table still keeps this binding's
    buffers under it. The graph writes them on every replay, so the table must never drop them (an unbound
    ``step`` there pins its shape too); the caller may let go of the BoundStep once it holds the graph."""
    if torch.cuda.is_current_stream_capturing():
        entry = shapes.entries.get(key)
        if entry is not None and entry[0] is result:
            shapes.pin(key)
    run()


def _fixed_step(run, result):
    """What a :class:`BoundStep` on table-made CPU inputs runs: ``run()``, return ``result``.

    The inputs are numpy arrays over tensors whose storages the binding holds; numpy
    neither resizes nor frees memory an array does not own, so that memory cannot move
    or go away and there is nothing to check: no torch call at all, which saves ~6 µs a step
    when a forward pass has cooled the caches.
    """
    run()
    return result
