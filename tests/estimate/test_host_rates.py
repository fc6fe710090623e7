"""Issue 21 item 3: `estimate` projects with this host's measured AdamW rate and memory bandwidth; a profile's
published host figure only with --host-from-profile, which reproduces the figures of the profile path as it was."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hf_zenflow.cli import main
from hf_zenflow.estimate import host_rates
from hf_zenflow.estimate.emulator_scenario import PUBLISHED_HOST_CORES, PUBLISHED_HOST_PARAMS_PER_S
from hf_zenflow.estimate.hardware import HOST_ADAMW_BYTES_PER_PARAM, PROFILES, format_schedule_model
from hf_zenflow.estimate.host_rates import HostRates


FAKE = HostRates(cores=4, adamw_params_per_s={1: 1.0e9, 2: 1.8e9, 4: 3.0e9}, mem_gbps=40.0, seconds=0.1)


def _table(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| ") or line.startswith("- ")]


def _sync_host_ms(text: str) -> float:
    row = next(line for line in text.splitlines() if line.startswith("| synchronous offload"))
    return float(row.split("|")[4])


def test_host_from_profile_reproduces_the_published_figures(capsys: pytest.CaptureFixture[str]) -> None:
    """The table and advice equal the profile path's (the preset as it is, published host rate); the host AdamW
    time is 7e9 over the published per-core rate x 96 cores (below the 300 GB/s cap)."""
    rc = main(["estimate", "--hardware", "h100-80gb-pcie5", "--params", "7e9", "--model-only", "--host-from-profile"])
    assert rc == 0
    out = capsys.readouterr().out
    assert _table(out) == _table(format_schedule_model(PROFILES["h100-80gb-pcie5"], 7e9, 4096, 0.1, 4))
    published = 7e9 / min(PUBLISHED_HOST_PARAMS_PER_S / PUBLISHED_HOST_CORES * 96,
                          300e9 / HOST_ADAMW_BYTES_PER_PARAM) * 1e3
    assert _sync_host_ms(out) == pytest.approx(published, abs=0.5)
    assert "Host: the profile's published figure (--host-from-profile)" in out


def test_estimate_uses_the_measured_host(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Without --host-from-profile the host is this machine (a stand-in measurement here): its cores, its rate."""
    monkeypatch.setattr(host_rates, "measure_host_rates", lambda: FAKE)
    assert main(["estimate", "--hardware", "h100-80gb-pcie5", "--params", "7e9", "--model-only"]) == 0
    out = capsys.readouterr().out
    assert "measured on this machine (4 cores" in out and "host AdamW 3.00 Gparam/s on 4 core(s)" in out
    assert _sync_host_ms(out) == pytest.approx(7e9 / 3.0e9 * 1e3, abs=0.5)
    # --host-cores picks the measured rate at that many threads
    assert main(["estimate", "--hardware", "h100-80gb-pcie5", "--params", "7e9", "--model-only",
                 "--host-cores", "2"]) == 0
    assert _sync_host_ms(capsys.readouterr().out) == pytest.approx(7e9 / 1.8e9 * 1e3, abs=0.5)


def test_json_profile_host_fields_win_over_the_measurement(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(host_rates, "measure_host_rates", lambda: FAKE)
    spec = tmp_path / "box.json"
    spec.write_text(json.dumps({"device_tflops": 100, "device_mem_gb": 24, "device_mem_gbps": 900, "link_gbps": 25,
                                "host_cores": 16, "host_mem_gbps": 60, "host_adamw_per_core": 1e8}))
    assert main(["estimate", "--hardware", str(spec), "--params", "1e9", "--model-only"]) == 0
    out = capsys.readouterr().out
    assert _sync_host_ms(out) == pytest.approx(1e9 / 1.6e9 * 1e3, abs=0.5)  # 16 cores x 1e8, not the measured 3e9
    assert re.search(r"host_cores, host_mem_gbps, host_adamw_per_core kept", out)


def test_measured_rates_interpolate_and_cap() -> None:
    assert FAKE.params_per_s(3) == pytest.approx(2.4e9)  # between the measured 2 and 4 threads
    assert FAKE.params_per_s(8) == pytest.approx(6.0e9)  # beyond: the best per-thread rate x cores
    assert FAKE.effective_mem_gbps() == pytest.approx(3.0e9 * HOST_ADAMW_BYTES_PER_PARAM / 1e9)


def test_measure_host_rates_is_quick_and_cached() -> None:
    rates = host_rates.measure_host_rates()
    assert rates is host_rates.measure_host_rates()
    assert set(rates.adamw_params_per_s) >= {1, rates.cores}
    assert all(v > 0 for v in rates.adamw_params_per_s.values()) and rates.mem_gbps > 0
