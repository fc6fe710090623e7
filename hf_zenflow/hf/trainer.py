"""`ZenFlowTrainer`: a `transformers.Trainer` that trains with `ZenFlowAdamW`.

Only the seams the 5.x Trainer exposes are used:

- `get_optimizer_cls_and_kwargs` returns `ZenFlowAdamW` and its settings, so the Trainer's own decay / no-decay
  groups (trainable parameters only, hence LoRA works) are what ZenFlow optimizes;
- `_clip_grad_norm` / `_get_grad_norm` go through `ZenFlowAdamW.clip_grad_norm_`, so clipping covers every gradient
  and the logged `grad_norm` is the true global norm;
- `_save_checkpoint`, `save_model` and evaluation wait for the host worker first, `_finalize_training` flushes the
  last window into the weights and stops the host worker (no thread outlives `train()`);
- under several processes (DDP) and under FSDP2, `_save_optimizer_and_scheduler` / `_load_optimizer_and_scheduler`
  write and read one optimizer file per rank (`rank_checkpoint`): the stock path saves only the main process's
  state, and its FSDP path (torch DCP) expects per-parameter optimizer state, which ZenFlow's is not;
- under FSDP2 (`--fsdp --fsdp_config '{"version": 2}'`) the Trainer creates the optimizer before `fully_shard`,
  and accelerate then swaps its parameters for the DTensor shards: `create_scheduler`, which the Trainer calls right
  after that swap, names the new parameters;
- `log` merges the optimizer's telemetry under `zenflow/...` (`trainer_telemetry`); `create_model_card` renders the
  ZenFlow card (`trainer_card`).

Gradient accumulation needs nothing special: the Trainer calls `optimizer.step()` once per optimizer step, so the
ZenFlow window (`update_interval`) counts optimizer steps, not micro-batches.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch
from accelerate.utils import save_fsdp_model
from transformers import PreTrainedModel, Trainer, TrainingArguments
from transformers.distributed.fsdp import get_fsdp_ckpt_kwargs
from transformers.trainer import SCHEDULER_NAME
from transformers.trainer_pt_utils import reissue_pt_warnings
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from ..atomic import torch_save, write_text
from ..checkpoint.format import CheckpointError, check_file
from ..distributed.replica_check import warn_if_replicated
from ..engine.layout import column_major_
from ..engine.worker import wait_for_closed_workers
from ..optimizer.zenflow import ZenFlowAdamW
from .args_upgrade import upgrade_training_arguments
from .checkpoint_manifest import finish_saving, mark_saving
from .rank_checkpoint import OPTIMIZER_NAME, check_one_process_resume, load_rank_state, save_rank_state
from .resume import check_resumed_optimizer, checked_resume
from .trainer_card import render_trainer_card
from .trainer_telemetry import ZenFlowTelemetry, ZenFlowTelemetryCallback
from .training_args import SUPPORTED_OPTIMS, ZenFlowTrainingArguments
from .unwrap import unwrap_zenflow_optimizer


logger = logging.getLogger(__name__)


def refuse_unmanaged_dtensors(model: torch.nn.Module) -> None:
    """Raise a `ValueError` when `model` has DTensor parameters (`fully_shard` applied by hand) but the Trainer's
    FSDP is off: the Trainer would then wrap the shards in DDP, and neither save nor load them as FSDP."""
    for name, param in model.named_parameters():
        if type(param).__name__ == "DTensor" or type(param.data).__name__ == "DTensor":
            raise ValueError(
                f"ZenFlowTrainer: parameter {name!r} is a DTensor: the model was sharded (fully_shard) outside the "
                "Trainer, whose FSDP is off. Pass the unsharded model with --fsdp --fsdp_config '{\"version\": 2}' "
                "(or an accelerate config with fsdp_version: 2): the Trainer then shards it with FSDP2, and saves "
                "and resumes it."
            )


def _is_peft_model(model: Any) -> bool:
    return any(cls.__name__ == "PeftModel" for cls in type(model).__mro__)


class ZenFlowTrainer(Trainer):
    """A [`~transformers.Trainer`] that trains with `ZenFlowAdamW` (when `args.zenflow`, the default).

    Takes the same arguments as `Trainer`. A plain `TrainingArguments` is upgraded to `ZenFlowTrainingArguments`
    (ZenFlow on, default settings), any subclass of it (trl's `SFTConfig`, `DPOConfig`) to the dataclass
    `(that class, ZenFlowTrainingArguments)`, which keeps that class's defaults (`args_upgrade`).

    Mixes into any Trainer subclass, first in the bases so that its overrides wrap the other Trainer's:
    `class MyTrainer(ZenFlowTrainer, DPOTrainer)` (set `zenflow_args_base = DPOConfig` there when that Trainer
    rebuilds foreign arguments as its own config, as trl's do); `hf_zenflow.trl.ZenFlowSFTTrainer` is the SFT one.

    Everything else of the Trainer keeps working: LR schedulers, gradient
    accumulation, clipping (`max_grad_norm`), `grad_norm` logging, checkpoints and `resume_from_checkpoint`,
    evaluation, peft models, activation (gradient) checkpointing, bf16, fp16 (its GradScaler). Telemetry appears
    in the logs as `zenflow/...`; the model card (`README.md` next to the saved model) carries a ZenFlow section
    and the `hf_zenflow` tag.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from hf_zenflow import ZenFlowTrainer, ZenFlowTrainingArguments
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
        ...                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4))
        >>> args = ZenFlowTrainingArguments(output_dir="out", max_steps=10, use_cpu=True, report_to="none",
        ...                                 zenflow_topk_ratio=0.1, zenflow_update_interval=4)
        >>> trainer = ZenFlowTrainer(model=model, args=args, train_dataset=dataset)  # doctest: +SKIP
        >>> trainer.train(); trainer.save_model()  # doctest: +SKIP
    """

    _tag_names = ["hf_zenflow", "zenflow"]

    #: The arguments class of the Trainer mixed in after this one (trl's `SFTTrainer`: `SFTConfig`), which that
    #: Trainer would otherwise rebuild the arguments as, dropping the zenflow_* fields; None: any.
    zenflow_args_base: type[TrainingArguments] | None = None

    def __init__(self, model: Any = None, args: TrainingArguments | None = None, *pargs: Any, **kwargs: Any) -> None:
        args = self._upgrade_args(args)
        # Mixed into another Trainer (trl's SFTTrainer: "trl", "sft"), the model and card carry both's tags.
        self._tag_names = list(dict.fromkeys(
            tag for cls in reversed(type(self).__mro__) for tag in cls.__dict__.get("_tag_names", ())))
        self._zenflow_telemetry = ZenFlowTelemetry()
        self._zenflow_steps_per_epoch: int | None = None
        super().__init__(model, args, *pargs, **kwargs)
        self.add_callback(ZenFlowTelemetryCallback(self._zenflow_telemetry))
        if self.args.zenflow and (self.optimizer is not None or self.optimizer_cls_and_kwargs is not None):
            if unwrap_zenflow_optimizer(self.optimizer) is None and (
                self.optimizer_cls_and_kwargs is None or self.optimizer_cls_and_kwargs[0] is not ZenFlowAdamW
            ):
                logger.warning(
                    "ZenFlowTrainer: an explicit optimizer was passed (`optimizers` / `optimizer_cls_and_kwargs`), so "
                    "the --zenflow_* settings are ignored and no ZenFlowAdamW is used."
                )
        # Tags end up in the model's own card and in push_to_hub (the Trainer reads `model.model_tags`).
        if self.model is not None and hasattr(self.model, "add_model_tags"):
            self.model.add_model_tags(self._tag_names)

    def _upgrade_args(self, args: TrainingArguments | None) -> ZenFlowTrainingArguments:
        # Any TrainingArguments subclass (an SFTConfig, a DPOConfig) gains the zenflow_* fields, its own defaults
        # and values kept (args_upgrade); `zenflow_args_base` is what the Trainer mixed in after this one expects.
        return upgrade_training_arguments(args, self.zenflow_args_base)

    # -- optimizer ---------------------------------------------------------------------------------------------------
    @staticmethod
    def get_optimizer_cls_and_kwargs(args: TrainingArguments, model: Any = None) -> tuple[Any, dict[str, Any]]:
        """`(ZenFlowAdamW, kwargs)` when `args.zenflow`, else the Trainer's usual choice for `args.optim`."""
        if not getattr(args, "zenflow", False):
            return Trainer.get_optimizer_cls_and_kwargs(args, model)
        optim = getattr(args.optim, "value", args.optim)
        if optim not in SUPPORTED_OPTIMS:
            raise ValueError(
                f"ZenFlowTrainer: --optim {optim} is not supported with --zenflow: ZenFlowAdamW implements AdamW, so "
                f"--optim must be one of {', '.join(SUPPORTED_OPTIMS)} (or pass --zenflow False)."
            )
        return ZenFlowAdamW, {
            "lr": args.learning_rate,
            "betas": (args.adam_beta1, args.adam_beta2),
            "eps": args.adam_epsilon,
            "weight_decay": args.weight_decay,
            "config": args.zenflow_config(),
        }

    def set_initial_training_values(self, args, dataloader):
        values = super().set_initial_training_values(args, dataloader)
        # (num_train_epochs, num_update_steps_per_epoch, ...): the epoch length in optimizer steps, which
        # select_strategy "epoch"/"auto" needs; unknown for an iterable dataset without a length.
        has_length = False
        try:
            has_length = len(dataloader) > 0
        except TypeError:
            pass
        self._zenflow_steps_per_epoch = int(values[1]) if has_length else None
        return values

    def create_optimizer(self, model=None):
        target = self.model if model is None else model
        if (getattr(self.args, "zenflow", False) and self.optimizer is None and not self.is_fsdp_enabled
                and not self.is_distributed_loading_by_transformers):
            refuse_unmanaged_dtensors(target)
        layout = getattr(self.args, "zenflow_layout", "row")
        # Under FSDP2 "auto" is row: fully_shard replaces each weight with row-major Shard(0) pieces, whatever the
        # layout before ("column" is refused with FSDP at construction, ZenFlowTrainingArguments).
        if getattr(self.args, "zenflow", False) and self.optimizer is None and (
            layout == "column"
            or (layout == "auto" and not self.is_fsdp_enabled and next(target.parameters()).device.type == "cpu")
        ):
            # before the optimizer exists: its state is laid out like each weight when first created. Only the
            # weights it will offload (a LoRA run's frozen base and small adapters keep their layout)
            column_major_(target, self.args.zenflow_config())
        optimizer = super().create_optimizer(model)
        opt = unwrap_zenflow_optimizer(optimizer)
        # Fill the epoch length in unless the user's own optimizer (`optimizers=(ZenFlowAdamW(...), None)`) has one.
        if opt is not None and self._zenflow_steps_per_epoch is not None and opt.steps_per_epoch is None:
            opt.set_steps_per_epoch(self._zenflow_steps_per_epoch)
        if opt is not None:
            opt.drained_by = type(self).__name__  # this Trainer synchronises, flushes and closes it itself
            warn_if_replicated()
            opt.name_parameters(target)  # checkpoints carry the names; errors and `convert-checkpoint` use them
            opt.clip_through_optimizer()  # (`_clip_grad_norm`: gradients freed in backward are clipped too)
        return optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        # The Trainer calls this right after `accelerator.prepare`, which under FSDP2 has swapped the optimizer's
        # parameters for the model's DTensor shards: name those (the names are keyed by parameter) before a
        # checkpoint is loaded or saved.
        opt = self.zenflow_optimizer
        if opt is not None and self.is_fsdp_enabled:
            opt.name_parameters(self.model)
        return super().create_scheduler(num_training_steps, optimizer)

    # -- checkpoints: one optimizer file per rank under several processes or FSDP2 (rank_checkpoint) -----------------
    def _per_rank_optimizer_files(self) -> bool:
        return self.zenflow_optimizer is not None and (self.args.world_size > 1 or self.is_fsdp_enabled)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._per_rank_optimizer_files():
            return super()._save_optimizer_and_scheduler(output_dir)
        if self.is_fsdp_enabled:
            # The stock FSDP path saves the model's FSDP checkpoint here, with the optimizer: keep the model part.
            save_fsdp_model(self.accelerator.state.fsdp_plugin, self.accelerator, self.model, output_dir,
                            **get_fsdp_ckpt_kwargs())
        # Every rank writes its own state (the stock path writes optimizer.pt from the main process only, and a
        # state_dict() that needs collectives would hang there); the main process also writes the scheduler.
        save_rank_state(self.optimizer, output_dir, self.args.process_index, self.args.world_size)
        if self.args.should_save:
            with warnings.catch_warnings(record=True) as caught:
                torch_save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
            reissue_pt_warnings(caught)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        # resume_from_checkpoint=True: the stock Trainer takes the newest checkpoint-N folder even when a process
        # killed while saving left it partial (and then fails on a cut file, or on a missing one); take the newest
        # complete one (its manifest checks), naming those skipped; a folder named explicitly is checked too
        # (`resume.checked_resume`).
        need_optimizer = not getattr(self.args, "zenflow_resume_without_optimizer", False)
        resume_from_checkpoint = checked_resume(resume_from_checkpoint, self.args.output_dir, need_optimizer)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        except BaseException:
            # a failed or interrupted train() skips `_finalize_training`: the host worker (a failed one too) must not
            # outlive it either. After a worker failure the optimizer stays refused until a resume loads a state.
            if self.zenflow_optimizer is not None:
                self.zenflow_optimizer.close()
            raise

    def _without_optimizer_state(self, checkpoint: str, path: str) -> None:
        """A checkpoint with no optimizer state: refused, unless the user asked to resume without it."""
        if not getattr(self.args, "zenflow_resume_without_optimizer", False):
            raise CheckpointError(
                f"{path}: no such file: checkpoint {checkpoint} has no ZenFlow optimizer state (a partial copy, or "
                "saved with save_only_model). Resuming would restart the moments and the ZenFlow schedule. Resume "
                "from a complete checkpoint, or set zenflow_resume_without_optimizer=True to continue with a fresh "
                "optimizer state.")
        logger.warning("ZenFlowTrainer: %s has no optimizer state (%s missing): resuming with a fresh optimizer state "
                       "(zenflow_resume_without_optimizer=True); the learning-rate schedule is restored when its "
                       "file is there.", checkpoint, os.path.basename(path))
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            with warnings.catch_warnings(record=True) as caught:
                self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
            reissue_pt_warnings(caught)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # A damaged optimizer.pt must say which file and what is wrong, not raise a bare EOFError from torch.load;
        # a ZenFlow state that fails validation says which tensor (ZenFlowAdamW.load_state_dict) and which file.
        if checkpoint is None or self.zenflow_optimizer is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if self._per_rank_optimizer_files():
            return self._load_rank_optimizer_and_scheduler(checkpoint)
        check_one_process_resume(checkpoint)
        path = os.path.join(checkpoint, OPTIMIZER_NAME)
        if not os.path.isfile(path):
            return self._without_optimizer_state(checkpoint, path)
        check_file(path)
        try:
            super()._load_optimizer_and_scheduler(checkpoint)
        except CheckpointError as exc:
            raise CheckpointError(f"{path}: {exc}") from exc
        self._check_resumed_optimizer(path)

    def _check_resumed_optimizer(self, where: str) -> None:
        """The optimizer state just loaded belongs to the Trainer state resumed (`resume.check_resumed_optimizer`):
        the same step count; the same clipping, or a warning. (`self.state` was read from the checkpoint's
        trainer_state.json before the optimizer is loaded.)"""
        clip = self.args.max_grad_norm if self.args.max_grad_norm > 0 else float("inf")  # (as `_get_grad_norm`)
        check_resumed_optimizer(self.zenflow_optimizer.loaded_progress, self.state.global_step, where, clip)

    def _load_rank_optimizer_and_scheduler(self, checkpoint: str) -> None:
        state = load_rank_state(checkpoint, self.args.process_index, self.args.world_size)
        if state is None:
            return self._without_optimizer_state(checkpoint, os.path.join(checkpoint, OPTIMIZER_NAME))
        try:
            self.optimizer.load_state_dict(state)
        except CheckpointError as exc:
            raise CheckpointError(f"{checkpoint} (rank {self.args.process_index}): {exc}") from exc
        self._check_resumed_optimizer(f"{checkpoint} (rank {self.args.process_index})")
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            with warnings.catch_warnings(record=True) as caught:
                self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
            reissue_pt_warnings(caught)

    @property
    def zenflow_optimizer(self) -> ZenFlowAdamW | None:
        """The `ZenFlowAdamW` in use (None before `train()` creates it, or when ZenFlow is off)."""
        return unwrap_zenflow_optimizer(self.optimizer)

    def _zenflow_synchronize(self) -> None:
        opt = self.zenflow_optimizer
        if opt is not None:
            opt.synchronize()
            wait_for_closed_workers()  # a worker closed during a Ctrl-C may still finish its last job

    # -- clipping: the optimizer owns the gradients ----------------------------------------------------------------
    def _clip_grad_norm(self, model):
        opt = self.zenflow_optimizer
        if opt is None:
            return super()._clip_grad_norm(model)
        self.accelerator.unscale_gradients(opt)  # fp16: clip the unscaled gradients (a no-op without a GradScaler)
        return opt.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        opt = self.zenflow_optimizer
        if opt is None:
            return super()._get_grad_norm(model, grad_norm)
        if grad_norm is None:
            self.accelerator.unscale_gradients(opt)  # (as in `_clip_grad_norm`, which did not run)
            grad_norm = opt.clip_grad_norm_(float("inf"))  # measure only
        return grad_norm

    # -- drains ------------------------------------------------------------------------------------------------------
    def _save_checkpoint(self, model, trial):
        # The optimizer state_dict must not be taken while the worker writes it, and the worker's errors must
        # surface here rather than in a corrupt checkpoint.
        self._zenflow_synchronize()
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save:
            mark_saving(folder)  # (a folder re-saved over must not pass for complete while it is rewritten)
        self.accelerator.wait_for_everyone()  # no rank writes a file before the folder is marked in progress
        # The stock save ends by deleting checkpoints over save_total_limit: here that waits until the new one is
        # marked complete, so that a save killed halfway never leaves the run without a complete checkpoint.
        limit, self.args.save_total_limit = self.args.save_total_limit, None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        # Every rank has written its files (rank optimizer files, rng_state_{r}.pth) once all are here; only then
        # does the main process write the manifest that marks the folder complete.
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            finish_saving(folder)
            rotate_checkpoints(output_dir=run_dir, save_total_limit=limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)
        if self.args.should_save and self.zenflow_optimizer is not None:
            self.create_model_card()

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        # A model that is not a PreTrainedModel is saved with safetensors' save_file, which refuses views with gaps;
        # ZenFlow's column-major weights (zenflow_layout) are such views: save them contiguous, as the plain Trainer
        # saves the same model (loading copies the values back into the column-major weights).
        if state_dict is None and self.args.should_save and not _is_peft_model(self.model) and not isinstance(
                self.accelerator.unwrap_model(self.model, keep_torch_compile=False), PreTrainedModel):
            state_dict = {k: v if v.is_contiguous() else v.contiguous() for k, v in self.model.state_dict().items()}
        super()._save(output_dir, state_dict=state_dict)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        self._zenflow_synchronize()
        super().save_model(output_dir, _internal_call=_internal_call)
        if not _internal_call and self.args.should_save and self.zenflow_optimizer is not None:
            self._write_model_card(output_dir if output_dir is not None else self.args.output_dir)

    def evaluate(self, *pargs: Any, **kwargs: Any) -> dict[str, float]:
        self._zenflow_synchronize()
        return super().evaluate(*pargs, **kwargs)

    def predict(self, *pargs: Any, **kwargs: Any):
        self._zenflow_synchronize()
        return super().predict(*pargs, **kwargs)

    def _finalize_training(self, trial, num_train_samples, start_time):
        # Close the open window and write every pending host result into the weights, so that the weights after
        # train() (save_model, push_to_hub, load_best_model_at_end comparisons) contain every gradient seen; then
        # stop the host worker, so that no thread outlives train() (a later train() starts a new one).
        opt = self.zenflow_optimizer
        if opt is not None:
            opt.flush()
            self._zenflow_training_threads = torch.get_num_threads()  # the split in use, for the model card
            opt.close()
        return super()._finalize_training(trial, num_train_samples, start_time)

    # -- telemetry ---------------------------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.zenflow_optimizer is not None:
            if "loss" in logs:  # a training log: the figures of the steps since the previous one
                logs.update(self._zenflow_telemetry.pop_interval())
            elif "train_loss" in logs:  # the end-of-training summary: whole-run figures
                logs.update(self._zenflow_telemetry.run_summary())
        super().log(logs, start_time)

    # -- model card --------------------------------------------------------------------------------------------------
    def _render_model_card(self, model_name: str | None = None, **kwargs: Any):
        return render_trainer_card(self, model_name, **kwargs)

    def _write_model_card(self, output_dir: str, **kwargs: Any) -> None:
        if not self.is_world_process_zero():
            return
        os.makedirs(output_dir, exist_ok=True)
        write_text(os.path.join(output_dir, "README.md"), str(self._render_model_card(**kwargs)))

    def create_model_card(self, language: str | None = None, license: str | None = None,
                          tags: str | list[str] | None = None, model_name: str | None = None,
                          finetuned_from: str | None = None, tasks: str | list[str] | None = None,
                          dataset_tags: str | list[str] | None = None, dataset: str | list[str] | None = None,
                          dataset_args: str | list[str] | None = None, dataset_name: str | None = None) -> None:
        """Write `args.output_dir/README.md`: a Hub model card with what the Trainer's own card carries (evaluation
        results, tasks, datasets) plus a ZenFlow section (settings and measured figures) and the `hf_zenflow` tag.
        Without ZenFlow, the Trainer's own card. `dataset_name` is trl's name for `dataset`."""
        dataset = dataset if dataset is not None else dataset_name
        if not getattr(self.args, "zenflow", False) and self.zenflow_optimizer is None:
            return Trainer.create_model_card(self, language=language, license=license, tags=tags,
                                             model_name=model_name, finetuned_from=finetuned_from, tasks=tasks,
                                             dataset_tags=dataset_tags, dataset=dataset, dataset_args=dataset_args)
        self._write_model_card(self.args.output_dir, language=language, license=license, tags=tags,
                               model_name=model_name, finetuned_from=finetuned_from, tasks=tasks,
                               dataset_tags=dataset_tags, dataset=dataset, dataset_args=dataset_args)
