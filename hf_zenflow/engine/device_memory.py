"""What the device holds at its peak in a training step: `DeviceMemoryMeter`.

On CUDA the caching allocator knows (`torch.cuda.max_memory_allocated`, which also counts activations and
temporaries); the meter resets that peak at the end of each step (`torch.cuda.reset_peak_memory_stats`), so that
each step's peak is its own, and keeps the run's (`peak_bytes`): code that reads the allocator's peak itself after
training reads the last step's. A CPU device shares its memory with the host, so there the meter counts what a GPU
would hold:

- the parameters (every trained parameter's storage, once);
- the gradients while they are on the device: from the moment backward produces one (the census runs in each
  post-accumulate-grad hook, where a gradient is newest and every gradient still held is counted) until it is set
  to None (by `step()` or ``zero_grad``) or, freed in backward, until its copy to the host has read it (`in_flight`, a
  callback: the bytes of the freed gradients whose copy has not landed, `in_flight.FreedInFlight`);
- the optimizer's device state (`state_bytes`, a callback: fused AdamW's moments, ZenFlow's selected columns and
  dense state, device-side window sums), counted at the end of each step and at every census after it;
- transient bytes the caller names at a census (`note`'s `extra`): ZenFlow's device update passes the fp32 copies
  it widened the gathered bf16 / fp16 gradients into.

Activations and other kernels' temporaries are not counted on a CPU device: the figure is the optimizer's share of the
peak, the part an offloading optimizer changes. Gradients are tracked per parameter (a dict of bytes), so a census
costs O(1); one full recount of `p.grad` runs at the first hook after each step, which also sees gradients set to
None outside the meter (``zero_grad``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


__all__ = ["DeviceMemoryMeter"]


def _bytes(t: torch.Tensor | None) -> int:
    """Bytes of `t` on this process's device (an FSDP2 DTensor: its local shard)."""
    if t is None:
        return 0
    t = getattr(t, "_local_tensor", t)
    return t.numel() * t.element_size()


class DeviceMemoryMeter:
    """The peak of `params` + their gradients on the device + `state_bytes()` (see the module docstring).

    `watch=True` registers its own post-accumulate-grad hooks (any optimizer, e.g. `torch.optim.AdamW`);
    `ZenFlowAdamW` calls `gradient_arrived` / `gradient_left` from its own hooks instead, around the freeing.

    Example:
        >>> lin = torch.nn.Linear(4, 4)
        >>> opt = torch.optim.AdamW(lin.parameters())
        >>> meter = DeviceMemoryMeter(lin.parameters(), lambda: 0, watch=True)
        >>> lin(torch.randn(2, 4)).sum().backward()
        >>> meter.peak_bytes  # weights 80 B + gradients 80 B
        160
        >>> meter.remove()
    """

    def __init__(self, params: Iterable[torch.Tensor], state_bytes: Callable[[], int], watch: bool = False,
                 in_flight: Callable[[], int] = lambda: 0) -> None:
        self.params = list(dict.fromkeys(p for p in params))  # (a parameter listed twice counts once)
        self.state_bytes = state_bytes
        self.in_flight = in_flight
        self.param_count = sum(p.numel() for p in self.params)
        self._weights = sum(_bytes(p.data) for p in self.params)
        self._grads: dict[int, int] = {}
        self._grad_total = 0
        self._state = 0
        self._recount = True  # the next hook recounts every gradient (after a step, zero_grad may have run)
        #: the largest census since construction (the run) and within the last step
        self.peak_bytes = 0
        self.step_peak_bytes = 0
        self._step_peak = 0
        self._handles: list = []
        if watch:
            for p in self.params:
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._watched))

    @property
    def weight_bytes(self) -> int:
        return self._weights

    def _cuda_device(self) -> torch.device | None:
        device = self.params[0].device if self.params else None
        return device if device is not None and device.type == "cuda" else None

    def _watched(self, p: torch.Tensor) -> None:
        self.gradient_arrived(p, p.grad)

    def _census(self, extra: int = 0) -> None:
        if self._cuda_device() is not None:
            return
        held = self._weights + self._grad_total + self.in_flight() + self._state + extra
        self._step_peak = max(self._step_peak, held)
        self.peak_bytes = max(self.peak_bytes, held)

    def _set(self, p: torch.Tensor, nbytes: int) -> None:
        key = id(p)
        self._grad_total += nbytes - self._grads.get(key, 0)
        self._grads[key] = nbytes

    def recount(self) -> None:
        """Count the weights and every parameter's gradient afresh from ``p.grad``."""
        self._weights = sum(_bytes(p.data) for p in self.params)
        self._grads = {id(p): _bytes(p.grad) for p in self.params}
        self._grad_total = sum(self._grads.values())
        self._recount = False

    def gradient_arrived(self, p: torch.Tensor, g: torch.Tensor | None, extra: int = 0) -> None:
        """Backward has produced `p`'s gradient `g`: a census with it (and `extra` transient bytes, e.g. a copy
        buffer)."""
        if self._recount:
            self.recount()
        self._set(p, _bytes(g))
        self._census(extra)

    def gradient_left(self, p: torch.Tensor) -> None:
        """`p`'s gradient left ``p.grad`` (freed in backward; until its copy has read it, `in_flight` counts it)."""
        self._set(p, 0)

    def note(self, extra: int = 0) -> None:
        """A census now (inside a step: the gradients still held and the state as it is)."""
        self._state = self.state_bytes()
        self.recount()
        self._census(extra)

    def finish_step(self) -> None:
        """The end of an optimizer step: count its state (it may have grown), close the step's peak."""
        self.note()
        device = self._cuda_device()
        if device is not None:
            # the caching allocator's peak since the end of the last step (a host-side counter: no sync), which
            # starts afresh from the bytes allocated now, so that the next step's peak is its own; it is every
            # reader's peak statistic of this device, so the run's peak is `peak_bytes`
            self._step_peak = torch.cuda.max_memory_allocated(device)
            self.peak_bytes = max(self.peak_bytes, self._step_peak)
            torch.cuda.reset_peak_memory_stats(device)
        self.step_peak_bytes, self._step_peak = self._step_peak, 0
        self._recount = True

    def as_dict(self) -> dict[str, float]:
        per_param = self.peak_bytes / self.param_count if self.param_count else 0.0
        return {"peak_device_bytes": float(self.peak_bytes), "step_peak_device_bytes": float(self.step_peak_bytes),
                "peak_device_bytes_per_param": per_param, "weight_bytes": float(self.weight_bytes)}

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
