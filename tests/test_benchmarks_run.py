"""The benchmark scripts run and print their tables (tiny sizes; timings are not checked)."""

import importlib.util
import json
import os

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks")


def load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name, argv, header", [
    ("bench_pool", ["--sizes", "1", "4", "--num-pages", "64", "--samples", "3", "--inner", "2",
                    "--backends", "numba"], "alloc + free of N pages"),
    ("bench_page_table", ["--batch", "1", "3", "--samples", "3", "--inner", "2", "--backends", "numba"],
     "decode step"),
    ("bench_evict", ["--pages", "512", "--k", "1", "8", "--samples", "3", "--backends", "numba"], "evict k"),
])
def test_benchmark_prints_its_table(name, argv, header, tmp_path, capsys):
    out = tmp_path / f"{name}.json"
    load(name).main(argv + ["--json", str(out)])
    text = capsys.readouterr().out
    assert header in text and "median" in text and "p20" in text
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["median_us"] > 0 for r in rows)
