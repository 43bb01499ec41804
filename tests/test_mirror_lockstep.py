"""The mirror in lockstep with the device and a Python model (``tests/mirror_lockstep.py``): random
schedules of every call a scheduler makes, checked after each one; and a mixed step against the same
work done as a decode and an admission.

``python tests/mirror_lockstep.py --seeds 0-80`` runs many more seeds than these.
"""

import random

import numpy as np
import pytest
import torch

from mirror_lockstep import Driver
from tpool.scheduling import WouldNotFit

MODES = ("plain", "shared", "cache")


@pytest.mark.parametrize("mode", MODES)
def test_random_schedules_agree_with_the_device_and_the_model(backend, mode):
    seeds, steps = {"triton": (2, 50), "reference": (6, 150)}.get(backend, (20, 200))
    total = {}
    for seed in range(seeds):
        d = Driver(backend, seed, mode)
        d.run(steps)    # (raises at the first disagreement, naming it)
        for k, v in d.hits.items():
            total[k] = total.get(k, 0) + v
    if backend != "triton":   # the calls the schedules are meant to make were made
        made = {"decode", "decode out", "step rows=True admits=True", "truncate", "reconcile"}
        if mode != "plain":
            made |= {"fork", "rollback", "revive", "evicted", "preempted"}
        if mode == "cache":   # (prompts matched against the index model, hits found)
            made |= {"matched"}
        assert made <= set(total), f"{sorted(made - set(total))} never made: {total}"


def _state(d):
    m, st = d.m, d.pool.state
    counters = torch.cat([st.counters[:2], st.counters[3:]])   # (the clock counts calls: one step, two calls)
    return [d.table.seq_lens, d.table.block_table, st.refcount, st.page_state, counters, m.free, m.cached,
            m.reserved, m._st, m.live, list(m._free_rows), m.exact, m.cached_exact]


def _equal(a, b):
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else np.array_equal(x, y) if isinstance(x, np.ndarray)
               else x == y for x, y in zip(a, b))


def test_a_mixed_step_does_what_a_decode_then_an_admission_do(backend):
    """Whenever ``decode(rows, n)`` then ``admit(prompts)`` both run, ``step(rows, n, prompts)`` from the same
    state runs too and leaves the same device state, books and rows, with the same slots (decode lanes, then
    prompts), after random histories of every mode."""
    seeds = {"triton": 3, "reference": 30}.get(backend, 90)
    compared = 0
    for seed in range(seeds):
        mode = MODES[seed % 3]
        a, b = Driver(backend, seed, mode), Driver(backend, seed, mode)
        h = random.Random(seed).randint(0, 40 if backend != "triton" else 10)
        a.run(h)
        b.run(h)
        rng, m = random.Random(seed * 7 + 1), a.m
        rows = [r for r in a.running() if m.hi[r] < m.limit[r]]
        rows = rng.sample(rows, rng.randint(0, len(rows)))
        n = [rng.randint(0, int(min(5, m.limit[r] - m.hi[r]))) for r in rows]
        if rows and rng.random() < 0.3:
            n = rng.randint(0, int(min(4, *(m.limit[r] - m.hi[r] for r in rows))))
        prompts = [min(rng.randint(0, 3 * a.ps + 2), m.capacity) for _ in range(rng.randint(0, 3))]
        max_lens = [min(p + rng.randint(0, 6), m.capacity) for p in prompts]
        if m.unreserved < 0 or len(rows) + len(prompts) > m.max_batch:
            continue
        try:
            res = b.m.decode(rows, n) if rows else None
            slots = [] if res is None else res.slots.tolist()[:sum(n) if isinstance(n, list) else n * len(rows)]
            got = b.m.admit(prompts, max_lens) if prompts else []
            slots += b.m.last_admit.slots.tolist()[:sum(prompts)] if prompts else []
        except WouldNotFit:
            continue
        s = a.m.step(rows, n, prompts, max_lens, width=m.max_batch if rng.random() < 0.5 else None)
        assert s.rows == got
        assert s.result.slots.tolist() == slots + [-1] * (s.result.slots.numel() - len(slots))
        assert _equal(_state(a), _state(b)), f"seed {seed}: rows {rows} n {n} prompts {prompts}"
        compared += 1
    assert compared >= seeds // 4
