"""How `ZenFlowAdamW`'s arguments become its state: the settings (a `ZenFlowConfig` and keyword overrides), checked
param groups, the window schedule, and for each parameter whether it is split between the device and the host
(`SplitMatrix`) or updated wholly on the device (`DenseDeviceState`)."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .._base import check_group_hyperparameters
from ..settings.config import ZenFlowConfig, removed_settings_text
from ..settings.rules import HIGH_LR_RULE_THRESHOLD, EngineRules
from .device_state import DenseDeviceState
from .host_lr import peak_lr, rule_beta1, rule_window
from .schedule import WindowSchedule
from .selection import num_selected, selection_axis
from .split_matrix import SplitMatrix


if TYPE_CHECKING:
    from ..distributed.fsdp import LocalShards


logger = logging.getLogger("hf_zenflow")


def resolve_config(config: ZenFlowConfig | None, overrides: dict[str, Any], host_executor: str) -> ZenFlowConfig:
    """`config` (default: `ZenFlowConfig()`) with the keyword arguments named like its fields applied; unknown
    keywords and an unknown `host_executor` fail, naming what is allowed."""
    config = config if config is not None else ZenFlowConfig()
    if overrides:
        known = {f.name for f in dataclasses.fields(ZenFlowConfig)}
        unknown = sorted(set(overrides) - known)
        rules = sorted(set(unknown) & set(EngineRules.names()))
        if rules:
            raise ValueError(f"ZenFlowAdamW got engine rule(s) {rules}, which are not settings: change one for a "
                             f"test or a study with config=ZenFlowConfig(...).with_rules({rules[0]}=...).")
        removed = removed_settings_text(overrides)
        if removed:
            raise ValueError(f"ZenFlowAdamW: the {removed} in this version of hf_zenflow.")
        if unknown:
            raise ValueError(f"ZenFlowAdamW got unknown argument(s) {unknown}: ZenFlowConfig fields are "
                             f"{sorted(known)}.")
        config = config.replace(**overrides)
    if host_executor not in ("thread", "inline"):
        raise ValueError(f'ZenFlowAdamW host_executor={host_executor!r} is invalid: allowed is "thread" or '
                         '"inline".')
    return config


def check_param_group(group: dict[str, Any], defaults: dict[str, Any]) -> None:
    """Refuse a param group whose ``select_rows`` or AdamW hyper-parameters are invalid, naming the value."""
    if not isinstance(group.get("select_rows", False), bool):
        raise ValueError(f"ZenFlowAdamW param group select_rows={group['select_rows']!r} is invalid: "
                         "allowed are True and False.")
    check_group_hyperparameters(group, defaults)


#: Parameter dtypes ZenFlowAdamW updates: its masters and moments are fp32, so an fp64 parameter would silently be
#: trained at fp32 precision.
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def is_dense_layout(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill its memory without gaps or overlaps, in any dimension order (row-major,
    column-major, permuted). A view with gaps (``w[:, ::2]``) is not: its gradient is contiguous, its moments and
    the in-place update could not be laid over it element for element. An empty tensor has no elements to lay out."""
    if t.numel() == 0:
        return True
    expected = 1
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def check_group_params(group: dict[str, Any]) -> None:
    """Refuse, at construction, parameters ZenFlowAdamW would update wrongly: the same parameter twice in a group
    (torch only warns; it would get two updates per step; across groups torch refuses it), a non-dense view, or a
    dtype it cannot keep at its precision."""
    names = group.get("param_names") or [None] * len(group["params"])
    seen: set[int] = set()

    def label(i: int, p: torch.Tensor) -> str:
        return f"parameter {i}" + (f" ({names[i]})" if names[i] else "") + f" of shape {tuple(p.shape)}"

    for i, p in enumerate(group["params"]):
        if id(p) in seen:
            raise ValueError(f"ZenFlowAdamW: {label(i, p)} appears more than once in its param group: each "
                             "parameter may be listed once (torch.optim.AdamW would update it twice per step).")
        seen.add(id(p))
        if p.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"ZenFlowAdamW: {label(i, p)} is {p.dtype}: its masters and moments are fp32, so it "
                             f"would be trained at fp32 precision; allowed are {[str(d) for d in SUPPORTED_DTYPES]}. "
                             "Use torch.optim.AdamW for fp64 training, or cast the model to fp32.")
        if not hasattr(p, "placements") and not is_dense_layout(p):  # (an FSDP2 DTensor's layout is its shard's)
            raise ValueError(f"ZenFlowAdamW: {label(i, p)} has strides {p.stride()}: it is a view with gaps in "
                             "memory, which the fused in-place update cannot follow. Make it a parameter of its "
                             "own (nn.Parameter(w.contiguous())).")


def new_schedule(config: ZenFlowConfig, groups: list[dict] | None = None,
                 steps_per_epoch: int | None = None) -> WindowSchedule:
    """The run's schedule, re-selecting by the epoch length `steps_per_epoch` where the strategy says so
    (`ZenFlowConfig.select_period`); `high_lr_rule="auto"` judges by the largest peak learning rate of the param
    `groups` (`host_lr.high_lr_window`; its choice is logged at the first step, `announce_high_lr_rule`)."""
    configured = None if config.is_auto_interval else int(config.update_interval)
    schedule = WindowSchedule(
        warm_up=config.full_warm_up_rounds,
        update_interval=configured,
        auto_ratio=config.auto_ratio,
        auto_max_interval=config.rules.auto_max_interval,
        select_period=config.select_period(steps_per_epoch),
        # "auto": 1 step until the choice (`writeback_lag.py`)
        writeback_lag=1 if config.rules.writeback_lag == "auto" else config.rules.writeback_lag,
        writeback_lag_pending=config.rules.writeback_lag == "auto",
    )
    schedule.shorten_windows(rule_window(config, groups or []), configured, schedule.writeback_lag)
    return schedule


def announce_high_lr_rule(schedule: WindowSchedule, config: ZenFlowConfig, groups: list[dict]) -> None:
    """Log `high_lr_rule="auto"`'s choice, when engaged (`run_start.RunStart` calls it once per run, at its first
    step: after a resume that is the checkpoint's choice, restored over the one a fresh schedule would make, not a
    decision it replaced)."""
    window = schedule.high_lr_window
    if window is None:
        return
    lr = max((peak_lr(g) for g in groups), default=0.0)
    lag = window if schedule.writeback_lag is None else schedule.writeback_lag
    beta1 = groups[0]["betas"][0]
    until = ', until writeback_lag="auto" chooses' if schedule.writeback_lag_pending else ""
    logger.info('hf_zenflow: high_lr_rule="auto": peak lr %g x update_interval %s > %g: windows of %d step(s), '
                "host beta1 %.4g for beta1 %g (write-back lag %d%s)", lr, config.update_interval,
                HIGH_LR_RULE_THRESHOLD, window, rule_beta1(config, beta1, window, lag), beta1, lag, until)


def is_split(p: torch.Tensor, group: dict[str, Any], config: ZenFlowConfig,
             shape: torch.Size | None = None, min_numel: int | None = None) -> bool:
    """Whether `p` is split between the device and the host (a large enough matrix in a layout we can split), or
    updated wholly on the device. `shape`: the whole parameter's, when `p` is an FSDP2 shard (every rank must
    decide alike, whatever rows it holds); `min_numel`: the run's threshold when `device_memory_limit_bytes` chose
    one (`device_budget.py`), else `config.min_offload_numel`."""
    shape = p.shape if shape is None else shape
    min_numel = config.min_offload_numel if min_numel is None else min_numel
    return (len(shape) >= 2 and (bool(group.get("select_rows", False)) or selection_axis(p) is not None)
            and shape.numel() >= min_numel and shape.numel() > 0)  # (an empty matrix has no columns)


def offloads(p: torch.Tensor, group: dict[str, Any], config: ZenFlowConfig) -> bool:
    """Whether training `p` will give it host state (what needs a host worker, and the thread rule's claim): a
    trainable (``requires_grad``) split matrix with columns on the host, or any split matrix during warm-up (the host
    updates every column then). Decided from shapes and settings alone, before any gradient exists."""
    if not p.requires_grad or not is_split(p, group, config):
        return False
    columns = p.shape[0] if group.get("select_rows", False) else math.prod(p.shape[1:])
    return num_selected(config.topk_ratio, columns) < columns or config.full_warm_up_rounds > 0


def offloads_any(groups: list[dict[str, Any]], config: ZenFlowConfig) -> bool:
    """Whether any parameter of `groups` will be offloaded (`offloads`)."""
    return any(offloads(p, group, config) for group in groups for p in group["params"])


def create_state(entries: list[tuple[dict, torch.Tensor]], splits: dict[torch.Tensor, SplitMatrix],
                 dense: dict[torch.Tensor, DenseDeviceState], config: ZenFlowConfig, schedule: WindowSchedule,
                 attach_host: Callable[[list[SplitMatrix]], None], shards: LocalShards | None = None) -> None:
    """State for the parameters of `entries` that have none yet: a `SplitMatrix` (host state now when some
    columns live on the host, or during warm-up, when the host updates every column) or a `DenseDeviceState`.
    `attach_host` creates the host state of the new splits that need it (`HostWindows.attach_host`); `shards`: under
    FSDP2 the entries hold local shards, decided on by their whole parameters' shapes. Matrices are split from the
    schedule's `min_offload_numel` (`WindowSchedule.offload_threshold`)."""
    needs_host: list[SplitMatrix] = []
    for group, p in entries:
        if p in splits or p in dense:
            continue
        rows = bool(group.get("select_rows", False))
        owner = shards.owner(p) if shards is not None else p
        if owner is not p and (rows or not p.is_contiguous()):
            raise NotImplementedError(
                f"ZenFlowAdamW under FSDP2: parameter of shape {tuple(owner.shape)} has select_rows={rows} and "
                f"local strides {p.stride()}: FSDP2 shards the rows, so only row-major matrices split by input "
                "column are supported (no select_rows, no column_major_).")
        if rows and not p.is_contiguous():
            raise ValueError(f"ZenFlowAdamW param group select_rows=True needs row-major (contiguous) parameters; "
                             f"got one of shape {tuple(p.shape)} with strides {p.stride()} (do not combine it "
                             "with column_major_ on the same weight).")
        if is_split(p, group, config, owner.shape, schedule.offload_threshold(config)):
            split = SplitMatrix(p, 0, rows=rows, owner=owner)
            split.k = num_selected(config.topk_ratio, split.columns)
            if split.offloaded or schedule.in_warm_up():
                needs_host.append(split)
            splits[p] = split
        else:
            dense[p] = DenseDeviceState.fresh(p)
    attach_host(needs_host)
