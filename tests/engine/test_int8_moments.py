"""8-bit host moments (``host_moment_dtype="int8"``): blockwise codes with fp32 scales, updated in fp32.

The reference is an independent composition: torch's fused AdamW on the whole model, with each matrix's moments
replaced after every step by their 8-bit values (quantised, stochastically with the random bits of
`rounding.RandomStream`, and dequantised by blocks of 256 in the storage order).
With every column on the host and a window of one step, ZenFlow is that AdamW, so the two agree bit for bit, through
the CPU kernel and through the torch pass; and the setting changes the result, or the comparison says nothing."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import hf_zenflow.engine.host as host_module
import hf_zenflow.engine.quantized_moments as qm
from hf_zenflow import ZenFlowAdamW, to_torch_adamw
from hf_zenflow.checkpoint import CheckpointError
from hf_zenflow.checkpoint.seal import seal
from hf_zenflow.engine.host import HostMatrix
from hf_zenflow.engine.quantized_moments import BLOCK, QuantizedMoment
from hf_zenflow.transport.cpu_device import kernels
from hf_zenflow.transport.cpu_device.rounding import RandomStream, matrix_key, random16
from tests.conftest import DEVICE, batches, make_model, param_groups, roundtrip, train, zenflow_adamw


LR, STEPS = 1e-2, 12
DATA = batches(1) * STEPS
#: every column on the host, one-step windows summed in fp32 (the reference sums each step's gradient exactly)
ALL_ON_HOST = dict(topk_ratio=0.0, update_interval=1, overlap_step=False, min_offload_numel=0, cpu_threads=1,
                   host_sum_dtype="float32")
INT8 = dict(host_moment_dtype="int8")

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU device's host passes (a CUDA run: cuda_checks)")


def _roundtrip_8bit(t: torch.Tensor, signed: bool) -> torch.Tensor:
    q = QuantizedMoment.zeros(t, signed=signed)
    q.copy_(t)
    return q.float()


def _stochastic_8bit(t: torch.Tensor, signed: bool, random_bits: torch.Tensor) -> torch.Tensor:
    q = QuantizedMoment.zeros(t, signed=signed)
    qm.quantize_into(q.codes.view(-1), q.scales, t.reshape(-1), random_bits)
    return q.float()


class QuantizedAdamW(torch.optim.AdamW):
    """torch's fused AdamW with the matrices' moments replaced by their 8-bit values after each step, rounded
    stochastically with the bits of torch's initial seed (what ZenFlowAdamW keys its rounding by), the matrix's
    place in the param groups and the step count."""

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
            bits = self.streams[p].bits(int(state["step"]), 0, p.numel())
            state["exp_avg"].copy_(_stochastic_8bit(state["exp_avg"], True, random16(bits, 0)))
            state["exp_avg_sq"].copy_(_stochastic_8bit(state["exp_avg_sq"], False, random16(bits, 1)))


def _zenflow(settings: dict, **kw) -> tuple[torch.nn.Module, list[float], ZenFlowAdamW]:
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, **{**ALL_ON_HOST, **kw, **settings})
    losses = train(model, opt, DATA)
    opt.flush()
    return model, losses, opt


def test_codes_keep_relative_error_small_and_requantise_to_themselves():
    """Within a block, values down to 1/1000 of its maximum (1e-6 for exp_avg_sq) keep a relative error under 1/16
    (a code has 3 mantissa bits), zeros stay zero, and quantising the dequantised values gives the same codes and
    scales (so a partial write of a moment leaves the untouched blocks as they were)."""
    g = torch.Generator().manual_seed(0)
    n = 7 * BLOCK + 37  # (a partial last block)
    magnitude = torch.exp(torch.empty(n).uniform_(math.log(1e-3), 0, generator=g))
    m = magnitude * torch.randn(n, generator=g).sign() * 1e-2
    v = magnitude ** 2 * 1e-5
    m[:BLOCK] = 0  # an all-zero block
    for values, signed in ((m, True), (v, False)):
        q = QuantizedMoment.zeros(values, signed=signed)
        q.copy_(values)
        assert q.codes.dtype == (torch.int8 if signed else torch.uint8)
        assert q.scales.numel() == 8 and q.nbytes() == n + 8 * 4
        back = q.float()
        nonzero = values != 0
        assert torch.equal(back[~nonzero], values[~nonzero])
        rel = ((back - values).abs() / values.abs())[nonzero]
        assert float(rel.max()) <= 1 / 16, float(rel.max())
        assert float(rel.max()) > 1 / 40  # (and it is a quantisation)
        again = QuantizedMoment.zeros(values, signed=signed)
        again.copy_(back)
        assert torch.equal(again.codes, q.codes) and torch.equal(again.scales, q.scales)
    # a linear code would round an element at 1/300 of its block's maximum to zero: this one keeps it
    v = torch.full((BLOCK,), 1e-4)
    v[0] = 300 * 1e-4
    assert float(_roundtrip_8bit(v, signed=False)[1]) > 0


def test_the_kernel_is_the_torch_pass_bit_for_bit():
    if kernels.library() is None or not kernels.window_adamw_available():
        pytest.skip("no CPU kernels here")
    assert qm.kernel_matches()
    g = torch.Generator().manual_seed(3)
    rows, cols = 33, 1000  # several kernel chunks of 1024, partial quantisation blocks
    states = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(5)
        m = HostMatrix.create(torch.randn(rows, cols, generator=gen), torch.float32, moments=torch.int8)
        m.exp_avg.copy_(torch.randn(rows, cols, generator=gen) * 1e-3)
        m.exp_avg_sq.copy_(torch.rand(rows, cols, generator=gen) * 1e-6)
        states.append(m)
    grad = torch.randn(rows, cols, generator=g)
    hyper = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
    kernel, plain = states
    kernels.window_adamw_quantized([kernel.master], [kernel.accum], [grad], [True], [1], [kernel.exp_avg.codes],
                                   [kernel.exp_avg.scales], [kernel.exp_avg_sq.codes], [kernel.exp_avg_sq.scales],
                                   [kernel.step], hyper, None)
    plain.accumulate(grad, None)
    qm.adamw_pass(plain.master, plain.accum, plain.exp_avg, plain.exp_avg_sq, plain.step, hyper)
    assert torch.equal(kernel.master, plain.master)
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(getattr(kernel, name).codes, getattr(plain, name).codes)
        assert torch.equal(getattr(kernel, name).scales, getattr(plain, name).scales)
    assert not torch.equal(kernel.exp_avg.codes, HostMatrix.create(grad, torch.float32,
                                                                   moments=torch.int8).exp_avg.codes)


@pytest.mark.parametrize("path", ["kernel", "torch", "torch-pieces"])
def test_int8_host_is_adamw_with_8bit_moments(path, monkeypatch):
    if path == "kernel" and (kernels.library() is None or not kernels.window_adamw_available()):
        pytest.skip("no CPU kernels here")
    if path != "kernel":
        monkeypatch.setattr(host_module, "kernel_matches", lambda: False)
    if path == "torch-pieces":  # pieces of two blocks: every matrix in several pieces, with a remainder
        monkeypatch.setattr(qm, "PIECE", 2 * BLOCK)
    model, losses, opt = _zenflow(INT8)
    assert all(s.host.quantized for s in opt.engine_state.splits.values() if s.host is not None)
    opt.close()
    ref = make_model()
    ref_losses = train(ref, QuantizedAdamW(ref), DATA)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert losses == ref_losses and losses[-1] < losses[0]  # and it trains
    plain, _, opt = _zenflow({})
    opt.close()
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))  # the setting acts


SPLIT = dict(host_moment_dtype="int8", topk_ratio=0.25, update_interval=2, overlap_step=True, select_strategy="step",
             select_interval=3, min_offload_numel=0, cpu_threads=1)


def test_int8_moments_resume_exactly_from_their_codes():
    data = batches(STEPS)
    whole = make_model()
    opt = zenflow_adamw(param_groups(whole), lr=LR, **SPLIT)
    train(whole, opt, data)
    opt.flush()
    opt.close()
    first = make_model()
    opt = zenflow_adamw(param_groups(first), lr=LR, **SPLIT)
    train(first, opt, data[:5])  # mid-window, between re-selections
    saved = roundtrip(opt.state_dict())
    opt.close()
    split = [e for e in saved["state"].values() if e["kind"] == "split" and "host_master" in e]
    assert split and all(e["host_exp_avg"].dtype == torch.int8 and e["host_exp_avg_sq"].dtype == torch.uint8
                         and e["host_exp_avg_scale"].numel() == -(-e["host_exp_avg"].numel() // BLOCK)
                         for e in split)
    second = make_model()
    second.load_state_dict(first.state_dict())
    opt = zenflow_adamw(param_groups(second), lr=LR, **SPLIT)
    opt.load_state_dict(saved)
    train(second, opt, data[5:])
    opt.flush()
    opt.close()
    for p, q in zip(whole.parameters(), second.parameters()):
        assert torch.equal(p, q)


def _trained_state() -> tuple[dict, ZenFlowAdamW]:
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, **SPLIT)
    train(model, opt, batches(5))
    opt.flush()
    return roundtrip(opt.state_dict()), opt


def test_damaged_codes_or_scales_are_refused():
    saved, opt = _trained_state()
    index = next(i for i, e in saved["state"].items() if "host_exp_avg_scale" in e)
    cases = {
        "checksum": lambda e: e["host_exp_avg_scale"].mul_(2),  # (not resealed: the checksum catches it)
        "negative scale": lambda e: e["host_exp_avg_sq_scale"].__setitem__(0, -1.0),
        "missing scales": lambda e: e.pop("host_exp_avg_sq_scale"),
        "scale count": lambda e: e.__setitem__("host_exp_avg_scale", e["host_exp_avg_scale"][:-1].clone()),
        "code dtype": lambda e: e.__setitem__("host_exp_avg", e["host_exp_avg"].to(torch.uint8)),
    }
    for name, damage in cases.items():
        state = roundtrip(saved)
        damage(state["state"][index])
        if name != "checksum":
            state = seal(state)
        with pytest.raises(CheckpointError):
            opt.load_state_dict(state)
    opt.load_state_dict(roundtrip(saved))  # (the undamaged state loads)
    opt.close()


@pytest.mark.parametrize("other", ["float32", "bfloat16"])
def test_int8_state_loads_under_other_settings_and_converts_to_torch(other):
    """to_torch_adamw dequantises; a resume under another host_moment_dtype takes the fp32 values; an fp32 state
    resumed under int8 is quantised."""
    saved, opt = _trained_state()
    full = {i: s.full_state() for i, s in enumerate(opt.engine_state.splits.values())}
    hosted = [(s.host.exp_avg.float(), s.host.exp_avg_sq.float()) for s in opt.engine_state.splits.values()
              if s.host is not None]
    opt.close()
    adamw_state, _ = to_torch_adamw(saved, weights=[p for g in opt.param_groups for p in g["params"]])
    converted = [adamw_state["state"][i] for i, e in saved["state"].items() if e["kind"] == "split"]
    assert converted
    for state, (_, m, v) in zip(converted, full.values()):
        assert state["exp_avg"].dtype == torch.float32
        assert torch.equal(state["exp_avg"].reshape(m.shape), m)
        assert torch.equal(state["exp_avg_sq"].reshape(v.shape), v)
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, **{**SPLIT, "host_moment_dtype": other})
    opt.load_state_dict(saved)
    dtype = getattr(torch, other)
    here = [(s.host.exp_avg, s.host.exp_avg_sq) for s in opt.engine_state.splits.values() if s.host is not None]
    assert hosted and len(here) == len(hosted)
    for (m, v), (m2, v2) in zip(hosted, here):
        assert m2.dtype == v2.dtype == dtype
        assert torch.equal(m2, m.to(dtype)) and torch.equal(v2, v.to(dtype))
    wide = roundtrip(opt.state_dict())
    opt.close()
    opt = zenflow_adamw(param_groups(make_model()), lr=LR, **SPLIT)
    opt.load_state_dict(wide)  # back under int8: quantised again
    assert all(s.host.quantized for s in opt.engine_state.splits.values() if s.host is not None)
    opt.close()


@pytest.mark.parametrize("accumulate_on", ["device", "host"])
def test_host_bytes_per_param_with_int8_moments_are_the_host_tensors(accumulate_on):
    """stats()'s host bytes per offloaded element is what the host tensors hold (one process), and it is the fp32
    master (4) + the codes (1 + 1) + a scale per block of 256 for each moment + the window sum (4) with the sum on the
    device, whose landed fp32 sum is also the write-back buffer of fp32 weights: 10.03 B against 16 with fp32
    moments."""
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, topk_ratio=0.25, update_interval=3, overlap_step=True,
                        writeback_lag=1, min_offload_numel=0, cpu_threads=1, host_moment_dtype="int8",
                        accumulate_on=accumulate_on, host_sum_dtype="float32", host_sum_columns="all",
                        host_writeback="buffer")
    train(model, opt, batches(10))
    opt.flush()
    stats = opt.stats()
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
    opt.close()
    measured = sum(storages.values())
    assert elements > 0 and stats["host_state_bytes"] == measured
    assert stats["host_bytes_per_param"] == measured / elements
    if accumulate_on == "device":
        assert measured == elements * (4 + 2 + 4) + blocks * 4
        assert stats["host_bytes_per_param"] < 10.1
    else:  # the host keeps its own fp32 accumulator next to the write-back buffer (the rules set above)
        assert measured == elements * (4 + 2 + 4 + 4) + blocks * 4


def test_writes_into_columns_requantise_only_their_blocks():
    """Re-selection writes device columns into the host moments: blocks without a written element keep their
    codes and scales."""
    g = torch.Generator().manual_seed(1)
    values = torch.randn(4, 512, generator=g) * 1e-3
    q = QuantizedMoment.zeros(values, signed=True)
    q.copy_(values)
    before = q.codes.clone(), q.scales.clone()
    q.index_copy_(1, torch.tensor([3, 700 - 512]), torch.ones(4, 2))  # columns in the first block of every row
    changed = (q.scales != before[1]).nonzero().flatten().tolist()
    assert changed == [0, 2, 4, 6]
    assert torch.equal(q.codes[:, 256:], before[0][:, 256:])
    assert torch.equal(q.float()[:, [3, 188]], torch.ones(4, 2))
    assert qm.blocks(values.numel()) == 8


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_resharding_cuts_and_joins_the_8bit_moments_as_their_values(parallel):
    """Ranks' shares are quantised by blocks of their own: resharding works on the fp32 values (a one-process state
    cut for two ranks and joined again holds the dequantised moments), sealed and valid."""
    from hf_zenflow.checkpoint.format import migrate, widen_moments
    from hf_zenflow.checkpoint.reshard import merge_rank_states, reshard_states

    saved, opt = _trained_state()
    opt.close()
    shares = reshard_states([saved], 2, parallel)
    assert len(shares) == 2
    for share in shares:
        migrate(share)  # (checksums verified)
        assert not any("host_exp_avg_scale" in e for e in share["state"].values())
    joined = merge_rank_states(shares)
    for index, entry in saved["state"].items():
        if "host_exp_avg_scale" not in entry:
            continue
        wide = widen_moments(entry)
        for key in ("host_exp_avg", "host_exp_avg_sq", "host_master"):
            if wide[key] is None:  # (the fp32 weights hold the master: none saved, none joined)
                assert joined["state"][index][key] is None
                continue
            assert torch.equal(joined["state"][index][key], wide[key])
