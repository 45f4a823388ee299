"""The `prunewatch` command: one subcommand per job; each imports its part lazily so --help is fast."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import typer

app = typer.Typer(
    name="prunewatch",
    help="Observability and cost governance for pruned LLM inference.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "engine" / "models" / "probe-llama"


@app.callback()
def _root() -> None:
    """Observability and cost governance for pruned LLM inference."""


@app.command("build-model")
def build_model(
    out: Path = typer.Option(DEFAULT_MODEL_DIR, help="Folder to write the Hugging Face model into."),
    steps: int = typer.Option(None, min=1, help="Training steps (default: the committed model's schedule)."),
) -> None:
    """Train the bundled probe model (tokenizer + small Llama) offline from this machine's docs."""
    from dataclasses import replace

    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from engine.probe_model.train import ProbeModelConfig, build_probe_model

    config = ProbeModelConfig() if steps is None else replace(ProbeModelConfig(), steps=steps)
    command = "prunewatch " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    with Progress(TextColumn("training"), BarColumn(), TextColumn("{task.completed}/{task.total} loss {task.fields[loss]:.3f}"),
                  TimeRemainingColumn()) as progress:
        task = progress.add_task("train", total=config.steps, loss=float("nan"))

        def report(step: int, total: int, loss: float) -> None:
            progress.update(task, completed=step, loss=loss)

        try:
            manifest = build_probe_model(out, config, progress=report, command=command)
        except RuntimeError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2)
    typer.echo(f"wrote {out} (validation perplexity {manifest['validation_perplexity']}, "
               f"weights sha256 {manifest['weights_sha256'][:12]}...)")


def main() -> None:  # pragma: no cover - console entry point
    app()
