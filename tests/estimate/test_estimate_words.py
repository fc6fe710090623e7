"""`hf-zenflow estimate`'s words: every ratio says its direction and no schedule is compared with itself as
"1.00x faster"; `--params` takes the shorthand everyone types (7B); `--output` writes the format its suffix names and
an error names the user's file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hf_zenflow.cli import build_parser, main
from hf_zenflow.estimate.speed_words import than, versus


def table_rows(text: str, header_start: str) -> dict[str, list[str]]:
    """The rows (label -> cells) of the Markdown table whose header starts with `header_start`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header, cells))
    return rows


def test_versus_says_the_direction():
    assert versus(3.0, 1.0) == "3.00x slower" and versus(1.0, 4.0) == "4.00x faster"
    assert versus(1.001, 1.0) == "same speed" and versus(2.0, 2.0, baseline=True) == "baseline"
    assert than(1.0, 1.0, "X") == "as fast as X" and than(2.0, 1.0, "X") == "2.00x slower than X"


@pytest.fixture
def estimate_text(capsys) -> str:
    assert main(["estimate", "--host-from-profile", "--params", "7e9"]) == 0
    return capsys.readouterr().out


def test_no_schedule_is_faster_than_itself_and_every_ratio_has_a_direction(estimate_text):
    """Regression: the what-fits table said "1.00x faster" for synchronous offload against itself and "10.89x" with
    no direction in its "vs no offload" column."""
    assert "1.00x faster" not in estimate_text and "1.00x slower" not in estimate_text
    fits = table_rows(estimate_text, "| schedule | device GB |")
    sync, none = fits["synchronous offload (ZeRO-Offload)"], fits["no offload (AdamW on the device)"]
    assert sync["vs sync offload"] == "baseline" and none["vs no offload"] == "baseline"
    for row in fits.values():
        for column in ("vs no offload", "vs sync offload"):
            assert re.fullmatch(r"baseline|same speed|\d+\.\d\dx (faster|slower)", row[column]), row
    step_ms = {label: float(row["step ms"]) for label, row in fits.items()}
    expected = versus(step_ms["synchronous offload (ZeRO-Offload)"], step_ms["no offload (AdamW on the device)"])
    assert sync["vs no offload"] == expected and expected.endswith("slower")
    model = table_rows(estimate_text, "| schedule | device ms/step |")
    assert model["synchronous offload (ZeRO-Offload)"]["vs sync offload"] == "baseline"
    assert all(re.fullmatch(r"baseline|same speed|\d+\.\d\dx (faster|slower)", r["vs sync offload"])
               for r in model.values())


@pytest.mark.parametrize(("text", "value"), [("7B", 7e9), ("13b", 13e9), ("1.5e9", 1.5e9), ("350M", 350e6),
                                             ("7e9", 7e9), ("1.2t", 1.2e12), (" 70B ", 70e9)])
def test_params_take_the_shorthand(text, value):
    """Regression: `--params 7B` was refused."""
    for command, flag in (("estimate", "--params"), ("compare", "--project-params"), ("tune", "--target-params")):
        args = build_parser(command).parse_args([command, flag, text])
        assert getattr(args, flag[2:].replace("-", "_")) == pytest.approx(value)


@pytest.mark.parametrize("text", ["7X", "B", "-7B", "0", "nan", "infB"])
def test_params_refuse_what_is_no_count(text, capsys):
    with pytest.raises(SystemExit):
        build_parser("estimate").parse_args(["estimate", f"--params={text}"])
    assert "allowed is a number of parameters > 0" in capsys.readouterr().err


def test_output_format_follows_the_suffix(tmp_path: Path, capsys):
    """Regression: `--output x.md` wrote JSON into a .md name. .md gets the printed tables, .json the figures; any
    other suffix is refused before any work."""
    assert main(["estimate", "--host-from-profile", "--output", str(tmp_path / "x.md")]) == 0
    printed = capsys.readouterr().out
    written = (tmp_path / "x.md").read_text()
    assert written.startswith("## Bound model (not a measurement)") and written.strip() == printed.strip()
    assert main(["estimate", "--host-from-profile", "--output", str(tmp_path / "x.json")]) == 0
    assert json.loads((tmp_path / "x.json").read_text())["params"] == 7e9
    capsys.readouterr()
    for name in ("x.txt", "x"):
        assert main(["estimate", "--host-from-profile", "--output", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "names no format: allowed are .json" in err and ".md" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json", "x.md"]


def test_an_unwritable_output_names_the_users_file(capsys):
    """Regression: `estimate --output /proc/x.json` said "No such file or directory: /proc/.x.json.tmp", the hidden
    temporary file. (/proc takes no new files, whoever runs this; as root the write is attempted, otherwise the
    check before any work refuses it.)"""
    if not Path("/proc/self").exists():
        pytest.skip("no /proc")
    assert main(["estimate", "--host-from-profile", "--output", "/proc/hf_zenflow_estimate.json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "/proc/hf_zenflow_estimate.json" in err and ".tmp" not in err, err
