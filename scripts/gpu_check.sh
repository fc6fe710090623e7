#!/usr/bin/env bash
# The prepared GPU check, for a lent GPU machine (one call): the reference tests on CUDA (bf16 weights, pinned
# buffers, the side copy stream, events), the DDP and FSDP2 tests on NCCL with one rank per GPU, then the GPU
# benchmark.
# Writes logs under ${OUT:-gpu_out}.
#
#   bash scripts/gpu_check.sh            # uses the machine's python3 (its torch/transformers; no installs)
#
# Budget: about 2 minutes of tests, about 1 each of DDP and FSDP2 tests, + the benchmark's own limit (see
# scripts/bench_gpu.py --help).
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
# DDP on NCCL through torchrun, one rank per GPU of this machine (one GPU: world size 1 through the same launch and
# Trainer code): ranks agree bitwise, per-rank optimizer files, mid-window resume bitwise, ZenFlowPlugin under DDP.
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/hf/test_trainer_ddp.py -k "trains_and_ranks_agree or \
  one_optimizer_file or resume_mid_window or refused_in_one_process or plugin_under_ddp" 2>&1 \
  | tee "$out/tests_ddp_nccl.log"
ddp_rc=${PIPESTATUS[0]}
# FSDP2 on NCCL (tests/test_fsdp.py), one rank per GPU (one GPU: a mesh of one rank against the plain model, through
# the same code): the ranks train like one process, resume exactly, bf16 mixed precision with every column on the
# device equals torch's fused AdamW.
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_fsdp.py 2>&1 | tee "$out/tests_fsdp_nccl.log"
fsdp_rc=${PIPESTATUS[0]}
timeout 420 python3 scripts/bench_gpu.py --out "$out" "$@" 2>&1 | tee "$out/bench_gpu.log"
bench_rc=${PIPESTATUS[0]}
echo "cuda tests rc=$tests_rc ddp (nccl) rc=$ddp_rc fsdp2 (nccl) rc=$fsdp_rc bench rc=$bench_rc"
exit $(( tests_rc || ddp_rc || fsdp_rc || bench_rc ))
