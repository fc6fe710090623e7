"""fp16 training with `torch.amp.GradScaler`: how `ZenFlowAdamW` learns the scale of the gradients it reads.

Two recipes reach the optimizer, and both are supported:

- ``scaler.step(opt)`` alone. `ZenFlowAdamW` sets ``_step_supports_amp_scaling`` like torch's fused optimizers, so
  the scaler does not unscale ``p.grad``: it sets ``opt.grad_scale`` (the scale) and ``opt.found_inf`` (non-zero
  when a gradient overflowed) and calls ``opt.step()``. The step folds ``1 / grad_scale`` into the clip coefficient
  that both the device and the host path multiply by anyway (no extra pass), unscales the norms and Zen-auto's masses,
  and skips, changing nothing, when ``found_inf`` is set.
- ``scaler.unscale_(opt)`` (then ``opt.clip_grad_norm_``, then ``scaler.step(opt)``: the Trainer's order). unscale_
  rewrites ``p.grad`` in place WITHOUT bumping its version counter, so what the backward hooks read before it (the
  norms, and on CUDA the gradients' early copies to the host) would silently still look current. `install` wraps
  `GradScaler.unscale_` so that afterwards it tells the optimizer (`ZenFlowAdamW._grads_unscaled`), which multiplies
  the hooks' norms by the same ``1 / scale`` and keeps the early copies, which the host adds times ``1 / scale``
  (read in the step's one sync) instead of copying the gradients again; beforehand the compute stream waits for
  the copies of the gradients in ``p.grad``, so that the in-place rewrite cannot race them (not for those of the
  gradients freed in backward, which ``unscale_`` does not rewrite). `step()` then gets ``grad_scale=None``
  and the gradients are taken as they are.

What follows the scale on the optimizer's side, the hooks' early copies and the gradients freed in backward, is
`backward.BackwardHandOff`'s (`before_unscale`, `unscaled`, `freed_overflow`); the optimizer's three methods that
the wraps call hand over to it.

Gradients freed in backward (`free_gradients_in_backward`) are not in ``p.grad`` for the scaler, under either
recipe. Their overflow check, the scaler's own element-wise one (an L2 norm is no such test: it overflows fp16 on
finite values), is made in each gradient's hook once a scaler has been seen, and added to the scaler's
``found_inf`` (`_unscale_grads_` is wrapped), so that the scale backs off and the step is skipped for them exactly
as for the others. (The hooks of the first step with a scaler did not know of it: that step checks the host copies
of those whose norm is not finite.) ``unscale_`` does not bring them back: the selected columns their hooks
gathered are multiplied by ``1 / scale`` as the scaler multiplied the others, and their host copies are added times
it, like the early copies above.

`GradScaler.update()` still sees the scaler's own ``found_inf`` either way, so the scale backs off after an overflow.

Why the class is wrapped, once per process, and not one scaler or the optimizer alone (torch 2.13's
``torch/amp/grad_scaler.py``):

- ``unscale_(opt)`` calls no method of the optimizer, before or after: it reads ``opt.param_groups`` and rewrites each
  ``p.grad`` with ``torch._amp_foreach_non_finite_check_and_unscale_``, which leaves the version counter alone. The
  optimizer cannot see afterwards that it ran (its hooks' norms and early copies still look current), nor order
  the rewrite after those copies beforehand.
- The overflow flags live in the scaler's own per-optimizer state (``found_inf_per_device``), filled only from what
  ``_unscale_grads_`` returns; ``step`` skips on them and ``update()`` backs the scale off on them. A gradient that
  is not in ``p.grad`` can join them nowhere else.
- ``_step_supports_amp_scaling`` changes ``scaler.step`` alone: the optimizer is given ``grad_scale`` and ``found_inf``
  when ``step()`` is called, after ``unscale_`` has run and after those flags are recorded. The scaler itself
  reaches the optimizer only as a ``grad_scaler`` keyword of ``step()``, which torch deprecates (a FutureWarning),
  and only at the first step, after the first ``unscale_``: no scaler instance can be wrapped before its first use.

The wraps change nothing for other optimizers: they call only the methods an optimizer defines
(``_before_unscale``, ``_grads_unscaled``, ``_freed_overflow``), and only while the scaler is enabled.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


_WRAPPED = "_hf_zenflow_notifies"


def install() -> None:
    """Wrap `torch.amp.GradScaler.unscale_` (once per process) so that an optimizer defining
    ``_grads_unscaled(inv_scale)`` hears of it after its gradients were unscaled, and the scaler's overflow check
    (``_unscale_grads_``, under ``unscale_`` and ``step``) so that one defining ``_freed_overflow()`` (a flag per
    device) adds the overflow of gradients that are not in ``p.grad`` on their devices. Other optimizers see no
    change."""
    original = torch.amp.GradScaler.unscale_
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def unscale_(self: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
        prepare = getattr(optimizer, "_before_unscale", None)
        if prepare is not None and self.is_enabled():
            prepare()
        original(self, optimizer)
        notify = getattr(optimizer, "_grads_unscaled", None)
        if notify is not None and self.is_enabled():
            notify(inverse(self._scale))

    setattr(unscale_, _WRAPPED, True)
    torch.amp.GradScaler.unscale_ = unscale_  # type: ignore[method-assign]
    check = torch.amp.GradScaler._unscale_grads_

    @functools.wraps(check)
    def unscale_grads_(self: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, *args: Any) -> dict:
        found = check(self, optimizer, *args)
        overflow = getattr(optimizer, "_freed_overflow", None)
        extra = overflow() if overflow is not None else None
        # gradients the scaler did not see (freed in backward): their overflow counts too, on their own device, as the
        # scaler keeps one flag per device
        for device, flag in (extra or {}).items():
            found[device] = found[device] + flag if device in found else flag
        return found

    torch.amp.GradScaler._unscale_grads_ = unscale_grads_  # type: ignore[method-assign]


def inverse(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` as `GradScaler.unscale_` computes it (in fp64, then fp32), so the factor is the very one applied
    to the gradients. A device tensor: no sync."""
    return scale.double().reciprocal().float()


def scaler_args(optimizer: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(1 / the scale still on the gradients, or None; the overflow flag, or None) from what `GradScaler.step` set
    on `optimizer` for this call (``grad_scale`` is None after ``unscale_``: the gradients are unscaled already)."""
    grad_scale = getattr(optimizer, "grad_scale", None)
    found_inf = getattr(optimizer, "found_inf", None)
    return (None if grad_scale is None else inverse(grad_scale)), found_inf
