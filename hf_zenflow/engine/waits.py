"""Bounded waits for the host worker (`bounded_wait`): every wait of the caller polls, says what it waits for after
`WAIT_WARN_S` (a warning, again each time the wait doubles) and gives up after `wait_limit_s()`
(``HF_ZENFLOW_HOST_WAIT_LIMIT_S``, default 1800 s) with `HostWorkerError` naming what it waited for, instead of hanging
on a job that can never finish.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable


logger = logging.getLogger("hf_zenflow")


class HostWorkerError(RuntimeError):
    """The host worker failed; raised in the training process at its next `step()`/`synchronize()`."""


#: How often a waiting caller wakes to check that the worker thread is still alive.
_POLL_S = 0.5
#: A caller still waiting for the host worker after this many seconds says so (a warning naming the job), and again
#: each time its wait doubles.
WAIT_WARN_S = 60.0
#: The default of `wait_limit_s`: far above any host step (seconds on the largest models), so only a job that can
#: never finish reaches it.
_WAIT_LIMIT_S = 1800.0


def wait_limit_s() -> float:
    """How long a caller waits for one host job before it raises (``HF_ZENFLOW_HOST_WAIT_LIMIT_S``, seconds)."""
    text = os.environ.get("HF_ZENFLOW_HOST_WAIT_LIMIT_S")
    if text is None:
        return _WAIT_LIMIT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"HF_ZENFLOW_HOST_WAIT_LIMIT_S={text!r} is invalid: allowed is a number of seconds > 0.")
    return value


def bounded_wait(done: Callable[[float], bool], what: str, alive: Callable[[], bool] | None = None,
              check: Callable[[], None] | None = None) -> None:
    """Call ``done(timeout)`` until it returns True; between polls raise the worker's failure (`check`), notice a
    dead thread (`alive`), warn after `WAIT_WARN_S` (and at each doubling) and give up after `wait_limit_s()`,
    naming `what` was waited for each time."""
    start, warn_at, limit = time.monotonic(), WAIT_WARN_S, wait_limit_s()
    while not done(_POLL_S):
        if check is not None:
            check()
        if alive is not None and not alive():
            raise HostWorkerError(f"the hf_zenflow host worker thread died while the caller waited for {what}")
        waited = time.monotonic() - start
        if waited >= limit:
            raise HostWorkerError(f"gave up waiting for {what} after {waited:.0f} s (HF_ZENFLOW_HOST_WAIT_LIMIT_S="
                                  f"{limit:g}): the host worker is stuck; its state is not usable any more")
        if waited >= warn_at:
            logger.warning("hf_zenflow: still waiting for %s after %.0f s (a host step takes seconds; it gives up "
                           "after HF_ZENFLOW_HOST_WAIT_LIMIT_S=%g s)", what, waited, limit)
            warn_at *= 2
