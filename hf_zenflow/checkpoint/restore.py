"""Loading a ZenFlowAdamW checkpoint: `load` / `unpack` check everything first (`validate`, the rank checks of
`reshard.py`, the settings change of `convert.py`) and only then write the optimizer's state, so a refused state
dict leaves the optimizer unchanged. The format itself (versions, migration, what `pack` writes) is `format.py`."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..engine.device_state import DenseDeviceState
from ..engine.engine_state import EngineState
from ..engine.split_matrix import SplitMatrix
from ..settings.config import ZenFlowConfig
from . import validate as checks
from .convert import apply_changed_settings, is_torch_adamw_state, unpack_torch_adamw
from .format import _PARSE_ERRORS, _migrate, _refused, _restore_groups
from .reshard import check_fsdp_ranks, check_ranks, fsdp_rows_of
from .seal import Refusal
from .state import ZenFlowState


def _label(index: Any, entry: dict[str, Any], param: torch.Tensor) -> str:
    name = entry.get("name")
    return f"parameter {index}" + (f" ({name})" if isinstance(name, str) else "") + f" of shape {list(param.shape)}"


def validate(opt: ZenFlowState, state_dict: dict[str, Any]) -> None:
    """Refuse a (migrated) state dict that does not fit `opt`'s parameters or holds damaged or out-of-range values,
    naming the entry and what was expected. Everything `unpack` reads is checked here."""
    try:
        _validate(opt, state_dict)
    except _PARSE_ERRORS as exc:
        raise _refused(exc) from None


def _index(index: Any, count: int) -> int:
    if isinstance(index, str) and index.isdigit():
        index = int(index)
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
        raise Refusal(f"state for parameter {index!r}, but this optimizer has parameters 0..{count - 1}")
    return index


def _validate(opt: ZenFlowState, state_dict: dict[str, Any]) -> None:
    engine = opt.engine_state
    params = engine.params()
    checks.check_groups(opt, state_dict["param_groups"])
    zenflow = state_dict.get("zenflow")
    if zenflow is None:
        return  # (`migrate` refused entries without a block)
    checks.check_block(zenflow)
    # the group settings in force after the load: `_restore_groups` takes the saved ones (select_rows among them)
    restored = [{**g, **{k: v for k, v in saved.items() if k != "params"}}
                for g, saved in zip(opt.param_groups, state_dict["param_groups"])]
    groups = [r for g, r in zip(opt.param_groups, restored) for _ in g["params"]]
    seen: set[int] = set()
    for index, entry in state_dict["state"].items():
        i = _index(index, len(params))
        if i in seen:
            raise Refusal(f"parameter {i} has two state entries")
        seen.add(i)
        p = params[i]
        if not isinstance(entry, dict):
            raise Refusal(f"parameter {index}: the entry is {type(entry).__name__}, expected a dict")
        where = _label(index, entry, p)
        if entry.get("kind") not in ("split", "dense") or (entry["kind"] == "split" and p.ndim < 2):
            raise Refusal(f"{where}: entry kind {entry.get('kind')!r} is invalid here")
        checks.check_name(where, entry.get("name"), engine.name_of(p))
        rows = bool(groups[i].get("select_rows", False))
        units = p.shape[0] if rows else math.prod(p.shape[1:])  # (an FSDP2 shard may have 0 rows)
        checks.check_entry_fields(where, entry, p, zenflow["steps"], units, rows)
        checks.check_tensors(where, entry, p)
        checks.check_consistency(where, entry, zenflow)
        if entry["kind"] == "split" and "device_index" in entry:
            checks.check_device_columns(where, entry, p, units)
    checks.check_settings_change(opt, zenflow)


@torch.no_grad()
def unpack(opt: ZenFlowState, state_dict: dict[str, Any]) -> None:
    """Restore `opt` (its worker idle) from a ZenFlow or a `torch.optim.AdamW` state dict."""
    if is_torch_adamw_state(state_dict):
        unpack_torch_adamw(opt, state_dict)
        return
    try:
        state_dict = _checked(opt, state_dict)
    except _PARSE_ERRORS as exc:
        raise _refused(exc) from None
    # From here on every value read was checked: the optimizer is only written now.
    _restore_groups(opt, state_dict["param_groups"])
    engine = opt.engine_state
    engine.reset()
    zenflow = state_dict.get("zenflow")
    if zenflow is None:
        return
    params = engine.params()
    groups = [g for g in opt.param_groups for _ in g["params"]]
    schedule = engine.ensure_schedule()
    saved = zenflow.get("config", {})
    # (the saved settings were checked by `validate`: they make a config, whose rules are the saved run's)
    if opt.config.rules.high_lr_rule == "auto" and ZenFlowConfig.from_dict(saved).rules.high_lr_rule == "auto" \
            and saved.get("update_interval") == opt.config.update_interval:
        # the saved run's `high_lr_rule="auto"` choice (a checkpoint from before the rule: none, as it ran); with
        # another update_interval, or the rule newly on, it decides afresh (`new_schedule`)
        configured = None if opt.config.is_auto_interval else int(opt.config.update_interval)
        schedule.shorten_windows(zenflow.get("high_lr_window"), configured,
                                 1 if opt.config.rules.writeback_lag == "auto" else opt.config.rules.writeback_lag)
    schedule.load(
        zenflow,
        # the saved run's lag, chosen or still provisional; an explicit setting replaces it
        lag=opt.config.rules.writeback_lag == "auto" and "writeback_lag_pending" in zenflow,
        # the threshold the saved run's device memory limit chose; a new limit or min_offload_numel chooses afresh
        # (`apply_changed_settings` moves the matrices), except under FSDP2, where matrices cannot move
        limit="limit_min_offload_numel" in zenflow and (engine.host.param_shards is not None or all(
            saved.get(name) == getattr(opt.config, name)
            for name in ("device_memory_limit_bytes", "min_offload_numel"))))
    # before any host state is restored: it is created for the accumulation the saved run chose, its random bits
    # keyed by the saved seed
    engine.host.load(zenflow)
    engine.load(zenflow)  # (the skipped steps; the clip threshold, until the next `clip_grad_norm_`)
    for index, entry in state_dict["state"].items():
        p = params[int(index)]
        if entry["kind"] == "dense":
            dense = DenseDeviceState.fresh(p)
            for name in ("step", "exp_avg", "exp_avg_sq"):
                getattr(dense, name).copy_(entry[name].view_as(getattr(dense, name)))
            if entry["master"] is not None and dense.master is not None:
                # (an fp32 parameter is its own master: none is saved)
                dense.master.copy_(entry["master"].view_as(dense.master))
            engine.dense[p] = dense
            continue
        engine.splits[p] = _restore_split(engine, p, groups[int(index)], entry)
    apply_changed_settings(opt, zenflow.get("config") or {})


def _checked(opt: ZenFlowState, state_dict: dict[str, Any]) -> dict[str, Any]:
    """`state_dict` migrated, cut to this rank's part where needed, and checked through and through."""
    state_dict = _migrate(state_dict)
    zenflow = state_dict.get("zenflow")
    if zenflow is not None:
        checks.check_block(zenflow)  # (the rank fields are read next)
    host = opt.engine_state.host
    mesh = host.param_shards
    if mesh is not None and zenflow and not {"ranks", "fsdp_ranks"} & set(zenflow):
        state_dict = fsdp_rows_of(state_dict, mesh.ranks, mesh.rank)  # a one-process state: this rank's rows of it
    check_ranks(state_dict.get("zenflow") or {}, host.shards.ranks, host.shards.rank)
    check_fsdp_ranks(state_dict.get("zenflow") or {}, host.param_shards)
    _validate(opt, state_dict)
    return state_dict


def load(opt: ZenFlowState, state_dict: dict[str, Any]) -> None:
    """`ZenFlowAdamW.load_state_dict` (its worker idle): `unpack`, then a host worker whose thread count or mode no
    longer matches the settings in force is closed (the next step starts one with the current settings)."""
    before = (opt.config.resolved_cpu_threads, opt.config.overlap_step)
    unpack(opt, state_dict)
    # (a worker started with other settings stops, not `opt.close()`: the run goes on; after a host worker failure
    # the state is whole and checked again)
    opt.engine_state.host.loaded(threads=before[0], background=before[1] and opt.host_executor == "thread")
    opt.engine_state.mark_weights()


def _restore_split(engine: EngineState, p: torch.Tensor, group: dict[str, Any], entry: dict[str, Any]
                   ) -> SplitMatrix:
    split = SplitMatrix(p, int(entry["k"]), rows=bool(group.get("select_rows", False)), owner=engine.fsdp.owner(p))
    if "host_master" in entry:
        engine.host.attach_host([split])  # (for the settings in force, in this rank's share)
    split.load(entry, writeback_fresh=engine.host.writeback_pending)
    return split


__all__ = ["load", "unpack", "validate"]
