"""One live ZenFlow optimizer per parameter: a second optimizer of this package over parameters a `ZenFlowAdamW`
holds takes them over (the first detached, said once), and `close()` takes the backward hooks off."""

from __future__ import annotations

import logging

import pytest
import torch

from hf_zenflow import SyncOffloadAdamW
from tests.conftest import batches, make_model, param_groups, train, zenflow_adamw


SETTINGS = dict(lr=1e-2, topk_ratio=0.1, update_interval=2, min_offload_numel=0, high_lr_rule="off")


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def fresh_run(start: list[torch.Tensor], steps: int, **settings) -> list[torch.Tensor]:
    """The reference: a ZenFlowAdamW on a model no other optimizer ever saw, from the weights `start`."""
    model = make_model()
    with torch.no_grad():
        for p, w in zip(model.parameters(), start):
            p.copy_(w)
    opt = zenflow_adamw(param_groups(model), **{**SETTINGS, **settings})
    train(model, opt, batches(steps, seed=5), clip=1.0)
    opt.flush()
    opt.close()
    return weights(model)


def takeover_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "takes over" in r.getMessage()]


def test_a_second_optimizer_takes_the_parameters_over_and_trains_as_a_fresh_one(caplog):
    """The README in order: a plain loop's optimizer left open (its hooks free the gradients in backward: it clips
    through `clip_grad_norm_`), then a new one over the same model. The new one trains exactly as one on a model no
    optimizer saw; the first refuses to step, naming why; the take-over is said once, with the count and a name."""
    model = make_model()
    first = zenflow_adamw(param_groups(model), **SETTINGS)
    first.name_parameters(model)
    train(model, first, batches(4), clip=1.0)
    first.flush()
    start = weights(model)
    with caplog.at_level(logging.WARNING, logger="hf_zenflow"):
        second = zenflow_adamw(param_groups(model), **{**SETTINGS, "free_gradients_in_backward": "on"})
        train(model, second, batches(6, seed=5), clip=1.0)
        second.flush()
    told = takeover_warnings(caplog)
    assert len(told) == 1, told
    assert "6 parameter(s) (the first: 'embed.weight')" in told[0] and "was not closed" in told[0], told[0]
    assert second.stats()["total_bytes_to_host"] > 0
    for ours, reference in zip(weights(model), fresh_run(start, 6, free_gradients_in_backward="on")):
        assert torch.equal(ours, reference)
    with pytest.raises(RuntimeError, match=r"no longer holds its parameters \(a ZenFlowAdamW built later over 6 "):
        first.step()
    second.close()
    with pytest.raises(RuntimeError, match="no longer holds its parameters"):  # (still: the parameters are taken)
        first.train()


def test_an_open_window_left_behind_is_named_in_the_warning(caplog):
    model = make_model()
    first = zenflow_adamw(param_groups(model), **SETTINGS, writeback_lag=None)
    train(model, first, batches(3), clip=1.0)  # one window closed, written back at the next one's end; one step in it
    first.close()  # closed, but not flushed
    with caplog.at_level(logging.WARNING, logger="hf_zenflow"):
        zenflow_adamw(param_groups(model), **SETTINGS).close()
    told = takeover_warnings(caplog)
    assert len(told) == 1 and "host updates of its last 3 step(s)" in told[0] and "not closed" not in told[0], told


def test_a_run_ended_with_flush_and_close_is_taken_over_without_a_word(caplog):
    """The Trainer's end of training (flush, close): nothing is lost, so nothing is said; the step still refuses."""
    model = make_model()
    first = zenflow_adamw(param_groups(model), **SETTINGS)
    train(model, first, batches(3), clip=1.0)
    first.flush()
    first.close()
    with caplog.at_level(logging.WARNING, logger="hf_zenflow"):
        second = zenflow_adamw(param_groups(model), **SETTINGS)
    assert takeover_warnings(caplog) == []
    with pytest.raises(RuntimeError, match="no longer holds its parameters"):
        train(model, first, batches(1))
    second.close()


def test_only_the_shared_parameters_are_taken_over_and_others_stay_held():
    """Two optimizers over different parameters of one model both train; a third over one of them detaches only
    the one holding it."""
    model = make_model()
    matrices = [model.up.weight, model.down.weight]
    rest = [p for p in model.parameters() if all(p is not m for m in matrices)]
    a = zenflow_adamw(matrices, **SETTINGS)
    b = zenflow_adamw(rest, **SETTINGS)
    c = zenflow_adamw([model.embed.weight], **SETTINGS)
    with pytest.raises(RuntimeError, match=r"over 1 parameter\(s\) \(the first: one of shape \(24, 40\)\)"):
        b.step()
    a.step()  # (no gradients yet: a step that changes nothing, but not refused)
    for opt in (a, b, c):
        opt.close()


def test_close_takes_the_hooks_off_and_a_later_step_puts_them_back_exactly():
    """With gradients freed in backward, the hooks take the offloaded matrices' gradients off the parameters: after
    `close()` a backward leaves them in place (for another optimizer); a step after the close hooks again and the
    run continues bit for bit as one never closed."""
    settings = {**SETTINGS, "free_gradients_in_backward": "on"}
    results = []
    for close_between in (False, True):
        model = make_model()
        opt = zenflow_adamw(param_groups(model), **settings)
        data = batches(8)
        train(model, opt, data[:3], clip=1.0)
        if close_between:
            opt.close()
            x, y = data[3]
            torch.nn.functional.cross_entropy(model(x).view(-1, 24), y.view(-1)).backward()
            assert model.up.weight.grad is not None and model.down.weight.grad is not None
            model.zero_grad()
        train(model, opt, data[3:5], clip=1.0)  # the first step after the close hooks again
        if close_between:
            x, y = data[5]
            torch.nn.functional.cross_entropy(model(x).view(-1, 24), y.view(-1)).backward()
            assert model.up.weight.grad is None  # taken by the hook again
            opt.zero_grad()
        train(model, opt, data[6:], clip=1.0)
        opt.flush()
        opt.close()
        results.append(weights(model))
    for ours, reference in zip(*results):
        assert torch.equal(ours, reference)


def test_sync_offload_over_the_parameters_of_an_open_zenflow_optimizer_trains():
    """`SyncOffloadAdamW` reads ``p.grad`` in `step()`: an open ZenFlowAdamW's hooks would free the gradients first.
    It takes them over and trains as on a model no optimizer saw."""
    model = make_model()
    zen = zenflow_adamw(param_groups(model), **{**SETTINGS, "free_gradients_in_backward": "on"})
    train(model, zen, batches(2), clip=1.0)
    zen.flush()
    start = weights(model)
    sync = SyncOffloadAdamW(param_groups(model), lr=1e-2)
    train(model, sync, batches(3, seed=5))
    reference = make_model()
    with torch.no_grad():
        for p, w in zip(reference.parameters(), start):
            p.copy_(w)
    ref_opt = SyncOffloadAdamW(param_groups(reference), lr=1e-2)
    train(reference, ref_opt, batches(3, seed=5))
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(ours, theirs)
    with pytest.raises(RuntimeError, match="a SyncOffloadAdamW built later"):
        zen.step()
    sync.close()
    ref_opt.close()
