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
import json
import platform
import statistics
import time

import torch

import tpool
from tpool.serving import PagedKVCache, step_metadata
from tpool.serving.engine import kv_shape
from tpool.serving.hf import ATTN_IMPLEMENTATION, PagedContext, forward_step, takes_logits_to_keep
from tpool.testing import peak_alloc_bytes, without_logits_to_keep

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
    return cls._from_config(cfg, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.float32).eval()


def step(model, tokens, lanes):
    """One prefill step of ``tokens`` tokens in ``lanes`` lanes on a fresh pool: ``(input_ids, ctx, lasts)``,
    ``lasts`` each lane's last packed token."""
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
    return x, PagedContext(cache, step_metadata(table, res)), lasts


def quantiles(fn, samples):
    """Median, p20 and p80 of ``fn()``'s wall time over ``samples`` calls, in ms."""
    ts = []
    for _ in range(samples):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    q = statistics.quantiles(ts, n=5, method="inclusive")
    return statistics.median(ts), q[0], q[3]


def measure(name, a):
    model = build(name, a)
    x, ctx, lasts = step(model, a.tokens, a.lanes)
    keep = torch.zeros(a.keep, dtype=torch.long)
    keep[:lasts.numel()] = lasts
    head = model.get_output_embeddings()
    h = torch.randn(a.tokens, a.hidden, generator=torch.Generator().manual_seed(2))
    row = dict(model=name, takes_logits_to_keep=takes_logits_to_keep(model), tokens=a.tokens, keep=a.keep,
               vocab=a.vocab)
    with torch.no_grad():
        full = forward_step(model, x, ctx)
        kept = forward_step(model, x, ctx, logits_to_keep=keep)
        row["bit_equal"] = torch.equal(full[keep], kept)
        row["max_abs_diff"] = (full[keep] - kept).abs().max().item()
        for what, kw, rows in (("full", {}, a.tokens), ("kept", dict(logits_to_keep=keep), a.keep)):
            row[f"{what}_logits_bytes"] = rows * a.vocab * 4
            row[f"{what}_peak_bytes"] = peak_alloc_bytes(lambda: forward_step(model, x, ctx, **kw))
            row[f"{what}_step_ms"] = quantiles(lambda: forward_step(model, x, ctx, **kw), a.samples)
            row[f"{what}_lm_head_ms"] = quantiles(lambda: head(h[:rows]), a.samples)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--tokens", type=int, default=512, help="packed tokens in the step (default 512)")
    p.add_argument("--lanes", type=int, default=4, help="prefill lanes the tokens are split into (default 4)")
    p.add_argument("--keep", type=int, default=32, help="logits rows kept: the lanes' last tokens, then padding "
                   "(default 32, Engine's for max_batch 8 and draft_len 3)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", help="write the rows here, with the machine and versions")
    a = p.parse_args(argv)
    if not 1 <= a.lanes <= a.keep <= a.tokens:
        p.error(f"expected 1 <= --lanes <= --keep <= --tokens, got {a.lanes}, {a.keep}, {a.tokens}")
    if a.samples < 2:
        p.error(f"--samples: expected at least 2 (for p20 / p80), got {a.samples}")
    torch.set_num_threads(a.threads)
    rows = []
    print(f"{a.tokens} tokens in {a.lanes} lanes, vocab {a.vocab:,}, hidden {a.hidden}, {a.layers} layers, float32, "
          f"{a.threads} thread(s); ms: median (p20 / p80) of {a.samples}")
    print("| model | logits_to_keep | kept rows bit-equal | logits MB | step peak MB | step ms | lm_head ms |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
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
              f"{both('lm_head_ms', ms)} |", flush=True)
    if a.json:
        import transformers
        meta = dict(machine=platform.machine(), processor=platform.processor(), python=platform.python_version(),
                    torch=torch.__version__, transformers=transformers.__version__, time=time.time())
        with open(a.json, "w") as f:
            json.dump(dict(meta=meta, args=vars(a), rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
