"""Start the API: load the model, make sure it is calibrated, run uvicorn.

Calibration uses the canonical probes (prunewatch/probes/canonical.yaml), the same texts and the same corpus
digest (`ProbeSet.digest`) as the collector's embedded target, so `prunewatch serve` and the
collector share one cached calibration per model instead of measuring twice.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from prunewatch.engine.pruning_engine import PruningEngine
from prunewatch.engine.settings import EngineSettings, LogLevel, WeightFormat
from prunewatch.engine.threads import release_openmp_team
from prunewatch.server.settings import ServerSettings

logger = logging.getLogger("prunewatch.server")

_DEFAULT_DEVICE = EngineSettings.model_fields["device"].default  # the engine's: CUDA when present, else the CPU


def build_engine(model_dir: Path, sensitivity: float = 0.5, device: Literal["auto", "cpu", "cuda"] = _DEFAULT_DEVICE,
                 *, probes_path: Path | None = None, calibration_dir: Path | None = None,
                 log_level: LogLevel = LogLevel.SUMMARY, threads: int | None = None,
                 weights: WeightFormat | None = None) -> PruningEngine:
    """Load the model and attach a calibration (cached, else measured on the calibration set); then release
    this thread's OpenMP team, as generations run on generation threads (prunewatch/engine/threads.py)."""
    from prunewatch.probes import CALIBRATION_PATH, load_calibration_set

    # None: PRUNEWATCH_ENGINE_*, else the default
    unset: dict[str, Any] = {"calibration_dir": calibration_dir, "threads": threads, "weights": weights}
    engine = PruningEngine.load(EngineSettings(
        model_dir=Path(model_dir), device=device, sensitivity=sensitivity, log_level=log_level,
        **{name: value for name, value in unset.items() if value is not None},
    ))
    probe_set = load_calibration_set(probes_path or CALIBRATION_PATH)
    calibration, cached = engine.load_or_calibrate(probe_set.calibration_texts(), probe_set.digest)
    logger.info("%s calibration for %s: %d domains (%s)", "cached" if cached else "new", engine.name,
                len(calibration.domains), ", ".join(sorted(calibration.domains)))
    warm_up_s = engine.warm_up_compiled()  # PRUNEWATCH_ENGINE_COMPILE_DECODE=true: compile before listening
    if warm_up_s is not None:
        logger.info("compiled decode graphs ready in %.0f s", warm_up_s)
    # Generations run on the server's generation threads: this thread's OpenMP team would be a second one.
    release_openmp_team()
    return engine


def _log_to_stderr(level: str) -> None:
    """Show the engine's per-request pruning log (X-Pruning-Log-Level) next to uvicorn's access log.

    uvicorn configures only its own loggers; without this, the engine's INFO lines would be dropped.
    """
    root = logging.getLogger("prunewatch")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    root.setLevel(level.upper())


def serve(model_dir: Path, host: str = "127.0.0.1", port: int = 8000, sensitivity: float = 0.5,
          device: Literal["auto", "cpu", "cuda"] = _DEFAULT_DEVICE, *, queue_depth: int | None = None,
          workers: int | None = None, probes_path: Path | None = None, calibration_dir: Path | None = None,
          log_level: str = "info", listener: socket.socket | None = None, threads: int | None = None,
          weights: WeightFormat | None = None) -> None:
    """Serve `model_dir` on host:port until interrupted (both serve commands, through prunewatch/commands/serve.py).
    `listener`: the socket `bind_listener(host, port)` bound already (the command binds before it resolves the
    model). `threads`: CPU threads of the forward passes (default PRUNEWATCH_ENGINE_THREADS, else the cores): the
    batcher's stepper's, or with one worker the generation thread's. `weights`: fp32 or int8 (default
    PRUNEWATCH_ENGINE_WEIGHTS, else fp32).

    Everything not passed here comes from ServerSettings (PRUNEWATCH_SERVER_* variables, and
    PRUNEWATCH_API_KEYS / PRUNEWATCH_API_KEYS_FILE for auth).
    """
    import uvicorn

    from prunewatch.server.app import create_app

    overrides: dict[str, Any] = {"host": host, "port": port}
    if queue_depth is not None:
        overrides["queue_depth"] = queue_depth
    if workers is not None:
        overrides["workers"] = workers
    settings = ServerSettings(**overrides)
    _log_to_stderr(log_level)
    # Bound before minutes of loading, so a taken port fails at once.
    sock = listener if listener is not None else bind_listener(settings.host, settings.port)
    try:
        engine = build_engine(model_dir, sensitivity, device, probes_path=probes_path, calibration_dir=calibration_dir,
                              threads=threads, weights=weights)
        app = create_app(engine, settings)
        config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()


class ServeAddressError(RuntimeError):
    """The server cannot listen where it was asked to (port taken, address not of this host, bad name)."""


def bind_listener(host: str, port: int, what: str | None = None) -> socket.socket:
    """A TCP socket bound to host:port for uvicorn to listen on; ServeAddressError (one line, naming `what`
    is served when given) when it cannot be.

    Bound before the model loads, and handed to uvicorn, so the address is held from then on: a port
    another process takes meanwhile cannot make a loaded engine fail at its last step."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        served = f" {what}" if what else ""
        raise ServeAddressError(f"cannot serve{served} on {host}:{port}: {exc.strerror or exc}") from None
    return sock


@contextmanager
def serve_in_background(app: Any, host: str = "127.0.0.1", port: int = 0,
                        startup_timeout_s: float = 30.0) -> Iterator[str]:
    """Run `app` under uvicorn in a daemon thread; yield its base URL; stop it on exit.

    For tests and benchmarks that need a real socket. Port 0 binds a free port chosen by the OS
    (the socket is bound here, so there is no race between picking a port and listening on it).
    """
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound_port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="prunewatch-uvicorn",
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    try:
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {host}:{bound_port}")
            time.sleep(0.02)
        yield f"http://{host}:{bound_port}"
    finally:
        server.should_exit = True
        thread.join(timeout=startup_timeout_s)
        sock.close()
