#!/usr/bin/env bash
# The prepared GPU check, for a lent GPU machine (one call): the reference tests on CUDA (bf16 weights, pinned
# buffers, the side copy stream, events), then the GPU benchmark. Writes logs under ${OUT:-gpu_out}.
#
#   bash scripts/gpu_check.sh            # uses the machine's python3 (its torch/transformers; no installs)
#
# Budget: about 2 minutes of tests + the benchmark's own limit (see scripts/bench_gpu.py --help).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_ZENFLOW_TEST_DEVICE=cuda
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$out/gpu.txt"
timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_optimizer.py tests/test_baselines.py \
  tests/test_checkpoint.py tests/test_gradients.py tests/cpu_device/test_layout.py 2>&1 \
  | tee "$out/tests_cuda.log"
tests_rc=${PIPESTATUS[0]}
timeout 420 python3 scripts/bench_gpu.py --out "$out" "$@" 2>&1 | tee "$out/bench_gpu.log"
bench_rc=${PIPESTATUS[0]}
echo "cuda tests rc=$tests_rc bench rc=$bench_rc"
exit $(( tests_rc || bench_rc ))
