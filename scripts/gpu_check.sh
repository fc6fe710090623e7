#!/usr/bin/env bash
# The prepared GPU check: ONE call of at most 300 s on one GPU (the machine's start aside), so that a GPU available for
# fifteen minutes can run it twice. Every part runs under its own `timeout` (`part NAME LIMIT ...`; on a GPU the
# limits, the probe's included, sum to at most 300 s: tests/test_gpu_check.py checks that), and its result is written as
# soon as it ends: one JSON line per part in ${OUT}/gpu_check.jsonl (default gpu_out/), its output in
# ${OUT}/NAME.log, the checks' figures in ${OUT}/cuda_checks_*.json and ${OUT}/launches*.json.
#
# Parts (docs/gpu.md gives what each asserts and its time estimate):
#   machine        nvidia-smi, torch's and CUDA's versions, the GPUs                                         CUDA
#   launches       launches per step and a re-selection's host reads on the CPU double with CUDA's
#                  dispatch, Llama-7B's shapes divided by 4, held to scripts/count_device_calls.py's bounds   any
#   checks         fp16 with a GradScaler (both recipes, clipping, overflow); host syncs per ordinary step;
#                  every link buffer pinned and counted (scripts/cuda_checks.py)                             any/CUDA
#   launches_cuda  launches per step on the GPU itself, one Llama-7B layer (4096 x 11008 matrices), bounded    CUDA
#   races          4096 x 11008 matrices, copies and the compute stream slowed with torch.cuda._sleep: bit
#                  for bit the same run with every copy synchronous (on the CPU: the asynchronous double)     any
#   memory         the allocator's peak and reserved bytes against the optimizer's estimate, with a
#                  device_memory_limit_bytes, and the peak that freeing gradients in backward saves          CUDA
#   sanitizer      the race schedules under TORCH_CUDA_SANITIZER=1 (torch's CUDA stream sanitizer)           CUDA
#   tests_cuda     the reference tests on CUDA (freeing, bf16 device sums, narrow gather, device limit,
#                  bucket views, fp16, layouts, baselines)                                                   CUDA
#   ranks          two NCCL ranks, one per GPU                                                          2+ GPUs
# Without a CUDA device the parts marked "any" run (on the CPU, sized for it), the others are named as needing
# CUDA, and the exit status is theirs. No `pytest -x`: one failure never hides the later results.
#
#   bash scripts/gpu_check.sh            # the machine's python3 (or PYTHON=...), no installs; OUT=dir for results
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
results="$out/gpu_check.jsonl"
: > "$results"
failed=0
summary=()

# part NAME LIMIT COMMAND...: COMMAND under `timeout LIMIT`, its output to $out/NAME.log, one result line.
part() {
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    rc=$?
    printf '{"part": "%s", "rc": %d, "seconds": %d, "limit_s": %d}\n' "$name" "$rc" $((SECONDS - start)) "$limit" \
        >> "$results"
    echo "gpu_check: $name: $([ "$rc" = 0 ] && echo passed || echo "FAILED rc=$rc (124: out of time)")," \
        "$((SECONDS - start)) s of $limit (log: $out/$name.log)"
    [ "$rc" = 0 ] || failed=1
    summary+=("$name=$rc")
}

# not_run NAME WHY: a part this machine cannot run, said so and recorded.
not_run() {
    printf '{"part": "%s", "not_run": "%s"}\n' "$1" "$2" >> "$results"
    echo "gpu_check: $1: not run: $2"
    summary+=("$1=not-run")
}

gpus=$(timeout 10 "$py" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" \
    2>/dev/null || echo 0)
gpus=${gpus:-0}

# One GPU or more: every part, within 300 s with the probe (each limit about twice the part's estimate).
on_gpu() {
    part machine 10 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; \"$py\" -c \
'import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"gpus\", torch.cuda.device_count())'"
    part launches 20 "$py" scripts/count_device_calls.py --shape llama-7b --shrink 4 --dtype bfloat16 --steps 10 \
        --check --out "$out/launches.json"
    part checks 40 "$py" scripts/cuda_checks.py --checks fp16_grad_scaler,host_syncs,pinned_link_buffers \
        --out-dir "$out"
    part launches_cuda 20 "$py" scripts/count_device_calls.py --device cuda --shape llama-7b --layers 1 \
        --dtype bfloat16 --steps 10 --check --out "$out/launches_cuda.json"
    part races 45 "$py" scripts/cuda_checks.py --checks races --out-dir "$out"
    part memory 30 "$py" scripts/cuda_checks.py --checks device_memory --out-dir "$out"
    part sanitizer 30 "$py" scripts/cuda_checks.py --checks sanitized --out-dir "$out"
    # (the reference tests build their models on HF_ZENFLOW_TEST_DEVICE: tests/conftest.py's DEVICE. Left out: the
    # gloo ranks test, CPU-only; and the device-limit tests that hold the CPU device's census of a ~1 MB model to
    # byte limits, which CUDA's allocator figures cannot meet (cuBLAS's workspace alone is more): `memory` above
    # holds CUDA's figures to the estimate instead)
    part tests_cuda 70 env HF_ZENFLOW_TEST_DEVICE=cuda "$py" -m pytest -q -p no:cacheprovider --maxfail=1000 \
        -o faulthandler_timeout=65 -m "not slow" -k "not ranks_agree and not what_the_meter_counts and not \
        at_sync_offloads_peak and not window_sums_fit_under_the_limit and not cannot_be_met" \
        tests/engine/test_free_gradients.py \
        tests/engine/test_accumulate_bf16.py \
        tests/engine/test_gathered_gradient.py tests/engine/test_device_memory_limit.py \
        tests/distributed/test_bucket_view_race.py tests/engine/test_amp.py tests/engine/test_layout.py \
        tests/optimizer/test_baselines.py
    if [ "$gpus" -gt 1 ]; then
        part ranks 20 "$py" scripts/cuda_checks.py --checks nccl_two_ranks --out-dir "$out"
    else
        not_run ranks "needs 2 or more GPUs (this machine has 1)"
    fi
}

# No CUDA device: the parts that need none, on the CPU and sized for it (limits for a busy machine: this is not the
# one call a GPU makes), and the others named.
on_cpu() {
    echo "gpu_check: no CUDA device on this machine (torch.cuda.is_available() is False): running the" \
        "device-independent parts on the CPU; machine, launches_cuda, memory, sanitizer and tests_cuda need CUDA," \
        "ranks needs 2 or more GPUs"
    part launches 120 "$py" scripts/count_device_calls.py --matrices 12 --width 48 --dtype bfloat16 --steps 10 \
        --check --out "$out/launches.json"
    part checks 240 "$py" scripts/cuda_checks.py --device cpu --checks fp16_grad_scaler --out-dir "$out"
    part races 240 "$py" scripts/cuda_checks.py --device cpu --checks races --out-dir "$out"
    for name in machine launches_cuda memory sanitizer tests_cuda; do
        not_run "$name" "needs CUDA"
    done
    not_run ranks "needs 2 or more GPUs"
}

if [ "$gpus" -gt 0 ]; then
    on_gpu
else
    on_cpu
fi

echo "gpu_check: ${summary[*]} (0: passed; 124: out of time); results: $results" | tee "$out/gpu_check.txt"
exit "$failed"
