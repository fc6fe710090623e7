"""The checkpoint format of `ZenFlowAdamW`: what `state_dict()` writes (`pack`), its versions and their migration, and
the checks of a checkpoint file. Loading (`restore.py`) and the conversions to and from `torch.optim.AdamW`
(`convert.py`) are beside it.

Format version 4 (``state_dict()["zenflow"]["format_version"]``): per parameter index an entry of kind ``"split"``
(a matrix: selection, device columns, host state, the open window's gradient sum) or ``"dense"`` (updated wholly on
the device), each with the parameter's ``shape`` and ``dtype``, its name when known, and a ``checksums`` dict; the
``zenflow`` block carries a ``checksum`` too. Together they cover every tensor and every non-tensor field (counters,
settings, hyper-parameters, Zen-auto statistics) and their own presence (`validate.py`), so that a damaged
file is refused instead of training on garbage (torch's own loader does not check its zip CRCs). Every tensor is
saved in the dtype it is kept in (bf16 host moments and window sums as bf16), and nothing the fp32 weights hold is
saved twice: a split entry's ``host_master`` is None where the weights are the master of every column the host owns
(no host result waiting for its write-back), with the device columns' own host values in ``host_master_columns``,
and its ``device_master`` None where the weights hold the device columns' (`host_master_to_save`,
`weights_hold_columns`); loading takes them from the parameters, as a dense fp32 parameter's master always was.
Format 3 (every master saved, moments and sums widened to fp32) loads as it is; any other version is refused in one
line.

Loading is transactional: every field is parsed and checked (types, ranges, shapes, dtypes, saved parameter names
against this optimizer's, checksums) before anything is written, and every refusal is a `CheckpointError` naming the
entry and what was expected; the optimizer is then unchanged.

Under several data-parallel ranks (`distributed/sharding.py`) each rank's state dict holds its share of the host state:
the ``zenflow`` block says ``ranks`` and ``rank``, each split entry its ``share`` (start, length, size of the shared
dimension). It loads on the same rank of the same number of ranks; a one-process state dict loads on any number of
ranks (each rank takes its share); other combinations are refused, naming both rank counts. Under FSDP2
(`distributed/fsdp.py`) every entry is of this rank's shard of the parameter (shapes included) and the block says
``fsdp_ranks`` and
``fsdp_rank``: it loads only on the same rank of the same world size.

Loading compares the saved settings with the optimizer's own and lets the current ones take effect (a new
``topk_ratio`` re-selects every matrix at the next step, moments kept; a new ``min_offload_numel`` or
``device_memory_limit_bytes`` moves matrices between the split and the dense path, and otherwise the threshold the
limit chose, ``limit_min_offload_numel``, is kept; the rest apply as they are), logging what changed.
"""

from __future__ import annotations

import logging
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..engine.quantized_moments import QuantizedMoment
from .seal import PREFIX, Outdated, Refusal, seal, verify
from .state import ZenFlowState


if TYPE_CHECKING:
    from ..engine.split_matrix import SplitMatrix


logger = logging.getLogger(__name__)

FORMAT_VERSION = 4
#: The format versions this hf_zenflow reads: 3 is 4 with every master saved and the host moments and window sums
#: widened to fp32, which the readers of 4 take as they are.
READ_VERSIONS = (3, 4)

#: Group keys of `torch.optim.AdamW` that ZenFlowAdamW has no use for (its behaviour is fixed: fused, decoupled).
_TORCH_ONLY_GROUP_KEYS = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused",
                          "decoupled_weight_decay", "param_names")

class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is: damaged, from another model, or from an incompatible version.
    The message names the file or tensor and what to do."""


@dataclass(frozen=True)
class SavedProgress:
    """How far the run that wrote an optimizer state dict had got, for a resume to compare with the Trainer's state:
    `steps`, the optimizer steps it had taken (`exact`: every `step()` call, skipped ones included, as a ZenFlow state
    counts them; not `exact`: a `torch.optim.AdamW` state's largest per-parameter step, which leaves out steps a
    GradScaler skipped), and the `max_grad_norm` it clipped at last (None: not recorded)."""

    steps: int
    exact: bool
    max_grad_norm: float | None = None


def saved_progress(state_dict: dict[str, Any]) -> SavedProgress | None:
    """The `SavedProgress` of a state dict that loaded (checked already); None for one without steps (a state saved
    before the first step)."""
    zenflow = state_dict.get("zenflow")
    if zenflow is not None:
        return SavedProgress(int(zenflow["steps"]) + int(zenflow["skipped_steps"]), True,
                             zenflow.get("max_grad_norm"))
    steps = [float(entry["step"]) for entry in state_dict.get("state", {}).values()
             if isinstance(entry, dict) and "step" in entry]
    return SavedProgress(int(max(steps)), False) if steps else None



def _tensors(entry: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in entry.items() if isinstance(v, torch.Tensor)}


#: A split entry's 8-bit host moments: the codes' key and the key of their per-block scales.
QUANTIZED_MOMENTS = (("host_exp_avg", "host_exp_avg_scale"), ("host_exp_avg_sq", "host_exp_avg_sq_scale"))


def is_quantized(entry: dict[str, Any]) -> bool:
    """Whether the split `entry` holds 8-bit host moments (codes and scales: ``host_moment_dtype="int8"``)."""
    return "host_exp_avg_scale" in entry


def widen_moments(entry: dict[str, Any]) -> dict[str, Any]:
    """`entry` with 8-bit host moments replaced by their fp32 values (a new dict; other entries as they are): what a
    reader that cuts, joins or converts the host state works on."""
    if not is_quantized(entry):
        return entry
    out = dict(entry)
    for codes_key, scales_key in QUANTIZED_MOMENTS:
        codes = entry[codes_key]
        moment = QuantizedMoment(codes, entry[scales_key].float())
        out[codes_key] = moment.float()
        del out[scales_key]
    out.pop("checksums", None)  # (the caller seals what it builds)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------------------
#: Elements compared at a time when `host_master_to_save` checks a master against the weights (a bounded copy of a
#: GPU's weights on the host).
_COMPARE_ELEMENTS = 1 << 22


def weights_hold_columns(split: SplitMatrix) -> bool:
    """Whether the fp32 weights hold `split`'s device columns' master values exactly (the step writes them there):
    then they are not saved twice."""
    d = split.device
    if split.param.dtype != torch.float32 or d is None:
        return False
    return torch.equal(split.matrix(split.param.detach()).index_select(split.axis, d.index), d.master)


def host_master_to_save(split: SplitMatrix) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the host master to save, the values of its device columns to save beside it): (None, those columns) when the
    fp32 weights hold the master of every column the host owns (no host result waiting for its write-back: the
    weights, saved with the model, are then the master there); (the master, None) otherwise. The device columns'
    host values (the host's own, refreshed from the device at each re-selection) are kept as they are."""
    host, param = split.host, split.param
    if param.dtype != torch.float32 or split.share.ranks > 1:
        return host.master, None
    weight = split.host_part(param.detach())
    index = split.device.index.cpu() if split.device is not None else None
    rows = max(1, _COMPARE_ELEMENTS // max(1, weight.shape[1]))
    for start in range(0, weight.shape[0], rows):
        mine, theirs = host.master[start:start + rows], weight[start:start + rows].cpu()
        same = mine == theirs
        if index is not None and split.axis == 1:
            same[:, index] = True
        elif index is not None:  # (column-major storage: the device columns are rows)
            inside = index[(index >= start) & (index < start + mine.shape[0])] - start
            same[inside] = True
        if not bool(same.all()):
            return host.master, None
    return None, None if index is None else host.master.index_select(split.axis, index)


def pack(opt: ZenFlowState) -> dict[str, Any]:
    """The state dict of `opt` (its worker idle): see the module docstring."""
    engine = opt.engine_state
    index_of: dict[torch.Tensor, int] = {}
    groups = []
    for group in opt.param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = []
        for p in group["params"]:
            packed["params"].append(len(index_of))
            index_of[engine.fsdp.local(p)] = len(index_of)  # (the engine keys an FSDP2 parameter by its shard)
        groups.append(packed)
    state: dict[int, dict[str, Any]] = {}
    for p, split in engine.splits.items():
        # the matrix's state as held (the moments in the dtype they are stored in: a resume under either setting
        # restores them, widened or rounded as the new setting stores them; 8-bit ones as codes and per-block scales,
        # for an exact resume, which readers that move the state elsewhere widen: `widen_moments`; the open window's
        # sum as it is kept: any setting loads it, and a bf16 one gets the same bits), less what the fp32 weights
        # hold: a master saved twice
        held = split.state()
        master, columns = host_master_to_save(split) if split.host is not None else (None, None)
        entry: dict[str, Any] = {"kind": "split"}
        for key, value in held.items():
            if key == "device_master" and weights_hold_columns(split):
                value = None
            elif key == "host_master":
                value = master
            entry[key] = value
            if key == "accum_count" and columns is not None:  # (the device columns' host values, beside the master)
                entry["host_master_columns"] = columns
        state[index_of[p]] = entry
    for p, dense in engine.dense.items():
        state[index_of[p]] = {
            "kind": "dense", "step": dense.step, "exp_avg": dense.exp_avg, "exp_avg_sq": dense.exp_avg_sq,
            "master": dense.master,  # None: the fp32 parameter is its own master (saved with the model)
        }
    for p, entry in state.items():
        param = next(q for q, i in index_of.items() if i == p)
        entry.update(shape=list(param.shape), dtype=str(param.dtype).removeprefix("torch."))
        name = engine.name_of(param)
        if name is not None:
            entry["name"] = name
    schedule = engine.schedule
    zenflow = None
    if schedule is not None:
        host, progress, counters = engine.host.state(), schedule.state(), engine.state()
        zenflow = {
            "format_version": FORMAT_VERSION,
            **{key: progress[key] for key in (*schedule.COUNTERS, "force_select", "writeback_lag",
                                              "writeback_lag_pending")},
            "high_lr_window": progress["high_lr_window"],  # (`high_lr_rule="auto"`'s choice: None = not engaged)
            "host_step_guard": host["host_step_guard"],  # (its factor, and a write-back it still watches)
            # the seed of the random bits that round narrow host moments: a resumed run rounds as this one would
            "rounding_seed": host["rounding_seed"],
            "writeback_pending": host["writeback_pending"], "unapplied_steps": host["unapplied_steps"],
            "skipped_steps": counters["skipped_steps"], "config": opt.config.to_dict(),
            # the max_norm of the last `clip_grad_norm_` (None: never called; inf: measured only): a resume through
            # the Trainer compares it with its max_grad_norm (`hf/resume.py`)
            "max_grad_norm": counters["max_grad_norm"],
            # where windows are summed ("auto"'s choice; None before any host state): a resumed run keeps it
            "accumulate_on": host["accumulate_on"],
            # the min_offload_numel device_memory_limit_bytes chose (None: no limit): a resumed run keeps it
            "limit_min_offload_numel": progress["limit_min_offload_numel"],
        }
        # with several ranks, this rank's share of the host state; under FSDP2, this rank's shards of the parameters
        zenflow.update({key: host[key] for key in ("ranks", "rank", "fsdp_ranks", "fsdp_rank") if key in host})
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
    if isinstance(exc, Outdated):
        return CheckpointError(f"{PREFIX}: {exc}; resume without it (fresh optimizer state), or with the version "
                               "that wrote it.")
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
    version = zenflow.get("format_version")
    if version not in READ_VERSIONS or isinstance(version, bool):
        raise CheckpointError(
            f"{PREFIX}: the checkpoint has format_version={version!r}; this hf_zenflow reads formats "
            f"{', '.join(map(str, READ_VERSIONS))}. Resume without the optimizer state, or with the hf_zenflow that "
            "wrote it."
        )
    verify(state_dict)
    return state_dict


def _restore_groups(opt: ZenFlowState, saved_groups: list[dict[str, Any]]) -> None:
    for group, saved in zip(opt.param_groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k != "params" and k not in _TORCH_ONLY_GROUP_KEYS})
        group["betas"] = tuple(group["betas"])


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


__all__ = ["FORMAT_VERSION", "CheckpointError", "SavedProgress", "ZenFlowState", "check_file", "load_file", "migrate",
           "pack", "saved_progress"]

