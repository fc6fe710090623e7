"""The emulated hardware: a device clock whose compute is a timed wait, a host<->device link that paces real copies
to its bandwidth and the copy engine that runs them beside the caller, and the scaled-down model the real host code
runs on."""

from __future__ import annotations

import queue
import threading
import time

import torch


class PacedLink:
    """A host<->device link: a real memory copy of `nbytes`, then a wait for the rest of nbytes / bandwidth.

    `bytes_per_s` is the real-time bandwidth (already divided by the time-compression factor).
    """

    def __init__(self, capacity_bytes: int, bytes_per_s: float) -> None:
        self.bytes_per_s = float(bytes_per_s)
        n = max(1, int(capacity_bytes))
        self._src = torch.ones(n, dtype=torch.uint8)
        self._dst = torch.empty(n, dtype=torch.uint8)
        self._dst.zero_()  # touch the pages now: a first-touch page fault is not link time
        self.copies = 0
        self.copy_s = 0.0  # time spent in real copies
        self.total_s = 0.0  # time including the pacing wait

    def target_s(self, nbytes: int) -> float:
        return nbytes / self.bytes_per_s if self.bytes_per_s > 0 else 0.0

    def copy(self, nbytes: int, already_spent_s: float = 0.0) -> float:
        """Move `nbytes` (real copy, chunked through the buffer), pace to the bandwidth; returns seconds taken.

        `already_spent_s`: time the caller already spent copying these bytes itself (the optimizer's own host copy);
        then no further copy is made and only the rest of the pacing wait is slept.
        """
        start = time.perf_counter()
        if already_spent_s <= 0 and nbytes > 0:
            left = int(nbytes)
            cap = self._src.numel()
            while left > 0:
                n = min(left, cap)
                self._dst[:n].copy_(self._src[:n])
                left -= n
        copied = time.perf_counter() - start + max(0.0, already_spent_s)
        rest = self.target_s(nbytes) - copied
        if rest > 0:
            time.sleep(rest)
        took = time.perf_counter() - start + max(0.0, already_spent_s)
        self.copies += 1
        self.copy_s += copied
        self.total_s += took
        return took


class CopyEngine:
    """One DMA channel on its own thread: copies run one after another, overlapping whatever the caller does."""

    def __init__(self, link: PacedLink) -> None:
        self.link = link
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._last: threading.Event | None = None
        self._thread = threading.Thread(target=self._run, name="emulated-copy-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        torch.set_num_threads(1)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            nbytes, done = job
            self.link.copy(nbytes)
            done.set()

    def start(self, nbytes: int) -> tuple[threading.Event, float]:
        """Enqueue a copy; returns its completion event and how long the caller waited for the channel."""
        waited = 0.0
        if self._last is not None and not self._last.is_set():
            t0 = time.perf_counter()
            self._last.wait()  # the channel is still busy with the previous step's copy: a link stall
            waited = time.perf_counter() - t0
        done = threading.Event()
        self._last = done
        self._jobs.put((nbytes, done))
        return done, waited

    def drain(self) -> None:
        if self._last is not None:
            self._last.wait()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(5)


class DeviceClock:
    """The device timeline: compute is a sleep of the modelled time, compressed by `scale`."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def seconds(self, full_ms: float) -> float:
        """Real seconds standing for `full_ms` of full-scale device time."""
        return full_ms / self.scale / 1e3

    def compute(self, full_ms: float) -> None:
        want = self.seconds(full_ms)
        if want > 0:
            time.sleep(want)


# ---------------------------------------------------------------------------------------------------------------------
# The scaled-down model
# ---------------------------------------------------------------------------------------------------------------------
def emulated_model(n_params: float, seed: int = 0) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    """Llama-shaped bf16 matrices (q, k, v, o, gate, up, down and two norms per layer) totalling about `n_params`,
    and one fixed bf16 gradient per parameter whose energy sits on ~5% of the input columns (the skew ZenFlow's
    selection relies on, as in the ZenFlow paper)."""
    hidden = 1024 if n_params >= 8e6 else 256
    inter = int(hidden * 2.75)
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    layers = max(1, round(n_params / per_layer))
    gen = torch.Generator().manual_seed(seed)
    shapes: list[tuple[int, ...]] = []
    for _ in range(layers):
        shapes += [(hidden, hidden)] * 4 + [(inter, hidden), (inter, hidden), (hidden, inter), (hidden,), (hidden,)]
    params, grads = [], []
    for shape in shapes:
        p = torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16))
        g = torch.randn(shape, generator=gen) * 1e-3
        if len(shape) == 2:
            hot = torch.rand(shape[1], generator=gen) < 0.05
            g[:, hot] *= 10.0
        params.append(p)
        grads.append(g.to(torch.bfloat16))
    return params, grads


def set_grads(params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> None:
    for p, g in zip(params, grads):
        p.grad = g  # the same tensors every step: the optimizers only read them


def offloaded_grad_bytes(params: list[torch.nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in params if p.ndim >= 2)

