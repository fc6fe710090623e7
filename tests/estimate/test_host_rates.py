"""`estimate` projects with this host's measured AdamW rate per core on the profile's
host cores, capped by the profile's host memory bandwidth (a typical server of its class, not this machine's); a
profile's published host figure only with --host-from-profile, which reproduces the figures of the profile path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_zenflow.cli import main
from hf_zenflow.estimate import host_rates
from hf_zenflow.estimate.advice import format_schedule_model
from hf_zenflow.estimate.host_rates import TIMED_ADAMW_BYTES_PER_PARAM, HostRates
from hf_zenflow.estimate.profiles import (
    HOST_ADAMW_BYTES_PER_PARAM,
    PROFILES,
    PUBLISHED_HOST_CORES,
    PUBLISHED_HOST_PARAMS_PER_S,
)


#: The device fields a JSON profile must give.
DEVICE = {"device_tflops": 100, "device_mem_gb": 24, "device_mem_gbps": 900, "link_gbps": 25, "mfu": 0.4,
          "interconnect_gbps": 25}
FAKE = HostRates(cores=4, adamw_params_per_s={1: 1.0e9, 2: 1.8e9, 4: 3.0e9}, mem_gbps=40.0, seconds=0.1)


def _table(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| ") or line.startswith("- ")]


def _sync_host_ms(text: str) -> float:
    row = next(line for line in text.splitlines() if line.startswith("| synchronous offload"))
    return float(row.split("|")[4])


def test_host_from_profile_reproduces_the_published_figures(capsys: pytest.CaptureFixture[str]) -> None:
    """The table and advice equal the profile path's (the preset as it is, published host rate); the host AdamW
    time is 7e9 over the published per-core rate x 96 cores (below the profile's memory cap)."""
    rc = main(["estimate", "--hardware", "h100-80gb-pcie5", "--params", "7e9", "--host-from-profile"])
    assert rc == 0
    out = capsys.readouterr().out
    bound_model = out.split("### What fits")[0]
    assert _table(bound_model) == _table(format_schedule_model(PROFILES["h100-80gb-pcie5"], 7e9, 4096, 0.1, 4))
    published = 7e9 / min(PUBLISHED_HOST_PARAMS_PER_S / PUBLISHED_HOST_CORES * 96,
                          PROFILES["h100-80gb-pcie5"].host_mem_gbps * 1e9 / HOST_ADAMW_BYTES_PER_PARAM) * 1e3
    assert _sync_host_ms(out) == pytest.approx(published, abs=0.5)
    assert "Host: the profile's published figure (--host-from-profile)" in out and "the cores cap applies" in out


def test_estimate_caps_by_the_profiles_memory_not_this_machines(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Without --host-from-profile: this machine's best per-thread rate (1.0e9 here) x the profile's 96 cores, capped
    by the profile's 460.8 GB/s over 30 B per parameter, not by this machine's 84 GB/s (3.0e9 x 28 B)."""
    monkeypatch.setattr(host_rates, "measure_host_rates", lambda: FAKE)
    assert main(["estimate", "--hardware", "h100-80gb-pcie5", "--params", "7e9"]) == 0
    out = capsys.readouterr().out
    profile_cap = PROFILES["h100-80gb-pcie5"].host_mem_gbps * 1e9 / HOST_ADAMW_BYTES_PER_PARAM
    assert profile_cap < 1.0e9 * 96
    assert _sync_host_ms(out) == pytest.approx(7e9 / profile_cap * 1e3, abs=0.5)
    assert "measured on this machine (4 cores" in out and "the profile's 96 core(s)" in out
    assert "the memory cap applies" in out and "(the profile's: a typical H100 PCIe server" in out
    # this machine's bandwidth would have given 7e9 / (84e9 / 30) = 2500 ms
    assert _sync_host_ms(out) < 0.5 * 7e9 / (FAKE.effective_mem_gbps() * 1e9 / HOST_ADAMW_BYTES_PER_PARAM) * 1e3


@pytest.mark.parametrize(("flags", "rate"), [
    (["--host-memory-gbps", "60"], 60e9 / HOST_ADAMW_BYTES_PER_PARAM),  # the flag's bandwidth caps the 96 cores
    (["--host-memory-gbps", "measured"], 3.0e9 * TIMED_ADAMW_BYTES_PER_PARAM / HOST_ADAMW_BYTES_PER_PARAM),
    (["--host-cores", "2"], 1.8e9),  # the measured rate at 2 threads, under the profile's cap
    (["--host-cores", "2", "--host-memory-gbps", "measured"], 1.8e9),  # this 4-core machine's 2 cores
    (["--host-from-profile", "--host-memory-gbps", "1"], 1e9 / HOST_ADAMW_BYTES_PER_PARAM),
])
def test_host_overrides(flags: list[str], rate: float, monkeypatch: pytest.MonkeyPatch,
                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(host_rates, "measure_host_rates", lambda: FAKE)
    assert main(["estimate", "--hardware", "h100-80gb-pcie5", "--params", "7e9", *flags]) == 0
    out = capsys.readouterr().out
    assert _sync_host_ms(out) == pytest.approx(7e9 / rate * 1e3, abs=0.5)
    if "--host-memory-gbps" in flags:
        assert "--host-memory-gbps" in out.split("Host:")[1]  # the line names the cap's origin


def test_host_memory_flag_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("0", "-5", "fast"):
        with pytest.raises(SystemExit) as exc:
            main(["estimate", "--hardware", "h100-80gb-pcie5", "--host-memory-gbps", bad])
        assert exc.value.code == 2
        assert 'a number > 0 or "measured"' in capsys.readouterr().err


def test_json_profile_host_fields_win_over_the_measurement(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(host_rates, "measure_host_rates", lambda: FAKE)
    spec = tmp_path / "box.json"
    spec.write_text(json.dumps({**DEVICE, "host_cores": 16, "host_mem_gbps": 60, "host_adamw_per_core": 1e8}))
    assert main(["estimate", "--hardware", str(spec), "--params", "1e9"]) == 0
    out = capsys.readouterr().out
    assert _sync_host_ms(out) == pytest.approx(1e9 / 1.6e9 * 1e3, abs=0.5)  # 16 cores x 1e8, not the measured 3e9
    assert f"memory 60 GB/s (the profile's ({spec}))" in out
    # a JSON profile without host fields: this machine is the host (its cores, rate and measured bandwidth)
    spec.write_text(json.dumps(DEVICE))
    assert main(["estimate", "--hardware", str(spec), "--params", "1e9"]) == 0
    out = capsys.readouterr().out
    # 4 threads measured 3.0e9 at 28 B each (84 GB/s): a 30-B pass at that bandwidth reaches 2.8e9
    assert _sync_host_ms(out) == pytest.approx(1e9 / (3.0e9 * 28 / 30) * 1e3, abs=0.5)
    assert "this machine's 4 core(s)" in out and "(this machine's, measured)" in out


def test_measured_rates_interpolate_and_cap() -> None:
    assert FAKE.params_per_s(3) == pytest.approx(2.4e9)  # between the measured 2 and 4 threads
    assert FAKE.per_core() == pytest.approx(1.0e9)  # 1 thread's; at 4 threads each reaches 0.75e9
    assert FAKE.params_per_s(8) == pytest.approx(8.0e9)  # beyond: the best per-thread rate x cores
    assert FAKE.effective_mem_gbps() == pytest.approx(3.0e9 * TIMED_ADAMW_BYTES_PER_PARAM / 1e9)


def test_measure_host_rates_is_quick_and_cached() -> None:
    rates = host_rates.measure_host_rates()
    assert rates is host_rates.measure_host_rates()
    assert set(rates.adamw_params_per_s) >= {1, rates.cores}
    assert all(v > 0 for v in rates.adamw_params_per_s.values()) and rates.mem_gbps > 0
    # ZenFlow's passes timed against the AdamW: in AdamWs, and not the defaults' numbers by accident of a stub
    assert rates.window_adamws > 0 and rates.accumulate_adamws > 0 and rates.rounding_adamws > 0
    # one add, and one conversion, against a whole AdamW pass with the sum folded in
    assert max(rates.accumulate_adamws, rates.rounding_adamws) < rates.window_adamws


def test_host_profile_carries_the_measured_passes_and_the_published_host_keeps_the_defaults() -> None:
    rates = HostRates(cores=4, adamw_params_per_s={1: 1.0e9}, mem_gbps=40.0, window_adamws=1.7, accumulate_adamws=0.3,
                      rounding_adamws=0.5)
    measured = host_rates.host_profile(PROFILES["h100-80gb-pcie5"], rates, given=host_rates.PRESET_HOST_FIELDS)
    assert (measured.host_window_adamws, measured.host_accumulate_adamws, measured.host_rounding_adamws) == (
        1.7, 0.3, 0.5)
    # --host-from-profile: the published CPUAdam rate is kept, and nothing measured here is put beside it
    published = host_rates.host_profile(PROFILES["h100-80gb-pcie5"], rates,
                                        given=(*host_rates.PRESET_HOST_FIELDS, "host_adamw_per_core"))
    preset = PROFILES["h100-80gb-pcie5"]
    assert (published.host_window_adamws, published.host_accumulate_adamws, published.host_rounding_adamws) == (
        preset.host_window_adamws, preset.host_accumulate_adamws, preset.host_rounding_adamws)
