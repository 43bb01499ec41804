"""pytest-benchmark suite: the end-to-end decode loop (bench_e2e.py's workload) at B=4, short.

    pytest benchmarks/test_bench_e2e.py --benchmark-only
    pytest benchmarks/test_bench_e2e.py --benchmark-disable       # each workload once (smoke)

A round is one run of ``bench_e2e.py``'s loop with ``--samples 1 --inner 8``: the
pool, table and paged KV cache made, the prompts prefilled, then 2 x 8 decode
steps (``table.step``, the step metadata, the forward, greedy sampling), the
requests rolled back to their prompts after each 8. The baseline in the same
group is transformers' eager attention with ``DynamicCache`` on the same model
and prompts (``run_baseline``, the same number of steps). The per-step split
(tpool calls against the forward) of the last round is in ``extra_info``;
``python benchmarks/bench_e2e.py`` prints it as a table with ratios.
"""

import argparse
import statistics

import pytest
import torch

pytest.importorskip("transformers")

from bench_e2e import build_model, run_baseline, run_tpool  # noqa: E402

B, PROMPT, ROUNDS = 4, 64, 5
ARGS = argparse.Namespace(batch=[B], prompt=PROMPT, page_size=16, hidden=256, layers=4, heads=8, kv_heads=2,
                          vocab=1024, samples=1, inner=8, backend="numba", threads=1)


@pytest.fixture(scope="module")
def model_and_prompts():
    torch.set_num_threads(ARGS.threads)
    model = build_model(ARGS.hidden, ARGS.layers, ARGS.heads, ARGS.kv_heads, ARGS.vocab)
    prompts = torch.randint(1, ARGS.vocab, (B, PROMPT), generator=torch.Generator().manual_seed(B))
    return model, prompts


@pytest.mark.parametrize("impl", ["tpool", "eager + DynamicCache"])
def test_e2e_loop(benchmark, model_and_prompts, impl):
    model, prompts = model_and_prompts
    benchmark.group = f"end-to-end decode loop, B={B}, prompt {PROMPT}, 2 x {ARGS.inner} steps a round"
    benchmark.extra_info.update(batch=B, impl=impl, steps_per_round=2 * ARGS.inner)
    if impl == "tpool":
        samples = benchmark.pedantic(run_tpool, args=(model, prompts, ARGS), rounds=ROUNDS, iterations=1,
                                     warmup_rounds=1)
        step, tp, fw, st, meta = (statistics.median(s[k] for s in samples) * 1e6 for k in range(5))
        benchmark.extra_info.update(step_us=step, tpool_us=tp, forward_us=fw, table_step_us=st, metadata_us=meta)
        assert samples and all(s[0] > 0 for s in samples)
    else:
        samples = benchmark.pedantic(run_baseline, args=(prompts, model, ARGS), rounds=ROUNDS, iterations=1,
                                     warmup_rounds=1)
        benchmark.extra_info.update(step_us=statistics.median(samples) * 1e6)
