"""`SyncOffloadAdamW`: the synchronous CPU-offloaded AdamW baseline (ZeRO-Offload's schedule).

Every step: all gradients go to the host, a fused host AdamW updates fp32 masters and moments there, and the
parameters come back; the caller waits for all of it. This is what ZenFlow is measured against, and with
``topk_ratio=0, update_interval=1, overlap_step=False`` (and fp32 host moments) ZenFlow reproduces it bit for bit on
a CPU device.

It is a class of its own rather than that setting of `ZenFlowAdamW`: on CUDA the engine updates 1-D parameters on
the device (ZeRO-Offload keeps every state on the host and moves every gradient), and a baseline run through the
engine would carry the engine's own per-step work (column scores, hooks, window bookkeeping) into the figures
ZenFlow is compared against.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from .._base import (
    GradNormCache,
    check_group_hyperparameters,
    check_hyperparameters,
    clip_coefficient,
    fused_adamw_,
    grad_norms,
    host_empty,
)
from ..engine.selection import selection_axis
from ..engine.telemetry import StepTimer, ZenFlowStats
from ..engine.worker import bounded_wait
from ..settings.threads import rank_cpu_count
from ..transport import transport_for
from .ownership import take_over


class _HostParam:
    """Host state of one parameter. What crosses the link does so once per step in the device tensor's own dtype:
    a bf16 gradient lands in a bf16 host buffer (`link_grad`) and is widened to fp32 on the host; the fp32 master is
    rounded on the host into `link_weight`, which is copied into the weight. (Casting on the device instead would
    send 4 bytes per element each way and time the device's cast: not the baseline ZenFlow is measured against.)
    For fp32 the fp32 buffers cross directly."""

    __slots__ = ("master", "grad", "exp_avg", "exp_avg_sq", "step", "link_grad", "link_weight", "_pin", "_stride")

    def __init__(self, param: torch.Tensor) -> None:
        self._pin = transport_for(param.device).pins_host_memory
        # the parameter's own layout (row- or column-major), so every copy each way is a contiguous stream
        self._stride = param.stride() if selection_axis(param) is not None else None
        self.master = host_empty(param.shape, torch.float32, self._pin, self._stride)
        self.master.copy_(param.detach())
        self.grad = host_empty(param.shape, torch.float32, self._pin, self._stride)
        self.exp_avg = torch.zeros_like(self.master, pin_memory=False)
        self.exp_avg_sq = torch.zeros_like(self.master, pin_memory=False)
        self.step = torch.zeros((), dtype=torch.float32)
        self.link_grad: torch.Tensor | None = None
        self.link_weight = None if param.dtype == torch.float32 else self._buffer(param.dtype)

    def _buffer(self, dtype: torch.dtype) -> torch.Tensor:
        return host_empty(self.master.shape, dtype, self._pin, self._stride)

    def receive_grad(self, grad: torch.Tensor, coef: float | None) -> None:
        """The gradient into the fp32 host buffer (times `coef`): one blocking copy in its own dtype."""
        if grad.dtype == torch.float32:
            self.grad.copy_(grad)
        else:
            if self.link_grad is None or self.link_grad.dtype != grad.dtype:
                self.link_grad = self._buffer(grad.dtype)
            self.link_grad.copy_(grad)
            self.grad.copy_(self.link_grad)  # widened on the host
        if coef is not None and coef != 1.0:
            self.grad.mul_(coef)

    def send_weight(self, param: torch.Tensor) -> None:
        """The master into the weight: rounded on the host, then one blocking copy in the weight's dtype."""
        if self.link_weight is None:
            param.copy_(self.master)
        else:
            self.link_weight.copy_(self.master)
            param.copy_(self.link_weight)

    def nbytes(self) -> int:
        tensors = [self.master, self.grad, self.exp_avg, self.exp_avg_sq, self.link_grad, self.link_weight]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class SyncOffloadAdamW(torch.optim.Optimizer):
    """AdamW with all optimizer state on the host and a synchronous host step (ZeRO-Offload's schedule).

    Args:
        params: parameters or param groups.
        lr, betas, eps, weight_decay: AdamW hyper-parameters (decoupled weight decay).
        cpu_threads: threads of the host AdamW; None = the cores given to this process (its CPU affinity, its share
            of it with several ranks on a node: `threads.rank_cpu_count`). The host AdamW runs on a dedicated host
            thread with these intra-op threads (the training thread's own pool is left alone) while the caller
            waits, as ZenFlow's host worker does without the wait.

    Example:
        >>> import torch
        >>> from hf_zenflow import SyncOffloadAdamW
        >>> model = torch.nn.Linear(16, 16)
        >>> opt = SyncOffloadAdamW(model.parameters(), lr=1e-3)
        >>> model(torch.randn(4, 16)).sum().backward(); opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        cpu_threads: int | None = None,
    ) -> None:
        check_hyperparameters(lr, betas, eps, weight_decay)
        if cpu_threads is not None and (not isinstance(cpu_threads, int) or cpu_threads < 1):
            raise ValueError(f"SyncOffloadAdamW cpu_threads={cpu_threads!r} is invalid: allowed is None or an "
                             "integer >= 1.")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        # a ZenFlowAdamW still hooked on these parameters would take their gradients in backward (`ownership.py`)
        take_over(self, [p for g in self.param_groups for p in g["params"]], holds=False)
        self.cpu_threads = cpu_threads if cpu_threads is not None else rank_cpu_count()
        self._host: dict[torch.Tensor, _HostParam] = {}
        self._norm_cache = GradNormCache()
        self._stats = ZenFlowStats()
        self._steps = 0
        self._host_thread: ThreadPoolExecutor | None = None  # started by the first step (`_host_executor`)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        check_group_hyperparameters(param_group, self.defaults)  # (a group's own lr, betas, ... as the arguments)
        super().add_param_group(param_group)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Global gradient norm (as `torch.nn.utils.clip_grad_norm_`); the clip scale is applied on the host."""
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        _, total = grad_norms(grads, norm_type)
        coef = clip_coefficient(total, float(max_norm)) if max_norm != float("inf") else None
        self._norm_cache.store(grads, [], None, coef)
        return total

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        timer = StepTimer()
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        _, _, clip = self._norm_cache.take(grads)
        coef = float(clip) if clip is not None else None  # Sync point: the clip scale is needed on the host
        with timer.phase("handoff"):
            # Sync point: every gradient is copied to the host and the caller waits for it (the ZeRO-Offload stall).
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    host = self._host.get(p)
                    if host is None:
                        host = self._host[p] = _HostParam(p)
                    host.receive_grad(p.grad, coef)
                    self._stats.bytes_to_host += p.grad.numel() * p.grad.element_size()
        with timer.phase("host_update"):
            # Sync point: the host AdamW runs on the host thread (cpu_threads cores) and the caller waits for it.
            job = self._host_executor().submit(self._host_update)
            bounded_wait(lambda timeout: bool(wait_futures([job], timeout).done), "the synchronous host AdamW")
            job.result()  # (its exception, if it raised)
        with timer.phase("writeback"):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._host[p].send_weight(p)
                        self._stats.bytes_to_device += p.numel() * p.element_size()
        self._steps += 1
        self._stats.finish_step(timer, staleness=0)
        return loss

    @torch.no_grad()
    def _host_update(self) -> None:
        for group in self.param_groups:
            live = [self._host[p] for p in group["params"] if p.grad is not None]
            fused_adamw_([h.master for h in live], [h.grad for h in live], [h.exp_avg for h in live],
                         [h.exp_avg_sq for h in live], [h.step for h in live], group)

    def synchronize(self) -> None:
        """Nothing runs in the background: present for API parity with `ZenFlowAdamW`."""

    def flush(self) -> None:
        """Nothing is ever pending: present for API parity with `ZenFlowAdamW`."""

    def close(self) -> None:
        """Stop the host thread (a later `step()` starts it again)."""
        executor, self._host_thread = self._host_thread, None
        if executor is not None:
            executor.shutdown(wait=True)

    def _host_executor(self) -> ThreadPoolExecutor:
        """One thread with `cpu_threads` intra-op threads: torch's thread count is per OS thread, so the training
        thread's pool is never resized, and the host step runs on the same H cores as ZenFlow's host worker. (At
        interpreter exit `concurrent.futures` waits for a job in flight: a thread returning from a torch op during
        finalization would abort the process.)"""
        if self._host_thread is None:
            self._host_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_zenflow-sync-host",
                                                   initializer=torch.set_num_threads, initargs=(self.cpu_threads,))
            # an optimizer dropped without close() leaves no thread
            weakref.finalize(self, self._host_thread.shutdown, False)
        return self._host_thread

    def stats(self) -> dict[str, float]:
        return self._stats.as_dict(
            selected_fraction=0.0, update_interval=1.0, steps=self._steps, windows=self._steps, reselections=0,
            host_step_ms=self._stats.last_phases.get("host_update", 0.0), accumulate_ms=0.0,
            host_state_bytes=sum(h.nbytes() for h in self._host.values()), device_state_bytes=0,
        )

    def master_weight(self, param: torch.Tensor) -> torch.Tensor:
        host = self._host.get(param)
        return host.master.clone() if host is not None else param.detach().float().cpu().clone()

    def state_dict(self) -> dict[str, Any]:
        index_of = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index_of[p] for p in g["params"]]}
                  for g in self.param_groups]
        state = {index_of[p]: {"master": h.master, "exp_avg": h.exp_avg, "exp_avg_sq": h.exp_avg_sq, "step": h.step}
                 for p, h in self._host.items()}
        return {"state": state, "param_groups": groups, "steps": self._steps}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        params = [p for g in self.param_groups for p in g["params"]]
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("SyncOffloadAdamW.load_state_dict: the saved param groups do not match this optimizer's.")
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
            group["betas"] = tuple(group["betas"])
        self._host.clear()
        for index, entry in state_dict["state"].items():
            p = params[int(index)]
            host = self._host[p] = _HostParam(p)
            for name in ("master", "exp_avg", "exp_avg_sq", "step"):
                getattr(host, name).copy_(entry[name])
        self._steps = int(state_dict.get("steps", 0))
