"""Conversions a resume may need: a `ZenFlowAdamW` state moved to changed settings (`topk_ratio`,
`min_offload_numel`, ...), and state moved between `ZenFlowAdamW` and `torch.optim.AdamW` in either direction.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._base import fused_adamw_
from ..engine.device_state import DenseDeviceState
from ..engine.host import host_adamw_window
from ..engine.host_lr import host_hyper, window_lag
from ..engine.params import is_split
from ..engine.selection import num_selected, storage_matrix
from ..engine.split_matrix import SplitMatrix
from ..settings.config import ZenFlowConfig
from .format import (
    _PARSE_ERRORS,
    CheckpointError,
    _refused,
    _restore_groups,
    migrate,
    widen_moments,
)
from .state import ZenFlowState
from .validate import check_groups


logger = logging.getLogger("hf_zenflow.checkpoint")


def is_torch_adamw_state(state_dict: dict[str, Any]) -> bool:
    """A `torch.optim.AdamW` (or `Adam`) state dict: no ZenFlow block, per-parameter ``exp_avg``/``step``."""
    if "zenflow" in state_dict or "param_groups" not in state_dict:
        return False
    entries = state_dict.get("state")
    # (a ZenFlow entry says its "kind": a ZenFlow state whose "zenflow" key was damaged is not taken for torch's)
    return isinstance(entries, dict) and all(
        isinstance(e, dict) and {"step", "exp_avg", "exp_avg_sq"} <= set(e) and "kind" not in e
        for e in entries.values())


def _settings_and_rules(config: ZenFlowConfig) -> dict[str, Any]:
    """`config`'s settings and every rule they resolve to (`config.rules`), by name."""
    return {**{k: v for k, v in config.to_dict().items() if k != "rules"}, **dataclasses.asdict(config.rules)}


def apply_changed_settings(opt: ZenFlowState, saved: dict[str, Any]) -> None:
    """Let the optimizer's current settings (and the rules they stand for) take effect where they differ from the
    checkpoint's."""
    current = _settings_and_rules(opt.config)
    if saved:  # (its rules, resolved: a preset's or changed by `with_rules`; checked on loading, `validate.py`)
        saved = {**saved, **dataclasses.asdict(ZenFlowConfig.from_dict(saved).rules)}
    changed = {name: (saved[name], current[name]) for name in current
               if name in saved and saved[name] != current[name]}
    if not changed:
        return
    host, schedule = opt.engine_state.host, opt.engine_state.schedule
    notes = []
    for name, (before, now) in changed.items():
        note = f"{name} {before!r} -> {now!r}"
        if name == "topk_ratio":
            schedule.force_select = True
            note += " (every matrix is re-selected at the next step; master values and moments are kept)"
        elif name == "full_warm_up_rounds" and schedule.steps < int(now) and schedule.steps >= int(before):
            raise CheckpointError(
                f"ZenFlowAdamW.load_state_dict: full_warm_up_rounds={now} cannot take effect: the checkpoint is "
                f"{schedule.steps} steps in, past its own warm-up of {before} steps, and the columns were selected "
                f"already. Resume with full_warm_up_rounds <= {schedule.steps}."
            )
        elif name == "accumulate_on" and now == "auto":
            kept = host.accumulate_on
            note += f" (keeps the checkpoint's {kept!r})" if kept else ""
        notes.append(note)
    if "min_offload_numel" in changed or ("device_memory_limit_bytes" in changed
                                          and host.param_shards is None):
        # (a new limit chooses the run's threshold afresh, `device_budget.py`; under FSDP2 the checkpoint's stays)
        notes.append(_apply_min_offload_numel(opt))
    logger.warning("ZenFlowAdamW.load_state_dict: settings differ from the checkpoint's; the current ones take "
                   "effect: %s.", "; ".join(n for n in notes if n))


def _apply_min_offload_numel(opt: ZenFlowState) -> str:
    """Move matrices between the split path and the dense path to match the current `min_offload_numel`."""
    engine = opt.engine_state
    if engine.host.param_shards is not None:
        raise CheckpointError(
            "ZenFlowAdamW.load_state_dict: min_offload_numel differs from the checkpoint's; under FSDP2 matrices "
            "cannot move between the split and the dense path on resume. Resume with the checkpoint's "
            "min_offload_numel.")
    group_of = {p: g for g in opt.param_groups for p in g["params"]}
    threshold = engine.schedule.offload_threshold(opt.config)  # (a device memory limit's choice, else the setting)
    to_dense = [p for p in engine.splits if not is_split(p, group_of[p], opt.config, min_numel=threshold)]
    to_split = [p for p in engine.dense if is_split(p, group_of[p], opt.config, min_numel=threshold)]
    for p in to_dense:
        _split_to_dense(opt, p, group_of[p])
    for p in to_split:
        _dense_to_split(opt, p, group_of[p])
    return f"{len(to_dense)} matrices now updated wholly on the device, {len(to_split)} now split"


def _split_to_dense(opt: ZenFlowState, p: torch.Tensor, group: dict[str, Any]) -> None:
    engine = opt.engine_state
    split = engine.splits.pop(p)
    if split.host is not None:
        host = split.host
        if split.window_sum is not None and split.window_count:
            host.accum.copy_(split.window_sum)
            host.accum_count = split.window_count
        if host.accum_count:
            # the open window's gradients are applied now, as `flush()` would, so none is lost
            lag = window_lag(engine.schedule, opt.config.overlap_step, host.accum_count)
            hyper, _ = host_hyper(group, opt.config, host.accum_count, lag, engine.schedule.high_lr_window,
                                  engine.host.guard_factor())
            host_adamw_window([(hyper, [host])])
    master, m, v = split.full_state(engine.host.shards)
    step = (split.device.step if split.device is not None else split.host.step).clone()
    dense = DenseDeviceState.fresh(p)
    dense.exp_avg.copy_(split.unmatrix(m.to(p.device)))
    dense.exp_avg_sq.copy_(split.unmatrix(v.to(p.device)))
    dense.step.copy_(step)
    if dense.master is not None:
        dense.master.copy_(split.unmatrix(master.to(p.device)))
    p.copy_(split.unmatrix(master.to(p.device)))
    engine.dense[p] = dense


def _dense_to_split(opt: ZenFlowState, p: torch.Tensor, group: dict[str, Any]) -> None:
    engine = opt.engine_state
    dense = engine.dense.pop(p)
    rows = bool(group.get("select_rows", False))
    split = SplitMatrix(p, 0, rows=rows)
    split.k = num_selected(opt.config.topk_ratio, split.columns)
    engine.host.attach_host([split])
    host = split.host
    host.master.copy_(split.host_part(dense.master_of(p)))
    host.exp_avg.copy_(split.host_part(dense.exp_avg))
    host.exp_avg_sq.copy_(split.host_part(dense.exp_avg_sq))
    host.step.copy_(dense.step)
    if not host.writes_back_master:  # (the master itself: set above)
        host.writeback.copy_(split.host_part(p.detach()))
    engine.splits[p] = split  # device columns are chosen at the next step with a gradient


def _check_torch_adamw(opt: ZenFlowState, state_dict: dict[str, Any]) -> None:
    params = [p for g in opt.param_groups for p in g["params"]]
    saved_groups = state_dict["param_groups"]
    check_groups(opt, saved_groups)  # (as many groups and parameters as here, valid hyper-parameters)
    for saved in saved_groups:
        for key, bad in (("amsgrad", True), ("maximize", True)):
            if saved.get(key, False) == bad:
                raise CheckpointError(f"ZenFlowAdamW.load_state_dict: the torch optimizer ran with {key}=True, "
                                      "which ZenFlowAdamW does not implement; its state cannot be continued.")
        if not saved.get("decoupled_weight_decay", True) and saved.get("weight_decay", 0.0) > 0:
            raise CheckpointError("ZenFlowAdamW.load_state_dict: the checkpoint is torch.optim.Adam with L2 weight "
                                  "decay (not decoupled); ZenFlowAdamW implements AdamW's decoupled decay.")
    for index, entry in state_dict["state"].items():
        if not isinstance(index, int) or not 0 <= index < len(params):
            raise CheckpointError(f"ZenFlowAdamW.load_state_dict: state for parameter {index!r}, but this optimizer "
                                  f"has parameters 0..{len(params) - 1}.")
        p = params[index]
        step = entry["step"]
        if not isinstance(step, (int, float, torch.Tensor)) or torch.as_tensor(step).numel() != 1 \
                or not float(step) >= 0:
            raise CheckpointError(f"ZenFlowAdamW.load_state_dict: step of parameter {index} is {step!r}, "
                                  "expected a count >= 0.")
        for key in ("exp_avg", "exp_avg_sq"):
            if not isinstance(entry[key], torch.Tensor) or entry[key].numel() != p.numel():
                raise CheckpointError(f"ZenFlowAdamW.load_state_dict: {key} of parameter {index} is not a tensor "
                                      f"of {p.numel()} elements, as the parameter.")
            if not bool(torch.isfinite(entry[key]).all()):
                raise CheckpointError(f"ZenFlowAdamW.load_state_dict: {key} of parameter {index} holds non-finite "
                                      "values; the checkpoint is damaged.")
        if bool((entry["exp_avg_sq"] < 0).any()):
            raise CheckpointError(f"ZenFlowAdamW.load_state_dict: exp_avg_sq of parameter {index} holds negative "
                                  "values (a second moment cannot be negative); the checkpoint is damaged.")


def unpack_torch_adamw(opt: ZenFlowState, state_dict: dict[str, Any]) -> None:
    """Continue from a `torch.optim.AdamW` checkpoint: moments and step counts carried over; each matrix's columns
    are selected at the next step (until then its whole state is on the host)."""
    engine = opt.engine_state
    if engine.host.param_shards is not None:
        raise CheckpointError(
            "ZenFlowAdamW.load_state_dict: continuing from a torch.optim.AdamW state dict under FSDP2 is not "
            "supported (its tensors are DTensors of the whole parameters). Load it in a run without FSDP2 and save "
            "a ZenFlow state, or start ZenFlow from the weights.")
    try:
        _check_torch_adamw(opt, state_dict)
    except _PARSE_ERRORS as exc:
        raise _refused(exc) from None
    # every value read below was checked: the optimizer is only written now
    params = [p for g in opt.param_groups for p in g["params"]]
    _restore_groups(opt, state_dict["param_groups"])
    engine.reset()
    threshold = engine.ensure_schedule().offload_threshold(opt.config)
    group_of = {p: g for g in opt.param_groups for p in g["params"]}
    for index, entry in state_dict["state"].items():
        p = params[int(index)]
        step = torch.as_tensor(entry["step"], dtype=torch.float32).reshape(())
        exp_avg, exp_avg_sq = (entry[k].to(p.device, torch.float32).view(p.shape) for k in ("exp_avg", "exp_avg_sq"))
        dense = DenseDeviceState.fresh(p)
        dense.exp_avg.copy_(exp_avg)
        dense.exp_avg_sq.copy_(exp_avg_sq)
        dense.step.copy_(step)
        engine.dense[p] = dense
        if is_split(p, group_of[p], opt.config, min_numel=threshold):
            _dense_to_split(opt, p, group_of[p])


# ---------------------------------------------------------------------------------------------------------------------
# To torch.optim.AdamW
# ---------------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def to_torch_adamw(state_dict: dict[str, Any],
                   weights: Mapping[int, torch.Tensor] | Sequence[torch.Tensor] | None = None,
                   ) -> tuple[dict[str, Any], dict[int, torch.Tensor]]:
    """Turn a ZenFlowAdamW state dict into one `torch.optim.AdamW` loads, and the fp32 master weight per parameter
    index that the weights must be set to for the two to continue together.

    Whatever ZenFlow had not yet put into the weights is applied first, as `flush()` would: a pending host result
    (already in the host master) and the open window's gradient sum (one host AdamW step with the group's learning
    rate). Step counts are the device path's (one per optimizer step). `weights`: the parameters' current values by
    index (e.g. ``list(model.parameters())``), needed where the state leaves a matrix's fp32 master to its fp32
    weights (saved with the model, not twice).

    Example:
        >>> import torch
        >>> from hf_zenflow import ZenFlowAdamW, to_torch_adamw
        >>> model = torch.nn.Linear(16, 16)
        >>> opt = ZenFlowAdamW(model.parameters(), lr=1e-3, min_offload_numel=0)
        >>> model(torch.randn(4, 16)).sum().backward(); opt.step()
        >>> adamw_state, masters = to_torch_adamw(opt.state_dict(), weights=list(model.parameters()))
        >>> with torch.no_grad():
        ...     for i, p in enumerate(model.parameters()):
        ...         p.copy_(masters[i])
        >>> adamw = torch.optim.AdamW(model.parameters(), lr=1e-3); adamw.load_state_dict(adamw_state)
        >>> opt.close()
    """
    try:
        return _to_torch_adamw(migrate(state_dict), weights)
    except _PARSE_ERRORS as exc:
        raise _refused(exc) from None


def _weight_matrix(entry: dict[str, Any], index: int, weights: Any) -> torch.Tensor | None:
    """The fp32 weight of parameter `index` as the entry's storage matrix, when the entry leaves a master to it
    (None when it leaves none); a `CheckpointError` when it does and `weights` does not hold it."""
    if entry.get("host_master", 0) is not None and entry.get("device_master", 0) is not None:
        return None
    try:
        weight = weights[index] if weights is not None else None
    except (IndexError, KeyError):
        weight = None
    if weight is None:
        raise CheckpointError(
            f"to_torch_adamw: parameter {index}'s fp32 master is its weight (saved with the model, not twice in the "
            "optimizer state): pass the weights, e.g. to_torch_adamw(state, weights=list(model.parameters())).")
    axis, rows = int(entry.get("axis", 1)), bool(entry.get("rows", False))
    weight = weight.detach().float().cpu().reshape(entry.get("shape") or weight.shape)
    return storage_matrix(weight, 1 if rows else axis).clone()


def _to_torch_adamw(state_dict: dict[str, Any], weights: Any = None
                    ) -> tuple[dict[str, Any], dict[int, torch.Tensor]]:
    zenflow = state_dict.get("zenflow") or {}
    if int(zenflow.get("ranks", 1)) > 1:
        raise CheckpointError(
            f"to_torch_adamw: this state dict holds rank {zenflow.get('rank')}'s share of a host state split across "
            f"{zenflow['ranks']} ranks; torch.optim.AdamW needs every element. Call ZenFlowAdamW.flush() on every "
            "rank and save the optimizer state from a one-process run, or start AdamW from the weights.")
    config = ZenFlowConfig.from_dict(zenflow["config"]) if zenflow.get("config") else ZenFlowConfig()
    group_of = {i: g for g in state_dict["param_groups"] for i in g["params"]}
    out_state: dict[int, dict[str, torch.Tensor]] = {}
    masters: dict[int, torch.Tensor] = {}
    for index, entry in state_dict["state"].items():
        index = int(index)
        if entry["kind"] == "dense":
            shape = entry.get("shape") or list(entry["exp_avg"].shape)
            out_state[index] = {"step": entry["step"].float().cpu().clone(),
                                "exp_avg": entry["exp_avg"].float().cpu().reshape(shape).clone(),
                                "exp_avg_sq": entry["exp_avg_sq"].float().cpu().reshape(shape).clone()}
            if entry["master"] is not None:
                masters[index] = entry["master"].float().cpu().reshape(shape).clone()
            continue
        master, m, v, step = _flushed_split(entry, config, group_of[index], zenflow,
                                            _weight_matrix(entry, index, weights))
        axis, rows = int(entry.get("axis", 1)), bool(entry.get("rows", False))
        shape = entry.get("shape")
        if shape is None:
            shape = list(master.shape) if axis == 1 or rows else list(master.t().shape)
        out_state[index] = {"step": step, "exp_avg": _unstorage(m, axis, rows, shape),
                            "exp_avg_sq": _unstorage(v, axis, rows, shape)}
        masters[index] = _unstorage(master, axis, rows, shape)
    groups = []
    for group in state_dict["param_groups"]:
        packed = {k: v for k, v in group.items() if k not in ("select_rows",)}
        packed.update(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False,
                      fused=None, decoupled_weight_decay=True)
        groups.append(packed)
    return {"state": out_state, "param_groups": groups}, masters


def _unstorage(m: torch.Tensor, axis: int, rows: bool, shape: list[int]) -> torch.Tensor:
    """A storage matrix back into a contiguous tensor of the parameter's shape."""
    return (m if axis == 1 or rows else m.t()).contiguous().reshape(shape).clone()


def _flushed_split(entry: dict[str, Any], config: ZenFlowConfig, group: dict[str, Any], zenflow: dict[str, Any],
                   weight: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full fp32 (master, exp_avg, exp_avg_sq) storage matrices of a split entry and its AdamW step count, with the
    open window applied. `weight`: the fp32 weight's storage matrix, where the entry leaves a master to it."""
    axis = int(entry.get("axis", 1))
    entry = widen_moments(entry)  # (8-bit host moments: their fp32 values)
    index = entry["device_index"].long().cpu() if "device_index" in entry else None
    if "device_master" in entry and entry["device_master"] is None:
        entry = {**entry, "device_master": weight.index_select(axis, index)}  # (the weights hold them)
    if "host_master" in entry and entry["host_master"] is None:
        master = weight.clone()
        if "host_master_columns" in entry:
            master.index_copy_(axis, index, entry["host_master_columns"].float().cpu())
        entry = {**entry, "host_master": master}
    if "host_master" in entry:
        master, m, v = (entry[k].float().cpu().clone() for k in ("host_master", "host_exp_avg", "host_exp_avg_sq"))
        count = int(entry.get("accum_count", 0))
        if count and entry.get("accum") is not None:
            # the saved schedule's lag (None: the next boundary, a whole window), as the optimizer counts it
            lag = zenflow.get("writeback_lag") or zenflow.get("high_lr_window") or config.update_interval
            lag = (lag if isinstance(lag, int) else count) if config.overlap_step else 1
            guard = 1.0 if config.rules.host_step_guard == "off" else float(
                (zenflow.get("host_step_guard") or {}).get("factor", 1.0))
            hyper, _ = host_hyper(group, config, count, lag, zenflow.get("high_lr_window"), guard)
            host_step = entry["host_step"].float().cpu().clone()
            fused_adamw_([master], [entry["accum"].float().cpu() / count], [m], [v], [host_step], hyper)
    else:
        master = entry["device_master"].float().cpu().clone()
        m, v = (entry[k].float().cpu().clone() for k in ("device_exp_avg", "device_exp_avg_sq"))
    if "device_master" in entry and "host_master" in entry:
        for full, key in ((master, "device_master"), (m, "device_exp_avg"), (v, "device_exp_avg_sq")):
            full.index_copy_(axis, index, entry[key].float().cpu())
    if "device_step" in entry:
        step = entry["device_step"].float().cpu().clone()
    else:
        step = torch.tensor(float(zenflow.get("steps", 0)))
    return master, m, v, step.reshape(())
