"""`hf-zenflow compare`: fine-tune one real model three ways and measure the difference.

The three runs share the seed, the initial weights (deep copies of one loaded model), every batch and the learning-rate
schedule; only the optimizer differs:

* ``adamw_torch``   - ``torch.optim.AdamW(fused=True)`` on the device, no offload (the speed and accuracy reference);
* ``sync_offload``  - `hf_zenflow.SyncOffloadAdamW`, the ZeRO-Offload schedule (all gradients to the host, host AdamW,
  parameters back, the caller waits);
* ``zenflow``       - `hf_zenflow.ZenFlowAdamW`.

The settings are a `CompareConfig` (`hf_zenflow.compare.compare_config`); each of the three runs is one
`train_one` (`hf_zenflow.compare.training_run`: the per-phase timing and its statistics).

Every run gets the same cores: D for the device (the training thread), H for the host (`hf_zenflow.compare.cores`);
each run's device utilisation is measured and one window of it drawn (`hf_zenflow.compare.timeline`); after the runs
the three schedules are projected to GPU hardware profiles (`hf_zenflow.compare.projection`).

Output: a new run folder per run (`hf_zenflow.compare.output`), a short headline table on the terminal and the full
table in results.md (`hf_zenflow.compare.report`), the plots (`hf_zenflow.compare.plots`, timeline.png), a
busy-machine check (`hf_zenflow.compare.machine_load`) and, with ``save_model``, the model with its card
(`hf_zenflow.compare.card`).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import platform
import textwrap
import time
from pathlib import Path
from typing import Any

import torch

from hf_zenflow.compare import progress, report
from hf_zenflow.compare.compare_config import CompareConfig
from hf_zenflow.compare.data import PreparedTask, prepare_task
from hf_zenflow.compare.machine_load import LoadMonitor
from hf_zenflow.compare.output import RunOutput
from hf_zenflow.compare.plots import LABELS, plot_loss_curves, plot_time_breakdown
from hf_zenflow.compare.projection import projection_table, run_projection
from hf_zenflow.compare.report import OPTIMIZERS
from hf_zenflow.compare.run_order import resolve_block_steps, resolve_run_order, turns
from hf_zenflow.compare.timeline import plot_timeline
from hf_zenflow.compare.training_run import TIMING_SKIP, TrainingRun, evaluate, make_optimizer, train_one
from hf_zenflow.compare.verdict import MIN_TIMED_STEPS, verdict
from hf_zenflow.settings.threads import available_cpu_count


def _log(cfg: CompareConfig, msg: str, bar: Any = None) -> None:
    """A `[compare]` line; above the progress bar while one is drawn."""
    if cfg.quiet:
        return
    if bar is not None:
        bar.write(f"[compare] {msg}")
    else:
        print(f"[compare] {msg}", flush=True)


def progress_bar(cfg: CompareConfig, total: int) -> Any:
    """One bar over every step of every run, with ETA, on a terminal; whole lines at every tenth of the steps in a
    file or a pipe (`hf_zenflow.compare.progress`); None with --quiet or --log-every 0."""
    return progress.progress_bar(total, show=not cfg.quiet and bool(cfg.log_every))


def machine_info(device: torch.device) -> dict[str, Any]:
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
            f"{cfg.select_interval}, full_warm_up_rounds {cfg.full_warm_up_rounds}, device memory limit "
            f"{cfg.device_memory_limit_bytes}; weights of the offloading runs "
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


def _projection_title(projection: dict[str, Any]) -> str:
    host = ("the profiles' published host figure" if projection["host_from_profile"] else
            "this host's measured AdamW rate per core on each profile's host")
    size = projection["params"]
    size_text = f"{size / 1e9:.3g}B" if size >= 1e9 else f"{size / 1e6:.3g}M"
    return (f"Projected (not measured) for {size_text} parameters, "
            f"{projection['tokens_per_step']:.0f} tokens/step, from this run's measured selection and window, "
            f"with {host}:")


def _projection_md(projection: dict[str, Any], table: str) -> list[str]:
    return ["## Projected to GPU hardware (not measured)", "", _projection_title(projection), "", table, "",
            projection["method"], "", *[f"- {name}: {line}" for name, line in projection["hosts"].items()], ""]


def run_compare(cfg: CompareConfig) -> dict[str, Any]:
    """Run the comparison into a new run folder (`hf_zenflow.compare.output`): results.json, results.md,
    loss_curves.png, time_breakdown.png and, with `save_model`, zenflow_model/ with its card (README.md). Returns
    what results.json holds; ``payload["output_dir"]`` is the folder."""
    from hf_zenflow.compare.checks import check_compare_inputs

    check_compare_inputs(cfg)  # every input, before any work: one line naming the flag
    output = RunOutput.prepare(cfg.output_dir, cfg.model, cfg.overwrite)
    monitor = LoadMonitor()
    monitor.start()  # first: its load average before the run counts only other processes
    try:
        payload = _run(cfg, output.staging, monitor, output.final)
        output.publish()  # only now does the run replace an earlier one (--overwrite)
    except BaseException:
        output.discard()  # a failed run leaves the folder as it was, and nothing else behind
        raise
    finally:
        monitor.stop()
    _log(cfg, f"wrote {output.final}/: results.md (every figure), results.json, loss_curves.png, "
              "time_breakdown.png, timeline.png"
              + (", zenflow_model/ (model + README.md card)" if payload["saved_model"] else "")
              + f" in {payload['total_seconds']:.0f} s")
    if not cfg.quiet and payload["verdict"]:  # the last words: the verdict
        print("\nVerdict (from the figures above):\n" + "\n".join(textwrap.fill(f"- {line}", 118,
                                                                               subsequent_indent="  ")
                                                              for line in payload["verdict"]), flush=True)
    return payload


def _tokens_per_step(task: PreparedTask, cfg: CompareConfig) -> float:
    """Tokens per optimizer step of this run (attention-masked tokens when the batches have a mask)."""
    masks = [b.inputs["attention_mask"] for b in task.train_batches if "attention_mask" in b.inputs]
    if masks:
        return float(sum(int(m.sum()) for m in masks)) / len(masks)
    return float(cfg.batch_size * cfg.max_length)


def _stage(cfg: CompareConfig, name: str) -> str:
    return f"[{cfg.optimizers.index(name) + 1}/{len(cfg.optimizers)}] {LABELS[name]}"


def _describe_bar(cfg: CompareConfig, bar: Any, name: str) -> None:
    if bar is not None:
        bar.set_description(f"[{cfg.optimizers.index(name) + 1}/{len(cfg.optimizers)}] "
                            f"{report.SHORT_NAMES[name]}", refresh=False)
        bar.set_postfix_str("", refresh=False)  # the previous run's figures


def _finish(cfg: CompareConfig, task: PreparedTask, run: TrainingRun, load: Any, bar: Any) -> dict[str, Any]:
    """The run's figures with the machine's load over its time; its summary line."""
    r = run.finish()
    r["machine_load"] = load.to_dict()
    _log(cfg, f"{_stage(cfg, run.name)}: held-out {task.metric_name} {r[task.metric.key]:.4f}, loss "
              f"{r['eval_loss']:.4f}; {r['steps_per_s']:.2f} steps/s (whole run); optimizer.step "
              f"{report.format_ms(r['opt_step_ms_median'])} ms median, p10–p90 {report.format_spread(r)}; "
              f"device utilisation {report.format_utilization(r.get('device_utilization'))}; "
              f"other processes' CPU {load.short()}", bar)
    return r


def _run_sequential(cfg: CompareConfig, task: PreparedTask, device: torch.device, monitor: LoadMonitor,
                    bar: Any) -> dict[str, dict[str, Any]]:
    """One run after the other, each from its first step to its last (its load measured over its own time)."""
    results: dict[str, dict[str, Any]] = {}
    for name in cfg.optimizers:
        _describe_bar(cfg, bar, name)
        if bar is None:
            _log(cfg, f"{_stage(cfg, name)} ...")
        gc.collect()
        since = monitor.reading()
        run = TrainingRun(name, task, cfg, device, bar)
        run.advance(run.steps)
        results[name] = _finish(cfg, task, run, monitor.report(since), bar)
        del run
        gc.collect()
    return results


def _run_interleaved(cfg: CompareConfig, task: PreparedTask, device: torch.device, monitor: LoadMonitor,
                     bar: Any, block: int) -> dict[str, dict[str, Any]]:
    """Every run built first, then turns of `block` steps in rotating order (`compare.run_order`); each run hands
    over with its host worker idle. The load is measured over the whole interleaved span, which every run shares."""
    since = monitor.reading()
    runs: dict[str, TrainingRun] = {}
    for name in cfg.optimizers:
        gc.collect()
        runs[name] = TrainingRun(name, task, cfg, device, bar)
        runs[name].interleaved = True
    steps = len(task.train_batches)
    for name, count in turns(steps, block, min(TIMING_SKIP, max(0, steps - 1)), list(cfg.optimizers)):
        _describe_bar(cfg, bar, name)
        runs[name].advance(count, handover=True)
    if bar is not None:
        bar.set_description(f"{len(runs)} runs, interleaved", refresh=False)
    load = monitor.report(since)
    results: dict[str, dict[str, Any]] = {}
    for name in cfg.optimizers:
        results[name] = _finish(cfg, task, runs.pop(name), load, bar)
        gc.collect()
    return results


def _run(cfg: CompareConfig, out_dir: Path, monitor: LoadMonitor, final_dir: Path) -> dict[str, Any]:
    """The comparison, written into `out_dir` (a staging folder that becomes `final_dir` once it succeeded)."""
    device = cfg.resolved_device()
    split = cfg.core_split()  # fails on a bad --device-cores/--host-cores before the model loads
    cuda = device.type == "cuda"
    wall = time.perf_counter()
    _log(cfg, f"loading model and data (model={cfg.model or 'minilm'}, device={device}) ...")
    task = prepare_task(model=cfg.model, task=cfg.task, steps=cfg.steps, train_size=cfg.train_size,
                        eval_size=cfg.eval_size, batch_size=cfg.batch_size, max_length=cfg.max_length, seed=cfg.seed,
                        eval_batch_size=cfg.eval_batch_size, data=cfg.data_spec(), metric=cfg.metric)
    _log(cfg, f"{task.model_name}: {task.num_parameters / 1e6:.1f}M params; {task.task}; "
              f"{task.train_examples} train / {task.eval_examples} held-out examples; {cfg.steps} steps x "
              f"batch {cfg.batch_size}; load {time.perf_counter() - wall:.1f} s; writing to {final_dir}/")
    _log(cfg, f"cores: {split.describe()}")
    order, why = resolve_run_order(cfg.run_order, device, task.num_parameters, len(cfg.optimizers))
    block = resolve_block_steps(cfg.block_steps, cfg.update_interval)
    order_text = f"{order} ({why})" + (f", {block} steps per turn" if order == "interleaved" else "")
    _log(cfg, f"run order: {order_text}")
    first = min(TIMING_SKIP, max(0, len(task.train_batches) - 1))
    timed = len(task.train_batches) - first
    if timed < MIN_TIMED_STEPS:
        _log(cfg, f"warning: {cfg.steps} steps leave {timed} timed step(s) (the first {first} are not timed): the "
                  "per-step statistics (p10–p90) and the verdict's speed interval say little; use --steps "
                  f"{first + MIN_TIMED_STEPS} or more")
    bar = progress_bar(cfg, len(task.train_batches) * len(cfg.optimizers))
    try:
        with progress.lines_above(bar):  # (the thread split each engine announces: a line of its own)
            if order == "interleaved":
                results = _run_interleaved(cfg, task, device, monitor, bar, block)
            else:
                results = _run_sequential(cfg, task, device, monitor, bar)
    finally:
        if bar is not None:
            bar.close()
    whole = monitor.whole_run().to_dict()
    rat = report.ratios(results, task.metric_name, cuda)
    headline = report.comparison_table(results, rat, task.metric_name, cuda, headline=True)
    full = report.comparison_table(results, rat, task.metric_name, cuda, headline=False)
    note = report.statistics_note(len(task.train_batches), TIMING_SKIP)
    per_run_load = {n: r["machine_load"] for n, r in results.items()}
    warning = report.busy_warning(whole["busy_reasons"], per_run_load, interleaved=order == "interleaved")
    notes = report.disagreement_notes(rat)
    title = (f"{task.model_name} on {task.dataset_name.split(' (')[0]}: {cfg.steps} steps x batch {cfg.batch_size}, "
             f"seed {cfg.seed}")
    plot_loss_curves(results, out_dir / "loss_curves.png", title)
    plot_time_breakdown(results, out_dir / "time_breakdown.png", title, TIMING_SKIP,
                        report.busy_banner(whole, per_run_load))
    plot_timeline(results, out_dir / "timeline.png", title)
    model_dir = _save_model(out_dir, task, cfg, results, rat, device)
    _log(cfg, "projecting to the hardware profiles (measuring this host's AdamW rate and memory bandwidth) ...")
    projection = run_projection(results, task.num_parameters, _tokens_per_step(task, cfg), cfg, split.host)
    projected = projection_table(projection["profiles"])
    said = verdict(results, projection, task.metric_name, first, block, cfg.device_memory_limit_bytes,
                   task.num_parameters, cuda, split.device)
    info = machine_info(device)
    payload = {
        "output_dir": str(final_dir),
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()},
        "task": {"task": task.task, "model": task.model_name, "model_path": task.model_path,
                 "dataset": task.dataset_name, "num_parameters": task.num_parameters,
                 "train_examples": task.train_examples, "eval_examples": task.eval_examples,
                 "metric": task.metric_name, **task.extra},
        "machine": info,
        "cores": split.to_dict(),
        "run_order": {"order": order, "why": why, "block_steps": block if order == "interleaved" else None},
        "projection": projection,
        "machine_load": whole,
        "warnings": [w for w in (warning, *notes) if w],
        "timing_skip_steps": TIMING_SKIP,
        "results": results,
        "ratios": rat,
        "saved_model": str(final_dir / model_dir.name) if model_dir else None,
        "verdict": said,
        "total_seconds": time.perf_counter() - wall,
    }
    (out_dir / "results.json").write_text(json.dumps(payload, indent=2, default=str), encoding="utf-8")
    machine = _machine_line(info, whole)
    md = [f"# hf-zenflow compare: {task.model_name}", "", _settings_line(task, cfg, device), "", f"Machine: {machine}",
          "", f"Cores: {split.describe()}.", "", f"Run order: {order_text}.", ""]
    md += [f"> **{warning}**", ""] if warning else []
    md += ["## Verdict", "", *[f"- {line}" for line in said], ""] if said else []
    md += ["## Headline", "", report.TABLE_CAPTION, "", headline, "", note, ""]
    md += [f"- {n}" for n in notes] + ([""] if notes else [])
    md += ["## All figures", "", full, "",
           ("adamw_torch is `torch.optim.AdamW(fused=True)`, its state counted as device state. \"optimizer.step\" "
            "is the time the runner measures around `optimizer.step()` (the optimizer's critical path); the "
            "gradient-norm clip is timed separately. Host RSS is the whole process, sampled after every step (the "
            "runs share it: interleaved, all of them are alive at once; sequential, one after the other). With "
            "interleaved runs each run's clock counts only its own turns, including the wait for its own host "
            "work before it hands over (handover_ms_total in results.json). Plots: loss_curves.png, "
            "time_breakdown.png."), "",
           ("Device utilisation: the share of the timed steps' wall time in which the device computes (forward, "
            "backward, clip, device-side optimizer work); the rest it waits for the host step, copies and syncs "
            "(the engines' handoff, wait, writeback and inline host_update phases). timeline.png draws one window "
            "of each run."), "",
           *_projection_md(projection, projected),
           f"Total wall time {payload['total_seconds']:.0f} s."]
    (out_dir / "results.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    if not cfg.quiet:
        wrap = lambda text: textwrap.fill(text, 118)
        print("\n" + wrap(f"Cores: {split.describe()}. Run order: {order_text}.") + "\n\n"
              + wrap(report.TABLE_CAPTION) + "\n" + headline
              + "\n\n" + wrap(note) + "\n\n" + wrap(f"Machine: {machine}"), flush=True)
        print("\n" + wrap(_projection_title(projection)) + "\n" + projected, flush=True)
        for text in [*notes, *([warning] if warning else [])]:
            print("\n" + wrap(text), flush=True)
        print(flush=True)
    return payload


# CompareConfig (compare_config) and evaluate, make_optimizer, train_one (training_run) are importable from here too
__all__ = ["OPTIMIZERS", "CompareConfig", "evaluate", "make_optimizer", "run_compare", "train_one"]
