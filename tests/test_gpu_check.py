"""`scripts/gpu_check.sh` fits one call of 300 s on a GPU machine, every part under its own time limit, and where
there is no GPU runs the device-independent parts on the CPU, names the parts that need CUDA and exits 0."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
#: What one call may take on one GPU, the machine's start aside: twice that fits fifteen minutes with the start.
BUDGET_S = 300
CUDA_PARTS = ("machine", "launches_cuda", "memory", "sanitizer", "tests_cuda")
ANY_DEVICE_PARTS = ("launches", "checks", "races")


def _commands(text: str | None = None) -> list[str]:
    """The script's command lines (or those of `text`, a part of it), continuation lines joined, comments dropped."""
    text = (SCRIPT.read_text() if text is None else text).replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _parts(function: str) -> dict[str, int]:
    """Each part's time limit (`part NAME LIMIT ...`) in the script's shell function `function`, by name."""
    body = re.search(rf"^{function}\(\) {{\n(.*?)^}}", SCRIPT.read_text(), re.DOTALL | re.MULTILINE)
    assert body is not None, function
    limits: dict[str, int] = {}
    for line in _commands(body.group(1)):
        found = re.match(r"part (\w+) (\d+) ", line)
        if found:
            limits[found.group(1)] = int(found.group(2))
    return limits


def test_on_a_gpu_the_parts_and_the_probe_fit_one_call_of_300_seconds():
    limits = _parts("on_gpu")
    assert set(limits) == {*CUDA_PARTS, *ANY_DEVICE_PARTS, "ranks"}, limits
    probes = [int(t) for line in _commands() if not line.startswith("part ") and "timeout" in line
              for t in re.findall(r"\btimeout (\d+)\b", line)]
    assert probes, "the probe for a GPU is not bounded"
    assert sum(limits.values()) + sum(probes) <= BUDGET_S, (limits, probes)
    assert set(_parts("on_cpu")) == set(ANY_DEVICE_PARTS)  # (without CUDA: the parts that need none, bounded too)


def test_every_command_is_bounded():
    """Every python3 / nvidia-smi / pytest command runs inside a part (under its `timeout`) or under a timeout."""
    for line in _commands():
        if re.search(r'"\$py"|nvidia-smi|pytest', line) and not (line.startswith("part ") or "timeout " in line):
            pytest.fail(f"unbounded command in gpu_check.sh: {line}")
    text = SCRIPT.read_text()
    assert 'timeout "$limit" "$@"' in text  # (what `part` runs)
    assert " -x " not in text and "--maxfail=" in text  # one failure never hides the later results
    assert not re.search(r"\blent\b|\bsession", text, re.IGNORECASE)  # it speaks of the machine, not who runs it


def test_the_reference_tests_it_runs_on_cuda_build_on_the_test_device():
    """The files of `tests_cuda` exist, train on ``HF_ZENFLOW_TEST_DEVICE`` (conftest's `DEVICE`), and none skips
    itself whole off the CPU."""
    line = next(line for line in _commands() if line.startswith("part tests_cuda "))
    files = [word for word in shlex.split(line) if word.startswith("tests/")]
    assert len(files) >= 6
    for name in files:
        text = (ROOT / name).read_text()
        assert "DEVICE" in text, name
        assert "allow_module_level" not in text, name


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_cuda_it_runs_the_device_independent_parts_and_names_the_others(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr + "".join(
        p.read_text()[-2000:] for p in tmp_path.glob("*.log"))
    assert "no CUDA device" in done.stdout
    for name in CUDA_PARTS:
        assert f"gpu_check: {name}: not run: needs CUDA" in done.stdout
    lines = [json.loads(line) for line in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
    ran = {line["part"]: line for line in lines if "rc" in line}
    assert set(ran) == set(ANY_DEVICE_PARTS) and all(line["rc"] == 0 for line in ran.values())
    assert {line["part"] for line in lines if "not_run" in line} == {*CUDA_PARTS, "ranks"}
    launches = json.loads((tmp_path / "launches.json").read_text())
    assert launches["check"]["ok"] is True and launches["max_per_step"]["ordinary"]["launches"] > 0
    assert json.loads((tmp_path / "cuda_checks_fp16_grad_scaler.json").read_text())["fp16_grad_scaler"]["ok"]
    assert json.loads((tmp_path / "cuda_checks_races.json").read_text())["races"]["ok"]
    assert not (tmp_path / "tests_cuda.log").exists()  # nothing that needs CUDA ran
