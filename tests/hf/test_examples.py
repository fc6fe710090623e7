"""The examples run end to end, as README.md and docs/ give their commands: the Trainer script, the accelerate loop
under `accelerate launch` (one rank with a resume, and the README's two ranks), and the quick-start notebook; each
offloads what its comments say (its logged selected fraction and bytes to host)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import torch
from hf_helpers import REPO_ROOT, free_port
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


def documented_command(start: str) -> tuple[dict[str, str], list[str]]:
    """The command line of README.md or docs/ that starts with `start` (after any ``VAR=value`` prefix): its
    environment assignments and its arguments."""
    for page in (REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))):
        shell = re.findall(r"^```bash\n(.*?)^```", page.read_text(), re.MULTILINE | re.DOTALL)
        for line in "\n".join(shell).replace("\\\n", " ").splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:  # (a line of a multi-line quote: not a command)
                continue
            env = {}
            while words and "=" in words[0] and not words[0].startswith("-"):
                name, _, value = words.pop(0).partition("=")
                env[name] = value
            if words and " ".join(words).startswith(start):
                return env, words
    raise AssertionError(f"no command starting with {start!r} in README.md or docs/")


def assert_it_offloads(stats: dict, ranks: int = 1) -> None:
    """What the examples say they do: about 10 % of each offloaded matrix's columns on the device, the rest of the
    gradient to the host in windows of 4 steps (not a run that offloads nothing: selected fraction 1, 0 bytes)."""
    assert 0.05 < stats["zenflow/selected_fraction"] < 0.2, stats
    assert stats["zenflow/update_interval"] == 4, stats
    # the tiny Llama (hidden 512) offloads 5 of the 7 matrices of each layer: 8 Mi fp32 elements, 90 % of them
    # going to the host each step, split between the ranks
    assert stats["zenflow/bytes_to_host"] > 0.8 * 4 * (1 << 22) / ranks, stats


def test_the_readme_trainer_command(tmp_path):
    """The README's `python examples/train_trainer.py ...` line as written (in a scratch folder): it trains, logs
    the loss, writes the model, its card and all_results.json, and offloads what its comments say."""
    env, words = documented_command("python examples/train_trainer.py")
    assert words[:2] == ["python", "examples/train_trainer.py"]
    proc = run([sys.executable, str(EXAMPLES / "train_trainer.py"), *words[2:], "--disable_tqdm", "True"],
               example_env(OMP_NUM_THREADS="1", **env), cwd=tmp_path)
    out = tmp_path / words[words.index("--output_dir") + 1]
    assert "{'loss':" in proc.stdout and proc.stdout.count("train_loss") == 1
    assert proc.stdout.strip().splitlines()[-1].endswith(f"all_results.json to {out.resolve()}")
    results = json.loads((out / "all_results.json").read_text())
    assert results["zenflow/steps"] == int(words[words.index("--max_steps") + 1]) and "eval_loss" in results
    assert results["train_loss"] < 4.0  # from ln(256) ~ 5.55 down
    assert_it_offloads(results)
    card = (out / "README.md").read_text()
    assert "hf_zenflow" in card and "## ZenFlow" in card and "| `update_interval` | 4 |" in card
    assert (out / "model.safetensors").is_file()


def test_the_readme_two_rank_accelerate_command(tmp_path):
    """`ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 examples/train_accelerate.py` on a
    CPU machine starts two ranks (without --multi_gpu and ACCELERATE_USE_CPU accelerate runs one process without a
    word) and exercises the host path: each rank sends half the host-bound bytes of one process."""
    env, words = documented_command("accelerate launch --multi_gpu --num_processes 2")
    assert env == {"ACCELERATE_USE_CPU": "true"} and words[-1] == "examples/train_accelerate.py"
    # (a free rendezvous port rather than accelerate's fixed 29500, which another job on the machine may hold)
    launch = [sys.executable, "-m", "accelerate.commands.launch", *words[2:-1], "--main_process_port",
              str(free_port()), str(EXAMPLES / "train_accelerate.py")]
    out = tmp_path / "two_ranks"
    proc = run([*launch, "--output_dir", str(out)], example_env(**env), cwd=tmp_path)
    log = json.loads((out / "train_log.json").read_text())
    assert log["num_processes"] == 2, proc.stdout[-2000:]
    assert [s["step"] for s in log["steps"]] == list(range(1, 31))
    assert_it_offloads(log["steps"][-1], ranks=2)


def test_train_accelerate_under_accelerate_launch(tmp_path):
    """`accelerate launch --cpu --num_processes 1`, with the thread trap of a GPU launch (OMP_NUM_THREADS=1 from
    --num_cpu_threads_per_process 1): the host worker still runs HF_ZENFLOW_CPU_THREADS=2 threads. Then
    save_state mid-window and a resumed launch reproduce the uninterrupted run."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--num_cpu_threads_per_process", "1", str(EXAMPLES / "train_accelerate.py")]
    common = ["--max_steps", "8", "--num_train_samples", "64", "--seq_len", "32", "--hidden_size", "32",
              "--log_every", "4"]
    # (HF_ZENFLOW_MIN_OFFLOAD_NUMEL=0: the tiny model is offloaded; with nothing offloaded no worker would start; the
    # example's lr 1e-3 x 4 stays under the high-lr rule's threshold: windows of 4, so that step 6 is mid-window)
    env = example_env(HF_ZENFLOW_CPU_THREADS="2", HF_ZENFLOW_UPDATE_INTERVAL="4", HF_ZENFLOW_OVERLAP_STEP="true",
                      HF_ZENFLOW_MIN_OFFLOAD_NUMEL="0")
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


def test_quickstart_notebook_runs_from_the_readme_command(tmp_path):
    """The documented `jupyter execute ...` line (docs/usage.md), in a copy of examples/: the notebook runs top to
    bottom, warns about no missing widget support, writes what the docs say, and offloads what it says."""
    for name in ("nbclient", "ipykernel", "ipywidgets"):
        pytest.importorskip(name)
    _, command = documented_command("jupyter execute ")
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
    measured = card_rows(card)
    assert 0.05 < float(measured["selected fraction (mean)"]) < 0.2
    assert measured["bytes to host per step (mean)"].endswith("MiB")  # the attention and MLP matrices go to the host


def card_rows(card: str) -> dict[str, str]:
    """The two-column rows of a model card's tables (figure -> value)."""
    return dict(re.findall(r"^\| ([^|]+?) \| ([^|]+?) \|$", card, re.MULTILINE))


def test_the_example_model_card_is_what_its_command_writes():
    """model_cards/example_tiny_llama.md came from the command model_cards/README.md names: its settings are that
    command's, and it shows the offload the example makes."""
    index = (REPO_ROOT / "model_cards" / "README.md").read_text()
    (command,) = re.findall(r"`(python examples/train_trainer\.py --output_dir example_tiny_llama [^`]+)`", index)
    words = shlex.split(command)
    rows = card_rows((REPO_ROOT / "model_cards" / "example_tiny_llama.md").read_text())
    assert float(rows["learning_rate"]) == float(words[words.index("--learning_rate") + 1])
    assert rows["training_steps"] == words[words.index("--max_steps") + 1]
    assert 0.05 < float(rows["selected fraction (mean)"]) < 0.2
    # the columns chosen by gradient norm hold more of the gradient than their share of the columns
    share = float(rows["device columns' share of the gradient norm (last selection)"])
    assert float(rows["selected fraction (mean)"]) < share <= 1.0
    assert rows["bytes to host per step (mean)"].endswith("MiB")


def test_notebook_outputs_are_git_ignored():
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    for path in ("examples/zenflow_quickstart_output/README.md", "examples/zenflow_quickstart_run.ipynb"):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO_ROOT).returncode == 0, path


@pytest.mark.parametrize("flags, named", [
    (["--zenflow_topk_ratio", "2"], "--zenflow_topk_ratio=2.0 is invalid: allowed is a float in [0, 1]"),
    (["--zenflow_select_strategy=nope"], "--zenflow_select_strategy='nope' is invalid"),
    (["--zenflow_select_interval", "3"], "--zenflow_select_interval=3 is invalid with select_strategy"),
])
def test_train_trainer_refuses_a_bad_zenflow_flag_before_importing_torch(flags, named, tmp_path):
    """Regression: `train_trainer.py --zenflow_topk_ratio 2` ended in a traceback after transformers was imported;
    a bad --zenflow_* value is one line and exit status 2, with neither torch nor transformers imported."""
    proc = subprocess.run([sys.executable, "-X", "importtime", str(EXAMPLES / "train_trainer.py"), *flags,
                           "--output_dir", str(tmp_path / "out")], env=example_env(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time")}
    said = [line for line in proc.stderr.splitlines() if not line.startswith("import time")]
    assert proc.returncode == 2 and len(said) == 1, proc.stderr[-3000:]
    assert said[0].startswith("train_trainer.py: ") and named in said[0], said
    assert not {"torch", "transformers"} & imported
    assert not (tmp_path / "out").exists()
