"""The oldest torch the package accepts: `pyproject.toml`'s requirement and the import-time check agree, an older
torch is refused at import with a message naming both versions, and the installed torch has every API the floor
stands for."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_zenflow._base import MIN_TORCH, check_torch_version


ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_requires_the_floor_the_package_checks():
    requirement = re.search(r'"torch>=(\d+)\.(\d+)"', (ROOT / "pyproject.toml").read_text())
    assert requirement is not None, "pyproject.toml names no torch floor"
    assert (int(requirement.group(1)), int(requirement.group(2))) == MIN_TORCH


@pytest.mark.parametrize("version", ["2.6.0", "2.6.0+cu124", "2.4.1+cpu", "1.13.1", "unknown"])
def test_an_older_torch_is_refused_naming_both_versions(version):
    with pytest.raises(ImportError) as info:
        check_torch_version(version)
    floor = ".".join(map(str, MIN_TORCH))
    assert f"torch >= {floor}" in str(info.value) and f"torch {version}" in str(info.value)


@pytest.mark.parametrize("version", ["2.7.0", "2.7.1+cu126", "2.13.0+cpu", "2.14.0a0+gitabc", "3.0.0"])
def test_the_floor_and_later_are_accepted(version):
    check_torch_version(version)


def test_importing_the_optimizer_under_an_older_torch_stops_at_once():
    """(a fresh interpreter: torch's version string replaced before hf_zenflow is imported)"""
    code = ("import torch; torch.__version__ = '2.6.0+cu124'\n"
            "from hf_zenflow import ZenFlowAdamW\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode != 0
    assert "ImportError: hf_zenflow needs torch >= 2.7; this environment has torch 2.6.0+cu124" in done.stderr


def test_the_installed_torch_has_what_the_floor_stands_for():
    from torch.optim.adam import adam

    assert "decoupled_weight_decay" in inspect.signature(adam).parameters
    assert hasattr(torch.Tensor, "register_post_accumulate_grad_hook")
    torch.amp.GradScaler("cpu")
    if torch.distributed.is_available():
        from torch.distributed.fsdp import fully_shard  # noqa: F401
        from torch.distributed.tensor import DTensor  # noqa: F401
