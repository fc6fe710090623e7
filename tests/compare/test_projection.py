"""`compare`'s projection (`projection.project`) by hand on round figures: a host-accumulation run and a
device-accumulation run, whose measured bytes per step are one fp32 sum per window."""

from __future__ import annotations

import pytest

from hf_zenflow.compare.projection import project
from hf_zenflow.estimate.profiles import HardwareProfile


# 1e9 projected parameters from a 1e6-parameter run (x 1000); 1000 tokens -> 120 ms of compute; link 20 GB/s; host
# AdamW 1e9 / 1.522e9 params/s = 657 ms (128 cores at the published rate, under the 100 GB/s cap).
PROFILE = HardwareProfile("t", device_tflops=100.0, device_mem_gb=80.0, device_mem_gbps=1000.0, link_gbps=20.0,
                          host_cores=128, host_mem_gbps=100.0, mfu=0.5)
ADAMW_MS = 1e9 / (7e9 / 4.6) * 1e3


def _zenflow(accumulate_on: str, bytes_per_step: float) -> dict:
    return {"bytes_to_host_per_step": bytes_per_step, "bytes_to_device_per_step": 1e6,
            "host_step_ms_mean": 10.0, "accumulate_ms_mean": 5.0,
            "engine_stats": {"accumulate_on": accumulate_on, "steps": 8, "windows": 2, "selected_fraction": 0.0}}


def test_projection_of_host_and_device_accumulation() -> None:
    # host accumulation: every step's fp32 gradient of 1e6 elements (4e6 B), bf16 on the GPU: 2e9 B / 20 GB/s =
    # 100 ms; one AdamW per 4-step window plus every step's accumulation at the measured ratio 5 / 10
    host = project({"zenflow": _zenflow("host", 4e6)}, 1e6, 1e9, 1000, PROFILE)["zenflow"]
    assert host["host_ms"] == pytest.approx(ADAMW_MS * (1 / 4 + 0.5))
    assert host["link_ms"] == pytest.approx(100.0)
    # device accumulation: one fp32 sum of 1e6 elements per window, 1e6 B per step on average; the sum stays fp32 on
    # the GPU (4e9 B / 20 GB/s = 200 ms per window); the AdamW covers all 1e9 parameters once per window, after the
    # sum has landed: (200 + 657) / 4 per step, no accumulation
    dev = project({"zenflow": _zenflow("device", 1e6)}, 1e6, 1e9, 1000, PROFILE)["zenflow"]
    assert dev["host_ms"] == pytest.approx((200 + ADAMW_MS) / 4)
    assert dev["link_ms"] == pytest.approx(max(200 / 4, 1e6 * 1000 * 2 / 4 / 20e9 * 1e3))
    assert dev["step_ms"] == pytest.approx(max(dev["device_ms"], dev["link_ms"], dev["host_ms"]))


def test_projection_of_bf16_device_sums() -> None:
    # "device_bf16": the same 1e6 hosted elements send a bf16 sum per window (half the bytes of the fp32 sum): the
    # host AdamW covers the same elements, the landing (and the link) takes half as long
    fp32 = project({"zenflow": _zenflow("device", 1e6)}, 1e6, 1e9, 1000, PROFILE)["zenflow"]
    bf16 = project({"zenflow": _zenflow("device_bf16", 0.5e6)}, 1e6, 1e9, 1000, PROFILE)["zenflow"]
    assert bf16["host_ms"] == pytest.approx((100 + ADAMW_MS) / 4)
    assert fp32["host_ms"] - bf16["host_ms"] == pytest.approx(100 / 4)
    assert bf16["device_ms"] == pytest.approx(fp32["device_ms"])
