"""`unwrap_zenflow_optimizer`: the one helper the Trainer, its telemetry callback and `ZenFlowPlugin` use to reach
the `ZenFlowAdamW` behind accelerate's `AcceleratedOptimizer`."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer

import hf_zenflow.hf.accelerate_plugin as accelerate_plugin
import hf_zenflow.hf.trainer as trainer
import hf_zenflow.hf.trainer_telemetry as trainer_telemetry
from hf_zenflow import ZenFlowAdamW
from hf_zenflow.hf.unwrap import MAX_WRAPPERS, unwrap_zenflow_optimizer


def test_unwraps_accelerated_optimizers_and_nothing_else() -> None:
    accelerator = Accelerator(cpu=True)
    opt = ZenFlowAdamW([torch.nn.Parameter(torch.zeros(8, 8))], lr=1e-3)
    try:
        accelerated = accelerator.prepare_optimizer(opt, device_placement=False)
        assert isinstance(accelerated, AcceleratedOptimizer) and accelerated is not opt
        assert unwrap_zenflow_optimizer(opt) is opt
        assert unwrap_zenflow_optimizer(accelerated) is opt
        assert unwrap_zenflow_optimizer(AcceleratedOptimizer(accelerated, device_placement=False)) is opt
    finally:
        opt.close()
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    assert unwrap_zenflow_optimizer(sgd) is None
    assert unwrap_zenflow_optimizer(accelerator.prepare_optimizer(sgd, device_placement=False)) is None
    assert unwrap_zenflow_optimizer(None) is None


def test_gives_up_on_long_chains_and_cycles() -> None:
    opt = ZenFlowAdamW([torch.nn.Parameter(torch.zeros(8, 8))], lr=1e-3)
    chain = opt
    for _ in range(MAX_WRAPPERS):
        chain = SimpleNamespace(optimizer=chain)
    assert unwrap_zenflow_optimizer(chain) is opt  # MAX_WRAPPERS links are followed
    assert unwrap_zenflow_optimizer(SimpleNamespace(optimizer=chain)) is None  # one more is not
    cycle = SimpleNamespace()
    cycle.optimizer = cycle
    assert unwrap_zenflow_optimizer(cycle) is None  # returns instead of looping


def test_trainer_and_plugin_share_the_helper() -> None:
    assert trainer.unwrap_zenflow_optimizer is accelerate_plugin.unwrap_zenflow_optimizer is unwrap_zenflow_optimizer
    assert trainer_telemetry.unwrap_zenflow_optimizer is unwrap_zenflow_optimizer  # the telemetry callback's
