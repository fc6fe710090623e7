"""`ZenFlowConfig`: the validated settings of a ZenFlow optimizer.

Field names follow DeepSpeed's `zero_optimization.zenflow` block so that a DeepSpeed config moves over unchanged
(`ZenFlowConfig.from_deepspeed`). Every invalid value fails here, at construction, with a `ValueError` that names the
field, the value and what is allowed.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal


SelectStrategy = Literal["auto", "step", "epoch"]

#: Re-selection period (in optimizer steps) used by ``select_strategy="auto"`` when the number of steps per epoch is
#: unknown (a plain training loop over an iterable dataset, say). DeepSpeed silently never re-selects in that case
#: (DeepSpeed #8456); we re-select on this fixed step period instead.
DEFAULT_SELECT_STEPS = 100

_SELECT_STRATEGIES = ("auto", "step", "epoch")
_ACCUMULATE_ON = ("host", "device")


def available_cpu_count() -> int:
    """Cores this process may run on: its CPU affinity, not `os.cpu_count()` (which ignores taskset/cgroups)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS/Windows have no sched_getaffinity
        return max(1, os.cpu_count() or 1)


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
            "columns with the largest gradient norm). 1.0 = every column on the device (plain AdamW); 0.0 = none "
            "(every matrix updated by the host AdamW only)."
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
            f"{DEFAULT_SELECT_STEPS} steps."
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
    auto_max_interval: int = field(
        default=16,
        metadata={"help": 'With update_interval="auto": a window never spans more than this many steps (bounded '
                  "staleness)."},
    )
    host_lr_scale: float | str = field(
        default="interval",
        metadata={"help": 'Learning-rate multiplier of the host AdamW step. The unselected columns take one AdamW '
                  'step per window, so they move about `update_interval` times less per optimizer step than under '
                  'AdamW; "interval" (the default) multiplies by the length of each window, restoring the per-step '
                  "rate: in paired runs it lost less held-out quality than 1.0 on every task and seed measured "
                  "(BENCHMARKS.md §4). 1.0 is ZenFlow's (and DeepSpeed's) rule."},
    )
    min_offload_numel: int = field(
        default=0,
        metadata={"help": "Matrices with fewer elements are updated entirely on the device every step, like 1-D "
                  "parameters (e.g. a classification head: tiny state, and every step matters)."},
    )
    accumulate_on: str = field(
        default="host",
        metadata={"help": 'Where the unselected gradient is summed over a window. "host": every step the whole '
                  "matrix gradient goes to the host and the worker adds it into an fp32 accumulator (no device "
                  'memory). "device": an fp32 accumulator per offloaded matrix stays on the device (+4 bytes per '
                  "offloaded parameter of device memory) and crosses the link once per window; the host then only "
                  "runs the AdamW. Use it when the host cannot keep up with one accumulation per step."},
    )
    cpu_threads: int | None = field(
        default=None,
        metadata={"help": "Threads of the host AdamW and of the host accumulation. None = the number of cores in "
                  "this process's CPU affinity (not os.cpu_count()). Independent of OMP_NUM_THREADS."},
    )
    steps_per_epoch: int | None = field(
        default=None,
        metadata={"help": 'Optimizer steps per epoch, used by select_strategy "epoch"/"auto". The Trainer fills '
                  "it in; a plain loop may pass it."},
    )

    def __post_init__(self) -> None:
        if isinstance(self.topk_ratio, bool) or not isinstance(self.topk_ratio, (int, float)) or not (
            0.0 <= float(self.topk_ratio) <= 1.0
        ) or math.isnan(float(self.topk_ratio)):
            _fail("topk_ratio", self.topk_ratio, "a float in [0, 1] (0.1 is typical)")
        self.topk_ratio = float(self.topk_ratio)
        self.update_interval = parse_int_or_auto("update_interval", self.update_interval)
        if self.select_strategy not in _SELECT_STRATEGIES:
            _fail("select_strategy", self.select_strategy, " | ".join(f'"{s}"' for s in _SELECT_STRATEGIES))
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
        if not _is_int(self.auto_max_interval) or self.auto_max_interval < 1:
            _fail("auto_max_interval", self.auto_max_interval, "an integer >= 1")
        if isinstance(self.host_lr_scale, str) and self.host_lr_scale.strip().lower() == "interval":
            self.host_lr_scale = "interval"
        else:
            try:
                scale = float(self.host_lr_scale)
            except (TypeError, ValueError):
                scale = float("nan")
            if isinstance(self.host_lr_scale, bool) or not scale > 0 or math.isinf(scale):
                _fail("host_lr_scale", self.host_lr_scale, 'a float > 0 or "interval"')
            self.host_lr_scale = scale
        if not _is_int(self.min_offload_numel) or self.min_offload_numel < 0:
            _fail("min_offload_numel", self.min_offload_numel, "an integer >= 0")
        if self.accumulate_on not in _ACCUMULATE_ON:
            _fail("accumulate_on", self.accumulate_on, " | ".join(f'"{s}"' for s in _ACCUMULATE_ON))
        if self.cpu_threads is not None and (not _is_int(self.cpu_threads) or self.cpu_threads < 1):
            _fail("cpu_threads", self.cpu_threads, "None (derive from CPU affinity) or an integer >= 1")
        if self.steps_per_epoch is not None and (not _is_int(self.steps_per_epoch) or self.steps_per_epoch < 1):
            _fail("steps_per_epoch", self.steps_per_epoch, "None or an integer >= 1")
        if self.select_strategy == "epoch" and self.steps_per_epoch is None:
            # Not an error: the Trainer fills steps_per_epoch in later. The optimizer raises if it is still unknown
            # when the first re-selection is due, rather than silently never re-selecting (DeepSpeed #8456).
            pass

    # ----------------------------------------------------------------------------------------------------------------
    @property
    def is_auto_interval(self) -> bool:
        return self.update_interval == "auto"

    @property
    def resolved_cpu_threads(self) -> int:
        """`cpu_threads`, or half the cores of this process's CPU affinity (at least 1): the other half stays with
        the training thread. Sharing every core oversubscribes them (both sides' OpenMP threads spin-wait), which
        was measured to make a host step >100x slower on a busy 2-core machine."""
        if self.cpu_threads is not None:
            return self.cpu_threads
        return max(1, available_cpu_count() // 2)

    def select_period(self) -> int:
        """Optimizer steps between re-selections, as resolved from the strategy and the epoch length."""
        interval = 1 if self.select_interval == "auto" else int(self.select_interval)
        if self.select_strategy == "step":
            return DEFAULT_SELECT_STEPS if self.select_interval == "auto" else interval
        if self.steps_per_epoch is None:
            if self.select_strategy == "epoch":
                raise ValueError(
                    'ZenFlowConfig.select_strategy="epoch" needs steps_per_epoch (an integer >= 1); the Trainer '
                    'sets it, a plain loop must pass it, or use select_strategy="step".'
                )
            return DEFAULT_SELECT_STEPS
        return interval * self.steps_per_epoch

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ZenFlowConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"ZenFlowConfig got unknown field(s) {unknown}: allowed are {sorted(known)}.")
        return cls(**values)

    @classmethod
    def from_deepspeed(cls, config: dict[str, Any]) -> ZenFlowConfig:
        """Build from a DeepSpeed config: a whole config (``{"zero_optimization": {"zenflow": {...}}}``) or the
        ``zenflow`` block alone. Missing keys take DeepSpeed's defaults (``update_interval="auto"``,
        ``overlap_step=False``), so a moved-over run behaves as it did under DeepSpeed.

        ``pt_reserved_cores_perc`` becomes ``cpu_threads`` (the cores not reserved for the training process);
        ``offload`` (GPU moments in pinned host memory) is not supported and is ignored with a warning.

        Example:
            >>> ZenFlowConfig.from_deepspeed({"zero_optimization": {"zenflow": {"topk_ratio": 0.05,
            ...     "update_interval": 4, "overlap_step": True}}}).topk_ratio
            0.05
        """
        if not isinstance(config, dict):
            raise ValueError(f"ZenFlowConfig.from_deepspeed needs a dict, got {type(config).__name__}.")
        block = config
        if "zero_optimization" in config:
            block = config["zero_optimization"].get("zenflow")
            if block is None:
                raise ValueError("ZenFlowConfig.from_deepspeed: the config has no zero_optimization.zenflow block.")
        if not isinstance(block, dict):
            raise ValueError(f"ZenFlowConfig.from_deepspeed: the zenflow block must be a dict, got {block!r}.")
        block = dict(block)
        values: dict[str, Any] = {
            "topk_ratio": 0.1,
            "select_strategy": "auto",
            "select_interval": "auto",
            "update_interval": "auto",
            "overlap_step": False,
            "auto_ratio": 0.99,
            "full_warm_up_rounds": 0,
            "host_lr_scale": 1.0,  # DeepSpeed applies no compensation to the host step
        }
        if block.pop("offload", False):
            warnings.warn(
                "ZenFlowConfig.from_deepspeed: 'offload' (device-side moments kept in pinned host memory) is not "
                "supported by hf_zenflow and is ignored: the selected columns' moments stay on the device.",
                stacklevel=2,
            )
        block.pop("steps_per_epoch", None)  # internal in DeepSpeed, filled by the trainer here
        perc = block.pop("pt_reserved_cores_perc", None)
        if perc is not None:
            if isinstance(perc, bool) or not isinstance(perc, (int, float)) or not 0.0 <= perc <= 1.0:
                raise ValueError(
                    f"ZenFlowConfig.from_deepspeed: pt_reserved_cores_perc={perc!r} is invalid: allowed is a float "
                    "in [0, 1]."
                )
            n = available_cpu_count()
            reserved = math.ceil(perc * n)
            values["cpu_threads"] = n if reserved in (0, n) else n - reserved
        allowed = {"topk_ratio", "select_strategy", "select_interval", "update_interval", "overlap_step",
                   "auto_ratio", "full_warm_up_rounds"}
        unknown = sorted(set(block) - allowed)
        if unknown:
            raise ValueError(
                f"ZenFlowConfig.from_deepspeed: unknown zenflow key(s) {unknown}: allowed are "
                f"{sorted(allowed | {'offload', 'pt_reserved_cores_perc', 'steps_per_epoch'})}."
            )
        values.update(block)
        return cls(**values)
