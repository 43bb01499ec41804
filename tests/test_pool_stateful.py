"""Hypothesis stateful test: random operation sequences on every backend vs the pure-Python model.

Budget: reference and numba run 50 sequences of up to 50 steps each (the test
checks that at least 2,000 steps ran); Triton, interpreted on a CPU, 6
sequences of up to 20 steps.
"""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import tpool
from conftest import CPU_BACKENDS, i32
from pool_model import PoolModel
from tpool.testing import no_host_sync

BUDGET = {"reference": (50, 50), "numba": (50, 50), "triton": (6, 20)}
MIN_STEPS = {"reference": 2000, "numba": 2000, "triton": 50}

page_ids = st.lists(st.integers(-2, 40), max_size=6)


class PoolMachine(RuleBasedStateMachine):
    backend = "reference"
    steps = 0  # checked steps, summed over all sequences of one test

    @initialize(num_pages=st.integers(1, 33), max_pages=st.integers(1, 40))
    def build(self, num_pages, max_pages):
        max_pages = min(max_pages, num_pages)  # no call grants more than the pool: longer outputs are refused
        self.pool = tpool.PagePool(num_pages, device="cpu", backend=self.backend, max_alloc_pages=max_pages)
        self.model = PoolModel(num_pages)
        self.max_pages = max_pages
        self.live = []

    def _ids(self, extra, take):
        return self.live[:take] + extra

    @rule(counts=st.lists(st.integers(-1, 6), max_size=5), evict=st.booleans(), padded=st.booleans())
    def alloc(self, counts, evict, padded):
        out = self.pool.alloc_out(max_batch=len(counts) + 2, max_pages=self.max_pages) if padded else None
        with no_host_sync():
            r = self.pool.alloc(i32(counts), out=out, evict=evict)
        exp = self.model.alloc(counts, self.max_pages, len(counts) + 2 if padded else None, evict=evict)
        assert (r.pages.tolist(), r.indptr.tolist(), r.ok.tolist(), r.evicted.tolist()) == exp
        self.live += [p for p in r.pages.tolist() if p >= 0]

    @rule(extra=page_ids, take=st.integers(0, 4), cache=st.booleans())
    def free(self, extra, take, cache):
        ids = self._ids(extra, take)
        with no_host_sync():
            self.pool.free(i32(ids), cache=cache)
        self.model.free(ids, cache=cache)
        self.live = self.live[take:]

    @rule(extra=page_ids, take=st.integers(0, 3))
    def incref(self, extra, take):
        ids = self._ids(extra, take)
        with no_host_sync():
            self.pool.incref(i32(ids))
        self.model.incref(ids)
        self.live += [p for p in ids if 0 <= p < self.model.P and self.model.state[p] == 1]

    @rule(extra=page_ids)
    def touch(self, extra):
        with no_host_sync():
            self.pool.touch(i32(extra))
        self.model.touch(extra)

    @rule(k=st.integers(0, 8))
    def evict(self, k):
        with no_host_sync():
            out = self.pool.evict(k)
        assert out.tolist() == self.model.evict(k)[:self.pool.num_pages]  # at most num_pages entries

    @precondition(lambda self: len(self.live) >= 2)
    @rule(cache=st.booleans())
    def free_group(self, cache):
        a, b = self.live[0], self.live[1]
        with no_host_sync():
            with self.pool.free_group():
                self.pool.free(i32([a]), cache=cache)
                self.pool.free(i32([b]))
        # At exit the plain frees are applied as one pass, then the cached ones.
        if cache:
            self.model.free([b])
            self.model.free([a], cache=True)
        else:
            self.model.free([a, b])
        self.live = self.live[2:]

    @invariant()
    def matches_model(self):
        if hasattr(self, "pool"):
            type(self).steps += 1
            self.model.assert_matches(self.pool)
            self.pool.check_invariants()


def _machine(backend):
    examples, steps = BUDGET[backend]
    cls = type(f"PoolMachine_{backend}", (PoolMachine,), {"backend": backend})
    cls.TestCase.settings = settings(max_examples=examples, stateful_step_count=steps, deadline=None,
                                     suppress_health_check=list(HealthCheck))  # derandomized: conftest
    return cls


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_stateful_matches_model(backend):
    machine = _machine(backend)
    machine.TestCase("runTest").runTest()
    assert machine.steps >= MIN_STEPS[backend]
