"""A CPU double of an asynchronous CUDA device, for `CudaTransport` (`AsyncCopies` stands in for `CudaStreams`).

What CUDA does and a CPU device does not, modelled here:

- a copy on a side stream (device->host: gradients, window sums) completes later, on a background thread, after a
  random delay (seeded); until then its destination reads as poison (NaN), so a host reader that does not wait
  for the copy's event reads NaN and a reference test fails;
- the copies of one stream complete in order; an event recorded on a stream completes after everything enqueued
  on it before; `wait_stream`/`wait_event` order a stream after another stream's work;
- a copy on the compute stream (host->device: the write-back) is seen at once by later device work (stream order),
  but reads its host source only when it runs: a source written before then (the worker refilling a write-back
  buffer it did not wait for) poisons the destination;
- a source written between the copy's enqueue and its run gives a torn read: the destination is poisoned
  (a later copy into it, ordered after on the same stream, may legitimately replace it);
- page-locked blocks unlocked while a copy from or into them is still in flight are recorded as errors
  (`CheckedRegistrar`);
- with a `bandwidth`, a device->host copy takes its bytes over that bandwidth (the side stream's copies run one after
  another, so they lag a backward pass that produces gradients faster), and until it has run the copy keeps its
  source alive, as ``record_stream`` keeps a CUDA block allocated: `GradientBlocks` is the allocator's view of the
  gradients, each block held until the engine has let it go and its copy has read it.

Every wait is bounded (`WAIT_S`): a missing event completion fails a test instead of hanging it. Anything that
went wrong on a background thread is collected in `AsyncCopies.errors` for the test to assert on.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hf_zenflow.transport import CudaStreams, CudaTransport
from hf_zenflow.transport.link import counted_device_wait
from hf_zenflow.transport.pinned import HostRegistrar


#: The longest any wait on the double may take before it is reported as a hang.
WAIT_S = 30.0


class CopyRaceError(AssertionError):
    """The engine let the double's asynchronous copies race something (recorded in `AsyncCopies.errors`)."""


@torch.no_grad()
def poison(t: torch.Tensor) -> None:
    """What a buffer holds while a copy into it has not landed (or after a torn read)."""
    t.detach().fill_(float("nan") if t.is_floating_point() else -1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t`'s bytes (NaN compares equal to itself)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


class FakeEvent:
    """A CUDA event: completes when everything enqueued on the stream it was recorded on has run."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._stream: FakeStream | None = None
        self.reached_at: float | None = None  # when the stream reached it (perf_counter s): timing events

    def record(self, stream: FakeStream) -> None:
        self._stream = stream
        stream.enqueue(self._reached, delay=0.0)

    def _reached(self) -> None:
        self.reached_at = time.perf_counter()
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self, host: bool = True) -> None:
        """Wait until complete. `host`: a host thread waits (counted in `AsyncCopies.host_waits` when the event is
        not complete yet); False: a stream waits (`wait_event`), which on CUDA blocks no host thread."""
        stream = self._stream
        if stream is None or self._done.is_set():
            return  # (CUDA: an event never recorded is complete)
        if host:
            stream.backend.host_waits += 1
        # (a host thread's wait is device time, not host work, as `HostWaitEvent` counts it on CUDA)
        with counted_device_wait() if host else contextlib.nullcontext():
            if stream.backend.lazy:
                stream.run_until(self._done.is_set)
            if not self._done.wait(WAIT_S):
                raise CopyRaceError(f"an event did not complete within {WAIT_S} s (a stream waits on itself?)")


class FakeStream:
    """A CUDA stream: its operations run in order, each on a background thread after its delay. `compute`: the
    stream the CPU device's own work runs on, synchronously in the caller (so its `wait_event` blocks the caller,
    which is how later device work is ordered after the event)."""

    def __init__(self, backend: AsyncCopies, compute: bool) -> None:
        self.backend, self.compute = backend, compute
        self._lock = threading.Lock()
        self._last = threading.Event()
        self._last.set()
        self._pending: list[Callable[[], None]] = []  # (lazy backend) not run yet, in order
        self._running = threading.RLock()

    def run_until(self, done: Callable[[], bool]) -> None:
        """(Lazy backend) run this stream's pending operations, in order, until `done()` (or none is left)."""
        with self._running:
            while not done():
                with self._lock:
                    if not self._pending:
                        return
                    op = self._pending.pop(0)
                try:
                    op()
                except BaseException as exc:  # noqa: BLE001 - reported to the test through `errors`
                    self.backend.errors.append(exc)

    def enqueue(self, op: Callable[[], None], delay: float) -> None:
        if self.backend.lazy:
            with self._lock:
                self._pending.append(op)
            return
        with self._lock:
            before, done = self._last, threading.Event()
            self._last = done

        def run() -> None:
            try:
                if not before.wait(WAIT_S):
                    raise CopyRaceError("a stream operation waited too long for the one before it")
                if delay:
                    time.sleep(delay)
                op()
            except BaseException as exc:  # noqa: BLE001 - reported to the test through `errors`
                self.backend.errors.append(exc)
            finally:
                done.set()

        threading.Thread(target=run, name="async-device-stream", daemon=True).start()

    def wait_stream(self, other: FakeStream) -> None:
        if other is not self:
            event = FakeEvent()
            event.record(other)
            self.wait_event(event)

    def wait_event(self, event: FakeEvent) -> None:
        if self.compute:
            event.synchronize(host=False)
        else:
            self.enqueue(lambda: event.synchronize(host=False), delay=0.0)

    def synchronize(self, host: bool = True) -> None:
        event = FakeEvent()
        event.record(self)
        event.synchronize(host)


class AsyncCopies(CudaStreams):
    """`CudaStreams` on the CPU with copies that land late (see the module docstring). `seed` fixes the delays;
    most are under half a millisecond, one in three 1 to `max_delay_s`, so both orders of every race occur.

    `lazy`: for counting host waits deterministically, nothing runs by itself: a stream's operations run when
    something waits for them (an event's `synchronize`, a stream's `wait_event`, `sync_compute` for a host read of
    a device value), so a host wait that the schedule should have made unnecessary is always counted
    (`host_waits`)."""

    def __init__(self, seed: int = 0, max_delay_s: float = 0.004, lazy: bool = False,
                 bandwidth: float | None = None) -> None:
        self.lazy = lazy
        #: bytes per second of a device->host copy (None: the seeded random delays)
        self.bandwidth = bandwidth
        self.host_waits = 0
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        self.max_delay_s = max_delay_s
        self._compute: dict[torch.device, FakeStream] = {}
        self._side: list[FakeStream] = []
        self._local = threading.local()
        self._ids = itertools.count()
        self._in_flight: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.errors: list[BaseException] = []
        self.copies = 0
        self.torn_reads = 0

    def _delay(self) -> float:
        with self._rng_lock:
            if self._rng.random() < 2 / 3:
                return self._rng.uniform(0.0, 0.0005)
            return self._rng.uniform(0.001, self.max_delay_s)

    #: the class of the streams it makes
    stream_type: type[FakeStream] = FakeStream

    def side_stream(self, device: torch.device) -> FakeStream:
        stream = self.stream_type(self, compute=False)
        self._side.append(stream)
        return stream

    def current_stream(self, device: torch.device) -> FakeStream:
        return getattr(self._local, "stream", None) or self._compute.setdefault(
            torch.device(device), self.stream_type(self, compute=True))

    @contextlib.contextmanager
    def use(self, stream: FakeStream) -> Iterator[None]:
        before = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = before

    def event(self) -> FakeEvent:
        return FakeEvent()

    def timing_event(self) -> FakeEvent:
        return FakeEvent()

    def elapsed_ms(self, start: FakeEvent, end: FakeEvent) -> float | None:
        if not end.query():
            return None
        return (end.reached_at - start.reached_at) * 1e3

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        stream = self.current_stream(dst.device)
        # What the source holds now, to tell at run time whether it was written meanwhile (by contents: the
        # arena's buffers are views of one block, which share one version counter).
        before, key = _bits(src), next(self._ids)
        self._in_flight[key] = (dst, src)  # (also keeps the source alive until the copy ran: `record_stream`)
        self.copies += 1

        def torn() -> bool:
            if not torch.equal(_bits(src), before):
                self.torn_reads += 1
                poison(dst)
                return True
            return False

        if stream.compute:
            with torch.no_grad():
                dst.copy_(src)  # later work on this stream sees it at once...

            def read_source() -> None:  # ... but the source is read only now
                try:
                    if torn():
                        raise CopyRaceError(f"the source of a host->device copy {tuple(src.shape)} was written "
                                            "before the copy had read it")
                finally:
                    self._in_flight.pop(key, None)

            # (a host->device copy reads its source only after the device work queued before it: later still)
            stream.enqueue(read_source, 3 * self._delay())
        else:
            poison(dst)
            nbytes = src.numel() * src.element_size()

            def land() -> None:
                nonlocal src
                try:
                    if not torn():
                        with torch.no_grad():
                            dst.copy_(src)
                finally:
                    self._in_flight.pop(key, None)
                    src = None  # the source's block is free once the copy has run (before the stream's next event)

            stream.enqueue(land, self._delay() if self.bandwidth is None else nbytes / self.bandwidth)

    def keep_alive(self, t: torch.Tensor, stream: Any) -> None:
        """(`copy` holds the source until it has run.)"""

    def synchronize(self, device: torch.device) -> None:
        for stream in [*self._compute.values(), *self._side]:
            stream.synchronize(host=False)

    def sync_compute(self) -> None:
        """A host read of a device value (``.tolist()``, ``.item()``): everything on the compute streams has run."""
        for stream in list(self._compute.values()):
            stream.synchronize(host=False)

    def in_flight_on(self, ptr: int) -> bool:
        """Whether a copy from or into the block at `ptr` has not run yet."""
        return any(t.untyped_storage().data_ptr() == ptr
                   for pair in list(self._in_flight.values()) for t in pair)

    def check(self) -> None:
        """Raise the first error a background copy or the arena recorded."""
        if self.errors:
            raise self.errors[0]


class CheckedRegistrar(HostRegistrar):
    """Page-locking that only counts, and records an error when a block is unlocked under an in-flight copy."""

    def __init__(self, backend: AsyncCopies) -> None:
        super().__init__(cudart=object())  # (never called: registration is only counted here)
        self.backend = backend
        self.registered: set[int] = set()

    def register(self, ptr: int, nbytes: int) -> bool:
        self.registered.add(ptr)
        return True

    def unregister(self, ptr: int) -> bool:
        if self.backend.in_flight_on(ptr):
            self.backend.errors.append(CopyRaceError("a pinned block was unlocked while a copy from or into it "
                                                     "was in flight"))
        self.registered.discard(ptr)
        return True


def lazy_transports(monkeypatch: Any) -> list[AsyncCopies]:
    """From now on (until `monkeypatch` undoes it) every transport an optimizer makes is a `CudaTransport` over its
    own lazy double (`AsyncCopies(lazy=True)`: a copy runs only when something waits for it, as late as CUDA may run
    it); returns the doubles, in the order they are made."""
    backends: list[AsyncCopies] = []

    def make(device: torch.device) -> CudaTransport:
        backend = AsyncCopies(seed=len(backends), lazy=True)
        backends.append(backend)
        return CudaTransport(streams=backend, registrar=CheckedRegistrar(backend))

    monkeypatch.setattr("hf_zenflow.transport.transport_for", make)
    return backends


def async_transport(seed: int = 0, bandwidth: float | None = None) -> tuple[CudaTransport, AsyncCopies]:
    """`CudaTransport` (its own code: streams, events, the pinned arena) over the asynchronous CPU double; copies
    to the host at `bandwidth` bytes per second when given."""
    backend = AsyncCopies(seed, bandwidth=bandwidth)
    return CudaTransport(streams=backend, registrar=CheckedRegistrar(backend)), backend


@contextlib.contextmanager
def async_transports(monkeypatch: Any, first_seed: int = 0, bandwidth: float | None = None
                     ) -> Iterator[list[AsyncCopies]]:
    """Every transport the optimizers create meanwhile is a `CudaTransport` over its own `AsyncCopies` (seeds from
    `first_seed` on, copies at `bandwidth`); yields their doubles, then lets every copy run and raises what a
    background copy recorded (a torn read of an unlocked block, an event that never completed)."""
    backends: list[AsyncCopies] = []
    seeds = itertools.count(first_seed)

    def make(device: torch.device) -> CudaTransport:
        transport, backend = async_transport(next(seeds), bandwidth)
        backends.append(backend)
        return transport

    monkeypatch.setattr("hf_zenflow.transport.transport_for", make)
    yield backends
    for backend in backends:
        backend.synchronize(torch.device("cpu"))
        backend.check()


class GradientBlocks:
    """The device allocator's view of the gradients of `params`: a gradient's block is allocated when backward
    produces it (seen by a post-accumulate-grad hook registered before the optimizer's) and released when its
    storage is (``p.grad`` set to None and nothing else holding it: the double's copy keeps its source until it has
    run). `peak_bytes`: the most gradient bytes allocated at once."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, int] = {}
        self.bytes = self.peak_bytes = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._produced) for p in params if p.requires_grad]

    def _produced(self, p: torch.Tensor) -> None:
        storage = p.grad.untyped_storage()
        key = id(storage)
        with self._lock:
            if key in self._live:
                return
            self._live[key] = storage.nbytes()
            self.bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.bytes)
        weakref.finalize(storage, self._released, key)  # (a storage's Python object lives as long as the block)

    def _released(self, key: int) -> None:
        with self._lock:
            self.bytes -= self._live.pop(key)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
