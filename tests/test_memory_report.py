"""The three ledgers and the report CLI (tpool.memory.report)."""

import gc
import json
import re
import sys

import numpy as np
import pytest
import torch

from tpool import PagePool, PageTable
from tpool.memory import report as report_module
from tpool.memory.owned_cache import OwnedCache
from tpool.memory.report import MemoryReport, format_report, main, memory_report

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class FakePool:
    name = "kv"

    def memory_bytes(self):
        return {"state_bytes": 4096, "pages_bytes": 1 << 20, "backend": "numba"}


def _cache():
    cache = OwnedCache(2 << 20)
    cache.name = "mm"
    cache.put("img", torch.zeros(1000, 4096, dtype=torch.bfloat16).split(100)[3])
    return cache


def test_cpu_report_structure():
    report = memory_report("cpu", pools=[FakePool()], caches=[_cache()])
    assert isinstance(report, MemoryReport) and report.device == "cpu"
    assert report.tracked.caches["mm"]["payload_bytes"] == 819_200
    assert report.tracked.caches["mm"]["storage_bytes"] == 819_200
    assert report.tracked.pools == {"kv": {"state_bytes": 4096, "pages_bytes": 1 << 20, "backend": "numba"}}
    a, d = report.allocator, report.driver
    assert {a.allocated_bytes, a.reserved_bytes, a.peak_allocated_bytes, a.peak_reserved_bytes,
            a.inactive_split_bytes} == {None} and "cpu" in a.unavailable
    assert {d.total_bytes, d.free_bytes, d.used_bytes, d.non_pytorch_bytes} == {None} and "cpu" in d.unavailable
    assert report.process.rss_bytes > 1 << 20 and report.process.peak_rss_bytes >= report.process.rss_bytes


def test_process_rss_sees_a_big_host_allocation():
    gc.collect()   # garbage freed between the two readings would hide part of the allocation
    before = memory_report("cpu").process.rss_bytes
    big = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    after = memory_report("cpu").process.rss_bytes
    assert after - before >= 48 << 20
    del big


def test_to_dict_is_json_and_complete():
    d = memory_report("cpu", caches=[_cache()]).to_dict()
    assert set(d) == {"device", "tracked", "allocator", "driver", "process"}
    assert set(d["driver"]) == {"total_bytes", "free_bytes", "used_bytes", "non_pytorch_bytes", "unavailable"}
    assert json.loads(json.dumps(d)) == d


def test_names_default_and_collide():
    a, b = OwnedCache(10), OwnedCache(10)
    assert list(memory_report("cpu", caches=[a, b]).tracked.caches) == ["OwnedCache[0]", "OwnedCache[1]"]
    a.name = b.name = "mm"
    assert list(memory_report("cpu", caches=[a, b]).tracked.caches) == ["mm", "mm[1]"]


def test_a_renamed_duplicate_never_replaces_another_name():
    caches = [OwnedCache(100), OwnedCache(200), OwnedCache(300), OwnedCache(400)]
    for cache, name in zip(caches, ["kv", "kv[2]", "kv", "kv"]):
        cache.name = name
    got = memory_report("cpu", caches=caches).tracked.caches
    assert {k: v["budget_bytes"] for k, v in got.items()} == {"kv": 100, "kv[2]": 200, "kv[3]": 300, "kv[4]": 400}
    named = OwnedCache(10)
    named.name = "OwnedCache[1]"  # a name that a default name would take
    assert list(memory_report("cpu", caches=[named, OwnedCache(20)]).tracked.caches) == \
        ["OwnedCache[1]", "OwnedCache[1][1]"]


@pytest.mark.parametrize("device", ["bogus", "meta", "cuda:x"])
def test_a_device_torch_cannot_parse_or_tpool_cannot_use_is_a_valueerror(device, capsys):
    with pytest.raises(ValueError, match="device: expected a cpu or cuda device"):
        memory_report(device)
    assert main(["report", "--device", device]) == 2
    err = capsys.readouterr().err
    assert "expected a cpu or cuda device" in err
    assert err.startswith("usage: ") and "report: error: --device: expected" in err   # (the demo's form too)


def test_the_report_takes_no_abbreviated_option(capsys):
    """``report --js`` ran as ``--json`` where the demos refuse an abbreviation: one rule for the CLI."""
    with pytest.raises(SystemExit) as e:
        main(["report", "--js"])
    assert e.value.code == 2
    assert "unrecognized arguments: --js" in capsys.readouterr().err


@pytest.mark.parametrize("bad, match", [
    (object(), "memory_bytes"),
    (type("P", (), {"memory_bytes": lambda s: [1]})(), "dict"),
    (type("P", (), {"memory_bytes": lambda s: {"t": torch.zeros(1)}})(), "dict"),
    (type("P", (), {"memory_bytes": lambda s: {"x_bytes": float("nan")}})(), "not nan or inf"),   # (--json wrote NaN)
    (type("P", (), {"memory_bytes": lambda s: {"x_bytes": float("-inf")}})(), "not nan or inf"),
])
def test_pools_must_offer_memory_bytes(bad, match):
    with pytest.raises(TypeError, match=match):
        memory_report("cpu", pools=[bad])


def test_a_pool_with_no_numbers_is_named_not_taken_for_none_passed():
    """The table said "(no caches or pools passed)" for a pool whose memory_bytes() gave {}."""
    empty = type("Empty", (), {"memory_bytes": lambda s: {}})()
    text = format_report(memory_report("cpu", pools=[empty]))
    assert "pool Empty" in text and "its memory_bytes() gave no numbers" in text and "no caches or pools" not in text


def test_format_report_table():
    text = format_report(memory_report("cpu", pools=[FakePool()], caches=[_cache()]))
    lines = text.splitlines()
    assert lines[0] == "tpool memory report: cpu"
    row = next(line for line in lines if "cache mm: storage_bytes" in line)
    assert "819,200" in row and row.rstrip().endswith("0.78")
    assert any(line.startswith("allocator") and "n/a" in line and "statistics" in line for line in lines)
    assert any(line.startswith("driver") and "n/a" in line for line in lines)
    assert any("pool kv: pages_bytes" in line and "1.00" in line for line in lines)
    assert any("pool kv: backend" in line and line.rstrip().endswith("numba") for line in lines)
    # the number columns line up: a text value longer than the bytes column (a table's name) sits in
    # the note column, and the bytes column holds only numbers, n/a or nothing
    table = PageTable(PagePool(64, page_size=4, device="cpu"), max_requests=4, max_pages_per_request=8)
    lines = format_report(memory_report("cpu", pools=[FakePool(), table])).splitlines()
    header = lines[1]
    bytes_end = header.index("bytes") + len("bytes")
    for line in lines[2:]:
        column = line[bytes_end - 16:bytes_end]
        assert re.fullmatch(r" *([0-9,]+|n/a)?", column), line
    assert any(": name" in line and line.rstrip().endswith("page_size=4, device=cpu, backend='numba'))")
               for line in lines)


def test_cli_json_and_table(capsys):
    assert main(["report", "--json", "--device", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == "cpu" and out["allocator"]["allocated_bytes"] is None
    assert main(["--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("tpool memory report: cpu")


@no_cuda
def test_cuda_requested_without_cuda(capsys):
    with pytest.raises(ValueError, match="CUDA is not available"):
        memory_report("cuda:0")
    assert main(["report", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "report: error: --device: expected cpu, got cuda" in err and "CUDA is not available" in err


@pytest.mark.gpu
@needs_cuda
def test_cuda_ledgers_are_consistent():
    r = memory_report("cuda")
    a, d = r.allocator, r.driver
    assert a.unavailable is None and d.unavailable is None
    assert 0 <= a.allocated_bytes <= a.reserved_bytes <= a.peak_reserved_bytes
    assert d.used_bytes == d.total_bytes - d.free_bytes
    assert d.non_pytorch_bytes == d.used_bytes - a.reserved_bytes > 0  # the CUDA context at least
    assert r.device == f"cuda:{torch.cuda.current_device()}"


@pytest.mark.gpu
@needs_cuda
def test_cuda_freed_blocks_stay_reserved():
    torch.cuda.synchronize()
    before = memory_report("cuda").allocator
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    during = memory_report("cuda").allocator
    del x
    after = memory_report("cuda").allocator
    assert during.allocated_bytes - before.allocated_bytes == 64 << 20
    assert after.allocated_bytes == before.allocated_bytes
    assert after.reserved_bytes == during.reserved_bytes >= before.reserved_bytes
    assert during.peak_allocated_bytes >= during.allocated_bytes


def test_memory_report_counts_pool_state():
    import tpool

    pool = tpool.PagePool(1024, device="cpu", backend="numba")
    report = tpool.memory_report("cpu", pools=[pool])
    tracked = report.to_dict()["tracked"]["pools"]
    # per page: free stack, refcount, state, stamp, generation, two int32 scratch, int64 keys, four int32
    # LRU queue slots and an int64 queue position; plus 27 int64 counters and the 27 that check() has seen
    per_page = 4 + 4 + 1 + 8 + 4 + 4 + 4 + 8 + 4 * 4 + 8
    assert [v["state_bytes"] for v in tracked.values()] == [1024 * per_page + 2 * 8 * 27]


def test_one_cache_or_pool_is_taken_as_a_list_of_one():
    """``caches=cache`` (not ``[cache]``) failed with "'OwnedCache' object is not iterable"."""
    import tpool

    cache, pool = OwnedCache(1 << 20), tpool.PagePool(8, device="cpu", backend="reference")
    one = memory_report("cpu", caches=cache, pools=pool).to_dict()["tracked"]
    listed = memory_report("cpu", caches=[cache], pools=[pool]).to_dict()["tracked"]
    assert one == listed and len(one["caches"]) == len(one["pools"]) == 1
    with pytest.raises(TypeError, match="caches: expected a list of objects with memory_bytes"):
        memory_report("cpu", caches={"kv": cache})



# --- The CUDA path on a CPU machine: torch.cuda.memory_stats / mem_get_info monkeypatched ---------------------------

GIB = 1 << 30
STATS = {  # a distinct number for every key, so a field reading the wrong (or a misspelt) key is seen
    "allocated_bytes.all.current": 3 * GIB + 1,
    "reserved_bytes.all.current": 5 * GIB + 2,
    "allocated_bytes.all.peak": 4 * GIB + 3,
    "reserved_bytes.all.peak": 6 * GIB + 4,
    "inactive_split_bytes.all.current": 123,
    "active_bytes.all.current": 3 * GIB + 7,
    "allocated_bytes.small_pool.current": 11,
}


def _fake_cuda(monkeypatch, stats, free=70 * GIB, total=80 * GIB):
    from tpool.memory import report as R

    monkeypatch.setattr(R._checks, "resolve_device", lambda d, name="device": torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "memory_stats", stats if callable(stats) else lambda d=None: stats)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (free, total))


def test_each_allocator_field_reads_its_memory_stats_key(monkeypatch):
    _fake_cuda(monkeypatch, STATS)
    r = memory_report("cuda:0")
    a, d = r.allocator, r.driver
    assert a.allocated_bytes == STATS["allocated_bytes.all.current"]
    assert a.reserved_bytes == STATS["reserved_bytes.all.current"]
    assert a.peak_allocated_bytes == STATS["allocated_bytes.all.peak"]
    assert a.peak_reserved_bytes == STATS["reserved_bytes.all.peak"]
    assert a.inactive_split_bytes == STATS["inactive_split_bytes.all.current"]
    assert a.unavailable is None and d.unavailable is None
    assert (d.total_bytes, d.free_bytes, d.used_bytes) == (80 * GIB, 70 * GIB, 10 * GIB)
    assert d.non_pytorch_bytes == 10 * GIB - STATS["reserved_bytes.all.current"]


def test_allocator_not_initialised_is_zero(monkeypatch):
    """memory_stats() is {} before the caching allocator first allocates on the device: it holds nothing."""
    _fake_cuda(monkeypatch, {})
    r = memory_report("cuda:0")
    assert (r.allocator.allocated_bytes, r.allocator.reserved_bytes, r.allocator.peak_reserved_bytes) == (0, 0, 0)
    assert r.allocator.unavailable is None and r.driver.non_pytorch_bytes == 10 * GIB


def test_a_missing_stats_key_is_none_not_zero(monkeypatch):
    stats = {k: v for k, v in STATS.items() if k != "reserved_bytes.all.peak"}
    _fake_cuda(monkeypatch, stats)
    a = memory_report("cuda:0").allocator
    assert a.peak_reserved_bytes is None and "reserved_bytes.all.peak" in a.unavailable
    assert a.allocated_bytes == STATS["allocated_bytes.all.current"] and a.reserved_bytes == 5 * GIB + 2
    stats = {k: v for k, v in STATS.items() if k != "reserved_bytes.all.current"}
    _fake_cuda(monkeypatch, stats)
    r = memory_report("cuda:0")
    assert r.allocator.reserved_bytes is None and r.driver.non_pytorch_bytes is None
    assert r.driver.used_bytes == 10 * GIB and "reserved_bytes" in r.driver.unavailable


def _pluggable(device=None):
    raise RuntimeError("CUDAPluggableAllocator does not yet support getDeviceStats. If you need it, please file "
                       "an issue describing your use case.")


def test_a_pluggable_allocator_still_reports_the_driver(monkeypatch, capsys):
    """With RMM & co. memory_stats raises: the report failed and the CLI exited 2 without the driver ledger."""
    _fake_cuda(monkeypatch, _pluggable)
    r = memory_report("cuda:0")
    a, d = r.allocator, r.driver
    assert {a.allocated_bytes, a.reserved_bytes, a.peak_allocated_bytes, a.peak_reserved_bytes,
            a.inactive_split_bytes} == {None} and "getDeviceStats" in a.unavailable
    assert (d.total_bytes, d.free_bytes, d.used_bytes, d.non_pytorch_bytes) == (80 * GIB, 70 * GIB, 10 * GIB, None)
    assert main(["report"]) == 0
    out = capsys.readouterr().out
    assert "getDeviceStats" in out and any(line.startswith("driver") and "81920.00" in line
                                           for line in out.splitlines())


def test_cli_says_the_allocator_numbers_are_its_own_process(monkeypatch, capsys):
    """From the CLI, non_pytorch_bytes holds the engine's whole PyTorch memory: the output says so."""
    _fake_cuda(monkeypatch, {}, free=19 * GIB)
    assert main(["report"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("note: ") and "this process" in last and "memory_report() in the engine's process" in last
    assert main(["report", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "this process" in out["note"] and out["driver"]["non_pytorch_bytes"] == 61 * GIB
    assert not any(line.startswith("note:") for line in format_report(memory_report("cuda:0")).splitlines())


def test_report_lists_a_page_table_an_arena_and_an_owned_caches_arena():
    import tpool
    from tpool.memory.arena import Arena

    arena = Arena(1 << 20, "cpu")
    cache = OwnedCache(1 << 20, arena=arena)
    cache.put("x", torch.zeros(1024, dtype=torch.uint8))
    pool = tpool.PagePool(1 << 16, page_size=16, device="cpu", backend="reference")
    table = tpool.PageTable(pool, 1024, 2048)
    report = memory_report("cpu", pools=[pool, table, arena], caches=[cache, OwnedCache(1 << 20)])
    alive = arena.buffer.untyped_storage().nbytes()
    assert report.tracked.caches["OwnedCache[0]"] == {"entries": 1, "payload_bytes": 1024, "storage_bytes": 1024,
                                                      "budget_bytes": 1 << 20, "peak_bytes": 1024, "arena_bytes": alive}
    assert "arena_bytes" not in report.tracked.caches["OwnedCache[1]"]  # no arena: the keys as before
    assert report.tracked.pools["PageTable[1]"] == table.memory_bytes()
    assert report.tracked.pools["PageTable[1]"]["block_table_bytes"] == 1024 * 2048 * 4
    assert report.tracked.pools["Arena[2]"] == {"storage_bytes": alive, "capacity_bytes": 1 << 20,
                                                "allocated_bytes": 1024, "free_bytes": (1 << 20) - 1024, "blocks": 1}
    text = format_report(report)
    assert "pool PageTable[1]: total_bytes" in text and "pool Arena[2]: allocated_bytes" in text
    assert "cache OwnedCache[0]: arena_bytes" in text
    json.dumps(report.to_dict())


class _Numbers:
    """A pool whose ``memory_bytes()`` returns ``numbers`` itself."""

    def __init__(self, numbers, name="p"):
        self.numbers, self.name = numbers, name

    def memory_bytes(self):
        return self.numbers


def test_numpy_numbers_from_memory_bytes_are_read_as_python_numbers():
    """A pool summing its arrays with numpy returns numpy.int64: a TypeError, where it is an int."""
    report = memory_report("cpu", pools=[_Numbers({"state_bytes": np.int64(4096), "share": np.float32(0.5)})])
    numbers = report.tracked.pools["p"]
    assert numbers == {"state_bytes": 4096, "share": 0.5}
    assert type(numbers["state_bytes"]) is int and type(numbers["share"]) is float
    json.dumps(report.to_dict())
    with pytest.raises(TypeError, match="not nan or inf"):
        memory_report("cpu", pools=[_Numbers({"x_bytes": np.float64("nan")})])


def test_the_report_keeps_a_copy_of_what_memory_bytes_returned():
    pool = _Numbers({"state_bytes": 4096})
    report = memory_report("cpu", pools=[pool])
    pool.numbers["state_bytes"] = 1
    assert report.tracked.pools == {"p": {"state_bytes": 4096}}


def _rusage_with_maxrss(monkeypatch, maxrss):
    import resource

    real = resource.getrusage

    class Usage:
        def __init__(self, r):
            self.r = r

        def __getattr__(self, name):
            return maxrss if name == "ru_maxrss" else getattr(self.r, name)

    monkeypatch.setattr(resource, "getrusage", lambda who: Usage(real(who)))
    monkeypatch.setattr(report_module, "_PEAK_SEEN", [0])  # (what earlier reports in this process read)


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss is in KiB on Linux")
def test_the_peak_rss_reads_ru_maxrss_in_kib(monkeypatch):
    _rusage_with_maxrss(monkeypatch, 64 << 20)  # 64 GiB in KiB, above any RSS of this process
    assert memory_report("cpu").process.peak_rss_bytes == 64 << 30


def test_the_peak_rss_is_never_below_the_current_rss(monkeypatch):
    """``ru_maxrss`` can lag the current RSS: the peak is then the current RSS."""
    _rusage_with_maxrss(monkeypatch, 1)
    p = memory_report("cpu").process
    assert p.rss_bytes > 1 << 20 and p.peak_rss_bytes == p.rss_bytes


def test_the_peak_rss_never_goes_down_between_reports(monkeypatch):
    """With ``ru_maxrss`` lagging, the peak is the highest RSS a report has read: a later report, after
    the RSS fell, still says the earlier, higher one (it said the current RSS, lower than it had said)."""
    _rusage_with_maxrss(monkeypatch, 1)
    seen = iter([100 << 20, 50 << 20])
    monkeypatch.setattr(report_module, "_rss", lambda: next(seen))
    first, second = memory_report("cpu").process, memory_report("cpu").process
    assert (first.rss_bytes, first.peak_rss_bytes) == (100 << 20, 100 << 20)
    assert (second.rss_bytes, second.peak_rss_bytes) == (50 << 20, 100 << 20)


def test_format_report_shows_mib_only_for_byte_quantities_and_a_bool_as_text():
    lines = format_report(memory_report("cpu", pools=[_Numbers({"blocks": 3 << 20, "pinned": True})])).splitlines()
    blocks = next(line for line in lines if "pool p: blocks" in line)
    assert blocks.rstrip().endswith("3,145,728") and "3.00" not in blocks  # a count: no MiB column
    pinned = next(line for line in lines if "pool p: pinned" in line)
    assert pinned.rstrip().endswith("True") and " 1 " not in pinned


def test_an_empty_name_is_replaced_by_the_type_and_index():
    report = memory_report("cpu", pools=[_Numbers({"a_bytes": 1}, name=""), _Numbers({"b_bytes": 2}, name=None)])
    assert report.tracked.pools == {"_Numbers[0]": {"a_bytes": 1}, "_Numbers[1]": {"b_bytes": 2}}


def test_format_report_refuses_what_is_not_a_report():
    # a report's to_dict() (or its JSON, read back) raised AttributeError: 'dict' object has no attribute 'device'
    report = memory_report("cpu")
    for bad in (report.to_dict(), None, "cpu"):
        with pytest.raises(ValueError, match=r"report: expected a MemoryReport \(what memory_report\(\) returns\), "
                                             f"got a {type(bad).__name__}"):
            format_report(bad)
    with pytest.raises(ValueError, match="note: expected a str or None, got a int"):
        format_report(report, 3)
    assert format_report(report, "n").endswith("note: n")
