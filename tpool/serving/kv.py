"""Paged K/V storage sized from a pool: one K and one V tensor per layer, NHD.

Note: the layout is FlashInfer's default ``NHD``: layer ``l``'s keys are
``k[l]`` of shape ``[num_pages, page_size, num_kv_heads, head_dim]``, and the
token at slot ``s = page * page_size + offset`` (the slot a ``PageTable``
hands out) is ``k[l][page, offset]``, i.e. row ``s`` of
``k[l].view(-1, num_kv_heads, head_dim)``. Behind each layer's pages sits one
scratch page that no exported view covers. A write sends every padding slot
(-1) and every slot outside ``[0, num_pages * page_size)`` there, with a
``torch.where`` on the device: no host sync, no data-dependent shape, and no
page a request owns is ever touched by padding. (``cache.view(-1, H, D)[slots]
= k`` would instead write each padding token into the last slot of the last
page, since torch wraps -1.) ``copy_pages`` sends its -1 pairs to the scratch
page the same way. A slot or page outside the cache that is not the padding -1
is misuse: it goes to the scratch page too, and is counted on the device and
raised by the cache's ``check()`` (a sync point) as :class:`tpool.InvalidPage`.
"""

import threading

import torch

from tpool import _checks
from tpool.errors import InvalidPage
from tpool.pool import PagePool

# The cache's misuse counters: slots outside it given to write, page pairs outside it given to copy_pages,
# logits_to_keep indices outside a step given to forward_step (which counts them here: the step's one counter)
BAD_SLOTS, BAD_COPIES, BAD_KEEP = 0, 1, 2
MISUSE_NAMES = {BAD_SLOTS: "invalid_slot", BAD_COPIES: "invalid_copy_page", BAD_KEEP: "invalid_logits_row"}
# What each kind was, and what was done with it, for check's message
_MISUSE_TEXT = {
    BAD_SLOTS: "a slot outside [0, {slots}) (num_pages * page_size), not the padding -1, given to write: it was "
               "written to the scratch page, which no view shows",
    BAD_COPIES: "a page outside [0, {pages}), not -1, given to copy_pages: the pair was copied in the scratch page",
    BAD_KEEP: "a logits_to_keep index outside [0, T) (the step's max_tokens) given to forward_step: its row holds "
              "token 0's logits",
}

NHD = "NHD"   # the only layout: [num_pages, page_size, num_kv_heads, head_dim]
SCRATCH_PAGES = 1  # pages per layer behind the exported views; padding writes land there


def _vector(t, name, device, n=None):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype is not torch.int32:
        raise ValueError(f"{name}: expected dtype torch.int32, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if t.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(t.shape)}")
    if n is not None and t.numel() != n:
        raise ValueError(f"{name}: expected {_checks.entries(n)}, got {t.numel()}")


class PagedKVCache:
    """K and V pages for ``num_layers`` layers, addressed by the slots of a ``PageTable``.

    Parameters
    ----------
    num_layers, num_pages, page_size, num_kv_heads, head_dim : int
        Shape of the storage; ``num_pages`` and ``page_size`` must match the pool whose
        page ids index it (:meth:`from_pool` takes them from the pool).
    dtype : torch.dtype
        Element type of K and V: the model's (e.g. ``torch.bfloat16``), or a float8 type to store them cast.
    device : torch.device or str
        Where the pages live (the pool's device, for a table's slots to index them).

    Attributes
    ----------
    k, v : list of torch.Tensor
        Per layer, ``[num_pages, page_size, num_kv_heads, head_dim]`` views (NHD), each
        contiguous: pass ``(cache.k[l], cache.v[l])`` as FlashInfer's ``paged_kv_cache``.
    misuse : torch.Tensor
        int64 ``[3]`` on the device: slots (``invalid_slot``) and page pairs
        (``invalid_copy_page``) outside the cache, and ``forward_step``'s ``logits_to_keep``
        indices outside its step (``invalid_logits_row``), counted since the last :meth:`check`.

    Example
    -------
    >>> pool = PagePool(4, page_size=2, device="cpu", backend="reference")
    >>> cache = PagedKVCache.from_pool(pool, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)
    >>> slots = torch.tensor([3, -1, 0], dtype=torch.int32)       # token 1 is padding
    >>> x = torch.tensor([1.0, 2.0, 3.0]).view(3, 1, 1)
    >>> cache.write(0, slots, x, x)
    >>> cache.k[0].flatten().tolist()                           # padding wrote nothing
    [3.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    """

    layout = NHD

    @torch.inference_mode(False)   # (normal tensors, as the pool's: written in place outside the mode too)
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype, device):
        for name, val in (("num_layers", num_layers), ("num_pages", num_pages), ("page_size", page_size),
                          ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name}: expected a positive int, got {val!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            # fp8 (float8_e4m3fn, float8_e5m2) is floating; int8 or uint8 K/V would need scales nothing here applies
            raise ValueError(f"dtype: expected a floating torch.dtype (float8_e4m3fn and float8_e5m2 included), "
                             f"got {dtype!r}")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.device = _checks.resolve_device(device)
        shape = (num_layers, num_pages + SCRATCH_PAGES, page_size, num_kv_heads, head_dim)
        # One allocation each for K and V; zeros, so a test can see that nothing was written.
        self._k = torch.zeros(shape, dtype=dtype, device=self.device)
        self._v = torch.zeros(shape, dtype=dtype, device=self.device)
        self.k = [self._k[i, :num_pages] for i in range(num_layers)]
        self.v = [self._v[i, :num_pages] for i in range(num_layers)]
        rows = (num_layers, (num_pages + SCRATCH_PAGES) * page_size, num_kv_heads, head_dim)
        self._k_rows, self._v_rows = self._k.view(rows), self._v.view(rows)
        # Their bytes, which copy_pages copies: index_copy_ has no float8 kernel (CPU nor CUDA), bytes copy alike.
        self._raw = (self._k.view(torch.uint8), self._v.view(torch.uint8))
        self._num_slots = num_pages * page_size  # slots >= this (the scratch page) are never exported
        self._scratch = torch.tensor(self._num_slots, dtype=torch.int64, device=self.device)
        self._scratch_page = torch.tensor(num_pages, dtype=torch.int64, device=self.device)
        # Misuse counted on the device (BAD_SLOTS, BAD_COPIES, BAD_KEEP), raised by check(): fixed, so a graph
        # keeps it
        self.misuse = torch.zeros(len(MISUSE_NAMES), dtype=torch.int64, device=self.device)
        self._check_lock = threading.Lock()  # check's read and its subtraction as one (two threads raise once)

    @classmethod
    def from_pool(cls, pool, num_layers: int, num_kv_heads: int, head_dim: int, *, dtype: torch.dtype,
                  device=None) -> "PagedKVCache":
        """Storage for every page of ``pool`` (its ``num_pages``, ``page_size``; its device by default).

        ``dtype`` has no default: pass the model's (``model.dtype``). ``tpool.serving.hf`` refuses K/V
        of another dtype than the cache's (a silent cast would change the tokens), but for a float8
        cache, where storing K/V cast is the point. A ``pool`` that is not a ``PagePool`` (a
        ``PageTable``: pass ``table.pool``) is a ``ValueError``.
        """
        if not isinstance(pool, PagePool):
            hint = " (its pool is table.pool)" if isinstance(getattr(pool, "pool", None), PagePool) else ""
            raise ValueError(f"pool: expected a PagePool, got {type(pool).__name__}{hint}")
        return cls(num_layers, pool.num_pages, pool.page_size, num_kv_heads, head_dim, dtype=dtype,
                   device=pool.device if device is None else device)

    def __repr__(self):
        return (f"PagedKVCache(layers={self.num_layers}, pages={self.num_pages}, page_size={self.page_size}, "
                f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, "
                f"device={self.device}, layout={NHD})")

    def layer(self, i: int):
        """``(k, v)`` of layer ``i``, each ``[num_pages, page_size, num_kv_heads, head_dim]``."""
        return self.k[i], self.v[i]

    # ------------------------------------------------------------ hot path
    def _check_kv(self, name, t, n):
        want = (n, self.num_kv_heads, self.head_dim)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != want:
            raise ValueError(f"{name}: expected shape {want} ([T, num_kv_heads, head_dim]), got {tuple(t.shape)}")
        if t.dtype != self.dtype:
            raise ValueError(f"{name}: expected dtype {self.dtype} (the cache's), got {t.dtype}")
        if t.device != self.device:
            raise ValueError(f"{name}: expected device {self.device}, got {t.device}")

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the keys and values of ``T`` tokens of ``layer`` at their slots.

        Parameters
        ----------
        layer : int
            In ``[0, num_layers)``.
        slots : torch.Tensor  shape ``[T]``, int32, on the cache's device
            A step's ``slots``: -1 (padding, a failed lane, unused capacity) writes nothing
            the views show; nor does a slot outside ``[0, num_pages * page_size)``, which is
            counted (``invalid_slot``) and raised by :meth:`check`.
        k, v : torch.Tensor  shape ``[T, num_kv_heads, head_dim]``, the cache's dtype and device
            Any strides (a transposed model output is fine).

        Each call counts the bad slots it is given: the same bad slot written for two layers
        counts twice (``forward_step`` makes a step's destinations once, so it counts once).
        A call refused with ``ValueError`` (a bad ``layer``, ``k`` or ``v``) counts nothing.
        """
        _vector(slots, "slots", self.device)
        self._check_layer_kv(layer, slots.numel(), k, v)
        self._store(layer, self.destinations(slots), k, v)

    def destinations(self, slots: torch.Tensor) -> torch.Tensor:
        """The int64 rows a write of ``slots`` stores at: each slot, or the scratch page's first
        row for -1 and for a slot outside ``[0, num_pages * page_size)`` (those counted as
        ``invalid_slot``, raised by :meth:`check`). Device operations only: no host sync.
        ``forward_step`` makes them once per step for every layer's write."""
        _vector(slots, "slots", self.device)
        s = slots.long()
        bad = s.clamp(-1, self._num_slots - 1) != s   # neither a slot nor the padding -1
        self.misuse[BAD_SLOTS].add_(bad.sum())
        return torch.where(bad | (s < 0), self._scratch, s)

    def _write_rows(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """:meth:`write` at ``rows``, which must be what :meth:`destinations` made (int64 ``[T]``): their
        values are not checked again (a row of another making could land in a page the views show)."""
        if not isinstance(rows, torch.Tensor) or rows.dtype is not torch.int64 or rows.dim() != 1 \
                or rows.device != self.device:
            got = (f"{rows.dtype} shape {tuple(rows.shape)} on {rows.device}" if isinstance(rows, torch.Tensor)
                   else type(rows).__name__)
            raise ValueError(f"rows: expected a 1-D int64 tensor on {self.device} (destinations(slots)), got {got}")
        self._check_layer_kv(layer, rows.numel(), k, v)
        self._store(layer, rows, k, v)

    def _check_layer_kv(self, layer, n: int, k, v) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: expected an int in [0, {self.num_layers}), got {layer!r}")
        self._check_kv("k", k, n)
        self._check_kv("v", v, n)

    def _store(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self._k_rows[layer].index_put_((rows,), k)
        self._v_rows[layer].index_put_((rows,), v)

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy page ``src[i]`` into page ``dst[i]`` in every layer, K and V (copy-on-write).

        Parameters
        ----------
        src, dst : torch.Tensor  shape ``[B]``, int32, on the cache's device
            ``PageTable.fork``'s ``cow_src`` / ``cow_dst``. A pair with a -1 on either side is
            skipped; so is one with an id outside ``[0, num_pages)`` (and not -1), which is
            counted (``invalid_copy_page``) and raised by :meth:`check`.
        """
        _vector(src, "src", self.device)
        _vector(dst, "dst", self.device, src.numel())
        s, d = src.long(), dst.long()
        s_in, d_in = s.clamp(-1, self.num_pages - 1), d.clamp(-1, self.num_pages - 1)
        self.misuse[BAD_COPIES].add_(((s_in != s) | (d_in != d)).sum())
        ok = (s_in == s) & (d_in == d) & (s >= 0) & (d >= 0)
        s, d = torch.where(ok, s, self._scratch_page), torch.where(ok, d, self._scratch_page)
        for store in self._raw:   # index_select copies first, so src and dst may overlap
            store.index_copy_(1, d, store.index_select(1, s))

    # ---------------------------------------------------------- sync points
    def check(self) -> None:
        """Raise :class:`tpool.InvalidPage` for the misuse counted since the last check (a sync point).

        Its ``counts`` names each kind seen: ``invalid_slot`` (slots given to :meth:`write` or
        :meth:`destinations` outside ``[0, num_pages * page_size)``, not -1), ``invalid_copy_page``
        (:meth:`copy_pages` pairs with an id outside ``[0, num_pages)``, not -1), one per bad slot
        or pair in each call; nothing was written for them but in the scratch page. ``invalid_logits_row``
        (``forward_step``'s ``logits_to_keep`` indices outside ``[0, T)``): their rows of the logits
        returned are token 0's. What was read is taken
        off the counters, so a count added meanwhile is raised by the next check; two threads
        checking at once never both raise the same counts.
        """
        with self._check_lock:
            seen = self.misuse.tolist()
            if not any(seen):
                return
            self.misuse.sub_(torch.tensor(seen, dtype=torch.int64, device=self.device))  # (not the default device)
        counts = {MISUSE_NAMES[i]: n for i, n in enumerate(seen) if n}
        said = "; ".join(_MISUSE_TEXT[i].format(slots=self._num_slots, pages=self.num_pages)
                         for i, n in enumerate(seen) if n)
        raise InvalidPage(f"PagedKVCache: {', '.join(f'{k}: {n}' for k, n in counts.items())}. Each is {said}. "
                          f"Pass a step's slots and a fork's cow_src/cow_dst as the table made them, on a cache "
                          f"of the table's pool (PagedKVCache.from_pool), and logits_to_keep indices of the "
                          f"step's tokens.", counts)

    def memory_bytes(self) -> dict:
        """Bytes of the K/V storage (for ``tpool.memory_report(pools=[...])``).

        ``storage_bytes``: what the two allocations keep alive (``untyped_storage().nbytes()``),
        scratch pages included; ``page_bytes``: the exported pages alone; ``bytes_per_page``:
        one page of K and V over all layers.
        """
        storage = sum({id(t.untyped_storage()): t.untyped_storage().nbytes() for t in (self._k, self._v)}.values())
        per_page = 2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim * self._k.element_size()
        return {"name": repr(self), "storage_bytes": storage, "page_bytes": per_page * self.num_pages,
                "bytes_per_page": per_page}
