"""A host window sum over the unselected columns only (``host_sum_columns="unselected"``).

References: the sum of every column (``"all"``). Each kept element is added by the same rule, so the kept columns
of the sum are those of the full sum bit for bit, and the host AdamW's pass, which reads the kept columns through
their places in the kept sum, gives the full pass on a sum that is zero in the device columns; with fp32 and bf16
moments (elementwise) the host columns, and so the weights, are the full sum's bit for bit. With 8-bit moments the
blocks' scales see the device columns' (never read) values, so only the pass on a zeroed sum is the reference. With
8-bit moments, bf16 sums and no write-back buffer the host holds 4 + 2.03 + 2 x (1 - topk_ratio) B per offloaded
parameter: 7.83 at topk_ratio=0.1."""

from __future__ import annotations

import pytest
import torch

import hf_zenflow.engine.host as host_module
from hf_zenflow.engine.host import HostLayout, HostMatrix, host_adamw_window
from hf_zenflow.engine.layout import column_major_
from hf_zenflow.engine.quantized_moments import QuantizedMoment
from hf_zenflow.transport.cpu_device import kernels
from tests.conftest import (
    DEVICE,
    TinyNet,
    batches,
    make_model,
    param_groups,
    roundtrip,
    train,
    zenflow_adamw,
    zenflow_config,
)
from tests.engine.test_host_sums_bf16 import _host_bytes


LR = 1e-2
SPLIT = dict(topk_ratio=0.25, update_interval=3, overlap_step=True, writeback_lag=1, select_strategy="step",
             select_interval=4, min_offload_numel=0, cpu_threads=1, high_lr_rule="off", accumulate_on="host",
             host_sum_columns="all")
UNSELECTED = dict(host_sum_columns="unselected")
MOMENTS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU device's host passes (a CUDA run: cuda_checks)")


def _kept(columns: int, selected: list[int]) -> torch.Tensor:
    mask = torch.ones(columns, dtype=torch.bool)
    mask[selected] = False
    return mask.nonzero().squeeze(1)


def _host(shape: tuple[int, int], kind: str, sums: torch.dtype, unselected: bool) -> HostMatrix:
    """A matrix's host state with moments of `kind`, the same values at every call."""
    gen = torch.Generator().manual_seed(5)
    host = HostMatrix.create(torch.randn(*shape, generator=gen), torch.float32,
                             moments=HostLayout(moments=MOMENTS[kind], sums=sums, unselected_sums=unselected))
    host.exp_avg.copy_(torch.randn(*shape, generator=gen) * 0.01)
    host.exp_avg_sq.copy_(torch.rand(*shape, generator=gen) * 1e-4)
    return host


def _values(host: HostMatrix) -> list[torch.Tensor]:
    out = []
    for t in (host.master, host.exp_avg, host.exp_avg_sq):
        out += [t.codes, t.scales] if isinstance(t, QuantizedMoment) else [t]
    return out


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("sums", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("native", [True, False])
def test_kept_columns_are_the_full_sums_columns_bit_for_bit(monkeypatch, axis, sums, grad_dtype, native):
    if native and kernels.library() is None:
        pytest.skip("no C compiler")
    if not native:
        monkeypatch.setenv("HF_ZENFLOW_NATIVE", "0")
    monkeypatch.setattr(host_module, "NARROW_CHUNK", 700)  # (several pieces)
    shape = (37, 301)
    kept = _kept(shape[axis], [0, 5, 6, 30, shape[axis] - 1])
    full, compact = _host(shape, "float32", sums, False), _host(shape, "float32", sums, True)
    compact.keep_sum_columns(kept, axis)
    assert compact.accum.shape[axis] == kept.numel() and compact.accum.shape[1 - axis] == shape[1 - axis]
    gen = torch.Generator().manual_seed(3)
    for i in range(4):
        g = (torch.randn(*shape, generator=gen) * 10 ** (i - 2)).to(grad_dtype)
        full.accumulate(g, 0.37)
        compact.accumulate(g, 0.37)
    assert torch.equal(compact.accum, full.accum.index_select(axis, kept))
    spread = compact.full_sum()
    assert torch.equal(spread.index_select(axis, kept), compact.accum)
    assert not spread.index_select(axis, _kept(shape[axis], kept.tolist())).any()


@pytest.mark.skipif(kernels.library() is None, reason="no C compiler: the kernels are not built")
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("shape", [(29, 384), (29, 1031)])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("fold", [True, False])
def test_window_pass_on_the_kept_sum_is_the_pass_on_a_sum_zero_in_the_device_columns(kind, shape, axis, fold):
    """The kernel reading the kept sum (spread block by block, blocks that span rows) gives the pass on a full sum
    whose device columns are zero (the last step's gradient, folded in, is read whole), bit for bit, for every kind
    of moments; with fp32 and bf16 moments the host columns also equal the pass on the real full sum."""
    kept = _kept(shape[axis], [1, 2, 17, shape[axis] - 2])
    gen = torch.Generator().manual_seed(11)
    grads = [torch.randn(*shape, generator=gen) for _ in range(3)]
    compact, zeroed, full = (_host(shape, kind, torch.bfloat16, u) for u in (True, False, False))
    compact.keep_sum_columns(kept, axis)
    device_columns = _kept(shape[axis], kept.tolist())
    for g in grads if not fold else grads[:-1]:
        compact.accumulate(g, 0.5)
        full.accumulate(g, 0.5)
        zeroed.accumulate(g.index_fill(axis, device_columns, 0.0), 0.5)
    last = grads[-1] if fold else None
    assert host_module._fusable(compact, last)
    host_adamw_window([(HYPER, [compact])], [(compact, last)] if fold else None, coef=0.5)
    host_adamw_window([(HYPER, [zeroed])], [(zeroed, last)] if fold else None, coef=0.5)
    host_adamw_window([(HYPER, [full])], [(full, last)] if fold else None, coef=0.5)
    assert all(torch.equal(a, b) for a, b in zip(_values(compact), _values(zeroed)))
    assert torch.equal(compact.step, full.step) and compact.step.item() == 1
    if kind != "int8":
        assert all(torch.equal(a.index_select(axis, kept), b.index_select(axis, kept))
                   for a, b in zip(_values(compact), _values(full)))
    assert not torch.equal(compact.master, _host(shape, kind, torch.bfloat16, True).master)  # (the pass ran)


def test_a_first_selection_mid_window_keeps_the_partial_sums_of_the_kept_columns():
    host = _host((7, 12), "float32", torch.float32, True)
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(7, 12, generator=gen) for _ in range(2)]
    host.accumulate(grads[0], None)  # (every column kept: nothing on the device yet)
    assert host.sum_index is None and host.accum.shape == (7, 12)
    kept = _kept(12, [3, 4])
    host.keep_sum_columns(kept, 1)
    host.accumulate(grads[1], None)
    assert torch.equal(host.accum, (grads[0] + grads[1]).index_select(1, kept))
    host.keep_sum_columns(_kept(12, [3, 4, 9]), 1)  # (a column leaves: its sum is dropped)
    assert torch.equal(host.accum, (grads[0] + grads[1]).index_select(1, _kept(12, [3, 4, 9])))


def _run(settings: dict, steps: int = 11, dtype: torch.dtype = torch.float32, data=None, layout: str = "row",
         width: int | None = None):
    model = make_model(dtype=dtype) if width is None else TinyNet(vocab=width, width=width, dtype=dtype)
    if layout == "column":
        column_major_(model)
    opt = zenflow_adamw(param_groups(model), lr=LR, **{**SPLIT, **settings})
    train(model, opt, data if data is not None else batches(steps))
    opt.flush()
    return model, opt


@pytest.mark.parametrize("moments", ["float32", "bfloat16"])
@pytest.mark.parametrize("sums", ["float32", "bfloat16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["row", "column"])
def test_unselected_sums_train_the_weights_of_full_sums_bit_for_bit(moments, sums, dtype, layout):
    """11 steps with windows of 3, overlapped, re-selection every 4 steps (mid-window: it closes the window first)."""
    settings = dict(host_moment_dtype=moments, host_sum_dtype=sums)
    full, opt = _run(settings, dtype=dtype, layout=layout)
    assert all(s.host.sum_index is None for s in opt.engine_state.splits.values() if s.host is not None)
    opt.close()
    lean, opt = _run({**settings, **UNSELECTED}, dtype=dtype, layout=layout)
    hosted = [s for s in opt.engine_state.splits.values() if s.host is not None]
    assert hosted and all(s.host.accum.shape[s.axis] == s.columns - s.k for s in hosted)
    assert opt.stats()["reselections"] >= 2
    opt.close()
    assert all(torch.equal(p, q) for p, q in zip(full.parameters(), lean.parameters()))


def test_unselected_sums_without_the_kernels_train_the_same_weights(monkeypatch):
    settings = dict(host_moment_dtype="float32", host_sum_dtype="bfloat16", **UNSELECTED)
    native, opt = _run(settings)
    opt.close()
    monkeypatch.setattr(host_module, "_fusable", lambda m, g: False)  # torch's operations, a transient full sum
    monkeypatch.setenv("HF_ZENFLOW_NATIVE", "0")
    plain, opt = _run(settings)
    opt.close()
    assert all(torch.equal(p, q) for p, q in zip(native.parameters(), plain.parameters()))


@pytest.mark.parametrize("saved_with,loaded_with", [("unselected", "unselected"), ("unselected", "all"),
                                                    ("all", "unselected")])
def test_a_resume_mid_window_continues_bit_for_bit(saved_with, loaded_with):
    """Saved after 5 steps (a window open, a write-back pending), the sum saved over every column: loaded under
    either setting the run continues as the uninterrupted one."""
    settings = dict(host_moment_dtype="int8" if saved_with == loaded_with else "float32", host_sum_dtype="bfloat16")
    data = batches(12)
    whole, opt = _run({**settings, "host_sum_columns": saved_with}, data=data)
    opt.close()
    first = make_model()
    opt = zenflow_adamw(param_groups(first), lr=LR, **{**SPLIT, **settings, "host_sum_columns": saved_with})
    train(first, opt, data[:5])
    saved = roundtrip(opt.state_dict())
    open_sums = [s for s in opt.engine_state.splits.values() if s.host is not None and s.host.accum_count]
    assert open_sums and all((s.host.sum_index is not None) == (saved_with == "unselected") for s in open_sums)
    opt.close()
    entries = [e for e in saved["state"].values() if e["kind"] == "split" and e.get("accum") is not None]
    assert entries and all(e["accum"].shape == e["host_exp_avg"].shape for e in entries)
    second = make_model()
    second.load_state_dict(first.state_dict())
    opt = zenflow_adamw(param_groups(second), lr=LR, **{**SPLIT, **settings, "host_sum_columns": loaded_with})
    opt.load_state_dict(saved)
    assert all((s.host.sum_index is not None) == (loaded_with == "unselected")
               for s in opt.engine_state.splits.values() if s.host is not None and s.device is not None)
    train(second, opt, data[5:])
    opt.flush()
    opt.close()
    assert all(torch.equal(p, q) for p, q in zip(whole.parameters(), second.parameters()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_moments_bf16_unselected_sums_and_no_write_back_buffer_hold_under_8_bytes_per_param(dtype):
    """Measured from the host tensors, one process, the window summed on the host, topk_ratio=0.1: fp32 master 4 +
    int8 codes 2 + one fp32 scale per 256 elements of each moment + the bf16 sum of the unselected columns + their
    indices (8 B per kept column and 4 per column: about 12 / rows B per element, 0.05 for the 256-row matrices
    here, 0.03 for MiniLM's)."""
    settings = dict(host_moment_dtype="int8", host_sum_dtype="bfloat16", host_writeback="master", topk_ratio=0.1,
                    **UNSELECTED)
    _, opt = _run(settings, 8, dtype, width=256)
    stats = opt.stats()
    measured, elements, blocks = _host_bytes(opt)
    hosted = [s for s in opt.engine_state.splits.values() if s.host is not None]
    summed = sum(s.host.accum.numel() for s in hosted)
    kept_columns = sum(s.columns - s.k for s in hosted)
    opt.close()
    assert elements > 0 and summed == sum(s.host.master.numel() // s.columns * (s.columns - s.k) for s in hosted)
    columns = sum(s.columns for s in hosted)
    assert stats["host_state_bytes"] == measured == (elements * 6 + blocks * 4 + summed * 2 + kept_columns * 8
                                                     + (columns + len(hosted)) * 4 + (columns - kept_columns) * 4)
    assert stats["host_bytes_per_param"] == measured / elements < 7.9


@pytest.mark.parametrize("accumulate_on", ["device", "device_bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["row", "column"])
def test_device_sums_land_only_the_unselected_columns_and_train_the_weights_of_full_sums(accumulate_on, dtype,
                                                                                         layout, monkeypatch):
    """Where a window's device sums are copied to the host (CUDA; here its asynchronous double) the accumulator they
    land in keeps the unselected columns only, gathered on the device piece by piece: through a ring of 2 x 64 B
    (pieces of part of a row) and of 2 x 4 KiB (pieces of several rows), the weights of an accumulator of every
    column bit for bit, with re-selections between windows; the host holds the device columns' sum bytes less, and
    the kept columns' indices; the link carries the kept columns only."""
    from tests.transport.test_pinned_pool import small_ring_transports

    settings = dict(host_moment_dtype="bfloat16", accumulate_on=accumulate_on)
    itemsize = 2 if accumulate_on == "device_bf16" else 4
    weights, host_bytes, sent = {}, {}, {}
    for columns, chunk_bytes in (("all", 4096), ("unselected", 64), ("unselected", 4096)):
        backends: list = []
        small_ring_transports(monkeypatch, backends, [], chunk_bytes=chunk_bytes)
        model, opt = _run({**settings, "host_sum_columns": columns}, dtype=dtype, layout=layout)
        hosted = [s for s in opt.engine_state.splits.values() if s.host is not None]
        assert hosted and opt.stats()["reselections"] >= 2 and opt.stats()["accumulate_on"] == accumulate_on
        sent[columns, chunk_bytes] = opt.stats()["bytes_to_host"]
        if columns == "unselected":
            assert all(s.host.accum.shape[s.axis] == s.columns - s.k for s in hosted)
            selected = sum(s.host.master.numel() // s.columns * s.k for s in hosted)
            kept_columns = sum(s.columns - s.k for s in hosted)
            index_bytes = kept_columns * 8 + sum(s.columns + 1 for s in hosted) * 4 + sum(s.k for s in hosted) * 4
            host_bytes[columns, chunk_bytes] = opt.stats()["host_state_bytes"]
            assert host_bytes[columns, chunk_bytes] == host_bytes["all", 4096] - selected * itemsize + index_bytes
        else:
            assert all(s.host.sum_index is None and s.host.accum.shape == s.host.master.shape for s in hosted)
            host_bytes[columns, chunk_bytes] = opt.stats()["host_state_bytes"]
        opt.close()
        for backend in backends:
            backend.synchronize(torch.device("cpu"))
            backend.check()
        assert sum(b.copies for b in backends) > 0
        weights[columns, chunk_bytes] = [p.detach().clone() for p in model.parameters()]
    for key in (("unselected", 64), ("unselected", 4096)):
        assert all(torch.equal(p, q) for p, q in zip(weights["all", 4096], weights[key])), key
        assert sent[key] < sent["all", 4096], key


def test_bad_settings_fail_at_construction():
    with pytest.raises(ValueError, match=r"EngineRules.host_sum_columns='device' is invalid: allowed is "
                                         r'"all" \| "unselected"'):
        zenflow_config(host_sum_columns="device")
    assert zenflow_config(host_sum_columns="Unselected", accumulate_on="auto").rules.host_sum_columns == "unselected"
