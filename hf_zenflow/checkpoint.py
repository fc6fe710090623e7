"""The checkpoint format of `ZenFlowAdamW`: what `state_dict()` writes, how `load_state_dict()` checks and restores
it, and the conversion to and from `torch.optim.AdamW` checkpoints.

Format version 2 (``state_dict()["zenflow"]["format_version"]``): per parameter index an entry of kind ``"split"``
(a matrix: selection, device columns, host state, the open window's gradient sum) or ``"dense"`` (updated wholly on
the device), each with the parameter's ``shape`` and ``dtype``, its name when known, and a ``checksums`` dict (a
64-bit sum of each tensor's bits) so that a damaged file is refused instead of training on garbage (torch's own
loader does not check its zip CRCs). Version 1 (no ``format_version``: hf_zenflow before 2026-12-01) is read by
migration: the same entries without shapes and checksums. A newer version is refused with a message.

Under several data-parallel ranks (`sharding.py`) each rank's state dict holds its share of the host state: the
``zenflow`` block says ``ranks`` and ``rank``, each split entry its ``share`` (start, length, size of the shared
dimension). It loads on the same rank of the same number of ranks; a one-process state dict loads on any number of
ranks (each rank takes its share); other combinations are refused, naming both rank counts. Under FSDP2 (`fsdp.py`)
every entry is of this rank's shard of the parameter (shapes included) and the block says ``fsdp_ranks`` and
``fsdp_rank``: it loads only on the same rank of the same world size.

Loading compares the saved settings with the optimizer's own and lets the current ones take effect (a new
``topk_ratio`` re-selects every matrix at the next step, moments kept; a new ``min_offload_numel`` moves matrices
between the split and the dense path; the rest apply as they are), logging what changed.
"""

from __future__ import annotations

import logging
import math
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .device_step import DenseDeviceState, DeviceColumns
from .schedule import ZenAutoStats
from .split_matrix import SplitMatrix


if TYPE_CHECKING:
    from .optimizer import ZenFlowAdamW

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2

#: Group keys of `torch.optim.AdamW` that ZenFlowAdamW has no use for (its behaviour is fixed: fused, decoupled).
_TORCH_ONLY_GROUP_KEYS = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused",
                          "decoupled_weight_decay", "param_names")

#: Settings that are not the user's to change on resume (filled in by the Trainer or the plugin).
_DERIVED_SETTINGS = ("steps_per_epoch",)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is: damaged, from another model, or from an incompatible version.
    The message names the file or tensor and what to do."""


def tensor_checksum(t: torch.Tensor) -> int:
    """A 64-bit wrap-around sum of the tensor's bits (read as integers of its element size): any change of a value
    changes it with overwhelming probability, at the cost of one read."""
    t = t.detach().contiguous()
    as_int = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]
    return int(t.view(as_int).sum(dtype=torch.int64).item())


def _tensors(entry: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in entry.items() if isinstance(v, torch.Tensor)}


# ---------------------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------------------
def pack(opt: ZenFlowAdamW) -> dict[str, Any]:
    """The state dict of `opt` (its worker idle): see the module docstring."""
    index_of: dict[torch.Tensor, int] = {}
    groups = []
    for group in opt.param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = []
        for p in group["params"]:
            packed["params"].append(len(index_of))
            index_of[opt._fsdp.local(p)] = len(index_of)  # (the engine keys an FSDP2 parameter by its shard)
        groups.append(packed)
    state: dict[int, dict[str, Any]] = {}
    for p, split in opt._split.items():
        entry: dict[str, Any] = {"kind": "split", "k": split.k, "auto": split.auto.to_list(), "axis": split.axis,
                                 "rows": split.rows}
        if split.device is not None:
            d = split.device
            entry.update(device_index=d.index, device_master=d.master, device_exp_avg=d.exp_avg,
                         device_exp_avg_sq=d.exp_avg_sq, device_step=d.step)
        if split.host is not None:
            h = split.host
            # the open window's sum, wherever it is kept (the host worker is idle: closed windows are applied)
            accum, count = (split.window_sum, split.window_count) if split.window_sum is not None else (
                h.accum, h.accum_count)
            entry.update(host_master=h.master, host_exp_avg=h.exp_avg, host_exp_avg_sq=h.exp_avg_sq,
                         host_step=h.step, accum=accum if count else None, accum_count=count)
            if split.share.ranks > 1:
                entry["share"] = [split.share.start, split.share.length, split.share.size]
        state[index_of[p]] = entry
    for p, dense in opt._dense.items():
        state[index_of[p]] = {
            "kind": "dense", "step": dense.step, "exp_avg": dense.exp_avg, "exp_avg_sq": dense.exp_avg_sq,
            "master": dense.master,  # None: the fp32 parameter is its own master (saved with the model)
        }
    for p, entry in state.items():
        param = next(q for q, i in index_of.items() if i == p)
        entry.update(shape=list(param.shape), dtype=str(param.dtype).removeprefix("torch."))
        name = opt._param_names.get(opt._fsdp.owner(param))
        if name is not None:
            entry["name"] = name
        entry["checksums"] = {key: tensor_checksum(t) for key, t in _tensors(entry).items()}
    schedule = opt._schedule
    zenflow = None
    if schedule is not None:
        zenflow = {
            "format_version": FORMAT_VERSION,
            "steps": schedule.steps, "window_steps": schedule.window_steps, "windows": schedule.windows,
            "reselections": schedule.reselections, "last_interval": schedule.last_interval,
            "force_select": schedule.force_select, "writeback_lag": schedule.writeback_lag,
            "writeback_lag_pending": schedule.writeback_lag_pending,
            "writeback_pending": opt._host.writeback_pending, "unapplied_steps": list(opt._host.unapplied_steps),
            "skipped_steps": opt._stats.skipped_steps, "config": opt.config.to_dict(),
            # where windows are summed ("auto"'s choice; None before any host state): a resumed run keeps it
            "accumulate_on": opt._host.accumulate_on,
        }
        if opt._host.shards.ranks > 1:
            zenflow.update(ranks=opt._host.shards.ranks, rank=opt._host.shards.rank)
        if opt._host.param_shards is not None:  # FSDP2: this rank's shards of the parameters
            zenflow.update(fsdp_ranks=opt._host.param_shards.ranks, fsdp_rank=opt._host.param_shards.rank)
    return {"state": state, "param_groups": groups, "zenflow": zenflow}


# ---------------------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------------------
def migrate(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The state dict in the current format version; refuses versions this hf_zenflow does not know."""
    zenflow = state_dict.get("zenflow")
    if zenflow is None:
        return state_dict
    version = zenflow.get("format_version", 1)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"ZenFlowAdamW.load_state_dict: the checkpoint has format_version={version!r}, written by a newer "
            f"hf_zenflow; this one reads versions 1 to {FORMAT_VERSION}. Upgrade hf_zenflow to resume from it."
        )
    if version == 1:  # same entries; no shapes, checksums or forced re-selection yet
        zenflow = {**zenflow, "format_version": FORMAT_VERSION, "force_select": False}
        state_dict = {**state_dict, "zenflow": zenflow}
    return state_dict


def _label(index: int, entry: dict[str, Any], param: torch.Tensor) -> str:
    name = entry.get("name")
    return f"parameter {index}" + (f" ({name})" if name else "") + f" of shape {list(param.shape)}"


def _fail(index: int, entry: dict[str, Any], param: torch.Tensor, problem: str) -> None:
    raise CheckpointError(
        f"ZenFlowAdamW.load_state_dict: {_label(index, entry, param)}: {problem}. The optimizer checkpoint is damaged "
        "or belongs to another model; restore it from a copy, or resume without it (fresh optimizer state)."
    )


#: The tensors of a split entry that hold only this rank's share under several ranks.
_SHARED_KEYS = ("host_master", "host_exp_avg", "host_exp_avg_sq", "accum")

_FP32_KEYS = ("device_master", "device_exp_avg", "device_exp_avg_sq", "host_master", "host_exp_avg",
              "host_exp_avg_sq", "accum", "exp_avg", "exp_avg_sq", "master")


def validate(opt: ZenFlowAdamW, state_dict: dict[str, Any]) -> None:
    """Refuse a state dict that does not fit `opt`'s parameters or holds damaged values, naming the tensor."""
    params = opt._engine_params()
    saved_groups = state_dict.get("param_groups")
    if not isinstance(saved_groups, list) or len(saved_groups) != len(opt.param_groups) or any(
        len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, opt.param_groups)
    ):
        raise CheckpointError(
            "ZenFlowAdamW.load_state_dict: the saved param groups do not match this optimizer's (different number "
            f"of groups or of parameters per group: saved {[len(s['params']) for s in saved_groups or []]}, here "
            f"{[len(g['params']) for g in opt.param_groups]})."
        )
    for index, entry in state_dict["state"].items():
        if not 0 <= int(index) < len(params):
            raise CheckpointError(f"ZenFlowAdamW.load_state_dict: state for parameter {index}, but this optimizer "
                                  f"has {len(params)} parameters.")
        p = params[int(index)]
        if entry.get("kind") not in ("split", "dense"):
            _fail(index, entry, p, f"unknown entry kind {entry.get('kind')!r}")
        if "shape" in entry and list(entry["shape"]) != list(p.shape):
            _fail(index, entry, p, f"saved for a parameter of shape {list(entry['shape'])}")
        tensors = _tensors(entry)
        numel_ok = {"host_master", "host_exp_avg", "host_exp_avg_sq", "accum", "exp_avg", "exp_avg_sq", "master"}
        share = entry.get("share")
        for key, t in tensors.items():
            expected = p.numel() // share[2] * share[1] if share and key in _SHARED_KEYS else p.numel()
            if key in numel_ok and t.numel() != expected:
                _fail(index, entry, p, f"{key} has {t.numel()} elements, expected {expected}")
            if key in _FP32_KEYS and t.dtype != torch.float32:
                _fail(index, entry, p, f"{key} is {t.dtype}, expected torch.float32")
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                bad = int((~torch.isfinite(t)).sum())
                _fail(index, entry, p, f"{key} holds {bad} non-finite value(s)")
            if key.endswith("exp_avg_sq") and bool((t < 0).any()):
                _fail(index, entry, p, f"{key} holds negative values (a second moment cannot be negative)")
            if key.endswith("step") and (t.numel() != 1 or float(t) < 0):
                _fail(index, entry, p, f"{key} is {t.tolist()}, expected a count >= 0")
        checksums = entry.get("checksums")
        if checksums is not None:
            for key, t in tensors.items():
                if key in checksums and tensor_checksum(t) != checksums[key]:
                    _fail(index, entry, p, f"{key} does not match its checksum (its bytes were altered)")
            missing = sorted(set(checksums) - set(tensors))
            if missing:
                _fail(index, entry, p, f"tensors {missing} are missing")
        if entry["kind"] == "split":
            _validate_split(index, entry, p)


def _validate_split(index: int, entry: dict[str, Any], p: torch.Tensor) -> None:
    units = p.shape[0] if entry.get("rows", False) else math.prod(p.shape[1:])  # (an FSDP2 shard may have 0 rows)
    if not 0 <= int(entry["k"]) <= units:
        _fail(index, entry, p, f"k={entry['k']} is not in [0, {units}]")
    if "device_index" not in entry:
        return
    idx = entry["device_index"]
    if idx.dtype not in (torch.int64, torch.int32) or idx.ndim != 1:
        _fail(index, entry, p, f"device_index is {idx.dtype} of shape {list(idx.shape)}, expected 1-D integers")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= units or bool((idx[1:] <= idx[:-1]).any())):
        _fail(index, entry, p, f"device_index is not a sorted set of distinct indices in [0, {units})")
    if int(entry["k"]) != idx.numel() or entry["device_master"].shape[int(entry.get("axis", 1))] != idx.numel():
        _fail(index, entry, p, f"k={entry['k']} does not match the {idx.numel()} saved device columns")


@torch.no_grad()
def unpack(opt: ZenFlowAdamW, state_dict: dict[str, Any]) -> None:
    """Restore `opt` (its worker idle) from a ZenFlow or a `torch.optim.AdamW` state dict."""
    from .checkpoint_convert import apply_changed_settings, is_torch_adamw_state, unpack_torch_adamw

    if is_torch_adamw_state(state_dict):
        unpack_torch_adamw(opt, state_dict)
        return
    if "param_groups" not in state_dict or "state" not in state_dict:
        raise CheckpointError("ZenFlowAdamW.load_state_dict: not an optimizer state dict (needs 'state' and "
                              f"'param_groups'; got keys {sorted(state_dict)[:8]}).")
    state_dict = migrate(state_dict)
    from .accumulation import resumed_choice
    from .checkpoint_reshard import check_fsdp_ranks, check_ranks, fsdp_rows_of

    mesh = opt._host.param_shards
    if mesh is not None and state_dict.get("zenflow") and not {"ranks", "fsdp_ranks"} & set(state_dict["zenflow"]):
        state_dict = fsdp_rows_of(state_dict, mesh.ranks, mesh.rank)  # a one-process state: this rank's rows of it
    check_ranks(state_dict.get("zenflow") or {}, opt._host.shards.ranks, opt._host.shards.rank)
    check_fsdp_ranks(state_dict.get("zenflow") or {}, opt._host.param_shards)
    validate(opt, state_dict)
    _restore_groups(opt, state_dict["param_groups"])
    opt._reset_state()
    zenflow = state_dict.get("zenflow")
    if zenflow is None:
        return
    params = opt._engine_params()
    groups = [g for g in opt.param_groups for _ in g["params"]]
    schedule = opt._ensure_schedule()
    for key in ("steps", "window_steps", "windows", "reselections", "last_interval"):
        setattr(schedule, key, int(zenflow[key]))
    schedule.force_select = bool(zenflow.get("force_select", False))
    if opt.config.writeback_lag == "auto" and "writeback_lag_pending" in zenflow:
        # the saved run's lag, chosen or still provisional; an explicit setting replaces it
        schedule.writeback_lag = zenflow["writeback_lag"]
        schedule.writeback_lag_pending = bool(zenflow["writeback_lag_pending"])
    # before any host state is restored: it is created for the accumulation the saved run chose
    opt._host.accumulate_chosen = resumed_choice(opt.config, zenflow)
    opt._host.writeback_pending = bool(zenflow["writeback_pending"])
    opt._host.unapplied_steps = [int(n) for n in zenflow["unapplied_steps"]]
    opt._stats.skipped_steps = int(zenflow["skipped_steps"])
    for index, entry in state_dict["state"].items():
        p = params[int(index)]
        if entry["kind"] == "dense":
            dense = DenseDeviceState.fresh(p)
            for name in ("step", "exp_avg", "exp_avg_sq"):
                getattr(dense, name).copy_(entry[name].view_as(getattr(dense, name)))
            if entry["master"] is not None and dense.master is not None:
                # (an fp32 parameter is its own master: format 1 saved a copy of it, the same values as the weights)
                dense.master.copy_(entry["master"].view_as(dense.master))
            opt._dense[p] = dense
            continue
        opt._split[p] = _restore_split(opt, p, groups[int(index)], int(index), entry)
    apply_changed_settings(opt, zenflow.get("config") or {})


def load(opt: ZenFlowAdamW, state_dict: dict[str, Any]) -> None:
    """`ZenFlowAdamW.load_state_dict` (its worker idle): `unpack`, then a host worker whose thread count or mode no
    longer matches the settings in force is closed (the next step starts one with the current settings)."""
    before = (opt.config.resolved_cpu_threads, opt.config.overlap_step)
    unpack(opt, state_dict)
    worker = opt._host.worker
    if worker is not None and (worker.threads, worker.background) != (
        before[0], before[1] and opt.host_executor == "thread"
    ):
        opt.close()
    opt._mark_weights()


def _restore_groups(opt: ZenFlowAdamW, saved_groups: list[dict[str, Any]]) -> None:
    for group, saved in zip(opt.param_groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k != "params" and k not in _TORCH_ONLY_GROUP_KEYS})
        group["betas"] = tuple(group["betas"])


def _restore_split(opt: ZenFlowAdamW, p: torch.Tensor, group: dict[str, Any], index: int, entry: dict[str, Any]
                   ) -> SplitMatrix:
    split = SplitMatrix(p, int(entry["k"]), rows=bool(group.get("select_rows", False)), owner=opt._fsdp.owner(p))
    if bool(entry.get("rows", False)) != split.rows:
        raise CheckpointError(
            f"ZenFlowAdamW.load_state_dict: {_label(index, entry, p)} was saved with select_rows="
            f"{bool(entry.get('rows', False))} but its param group now has select_rows={split.rows}: the saved "
            "selection indexes different units (rows vs columns). Use the same setting to resume."
        )
    split.auto = ZenAutoStats.from_list(entry["auto"])
    # saved from a parameter in the other layout (see `column_major_`): every matrix here is transposed
    flip = not split.rows and int(entry.get("axis", 1)) != split.axis

    def fit(t: torch.Tensor) -> torch.Tensor:
        return t.t() if flip and t.ndim == 2 else t

    if "host_master" in entry:
        opt._host.attach_host([split])
        host = split.host
        # a one-process state dict loaded under several ranks: each takes its share
        mine = (lambda t: split.share.local(fit(t))) if "share" not in entry else fit
        for name in ("master", "exp_avg", "exp_avg_sq"):
            getattr(host, name).copy_(mine(entry[f"host_{name}"]))
        host.step.copy_(entry["host_step"])
        # the open window's sum goes wherever this optimizer keeps it (either setting can load either)
        target = split.window_sum if split.window_sum is not None else host.accum
        if split.window_sum is not None:
            split.window_count = int(entry["accum_count"])
        else:
            host.accum_count = int(entry["accum_count"])
        if entry["accum"] is not None:
            target.copy_(mine(entry["accum"]))
        host.writeback.copy_(host.master)  # a pending write-back reads this buffer
        host.writeback_fresh = opt._host.writeback_pending
    if "device_master" in entry:
        split.device = DeviceColumns.from_columns(
            entry["device_index"].long(), fit(entry["device_master"]), fit(entry["device_exp_avg"]),
            fit(entry["device_exp_avg_sq"]), step=entry["device_step"], device=p.device, axis=split.axis,
        )
    return split


_RESUME_ADVICE = "Resume from an earlier checkpoint, or without the optimizer state."


def check_file(path: str | Path) -> None:
    """Cheap checks of an optimizer checkpoint file before `torch.load` (which fails on them with bare errors such
    as ``EOFError``): it exists, is not empty and is a complete zip archive (torch's format)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such optimizer checkpoint file.")
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"{path}: the optimizer checkpoint is empty (0 bytes): it was not written completely "
                              f"(the process was killed while saving, or the disk was full). {_RESUME_ADVICE}")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path}: the optimizer checkpoint ({size} bytes) is not a complete torch.save archive: "
                              f"it is truncated or damaged. {_RESUME_ADVICE}")


def load_file(path: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
    """`torch.load` of an optimizer checkpoint (``weights_only=True``) with errors that name the file and the
    problem."""
    check_file(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - every failure of a damaged file gets the same explanation
        raise CheckpointError(
            f"{path}: the optimizer checkpoint ({Path(path).stat().st_size} bytes) cannot be read "
            f"({type(exc).__name__}: {exc}): it is truncated or damaged. {_RESUME_ADVICE}"
        ) from exc


__all__ = ["FORMAT_VERSION", "CheckpointError", "check_file", "load", "load_file", "migrate", "pack",
           "tensor_checksum", "unpack", "validate"]

