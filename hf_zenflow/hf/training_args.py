"""`ZenFlowTrainingArguments`: `TrainingArguments` plus the `--zenflow_*` flags.

Every `ZenFlowConfig` field `<name>` is a field `zenflow_<name>` here (`ZenFlowSettingArguments`), with the
setting's type, true default, help and choices (`settings.flags`).
Values are validated by `ZenFlowConfig` itself (errors name the flag). Combinations the ZenFlow optimizer does not
support fail at construction, naming the conflict, instead of training wrongly later.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

import torch
from transformers import TrainingArguments

from ..settings.config import ZenFlowConfig
from ..settings.flags import (
    FALSE_WORDS,
    SETTINGS,
    SETTINGS_BY_NAME,
    TRUE_WORDS,
    LowercaseChoice,
    hf_parameter_doc,
    rename_fields,
    render_help,
    trainer_fields,
)
from .deepspeed_arguments import apply_deepspeed_config


#: `args.optim` values whose update rule is the one ZenFlowAdamW implements (decoupled-weight-decay AdamW).
SUPPORTED_OPTIMS = ("adamw_torch", "adamw_torch_fused")

#: Prefix of the generated fields (`zenflow_topk_ratio`, ...).
ARG_PREFIX = "zenflow_"

#: TrainingArguments field -> ZenFlowConfig field.
ZENFLOW_FIELDS = {ARG_PREFIX + s.name: s.name for s in SETTINGS}

_LAYOUTS = ("auto", "column", "row")

#: Each setting's command-line field: its type, true default, help and choices (`settings.flags.trainer_fields`).
_FIELDS = {name: spec for name, _, spec in trainer_fields(ARG_PREFIX)}


def _setting(name: str) -> Any:
    """The `dataclasses.field` of ``zenflow_<name>``: `ZenFlowConfig.<name>`'s default, help and choices."""
    return _FIELDS[ARG_PREFIX + name]


@dataclass
class ZenFlowSettingArguments:
    """One ``--zenflow_<setting>`` field per `ZenFlowConfig` field, in its order;
    defaults, help and choices come from the setting. `ZenFlowTrainingArguments` lists this class first among its
    bases so that these fields come after the `TrainingArguments` ones (``output_dir`` stays the first positional
    argument)."""

    zenflow_topk_ratio: float = _setting("topk_ratio")
    zenflow_update_interval: str = _setting("update_interval")
    zenflow_select_strategy: LowercaseChoice = _setting("select_strategy")
    zenflow_select_interval: str = _setting("select_interval")
    zenflow_full_warm_up_rounds: int = _setting("full_warm_up_rounds")
    zenflow_overlap_step: bool = _setting("overlap_step")
    zenflow_auto_ratio: float = _setting("auto_ratio")
    zenflow_host_step: LowercaseChoice = _setting("host_step")
    zenflow_min_offload_numel: int = _setting("min_offload_numel")
    zenflow_host_state: LowercaseChoice = _setting("host_state")
    zenflow_device_memory_limit_bytes: int | None = _setting("device_memory_limit_bytes")
    zenflow_cpu_threads: int | None = _setting("cpu_threads")


#: The boolean fields of `ZenFlowTrainingArguments`: text given from Python ("false") is read as the command line
#: reads it.
_BOOL_FIELDS = ("zenflow", "zenflow_resume_without_optimizer", "zenflow_overlap_step")


def _truthy_env(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _as_bool(name: str, value: Any) -> Any:
    """`value` of the boolean field `name` as a bool when it is text ("false", "Yes", "0"), as `HfArgumentParser`
    reads the flag; other values are left to the checks that follow."""
    if not isinstance(value, str):
        return value
    text = value.strip().lower()
    if text in TRUE_WORDS or text in FALSE_WORDS:
        return text in TRUE_WORDS
    raise ValueError(f"ZenFlowTrainingArguments: {name}={value!r} is invalid: allowed are True, False and the texts "
                     f"{', '.join(TRUE_WORDS)} / {', '.join(FALSE_WORDS)}.")


@dataclass
class ZenFlowTrainingArguments(ZenFlowSettingArguments, TrainingArguments):
    r"""
    [`~transformers.TrainingArguments`] with the settings of the ZenFlow optimizer (`ZenFlowAdamW`).

    With `zenflow=True` (the default) [`ZenFlowTrainer`] trains with `ZenFlowAdamW` instead of `args.optim`, which must
    then be `"adamw_torch"` or `"adamw_torch_fused"` (`learning_rate`, `weight_decay`, `adam_beta1/2`, `adam_epsilon`,
    `max_grad_norm`, the LR scheduler and gradient accumulation keep their usual meaning; the ZenFlow interval counts
    *optimizer* steps). `zenflow_<name>` is `ZenFlowConfig.<name>`; after construction each holds the validated value
    (e.g. `zenflow_update_interval` an `int` or `"auto"`). Choice strings are case-insensitive. The epoch length that
    select_strategy "epoch" / "auto" re-select by is not a setting: the Trainer derives it from the train dataloader
    (for a dataset without a length use `zenflow_select_strategy="step"`).

    > Parameters that control ZenFlow

    {zenflow_parameters}

    Not supported together with `zenflow=True` (a `ValueError` names the conflict): `deepspeed` (move a DeepSpeed
    ZenFlow config over with `zenflow_from_deepspeed` or `ZenFlowTrainingArguments.from_deepspeed`), FSDP1 (`fsdp`
    is supported with `fsdp_config={"version": 2}`, FSDP2, the default in transformers 5), and `optim` other than
    the AdamW variants above. `fp16` works (its GradScaler: `hf_zenflow.engine.amp`), as do `bf16` and fp32.

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
        metadata={"help": "Train with the ZenFlow optimizer (ZenFlowAdamW) instead of `--optim`. `False` gives a "
                  "plain Trainer run with `--optim`."},
    )
    zenflow_layout: LowercaseChoice = field(
        default="auto",
        metadata={"help": 'Memory layout of the Linear weights: "column" (hf_zenflow.column_major_: each input column '
                  'contiguous, DeepSpeed\'s transposed layout, so the selected columns move as rows), "row" '
                  '(unchanged) or "auto" (column when the model is on the CPU). Only trainable weights ZenFlow will '
                  "offload are re-laid (at least min_offload_numel elements). Exported checkpoints stay ordinary "
                  "row-major.",
                  "choices": list(_LAYOUTS)},
    )
    zenflow_resume_without_optimizer: bool = field(
        default=False,
        metadata={"help": "Resume from a checkpoint that has no optimizer state (a partial copy, or saved with "
                  "save_only_model) with a fresh optimizer state and a warning. Without it such a checkpoint is "
                  "refused: the moments and the ZenFlow schedule would be lost silently."},
    )
    zenflow_from_deepspeed: str | None = field(
        default=None,
        metadata={"help": "A DeepSpeed ZenFlow config (JSON file path, JSON text or dict) to move over: its zenflow "
                  "block, optimizer (lr, betas, eps, weight decay), gradient_clipping, bf16, fp16 and batch sizes set "
                  "the matching arguments left at their defaults (an argument given on both sides must agree); what "
                  "cannot move over is named in a warning."},
    )

    def __post_init__(self) -> None:
        for name in _BOOL_FIELDS:
            setattr(self, name, _as_bool(name, getattr(self, name)))
        if self.zenflow_from_deepspeed is not None:
            # before the parent's post-init, which reads bf16 and the batch settings
            if isinstance(self.zenflow_from_deepspeed, os.PathLike):
                self.zenflow_from_deepspeed = os.fspath(self.zenflow_from_deepspeed)  # to_json_string() needs a str

            apply_deepspeed_config(self, self.zenflow_from_deepspeed)
        # Conflicts are checked before `super().__post_init__()`: with `deepspeed` set, the parent would otherwise
        # import DeepSpeed and build its plugin first, and fail (or warn) about something unrelated.
        if self.zenflow:
            self._check_conflicts_before_init()
        self._adopt_class_default_checkpointing()
        super().__post_init__()
        if self.zenflow:
            self._check_conflicts_after_init()
        layout = self.zenflow_layout.strip().lower() if isinstance(self.zenflow_layout, str) else self.zenflow_layout
        if layout not in _LAYOUTS:
            raise ValueError(f"--zenflow_layout={self.zenflow_layout!r} is invalid: allowed are 'auto', 'column' and "
                             "'row'.")
        self.zenflow_layout = str(layout)
        if self.zenflow and layout == "column" and (self.fsdp or _truthy_env("ACCELERATE_USE_FSDP")):
            raise ValueError("ZenFlowTrainingArguments: --zenflow_layout='column' cannot be combined with FSDP: "
                             "fully_shard replaces each weight with row-major shards. Use 'auto' or 'row'.")
        # Validate and normalise ("4" -> 4, "AUTO" -> "auto", "Step" -> "step") through ZenFlowConfig, so that the
        # rules live in one place.
        config = self.zenflow_config()
        for arg, name in ZENFLOW_FIELDS.items():
            setattr(self, arg, getattr(config, name))

    def _adopt_class_default_checkpointing(self) -> None:
        # trl's configs default the deprecated alias `gradient_checkpointing` to True: the parent would warn about
        # that default as if the user had passed it. A value that is the class's own default moves to
        # `activation_checkpointing` here, as the parent would move it; a user's explicit value still warns there.
        default = next(f.default for f in fields(self) if f.name == "gradient_checkpointing")
        if (self.activation_checkpointing is None and self.gradient_checkpointing is not None
                and default is not None and self.gradient_checkpointing == default):
            self.activation_checkpointing = self.gradient_checkpointing

    @cached_property
    def _setup_devices(self) -> torch.device:
        # transformers 5.24 passes --ddp_timeout to the process group only without --use_cpu: on CPU ranks (gloo)
        # a rank whose peer died silently would wait torch's default 30 minutes. Create the group first, with the
        # timeout; PartialState keeps a group that is already initialised.
        if self.use_cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1 and "LOCAL_RANK" in os.environ:
            dist = torch.distributed
            if dist.is_available() and not dist.is_initialized():
                dist.init_process_group(backend=self.ddp_backend or "gloo", timeout=self.ddp_timeout_delta)
        return super()._setup_devices

    @classmethod
    def from_deepspeed(cls, config: dict[str, Any] | str | os.PathLike, **kwargs: Any) -> ZenFlowTrainingArguments:
        """Move a DeepSpeed ZenFlow config over in one step: its zenflow block, optimizer (lr, betas, eps, weight
        decay), ``gradient_clipping``, ``bf16``, ``fp16`` and batch sizes become these arguments; `kwargs` are the
        other arguments (``output_dir``, ...). ``"auto"`` in the DeepSpeed config leaves the argument as given here (or
        its default). A setting given both here and in the DeepSpeed config must agree. What cannot move over
        (ZeRO communication settings, a scheduler, ...) is named in one warning.

        Example:
            >>> args = ZenFlowTrainingArguments.from_deepspeed("zf_config.json", output_dir="out")  # doctest: +SKIP
            >>> args.learning_rate, args.bf16, args.zenflow_update_interval  # doctest: +SKIP
            (2e-05, True, 4)
        """
        return cls(zenflow_from_deepspeed=config, **kwargs)

    # ----------------------------------------------------------------------------------------------------------------
    def zenflow_config(self, **overrides: Any) -> ZenFlowConfig:
        """The `ZenFlowConfig` these arguments describe (`overrides` replace fields, e.g. `topk_ratio=...`).

        Raises `ValueError` naming the `--zenflow_*` flag when a value is invalid.
        """
        values: dict[str, Any] = {name: getattr(self, arg) for arg, name in ZENFLOW_FIELDS.items()}
        values.update(overrides)
        try:
            return ZenFlowConfig(**values)
        except ValueError as err:
            flag = {name: f"--{arg}" for arg, name in ZENFLOW_FIELDS.items()}
            raise ValueError(rename_fields(str(err), lambda name: flag.get(name, f"ZenFlowConfig.{name}"))) from None

    def _check_conflicts_before_init(self) -> None:
        if self.deepspeed or _truthy_env("ACCELERATE_USE_DEEPSPEED"):
            raise ValueError(
                "ZenFlowTrainingArguments: --zenflow cannot be combined with DeepSpeed (--deepspeed or "
                "ACCELERATE_USE_DEEPSPEED): ZenFlowAdamW replaces DeepSpeed's optimizer and gradient handling. Drop "
                "the DeepSpeed config (move a DeepSpeed ZenFlow config over with --zenflow_from_deepspeed PATH) or "
                "pass --zenflow False."
            )

    def _check_conflicts_after_init(self) -> None:
        # After the parent's post-init: it has read --fsdp_config (a dict or a JSON file) into `fsdp_plugin_args`.
        self._check_fsdp_version()
        optim = getattr(self.optim, "value", self.optim)
        if optim not in SUPPORTED_OPTIMS:
            raise ValueError(
                f"ZenFlowTrainingArguments: --optim {optim} cannot be combined with --zenflow: ZenFlowAdamW "
                f"implements AdamW, so --optim must be one of {', '.join(SUPPORTED_OPTIMS)} (or pass --zenflow False)."
            )

    def _check_fsdp_version(self) -> None:
        """FSDP2 (`fully_shard`, DTensor shards) is supported; FSDP1 and XLA's FSDP are not."""
        if self.fsdp:
            plugin = self.fsdp_plugin_args  # None: XLA's FSDP, which builds no accelerate plugin
            version = "xla" if plugin is None else str(plugin.get("fsdp_version"))
            source = "--fsdp with XLA FSDP" if plugin is None else f"--fsdp with fsdp_config version {version}"
        elif _truthy_env("ACCELERATE_USE_FSDP"):
            # accelerate's FullyShardedDataParallelPlugin reads FSDP_VERSION, and defaults to 1 without it
            version = os.environ.get("FSDP_VERSION", "1").strip()
            source = f"ACCELERATE_USE_FSDP with FSDP_VERSION={version}"
        else:
            return
        if version != "2":
            kind = {"1": "FSDP1", "xla": "XLA FSDP"}.get(version, f"FSDP version {version}")
            raise ValueError(
                f"ZenFlowTrainingArguments: --zenflow cannot be combined with {source} ({kind}): only FSDP2 "
                "(fully_shard) is supported. Set fsdp_version 2 (--fsdp_config '{\"version\": 2}', or fsdp_version: "
                "2 in the accelerate config), train with DDP, or pass --zenflow False."
            )


def _doc_type(annotation: str) -> str:
    names = [part.strip() for part in annotation.split("|") if part.strip() != "None"]
    return " or ".join(f"`{'str' if name == 'LowercaseChoice' else name}`" for name in names)


def _parameters_doc() -> str:
    """The "Parameters that control ZenFlow" section, from the fields themselves (so it cannot drift)."""
    entries = []
    for f in sorted((f for f in fields(ZenFlowTrainingArguments) if f.name.startswith("zenflow")),
                    key=lambda f: f.name != "zenflow"):
        setting = SETTINGS_BY_NAME.get(ZENFLOW_FIELDS.get(f.name, ""))
        if setting is not None:
            doc = hf_parameter_doc(f.name, setting.doc_type, setting.default,
                                   render_help(setting, lambda n: f"`{ARG_PREFIX}{n}`"))
        else:
            doc = hf_parameter_doc(f.name, _doc_type(str(f.type)), f.default, f.metadata["help"])
        entries.append(doc)
    return "\n".join(entries).strip()


ZenFlowTrainingArguments.__doc__ = ZenFlowTrainingArguments.__doc__.replace("{zenflow_parameters}", _parameters_doc())
