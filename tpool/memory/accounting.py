"""What bytes a tensor keeps alive, and how they are counted.

Note:
    A view keeps its WHOLE storage alive: keep one ``[100, 4096]`` item of a
    split ``[1000, 4096]`` bf16 batch and 7.81 MiB stays resident for a
    0.78 MiB payload. Three numbers per tensor, in bytes:

    * payload = ``numel * element_size``: what the values need;
    * storage = ``untyped_storage().nbytes()``: what stays alive;
    * compact = ``min(distinct, span)``: the fewest bytes that hold the
      values. distinct counts the elements of ``t`` with every stride-0
      dimension cut to size 1 (what an ``expand`` repeats); span is the range
      the strides reach, below distinct only for overlapping views such as
      ``unfold``.

    A storage that is not resizable (``untyped_storage().resizable()`` is
    False) wraps memory torch did not allocate: ``torch.from_numpy``,
    ``torch.frombuffer``, ``torch.from_dlpack``, ``torch.load(mmap=True)``.
    Its ``nbytes`` covers only the wrapped part while the owner's whole
    buffer stays alive (a row of a numpy array keeps the array), so its true
    size is unknown. ``torch.empty`` and ``share_memory_()`` storages are
    resizable. ``pin_memory()`` makes a pinned storage that is not resizable
    but is torch's own; it is counted at its ``nbytes``, though torch's
    pinned-memory allocator rounds each block up to a power of two (up to 2x
    behind it). Known gap (CUDA hosts): any pinned storage counts as torch's,
    so a ``from_numpy`` view into memory registered with
    ``cudaHostRegister`` is counted, and kept, at its own bytes.

    Storage identity is the storage object (``untyped_storage()._cdata``),
    not its address: two live storages can start at one address
    (``torch.from_numpy(a[:1])`` and ``torch.from_numpy(a)``). Bytes kept
    alive are counted by address, though: where two storage objects on one
    cpu or cuda device cover the same memory (``t`` and
    ``torch.from_numpy(t.numpy())``, ``torch.from_dlpack(t)``), their byte
    ranges are merged and the memory counts once. A tensor whose
    offset and strides reach past its storage (shrunk or freed under it by
    ``untyped_storage().resize_``) raises ``ValueError``. Tensors without
    ordinary storage (sparse, mkldnn, meta, nested, quantized, dispatch
    subclasses) raise ``TypeError``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, MappingView
from typing import Any

import torch

from tpool._checks import storage_spans
from tpool.memory.values import _LEAVES, iter_tensors, leaf_bytes  # (the walkers: re-exported here)

__all__ = ["payload_bytes", "storage_bytes", "compact_bytes", "storage_key", "retained_bytes", "iter_tensors",
           "leaf_bytes", "check_ownable"]

StorageKey = tuple[str, int, int]  # (device type, device index or -1, storage object id)


_QUANTIZED_DTYPES = frozenset((torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4))


def check_ownable(t: Any) -> torch.Tensor:
    """Return ``t`` if it is a dense strided tensor with real storage, else raise.

    Parameters
    ----------
    t : Any
        The object to check; a tensor passes if it is dense and strided, of
        any shape and dtype, on any device, and empty or inside its storage.

    Returns
    -------
    torch.Tensor
        ``t`` itself.

    Raises
    ------
    TypeError
        ``t`` is not a tensor, or its kind has no countable storage (nested,
        sparse or another non-strided layout, quantized or of a quantized dtype, meta, a subclass with
        ``__torch_dispatch__``, a functorch-wrapped tensor, a ZeroTensor).
    ValueError
        ``t`` is not empty and its offset and strides reach past the end of
        its storage (shrunk or freed under it by ``untyped_storage().resize_``,
        as FSDP-style code does): its bytes cannot be counted or copied.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    kind = None
    if t.is_nested:
        kind = f"nested tensor (layout {t.layout})"
    elif t.layout != torch.strided:
        kind = f"layout {t.layout}"
    elif t.is_quantized:
        kind = "quantized tensor"
    elif t.dtype in _QUANTIZED_DTYPES:  # raw bytes viewed as one (not is_quantized): torch's copy refuses it
        kind = f"tensor of quantized dtype {t.dtype} (a view of raw bytes: torch copies it only from floats)"
    elif t.is_meta:
        kind = "meta tensor (it holds no data)"
    elif type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        kind = f"tensor subclass {type(t).__name__} with __torch_dispatch__"
    elif torch._C._functorch.is_functorch_wrapped_tensor(t):
        kind = "functorch-wrapped tensor (vmap/grad)"
    elif t._is_zerotensor():
        kind = "zero tensor (torch's ZeroTensor: no storage behind its values)"
    if kind is not None:
        raise TypeError(f"expected a dense strided tensor with its own storage, got a {kind}")
    if t.numel():
        need = (t.storage_offset() + _span_elems(t)) * t.element_size()
        have = t.untyped_storage().nbytes()
        if need > have:
            raise ValueError(
                f"expected a storage of at least {need} bytes (what offset {t.storage_offset()} and strides "
                f"{t.stride()} of shape {list(t.shape)} reach), got a storage of {have} bytes (shrunk or freed "
                "under the tensor, e.g. by untyped_storage().resize_)")
    return t


def payload_bytes(t: torch.Tensor) -> int:
    """Bytes the values of ``t`` need: ``numel * element_size``.

    Parameters
    ----------
    t : torch.Tensor
        any shape and dtype, any device; dense strided.

    Returns
    -------
    int
        Bytes, whatever the strides: an ``expand`` counts every repeated
        element; 0 for an empty tensor.

    Raises
    ------
    TypeError
        ``t`` has no ordinary storage (see :func:`check_ownable`).
    ValueError
        ``t`` reaches past its storage (see :func:`check_ownable`).

    Example
    -------
    >>> batch = torch.zeros(1000, 4096, dtype=torch.bfloat16)
    >>> payload_bytes(batch.split(100)[3])      # 100 * 4096 * 2
    819200
    """
    t = check_ownable(t)
    return t.numel() * t.element_size()


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes of the backing storage that ``t`` keeps alive (``untyped_storage().nbytes()``).

    Parameters
    ----------
    t : torch.Tensor
        any shape and dtype, any device; dense strided.

    Returns
    -------
    int
        Bytes of the whole storage, however little of it ``t`` reads. For a
        storage over memory torch did not allocate (not resizable:
        ``torch.from_numpy`` of a numpy view, ``torch.frombuffer``,
        ``from_dlpack``) torch sees only the wrapped part, so this undercounts
        what stays alive: the owner's whole buffer.

    Raises
    ------
    TypeError
        ``t`` has no ordinary storage (see :func:`check_ownable`).
    ValueError
        ``t`` reaches past its storage (see :func:`check_ownable`).

    Example
    -------
    >>> batch = torch.zeros(1000, 4096, dtype=torch.bfloat16)
    >>> storage_bytes(batch.split(100)[3])      # the whole batch stays alive
    8192000
    """
    return check_ownable(t).untyped_storage().nbytes()


def _span_elems(t: torch.Tensor) -> int:
    """Elements from the first to the last one the strides can reach (0 if empty)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _distinct_elems(t: torch.Tensor) -> int:
    """Elements of ``t`` with every stride-0 dimension cut to size 1 (what an ``expand`` repeats), from the
    metadata alone: ``tpool.memory.ownership._distinct(t).numel()``."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        n *= 1 if stride == 0 and size > 1 else size
    return n


def compact_bytes(t: torch.Tensor) -> int:
    """Fewest bytes an owned copy of ``t`` needs: ``min(distinct, span)`` elements.

    distinct counts the elements of ``t`` with every stride-0 dimension cut
    to size 1: a copy of that part, expanded back to the shape, repeats the
    values for free (an ``expand`` of a column of a batch needs one column).
    span counts the elements from the first to the last one the strides
    reach; it is below distinct only for overlapping views (``unfold``), and
    a copy of the span keeps the strides.

    Parameters
    ----------
    t : torch.Tensor
        any shape and dtype, any device; dense strided.

    Returns
    -------
    int
        Bytes; 0 for an empty tensor.

    Raises
    ------
    TypeError
        ``t`` has no ordinary storage (see :func:`check_ownable`).
    ValueError
        ``t`` reaches past its storage (see :func:`check_ownable`).

    Example
    -------
    >>> compact_bytes(torch.ones(4096).expand(1000, 4096))   # one float32 row
    16384
    >>> batch = torch.zeros(1000, 4096)
    >>> compact_bytes(batch[:, 3:4].expand(-1, 4096))         # one column: 1000 floats
    4000
    >>> compact_bytes(torch.arange(16.0).unfold(0, 4, 2))     # 7 windows of 4 over 16 floats
    64
    """
    t = check_ownable(t)
    return min(_distinct_elems(t), _span_elems(t)) * t.element_size()


def storage_key(t: torch.Tensor) -> StorageKey:
    """Identity of ``t``'s storage: ``(device type, device index or -1, storage object id)``.

    The id is ``untyped_storage()._cdata``, the address of torch's storage
    object, not of its bytes: two live storages can start at one address
    with different sizes (``torch.from_numpy(a[:1])`` and
    ``torch.from_numpy(a)``), and a storage resized in place
    (``resize_``) moves its bytes but stays the same object.

    Parameters
    ----------
    t : torch.Tensor
        any shape and dtype, any device; dense strided.

    Returns
    -------
    tuple of (str, int, int)
        Equal for all views of one storage, before and after a ``resize_``
        of it; different for two live storages. A freed storage's id can be
        reused by a later one, so compare keys of live tensors only.

    Raises
    ------
    TypeError
        ``t`` has no ordinary storage (see :func:`check_ownable`).
    ValueError
        ``t`` reaches past its storage (see :func:`check_ownable`).
    """
    t = check_ownable(t)
    index = -1 if t.device.index is None else t.device.index
    return (t.device.type, index, t.untyped_storage()._cdata)


def _with_grads(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` and the gradients that stay alive with them: the ``.grad`` of each one and of the
    tensor it is a view of (``t._base``, which the view keeps alive), asked of autograd leaves and of
    non-leaves that ``retain_grad()`` (torch warns when another non-leaf's is read, and it holds none);
    a sparse gradient as the dense tensors it is made of."""
    tensors = list(tensors)
    grads = []
    for t in tensors:
        for u in (t,) if t._base is None else (t, t._base):
            if (u.is_leaf or u.retains_grad) and (g := u.grad) is not None:
                grads += _dense_parts(g)
    return tensors + grads


def _dense_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The dense tensors a sparse ``t`` is made of (its indices and values); ``[t]`` for any other."""
    if t.layout == torch.sparse_coo:
        return [t._indices(), t._values()]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return [t.ccol_indices(), t.row_indices(), t.values()]
    return [t]


def _alive_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors`` (one tensor per storage object), memory that two
    storage objects cover counted once: on a cpu or cuda device the byte ranges are merged (a
    storage's range is where its bytes are now); elsewhere ``data_ptr`` need not be an address,
    so each storage counts whole."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    total = 0
    for t in tensors:
        if t.device.type in ("cpu", "cuda"):
            by_device.setdefault(t.device, []).append(t)
        else:
            total += t.untyped_storage().nbytes()
    for same_device in by_device.values():
        spans = storage_spans(same_device)  # start -> end, the longest per start
        reach = 0  # the furthest end so far: what lies before it is counted
        for lo in sorted(spans):
            total += max(0, spans[lo] - max(lo, reach))
            reach = max(reach, spans[lo])
    return total


def retained_bytes(tensors: torch.Tensor | Iterable[Any]) -> int:
    """Bytes of storage kept alive by ``tensors``, each storage (and each byte of memory) counted once.

    Parameters
    ----------
    tensors : torch.Tensor or iterable
        A tensor, or a container of tensors and plain scalars as
        :func:`~tpool.memory.ownership.map_tensors` accepts (dicts,
        ``UserDict``s, lists, tuples, sets, dataclasses, nested); at the top
        level also a generator or another iterator, or a dict view
        (``d.values()``), read into a list first. Tensors may be on any
        devices.

    Returns
    -------
    int
        Sum over the distinct storages (by :func:`storage_key`) of their
        ``nbytes``, as :func:`~tpool.memory.ownership.plan_ownership` counts
        ``retained_bytes``; where two storage objects cover the same memory
        of a cpu or cuda device (``t`` and ``torch.from_numpy(t.numpy())``,
        ``torch.from_dlpack(t)``) that memory counts once. A storage over
        memory torch did not allocate counts what torch sees of it (see
        :func:`storage_bytes`). A ``.grad`` counts too, as it stays alive with
        the tensor (``own`` and ``OwnedCache`` leave it behind): a leaf's, a
        ``retain_grad()`` non-leaf's, that of the tensor a view is of (which
        the view keeps alive), and a sparse one as its indices and values.
        Not counted: what a non-leaf's autograd history keeps alive (the
        tensors its ``grad_fn`` saved for backward, often the model's
        weights, alive anyway) and what hook closures hold. ``own`` and
        ``OwnedCache`` detach a tensor that holds either, so what they keep is
        counted whole; count under ``torch.no_grad()`` (or detach) to keep
        activations out of the history.

    Raises
    ------
    TypeError
        ``tensors`` is a plain scalar (str, bytes, int, None, ...); or a leaf
        or container in it that :func:`~tpool.memory.ownership.map_tensors`
        refuses (a numpy array, a deque, a ``UserList``, an ``nn.Module``,
        a dict view inside a container, ...), as ``OwnedCache.put`` refuses
        it; or a tensor in it has no ordinary storage.
    ValueError
        A tensor in it reaches past its storage (see :func:`check_ownable`).

    Example
    -------
    >>> batch = torch.zeros(1000, 4096, dtype=torch.bfloat16)
    >>> retained_bytes(batch.split(100)[:2])    # two views, one storage
    8192000
    >>> retained_bytes([batch, torch.from_numpy(batch.view(torch.int16).numpy())])  # one memory, two storages
    8192000
    """
    if isinstance(tensors, (Iterator, MappingView)):
        tensors = list(tensors)  # a generator or another one-shot iterable, or d.values()
    if isinstance(tensors, _LEAVES):
        raise TypeError(f"expected a tensor or an iterable of tensors, got {type(tensors).__name__}")
    seen = {storage_key(t): t for t in _with_grads(iter_tensors(tensors))}
    return _alive_bytes(seen.values())
