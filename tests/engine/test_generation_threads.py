"""Where generations run and how their threads are configured (prunewatch/engine/threads.py), never a timing.

The served path was slow because the thread that loaded the model kept its OpenMP team while a worker started a
second one: more OpenMP threads than cores, and GNU OpenMP then sleeps and wakes its threads at every parallel
region. These tests hold the configuration that avoids it: generation threads are long-lived and start with
their intra-op thread count, their OpenMP team has that many threads, a released thread keeps no team, and the
server, `serve`'s loader and the collector's in-process target each put the work where it belongs.
"""

from __future__ import annotations

import contextvars
import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from prunewatch.collector.in_process import InProcessTarget
from prunewatch.engine.sparse import sparse_linear
from prunewatch.engine.threads import (
    GenerationThreads,
    _name_os_thread,
    openmp_runtime,
    release_openmp_team,
    start_generation_thread,
)
from prunewatch.probes import Probe
from prunewatch.server import ServerSettings, create_app
from prunewatch.server.run import build_engine, serve_in_background
from tests.engine.test_server_properties import FakeEngine

# The OS names of threads (and the inheritance of a thread's name by the OpenMP threads it starts) are how the
# tests see a team; both are Linux facts, and releasing a team needs an OpenMP 5.0 runtime (torch's libgomp).
linux_openmp = pytest.mark.skipif(not sys.platform.startswith("linux") or openmp_runtime() is None,
                                  reason="needs Linux and an OpenMP runtime with omp_pause_resource_all")

REGION = 1 << 20  # elements: far above ATen's grain size, so an elementwise op opens a parallel region


def os_threads_named(name: str) -> int:
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm", encoding="utf-8") as comm:
                count += comm.read().strip() == name
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return count


def settle(count, expected: int, timeout_s: float = 5.0) -> int:
    """`count()` once it equals `expected`, or its last value after `timeout_s` (threads exit asynchronously)."""
    deadline = time.monotonic() + timeout_s
    value = count()
    while value != expected and time.monotonic() < deadline:
        time.sleep(0.01)
        value = count()
    return value


def open_a_parallel_region() -> None:
    torch.ones(REGION).mul_(2.0)


def test_generation_threads_are_long_lived_and_start_with_their_thread_count() -> None:
    request = contextvars.ContextVar("request", default=None)
    threads = GenerationThreads(workers=1, threads=3, name="prunewatch-test-gen")
    try:
        def where() -> tuple[str, int, int, object]:
            return threading.current_thread().name, threading.get_ident(), torch.get_num_threads(), request.get()

        request.set("r1")
        first = threads.submit(where).result()
        second = threads.run(where)
        assert first[0] == "prunewatch-test-gen_0" and first[2] == 3 and first[3] == "r1"  # the submitter's context
        assert second[:3] == first[:3]  # the same thread, still configured
        assert threads.run(threads.on_worker) and not threads.on_worker()
        assert threads.run(lambda: threads.run(where))[1] == first[1]  # a worker calling run() does not queue
    finally:
        threads.shutdown(wait=True)
    assert torch.get_num_threads() >= 1  # the caller's own setting is its own


def test_each_worker_gets_its_share_of_the_cores_by_default() -> None:
    threads = GenerationThreads(workers=2)
    try:
        assert threads.threads == max(1, torch.get_num_threads() // 2)
        assert threads.run(torch.get_num_threads) == threads.threads
    finally:
        threads.shutdown(wait=True)
    with pytest.raises(ValueError):
        GenerationThreads(workers=0)
    with pytest.raises(ValueError):
        GenerationThreads(threads=0)


@linux_openmp
@pytest.mark.parametrize("intra_op", [1, 2, 3])
def test_a_generation_threads_openmp_team_has_its_configured_size(intra_op: int) -> None:
    """Its OpenMP threads inherit its OS name: the thread itself plus intra_op - 1 team threads."""
    threads = GenerationThreads(workers=1, threads=intra_op, name=f"prunewatch-team{intra_op}")
    try:
        threads.run(open_a_parallel_region)
        assert settle(lambda: os_threads_named(f"pw-team{intra_op}_0"), intra_op) == intra_op
        threads.run(open_a_parallel_region)  # the same team again, not a second one
        assert settle(lambda: os_threads_named(f"pw-team{intra_op}_0"), intra_op) == intra_op
    finally:
        threads.shutdown(wait=True)


@linux_openmp
def test_releasing_a_threads_openmp_team_ends_its_team_threads() -> None:
    seen: dict[str, object] = {}

    def loader() -> None:  # as the thread that loads and calibrates an engine
        _name_os_thread("pw-test-loader")
        torch.set_num_threads(2)
        open_a_parallel_region()
        seen["team"] = settle(lambda: os_threads_named("pw-test-loader"), 2)
        seen["released"] = release_openmp_team()
        seen["after"] = settle(lambda: os_threads_named("pw-test-loader"), 1)

    worker = threading.Thread(target=loader)
    worker.start()
    worker.join(30)
    assert seen == {"team": 2, "released": True, "after": 1}


def run_the_sparse_kernel() -> None:
    """A call large enough that the kernel splits it across its thread's team."""
    generator = torch.Generator().manual_seed(0)
    x, weight_t = torch.randn(2, 1024, generator=generator), torch.randn(1024, 1024, generator=generator)
    sparse_linear(x, weight_t, None, torch.ones(1024), 0.0)


@linux_openmp
@pytest.mark.parametrize("first_work", [open_a_parallel_region, run_the_sparse_kernel], ids=["aten", "sparse-kernel"])
def test_a_generation_thread_keeps_its_count_when_another_thread_is_set_to_one_before_its_first_region(
        first_work) -> None:
    """torch sizes a thread's team lazily from the count last set on any thread (and the sparse kernel's library
    has its own copy of that step): a stepper set to 2 whose requests' threads were set to 1 before its first
    region must still run its regions on 2."""
    original = torch.get_num_threads()
    configured, other_set, seen = threading.Event(), threading.Event(), {}

    def stepper() -> None:
        configured.set()
        other_set.wait(10)
        first_work()
        seen["count"] = torch.get_num_threads()
        seen["team"] = settle(lambda: os_threads_named("pw-keep"), 2)

    def other() -> None:  # a request thread, configured after the stepper and before its first region
        configured.wait(10)
        torch.set_num_threads(1)
        other_set.set()

    thread = start_generation_thread(stepper, 2, name="prunewatch-keep")
    helper = threading.Thread(target=other)
    helper.start()
    helper.join(30)
    thread.join(30)
    reset = threading.Thread(target=torch.set_num_threads, args=(original,))  # the count new threads start from
    reset.start()
    reset.join()
    assert seen == {"count": 2, "team": 2}


class RecordingEngine(FakeEngine):
    """The server tests' model-free engine; its generations note where they ran."""

    def __init__(self, threads: int) -> None:
        self.settings = SimpleNamespace(threads=threads)
        self.ran: list[tuple[str, int]] = []
        self.batchers: list = []

    def new_batcher(self, max_batch: int, threads: int | None = None, *, kv_budget_bytes: int | None = None):
        batcher = super().new_batcher(max_batch, threads, kv_budget_bytes=kv_budget_bytes)
        self.batchers.append(batcher)
        return batcher

    def stream(self, *args, **kwargs):
        self.ran.append((threading.current_thread().name, torch.get_num_threads()))
        yield from super().stream(*args, **kwargs)


@pytest.mark.parametrize("workers, threads, request_threads", [(1, 2, 2), (2, 2, 1), (8, 1, 1)])
def test_the_server_generates_on_its_configured_generation_threads(workers: int, threads: int,
                                                                    request_threads: int) -> None:
    """One worker: the request's generation thread runs the forward passes with the engine's threads. More: the
    batcher's stepper runs them (tests/engine/test_batching.py checks its threads), and each request's thread only
    detokenizes and streams, on one intra-op thread."""
    engine = RecordingEngine(threads)
    app = create_app(engine, ServerSettings(workers=workers))  # type: ignore[arg-type]
    body = {"model": engine.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with serve_in_background(app) as url:
        for _ in range(2):
            assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).status_code == 200
    assert len(engine.ran) == 2
    assert all(name.startswith("prunewatch-generate_") and count == request_threads for name, count in engine.ran)
    assert [b.max_batch for b in engine.batchers] == ([workers] if workers > 1 else [])


@linux_openmp
def test_building_the_served_engine_releases_the_loaders_openmp_team(probe_model_dir: Path,
                                                                      calibration_dir: Path) -> None:
    seen: dict[str, object] = {}

    def load() -> None:
        _name_os_thread("pw-test-build")  # the threads it starts carry the name: OpenMP's, and the tokenizer's
        torch.set_num_threads(2)
        build_engine(probe_model_dir, calibration_dir=calibration_dir, device="cpu")
        time.sleep(0.2)
        seen["before"] = os_threads_named("pw-test-build")
        open_a_parallel_region()  # with its team released, the thread starts a new one: one more thread
        seen["after"] = settle(lambda: os_threads_named("pw-test-build"), seen["before"] + 1)

    worker = threading.Thread(target=load)
    worker.start()
    worker.join(300)
    assert seen["after"] == seen["before"] + 1


def test_in_process_probes_run_on_the_engines_generation_thread(probe_engine) -> None:
    ran: list[tuple[str, int]] = []

    class Recording:
        def __init__(self, inner) -> None:
            self._inner = inner

        def __getattr__(self, name: str):
            return getattr(self._inner, name)

        def stream(self, *args, **kwargs):
            ran.append((threading.current_thread().name, torch.get_num_threads()))
            yield from self._inner.stream(*args, **kwargs)

    target = InProcessTarget(Recording(probe_engine), name="embedded")  # type: ignore[arg-type]
    probe = Probe(id="t1", domain="tech", version=1, max_tokens=2, system="", prompt="What is a cache?")
    from_other_thread: list[object] = []
    caller = threading.Thread(target=lambda: from_other_thread.append(target.run_probe(probe)))
    caller.start()
    caller.join(120)
    target.run_probe(probe)
    assert from_other_thread and len(ran) == 2
    assert ran[0] == ran[1] == ("prunewatch-engine_0", probe_engine.generation_thread.threads)
