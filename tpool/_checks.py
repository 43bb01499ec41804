"""Input checks from tensor metadata only (no host sync), shared by the façade."""

import bisect
import itertools
import numbers

import numpy as np
import torch

from tpool.kernels.layout import INT32_MAX, MAX_INDEXED

_Tensor, _int32 = torch.Tensor, torch.int32  # module globals: read on every hot-path call
# ``t.stride() == (1,)``: 1-D and contiguous in one metadata call. It misses only 1-D
# tensors of at most one element with another stride; those take the full check.
_UNIT_STRIDE = (1,)


def resolve_device(device, name: str = "device", *, backend: str = "auto") -> torch.device:
    """``device`` (a ``torch.device``, a string, a CUDA index, or None: the current CUDA device,
    else the CPU; the CPU for ``backend`` ``"numba"``, which runs on host memory only) as a
    ``torch.device`` with its index, or ``ValueError`` naming what was expected: a cpu or cuda
    device, CUDA available for a cuda one, an index this machine has."""
    if device is None:
        cuda = torch.cuda.is_available() and backend != "numba"
        return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) and not isinstance(device, bool) \
            else torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{name}: expected a cpu or cuda device, got {device!r} ({e})") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: expected a cpu or cuda device, got {dev} (tpool's kernels read and "
                         "write memory there only)")
    if dev.type == "cpu":
        return torch.device("cpu")  # "cpu:0" too: CPU tensors carry no index, and inputs are compared with it
    if not torch.cuda.is_available():
        raise ValueError(f"{name}: expected cpu, got {dev}: CUDA is not available here (torch "
                         f"{torch.__version__}, torch.cuda.is_available() is False)")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if not index < torch.cuda.device_count():
        raise ValueError(f"{name}: expected a CUDA index in [0, {torch.cuda.device_count()}), got {index}")
    return torch.device("cuda", index)


def input_len(t, device: torch.device, written: "Written") -> int:
    """:func:`i32_len`, then :func:`check_not_written` without raising: the length of a valid
    hot-path input that shares no memory with ``written``, else -1 (the caller then runs the
    full checks, which raise). Both on the one storage object :func:`_plain_i32` fetched."""
    got = _plain_i32(t, device)
    return got[0] if got is not None and not written.storage_hit(got[1]) else -1


def i32_len(t, device: torch.device, written=None) -> int:
    """Length of ``t`` if it is a plain 1-D contiguous int32 tensor on ``device``, else -1.

    The valid case of every hot-path input, in one condition; on -1 the caller runs
    :func:`check_vector`, which raises naming the expected and the actual value (or
    accepts the rare valid tensor this misses, see ``_UNIT_STRIDE``). ``written`` is
    ignored: this stands in for :func:`input_len` where the backend's compiled calls
    refuse overlapping inputs themselves. Plain also means memory whose bytes are the
    values (:func:`_unreadable`: no ZeroTensor, no negative view); the callers remember the
    tensor checked (:func:`seen`), so this runs once per new input tensor, not per call.
    """
    got = _plain_i32(t, device)
    return -1 if got is None else got[0]


def _plain_i32(t, device):
    """``(numel, untyped storage)`` of a plain 1-D contiguous int32 tensor on ``device``, else None."""
    if type(t) is _Tensor and t.dtype is _int32 and t.device == device and t.stride() == _UNIT_STRIDE:
        n, s = t.numel(), t.untyped_storage()
        if s.nbytes() >= 4 * (t.storage_offset() + n) and (t.data_ptr() or not n) and not t.is_neg():
            return n, s
    return None


def storage_size(t) -> tuple:
    """``(nbytes, n)``: the ``nbytes`` method of ``t``'s storage and what it returns now. A bound
    call or a cached check compares ``nbytes() == n`` each time (~50 ns): a storage resized in
    place (``untyped_storage().resize_``) is seen even when it comes back at the same address,
    which the address and length comparisons alone would miss."""
    nbytes = t.untyped_storage().nbytes
    return nbytes, nbytes()


def in_storage(t) -> bool:
    """``t``'s elements lie inside its storage. ``untyped_storage().resize_`` can shrink (or free,
    as FSDP-style code does) the storage under a tensor that keeps its shape and stride; a
    kernel reading ``numel`` entries from ``data_ptr()`` would then read past the allocation."""
    return t.untyped_storage().nbytes() >= t.element_size() * (t.storage_offset() + t.numel())


UNCHECKED = object()  # what a "last input checked" memo holds before any call: no argument (None included) is it
NOT_SEEN = (UNCHECKED, 0, -1, int, 0)  # a memo of no input (see seen)


def flag(v, name: str) -> bool:
    """A boolean option given by the caller (``cache=``, ``evict=``): a bool or a numpy bool, as
    bool. Anything else is a ``ValueError``: ``"no"`` or a tensor would be read by truthiness."""
    if type(v) is bool:
        return v
    if isinstance(v, np.bool_):
        return bool(v)
    raise ValueError(f"{name}: expected a bool, got {_describe(v)}")


def seen(t) -> tuple:
    """What a cached check remembers of the int32 input it checked: the tensor, its address, its
    length, and its storage's ``nbytes`` method and size (:func:`storage_size`)."""
    return (t, t.data_ptr(), t.numel(), *storage_size(t))


def still_seen(t, s) -> bool:
    """Whether ``t`` is the input remembered in ``s`` (:func:`seen`) as it was checked: the same
    object, address, length and storage size, so a kernel reading ``numel`` int32 from its
    address reads the bytes that were checked. A loop refilling its input in place skips the
    checks; ``t.data = t.view(torch.uint8)`` keeps the object and address but multiplies the
    length (a kernel would read past the storage) and is checked again, as is a storage resized
    in place, even back at the same address. A view of the same bytes and length
    (``t.view(torch.float32)``) is read as the int32 it was: no dtype compare on this path."""
    return t is s[0] and t.data_ptr() == s[1] and t.numel() == s[2] and s[3]() == s[4]


def _unreadable(t) -> str | None:
    """What makes the bytes at ``t.data_ptr()`` other than ``t``'s values, or None: a ZeroTensor
    (``torch._efficientzerotensor``: no memory, ``data_ptr()`` 0), any tensor with elements at
    address 0, or a negative or conjugate view (``torch._neg_view``, ``conj()``: the values are
    the bytes negated or conjugated). A kernel reading raw memory (numba) would read address 0
    or the bytes as they are, while torch ops (reference, triton's launch) read the values."""
    if t.numel() and not t.data_ptr():
        return "a ZeroTensor" if t._is_zerotensor() else "a tensor whose data_ptr() is 0"
    if t.is_neg():
        return "a negative view (torch._neg_view); pass .resolve_neg()"
    if t.is_conj():  # (complex only, which no check accepts)
        return "a conjugate view; pass .resolve_conj()"
    return None


def _describe(v) -> str:
    """``v`` for an error message without reading tensor data (a repr of a tensor would sync)."""
    return f"a {type(v).__name__}" if isinstance(v, torch.Tensor) or not isinstance(v, (int, float, str)) else repr(v)


def check_size(v, name: str, minimum: int = 0) -> int:
    """A size given by the caller: an integer (numpy integers too, never a bool or a tensor)
    of at least ``minimum``, as int."""
    if type(v) is int and v >= minimum:  # the common case at one type test (scheduler calls make several a step)
        return v
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < minimum:
        what = {0: "a non-negative int", 1: "a positive int"}.get(minimum, f"an int >= {minimum}")
        raise ValueError(f"{name}: expected {what}, got {_describe(v)}")
    return int(v)


def check_page_size(page_size: int) -> None:
    """Refuse a page of more than ``INT32_MAX`` tokens (``ValueError``): its offsets, lengths and slots are
    int32, so no ``PageTable`` or slot layout could index it (``PagePool`` and ``plan_pages`` both check it)."""
    if page_size > INT32_MAX:
        raise ValueError(f"page_size: expected at most {INT32_MAX} tokens (a page's offsets, lengths and slots are "
                         f"int32), got {page_size}")


def most_table_pages(page_size: int) -> int:
    """The most pages a pool under a ``PageTable`` may have: its slots, ``num_pages * page_size``, are int32,
    and a pool takes at most ``MAX_INDEXED`` pages."""
    return min(INT32_MAX // page_size, MAX_INDEXED)


def check_table_bounds(max_requests: int, pages: int, page_size: int, num_pages: int | None = None, *,
                       named: str = "max_pages_per_request", pages_is: str = "max_pages_per_request",
                       given: str = "") -> None:
    """The bounds of a ``PageTable`` of ``max_requests`` rows of ``pages`` pages of ``page_size`` tokens, over
    a pool of ``num_pages`` pages (None: not checked), as ``ValueError`` before anything is allocated.

    A row's tokens (``pages * page_size``) and the pool's slots (``num_pages * page_size``) are int32, and
    the table's entries (``max_requests * pages``) at most ``MAX_INDEXED`` (a kernel's chunk offsets are
    int32). ``PageTable`` and ``plan_pages`` both call this, each naming its own arguments: ``named`` is the
    argument to change where a row passes int32, ``pages_is`` how the caller writes ``pages`` (``plan_pages``:
    ``"ceil(max_len / page_size)"``), ``given`` what it adds to that error (``" (max_len=100)"``).
    """
    if pages * page_size > INT32_MAX:
        raise ValueError(f"{named}: lengths are int32, so {pages_is} * page_size must be at most {INT32_MAX}, "
                         f"got {pages} * {page_size}{given}")
    if num_pages is not None and num_pages > INT32_MAX // page_size:  # (num_pages * page_size > INT32_MAX)
        raise ValueError(f"pool: slots are int32, so num_pages * page_size must be at most {INT32_MAX}, "
                         f"got {num_pages} * {page_size}")
    if max_requests * pages > MAX_INDEXED:  # (a kernel's chunk offsets are int32)
        raise ValueError(f"max_requests * {pages_is}: expected at most {MAX_INDEXED} table entries, "
                         f"got {max_requests} * {pages}")


def storage_spans(tensors) -> dict:
    """``{start: end}``, the byte range of each distinct non-empty storage behind ``tensors``
    (the longest, where two storages start at the same address)."""
    spans = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes():
            lo = s.data_ptr()
            spans[lo] = max(spans.get(lo, 0), lo + s.nbytes())
    return spans


class Written:
    """The byte ranges of the storages a call writes, for :func:`check_not_written`.

    An input on one of those storages is found by its base address (one set lookup); an
    input on another storage over the same memory (``torch.from_numpy`` of a numpy view
    of a tpool tensor, say) by its range: with the ranges sorted by start, some range
    starting before the input's storage ends overlaps it exactly when the furthest end
    among them lies past the input's start (a bisection, then one lookup of a running
    maximum; the ranges may overlap, as a caller's own storages can). Immutable;
    ``a | b`` is the union.
    """

    __slots__ = ("bases", "_spans", "_starts", "_reach")

    def __init__(self, spans: dict):
        self._spans = spans  # owned: storage_spans makes a fresh one per call
        self.bases = frozenset(spans)
        self._starts = sorted(spans)
        self._reach = list(itertools.accumulate(map(spans.__getitem__, self._starts), max))

    def __or__(self, other: "Written") -> "Written":
        spans = dict(self._spans)
        for lo, hi in other._spans.items():
            spans[lo] = max(spans.get(lo, 0), hi)
        return Written(spans)

    def hit(self, t) -> bool:
        """Whether tensor ``t``'s storage overlaps one of the ranges. Metadata only, no sync."""
        return self.storage_hit(t.untyped_storage())

    def storage_hit(self, s) -> bool:
        """Whether storage ``s`` (a ``torch.UntypedStorage``) overlaps one of the ranges."""
        lo = s.data_ptr()
        if lo in self.bases:
            return True
        hi = lo + s.nbytes()
        i = bisect.bisect_left(self._starts, hi) - 1
        return hi > lo and i >= 0 and self._reach[i] > lo


def written_storages(tensors) -> Written:
    """The storages of ``tensors`` (buffers a call writes), for :func:`check_not_written`."""
    return Written(storage_spans(tensors))


def overlap_error(name: str) -> ValueError:
    """The error for input ``name`` sharing memory with what its call writes (every backend raises this)."""
    return ValueError(f"{name}: shares memory with a buffer this call writes (a pool or table state tensor, "
                      "or this call's own output buffer); pass a copy (.clone())")


def check_not_written(t, name: str, written: Written) -> None:
    """Raise if input ``t``'s memory overlaps a buffer the call writes (``written``, from
    :func:`written_storages`): a kernel would read an input it is overwriting, and the
    backends would disagree. Metadata only, no sync."""
    if written.hit(t):
        raise overlap_error(name)


def check_vector(t, name: str, dtype: torch.dtype, device: torch.device, max_len: int | None = None,
                 bound: str = "") -> int:
    """Check ``t`` is a contiguous 1-D ``dtype`` tensor on ``device``; return its length.

    Raises ``ValueError`` naming the expected and the actual value (and ``bound``, where
    ``max_len`` comes from, when given). The common (valid) case is one short condition:
    it runs on every hot-path call.
    """
    if (
        type(t) is torch.Tensor
        and t.dtype is dtype
        and t.device == device
        and t.dim() == 1
        and t.is_contiguous()
    ):
        n = t.numel()
        if (max_len is None or n <= max_len) and in_storage(t) and (t.data_ptr() or not n) and not t.is_neg():
            return n
        if max_len is not None and n > max_len:
            _raise_too_long(name, max_len, n, bound)
        if not in_storage(t):
            _raise_outside_storage(t, name)
        _raise_unreadable(t, name)
    if type(t) is not torch.Tensor:  # subclasses too: a FakeTensor or a wrapper has no memory to read
        if isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a plain torch.Tensor, got {type(t).__name__}, a subclass (a "
                             f"FakeTensor or a wrapper subclass has no memory a kernel can read; for a Parameter "
                             f"pass {name}.detach(), the same memory)")
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype is not dtype:
        how = "" if t.is_floating_point() or t.is_complex() or t.dtype is torch.bool else \
            f"; pass .to({dtype}) (a copy)"
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}{how}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if t.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got stride {t.stride()}; pass .contiguous()")
    n = t.numel()
    if max_len is not None and n > max_len:
        _raise_too_long(name, max_len, n, bound)
    if not in_storage(t):
        _raise_outside_storage(t, name)
    if _unreadable(t):
        _raise_unreadable(t, name)
    return n


def entries(n: int) -> str:
    """``n`` entries, for an error message: "1 entry", "3 entries"."""
    return f"{n} entry" if n == 1 else f"{n} entries"


def _raise_too_long(name: str, max_len: int, n: int, bound: str):
    raise ValueError(f"{name}: expected at most {entries(max_len)}{f' ({bound})' if bound else ''}, got {n}")


def _raise_unreadable(t, name: str):
    raise ValueError(f"{name}: expected a tensor whose memory holds its values, got {_unreadable(t)}")


def _raise_outside_storage(t, name: str):
    need = t.element_size() * (t.storage_offset() + t.numel())
    raise ValueError(f"{name}: expected a storage holding its {t.numel()} entries ({need} bytes from its start), "
                     f"got a storage of {t.untyped_storage().nbytes()} bytes (shrunk or freed under the tensor, "
                     f"e.g. by untyped_storage().resize_)")
