"""Reference tests of `ZenFlowAdamW`: degenerate settings reproduce known optimizers, the overlapped schedule is the
sequential one it claims, checkpoints continue exactly, and failures surface."""

from __future__ import annotations

import copy
import math
import threading
import time
from collections.abc import Callable

import pytest
import torch

import hf_zenflow.engine.host as host_module
from hf_zenflow import HostWorkerError, SyncOffloadAdamW, ZenFlowAdamW
from hf_zenflow._base import fused_adamw_
from tests.conftest import (
    DEVICE,
    FP32_MOMENTS,
    batches,
    linear_schedule,
    make_model,
    max_rel_diff,
    param_groups,
    roundtrip,
    train,
    zenflow_adamw,
)


#: (at this rate `high_lr_rule="auto"` would shorten windows of 2 or more steps to one: the tests of the configured
#: windows below pin them with OFF; the rule's own tests are tests/engine/test_high_lr_rule.py)
LR = 1e-2
OFF = {"high_lr_rule": "off"}
STEPS = 50


def run_reference(steps: int = STEPS, clip: float | None = None, fused: bool = False) -> tuple[torch.nn.Module, list]:
    model = make_model()
    opt = torch.optim.AdamW(param_groups(model), lr=LR, fused=fused)
    losses = train(model, opt, batches(steps), linear_schedule(opt, steps), clip=clip)
    return model, losses


def run_zenflow(steps: int = STEPS, clip: float | None = None, **kw) -> tuple[torch.nn.Module, list, ZenFlowAdamW]:
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, **{**OFF, **kw}, min_offload_numel=0)
    losses = train(model, opt, batches(steps), linear_schedule(opt, steps), clip=clip)
    opt.flush()
    opt.close()
    return model, losses, opt


def test_all_columns_selected_is_adamw():
    ref, ref_losses = run_reference()
    model, losses, opt = run_zenflow(topk_ratio=1.0)
    assert max_rel_diff(model, ref) < 1e-5
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert opt.stats()["selected_fraction"] == 1.0
    assert opt.stats()["host_state_bytes"] == 0  # nothing lives on the host


def test_all_columns_selected_matches_fused_adamw_bit_for_bit():
    ref, _ = run_reference(fused=True)
    model, _, _ = run_zenflow(topk_ratio=1.0)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("topk_ratio", [0.0, 0.05, 0.1, 0.5, 0.9])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_interval_one_sequential_is_adamw_for_any_ratio_with_reselection(topk_ratio, clip):
    ref, ref_losses = run_reference(clip=clip)
    model, losses, opt = run_zenflow(
        clip=clip, topk_ratio=topk_ratio, update_interval=1, overlap_step=False, select_strategy="step",
        select_interval=3, **FP32_MOMENTS,
    )
    assert max_rel_diff(model, ref) < 1e-5
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    if topk_ratio > 0:
        assert opt.stats()["reselections"] == len(range(0, STEPS, 3))


def test_nothing_selected_interval_one_is_sync_offload():
    """Bit for bit on a CPU device (every update is the host's AdamW kernel in both). On CUDA, ZenFlow updates the
    1-D parameters on the device with CUDA's fused AdamW (other instruction order, fused multiply-adds) and sync
    offload updates them with the host's kernel, so the runs part by rounding: within the tolerance the other
    cross-device references here use (the matrices stay on the host in both, but their gradients then differ)."""
    model_s = make_model()
    sync = SyncOffloadAdamW(param_groups(model_s), lr=LR)
    sync_losses = train(model_s, sync, batches(STEPS), linear_schedule(sync, STEPS), clip=1.0)
    model, losses, _ = run_zenflow(clip=1.0, topk_ratio=0.0, update_interval=1, overlap_step=False, **FP32_MOMENTS)
    if DEVICE.type == "cpu":
        assert losses == sync_losses
        for p, q in zip(model.parameters(), model_s.parameters()):
            assert torch.equal(p, q)
    else:
        assert losses == pytest.approx(sync_losses, rel=1e-5)
        assert max_rel_diff(model, model_s) < 1e-5


def test_warm_up_rounds_are_dense_adamw():
    ref, _ = run_reference(steps=10)
    model, _, opt = run_zenflow(steps=10, topk_ratio=0.1, update_interval=4, full_warm_up_rounds=10, **FP32_MOMENTS)
    assert max_rel_diff(model, ref) < 1e-5
    assert opt.stats()["reselections"] == 0


@pytest.mark.parametrize(
    "settings",
    [
        dict(topk_ratio=0.1, update_interval=4),
        dict(topk_ratio=0.25, update_interval=3, select_strategy="step", select_interval=7),  # partial windows
        dict(topk_ratio=0.1, update_interval="auto", select_strategy="step", select_interval=10),
        dict(topk_ratio=0.1, update_interval=2, full_warm_up_rounds=5),
        dict(topk_ratio=0.1, update_interval=4, writeback_lag=1),
        dict(topk_ratio=0.1, update_interval="auto", select_strategy="step", select_interval=10, writeback_lag=2),
    ],
)
def test_overlapped_equals_sequential_schedule_bit_for_bit(settings):
    threaded, losses_t, opt_t = run_zenflow(clip=1.0, host_executor="thread", **settings)
    inline, losses_i, opt_i = run_zenflow(clip=1.0, host_executor="inline", **settings)
    assert losses_t == losses_i
    for p, q in zip(threaded.parameters(), inline.parameters()):
        assert torch.equal(p, q)
    assert opt_t.stats()["windows"] == opt_i.stats()["windows"] > 0


@pytest.mark.parametrize("host_lr_scale, writeback_lag",
                         [(1.0, None), ("interval", None), (1.0, 1), (1.0, 3), (1.0, "auto")])
def test_overlapped_schedule_matches_an_independent_model_of_it(host_lr_scale, writeback_lag, monkeypatch):
    """A from-scratch model of the claimed schedule: selected columns by AdamW every step; the rest by a host AdamW
    on the mean gradient of each U-step window, written back one window later (lr at window close, times U with
    host_lr_scale="interval"), or `writeback_lag` steps into the next window ("auto": the lag chosen at the first
    step, stubbed to choose 2)."""
    monkeypatch.setattr("hf_zenflow.engine.writeback_lag.auto_lag_from_sizes", lambda elements, longest: 2)
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 16, bias=False)
    ref_w = lin.weight.detach().clone()
    data = [torch.randn(4, 32) for _ in range(24)]
    U, k = 4, 8
    opt = zenflow_adamw([lin.weight], lr=LR, weight_decay=0.05, topk_ratio=k / 32, update_interval=U,
                        select_strategy="step", select_interval=1000, host_lr_scale=host_lr_scale, min_offload_numel=0,
                        writeback_lag=writeback_lag, **OFF, **FP32_MOMENTS)
    def lag(window: int) -> int:  # the write-back lag of window `window`'s result (1-based)
        if writeback_lag == "auto":
            return 2
        return U if writeback_lag is None else writeback_lag

    closed = 0
    host_scale = U if host_lr_scale == "interval" else 1.0
    sched = linear_schedule(opt, 24)
    group = dict(lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05)

    def zeros():
        return torch.zeros_like(ref_w)

    dev = dict(master=None, m=None, v=None, step=torch.zeros(()))
    host = dict(master=ref_w.clone(), m=zeros(), v=zeros(), step=torch.zeros(()), acc=zeros(), n=0)
    pending = None
    sel = None
    for t, x in enumerate(data):
        w = ref_w.clone().requires_grad_(True)
        (x @ w.t()).square().mean().backward()
        g = w.grad
        lr = LR * max(0.0, 1.0 - t / 24)
        if sel is None:
            sel = torch.topk(g.square().sum(0), k).indices.sort().values
            dev.update(master=ref_w[:, sel].clone(), m=torch.zeros(16, k), v=torch.zeros(16, k))
        fused_adamw_([dev["master"]], [g[:, sel].clone()], [dev["m"]], [dev["v"]], [dev["step"]], {**group, "lr": lr})
        ref_w[:, sel] = dev["master"]
        host["acc"] += g
        host["n"] += 1
        if pending is not None and host["n"] == lag(closed):
            ref_w.copy_(pending)
            ref_w[:, sel] = dev["master"]
            pending = None
        if host["n"] == U:
            fused_adamw_([host["master"]], [host["acc"] / U], [host["m"]], [host["v"]], [host["step"]],
                         {**group, "lr": lr * host_scale})
            pending = host["master"].clone()
            closed += 1
            host["acc"].zero_()
            host["n"] = 0
        # the optimizer under test, same gradient
        (x @ lin.weight.t()).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        opt.synchronize()
        torch.testing.assert_close(lin.weight.detach(), ref_w, rtol=1e-6, atol=1e-7)
    assert opt.stats()["writeback_lag"] == (lag(2) if writeback_lag is not None else U)
    opt.close()


@pytest.mark.parametrize(
    "settings",
    [
        dict(topk_ratio=0.1, update_interval=4),
        dict(topk_ratio=0.25, update_interval=3, select_strategy="step", select_interval=7),
        dict(topk_ratio=0.1, update_interval="auto", select_strategy="step", select_interval=10),
        dict(topk_ratio=0.1, update_interval=2, full_warm_up_rounds=5, overlap_step=False),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_accumulation_equals_host_accumulation_bit_for_bit(settings, dtype):
    """Where an fp32 window sum is kept changes memory and traffic, never the arithmetic."""
    results = []
    for accumulate_on in ("host", "device"):
        model = make_model(dtype=dtype)
        opt = zenflow_adamw(param_groups(model), lr=LR, accumulate_on=accumulate_on, host_sum_dtype="float32",
                            **{**OFF, **settings}, min_offload_numel=0)
        losses = train(model, opt, batches(30), linear_schedule(opt, 30), clip=1.0)
        opt.flush()
        results.append((model, losses, opt.stats()))
        opt.close()
    (host_model, host_losses, host_stats), (dev_model, dev_losses, dev_stats) = results
    assert host_losses == dev_losses
    for p, q in zip(host_model.parameters(), dev_model.parameters()):
        assert torch.equal(p, q)
    assert host_stats["windows"] == dev_stats["windows"] > 0
    # the device keeps one fp32 sum per offloaded matrix, the host no staging
    extra = sum(p.numel() * 4 for p in (dev_model.up.weight, dev_model.down.weight, dev_model.embed.weight))
    assert dev_stats["device_state_bytes"] - host_stats["device_state_bytes"] == extra
    # one fp32 transfer per window instead of one gradient per step
    if dtype == torch.float32:
        assert dev_stats["total_bytes_to_host"] < host_stats["total_bytes_to_host"]


def assert_resume_continues_identically(split_at: int, total: int, settings: dict, save: dict | None = None,
                                        load: dict | None = None) -> dict:
    """Train `total` steps in one go; train `split_at` steps with `settings | save`, checkpoint (weights_only
    round trip), load into a fresh optimizer with `settings | load` over a differently initialised model, train the
    rest: losses and weights must be identical. Returns the checkpoint."""
    data = batches(total)
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, **{**OFF, **settings}, min_offload_numel=0)
    full_losses = train(model, opt, data, linear_schedule(opt, total), clip=1.0)
    opt.close()

    model_a = make_model()
    opt_a = zenflow_adamw(param_groups(model_a), lr=LR, **{**OFF, **settings, **(save or {})}, min_offload_numel=0)
    sched_a = linear_schedule(opt_a, total)
    first = train(model_a, opt_a, data[:split_at], sched_a, clip=1.0)
    checkpoint = roundtrip({"model": model_a.state_dict(), "opt": opt_a.state_dict(), "sched": sched_a.state_dict()})
    opt_a.close()

    model_b = make_model(seed=123)  # fresh copy, different init: everything must come from the checkpoint
    model_b.load_state_dict(checkpoint["model"])
    opt_b = zenflow_adamw(param_groups(model_b), lr=LR, **{**OFF, **settings, **(load or {})}, min_offload_numel=0)
    sched_b = linear_schedule(opt_b, total)  # built before loading, as the HF Trainer does
    opt_b.load_state_dict(checkpoint["opt"])
    sched_b.load_state_dict(checkpoint["sched"])
    rest = train(model_b, opt_b, data[split_at:], sched_b, clip=1.0)
    opt_b.close()
    assert first + rest == full_losses
    for p, q in zip(model_b.parameters(), model.parameters()):
        assert torch.equal(p, q)
    return checkpoint


@pytest.mark.parametrize("save_on, load_on", [("host", "device"), ("device", "host"), ("device", "device")])
def test_checkpoint_moves_between_accumulation_places(save_on, load_on):
    assert_resume_continues_identically(  # (fp32 sums on either side: the same arithmetic)
        6, 26, dict(topk_ratio=0.1, update_interval=4, select_strategy="step", select_interval=8,
                    host_sum_dtype="float32"),
        save={"accumulate_on": save_on}, load={"accumulate_on": load_on},
    )


@pytest.mark.parametrize("executor", ["thread", "inline"])
@pytest.mark.parametrize("split_at", [6, 13])  # mid-window with a host step in flight / right after a boundary
def test_checkpoint_mid_window_continues_identically(executor, split_at):
    settings = dict(topk_ratio=0.1, update_interval=4, select_strategy="step", select_interval=8,
                    host_executor=executor)
    checkpoint = assert_resume_continues_identically(split_at, split_at + 20, settings)
    assert checkpoint["opt"]["zenflow"]["window_steps"] == split_at % 4


def test_state_dict_is_weights_only_safe_and_accepts_any_device_tensors():
    _, _, opt = run_zenflow(steps=6, topk_ratio=0.2, update_interval=4)
    state = roundtrip(opt.state_dict())
    assert state["zenflow"]["steps"] == 6
    kinds = {entry["kind"] for entry in state["state"].values()}
    assert kinds == {"split", "dense"}
    model = make_model()
    fresh = zenflow_adamw(param_groups(model), lr=LR, topk_ratio=0.2, update_interval=4, min_offload_numel=0, **OFF)
    fresh.load_state_dict(copy.deepcopy(state))
    assert roundtrip(fresh.state_dict())["zenflow"] == state["zenflow"]


def test_bf16_weights_are_the_rounded_fp32_master():
    model = make_model(dtype=torch.bfloat16)
    opt = zenflow_adamw(param_groups(model), lr=LR, topk_ratio=0.1, update_interval=3, select_strategy="step",
                        select_interval=5, min_offload_numel=0)
    train(model, opt, batches(23))
    opt.flush()
    for p in model.parameters():
        master = opt.master_weight(p)
        assert master.dtype == torch.float32
        assert torch.equal(p.detach().cpu(), master.to(torch.bfloat16).view(p.shape))  # (the master is on the host)
    # the master carries information below bf16 resolution (it was never truncated)
    big = opt.master_weight(model.up.weight)
    assert not torch.equal(big, big.to(torch.bfloat16).float())
    opt.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clip_grad_norm_returns_torch_value(dtype):
    model = make_model(dtype=dtype)
    x, y = (t.to(DEVICE) for t in batches(1)[0])
    logits = model(x).float()
    torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1)).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt = zenflow_adamw(model.parameters(), lr=LR, min_offload_numel=0)
    sync = SyncOffloadAdamW(model.parameters(), lr=LR)
    ours, ours_sync = opt.clip_grad_norm_(0.1), sync.clip_grad_norm_(0.1)
    theirs = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    assert theirs > 0.1  # clipping is active
    assert torch.equal(ours, theirs) and torch.equal(ours_sync, theirs)
    for p, g in zip(model.parameters(), grads):  # measuring does not rewrite the gradients
        assert torch.equal(g * torch.clamp(0.1 / (theirs + 1e-6), max=1.0), p.grad)


def test_non_finite_gradient_skips_the_whole_step():
    data = batches(16)
    settings = dict(topk_ratio=0.1, update_interval=4, select_strategy="step", select_interval=8)

    # reference: the same run with batch 6 simply absent
    model_r = make_model()
    opt_r = zenflow_adamw(param_groups(model_r), lr=LR, **settings, min_offload_numel=0)
    ref_losses = train(model_r, opt_r, data[:6] + data[7:])
    opt_r.flush()

    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, **settings, min_offload_numel=0)
    snapshot = {}
    # the non-finite values arrive with the gradients, in backward (freed in backward, a gradient is gone by then)
    poisoned = {"now": False}

    def nan_at(index: tuple[int, ...], value: float) -> Callable[[torch.Tensor], torch.Tensor]:
        def add(grad: torch.Tensor) -> torch.Tensor:
            if not poisoned["now"]:
                return grad
            grad = grad.clone()
            grad[index] = value
            return grad
        return add

    model.up.weight.register_hook(nan_at((3, 5), float("nan")))
    model.norm.bias.register_hook(nan_at((0,), float("inf")))

    def poison(i: int) -> None:
        poisoned["now"] = i == 5  # (the backward of batch 6 runs next)
        if i == 6:
            opt.synchronize()
            snapshot["weights"] = copy.deepcopy(model.state_dict())
            snapshot["opt"] = roundtrip(opt.state_dict())

    losses = train(model, opt, data, hook=poison)
    opt.flush()
    assert opt.stats()["skipped_steps"] == 1
    assert losses[:6] + losses[7:] == ref_losses
    for p, q in zip(model.parameters(), model_r.parameters()):
        assert torch.equal(p, q)
    opt.close()
    opt_r.close()


def test_skipped_step_leaves_weights_and_state_untouched():
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, topk_ratio=0.1, update_interval=4, min_offload_numel=0)
    train(model, opt, batches(5))
    opt.synchronize()
    before_w = copy.deepcopy(model.state_dict())
    before_s = copy.deepcopy(roundtrip(opt.state_dict()))
    x, y = (t.to(DEVICE) for t in batches(1, seed=9)[0])
    logits = model(x)
    model.down.weight.register_hook(lambda g: g.index_put((torch.tensor([0]), torch.tensor([0])),
                                                          torch.tensor(float("nan"), dtype=g.dtype)))
    torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1)).backward()
    opt.step()
    opt.synchronize()
    after_s = roundtrip(opt.state_dict())
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before_w[name])
    assert after_s["zenflow"].pop("skipped_steps") == before_s["zenflow"].pop("skipped_steps") + 1
    after_s["zenflow"].pop("checksum"), before_s["zenflow"].pop("checksum")  # (it covers skipped_steps)
    assert after_s["zenflow"] == before_s["zenflow"]
    for i, entry in before_s["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, after_s["state"][i][key]), key
    opt.close()


def test_worker_failure_is_raised_in_the_caller(monkeypatch):
    def broken(groups, *last):
        raise MemoryError("injected host failure")

    monkeypatch.setattr(host_module, "host_adamw_window", broken)
    import hf_zenflow.engine.windows as window_close

    monkeypatch.setattr(window_close, "host_adamw_window", broken)
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, topk_ratio=0.1, update_interval=2, min_offload_numel=0)
    start = time.monotonic()
    with pytest.raises(HostWorkerError, match="injected host failure"):
        train(model, opt, batches(10))
        opt.synchronize()
    assert time.monotonic() - start < 30
    with pytest.raises(HostWorkerError):
        opt.synchronize()  # stays failed: nothing continues on inconsistent state
    opt.close()


def test_inline_failure_raises_at_once(monkeypatch):
    import hf_zenflow.engine.windows as window_close

    monkeypatch.setattr(window_close, "host_adamw_window", lambda groups, *last: 1 / 0)
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, topk_ratio=0.1, update_interval=1, overlap_step=False,
                        min_offload_numel=0)
    with pytest.raises(HostWorkerError, match="ZeroDivisionError"):
        train(model, opt, batches(2))


def test_eval_drains_and_close_stops_the_worker():
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, topk_ratio=0.1, update_interval=2, min_offload_numel=0)
    train(model, opt, batches(4))
    opt.eval()
    worker = opt.host_windows.worker
    assert all(f.done() for f in worker._outstanding)
    thread = worker._thread
    opt.close()
    assert not thread.is_alive()
    train(model, opt, batches(2))  # a later step starts a new worker
    opt.close()


def test_reselection_follows_changing_importance():
    lin = torch.nn.Linear(20, 4, bias=False)
    opt = zenflow_adamw([lin.weight], lr=LR, topk_ratio=0.1, update_interval=2, select_strategy="step",
                        select_interval=4, min_offload_numel=0)
    for t in range(8):
        hot = 3 if t < 4 else 17
        lin.weight.grad = torch.zeros_like(lin.weight)
        lin.weight.grad[:, hot] = 1.0
        lin.weight.grad[:, (hot + 1) % 20] = 0.5
        opt.step()
        split = opt.engine_state.splits[lin.weight]
        assert split.device.index.tolist() == sorted([hot, (hot + 1) % 20])
    assert opt.stats()["reselections"] == 2
    opt.close()


def test_epoch_strategy_needs_the_epoch_length():
    model = make_model()
    opt = ZenFlowAdamW(param_groups(model), lr=LR, select_strategy="epoch", select_interval=1, min_offload_numel=0)
    assert opt.steps_per_epoch is None
    with pytest.raises(ValueError, match="steps_per_epoch"):
        train(model, opt, batches(1))
    opt.set_steps_per_epoch(3)
    train(model, opt, batches(7))
    assert opt.steps_per_epoch == 3 and opt.stats()["reselections"] == 3  # steps 0, 3, 6
    opt.close()


def test_the_epoch_length_is_a_keyword_of_the_optimizer():
    """A plain loop passes the epoch length where it builds the optimizer: the same re-selections as setting it
    before the first step; an invalid one is refused naming it."""
    model = make_model()
    opt = ZenFlowAdamW(param_groups(model), lr=LR, select_strategy="epoch", select_interval=2, min_offload_numel=0,
                       steps_per_epoch=2)
    train(model, opt, batches(9))
    assert opt.steps_per_epoch == 2 and opt.stats()["reselections"] == 3  # steps 0, 4, 8
    opt.close()
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match=rf"steps_per_epoch={bad!r} is invalid: allowed is an integer >= 1"):
            ZenFlowAdamW(param_groups(make_model()), lr=LR, steps_per_epoch=bad)


def test_auto_interval_is_adaptive_and_bounded():
    lin = torch.nn.Linear(50, 8, bias=False)
    opt = zenflow_adamw([lin.weight], lr=LR, topk_ratio=0.1, update_interval="auto", auto_max_interval=6,
                        select_strategy="step", select_interval=1000, host_executor="inline", min_offload_numel=0)
    intervals = []
    for t in range(40):
        g = torch.zeros_like(lin.weight)
        g[:, :5] = 1.0  # the selected columns: one step's selected mass per column is 8
        # unselected mass per column: tiny for the first 20 steps (window runs to the bound), then large
        g[:, 5:] = 0.01 if t < 20 else 3.0
        lin.weight.grad = g
        windows = opt.stats()["windows"]
        opt.step()
        if opt.stats()["windows"] > windows:
            intervals.append(int(opt.stats()["update_interval"]))
    assert max(intervals) <= 6
    assert intervals[0] == 6  # little unselected mass: the window runs to its bound
    assert intervals[-1] == 1  # unselected mass above the selected mean: the window closes every step
    opt.close()


def test_host_memory_is_sixteen_bytes_per_offloaded_element_plus_the_write_back_buffer():
    lin = torch.nn.Linear(64, 32, bias=False)
    opt = zenflow_adamw([lin.weight], lr=LR, topk_ratio=0.25, update_interval=2, min_offload_numel=0,
                        host_writeback="buffer", **FP32_MOMENTS)
    lin.weight.grad = torch.randn_like(lin.weight)
    opt.step()
    stats = opt.stats()
    # 16 B of AdamW state and window sum + the write-back buffer in the parameter dtype (on a CPU device, the
    # weight's spare storage that the write-back swaps in; the preset's "auto" copies the master instead)
    assert stats["host_state_bytes"] == (16 + 4) * lin.weight.numel()
    assert stats["host_bytes_per_param"] == 16 + 4
    assert stats["pinned_host_bytes"] == 0  # nothing is pinned for a CPU device
    # device: fp32 master, two moments and the gather buffer for 16 of 64 columns
    assert stats["device_state_bytes"] == 4 * 4 * 32 * 16
    opt.close()


def test_steps_consume_offloaded_gradients_only():
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, topk_ratio=0.1, update_interval=2, min_offload_numel=0)
    train(model, opt, batches(1))  # zero_grad already ran; do one more backward by hand
    x, y = (t.to(DEVICE) for t in batches(1)[0])
    logits = model(x)
    torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1)).backward()
    opt.step()
    assert model.up.weight.grad is None  # handed to the host worker
    assert model.up.bias.grad is not None  # device-only parameter: left as torch optimizers leave it
    opt.close()


def test_telemetry_counts_bytes_staleness_and_phases():
    lin = torch.nn.Linear(40, 16, bias=True)
    opt = zenflow_adamw(lin.parameters(), lr=LR, topk_ratio=0.1, update_interval=4, select_strategy="step",
                        select_interval=1000, host_executor="inline", min_offload_numel=0, writeback_lag=None, **OFF)
    matrix_bytes = lin.weight.numel() * 4
    seen = []
    for _ in range(12):
        lin.weight.grad, lin.bias.grad = torch.randn_like(lin.weight), torch.randn_like(lin.bias)
        opt.step()
        s = opt.stats()
        seen.append((s["bytes_to_host"], s["bytes_to_device"], s["staleness"]))
        assert s["critical_path_ms"] >= s["cp_norms_ms"] + s["cp_device_update_ms"]
        assert s["selected_fraction"] == pytest.approx(4 / 40)
    assert all(b == matrix_bytes for b, _, _ in seen)  # the matrix gradient goes down every step
    # written back one window late: nothing until the second boundary (step 7), then every 4 steps
    assert [d for _, d, _ in seen] == [0] * 7 + [matrix_bytes] + [0] * 3 + [matrix_bytes]
    # steps whose host-path gradient is not yet in the weights: grows to 8 before each write-back
    assert [int(s) for _, _, s in seen] == [1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7, 4]
    assert opt.stats()["windows"] == 3 and opt.stats()["update_interval"] == 4


def test_selected_grad_share_is_the_chosen_columns_share_of_the_gradient_at_each_selection():
    # two matrices, each with its own spread over columns; re-selected every 3 steps from that step's gradient
    a, b = torch.nn.Linear(40, 16, bias=False), torch.nn.Linear(30, 8, bias=False)
    opt = zenflow_adamw([a.weight, b.weight], lr=LR, topk_ratio=0.1, update_interval=2, select_strategy="step",
                        select_interval=3, host_executor="inline", min_offload_numel=0, **OFF)
    assert math.isnan(opt.stats()["selected_grad_share"])  # nothing chosen yet
    generator = torch.Generator().manual_seed(0)
    expected = math.nan
    for step in range(10):
        skew = 1.0 + step % 4  # how unevenly the gradient spreads over the columns changes from step to step
        grads = [torch.randn(w.shape, generator=generator) * torch.linspace(0.1, 1.0, w.shape[1]).pow(skew)
                 for w in (a.weight, b.weight)]
        a.weight.grad, b.weight.grad = (g.clone() for g in grads)
        before = opt.stats()["reselections"]
        opt.step()
        if opt.stats()["reselections"] != before or step == 0:  # (the first step chooses the first columns)
            shares = []
            for g in grads:
                scores = g.pow(2).sum(0)
                shares.append(float(scores.topk(max(1, int(0.1 * scores.numel()))).values.sum() / scores.sum()))
            expected = sum(shares) / len(shares)
        # (a tolerance: the engine sums the squares in row chunks, this reference in one reduction)
        assert opt.stats()["selected_grad_share"] == pytest.approx(expected, rel=1e-5), step
    assert opt.stats()["reselections"] >= 2  # the figure followed re-selections, not only the first choice
    state = opt.state_dict()
    opt.close()
    resumed = zenflow_adamw([a.weight, b.weight], lr=LR, topk_ratio=0.1, update_interval=2, select_strategy="step",
                            select_interval=3, host_executor="inline", min_offload_numel=0, **OFF)
    resumed.load_state_dict(state)
    assert math.isnan(resumed.stats()["selected_grad_share"])  # not checkpointed: read again at the next selection
    resumed.close()


def test_small_matrices_stay_on_the_device():
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, topk_ratio=0.1, update_interval=4, min_offload_numel=1500)
    train(model, opt, batches(2))
    split = {name for name, p in model.named_parameters() if p in opt.engine_state.splits}
    assert split == {"up.weight", "down.weight"}  # the 24x40 embedding (960 elements) is below the threshold
    opt.close()


def test_cpu_write_back_swaps_in_the_workers_buffer():
    """On a CPU device the write-back gives the weight the worker's buffer as storage (no copy on the critical
    path): same Parameter object, shape and strides, new storage, the host result plus the device columns, and
    autograd keeps working across it (the worker writes the old storage next, which autograd must not see)."""
    if DEVICE.type != "cpu":
        pytest.skip("the swap is the CPU-device write-back")
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, topk_ratio=0.25, update_interval=2, overlap_step=False,
                        min_offload_numel=0, host_writeback="buffer")
    weight, stride = model.up.weight, model.up.weight.stride()
    data = batches(6)
    train(model, opt, data[:1], clip=1.0)
    before = weight.data_ptr()
    train(model, opt, data[1:2], clip=1.0)  # closes the window: host step, then the write-back
    assert weight is model.up.weight and weight.data_ptr() != before and weight.stride() == stride
    opt.synchronize()
    torch.testing.assert_close(weight.detach(), opt.master_weight(weight), rtol=0, atol=0)
    train(model, opt, data[2:], clip=1.0)  # forward/backward across further swaps
    opt.close()


def _auto_windows(clip: float | None) -> tuple[list[int], list[torch.Tensor]]:
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, topk_ratio=0.1, update_interval="auto", select_strategy="step",
                        select_interval=1000, host_executor="inline", min_offload_numel=0)
    intervals: list[int] = []

    def record(_: int) -> None:
        if clip is not None:
            opt.clip_grad_norm_(clip)

    windows = 0
    for batch in batches(40):
        train(model, opt, [batch], hook=record)
        if opt.stats()["windows"] > windows:
            windows = int(opt.stats()["windows"])
            intervals.append(int(opt.stats()["update_interval"]))
    opt.close()
    return intervals, [p.detach().clone() for p in model.parameters()]


def test_auto_interval_adapts_the_same_when_the_norm_was_measured_first():
    """Regression (issue 10.1): with the norms measured by `clip_grad_norm_` (as the Trainer does every step), no
    matrix voted and every window ran to `auto_max_interval`."""
    free, free_weights = _auto_windows(None)
    measured, measured_weights = _auto_windows(float("inf"))
    clipped, _ = _auto_windows(1.0)
    assert max(free) < 16  # the task closes windows before the bound
    assert measured == free  # measuring the norm changes nothing...
    for p, q in zip(measured_weights, free_weights):
        assert torch.equal(p, q)  # ...bit for bit
    assert max(clipped) < 16 and len(clipped) > 40 // 16 + 1


def test_no_selection_from_an_all_zero_gradient():
    """Regression (issue 10.3): a matrix whose first gradient is exactly zero (LoRA's lora_A while lora_B is zero)
    had its device columns chosen from that gradient (arbitrarily) and kept them until the next re-selection."""
    lin = torch.nn.Linear(20, 4, bias=False)
    opt = zenflow_adamw([lin.weight], lr=LR, topk_ratio=0.1, update_interval=2, select_strategy="step",
                        select_interval=1000, min_offload_numel=0)
    hot = [7, 13]
    for t in range(6):
        lin.weight.grad = torch.zeros_like(lin.weight)
        if t > 0:
            lin.weight.grad[:, hot] = 1.0
            lin.weight.grad[:, 2] = 0.01
        opt.step()
        split = opt.engine_state.splits[lin.weight]
        if t == 0:
            assert split.device is None  # nothing to rank yet
        else:
            assert split.device.index.tolist() == hot  # chosen at the first step with signal, and kept
    assert opt.stats()["reselections"] == 1
    opt.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp32_parameters_are_their_own_master(dtype):
    """Regression (issue 10.8): `state.master is not p.data` was always true (`p.data` is a new object each time): a
    self-copy of every fp32 1-D parameter per step, its master counted twice in the device bytes and saved in every
    checkpoint."""
    model = make_model(dtype=dtype)
    opt = zenflow_adamw(param_groups(model), lr=LR, topk_ratio=1.0, min_offload_numel=0)
    train(model, opt, batches(2))
    state = roundtrip(opt.state_dict())
    dense = [entry for entry in state["state"].values() if entry["kind"] == "dense"]
    assert len(dense) == 3  # up.bias and the norm
    moments = sum(2 * 4 * p.numel() for p in model.parameters() if p.ndim < 2)
    masters = sum(4 * p.numel() for p in model.parameters() if p.ndim < 2)
    # fp32 master and moments, and the gather buffer in the gradient's dtype
    columns = sum((3 * 4 + dtype.itemsize) * p.numel() for p in model.parameters() if p.ndim == 2)
    if dtype == torch.float32:
        assert all(entry["master"] is None for entry in dense)
        assert opt.stats()["device_state_bytes"] == moments + columns
    else:
        assert all(entry["master"].dtype == torch.float32 for entry in dense)
        assert opt.stats()["device_state_bytes"] == moments + masters + columns
    opt.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_changed_from_outside_are_picked_up(dtype):
    """Regression (issue 10.13): after `model.load_state_dict` (the Trainer's load_best_model_at_end) the fp32
    masters kept the old values, and the next write-back overwrote the loaded weights with stale host results."""
    model = make_model(dtype=dtype)
    opt = zenflow_adamw(param_groups(model), lr=LR, topk_ratio=0.1, update_interval=4, min_offload_numel=0)
    data = batches(12)
    train(model, opt, data[:3])
    best = copy.deepcopy(model.state_dict())
    train(model, opt, data[3:10])  # a write-back is pending (overlapped window)
    model.load_state_dict(best)
    opt.flush()  # nothing new to apply: the loaded weights stay exactly as loaded
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, best[name]), name
    for p in model.parameters():
        assert torch.equal(opt.master_weight(p).to(dtype).view(p.shape), p.detach().cpu())  # (a host tensor)
    opt.close()


def test_training_through_an_outside_weight_change_is_adamw_at_interval_one():
    """With U=1 and no overlap ZenFlow is AdamW, and stays AdamW when the weights are replaced mid-run (torch's
    AdamW keeps its moments and continues from the loaded weights)."""
    data = batches(14)
    runs = []
    for zenflow in (False, True):
        model = make_model()
        opt = (zenflow_adamw(param_groups(model), lr=LR, topk_ratio=0.1, update_interval=1, overlap_step=False,
                             select_strategy="step", select_interval=5, min_offload_numel=0, **FP32_MOMENTS) if zenflow
               else torch.optim.AdamW(param_groups(model), lr=LR))
        train(model, opt, data[:4])
        best = copy.deepcopy(model.state_dict())
        train(model, opt, data[4:10])
        model.load_state_dict(best)
        losses = train(model, opt, data[10:])
        runs.append((model, losses))
    (ref, ref_losses), (model, losses) = runs
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert max_rel_diff(model, ref) < 1e-5


def test_an_ordinary_step_syncs_once_after_launching_the_device_update(monkeypatch):
    """Regression (issue 10.9): `float(clip)` added a second device->host sync per step, and the one `.tolist()`
    sync came before any device kernel was launched, so the device idled while the host waited. Counted here
    through the tensor methods that wait for the device; the order through the fused AdamW call."""
    import hf_zenflow.engine.device_step as device_module

    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, topk_ratio=0.1, update_interval=4, select_strategy="step",
                        select_interval=100, min_offload_numel=0)
    train(model, opt, batches(3), clip=1.0)  # past the first selection
    events: list[str] = []
    caller = threading.current_thread()
    real_adamw = device_module.fused_adamw_

    def adamw(*args, **kwargs):
        events.append("device update")
        return real_adamw(*args, **kwargs)

    def sync(name):
        real = getattr(torch.Tensor, name)

        def counted(self, *args, **kwargs):
            # the caller's syncs only: the host worker's own reads of host tensors (a host step still running from
            # the previous step, as on a busy machine) are not the training thread waiting for the device
            if threading.current_thread() is caller:
                events.append("sync")
            return real(self, *args, **kwargs)
        return counted

    monkeypatch.setattr(device_module, "fused_adamw_", adamw)
    for name in ("tolist", "item", "__float__", "__bool__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, sync(name))
    x, y = (t.to(DEVICE) for t in batches(1, seed=5)[0])
    logits = model(x)
    torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1)).backward()
    opt.clip_grad_norm_(1.0)
    events.clear()
    opt.step()
    monkeypatch.undo()
    assert events.count("sync") == 1, events
    assert events.index("device update") < events.index("sync"), events
    opt.close()


def test_flush_and_checkpoint_after_close_work():
    """`close()` (the Trainer's end of training) and then `flush()` with an open window, or `state_dict()`: the
    worker restarts for the flush instead of failing (`AttributeError` before), and the result is the same as
    without the close."""
    results = []
    for close_first in (False, True):
        model = make_model()
        opt = zenflow_adamw(param_groups(model), lr=LR, topk_ratio=0.1, update_interval=4, min_offload_numel=0)
        train(model, opt, batches(6))  # mid-window, a write-back pending
        if close_first:
            opt.close()
        state = roundtrip(opt.state_dict())
        opt.flush()
        results.append((state["zenflow"], [p.detach().clone() for p in model.parameters()]))
        opt.close()
    (zen_a, weights_a), (zen_b, weights_b) = results
    assert zen_a == zen_b
    for p, q in zip(weights_a, weights_b):
        assert torch.equal(p, q)


# ---- construction checks and copies (issue 22) ------------------------------------------------------------------
@pytest.mark.parametrize("make", [lambda: torch.randn(64, 64)[:, ::2], lambda: torch.randn(64, 40)[:, :32],
                                  lambda: torch.randn(128, 32)[::2], lambda: torch.randn(128)[::2]])
def test_non_dense_parameter_is_refused_at_construction_naming_its_strides(make):
    p = torch.nn.Parameter(make())  # (nn.Parameter keeps the view's strides: a parameter with gaps in memory)
    with pytest.raises(ValueError, match=r"w.*strides"):
        zenflow_adamw([("w", p)], lr=LR, min_offload_numel=0)


def test_dense_permuted_parameter_is_accepted_and_equals_adamw():
    # a dense but permuted 3-D layout (no gaps): the gradient gets the parameter's strides, the update is exact
    base = torch.randn(4, 8, 16).permute(2, 0, 1)
    p, q = torch.nn.Parameter(base.clone()), torch.nn.Parameter(base.clone())
    opt, ref = zenflow_adamw([p], lr=LR, min_offload_numel=0, topk_ratio=0.25), torch.optim.AdamW([q], lr=LR)
    for step in range(6):
        g = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
        for t, o in ((p, opt), (q, ref)):
            t.grad = g.clone()
            o.step()
    opt.flush()
    opt.close()
    assert (p - q).abs().max() < 1e-6


def test_duplicate_parameter_in_one_list_is_refused():
    p = torch.nn.Parameter(torch.randn(8, 8))
    with pytest.raises(ValueError, match="more than once"):
        zenflow_adamw([p, p], lr=LR)


def test_float64_parameter_is_refused_naming_the_dtype():
    p = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="float64"):
        zenflow_adamw([("w", p)], lr=LR)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copy_and_pickle_are_refused_at_copy_time(how):
    import pickle

    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, min_offload_numel=0)
    with pytest.raises(TypeError, match="state_dict"):
        copy.deepcopy(opt) if how == "deepcopy" else pickle.dumps(opt)
    opt.close()


@pytest.mark.parametrize("optimizer", [ZenFlowAdamW, SyncOffloadAdamW])
@pytest.mark.parametrize(("name", "value"), [
    ("lr", float("inf")), ("lr", float("nan")), ("lr", True), ("lr", "1e-3"), ("eps", float("inf")),
    ("weight_decay", float("inf")), ("weight_decay", -float("inf")), ("betas", (False, 0.999)),
    ("betas", (0.9, float("nan"))), ("betas", (0.9,)),
])
def test_a_hyper_parameter_that_is_not_a_finite_number_is_refused_naming_it(optimizer, name, value):
    """Regression: `lr=float("inf")` was accepted (every step then skipped, blamed on a NaN loss), as were an
    infinite eps or weight decay and a bool for a beta."""
    model = make_model()
    with pytest.raises(ValueError, match=rf"^{name}=.* is invalid: allowed is"):
        optimizer(model.parameters(), **{name: value})
    with pytest.raises(ValueError, match=rf"^{name}=.* is invalid"):  # a param group's own value, too
        optimizer([{"params": list(model.parameters()), name: value}])
