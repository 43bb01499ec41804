"""An address check for Triton's interpreter: a kernel's load or store outside its tensors raises.

Under ``TRITON_INTERPRET=1`` an out-of-bounds access reads or writes whatever host memory lies
there (or kills the process), and most do neither visibly: the interpreter checks nothing. The
fuzzers (``tests/fuzz_lockstep.py``, ``tests/fuzz_corrupt.py --backend triton``) call
:func:`install` before the first launch: from then on every load, store and atomic of a launch
must address, on each lane its mask leaves on, bytes inside one of the launch's tensor
arguments whose element size is the access's (an int32 load run into a neighbouring int64
argument is caught too; a wrapper such as ``triton.reinterpret`` takes any size); otherwise
:class:`OutOfBounds` is raised before the access (the interpreter wraps it in its
``InterpreterError``). A tensor's bytes run from its ``data_ptr`` over its strides
(``storage_offset`` included, the rest of its storage not: a kernel is given a view, not what
lies around it).

It patches private parts of the interpreter (``GridExecutor._init_args_hst``,
``InterpreterBuilder.create_masked_load`` and the like, triton 3.x); :func:`install` raises if
they are gone rather than check nothing. ``tests/test_fuzz.py`` shows it catching a planted
out-of-bounds load.
"""

import numpy as np

from tpool.kernels import _triton_shim

_spans = []        # (first byte, end, argument name, element size) of each tensor argument of the current launch
_launch = ["?"]    # the current kernel's name
_installed = [False]


class OutOfBounds(Exception):
    """A lane of a load, store or atomic addressed bytes outside every tensor of its launch."""


def _span(t) -> tuple:
    """The bytes ``t`` spans: from its first element to the end of its last, over its strides."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _add_spans(a, name: str) -> None:
    """The spans of argument ``a``: a tensor's, each tensor's of a tuple, the base tensor's of a wrapper
    (``triton.reinterpret``) or of a tensor descriptor."""
    if isinstance(a, tuple):
        for i, x in enumerate(a):
            _add_spans(x, f"{name}[{i}]")
    elif hasattr(a, "data_ptr") and hasattr(a, "stride") and hasattr(a, "numel"):
        _spans.append((*_span(a), name, a.element_size()))
    elif hasattr(a, "base") and a.base is not a:
        _add_spans(a.base, name)
        _spans[-1] = (*_spans[-1][:3], 0)  # (a wrapper may reinterpret its base: any element size)


def _check(kind: str, ptrs, mask, nbytes: int) -> None:
    addrs = np.asarray(ptrs.data).astype(np.uint64)
    on = np.ones(addrs.shape, bool) if mask is None else np.broadcast_to(np.asarray(mask.data).astype(bool),
                                                                         addrs.shape)
    a = addrs[on]
    if a.size == 0:
        return
    inside = np.zeros(a.shape, bool)
    # An access must lie in a tensor argument of its own element size: one that lands in a neighbouring
    # argument of another dtype (an index run past an int32 array into an int64 one) is caught too.
    for lo, hi, _, size in _spans:   # (no a + nbytes: an address near 2**64 would wrap to a small one)
        if size in (0, nbytes):
            inside |= (a >= np.uint64(lo)) & (a < np.uint64(hi)) & (np.uint64(hi) - a >= np.uint64(nbytes))
    if inside.all():
        return
    bad = [int(x) for x in a[~inside][:3]]
    near = [min(_spans, key=lambda s: min(abs(b - s[0]), abs(b - s[1])), default=(0, 0, "none", 0)) for b in bad]
    said = "; ".join(f"{b:#x} ({(b - s[0]) // nbytes:+d} elements from {s[2]}, which holds {(s[1] - s[0]) // nbytes}"
                     f"{'' if s[3] in (0, nbytes) else f' of {s[3]} bytes each'})" for b, s in zip(bad, near))
    raise OutOfBounds(f"{_launch[0]}: {kind} of {int((~inside).sum())} {nbytes}-byte lanes outside every tensor "
                      f"argument of that element size, e.g. {said}")


def install() -> None:
    """Check every access of every later interpreted launch (idempotent)."""
    if _installed[0]:
        return
    import triton.runtime.interpreter as interp
    executor, builder = getattr(interp, "GridExecutor", None), getattr(interp, "InterpreterBuilder", None)
    needed = ("_init_args_hst", "create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas")
    if executor is None or builder is None or not all(hasattr(executor if n.startswith("_") else builder, n)
                                                      for n in needed):
        raise RuntimeError("tests/triton_guard.py: this triton's interpreter lacks the parts the address check "
                           f"patches ({', '.join(needed)}); update the guard")
    init_args = executor._init_args_hst

    def _init_args_hst(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        _spans.clear()
        _launch[0] = getattr(self.fn, "__name__", "?")
        names = list(getattr(self, "arg_names", ()))
        given = [*zip(names, args_hst), *kwargs_hst.items()]
        for name, a in given:
            _add_spans(a, name)
        return args_hst, kwargs_hst

    load, store = builder.create_masked_load, builder.create_masked_store
    rmw, cas = builder.create_atomic_rmw, builder.create_atomic_cas

    def _itemsize(ptrs) -> int:
        return interp._get_np_dtype(ptrs.get_element_ty()).itemsize

    def create_masked_load(self, ptrs, mask, *args):
        _check("load", ptrs, mask, _itemsize(ptrs))
        return load(self, ptrs, mask, *args)

    def create_masked_store(self, ptrs, value, mask, *args):
        _check("store", ptrs, mask, np.asarray(value.data).dtype.itemsize)
        return store(self, ptrs, value, mask, *args)

    def create_atomic_rmw(self, op, ptr, val, mask, *args):
        _check("atomic", ptr, mask, np.asarray(val.data).dtype.itemsize)
        return rmw(self, op, ptr, val, mask, *args)

    def create_atomic_cas(self, ptr, cmp, val, *args):
        _check("atomic_cas", ptr, None, np.asarray(val.data).dtype.itemsize)
        return cas(self, ptr, cmp, val, *args)

    executor._init_args_hst = _init_args_hst
    builder.create_masked_load, builder.create_masked_store = create_masked_load, create_masked_store
    builder.create_atomic_rmw, builder.create_atomic_cas = create_atomic_rmw, create_atomic_cas
    _installed[0] = True


def setup(block=None) -> None:
    """What the fuzzers call before their first Triton launch: the address check when the interpreter
    runs (``TRITON_INTERPRET=1``; compiled kernels on a GPU are left alone), and ``block`` lanes per
    chunk if given (:func:`force_block`)."""
    if _triton_shim.interpreting():
        install()
    if block is not None:
        force_block(block)


def force_block(lanes: int) -> None:
    """Make every Triton kernel of tpool work in chunks of ``lanes`` lanes (a power of two), so small
    batches run the multi-chunk paths (running carries, chunk loops) that the default chunk of up to
    2,048 lanes never reaches in a fuzzer's sizes. Call before the first launch."""
    from tpool.kernels import _triton_util
    if lanes < 1 or lanes & (lanes - 1):
        raise ValueError(f"lanes: expected a power of two, got {lanes}")
    _triton_util.MIN_BLOCK = _triton_util.MAX_BLOCK = lanes
