"""Serving a transformers model on tpool pages: token-identical to generate, logits, sync-free hot path.

Tested with transformers 5.24.0 (the ``tpool[hf]`` extra); skipped without transformers.
"""

import dataclasses
import importlib.util

import pytest
import torch

import tpool
from conftest import i32, requires_cuda

pytest.importorskip("transformers")

from tpool.serving import PagedKVCache, paged_attention, step_metadata  # noqa: E402
from tpool.serving import engine  # noqa: E402
from tpool.testing import no_host_sync, without_logits_to_keep  # noqa: E402
from tpool.serving.hf import ATTN_IMPLEMENTATION, PagedContext, forward_step, paged_attention_forward  # noqa: E402

LOGITS_ATOL = 1e-4  # float32 paged forward vs transformers' eager forward (observed ~1e-5)
# no prefix cache: preempts, forks (with a CoW page), rolls back
SMALL = dict(requests=6, num_pages=16, page_size=4, max_batch=4, system_len=0, prefix_cache=False)
# a system prompt and the prefix cache: hits and evictions too, and still preempts, forks, rolls back
CACHED = dict(requests=10, num_pages=24, page_size=4, max_batch=4, system_len=8)


@pytest.fixture(scope="module")
def models():
    return {name: engine.tiny_model(name, seed=0) for name in engine.MODELS}


@pytest.mark.parametrize("arch", engine.MODELS)
def test_greedy_tokens_identical_to_generate(backend, arch, models):
    if backend == "triton":   # interpreted: one short run keeps the file well under a minute
        if arch != "llama":
            pytest.skip("interpreted Triton: one short run (llama)")
        r = engine.run_demo(arch, backend=backend, out=None, requests=4, num_pages=14, page_size=4, max_batch=4,
                            max_new=(3, 6))
        assert r["mismatches"] == 0 and r["pages_in_use"] == 0 and r["rollbacks"] > 0
        return
    r = engine.run_demo(arch, backend=backend, out=None, **SMALL)   # raises if any request differs
    assert r["mismatches"] == 0 and r["pages_in_use"] == 0
    # The run did what it is meant to check: preemption, a shared prefix, speculative rollback.
    assert r["preemptions"] > 0 and r["forks"] > 0 and r["rollbacks"] > 0 and 0 < r["accepted"] < r["drafted"]
    assert r["tokens"] == sum(q.max_new for q in engine.make_requests(SMALL["requests"], max_new=(4, 16)))


@pytest.mark.parametrize("arch", engine.MODELS)
def test_prefix_cache_hits_give_the_tokens_of_generate(backend, arch, models):
    """Finished and preempted requests' pages kept CACHED, revived by later requests that start with
    the same tokens (the system prompt), evicted when a step needs them: every request still
    matches generate, and the end-of-run check (the prefix cache's own invariants too) holds."""
    if backend == "triton" and arch != "llama":
        pytest.skip("interpreted Triton: one short run (llama)")
    r = engine.run_demo(arch, backend=backend, out=None, **CACHED)
    assert r["mismatches"] == 0 and r["pages_in_use"] == 0 and r["failed_extends"] == 0
    assert r["cache_hits"] > 0 and r["cached_tokens"] >= 8 * r["cache_hits"] and r["evicted"] > 0
    assert r["preemptions"] > 0 and r["forks"] > 0 and r["rollbacks"] > 0


def test_a_preempted_request_revives_the_pages_of_its_output_too(monkeypatch):
    """Pages are keyed by every token they hold, generated ones too: a preempted request, admitted
    again, revives past its prompt (and its tokens still match generate)."""
    take, hits = engine.Engine._take, []

    def spy(self, w, share, hit, *a):
        if hit:
            hits.append((len(w.prompt), len(w.out), hit.n_tokens))
        return take(self, w, share, hit, *a)

    monkeypatch.setattr(engine.Engine, "_take", spy)
    r = engine.run_demo("llama", backend="numba", out=None, system_len=0)   # the demo's pool and requests
    assert r["mismatches"] == 0 and r["preemptions"] > 0
    assert any(n > prompt and out > 0 for prompt, out, n in hits), hits


def test_revived_pages_are_the_ones_the_model_reads(monkeypatch):
    """Zeroing the K/V of the pages a prefix-cache hit revives changes tokens: the hits are used."""
    from tpool.scheduling import PrefixCache
    revive = PrefixCache.revive
    kv = []

    def spoil(self, match, *a, **k):
        row = revive(self, match, *a, **k)
        pages = self.slot_page[list(match.slots)].long()
        for layer in kv[0].k:
            layer[pages] = 0
        return row

    monkeypatch.setattr(PrefixCache, "revive", spoil)
    init = engine.Engine.__init__
    monkeypatch.setattr(engine.Engine, "__init__",
                        lambda self, *a, **k: (init(self, *a, **k), kv.append(self.cache))[0])
    with pytest.raises(AssertionError, match="differ from generate"):
        engine.run_demo("llama", backend="numba", out=None, **CACHED)


class _Unreadable:
    """Stands in for a step's ``ok``: any use of it fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"the loop read a step's ok ({name})")

    def __bool__(self):
        raise AssertionError("the loop read a step's ok")


def test_the_loop_never_reads_a_steps_ok(monkeypatch):
    step = tpool.PageTable.step
    monkeypatch.setattr(tpool.PageTable, "step", lambda self, *a, **k: step(self, *a, **k)._replace(ok=_Unreadable()))
    r = engine.run_demo("llama", backend="numba", out=None, **SMALL)
    assert r["mismatches"] == 0 and r["preemptions"] > 0


def test_a_longer_run_and_the_cli(capsys):
    from tpool.__main__ import main
    assert main(["demo", "--model", "gpt-neox", "--requests", "6", "--num-pages", "16", "--max-batch", "4",
                 "--backend", "numba", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "requests matching generate: 6/6" in out and "pages in use at the end 0" in out
    assert "PagePool(num_pages=16, page_size=4, device=cpu, backend='numba')" in out


def test_skipping_the_copy_on_write_copy_changes_tokens(monkeypatch):
    monkeypatch.setattr(PagedKVCache, "copy_pages", lambda self, src, dst: None)
    with pytest.raises(AssertionError, match="differ from generate"):
        engine.run_demo("llama", backend="numba", out=None, **SMALL)


def _prefill_and_decode(model, prompts, backend, shift=0, steps=4):
    """Greedy decode of ``prompts`` packed in one batch (prefills, then decode steps) on tpool pages.
    ``shift`` adds to the positions the model sees in the decode steps (a deliberate off-by-one: a
    shift of every position alike would change nothing, rotary embeddings being relative)."""
    pool = tpool.PagePool(64, 4, device="cpu", backend=backend)
    table = tpool.PageTable(pool, len(prompts), 16)
    cache = PagedKVCache.from_pool(pool, *engine.kv_shape(model.config),
                                   dtype=torch.float32)
    ids = i32(list(range(len(prompts))))
    feed, toks, logits = [list(p) for p in prompts], [[] for _ in prompts], None
    for s in range(steps):
        ntok = i32([len(f) for f in feed])
        t = sum(len(f) for f in feed)
        res = table.step(ids, ntok, max_tokens=t)
        meta = step_metadata(table, res)
        x = torch.tensor([tok for f in feed for tok in f])
        with torch.no_grad():
            pos = meta.positions.long() + (shift if s else 0)
            out = model(input_ids=x[None], position_ids=pos[None], use_cache=False,
                        tpool_context=PagedContext(cache, meta)).logits[0]
        if s == 0:
            logits = out
        ends = meta.qo_indptr[1:].tolist()
        for i, e in enumerate(ends):
            toks[i].append(int(out[e - 1].argmax()))
        feed = [[tk[-1]] for tk in toks]
    pool_used = pool.stats()["pages.used.current"]
    table.release(ids)
    pool.check()
    assert pool.stats()["pages.used.current"] == 0 and pool_used > 0
    return toks, logits


@pytest.mark.parametrize("arch", engine.MODELS)
def test_logits_of_a_packed_batch_match_eager_within_tolerance(arch, models):
    model = models[arch]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (7, 1, 13)]
    _, logits = _prefill_and_decode(model, prompts, "reference", steps=1)
    model.set_attn_implementation("eager")
    try:
        start = 0
        for p in prompts:
            with torch.no_grad():
                want = model(torch.tensor([p])).logits[0]
            got = logits[start:start + len(p)]
            assert (got - want).abs().max() < LOGITS_ATOL
            start += len(p)
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)


@pytest.mark.parametrize("page_size", [1, 3])
@pytest.mark.parametrize("arch", engine.MODELS)
def test_random_steps_on_reused_pages_match_eager_forwards(arch, page_size, models):
    """Random steps of chunked prefills, decodes and a padding lane, requests released and their pages
    taken by new ones, lanes failing for lack of pages; the pages start as NaN (never-written memory, as
    ``torch.empty`` on a GPU). Every granted lane's logits are eager's over its whole sequence so far: no
    stale or unwritten K/V reaches a request (the NaN reached every token before c0eb309)."""
    import random
    model, rng = models[arch], random.Random(page_size)
    pool = tpool.PagePool(-(-32 // page_size), page_size, device="cpu", backend="reference")
    table = tpool.PageTable(pool, 3, -(-32 // page_size))
    cache = PagedKVCache.from_pool(pool, *engine.kv_shape(model.config), dtype=torch.float32)
    for x in (*cache.k, *cache.v):
        x.fill_(float("nan"))
    seqs, checked, failed = {}, 0, 0   # row -> [its tokens, how many are in the pages]
    for _ in range(12):
        for r in [r for r in seqs if rng.random() < 0.25 or seqs[r][1] == len(seqs[r][0])]:
            table.release(i32([r]))
            del seqs[r]
        for r in range(3):
            if r not in seqs:
                seqs[r] = [[rng.randrange(1, 256) for _ in range(rng.randint(2, 24))], 0]
        lanes = [(r, 1 if done and rng.random() < 0.5 else rng.randint(1, len(toks) - done))
                 for r, (toks, done) in seqs.items()] + [(-1, 0)]
        t = sum(n for _, n in lanes) + 2
        res = table.step(i32([r for r, _ in lanes]), i32([n for _, n in lanes]), max_tokens=t)
        feed = [tok for r, n in lanes if r >= 0 for tok in seqs[r][0][seqs[r][1]:seqs[r][1] + n]]
        with torch.no_grad():
            logits = forward_step(model, torch.tensor(feed + [0] * (t - len(feed))),
                                  PagedContext(cache, step_metadata(table, res)))
        model.set_attn_implementation("eager")
        try:
            at = 0
            for (r, n), ok in zip(lanes, res.ok.tolist()):
                if r >= 0 and ok:
                    seqs[r][1] += n
                    with torch.no_grad():
                        want = model(torch.tensor([seqs[r][0][:seqs[r][1]]])).logits[0, -n:]
                    assert (logits[at:at + n] - want).abs().max() < LOGITS_ATOL
                    checked += n
                failed += r >= 0 and not ok
                at += n
        finally:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
    pool.check()
    cache.check()
    assert checked > 40 and failed > 0


@pytest.mark.parametrize("arch", engine.MODELS)
def test_a_position_off_by_one_changes_tokens(arch, models):
    """The check is sharp: with the initializer range used, a shifted position changes greedy tokens."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (9, 5, 17, 3)]
    right, _ = _prefill_and_decode(models[arch], prompts, "numba")
    wrong, _ = _prefill_and_decode(models[arch], prompts, "numba", shift=1)
    want = engine.reference_tokens(models[arch], [engine.Request(i, p, 4) for i, p in enumerate(prompts)])
    assert right == [want[i] for i in range(len(prompts))]
    assert wrong != right


def test_the_hot_path_has_no_host_sync(backend, models, guard):
    model = models["llama"]
    pool = tpool.PagePool(32, 4, device="cpu", backend=backend)
    table = tpool.PageTable(pool, 4, 8)
    cache = PagedKVCache.from_pool(pool, *engine.kv_shape(model.config), dtype=torch.float32)
    ids, ntok = i32([0, 1, -1]), i32([5, 3, 0])
    x = torch.randint(1, 256, (8,))
    table.step(ids, ntok, max_tokens=8)     # first call of the shape (buffers), outside the guard
    table.release(i32([0, 1]))
    fork = table.fork(i32([0]), i32([1]), i32([0]))
    with guard():
        res = table.step(ids, ntok, max_tokens=8)
        meta = step_metadata(table, res)
        with torch.no_grad():
            logits = forward_step(model, x, PagedContext(cache, meta))   # K/V writes + paged attention, each layer
        out = paged_attention(torch.zeros(8, 4, 16), cache.k[0], cache.v[0], meta)
        cache.copy_pages(fork.cow_src, fork.cow_dst)
    assert logits.shape == (8, 256) and out.shape == (8, 4, 16)
    assert (cache.k[0] != 0).any()
    pool.check()


def test_no_mask_is_built_and_the_context_is_required(models):
    from transformers.masking_utils import create_causal_mask
    model = models["gpt-neox"]
    emb = torch.zeros(1, 5, 64)
    assert create_causal_mask(config=model.config, inputs_embeds=emb, attention_mask=None, cache=None,
                              position_ids=torch.arange(5)[None]) is None
    attn = model.gpt_neox.layers[0].attention
    q = torch.zeros(1, 4, 2, 16)
    with pytest.raises(ValueError, match="GPTNeoXAttention got no tpool_context: pass tpool_context="):
        paged_attention_forward(attn, q, q, q, None)
    with pytest.raises(ValueError, match="expected the forward keyword tpool_context=PagedContext.*got dict"):
        paged_attention_forward(attn, q, q, q, None, tpool_context={})


# ----------------------------------------------------------------- GPU only
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None


@requires_cuda
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FLASHINFER, reason="needs flashinfer")
@pytest.mark.parametrize("decode", [False, True])
def test_flashinfer_matches_reference_attention(decode):
    from tpool.serving import FlashInferAttention
    torch.manual_seed(0)
    dev, ps, hq, hkv, d = "cuda", 16, 8, 2, 128
    pool = tpool.PagePool(256, ps, device=dev, backend="triton")
    table = tpool.PageTable(pool, 8, 32)
    cache = PagedKVCache.from_pool(pool, 1, hkv, d, dtype=torch.float16)
    t32 = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
    pre = table.extend(t32(list(range(4))), t32([37, 5, 100, 16]), max_tokens=158)
    cache.write(0, pre.slots, torch.randn(158, hkv, d, device=dev, dtype=torch.float16),
                torch.randn(158, hkv, d, device=dev, dtype=torch.float16))
    # The mixed batch has a padding lane (no pages: FlashInfer must see a KV length of 0) and
    # rows past its tokens (positions -1: zeros, as from the reference).
    ids = t32([0, 1, 2, 3]) if decode else t32([0, 1, -1, 2, 3])
    ntok = t32([1, 1, 1, 1]) if decode else t32([1, 9, 0, 1, 30])
    t = 4 if decode else 48
    res = table.step(ids, ntok, max_tokens=t)
    meta = step_metadata(table, res)
    cache.write(0, meta.slots, torch.randn(t, hkv, d, device=dev, dtype=torch.float16),
                torch.randn(t, hkv, d, device=dev, dtype=torch.float16))
    q = torch.randn(t, hq, d, device=dev, dtype=torch.float16)
    for window in (None, 24):
        fi = FlashInferAttention(dev)
        fi.plan(meta, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=ps, q_dtype=torch.float16,
                kv_dtype=torch.float16, scale=d ** -0.5, sliding_window=window, decode=decode)
        got = fi.run(q, cache.k[0], cache.v[0])
        want = paged_attention(q, cache.k[0], cache.v[0], meta, scale=d ** -0.5, sliding_window=window)
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_decode_step_and_forward_in_one_cuda_graph_match_eager(backend):
    """forward + step captured once; every decode step of a whole generation is a replay."""
    from tpool.graphs import capture
    dev, n_lanes, steps = "cuda", 4, 24
    model = engine.tiny_model("llama", seed=0).to(dev)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (9, 5, 17, 3)]

    def setup():
        pool = tpool.PagePool(64, 4, device=dev, backend=backend)
        table = tpool.PageTable(pool, n_lanes, 16)
        cache = PagedKVCache.from_pool(pool, *engine.kv_shape(model.config), dtype=torch.float32)
        ids = torch.arange(n_lanes, dtype=torch.int32, device=dev)
        ntok = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=dev)
        total = int(ntok.sum())
        res = table.step(ids, ntok, max_tokens=total)
        meta = step_metadata(table, res)
        x = torch.tensor([t for p in prompts for t in p], device=dev)
        with torch.no_grad():
            logits = forward_step(model, x, PagedContext(cache, meta))
        first = logits[meta.qo_indptr[1:].long() - 1].argmax(-1)
        return pool, table, cache, ids, first

    def decode(table, cache, ids, ones, tok):
        res = table.step(ids, ones)
        meta = step_metadata(table, res)
        with torch.no_grad():
            tok.copy_(forward_step(model, tok, PagedContext(cache, meta)).argmax(-1))

    ones = torch.ones(n_lanes, dtype=torch.int32, device=dev)
    pool_e, table_e, cache_e, ids_e, tok_e = setup()
    eager = [tok_e.clone()]
    for _ in range(steps):
        decode(table_e, cache_e, ids_e, ones, tok_e)
        eager.append(tok_e.clone())
    pool_g, table_g, cache_g, ids_g, tok_g = setup()
    start = tok_g.clone()
    graph = capture(lambda: decode(table_g, cache_g, ids_g, ones, tok_g), table_g)
    tok_g.copy_(start)                        # the warm-up ran the step; its state was restored, the tokens not
    graphed = [tok_g.clone()]
    for _ in range(steps):
        graph.replay()
        graphed.append(tok_g.clone())
    torch.cuda.synchronize()
    assert torch.equal(torch.stack(graphed), torch.stack(eager))
    want = engine.reference_tokens(model.cpu(), [engine.Request(i, p, steps + 1) for i, p in enumerate(prompts)])
    assert torch.stack(eager).T.tolist() == [want[i] for i in range(n_lanes)]
    for p in (pool_e, pool_g):
        p.check()


def test_the_engine_keeps_its_pages_on_the_models_device():
    """Default: the model's device. Another one is refused naming both, before a pool is made
    (the forward would read the K/V pages on the wrong device)."""
    model = engine.tiny_model("llama", seed=0)
    size = dict(num_pages=8, page_size=4, max_batch=2, max_pages=4)
    eng = engine.Engine(model, backend="reference", **size)
    assert eng.pool.device == eng.cache.device == torch.device("cpu")
    assert engine.Engine(model, device="cpu:0", **size).pool.device == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            engine.Engine(model, device="cuda", **size)
    else:
        with pytest.raises(ValueError, match=r"device: expected the model's device cpu .*got 'cuda' \(cuda:0\); "
                                             r"move the model with model.to\('cuda:0'\) first"):
            engine.Engine(model, device="cuda", **size)
    with pytest.raises(ValueError, match=r"model: expected its weights on a cpu or cuda device, got "
                                         r"LlamaForCausalLM on meta \(a model built on the meta device"):
        engine.Engine(engine.tiny_model("llama", seed=0).to("meta"), device="cpu", **size)
    bare = engine.tiny_model("llama", seed=0)
    bare.parameters = lambda recurse=True: iter(())   # (a model whose weights were all taken off)
    with pytest.raises(ValueError, match="model: expected a model with weights, got LlamaForCausalLM without "
                                         "parameters"):
        engine.Engine(bare, **size)


def test_the_model_demo_bounds_the_tokens_of_its_kv_pages(capsys):
    """--page-size had no bound: 10,000,000 tokens a page passed the option checks and failed allocating
    ~125 GB of K/V with a traceback. The pool's tokens (pages x page size) are bounded, before anything is built."""
    from tpool.serving.cli import MAX_POOL_TOKENS, main as serve_main
    with pytest.raises(SystemExit) as e:
        serve_main(["--model", "llama", "--page-size", "10000000", "--requests", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and (f"error: --num-pages x --page-size: expected at most {MAX_POOL_TOKENS:,} tokens "
                                  f"of K/V pages, got 48 x 10,000,000 = 480,000,000") in err, err
    with pytest.raises(SystemExit):
        serve_main(["--model", "llama", "--num-pages", str(MAX_POOL_TOKENS // 4), "--page-size", "5"])
    assert f"got {MAX_POOL_TOKENS // 4:,} x 5 = {MAX_POOL_TOKENS // 4 * 5:,}" in capsys.readouterr().err


def test_the_model_demo_on_cuda_without_cuda_is_an_option_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    from tpool.serving.cli import main as serve_main
    with pytest.raises(SystemExit) as e:
        serve_main(["--model", "llama", "--device", "cuda", "--requests", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "error: --device: expected cpu, got cuda: CUDA is not available" in err, err


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_the_model_demo_on_cuda_matches_generate(backend):
    """The serving demo with the model, the pool and the K/V pages on CUDA: every request's tokens
    equal ``generate``'s on the same device, with preemptions, forks, rollbacks and prefix-cache hits."""
    r = engine.run_demo("llama", backend=backend, device="cuda", out=None, **CACHED)
    assert r["mismatches"] == 0 and r["pages_in_use"] == 0 and r["failed_extends"] == 0
    assert r["cache_hits"] > 0 and r["preemptions"] > 0 and r["forks"] > 0 and r["rollbacks"] > 0


def test_bench_e2e_prints_its_table(tmp_path, capsys):
    import importlib.util as iu
    import json
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_e2e.py")
    spec = iu.spec_from_file_location("bench_e2e", path)
    mod = iu.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "e2e.json"
    mod.main(["--batch", "2", "3", "--samples", "3", "--inner", "2", "--prompt", "5", "--hidden", "32",
              "--layers", "1", "--heads", "4", "--vocab", "64", "--json", str(out)])
    captured = capsys.readouterr()
    text = captured.out
    assert "decode step, end to end" in text and "tpool share" in text and "p20 / p80" in text
    assert "tpool loop" not in text and "B=3: tpool loop" in captured.err  # progress on stderr, not in the table
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [2, 3]
    assert all(r["tokens_per_s"] > 0 and 0 < r["tpool_share"] < 1 and r["baseline_tokens_per_s"] > 0 for r in rows)


def test_a_sliding_window_model_matches_generate_and_the_window_matters(monkeypatch):
    """Mistral passes ``sliding_window`` to the attention function; prompts are longer than the window.
    (Served without it, with the check that refuses a window only generate's cache keeps switched off,
    the tokens differ.)"""
    from transformers import AttentionInterface, MistralConfig, MistralForCausalLM
    from tpool.serving import hf
    cfg = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.25,
                        sliding_window=6, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = MistralForCausalLM._from_config(cfg, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None

    def serve():
        eng = engine.Engine(model, num_pages=16, page_size=4, max_batch=4, max_pages=20, backend="reference")
        return eng.run(engine.make_requests(6, max_new=(4, 10)))

    want = engine.reference_tokens(model, engine.make_requests(6, max_new=(4, 10)))
    assert serve() == want
    monkeypatch.setattr(hf, "_refuse_window_in_cache_only", lambda module, layer: None)
    AttentionInterface.register(ATTN_IMPLEMENTATION, lambda *a, **k: hf.paged_attention_forward(
        *a, **{**k, "sliding_window": None}))
    try:
        without = serve()
    finally:
        hf.register()
    assert without != want


# ------------------------------------------- other models' attention options
def _other_model(name):
    """A tiny random-weight model of an architecture whose attention takes options Llama's does not."""
    import transformers
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, initializer_range=0.25, max_position_embeddings=512)
    cfg = {  # each with a window shorter than the sequences, on its first layer only (hybrid)
        # passes sliding_window on every layer, None on its full layers; sets module.sliding_window on all
        "exaone4": lambda: transformers.Exaone4Config(sliding_window=4, layer_types=["sliding_attention",
                                                                                     "full_attention"], **common),
        # passes no sliding_window; sets module.sliding_window on its sliding layers only
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(use_sliding_window=True, sliding_window=4,
                                                         max_window_layers=2, num_experts=4, num_experts_per_tok=2,
                                                         moe_intermediate_size=32,
                                                         shared_expert_intermediate_size=32, **common),
        # passes softcap (attn_logit_softcapping) and its window
        "gemma2": lambda: transformers.Gemma2Config(sliding_window=4, attn_logit_softcapping=5.0,
                                                    final_logit_softcapping=None, **common),
        # passes s_aux (attention sinks, one logit per query head) and its window
        "gpt_oss": lambda: transformers.GptOssConfig(sliding_window=4, num_local_experts=4, num_experts_per_tok=2,
                                                     **common),
        # passes no sliding_window and keeps none: its mask alone applies the config's, on every layer
        "phimoe": lambda: transformers.PhimoeConfig(sliding_window=4, num_local_experts=4, num_experts_per_tok=2,
                                                    **{k: v for k, v in common.items() if k != "head_dim"}),
    }[name]()
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=ATTN_IMPLEMENTATION,
                                                         dtype=torch.float32).eval()


def _paged_logits(model, seqs, schedule, max_tokens=16):
    """Each sequence's logits from packed steps on tpool pages; ``schedule``: per step, (seq, n) lanes."""
    pool = tpool.PagePool(64, 4, device="cpu", backend="reference")
    table = tpool.PageTable(pool, len(seqs), 16)
    cache = PagedKVCache.from_pool(pool, *engine.kv_shape(model.config), dtype=torch.float32)
    done, out = [0] * len(seqs), [[] for _ in seqs]
    for lanes in schedule:
        x = torch.zeros(max_tokens, dtype=torch.long)
        toks = [t for r, n in lanes for t in seqs[r][done[r]:done[r] + n]]
        x[:len(toks)] = torch.tensor(toks)
        meta = step_metadata(table, table.step(i32([r for r, _ in lanes]), i32([n for _, n in lanes]),
                                               max_tokens=max_tokens))
        with torch.no_grad():
            logits = forward_step(model, x, PagedContext(cache, meta))
        start = 0
        for r, n in lanes:
            out[r].append(logits[start:start + n])
            start, done[r] = start + n, done[r] + n
    return [torch.cat(o) for o in out]


@pytest.mark.parametrize("name", ["exaone4", "qwen2_moe", "gemma2", "gpt_oss", "phimoe"])
def test_other_models_attention_options_match_eager(name):
    """Prefill and decode lanes mixed, sequences longer than the window: every layer attends as
    transformers' eager attention does (a full layer of a hybrid model gets no window; a window
    only the module's attribute gives still applies; softcap; sinks; PhiMoE's window, which only
    its mask applied, was left out: full attention, silently)."""
    model = _other_model(name)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (14, 13, 4)]
    schedule = [[(0, 11), (1, 3)], [(0, 1), (1, 9), (2, 3)], [(0, 1), (1, 1), (2, 1)], [(0, 1)]]
    got = _paged_logits(model, seqs, schedule)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        for s, g_ in zip(seqs, got):
            want = model(torch.tensor([s])).logits[0]
            assert (g_ - want).abs().max() < LOGITS_ATOL


@pytest.mark.parametrize("kwargs, match", [
    (dict(attention_mask=torch.zeros(1, 1, 8, 8)), r"attention_mask: expected None .*got a mask of shape "
                                                  r"\(1, 1, 8, 8\)"),
    (dict(is_causal=False), "is_causal: expected True .*got False"),
    (dict(position_bias=torch.zeros(1)), "position_bias: expected None, got Tensor"),
    (dict(sinks=torch.zeros(4)), "sinks: expected None, got Tensor"),
])
def test_attention_keywords_that_change_the_result_are_refused_naming_the_model(models, kwargs, match):
    model = models["llama"]
    pool = tpool.PagePool(8, 4, device="cpu", backend="reference")
    table = tpool.PageTable(pool, 2, 2)
    cache = PagedKVCache.from_pool(pool, *engine.kv_shape(model.config), dtype=torch.float32)
    ctx = PagedContext(cache, step_metadata(table, table.step(i32([0]), i32([8]), max_tokens=8)))
    attn, q, kv = model.model.layers[0].self_attn, torch.zeros(1, 4, 8, 16), torch.zeros(1, 2, 8, 16)
    with pytest.raises(ValueError, match=f"tpool_paged: {match} from LlamaAttention"):
        paged_attention_forward(attn, q, kv, kv, tpool_context=ctx, **kwargs)
    attn.train()
    try:
        with pytest.raises(ValueError, match="dropout: expected 0.0 in training .*got 0.1 from LlamaAttention"):
            paged_attention_forward(attn, q, kv, kv, dropout=0.1, tpool_context=ctx)
    finally:
        attn.eval()
    assert paged_attention_forward(attn, q, kv, kv, dropout=0.1, is_causal=True, tpool_context=ctx)[0].shape == \
        (1, 8, 4, 16)                         # dropout outside training changes nothing (eager's rule)


def test_a_cache_of_another_page_size_or_count_is_refused(models):
    """A cache whose pages are not the table's pool's would be read at the wrong slots, silently."""
    model = models["llama"]
    layers, heads, dim = engine.kv_shape(model.config)
    table = tpool.PageTable(tpool.PagePool(32, 4, device="cpu", backend="reference"), 2, 8)
    meta = step_metadata(table, table.step(i32([0, 1]), i32([3, 5]), max_tokens=8))
    for pages, size in ((16, 8), (24, 4)):
        cache = PagedKVCache(layers, pages, size, heads, dim, dtype=torch.float32, device="cpu")
        with pytest.raises(ValueError, match=f"cache: expected 32 pages of 4 tokens .*got {pages} pages of {size}"):
            PagedContext(cache, meta)


def test_forward_step_refuses_input_ids_not_padded_to_max_tokens(models):
    pool = tpool.PagePool(32, 4, device="cpu", backend="reference")
    table = tpool.PageTable(pool, 2, 8)
    cache = PagedKVCache.from_pool(pool, *engine.kv_shape(models["llama"].config), dtype=torch.float32)
    ctx = PagedContext(cache, step_metadata(table, table.step(i32([0, 1]), i32([3, 2]), max_tokens=8)))
    with pytest.raises(ValueError, match=r"input_ids: expected shape \(8,\), the step's max_tokens \(pad "
                                         r"input_ids to it.*got \(5,\)"):
        forward_step(models["llama"], torch.arange(5), ctx)        # the 5 real tokens only
    with pytest.raises(ValueError, match=r"got \(1, 8\)"):
        forward_step(models["llama"], torch.arange(8)[None], ctx)
    assert forward_step(models["llama"], torch.arange(8), ctx).shape == (8, 256)


def test_a_slot_outside_the_cache_is_counted_once_per_forward_and_raised_by_the_check(models):
    """Slots a caller made outside the cache went to the scratch page unseen; forward_step counts them once
    for all layers (their write destinations are made once per forward) and the cache's check raises."""
    model = models["llama"]
    pool = tpool.PagePool(32, 4, device="cpu", backend="reference")
    table = tpool.PageTable(pool, 2, 8)
    cache = PagedKVCache.from_pool(pool, *engine.kv_shape(model.config), dtype=torch.float32)
    meta = step_metadata(table, table.step(i32([0, 1]), i32([3, 2]), max_tokens=8))
    bad = dataclasses.replace(meta, slots=torch.where(meta.slots == 4, 200, meta.slots).to(torch.int32))
    with torch.no_grad():
        forward_step(model, torch.arange(8), PagedContext(cache, bad))
    assert cache.num_layers == 2 and not cache.k[0].reshape(-1, *cache.k[0].shape[2:])[4].any()
    with pytest.raises(tpool.InvalidPage, match="invalid_slot: 1") as e:
        cache.check()
    assert e.value.counts == {"invalid_slot": 1}
    with torch.no_grad():                       # the table's own slots: nothing counted
        forward_step(model, torch.arange(8), PagedContext(cache, meta))
    cache.check()
    pool.check()


def _tiny(kind, **extra):
    """A tiny random-weight transformers model of model type ``kind`` on tpool_paged attention."""
    import transformers
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, initializer_range=0.25, max_position_embeddings=512,
                  eos_token_id=None, bos_token_id=None, pad_token_id=0)
    cfg = transformers.AutoConfig.for_model(kind, **{**common, **extra})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=ATTN_IMPLEMENTATION,
                                                         dtype=torch.float32).eval()


def _step_context(config, lanes=(5, 3), max_tokens=8, num_pages=16, max_pages=4, kv_shape=None):
    """A PagedContext of one prefill step of ``lanes`` tokens on fresh reference pages of 4 tokens, its
    cache of ``kv_shape`` (``(layers, kv_heads, head_dim)``; the config's by default)."""
    pool = tpool.PagePool(num_pages, 4, device="cpu", backend="reference")
    table = tpool.PageTable(pool, len(lanes), max_pages)
    cache = PagedKVCache.from_pool(pool, *(kv_shape or engine.kv_shape(config)), dtype=torch.float32)
    meta = step_metadata(table, table.step(i32(list(range(len(lanes)))), i32(list(lanes)), max_tokens=max_tokens))
    return PagedContext(cache, meta)


def _one_step(model):
    """One prefill step of two lanes through forward_step; returns the cache (its layer 0 K)."""
    ctx = _step_context(model.config)
    with torch.no_grad():
        forward_step(model, torch.randint(1, 256, (8,)), ctx)
    return ctx.cache


def test_forward_step_refuses_a_model_whose_layers_do_not_all_attend_through_the_pages(models):
    """Another attention implementation takes the tpool_context keyword silently and attends over the packed
    row (lanes see each other, no K/V lands in a page); so does a model whose attention does not dispatch
    through AttentionInterface (XGLM: no layer ran here). Both were silent wrong logits."""
    model = engine.tiny_model("llama", seed=0)
    assert _one_step(model).k[0].abs().sum() > 0  # (the check passes a model that does attend here)
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="model: expected attn_implementation='tpool_paged' .*got 'sdpa' from llama"):
        _one_step(model)
    import transformers
    cfg = transformers.XGLMConfig(vocab_size=256, d_model=64, ffn_dim=128, num_layers=2, attention_heads=4,
                                  pad_token_id=0)
    xglm = transformers.XGLMForCausalLM._from_config(cfg, attn_implementation=ATTN_IMPLEMENTATION).eval()
    with pytest.raises(ValueError, match="model: expected all 2 layers to attend through tpool_paged, got 0 "
                                         r"\(XGLMForCausalLM"):
        _one_step(xglm)


@pytest.mark.parametrize("kind, extra, match", [
    ("qwen3_next", dict(layer_types=["linear_attention", "full_attention"], num_experts=2, num_experts_per_tok=1,
                        moe_intermediate_size=32, shared_expert_intermediate_size=32),
     "got linear_attention in qwen3_next"),
    ("lfm2", dict(layer_types=["conv", "full_attention"]), "got conv in lfm2"),
    ("llama4_text", dict(attention_chunk_size=8, no_rope_layers=[1, 1], attn_temperature_tuning=False,
                         num_local_experts=2, intermediate_size_mlp=128), "got chunked_attention in llama4_text"),
])
def test_layers_whose_state_or_mask_the_pages_do_not_hold_are_refused(kind, extra, match):
    """A recurrent, convolution or linear-attention layer keeps state outside the pages, and Llama4's chunks
    live only in a mask this implementation does not build: a packed step gave other tokens (6 of 6
    requests differed from generate), silently."""
    import transformers
    if kind not in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {kind}")
    with pytest.raises(ValueError, match=f"model: expected only full_attention and sliding_attention layers .*{match}"):
        _one_step(_tiny(kind, **extra))


def test_llama4_without_chunks_or_temperature_tuning_runs_and_with_tuning_is_refused():
    """Llama4 scales a NoPE layer's queries by each token's index in the packed row (transformers'
    attn_temperature_tuning), not its position: refused; a chunk spanning every position is full attention."""
    extra = dict(attention_chunk_size=512, num_local_experts=2, intermediate_size_mlp=128, num_hidden_layers=2)
    assert _one_step(_tiny("llama4_text", no_rope_layers=[1, 1], attn_temperature_tuning=False, **extra)
                     ).k[1].abs().sum() > 0
    with pytest.raises(ValueError, match="attn_temperature_tuning: expected False on a layer without rope"):
        _one_step(_tiny("llama4_text", no_rope_layers=[1, 0], attn_temperature_tuning=True, floor_scale=4, **extra))


def _llama_context():
    """The tiny llama's first attention module, a prefill step's context on fresh pages, q and K/V."""
    model = engine.tiny_model("llama", seed=0)
    ctx = _step_context(model.config, lanes=(8,), num_pages=8, max_pages=2)
    torch.manual_seed(0)
    return model.model.layers[0].self_attn, ctx, torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)


def test_llama4_temperature_tuning_on_rope_layers_only_is_served():
    """Llama4's attn_temperature_tuning scales the queries of its NoPE layers only: a model whose layers
    all use rope, tuning on, runs (only a NoPE layer with tuning is refused)."""
    extra = dict(attention_chunk_size=512, num_local_experts=2, intermediate_size_mlp=128, num_hidden_layers=2)
    cache = _one_step(_tiny("llama4_text", no_rope_layers=[1, 1], attn_temperature_tuning=True, floor_scale=4,
                            **extra))
    assert cache.k[1].abs().sum() > 0


def test_a_module_without_an_is_causal_attribute_attends_causally():
    """``is_causal=None`` reads the module's ``is_causal``; a module without one is causal (as transformers'
    sdpa takes it), not refused."""
    attn, ctx, q, kv = _llama_context()

    class Bare(torch.nn.Module):   # an attention module with a layer_idx and nothing else
        layer_idx = 0

    bare = Bare().eval()
    assert not hasattr(bare, "is_causal")
    got = paged_attention_forward(bare, q, kv, kv, scaling=0.25, tpool_context=ctx)[0]
    ctx.layers.clear()
    want = paged_attention_forward(attn, q, kv, kv, scaling=0.25, is_causal=True, tpool_context=ctx)[0]
    assert got.shape == (1, 8, 4, 16) and torch.equal(got, want)


def test_unsupported_attention_keywords_passed_as_none_are_accepted():
    """``position_bias``, ``sinks``, ... are refused only when given: a model passing them as None (not in
    use) is served."""
    attn, ctx, q, kv = _llama_context()
    out = paged_attention_forward(attn, q, kv, kv, position_bias=None, sinks=None, indices=None,
                                  cu_seq_lens_q=None, tpool_context=ctx)[0]
    assert out.shape == (1, 8, 4, 16)


def test_a_cache_of_another_head_dim_is_refused_naming_both():
    """K/V whose head_dim is not the cache's is refused before any write, naming the module's heads and
    head_dim and the cache's (as for another K/V head count)."""
    attn, ctx, q, kv = _llama_context()
    bad = _step_context(None, lanes=(8,), num_pages=8, max_pages=2, kv_shape=(2, 2, 8))   # the model's is 16
    cache = bad.cache
    with pytest.raises(ValueError, match=r"tpool_paged: cache: expected K/V of 2 heads of head_dim 16 \(what "
                                         r"LlamaAttention, layer 0, attends with\), the cache holds 2 heads of 8"):
        paged_attention_forward(attn, q, kv, kv, tpool_context=bad)
    assert cache.k[0].abs().sum() == 0 and not bad.layers


def test_the_attention_output_has_the_querys_dtype_whatever_attend_returns():
    """The layer gets its output in the query's dtype, as eager attention gives it, also from an ``attend``
    that computes in another dtype."""
    attn, ctx, q, kv = _llama_context()
    wide = PagedContext(ctx.cache, ctx.meta,
                        attend=lambda q, k, v, meta, **kw: torch.ones(q.shape, dtype=torch.float64))
    out = paged_attention_forward(attn, q, kv, kv, tpool_context=wide)[0]
    assert out.dtype == q.dtype == torch.float32 and out.shape == (1, 8, 4, 16)


def test_check_model_checks_again_a_config_put_on_a_checked_model():
    """The checks are kept per model and config: a config put on an already checked model (here one
    whose rope frequencies depend on the row's longest position) is checked, and refused."""
    import copy

    from tpool.serving.hf import check_model
    model = engine.tiny_model("llama", seed=0)
    assert check_model(model) is model.config
    cfg = copy.deepcopy(model.config)
    cfg.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model.config = cfg
    with pytest.raises(ValueError, match="expected a rope_type whose frequencies are fixed .*got rope_parameters "
                                         "rope_type 'dynamic' in llama's config"):
        check_model(model)


def test_a_composite_model_is_checked_on_its_text_decoders_attention_implementation():
    """A composite model (Llava: a vision tower and a Llama) names an attention implementation per
    sub-config: the text decoder's is the one that serves the step. Refused when only the top-level
    config names tpool_paged, accepted when the text config does (whatever the vision tower uses)."""
    import transformers

    from tpool.serving.hf import check_model
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=32, patch_size=16)
    text = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0)
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=255)

    def build(text_impl, top_impl):
        impl = {"text_config": text_impl, "vision_config": "eager", "": top_impl}
        return transformers.LlavaForConditionalGeneration._from_config(cfg, attn_implementation=impl)
    with pytest.raises(ValueError, match="model: expected attn_implementation='tpool_paged' .*got 'eager' from llama"):
        check_model(build("eager", ATTN_IMPLEMENTATION))
    model = build(ATTN_IMPLEMENTATION, "eager")
    assert check_model(model) is model.config.get_text_config(decoder=True)


def test_int32_input_ids_give_the_logits_of_int64():
    """forward_step takes int32 token ids as well as int64."""
    model = engine.tiny_model("llama", seed=0)
    x = torch.randint(1, 256, (8,))
    ctx = _step_context(model.config)
    with torch.no_grad():
        want = forward_step(model, x, ctx)
        got = forward_step(model, x.to(torch.int32), PagedContext(ctx.cache, ctx.meta))
    assert torch.equal(got, want)


def test_padding_positions_reach_a_learned_position_table_as_zero():
    """Padding has position -1 in the metadata; the model sees 0 there, so a learned position table
    (GPT-2's) is never indexed at -1: a step with padding runs and its lanes' logits are those without."""
    import transformers
    cfg = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                  initializer_range=0.25, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation=ATTN_IMPLEMENTATION).eval()
    x = torch.randint(3, 256, (8,))

    def logits(lanes, max_tokens):
        with torch.no_grad():
            return forward_step(model, x[:max_tokens], _step_context(model.config, lanes, max_tokens))[:sum(lanes)]

    padded, whole = logits((5, 2), 8), logits((5, 2), 7)
    assert (padded - whole).abs().max() < 1e-5


# ------------------------------------------- logits_to_keep: the logits of the tokens read, only
def _no_keep_llama():
    """The engine's tiny Llama, as a class whose forward does not name ``logits_to_keep``."""
    from transformers import LlamaForCausalLM

    model = engine.tiny_model("llama", seed=0)
    model.__class__ = without_logits_to_keep(LlamaForCausalLM)
    return model


@pytest.mark.parametrize("kind", ["llama", "gpt-neox", "gemma2", "no-logits-to-keep"])
def test_forward_step_computes_only_the_kept_tokens_logits_the_rows_of_the_full_ones(models, kind):
    """With ``logits_to_keep`` a model whose forward takes it runs its LM head on the kept tokens only, and
    the rows are those of the full logits, in the order asked, repeats allowed; a model whose forward does
    not name it computes every token's logits, indexed after."""
    from tpool.serving.hf import takes_logits_to_keep
    model = {"gemma2": lambda: _tiny("gemma2", sliding_window=4, attn_logit_softcapping=5.0,
                                     final_logit_softcapping=3.0),
             "no-logits-to-keep": _no_keep_llama}.get(kind, lambda: models[kind])()
    takes = kind != "no-logits-to-keep"
    assert takes_logits_to_keep(model) is takes
    ctx = _step_context(model.config, lanes=(5, 3, 2), max_tokens=16)
    x = torch.randint(1, 256, (16,), generator=torch.Generator().manual_seed(0))
    heads = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, o: heads.append(i[0].shape[1]))
    keep = torch.tensor([4, 7, 9, 0, 0, 4])                    # each lane's last token, padding rows, a repeat
    try:
        with torch.no_grad():
            full = forward_step(model, x, ctx)
            kept = forward_step(model, x, ctx, logits_to_keep=keep)
    finally:
        hook.remove()
    assert full.shape == (16, 256) and kept.shape == (6, 256)
    assert heads == [16, 6 if takes else 16]                    # the LM head's rows: the kept ones only
    # (6 rows: MKL rounds rows 5-6 ~1e-6 apart at 2 threads, the BLAS's choice: see Engine.logits_rows)
    torch.testing.assert_close(kept, full[keep], rtol=0, atol=1e-5)
    with torch.no_grad():                                       # int32 indices: the same rows
        assert torch.equal(forward_step(model, x, ctx, logits_to_keep=keep.int()), kept)


@pytest.mark.parametrize("kind", ["llama", "no-logits-to-keep"])
def test_forward_step_counts_logits_to_keep_indices_outside_the_step_and_reads_no_row_outside(models, kind):
    """An index outside ``[0, T)`` (negative ones too: torch would wrap them) is not a host check (it would read
    a device value) nor an IndexError midway (a device-side assert on a GPU): it is counted on the device,
    raised by the cache's check() as InvalidPage naming it, and its row holds token 0's logits."""
    model = {"no-logits-to-keep": _no_keep_llama}.get(kind, lambda: models[kind])()
    ctx = _step_context(model.config)
    x = torch.arange(8)
    keep = torch.tensor([7, 8, -1, 3, 1 << 40])
    with torch.no_grad():
        full = forward_step(model, x, ctx)
        with no_host_sync():
            kept = forward_step(model, x, ctx, logits_to_keep=keep)
    torch.testing.assert_close(kept, full[[7, 0, 0, 3, 0]], rtol=0, atol=1e-5)
    with pytest.raises(tpool.InvalidPage, match=r"invalid_logits_row: 3\. Each is a logits_to_keep index outside "
                                          r"\[0, T\) \(the step's max_tokens\) given to forward_step: its row "
                                          r"holds token 0's logits") as info:
        ctx.cache.check()
    assert info.value.counts == {"invalid_logits_row": 3}
    ctx.cache.check()                                            # taken off the counters: raised once
    forward_step(model, x, ctx, logits_to_keep=torch.tensor([0, 7], dtype=torch.int32))
    ctx.cache.check()                                            # indices of the step count nothing


def test_forward_step_refuses_logits_to_keep_that_are_not_token_indices_and_a_model_ignoring_them(models):
    from transformers import LlamaForCausalLM
    model = models["llama"]
    ctx = _step_context(model.config)
    for bad, got in ((1, "got 1"), (torch.tensor([[0, 1]]), r"got torch.int64 of shape \(1, 2\)"),
                     (torch.tensor([0.0]), "got torch.float32"),
                     (torch.tensor(4), r"got torch.int64 of shape \(\) on cpu"),      # 0-d: one row, no [K] dim
                     (torch.tensor([4], device="meta"), r"got torch.int64 of shape \(1,\) on meta")):
        with pytest.raises(ValueError, match=r"logits_to_keep: expected None \(every token's logits\) or a 1-D int64 "
                                             r"\(or int32\) tensor of token indices in \[0, 8\) on cpu .*" + got):
            forward_step(model, torch.arange(8), ctx, logits_to_keep=bad)

    class AllRows(LlamaForCausalLM):   # names logits_to_keep, returns every token's logits
        def forward(self, input_ids=None, position_ids=None, logits_to_keep=0, **kwargs):
            return super().forward(input_ids=input_ids, position_ids=position_ids, **kwargs)

    other = engine.tiny_model("llama", seed=0)
    other.__class__ = AllRows
    with pytest.raises(ValueError, match="model: expected logits of the 2 tokens logits_to_keep names, got 8 rows "
                                         "from AllRows"), torch.no_grad():
        forward_step(other, torch.arange(8), ctx, logits_to_keep=torch.tensor([4, 7]))
