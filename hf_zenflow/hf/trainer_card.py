"""The `ZenFlowTrainer`'s model card: the run's hyperparameters, results, ZenFlow settings and measured figures,
gathered from the trainer and rendered by `model_card.render_zenflow_model_card`. `trainer` is a `ZenFlowTrainer` (or
a trl subclass of it): typed as the transformers `Trainer` it is, since `trainer.py` imports this module."""

from __future__ import annotations

import os
from dataclasses import fields
from typing import Any

import torch
from huggingface_hub import ModelCard
from transformers import Trainer
from transformers.modelcard import TrainingSummary, _listify, make_markdown_table

from .model_card import format_bytes, is_hub_id, render_zenflow_model_card
from .trainer_telemetry import LAST_STATS, TELEMETRY_PREFIX


def card_inputs(trainer: Trainer) -> dict[str, Any]:
    """The card's ZenFlow section: every setting of the optimizer in use and the run's measured figures."""
    args = trainer.args
    opt = trainer.zenflow_optimizer
    config = opt.config if opt is not None else args.zenflow_config()
    settings = {f.name: getattr(config, f.name) for f in fields(config)}  # every setting, in field order
    settings["cpu_threads"] = f"{config.resolved_cpu_threads}" + (" (auto)" if config.cpu_threads is None else "")
    run = trainer._zenflow_telemetry.run_summary()
    measured: dict[str, Any] = {}
    labels = {
        "steps": "optimizer steps",
        "windows": "host windows",
        "reselections": "column re-selections",
        "skipped_steps": "skipped steps",
        "update_interval": "update interval (last)",
        "high_lr_window": 'high_lr_rule="auto": window steps (0 = not engaged)',
        "host_beta1": "host AdamW beta1",
        "host_step_guard": "host_step_guard: host lr factor (1 = not engaged)",
        "host_step_guard_engaged": "host_step_guard: overshoots seen",
        "critical_path_ms": "critical path per step (mean, ms)",
        "cp_wait_ms": "of which waiting for the host worker (mean, ms)",
        "host_step_ms": "host AdamW step per window (mean, ms)",
        "selected_fraction": "selected fraction (mean)",
        "selected_grad_share": "device columns' share of the gradient norm (last selection)",
        "staleness": "staleness (mean, steps)",
    }
    for key, label in labels.items():
        value = run.get(TELEMETRY_PREFIX + key)
        if value is not None:
            fractional = ("update_interval", "host_beta1", "host_step_guard", "selected_grad_share")
            measured[label] = int(value) if key in LAST_STATS and key not in fractional else value
    for key, label in (("bytes_to_host", "to host"), ("bytes_to_device", "to device")):
        value = run.get(TELEMETRY_PREFIX + key)
        if value is not None:
            measured[f"bytes {label} per step (mean)"] = format_bytes(value)
    if measured:
        measured = {"training device": training_device_description(trainer), **measured}
    return {"settings": settings, "measured": measured}


def training_device_description(trainer: Trainer) -> str:
    """The device the run trained on, and on a CPU the threads the forward/backward had."""
    device = trainer.args.device
    if device.type == "cuda" and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(device)} ({device})"
    threads = getattr(trainer, "_zenflow_training_threads", None) or torch.get_num_threads()
    return f"{device.type} ({threads} training threads)"


def plain_card_summary(trainer: Trainer, **kwargs: Any) -> TrainingSummary:
    """What `Trainer.create_model_card` puts on the plain card for the same run and arguments: every evaluation
    metric, the `tasks`, the dataset names, tags and arguments, and the `model-index` / `metrics` metadata."""
    if isinstance(kwargs.get("tags"), list):
        kwargs["tags"] = list(kwargs["tags"])  # from_trainer appends to the list it is given
    return TrainingSummary.from_trainer(trainer, **kwargs)


def render_trainer_card(trainer: Trainer, model_name: str | None = None, **kwargs: Any) -> ModelCard:
    """The Hub card of `trainer`'s run; `kwargs` are `Trainer.create_model_card`'s (language, license, tags,
    finetuned_from, tasks, dataset_tags, dataset, dataset_args). It carries what the plain card carries (evaluation
    results, tasks, datasets: `plain_card_summary`) plus the ZenFlow section."""
    model = trainer.accelerator.unwrap_model(trainer.model) if trainer.model is not None else None
    library_name = "transformers"
    base_model = kwargs.pop("finetuned_from", None)
    peft_config = getattr(model, "peft_config", None)
    if isinstance(peft_config, dict) and peft_config:
        library_name = "peft"
        base_model = base_model or next(iter(peft_config.values())).base_model_name_or_path
    config = getattr(model, "config", None)
    if base_model is None and config is not None:
        base_model = getattr(config, "_name_or_path", "") or None
    tags = kwargs.pop("tags", None)
    tags = [tags] if isinstance(tags, str) else list(tags or [])
    tags += list(getattr(model, "model_tags", None) or [])
    tags = list(dict.fromkeys(["generated_from_trainer", *tags, *trainer._tag_names]))
    args = trainer.args
    summary = plain_card_summary(
        trainer, model_name=model_name or os.path.basename(os.path.abspath(args.output_dir)), tags=tags,
        finetuned_from=base_model or "", **kwargs)
    hub_model = base_model if base_model and is_hub_id(base_model) else None
    metadata = summary.create_metadata()
    hyperparameters = {
        "learning_rate": args.learning_rate,
        "train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "total_train_batch_size": args.per_device_train_batch_size * args.gradient_accumulation_steps
        * max(1, args.world_size),
        "seed": args.seed,
        "optimizer": f"ZenFlowAdamW (betas=({args.adam_beta1}, {args.adam_beta2}), eps={args.adam_epsilon}, "
        f"weight_decay={args.weight_decay})",
        "lr_scheduler_type": getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type),
        "max_grad_norm": args.max_grad_norm,
        "training_steps": trainer.state.max_steps or args.max_steps,
        "mixed_precision": "bf16" if args.bf16 else "no",
    }
    results: dict[str, Any] = {}
    for entry in reversed(trainer.state.log_history):
        if "train_loss" in entry and "train_loss" not in results:
            results["train_loss"] = entry["train_loss"]
        if "loss" in entry and "last logged loss" not in results:
            results["last logged loss"] = entry["loss"]
    inputs = card_inputs(trainer)
    name = trainer.__class__.__name__
    procedure = None
    if name != "ZenFlowTrainer":
        procedure = (f"It was trained with `{name}` (the ZenFlow optimizer of `hf_zenflow` in "
                     f"{'trl' if 'trl' in trainer._tag_names else 'a Hugging Face'} Trainer).")
    return render_zenflow_model_card(
        model_name=summary.model_name,
        base_model=base_model,
        base_model_on_hub=hub_model is not None,
        datasets=[str(d) for d in _listify(summary.dataset)],
        tags=list(summary.tags),
        library_name=library_name,
        license=summary.license,
        language=summary.language,
        hyperparameters=hyperparameters,
        results=results,
        eval_results=summary.eval_results,
        eval_table=make_markdown_table(summary.eval_lines) if summary.eval_lines else None,
        card_metadata={key: metadata[key] for key in ("datasets", "metrics", "model-index") if key in metadata},
        zenflow_settings=inputs["settings"],
        zenflow_measured=inputs["measured"],
        training_procedure=procedure,
    )
