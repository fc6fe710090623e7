"""One fine-tune of the comparison: a fresh copy of the model trained with one optimizer, every step timed phase by
phase, then evaluated on the held-out set (`train_one`).

Timing: each phase of every step is measured with `time.perf_counter`, synchronising the device's current stream at
phase boundaries when the device is CUDA (side-stream copies that ZenFlow overlaps are not waited for, as a training
loop would not wait for them either). "optimizer step ms" is the caller's time inside ``optimizer.step()``, the
critical path the optimizer adds to a training step. The first `TIMING_SKIP` steps (state allocation, first
selection) are left out of the per-step statistics (median, p10-p90, mean) and reported separately.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from typing import Any

import torch

from hf_zenflow.compare.compare_config import CompareConfig
from hf_zenflow.compare.data import PreparedTask
from hf_zenflow.compare.plots import ENGINE_PHASES, LABELS
from hf_zenflow.compare.report import OPTIMIZERS
from hf_zenflow.compare.timeline import StepClock, TimelineRecorder, device_utilization, wait_ms
from hf_zenflow.engine.device_memory import DeviceMemoryMeter
from hf_zenflow.engine.layout import column_major_
from hf_zenflow.optimizer import SyncOffloadAdamW, ZenFlowAdamW
from hf_zenflow.settings import ZenFlowConfig


#: Steps left out of the timing statistics: the first step allocates optimizer state and makes the first selection.
TIMING_SKIP = 2


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only, as the HF Trainer does (no decay on biases and norm weights)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def make_optimizer(name: str, model: torch.nn.Module, cfg: CompareConfig) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    common = {"lr": cfg.lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": cfg.weight_decay}
    if name == "adamw_torch":
        return torch.optim.AdamW(groups, fused=True, **common)
    host_cores = cfg.core_split().host  # the same H cores for both offloading runs (`compare.cores`)
    if name == "sync_offload":
        return SyncOffloadAdamW(groups, cpu_threads=host_cores, **common)
    if name == "zenflow":
        limit = device_memory_limit(cfg, model)
        zcfg = ZenFlowConfig(
            topk_ratio=cfg.topk_ratio, update_interval=cfg.update_interval, overlap_step=cfg.overlap_step,
            select_strategy=cfg.select_strategy, select_interval=cfg.select_interval,
            full_warm_up_rounds=cfg.full_warm_up_rounds, cpu_threads=host_cores,
            host_step=cfg.host_step, min_offload_numel=cfg.min_offload_numel, host_state=cfg.host_state,
            # --device-memory-limit-bytes: ZenFlow's whole step is held to it (the run's min_offload_numel is lowered
            # until the step fits, and the planner decides where windows are summed under it); "free": the device's
            # free memory
            device_memory_limit_bytes=cpu_device_free_limit(model) if limit is None else limit,
        ).with_rules(**cfg.rules)
        if cfg.resolved_embedding_select() == "rows":
            tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
            rows = [p for p in groups[0]["params"] if id(p) in tables]
            groups[0]["params"] = [p for p in groups[0]["params"] if id(p) not in tables]
            groups.append({"params": rows, "weight_decay": cfg.weight_decay, "select_rows": True})
        opt = ZenFlowAdamW(groups, config=zcfg, steps_per_epoch=_steps_per_epoch(cfg), **common)
        opt.clip_through_optimizer()  # (`TrainingRun._step` clips with `opt.clip_grad_norm_`)
        return opt
    raise ValueError(f"optimizer {name!r} is unknown: allowed are {OPTIMIZERS}.")


def sync_offload_device_bytes(model: torch.nn.Module) -> int:
    """What synchronous offload holds on the device at its peak: the weights and every trainable parameter's gradient
    (its optimizer state lives on the host), as the `sync_offload` run's meter counts them."""
    params = list(dict.fromkeys(model.parameters()))
    return sum(p.numel() * p.element_size() for p in params) + sum(
        p.numel() * p.element_size() for p in params if p.requires_grad)


def device_memory_limit(cfg: CompareConfig, model: torch.nn.Module) -> int | None:
    """The device memory ZenFlow's step is held to (`ZenFlowConfig.device_memory_limit_bytes`): synchronous
    offload's (`sync_offload_device_bytes`) by default, the bytes given, or None with "free"."""
    limit = cfg.device_memory_limit_bytes
    if limit == "sync":
        return sync_offload_device_bytes(model)
    return None if limit == "free" else int(limit)


def cpu_device_free_limit(model: torch.nn.Module) -> int | None:
    """``--device-memory-limit-bytes free`` on a CPU device: the weights it holds plus the machine's available memory
    now (model and data loaded), where device-side window sums would really live, so that `accumulate_on="auto"`
    weighs the memory left beside the step. CUDA measures its own free memory (None). Without a limit a CPU device
    always accumulates on the host, which no GPU run of a model this size would do."""
    if next(model.parameters()).device.type != "cpu":
        return None
    import psutil

    weights = sum(p.numel() * p.element_size() for p in dict.fromkeys(model.parameters()))
    return weights + int(psutil.virtual_memory().available)


def _steps_per_epoch(cfg: CompareConfig) -> int:
    return max(1, math.ceil(cfg.train_size / cfg.batch_size))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def torch_adamw_state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _p10_p90(values: list[float]) -> tuple[float | None, float | None]:
    """10th and 90th percentiles (inclusive method: within the observed range even for a handful of steps)."""
    if len(values) < 2:
        return (values[0], values[0]) if values else (None, None)
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    return deciles[0], deciles[-1]


@torch.no_grad()
def evaluate(model: torch.nn.Module, task: PreparedTask, device: torch.device) -> dict[str, float]:
    """Held-out loss (mean per label / per predicted token) and the task's metric (`task.metric`, computed by
    `evaluate` from the predicted classes, or next tokens of a causal LM; perplexity from the loss), under the
    metric's result key (``eval_accuracy``, ``eval_perplexity``, ...)."""
    model.eval()
    loss_sum, count = 0.0, 0
    predictions: list[int] = []
    references: list[int] = []
    for batch in task.eval_batches:
        b = batch.to(device)
        out = model(**b.inputs)
        labels = b.inputs["labels"]
        if task.metric.needs_predictions:
            if task.task == "causal-lm":  # the prediction at position t is of token t + 1
                predictions += out.logits[:, :-1].argmax(-1).flatten().tolist()
                references += labels[:, 1:].flatten().tolist()
            else:
                predictions += out.logits.argmax(-1).tolist()
                references += labels.tolist()
        loss_sum += float(out.loss) * b.n_items
        count += b.n_items
    model.train()
    loss = loss_sum / max(1, count)
    return {"eval_loss": loss, task.metric.key: task.metric.compute(predictions, references, loss)}


def train_one(name: str, task: PreparedTask, cfg: CompareConfig, device: torch.device,
              bar: Any = None) -> dict[str, Any]:
    """Fine-tune a fresh copy of the model with optimizer `name` from its first step to its last; return its measured
    figures. `bar` (a tqdm bar or None) advances one step per optimizer step."""
    run = TrainingRun(name, task, cfg, device, bar)
    run.advance(run.steps)
    return run.finish()


class TrainingRun:
    """One fine-tune of the comparison, advanced a block of steps at a time, so that the runs can take turns
    (`hf_zenflow.compare.run_order`): everything a run owns lives here (its model, optimizer, scheduler, random
    state and clocks), and its figures count only the time inside its own blocks.

    Example (what `train_one` does)::

        run = TrainingRun("zenflow", task, cfg, torch.device("cpu"))
        run.advance(run.steps)
        figures = run.finish()
    """

    def __init__(self, name: str, task: PreparedTask, cfg: CompareConfig, device: torch.device,
                 bar: Any = None) -> None:
        from transformers import get_linear_schedule_with_warmup

        self.name, self.task, self.cfg, self.device, self.bar = name, task, cfg, device, bar
        self.split = cfg.core_split()
        self.split.apply_device()  # D threads for the training thread, before the first forward: the same in every run
        torch.manual_seed(cfg.seed)  # dropout masks identical across the three runs
        model = copy.deepcopy(task.base_model).to(device)
        if name != "adamw_torch" and cfg.resolved_layout() == "column":
            # the no-offload reference keeps row-major weights: torch's fused AdamW runs ~4x slower on strided tensors
            column_major_(model)
        model.train()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self.model = model
        self.rss_start = _rss()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.opt = make_optimizer(name, model, cfg)
        self.is_engine = name != "adamw_torch"
        # what the device holds at its peak (weights, gradients, optimizer device state): ZenFlow counts its own
        # (`stats()`), the baselines are counted by their own meter, the same way
        self.meter = None if name == "zenflow" else DeviceMemoryMeter(
            model.parameters(), (lambda opt=self.opt: torch_adamw_state_bytes(opt)) if name == "adamw_torch"
            else (lambda opt=self.opt: int(opt.stats()["device_state_bytes"])), watch=True)
        self.steps = len(task.train_batches)
        self.sched = get_linear_schedule_with_warmup(self.opt, int(cfg.warmup_ratio * self.steps), self.steps)
        self.rec: dict[str, list[float]] = {k: [] for k in (
            "loss", "fb_ms", "clip_ms", "opt_ms", "other_ms", "step_ms", "handover_ms", "engine_critical_ms",
            "host_step_ms",
            "accumulate_ms", "bytes_to_host", "bytes_to_device", "staleness", "selected_fraction")}
        self.rss_peak = self.rss_start
        self.last_stats: dict[str, Any] = {}
        self.timeline = TimelineRecorder(min(TIMING_SKIP, max(0, self.steps - 1)))
        self.waits: list[float] = []
        self.next_step = 0
        self.train_s = 0.0  # wall time inside this run's own blocks
        self.handover_ms: list[float] = []  # the waits for this run's own host work before another run's turn
        self._rng = _random_state(device)  # this run's random stream, carried across the other runs' turns
        self.interleaved = False  # set by the runner when the runs take turns: the device's peak is then shared

    @property
    def done(self) -> bool:
        return self.next_step >= self.steps

    def advance(self, count: int, handover: bool = False) -> None:
        """Run the next `count` steps (fewer at the end). With `handover` (another run takes the turn next), wait
        until this run's host work is done before the clock stops: its host worker must not run on the host cores
        during another run's turn, and that wait counts as this run's time (one wait per turn; an overlapped host
        step would otherwise have hidden behind this run's next steps). The wait changes no value: a host result
        still pending its write-back step stays pending (`ZenFlowAdamW.synchronize`)."""
        _set_random_state(self.device, self._rng)
        self.split.apply_device()
        stop = min(self.steps, self.next_step + count)
        start = time.perf_counter()
        while self.next_step < stop:
            self._step(self.next_step)
            self.next_step += 1
        if handover and not self.done:
            t0 = time.perf_counter()
            if self.is_engine:
                self.opt.synchronize()  # the host worker idle: the next run's turn has the host cores to itself
            _sync(self.device)
            self.handover_ms.append((time.perf_counter() - t0) * 1e3)
            self.rec["handover_ms"][-1] += self.handover_ms[-1]  # (charged to the turn's last step)
        self.train_s += time.perf_counter() - start
        self._rng = _random_state(self.device)

    def _step(self, index: int) -> None:
        cfg, device, opt, rec = self.cfg, self.device, self.opt, self.rec
        b = self.task.train_batches[index].to(device)
        clock = StepClock(device)
        clock.mark()
        loss = self.model(**b.inputs).loss
        loss.backward()
        loss_value = loss.detach().item()  # the scalar read waits for the backward on the device
        _sync(device)
        clock.mark()
        if cfg.max_grad_norm and cfg.max_grad_norm > 0:
            if self.is_engine:
                opt.clip_grad_norm_(cfg.max_grad_norm)
            else:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
        _sync(device)
        clock.mark()
        opt.step()
        _sync(device)
        clock.mark()
        if self.meter is not None:
            self.meter.finish_step()  # (before zero_grad: the step's gradients and its state)
        self.sched.step()
        opt.zero_grad(set_to_none=True)
        clock.mark()
        fb_ms, clip_ms, opt_ms, other_ms = clock.durations_ms()
        for key, value in (("loss", loss_value), ("fb_ms", fb_ms), ("clip_ms", clip_ms), ("opt_ms", opt_ms),
                           ("other_ms", other_ms), ("step_ms", fb_ms + clip_ms + opt_ms + other_ms),
                           ("handover_ms", 0.0)):
            rec[key].append(value)
        if self.is_engine:
            self.last_stats = dict(opt.stats())
        stats = self.last_stats
        # the device waits only inside an engine's step (host AdamW inline, the wait for the worker, the copies)
        self.waits.append(min(opt_ms, wait_ms(stats)) if self.is_engine else 0.0)
        self.timeline.record_step(index, clock.times[0], clock.times[-1], opt)
        if self.is_engine:
            rec["engine_critical_ms"].append(float(stats.get("critical_path_ms") or 0.0))
            rec["host_step_ms"].append(float(stats.get("host_step_ms") or 0.0))
            rec["accumulate_ms"].append(float(stats.get("accumulate_ms") or 0.0))
            rec["bytes_to_host"].append(float(stats.get("bytes_to_host") or 0))
            rec["bytes_to_device"].append(float(stats.get("bytes_to_device") or 0))
            rec["staleness"].append(float(stats.get("staleness") or 0))
            rec["selected_fraction"].append(float(stats.get("selected_fraction") or 0.0))
            for phase in ENGINE_PHASES:
                rec.setdefault(f"cp_{phase}_ms", []).append(float(stats.get(f"cp_{phase}_ms") or 0.0))
        self.rss_peak = max(self.rss_peak, _rss())
        if self.bar is not None:
            window = cfg.log_every
            self.bar.set_postfix_str(f"last {window}: loss {statistics.fmean(rec['loss'][-window:]):.3f} (mean), "
                                     f"opt.step {statistics.median(rec['opt_ms'][-window:]):.1f} ms (median)",
                                     refresh=False)
            self.bar.update(1)

    def finish(self) -> dict[str, Any]:
        """After the last step: apply pending host work, evaluate on the held-out set, release the optimizer; the
        run's measured figures."""
        name, task, cfg, device, opt, rec = self.name, self.task, self.cfg, self.device, self.opt, self.rec
        is_engine, steps, split, last_stats = self.is_engine, self.steps, self.split, self.last_stats
        self.timeline.collect_host(opt)
        training_threads = torch.get_num_threads()  # while the engine's worker still runs: what forward/backward had
        flush_ms = 0.0
        if is_engine:
            t0 = time.perf_counter()
            if hasattr(opt, "flush"):
                opt.flush()  # ZenFlow: apply pending host work before the weights are evaluated
            else:
                opt.synchronize()
            flush_ms = (time.perf_counter() - t0) * 1e3
            last_stats = dict(opt.stats())
            self.rss_peak = max(self.rss_peak, _rss())
        ev = evaluate(self.model, task, device)
        memory = self.meter.as_dict() if self.meter is not None else last_stats
        if self.meter is not None:
            self.meter.remove()
        if is_engine:
            device_state = int(last_stats.get("device_state_bytes") or 0)
            host_state = int(last_stats.get("host_state_bytes") or 0)
        else:
            device_state, host_state = torch_adamw_state_bytes(opt), 0
        timed = slice(min(TIMING_SKIP, max(0, steps - 1)), None)
        tail = max(1, steps // 10)
        train_s = self.train_s
        host_ms = [v for v in rec["host_step_ms"][timed] if v > 0]
        opt_p10, opt_p90 = _p10_p90(rec["opt_ms"][timed])
        link_bytes = sum(_mean(rec[k][timed]) or 0.0 for k in ("bytes_to_host", "bytes_to_device"))
        result: dict[str, Any] = {
            "optimizer": name,
            "label": LABELS[name],
            "steps": steps,
            **ev,
            "train_loss": statistics.fmean(rec["loss"][-tail:]),
            "train_seconds": train_s,
            "steps_per_s": steps / train_s,
            "step_ms": 1e3 * train_s / steps,  # whole run: wall time of the training loop per step (its own turns)
            # the waits for this run's own host work at the end of its turns (interleaved runs; counted in step_ms)
            "handover_ms_total": sum(self.handover_ms),
            "turns": len(self.handover_ms) + 1,
            "opt_step_ms_mean": _mean(rec["opt_ms"][timed]),
            "opt_step_ms_median": _median(rec["opt_ms"][timed]),
            "opt_step_ms_p10": opt_p10,
            "opt_step_ms_p90": opt_p90,
            "opt_step_ms_first": rec["opt_ms"][:TIMING_SKIP],
            "clip_ms_mean": _mean(rec["clip_ms"][timed]),
            "forward_backward_ms_mean": _mean(rec["fb_ms"][timed]),
            "other_ms_mean": _mean(rec["other_ms"][timed]),
            "step_ms_mean": _mean(rec["step_ms"][timed]),
            "engine_critical_path_ms_mean": _mean(rec["engine_critical_ms"][timed]) if is_engine else None,
            # host_step_ms is the engine's report of its last host step, repeated until the next one: the mean over
            # the distinct nonzero reports is the cost of one host step, not a per-training-step figure.
            "host_step_ms_mean": _mean(host_ms) if is_engine else None,
            # the same for ZenFlow's host accumulation jobs (one per step outside the window's last)
            "accumulate_ms_mean": _mean([v for v in rec["accumulate_ms"][timed] if v > 0]) if is_engine else None,
            "bytes_to_host_per_step": _mean(rec["bytes_to_host"][timed]) if is_engine else 0.0,
            "bytes_to_device_per_step": _mean(rec["bytes_to_device"][timed]) if is_engine else 0.0,
            # both directions of the link, and the host state per offloaded parameter
            "link_bytes_per_step": link_bytes if is_engine else 0.0,
            # the same over the model's weight bytes
            "link_bytes_per_step_x_model": link_bytes / self.weight_bytes if is_engine else 0.0,
            "host_bytes_per_param": last_stats.get("host_bytes_per_param") if is_engine else None,
            "flush_ms": flush_ms,
            # the device's busy share of the timed steps' wall time (`compare.timeline`)
            "device_utilization": device_utilization(rec["step_ms"][timed], self.waits[timed]),
            "device_wait_ms_mean": _mean(self.waits[timed]),
            "cores": {**split.to_dict(), "training_threads": training_threads,
                      "host_threads": int(last_stats.get("host_threads") or split.host) if is_engine else None},
            "timeline": self.timeline.to_dict(),
            # (not separable when the runs take turns on one GPU: every run's memory is allocated at once)
            # (each run's meter resets the allocator's peak at the end of each step and keeps the run's)
            "peak_device_memory_bytes": max(torch.cuda.max_memory_allocated(device),
                                            memory.get("peak_device_bytes") or 0)
            if device.type == "cuda" and not self.interleaved else None,
            # weights + gradients held + optimizer device state at the step's peak (`engine/device_memory.py`; CUDA:
            # max_memory_allocated, shared between runs that take turns), and per parameter
            "peak_device_bytes": memory.get("peak_device_bytes"),
            "peak_device_bytes_per_param": memory.get("peak_device_bytes_per_param"),
            # the last step's peak: an ordinary step (the run's peak may be its first step or a re-selection)
            "step_peak_device_bytes": memory.get("step_peak_device_bytes"),
            "offloaded_params_fraction": last_stats.get("offloaded_params_fraction") if name == "zenflow" else None,
            "device_memory_limit_bytes": device_memory_limit(cfg, self.model) if name == "zenflow" else None,
            "host_rss_peak_bytes": self.rss_peak,
            "host_rss_start_bytes": self.rss_start,
            "optimizer_state_device_bytes": device_state,
            "optimizer_state_host_bytes": host_state,
            "engine_stats": {k: v for k, v in last_stats.items()
                             if isinstance(v, (int, float, str, bool)) or v is None},
            # the engine's own split of its critical path (mean ms per step over the timed steps)
            "engine_phases_ms_mean": {p: _mean(rec[f"cp_{p}_ms"][timed]) for p in ENGINE_PHASES
                                      if f"cp_{p}_ms" in rec} if is_engine else {},
            # per step; step_ms + handover_ms (the wait at the end of a turn, on the turn's last step) is the step's
            # share of the whole run's time, which the verdict's interval is taken over
            "curves": {k: rec[k] for k in ("loss", "fb_ms", "clip_ms", "opt_ms", "other_ms", "step_ms", "handover_ms",
                                           "engine_critical_ms", "bytes_to_host", "bytes_to_device", "staleness")},
        }
        if cfg.save_model and name == "zenflow":
            result["_model"] = self.model  # kept for saving next to the card; dropped before results.json is written
        if hasattr(opt, "close"):
            opt.close()
        self.opt = self.model = self.sched = None  # type: ignore[assignment]  # the memory goes back before the next
        return result


def _random_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The global random streams a step draws from (dropout): the CPU generator, and the device's on CUDA."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_random_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
