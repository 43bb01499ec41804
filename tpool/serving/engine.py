"""A continuous-batching loop: a transformers model whose K/V lives in tpool pages.

Note: the loop schedules on a host mirror of the pool
(:class:`tpool.scheduling.HostMirror`): every decision is made on host
integers kept from what the loop itself asked for, never from a device read,
and the loop never reads a step's ``ok``. Each running request holds a
reservation of the pages its next ``1 + draft_len`` tokens need (the worst
case of a speculative lane: every draft accepted; never past its ``max_len``, as
a lane drafts no token past its ``max_new``), so no step can fail for
lack of pages; the pages of drafts the model rejects come back at
``truncate``, and the reservation is topped up again from there. Before a step the
mirror names the requests to preempt if the step's lanes would not fit
(lowest priority first: the most recently admitted), and they are released
before the step and requeued, to be recomputed (prefill over prompt + tokens
so far) later, as vLLM does. Admissions take only unreserved pages, after the
decode lanes' own need; a request that shares a running request's prompt
prefix ``fork``s it through the mirror and copies the copy-on-write page with
``PagedKVCache.copy_pages``. A release of a forked prefix credits the mirror
only what was surely the request's own (a safe under-count); a snapshot of
the pool's counters, taken without waiting and applied once it has landed
(``HostMirror.snapshot``/``reconcile``), gives the rest back. The one host
read per step is the sampled tokens (greedy ``argmax``, :meth:`Engine.sample`),
the model loop's own sync point. Every request's tokens are then checked
against the model's own ``generate`` (eager attention, same weights).

Each step of :meth:`Engine.run`, one method a stage: reconcile the snapshots
that have landed (``_reconcile``), what each running lane feeds (``_feeds``),
preempt if needed (``_preempt``), admit arrived requests (``_admit``: first
come first served, into free rows), one ``HostMirror.step`` for every lane
(prefill lanes carry their prompt, decode lanes one token, speculative lanes
their last token plus drafted tokens, a forked request the rest of its
prompt), the forward over the packed batch and greedy sampling
(``_forward``), the accepted tokens (``_accept``), then a ``truncate`` for
rejected drafts and one ``finish`` (release) for the finished requests
(``_release``).
"""

import numbers
import random
import time
import warnings
from dataclasses import dataclass, field

import torch

from tpool import _checks
from tpool.backends import requested_backend
from tpool.demo import OptionError
from tpool.page_table import PageTable
from tpool.pool import DEFAULT_MAX_BATCH, PagePool
from tpool.scheduling import HostMirror, PrefixCache, PrefixMatch
from tpool.serving import checks
from tpool.serving.attention import step_metadata
from tpool.serving.cli import MAX_POOL_TOKENS, MODELS
from tpool.serving.hf import ATTN_IMPLEMENTATION, PagedContext, check_model, forward_step
from tpool.serving.kv import PagedKVCache

EOS_FROM_MODEL = "model"  # eos_token_id's default: the model's generation_config.eos_token_id
INITIALIZER_RANGE = 0.25  # std of the random weights: large enough that a position off by one changes tokens
MIN_TOKEN_BUCKET = 8      # smallest packed-batch size (tokens); sizes are powers of two from here
LOGITS_ROW_MULTIPLE = 8   # a step's kept logits rows are a multiple of this (rows); see Engine.logits_rows
CHECK_PROGRESS_S = 5.0    # seconds: the demo's check says how far it got when its last line is older than this
CHECK_CHUNK = 16          # requests checked between two looks at the clock


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
    """``(num_layers, num_kv_heads, head_dim)`` of a transformers config: one K/V shape for every layer,
    K and V alike (what :class:`PagedKVCache` holds). A composite model's config (Gemma 3's, Llava's: a
    vision tower and a text decoder) is read through its text decoder's, as ``check_model`` and
    ``forward_step`` read it.

    Raises ``ValueError`` naming the model type for a config no such shape describes: multi-head
    latent attention (DeepSeek-V2/V3: ``kv_lora_rank``; K and V are per query head, with their own
    head dims), a ``v_head_dim`` other than the K head dim, or head dims or K/V head counts that
    differ per layer (a transformers ``per_layer_config``: Gemma 4's full-attention layers), and a
    config whose layers are not all attention (:func:`tpool.serving.checks.check_layers`: Mamba,
    Qwen3-Next, ...) or that names no attention heads.
    """
    if callable(getattr(config, "get_text_config", None)):
        config = config.get_text_config(decoder=True)
    kind = getattr(config, "model_type", None) or type(config).__name__
    checks.check_layers(config)
    missing = [a for a in ("num_hidden_layers", "num_attention_heads") if getattr(config, a, None) is None]
    if missing:
        raise ValueError(f"{kind}: not supported by tpool.serving: expected a config with "
                         f"{' and '.join(missing)} (a transformers text config of an attention model), "
                         f"got {type(config).__name__} without")
    if getattr(config, "is_heterogeneous", False):   # transformers 5's per-layer configs
        per_layer = [_layer_kv_shape(c, kind) for c in config.per_layer_config]
    else:
        per_layer = [_layer_kv_shape(config, kind)]
    if len(set(per_layer)) > 1:
        layers = {}
        for i, shape in enumerate(per_layer):
            layers.setdefault(shape, []).append(i)
        what = "; ".join(f"layers {ids}: {heads} K/V heads of head_dim {hd}" for (heads, hd), ids in layers.items())
        raise ValueError(f"{kind}: not supported by tpool.serving: its head dims or K/V head counts differ per "
                         f"layer ({what}); PagedKVCache holds one (num_kv_heads, head_dim) for every layer")
    return config.num_hidden_layers, *per_layer[0]


def _layer_kv_shape(config, kind):
    """``(num_kv_heads, head_dim)`` of one layer's config (the model's config when all layers are alike)."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    hd = getattr(config, "head_dim", None) or config.hidden_size // heads
    v = getattr(config, "v_head_dim", None)
    if getattr(config, "kv_lora_rank", None):
        qk = (getattr(config, "qk_nope_head_dim", None) or 0) + (getattr(config, "qk_rope_head_dim", None) or 0)
        differ = " (K and V head dims differ)" if qk != v else ""
        raise ValueError(f"{kind}: not supported by tpool.serving: multi-head latent attention (kv_lora_rank "
                         f"{config.kv_lora_rank}) caches K and V for each of its {heads} query heads, K of head dim "
                         f"{qk} (qk_nope_head_dim + qk_rope_head_dim) and V of head dim {v} (v_head_dim){differ}, "
                         f"not the {kv} K/V heads of head_dim {hd} the config names; PagedKVCache holds K and V "
                         f"of one (num_kv_heads, head_dim)")
    if v is not None and v != hd:
        raise ValueError(f"{kind}: not supported by tpool.serving: K and V head dims differ (head_dim {hd}, "
                         f"v_head_dim {v}); PagedKVCache holds K and V of one head_dim")
    return kv, hd


class RequestTooLong(ValueError):
    """A request holds more tokens than a row or the pool (``Engine.check_fits``): a bigger pool or
    ``max_pages`` serves it, unlike the other refusals there, which are requests to fix."""


@dataclass
class Request:
    """One generation request: at most ``max_new`` new tokens (fewer when one is an EOS, see
    :class:`Engine`); ``parent``/``shared``: its prompt starts with request ``parent``'s first
    ``shared`` prompt tokens (a shared prefix the engine may ``fork``)."""

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


def max_len(r: Request) -> int:
    """The most tokens ``r`` ever holds in an :class:`Engine`'s table (the mirror's ``max_len``), the
    positions it ever feeds: its prompt and ``max_new - 1`` new tokens (its last token is never fed).
    A speculative lane drafts at most the tokens it may still keep less one (``Engine._feeds``): a
    draft past them would be cut at ``max_new`` whatever the model says, and would feed a position
    ``generate`` never reaches (past a learned position table: GPT-2's ``n_positions``)."""
    return len(r.prompt) + max(r.max_new - 1, 0)


@dataclass
class Stats:
    steps: int = 0
    preemptions: int = 0
    forks: int = 0
    cache_hits: int = 0      # requests admitted on revived pages of the prefix cache
    cached_tokens: int = 0   # prompt tokens those hits did not compute again
    evicted: int = 0         # CACHED pages the loop asked the pool to evict
    prompt_tokens: int = 0   # prompt tokens the forward computed (not revived, forked or in the pages already)
    fed_tokens: int = 0      # tokens the forward computed, all lanes (prompts, decoded tokens, drafts)
    drafted: int = 0
    accepted: int = 0
    rollbacks: int = 0
    tokens_out: int = 0
    tpool_s: float = 0.0     # mirror calls (its host accounting + the table calls), copy_pages, step metadata
    calls: dict = field(default_factory=dict)  # the same per call: {"HostMirror.step": [seconds, calls], ...}
    forward_s: float = 0.0   # the model forward (K/V writes and paged attention included) and argmax
    step_s: list = field(default_factory=list)


class Engine:
    """Greedy continuous batching of ``model`` on a pool of ``num_pages`` pages of ``page_size`` tokens.

    ``max_batch`` lanes per step (also the table's rows), ``max_pages`` pages per request;
    ``spec_every`` (0: none): requests whose id is a multiple of it decode speculatively, drafting
    ``draft_len`` tokens (0: none) by prompt lookup (the tokens that followed the last earlier
    occurrence of the last token) and rolling back the rejected ones with ``truncate``.
    The loop schedules on ``mirror`` (a :class:`tpool.scheduling.HostMirror` of the table,
    reserving ``lookahead`` = ``1 + draft_len`` tokens per running request, or 1 without
    speculation). With ``prefix_cache`` (default) a request leaving the loop, finished or
    preempted, keeps its whole pages CACHED in a :class:`tpool.scheduling.PrefixCache`, and a
    request whose tokens start with them revives them instead of computing them again
    (preempted ones too); CACHED pages are evicted, least recently released first, when a
    step or an admission needs them.

    ``eos_token_id`` (:func:`eos_ids`; default ``"model"``: the model's
    ``generation_config.eos_token_id``, as ``generate`` does; ``None``: never stop early): a
    request ends at its first generated token among these (kept in its output, as ``generate``
    keeps it) or after ``max_new`` tokens. :func:`reference_tokens` takes the same option.

    ``device`` (default: the model's): where the pool, the page table and the K/V pages live;
    it must be the model's (``ValueError`` naming both otherwise: the forward reads the pages).

    ``reconcile_every`` (default 1): a snapshot of the pool is started only on steps whose count is
    a multiple of it (and only while the mirror is inexact, none on its way); each is reconciled once
    it has landed. Until then the mirror under-promises, so a larger value preempts and admits on
    staler, smaller counts (``Stats.preemptions``; ``benchmarks/bench_reconcile.py`` compares them).
    """

    def __init__(self, model, *, num_pages: int, page_size: int, max_batch: int, max_pages: int,
                 backend: str = "auto", device=None, spec_every: int = 3, draft_len: int = 3,
                 prefix_cache: bool = True, eos_token_id=EOS_FROM_MODEL, reconcile_every: int = 1):
        layers, kv_heads, head_dim = kv_shape(model.config)   # before the pool is made: nothing to undo
        check_model(model)  # (memoized: forward_step's own check costs nothing more)
        device = _model_device(model, device)
        self.eos = eos_ids(model, eos_token_id)
        spec_every = _checks.check_size(spec_every, "spec_every")
        draft_len = _checks.check_size(draft_len, "draft_len")
        prefix_cache = _checks.flag(prefix_cache, "prefix_cache")
        max_batch = _checks.check_size(max_batch, "max_batch", 1)
        self.reconcile_every = _checks.check_size(reconcile_every, "reconcile_every", 1)
        self.model = model
        self.vocab = model.get_input_embeddings().num_embeddings   # token ids run checks against
        self.positions = checks.position_limit(model)              # (positions, what bounds them), or None
        # The pool's max_batch bounds a step's lanes: at least the table's rows (its default otherwise).
        self.pool = PagePool(num_pages, page_size, device=device, backend=backend,
                             max_batch=max(max_batch, DEFAULT_MAX_BATCH))
        self.table = PageTable(self.pool, max_batch, max_pages)
        self.lookahead = 1 + draft_len if spec_every else 1
        self.mirror = HostMirror(self.table, lookahead=self.lookahead, free=num_pages, cached=0)  # a fresh pool
        self.prefix = PrefixCache(self.mirror) if prefix_cache else None
        self.cache = PagedKVCache.from_pool(self.pool, layers, kv_heads, head_dim, dtype=model.dtype)
        self.ps, self.max_batch, self.max_pages = page_size, max_batch, max_pages
        self.spec_every, self.draft_len = spec_every, draft_len
        self.dev = self.pool.device
        self.stats = Stats()
        self._snapshots = []   # started snapshots of the pool, oldest first, applied once landed
        self._evicted = []     # the prefix cache's evicted slots sample() has handed out and not dropped yet
        self._names = {}       # stats.calls' name of each function _timed has run

    def _timed(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, its host time added to ``stats.tpool_s`` and to ``stats.calls``
        under its name (a method's as ``Class.method`` of the object it is bound to)."""
        t0 = time.perf_counter()
        res = fn(*args, **kwargs)
        dt = time.perf_counter() - t0
        self.stats.tpool_s += dt
        key = getattr(fn, "__func__", fn)  # (a bound method is a new object every call; its function is not)
        name = self._names.get(key)        # named once per function, not per call
        if name is None:
            owner = getattr(fn, "__self__", None)
            name = self._names[key] = fn.__name__ if owner is None else f"{type(owner).__name__}.{fn.__name__}"
        total = self.stats.calls.get(name)
        if total is None:
            total = self.stats.calls[name] = [0.0, 0]
        total[0] += dt
        total[1] += 1
        return res

    def _spec(self, r):
        return bool(self.spec_every) and r.rid % self.spec_every == 0

    def _draft(self, r):
        """Prompt-lookup drafts: the ``draft_len`` tokens that followed the last earlier occurrence of
        ``r``'s last token (else its last tokens)."""
        if not self.draft_len:
            return []  # (``toks[-0:]`` below would be every token)
        toks = r.tokens
        for i in range(len(toks) - 2, -1, -1):
            if toks[i] == toks[-1]:
                return toks[i + 1:i + 1 + self.draft_len]
        return toks[-self.draft_len:]

    def sample(self, logits: torch.Tensor) -> list:
        """Greedy tokens of a step: the loop's one host read per step (its sync point).

        logits : torch.Tensor  shape ``[logits_rows(max_tokens), vocab]``, float, on the model's device:
        the logits of the step's kept tokens (:meth:`_kept_tokens`, then padding rows).
        Returns the ``argmax`` of every row as a list of ints. The prefix cache's evictions
        since the last read come back in the same copy, and their entries are dropped (with
        those a ``sample`` that raised handed out and did not drop: until dropped the cache
        matches nothing).
        """
        ids = logits.argmax(-1)
        if self.prefix is None:
            return ids.tolist()
        if self._evicted and not self.prefix.closed:
            self._evicted.clear()   # (dropped, the error after the drop)
        evicted = self.prefix.unread()
        if evicted is not None:
            self._evicted.append(evicted)   # handed out: dropped below, else by the next sample or _abandon
        if not self._evicted:
            return ids.tolist()
        host = torch.cat([ids] + [t.to(ids.dtype) for t in self._evicted]).tolist()
        at = ids.numel()
        while self._evicted:               # each unread() dropped apart, oldest first
            n = self._evicted[0].numel()
            self.prefix.drop(host[at:at + n])
            del self._evicted[0]
            at += n
        return host[:ids.numel()]

    def _reconcile(self, wait=False, idle=False):
        """Start a snapshot of the pool if the mirror is inexact (a shared prefix was released, or a
        revive took pages that may have been USED), none is on its way, and the steps run so far are a
        multiple of ``reconcile_every`` or nothing runs (``idle``: no step would come to count, and the
        mirror's under-count could refuse every admission for good) or ``wait``; apply those that have
        landed (never waits unless ``wait``: a sync point)."""
        m = self.mirror
        due = wait or idle or self.stats.steps % self.reconcile_every == 0
        if due and not (m.exact and m.cached_exact) and not self._snapshots:
            self._snapshots.append(self._timed(m.snapshot))
        while self._snapshots and (wait or self._snapshots[0].ready()):
            self._timed(m.reconcile, self._snapshots.pop(0))

    def check_fits(self, requests) -> None:
        """Raise ``ValueError`` naming the first request that could never fit a row and the pool: the
        tokens it ever holds (:func:`max_len`: prompt + max_new - 1), or one past the model's
        position table (GPT-2's ``n_positions``: :func:`tpool.serving.checks.position_limit`), or
        an empty prompt (nothing to predict the first token from: the loop would never end). Also one
        whose fields are not what they should be (``rid`` and ``arrival`` ints, ``prompt`` a list of
        token ids in ``[0, vocab)``, the model's embedding rows, ``max_new`` an int >= 1, as
        ``generate`` requires), and one the loop would serve wrongly: a ``rid`` given twice (feeds and
        results are keyed by it), a request already served (its ``out``, ``row`` or ``cached`` set:
        make a new one), or a ``parent`` that is not in ``requests`` or whose prompt does not start
        with the same ``shared`` tokens (the fork would give it the parent's K/V for other tokens).
        ``requests``: a list, or any iterable of them (read once: a generator's requests are all checked)."""
        self._check_fits(_request_list(requests))

    def _check_fits(self, requests: list) -> None:
        """:meth:`check_fits` of a list (:meth:`run` has made one already: no second copy)."""
        by_id = {}
        for r in requests:
            self._check_fields(r)
            if r.rid in by_id:
                raise ValueError(f"request {r.rid}: expected one request per rid (feeds and results are keyed by "
                                 f"it), got two")
            by_id[r.rid] = r
            if r.out or r.row is not None or r.cached:
                raise ValueError(f"request {r.rid}: expected a new Request, got one already served (out has "
                                 f"{len(r.out)} tokens, row={r.row}, cached={r.cached}): make a new one to run again")
            if not r.prompt:
                raise ValueError(f"request {r.rid}: expected a prompt of at least 1 token, got 0 tokens")
        for r in requests:
            if r.parent is None:
                continue
            if isinstance(r.shared, bool) or not isinstance(r.shared, int) or r.shared < 0:
                raise ValueError(f"request {r.rid}: expected shared (its prompt tokens from parent {r.parent}) a "
                                 f"non-negative int, got {r.shared!r}")
            p, k = by_id.get(r.parent), min(r.shared, len(r.prompt))  # (past its prompt: served without a fork)
            if p is None or p is r or r.shared > len(p.prompt) or r.prompt[:k] != p.prompt[:k]:
                got = "is not among the requests" if p is None else "is the request itself" if p is r else \
                    f"has a {len(p.prompt)}-token prompt" if r.shared > len(p.prompt) else \
                    "starts with other tokens"
                raise ValueError(f"request {r.rid}: expected parent {r.parent}'s prompt to start with its first "
                                 f"shared={r.shared} prompt tokens, but request {r.parent} {got}")
        cap = min(self.max_pages, self.pool.num_pages) * self.ps
        for r in requests:
            held = max_len(r)
            if self.positions is not None and held > self.positions[0]:
                raise ValueError(f"request {r.rid}: expected prompt + max_new - 1 <= {self.positions[0]} tokens "
                                 f"(the model's {self.positions[1]} bounds positions to {self.positions[0]}), "
                                 f"got {held}")
            if held > cap:
                raise RequestTooLong(f"request {r.rid}: expected prompt + max_new - 1 <= {cap} tokens (max_pages "
                                     f"and the pool), got {held}")

    def _check_fields(self, r) -> None:
        if not isinstance(r, Request):
            raise ValueError(f"requests: expected Request objects, got {type(r).__name__}")
        for name in ("rid", "arrival"):
            v = getattr(r, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise ValueError(f"request {r.rid!r}: expected {name} an int, got {v!r}")
        _checks.check_size(r.max_new, f"request {r.rid}: max_new (tokens to generate, as generate's "
                                      f"max_new_tokens)", 1)
        p = r.prompt
        if type(p) is not list:
            raise ValueError(f"request {r.rid}: expected the prompt as a list of token ids, got {type(p).__name__}")
        if p and not all(type(t) is int for t in p):   # (numpy ints, say: checked one by one)
            p = [_checks.check_size(t, f"request {r.rid}: prompt token", 0) for t in p]
        if p and (min(p) < 0 or max(p) >= self.vocab):
            bad = next(t for t in p if not 0 <= t < self.vocab)
            raise ValueError(f"request {r.rid}: expected prompt token ids in [0, {self.vocab}) (the model's "
                             f"embedding rows), got {bad}")

    def run(self, requests, out=None):
        """Serve ``requests`` (a list of :class:`Request`, or any iterable of them: a generator is read
        once, here) to completion; return ``{rid: tokens}``.

        An exception inside the loop (the model's forward, an interrupt) releases the rows of the
        requests running then (:meth:`_abandon`) before it propagates: the pool and the table hold
        nothing of the run, and the engine serves the next ``run``."""
        requests = _request_list(requests)   # (the checks and the loop below each read it: a generator once)
        self._check_fits(requests)
        by_id = {r.rid: r for r in requests}
        waiting = sorted(requests, key=lambda r: (r.arrival, r.rid))
        running = []                                # admission order, the newest last
        try:
            self._loop(waiting, running, by_id, out)
        except BaseException:
            try:
                self._abandon(running)
            except Exception as e:   # the run's own exception is the one to see; check() names what is left
                warnings.warn(f"Engine.run: releasing the running requests' rows after an error failed too "
                              f"({type(e).__name__}: {e}); Engine.check() names what is still held", RuntimeWarning,
                              stacklevel=2)
            raise
        return {r.rid: list(r.out) for r in requests}

    def _loop(self, waiting, running, by_id, out) -> None:
        step = 0
        while waiting or running:
            if not running:   # nothing runs before the next arrival: skip the steps between (an arrival is a step)
                step = max(step, min(w.arrival for w in waiting))
            t_step = time.perf_counter()
            self._reconcile(idle=not running)
            feed = self._feeds(running)
            self._preempt(running, waiting, feed)
            decode, prefill = self._admit(step, waiting, running, feed, by_id)
            if running:
                lanes = decode + prefill            # the mirror's lane order: decode rows, then admissions
                preds = self._forward(decode, prefill, feed)
                rollback, done = self._accept(lanes, feed, preds)
                self._release(rollback, done, running)
                self.stats.steps += 1
                self.stats.step_s.append(time.perf_counter() - t_step)
                if out is not None and step % 10 == 0:
                    arrived = sum(w.arrival <= step for w in waiting)   # (the rest arrive at later steps)
                    out(f"step {step:>4}: running {len(running):>2}, waiting {arrived:>2} (+{len(waiting) - arrived} "
                        f"to arrive), tokens this step "
                        f"{sum(len(feed[r.rid]) for r in lanes):>3}, preemptions {self.stats.preemptions}, forks "
                        f"{self.stats.forks}, cache hits {self.stats.cache_hits}, rollbacks {self.stats.rollbacks}, "
                        f"free pages (mirror) {self.mirror.free}", flush=True)
            step += 1

    def _abandon(self, running) -> None:
        """After an exception in :meth:`run`: drop the prefix cache's evictions not dropped yet (handed
        out by :meth:`sample` or not yet: until then it matches nothing), then release the rows of
        ``running`` as a preemption does (with a prefix cache their computed whole pages stay CACHED and
        named), so nothing of the run stays in use. The requests keep the tokens they got."""
        try:
            if self.prefix is not None:
                while self._evicted and self.prefix.closed:   # (not dropped already; a read on the error
                    self.prefix.drop(self._evicted[0].tolist())   # path: a sync point, as check() is)
                    del self._evicted[0]
                self._evicted.clear()
                self.prefix.sync()
        finally:   # the rows are released whatever the cache's cleanup does
            held = [r for r in running if r.row is not None and self.mirror.live[r.row]]   # (not released already)
            if held:
                self._finish(held, [r.row for r in held])
            for r in running:
                r.row, r.cached = None, 0

    def _feeds(self, running) -> dict:
        """1. What each running request feeds this step (``{rid: tokens}``): its tokens not yet in
        the pages, plus drafted tokens for a speculative lane with one pending token: at most the
        tokens it may still keep less one (the model's own next token comes with the accepted drafts),
        so it never feeds past :func:`max_len`."""
        feed = {}
        for r in running:
            pending = r.tokens[r.cached:]
            keep = r.max_new - len(r.out) - 1
            spec = self._spec(r) and r.out and len(pending) == 1 and keep > 0
            feed[r.rid] = pending + (self._draft(r)[:keep] if spec else [])
        return feed

    def _preempt(self, running, waiting, feed) -> None:
        """2. Preemption, decided on the mirror before the step: if the running lanes would not fit
        (with a prefix cache: even with every CACHED page evicted), release the newest first
        (``finish``) and requeue them at the front of ``waiting``."""
        m = self.mirror
        rows, ntok = [r.row for r in running], [len(feed[r.rid]) for r in running]
        victims = self._timed(m.preemption, rows, [-i for i in range(len(running))], ntok,
                              count_cached=self.prefix is not None) if running else []
        if victims:
            gone = set(victims)
            back = [r for r in running if r.row in gone]
            self._finish(back, [r.row for r in back])   # (inserted and released in one order: see _finish)
            for v in back:
                running.remove(v)
                feed.pop(v.rid)
                v.row, v.cached = None, 0
            waiting[:0] = back                      # requeued first, oldest first; recomputed when readmitted
            self.stats.preemptions += len(back)

    def _admit(self, step, waiting, running, feed, by_id) -> tuple:
        """3. Admissions, in arrival order while the mirror says they fit after the decode lanes: a
        request that shares a running parent's prompt forks it, or revives the prefix cache's entries
        its tokens start with, whichever holds more tokens (:meth:`_plan`); others prefill. Each is asked as its whole
        prompt (a fork costs at most that; a revive takes the rest and its revived pages, which
        come out of the CACHED pages that count as room with a prefix cache). Then, the
        admissions done, one ``evict`` of what the step still lacks: after the revives, so no
        page evicted now is revived before the step's read says which were.

        Moves them from ``waiting`` to ``running`` and sets their ``feed``; returns the step's
        lanes ``(decode, prefill)``: rows already held (running, forked or revived requests),
        then prefills.
        """
        m, pc = self.mirror, self.prefix is not None
        decode, prefill = list(running), []

        def ask(extra=()):   # the step's prompts (prefills so far, then ``extra``) and its decode lanes
            return ([len(w.tokens) for w in (*prefill, *extra)], [max_len(w) for w in (*prefill, *extra)],
                    [r.row for r in decode], [len(feed[r.rid]) for r in decode])

        for w in [w for w in waiting if w.arrival <= step][:m.rows_free]:
            if self._timed(m.can_admit, *ask((w,)), count_cached=pc) <= len(prefill):
                break
            waiting.remove(w)
            running.append(w)   # (first: a row its fork or revive takes is released if what follows raises)
            self._take(w, *self._plan(w, by_id), by_id, feed, decode, prefill)
        if pc and decode + prefill:
            self._evict(self._timed(m.shortfall, *ask()))
        return decode, prefill

    def _plan(self, w, by_id) -> tuple:
        """``(share, hit)``: the prompt tokens ``w`` may fork from its running parent (0: none), or the
        prefix cache's entries its tokens start with, whichever holds more tokens (the other empty). A
        preempted child forks its parent again while it runs, unless its own pages, CACHED when it was
        preempted, hold more. A fork takes its copy-on-write page (a partial last page) at once, from
        the FREE pages: without one it shares whole pages only."""
        parent = by_id.get(w.parent) if w.parent is not None else None
        share = (w.shared if parent is not None and parent.row is not None
                 and parent.cached >= w.shared and w.shared < len(w.prompt) else 0)
        if share % self.ps and self.mirror.free < 1:
            share -= share % self.ps
        hit = self._timed(self.prefix.match, w.tokens) if self.prefix is not None else PrefixMatch()
        return (0, hit) if hit.n_tokens > share else (share, PrefixMatch())

    def _take(self, w, share, hit, by_id, feed, decode, prefill) -> None:
        """Admit ``w``: fork its parent's first ``share`` tokens, or revive ``hit``, into a row (a decode
        lane, fed the rest of its tokens), or else leave it to prefill."""
        m, pc = self.mirror, self.prefix is not None
        if share:
            w.row = self._timed(m.fork, by_id[w.parent].row, share, max_len(w), count_cached=pc)
            fork = m.last_fork
            self._timed(self.cache.copy_pages, fork.cow_src, fork.cow_dst)
            self.stats.forks += 1
        elif hit:
            w.row = self._timed(self.prefix.revive, hit, max_len(w), count_cached=pc)
            self.stats.cache_hits += 1
            self.stats.cached_tokens += hit.n_tokens
        else:
            feed[w.rid] = w.tokens
            prefill.append(w)
            return
        w.cached = share or hit.n_tokens
        feed[w.rid] = w.tokens[w.cached:]
        decode.append(w)

    def _evict(self, need) -> None:
        """Evict ``need`` CACHED pages (at most the mirror's sure count), least recently released first."""
        k = min(need, self.mirror.cached)
        if k:
            self._timed(self.prefix.evict, k)
            self.stats.evicted += k

    def _finish(self, reqs, rows) -> None:
        """Release ``reqs`` (their ``rows``, in that order): with a prefix cache their whole pages become
        its entries and stay CACHED. Inserted and released in the same order, so of two copies of one
        prefix the one the entries name (inserted last) is released last, and evicted after the other."""
        if self.prefix is not None:
            for r in reqs:
                self._timed(self.prefix.insert, r.row, r.tokens[:r.cached])
        self._timed(self.mirror.finish, rows, cache=self.prefix is not None)

    def _forward(self, decode, prefill, feed) -> list:
        """4. One ``HostMirror.step`` for every lane (the prefills get their rows), the forward over
        the packed batch and greedy sampling (the step's host read); returns the sampled tokens of the
        kept tokens (:meth:`_kept_tokens`; the model computes only their logits, ``logits_to_keep``, when
        its forward takes it: :func:`tpool.serving.hf.forward_step`), then of padding rows."""
        lanes = decode + prefill
        total = sum(len(feed[r.rid]) for r in lanes)
        self.stats.fed_tokens += total
        self.stats.prompt_tokens += sum(max(len(r.prompt) - r.cached, 0) for r in lanes)
        t_max = max(MIN_TOKEN_BUCKET, 1 << (total - 1).bit_length())
        keep = self._kept_tokens(lanes, feed)
        k_max = self.logits_rows(t_max)
        assert len(keep) <= k_max, (len(keep), k_max)
        # one host buffer, one copy: the step's tokens (padded with 0), then the tokens whose logits are read
        # (padded with token 0: rows nobody reads)
        buf = torch.zeros(t_max + k_max, dtype=torch.long, device="cpu")   # (host, whatever the default device)
        buf[:total] = torch.tensor([t for r in lanes for t in feed[r.rid]], dtype=torch.long, device="cpu")
        buf[t_max:t_max + len(keep)] = torch.tensor(keep, dtype=torch.long, device="cpu")
        if self.dev.type != "cpu":
            buf = buf.pin_memory().to(self.dev, non_blocking=True)
        x, keep = buf[:t_max], buf[t_max:]
        res = self._timed(self.mirror.step, [r.row for r in decode], [len(feed[r.rid]) for r in decode],
                          [len(feed[r.rid]) for r in prefill], [max_len(r) for r in prefill],
                          width=self.max_batch, max_tokens=t_max)
        for r, row in zip(prefill, res.rows):
            r.row = row
        meta = self._timed(step_metadata, self.table, res.result)
        t1 = time.perf_counter()
        with torch.no_grad():
            preds = self.sample(forward_step(self.model, x, PagedContext(self.cache, meta), logits_to_keep=keep))
        self.stats.forward_s += time.perf_counter() - t1
        return preds

    def logits_rows(self, max_tokens: int) -> int:
        """The logits a step of ``max_tokens`` packed tokens computes: ``max_batch * lookahead`` rounded up to
        a multiple of ``LOGITS_ROW_MULTIPLE``, at most ``max_tokens``. A step reads at most ``lookahead``
        tokens' logits a lane (:meth:`_kept_tokens`) over at most ``max_batch`` lanes; the shape is fixed
        by the step's ``max_tokens`` (one per token bucket, as the forward's own), never by what the lanes
        feed. The multiple of 8: on a 2-core x86 CPU, MKL's float32 matmul rounded the products of 1 to 3
        rows, and at 2 threads of 5-7 and 9-11, otherwise than the same rows of a longer product (~1e-6
        apart); of a multiple of 8 rows, bit for bit as the full product (what one BLAS did, not a
        promise: the tests compare tokens with ``generate``)."""
        rows = -(-self.max_batch * self.lookahead // LOGITS_ROW_MULTIPLE) * LOGITS_ROW_MULTIPLE
        return min(max_tokens, rows)

    @staticmethod
    def _kept_tokens(lanes, feed) -> list:
        """The packed tokens whose logits :meth:`_accept` reads, in lane order: each lane's last token not
        in the pages (a prefill lane's last prompt token, a decode lane's one token) and its drafts
        (the prediction after each)."""
        keep, at = [], 0
        for r in lanes:
            n = len(feed[r.rid])
            keep.extend(range(at + len(r.tokens) - r.cached - 1, at + n))
            at += n
        return keep

    def _accept(self, lanes, feed, preds) -> tuple:
        """5. Host bookkeeping of the sampled tokens: each lane keeps its drafts up to the first one the
        model rejects, plus the model's next token (``preds``: one per kept token, :meth:`_kept_tokens`).
        Returns ``(rollback, done)``: the lanes with rejected drafts, and the finished requests."""
        start, rollback, done = 0, [], []
        for r in lanes:
            pending = len(r.tokens) - r.cached
            drafts = feed[r.rid][pending:]
            got = preds[start:start + len(drafts) + 1]     # predictions after the last pending token and each draft
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
            end = next((i for i, tok in enumerate(new) if tok in self.eos), None)   # generate stops there too
            if end is not None:
                new = new[:end + 1]
            r.out.extend(new)
            self.stats.tokens_out += len(new)
            if len(r.out) >= r.max_new or end is not None:
                done.append(r)
            start += len(drafts) + 1
        return rollback, done

    def _release(self, rollback, done, running) -> None:
        """6. One ``truncate`` for the rejected drafts (host-known lengths: the mirror credits their
        pages at once), then one ``finish`` for the finished requests, which leave ``running``."""
        if rollback:
            self._timed(self.mirror.truncate, [r.row for r in rollback], [r.cached for r in rollback])
            self.stats.rollbacks += len(rollback)
        if done:
            self._finish(done, [r.row for r in done])
            for r in done:
                running.remove(r)
                r.row = None

    def check(self) -> dict:
        """The end of a run (a sync point): the pool's, the K/V cache's and the table's checks, no failed extend,
        no row held and no page in use, and the mirror equal to the device's free pages. Returns the pool's
        ``stats()``."""
        self._reconcile(wait=True)
        self.pool.check()
        self.cache.check()
        self.table.check_invariants()
        if self.prefix is not None:
            self.prefix.sync()
            self.prefix.check_invariants()
        s, m = self.pool.stats(), self.mirror
        if (s["requests.failed"] or m.free != s["pages.free.current"] or m.cached != s["pages.cached.current"]
                or not (m.exact and m.cached_exact) or s["pages.used.current"] or m.rows_free != self.max_batch):
            raise AssertionError(f"failed extends {s['requests.failed']}; the mirror counts {m.free} free and "
                                 f"{m.cached} cached pages (exact: {m.exact}, {m.cached_exact}), the device has "
                                 f"{s['pages.free.current']} and {s['pages.cached.current']}; "
                                 f"{s['pages.used.current']} pages in use, {self.max_batch - m.rows_free} rows held")
        return s


def make_requests(n: int = 32, *, seed: int = 0, vocab_size: int = 256, max_new: tuple = (4, 16),
                  prompt_len: tuple = (5, 40), share_every: int = 5, system_len: int = 0):
    """``n`` requests: prompts of ``prompt_len`` tokens, ``max_new`` new tokens, arriving a few per
    step; every ``share_every``-th one (0: none) starts with part of the previous request's prompt.
    With ``system_len``, every prompt starts with the same ``system_len`` tokens (a system prompt,
    what a prefix cache serves again) before its own."""
    share_every = _checks.check_size(share_every, "share_every")
    system_len = _checks.check_size(system_len, "system_len")
    rng = random.Random(seed)
    system = [rng.randrange(1, vocab_size) for _ in range(system_len)]
    reqs = []
    for i in range(n):
        prompt = system + [rng.randrange(1, vocab_size) for _ in range(rng.randint(*prompt_len))]
        r = Request(i, prompt, rng.randint(*max_new), arrival=i // 4)
        if share_every and i % share_every == share_every - 1 and reqs:  # (the first has none before it)
            base = reqs[-1].prompt
            r.parent, r.shared = i - 1, rng.randint(system_len + 1, len(base))
            own = prompt[system_len:]
            r.prompt = base[:r.shared] + own[:max(prompt_len[0] + system_len - r.shared, 1) + rng.randint(0, 8)]
            r.arrival = reqs[-1].arrival + 1
        reqs.append(r)
    return reqs


def eos_ids(model, eos_token_id=EOS_FROM_MODEL) -> frozenset:
    """The token ids that end a request, for :class:`Engine` and :func:`reference_tokens` alike.

    ``eos_token_id``: ``"model"`` (:data:`EOS_FROM_MODEL`, the default): the model's
    ``generation_config.eos_token_id`` (an int, a list, or None), what ``generate`` stops at;
    ``None``: none (every request gets its ``max_new`` tokens); an int or a list of ints: those.
    """
    given = eos_token_id
    if isinstance(eos_token_id, str) and eos_token_id == EOS_FROM_MODEL:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        return frozenset()
    ids = [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
    try:
        ids = list(ids)
    except TypeError:
        ids = [eos_token_id]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"eos_token_id: expected {EOS_FROM_MODEL!r} (the model's generation_config), None (never "
                         f"stop early), a token id (an int >= 0) or a list of them, got {given!r}")
    return frozenset(ids)


def _request_list(requests) -> list:
    """``requests`` as a list: each pass of :meth:`Engine.check_fits` and :meth:`Engine.run` over a generator
    would see only what the passes before it left (nothing), and serve or check nothing, silently."""
    try:
        return list(requests)
    except TypeError:
        raise ValueError(f"requests: expected a list (or another iterable) of Request objects, got "
                         f"{type(requests).__name__}") from None


def _model_device(model, device):
    """The device an :class:`Engine` of ``model`` keeps its pages on: ``device`` (any spelling
    :func:`tpool._checks.resolve_device` takes), which must be the one of the model's weights;
    None: the model's. ``ValueError`` for a model without weights or with them off cpu and cuda."""
    first = next(model.parameters(), None)
    if first is None:
        raise ValueError(f"model: expected a model with weights, got {type(model).__name__} without parameters")
    have = first.device
    if have.type not in ("cpu", "cuda"):
        raise ValueError(f"model: expected its weights on a cpu or cuda device, got {type(model).__name__} on "
                         f"{have} (a model built on the meta device has no weights yet: load them first)")
    have = _checks.resolve_device(have)
    if device is None:
        return have
    want = _checks.resolve_device(device)
    if want != have:
        raise ValueError(f"device: expected the model's device {have} (the forward reads the K/V pages there), "
                         f"got {device!r} ({want}); move the model with model.to({str(want)!r}) first")
    return want


def reference_tokens(model, requests, *, eos_token_id=EOS_FROM_MODEL):
    """Each request's greedy tokens from ``model.generate`` with eager attention (the check).

    Plain greedy decoding, as :class:`Engine` does it: ``generate`` runs on a fresh
    ``GenerationConfig`` (``do_sample=False``; no repetition penalty, forced or suppressed
    token, minimum length or any other processor the model's own generation config may hold),
    and stops at ``eos_token_id`` (:func:`eos_ids`, the :class:`Engine` option of that name,
    same default) or after ``max_new`` tokens. The model's ``generation_config`` and attention
    implementation are put back after.
    """
    from transformers import GenerationConfig
    eos = sorted(eos_ids(model, eos_token_id))
    dev = _model_device(model, None)   # the prompts go where the model is
    saved, saved_attn = model.generation_config, model.config._attn_implementation
    greedy = GenerationConfig(do_sample=False, eos_token_id=eos or None, pad_token_id=saved.pad_token_id)
    model.generation_config = greedy  # generate fills what a passed config leaves None from this one
    model.set_attn_implementation("eager")
    out = {}
    try:
        with torch.no_grad():
            for r in requests:
                greedy.max_new_tokens = r.max_new
                ids = torch.tensor([r.prompt], device=dev)
                out[r.rid] = model.generate(ids, attention_mask=torch.ones_like(ids),
                                            generation_config=greedy)[0, len(r.prompt):].tolist()
        return out
    finally:
        model.set_attn_implementation(saved_attn)  # as it was given (tpool's paged attention, or another)
        model.generation_config = saved


def _checked_tokens(lm, reqs, out) -> dict:
    """:func:`reference_tokens` of ``reqs``, a line to ``out`` whenever the last is older than ``CHECK_PROGRESS_S``:
    ``generate`` decodes each request alone (0.17-0.33 s each on a busy 2-core machine), so the check of
    ``--requests 10000`` would otherwise print nothing for most of an hour."""
    if not out:
        return reference_tokens(lm, reqs)
    want, last = {}, time.monotonic()
    for i in range(0, len(reqs), CHECK_CHUNK):
        want.update(reference_tokens(lm, reqs[i:i + CHECK_CHUNK]))
        if len(want) < len(reqs) and time.monotonic() - last > CHECK_PROGRESS_S:
            out(f"  checked {len(want)} of {len(reqs)} requests", flush=True)
            last = time.monotonic()
    return want


def run_demo(model: str = "llama", *, requests: int = 32, num_pages: int = 48, page_size: int = 4,
             max_batch: int = 8, max_new: tuple = (4, 16), backend: str = "auto", device=None, seed: int = 0,
             system_len: int = 8, prefix_cache: bool = True, out=print) -> dict:
    """Serve ``requests`` random prompts with a tiny random ``model`` on tpool pages; check against generate.

    ``system_len``: every prompt starts with the same that many tokens (see :func:`make_requests`);
    ``prefix_cache``: the engine keeps finished requests' pages and revives them (see :class:`Engine`);
    ``device`` (default: cuda if available, else cpu; cpu for ``backend="numba"``): the model's, the
    pool's and the pages'.
    Returns a dict of counts (steps, preemptions, forks, prefix-cache hits and the tokens they
    held, pages evicted, rollbacks, drafts accepted, tokens) and ``mismatches`` (requests whose
    tokens differ from ``generate``: 0 expected). Raises ``AssertionError`` if any differ, pages
    are left in use, or the pool's or the prefix cache's checks fail.
    """
    try:  # what the options describe: errors here are the caller's (OptionError), not the run's
        requests = _checks.check_size(requests, "requests", 1)   # (0: the longest of no requests below)
        tokens = _checks.check_size(num_pages, "num_pages", 1) * _checks.check_size(page_size, "page_size", 1)
        if tokens > MAX_POOL_TOKENS:  # (before the K/V pages are allocated: they hold every layer's K/V of each)
            raise ValueError(f"--num-pages x --page-size: expected at most {MAX_POOL_TOKENS:,} tokens of K/V pages, "
                             f"got {num_pages:,} x {page_size:,} = {tokens:,}")
        dev = _checks.resolve_device(device, backend=requested_backend(backend))
        lm = tiny_model(model, seed=seed).to(dev)
        positions = lm.config.max_position_embeddings
        if _checks.check_size(system_len, "system_len") > positions:  # (before a list that long is made)
            raise ValueError(f"system_len (--system-prompt): expected at most the model's {positions} positions, "
                             f"got {system_len}")
        reqs = make_requests(requests, seed=seed, vocab_size=lm.config.vocab_size, max_new=max_new,
                             system_len=system_len)
        spec_every, draft_len = 3, 3
        held = max(max_len(r) for r in reqs)
        if held > positions:
            raise ValueError(f"system_len (--system-prompt): a request would hold {held} tokens (system prompt, "
                             f"its own and new tokens), past the model's {positions} positions")
        max_pages = -(-held // page_size)  # a row holds the longest request
        eng = Engine(lm, num_pages=num_pages, page_size=page_size, max_batch=max_batch, max_pages=max_pages,
                     backend=backend, device=dev, spec_every=spec_every, draft_len=draft_len,
                     prefix_cache=prefix_cache)
        try:
            eng.check_fits(reqs)
        except RequestTooLong as e:  # so the pool is what is short
            raise ValueError(f"{e}: raise --num-pages to at least {max_pages} (pages of --page-size "
                             f"{page_size} tokens) so the longest request fits") from None
    except (ValueError, ImportError) as e:
        raise OptionError(str(e)) from e
    if out:
        out(f"tpool serving demo: {model}, {requests} requests, {eng.pool!r}, {eng.cache!r}", flush=True)
    got = eng.run(reqs, out=out)
    ps = eng.check()
    if out:  # (most of a warm run: generate decodes each request alone, token by token)
        out(f"checking the {len(reqs)} requests against the model's own generate (eager attention) ...", flush=True)
    want = _checked_tokens(lm, reqs, out)
    bad = [rid for rid in got if got[rid] != want[rid]]
    s, used = eng.stats, ps["pages.used.current"]
    report = dict(steps=s.steps, preemptions=s.preemptions, forks=s.forks, cache_hits=s.cache_hits,
                  cached_tokens=s.cached_tokens, evicted=s.evicted, rollbacks=s.rollbacks,
                  drafted=s.drafted, accepted=s.accepted, tokens=s.tokens_out, mismatches=len(bad),
                  pages_in_use=used, peak_pages=ps["pages.used.peak"], failed_extends=ps["requests.failed"])
    if out:
        cache = (f"prefix cache: {s.cache_hits} hits holding {s.cached_tokens} tokens, {s.evicted} pages evicted; "
                 if eng.prefix is not None else "no prefix cache; ")
        out(f"{s.steps} steps, {s.tokens_out} tokens; preemptions {s.preemptions}, forks {s.forks}, {cache}rollbacks "
            f"{s.rollbacks} ({s.accepted}/{s.drafted} drafts accepted); peak pages {report['peak_pages']} of "
            f"{num_pages}; pages in use at the end {used}; failed extends {report['failed_extends']}; "
            f"requests matching generate: "
            f"{len(got) - len(bad)}/{len(got)}")
    assert not bad, f"requests {bad} differ from generate"
    assert used == 0, f"{used} pages still in use"
    return report


if __name__ == "__main__":
    from tpool.serving.cli import main
    main()
