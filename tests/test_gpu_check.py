"""`scripts/gpu_check.sh` fits one call on a lent GPU machine and costs nothing where there is no GPU."""

from __future__ import annotations

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


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_cuda_it_says_so_and_exits_0(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "no CUDA device" in done.stdout
    assert "no CUDA device" in (tmp_path / "gpu_check.txt").read_text()
    assert not (tmp_path / "tests_cuda.log").exists()  # nothing else ran
