"""Hugging Face integration of ZenFlow: `ZenFlowTrainer`, `ZenFlowTrainingArguments` (transformers) and
`ZenFlowPlugin` (accelerate).

The submodules import transformers / accelerate, which is slow, so they are loaded on first attribute access: a
plain ``import hf_zenflow`` stays cheap.

Example:
    >>> from hf_zenflow.hf import ZenFlowTrainer, ZenFlowTrainingArguments, ZenFlowPlugin
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any


if TYPE_CHECKING:
    from .accelerate_plugin import ZenFlowPlugin
    from .callback import ZenFlowCallback
    from .model_card import render_zenflow_model_card
    from .trainer import ZenFlowTrainer
    from .trainer_telemetry import ZenFlowTelemetry
    from .training_args import ZenFlowTrainingArguments

_EXPORTS = {
    "ZenFlowCallback": ".callback",
    "ZenFlowTrainer": ".trainer",
    "ZenFlowTelemetry": ".trainer_telemetry",
    "ZenFlowTrainingArguments": ".training_args",
    "ZenFlowPlugin": ".accelerate_plugin",
    "render_zenflow_model_card": ".model_card",
}

__all__ = [
    "ZenFlowCallback",
    "ZenFlowPlugin",
    "ZenFlowTelemetry",
    "ZenFlowTrainer",
    "ZenFlowTrainingArguments",
    "render_zenflow_model_card",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
