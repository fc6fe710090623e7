"""Every `hf-zenflow` input checked before any work (one line, exit 2, nothing left behind), `compare --overwrite`
keeping the earlier run until the new one is complete, and argument errors answered before torch is imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_zenflow.cli import main
from hf_zenflow.compare.checks import GPU_DRIVER_PATHS


ROOT = Path(__file__).resolve().parents[2]


def one_line_refusal(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"hf-zenflow {command}: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_overwrite_keeps_the_earlier_run_when_the_new_one_fails_its_inputs(tmp_path, capsys):
    """Regression: `mkdir -p x/prev && echo keep > x/prev/results.md && : > x/e.csv && hf-zenflow compare
    --output-dir x/prev --overwrite --dataset x/e.csv` removed the earlier results before checking its inputs: the
    old results were gone and nothing new was written."""
    prev = tmp_path / "prev"
    prev.mkdir()
    (prev / "results.md").write_text("keep\n")
    (tmp_path / "e.csv").write_text("")
    assert main(["compare", "--output-dir", str(prev), "--overwrite", "--dataset", str(tmp_path / "e.csv")]) == 2
    assert "e.csv" in one_line_refusal(capsys, "compare")
    assert (prev / "results.md").read_text() == "keep\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.csv", "prev"]


def test_overwrite_keeps_the_earlier_run_when_the_new_one_fails_midway(tmp_path, monkeypatch):
    """A run that fails after it started writing (here: after its first file) leaves the earlier run whole."""
    from hf_zenflow.compare import runner
    from hf_zenflow.compare.compare_config import CompareConfig

    prev = tmp_path / "prev"
    prev.mkdir()
    (prev / "results.md").write_text("keep\n")

    def failing_run(cfg, out_dir, monitor, final_dir):
        (out_dir / "results.json").write_text("{}")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(runner, "_run", failing_run)
    with pytest.raises(OSError, match="No space left"):
        runner.run_compare(CompareConfig(output_dir=str(prev), overwrite=True, device="cpu"))
    assert sorted(p.name for p in prev.iterdir()) == ["results.md"]
    assert (prev / "results.md").read_text() == "keep\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prev"]  # no staging folder left


BAD_COMPARE = {
    "project-hardware": (["--project-hardware", "bogus"], "--project-hardware"),
    "optimizers": (["--optimizers", "bogus"], "--optimizers"),
    "device-tpu": (["--device", "tpu"], "--device"),
    "model": (["--model", "no/such/model"], "--model"),
    "output-dir-under-a-file": (["--output-dir", "{tmp}/afile/run"], "afile"),
}
if not torch.cuda.is_available():
    BAD_COMPARE["device-cuda"] = (["--device", "cuda"], "--device cuda")


@pytest.mark.parametrize("case", sorted(BAD_COMPARE))
@pytest.mark.parametrize("output", ["default", "new-folder"])
def test_a_bad_compare_input_is_one_line_before_any_work_leaving_nothing(case, output, tmp_path, monkeypatch, capsys):
    """Regression: --project-hardware bogus was checked after all three runs (a folder with only the PNGs);
    --optimizers bogus and --device cuda without CUDA gave tracebacks; --device tpu failed after
    the model loaded, leaving an empty zenflow_compare/; a failed --output-dir NEW left an empty NEW."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    flags, named = BAD_COMPARE[case]
    flags = [f.format(tmp=tmp_path) for f in flags]
    if output == "new-folder" and "--output-dir" not in flags:
        flags += ["--output-dir", str(tmp_path / "new" / "run")]
    assert main(["compare", *flags]) == 2
    assert named in one_line_refusal(capsys, "compare")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # no zenflow_compare/, no new/


def test_tune_with_a_missing_model_is_refused_leaving_no_folder(tmp_path, monkeypatch, capsys):
    """Regression: `hf-zenflow tune --model missing` left an empty zenflow_tune/."""
    monkeypatch.chdir(tmp_path)
    assert main(["tune", "--model", "missing"]) == 2
    assert "--model" in one_line_refusal(capsys, "tune")
    assert list(tmp_path.iterdir()) == []


def test_tune_with_a_bad_profile_or_device_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["tune", "--hardware", "bogus"]) == 2
    assert "--hardware" in one_line_refusal(capsys, "tune")
    assert main(["tune", "--device", "tpu"]) == 2
    assert "--device" in one_line_refusal(capsys, "tune")
    assert list(tmp_path.iterdir()) == []


ARGUMENT_ERRORS = [["--help"], ["compare", "--steps", "0"], ["compare", "--bogus"], ["compare", "--help"],
                   ["convert-checkpoint", "--help"], ["reshard-checkpoint", "x", "--world-size", "0"]]


@pytest.mark.parametrize("argv", ARGUMENT_ERRORS, ids=" ".join)
def test_argument_errors_and_help_answer_before_torch_is_imported(argv):
    """Regression: `hf-zenflow --help` took seconds (11 s on a busy machine): building the parser imported torch and
    the whole package. The figures are in BENCHMARKS.md; here: what the command imports."""
    code = ("import sys; from hf_zenflow.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit as exc:\n    code = exc.code\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules)\n"
            "print('HEAVY', heavy, 'CODE', code)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=120)
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("HEAVY [] CODE"), proc.stdout[-2000:] + proc.stderr[-2000:]
    assert last.endswith("CODE 0" if "--help" in argv else "CODE 2")


def run_cli_counting_imports(argv: list[str], cwd: Path) -> tuple[str, str, list[str]]:
    """`hf-zenflow ARGV` in a fresh interpreter: its last line of output ("HEAVY [modules] CODE status": which of
    torch, transformers and numpy were imported by the time it returned, and its exit status), its stderr and that
    stderr's lines."""
    code = ("import sys; from hf_zenflow.cli import main\n"
            "try:\n    code = main(sys.argv[1:])\nexcept SystemExit as exc:\n    code = exc.code\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules)\n"
            "print('HEAVY', heavy, 'CODE', code)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=120,
                          cwd=cwd)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-2000:]
    return last, proc.stderr, proc.stderr.strip().splitlines()


def weights_only_checkpoint(folder: Path) -> Path:
    """A checkpoint folder whose weights' longest dimension is 33 (and an optimizer file)."""
    from safetensors.torch import save_file

    folder.mkdir()
    save_file({"embed.weight": torch.zeros(24, 20), "up.weight": torch.zeros(33, 20)},
              str(folder / "model.safetensors"))
    torch.save({"state": {}, "param_groups": []}, folder / "optimizer.pt")
    return folder


INPUT_ERRORS = {
    "tune-dataset": (["tune", "--dataset", "missing.csv"], "--dataset 'missing.csv': no such file"),
    "tune-model": (["tune", "--model", "missing"], "--model 'missing'"),
    "tune-hardware": (["tune", "--hardware", "nope"], "--hardware 'nope'"),
    "estimate-hardware": (["estimate", "--hardware", "nope"], "--hardware 'nope'"),
    "compare-dataset": (["compare", "--dataset", "missing.csv"], "--dataset 'missing.csv': no such file"),
    "compare-model": (["compare", "--model", "missing"], "--model 'missing'"),
    "convert-missing": (["convert-checkpoint", "missing"], "missing: no such checkpoint folder"),
    "reshard-missing": (["reshard-checkpoint", "missing", "--world-size", "2"], "missing: no such checkpoint folder"),
    "reshard-too-many-ranks": (["reshard-checkpoint", "ckpt", "--world-size", "1000000000"],
                               "--world-size 1000000000 is invalid for ckpt: allowed is at most 33"),
}
if not any(os.path.exists(p) for p in GPU_DRIVER_PATHS):
    INPUT_ERRORS["compare-device-cuda"] = (["compare", "--device", "cuda"], "--device cuda: this machine has no GPU")


@pytest.mark.parametrize("case", sorted(INPUT_ERRORS))
def test_a_missing_path_file_or_device_is_refused_before_torch_is_imported(case, tmp_path):
    """Regression: these failures came after torch was imported (and for estimate after a host measurement), 4 to
    52 s each; `reshard-checkpoint CKPT --world-size 1000000000` never ended. Each is now one line and exit status
    2 with torch not imported (what it costs in seconds: BENCHMARKS.md)."""
    weights_only_checkpoint(tmp_path / "ckpt")
    argv, named = INPUT_ERRORS[case]
    last, stderr, lines = run_cli_counting_imports(argv, tmp_path)
    assert last == "HEAVY [] CODE 2", stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert lines[0].startswith(f"hf-zenflow {argv[0]}: ") and named in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nothing made

