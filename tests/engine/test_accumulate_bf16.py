"""``accumulate_on="device_bf16"``: the window summed on the device in bf16 (each add computed in fp32, the running sum
rounded to nearest bf16), shipped as bf16 and widened into the host's fp32 accumulator; "auto", with the host's RAM
short for host sums, picks it exactly when fp32 sums do not fit the device with the margin and bf16 sums do
(`hf_zenflow.engine.planner`)."""

from __future__ import annotations

import itertools
import logging
import math

import pytest
import torch

import hf_zenflow.engine.accumulation as accumulation_module
import hf_zenflow.transport as transport_module
from hf_zenflow import ZenFlowAdamW
from hf_zenflow.engine import accumulation
from hf_zenflow.engine.host import accumulate_into
from hf_zenflow.transport import CopyTransport, CpuDeviceTransport
from tests.conftest import (
    DEVICE,
    batches,
    linear_schedule,
    make_model,
    param_groups,
    plan_with_host_ram,
    roundtrip,
    smallest_limit_that_fits,
    step_peak,
    train,
    zenflow_adamw,
)
from tests.doubles.async_device import async_transport


LR = 1e-2
# (the boundaries here are the sums' alone: with the gradients freed in backward, device sums also count the
# gradients they keep on the device, `tests/engine/test_free_gradients.py`)
# (host sums in fp32 over every column with a write-back buffer, 16 B, so that a short host holds device sums only)
SETTINGS = dict(topk_ratio=0.1, update_interval=4, select_strategy="step", select_interval=8, min_offload_numel=0,
                high_lr_rule="off", free_gradients_in_backward="off", host_sum_dtype="float32",
                host_sum_columns="all", host_writeback="buffer")
FITS = 1 << 30  # bytes: a device memory limit far above the tiny model's step, window sums and selected columns
#: Host RAM for the tiny fp32 model's host state with device sums (12 B per offloaded element on a CPU device with
#: fp32 sums, 14 with bf16 ones) but not with host sums (16): "auto" then weighs the device sums against the device.
DEVICE_SUMS_ONLY = 15 * sum(p.numel() for p in make_model().parameters() if p.ndim >= 2)


@pytest.fixture(autouse=True)
def host_short_for_host_sums(monkeypatch) -> None:
    plan_with_host_ram(monkeypatch, DEVICE_SUMS_ONLY)


def run(steps: int, **settings) -> tuple[torch.nn.Module, list[float], ZenFlowAdamW, list[dict]]:
    """Train `steps` steps (clipped: the clip coefficient scales every add); returns the optimizer, flushed and
    closed, and the stats after every step."""
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, **{**SETTINGS, **settings})
    per_step: list[dict] = []
    schedule = linear_schedule(opt, steps)
    losses = []
    for batch in batches(steps):
        losses += train(model, opt, [batch], schedule, clip=1.0)
        per_step.append(opt.stats())
    opt.flush()
    opt.close()
    return model, losses, opt, per_step


def sums_needed(settings: dict) -> tuple[int, int]:
    """What "auto" weighs for the tiny model: its window sums (fp32, bf16) plus the selected columns' state."""
    _, _, opt, _ = run(1, accumulate_on="device", **settings)
    splits = [s for s in opt.engine_state.splits.values() if s.host is not None]
    shares = {id(s): s.share for s in splits}
    return (accumulation.device_bytes_needed(splits, shares, 4), accumulation.device_bytes_needed(splits, shares, 2))


def test_auto_chooses_fp32_then_bf16_then_host_at_the_exact_boundaries(caplog):
    need32, need16 = sums_needed({})
    assert need16 < need32  # (half the sums' bytes; the selected columns' state is the same)
    at32, at16 = smallest_limit_that_fits(SETTINGS, need32), smallest_limit_that_fits(SETTINGS, need16)
    cases = [(at32, "device"), (at32 - 1, "device_bf16"), (at16, "device_bf16"), (at16 - 1, "host")]
    for limit, expected in cases:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hf_zenflow"):
            _, _, opt, per_step = run(2, device_memory_limit_bytes=limit)
        assert per_step[-1]["accumulate_on"] == expected, limit
        chosen = [r.getMessage() for r in caplog.records if 'accumulate_on="auto" chose' in r.getMessage()]
        assert len(chosen) == 1 and f'chose "{expected}"' in chosen[0]
        sums = [s.window_sum for s in opt.engine_state.splits.values() if s.host is not None]
        expected_dtype = accumulation.DEVICE_SUM_DTYPES.get(expected)
        assert all((t is None if expected_dtype is None else t.dtype == expected_dtype) for t in sums)


def within_half_a_bf16_ulp(value: torch.Tensor, exact: torch.Tensor, terms: torch.Tensor) -> bool:
    """Every element of `value` within half a bf16 ulp of `exact` (float64), plus the fp32 arithmetic's own rounding
    (at most 2**-23 of the terms' magnitudes `terms`: it shows where the add cancels)."""
    ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
    return bool(((value.double() - exact).abs() <= 0.5 * ulp + 2.0**-23 * terms + 1e-30).all())


def test_a_bf16_add_is_the_fp32_add_rounded_to_nearest():
    """One add into a bf16 sum = the fp32 rule (`accumulate_into` on an fp32 sum) on the widened sum, rounded to
    nearest bf16, bit for bit; so within half a bf16 ulp of the exact ``sum + coef * grad`` (a hand loop in float64).
    torch's in-place bf16 add on CPU is not: it rounds the clip coefficient to bf16 first. Several pieces on the CPU
    (`bf16_sum_piece_elems`) and a strided gradient (a share's columns); on `DEVICE`."""
    torch.manual_seed(0)
    rows, cols = 1100, 4000  # > NARROW_CHUNK elements: three pieces
    for grad_dtype, coef in itertools.product((torch.float32, torch.bfloat16), (None, 0.37)):
        grads = [torch.randn(rows, cols + 7)[:, 3 : cols + 3].to(DEVICE, grad_dtype) for _ in range(4)]
        narrow = torch.empty(rows, cols, dtype=torch.bfloat16, device=DEVICE)
        wide = torch.empty(rows, cols, device=DEVICE)
        for i, g in enumerate(grads):
            before = narrow.clone()
            accumulate_into(narrow, g, coef, first=i == 0)
            accumulate_into(wide, g, coef, first=i == 0)
            wide.copy_(wide.bfloat16())  # the reference: the fp32 sum rounded after every add
            assert torch.equal(narrow.float(), wide), (grad_dtype, coef, i)
            term = (1.0 if coef is None else coef) * g.double()
            exact = (0.0 if i == 0 else before.double()) + term
            terms = term.abs() + (0.0 if i == 0 else before.double().abs())
            assert within_half_a_bf16_ulp(narrow, exact, terms), (grad_dtype, coef, i)
            if coef is not None and i > 0 and grad_dtype == torch.bfloat16 and DEVICE.type == "cpu":
                torch_add = before.add_(g, alpha=coef)  # (what the bound rules out, on the CPU)
                assert not within_half_a_bf16_ulp(torch_add, exact, terms)


def rounded_device_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference: ``accumulate_on="device"`` (fp32 sums) with the window sum passed through bf16 after every
    device add."""

    def add_then_round(accum, grad2d, coef, first):
        accumulate_into(accum, grad2d, coef, first)
        accum.copy_(accum.bfloat16())

    monkeypatch.setattr(accumulation_module, "accumulate_into", add_then_round)


def test_device_bf16_is_the_fp32_device_schedule_rounded_after_every_add(monkeypatch):
    model, losses, _, stats = run(26, accumulate_on="device_bf16")
    assert stats[-1]["accumulate_on"] == "device_bf16"
    fp32_model, fp32_losses, _, _ = run(26, accumulate_on="device")
    with monkeypatch.context() as patch:
        rounded_device_schedule(patch)
        ref_model, ref_losses, _, _ = run(26, accumulate_on="device")
    assert losses == ref_losses
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))
    # the rounding is real: fp32 sums give other weights
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), fp32_model.parameters()))


def test_link_bytes_per_window_are_half_and_device_bytes_two_per_element_less():
    _, _, _, fp32 = run(14, accumulate_on="device")
    _, _, opt, bf16 = run(14, accumulate_on="device_bf16")
    hosted = sum(s.host.master.numel() for s in opt.engine_state.splits.values() if s.host is not None)
    closes = [i for i, st in enumerate(fp32) if st["windows"] > (fp32[i - 1]["windows"] if i else 0)]
    shipped = 0
    for a, b in zip(fp32, bf16):
        assert a["bytes_to_device"] == b["bytes_to_device"]  # (write-backs and column moves: unchanged)
    for i in range(len(fp32)):
        extra32 = fp32[i]["bytes_to_host"]
        extra16 = bf16[i]["bytes_to_host"]
        if i in closes and i >= 1:  # (past the warm-up step, whose one-step window is summed the same way)
            # the sums of every offloaded element, fp32 vs bf16; anything else that crossed is the same in both
            assert extra32 - extra16 == 2 * hosted, i
            shipped += 1
        else:
            assert extra32 == extra16, i
    assert shipped >= 3
    assert fp32[-1]["device_state_bytes"] - bf16[-1]["device_state_bytes"] == 2 * hosted
    # the host's accumulator is bf16 (2 B) and no longer the fp32 write-back buffer (4 B): 2 B per element more
    assert bf16[-1]["host_state_bytes"] - fp32[-1]["host_state_bytes"] == 2 * hosted
    assert bf16[-1]["host_bytes_per_param"] == pytest.approx(fp32[-1]["host_bytes_per_param"] + 2)


def resume(
    settings_first: dict, settings_then: dict, total: int = 22, split_at: int = 6
) -> tuple[list[float], list[float], torch.nn.Module, torch.nn.Module, dict, ZenFlowAdamW]:
    """Train `total` steps straight, and again with a checkpoint at `split_at` (mid-window, a host step in
    flight) resumed under `settings_then`."""
    data = batches(total)
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, **SETTINGS, **settings_first)
    full = train(model, opt, data, linear_schedule(opt, total), clip=1.0)
    opt.close()

    model_a = make_model()
    opt_a = zenflow_adamw(param_groups(model_a), lr=LR, **SETTINGS, **settings_first)
    sched_a = linear_schedule(opt_a, total)
    head = train(model_a, opt_a, data[:split_at], sched_a, clip=1.0)
    checkpoint = roundtrip({"model": model_a.state_dict(), "opt": opt_a.state_dict(), "sched": sched_a.state_dict()})
    opt_a.close()

    model_b = make_model(seed=123)
    model_b.load_state_dict(checkpoint["model"])
    opt_b = zenflow_adamw(param_groups(model_b), lr=LR, **SETTINGS, **settings_then)
    sched_b = linear_schedule(opt_b, total)
    opt_b.load_state_dict(checkpoint["opt"])
    sched_b.load_state_dict(checkpoint["sched"])
    chosen = opt_b.stats()["accumulate_on"]
    tail = train(model_b, opt_b, data[split_at:], sched_b, clip=1.0)
    opt_b.close()
    return full, head + tail, model, model_b, {"checkpoint": checkpoint, "chosen": chosen}, opt_b


@pytest.mark.parametrize(
    ("first", "then"),
    [
        (dict(accumulate_on="device_bf16"), dict(accumulate_on="device_bf16")),
        # "auto" chose bf16 sums; the resumed run's limit alone would choose fp32 sums: the checkpoint's choice wins
        (dict(device_memory_limit_bytes="bf16"), dict(device_memory_limit_bytes=FITS)),
    ],
)
def test_a_resume_mid_window_continues_exactly(first, then):
    if first.get("device_memory_limit_bytes") == "bf16":
        need32, _ = sums_needed({})
        first = dict(device_memory_limit_bytes=smallest_limit_that_fits(SETTINGS, need32) - 1)
    full, resumed, model, model_b, seen, opt_b = resume(first, then)
    saved = seen["checkpoint"]["opt"]
    assert saved["zenflow"]["accumulate_on"] == "device_bf16"
    open_sums = [e["accum"] for e in saved["state"].values() if e.get("kind") == "split" and e["accum_count"]]
    assert open_sums and all(t.dtype == torch.bfloat16 for t in open_sums)  # (saved as it is kept)
    assert seen["chosen"] == "device_bf16"
    assert all(s.window_sum is None or s.window_sum.dtype == torch.bfloat16
               for s in opt_b.engine_state.splits.values())
    assert resumed == full
    assert all(torch.equal(p, q) for p, q in zip(model_b.parameters(), model.parameters()))


@pytest.mark.parametrize("then", ["host", "device"])
def test_a_bf16_checkpoint_loads_under_another_accumulation_with_its_open_window(then):
    """Another setting takes the open window's sum where it keeps it (widened exactly) and trains on."""
    data = batches(10)
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, **SETTINGS, accumulate_on="device_bf16")
    train(model, opt, data[:6], clip=1.0)
    state = roundtrip(opt.state_dict())
    opt.close()
    fresh = zenflow_adamw(param_groups(model), lr=LR, **SETTINGS, accumulate_on=then)
    fresh.load_state_dict(state)
    assert fresh.stats()["accumulate_on"] == then
    entries = [e for e in state["state"].values() if e.get("kind") == "split" and e["accum_count"]]
    splits = [s for s in fresh.engine_state.splits.values() if s.host is not None]
    assert entries and len(entries) == len(splits)
    for entry, split in zip(entries, splits):
        held = split.window_sum if then == "device" else split.host.accum
        assert held.dtype == torch.float32 and torch.equal(held, entry["accum"].float())  # (widened exactly)
    train(model, fresh, data[6:], clip=1.0)
    fresh.flush()
    assert fresh.stats()["windows"] > 0 and all(torch.isfinite(p).all() for p in model.parameters())
    fresh.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copying_and_asynchronous_transports_give_the_cpu_device_bits(dtype, monkeypatch):
    """CUDA's schedule (a bf16 sum copied into the pinned bf16 accumulator, on a side stream, with the worker
    waiting for its event before its pass widens it), with copies that land late (`tests/doubles/async_device`), gives
    the CPU device's bits (a buffer swap). On CUDA: CUDA's own transport gives the bits of every copy synchronous
    (`CopyTransport` over pageable memory)."""
    results, backends = [], []
    seeds = itertools.count(7)

    def asynchronous(device):
        transport, backend = async_transport(next(seeds))
        backends.append(backend)
        return transport

    cuda_own = transport_module.transport_for
    factories = ((lambda device: CpuDeviceTransport(), lambda device: CopyTransport(), asynchronous)
                 if DEVICE.type == "cpu" else (lambda device: CopyTransport(), cuda_own))
    for factory in factories:
        monkeypatch.setattr("hf_zenflow.transport.transport_for", factory)
        model = make_model(dtype=dtype)
        opt = zenflow_adamw(param_groups(model), lr=LR, **SETTINGS, accumulate_on="device_bf16")
        losses = train(model, opt, batches(22), linear_schedule(opt, 22), clip=1.0)
        opt.flush()
        assert opt.stats()["windows"] > 0
        assert all(s.host.accum.dtype == torch.bfloat16
                   for s in opt.engine_state.splits.values() if s.host is not None)
        opt.close()
        results.append((losses, [p.detach().clone() for p in model.parameters()]))
    for backend in backends:
        backend.synchronize(torch.device("cpu"))
        backend.check()
    assert DEVICE.type != "cpu" or sum(b.copies for b in backends) > 0
    (cpu_losses, cpu_weights), *others = results
    for losses, weights in others:
        assert losses == cpu_losses
        assert all(torch.equal(p, q) for p, q in zip(weights, cpu_weights))


def _ranks_run(rank: int, init_file: str, out_dir: str, limits: tuple[int, int]) -> None:
    from gloo_ranks import run_in_group

    run_in_group(rank, init_file, _ranks_run_body, out_dir, limits)


def _ranks_run_body(rank: int, out_dir: str, limits: tuple[int, int]) -> None:
    from hf_zenflow.engine import planner

    planner.host_room = lambda: DEVICE_SUMS_ONLY / 2  # (this rank's process, half the host state: short for host sums)
    model = make_model().cpu()
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    opt = zenflow_adamw(
        param_groups(model), lr=LR, **SETTINGS, cpu_threads=1, device_memory_limit_bytes=limits[rank]
    )
    for x, y in batches(10, seed=rank):
        loss = torch.nn.functional.cross_entropy(wrapped(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    opt.flush()
    sums = {str(s.window_sum.dtype) for s in opt.engine_state.splits.values() if s.window_sum is not None}
    torch.save(
        {
            "chosen": opt.stats()["accumulate_on"],
            "sums": sorted(sums),
            "weights": [p.detach() for p in model.parameters()],
        },
        f"{out_dir}/rank{rank}.pt",
    )
    opt.close()


def test_ranks_agree_on_bf16_sums_when_one_rank_fits_only_those(tmp_path):
    """Rank 0 fits fp32 sums, rank 1 (its share of the sums: half) only bf16 ones: both sum in bf16, and their
    weights agree bit for bit (one spawn of two gloo ranks)."""
    from gloo_ranks import spawn_ranks

    need32, need16 = sums_needed({})
    hosted_bytes = (need32 - need16) // 2  # 2 B per hosted element (one process), the rest is the selected state
    selected = need16 - 2 * hosted_bytes
    # each rank's share: half the sums; room midway between its bf16 and fp32 needs beside the step (each rank's
    # step holds the whole model on its device, as one process's does)
    per_rank32, per_rank16 = 2 * hosted_bytes + selected, hosted_bytes + selected
    only_bf16 = math.ceil(((per_rank32 + per_rank16) / 2 + step_peak(SETTINGS)) / (1 - accumulation.MARGIN))
    spawn_ranks(_ranks_run, str(tmp_path), (FITS, only_bf16))
    a, b = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    assert a["chosen"] == b["chosen"] == "device_bf16"
    assert a["sums"] == b["sums"] == ["torch.bfloat16"]
    assert all(torch.equal(p, q) for p, q in zip(a["weights"], b["weights"]))


@pytest.mark.parametrize("saved_under", ["host", "device"])
def test_an_fp32_checkpoint_loads_under_device_bf16_its_open_window_rounded(saved_under):
    data = batches(10)
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, **SETTINGS, accumulate_on=saved_under)
    train(model, opt, data[:6], clip=1.0)
    state = roundtrip(opt.state_dict())
    opt.close()
    fresh = zenflow_adamw(param_groups(model), lr=LR, **SETTINGS, accumulate_on="device_bf16")
    fresh.load_state_dict(state)
    assert fresh.stats()["accumulate_on"] == "device_bf16"
    entries = [e for e in state["state"].values() if e.get("kind") == "split" and e["accum_count"]]
    splits = [s for s in fresh.engine_state.splits.values() if s.host is not None]
    assert entries and len(entries) == len(splits)
    for entry, split in zip(entries, splits):
        assert split.window_count == entry["accum_count"]
        assert torch.equal(split.window_sum, entry["accum"].bfloat16())
    train(model, fresh, data[6:], clip=1.0)
    fresh.flush()
    assert fresh.stats()["windows"] > 0 and all(torch.isfinite(p).all() for p in model.parameters())
    fresh.close()
