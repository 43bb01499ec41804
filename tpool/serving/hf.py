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
model, never ignored; so is a layer given no window whose config's ``sliding_window``
makes ``generate``'s cache keep only a window of it. A model a packed step would not serve exactly (other layer
types, a layer attending twice, ALiBi, no ``position_ids``, row-global rotary
frequencies: :mod:`tpool.serving.checks`) is refused by :func:`check_model`, which
:func:`forward_step` runs first. Needs transformers 5 (``pip install "transformers>=5"``, the ``hf`` extra);
tested with transformers 5.24.0 and 5.25.0.
"""

import copy
import inspect
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import AttentionInterface

from tpool.serving import checks
from tpool.serving.attention import StepMetadata, check_meta, check_pages, paged_attention
from tpool.serving.kv import BAD_KEEP, PagedKVCache

ATTN_IMPLEMENTATION = "tpool_paged"  # the name to pass as attn_implementation
CONTEXT_KWARG = "tpool_context"      # the forward keyword that carries a PagedContext
# Attention keywords some transformers models pass that change the result and that the paged
# attention does not implement: refused when not None (position biases, other sink layouts,
# sparse-attention indices, packed-sequence boundaries of another layout).
UNSUPPORTED_KWARGS = ("position_bias", "sinks", "indices", "block_indices", "cu_seq_lens_q", "cu_seq_lens_k")
# from_pretrained keywords that also say which config to read
_HUB_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "subfolder", "trust_remote_code")
_NOT_PASSED = object()  # sliding_window's default: "not passed" differs from "passed None"
# model -> the text config its layers, positions and decoder passed the checks with: they are fixed once a
# model is built (the signature inspection costs ~45 µs, paid once instead of every forward_step)
_CHECKED = weakref.WeakKeyDictionary()
# attention module -> the config its sliding_window None passed _refuse_window_in_cache_only with: a config's
# attribute reads cost ~2-8 µs, per layer per step when checked every call
_WINDOW_CHECKED = weakref.WeakKeyDictionary()
# model -> whether its forward names a logits_to_keep parameter (read from its signature once per model)
_KEEPS_LOGITS = weakref.WeakKeyDictionary()


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

    Raises ``ValueError`` for a ``cache`` that is not a ``PagedKVCache``, a ``meta`` that is
    not a ``StepMetadata`` (the step's own result is not: ``step_metadata(table, step)`` makes
    it), an ``attend`` that is not callable, and if the cache's pages are not the table's
    (``page_size``, ``num_pages`` of ``meta``): checked once per step here, per layer in the attention.
    One context serves one forward: a layer whose attention runs through it a second
    time (before :func:`forward_step` starts the next forward) is a ``ValueError``, raised
    before that call writes anything: its K/V would overwrite the first call's.
    """

    cache: PagedKVCache
    meta: StepMetadata
    attend: Callable = field(default=paged_attention)
    # the step's write destinations (PagedKVCache.destinations of meta.slots), made once per forward by
    # forward_step and dropped after it; None: each layer's write makes its own
    _rows: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    # the layers whose attention ran through this context in this forward (forward_step clears it first,
    # and checks that every layer ran; a layer that runs twice is refused)
    layers: set = field(default_factory=set, init=False, repr=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.cache, PagedKVCache):
            raise ValueError(f"cache: expected a PagedKVCache (PagedKVCache.from_pool(pool, ...)), got "
                             f"{type(self.cache).__name__}")
        check_meta(self.meta)
        if not callable(self.attend):
            raise ValueError(f"attend: expected a callable (q, k_cache, v_cache, meta, scale=, sliding_window=) such "
                             f"as paged_attention, got {type(self.attend).__name__}")
        check_pages(self.cache.k[0], self.meta, "cache")


# Attention modules whose model applies its config's sliding_window through its mask alone (every
# layer), passing no window to the attention and keeping no attribute: PhiMoE. Masks are not built
# here, so the window is taken from the config.
WINDOW_IN_MASK_ONLY = frozenset({"PhimoeAttention"})


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
    if not (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        # (None: the module's attribute, as transformers' sdpa reads it: Gemma 3 with
        # use_bidirectional_attention, BERT-family layers with is_decoder=False set it False)
        refuse("is_causal", "True (causal attention)", f"{is_causal!r}" if is_causal is not None else
               "False (the module's is_causal attribute: bidirectional attention)")
    if dropout and getattr(module, "training", False):
        refuse("dropout", "0.0 in training (no attention dropout)", repr(dropout))
    for name in UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            refuse(name, "None", type(kwargs[name]).__name__)


def _cache_window(module, layer):
    """The window ``generate``'s ``DynamicCache`` keeps for ``layer`` of ``module``'s config (transformers'
    ``get_layer_types_and_kwargs``): its ``sliding_window`` on a ``sliding_attention`` layer of its
    ``layer_types``, or on every layer of a config without ``layer_types``; None where it keeps all."""
    cfg = getattr(module, "config", None)
    try:
        window, types = getattr(cfg, "sliding_window", None), getattr(cfg, "layer_types", None)
    except Exception:   # (a per-layer config that names no one window: nothing to compare)
        return None
    if not isinstance(window, int) or isinstance(window, bool):
        return None
    if types is None:
        return window
    return window if layer < len(types) and types[layer] == "sliding_attention" else None


def _refuse_window_in_cache_only(module, layer):
    """Raise ``ValueError`` where the attention gets no window but ``generate``'s cache keeps one: its decode
    steps then attend over the window alone, its prefill (and a packed step) over every position."""
    window = _cache_window(module, layer)
    if window is not None:
        raise ValueError(f"{ATTN_IMPLEMENTATION}: sliding_window: expected the window generate applies, got None "
                         f"from {type(module).__name__}, layer {layer}: its config's sliding_window={window} makes "
                         f"generate's cache keep only the last tokens of this layer while its attention and mask "
                         f"apply no window, so no window gives generate's tokens; set the config's sliding_window "
                         f"to None for full attention")


def _kv_shape_message(module, layer, key, cache) -> str:
    """Why the K/V ``module`` attends with do not fit ``cache``: the cache was built for another shape than
    the config names, or the attention does not use the K/V heads its config names."""
    from tpool.serving.engine import kv_shape  # (engine imports this module)
    attends = (key.shape[1], key.shape[3])
    head = (f"{ATTN_IMPLEMENTATION}: cache: expected K/V of {attends[0]} heads of head_dim {attends[1]} (what "
            f"{type(module).__name__}, layer {layer}, attends with), the cache holds {cache.num_kv_heads} heads of "
            f"{cache.head_dim}")
    try:
        named = kv_shape(module.config)
    except Exception:  # (only wording the refusal: no error of the config's may replace it)
        named = None
    if named is None:
        return (f"{head}: build the PagedKVCache for {attends[0]} K/V heads of head_dim {attends[1]} "
                f"(engine.kv_shape(model.config) gives the shape a config names)")
    if tuple(named[1:]) == attends:
        return (f"{head}: build the PagedKVCache with the shape engine.kv_shape(model.config) gives, "
                f"{tuple(named)} (num_layers, num_kv_heads, head_dim)")
    return (f"{head} (engine.kv_shape reads num_key_value_heads and head_dim from the config): this model's "
            f"attention does not use the K/V heads its config names (JetMoE repeats them per expert; a head_dim "
            f"key the model ignores, as GPT-2's, names a shape it never attends with): the Engine, which sizes "
            f"the cache by kv_shape, does not serve it")


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
        attribute, which some models set only on their sliding layers (Qwen2-MoE), else for
        PhiMoE (:data:`WINDOW_IN_MASK_ONLY`) its config's.
    softcap : float, optional  the logit softcap (Gemma2's ``attn_logit_softcapping``).
    s_aux : torch.Tensor, optional  ``[num_qo_heads]`` attention sinks (gpt-oss).
    is_causal : bool, optional  must be True, or None with the module's ``is_causal`` not False.
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
        if sliding_window is None and type(module).__name__ in WINDOW_IN_MASK_ONLY:
            sliding_window = getattr(module.config, "sliding_window", None)
    if sliding_window is None and _WINDOW_CHECKED.get(module, _NOT_PASSED) is not getattr(module, "config", None):
        _refuse_window_in_cache_only(module, layer)
        _WINDOW_CHECKED[module] = getattr(module, "config", None)
    extra = {name: val for name, val in (("softcap", softcap), ("sinks", s_aux)) if val is not None}
    cache, meta = ctx.cache, ctx.meta
    if layer in ctx.layers:
        raise ValueError(f"{ATTN_IMPLEMENTATION}: expected one attention call per layer per forward, got a second "
                         f"call for layer {layer} from {type(module).__name__} (its K/V would overwrite the "
                         f"first call's in the pages: later steps would read them); this model is not served")
    if key.shape[1] != cache.num_kv_heads or key.shape[3] != cache.head_dim:
        raise ValueError(_kv_shape_message(module, layer, key, cache))
    if key.dtype != cache.dtype and not _is_float8(cache.dtype):
        raise ValueError(f"{ATTN_IMPLEMENTATION}: cache: expected dtype {key.dtype} (the K/V of "
                         f"{type(module).__name__}, layer {layer}), got {cache.dtype}: build the cache with "
                         f"dtype=model.dtype (only a float8 cache takes K/V cast to its dtype: a silent cast "
                         f"changes tokens)")
    q = query[0].transpose(0, 1)                         # [T, Hq, D]
    k = key[0].transpose(0, 1).to(cache.dtype)           # [T, Hkv, D] (a cast only into a float8 cache)
    v = value[0].transpose(0, 1).to(cache.dtype)
    ctx.layers.add(layer)
    if ctx._rows is None:
        cache.write(layer, meta.slots, k, v)
    else:
        cache._write_rows(layer, ctx._rows, k, v)
    out = ctx.attend(q, cache.k[layer], cache.v[layer], meta, scale=scaling, sliding_window=sliding_window,
                     **extra)
    return out[None].to(query.dtype), None


def _is_float8(dtype) -> bool:
    return "float8" in str(dtype)


def register() -> str:
    """Register :func:`paged_attention_forward` as ``ATTN_IMPLEMENTATION``; return the name (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION


register()


def check_model(model):
    """Raise ``ValueError`` unless a packed step on tpool pages gives ``model``'s own tokens; return
    its text config.

    That takes ``attn_implementation="tpool_paged"`` (another implementation takes the
    ``tpool_context`` keyword silently and attends over the packed row: lanes would see each
    other), and what :mod:`tpool.serving.checks` tests: layers that are all softmax attention,
    full or sliding (a recurrent, linear attention or convolution layer (Qwen3-Next, LFM2,
    Mamba hybrids) keeps state the pages do not hold, and a chunked attention layer (Llama4)
    has its chunks only in a mask this implementation does not build: accepted when the chunk
    spans every position), one attention call per layer (not DiffLlama), no ALiBi (Falcon's
    ``alibi``, MPT, Bloom), a decoder that takes ``position_ids`` (not Bart, MBart, TrOCR), and
    rotary frequencies that do not depend on the row's longest position (not ``rope_type``
    ``"dynamic"`` or ``"longrope"``). Python only, no tensor read. A model whose attention
    does not dispatch through ``AttentionInterface`` at all is found by :func:`forward_step`
    after its forward (no layer ran here), and one whose layer attends twice by the second call.
    """
    cfg = model.config.get_text_config(decoder=True)
    name = getattr(cfg, "model_type", "") or type(model).__name__
    impl = getattr(cfg, "_attn_implementation", None) or getattr(model.config, "_attn_implementation", None)
    if impl != ATTN_IMPLEMENTATION:
        raise ValueError(f"model: expected attn_implementation={ATTN_IMPLEMENTATION!r} (from_config/"
                         f"from_pretrained(..., attn_implementation={ATTN_IMPLEMENTATION!r}) or "
                         f"model.set_attn_implementation(...)), got {impl!r} from {name}")
    if _CHECKED.get(model) is not cfg:
        checks.check_config(cfg)
        checks.check_decoder(model, name)
        _CHECKED[model] = cfg
    return cfg


def from_config(config, **kwargs):
    """``AutoModelForCausalLM.from_config(config, attn_implementation="tpool_paged", **kwargs)``, checked.

    Raises ``ValueError`` before building for an ``attn_implementation`` keyword other than
    ``"tpool_paged"`` (that one is taken), for a config :func:`tpool.serving.checks.check_config`
    refuses, for a model that has no ``"tpool_paged"`` in its own table of attention classes
    (GPT-Neo: transformers raises ``KeyError: 'tpool_paged'`` while building), and after building
    for one :func:`check_model` refuses.

    The model is built on a copy of ``config``: transformers builds on the object it is given and
    sets its attention implementation there, which would switch another model built from the same
    config (an eager baseline beside this one) to tpool's attention.
    """
    from transformers import AutoModelForCausalLM
    _take_attn_implementation(kwargs)
    config = copy.deepcopy(config)
    return _build(config, lambda: AutoModelForCausalLM.from_config(config, attn_implementation=ATTN_IMPLEMENTATION,
                                                                   **kwargs))


def from_pretrained(name_or_path, **kwargs):
    """``AutoModelForCausalLM.from_pretrained(name_or_path, attn_implementation="tpool_paged", **kwargs)``, with
    the checks of :func:`from_config` (the config is read first, the weights only if it passes). The
    config checked is the one the model is built from: ``config=`` when passed, else the saved one with
    the keyword overrides transformers applies (``rope_parameters=...``: a keyword naming a config
    attribute). A ``config=`` object is copied first, as :func:`from_config` copies its config."""
    from transformers import AutoConfig, AutoModelForCausalLM
    _take_attn_implementation(kwargs)
    config = kwargs.get("config")
    if config is not None and not (isinstance(config, (str, bytes)) or hasattr(config, "__fspath__")):
        config = kwargs["config"] = copy.deepcopy(config)  # built on a copy, as from_config's
    else:  # a saved config: read it, with the keyword overrides
        config = AutoConfig.from_pretrained(name_or_path if config is None else config,
                                            **{k: v for k, v in kwargs.items() if k in _HUB_KWARGS})
        for k, v in kwargs.items():
            if k not in _HUB_KWARGS and k != "config" and hasattr(config, k):
                setattr(config, k, v)
    return _build(config, lambda: AutoModelForCausalLM.from_pretrained(
        name_or_path, attn_implementation=ATTN_IMPLEMENTATION, **kwargs))


def _take_attn_implementation(kwargs) -> None:
    """Drop an ``attn_implementation`` keyword naming tpool's (the builders pass it themselves); refuse another:
    a model on it would not be served (:func:`check_model`)."""
    given = kwargs.pop("attn_implementation", ATTN_IMPLEMENTATION)
    if given != ATTN_IMPLEMENTATION:
        raise ValueError(f"attn_implementation: expected {ATTN_IMPLEMENTATION!r} or none (these builders build on "
                         f"tpool's paged attention; use transformers' own for another), got {given!r}")


def _build(config, build):
    text = config.get_text_config(decoder=True)
    checks.check_config(text)
    try:
        model = build()
    except KeyError as e:
        if e.args != (ATTN_IMPLEMENTATION,):
            raise
        raise ValueError(f"model: expected a model whose attention dispatches through transformers' "
                         f"AttentionInterface, got {checks.config_name(text)}, which picks its attention class from a "
                         f"table of its own without {ATTN_IMPLEMENTATION!r} (transformers: KeyError "
                         f"{ATTN_IMPLEMENTATION!r})") from e
    check_model(model)
    return model


def takes_logits_to_keep(model) -> bool:
    """Whether ``model.forward`` names a ``logits_to_keep`` parameter (transformers' causal LMs do: the
    positions whose logits to compute; 192 of the 200 causal-LM classes of transformers 5.25). Read from
    the forward's signature once per model. A forward that would get it only through ``**kwargs`` does not
    count: it may pass it on, or drop it and return every position's logits."""
    takes = _KEEPS_LOGITS.get(model)
    if takes is None:
        try:
            takes = "logits_to_keep" in inspect.signature(model.forward).parameters
        except (TypeError, ValueError):   # (no signature to read: the full logits, indexed)
            takes = False
        _KEEPS_LOGITS[model] = takes
    return takes


def _check_keep(keep, t, device):
    if not isinstance(keep, torch.Tensor) or keep.dim() != 1 or keep.dtype not in (torch.int64, torch.int32) \
            or keep.device != device:
        got = (f"{keep.dtype} of shape {tuple(keep.shape)} on {keep.device}" if isinstance(keep, torch.Tensor)
               else repr(keep))
        raise ValueError(f"logits_to_keep: expected None (every token's logits) or a 1-D int64 (or int32) tensor of "
                         f"token indices in [0, {t}) on {device} (the step's), got {got}")


def forward_step(model, input_ids: torch.Tensor, ctx: PagedContext, *, logits_to_keep=None,
                 **kwargs) -> torch.Tensor:
    """Run ``model`` on one packed step; return its logits ``[T, vocab]`` (fp32 or the model's dtype),
    or ``[K, vocab]``: those of the ``K`` tokens ``logits_to_keep`` names.

    input_ids : torch.Tensor  shape ``[T]``, int64, on the model's device: the step's tokens in
    lane order (anything, e.g. 0, at padding), T = the step's ``max_tokens``. Positions come
    from ``ctx.meta.positions``.
    logits_to_keep : torch.Tensor, optional
        shape ``[K]``, int64 (or int32), on the step's device: the tokens (indices in ``[0, T)``,
        repeats allowed) whose logits to return, in that order. A model whose forward takes
        ``logits_to_keep`` (:func:`takes_logits_to_keep`) computes only those rows (its LM head runs on
        ``K`` tokens, not ``T``); any other model's full logits are computed, then indexed.
        Either way the shape is ``[K, vocab]`` and no device value is read: an index outside
        ``[0, T)`` is counted on the device (``invalid_logits_row``, raised by the cache's
        ``check()``), and its row holds token 0's logits.

    Raises ``ValueError`` for a model :func:`check_model` refuses, a ``ctx`` that is not a
    :class:`PagedContext`, and for a cache whose
    ``num_layers`` is not the model's ``num_hidden_layers``, before the forward; during it for a
    layer that attends twice, or K/V of another dtype than the cache's (but a float8 cache's);
    after it when not every layer's attention ran through ``ctx`` (a model whose attention
    does not dispatch through ``AttentionInterface``, or that has other layers).
    """
    layers = check_model(model).num_hidden_layers
    if not isinstance(ctx, PagedContext):
        raise ValueError(f"ctx: expected a PagedContext(cache, meta), got {type(ctx).__name__}")
    if ctx.cache.num_layers != layers:
        raise ValueError(f"cache: expected {layers} layers (the model's num_hidden_layers: one cache holds one "
                         f"model's K/V), got {ctx.cache.num_layers}")
    t = ctx.meta.positions.numel()
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1 or input_ids.numel() != t:
        got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids: expected shape ({t},), the step's max_tokens (pad input_ids to it, e.g. "
                         f"with 0), got {got}")
    if input_ids.dtype not in (torch.int64, torch.int32) or input_ids.device != ctx.meta.positions.device:
        raise ValueError(f"input_ids: expected int64 (or int32) token ids on {ctx.meta.positions.device} (the "
                         f"step's), got {input_ids.dtype} on {input_ids.device}")
    if logits_to_keep is not None:
        _check_keep(logits_to_keep, t, ctx.meta.positions.device)
        # An index outside the step would be a device-side assert on a GPU (an IndexError midway on a CPU,
        # after some layers wrote K/V): counted on the device instead, raised by the cache's check(), and
        # read as token 0's row. No value is read on the host.
        keep = logits_to_keep.long()
        bad = (keep < 0) | (keep >= t)
        ctx.cache.misuse[BAD_KEEP].add_(bad.sum())
        logits_to_keep = keep.masked_fill(bad, 0)
        if takes_logits_to_keep(model):
            kwargs["logits_to_keep"] = logits_to_keep
    positions = ctx.meta.positions.long().clamp(min=0)[None]
    ctx.layers.clear()
    ctx._rows = ctx.cache.destinations(ctx.meta.slots)   # once for every layer (a bad slot counted once)
    try:
        out = model(input_ids=input_ids[None], position_ids=positions, use_cache=False, **{CONTEXT_KWARG: ctx},
                    **kwargs)
    finally:
        ctx._rows = None   # this forward's slots: a later call of the model's own makes its own
    if len(ctx.layers) != layers:
        raise ValueError(f"model: expected all {layers} layers to attend through {ATTN_IMPLEMENTATION}, got "
                         f"{len(ctx.layers)} ({type(model).__name__}: its attention does not dispatch through "
                         f"transformers' AttentionInterface, or some layers are not attention); the step's "
                         f"logits are not from its pages")
    logits = out.logits[0]
    if logits_to_keep is None:
        return logits
    if "logits_to_keep" not in kwargs:
        return logits[logits_to_keep]
    if logits.shape[0] != logits_to_keep.numel():
        raise ValueError(f"model: expected logits of the {logits_to_keep.numel()} tokens logits_to_keep names, got "
                         f"{logits.shape[0]} rows from {type(model).__name__}, whose forward takes logits_to_keep")
    return logits
