"""Low-precision host state: ``host_moment_dtype="bfloat16"`` (host moments stored bf16, updated in fp32).

The reference is an independent implementation of the same arithmetic: torch's fused AdamW on the matrices with
each moment rounded to bf16 after the step (stochastically,
with the random bits of `rounding.RandomStream` for the optimizer's seed, the matrix's place in the param groups and
the step count). With every column on the host and a window of one step, ZenFlow is that AdamW, so the two must agree
bit for bit; and the settings must change the result, or the comparison says nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hf_zenflow.engine.host as host_module
from hf_zenflow import ZenFlowAdamW
from hf_zenflow.transport.cpu_device import kernels
from hf_zenflow.transport.cpu_device.rounding import RandomStream, matrix_key, random16, round_bf16
from tests.conftest import DEVICE, FP32_MOMENTS, batches, make_model, param_groups, roundtrip, train, zenflow_adamw


LR, STEPS = 1e-2, 12
#: one batch seen every step: its loss must fall
DATA = batches(1) * STEPS
#: every column on the host, one-step windows summed in fp32 (the reference sums each step's gradient exactly)
ALL_ON_HOST = dict(topk_ratio=0.0, update_interval=1, overlap_step=False, min_offload_numel=0, cpu_threads=1,
                   host_sum_dtype="float32")
BF16_MOMENTS = dict(host_moment_dtype="bfloat16")

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU device's transports (a CUDA run: cuda_checks)")


class RoundedAdamW(torch.optim.AdamW):
    """torch's fused AdamW with the matrices' moments rounded to bf16 stochastically after each step, with the bits
    of torch's initial seed (what ZenFlowAdamW keys its rounding by), the matrix's place in the param groups and the
    step count."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(param_groups(model), lr=LR, fused=True)
        self.matrices = [p for p in model.parameters() if p.ndim == 2]
        ordinals = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        self.streams = {p: RandomStream(matrix_key(torch.initial_seed(), ordinals[id(p)])) for p in self.matrices}

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 - torch's signature
        super().step(closure)
        for p in self.matrices:
            state = self.state[p]
            bits = self.streams[p].bits(int(state["step"]), 0, p.numel()).view(p.shape)
            state["exp_avg"].copy_(round_bf16(state["exp_avg"], random16(bits, 0)))
            state["exp_avg_sq"].copy_(round_bf16(state["exp_avg_sq"], random16(bits, 1)))


def _zenflow(settings: dict, **kw) -> tuple[torch.nn.Module, list[float], ZenFlowAdamW]:
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, **{**ALL_ON_HOST, **kw, **settings})
    losses = train(model, opt, DATA)
    opt.flush()
    return model, losses, opt


def _count_moment_passes(monkeypatch) -> dict[str, int]:
    """Counts the host passes over bf16 moments: through the CPU kernel, and through torch's operations."""
    calls = {"kernel": 0, "torch": 0}

    def counted(name: str, fn):  # noqa: ANN001, ANN202
        def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(kernels, "window_adamw_bf16", counted("kernel", kernels.window_adamw_bf16))
    monkeypatch.setattr(host_module, "_adamw_narrow_moments", counted("torch", host_module._adamw_narrow_moments))
    return calls


def _moment_path(path: str, monkeypatch) -> dict[str, int]:
    """Routes the bf16 moments' host pass through the CPU kernel ("kernel") or torch's operations ("torch"; in
    pieces of 1000 elements, with a remainder, for "torch-pieces": the bits of one call)."""
    if path == "kernel" and not kernels.window_adamw_bf16_available():
        pytest.skip("no CPU kernels here")
    if path != "kernel":
        monkeypatch.setattr(kernels, "window_adamw_bf16_available", lambda: False)
    if path == "torch-pieces":
        monkeypatch.setattr(host_module, "NARROW_CHUNK", 1000)
    return _count_moment_passes(monkeypatch)


@pytest.mark.parametrize("path", ["kernel", "torch", "torch-pieces"])
def test_low_precision_host_is_adamw_with_the_same_rounding(path, monkeypatch):
    calls = _moment_path(path, monkeypatch)
    model, losses, opt = _zenflow(BF16_MOMENTS)
    opt.close()
    # (the pass went where it was sent)
    assert calls[path.split("-")[0]] > 0 and calls["torch" if path == "kernel" else "kernel"] == 0
    ref = make_model()
    ref_losses = train(ref, RoundedAdamW(ref), DATA)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert losses == ref_losses and losses[-1] < losses[0]  # and it trains
    plain, _, opt = _zenflow(FP32_MOMENTS)
    opt.close()
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))  # the setting acts


def test_bf16_moments_through_the_kernel_are_the_torch_pass_bit_for_bit(monkeypatch):
    """A split run with bf16 moments (columns on the device, windows of three steps overlapped with the next ones,
    re-selection, a clipped run): the CPU kernel's one-pass window and torch's
    operations give the same weights and the same host moments."""
    # (every column summed: the device columns' host moments, never read, are then the same on both paths too)
    settings = dict(host_moment_dtype="bfloat16", topk_ratio=0.25, update_interval=3, overlap_step=True,
                    select_strategy="step", select_interval=4, min_offload_numel=0, cpu_threads=2,
                    host_sum_columns="all")
    runs = []
    for path in ("kernel", "torch"):
        with monkeypatch.context() as patch:
            calls = _moment_path(path, patch)
            model = make_model()
            opt = zenflow_adamw(param_groups(model), lr=LR, **settings)
            train(model, opt, batches(STEPS), clip=0.05)
            opt.flush()
            moments = [(s.host.exp_avg.clone(), s.host.exp_avg_sq.clone())
                       for s in opt.engine_state.splits.values() if s.host is not None]
            opt.close()
            runs.append((list(model.parameters()), moments))
            assert calls[path] > 0 and calls["torch" if path == "kernel" else "kernel"] == 0
    (params, moments), (ref_params, ref_moments) = runs
    assert moments and all(m.dtype == torch.bfloat16 for pair in moments for m in pair)
    for p, q in zip(params, ref_params):
        assert torch.equal(p, q)
    for pair, ref_pair in zip(moments, ref_moments):
        assert all(torch.equal(a, b) for a, b in zip(pair, ref_pair))


def test_stats_report_the_bytes_saved():
    """bf16 moments: 4 B less per hosted element."""
    figures = {}
    for name, settings in {"fp32": FP32_MOMENTS, "moments": {**FP32_MOMENTS, **BF16_MOMENTS}}.items():
        _, _, opt = _zenflow(settings, topk_ratio=0.25, update_interval=2, overlap_step=True)
        figures[name] = opt.stats()
        opt.close()
    hosted = (figures["fp32"]["host_state_bytes"] - figures["moments"]["host_state_bytes"]) / 4
    assert hosted > 0 and hosted == int(hosted)
    assert figures["fp32"]["host_bytes_per_param"] - figures["moments"]["host_bytes_per_param"] == pytest.approx(4)


def test_bf16_moments_resume_exactly():
    settings = dict(host_moment_dtype="bfloat16", topk_ratio=0.25, update_interval=2,
                    overlap_step=True, select_strategy="step", select_interval=3, min_offload_numel=0, cpu_threads=1)
    data = batches(STEPS)
    whole = make_model()
    opt = zenflow_adamw(param_groups(whole), lr=LR, **settings)
    train(whole, opt, data)
    opt.flush()
    opt.close()
    first = make_model()
    opt = zenflow_adamw(param_groups(first), lr=LR, **settings)
    train(first, opt, data[:5])  # mid-window, between re-selections
    saved = roundtrip(opt.state_dict())
    opt.close()
    assert saved["zenflow"]["config"]["rules"]["host_moment_dtype"] == "bfloat16"
    second = make_model()
    second.load_state_dict(first.state_dict())
    opt = zenflow_adamw(param_groups(second), lr=LR, **settings)
    opt.load_state_dict(saved)
    assert all(s.host.exp_avg.dtype == torch.bfloat16 for s in opt.engine_state.splits.values() if s.host is not None)
    train(second, opt, data[5:])
    opt.flush()
    opt.close()
    for p, q in zip(whole.parameters(), second.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("moments", ["bfloat16", "int8"])
def test_the_rounding_seed_travels_with_the_checkpoint(moments):
    """The random bits of the moments' rounding are keyed by torch's seed when the optimizer is made: a run resumed
    in a process seeded otherwise takes the checkpoint's seed and continues bit for bit; a run made under another
    seed rounds otherwise (the seed acts)."""
    settings = dict(host_moment_dtype=moments, topk_ratio=0.25, update_interval=2, overlap_step=True,
                    select_strategy="step", select_interval=3, min_offload_numel=0, cpu_threads=1)
    data = batches(STEPS)

    def made_under(seed: int, model: torch.nn.Module) -> ZenFlowAdamW:
        torch.manual_seed(seed)
        return zenflow_adamw(param_groups(model), lr=LR, **settings)

    whole = make_model()
    opt = made_under(3, whole)
    train(whole, opt, data)
    opt.close()
    first = make_model()
    opt = made_under(3, first)
    train(first, opt, data[:5])
    saved = roundtrip(opt.state_dict())
    opt.close()
    assert saved["zenflow"]["rounding_seed"] == 3
    second = make_model()
    second.load_state_dict(first.state_dict())
    opt = made_under(4, second)
    assert opt.host_windows.state()["rounding_seed"] == 4
    opt.load_state_dict(saved)
    assert opt.host_windows.state()["rounding_seed"] == 3
    train(second, opt, data[5:])
    opt.close()
    assert all(torch.equal(p, q) for p, q in zip(whole.parameters(), second.parameters()))
    other = make_model()
    opt = made_under(4, other)
    train(other, opt, data)
    opt.close()
    assert not all(torch.equal(p, q) for p, q in zip(whole.parameters(), other.parameters()))


def _measured_host_bytes(opt: ZenFlowAdamW) -> tuple[int, int]:
    """(bytes of every distinct host storage the host state holds, its elements), read off the tensors themselves:
    every tensor field of each `HostMatrix` (and its lists of tensors), one count per storage however many fields
    share it. The step counter is one scalar per matrix, not per element: left out, as `stats()` leaves it."""
    storages: dict[int, int] = {}
    elements = 0
    for split in opt.engine_state.splits.values():
        host = split.host
        if host is None:
            continue
        elements += host.master.numel()
        for f in dataclasses.fields(host):
            value = getattr(host, f.name)
            for t in value if isinstance(value, list) else [value]:
                if isinstance(t, torch.Tensor) and f.name != "step":
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values()), elements


@pytest.mark.parametrize("accumulate_on", ["device", "host"])
def test_host_bytes_per_param_with_bf16_moments_are_the_host_tensors(accumulate_on):
    """stats()'s host bytes per offloaded element is what the host tensors hold, measured from them after windows
    and write-backs, and at most 12 B with the window summed on the device (fp32 master 4, bf16 moments 2 + 2, one
    fp32 buffer for the landed window sum and the write-back), 10 with the defaults' host sums (a bf16 sum of the
    unselected columns, the write-back from the master)."""
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, topk_ratio=0.25, update_interval=3, overlap_step=True,
                        writeback_lag=1, min_offload_numel=0, cpu_threads=1, host_moment_dtype="bfloat16",
                        accumulate_on=accumulate_on)
    train(model, opt, batches(10))  # three windows closed, two written back, one pending
    opt.flush()
    stats = opt.stats()
    assert stats["accumulate_on"] == accumulate_on and stats["windows"] >= 3
    measured, elements = _measured_host_bytes(opt)
    assert elements > 0
    assert stats["host_state_bytes"] == measured
    assert stats["host_bytes_per_param"] == measured / elements
    assert stats["host_bytes_per_param"] <= (12 if accumulate_on == "device" else 10)
    opt.close()
