"""What each benchmark script times, what its baseline is given, and the arithmetic of its tables.

bench_*.py, cold_breakdown.py and ab_compare.py on stand-ins: no timing is asserted. The timed calls run on
fake clocks or stand-ins that say what they cost, and counting stand-ins record what each row hands its pool,
so what is checked is the work each row times, the work its baseline is given, and the ratios and rates the
tables print. Each test was written for a mutant of a script that the suite let pass (helper-154's mutation
run, session 42: 60 of 61 survivors; the last, bench_pool's verify ignoring failed allocs, is equivalent:
every call makes the same alloc from an all-free pool, so a failed one shows as no page allocated).
"""

import argparse
import collections
import json
import os
import re
import sys
import tempfile
import types

import numpy as np
import pytest
import torch

from bench_scripts import TINY, FakeClock, json_rows, load


def _count_pages(model, log, vllm, page_size):
    """Log the pages an engine model hands out and takes back: ("alloc", n) and ("free", n) per call."""
    if vllm:
        get, free = model.get_new_blocks, model.free_blocks

        def get_new_blocks(k):
            log.append(("alloc", k))
            return get(k)

        def free_blocks(blocks):
            blocks = list(blocks)
            log.append(("free", len(blocks)))
            return free(blocks)
        model.get_new_blocks, model.free_blocks = get_new_blocks, free_blocks
    else:
        get, free = model.alloc, model.free

        def alloc(slots):
            log.append(("alloc", slots // page_size))
            return get(slots)

        def free_slots(slots):
            log.append(("free", (slots // page_size).unique().numel()))
            return free(slots)
        model.alloc, model.free = alloc, free_slots


def test_every_pool_row_allocs_and_frees_n_pages_a_call(monkeypatch):
    """bench_pool.py: each row, called 3 times, takes N pages (vllm-queue's blocks, sglang-paged's pages of 16
    slots, torch-slice's N slots, host-list's ids, tpool's pages) out of its pool and gives all of them back, in
    every call; tpool's plain row allocates through out=, its no-out row without, its bound row through the
    bound calls (no alloc call)."""
    import tpool
    bp = load("bench_pool")
    n, num_pages, log = 5, 40, []

    class Pool(tpool.PagePool):
        def alloc(self, counts, **kw):
            log.append(("tpool alloc", "out" in kw))
            return super().alloc(counts, **kw)
    made = []
    monkeypatch.setattr(bp, "tpool", types.SimpleNamespace(PagePool=lambda *a, **k: made.append(Pool(*a, **k))
                                                           or made[-1]))

    class HostList(bp.HostListPool):
        def alloc(self, k):
            log.append(("alloc", k))
            return super().alloc(k)

        def free(self, pages):
            log.append(("free", len(pages)))
            super().free(pages)

    class TorchSlice(bp.TorchSlicePool):
        def alloc(self, k):
            log.append(("alloc", k))
            return super().alloc(k)

        def free(self, pages):
            log.append(("free", pages.numel()))
            super().free(pages)
    monkeypatch.setattr(bp, "HostListPool", HostList)
    monkeypatch.setattr(bp, "TorchSlicePool", TorchSlice)
    for name in ("vllm-queue", "sglang-paged", "torch-slice", "host-list", "tpool-numba", "tpool-numba (no out=)",
                 "tpool-numba bound", "tpool-reference"):
        made.clear()
        fn = bp.pair_fns(n, num_pages, torch.device("cpu"), ["numba", "reference"], only=[name])[name]
        model = getattr(fn, "model", None)
        if name in ("vllm-queue", "sglang-paged"):
            _count_pages(model, log, vllm=name == "vllm-queue", page_size=bp.PAGE_SIZE)
        log.clear()
        for _ in range(3):
            fn()
        fn.verify()
        if name.startswith("tpool-"):
            (pool,) = made
            s = pool.stats()
            assert s["pages.allocated"] == s["pages.freed"] == 3 * n, name
            want = {"tpool-numba": [True] * 3, "tpool-reference": [True] * 3, "tpool-numba (no out=)": [False] * 3,
                    "tpool-numba bound": []}[name]
            assert [out for _, out in log] == want, name
        else:
            assert log == [("alloc", n), ("free", n)] * 3, (name, log)


def _fake_pool_clock(bp, monkeypatch, cost):
    """bench_pool's timing on stand-ins: each row's function says what a call costs (``cost(name, n)`` µs);
    time_calls_us returns calls x that without timing anything; calibrate says 4 calls a sample. Returns the
    log of (name, pool size, calls) per timed sample and of calibrations."""
    timed, calibrated = [], []
    pair_fns = bp.pair_fns

    def tagged(n, num_pages, *a, **k):
        fns = pair_fns(n, num_pages, *a, **k)
        for name, fn in fns.items():
            fn.tag = (name, num_pages, cost(name, n))
        return fns
    monkeypatch.setattr(bp, "pair_fns", tagged)
    monkeypatch.setattr(bp, "time_calls_us", lambda fn, calls, sync=None: (timed.append((fn.tag[:2], calls)),
                                                                           calls * fn.tag[2])[1])
    monkeypatch.setattr(bp, "calibrate", lambda fn, sync=None: (calibrated.append(fn.tag[:2]), 4)[1])
    return timed, calibrated


def test_pool_table_from_a_fake_clock(tmp_path, monkeypatch, capsys):
    """bench_pool.py on stand-ins that cost a known time a call: each row's median is its per-call cost (a
    sample's time over its calls), Mpages/s counts the alloc and the free (2 N pages a pair), each ratio is
    the baseline's cost over the row's at the row's own N; every row and pool size is calibrated once, the
    pool sizes take turns sample by sample in a rotating order, and --sizes may equal the smallest pool."""
    bp = load("bench_pool")
    base = {"vllm-queue": 3.0, "sglang-paged": 12.0, "torch-slice": 5.0, "host-list": 0.5, "tpool-numba": 2.0,
            "tpool-numba (no out=)": 8.0, "tpool-numba bound": 1.0}

    def cost(name, n):
        return base[name] + (n / 16 if name in ("vllm-queue", "sglang-paged") else 0)  # the baselines' grow with N
    timed, calibrated = _fake_pool_clock(bp, monkeypatch, cost)
    out = tmp_path / "pool.json"
    bp.main(["--sizes", "1", "64", "--pool-sizes", "64", "128", "--samples", "3", "--backends", "numba",
             "--json", str(out)])
    capsys.readouterr()
    rows = json_rows(out)
    assert len(rows) == 2 * 2 * len(base)
    for r in rows:
        n, c = r["pages"], cost(r["impl"], r["pages"])
        assert r["median_us"] == pytest.approx(c) and r["pages_per_s"] == pytest.approx(2 * n / c * 1e6)
        assert r["vs_vllm_queue"] == pytest.approx(cost("vllm-queue", n) / c), r
        assert r["vs_sglang_paged"] == pytest.approx(cost("sglang-paged", n) / c), r
    assert sorted(calibrated) == sorted((name, P) for name in base for P in (64, 128) for _ in (1, 64))
    for name in base:  # per row: 64 then 128, then 128 then 64, ... (for each N)
        order = [P for (nm, P), calls in timed if nm == name]
        assert order == [64, 128, 128, 64, 64, 128] * 2, (name, order)
        assert {calls for (nm, _), calls in timed if nm == name} == {4}


def test_pool_table_prints_a_ratio_below_a_hundredth_with_its_digits(monkeypatch, capsys):
    """A row 1,000 times slower than its baseline (the reference backend's, ~700 µs against vLLM's ~1 µs at
    N=1) prints its ratio with two significant digits, "0.001x", not "0.00x" (ratio_text)."""
    bp = load("bench_pool")
    _fake_pool_clock(bp, monkeypatch, lambda name, n: {"vllm-queue": 1.0, "sglang-paged": 40.0}.get(name, 1000.0))
    bp.main(["--sizes", "1", "--num-pages", "64", "--samples", "3", "--backends", "reference"])
    (row,) = [line for line in capsys.readouterr().out.splitlines() if " tpool-reference " in line]
    assert row.split()[-2:] == ["0.001x", "0.04x"], row
    common = load("_common")
    assert [common.ratio_text(x) for x in (None, 2.0, 0.01, 0.0042, 4.2e-05)] == ["", "2.00x", "0.01x", "0.0042x",
                                                                                 "4.2e-05x"]


def test_page_table_rows_give_tpool_and_baselines_the_same_work():
    """bench_page_table.py: from the same start, every decode row (the baselines' and tpool's) adds one token
    to each of the B requests a call, and every turnover row releases and admits the same requests with the
    same prompt lengths, call after call: the lengths the baselines hold equal the table's after each call.
    The two-StepOuts row writes two StepOuts in turn."""
    bpt = load("bench_page_table")
    B, calls = 3, 5
    impls = bpt.workloads(B, ["numba"], torch.device("cpu"))

    def lengths(owner):
        if isinstance(owner, bpt.NumpyBlocks):
            return owner.lens.tolist()
        if isinstance(owner, bpt.VllmBlocks):
            return list(owner.num_tokens)
        return owner.seq_lens.tolist()
    traces = {"decode": {}, "turnover": {}}
    for name, (fn, owner, kind) in impls.items():
        if kind == "other":
            continue
        reset = bpt.make_reset(fn, owner)
        start = lengths(owner)
        trace = [start]
        for _ in range(calls):
            fn()
            trace.append(lengths(owner))
        reset()
        assert lengths(owner) == start, name
        traces[kind][name] = trace
    assert len(traces["decode"]) == 8 and len(traces["turnover"]) == 5
    for kind, by_name in traces.items():
        first = next(iter(by_name.values()))
        for name, trace in by_name.items():
            assert trace == first, (kind, name)
    decode = traces["decode"]["numpy-blocks"]
    assert all(decode[i][:B] == [x + i for x in decode[0][:B]] for i in range(calls + 1))
    fn = impls["tpool-numba bound step, two StepOuts taking turns"][0]
    a, b, c = fn(), fn(), fn()
    assert a is not b and c is a


def test_page_table_time_row_settles_and_splits_its_samples(monkeypatch):
    """bench_page_table.time_row on stand-ins: each configuration calibrated once to at most WARM_INNER calls,
    its warm samples settled (one untimed call after each reset); a sweep takes turns one warm sample at a time
    (--samples in all per configuration) and splits --cold-samples over SWEEP_ROUNDS blocks, every cold sample
    settled; a single configuration takes all its samples in one go."""
    bpt = load("bench_page_table")
    log = []
    monkeypatch.setattr(bpt, "calibrate", lambda fn, **kw: (log.append(("calibrate", fn, kw["max_inner"],
                                                                         kw["reset"])), 7)[1])
    monkeypatch.setattr(bpt, "sample_us", lambda fn, **kw: (log.append(("warm", fn, kw)), [1.0] * kw["samples"])[1])
    monkeypatch.setattr(bpt, "sample_cold_us", lambda fn, **kw: (log.append(("cold", fn, kw)),
                                                                  [2.0] * kw["samples"])[1])
    runs = {"a": ("fa", "ra"), "b": ("fb", "rb")}
    args = argparse.Namespace(inner=None, samples=3, cold_samples=7)
    got = bpt.time_row(runs, args, None, "flush", "decode")
    assert got == {k: ((1.0, 1.0, 1.0), (2.0, 2.0, 2.0)) for k in runs}
    assert [e[1:] for e in log if e[0] == "calibrate"] == [("fa", bpt.WARM_INNER, "ra"), ("fb", bpt.WARM_INNER, "rb")]
    warm = [(e[1], e[2]["samples"], e[2]["inner"], e[2]["settle"], e[2]["reset"]) for e in log if e[0] == "warm"]
    assert warm == [("fa", 1, 7, True, "ra"), ("fb", 1, 7, True, "rb")] * 3
    cold = [(e[1], e[2]["samples"], e[2]["settle"], e[2]["flush"]) for e in log if e[0] == "cold"]
    assert [c[0] for c in cold] == ["fa", "fb"] * bpt.SWEEP_ROUNDS and all(c[2:] == (True, "flush") for c in cold)
    assert [sum(c[1] for c in cold if c[0] == f) for f in ("fa", "fb")] == [7, 7]
    log.clear()
    bpt.time_row({"a": ("fa", "ra")}, args, None, None, "decode")
    assert [(e[0], e[2]["samples"]) for e in log if e[0] != "calibrate"] == [("warm", 3)]


def _label_workloads(monkeypatch, bpt, label):
    """Wrap ``bpt.workloads`` so that each function it makes is labelled ``label(row name)`` (read when it is
    made); returns the labels by ``id(fn)``, for stand-ins that take the function only."""
    labels, workloads = {}, bpt.workloads

    def labelled(*a, **k):
        impls = workloads(*a, **k)
        labels.update({id(fn): label(name) for name, (fn, _, _) in impls.items()})
        return impls
    monkeypatch.setattr(bpt, "workloads", labelled)
    return labels


def test_page_table_ratios_are_the_baseline_of_the_rows_kind_over_the_row(tmp_path, monkeypatch, capsys):
    """bench_page_table.py with each row's quantiles made up (a warm and a cold median per row): every decode
    row's ratio is numpy-blocks' (vllm-blocks') decode median over the row's, every turnover row's that of the
    baselines' turnover rows, warm against warm and cold against cold; extend-only, csr-only and the floor
    have none."""
    bpt = load("bench_page_table")
    names = _label_workloads(monkeypatch, bpt, lambda name: name)
    cost = {"numpy-blocks": 40.0, "numpy-blocks turnover": 100.0, "vllm-blocks": 30.0, "vllm-blocks turnover": 120.0}

    def warm_of(name):
        return cost.get(name, 1.0 + len(name) % 7)

    def time_row(runs, args, sync, flush, kind):
        out = {}
        for k, (fn, _) in runs.items():
            w = warm_of(names[id(fn)])
            out[k] = ((w, w, w), (w + 7, w + 7, w + 7) if flush and kind != "other" else None)
        return out
    monkeypatch.setattr(bpt, "time_row", time_row)
    out = tmp_path / "pt.json"
    bpt.main(["--batch", "2", "--backends", "numba", "--cold", "--cold-bytes", "4096", "--json", str(out)])
    assert "cold: 4,096 bytes written before each call" in capsys.readouterr().out  # not "0 MiB"
    rows = {r["impl"]: r for r in json_rows(out)}
    for name, r in rows.items():
        if r["kind"] == "other":
            assert not any(k.startswith(("vs_", "cold_vs_")) for k in r), name
            continue
        suffix = " turnover" if r["kind"] == "turnover" else ""
        w = warm_of(name)
        for b, key in (("numpy-blocks", "numpy_blocks"), ("vllm-blocks", "vllm_blocks")):
            if name.startswith("numpy-blocks") and b == "vllm-blocks":
                continue  # (timed before vllm-blocks: no ratio against it)
            assert r[f"vs_{key}"] == pytest.approx(cost[b + suffix] / w), (name, key)
            assert r[f"cold_vs_{key}"] == pytest.approx((cost[b + suffix] + 7) / (w + 7)), (name, key)


def test_evict_numpy_scan_picks_the_pages_tpool_evicts_on_the_cached_state():
    """bench_evict.py's numpy-argpartition row on the state cached_pools() makes (each cache call frees its pages
    in id order, so (stamp, id) is tpool's LRU order there): the k pages it selects are the k tpool evicts, in
    order, for k within a stamp, across stamps and the whole cached half."""
    be = load("bench_evict")
    pool = be.cached_pools(16384, ["numba"], torch.device("cpu"))["numba"]  # 32 pages a stamp
    order = be.lru_order(pool)
    state, stamp = pool.state.page_state.numpy().copy(), pool.state.stamp.numpy().copy()
    for k in (1, 5, 32, 64, 100, 8192):
        assert be.numpy_select(state, stamp, k).tolist() == order[:k], k


def test_evict_ratio_and_sample_counts_on_stand_in_samplers(tmp_path, monkeypatch, capsys):
    """bench_evict.py with stand-in samplers that say what a call took: each row's ratio is vllm-queue's median
    over the row's, and every row takes --samples samples except the reference backend's, a fifth (at least 3)."""
    be = load("bench_evict")
    calls = collections.Counter()

    def stand_in(name, us):
        def sample():
            calls[name] += 1
            return us
        return sample
    monkeypatch.setattr(be, "vllm_sampler", lambda model, k: stand_in("vllm-queue", 8.0))
    monkeypatch.setattr(be, "numpy_sampler", lambda pool, k: stand_in("numpy-argpartition", 20.0))
    monkeypatch.setattr(be, "tpool_sampler", lambda pool, k, sync: stand_in(f"tpool-{pool.backend}",
                                                                             2.0 if pool.backend == "numba" else 500.0))
    out = tmp_path / "evict.json"
    be.main(["--pool-sizes", "1024", "--k", "1", "--samples", "20", "--backends", "numba", "reference",
             "--json", str(out)])
    capsys.readouterr()
    rows = {r["impl"]: r for r in json_rows(out)}
    for name, us in (("vllm-queue", 8.0), ("numpy-argpartition", 20.0), ("tpool-numba", 2.0),
                     ("tpool-reference", 500.0)):
        assert rows[name]["median_us"] == us and rows[name]["vs_vllm_queue"] == pytest.approx(8.0 / us), name
    assert calls == {"vllm-queue": 20, "numpy-argpartition": 20, "tpool-numba": 20, "tpool-reference": 4}


def test_lru_host_baseline_keeps_lru_order(monkeypatch):
    """bench_lru.run_host: per step, each touched page moved to the MRU end in turn, k pages popped from the LRU
    end, then put back at the MRU end (worked by hand on 8 pages)."""
    bl = load("bench_lru")
    made = []

    class Recording(collections.OrderedDict):
        @classmethod
        def fromkeys(cls, keys, value=None):
            made.append(super().fromkeys(keys, value))
            return made[-1]
    monkeypatch.setattr(bl, "collections", types.SimpleNamespace(OrderedDict=Recording))
    times = bl.run_host(8, argparse.Namespace(k=2), np.array([[5, 6], [0, 5]], dtype=np.int32))
    assert len(times) == 2 and list(made[0]) == [4, 7, 6, 1, 0, 5, 2, 3]


def test_lru_tpool_steps_touch_each_steps_pages_and_evict_k(monkeypatch):
    """bench_lru.run_tpool: a step touches that step's pages (the untimed first step the first row's), then
    allocates k pages with evict=True and caches them again."""
    import tpool
    bl = load("bench_lru")
    log = []

    class Pool(tpool.PagePool):
        def touch(self, pages):
            log.append(("touch", pages.tolist()))
            return super().touch(pages)

        def alloc(self, counts, **kw):
            log.append(("alloc", counts.tolist(), kw.get("evict", False)))
            return super().alloc(counts, **kw)

        def free(self, pages, **kw):
            log.append(("free", kw.get("cache", False)))
            return super().free(pages, **kw)
    monkeypatch.setattr(bl, "tpool", types.SimpleNamespace(PagePool=Pool))
    touched = bl.touched_pages(64, 5, 8, 0)
    times, _ = bl.run_tpool(64, argparse.Namespace(k=4), torch.device("cpu"), "numba", touched)
    assert len(times) == 5
    steps = log[2:]  # (after the set-up's alloc and cached free of the whole pool)
    assert steps == [e for row in [touched[0]] + list(touched) for e in
                     (("touch", row.tolist()), ("alloc", [4], True), ("free", True))]


def test_lru_and_revive_ratios_are_the_baseline_over_the_row(tmp_path, capsys):
    """bench_lru.py's vs host is the OrderedDict's median over the row's; bench_revive.py's vs vllm-touch is
    vllm-touch's median over the row's."""
    out = tmp_path / "lru.json"
    load("bench_lru").main(TINY["bench_lru"] + ["--json", str(out)])
    rows = {r["impl"]: r for r in json_rows(out)}
    host = rows["host-ordereddict"]["median_us"]
    assert all(r["vs_host"] == pytest.approx(host / r["median_us"]) for r in rows.values())
    out = tmp_path / "revive.json"
    load("bench_revive").main(["--k", "2", "--samples", "5", "--backends", "numba", "--json", str(out)])
    capsys.readouterr()
    rows = {r["impl"]: r for r in json_rows(out)}
    base = rows["vllm-touch"]["median_us"]
    assert len(rows) == 3 and all(r["vs_vllm_touch"] == pytest.approx(base / r["median_us"]) for r in rows.values())


def test_revive_by_hand_row_never_calls_table_revive(monkeypatch):
    """bench_revive.tpool_sampler: the table.revive row calls PageTable.revive once a sample (and once untimed
    first), the by-hand row never does (its torch ops do the revive)."""
    import tpool
    bv = load("bench_revive")
    count, revive = [0], tpool.PageTable.revive
    monkeypatch.setattr(tpool.PageTable, "revive", lambda self, *a, **k: (count.__setitem__(0, count[0] + 1),
                                                                         revive(self, *a, **k))[1])
    for hand, want in ((True, 0), (False, 4)):
        count[0] = 0
        sample = bv.tpool_sampler(4, "numba", torch.device("cpu"), lambda: None, hand=hand)
        for _ in range(3):
            sample()                                              # (a time on the real clock: not checked)
        assert count[0] == want, hand


def test_scheduler_run_times_step_and_after_but_not_the_flush(monkeypatch):
    """bench_scheduler.run on a fake clock: a timed step is step() and after() (10 + 1 µs here), never the
    flush (1,000 µs, before the clock starts); warm-up steps are not kept, admission blocks are."""
    bs = load("bench_scheduler")
    clock = FakeClock(bs, monkeypatch, log_reads=True)

    class Churn:
        def step(self, i):
            clock.spend(10, "step")
            return 50.0 if i % 4 == 0 else None

        def after(self, i):
            clock.spend(1, "after")
    args = argparse.Namespace(warmup=3, seed=0)
    got = bs.run({"a": Churn(), "b": Churn()}, args, 9, flush=lambda: clock.spend(1000, "flush"))
    for step_us, admit_us in got.values():
        assert step_us == [11.0] * 9 and admit_us == [50.0, 50.0]  # steps 4 and 8 (0 is a warm-up step)
    assert clock.log[:6] == ["flush", "clock", "step", "after", "clock", "flush"]


def test_scheduler_reads_per_step_count_the_admissions():
    """read-ok reads ok after every step and after every admission block (one each --every steps)."""
    bs = load("bench_scheduler")
    args = argparse.Namespace(warmup=4, every=8)
    r = bs.read_ok_result(types.SimpleNamespace(pool=types.SimpleNamespace(check=lambda: None), failed=0), args, 36,
                          [1.0], [])
    assert r["reads"] == pytest.approx((40 + 5) / 40)


def test_scheduler_table_from_made_up_step_times(tmp_path, monkeypatch, capsys):
    """bench_scheduler.py with run() made up (read-ok's steps take 6 µs, the mirror's 3 µs, an admission block
    50 µs): vs read-ok is read-ok's median over the row's (2.00x for the mirror, in the table and the JSON),
    admissions/s counts the block's --turnover admissions; both schedulers start from the same seed."""
    bs = load("bench_scheduler")
    states = []
    for cls in ("ReadOkChurn", "MirrorChurn"):
        real = getattr(bs, cls)

        class Recording(real):
            def __init__(self, args, *rest):
                states.append(rest[-1].getstate())
                super().__init__(args, *rest)
        monkeypatch.setattr(bs, cls, Recording)
    us = {"read-ok": 6.0, "mirror-plain": 3.0}
    monkeypatch.setattr(bs, "run", lambda churns, args, steps, flush=None, suffix="": {
        name: ([us[name]] * steps, [50.0]) for name in churns})
    out = tmp_path / "churn.json"
    bs.main(["--requests", "8", "--steps", "16", "--num-pages", "4096", "--scenarios", "plain", "--turnover", "2",
             "--cold", "--cold-steps", "16", "--cold-bytes", "1000000", "--json", str(out)])
    text = capsys.readouterr().out
    assert "(16 cold, 1,000,000 bytes written before each)" in text  # not "0 MiB"
    rows = {r["name"]: r for r in json_rows(out)}
    for cold in ("", ", cold"):
        assert rows["mirror-plain" + cold]["vs_read_ok"] == pytest.approx(2.0)
        assert rows["read-ok" + cold]["vs_read_ok"] == 1.0
    assert all(r["admissions_per_s"] == pytest.approx(2 / 50e-6) for r in rows.values())
    assert re.search(r"mirror-plain +3\.0 +3\.0 +3\.0 +2\.00x", text), text
    assert len(states) == 4 and len(set(states)) == 1  # warm and cold: both schedulers, the same seed


def test_read_ok_counts_every_lane_it_reads_back_refused():
    """ReadOkChurn reads ok back after every step: on a pool the growing requests run out of, the lanes it
    counts as failed are the device's refused requests."""
    bs = load("bench_scheduler")
    args = bs.parser().parse_args(["--requests", "4", "--num-pages", "1"])
    args.num_pages = bs.startup_pages(args) + 2  # room for the prompts and a few tokens more
    churn = bs.ReadOkChurn(args, torch.device("cpu"), bs.random.Random(args.seed))
    for i in range(1, 200):  # (no turnover: step 0 of --every is skipped, so set the batch by hand)
        if churn.ids is None:
            churn.ids = churn.t32(churn.rows)
            churn.ones = torch.ones(len(churn.rows), dtype=torch.int32)
        churn.step(i if i % args.every else i + 1)
    assert churn.failed > 0 and churn.failed == churn.pool.stats()["requests.failed"]


def test_cold_breakdown_times_each_call_right_after_the_flush(monkeypatch, capsys):
    """cold_breakdown.py on a fake clock: each sample of each row resets it, settles it (one untimed call), writes
    the cold bytes, then times one call of it alone (the code-warm row runs the other table's kernel between the
    flush and the clock); the last column is the row's median over the bound step's."""
    cb = load("cold_breakdown")
    clock = FakeClock(cb, monkeypatch, log_reads=True)

    class Flush:
        def __init__(self, nbytes):
            self.buf = np.zeros(max(1, nbytes // 8), dtype=np.int64)

        def __call__(self):
            clock.spend(0, "flush")
    monkeypatch.setattr(cb, "CacheFlusher", Flush)
    rows_for = cb.rows_for
    cost = {}

    def wrapped(B):
        rows, keep = rows_for(B)
        out = {}
        for i, (name, (fn, reset, settle, after)) in enumerate(rows.items()):
            cost[name] = 1.0 + i

            def timed(fn=fn, name=name):
                fn()
                clock.spend(cost[name], name)

            def resets(reset=reset, name=name):
                reset()
                clock.log.append(("reset", name))
            out[name] = (timed, resets if reset else None, timed,
                         (lambda after=after: (after(), clock.log.append("after"))) if after else None)
        return out, keep
    monkeypatch.setattr(cb, "rows_for", wrapped)
    cb.main(["--batch", "4", "--samples", "2", "--cold-bytes", "4096"])
    text = capsys.readouterr().out
    assert "cold decode step, 4,096 bytes written before each call" in text
    log = clock.log
    starts = [i for i, e in enumerate(log) if e == "clock"][::2]
    assert len(starts) == 2 * len(cost)
    for i in starts:
        name = log[i + 1]
        assert log[i + 2] == "clock", name  # the call alone between the two reads
        before = log[:i]
        back = before[::-1]
        if name == "kernel alone, code warm":
            assert back[:2] == ["after", "flush"], back[:4]
            back = back[3:]  # (after the flush: the other table's kernel, before it: its settle)
        else:
            assert back[0] == "flush", (name, back[:3])
            back = back[1:]
        assert back[0] == name, (name, back[:3])  # the untimed settle call
        if name.startswith(("touch: +", "kernel", "extend", "bound", "step")):
            assert back[1] == ("reset", name), (name, back[:3])
    for name, c in cost.items():
        assert re.search(rf"{re.escape(name)} +{c:.2f} .* {c / cost['bound step']:.2f}\n", text), name


def test_startup_ratio_is_tpool_launch_over_torch_launch(tmp_path, monkeypatch, capsys):
    """bench_startup.py with its processes stood in for: the warm runs run tpool's code with --cache-dir, the
    baseline runs import torch only, each cold run gets an empty cache directory of its own; vs torch is a
    tpool launch-to-first-step median over the torch-only launch-to-import median, on the launch rows only."""
    bs = load("bench_startup")
    seen = []

    def run_child(code, cache_dir):
        torch_only = "if True:" in code
        seen.append((torch_only, cache_dir, os.path.isdir(cache_dir) and not os.listdir(cache_dir)
                     if cache_dir else None))
        if torch_only:
            return dict(phases={"torch": 0.5, "CPU time (process)": 1.0, "next 20,000 objects": 0.01,
                                "launch to import": 0.8})
        launch = 3.2 if cache_dir.startswith(tempfile.gettempdir() + os.sep + "tpool-cold-cache-") else 2.0
        return dict(phases={"torch": 0.5, "import tpool": 0.3, "first step": 0.1, "CPU time (process)": 1.5,
                            "next 20,000 objects": 0.01, "launch to first step": launch}, tpool="x/tpool/__init__.py")
    monkeypatch.setattr(bs, "run_child", run_child)
    cache = str(tmp_path / "cache")
    out = tmp_path / "startup.json"
    bs.main(["--runs", "2", "--cold", "2", "--cache-dir", cache, "--json", str(out)])
    text = capsys.readouterr().out
    assert re.search(r"warm +launch to first step +2000 +2000 +2000 +2\.50x", text), text
    assert [s[:2] for s in seen[:5]] == [(False, cache), (False, cache), (True, cache), (False, cache), (True, cache)]
    cold = seen[5:]
    assert len(cold) == 2 and all(not t and empty for t, _, empty in cold) and cold[0][1] != cold[1][1]
    rows = {(r["cache"], r["phase"]): r for r in json_rows(out)}
    assert rows[("warm", "launch to first step")]["vs_torch_import"] == pytest.approx(2.0 / 0.8)
    assert rows[("cold", "launch to first step")]["vs_torch_import"] == pytest.approx(3.2 / 0.8)
    assert rows[("torch only", "launch to import")]["vs_torch_import"] is None
    assert rows[("warm", "first step")]["vs_torch_import"] is None


def test_startup_launch_time_ends_at_the_childs_first_step(monkeypatch):
    """run_child: launch to first step is the child's wall clock at its step's end less the parent's at the
    start, not the parent's clock after the child exits (its 20,000 objects and its exit)."""
    bs = load("bench_startup")
    now = iter([100.0, 250.0])
    monkeypatch.setattr(bs, "time", types.SimpleNamespace(time=lambda: next(now)))
    child = json.dumps(dict(end=101.5, phases={"first step": 0.1}))
    ran = types.SimpleNamespace(returncode=0, stdout=child + "\n", stderr="")
    monkeypatch.setattr(bs, "subprocess", types.SimpleNamespace(run=lambda *a, **k: ran))
    assert bs.run_child("code", "")["phases"]["launch to first step"] == pytest.approx(1.5)


def test_e2e_table_from_made_up_samples(tmp_path, monkeypatch, capsys):
    """bench_e2e.py with its two loops stood in for (a tpool step of 4 ms, a baseline step of 6 ms, B = 4):
    tok/s is B over the step, the ratio the baseline's step over tpool's (tpool's tokens/s over the
    baseline's). The two loops take turns sample by sample (they ran one after the other, so a busy stretch of
    the shared machine fell on one of them alone), and the tpool loop runs to its end (its pool's check)."""
    pytest.importorskip("transformers")
    be = load("bench_e2e")
    log = []

    def tpool_samples(model, prompts, a):
        for _ in range(a.samples):
            log.append("tpool")
            yield (0.004, 0.001, 0.003, 0.0006, 0.0004)
        log.append("tpool checked")

    def baseline_samples(prompts, model, a):
        for _ in range(a.samples):
            log.append("baseline")
            yield 0.006
    monkeypatch.setattr(be, "build_model", lambda *a, **k: None)
    monkeypatch.setattr(be, "tpool_samples", tpool_samples)
    monkeypatch.setattr(be, "baseline_samples", baseline_samples)
    out = tmp_path / "e2e.json"
    be.main(["--batch", "4", "--samples", "3", "--json", str(out)])
    capsys.readouterr()
    (row,) = json_rows(out)
    assert row["tokens_per_s"] == pytest.approx(1000) and row["baseline_tokens_per_s"] == pytest.approx(4 / 0.006)
    assert row["ratio"] == pytest.approx(1.5) and row["tpool_share"] == pytest.approx(0.25)
    assert log == ["tpool", "baseline"] * 3 + ["tpool checked"]


def test_e2e_baseline_crops_its_cache_back_to_the_prompt_every_sample(monkeypatch):
    """run_baseline: every sample decodes --inner tokens from the prompt (the cache holds prompt + inner tokens
    at its end) and crops them off, so each sample decodes the same workload, as the tpool loop's truncate does."""
    pytest.importorskip("transformers")
    be = load("bench_e2e")
    model = be.build_model(32, 1, 4, 2, 64)
    transformers = sys.modules["transformers"]  # (by now: importing the model swaps the lazy module for the real one)
    seen = []

    class Cache(transformers.DynamicCache):
        def crop(self, n):
            seen.append(self.get_seq_length())
            super().crop(n)
            seen.append(self.get_seq_length())
    monkeypatch.setattr(transformers, "DynamicCache", Cache)
    prompts = torch.randint(1, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    samples = be.run_baseline(prompts, model, argparse.Namespace(samples=2, inner=3))
    assert len(samples) == 2 and seen == [13, 10] * 3
    seen.clear()  # one step a sample: the untimed first one still makes WARMUP_STEPS (3), and crops them all
    samples = be.run_baseline(prompts, model, argparse.Namespace(samples=2, inner=1))
    assert len(samples) == 2 and seen == [13, 10] + [11, 10] * 2


def test_e2e_baseline_leaves_grad_mode_and_attention_as_they_were_between_its_samples():
    """baseline_samples yields to the tpool loop between samples: at each yield the model is back on tpool's
    attention and grad mode is what the caller had. It held one no_grad across its yields, so the tpool loop's
    table.step and metadata ran with grad off from its second sample on (not in its first), and the caller's
    grad mode stayed off until the generator was dropped."""
    pytest.importorskip("transformers")
    be = load("bench_e2e")
    hf = be.serving_hf()
    model = be.build_model(32, 1, 4, 2, 64)
    prompts = torch.randint(1, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    samples = be.baseline_samples(prompts, model, argparse.Namespace(samples=2, inner=1))
    for _ in range(2):
        assert next(samples) > 0
        assert torch.is_grad_enabled() and model.config._attn_implementation == hf.ATTN_IMPLEMENTATION
    with torch.no_grad():  # and a caller's no_grad is left on
        samples = be.baseline_samples(prompts, model, argparse.Namespace(samples=1, inner=1))
        next(samples)
        assert not torch.is_grad_enabled()


def test_e2e_first_sample_binds_the_step_even_with_one_step_samples(monkeypatch):
    """run_tpool with --inner 1: the untimed first sample makes WARMUP_STEPS decode steps, so the bound step
    table.step makes on its second call on the same inputs (~20 ms on 2 cores) is made before the timing; it
    made one, and the first timed sample's table.step read 21 ms instead of ~6 µs. Each timed sample: --inner
    steps, from the prompt again."""
    pytest.importorskip("transformers")
    import tpool
    be = load("bench_e2e")
    model = be.build_model(32, 1, 4, 2, 64)
    step, decodes = tpool.PageTable.step, []

    def counting(table, req_ids, num_tokens, *args, **kw):
        if bool((num_tokens == 1).all()):
            decodes.append(table.seq_lens[: len(req_ids)].tolist())  # the lengths before the step
        return step(table, req_ids, num_tokens, *args, **kw)
    monkeypatch.setattr(tpool.PageTable, "step", counting)
    prompts = torch.randint(1, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    samples = be.run_tpool(model, prompts, argparse.Namespace(samples=2, inner=1, page_size=4, backend="numba"))
    assert len(samples) == 2 and be.WARMUP_STEPS == 3
    assert decodes == [[10, 10], [11, 11], [12, 12], [10, 10], [10, 10]]


def test_prefix_table_from_made_up_runs(tmp_path, monkeypatch, capsys):
    """bench_prefix.py with Engine.run stood in for: the untimed first pair is left out (--repeats walls per
    configuration), the ratio is tok/s over the no-prefix-cache run's, and a run whose tokens differ from the
    first run's stops the script."""
    bp = load("bench_prefix")
    monkeypatch.setattr(bp, "build_model", lambda a: None)
    walls = iter([9.0, 9.0, 1.0, 2.0, 1.0, 2.0, 1.0, 2.0])

    def run_once(model, a, prefix_cache):
        return dict(tokens={0: [1, 2]}, wall_s=next(walls), tokens_out=100, prompt_computed=5, tokens_fed=9,
                    revived=0, cache_hits=0, evicted=0, preemptions=0, steps=10, tpool_us_per_step=1.0,
                    forward_ms_per_step=1.0, calls={})
    monkeypatch.setattr(bp, "run_once", run_once)
    out = tmp_path / "prefix.json"
    argv = TINY["bench_prefix"][:2] + ["--repeats", "3", "--json", str(out)]
    bp.main(argv)
    capsys.readouterr()
    with_cache, without = json_rows(out)
    assert with_cache["walls_s"] == [1.0] * 3 and without["walls_s"] == [2.0] * 3
    assert with_cache["ratio"] == pytest.approx(2.0) and without["ratio"] == 1.0
    tokens = iter([{0: [1, 2]}, {0: [1, 3]}] + [{0: [1, 2]}] * 6)
    monkeypatch.setattr(bp, "run_once", lambda model, a, pc: dict(run_once(model, a, pc), tokens=next(tokens)))
    walls = iter([1.0] * 8)
    with pytest.raises(AssertionError, match="got other tokens than the first run"):
        bp.main(argv)


def test_ab_compare_sample_is_per_call_and_steps_between_cold_calls(monkeypatch):
    """ab_compare.time_sample with a stand-in clock (10 µs a call): warm, a reset, one untimed call, then inner
    calls timed together; cold, after the reset and the untimed call, each call timed alone after a flush and
    followed by an untimed one (a decode loop's next step finds the CSR the last one grew); per call µs."""
    ab = load("ab_compare")
    log = []

    def time_calls_us(fn, n, sync=None):
        log.append(("timed", n))
        for _ in range(n):
            fn()
        return 10.0 * n
    monkeypatch.setattr(ab, "time_calls_us", time_calls_us)
    fn, reset, flush = (lambda: log.append("fn")), (lambda: log.append("reset")), (lambda: log.append("flush"))
    assert ab.time_sample(fn, reset, 4, None) == 10.0
    assert log == ["reset", "fn", ("timed", 4)] + ["fn"] * 4
    log.clear()
    assert ab.time_sample(fn, reset, 2, flush) == 10.0
    assert log == ["reset", "fn"] + ["flush", ("timed", 1), "fn", "fn"] * 2


def test_ab_compare_table_from_made_up_samples(monkeypatch, capsys, tmp_path):
    """ab_compare.compare on an A/A pair (the working tree loaded as the base too) with made-up samples, the
    base's 2 µs, the new version's 1, 1 and 3: new / base is the new median over the base's (0.500), and the
    paired count counts the samples where the new version was faster (2/3). Without --inner, both versions
    of a row take the base's calibrated calls per sample, so paired samples do the same work."""
    import tpool
    ab = load("ab_compare")
    monkeypatch.setattr(sys, "path", list(sys.path))  # (compare puts the base's folder first on it)
    base = types.SimpleNamespace(PagePool=tpool.PagePool, PageTable=tpool.PageTable)
    monkeypatch.setitem(sys.modules, ab.BASE_NAME, base)
    monkeypatch.setattr(ab.bpt, "tpool", ab.bpt.tpool)  # (compare sets it: put back even if the test fails)
    labels = _label_workloads(monkeypatch, ab.bpt, lambda name: "base" if ab.bpt.tpool is base else "new")
    made_up = {"base": iter([2.0, 2.0, 2.0]), "new": iter([1.0, 1.0, 3.0])}
    inners = []
    monkeypatch.setattr(ab, "time_sample", lambda fn, reset, inner, flush: (inners.append((labels[id(fn)], inner)),
                                                                            next(made_up[labels[id(fn)]]))[1])
    args = ab.parser().parse_args(["tpool-numba step", "--batch", "2", "--samples", "3", "--inner", "2"])
    ab.compare(args, str(tmp_path))
    text = capsys.readouterr().out
    assert re.search(r"tpool-numba step +2\.00 +2\.00 / 2\.00 +1\.00 +1\.00 / \S+ +0\.500 +2/3", text), text
    assert ab.bpt.tpool is tpool and {n for _, n in inners} == {2}
    made_up = {"base": iter([2.0] * 3), "new": iter([1.0] * 3)}
    inners.clear()
    monkeypatch.setattr(ab, "calibrate", lambda fn, **kw: 5 if labels[id(fn)] == "base" else 9)
    ab.compare(ab.parser().parse_args(["tpool-numba step", "--batch", "2", "--samples", "3"]), str(tmp_path))
    capsys.readouterr()
    assert sorted(inners) == [("base", 5)] * 3 + [("new", 5)] * 3

