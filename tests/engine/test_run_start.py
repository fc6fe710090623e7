"""What a run decides and says once, at its first step (`hf_zenflow.engine.run_start`): over many steps each log line
appears once, the announcers are called at the first step only, and a loaded checkpoint starts a new run that says
what it restored."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch

from hf_zenflow.engine import run_start
from tests.conftest import batches, make_model, param_groups, roundtrip, train, zenflow_adamw


#: the start of each once-per-run log line: writeback_lag="auto"'s choice, high_lr_rule="auto"'s, the warning that
#: the rule made the windows one step long, and what device_memory_limit_bytes chose
LINES = {
    "lag": 'hf_zenflow: writeback_lag="auto" chose',
    "high_lr": 'hf_zenflow: high_lr_rule="auto": peak lr',
    "one_step_windows": 'ZenFlowAdamW: high_lr_rule="auto" shortened the host windows',
    "limit": "hf_zenflow: device_memory_limit_bytes=",
}


def _said(caplog: pytest.LogCaptureFixture) -> Counter:
    return Counter(name for r in caplog.records for name, start in LINES.items() if r.getMessage().startswith(start))


def test_the_once_per_run_lines_appear_once_over_many_steps_and_again_after_a_load(monkeypatch, caplog):
    calls: Counter = Counter()
    for name in ("announce_high_lr_rule", "announce_offload", "announce_limit"):
        original = getattr(run_start, name)
        monkeypatch.setattr(run_start, name,
                            lambda *a, _name=name, _original=original, **k: (calls.update([_name]),
                                                                              _original(*a, **k))[1])
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=1e-2, topk_ratio=0.25, update_interval=4, min_offload_numel=0,
                        writeback_lag="auto", high_lr_rule="auto", device_memory_limit_bytes=10**9,
                        host_executor="inline")
    with caplog.at_level(logging.INFO, logger="hf_zenflow"):
        train(model, opt, batches(24), clip=1.0)
    assert _said(caplog) == {"lag": 1, "high_lr": 1, "one_step_windows": 1, "limit": 1}
    assert calls == {"announce_high_lr_rule": 1, "announce_offload": 1, "announce_limit": 1}

    caplog.clear()
    opt.load_state_dict(roundtrip(opt.state_dict()))
    with caplog.at_level(logging.INFO, logger="hf_zenflow"):
        train(model, opt, batches(8, seed=2), clip=1.0)
    opt.close()
    # the resumed run says what it restored, once; the lag it restored was chosen already (logged when chosen)
    assert _said(caplog) == {"high_lr": 1, "one_step_windows": 1, "limit": 1}
    assert calls == {"announce_high_lr_rule": 2, "announce_offload": 2, "announce_limit": 2}


def test_a_first_step_skipped_before_any_state_leaves_the_announcements_to_the_next(caplog):
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=1e-3, topk_ratio=0.25, update_interval=4, min_offload_numel=0,
                        device_memory_limit_bytes=10**9, host_executor="inline")
    (x, _), = batches(1)
    model(x).float().sum().backward()
    with caplog.at_level(logging.INFO, logger="hf_zenflow"):
        opt.grad_scale, opt.found_inf = None, torch.ones(())  # (what a GradScaler's step passes after an overflow)
        opt.step()
        del opt.grad_scale, opt.found_inf
        opt.zero_grad()
        assert opt.stats()["skipped_steps"] == 1 and not _said(caplog)  # (nothing decided yet: no state exists)
        train(model, opt, batches(6), clip=1.0)
    opt.close()
    assert _said(caplog) == {"lag": 1, "limit": 1}
