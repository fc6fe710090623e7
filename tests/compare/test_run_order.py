"""`compare`'s run order (`hf_zenflow.compare.run_order`): interleaved runs compute exactly what sequential runs
compute, each run's clock holds only its own turns, and no run's host work overlaps another run's turn. A tiny
in-file model with dropout stands in for the real one (its random stream must survive the other runs' turns)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from hf_zenflow.compare import runner
from hf_zenflow.compare.compare_config import CompareConfig
from hf_zenflow.compare.data import Batch, PreparedTask
from hf_zenflow.compare.machine_load import LoadMonitor
from hf_zenflow.compare.metrics import resolve_metric
from hf_zenflow.compare.run_order import MIN_BLOCK_STEPS, resolve_block_steps, resolve_run_order, turns
from hf_zenflow.compare.training_run import TIMING_SKIP, TrainingRun


class DropoutClassifier(torch.nn.Module):
    """Two matrices with dropout between them and a head: every step draws from the global random stream."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(32, 64)
        self.drop = torch.nn.Dropout(0.2)
        self.down = torch.nn.Linear(64, 32)
        self.head = torch.nn.Linear(32, 2)

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        logits = self.head(torch.relu(self.down(self.drop(torch.relu(self.up(features))))))
        return SimpleNamespace(loss=torch.nn.functional.cross_entropy(logits, labels), logits=logits)


def tiny_task(steps: int) -> PreparedTask:
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(1)
    model = DropoutClassifier()

    def batch() -> Batch:
        x = torch.randn(8, 32, generator=gen)
        return Batch({"features": x, "labels": (x[:, 0] > 0).long()}, 8)

    return PreparedTask(task="sequence-classification", model_name="tiny", model_path="", dataset_name="random",
                        base_model=model, tokenizer=None, train_batches=[batch() for _ in range(steps)],
                        eval_batches=[batch()], train_examples=8 * steps, eval_examples=8, max_length=32,
                        metric=resolve_metric("accuracy", "sequence-classification"))


def tiny_config(**overrides) -> CompareConfig:
    values = dict(steps=21, train_size=168, batch_size=8, update_interval=2, min_offload_numel=0,
                  log_every=0, quiet=True, device="cpu", device_cores=1, host_cores=1, lr=1e-2, save_model=True)
    values.update(overrides)
    return CompareConfig(**values)


@pytest.mark.parametrize(("steps", "block", "first", "names"), [
    (21, 8, 2, ["a", "b", "c"]),
    (12, 4, 2, ["a", "b"]),
    (9, 8, 0, ["a", "b", "c"]),
    (1, 8, 0, ["a", "b", "c"]),
])
def test_turns_cover_every_step_and_rotate(steps: int, block: int, first: int, names: list[str]) -> None:
    schedule = list(turns(steps, block, first, names))
    for name in names:
        counts = [n for who, n in schedule if who == name]
        assert sum(counts) == steps
        if first:
            assert counts[0] == first and all(n <= block for n in counts[1:])
    rounds = [schedule[i:i + len(names)] for i in range(0, len(schedule), len(names))]
    for r, turn in enumerate(rounds):
        assert [who for who, _ in turn] == [*names[r % len(names):], *names[:r % len(names)]]
        assert len({n for _, n in turn}) == 1  # every run advances as far in a round


def test_block_steps_and_run_order_resolution() -> None:
    assert resolve_block_steps(None, 4) == 8 and resolve_block_steps(None, 16) == 32
    assert resolve_block_steps(None, "auto") == MIN_BLOCK_STEPS
    assert resolve_run_order("auto", torch.device("cpu"), 10**6, 3)[0] == "interleaved"
    assert resolve_run_order("auto", torch.device("cpu"), 10**15, 3)[0] == "sequential"  # the copies do not fit
    assert resolve_run_order("auto", torch.device("cuda"), 10**6, 3)[0] == "sequential"
    assert resolve_run_order("sequential", torch.device("cpu"), 10**6, 3)[0] == "sequential"
    with pytest.raises(ValueError, match="run_order='both' is invalid: allowed are 'auto', 'interleaved'"):
        CompareConfig(run_order="both")
    with pytest.raises(ValueError, match="block_steps=4 is invalid: allowed is None or an integer >= 8"):
        CompareConfig(block_steps=4)


def _both_orders(task: PreparedTask, cfg: CompareConfig) -> tuple[dict, dict]:
    monitor = LoadMonitor()
    sequential = runner._run_sequential(cfg, task, torch.device("cpu"), monitor, None)
    interleaved = runner._run_interleaved(cfg, task, torch.device("cpu"), monitor, None, 8)
    return sequential, interleaved


def test_interleaved_runs_compute_exactly_what_sequential_runs_compute() -> None:
    """Every step's loss, the held-out loss and ZenFlow's final weights are bit-identical whether the three runs
    take turns (8-step turns, 21 steps: 4 turns each) or run one after the other; dropout draws from each run's own
    stream. A run that shared one stream would differ from the sequential one at its second turn."""
    task, cfg = tiny_task(21), tiny_config()
    sequential, interleaved = _both_orders(task, cfg)
    for name in cfg.optimizers:
        assert interleaved[name]["curves"]["loss"] == sequential[name]["curves"]["loss"], name
        assert interleaved[name]["eval_loss"] == sequential[name]["eval_loss"], name
        assert interleaved[name]["turns"] == 4 and sequential[name]["turns"] == 1
    assert len(set(sequential[name]["eval_loss"] for name in cfg.optimizers)) > 1  # the optimizers do differ
    seq_model, int_model = sequential["zenflow"]["_model"], interleaved["zenflow"]["_model"]
    for (key, a), b in zip(seq_model.state_dict().items(), int_model.state_dict().values()):
        assert torch.equal(a, b), key


def test_each_run_counts_its_own_turns_and_host_work_never_crosses_a_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """adamw_torch's step sleeps 30 ms more and ZenFlow's host jobs 25 ms more: only adamw_torch's step time grows
    by the 30 ms, ZenFlow's host jobs all end before another run's turn starts (the wait charged to ZenFlow as
    handover time), and the three runs' clocks together tile the span of the turns."""
    from hf_zenflow.engine.worker import HostAdamWorker

    sleep_s, host_sleep_s = 0.03, 0.025
    real_step = torch.optim.AdamW.step

    def slow_step(self, *args, **kwargs):
        time.sleep(sleep_s)
        return real_step(self, *args, **kwargs)

    host_spans: list[tuple[float, float]] = []
    real_execute = HostAdamWorker._execute

    def slow_execute(self, what, fn, future):
        start = time.perf_counter()
        if threading.current_thread() is not threading.main_thread():
            time.sleep(host_sleep_s)
        real_execute(self, what, fn, future)
        host_spans.append((start, time.perf_counter()))

    turn_spans: list[tuple[str, float, float]] = []
    real_advance = TrainingRun.advance

    def recorded_advance(self, count, handover=False):
        start = time.perf_counter()
        real_advance(self, count, handover)
        turn_spans.append((self.name, start, time.perf_counter()))

    monkeypatch.setattr(torch.optim.AdamW, "step", slow_step)
    monkeypatch.setattr(HostAdamWorker, "_execute", slow_execute)
    monkeypatch.setattr(TrainingRun, "advance", recorded_advance)
    # (the free memory: the window summed on the device, so that ZenFlow's step itself never waits for a host job)
    task, cfg = tiny_task(21), tiny_config(save_model=False, device_memory_limit_bytes="free")
    results = runner._run_interleaved(cfg, task, torch.device("cpu"), LoadMonitor(), None, 8)
    span_s = max(b for _, _, b in turn_spans) - min(a for _, a, _ in turn_spans)
    others = [(a, b) for who, a, b in turn_spans if who != "zenflow"]
    assert host_spans and others
    for h0, h1 in host_spans:  # the worker's jobs (inline ones included) never overlap another run's turn
        assert all(h1 <= a or h0 >= b for a, b in others), (h0, h1)
    assert results["zenflow"]["handover_ms_total"] > 0
    base, zen = results["adamw_torch"], results["zenflow"]
    assert base["opt_step_ms_median"] >= 1e3 * sleep_s
    assert zen["opt_step_ms_median"] < 1e3 * sleep_s  # the other run's sleeps are not in ZenFlow's clock
    own = sum(r["train_seconds"] for r in results.values())
    assert 0.9 * span_s <= own <= span_s  # the runs' clocks tile the span of the turns: nothing counted twice
    assert TIMING_SKIP == 2  # the first turn of each run is the untimed steps
