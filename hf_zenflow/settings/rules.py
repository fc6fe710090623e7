"""`EngineRules`: the engine's finer rules, behind the few choices `ZenFlowConfig` offers.

A user sets a handful of settings (`ZenFlowConfig`); each choice among them stands for a set of rules the engine
follows, with the constants the project measured (docs/quality.md, docs/memory.md). The rules are not settings: no
flag, environment variable or Trainer field reaches them. Tests and studies that examine one rule on its own change it
on a config with `ZenFlowConfig.with_rules`, which validates the change like a setting and keeps it in the config's
`to_dict()`, so a checkpoint of such a run resumes under the same rules.

`ZenFlowConfig.host_state` chooses the host state's rules (`host_state_rules`: where windows are summed, the moments'
and sums' precision, the write-back, the freeing of gradients), `ZenFlowConfig.host_step` the rules of the host step
(`HOST_STEP_RULES`): ``"auto"`` the project's measured ones (`host_lr_scale`, `high_lr_rule`, `host_step_guard` and
`writeback_lag` all ``"auto"``), ``"zenflow"`` ZenFlow's and DeepSpeed's schedule (one AdamW step per window at the
configured lr, written back at the next window boundary).

Example:
    >>> from hf_zenflow import ZenFlowConfig
    >>> ZenFlowConfig().rules.auto_max_interval
    16
    >>> ZenFlowConfig(update_interval="auto").with_rules(auto_max_interval=8).rules.auto_max_interval
    8
    >>> ZenFlowConfig(host_step="zenflow").rules.host_lr_scale
    1.0
    >>> ZenFlowConfig(host_state="lean").rules.host_moment_dtype
    'int8'
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any


#: The longest Zen-auto window (`update_interval="auto"`), in optimizer steps: the staleness bound of the host
#: columns when the gradient mass is slow to balance. DeepSpeed's ZenFlow bounds it the same way.
AUTO_MAX_INTERVAL = 16

#: `host_lr_scale="auto"`: the largest learning rate a window's host step takes (lr × multiplier) when its result is
#: written back 1 step into the next window; a lag of L steps divides it by sqrt(L). Set by the quality suite
#: (`scripts/quality_suite.py`, BENCHMARKS.md "Quality: the size of the host step"): a host step above it diverged a
#: model from scratch (an un-normalised block, lr 1e-3 x 4 and 5e-4 x 4) and cost MiniLM +6 % held-out loss at lr 3e-4
#: x 4, while the window's multiplier stays necessary at fine-tuning rates (MiniLM at 5e-5: x1 costs +5.7 %, x4 +0.25
#: %). A cap of 2e-3 with `host_step_guard` diverged nothing but cost the pretrained tiny Llama's fine-tune +2-3 % at
#: 3e-4 - 1e-3.
AUTO_HOST_LR_CAP = 5e-4

#: `high_lr_rule="auto"`: above peak lr × update_interval > this, windows are shortened to floor(this / lr) steps.
#: Measured on the tiny Llama (30 steps, U=4, 5 paired seeds, BENCHMARKS.md "Quality: high learning rates").
HIGH_LR_RULE_THRESHOLD = 5e-3

#: `host_step_guard="auto"`'s ratio, where it watches (windows shortened by `high_lr_rule`): a host result is taken
#: to have overshot when the first gradient that sees it has a total norm above this multiple of the largest of the
#: last `HOST_STEP_GUARD_HISTORY` norms before it (BENCHMARKS.md "Quality: the size of the host step"). The largest
#: recent norm, not the last one: while fine-tuning a norm can triple from one batch to the next, within the spread
#: the steps before it already showed.
HOST_STEP_GUARD_RATIO = 2.5

#: `host_step_guard` compares the first gradient norm after a write-back with the largest of this many norms before it.
HOST_STEP_GUARD_HISTORY = 4

#: `host_step_guard` cuts the host step's learning rate at each overshoot, down to this fraction of it.
HOST_STEP_GUARD_MIN_FACTOR = 0.125

#: The rules of the host step each `ZenFlowConfig.host_step` choice stands for.
HOST_STEP_RULES: dict[str, dict[str, Any]] = {
    "auto": {"host_lr_scale": "auto", "high_lr_rule": "auto", "host_step_guard": "auto", "writeback_lag": "auto"},
    # ZenFlow's (and DeepSpeed's) own schedule: one AdamW step per window at the configured lr, written back at the
    # next window boundary, at every learning rate
    "zenflow": {"host_lr_scale": 1.0, "high_lr_rule": "off", "host_step_guard": "off", "writeback_lag": None},
}

_HIGH_LR_RULES = ("auto", "off")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fail(name: str, value: Any, allowed: str) -> None:
    raise ValueError(f"EngineRules.{name}={value!r} is invalid: allowed is {allowed}.")


def _word(value: Any, words: tuple[str, ...]) -> str | None:
    """`value` as one of `words` (any case, spaces around), or None."""
    if isinstance(value, str) and value.strip().lower() in words:
        return value.strip().lower()
    return None


def _number_above(name: str, value: Any, low: float, allowed: str) -> float:
    """`value` (a number, or text holding one) as a finite float > `low`."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if isinstance(value, bool) or not number > low or math.isinf(number):
        _fail(name, value, allowed)
    return number


def split_rules(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`values` (``KEY=VALUE`` pairs of a study's command line, say) split into `ZenFlowConfig` settings and engine
    rules, so that a script builds ``ZenFlowConfig(**settings).with_rules(**rules)``.

    Example:
        >>> split_rules({"topk_ratio": 0.2, "host_lr_scale": 1.0})
        ({'topk_ratio': 0.2}, {'host_lr_scale': 1.0})
    """
    rules = {k: v for k, v in values.items() if k in EngineRules.names()}
    return {k: v for k, v in values.items() if k not in rules}, rules


#: The values of each host-state rule (`ZenFlowConfig.host_state` chooses among them: `host_state_rules`).
ACCUMULATE_ON = ("auto", "host", "device", "device_bf16")
#: The resolved `accumulate_on` values that sum on the device.
DEVICE_SUMS = ("device", "device_bf16")
HOST_MOMENT_DTYPES = ("float32", "bfloat16", "int8")
HOST_SUM_DTYPES = ("float32", "bfloat16")
HOST_SUM_COLUMNS = ("all", "unselected")
HOST_WRITEBACKS = ("auto", "buffer", "master")
FREE_GRADIENTS = ("auto", "on", "off")

#: The presets of `ZenFlowConfig.host_state`: the host-state rules each stands for (docs/host-memory.md). "auto":
#: bf16 moments kept with stochastic rounding, the window summed where the planner puts it (on the host: in bf16, the
#: unselected columns only), the write-back from the fp32 master where that is a plain copy; "fp32": fp32 moments and
#: fp32 window sums of every column, torch's AdamW arithmetic for every element; "lean": the smallest host state
#: (8-bit moments, a bf16 window sum of the unselected columns only, the write-back from the fp32 master wherever it
#: applies).
HOST_STATES: dict[str, dict[str, str]] = {
    "auto": {"accumulate_on": "auto", "host_moment_dtype": "bfloat16", "host_sum_dtype": "bfloat16",
             "host_sum_columns": "unselected", "host_writeback": "auto", "free_gradients_in_backward": "auto"},
    "fp32": {"accumulate_on": "auto", "host_moment_dtype": "float32", "host_sum_dtype": "float32",
             "host_sum_columns": "all", "host_writeback": "auto", "free_gradients_in_backward": "auto"},
    "lean": {"accumulate_on": "auto", "host_moment_dtype": "int8", "host_sum_dtype": "bfloat16",
             "host_sum_columns": "unselected", "host_writeback": "master", "free_gradients_in_backward": "auto"},
}


def host_state_rules(host_state: str) -> dict[str, str]:
    """The host-state rules the preset `host_state` ("auto", "fp32" or "lean") stands for; the engine
    (`EngineRules.resolve`) and `hf-zenflow estimate` resolve a preset through this one function.

    Example:
        >>> host_state_rules("fp32")["host_moment_dtype"]
        'float32'
    """
    if host_state not in HOST_STATES:
        raise ValueError(f"host_state={host_state!r} is invalid: allowed is "
                         f"{' | '.join(repr(name) for name in HOST_STATES)}.")
    return dict(HOST_STATES[host_state])


@dataclass(frozen=True)
class EngineRules:
    """The rules a `ZenFlowConfig` resolves to (`config.rules`).

    Each field's default is the rule the default choices stand for (``host_state="auto"``, ``host_step="auto"``);
    `ZenFlowConfig.with_rules` changes one for a test or a study.
    """

    #: Zen-auto windows close after at most this many steps (`AUTO_MAX_INTERVAL`).
    auto_max_interval: int = AUTO_MAX_INTERVAL
    #: Where the unselected gradient is summed over a window. "host": every step the whole matrix gradient goes to
    #: the host, whose worker adds it into the window sum (no device memory). "device": an fp32 sum per offloaded
    #: matrix stays on the device (+4 bytes per offloaded parameter) and crosses the link once per window (the same
    #: results). "device_bf16": the same in bf16 (+2 bytes; each step adds in fp32 and rounds the running sum to
    #: bf16), sent as bf16 and widened on the host. "auto": the planner's choice at the first step
    #: (`engine.planner`): the fastest of the three that fits the device memory and the host RAM left, by the bound
    #: model, never by timings; logged, in stats() and checkpoints (docs/memory.md).
    accumulate_on: str = "auto"
    #: The host AdamW moments' dtype: "bfloat16" (widened to fp32 for the update, rounded back stochastically with
    #: reproducible random bits kept in checkpoints), "float32" (torch's AdamW arithmetic for every element), or
    #: "int8" (8-bit codes with one fp32 scale per block of 256 elements, updated in fp32 and quantised again
    #: stochastically in the same pass). The device columns keep fp32 moments (docs/host-memory.md).
    host_moment_dtype: str = "bfloat16"
    #: The dtype of a window summed on the host: "float32", or "bfloat16" (each add computed in fp32 and the running
    #: sum rounded to nearest bf16, `accumulate_on="device_bf16"`'s rule on the host). Not with device sums, which
    #: keep their own dtype.
    host_sum_dtype: str = "bfloat16"
    #: Which columns the host's window sum keeps: "all" (one contiguous add per step) or "unselected" (only the
    #: columns not on the device: topk_ratio x the sum's bytes less; the same weights bit for bit with fp32 and bf16
    #: moments; with int8 moments the never-read device columns' codes change their blocks' scales). With device
    #: sums, the accumulator they land in, where they are copied to the host (CUDA).
    host_sum_columns: str = "unselected"
    #: Where a window's host result is written back from: "buffer" (rounded by the worker into a buffer in the
    #: weight's dtype: copied on CUDA through a ring of pinned chunks, swapped in as the weight's storage on a CPU
    #: device) or "master" (no buffer: the training thread copies the fp32 master into the weight, the same weights
    #: bit for bit; on CUDA piece by piece through the ring, `transport.ring`, rounding each piece at the
    #: write-back). "master" applies on one process; with a host state shared by several ranks the buffer stays,
    #: with a warning when asked for by `with_rules`, logged at info level when a preset asked for it. "auto": the
    #: master where it applies, else the buffer, silently.
    host_writeback: str = "auto"
    #: Free each offloaded matrix's device gradient in its backward hook (the selected columns gathered on the
    #: device, the whole gradient sent to the host), with host sums on one process or FSDP2 ranks (docs/memory.md):
    #: "auto" from the first step under ZenFlowTrainer and `hf-zenflow compare` (they clip through the optimizer),
    #: in a plain loop from the step after the first optimizer.clip_grad_norm_; "on" / "off": from the first step /
    #: never.
    free_gradients_in_backward: str = "auto"

    #: The host AdamW's learning-rate multiplier: a float > 0; "interval" (the window's length: the unselected
    #: columns move at AdamW's per-step rate); "auto" ("interval" while lr x multiplier stays under
    #: `AUTO_HOST_LR_CAP` / sqrt(write-back lag), the multiplier reaching that cap above it, never below 1.0).
    host_lr_scale: float | str = "auto"
    #: "auto": windows shortened, and the host beta1 lowered, where peak lr x update_interval exceeds
    #: `HIGH_LR_RULE_THRESHOLD` (`engine.host_lr.high_lr_window`); "off": the configured windows at every lr.
    high_lr_rule: str = "auto"
    #: The ratio of the first gradient norm after a write-back to the largest recent ones above which the host lr is
    #: cut (`engine.host_guard`): a float > 1; "auto" (`HOST_STEP_GUARD_RATIO` where `high_lr_rule` shortened the
    #: windows, not watching elsewhere); "off".
    host_step_guard: float | str = "auto"
    #: With overlap_step: after how many steps of the next window a window's host result is written back: an integer
    #: from 1 to the window's length, None (at the next window boundary) or "auto" (from the elements of host columns,
    #: `engine.writeback_lag`).
    writeback_lag: int | str | None = "auto"

    def __post_init__(self) -> None:
        if not _is_int(self.auto_max_interval) or self.auto_max_interval < 1:
            _fail("auto_max_interval", self.auto_max_interval, "an integer >= 1")
        for name, choices in _CHOICES.items():  # in any case, like the settings' choices
            given = getattr(self, name)
            value = given.strip().lower() if isinstance(given, str) else given
            if value not in choices:
                _fail(name, given, " | ".join(f'"{c}"' for c in choices))
            object.__setattr__(self, name, value)
        if self.host_sum_dtype != "float32" and self.accumulate_on in DEVICE_SUMS:
            raise ValueError(
                f"EngineRules.host_sum_dtype={self.host_sum_dtype!r} is invalid with "
                f"accumulate_on={self.accumulate_on!r}: allowed is \"float32\" (the window is summed on the device, "
                'in the dtype accumulate_on names); host_sum_dtype applies with accumulate_on "host" or "auto".'
            )
        scale = _word(self.host_lr_scale, ("interval", "auto"))
        if scale is None:
            scale = _number_above("host_lr_scale", self.host_lr_scale, 0.0, 'a float > 0, "interval" or "auto"')
        object.__setattr__(self, "host_lr_scale", scale)
        rule = _word(self.high_lr_rule, _HIGH_LR_RULES)
        if rule is None:
            _fail("high_lr_rule", self.high_lr_rule, " | ".join(f'"{c}"' for c in _HIGH_LR_RULES))
        object.__setattr__(self, "high_lr_rule", rule)
        guard = _word(self.host_step_guard, ("off", "auto"))
        if guard is None:
            guard = _number_above("host_step_guard", self.host_step_guard, 1.0, 'a float > 1, "auto" or "off"')
        object.__setattr__(self, "host_step_guard", guard)
        lag = self.writeback_lag
        if _word(lag, ("none",)):
            lag = None  # (text cannot carry None)
        elif _word(lag, ("auto",)):
            lag = "auto"
        elif isinstance(lag, str) and lag.strip().isdigit():
            lag = int(lag)
        if lag is not None and lag != "auto" and (not _is_int(lag) or lag < 1):
            _fail("writeback_lag", self.writeback_lag, 'None (the next window boundary), "auto" or an integer >= 1')
        object.__setattr__(self, "writeback_lag", lag)

    def check_window(self, top: int, bound: str) -> None:
        """Refuse a `writeback_lag` beyond a window's length `top` (`ZenFlowConfig.writeback_lag_bound`, `bound`
        naming where it comes from): a later write-back would come after the next window has closed."""
        if _is_int(self.writeback_lag) and self.writeback_lag > top:
            _fail("writeback_lag", self.writeback_lag,
                  f'None (the next window boundary), "auto" or an integer from 1 to {bound} ({top})')

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def resolve(cls, config: Any, changes: dict[str, Any]) -> EngineRules:
        """The rules `config`'s choices stand for (`config`: a `ZenFlowConfig`, whose module imports this one: its
        `host_state` preset, `host_state_rules`, and its `host_step`, `HOST_STEP_RULES`), with `changes` (a test's or
        a study's) applied. An unknown rule fails, naming the ones there are."""
        unknown = sorted(set(changes) - set(cls.names()))
        if unknown:
            raise ValueError(f"ZenFlowConfig.with_rules got unknown rule(s) {unknown}: allowed are "
                             f"{sorted(cls.names())}.")
        rules = {**host_state_rules(config.host_state), **HOST_STEP_RULES[config.host_step]}
        if _word(changes.get("accumulate_on"), DEVICE_SUMS):
            # the preset's dtype of a window summed on the host does not apply to sums on the device
            rules.update(host_sum_dtype="float32")
        return cls(**{**rules, **changes})


#: The string rules and the values each allows.
_CHOICES = {"accumulate_on": ACCUMULATE_ON, "host_moment_dtype": HOST_MOMENT_DTYPES,
            "host_sum_dtype": HOST_SUM_DTYPES, "host_sum_columns": HOST_SUM_COLUMNS, "host_writeback": HOST_WRITEBACKS,
            "free_gradients_in_backward": FREE_GRADIENTS}
