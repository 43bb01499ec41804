"""A preallocated byte arena: first-fit blocks inside one uint8 buffer.

Note:
    The arena allocates ONE ``uint8`` buffer of ``capacity_bytes`` at
    construction and never asks the caching allocator for more, so whatever
    lives in it cannot make ``memory_reserved`` grow. Blocks are carved
    first-fit (lowest offset that fits); every block starts at a multiple of
    ``alignment`` and its size is the request rounded up to ``alignment``, so
    a typed view of any dtype at the block start is aligned. The buffer's
    address is a multiple of ``alignment`` too (when the allocator's is not,
    the buffer is cut from ``alignment - 1`` bytes more), so block addresses
    are: ``alignment=4096`` gives page-aligned blocks for ``O_DIRECT`` reads. Freeing merges a
    block with free neighbours at once (coalescing), so two adjacent free
    ranges never exist. Allocated and free byte counts are kept as running
    sums (O(1)); ``fragmentation`` is ``1 - largest free block / free bytes``
    (0 when nothing is free or the free bytes are one block).

    A handle is a :class:`Block` ``(offset, size, serial)``; the serial makes a
    stale handle (already freed, or its offset reused since) fail loudly.
    The arena does not track tensor references: a view obtained from a block
    reads whatever is written there after the block is freed and reused.
"""

from __future__ import annotations

import bisect
import itertools
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from tpool._checks import check_size, resolve_device

__all__ = ["Arena", "Block"]

DEFAULT_ALIGNMENT = 256  # bytes; the start of every block is a multiple of this
_SERIALS = itertools.count(1)  # shared by all arenas, so a foreign handle never matches


@dataclass(frozen=True)
class Block:
    """An allocated range ``[offset, offset + size)`` of an arena's buffer (bytes)."""

    offset: int  # bytes from the buffer start; a multiple of the alignment (as is the buffer's address)
    size: int  # bytes; the request rounded up to the alignment
    serial: int  # unique per allocation, across all arenas


@torch.inference_mode(False)  # (a normal tensor whatever the caller's mode: blocks are written outside it too)
def _aligned_bytes(n: int, alignment: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor of ``n`` bytes whose address is a multiple of ``alignment`` (a power of two)."""
    buf = torch.empty(n, dtype=torch.uint8, device=device)
    if buf.data_ptr() % alignment == 0:
        return buf
    del buf
    raw = torch.empty(n + alignment - 1, dtype=torch.uint8, device=device)
    start = -raw.data_ptr() % alignment
    return raw[start:start + n]


class Arena:
    """One preallocated uint8 buffer with first-fit, coalescing block allocation.

    Parameters
    ----------
    capacity_bytes : int
        Size of the buffer, > 0, rounded up to a multiple of ``alignment``
        (blocks are whole multiples of it: a shorter tail could never be
        handed out, yet would count as free). ``capacity_bytes`` is the size
        after rounding.
    device : torch.device, str or int
        Where the buffer lives: a cpu or cuda device (an int is a CUDA index).
    alignment : int
        Power of two, in bytes; block starts and sizes are multiples of it.

    Raises
    ------
    ValueError
        ``capacity_bytes`` is not a positive int, ``alignment`` is not a
        positive power of two (a bool is neither), or ``device`` is not a cpu
        or cuda device this machine has (a ``meta`` device holds no bytes).

    Example
    -------
    >>> arena = Arena(4096, "cpu", alignment=256)
    >>> a = arena.alloc(100); b = arena.alloc(300)       # sizes 256 and 512
    >>> (a.offset, b.offset, arena.allocated_bytes)
    (0, 256, 768)
    >>> arena.free(a); arena.free_ranges()               # 1 - 3328 / 3584 fragmented
    [(0, 256), (768, 3328)]
    >>> round(arena.fragmentation, 4)
    0.0714

    Notes
    -----
    Blocks are reused in host order and the arena tracks no streams (unlike torch's caching
    allocator, whose ``record_stream`` does): on CUDA, a kernel still reading a freed block on
    another stream races with whatever the next owner of those bytes writes. Free a block only
    after the work that reads it is ordered before its reuse (one stream, or an event waited on).
    """

    def __init__(self, capacity_bytes: int, device: torch.device | str, *, alignment: int = DEFAULT_ALIGNMENT):
        capacity_bytes = check_size(capacity_bytes, "capacity_bytes", 1)
        alignment = check_size(alignment, "alignment", 1)
        if alignment & (alignment - 1):
            raise ValueError(f"alignment: expected a power of two, got {alignment}")
        capacity_bytes = -(-capacity_bytes // alignment) * alignment  # whole blocks only
        self.capacity_bytes = capacity_bytes
        self.alignment = alignment
        self.buffer = _aligned_bytes(capacity_bytes, alignment, resolve_device(device))
        self.device = self.buffer.device
        self._free_offsets: list[int] = [0]  # sorted starts of free ranges
        self._free_sizes: dict[int, int] = {0: capacity_bytes}  # start -> size
        self._blocks: dict[int, Block] = {}  # start -> live block
        self._allocated = 0

    # -- counts -------------------------------------------------------------
    @property
    def allocated_bytes(self) -> int:
        """Bytes in live blocks (sizes after rounding)."""
        return self._allocated

    @property
    def free_bytes(self) -> int:
        """Bytes not in any live block."""
        return self.capacity_bytes - self._allocated

    @property
    def largest_free_block(self) -> int:
        """Size of the largest free range, in bytes."""
        return max(self._free_sizes.values(), default=0)

    @property
    def fragmentation(self) -> float:
        """``1 - largest free block / free bytes``; 0.0 when nothing is free."""
        free = self.free_bytes
        return 0.0 if free == 0 else 1.0 - self.largest_free_block / free

    @property
    def num_blocks(self) -> int:
        """Number of live blocks."""
        return len(self._blocks)

    def memory_bytes(self) -> dict[str, int]:
        """The buffer and how much of it is in blocks (for :func:`tpool.memory_report`).

        Returns
        -------
        dict of str to int
            ``storage_bytes``: what the buffer keeps alive (its storage's
            ``nbytes``: ``capacity_bytes``, or up to ``alignment - 1`` more when
            the buffer was cut to align it); ``capacity_bytes``;
            ``allocated_bytes`` (bytes in live blocks); ``free_bytes``;
            ``blocks`` (live blocks). The buffer stays alive whatever is
            allocated: ``storage_bytes`` is what the arena costs.
        """
        return {"storage_bytes": self.buffer.untyped_storage().nbytes(), "capacity_bytes": self.capacity_bytes,
                "allocated_bytes": self._allocated, "free_bytes": self.free_bytes, "blocks": len(self._blocks)}

    def free_ranges(self) -> list[tuple[int, int]]:
        """Free ``(offset, size)`` ranges in offset order (for tests and reports).

        Returns
        -------
        list of (int, int)
            Byte offset and size of each free range; no two touch (freeing
            coalesces). Empty when the arena is full.
        """
        return [(o, self._free_sizes[o]) for o in self._free_offsets]

    def block_size(self, nbytes: int) -> int:
        """Bytes a request of ``nbytes`` occupies: rounded up to the alignment.

        Parameters
        ----------
        nbytes : int
            Requested bytes, > 0.

        Returns
        -------
        int
            The smallest multiple of ``alignment`` that is >= ``nbytes``.

        Raises
        ------
        ValueError
            ``nbytes`` is not a positive int.

        Example
        -------
        >>> Arena(4096, "cpu", alignment=256).block_size(300)
        512
        """
        nbytes = check_size(nbytes, "nbytes", 1)
        return -(-nbytes // self.alignment) * self.alignment

    # -- allocation ---------------------------------------------------------
    def alloc(self, nbytes: int) -> Block | None:
        """Take the lowest free range that holds ``nbytes``; ``None`` if none does.

        Parameters
        ----------
        nbytes : int
            Requested bytes, > 0; the block takes :meth:`block_size` bytes.

        Returns
        -------
        Block or None
            The new block (at the start of the first free range that fits,
            the rest of the range staying free), or None when no free range
            is large enough; nothing changes then.

        Raises
        ------
        ValueError
            ``nbytes`` is not a positive int.
        """
        size = self.block_size(nbytes)
        for offset in self._free_offsets:
            have = self._free_sizes[offset]
            if have >= size:
                break
        else:
            return None
        i = bisect.bisect_left(self._free_offsets, offset)
        del self._free_offsets[i], self._free_sizes[offset]
        if have > size:
            self._free_offsets.insert(i, offset + size)
            self._free_sizes[offset + size] = have - size
        block = Block(offset, size, next(_SERIALS))
        self._blocks[offset] = block
        self._allocated += size
        return block

    def can_alloc(self, nbytes: int, *, also_free: Iterable[Block] = ()) -> bool:
        """Whether ``alloc(nbytes)`` would succeed, optionally as if ``also_free`` were freed.

        Nothing is allocated or freed.

        Parameters
        ----------
        nbytes : int
            Requested bytes, > 0.
        also_free : iterable of Block
            Live blocks of this arena to count as free, merged with the free
            ranges they touch (e.g. the blocks an eviction would release).

        Returns
        -------
        bool
            True if some free range, after the merge, holds
            :meth:`block_size` of ``nbytes``.

        Raises
        ------
        ValueError
            ``nbytes`` is not a positive int, or a block in ``also_free`` is
            not live in this arena or is listed twice (freeing it twice
            would fail).
        TypeError
            An item of ``also_free`` is not a :class:`Block`.
        """
        size = self.block_size(nbytes)
        extra = sorted((self._check_live(b).offset, b.size) for b in also_free)
        twice = next((o for (o, _), (p, _) in zip(extra, extra[1:]) if o == p), None)
        if twice is not None:  # its range would restart the merge below: a false "no"
            raise ValueError(f"also_free: the block at offset {twice} is listed twice")
        if not extra:
            return self.largest_free_block >= size
        ranges = sorted(self.free_ranges() + extra)
        start, end = ranges[0][0], ranges[0][0]
        for o, s in ranges:  # merge touching ranges, track the longest
            start, end = (start, o + s) if o == end else (o, o + s)
            if end - start >= size:
                return True
        return False

    def free(self, block: Block) -> None:
        """Return ``block`` to the free ranges, merging it with free neighbours.

        Views of the block stay valid tensors and read whatever is written
        there next.

        Parameters
        ----------
        block : Block
            A live block of this arena.

        Raises
        ------
        TypeError
            ``block`` is not a :class:`Block`.
        ValueError
            ``block`` is not live here: freed already, stale (its offset
            reused since) or from another arena.
        """
        self._check_live(block)
        del self._blocks[block.offset]
        self._allocated -= block.size
        offset, size = block.offset, block.size
        i = bisect.bisect_left(self._free_offsets, offset)
        if i < len(self._free_offsets) and self._free_offsets[i] == offset + size:  # merge right
            size += self._free_sizes.pop(offset + size)
            del self._free_offsets[i]
        if i > 0:  # merge left
            left = self._free_offsets[i - 1]
            if left + self._free_sizes[left] == offset:
                self._free_sizes[left] += size
                return
        self._free_offsets.insert(i, offset)
        self._free_sizes[offset] = size

    def is_live(self, block: Block) -> bool:
        """Whether ``block`` is a live block of this arena.

        Parameters
        ----------
        block : Block
            Any object; a non-Block gives False.

        Returns
        -------
        bool
            False for a freed, stale or foreign handle.
        """
        return isinstance(block, Block) and self._blocks.get(block.offset) == block

    def _check_live(self, block: Block) -> Block:
        if not isinstance(block, Block):
            raise TypeError(f"expected an arena Block, got {type(block).__name__}")
        if not self.is_live(block):
            raise ValueError(f"{block} is not a live block of this arena (freed twice, stale, or foreign)")
        return block

    # -- views --------------------------------------------------------------
    def bytes_of(self, block: Block, nbytes: int | None = None, *, offset: int = 0) -> torch.Tensor:
        """The uint8 range ``[offset, offset + nbytes)`` of ``block`` (default: all of it).

        Parameters
        ----------
        block : Block
            A live block of this arena.
        nbytes : int, optional
            Bytes in the range, >= 0; default ``block.size - offset``.
        offset : int
            Bytes from the block start, >= 0.

        Returns
        -------
        torch.Tensor
            Shape ``[nbytes]``, uint8, on ``self.device``; a view of the buffer.

        Raises
        ------
        TypeError
            ``block`` is not a :class:`Block`.
        ValueError
            ``block`` is not live here, ``nbytes`` or ``offset`` is not an
            int >= 0, or the range does not fit in the block.
        """
        self._check_live(block)
        offset = check_size(offset, "offset", 0)
        if offset > block.size:
            raise ValueError(f"offset: expected at most {block.size} (the block's size), got {offset}")
        nbytes = block.size - offset if nbytes is None else check_size(nbytes, "nbytes", 0)
        if offset + nbytes > block.size:
            raise ValueError(f"range [{offset}, {offset + nbytes}) does not fit in a block of {block.size} bytes")
        start = block.offset + offset
        return self.buffer[start : start + nbytes]

    def view(self, block: Block, dtype: torch.dtype, shape: int | Sequence[int], *, offset: int = 0) -> torch.Tensor:
        """A contiguous tensor of ``dtype`` and ``shape`` at byte ``offset`` of ``block``.

        Parameters
        ----------
        block : Block
            A live block of this arena.
        dtype : torch.dtype
            Element type of the view.
        shape : int or sequence of int
            Shape of the view, sizes >= 0 (an int ``n`` is ``(n,)``, as in
            ``torch.empty(n)``); its bytes must fit in the block after
            ``offset``.
        offset : int
            Bytes from the block start, >= 0, a multiple of ``dtype``'s
            element size (block starts are aligned to ``alignment``).

        Returns
        -------
        torch.Tensor
            Shape ``shape``, dtype ``dtype``, on ``self.device``; a view of the
            buffer (no copy), valid while ``block`` is live.

        Raises
        ------
        TypeError
            ``block`` is not a :class:`Block`.
        ValueError
            ``block`` is not live here, ``dtype`` is not a ``torch.dtype``,
            ``shape`` is neither an int nor a sequence of ints, a size in
            ``shape`` or ``offset`` is not an int >= 0,
            ``block.offset + offset`` is not a multiple of ``dtype``'s element
            size, or the view does not fit in the block.

        Example
        -------
        >>> arena = Arena(1024, "cpu")
        >>> block = arena.alloc(64)
        >>> arena.view(block, torch.float32, (2, 8)).shape
        torch.Size([2, 8])
        >>> arena.view(block, torch.float32, 16).shape
        torch.Size([16])
        """
        self._check_live(block)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype: expected a torch.dtype, got {type(dtype).__name__}")
        if isinstance(shape, numbers.Integral):
            shape = (shape,)  # torch.empty(n) and Tensor.view(n) take an int too; check_size refuses a bool
        elif not isinstance(shape, Sequence) or isinstance(shape, (str, bytes)):
            raise ValueError(f"shape: expected an int or a sequence of ints, got {type(shape).__name__} {shape!r}")
        shape = tuple(check_size(n, f"shape[{i}]", 0) for i, n in enumerate(shape))
        offset = check_size(offset, "offset", 0)
        itemsize = dtype.itemsize
        if (block.offset + offset) % itemsize:
            raise ValueError(f"offset: the view would start at byte {block.offset + offset} of the arena (the "
                             f"block's start {block.offset} + offset {offset}), expected a multiple of {itemsize} "
                             f"({dtype})")
        numel = 1
        for n in shape:
            numel *= n
        return self.bytes_of(block, numel * itemsize, offset=offset).view(dtype).view(shape)

    def __repr__(self) -> str:
        return (
            f"Arena(capacity_bytes={self.capacity_bytes}, device={self.device}, alignment={self.alignment}, "
            f"allocated={self._allocated}, blocks={len(self._blocks)}, fragmentation={self.fragmentation:.3f})"
        )
