"""Models a packed step on tpool pages would serve with other tokens, silently, are refused with a ValueError.

Each case was found on random-weight models of transformers 5.25 (other tokens than ``generate``, no
error) or crashed deep inside transformers; each test fails without its check. Skipped without
transformers.
"""

import re
import types

import pytest
import torch

import tpool
from conftest import i32

transformers = pytest.importorskip("transformers")

from tpool.serving import PagedKVCache, checks, step_metadata  # noqa: E402
from tpool.serving import engine, hf  # noqa: E402
from tpool.serving.hf import ATTN_IMPLEMENTATION, PagedContext, check_model, forward_step  # noqa: E402

V = 256
LLAMA = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, initializer_range=0.25, max_position_embeddings=256,
             eos_token_id=None, bos_token_id=None, pad_token_id=0)
SEQ = dict(d_model=64, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=128, encoder_layers=2,
           encoder_attention_heads=4, encoder_ffn_dim=128, max_position_embeddings=256, init_std=0.25,
           pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, is_decoder=True,
           is_encoder_decoder=False)


def _build(config_cls, model_cls, **kw):
    torch.manual_seed(0)
    return model_cls._from_config(config_cls(**kw), attn_implementation=ATTN_IMPLEMENTATION,
                                  dtype=torch.float32).eval()


def _llama(**kw):
    return _build(transformers.LlamaConfig, transformers.LlamaForCausalLM, **{**LLAMA, **kw})


def _ctx(model, lanes=(5, 3), max_tokens=8, layers=None, dtype=torch.float32, num_pages=32):
    """A PagedContext of one prefill step of ``lanes`` tokens; ``layers`` overrides the cache's layer count."""
    pool = tpool.PagePool(num_pages, 4, device="cpu", backend="reference")
    table = tpool.PageTable(pool, len(lanes), 16)
    n, heads, dim = engine.kv_shape(model.config)
    cache = PagedKVCache.from_pool(pool, layers or n, heads, dim, dtype=dtype)
    meta = step_metadata(table, table.step(i32(list(range(len(lanes)))), i32(list(lanes)), max_tokens=max_tokens))
    return PagedContext(cache, meta)


def _untouched(ctx):
    return all(not k.any() for k in ctx.cache.k) and all(not v.any() for v in ctx.cache.v)


# ------------------------------------------------------------ attention that is not causal
@pytest.mark.parametrize("name", ["gemma3_bidirectional", "bert_not_a_decoder"])
def test_attention_whose_module_is_not_causal_is_refused_before_it_writes(name):
    """Gemma 3 with ``use_bidirectional_attention`` and a BERT-family LM head without ``is_decoder`` pass no
    ``is_causal`` keyword: their modules' ``is_causal`` attribute is False (what transformers' sdpa reads).
    Served causally, they gave other tokens than ``generate``, silently."""
    if name == "gemma3_bidirectional":
        model = _build(transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
                       **{**LLAMA, "use_bidirectional_attention": True, "sliding_window": 64})
    else:
        model = _build(transformers.BertConfig, transformers.BertLMHeadModel, vocab_size=V, hidden_size=64,
                       num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, max_position_embeddings=256,
                       pad_token_id=0, is_decoder=False)
    ctx = _ctx(model)
    with pytest.raises(ValueError, match=r"is_causal: expected True .*got False \(the module's is_causal attribute"):
        forward_step(model, torch.zeros(8, dtype=torch.long), ctx)
    assert _untouched(ctx)


def test_attention_with_other_kv_heads_than_the_config_names_is_refused_naming_it():
    """JetMoE repeats its K/V heads per expert before the attention: the Engine's cache (``kv_shape``,
    from the config) has half of them. The error names the model, the layer and ``kv_shape``, not only
    the cache's shape check."""
    cfg = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_key_value_heads=2, kv_channels=16,
               intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
               initializer_range=0.1, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    model = _build(transformers.JetMoeConfig, transformers.JetMoeForCausalLM, **cfg)
    eng = engine.Engine(model, num_pages=32, page_size=4, max_batch=2, max_pages=16, backend="reference")
    with pytest.raises(ValueError, match=r"expected K/V of 4 heads of head_dim 16 \(what JetMoeAttention, layer 0, "
                                         r"attends with\), the cache holds 2 heads of 16 .*kv_shape.*does not use "
                                         r"the K/V heads its config names"):
        eng.run([engine.Request(0, [5, 6, 7, 8, 9], 3)])


@pytest.mark.parametrize("heads, dim", [(4, 16), (2, 8)])
def test_a_cache_built_for_other_kv_heads_than_the_config_names_says_to_build_it_with_kv_shape(heads, dim):
    """A model whose attention uses the K/V heads its config names, on a cache built by hand with another
    head count or head_dim: the message gives the shape to build it with (not JetMoE's refusal)."""
    model = _llama()
    ctx = _ctx(model)
    ctx.cache = PagedKVCache.from_pool(tpool.PagePool(32, 4, device="cpu", backend="reference"), 2, heads, dim,
                                       dtype=torch.float32)
    with pytest.raises(ValueError, match=re.escape(
            f"expected K/V of 2 heads of head_dim 16 (what LlamaAttention, layer 0, attends with), the cache holds "
            f"{heads} heads of {dim}: build the PagedKVCache with the shape engine.kv_shape(model.config) gives, "
            f"(2, 2, 16) (num_layers, num_kv_heads, head_dim)")) as e:
        forward_step(model, torch.zeros(8, dtype=torch.long), ctx)
    assert "JetMoE" not in str(e.value) and _untouched(ctx)


def test_a_kv_shape_mismatch_without_a_usable_config_names_the_shape_the_attention_uses():
    """With no config to read (a module without one, or a config kv_shape cannot read: no heads), the message
    gives the K/V shape the attention uses, claims nothing about the config, and raises nothing else."""
    key = torch.zeros(1, 2, 3, 16)
    cache = types.SimpleNamespace(num_kv_heads=4, head_dim=16)
    bare = torch.nn.Module()
    odd = torch.nn.Module()
    odd.config = types.SimpleNamespace(model_type="odd", num_hidden_layers=2, num_attention_heads=0, hidden_size=64)
    for module in (bare, odd):
        text = hf._kv_shape_message(module, 0, key, cache)
        assert text.endswith("the cache holds 4 heads of 16: build the PagedKVCache for 2 K/V heads of head_dim 16 "
                             "(engine.kv_shape(model.config) gives the shape a config names)"), text


# ------------------------------------------------------------ attention twice per layer
def _diffllama():
    return _build(transformers.DiffLlamaConfig, transformers.DiffLlamaForCausalLM, **LLAMA)


def test_diffllama_is_refused_before_its_first_step():
    """DiffLlama calls the attention function twice per layer (one call per half of V, one layer_idx): the
    second call's K/V overwrote the first's in the pages and every decode step after the prefill read the
    wrong half (max |dlogit| ~8, other tokens than generate, no error)."""
    model = _diffllama()
    ctx = _ctx(model)
    with pytest.raises(ValueError, match="expected one attention call per layer per forward, got diffllama"):
        check_model(model)
    with pytest.raises(ValueError, match="got diffllama"):
        forward_step(model, torch.randint(1, V, (8,)), ctx)
    assert _untouched(ctx)
    with pytest.raises(ValueError, match="got diffllama"):   # at construction, not in run() after pages went
        engine.Engine(model, num_pages=32, page_size=4, max_batch=4, max_pages=8, backend="reference")


def test_a_layer_attending_twice_in_one_forward_is_refused_before_its_second_write(monkeypatch):
    """The check any model meets, not only the model types known to attend twice: PagedContext records the
    layers that attended in this forward; a second call for one is refused before it writes."""
    monkeypatch.setattr(checks, "ATTENDS_TWICE", {})    # as for a model type nobody listed
    model = _diffllama()
    ctx = _ctx(model)
    with pytest.raises(ValueError, match="expected one attention call per layer per forward, got a second call "
                                         "for layer 0 from DiffLlamaAttention"):
        forward_step(model, torch.randint(1, V, (8,)), ctx)
    assert ctx.layers == {0}
    # one forward per context: forward_step starts each forward afresh, so a context used twice is fine
    llama = _llama()
    ctx = _ctx(llama)
    x = torch.randint(1, V, (8,))
    assert torch.equal(forward_step(llama, x, ctx), forward_step(llama, x, ctx))


# ------------------------------------------------------------ positions the model does not take
@pytest.mark.parametrize("name", ["bart", "mbart", "trocr"])
def test_a_decoder_that_takes_no_position_ids_is_refused(name):
    """Bart, MBart and TrOCR as causal LMs number their learned positions from the cache length, not from
    position_ids (their **kwargs take the keyword and drop it): one request alone already got other tokens
    than generate after its prefill."""
    if name == "trocr":
        model = _build(transformers.TrOCRConfig, transformers.TrOCRForCausalLM, vocab_size=V, d_model=64,
                       decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=128, max_position_embeddings=256,
                       init_std=0.25, pad_token_id=1, use_learned_position_embeddings=True)
        owner = "TrOCRDecoder"
    else:
        cfg_cls, model_cls = {"bart": (transformers.BartConfig, transformers.BartForCausalLM),
                              "mbart": (transformers.MBartConfig, transformers.MBartForCausalLM)}[name]
        model = _build(cfg_cls, model_cls, vocab_size=V, **SEQ)
        owner = type(model.get_decoder()).__name__
    ctx = _ctx(model)
    with pytest.raises(ValueError, match=f"expected a decoder that takes position_ids .*got {owner}.forward "
                                         f"without it in {name}"):
        forward_step(model, torch.randint(3, V, (8,)), ctx)
    assert _untouched(ctx)
    if name != "trocr":                 # the check a config alone cannot answer runs on the model it builds
        with pytest.raises(ValueError, match=f"expected a decoder that takes position_ids .*in {name}"):
            hf.from_config(cfg_cls(vocab_size=V, **SEQ))


def test_models_whose_decoder_takes_position_ids_are_still_served():
    """The signature test looks past a wrapper that only passes ``*args, **kwargs`` on and past a
    ``decoder`` attribute that is not a decoder (ModernBERT-decoder's LM head): learned positions that
    do come from position_ids (GPT-2, OPT) and rotary models pass."""
    gpt2 = _build(transformers.GPT2Config, transformers.GPT2LMHeadModel, vocab_size=V, n_embd=64, n_layer=2,
                  n_head=4, n_positions=256, initializer_range=0.25, bos_token_id=0, eos_token_id=0)
    opt = _build(transformers.OPTConfig, transformers.OPTForCausalLM, vocab_size=V, hidden_size=64, ffn_dim=128,
                 num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=64,
                 init_std=0.25, pad_token_id=1)
    models = [gpt2, opt, _llama()]
    if hasattr(transformers, "ModernBertDecoderForCausalLM"):
        models.append(_build(transformers.ModernBertDecoderConfig, transformers.ModernBertDecoderForCausalLM,
                             vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, pad_token_id=0))
    for m in models:
        check_model(m)
        assert forward_step(m, torch.randint(3, V, (8,)), _ctx(m)).shape == (8, V)


# ------------------------------------------------------------ rotary frequencies of the whole row
def _packed_logits_of_a_short_lane(model, bypass=None):
    """Logits of a 7-token lane prefilled in one step next to a 30-token lane, and those of eager alone."""
    g = torch.Generator().manual_seed(0)
    short, long_ = torch.randint(3, V, (7,), generator=g), torch.randint(3, V, (30,), generator=g)
    ctx = _ctx(model, lanes=(7, 30), max_tokens=40)
    x = torch.zeros(40, dtype=torch.long)
    x[:37] = torch.cat([short, long_])
    with torch.no_grad():
        got = forward_step(model, x, ctx)[:7]
        model.set_attn_implementation("eager")
        try:
            want = model(short[None]).logits[0]
        finally:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return got, want


ROW_GLOBAL = {
    "dynamic": lambda: _llama(max_position_embeddings=16,
                              rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
    "longrope": lambda: _build(transformers.Phi3Config, transformers.Phi3ForCausalLM,
                               **{k: v for k, v in LLAMA.items() if k != "head_dim"},
                               original_max_position_embeddings=16,
                               rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 4,
                                                "long_factor": [4.0] * 4, "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.5}),
}


@pytest.mark.parametrize("kind", sorted(ROW_GLOBAL))
def test_rope_whose_frequencies_depend_on_the_rows_longest_position_is_refused(kind, monkeypatch):
    """transformers recomputes "dynamic" and "longrope" frequencies every forward from max(position_ids):
    a short lane packed next to one past the original length got the long one's frequencies (other tokens
    than alone and than generate). Shown with the check bypassed, then refused."""
    model = ROW_GLOBAL[kind]()
    with pytest.raises(ValueError, match=f"expected a rope_type whose frequencies are fixed .*got rope_parameters "
                                         f"rope_type '{kind}' in (llama|phi3)'s config"):
        check_model(model)
    monkeypatch.setattr(checks, "_row_global", lambda rope_type: False)
    got, want = _packed_logits_of_a_short_lane(model)
    assert (got - want).abs().max() > 1e-2


def test_row_global_rope_of_one_layer_type_is_refused():
    """A per-layer-type rope_parameters (Gemma3: one set for full layers, one for sliding) is read per type."""
    cfg = transformers.Gemma3TextConfig(**LLAMA, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                        rope_parameters={"full_attention": {"rope_type": "dynamic", "factor": 2.0,
                                                                            "rope_theta": 1e6},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 1e4}})
    with pytest.raises(ValueError, match=r"got rope_parameters\['full_attention'\] rope_type 'dynamic' in gemma3_text"):
        checks.check_config(cfg)


def test_phimoe_rope_other_than_default_is_refused(monkeypatch):
    """PhiMoE's rotary embedding multiplies cos/sin by short_mscale or long_mscale, picked from the row's
    largest position, for every rope type but "default" (even "linear", fixed for other models): a short
    lane packed next to one past original_max_position_embeddings got the long one's scale. Shown with the
    check bypassed, then refused."""
    rope = {"rope_type": "linear", "factor": 1.0, "rope_theta": 10000.0, "short_mscale": 1.0, "long_mscale": 2.0,
            "original_max_position_embeddings": 16}
    model = _build(transformers.PhimoeConfig, transformers.PhimoeForCausalLM,
                   **{k: v for k, v in LLAMA.items() if k != "head_dim"}, num_local_experts=4,
                   num_experts_per_tok=2, rope_parameters=rope)
    with pytest.raises(ValueError, match="got rope_parameters rope_type 'linear' in phimoe's config: PhiMoE scales "
                                         "cos/sin by short_mscale or long_mscale"):
        check_model(model)
    monkeypatch.setattr(checks, "ROW_GLOBAL_ROPE_MODELS", {})
    got, want = _packed_logits_of_a_short_lane(model)
    assert (got - want).abs().max() > 1e-2


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 16},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16, "rope_theta": 10000.0},
], ids=lambda r: r["rope_type"])
def test_rope_fixed_at_build_time_is_served_packed_as_alone(rope):
    model = _llama(max_position_embeddings=64, rope_parameters=rope)
    check_model(model)
    got, want = _packed_logits_of_a_short_lane(model)
    assert (got - want).abs().max() < 1e-4


# ------------------------------------------------------------ clear errors instead of crashes
@pytest.mark.parametrize("name", ["falcon", "mpt", "bloom"])
def test_alibi_is_refused_before_the_forward(name):
    """Falcon with alibi=True and MPT crashed deep in transformers (AttributeError on a None mask); Bloom was
    found only after its forward. ALiBi biases come from the packed row's length and mask."""
    if name == "falcon":
        model = _build(transformers.FalconConfig, transformers.FalconForCausalLM, vocab_size=V, hidden_size=64,
                       num_hidden_layers=2, num_attention_heads=4, multi_query=True, alibi=True,
                       initializer_range=0.25)
    elif name == "mpt":
        model = _build(transformers.MptConfig, transformers.MptForCausalLM, vocab_size=V, d_model=64, n_heads=4,
                       n_layers=2, max_seq_len=256)
    else:
        model = _build(transformers.BloomConfig, transformers.BloomForCausalLM, vocab_size=V, hidden_size=64,
                       n_layer=2, n_head=4, pad_token_id=0)
    ctx = _ctx(model)
    with pytest.raises(ValueError, match=f"expected rotary or learned positions from position_ids, got ALiBi in "
                                         f"{name}'s config"):
        forward_step(model, torch.randint(1, V, (8,)), ctx)
    assert _untouched(ctx)


WINDOWED = dict(sliding_window=6, max_position_embeddings=256)


def _window_config(name, **kw):
    if name == "olmoe":
        return transformers.OlmoeConfig(**{**LLAMA, **WINDOWED, "num_experts": 4, "num_experts_per_tok": 2, **kw})
    return transformers.SmolLM3Config(**{**LLAMA, **WINDOWED, "layer_types": ["sliding_attention", "full_attention"],
                                         **kw})


@pytest.mark.parametrize("name, why", [("olmoe", "OLMoE passes it to every layer's attention but builds a plain "
                                                 "causal mask"),
                                       ("smollm3", "SmolLM3 with use_sliding_window=False passes no window")])
def test_a_window_the_attention_and_the_mask_disagree_on_is_refused(name, why):
    """OLMoE passes its config's sliding_window to the attention but masks causally (generate's cache keeps the
    window); SmolLM3 with use_sliding_window=False passes none while its mask and cache apply the window on
    sliding_attention layers. Both were served with the attention's window: every request of an 8-request
    Engine run differed from generate, no error."""
    with pytest.raises(ValueError, match=f"expected the attention and the mask to apply one sliding window, got "
                                         f"sliding_window=6 in {name}'s config: {why}"):
        hf.from_config(_window_config(name), dtype=torch.float32)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_window_config(name), dtype=torch.float32,
                                                          attn_implementation=ATTN_IMPLEMENTATION).eval()
    with pytest.raises(ValueError, match="expected the attention and the mask to apply one sliding window"):
        engine.Engine(model, num_pages=16, page_size=4, max_batch=2, max_pages=8, backend="reference")


@pytest.mark.parametrize("name, kw", [("olmoe", dict(sliding_window=None)), ("smollm3", dict(use_sliding_window=True))])
def test_the_same_models_with_one_window_are_served_as_generate(name, kw):
    torch.manual_seed(0)
    model = hf.from_config(_window_config(name, **kw), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    reqs = lambda: engine.make_requests(4, max_new=(4, 8), prompt_len=(8, 16), share_every=0)   # noqa: E731
    eng = engine.Engine(model, num_pages=32, page_size=4, max_batch=4, max_pages=8, backend="reference")
    assert eng.run(reqs()) == engine.reference_tokens(model, reqs())


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_window_only_generates_cache_keeps_is_refused_before_it_writes(name):
    """A config carrying a sliding_window its model ignores (a stray key of a saved config.json): generate's
    DynamicCache keeps only that window of every layer, so its decode steps saw the last tokens alone while a
    packed step attended over all of them. 44 of the 78 types of transformers 5.25 served here gave other
    tokens than generate that way, with no error."""
    if name == "llama":
        model = _llama(sliding_window=4)
    else:
        model = _build(transformers.GPT2Config, transformers.GPT2LMHeadModel, vocab_size=V, n_embd=64, n_layer=2,
                       n_head=4, sliding_window=4)
    ctx = _ctx(model)
    with pytest.raises(ValueError, match=r"sliding_window: expected the window generate applies, got None from "
                                         r"\w+Attention, layer 0: its config's sliding_window=4 makes generate's "
                                         r"cache keep only the last tokens"):
        forward_step(model, torch.randint(1, V, (8,)), ctx)
    assert _untouched(ctx)
    model.config.sliding_window = None   # the same model, full attention in its cache too: served
    forward_step(model, torch.randint(1, V, (8,)), _ctx(model))


def test_a_layers_missing_window_is_checked_once_and_a_refusal_every_time(monkeypatch):
    """The check of a layer given no window reads its config (~2-8 µs a layer): it ran on every attention call
    of every step. It now runs once per module and config; a refused layer is refused at every forward."""
    calls = []
    window = hf._cache_window
    monkeypatch.setattr(hf, "_cache_window", lambda module, layer: calls.append(layer) or window(module, layer))
    model = _llama()
    for _ in range(3):
        forward_step(model, torch.randint(1, V, (8,)), _ctx(model))
    assert calls == [0, 1]                       # two layers, three forwards: once a layer
    stray = _llama(sliding_window=4)             # a stray window: refused at every forward, never memoized
    for _ in range(2):
        with pytest.raises(ValueError, match="sliding_window: expected the window generate applies"):
            forward_step(stray, torch.randint(1, V, (8,)), _ctx(stray))
    assert calls == [0, 1, 0, 0]


def test_a_model_with_its_own_attention_table_is_refused_at_build(tmp_path):
    """GPT-Neo picks its attention class from a table of its own: building it on tpool_paged raised
    ``KeyError: 'tpool_paged'`` inside transformers. hf.from_config / from_pretrained say why."""
    cfg = transformers.GPTNeoConfig(vocab_size=V, hidden_size=64, num_layers=2, num_heads=4,
                                    attention_types=[[["global", "local"], 1]], max_position_embeddings=256)
    with pytest.raises(KeyError, match=ATTN_IMPLEMENTATION):   # what building it directly does
        transformers.GPTNeoForCausalLM._from_config(cfg, attn_implementation=ATTN_IMPLEMENTATION)
    with pytest.raises(ValueError, match="expected a model whose attention dispatches through transformers' "
                                         "AttentionInterface, got gpt_neo"):
        hf.from_config(cfg)
    transformers.GPTNeoForCausalLM._from_config(cfg, attn_implementation="eager").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="got gpt_neo"):
        hf.from_pretrained(tmp_path)
    # a model it serves builds as from_config does; one it refuses is refused before building
    llama = hf.from_config(transformers.LlamaConfig(**LLAMA))
    assert llama.config._attn_implementation == ATTN_IMPLEMENTATION
    with pytest.raises(ValueError, match="got diffllama"):
        hf.from_config(transformers.DiffLlamaConfig(**LLAMA))

    def build():                        # any other KeyError is the builder's own, raised as it is
        raise KeyError("some_weight")
    with pytest.raises(KeyError, match="some_weight"):
        hf._build(transformers.LlamaConfig(**LLAMA), build)


def test_from_pretrained_checks_the_config_the_model_is_built_from(tmp_path):
    """A checkpoint saved with a refused rope is served when the caller builds it with a fixed one
    (``config=``, or a keyword override of ``rope_parameters``), and refused otherwise."""
    bad = transformers.LlamaConfig(**LLAMA, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                             "rope_theta": 1e4})
    transformers.LlamaForCausalLM._from_config(bad, attn_implementation="eager").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        hf.from_pretrained(tmp_path)
    for kw in (dict(config=transformers.LlamaConfig(**LLAMA)),
               dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4})):
        model = hf.from_pretrained(tmp_path, **kw)
        assert model.config.rope_parameters["rope_type"] == "default"
        check_model(model)


def test_building_on_tpool_leaves_the_callers_config_alone(tmp_path):
    """transformers builds on the config object it is given and sets its attention implementation there:
    hf.from_config(cfg) switched an eager model built earlier from the same cfg to tpool's attention.
    Both builders work on a copy; the eager model and the config keep theirs."""
    cfg = transformers.LlamaConfig(**LLAMA)
    eager = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="eager")
    eager.save_pretrained(tmp_path)
    for build in (lambda: hf.from_config(cfg), lambda: hf.from_pretrained(tmp_path, config=cfg)):
        model = build()
        assert model.config._attn_implementation == ATTN_IMPLEMENTATION and model.config is not cfg
        assert eager.config._attn_implementation == "eager" and cfg._attn_implementation == "eager"


def test_the_builders_take_attn_implementation_tpool_paged_and_refuse_another(tmp_path):
    """``hf.from_config(cfg, attn_implementation="tpool_paged")`` (the keyword the README's plain transformers
    example passes) raised transformers' ``TypeError: got multiple values for keyword argument
    'attn_implementation'``, and so did any other implementation, whose model tpool would not serve. The
    builders' own name is taken; another is a ValueError naming it, before anything is read or built."""
    cfg = transformers.LlamaConfig(**LLAMA)
    transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="eager").save_pretrained(tmp_path)
    for build in (lambda **kw: hf.from_config(cfg, **kw), lambda **kw: hf.from_pretrained(tmp_path, **kw)):
        model = build(attn_implementation=ATTN_IMPLEMENTATION)
        assert model.config._attn_implementation == ATTN_IMPLEMENTATION
        check_model(model)
        for other in ("eager", "sdpa", None):
            with pytest.raises(ValueError, match=f"attn_implementation: expected {ATTN_IMPLEMENTATION!r} .*got "
                                                 f"{other!r}"):
                build(attn_implementation=other)
    with pytest.raises(ValueError, match="attn_implementation: expected"):
        hf.from_pretrained(tmp_path / "missing", attn_implementation="eager")   # (before the config is read)


@pytest.mark.parametrize("ids, match", [(torch.zeros(8), "got torch.float32 on cpu"),
                                        (torch.zeros(8, dtype=torch.bool), "got torch.bool on cpu"),
                                        (torch.zeros(8, dtype=torch.long, device="meta"), "got torch.int64 on meta")])
def test_input_ids_of_another_dtype_or_device_are_refused_before_the_forward(ids, match):
    """Float or bool ids failed inside the model's embedding (a torch RuntimeError), after the step's write
    destinations had been made."""
    model = _llama()
    ctx = _ctx(model)
    with pytest.raises(ValueError, match=r"input_ids: expected int64 \(or int32\) token ids on cpu \(the step's\), "
                                         + match):
        forward_step(model, ids, ctx)
    assert _untouched(ctx) and ctx._rows is None


def test_kv_shape_of_a_config_without_attention_is_a_value_error():
    """kv_shape(MambaConfig()) raised AttributeError (no num_attention_heads)."""
    with pytest.raises(ValueError, match="expected only full_attention and sliding_attention layers .*in mamba"):
        engine.kv_shape(transformers.MambaConfig())

    class NoHeads:   # a config that names no attention heads and no layer types
        model_type, num_hidden_layers = "custom", 2
    with pytest.raises(ValueError, match="custom: not supported by tpool.serving: expected a config with "
                                         "num_attention_heads"):
        engine.kv_shape(NoHeads())


def test_a_context_of_other_objects_is_refused_naming_what_was_expected():
    """``PagedContext(cache, table.step(...))`` (the step's result, not its metadata) and ``forward_step(model, x,
    meta)`` (the metadata, not a context) got an AttributeError from inside (``'StepResult' object has no attribute
    'num_pages'``, ``'StepMetadata' object has no attribute 'cache'``); a ValueError names what was expected."""
    model = _llama()
    ctx = _ctx(model)
    res = ctx.meta   # (the metadata's fields are the step's: a StepResult with them)
    step = tpool.table_results.StepResult(res.slots, torch.ones(2, dtype=torch.bool), res.csr, res.positions,
                                          res.qo_indptr, res.kv_lens)
    with pytest.raises(ValueError, match=r"meta: expected a StepMetadata \(step_metadata\(table, step\)\), got "
                                         r"StepResult: pass step_metadata\(table, step\)"):
        PagedContext(ctx.cache, step)
    for bad in (None, ctx.cache.k):
        with pytest.raises(ValueError, match=f"cache: expected a PagedKVCache .*got {type(bad).__name__}"):
            PagedContext(bad, ctx.meta)
    with pytest.raises(ValueError, match=r"attend: expected a callable \(q, k_cache, v_cache, meta, scale=, "
                                         r"sliding_window=\) such as paged_attention, got str"):
        PagedContext(ctx.cache, ctx.meta, attend="flashinfer")   # (it failed at the first layer, after its write)
    x = torch.randint(1, V, (8,))
    for bad in (ctx.meta, (ctx.cache, ctx.meta), None):
        with pytest.raises(ValueError, match=f"ctx: expected a PagedContext\\(cache, meta\\), got "
                                             f"{type(bad).__name__}"):
            forward_step(model, x, bad)
    assert _untouched(ctx)
    assert forward_step(model, x, ctx).shape == (8, V)


# ------------------------------------------------------------ the cache
def test_a_cache_of_another_dtype_is_refused_and_from_pool_takes_no_default():
    """from_pool defaulted to float16, and the attention cast an fp32 model's K/V to it silently (tokens
    off generate's). Now the dtype is the caller's to give, and a mismatch is refused before any write;
    a float8 cache, where storing K/V cast is the point, still takes them."""
    model = _llama()
    pool = tpool.PagePool(8, 4, device="cpu", backend="reference")
    with pytest.raises(TypeError, match="dtype"):
        PagedKVCache.from_pool(pool, 2, 2, 16)
    for dtype in (torch.float16, torch.bfloat16):
        ctx = _ctx(model, dtype=dtype)
        with pytest.raises(ValueError, match=f"cache: expected dtype torch.float32 \\(the K/V of LlamaAttention, "
                                             f"layer 0\\), got {dtype}"):
            forward_step(model, torch.randint(1, V, (8,)), ctx)
        assert _untouched(ctx)
    ctx = _ctx(model, dtype=torch.float8_e4m3fn)
    assert forward_step(model, torch.randint(1, V, (8,)), ctx).shape == (8, V)
    assert ctx.cache.k[1].float().abs().sum() > 0


@pytest.mark.parametrize("layers", [1, 3])
def test_a_cache_with_other_layers_than_the_model_is_refused_before_the_forward(layers):
    """A 3-layer cache for a 2-layer model was taken (a cache shared by two models of one K/V shape would
    have their layers overwrite each other); a 1-layer one failed at the second layer, after the first's write."""
    model = _llama()
    ctx = _ctx(model, layers=layers)
    with pytest.raises(ValueError, match=f"cache: expected 2 layers \\(the model's num_hidden_layers.*got {layers}"):
        forward_step(model, torch.randint(1, V, (8,)), ctx)
    assert _untouched(ctx)


# ------------------------------------------------------------ EOS: the engine and its check agree
def _engine_tokens(model, reqs, **kw):
    eng = engine.Engine(model, num_pages=48, page_size=4, max_batch=4, max_pages=16, backend="reference",
                        prefix_cache=False, **kw)
    got = eng.run(reqs)
    eng.check()
    return got


def test_the_engine_and_reference_tokens_stop_at_the_same_eos():
    """The engine ignored eos_token_id while reference_tokens (generate) stopped at the model's: the repo's
    own check reported mismatches on every model whose config has an EOS in its vocabulary (Mistral, OPT,
    Granite, ...). Both now take ``eos_token_id``, default the model's generation_config; and reference_tokens
    decodes plain greedy whatever else the model's generation_config holds (a repetition penalty, a forced
    EOS at max_length)."""
    model = _llama()
    reqs = lambda: engine.make_requests(5, seed=3, vocab_size=V, max_new=(6, 10), prompt_len=(3, 9))  # noqa: E731
    free = _engine_tokens(model, reqs(), eos_token_id=None)
    assert all(len(free[r.rid]) == r.max_new for r in reqs())
    eos = free[0][2]                                   # a token request 0 generates third: it stops there
    model.generation_config.eos_token_id = eos
    model.generation_config.repetition_penalty = 3.0   # processors the engine does not apply: not in the check
    model.generation_config.forced_eos_token_id = eos
    got, want = _engine_tokens(model, reqs()), engine.reference_tokens(model, reqs())
    assert got == want
    assert got[0] == free[0][:3] and sum(map(len, got.values())) < sum(map(len, free.values()))
    assert all(v == free[k][:len(v)] and (len(v) == len(free[k]) or v[-1] == eos) for k, v in got.items())
    assert model.generation_config.repetition_penalty == 3.0      # put back
    # ... and the attention implementation the model came with, not tpool's (session 25: always tpool's)
    model.set_attn_implementation("sdpa")
    engine.reference_tokens(model, reqs()[:1])
    assert model.config._attn_implementation == "sdpa"
    model.set_attn_implementation(engine.ATTN_IMPLEMENTATION)
    # None: neither stops early; an explicit id (or a list) overrides the model's
    assert engine.reference_tokens(model, reqs(), eos_token_id=None) == free
    assert _engine_tokens(model, reqs(), eos_token_id=[eos]) == want
    for bad in ("eos", -1, 1.5, [2, None]):
        with pytest.raises(ValueError, match="eos_token_id: expected 'model' .*got"):
            engine.Engine(model, num_pages=8, page_size=4, max_batch=2, max_pages=4, eos_token_id=bad)
