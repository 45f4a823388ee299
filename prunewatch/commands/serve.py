"""The engine's HTTP server as a command: the one implementation behind both serve commands.

    prunewatch serve [--model NAME|DIR] [--host H] [--port P] [--device D] ...
    python -m prunewatch.stack.runners serve --model DIR [--port P] [--device D] [--calibration-dir D]

Each command reads its own options and calls `serve_model`, which binds the address, loads and calibrates
the engine and runs the server (prunewatch.server.serve). Bad input is one `error: ...` line and exit code 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from prunewatch.cli_errors import fail, first_validation_error

DEFAULT_DEVICE = "auto"
"""The engine settings' device default (EngineSettings.device: CUDA when present, else the CPU), written out
here because prunewatch.engine.settings imports torch and --help must not; a test checks that they agree."""

_DEVICES: dict[str, Literal["auto", "cpu", "cuda"]] = {"auto": "auto", "cpu": "cpu", "cuda": "cuda"}
_WEIGHTS: dict[str, Literal["fp32", "int8", "int4"]] = {"fp32": "fp32", "int8": "int8", "int4": "int4"}  # EngineSettings.weights


def serve_model(model: str | Path | None, *, host: str, port: int, device: str = DEFAULT_DEVICE,
                sensitivity: float = 0.5, queue_depth: int | None = None, workers: int | None = None,
                threads: int | None = None, probes: Path | None = None, calibration_dir: Path | None = None,
                weights: str | None = None) -> None:
    """Serve a model until interrupted. `model`: a Path is the model folder itself; a string (a folder or a known
    model's name) or None (the default model) is resolved as every command's --model is, pulled if needed.

    The address is bound before the model is fetched or loaded, so a taken port fails at once."""
    from pydantic import ValidationError

    from prunewatch.engine.errors import EngineError
    from prunewatch.models_cli import model_folder
    from prunewatch.probes import ProbeFileError
    from prunewatch.server import ServeAddressError, bind_listener, serve

    if device not in _DEVICES:
        raise fail(f"--device must be auto, cpu or cuda, got {device!r}")
    if weights is not None and weights not in _WEIGHTS:
        raise fail(f"--weights must be one of {', '.join(_WEIGHTS)}, got {weights!r}")
    try:
        listener = bind_listener(host, port)
        model_dir = model if isinstance(model, Path) else model_folder(model)
        serve(model_dir, host=host, port=port, sensitivity=sensitivity, device=_DEVICES[device],
              queue_depth=queue_depth, workers=workers, probes_path=probes, calibration_dir=calibration_dir,
              listener=listener, threads=threads, weights=_WEIGHTS[weights] if weights is not None else None)
    except ValidationError as exc:
        raise fail(first_validation_error(exc))
    except (EngineError, ProbeFileError, ServeAddressError) as exc:
        raise fail(str(exc))
