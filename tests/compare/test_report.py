"""The compare report: one ratio convention, named statistics, the busy-machine check and its warnings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hf_zenflow.compare import machine_load, report
from hf_zenflow.compare.machine_load import CpuReading, LoadReport, cpu_seconds, load_between, take_reading


def _result(step_ms: float, opt_median: float, opt_mean: float, accuracy: float, to_device: float) -> dict:
    return {"eval_accuracy": accuracy, "eval_loss": 0.5, "train_loss": 0.5, "step_ms": step_ms,
            "steps_per_s": 1e3 / step_ms, "opt_step_ms_median": opt_median, "opt_step_ms_mean": opt_mean,
            "opt_step_ms_p10": opt_median * 0.9, "opt_step_ms_p90": opt_median * 1.5,
            "engine_critical_path_ms_mean": None, "forward_backward_ms_mean": 700.0, "clip_ms_mean": 3.0,
            "other_ms_mean": 0.3, "host_step_ms_mean": None, "flush_ms": 0.0, "bytes_to_host_per_step": to_device,
            "bytes_to_device_per_step": to_device, "optimizer_state_device_bytes": 1 << 20,
            "optimizer_state_host_bytes": 0, "peak_device_memory_bytes": None, "host_rss_peak_bytes": 1 << 30,
            "machine_load": {"others_cores": 0.05, "steal_fraction": 0.0, "cores": 2, "busy": False}}


def test_every_ratio_is_zenflow_over_baseline_of_a_cost() -> None:
    results = {"sync_offload": _result(800.0, 55.0, 56.0, 0.787, 90e6),
               "zenflow": _result(760.0, 15.0, 18.0, 0.783, 45e6)}
    rat = report.ratios(results)["zenflow_vs_sync_offload"]
    assert rat["step_ms_ratio"] == pytest.approx(760 / 800)  # faster ZenFlow -> below 1, like every time ratio
    assert rat["opt_step_ms_median_ratio"] == pytest.approx(15 / 55)
    assert rat["opt_step_ms_mean_ratio"] == pytest.approx(18 / 56)
    assert rat["bytes_to_device_per_step_ratio"] == pytest.approx(0.5)
    assert rat["eval_accuracy_delta_points"] == pytest.approx(-0.4)
    assert not any(key.startswith("steps_per_s") for key in rat)  # no ratio that points the other way
    table = report.comparison_table(results, report.ratios(results), "accuracy", cuda=False, headline=True)
    assert "| ÷ sync offload |" in table.splitlines()[0].replace("  ", "")
    row = next(line for line in table.splitlines() if line.startswith("| ms per step, whole run (steps/s)"))
    assert "760 (1.32/s)" in row and "0.95×" in row
    assert "-0.40 pts" in table and "85.8 MiB" in table and "42.9 MiB" in table


def test_mean_and_median_disagreement_is_called_out() -> None:
    # the run under load: 0.841x by the mean, 0.196x by the median
    noisy = {"zenflow_vs_sync_offload": {"opt_step_ms_mean_ratio": 0.841, "opt_step_ms_median_ratio": 0.196}}
    quiet = {"zenflow_vs_sync_offload": {"opt_step_ms_mean_ratio": 0.330, "opt_step_ms_median_ratio": 0.273}}
    notes = report.disagreement_notes(noisy)
    assert len(notes) == 1 and "0.84×" in notes[0] and "0.20×" in notes[0]
    assert report.disagreement_notes(quiet) == []


def test_busy_reasons_and_warning() -> None:
    quiet = LoadReport(seconds=60, cores=2, others_cores=0.05, steal_fraction=0.001, loadavg_before=0.4,
                       loadavg_max=2.5)  # 2.5: this run's own threads; not a reason
    assert quiet.busy_reasons() == []
    busy = LoadReport(seconds=60, cores=2, others_cores=1.5, steal_fraction=0.05, loadavg_before=4.0, loadavg_max=6)
    reasons = busy.busy_reasons()
    assert len(reasons) == 3 and "1.50 of the 2 cores" in reasons[0] and "5.0 % of the CPU time" in reasons[1]
    assert report.busy_warning([], {"zenflow": quiet.to_dict()}) is None
    warning = report.busy_warning(reasons, {"sync_offload": quiet.to_dict(), "zenflow": busy.to_dict()})
    assert warning.startswith("WARNING: the machine was busy") and "sync offload 0.05; ZenFlow 1.50" in warning
    # runs that took turns share one load figure: the warning says the load met them alike, not "one after the other"
    shared = report.busy_warning(reasons, {"sync_offload": busy.to_dict(), "zenflow": busy.to_dict()}, True)
    assert "took turns" in shared and "one after the other" not in shared and "one after the other" in warning
    # one disturbed run is enough: the ratios compare runs
    assert report.busy_warning([], {"sync_offload": quiet.to_dict(), "zenflow": busy.to_dict()}) is not None
    per_run = {"sync_offload": quiet.to_dict(), "zenflow": busy.to_dict()}
    banner = report.busy_banner({"busy_reasons": [], "cores": 2}, per_run)
    assert banner.startswith("BUSY MACHINE") and "sync offload 0.05, ZenFlow 1.50" in banner
    assert report.busy_banner({"busy_reasons": [], "cores": 2}, {"zenflow": quiet.to_dict()}) is None


def test_load_between_subtracts_this_process() -> None:
    a = CpuReading(wall=0.0, busy_s=100.0, total_s=400.0, steal_s=1.0, own_s=50.0, loadavg_1m=1.0)
    b = CpuReading(wall=10.0, busy_s=118.0, total_s=420.0, steal_s=2.0, own_s=63.0, loadavg_1m=2.0)
    r = load_between(a, b, cores=2, loadavg_max=3.0)
    assert r.others_cores == pytest.approx((18.0 - 13.0) / 10.0)
    assert r.steal_fraction == pytest.approx(1.0 / 20.0)
    assert r.loadavg_max == 3.0 and r.loadavg_before is None


def test_cpu_seconds_count_only_the_allowed_cpus() -> None:
    first = cpu_seconds([0])  # (read first: every counter only grows)
    every = cpu_seconds(None)
    assert every is not None and first is not None and all(0 <= part <= whole for part, whole in zip(first, every))
    assert every[0] <= every[1] and every[2] <= every[1]  # busy and steal are parts of the total
    assert cpu_seconds([10_000]) is None  # no such CPU


def test_another_process_cpu_time_is_counted_as_others() -> None:
    """A child that burns 1 s of CPU (its own process time, however long that takes on a shared machine) shows up
    as other processes' CPU; this process's own time does not."""
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0:\n    pass\n"
    start = take_reading()
    subprocess.run([sys.executable, "-c", burn], check=True)
    end = take_reading()
    others_s = (end.busy_s - start.busy_s) - (end.own_s - start.own_s)
    assert others_s >= 0.9, others_s  # jiffy accounting; other machine users only add to it


def test_monitor_reports_over_an_interval(tmp_path: Path) -> None:
    monitor = machine_load.LoadMonitor(interval_s=0.01)
    monitor.start()
    since = monitor.reading()
    sum(i * i for i in range(200_000))
    part = monitor.report(since)
    whole = monitor.whole_run()
    monitor.stop()
    assert part.cores == whole.cores >= 1 and part.seconds <= whole.seconds
    assert part.loadavg_before is None  # an interval inside the run: the load average would count this run
    assert whole.others_cores is not None and whole.others_cores >= 0.0
