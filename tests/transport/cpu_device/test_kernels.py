"""The CPU kernels (`hf_zenflow/transport/cpu_device/kernels.py`) against torch: exact copies, bf16 rounding, fp64
norms, and the optimizer giving the same bits with and without them."""

from __future__ import annotations

import math

import pytest
import torch

from hf_zenflow import ZenFlowAdamW
from hf_zenflow.transport.cpu_device import kernels as _native
from tests.conftest import batches, linear_schedule, make_model, param_groups, train


needs_kernels = pytest.mark.skipif(_native.library() is None, reason=f"CPU kernels: {_native.status()}")

SHAPES = [(37, 53), (300, 1024), (1, 7)]


def _case(shape: tuple[int, int], dtype: torch.dtype, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    big = (torch.randn(shape, generator=g) * 3).to(dtype)
    index = torch.randperm(shape[1], generator=g)[:k].sort().values
    return big, index


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_norms_and_gather_match_torch(dtype, shape):
    k = max(1, shape[1] // 10)
    grad, index = _case(shape, dtype, k)
    out = torch.full((shape[0], k), float("nan"))
    (sumsq,) = _native.norms_and_gather([grad], [out], [index])
    assert torch.equal(out, grad[:, index].float())
    assert sumsq == pytest.approx(grad.double().square().sum().item(), rel=1e-12)


@needs_kernels
@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_gradients_gather_into_a_bf16_buffer_as_they_are(shape):
    """A bf16 gradient's selected columns kept in bf16 (the device keeps them in the gradient's dtype): the very
    bits, the same sum of squares as with an fp32 buffer."""
    k = max(1, shape[1] // 10)
    grad, index = _case(shape, torch.bfloat16, k)
    grad[0, index[0]] = float("nan")  # (copied as it is, like any other value)
    out = torch.empty((shape[0], k), dtype=torch.bfloat16)
    wide = torch.empty((shape[0], k))
    (sumsq,) = _native.norms_and_gather([grad], [out], [index])
    (wide_sumsq,) = _native.norms_and_gather([grad], [wide], [index])
    assert torch.equal(out.view(torch.int16), grad[:, index].view(torch.int16))
    assert torch.equal(wide.isnan(), out.isnan()) and torch.equal(wide.nan_to_num(), out.float().nan_to_num())
    assert math.isnan(sumsq) and math.isnan(wide_sumsq)


@needs_kernels
def test_norms_without_gather_and_non_finite_values():
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    nan = torch.tensor([1.0, float("nan"), 2.0])
    inf = torch.tensor([[float("inf"), 0.0]])
    big = torch.tensor([3e30, 4e30])  # squares overflow fp32, not the fp64 sum
    sums = _native.norms_and_gather([a, nan, inf, big], [None] * 4, [None] * 4)
    assert sums[0] == 30.0
    assert math.isnan(sums[1]) and sums[2] == math.inf
    assert math.sqrt(sums[3]) == pytest.approx(5e30)


@needs_kernels
def test_norms_do_not_depend_on_the_thread_count():
    grad, _ = _case((2000, 300), torch.float32, 0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _native.norms_and_gather([grad], [None], [None])
        torch.set_num_threads(2)
        two = _native.norms_and_gather([grad], [None], [None])
    finally:
        torch.set_num_threads(before)
    assert one == two


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_scatter_matches_torch(dtype, shape):
    k = max(1, shape[1] // 10)
    param, index = _case(shape, dtype, k, seed=1)
    source = torch.randn(shape[0], k) * 1.0001  # values between bf16 neighbours: exercises the rounding

    expected = param.clone()
    expected[:, index] = source.to(dtype)
    _native.scatter([param], [source], [index])
    assert torch.equal(param, expected)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_optimizer_gives_the_same_bits_without_the_kernels(monkeypatch, dtype):
    """Gather, scatter and write-back are exact either way; the norms differ in rounding but only decide skips
    (none here) and Zen-auto windows (fixed interval here)."""
    runs = []
    for native in ("1", "0"):
        monkeypatch.setenv("HF_ZENFLOW_NATIVE", native)
        model = make_model(dtype=dtype)
        opt = ZenFlowAdamW(param_groups(model), lr=1e-2, topk_ratio=0.2, update_interval=3,
                           select_strategy="step", select_interval=7, min_offload_numel=0)
        losses = train(model, opt, batches(20), linear_schedule(opt, 20))
        opt.flush()
        opt.close()
        runs.append((model, losses))
    (with_kernels, losses_a), (without, losses_b) = runs
    assert losses_a == losses_b
    for p, q in zip(with_kernels.parameters(), without.parameters()):
        assert torch.equal(p, q)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("HF_ZENFLOW_NATIVE", "0")
    assert _native.library() is None
    assert _native.status().startswith("disabled")


def test_kernels_build_wherever_a_compiler_exists():
    import shutil

    if not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        pytest.skip("no C compiler here")
    assert _native.library() is not None, _native.status()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("coef", [None, 0.37])
def test_accumulate_matches_torch(monkeypatch, dtype, coef):
    from hf_zenflow.engine.host import accumulate_into

    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(203, 77, generator=gen).to(dtype) for _ in range(3)]
    results = []
    for native in ("1", "0"):
        monkeypatch.setenv("HF_ZENFLOW_NATIVE", native)
        accum = torch.full((203, 77), float("nan"))
        for i, g in enumerate(grads):
            accumulate_into(accum, g, coef, first=i == 0)
        results.append(accum)
    assert torch.equal(results[0], results[1])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_scores_match_column_scores(dtype):
    """The batched row scores (re-selection of column-major weights and embedding rows) are torch's
    `column_scores` up to summation order, and pick the same top rows."""
    from hf_zenflow.engine.selection import column_scores, top_columns

    gen = torch.Generator().manual_seed(11)
    mats = [(torch.randn(r, c, generator=gen) * 2).to(dtype) for r, c in [(301, 17), (64, 1536), (5, 3)]]
    for m, scores in zip(mats, _native.row_scores(mats)):
        reference = column_scores(m, 0)
        assert scores.dtype == torch.float32 and scores.shape == reference.shape
        torch.testing.assert_close(scores, reference, rtol=1e-5, atol=0)
        k = max(1, m.shape[0] // 10)
        assert torch.equal(top_columns(scores, k), top_columns(reference, k))


@needs_kernels
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, None])
@pytest.mark.parametrize("count", [1, 3, 4])
def test_window_adamw_is_sum_divide_and_torch_fused_adamw_bit_for_bit(grad_dtype, count):
    """The one-pass host AdamW of a window (`kernels.window_adamw`) against the two passes it replaces: the last
    gradient added into the sum (`accumulate`), the division by the window's length, torch's fused AdamW. Sizes with
    every kind of tail torch's vectorised kernel leaves (none, < 8, 8, > 8 elements), both forms of its moment update
    (beta1 0.9 and 0.3), with and without weight decay."""
    from hf_zenflow._base import fused_adamw_

    assert _native.window_adamw_available()
    for numel, beta1, weight_decay in ((16, 0.9, 0.1), (37, 0.9, 0.0), (40, 0.3, 0.1), (1007, 0.9, 0.1),
                                       (70001, 0.95, 0.01)):
        gen = torch.Generator().manual_seed(numel)
        master, accum = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen)
        exp_avg, exp_avg_sq = torch.randn(numel, generator=gen) * 0.01, torch.rand(numel, generator=gen) * 1e-4
        grad = None if grad_dtype is None else torch.randn(numel, generator=gen).to(grad_dtype)
        first = count == 1 and grad is not None  # a one-step window: the sum is that gradient alone
        hyper = {"lr": 1e-3, "betas": (beta1, 0.999), "eps": 1e-8, "weight_decay": weight_decay}
        ref = [master.clone(), exp_avg.clone(), exp_avg_sq.clone(), torch.tensor(4.0)]
        mean = accum.clone()
        if grad is not None:
            _native.accumulate([mean], [grad], 0.7, first)
        if count > 1:
            mean.div_(count)
        fused_adamw_([ref[0]], [mean], [ref[1]], [ref[2]], [ref[3]], hyper)
        mine = [master.clone(), exp_avg.clone(), exp_avg_sq.clone(), torch.tensor(4.0)]
        kept = accum.clone()
        _native.window_adamw([mine[0]], [kept], [grad], [first], [count], [mine[1]], [mine[2]], [mine[3]], hyper, 0.7)
        for a, b in zip(ref, mine):
            assert torch.equal(a, b), numel
        assert torch.equal(kept, accum)  # read, never written
