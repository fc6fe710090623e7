"""`ZenFlowPlugin`: ZenFlow for a plain 🤗 Accelerate training loop.

accelerate's plugin set is closed (`Accelerator(kwargs_handlers=[...])` rejects third-party handlers), so this is a
stand-alone dataclass in accelerate's style: every setting can come from the constructor or, when not given, from an
environment variable under one prefix, ``HF_ZENFLOW_`` (``HF_ZENFLOW_TOPK_RATIO``, ``HF_ZENFLOW_UPDATE_INTERVAL``,
...). Explicit arguments win over the environment.

Threads (the rule: docs/threads.md; `settings.threads`): ``accelerate launch`` exports ``OMP_NUM_THREADS=1``
unless ``--num_cpu_threads_per_process N`` is given (on CPU-only machines it may pick the number of physical cores
instead). ZenFlow's host worker does not inherit it: it runs ``cpu_threads`` threads (default: half the cores given
to the process: its CPU affinity, shared with the other ranks on the node) inside its own thread. When something is
offloaded, `prepare` (which builds the optimizer before the loop's first forward) lowers the training thread's pool
to the cores the worker leaves, ``OMP_NUM_THREADS`` being a ceiling like torch's default, and `flush` gives them back
at the end; a run that offloads nothing changes nothing. `ZenFlowPlugin.thread_report` shows the split.

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
                accelerator.unscale_gradients(optimizer)  # fp16 (a GradScaler): clip unscaled gradients; else no-op
                optimizer.optimizer.clip_grad_norm_(1.0)  # the ZenFlowAdamW inside: the true global norm
            optimizer.step()
            optimizer.zero_grad()
    accelerator.save_state("ckpt")                    # on every rank; DDP, FSDP2: one optimizer file per rank
    plugin.flush(optimizer)                           # end of training: every gradient in the weights, worker stopped
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, make_dataclass
from typing import Any

import torch

from ..distributed.replica_check import warn_if_replicated
from ..engine.worker import wait_for_closed_workers
from ..optimizer.zenflow import ZenFlowAdamW
from ..settings.config import ZenFlowConfig, available_cpu_count
from ..settings.flags import SETTINGS, optional_fields, parse_text, rename_fields, render_help, wrap
from ..settings.threads import rank_cpu_count
from .unwrap import unwrap_zenflow_optimizer


logger = logging.getLogger(__name__)

#: Prefix of the environment variables read by `ZenFlowPlugin` (``HF_ZENFLOW_<FIELD>``).
ENV_PREFIX = "HF_ZENFLOW_"
#: The package's other variables under the prefix, which are not settings: the host wait's limit (`engine/waits.py`),
#: the kernel and model cache, the native kernels' switch (`transport/cpu_device/kernels.py`).
OTHER_ENV = ("HF_ZENFLOW_CACHE", "HF_ZENFLOW_HOST_WAIT_LIMIT_S", "HF_ZENFLOW_NATIVE")
#: The test suite's own variables (its device, its gradient-freeing mode) share this prefix.
TEST_ENV_PREFIX = "HF_ZENFLOW_TEST_"


def env_name(setting: str) -> str:
    """The environment variable of a setting: ``HF_ZENFLOW_<SETTING>``."""
    return ENV_PREFIX + setting.upper()


def refuse_unknown_env() -> None:
    """Raise `ValueError` for a variable under ``HF_ZENFLOW_`` that names no setting (a misspelt or removed one would
    otherwise be ignored without a word), naming the closest setting's variable and the ones allowed."""
    allowed = sorted(env_name(s.name) for s in SETTINGS)
    for name in sorted(os.environ):
        if (name.startswith(ENV_PREFIX) and name not in allowed and name not in OTHER_ENV
                and not name.startswith(TEST_ENV_PREFIX)):
            # (the names compared without the prefix that they all share)
            close = difflib.get_close_matches(name[len(ENV_PREFIX):], [a[len(ENV_PREFIX):] for a in allowed], n=1)
            hint = f" (did you mean {ENV_PREFIX}{close[0]}?)" if close else ""
            raise ValueError(f"{name} is not a ZenFlow setting{hint}: allowed are {', '.join(allowed)}, and "
                             f"{', '.join(OTHER_ENV)} and the test suite's {TEST_ENV_PREFIX}*, which are not "
                             "settings.")


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


# The plugin's fields: every ZenFlowConfig field under its own name, None = not given (generated, `settings/flags.py`).
_ZenFlowPluginSettings = make_dataclass(
    "ZenFlowPluginSettings", optional_fields(),
    namespace={"__module__": __name__, "__doc__": "The ZenFlowPlugin settings, generated from ZenFlowConfig."},
)


@dataclass
class ZenFlowPlugin(_ZenFlowPluginSettings):
    """ZenFlow settings for an `accelerate` loop, read from ``HF_ZENFLOW_<FIELD>`` when not given.

    Every `ZenFlowConfig` field is an argument (generated from its fields). Unset fields take `ZenFlowConfig`'s
    defaults; the optimizer's epoch length is set from the prepared dataloader (`prepare`). Environment values are read
    like command-line text (``true``/``false``, numbers, ``auto``; choices in any case). Invalid values raise
    `ValueError` naming the argument or the environment variable they came from, and a variable under the prefix that
    names no setting raises too.

    Example:
        >>> import os; os.environ["HF_ZENFLOW_UPDATE_INTERVAL"] = "8"
        >>> plugin = ZenFlowPlugin(topk_ratio=0.05)
        >>> (plugin.topk_ratio, plugin.to_config().update_interval)
        (0.05, 8)
        >>> del os.environ["HF_ZENFLOW_UPDATE_INTERVAL"]
    """

    def __post_init__(self) -> None:
        self._from_env: dict[str, str] = {}
        refuse_unknown_env()
        for setting in SETTINGS:
            if getattr(self, setting.name) is not None:
                continue  # explicit arguments win over the environment
            name = env_name(setting.name)
            raw = os.environ.get(name)
            if raw is None or not raw.strip():
                continue
            try:
                setattr(self, setting.name, parse_text(setting, raw))
            except ValueError as err:
                raise ValueError(f"{name}={raw!r} is invalid: {err}.") from None
            self._from_env[setting.name] = name
        self.to_config()  # validate now, not at the first step

    def to_config(self, **overrides: Any) -> ZenFlowConfig:
        """The `ZenFlowConfig` of these settings (unset fields at their defaults)."""
        values = {s.name: getattr(self, s.name) for s in SETTINGS if getattr(self, s.name) is not None}
        values.update(overrides)
        try:
            return ZenFlowConfig(**values)
        except ValueError as err:
            def name(field_name: str) -> str:
                env = self._from_env.get(field_name)
                return f"{env} (ZenFlowPlugin.{field_name})" if env else f"ZenFlowPlugin.{field_name}"

            raise ValueError(rename_fields(str(err), name)) from None

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

        Examples:
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
        optimizer = ZenFlowAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                 config=self.to_config(), **kwargs)
        warn_if_replicated()
        return optimizer

    def check_accelerator(self, accelerator: Any) -> None:
        """Fail fast on setups ZenFlowAdamW does not support: DeepSpeed, FSDP1. (fp16 works: `engine.amp`.)"""
        from accelerate.utils import DistributedType

        dtype = accelerator.distributed_type
        if dtype == DistributedType.DEEPSPEED:
            raise ValueError("ZenFlowPlugin cannot be combined with DeepSpeed: ZenFlowAdamW replaces DeepSpeed's "
                             "optimizer. Launch without a DeepSpeed config.")
        if dtype == DistributedType.FSDP and not getattr(accelerator, "is_fsdp2", False):
            raise ValueError("ZenFlowPlugin cannot be combined with FSDP1 (fsdp_version 1, accelerate's default): "
                             "only FSDP2 (fully_shard, DTensor shards) is supported. Set fsdp_version: 2 in the "
                             "accelerate config (or FullyShardedDataParallelPlugin(fsdp_version=2)), or use DDP.")

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
        ``steps_per_epoch`` is passed in `optimizer_kwargs`, and registers save/load-state pre-hooks that wait for the
        host worker, so that `accelerator.save_state` / `load_state` round-trip exactly (the optimizer's state_dict
        holds the whole ZenFlow state). Build the LR scheduler on the returned optimizer afterwards (and prepare it).

        Under DDP (several processes) ``save_state`` must be called on every rank, as accelerate asks anyway: each
        rank writes its share of the optimizer state to ``zenflow_optimizer_rank{r}_of_{N}.pt`` in the folder, as
        `ZenFlowTrainer` does, and ``optimizer.bin`` only points at those files; ``load_state`` gives each rank its
        own file back. Another number of ranks is refused naming both; a one-process folder loads on any number
        (`hf_zenflow.hf.accelerate_checkpoint`).

        Under FSDP2 (``fsdp_version: 2``) accelerate shards the model and hands the optimizer the DTensor shards:
        ZenFlow works on each rank's rows, and ``save_state`` / ``load_state`` keep the same per-rank files (under
        FSDP2 even for one process) next to accelerate's FSDP model checkpoint; accelerate's own FSDP optimizer
        checkpoint (torch DCP) is not used for it. FSDP1 is refused.
        """
        from .accelerate_checkpoint import prepare_rank_file_optimizer  # imports accelerate: not at module import

        self.check_accelerator(accelerator)
        self._warn_thread_trap()
        if not getattr(accelerator, "is_fsdp2", False):
            # FSDP2 shards the model only when it is prepared with its optimizer, then swaps the DTensor shards into
            # the optimizer's param groups (the engine takes them at its first step): prepare_rank_file_optimizer
            model = accelerator.prepare_model(model)
        optimizer = self.create_optimizer(accelerator.unwrap_model(model), lr=lr, weight_decay=weight_decay,
                                          betas=betas, eps=eps, **optimizer_kwargs)
        self.register_hooks(accelerator, optimizer)  # drain the host worker before the per-rank files are written
        model, prepared_opt = prepare_rank_file_optimizer(accelerator, model, optimizer)
        prepared = accelerator.prepare(*objects) if objects else ()
        if len(objects) == 1:
            prepared = (prepared,)
        if optimizer.steps_per_epoch is None:
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
        return (model, prepared_opt, *prepared)

    @staticmethod
    def register_hooks(accelerator: Any, optimizer: Any) -> None:
        """Make `accelerator.save_state` / `load_state` wait for `optimizer`'s host worker first."""
        ref = weakref.ref(unwrap_zenflow_optimizer(optimizer))

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
        opt = unwrap_zenflow_optimizer(optimizer)
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
        """Threads in use: ``OMP_NUM_THREADS``, the cores (the affinity's, and this process's share: the thread
        rule's), the training thread's torch threads, the configured ZenFlow
        ``cpu_threads`` and (once the optimizer has stepped) the torch threads measured inside its host worker.

        Example:
            >>> sorted(ZenFlowPlugin.thread_report())  # doctest: +NORMALIZE_WHITESPACE
            ['OMP_NUM_THREADS', 'available_cpus', 'host_worker_threads', 'process_cores', 'training_threads',
             'zenflow_cpu_threads']
        """
        opt = unwrap_zenflow_optimizer(optimizer)
        report: dict[str, Any] = {
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "available_cpus": available_cpu_count(),
            "process_cores": rank_cpu_count(),  # (this rank's share of them with several ranks on the node)
            "training_threads": torch.get_num_threads(),
            "zenflow_cpu_threads": opt.config.resolved_cpu_threads if opt is not None else None,
            "host_worker_threads": None,
        }
        worker = opt.host_windows.worker if opt is not None else None
        if worker is not None and getattr(worker, "_thread", None) is not None:
            # Ask the worker thread itself: torch's thread count is per OS thread.
            seen: dict[str, Any] = {}

            def probe() -> None:
                seen["threads"] = torch.get_num_threads()
                seen["thread"] = threading.current_thread().name

            worker.wait(worker.submit("thread_probe", probe))
            report["host_worker_threads"] = seen.get("threads")
        return report


def _arguments_doc() -> str:
    """The "Args:" section, from the fields themselves (so it cannot drift)."""
    entries = [wrap(f"{s.name}: ``{env_name(s.name)}``; {render_help(s)}", 8, hanging=4) for s in SETTINGS]
    return "\n".join(entries).strip()


ZenFlowPlugin.__doc__ = f"{ZenFlowPlugin.__doc__.rstrip()}\n\n    Args:\n        {_arguments_doc()}\n"
