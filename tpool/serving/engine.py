"""A continuous-batching loop: a transformers model whose K/V lives in tpool pages.

Note: the scheduler keeps every length on the host (what it asked for) and
never reads a step's ``ok``: before a step it sizes the step's page need from
host lengths (``cdiv(len + n, page_size) - cdiv(len, page_size)`` per lane)
against a host count of pages in use that can only over-count (a page shared
by a fork counts once per holder), so a step it schedules cannot fail. When
the running batch needs more pages than that count allows, the most recently
admitted requests are preempted: released and requeued, to be recomputed
(prefill over prompt + tokens so far) later, as vLLM does. The one host read
per step is the sampled tokens (greedy ``argmax``), the model loop's own sync
point. Every request's tokens are then checked against the model's own
``generate`` (eager attention, same weights).

Each step: admissions (arrived requests, first come first served, into free
rows; a request that shares a running request's prompt prefix ``fork``s it and
copies the copy-on-write page with ``PagedKVCache.copy_pages``), one
``table.step`` for every lane (prefill lanes carry their prompt, decode lanes
one token, speculative lanes their last token plus drafted tokens), the
forward over the packed batch, greedy sampling, a ``truncate`` for rejected
drafts, and one ``release`` for the finished requests.
"""

import argparse
import random
import time
from dataclasses import dataclass, field

import torch

from tpool.page_table import PageTable
from tpool.pool import PagePool
from tpool.serving.attention import step_metadata
from tpool.serving.hf import ATTN_IMPLEMENTATION, PagedContext, forward_step
from tpool.serving.kv import PagedKVCache

MODELS = ("llama", "gpt-neox")
INITIALIZER_RANGE = 0.25  # std of the random weights: large enough that a position off by one changes tokens
MIN_TOKEN_BUCKET = 8      # smallest packed-batch size (tokens); sizes are powers of two from here


def tiny_model(name: str, *, seed: int = 0, vocab_size: int = 256):
    """A random-weight causal LM built from a config (nothing downloaded), on ``tpool_paged`` attention.

    ``llama``: grouped-query attention (4 query heads, 2 K/V heads, head_dim 16).
    ``gpt-neox``: partial rotary (a quarter of each head), fused QKV, parallel residual.
    """
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, initializer_range=INITIALIZER_RANGE, max_position_embeddings=512,
                  eos_token_id=None, bos_token_id=None, pad_token_id=0)
    if name == "llama":
        cfg, cls = LlamaConfig(num_key_value_heads=2, head_dim=16, **common), LlamaForCausalLM
    elif name == "gpt-neox":
        cfg, cls = GPTNeoXConfig(rotary_pct=0.25, **common), GPTNeoXForCausalLM
    else:
        raise ValueError(f"model: expected one of {MODELS}, got {name!r}")
    torch.manual_seed(seed)
    model = cls._from_config(cfg, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def kv_shape(config):
    """``(num_layers, num_kv_heads, head_dim)`` of a transformers config."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    hd = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv, hd


@dataclass
class Request:
    """One generation request; ``parent``/``shared``: its prompt starts with request ``parent``'s
    first ``shared`` prompt tokens (a shared prefix the engine may ``fork``)."""

    rid: int
    prompt: list
    max_new: int
    arrival: int = 0
    parent: int | None = None
    shared: int = 0
    out: list = field(default_factory=list)
    row: int | None = None
    cached: int = 0         # tokens whose K/V are in the pages (the table's length of this row)

    @property
    def tokens(self):
        return self.prompt + self.out


@dataclass
class Stats:
    steps: int = 0
    preemptions: int = 0
    forks: int = 0
    drafted: int = 0
    accepted: int = 0
    rollbacks: int = 0
    tokens_out: int = 0
    tpool_s: float = 0.0     # table calls (step, release, truncate, fork), copy_pages, step metadata
    forward_s: float = 0.0   # the model forward (K/V writes and paged attention included) and argmax
    step_s: list = field(default_factory=list)


class Engine:
    """Greedy continuous batching of ``model`` on a pool of ``num_pages`` pages of ``page_size`` tokens.

    ``max_batch`` lanes per step (also the table's rows), ``max_pages`` pages per request;
    ``spec_every``: requests whose id is a multiple of it decode speculatively, drafting
    ``draft_len`` tokens by prompt lookup (the tokens that followed the last earlier
    occurrence of the last token) and rolling back the rejected ones with ``truncate``.
    """

    def __init__(self, model, *, num_pages: int, page_size: int, max_batch: int, max_pages: int,
                 backend: str = "auto", device="cpu", spec_every: int = 3, draft_len: int = 3):
        self.model = model
        self.pool = PagePool(num_pages, page_size, device=device, backend=backend)
        self.table = PageTable(self.pool, max_batch, max_pages)
        layers, kv_heads, head_dim = kv_shape(model.config)
        self.cache = PagedKVCache.from_pool(self.pool, layers, kv_heads, head_dim, dtype=model.dtype)
        self.ps, self.max_batch, self.max_pages = page_size, max_batch, max_pages
        self.spec_every, self.draft_len = spec_every, draft_len
        self.dev = self.pool.device
        self.stats = Stats()

    def _i32(self, values):
        return torch.tensor(values, dtype=torch.int32, device=self.dev)

    def _pages(self, n):
        return -(-n // self.ps)

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        res = fn(*args)
        self.stats.tpool_s += time.perf_counter() - t0
        return res

    def _draft(self, r):
        toks = r.tokens
        for i in range(len(toks) - 2, -1, -1):
            if toks[i] == toks[-1]:
                return toks[i + 1:i + 1 + self.draft_len]
        return toks[-self.draft_len:]

    def run(self, requests, out=None):
        """Serve ``requests`` (a list of :class:`Request`) to completion; return ``{rid: tokens}``."""
        cap = min(self.max_pages, self.pool.num_pages) * self.ps
        for r in requests:
            if len(r.prompt) + r.max_new + self.draft_len > cap:
                raise ValueError(f"request {r.rid}: expected prompt + max_new + draft_len <= {cap} tokens "
                                 f"(max_pages and the pool), got {len(r.prompt) + r.max_new + self.draft_len}")
        by_id = {r.rid: r for r in requests}
        waiting = sorted(requests, key=lambda r: (r.arrival, r.rid))
        running, free_rows, step = [], list(range(self.max_batch - 1, -1, -1)), 0
        in_use = lambda: sum(self._pages(r.cached) for r in running)  # noqa: E731  (over-counts shared pages)
        while waiting or running:
            t_step = time.perf_counter()
            # 1. Lanes of the running requests: what each feeds this step.
            feed = {}
            for r in running:
                pending = r.tokens[r.cached:]
                spec = self.spec_every and r.rid % self.spec_every == 0 and r.out and len(pending) == 1
                feed[r.rid] = pending + (self._draft(r) if spec else [])
            need = lambda r: self._pages(r.cached + len(feed[r.rid])) - self._pages(r.cached)  # noqa: E731
            # 2. Preempt the newest running requests until the rest fit (release, recompute later).
            while running and in_use() + sum(need(r) for r in running) > self.pool.num_pages:
                victim = running.pop()
                self._timed(self.table.release, self._i32([victim.row]))
                free_rows.append(victim.row)
                victim.row, victim.cached = None, 0
                feed.pop(victim.rid)
                waiting.insert(0, victim)
                self.stats.preemptions += 1
            # 3. Admit arrived requests into free rows while their pages fit (prefix: fork the parent).
            budget = self.pool.num_pages - in_use() - sum(need(r) for r in running)
            forks = []
            for r in [w for w in waiting if w.arrival <= step]:
                if not free_rows:
                    break
                parent = by_id.get(r.parent) if r.parent is not None else None
                share = (r.shared if parent is not None and parent.row is not None and not r.out
                         and parent.cached >= r.shared else 0)
                cost = self._pages(len(r.tokens)) + (1 if share % self.ps else 0)
                if cost > budget:
                    break
                budget -= cost
                r.row = free_rows.pop()
                if share:
                    forks.append((parent.row, r.row, share))
                    r.cached = share
                waiting.remove(r)
                running.append(r)
                feed[r.rid] = r.tokens[r.cached:]
            if forks:
                src, dst, lens = (self._i32(list(c)) for c in zip(*forks))
                res = self._timed(self.table.fork, src, dst, lens)
                self._timed(self.cache.copy_pages, res.cow_src, res.cow_dst)
                self.stats.forks += len(forks)
            if not running:
                step += 1
                continue
            # 4. One step for every lane, the forward, greedy sampling (the host read of the step).
            lanes = running
            ntok = [len(feed[r.rid]) for r in lanes]
            total = sum(ntok)
            t_max = max(MIN_TOKEN_BUCKET, 1 << (total - 1).bit_length())
            pad = self.max_batch - len(lanes)
            ids = self._i32([r.row for r in lanes] + [-1] * pad)
            nt = self._i32(ntok + [0] * pad)
            x = torch.zeros(t_max, dtype=torch.long, device=self.dev)
            x[:total] = torch.tensor([t for r in lanes for t in feed[r.rid]], dtype=torch.long)
            t0 = time.perf_counter()
            res = self.table.step(ids, nt, max_tokens=t_max)
            meta = step_metadata(self.table, res)
            t1 = time.perf_counter()
            with torch.no_grad():
                preds = forward_step(self.model, x, PagedContext(self.cache, meta)).argmax(-1).tolist()
            t2 = time.perf_counter()
            self.stats.tpool_s += t1 - t0
            self.stats.forward_s += t2 - t1
            # 5. Host bookkeeping: accept tokens, roll back rejected drafts, release finished requests.
            start, rollback, done = 0, [], []
            for r, n in zip(lanes, ntok):
                pending = len(r.tokens) - r.cached
                got = preds[start + pending - 1:start + n]     # predictions after each fed token
                drafts = feed[r.rid][pending:]
                a = 0
                while a < len(drafts) and drafts[a] == got[a]:
                    a += 1
                if drafts:
                    self.stats.drafted += len(drafts)
                    self.stats.accepted += a
                r.cached += pending + a
                if a < len(drafts):
                    rollback.append(r)
                new = got[:a + 1][:r.max_new - len(r.out)]
                r.out.extend(new)
                self.stats.tokens_out += len(new)
                if len(r.out) >= r.max_new:
                    done.append(r)
                start += n
            if rollback:
                self._timed(self.table.truncate, self._i32([r.row for r in rollback]),
                            self._i32([r.cached for r in rollback]))
                self.stats.rollbacks += len(rollback)
            if done:
                self._timed(self.table.release, self._i32([r.row for r in done]))
                for r in done:
                    running.remove(r)
                    free_rows.append(r.row)
                    r.row = None
            self.stats.steps += 1
            self.stats.step_s.append(time.perf_counter() - t_step)
            if out is not None and step % 10 == 0:
                out(f"step {step:>4}: running {len(running):>2}, waiting {len(waiting):>2}, "
                    f"tokens this step {total:>3}, preemptions {self.stats.preemptions}, forks {self.stats.forks}, "
                    f"rollbacks {self.stats.rollbacks}", flush=True)
            step += 1
        return {r.rid: list(r.out) for r in requests}


def make_requests(n: int = 32, *, seed: int = 0, vocab_size: int = 256, max_new: tuple = (4, 16),
                  prompt_len: tuple = (5, 40), share_every: int = 5):
    """``n`` requests: prompts of ``prompt_len`` tokens, ``max_new`` new tokens, arriving a few per
    step; every ``share_every``-th one starts with part of the previous request's prompt."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(1, vocab_size) for _ in range(rng.randint(*prompt_len))]
        r = Request(i, prompt, rng.randint(*max_new), arrival=i // 4)
        if share_every and i % share_every == share_every - 1:
            base = reqs[-1].prompt
            r.parent, r.shared = i - 1, rng.randint(1, len(base))
            r.prompt = base[:r.shared] + prompt[:max(prompt_len[0] - r.shared, 1) + rng.randint(0, 8)]
            r.arrival = reqs[-1].arrival + 1
        reqs.append(r)
    return reqs


def reference_tokens(model, requests):
    """Each request's greedy tokens from ``model.generate`` with eager attention (the check)."""
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return {r.rid: model.generate(torch.tensor([r.prompt]), attention_mask=torch.ones(1, len(r.prompt),
                                          dtype=torch.long), max_new_tokens=r.max_new,
                                          do_sample=False)[0, len(r.prompt):].tolist()
                    for r in requests}
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)


def run_demo(model: str = "llama", *, requests: int = 32, num_pages: int = 48, page_size: int = 4,
             max_batch: int = 8, max_new: tuple = (4, 16), backend: str = "auto", seed: int = 0,
             out=print) -> dict:
    """Serve ``requests`` random prompts with a tiny random ``model`` on tpool pages; check against generate.

    Returns a dict of counts (steps, preemptions, forks, rollbacks, drafts accepted, tokens) and
    ``mismatches`` (requests whose tokens differ from ``generate``: 0 expected). Raises
    ``AssertionError`` if any differ, pages are left in use, or the pool's checks fail.
    """
    lm = tiny_model(model, seed=seed)
    reqs = make_requests(requests, seed=seed, vocab_size=lm.config.vocab_size, max_new=max_new)
    draft_len = 3
    max_pages = -(-max(len(r.prompt) + r.max_new + draft_len for r in reqs) // page_size)
    eng = Engine(lm, num_pages=num_pages, page_size=page_size, max_batch=max_batch, max_pages=max_pages,
                 backend=backend, draft_len=draft_len)
    if out:
        out(f"tpool serving demo: {model}, {requests} requests, {eng.pool!r}, {eng.cache!r}", flush=True)
    got = eng.run(reqs, out=out)
    want = reference_tokens(lm, reqs)
    bad = [rid for rid in got if got[rid] != want[rid]]
    eng.pool.check()
    eng.table.check_invariants()
    s, used = eng.stats, eng.pool.stats()["pages.used.current"]
    report = dict(steps=s.steps, preemptions=s.preemptions, forks=s.forks, rollbacks=s.rollbacks,
                  drafted=s.drafted, accepted=s.accepted, tokens=s.tokens_out, mismatches=len(bad),
                  pages_in_use=used, peak_pages=eng.pool.stats()["pages.used.peak"])
    if out:
        out(f"{s.steps} steps, {s.tokens_out} tokens; preemptions {s.preemptions}, forks {s.forks}, rollbacks "
            f"{s.rollbacks} ({s.accepted}/{s.drafted} drafts accepted); peak pages {report['peak_pages']} of "
            f"{num_pages}; pages in use at the end {used}; requests matching generate: "
            f"{len(got) - len(bad)}/{len(got)}")
    assert not bad, f"requests {bad} differ from generate"
    assert used == 0, f"{used} pages still in use"
    return report


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tpool demo --model NAME",
                                 description="Serve a tiny random transformers model on tpool pages and check "
                                             "every request against the model's generate.")
    ap.add_argument("--model", choices=MODELS, default="llama", help="architecture (default llama)")
    ap.add_argument("--requests", type=int, default=32, help="number of prompts (default 32)")
    ap.add_argument("--num-pages", type=int, default=48, help="pool pages, too few for all (default 48)")
    ap.add_argument("--page-size", type=int, default=4, help="tokens per page (default 4)")
    ap.add_argument("--max-batch", type=int, default=8, help="lanes per step (default 8)")
    ap.add_argument("--backend", default="auto", help="pool backend (default auto)")
    ap.add_argument("--seed", type=int, default=0, help="weights and prompts seed (default 0)")
    a = ap.parse_args(argv)
    run_demo(a.model, requests=a.requests, num_pages=a.num_pages, page_size=a.page_size, max_batch=a.max_batch,
             backend=a.backend, seed=a.seed)
    return 0


if __name__ == "__main__":
    main()
