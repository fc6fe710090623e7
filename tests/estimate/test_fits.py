"""What fits: the device and host memory of each schedule in the bound model, against the engine's own byte counts;
the largest model each schedule trains (`max_params`) against the `--params` rows at that size; and `estimate`'s
inputs, each checked before any work."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from hf_zenflow.cli import main
from hf_zenflow.engine.host import GRAD_SLOTS
from hf_zenflow.estimate import host_rates
from hf_zenflow.estimate.fits import FIT_SCHEDULES, PARAMS_PRECISION, fit_row, max_params
from hf_zenflow.estimate.hardware import AUTO_ROWS, activation_gb, schedule_model
from hf_zenflow.estimate.host_rates import HostRates
from hf_zenflow.estimate.memory import (
    SELECTED_BYTES,
    device_memory_gb,
    in_flight_gradient_gb,
    zenflow_host_bytes_per_param,
)
from hf_zenflow.estimate.profiles import PROFILES, HardwareProfile
from hf_zenflow.estimate.ranks import RankSplit
from tests.conftest import zenflow_adamw


FAKE = HostRates(cores=4, adamw_params_per_s={1: 1.0e9, 2: 1.8e9, 4: 3.0e9}, mem_gbps=40.0, seconds=0.1)
H100 = PROFILES["h100-80gb-pcie5"]


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine's host rates, fixed (the measurement is the only thing that varies)."""
    monkeypatch.setattr(host_rates, "measure_host_rates", lambda: FAKE)


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any measurement of the host (the first work `estimate` does) fails the test."""
    def refuse() -> HostRates:
        raise AssertionError("the host was measured before the inputs were checked")

    monkeypatch.setattr(host_rates, "measure_host_rates", refuse)


def test_device_bytes_per_param_with_gradients_held_and_freed() -> None:
    """bf16 weights (2) + gradients (2) held until the step + the selected tenth's state and gathered gradient; freed
    in backward, only the gradients in flight remain (a few of the largest matrices: well under 0.1 B/param at 7B).
    The largest model ZenFlow trains on one 80 GB device grows by more than 1.4x."""
    n = 7e9
    held = device_memory_gb("zenflow", n, 0.1, gradients_freed_in_backward=False) * 1e9 / n
    freed = device_memory_gb("zenflow", n, 0.1, gradients_freed_in_backward=True) * 1e9 / n
    assert held == pytest.approx(2 + 2 + 0.1 * SELECTED_BYTES)
    assert freed == pytest.approx(2 + 0.1 * SELECTED_BYTES + in_flight_gradient_gb(n) * 1e9 / n)
    assert 0 < in_flight_gradient_gb(n) * 1e9 / n < 0.1
    before = max_params(H100, "zenflow", 4096, gradients_freed_in_backward=False)
    after = max_params(H100, "zenflow", 4096, gradients_freed_in_backward=True)
    assert before["limited_by"] == after["limited_by"] == "device memory"
    assert after["params"] >= 1.4 * before["params"]
    # synchronous offload and no offload do not depend on the setting
    for schedule in ("no_offload", "sync_offload"):
        assert device_memory_gb(schedule, n, gradients_freed_in_backward=True) == device_memory_gb(schedule, n)


def test_zenflow_defaults_hold_at_most_3_5_bytes_per_param_on_the_device(tmp_path: Path, measured: None) -> None:
    """13B on `h100-80gb-pcie5`, the defaults (gradients freed in backward, window summed on the host): the
    selected columns' gradient is counted in bf16, as the engine gathers a bf16 model's (14 B per selected element
    with the fp32 state), which keeps ZenFlow's device under 3.5 B/param; with an fp32 gather it was above."""
    from hf_zenflow.engine.accumulation import selected_bytes

    assert SELECTED_BYTES == selected_bytes(torch.bfloat16) == selected_bytes(torch.float32) - 2
    n = 13e9
    row = _estimate_json(tmp_path, "13b", "--params", repr(n))["what_fits"]["zenflow"]
    per_param = row["device_memory_gb"] * 1e9 / n
    assert row["accumulate_on"] == "host"
    assert per_param <= 3.5 < per_param + 0.1 * 2


def test_gradients_freed_where_the_engine_frees_them() -> None:
    """The default follows the engine: one process and FSDP2 ranks (each its shards) free the gradients in backward
    with the window summed on the host; DDP ranks (the reducer's buckets hold a whole gradient for the run) and
    device sums keep them."""
    n = 7e9
    for ranks, parallel, sum_bytes, freed in [(1, "ddp", 0, True), (4, "fsdp2", 0, True), (4, "ddp", 0, False),
                                              (1, "ddp", 4, False), (4, "fsdp2", 4, False)]:
        split = RankSplit(ranks=ranks, parallel=parallel)
        assert device_memory_gb("zenflow", n, 0.1, sum_bytes, split=split) == device_memory_gb(
            "zenflow", n, 0.1, sum_bytes, gradients_freed_in_backward=freed, split=split), (ranks, parallel, sum_bytes)
    fsdp = RankSplit(ranks=4, parallel="fsdp2")
    assert device_memory_gb("zenflow", n, 0.1, split=fsdp) == pytest.approx(
        (2 + 0.1 * SELECTED_BYTES) * n / 4 / 1e9 + in_flight_gradient_gb(n, 0.25))


@pytest.mark.parametrize("moments", ["float32", "bfloat16"])
def test_host_bytes_per_param_are_the_engines(moments: str) -> None:
    """The model's host bytes per offloaded parameter (window summed on the host, over every column) less what a GPU
    adds, the landing slots (`GRAD_SLOTS` bf16 gradients), are what a real ZenFlowAdamW on a bf16 CPU model holds
    (``stats()["host_bytes_per_param"]``, measured from its host tensors): ``"auto"`` reads the master on either."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 48).to(torch.bfloat16)) for _ in range(3)]
    opt = zenflow_adamw(params, lr=1e-3, topk_ratio=0.25, update_interval=2, min_offload_numel=0,
                        accumulate_on="host", host_moment_dtype=moments, overlap_step=False, host_sum_columns="all")
    try:
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        measured = opt.stats()["host_bytes_per_param"]
    finally:
        opt.close()
    modelled = zenflow_host_bytes_per_param(0, moments, host_sum_columns="all")
    assert modelled - GRAD_SLOTS * 2 == pytest.approx(measured)


def test_int8_moments_take_a_quarter_of_fp32_plus_their_block_scales() -> None:
    assert zenflow_host_bytes_per_param(0, "float32") - zenflow_host_bytes_per_param(0, "int8") == pytest.approx(
        2 * (4 - 1 - 4 / 256))
    with pytest.raises(ValueError, match=r"host_moment_dtype='fp8' is invalid: allowed is \"float32\" \| "):
        zenflow_host_bytes_per_param(0, "fp8")


def _estimate_json(tmp_path: Path, name: str, *flags: str) -> dict:
    out = tmp_path / f"{name}.json"
    assert main(["estimate", "--hardware", "h100-80gb-pcie5", *flags, "--output", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("flags", [(), ("--host-mem-gb", "128"), ("--ranks", "4", "--parallel", "fsdp2")])
def test_max_params_agree_with_params_runs_at_that_size(flags: tuple[str, ...], tmp_path: Path, measured: None,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Each schedule's largest model in `--max-params` fits in a `--params N` run at that size, with the same device
    and host GB and step time; a model larger by twice the search's precision does not fit, on the side it names."""
    largest = _estimate_json(tmp_path, "max", "--max-params", *flags)["max_params"]
    assert set(largest) == set(FIT_SCHEDULES)
    limits = set()
    for schedule, row in largest.items():
        at = _estimate_json(tmp_path, "at", "--params", repr(row["params"]), *flags)["what_fits"][schedule]
        assert at["fits"] and at["fits_device_memory"] and at["fits_host_memory"]
        for key in ("device_memory_gb", "host_memory_node_gb", "step_ms", "accumulate_on"):
            assert at[key] == pytest.approx(row[key]) if key != "accumulate_on" else at[key] == row[key]
        above = _estimate_json(tmp_path, "above", "--params", repr(row["params"] * (1 + 2 * PARAMS_PRECISION)),
                               *flags)["what_fits"][schedule]
        assert not above["fits"]
        final = row["limited_by"].split(", ")[-1]  # (what the row the planner takes above it overflows)
        side = "fits_device_memory" if final.startswith("device memory") else "fits_host_memory"
        assert not above[side]
        limits.add(row["limited_by"])
    text = capsys.readouterr().out
    assert "### The largest model each schedule trains on `h100-80gb-pcie5`" in text
    if "--host-mem-gb" in flags:
        # 128 GB of RAM: the host limits the offloading schedules, and a smaller host state fits larger models (the
        # defaults keep the moments in bf16); the defaults and the lean state both reach the size where bf16 device
        # sums, the smallest host state, no longer fit the device
        # (the planner leaves bf16 device sums there for host sums: each place's limit is named)
        assert {largest[s]["limited_by"].split(", ")[-1].split(" with ")[0]
                for s in FIT_SCHEDULES if s != "no_offload"} == {"host memory"}
        for schedule in ("zenflow", "zenflow_lean"):
            assert largest[schedule]["limited_by"] == ("device memory (activations counted) with bf16 device sums, "
                                                       "host memory with host sums")
        assert (largest["zenflow_fp32"]["params"] < largest["zenflow"]["params"]
                <= largest["zenflow_lean"]["params"])
    elif not flags:
        assert limits == {"device memory"}  # 1 TB of RAM: the device limits every schedule


def test_what_fits_table_and_json(tmp_path: Path, measured: None, capsys: pytest.CaptureFixture[str]) -> None:
    """`--params` prints one set of ratios (the bound model's, no second model) and the memory table; its JSON
    holds the same rows as `fit_row` on the resolved profile."""
    payload = _estimate_json(tmp_path, "fits", "--params", "7e9")
    out = capsys.readouterr().out
    assert "EMULATED" not in out and "### What fits: 7.00B parameters on `h100-80gb-pcie5`" in out
    ratios = set(re.findall(r"ZenFlow with the defaults: [0-9.]+ ms/step, [0-9.]+ GB on the device, \w+-bound, "
                            r"([0-9.]+)x faster", out))
    row = payload["what_fits"]["zenflow"]
    assert ratios == {f"{row['speedup_vs_sync']:.2f}"}
    assert f"| {row['speedup_vs_sync']:.2f}x faster |" in out
    from hf_zenflow.estimate.profiles import HardwareProfile

    again = fit_row(HardwareProfile(**payload["profile"]), "zenflow", 7e9, 4096)
    assert again["accumulate_on"] == row["accumulate_on"]
    for key in ("device_memory_gb", "host_memory_node_gb", "step_ms", "device_ms", "host_ms"):
        assert again[key] == pytest.approx(row[key])


def test_the_default_row_is_the_fastest_schedule_that_fits(tmp_path: Path, measured: None,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`--params 7e9` on h100-80gb-pcie5: the row marked as the default is, of ZenFlow's three, the fastest whose
    device state and activations fit 90 % of the device and whose host state fits 90 % of the RAM: the window summed
    on the host (device-bound, nothing added on the device), not the device sums that also fit (slower by their
    per-step add on the device, and 40 GB more device memory)."""
    payload = _estimate_json(tmp_path, "default", "--params", "7e9")
    out = capsys.readouterr().out
    profile = HardwareProfile(**payload["profile"])
    rows = schedule_model(profile, 7e9, 4096)
    act = activation_gb(7e9, 4096)
    fitting = {place: rows[row] for place, row in AUTO_ROWS.items()
               if rows[row]["device_memory_gb"] + act <= 0.9 * profile.device_mem_gb
               and rows[row]["host_memory_node_gb"] <= 0.9 * profile.host_mem_gb}
    chosen = payload["what_fits"]["zenflow"]["accumulate_on"]
    assert set(fitting) == {"host", "device", "device_bf16"}
    assert rows[AUTO_ROWS[chosen]]["step_ms"] == min(r["step_ms"] for r in fitting.values())
    assert chosen == "host"
    marked = [line for line in out.splitlines() if '= the default ("auto")' in line]
    assert len(marked) == 1 and "(window summed on the host)" in marked[0]


def test_host_ram_defaults(tmp_path: Path, measured: None) -> None:
    """A preset's host RAM is its typical server's; a JSON profile without host_mem_gb takes this machine's; the flag
    wins over both."""
    preset = _estimate_json(tmp_path, "preset", "--params", "1e9")
    assert preset["profile"]["host_mem_gb"] == H100.host_mem_gb == 1024
    spec = tmp_path / "box.json"
    spec.write_text(json.dumps({"device_tflops": 100, "device_mem_gb": 24, "device_mem_gbps": 900, "link_gbps": 25,
                                "mfu": 0.4, "interconnect_gbps": 25}))
    out = tmp_path / "box_out.json"
    assert main(["estimate", "--hardware", str(spec), "--params", "1e9", "--output", str(out)]) == 0
    assert json.loads(out.read_text())["profile"]["host_mem_gb"] == pytest.approx(host_rates.this_machine_ram_gb())
    flag = _estimate_json(tmp_path, "flag", "--params", "1e9", "--host-mem-gb", "128")
    assert flag["profile"]["host_mem_gb"] == 128
    assert flag["what_fits"]["sync_offload"]["fits_host_memory"]  # 16 GB of 115
    tight = _estimate_json(tmp_path, "tight", "--params", "1e9", "--host-mem-gb", "17")
    assert not tight["what_fits"]["sync_offload"]["fits_host_memory"]  # 16 GB of 15.3


def test_unwritable_output_is_refused_before_any_work(tmp_path: Path, no_work: None,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """`estimate --output` under a file (no folder can be made there): one line, exit 2, nothing measured."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for flags in (["--params", "7e9"], ["--max-params"]):
        assert main(["estimate", *flags, "--output", str(blocker / "out.json")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--output" in err and "is not a folder" in err
    assert main(["estimate", "--output", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_profile_file_with_missing_fields_is_refused_naming_them(tmp_path: Path, no_work: None,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A JSON profile without mfu and interconnect_gbps: refused, naming both, before any work (no defaults)."""
    spec = tmp_path / "box.json"
    spec.write_text(json.dumps({"device_tflops": 100, "device_mem_gb": 24, "device_mem_gbps": 900, "link_gbps": 25}))
    assert main(["estimate", "--hardware", str(spec), "--params", "1e9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing field(s) mfu, interconnect_gbps" in err
    # with --host-from-profile the host figures cannot come from this machine: those are required too
    spec.write_text(json.dumps({"device_tflops": 100, "device_mem_gb": 24, "device_mem_gbps": 900, "link_gbps": 25,
                                "mfu": 0.4, "interconnect_gbps": 25, "host_cores": 8}))
    assert main(["estimate", "--hardware", str(spec), "--host-from-profile"]) == 2
    assert "missing field(s) host_mem_gbps, host_mem_gb" in capsys.readouterr().err
    spec.write_text("{not json")
    assert main(["estimate", "--hardware", str(spec)]) == 2
    assert "not a readable JSON file" in capsys.readouterr().err


def test_flags_that_do_not_go_together(no_work: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--max-params", "--device-step-ms", "900"]) == 2
    assert "--device-step-ms is invalid with --max-params" in capsys.readouterr().err
    assert main(["estimate", "--ranks", "2", "--parallel", "fsdp2", "--interconnect-gbps", "100"]) == 2
    assert "--interconnect-gbps is invalid with --parallel fsdp2" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["estimate", "--max-params", "--params", "7e9"])
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
