"""`hf-zenflow tune` / `hf_zenflow.tune(...)`: short paired trials that choose ZenFlow's settings before scaling up.

Every trial fine-tunes a fresh copy of the same model from the same initial weights on the same batches (the
`compare` runner's `prepare_task` / `train_one`); only the optimizer differs. `adamw_torch` runs first: it is the
quality reference. Each ZenFlow setting of the grid (`topk_ratio` x `update_interval` x `host_lr_scale`, library
default first) is then scored by

* quality: held-out loss relative to `adamw_torch`'s (``quality_loss_pct = 100 * (loss / reference - 1)``; also the
  held-out accuracy difference in points);
* measured speed on this device: steps/s and the optimizer's critical path (clip + ``optimizer.step()`` ms);
* modelled speed-up over synchronous offload on a hardware profile (`hardware.schedule_model`, for the model size
  you will scale up to), with the window length Zen-auto actually chose in the trial.

The trials run until the budget is spent (a trial is started only when the time measured so far says it fits);
an interrupted run (Ctrl-C) keeps and writes what finished. Outputs: ``tune.json``, ``tune.md`` (table and
recommendation), ``pareto.png`` (quality loss vs speed-up, the Pareto front and the recommended point) and
``recommended.py`` (ready `ZenFlowTrainingArguments(...)`).

One seed per trial: a single trial's difference has the seed-to-seed noise of a short fine-tune (BENCHMARKS.md
§4 measures it); treat differences smaller than that as ties.

Example:
    >>> from hf_zenflow.compare.tune import pareto_front
    >>> pareto_front([(0.0, 1.0), (1.0, 3.0), (2.0, 2.0), (0.5, 1.0)])
    [0, 1]
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_zenflow._extras import require
from hf_zenflow.config import ZenFlowConfig


GRID_TOPK: tuple[float, ...] = (0.05, 0.1, 0.2)
GRID_INTERVAL: tuple[int | str, ...] = (1, 2, 4, 8, "auto")
GRID_SCALE: tuple[float | str, ...] = (1.0, "interval")

#: Two-sided 95 % quantiles of Student's t by degrees of freedom (no scipy dependency).
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
        20: 2.086, 25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}


def t95(df: int) -> float:
    """Two-sided 95 % Student-t quantile (the next tabulated df at or below `df`; 1.96 beyond 120)."""
    if df < 1:
        raise ValueError(f"t95: df={df} is invalid: allowed is an integer >= 1.")
    if df > 120:
        return 1.96
    return _T95[max(k for k in _T95 if k <= df)]


def paired_interval(diffs: Sequence[float]) -> tuple[float, float | None]:
    """Mean of paired differences and the half-width of its t-based 95 % interval (None with one value).

    Example:
        >>> m, h = paired_interval([1.0, 2.0, 3.0])
        >>> round(m, 3), round(h, 3)
        (2.0, 2.484)
    """
    values = [float(d) for d in diffs]
    if not values:
        raise ValueError("paired_interval needs at least one difference.")
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None
    return mean, t95(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


@dataclass(frozen=True)
class TrialSetting:
    """One point of the grid: the three ZenFlow settings a trial varies (the rest are the library defaults)."""

    topk_ratio: float
    update_interval: int | str
    host_lr_scale: float | str

    @property
    def label(self) -> str:
        scale = "xU" if self.host_lr_scale == "interval" else f"x{float(self.host_lr_scale):g}"
        return f"r={self.topk_ratio:g} U={self.update_interval} lr{scale}"

    def config_kwargs(self) -> dict[str, Any]:
        return {"topk_ratio": self.topk_ratio, "update_interval": self.update_interval,
                "host_lr_scale": self.host_lr_scale}

    def config(self, **extra: Any) -> ZenFlowConfig:
        """The full `ZenFlowConfig` of this setting (library defaults elsewhere): validates it."""
        return ZenFlowConfig(**self.config_kwargs(), **extra)

    def training_arguments_code(self) -> str:
        def arg(v: Any) -> str:
            return repr(str(v)) if isinstance(v, str) else repr(v)

        return (f"ZenFlowTrainingArguments(output_dir=..., zenflow_topk_ratio={self.topk_ratio!r}, "
                f"zenflow_update_interval={arg(self.update_interval)}, "
                f"zenflow_host_lr_scale={arg(self.host_lr_scale)})")

    def cli_flags(self) -> str:
        return (f"--zenflow_topk_ratio {self.topk_ratio:g} --zenflow_update_interval {self.update_interval} "
                f"--zenflow_host_lr_scale {self.host_lr_scale}")


def parse_value(text: str) -> Any:
    """A command-line value as `ZenFlowConfig` takes it: bool, int, float, else the string ("auto", "interval").

    Example:
        >>> [parse_value(v) for v in ("262144", "0.5", "False", "auto")]
        [262144, 0.5, False, 'auto']
    """
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_settings(text: str) -> dict[str, Any]:
    """``"KEY=VALUE KEY=VALUE"`` -> a dict of `parse_value` values ("defaults" or "" -> {})."""
    if text.strip() in ("", "defaults"):
        return {}
    return {k: parse_value(v) for k, v in (kv.split("=", 1) for kv in text.split())}


def library_default_setting() -> TrialSetting:
    d = ZenFlowConfig()
    return TrialSetting(d.topk_ratio, d.update_interval, d.host_lr_scale)


def default_grid(topk: Sequence[float] = GRID_TOPK, intervals: Sequence[int | str] = GRID_INTERVAL,
                 scales: Sequence[float | str] = GRID_SCALE) -> list[TrialSetting]:
    """Every combination, in the order a budget trims it: the library default first, then the update_interval x
    host_lr_scale sweep at the default topk_ratio, then the other ratios. ``update_interval=1`` takes one scale only
    (``"interval"`` multiplies by a window of 1)."""
    default = library_default_setting()
    seen: set[TrialSetting] = set()
    out: list[TrialSetting] = []

    def add(s: TrialSetting) -> None:
        if s.update_interval == 1:
            s = dataclasses.replace(s, host_lr_scale=1.0)
        if s not in seen:
            seen.add(s)
            out.append(s)

    if default.topk_ratio in topk and default.update_interval in intervals:
        add(default)
    ratios = sorted(topk, key=lambda r: (abs(r - default.topk_ratio), r))
    for r in ratios:
        for u in intervals:
            for s in scales:
                add(TrialSetting(float(r), u, s if s == "interval" else float(s)))
    return out


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices (ascending) of the points no other point dominates, for (quality loss: lower is better, speed-up:
    higher is better). A point with a NaN coordinate is never on the front. Equal points are all kept."""
    front = []
    for i, (qi, si) in enumerate(points):
        if math.isnan(qi) or math.isnan(si):
            continue
        dominated = any(
            (qj <= qi and sj >= si) and (qj < qi or sj > si)
            for j, (qj, sj) in enumerate(points) if j != i and not (math.isnan(qj) or math.isnan(sj))
        )
        if not dominated:
            front.append(i)
    return front


def recommend(points: Sequence[tuple[float, float]], max_quality_loss: float,
              min_speedup: float = 1.0) -> tuple[int | None, bool]:
    """(index, within tolerance): the fastest point of the Pareto front whose quality loss is at most
    `max_quality_loss`; when none is, the front's point with the least quality loss and False. Points slower than
    `min_speedup` (1.0: synchronous offload's speed) are passed over while a faster front point exists.

    Example:
        >>> recommend([(0.2, 1.5), (0.8, 3.0), (3.0, 4.0)], max_quality_loss=1.0)
        (1, True)
    """
    front = pareto_front(points)
    if not front:
        return None, False
    useful = [i for i in front if points[i][1] >= min_speedup] or front
    within = [i for i in useful if points[i][0] <= max_quality_loss]
    if within:
        return max(within, key=lambda i: points[i][1]), True
    return min(useful, key=lambda i: points[i][0]), False


# ---------------------------------------------------------------------------------------------------------------------
# Running trials
# ---------------------------------------------------------------------------------------------------------------------
def trial_record(name: str, result: dict[str, Any], seconds: float, setting: TrialSetting | None) -> dict[str, Any]:
    """The compact figures of one `train_one` result."""
    stats = result.get("engine_stats") or {}
    windows = stats.get("windows") or 0
    return {
        "optimizer": name,
        "setting": dataclasses.asdict(setting) if setting else None,
        "label": setting.label if setting else name,
        "eval_loss": result["eval_loss"],
        "eval_accuracy": result["eval_accuracy"],
        "train_loss": result["train_loss"],
        "steps_per_s": result["steps_per_s"],
        "critical_path_ms": (result["opt_step_ms_mean"] or 0.0) + (result["clip_ms_mean"] or 0.0),
        "mean_window": (stats.get("steps") or result["steps"]) / windows if windows else None,
        "seconds": seconds,
    }


def run_trial(name: str, task: Any, cfg: Any, device: Any, setting: TrialSetting | None = None,
              **overrides: Any) -> dict[str, Any]:
    """Train one fresh copy (`compare.runner.train_one`) with `setting` applied; return `trial_record`."""
    from hf_zenflow.compare.runner import train_one

    values = {"quiet": True, "log_every": 0, **overrides}
    if setting is not None:
        values.update(setting.config_kwargs())
    run_cfg = dataclasses.replace(cfg, **values)
    gc.collect()
    t0 = time.perf_counter()
    result = train_one(name, task, run_cfg, device)
    record = trial_record(name, result, time.perf_counter() - t0, setting)
    del result
    gc.collect()
    return record


class Progress:
    """One status line: trials done, elapsed, the estimated time left (the mean trial so far times the trials left,
    capped by the budget's end), a bar."""

    def __init__(self, total: int, stream: Any = None, width: int = 24, deadline: float | None = None) -> None:
        self.total, self.done, self.width = total, 0, width
        self.stream = stream if stream is not None else sys.stderr
        self.start = time.perf_counter()
        self.deadline = deadline  # perf_counter time at which the budget ends: the time left never exceeds it
        self.trial_s: list[float] = []

    def update(self, done: int, total: int, note: str, trial_s: float | None = None) -> None:
        self.done, self.total = done, max(total, done)
        if trial_s is not None:
            self.trial_s.append(trial_s)
        elapsed = time.perf_counter() - self.start
        left = statistics.fmean(self.trial_s) * (self.total - self.done) if self.trial_s else math.nan
        if self.deadline is not None and self.done < self.total:
            budget_left = max(0.0, self.deadline - time.perf_counter())
            left = budget_left if math.isnan(left) else min(left, budget_left)
        filled = int(self.width * self.done / max(1, self.total))
        bar = "#" * filled + "-" * (self.width - filled)
        left_txt = "?" if math.isnan(left) else _mmss(left)
        self.stream.write(f"\r[tune] [{bar}] {self.done}/{self.total} trials  elapsed {_mmss(elapsed)}  "
                          f"left ~{left_txt}  {note[:60]:<60s}")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def _mmss(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 60}:{seconds % 60:02d}"


@dataclass
class TuneConfig:
    """Settings of `hf-zenflow tune` (the CLI flags map onto these fields).

    Task defaults are sized so that the built-in MiniLM task runs the reference and about eight settings in ten
    minutes on a 2-core CPU; scale `steps`/`eval_size` up when the budget allows (a longer trial is a better
    predictor of a long run).
    """

    model: str | None = None  # "minilm" (default), "smollm2", or a local HF model folder
    task: str = "auto"
    budget_minutes: float = 20.0
    steps: int = 60
    train_size: int = 960
    eval_size: int = 500
    batch_size: int = 16
    eval_batch_size: int = 64
    max_length: int = 64
    lr: float = 1e-4
    seed: int = 0
    topk: tuple[float, ...] = GRID_TOPK
    intervals: tuple[int | str, ...] = GRID_INTERVAL
    scales: tuple[float | str, ...] = GRID_SCALE
    max_quality_loss_pct: float = 1.0  # tolerance on the held-out loss relative to adamw_torch
    hardware: str = "a100-40gb-pcie4"  # preset name or JSON profile
    target_params: float | None = None  # model size the speed-up is modelled for (None: this model's)
    target_tokens_per_step: float | None = None  # tokens per optimizer step at scale (None: this task's)
    threads: int | None = None
    device: str = "auto"
    output_dir: str = "zenflow_tune"
    progress: bool = True


def _tokens_per_step(task: Any) -> float:
    batches = task.train_batches[: min(8, len(task.train_batches))]
    return statistics.fmean(float(b.inputs["attention_mask"].sum()) for b in batches)


def modelled_speedup(record: dict[str, Any], profile: Any, params: float, tokens: float) -> float:
    """ZenFlow's modelled speed-up over synchronous offload on `profile` at this trial's (mean) window length."""
    from hf_zenflow.compare.hardware import schedule_model

    s = record["setting"]
    u = record.get("mean_window") or (s["update_interval"] if s["update_interval"] != "auto" else 4)
    rows = schedule_model(profile, params, tokens, s["topk_ratio"], float(u))
    return rows["sync_offload"]["step_ms"] / rows["zenflow"]["step_ms"]


def score(records: list[dict[str, Any]], profile: Any, params: float, tokens: float) -> list[dict[str, Any]]:
    """Add quality_loss_pct, accuracy_delta_points and modelled_speedup to the ZenFlow records."""
    ref = next(r for r in records if r["optimizer"] == "adamw_torch")
    out = []
    for r in records:
        if r["optimizer"] != "zenflow":
            continue
        row = dict(r)
        row["quality_loss_pct"] = 100.0 * (r["eval_loss"] / ref["eval_loss"] - 1.0)
        row["accuracy_delta_points"] = 100.0 * (r["eval_accuracy"] - ref["eval_accuracy"])
        row["modelled_speedup"] = modelled_speedup(r, profile, params, tokens)
        out.append(row)
    return out


def run_tune(cfg: TuneConfig, on_trial: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the reference and as many grid settings as the budget allows; write and return the results."""
    import torch

    from hf_zenflow.compare.data import prepare_task
    from hf_zenflow.compare.hardware import load_profile
    from hf_zenflow.compare.runner import CompareConfig

    profile = load_profile(cfg.hardware)
    grid = default_grid(cfg.topk, cfg.intervals, cfg.scales)
    for s in grid:
        s.config()  # a bad grid value fails here, naming the field
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    wall = time.perf_counter()
    deadline = wall + cfg.budget_minutes * 60.0
    base = CompareConfig(model=cfg.model, task=cfg.task, steps=cfg.steps, train_size=cfg.train_size,
                         eval_size=cfg.eval_size, batch_size=cfg.batch_size, eval_batch_size=cfg.eval_batch_size,
                         max_length=cfg.max_length, lr=cfg.lr, seed=cfg.seed, device=cfg.device, quiet=True,
                         log_every=0)
    device = base.resolved_device()
    task = prepare_task(model=cfg.model, task=cfg.task, steps=cfg.steps, train_size=cfg.train_size,
                        eval_size=cfg.eval_size, batch_size=cfg.batch_size, max_length=cfg.max_length, seed=cfg.seed,
                        eval_batch_size=cfg.eval_batch_size)
    params = cfg.target_params or float(task.num_parameters)
    tokens = cfg.target_tokens_per_step or _tokens_per_step(task)
    records: list[dict[str, Any]] = []
    progress = Progress(len(grid) + 1, deadline=deadline) if cfg.progress else None
    interrupted, skipped = False, []
    try:
        if progress:
            progress.update(0, len(grid) + 1, "adamw_torch (reference)")
        ref = run_trial("adamw_torch", task, base, device)
        records.append(ref)
        if on_trial:
            on_trial(ref)
        per_trial = ref["seconds"] * 1.15  # ZenFlow's trials add the host work to the same forward/backward
        for i, setting in enumerate(grid):
            if time.perf_counter() + per_trial > deadline:
                skipped = grid[i:]
                break
            if progress:
                progress.update(len(records), len(grid) + 1, setting.label, trial_s=records[-1]["seconds"])
            rec = run_trial("zenflow", task, base, device, setting)
            records.append(rec)
            if on_trial:
                on_trial(rec)
            per_trial = statistics.fmean(r["seconds"] for r in records[1:])
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if progress:
            progress.update(len(records), len(records) + len(skipped), "done" if not interrupted else "interrupted")
            progress.close()
    payload = summarize(cfg, task, records, profile, params, tokens, skipped, interrupted,
                        time.perf_counter() - wall, device)
    # the reference trial always runs: on a slow or busy machine it alone can overrun the budget
    payload["over_budget_s"] = max(0.0, payload["seconds"] - cfg.budget_minutes * 60.0)
    write_outputs(payload, out_dir)
    return payload


def summarize(cfg: TuneConfig, task: Any, records: list[dict[str, Any]], profile: Any, params: float, tokens: float,
              skipped: list[TrialSetting], interrupted: bool, seconds: float, device: Any) -> dict[str, Any]:
    from hf_zenflow.compare.runner import machine_info

    rows = score(records, profile, params, tokens) if records else []
    points = [(r["quality_loss_pct"], r["modelled_speedup"]) for r in rows]
    front = pareto_front(points)
    best, within = recommend(points, cfg.max_quality_loss_pct)
    for i, r in enumerate(rows):
        r["pareto"] = i in front
        r["recommended"] = i == best
    rec = None
    if best is not None:
        s = TrialSetting(**rows[best]["setting"])
        rec = {"setting": dataclasses.asdict(s), "label": s.label, "within_tolerance": within,
               "config": s.config().to_dict(), "training_arguments": s.training_arguments_code(),
               "cli_flags": s.cli_flags()}
    return {
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()},
        "task": {"model": task.model_name, "task": task.task, "dataset": task.dataset_name,
                 "num_parameters": task.num_parameters, "train_examples": task.train_examples,
                 "eval_examples": task.eval_examples},
        "hardware": dataclasses.asdict(profile),
        "modelled_params": params,
        "modelled_tokens_per_step": tokens,
        "machine": machine_info(device),
        "reference": next((r for r in records if r["optimizer"] == "adamw_torch"), None),
        "trials": rows,
        "skipped": [s.label for s in skipped],
        "interrupted": interrupted,
        "recommendation": rec,
        "seconds": seconds,
    }


def format_table(payload: dict[str, Any]) -> str:
    ref = payload["reference"]
    lines = ["| setting | held-out loss | vs adamw_torch | accuracy diff (points) | steps/s | critical path ms | "
             "mean window | modelled speed-up vs sync offload | Pareto | |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    if ref:
        lines.append(f"| adamw_torch (reference) | {ref['eval_loss']:.4f} | - | - | {ref['steps_per_s']:.2f} | "
                     f"{ref['critical_path_ms']:.1f} | - | - | | |")
    for r in payload["trials"]:
        window = "-" if r["mean_window"] is None else f"{r['mean_window']:.1f}"
        lines.append(f"| {r['label']} | {r['eval_loss']:.4f} | {r['quality_loss_pct']:+.2f} % | "
                     f"{r['accuracy_delta_points']:+.1f} | {r['steps_per_s']:.2f} | {r['critical_path_ms']:.1f} | "
                     f"{window} | {r['modelled_speedup']:.2f}x | {'yes' if r['pareto'] else ''} | "
                     f"{'**recommended**' if r['recommended'] else ''} |")
    return "\n".join(lines)


def format_recommendation(payload: dict[str, Any]) -> str:
    rec = payload["recommendation"]
    if rec is None:
        return "No ZenFlow trial finished: no recommendation."
    tol = payload["config"]["max_quality_loss_pct"]
    head = (f"Recommended: **{rec['label']}** (the fastest Pareto point within {tol:g} % of adamw_torch's held-out "
            "loss)." if rec["within_tolerance"] else
            f"No setting tried came within {tol:g} % of adamw_torch's held-out loss; the closest Pareto point that is "
            f"faster than synchronous offload is **{rec['label']}**: the trade-off curve is in pareto.png.")
    return "\n".join([head, "", "```python", "from hf_zenflow import ZenFlowTrainingArguments", "",
                      f"args = {rec['training_arguments']}", "```", "", "Command-line flags (HfArgumentParser):",
                      "", f"```\n{rec['cli_flags']}\n```"])


def write_outputs(payload: dict[str, Any], out_dir: Path) -> None:
    (out_dir / "tune.json").write_text(json.dumps(payload, indent=2, default=str), encoding="utf-8")
    t = payload["task"]
    hw = payload["hardware"]
    md = [f"# hf-zenflow tune: {t['model']}", "",
          (f"{payload['machine']['date_utc']} UTC; {t['dataset']}; {t['train_examples']} train / "
           f"{t['eval_examples']} held-out; {payload['config']['steps']} steps x batch "
           f"{payload['config']['batch_size']}, lr {payload['config']['lr']}, seed {payload['config']['seed']}; "
           f"speed-up modelled on `{hw['name']}` for {payload['modelled_params'] / 1e6:.1f}M params and "
           f"{payload['modelled_tokens_per_step']:.0f} tokens/step (hardware.schedule_model; a model, not a "
           f"measurement); {payload['seconds']:.0f} s wall."
           + (" Interrupted: the table holds the trials that finished." if payload["interrupted"] else "")),
          "", format_table(payload), ""]
    if payload["skipped"]:
        md += [f"Not run (budget): {', '.join(payload['skipped'])}.", ""]
    if payload.get("over_budget_s"):
        md += [f"The run took {payload['over_budget_s']:.0f} s longer than the budget: the adamw_torch reference "
               "always runs, and no trial starts once the budget cannot hold it; shorten --steps / --eval-size for a "
               "tighter budget.", ""]
    md += [format_recommendation(payload), "",
           "Quality is one seed per trial: differences below the seed-to-seed noise of a short fine-tune are ties."]
    (out_dir / "tune.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    rec = payload["recommendation"]
    if rec:
        (out_dir / "recommended.py").write_text(
            "from hf_zenflow import ZenFlowTrainingArguments\n\n" f"args = {rec['training_arguments']}\n",
            encoding="utf-8")
    plot_pareto(payload, out_dir / "pareto.png")


def plot_pareto(payload: dict[str, Any], path: Path) -> None:
    from hf_zenflow.compare.plots import pyplot

    plt = pyplot()

    rows = payload["trials"]
    fig, ax = plt.subplots(figsize=(8.5, 5.5))
    if rows:
        xs = [r["modelled_speedup"] for r in rows]
        ys = [r["quality_loss_pct"] for r in rows]
        colors = {0.05: "#dd8452", 0.1: "#4c72b0", 0.2: "#55a868"}
        for r, x, y in zip(rows, xs, ys):
            marker = "s" if r["setting"]["host_lr_scale"] == "interval" else "o"
            ax.scatter(x, y, s=60, marker=marker, color=colors.get(r["setting"]["topk_ratio"], "#8c8c8c"),
                       edgecolors="black", linewidths=0.5, zorder=3)
            ax.annotate(r["label"], (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7)
        front = sorted((r for r in rows if r["pareto"]), key=lambda r: r["modelled_speedup"])
        ax.plot([r["modelled_speedup"] for r in front], [r["quality_loss_pct"] for r in front], color="#c44e52",
                linewidth=1.5, zorder=2, label="Pareto front")
        best = next((r for r in rows if r["recommended"]), None)
        if best:
            ax.scatter(best["modelled_speedup"], best["quality_loss_pct"], s=320, marker="*", color="gold",
                       edgecolors="black", zorder=4, label=f"recommended: {best['label']}")
        tol = payload["config"]["max_quality_loss_pct"]
        ax.axhline(tol, color="#8c8c8c", linestyle="--", linewidth=1, label=f"tolerance {tol:g} %")
        ax.axhline(0, color="black", linewidth=0.6)
        for ratio, color in colors.items():
            if any(r["setting"]["topk_ratio"] == ratio for r in rows):
                ax.scatter([], [], color=color, label=f"topk_ratio {ratio:g}")
        ax.scatter([], [], marker="o", color="white", edgecolors="black", label="host_lr_scale 1")
        ax.scatter([], [], marker="s", color="white", edgecolors="black", label="host_lr_scale interval")
    hw = payload["hardware"]["name"]
    ax.set_xlabel(f"modelled speed-up over synchronous offload on {hw} "
                  f"({payload['modelled_params'] / 1e6:.0f}M params)")
    ax.set_ylabel("held-out loss vs adamw_torch (%; lower is better)")
    ax.set_title(f"hf-zenflow tune: {payload['task']['model']} ({payload['config']['steps']} steps, one seed)",
                 fontsize=10)
    ax.grid(alpha=0.3)
    if rows:
        ax.legend(fontsize=7, loc="best")
    else:
        ax.text(0.5, 0.5, "no ZenFlow trial finished", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def tune(model: str | None = None, **kwargs: Any) -> dict[str, Any]:
    """Notebook entry point: `run_tune(TuneConfig(model=model, **kwargs))`; returns the payload written to
    ``tune.json`` (``payload["recommendation"]["config"]`` is a ready `ZenFlowConfig` dict).

    Example:
        >>> import hf_zenflow
        >>> result = hf_zenflow.tune(budget_minutes=10)  # doctest: +SKIP
        >>> result["recommendation"]["training_arguments"]  # doctest: +SKIP
    """
    require("compare", "hf_zenflow.tune")
    return run_tune(TuneConfig(model=model, **kwargs))


__all__ = ["GRID_INTERVAL", "GRID_SCALE", "GRID_TOPK", "Progress", "TrialSetting", "TuneConfig", "default_grid",
           "paired_interval", "pareto_front", "recommend", "run_trial", "run_tune", "t95", "tune"]
