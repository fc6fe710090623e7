"""`hf-zenflow compare`: fine-tune one real model three ways and measure the difference.

The three runs share the seed, the initial weights (deep copies of one loaded model), every batch and the learning-rate
schedule; only the optimizer differs:

* ``adamw_torch``   - ``torch.optim.AdamW(fused=True)`` on the device, no offload (the speed and accuracy reference);
* ``sync_offload``  - `hf_zenflow.SyncOffloadAdamW`, the ZeRO-Offload schedule (all gradients to the host, host AdamW,
  parameters back, the caller waits);
* ``zenflow``       - `hf_zenflow.ZenFlowAdamW`.

Timing: the runner measures each phase of every step with `time.perf_counter`, synchronising the device's current
stream at phase boundaries when the device is CUDA (side-stream copies that ZenFlow overlaps are not waited for, as a
training loop would not wait for them either). "optimizer step ms" is the caller's time inside ``optimizer.step()``,
the critical path the optimizer adds to a training step. The first `TIMING_SKIP` steps (state allocation, first
selection) are left out of the per-step statistics (median, p10-p90, mean) and reported separately.

Output: a new run folder per run (`hf_zenflow.compare.output`), a short headline table on the terminal and the full
table in results.md (`hf_zenflow.compare.report`), the plots (`hf_zenflow.compare.plots`), a busy-machine check
(`hf_zenflow.compare.machine_load`) and, with ``save_model``, the model with its card (`hf_zenflow.compare.card`).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import math
import os
import platform
import shutil
import statistics
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hf_zenflow.compare import report
from hf_zenflow.compare.data import PreparedTask, prepare_task
from hf_zenflow.compare.machine_load import LoadMonitor
from hf_zenflow.compare.output import prepare_output_dir
from hf_zenflow.compare.plots import ENGINE_PHASES, LABELS, plot_loss_curves, plot_time_breakdown
from hf_zenflow.compare.report import OPTIMIZERS
from hf_zenflow.config import ZenFlowConfig
from hf_zenflow.cpu_device.layout import column_major_


#: Steps left out of the timing statistics: the first step allocates optimizer state and makes the first selection.
TIMING_SKIP = 2

#: ZenFlow's re-selection period (steps) when `compare` is given ``--select-strategy step`` without an interval.
COMPARE_SELECT_STEPS = 10

_LIBRARY = ZenFlowConfig()


@dataclass
class CompareConfig:
    """Settings of one `hf-zenflow compare` run (the CLI flags map 1:1 onto these fields).

    The defaults are sized for a 2-core CPU: 150 steps of 16 sentences (one pass over 2400), evaluated on 1000
    held-out sentences. The ZenFlow settings default to the library's (`ZenFlowConfig()`), so the table shows what a
    user gets; the settings sweeps that chose those defaults are in BENCHMARKS.md §4 (paired runs over seeds; the
    earlier single-seed sweeps of this runner are in its history, see the §2 history line). ``select_interval=None``
    resolves to `COMPARE_SELECT_STEPS` with ``select_strategy="step"`` and to ``"auto"`` otherwise.
    """

    model: str | None = None  # "minilm" (default), "smollm2", or a local HF model folder
    task: str = "auto"
    steps: int = 150
    train_size: int = 2400
    eval_size: int = 1000
    batch_size: int = 16
    eval_batch_size: int = 64
    max_length: int = 64
    lr: float = 2e-4
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1
    max_grad_norm: float = 1.0
    seed: int = 0
    # ZenFlow settings: the library's defaults (`ZenFlowConfig`), so that compare shows what a user gets
    topk_ratio: float = _LIBRARY.topk_ratio
    update_interval: int | str = _LIBRARY.update_interval
    overlap_step: bool = _LIBRARY.overlap_step
    host_lr_scale: float | str = _LIBRARY.host_lr_scale
    min_offload_numel: int = _LIBRARY.min_offload_numel
    select_strategy: str = _LIBRARY.select_strategy
    select_interval: int | str | None = None  # None: COMPARE_SELECT_STEPS with "step", "auto" otherwise
    full_warm_up_rounds: int = _LIBRARY.full_warm_up_rounds
    cpu_threads: int | None = None  # host-optimizer threads of the offloading engines (None = engine default)
    threads: int | None = None  # torch intra-op threads for forward/backward (None = torch's default)
    device: str = "auto"
    layout: str = "auto"  # weights of the offloading runs: "column" (column_major_), "row"; auto = column on CPU
    embedding_select: str = "auto"  # ZenFlow on embedding tables: "rows" (tokens), "columns"; auto = rows on CPU
    optimizers: tuple[str, ...] = OPTIMIZERS
    output_dir: str | None = None  # None: a new folder zenflow_compare/<UTC time>_<model>/ (see compare.output)
    overwrite: bool = False  # replace the results of an earlier run in output_dir
    log_every: int = 10  # the progress bar's loss and optimizer.step figures cover the last N steps; 0: no bar
    save_model: bool = False
    quiet: bool = False

    def __post_init__(self) -> None:
        if self.select_interval is None:
            self.select_interval = COMPARE_SELECT_STEPS if self.select_strategy == "step" else "auto"

    def resolved_layout(self) -> str:
        """On a CPU device the offloading engines get column-major Linear weights (DeepSpeed's transposed layout:
        each input column contiguous, see `hf_zenflow.cpu_device.layout`); on CUDA the gather/scatter is cheap
        either way."""
        if self.layout not in ("auto", "column", "row"):
            raise ValueError(f"CompareConfig.layout={self.layout!r} is invalid: allowed are 'auto', 'column', 'row'.")
        if self.layout == "auto":
            return "column" if self.resolved_device().type == "cpu" else "row"
        return self.layout

    def resolved_embedding_select(self) -> str:
        """What ZenFlow selects in embedding tables: their rows (the tokens: an embedding's input channels,
        contiguous) or, like any matrix, their columns (hidden features, strided in a row-major table). Rows on a
        CPU device, where strided columns sweep the whole table."""
        if self.embedding_select not in ("auto", "rows", "columns"):
            raise ValueError(f"CompareConfig.embedding_select={self.embedding_select!r} is invalid: allowed are "
                             "'auto', 'rows', 'columns'.")
        if self.embedding_select == "auto":
            return "rows" if self.resolved_device().type == "cpu" else "columns"
        return self.embedding_select

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def _log(cfg: CompareConfig, msg: str, bar: Any = None) -> None:
    """A `[compare]` line; above the progress bar while one is drawn."""
    if cfg.quiet:
        return
    if bar is not None:
        bar.write(f"[compare] {msg}")
    else:
        print(f"[compare] {msg}", flush=True)


def _engine() -> Any:
    """The hf_zenflow engine module (imported lazily: this file must import even while the engine is absent)."""
    import hf_zenflow

    return hf_zenflow


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
    engine = _engine()
    if name == "sync_offload":
        return engine.SyncOffloadAdamW(groups, cpu_threads=cfg.cpu_threads, **common)
    if name == "zenflow":
        zcfg = engine.ZenFlowConfig(
            topk_ratio=cfg.topk_ratio, update_interval=cfg.update_interval, overlap_step=cfg.overlap_step,
            select_strategy=cfg.select_strategy, select_interval=cfg.select_interval,
            full_warm_up_rounds=cfg.full_warm_up_rounds, cpu_threads=cfg.cpu_threads,
            steps_per_epoch=_steps_per_epoch(cfg), host_lr_scale=cfg.host_lr_scale,
            min_offload_numel=cfg.min_offload_numel,
        )
        if cfg.resolved_embedding_select() == "rows":
            tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
            rows = [p for p in groups[0]["params"] if id(p) in tables]
            groups[0]["params"] = [p for p in groups[0]["params"] if id(p) not in tables]
            groups.append({"params": rows, "weight_decay": cfg.weight_decay, "select_rows": True})
        return engine.ZenFlowAdamW(groups, config=zcfg, **common)
    raise ValueError(f"optimizer {name!r} is unknown: allowed are {OPTIMIZERS}.")


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


def progress_bar(cfg: CompareConfig, total: int) -> Any:
    """One bar over every step of every run, with ETA (tqdm, as the Trainer uses); None with --quiet or
    --log-every 0. Redrawn at most every 0.5 s on a terminal, every 30 s into a log file."""
    if cfg.quiet or not cfg.log_every:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="step", file=sys.stderr, mininterval=0.5 if sys.stderr.isatty() else 30.0,
                **_bar_width())


def _bar_width() -> dict[str, Any]:
    """Follow the terminal's size when it has one. A pseudo-terminal without a size (`script`, some CI runners)
    reports 0 x 0, and tqdm then draws nothing at all: give it $COLUMNS (or 120) x 24 there, as for a pipe."""
    try:
        size = os.get_terminal_size(sys.stderr.fileno())
        if size.columns > 0 and size.lines > 0:
            return {"dynamic_ncols": True}
    except (OSError, ValueError):  # not a terminal
        pass
    return {"ncols": shutil.get_terminal_size((120, 24)).columns, "nrows": 24}


@torch.no_grad()
def evaluate(model: torch.nn.Module, task: PreparedTask, device: torch.device) -> dict[str, float]:
    """Held-out loss (mean per label / per predicted token) and accuracy."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for batch in task.eval_batches:
        b = batch.to(device)
        out = model(**b.inputs)
        labels = b.inputs["labels"]
        if task.task == "causal-lm":
            pred = out.logits[:, :-1].argmax(-1)
            correct += int((pred == labels[:, 1:]).sum())
        else:
            correct += int((out.logits.argmax(-1) == labels).sum())
        loss_sum += float(out.loss) * b.n_items
        count += b.n_items
    model.train()
    return {"eval_loss": loss_sum / max(1, count), "eval_accuracy": correct / max(1, count)}


def train_one(name: str, task: PreparedTask, cfg: CompareConfig, device: torch.device,
              bar: Any = None) -> dict[str, Any]:
    """Fine-tune a fresh copy of the model with optimizer `name`; return its measured figures. `bar` (a tqdm bar
    or None) advances one step per optimizer step."""
    from transformers import get_linear_schedule_with_warmup

    torch.manual_seed(cfg.seed)  # dropout masks identical across the three runs
    model = copy.deepcopy(task.base_model).to(device)
    if name != "adamw_torch" and cfg.resolved_layout() == "column":
        # the no-offload reference keeps row-major weights: torch's fused AdamW runs ~4x slower on strided tensors
        column_major_(model)
    model.train()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rss_start = _rss()
    opt = make_optimizer(name, model, cfg)
    is_engine = name != "adamw_torch"
    steps = len(task.train_batches)
    sched = get_linear_schedule_with_warmup(opt, int(cfg.warmup_ratio * steps), steps)
    rec: dict[str, list[float]] = {k: [] for k in ("loss", "fb_ms", "clip_ms", "opt_ms", "other_ms", "step_ms",
                                                   "engine_critical_ms", "host_step_ms", "bytes_to_host",
                                                   "bytes_to_device", "staleness", "selected_fraction")}
    rss_peak = rss_start
    last_stats: dict[str, Any] = {}
    start = time.perf_counter()
    for batch in task.train_batches:
        b = batch.to(device)
        t0 = time.perf_counter()
        loss = model(**b.inputs).loss
        loss.backward()
        loss_value = loss.detach().item()  # the scalar read waits for the backward on the device
        _sync(device)
        t1 = time.perf_counter()
        if cfg.max_grad_norm and cfg.max_grad_norm > 0:
            if is_engine:
                opt.clip_grad_norm_(cfg.max_grad_norm)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        _sync(device)
        t2 = time.perf_counter()
        opt.step()
        _sync(device)
        t3 = time.perf_counter()
        sched.step()
        opt.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        for key, value in (("loss", loss_value), ("fb_ms", (t1 - t0) * 1e3), ("clip_ms", (t2 - t1) * 1e3),
                           ("opt_ms", (t3 - t2) * 1e3), ("other_ms", (t4 - t3) * 1e3), ("step_ms", (t4 - t0) * 1e3)):
            rec[key].append(value)
        if is_engine:
            last_stats = dict(opt.stats())
            rec["engine_critical_ms"].append(float(last_stats.get("critical_path_ms") or 0.0))
            rec["host_step_ms"].append(float(last_stats.get("host_step_ms") or 0.0))
            rec["bytes_to_host"].append(float(last_stats.get("bytes_to_host") or 0))
            rec["bytes_to_device"].append(float(last_stats.get("bytes_to_device") or 0))
            rec["staleness"].append(float(last_stats.get("staleness") or 0))
            rec["selected_fraction"].append(float(last_stats.get("selected_fraction") or 0.0))
            for phase in ENGINE_PHASES:
                rec.setdefault(f"cp_{phase}_ms", []).append(float(last_stats.get(f"cp_{phase}_ms") or 0.0))
        rss_peak = max(rss_peak, _rss())
        if bar is not None:
            window = cfg.log_every
            bar.set_postfix_str(f"last {window}: loss {statistics.fmean(rec['loss'][-window:]):.3f} (mean), "
                                f"opt.step {statistics.median(rec['opt_ms'][-window:]):.1f} ms (median)",
                                refresh=False)
            bar.update(1)
    train_s = time.perf_counter() - start
    flush_ms = 0.0
    if is_engine:
        t0 = time.perf_counter()
        if hasattr(opt, "flush"):
            opt.flush()  # ZenFlow: apply pending host work before the weights are evaluated
        else:
            opt.synchronize()
        flush_ms = (time.perf_counter() - t0) * 1e3
        last_stats = dict(opt.stats())
        rss_peak = max(rss_peak, _rss())
    ev = evaluate(model, task, device)
    if is_engine:
        device_state = int(last_stats.get("device_state_bytes") or 0)
        host_state = int(last_stats.get("host_state_bytes") or 0)
    else:
        device_state, host_state = torch_adamw_state_bytes(opt), 0
    timed = slice(min(TIMING_SKIP, max(0, steps - 1)), None)
    tail = max(1, steps // 10)
    host_ms = [v for v in rec["host_step_ms"][timed] if v > 0]
    opt_p10, opt_p90 = _p10_p90(rec["opt_ms"][timed])
    result: dict[str, Any] = {
        "optimizer": name,
        "label": LABELS[name],
        "steps": steps,
        **ev,
        "train_loss": statistics.fmean(rec["loss"][-tail:]),
        "train_seconds": train_s,
        "steps_per_s": steps / train_s,
        "step_ms": 1e3 * train_s / steps,  # whole run: wall time of the training loop per step
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
        "bytes_to_host_per_step": _mean(rec["bytes_to_host"][timed]) if is_engine else 0.0,
        "bytes_to_device_per_step": _mean(rec["bytes_to_device"][timed]) if is_engine else 0.0,
        "flush_ms": flush_ms,
        "peak_device_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "host_rss_peak_bytes": rss_peak,
        "host_rss_start_bytes": rss_start,
        "optimizer_state_device_bytes": device_state,
        "optimizer_state_host_bytes": host_state,
        "engine_stats": {k: v for k, v in last_stats.items() if isinstance(v, (int, float, str, bool)) or v is None},
        # the engine's own split of its critical path (mean ms per step over the timed steps)
        "engine_phases_ms_mean": {p: _mean(rec[f"cp_{p}_ms"][timed]) for p in ENGINE_PHASES
                                  if f"cp_{p}_ms" in rec} if is_engine else {},
        "curves": {k: rec[k] for k in ("loss", "fb_ms", "clip_ms", "opt_ms", "other_ms", "engine_critical_ms",
                                       "bytes_to_host", "bytes_to_device", "staleness")},
    }
    if cfg.save_model and name == "zenflow":
        result["_model"] = model  # kept for saving next to the card; dropped before results.json is written
    if hasattr(opt, "close"):
        opt.close()
    del opt
    return result


def machine_info(device: torch.device) -> dict[str, Any]:
    from hf_zenflow.config import available_cpu_count

    info: dict[str, Any] = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_affinity_cores": available_cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    return info


def _device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({device})"
    return f"{device.type} ({torch.get_num_threads()} training threads)"


def _settings_line(task: PreparedTask, cfg: CompareConfig, device: torch.device) -> str:
    return (f"{task.num_parameters / 1e6:.1f}M params; {task.dataset_name}; {task.train_examples} train / "
            f"{task.eval_examples} held-out; {cfg.steps} steps x batch {cfg.batch_size}, lr {cfg.lr}, "
            f"seed {cfg.seed}; "
            f"device {device}; ZenFlow topk_ratio {cfg.topk_ratio}, update_interval {cfg.update_interval}, "
            f"overlap_step {cfg.overlap_step}, select_strategy {cfg.select_strategy}, select_interval "
            f"{cfg.select_interval}, full_warm_up_rounds {cfg.full_warm_up_rounds}; weights of the offloading runs "
            f"{cfg.resolved_layout()}-major; ZenFlow selects embedding {cfg.resolved_embedding_select()}.")


def _machine_line(info: dict[str, Any], load: dict[str, Any]) -> str:
    """The machine and how busy it was over the whole comparison."""
    text = (f"{info['date_utc']} UTC; {info['processor']}, {info['cpu_affinity_cores']} cores; torch {info['torch']}")
    if load.get("others_cores") is not None:
        text += (f"; over the whole comparison other processes used {load['others_cores']:.2f} of the "
                 f"{load['cores']} cores on average, CPU steal {100 * (load.get('steal_fraction') or 0):.1f} %")
    if load.get("loadavg_before") is not None:
        text += (f"; 1-minute load average {load['loadavg_before']:.2f} before the run, max "
                 f"{load['loadavg_max']:.2f} during it (this run's own threads included)")
    return text + "."


def _save_model(out_dir: Path, task: PreparedTask, cfg: CompareConfig, results: dict[str, dict[str, Any]],
                rat: dict[str, dict[str, float | None]], device: torch.device) -> Path | None:
    """With --save-model: the ZenFlow-trained model, its tokenizer and its card (README.md) in
    out_dir/zenflow_model."""
    model = results.get("zenflow", {}).pop("_model", None)
    if model is None:
        return None
    from hf_zenflow.compare.card import render_compare_card

    model_dir = out_dir / "zenflow_model"
    model.save_pretrained(str(model_dir))
    task.tokenizer.save_pretrained(str(model_dir))
    card = render_compare_card(task, cfg, results, rat, _device_description(device))
    (model_dir / "README.md").write_text(card, encoding="utf-8")
    return model_dir


def run_compare(cfg: CompareConfig) -> dict[str, Any]:
    """Run the comparison into a new run folder (`hf_zenflow.compare.output`): results.json, results.md,
    loss_curves.png, time_breakdown.png and, with `save_model`, zenflow_model/ with its card (README.md). Returns
    what results.json holds; ``payload["output_dir"]`` is the folder."""
    unknown = [o for o in cfg.optimizers if o not in OPTIMIZERS]
    if unknown:
        raise ValueError(f"unknown optimizer(s) {unknown}: allowed are {OPTIMIZERS}.")
    out_dir = prepare_output_dir(cfg.output_dir, cfg.model, cfg.overwrite)  # refuses before any work
    monitor = LoadMonitor()
    monitor.start()  # first: its load average before the run counts only other processes
    try:
        return _run(cfg, out_dir, monitor)
    except BaseException:
        if cfg.output_dir is None and not any(out_dir.iterdir()):
            out_dir.rmdir()  # a failed run leaves no empty run folder behind
        raise
    finally:
        monitor.stop()


def _run(cfg: CompareConfig, out_dir: Path, monitor: LoadMonitor) -> dict[str, Any]:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = cfg.resolved_device()
    cuda = device.type == "cuda"
    wall = time.perf_counter()
    _log(cfg, f"loading model and data (model={cfg.model or 'minilm'}, device={device}) ...")
    task = prepare_task(model=cfg.model, task=cfg.task, steps=cfg.steps, train_size=cfg.train_size,
                        eval_size=cfg.eval_size, batch_size=cfg.batch_size, max_length=cfg.max_length, seed=cfg.seed,
                        eval_batch_size=cfg.eval_batch_size)
    _log(cfg, f"{task.model_name}: {task.num_parameters / 1e6:.1f}M params; {task.task}; "
              f"{task.train_examples} train / {task.eval_examples} held-out examples; {cfg.steps} steps x "
              f"batch {cfg.batch_size}; load {time.perf_counter() - wall:.1f} s; writing to {out_dir}/")
    results: dict[str, dict[str, Any]] = {}
    bar = progress_bar(cfg, len(task.train_batches) * len(cfg.optimizers))
    try:
        for i, name in enumerate(cfg.optimizers):
            stage = f"[{i + 1}/{len(cfg.optimizers)}] {LABELS[name]}"
            if bar is not None:
                bar.set_description(f"[{i + 1}/{len(cfg.optimizers)}] {report.SHORT_NAMES[name]}", refresh=False)
                bar.set_postfix_str("", refresh=False)  # the previous run's figures
            else:
                _log(cfg, f"{stage} ...")
            gc.collect()
            since = monitor.reading()
            r = train_one(name, task, cfg, device, bar)
            load = monitor.report(since)
            r["machine_load"] = load.to_dict()
            results[name] = r
            _log(cfg, f"{stage}: held-out {task.metric_name} {r['eval_accuracy']:.4f}, loss {r['eval_loss']:.4f}; "
                      f"{r['steps_per_s']:.2f} steps/s (whole run); optimizer.step "
                      f"{report.format_ms(r['opt_step_ms_median'])} ms median, p10–p90 {report.format_spread(r)}; "
                      f"other processes' CPU {load.short()}", bar)
            gc.collect()
    finally:
        if bar is not None:
            bar.close()
    whole = monitor.whole_run().to_dict()
    rat = report.ratios(results, task.metric_name, cuda)
    headline = report.comparison_table(results, rat, task.metric_name, cuda, headline=True)
    full = report.comparison_table(results, rat, task.metric_name, cuda, headline=False)
    note = report.statistics_note(len(task.train_batches), TIMING_SKIP)
    per_run_load = {n: r["machine_load"] for n, r in results.items()}
    warning = report.busy_warning(whole["busy_reasons"], per_run_load)
    notes = report.disagreement_notes(rat)
    title = (f"{task.model_name} on {task.dataset_name.split(' (')[0]}: {cfg.steps} steps x batch {cfg.batch_size}, "
             f"seed {cfg.seed}")
    plot_loss_curves(results, out_dir / "loss_curves.png", title)
    plot_time_breakdown(results, out_dir / "time_breakdown.png", title, TIMING_SKIP,
                        report.busy_banner(whole, per_run_load))
    model_dir = _save_model(out_dir, task, cfg, results, rat, device)
    info = machine_info(device)
    payload = {
        "output_dir": str(out_dir),
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()},
        "task": {"task": task.task, "model": task.model_name, "model_path": task.model_path,
                 "dataset": task.dataset_name, "num_parameters": task.num_parameters,
                 "train_examples": task.train_examples, "eval_examples": task.eval_examples,
                 "metric": task.metric_name, **task.extra},
        "machine": info,
        "machine_load": whole,
        "warnings": [w for w in (warning, *notes) if w],
        "timing_skip_steps": TIMING_SKIP,
        "results": results,
        "ratios": rat,
        "saved_model": str(model_dir) if model_dir else None,
        "total_seconds": time.perf_counter() - wall,
    }
    (out_dir / "results.json").write_text(json.dumps(payload, indent=2, default=str), encoding="utf-8")
    machine = _machine_line(info, whole)
    md = [f"# hf-zenflow compare: {task.model_name}", "", _settings_line(task, cfg, device), "", f"Machine: {machine}",
          ""]
    md += [f"> **{warning}**", ""] if warning else []
    md += ["## Headline", "", report.TABLE_CAPTION, "", headline, "", note, ""]
    md += [f"- {n}" for n in notes] + ([""] if notes else [])
    md += ["## All figures", "", full, "",
           ("adamw_torch is `torch.optim.AdamW(fused=True)`, its state counted as device state. \"optimizer.step\" "
            "is the time the runner measures around `optimizer.step()` (the optimizer's critical path); the "
            "gradient-norm clip is timed separately. Host RSS is the whole process (the runs share it, one after "
            "the other), sampled after every step. Plots: loss_curves.png, time_breakdown.png."), "",
           f"Total wall time {payload['total_seconds']:.0f} s."]
    (out_dir / "results.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    if not cfg.quiet:
        wrap = lambda text: textwrap.fill(text, 118)
        print("\n" + wrap(report.TABLE_CAPTION) + "\n" + headline + "\n\n" + wrap(note) + "\n\n"
              + wrap(f"Machine: {machine}"), flush=True)
        for text in [*notes, *([warning] if warning else [])]:
            print("\n" + wrap(text), flush=True)
        print(flush=True)
    _log(cfg, f"wrote {out_dir}/: results.md (every figure), results.json, loss_curves.png, time_breakdown.png"
              + (f", {model_dir.name}/ (model + README.md card)" if model_dir else "")
              + f" in {payload['total_seconds']:.0f} s")
    return payload


__all__ = ["OPTIMIZERS", "CompareConfig", "evaluate", "make_optimizer", "run_compare", "train_one"]
