"""The checksums of a `ZenFlowAdamW` state dict (format 3).

Each entry's ``checksums`` hold a position-dependent 64-bit sum of every tensor (`tensor_digest`: a transposed or
shifted tensor does not keep its sum) and a digest of each of its other fields (``"fields"``: values, and the
tensors' dtypes and shapes); the ``zenflow`` block's ``checksum`` holds a digest of each of its fields, of each param
group's and of every entry's field digests, and so covers every key's presence. A damaged file (a flipped byte in
``data.pkl``, a hand edit, a removed checksum) is refused naming the entry and the field. `seal` writes them (the
re-sharding transforms re-seal what they change); `verify` checks them.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch


PREFIX = "ZenFlowAdamW.load_state_dict"
FIELDS = "fields"  # the key of an entry's field digests in its ``checksums``
BLOCK = "checksum"  # the key of the zenflow block's digests


class Refusal(ValueError):
    """A problem found by the checks; `checkpoint` turns it into a `CheckpointError` with the advice."""


class Outdated(Refusal):
    """A state written by an earlier version of hf_zenflow that this one cannot read: not damaged, so the
    `CheckpointError` carries its own advice."""


# ---------------------------------------------------------------------------------------------------------------------
# Checksums
# ---------------------------------------------------------------------------------------------------------------------
#: `tensor_digest` weights blocks of this many elements in large tensors (each element in small ones).
_BLOCK, _SMALL = 64, 1 << 16


def tensor_digest(t: torch.Tensor) -> int:
    """A tensor's checksum: ``sum_b (2 b + 1) * bits(block b)`` (``bits``: the wrap-around sum of a block's bits, read
    as integers of the element size) in 64-bit wrap-around arithmetic over the
    tensor in logical order, with blocks of 64 elements (1 in tensors under 65536 elements). Unlike a plain sum it
    changes when values move between blocks (a flipped stride, a shifted storage offset); at about twice a plain
    sum's cost (weighting every element costs about three times a plain sum's)."""
    t = t.detach().contiguous()
    as_int = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]
    flat = t.view(as_int).reshape(-1)
    block = 1 if flat.numel() < _SMALL else _BLOCK
    body = flat.numel() - flat.numel() % block
    sums = flat[:body].view(-1, block).sum(dim=1, dtype=torch.int64) if block > 1 else flat.to(torch.int64)
    weights = torch.arange(1, 2 * sums.numel() + 1, 2, dtype=torch.int64, device=t.device)
    tail = flat[body:].sum(dtype=torch.int64) * (2 * sums.numel() + 1)  # (the last, partial block)
    return int(((sums * weights).sum() + tail).item())  # one sync, on the tensor's device


def _plain(obj: Any) -> Any:
    """`obj` as JSON values that tell apart what loading would tell apart (1, 1.0 and True; tensors by dtype and
    shape, their values being covered by `tensor_digest`)."""
    if isinstance(obj, torch.Tensor):
        return {"tensor": [str(obj.dtype), list(obj.shape)]}
    if isinstance(obj, dict):
        return {f"{type(k).__name__}:{k}": _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return {"float": repr(obj)}  # (repr: exact, and NaN/inf too)
    return {type(obj).__name__: repr(obj)}


def fields_digest(obj: Any) -> str:
    text = json.dumps(_plain(obj), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _entry_fields(entry: dict[str, Any]) -> dict[str, str]:
    """One digest per field of an entry (its tensors by dtype and shape), so that a mismatch names the field."""
    return {str(k): fields_digest(v) for k, v in entry.items() if k != "checksums"}


def _block_fields(state: dict[str, Any]) -> dict[str, str]:
    digests = {f"zenflow.{k}": fields_digest(v) for k, v in state["zenflow"].items() if k != BLOCK}
    for n, group in enumerate(state["param_groups"]):
        digests.update({f"param_groups[{n}].{k}": fields_digest(v) for k, v in group.items()})
    # the set of entries and their field digests: an entry removed or a field checksum swapped shows here too
    digests["state"] = fields_digest({str(i): (e.get("checksums") or {}).get(FIELDS) if isinstance(e, dict) else None
                                      for i, e in state["state"].items()})
    return digests


def saved_label(index: Any, entry: dict[str, Any]) -> str:
    """An entry as the state dict itself describes it (its saved name and shape, where they are well-formed)."""
    name, shape = entry.get("name"), entry.get("shape")
    return (f"parameter {index}" + (f" ({name})" if isinstance(name, str) else "")
            + (f" of shape {shape}" if isinstance(shape, list) else ""))


def _compare(where: str, saved: Any, actual: dict[str, str]) -> None:
    if not isinstance(saved, dict):
        raise Refusal(f"{where}: its field checksums are {type(saved).__name__}, expected a dict")
    missing = sorted(set(saved) - set(actual))
    if missing:
        raise Refusal(f"{where}: {missing} missing (checksummed when saved: the key was removed or altered)")
    unknown = sorted(set(actual) - set(saved))
    if unknown:
        raise Refusal(f"{where}: {unknown} have no checksum (not written by hf_zenflow: a key was added or altered)")
    changed = sorted(k for k in actual if saved[k] != actual[k])
    if changed:
        raise Refusal(f"{where}: {changed} do not match their checksum (a value was altered)")


def seal_entry(entry: dict[str, Any]) -> dict[str, Any]:
    """Write `entry`'s checksums (in place; returned for chaining)."""
    sums: dict[str, Any] = {k: tensor_digest(t) for k, t in entry.items() if isinstance(t, torch.Tensor)}
    sums[FIELDS] = _entry_fields(entry)
    entry["checksums"] = sums
    return entry


def seal(state: dict[str, Any]) -> dict[str, Any]:
    """Seal every entry of `state` and its zenflow block (in place), as `ZenFlowAdamW.state_dict()` does."""
    for entry in state["state"].values():
        seal_entry(entry)
    if state.get("zenflow") is not None:
        state["zenflow"].pop(BLOCK, None)
        state["zenflow"][BLOCK] = _block_fields(state)
    return state


def verify(state: dict[str, Any]) -> None:
    """Refuse a format-3 state whose checksums are missing or do not match, naming the entry and the field."""
    zenflow = state.get("zenflow")
    if zenflow is None:
        if state["state"]:
            raise Refusal("the state has per-parameter entries but no 'zenflow' block (the block is missing or its "
                          "key was damaged)")
        return
    for index, entry in state["state"].items():
        if not isinstance(entry, dict):
            raise Refusal(f"parameter {index}: the entry is {type(entry).__name__}, expected a dict")
        where = saved_label(index, entry)
        sums = entry.get("checksums")
        if not isinstance(sums, dict) or FIELDS not in sums:
            raise Refusal(f"{where}: its 'checksums' entry is missing or incomplete (format 3 writes the "
                          "checksums of every tensor and field)")
        for key, t in entry.items():
            if isinstance(t, torch.Tensor) and sums.get(key) != tensor_digest(t):
                raise Refusal(f"{where}: {key} does not match its checksum (its bytes were altered: a damaged file, "
                              "or a state dict serialised after further steps, as state_dict() returns the live "
                              "tensors)")
        _compare(where, sums[FIELDS], _entry_fields(entry))
    if BLOCK not in zenflow:
        raise Refusal("the 'zenflow' block has no 'checksum' entry (format 3 always writes one: it was removed)")
    _compare("the 'zenflow' block and param groups", zenflow[BLOCK], _block_fields(state))


__all__ = ["BLOCK", "FIELDS", "PREFIX", "Refusal", "fields_digest", "saved_label", "seal",
           "seal_entry", "tensor_digest", "verify"]
