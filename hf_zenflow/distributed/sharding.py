"""The host work split across data-parallel ranks: under DDP each of N ranks keeps host state for, and runs the host
AdamW on, 1/N of every offloaded matrix, and the ranks exchange their shares at each write-back.

Which share (`Share`): a range of the matrix's dimension that does NOT index selectable units. For an
``nn.Linear`` weight ``[out, in]`` that is a range of output features, the dimension FSDP2 shards (``Shard(0)``), so a
sharded-parameter path can reuse "this rank's rows" unchanged. In the engine's storage layout (`SplitMatrix.matrix`)
it is a block of rows of a row-major weight (contiguous), a block of columns of a column-major weight's ``[in, out]``
storage, or of a ``select_rows`` table's hidden dimension (strided). Each rank's host state is a dense tensor of its
share, whatever the layout. A size that does not divide by N: every share is ``ceil(size / N)`` long in the
collectives (padded), the last ones shorter, possibly empty.

What must agree across ranks agrees: the device update of the selected columns is replicated (every rank sees the
same averaged gradient under DDP), and so are the norms, the non-finite check and Zen-auto's masses computed from it.
Selection scores are per-unit sums of squares over this rank's share, summed across ranks (one ``all_reduce`` for all
matrices), which stays right when a rank only sees its own rows.

Collectives (`RankGroup`) all run on the training thread, inside `step()`/`flush()`/`load_state_dict()` at points the
schedule fixes, so every rank issues the same ones in the same order; the host worker never issues one. Each is
batched over matrices: one all-gather per write-back, (device, dtype) and bucket of ``GATHER_BUCKET_BYTES`` (so that
its buffer is a bounded slice of device memory), one all-reduce of selection scores and one
all-gather (per bucket) of the incoming device columns' state per selection. Every collective takes tensors on the
collective device (`RankGroup.device_for` of the parameters' device: the GPU under NCCL, the host under gloo), never
host state directly: NCCL refuses host tensors, so host pieces are copied into a device buffer first and back after.
A collective that fails (a rank died) or times out (the process group's ``timeout``) raises `ShardCollectiveError`
in the training process.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


#: The most bytes the write-back's all-gather buffer takes per bucket (on the device with NCCL, the host with gloo).
GATHER_BUCKET_BYTES = 128 << 20


class ShardCollectiveError(RuntimeError):
    """A collective between the ranks sharing the host work failed or timed out."""


@dataclass(frozen=True)
class Share:
    """This rank's share of a storage matrix: indices ``[start, start + length)`` of dimension `dim` (of `size`),
    with every rank's share padded to `padded` in the collectives."""

    dim: int
    size: int
    ranks: int = 1
    rank: int = 0

    @property
    def padded(self) -> int:
        return -(-self.size // self.ranks)

    def range_of(self, rank: int) -> tuple[int, int]:
        """(start, length) of `rank`'s share."""
        start = min(rank * self.padded, self.size)
        return start, min(self.size, start + self.padded) - start

    @property
    def start(self) -> int:
        return self.range_of(self.rank)[0]

    @property
    def length(self) -> int:
        return self.range_of(self.rank)[1]

    def local(self, m: torch.Tensor) -> torch.Tensor:
        """This rank's share of a full storage matrix `m` (a view; `m` itself with one rank)."""
        return m if self.ranks == 1 else m.narrow(self.dim, self.start, self.length)

    def local_shape(self, shape: torch.Size | tuple[int, ...]) -> torch.Size:
        out = list(shape)
        out[self.dim] = self.length
        return torch.Size(out)


def is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def _gather_single(out: torch.Tensor, mine: torch.Tensor, group: Any = None) -> None:
    # (looked up at each call, so that a wrapper installed after import, e.g. a test's NCCL-like double, sees it)
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, mine, group=group)


#: Backends whose collectives take tensors on the device itself (NCCL refuses host tensors); the others (gloo) take
#: host tensors.
DEVICE_BACKENDS = ("nccl", "xccl")


class RankGroup:
    """The ranks that share the host work (see the module docstring); one rank when no process group is in use."""

    def __init__(self, group: Any = None, ranks: int = 1, rank: int = 0) -> None:
        self.group, self.ranks, self.rank = group, ranks, rank
        self._buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    @classmethod
    def of(cls, process_group: Any = None) -> RankGroup:
        """`process_group` (default: torch's default group, when one is initialised) as a `RankGroup`."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        ranks = dist.get_world_size(process_group)
        return cls(process_group, ranks, dist.get_rank(process_group)) if ranks > 1 else cls()

    def share(self, dim: int, size: int) -> Share:
        return Share(dim, size, self.ranks, self.rank)

    def device_for(self, device: torch.device) -> torch.device:
        """Where this group's collectives take tensors that belong to `device` (a parameter's device, never a host
        tensor's): the device itself for a backend that runs there (NCCL), else the host (gloo)."""
        if any(name in str(dist.get_backend(self.group)) for name in DEVICE_BACKENDS):
            return device
        return torch.device("cpu")

    def _run(self, what: str, collective: Callable[[], Any]) -> None:
        try:
            collective()
        except Exception as exc:  # noqa: BLE001 - every failure of a collective gets the same explanation
            raise ShardCollectiveError(
                f"hf_zenflow: the {what} across {self.ranks} ranks failed on rank {self.rank} "
                f"({type(exc).__name__}: {exc}). Another rank died, stopped calling step() in step with this one, "
                "or took longer than the process group's timeout. The ranks' optimizer states no longer agree: "
                "restart from the last checkpoint."
            ) from exc

    def all_reduce_sum(self, tensors: list[torch.Tensor], what: str = "selection-score all-reduce",
                       op: str = "sum") -> None:
        """Sum (or, ``op="max"``, the maximum of) each tensor across the ranks, in place, with one collective for
        all of them."""
        if self.ranks == 1 or not tensors:
            return
        device = self.device_for(tensors[0].device)
        flat = torch.cat([t.reshape(-1).to(device, torch.float32) for t in tensors])
        reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        self._run(what, lambda: dist.all_reduce(flat, op=reduce_op, group=self.group))
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view(t.shape))
            offset += t.numel()

    def gather_into(self, items: list[tuple[Share, torch.Tensor, torch.Tensor | None]], device: torch.device,
                    what: str, keep: bool = False) -> None:
        """For each (share, local, full): write every rank's share of the matrix into `full` (None: not wanted
        here), this rank's from `local` (shaped `Share.local_shape`). One all-gather on `device` for all items (one
        dtype); `keep`: reuse the flat buffer across calls (the write-back, every window)."""
        if not items:
            return
        dtype = items[0][1].dtype
        shapes = []
        for share, local, _ in items:
            shape = list(local.shape)
            shape[share.dim] = share.padded
            shapes.append(torch.Size(shape))
        segment = sum(s.numel() for s in shapes)
        buf = self._buffer(device, dtype, segment * self.ranks, keep)
        mine = buf[self.rank * segment:(self.rank + 1) * segment]
        offset = 0
        for (share, local, _), shape in zip(items, shapes):
            mine[offset:offset + shape.numel()].view(shape).narrow(share.dim, 0, share.length).copy_(
                local, non_blocking=True)
            offset += shape.numel()
        self._run(what, lambda: _gather_single(buf, mine, group=self.group))
        for r in range(self.ranks):
            offset = r * segment
            for (share, _, full), shape in zip(items, shapes):
                start, length = share.range_of(r)
                if length and full is not None:
                    piece = buf[offset:offset + shape.numel()].view(shape).narrow(share.dim, 0, length)
                    full.narrow(share.dim, start, length).copy_(piece, non_blocking=True)
                offset += shape.numel()

    def gather(self, items: list[tuple[Share, torch.Tensor]], what: str, device: torch.device,
               out: torch.device | None = None) -> list[torch.Tensor]:
        """Full fp32 matrices from every rank's (share, local) pieces, as new tensors on `out` (default: `device`).

        `device` is the parameters' device, never taken from the pieces: they are host state here (masters and
        moments at a re-selection, `SplitMatrix.full_state`), and NCCL refuses host tensors. Each piece is copied
        into the collective's buffer on `device_for(device)` and every rank's pieces copied out of it, bucket by
        bucket (`buckets`), so the device holds one bucket's buffer at a time, not every matrix twice."""
        out = device if out is None else out
        if self.ranks == 1:
            return [local.to(out, torch.float32, copy=True) for _, local in items]
        on = self.device_for(device)
        fulls = []
        for share, local in items:
            shape = list(local.shape)
            shape[share.dim] = share.size
            fulls.append(torch.empty(shape, dtype=torch.float32, device=out))
        for bucket in self.buckets([(s, local.float(), full) for (s, local), full in zip(items, fulls)]):
            self.gather_into(bucket, on, what)
        if on.type == "cuda" and out.type == "cpu":
            # Sync point (re-selection and checkpoints only): the device->host copies out of the buffer were queued
            # on the current stream and the host reads the fulls next
            torch.cuda.current_stream(on).synchronize()
        return fulls

    def _buffer(self, device: torch.device, dtype: torch.dtype, numel: int, keep: bool) -> torch.Tensor:
        if not keep:
            return torch.empty(numel, dtype=dtype, device=device)
        buf = self._buffers.get((device, dtype))
        if buf is None or buf.numel() < numel:
            buf = self._buffers[(device, dtype)] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]  # (the write-back's buckets differ in size: the largest one's buffer serves them all)

    def buckets(self, items: list[tuple[Share, torch.Tensor, torch.Tensor | None]]
                ) -> list[list[tuple[Share, torch.Tensor, torch.Tensor | None]]]:
        """`items` (share, local, full) in consecutive groups whose all-gather buffer (every rank's padded share)
        stays within `GATHER_BUCKET_BYTES`, a matrix bigger than that alone in its group: the write-back's buffer is
        a bounded slice of device memory, not a second copy of every offloaded weight."""
        out: list[list[tuple[Share, torch.Tensor, torch.Tensor | None]]] = []
        used = 0
        for item in items:
            share, local, _ = item
            shape = list(local.shape)
            shape[share.dim] = share.padded
            size = math.prod(shape) * self.ranks * local.element_size()
            if out and used + size <= GATHER_BUCKET_BYTES:
                out[-1].append(item)
                used += size
            else:
                out.append([item])
                used = size
        return out

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the write-back's gather buffers (for `stats()`)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def set_grad(owner: torch.Tensor, grad: torch.Tensor) -> None:
    """``owner.grad = grad``; under FSDP2 (`owner` a DTensor parameter, `grad` its local shard's gradient) as the
    DTensor FSDP2 itself would have set."""
    if is_dtensor(owner):
        from torch.distributed.tensor import DTensor

        grad = DTensor.from_local(grad, owner.device_mesh, owner.placements, run_check=False, shape=owner.shape,
                                  stride=owner.stride())
    owner.grad = grad


def local_grad(owner: torch.Tensor) -> torch.Tensor | None:
    """``owner.grad``, or its local shard under FSDP2."""
    g = owner.grad
    return g._local_tensor if g is not None and is_dtensor(g) else g
