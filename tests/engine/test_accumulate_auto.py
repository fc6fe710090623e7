"""``accumulate_on="auto"`` (the default): the fastest place to sum the windows that fits the device memory and the
host RAM, then the smallest (`hf_zenflow.engine.planner`): the host when its RAM holds host sums, the device when only
device sums fit the host's RAM and the device has room for them; decided once at the first step, the same on every
rank, kept by checkpoints."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from hf_zenflow import ZenFlowAdamW, ZenFlowConfig
from hf_zenflow.engine import accumulation, planner
from hf_zenflow.settings.rules import EngineRules
from hf_zenflow.transport import CudaTransport
from tests.conftest import (
    DEVICE,
    batches,
    linear_schedule,
    make_model,
    param_groups,
    plan_with_host_ram,
    roundtrip,
    step_peak,
    train,
    zenflow_adamw,
    zenflow_config,
)


LR = 1e-2
#: (host sums in fp32 over every column with a write-back buffer, 16 B: `SHORT_HOST` holds device sums only)
SETTINGS = dict(topk_ratio=0.1, update_interval=4, select_strategy="step", select_interval=8, min_offload_numel=0,
                host_sum_dtype="float32", host_sum_columns="all", host_writeback="buffer")
#: device memory limits, in bytes: FITS far above the tiny model's step and its window sums and selected columns
#: (~36 KB), TOO_SMALL (`too_small`) 1000 bytes above the step's estimated peak
FITS, TOO_SMALL = 1 << 30, "too small"
#: Host RAM for the tiny fp32 model's host state with fp32 device sums (12 B per offloaded element on a CPU device:
#: master, bf16 moments, the sum that is also the write-back buffer) but not with host sums (16: the sum and the
#: write-back buffer apart) nor bf16 device sums (14: a bf16 accumulator and the write-back buffer apart).
SHORT_HOST = 13 * sum(p.numel() for p in make_model().parameters() if p.ndim >= 2)


def limit(room: int | str, settings: dict = SETTINGS) -> int:
    """`room` as a `device_memory_limit_bytes`: FITS as it is, TOO_SMALL 1000 bytes of room beside the step."""
    return step_peak(settings) + 1000 if room == TOO_SMALL else room


def run(steps: int, **settings) -> tuple[torch.nn.Module, list[float], dict]:
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, **{**SETTINGS, **settings})
    losses = train(model, opt, batches(steps), linear_schedule(opt, steps), clip=1.0)
    opt.flush()
    stats = opt.stats()
    opt.close()
    return model, losses, stats


def test_auto_is_the_default_and_undecided_before_the_first_step():
    assert ZenFlowConfig().rules.accumulate_on == "auto"
    opt = ZenFlowAdamW(param_groups(make_model()), lr=LR)
    assert opt.stats()["accumulate_on"] == "auto"
    opt.close()


@pytest.fixture
def short_host(monkeypatch) -> None:
    plan_with_host_ram(monkeypatch, SHORT_HOST)


@pytest.mark.parametrize(("room", "host_ram", "expected"), [(FITS, None, "host"), (FITS, SHORT_HOST, "device"),
                                                            (TOO_SMALL, SHORT_HOST, "host")])
def test_auto_chooses_by_memory_and_trains_bitwise_like_the_explicit_setting(room, host_ram, expected, caplog,
                                                                            monkeypatch):
    """With room on the host (None: unknown, counted as room) host sums are the fastest; where the host is short and
    the device has room, device sums; where neither has room, host sums (the device never overflows first)."""
    plan_with_host_ram(monkeypatch, host_ram)
    limit_bytes = limit(room)
    with caplog.at_level(logging.INFO, logger="hf_zenflow"):
        auto_model, auto_losses, auto_stats = run(14, device_memory_limit_bytes=limit_bytes)
    assert auto_stats["accumulate_on"] == expected
    chosen = [r.getMessage() for r in caplog.records if 'accumulate_on="auto" chose' in r.getMessage()]
    assert len(chosen) == 1 and f'chose "{expected}"' in chosen[0]
    ref_model, ref_losses, ref_stats = run(14, accumulate_on=expected)
    assert ref_stats["accumulate_on"] == expected
    assert auto_losses == ref_losses
    assert all(torch.equal(p, q) for p, q in zip(auto_model.parameters(), ref_model.parameters()))
    # the same memory layout as the explicit run: window sums on the device only when it chose the device
    assert auto_stats["device_state_bytes"] == ref_stats["device_state_bytes"]
    assert auto_stats["host_state_bytes"] == ref_stats["host_state_bytes"]


@pytest.mark.skipif(DEVICE.type != "cpu", reason="a CPU device's memory is unknown without a limit")
def test_a_cpu_device_without_a_limit_accumulates_on_the_host():
    _, _, stats = run(5)
    assert stats["accumulate_on"] == "host"


@pytest.mark.parametrize(("first", "then", "kept"), [(FITS, TOO_SMALL, "device"), (TOO_SMALL, FITS, "host")])
def test_a_resumed_run_keeps_its_choice_and_continues_exactly(first, then, kept, short_host):
    total, split_at = 22, 6  # mid-window, with a host step in flight
    data = batches(total)
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, **SETTINGS, device_memory_limit_bytes=limit(first))
    full_losses = train(model, opt, data, linear_schedule(opt, total), clip=1.0)
    assert opt.stats()["accumulate_on"] == kept
    opt.close()

    model_a = make_model()
    opt_a = zenflow_adamw(param_groups(model_a), lr=LR, **SETTINGS, device_memory_limit_bytes=limit(first))
    sched_a = linear_schedule(opt_a, total)
    head = train(model_a, opt_a, data[:split_at], sched_a, clip=1.0)
    checkpoint = roundtrip({"model": model_a.state_dict(), "opt": opt_a.state_dict(), "sched": sched_a.state_dict()})
    opt_a.close()
    assert checkpoint["opt"]["zenflow"]["accumulate_on"] == kept

    model_b = make_model(seed=123)
    model_b.load_state_dict(checkpoint["model"])
    # this limit alone would choose the other place: the checkpoint's choice wins
    opt_b = zenflow_adamw(param_groups(model_b), lr=LR, **SETTINGS, device_memory_limit_bytes=limit(then))
    sched_b = linear_schedule(opt_b, total)
    opt_b.load_state_dict(checkpoint["opt"])
    sched_b.load_state_dict(checkpoint["sched"])
    assert opt_b.stats()["accumulate_on"] == kept
    window_sums_on_device = any(s.window_sum is not None for s in opt_b.engine_state.splits.values())
    assert window_sums_on_device == (kept == "device")
    tail = train(model_b, opt_b, data[split_at:], sched_b, clip=1.0)
    assert opt_b.stats()["accumulate_on"] == kept
    opt_b.close()
    assert head + tail == full_losses
    assert all(torch.equal(p, q) for p, q in zip(model_b.parameters(), model.parameters()))


def test_an_explicit_setting_on_resume_replaces_the_saved_choice():
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, **SETTINGS, device_memory_limit_bytes=FITS)
    train(model, opt, batches(6), clip=1.0)
    state = roundtrip(opt.state_dict())
    opt.close()
    fresh = zenflow_adamw(param_groups(model), lr=LR, **SETTINGS, accumulate_on="host")
    fresh.load_state_dict(state)
    assert fresh.stats()["accumulate_on"] == "host"
    assert all(s.window_sum is None for s in fresh.engine_state.splits.values())
    fresh.close()


@pytest.mark.parametrize(("field", "value", "allowed"), [
    ("accumulate_on", "gpu", '"auto" | "host" | "device"'),
    ("accumulate_on", 1, '"auto" | "host" | "device"'),
    ("device_memory_limit_bytes", -1, "None or an integer >= 0"),
    ("device_memory_limit_bytes", 1.5, "None or an integer >= 0"),
])
def test_invalid_values_are_refused_naming_field_value_and_allowed(field, value, allowed):
    with pytest.raises(ValueError) as err:
        zenflow_config(**{field: value})
    owner = "EngineRules" if field in EngineRules.names() else "ZenFlowConfig"
    assert f"{owner}.{field}={value!r} is invalid" in str(err.value)
    assert allowed in str(err.value)


def test_choices_are_case_insensitive():
    assert zenflow_config(accumulate_on=" AUTO").rules.accumulate_on == "auto"


def test_cuda_spare_memory_is_free_plus_cache_minus_the_peak(monkeypatch):
    """The CUDA figure, with the allocator's numbers faked: the next step needs its peak again."""
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 30 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 36 * gib)
    cuda = torch.device("cuda", 0)
    assert accumulation.available_bytes(cuda, None) == (4 * gib, 80 * gib)
    # a limit caps it: the limit less the step's peak, within the measured room
    assert accumulation.available_bytes(cuda, 37 * gib) == (gib, 37 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 50 * gib)
    assert accumulation.available_bytes(cuda, None) == (0, 80 * gib)
    assert accumulation.available_bytes(torch.device("cpu"), None) == (None, None)
    assert accumulation.available_bytes(torch.device("cpu"), 5) == (5, 5)
    assert accumulation.available_bytes(torch.device("cpu"), 5, peak=3) == (2, 5)


def _agreement_run(rank: int, init_file: str, out_dir: str, limits: tuple[int, int]) -> None:
    from gloo_ranks import run_in_group

    run_in_group(rank, init_file, _agreement_run_body, out_dir, limits)


def _agreement_run_body(rank: int, out_dir: str, limits: tuple[int, int]) -> None:
    from hf_zenflow.engine import planner

    planner.host_room = lambda: SHORT_HOST  # (this rank's process: device sums where its device has room)
    model = make_model().cpu()
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    opt = zenflow_adamw(param_groups(model), lr=LR, **SETTINGS, cpu_threads=1,
                        device_memory_limit_bytes=limits[rank])
    for x, y in batches(6, seed=rank):
        loss = torch.nn.functional.cross_entropy(wrapped(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    opt.flush()
    torch.save({"chosen": opt.stats()["accumulate_on"], "weights": [p.detach() for p in model.parameters()]},
               f"{out_dir}/rank{rank}.pt")
    opt.close()


def test_ranks_agree_on_the_most_conservative_choice(tmp_path):
    """With the host short for host sums, rank 0's limit fits device sums, rank 1's does not: both accumulate on
    the host (one spawn of two gloo ranks)."""
    from gloo_ranks import spawn_ranks

    spawn_ranks(_agreement_run, str(tmp_path), (FITS, limit(TOO_SMALL)))
    a, b = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    assert a["chosen"] == b["chosen"] == "host"
    assert all(torch.equal(p, q) for p, q in zip(a["weights"], b["weights"]))



class _Split:
    """What the planner reads of a matrix: the device and dtype of its parameter, its [rows, columns] shape (a meta
    tensor) and its selected columns."""

    def __init__(self, device: torch.device, rows: int, columns: int, k: int) -> None:
        shape = torch.empty((rows, columns), device="meta")
        self.param = SimpleNamespace(device=device, shape=shape, dtype=torch.float32, element_size=lambda: 4)
        self.columns, self.k = columns, k
        self.grad_dtype = torch.float32  # (its selected columns: 16 B per element)

    def matrix(self, param: SimpleNamespace) -> torch.Tensor:
        return param.shape


class _WholeShare:
    ranks = 1

    def local(self, matrix: torch.Tensor) -> torch.Tensor:
        return matrix


@pytest.mark.parametrize(("spare_mib", "expected"), [((64, 64), "device"), ((64, 5), "device_bf16"),
                                                     ((64, 2), "host"), ((2, 64), "host")])
def test_a_model_over_several_gpus_gets_device_sums_only_where_every_gpu_has_room(spare_mib, expected, monkeypatch):
    """``device_map``: each GPU holds the window sums of its own matrices, so each must have room for them. Before:
    only the first parameter's GPU was measured (here GPU 0, roomy), and a full GPU 1 got fp32 sums anyway. (The
    host's RAM here holds device sums, not host sums.)"""
    mib = 1 << 20
    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    # one matrix of 1 Mi elements per GPU: fp32 sums 4 MiB, bf16 sums 2 MiB, plus 1 MiB of selected columns (16 B
    # per selected element); the margin is 1 MiB of each GPU's 10
    splits = [_Split(gpu, 1024, 1024, k=64) for gpu in gpus]
    shares = {id(s): _WholeShare() for s in splits}
    spare = dict(zip(gpus, spare_mib))
    monkeypatch.setattr(planner, "available_bytes", lambda device, *limits: (spare[device] * mib, 10 * mib))
    # fp32 weights on CUDA: 17.9 B per element with host sums (two fp32 landing slots), 12 with fp32 device sums,
    # 10 with bf16 ones, against 14.4 B of room (the RAM less the planner's 10 %); the transport's rings, a fixed
    # 128 MiB each, left out: they would dwarf this model
    plan_with_host_ram(monkeypatch, 16 * 2 * mib)
    gpus_transport = CudaTransport()  # (one per device type, as the engine's `Transports` keeps them)
    monkeypatch.setattr(gpus_transport, "fixed_host_bytes", lambda *rings: 0)
    sizes = planner.RunSizes(splits, shares, lambda split: gpus_transport, 2 * mib, 2 * mib)
    chosen = planner.plan_accumulation(zenflow_config(accumulate_on="auto"), sizes, SimpleNamespace(ranks=1))
    assert chosen == expected
