#!/usr/bin/env bash
# All GPU checks in one run, for a machine with CUDA (run from the repository root):
# the GPU-only tests, the compiled Triton differential tests, and the three
# benchmarks on CUDA. Results go to ${OUT:-gpu_results}/ as logs and JSON.
# Install first: a CUDA build of torch, then `pip install -e ".[dev,hf,bench]" flashinfer-python` (without
# transformers or flashinfer some GPU tests skip, and the script then reports failure; bench: the plots).
set -uo pipefail
out=${OUT:-gpu_results}
mkdir -p "$out"
unset TRITON_INTERPRET
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
python -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" \
    | tee "$out/versions.txt"
status=0
python -m pytest -q -rs -m gpu tests/ 2>&1 | tee "$out/gpu_tests.txt" || status=1
if grep -q "skipped" "$out/gpu_tests.txt"; then  # every GPU test must run here (-rs says why one did not)
    echo "gpu_checks: some GPU tests were skipped" | tee -a "$out/gpu_tests.txt"; status=1
fi
python -m pytest -q tests/test_triton_kernels.py tests/test_triton_table.py 2>&1 \
    | tee "$out/triton_compiled_tests.txt" || status=1
python benchmarks/bench_pool.py --device cuda --json "$out/pool.json" 2>&1 | tee "$out/pool.txt"
python benchmarks/bench_page_table.py --device cuda --json "$out/page_table.json" 2>&1 | tee "$out/page_table.txt"
python benchmarks/bench_evict.py --device cuda --samples 10 --json "$out/evict.json" 2>&1 | tee "$out/evict.txt"
python benchmarks/bench_scheduler.py --device cuda --json "$out/scheduler.json" --plot "$out/scheduler.png" 2>&1 \
    | tee "$out/scheduler.txt"
exit $status
