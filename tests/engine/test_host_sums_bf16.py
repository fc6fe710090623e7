"""The host's smallest state: bf16 window sums on the host (``host_sum_dtype="bfloat16"``) and the write-back read
from the fp32 master (``host_writeback="master"``).

References: a bf16 host sum is the fp32 rule rounded to nearest bf16 after every add, computed here with torch's
own operations, and the same rule summed on the device (``accumulate_on="device_bf16"``) gives the same weights bit
for bit; with every column on the host and one-step windows ZenFlow is torch's AdamW on gradients rounded to bf16.
The write-back from the master changes no bit of the weights. With 8-bit moments the host tensors hold 8.03 B per
offloaded parameter (fp32 master 4, codes 2, an fp32 scale per 256 elements of each moment, the bf16 sum 2)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import hf_zenflow.engine.host as host_module
from hf_zenflow import ZenFlowAdamW, to_torch_adamw
from hf_zenflow.checkpoint import CheckpointError
from hf_zenflow.engine.host import HostLayout, HostMatrix, accumulate_into, host_adamw_window
from hf_zenflow.engine.quantized_moments import BLOCK, QuantizedMoment
from hf_zenflow.transport import CopyTransport, Transport
from hf_zenflow.transport.cpu_device import kernels
from tests.conftest import DEVICE, batches, make_model, param_groups, roundtrip, train, zenflow_adamw, zenflow_config


LR = 1e-2
LEAN = dict(host_sum_dtype="bfloat16", host_sum_columns="all", host_writeback="master", accumulate_on="host")
#: the host state of fp32 host sums of every column and a write-back buffer
FP32_SUMS = dict(accumulate_on="host", host_sum_dtype="float32", host_sum_columns="all", host_writeback="buffer")
SPLIT = dict(topk_ratio=0.25, update_interval=3, overlap_step=True, writeback_lag=1, select_strategy="step",
             select_interval=4, min_offload_numel=0, cpu_threads=1, high_lr_rule="off")

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU device's host passes (a CUDA run: cuda_checks)")
native = pytest.mark.skipif(kernels.library() is None, reason="no C compiler: the kernels are not built")


def _torch_bf16_sum(grads: list[torch.Tensor], coef: float | None) -> torch.Tensor:
    """The reference rule with torch's operations: widen the running sum, add in fp32, round to nearest bf16."""
    total = None
    for g in grads:
        wide = g.float() * coef if coef is not None else g.float().clone()
        if total is not None:
            wide = total.float().add_(g.float(), alpha=coef) if coef is not None else total.float().add_(g.float())
        total = wide.to(torch.bfloat16)
    return total


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("coef", [None, 0.37])
@pytest.mark.parametrize("use_kernels", [True, False])
def test_bf16_host_sum_is_the_fp32_rule_rounded_after_every_add(monkeypatch, grad_dtype, coef, use_kernels):
    if use_kernels and kernels.library() is None:
        pytest.skip("no C compiler")
    if not use_kernels:
        monkeypatch.setenv("HF_ZENFLOW_NATIVE", "0")
    gen = torch.Generator().manual_seed(3)
    grads = [(torch.randn(37, 301, generator=gen) * 10 ** i).to(grad_dtype) for i in range(-2, 3)]
    host = HostMatrix.create(torch.zeros(37, 301), grad_dtype, moments=HostLayout(sums=torch.bfloat16))
    assert host.accum.dtype == torch.bfloat16
    for g in grads:
        host.accumulate(g, coef)
    expected = _torch_bf16_sum(grads, coef)
    assert torch.equal(host.accum, expected)
    fp32 = torch.zeros(37, 301)
    for i, g in enumerate(grads):
        accumulate_into(fp32, g, coef, first=i == 0)
    assert not torch.equal(host.accum.float(), fp32)  # (the rounding acts: the comparison says something)


MOMENTS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}


def _host(kind: str, sums: torch.dtype) -> HostMatrix:
    """A matrix's host state with moments of `kind` and window sums in `sums`, the same values at every call."""
    gen = torch.Generator().manual_seed(5)
    host = HostMatrix.create(torch.randn(29, 1031, generator=gen), torch.float32,
                             moments=HostLayout(moments=MOMENTS[kind], sums=sums))
    host.exp_avg.copy_(torch.randn(29, 1031, generator=gen) * 0.01)
    host.exp_avg_sq.copy_(torch.rand(29, 1031, generator=gen) * 1e-4)
    return host


def _values(host: HostMatrix) -> list[torch.Tensor]:
    return [t.codes if isinstance(t, QuantizedMoment) else t for t in (host.master, host.exp_avg, host.exp_avg_sq)]


@native
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("fold", [True, False])
def test_window_pass_on_a_bf16_sum_is_widen_divide_and_the_fp32_pass(monkeypatch, kind, steps, fold):
    """The one-pass kernel reading a bf16 sum (the last gradient folded in, or already summed) gives the bits of
    summing in bf16, widening the sum into fp32 and running the pass of an fp32 sum (torch's operations)."""
    hyper = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
    gen = torch.Generator().manual_seed(11)
    grads = [torch.randn(29, 1031, generator=gen) for _ in range(steps)]
    fused, plain, reference = _host(kind, torch.bfloat16), _host(kind, torch.bfloat16), _host(kind, torch.float32)
    for g in grads if not fold else grads[:-1]:
        fused.accumulate(g, 0.5)
    for g in grads:
        plain.accumulate(g, 0.5)
    assert host_module._fusable(fused, grads[-1] if fold else None)
    host_adamw_window([(hyper, [fused])], [(fused, grads[-1])] if fold else None, coef=0.5)
    reference.accum.copy_(plain.accum)  # (widened exactly)
    reference.accum_count = steps
    monkeypatch.setattr(host_module, "_fusable", lambda m, g: False)  # torch's operations
    host_adamw_window([(hyper, [plain])])
    host_adamw_window([(hyper, [reference])])
    assert all(torch.equal(a, b) and torch.equal(b, c)
               for a, b, c in zip(_values(fused), _values(plain), _values(reference)))
    assert plain.accum.dtype == torch.bfloat16  # (the torch pass widened a copy; the sum stays bf16)
    assert not torch.equal(fused.master, _host(kind, torch.bfloat16).master)  # (the pass ran)


def _run(settings: dict, steps: int = 10, dtype: torch.dtype = torch.float32, model=None, data=None):
    model = model if model is not None else make_model(dtype=dtype)
    opt = zenflow_adamw(param_groups(model), lr=LR, **{**SPLIT, **settings})
    train(model, opt, data if data is not None else batches(steps))
    opt.flush()
    return model, opt


def test_bf16_host_sums_are_the_device_bf16_sums_bit_for_bit():
    """The same rule wherever the window is summed: on the host in bf16, or on the device in bf16 (whose landed sum
    the host widens into fp32): the same weights, and not those of fp32 sums."""
    ours, opt = _run(dict(host_sum_dtype="bfloat16", host_sum_columns="all", accumulate_on="host"), 11)
    assert all(s.host.accum.dtype == torch.bfloat16 for s in opt.engine_state.splits.values() if s.host is not None)
    opt.close()
    device, opt = _run(dict(accumulate_on="device_bf16"), 11)
    opt.close()
    fp32, opt = _run(FP32_SUMS, 11)
    opt.close()
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), device.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(ours.parameters(), fp32.parameters()))


def test_one_step_windows_with_every_column_on_the_host_are_adamw_on_bf16_gradients():
    """topk 0, windows of one step, no overlap: each matrix's window sum is its gradient rounded to bf16, so
    ZenFlow is torch's fused AdamW with the matrices' gradients rounded to bf16 (1-D parameters as they are)."""
    data = batches(8)
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, topk_ratio=0.0, update_interval=1, overlap_step=False,
                        min_offload_numel=0, cpu_threads=1, host_moment_dtype="float32", **LEAN)
    train(model, opt, data)
    opt.close()
    reference = make_model()
    adamw = torch.optim.AdamW(param_groups(reference), lr=LR, fused=True)
    for x, y in data:
        logits = reference(x).float()
        torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1)).backward()
        with torch.no_grad():
            for p in reference.parameters():
                if p.ndim == 2:
                    p.grad.copy_(p.grad.to(torch.bfloat16))
        adamw.step()
        adamw.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("accumulate_on", ["host", "device"])
def test_write_back_from_the_master_changes_no_bit(dtype, accumulate_on):
    """host_writeback="master" (no buffer: the master copied into the weight, rounded) against the buffer (swapped
    in as the weight's storage on a CPU device), with overlap, re-selection and a write-back lag."""
    buffered, opt = _run(dict(accumulate_on=accumulate_on), 13, dtype)
    opt.close()
    ours, opt = _run(dict(accumulate_on=accumulate_on, host_writeback="master"), 13, dtype)
    hosted = [s.host for s in opt.engine_state.splits.values() if s.host is not None]
    assert hosted and all(h.writes_back_master for h in hosted) == (accumulate_on == "host" or dtype != torch.float32)
    opt.close()
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), buffered.parameters()))


def test_write_back_from_the_master_through_a_copying_transport(monkeypatch):
    """A transport that copies (synchronously, unpinned: CUDA's schedule without streams) copies from the master."""
    buffered, opt = _run(FP32_SUMS, 9, torch.bfloat16)
    opt.close()
    made: list[CopyTransport] = []
    monkeypatch.setattr("hf_zenflow.transport.transport_for", lambda device: made.append(CopyTransport())
                        or made[-1])
    ours, opt = _run(dict(LEAN), 9, torch.bfloat16)
    hosted = [s.host for s in opt.engine_state.splits.values() if s.host is not None]
    assert hosted and all(h.writes_back_master for h in hosted)
    # no write-back buffer, and the gradient slots are ordinary memory (the gradients cross through the ring)
    assert made and all(h.staging and not any(t.is_pinned() for t in h.staging) for h in hosted)
    opt.close()
    rounded, opt = _run(dict(FP32_SUMS, host_sum_dtype="bfloat16"), 9, torch.bfloat16)
    opt.close()
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), rounded.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(ours.parameters(), buffered.parameters()))


def test_write_back_from_the_master_keeps_the_buffer_where_ranks_share_the_host_state(caplog):
    """Several ranks all-gather write-back buffers: the buffer stays there, with a warning where it was asked for;
    one process reads the master, over asynchronous copies too (through the transport's pinned ring)."""
    pinned = CopyTransport()
    pinned.pins_host_memory = True  # (what a transport with asynchronous copies from pinned memory says)
    layout = HostLayout.of(zenflow_config(host_writeback="master"))  # (asked for: a warning where it cannot apply)
    assert layout.writeback_from_master
    host_module._warned_writeback = False
    with caplog.at_level(logging.WARNING, logger="hf_zenflow"):
        assert layout.on_link(CopyTransport(), 2).writeback_from_master is False
    assert layout.on_link(CopyTransport(), 1) == layout == layout.on_link(pinned, 1)
    assert [r.message for r in caplog.records if "host_writeback" in r.message][:1] == [
        'hf_zenflow: host_writeback="master" does not apply here (a host state shared by 2 ranks): the write-back '
        "buffer stays"]
    host = HostMatrix.create(torch.zeros(4, 8), torch.float32, transport=pinned, moments=layout)
    assert host.writes_back_master


def test_the_defaults_write_back_from_the_master_wherever_one_process_writes_back():
    """``host_writeback="auto"`` reads the master on one process over every transport, asynchronous copies from pinned
    chunks included (it kept a buffer there); ranks sharing the host state keep the buffer, without a word."""
    pinned = CopyTransport()
    pinned.pins_host_memory = True  # (what a transport with asynchronous copies from pinned memory says)
    layout = HostLayout.of(zenflow_config())
    assert layout.writeback == "auto"
    for transport in (Transport(), CopyTransport(), pinned):
        assert layout.on_link(transport, 1).writeback_from_master, transport
    assert not layout.on_link(pinned, 2).writeback_from_master
    host = HostMatrix.create(torch.zeros(4, 8, dtype=torch.bfloat16), torch.float32, transport=pinned,
                             moments=layout.on_link(pinned, 1))
    assert host.writes_back_master


def _host_bytes(opt: ZenFlowAdamW) -> tuple[int, int, int]:
    """(bytes of the distinct host storages, elements, quantisation blocks) of the host state."""
    storages: dict[int, int] = {}
    elements = blocks = 0
    for split in opt.engine_state.splits.values():
        host = split.host
        if host is None:
            continue
        elements += host.master.numel()
        blocks += 2 * -(-host.master.numel() // BLOCK)
        for f in dataclasses.fields(host):
            value = getattr(host, f.name)
            if isinstance(value, QuantizedMoment):
                value = [value.codes, value.scales]
            for t in value if isinstance(value, list) else [value]:
                if isinstance(t, torch.Tensor) and f.name != "step":
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values()), elements, blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_moments_with_bf16_host_sums_and_no_write_back_buffer_hold_8_03_bytes_per_param(dtype):
    """Measured from the host tensors with the window summed on the host (one process): fp32 master 4 + int8
    codes 1 + 1 + one fp32 scale per 256 elements of each moment (0.03) + the bf16 sum 2 = 8.03 B; with fp32 sums
    and a write-back buffer: 4 + 2.03 + 4 (fp32 sum) + the buffer (4 fp32 / 2 bf16 weights)."""
    for settings, per_element in ((dict(LEAN), 8), (FP32_SUMS, 8 + dtype.itemsize + 2)):
        _, opt = _run({**settings, "host_moment_dtype": "int8"}, 8, dtype)
        stats = opt.stats()
        measured, elements, blocks = _host_bytes(opt)
        opt.close()
        assert elements > 0 and stats["host_state_bytes"] == measured
        assert stats["host_bytes_per_param"] == measured / elements
        assert measured == elements * per_element + blocks * 4
    assert stats["host_bytes_per_param"] > 10  # (fp32 sums and a buffer)


def test_lean_host_state_resumes_exactly_and_its_sum_is_checksummed():
    """Saved mid-window (a bf16 sum with steps in it, a write-back pending), loaded into a new optimizer: the run
    continues bit for bit; the sum is saved as it is kept (bf16) under the file's checksums."""
    settings = dict(LEAN, host_moment_dtype="int8")
    data = batches(12)
    whole, opt = _run(settings, data=data)
    opt.close()
    first = make_model()
    opt = zenflow_adamw(param_groups(first), lr=LR, **{**SPLIT, **settings})
    train(first, opt, data[:5])
    saved = roundtrip(opt.state_dict())
    sums = {id(s): s.host.accum.clone() for s in opt.engine_state.splits.values()
            if s.host is not None and s.host.accum_count}
    opt.close()
    assert sums and all(t.dtype == torch.bfloat16 and bool(t.any()) for t in sums.values())
    entries = [e for e in saved["state"].values() if e["kind"] == "split" and e.get("accum") is not None]
    assert entries and all(e["accum"].dtype == torch.bfloat16 for e in entries)
    damaged = roundtrip(saved)
    next(e for e in damaged["state"].values() if e["kind"] == "split" and e.get("accum") is not None)["accum"].add_(1)
    with pytest.raises(CheckpointError):
        zenflow_adamw(param_groups(make_model()), lr=LR, **{**SPLIT, **settings}).load_state_dict(damaged)
    second = make_model()
    second.load_state_dict(first.state_dict())
    opt = zenflow_adamw(param_groups(second), lr=LR, **{**SPLIT, **settings})
    opt.load_state_dict(saved)
    train(second, opt, data[5:])
    opt.flush()
    opt.close()
    assert all(torch.equal(p, q) for p, q in zip(whole.parameters(), second.parameters()))


def test_to_torch_adamw_takes_the_lean_state():
    """to_torch_adamw: the fp32 master and dequantised moments of every column, as the optimizer holds them."""
    model, opt = _run(dict(LEAN, host_moment_dtype="int8"), 7)
    full = [s.full_state() for s in opt.engine_state.splits.values()]
    saved = roundtrip(opt.state_dict())
    opt.close()
    adamw_state, _ = to_torch_adamw(saved, weights=[p for g in opt.param_groups for p in g["params"]])
    converted = [adamw_state["state"][i] for i, e in saved["state"].items() if e["kind"] == "split"]
    assert converted and len(converted) == len(full)
    for state, (_, m, v) in zip(converted, full):
        assert torch.equal(state["exp_avg"].reshape(m.shape), m)
        assert torch.equal(state["exp_avg_sq"].reshape(v.shape), v)


@pytest.mark.parametrize("field,value,allowed", [
    ("host_sum_dtype", "float16", '"float32" | "bfloat16"'),
    ("host_writeback", "pinned", '"buffer" | "master"'),
])
def test_bad_settings_fail_at_construction(field, value, allowed):
    with pytest.raises(ValueError, match=rf"ZenFlowConfig.{field}='{value}' is invalid: allowed is {allowed}"):
        zenflow_config(**{field: value})
    for accumulate_on in ("device", "device_bf16"):
        with pytest.raises(ValueError, match=rf"host_sum_dtype='bfloat16' is invalid with "
                                             rf"accumulate_on='{accumulate_on}'"):
            zenflow_config(host_sum_dtype="bfloat16", accumulate_on=accumulate_on)
    assert zenflow_config(host_sum_dtype="BFloat16", accumulate_on="auto").rules.host_sum_dtype == "bfloat16"
