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
causality, lanes and padding come from the metadata. A keyword that would
change the result and that is not implemented here (a mask, ``is_causal=False``,
dropout in training, a position bias, ...) is a ``ValueError`` naming it and the
model, never ignored. Needs transformers 5 (``pip install "tpool[hf]"``);
tested with transformers 5.24.0.
"""

from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import AttentionInterface

from tpool.serving.attention import StepMetadata, check_pages, paged_attention
from tpool.serving.kv import PagedKVCache

ATTN_IMPLEMENTATION = "tpool_paged"  # the name to pass as attn_implementation
CONTEXT_KWARG = "tpool_context"      # the forward keyword that carries a PagedContext
# Attention keywords some transformers models pass that change the result and that the paged
# attention does not implement: refused when not None (position biases, other sink layouts,
# sparse-attention indices, packed-sequence boundaries of another layout).
UNSUPPORTED_KWARGS = ("position_bias", "sinks", "indices", "block_indices", "cu_seq_lens_q", "cu_seq_lens_k")
_NOT_PASSED = object()  # sliding_window's default: "not passed" differs from "passed None"


@dataclass
class PagedContext:
    """What one step's forward needs: the K/V storage and the step's metadata.

    cache : PagedKVCache  the model's pages (one layer per decoder layer).
    meta : StepMetadata  the step's slots, positions, qo_indptr, kv_lens and CSR.
    attend : callable, optional
        ``attend(q, k_cache, v_cache, meta, scale=, sliding_window=)`` ->
        ``[T, Hq, D]``, also given ``softcap=`` and ``sinks=`` where the model passes
        them (an ``attend`` that takes ``**kwargs`` must refuse those it does not
        implement); default :func:`tpool.serving.attention.paged_attention`. A
        planned FlashInfer path (eager only): the planned
        :class:`~tpool.serving.attention.FlashInferAttention` itself, ``attend=fi``.

    Raises ``ValueError`` if the cache's pages are not the table's (``page_size``,
    ``num_pages`` of ``meta``): checked once per step here, per layer in the attention.
    """

    cache: PagedKVCache
    meta: StepMetadata
    attend: Callable = field(default=paged_attention)
    # the layers whose attention ran through this context (forward_step checks that every layer did)
    layers: set = field(default_factory=set, init=False, repr=False, compare=False)

    def __post_init__(self):
        check_pages(self.cache.k[0], self.meta, "cache")


def _refuse_unsupported(module, attention_mask, dropout, is_causal, kwargs):
    """Raise ``ValueError`` for a keyword that would change the result and is not implemented here."""
    def refuse(name, expected, got):
        raise ValueError(f"{ATTN_IMPLEMENTATION}: {name}: expected {expected}, got {got} from "
                         f"{type(module).__name__} (not implemented by the paged attention)")
    if attention_mask is not None:
        refuse("attention_mask", "None (the step's metadata gives causality, lanes and padding)",
               f"a mask of shape {tuple(getattr(attention_mask, 'shape', ()))}")
    if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
        refuse("attn_temperature_tuning", "False on a layer without rope (Llama4 scales q by the token's index "
               "in the packed row, not its position)", "True")
    if is_causal is not None and not is_causal:
        refuse("is_causal", "True or None (causal attention)", repr(is_causal))
    if dropout and getattr(module, "training", False):
        refuse("dropout", "0.0 in training (no attention dropout)", repr(dropout))
    for name in UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            refuse(name, "None", type(kwargs[name]).__name__)


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask=None, scaling: float | None = None, dropout: float = 0.0,
                            sliding_window=_NOT_PASSED, softcap: float | None = None,
                            s_aux: torch.Tensor | None = None, is_causal: bool | None = None, **kwargs):
    """transformers attention function: write the layer's new K/V into pages, attend through them.

    Parameters
    ----------
    module : the attention module (its ``layer_idx`` selects the cache layer).
    query : torch.Tensor  shape ``[1, num_qo_heads, T, head_dim]`` (transformers' layout).
    key, value : torch.Tensor  shape ``[1, num_kv_heads, T, head_dim]``: this step's tokens only.
    attention_mask : must be None (as it is with this implementation); the metadata carries causality.
    scaling : float, optional  softmax scale (the module's).
    dropout : float  must be 0 in training (transformers passes 0 in eval).
    sliding_window : int or None, optional
        As passed by the model, None included (Exaone4's full layers pass None, Mistral, Qwen2,
        Gemma2, gpt-oss pass theirs); if not passed at all, the module's ``sliding_window``
        attribute, which some models set only on their sliding layers (Qwen2-MoE).
    softcap : float, optional  the logit softcap (Gemma2's ``attn_logit_softcapping``).
    s_aux : torch.Tensor, optional  ``[num_qo_heads]`` attention sinks (gpt-oss).
    is_causal : bool, optional  must be True or None.
    tpool_context : PagedContext  (keyword) the step's context.

    Returns
    -------
    ``(out, None)``: out ``[1, T, num_qo_heads, head_dim]``, as transformers' eager attention.
    """
    ctx = kwargs.get(CONTEXT_KWARG)
    if ctx is None:
        raise ValueError(f"{ATTN_IMPLEMENTATION}: {type(module).__name__} got no {CONTEXT_KWARG}: pass "
                         f"{CONTEXT_KWARG}=PagedContext(...) to the model's forward (forward_step does); if it was "
                         f"passed, this model does not hand its forward keywords down to its attention")
    if not isinstance(ctx, PagedContext):
        raise ValueError(f"{ATTN_IMPLEMENTATION}: expected the forward keyword {CONTEXT_KWARG}=PagedContext(...), "
                         f"got {type(ctx).__name__}")
    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(f"{ATTN_IMPLEMENTATION}: expected one packed row, query [1, heads, T, head_dim], "
                         f"got {tuple(query.shape)}")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise ValueError(f"{ATTN_IMPLEMENTATION}: {type(module).__name__} has no layer_idx to pick its cache layer")
    _refuse_unsupported(module, attention_mask, dropout, is_causal, kwargs)
    if sliding_window is _NOT_PASSED:
        sliding_window = getattr(module, "sliding_window", None)
    extra = {name: val for name, val in (("softcap", softcap), ("sinks", s_aux)) if val is not None}
    cache, meta = ctx.cache, ctx.meta
    q = query[0].transpose(0, 1)                         # [T, Hq, D]
    k = key[0].transpose(0, 1).to(cache.dtype)           # [T, Hkv, D]
    v = value[0].transpose(0, 1).to(cache.dtype)
    cache.write(layer, meta.slots, k, v)
    ctx.layers.add(layer)
    out = ctx.attend(q, cache.k[layer], cache.v[layer], meta, scale=scaling, sliding_window=sliding_window,
                     **extra)
    return out[None].to(query.dtype), None


def register() -> str:
    """Register :func:`paged_attention_forward` as ``ATTN_IMPLEMENTATION``; return the name (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION


register()


_ATTENTION_LAYERS = ("full_attention", "sliding_attention")  # the layer types the paged attention serves


def check_model(model):
    """Raise ``ValueError`` unless every layer of ``model`` can keep its state in tpool pages; return
    its text config.

    That takes ``attn_implementation="tpool_paged"`` (another implementation takes the
    ``tpool_context`` keyword silently and attends over the packed row: lanes would see each
    other), and layers that are all softmax attention, full or sliding: a recurrent, linear
    attention or convolution layer (Qwen3-Next, LFM2, Mamba hybrids) keeps state the pages do
    not hold, and a chunked attention layer (Llama4) has its chunks only in a mask this
    implementation does not build (accepted when the chunk spans every position). A model
    whose attention does not dispatch through ``AttentionInterface`` at all is found by
    :func:`forward_step` after its forward (no layer ran here).
    """
    cfg = model.config.get_text_config(decoder=True)
    name = getattr(cfg, "model_type", "") or type(model).__name__
    impl = getattr(cfg, "_attn_implementation", None) or getattr(model.config, "_attn_implementation", None)
    if impl != ATTN_IMPLEMENTATION:
        raise ValueError(f"model: expected attn_implementation={ATTN_IMPLEMENTATION!r} (from_config/from_pretrained(..., "
                         f"attn_implementation={ATTN_IMPLEMENTATION!r}) or model.set_attn_implementation(...)), got "
                         f"{impl!r} from {name}")
    kinds = set(getattr(cfg, "layer_types", None) or ())
    chunk = getattr(cfg, "attention_chunk_size", None)
    if chunk is not None and chunk >= getattr(cfg, "max_position_embeddings", chunk + 1):
        kinds.discard("chunked_attention")  # one chunk over every position: full attention
    other = sorted(kinds - set(_ATTENTION_LAYERS)) + sorted(k for k in vars(cfg) if k.startswith("mamba_"))[:1]
    if other:
        raise ValueError(f"model: expected only {' and '.join(_ATTENTION_LAYERS)} layers (their K/V in pages), got "
                         f"{', '.join(other)} in {name}'s config, which the paged attention does not serve")
    return cfg


def forward_step(model, input_ids: torch.Tensor, ctx: PagedContext, **kwargs) -> torch.Tensor:
    """Run ``model`` on one packed step; return its logits ``[T, vocab]`` (fp32 or the model's dtype).

    input_ids : torch.Tensor  shape ``[T]``, int64, on the model's device: the step's tokens in
    lane order (anything, e.g. 0, at padding), T = the step's ``max_tokens``. Positions come
    from ``ctx.meta.positions``.

    Raises ``ValueError`` for a model :func:`check_model` refuses, before the forward, and
    after it when not every layer's attention ran through ``ctx`` (a model whose attention
    does not dispatch through ``AttentionInterface``, or that has other layers).
    """
    layers = check_model(model).num_hidden_layers
    t = ctx.meta.positions.numel()
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1 or input_ids.numel() != t:
        got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids: expected shape ({t},), the step's max_tokens (pad input_ids to it, e.g. "
                         f"with 0), got {got}")
    positions = ctx.meta.positions.long().clamp(min=0)[None]
    ctx.layers.clear()
    out = model(input_ids=input_ids[None], position_ids=positions, use_cache=False, **{CONTEXT_KWARG: ctx},
                **kwargs)
    if len(ctx.layers) != layers:
        raise ValueError(f"model: expected all {layers} layers to attend through {ATTN_IMPLEMENTATION}, got "
                         f"{len(ctx.layers)} ({type(model).__name__}: its attention does not dispatch through "
                         f"transformers' AttentionInterface, or some layers are not attention); the step's "
                         f"logits are not from its pages")
    return out.logits[0]
