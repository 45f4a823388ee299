"""The `prunewatch` command: one subcommand per job; each imports its part lazily so --help is fast."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from prunewatch.cli_errors import fail, first_validation_error, needs_extra
from prunewatch.commands.serve import DEFAULT_DEVICE, serve_model
from prunewatch.engine.model_store import PROBE_MODEL_DIR
from prunewatch.models_cli import MODEL_HELP, main_job_model, model_folder, models_app

app = typer.Typer(
    name="prunewatch",
    help="Observability and cost governance for pruned LLM inference.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)



@app.callback()
def _root() -> None:
    """Observability and cost governance for pruned LLM inference."""


@app.command("build-model")
def build_model(
    out: Annotated[Path, typer.Option(help="Folder to write the Hugging Face model into.")] = PROBE_MODEL_DIR,
    steps: Annotated[int | None, typer.Option(min=1, help="Training steps (default: the committed model's schedule).")] = None,
    seed: Annotated[int | None, typer.Option(help="Random seed of tokenizer sampling, init and batches (default: the committed model's).")] = None,
) -> None:
    """Train the bundled probe model (tokenizer + small Llama) offline from this machine's docs."""
    from dataclasses import replace

    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from prunewatch.engine.probe_model.train import ProbeModelConfig, build_probe_model

    overrides = {k: v for k, v in (("steps", steps), ("seed", seed)) if v is not None}
    config = replace(ProbeModelConfig(), **overrides)
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


@app.command("run")
def run(
    rounds: Annotated[int | None, typer.Option(help="Stop after N probe rounds (default: run until Ctrl-C). (env PRUNEWATCH_ROUNDS)")] = None,
    interval: Annotated[float | None, typer.Option(help="Seconds between rounds (default 30). (env PRUNEWATCH_INTERVAL_S)")] = None,
    db: Annotated[str | None, typer.Option(help="SQLAlchemy URL of the result store (default sqlite:///prunewatch.db). "
                                      "(env PRUNEWATCH_DB_URL)")] = None,
    metrics_port: Annotated[int | None, typer.Option(help="Port of the /metrics endpoint (default 9464; 0 disables it). "
                                                "(env PRUNEWATCH_METRICS_PORT)")] = None,
    metrics_host: Annotated[str | None, typer.Option(help="Address of the /metrics endpoint (default 127.0.0.1). "
                                                "(env PRUNEWATCH_METRICS_HOST)")] = None,
    model: Annotated[str | None, typer.Option(help=MODEL_HELP + " (env PRUNEWATCH_MODEL_DIR)")] = None,
    sensitivity: Annotated[float | None, typer.Option(help="Pruning sensitivity in [0, 1] (default 0.5); 0 runs dense. "
                                                 "(env PRUNEWATCH_SENSITIVITY)")] = None,
    activation_sparsity: Annotated[float | None, typer.Option(help="Activation-sparsity target at sensitivity 1, in [0, 1) (sparse kernel; default: the engine's, "
                   "chosen to keep quality on SmolLM2-135M-Instruct; 0 turns it off). (env PRUNEWATCH_ACTIVATION_SPARSITY)")] = None,
    device: Annotated[str | None, typer.Option(help="auto, cpu or cuda (default auto). (env PRUNEWATCH_DEVICE)")] = None,
    probes: Annotated[Path | None, typer.Option(help="Probes YAML (default: the canonical probes). (env PRUNEWATCH_PROBES_PATH)")] = None,
    baseline_every: Annotated[int | None, typer.Option(help="Every N rounds (the first included) also run each probe dense, stored as a measured baseline "
                   "for the ROI report and the latency rules (default 10; 0 never). (env PRUNEWATCH_BASELINE_EVERY)")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log every probe result as JSON.")] = False,
    govern: Annotated[bool, typer.Option("--govern/--no-govern", envvar="PRUNEWATCH_GOVERN", help="Hold the token-agreement floor per domain with the quality governor "
                                     "(starts at --sensitivity, lowers it on a breach, relaxes slowly).")] = False,
    govern_floor: Annotated[float | None, typer.Option("--govern-floor", envvar="PRUNEWATCH_GOVERNOR_FLOOR", help="The governor's token-agreement floor (default 0.95).")] = None,
) -> None:
    """The main job: probe the embedded engine on a schedule, store results, serve /metrics.

    Each setting comes from its flag, else its PRUNEWATCH_* variable, else its default."""
    from pydantic import ValidationError

    from prunewatch.collector.exposition import MetricsPortError
    from prunewatch.collector.governor import GovernorSettings
    from prunewatch.collector.settings import CollectorSettings
    from prunewatch.commands.collect import configure_logging
    from prunewatch.embedded import run_embedded
    from prunewatch.engine.errors import EngineError
    from prunewatch.probes import ProbeFileError
    from prunewatch.records.store import StoreUnavailableError

    configure_logging(verbose)
    flags: dict[str, Any] = dict(db_url=db, interval_s=interval, rounds=rounds, metrics_port=metrics_port, metrics_host=metrics_host,
                 sensitivity=sensitivity, device=device, probes_path=probes, activation_sparsity=activation_sparsity,
                 baseline_every=baseline_every)
    try:
        settings = CollectorSettings(**{name: value for name, value in flags.items() if value is not None})
        # The model: the flag, else PRUNEWATCH_MODEL_DIR, else the default real model (each may be a name).
        settings = settings.model_copy(update={"model_dir": main_job_model(settings, model)})
        governor = GovernorSettings(**({} if govern_floor is None else {"floor": govern_floor})) if govern else None
    except ValidationError as exc:
        raise fail(first_validation_error(exc))
    except EngineError as exc:
        raise fail(str(exc))
    try:
        outcome = run_embedded(settings, governor=governor)
    except (EngineError, ProbeFileError, StoreUnavailableError, MetricsPortError) as exc:
        raise fail(str(exc))
    typer.echo(f"done: {outcome.rounds} round(s), {outcome.results} probe result(s), {outcome.failures} failed; "
               f"store {settings.db_url}")


@app.command("calibrate")
def calibrate_command(
    model: Annotated[str | None, typer.Option(help=MODEL_HELP)] = None,
    probes: Annotated[Path | None, typer.Option(help="Calibration probes YAML whose texts calibrate each domain "
                                            "(default: the calibration set, probes/calibration.yaml).")] = None,
    out: Annotated[Path, typer.Option(help="Folder for the calibration JSON and heatmap PNG.")] = Path("calibration"),
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
) -> None:
    """Measure per-domain block influence on the dense model; write JSON + a heatmap PNG."""
    from rich.progress import Progress

    from prunewatch.engine import EngineError, EngineSettings, PruningEngine
    from prunewatch.engine.heatmap import write_heatmap
    from prunewatch.probes import CALIBRATION_PATH, ProbeFileError, load_calibration_set

    try:
        probe_set = load_calibration_set(probes or CALIBRATION_PATH)
        engine = PruningEngine.load(EngineSettings(model_dir=model_folder(model), device=device))
    except (EngineError, ProbeFileError) as exc:
        raise fail(str(exc))
    texts = probe_set.calibration_texts()
    with Progress() as progress:
        task = progress.add_task("calibrating", total=sum(len(t) for t in texts.values()))
        calibration = engine.calibrate(texts, probe_set.digest,
                                       progress=lambda done, total: progress.update(task, completed=done))
    json_path = out / f"{engine.name}.calibration.json"
    calibration.save(json_path)
    png_path = write_heatmap(calibration, out / f"{engine.name}.heatmap.png")
    typer.echo(f"wrote {json_path} and {png_path} (model fingerprint {calibration.model_fingerprint[:12]})")


@app.command("profile-dram")
def profile_dram_command(
    model: Annotated[Path, typer.Option(help="Local Hugging Face model folder.")] = PROBE_MODEL_DIR,
    sparsity: Annotated[list[float] | None, typer.Option(
        help="Activation-sparsity levels to profile (0 is dense); default 0 and 0.5.")] = None,
    dtype: Annotated[str, typer.Option(help="bfloat16, float16 or float32 (what the engine runs on CUDA).")] = "bfloat16",
    out: Annotated[Path | None, typer.Option(help="Profile JSON (default: <model name>.dram-profile.json here).")] = None,
) -> None:
    """Measure DRAM bytes per instruction of one decode step per sparsity level with Nsight Compute
    (needs an NVIDIA GPU and ncu); pass the file to the engine as PRUNEWATCH_ENGINE_DRAM_PROFILE."""
    import torch
    from rich.progress import Progress

    from prunewatch.engine import EngineError
    from prunewatch.engine.dram_profile import profile_dram
    from prunewatch.engine.loading import weights_fingerprint

    sparsity = sparsity or [0.0, 0.5]
    if not torch.cuda.is_available():
        raise fail("profile-dram measures a GPU with Nsight Compute, and torch sees no CUDA device here")
    if dtype not in ("bfloat16", "float16", "float32"):
        raise fail(f"--dtype must be bfloat16, float16 or float32, got {dtype!r}")
    if not (model / "config.json").is_file():
        raise fail(f"no Hugging Face model in {model} (config.json missing)")
    try:
        with Progress() as progress:
            task = progress.add_task("profiling with ncu", total=len(set(sparsity)))
            profile = profile_dram(model, model_fingerprint=weights_fingerprint(model),
                                   device_name=torch.cuda.get_device_name(), sparsities=sparsity, dtype=dtype,
                                   progress=lambda done, total: progress.update(task, completed=done))
    except (EngineError, ValueError) as exc:
        raise fail(str(exc))
    path = out or Path(f"{model.name}.dram-profile.json")
    profile.save(path)
    for level in profile.levels:
        typer.echo(f"sparsity {level.sparsity:.2f}: {level.dram_bytes_read / 1e6:,.1f} MB read, "
                   f"{level.bytes_per_instruction:.3f} bytes/instruction (ncu, {level.kernels} kernels)")
    typer.echo(f"wrote {path}")


@app.command("serve")
def serve_command(
    model: Annotated[str | None, typer.Option(help=MODEL_HELP)] = None,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.")] = 8000,
    sensitivity: Annotated[float, typer.Option(help="Default pruning sensitivity in [0, 1] (X-Pruning-Sensitivity overrides).")] = 0.5,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = DEFAULT_DEVICE,
    queue_depth: Annotated[int | None, typer.Option(help="Requests waiting + running before 429 (default 64).")] = None,
    workers: Annotated[int | None, typer.Option(help="Requests decoded together, sharing each decode step (default 8; 1: one at a time).")] = None,
    threads: Annotated[int | None, typer.Option(min=1, help="CPU threads of the forward passes (default: the cores). "
                                                  "(env PRUNEWATCH_ENGINE_THREADS)")] = None,
    probes: Annotated[Path | None, typer.Option(help="Calibration probes YAML (default: the calibration set).")] = None,
    weights: Annotated[str | None, typer.Option(help="fp32, int8 (one scale per output channel; a quarter of the "
                                                  "bytes per decode step) or int4 (groups of 32 with a scale and "
                                                  "minimum, GGUF Q4_1; head int8); CPU only. "
                                                  "(env PRUNEWATCH_ENGINE_WEIGHTS)")] = None,
) -> None:
    """Serve the engine over an OpenAI-compatible HTTP API with pruning headers and /metrics."""
    serve_model(model, host=host, port=port, sensitivity=sensitivity, device=device, queue_depth=queue_depth,
                workers=workers, threads=threads, probes=probes, weights=weights)


def _run_bench(bench_main: Callable[[list[str]], int], args: list[str]) -> None:
    """Run a benchmark's main and exit with its code; the engine's typed errors (a missing or unreadable model
    folder, a calibration made for another model) become one `error:` line, as in every other command."""
    from prunewatch.engine.errors import EngineError

    try:
        code = bench_main(args)
    except EngineError as exc:
        raise fail(str(exc))
    raise typer.Exit(code)


bench_app = typer.Typer(help="Benchmarks: dense vs pruned in one run, ratios against the baseline.",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")
# Each bench parses its own arguments (argparse), --help included, so that help lists its options.
_BENCH_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}
app.add_typer(models_app, name="models")


@bench_app.command("engine", context_settings=_BENCH_ARGS, add_help_option=False)
def bench_engine_command(ctx: typer.Context) -> None:
    """Decode tokens/s dense vs activation-sparse (batch 1, 4, 8) and probe-model quality vs sparsity."""
    from prunewatch.bench.engine import main as bench_main

    _run_bench(bench_main, list(ctx.args))


@bench_app.command("mechanisms", context_settings=_BENCH_ARGS, add_help_option=False)
def bench_mechanisms_command(ctx: typer.Context) -> None:
    """Pruning ratio, quality and decode speed of layer bypass, head gating and activation sparsity
    on the probe model, each alone and combined, against dense in the same run."""
    from prunewatch.bench.mechanisms import main as bench_main

    _run_bench(bench_main, list(ctx.args))


@bench_app.command("frontier", context_settings=_BENCH_ARGS, add_help_option=False)
def bench_frontier_command(ctx: typer.Context) -> None:
    """Decode pruning ratio against agreement, held-out perplexity and decode speed for each mechanism and
    allocation (TEAL's uniform rule as the baseline), all in one run; JSON + plot in bench/results."""
    from prunewatch.bench.frontier import main as bench_main

    _run_bench(bench_main, list(ctx.args))


@bench_app.command("precision", context_settings=_BENCH_ARGS, add_help_option=False)
def bench_precision_command(ctx: typer.Context) -> None:
    """fp32, int8 and int4 weights, each dense and at the default, on the real model in one run: decode tokens/s
    and speedups within rounds, bytes per step, agreement of the served answers with fp32 dense, and with
    --peer llama.cpp llama-bench at F32/Q8_0/Q4_1 in the same rounds."""
    from prunewatch.bench.precision import main as bench_main

    _run_bench(bench_main, list(ctx.args))


@bench_app.command("kernels", context_settings=_BENCH_ARGS, add_help_option=False)
def bench_kernels_command(ctx: typer.Context) -> None:
    """torch's CPU int8/int4 weight-only kernels against fp32 and the engine's int8/int4 kernel, one token row,
    on the model's layer shapes, interleaved: microseconds per product and the error against fp32."""
    from prunewatch.bench.weight_kernels import main as bench_main

    _run_bench(bench_main, list(ctx.args))


@bench_app.command("load", context_settings=_BENCH_ARGS, add_help_option=False)
def bench_load_command(ctx: typer.Context) -> None:
    """Serving under load: 1, 2, 4, 8 concurrent streaming clients against `prunewatch serve`, dense and default,
    in one run: aggregate tokens/s, p50/p99 time per output token and to first token; --peer llama.cpp
    llama-server -np N beside it."""
    from prunewatch.bench.load import main as bench_main

    _run_bench(bench_main, list(ctx.args))


@bench_app.command("prefix-cache", context_settings=_BENCH_ARGS, add_help_option=False)
def bench_prefix_cache_command(ctx: typer.Context) -> None:
    """Prefills on the batcher's stepper with the prefix cache off, cold and as served, on the held-out prompts
    and behind one long system prompt, in one run: prefill ms and the speedup over the cache off."""
    from prunewatch.bench.prefix_cache import main as bench_main

    _run_bench(bench_main, list(ctx.args))


@bench_app.command("batch-sparsity", context_settings=_BENCH_ARGS, add_help_option=False)
def bench_batch_sparsity_command(ctx: typer.Context) -> None:
    """What activation sparsity keeps in a batch: b = 1, 2, 4, 8 requests decoding together, dense, with the
    pruning kept in batched steps (the union of their active channels) and under serve's policy: aggregate
    tokens/s and decode pruning ratio, in one run."""
    from prunewatch.bench.batch_sparsity import main as bench_main

    _run_bench(bench_main, list(ctx.args))


@bench_app.command("speed", context_settings=_BENCH_ARGS, add_help_option=False)
def bench_speed_command(ctx: typer.Context) -> None:
    """The machine's read bandwidth, then plain transformers, engine dense and engine at its defaults decoding
    the real model and the 0.67 B shape, interleaved: tokens/s, bytes per token, share of bandwidth, bound."""
    from prunewatch.bench.speed import main as bench_main

    _run_bench(bench_main, list(ctx.args))


def _mount_groups() -> None:
    """Command groups whose parts own their command functions."""
    from prunewatch.commands import alerts as alerts_cli
    from prunewatch.commands import collect as collector_cli
    from prunewatch.commands import dashboards as dashboards_cli
    from prunewatch.commands import governor as governor_cli
    from prunewatch.commands import roi as roi_cli
    from prunewatch.stack import cli as stack_cli

    app.command("collect")(collector_cli.collect_command)
    app.command("tune")(collector_cli.tune_command)
    app.command("doctor")(collector_cli.doctor_command)
    db_app = typer.Typer(help="The result store: migrations and retention.", no_args_is_help=True)
    db_app.command("upgrade")(collector_cli.db_upgrade_command)
    db_app.command("prune")(collector_cli.db_prune_command)
    app.add_typer(db_app, name="db")

    stack_app = typer.Typer(help="The whole stack as local processes on 127.0.0.1 (no Docker).", no_args_is_help=True)
    stack_app.command("up")(stack_cli.stack_up_command)
    stack_app.command("down")(stack_cli.stack_down_command)
    app.add_typer(stack_app, name="stack")

    app.command("roi")(roi_cli.roi_command)
    app.command("report")(roi_cli.report_command)

    alerts_app = typer.Typer(help="Alert rules: render, check, evaluate over the store.", no_args_is_help=True)
    alerts_app.command("render-rules")(alerts_cli.render_rules_command)
    alerts_app.command("check")(alerts_cli.check_command)
    alerts_app.command("eval")(alerts_cli.eval_command)
    alerts_app.command("thresholds")(alerts_cli.thresholds_command)
    app.add_typer(alerts_app, name="alerts")

    dashboards_app = typer.Typer(help="Grafana dashboards as code: export JSON, push to Grafana.", no_args_is_help=True)
    dashboards_app.command("export")(dashboards_cli.export_command)
    dashboards_app.command("push")(dashboards_cli.push_command)
    app.add_typer(dashboards_app, name="dashboards")

    governor_app = typer.Typer(help="The quality governor: the pruning policy it holds and why.", no_args_is_help=True)
    governor_app.command("status")(governor_cli.status_command)
    app.add_typer(governor_app, name="governor")


_mount_groups()


EXTRA_OF = {
    **dict.fromkeys(("torch", "transformers", "tokenizers", "safetensors", "gguf", "accelerate"), "engine"),
    **dict.fromkeys(("fastapi", "uvicorn"), "serve"),
    **dict.fromkeys(("apscheduler", "psycopg"), "collector"),
    **dict.fromkeys(("streamlit", "altair", "pandas", "reportlab"), "roi"),
    "grafana_client": "dashboards",
    "matplotlib": "all",  # plots of the engine, the collector's tune and the ROI report
}
"""Top-level module -> the extra that installs it: a command of a part that is not installed says which one."""


def main() -> None:  # the console script and `python -m prunewatch`
    """The console script: the commands, and one line for a setting that a PRUNEWATCH_* variable set wrongly
    deep inside a command (a JSON-valued variable that is not JSON, a value out of its range)."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    try:
        app()
    except ModuleNotFoundError as exc:  # a part this install does not have (extras: pyproject.toml)
        extra = EXTRA_OF.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        sys.exit(fail(needs_extra(exc, extra)).exit_code)
    except SettingsError as exc:  # a variable pydantic-settings could not even parse (JSON-valued fields)
        sys.exit(fail(f"invalid setting: {str(exc).splitlines()[0]}").exit_code)
    except ValidationError as exc:
        sys.exit(fail(f"invalid {exc.title} setting: {first_validation_error(exc)}").exit_code)

