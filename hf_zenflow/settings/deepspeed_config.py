"""Moving a DeepSpeed ZenFlow config over: its ``zero_optimization.zenflow`` block to `ZenFlowConfig`, and the rest
of what a DeepSpeed fine-tune sets (optimizer, clipping, bf16, fp16, batch sizes) to `ZenFlowTrainingArguments` fields.

A config is a dict, a path to a JSON file (what DeepSpeed users hold, and what the Trainer's ``--deepspeed`` takes)
or JSON text. ``"auto"`` in a DeepSpeed config means "take it from the TrainingArguments" (transformers' DeepSpeed
integration fills it in): such a key maps to nothing and the TrainingArguments value stands. Missing keys take
DeepSpeed's defaults, so that a moved-over run behaves as it did under DeepSpeed (no ``gradient_clipping`` = no
clipping; no ``update_interval`` in the zenflow block = ``"auto"``). What cannot move over is named in one warning.

Example:
    >>> values, dropped = training_values({"train_batch_size": 8, "gradient_clipping": 1.0,
    ...     "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "weight_decay": 0.01}},
    ...     "zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.1}}}, world_size=2)
    >>> {name: value for name, (_, value) in values.items()}  # doctest: +NORMALIZE_WHITESPACE
    {'learning_rate': 2e-05, 'weight_decay': 0.01, 'max_grad_norm': 1.0, 'per_device_train_batch_size': 4,
     'gradient_accumulation_steps': 1}
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any


#: DeepSpeed's defaults for the zenflow keys (`deepspeed/runtime/zenflow/zenflow_config.py`).
DEEPSPEED_ZENFLOW_DEFAULTS: dict[str, Any] = {
    "topk_ratio": 0.1,
    "select_strategy": "auto",
    "select_interval": "auto",
    "update_interval": "auto",
    "overlap_step": False,
    "auto_ratio": 0.99,
    "full_warm_up_rounds": 0,
}
_ZENFLOW_OTHER_KEYS = ("offload", "pt_reserved_cores_perc", "steps_per_epoch")

#: Top-level keys read by `training_values` (everything else is reported as not moved over).
_READ_KEYS = {"zero_optimization", "optimizer", "gradient_clipping", "bf16", "bfloat16", "fp16",
              "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
              "zero_allow_untested_optimizer"}  # the last: DeepSpeed's own guard, meaningless here
#: `zero_optimization` keys that ZenFlowAdamW covers by itself: stage 1/2 shard only the optimizer state (one
#: process here holds it whole), `offload_optimizer` to the CPU is what ZenFlow's host side is (pinned on CUDA).
_COVERED_ZERO_KEYS = {"stage", "offload_optimizer", "zenflow"}
#: Why some common top-level keys do not move over, and what to set instead.
_DROPPED_HINTS = {
    "scheduler": "set lr_scheduler_type and warmup_steps",
    "steps_per_print": "set logging_steps",
    "wall_clock_breakdown": "ZenFlow's telemetry is logged as zenflow/...",
}
_ADAM_TYPES = ("adam", "adamw")
#: `optimizer.params` keys that choose DeepSpeed's implementation, not the update rule.
_IMPLEMENTATION_PARAMS = {"torch_adam", "fused", "adam_w_mode"}


def load(source: dict[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """A DeepSpeed config from a dict, a JSON file path or JSON text (a copy: the caller's dict is left alone).

    Example:
        >>> load('{"zero_optimization": {"stage": 2}}')
        {'zero_optimization': {'stage': 2}}
    """
    if isinstance(source, dict):
        return json.loads(json.dumps(source))  # deep copy, and the same types a file would give
    if isinstance(source, str) and source.lstrip().startswith("{"):
        try:
            return json.loads(source)
        except json.JSONDecodeError as err:
            raise ValueError(f"the DeepSpeed config text is not valid JSON: {err}") from None
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(f"a DeepSpeed config must be a dict, a JSON file path or JSON text, got "
                         f"{type(source).__name__}.")
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"the DeepSpeed config file {str(path)!r} does not exist.")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"the DeepSpeed config file {str(path)!r} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"the DeepSpeed config file {str(path)!r} holds {type(config).__name__}, not an object.")
    return config


def zenflow_block(config: dict[str, Any]) -> dict[str, Any]:
    """The ``zenflow`` block of a whole config (``{"zero_optimization": {"zenflow": {...}}}``), or `config` itself
    when it is the block alone."""
    if "zero_optimization" not in config:
        return config
    block = config["zero_optimization"].get("zenflow")
    if block is None:
        raise ValueError("ZenFlowConfig.from_deepspeed: the config has no zero_optimization.zenflow block.")
    if not isinstance(block, dict):
        raise ValueError(f"ZenFlowConfig.from_deepspeed: the zenflow block must be a dict, got {block!r}.")
    return block


def zenflow_values(config: dict[str, Any]) -> dict[str, Any]:
    """The `ZenFlowConfig` fields a DeepSpeed zenflow block determines (its keys, else DeepSpeed's defaults).

    ``pt_reserved_cores_perc`` becomes ``cpu_threads`` (the cores not reserved for the training process);
    ``offload`` (GPU moments in pinned host memory) is not supported and is ignored with a warning. ``host_step``
    is ``"zenflow"``: DeepSpeed's host step (one AdamW step per window at the configured lr, written back at the next
    window boundary), which no key of the block changes.
    """
    block = dict(zenflow_block(config))
    values = {**DEEPSPEED_ZENFLOW_DEFAULTS, "host_step": "zenflow"}
    if block.pop("offload", False):
        warnings.warn(
            "ZenFlowConfig.from_deepspeed: 'offload' (device-side moments kept in pinned host memory) is not "
            "supported by hf_zenflow and is ignored: the selected columns' moments stay on the device.",
            stacklevel=3,
        )
    block.pop("steps_per_epoch", None)  # internal in DeepSpeed, filled by the trainer here
    perc = block.pop("pt_reserved_cores_perc", None)
    if perc is not None:
        if isinstance(perc, bool) or not isinstance(perc, (int, float)) or not 0.0 <= perc <= 1.0:
            raise ValueError(
                f"ZenFlowConfig.from_deepspeed: pt_reserved_cores_perc={perc!r} is invalid: allowed is a float "
                "in [0, 1]."
            )
        from .threads import available_cpu_count  # (it imports torch: only here)

        n = available_cpu_count()
        reserved = math.ceil(perc * n)
        values["cpu_threads"] = n if reserved in (0, n) else n - reserved
    unknown = sorted(set(block) - set(DEEPSPEED_ZENFLOW_DEFAULTS))
    if unknown:
        raise ValueError(
            f"ZenFlowConfig.from_deepspeed: unknown zenflow key(s) {unknown}: allowed are "
            f"{sorted(set(DEEPSPEED_ZENFLOW_DEFAULTS) | set(_ZENFLOW_OTHER_KEYS))}."
        )
    values.update(block)
    return values


def _given(value: Any) -> bool:
    """False for a key DeepSpeed would fill from the TrainingArguments (``"auto"``) or that is absent."""
    return value is not None and not (isinstance(value, str) and value.strip().lower() == "auto")


def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"DeepSpeed config: {key}={value!r} is invalid: allowed is an integer >= 1 or \"auto\".")
    return value


def _batch_values(config: dict[str, Any], world_size: int) -> dict[str, tuple[str, int]]:
    """Per-device batch size and accumulation steps, resolved the way DeepSpeed resolves them:
    ``train_batch_size = micro_batch * gradient_accumulation_steps * world_size``."""
    total, micro, accumulation = (config.get(k) for k in (
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"))
    total = _positive_int("train_batch_size", total) if _given(total) else None
    micro = _positive_int("train_micro_batch_size_per_gpu", micro) if _given(micro) else None
    accumulation = _positive_int("gradient_accumulation_steps", accumulation) if _given(accumulation) else None
    if total is not None:
        if micro is None:
            accumulation = accumulation or 1
            micro = total // (accumulation * world_size)
        elif accumulation is None:
            accumulation = total // (micro * world_size)
        if micro < 1 or accumulation < 1 or micro * accumulation * world_size != total:
            raise ValueError(
                f"DeepSpeed config: train_batch_size={total} is not train_micro_batch_size_per_gpu "
                f"({config.get('train_micro_batch_size_per_gpu')}) x gradient_accumulation_steps "
                f"({config.get('gradient_accumulation_steps')}) x world size ({world_size})."
            )
    values: dict[str, tuple[str, int]] = {}
    if micro is not None:
        values["per_device_train_batch_size"] = ("train_micro_batch_size_per_gpu", micro)
    if accumulation is not None:
        values["gradient_accumulation_steps"] = ("gradient_accumulation_steps", accumulation)
    return values


def training_values(config: dict[str, Any], world_size: int | None = None
                    ) -> tuple[dict[str, tuple[str, Any]], list[str]]:
    """What a whole DeepSpeed config sets in `TrainingArguments` terms, and what cannot move over.

    Returns ``({training_arguments_field: (deepspeed_key, value)}, [not moved over, with the reason])``. The
    ``zenflow`` block is not included (`zenflow_values`). `world_size` (default: ``WORLD_SIZE``, else 1) resolves
    ``train_batch_size`` into a per-device batch size as DeepSpeed does.

    Raises `ValueError` for what would change the training rule: a non-Adam optimizer, Adam with L2 instead of
    decoupled weight decay (``adam_w_mode: false``), AMSGrad.
    """
    world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1") or 1)
    values: dict[str, tuple[str, Any]] = {}
    dropped = [f"{key} ({_DROPPED_HINTS[key]})" if key in _DROPPED_HINTS else key
               for key in config if key not in _READ_KEYS]

    optimizer = config.get("optimizer")
    if isinstance(optimizer, dict):
        kind = str(optimizer.get("type", "")).lower()
        if kind not in _ADAM_TYPES:
            raise ValueError(f"DeepSpeed config: optimizer.type={optimizer.get('type')!r} cannot move over: "
                             "ZenFlowAdamW implements AdamW; allowed are 'Adam' and 'AdamW'.")
        params = dict(optimizer.get("params") or {})
        if params.get("adam_w_mode") is False or params.get("amsgrad"):
            raise ValueError("DeepSpeed config: optimizer.params adam_w_mode=false (L2 Adam) or amsgrad=true cannot "
                             "move over: ZenFlowAdamW implements AdamW (decoupled weight decay, no AMSGrad).")
        for key, name in (("lr", "learning_rate"), ("eps", "adam_epsilon"), ("weight_decay", "weight_decay")):
            if _given(params.get(key)):
                values[name] = (f"optimizer.params.{key}", params[key])
        betas = params.get("betas")
        if _given(betas):
            values["adam_beta1"] = ("optimizer.params.betas[0]", betas[0])
            values["adam_beta2"] = ("optimizer.params.betas[1]", betas[1])
        dropped += [f"optimizer.params.{key}" for key in params
                    if key not in {"lr", "eps", "weight_decay", "betas", "amsgrad"} | _IMPLEMENTATION_PARAMS]

    if "gradient_clipping" not in config:
        values["max_grad_norm"] = ("gradient_clipping (absent: DeepSpeed does not clip)", 0.0)
    elif _given(config["gradient_clipping"]):
        values["max_grad_norm"] = ("gradient_clipping", config["gradient_clipping"])

    fp16 = config.get("fp16") or {}
    if _given(fp16.get("enabled")):
        values["fp16"] = ("fp16.enabled", bool(fp16["enabled"]))
    # the loss-scale settings: the Trainer's GradScaler is torch's (dynamic, its own defaults)
    dropped += [f"fp16.{key}" for key in fp16 if key != "enabled"]
    bf16_key = "bf16" if "bf16" in config else "bfloat16"
    bf16 = (config.get(bf16_key) or {}).get("enabled")
    if _given(bf16):
        values["bf16"] = (f"{bf16_key}.enabled", bool(bf16))

    values.update(_batch_values(config, world_size))

    zero = config.get("zero_optimization") or {}
    dropped += [f"zero_optimization.{key}" for key in zero if key not in _COVERED_ZERO_KEYS]
    if zero.get("stage") == 3:
        dropped.append("zero_optimization.stage=3 (parameter partitioning: hf_zenflow keeps every parameter whole "
                       "on its device)")
    offload = zero.get("offload_optimizer") or {}
    if offload.get("device") not in (None, "cpu", "none"):
        dropped.append(f"zero_optimization.offload_optimizer.device={offload['device']!r} (ZenFlow's host side is "
                       "CPU memory)")
    dropped += [f"zero_optimization.offload_optimizer.{key}" for key in offload
                if key not in ("device", "pin_memory")]
    return values, dropped


def warn_dropped(dropped: list[str], where: str, stacklevel: int = 3) -> None:
    """One warning naming every DeepSpeed key that did not move over."""
    if dropped:
        warnings.warn(f"{where}: not moved over from the DeepSpeed config (no equivalent in hf_zenflow): "
                      f"{', '.join(dropped)}.", UserWarning, stacklevel=stacklevel)
