"""A guard for the test suite: our code (hf_zenflow/, tests/, scripts/) must not call deprecated third-party API.

A ``filterwarnings = error::FutureWarning:hf_zenflow`` entry would not do: the module it matches is the one the
warning is attributed to, and a deprecated transformers property (``is_gradient_checkpointing``) warns without a
stacklevel, i.e. from transformers itself. So the guard looks at who called: the frame the library's stacklevel
points to, or (stacklevel 1) the caller of the function that warned. Third-party code calling third-party deprecated
API (peft reading that property) is left alone, and so are the warnings our own code issues.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path


OUR_CODE = tuple(str(Path(__file__).resolve().parents[1] / folder) + os.sep
                 for folder in ("hf_zenflow", "tests", "scripts"))


class DeprecatedCallError(AssertionError):
    """Our code called something deprecated."""


def _blamed_caller(stacklevel: int) -> str | None:
    """`file:line` of our code that the warning being issued blames, else None."""
    issuer = sys._getframe(2)  # 0: here, 1: _guarded_warn, 2: the code that called warnings.warn
    if issuer.f_code.co_filename.startswith(OUR_CODE):
        return None  # a warning of our own
    caller = issuer
    for _ in range(stacklevel - 1 if stacklevel > 1 else 1):
        caller = caller.f_back if caller is not None else None
    if caller is not None and caller.f_code.co_filename.startswith(OUR_CODE):
        return f"{caller.f_code.co_filename}:{caller.f_lineno}"
    return None


_original_warn = warnings.warn


def _guarded_warn(message, category=None, stacklevel=1, *args, **kwargs):
    kind = category or (type(message) if isinstance(message, Warning) else UserWarning)
    if issubclass(kind, (DeprecationWarning, FutureWarning)):
        where = _blamed_caller(stacklevel)
        if where is not None:
            raise DeprecatedCallError(f"{where} calls a deprecated API: {kind.__name__}: {message}")
    return _original_warn(message, category, stacklevel + 1, *args, **kwargs)


@contextlib.contextmanager
def no_deprecated_calls_from_our_code() -> Iterator[None]:
    """Within: a `DeprecationWarning` / `FutureWarning` that blames our code raises `DeprecatedCallError` instead."""
    warnings.warn = _guarded_warn
    try:
        yield
    finally:
        warnings.warn = _original_warn
