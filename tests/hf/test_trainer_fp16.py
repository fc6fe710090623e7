"""`ZenFlowTrainer` with ``--fp16`` and `ZenFlowPlugin` with ``mixed_precision="fp16"``: the GradScaler that the
Trainer or the loop drives (unscale_, clip, step, update; overflowed steps skipped), against torch's optimizer under
the same scaler, and resumed mid-window.

The reference is ``adamw_torch_fused``: like `ZenFlowAdamW` it takes the scaler's ``grad_scale`` / ``found_inf``
(``_step_supports_amp_scaling``), so the scaler always calls its ``step()``. accelerate detects a skipped step by
``step()`` not being called, so for both it reports none and the Trainer's LR schedule also advances on an
overflowed step (with ``adamw_torch`` it does not).

On a CPU, accelerate makes fp16 a no-op: it builds no GradScaler and no autocast for a CPU device (its
`Accelerator.__init__` only does so for GPU-like devices), so ``--fp16`` alone would train in fp32 here. These
tests give the Trainer's accelerator, before training, what it builds on a GPU: native AMP (the forward under fp16
autocast) and a `torch.amp.GradScaler`, for the CPU.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hf_helpers import logged, tiny_llama, zenflow_args
from transformers import Trainer

from hf_zenflow import ZenFlowTrainer


#: torch's default first scale: high enough that the first steps overflow in fp16 and are skipped
INIT_SCALE = 2.0**16


def with_gpu_grad_scaler(trainer: Trainer) -> Trainer:
    accelerator = trainer.accelerator
    assert accelerator.mixed_precision == "fp16" and accelerator.scaler is None  # the CPU no-op described above
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=4)
    return trainer


class GroupOrderTrainer(Trainer):
    """The reference: a plain Trainer whose gradient norm (clipped or only measured) sums over the optimizer's
    param groups in order, as `ZenFlowAdamW.clip_grad_norm_` does, instead of over ``model.parameters()``: the
    summation order changes the last bit of the norm, which fp16 training amplifies over a few steps."""

    def _group_order(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _clip_grad_norm(self, model):
        return self.accelerator.clip_grad_norm_(self._group_order(), self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            grad_norm = self.accelerator.clip_grad_norm_(self._group_order(), float("inf"))
        return grad_norm


def fp16_run(tmp_path, train_dataset, name, zenflow=True, model=None, resume=None, **overrides) -> Trainer:
    args = zenflow_args(tmp_path / name, fp16=True, zenflow=zenflow, **overrides)
    cls = ZenFlowTrainer if zenflow else GroupOrderTrainer
    trainer = with_gpu_grad_scaler(cls(model=model if model is not None else tiny_llama(), args=args,
                                       train_dataset=train_dataset))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0], ids=["clip", "no-clip"])
def test_fp16_topk_ratio_1_reproduces_adamw_torch_under_the_same_scaler(tmp_path, train_dataset, max_grad_norm):
    common = dict(max_steps=16, weight_decay=0.01, max_grad_norm=max_grad_norm)
    ref = fp16_run(tmp_path, train_dataset, "reference", zenflow=False, optim="adamw_torch_fused", **common)
    # zenflow_layout="row": the CPU default (column-major Linear weights) rounds fp16 autocast matmuls differently
    zen = fp16_run(tmp_path, train_dataset, "zenflow", zenflow_topk_ratio=1.0, zenflow_layout="row", **common)
    norms = logged(ref, "grad_norm")
    assert not all(map(math.isfinite, norms))  # some step overflowed (the scale grows every 4 steps)...
    assert zen.zenflow_optimizer.stats()["skipped_steps"] == len(norms) - sum(map(math.isfinite, norms))  # ...skipped
    assert zen.accelerator.scaler.get_scale() == ref.accelerator.scaler.get_scale()
    assert logged(zen, "learning_rate") == logged(ref, "learning_rate")
    # bit for bit: the norms are the hooks' norms of the scaled gradients times 1 / scale (a power of two: exact),
    # and topk_ratio=1.0 updates every column with torch's fused AdamW kernel
    assert logged(zen) == logged(ref)
    assert logged(zen, "grad_norm") == norms
    assert logged(zen)[-1] < logged(zen)[0] - 0.5  # it trains


def test_fp16_resume_mid_window_continues_exactly(tmp_path, train_dataset):
    common = dict(max_steps=12, zenflow_update_interval=4)
    full = fp16_run(tmp_path, train_dataset, "full", save_strategy="steps", save_steps=6, **common)
    checkpoint = tmp_path / "full" / "checkpoint-6"
    assert (checkpoint / "scaler.pt").is_file()
    resumed = fp16_run(tmp_path, train_dataset, "resumed", model=tiny_llama(seed=123), resume=str(checkpoint),
                       **common)
    assert resumed.state.global_step == 12
    assert logged(resumed)[6:] == logged(full)[6:]  # bit for bit
    assert resumed.accelerator.scaler.get_scale() == full.accelerator.scaler.get_scale()
    full_w, resumed_w = full.model.state_dict(), resumed.model.state_dict()
    for name in full_w:
        assert torch.equal(full_w[name], resumed_w[name]), name


def test_plugin_fp16_loop_reproduces_fused_adamw_under_the_same_scaler():
    """A plain accelerate loop with ``mixed_precision="fp16"`` (the scaler given as on a GPU): ZenFlowPlugin's
    optimizer at topk_ratio=1.0 against torch's fused AdamW, both unscaled before clipping."""
    from accelerate import Accelerator
    from hf_helpers import ByteLMDataset, corpus_text

    from hf_zenflow import ZenFlowPlugin
    from hf_zenflow.hf.accelerate_plugin import decay_parameter_groups

    data = ByteLMDataset(corpus_text(), num_samples=64)
    batches = [{k: torch.stack([data[i][k] for i in range(s * 4, s * 4 + 4)]) for k in data[0]} for s in range(16)]

    def loop(prepare) -> tuple[list[float], list[float], float]:
        accelerator = with_gpu_grad_scaler(SimpleNamespace(accelerator=Accelerator(cpu=True, mixed_precision="fp16"))
                                           ).accelerator
        model, optimizer = prepare(accelerator)
        inner = optimizer.optimizer
        params = [p for group in inner.param_groups for p in group["params"]]
        losses, norms = [], []
        for batch in batches:
            loss = model(**batch).loss
            accelerator.backward(loss)
            accelerator.unscale_gradients(optimizer)
            clip = getattr(inner, "clip_grad_norm_", None)
            norms.append((clip(1.0) if clip else torch.nn.utils.clip_grad_norm_(params, 1.0)).item())
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses, norms, accelerator.scaler.get_scale()

    def fused_adamw(accelerator):
        model = tiny_llama()
        groups = decay_parameter_groups(model, 0.0)  # the plugin's groups: the same order of the norm's sum
        return accelerator.prepare(model, torch.optim.AdamW(groups, lr=3e-3, weight_decay=0.0, fused=True))

    ref = loop(fused_adamw)
    zen = loop(lambda acc: ZenFlowPlugin(topk_ratio=1.0, cpu_threads=1).prepare(acc, tiny_llama(), lr=3e-3,
                                                                               weight_decay=0.0))
    assert not all(map(math.isfinite, ref[1]))  # an overflow was skipped on the way
    assert zen == ref  # losses, norms and the final scale, bit for bit
