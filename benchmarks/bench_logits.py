"""A prefill step's logits: every packed token's, or only the rows an engine reads (``logits_to_keep``).

One step of ``--tokens`` packed prompt tokens in ``--lanes`` prefill lanes through
``tpool.serving.hf.forward_step``, on a random-weight model of each ``--models`` family (float32, one torch
thread), twice: asking for every token's logits (``[tokens, vocab]``, what ``Engine`` asked for before) and
for ``--keep`` rows (each lane's last token, then padding rows: what ``Engine`` keeps for a step of that
size with ``max_batch`` 8 and ``draft_len`` 3). Prints, per model, whether the kept rows are bit-equal to
the same rows of the full logits, the logits' bytes, the peak bytes the step allocates (torch's profiler,
allocations and frees in order), and the medians (p20 / p80) of the step and of the LM head alone.
``nokeep`` is a Llama whose forward does not name ``logits_to_keep``: ``forward_step`` computes its full
logits and indexes them (the path for such models).

    python benchmarks/bench_logits.py            # 512 tokens, vocab 32,000, hidden 256, 2 layers
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import (Distinct, HelpFormatter, check_model, out_path, positive_int, progress,  # noqa: E402
                     need_transformers, quantiles, ratio_text, serving_hf, write_json)

import tpool  # noqa: E402
from tpool.serving import PagedKVCache, step_metadata  # noqa: E402
from tpool.testing import peak_alloc_bytes, without_logits_to_keep  # noqa: E402

MODELS = ("llama", "qwen2", "gpt-neox", "gemma2", "mistral", "nokeep")
PAGE_SIZE = 16  # tokens


def build(name, a):
    """A random-weight model of family ``name`` on tpool's attention (seed 0, float32)."""
    import transformers as tf

    common = dict(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
                  num_hidden_layers=a.layers, num_attention_heads=a.heads, max_position_embeddings=4096)
    gqa = dict(num_key_value_heads=a.kv_heads, head_dim=a.hidden // a.heads)
    cfg, cls = {
        "llama": lambda: (tf.LlamaConfig(**common, **gqa), tf.LlamaForCausalLM),
        "nokeep": lambda: (tf.LlamaConfig(**common, **gqa), without_logits_to_keep(tf.LlamaForCausalLM)),
        "qwen2": lambda: (tf.Qwen2Config(**common, **gqa), tf.Qwen2ForCausalLM),
        "gpt-neox": lambda: (tf.GPTNeoXConfig(rotary_pct=0.25, **common), tf.GPTNeoXForCausalLM),
        # softcaps of the attention logits and of the final logits, a window on the sliding layers
        "gemma2": lambda: (tf.Gemma2Config(sliding_window=64, attn_logit_softcapping=50.0,
                                           final_logit_softcapping=30.0, **common, **gqa), tf.Gemma2ForCausalLM),
        "mistral": lambda: (tf.MistralConfig(sliding_window=64, **common, **gqa), tf.MistralForCausalLM),
    }[name]()
    torch.manual_seed(0)
    return cls._from_config(cfg, attn_implementation=serving_hf().ATTN_IMPLEMENTATION, dtype=torch.float32).eval()


def step(model, tokens, lanes):
    """One prefill step of ``tokens`` tokens in ``lanes`` lanes on a fresh pool: ``(input_ids, ctx, lasts)``,
    ``lasts`` each lane's last packed token."""
    from tpool.serving.engine import kv_shape
    per = [tokens // lanes + (i < tokens % lanes) for i in range(lanes)]
    pages = sum(-(-n // PAGE_SIZE) for n in per)
    pool = tpool.PagePool(pages, PAGE_SIZE, device="cpu", backend="reference")
    table = tpool.PageTable(pool, lanes, max(-(-n // PAGE_SIZE) for n in per))
    cache = PagedKVCache.from_pool(pool, *kv_shape(model.config), dtype=torch.float32)
    res = table.step(torch.arange(lanes, dtype=torch.int32), torch.tensor(per, dtype=torch.int32),
                     max_tokens=tokens)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, model.config.vocab_size, (tokens,), generator=g)
    lasts = torch.tensor(per).cumsum(0) - 1
    return x, serving_hf().PagedContext(cache, step_metadata(table, res)), lasts


def timed_ms(fns, samples):
    """Median, p20 and p80 of each of ``fns``' wall time over ``samples`` calls, in ms (``_common.quantiles``),
    one per function; the functions take turns call by call, so a busy moment of a shared machine falls on
    both ways (full and kept) alike, as the other scripts' rows take turns."""
    ts = [[] for _ in fns]
    for _ in range(samples):
        for fn, t in zip(fns, ts):
            t0 = time.perf_counter()
            fn()
            t.append((time.perf_counter() - t0) * 1e3)
    return [quantiles(t) for t in ts]


def measure(name, a):
    hf = serving_hf()
    forward_step = hf.forward_step
    progress(f"{name}: building the model and its step")
    model = build(name, a)
    x, ctx, lasts = step(model, a.tokens, a.lanes)
    keep = torch.zeros(a.keep, dtype=torch.long)
    keep[:lasts.numel()] = lasts
    head = model.get_output_embeddings()
    h = torch.randn(a.tokens, a.hidden, generator=torch.Generator().manual_seed(2))
    row = dict(model=name, takes_logits_to_keep=hf.takes_logits_to_keep(model), tokens=a.tokens, keep=a.keep,
               vocab=a.vocab)
    with torch.no_grad():
        full = forward_step(model, x, ctx)
        kept = forward_step(model, x, ctx, logits_to_keep=keep)
        row["bit_equal"] = torch.equal(full[keep], kept)
        row["max_abs_diff"] = (full[keep] - kept).abs().max().item()
        ways = (("full", {}, a.tokens), ("kept", dict(logits_to_keep=keep), a.keep))
        for what, kw, rows in ways:
            row[f"{what}_logits_bytes"] = rows * a.vocab * 4
            row[f"{what}_peak_bytes"] = peak_alloc_bytes(lambda kw=kw: forward_step(model, x, ctx, **kw))
        progress(f"{name}: full ({a.tokens} rows) and kept ({a.keep} rows) logits in turns, {a.samples} samples")
        steps = timed_ms([lambda kw=kw: forward_step(model, x, ctx, **kw) for _, kw, _ in ways], a.samples)
        heads = timed_ms([lambda rows=rows: head(h[:rows]) for _, _, rows in ways], a.samples)
        for (what, _, _), st, hd in zip(ways, steps, heads):
            row[f"{what}_step_ms"], row[f"{what}_lm_head_ms"] = st, hd
    return row


EPILOG = ("Progress goes to stderr, a few lines per model. Rows: one per model, its step asked for every "
          "token's logits (full, the baseline) and for --keep rows (kept), timed in turns, shown as 'full → kept'; "
          "the ratio is the full step's median over the kept one's (above 1: keeping is faster). A model whose forward "
          "does not name logits_to_keep is 'indexed' (its full logits computed, then the rows taken), else 'taken'.")


def parser() -> argparse.ArgumentParser:
    """The command line: every option with its help and default."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=EPILOG, formatter_class=HelpFormatter)
    ap.add_argument("--models", nargs="+", choices=MODELS, action=Distinct, default=list(MODELS),
                    help="model families to build, random weights, seed 0 (nokeep: a Llama whose forward does not "
                         "name logits_to_keep)")
    ap.add_argument("--tokens", type=positive_int, default=512, help="packed tokens in the step")
    ap.add_argument("--lanes", type=positive_int, default=4, help="prefill lanes the tokens are split into")
    ap.add_argument("--keep", type=positive_int, default=32, help="logits rows kept: the lanes' last tokens, then "
                    "padding (default 32, Engine's for max_batch 8 and draft_len 3)")
    ap.add_argument("--vocab", type=positive_int, default=32000, help="vocabulary size (the LM head's rows)")
    ap.add_argument("--hidden", type=positive_int, default=256, help="hidden size")
    ap.add_argument("--layers", type=positive_int, default=2, help="decoder layers")
    ap.add_argument("--heads", type=positive_int, default=8, help="attention heads (--hidden must divide by it)")
    ap.add_argument("--kv-heads", type=positive_int, default=2, help="K/V heads (grouped-query; --heads must "
                    "divide by it)")
    ap.add_argument("--samples", type=positive_int, default=5, help="timed calls per figure (at least 2)")
    ap.add_argument("--threads", type=positive_int, default=1, help="torch threads (one: more stall on a loaded "
                    "2-core machine)")
    ap.add_argument("--json", type=out_path, default="", metavar="PATH", help="also write the rows as JSON")
    return ap


def main(argv=None):
    ap = parser()
    a = ap.parse_args(argv)
    if not a.lanes <= a.keep <= a.tokens:
        ap.error(f"argument --keep: expected --lanes <= --keep <= --tokens (a kept row per lane, at most one per "
                 f"token), got {a.lanes}, {a.keep}, {a.tokens}")
    if a.samples < 2:
        ap.error(f"argument --samples: expected at least 2 (for p20 / p80), got {a.samples}")
    check_model(ap, a)
    need_transformers(ap)
    torch.set_num_threads(a.threads)
    rows = []
    print(f"{a.tokens} tokens in {a.lanes} lanes, vocab {a.vocab:,}, hidden {a.hidden}, {a.layers} layers, float32, "
          f"{a.threads} thread(s); ms: median (p20 / p80) of {a.samples}")
    print("| model | logits_to_keep | kept rows bit-equal | logits MB | step peak MB | step ms | lm_head ms "
          "| step full / kept |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name in a.models:
        r = measure(name, a)
        rows.append(r)

        def both(key, fmt):
            return " → ".join(fmt(r[f"{w}_{key}"]) for w in ("full", "kept"))

        def ms(q):
            return f"{q[0]:.1f} ({q[1]:.1f} / {q[2]:.1f})"
        print(f"| {name} | {'taken' if r['takes_logits_to_keep'] else 'indexed'} | {r['bit_equal']} "
              f"(max diff {r['max_abs_diff']:.1e}) | {both('logits_bytes', lambda b: f'{b / 2**20:.1f}')} | "
              f"{both('peak_bytes', lambda b: f'{b / 2**20:.1f}')} | {both('step_ms', ms)} | "
              f"{both('lm_head_ms', ms)} | {ratio_text(r['full_step_ms'][0] / r['kept_step_ms'][0])} |", flush=True)
    write_json(a.json, "bench_logits", rows)
    return rows


if __name__ == "__main__":
    main()
