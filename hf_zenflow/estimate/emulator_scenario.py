"""The emulator's scenario: the full-scale figures of one hardware set-up (`EmulatorScenario`), its calibrated
presets, and the per-parameter byte counts and published host rate the emulator and the bound model share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hf_zenflow.estimate.ranks import RankSplit, check_parallel, check_ranks


#: AdamW bytes per parameter on the device: read bf16 grad + fp32 master, exp_avg, exp_avg_sq (14 B), write the
#: three fp32 tensors and the bf16 parameter (14 B).
DEVICE_ADAMW_BYTES_PER_PARAM = 28
#: bf16 gradients and parameters cross the link.
LINK_BYTES_PER_PARAM = 2

#: Host bytes per offloaded parameter: synchronous offload keeps fp32 master, gradient and two moments (16 B);
#: ZenFlow fp32 master, two moments and the window sum (16 B) plus the bf16 write-back buffer (2 B), its
#: ``stats()["host_bytes_per_param"]`` without the CUDA gradient landing slots; with bf16 window sums
#: (``accumulate_on="device_bf16"``) their bf16 landing buffer too (2 B).
HOST_BYTES_PER_PARAM = {"no_offload": 0, "sync_offload": 16, "zenflow": 18, "zenflow_device_accumulation": 18,
                        "zenflow_device_bf16": 20}

#: The published Llama-2-7B host figure: CPUAdam over 7e9 parameters in 4600 ms on 128 threads (the ZenFlow paper).
PUBLISHED_HOST_PARAMS_PER_S = 7e9 / 4.6
PUBLISHED_HOST_CORES = 128

#: Key of the per-step host-executed device-phase time in a ZenFlow row's "extra".
EXEC_KEY = "device_phases_on_host_real_ms"

#: ZenFlow's rows: the window summed on the host (the default) or on the device (``accumulate_on="device"``).
ZENFLOW_ROWS = ("zenflow", "zenflow_device_accumulation")

HEADER = "EMULATED ACCELERATOR (no GPU used): device compute = timed waits, link = paced real copies, host = real code"


@dataclass
class EmulatorScenario:
    """Full-scale figures of one hardware scenario (times in ms for the whole model, one optimizer step).

    With ``ranks`` > 1 the times still describe the whole model (on one GPU's device and link, on the whole node's
    host); the emulator runs one rank, with the share `rank_figures` gives it (module `ranks`).
    """

    name: str = "custom"
    params: float = 7e9
    forward_ms: float = 45.0
    backward_ms: float = 2000.0
    grad_offload_ms: float = 500.0  # device->host, all bf16 gradients
    param_upload_ms: float = 500.0  # host->device, all bf16 parameters
    cpu_update_ms: float | None = 4600.0  # host AdamW over the whole model; None = this machine's measured rate
    device_optimizer_ms: float | None = None  # AdamW over the whole model on the device; None = from bandwidth
    device_mem_gbps: float = 8000.0  # aggregate device memory bandwidth used for device optimizer work
    host_cores: int | None = 128  # None: this machine's cores (the measured host)
    host_from_profile: bool = False  # cpu_update_ms None: the published rate instead of this machine's measured one
    topk_ratio: float = 0.1
    update_interval: int = 4
    emulated_params: float = 100e6
    steps: int = 14
    warmup_steps: int = 2
    host_threads: int | None = None
    notes: str = ""
    ranks: int = 1  # data-parallel ranks on the node, one GPU each
    parallel: str = "ddp"  # "ddp" or "fsdp2": how the ranks split the offloaded part (module `ranks`)
    interconnect_gbps: float = 25.0  # GPU<->GPU per GPU and direction: DDP's all-gather at write-back (PCIe Gen4)

    @property
    def device_compute_ms(self) -> float:
        return self.forward_ms + self.backward_ms

    def resolved_device_optimizer_ms(self) -> float:
        if self.device_optimizer_ms is not None:
            return self.device_optimizer_ms
        return self.params * DEVICE_ADAMW_BYTES_PER_PARAM / (self.device_mem_gbps * 1e9) * 1e3

    def rank_split(self) -> RankSplit:
        check_ranks(self.ranks, "EmulatorScenario.ranks")
        check_parallel(self.parallel, "EmulatorScenario.parallel")
        gbps = self.interconnect_gbps
        if isinstance(gbps, bool) or not isinstance(gbps, (int, float)) or not 0 < gbps < float("inf"):
            raise ValueError(f"EmulatorScenario.interconnect_gbps={gbps!r} is invalid: allowed is a finite number "
                             "> 0.")
        return RankSplit(self.ranks, self.parallel)

    def rank_figures(self, cpu_update_ms: float) -> dict[str, Any]:
        """One rank's full-scale figures, given the host AdamW time of the whole model on the whole node: its
        parameters, host cores, host AdamW, link times and device optimizer time, and the all-gather of one
        write-back. With one rank these are the scenario's own figures."""
        split = self.rank_split()
        return {
            "ranks": self.ranks, "parallel": self.parallel, "interconnect_gbps": self.interconnect_gbps,
            "host_share": split.host_share, "device_share": split.device_share,
            "params_per_rank": self.params * split.host_share,
            "host_cores_per_rank": split.cores_per_rank(self.host_cores) if self.host_cores else None,
            "cpu_update_ms": split.host_ms(cpu_update_ms),
            "grad_offload_ms": self.grad_offload_ms * split.link_share,
            "param_upload_ms": self.param_upload_ms * split.link_share,
            "device_optimizer_ms": self.resolved_device_optimizer_ms() * split.device_share,
            "zenflow_host_memory_gb": self.params * split.host_share * HOST_BYTES_PER_PARAM["zenflow"] / 1e9,
            "allgather_ms_per_write_back": split.allgather_ms(self.params * LINK_BYTES_PER_PARAM,
                                                              self.interconnect_gbps),
        }


def llama2_7b_4xa100() -> EmulatorScenario:
    """The breakdown published with ZenFlow for Llama-2-7B on 4xA100 with ZeRO-Offload and CPUAdam on 128 threads
    (the ZenFlow paper): forward 45 ms, backward 2000 ms, gradient offload 500 ms, CPU update 4600 ms, upload
    500 ms."""
    return EmulatorScenario(
        name="llama2-7b-4xa100", params=7e9, forward_ms=45.0, backward_ms=2000.0, grad_offload_ms=500.0,
        param_upload_ms=500.0, cpu_update_ms=4600.0, device_mem_gbps=4 * 2000.0, host_cores=128,
        notes="published ZeRO-Offload breakdown; device optimizer time assumed = 7e9 x 28 B over 4 x 2 TB/s HBM "
              "(data-parallel ZeRO partitions: each GPU updates a quarter)",
    )


SCENARIOS = {"llama2-7b-4xa100": llama2_7b_4xa100}

