"""Reading each gradient as backward produces it: its norm, and (on CUDA) the start of its copy to the host.

`GradientReads` registers a post-accumulate-grad hook on every parameter. When backward has finished a parameter's
gradient, the hook computes its L2 norm (exactly as `torch.nn.utils.clip_grad_norm_` would, so clipping can reuse
it) while the gradient is hot and the rest of backward still runs, and hands it to a callback (the host side starts
the device-to-host copy there when its transport copies). Results are keyed by the gradient tensor's identity and
version counter: anything that changes the gradient afterwards (another micro-batch accumulating into it, an in-place
clip, zeroing) invalidates them, and `step()` reads that gradient itself.

DDP: its reducer all-reduces a gradient after these hooks have run and then rewrites ``p.grad`` (a version bump), so
a norm or a copy taken in the hook would describe the unreduced gradient and be thrown away, and the copy made again
after the sync (twice the device-to-host traffic). With the host work split across data-parallel ranks
(`reduced_later`, `distributed/sharding.py`), the hooks read nothing and `step()` reads each reduced gradient once.
(FSDP2 calls the hooks after its reduce-scatter: those are read.) A DDP communication hook the user registers
(bf16_compress_hook,
PowerSGD) composes unchanged: `step()` reads whatever the hook's result left in ``p.grad``.

Gradient accumulation: under accelerate (the Trainer) the hooks skip the micro-batches that do not end an optimizer
step (``GradientState.sync_gradients``); in a plain loop every micro-batch is read and the last one counts.
"""

from __future__ import annotations

import math
import sys
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .._base import torch_norms
from ..distributed.sharding import RankGroup, is_dtensor, set_grad
from .device_memory import DeviceMemoryMeter
from .device_step import gather_selected, norms_and_gather
from .graph_guard import refuse_traced_hook


if TYPE_CHECKING:
    from .split_matrix import SplitMatrix


def torch_norm(g: torch.Tensor) -> torch.Tensor:
    """The L2 norm of `g` computed the way `torch.nn.utils.clip_grad_norm_` computes it per tensor (foreach where
    supported), so that a total built from such norms is bit-identical to torch's."""
    return torch_norms([g])[0]


def _between_micro_batches() -> bool:
    """True while accelerate accumulates gradients over micro-batches and this backward does not end a step."""
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "GradientState", None), "_shared_state", None)
    return bool(shared) and not shared.get("sync_gradients", True)


class GradientReads:
    """Per-gradient norms taken in post-accumulate-grad hooks (see the module docstring).

    Example:
        >>> lin = torch.nn.Linear(4, 4)
        >>> reads = GradientReads(lin.parameters())
        >>> lin(torch.randn(2, 4)).sum().backward()
        >>> reads.norm(lin.weight) is not None
        True
        >>> lin.weight.grad.mul_(2.0)  # changed afterwards: the hook's norm no longer holds
        ... # doctest: +ELLIPSIS
        tensor(...)
        >>> reads.norm(lin.weight) is None
        True
        >>> reads.remove()
    """

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        # parameter -> (its gradient then, that gradient's version then, norm); a weak reference, so that a new
        # gradient at a recycled address is never taken for the one that was read
        self._norms: dict[torch.Tensor, tuple[weakref.ref, int, torch.Tensor]] = {}
        #: called with (parameter, gradient) after the norm, e.g. to start the gradient's copy to the host; returns
        #: a stand-in when it freed the gradient (`BackwardHandOff.grad_ready`), else None
        self.on_ready: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None] | None = None
        #: called with the parameter before the norm (`BackwardHandOff.regather`)
        self.on_arrival: Callable[[torch.Tensor], None] | None = None
        #: True when each (non-DTensor) gradient is rewritten after its hook by a data-parallel reduction (DDP's
        #: all-reduce): the hooks then read nothing (see the module docstring)
        self.reduced_later: Callable[[], bool] = lambda: False
        #: whether an FSDP2 gradient shard that stays on the device is copied out of its reduce-scatter output
        #: (`BackwardHandOff.copies_out`)
        self.copies_out: Callable[[torch.Tensor], bool] = lambda p: False
        #: counts the device's gradients as they arrive and leave (`device_memory.py`), when set
        self.meter: DeviceMemoryMeter | None = None
        #: whether the norm of a gradient that stays in ``p.grad`` is left to the step (`settle`), which takes all
        #: of them in one batched launch per device and dtype instead of one per gradient in its hook (set by the
        #: optimizer: where the device is not the host's memory)
        self.defers_norm: Callable[[torch.Tensor], bool] = lambda g: False
        # parameter -> (its gradient then, that gradient's version then) for the norms left to `settle`
        self._deferred: dict[torch.Tensor, tuple[weakref.ref, int]] = {}
        self._handles: list = []
        self.watch(params)

    def watch(self, params: Iterable[torch.Tensor]) -> None:
        """Read the gradients of `params` too."""
        ref = weakref.ref(self)  # the hooks live as long as the parameters; they must not keep the optimizer alive

        def hook(p: torch.Tensor) -> None:
            reads = ref()
            if reads is not None:
                reads._read(p)

        self._handles += [p.register_post_accumulate_grad_hook(hook) for p in params if p.requires_grad]

    @torch.no_grad()
    def _read(self, p: torch.Tensor) -> None:
        refuse_traced_hook(p.grad)  # (compiled autograd, CUDA graphs: `graph_guard.py`)
        meter = self.meter
        if meter is not None:
            meter.gradient_arrived(p, p.grad)
        self._read_now(p)
        if meter is not None and p.grad is None:
            meter.gradient_left(p)  # freed in backward (`BackwardHandOff.grad_ready`)

    def _read_now(self, p: torch.Tensor) -> None:
        g = p.grad
        if g is None or g.is_sparse or _between_micro_batches():
            return
        if is_dtensor(g):
            # FSDP2 calls the hook once the reduce-scatter has produced the rank's shard of the gradient: the norm
            # and the copy are of the local shard, keyed by the local tensor the engine works on
            # (`distributed/fsdp.py`)
            owner, p, g = p, p._local_tensor, g._local_tensor
            if self.copies_out(p) and g.untyped_storage().nbytes() > g.numel() * g.element_size():
                # (a view of the group's reduce-scatter output, which the freed gradients of the group then release)
                g = g.clone()
                set_grad(owner, g)
        elif self.reduced_later():
            return
        if self.on_arrival is not None:
            self.on_arrival(p)  # (an earlier micro-batch's gradient that was freed comes back, added into `g`)
        self._norms.pop(p, None)
        self._deferred.pop(p, None)
        stand_in = self.on_ready(p, g) if self.on_ready is not None else None
        if stand_in is not None:  # freed: its norm now (`g` is still alive here), keyed by the stand-in `step()` sees
            self._norms[p] = (weakref.ref(stand_in), stand_in._version, torch_norm(g))
        elif self.defers_norm(g):
            self._deferred[p] = (weakref.ref(g), g._version)
        else:
            self._norms[p] = (weakref.ref(g), g._version, torch_norm(g))

    def settle(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Take the norms the hooks left to the step (`defers_norm`) of the gradients among `grads` (of `params`)
        that are still as the hooks saw them, in one ``torch._foreach_norm`` per device and dtype (`torch_norms`:
        the bits the hooks' `torch_norm` gives), so that `norm` then returns them."""
        todo = []
        for p, g in zip(params, grads):
            seen = self._deferred.pop(p, None)
            if seen is not None and seen[0]() is g and seen[1] == g._version:
                todo.append((p, g))
        for (p, g), n in zip(todo, torch_norms([g for _, g in todo])):
            self._norms[p] = (weakref.ref(g), g._version, n)

    def norm(self, p: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor | None:
        """The hook's norm of `p`'s gradient `g` (default ``p.grad``), if it still describes that gradient."""
        seen, g = self._norms.get(p), p.grad if g is None else g
        if seen is None or g is None or seen[0]() is not g or seen[1] != g._version:
            return None
        return seen[2]

    def rescale(self, factor: torch.Tensor) -> None:
        """The gradients were multiplied by `factor` in place without a version bump (`GradScaler.unscale_`,
        `amp.py`): the norms follow (an L2 norm scales with its tensor; exactly, for the scaler's powers of two)."""
        for p, (g, version, n) in self._norms.items():
            self._norms[p] = (g, version, n * factor.to(n.device))

    def clear(self) -> None:
        self._norms.clear()
        self._deferred.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.clear()


@dataclass
class Synced:
    """The scalars of a step's one sync as numbers: whether the step goes ahead (total norm and clip coefficient
    finite), the clip coefficient for the host accumulation (times a GradScaler's 1 / scale; None: exactly 1), each
    entry's gradient norm where a matrix waits for its first columns (0.0 elsewhere), and Zen-auto's (total,
    critical) masses."""

    finite: bool
    coef: float | None
    waiting_norms: list[float]
    masses: list[tuple[float, float]]
    #: the inverse scale still on the copies the hooks made before a GradScaler's ``unscale_`` (None: none)
    copies_factor: float | None = None
    #: the total gradient norm (unscaled; global with several ranks)
    total: float = math.nan


@dataclass
class StepReads:
    """What one `step()` reads of its gradients before the one sync: the total norm, the multiplier of every
    gradient (the clip coefficient times a GradScaler's ``1 / scale``; None: 1), the split matrices whose
    selected columns were gathered, Zen-auto's (index, matrix) pairs, the matrices waiting for their
    first columns, and `scalars`: the scalars the sync reads (total, clip coefficient, Zen-auto's masses, waiting
    norms, in that order)."""

    total: torch.Tensor
    clip: torch.Tensor | None = None
    gathered: set[torch.Tensor] = field(default_factory=set)
    auto_split: list[tuple[int, SplitMatrix]] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    scalars: list[torch.Tensor] = field(default_factory=list)

    def sync(self, clipped: bool, entries: int, copies_factor: torch.Tensor | None = None) -> Synced:
        """Read `scalars` on the host (Sync point: waits for backward and the norms). `clipped`: a clip coefficient
        was measured; `entries`: the step's number of parameters with a gradient; `copies_factor`: a device scalar
        read in the same sync (`Synced.copies_factor`)."""
        scalars = self.scalars + ([copies_factor] if copies_factor is not None else [])
        values = torch.stack([v.float().to(self.scalars[0].device) for v in scalars]).tolist()
        factor = values.pop() if copies_factor is not None else None
        coef = values[1] if clipped else None
        finite = math.isfinite(values[0]) and (coef is None or math.isfinite(coef))
        waiting_norms = [0.0] * entries
        for i, value in zip(self.waiting, values[len(values) - len(self.waiting):]):
            waiting_norms[i] = value
        n = len(self.auto_split)
        masses = [(values[2 + j], values[2 + n + j]) for j in range(n)]
        # multiplying by exactly 1 changes nothing: no pass for it
        return Synced(finite, None if coef == 1.0 else coef, waiting_norms, masses, factor, values[0])

    def votes(self, synced: Synced) -> list[bool]:
        """Zen-auto's votes of this step (one per matrix it watches), from the synced masses."""
        return [split.auto.update(critical, total, split.k, split.columns)
                for (_, split), (total, critical) in zip(self.auto_split, synced.masses)]


def _selected_mass(split: SplitMatrix) -> torch.Tensor:
    """The sum of squares of `split`'s gathered selected columns, in fp32 (a bf16 / fp16 gather widened first, one
    matrix at a time: the same bits as from an fp32 gather)."""
    wide = split.device.widened_grad()
    return (wide.square_() if wide is not split.device.grad else wide.square()).sum()


def read_gradients(
    splits: dict[torch.Tensor, SplitMatrix], reads: GradientReads, entries: list[tuple[dict, torch.Tensor]],
    grads: list[torch.Tensor], measured: tuple[list[torch.Tensor] | None, torch.Tensor | None, torch.Tensor | None],
    gather_now: bool, auto: bool, ranks: RankGroup | None = None,
    unscale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
    gathered_already: set[torch.Tensor] | None = None,
) -> StepReads:
    """Norms from `clip_grad_norm_` (`measured`: norms, total, clip coefficient) or from the backward hooks, the
    rest read now; the selected columns gathered (an ordinary step); Zen-auto's masses (`auto`). `ranks`: under
    FSDP2 each rank reads its shards of the gradients, and the sums of squares are summed across these ranks.
    `unscale`: the gradients still carry a GradScaler's scale, and this is 1 / scale (`amp.py`); `found_inf`: the
    scaler's overflow flag (set: the step is skipped). `gathered_already`: matrices whose selected columns the
    backward hooks gathered (their gradients were freed)."""
    cached_norms, cached_total, clip = measured
    gathered: set[torch.Tensor] = set(gathered_already or ())
    if cached_norms:
        norms = list(cached_norms)
    else:
        reads.settle([p for _, p in entries], grads)  # (the norms the hooks left to the step: batched)
        norms = [reads.norm(p, g) for (_, p), g in zip(entries, grads)]
        todo = [i for i, n in enumerate(norms) if n is None]
        if todo:  # read now, with the gather in the same sweep where the kernels allow
            read = norms_and_gather(splits, [entries[i] for i in todo], [grads[i] for i in todo], gather_now, gathered)
            for i, n in zip(todo, read):
                norms[i] = n
    if gather_now:
        # the selected columns are needed before the sync either way: Zen-auto votes on their mass
        gather_selected(splits, entries, grads, gathered)
    first = norms[0].device
    auto_split = [(i, splits[p]) for i, (_, p) in enumerate(entries)
                  if p in gathered and splits[p].offloaded] if auto else []
    masses = [norms[i].square() for i, _ in auto_split] + [_selected_mass(split) for _, split in auto_split]
    # matrices still waiting for their first columns (`reselection.select_waiting`): is their gradient non-zero?
    waiting = [i for i, (_, p) in enumerate(entries)
               if gather_now and (split := splits.get(p)) is not None and split.device is None and split.k > 0]
    waiting_norms = [norms[i] for i in waiting]
    if ranks is not None and ranks.ranks > 1:
        # Collective (FSDP2, every step): each rank holds some rows of every gradient; one all-reduce of all the
        # sums of squares makes the total (the non-finite check, clipping), the masses and the waiting matrices'
        # norms global, so that every rank skips, clips, votes and selects alike. (The total from
        # `clip_grad_norm_` is global already.)
        squares = torch.stack([n.to(first).square() for n in norms + waiting_norms] + [m.to(first) for m in masses])
        ranks.all_reduce_sum([squares], "gradient-norm all-reduce")
        n = len(norms)
        norm_sq, waiting_sq, masses = squares[:n], squares[n:n + len(waiting)], list(squares[n + len(waiting):])
        total = cached_total if cached_total is not None else norm_sq.sum().sqrt()
        waiting_norms = list(waiting_sq.sqrt())
    elif cached_total is not None:
        total = cached_total
    else:
        total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]))
    if unscale is not None:
        # Everything above measured the scaled gradients: the factor goes into the norms and masses (Zen-auto adds
        # masses up across steps, whose scales may differ) and into the multiplier that the device and host paths
        # apply anyway, so unscaling costs no pass over the gradients.
        factor = unscale.to(first)
        total, waiting_norms = total * factor, [n * factor.to(n.device) for n in waiting_norms]
        masses = [m * factor.to(m.device).square() for m in masses]
        clip = factor if clip is None else clip * factor.to(clip.device)
    if found_inf is not None:
        # the scaler found an overflow: a non-finite total makes the step skip, changing nothing (the device update
        # launched before the sync takes the same flag)
        total = torch.where(found_inf.to(total.device) != 0, torch.full_like(total, float("nan")), total)
    scalars = [total, total if clip is None else clip] + masses + waiting_norms
    return StepReads(total, clip, gathered, auto_split, waiting, scalars)
