"""The settings `hf-zenflow tune` tries: one grid point (`TrialSetting`: topk_ratio, update_interval, host_step)
rendered as training arguments and flags, the grid in the order a budget trims it, and the parsing of settings given
on the command line."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hf_zenflow.settings.config import ZenFlowConfig
from hf_zenflow.settings.rules import split_rules


GRID_TOPK: tuple[float, ...] = (0.05, 0.1, 0.2)
GRID_INTERVAL: tuple[int | str, ...] = (1, 2, 4, 8, "auto")
#: the host step's rules: the measured ones ("auto") and ZenFlow's and DeepSpeed's ("zenflow")
GRID_HOST_STEP: tuple[str, ...] = ZenFlowConfig.choices("host_step")


@dataclass(frozen=True)
class TrialSetting:
    """One point of the grid: the ZenFlow settings a trial varies (the rest are the library defaults)."""

    topk_ratio: float
    update_interval: int | str
    host_step: str = ZenFlowConfig.__dataclass_fields__["host_step"].default

    @property
    def label(self) -> str:
        step = "" if self.host_step == "auto" else f" {self.host_step}"
        return f"r={self.topk_ratio:g} U={self.update_interval}{step}"

    def config_kwargs(self) -> dict[str, Any]:
        return {"topk_ratio": self.topk_ratio, "update_interval": self.update_interval, "host_step": self.host_step}

    def config(self, **extra: Any) -> ZenFlowConfig:
        """The full `ZenFlowConfig` of this setting (library defaults elsewhere): validates it."""
        return ZenFlowConfig(**self.config_kwargs(), **extra)

    def training_arguments_code(self) -> str:
        def arg(v: Any) -> str:
            return repr(str(v)) if isinstance(v, str) else repr(v)

        return (f"ZenFlowTrainingArguments(output_dir=..., zenflow_topk_ratio={self.topk_ratio!r}, "
                f"zenflow_update_interval={arg(self.update_interval)}, zenflow_host_step={arg(self.host_step)})")

    def cli_flags(self) -> str:
        return (f"--zenflow_topk_ratio {self.topk_ratio:g} --zenflow_update_interval {self.update_interval} "
                f"--zenflow_host_step {self.host_step}")


def parse_value(text: str) -> Any:
    """A command-line value as `ZenFlowConfig` takes it: bool, int, float, else the string ("auto", "interval").

    Example:
        >>> [parse_value(v) for v in ("262144", "0.5", "False", "auto")]
        [262144, 0.5, False, 'auto']
    """
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_settings(text: str) -> dict[str, Any]:
    """``"KEY=VALUE KEY=VALUE"`` -> a dict of `parse_value` values ("defaults" or "" -> {})."""
    if text.strip() in ("", "defaults"):
        return {}
    return {k: parse_value(v) for k, v in (kv.split("=", 1) for kv in text.split())}


def study_config(values: dict[str, Any]) -> ZenFlowConfig:
    """The `ZenFlowConfig` of `values` (e.g. `parse_settings`'): the settings among them as settings, the engine's
    rules (`EngineRules`, for a study of one rule: ``host_moment_dtype=float32``) through `ZenFlowConfig.with_rules`.

    Example:
        >>> study_config(parse_settings("topk_ratio=0.2 host_moment_dtype=float32")).rules.host_moment_dtype
        'float32'
    """
    settings, rules = split_rules(values)
    return ZenFlowConfig(**settings).with_rules(**rules)


def library_default_setting() -> TrialSetting:
    d = ZenFlowConfig()
    return TrialSetting(d.topk_ratio, d.update_interval, d.host_step)


def default_grid(topk: Sequence[float] = GRID_TOPK, intervals: Sequence[int | str] = GRID_INTERVAL,
                 host_steps: Sequence[str] = GRID_HOST_STEP) -> list[TrialSetting]:
    """Every combination, in the order a budget trims it: the library default first, then the update_interval x
    host_step sweep at the default topk_ratio, then the other ratios. ``update_interval=1`` takes the default
    host_step only (a one-step window is written back one step later at one AdamW step's rate under either)."""
    default = library_default_setting()
    seen: set[TrialSetting] = set()
    out: list[TrialSetting] = []

    def add(s: TrialSetting) -> None:
        if s.update_interval == 1:
            s = dataclasses.replace(s, host_step=default.host_step)
        if s not in seen:
            seen.add(s)
            out.append(s)

    if default.topk_ratio in topk and default.update_interval in intervals:
        add(default)
    ratios = sorted(topk, key=lambda r: (abs(r - default.topk_ratio), r))
    for r in ratios:
        for u in intervals:
            for step in host_steps:
                add(TrialSetting(float(r), u, step))
    return out
