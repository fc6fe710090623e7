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
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sum_dtype", [torch.float32, torch.bfloat16])
def test_accumulate_into_kept_columns_is_the_full_sums_columns(grad_dtype, sum_dtype):
    """`accumulate` with an index (a sum of the unselected columns) gives each kept element the bits of the sum of
    every column; scattering a bf16 sum into a bf16 tensor copies its bits."""
    gen = torch.Generator().manual_seed(4)
    grads = [torch.randn(203, 77, generator=gen).to(grad_dtype) for _ in range(3)]
    kept = torch.tensor([c for c in range(77) if c % 9], dtype=torch.long)
    full = torch.full((203, 77), float("nan"), dtype=sum_dtype)
    columns = torch.full((203, kept.numel()), float("nan"), dtype=sum_dtype)
    for i, g in enumerate(grads):
        _native.accumulate([full], [g], 0.37, first=i == 0)
        _native.accumulate([columns], [g], 0.37, first=i == 0, index=[kept])
    assert torch.equal(columns, full[:, kept])
    if sum_dtype == torch.bfloat16:
        spread = torch.zeros(203, 77, dtype=torch.bfloat16)
        _native.scatter([spread], [columns], [kept])
        assert torch.equal(spread[:, kept], columns) and not spread.index_select(
            1, torch.arange(0, 77, 9)).any()


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


@needs_kernels
@pytest.mark.parametrize("threads, chunk", [(1, None), (3, 4096)])
@pytest.mark.parametrize("coef", [None, 0.7])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, None])
@pytest.mark.parametrize("count", [1, 3])
def test_window_adamw_bf16_is_the_torch_narrow_moment_pass_bit_for_bit(grad_dtype, count, coef, threads, chunk,
                                                                       monkeypatch):
    """The one-pass host AdamW with bf16 moments (`kernels.window_adamw_bf16`) against the torch pass it replaces
    (`_adamw_narrow_moments`, after the window's sum and mean): the last gradient folded in or already summed, a
    one-step window or a longer one, with and without a clip coefficient, on one thread and on several (the
    reference then in pieces too). Sizes with every kind of tail torch's vectorised kernel leaves (none, < 8, 8,
    > 8 elements) and several work items, both forms of its moment update (beta1 0.9 and 0.3), with and without
    weight decay; a few gradient-free elements whose moments decay into bf16's subnormal range."""
    import hf_zenflow.engine.host as host_module
    from hf_zenflow.engine.host import HostMatrix

    assert _native.window_adamw_bf16_available()
    if chunk is not None:
        monkeypatch.setattr(host_module, "ROUNDING_PIECE", chunk)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for shape, beta1, weight_decay in (((1, 16), 0.9, 0.1), ((1, 37), 0.9, 0.0), ((5, 8), 0.3, 0.1),
                                           ((19, 53), 0.9, 0.1), ((7, 10001), 0.95, 0.01), ((3, 4099), 0.3, 0.0)):
            gen = torch.Generator().manual_seed(shape[0] * shape[1])
            master, accum = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
            exp_avg = (torch.randn(shape, generator=gen) * 0.01).bfloat16()
            exp_avg_sq = (torch.rand(shape, generator=gen) * 1e-4).bfloat16()
            grad = None if grad_dtype is None else torch.randn(shape, generator=gen).to(grad_dtype)
            tiny = torch.tensor([1e-38, -3e-39, 5e-39, 1.2e-38, -2e-40])
            exp_avg.view(-1)[:5], exp_avg_sq.view(-1)[:5] = tiny.bfloat16(), tiny.abs().bfloat16()
            accum.view(-1)[:5] = 0.0
            if grad is not None:
                grad.view(-1)[:5] = 0.0
            first = count == 1 and grad is not None  # a one-step window: the sum is that gradient alone
            hyper = {"lr": 1e-3, "betas": (beta1, 0.999), "eps": 1e-8, "weight_decay": weight_decay}
            states = []
            for _ in range(2):
                m = HostMatrix.create(master, torch.float32, moments=torch.bfloat16)
                m.exp_avg.copy_(exp_avg)
                m.exp_avg_sq.copy_(exp_avg_sq)
                m.accum.copy_(accum)
                m.step.fill_(4.0)
                states.append(m)
            kernel, plain = states
            _native.window_adamw_bf16([kernel.master], [kernel.accum], [grad], [first], [count], [kernel.exp_avg],
                                      [kernel.exp_avg_sq], [kernel.step], hyper, coef)
            plain.accum_count = count - (grad is not None)
            if grad is not None:
                plain.accumulate(grad, coef)
            if count > 1:
                plain.accum.div_(count)
            host_module._adamw_narrow_moments(plain, hyper)
            for name in ("master", "exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(getattr(kernel, name), getattr(plain, name)), (shape, name)
            assert torch.equal(kernel.accum, accum)  # read, never written
            assert not torch.equal(kernel.exp_avg_sq, exp_avg_sq)  # (and the moments moved)
            assert (kernel.exp_avg_sq.view(-1)[:5] != 0).any() and kernel.exp_avg_sq.view(-1)[:5].abs().min() < 1.1e-38
    finally:
        torch.set_num_threads(previous)
