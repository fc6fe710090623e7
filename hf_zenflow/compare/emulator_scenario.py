"""The emulator's scenario: the full-scale figures of one hardware set-up (`EmulatorScenario`), its calibrated
presets, and the per-parameter byte counts and published host rate the emulator and the bound model share."""

from __future__ import annotations

from dataclasses import dataclass


#: AdamW bytes per parameter on the device: read bf16 grad + fp32 master, exp_avg, exp_avg_sq (14 B), write the
#: three fp32 tensors and the bf16 parameter (14 B).
DEVICE_ADAMW_BYTES_PER_PARAM = 28
#: bf16 gradients and parameters cross the link.
LINK_BYTES_PER_PARAM = 2

#: The published Llama-2-7B host figure: CPUAdam over 7e9 parameters in 4600 ms on 128 threads (zenflow.md §2).
PUBLISHED_HOST_PARAMS_PER_S = 7e9 / 4.6
PUBLISHED_HOST_CORES = 128

#: Key of the per-step host-executed device-phase time in a ZenFlow row's "extra".
EXEC_KEY = "device_phases_on_host_real_ms"

#: ZenFlow's rows: the window summed on the host (the default) or on the device (``accumulate_on="device"``).
ZENFLOW_ROWS = ("zenflow", "zenflow_device_accumulation")

HEADER = "EMULATED ACCELERATOR (no GPU used): device compute = timed waits, link = paced real copies, host = real code"


@dataclass
class EmulatorScenario:
    """Full-scale figures of one hardware scenario (times in ms for the whole model, one optimizer step)."""

    name: str = "custom"
    params: float = 7e9
    forward_ms: float = 45.0
    backward_ms: float = 2000.0
    grad_offload_ms: float = 500.0  # device->host, all bf16 gradients
    param_upload_ms: float = 500.0  # host->device, all bf16 parameters
    cpu_update_ms: float | None = 4600.0  # host AdamW over the whole model; None = extrapolate from this machine
    device_optimizer_ms: float | None = None  # AdamW over the whole model on the device; None = from bandwidth
    device_mem_gbps: float = 8000.0  # aggregate device memory bandwidth used for device optimizer work
    host_cores: int | None = 128
    topk_ratio: float = 0.1
    update_interval: int = 4
    emulated_params: float = 100e6
    steps: int = 14
    warmup_steps: int = 2
    host_threads: int | None = None
    notes: str = ""

    @property
    def device_compute_ms(self) -> float:
        return self.forward_ms + self.backward_ms

    def resolved_device_optimizer_ms(self) -> float:
        if self.device_optimizer_ms is not None:
            return self.device_optimizer_ms
        return self.params * DEVICE_ADAMW_BYTES_PER_PARAM / (self.device_mem_gbps * 1e9) * 1e3


def llama2_7b_4xa100() -> EmulatorScenario:
    """The breakdown published with ZenFlow for Llama-2-7B on 4xA100 with ZeRO-Offload and CPUAdam on 128 threads
    (zenflow.md §2): forward 45 ms, backward 2000 ms, gradient offload 500 ms, CPU update 4600 ms, upload 500 ms."""
    return EmulatorScenario(
        name="llama2-7b-4xa100", params=7e9, forward_ms=45.0, backward_ms=2000.0, grad_offload_ms=500.0,
        param_upload_ms=500.0, cpu_update_ms=4600.0, device_mem_gbps=4 * 2000.0, host_cores=128,
        notes="published ZeRO-Offload breakdown; device optimizer time assumed = 7e9 x 28 B over 4 x 2 TB/s HBM "
              "(data-parallel ZeRO partitions: each GPU updates a quarter)",
    )


SCENARIOS = {"llama2-7b-4xa100": llama2_7b_4xa100}

