"""Optional dependencies: which modules each pip extra brings, and one check that names the extra when one is missing.

The core install (torch, transformers, accelerate, huggingface_hub, jinja2, safetensors) is what the engine and the
Hugging Face glue import. What only `hf-zenflow compare` and its plots import comes with the ``compare`` extra
(pyproject.toml lists the same modules; a test keeps the two in step). The entry points call `require` before they
start, so a missing module says what to install instead of failing deep inside a run.

Example:
    >>> require("compare", "hf-zenflow compare")  # quiet when datasets, evaluate, matplotlib, psutil, tqdm import
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence


#: The modules of each extra, by their import names (here the same as their distribution names).
EXTRAS: dict[str, tuple[str, ...]] = {
    "compare": ("datasets", "evaluate", "matplotlib", "psutil", "tqdm"),
}


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the modules and the extra that brings them."""


def missing_modules(modules: Sequence[str]) -> list[str]:
    """The names in `modules` that do not import (an installed but broken module counts as missing).

    Example:
        >>> missing_modules(["json", "no_such_module"])
        ['no_such_module']
    """
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def require(extra: str, what: str, modules: Sequence[str] | None = None) -> None:
    """Raise `MissingExtraError` naming `extra` unless every module of it imports (or only `modules`, a subset).

    `what` is the feature that needs them, as the user called it (``"hf-zenflow compare"``).

    Example:
        >>> require("compare", "plotting", modules=["no_such_module"])
        Traceback (most recent call last):
        ...
        hf_zenflow._extras.MissingExtraError: plotting needs no_such_module: pip install 'hf_zenflow[compare]'
    """
    if extra not in EXTRAS:
        raise ValueError(f"extra={extra!r} is not an extra of hf_zenflow; allowed: {', '.join(sorted(EXTRAS))}")
    missing = missing_modules(EXTRAS[extra] if modules is None else modules)
    if missing:
        raise MissingExtraError(f"{what} needs {', '.join(missing)}: pip install 'hf_zenflow[{extra}]'")


__all__ = ["EXTRAS", "MissingExtraError", "missing_modules", "require"]
