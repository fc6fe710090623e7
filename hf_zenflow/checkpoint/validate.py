"""Types and ranges of every field of a `ZenFlowAdamW` state dict, checked before anything is restored from it
(`checkpoint.unpack`), so that a refusal changes nothing: each problem is a `Refusal` naming the entry, the field and
what was expected (`checkpoint` turns it into a `CheckpointError`). The checksums are `seal.py`'s."""

from __future__ import annotations

import math
from typing import Any

import torch

from .._base import check_hyperparameters
from ..engine.host_guard import check_state as guard_problem
from ..engine.quantized_moments import BLOCK, blocks
from ..settings.config import ZenFlowConfig, removed_settings_text
from ..settings.rules import ACCUMULATE_ON
from .seal import Outdated, Refusal
from .state import ZenFlowState


_DEVICE_KEYS = ("device_index", "device_master", "device_exp_avg", "device_exp_avg_sq", "device_step")
_HOST_KEYS = ("host_master", "host_exp_avg", "host_exp_avg_sq", "host_step", "accum", "accum_count")
_BLOCK_INTS = ("steps", "window_steps", "windows", "reselections", "last_interval", "skipped_steps")
_BLOCK_BOOLS = ("force_select", "writeback_pending")

#: Step counts are fp32 tensors (as torch's AdamW keeps them): above 2**24 adding one step no longer changes them. The
#: block's counters (steps, windows, skipped steps...) are held to it too: no run this optimizer saves gets beyond.
_MAX_STEP_COUNT = 2**24

#: The tensors of a split entry that hold only this rank's share under several ranks.
_SHARED_KEYS = ("host_master", "host_exp_avg", "host_exp_avg_sq", "accum", "host_master_columns")

_FP32_KEYS = ("device_master", "device_exp_avg", "device_exp_avg_sq", "host_master", "host_master_columns",
              "exp_avg", "exp_avg_sq", "master")
#: Tensors kept in the dtype they are stored in: fp32, or bf16 (``host_moment_dtype="bfloat16"``, bf16 window sums).
_STORED_KEYS = ("host_exp_avg", "host_exp_avg_sq", "accum")
#: Masters an entry of an fp32 parameter may leave to the weights (None: the weights hold them).
_MASTERS_IN_WEIGHTS = ("host_master", "device_master")


# ---------------------------------------------------------------------------------------------------------------------
# Types and ranges
# ---------------------------------------------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _count(where: str, holder: dict[str, Any], key: str, top: int | None = None, low: int = 0) -> int:
    if key not in holder:
        raise Refusal(f"{where}: '{key}' is missing")
    value = holder[key]
    if not _is_int(value) or value < low or (top is not None and value > top):
        allowed = f"an integer >= {low}" + (f" and <= {top}" if top is not None else "")
        raise Refusal(f"{where}: {key}={value!r} is invalid, expected {allowed}")
    return value


def _flag(where: str, holder: dict[str, Any], key: str) -> bool:
    if key not in holder:
        raise Refusal(f"{where}: '{key}' is missing")
    if not isinstance(holder[key], bool):
        raise Refusal(f"{where}: {key}={holder[key]!r} is invalid, expected True or False")
    return holder[key]


def check_groups(opt: ZenFlowState, saved_groups: Any) -> None:
    """The saved param groups: as many as here, as many parameters each, valid hyper-parameters."""
    if not isinstance(saved_groups, list) or not all(isinstance(g, dict) for g in saved_groups):
        raise Refusal("'param_groups' is not a list of dicts")
    counts = [len(s["params"]) if isinstance(s.get("params"), list) else None for s in saved_groups]
    here = [len(g["params"]) for g in opt.param_groups]
    if counts != here:
        raise Refusal(f"the saved param groups do not match this optimizer's (different number of groups or of "
                      f"parameters per group: saved {counts}, here {here})")
    indices = [i for s in saved_groups for i in s["params"]]
    if sorted(indices) != list(range(len(indices))) or not all(_is_int(i) for i in indices):
        raise Refusal(f"param_groups: the parameter indices {indices[:16]} are not 0..{len(indices) - 1} once each")
    for n, saved in enumerate(saved_groups):
        where = f"param group {n}"
        for key in ("lr", "betas", "eps", "weight_decay"):
            if key not in saved:
                raise Refusal(f"{where}: '{key}' is missing")
        try:  # (the optimizers' own check of these values)
            check_hyperparameters(saved["lr"], saved["betas"], saved["eps"], saved["weight_decay"])
        except ValueError as exc:
            raise Refusal(f"{where}: {exc}") from None
        if "select_rows" in saved and not isinstance(saved["select_rows"], bool):
            raise Refusal(f"{where}: select_rows={saved['select_rows']!r} is invalid, expected True or False")


def check_block(zenflow: dict[str, Any]) -> None:
    """The zenflow block's counters, flags and settings: each in the range its `ZenFlowConfig` setting allows (the
    saved config's, checked by `ZenFlowConfig` itself), counters below `_MAX_STEP_COUNT`."""
    where = "the 'zenflow' block"
    config = _saved_config(where, zenflow)
    for key in _BLOCK_INTS:
        _count(where, zenflow, key, top=_MAX_STEP_COUNT)
    steps = zenflow["steps"]
    _count(where, zenflow, "window_steps", top=steps)
    _count(where, zenflow, "windows", top=steps)  # (a window closes at a step: warm-up steps close one each)
    for key in _BLOCK_BOOLS:
        _flag(where, zenflow, key)
    # the run's write-back lag and high_lr_rule's windows: never beyond the configured window (`ZenFlowConfig`'s
    # bound of writeback_lag)
    top, bound = config.writeback_lag_bound() if config is not None else (None, "")
    for key in ("writeback_lag", "high_lr_window"):
        value = zenflow.get(key)
        if value is not None and (not _is_int(value) or value < 1 or (top is not None and value > top)):
            allowed = f"an integer from 1 to {bound} ({top})" if top is not None else "an integer >= 1"
            raise Refusal(f"{where}: {key}={value!r} is invalid, expected None or {allowed}")
    if "writeback_lag_pending" in zenflow:
        _flag(where, zenflow, "writeback_lag_pending")
    seed = zenflow.get("rounding_seed")  # (a checkpoint from before stochastic rounding has none)
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 2 ** 64):
        raise Refusal(f"{where}: rounding_seed={seed!r} is invalid, expected an integer in [0, 2**64)")
    if "host_step_guard" in zenflow:  # (a checkpoint from before the guard has none: it starts afresh)
        problem = guard_problem(zenflow["host_step_guard"])
        if problem is not None:
            raise Refusal(f"{where}: {problem}")
    chosen_places = [c for c in ACCUMULATE_ON if c != "auto"]  # ("auto"'s choice)
    if zenflow.get("accumulate_on") not in (None, *chosen_places):
        raise Refusal(f"{where}: accumulate_on={zenflow['accumulate_on']!r} is invalid, expected one of "
                      f"{chosen_places} or None (not decided yet)")
    clip = zenflow.get("max_grad_norm")
    if clip is not None and (not _is_number(clip) or not clip >= 0):  # (inf: measured only)
        raise Refusal(f"{where}: max_grad_norm={clip!r} is invalid, expected a number >= 0 (inf: not clipped) or None")
    chosen = zenflow.get("limit_min_offload_numel")
    top = (zenflow.get("config") or {}).get("min_offload_numel")
    if chosen is not None and (not _is_int(chosen) or chosen < 0 or (_is_int(top) and chosen > top)):
        raise Refusal(f"{where}: limit_min_offload_numel={chosen!r} is invalid, expected None (no device memory "
                      "limit) or an integer from 0 to the saved min_offload_numel"
                      + (f" ({top})" if _is_int(top) else ""))
    unapplied = zenflow.get("unapplied_steps")
    if not isinstance(unapplied, list) or not all(_is_int(n) and 0 <= n <= steps for n in unapplied):
        raise Refusal(f"{where}: unapplied_steps={unapplied!r} is invalid, expected a list of step counts "
                      f"in [0, {steps}]")
    for key in ("ranks", "fsdp_ranks"):
        if key in zenflow:
            ranks = _count(where, zenflow, key, low=1)
            _count(where, zenflow, key.removesuffix("s"), top=ranks - 1)


def _saved_config(where: str, zenflow: dict[str, Any]) -> ZenFlowConfig | None:
    """The block's saved settings, checked by `ZenFlowConfig` itself (None: a state saved without them)."""
    config = zenflow.get("config")
    if config is None:
        return None
    removed = removed_settings_text(config) if isinstance(config, dict) else None
    if removed:
        raise Outdated(f"{where}: it was written by an earlier version of hf_zenflow: its {removed} in this "
                       "version, so it cannot be loaded")
    try:
        return ZenFlowConfig.from_dict(config)
    except (TypeError, ValueError) as exc:
        raise Refusal(f"{where}: its config is invalid ({exc})") from None


def check_entry_fields(where: str, entry: dict[str, Any], p: torch.Tensor, steps: int, units: int,
                       select_rows: bool) -> None:
    """The non-tensor fields of one entry and which tensors it must hold."""
    if "shape" in entry and (not isinstance(entry["shape"], list) or entry["shape"] != list(p.shape)):
        raise Refusal(f"{where}: saved for a parameter of shape {entry['shape']!r}")
    if "dtype" in entry and entry["dtype"] != str(p.dtype).removeprefix("torch."):
        raise Refusal(f"{where}: saved for a parameter of dtype {entry['dtype']!r}, this one is {p.dtype}")
    if entry["kind"] == "dense":
        for key in ("step", "exp_avg", "exp_avg_sq"):
            if not isinstance(entry.get(key), torch.Tensor):
                raise Refusal(f"{where}: '{key}' is missing or not a tensor")
        if "master" not in entry or not (entry["master"] is None or isinstance(entry["master"], torch.Tensor)):
            raise Refusal(f"{where}: 'master' is missing (expected a tensor or None)")
        return
    _count(where, entry, "k", top=units)
    auto = entry.get("auto")
    if not isinstance(auto, list) or len(auto) != 3 or not all(_is_number(v) and math.isfinite(v) and v >= 0
                                                               for v in auto) or auto[2] != int(auto[2]):
        raise Refusal(f"{where}: auto={auto!r} is invalid, expected Zen-auto's [mean critical, accumulated "
                      "non-critical, steps]: three finite numbers >= 0, the last a whole number")
    if entry.get("axis") not in (0, 1) or isinstance(entry.get("axis"), bool):
        raise Refusal(f"{where}: axis={entry.get('axis')!r} is invalid, expected 0 or 1")
    if _flag(where, entry, "rows") != select_rows:
        raise Refusal(f"{where}: saved with select_rows={entry['rows']} but its param group now has select_rows="
                      f"{select_rows}: the saved selection indexes different units (rows vs columns). Use the same "
                      "setting to resume")
    for keys in (_DEVICE_KEYS, _HOST_KEYS):
        present = [k for k in keys if k in entry]
        if present and len(present) != len(keys):
            raise Refusal(f"{where}: {sorted(set(keys) - set(present))} are missing (the entry has {present})")
    for key in _DEVICE_KEYS + _HOST_KEYS[:4]:
        if key in _MASTERS_IN_WEIGHTS and key in entry and entry[key] is None and p.dtype == torch.float32:
            continue  # (the fp32 weights hold it)
        if key in entry and not isinstance(entry[key], torch.Tensor):
            raise Refusal(f"{where}: {key} is {type(entry[key]).__name__}, expected a tensor")
    if "host_master_columns" in entry and (entry.get("host_master", 0) is not None or "device_index" not in entry
                                           or not isinstance(entry["host_master_columns"], torch.Tensor)):
        raise Refusal(f"{where}: host_master_columns is only saved, as a tensor, beside device columns when the "
                      "weights hold the host master (host_master None)")
    if "host_master" in entry:
        _count(where, entry, "accum_count", top=steps)
        if not (entry["accum"] is None or isinstance(entry["accum"], torch.Tensor)):
            raise Refusal(f"{where}: accum is {type(entry['accum']).__name__}, expected a tensor or None")
        if (entry["accum"] is None) != (entry["accum_count"] == 0):
            raise Refusal(f"{where}: accum_count={entry['accum_count']} does not match the saved accumulator "
                          f"({'none' if entry['accum'] is None else 'present'})")
    share = entry.get("share")
    if share is not None and (not isinstance(share, list) or len(share) != 3 or not all(_is_int(v) for v in share)
                              or not 0 <= share[0] <= share[0] + share[1] <= share[2] or share[2] <= 0):
        raise Refusal(f"{where}: share={share!r} is invalid, expected [start, length, size] within the matrix")


def check_tensors(where: str, entry: dict[str, Any], p: torch.Tensor) -> None:
    numel_ok = {"host_master", "host_exp_avg", "host_exp_avg_sq", "accum", "exp_avg", "exp_avg_sq", "master"}
    share = entry.get("share")
    quantized = _check_quantized(where, entry)
    for key, t in ((k, t) for k, t in entry.items() if isinstance(t, torch.Tensor)):
        expected = p.numel() // share[2] * share[1] if share and key in _SHARED_KEYS else p.numel()
        if key in numel_ok and t.numel() != expected:
            raise Refusal(f"{where}: {key} has {t.numel()} elements, expected {expected}")
        if key in _FP32_KEYS and t.dtype != torch.float32:
            raise Refusal(f"{where}: {key} is {t.dtype}, expected torch.float32")
        if key in _STORED_KEYS and t.dtype not in (torch.float32, torch.bfloat16) \
                and not (quantized and key in _QUANTIZED_CODES):
            raise Refusal(f"{where}: {key} is {t.dtype}, expected torch.float32 or torch.bfloat16")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise Refusal(f"{where}: {key} holds {int((~torch.isfinite(t)).sum())} non-finite value(s)")
        if key.endswith("exp_avg_sq") and bool((t < 0).any()):
            raise Refusal(f"{where}: {key} holds negative values (a second moment cannot be negative)")
        if key.endswith("step") and (t.numel() != 1 or not t.is_floating_point() or float(t) < 0):
            raise Refusal(f"{where}: {key} is {t.tolist()}, expected a count >= 0")
    if "host_master" in entry:
        reference = "host_master" if entry["host_master"] is not None else "host_exp_avg"
        shape = entry[reference].shape
        for key in ("host_master", "host_exp_avg", "host_exp_avg_sq", "accum"):
            if entry.get(key) is not None and entry[key].shape != shape:
                raise Refusal(f"{where}: {key} has shape {list(entry[key].shape)}, {reference} {list(shape)}")


def check_consistency(where: str, entry: dict[str, Any], zenflow: dict[str, Any]) -> None:
    """Invariants between the fields of an entry and the block, which a well-sealed state must hold too: the open
    window's sum covers at most the steps the window has taken (none when it has taken none); step counts are whole
    numbers an fp32 count can reach; a matrix's host AdamW steps (one per window) cannot outrun its device columns'
    steps (one per step; both start from the same count) by more than the windows closed."""
    counts = {key: float(t) for key, t in entry.items() if key.endswith("step") and isinstance(t, torch.Tensor)}
    for key, count in counts.items():
        if count != int(count) or count >= _MAX_STEP_COUNT:
            raise Refusal(f"{where}: {key}={count:g} is not a step count (a whole number below {_MAX_STEP_COUNT})")
    if "host_master" in entry and entry["accum_count"] > zenflow["window_steps"]:
        raise Refusal(f"{where}: accum_count={entry['accum_count']} gradients summed in the open window, but the "
                      f"window has taken window_steps={zenflow['window_steps']} steps (the counters do not belong "
                      "together)")
    if "host_step" in counts and "device_step" in counts \
            and counts["host_step"] > counts["device_step"] + zenflow["windows"]:
        raise Refusal(f"{where}: host_step={counts['host_step']:g} exceeds device_step={counts['device_step']:g} plus "
                      f"the {zenflow['windows']} windows closed (one host step per window)")


#: 8-bit host moments (``host_moment_dtype="int8"``): the codes' key, their dtype, and their scales' key.
_QUANTIZED_CODES = {"host_exp_avg": (torch.int8, "host_exp_avg_scale"),
                    "host_exp_avg_sq": (torch.uint8, "host_exp_avg_sq_scale")}


def _check_quantized(where: str, entry: dict[str, Any]) -> bool:
    """Whether the entry holds 8-bit host moments; if so, that both moments' codes and scales are there, of their
    dtypes, one finite scale >= 0 per block of the codes."""
    present = [scales for _, scales in _QUANTIZED_CODES.values() if scales in entry]
    if not present:
        return False
    if len(present) != 2 or "host_master" not in entry:
        raise Refusal(f"{where}: {present} without the other 8-bit moment's scales or the host state")
    for key, (dtype, scales_key) in _QUANTIZED_CODES.items():
        codes, scales = entry[key], entry[scales_key]
        if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or scales.ndim != 1:
            raise Refusal(f"{where}: {scales_key} is not a 1-D float32 tensor")
        if codes.dtype != dtype:
            raise Refusal(f"{where}: {key} is {codes.dtype}, expected {dtype} (8-bit codes with {scales_key})")
        if scales.numel() != blocks(codes.numel()):
            raise Refusal(f"{where}: {scales_key} has {scales.numel()} scales, expected {blocks(codes.numel())} (one "
                          f"per block of {BLOCK} of the {codes.numel()} codes)")
        if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
            raise Refusal(f"{where}: {scales_key} holds non-finite or negative scales (absolute maxima)")
    return True


def check_device_columns(where: str, entry: dict[str, Any], p: torch.Tensor, units: int) -> None:
    idx = entry["device_index"]
    if idx.dtype not in (torch.int64, torch.int32) or idx.ndim != 1:
        raise Refusal(f"{where}: device_index is {idx.dtype} of shape {list(idx.shape)}, expected 1-D integers")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= units or bool((idx[1:] <= idx[:-1]).any())):
        raise Refusal(f"{where}: device_index is not a sorted set of distinct indices in [0, {units})")
    reference = "device_master" if entry["device_master"] is not None else "device_exp_avg"
    master, axis = entry[reference], entry["axis"]
    if master.ndim != 2 or entry["k"] != idx.numel() or master.shape[axis] != idx.numel():
        raise Refusal(f"{where}: k={entry['k']} does not match the {idx.numel()} saved device columns")
    other = p.numel() // units if units else 0
    if master.shape[1 - axis] != other and not entry.get("rows"):
        raise Refusal(f"{where}: {reference} has shape {list(master.shape)}, expected {other} values per column")
    for key in ("device_exp_avg", "device_exp_avg_sq"):
        if entry[key].shape != master.shape:
            raise Refusal(f"{where}: {key} has shape {list(entry[key].shape)}, {reference} {list(master.shape)}")
    columns = entry.get("host_master_columns")
    share = entry.get("share")
    if columns is not None and (columns.ndim != 2 or columns.shape[axis] != idx.numel() or columns.shape[1 - axis]
                                != (share[1] if share else master.shape[1 - axis])):
        raise Refusal(f"{where}: host_master_columns has shape {list(columns.shape)}, expected this rank's rows of "
                      f"the {idx.numel()} device columns")


#: Name segments that wrappers add (DDP, torch.compile, FSDP1, activation checkpointing): the same parameter.
_WRAPPER_SEGMENTS = {"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"}


def _bare(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def check_name(where: str, saved: Any, here: str | None) -> None:
    """Refuse a state saved for another parameter (another model of the same shapes, layers swapped), when both
    names are known."""
    if saved is not None and not isinstance(saved, str):
        raise Refusal(f"{where}: name={saved!r} is invalid, expected a string")
    if saved is not None and here is not None and _bare(saved) != _bare(here):
        raise Refusal(f"{where}: the state was saved for parameter {saved!r}, but this optimizer's parameter at "
                      f"this position is {here!r} (another model, or parameters in another order)")


def check_settings_change(opt: ZenFlowState, zenflow: dict[str, Any]) -> None:
    """Settings changes `apply_changed_settings` could not carry out, refused before anything is written."""
    saved = zenflow.get("config") or {}
    now = opt.config
    before = saved.get("full_warm_up_rounds", now.full_warm_up_rounds)
    steps = zenflow["steps"]
    if before != now.full_warm_up_rounds and steps < int(now.full_warm_up_rounds) and steps >= int(before):
        raise Refusal(
            f"full_warm_up_rounds={now.full_warm_up_rounds} cannot take effect: the checkpoint is {steps} steps in, "
            f"past its own warm-up of {before} steps, and the columns were selected already. Resume with "
            f"full_warm_up_rounds <= {steps}")
    if opt.engine_state.host.param_shards is not None and saved.get("min_offload_numel", now.min_offload_numel) \
            != now.min_offload_numel:
        raise Refusal("min_offload_numel differs from the checkpoint's; under FSDP2 matrices cannot move between the "
                      "split and the dense path on resume. Resume with the checkpoint's min_offload_numel")


__all__ = ["check_block", "check_consistency", "check_device_columns", "check_entry_fields", "check_groups",
           "check_name", "check_settings_change", "check_tensors"]
