"""`ZenFlowPlugin`: ZenFlow for a plain 🤗 Accelerate training loop.

accelerate's plugin set is closed (`Accelerator(kwargs_handlers=[...])` rejects third-party handlers), so this is a
stand-alone dataclass in accelerate's style: every setting can come from the constructor or, when not given, from an
environment variable under one prefix, ``HF_ZENFLOW_`` (``HF_ZENFLOW_TOPK_RATIO``, ``HF_ZENFLOW_UPDATE_INTERVAL``,
...). Explicit arguments win over the environment.

Threads (the rule: README, *Threads*; `hf_zenflow.threads`): ``accelerate launch`` exports ``OMP_NUM_THREADS=1``
unless ``--num_cpu_threads_per_process N`` is given (on CPU-only machines it may pick the number of physical cores
instead), which makes torch single-threaded in the training process. ZenFlow's host worker does not inherit this: it
runs ``cpu_threads`` threads (default: half the cores in the process's CPU affinity) inside its own thread, and with
``OMP_NUM_THREADS`` set the training thread's pool is left as it is. `ZenFlowPlugin.thread_report` shows both.

Example (``accelerate launch --cpu --num_processes 1 train.py``)::

    from accelerate import Accelerator
    from hf_zenflow import ZenFlowPlugin

    accelerator = Accelerator()
    plugin = ZenFlowPlugin(topk_ratio=0.1)            # update_interval etc. from HF_ZENFLOW_* or the defaults
    model, optimizer, loader = plugin.prepare(accelerator, model, loader, lr=1e-3, weight_decay=0.01)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients:
                optimizer.clip_grad_norm_(1.0)        # the true global norm; applied inside step()
            optimizer.step()
            optimizer.zero_grad()
    accelerator.save_state("ckpt")                    # the plugin's pre-hook drains the host worker first
    plugin.flush(optimizer)                           # end of training: every gradient in the weights, worker stopped
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from ..config import ZenFlowConfig, available_cpu_count
from ..host import wait_for_closed_workers
from ..optimizer import ZenFlowAdamW


logger = logging.getLogger(__name__)

#: Prefix of the environment variables read by `ZenFlowPlugin` (``HF_ZENFLOW_<FIELD>``).
ENV_PREFIX = "HF_ZENFLOW_"

_TRUE = ("1", "true", "yes", "on", "y", "t")
_FALSE = ("0", "false", "no", "off", "n", "f")


def _unwrap(optimizer: Any) -> ZenFlowAdamW | None:
    for _ in range(8):
        if optimizer is None or isinstance(optimizer, ZenFlowAdamW):
            break
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer if isinstance(optimizer, ZenFlowAdamW) else None


def decay_parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The Trainer's decay / no-decay split over the trainable parameters: no weight decay for biases and norms."""
    from transformers.trainer_pt_utils import get_parameter_names

    forbidden = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
    decay = set(get_parameter_names(model, [torch.nn.LayerNorm], forbidden))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


@dataclass
class ZenFlowPlugin:
    """ZenFlow settings for an `accelerate` loop, read from ``HF_ZENFLOW_<FIELD>`` when not given.

    Args:
        topk_ratio: ``HF_ZENFLOW_TOPK_RATIO``; fraction of columns per matrix updated on the device each step.
        update_interval: ``HF_ZENFLOW_UPDATE_INTERVAL``; steps per host window, or ``"auto"``.
        select_strategy: ``HF_ZENFLOW_SELECT_STRATEGY``; ``"auto"``, ``"step"`` or ``"epoch"``.
        select_interval: ``HF_ZENFLOW_SELECT_INTERVAL``; re-selection period, or ``"auto"``.
        full_warm_up_rounds: ``HF_ZENFLOW_FULL_WARM_UP_ROUNDS``; dense AdamW steps before the first selection.
        overlap_step: ``HF_ZENFLOW_OVERLAP_STEP``; overlap the host AdamW with training (``true``/``false``).
        auto_ratio, auto_max_interval: ``HF_ZENFLOW_AUTO_RATIO``, ``HF_ZENFLOW_AUTO_MAX_INTERVAL`` (Zen-auto).
        host_lr_scale: ``HF_ZENFLOW_HOST_LR_SCALE``; host AdamW lr multiplier, or ``"interval"``.
        min_offload_numel: ``HF_ZENFLOW_MIN_OFFLOAD_NUMEL``; smaller matrices stay entirely on the device.
        accumulate_on: ``HF_ZENFLOW_ACCUMULATE_ON``; ``"host"`` or ``"device"``.
        cpu_threads: ``HF_ZENFLOW_CPU_THREADS``; host worker threads (default: half the cores in this process's
            affinity, whatever ``OMP_NUM_THREADS`` says; README, *Threads*).
        steps_per_epoch: ``HF_ZENFLOW_STEPS_PER_EPOCH``; derived from the prepared dataloader when not given.

    Unset fields take `ZenFlowConfig`'s defaults. Invalid values raise `ValueError` naming the argument or the
    environment variable they came from.

    Example:
        >>> import os; os.environ["HF_ZENFLOW_UPDATE_INTERVAL"] = "8"
        >>> plugin = ZenFlowPlugin(topk_ratio=0.05)
        >>> (plugin.topk_ratio, plugin.to_config().update_interval)
        (0.05, 8)
        >>> del os.environ["HF_ZENFLOW_UPDATE_INTERVAL"]
    """

    topk_ratio: float | None = field(default=None, metadata={"help": "Fraction of columns updated on the device."})
    update_interval: int | str | None = field(default=None, metadata={"help": 'Steps per host window, or "auto".'})
    select_strategy: str | None = field(default=None, metadata={"help": '"auto", "step" or "epoch".'})
    select_interval: int | str | None = field(default=None, metadata={"help": 'Re-selection period, or "auto".'})
    full_warm_up_rounds: int | None = field(default=None, metadata={"help": "Dense AdamW steps first."})
    overlap_step: bool | None = field(default=None, metadata={"help": "Overlap the host AdamW with training."})
    auto_ratio: float | None = field(default=None, metadata={"help": "Zen-auto: fraction of matrices that agree."})
    auto_max_interval: int | None = field(default=None, metadata={"help": "Zen-auto: longest window."})
    host_lr_scale: float | str | None = field(
        default=None, metadata={"help": 'Host AdamW lr multiplier, or "interval" (x window length).'})
    min_offload_numel: int | None = field(
        default=None, metadata={"help": "Matrices with fewer elements stay entirely on the device."})
    accumulate_on: str | None = field(
        default=None, metadata={"help": 'Where the window gradient is summed: "host" or "device".'})
    cpu_threads: int | None = field(default=None, metadata={"help": "Host worker threads."})
    steps_per_epoch: int | None = field(default=None, metadata={"help": "Optimizer steps per epoch."})

    def __post_init__(self) -> None:
        self._from_env: dict[str, str] = {}
        for f in fields(self):
            if getattr(self, f.name) is not None:
                continue  # explicit arguments win over the environment
            name = ENV_PREFIX + f.name.upper()
            raw = os.environ.get(name)
            if raw is None or not raw.strip():
                continue
            setattr(self, f.name, self._parse_env(f.name, name, raw.strip()))
            self._from_env[f.name] = name
        self.to_config()  # validate now, not at the first step

    @staticmethod
    def _parse_env(field_name: str, env_name: str, raw: str) -> Any:
        try:
            if field_name in ("topk_ratio", "auto_ratio"):
                return float(raw)
            if field_name in ("full_warm_up_rounds", "auto_max_interval", "cpu_threads", "steps_per_epoch",
                              "min_offload_numel"):
                return int(raw)
            if field_name == "overlap_step":
                if raw.lower() in _TRUE:
                    return True
                if raw.lower() in _FALSE:
                    return False
                raise ValueError
        except ValueError:
            kind = {"overlap_step": "true or false"}.get(field_name, "a number")
            raise ValueError(f"{env_name}={raw!r} is invalid: allowed is {kind}.") from None
        return raw  # update_interval / select_interval (int or "auto") and select_strategy: ZenFlowConfig parses

    def to_config(self, **overrides: Any) -> ZenFlowConfig:
        """The `ZenFlowConfig` of these settings (unset fields at their defaults)."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        values.update(overrides)
        try:
            return ZenFlowConfig(**values)
        except ValueError as err:
            def name(match: re.Match) -> str:
                env = self._from_env.get(match.group(1))
                return f"{env} (ZenFlowPlugin.{match.group(1)})" if env else f"ZenFlowPlugin.{match.group(1)}"

            raise ValueError(re.sub(r"ZenFlowConfig\.(\w+)", name, str(err))) from None

    # ----------------------------------------------------------------------------------------------------------------
    def create_optimizer(
        self,
        model_or_params: torch.nn.Module | Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        **kwargs: Any,
    ) -> ZenFlowAdamW:
        """A `ZenFlowAdamW` with these settings.

        A model is split like the Trainer does: its trainable parameters, without weight decay for biases and
        norms. Parameters or param groups are taken as they are. `kwargs` go to `ZenFlowAdamW` (e.g.
        ``host_executor``).

        Example:
            >>> opt = ZenFlowPlugin(topk_ratio=0.1).create_optimizer(torch.nn.Linear(8, 8), lr=1e-3)
            >>> [g["weight_decay"] for g in opt.param_groups]
            [0.01, 0.0]
        """
        if isinstance(model_or_params, torch.nn.Module):
            params: Any = decay_parameter_groups(model_or_params, weight_decay)
            if not params:
                raise ValueError("ZenFlowPlugin.create_optimizer: the model has no trainable parameter.")
        else:
            params = model_or_params
        return ZenFlowAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                            config=self.to_config(), **kwargs)

    def check_accelerator(self, accelerator: Any) -> None:
        """Fail fast on setups ZenFlowAdamW does not support: DeepSpeed, FSDP, fp16 (its GradScaler)."""
        from accelerate.utils import DistributedType

        dtype = accelerator.distributed_type
        if dtype == DistributedType.DEEPSPEED:
            raise ValueError("ZenFlowPlugin cannot be combined with DeepSpeed: ZenFlowAdamW replaces DeepSpeed's "
                             "optimizer. Launch without a DeepSpeed config.")
        if dtype == DistributedType.FSDP:
            raise ValueError("ZenFlowPlugin cannot be combined with FSDP: column selection needs whole weight "
                             "matrices. Use DDP or a single device.")
        if accelerator.mixed_precision == "fp16":
            raise ValueError("ZenFlowPlugin cannot be combined with fp16 mixed precision: its GradScaler unscales "
                             "p.grad after ZenFlow has taken the gradients over. Use bf16 or fp32.")

    def prepare(
        self,
        accelerator: Any,
        model: torch.nn.Module,
        *objects: Any,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        **optimizer_kwargs: Any,
    ) -> tuple[Any, ...]:
        """`accelerator.prepare` for a ZenFlow run: returns ``(model, optimizer, *objects)``, all prepared.

        Builds the `ZenFlowAdamW` over the model's trainable parameters, sets its epoch length from the first
        prepared dataloader in `objects` (in optimizer steps, i.e. divided by the gradient accumulation steps) unless
        `steps_per_epoch` is set, and registers save/load-state pre-hooks that wait for the host worker, so that
        `accelerator.save_state` / `load_state` round-trip exactly (the optimizer's state_dict holds the whole
        ZenFlow state). Build the LR scheduler on the returned optimizer afterwards (and prepare it).
        """
        self.check_accelerator(accelerator)
        self._warn_thread_trap()
        model = accelerator.prepare_model(model)
        optimizer = self.create_optimizer(accelerator.unwrap_model(model), lr=lr, weight_decay=weight_decay,
                                          betas=betas, eps=eps, **optimizer_kwargs)
        # device_placement=False: AcceleratedOptimizer would otherwise round-trip the (empty) state through
        # state_dict/load_state_dict onto the device; ZenFlowAdamW places its own state (host side on the host).
        prepared_opt = accelerator.prepare_optimizer(optimizer, device_placement=False)
        prepared = accelerator.prepare(*objects) if objects else ()
        if len(objects) == 1:
            prepared = (prepared,)
        if self.steps_per_epoch is None:
            for obj in prepared:
                if isinstance(obj, torch.utils.data.DataLoader):
                    try:
                        batches = len(obj)
                    except TypeError:
                        continue
                    steps = math.ceil(batches / max(1, accelerator.gradient_accumulation_steps))
                    if steps > 0:
                        optimizer.set_steps_per_epoch(steps)
                    break
        self.register_hooks(accelerator, optimizer)
        return (model, prepared_opt, *prepared)

    @staticmethod
    def register_hooks(accelerator: Any, optimizer: Any) -> None:
        """Make `accelerator.save_state` / `load_state` wait for `optimizer`'s host worker first."""
        ref = weakref.ref(_unwrap(optimizer))

        def drain(*_: Any) -> None:
            opt = ref()
            if opt is not None:
                opt.synchronize()  # also re-raises a worker failure before a checkpoint is written
            wait_for_closed_workers()  # a worker closed during a Ctrl-C may still finish its last job

        accelerator.register_save_state_pre_hook(drain)
        accelerator.register_load_state_pre_hook(drain)

    @staticmethod
    def flush(optimizer: Any) -> None:
        """End of training: write every pending host result into the weights (before saving the final model) and
        stop the host worker, so that no thread outlives the loop (a later `step()` starts a new one)."""
        opt = _unwrap(optimizer)
        if opt is not None:
            opt.flush()
            opt.close()

    def _warn_thread_trap(self) -> None:
        omp = os.environ.get("OMP_NUM_THREADS")
        cores = available_cpu_count()
        if omp == "1" and cores > 1:
            logger.warning(
                "OMP_NUM_THREADS=1 (what `accelerate launch` sets without --num_cpu_threads_per_process): the "
                "forward/backward run on 1 thread. The ZenFlow host worker uses %d thread(s) regardless "
                "(cpu_threads); pass --num_cpu_threads_per_process to give the training thread more.",
                self.to_config().resolved_cpu_threads,
            )

    @staticmethod
    def thread_report(optimizer: Any = None) -> dict[str, Any]:
        """Threads in use: ``OMP_NUM_THREADS``, the training thread's torch threads, the configured ZenFlow
        ``cpu_threads`` and (once the optimizer has stepped) the torch threads measured inside its host worker.

        Example:
            >>> sorted(ZenFlowPlugin.thread_report())
            ['OMP_NUM_THREADS', 'available_cpus', 'host_worker_threads', 'training_threads', 'zenflow_cpu_threads']
        """
        opt = _unwrap(optimizer)
        report: dict[str, Any] = {
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "available_cpus": available_cpu_count(),
            "training_threads": torch.get_num_threads(),
            "zenflow_cpu_threads": opt.config.resolved_cpu_threads if opt is not None else None,
            "host_worker_threads": None,
        }
        worker = getattr(opt, "_worker", None) if opt is not None else None
        if worker is not None and getattr(worker, "_thread", None) is not None:
            # Ask the worker thread itself: torch's thread count is per OS thread.
            seen: dict[str, Any] = {}

            def probe() -> None:
                seen["threads"] = torch.get_num_threads()
                seen["thread"] = threading.current_thread().name

            worker.wait(worker.submit("thread_probe", probe))
            report["host_worker_threads"] = seen.get("threads")
        return report
