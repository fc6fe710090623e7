"""Issue 21's figures of `hf-zenflow compare`: the same core split for every run, the measured device utilisation,
the timeline picture and the projection table. A tiny in-file model stands in for the real one (no assets)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_zenflow.compare.compare_config import CompareConfig
from hf_zenflow.compare.data import Batch, PreparedTask
from hf_zenflow.compare.metrics import resolve_metric
from hf_zenflow.compare.training_run import TIMING_SKIP, train_one


class SleepyClassifier(torch.nn.Module):
    """Two matrices and a head whose forward also sleeps `device_ms`: device work of a known length."""

    def __init__(self, device_ms: float = 0.0) -> None:
        super().__init__()
        self.device_ms = device_ms
        self.up = torch.nn.Linear(32, 64)
        self.down = torch.nn.Linear(64, 32)
        self.head = torch.nn.Linear(32, 2)

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        if self.device_ms:
            time.sleep(self.device_ms / 1e3)
        logits = self.head(torch.relu(self.down(torch.relu(self.up(features)))))
        return SimpleNamespace(loss=torch.nn.functional.cross_entropy(logits, labels), logits=logits)


def tiny_task(steps: int, device_ms: float = 0.0) -> PreparedTask:
    gen = torch.Generator().manual_seed(0)

    def batch() -> Batch:
        x = torch.randn(8, 32, generator=gen)
        return Batch({"features": x, "labels": (x[:, 0] > 0).long()}, 8)

    return PreparedTask(task="sequence-classification", model_name="tiny", model_path="", dataset_name="random",
                        base_model=SleepyClassifier(device_ms), tokenizer=None,
                        train_batches=[batch() for _ in range(steps)], eval_batches=[batch()],
                        train_examples=8 * steps, eval_examples=8, max_length=32,
                        metric=resolve_metric("accuracy", "sequence-classification"))


def tiny_config(**overrides) -> CompareConfig:
    values = dict(steps=12, train_size=96, batch_size=8, update_interval=2, min_offload_numel=0, log_every=0,
                  quiet=True, device="cpu", device_cores=1, host_cores=1)
    values.update(overrides)
    return CompareConfig(**values)


def test_device_utilization_of_a_known_host_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward sleeps 100 ms (device busy), the synchronous host step sleeps 50 ms per param group more (device
    waits): the measured utilisation is within 5 points of the truth, 1 - the host step's time / step (the host
    time as the injected function itself measured it: a sleep overshoots on a busy machine); adamw_torch, with no host
    step, is ~all busy."""
    import hf_zenflow.optimizer.sync_offload as baselines

    delay_s, host_s = 0.05, []
    real = baselines.fused_adamw_

    def slow_host_adamw(*args, **kwargs):
        t0 = time.perf_counter()
        time.sleep(delay_s)
        real(*args, **kwargs)
        host_s.append(time.perf_counter() - t0)

    monkeypatch.setattr(baselines, "fused_adamw_", slow_host_adamw)
    steps = 8
    task, cfg = tiny_task(steps, device_ms=100.0), tiny_config(steps=steps, train_size=8 * steps)
    sync = train_one("sync_offload", task, cfg, torch.device("cpu"))
    timed = host_s[2 * TIMING_SKIP:]  # one call per param group and step, after the untimed first steps
    truth = 1.0 - 1e3 * sum(timed) / (steps - TIMING_SKIP) / sync["step_ms_mean"]
    assert 0.3 < truth < 0.7, truth  # the two sleeps dominate the step: a mid-range figure
    assert abs(sync["device_utilization"] - truth) <= 0.05, (sync["device_utilization"], truth)
    base = train_one("adamw_torch", task, cfg, torch.device("cpu"))
    assert base["device_utilization"] >= 0.95
    for r in (sync, base):
        assert r["cores"]["device"] == 1 and r["cores"]["host"] == 1 and r["cores"]["training_threads"] == 1
    # the timeline window holds the device's waits for the host step and the host's busy spans
    lanes = {(s["lane"], s["kind"]) for s in sync["timeline"]["spans"]}
    assert {("device", "busy"), ("device", "wait"), ("host", "busy"), ("link", "copy")} <= lanes
    assert sync["timeline"]["first_step"] == TIMING_SKIP


def test_compare_run_same_cores_timeline_and_projection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole `compare` on the tiny model: every run has the same core split in results.json, a measured device
    utilisation, timeline.png is written, and results.md holds the projection table (labelled projected) with its
    method, for the named model size."""
    from hf_zenflow.compare import runner
    from hf_zenflow.estimate.host_rates import HostRates

    monkeypatch.setattr(runner, "prepare_task", lambda **kwargs: tiny_task(kwargs["steps"]))
    monkeypatch.setattr("hf_zenflow.estimate.host_rates.measure_host_rates",
                        lambda: HostRates(cores=2, adamw_params_per_s={1: 1e9, 2: 1.5e9}, mem_gbps=20.0))
    cfg = tiny_config(output_dir=str(tmp_path / "run"), project_params=7e9,
                      project_hardware=("h100-80gb-pcie5", "a100-80gb-pcie4"))
    payload = runner.run_compare(cfg)
    out = Path(payload["output_dir"])
    saved = json.loads((out / "results.json").read_text())
    splits = [r["cores"] for r in saved["results"].values()]
    assert len(splits) == 3 and all((s["device"], s["host"]) == (1, 1) for s in splits)
    assert all(s["training_threads"] == 1 for s in splits)
    assert saved["results"]["sync_offload"]["cores"]["host_threads"] == 1
    assert saved["results"]["zenflow"]["cores"]["host_threads"] == 1
    for r in saved["results"].values():
        assert 0.0 <= r["device_utilization"] <= 1.0
    assert (out / "timeline.png").stat().st_size > 1000
    md = (out / "results.md").read_text()
    assert "Cores: device = 1 core(s)" in md and "| device utilisation" in md
    assert saved["run_order"] == {"order": "interleaved", "why": saved["run_order"]["why"], "block_steps": 8}
    assert "Run order: interleaved (auto on a CPU device" in md
    assert "## Projected to GPU hardware (not measured)" in md and "7B parameters" in md
    assert "| step ms" in md and "| h100-80gb-pcie5 | ZenFlow" in md and "Projected, not measured" in md
    proj = saved["projection"]["profiles"]["h100-80gb-pcie5"]
    assert set(proj) == {"adamw_torch", "sync_offload", "zenflow"}
    # the synchronous schedule is the sum of its sides; ZenFlow's the slowest side
    sync, zen = proj["sync_offload"], proj["zenflow"]
    assert sync["step_ms"] == pytest.approx(sync["device_ms"] + sync["link_ms"] + sync["host_ms"])
    assert zen["step_ms"] == pytest.approx(max(zen["device_ms"], zen["link_ms"], zen["host_ms"]))


def test_trainer_telemetry_reports_the_device_utilization() -> None:
    """The Trainer's zenflow/device_utilization: 1 - the steps' device waits (handoff, wait, writeback, inline host
    update; not norms or the device update) / their wall time; a step without a wall time is left out."""
    from hf_zenflow.hf.trainer_telemetry import ZenFlowTelemetry

    t = ZenFlowTelemetry()
    t.record({"cp_wait_ms": 90.0}, None)  # the first step: no wall time known
    t.record({"cp_wait_ms": 30.0, "cp_handoff_ms": 10.0, "cp_norms_ms": 5.0, "cp_device_update_ms": 5.0}, 100.0)
    t.record({"cp_writeback_ms": 20.0, "cp_host_update_ms": 20.0}, 100.0)
    assert t.pop_interval()["zenflow/device_utilization"] == pytest.approx(1 - 80 / 200)
    t.record({"cp_wait_ms": 0.0}, 50.0)
    assert t.pop_interval()["zenflow/device_utilization"] == pytest.approx(1.0)
    assert t.run_summary()["zenflow/device_utilization"] == pytest.approx(1 - 80 / 250)
