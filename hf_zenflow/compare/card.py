"""The model card of `hf-zenflow compare --save-model`: the `README.md` next to the saved ZenFlow-trained model.

It is the ZenFlowTrainer's card (same template, same row names for the same figures), with the sentence on how the
model was trained replaced (a plain PyTorch loop, not the Trainer) and the side-by-side figures added: ratios as
"ZenFlow ÷ baseline" with "×", bytes with units. No card is written when no model is saved: a card describes weights.
"""

from __future__ import annotations

from typing import Any

from hf_zenflow.compare.data import PreparedTask
from hf_zenflow.compare.report import (
    SHORT_NAMES,
    format_delta,
    format_ms,
    format_points,
    format_ratio,
    format_size,
    format_spread,
)
from hf_zenflow.hf.model_card import render_zenflow_model_card


def card_settings(cfg: Any) -> dict[str, Any]:
    """ZenFlow's settings as the card lists them (`cfg` is a `CompareConfig`)."""
    return {"topk_ratio": cfg.topk_ratio, "update_interval": cfg.update_interval, "overlap_step": cfg.overlap_step,
            "host_step": cfg.host_step, **({"engine rules": cfg.rules} if cfg.rules else {}),
            "min_offload_numel": cfg.min_offload_numel,
            "select_strategy": cfg.select_strategy, "select_interval": cfg.select_interval,
            "full_warm_up_rounds": cfg.full_warm_up_rounds, "cpu_threads": cfg.core_split().host,
            "select in embedding tables": cfg.resolved_embedding_select()}


def card_measured(zen: dict[str, Any], rat: dict[str, dict[str, float | None]], device: str) -> dict[str, Any]:
    """The "Measured during training" rows, named as on the ZenFlowTrainer's card where the figure is the same."""
    stats = zen.get("engine_stats") or {}
    measured: dict[str, Any] = {
        "training device": device,
        "optimizer steps": zen["steps"],
        "host windows": stats.get("windows"),
        "column re-selections": stats.get("reselections"),
        "critical path per step (mean, ms)": zen["engine_critical_path_ms_mean"],
        "optimizer.step per step (median [p10–p90], ms)": (f"{format_ms(zen['opt_step_ms_median'])} "
                                                           f"[{format_spread(zen)}]"),
        "host AdamW step per window (mean, ms)": zen["host_step_ms_mean"],
        "bytes to host per step (mean)": format_size(zen["bytes_to_host_per_step"]),
        "bytes to device per step (mean)": format_size(zen["bytes_to_device_per_step"]),
        "optimizer state on the device": format_size(zen["optimizer_state_device_bytes"]),
        "optimizer state on the host": format_size(zen["optimizer_state_host_bytes"]),
        "device utilisation (busy share of the training steps)": (
            f"{100 * zen['device_utilization']:.0f} %" if zen.get("device_utilization") is not None else None),
    }
    for key, r in rat.items():
        base = SHORT_NAMES[key.replace("zenflow_vs_", "")]
        measured[f"optimizer.step time, ZenFlow ÷ {base} (median; mean)"] = (
            f"{format_ratio(r.get('opt_step_ms_median_ratio'))}; {format_ratio(r.get('opt_step_ms_mean_ratio'))}")
    load = zen.get("machine_load") or {}
    if load.get("others_cores") is not None:
        measured["other processes' CPU during the run (mean cores; steal)"] = (
            f"{load['others_cores']:.2f} of {load['cores']}; {100 * (load.get('steal_fraction') or 0.0):.1f} %"
            + (" (busy machine: times are disturbed)" if load.get("busy") else ""))
    return {k: v for k, v in measured.items() if v is not None}


def render_compare_card(task: PreparedTask, cfg: Any, results: dict[str, dict[str, Any]],
                        rat: dict[str, dict[str, float | None]], device: str) -> str:
    """The card of the ZenFlow-trained model of one compare run, as Markdown with YAML front matter."""
    zen = results["zenflow"]
    baselines = [label for name, label in (("adamw_torch", "`adamw_torch`"), ("sync_offload", "`SyncOffloadAdamW`"))
                 if name in results]
    side_by_side = (f", side by side with {' and '.join(baselines)} (same initial weights, seed, batches and "
                    "learning-rate schedule)") if baselines else ""
    metric_line = (f" Held-out metric: {task.metric_name} ({task.metric.source})." if task.metric.source else "")
    procedure = (f"It was trained with the ZenFlow optimizer of `hf_zenflow` (`ZenFlowAdamW`) in the plain PyTorch "
                 f"training loop of `hf-zenflow compare`, on {task.dataset_name}{side_by_side}. The whole comparison "
                 "is in `results.md` of the run folder." + metric_line)
    hyper = {"learning_rate": cfg.lr, "train_batch_size": cfg.batch_size, "seed": cfg.seed,
             "optimizer": f"ZenFlowAdamW (betas=(0.9, 0.999), eps=1e-08, weight_decay={cfg.weight_decay})",
             "lr_scheduler_type": "linear", "warmup_ratio": cfg.warmup_ratio, "max_grad_norm": cfg.max_grad_norm,
             "training_steps": cfg.steps, "max_length": cfg.max_length,
             "train / held-out examples": f"{task.train_examples} / {task.eval_examples}"}
    metric, value = task.metric_name, task.metric.key
    summary = {f"held-out {metric}": zen[value], "held-out loss": zen["eval_loss"],
               "train loss (mean of the last 10% of steps)": zen["train_loss"]}
    for key, r in rat.items():
        base = key.replace("zenflow_vs_", "")
        summary[f"held-out {metric} of {SHORT_NAMES[base]} (same data and seed)"] = results[base][value]
        if f"{value}_delta_points" in r:
            summary[f"held-out {metric}, ZenFlow minus {SHORT_NAMES[base]}"] = format_points(
                r[f"{value}_delta_points"])
        elif f"{value}_delta" in r:
            summary[f"held-out {metric}, ZenFlow minus {SHORT_NAMES[base]}"] = format_delta(r[f"{value}_delta"])
        else:  # a cost (perplexity): a ratio, like the loss
            summary[f"held-out {metric}, ZenFlow ÷ {SHORT_NAMES[base]}"] = format_ratio(r.get(f"{value}_ratio"))
    card = render_zenflow_model_card(
        model_name=f"{task.model_name.split('/')[-1]}-zenflow-compare",
        zenflow_settings=card_settings(cfg), zenflow_measured=card_measured(zen, rat, device),
        hyperparameters=hyper, results=summary,
        # Local and built-in data is described in the text only (the template would turn a name into a Hub link); a
        # load_dataset name is a Hub id.
        base_model=task.model_name if "/" in task.model_name else None, dataset_name=task.dataset_id,
        tags=["hf-zenflow-compare", task.task], training_procedure=procedure,
    )
    card.data.metrics = [metric]  # the metric the held-out figures above are of (model-card metadata)
    return str(card)
