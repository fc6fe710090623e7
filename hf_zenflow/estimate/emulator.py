"""EMULATED accelerator: measure the end-to-end step time of no-offload AdamW, synchronous offload and ZenFlow on a
machine without a GPU. This is an emulation, and every figure it prints says so.

What is real and what is emulated
---------------------------------
* **Host side: real.** `SyncOffloadAdamW` and `ZenFlowAdamW` run unchanged on a scaled-down bf16 model whose
  parameters are CPU tensors (fp32 masters and moments on the host, as on a GPU machine). The host AdamW, the
  gradient accumulation, ZenFlow's background worker, its window hand-over and every stall the caller sees are real
  work on this machine's cores.
* **Device compute: emulated** as `time.sleep` (a wait that occupies no host core, as a GPU kernel would not) of the
  configured forward+backward time, plus the device's optimizer work (no-offload: the whole AdamW; ZenFlow: the
  selected columns and 1-D parameters), modelled as bytes moved / device memory bandwidth.
* **Host<->device link: emulated** as a real memory copy of the bytes the optimizer moves, paced (copy, then sleep
  the rest of bytes / bandwidth). ZenFlow's per-step gradient download runs on a separate "copy engine" thread that
  overlaps the next step's compute, as a CUDA side stream would, and the host worker does not fold a gradient in
  before its copy has landed (the engine's CUDA path waits on an event the same way). ZenFlow's write-back of the
  host result runs on the device timeline (the engine enqueues it on the compute stream).
* **Device-side optimizer work executed on the host.** The parameters are CPU tensors, so ZenFlow's device phases
  (gradient norms, column selection, the selected-column AdamW) execute on this CPU, where they are ~100x slower
  than on a GPU. Their measured time (the engine's own phase timers) is taken out of the step and their modelled
  device time put in. While they execute, the host worker keeps running, so it gets that much extra overlap per
  step; the JSON keeps the per-step executed time (``device_phases_on_host_real_ms``) and the unadjusted step times
  so the size of that bias can be checked.

Time scaling
------------
The host work runs on `emulated_params` parameters instead of the full model. One calibration step measures the
host AdamW on them (the `host_update` phase of `SyncOffloadAdamW`); the time-compression factor is
``s = full-model CPU update ms / measured host AdamW ms``. Every modelled time (compute, links, device optimizer) is
divided by ``s`` for the real waits, and every measured wall time is multiplied by ``s`` when reported. This assumes
all host work (AdamW, accumulation, copies) scales linearly with the parameter count, and it scales fixed per-step
costs (Python overhead, thread hand-offs) by ``s`` as well, which makes the offloading schedules look *slower*, never
faster; the default of 1e8 emulated parameters keeps the factor near 30 (at 24e6 it was 50-150 and ~1.5 ms of
per-step Python overhead became ~100 ms "full scale"). The copy pacing needs real copies to be at least as fast as
the scaled link. When one is slower (this host is small and shared), the step is accounted with the scenario's link
time instead of the real copy time, for every schedule alike, and the table reports the real per-copy time next to
the target.
Several ranks
-------------
With ``ranks`` > 1 (``estimate --ranks N``) the process emulates ONE of N data-parallel ranks on the node (module
`ranks`): the real host code stands for 1/N of the offloaded parameters, on 1/N of the node's host cores and memory
bandwidth (so the scaled host AdamW keeps the whole-node time), each paced link carries 1/N of the bytes, and under
DDP every write-back is followed by a timed wait for the all-gather of the updated rows on the modelled interconnect.

Where the code lives: `emulator_scenario` (the figures of one set-up and the shared byte counts), `emulator_device`
(the device clock, the paced link, the copy engine, the scaled-down model), `emulator_schedules` (the three schedules
and `run_estimate`), `emulator_report` (`format_estimate`), `emulator_cli` (the `estimate` flags and the run), `ranks`
(the split among ranks). This module keeps every public name importable from one place.
"""

from __future__ import annotations

from hf_zenflow.estimate.emulator_cli import (
    add_estimate_arguments,
    add_hardware_arguments,
    estimate_from_args,
    scenario_from_args,
    scenario_from_profile,
)
from hf_zenflow.estimate.emulator_device import CopyEngine, DeviceClock, PacedLink, emulated_model
from hf_zenflow.estimate.emulator_report import format_estimate
from hf_zenflow.estimate.emulator_scenario import (
    DEVICE_ADAMW_BYTES_PER_PARAM,
    EXEC_KEY,
    HEADER,
    LINK_BYTES_PER_PARAM,
    PUBLISHED_HOST_CORES,
    PUBLISHED_HOST_PARAMS_PER_S,
    SCENARIOS,
    ZENFLOW_ROWS,
    EmulatorScenario,
    llama2_7b_4xa100,
)
from hf_zenflow.estimate.emulator_schedules import run_estimate


__all__ = ["DEVICE_ADAMW_BYTES_PER_PARAM", "EXEC_KEY", "HEADER", "LINK_BYTES_PER_PARAM", "PUBLISHED_HOST_CORES",
           "PUBLISHED_HOST_PARAMS_PER_S", "SCENARIOS", "ZENFLOW_ROWS", "CopyEngine", "DeviceClock", "EmulatorScenario",
           "PacedLink", "add_estimate_arguments", "add_hardware_arguments", "emulated_model", "estimate_from_args",
           "format_estimate", "llama2_7b_4xa100", "run_estimate", "scenario_from_args", "scenario_from_profile"]
