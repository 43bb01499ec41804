"""Capacity planning from a static memory fraction (tpool.memory.planner)."""

import dataclasses
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tpool
from tpool.kernels.layout import INT32_MAX, MAX_INDEXED
from tpool.memory import planner
from tpool.memory.planner import PagePlan, PlanError, plan_pages
from tpool.state import pool_state_bytes, table_state_bytes
from tpool.serving.kv import PagedKVCache

GIB = 1 << 30
MIB = 1 << 20
PAGE = 2 * MIB  # 16 tokens x 128 KiB per token (Llama-3-8B: 32 layers x 8 heads x 128 x K,V x bf16)


def test_hand_worked_80_gib():
    # 80 GiB device, 60 GiB free after the weights, fraction 0.8:
    # static 64 GiB, in use 20 GiB, reserve 16 GiB, pool 44 GiB = 22_528 pages of 2 MiB.
    p = plan_pages(PAGE, 0.8, total_bytes=80 * GIB, free_bytes=60 * GIB)
    assert dataclasses.astuple(p) == (
        PAGE, 0.8, 80 * GIB, 60 * GIB, 0, 20 * GIB, 64 * GIB, 16 * GIB, 0, 0, None, None, None, None, 44 * GIB, 22_528,
        44 * GIB, "given")
    text = p.explain()
    for number in ("85,899,345,920", "68,719,476,736", "47,244,640,256", "22,528 pages"):
        assert number in text


def test_hand_worked_pending_weights_and_extra_reserve():
    # 24 GiB, 20 GiB free BEFORE 14 GiB of weights load, fraction 0.9, 1 GiB extra reserve:
    # static floor(25_769_803_776 x 0.9) = 23_192_823_398; in use 4 + 14 = 18 GiB = 19_327_352_832;
    # pool budget 23_192_823_398 - 19_327_352_832 - 1_073_741_824 = 2_791_728_742 -> 1331 pages.
    p = plan_pages(PAGE, 0.9, total_bytes=24 * GIB, free_bytes=20 * GIB, weights_bytes=14 * GIB,
                   reserve_bytes=GIB)
    assert (p.static_budget_bytes, p.used_bytes, p.pool_budget_bytes) == (23_192_823_398, 18 * GIB, 2_791_728_742)
    assert (p.num_pages, p.pool_bytes, p.runtime_reserve_bytes) == (1331, 1331 * PAGE, 24 * GIB - 23_192_823_398)
    assert p.pool_budget_bytes == p.free_bytes - p.pending_weights_bytes - p.runtime_reserve_bytes - GIB


def test_fraction_is_read_as_its_decimal():
    assert 100 * 0.29 < 29  # binary floating point: 28.999999999999996
    mib = 1 << 20
    assert 0.29 * (100 * mib) < 29 * mib
    assert plan_pages(mib, 0.29, total_bytes=100 * mib, free_bytes=100 * mib).static_budget_bytes == 29 * mib


def test_max_pages_caps():
    p = plan_pages(PAGE, 0.8, total_bytes=80 * GIB, free_bytes=60 * GIB, max_pages=1000)
    assert (p.num_pages, p.pool_bytes, p.pool_budget_bytes) == (1000, 1000 * PAGE, 44 * GIB)


def test_pages_stop_at_what_a_page_pool_takes():
    """A plan gave more pages than PagePool accepts (MAX_INDEXED: its kernels' offsets are int32), and past
    int64 its state's size overflowed (OverflowError, not a plan). The most a pool takes is the cap."""
    p = plan_pages(64, 0.5, total_bytes=400 * GIB, free_bytes=400 * GIB)   # 200 GiB of 64 B pages: 3.36e9
    assert p.num_pages == MAX_INDEXED and p.pool_bytes == MAX_INDEXED * 64
    with pytest.raises(ValueError, match=f"num_pages: expected at most {MAX_INDEXED}"):
        tpool.PagePool(p.num_pages + 1, device="cpu", backend="reference")   # (refused before allocating)
    huge = plan_pages(PAGE, 0.8, total_bytes=10 ** 30, free_bytes=10 ** 30, max_pages=MAX_INDEXED + 1)
    assert huge.num_pages == MAX_INDEXED
    with pytest.raises(ValueError, match=f"min_pages: expected at most {MAX_INDEXED} .* got {MAX_INDEXED + 1}"):
        plan_pages(PAGE, 0.8, total_bytes=10 ** 30, free_bytes=10 ** 30, min_pages=MAX_INDEXED + 1)


def test_weights_exceed_static_budget_suggests_fraction():
    # 24 GiB device, 22 GiB in use after the weights, fraction 0.88: static 21.12 GiB < 22 GiB.
    # Needed: (22 GiB + one 2 MiB page) / 24 GiB = 0.91675 -> 0.92.
    with pytest.raises(PlanError, match=r"mem_fraction_static >= 0\.92") as info:
        plan_pages(PAGE, 0.88, total_bytes=24 * GIB, free_bytes=2 * GIB)
    assert info.value.suggested_fraction == 0.92 and isinstance(info.value, ValueError)
    assert plan_pages(PAGE, 0.92, total_bytes=24 * GIB, free_bytes=2 * GIB).num_pages == 40



def test_a_plan_error_survives_pickle_and_copy():
    """An engine's worker process sends its exceptions to the driver pickled; pickle and copy rebuild an
    exception from its message alone, then restore its attributes. PlanError required suggested_fraction,
    so unpickling it raised TypeError (missing argument) instead of giving the driver the PlanError."""
    import copy
    import pickle
    with pytest.raises(PlanError) as info:
        plan_pages(PAGE, 0.88, total_bytes=24 * GIB, free_bytes=2 * GIB)
    for back in (pickle.loads(pickle.dumps(info.value)), copy.copy(info.value), copy.deepcopy(info.value)):
        assert type(back) is PlanError and str(back) == str(info.value) and back.suggested_fraction == 0.92

def test_min_pages_counts_in_the_suggestion():
    with pytest.raises(PlanError) as info:
        plan_pages(PAGE, 0.8, total_bytes=80 * GIB, free_bytes=60 * GIB, min_pages=30_000)
    # (20 GiB + 30_000 x 2 MiB) / 80 GiB = 0.9824 -> 0.99
    assert info.value.suggested_fraction == 0.99


def test_impossible_even_at_fraction_one():
    with pytest.raises(PlanError, match="even mem_fraction_static=1.0") as info:
        plan_pages(PAGE, 0.9, total_bytes=24 * GIB, free_bytes=20 * GIB, weights_bytes=30 * GIB)
    assert info.value.suggested_fraction is None


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 1 << 24), st.integers(1, 100), st.integers(1 << 20, 1 << 40), st.data())
def test_suggested_fraction_is_the_smallest_that_works(page, percent, total, data):
    free = data.draw(st.integers(0, total))
    kw = dict(total_bytes=total, free_bytes=free)
    try:
        plan = plan_pages(page, percent / 100, **kw)
    except PlanError as e:
        s = e.suggested_fraction
        if s is not None:
            assert plan_pages(page, s, **kw).num_pages >= 1
            d = next(d for d in (2, 3, 4) if round(s, d) == s)   # its step: 0.01, else 0.001 or 0.0001
            if d > 2:                                            # no multiple of 0.01 works on that side
                assert round(s, 2) != s
            if s > percent / 100:   # too few pages: the smallest fraction that gives them
                if s > 10 ** -d:
                    with pytest.raises(PlanError):
                        plan_pages(page, round(s - 10 ** -d, d), **kw)
            else:                   # no room beside the pool: the largest smaller fraction that leaves it
                assert s < percent / 100
                if round(s + 10 ** -d, d) < percent / 100:
                    with pytest.raises(PlanError):
                        plan_pages(page, round(s + 10 ** -d, d), **kw)
    else:
        assert plan.num_pages >= 1 and plan.pool_bytes <= plan.pool_budget_bytes
        assert plan.pool_budget_bytes < plan.pool_bytes + page or plan.num_pages == MAX_INDEXED  # (a pool's most)
        assert plan.used_bytes + plan.pool_budget_bytes <= plan.static_budget_bytes <= total
        # what from_pool and PagePool take beside the pages fits in what the plan leaves
        assert total - plan.used_bytes - plan.pool_bytes >= page + pool_state_bytes(plan.num_pages)


def test_a_fraction_of_one_leaves_room_for_the_scratch_page_and_the_state_or_is_refused():
    """At mem_fraction_static=1.0 the pool took all the free memory, while explain() said its scratch page
    and state come from the runtime reserve, which was 0: the plan could not be allocated at its own numbers."""
    kw = dict(total_bytes=80 * GIB, free_bytes=60 * GIB)
    with pytest.raises(PlanError, match=r"the runtime reserve \(0 B = total - static budget\) cannot hold what the "
                                        r"pool takes beside its 30,720 pages: .*3,971,504 B .*use "
                                        r"mem_fraction_static <= 0.99") as info:
        plan_pages(PAGE, 1.0, **kw)
    assert info.value.suggested_fraction == 0.99
    assert plan_pages(PAGE, 0.99, **kw).num_pages == 30_310
    with pytest.raises(PlanError, match="use mem_fraction_static <= 0.99"):   # the extra reserve is the caller's
        plan_pages(PAGE, 1.0, **kw, reserve_bytes=8 << 20)
    assert plan_pages(PAGE, 1.0, **kw, max_pages=30_000).num_pages == 30_000   # fewer pages: room left
    # min_pages=0 asks whether anything fits: 0 pages is an answer (no pool, nothing beside it), not an error
    assert plan_pages(PAGE, 1.0, total_bytes=80 * GIB, free_bytes=0, min_pages=0).num_pages == 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(bytes_per_page=0), "bytes_per_page"),
    (dict(mem_fraction_static=0.0), "mem_fraction_static"),
    (dict(mem_fraction_static=1.5), "mem_fraction_static"),
    (dict(free_bytes=100 * GIB), "free_bytes must be <= total_bytes"),
    (dict(reserve_bytes=-1), "reserve_bytes"),
    (dict(weights_bytes=-1), "weights_bytes"),
    (dict(max_pages=0, min_pages=1), "max_pages"),
    # bools and numpy floats are not sizes or fractions
    (dict(mem_fraction_static=True), "mem_fraction_static: expected a float in .0, 1., got a bool"),
    (dict(mem_fraction_static=np.bool_(True)), "mem_fraction_static: expected a float in .0, 1., got a bool"),
    (dict(mem_fraction_static=np.float32(1.5)), "mem_fraction_static: expected a float in .0, 1., got np.float32.1.5."),
    (dict(bytes_per_page=True), "bytes_per_page: expected a positive int, got True"),
    (dict(total_bytes=True), "total_bytes: expected a positive int, got True"),
    (dict(reserve_bytes=False), "reserve_bytes: expected a non-negative int, got False"),
    (dict(min_pages=True), "min_pages: expected a non-negative int, got True"),
    (dict(max_pages=2.0), "max_pages: expected a positive int, got 2.0"),
    (dict(min_pages=3, max_pages=2), "max_pages: expected an int >= 3, got 2"),
])
def test_bad_arguments(kwargs, match):
    args = dict(bytes_per_page=PAGE, mem_fraction_static=0.8, total_bytes=80 * GIB, free_bytes=60 * GIB)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        plan_pages(args.pop("bytes_per_page"), args.pop("mem_fraction_static"), **args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_cpu_requires_explicit_budget():
    with pytest.raises(ValueError, match="total_bytes and free_bytes are required"):
        plan_pages(PAGE, 0.8)
    with pytest.raises(ValueError, match="required on cpu"):
        plan_pages(PAGE, 0.8, device="cpu", total_bytes=80 * GIB)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_reads_mem_get_info():
    torch.cuda.empty_cache()  # as plan_pages does before it measures
    free, total = torch.cuda.mem_get_info()
    p = plan_pages(PAGE, 0.9, device="cuda", max_pages=10)
    assert isinstance(p, PagePlan) and p.total_bytes == total and "mem_get_info" in p.source
    assert abs(p.free_bytes - free) < 256 * MIB  # other work may move it a little
    assert p.num_pages == 10
    q = plan_pages(PAGE, 1.0, device="cuda", free_bytes=GIB)  # partial: total comes from the device
    assert q.total_bytes == total and q.free_bytes == GIB and q.num_pages == GIB // PAGE


def test_numpy_ints_are_sizes():
    p = plan_pages(np.int64(PAGE), 0.8, total_bytes=np.int64(80 * GIB), free_bytes=np.uint64(60 * GIB))
    assert p.num_pages == 22_528 and type(p.total_bytes) is int and type(p.bytes_per_page) is int


def test_numpy_numbers_are_fractions_like_python_ones():
    """np.int64(1) was refused while int 1 and np.float64 were accepted; numpy floats read as their decimal."""
    kw = dict(total_bytes=80 * GIB, free_bytes=60 * GIB)
    kw1 = dict(kw, max_pages=30_000)   # (at 1.0 the pool must leave room beside it: max_pages does)
    assert dataclasses.astuple(plan_pages(PAGE, np.int64(1), **kw1)) == dataclasses.astuple(plan_pages(PAGE, 1, **kw1))
    for value in (np.float32(0.88), np.float16(0.5), np.float64(0.88)):
        got, want = plan_pages(PAGE, value, **kw), plan_pages(PAGE, float(str(value)), **kw)
        assert dataclasses.astuple(got) == dataclasses.astuple(want) and type(got.mem_fraction_static) is float
    mib = 1 << 20
    assert plan_pages(mib, np.float32(0.29), total_bytes=100 * mib, free_bytes=100 * mib).static_budget_bytes == \
        29 * mib


class _FakeCuda:
    """torch.cuda as seen by _measure on a machine with one 80 GiB device; records the calls in order."""

    def __init__(self, monkeypatch, free=60 * GIB, total=80 * GIB):
        self.calls = []
        fake = self

        class Device:
            def __init__(self, device):
                self.device = device

            def __enter__(self):
                fake.calls.append(("device", str(self.device)))

            def __exit__(self, *exc):
                fake.calls.append(("device exit", str(self.device)))

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        monkeypatch.setattr(torch.cuda, "device", Device)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: self.calls.append(("empty_cache",)))

        def mem_get_info(device=None):
            self.calls.append(("mem_get_info", str(device)))
            return free, total

        monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)


@pytest.mark.parametrize("device, name", [(None, "cuda:0"), ("cuda", "cuda:0"), ("cuda:1", "cuda:1"), (1, "cuda:1")])
def test_measuring_empties_the_cache_of_that_device_first(monkeypatch, device, name):
    """Memory torch freed but still caches counted as in use: mem_get_info must come after empty_cache."""
    fake = _FakeCuda(monkeypatch)
    p = plan_pages(PAGE, 0.8, device=device)
    assert fake.calls == [("device", name), ("empty_cache",), ("device exit", name), ("mem_get_info", name)]
    assert p.source == f"torch.cuda.mem_get_info({name}) after empty_cache()" and p.num_pages == 22_528
    assert p.explain().splitlines()[0].endswith("after empty_cache()")
    fake.calls.clear()
    assert plan_pages(PAGE, 0.8, device=device, total_bytes=80 * GIB, free_bytes=60 * GIB).source == "given"
    assert fake.calls == []  # nothing measured, nothing emptied


def test_the_source_says_which_of_total_and_free_was_given(monkeypatch):
    """total_bytes given (SGLang's base: the free memory before the weights) and free measured: explain()'s
    total line said the total came from mem_get_info, which gives 80 GiB, not the 70 GiB planned with."""
    _FakeCuda(monkeypatch)
    measured = "torch.cuda.mem_get_info(cuda:0) after empty_cache()"
    p = plan_pages(PAGE, 0.8, total_bytes=70 * GIB)
    assert (p.total_bytes, p.free_bytes, p.source) == (70 * GIB, 60 * GIB, f"given; free: {measured}")
    assert p.explain().splitlines()[0].endswith(f"70.00 GiB   given; free: {measured}")
    p = plan_pages(PAGE, 0.8, free_bytes=40 * GIB)
    assert (p.total_bytes, p.free_bytes, p.source) == (80 * GIB, 40 * GIB, f"{measured}; free given")


@pytest.mark.parametrize("device, match", [
    ("bogus", "device: expected a cpu or cuda device, got 'bogus'"),
    ("meta", "device: expected a cpu or cuda device, got meta"),
    (0, "CUDA is not available"),
    ("cuda:0", "CUDA is not available"),
])
def test_a_device_that_cannot_be_measured_is_a_valueerror(monkeypatch, device, match):
    """device="bogus" or 0 on a CPU-only machine raised torch's RuntimeError, not ValueError."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=match) as info:
        plan_pages(PAGE, 0.8, device=device, total_bytes=80 * GIB)
    assert "or pass both total_bytes and free_bytes" in str(info.value)
    assert plan_pages(PAGE, 0.8, device=device, total_bytes=80 * GIB, free_bytes=60 * GIB).num_pages == 22_528


def test_index_out_of_range_is_a_valueerror(monkeypatch):
    _FakeCuda(monkeypatch)
    with pytest.raises(ValueError, match=r"expected a CUDA index in \[0, 2\), got 5"):
        plan_pages(PAGE, 0.8, device="cuda:5")


def test_explain_says_what_a_cache_built_on_the_plan_adds():
    """from_pool allocates num_pages + 1 pages, and the pool its state: beyond the pool line, the state's bytes
    exact."""
    layers, heads, dim, page = 2, 2, 64, 16
    bpp = 2 * layers * page * heads * dim * 4
    plan = plan_pages(bpp, 0.5, total_bytes=1 << 30, free_bytes=(1 << 29) + 100 * bpp)
    assert plan.num_pages == 100
    pool = tpool.PagePool(plan.num_pages, page_size=page, device="cpu", backend="reference")
    cache = PagedKVCache.from_pool(pool, num_layers=layers, num_kv_heads=heads, head_dim=dim, dtype=torch.float32)
    assert cache.memory_bytes()["storage_bytes"] == plan.pool_bytes + bpp  # the scratch page
    state = pool.memory_bytes()["state_bytes"]
    assert 57 * plan.num_pages <= state < 57 * plan.num_pages + 1024
    note = plan.explain().splitlines()[-1]
    assert note.startswith("note: ") and f"1 scratch page ({bpp:,} B)" in note
    assert f"PagePool state {state:,} B" in note  # read off the layout, as the pool it plans holds it
    big = plan_pages(bpp, 0.5, total_bytes=1 << 40, free_bytes=(1 << 39) + 3_000_000 * bpp)
    big_state = tpool.PagePool(big.num_pages, page_size=page, device="cpu").memory_bytes()["state_bytes"]
    assert f"PagePool state {big_state:,} B" in big.explain().splitlines()[-1]
    assert "scratch page" in planner.__doc__ and "state_bytes" in planner.__doc__


def test_the_note_states_sglangs_base_and_how_to_match_it():
    """The module said it sizes "the way SGLang does"; SGLang's base is the free memory before the weights."""
    doc = " ".join(planner.__doc__.split())
    assert "the way SGLang does" not in doc
    assert "free_after_load - free_before_load * (1 - fraction)" in doc and "gpu_memory_utilization" in doc
    # what the note says: SGLang's number is tpool's with total_bytes = free before the weights
    total, ctx, other, weights, f = 80 * GIB, GIB // 2, 20 * GIB, 16 * GIB, 0.88
    before = total - ctx - other
    after = before - weights
    sglang = int(after - before * (1 - f)) // PAGE
    assert plan_pages(PAGE, f, total_bytes=before, free_bytes=after).num_pages == sglang
    ours = plan_pages(PAGE, f, total_bytes=total, free_bytes=after).num_pages
    assert abs((sglang - ours) * PAGE - (1 - f) * (ctx + other)) <= PAGE


def test_the_suggested_fraction_counts_the_extra_reserve():
    """Too few pages with reserve_bytes: the suggestion must cover in use + extra reserve + min_pages pages."""
    kw = dict(total_bytes=80 * GIB, free_bytes=60 * GIB, reserve_bytes=8 * GIB)
    with pytest.raises(PlanError, match=r"use mem_fraction_static >= 0\.36") as info:
        plan_pages(PAGE, 0.2, **kw)
    # (20 GiB in use + 8 GiB reserve + one 2 MiB page) / 80 GiB = 0.350025 -> 0.36
    assert info.value.suggested_fraction == 0.36
    assert plan_pages(PAGE, 0.36, **kw).num_pages >= 1
    with pytest.raises(PlanError):
        plan_pages(PAGE, 0.35, **kw)


def test_need_exactly_the_total_is_not_called_short():
    """min_pages that fill the device to the byte: no fraction leaves room beside them, which the message
    says; it is not "short by 0 B" of the device."""
    with pytest.raises(PlanError) as info:
        plan_pages(PAGE, 0.5, total_bytes=100 * PAGE, free_bytes=10 * PAGE, min_pages=10)
    assert info.value.suggested_fraction is None
    assert "no fraction leaves room" in str(info.value)
    assert "short by" not in str(info.value)


def test_no_room_beside_the_pool_at_a_fraction_between_percents():
    """At 0.995 the reserve cannot hold the scratch page and state: the suggestion is the largest
    whole-percent fraction below it that can (0.99), not one step lower."""
    kw = dict(total_bytes=GIB, free_bytes=GIB)
    with pytest.raises(PlanError, match=r"mem_fraction_static <= 0\.99") as info:
        plan_pages(8 * MIB, 0.995, **kw)
    assert info.value.suggested_fraction == 0.99
    assert plan_pages(8 * MIB, 0.99, **kw).num_pages == 126


@pytest.mark.parametrize("fraction, says, suggested", [(0.9, ">=", 0.994), (1.0, "<=", 0.999)])
def test_a_suggestion_finer_than_a_percent_when_no_percent_works(fraction, says, suggested):
    """79.5 GiB of 80 in use after the weights: every whole percent either gives no page or, rounded up to
    give them, so many (1.00: 255) that nothing is left beside them for the scratch page and the state; a
    step of 0.001 finds the fraction that works (0.994: 10 pages, 0.999: 215), where the suggestion used to
    be None ("no fraction leaves room")."""
    kw = dict(total_bytes=80 * GIB, free_bytes=GIB // 2)
    with pytest.raises(PlanError, match=f"use mem_fraction_static {says} {suggested}$") as info:
        plan_pages(2 * MIB, fraction, **kw)
    assert info.value.suggested_fraction == suggested
    assert plan_pages(2 * MIB, suggested, **kw).num_pages == (10 if fraction < 1 else 215)
    with pytest.raises(PlanError):                           # the next step past it does not work
        plan_pages(2 * MIB, round(suggested - 0.001 if fraction < 1 else suggested + 0.001, 3), **kw)


def test_no_room_beside_the_pool_suggests_a_fraction_giving_exactly_min_pages():
    """The largest smaller fraction that leaves room may give exactly min_pages: that one is suggested."""
    kw = dict(total_bytes=GIB, free_bytes=GIB, min_pages=126)
    with pytest.raises(PlanError, match="cannot hold") as info:
        plan_pages(8 * MIB, 1.0, **kw)
    assert info.value.suggested_fraction == 0.99
    assert plan_pages(8 * MIB, 0.99, **kw).num_pages == 126


def test_weights_over_the_static_budget_with_min_pages_0_plan_no_pool():
    """A negative pool budget with min_pages=0 is a plan of 0 pages (0 bytes), not an error."""
    p = plan_pages(PAGE, 0.5, total_bytes=80 * GIB, free_bytes=10 * GIB, min_pages=0)
    assert p.pool_budget_bytes < 0
    assert (p.num_pages, p.pool_bytes) == (0, 0)
    q = plan_pages(PAGE, 0.5, total_bytes=80 * GIB, free_bytes=10 * GIB, min_pages=0, max_pages=5)
    assert (q.num_pages, q.pool_bytes) == (0, 0)


def test_a_given_total_is_kept_when_free_is_measured(monkeypatch):
    """total_bytes given, free_bytes measured: the plan's total is the given one, not the device's."""
    fake = _FakeCuda(monkeypatch, free=30 * GIB, total=80 * GIB)
    p = plan_pages(PAGE, 0.8, device="cuda:0", total_bytes=40 * GIB)
    assert ("mem_get_info", "cuda:0") in fake.calls
    assert (p.total_bytes, p.free_bytes) == (40 * GIB, 30 * GIB)
    assert p.num_pages == 22 * GIB // PAGE      # static 32 GiB, in use 40 - 30 = 10 GiB: a pool of 22 GiB


# ------------------------------------------------------------------ the page table's state (helper-182)
def _storage_bytes(tensors):
    """Bytes of the distinct storages behind ``tensors``, measured from the storages themselves."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


@pytest.mark.parametrize("max_requests, max_len, page_size, max_batch", [
    (1, 1, 1, None), (7, 100, 16, 5), (3, 33, 32, None), (5, 4096, 1, 13), (256, 128 << 10, 16, None)])
def test_the_planned_table_is_what_a_page_table_allocates(max_requests, max_len, page_size, max_batch):
    """The table's state came out of the runtime reserve unplanned: at page_size 1, 256 requests of 128k tokens
    hold a 128 MiB block table. The plan counts what a PageTable with those arguments allocates, byte for byte."""
    kw = {} if max_batch is None else {"max_batch": max_batch}
    plan = plan_pages(PAGE, 0.8, total_bytes=80 * GIB, free_bytes=60 * GIB, max_requests=max_requests,
                      max_len=max_len, page_size=page_size, **kw)
    pages = -(-max_len // page_size)
    assert (plan.max_requests, plan.max_pages_per_request) == (max_requests, pages)
    pool = tpool.PagePool(8, page_size=page_size, device="cpu", backend="reference", **kw)
    table = tpool.PageTable(pool, plan.max_requests, plan.max_pages_per_request)
    assert plan.table_bytes == _storage_bytes(table.state.tensors().values()) == table.memory_bytes()["total_bytes"]
    assert f"block table {_storage_bytes([table.block_table]):,} B" in plan.explain()
    # it comes out of the pool budget: the pages are what is left after it
    assert plan.pool_budget_bytes == 44 * GIB - plan.table_bytes
    assert plan.num_pages == (44 * GIB - plan.table_bytes) // PAGE


def test_the_table_from_the_brief_and_explain():
    """256 requests of 128k tokens at page_size 1: 128 MiB of block table, its own line in explain()."""
    plan = plan_pages(PAGE, 0.8, total_bytes=80 * GIB, free_bytes=60 * GIB, max_requests=256, max_len=128 << 10,
                      page_size=1)
    # the block table; per row seq_lens, claim, row_version (int32, int32, int64); version (2 x int64); lane_end
    rows, cells, lanes = 256 * (4 + 4 + 8), 2 * 8, 4096 * 4
    assert plan.table_bytes == 256 * 131_072 * 4 + rows + cells + lanes == 128 * MIB + 20_496 == 134_238_224
    assert plan.num_pages == 22_528 - 65   # 134,238,224 B is 64.01 pages
    lines = plan.explain().splitlines()
    assert [line.split("  ")[0] for line in lines[:-1]] == [
        "total", "free", "in use", "static budget", "runtime reserve", "extra reserve", "page table", "pool budget",
        "pool"]
    assert "134,238,224 B" in lines[6] and "PageTable(256 x 131,072)" in lines[6] and "134,217,728 B" in lines[6]
    assert lines[7].endswith("static budget - in use - extra reserve - page table")
    assert "PageTable's call-shape buffers" in lines[-1] and lines[-1].endswith("from the reserve")
    # without a table the text is what it was: eight lines and the note
    bare = plan_pages(PAGE, 0.8, total_bytes=80 * GIB, free_bytes=60 * GIB).explain().splitlines()
    assert len(bare) == 9 and not any(line.startswith("page table") for line in bare)
    assert "PageTable" not in bare[-1] and bare[6].endswith("static budget - in use - extra reserve")


def test_a_table_that_does_not_fit_is_a_plan_error_with_a_suggestion():
    kw = dict(total_bytes=80 * GIB, free_bytes=60 * GIB)
    table = dict(max_requests=256, max_len=128 << 10, page_size=1)
    assert plan_pages(PAGE, 0.251, **kw).num_pages == 40          # 85,899,345 B without the table
    with pytest.raises(PlanError, match=r"0 B extra reserve and 134,238,224 B of page table; .* "
                                        r"use mem_fraction_static >= 0\.26$") as info:
        plan_pages(PAGE, 0.251, **kw, **table)
    # (20 GiB + 134,238,224 B + one page) / 80 GiB = 0.25159 -> 0.26
    assert info.value.suggested_fraction == 0.26
    assert plan_pages(PAGE, 0.26, **kw, **table).num_pages >= 1
    # a table bigger than the device: no fraction helps
    with pytest.raises(PlanError, match="even mem_fraction_static=1.0 is short by") as info:
        plan_pages(PAGE, 0.5, total_bytes=GIB, free_bytes=GIB, max_requests=4096, max_len=128 << 10, page_size=1)
    assert info.value.suggested_fraction is None


def test_a_table_leaves_room_beside_the_pool_at_a_fraction_of_one():
    """The table's bytes count in what is left beside the pool too: at 1.0 the scratch page and state still fit."""
    kw = dict(total_bytes=GIB, free_bytes=GIB, max_requests=100, max_len=1000, page_size=16)
    with pytest.raises(PlanError, match="cannot hold") as info:
        plan_pages(8 * MIB, 1.0, **kw)
    p = plan_pages(8 * MIB, info.value.suggested_fraction, **kw)
    assert GIB - p.used_bytes - p.table_bytes - p.pool_bytes >= 8 * MIB + pool_state_bytes(p.num_pages)


def test_with_a_table_the_pages_stop_where_its_slots_pass_int32():
    """A PageTable refuses a pool with num_pages * page_size over INT32_MAX: the plan stops below it."""
    kw = dict(total_bytes=1 << 50, free_bytes=1 << 50, max_requests=1, max_len=64, page_size=64)
    assert plan_pages(64, 0.5, **kw).num_pages == INT32_MAX // 64
    assert plan_pages(64, 0.5, total_bytes=1 << 50, free_bytes=1 << 50).num_pages == MAX_INDEXED   # no table
    with pytest.raises(ValueError, match=f"min_pages: expected at most {INT32_MAX // 64} .* got {INT32_MAX // 64 + 1}"):
        plan_pages(64, 0.5, **kw, min_pages=INT32_MAX // 64 + 1)
    # a max_pages given stops there too (a mutation test, helper-196: min(max_pages, MAX_INDEXED) passed)
    assert plan_pages(64, 0.5, **kw, max_pages=MAX_INDEXED).num_pages == INT32_MAX // 64


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_requests=8), r"expected all three, got max_requests=8, max_len=None, page_size=None "
                           r"\(missing max_len, page_size\)"),
    (dict(max_len=4096, page_size=16), r"got max_requests=None, max_len=4096, page_size=16 \(missing max_requests\)"),
    (dict(page_size=16), r"\(missing max_requests, max_len\)"),
    (dict(max_batch=64), "max_batch sizes a PageTable's scratch: expected max_requests, max_len and page_size with "
                         "it, got max_batch=64 alone"),
    (dict(max_requests=0, max_len=1, page_size=1), "max_requests: expected a positive int, got 0"),
    (dict(max_requests=True, max_len=1, page_size=1), "max_requests: expected a positive int, got True"),
    (dict(max_requests=1, max_len=0, page_size=1), "max_len: expected a positive int, got 0"),
    (dict(max_requests=1, max_len=1, page_size=2.0), "page_size: expected a positive int, got 2.0"),
    (dict(max_requests=1, max_len=1, page_size=1, max_batch=0), "max_batch: expected a positive int, got 0"),
    (dict(max_requests=1, max_len=1, page_size=1, max_batch=MAX_INDEXED + 1),
     f"max_batch: expected at most {MAX_INDEXED} .*, got {MAX_INDEXED + 1}"),
    (dict(max_requests=1, max_len=INT32_MAX + 1, page_size=1), r"max_len: lengths are int32, so ceil\(max_len / "
     rf"page_size\) \* page_size must be at most {INT32_MAX}, got {INT32_MAX + 1} \* 1"),
    (dict(max_requests=1, max_len=INT32_MAX, page_size=16), rf"got {(INT32_MAX + 15) // 16} \* 16"),
    (dict(max_requests=1 << 16, max_len=1 << 16, page_size=1),
     rf"expected at most {MAX_INDEXED} table entries, got 65536 \* 65536"),
])
def test_bad_table_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        plan_pages(PAGE, 0.8, total_bytes=80 * GIB, free_bytes=60 * GIB, **kwargs)
    assert not isinstance(info.value, PlanError)


@pytest.mark.parametrize("max_requests, max_len, page_size", [(1, INT32_MAX, 16), (1 << 16, 1 << 16, 1)])
def test_a_page_table_refuses_what_the_plan_refuses(max_requests, max_len, page_size):
    """The plan's refusals are PageTable's own (checked before it allocates)."""
    pool = tpool.PagePool(8, page_size=page_size, device="cpu", backend="reference")
    with pytest.raises(ValueError):
        tpool.PageTable(pool, max_requests, -(-max_len // page_size))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 1 << 24), st.integers(1, 100), st.integers(1 << 20, 1 << 40), st.integers(1, 512),
       st.integers(1, 1 << 17), st.sampled_from([1, 16, 64]), st.data())
def test_a_plan_with_a_table_holds_the_table(page, percent, total, requests, max_len, page_size, data):
    free = data.draw(st.integers(0, total))
    kw = dict(total_bytes=total, free_bytes=free, max_requests=requests, max_len=max_len, page_size=page_size)
    try:
        plan = plan_pages(page, percent / 100, **kw)
    except PlanError as e:
        if e.suggested_fraction is not None:
            assert plan_pages(page, e.suggested_fraction, **kw).num_pages >= 1
    else:
        assert plan.used_bytes + plan.table_bytes + plan.pool_bytes <= plan.static_budget_bytes
        most = min(INT32_MAX // page_size, MAX_INDEXED)   # the most pages a PageTable's pool may have
        assert plan.pool_budget_bytes < plan.pool_bytes + page or plan.num_pages == most
        assert total - plan.used_bytes - plan.table_bytes - plan.pool_bytes >= page + pool_state_bytes(plan.num_pages)


# ------------------------------------------------- the sizes the plan accepts are the ones the classes accept
class _Reached(Exception):
    """Raised where a constructor starts allocating: every check of its sizes has passed."""


@pytest.fixture
def no_alloc(monkeypatch):
    """PagePool and PageTable checked at any size without allocating: a pool's state is an 8-page one (its
    ``num_pages`` stays what was asked), and a table stops where it would allocate its state. (The names in
    their modules only: the planner reads the sizes off the real layouts.)"""
    import tpool.page_table
    import tpool.pool
    from tpool.state import PoolState

    class SmallPool:
        @staticmethod
        def create(num_pages, device):
            return PoolState.create(8, device)

    class NoTable:
        @staticmethod
        def create(*args):
            raise _Reached
    monkeypatch.setattr(tpool.pool, "PoolState", SmallPool)
    monkeypatch.setattr(tpool.page_table, "TableState", NoTable)


def _classes_accept(max_requests, pages, page_size, num_pages, max_batch) -> bool:
    """Whether PagePool(num_pages, page_size, max_batch=) and a PageTable(pool, max_requests, pages) over it
    pass their checks (``no_alloc``: nothing is allocated)."""
    try:
        pool = tpool.PagePool(num_pages, page_size, device="cpu", backend="reference", max_batch=max_batch)
        tpool.PageTable(pool, max_requests, pages)
    except _Reached:
        return True
    except ValueError:
        return False
    raise AssertionError("PageTable was made without allocating its state")


def _plan_accepts(max_requests, max_len, page_size, num_pages, max_batch) -> bool:
    """Whether plan_pages plans exactly ``num_pages`` pages with that table (on a device that holds them)."""
    try:
        plan = plan_pages(1, 0.5, total_bytes=1 << 50, free_bytes=1 << 50, min_pages=num_pages, max_pages=num_pages,
                          max_requests=max_requests, max_len=max_len, page_size=page_size, max_batch=max_batch)
    except PlanError:
        raise AssertionError("the device holds any table and pool these sizes allow") from None
    except ValueError:
        return False
    assert (plan.num_pages, plan.max_pages_per_request) == (num_pages, -(-max_len // page_size))
    return True


_EDGE = INT32_MAX // 3   # pages of 3 tokens whose slots reach INT32_MAX
_ROWS = MAX_INDEXED // (1 << 16)   # rows of 65,536 entries that make MAX_INDEXED entries


@pytest.mark.parametrize("max_requests, max_len, page_size, num_pages, max_batch, ok", [
    (1, 1, INT32_MAX, 1, 1, True),                          # the longest page
    (1, 1, INT32_MAX + 1, 1, 1, False),                     # one token longer: no slot of it is int32
    (1, 2047 << 20, 1 << 20, 2047, 1, True),                # a row of INT32_MAX // page_size pages
    (1, (2047 << 20) + 1, 1 << 20, 2048, 1, False),         # one token more takes a page more: past int32
    (1, 3, 3, _EDGE, 1, True),                              # the pool's slots up to INT32_MAX
    (1, 3, 3, _EDGE + 1, 1, False),                         # one page more
    (_ROWS, 1 << 16, 1, 8, 1, True),                        # MAX_INDEXED table entries
    (_ROWS + 1, 1 << 16, 1, 8, 1, False),                   # a row more
    (1, 1, 1, MAX_INDEXED, MAX_INDEXED, True),              # the most pages and lanes a pool takes
    (1, 1, 1, MAX_INDEXED + 1, 1, False),
    (1, 1, 1, 8, MAX_INDEXED + 1, False),
])
def test_the_plan_accepts_the_sizes_a_page_pool_and_table_accept(no_alloc, max_requests, max_len, page_size,
                                                                  num_pages, max_batch, ok):
    """Each bound of PagePool and PageTable at its edge and one past it: the plan takes a size exactly when
    the classes do. A page over INT32_MAX tokens was a pool PagePool made and no PageTable took (the plan
    refused it as a max_len error); the table's bounds are one check shared by the two (_checks)."""
    pages = -(-max_len // page_size)
    assert _classes_accept(max_requests, pages, page_size, num_pages, max_batch) is ok
    assert _plan_accepts(max_requests, max_len, page_size, num_pages, max_batch) is ok


def test_a_page_over_int32_tokens_is_refused_by_the_pool_and_the_plan_alike():
    """PagePool(8, page_size=2**40) was made, and only a PageTable over it refused it; the plan named max_len."""
    match = f"page_size: expected at most {INT32_MAX} tokens .*got {2 ** 40}"
    with pytest.raises(ValueError, match=match):
        tpool.PagePool(8, page_size=2 ** 40, device="cpu", backend="reference")
    with pytest.raises(ValueError, match=match):
        plan_pages(PAGE, 0.8, total_bytes=80 * GIB, free_bytes=60 * GIB, max_requests=1, max_len=1, page_size=2 ** 40)


def test_a_plan_records_the_page_size_and_max_batch_of_its_table():
    """PagePlan kept max_requests and max_pages_per_request but not the page_size and max_batch it was given,
    so the pool it planned could not be built from the plan alone."""
    kw = dict(total_bytes=80 * GIB, free_bytes=60 * GIB)
    bare = plan_pages(PAGE, 0.8, **kw)
    assert (bare.page_size, bare.max_batch) == (None, None)
    p = plan_pages(PAGE, 0.8, **kw, max_requests=3, max_len=100, page_size=16, max_batch=5)
    assert (p.max_requests, p.max_pages_per_request, p.page_size, p.max_batch) == (3, 7, 16, 5)
    assert "(page_size 16, max_batch 5)" in p.explain()
    assert plan_pages(PAGE, 0.8, **kw, max_requests=3, max_len=100, page_size=16).max_batch == 4096   # the default


@pytest.mark.parametrize("table, kept", [
    ({}, "what is in use and the extra reserve"),                                           # weights over it
    (dict(max_requests=4096, max_len=128 << 10, page_size=1), "what is in use, the extra reserve and the page table"),
])
def test_a_plan_of_no_pages_says_why_no_pool_fits(table, kept):
    """With min_pages=0, weights or a table over the static budget planned 0 pages with a negative pool budget,
    and explain() still spoke of the scratch page and PagePool state of a pool that cannot exist (PagePool takes
    at least one page). The plan stays an answer (as for the weights before), and its note says why no pool
    fits and by how much; min_pages=1 gives the PlanError with the fraction."""
    # 70 GiB of weights on an 80 GiB device; a 2 GiB block table on a 1 GiB one
    kw = dict(total_bytes=GIB, free_bytes=GIB, **table) if table else dict(total_bytes=80 * GIB, free_bytes=10 * GIB)
    p = plan_pages(PAGE, 0.5, min_pages=0, **kw)
    assert p.num_pages == 0 and p.pool_budget_bytes < 0
    note = p.explain().splitlines()[-1]
    assert note == (f"note: no pool fits (the static budget is {-p.pool_budget_bytes:,} B short of {kept}); "
                    f"plan_pages(..., min_pages=1) raises a PlanError naming the fraction that gives one, if any")
    with pytest.raises(PlanError):
        plan_pages(PAGE, 0.5, **kw)


def test_a_plan_of_no_pages_for_a_budget_under_a_page_or_max_pages_0():
    kw = dict(total_bytes=80 * GIB, free_bytes=60 * GIB)
    small = plan_pages(64 * GIB, 0.8, min_pages=0, **kw)              # 44 GiB budget, 64 GiB pages
    assert small.num_pages == 0 and small.pool_budget_bytes == 44 * GIB
    assert small.explain().splitlines()[-1].startswith("note: no pool fits (the pool budget holds no page of "
                                                       "68,719,476,736 B)")
    assert plan_pages(PAGE, 0.8, min_pages=0, max_pages=0, **kw).explain().splitlines()[-1] == \
        "note: no pool (max_pages=0)"
    # The edges (a mutation test, helper-196: >= and < could each move by one with no test failing): a
    # budget of exactly one page holds one, so only max_pages=0 left it out; a budget of exactly 0 is short
    # of nothing, it holds no page.
    assert plan_pages(44 * GIB, 0.8, min_pages=0, max_pages=0, **kw).explain().splitlines()[-1] == \
        "note: no pool (max_pages=0)"
    zero = plan_pages(PAGE, 0.25, min_pages=0, **kw)                   # 20 GiB budget, 20 GiB in use
    assert zero.num_pages == 0 and zero.pool_budget_bytes == 0
    assert zero.explain().splitlines()[-1].startswith(f"note: no pool fits (the pool budget holds no page of "
                                                      f"{PAGE:,} B)")


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4096), st.integers(1, 300), st.integers(1, 64), st.integers(1, 40), st.integers(1, 100),
       st.data())
def test_the_plans_bytes_are_the_storages_of_the_pool_and_table_it_plans(page, pages, requests, page_size,
                                                                         max_batch, data):
    """Random sizes: the pool and table built from the plan's own fields hold exactly the bytes it counts
    (the table's state, the PagePool state its note gives) and its pages, in storages measured directly."""
    max_len = data.draw(st.integers(1, 50 * page_size))
    table_kw = dict(max_requests=requests, max_len=max_len, page_size=page_size, max_batch=max_batch)
    table = table_state_bytes(requests, -(-max_len // page_size), max_batch)
    total = 4 * (table + pages * page + page + pool_state_bytes(pages))   # pages fit at 0.5, room beside them
    p = plan_pages(page, 0.5, total_bytes=total, free_bytes=total, max_pages=pages, **table_kw)
    assert p.num_pages == pages
    pool = tpool.PagePool(p.num_pages, p.page_size, device="cpu", backend="reference", max_batch=p.max_batch)
    t = tpool.PageTable(pool, p.max_requests, p.max_pages_per_request)
    assert p.table_bytes == _storage_bytes(t.state.tensors().values()) == table
    assert f"PagePool state {_storage_bytes(pool.state.tensors().values()):,} B" in p.explain()
    assert p.pool_bytes == pages * page and p.pool_budget_bytes == total // 2 - table


def test_room_beside_the_pool_exactly_its_scratch_page_and_state_is_enough():
    """What is left after the pool may equal, not only exceed, what the pool takes beside its pages."""
    page, pages = 1 << 20, 100
    total = pages * page + page + pool_state_bytes(pages)  # left after 100 pages: exactly their page and state
    plan = plan_pages(page, Fraction(pages * page, total), total_bytes=total, free_bytes=total)
    assert plan.num_pages == pages and plan.runtime_reserve_bytes == page + pool_state_bytes(pages)


def test_a_suggested_fraction_keeps_its_trailing_zero():
    """A suggestion is written to its step: 0.90, as 0.92 is, not 0.9."""
    page = 1 << 20
    with pytest.raises(PlanError, match=r"use mem_fraction_static >= 0\.90$") as info:
        plan_pages(page, 0.5, total_bytes=1000 * page, free_bytes=1000 * page, min_pages=900)
    assert info.value.suggested_fraction == 0.9
