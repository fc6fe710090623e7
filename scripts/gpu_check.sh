#!/usr/bin/env bash
# The prepared GPU check: ONE run of at most 540 s. Parts, each under its own `timeout` (the sum of the `timeout`
# values below is at most 540 s, and tests/test_gpu_check.py checks that):
#   1. scripts/cuda_checks.py. Device-independent: fp16 autocast with torch.amp.GradScaler, for accumulate_on="host"
#      and "device" (the two public recipes agree bit for bit, the clip norm after unscale_ is torch's, every column
#      selected equals torch's AdamW, an overflowed step changes nothing but its counter). CUDA only: per step, for
#      both accumulation places, the training thread's synchronising CUDA calls (torch.cuda.set_sync_debug_mode)
#      and the torch.cuda.Event.synchronize calls of every thread, counted by the script (the debug mode does not
#      see them); every host buffer that crosses the link page-locked; two NCCL ranks on one GPU (NCCL refuses two
#      ranks of one group on one device: then it says so). On a machine without a CUDA device the device-independent
#      checks run on the CPU, and that is all the script does there;
#   2. the machine (nvidia-smi, versions);
#   3. the reference tests on CUDA (bf16 weights, pinned buffers, the side copy stream, events), the fp16 GradScaler
#      tests among them. A comparison that crosses devices (the host's AdamW against CUDA's AdamW) uses a tolerance
#      there (tests/conftest.py, `assert_same_across_devices`); CUDA against CUDA (overlap = sequential, resume =
#      uninterrupted) stays bitwise;
#   4. the DDP and FSDP2 tests on NCCL, one rank per GPU (one GPU: the tests that need 2 ranks skip themselves);
#   5. the GPU benchmark (scripts/bench_gpu.py), sized to fit its part.
# No `pytest -x`: `--maxfail` is large, so one failure never hides the later results. Everything goes to ${OUT}
# (default gpu_out): logs, cuda_checks.json, bench_gpu.json and bench_gpu.md.
#
#   bash scripts/gpu_check.sh            # uses the machine's python3 (its torch/transformers; no installs)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"

if timeout 20 "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)" 2>/dev/null; then
    device=cuda
else
    device=cpu
fi

# 1. the checks of scripts/cuda_checks.py (without a CUDA device: the device-independent ones, on the CPU)
timeout 100 "$py" scripts/cuda_checks.py --device "$device" --out-dir "$out" 2>&1 | tee "$out/cuda_checks.log"
checks_rc=${PIPESTATUS[0]}
if [ "$device" = cpu ]; then
    echo "gpu_check: no CUDA device on this machine (torch.cuda.is_available() is False): ran only the" \
        "device-independent checks, on the CPU: rc=$checks_rc (124: out of time)" | tee "$out/gpu_check.txt"
    exit "$checks_rc"
fi
export HF_ZENFLOW_TEST_DEVICE=cuda
pytest_args=(-q -p no:cacheprovider --maxfail=1000 -o faulthandler_timeout=120)

# 2. the machine
timeout 10 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$out/gpu.txt"
timeout 10 "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', \
torch.cuda.device_count())" 2>&1 | tee -a "$out/gpu.txt"

# 3. the reference tests on CUDA
timeout 150 "$py" -m pytest "${pytest_args[@]}" tests/optimizer/test_optimizer.py tests/optimizer/test_baselines.py \
  tests/checkpoint/test_checkpoint.py tests/engine/test_gradients.py tests/engine/test_layout.py \
  tests/engine/test_amp.py 2>&1 | tee "$out/tests_cuda.log"
tests_rc=${PIPESTATUS[0]}

# 4. DDP (through torchrun and the Trainer) and FSDP2 on NCCL, one rank per GPU of this machine (one GPU: world
# size 1 through the same code; tests/gloo_ranks.py: RANKS). (tests/distributed/test_nccl_double.py is CI's CPU stand-in.)
timeout 70 "$py" -m pytest "${pytest_args[@]}" tests/hf/test_trainer_ddp.py -k "trains_and_ranks_agree or \
  one_optimizer_file or resume_mid_window or refused_in_one_process or plugin_under_ddp" 2>&1 \
  | tee "$out/tests_ddp_nccl.log"
ddp_rc=${PIPESTATUS[0]}
timeout 70 "$py" -m pytest "${pytest_args[@]}" tests/distributed/test_fsdp.py 2>&1 | tee "$out/tests_fsdp_nccl.log"
fsdp_rc=${PIPESTATUS[0]}

# 5. the benchmark: a ~0.4B-parameter Llama, few steps per optimizer, so that every row fits
timeout 100 "$py" scripts/bench_gpu.py --out-dir "$out" --layers 6 --steps 6 --warmup 3 "$@" 2>&1 \
  | tee "$out/bench_gpu.log"
bench_rc=${PIPESTATUS[0]}

echo "cuda tests rc=$tests_rc cuda checks rc=$checks_rc ddp (nccl) rc=$ddp_rc fsdp2 (nccl) rc=$fsdp_rc" \
  "bench rc=$bench_rc (124: the part ran out of time)" | tee "$out/gpu_check.txt"
exit $(( tests_rc || checks_rc || ddp_rc || fsdp_rc || bench_rc ))
