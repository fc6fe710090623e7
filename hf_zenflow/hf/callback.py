"""`ZenFlowCallback`: what `ZenFlowTrainer` does around a `ZenFlowAdamW`, for any other Trainer given one through
`optimizers=(ZenFlowAdamW(...), None)` (a plain `Trainer`, trl's `SFTTrainer`, ...).

Without it nothing would call `synchronize()`, `flush()` or `close()`: after `train()` the last window's host
updates would be missing from the weights (and from the saved model), and the host worker would outlive `train()`.
Forgotten, the first training step fails: `ZenFlowAdamW.train()`, which the Trainer calls before each step, refuses
to run for an optimizer nothing drains (`ZenFlowAdamW.drained_by`), naming the callback.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from ..engine.worker import wait_for_closed_workers
from ..optimizer.zenflow import ZenFlowAdamW
from .resume import check_resumed_optimizer
from .unwrap import unwrap_zenflow_optimizer


class ZenFlowCallback(TrainerCallback):
    """Drains a `ZenFlowAdamW` at the points `ZenFlowTrainer` does: before a checkpoint and an evaluation it waits
    for the host worker (the checkpoint then holds a consistent optimizer state, pending host results included, so
    a resumed run continues exactly); at the end of training it flushes the open window into the weights and stops
    the worker thread (a later `train()` starts a new one).

    Example:
        >>> from transformers import Trainer
        >>> from hf_zenflow import ZenFlowAdamW
        >>> from hf_zenflow.hf.callback import ZenFlowCallback
        >>> opt = ZenFlowAdamW(model.parameters(), lr=1e-4)  # doctest: +SKIP
        >>> trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None),
        ...                   callbacks=[ZenFlowCallback()])  # doctest: +SKIP
    """

    def __init__(self, optimizer: ZenFlowAdamW | None = None) -> None:
        self._optimizer = optimizer

    def _zenflow(self, kwargs: dict[str, Any]) -> ZenFlowAdamW | None:
        # The Trainer hands every event its optimizer (possibly accelerate's wrapper around ours).
        return unwrap_zenflow_optimizer(kwargs.get("optimizer")) or self._optimizer

    def on_train_begin(self, args, state, control, **kwargs):
        opt = self._zenflow(kwargs)
        if opt is not None:
            self._optimizer = opt
            opt.drained_by = type(self).__name__  # (before the first step's `optimizer.train()`, which checks it)
            if state.global_step > 0:
                # a resume (the Trainer has loaded trainer_state.json and then the optimizer file): the two must be
                # of the same save. (A fresh TrainerState starts at 0: an optimizer state loaded by hand before a
                # new run is the caller's.)
                check_resumed_optimizer(opt.loaded_progress, state.global_step,
                                        f"{type(self).__name__}: the optimizer file resumed from")
            opt.loaded_progress = None  # (compared once)

    def on_step_end(self, args, state, control, **kwargs):
        # Runs after DefaultFlowCallback (first in the list) has decided this step's save / evaluation, and before
        # the Trainer does them: the state_dict must not be taken, nor the weights read, while the worker writes.
        return self._drain_before_save_or_evaluation(control, kwargs)

    def on_epoch_end(self, args, state, control, **kwargs):
        # save_strategy / eval_strategy "epoch": decided here, done right after
        return self._drain_before_save_or_evaluation(control, kwargs)

    def _drain_before_save_or_evaluation(self, control, kwargs: dict[str, Any]):
        if control.should_save or control.should_evaluate:
            opt = self._zenflow(kwargs)
            if opt is not None:
                opt.synchronize()
                wait_for_closed_workers()
        return control

    def on_train_end(self, args, state, control, **kwargs):
        opt = self._zenflow(kwargs)
        if opt is None:
            return control
        # With load_best_model_at_end the weights are the best checkpoint's by now: flush() notices weights changed
        # from outside and re-reads its masters from them (weight_marks) instead of writing the discarded
        # trajectory's open window into them.
        opt.flush()
        opt.close()  # no thread outlives train()
        return control
