"""The checkpoint format of `ZenFlowAdamW`: what `state_dict()` writes, how `load_state_dict()` checks and restores
it, and the conversion to and from `torch.optim.AdamW` checkpoints.

Format version 3 (``state_dict()["zenflow"]["format_version"]``): per parameter index an entry of kind ``"split"``
(a matrix: selection, device columns, host state, the open window's gradient sum) or ``"dense"`` (updated wholly on
the device), each with the parameter's ``shape`` and ``dtype``, its name when known, and a ``checksums`` dict; the
``zenflow`` block carries a ``checksum`` too. Together they cover every tensor and every non-tensor field (counters,
settings, hyper-parameters, Zen-auto statistics) and their own presence (`checkpoint_validate`), so that a damaged
file is refused instead of training on garbage (torch's own loader does not check its zip CRCs). Version 2
(2026-12-01: checksums of the tensors only) and version 1 (no ``format_version``, no shapes or checksums) are read by
migration, with a logged note that their other fields are checked by range only. A newer version is refused.

Loading is transactional: every field is parsed and checked (types, ranges, shapes, dtypes, saved parameter names
against this optimizer's, checksums) before anything is written, and every refusal is a `CheckpointError` naming the
entry and what was expected; the optimizer is then unchanged.

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

from . import checkpoint_validate as checks
from .checkpoint_seal import PREFIX, Refusal, bits_sum, migrate_old, seal, verify
from .device_step import DenseDeviceState, DeviceColumns
from .schedule import ZenAutoStats
from .split_matrix import SplitMatrix


if TYPE_CHECKING:
    from .optimizer import ZenFlowAdamW

logger = logging.getLogger(__name__)

FORMAT_VERSION = 3

#: Group keys of `torch.optim.AdamW` that ZenFlowAdamW has no use for (its behaviour is fixed: fused, decoupled).
_TORCH_ONLY_GROUP_KEYS = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused",
                          "decoupled_weight_decay", "param_names")

#: Settings that are not the user's to change on resume (filled in by the Trainer or the plugin).
_DERIVED_SETTINGS = ("steps_per_epoch",)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is: damaged, from another model, or from an incompatible version.
    The message names the file or tensor and what to do."""


def tensor_checksum(t: torch.Tensor) -> int:
    """Format 2's checksum of a tensor: a 64-bit wrap-around sum of its bits (format 3 uses
    `checkpoint_validate.tensor_digest`, which also changes when values move)."""
    return bits_sum(t)


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
            # moments stored bf16 (host_moment_dtype) are saved widened, exactly: the file format stays fp32, and a
            # resume under either setting restores them (the setting itself is in the saved config)
            # a bf16 window sum (accumulate_on="device_bf16") too: any setting loads it, and "device_bf16" rounds it
            # back to the same bits
            entry.update(host_master=h.master, host_exp_avg=h.exp_avg.float(), host_exp_avg_sq=h.exp_avg_sq.float(),
                         host_step=h.step, accum=accum.float() if count else None, accum_count=count)
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
    return seal({"state": state, "param_groups": groups, "zenflow": zenflow})


# ---------------------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------------------
_DAMAGED = ("The optimizer checkpoint is damaged or belongs to another model; restore it from a copy, or resume "
            "without it (fresh optimizer state).")

#: What malformed input can raise while it is parsed: every one becomes a `CheckpointError`.
_PARSE_ERRORS = (Refusal, KeyError, IndexError, TypeError, AttributeError, ValueError, RuntimeError)


def _refused(exc: Exception) -> CheckpointError:
    if isinstance(exc, CheckpointError):
        return exc
    problem = str(exc) if isinstance(exc, Refusal) else f"the state is malformed ({type(exc).__name__}: {exc})"
    return CheckpointError(f"{PREFIX}: {problem}. {_DAMAGED}")


def migrate(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The state dict in the current format version, its checksums verified (an older format's are checked and
    the result sealed anew); refuses versions this hf_zenflow does not know."""
    try:
        return _migrate(state_dict)
    except _PARSE_ERRORS as exc:
        raise _refused(exc) from None


def _migrate(state_dict: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(state_dict, dict) or "param_groups" not in state_dict or "state" not in state_dict:
        keys = sorted(map(str, state_dict))[:8] if isinstance(state_dict, dict) else type(state_dict).__name__
        raise Refusal(f"not an optimizer state dict (needs 'state' and 'param_groups'; got {keys})")
    if not isinstance(state_dict["state"], dict):
        raise Refusal(f"'state' is {type(state_dict['state']).__name__}, expected a dict of per-parameter entries")
    zenflow = state_dict.get("zenflow")
    if zenflow is None:
        verify(state_dict)  # (only a never-stepped optimizer's state has no block: it has no entries)
        return state_dict
    if not isinstance(zenflow, dict):
        raise Refusal(f"the 'zenflow' block is {type(zenflow).__name__}, expected a dict")
    version = zenflow.get("format_version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise Refusal(f"format_version={version!r} is invalid, expected an integer >= 1")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{PREFIX}: the checkpoint has format_version={version!r}, written by a newer hf_zenflow; this one reads "
            f"versions 1 to {FORMAT_VERSION}. Upgrade hf_zenflow to resume from it."
        )
    if version < FORMAT_VERSION:
        return migrate_old(state_dict, version, FORMAT_VERSION)
    verify(state_dict)
    return state_dict


def _label(index: Any, entry: dict[str, Any], param: torch.Tensor) -> str:
    name = entry.get("name")
    return f"parameter {index}" + (f" ({name})" if isinstance(name, str) else "") + f" of shape {list(param.shape)}"


def validate(opt: ZenFlowAdamW, state_dict: dict[str, Any]) -> None:
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


def _validate(opt: ZenFlowAdamW, state_dict: dict[str, Any]) -> None:
    params = opt._engine_params()
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
        checks.check_name(where, entry.get("name"), opt._param_names.get(opt._fsdp.owner(p)))
        rows = bool(groups[i].get("select_rows", False))
        units = p.shape[0] if rows else math.prod(p.shape[1:])  # (an FSDP2 shard may have 0 rows)
        checks.check_entry_fields(where, entry, p, zenflow["steps"], units, rows)
        checks.check_tensors(where, entry, p)
        if entry["kind"] == "split" and "device_index" in entry:
            checks.check_device_columns(where, entry, p, units)
    checks.check_settings_change(opt, zenflow)


@torch.no_grad()
def unpack(opt: ZenFlowAdamW, state_dict: dict[str, Any]) -> None:
    """Restore `opt` (its worker idle) from a ZenFlow or a `torch.optim.AdamW` state dict."""
    from .checkpoint_convert import apply_changed_settings, is_torch_adamw_state, unpack_torch_adamw

    if is_torch_adamw_state(state_dict):
        unpack_torch_adamw(opt, state_dict)
        return
    try:
        state_dict = _checked(opt, state_dict)
    except _PARSE_ERRORS as exc:
        raise _refused(exc) from None
    # From here on every value read was checked: the optimizer is only written now.
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
    from .accumulation import resumed_choice

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


def _checked(opt: ZenFlowAdamW, state_dict: dict[str, Any]) -> dict[str, Any]:
    """`state_dict` migrated, cut to this rank's part where needed, and checked through and through."""
    from .checkpoint_reshard import check_fsdp_ranks, check_ranks, fsdp_rows_of

    state_dict = _migrate(state_dict)
    zenflow = state_dict.get("zenflow")
    if zenflow is not None:
        checks.check_block(zenflow)  # (the rank fields are read next)
    mesh = opt._host.param_shards
    if mesh is not None and zenflow and not {"ranks", "fsdp_ranks"} & set(zenflow):
        state_dict = fsdp_rows_of(state_dict, mesh.ranks, mesh.rank)  # a one-process state: this rank's rows of it
    check_ranks(state_dict.get("zenflow") or {}, opt._host.shards.ranks, opt._host.shards.rank)
    check_fsdp_ranks(state_dict.get("zenflow") or {}, opt._host.param_shards)
    _validate(opt, state_dict)
    return state_dict


def load(opt: ZenFlowAdamW, state_dict: dict[str, Any]) -> None:
    """`ZenFlowAdamW.load_state_dict` (its worker idle): `unpack`, then a host worker whose thread count or mode no
    longer matches the settings in force is closed (the next step starts one with the current settings)."""
    before = (opt.config.resolved_cpu_threads, opt.config.overlap_step)
    unpack(opt, state_dict)
    worker = opt._host.worker
    if worker is not None and (worker.threads, worker.background) != (
        before[0], before[1] and opt.host_executor == "thread"
    ):
        opt._host.stop_worker()  # (not `opt.close()`: the run goes on, its cores stay claimed and the state just
        # loaded keeps its pinned buffers)
    opt._mark_weights()


def _restore_groups(opt: ZenFlowAdamW, saved_groups: list[dict[str, Any]]) -> None:
    for group, saved in zip(opt.param_groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k != "params" and k not in _TORCH_ONLY_GROUP_KEYS})
        group["betas"] = tuple(group["betas"])


def _restore_split(opt: ZenFlowAdamW, p: torch.Tensor, group: dict[str, Any], index: int, entry: dict[str, Any]
                   ) -> SplitMatrix:
    split = SplitMatrix(p, int(entry["k"]), rows=bool(group.get("select_rows", False)), owner=opt._fsdp.owner(p))
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

