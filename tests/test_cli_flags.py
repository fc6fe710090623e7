"""Command-line flags are taken only as spelled: argparse's prefix matching (``--step`` read as ``--steps``) is off in
every parser of the package, the examples and the scripts; a bad `zenflow_*` value of the Trainer example ends in one
line and exit status 2."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_zenflow.cli import build_parser


ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*ROOT.joinpath("hf_zenflow").rglob("*.py"), *ROOT.joinpath("examples").glob("*.py"),
                  *ROOT.joinpath("scripts").glob("*.py")])
PARSERS = ("ArgumentParser", "HfArgumentParser", "add_parser")


def parser_calls_with_prefix_matching(path: Path) -> list[str]:
    """The parser constructions in `path` (``ArgumentParser(...)``, ``HfArgumentParser(...)``, ``add_parser(...)``)
    that leave argparse's prefix matching on (no ``allow_abbrev=False``), as ``file:line``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if name not in PARSERS:
            continue
        off = any(k.arg == "allow_abbrev" and isinstance(k.value, ast.Constant) and k.value.value is False
                  for k in node.keywords)
        if not off:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_parser_turns_prefix_matching_off():
    """Regression: `hf-zenflow compare --step 10` ran with --steps 10 and `estimate --param 7e9` with --params,
    silently: every parser (subcommands' included; add_parser does not inherit the setting) says
    allow_abbrev=False."""
    assert [where for path in SOURCES for where in parser_calls_with_prefix_matching(path)] == []


@pytest.mark.parametrize("argv", [["compare", "--step", "10"], ["estimate", "--param", "7e9"],
                                  ["tune", "--budget", "1"],
                                  ["reshard-checkpoint", "x", "--world-size", "2", "--par", "ddp"],
                                  ["convert-checkpoint", "x", "--output", "y"]], ids=" ".join)
def test_a_prefix_of_a_flag_is_refused(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser(argv[0]).parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"unrecognized arguments: {argv[-2]}" in err
    assert err.count("\n") == 1 and err.endswith("--help\n"), err  # one line: the usage block is --help's


def run_trainer_example(cwd: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(ROOT / "examples" / "train_trainer.py"), "--output_dir", "out",
                           *flags], capture_output=True, text=True, env=env, timeout=300, cwd=cwd)


def test_the_trainer_example_refuses_a_bad_zenflow_value_in_one_line(tmp_path):
    """Regression: `examples/train_trainer.py --zenflow_topk_ratio 2` ended in a traceback (the good message at its
    end)."""
    proc = run_trainer_example(tmp_path, "--zenflow_topk_ratio", "2")
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith("train_trainer.py: ") and "--zenflow_topk_ratio=2.0 is invalid" in lines[0]


def test_a_removed_setting_is_no_flag_and_is_named_as_removed(tmp_path):
    """`--zenflow_host_grad_dtype` is no flag: the Trainer's parser refuses it naming it, and the example script says
    in one line that the setting no longer exists."""
    from transformers import HfArgumentParser

    from hf_zenflow import ZenFlowTrainingArguments

    with pytest.raises(ValueError, match=r"not used by the HfArgumentParser: \['--zenflow_host_grad_dtype'"):
        HfArgumentParser(ZenFlowTrainingArguments).parse_args_into_dataclasses(
            ["--output_dir", "out", "--use_cpu", "--zenflow_host_grad_dtype", "bfloat16"])
    proc = run_trainer_example(tmp_path, "--zenflow_host_grad_dtype", "bfloat16")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("\n") == 1 and ("--zenflow_host_grad_dtype: the setting host_grad_dtype no longer exists "
                                              "in this version of hf_zenflow") in proc.stderr, proc.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []


def test_the_trainer_example_refuses_a_prefix_of_a_flag(tmp_path):
    """(A bad value: taken as --zenflow_topk_ratio, it fails at once too, not after a run.)"""
    proc = run_trainer_example(tmp_path, "--zenflow_topk", "2")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("\n") == 1 and "not used by the HfArgumentParser: ['--zenflow_topk', '2']" in proc.stderr
    assert list(tmp_path.iterdir()) == []
