"""`scripts/gpu_check.sh` fits one run of 540 s on a GPU machine, and where there is no GPU runs the device-independent
checks on the CPU and nothing else."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch


SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


def test_its_timeouts_fit_one_call_of_540_seconds():
    text = SCRIPT.read_text()
    commands = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    timeouts = [int(t) for line in commands for t in re.findall(r"\btimeout (\d+)\b", line)]
    assert len(timeouts) >= 6  # every part is bounded: the probe, the machine, tests, checks, ranks, benchmark
    assert sum(timeouts) <= 540, timeouts
    # every python3 / nvidia-smi invocation runs under a timeout
    for line in commands:
        if re.search(r'"\$py" |nvidia-smi ', line) and "timeout" not in line:
            pytest.fail(f"unbounded command in gpu_check.sh: {line.strip()}")
    assert " -x " not in text and "--maxfail=" in text  # one failure never hides the later results
    assert not re.search(r"\blent\b|\bsession", text, re.IGNORECASE)  # it speaks of the machine, not of who runs it


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_cuda_it_runs_the_device_independent_checks_and_nothing_else(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no CUDA device" in done.stdout
    assert "no CUDA device" in (tmp_path / "gpu_check.txt").read_text()
    results = json.loads((tmp_path / "cuda_checks.json").read_text())
    assert results["device"] == "cpu" and results["fp16_grad_scaler"]["ok"] is True
    assert not (tmp_path / "tests_cuda.log").exists()  # nothing else ran
