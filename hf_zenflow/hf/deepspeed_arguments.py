"""`--zenflow_from_deepspeed`: a DeepSpeed ZenFlow config applied onto `ZenFlowTrainingArguments`.

The mapping itself (which DeepSpeed key is which argument) is `settings.deepspeed_config`; this module applies it:
an argument still at its default takes the DeepSpeed value, an argument given with another value is a conflict
(`ValueError` naming both), like transformers' own DeepSpeed integration, which refuses mismatching values.
"""

from __future__ import annotations

import os
from dataclasses import fields
from typing import Any

from ..settings.config import ZenFlowConfig
from ..settings.deepspeed_config import load, training_values, warn_dropped, zenflow_values
from ..settings.flags import field_default, rename_fields


def apply_deepspeed_config(args: Any, source: dict[str, Any] | str | os.PathLike) -> None:
    """Set `args`' fields (a `ZenFlowTrainingArguments` before its post-init) from the DeepSpeed config `source`."""
    config = load(source)
    whole = "zero_optimization" in config  # else the zenflow block alone
    values, dropped = training_values(config) if whole else ({}, [])
    defaults = {f.name: field_default(f) for f in fields(args)}
    for name, (key, value) in values.items():
        _put(args, name, key, value, current=getattr(args, name), default=defaults[name])

    zenflow = zenflow_values(config)
    try:
        theirs = ZenFlowConfig(**zenflow)
    except ValueError as err:
        raise ValueError(rename_fields(str(err), lambda name: f"DeepSpeed zenflow.{name}")) from None
    mine, default = args.zenflow_config(), ZenFlowConfig()
    for name in zenflow:
        key = "zenflow.pt_reserved_cores_perc" if name == "cpu_threads" else f"zenflow.{name}"
        _put(args, f"zenflow_{name}", key, getattr(theirs, name), current=getattr(mine, name),
             default=getattr(default, name))
    warn_dropped(dropped, "ZenFlowTrainingArguments.from_deepspeed", stacklevel=5)


def _put(args: Any, name: str, key: str, value: Any, current: Any, default: Any) -> None:
    if current == value:
        return
    if current == default:
        setattr(args, name, value)
        return
    raise ValueError(
        f"ZenFlowTrainingArguments: the DeepSpeed config sets {key}={value!r} but {name}={current!r} was given: "
        f"leave {name} at its default ({default!r}) to take the DeepSpeed value, or make them agree."
    )
