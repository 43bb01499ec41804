"""Benchmark: a transformers decode loop on tpool pages, end to end, on one torch thread.

A random-weight Llama (grouped-query attention) decodes B requests at once:
each step is ``table.step`` (one token per lane: pages, slots, CSR), the step
metadata (positions, qo_indptr, kv_lens: written by the step itself, so this
part only packs them), the model forward through the ``tpool_paged`` attention function (K/V
writes + reference paged attention in every layer) and greedy sampling (the
step's host read). Reported: tokens/s, the share of step time spent in tpool
calls (step + metadata) against the forward, each part's median. Baseline in
the same run: the same model with transformers' own eager attention and
``DynamicCache`` (contiguous K/V per layer, no pages), batched decode of the
same prompts, the two loops taking turns sample by sample; ratio = tpool
tokens/s over baseline tokens/s. Each sample times ``--inner`` decode steps,
then rolls the requests back to their prompts (``truncate``; the baseline crops
its cache), so every sample times the same workload.

    python benchmarks/bench_e2e.py [--batch 4 32] [--samples 30] [--inner 8] [--json out.json]
"""

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import (Distinct, HelpFormatter, check_backends, check_model, out_path, positive_int,  # noqa: E402
                     in_turns, need_transformers, print_table, progress, quantiles, serving_hf,
                     write_json)

import tpool  # noqa: E402
from tpool.serving import PagedKVCache, step_metadata  # noqa: E402


POSITIONS = 4096   # the model's max_position_embeddings (tokens)
# Decode steps of the untimed first sample, at least: table.step binds its inputs on its second call on them
# (~20 ms on 2 cores), which with --inner 1 landed in the first timed sample.
WARMUP_STEPS = 3


def build_model(hidden, layers, heads, kv_heads, vocab, seed=0, initializer_range=None):
    """A random Llama from a config (nothing downloaded) on ``tpool_paged`` attention; ``initializer_range``
    the weights' spread (default transformers')."""
    from transformers import LlamaConfig, LlamaForCausalLM
    spread = {} if initializer_range is None else dict(initializer_range=initializer_range)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                      max_position_embeddings=POSITIONS, eos_token_id=None, bos_token_id=None, pad_token_id=0,
                      **spread)
    torch.manual_seed(seed)
    return LlamaForCausalLM._from_config(cfg, attn_implementation=serving_hf().ATTN_IMPLEMENTATION,
                                         dtype=torch.float32).eval()


def run_tpool(model, prompts, a):
    """Per sample: (step, tpool, forward, table.step, metadata) seconds per decode step, means over ``inner``."""
    return list(tpool_samples(model, prompts, a))


def run_baseline(prompts, model, a):
    """transformers' eager attention + DynamicCache, batched decode of the same prompts: seconds per decode step,
    one per sample."""
    return list(baseline_samples(prompts, model, a))


def tpool_samples(model, prompts, a):
    """:func:`run_tpool`'s samples one at a time (the untimed first sample made before the first), so that
    ``main`` can take turns with the baseline; the pool is checked after the last."""
    hf = serving_hf()
    forward_step, PagedContext = hf.forward_step, hf.PagedContext
    b, plen = len(prompts), len(prompts[0])
    max_pages = -(-(plen + max(a.inner, WARMUP_STEPS) + 1) // a.page_size)
    pool = tpool.PagePool(b * max_pages + 1, a.page_size, device="cpu", backend=a.backend)
    table = tpool.PageTable(pool, b, max_pages)
    cfg = model.config
    cache = PagedKVCache.from_pool(pool, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                   dtype=torch.float32)
    ids = torch.arange(b, dtype=torch.int32)
    ones = torch.ones(b, dtype=torch.int32)
    prompt_ntok = torch.full((b,), plen, dtype=torch.int32)
    with torch.no_grad():
        res = table.step(ids, prompt_ntok, max_tokens=b * plen)
        logits = forward_step(model, prompts.flatten(), PagedContext(cache, step_metadata(table, res)))
        first = logits[plen - 1::plen].argmax(-1)
    lens = torch.full((b,), plen, dtype=torch.int32)
    for s in range(a.samples + 1):                      # sample 0 is a warm-up
        tok = first.clone()
        t_tp = t_fw = t_st = 0.0
        t0 = time.perf_counter()
        for _ in range(a.inner if s else max(a.inner, WARMUP_STEPS)):
            ta = time.perf_counter()
            res = table.step(ids, ones)
            tm = time.perf_counter()
            meta = step_metadata(table, res)
            tb = time.perf_counter()
            with torch.no_grad():
                nxt = forward_step(model, tok, PagedContext(cache, meta)).argmax(-1)
            tok = torch.tensor(nxt.tolist())                # the step's host read (sampled tokens)
            t_tp += tb - ta
            t_st += tm - ta
            t_fw += time.perf_counter() - tb
        total = time.perf_counter() - t0
        table.truncate(ids, lens)                           # back to the prompts: same workload each sample
        if s:
            yield (total / a.inner, t_tp / a.inner, t_fw / a.inner, t_st / a.inner, (t_tp - t_st) / a.inner)
    pool.check()


def baseline_samples(prompts, model, a):
    """:func:`run_baseline`'s samples one at a time. The model attends eagerly, under ``no_grad``, only inside a
    sample (and the prefill): at each yield it is back on ``tpool_paged`` and grad mode is as the caller had it,
    so the tpool loop's turn in between runs as it would alone (a ``no_grad`` held across the yields ran the
    tpool loop's table.step and metadata with grad off from its second sample on, and not in its first)."""
    from transformers import DynamicCache
    b, plen = prompts.shape
    tpool_attention = serving_hf().ATTN_IMPLEMENTATION

    @contextlib.contextmanager
    def eager():
        with torch.no_grad():
            model.set_attn_implementation("eager")
            try:
                yield
            finally:
                model.set_attn_implementation(tpool_attention)

    cache = DynamicCache(config=model.config)
    with eager():
        first = model(prompts, cache=cache, use_cache=True).logits[:, -1].argmax(-1)
    for s in range(a.samples + 1):
        tok = first[:, None]
        steps = a.inner if s else max(a.inner, WARMUP_STEPS)  # (the same warm-up as the tpool loop)
        with eager():
            t0 = time.perf_counter()
            for i in range(steps):
                pos = torch.full((b, 1), plen + i)
                out = model(tok, cache=cache, position_ids=pos, use_cache=True)
                tok = torch.tensor(out.logits[:, -1].argmax(-1).tolist())[:, None]
            total = time.perf_counter() - t0
        cache.crop(-steps)                             # drop the decoded tokens
        if s:
            yield total / a.inner


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter,
                                 epilog="Progress goes to stderr: the model's build, then each batch size's tpool "
                                        "loop and its baseline (transformers' eager attention and DynamicCache, "
                                        "the same prompts), taking turns sample by sample; the ratio is tpool's "
                                        "tokens/s over the baseline's.")
    ap.add_argument("--batch", type=positive_int, nargs="+", action=Distinct,
                    default=[4, 32], help="requests decoding at once (B)")
    ap.add_argument("--prompt", type=positive_int, default=64, help="prompt tokens per request")
    ap.add_argument("--page-size", type=positive_int, default=16, help="tokens per page")
    ap.add_argument("--hidden", type=positive_int, default=256, help="model hidden size")
    ap.add_argument("--layers", type=positive_int, default=4, help="decoder layers")
    ap.add_argument("--heads", type=positive_int, default=8, help="query heads: divide --hidden into even head sizes")
    ap.add_argument("--kv-heads", type=positive_int, default=2, help="key/value heads (grouped-query): divide --heads")
    ap.add_argument("--vocab", type=positive_int, default=1024, help="vocabulary size, at least 2")
    ap.add_argument("--samples", type=positive_int, default=30,
                    help="samples per batch size (median, p20/p80 over them)")
    ap.add_argument("--inner", type=positive_int, default=8, help="decode steps per sample")
    ap.add_argument("--backend", default="numba", help="pool backend (the pool is on the CPU)")
    ap.add_argument("--threads", type=positive_int, default=1, help="torch threads (more stall on a 2-core machine)")
    ap.add_argument("--json", type=out_path, default=None, metavar="PATH", help="write the rows as JSON to this path")
    return ap


def main(argv=None):
    ap = parser()
    a = ap.parse_args(argv)
    check_model(ap, a)
    held = a.prompt + max(a.inner, WARMUP_STEPS)        # tokens a request holds after a sample's decode steps
    if held > POSITIONS:
        ap.error(f"argument --prompt: a request would hold {held} tokens (--prompt {a.prompt} + "
                 f"{max(a.inner, WARMUP_STEPS)} decoded), past the model's {POSITIONS} positions")
    check_backends(ap, "--backend", [a.backend], "cpu")
    need_transformers(ap)
    torch.set_num_threads(a.threads)
    progress(f"building a random Llama {a.layers}x{a.hidden} (importing transformers) ...")
    model = build_model(a.hidden, a.layers, a.heads, a.kv_heads, a.vocab)
    rows = []
    for b in a.batch:
        prompts = torch.randint(1, a.vocab, (b, a.prompt), generator=torch.Generator().manual_seed(b))
        progress(f"B={b}: tpool loop and baseline (eager + DynamicCache), taking turns sample by sample ...")
        tp, base = in_turns([tpool_samples(model, prompts, a), baseline_samples(prompts, model, a)], a.samples)
        step, p20, p80 = quantiles([s[0] for s in tp])
        share = statistics.median(s[1] / s[0] for s in tp)
        tpool_us = statistics.median(s[1] for s in tp) * 1e6
        step_us = statistics.median(s[3] for s in tp) * 1e6
        meta_us = statistics.median(s[4] for s in tp) * 1e6
        fwd_ms = statistics.median(s[2] for s in tp) * 1e3
        base_step = quantiles(base)[0]
        rows.append(dict(batch=b, tokens_per_s=b / step, step_ms=step * 1e3, step_p20_ms=p20 * 1e3,
                         step_p80_ms=p80 * 1e3, tpool_us=tpool_us, table_step_us=step_us, metadata_us=meta_us,
                         tpool_share=share, forward_ms=fwd_ms,
                         baseline_tokens_per_s=b / base_step, baseline_step_ms=base_step * 1e3,
                         ratio=base_step / step))
    print_table(f"decode step, end to end (Llama {a.layers}x{a.hidden}, {a.heads}/{a.kv_heads} heads, prompt "
                f"{a.prompt}, page {a.page_size}, {a.backend}, {a.threads} thread; median over {a.samples} "
                f"samples of {a.inner} steps; p20/p80 of the step)",
                ["B", "tok/s", "step ms", "p20 / p80", "tpool us", "= table.step", "+ metadata", "tpool share",
                 "forward ms", "baseline tok/s", "ratio"],
                [[r["batch"], f"{r['tokens_per_s']:.0f}", f"{r['step_ms']:.2f}",
                  f"{r['step_p20_ms']:.2f} / {r['step_p80_ms']:.2f}", f"{r['tpool_us']:.0f}",
                  f"{r['table_step_us']:.1f}", f"{r['metadata_us']:.0f}",
                  f"{100 * r['tpool_share']:.1f}%", f"{r['forward_ms']:.2f}", f"{r['baseline_tokens_per_s']:.0f}",
                  f"{r['ratio']:.2f}x"] for r in rows])
    write_json(a.json, "bench_e2e", rows)
    return rows


if __name__ == "__main__":
    main()
