"""FSDP2 (``torch.distributed.fsdp.fully_shard``): ZenFlow on each rank's local shard of every parameter.

FSDP2 turns every parameter into a DTensor sharded on dimension 0 over a 1-D device mesh: each rank holds some
rows (output features) of every matrix and ALL of its input columns. ZenFlow's split is by input column, so it works
on the local shard unchanged: the device columns are the selected columns of this rank's rows, the host state holds
this rank's rows, and each rank writes back its own rows (no weight collective; FSDP2's own all-gather in the next
forward sees them). The engine keys its state by the local tensors (`LocalShards.local`); parameters that are not
DTensors are not allowed next to DTensor ones (their gradients would not be FSDP-reduced the same way).

What must be the same on every rank is made global over the mesh's process group (`RankGroup`), batched:

- every step, ONE all-reduce of this step's gradient sums of squares (`gradients.read_gradients`): the total norm
  behind the non-finite check and the clip coefficient, Zen-auto's masses, the norms of matrices waiting for columns;
- `clip_grad_norm_`: one all-reduce of the total;
- each (re-)selection: one all-reduce of the per-column scores, summed over the ranks' rows
  (`reselection.select_columns`), so every rank selects the same columns;
- ``writeback_lag="auto"``: one all-reduce of the choice (`engine/writeback_lag.py`).

All run on the training thread at points the schedule fixes, so every rank issues them in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from .sharding import RankGroup, is_dtensor


class LocalShards:
    """The DTensor parameters of one optimizer and their local shards (see the module docstring)."""

    def __init__(self) -> None:
        #: the mesh's ranks; None until `find` has seen DTensor parameters (then every parameter is one)
        self.group: RankGroup | None = None
        self._local: dict[torch.Tensor, torch.Tensor] = {}  # DTensor parameter -> its local tensor when first seen
        self._sharded: dict[torch.Tensor, torch.Tensor] = {}  # local tensor -> its DTensor parameter
        self._checked = False

    @property
    def active(self) -> bool:
        return self.group is not None

    def find_once(self, groups: list[dict[str, Any]], use_param_shards: Callable[[RankGroup], None], final: bool
                  ) -> bool:
        """`find`, and tell the host side (`use_param_shards`, the engine's `HostWindows.use_param_shards`) to keep
        its host state per rank's own rows, until the answer is final: DTensors
        found, or the first step (`final`). accelerate swaps FSDP2's DTensors into the param groups after the
        optimizer is built, and takes a `state_dict()` before it does. True on the call that found them."""
        if self._checked:
            return False
        group = self.find(p for g in groups for p in g["params"])
        if group is not None:
            use_param_shards(group)
        self._checked = final or group is not None
        return group is not None

    def find(self, params: Iterable[torch.Tensor]) -> RankGroup | None:
        """Look at the parameters (at the first step: accelerate swaps in FSDP2's DTensors after the optimizer is
        built); refuse layouts this path does not handle, naming them. Returns the mesh's ranks, or None."""
        params = list(params)
        sharded = [p for p in params if is_dtensor(p)]
        if not sharded:
            return None
        if len(sharded) != len(params):
            plain = next(p for p in params if not is_dtensor(p))
            raise NotImplementedError(
                f"ZenFlowAdamW got DTensor (FSDP2) parameters together with a plain parameter of shape "
                f"{tuple(plain.shape)}: under FSDP2 every parameter the optimizer updates must be sharded by "
                "fully_shard (apply fully_shard to the root module too, and do not pass ignored_params).")
        mesh = sharded[0].device_mesh
        for p in sharded:
            placements = tuple(p.placements)
            if p.device_mesh.ndim != 1 or len(placements) != 1 or type(placements[0]).__name__ != "Shard" or \
                    placements[0].dim != 0:
                raise NotImplementedError(
                    f"ZenFlowAdamW got a DTensor parameter of shape {tuple(p.shape)} with placements {placements} "
                    f"on a {p.device_mesh.ndim}-D mesh: supported is FSDP2's fully_shard on a 1-D mesh "
                    "(placements (Shard(dim=0),)). HSDP (a 2-D mesh), tensor parallelism and shard_placement_fn "
                    "are not supported.")
            if p.device_mesh != mesh:
                raise NotImplementedError("ZenFlowAdamW got DTensor parameters on different device meshes: "
                                          "supported is one 1-D FSDP2 mesh for all parameters.")
        group = mesh.get_group()
        self.group = RankGroup.of(group) if mesh.size() > 1 else RankGroup()
        return self.group

    def local(self, p: torch.Tensor) -> torch.Tensor:
        """The tensor the engine updates for parameter `p`: its local shard under FSDP2 (the same object every
        step), else `p` itself."""
        if not self.active or not is_dtensor(p):
            return p
        local = self._local.get(p)
        if local is None:
            local = self._local[p] = p._local_tensor
            self._sharded[local] = p
        return local

    def owner(self, local: torch.Tensor) -> torch.Tensor:
        """The parameter whose ``.grad`` holds `local`'s gradient (the DTensor under FSDP2)."""
        return self._sharded.get(local, local)

    def grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """`p`'s gradient as the engine reads it: its local shard under FSDP2 (the same object as long as FSDP2
        keeps accumulating into it)."""
        g = p.grad
        return g._local_tensor if g is not None and is_dtensor(g) else g

    def moved(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(old, new) local tensors of parameters whose shard FSDP2 has re-allocated since they were first seen
        (``model.to(...)``, ``load_state_dict(assign=True)``): the engine's state follows them
        (`engine.weight_marks.rekey`)."""
        out = []
        for p, old in list(self._local.items()):
            new = p._local_tensor
            if new is not old:
                out.append((old, new))
                self._local[p] = new
                del self._sharded[old]
                self._sharded[new] = p
        return out

    def entries(self, entries: list[tuple[dict, torch.Tensor]]) -> tuple[list[tuple[dict, torch.Tensor]],
                                                                          list[torch.Tensor]]:
        """`entries` (group, parameter with a gradient) as the engine sees them, and their gradients."""
        return [(group, self.local(p)) for group, p in entries], [self.grad(p) for _, p in entries]


def global_norm(local_total: torch.Tensor, norm_type: float, ranks: RankGroup | None) -> torch.Tensor:
    """The norm of all gradients from this rank's norm of its shards (`clip_grad_norm_` under FSDP2): one
    all-reduce, of the p-th powers (the maximum for the inf-norm)."""
    if ranks is None or ranks.ranks == 1:
        return local_total
    if norm_type == float("inf"):
        total = local_total.float().clone().reshape(1)
        ranks.all_reduce_sum([total], "gradient-norm all-reduce", op="max")
        return total[0]
    total = local_total.float().pow(norm_type).reshape(1)
    ranks.all_reduce_sum([total], "gradient-norm all-reduce")
    return total[0].pow(1.0 / norm_type)


__all__ = ["LocalShards", "global_norm"]
