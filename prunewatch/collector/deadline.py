"""Run a probe with a deadline: stop waiting when it passes, and never record the late answer.

Python cannot kill a thread, so the probe runs in a worker thread and the caller waits at most
`timeout_s`. When the deadline passes the call is marked abandoned *under a lock* and the probe's
cancel event is set: a cooperative target (the in-process engine checks it between tokens) stops
its work, and whatever the worker produces afterwards is dropped, so the timeout failure is the
only record of that probe.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from prunewatch.collector.targets import ProbeTimeoutError

T = TypeVar("T")
logger = logging.getLogger("prunewatch.collector")


class _Call(Generic[T]):
    def __init__(self, fn: Callable[[threading.Event], T], label: str) -> None:
        self.fn = fn
        self.label = label
        self.cancel = threading.Event()
        self.finished = threading.Event()
        self.lock = threading.Lock()
        self.abandoned = False
        self.late_results_dropped = 0
        self.value: T | None = None
        self.error: BaseException | None = None

    def work(self) -> None:
        value: T | None = None
        error: BaseException | None = None
        try:
            value = self.fn(self.cancel)
        except BaseException as exc:  # handed to the waiting caller
            error = exc
        with self.lock:
            if self.abandoned:
                self.late_results_dropped += 1
                logger.info("%s finished after its deadline; its late %s is dropped", self.label,
                            "error" if error is not None else "result")
                return
            self.value, self.error = value, error
            self.finished.set()


class DeadlineExceeded(ProbeTimeoutError):
    """The deadline passed; `worker` is the thread still winding down (join it before reusing a target)."""

    def __init__(self, message: str, worker: threading.Thread) -> None:
        super().__init__(message)
        self.worker = worker


def call_with_deadline(fn: Callable[[threading.Event], T], timeout_s: float, *, label: str = "probe") -> T:
    """`fn(cancel)` in a worker thread; its value, its exception, or DeadlineExceeded after timeout_s."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    call: _Call[T] = _Call(fn, label)
    worker = threading.Thread(target=call.work, name=f"prunewatch-{label}", daemon=True)
    worker.start()
    if not call.finished.wait(timeout_s):
        with call.lock:
            if not call.finished.is_set():
                call.abandoned = True
                call.cancel.set()
                raise DeadlineExceeded(f"{label} overran its {timeout_s:g}s timeout and was cancelled", worker)
    if call.error is not None:
        raise call.error
    return call.value  # type: ignore[return-value]
