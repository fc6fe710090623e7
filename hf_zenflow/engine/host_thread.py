"""`HostThread`: one dedicated OS thread that runs host math with its own intra-op thread count, for a caller that
waits for it (`SyncOffloadAdamW`'s synchronous host step).

torch's intra-op thread count is per OS thread: running the host AdamW on its own thread with ``cpu_threads``
threads leaves the training thread's pool untouched (no resize of its OpenMP team every step), and puts the host
step on the same H cores as ZenFlow's host worker. The caller blocks until the job is done, so the schedule stays
synchronous and the arithmetic is the same as inline.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar


T = TypeVar("T")

_started: weakref.WeakSet[HostThread] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    """Stop every host thread before the interpreter finalizes. A job is in flight at exit only when its caller
    was interrupted (Ctrl-C) while waiting for it; a daemon thread returning from a torch op during finalization
    would abort the process ("terminate called without an active exception"), so the job is waited for."""
    for host_thread in list(_started):
        host_thread.close()


class HostThread:
    """Runs ``fn()`` on a daemon thread with `threads` intra-op threads and returns its result (or raises its
    exception) in the caller. Started on the first `run`; `close` stops it.

    Example:
        >>> t = HostThread(threads=1)
        >>> t.run(lambda: 6 * 7)
        42
        >>> t.close()
    """

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._jobs: queue.Queue[tuple[Callable[[], Any], queue.Queue[tuple[bool, Any]]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        import torch

        torch.set_num_threads(self.threads)  # this OS thread's pool only
        while True:
            item = self._jobs.get()
            if item is None:
                return
            fn, reply = item
            try:
                reply.put((True, fn()))
            except BaseException as exc:  # carried into the caller, which re-raises it
                reply.put((False, exc))

    def run(self, fn: Callable[[], T]) -> T:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="hf_zenflow-sync-host", daemon=True)
            _started.add(self)
            self._thread.start()
        reply: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=1)
        self._jobs.put((fn, reply))
        # Sync point: the caller waits for the whole host step (the synchronous schedule); the poll notices a dead
        # thread instead of hanging.
        while True:
            try:
                ok, value = reply.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("the hf_zenflow synchronous host thread died") from None
        if not ok:
            raise value
        return value

    def close(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive():
            self._jobs.put(None)
            if thread is not threading.current_thread():  # a finalizer may run on the host thread itself
                thread.join()
