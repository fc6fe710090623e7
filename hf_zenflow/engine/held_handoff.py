"""The window's last gradients go straight into its host AdamW job: `HeldHandOff`.

Each step's gradients are handed to the host worker (`windows.HostWindows.finish_hand_off`), but the job that adds
them into the window sums is held until the step knows whether it closes the window. A step that does not close it
submits that accumulation job (`submit`); a step that closes it submits one host AdamW job that reads those
gradients itself (`submit_close`, then `host.host_adamw_window` sums, divides and updates in one pass over the host
state instead of an accumulation pass and an AdamW pass). The worker runs the same work in the same order either
way, and between steps nothing is held: a checkpoint's open-window sum means what it always meant.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from ..transport.link import Landed
from .host import HostMatrix, host_adamw_window


if TYPE_CHECKING:
    from .handoff import HandOff
    from .worker import HostAdamWorker


class HeldHandOff:
    """This step's hand-off (its slot, gradients and clip coefficient), not submitted yet."""

    def __init__(self) -> None:
        self.held: tuple[HandOff, float | None] | None = None
        self._factor: float | None = None  # the inverse scale on the held hand-off's `scaled` copies

    def hold(self, started: HandOff, coef: float | None, factor: float | None = None) -> None:
        """Hold `started` with its clip coefficient `coef`; `factor`: the inverse scale still on its `scaled`
        copies (they are added times ``coef * factor``)."""
        self.held, self._factor = (started, coef), factor

    def _scaled(self, started: HandOff, coef: float | None) -> tuple[list, float | None]:
        """The hand-off's copies made before a GradScaler's unscale_, and the multiplier they are added with."""
        factor = self._factor
        if not started.scaled:
            return [], None
        assert factor is not None, "copies made before unscale_ need the inverse scale"
        return started.scaled, factor if coef is None else coef * factor

    def submit(self) -> None:
        """Submit the job that adds the held gradients into the window sums (nothing when none is held)."""
        held, self.held = self.held, None
        if held is None:
            return
        started, coef = held
        sources, landed = started.sources, started.landed
        scaled, scaled_coef = self._scaled(started, coef)

        def accumulate() -> None:
            try:
                landed.wait()  # Sync point (worker waits on the device): the gradients have landed on the host
                HostMatrix.accumulate_all(sources, coef)
                if scaled:
                    HostMatrix.accumulate_all(scaled, scaled_coef)
            finally:
                sources.clear()  # the gradients' memory goes now, not when the worker's next job replaces this one
                scaled.clear()

        started.grant.submit("accumulate", accumulate)  # the job returns the slot when it has run
        started.done = True  # (interrupted before this line, `abandon` returns it and the job skips)

    def submit_close(self, worker: HostAdamWorker, work: list[tuple[dict, list[HostMatrix]]],
                     sums_landed: Landed | None, window_step: Callable[..., None] = host_adamw_window) -> Future:
        """Submit the window's host AdamW job (`window_step`), with the held gradients (if any) folded into it."""
        held = self.held
        last, last_landed, coef = (held[0].sources, held[0].landed, held[1]) if held else ([], None, None)
        scaled, scaled_coef = self._scaled(held[0], coef) if held else ([], None)

        def host_step() -> None:
            try:
                if sums_landed is not None:
                    sums_landed.wait()  # Sync point (worker waits on the device): the window's sums are on the host
                if last_landed is not None:
                    last_landed.wait()  # Sync point (worker waits on the device): the last gradients have landed
                if scaled:  # (added first, with their multiplier; the window's pass then reads them from the sums)
                    HostMatrix.accumulate_all(scaled, scaled_coef)
                if last:
                    window_step(work, last, coef)
                else:
                    window_step(work)
            finally:
                last.clear()  # the gradients' memory goes now
                scaled.clear()

        if held is None:
            return worker.submit("host_adamw", host_step)
        future = held[0].grant.submit("host_adamw", host_step)  # (the job returns the hand-off slot)
        held[0].done, self.held = True, None
        return future

    def abandon(self, abandon_hand_off: Callable[[HandOff], None]) -> None:
        """The step failed after its hand-off: the held gradients are dropped and the slot goes back."""
        held, self.held = self.held, None
        if held is not None and not held[0].done:
            abandon_hand_off(held[0])
