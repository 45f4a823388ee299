"""Entry points the local stack starts its engine and collector processes with.

    python -m prunewatch.stack.runners serve --model DIR --port 8001 [--device cpu] [--calibration-dir D]
    python -m prunewatch.stack.runners collect --config targets.yaml

`serve` runs serve_model (prunewatch/commands/serve.py, what `prunewatch serve` runs); `collect` is the
collector's own command function (prunewatch/commands/collect.py, what `prunewatch collect` runs). They live
here so the stack does not depend on how the top-level `prunewatch` app mounts its commands.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from prunewatch.commands.serve import DEFAULT_DEVICE, serve_model

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False)


@app.command("serve")
def serve_command(
    model: Annotated[Path, typer.Option(help="Local Hugging Face model folder.")],
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port.")] = 8000,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = DEFAULT_DEVICE,
    calibration_dir: Annotated[Path | None, typer.Option(help="Calibration cache (default: the engine's).")] = None,
) -> None:
    """The engine's OpenAI-compatible server (API keys from PRUNEWATCH_API_KEYS_FILE)."""
    serve_model(model, host=host, port=port, device=device, calibration_dir=calibration_dir)


def _mount_collector() -> None:
    from prunewatch.commands.collect import collect_command

    app.command("collect")(collect_command)


_mount_collector()

if __name__ == "__main__":
    app()
