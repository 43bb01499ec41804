#!/usr/bin/env bash
# All GPU checks in one run, for a machine with CUDA (run from the repository root):
# the GPU-only tests, the compiled Triton differential tests, four benchmarks and the step profile on CUDA
# (a failing step, a skipped GPU test or a benchmark that exits non-zero makes the script exit 1).
# Results go to ${OUT:-gpu_results}/ as eight text files (env, gpu_tests, triton_compiled,
# pool, page_table, step_phases, evict, scheduler); GPU_CHECKS_JSON=1 also writes each benchmark's JSON.
#
# Installed (a CUDA build of torch, then `pip install -e ".[dev,hf,bench]" flashinfer-python`) or
# not: on a machine that cannot install (no network, torch, triton, numba, pytest and
# transformers already there), the checks run from a copy of the checkout with kernels/ placed
# as tpool/kernels, the layout the wheel has, and the checkout is left as it is.
# Each step runs under `timeout ${GPU_CHECK_STEP_S:-600}` seconds. Without transformers or
# flashinfer some GPU tests skip, and the script then reports failure.
set -uo pipefail
out=$(mkdir -p "${OUT:-gpu_results}" && cd "${OUT:-gpu_results}" && pwd)
step_s=${GPU_CHECK_STEP_S:-600}
py=${PYTHON:-$(command -v python || command -v python3)}
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1

if ! "$py" -c "import tpool.kernels" > /dev/null 2>&1; then
    run=$(mktemp -d)
    tar --exclude=./.git --exclude=./.venv --exclude=./build --exclude="./${OUT:-gpu_results}" -cf - . \
        | tar -xf - -C "$run" && cp -r kernels "$run"/tpool/kernels
    cd "$run" && export PYTHONPATH="$run${PYTHONPATH:+:$PYTHONPATH}"
    echo "gpu_checks: tpool is not installed; running from a copy at $run"
fi

json() {  # --json PATH when GPU_CHECKS_JSON=1
    [ "${GPU_CHECKS_JSON:-0}" = 1 ] && echo "--json $out/$1.json"
}

{ nvidia-smi; "$py" -c "import sys, torch, triton; print(sys.version); print('torch', torch.__version__, \
'triton', triton.__version__, torch.cuda.get_device_name())"; } > "$out/env.txt" 2>&1
status=0
timeout "$step_s" "$py" -m pytest -q -rs -m gpu -p no:cacheprovider tests/ 2>&1 | tee "$out/gpu_tests.txt" \
    || status=1
if grep -q "skipped" "$out/gpu_tests.txt"; then  # every GPU test must run here (-rs says why one did not)
    echo "gpu_checks: some GPU tests were skipped" | tee -a "$out/gpu_tests.txt"; status=1
fi
timeout "$step_s" "$py" -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_triton_table.py \
    2>&1 | tee "$out/triton_compiled.txt" || status=1
# shellcheck disable=SC2046  # (json's words are meant to split)
timeout "$step_s" "$py" benchmarks/bench_pool.py --device cuda $(json pool) 2>&1 | tee "$out/pool.txt" \
    || status=1
# shellcheck disable=SC2046
timeout "$step_s" "$py" benchmarks/bench_page_table.py --device cuda $(json page_table) 2>&1 | tee "$out/page_table.txt" \
    || status=1
# shellcheck disable=SC2046
timeout "$step_s" "$py" benchmarks/gpu_step_phases.py $(json step_phases) 2>&1 | tee "$out/step_phases.txt" \
    || status=1
# shellcheck disable=SC2046
timeout "$step_s" "$py" benchmarks/bench_evict.py --device cuda --samples 10 $(json evict) 2>&1 | tee "$out/evict.txt" \
    || status=1
# shellcheck disable=SC2046
timeout "$step_s" "$py" benchmarks/bench_scheduler.py --device cuda $(json scheduler) 2>&1 | tee "$out/scheduler.txt" \
    || status=1
exit $status
