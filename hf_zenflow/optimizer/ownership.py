"""One live ZenFlow optimizer per parameter.

A `ZenFlowAdamW` reads each gradient in a backward hook on its parameter (`engine/gradients.py`) and, with
``free_gradients_in_backward``, takes the gradient off the parameter there, for its own next `step()`. Two of them
hooked on one parameter would race for its gradient: the first one's hook takes it, and the other one sees
``p.grad`` None and trains nothing, without a word. So a parameter is held by one ZenFlow optimizer at a time: an
optimizer of this package built over parameters an earlier ZenFlow optimizer holds takes them over
(`take_over`), and the earlier one is detached (`ZenFlowAdamW._detach`: closed, its hooks off, its `step()`
refused). Why a take-over rather than a refusal: see `ZenFlowAdamW`.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from typing import Any

import torch


logger = logging.getLogger("hf_zenflow")

#: The ZenFlow optimizers that hold their parameters (built, and not detached since); weak: an optimizer dropped
#: by its caller holds nothing.
_HOLDERS: weakref.WeakSet = weakref.WeakSet()


def describe(params: list[torch.Tensor], names: dict[torch.Tensor, str]) -> str:
    """ "14 parameter(s) (the first: 'model.layers.0.mlp.up_proj.weight')", by shape where no name is known."""
    first = params[0]
    label = repr(names[first]) if first in names else f"one of shape {tuple(first.shape)}"
    return f"{len(params)} parameter(s) (the first: {label})"


def take_over(new: Any, params: Iterable[torch.Tensor], holds: bool = True) -> None:
    """`new` (an optimizer being built over `params`) takes over those of `params` that earlier ZenFlow optimizers
    hold: each such optimizer is detached (`_detach`), and a warning says so once per optimizer detached, unless it
    had been closed with nothing left to apply (the end of its run). `holds`: `new` hooks its parameters (a
    `ZenFlowAdamW`) and holds them from now on; False for an optimizer that only reads ``p.grad`` in `step()`
    (`SyncOffloadAdamW`), which only needs the hooks of the others off."""
    mine = {id(p) for p in params}
    for old in list(_HOLDERS):
        if old is new:
            continue
        shared = [p for p in old._held() if id(p) in mine]
        if not shared:
            continue
        new_names = new.engine_state.names if hasattr(new, "engine_state") else {}  # (`SyncOffloadAdamW`: none)
        what = describe(shared, {**old.engine_state.names, **new_names})
        was_closed, unapplied = old._hooks_off, old._unapplied_steps()
        old._detach(f"a {type(new).__name__} built later over {what} took them over")
        _HOLDERS.discard(old)
        if was_closed and not unapplied:
            continue
        lost = (f"; the host updates of its last {unapplied} step(s), not in the weights yet, are not applied (call "
                "flush() on an optimizer before building another over its parameters to keep them)" if unapplied
                else "")
        logger.warning("%s takes over %s from an earlier ZenFlowAdamW%s: that one is detached (closed, its backward "
                       "hooks off, its step() refused from now on)%s. Call close() on an optimizer you are done "
                       "with.", type(new).__name__, what, "" if was_closed else " that was not closed", lost)
    if holds:
        _HOLDERS.add(new)
