"""`hf-zenflow compare` ends with a verdict computed from its own figures, reads in a log file as on a terminal, holds
ZenFlow to synchronous offload's device memory by default, and draws every run's timeline on one time scale."""

from __future__ import annotations

import io
import json
import logging
import math
import re
import sys
from pathlib import Path

import pytest
from test_figures import tiny_config, tiny_task

from hf_zenflow.cli import build_parser
from hf_zenflow.compare.verdict import MIN_TIMED_STEPS, block_ratios, speed_interval, verdict


def curves(step_ms: list[float], handover_ms: list[float] | None = None) -> dict:
    return {"curves": {"step_ms": step_ms, "handover_ms": handover_ms or [0.0] * len(step_ms)}}


def test_block_ratios_pair_the_same_steps_and_count_the_handover():
    zen = curves([9.0, 9.0, 2.0, 2.0, 3.0, 3.0], [0.0, 0.0, 0.0, 2.0, 0.0, 0.0])
    base = curves([1.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    assert block_ratios(zen, base, first=2, block=2) == [6.0 / 4.0, 6.0 / 4.0]  # steps 0-1 untimed
    geo, lo, hi, n = speed_interval([1.5, 1.5])
    assert (geo, lo, hi, n) == (pytest.approx(1.5), pytest.approx(1.5), pytest.approx(1.5), 2)
    assert speed_interval([1.2])[1:] == (None, None, 1)


def results(zen_steps: list[float], base_steps: list[float], **zen_extra) -> dict:
    def run(name: str, steps: list[float], **extra) -> dict:
        return {"optimizer": name, **curves(steps), "step_ms": sum(steps) / len(steps),
                "step_ms_mean": sum(steps) / len(steps), "forward_backward_ms_mean": 0.9 * steps[0],
                "opt_step_ms_median": 0.1 * steps[0], "eval_accuracy": 0.80, "eval_loss": 0.50,
                "peak_device_bytes": 8 << 20, "peak_device_bytes_per_param": 8.0, **extra}

    return {"adamw_torch": run("adamw_torch", base_steps, peak_device_bytes=16 << 20,
                               peak_device_bytes_per_param=16.0),
            "sync_offload": run("sync_offload", base_steps),
            "zenflow": run("zenflow", zen_steps, **zen_extra)}


PROJECTION = {"params": 22.7e6, "profiles": {"h100-80gb-pcie5": {
    "adamw_torch": {"device_ms": 0.513, "link_ms": 0.0, "host_ms": 0.0, "step_ms": 0.513, "bound": "device",
                    "device_memory_gb": 0.4, "fits_device_memory": True},
    "sync_offload": {"device_ms": 0.5, "link_ms": 0.3, "host_ms": 2.0, "step_ms": 2.8, "bound": "host",
                     "device_memory_gb": 0.2, "fits_device_memory": True},
    "zenflow": {"device_ms": 0.52, "link_ms": 0.2, "host_ms": 1.004, "step_ms": 1.004, "bound": "host",
                "device_memory_gb": 0.2, "fits_device_memory": True}}}}


def say(res: dict, **kwargs) -> str:
    values = dict(projection=PROJECTION, metric_name="accuracy", first=2, block=4, memory_limit="sync",
                  params_ran=22.7e6, device_cores=1)
    values.update(kwargs)
    return "\n".join(verdict(res, **values))


def test_the_verdict_says_no_difference_when_the_interval_holds_one():
    """Regression: compare printed honest tables and no verdict: a user had to work out that ZenFlow gave no
    wall-clock gain (1.00×) from rows of figures. Steps that differ only by noise around the same time: "no
    difference shown", with the interval, against each baseline."""
    noise = [100.0 + 3.0 * math.sin(i) for i in range(42)]
    text = say(results(noise, list(reversed(noise)), device_memory_limit_bytes=8 << 20))
    assert text.count("no difference shown") == 2, text
    assert "Speed against adamw_torch: ZenFlow's whole run was as fast as adamw_torch's" in text
    assert re.search(r"per block of 4 steps \d\.\d{3}× its time \(95 % interval 0\.9\d\d–1\.0\d\d, 10 blocks\)",
                     text), text


def test_the_verdict_names_a_shown_difference_memory_quality_and_the_projection():
    slow = [130.0 + (i % 3) for i in range(42)]
    base = [100.0 + (i % 2) for i in range(42)]
    res = results(slow, base, eval_accuracy=0.794, eval_loss=0.49, device_memory_limit_bytes=8 << 20)
    text = say(res)
    assert "ZenFlow slower" in text and "ZenFlow's whole run was 1.30x slower than adamw_torch's" in text
    assert "Device memory: ZenFlow's peak 8.0 MiB (8.0 B/param), 0.50× adamw_torch's 16.0 MiB" in text
    assert ("held to 8.0 MiB, synchronous offload's weights and gradients (--device-memory-limit-bytes), within it"
            in text)
    assert "Quality: held-out accuracy 0.7940 and loss 0.4900 against adamw_torch 0.8000 (-0.60 points)" in text
    assert "the accuracy and the loss disagree in direction" in text and "One seed is one seed" in text
    # the projection: why it differs, and the profile where ZenFlow loses to no offload, with its bound
    assert "Why the projection differs from what this machine measured: here the device is 1 CPU core" in text
    assert "adamw_torch's forward + backward took 90 of its 100 ms per step" in text and "was 10% of a step" in text
    assert ("Where the projection has ZenFlow slower than no offload (h100-80gb-pcie5 1.004 against 0.513 ms, "
            "host-bound: its host side 1.004 ms against 0.52 ms of GPU work)") in text
    assert "no offload fits there" in text and "ZenFlow is 2.79x faster on h100-80gb-pcie5" in text
    free = say(results(slow, base), memory_limit="free")
    assert "it had the device's free memory (--device-memory-limit-bytes free)" in free


def test_too_few_steps_give_no_interval():
    text = say(results([100.0] * 3, [100.0] * 3))
    assert "too few timed steps for an interval" in text


@pytest.fixture
def tiny_compare(monkeypatch: pytest.MonkeyPatch):
    """`run_compare` on the tiny in-file model (no assets), the host rates fixed."""
    from hf_zenflow.compare import runner
    from hf_zenflow.estimate.host_rates import HostRates

    monkeypatch.setattr(runner, "prepare_task", lambda **kwargs: tiny_task(kwargs["steps"]))
    monkeypatch.setattr("hf_zenflow.estimate.host_rates.measure_host_rates",
                        lambda: HostRates(cores=2, adamw_params_per_s={1: 1e9, 2: 1.5e9}, mem_gbps=20.0))
    return runner.run_compare


def test_compare_in_a_log_file_has_no_carriage_returns_and_ends_with_the_verdict(tiny_compare, tmp_path, capsys):
    """Regression: written to a file or a pipe the output was full of the progress bar's carriage returns, the
    threads line glued to a bar, and it ended with tables. Now (stderr not a terminal) whole progress lines, and the
    last lines are the verdict, also in results.md and results.json."""
    payload = tiny_compare(tiny_config(output_dir=str(tmp_path / "run"), quiet=False, log_every=2, steps=24,
                                       train_size=192, project_hardware=("h100-80gb-pcie5",)))
    out, err = capsys.readouterr()
    assert "\r" not in out and "\r" not in err
    assert re.search(r"^\[compare\] 72/72 steps \(100 %\), .* elapsed", err, re.MULTILINE), err[-2000:]
    assert all(not line or line.startswith(("[compare]", "hf_zenflow")) for line in err.splitlines()), err[-2000:]
    tail = out[out.rindex("Verdict (from the figures above):"):]
    assert tail.rstrip().endswith(payload["verdict"][-1].split()[-1])
    assert "Speed against adamw_torch" in tail and "Speed against sync offload" in tail and "Quality:" in tail
    saved = json.loads((Path(payload["output_dir"]) / "results.json").read_text())
    assert saved["verdict"] == payload["verdict"] and len(payload["verdict"]) >= 4
    assert "## Verdict" in (Path(payload["output_dir"]) / "results.md").read_text()


def test_zenflow_is_held_to_sync_offloads_device_memory_by_default(tiny_compare, tmp_path):
    """Regression: compare ran ZenFlow with the device's free memory (1.75× synchronous offload's on the default
    task) where people offload because memory is short. By default its limit is synchronous offload's weights and
    gradients, byte for byte what the sync offload run's meter measured; --device-memory-limit-bytes free is the
    option."""
    held = tiny_compare(tiny_config(output_dir=str(tmp_path / "held"), project_hardware=("h100-80gb-pcie5",)))
    zen, sync = held["results"]["zenflow"], held["results"]["sync_offload"]
    assert zen["device_memory_limit_bytes"] == sync["peak_device_bytes"] > 0
    assert zen["peak_device_bytes"] <= zen["device_memory_limit_bytes"]
    free = tiny_compare(tiny_config(output_dir=str(tmp_path / "free"), device_memory_limit_bytes="free",
                                    project_hardware=("h100-80gb-pcie5",)))
    assert free["results"]["zenflow"]["device_memory_limit_bytes"] is None
    assert any("--device-memory-limit-bytes free" in line for line in free["verdict"])


def test_the_limit_flag_takes_sync_free_or_bytes(capsys):
    parse = lambda *flags: (  # noqa: E731
        build_parser("compare").parse_args(["compare", *flags]).device_memory_limit_bytes)
    assert parse() == "sync" and parse("--device-memory-limit-bytes", "free") == "free"
    assert parse("--device-memory-limit-bytes", "181711888") == 181711888
    with pytest.raises(SystemExit):
        parse("--device-memory-limit-bytes", "lots")
    assert '"sync", "free" or an integer >= 0' in capsys.readouterr().err


def test_few_steps_are_warned_about(tiny_compare, tmp_path, capsys):
    """Regression: `--steps 3` timed one step and printed percentiles of it without a word."""
    tiny_compare(tiny_config(output_dir=str(tmp_path / "run"), steps=3, train_size=24, quiet=False,
                             project_hardware=("h100-80gb-pcie5",)))
    out = capsys.readouterr().out
    assert (f"warning: 3 steps leave 1 timed step(s) (the first 2 are not timed): the per-step statistics (p10–p90) "
            f"and the verdict's speed interval say little; use --steps {2 + MIN_TIMED_STEPS} or more") in out


def test_a_log_line_is_written_above_the_bar_not_glued_to_it(monkeypatch: pytest.MonkeyPatch):
    """On a terminal the engine's thread-split line came while the bar was drawn and was glued to it."""
    from tqdm import tqdm

    from hf_zenflow.compare.progress import lines_above

    monkeypatch.setattr(logging.root, "handlers", [])  # (pytest's own capture handler: a program has none)
    screen = io.StringIO()
    monkeypatch.setattr(sys, "stderr", screen)
    bar = tqdm(total=4, file=screen, mininterval=0.0, ncols=80)
    with lines_above(bar):
        bar.update(1)
        logging.getLogger("hf_zenflow").warning("hf_zenflow threads: 1 core(s) for this process")
        bar.update(1)
    bar.close()
    segments = re.split(r"[\r\n]", screen.getvalue())
    (line,) = [s for s in segments if "hf_zenflow threads" in s]
    assert line.startswith("hf_zenflow threads"), screen.getvalue()


def test_the_timeline_panels_share_one_time_scale():
    """Regression: each panel of timeline.png had its own x-axis: 10.4 s and 22.8 s windows looked alike."""
    from hf_zenflow.compare.timeline import timeline_figure

    def run(end_ms: float) -> dict:
        return {"device_utilization": 0.9, "timeline": {"first_step": 2, "last_step": 7, "spans": [
            {"lane": "device", "kind": "busy", "start_ms": 0.0, "end_ms": end_ms}]}}

    fig = timeline_figure({"adamw_torch": run(10_400.0), "zenflow": run(22_800.0)}, "t")
    limits = {ax.get_xlim() for ax in fig.axes}
    assert len(limits) == 1 and limits.pop()[1] >= 22_800.0
