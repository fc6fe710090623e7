"""Gradients freed in backward (`free_gradients_in_backward`) and the device memory they save (`device_memory.py`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from hf_zenflow import SyncOffloadAdamW, ZenFlowAdamW
from hf_zenflow.engine import accumulation
from hf_zenflow.engine.device_memory import DeviceMemoryMeter
from hf_zenflow.engine.schedule import StepKind
from hf_zenflow.transport import CopyTransport
from tests.conftest import (
    DEVICE,
    FREE_GRADIENTS,
    batches,
    make_model,
    param_groups,
    plan_with_host_ram,
    smallest_limit_that_fits,
    zenflow_adamw,
)


SETTINGS = dict(topk_ratio=0.1, update_interval=4, select_strategy="step", select_interval=5, min_offload_numel=0,
                accumulate_on="host")


def _run(free: str, dtype: torch.dtype = torch.float32, micro_batches: int = 1, clip: float | None = 0.5,
         steps: int = 12, transport: type | None = None, monkeypatch: pytest.MonkeyPatch | None = None,
         forward: Callable[[torch.nn.Module], Callable] = lambda model: model,
         **settings: object) -> tuple[list[torch.Tensor], list[float], list[float]]:
    """`forward`: what the model's forward runs through (e.g. `torch.compile`)."""
    if transport is not None:
        monkeypatch.setattr("hf_zenflow.transport.transport_for", lambda device: transport())
    model = make_model(dtype=dtype)
    opt = zenflow_adamw(param_groups(model), lr=1e-2, **{**SETTINGS, **settings}, free_gradients_in_backward=free)
    peaks, losses = [], []
    data = batches(steps * micro_batches)
    run_forward = forward(model)
    for i in range(steps):
        for x, y in data[i * micro_batches:(i + 1) * micro_batches]:
            logits = run_forward(x.to(DEVICE)).float()
            loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.to(DEVICE).view(-1))
            loss.backward()
            losses.append(loss.item())
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
        peaks.append(opt.stats()["step_peak_device_bytes"])
    opt.flush()
    weights = [p.detach().clone() for p in model.parameters()]
    opt.close()
    return weights, losses, peaks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("micro_batches", [1, 3])
def test_freeing_in_backward_changes_no_arithmetic(dtype, micro_batches):
    """The same run with the gradients freed in backward and without: bit for bit, the first step (its state made in
    the hooks), re-selections (scores from the hooks, the new columns from the host copies) and micro-batches of a
    plain loop (a freed gradient comes back and is added to) included; and every step's peak is lower."""
    kept, kept_losses, kept_peaks = _run("off", dtype, micro_batches)
    freed, freed_losses, freed_peaks = _run("on", dtype, micro_batches)
    assert kept_losses == freed_losses
    for a, b in zip(kept, freed):
        assert torch.equal(a, b)
    assert all(f < k for f, k in zip(freed_peaks, kept_peaks))  # (steps 0, 5, 10 select: freed too)


def test_freeing_with_staged_copies_changes_no_arithmetic(monkeypatch):
    """The copying transport (what CUDA does, with synchronous copies): the hook copies into the slot's staging
    buffer, the device gradient goes, the worker reads the copy; a second micro-batch brings it back."""
    kept, kept_losses, _ = _run("off", micro_batches=2, transport=CopyTransport, monkeypatch=monkeypatch)
    freed, freed_losses, _ = _run("on", micro_batches=2, transport=CopyTransport, monkeypatch=monkeypatch)
    assert kept_losses == freed_losses
    for a, b in zip(kept, freed):
        assert torch.equal(a, b)


@pytest.mark.skipif(FREE_GRADIENTS == "on", reason='"auto" is "on" in this mode')
def test_auto_frees_only_when_clipping_goes_through_the_optimizer():
    """"auto": a plain loop that clips with torch's function over the model would miss freed gradients, so nothing
    is freed until the optimizer's own `clip_grad_norm_` is used."""
    _, _, no_clip = _run("auto", clip=None, steps=4)
    _, _, kept = _run("off", clip=None, steps=4)
    _, _, clipped = _run("auto", clip=0.5, steps=4)
    assert no_clip == kept
    assert clipped[0] == kept[0]  # (the first step: not yet known that clipping goes through the optimizer)
    assert all(c < k for c, k in zip(clipped[1:], kept[1:]))


@pytest.mark.parametrize("freed_for", [StepKind.SELECT, StepKind.ORDINARY, StepKind.WARM_UP])
def test_a_step_of_another_kind_brings_the_freed_gradients_back_exactly(freed_for, monkeypatch):
    """The hooks freed the gradients for one kind of step and the step is of another (a resume, a setting changed
    between backward and step()): they come back from the host, and the clip measured on them still holds."""
    kept, kept_losses, _ = _run("off")
    monkeypatch.setattr(ZenFlowAdamW, "_frees_next_step", lambda self: freed_for)
    freed, freed_losses, _ = _run("on")
    assert kept_losses == freed_losses
    for a, b in zip(kept, freed):
        assert torch.equal(a, b)


def test_auto_counts_the_freed_gradients_against_device_sums(monkeypatch):
    """accumulate_on="auto" with the gradients freed in backward and the host short for host sums: device sums would
    keep every offloaded gradient on the device until step(), so a limit whose room beside the step fits the sums and
    selected columns alone chooses host sums (which free them), and one larger by the gradients' bytes chooses
    device sums."""
    plan_with_host_ram(monkeypatch, 0)  # (no host option fits: the device sums that fit the device are taken)
    # (fp32 host sums of every column with a write-back buffer: the largest host state, so that the host's overflow
    # does not rank host sums first)
    fp32_sums = dict(host_sum_dtype="float32", host_sum_columns="all", host_writeback="buffer")
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=1e-2, **{**SETTINGS, "accumulate_on": "device"})
    x, y = batches(1)[0]
    logits = model(x.to(DEVICE)).float()
    torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.to(DEVICE).view(-1)).backward()
    opt.step()
    splits = [s for s in opt.engine_state.splits.values() if s.host is not None]
    need = accumulation.device_bytes_needed(splits, {id(s): s.share for s in splits}, 4)
    grads = sum(s.param.numel() * s.param.element_size() for s in splits)
    opt.close()
    freeing = {**SETTINGS, **fp32_sums, "accumulate_on": "auto", "free_gradients_in_backward": "on"}
    roomy = smallest_limit_that_fits(freeing, need + grads)
    tight = smallest_limit_that_fits(freeing, need)
    chosen = {}
    for limit in (tight, roomy):
        model = make_model()
        opt = zenflow_adamw(param_groups(model), lr=1e-2, **freeing, device_memory_limit_bytes=limit)
        logits = model(x.to(DEVICE)).float()
        torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.to(DEVICE).view(-1)).backward()
        opt.step()
        chosen[limit] = opt.stats()["accumulate_on"]
        opt.close()
    assert chosen[tight] != "device" and chosen[roomy] == "device"


def test_meter_counts_weights_gradients_and_state_exactly():
    """torch's AdamW on one Linear: the peak is weights + gradients + (exp_avg, exp_avg_sq, step) bytes."""
    lin = torch.nn.Linear(64, 32)
    opt = torch.optim.AdamW(lin.parameters())
    meter = DeviceMemoryMeter(lin.parameters(), lambda: sum(
        v.numel() * v.element_size() for s in opt.state.values() for v in s.values()), watch=True)
    for _ in range(2):
        lin(torch.randn(4, 64)).sum().backward()
        opt.step()
        meter.finish_step()
        opt.zero_grad()
    n = sum(p.numel() for p in lin.parameters())
    assert meter.peak_bytes == 4 * n + 4 * n + 8 * n + 2 * 4  # weights, grads, two moments, two step counters
    meter.remove()


class FakeCudaMemory:
    """The caching allocator's statistics as `torch.cuda` reports them: the bytes allocated now, and their peak since
    the last `reset_peak_memory_stats`, which sets the peak to the bytes allocated now."""

    def __init__(self, allocated: int) -> None:
        self.allocated = self.peak = allocated

    def run(self, nbytes: int) -> None:
        """A step's forward and backward: `nbytes` of activations allocated at once, then freed."""
        self.peak = max(self.peak, self.allocated + nbytes)

    def max_memory_allocated(self, device: torch.device | None = None) -> int:
        return self.peak

    def reset_peak_memory_stats(self, device: torch.device | None = None) -> None:
        self.peak = self.allocated


def test_the_cuda_step_peak_is_each_steps_own(monkeypatch):
    """On CUDA the meter reads the caching allocator's peak (`torch.cuda.max_memory_allocated`): it starts afresh
    after each step (`torch.cuda.reset_peak_memory_stats`), so ``step_peak_device_bytes`` is that step's peak and
    ``peak_device_bytes`` the run's (before, the allocator's peak was never reset: every step's peak read the run's,
    the largest step's forever after)."""
    fake = FakeCudaMemory(allocated=1000)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", fake.max_memory_allocated)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset_peak_memory_stats)
    monkeypatch.setattr(DeviceMemoryMeter, "_cuda_device", lambda self: torch.device("cuda", 0))
    lin = torch.nn.Linear(8, 8)
    meter = DeviceMemoryMeter(lin.parameters(), lambda: 0)
    seen = []
    for activations in (500, 100, 300, 0):
        fake.run(activations)
        meter.finish_step()
        seen.append((meter.step_peak_bytes, meter.peak_bytes))
    assert seen == [(1500, 1500), (1100, 1500), (1300, 1500), (1000, 1500)]


def _llama(hidden: int, layers: int, vocab: int) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    LlamaConfig, LlamaForCausalLM = transformers.LlamaConfig, transformers.LlamaForCausalLM  # noqa: N806

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                         max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.bfloat16)


def _peak(name: str, steps: int) -> tuple[dict[str, float], int, int]:
    model = _llama(512, 14, 8192)
    params = list(model.parameters())
    if name == "zenflow":
        opt = zenflow_adamw(params, lr=1e-4, topk_ratio=0.1, update_interval=4, accumulate_on="host",
                            free_gradients_in_backward="on")
        meter = opt._meter
    elif name == "sync_offload":
        opt = SyncOffloadAdamW(params, lr=1e-4)
        meter = DeviceMemoryMeter(params, lambda: 0, watch=True)
    else:
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
        meter = DeviceMemoryMeter(params, lambda: sum(v.numel() * v.element_size() for s in opt.state.values()
                                                      for v in s.values()), watch=True)
    tokens = torch.randint(0, 8192, (2, 32), generator=torch.Generator().manual_seed(0))
    per_step = []
    for _ in range(steps):
        model(input_ids=tokens, labels=tokens).loss.backward()
        if name == "zenflow":
            opt.clip_grad_norm_(1.0)
        opt.step()
        if name != "zenflow":
            meter.finish_step()
        per_step.append(meter.step_peak_bytes)
        opt.zero_grad()
    out = {"peak": meter.peak_bytes, "first": per_step[0], "later": max(per_step[1:], default=None)}
    weight_bytes, n = meter.weight_bytes, meter.param_count
    if hasattr(opt, "close"):
        opt.close()
    return out, weight_bytes, n


@pytest.mark.slow
def test_llama_peak_device_bytes_with_gradients_freed():
    """A bf16 Llama-shaped model (>= 50M parameters), topk 0.1, U=4, host sums, counted on the CPU device. The run's
    peak (every step, the first and its selection included) is the weights, the selected columns' fp32 state and
    their gradient gathered in bf16 (12 + 2 B per selected element, ~10.2 % of the elements: ~1.43 B/param) and the
    gradient in its hook (the largest, the LM head's: 0.16 B/param): 1.78x the bf16 weights (1.88x with the
    gradient gathered in fp32), 0.89x sync offload's peak (weights and every gradient); torch's AdamW holds
    weights, gradients and fp32 moments (4x)."""
    zen, weight_bytes, n = _peak("zenflow", 3)
    sync, _, _ = _peak("sync_offload", 2)
    adamw, _, _ = _peak("adamw_torch", 1)
    print(f"params {n}, bf16 weights {weight_bytes} B; peak device bytes: ZenFlow {zen}, sync offload {sync}, "
          f"adamw_torch {adamw}")
    assert n >= 50e6
    assert zen["peak"] <= 1.79 * weight_bytes
    assert zen["peak"] <= 0.9 * sync["peak"]
    assert sync["peak"] >= 2 * weight_bytes and adamw["peak"] >= 4 * weight_bytes


def _scaled_run(free: str, recipe: str, dtype: torch.dtype, overflow_at: frozenset[int], init_scale: float,
                steps: int = 12, **settings: object) -> dict:
    """Train under a `torch.amp.GradScaler`: "unscale" (scale, unscale_, clip, step, update: the Trainer's order) or
    "step" (scale, step, update). Batches in `overflow_at` get an infinite scaled loss."""
    model = make_model(dtype=dtype)
    opt = zenflow_adamw(param_groups(model), lr=1e-2, **{**SETTINGS, **settings}, free_gradients_in_backward=free)
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=init_scale)
    scales, peaks, norms = [], [], []
    for i, (x, y) in enumerate(batches(steps)):
        logits = model(x.to(DEVICE)).float()
        loss = scaler.scale(torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]),
                                                              y.to(DEVICE).view(-1)))
        (loss * math.inf if i in overflow_at else loss).backward()
        if recipe == "unscale":
            scaler.unscale_(opt)
            norms.append(opt.clip_grad_norm_(0.5).item())
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        peaks.append(opt.stats()["step_peak_device_bytes"])
        opt.zero_grad()
    opt.flush()
    out = {"weights": [p.detach().clone() for p in model.parameters()], "scales": scales, "peaks": peaks,
           "norms": norms, "skipped": opt.stats()["skipped_steps"]}
    opt.close()
    return out


@pytest.mark.parametrize("recipe,dtype,copying", [
    ("unscale", torch.float32, False), ("unscale", torch.bfloat16, False), ("step", torch.float32, False),
    ("step", torch.float16, False), ("unscale", torch.float32, True), ("step", torch.float16, True)])
def test_freeing_under_a_grad_scaler_changes_nothing(recipe, dtype, copying, monkeypatch):
    """fp16 training's GradScaler with the gradients freed in backward, both recipes: the same weights, clip norms,
    scale trajectory and skipped steps as without freeing, bit for bit, with overflows in the first step (no state
    yet), a re-selection (step 5) and mid-window; and every step's peak is lower (the freeing goes on under the
    scaler). The overflow check of a freed gradient is made in its hook (the scaler reads only ``p.grad``).
    `copying`: the transport that copies each gradient into a staging buffer in its hook, as on CUDA."""
    if copying:
        monkeypatch.setattr("hf_zenflow.transport.transport_for", lambda device: CopyTransport())
    overflow_at = frozenset({0, 5, 7})
    kept = _scaled_run("off", recipe, dtype, overflow_at, init_scale=4096.0, high_lr_rule="off")
    freed = _scaled_run("on", recipe, dtype, overflow_at, init_scale=4096.0, high_lr_rule="off")
    assert kept["scales"] == freed["scales"] and kept["skipped"] == freed["skipped"] == len(overflow_at)
    assert [repr(n) for n in kept["norms"]] == [repr(n) for n in freed["norms"]]  # (NaN at an overflow)
    for a, b in zip(kept["weights"], freed["weights"]):
        assert torch.equal(a, b)
    assert all(f < k for f, k in zip(freed["peaks"], kept["peaks"]))


def test_an_fp16_norm_that_overflows_on_finite_gradients_is_no_overflow_for_the_scaler():
    """Pure fp16 gradients at a high scale: some gradient's L2 norm overflows fp16 while every element is finite.
    The scaler sees no overflow there (its check is element-wise), the optimizer skips the step on its non-finite
    norm; the freed run must make the same element-wise check, not take the norm for it: the same scale trajectory
    and weights as without freeing."""
    scale = 2.0 ** 17  # (TinyNet's fp16 gradients: the matrices' norms overflow, their largest elements ~1e4)
    kept = _scaled_run("off", "step", torch.float16, frozenset({2}), init_scale=scale, steps=4)
    freed = _scaled_run("on", "step", torch.float16, frozenset({2}), init_scale=scale, steps=4)
    # every step skipped on its norm, and the scaler backed off only for the step whose elements overflowed
    assert kept["skipped"] == 4 and kept["scales"] == [scale, scale, scale / 2, scale / 2]
    assert kept["scales"] == freed["scales"] and kept["skipped"] == freed["skipped"]
    for a, b in zip(kept["weights"], freed["weights"]):
        assert torch.equal(a, b)
    assert all(f < k for f, k in zip(freed["peaks"], kept["peaks"]))
