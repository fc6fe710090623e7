"""accelerate's ``save_state`` / ``load_state`` with one optimizer file per rank (`rank_checkpoint`), as the Trainer.

Under DDP a `ZenFlowAdamW` state dict holds the rank's share of the host state, but ``Accelerator.save_state`` writes
``optimizer.bin`` from the main process only, and ``load_state`` loads that file into every rank (which the engine
refuses on rank >= 1). accelerate's hooks receive the models and the folder but not the optimizers, so the optimizer
that accelerate holds is a `RankFileOptimizer`: the `AcceleratedOptimizer` that ``prepare`` would make, plus

- a save pre-hook (`save_rank_files`): every rank writes its ``zenflow_optimizer_rank{r}_of_{N}.pt``
  (`rank_checkpoint.save_rank_state`, the Trainer's code), all ranks wait for each other, and the optimizer's next
  ``state_dict()`` (the one accelerate's ``save_accelerator_state`` takes right after the hooks) returns a pointer
  (`rank_checkpoint.rank_files_pointer`) instead of a second copy of the state, which becomes ``optimizer.bin``;
- a load pre-hook that notes the folder; when accelerate then loads ``optimizer.bin`` and hands the pointer to
  ``load_state_dict``, the rank's own file is loaded instead (`rank_checkpoint.load_rank_state`: another world size is
  refused naming both). A one-process ``optimizer.bin`` is a real state dict and loads on every rank (each takes its
  share).

No accelerate code is patched: the subclass goes in through ``prepare_optimizer``'s "already prepared" path.

Under FSDP2 the hooks do the whole job (`prepare_rank_file_optimizer`). accelerate's FSDP ``save_state`` /
``load_state`` send every optimizer they hold through torch DCP (``save_fsdp_optimizer``), whose
``get_optimizer_state_dict`` keeps only per-parameter ``state`` and ``param_groups`` (ZenFlow's own block would be
lost) and first "initialises" an optimizer whose torch ``state`` dict is empty, as ZenFlow's always is, with a real
``step()`` on zero gradients (tried: a run that saved counted 13 ZenFlow steps of 12 and left the unsaved run's
path). accelerate has no per-optimizer opt-out, so after ``prepare`` the optimizer is removed from
``accelerator._optimizers``, the one private attribute touched: the list those checkpoints walk. Elsewhere it is
read only for fp8 and LOMO setups, to match a scheduler to its optimizer (a scheduler built on this optimizer never
matched it, so it steps the same), and for fp16 by ``unscale_gradients()`` without an argument (pass the optimizer,
as the example in `accelerate_plugin` does) and ``optimizer_step_was_skipped`` (which never reports a ZenFlow step
skipped anyway: the GradScaler always calls its ``step()``, `hf_zenflow.engine.amp`). Every rank writes its file in the
save pre-hook (also under one process: the state is in DTensor shards) and loads it in the load pre-hook.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate.optimizer import AcceleratedOptimizer

from ..checkpoint.format import CheckpointError
from .rank_checkpoint import (
    ACCELERATE_OPTIMIZER_NAME,
    is_rank_files_pointer,
    load_rank_state,
    rank_file_name,
    rank_files_pointer,
    save_rank_state,
)


class RankFileOptimizer(AcceleratedOptimizer):
    """An `AcceleratedOptimizer` whose ``accelerator.save_state`` / ``load_state`` go through per-rank files."""

    def __init__(self, optimizer: Any, scaler: Any = None, hooks_only: bool = False) -> None:
        # device_placement=False: it would round-trip the (empty) state through state_dict/load_state_dict onto the
        # device; ZenFlowAdamW places its own state (host side on the host).
        super().__init__(optimizer, device_placement=False, scaler=scaler)
        #: FSDP2: accelerate does not checkpoint this optimizer at all, the pre-hooks save and load its rank files
        self.hooks_only = hooks_only
        self._pointer_next = False  # set by the save pre-hook, for accelerate's state_dict() call right after it
        self._loading_from: str | None = None

    @property
    def _ranks(self) -> tuple[int, int]:
        return self.accelerator_state.process_index, self.accelerator_state.num_processes

    def save_rank_files(self, _models: Any, _weights: Any, output_dir: str) -> None:
        """Save pre-hook: this rank's file; under one process nothing (accelerate's ``optimizer.bin`` is whole)."""
        rank, world_size = self._ranks
        if world_size <= 1 and not self.hooks_only:
            return
        save_rank_state(self.optimizer, output_dir, rank, world_size)
        # When save_state returns on any rank, every rank's file is on disk.
        self.accelerator_state.wait_for_everyone()
        self._pointer_next = not self.hooks_only  # under FSDP2 accelerate takes no state_dict() to replace

    def note_load_folder(self, _models: Any, input_dir: str) -> None:
        """Load pre-hook: note the folder for ``load_state_dict``; under FSDP2 load this rank's file now."""
        if not self.hooks_only:
            self._loading_from = input_dir
            return
        rank, world_size = self._ranks
        state = load_rank_state(input_dir, rank, world_size)
        if state is None:
            raise CheckpointError(f"{input_dir}: no ZenFlow optimizer file ({rank_file_name(rank, world_size)}): "
                                  "under FSDP2, ZenFlowPlugin's save_state writes one per rank. Resume from a folder "
                                  "that accelerator.save_state wrote with the plugin's optimizer prepared.")
        self.optimizer.load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        if self._pointer_next:
            self._pointer_next = False
            return rank_files_pointer(self._ranks[1])
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        folder, self._loading_from = self._loading_from, None
        if is_rank_files_pointer(state_dict):
            if folder is None:
                raise CheckpointError("this optimizer state is a pointer to per-rank files (the optimizer.bin of a "
                                      "several-process accelerate checkpoint): load it with accelerator.load_state.")
            rank, world_size = self._ranks
            loaded = load_rank_state(folder, rank, world_size, one_process_name=ACCELERATE_OPTIMIZER_NAME)
            assert loaded is not None  # the pointer is in the folder: load_rank_state returned a state or raised
            state_dict = loaded
        super().load_state_dict(state_dict)

    def step(self, closure: Any = None) -> Any:
        self._pointer_next = False  # a save_state that failed after its hooks must not leave the pointer armed
        return super().step(closure)


def prepare_rank_file_optimizer(accelerator: Any, model: torch.nn.Module,
                                optimizer: Any) -> tuple[torch.nn.Module, RankFileOptimizer]:
    """``accelerator.prepare_optimizer`` for a `ZenFlowAdamW` over `model`, with the hooks of per-rank checkpoint
    files; returns ``(model, optimizer)``. Under FSDP2: ``accelerator.prepare(model, optimizer)``, which shards the
    model and swaps the shards into the optimizer, and the optimizer is left out of accelerate's checkpoints (see
    the module docstring)."""
    fsdp2 = bool(getattr(accelerator, "is_fsdp2", False))
    wrapped = RankFileOptimizer(optimizer, scaler=accelerator.scaler, hooks_only=fsdp2)
    wrapped._is_accelerate_prepared = True  # what accelerate's own prepare() sets: it takes the object as it is
    if fsdp2:
        model, prepared = accelerator.prepare(model, wrapped)
        accelerator._optimizers.remove(prepared)  # no DCP save/load of it: the hooks below write and read its files
    else:
        prepared = accelerator.prepare_optimizer(wrapped)
    accelerator.register_save_state_pre_hook(wrapped.save_rank_files)
    accelerator.register_load_state_pre_hook(wrapped.note_load_folder)
    return model, prepared
