"""The settings `hf-zenflow tune` tries: one grid point (`TrialSetting`: topk_ratio, update_interval,
host_lr_scale, writeback_lag) rendered as training arguments and flags, the grid in the order a budget trims it, and
the parsing of settings given on the command line."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hf_zenflow.settings.config import ZenFlowConfig
from hf_zenflow.settings.rules import EngineRules


GRID_TOPK: tuple[float, ...] = (0.05, 0.1, 0.2)
GRID_INTERVAL: tuple[int | str, ...] = (1, 2, 4, 8, "auto")
GRID_SCALE: tuple[float | str, ...] = (1.0, "interval")
#: write-back lags (None: the next window boundary, ZenFlow's schedule); tried at the default topk_ratio and
#: host_lr_scale only, and only for windows longer than a step (a one-step window has one lag)
GRID_LAG: tuple[int | str | None, ...] = (1, "auto", None)


@dataclass(frozen=True)
class TrialSetting:
    """One point of the grid: the ZenFlow settings a trial varies (the rest are the library defaults)."""

    topk_ratio: float
    update_interval: int | str
    host_lr_scale: float | str
    writeback_lag: int | str | None = ZenFlowConfig.__dataclass_fields__["writeback_lag"].default

    @property
    def label(self) -> str:
        scale = {"interval": "xU", "auto": "xauto"}.get(str(self.host_lr_scale))
        scale = scale or f"x{float(self.host_lr_scale):g}"
        lag = "" if self.writeback_lag == "auto" else f" lag={self.writeback_lag or 'U'}"
        return f"r={self.topk_ratio:g} U={self.update_interval} lr{scale}{lag}"

    def config_kwargs(self) -> dict[str, Any]:
        return {"topk_ratio": self.topk_ratio, "update_interval": self.update_interval,
                "host_lr_scale": self.host_lr_scale, "writeback_lag": self.writeback_lag}

    def config(self, **extra: Any) -> ZenFlowConfig:
        """The full `ZenFlowConfig` of this setting (library defaults elsewhere): validates it."""
        return ZenFlowConfig(**self.config_kwargs(), **extra)

    def training_arguments_code(self) -> str:
        def arg(v: Any) -> str:
            return repr(str(v)) if isinstance(v, str) else repr(v)

        # (a None argument means "not given" there: ZenFlow's schedule is spelled "none")
        lag = "none" if self.writeback_lag is None else self.writeback_lag
        return (f"ZenFlowTrainingArguments(output_dir=..., zenflow_topk_ratio={self.topk_ratio!r}, "
                f"zenflow_update_interval={arg(self.update_interval)}, "
                f"zenflow_host_lr_scale={arg(self.host_lr_scale)}, zenflow_writeback_lag={arg(lag)})")

    def cli_flags(self) -> str:
        lag = "none" if self.writeback_lag is None else self.writeback_lag
        return (f"--zenflow_topk_ratio {self.topk_ratio:g} --zenflow_update_interval {self.update_interval} "
                f"--zenflow_host_lr_scale {self.host_lr_scale} --zenflow_writeback_lag {lag}")


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
    rules = {k: v for k, v in values.items() if k in EngineRules.names()}
    return ZenFlowConfig(**{k: v for k, v in values.items() if k not in rules}).with_rules(**rules)


def library_default_setting() -> TrialSetting:
    d = ZenFlowConfig()
    return TrialSetting(d.topk_ratio, d.update_interval, d.host_lr_scale, d.writeback_lag)


def default_grid(topk: Sequence[float] = GRID_TOPK, intervals: Sequence[int | str] = GRID_INTERVAL,
                 scales: Sequence[float | str] = GRID_SCALE,
                 lags: Sequence[int | str | None] = GRID_LAG) -> list[TrialSetting]:
    """Every combination, in the order a budget trims it: the library default first, then the update_interval x
    host_lr_scale sweep at the default topk_ratio, then its writeback_lag sweep (the default host_lr_scale), then
    the other ratios (the default lag). ``update_interval=1`` takes one scale and lag only (``"interval"``
    multiplies by a window of 1, and a one-step window is written back one step later whatever the lag says)."""
    default = library_default_setting()
    seen: set[TrialSetting] = set()
    out: list[TrialSetting] = []

    def add(s: TrialSetting) -> None:
        if s.update_interval == 1:
            s = dataclasses.replace(s, host_lr_scale=1.0, writeback_lag=default.writeback_lag)
        if s not in seen:
            seen.add(s)
            out.append(s)

    def point(r: float, u: int | str, s: float | str, lag: int | str | None = default.writeback_lag) -> TrialSetting:
        return TrialSetting(float(r), u, s if s in ("interval", "auto") else float(s), lag)

    if default.topk_ratio in topk and default.update_interval in intervals:
        add(default)
    ratios = sorted(topk, key=lambda r: (abs(r - default.topk_ratio), r))
    for i, r in enumerate(ratios):
        for u in intervals:
            for s in scales:
                add(point(r, u, s))
        if i == 0:  # the default window first: the budget may end inside this sweep
            for u in sorted(intervals, key=lambda u: u != default.update_interval):
                for lag in lags:
                    add(point(r, u, default.host_lr_scale, lag))
    return out
