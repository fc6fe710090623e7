"""`hf-zenflow tune` / `hf_zenflow.tune(...)`: short paired trials that choose ZenFlow's settings before scaling up.

Every trial fine-tunes a fresh copy of the same model from the same initial weights on the same batches (the
`compare` runner's `prepare_task` / `train_one`); only the optimizer differs. `adamw_torch` runs first: it is the
quality reference. Each ZenFlow setting of the grid (`topk_ratio` x `update_interval` x `host_step`; library
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

One seed per trial: a single trial's difference has the seed-to-seed noise of a short fine-tune
(BENCHMARKS.md "Quality: short fine-tunes" measures it); treat differences smaller than that as ties.

Where the parts live: the grid (`tune_grid`), the Pareto front and the recommendation (`pareto`), the written outputs
(`tune_report`); the paired interval of the quality study is in `paired_stats`. Their public names are importable
from this module too.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_zenflow._extras import require
from hf_zenflow.compare.metrics import metric_key
from hf_zenflow.tuning.divergence import curve_diverged, diverged
from hf_zenflow.tuning.paired_stats import paired_interval, t95
from hf_zenflow.tuning.pareto import pareto_front, recommend
from hf_zenflow.tuning.tune_grid import (
    GRID_HOST_STEP,
    GRID_INTERVAL,
    GRID_TOPK,
    TrialSetting,
    default_grid,
    library_default_setting,
    parse_settings,
)
from hf_zenflow.tuning.tune_report import format_recommendation, format_table, plot_pareto, write_outputs


def trial_record(name: str, result: dict[str, Any], seconds: float, setting: TrialSetting | None,
                 metric: str = "accuracy") -> dict[str, Any]:
    """The compact figures of one `train_one` result; `metric` names its held-out metric."""
    stats = result.get("engine_stats") or {}
    windows = stats.get("windows") or 0
    losses = list((result.get("curves") or {}).get("loss") or [])
    return {
        "optimizer": name,
        "setting": dataclasses.asdict(setting) if setting else None,
        "label": setting.label if setting else name,
        "eval_loss": result["eval_loss"],
        "metric": metric,
        "eval_metric": result[metric_key(metric)],
        **{k: v for k, v in result.items() if k.startswith("eval_")},  # eval_loss and eval_<metric name>
        "train_loss": result["train_loss"],
        "train_losses": losses,  # per step: the divergence flag reads where the curve started and ended
        "steps_per_s": result["steps_per_s"],
        "critical_path_ms": (result["opt_step_ms_mean"] or 0.0) + (result["clip_ms_mean"] or 0.0),
        "mean_window": (stats.get("steps") or result["steps"]) / windows if windows else None,
        # how much of the gradient the device columns held at the last selection (None: no selection)
        "selected_grad_share": _finite(stats.get("selected_grad_share")),
        "seconds": seconds,
    }


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def run_trial(name: str, task: Any, cfg: Any, device: Any, setting: TrialSetting | None = None,
              **overrides: Any) -> dict[str, Any]:
    """Train one fresh copy (`compare.runner.train_one`) with `setting` applied; return `trial_record`."""
    from hf_zenflow.compare.training_run import train_one

    values = {"quiet": True, "log_every": 0, **overrides}
    if setting is not None:
        values.update(setting.config_kwargs())
    run_cfg = dataclasses.replace(cfg, **values)
    gc.collect()
    t0 = time.perf_counter()
    result = train_one(name, task, run_cfg, device)
    record = trial_record(name, result, time.perf_counter() - t0, setting, task.metric_name)
    del result
    gc.collect()
    return record


class Progress:
    """One tqdm bar over the trials: trials done, elapsed, and the estimated time left (the mean trial so far times
    the trials left, capped by the budget's end: tqdm's own estimate knows nothing of the budget)."""

    def __init__(self, total: int, stream: Any = None, width: int = 24, deadline: float | None = None) -> None:
        from tqdm.auto import tqdm

        self.deadline = deadline  # perf_counter time at which the budget ends: the time left never exceeds it
        self.trial_s: list[float] = []
        line = f"[tune] {{bar:{width}}} {{n_fmt}}/{{total_fmt}} trials  elapsed {{elapsed}}{{postfix}}"
        self.bar = tqdm(total=total, file=stream if stream is not None else sys.stderr, ncols=width + 110,
                        bar_format=line, mininterval=0.0)

    def update(self, done: int, total: int, note: str, trial_s: float | None = None) -> None:
        if trial_s is not None:
            self.trial_s.append(trial_s)
        self.bar.total = max(total, done)
        self.bar.n = done
        left = statistics.fmean(self.trial_s) * (self.bar.total - done) if self.trial_s else math.nan
        if self.deadline is not None and done < self.bar.total:
            budget_left = max(0.0, self.deadline - time.perf_counter())
            left = budget_left if math.isnan(left) else min(left, budget_left)
        self.bar.set_postfix_str(f"left ~{'?' if math.isnan(left) else _mmss(left)}  {note[:60]}", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


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
    # the data and the metric, as in compare (CompareConfig): None = the built-in corpus / the task's default metric
    dataset: str | None = None
    text_column: str | None = None
    label_column: str | None = None
    train_split: str = "train"
    eval_split: str | None = None
    metric: str | None = None
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
    host_steps: tuple[str, ...] = GRID_HOST_STEP
    max_quality_loss_pct: float = 1.0  # tolerance on the held-out loss relative to adamw_torch
    hardware: str = "a100-40gb-pcie4"  # preset name or JSON profile
    target_params: float | None = None  # model size the speed-up is modelled for (None: this model's)
    target_tokens_per_step: float | None = None  # tokens per optimizer step at scale (None: this task's)
    device_cores: int | None = None  # D: the training thread's cores on a CPU device (`compare.cores`)
    host_cores: int | None = None  # H: the host AdamW's cores, and the modelled host's (measured here)
    host_from_profile: bool = False  # model the speed-up with the profile's published host instead of this host
    device: str = "auto"
    output_dir: str = "zenflow_tune"
    progress: bool = True


def _tokens_per_step(task: Any) -> float:
    batches = task.train_batches[: min(8, len(task.train_batches))]
    return statistics.fmean(float(b.inputs["attention_mask"].sum()) for b in batches)


def modelled_speedup(record: dict[str, Any], profile: Any, params: float, tokens: float) -> float:
    """ZenFlow's modelled speed-up over synchronous offload on `profile` at this trial's (mean) window length."""
    from hf_zenflow.estimate.hardware import schedule_model

    s = record["setting"]
    u = record.get("mean_window") or (s["update_interval"] if s["update_interval"] != "auto" else 4)
    rows = schedule_model(profile, params, tokens, s["topk_ratio"], float(u))
    return rows["sync_offload"]["step_ms"] / rows["zenflow"]["step_ms"]


def trial_diverged(record: dict[str, Any], reference: dict[str, Any]) -> bool:
    """The quality suite's divergence flag (`divergence.diverged`) for a trial, where `adamw_torch` converged: its
    training loss ends above where it started (the mean of the last steps against the first step; the trials see the
    same batches, so a curve that rises for `adamw_torch` too says the batches, not the optimizer), or its held-out
    loss ends above 1.5x `adamw_torch`'s."""
    rising = curve_diverged(record.get("train_losses") or [])
    return ((rising and not curve_diverged(reference.get("train_losses") or []))
            or diverged(None, record["eval_loss"], reference["eval_loss"]))


def front_points(rows: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(quality loss %, modelled speed-up) of each scored trial for the Pareto front; a diverged trial's quality is
    unknown (NaN), so it is never on the front and never recommended, however fast."""
    return [(math.nan if r.get("diverged") else r["quality_loss_pct"], r["modelled_speedup"]) for r in rows]


def score(records: list[dict[str, Any]], profile: Any, params: float, tokens: float) -> list[dict[str, Any]]:
    """Add quality_loss_pct, metric_delta (held-out metric, ZenFlow minus adamw_torch), diverged
    (`trial_diverged`) and modelled_speedup to the ZenFlow records."""
    ref = next(r for r in records if r["optimizer"] == "adamw_torch")
    out = []
    for r in records:
        if r["optimizer"] != "zenflow":
            continue
        row = dict(r)
        row["quality_loss_pct"] = 100.0 * (r["eval_loss"] / ref["eval_loss"] - 1.0)
        row["metric_delta"] = r["eval_metric"] - ref["eval_metric"]  # ZenFlow minus adamw_torch
        row["diverged"] = trial_diverged(r, ref)
        row["modelled_speedup"] = modelled_speedup(r, profile, params, tokens)
        out.append(row)
    return out


def check_tune_inputs(cfg: TuneConfig) -> None:
    """Every input of a tune run, before any work: a `ValueError` naming the flag, the value and what is allowed."""
    from hf_zenflow.atomic import check_writable_folder
    from hf_zenflow.compare.checks import check_dataset, check_device, check_model, check_profiles

    check_device(cfg.device)
    check_profiles([cfg.hardware], "--hardware")
    for s in default_grid(cfg.topk, cfg.intervals, cfg.host_steps):
        s.config()  # a bad grid value fails here, naming the field
    check_model(cfg.model)
    check_dataset(cfg.dataset)
    check_writable_folder(cfg.output_dir, "--output-dir")


def run_tune(cfg: TuneConfig, on_trial: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the reference and as many grid settings as the budget allows; write and return the results (the output
    folder is made only then, its files written atomically)."""
    check_tune_inputs(cfg)
    from hf_zenflow.compare.compare_config import CompareConfig
    from hf_zenflow.compare.data import prepare_task
    from hf_zenflow.estimate.host_rates import resolve_host
    from hf_zenflow.estimate.profiles import load_profile

    # the modelled host is this machine, measured (`host_rates`), unless --host-from-profile
    profile = resolve_host(load_profile(cfg.hardware, published_host=cfg.host_from_profile), cfg.hardware,
                           cfg.host_cores, cfg.host_from_profile)[0]
    grid = default_grid(cfg.topk, cfg.intervals, cfg.host_steps)
    out_dir = Path(cfg.output_dir)
    wall = time.perf_counter()
    deadline = wall + cfg.budget_minutes * 60.0
    base = CompareConfig(model=cfg.model, task=cfg.task, steps=cfg.steps, train_size=cfg.train_size,
                         eval_size=cfg.eval_size, batch_size=cfg.batch_size, eval_batch_size=cfg.eval_batch_size,
                         max_length=cfg.max_length, lr=cfg.lr, seed=cfg.seed, device=cfg.device, quiet=True,
                         log_every=0, device_cores=cfg.device_cores, host_cores=cfg.host_cores,
                         dataset=cfg.dataset, text_column=cfg.text_column,
                         label_column=cfg.label_column, train_split=cfg.train_split, eval_split=cfg.eval_split,
                         metric=cfg.metric, device_memory_limit_bytes="free")  # (trials: the device's free memory)
    base.core_split()  # a bad core count fails before the model loads
    device = base.resolved_device()
    task = prepare_task(model=cfg.model, task=cfg.task, steps=cfg.steps, train_size=cfg.train_size,
                        eval_size=cfg.eval_size, batch_size=cfg.batch_size, max_length=cfg.max_length, seed=cfg.seed,
                        eval_batch_size=cfg.eval_batch_size, data=base.data_spec(), metric=cfg.metric)
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
    out_dir.mkdir(parents=True, exist_ok=True)
    write_outputs(payload, out_dir)
    return payload


def summarize(cfg: TuneConfig, task: Any, records: list[dict[str, Any]], profile: Any, params: float, tokens: float,
              skipped: list[TrialSetting], interrupted: bool, seconds: float, device: Any) -> dict[str, Any]:
    from hf_zenflow.compare.runner import machine_info

    rows = score(records, profile, params, tokens) if records else []
    points = front_points(rows)
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
        "task": {"model": task.model_name, "task": task.task, "dataset": task.dataset_name, "metric": task.metric_name,
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


__all__ = ["GRID_HOST_STEP", "GRID_INTERVAL", "GRID_TOPK", "Progress", "TrialSetting", "TuneConfig",
           "default_grid", "format_recommendation", "format_table", "library_default_setting", "paired_interval",
           "parse_settings", "pareto_front", "plot_pareto", "recommend", "run_trial", "run_tune", "t95", "tune"]
