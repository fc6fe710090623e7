"""`ZenFlowConfig`: the validated settings of a ZenFlow optimizer.

Field names follow DeepSpeed's `zero_optimization.zenflow` block so that a DeepSpeed config moves over unchanged
(`ZenFlowConfig.from_deepspeed`). Every invalid value fails here, at construction, with a `ValueError` that names the
field, the value and what is allowed. Each field's metadata (``help``, and ``choices`` for string choices) is the one
source of the settings' command-line flags, plugin arguments, environment variables and docs (`flags.py`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from .deepspeed_config import load, zenflow_values
from .rules import AUTO_HOST_LR_CAP, DEVICE_SUMS, HIGH_LR_RULE_THRESHOLD, HOST_STATES, HOST_STEP_RULES, EngineRules


SelectStrategy = Literal["auto", "step", "epoch"]

#: Re-selection period (in optimizer steps) used by ``select_strategy="auto"`` when the number of steps per epoch is
#: unknown (a plain training loop over an iterable dataset, say). DeepSpeed silently never re-selects in that case
#: (DeepSpeed #8456); we re-select on this fixed step period instead.
DEFAULT_SELECT_STEPS = 100

#: Default `min_offload_numel`: matrices under 2**18 elements (1 MiB in fp32, 3 MiB of AdamW state) stay on the device.
#: LoRA adapters (rank x hidden: 8 x 4096 = 32768, 32 x 4096 = 131072), classification heads and the like are far below
#: it; the smallest weight matrix of a 1B+ model (2048 x 2048) is 16x above it.
MIN_OFFLOAD_NUMEL = 1 << 18

_SELECT_STRATEGIES = ("auto", "step", "epoch")
#: `host_state`'s presets (`rules.HOST_STATES`: the rules each stands for).
HOST_STATE_CHOICES = tuple(HOST_STATES)
_HOST_STEPS = tuple(HOST_STEP_RULES)


#: Settings this version of hf_zenflow no longer has: a settings dict (a checkpoint's) or a `ZenFlowAdamW` keyword
#: that names one is refused with one message that says so (`removed_settings_text`), not as an unknown name.
REMOVED_SETTINGS = ("host_grad_dtype", "auto_max_interval", "device_memory_budget_bytes", "steps_per_epoch",
                    "accumulate_on", "host_moment_dtype", "host_sum_dtype", "host_sum_columns", "host_writeback",
                    "free_gradients_in_backward", "host_lr_scale", "high_lr_rule", "host_step_guard", "writeback_lag")


def removed_settings_text(names: Iterable[str]) -> str | None:
    """"setting X no longer exists" (or "settings X, Y no longer exist") for those of `names` that are
    `REMOVED_SETTINGS`; None when none is.

    Example:
        >>> removed_settings_text(["topk_ratio", "host_grad_dtype"])
        'setting host_grad_dtype no longer exists'
    """
    removed = sorted(set(names) & set(REMOVED_SETTINGS))
    if not removed:
        return None
    one = len(removed) == 1
    return f"setting{'' if one else 's'} {', '.join(removed)} no longer exist{'s' if one else ''}"


def sums_on_device(accumulate_on: str | None) -> bool:
    """Whether a resolved `accumulate_on` ("auto"'s choice, or the rule) sums windows on the device ("device" or
    "device_bf16")."""
    return accumulate_on in DEVICE_SUMS


def __getattr__(name: str) -> Any:
    # `DEVICE_SUM_DTYPES` (the device-side window sum's dtype of each resolved `accumulate_on` that sums on the
    # device) and `available_cpu_count` when first asked for: importing the settings (the command line's flag
    # checks) imports no torch.
    if name == "available_cpu_count":  # (imported from here too)
        from .threads import available_cpu_count

        return available_cpu_count
    if name == "DEVICE_SUM_DTYPES":
        import torch

        return {"device": torch.float32, "device_bf16": torch.bfloat16}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fail(name: str, value: Any, allowed: str) -> None:
    raise ValueError(f"ZenFlowConfig.{name}={value!r} is invalid: allowed is {allowed}.")


def parse_int_or_auto(name: str, value: Any) -> int | str:
    """Accept an int >= 1, the string "auto", or a string holding an int (what a command line delivers)."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return "auto"
        try:
            value = int(text)
        except ValueError:
            _fail(name, value, 'an integer >= 1 or "auto"')
    if not _is_int(value) or value < 1:
        _fail(name, value, 'an integer >= 1 or "auto"')
    return value


@dataclass
class ZenFlowConfig:
    """Settings of `ZenFlowAdamW`.

    Example:
        >>> from hf_zenflow import ZenFlowConfig
        >>> ZenFlowConfig(topk_ratio=0.1, update_interval=4).update_interval
        4
        >>> ZenFlowConfig(update_interval="auto").is_auto_interval
        True
    """

    topk_ratio: float = field(
        default=0.1,
        metadata={
            "help": "Fraction of the input columns of every weight matrix updated on the device each step (the "
            "columns with the largest gradient norm), e.g. 0.1 = 10% of the columns. 1.0 = every column on the "
            "device (plain AdamW); 0.0 = none (every matrix updated by the host AdamW only)."
        },
    )
    update_interval: int | str = field(
        default=4,
        metadata={
            "help": 'Optimizer steps per host window: the host AdamW applies the mean unselected gradient once every '
            '`update_interval` steps. "auto" closes a window when the accumulated unselected gradient mass has '
            "caught up with the selected mass (Zen-auto)."
        },
    )
    select_strategy: str = field(
        default="auto",
        metadata={
            "help": 'When to re-select the device columns: "step" every `select_interval` steps, "epoch" every '
            '`select_interval` epochs, "auto" = every epoch when the epoch length is known, else every '
            f"{DEFAULT_SELECT_STEPS} steps.",
            "choices": _SELECT_STRATEGIES,
        },
    )
    select_interval: int | str = field(
        default="auto",
        metadata={"help": 'Re-selection period, in steps or epochs (see `select_strategy`); "auto" = 1 epoch or '
                  f"{DEFAULT_SELECT_STEPS} steps."},
    )
    full_warm_up_rounds: int = field(
        default=0,
        metadata={"help": "The first N optimizer steps are plain dense AdamW (every column updated by the host "
                  "each step, synchronously); the first selection happens after them."},
    )
    overlap_step: bool = field(
        default=True,
        metadata={"help": "Run the host AdamW in a background worker that overlaps the next steps (its result is "
                  "written back one window later). False: run it inline and write it back at once."},
    )
    auto_ratio: float = field(
        default=0.99,
        metadata={"help": 'With update_interval="auto": fraction of weight matrices that must meet the Zen-auto '
                  "criterion to close the window."},
    )
    host_step: str = field(
        default="auto",
        metadata={"help": "The rules of the host AdamW step (docs/how-it-works.md). \"auto\" (the default): the "
                  "project's measured rules: the step's learning rate multiplied by each window's length while lr x "
                  f"multiplier stays under {AUTO_HOST_LR_CAP:g} / sqrt(write-back lag), shorter windows above peak "
                  f"lr x update_interval = {HIGH_LR_RULE_THRESHOLD:g}, a guard against host steps that overshoot "
                  "there, and the result written back into the next window after one step per 2**31 elements of "
                  "host columns (at least 1, at most the window; decided from sizes: the same script and seed give "
                  "the same weights). "
                  "\"zenflow\": ZenFlow's and DeepSpeed's schedule: one AdamW step per window at the configured lr, "
                  "written back at the next window boundary (what ZenFlowConfig.from_deepspeed gives).",
                  "choices": _HOST_STEPS},
    )
    min_offload_numel: int = field(
        default=MIN_OFFLOAD_NUMEL,
        metadata={"help": "Matrices with fewer elements are updated entirely on the device every step, like 1-D "
                  f"parameters. The default ({MIN_OFFLOAD_NUMEL} = 2**18 elements, 1 MiB in fp32) keeps LoRA "
                  "adapters, classification heads and other small matrices on the device, where their AdamW state "
                  "costs little and every step counts; no weight matrix of a model with 1B+ parameters is that "
                  "small. 0 offloads every matrix. device_memory_limit_bytes may lower it for the run, so that the "
                  "step fits the limit (stats()[\"min_offload_numel\"])."},
    )
    host_state: str = field(
        default="auto",
        metadata={"help": "The host state of the offloaded matrices, a preset of the engine's host-state rules "
                  "(docs/host-memory.md). \"auto\" (the default): bf16 AdamW moments (updated in fp32 against the "
                  "fp32 master, rounded back stochastically with reproducible random bits), the window summed on the "
                  "host or on the device, as the planner chooses at the first step from the memory each side has "
                  "left (logged, stats()[\"accumulate_on\"], checkpoints): on the host a bf16 sum of the columns "
                  "not on the device, on the device an fp32 or bf16 sum; the write-back from the fp32 master where "
                  "it is a plain copy (a CPU device), from a buffer in the weight's dtype where copies are "
                  "asynchronous (CUDA); each offloaded gradient freed in its backward hook where that applies (one "
                  "process, host sums; clip through optimizer.clip_grad_norm_). \"fp32\": fp32 moments and fp32 "
                  "window sums of every column, torch's AdamW arithmetic for every element. \"lean\": the smallest "
                  "host state: 8-bit moments (one fp32 scale per block of 256), a bf16 window sum of the unselected "
                  "columns only, the write-back from the fp32 master on one process (on CUDA through a ring of pinned "
                  "chunks).",
                  "choices": HOST_STATE_CHOICES},
    )
    device_memory_limit_bytes: int | None = field(
        default=None,
        metadata={"help": "The whole device memory, in bytes, the training step may hold (weights, gradients, "
                  "optimizer state, window sums; not activations). At the first step the run's min_offload_numel "
                  "is lowered until the estimated peak fits: matrices under it are offloaded too, largest first "
                  "(decided from sizes alone, logged once, in stats()[\"min_offload_numel\"] and checkpoints; a "
                  "warning when even offloading every matrix cannot fit). It is also the room accumulate_on=\"auto\" "
                  "weighs: it sums on the device only when the sums fit in the limit less the estimated peak, with "
                  "its margin (on CUDA also within the measured free memory). None: no such limit; on CUDA the "
                  "measured free memory decides where windows are summed, on a CPU device the room is unknown and "
                  "they are summed on the host."},
    )
    cpu_threads: int | None = field(
        default=None,
        metadata={"help": "Threads of the host worker (host AdamW and accumulation). None = half the cores in this "
                  "process's CPU affinity; more than those cores is clamped to them. When something is offloaded, the "
                  "training thread keeps the remaining cores from the optimizer's construction to the end of the run "
                  "(docs/threads.md)."},
    )

    def __post_init__(self) -> None:
        if isinstance(self.topk_ratio, bool) or not isinstance(self.topk_ratio, (int, float)) or not (
            0.0 <= float(self.topk_ratio) <= 1.0
        ) or math.isnan(float(self.topk_ratio)):
            _fail("topk_ratio", self.topk_ratio, "a float in [0, 1] (0.1 is typical)")
        self.topk_ratio = float(self.topk_ratio)
        self.update_interval = parse_int_or_auto("update_interval", self.update_interval)
        for f in fields(self):  # the string choices (select_strategy, host_state), in any case
            choices = f.metadata.get("choices")
            given = getattr(self, f.name)
            if not choices:
                continue
            value = given.strip().lower() if isinstance(given, str) else given
            if value not in choices:
                _fail(f.name, given, " | ".join(f'"{c}"' for c in choices))
            setattr(self, f.name, value)
        self.select_interval = parse_int_or_auto("select_interval", self.select_interval)
        if self.select_strategy == "auto" and self.select_interval != "auto":
            raise ValueError(
                f'ZenFlowConfig.select_interval={self.select_interval!r} is invalid with select_strategy="auto": '
                'allowed is "auto"; set select_strategy to "step" or "epoch" to choose the interval yourself.'
            )
        if not _is_int(self.full_warm_up_rounds) or self.full_warm_up_rounds < 0:
            _fail("full_warm_up_rounds", self.full_warm_up_rounds, "an integer >= 0")
        if not isinstance(self.overlap_step, bool):
            _fail("overlap_step", self.overlap_step, "True or False")
        if isinstance(self.auto_ratio, bool) or not isinstance(self.auto_ratio, (int, float)) or not (
            0.0 < float(self.auto_ratio) <= 1.0
        ):
            _fail("auto_ratio", self.auto_ratio, "a float in (0, 1]")
        self.auto_ratio = float(self.auto_ratio)
        # the rules the choices above stand for, with a test's or a study's changes (`with_rules`)
        self.rules = EngineRules.resolve(self, getattr(self, "_rule_changes", {}))
        self.rules.check_window(*self.writeback_lag_bound())
        if not _is_int(self.min_offload_numel) or self.min_offload_numel < 0:
            _fail("min_offload_numel", self.min_offload_numel, "an integer >= 0")
        if self.device_memory_limit_bytes is not None and (
            not _is_int(self.device_memory_limit_bytes) or self.device_memory_limit_bytes < 0
        ):
            _fail("device_memory_limit_bytes", self.device_memory_limit_bytes, "None or an integer >= 0")
        if self.cpu_threads is not None and (not _is_int(self.cpu_threads) or self.cpu_threads < 1):
            _fail("cpu_threads", self.cpu_threads, "None (derive from CPU affinity) or an integer >= 1")

    # ----------------------------------------------------------------------------------------------------------------
    def writeback_lag_bound(self) -> tuple[int, str]:
        """The largest `EngineRules.writeback_lag` (a window's length: a later write-back would come after the next
        window has closed) and where it comes from: `update_interval`, or the longest Zen-auto window with ``"auto"``
        windows."""
        if _is_int(self.update_interval):
            return self.update_interval, "update_interval"
        return self.rules.auto_max_interval, "the longest \"auto\" window"

    @classmethod
    def choices(cls, name: str) -> tuple[str, ...]:
        """The values the string setting `name` allows (its metadata's ``choices``)."""
        return next(f.metadata["choices"] for f in fields(cls) if f.name == name)

    @property
    def is_auto_interval(self) -> bool:
        return self.update_interval == "auto"

    @property
    def resolved_cpu_threads(self) -> int:
        """The host worker's threads: `cpu_threads` (clamped to the cores of this process's CPU affinity, with a
        warning), or half those cores (at least 1). The rule and why: `threads.py`, docs/threads.md."""
        from .threads import worker_threads  # (it imports torch: only here)

        return worker_threads(self.cpu_threads)

    def select_period(self, steps_per_epoch: int | None = None) -> int:
        """Optimizer steps between re-selections, as resolved from the strategy and the epoch length
        (`steps_per_epoch`, the data's, in optimizer steps: `ZenFlowAdamW.steps_per_epoch`; None: unknown).
        ``"epoch"`` with the epoch length unknown raises rather than never re-selecting."""
        interval = 1 if self.select_interval == "auto" else int(self.select_interval)
        if self.select_strategy == "step":
            return DEFAULT_SELECT_STEPS if self.select_interval == "auto" else interval
        if steps_per_epoch is None:
            if self.select_strategy == "epoch":
                raise ValueError(
                    'ZenFlowConfig.select_strategy="epoch" needs the epoch length: ZenFlowTrainer and '
                    "ZenFlowPlugin.prepare set it, a plain loop passes ZenFlowAdamW(..., steps_per_epoch=N) or calls "
                    'optimizer.set_steps_per_epoch(N) before the first step; or use select_strategy="step".'
                )
            return DEFAULT_SELECT_STEPS
        return interval * steps_per_epoch

    def with_rules(self, **changes: Any) -> ZenFlowConfig:
        """A copy whose engine rules (`EngineRules`, `self.rules`) have `changes` applied, checked like settings.
        For tests and studies of one rule; the changes are kept by `replace` and `to_dict` (checkpoints)."""
        changed = copy.copy(self)
        changed._rule_changes = {**getattr(self, "_rule_changes", {}), **changes}
        changed.__post_init__()
        return changed

    def changed_rules(self) -> dict[str, Any]:
        """The rules `with_rules` changed (the rest are what the choices stand for)."""
        return dict(getattr(self, "_rule_changes", {}))

    def replace(self, **changes: Any) -> ZenFlowConfig:
        """`dataclasses.replace` that keeps the rules changed by `with_rules` (which `dataclasses.replace`, making a
        new config from its fields alone, would drop)."""
        return dataclasses.replace(self, **changes).with_rules(**getattr(self, "_rule_changes", {}))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ZenFlowConfig) and self.to_dict() == other.to_dict()

    def to_dict(self) -> dict[str, Any]:
        """The settings, and under ``"rules"`` the rules `with_rules` changed (absent when none were)."""
        changes = getattr(self, "_rule_changes", {})
        return {**asdict(self), **({"rules": dict(changes)} if changes else {})}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ZenFlowConfig:
        removed = removed_settings_text(values)
        if removed:
            raise ValueError(f"ZenFlowConfig.from_dict: the {removed} in this version of hf_zenflow (settings "
                             "written by an earlier version).")
        values = dict(values)
        changes = values.pop("rules", None) or {}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"ZenFlowConfig got unknown field(s) {unknown}: allowed are {sorted(known)}.")
        return cls(**values).with_rules(**changes)

    @classmethod
    def from_deepspeed(cls, config: dict[str, Any] | str | os.PathLike) -> ZenFlowConfig:
        """Build from a DeepSpeed config: a dict, a JSON file path or JSON text, holding a whole config
        (``{"zero_optimization": {"zenflow": {...}}}``) or the ``zenflow`` block alone. Missing keys take
        DeepSpeed's defaults (``update_interval="auto"``, ``overlap_step=False``), and the host step is DeepSpeed's
        (``host_step="zenflow"``: one AdamW step per window at the configured lr, written back at the next window
        boundary), so a moved-over run behaves as it did under DeepSpeed.

        ``pt_reserved_cores_perc`` becomes ``cpu_threads`` (the cores not reserved for the training process);
        ``offload`` (GPU moments in pinned host memory) is not supported and is ignored with a warning. The rest of
        a DeepSpeed config (optimizer, clipping, bf16, batch sizes) moves over with
        `ZenFlowTrainingArguments.from_deepspeed`.

        Example:
            >>> ZenFlowConfig.from_deepspeed({"zero_optimization": {"zenflow": {"topk_ratio": 0.05,
            ...     "update_interval": 4, "overlap_step": True}}}).topk_ratio
            0.05
            >>> ZenFlowConfig.from_deepspeed({"topk_ratio": 0.1}).host_step  # (the zenflow block alone)
            'zenflow'
            >>> ZenFlowConfig.from_deepspeed("zf_config.json").update_interval  # doctest: +SKIP
            4
        """
        return cls(**zenflow_values(load(config)))
