"""What the benchmark tests share: loading a script by name, the tiny options each runs with, a fake clock,
the rows of a script's JSON."""

import importlib.util
import json
import os
import types

BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks")


def load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY = {
    "bench_pool": ["--sizes", "1", "4", "--num-pages", "64", "--samples", "3", "--inner", "2",
                   "--backends", "numba"],
    "bench_page_table": ["--batch", "1", "3", "--samples", "3", "--inner", "2", "--backends", "numba"],
    "bench_evict": ["--pool-sizes", "512", "--k", "1", "8", "--samples", "3", "--backends", "numba"],
    "bench_lru": ["--pool-sizes", "512", "--steps", "120", "--touch", "32", "--k", "4"],
    "bench_revive": ["--k", "1", "8", "--samples", "3", "--backends", "numba", "reference"],
    "bench_prefix": ["--requests", "10", "--repeats", "2", "--system-len", "8", "--prompt-len", "2", "6", "--max-new",
                     "2", "6", "--num-pages", "12", "--page-size", "4", "--max-batch", "4", "--hidden", "32",
                     "--layers", "1", "--heads", "4", "--kv-heads", "2", "--vocab", "64"],
    "bench_logits": ["--tokens", "32", "--lanes", "3", "--keep", "8", "--vocab", "64", "--hidden", "32", "--layers",
                     "1", "--heads", "4", "--kv-heads", "2", "--samples", "2"],
}


class FakeClock:
    """``time.perf_counter_ns`` (and ``perf_counter``) for a benchmark module: a clock that only the stand-ins
    advance. :meth:`fn` is a timed function costing ``costs_us(i)`` µs at its i-th call; :meth:`spend` any
    stand-in's cost; with ``log_reads`` each read of the clock is logged too ("clock")."""

    def __init__(self, module, monkeypatch, costs_us=None, log_reads=False):
        self.now, self.calls, self.log, self.costs, self.log_reads = 0, 0, [], costs_us, log_reads
        monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter_ns=self.read,
                                                                  perf_counter=lambda: self.now / 1e9))

    def read(self):
        if self.log_reads:
            self.log.append("clock")
        return self.now

    def spend(self, us, what):
        self.now += int(us * 1000)
        self.log.append(what)

    def fn(self):
        self.spend(self.costs(self.calls), "fn")
        self.calls += 1

    def sync(self):
        self.log.append("sync")

    def reset(self):
        self.log.append("reset")

    def flush(self):
        self.log.append("flush")


def json_rows(path):
    """The rows a script wrote with ``--json``."""
    with open(path) as f:
        return json.load(f)["rows"]
