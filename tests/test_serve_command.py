"""Both serve commands (`prunewatch serve` and the local stack's `python -m prunewatch.stack.runners serve`) run
one implementation, prunewatch/commands/serve.py: the engine settings' device default, the same one-line errors."""

from __future__ import annotations

import inspect
import socket

import pytest
import typer
from typer.testing import CliRunner

from prunewatch.cli import app as cli_app
from prunewatch.commands.serve import DEFAULT_DEVICE
from prunewatch.engine.settings import EngineSettings
from prunewatch.server import build_engine, serve
from prunewatch.stack.runners import app as runners_app
from tests.support.servers import free_port

APPS = {"prunewatch": cli_app, "stack.runners": runners_app}


def _serve_option_default(app: typer.Typer, name: str) -> object:
    command = typer.main.get_command(app).commands["serve"]
    (param,) = [p for p in command.params if p.name == name]
    return param.default


def test_every_serve_entry_point_defaults_to_the_engine_settings_device():
    engine_default = EngineSettings.model_fields["device"].default
    assert engine_default == DEFAULT_DEVICE
    for app in APPS.values():
        assert _serve_option_default(app, "device") == engine_default
    for function in (serve, build_engine):
        assert inspect.signature(function).parameters["device"].default == engine_default


@pytest.mark.parametrize("name", sorted(APPS))
def test_an_unknown_device_is_one_line_exit_2(name, tmp_path):
    result = CliRunner().invoke(APPS[name], ["serve", "--model", str(tmp_path), "--port", str(free_port()),
                                             "--device", "tpu"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == "error: --device must be auto, cpu or cuda, got 'tpu'"


@pytest.mark.parametrize("name", sorted(APPS))
def test_a_taken_port_is_one_line_exit_2_before_the_model_is_looked_at(name, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(APPS[name], ["serve", "--model", str(tmp_path / "no-such-model"),
                                                 "--host", "127.0.0.1", "--port", str(port)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot serve on 127.0.0.1:{port}: "), result.stderr


def test_an_unknown_weight_format_is_one_line_exit_2(tmp_path):
    result = CliRunner().invoke(cli_app, ["serve", "--model", str(tmp_path), "--port", str(free_port()),
                                          "--weights", "int2"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == "error: --weights must be one of fp32, int8, int4, got 'int2'"


def test_serve_passes_the_weight_format_to_the_engine_and_leaves_the_variable_otherwise(monkeypatch, tmp_path):
    """The weight format serve passes reaches EngineSettings; without one PRUNEWATCH_ENGINE_WEIGHTS (or fp32) decides."""
    import prunewatch.server.run as run

    seen: list[str] = []

    class Stop(Exception):
        pass

    def fake_load(settings):
        seen.append(settings.weights)
        raise Stop

    monkeypatch.setattr(run.PruningEngine, "load", staticmethod(fake_load))
    for args, env, expected in (([], None, "fp32"), (["--weights", "int8"], None, "int8"),
                                (["--weights", "int4"], None, "int4"), ([], "int8", "int8")):
        if env is None:
            monkeypatch.delenv("PRUNEWATCH_ENGINE_WEIGHTS", raising=False)
        else:
            monkeypatch.setenv("PRUNEWATCH_ENGINE_WEIGHTS", env)
        weights = args[1] if args else None
        with pytest.raises(Stop):
            build_engine(tmp_path, weights=weights)
        assert seen[-1] == expected
