"""The emulated accelerator: pacing lower bounds and the structure of its results (timings are not asserted
tightly: the machine is shared and noisy)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from hf_zenflow.cli import main
from hf_zenflow.compare.emulator import (
    CopyEngine,
    DeviceClock,
    EmulatorScenario,
    PacedLink,
    emulated_model,
    format_estimate,
    run_estimate,
)


def test_paced_copy_takes_at_least_bytes_over_bandwidth() -> None:
    nbytes, bandwidth = 8 * 2**20, 1e9  # 8 MiB at 1 GB/s: >= 8.4 ms
    link = PacedLink(4 * 2**20, bandwidth)  # smaller than the copy: exercises the chunked path
    t0 = time.perf_counter()
    took = link.copy(nbytes)
    elapsed = time.perf_counter() - t0
    assert elapsed >= nbytes / bandwidth * 0.99
    assert took >= nbytes / bandwidth * 0.99
    assert link.copies == 1 and link.copy_s > 0


def test_paced_copy_counts_the_callers_own_copy() -> None:
    link = PacedLink(1024, 1e6)  # 1 MB/s: 10 kB -> 10 ms
    t0 = time.perf_counter()
    link.copy(10_000, already_spent_s=0.004)
    assert time.perf_counter() - t0 >= 0.006 * 0.99  # only the rest of the 10 ms is slept


def test_copy_engine_overlaps_the_caller() -> None:
    engine = CopyEngine(PacedLink(2**20, 1e8))  # 1 MB at 100 MB/s: 10 ms
    t0 = time.perf_counter()
    done, waited = engine.start(10**6)
    assert waited == 0.0
    assert time.perf_counter() - t0 < 0.010  # start() does not wait for the copy
    assert done.wait(5)
    assert time.perf_counter() - t0 >= 0.010 * 0.99
    engine.close()


def test_device_clock_waits_the_compressed_time() -> None:
    clock = DeviceClock(scale=10.0)
    assert clock.seconds(100.0) == pytest.approx(0.01)
    t0 = time.perf_counter()
    clock.compute(100.0)  # 100 ms full scale / 10 = 10 ms real
    assert time.perf_counter() - t0 >= 0.010 * 0.99


def test_emulated_model_is_llama_shaped_bf16() -> None:
    params, grads = emulated_model(1e6)
    assert 0.5e6 < sum(p.numel() for p in params) < 2e6
    assert {p.ndim for p in params} == {1, 2}
    assert all(g.shape == p.shape and g.dtype == p.dtype for p, g in zip(params, grads))


def test_three_schedules_measured_with_the_real_optimizers() -> None:
    sc = EmulatorScenario(name="test", params=1e8, forward_ms=10.0, backward_ms=90.0, grad_offload_ms=20.0,
                          param_upload_ms=20.0, cpu_update_ms=60.0, device_optimizer_ms=5.0, emulated_params=1e6,
                          steps=5, warmup_steps=1, update_interval=2)
    res = run_estimate(sc, progress=False)
    rows = res["results"]
    assert set(rows) == {"no_offload", "sync_offload", "zenflow", "zenflow_device_accumulation"}
    device_ms = sc.device_compute_ms + sc.resolved_device_optimizer_ms()
    # no offload = device time (a wait); never shorter, and not wildly longer even on a busy machine
    assert device_ms * 0.97 <= rows["no_offload"]["step_ms_mean"] <= device_ms * 3
    # the offloading schedules cannot beat the device compute they include (on average: device work executed on
    # the host is repaid out of the next step's compute wait, so a single step may look shorter)
    for name in ("sync_offload", "zenflow", "zenflow_device_accumulation"):
        assert rows[name]["step_ms_mean"] >= sc.device_compute_ms * 0.97
        assert len(rows[name]["per_step_ms"]) == sc.steps
    # the ZenFlow figures come from the real ZenFlowAdamW: host windows ran, columns were selected
    extra = rows["zenflow"]["extra"]
    assert extra["windows"] >= 2
    assert 0.0 < extra["selected_fraction"] < 1.0
    assert extra["host_adamw_real_ms"]
    assert extra["worker_gated_on_link"] is True
    assert extra["accumulate_real_ms"] and extra["accumulate_on"] == "host"
    # accumulate_on="device": the host worker runs only the AdamW; the window sum crosses the link once per window
    dev = rows["zenflow_device_accumulation"]["extra"]
    assert dev["accumulate_on"] == "device" and dev["windows"] >= 2
    assert dev["host_adamw_real_ms"] and not dev["accumulate_real_ms"]
    assert rows["zenflow_device_accumulation"]["link_down_ms_per_copy"] is not None
    assert rows["sync_offload"]["extra"]["host_update_real_ms"]
    assert res["time_compression"] > 0 and res["cpu_update_ms"] == 60.0
    text = format_estimate(res)
    assert "EMULATED" in text and "Assumptions" in text and "ZenFlowAdamW" in text


def test_estimate_cli_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "est.json"
    rc = main(["estimate", "--params", "1e8", "--device-step-ms", "100", "--link-gbps", "10", "--host-cores", "4",
               "--emulated-params", "1e6", "--steps", "3", "--output", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["scenario"]["name"] == "custom"
    assert "extrapolated" in res["cpu_update_source"]
    assert res["scenario"]["grad_offload_ms"] == pytest.approx(1e8 * 2 / 10e9 * 1e3)
    assert {"no_offload", "sync_offload", "zenflow", "zenflow_device_accumulation"} == set(res["results"])
