"""transformers integration: an attention function that keeps a causal LM's K/V in tpool pages.

Note: importing this module registers :func:`paged_attention_forward` in
transformers' ``AttentionInterface`` under ``ATTN_IMPLEMENTATION``
(``"tpool_paged"``); no model code is patched. A model built with
``attn_implementation="tpool_paged"`` then sends every attention call here.
Run it on one packed batch per step: ``input_ids`` and ``position_ids`` of
shape ``[1, T]`` (the step's tokens in lane order, position -1 padding
clamped to 0), and the step's :class:`PagedContext` as the forward's keyword
``tpool_context``; transformers passes unknown keywords down to the
attention function. Each layer writes its new K/V at the step's slots
(``module.layer_idx`` picks the layer) and attends through the step's
metadata. No attention mask is built: no mask function is registered for
this name, so transformers' ``create_causal_mask`` returns None, and
causality, lanes and padding come from the metadata. Needs transformers 5
(``pip install "tpool[hf]"``); tested with transformers 5.24.0.
"""

from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import AttentionInterface

from tpool.serving.attention import StepMetadata, paged_attention
from tpool.serving.kv import PagedKVCache

ATTN_IMPLEMENTATION = "tpool_paged"  # the name to pass as attn_implementation
CONTEXT_KWARG = "tpool_context"      # the forward keyword that carries a PagedContext


@dataclass
class PagedContext:
    """What one step's forward needs: the K/V storage and the step's metadata.

    cache : PagedKVCache  the model's pages (one layer per decoder layer).
    meta : StepMetadata  the step's slots, positions, qo_indptr, kv_lens and CSR.
    attend : callable, optional
        ``attend(q, k_cache, v_cache, meta, scale=, sliding_window=)`` ->
        ``[T, Hq, D]``; default :func:`tpool.serving.attention.paged_attention`.
        A planned FlashInfer path (eager only, see
        :class:`~tpool.serving.attention.FlashInferAttention`):
        ``lambda q, k, v, meta, **_: fi.run(q, k, v)``.
    """

    cache: PagedKVCache
    meta: StepMetadata
    attend: Callable = field(default=paged_attention)


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask=None, scaling: float | None = None, dropout: float = 0.0,
                            sliding_window: int | None = None, **kwargs):
    """transformers attention function: write the layer's new K/V into pages, attend through them.

    Parameters
    ----------
    module : the attention module (its ``layer_idx`` selects the cache layer).
    query : torch.Tensor  shape ``[1, num_qo_heads, T, head_dim]`` (transformers' layout).
    key, value : torch.Tensor  shape ``[1, num_kv_heads, T, head_dim]``: this step's tokens only.
    attention_mask : ignored (None with this implementation); the metadata carries causality.
    scaling : float, optional  softmax scale (the module's).
    sliding_window : int, optional  passed by sliding-window models (Mistral, Qwen2...).
    tpool_context : PagedContext  (keyword) the step's context.

    Returns
    -------
    ``(out, None)``: out ``[1, T, num_qo_heads, head_dim]``, as transformers' eager attention.
    """
    ctx = kwargs.get(CONTEXT_KWARG)
    if not isinstance(ctx, PagedContext):
        raise ValueError(f"{ATTN_IMPLEMENTATION}: expected the forward keyword {CONTEXT_KWARG}=PagedContext(...), "
                         f"got {type(ctx).__name__}")
    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(f"{ATTN_IMPLEMENTATION}: expected one packed row, query [1, heads, T, head_dim], "
                         f"got {tuple(query.shape)}")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise ValueError(f"{ATTN_IMPLEMENTATION}: {type(module).__name__} has no layer_idx to pick its cache layer")
    if sliding_window is None:
        sliding_window = getattr(module, "sliding_window", None)
    cache, meta = ctx.cache, ctx.meta
    q = query[0].transpose(0, 1)                         # [T, Hq, D]
    k = key[0].transpose(0, 1).to(cache.dtype)           # [T, Hkv, D]
    v = value[0].transpose(0, 1).to(cache.dtype)
    cache.write(layer, meta.slots, k, v)
    out = ctx.attend(q, cache.k[layer], cache.v[layer], meta, scale=scaling, sliding_window=sliding_window)
    return out[None].to(query.dtype), None


def register() -> str:
    """Register :func:`paged_attention_forward` as ``ATTN_IMPLEMENTATION``; return the name (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION


register()


def forward_step(model, input_ids: torch.Tensor, ctx: PagedContext, **kwargs) -> torch.Tensor:
    """Run ``model`` on one packed step; return its logits ``[T, vocab]`` (fp32 or the model's dtype).

    input_ids : torch.Tensor  shape ``[T]``, int64, on the model's device: the step's tokens in
    lane order (anything, e.g. 0, at padding). Positions come from ``ctx.meta.positions``.
    """
    positions = ctx.meta.positions.long().clamp(min=0)[None]
    out = model(input_ids=input_ids[None], position_ids=positions, use_cache=False, **{CONTEXT_KWARG: ctx},
                **kwargs)
    return out.logits[0]
