"""The hardware bound model behind `hf-zenflow estimate` and `tune`'s modelled speed-up: hand-computed per-side times,
the named bound, the setting that moves it, profile validation, and the estimate table's columns."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from hf_zenflow.cli import main
from hf_zenflow.estimate import memory
from hf_zenflow.estimate.advice import advice, format_schedule_model
from hf_zenflow.estimate.hardware import (
    AUTO_ROWS,
    activation_gb,
    auto_accumulation,
    interval_to_unbind,
    schedule_model,
    zenflow_host_passes,
)
from hf_zenflow.estimate.profiles import ACCUMULATE_VS_ADAMW, PROFILES, HardwareProfile, load_profile
from hf_zenflow.transport.ring import RING_BYTES


@pytest.fixture(autouse=True)
def gradients_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hand-computed device figures below are of an engine that keeps every gradient until the step (whatever
    `memory.GRADIENTS_FREED_IN_BACKWARD` says the engine does; `test_fits.py` covers both)."""
    monkeypatch.setattr(memory, "GRADIENTS_FREED_IN_BACKWARD", False)


# Round numbers: 1e9 params, 1000 tokens -> 6e12 FLOPs at 100 TFLOP/s x 0.5 = 120 ms of compute; link 2 GB / 20 GB/s
# = 100 ms per direction; host: 128 cores x 7e9/4.6/128 params/s -> an AdamW's core work 657 ms; 100 GB/s of host
# memory -> 10 ms per byte per parameter.
PROFILE = HardwareProfile("t", device_tflops=100.0, device_mem_gb=80.0, device_mem_gbps=1000.0, link_gbps=20.0,
                          host_cores=128, host_mem_gbps=100.0, mfu=0.5)
ADAMW_CORE_MS = 1e9 / (7e9 / 4.6) * 1e3


def _host_acc_window_ms(adamw_ms: float, ms_per_byte: float) -> float:
    """ZenFlow's host passes of a U=4 window summed on the host, by hand: each pass the longer of its core work and
    its bytes; bytes per parameter: the first accumulation lands a bf16 gradient (2), reads it (2), writes the fp32
    sum (4); the next two also read the sum (+4); the AdamW pass lands and reads the last gradient (2 + 2), reads the
    sum (4), reads and writes master and moments (16: the default bf16 moments), and the write-back copy reads its
    bf16 buffer (2); the rounding into that buffer reads 4 and writes 2."""
    acc = ACCUMULATE_VS_ADAMW * adamw_ms
    return (max(acc, 8 * ms_per_byte) + 2 * max(acc, 12 * ms_per_byte) + max(adamw_ms, 26 * ms_per_byte)
            + 6 * ms_per_byte)


#: The host state's rules with a write-back buffer that the worker rounds the master into (the defaults read the
#: master at the write-back instead, on one rank).
BUFFER = {"host_writeback": "buffer"}


def test_schedule_model_matches_hand_computed_times() -> None:
    rows = schedule_model(PROFILE, params=1e9, tokens_per_step=1000, topk_ratio=0.1, update_interval=4,
                          host_state=BUFFER)
    host_adamw = ADAMW_CORE_MS  # core-bound: 30 B x 10 ms = 300 ms of memory traffic is less
    assert rows["no_offload"]["step_ms"] == pytest.approx(120 + 28.0)  # + 28 B/param at 1 TB/s
    assert rows["sync_offload"]["step_ms"] == pytest.approx(120 + 200 + host_adamw)
    assert rows["sync_offload"]["host_limit"] == "cores"
    zen = rows["zenflow"]
    # U - 1 accumulations per window (the last step's gradient is folded into the host AdamW's pass), the AdamW, the
    # rounding (60 ms of memory traffic, no core work counted): 3 x 355 + 657 + 60 = 1782 ms per window
    assert zen["host_ms"] == pytest.approx(_host_acc_window_ms(host_adamw, 10.0) / 4)
    assert zen["host_ms"] == pytest.approx((3 * 0.54 * host_adamw + host_adamw + 60) / 4)
    # the chain the write-back waits for: the last gradient lands (100 ms), then the AdamW and the rounding
    assert zen["host_chain_ms"] == pytest.approx(100 + host_adamw + 60)
    assert zen["link_ms"] == pytest.approx(100)
    assert zen["device_ms"] == pytest.approx(120 + 0.1 * 28 + 2 + 100 / 4)  # + grad read + write-back per window
    assert zen["step_ms"] == max(zen["device_ms"], zen["link_ms"], zen["host_ms"]) and zen["bound"] == "host"
    dev = rows["zenflow_device_accumulation"]
    # device sums: the host step waits for them to land (2 x 100 ms) before its 657 + 60 ms: the chain over the
    # window is longer than the work (717 ms), so it sets the host side
    assert dev["host_work_ms"] == pytest.approx((host_adamw + 60) / 4)
    assert dev["host_chain_ms"] == pytest.approx(200 + host_adamw + 60)
    assert dev["host_ms"] == pytest.approx((200 + host_adamw + 60) / 4)
    assert dev["link_ms"] == pytest.approx(2 * 100 / 4)
    # device: + the window sum (10 B/param at 1 TB/s) each step; the next window's first add waits for the 200 ms copy
    # of the sums to have read them, 80 ms after the 120 ms forward+backward, once per window
    assert dev["device_ms"] == pytest.approx(120 + 0.1 * 28 + 2 + 100 / 4 + 10 + 80 / 4)
    assert dev["device_memory_gb"] == pytest.approx(zen["device_memory_gb"] + 4.0)
    # bf16 weights and gradients (held until the step) and the selected tenth's state and gathered gradient
    assert zen["device_memory_gb"] == pytest.approx(4.0 + 0.1 * memory.SELECTED_BYTES, abs=1e-9)
    assert rows["no_offload"]["device_memory_gb"] == pytest.approx(16.0) and rows["no_offload"]["fits_device_memory"]
    # the defaults: the rounding (60 ms) runs on the training thread at the write-back, filling the ring's chunks
    # while the link copies them (100 ms): off the host's work and chain, hidden under the link on the device
    master = schedule_model(PROFILE, params=1e9, tokens_per_step=1000, topk_ratio=0.1, update_interval=4)
    assert master["zenflow"]["host_ms"] == pytest.approx((3 * 0.54 * host_adamw + host_adamw) / 4)
    assert master["zenflow"]["host_chain_ms"] == pytest.approx(100 + host_adamw)
    assert master["zenflow"]["device_ms"] == pytest.approx(zen["device_ms"])
    assert master["zenflow_device_accumulation"]["host_ms"] == pytest.approx((200 + host_adamw) / 4)


def test_a_profiles_measured_passes_set_zenflows_host_core_work() -> None:
    """The window pass, the accumulation and the rounding cost the profile's `host_window_adamws`,
    `host_accumulate_adamws` and `host_rounding_adamws` AdamWs (this machine's engine measured against its fused
    AdamW), not fixed constants; a pass's memory traffic still bounds it from below."""
    from dataclasses import replace

    slow = replace(PROFILE, host_window_adamws=1.7, host_accumulate_adamws=0.1, host_rounding_adamws=0.5)
    zen = schedule_model(slow, params=1e9, tokens_per_step=1000, topk_ratio=0.1, update_interval=4,
                         host_state=BUFFER)["zenflow"]
    adamw = ADAMW_CORE_MS  # 657 ms: an accumulation's 0.1 of it (66 ms) is under its bytes (80, then 120 ms)
    assert zen["host_ms"] == pytest.approx((80 + 2 * 120 + 1.7 * adamw + 0.5 * adamw) / 4)
    assert zen["host_chain_ms"] == pytest.approx(100 + 1.7 * adamw + 0.5 * adamw)


def test_a_profile_refuses_a_negative_pass_cost_and_takes_a_rounding_without_core_work() -> None:
    assert HardwareProfile("t", host_rounding_adamws=0.0).host_rounding_adamws == 0.0
    with pytest.raises(ValueError, match=r"host_rounding_adamws=-0.1 is invalid: allowed is a finite number >= 0"):
        HardwareProfile("t", host_rounding_adamws=-0.1)
    with pytest.raises(ValueError, match=r"host_window_adamws=0.0 is invalid: allowed is a finite number > 0"):
        HardwareProfile("t", host_window_adamws=0.0)


def test_host_passes_take_the_profiles_memory_bandwidth_when_it_binds() -> None:
    """At 10 GB/s (100 ms per byte per parameter) every pass is memory-bound: sync offload's AdamW moves 30 B; the
    window (device sums, bf16 moments) 22 B in the AdamW pass and, with a write-back buffer, 6 B in the rounding,
    after 200 ms of landing; with fp32 moments 30 B in the AdamW pass. The defaults round on the training thread at
    the write-back instead: 600 ms there (a buffer's copy: 400 ms), longer than the link's 100 ms, on the device's
    timeline."""
    from dataclasses import replace

    slow = replace(PROFILE, host_mem_gbps=10.0)
    defaults = schedule_model(slow, 1e9, 1000, 0.1, 4)["zenflow_device_accumulation"]
    assert defaults["host_ms"] == pytest.approx((200 + 2200) / 4)
    rows = schedule_model(slow, 1e9, 1000, 0.1, 4, host_state=BUFFER)
    # (the buffer's copy into the chunks, 4 B per element: 400 ms, itself longer than the link's copy)
    assert defaults["device_ms"] - rows["zenflow_device_accumulation"]["device_ms"] == pytest.approx((600 - 400) / 4)
    assert rows["sync_offload"]["host_ms"] == pytest.approx(3000.0) and rows["sync_offload"]["host_limit"] == "memory"
    dev = rows["zenflow_device_accumulation"]
    assert dev["host_ms"] == pytest.approx((200 + 2200 + 600) / 4) and dev["host_limit"] == "memory"
    fp32 = schedule_model(slow, 1e9, 1000, 0.1, 4, host_moments="float32",
                          host_state=BUFFER)["zenflow_device_accumulation"]
    assert fp32["host_ms"] == pytest.approx((200 + 3000 + 600) / 4)
    assert rows["zenflow"]["host_ms"] == pytest.approx(_host_acc_window_ms(ADAMW_CORE_MS, 100.0) / 4)
    assert slow.host_limit() == "memory" and PROFILE.host_limit() == "cores"


def test_host_pass_bytes_count_every_read_and_write() -> None:
    """Bytes per parameter per window: a one-step window on the host reads only its gradient (2 + 2 landed), never
    a sum; longer ones write the sum first, then add into it."""
    def total(u: int, on_device: bool) -> float:
        return sum(n * b for _, n, _, b in zenflow_host_passes(u, on_device))

    # master and moments read and written: 4 + 4 (fp32 master) + 8 (the default bf16 moments)
    assert total(1, False) == 2 + 2 + 16 + 2 + 6
    assert total(2, False) == 8 + (2 + 2 + 4 + 16 + 2) + 6
    assert total(4, False) == 8 + 2 * 12 + 26 + 6
    assert total(4, True) == total(1, True) == 4 + 16 + 2 + 6
    # fp32 moments: 8 B more each way, int8 codes and their scales 2 + 2 / 256 each way
    for moments, state in (("float32", 24), ("int8", 8 + 4 * (1 + 4 / 256))):
        assert sum(n * b for _, n, _, b in zenflow_host_passes(4, True, host_moments=moments)) == pytest.approx(
            4 + state + 2 + 6)
    # core work: U - 1 accumulations and one AdamW per window; the rounding only moves bytes
    assert sum(n * c for _, n, c, _ in zenflow_host_passes(4, False)) == pytest.approx(3 * ACCUMULATE_VS_ADAMW + 1)


def test_bound_moves_to_the_device_with_a_longer_window() -> None:
    u = interval_to_unbind(PROFILE, 1e9, 1000, 0.1, "device")
    assert u is not None
    assert schedule_model(PROFILE, 1e9, 1000, 0.1, u)["zenflow_device_accumulation"]["bound"] == "device"
    if u > 1:
        assert schedule_model(PROFILE, 1e9, 1000, 0.1, u // 2)["zenflow_device_accumulation"]["bound"] != "device"
    # U=8: the host's chain (200 + 657 + 60 ms) / 8 = 115 ms < the device's 157 ms; at U=4 its 229 ms exceed 180 ms
    assert u == 8
    # host accumulation costs 0.54 AdamW every step whatever the window: 355 ms here, never device-bound
    assert interval_to_unbind(PROFILE, 1e9, 1000, 0.1, "host") is None


def test_advice_names_the_bound_and_the_setting_that_moves_it() -> None:
    text = " ".join(advice(PROFILE, 1e9, 1000))
    assert "host-bound" in text and 'accumulate_on="device"' in text
    small = " ".join(advice(PROFILES["a100-80gb-pcie4"], 1e8, 4096))
    assert small.startswith("No offload needed")  # 1.6 GB of state fits 80 GB


def test_profiles_validate_and_load_from_json(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"HardwareProfile\.link_gbps=0 is invalid"):
        HardwareProfile(link_gbps=0)
    with pytest.raises(ValueError, match=r"HardwareProfile\.mfu=1\.5"):
        HardwareProfile(mfu=1.5)
    path = tmp_path / "box.json"
    path.write_text(json.dumps({**DEVICE, "host_cores": 8, "host_mem_gbps": 40}))
    prof = load_profile(str(path))
    assert prof.name == "box" and prof.link_gbps == 12
    path.write_text(json.dumps({"device_tflop": 50}))
    with pytest.raises(ValueError, match="unknown key"):
        load_profile(str(path))
    with pytest.raises(ValueError, match="neither a preset"):
        load_profile("no-such-box")


#: The device fields a JSON profile must give (round figures).
DEVICE = {"device_tflops": 50, "device_mem_gb": 16, "device_mem_gbps": 500, "link_gbps": 12, "mfu": 0.4,
          "interconnect_gbps": 12}


def test_estimate_hardware(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["estimate", "--hardware", "a100-40gb-pcie4", "--params", "7e9", "--host-from-profile"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Bound model (not a measurement)" in out and "| ZenFlow, U=4" in out
    assert "Offload needed" in out and "bound" in out


# The same round profile with a 50 GB/s interconnect: an all-gather of the 2 GB of bf16 weights takes (N-1)/N x 40 ms.
# Host AdamW 1e9 / 1.522e9 params/s = 657 ms is core-bound; at 30 GB/s of host memory it is bandwidth-bound:
# 1e9 / (30e9 / 30) = 1000 ms.
RANK_PROFILE = HardwareProfile("t", device_tflops=100.0, device_mem_gb=80.0, device_mem_gbps=1000.0, link_gbps=20.0,
                               host_cores=128, host_mem_gbps=100.0, mfu=0.5, interconnect_gbps=50.0)
HOST_ADAMW_MS = 1e9 / (7e9 / 4.6) * 1e3


@pytest.mark.parametrize(("ranks", "host_ms", "link_ms", "allgather_ms", "host_gb"), [
    (1, HOST_ADAMW_MS, 100.0, 0.0, 15.8),
    (2, HOST_ADAMW_MS, 50.0, 20.0, 7.9),
    (4, HOST_ADAMW_MS, 25.0, 30.0, 3.95),
    (8, HOST_ADAMW_MS, 12.5, 35.0, 1.975),
])
@pytest.mark.parametrize("host_mem_gbps", [100.0, 30.0])
def test_per_rank_figures_scale_as_documented(ranks: int, host_ms: float, link_ms: float, allgather_ms: float,
                                              host_gb: float, host_mem_gbps: float) -> None:
    """Issue 13 item 6: one rank's host work and memory are 1/N, on 1/N of the node's cores and memory bandwidth, so
    its host time stays the whole-node figure (core- or bandwidth-bound alike); its link carries 1/N; DDP adds an
    all-gather per write-back on the device timeline, FSDP2 none and a 1/N device-side update."""
    from dataclasses import replace

    profile = replace(RANK_PROFILE, host_mem_gbps=host_mem_gbps)
    host_ms = host_ms if host_mem_gbps == 100.0 else 1000.0
    u = 4
    ddp = schedule_model(profile, 1e9, 1000, 0.1, u, ranks=ranks, host_state=BUFFER)
    sync, zen, dev = ddp["sync_offload"], ddp["zenflow"], ddp["zenflow_device_accumulation"]
    assert sync["host_ms"] == pytest.approx(host_ms)  # not 1/N faster: the ranks share the node's host
    # the same passes on 1/N of the host: the whole-node figure, core- or bandwidth-bound pass by pass
    assert zen["host_ms"] == pytest.approx(_host_acc_window_ms(HOST_ADAMW_MS, 1e3 / host_mem_gbps) / u)
    assert sync["link_ms"] == pytest.approx(2 * link_ms) and zen["link_ms"] == pytest.approx(link_ms)
    assert dev["link_ms"] == pytest.approx(2 * link_ms / u)
    assert sync["allgather_ms"] == pytest.approx(allgather_ms)
    assert zen["allgather_ms"] == pytest.approx(allgather_ms / u)
    # device: compute 120 + replicated selected-column AdamW 2.8 + gradient read 2 + write-back and all-gather once
    # per window; the write-back lasts the longer of the link's copy and the host's fill of the ring's chunks from
    # the buffer (1/N of 4 B per element at 1/N of the host's memory bandwidth)
    writeback_ms = max(link_ms, 4e3 / host_mem_gbps)
    assert zen["device_ms"] == pytest.approx(120 + 2.8 + 2 + (writeback_ms + allgather_ms) / u)
    assert sync["device_ms"] == pytest.approx(120 + allgather_ms)
    # (each rank's share, and the rings its gradients and its write-back cross, a fixed 128 MiB each)
    ring_gb = 2 * RING_BYTES / 1e9
    assert zen["host_memory_gb"] == pytest.approx(host_gb + ring_gb)
    assert sync["host_memory_gb"] == pytest.approx(16 / ranks)
    assert zen["host_memory_node_gb"] == pytest.approx(15.8 + ranks * ring_gb)  # the node holds all ranks' shares
    # DDP replicates weights, grads, the selected state
    assert zen["device_memory_gb"] == pytest.approx(4.0 + 0.1 * memory.SELECTED_BYTES)
    fsdp = schedule_model(profile, 1e9, 1000, 0.1, u, ranks=ranks, parallel="fsdp2", host_state=BUFFER)
    assert fsdp["zenflow"]["allgather_ms"] == 0.0 and fsdp["sync_offload"]["host_ms"] == pytest.approx(host_ms)
    assert fsdp["zenflow"]["device_ms"] == pytest.approx(120 + (2.8 + 2) / ranks + writeback_ms / u)  # all sharded
    # the defaults: each FSDP2 rank writes back its whole share from the master, rounding it (6 B per element) into
    # the ring's chunks as the link copies them
    fsdp = schedule_model(profile, 1e9, 1000, 0.1, u, ranks=ranks, parallel="fsdp2")
    rounding_ms = max(link_ms, 6e3 / host_mem_gbps)
    assert fsdp["zenflow"]["device_ms"] == pytest.approx(120 + (2.8 + 2) / ranks + rounding_ms / u)
    assert fsdp["no_offload"]["device_memory_gb"] == pytest.approx(16.0 / ranks)


def test_one_rank_is_todays_model_and_table() -> None:
    rows = schedule_model(RANK_PROFILE, 1e9, 1000, 0.1, 4)
    assert schedule_model(RANK_PROFILE, 1e9, 1000, 0.1, 4, ranks=1, parallel="fsdp2") == rows  # no split at N=1
    assert all(r["allgather_ms"] == 0.0 for r in rows.values())
    text = format_schedule_model(RANK_PROFILE, 1e9, 1000)
    assert "Ranks:" not in text and "Per rank" not in text
    assert ("| schedule | device ms/step | link ms/step | host ms/step | step ms | bound | vs sync offload | "
            "device memory GB (no activations) | host memory GB (node) | host passes limited by |\n") in text


def test_several_ranks_table_and_advice() -> None:
    text = format_schedule_model(RANK_PROFILE, 1e9, 1000, ranks=8)
    assert "Ranks: 8 DDP ranks" in text and "host passes limited by | all-gather ms/step (in device) |" in text
    assert "Per rank: 16 of the node's 128 host cores" in text and f"takes {HOST_ADAMW_MS:.0f} ms" in text
    assert f"each rank would take {8 * HOST_ADAMW_MS:.0f} ms" in text
    assert "35 ms per write-back at 50 GB/s" in text
    with pytest.raises(ValueError, match=r"ranks=0 is invalid: allowed is an integer >= 1"):
        schedule_model(RANK_PROFILE, 1e9, 1000, ranks=0)


def test_interconnect_defaults_and_json(tmp_path: Path) -> None:
    assert HardwareProfile().interconnect_gbps == 25.0
    assert PROFILES["a100-40gb-pcie4"].interconnect_gbps == PROFILES["a100-40gb-pcie4"].link_gbps
    assert PROFILES["h100-80gb-sxm5-nvlink"].interconnect_gbps > 5 * PROFILES["h100-80gb-pcie5"].interconnect_gbps
    path = tmp_path / "nvl.json"
    path.write_text(json.dumps({**DEVICE, "interconnect_gbps": 300}))
    assert load_profile(str(path)).interconnect_gbps == 300
    with pytest.raises(ValueError, match=r"HardwareProfile\.interconnect_gbps=0 is invalid"):
        HardwareProfile(interconnect_gbps=0)


def test_estimate_cli_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    # the profile's own host (128 cores), split among the ranks
    rc = main(["estimate", "--hardware", "a100-80gb-sxm4-nvlink", "--params", "7e9", "--ranks", "8",
               "--host-from-profile"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Ranks: 8 DDP ranks" in out and "Per rank: 16 of the node's 128 host cores" in out
    for bad in ("0", "-2", "1.5", "two"):
        with pytest.raises(SystemExit) as exc:
            main(["estimate", "--hardware", "a100-40gb-pcie4", "--ranks", bad])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "argument --ranks" in err and "is invalid: allowed is an integer >= 1" in err and bad in err


def _fastest_that_fits(profile: HardwareProfile, params: float, tokens: float) -> str:
    """By hand: the place of the fastest ZenFlow row whose device state plus activations fits 90 % of the device and
    whose host state fits 90 % of the RAM (the smallest device state among rows within 1 % of that speed)."""
    rows = schedule_model(profile, params, tokens)
    act = activation_gb(params, tokens)
    fitting = {p: rows[r] for p, r in AUTO_ROWS.items()
               if rows[r]["device_memory_gb"] + act <= 0.9 * profile.device_mem_gb
               and rows[r]["host_memory_node_gb"] <= 0.9 * profile.host_mem_gb}
    fastest = min(r["step_ms"] for r in fitting.values())
    return min((p for p, r in fitting.items() if r["step_ms"] <= 1.01 * fastest),
               key=lambda p: fitting[p]["device_memory_gb"] + fitting[p]["host_memory_node_gb"])


def test_auto_accumulation_takes_the_fastest_schedule_that_fits() -> None:
    """1e9 params on PROFILE (the published host rate: the host is the bound): device sums skip the host's
    accumulation passes, so they are the fastest where they fit, bf16 ones most (the write-back waits for the sums'
    landing, half as long in bf16: 100 + 60 ms of widening against 200 ms); 8 GB of device memory less 10 % holds
    neither the fp32 sums nor the bf16 sums (weights + gradients 4 GB + selected columns 1.4 GB + sums 4 or 2 GB,
    plus activations): the host sums, which fit."""
    fits = auto_accumulation(PROFILE, 1e9, 1000)
    assert fits["state_gb"] == pytest.approx(6.0 + 0.1 * memory.SELECTED_BYTES)
    assert fits["limit_gb"] == pytest.approx(72.0)
    assert fits["activations_gb"] == pytest.approx(activation_gb(1e9, 1000))
    assert fits["choice"] == _fastest_that_fits(PROFILE, 1e9, 1000) == "device_bf16"
    small = replace(PROFILE, name="s", device_mem_gb=8.0)
    assert auto_accumulation(small, 1e9, 1000)["choice"] == _fastest_that_fits(small, 1e9, 1000) == "host"
    # 7B: about hidden 4096 and 32 layers (the size formula gives 4210 and 32.9); 4096 tokens -> 4096 x 4096 x
    # (64 + 34) bytes, within the formula's 5%
    assert activation_gb(7e9, 4096) == pytest.approx(4096 * 4096 * 98 / 1e9, rel=0.05)
    text = format_schedule_model(PROFILE, 1e9, 1000)
    assert 'accumulate_on="device_bf16" = the default ("auto")' in text
    assert 'accumulate_on="auto" (the default) chooses "device_bf16"' in text
    assert 'accumulate_on="auto" (the default) chooses "host"' in format_schedule_model(small, 1e9, 1000)


def test_auto_takes_host_sums_where_the_host_keeps_up_and_device_sums_where_its_ram_is_short() -> None:
    """A host whose passes keep up with forward and backward (a server's memory bandwidth, this package's per-core
    rate): host sums are the fastest (the device adds nothing), though device sums fit the device; with the host's
    RAM too short for host sums (21.8 B per parameter on a GPU at this size: five pinned landing slots) but not for
    device sums (14), device sums."""
    fast = replace(PROFILES["h100-80gb-pcie5"], host_adamw_per_core=1e9)
    rows = schedule_model(fast, 7e9, 4096)
    assert rows["zenflow"]["step_ms"] < rows["zenflow_device_accumulation"]["step_ms"]
    assert auto_accumulation(fast, 7e9, 4096)["choice"] == _fastest_that_fits(fast, 7e9, 4096) == "host"
    short = replace(fast, host_mem_gb=16 * 7 / 0.9)  # 16 B/param of 7e9 within 90 %
    assert auto_accumulation(short, 7e9, 4096)["choice"] == _fastest_that_fits(short, 7e9, 4096) == "device"


def test_auto_accumulation_takes_bf16_device_sums_when_only_they_fit() -> None:
    """Between the two needs (fp32 sums 9.4 GB, bf16 sums 7.4 GB, plus activations) "auto" keeps bf16 sums on the
    device: the sum crosses in bf16 (half the link time: 100 ms per window), the host's AdamW (657 ms) reads it as
    it is (the rounding, 60 ms, at the write-back on the training thread), and the device holds 2 B/param less."""
    act = activation_gb(1e9, 1000)
    mid = HardwareProfile("m", device_tflops=100.0, device_mem_gb=(8.6 + act) / 0.9, device_mem_gbps=1000.0,
                          link_gbps=20.0, host_cores=128, host_mem_gbps=100.0, mfu=0.5)
    auto = auto_accumulation(mid, 1e9, 1000)
    assert auto["choice"] == "device_bf16" and auto["state_gb"] == pytest.approx(6.0 + 0.1 * memory.SELECTED_BYTES)
    rows = schedule_model(mid, 1e9, 1000)
    dev, bf16 = rows["zenflow_device_accumulation"], rows["zenflow_device_bf16"]
    assert bf16["link_ms"] == pytest.approx(dev["link_ms"] / 2) == pytest.approx(100 / 4)
    assert bf16["host_chain_ms"] == pytest.approx(100 + ADAMW_CORE_MS)
    assert dev["device_memory_gb"] - bf16["device_memory_gb"] == pytest.approx(2.0)
    # the window's pass reads the landed bf16 sum as it is (2 B), no widening pass before it
    passes = {on: zenflow_host_passes(4, on_device=True, bf16_sums=on) for on in (False, True)}
    assert [name for name, *_ in passes[True]] == ["window AdamW", "write-back rounding"]
    assert passes[False][0][3] - passes[True][0][3] == 2
    text = format_schedule_model(mid, 1e9, 1000)
    assert 'accumulate_on="device_bf16" = the default ("auto")' in text
    assert 'chooses "device_bf16": the fastest schedule that fits' in text and "7.4 GB on the device" in text
