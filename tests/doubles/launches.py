"""Counting the device work a step would launch on CUDA, on the CPU double of an asynchronous device
(`async_device.py`): every torch operator the optimizer runs on the training thread (its backward hooks and its
`step()`), seen at torch's dispatcher, plus the copies, event records and stream waits the transport enqueues.

On CUDA each counted operator is at least one kernel launch (a few are two: ``_foreach_norm``, a reduction with a
cleanup pass); a copy, an event record and a stream wait are one stream operation each. Not counted: views and
metadata (no device work), allocations (counted apart: the caching allocator serves them without a launch), the
model's own forward and backward, and the host worker's thread. The CPU device cannot tell a device tensor from a
host one, so an operator on host memory made by the training thread counts too (an upper bound; an ordinary step
makes none).

The engine takes CPU-only shortcuts where the device is the CPU: `CUDA_LIKE` runs the paths a CUDA device takes
instead (no C kernels for the device side; the device's score pieces), so that what is counted is CUDA's dispatch.

    with launches_counted(model, opt) as calls:
        ...
    calls.launches, calls.allocations, calls.by_op
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .async_device import AsyncCopies, FakeEvent, FakeStream


#: Operators that allocate (no launch: the caching allocator serves them).
ALLOCATING = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"}
#: Operators without device work besides views (`OpOverload.is_view`): metadata, storage swaps, stream bookkeeping.
NO_WORK = {"detach", "alias", "_record_function_enter_new", "_record_function_exit", "lift_fresh", "set_",
           "record_stream", "is_pinned", "_local_scalar_dense", "is_same_size", "is_nonzero", "sym_size", "sym_stride",
           "sym_numel", "sym_storage_offset", "equal"}


class DeviceCalls(TorchDispatchMode):
    """Counts operators by kind while active (see the module docstring). `paused` (thread-local): inside the
    double's own bookkeeping, whose tensor work is no device work of CUDA's."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()
        self.launches = 0
        self.allocations = 0
        self._local = threading.local()

    @property
    def paused(self) -> bool:
        return getattr(self._local, "paused", False)

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        before, self._local.paused = self.paused, True
        try:
            yield
        finally:
            self._local.paused = before

    def stream_op(self, name: str) -> None:
        """A copy, event record or stream wait enqueued by the transport: one stream operation on CUDA."""
        if not self.paused:
            self.by_op[name] += 1
            self.launches += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if not self.paused:
            name = func.overloadpacket.__name__
            if name in ALLOCATING:
                self.allocations += 1
            elif not (func.is_view or name in NO_WORK):
                self.by_op[name] += 1
                self.launches += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Count on this thread inside (once: a nested use changes nothing)."""
        if getattr(self._local, "active", False):
            yield
            return
        self._local.active = True
        try:
            with self:
                yield
        finally:
            self._local.active = False

    def snapshot(self) -> tuple[int, int, Counter[str]]:
        return self.launches, self.allocations, Counter(self.by_op)


class _CountedEvent(FakeEvent):
    def __init__(self, calls: DeviceCalls) -> None:
        super().__init__()
        self.calls = calls

    def record(self, stream: FakeStream) -> None:
        self.calls.stream_op("event.record")
        super().record(stream)


class _CountedStream(FakeStream):
    backend: CountingCopies  # (the streams' backend: `CountingCopies.stream_type`)

    def wait_stream(self, other: FakeStream) -> None:
        self.backend.calls.stream_op("stream.wait_stream")
        with self.backend.calls.pause():
            super().wait_stream(other)

    def wait_event(self, event: FakeEvent) -> None:
        self.backend.calls.stream_op("stream.wait_event")
        super().wait_event(event)


class CountingCopies(AsyncCopies):
    """The asynchronous double, each copy, event record and stream wait it is asked for counted once by `calls`
    (and its own tensor work, which stands in for CUDA's, not counted)."""

    stream_type = _CountedStream

    def __init__(self, calls: DeviceCalls, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls = calls
        self.events = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.calls.stream_op("stream.copy")
        with self.calls.pause():
            super().copy(dst, src)

    def event(self) -> FakeEvent:
        self.events += 1
        return _CountedEvent(self.calls)


#: The engine's choices by device type that `CUDA_LIKE` makes as for a CUDA device: (module, function of a device).
BY_DEVICE = (("hf_zenflow.engine.selection", "score_chunk_elems"), ("hf_zenflow.engine.host", "bf16_sum_piece_elems"),
             ("hf_zenflow.engine.host", "widens_before_add"))


@contextlib.contextmanager
def CUDA_LIKE() -> Iterator[None]:  # noqa: N802 - reads as a setting
    """Run the device-side paths a CUDA device takes where the engine has CPU-only ones (see the module docstring):
    no C kernels (``HF_ZENFLOW_NATIVE=0``; the host worker then runs torch's code too) and the piece sizes of a
    CUDA device (`BY_DEVICE`; where a module lacks the function, nothing is changed)."""
    import importlib

    before = os.environ.get("HF_ZENFLOW_NATIVE")
    os.environ["HF_ZENFLOW_NATIVE"] = "0"
    patched = []
    for module_name, name in BY_DEVICE:
        module = importlib.import_module(module_name)
        choose = getattr(module, name, None)
        if choose is not None:
            setattr(module, name, lambda device, choose=choose: choose(torch.device("cuda")))
            patched.append((module, name, choose))
    try:
        yield
    finally:
        for module, name, choose in patched:
            setattr(module, name, choose)
        if before is None:
            os.environ.pop("HF_ZENFLOW_NATIVE", None)
        else:
            os.environ["HF_ZENFLOW_NATIVE"] = before


@contextlib.contextmanager
def counted_hooks(calls: DeviceCalls) -> Iterator[None]:
    """Count what the optimizer's backward hooks run (`GradientReads._read`), on whichever thread runs them."""
    from hf_zenflow.engine.gradients import GradientReads

    original = GradientReads._read

    @functools.wraps(original)
    def read(self: GradientReads, p: torch.Tensor) -> None:
        with calls.active():
            original(self, p)

    GradientReads._read = read  # type: ignore[method-assign]
    try:
        yield
    finally:
        GradientReads._read = original  # type: ignore[method-assign]


def counting_transport(calls: DeviceCalls, backends: list[CountingCopies]) -> Any:
    """A `transport_for` that gives every device a `CudaTransport` over a `CountingCopies` double."""
    from hf_zenflow.transport import CudaTransport

    from .async_device import CheckedRegistrar

    def make(device: torch.device) -> CudaTransport:
        backends.append(CountingCopies(calls, seed=0, max_delay_s=0.0005))
        return CudaTransport(streams=backends[-1], registrar=CheckedRegistrar(backends[-1]))

    return make
