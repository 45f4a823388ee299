"""Where generations run: long-lived threads whose OpenMP team is sized once, and one team per generation.

Why: torch's CPU kernels run their
parallel regions on OpenMP, and torch's bundled GNU OpenMP (libgomp) keeps one team of worker threads per
thread that ever opened a region. libgomp counts the threads of every team in the process, and while that
count exceeds the CPUs it stops spin-waiting between regions (100 spins instead of 300,000) and puts every
team thread to sleep on a futex after each region, for every team, the main thread's included. A decode step
opens 30 regions on SmolLM2-135M (attention) and ~216 with the sparse kernel, so each then pays a sleep and a
wake-up. That is what made a generation in a worker thread slower than the same generation in the main thread:
the thread that loaded the model kept its team while a worker started a second one (2 + 1 threads on 2 CPUs).

So the thread that loads an engine releases its team when it hands the engine over (`release_openmp_team`),
and generations run on `GenerationThreads`: long-lived threads, each configured at start with its share of
the cores (`set_thread_intra_op_threads`: that thread's OpenMP and MKL thread counts, kept even when other threads
are set to other counts before its first parallel region), so the process holds at most as many OpenMP threads as
the configuration says, and a team is not rebuilt per request.
"""

from __future__ import annotations

import contextvars
import ctypes
import functools
import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch

logger = logging.getLogger("prunewatch.engine")

T = TypeVar("T")

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t omp_pause_soft (OpenMP 5.0)
_OPENMP_RUNTIMES = ("libgomp", "libiomp5", "libomp")  # GNU (torch's Linux wheels), Intel, LLVM


@functools.cache
def openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch's kernels run on, as loaded in this process (None: not found, or not Linux).

    Found among the libraries mapped into this process, so it is the very instance torch uses (a wheel bundles
    its own libgomp; loading another copy by name would configure a runtime no kernel runs on)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if len(line.split()) >= 6}
    except OSError:
        return None
    for name in _OPENMP_RUNTIMES:
        for path in sorted(p for p in paths if os.path.basename(p).startswith(name + ".so")):
            try:
                runtime = ctypes.CDLL(path)
            except OSError:
                continue
            if hasattr(runtime, "omp_pause_resource_all"):
                return runtime
    return None


def release_openmp_team() -> bool:
    """Free the calling thread's OpenMP team (OpenMP 5.0 `omp_pause_resource_all(omp_pause_soft)`).

    Call it on the thread that loaded and calibrated an engine, once generations move to `GenerationThreads`:
    libgomp then counts only the generation threads' teams and keeps spin-waiting. The calling thread gets a new
    team if it opens a parallel region again. True when the runtime released it; False (and nothing changes)
    without a runtime that implements it."""
    runtime = openmp_runtime()
    if runtime is None:
        logger.debug("no OpenMP runtime with omp_pause_resource_all in this process: nothing to release")
        return False
    runtime.omp_pause_resource_all.restype = ctypes.c_int
    return runtime.omp_pause_resource_all(ctypes.c_int(_OMP_PAUSE_SOFT)) == 0


def default_threads(workers: int = 1) -> int:
    """Each of `workers` concurrent generations' share of torch's intra-op threads (the cores, unless set), >= 1."""
    return max(1, torch.get_num_threads() // max(1, workers))


def set_thread_intra_op_threads(count: int) -> None:
    """Give the calling thread `count` intra-op threads, for good.

    Why not `torch.set_num_threads` alone: torch sizes a thread's OpenMP team lazily, at that thread's first
    parallel region or thread-count query, from the count the process last set on *any* thread. A thread set to 2
    that reaches its first region after another thread was set to 1 silently runs with 1 (a batcher's stepper
    whose requests' threads start with one each, for instance). Querying first does that lazy sizing now, so the
    count set after it is the one this thread keeps."""
    if count < 1:
        raise ValueError(f"threads must be >= 1, got {count}")
    torch.get_num_threads()  # torch's per-thread lazy initialisation, done before the count is set
    torch.set_num_threads(count)  # this thread's OpenMP and MKL thread counts


def _name_os_thread(name: str) -> None:
    """Give the calling thread `name` in the OS (Linux: what `top -H` and /proc show; 15 bytes). The OpenMP
    threads it starts inherit the name, so a generation thread's team is visible as such."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def start_generation_thread(target: Callable[[], None], threads: int | None = None, *,
                            name: str = "prunewatch-step") -> threading.Thread:
    """Run `target` on a new daemon thread configured as a generation thread (`threads` intra-op threads, default
    torch's; the OS thread named): for a loop that lives as long as the process, which a pool would wait for at
    exit."""
    count = threads if threads is not None else default_threads(1)
    if count < 1:
        raise ValueError(f"threads must be >= 1, got {count}")

    def run() -> None:
        set_thread_intra_op_threads(count)
        _name_os_thread(name.replace("prunewatch-", "pw-"))
        logger.debug("%s started with %d intra-op threads", name, count)
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


class GenerationThreads:
    """`workers` long-lived threads that run generations, each with `threads` intra-op threads set at its start.

    One worker serialises generations, which is fastest on a CPU; more share the cores (`default_threads`).
    Work submitted runs in a copy of the submitter's context (the engine keeps a request's plan and ledger in
    context variables)."""

    def __init__(self, workers: int = 1, threads: int | None = None, *, name: str = "prunewatch-generate") -> None:
        if workers < 1 or (threads is not None and threads < 1):
            raise ValueError(f"workers and threads must be >= 1, got workers={workers}, threads={threads}")
        self.workers = workers
        self.threads = threads if threads is not None else default_threads(workers)
        self.name = name
        self._idents: set[int] = set()
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name,
                                            initializer=self._configure)

    def _configure(self) -> None:
        """Runs once on each worker as it starts, before any generation."""
        set_thread_intra_op_threads(self.threads)
        _name_os_thread(threading.current_thread().name.replace("prunewatch-", "pw-"))
        with self._lock:
            self._idents.add(threading.get_ident())
        logger.debug("%s started with %d intra-op threads", threading.current_thread().name, self.threads)

    def on_worker(self) -> bool:
        """Whether the calling thread is one of these workers."""
        return threading.get_ident() in self._idents

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Run `fn(*args, **kwargs)` on a worker, in a copy of the caller's context; RuntimeError once shut down."""
        context = contextvars.copy_context()
        return self._executor.submit(context.run, fn, *args, **kwargs)

    def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on a worker, waiting for it (directly when already on one)."""
        if self.on_worker():
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    def shutdown(self, wait: bool = False) -> None:
        """Stop taking work; work not yet started is dropped."""
        self._executor.shutdown(wait=wait, cancel_futures=True)
