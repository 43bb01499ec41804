"""What a packed step on tpool pages serves exactly, and what it refuses (``ValueError``) instead.

Note: a packed step runs every lane's new tokens as ONE row of the model, positions
given per token (``position_ids``), each layer's K/V in pages. A model computes the same
tokens as its own ``generate`` only if nothing in it depends on the row as a whole. Each
check below names a way a model does, found on random-weight models of transformers 5.25
that returned other tokens with no error:

- a layer type whose state is not K/V (linear attention, convolution, Mamba) or whose
  mask holds what the pages do not (Llama4's chunks): :func:`check_layers`;
- one attention module called twice per forward on its ``layer_idx`` (DiffLlama: the
  second call's V overwrote the first's in the pages): refused here by model type, and
  by ``PagedContext`` for any model whose layer attends twice in one forward;
- ALiBi position biases (Falcon with ``alibi=True``, MPT, Bloom), built from the row's
  own length and mask;
- a decoder whose ``forward`` takes no ``position_ids`` (Bart, MBart, TrOCR: learned
  positions numbered from the row or the cache length; Bloom, MPT): transformers
  passes the keyword on silently in ``**kwargs`` and the model ignores it;
- rotary embeddings whose frequencies depend on the longest position in the row (the
  ``rope_type`` ``"dynamic"`` and ``"longrope"``, which transformers' ``dynamic_rope_update``
  recomputes per forward from ``max(position_ids)``; PhiMoE's ``mscale`` for any rope type
  but ``"default"``): a short lane packed next to a long one gets the long one's frequencies.
  ``"default"``, ``"linear"``, ``"yarn"``, ``"llama3"`` and ``"proportional"`` are fixed at
  build time and served;
- a ``sliding_window`` the attention is given otherwise than the mask and the cache of
  ``generate`` apply it (:data:`WINDOW_DISAGREES`: OLMoE with one, SmolLM3 with
  ``use_sliding_window=False`` and ``sliding_attention`` layers): the pages see only the
  attention's, so ``generate``'s tokens come from another window.

At each layer's attention call ``tpool.serving.hf.paged_attention_forward`` refuses what only
shows there: a mask, attention that is not causal (the ``is_causal`` keyword, else the module's
attribute: Gemma 3 with ``use_bidirectional_attention``, BERT-family heads without ``is_decoder``),
K/V heads other than the cache's (JetMoE), and the keywords it does not implement. It takes
PhiMoE's window, which that model applies in its mask alone, from the config.

:func:`check_config` needs only a config (before a model is built); :func:`check_decoder`
the built model. Both are Python only, no tensor is read.
"""

import inspect
import math
import re

from torch import nn

ATTENTION_LAYERS = ("full_attention", "sliding_attention")  # the layer types the paged attention serves
# Model types whose attention module is called more than once per forward with one layer_idx.
ATTENDS_TWICE = {"diffllama": "DiffLlama attends twice per layer (differential attention: two calls, one "
                              "per half of V, same layer_idx)"}
# Model types whose attention is given another sliding window than their mask and generate's cache apply, when
# the config has one: (whether the config is such a one, why). The paged attention applies the attention's.
WINDOW_DISAGREES = {
    "olmoe": (lambda cfg: True,
              "OLMoE passes it to every layer's attention but builds a plain causal mask (eager attention attends "
              "over the whole prompt) while generate's cache keeps only the window (its decode steps see the last "
              "sliding_window tokens)"),
    "smollm3": (lambda cfg: not getattr(cfg, "use_sliding_window", False)
                and "sliding_attention" in (getattr(cfg, "layer_types", None) or ()),
                "SmolLM3 with use_sliding_window=False passes no window to the attention, but its mask and "
                "generate's cache apply it on the sliding_attention layers of layer_types"),
}
# Model types whose own rotary embedding reads the row's largest position for rope types other than "default".
ROW_GLOBAL_ROPE_MODELS = {"phimoe": "PhiMoE scales cos/sin by short_mscale or long_mscale from max(position_ids)"}


def config_name(cfg) -> str:
    """The config's ``model_type`` (its class name if it has none): what the errors name."""
    return getattr(cfg, "model_type", None) or type(cfg).__name__


def check_layers(cfg) -> None:
    """Raise ``ValueError`` unless every layer of ``cfg`` is full or sliding softmax attention (K/V in pages)."""
    kinds = set(getattr(cfg, "layer_types", None) or ())
    chunk = getattr(cfg, "attention_chunk_size", None)
    if chunk is not None and chunk >= getattr(cfg, "max_position_embeddings", chunk + 1):
        kinds.discard("chunked_attention")  # one chunk over every position: full attention
    other = sorted(kinds - set(ATTENTION_LAYERS)) + sorted(k for k in vars(cfg) if k.startswith("mamba_"))[:1]
    if other:
        raise ValueError(f"model: expected only {' and '.join(ATTENTION_LAYERS)} layers (their K/V in pages), got "
                         f"{', '.join(other)} in {config_name(cfg)}'s config, which the paged attention does not serve")


def rope_types(cfg) -> dict:
    """``{where: rope_type}`` of a config's ``rope_parameters`` (transformers 5; the legacy ``rope_scaling``
    is folded into it): ``{"": type}`` for one set, ``{layer_type: type}`` for one per layer type (Gemma3)."""
    rp = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if not isinstance(rp, dict):
        return {}
    if any(isinstance(v, dict) for v in rp.values()):
        return {k: v.get("rope_type", v.get("type", "default")) for k, v in rp.items() if isinstance(v, dict)}
    return {"": rp.get("rope_type", rp.get("type", "default"))}


def _row_global(rope_type) -> bool:
    """Whether transformers recomputes this rope type's frequencies every forward from the row's largest
    position (``dynamic_rope_update``: ``"dynamic" in rope_type`` or ``rope_type == "longrope"``)."""
    return isinstance(rope_type, str) and ("dynamic" in rope_type or rope_type == "longrope")


def check_config(cfg) -> None:
    """Raise ``ValueError`` for a (text) config whose model a packed step would not serve exactly (see the
    module's note): other layer types, attention twice per layer, a window the attention and the mask
    disagree on, ALiBi, row-global rotary embeddings.

    Needs only the config, so it can run before a model is built.
    """
    name = config_name(cfg)
    check_layers(cfg)
    if name in ATTENDS_TWICE:
        raise ValueError(f"model: expected one attention call per layer per forward, got {name}: "
                         f"{ATTENDS_TWICE[name]}; the pages hold one K/V per layer, so later steps would read "
                         f"the wrong half")
    disagrees = WINDOW_DISAGREES.get(name)
    window = getattr(cfg, "sliding_window", None)
    if disagrees is not None and window is not None and disagrees[0](cfg):
        raise ValueError(f"model: expected the attention and the mask to apply one sliding window, got "
                         f"sliding_window={window!r} in {name}'s config: {disagrees[1]}; the paged attention "
                         f"applies the attention's, so it would give other tokens than generate")
    attn_cfg = getattr(cfg, "attn_config", None)
    if getattr(cfg, "alibi", False) or getattr(attn_cfg, "alibi", False) or name == "bloom":
        raise ValueError(f"model: expected rotary or learned positions from position_ids, got ALiBi in {name}'s "
                         f"config (a position bias built from the packed row's length and mask, not each "
                         f"lane's), which the paged attention does not implement")
    for where, kind in rope_types(cfg).items():
        if _row_global(kind) or (name in ROW_GLOBAL_ROPE_MODELS and kind != "default"):
            at = f"rope_parameters[{where!r}]" if where else "rope_parameters"
            why = ROW_GLOBAL_ROPE_MODELS.get(name, "transformers recomputes its frequencies every forward from the "
                                                   "largest position in the row")
            raise ValueError(f"model: expected a rope_type whose frequencies are fixed ('default', 'linear', 'yarn', "
                             f"'llama3', ...), got {at} rope_type {kind!r} in {name}'s config: {why}, so a lane "
                             f"packed next to a longer one would get other frequencies than alone")


_POSITION_TABLE = re.compile(r"(^|_)(pos|position|positions)(_|$)|^wpe$")  # a table's name: wpe, embed_positions, ...


def position_limit(model) -> tuple[int, str] | None:
    """``(positions, what)``: how many positions ``model`` serves exactly on pages and what bounds
    them (``"position table transformer.wpe"``), or None where nothing does (rotary embeddings
    compute any position).

    A learned table is an ``nn.Embedding`` other than the input embeddings whose name says
    position (GPT-2's and GPT-Neo's ``wpe``, OPT's and BioGPT's ``embed_positions``, less the
    ``offset`` they add to each position); a fixed one a 2-D buffer so named (CTRL's
    ``pos_encoding``, GPT-J's and CodeGen's ``embed_positions`` of sin/cos rows, XGLM's
    ``embed_positions.weights``), or axial factors (Reformer's ``axial_pos_shape``: their product).
    A position past it indexes out of the table: an exception on a CPU (``IndexError``, a
    ``RuntimeError`` from a gather, ...), a device-side assert (the process ends) on CUDA. The
    smallest table bounds the model. Only the text decoder's count, not a model inside it that
    does not embed the tokens (a composite model's vision tower, GIT's image encoder: tables of
    patches), and only floating ones (``position_ids`` buffers are indices). Chunked attention
    layers, which :func:`check_layers` serves as full attention when one chunk spans
    ``max_position_embeddings`` (Llama 4), bound a sequence by ``attention_chunk_size`` too: past
    it eager attention attends within the chunk, the pages over every position. Python only: no
    tensor is read.
    """
    inputs = model.get_input_embeddings()
    try:
        dec = model.get_decoder()
    except (AttributeError, ValueError, NotImplementedError):
        dec = None
    if not isinstance(dec, nn.Module) or not any(m is inputs for m in dec.modules()):
        dec = model   # (get_decoder is best effort: ModernBERT-decoder's returns its LM head's projection)
    inside = {id(m) for m in dec.modules()}
    for sub in dec.modules():   # another model inside the decoder (GIT's image encoder): tables of its own patches
        if sub is not dec and hasattr(sub, "config") and hasattr(sub, "get_input_embeddings") and not any(
                m is inputs for m in sub.modules()):
            inside -= {id(m) for m in sub.modules()}
    found = []
    for name, module in model.named_modules():   # (the names the model's own state dict uses)
        if id(module) not in inside:
            continue
        leaf = name.rsplit(".", 1)[-1]
        axial = getattr(module, "axial_pos_shape", None)
        if isinstance(axial, (tuple, list)) and axial and all(isinstance(a, int) for a in axial):
            found.append((math.prod(axial), f"position table {name} (axial_pos_shape {tuple(axial)})"))
        if (isinstance(module, nn.Embedding) and module is not inputs and module.weight.is_floating_point()
                and _POSITION_TABLE.search(leaf)):
            found.append((module.num_embeddings - int(getattr(module, "offset", 0) or 0), f"position table {name}"))
        for buf_name, buf in module.named_buffers(recurse=False):
            if (buf.dim() == 2 and buf.is_floating_point()
                    and (_POSITION_TABLE.search(buf_name) or _POSITION_TABLE.search(leaf))):
                rows = buf.shape[0] - int(getattr(module, "offset", 0) or 0)
                found.append((rows, f"position table {name}.{buf_name}" if name else f"position table {buf_name}"))
    cfg = model.config.get_text_config(decoder=True)
    chunk = getattr(cfg, "attention_chunk_size", None)
    if chunk and "chunked_attention" in (getattr(cfg, "layer_types", None) or ()):
        found.append((chunk, "attention_chunk_size (its chunked layers, served as full attention within one chunk)"))
    return min(found) if found else None


def decoder_forward(model):
    """The ``forward`` that embeds positions: the first of the model's decoder (``get_decoder()``, a
    best-effort lookup that may return another module: ModernBERT-decoder's LM head is its ``decoder``),
    its base model and the model itself that is a transformers model whose ``forward`` names its
    parameters (not only ``*args, **kwargs``: Bart's ``BartDecoderWrapper``)."""
    try:
        dec = model.get_decoder()
    except (AttributeError, ValueError, NotImplementedError):
        dec = None
    for cand in (dec, getattr(model, "base_model", None), model):
        if cand is None or not hasattr(cand, "config") or not hasattr(cand, "forward"):
            continue
        try:
            params = inspect.signature(cand.forward).parameters.values()
        except (TypeError, ValueError):
            continue
        if any(p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
            return cand.forward
    return model.forward


def check_decoder(model, name: str) -> None:
    """Raise ``ValueError`` unless ``model``'s decoder takes ``position_ids``.

    The test is the signature of the decoder's ``forward`` (``inspect.signature``, through
    transformers' decorators), not a list of models: a model that numbers positions itself
    (Bart, MBart, TrOCR: learned positions from the cache length; Bloom, MPT: ALiBi) has no
    such parameter, and its ``**kwargs`` would take ``position_ids`` and drop it. A model
    whose decoder names the parameter uses it (checked on every tested architecture:
    their packed logits match eager).
    """
    fwd = decoder_forward(model)
    try:
        params = inspect.signature(fwd).parameters
    except (TypeError, ValueError):   # no signature to read: nothing to say
        return
    if "position_ids" not in params:
        owner = getattr(getattr(fwd, "__self__", None), "__class__", type(model)).__name__
        raise ValueError(f"model: expected a decoder that takes position_ids (each packed token's position in "
                         f"its own sequence), got {owner}.forward without it in {name}: it numbers positions "
                         f"from the packed row or its own cache, so every lane but the first would get "
                         f"other positions")
