"""Column-major weights (`column_major_`, DeepSpeed's transposed layout): the optimizer gives the same results in
either layout, the reference equivalences hold, and checkpoints move between layouts."""

from __future__ import annotations

import pytest
import torch

from hf_zenflow import SyncOffloadAdamW, ZenFlowAdamW, ZenFlowConfig, column_major_
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


LR = 1e-2
STEPS = 30


def column_major_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    model = make_model(seed, dtype)
    assert column_major_(model) == ["up.weight", "down.weight"]
    return model


def test_column_major_keeps_values_and_skips_tied_embeddings():
    model = make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    column_major_(model)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])
    assert model.up.weight.t().is_contiguous() and not model.up.weight.is_contiguous()
    assert model.embed.weight.is_contiguous()  # an embedding reads rows: left alone

    tied = torch.nn.ModuleDict({"embed": torch.nn.Embedding(10, 6), "head": torch.nn.Linear(6, 10, bias=False),
                                "proj": torch.nn.Linear(6, 6)})
    tied["head"].weight = tied["embed"].weight
    assert column_major_(tied) == ["proj.weight"]
    assert tied["head"].weight.is_contiguous()


def test_column_major_re_lays_only_weights_that_will_be_offloaded():
    """Frozen weights (a LoRA base) keep their layout; with a config, so do weights it does not offload (below
    `min_offload_numel`, or every column on the device at topk_ratio=1)."""
    model = make_model()  # up: 80x40 = 3200 elements, down: 24x80 = 1920
    model.up.weight.requires_grad_(False)
    assert column_major_(model) == ["down.weight"]
    assert model.up.weight.is_contiguous()
    model = make_model()
    assert column_major_(model, ZenFlowConfig(min_offload_numel=2000)) == ["up.weight"]
    assert model.down.weight.is_contiguous()
    model = make_model()
    assert column_major_(model, ZenFlowConfig(min_offload_numel=0, topk_ratio=1.0)) == []
    assert column_major_(model, ZenFlowConfig(min_offload_numel=0)) == ["up.weight", "down.weight"]


def test_gradients_keep_the_parameter_layout():
    """What the optimizer relies on: autograd gives a column-major weight a column-major gradient."""
    model = column_major_model()
    x, y = (t.to(DEVICE) for t in batches(1)[0])
    torch.nn.functional.cross_entropy(model(x).view(-1, 24), y.view(-1)).backward()
    assert model.up.weight.grad.stride() == model.up.weight.stride()


@pytest.mark.parametrize(
    "settings, clip",
    [
        (dict(topk_ratio=1.0), None),
        (dict(topk_ratio=0.1, update_interval=1, overlap_step=False, select_strategy="step", select_interval=3), 0.5),
        (dict(topk_ratio=0.5, update_interval=1, overlap_step=False, select_strategy="step", select_interval=3), None),
    ],
)
def test_column_major_degenerate_settings_are_adamw(settings, clip):
    ref = column_major_model()  # same layout: forward and backward are the same arithmetic
    ref_opt = torch.optim.AdamW(param_groups(ref), lr=LR)
    ref_losses = train(ref, ref_opt, batches(STEPS), linear_schedule(ref_opt, STEPS), clip=clip)
    model = column_major_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, **settings, min_offload_numel=0, **FP32_MOMENTS)
    losses = train(model, opt, batches(STEPS), linear_schedule(opt, STEPS), clip=clip)
    opt.close()
    assert max_rel_diff(model, ref) < 1e-5
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert not model.up.weight.is_contiguous()  # the layout survives training


def test_column_major_sync_offload_is_adamw_and_keeps_the_layout_on_the_host():
    ref = column_major_model()
    ref_opt = torch.optim.AdamW(param_groups(ref), lr=LR)
    train(ref, ref_opt, batches(10), clip=1.0)
    model = column_major_model()
    opt = SyncOffloadAdamW(param_groups(model), lr=LR)
    train(model, opt, batches(10), clip=1.0)
    assert max_rel_diff(model, ref) < 1e-5
    assert opt._host[model.up.weight].master.stride() == model.up.weight.stride()


OVERLAP_SETTINGS = dict(topk_ratio=0.25, update_interval=3, select_strategy="step", select_interval=7)


def assert_overlapped_equals_sequential(make, groups) -> ZenFlowAdamW:
    """Train `make()` with the threaded and the inline worker: losses and weights must agree bit for bit. Returns
    the threaded run's optimizer (closed)."""
    runs = []
    for executor in ("thread", "inline"):
        model = make()
        opt = zenflow_adamw(groups(model), lr=LR, host_executor=executor, **OVERLAP_SETTINGS, min_offload_numel=0)
        losses = train(model, opt, batches(STEPS), linear_schedule(opt, STEPS), clip=1.0)
        opt.flush()
        opt.close()
        runs.append((losses, model, opt))
    (losses_t, model_t, opt_t), (losses_i, model_i, _) = runs
    assert losses_t == losses_i
    for p, q in zip(model_t.parameters(), model_i.parameters()):
        assert torch.equal(p, q)
    return opt_t


def test_column_major_overlapped_equals_sequential_bit_for_bit():
    assert_overlapped_equals_sequential(column_major_model, param_groups)


SHAPES = [(48, 40), (24, 64), (64,)]


def layout_params(column_major: bool, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(5)
    params = []
    for shape in SHAPES:
        t = (torch.randn(shape, generator=gen) * 0.1).to(dtype)
        if column_major and t.ndim == 2:
            t = t.t().contiguous().t()
        params.append(torch.nn.Parameter(t))
    return params


def step_with(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer, grads: list[list[torch.Tensor]]) -> None:
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = torch.empty_like(p).copy_(g)  # the parameter's own layout, as autograd would give it
        opt.step()
        opt.zero_grad()


def layout_grads(steps: int, dtype: torch.dtype, seed: int = 9) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    # a few loud input columns per matrix, as real gradients have, so that selections are well separated
    return [[(torch.randn(s, generator=gen) * (1 + 20 * (torch.rand(s[-1], generator=gen) > 0.85))).to(dtype)
             for s in SHAPES] for _ in range(steps)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("accumulate_on", ["host", "device"])
def test_layouts_give_identical_bits_on_identical_gradients(dtype, accumulate_on):
    """Row- and column-major weights go through different gather/scatter code (strided columns vs contiguous
    rows) but the same arithmetic: with fp32 host moments (rounded by nothing) every weight bit must agree."""
    finals = layout_runs(dtype, accumulate_on, FP32_MOMENTS)
    for (p_row, m_row), (p_col, m_col) in zip(*finals):
        assert torch.equal(p_row, p_col)
        assert torch.equal(m_row, m_col)


def test_layouts_differ_only_by_the_random_bits_of_narrow_moments():
    """bf16 host moments are rounded stochastically with bits keyed by each element's place in the parameter's
    storage (`rounding.RandomStream`), which a column-major weight orders otherwise: the layouts draw other bits
    and agree within that rounding's noise, far closer than the update itself."""
    (row, col), start = layout_runs(torch.float32, "host", {}), layout_params(False, torch.float32)
    moved = max(((p - s).abs().max() / s.abs().max()).item() for (p, _), s in zip(row, start))
    apart = max(((p - q).abs().max() / p.abs().max()).item() for (p, _), (q, _) in zip(row, col))
    assert 0 < apart < moved / 20, (apart, moved)


def layout_runs(dtype: torch.dtype, accumulate_on: str, moments: dict) -> list[list[tuple]]:
    """The final weights and master weights of the row-major run, then of the column-major one, on the same
    gradients."""
    grads = layout_grads(24, dtype)
    settings = dict(lr=LR, topk_ratio=0.1, update_interval=4, select_strategy="step", select_interval=5,
                    min_offload_numel=16, accumulate_on=accumulate_on, **moments)
    finals = []
    for column_major in (False, True):
        params = layout_params(column_major, dtype)
        opt = zenflow_adamw(params, **settings)
        step_with(params, opt, grads)
        assert opt.engine_state.splits[params[0]].axis == (0 if column_major else 1)
        opt.flush()
        finals.append([(p.detach().clone(), opt.master_weight(p)) for p in params])
        opt.close()
        assert opt.stats()["reselections"] >= 4
    return finals


@pytest.mark.parametrize("save_column_major", [False, True])
def test_checkpoint_moves_between_layouts(save_column_major):
    """Saved in one layout, resumed in the other: the run continues bit for bit (fp32 host moments; narrow ones
    would draw the other layout's random bits after the resume, see above)."""
    grads = layout_grads(22, torch.float32, seed=3)
    settings = dict(lr=LR, topk_ratio=0.1, update_interval=4, select_strategy="step", select_interval=8,
                    min_offload_numel=16, **FP32_MOMENTS)
    params = layout_params(False, torch.float32)
    opt = zenflow_adamw(params, **settings)
    step_with(params, opt, grads)
    opt.flush()
    opt.close()

    params_a = layout_params(save_column_major, torch.float32)
    opt_a = zenflow_adamw(params_a, **settings)
    step_with(params_a, opt_a, grads[:6])  # mid-window, a host step in flight
    checkpoint = roundtrip({"opt": opt_a.state_dict(), "params": [p.detach() for p in params_a]})
    opt_a.close()

    params_b = layout_params(not save_column_major, torch.float32)
    with torch.no_grad():
        for p, saved in zip(params_b, checkpoint["params"]):
            p.copy_(saved)
    opt_b = zenflow_adamw(params_b, **settings)
    opt_b.load_state_dict(checkpoint["opt"])
    step_with(params_b, opt_b, grads[6:])
    opt_b.flush()
    opt_b.close()
    for p, q in zip(params_b, params):
        assert torch.equal(p, q)


def test_exported_weights_are_row_major(tmp_path):
    """The layout never leaks into exports (a DeepSpeed ZeRO-3 hazard): `save_pretrained` writes ordinary
    tensors and loading gives a row-major model with the same values."""
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                 vocab_size=50))
    assert "encoder.layer.0.attention.self.query.weight" in column_major_(model)
    model.save_pretrained(tmp_path)
    loaded = BertModel.from_pretrained(tmp_path)
    query, loaded_query = (m.encoder.layer[0].attention.self.query.weight for m in (model, loaded))
    assert torch.equal(query, loaded_query) and loaded_query.is_contiguous() and not query.is_contiguous()


def embedding_row_groups(model: torch.nn.Module) -> list[dict]:
    """`param_groups` with the embedding table in its own group that selects rows (tokens)."""
    groups = param_groups(model)
    embed = model.embed.weight
    groups[0]["params"] = [p for p in groups[0]["params"] if p is not embed]
    return groups + [{"params": [embed], "weight_decay": 0.1, "select_rows": True}]


@pytest.mark.parametrize("topk_ratio", [0.1, 0.5])
def test_embedding_rows_interval_one_is_adamw(topk_ratio):
    """Selecting an embedding's rows is still AdamW when the split is invisible (U=1, sequential, re-selection)."""
    ref = make_model()
    ref_opt = torch.optim.AdamW(embedding_row_groups(ref), lr=LR)
    ref_losses = train(ref, ref_opt, batches(STEPS), linear_schedule(ref_opt, STEPS), clip=0.5)
    model = make_model()
    opt = zenflow_adamw(embedding_row_groups(model), lr=LR, topk_ratio=topk_ratio, update_interval=1,
                        overlap_step=False, select_strategy="step", select_interval=3, min_offload_numel=0,
                        **FP32_MOMENTS)
    losses = train(model, opt, batches(STEPS), linear_schedule(opt, STEPS), clip=0.5)
    split = opt.engine_state.splits[model.embed.weight]
    assert split.rows and split.device.master.shape == (split.k, 40) and split.k == int(topk_ratio * 24)
    opt.close()
    assert max_rel_diff(model, ref) < 1e-5
    assert losses == pytest.approx(ref_losses, rel=1e-5)


def test_embedding_rows_overlapped_equals_sequential_and_the_setting_is_checkpointed():
    opt = assert_overlapped_equals_sequential(make_model, embedding_row_groups)
    # like every group hyper-parameter, the setting comes back from the checkpoint
    saved = roundtrip(opt.state_dict())
    groups = embedding_row_groups(make_model())
    groups[-1]["select_rows"] = False
    other = zenflow_adamw(groups, lr=LR, **OVERLAP_SETTINGS, min_offload_numel=0)
    other.load_state_dict(saved)
    assert other.param_groups[-1]["select_rows"] is True
    assert other.engine_state.splits[groups[-1]["params"][0]].rows
    with pytest.raises(ValueError, match="select_rows='yes' is invalid"):
        ZenFlowAdamW([{"params": [torch.nn.Parameter(torch.zeros(4, 4))], "select_rows": "yes"}], min_offload_numel=0)
