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
selection) are left out of the per-step means and reported separately.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import math
import platform
import statistics
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hf_zenflow.compare.data import PreparedTask, prepare_task
from hf_zenflow.config import ZenFlowConfig
from hf_zenflow.layout import column_major_


OPTIMIZERS = ("adamw_torch", "sync_offload", "zenflow")
LABELS = {
    "adamw_torch": "adamw_torch (no offload)",
    "sync_offload": "SyncOffloadAdamW",
    "zenflow": "ZenFlowAdamW",
}
COLORS = {"adamw_torch": "#4c72b0", "sync_offload": "#dd8452", "zenflow": "#55a868"}

#: Phases of the engines' step() as their telemetry names them (`hf_zenflow.telemetry.PHASES`).
ENGINE_PHASES = ("norms", "select", "device_update", "handoff", "wait", "writeback", "host_update")

#: Steps left out of the timing means: the first step allocates optimizer state and makes the first selection.
TIMING_SKIP = 2

MIB = 1024 * 1024

#: ZenFlow's re-selection period (steps) when `compare` is given ``--select-strategy step`` without an interval.
COMPARE_SELECT_STEPS = 10

_LIBRARY = ZenFlowConfig()


@dataclass
class CompareConfig:
    """Settings of one `hf-zenflow compare` run (the CLI flags map 1:1 onto these fields).

    The defaults are sized for a 2-core CPU: 150 steps of 16 sentences (one pass over 2400), evaluated on 1000
    held-out sentences. The ZenFlow settings default to the library's (`ZenFlowConfig()`), so the table shows what a
    user gets; the settings sweeps that chose those defaults are in BENCHMARKS.md §4 (paired runs over seeds; the
    earlier single-seed sweeps of this runner are in §2c/§2d). ``select_interval=None`` resolves to
    `COMPARE_SELECT_STEPS` with ``select_strategy="step"`` and to ``"auto"`` otherwise.
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
    output_dir: str = "zenflow_compare"
    log_every: int = 10
    save_model: bool = False
    quiet: bool = False

    def __post_init__(self) -> None:
        if self.select_interval is None:
            self.select_interval = COMPARE_SELECT_STEPS if self.select_strategy == "step" else "auto"

    def resolved_layout(self) -> str:
        """On a CPU device the offloading engines get column-major Linear weights (DeepSpeed's transposed layout:
        each input column contiguous, see `hf_zenflow.layout`); on CUDA the gather/scatter is cheap either way."""
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


def _log(cfg: CompareConfig, msg: str) -> None:
    if not cfg.quiet:
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


def train_one(name: str, task: PreparedTask, cfg: CompareConfig, device: torch.device) -> dict[str, Any]:
    """Fine-tune a fresh copy of the model with optimizer `name`; return its measured figures."""
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
    for t, batch in enumerate(task.train_batches):
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
        if cfg.log_every and ((t + 1) % cfg.log_every == 0 or t + 1 == steps):
            window = rec["loss"][-cfg.log_every:]
            elapsed = time.perf_counter() - start
            _log(cfg, f"{name:>12s} step {t + 1:4d}/{steps}  loss {statistics.fmean(window):.4f}  "
                      f"opt.step {statistics.fmean(rec['opt_ms'][-cfg.log_every:]):7.2f} ms  "
                      f"{(t + 1) / elapsed:5.2f} steps/s")
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
    result: dict[str, Any] = {
        "optimizer": name,
        "label": LABELS[name],
        "steps": steps,
        **ev,
        "train_loss": statistics.fmean(rec["loss"][-tail:]),
        "train_seconds": train_s,
        "steps_per_s": steps / train_s,
        "opt_step_ms_mean": _mean(rec["opt_ms"][timed]),
        "opt_step_ms_median": _median(rec["opt_ms"][timed]),
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


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """ZenFlow relative to each baseline that ran (x < 1 means ZenFlow needs less)."""
    out: dict[str, dict[str, float | None]] = {}
    z = results.get("zenflow")
    if z is None:
        return out
    for base in ("adamw_torch", "sync_offload"):
        r = results.get(base)
        if r is None:
            continue
        out[f"zenflow_vs_{base}"] = {
            "eval_accuracy_delta_points": 100 * (z["eval_accuracy"] - r["eval_accuracy"]),
            "eval_loss_ratio": _ratio(z["eval_loss"], r["eval_loss"]),
            "steps_per_s_ratio": _ratio(z["steps_per_s"], r["steps_per_s"]),
            "opt_step_ms_ratio": _ratio(z["opt_step_ms_mean"], r["opt_step_ms_mean"]),
            "opt_step_ms_median_ratio": _ratio(z["opt_step_ms_median"], r["opt_step_ms_median"]),
            "bytes_to_host_ratio": _ratio(z["bytes_to_host_per_step"], r["bytes_to_host_per_step"]),
            "bytes_to_device_ratio": _ratio(z["bytes_to_device_per_step"], r["bytes_to_device_per_step"]),
            "optimizer_state_device_ratio": _ratio(z["optimizer_state_device_bytes"],
                                                   r["optimizer_state_device_bytes"]),
        }
    return out


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / MIB:.1f}"


def results_table(results: dict[str, dict[str, Any]], device: torch.device, metric_name: str) -> str:
    """The markdown table printed at the end and written to results.md."""
    dev_mem_note = "" if device.type == "cuda" else " (device = CPU: n/a)"
    head = (f"| optimizer | held-out {metric_name} | held-out loss | train loss | steps/s | optimizer.step ms/step "
            "(median) | engine critical path ms | host step ms (per host step) | MiB to host/step | "
            f"MiB to device/step | peak device mem MiB{dev_mem_note} | host RSS peak MiB | opt. state on device MiB | "
            "opt. state on host MiB |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in results.values():
        lines.append(
            f"| {r['label']} | {r['eval_accuracy']:.4f} | {r['eval_loss']:.4f} | {r['train_loss']:.4f} | "
            f"{r['steps_per_s']:.2f} | {_fmt(r['opt_step_ms_mean'])} ({_fmt(r['opt_step_ms_median'])}) | "
            f"{_fmt(r['engine_critical_path_ms_mean'])} | {_fmt(r['host_step_ms_mean'])} | "
            f"{_mib(r['bytes_to_host_per_step'])} | {_mib(r['bytes_to_device_per_step'])} | "
            f"{_mib(r['peak_device_memory_bytes'])} | {_mib(r['host_rss_peak_bytes'])} | "
            f"{_mib(r['optimizer_state_device_bytes'])} | {_mib(r['optimizer_state_host_bytes'])} |"
        )
    return "\n".join(lines)


def ratio_table(rat: dict[str, dict[str, float | None]]) -> str:
    if not rat:
        return ""
    rows = [("held-out accuracy, difference in points", "eval_accuracy_delta_points", "{:+.2f}"),
            ("held-out loss ratio", "eval_loss_ratio", "{:.3f}x"),
            ("steps/s ratio (>1 = ZenFlow faster)", "steps_per_s_ratio", "{:.2f}x"),
            ("optimizer.step ms ratio, mean (<1 = ZenFlow shorter)", "opt_step_ms_ratio", "{:.3f}x"),
            ("optimizer.step ms ratio, median", "opt_step_ms_median_ratio", "{:.3f}x"),
            ("bytes to host per step ratio", "bytes_to_host_ratio", "{:.3f}x"),
            ("bytes to device per step ratio", "bytes_to_device_ratio", "{:.3f}x"),
            ("optimizer state on device ratio", "optimizer_state_device_ratio", "{:.3f}x")]
    cols = list(rat)
    lines = ["| ZenFlow vs | " + " | ".join(c.replace("zenflow_vs_", "") for c in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for label, key, fmt in rows:
        cells = []
        for c in cols:
            v = rat[c].get(key)
            cells.append("n/a" if v is None else fmt.format(v))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_loss_curves(results: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, r in results.items():
        loss = r["curves"]["loss"]
        ema, smooth = None, []
        for v in loss:  # exponential moving average: the raw per-batch loss is too noisy to compare by eye
            ema = v if ema is None else 0.9 * ema + 0.1 * v
            smooth.append(ema)
        steps = range(1, len(loss) + 1)
        ax.plot(steps, loss, color=COLORS[name], alpha=0.2, linewidth=0.8)
        # SyncOffloadAdamW runs the same AdamW arithmetic as adamw_torch, so their curves coincide: dash one.
        ax.plot(steps, smooth, color=COLORS[name], linewidth=2, linestyle="--" if name == "sync_offload" else "-",
                label=f"{r['label']} (train, EMA 0.9)")
        ax.scatter([len(loss)], [r["eval_loss"]], color=COLORS[name], marker="*", s=120, zorder=5,
                   edgecolors="black", label=f"{r['label']} held-out loss {r['eval_loss']:.3f}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(textwrap.fill(title, 90), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_time_breakdown(results: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(16, 4.8), gridspec_kw={"width_ratios": [1, 1, 1.4]})
    names = list(results)
    parts = [("forward_backward_ms_mean", "forward + backward", "#8c8c8c"),
             ("clip_ms_mean", "grad-norm clip", "#c44e52"),
             ("opt_step_ms_mean", "optimizer.step (critical path)", "#8172b3"),
             ("other_ms_mean", "scheduler + zero_grad", "#ccb974")]
    bottom = [0.0] * len(names)
    for key, label, color in parts:
        vals = [results[n][key] or 0.0 for n in names]
        left.bar([LABELS[n] for n in names], vals, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, total in enumerate(bottom):
        left.text(i, total, f"{total:.0f} ms", ha="center", va="bottom", fontsize=8)
    left.set_ylabel(f"mean ms per training step (steps > {TIMING_SKIP})")
    left.set_title("where a training step's time goes")
    left.legend(fontsize=8)
    left.tick_params(axis="x", labelsize=8)
    # The engines time each phase of their step() themselves: what the optimizer's critical path is made of.
    engines = [n for n in names if results[n].get("engine_phases_ms_mean")]
    bottom = [0.0] * len(engines)
    cmap = plt.get_cmap("tab10")
    for j, phase in enumerate(ENGINE_PHASES):
        vals = [results[n]["engine_phases_ms_mean"].get(phase) or 0.0 for n in engines]
        if not any(vals):
            continue
        mid.bar([LABELS[n] for n in engines], vals, bottom=bottom, label=phase, color=cmap(j))
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, total in enumerate(bottom):
        mid.text(i, total, f"{total:.1f} ms", ha="center", va="bottom", fontsize=8)
    mid.set_ylabel("mean ms per step, engine's own phase timers")
    mid.set_title("inside optimizer.step (engine phases)")
    if engines:
        mid.legend(fontsize=8)
    mid.tick_params(axis="x", labelsize=8)
    for name in names:
        opt_ms = results[name]["curves"]["opt_ms"]
        right.plot(range(1, len(opt_ms) + 1), opt_ms, color=COLORS[name], linewidth=1, label=LABELS[name])
    right.set_yscale("log")
    right.set_xlabel("optimizer step")
    right.set_ylabel("optimizer.step ms (log)")
    right.set_title("optimizer critical path, every step")
    right.grid(alpha=0.3, which="both")
    right.legend(fontsize=8)
    fig.suptitle(textwrap.fill(title, 140), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _card_settings(cfg: CompareConfig) -> dict[str, Any]:
    return {"topk_ratio": cfg.topk_ratio, "update_interval": cfg.update_interval, "overlap_step": cfg.overlap_step,
            "host_lr_scale": cfg.host_lr_scale, "min_offload_numel": cfg.min_offload_numel,
            "select_strategy": cfg.select_strategy, "select_interval": cfg.select_interval,
            "full_warm_up_rounds": cfg.full_warm_up_rounds, "cpu_threads": cfg.cpu_threads or "engine default"}


def write_model_card(path: Path, task: PreparedTask, cfg: CompareConfig, zen: dict[str, Any],
                     rat: dict[str, dict[str, float | None]]) -> str:
    """Render the ZenFlow run's card with the project's template; return which renderer was used."""
    measured = {
        "optimizer.step ms per step (mean)": zen["opt_step_ms_mean"],
        "engine critical path ms per step (mean)": zen["engine_critical_path_ms_mean"],
        "host step ms (per host step)": zen["host_step_ms_mean"],
        "bytes to host per step": zen["bytes_to_host_per_step"],
        "bytes to device per step": zen["bytes_to_device_per_step"],
        "optimizer state on device (bytes)": zen["optimizer_state_device_bytes"],
        "optimizer state on host (bytes)": zen["optimizer_state_host_bytes"],
        "steps/s": zen["steps_per_s"],
    }
    for key, r in rat.items():
        measured[f"optimizer.step time vs {key.replace('zenflow_vs_', '')}"] = r["opt_step_ms_ratio"]
        measured[f"held-out accuracy vs {key.replace('zenflow_vs_', '')} (points)"] = r["eval_accuracy_delta_points"]
    hyper = {"learning_rate": cfg.lr, "train_batch_size": cfg.batch_size, "seed": cfg.seed, "max_steps": cfg.steps,
             "lr_scheduler_type": "linear", "warmup_ratio": cfg.warmup_ratio, "weight_decay": cfg.weight_decay,
             "max_grad_norm": cfg.max_grad_norm, "max_length": cfg.max_length, "training data": task.dataset_name,
             "train / held-out examples": f"{task.train_examples} / {task.eval_examples}",
             "training loop": "hf-zenflow compare (plain PyTorch loop, not the Trainer)"}
    results = {f"held-out {task.metric_name}": zen["eval_accuracy"], "held-out loss": zen["eval_loss"],
               "train loss (last 10% of steps)": zen["train_loss"]}
    try:
        from hf_zenflow.hf import model_card as mc
    except ImportError:
        mc = None
    render = getattr(mc, "render_zenflow_model_card", None) or getattr(mc, "render_model_card", None)
    if render is not None:
        card = render(model_name=f"{task.model_name.split('/')[-1]}-zenflow-compare",
                      zenflow_settings=_card_settings(cfg),
                      zenflow_measured=measured, hyperparameters=hyper, results=results,
                      # The data is described, not a Hub dataset id: the template would turn a name into a link.
                      base_model=task.model_name, dataset_name=None,
                      tags=["hf-zenflow-compare", task.task])
        path.write_text(str(card), encoding="utf-8")
        return f"hf_zenflow.hf.model_card.{render.__name__}"
    # Fallback: a minimal card, used only when the template module is not importable.
    lines = [f"# {task.model_name} fine-tuned with ZenFlow", "", (f"Base model: `{task.model_name}`; data: "
             f"{task.dataset_name}."), "", "## ZenFlow", ""]
    lines += [f"- {k}: {v}" for k, v in _card_settings(cfg).items()]
    lines += ["", "### Measured", ""] + [f"- {k}: {_fmt(v, 4)}" for k, v in measured.items()]
    lines += ["", "## Results", ""] + [f"- {k}: {_fmt(v, 4)}" for k, v in results.items()]
    lines += ["", "## Hyperparameters", ""] + [f"- {k}: {v}" for k, v in hyper.items()]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return "runner fallback (hf_zenflow.hf.model_card not importable)"


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


def run_compare(cfg: CompareConfig) -> dict[str, Any]:
    """Run the comparison; write results.json, results.md, loss_curves.png, time_breakdown.png, model_card.md."""
    unknown = [o for o in cfg.optimizers if o not in OPTIMIZERS]
    if unknown:
        raise ValueError(f"unknown optimizer(s) {unknown}: allowed are {OPTIMIZERS}.")
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = cfg.resolved_device()
    wall = time.perf_counter()
    _log(cfg, f"loading model and data (model={cfg.model or 'minilm'}, device={device}) ...")
    task = prepare_task(model=cfg.model, task=cfg.task, steps=cfg.steps, train_size=cfg.train_size,
                        eval_size=cfg.eval_size, batch_size=cfg.batch_size, max_length=cfg.max_length, seed=cfg.seed,
                        eval_batch_size=cfg.eval_batch_size)
    _log(cfg, f"{task.model_name}: {task.num_parameters / 1e6:.1f}M params; {task.task}; "
              f"{task.train_examples} train / {task.eval_examples} held-out examples; {cfg.steps} steps x "
              f"batch {cfg.batch_size}; load {time.perf_counter() - wall:.1f} s")
    results: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(cfg.optimizers):
        _log(cfg, f"[{i + 1}/{len(cfg.optimizers)}] training with {LABELS[name]} ...")
        gc.collect()
        r = train_one(name, task, cfg, device)
        results[name] = r
        _log(cfg, f"{name}: held-out {task.metric_name} {r['eval_accuracy']:.4f}, loss {r['eval_loss']:.4f}, "
                  f"{r['steps_per_s']:.2f} steps/s, optimizer.step {r['opt_step_ms_mean']:.2f} ms/step")
        gc.collect()
    rat = ratios(results)
    table = results_table(results, device, task.metric_name)
    rtable = ratio_table(rat)
    title = (f"{task.model_name} on {task.dataset_name.split(' (')[0]}: {cfg.steps} steps x batch {cfg.batch_size}, "
             f"seed {cfg.seed}")
    plot_loss_curves(results, out_dir / "loss_curves.png", title)
    plot_time_breakdown(results, out_dir / "time_breakdown.png", title)
    card_renderer = None
    if "zenflow" in results:
        card_renderer = write_model_card(out_dir / "model_card.md", task, cfg, results["zenflow"], rat)
        model = results["zenflow"].pop("_model", None)
        if model is not None:
            model_dir = out_dir / "zenflow_model"
            model.save_pretrained(str(model_dir))
            task.tokenizer.save_pretrained(str(model_dir))
            (model_dir / "README.md").write_text((out_dir / "model_card.md").read_text(encoding="utf-8"))
    info = machine_info(device)
    payload = {
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()},
        "task": {"task": task.task, "model": task.model_name, "model_path": task.model_path,
                 "dataset": task.dataset_name, "num_parameters": task.num_parameters,
                 "train_examples": task.train_examples, "eval_examples": task.eval_examples,
                 "metric": task.metric_name, **task.extra},
        "machine": info,
        "timing_skip_steps": TIMING_SKIP,
        "results": results,
        "ratios": rat,
        "model_card_renderer": card_renderer,
        "total_seconds": time.perf_counter() - wall,
    }
    (out_dir / "results.json").write_text(json.dumps(payload, indent=2, default=str), encoding="utf-8")
    md = [f"# hf-zenflow compare: {task.model_name}", "",
          (f"{info['date_utc']} UTC; {info['processor']}, {info['cpu_affinity_cores']} cores; device {device}; "
          f"torch {info['torch']}; {task.num_parameters / 1e6:.1f}M params; {task.dataset_name}; "
          f"{task.train_examples} train / {task.eval_examples} held-out; {cfg.steps} steps x batch {cfg.batch_size}, "
          f"lr {cfg.lr}, seed {cfg.seed}; ZenFlow topk_ratio {cfg.topk_ratio}, update_interval {cfg.update_interval}, "
          f"overlap_step {cfg.overlap_step}, select_strategy {cfg.select_strategy}, select_interval "
          f"{cfg.select_interval}, full_warm_up_rounds {cfg.full_warm_up_rounds}; weights of the offloading runs "
          f"{cfg.resolved_layout()}-major; ZenFlow selects embedding {cfg.resolved_embedding_select()}."), "",
          table, "", rtable, "",
          (f"Per-step means leave out the first {TIMING_SKIP} steps. adamw_torch is `torch.optim.AdamW(fused=True)`; "
          "its optimizer state is counted as device state. \"optimizer.step ms\" is measured by the runner around "
          "`optimizer.step()`; the gradient-norm clip is timed separately (time_breakdown.png). Host RSS is the "
          "whole process (the three runs share it), sampled after every step."), "",
          f"Total wall time {payload['total_seconds']:.0f} s."]
    (out_dir / "results.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    _log(cfg, "results:\n" + table + ("\n\n" + rtable if rtable else ""))
    _log(cfg, f"wrote {out_dir}/results.json, results.md, loss_curves.png, time_breakdown.png"
              + (", model_card.md" if card_renderer else "") + f" in {payload['total_seconds']:.0f} s")
    return payload


__all__ = ["OPTIMIZERS", "CompareConfig", "evaluate", "make_optimizer", "run_compare", "train_one"]
