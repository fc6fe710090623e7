"""`TRAIN_HOOKS`: called with the optimizer at every `ZenFlowAdamW.train()` (before each training step under a
Trainer). Kept in a module that imports nothing, so that the package's top (`hf_zenflow/__init__.py`) wires in the
Hugging Face glue's hook without importing torch: ``import hf_zenflow`` stays instant for the command line."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


TRAIN_HOOKS: list[Callable[[Any], None]] = []

__all__ = ["TRAIN_HOOKS"]
