"""Re-sharding ZenFlow optimizer states between world sizes, as pure state-dict transforms.

- `merge_rank_states`: the state dicts of all N ranks of a run (DDP: each holds its share of the host state; FSDP2:
  each holds the state of its rows of every parameter) -> the one-process state dict. Under DDP the device columns and
  the dense state are replicated (rank 0's are taken); the shares of the host tensors are concatenated in rank order
  along the shared dimension. Under FSDP2 every tensor of every entry is concatenated along the rows.
- `fsdp_rows_of`: a one-process state dict -> FSDP2 rank `rank` of `ranks`'s state: every tensor cut to the rows that
  FSDP2 gives that rank (``ceil(rows / ranks)`` per rank, the last ones shorter: `sharding.Share`);
  `ddp_share_of`: the same for a DDP rank (its share of the host tensors);
- `reshard_states`: N ranks' states -> M ranks' states (merge, then cut), what
  ``hf-zenflow reshard-checkpoint`` writes (`hf_zenflow.hf.rank_checkpoint.reshard_checkpoint`).

A one-process state dict also loads on any number of ranks as it is (under DDP each rank takes its share, under
FSDP2 its rows: `checkpoint.unpack`), but then every rank reads the whole state: for a large model, reshard the files
offline instead, so that each rank reads only its own.

Example:
    >>> import torch
    >>> from hf_zenflow import ZenFlowAdamW
    >>> opt = ZenFlowAdamW(torch.nn.Linear(8, 8).parameters(), min_offload_numel=0)
    >>> merge_rank_states([opt.state_dict()])["zenflow"] is None  # one rank, never stepped: nothing to merge
    True
    >>> opt.close()
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ..distributed.sharding import Share
from .format import CheckpointError, _tensors, migrate, widen_moments
from .seal import seal


#: The tensors of a split entry that hold only a rank's share under DDP (`checkpoint._SHARED_KEYS`).
_DDP_SHARED = ("host_master", "host_exp_avg", "host_exp_avg_sq", "accum", "host_master_columns")


def _rank_count(zenflow: dict[str, Any] | None) -> tuple[str, int] | None:
    """("ddp" | "fsdp2", N) for a state dict saved by one of N > 1 ranks, else None."""
    zenflow = zenflow or {}
    if int(zenflow.get("fsdp_ranks", 1)) > 1:
        return "fsdp2", int(zenflow["fsdp_ranks"])
    if int(zenflow.get("ranks", 1)) > 1:
        return "ddp", int(zenflow["ranks"])
    return None


def merge_rank_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """The one-process state dict of the rank state dicts `states` (all ranks of one save, any order)."""
    states = [migrate(s) for s in states]
    kinds = {_rank_count(s.get("zenflow")) for s in states}
    if len(kinds) != 1:
        raise CheckpointError(f"merge_rank_states: the states come from different runs or world sizes ({kinds}).")
    kind = kinds.pop()
    if kind is None:
        if len(states) != 1:
            raise CheckpointError(f"merge_rank_states: {len(states)} states, none saved by one of several ranks.")
        return states[0]
    parallel, ranks = kind
    rank_key = "fsdp_rank" if parallel == "fsdp2" else "rank"
    by_rank = {int(s["zenflow"][rank_key]): s for s in states}
    if sorted(by_rank) != list(range(ranks)):
        raise CheckpointError(f"merge_rank_states: a {parallel.upper()} run of world size {ranks} needs the states of "
                              f"ranks 0..{ranks - 1}; got ranks {sorted(by_rank)}.")
    ordered = [by_rank[r] for r in range(ranks)]
    first = ordered[0]
    merged = {"param_groups": copy.deepcopy(first["param_groups"]), "state": {},
              "zenflow": {k: v for k, v in first["zenflow"].items()
                          if k not in ("ranks", "rank", "fsdp_ranks", "fsdp_rank")}}
    for index, entry in first["state"].items():
        # (8-bit moments are quantised by blocks of each rank's share: joined as their fp32 values)
        parts = [widen_moments(s["state"][index]) for s in ordered]
        entry = parts[0]
        out = dict(entry)
        if parallel == "fsdp2":
            for key, t in _tensors(entry).items():
                if key != "checksums" and t.ndim >= 1 and key not in ("device_index", "device_step", "host_step",
                                                                     "step"):
                    out[key] = torch.cat([p[key] for p in parts], dim=0)
            out["shape"] = [sum(int(p["shape"][0]) for p in parts), *entry["shape"][1:]]
        elif "share" in entry:
            dim = 1 - int(entry.get("axis", 1))
            for key in _DDP_SHARED:
                if entry.get(key) is not None:
                    out[key] = torch.cat([p[key] for p in parts], dim=dim)
            del out["share"]
        merged["state"][index] = out
    return seal(merged)


def _one_process(state: dict[str, Any], caller: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """`state` in the current format and its ``zenflow`` block; refused unless one process saved it."""
    state = migrate(state)
    zenflow = state.get("zenflow")
    if _rank_count(zenflow) is not None:
        raise CheckpointError(f"{caller}: this state was saved by one of several ranks; merge the ranks' states "
                              "first (merge_rank_states).")
    return state, zenflow


def fsdp_rows_of(state: dict[str, Any], ranks: int, rank: int) -> dict[str, Any]:
    """FSDP2 rank `rank` of `ranks`'s part of the one-process state dict `state` (its rows of every tensor)."""
    state, zenflow = _one_process(state, "fsdp_rows_of")
    out = {"param_groups": state["param_groups"], "state": {},
           "zenflow": None if zenflow is None else {**zenflow, "fsdp_ranks": ranks, "fsdp_rank": rank}}
    for index, entry in state["state"].items():
        rows = int(entry["shape"][0])
        share = Share(0, rows, ranks, rank)
        if entry.get("kind") == "split" and int(entry.get("axis", 1)) != 1:
            raise CheckpointError(f"fsdp_rows_of: parameter {index} was saved column-major or with select_rows, "
                                  "which FSDP2 does not support.")
        entry = widen_moments(entry)  # (8-bit moments: cut as their fp32 values, quantised again on load)
        mine = dict(entry)
        for key, t in _tensors(entry).items():
            if key != "checksums" and t.ndim >= 1 and t.shape[0] == rows and key not in ("device_index",):
                mine[key] = t.narrow(0, share.start, share.length).clone()
        mine["shape"] = [share.length, *entry["shape"][1:]]
        out["state"][index] = mine
    return seal(out)


def ddp_share_of(state: dict[str, Any], ranks: int, rank: int) -> dict[str, Any]:
    """DDP rank `rank` of `ranks`'s state from the one-process state dict `state`: its share of every host tensor
    (what `ZenFlowAdamW.state_dict()` of that rank holds; the device columns and dense state are replicated)."""
    state, zenflow = _one_process(state, "ddp_share_of")
    out = {"param_groups": state["param_groups"], "state": {},
           "zenflow": None if zenflow is None or ranks == 1 else {**zenflow, "ranks": ranks, "rank": rank}}
    for index, entry in state["state"].items():
        if ranks > 1:
            entry = widen_moments(entry)  # (8-bit moments: cut as their fp32 values, quantised again on load)
        mine = dict(entry)
        if entry.get("kind") == "split" and "host_master" in entry and ranks > 1:
            dim = 1 - int(entry.get("axis", 1))
            share = Share(dim, int(entry["host_exp_avg"].shape[dim]), ranks, rank)  # (the master may be None)
            for key in _DDP_SHARED:
                if entry.get(key) is not None:
                    mine[key] = share.local(entry[key]).clone()
            mine["share"] = [share.start, share.length, share.size]
        out["state"][index] = mine
    return seal(out)


def reshard_states(states: list[dict[str, Any]], world_size: int, parallel: str | None = None
                   ) -> list[dict[str, Any]]:
    """The state dicts of `world_size` ranks (rank order) from the states of all ranks of one save (or one
    one-process state). `parallel`: ``"ddp"`` or ``"fsdp2"`` for the new ranks (default: as saved; DDP for a
    one-process state)."""
    source = _rank_count(migrate(states[0]).get("zenflow"))
    parallel = parallel or (source[0] if source else "ddp")
    if parallel not in ("ddp", "fsdp2"):
        raise ValueError(f"reshard_states: parallel={parallel!r} is invalid: allowed are 'ddp' and 'fsdp2'.")
    if world_size < 1:
        raise ValueError(f"reshard_states: world_size={world_size!r} is invalid: allowed is an integer >= 1.")
    merged = merge_rank_states(states)
    if world_size == 1:
        return [merged]
    longest = max((max(entry["shape"], default=0) for entry in merged["state"].values() if "shape" in entry),
                  default=None)
    if longest is not None and world_size > longest:  # (each rank's part is a range of one dimension)
        raise ValueError(f"reshard_states: world_size={world_size} is invalid: allowed is at most {longest}, the "
                         "longest dimension of any parameter in the state; beyond it a rank would hold no part of "
                         "any parameter.")
    cut = fsdp_rows_of if parallel == "fsdp2" else ddp_share_of
    return [cut(merged, world_size, r) for r in range(world_size)]


# ---------------------------------------------------------------------------------------------------------------------
# Which rank's state loads where (`checkpoint.unpack` asks)
# ---------------------------------------------------------------------------------------------------------------------
_RESHARD_ADVICE = ("re-shard the ranks' files first (`hf-zenflow reshard-checkpoint CHECKPOINT --world-size M`, or "
                   "`hf_zenflow.checkpoint.reshard.reshard_states`)")


def check_ranks(zenflow: dict[str, Any], ranks: int, rank: int) -> None:
    """Refuse a state dict saved with its host state shared by another number of ranks, or by another rank."""
    saved, saved_rank = int(zenflow.get("ranks", 1)), int(zenflow.get("rank", 0))
    if saved == 1 or (saved, saved_rank) == (ranks, rank):
        return
    if saved != ranks:
        raise CheckpointError(
            f"ZenFlowAdamW.load_state_dict: this optimizer state was saved with the host state split across "
            f"{saved} ranks (world size {saved}, this file is rank {saved_rank}'s share), and this run has "
            f"{ranks} rank(s) (world size {ranks}). Resume with world size {saved}, or {_RESHARD_ADVICE}."
        )
    raise CheckpointError(
        f"ZenFlowAdamW.load_state_dict: this is rank {saved_rank}'s share of the host state (of {saved} ranks), "
        f"loaded on rank {rank}: every rank must load its own file."
    )


def _fsdp_origin(state: tuple[int, int] | None) -> str:
    if state is None:
        return "without FSDP2"
    return f"under FSDP2 by rank {state[1]} of {state[0]} (world size {state[0]})"


def check_fsdp_ranks(zenflow: dict[str, Any], mesh: Any) -> None:
    """Refuse a state dict saved under FSDP2 with another number of ranks or by another rank, or saved under FSDP2
    and loaded without it: each rank's state holds its own rows of every parameter. (A one-process state loaded
    under FSDP2 has been cut to this rank's rows already: `fsdp_rows_of`.)"""
    saved = (int(zenflow["fsdp_ranks"]), int(zenflow["fsdp_rank"])) if "fsdp_ranks" in zenflow else None
    here = (mesh.ranks, mesh.rank) if mesh is not None else None
    if saved == here or not zenflow:
        return
    if saved is not None and saved[0] != (here[0] if here else 1):
        raise CheckpointError(
            f"ZenFlowAdamW.load_state_dict: this optimizer state holds FSDP2 rank {saved[1]}'s rows of {saved[0]} "
            f"(world size {saved[0]}), and this run has world size {here[0] if here else 1}"
            f"{'' if here else ' without FSDP2'}. Merge or {_RESHARD_ADVICE}.")
    raise CheckpointError(
        f"ZenFlowAdamW.load_state_dict: this optimizer state was saved {_fsdp_origin(saved)} and is loaded "
        f"{_fsdp_origin(here)}. Under FSDP2 each rank's optimizer state holds the state of its own rows of every "
        f"parameter: each rank must load its own file (for another layout, {_RESHARD_ADVICE}).")


__all__ = ["check_fsdp_ranks", "check_ranks", "ddp_share_of", "fsdp_rows_of", "merge_rank_states", "reshard_states"]
