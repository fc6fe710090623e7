"""The memory side of the bound model: what each schedule holds on the device and on the host, per parameter of a
bf16 model, and the limits it must fit in.

* device (`device_memory_gb`): bf16 weights (2) and, where AdamW runs on the device, its fp32 master and moments (12);
  synchronous offload keeps every bf16 gradient until the step (2); ZenFlow keeps the selected columns' fp32 state
  and their gradient gathered in bf16 (`SELECTED_BYTES`, 14 per selected element), the window sums when they are on
  the device, and either every bf16 gradient until the step or, with ``gradients_freed_in_backward``, only the
  gradients in flight to the host (`in_flight_gradient_gb`). Counted against `DEVICE_MEMORY_HEADROOM` of the device;
  activations are not counted there (`activation_gb` estimates them for ``accumulate_on="auto"``);
* host (`zenflow_host_bytes_per_param`): per offloaded parameter, what the engine allocates on a GPU for the host
  state's rules (``host_moment_dtype``, ``host_sum_dtype``, ``host_sum_columns``, ``host_writeback``: a ``host_state``
  preset's, `preset_layout`; the default's unless given), counted by the engine's own rule (`engine.host_footprint`):
  the fp32 master (4), the two moments (fp32 8, bf16 4, int8 2 plus one fp32 scale per `INT8_BLOCK` elements of each),
  the window sum where it is host memory (fp32 4, bf16 2; with ``host_sum_columns="unselected"`` only the columns not
  on the device), the write-back buffer (bf16, 2, unless it is written back from the master), with the window summed on
  the host the landing slots of the in-flight gradients, `engine.host.grad_slots` x 2: 2 slots, or ``writeback_lag`` +
  1 with a later write-back, `engine.writeback_lag.planned_writeback_steps`; with device sums the accumulator they land
  in, fp32 4 or bf16 2; all ordinary memory), plus the transport's fixed pinned bytes once per rank
  (`Transport.fixed_host_bytes`: the rings the write-back and the device sums or the gradients cross,
  `transport.ring`); synchronous offload `SYNC_HOST_BYTES_PER_PARAM`. Every rank of a node holds its share;
  together they must fit `HOST_MEMORY_HEADROOM` of the node's RAM.

Example:
    >>> round(device_memory_gb("zenflow", 7e9, 0.1, gradients_freed_in_backward=False) / 7, 2)  # GB per 1e9 params
    5.4
"""

from __future__ import annotations

import torch

from hf_zenflow.engine.accumulation import selected_bytes
from hf_zenflow.engine.host import GRAD_SLOTS, HostLayout
from hf_zenflow.engine.host_footprint import host_bytes_per_element
from hf_zenflow.engine.in_flight import in_flight_count
from hf_zenflow.engine.step_model import BF16_BYTES, FP32_BYTES, INT8_BLOCK, MOMENT_BYTES, SUM_BYTES
from hf_zenflow.estimate.ranks import RankSplit
from hf_zenflow.settings.config import ZenFlowConfig
from hf_zenflow.settings.rules import host_state_rules
from hf_zenflow.transport import CudaTransport


HOST_MOMENT_DTYPES = tuple(MOMENT_BYTES)
#: The engine's host-state rules (`EngineRules`) that the host memory counts.
HOST_STATE_RULES = ("host_moment_dtype", "host_sum_dtype", "host_sum_columns", "host_writeback")


def preset_layout(host_state: str) -> dict[str, str]:
    """`HOST_STATE_RULES` as the preset ``host_state`` resolves them, by the engine's own function
    (`settings.rules.host_state_rules`).

    Example:
        >>> preset_layout("lean")["host_moment_dtype"]
        'int8'
    """
    rules = host_state_rules(host_state)
    return {name: rules[name] for name in HOST_STATE_RULES}


#: What "ZenFlow, the defaults" (``host_state="auto"``) holds on the host.
DEFAULT_HOST_STATE: dict[str, str] = preset_layout("auto")
DEFAULT_HOST_MOMENTS: str = DEFAULT_HOST_STATE["host_moment_dtype"]
#: The GPU transport whose buffers the host memory counts (made, never used: no GPU is needed).
GPU_TRANSPORT = CudaTransport()
#: Device bytes per parameter of a bf16 model: the weight and its gradient; fp32 master and moments where AdamW runs
#: on the device.
WEIGHT_BYTES = GRADIENT_BYTES = BF16_BYTES
DEVICE_BYTES_ADAM_STATE = 12
#: ZenFlow's device bytes per selected element of a bf16 model: fp32 master and moments (12) and the gradient
#: gathered in its own dtype (2), as the engine keeps them (`engine.accumulation.selected_bytes`).
SELECTED_BYTES = selected_bytes(torch.bfloat16)
#: Fraction of the device memory counted as usable for weights, gradients and optimizer state (the rest is left for
#: activations, the allocator and the runtime, which the model does not count).
DEVICE_MEMORY_HEADROOM = 0.9
#: Fraction of the node's RAM counted as usable for the offloaded optimizer state (the rest is left for the operating
#: system, the training processes, the data loader and the page cache, which the model does not count).
HOST_MEMORY_HEADROOM = 0.9
#: Synchronous offload's host bytes per offloaded parameter (`optimizer.sync_offload`): fp32 master, fp32 gradient
#: and the two fp32 moments.
SYNC_HOST_BYTES_PER_PARAM = 16
#: Whether ZenFlow's engine frees each offloaded matrix's device gradient in backward, once its unselected part is
#: on its way to the host (``free_gradients_in_backward``), where it applies: one process per node, or FSDP2 ranks
#: (each frees its shards), with the window summed on the host (device sums keep each gradient until `step()`); not
#: DDP, whose reducer keeps a whole gradient's buckets allocated for the run. The default of
#: ``gradients_freed_in_backward``; False models every gradient held until the step.
GRADIENTS_FREED_IN_BACKWARD = True


def host_layout(host_moments: str | None = None, host_state: dict[str, str] | None = None) -> dict[str, str]:
    """The host-state rules of a schedule: the defaults' (`DEFAULT_HOST_STATE`), with `host_state` (some of
    `HOST_STATE_RULES`, e.g. a preset's `preset_layout`) and `host_moments` (``host_moment_dtype``) over them; each
    value checked as the engine's rules check it (`ZenFlowConfig.with_rules`)."""
    values = {**DEFAULT_HOST_STATE, **(host_state or {})}
    if host_moments is not None:
        values["host_moment_dtype"] = host_moments
    unknown = sorted(set(values) - set(HOST_STATE_RULES))
    if unknown:
        raise ValueError(f"host_state {unknown} is invalid: allowed are {', '.join(HOST_STATE_RULES)}.")
    ZenFlowConfig().with_rules(**values)  # (a value the rules refuse is refused here, by name)
    return values


def zenflow_host_bytes_per_param(sum_bytes: int = 0, host_moment_dtype: str = DEFAULT_HOST_MOMENTS,
                                 host_sum_dtype: str = DEFAULT_HOST_STATE["host_sum_dtype"],
                                 host_sum_columns: str = DEFAULT_HOST_STATE["host_sum_columns"],
                                 host_writeback: str = DEFAULT_HOST_STATE["host_writeback"],
                                 topk_ratio: float = 0.1, slots: int = GRAD_SLOTS, ranks: int = 1) -> float:
    """ZenFlow's host memory per offloaded parameter of a bf16 model on a GPU: the engine's own count
    (`engine.host_footprint.host_bytes_per_element` over `GPU_TRANSPORT`) for device sums of `sum_bytes` per element
    (0: the window summed on the host) and the host state's settings (a `topk_ratio` share of the columns on the
    device), with `slots` hand-off slots (`engine.host.grad_slots`: one landing buffer each where the window is summed
    on the host) and the host state shared by `ranks` ranks (DDP's: they write back through buffers).

    Example:
        >>> zenflow_host_bytes_per_param(0), zenflow_host_bytes_per_param(4), zenflow_host_bytes_per_param(0, "int8")
        (18.0, 14.0, 16.03125)
        >>> zenflow_host_bytes_per_param(0, "int8", host_sum_dtype="bfloat16")
        14.03125
    """
    config = ZenFlowConfig().with_rules(host_moment_dtype=host_moment_dtype, host_sum_dtype=host_sum_dtype,
                                        host_sum_columns=host_sum_columns, host_writeback=host_writeback)
    place = {value: key for key, value in SUM_BYTES.items()}[sum_bytes]
    return host_bytes_per_element(HostLayout.of(config), place, torch.bfloat16, torch.bfloat16, GPU_TRANSPORT,
                                  ranks=ranks, device_share=topk_ratio, slots=slots)


def llama_shape(params: float) -> tuple[float, float]:
    """(hidden size, layers) of a llama-shaped model of `params` parameters: params = 12 x layers x hidden^2 with
    layers = hidden / 128 (7B: hidden 4096, 32 layers)."""
    hidden = (float(params) * 128 / 12) ** (1 / 3)
    return hidden, hidden / 128


def in_flight_gradient_gb(params: float, device_share: float = 1.0) -> float:
    """Device memory of the gradients in flight when each is freed in backward: the one autograd has just produced
    and those whose copy to the host has not read them yet (`engine.in_flight.in_flight_count`: a GPU's copies can
    lag backward), each of the model's largest matrix (a llama MLP matrix, hidden x 8/3 hidden, in bf16; of the
    rank's shard under FSDP2)."""
    hidden, _ = llama_shape(params)
    return in_flight_count(copies_lag=True) * hidden * (8 / 3) * hidden * device_share * GRADIENT_BYTES / 1e9


def device_memory_gb(schedule: str, params: float, topk_ratio: float = 0.1, sum_bytes: int = 0,
                     gradients_freed_in_backward: bool | None = None, split: RankSplit | None = None) -> float:
    """One rank's device memory, GB, for weights, gradients and optimizer state (no activations) of `schedule`:
    "no_offload", "sync_offload" or "zenflow" (with `sum_bytes` per element of device-side window sums, 0 for sums
    on the host). ``gradients_freed_in_backward`` applies to ZenFlow only; None: where the engine frees them
    (`GRADIENTS_FREED_IN_BACKWARD`: one rank or FSDP2 ranks, sums on the host).

    Example:
        >>> [round(device_memory_gb(s, 1e9, gradients_freed_in_backward=False), 2)
        ...  for s in ("no_offload", "sync_offload", "zenflow")]
        [16.0, 4.0, 5.4]
        >>> round(device_memory_gb("zenflow", 1e9, gradients_freed_in_backward=True), 2)
        3.48
    """
    split = split or RankSplit()
    n, dev, share = float(params), split.device_share, split.host_share
    weights, grads = n * dev * WEIGHT_BYTES / 1e9, n * dev * GRADIENT_BYTES / 1e9
    if schedule == "no_offload":
        return weights + grads + n * dev * DEVICE_BYTES_ADAM_STATE / 1e9
    if schedule == "sync_offload":
        return weights + grads  # every gradient until the step, as `SyncOffloadAdamW` keeps it
    freed = (GRADIENTS_FREED_IN_BACKWARD and (split.ranks == 1 or split.parallel == "fsdp2") and sum_bytes == 0) \
        if gradients_freed_in_backward is None else gradients_freed_in_backward
    held = in_flight_gradient_gb(n, dev) if freed else grads
    return weights + held + n * dev * topk_ratio * SELECTED_BYTES / 1e9 + n * share * sum_bytes / 1e9


def activation_gb(params: float, tokens_per_step: float) -> float:
    """Activation memory of a llama-shaped model with activation checkpointing, in GB: one bf16 hidden state per
    layer and token, plus one layer's full activations (~34 bytes x hidden per token, Korthikanti et al. 2022);
    shape from the size (`llama_shape`)."""
    hidden, layers = llama_shape(params)
    return tokens_per_step * hidden * (2 * layers + 34) / 1e9


__all__ = ["BF16_BYTES", "DEFAULT_HOST_STATE", "DEVICE_MEMORY_HEADROOM", "FP32_BYTES", "GPU_TRANSPORT",
           "GRADIENTS_FREED_IN_BACKWARD", "HOST_MEMORY_HEADROOM", "HOST_MOMENT_DTYPES", "HOST_STATE_RULES",
           "INT8_BLOCK", "MOMENT_BYTES", "SELECTED_BYTES", "activation_gb", "device_memory_gb", "host_layout",
           "in_flight_gradient_gb", "llama_shape", "preset_layout", "zenflow_host_bytes_per_param"]
