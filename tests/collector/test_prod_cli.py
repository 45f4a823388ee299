"""`prunewatch collect` from a targets file: a short run into a store, and one clear line for bad input."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from prunewatch.commands.collect import collect_command
from tests.collector.prod_helpers import baseline_server, count_rows


def app() -> typer.Typer:
    application = typer.Typer()
    application.command()(collect_command)
    return application


def test_collect_one_round_of_a_baseline_into_sqlite(tmp_path):
    store = f"sqlite:///{tmp_path / 'store.db'}"
    with baseline_server() as (url, seen):
        config = tmp_path / "targets.yaml"
        config.write_text(f"collector:\n  db_url: {store}\n  buffer_path: {tmp_path / 'buffer.sqlite'}\n"
                          f"targets:\n  - {{name: vllm, kind: openai, base_url: '{url}', model: baseline-model, "
                          f"domains: [tech]}}\n")
        result = CliRunner().invoke(app(), ["--config", str(config), "--rounds", "1", "--metrics-port", "0"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("probing 1 target(s): vllm every 60s (2 probes); store sqlite:///")
    assert lines[1].startswith("round ") and lines[1].endswith(" vllm: 2 ok, 0 failed")
    assert lines[-1] == "done: 1 round(s), 2 result(s), 0 failed; 2 written to the store, 0 record(s) left in the buffer"
    assert len(seen) == 2
    assert count_rows(store, "SELECT target, domain, pruning_ratio FROM probe_results") == [
        ("vllm", "tech", None), ("vllm", "tech", None)]


def test_collect_bad_input_is_one_line_and_exit_2(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default buffer path is relative: nothing may be written there
    config = tmp_path / "targets.yaml"
    config.write_text("targets:\n  - {name: a, kind: prunewatch, model: m}\n")
    result = CliRunner().invoke(app(), ["--config", str(config)])
    assert result.exit_code == 2
    assert result.output.strip() == f"error: {config}: targets[0] (a): base_url is required for a prunewatch target"
    config.write_text("targets:\n  - {name: a, kind: openai, base_url: 'http://127.0.0.1:9', model: m}\n")
    result = CliRunner().invoke(app(), ["--config", str(config), "--db", "nonsense://"])
    assert result.exit_code == 2
    assert result.output.strip() == ("error: invalid database URL nonsense://: Can't load plugin: "
                                     "sqlalchemy.dialects:nonsense")
    assert list(tmp_path.iterdir()) == [config]  # no buffer file, no store file


def test_collect_on_a_taken_metrics_port_is_one_line_and_writes_nothing(tmp_path, monkeypatch):
    import socket

    monkeypatch.chdir(tmp_path)
    config = tmp_path / "targets.yaml"
    config.write_text(f"collector:\n  db_url: sqlite:///{tmp_path / 'store.db'}\n"
                      "targets:\n  - {name: a, kind: openai, base_url: 'http://127.0.0.1:9', model: m}\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(app(), ["--config", str(config), "--rounds", "1", "--metrics-port", str(port)])
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1].startswith(f"error: cannot serve /metrics on 127.0.0.1:{port}: ")
    assert list(tmp_path.iterdir()) == [config]  # no buffer file, no store file
