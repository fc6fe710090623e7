"""The memory side of the bound model: what each schedule holds on the device and on the host, per parameter of a
bf16 model, and the limits it must fit in.

* device (`device_memory_gb`): bf16 weights (2) and, where AdamW runs on the device, its fp32 master and moments (12);
  synchronous offload keeps every bf16 gradient until the step (2); ZenFlow keeps the selected columns' fp32 state
  and their gradient gathered in bf16 (`SELECTED_BYTES`, 14 per selected element), the window sums when they are on
  the device, and either every bf16 gradient until the step or, with ``gradients_freed_in_backward``, only the
  gradients in flight to the host (`in_flight_gradient_gb`). Counted against `DEVICE_MEMORY_HEADROOM` of the device;
  activations are not counted there (`activation_gb` estimates them for ``accumulate_on="auto"``);
* host (`zenflow_host_bytes_per_param`): per offloaded parameter, the fp32 master (4), the two moments in
  ``host_moment_dtype`` (fp32 8, bf16 4, int8 2 plus one fp32 scale per `INT8_BLOCK` elements of each), the window
  accumulator (fp32 4; 2 with ``host_sum_dtype="bfloat16"`` and the window summed on the host), the bf16 write-back
  buffer (2, pinned: ``host_writeback="master"`` does not apply on a GPU), with the window summed on the host the
  pinned landing slots of the in-flight gradients (`engine.host.GRAD_SLOTS` x 2), with bf16 device sums their bf16
  landing buffer (2); synchronous offload `SYNC_HOST_BYTES_PER_PARAM`. Every rank of a node holds its share;
  together they must fit `HOST_MEMORY_HEADROOM` of the node's RAM.

Example:
    >>> round(device_memory_gb("zenflow", 7e9, 0.1, gradients_freed_in_backward=False) / 7, 2)  # GB per 1e9 params
    5.4
"""

from __future__ import annotations

import torch

from hf_zenflow.engine.accumulation import selected_bytes
from hf_zenflow.engine.host import GRAD_SLOTS
from hf_zenflow.engine.in_flight import in_flight_count
from hf_zenflow.estimate.ranks import RankSplit
from hf_zenflow.settings.config import ZenFlowConfig


FP32_BYTES, BF16_BYTES = 4, 2
#: Host moment storage, bytes per element of each of the two moments, by ``host_moment_dtype``: int8 blocks of
#: `INT8_BLOCK` elements with one fp32 scale each.
INT8_BLOCK = 256
MOMENT_BYTES = {"float32": 4.0, "bfloat16": 2.0, "int8": 1.0 + FP32_BYTES / INT8_BLOCK}
HOST_MOMENT_DTYPES = tuple(MOMENT_BYTES)
#: Host window accumulator bytes per element by ``host_sum_dtype`` (a window summed on the host).
HOST_SUM_BYTES = {"float32": FP32_BYTES, "bfloat16": BF16_BYTES}
#: The library's ``host_moment_dtype``: what "ZenFlow, the defaults" stores its host moments in.
DEFAULT_HOST_MOMENTS: str = ZenFlowConfig.host_moment_dtype
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


def zenflow_host_bytes_per_param(sum_bytes: int = 0, host_moments: str = DEFAULT_HOST_MOMENTS,
                                 host_sums: str = "float32") -> float:
    """ZenFlow's host memory per offloaded parameter of a bf16 model on a GPU (`engine/host.py`): fp32 master (4),
    the two moments (`MOMENT_BYTES`), the window accumulator (4; 2 with the window summed on the host in bf16,
    `host_sums` "bfloat16": ``host_sum_dtype``), the bf16 write-back buffer (2); with the window summed on the host
    (`sum_bytes` 0) the pinned landing slot of each in-flight gradient (`GRAD_SLOTS` x 2), with bf16 device sums
    (`sum_bytes` 2) the buffer the sum lands in (2).

    Example:
        >>> zenflow_host_bytes_per_param(0), zenflow_host_bytes_per_param(4), zenflow_host_bytes_per_param(0, "int8")
        (18.0, 14.0, 16.03125)
        >>> zenflow_host_bytes_per_param(0, "int8", host_sums="bfloat16")
        14.03125
    """
    if host_moments not in MOMENT_BYTES:
        raise ValueError(f"host_moments={host_moments!r} is invalid: allowed are {', '.join(HOST_MOMENT_DTYPES)}.")
    if host_sums not in HOST_SUM_BYTES:
        raise ValueError(f"host_sums={host_sums!r} is invalid: allowed are {', '.join(HOST_SUM_BYTES)}.")
    landing = GRAD_SLOTS * BF16_BYTES if sum_bytes == 0 else BF16_BYTES if sum_bytes == BF16_BYTES else 0
    accumulator = HOST_SUM_BYTES[host_sums] if sum_bytes == 0 else FP32_BYTES  # (device sums land in fp32)
    return FP32_BYTES + 2 * MOMENT_BYTES[host_moments] + accumulator + BF16_BYTES + landing


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


__all__ = ["DEVICE_MEMORY_HEADROOM", "GRADIENTS_FREED_IN_BACKWARD", "HOST_MEMORY_HEADROOM", "HOST_MOMENT_DTYPES",
           "HOST_SUM_BYTES", "MOMENT_BYTES", "SELECTED_BYTES", "activation_gb", "device_memory_gb",
           "in_flight_gradient_gb", "llama_shape", "zenflow_host_bytes_per_param"]
