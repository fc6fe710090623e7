"""`compare`'s projection (`projection.project`, `run_projection`) is `estimate`'s bound model on each profile's own
host, at the run's measured selection, window and accumulation, and its table keeps sub-ms figures."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hf_zenflow.compare.projection import project, projection_table, run_projection
from hf_zenflow.estimate import host_rates
from hf_zenflow.estimate.hardware import schedule_model
from hf_zenflow.estimate.host_rates import HostRates, resolve_host
from hf_zenflow.estimate.profiles import PROFILES, HardwareProfile


PROFILE = HardwareProfile("t", device_tflops=100.0, device_mem_gb=80.0, device_mem_gbps=1000.0, link_gbps=20.0,
                          host_cores=128, host_mem_gbps=100.0, mfu=0.5)
FAKE = HostRates(cores=2, adamw_params_per_s={1: 1.0e9, 2: 1.5e9}, mem_gbps=20.0, seconds=0.1)


def _results(accumulate_on: str, selected: float = 0.12, steps: int = 40, windows: int = 8) -> dict:
    stats = {"accumulate_on": accumulate_on, "steps": steps, "windows": windows, "selected_fraction": selected}
    return {"adamw_torch": {}, "sync_offload": {}, "zenflow": {"engine_stats": stats}}


@pytest.mark.parametrize(("accumulate_on", "row"), [("host", "zenflow"), ("device", "zenflow_device_accumulation"),
                                                     ("device_bf16", "zenflow_device_bf16")])
def test_projection_is_the_bound_model_at_the_runs_measured_setting(accumulate_on: str, row: str) -> None:
    """The run's selected fraction (0.12), mean window (40 steps / 8 windows = 5) and accumulation pick the row."""
    out = project(_results(accumulate_on), 1e9, 1000, PROFILE)
    rows = schedule_model(PROFILE, 1e9, 1000, topk_ratio=0.12, update_interval=5)
    for name, key in (("adamw_torch", "no_offload"), ("sync_offload", "sync_offload"), ("zenflow", row)):
        for side in ("device_ms", "link_ms", "host_ms", "step_ms", "device_memory_gb"):
            assert out[name][side] == pytest.approx(rows[key][side])
        assert out[name]["gpu_utilization"] == pytest.approx(rows[key]["device_ms"] / rows[key]["step_ms"])
        assert out[name]["host_memory_gb"] == pytest.approx(rows[key]["host_memory_node_gb"])
    assert out["sync_offload"]["step_ms"] == pytest.approx(
        sum(out["sync_offload"][k] for k in ("device_ms", "link_ms", "host_ms")))


def test_projection_takes_the_profiles_host_not_the_runs_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run whose host side had 1 core projects onto the H100 server's 96 cores (the figures `estimate` gives for
    that profile and size), not onto 1 core."""
    monkeypatch.setattr(host_rates, "measure_host_rates", lambda: FAKE)
    cfg = SimpleNamespace(project_params=7e9, project_hardware=("h100-80gb-pcie5",), host_from_profile=False)
    results = _results("host", selected=0.1, steps=40, windows=10)
    projection = run_projection(results, 22e6, 4096, cfg, host_cores=1)
    assert "the profile's 96 core(s)" in projection["hosts"]["h100-80gb-pcie5"]
    profile, _ = resolve_host(PROFILES["h100-80gb-pcie5"], "h100-80gb-pcie5", None, False)
    assert profile.host_cores == 96
    rows = schedule_model(profile, 7e9, 4096, 0.1, 4)
    got = projection["profiles"]["h100-80gb-pcie5"]
    assert got["sync_offload"]["host_ms"] == pytest.approx(rows["sync_offload"]["host_ms"])
    assert got["zenflow"]["step_ms"] == pytest.approx(rows["zenflow"]["step_ms"])


def test_projection_table_keeps_sub_millisecond_figures() -> None:
    """A small model's projected step is a fraction of a ms: the table shows it to four figures, not 0 or 1."""
    out = project(_results("host"), 22e6, 512, PROFILES["h100-80gb-pcie5"])
    table = projection_table({"h100-80gb-pcie5": out})
    step = out["adamw_torch"]["step_ms"]
    assert step < 1.0
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()]
    header = rows[0]
    cells = dict(zip(header, next(r for r in rows if r[1] == "no offload")))
    assert cells["step ms"] == f"{step:.4g}" and float(cells["step ms"]) > 0
    zen = dict(zip(header, next(r for r in rows if r[1] == "ZenFlow")))
    assert zen["GPU util."] == f"{100 * out['zenflow']['gpu_utilization']:.1f} %"
