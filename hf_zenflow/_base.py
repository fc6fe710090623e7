"""What `ZenFlowAdamW` and `SyncOffloadAdamW` share: hyper-parameter checks, the global gradient norm and clipping,
the fused AdamW kernel call, host buffer allocation and the worker-thread count."""

from __future__ import annotations

import contextlib
import math
import numbers
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.optim.adam import adam as _functional_adam


#: The oldest torch release this package runs on (``pyproject.toml`` requires the same): 2.7, the first whose
#: functional ``torch.optim.adam.adam`` takes ``decoupled_weight_decay`` (`fused_adamw_`). What else is used is
#: older: fused CPU AdamW (2.4), ``torch.distributed.fsdp.fully_shard`` at its public path (2.6),
#: ``torch.distributed.tensor.DTensor`` (2.5), ``torch.amp.GradScaler(device)`` (2.3),
#: ``Tensor.register_post_accumulate_grad_hook`` (2.1).
MIN_TORCH = (2, 7)


def check_torch_version(version: str) -> None:
    """Refuse a torch older than `MIN_TORCH` with an ImportError that names both versions: an old torch would
    otherwise fail later, inside the first optimizer step, with a TypeError about a keyword argument."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found.group(1)), int(found.group(2))) < MIN_TORCH:
        floor = ".".join(map(str, MIN_TORCH))
        raise ImportError(f"hf_zenflow needs torch >= {floor}; this environment has torch {version}: "
                          f"pip install 'torch>={floor}'")


check_torch_version(torch.__version__)


_HYPER_KEYS = ("lr", "betas", "eps", "weight_decay")


def _finite(value: Any) -> bool:
    """A finite real number (not a bool, a string or a tensor)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_hyperparameters(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """Reject AdamW settings torch would reject, and those no run can use (infinite, NaN, a bool, a string),
    naming the argument. The one check of these values: the optimizers' arguments and param groups, and a
    checkpoint's param groups (`checkpoint/validate.py`)."""
    if not _finite(lr) or not 0.0 <= lr:
        raise ValueError(f"lr={lr!r} is invalid: allowed is a finite float >= 0.")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2 or not all(_finite(b) and 0.0 <= b < 1.0
                                                                          for b in betas):
        raise ValueError(f"betas={betas!r} is invalid: allowed is a pair of floats in [0, 1).")
    if not _finite(eps) or not 0.0 <= eps:
        raise ValueError(f"eps={eps!r} is invalid: allowed is a finite float >= 0.")
    if not _finite(weight_decay) or not 0.0 <= weight_decay:
        raise ValueError(f"weight_decay={weight_decay!r} is invalid: allowed is a finite float >= 0.")


def check_group_hyperparameters(group: dict[str, Any], defaults: dict[str, Any]) -> None:
    """`check_hyperparameters` of a param group that sets any of them itself (the rest from `defaults`)."""
    if any(key in group for key in _HYPER_KEYS):
        check_hyperparameters(*(group.get(key, defaults[key]) for key in _HYPER_KEYS))


def fused_adamw_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    group: dict[str, Any],
    found_inf: torch.Tensor | None = None,
) -> None:
    """One AdamW step (decoupled weight decay) with torch's fused kernel, in place; increments `steps`.

    The same kernel serves the device path, the host path and the baseline, so a column's update is the same
    arithmetic wherever it runs (the degenerate-setting tests rely on that). `found_inf`: a tensor on the
    parameters' device; when it is non-zero the kernel changes nothing (parameters, moments, step counts), so the
    update can be launched before the host knows whether the step is skipped.
    """
    if not params:
        return
    params, grads, exp_avgs, exp_avg_sqs = list(params), list(grads), list(exp_avgs), list(exp_avg_sqs)
    for i, quad in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        if quad[0].ndim == 2 and not quad[0].is_contiguous() and all(t.t().is_contiguous() for t in quad):
            # column-major matrices (`column_major_`): AdamW is elementwise, so their contiguous transposes give
            # the same bits, and torch's fused kernel runs ~4x slower on the strided tensors
            params[i], grads[i], exp_avgs[i], exp_avg_sqs[i] = (t.t() for t in quad)
    beta1, beta2 = group["betas"]
    _functional_adam(
        params, grads, exp_avgs, exp_avg_sqs, [], steps,
        foreach=False, fused=True, decoupled_weight_decay=True, amsgrad=False, maximize=False,
        beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
        found_inf=found_inf,
    )


def by_device(items: list[Any], device_of: Callable[[Any], torch.device] = lambda t: t.device,
              ) -> list[tuple[torch.device, list[Any]]]:
    """`items` grouped by device (first-seen order), for one kernel launch or one copy stream per device."""
    groups: dict[torch.device, list[Any]] = {}
    for item in items:
        groups.setdefault(device_of(item), []).append(item)
    return list(groups.items())


def host_empty(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, pin: bool,
               stride: tuple[int, ...] | None = None) -> torch.Tensor:
    """A host buffer (with the given strides, e.g. a parameter's own); pinned when a CUDA device will copy from/to
    it asynchronously."""
    if stride is not None:
        return torch.empty_strided(shape, stride, dtype=dtype, device="cpu", pin_memory=pin)
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run host math with `n` intra-op threads. torch's setting is per OS thread, so this neither sees nor changes
    what `OMP_NUM_THREADS` (set to 1 by `accelerate launch`) gave the training thread once restored."""
    before = torch.get_num_threads()
    if before != n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if before != n:
            torch.set_num_threads(before)


def torch_norms(grads: list[torch.Tensor], norm_type: float = 2.0) -> list[torch.Tensor]:
    """Per-tensor norms (in the order given) computed exactly as `torch.nn.utils.clip_grad_norm_` computes them:
    grouped by device and dtype, one ``torch._foreach_norm`` per group where supported. A tensor's norm has the same
    bits whatever else is in its group (the foreach kernel reduces each tensor on its own)."""
    if not grads:
        return []
    norms: list[torch.Tensor | None] = [None] * len(grads)
    grouped = torch.utils._foreach_utils._group_tensors_by_device_and_dtype([grads], with_indices=True)  # type: ignore[attr-defined]
    for (device, _), ([device_grads], indices) in grouped.items():
        if torch.utils._foreach_utils._has_foreach_support(device_grads, device):  # type: ignore[attr-defined]
            values = list(torch._foreach_norm(device_grads, norm_type))
        else:
            values = [torch.linalg.vector_norm(g, norm_type) for g in device_grads]
        for i, v in zip(indices, values):
            norms[i] = v
    return norms  # type: ignore[return-value]


def grad_norms(grads: list[torch.Tensor], norm_type: float = 2.0,
               known: list[torch.Tensor | None] | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per-tensor norms (in the order given) and their total, computed exactly as
    `torch.nn.utils.clip_grad_norm_` does (`torch_norms`, the total taken over the norms in grouped order), so the
    total is bit-identical to what torch would report. `known`: norms already computed the same way
    (`gradients.torch_norm`, in backward hooks), used instead of reading again."""
    if not grads:
        return [], torch.tensor(0.0)
    known = known if known is not None else [None] * len(grads)
    missing = [i for i, n in enumerate(known) if n is None]
    norms: list[torch.Tensor | None] = list(known)
    for i, n in zip(missing, torch_norms([grads[i] for i in missing], norm_type)):
        norms[i] = n
    grouped = torch.utils._foreach_utils._group_tensors_by_device_and_dtype([grads], with_indices=True)  # type: ignore[attr-defined]
    in_grouped_order = [norms[i] for _, (_, indices) in grouped.items() for i in indices]
    first = grads[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in in_grouped_order]), norm_type)
    return norms, total  # type: ignore[return-value]


def l2_norm(t: torch.Tensor) -> torch.Tensor:
    """L2 norm of one tensor. For contiguous fp32 CPU tensors through BLAS `dot`, which streams ~2x faster than
    `torch.linalg.vector_norm` here (100M elements: 40 vs 76 ms); elsewhere `vector_norm`. NaN/Inf propagate either
    way, which is what the non-finite check needs. (Clipping uses `grad_norms`, bit-identical to torch.)"""
    if t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous():
        flat = t.view(-1)
        return torch.dot(flat, flat).sqrt()
    return torch.linalg.vector_norm(t)


class GradNormCache:
    """Remembers the norms `clip_grad_norm_` computed so `step()` does not read every gradient a second time.

    Valid only for the very gradient tensors, unmodified (same identity and version counter), that were measured.
    """

    def __init__(self) -> None:
        self._key: tuple[tuple[int, int], ...] | None = None
        self.norms: list[torch.Tensor] = []
        self.total: torch.Tensor | None = None
        self.clip_coef: torch.Tensor | None = None

    @staticmethod
    def _key_of(grads: list[torch.Tensor]) -> tuple[tuple[int, int], ...]:
        return tuple((id(g), g._version) for g in grads)

    def store(
        self, grads: list[torch.Tensor], norms: list[torch.Tensor], total: torch.Tensor | None,
        clip_coef: torch.Tensor | None,
    ) -> None:
        self._key, self.norms, self.total, self.clip_coef = self._key_of(grads), norms, total, clip_coef

    def take(
        self, grads: list[torch.Tensor],
    ) -> tuple[list[torch.Tensor] | None, torch.Tensor | None, torch.Tensor | None]:
        """(L2 norms, their total, clip coefficient) if measured on exactly these gradients; clears the cache."""
        hit = self._key is not None and self._key == self._key_of(grads)
        out = (self.norms or None, self.total, self.clip_coef) if hit else (None, None, None)
        self._key, self.norms, self.total, self.clip_coef = None, [], None, None
        return out


def clip_coefficient(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch's clipping rule: scale = min(1, max_norm / (norm + 1e-6))."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


