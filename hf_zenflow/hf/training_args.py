"""`ZenFlowTrainingArguments`: `TrainingArguments` plus the `--zenflow_*` flags.

Every `--zenflow_<name>` flag maps onto the `ZenFlowConfig.<name>` field of the same name, and is validated by
`ZenFlowConfig` itself (errors name the flag). Combinations the ZenFlow optimizer does not support fail at
construction, naming the conflict, instead of training wrongly later.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from ..config import ZenFlowConfig


#: `args.optim` values whose update rule is the one ZenFlowAdamW implements (decoupled-weight-decay AdamW).
SUPPORTED_OPTIMS = ("adamw_torch", "adamw_torch_fused")

#: TrainingArguments field -> ZenFlowConfig field.
ZENFLOW_FIELDS = {
    "zenflow_topk_ratio": "topk_ratio",
    "zenflow_update_interval": "update_interval",
    "zenflow_select_strategy": "select_strategy",
    "zenflow_select_interval": "select_interval",
    "zenflow_full_warm_up_rounds": "full_warm_up_rounds",
    "zenflow_overlap_step": "overlap_step",
    "zenflow_host_lr_scale": "host_lr_scale",
    "zenflow_min_offload_numel": "min_offload_numel",
    "zenflow_accumulate_on": "accumulate_on",
    "zenflow_cpu_threads": "cpu_threads",
}


def _truthy_env(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass
class ZenFlowTrainingArguments(TrainingArguments):
    r"""
    [`~transformers.TrainingArguments`] with the settings of the ZenFlow optimizer (`ZenFlowAdamW`).

    With `zenflow=True` (the default) [`ZenFlowTrainer`] trains with `ZenFlowAdamW` instead of `args.optim`, which must
    then be `"adamw_torch"` or `"adamw_torch_fused"` (`learning_rate`, `weight_decay`, `adam_beta1/2`, `adam_epsilon`,
    `max_grad_norm`, the LR scheduler and gradient accumulation keep their usual meaning; the ZenFlow interval counts
    *optimizer* steps).

    > Parameters that control ZenFlow

    zenflow (`bool`, *optional*, defaults to `True`):
        Train with `ZenFlowAdamW`. `False` gives a plain `Trainer` run with `args.optim`.
    zenflow_topk_ratio (`float`, *optional*, defaults to `0.1`):
        Fraction of the input columns of every weight matrix updated on the device each step.
    zenflow_update_interval (`str`, *optional*, defaults to `"4"`):
        Optimizer steps per host window, an integer >= 1, or `"auto"` (Zen-auto). After construction it holds an
        `int` or `"auto"`.
    zenflow_select_strategy (`str`, *optional*, defaults to `"auto"`):
        When to re-select the device columns: `"auto"`, `"step"` or `"epoch"`.
    zenflow_select_interval (`str`, *optional*, defaults to `"auto"`):
        Re-selection period in steps or epochs, or `"auto"`.
    zenflow_full_warm_up_rounds (`int`, *optional*, defaults to `0`):
        The first N optimizer steps are dense AdamW steps.
    zenflow_overlap_step (`bool`, *optional*, defaults to `True`):
        Overlap the host AdamW with the next steps (one window of staleness); `False` applies it at once.
    zenflow_host_lr_scale (`str`, *optional*, defaults to `"interval"`):
        Learning-rate multiplier of the host AdamW step (a number > 0), or `"interval"` (the window length).
    zenflow_min_offload_numel (`int`, *optional*, defaults to `0`):
        Weight matrices with fewer elements are updated entirely on the device.
    zenflow_accumulate_on (`str`, *optional*, defaults to `"host"`):
        Where the unselected gradient is summed over a window: `"host"` (no device memory) or `"device"` (+4 bytes
        per offloaded parameter on the device; one transfer per window instead of one per step).
    zenflow_layout (`str`, *optional*, defaults to `"auto"`):
        Memory layout of the `nn.Linear` weights: `"column"` applies `hf_zenflow.column_major_` (DeepSpeed's
        transposed layout: each input column contiguous, so the selected columns move as rows), `"row"` leaves the
        model alone, `"auto"` = column when the model is on the CPU. Exported checkpoints stay ordinary row-major.
    zenflow_cpu_threads (`int` or `None`, *optional*, defaults to `None`):
        Threads of the host worker; `None` = half the cores in this process's CPU affinity. Independent of
        `OMP_NUM_THREADS` (which `accelerate launch` sets to 1).

    Not supported together with `zenflow=True` (a `ValueError` names the conflict): `deepspeed` (use
    `ZenFlowConfig.from_deepspeed` to move a DeepSpeed ZenFlow config over), `fsdp`, `fp16` (its GradScaler unscales
    `p.grad`, which ZenFlow has already consumed; use `bf16`), and `optim` other than the AdamW variants above.

    Example:
        >>> from hf_zenflow import ZenFlowTrainingArguments
        >>> args = ZenFlowTrainingArguments(output_dir="out", use_cpu=True, zenflow_update_interval="auto",
        ...                                 report_to="none")
        >>> args.zenflow_config().update_interval
        'auto'
        >>> from transformers import HfArgumentParser
        >>> (args,) = HfArgumentParser(ZenFlowTrainingArguments).parse_args_into_dataclasses(
        ...     ["--output_dir", "out", "--use_cpu", "--report_to", "none", "--zenflow_update_interval", "8"])
        >>> args.zenflow_update_interval
        8
    """

    zenflow: bool = field(
        default=True,
        metadata={"help": "Train with the ZenFlow optimizer (ZenFlowAdamW) instead of `--optim`."},
    )
    zenflow_topk_ratio: float = field(
        default=0.1,
        metadata={
            "help": "Fraction of the input columns of every weight matrix updated on the device each step (the "
            "columns with the largest gradient norm), in [0, 1]; 0.1 = 10%% of the columns."
        },
    )
    # Typed `str` on purpose: HfArgumentParser turns `int | str` into `type=int`, so `--zenflow_update_interval auto`
    # would be rejected by argparse. `__post_init__` normalises the value to an int or "auto".
    zenflow_update_interval: str = field(
        default="4",
        metadata={
            "help": 'Optimizer steps per host window (an integer >= 1), or "auto": close a window when the '
            "accumulated unselected gradient has caught up with the selected one (Zen-auto)."
        },
    )
    zenflow_select_strategy: str = field(
        default="auto",
        metadata={
            "help": 'When to re-select the device columns: "step" every --zenflow_select_interval steps, "epoch" '
            'every --zenflow_select_interval epochs, "auto" every epoch (or every 100 steps when the epoch '
            "length is unknown).",
            "choices": ["auto", "step", "epoch"],
        },
    )
    zenflow_select_interval: str = field(
        default="auto",
        metadata={"help": 'Re-selection period in steps or epochs (an integer >= 1), or "auto".'},
    )
    zenflow_full_warm_up_rounds: int = field(
        default=0,
        metadata={"help": "The first N optimizer steps are plain dense AdamW steps; the first selection follows."},
    )
    zenflow_overlap_step: bool = field(
        default=True,
        metadata={
            "help": "Run the host AdamW in a background worker overlapping the next steps (its result lands one "
            "window later). Pass `--zenflow_overlap_step False` to apply it at once (sequential mode)."
        },
    )
    # `str` for the same reason as the update interval: a number or "interval".
    zenflow_host_lr_scale: str = field(
        default=str(ZenFlowConfig.host_lr_scale),
        metadata={
            "help": 'Learning-rate multiplier of the host AdamW step, or "interval" (the default) to multiply by the '
            "window length (the unselected columns take one step per window). 1.0 is ZenFlow's rule."
        },
    )
    zenflow_min_offload_numel: int = field(
        default=0,
        metadata={"help": "Weight matrices with fewer elements are updated entirely on the device every step."},
    )
    zenflow_accumulate_on: str = field(
        default="host",
        metadata={"help": 'Where the unselected gradient is summed over a window: "host" or "device" (+4 bytes per '
                  "offloaded parameter of device memory, one link transfer per window)."},
    )
    zenflow_layout: str = field(
        default="auto",
        metadata={"help": 'Memory layout of the Linear weights: "column" (hf_zenflow.column_major_: each input column '
                  'contiguous), "row" (unchanged) or "auto" (column when the model is on the CPU).'},
    )
    zenflow_cpu_threads: int | None = field(
        default=None,
        metadata={
            "help": "Threads of the host worker. Default: half the cores in this process's CPU affinity, whatever "
            "OMP_NUM_THREADS says (`accelerate launch` sets it to 1)."
        },
    )

    def __post_init__(self) -> None:
        # Conflicts are checked before `super().__post_init__()`: with `deepspeed` set, the parent would otherwise
        # import DeepSpeed and build its plugin first, and fail (or warn) about something unrelated.
        if self.zenflow:
            self._check_conflicts_before_init()
        super().__post_init__()
        if self.zenflow:
            self._check_conflicts_after_init()
        # Validate (and normalise: "4" -> 4, "AUTO" -> "auto") through ZenFlowConfig so that the rules live in one
        # place; its messages name `ZenFlowConfig.<field>`, which we rewrite into the command-line flag.
        if self.zenflow_layout not in ("auto", "column", "row"):
            raise ValueError(f"--zenflow_layout={self.zenflow_layout!r} is invalid: allowed are 'auto', 'column' and "
                             "'row'.")
        config = self.zenflow_config()
        self.zenflow_update_interval = config.update_interval
        self.zenflow_host_lr_scale = config.host_lr_scale
        self.zenflow_select_interval = config.select_interval
        self.zenflow_topk_ratio = config.topk_ratio

    # ----------------------------------------------------------------------------------------------------------------
    def zenflow_config(self, **overrides: Any) -> ZenFlowConfig:
        """The `ZenFlowConfig` these arguments describe (`overrides` replace fields, e.g. `steps_per_epoch=...`).

        Raises `ValueError` naming the `--zenflow_*` flag when a value is invalid.
        """
        values: dict[str, Any] = {name: getattr(self, arg) for arg, name in ZENFLOW_FIELDS.items()}
        values.update(overrides)
        try:
            return ZenFlowConfig(**values)
        except ValueError as err:
            message = re.sub(r"ZenFlowConfig\.(\w+)", lambda m: f"--zenflow_{m.group(1)}", str(err))
            raise ValueError(message) from None

    def _check_conflicts_before_init(self) -> None:
        if self.deepspeed or _truthy_env("ACCELERATE_USE_DEEPSPEED"):
            raise ValueError(
                "ZenFlowTrainingArguments: --zenflow cannot be combined with DeepSpeed (--deepspeed or "
                "ACCELERATE_USE_DEEPSPEED): ZenFlowAdamW replaces DeepSpeed's optimizer and gradient handling. Drop "
                "the DeepSpeed config (move a DeepSpeed `zenflow` block over with ZenFlowConfig.from_deepspeed) or "
                "pass --zenflow False."
            )
        if self.fsdp or _truthy_env("ACCELERATE_USE_FSDP"):
            raise ValueError(
                "ZenFlowTrainingArguments: --zenflow cannot be combined with FSDP (--fsdp or ACCELERATE_USE_FSDP): "
                "column selection needs whole weight matrices, FSDP shards them. Train on a single device, or "
                "pass --zenflow False."
            )
        if self.fp16:
            raise ValueError(
                "ZenFlowTrainingArguments: --zenflow cannot be combined with --fp16: the fp16 GradScaler unscales "
                "p.grad after ZenFlow has taken the gradients over. Use --bf16 (supported) or fp32."
            )

    def _check_conflicts_after_init(self) -> None:
        # `accelerate launch --mixed_precision fp16` reaches us through the environment, after the parent's post-init.
        if self.mixed_precision == "fp16":
            raise ValueError(
                "ZenFlowTrainingArguments: --zenflow cannot be combined with fp16 mixed precision "
                "(ACCELERATE_MIXED_PRECISION=fp16): its GradScaler unscales p.grad after ZenFlow has taken the "
                "gradients over. Use bf16 (supported) or fp32."
            )
        optim = getattr(self.optim, "value", self.optim)
        if optim not in SUPPORTED_OPTIMS:
            raise ValueError(
                f"ZenFlowTrainingArguments: --optim {optim} cannot be combined with --zenflow: ZenFlowAdamW "
                f"implements AdamW, so --optim must be one of {', '.join(SUPPORTED_OPTIMS)} (or pass --zenflow False)."
            )
