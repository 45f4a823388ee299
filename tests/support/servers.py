"""Real servers for the tests (PostgreSQL, Prometheus, Alertmanager) on 127.0.0.1 with free ports.

Starting, waiting for and stopping the processes is `services`' work, shared with `prunewatch stack`
and the benchmarks; this module only writes each server's config into a temp folder and removes
it afterwards.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from prunewatch.services import (
    ALERTMANAGER_BINARIES,
    PROMETHEUS_BINARIES,
    PostgresServer,
    ProcessRecord,
    ServiceError,
    find_binary,
    free_port,
    launch,
    postgres_available,
    stop,
    temporary_postgres,
    wait_for_url,
    which_binary,
)
from prunewatch.services import wait_for_http as wait_for_service

__all__ = ["PostgresServer", "ProcessServer", "alertmanager_binary", "alertmanager_server", "free_port",
           "postgres_available", "postgres_server", "prometheus_server", "wait_for_http"]


def wait_for_http(url: str, timeout_s: float = 30.0) -> None:
    """Wait until `url` answers 2xx, for servers the tests start themselves (threads, their own children)."""
    wait_for_url(url, timeout_s)


# -- PostgreSQL ----------------------------------------------------------------------------------
@contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    """A throwaway cluster on a free port with the `prunewatch` database; stopped and deleted after.

    fsync is off: a test's data need not survive a power cut, and commits are many times faster.
    """
    with temporary_postgres(options={"fsync": "off"}) as server:
        yield server


# -- Prometheus and Alertmanager -----------------------------------------------------------------
@dataclass
class ProcessServer:
    url: str
    record: ProcessRecord
    workdir: Path
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@contextmanager
def _serve(name: str, command: list[str], workdir: Path, port: int, timeout_s: float = 60.0) -> Iterator[ProcessServer]:
    """Run `command` until /-/ready answers, yield it, then stop it and delete `workdir`."""
    log_path = workdir / "server.log"
    server = ProcessServer(url=f"http://127.0.0.1:{port}", record=launch(name, command, log_path, cwd=workdir),
                           workdir=workdir, log_path=log_path)
    try:
        try:
            wait_for_service(server.record, f"{server.url}/-/ready", timeout_s)
        except ServiceError as exc:
            raise RuntimeError(f"{exc}\n{server.log()[-3000:]}") from None
        yield server
    finally:
        stop([server.record], 10.0)
        shutil.rmtree(workdir, ignore_errors=True)


def _workdir(prefix: str, config_name: str, config_yaml: str, extra_files: dict[str, str] | None) -> Path:
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    for name, content in (extra_files or {}).items():
        (workdir / name).write_text(content)
    (workdir / config_name).write_text(config_yaml)
    return workdir


@contextmanager
def prometheus_server(config_yaml: str, extra_files: dict[str, str] | None = None,
                      extra_args: list[str] | None = None) -> Iterator[ProcessServer]:
    """Run `prometheus` with the given config (and rule files written beside it)."""
    binary = find_binary(PROMETHEUS_BINARIES, "prometheus", "prometheus")
    workdir = _workdir("prunewatch-prom-", "prometheus.yml", config_yaml, extra_files)
    port = free_port()
    command = [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
               f"--web.listen-address=127.0.0.1:{port}", "--web.enable-lifecycle", *(extra_args or [])]
    with _serve("prometheus", command, workdir, port) as server:
        yield server


def alertmanager_binary() -> str | None:
    """Alertmanager's path (Debian names it prometheus-alertmanager); None when it is not installed."""
    return which_binary(ALERTMANAGER_BINARIES)


@contextmanager
def alertmanager_server(config_yaml: str, extra_files: dict[str, str] | None = None) -> Iterator[ProcessServer]:
    """Run Alertmanager with clustering off."""
    binary = alertmanager_binary()
    if binary is None:
        raise FileNotFoundError("alertmanager not installed (apt-get install prometheus-alertmanager)")
    workdir = _workdir("prunewatch-am-", "alertmanager.yml", config_yaml, extra_files)
    port = free_port()
    command = [binary, f"--config.file={workdir / 'alertmanager.yml'}", f"--storage.path={workdir / 'data'}",
               f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="]
    with _serve("alertmanager", command, workdir, port) as server:
        yield server


@contextmanager
def prunewatch_serve(model_dir: Path, *, args: tuple[str, ...] = (), env: dict[str, str] | None = None,
                     calibration_dir: Path | None = None, timeout_s: float = 480.0) -> Iterator[tuple[str, Path]]:
    """A `prunewatch serve` process on 127.0.0.1 for `model_dir` (CPU), up and healthy; yields (base URL, log path).

    `calibration_dir`: the session's calibration folder, linked into the process's cache so that it calibrates
    only when no other test has; `env` adds variables (API keys, PRUNEWATCH_ENGINE_*)."""
    import os
    import subprocess
    import sys
    import time

    import httpx

    cache = Path(tempfile.mkdtemp(prefix="prunewatch-serve-"))
    (cache / "prunewatch").mkdir()
    if calibration_dir is not None:
        (cache / "prunewatch" / "calibration").symlink_to(calibration_dir, target_is_directory=True)
    log = cache / "serve.log"
    port = free_port()
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "prunewatch", "serve", "--model", str(model_dir), "--device", "cpu",
             "--host", "127.0.0.1", "--port", str(port), *args], stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "XDG_CACHE_HOME": str(cache), **(env or {})})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"prunewatch serve exited:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"prunewatch serve did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield base, log
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        shutil.rmtree(cache, ignore_errors=True)


def share_calibration(home: Path, calibration_dir: Path) -> None:
    """Point a fresh HOME's calibration cache (~/.cache/prunewatch/calibration) at the session's folder, so a
    process started there loads what the session already calibrated instead of calibrating again. An operating
    range is cached in that folder too, so callers that must not share one turn its measurement off."""
    cache = home / ".cache" / "prunewatch"
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "calibration").symlink_to(calibration_dir, target_is_directory=True)
