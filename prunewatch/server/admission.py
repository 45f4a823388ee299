"""Bounded admission and the bridge from the engine's blocking generator to asyncio.

Why: CPU inference is fastest serialised, and the event loop must never run a forward pass, so
generations run on a small pool of long-lived generation threads (prunewatch.engine.threads.GenerationThreads:
each configured at start with its share of the cores, so the process keeps one OpenMP team per worker and
libgomp keeps spin-waiting; a second team, such as the loading thread's, makes every decode step sleep and
wake its team at each parallel region). The queue bound counts requests admitted and not yet
finished, waiting plus running; past it a request is refused at once (429 + Retry-After) instead
of waiting unboundedly and timing out in the client.

Each generation runs start to finish in one worker job, inside its own copy of the context: the
engine keeps a request's execution plan and FLOP ledger in a ContextVar, so two requests on two
workers, or one after the other on the same worker, never see each other's plan or counts.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from typing import Generic, TypeVar

from prunewatch.engine.threads import GenerationThreads

T = TypeVar("T")

_DONE = object()
_EWMA_WEIGHT = 0.2  # recent generations dominate the service-time estimate behind Retry-After
_MAX_RETRY_AFTER_S = 60


class QueueFullError(Exception):
    """No room: `depth` requests are already waiting or running."""

    def __init__(self, depth: int, retry_after_s: int) -> None:
        super().__init__(
            f"The server's request queue is full ({depth} requests waiting or running); "
            f"retry after {retry_after_s} s."
        )
        self.depth = depth
        self.retry_after_s = retry_after_s


class Slot:
    """One admitted request's place in the queue; released exactly once, when its work ends."""

    def __init__(self, queue: AdmissionQueue) -> None:
        self._queue = queue
        self._released = False
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        self._queue._release()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class GenerationJob(Generic[T]):
    """A blocking iterator run on a worker; its items are read here with `async for`.

    The job is submitted at construction, so its slot is released when the work ends even if no
    one ever reads the items. Leaving `items()` early (client gone) asks the worker to stop at the
    next item.
    """

    def __init__(self, queue: AdmissionQueue, slot: Slot, make_iterator: Callable[[], Iterator[T]]) -> None:
        self._loop = asyncio.get_running_loop()
        self._items: asyncio.Queue[object] = asyncio.Queue()
        self._cancel = threading.Event()
        self._make_iterator = make_iterator
        self._admitted_at = time.perf_counter()
        self._queue = queue
        self._slot = slot
        self.queue_ms = 0.0  # admitted -> a worker picked it up; written by the worker before any item
        try:  # in a copy of this context (GenerationThreads.submit)
            self.future: Future[None] = queue.threads.submit(self._work)
        except RuntimeError:  # the pool is shut down: the server is stopping
            slot.release()
            raise
        # A job dropped before it ran (the pool shut down) releases here; one that ran released in _work.
        self.future.add_done_callback(lambda _: slot.release())

    def _put(self, item: object) -> None:
        try:
            self._loop.call_soon_threadsafe(self._items.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            self._cancel.set()

    def _work(self) -> None:
        started = time.perf_counter()
        self.queue_ms = round((started - self._admitted_at) * 1000.0, 3)
        iterator: Iterator[T] | None = None
        try:
            if self._cancel.is_set():
                return
            iterator = self._make_iterator()
            for item in iterator:
                self._put(item)
                if self._cancel.is_set():
                    break
        except Exception as exc:  # handed to the reader, which raises it in the request's task
            self._put(_Failed(exc))
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()
            self._queue._observe_service(time.perf_counter() - started)
            # Release before the reader can see the end: a response sent on _DONE must find the slot
            # free, or a client that reads the queue gauge right after its answer sees its own request.
            self._slot.release()
            self._put(_DONE)

    def cancel(self) -> None:
        self._cancel.set()

    async def items(self) -> AsyncIterator[T]:
        try:
            while True:
                item = await self._items.get()
                if item is _DONE:
                    return
                if isinstance(item, _Failed):
                    raise item.error
                yield item  # type: ignore[misc]
        finally:
            self._cancel.set()


class AdmissionQueue:
    """At most `depth` requests admitted at once; `workers` of them generate at the same time, each on a
    generation thread with `threads` intra-op threads (None: its share of the cores)."""

    def __init__(self, depth: int, workers: int = 1, on_change: Callable[[int], None] | None = None,
                 threads: int | None = None) -> None:
        if depth < 1 or workers < 1:
            raise ValueError(f"depth and workers must be >= 1, got depth={depth}, workers={workers}")
        self.depth = depth
        self.workers = workers
        self.threads = GenerationThreads(workers, threads)
        self._lock = threading.Lock()
        self._in_flight = 0
        self._service_s: float | None = None
        self._on_change = on_change

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def retry_after_s(self) -> int:
        """Seconds for the admitted requests to drain at the recent service rate (1 before any finished)."""
        if self._service_s is None:
            return 1
        estimate = self._service_s * self._in_flight / self.workers
        return max(1, min(_MAX_RETRY_AFTER_S, math.ceil(estimate)))

    def admit(self, count: int = 1) -> list[Slot]:
        """`count` slots, all or none; raises QueueFullError when they do not fit."""
        with self._lock:
            if self._in_flight + count > self.depth:
                raise QueueFullError(self.depth, self.retry_after_s())
            self._in_flight += count
            in_flight = self._in_flight
        self._changed(in_flight)
        return [Slot(self) for _ in range(count)]

    def start(self, slot: Slot, make_iterator: Callable[[], Iterator[T]]) -> GenerationJob[T]:
        """Run `make_iterator()` to exhaustion on a worker; call from the event loop."""
        return GenerationJob(self, slot, make_iterator)

    def _release(self) -> None:
        with self._lock:
            self._in_flight -= 1
            in_flight = self._in_flight
        self._changed(in_flight)

    def _changed(self, in_flight: int) -> None:
        if self._on_change is not None:
            self._on_change(in_flight)

    def _observe_service(self, seconds: float) -> None:
        with self._lock:
            if self._service_s is None:
                self._service_s = seconds
            else:
                self._service_s += _EWMA_WEIGHT * (seconds - self._service_s)

    def close(self) -> None:
        """Stop taking work; jobs not yet started are dropped (their slots released)."""
        self.threads.shutdown(wait=False)
