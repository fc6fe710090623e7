"""Shared fixtures: tiny in-file models and a deterministic training loop (no downloads)."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import math
import os
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from deprecation_guard import no_deprecated_calls_from_our_code

from hf_zenflow import ZenFlowAdamW, ZenFlowConfig
from hf_zenflow.settings.rules import split_rules


class TinyNet(torch.nn.Module):
    """Embedding + two matrices + a norm and biases: every parameter kind the optimizer distinguishes."""

    def __init__(self, vocab: int = 24, width: int = 40, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width, dtype=dtype)
        self.up = torch.nn.Linear(width, 2 * width, dtype=dtype)
        self.norm = torch.nn.LayerNorm(2 * width, dtype=dtype)
        self.down = torch.nn.Linear(2 * width, vocab, bias=False, dtype=dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(torch.nn.functional.gelu(self.up(self.embed(tokens)))))


#: The device the reference tests train on: "cpu" in CI; `scripts/gpu_check.sh` runs them with "cuda".
DEVICE = torch.device(os.environ.get("HF_ZENFLOW_TEST_DEVICE", "cpu"))
#: Host moments in fp32, for the tests whose reference is AdamW with fp32 moments (torch's AdamW, synchronous
#: offload, an fp32 checkpoint's continuation): the default stores the host moments in bf16.
FP32_MOMENTS = {"host_state": "fp32"}


def zenflow_config(config: ZenFlowConfig | None = None, **values: Any) -> ZenFlowConfig:
    """`config` (default: `ZenFlowConfig()`) with `values` applied: the settings among them as settings, the engine
    rules (`EngineRules`) through `with_rules`, so that a test names what it fixes in one place."""
    settings, rules = split_rules(values)
    return (config if config is not None else ZenFlowConfig()).replace(**settings).with_rules(**rules)


def zenflow_adamw(params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                  weight_decay: float = 1e-2, *, config: ZenFlowConfig | None = None, host_executor: str = "thread",
                  process_group: Any = None, **values: Any) -> ZenFlowAdamW:
    """`ZenFlowAdamW` whose keyword arguments may name engine rules beside the settings (`zenflow_config`)."""
    return ZenFlowAdamW(params, lr, betas, eps, weight_decay, config=zenflow_config(config, **values),
                        host_executor=host_executor, process_group=process_group)


def plan_with_host_ram(monkeypatch: pytest.MonkeyPatch, nbytes: float | None) -> None:
    """The host RAM the planner sees for the host state (`hf_zenflow.engine.planner.host_room`), fixed for a test:
    where it is short for host window sums, ``accumulate_on="auto"`` takes device sums when they fit the device."""
    monkeypatch.setattr("hf_zenflow.engine.planner.host_room", lambda: nbytes)


def step_peak(settings: dict) -> int:
    """The peak of a step of `make_model()` under `settings` (with ``accumulate_on="auto"``) that the planner takes
    from a `device_memory_limit_bytes`: the larger of the peak measured when it decides and the estimated one beside
    the window sums (`HostWindows._decide`); the limit less this is the room device sums must fit in. Read off the
    planner's own input in one step under a limit far above the model."""
    import hf_zenflow.engine.windows as windows

    seen: list[int] = []
    plan = windows.plan_accumulation

    def recording(config, sizes, *args):  # noqa: ANN001, ANN002, ANN202
        seen.append(sizes.peak)
        return plan(config, sizes, *args)

    windows.plan_accumulation = recording
    try:
        model = make_model()
        opt = zenflow_adamw(param_groups(model), lr=1e-2,
                            **{**settings, "accumulate_on": "auto", "device_memory_limit_bytes": 1 << 40})
        train(model, opt, batches(1))
        opt.close()
    finally:
        windows.plan_accumulation = plan
    (peak,) = seen
    return peak


def smallest_limit_that_fits(settings: dict, need: int) -> int:
    """The smallest `device_memory_limit_bytes` under which `need` bytes (device sums, the selected columns' state,
    the gradients device sums keep) fit beside a step under `settings` with the planner's margin (its rule,
    `planner.plan_accumulation`: ``need <= limit - step_peak - MARGIN * limit``)."""
    from hf_zenflow.engine.accumulation import MARGIN

    peak = step_peak(settings)
    limit = math.floor((need + peak) / (1 - MARGIN))
    while not need <= limit - peak - MARGIN * limit:
        limit += 1
    assert not need <= (limit - 1) - peak - MARGIN * (limit - 1)
    return limit


def assert_same_across_devices(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """`ours` (computed by the host's AdamW) equals `theirs` (torch's AdamW on `DEVICE`): bit for bit when the device
    is the CPU (the same kernel on the same numbers); on CUDA within fp32 rounding, because CUDA's fused AdamW is
    not bit-identical to the CPU kernel (other instruction order, fused multiply-adds)."""
    if DEVICE.type == "cpu":
        assert torch.equal(ours, theirs)
    else:
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


def load_script(name: str) -> types.ModuleType:
    """The module of ``scripts/<name>.py`` (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet(dtype=dtype).to(DEVICE)


def param_groups(model: torch.nn.Module) -> list[dict]:
    """Two groups as the HF Trainer builds them: weight decay on matrices, none on biases and norms."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def batches(n: int, seed: int = 1, vocab: int = 24) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (8, 6), generator=g), torch.randint(0, vocab, (8, 6), generator=g))
            for _ in range(n)]


def train(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    sched: torch.optim.lr_scheduler.LRScheduler | None = None,
    clip: float | None = None,
    hook: Callable[[int], None] | None = None,
) -> list[float]:
    losses = []
    device = next(model.parameters()).device
    for i, (x, y) in enumerate(data):
        x, y = x.to(device), y.to(device)
        logits = model(x).float()
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
        loss.backward()
        if hook is not None:
            hook(i)
        finish_step(model, opt, clip, sched)
        losses.append(loss.item())
    return losses


def finish_step(model: torch.nn.Module, opt: torch.optim.Optimizer, clip: float | None,
                sched: torch.optim.lr_scheduler.LRScheduler | None = None) -> None:
    """After backward: clip (the optimizer's own `clip_grad_norm_` where it has one), step, zero the gradients and
    step the scheduler."""
    if clip is not None:
        if hasattr(opt, "clip_grad_norm_"):
            opt.clip_grad_norm_(clip)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad()
    if sched is not None:
        sched.step()


def linear_schedule(opt: torch.optim.Optimizer, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1.0 - s / total))


def max_rel_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(((p.detach().float() - q.detach().float()).norm() / q.detach().float().norm().clamp_min(1e-12)).item()
               for p, q in zip(a.parameters(), b.parameters()))


def roundtrip(state: dict) -> dict:
    """Serialise and load back the way the HF Trainer does (weights_only=True)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.fixture(autouse=True)
def _deterministic_threads():
    """One intra-op thread for the training thread in every test: results then depend neither on the machine's
    cores nor on the split a background ZenFlow worker applies to an untouched pool (docs/threads.md), which
    would give a ZenFlow run (worker) and its reference run (none) different forward/backward bits."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="session")
def _no_deprecated_calls_from_our_code():
    """A deprecated third-party API called from hf_zenflow/, tests/ or scripts/ fails the test (deprecation_guard)."""
    with no_deprecated_calls_from_our_code():
        yield


#: "on": every optimizer of the tests frees its gradients in backward where it applies (the rule
#: `free_gradients_in_backward` left at "auto" becomes "on"), so that the reference tests run in both modes:
#: ``HF_ZENFLOW_TEST_FREE_GRADIENTS=on``.
FREE_GRADIENTS = os.environ.get("HF_ZENFLOW_TEST_FREE_GRADIENTS", "auto")
FREE_GRADIENTS_IN_RANKS = "HF_ZENFLOW_TEST_FREE_GRADIENTS_IN_RANKS"


@pytest.fixture(autouse=True)
def _free_gradients_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if FREE_GRADIENTS != "on" or "tests/hf" in str(request.node.fspath).replace(os.sep, "/"):
        return  # (the settings' own tests check the true default)
    from hf_zenflow.settings.config import ZenFlowConfig

    monkeypatch.setenv(FREE_GRADIENTS_IN_RANKS, "on")  # (the rank processes a test spawns: `gloo_ranks.init_ranks`)
    original = ZenFlowConfig.__post_init__

    def post_init(self: ZenFlowConfig) -> None:
        original(self)
        if self.rules.free_gradients_in_backward == "auto":
            self.rules = dataclasses.replace(self.rules, free_gradients_in_backward="on")

    monkeypatch.setattr(ZenFlowConfig, "__post_init__", post_init)
