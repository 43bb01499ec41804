"""Paged attention over a packed batch, read through a step's metadata.

Note: a step packs every lane's new tokens one after the other (lane ``i``'s
are rows ``qo_indptr[i]:qo_indptr[i+1]`` of ``q``), prefill lanes (many new
tokens) and decode lanes (one) mixed. A token at position ``p`` of its
sequence attends to the keys at positions ``0..p`` of its own lane (causal),
or only ``p - sliding_window + 1 .. p`` with a window (transformers'
``sliding_window``; FlashInfer's ``window_left = sliding_window - 1``).
Two options follow transformers' eager attention: ``softcap`` caps each
score as ``tanh(score / softcap) * softcap`` before the mask (Gemma2's
``attn_logit_softcapping``), and ``sinks`` adds one logit per query head to
the softmax's denominator, a key with no value (gpt-oss's ``s_aux``).
Query head ``h`` reads key/value head ``h // (Hq // Hkv)`` (grouped-query,
as transformers' ``repeat_kv``). Padding tokens (position -1: unused
capacity, padding lanes, failed lanes) get zeros.

:func:`paged_attention` is the reference in plain torch: fixed shapes from
static capacities (``max_pages`` per request), no host sync, so it runs on
any device and inside a CUDA graph. It gathers each token's lane pages, ``C`` tokens at a
time (``[C, max_pages * page_size, Hkv, D]`` float32 keys, then values, ``[C, Hq, max_pages *
page_size]`` scores), so the temporaries of a chunk, all of them together, take at most
``chunk_bytes`` (64 MiB by default), or two tokens' worth where one token alone needs more than
half of it: ``C = min(T, max(2, chunk_bytes // per_token))`` (:func:`chunk_tokens` counts
``per_token``, from static shapes only: the number of chunks is a Python int). Outside the chunks
the call holds ``[T, Hq, D]`` float32 twice (q and the output), its result in q's dtype, and int64
page ids and token indices: a few ``[B, max_pages]`` (three at once while it makes them, one kept
through the chunks) and ``[T]``. An oracle, not a fast path.
:class:`FlashInferAttention` is the CUDA path (FlashInfer's paged wrappers
fed the step's CSR as it is).
"""

import math
from dataclasses import dataclass

import torch

from tpool import _checks
from tpool.page_table import PageTable
from tpool.table_results import PagedKVCSR, StepResult

CHUNK_BYTES = 64 << 20  # bytes: the most a paged_attention chunk's temporaries take (two tokens' worth at least)


@dataclass(frozen=True)
class StepMetadata:
    """What attention needs from one step, all int32 on the table's device.

    slots : ``[T]``, slot of each packed token, -1 = padding (the step's ``slots``).
    positions : ``[T]``, position of each packed token in its sequence, -1 = padding.
    qo_indptr : ``[B+1]``, lane ``i``'s tokens are rows ``qo_indptr[i]:qo_indptr[i+1]``.
    kv_lens : ``[B]``, each lane's length after the step (a failed lane keeps its length; padding and a bad
        or repeated id 0); the CSR lists each lane's ``kv_lens`` tokens.
    csr : the step's FlashInfer CSR (``indptr`` ``[B+1]``, ``indices``, ``last_page_len`` ``[B]``).
    max_pages : int, static: pages per request at most (the table's ``max_pages_per_request``).
    page_size, num_pages : int, static: the pool's, which the K/V pages must have (checked by
        :func:`paged_attention` and ``PagedContext``: slots of one page size read through pages
        of another give wrong attention, no error).
    """

    slots: torch.Tensor
    positions: torch.Tensor
    qo_indptr: torch.Tensor
    kv_lens: torch.Tensor
    csr: PagedKVCSR
    max_pages: int
    page_size: int
    num_pages: int


def step_metadata(table, step) -> StepMetadata:
    """What attention reads from a step that just ran (``step = table.step(...)``).

    No device work: ``positions``, ``qo_indptr`` and ``kv_lens`` are written by the step
    itself, in the same pass as its slots (:class:`tpool.table_results.StepResult`); this
    packs them with the CSR, the table's static ``max_pages_per_request`` and its pool's
    ``page_size`` and ``num_pages``.

    Parameters
    ----------
    table : PageTable
    step : StepResult  the result of ``table.step(req_ids, num_tokens, ...)`` (or ``out.result``).

    Raises ``ValueError`` for a ``table`` that is not a ``PageTable`` or a ``step`` that is not a
    ``StepResult`` (a ``HostMirror.step``'s result holds one in ``.result``).

    Example
    -------
    >>> i32 = lambda v: torch.tensor(v, dtype=torch.int32)
    >>> pool = PagePool(8, page_size=4, device="cpu", backend="reference")
    >>> table = PageTable(pool, max_requests=4, max_pages_per_request=4)
    >>> _ = table.extend(i32([0]), i32([3]), max_tokens=3)     # request 0 holds 3 tokens
    >>> ids, ntok = i32([0, 1, -1]), i32([1, 2, 0])            # decode 1, prefill 2, a padding lane
    >>> m = step_metadata(table, table.step(ids, ntok, max_tokens=4))
    >>> m.positions.tolist(), m.qo_indptr.tolist(), m.kv_lens.tolist()   # slot 3: unused capacity
    ([3, 0, 1, -1], [0, 1, 3, 3], [4, 2, 0])
    """
    if not isinstance(table, PageTable):
        raise ValueError(f"table: expected a PageTable (the one that ran the step), got {type(table).__name__}")
    if not isinstance(step, StepResult):
        hint = ": pass its .result" if isinstance(getattr(step, "result", None), StepResult) else ""
        raise ValueError(f"step: expected a StepResult (what table.step returns), got {type(step).__name__}{hint}")
    return StepMetadata(step.slots, step.positions, step.qo_indptr, step.kv_lens, step.csr, table.max_pages,
                        table.page_size, table.pool.num_pages)


def check_meta(meta, name: str = "meta") -> None:
    """Raise ``ValueError`` unless ``meta`` is a :class:`StepMetadata` (a step's own result is not one)."""
    if not isinstance(meta, StepMetadata):
        hint = ": pass step_metadata(table, step)" if isinstance(meta, StepResult) else ""
        raise ValueError(f"{name}: expected a StepMetadata (step_metadata(table, step)), got "
                         f"{type(meta).__name__}{hint}")


def check_pages(k_cache: torch.Tensor, meta: StepMetadata, name: str = "k_cache") -> None:
    """Raise ``ValueError`` unless ``k_cache`` (``[num_pages, page_size, ...]``) has the table's pages.

    Python ints only (no host sync): cheap enough to run per layer per step.
    """
    if tuple(k_cache.shape[:2]) != (meta.num_pages, meta.page_size):
        raise ValueError(f"{name}: expected {meta.num_pages} pages of {meta.page_size} tokens (the table's pool: "
                         f"num_pages, page_size), got {k_cache.shape[0]} pages of {k_cache.shape[1]}")


def check_window(sliding_window) -> None:
    """``sliding_window`` is None or an int >= 1 (0 or less would mask every key: a row of zeros)."""
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window: expected None or an int >= 1 (the positions a token attends to, "
                         f"itself included), got {sliding_window!r}")


def _check(q, k_cache, v_cache, meta, softcap=None, sinks=None):
    check_meta(meta)
    if not (isinstance(q, torch.Tensor) and q.dim() == 3):
        raise ValueError(f"q: expected a [T, num_qo_heads, head_dim] tensor, got "
                         f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    if not (isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)):
        raise ValueError(f"k_cache, v_cache: expected two [num_pages, page_size, num_kv_heads, head_dim] tensors "
                         f"(one layer of a PagedKVCache: cache.k[layer], cache.v[layer]), got "
                         f"{type(k_cache).__name__} and {type(v_cache).__name__}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache, v_cache: expected two [num_pages, page_size, num_kv_heads, head_dim] tensors "
                         f"of one shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ValueError(f"k_cache: expected head_dim {d} (q's), got {k_cache.shape[3]}")
    if hq % hkv:
        raise ValueError(f"q: expected num_qo_heads a multiple of num_kv_heads {hkv}, got {hq}")
    if meta.positions.numel() != t:
        raise ValueError(f"q: expected {meta.positions.numel()} tokens (the step's max_tokens), got {t}")
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.device != meta.positions.device:
            raise ValueError(f"{name}: expected device {meta.positions.device} (the metadata's), got {x.device}")
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
        raise ValueError(f"softcap: expected a positive number or None, got {softcap!r}")
    if sinks is not None:
        is_t = isinstance(sinks, torch.Tensor)
        if not (is_t and tuple(sinks.shape) == (hq,) and sinks.device == q.device):
            got = f"{tuple(sinks.shape)} on {sinks.device}" if is_t else type(sinks).__name__
            raise ValueError(f"sinks: expected a ({hq},) tensor on {q.device} (one logit per query head), got {got}")


def chunk_tokens(t: int, span: int, num_kv_heads: int, head_dim: int, num_qo_heads: int,
                 chunk_bytes: int = CHUNK_BYTES, kv_itemsize: int = 4) -> int:
    """Tokens per chunk of :func:`paged_attention`: Python ints in, a Python int in ``[min(t, 2), t]`` out.

    ``C`` is the most tokens whose chunk fits ``chunk_bytes``, at most ``t`` and at least 2 (1 when
    ``t == 1``): torch's einsum takes another path for a single token, which rounds differently, so a
    floor of 2 keeps the result the same, bit for bit, for every ``chunk_bytes``. A chunk's bytes are
    the most its temporaries hold at once, per token (``span = max_pages * page_size`` keys, float32):
    ``keys = 4 * span * Hkv * D`` (as many for the values), ``scores = 4 * (span + 1) * Hq`` (one more
    column with attention sinks), ``out = 4 * Hq * D``; the largest of

    - ``2 * keys + scores + out``: in either einsum, the gathered keys (values) and the copy einsum
      makes of them in its own layout (it cannot batch ``[C, span, Hkv, D]`` over ``C`` and ``Hkv``
      without one), the scores (the weights ``p``) and einsum's output;
    - ``3 * scores``: the softcap's ``tanh(scores / softcap) * softcap``, the sinks' concatenation and
      its softmax;
    - ``keys * (4 + kv_itemsize) / 4``: a cache of ``kv_itemsize`` bytes an element gathered, and its
      float32 copy (3 keys' bytes for a float64 cache; within the first moment for 4 bytes or fewer);
    - plus ``24 * span``: the mask (bool), its float copy in ``p * mask`` and the lanes' page ids (int64,
      ``max_pages`` of them, at most ``span``), and the key index (int64, once per chunk).

    Example
    -------
    >>> chunk_tokens(512, 4096, 8, 128, 32)      # 32.6 MiB a token: 1 fits 64 MiB, 2 are taken (the floor)
    2
    >>> chunk_tokens(512, 4096, 8, 128, 32, chunk_bytes=1 << 30), chunk_tokens(1, 4096, 8, 128, 32, chunk_bytes=1)
    (31, 1)
    >>> chunk_tokens(3, 16, 2, 4, 4)             # 1,744 bytes a token: the whole step in one chunk
    3
    """
    keys = 4 * span * num_kv_heads * head_dim          # bytes, float32: one token's keys (or values)
    scores = 4 * (span + 1) * num_qo_heads             # one token's scores, a sink's column included
    out = 4 * num_qo_heads * head_dim                  # one token's output
    per_token = max(2 * keys + scores + out, 3 * scores, keys * (4 + kv_itemsize) // 4) + 24 * span
    return min(t, max(2, chunk_bytes // per_token))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: StepMetadata, *,
                    scale: float | None = None, sliding_window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None, chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """Reference paged attention (plain torch) for a packed batch of prefill and decode lanes.

    Parameters
    ----------
    q : torch.Tensor  shape ``[T, num_qo_heads, head_dim]``, on the cache's device
        The step's new tokens, packed as ``meta.qo_indptr`` says (T = the step's ``max_tokens``).
    k_cache, v_cache : torch.Tensor  shape ``[num_pages, page_size, num_kv_heads, head_dim]`` (NHD)
        One layer of a :class:`~tpool.serving.kv.PagedKVCache`, the new tokens already written.
    meta : StepMetadata
    scale : float, optional
        Softmax scale, default ``1 / sqrt(head_dim)``.
    sliding_window : int, optional
        Attend to the last ``sliding_window`` positions only (the token itself included).
    softcap : float, optional
        Cap the scaled scores: ``tanh(score / softcap) * softcap`` (Gemma2's ``attn_logit_softcapping``).
    sinks : torch.Tensor, optional  shape ``[num_qo_heads]``, on q's device
        One extra logit per query head in the softmax's denominator (gpt-oss's ``s_aux``).
    chunk_bytes : int, default ``CHUNK_BYTES`` (64 MiB)
        Memory bound: tokens go through in chunks of :func:`chunk_tokens` tokens (two at least),
        each chunk's temporaries (gathered keys and values, scores, masks) at most this many bytes
        together; the call also holds q and its output in float32 (``[T, Hq, D]`` each), and in
        q's dtype its result (under ``torch.no_grad()`` or inference mode, as serving runs: autograd
        keeps what it saves for a backward alive longer). The result does not depend on it (bit for
        bit on a CPU).

    Returns
    -------
    torch.Tensor  shape ``[T, num_qo_heads, head_dim]``, q's dtype; zeros for padding tokens.
    Computed in float32.
    """
    _check(q, k_cache, v_cache, meta, softcap, sinks)
    check_window(sliding_window)
    chunk_bytes = _checks.check_size(chunk_bytes, "chunk_bytes", 1)
    check_pages(k_cache, meta)
    t, hq, d = q.shape
    num_pages, ps, hkv, _ = k_cache.shape
    b, mp = meta.kv_lens.numel(), meta.max_pages
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if b == 0 or t == 0:
        return torch.zeros_like(q)
    dev = q.device
    # Each lane's pages, [B, max_pages]: indices[indptr[i] + j] for j < its page count.
    indptr, indices = meta.csr.indptr.long(), meta.csr.indices
    if not indices.numel():  # a CSR of capacity 0 (every lane exported empty): one padding entry to gather from
        indices = torch.full((1,), -1, dtype=indices.dtype, device=dev)
    j = torch.arange(mp, device=dev)
    at = (indptr[:-1, None] + j).clamp(max=indices.numel() - 1)
    mine = j < (indptr[1:] - indptr[:-1])[:, None]
    pages = torch.where(mine, indices[at].long(), 0).clamp(0, num_pages - 1)
    # Each token's lane, its position and its lane's length after the step: [T].
    u = torch.arange(t, device=dev)
    lane = torch.searchsorted(meta.qo_indptr[1:].long(), u, right=True).clamp(max=b - 1)
    pos, kv_len = meta.positions.long(), meta.kv_lens.long()[lane]
    qg = q.float().reshape(t, hkv, hq // hkv, d)
    sink = None if sinks is None else sinks.float().reshape(1, hkv, hq // hkv, 1)
    c = chunk_tokens(t, mp * ps, hkv, d, hq, chunk_bytes, k_cache.element_size())
    out = torch.empty(t, hkv, hq // hkv, d, dtype=torch.float32, device=dev)
    for s in range(0, t, c):   # Python ints: ceil(T / c) chunks of c tokens, the last one ending at T
        a = min(s, t - c)      # tokens a..s-1 were done by the chunk before: same values, kept from there
        out[s:a + c] = _attend_chunk(qg[a:a + c], pages[lane[a:a + c]], pos[a:a + c], kv_len[a:a + c], k_cache,
                                     v_cache, scale, sliding_window, softcap, sink)[s - a:]
    return out.reshape(t, hq, d).to(q.dtype)


def _attend_chunk(qg, pages, pos, kv_len, k_cache, v_cache, scale, sliding_window, softcap, sink):
    """Attention of ``C`` tokens (``qg`` ``[C, Hkv, G, D]`` float32) over their lanes' ``pages`` ``[C, max_pages]``.

    The keys are dropped before the values are gathered, the scores once ``p`` is made, and the values are
    masked in place: at most the bytes :func:`chunk_tokens` counts are alive at once.
    """
    c, hkv, g, d = qg.shape
    span = pages.shape[1] * k_cache.shape[1]
    pos = pos[:, None]
    key = torch.arange(span, device=qg.device)[None, :]
    allowed = (key <= pos) & (key < kv_len[:, None]) & (pos >= 0)
    if sliding_window is not None:
        allowed &= key > pos - sliding_window
    # The chunk's keys, [C, max_pages * page_size, Hkv, D] (the values below, once the keys are gone).
    k = k_cache[pages].reshape(c, span, hkv, d).float()
    scores = torch.einsum("thgd,tshd->thgs", qg, k)
    del k
    scores = scores * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed[:, None, None, :], torch.finfo(torch.float32).min)
    if sink is None:
        p = torch.softmax(scores, dim=-1)
    else:   # query head h = kv head h // g, group member h % g: the layout of qg
        p = torch.softmax(torch.cat([scores, sink.expand(c, -1, -1, -1)], dim=-1), dim=-1)[..., :-1]
    del scores
    p = p * allowed[:, None, None, :]   # a row with no key: all zeros
    # Keys a token may not see weigh 0, but 0 * inf or 0 * NaN is NaN: a value there (another request's
    # page 0, gathered as padding, or the stale tail of a reused page) must not reach the output. (In
    # place: the gather made v, and .float() of a float32 v is v.)
    v = v_cache[pages].reshape(c, span, hkv, d).float()
    v.masked_fill_(~allowed[:, :, None, None], 0.0)
    return torch.einsum("thgs,tshd->thgd", p, v)


class FlashInferAttention:
    """FlashInfer's paged attention on CUDA, fed a step's CSR as it is (NHD pages).

    ``plan`` once per step (outside a CUDA graph: FlashInfer's ``plan`` reads
    ``qo_indptr`` and ``indptr`` on the host, its own sync point), then ``run`` per
    layer; the object itself is a ``PagedContext`` ``attend`` (``PagedContext(cache,
    meta, attend=fi)``) that refuses a layer asking for what the plan does not do:
    another window or scale (a hybrid model's layers), a logit softcap, attention
    sinks. Mixed batches use ``BatchPrefillWithPagedKVCacheWrapper``; ``decode=True``
    (every lane exactly one token: ``qo_indptr == arange(B + 1)``) uses
    ``BatchDecodeWithPagedKVCacheWrapper``. Eager only: a plan holds host-side
    scheduling for one step, so ``run`` captured in a CUDA graph and replayed for
    later steps would use a stale plan (FlashInfer: "the plan method cannot be used
    in Cuda Graph"); use the reference attention, or FlashInfer's CUDA-graph
    wrappers re-planned before each replay, inside a graph. FlashInfer computes in
    fp16, bf16 or fp8, not float32.

    tpool's CSR gives an empty lane (padding, a failed admission) ``last_page_len =
    page_size``; FlashInfer derives a lane's KV length from its page count and last
    page length, so ``plan`` passes 0 for lanes without pages. Rows of tokens whose
    ``positions`` are -1 (a failed lane's), or whose lane has ``kv_lens`` 0 (a lane the
    step's CSR had no room for: ``capacity``), come back as zeros, as from the reference.

    Parameters
    ----------
    device : torch.device or str  a CUDA device.
    workspace_bytes : int  FlashInfer's float workspace (default 128 MiB).
    """

    @torch.inference_mode(False)   # (its workspace and FlashInfer's buffers, written by every plan, in any mode)
    def __init__(self, device, workspace_bytes: int = 128 << 20):
        import flashinfer  # an optional dependency: only this class needs it
        self.device = torch.device(device)
        self._workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._wrapper, self._rows, self._valid = None, 0, None
        self._meta, self._shapes, self._scale, self._window = None, None, None, None

    def plan(self, meta: StepMetadata, *, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             q_dtype: torch.dtype, kv_dtype: torch.dtype, page_size: int | None = None, scale: float | None = None,
             sliding_window: int | None = None, decode: bool = False) -> None:
        """Plan the step's attention (every layer of the step shares the plan). ``page_size`` defaults to
        the metadata's (the pool's); given, it must be that."""
        check_meta(meta)
        if page_size is None:
            page_size = meta.page_size
        elif page_size != meta.page_size:
            raise ValueError(f"page_size: expected {meta.page_size} (the table's pool) or None, got {page_size!r}")
        if q_dtype not in (torch.float16, torch.bfloat16) and "float8" not in str(q_dtype):
            raise ValueError(f"q_dtype: FlashInfer expects float16, bfloat16 or a float8 type, got {q_dtype}")
        check_window(sliding_window)
        window_left = -1 if sliding_window is None else sliding_window - 1
        csr = meta.csr
        common = dict(window_left=window_left, q_data_type=q_dtype, kv_data_type=kv_dtype, sm_scale=scale)
        b = meta.kv_lens.numel()
        # A lane with no pages has KV length 0, not page_size (FlashInfer reads the length from these two).
        last = torch.where(csr.indptr[1:] > csr.indptr[:-1], csr.last_page_len, 0)
        if decode and not torch.equal(meta.qo_indptr.cpu(), torch.arange(b + 1, dtype=torch.int32)):
            raise ValueError(f"decode=True: expected exactly one token per lane (qo_indptr == arange({b + 1})), got "
                             f"qo_indptr {meta.qo_indptr.tolist()}")
        if decode:
            self._decode.plan(csr.indptr, csr.indices, last, num_qo_heads, num_kv_heads, head_dim, page_size,
                              **common)
            self._wrapper, self._rows = self._decode, b
        else:
            self._prefill.plan(meta.qo_indptr, csr.indptr, csr.indices, last, num_qo_heads, num_kv_heads,
                               head_dim, page_size, causal=True, **common)
            self._wrapper, self._rows = self._prefill, int(meta.qo_indptr[-1])  # plan read it on the host too
        # [T]: rows of tokens of a granted lane with keys to attend to (kv_lens 0: a lane past the CSR's
        # capacity, exported empty, which the reference also answers with zeros). Each token's lane from
        # qo_indptr, on the device (plan is eager; run only applies the mask, as in a graph).
        valid = meta.positions >= 0
        if b:
            t = meta.positions.numel()
            u = torch.arange(t, dtype=meta.qo_indptr.dtype, device=meta.positions.device)
            lane = torch.searchsorted(meta.qo_indptr[1:], u, right=True).clamp(max=b - 1)
            valid &= meta.kv_lens.index_select(0, lane) > 0
        self._valid = valid
        self._meta, self._scale, self._window = meta, scale, sliding_window
        self._shapes = num_qo_heads, num_kv_heads, head_dim, page_size, q_dtype, kv_dtype

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Attention of ``q`` over one layer's pages, as planned; zeros past the step's tokens.

        Parameters
        ----------
        q : torch.Tensor  shape ``[T, num_qo_heads, head_dim]``, ``q_dtype``, on the plan's device
            T = the planned step's tokens (``meta.positions.numel()``, its ``max_tokens``).
        k_cache, v_cache : torch.Tensor  shape ``[num_pages, page_size, num_kv_heads, head_dim]``, ``kv_dtype``
            One layer of a :class:`~tpool.serving.kv.PagedKVCache` (NHD), sizes as given to ``plan``.

        Raises
        ------
        ValueError
            Where a shape, dtype or device differs from the plan's (before any FlashInfer call).
        """
        if self._wrapper is None:
            raise RuntimeError("FlashInferAttention.run: call plan() for this step first")
        self._check(q, k_cache, v_cache)
        out = torch.zeros_like(q)
        out[:self._rows] = self._wrapper.run(q[:self._rows], (k_cache, v_cache))
        return torch.where(self._valid[:, None, None], out, 0)  # a failed lane's tokens: zeros

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: StepMetadata, *,
                 scale: float | None = None, sliding_window: int | None = None, softcap: float | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``PagedContext``'s ``attend``: :meth:`run`, once the layer's options are the plan's.

        Raises ``ValueError`` for another step's ``meta``, a ``scale`` or ``sliding_window``
        other than the planned one, a ``softcap`` or ``sinks`` (not implemented here): a
        wrong result is never returned in their place.
        """
        if self._wrapper is None:
            raise RuntimeError("FlashInferAttention: call plan() for this step first")
        if meta is not self._meta:
            raise ValueError("meta: expected the step metadata given to plan, got another step's")
        for name, val in (("softcap", softcap), ("sinks", sinks)):
            if val is not None:
                raise ValueError(f"{name}: FlashInferAttention does not implement it; expected None, got "
                                 f"{tuple(val.shape) if isinstance(val, torch.Tensor) else val!r} "
                                 f"(use the reference paged_attention)")
        if sliding_window != self._window:
            raise ValueError(f"sliding_window: expected {self._window} (given to plan), got {sliding_window}")
        planned, given = (q.shape[-1] ** -0.5 if s is None else s for s in (self._scale, scale))
        if not math.isclose(planned, given, rel_tol=1e-6):
            raise ValueError(f"scale: expected {planned} (given to plan), got {given}")
        return self.run(q, k_cache, v_cache)

    def _check(self, q, k_cache, v_cache):
        """Shapes and dtypes against the plan's (FlashInfer would fail in a broadcast, or read wrongly)."""
        _check(q, k_cache, v_cache, self._meta)   # q's rows are the planned step's tokens
        hq, hkv, d, ps, q_dtype, kv_dtype = self._shapes
        if q.shape[1:] != (hq, d) or q.dtype != q_dtype:
            raise ValueError(f"q: expected [T, {hq}, {d}] {q_dtype} (num_qo_heads, head_dim, q_dtype given to "
                             f"plan), got {list(q.shape)} {q.dtype}")
        if k_cache.shape[1:] != (ps, hkv, d) or k_cache.dtype != kv_dtype or v_cache.dtype != kv_dtype:
            raise ValueError(f"k_cache, v_cache: expected [num_pages, {ps}, {hkv}, {d}] {kv_dtype} (page_size, "
                             f"num_kv_heads, head_dim, kv_dtype given to plan), got {list(k_cache.shape)} "
                             f"{k_cache.dtype} and {v_cache.dtype}")
        check_pages(k_cache, self._meta)
