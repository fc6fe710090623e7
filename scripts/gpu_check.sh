#!/usr/bin/env bash
# The prepared GPU check for a GPU machine: ONE call of at most 540 s (a call may last 600 s; the rest is the
# machine's start and the transfers). Parts, each under its own `timeout` (the sum of the `timeout` values below is
# at most 540 s, and tests/test_gpu_check.py checks that):
#   1. the machine (nvidia-smi, versions);
#   2. the reference tests on CUDA (bf16 weights, pinned buffers, the side copy stream, events). A comparison that
#      crosses devices (the host's AdamW against CUDA's fused AdamW) uses a tolerance there (tests/conftest.py,
#      `assert_same_across_devices`); CUDA against CUDA (overlap = sequential, resume = uninterrupted) stays bitwise;
#   3. scripts/cuda_checks.py: host syncs per ordinary step under torch.cuda.set_sync_debug_mode("warn"), and fp16
#      autocast with torch.amp.GradScaler("cuda") through the public `scaler.step(opt)`;
#   4. the DDP and FSDP2 tests on NCCL, one rank per GPU (one GPU: the tests that need 2 ranks skip themselves);
#   5. the GPU benchmark (scripts/bench_gpu.py), sized to fit its part.
# No `pytest -x`: `--maxfail` is large, so one failure never hides the later results. Everything goes to ${OUT}
# (default gpu_out): logs, cuda_checks.json, bench_gpu.json and bench_gpu.md.
#
#   bash scripts/gpu_check.sh            # uses the machine's python3 (its torch/transformers; no installs)
#
# On a machine without a CUDA device it says so and exits 0 at once.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"

if ! timeout 30 "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)" 2>/dev/null; then
    echo "gpu_check: no CUDA device on this machine (torch.cuda.is_available() is False): nothing to check." \
        | tee "$out/gpu_check.txt"
    exit 0
fi
export HF_ZENFLOW_TEST_DEVICE=cuda
pytest_args=(-q -p no:cacheprovider --maxfail=1000 -o faulthandler_timeout=120)

# 1. the machine
timeout 10 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$out/gpu.txt"
timeout 10 "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', \
torch.cuda.device_count())" 2>&1 | tee -a "$out/gpu.txt"

# 2. the reference tests on CUDA
timeout 150 "$py" -m pytest "${pytest_args[@]}" tests/optimizer/test_optimizer.py tests/optimizer/test_baselines.py \
  tests/checkpoint/test_checkpoint.py tests/engine/test_gradients.py tests/engine/test_layout.py 2>&1 | tee "$out/tests_cuda.log"
tests_rc=${PIPESTATUS[0]}

# 3. host syncs per step, fp16 + GradScaler
timeout 50 "$py" scripts/cuda_checks.py --out-dir "$out" 2>&1 | tee "$out/cuda_checks.log"
checks_rc=${PIPESTATUS[0]}

# 4. DDP (through torchrun and the Trainer) and FSDP2 on NCCL, one rank per GPU of this machine (one GPU: world
# size 1 through the same code; tests/gloo_ranks.py: RANKS). (tests/distributed/test_nccl_double.py is CI's CPU stand-in.)
timeout 70 "$py" -m pytest "${pytest_args[@]}" tests/hf/test_trainer_ddp.py -k "trains_and_ranks_agree or \
  one_optimizer_file or resume_mid_window or refused_in_one_process or plugin_under_ddp" 2>&1 \
  | tee "$out/tests_ddp_nccl.log"
ddp_rc=${PIPESTATUS[0]}
timeout 90 "$py" -m pytest "${pytest_args[@]}" tests/distributed/test_fsdp.py 2>&1 | tee "$out/tests_fsdp_nccl.log"
fsdp_rc=${PIPESTATUS[0]}

# 5. the benchmark: a ~0.5B-parameter Llama, few steps per optimizer, so that every row fits
timeout 130 "$py" scripts/bench_gpu.py --out-dir "$out" --layers 8 --steps 6 --warmup 3 "$@" 2>&1 \
  | tee "$out/bench_gpu.log"
bench_rc=${PIPESTATUS[0]}

echo "cuda tests rc=$tests_rc cuda checks rc=$checks_rc ddp (nccl) rc=$ddp_rc fsdp2 (nccl) rc=$fsdp_rc" \
  "bench rc=$bench_rc (124: the part ran out of time)" | tee "$out/gpu_check.txt"
exit $(( tests_rc || checks_rc || ddp_rc || fsdp_rc || bench_rc ))
