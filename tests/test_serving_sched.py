"""The model loop schedules on the host mirror: one host read per step (the sampled tokens), no failed
extend, the mirror a safe bound at every step, preemption of the newest before the step.

Tested with transformers 5.24.0 (the ``tpool[hf]`` extra); skipped without transformers.
"""

import numpy as np
import pytest
import torch

from conftest import requires_cuda
from tpool.scheduling import HostMirror
from tpool.testing import count_host_reads, without_logits_to_keep

pytest.importorskip("transformers")

from tpool import demo  # noqa: E402
from tpool.scheduling.snapshot import MirrorSnapshot  # noqa: E402
from tpool.serving import engine  # noqa: E402

SMALL = dict(num_pages=16, page_size=4, max_batch=4)   # preempts, forks (with a CoW page), rolls back
CACHED = dict(num_pages=24, page_size=4, max_batch=4)  # with 10 requests of a system prompt: hits, evictions too


@pytest.fixture(scope="module")
def llama():
    return engine.tiny_model("llama", seed=0)


def _engine(model, backend, requests, prefix_cache=False, **kw):
    draft = 3
    max_pages = -(-max(len(r.prompt) + r.max_new + draft for r in requests) // kw["page_size"])
    return engine.Engine(model, backend=backend, max_pages=max_pages, draft_len=draft, prefix_cache=prefix_cache,
                         **kw)


def _plain(model, num_pages, max_batch, max_pages, **kw):
    """An engine on the reference backend with pages of 4 tokens and no speculation (``kw``: e.g.
    ``prefix_cache``), as most tests below want: every admission, fork and revive exact to count."""
    return engine.Engine(model, num_pages=num_pages, page_size=4, max_batch=max_batch, max_pages=max_pages,
                         backend="reference", spec_every=0, draft_len=0, **kw)


class _Admissions(list):
    """Every ``Engine._take`` call of a run, in order: a dict per admitted request of its ``rid``, its
    tokens ``out`` so far, the prompt tokens it forks (``share``) or revives from the prefix cache
    (``revive``), the mirror's ``free`` pages then, and whether its parent ``runs``."""

    def of(self, *keys):
        """The admissions' ``keys``, a tuple each (a bare value for one key)."""
        return [a[keys[0]] if len(keys) == 1 else tuple(a[k] for k in keys) for a in self]


@pytest.fixture
def admissions(monkeypatch):
    seen = _Admissions()
    take = engine.Engine._take

    def spy(self, w, share, hit, by_id, *a):
        parent = by_id.get(w.parent) if w.parent is not None else None
        seen.append(dict(rid=w.rid, out=len(w.out), share=share, revive=hit.n_tokens, free=self.mirror.free,
                         runs=parent is not None and parent.row is not None))
        return take(self, w, share, hit, by_id, *a)

    monkeypatch.setattr(engine.Engine, "_take", spy)
    return seen


def _functions(stack):
    return {name for _, name in stack}


@pytest.mark.parametrize("cached", [False, True], ids=["no-prefix-cache", "prefix-cache"])
@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_a_whole_run_reads_the_device_once_per_step_for_the_sampled_tokens(llama, backend, cached):
    """With the prefix cache, the slots of the step's evictions ride in the same read."""
    # (seed 3: a cached run that also accepts drafts)
    reqs = engine.make_requests(10, system_len=8, seed=3) if cached else engine.make_requests(6)
    eng = _engine(llama, backend, reqs, prefix_cache=cached, **(CACHED if cached else SMALL))
    with count_host_reads() as seen:
        got = eng.run(reqs)
        stats = eng.check()
    steps = eng.stats.steps
    in_check = [s for _, s in seen.reads if "check" in _functions(s)]
    sampled = [s for _, s in seen.reads if "check" not in _functions(s)]
    # One read per step, each of them the sampled tokens; the rest are the final check's.
    assert len(sampled) == steps > 30 and all("sample" in _functions(s) for s in sampled), \
        [(w, s[:3]) for w, s in seen.reads if "sample" not in _functions(s) and "check" not in _functions(s)][:3]
    assert in_check and len(seen.reads) == steps + len(in_check)
    # Snapshots (host memory an async copy filled) only where the mirror reconciles.
    assert all("_reconcile" in _functions(s) for _, s in seen.snapshot_reads)
    assert stats["requests.failed"] == 0 and stats["pages.used.current"] == 0
    s = eng.stats
    assert s.preemptions > 0 and s.forks > 0 and s.rollbacks > 0 and 0 < s.accepted < s.drafted
    assert (s.cache_hits > 0 and s.evicted > 0) == cached
    assert got == engine.reference_tokens(llama, reqs)


def test_the_mirror_is_a_safe_bound_at_every_step_and_exact_without_shared_prefixes(llama, monkeypatch):
    """Checked before each step's reconciliation and at its sync point (reading the device there is
    the test's, not the loop's)."""
    seen = []
    sample, reconcile = engine.Engine.sample, engine.Engine._reconcile

    def check(self):
        m = self.mirror
        seen.append((m.free, self.pool.available(), m.exact))
        assert m.reserved <= m.free <= seen[-1][1] and m.cached <= self.pool.stats()["pages.cached.current"]

    monkeypatch.setattr(engine.Engine, "sample", lambda self, logits: (check(self), sample(self, logits))[1])
    monkeypatch.setattr(engine.Engine, "_reconcile", lambda self, **k: (check(self), reconcile(self, **k))[1])
    for share_every, forks in ((5, True), (0, False)):
        seen.clear()
        reqs = engine.make_requests(10, share_every=share_every)
        eng = _engine(llama, "numba", reqs, **{**SMALL, "num_pages": 24})
        assert eng.run(reqs) == engine.reference_tokens(llama, reqs)
        eng.check()
        assert all(free == avail for free, avail, exact in seen if exact)
        # A released forked prefix leaves the mirror under-counting until a snapshot lands.
        assert any(free < avail for free, avail, _ in seen) == forks == (eng.stats.forks > 0)
        assert eng.stats.preemptions > 0
    # With the prefix cache (revives, evictions, releases into CACHED): still a safe bound at every step.
    seen.clear()
    reqs = engine.make_requests(10, system_len=8)
    eng = _engine(llama, "numba", reqs, prefix_cache=True, **CACHED)
    assert eng.run(reqs) == engine.reference_tokens(llama, reqs)
    eng.check()
    assert seen and all(free == avail for free, avail, exact in seen if exact)
    assert eng.stats.cache_hits > 0 and eng.stats.evicted > 0


def test_preemption_releases_the_newest_running_requests_before_the_step(llama, monkeypatch):
    order = []   # ("preempt", rows, priority, victims), ("finish", rows), ("step", decode rows), in call order
    preemption, finish, step = HostMirror.preemption, HostMirror.finish, HostMirror.step

    def spy_preemption(self, rows, priority, n=1, **k):
        victims = preemption(self, rows, priority, n, **k)
        order.append(("preempt", list(rows), list(priority), victims))
        return victims

    monkeypatch.setattr(HostMirror, "preemption", spy_preemption)
    monkeypatch.setattr(HostMirror, "finish", lambda self, rows, **k: (order.append(("finish", list(rows))),
                                                                       finish(self, rows, **k))[1])
    monkeypatch.setattr(HostMirror, "step", lambda self, *a, **k: (order.append(("step", list(a[0]))),
                                                                   step(self, *a, **k))[1])
    reqs = engine.make_requests(10)
    eng = _engine(llama, "numba", reqs, **{**SMALL, "num_pages": 24})
    assert eng.run(reqs) == engine.reference_tokens(llama, reqs)
    preempting = [i for i, e in enumerate(order) if e[0] == "preempt" and e[3]]
    assert preempting and eng.stats.preemptions == sum(len(order[i][3]) for i in preempting)
    for i in preempting:
        _, rows, prio, victims = order[i]
        assert prio == sorted(prio, reverse=True)                         # admission order: the newest last
        assert sorted(victims) == sorted(r for _, r in sorted(zip(prio, rows))[:len(victims)])
        assert order[i + 1] == ("finish", victims)                       # released before the step ...
        nxt = order[i + 2] if i + 2 < len(order) else None
        assert nxt is None or nxt[0] != "step" or not set(victims) & set(nxt[1])   # ... which runs without them
    assert eng.check()["requests.failed"] == 0


def test_reservations_hold_the_worst_case_draft_and_truncate_gives_the_rest_back(llama, monkeypatch):
    reqs = engine.make_requests(6, share_every=0)      # no forks: the mirror stays exact
    eng = _engine(llama, "numba", reqs, **SMALL)
    assert eng.mirror.lookahead == 1 + eng.draft_len
    truncated = []
    truncate = HostMirror.truncate

    def spy(self, rows, new_lens):
        before = (self.free, self.reserved, self.hi[rows].tolist())
        truncate(self, rows, new_lens)
        truncated.append((before, (self.free, self.reserved), list(new_lens)))
        assert self.free == eng.pool.available()    # exact here: host-known lengths

    monkeypatch.setattr(HostMirror, "truncate", spy)
    assert eng.run(reqs) == engine.reference_tokens(llama, reqs)
    assert truncated
    # Some rollback freed a page the drafts had taken (a draft past a page boundary, rejected).
    assert any(after[0] > before[0] for before, after, _ in truncated)
    eng.check()


def test_the_demo_command_prints_the_mirror_and_no_failed_extend(capsys):
    from tpool.__main__ import main
    assert main(["demo", "--model", "llama", "--requests", "8", "--num-pages", "16", "--max-batch", "4",
                 "--backend", "numba"]) == 0
    out = capsys.readouterr().out
    assert "free pages (mirror)" in out and "requests matching generate: 8/8" in out


# ----------------------------------------------------------------- GPU only
@requires_cuda
@pytest.mark.gpu
def test_gpu_engine_run_never_syncs_but_for_the_sampled_tokens(monkeypatch):
    """The whole loop under ``set_sync_debug_mode("error")``, with ``pool.stats_async()`` every step;
    only the sampled-token read (``Engine.sample``) runs outside it."""
    model = engine.tiny_model("llama", seed=0)
    reqs = engine.make_requests(10)
    want = engine.reference_tokens(model, reqs)
    model = model.cuda()
    handles, seen_clock = [], [0]
    sample = engine.Engine.sample

    def read(self, logits):
        handles.append(self.pool.stats_async())           # every step, still in "error" mode
        while handles and handles[0].ready():
            seen_clock[0] = max(seen_clock[0], handles.pop(0).get()["clock"])
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("default")
        try:
            return sample(self, logits)                    # the step's one sync point
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    monkeypatch.setattr(engine.Engine, "sample", read)

    warm = _engine(model, "triton", reqs, device="cuda", **SMALL)
    warm.run(engine.make_requests(10))                     # compiles every kernel shape outside the check
    torch.cuda.synchronize()
    handles.clear()
    seen_clock[0] = 0
    eng = _engine(model, "triton", reqs, device="cuda", **SMALL)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = eng.run(engine.make_requests(10))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stats = eng.check()
    assert got == want and stats["requests.failed"] == 0 and eng.stats.preemptions > 0
    # Each step's snapshot had landed by the next step (after its sampled-token read): read without a wait.
    assert 0 < seen_clock[0] <= stats["clock"]


@pytest.mark.parametrize("rid", [1, 3])   # plain, speculative: 5 + 4 - 1 either way (no draft past max_new)
def test_a_request_at_the_limit_runs_and_one_past_it_is_refused(llama, rid):
    """A row holds 2 pages of 4 tokens: a request holding exactly 8 tokens at most (its last token is
    never fed; a speculative one drafts no token past the ones it may keep) runs and matches generate."""
    kw = dict(num_pages=2, page_size=4, max_batch=2, max_pages=2, backend="reference", spec_every=3, draft_len=3)
    fits = engine.Request(rid, [5, 6, 7, 5, 6], max_new=4)   # (a repeat: prompt lookup drafts from it)
    assert engine.max_len(fits) == 8
    eng = engine.Engine(llama, **kw)
    assert eng.run([fits]) == engine.reference_tokens(llama, [fits])
    assert eng.check()["pages.used.peak"] == 2
    assert (eng.stats.drafted > 0) == (rid == 3)           # rid 3 speculative: it drafted; rid 1 did not
    past = engine.Request(rid, list(range(5, 11)), max_new=4)
    with pytest.raises(engine.RequestTooLong, match=rf"request {rid}: expected prompt \+ max_new - 1 <= 8 tokens "
                                                    rf"\(max_pages and the pool\), got 9"):
        engine.Engine(llama, **kw).run([past])


def test_the_demo_sizes_rows_by_the_tokens_a_request_holds(monkeypatch):
    """``max_pages`` of the demo's engine: the pages of the longest request's ``max_len``, no more."""
    seen = {}

    class Recording(engine.Engine):
        def __init__(self, model, **kw):
            seen.update(kw)
            super().__init__(model, **kw)

    monkeypatch.setattr(engine, "Engine", Recording)
    engine.run_demo("llama", backend="reference", out=None, requests=4, num_pages=16, page_size=4, max_batch=4,
                    max_new=(3, 6))
    reqs = engine.make_requests(4, max_new=(3, 6), system_len=8)   # (the demo's system prompt)
    held = max(len(r.prompt) + r.max_new - 1 for r in reqs)
    assert seen["max_pages"] == -(-held // 4) and seen["spec_every"] == 3 and seen["draft_len"] == 3


@pytest.mark.parametrize("requests, got", [(0, "0"), (-3, "-3"), (2.5, "2.5")])
def test_the_demo_refuses_a_request_count_below_one_naming_it(requests, got):
    """``run_demo(requests=0)`` raised ``OptionError: max() arg is an empty sequence`` (the longest of no
    requests); the command line's own check never let 0 through, the function's callers had none."""
    with pytest.raises(demo.OptionError, match=f"^requests: expected a positive int, got {got}$"):
        engine.run_demo("llama", requests=requests, backend="reference", out=None)


def test_an_empty_prompt_is_refused_instead_of_looping(llama):
    """Nothing predicts the first token of an empty prompt: run() used to step forever."""
    eng = engine.Engine(llama, num_pages=32, page_size=4, max_batch=4, max_pages=8, backend="numba", spec_every=0,
                        draft_len=0)
    reqs = [engine.Request(0, [5, 6], 3), engine.Request(1, [], 3)]
    for call in (eng.check_fits, eng.run):
        with pytest.raises(ValueError, match="request 1: expected a prompt of at least 1 token, got 0 tokens"):
            call(reqs)
    assert eng.stats.steps == 0


def test_a_generator_of_requests_is_served_and_checked_as_the_list_it_yields(llama):
    """run() and check_fits() each read their requests several times: a generator was exhausted by the first
    pass, so run() served nothing and returned {} and check_fits() skipped its parent and length checks."""
    eng = engine.Engine(llama, num_pages=16, page_size=4, max_batch=4, max_pages=8, backend="reference")
    reqs = engine.make_requests(3, max_new=(3, 5), prompt_len=(5, 12))
    assert eng.run(r for r in reqs) == engine.reference_tokens(llama, reqs)
    assert all(r.out for r in reqs)
    eng.check()
    long = engine.Request(0, [5] * 30, 4)
    with pytest.raises(engine.RequestTooLong, match="request 0: expected prompt"):
        eng.check_fits(iter([long]))
    orphan = engine.Request(1, [5, 6, 7], 2, parent=9, shared=2)
    with pytest.raises(ValueError, match="expected parent 9's prompt"):
        eng.run(iter([orphan]))
    with pytest.raises(ValueError, match=r"requests: expected a list \(or another iterable\) of Request objects, "
                                         r"got Request"):
        eng.run(long)
    assert eng.stats.steps > 0 and eng.check()["pages.used.current"] == 0


def test_run_makes_one_list_of_its_requests(llama, monkeypatch):
    """run() made a list of its requests and check_fits() a second copy of that list; the checks now take
    run's list."""
    made = []
    listed = engine._request_list
    monkeypatch.setattr(engine, "_request_list", lambda reqs: made.append(1) or listed(reqs))
    eng = engine.Engine(llama, num_pages=16, page_size=4, max_batch=4, max_pages=8, backend="reference")
    reqs = engine.make_requests(2, max_new=(2, 3), prompt_len=(3, 5))
    assert eng.run(iter(reqs)) == engine.reference_tokens(llama, reqs) and made == [1]
    eng.check_fits(iter(engine.make_requests(2, prompt_len=(3, 5))))   # any iterable still: listed once
    assert made == [1, 1]


def test_requests_the_loop_would_serve_wrongly_are_refused(llama):
    """Two requests with one rid both came back with the second one's tokens (feeds and results are
    keyed by rid); a parent whose prompt differs would have lent its K/V to other tokens."""
    eng = engine.Engine(llama, num_pages=32, page_size=4, max_batch=4, max_pages=8, backend="numba", spec_every=0,
                        draft_len=0)
    R = engine.Request
    cases = (([R(1, [3, 4, 5, 6], 4), R(1, [7, 8, 9, 10], 4)], "request 1: expected one request per rid"),
             ([R(0, [5, 6], 3), R(1, [5, 7, 8], 3, parent=0, shared=2)],
              r"request 1: expected parent 0's prompt to start with its first shared=2 prompt tokens, but request "
              r"0 starts with other tokens"),
             ([R(1, [5, 7, 8], 3, parent=4, shared=1)], "but request 4 is not among the requests"),
             ([R(0, [5], 3), R(1, [5, 7, 8], 3, parent=0, shared=2)], "but request 0 has a 1-token prompt"),
             ([R(0, [5, 6], 3), R(1, [5, 7], 3, parent=0, shared=-1)],
              r"request 1: expected shared \(its prompt tokens from parent 0\) a non-negative int, got -1"))
    for reqs, match in cases:
        for call in (eng.check_fits, eng.run):
            with pytest.raises(ValueError, match=match):
                call(reqs)
    assert eng.stats.steps == 0
    reqs = [R(0, [5, 6, 7], 3), R(1, [5, 6, 9], 3, parent=0, shared=2)]
    first = eng.run(reqs)
    assert first == engine.reference_tokens(llama, reqs)
    with pytest.raises(ValueError, match=r"request 0: expected a new Request, got one already served \(out has 3 "
                                         r"tokens"):
        eng.run(reqs)           # it returned the old tokens, served nothing
    again = [R(r.rid, r.prompt, r.max_new, parent=r.parent, shared=r.shared) for r in reqs]
    assert eng.run(again) == first
    # shared past the request's own prompt: its whole prompt is the parent's start, served without a fork
    reqs = [R(0, [5, 6, 7], 3), R(1, [5], 3, parent=0, shared=2)]
    assert eng.run(reqs) == engine.reference_tokens(llama, reqs)
    with pytest.raises(engine.RequestTooLong, match=r"request 0: expected prompt \+ max_new - 1"):
        eng.check_fits([R(0, [5] * 40, 3)])


def test_requests_with_bad_fields_are_refused_before_the_first_step(llama):
    """A token id past the vocabulary failed in the model's embedding (IndexError; a device assert on a GPU)
    after the mirror had taken rows and pages for it: two rows and two pages were lost for good and
    check() saw nothing (mirror and device lost the same). max_new <= 0 ran a prefill and returned []
    where generate raises; a tuple prompt failed on the first step."""
    eng = engine.Engine(llama, num_pages=32, page_size=2, max_batch=4, max_pages=8, backend="numba", spec_every=0,
                        draft_len=0)
    R = engine.Request
    cases = (([R(0, [1, 2, 3], 2), R(1, [4, 256], 2)], r"request 1: expected prompt token ids in \[0, 256\) \(the "
                                                        r"model's embedding rows\), got 256"),
             ([R(0, [1, -1], 2)], r"expected prompt token ids in \[0, 256\) .*got -1"),
             ([R(0, [1, 2.0], 2)], "request 0: prompt token: expected a non-negative int, got 2.0"),
             ([R(0, [1, 2], 0)], r"request 0: max_new \(tokens to generate.*expected a positive int, got 0"),
             ([R(0, [1, 2], -3)], "expected a positive int, got -3"),
             ([R(0, (1, 2), 2)], "request 0: expected the prompt as a list of token ids, got tuple"),
             ([R("a", [1, 2], 2)], "request 'a': expected rid an int, got 'a'"),
             ([R(0, [1, 2], 2, arrival=0.5)], "request 0: expected arrival an int, got 0.5"),
             ([(0, [1, 2], 2)], "requests: expected Request objects, got tuple"))
    for reqs, match in cases:
        for call in (eng.check_fits, eng.run):
            with pytest.raises(ValueError, match=match):
                call(reqs)
    assert eng.stats.steps == 0
    reqs = [R(0, [np.int64(5), 6, 7], 3), R(1, [255, 0], 2)]   # numpy ints and both ends of the vocabulary
    assert eng.run(reqs) == engine.reference_tokens(llama, [R(0, [5, 6, 7], 3), R(1, [255, 0], 2)])
    eng.check()
    assert eng.mirror.rows_free == 4 and eng.pool.stats()["pages.used.current"] == 0   # every row and page back


def test_an_engine_with_more_rows_than_the_pools_default_batch_serves(llama):
    """The pool took its default max_batch (4096) whatever the table's rows: a step over more lanes was
    refused naming "width" and max_batch=4096, a parameter the caller never gave."""
    eng = engine.Engine(llama, num_pages=16, page_size=4, max_batch=4100, max_pages=2, backend="numba",
                        spec_every=0, draft_len=0)
    assert eng.pool.max_batch >= 4100
    reqs = [engine.Request(0, [5, 6], 2)]
    assert eng.run(reqs) == engine.reference_tokens(llama, reqs)


def test_speculation_options_are_checked_and_draft_len_zero_drafts_nothing(llama):
    kw = dict(num_pages=64, page_size=4, max_batch=2, max_pages=16, backend="numba")
    for bad, match in ((dict(spec_every=-1), "spec_every: expected a non-negative int, got -1"),
                       (dict(draft_len=-2), "draft_len: expected a non-negative int, got -2"),
                       (dict(draft_len=1.5), "draft_len: expected a non-negative int, got 1.5")):
        with pytest.raises(ValueError, match=match):
            engine.Engine(llama, **kw, **bad)
    eng = engine.Engine(llama, **kw, spec_every=1, draft_len=0)
    r = engine.Request(0, [5, 6, 7], 4)
    r.out = [9]
    assert eng._draft(r) == []                        # toks[-0:] was every token
    reqs = [engine.Request(0, [5, 6, 7], 4), engine.Request(1, [8, 5, 8], 5)]
    assert eng.run(reqs) == engine.reference_tokens(llama, reqs) and eng.stats.drafted == 0
    eng.check()


def test_make_requests_shares_with_the_previous_request_for_any_share_every():
    reqs = engine.make_requests(6, share_every=1)    # the first has no request before it (IndexError before)
    assert reqs[0].parent is None and [r.parent for r in reqs[1:]] == [0, 1, 2, 3, 4]
    assert all(r.prompt[:r.shared] == reqs[r.parent].prompt[:r.shared] for r in reqs[1:])
    assert [r.prompt for r in engine.make_requests(6)] == [r.prompt for r in engine.make_requests(6, share_every=5)]
    with pytest.raises(ValueError, match="share_every: expected a non-negative int, got -1"):
        engine.make_requests(4, share_every=-1)


def _random_config(seed, vocab):
    """A random workload and engine: page size, pool (from one request's worth to four times it), rows,
    speculation, shared prefixes, system prompt, with or without the prefix cache."""
    import random
    rng = random.Random(seed)
    ps, spec_every, draft_len = rng.choice([1, 2, 4, 8]), rng.choice([0, 1, 2, 3]), rng.choice([0, 1, 3])
    reqs = engine.make_requests(rng.randint(4, 12), seed=seed, vocab_size=vocab, max_new=(1, rng.randint(1, 9)),
                                prompt_len=(1, rng.randint(2, 20)), share_every=rng.choice([0, 2, 3, 5]),
                                system_len=rng.choice([0, 3, 8, 12]))
    need = -(-max(engine.max_len(r) for r in reqs) // ps)
    kw = dict(num_pages=need + rng.randint(0, 3 * need), page_size=ps, max_batch=rng.randint(1, 6), max_pages=need,
              spec_every=spec_every, draft_len=draft_len, prefix_cache=rng.random() < 0.75)
    return reqs, kw


def test_random_configurations_serve_the_tokens_of_generate(llama):
    """60 random workloads and engines (numba): every request's tokens equal generate's, no page
    left in use, the pool's, table's and prefix cache's checks pass; together the runs preempt,
    fork, hit and evict the prefix cache and roll drafts back (else the sweep checks too little)."""
    seen = dict(preemptions=0, forks=0, cache_hits=0, evicted=0, rollbacks=0)
    for seed in range(60):
        reqs, kw = _random_config(seed, llama.config.vocab_size)
        want = engine.reference_tokens(llama, reqs)
        eng = engine.Engine(llama, backend="numba", **kw)
        got = eng.run(reqs)
        stats = eng.check()
        assert got == want, f"seed {seed} ({kw}): requests {[r for r in got if got[r] != want[r]]} differ"
        assert stats["pages.used.current"] == 0 and stats["requests.failed"] == 0, (seed, kw)
        for k in seen:
            seen[k] += getattr(eng.stats, k)
    assert all(seen.values()), seen


def test_attention_in_chunks_of_two_tokens_serves_the_same_logits_and_tokens(llama, monkeypatch):
    """A run whose attention budget forces chunks of two tokens (``chunk_bytes=1``: the floor) gets
    every step's logits bit for bit as a run with one chunk a call, so the same tokens, those of
    ``generate``: a smaller budget (a larger model, a longer row) never changes what is served."""
    import functools

    from tpool.serving import attention
    made, chunk, step = engine.PagedContext, attention._attend_chunk, engine.forward_step

    def served(budget):
        sizes, logits = set(), []
        monkeypatch.setattr(engine, "PagedContext", lambda cache, meta: made(
            cache, meta, attend=functools.partial(attention.paged_attention, chunk_bytes=budget)))
        monkeypatch.setattr(attention, "_attend_chunk", lambda qg, *a: sizes.add(qg.shape[0]) or chunk(qg, *a))
        monkeypatch.setattr(engine, "forward_step", lambda *a, **k: logits.append(step(*a, **k)) or logits[-1])
        reqs = engine.make_requests(6, seed=5, system_len=8)
        eng = _engine(llama, "numba", reqs, prefix_cache=True, **CACHED)
        got = eng.run(reqs)
        eng.check()
        return got, sizes, logits, reqs

    one, one_sizes, one_logits, reqs = served(1 << 40)
    two, two_sizes, two_logits, _ = served(1)
    assert two_sizes == {2} and max(one_sizes) > 2                   # the budget did force smaller chunks
    assert len(two_logits) == len(one_logits) and all(torch.equal(a, b) for a, b in zip(two_logits, one_logits))
    assert two == one == engine.reference_tokens(llama, reqs)


# Checks of the engine a mutation run (session 37, helper-129) could move by one unseen; each test fails on
# its mutant (S06-S14 in its report).

def test_check_fits_bounds_a_request_by_the_pool_too_not_only_max_pages(llama):
    """S06: cap = min(max_pages, num_pages) * page_size. With max_pages (4) past the pool's 2 pages, a request
    holding 9..16 tokens fits a row but never the pool: refused up front, not admitted to wait forever."""
    eng = _plain(llama, 2, 1, 4)
    eng.check_fits([engine.Request(0, list(range(5, 13)), 1)])           # 8 tokens: the whole pool
    with pytest.raises(engine.RequestTooLong, match=r"<= 8 tokens \(max_pages and the pool\), got 9"):
        eng.check_fits([engine.Request(0, list(range(5, 14)), 1)])


def test_eos_token_id_zero_is_a_token_id():
    """S13: token id 0 is an id like any other (an int >= 0, as the error message says)."""
    assert engine.eos_ids(None, 0) == frozenset({0})
    assert engine.eos_ids(None, [0, 7]) == frozenset({0, 7})


def test_the_demo_takes_a_system_prompt_whose_longest_request_holds_exactly_the_models_positions(monkeypatch):
    """S14: ``held > positions`` refuses; a request holding exactly max_position_embeddings tokens is served."""
    positions = 512
    kw = dict(vocab_size=256, max_new=(4, 16))
    held = lambda s: max(engine.max_len(r) for r in engine.make_requests(2, seed=0, system_len=s, **kw))  # noqa: E731
    s = next(s for s in range(positions - 120, positions) if held(s) == positions)

    class Built(Exception):
        pass

    def stop(*a, **k):
        raise Built
    monkeypatch.setattr(engine, "Engine", stop)
    with pytest.raises(Built):                   # past the option checks: the engine is built
        engine.run_demo("llama", requests=2, backend="reference", device="cpu", system_len=s, out=None)
    past = next(s2 for s2 in range(s + 1, positions + 1) if held(s2) > positions)
    with pytest.raises(demo.OptionError, match="past the model's 512 positions"):
        engine.run_demo("llama", requests=2, backend="reference", device="cpu", system_len=past, out=None)


def test_shared_past_the_parents_prompt_is_refused_even_when_the_requests_own_prompt_is_shorter(llama):
    """S08: ``r.shared > len(p.prompt)`` refuses; off by one, shared = len(parent's prompt) + 1 passed whenever
    the request's own prompt was no longer than the parent's (the prefix comparison saw equal lists)."""
    eng = _plain(llama, 32, 4, 8)
    R = engine.Request
    with pytest.raises(ValueError, match="but request 0 has a 2-token prompt"):
        eng.check_fits([R(0, [5, 6], 3), R(1, [5], 3, parent=0, shared=3)])


def test_a_request_whose_whole_prompt_is_its_parents_start_is_served_as_generate(llama):
    """S10: a fork takes ``shared < len(prompt)`` tokens only: a request whose prompt is all shared has no
    token left to feed; forking it all gave a lane of 0 tokens that read another lane's prediction."""
    R = engine.Request
    reqs = [R(0, [5, 6, 7, 8, 9], 4), R(1, [5, 6, 7], 4, arrival=1, parent=0, shared=3)]
    eng = _plain(llama, 32, 4, 8, prefix_cache=False)
    assert eng.run(reqs) == engine.reference_tokens(llama, reqs)
    eng.check()


def test_a_child_forks_a_parent_holding_exactly_the_shared_tokens(llama):
    """S11: ``parent.cached >= w.shared``: a parent whose pages hold exactly the shared tokens is forked (not
    recomputed)."""
    R = engine.Request
    reqs = [R(0, [5, 6, 7], 3), R(1, [5, 6, 7, 9], 3, arrival=1, parent=0, shared=3)]
    eng = _plain(llama, 32, 4, 8, prefix_cache=False)
    assert eng.run(reqs) == engine.reference_tokens(llama, reqs)
    assert eng.stats.forks == 1
    eng.check()


R = engine.Request


def test_without_speculation_a_running_request_reserves_one_token(llama, monkeypatch):
    """``lookahead`` is ``1 + draft_len`` only with speculation: with ``spec_every=0`` a request reserves its
    next token only, whatever ``draft_len``. Two 3-token prompts then start together on a 3-page pool of
    4-token pages (a page each); reserving 4 tokens ahead (2 pages each) would have admitted one alone."""
    prefills = []
    step = HostMirror.step
    monkeypatch.setattr(HostMirror, "step", lambda self, *a, **k: (prefills.append(len(a[2])), step(self, *a, **k))[1])
    eng = engine.Engine(llama, num_pages=3, page_size=4, max_batch=2, max_pages=2, backend="reference",
                        spec_every=0, draft_len=3, prefix_cache=False)
    reqs = [R(0, [5, 6, 7], 6), R(1, [8, 9, 10], 6)]
    assert eng.run(reqs) == engine.reference_tokens(llama, reqs)
    assert prefills[0] == 2
    assert eng.lookahead == 1 and eng.mirror.lookahead == 1
    assert eng.stats.drafted == 0
    eng.check()


def test_drafts_are_the_tokens_after_the_last_earlier_occurrence_of_the_last_token(llama):
    """Prompt lookup: the ``draft_len`` tokens that followed the last earlier occurrence of the last token,
    an occurrence at index 0 included; the occurrence itself is not drafted."""
    eng = engine.Engine(llama, num_pages=16, page_size=4, max_batch=2, max_pages=4, backend="reference",
                        spec_every=1, draft_len=2)
    r = R(0, [5, 6, 7], 4)
    r.out = [5]
    assert eng._draft(r) == [6, 7]                 # the earlier 5 is the prompt's first token
    r = R(0, [1, 5, 6, 9, 5, 8], 4)
    r.out = [5]
    assert eng._draft(r) == [8, 5]                 # the last earlier 5 (index 4), not the first
    r = R(0, [1, 2, 3], 4)
    r.out = [4]
    assert eng._draft(r) == [3, 4]                 # no earlier occurrence: the last draft_len tokens


def test_a_request_with_cached_tokens_set_is_refused_as_already_served(llama):
    """``cached`` is the engine's own record of the tokens in a row's pages: a Request arriving with it set
    (out empty, no row) is one already served, refused before any step."""
    eng = _plain(llama, 32, 4, 8)
    r = R(0, [5, 6, 7], 3)
    r.cached = 2
    for call in (eng.check_fits, eng.run):
        with pytest.raises(ValueError, match=r"request 0: expected a new Request, got one already served \(out has "
                                             r"0 tokens, row=None, cached=2\)"):
            call([r])
    assert eng.stats.steps == 0


def test_a_request_naming_itself_as_parent_is_refused(llama):
    """A request's ``parent`` is another request: one naming its own rid is refused, naming it."""
    eng = _plain(llama, 32, 4, 8)
    reqs = [R(0, [5, 6, 7], 3), R(1, [5, 6, 8], 3, parent=1, shared=2)]
    for call in (eng.check_fits, eng.run):
        with pytest.raises(ValueError, match=r"request 1: expected parent 1's prompt to start with its first "
                                             r"shared=2 prompt tokens, but request 1 is the request itself"):
            call(reqs)
    assert eng.stats.steps == 0


def test_at_most_one_snapshot_of_the_pool_is_in_flight(llama, monkeypatch):
    """The loop starts a snapshot only when none is on its way: while one has not landed (here: each
    lands on its third ``ready()``), steps neither wait for it nor start another."""
    calls = {}
    ready = MirrorSnapshot.ready

    def slow_ready(self):
        calls[id(self)] = calls.get(id(self), 0) + 1
        return calls[id(self)] >= 3 and ready(self)

    monkeypatch.setattr(MirrorSnapshot, "ready", slow_ready)
    in_flight = []
    reconcile = engine.Engine._reconcile
    monkeypatch.setattr(engine.Engine, "_reconcile",
                        lambda self, **k: (reconcile(self, **k), in_flight.append(len(self._snapshots)))[0])
    reqs = engine.make_requests(10, share_every=5)          # forks: releases leave the mirror inexact
    max_pages = -(-max(engine.max_len(r) for r in reqs) // 4)
    eng = engine.Engine(llama, num_pages=24, page_size=4, max_batch=4, max_pages=max_pages, backend="numba",
                        prefix_cache=False)
    assert eng.run(reqs) == engine.reference_tokens(llama, reqs)
    eng.check()
    assert eng.stats.forks > 0 and 1 in in_flight          # some snapshot stayed in flight across a step
    assert max(in_flight) == 1


def test_a_bool_rid_or_arrival_is_refused(llama):
    """``rid`` and ``arrival`` are ints; a bool (an int subclass) is refused as it is for every other count."""
    eng = _plain(llama, 32, 4, 8)
    for r, match in ((R(True, [1, 2], 2), "request True: expected rid an int, got True"),
                     (R(0, [1, 2], 2, arrival=False), "request 0: expected arrival an int, got False")):
        for call in (eng.check_fits, eng.run):
            with pytest.raises(ValueError, match=match):
                call([r])
    assert eng.stats.steps == 0


def test_admission_is_first_come_first_served_by_arrival_not_by_rid(llama, admissions):
    """Waiting requests are admitted in arrival order (rid breaks ties): with one row, request 2 (arrived
    at step 0) goes before request 0 (arrived at step 1), though its rid is higher."""
    eng = _plain(llama, 16, 1, 4, prefix_cache=False)
    reqs = [R(0, [5, 6, 7], 3, arrival=1), R(1, [8, 9], 3, arrival=0), R(2, [10, 11, 12], 3, arrival=0)]
    assert eng.run(reqs) == engine.reference_tokens(llama, reqs)
    assert admissions.of("rid") == [1, 2, 0]
    eng.check()


def test_run_reports_progress_at_its_first_step_and_every_tenth(llama):
    """``run(out=...)`` prints one progress line at step 0 and then every 10 steps."""
    lines = []
    reqs = [R(0, [5, 6, 7], 12), R(1, [8, 9], 12)]
    eng = _plain(llama, 16, 2, 4, prefix_cache=False)
    eng.run(reqs, out=lambda s, **k: lines.append(s))
    assert eng.stats.steps == 12
    assert [s.split(":")[0] for s in lines] == ["step    0", "step   10"]


def test_only_a_decoding_lane_with_one_pending_token_is_fed_drafts(llama):
    """A speculative lane drafts only when it decodes: one pending token after generated ones. A lane
    still feeding prompt tokens (a forked or revived request's last prompt token) or recomputing after a
    preemption (its whole prompt and output pending) is fed its pending tokens alone."""
    eng = engine.Engine(llama, num_pages=16, page_size=4, max_batch=2, max_pages=4, backend="reference",
                        spec_every=1, draft_len=2)
    decoding = R(0, [5, 6, 7], 4)
    decoding.out, decoding.cached = [5], 3
    prompt_left = R(1, [5, 6, 7, 5], 4)
    prompt_left.cached = 3
    recompute = R(2, [5, 6, 7], 4)
    recompute.out = [5]
    assert eng._feeds([decoding, prompt_left, recompute]) == {0: [5, 6, 7], 1: [5], 2: [5, 6, 7, 5]}


def test_a_request_is_admitted_at_the_step_it_arrives(llama, monkeypatch):
    """``arrival`` is the step a request may first be admitted at: with room, it prefills in that step."""
    seen = []
    admit = engine.Engine._admit

    def spy(self, step, *a):
        decode, prefill = admit(self, step, *a)
        seen.extend((step, r.rid) for r in prefill)
        return decode, prefill

    monkeypatch.setattr(engine.Engine, "_admit", spy)
    eng = _plain(llama, 16, 2, 4, prefix_cache=False)
    reqs = [R(0, [5, 6, 7], 4, arrival=0), R(1, [8, 9], 4, arrival=2)]
    assert eng.run(reqs) == engine.reference_tokens(llama, reqs)
    assert seen == [(0, 0), (2, 1)]


def test_the_loop_skips_the_steps_before_the_next_arrival_when_nothing_runs(llama, monkeypatch):
    """An arrival far ahead (a timestamp-like step number) made run() loop through every empty step to it.
    With nothing running, the loop goes to the next arrival at once; a request arriving while others run
    still waits for its step."""
    steps = []
    reconcile = engine.Engine._reconcile
    monkeypatch.setattr(engine.Engine, "_reconcile", lambda self, **k: (steps.append(1), reconcile(self, **k))[1])
    eng = _plain(llama, 16, 2, 4, prefix_cache=False)
    reqs = [R(0, [5, 6, 7], 2, arrival=2000), R(1, [8, 9], 2, arrival=2001), R(2, [3, 4], 4, arrival=5000)]
    assert eng.run(reqs) == engine.reference_tokens(llama, reqs)
    assert len(steps) == eng.stats.steps < 20        # one loop a step: no empty step between


def test_a_step_of_prefills_only_evicts_the_cached_pages_it_needs(llama):
    """With the prefix cache, CACHED pages are room for an admission: a prefill arriving when nothing is
    running, on a pool whose free pages are short only by CACHED ones, evicts them before its step."""
    eng = _plain(llama, 4, 1, 4, prefix_cache=True)
    reqs = [R(0, list(range(10, 18)), 1, arrival=0), R(1, list(range(30, 42)), 1, arrival=1)]
    assert eng.run(reqs) == engine.reference_tokens(llama, reqs)
    stats = eng.check()
    assert eng.stats.evicted >= 1 and stats["requests.failed"] == 0 and stats["pages.used.current"] == 0


def test_a_fork_without_a_free_page_shares_whole_pages_only(llama, admissions):
    """A fork's copy-on-write page (the shared prefix's partial last page) comes from the FREE pages at
    once. With none free (the pool's other pages CACHED), a child still forks its running parent, sharing
    only the prefix's whole pages, and computes the rest: its tokens are generate's, nothing fails."""
    eng = _plain(llama, 4, 2, 2, prefix_cache=True)
    parent = list(range(40, 46))                                     # 6 tokens: a page and a half
    reqs = [R(0, list(range(10, 18)), 1),                            # leaves 2 CACHED pages at step 0
            R(1, parent, 3),
            R(2, parent + [77], 2, arrival=1, parent=1, shared=6)]   # arrives with 0 FREE pages
    got = eng.run(reqs)
    assert got == engine.reference_tokens(llama, reqs)
    stats = eng.check()
    assert stats["requests.failed"] == 0 and stats["pages.used.current"] == 0
    assert (2, 4, 0) in admissions.of("rid", "share", "free") and eng.stats.forks == 1


@pytest.mark.parametrize("cached", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_a_preempted_child_takes_the_longer_of_its_running_parent_and_its_own_cached_pages(llama, admissions,
                                                                                          cached):
    """Request 1 forks its parent's 8 prompt tokens, is preempted (the newest) with 12 tokens out while
    its parent runs, and comes back when request 2 finishes. Without a prefix cache it forks its
    parent again and computes its one unshared prompt token again, not all 9; with one, its own pages
    (CACHED when it was preempted: 20 tokens) hold more than the fork, and it revives them."""
    prompt = list(range(40, 48))
    reqs = [R(0, prompt, 30), R(2, [7, 8, 9, 10, 11], 14), R(1, prompt + [99], 20, arrival=1, parent=0, shared=8)]
    eng = _plain(llama, 14, 3, 10, prefix_cache=cached)
    assert eng.run(reqs) == engine.reference_tokens(llama, reqs)
    taken = admissions.of("rid", "out", "share", "revive", "runs")
    assert eng.stats.preemptions == 1
    assert taken[2] == (1, 0, 8, 0, True)
    if cached:
        assert taken[3] == (1, 12, 0, 20, True) and eng.stats.forks == 1 and eng.stats.cache_hits == 1
        assert eng.stats.prompt_tokens == 8 + 5 + 1                   # nothing of request 1's prompt again
    else:
        assert taken[3] == (1, 12, 8, 0, True) and eng.stats.forks == 2
        assert eng.stats.prompt_tokens == 8 + 5 + 1 + 1               # its one unshared prompt token again
    stats = eng.check()
    assert stats["requests.failed"] == 0 and stats["pages.used.current"] == 0


@pytest.mark.parametrize("cached_len", [4, 8], ids=["match-shorter", "tie"])
def test_a_child_forks_its_running_parent_unless_the_prefix_cache_matches_more(llama, monkeypatch, admissions,
                                                                              cached_len):
    """Request 2 leaves its first ``cached_len`` tokens (the parent's too) in the prefix cache, and the
    parent revives them. Its child then matches those ``cached_len`` tokens in the cache, against 8 it
    may fork from its running parent: the fork wins when it holds more, and on a tie."""
    prompt = list(range(40, 48))
    reqs = [R(2, prompt[:cached_len] + [50], 1), R(0, prompt + [60], 10, arrival=1),
            R(1, prompt + [99], 6, arrival=2, parent=0, shared=8)]
    eng = _plain(llama, 32, 4, 10, prefix_cache=True)
    matched = []
    match = engine.PrefixCache.match
    monkeypatch.setattr(engine.PrefixCache, "match",
                        lambda self, tokens: (m := match(self, tokens), matched.append(m.n_tokens))[0])
    assert eng.run(reqs) == engine.reference_tokens(llama, reqs)
    assert matched == [0, cached_len, cached_len]           # request 2, the parent, the child
    assert admissions.of("rid", "share", "revive") == [(2, 0, 0), (0, 0, cached_len), (1, 8, 0)]
    assert eng.stats.forks == 1 and eng.stats.cache_hits == 1
    assert eng.stats.prompt_tokens == (cached_len + 1) + (9 - cached_len) + 1


def test_stats_count_the_prompt_and_fed_tokens_the_forward_computed(llama):
    """``prompt_tokens``: prompt tokens computed once (not again while decoding, nor those a fork shares);
    ``fed_tokens``: every token the forward computed, all lanes."""
    eng = _plain(llama, 16, 2, 4, prefix_cache=False)
    reqs = [R(0, [5, 6, 7, 8, 9], 4), R(1, [5, 6, 7, 8, 9, 10], 3, arrival=1, parent=0, shared=4)]
    assert eng.run(reqs) == engine.reference_tokens(llama, reqs)
    assert eng.stats.forks == 1
    assert eng.stats.prompt_tokens == 5 + 2               # request 1 computes its 2 unshared prompt tokens
    assert eng.stats.fed_tokens == (5 + 3) + (2 + 2)      # prompts, then one token per later step and lane


def test_packed_batches_are_padded_to_a_power_of_two_tokens(llama, monkeypatch):
    """A step's ``max_tokens`` is the smallest power of two holding its tokens, at least
    ``MIN_TOKEN_BUCKET``: few distinct shapes for the forward, whatever the lanes feed."""
    sizes = []
    step = HostMirror.step
    monkeypatch.setattr(HostMirror, "step", lambda self, *a, **k: (sizes.append((sum(a[1]) + sum(a[2]),
                                                                                 k["max_tokens"])),
                                                                   step(self, *a, **k))[1])
    eng = _plain(llama, 32, 4, 8, prefix_cache=False)
    reqs = [R(0, list(range(5, 16)), 2), R(1, list(range(20, 29)), 3), R(2, [7], 2)]
    assert eng.run(reqs) == engine.reference_tokens(llama, reqs)
    assert sizes[0] == (21, 32)
    assert all(t <= m and m >= engine.MIN_TOKEN_BUCKET and m & (m - 1) == 0 and (m == 8 or t > m // 2)
               for t, m in sizes), sizes


def test_stats_count_drafts_accepted_rollbacks_and_tokens_exactly(llama, monkeypatch):
    """With drafts whose fate is known (an oracle that drafts generate's next tokens, the last of them
    wrong for requests 1 and 2): ``drafted`` and ``accepted`` count draft tokens, ``rollbacks`` counts
    the lanes with rejected drafts, ``tokens_out`` the tokens kept. A lane feeds at most the drafts it
    may still keep less one, whatever the drafter proposes: a draft past them would be cut at ``max_new``."""
    prompts = {0: [5, 6, 7, 8], 1: [9, 10, 11, 12], 2: [13, 14, 15, 16]}
    max_new = {0: 3, 1: 5, 2: 5}
    ahead = engine.reference_tokens(llama, [R(i, p, max_new[i] + 3) for i, p in prompts.items()])

    def oracle(self, r):
        d = list(ahead[r.rid][len(r.out):len(r.out) + self.draft_len])
        if r.rid:
            d[-1] = (d[-1] + 1) % self.vocab      # the last draft rejected
        return d

    monkeypatch.setattr(engine.Engine, "_draft", oracle)
    eng = engine.Engine(llama, num_pages=32, page_size=4, max_batch=3, max_pages=4, backend="reference",
                        spec_every=1, draft_len=3, prefix_cache=False)
    reqs = [R(i, p, max_new[i]) for i, p in prompts.items()]
    got = eng.run(reqs)
    assert got == engine.reference_tokens(llama, reqs)
    s = eng.stats
    # After the prefill (1 token each): request 0 may keep 2 more, so it feeds 1 draft (accepted: done); requests 1
    # and 2 may keep 4, feed 3 drafts (2 accepted, rolled back: 4 tokens), then may keep 1 and feed none.
    assert (s.drafted, s.accepted, s.rollbacks) == (1 + 3 + 3, 1 + 2 + 2, 2)
    assert s.tokens_out == sum(map(len, got.values())) == 13
    eng.check()


def test_a_bool_eos_token_id_is_refused():
    """A token id is an int >= 0, not a bool (``True`` is no token id, though an int subclass)."""
    for bad in (True, [3, False]):
        with pytest.raises(ValueError, match="eos_token_id: expected 'model' .*got"):
            engine.eos_ids(None, bad)


def test_preemptions_count_every_request_released_not_every_release(llama, monkeypatch):
    """``stats.preemptions`` counts preempted requests: a step that releases two (here the mirror is made
    to answer the two newest rows once three are running) counts two, and they still match generate."""
    answers = []
    preemption = HostMirror.preemption

    def two_at_once(self, rows, priority, n=1, **k):
        victims = preemption(self, rows, priority, n, **k)
        if not victims and len(rows) >= 3 and not answers:
            victims = [rows[-1], rows[-2]]                 # the newest two (releasing more than needed is safe)
        answers.append(list(victims))
        return victims

    monkeypatch.setattr(HostMirror, "preemption", two_at_once)
    eng = _plain(llama, 32, 4, 4, prefix_cache=False)
    reqs = [R(0, [5, 6, 7], 4), R(1, [8, 9], 4), R(2, [10, 11, 12, 13], 4)]
    assert eng.run(reqs) == engine.reference_tokens(llama, reqs)
    assert [len(v) for v in answers if v] == [2]
    assert eng.stats.preemptions == 2
    eng.check()


def test_kv_shape_refuses_a_v_head_dim_other_than_the_k_head_dim():
    """Without latent attention too: a config whose ``v_head_dim`` differs from its head_dim has no one
    K/V shape (ValueError naming both); one equal to it is served."""
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    cfg.v_head_dim = 16
    assert engine.kv_shape(cfg) == (2, 2, 16)
    cfg.v_head_dim = 8
    with pytest.raises(ValueError, match=r"llama: not supported by tpool.serving: K and V head dims differ "
                                         r"\(head_dim 16, v_head_dim 8\)"):
        engine.kv_shape(cfg)


# A review of the serving engine (session 43, helper-158): a learned position table, an error inside a run,
# a composite model.

def _gpt2(n_positions):
    import transformers
    from tpool.serving import hf
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2, n_positions=n_positions,
                                  initializer_range=0.25, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return hf.from_config(cfg, dtype=torch.float32).eval()


def test_drafts_stop_at_max_new_so_a_request_filling_a_learned_position_table_runs():
    """A speculative lane fed up to draft_len drafts past the tokens it could still keep: cut at max_new
    anyway, they reached positions generate never does, past GPT-2's n_positions (IndexError; on CUDA a
    device assert). A request of exactly n_positions - 1 fed tokens, speculative, now matches generate."""
    model = _gpt2(24)
    reqs = [engine.Request(0, [5, 6, 7, 5, 6, 7, 5], max_new=17)]   # rid 0: speculative; 7 + 17 - 1 = 23 fed
    eng = engine.Engine(model, num_pages=8, page_size=4, max_batch=2, max_pages=6, backend="numba",
                        eos_token_id=None)
    assert eng.positions == (24, "position table transformer.wpe") and engine.max_len(reqs[0]) == 23
    want = engine.reference_tokens(model, reqs, eos_token_id=None)
    assert eng.run(reqs) == want and eng.stats.drafted > 0
    eng.check()


def _position_model(kind):
    import transformers as T
    small = dict(vocab_size=64)
    cfg = {
        "gpt2": lambda: T.GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=24, **small),
        "opt": lambda: T.OPTConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, ffn_dim=64,
                                   max_position_embeddings=40, word_embed_proj_dim=32, **small),  # offset 2
        "ctrl": lambda: T.CTRLConfig(n_layer=1, n_embd=32, n_head=2, dff=64, n_positions=20, **small),
        "gptj": lambda: T.GPTJConfig(n_layer=1, n_embd=32, n_head=2, rotary_dim=8, n_positions=36, **small),
        "roberta": lambda: T.RobertaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                           intermediate_size=64, max_position_embeddings=42, is_decoder=True,
                                           **small),                   # an int position_ids buffer beside its table
        "reformer": lambda: T.ReformerConfig(attn_layers=["local"], hidden_size=32, num_attention_heads=2,
                                             feed_forward_size=64, axial_pos_shape=[8, 8], axial_pos_embds_dim=[16, 16],
                                             max_position_embeddings=64, is_decoder=True, **small),
        "llama": lambda: T.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                       max_position_embeddings=16, **small),
        "git": lambda: T.GitConfig(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                      num_attention_heads=2, image_size=32, patch_size=16),
                                   hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                   max_position_embeddings=48, **small),   # its image encoder has a table of patches
    }[kind]()
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("kind, want", [("gpt2", (24, "transformer.wpe")),
                                        ("opt", (40, "model.decoder.embed_positions")),
                                        ("ctrl", (20, "transformer.pos_encoding")),
                                        ("gptj", (36, "transformer.rotary_emb.embed_positions")),
                                        ("roberta", (42, "roberta.embeddings.position_embeddings")),
                                        ("reformer", (64, "reformer.embeddings.position_embeddings")),
                                        ("git", (48, "git.embeddings.position_embeddings")), ("llama", None)])
def test_position_limit_is_the_first_position_the_model_cannot_embed(kind, want):
    """Learned (GPT-2, OPT less its offset, RoBERTa beside its int position_ids buffer), fixed (CTRL, GPT-J's
    sin/cos) and axial (Reformer) tables, GIT's text table (not its image encoder's of 5 patches): a position
    one below the limit runs, the limit raises. Rotary: None, and a position far past max_position_embeddings
    runs."""
    from tpool.serving.checks import position_limit
    model = _position_model(kind)
    got = position_limit(model)

    def at(p):
        with torch.no_grad():
            model(input_ids=torch.tensor([[1]]), position_ids=torch.tensor([[p]]))
    if want is None:
        assert got is None
        at(4096)
        return
    assert got[0] == want[0] and got[1].startswith(f"position table {want[1]}")
    at(got[0] - 1)
    with pytest.raises((IndexError, RuntimeError, ValueError)):
        at(got[0])


def test_a_request_past_a_learned_position_table_is_refused_before_the_run():
    """check_fits bounds prompt + max_new - 1 by the table's rows (generate fails past it too), naming the
    table: it used to be admitted and fail inside the model, its row and pages left taken."""
    model = _gpt2(16)
    eng = engine.Engine(model, num_pages=8, page_size=4, max_batch=2, max_pages=8, backend="numba")
    eng.check_fits([engine.Request(0, list(range(1, 13)), max_new=5)])             # 12 + 5 - 1 = 16
    with pytest.raises(ValueError, match=r"request 1: expected prompt \+ max_new - 1 <= 16 tokens \(the model's "
                                         r"position table transformer\.wpe bounds positions to 16\), got 17"):
        eng.run([engine.Request(1, list(range(1, 13)), max_new=6)])
    assert eng.check()["pages.used.current"] == 0


@pytest.mark.parametrize("prefix_cache, where", [(False, "forward"), (True, "forward"), (False, "fork"),
                                                 (True, "drop"), (True, "after drop")])
def test_an_error_inside_a_run_releases_its_rows_and_the_engine_serves_the_next_run(llama, monkeypatch,
                                                                                    prefix_cache, where):
    """An exception in the model's forward (a bad model, an interrupt) or in a fork's page copy (a float8
    cache's, before copy_pages copied bytes) left the running requests' rows and pages taken (the fork's
    too: it was not running yet), and the next run and check() passed over them. run() releases them
    before it raises. One between the step's read of the evicted slots and their drop (helper-161) left
    the prefix cache closed for good (no hit ever again, check() failing): run() drops them first, once."""
    reqs = engine.make_requests(10, system_len=8 if prefix_cache else 0)
    eng = _engine(llama, "numba", reqs, prefix_cache=prefix_cache, **CACHED)
    calls = [0]

    def failing(real, after):
        def call(*a, **k):
            calls[0] += 1
            if calls[0] == after:
                raise RuntimeError(f"the {where} failed")
            return real(*a, **k)
        return call
    if where == "forward":
        monkeypatch.setattr(engine, "forward_step", failing(engine.forward_step, 6))
    elif where == "drop":
        monkeypatch.setattr(eng.prefix, "drop", failing(eng.prefix.drop, 1))
    elif where == "after drop":   # the drop done, the error before sample() marks it (helper-163: dropped twice,
        real_drop = eng.prefix.drop   # which failed and left every row held)

        def dropped(*a, **k):
            n = real_drop(*a, **k)
            calls[0] += 1
            if calls[0] == 1:
                raise RuntimeError(f"the {where} failed")
            return n
        monkeypatch.setattr(eng.prefix, "drop", dropped)
    else:
        monkeypatch.setattr(eng.cache, "copy_pages", failing(eng.cache.copy_pages, 1))
    import warnings
    with warnings.catch_warnings(record=True) as seen, pytest.raises(RuntimeError, match=f"the {where} failed"):
        warnings.simplefilter("always")
        eng.run(reqs)
    assert not [w for w in seen if issubclass(w.category, RuntimeWarning)]   # the cleanup itself did not fail
    assert all(r.row is None for r in reqs)
    stats = eng.check()                                    # no row held, no page in use, the mirror exact
    assert stats["pages.used.current"] == 0 and eng.mirror.rows_free == eng.max_batch
    monkeypatch.undo()
    assert not (prefix_cache and eng.prefix.closed)
    hits = eng.stats.cache_hits
    again = engine.make_requests(10, system_len=8 if prefix_cache else 0)
    assert eng.run(again) == engine.reference_tokens(llama, again)
    assert (eng.stats.cache_hits > hits) == prefix_cache    # the cache serves the next run
    eng.check()


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_an_engine_made_under_inference_mode_serves_outside_it(llama, backend):
    """Engines build their model and caches under torch.inference_mode(): every tensor tpool made there (the
    pool's and table's state, the prefix cache's index, the K/V storage) was an inference tensor, and the
    first run outside the mode failed writing one in place (on numba at its first check())."""
    reqs = engine.make_requests(10, system_len=8)
    with torch.inference_mode():
        eng = _engine(llama, backend, reqs, prefix_cache=True, **CACHED)
    assert eng.run(reqs) == engine.reference_tokens(llama, reqs)
    assert eng.stats.cache_hits > 0
    eng.check()


def test_a_sample_that_failed_to_drop_its_evictions_has_the_next_sample_drop_them(llama, monkeypatch):
    """sample() hands the prefix cache's evictions out and drops them in the same read; one that raised
    outside run() (its drop failed) left them handed out and never dropped: the cache matched nothing from
    then on (only run()'s error path dropped them). The next sample drops them, with its own."""
    reqs = engine.make_requests(6, system_len=8)
    eng = _engine(llama, "reference", reqs, prefix_cache=True, **CACHED)
    eng.run(reqs)
    n = len(eng.prefix)
    eng.prefix.evict(2)
    logits = torch.randn(3, eng.vocab)
    real, calls = eng.prefix.drop, [0]

    def fails_once(slots):
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("the drop failed")
        return real(slots)
    monkeypatch.setattr(eng.prefix, "drop", fails_once)
    with pytest.raises(RuntimeError, match="the drop failed"):
        eng.sample(logits)
    assert eng.prefix.closed
    eng.prefix.evict(1)                                   # another eviction before the next read
    assert eng.sample(logits) == logits.argmax(-1).tolist()
    assert calls[0] == 3 and not eng.prefix.closed and len(eng.prefix) < n
    eng.prefix.check_invariants()
    again = engine.make_requests(6, system_len=8)
    hits = eng.stats.cache_hits
    assert eng.run(again) == engine.reference_tokens(llama, again) and eng.stats.cache_hits > hits
    eng.check()


def test_llama4s_chunk_bounds_a_request_where_its_chunked_layers_are_served_as_full_attention():
    """check_layers serves Llama 4's chunked layers when one chunk spans max_position_embeddings; a longer
    sequence (which nothing stopped) would be chunked by eager attention and not on the pages: refused."""
    import transformers
    from tpool.serving import hf
    cfg = transformers.Llama4TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=16, attention_chunk_size=16, num_local_experts=2,
                                        intermediate_size_mlp=128, no_rope_layers=[1, 1], attn_temperature_tuning=False,
                                        eos_token_id=None, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = hf.from_config(cfg, dtype=torch.float32).eval()
    eng = engine.Engine(model, num_pages=16, page_size=4, max_batch=2, max_pages=8, backend="numba",
                        eos_token_id=None)
    fits = [engine.Request(0, list(range(1, 9)), max_new=9)]          # 8 + 9 - 1 = 16
    assert eng.run(fits) == engine.reference_tokens(model, fits, eos_token_id=None)
    with pytest.raises(ValueError, match=r"<= 16 tokens \(the model's attention_chunk_size \(its chunked layers, "
                                         r"served as full attention within one chunk\) bounds positions to 16\)"):
        eng.run([engine.Request(1, list(range(1, 9)), max_new=10)])


def test_an_interrupt_between_a_release_and_its_bookkeeping_releases_the_rest_only(llama, monkeypatch):
    """A request released (a preemption's finish) but still listed as running when an interrupt lands is not
    released again: the other running requests are, and check() passes."""
    eng = _plain(llama, 16, 2, 4)

    def interrupted(self, running, waiting, feed):
        if len(running) == 2:
            self._finish(running[:1], [running[0].row])   # released, but still listed as running
            raise KeyboardInterrupt
    monkeypatch.setattr(engine.Engine, "_preempt", interrupted)
    with pytest.raises(KeyboardInterrupt):
        eng.run([R(0, [5, 6, 7], 4), R(1, [8, 9], 4)])
    eng.check()


def test_a_release_failing_after_an_error_warns_and_the_runs_own_error_propagates(llama, monkeypatch):
    eng = _plain(llama, 16, 2, 4)
    monkeypatch.setattr(engine, "forward_step", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("the model")))
    monkeypatch.setattr(eng.mirror, "finish", lambda *a, **k: (_ for _ in ()).throw(ValueError("finish failed")))
    with pytest.warns(RuntimeWarning, match=r"releasing the running requests' rows after an error failed too "
                                            r"\(ValueError: finish failed\)"):
        with pytest.raises(RuntimeError, match="the model"):
            eng.run([R(0, [5, 6, 7], 4)])


def test_the_rows_are_released_even_when_the_prefix_caches_cleanup_fails(llama, monkeypatch):
    eng = _plain(llama, 16, 2, 4, prefix_cache=True)
    monkeypatch.setattr(engine, "forward_step", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("the model")))
    monkeypatch.setattr(eng.prefix, "sync", lambda: (_ for _ in ()).throw(ValueError("sync failed")))
    with pytest.warns(RuntimeWarning, match=r"\(ValueError: sync failed\)"), pytest.raises(RuntimeError):
        eng.run([R(0, [5, 6, 7], 4), R(1, [8, 9], 4)])
    assert eng.mirror.rows_free == eng.max_batch and eng.pool.stats()["pages.used.current"] == 0


def test_check_refuses_a_row_held_or_a_page_in_use_after_a_run(llama):
    eng = _plain(llama, 8, 2, 4)
    eng.mirror.admit([5], [8])                            # a row and its pages taken outside any run
    with pytest.raises(AssertionError, match="2 pages in use, 1 rows held"):
        eng.check()


def test_a_composite_models_engine_reads_its_text_config():
    """Gemma 3 as AutoModelForCausalLM builds it (Gemma3ForConditionalGeneration: a vision tower and a text
    decoder) passed check_model and forward_step, but Engine read the top config, which names no layers, and
    refused it as not supported. kv_shape reads the text decoder's config; the engine serves it as generate."""
    import transformers
    from tpool.serving import hf
    text = transformers.Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                                         pad_token_id=0, eos_token_id=None, bos_token_id=None)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=32, patch_size=16)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=299, boi_token_index=297, eoi_token_index=298)
    torch.manual_seed(0)
    model = hf.from_config(cfg, dtype=torch.float32).eval()
    assert engine.kv_shape(model.config) == (2, 2, 16) == engine.kv_shape(text)
    reqs = engine.make_requests(4, vocab_size=290, share_every=0)
    eng = engine.Engine(model, num_pages=32, page_size=4, max_batch=4, max_pages=16, backend="numba")
    assert eng.run(reqs) == engine.reference_tokens(model, reqs)
    eng.check()


def test_a_preemption_inserts_and_releases_its_victims_in_one_order(llama, monkeypatch):
    """_preempt inserted its victims in running order (oldest first) and released them newest first: of two
    copies of one prefix the one the entries name (inserted last) was released first, older on the LRU,
    and evicted before the copy named by nothing (helper-161). Every finish now releases in insert order."""
    seen = []
    finish = engine.Engine._finish

    def spy(self, reqs, rows):
        seen.append(([r.row for r in reqs], list(rows)))
        return finish(self, reqs, rows)
    monkeypatch.setattr(engine.Engine, "_finish", spy)
    reqs = engine.make_requests(16, seed=7, vocab_size=llama.config.vocab_size, system_len=8, max_new=(20, 30),
                                prompt_len=(5, 8), share_every=0)
    for r in reqs:
        r.arrival = 0                     # all at once: one system prompt prefilled apart in one step
    need = -(-max(engine.max_len(r) for r in reqs) // 4)
    eng = engine.Engine(llama, num_pages=need * 3, page_size=4, max_batch=8, max_pages=need, backend="numba",
                        spec_every=0)
    assert eng.run(reqs) == engine.reference_tokens(llama, reqs)
    eng.check()
    assert any(len(rows) > 1 for _, rows in seen) and eng.stats.preemptions > 1
    assert all(inserted == released for inserted, released in seen)


def test_reconciling_rarely_preempts_more_and_the_counts_repeat(llama):
    """``reconcile_every``: the same fixed-seed workload (prefix cache, speculative decoding) preempts more with
    a snapshot every 16 steps than every step, takes fewer snapshots, gives the same tokens, and repeats its
    counts run after run (what benchmarks/bench_reconcile.py prints). With a snapshot due never, the loop still
    ends: a pass with nothing running reconciles at once (the mirror's under-count refused every admission)."""
    def counts(every):
        reqs = engine.make_requests(40, seed=0, vocab_size=256, system_len=8)
        max_pages = -(-max(engine.max_len(r) for r in reqs) // 4)
        eng = engine.Engine(llama, num_pages=24, page_size=4, max_batch=4, max_pages=max_pages, backend="numba",
                            reconcile_every=every)
        passes, reconcile = [], eng._reconcile

        def bounded(*args, **kwargs):   # a loop that spins fails here instead of hanging (helper-196's mutants)
            passes.append(1)
            assert len(passes) < 20_000, "nothing runs and no snapshot is taken: the loop never ends"
            return reconcile(*args, **kwargs)

        eng._reconcile = bounded
        tokens = eng.run(reqs)
        eng.check()
        s = eng.stats
        return (s.steps, s.preemptions, s.calls["HostMirror.snapshot"][1]), tokens

    every_step, every_16 = counts(1), counts(16)
    assert every_16[0][1] > every_step[0][1] and every_16[0][2] < every_step[0][2]
    assert every_16[1] == every_step[1]
    assert counts(1) == every_step and counts(16) == every_16
    assert counts(10**9)[1] == every_step[1]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="reconcile_every"):
            engine.Engine(llama, num_pages=24, page_size=4, max_batch=4, max_pages=8, reconcile_every=bad)


def _no_keep_llama():
    """The tiny Llama, as a class whose forward does not name ``logits_to_keep``."""
    from transformers import LlamaForCausalLM

    model = engine.tiny_model("llama", seed=0)
    model.__class__ = without_logits_to_keep(LlamaForCausalLM)
    return model


@pytest.mark.parametrize("takes", [True, False], ids=["logits_to_keep", "no-logits-to-keep"])
def test_a_step_computes_the_logits_of_the_tokens_it_reads(llama, monkeypatch, takes):
    """A step asks for the logits it reads (``logits_to_keep``): each lane's last token not in the pages and
    its drafts, then padding, ``logits_rows(max_tokens)`` rows (a multiple of 8, one shape per token bucket).
    A model whose forward takes ``logits_to_keep`` runs its LM head on those rows only (a prefill of
    64 tokens: 16 rows); another computes every token's and the step indexes them. Tokens: generate's."""
    model = llama if takes else _no_keep_llama()
    seen, heads, step = [], [], engine.forward_step

    def spy(model, x, ctx, **kw):
        out = step(model, x, ctx, **kw)
        seen.append((x.numel(), kw["logits_to_keep"].shape, out.shape))
        return out

    monkeypatch.setattr(engine, "forward_step", spy)
    reqs = engine.make_requests(6)
    eng = _engine(model, "numba", reqs, **SMALL)              # 4 lanes, 1 + 3 drafts a lane: 16 rows at most
    hook = model.lm_head.register_forward_hook(lambda m, i, o: heads.append(i[0].shape[1]))
    try:
        got = eng.run(reqs)
    finally:
        hook.remove()
    eng.check()
    assert eng.logits_rows(8) == 8 and eng.logits_rows(64) == 16 and eng.stats.accepted > 0
    assert seen[0][0] == 64 and all(k == (eng.logits_rows(t),) and out == (k[0], eng.vocab) for t, k, out in seen)
    assert heads == [k[0] if takes else t for t, k, _ in seen]
    assert got == engine.reference_tokens(model, reqs)


def test_logits_rows_are_lanes_times_lookahead_up_to_a_multiple_of_8_at_most_the_steps_tokens(llama):
    eng = _plain(llama, 16, 3, 8)                              # 3 lanes, one token read a lane
    assert [eng.logits_rows(t) for t in (8, 16, 64)] == [8, 8, 8]
    eng = engine.Engine(llama, num_pages=16, page_size=4, max_batch=5, max_pages=8, backend="reference",
                        draft_len=2)                           # 5 lanes, 1 + 2 drafts a lane: 15 rows, 16 kept
    assert [eng.logits_rows(t) for t in (8, 16, 64)] == [8, 16, 16]
