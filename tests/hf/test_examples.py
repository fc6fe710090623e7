"""The examples run end to end: the Trainer script (subprocess), the accelerate loop under `accelerate launch`
(subprocess), and the quick-start notebook (the README's `jupyter execute` command)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest
import torch
from hf_helpers import REPO_ROOT
from safetensors.torch import load_file


EXAMPLES = REPO_ROOT / "examples"


def example_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for name in list(env):
        if name.startswith(("HF_ZENFLOW_", "ACCELERATE_")) or name == "OMP_NUM_THREADS":
            env.pop(name)
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
        HF_HUB_OFFLINE="1",
        # Idle OpenMP threads sleep instead of spinning: on a small shared CI machine spinning teams of the training
        # thread and of the host worker starve each other.
        OMP_WAIT_POLICY="PASSIVE",
        TOKENIZERS_PARALLELISM="false",
    )
    env.update(extra)
    return env


def run(cmd: list[str], env: dict[str, str], cwd) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    )
    return proc


def test_train_trainer_script_with_auto_interval(tmp_path):
    out = tmp_path / "run"
    proc = run([sys.executable, str(EXAMPLES / "train_trainer.py"), "--output_dir", str(out), "--max_steps", "10",
                "--use_cpu", "--report_to", "none", "--learning_rate", "3e-3",
                "--per_device_train_batch_size", "4", "--num_train_samples", "64", "--num_eval_samples", "8",
                "--seq_len", "32", "--hidden_size", "32", "--save_strategy", "no", "--disable_tqdm", "True",
                "--zenflow_update_interval", "auto", "--zenflow_topk_ratio", "0.2", "--zenflow_cpu_threads", "1"],
               example_env(OMP_NUM_THREADS="1"), cwd=tmp_path)
    # the loss is logged during training without --logging_steps, the metrics are printed once, the output named
    assert "{'loss':" in proc.stdout
    assert proc.stdout.count("train_loss") == 1
    assert proc.stdout.strip().splitlines()[-1].endswith(f"all_results.json to {out.resolve()}")
    results = json.loads((out / "all_results.json").read_text())
    assert results["zenflow/steps"] == 10 and "eval_loss" in results
    assert results["train_loss"] < 5.6  # from ln(256) ~ 5.55 down
    args = torch.load(out / "training_args.bin", weights_only=False)
    assert args.zenflow_update_interval == "auto" and args.zenflow_topk_ratio == 0.2
    card = (out / "README.md").read_text()
    assert "hf_zenflow" in card and "## ZenFlow" in card and "| `update_interval` | auto |" in card
    assert (out / "model.safetensors").is_file()


def test_train_accelerate_under_accelerate_launch(tmp_path):
    """`accelerate launch --cpu --num_processes 1`, with the thread trap of a GPU launch (OMP_NUM_THREADS=1 from
    --num_cpu_threads_per_process 1): the host worker still runs HF_ZENFLOW_CPU_THREADS=2 threads. Then
    save_state mid-window and a resumed launch reproduce the uninterrupted run."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--num_cpu_threads_per_process", "1", str(EXAMPLES / "train_accelerate.py")]
    common = ["--max_steps", "8", "--num_train_samples", "64", "--seq_len", "32", "--hidden_size", "32",
              "--log_every", "4"]
    # (HF_ZENFLOW_MIN_OFFLOAD_NUMEL=0: the tiny model is offloaded; with nothing offloaded no worker would start;
    # HF_ZENFLOW_HIGH_LR_RULE=off: windows of 4 at the example's lr 3e-3, so that step 6 is mid-window)
    env = example_env(HF_ZENFLOW_CPU_THREADS="2", HF_ZENFLOW_UPDATE_INTERVAL="4", HF_ZENFLOW_OVERLAP_STEP="true",
                      HF_ZENFLOW_MIN_OFFLOAD_NUMEL="0", HF_ZENFLOW_HIGH_LR_RULE="off")
    full = tmp_path / "full"
    proc = run([*launch, *common, "--output_dir", str(full), "--save_state_steps", "6"], env, cwd=tmp_path)
    assert f"wrote the model and train_log.json to {full.resolve()}" in proc.stdout
    log = json.loads((full / "train_log.json").read_text())
    assert log["config"]["cpu_threads"] == 2 and log["config"]["update_interval"] == 4
    assert log["threads"]["OMP_NUM_THREADS"] == "1"
    assert log["threads"]["training_threads"] == 1
    assert log["threads"]["host_worker_threads"] == 2  # the trap does not reach the worker
    assert [s["step"] for s in log["steps"]] == list(range(1, 9))
    assert log["steps"][-1]["zenflow/windows"] == 2

    resumed = tmp_path / "resumed"
    run([*launch, *common, "--output_dir", str(resumed), "--resume_from_state", str(full / "state-6")], env,
        cwd=tmp_path)
    resumed_log = json.loads((resumed / "train_log.json").read_text())
    assert [s["loss"] for s in resumed_log["steps"]] == [s["loss"] for s in log["steps"][6:]]
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def readme_command(start: str) -> list[str]:
    """The README's command line that starts with `start` (one line, no shell syntax)."""
    for line in (REPO_ROOT / "README.md").read_text().splitlines():
        if line.startswith(start):
            return shlex.split(line.split("#")[0])
    raise AssertionError(f"README.md has no command starting with {start!r}")


def test_quickstart_notebook_runs_from_the_readme_command(tmp_path):
    """The README's `jupyter execute ...` line, in a copy of examples/: the notebook runs top to bottom, warns about
    no missing widget support, and writes what the README says."""
    for name in ("nbclient", "ipykernel", "ipywidgets"):
        pytest.importorskip(name)
    command = readme_command("jupyter execute ")
    (tmp_path / "examples").mkdir()
    shutil.copy(EXAMPLES / "zenflow_quickstart.ipynb", tmp_path / "examples")
    run([sys.executable, "-m", *command], example_env(OMP_NUM_THREADS="1"), cwd=tmp_path)  # `jupyter` of this venv
    executed = json.loads((tmp_path / "examples" / "zenflow_quickstart_run.ipynb").read_text())
    outputs = "\n".join(
        "".join(out.get("text", "")) or "".join(out.get("data", {}).get("text/plain", ""))
        for cell in executed["cells"] if cell["cell_type"] == "code" for out in cell["outputs"]
    )
    assert "critical path" in outputs and "eval loss" in outputs
    assert "### ZenFlow settings" in outputs
    assert "IProgress not found" not in outputs
    card = (tmp_path / "examples" / "zenflow_quickstart_output" / "README.md").read_text()
    assert "hf_zenflow" in card


def test_notebook_outputs_are_git_ignored():
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    for path in ("examples/zenflow_quickstart_output/README.md", "examples/zenflow_quickstart_run.ipynb"):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO_ROOT).returncode == 0, path
