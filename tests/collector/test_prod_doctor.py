"""`prunewatch doctor`: every check against real servers, PASS when healthy, FAIL with a fix otherwise."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import typer
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

from prunewatch.collector.exposition import start_metrics_server
from prunewatch.commands.collect import doctor_command
from prunewatch.records.metrics import CollectorMetrics
from prunewatch.records.store import connect
from prunewatch.records.store.migrate import upgrade
from prunewatch.server.app import create_app
from prunewatch.server.settings import ServerSettings
from tests.collector.prod_helpers import baseline_server, fresh_database, serving
from tests.conftest import calibration_inputs

KEY = "sk-doctor"
HTTP_CHECKS = ["reachable", "auth", "model listed", "pruning headers", "ratio plausible", "calibration",
               "target clock", "store reachable", "store migrated", "store clock", "metrics endpoint"]


def cli() -> typer.Typer:
    app = typer.Typer()
    app.command()(doctor_command)
    return app


def statuses(output: str) -> dict[str, str]:
    found = {}
    for line in output.splitlines():
        match = re.match(r"^(PASS|FAIL|SKIP)\s+(.+?)\s{2,}", line)
        if match:
            found[match.group(2)] = match.group(1)
    return found


def write_config(tmp_path, target: str) -> str:
    path = tmp_path / "targets.yaml"
    path.write_text("collector:\n  metrics_port: 0\ntargets:\n" + target)
    return str(path)


@pytest.fixture(scope="module")
def engine_url(probe_engine):
    with serving(create_app(probe_engine, ServerSettings(api_keys=[KEY]))) as url:
        yield url


@pytest.fixture(scope="module")
def migrated_pg(postgres):
    url = fresh_database(postgres)
    engine = connect(url)
    upgrade(engine)
    engine.dispose()
    return url


@pytest.mark.integration
def test_healthy_prunewatch_target_passes_every_check(tmp_path, monkeypatch, engine_url, probe_engine, migrated_pg):
    monkeypatch.setenv("PW_DOCTOR_KEY", KEY)
    config = write_config(tmp_path, f"  - {{name: gpu-a, kind: prunewatch, base_url: '{engine_url}', "
                                    f"model: {probe_engine.name}, api_key_env: PW_DOCTOR_KEY, sensitivity: 0.5}}\n")
    result = CliRunner().invoke(cli(), ["--target", "gpu-a", "--config", config, "--db", migrated_pg])
    assert result.exit_code == 0, result.output
    assert statuses(result.output) == {name: "PASS" for name in HTTP_CHECKS}
    assert result.output.splitlines()[-1] == "all checks passed"
    assert "key from $PW_DOCTOR_KEY accepted" in result.output and KEY not in result.output
    assert re.search(r"ratio plausible\s+0\.\d{3} at sensitivity 0\.5 \(measured", result.output)


@pytest.mark.integration
def test_each_problem_fails_with_what_to_do(tmp_path, monkeypatch, engine_url, probe_engine, postgres):
    monkeypatch.setenv("PW_DOCTOR_KEY", "sk-wrong")
    unmigrated = fresh_database(postgres)
    config = write_config(tmp_path, f"  - {{name: gpu-a, kind: prunewatch, base_url: '{engine_url}', "
                                    f"model: other-model, api_key_env: PW_DOCTOR_KEY}}\n")
    result = CliRunner().invoke(cli(), ["--target", "gpu-a", "--config", config, "--db", unmigrated])
    assert result.exit_code == 1
    found = statuses(result.output)
    assert (found["reachable"], found["auth"], found["store reachable"], found["store migrated"]) == (
        "PASS", "FAIL", "PASS", "FAIL")
    assert "-> export PW_DOCTOR_KEY=<a key the server accepts>" in result.output
    assert "-> run: prunewatch db upgrade --db 'postgresql+psycopg://prunewatch:***@" in result.output
    assert found["model listed"] == "SKIP" and found["metrics endpoint"] == "SKIP"  # need a working key
    assert result.output.splitlines()[-1] == "2 check(s) failed: auth, store migrated"

    monkeypatch.setenv("PW_DOCTOR_KEY", KEY)  # right key now: the wrong model name shows
    result = CliRunner().invoke(cli(), ["--target", "gpu-a", "--config", config, "--db", unmigrated])
    assert statuses(result.output)["model listed"] == "FAIL"
    assert f"-> set model: to one of ['{probe_engine.name}'] in the targets file" in result.output

    config = write_config(tmp_path, "  - {name: gone, kind: prunewatch, base_url: 'http://127.0.0.1:9', model: m}\n")
    result = CliRunner().invoke(cli(), ["--target", "gone", "--config", config, "--db", unmigrated])
    found = statuses(result.output)
    assert found["reachable"] == "FAIL" and found["auth"] == "SKIP" and found["calibration"] == "SKIP"
    assert "-> start the server or fix base_url; from this host try: curl http://127.0.0.1:9/health" in result.output


def test_baseline_target_and_the_collector_metrics_endpoint(tmp_path):
    store = f"sqlite:///{tmp_path / 'store.db'}"
    engine = connect(store)
    upgrade(engine)
    engine.dispose()
    server, _ = start_metrics_server(CollectorMetrics(CollectorRegistry()), "127.0.0.1", 0)  # as `collect` serves it
    port = server.server_address[1]
    try:
        with baseline_server() as (url, _):
            config = write_config(tmp_path, f"  - {{name: vllm, kind: openai, base_url: '{url}', "
                                            f"model: baseline-model}}\n")
            result = CliRunner().invoke(cli(), ["--target", "vllm", "--config", config, "--db", store,
                                                "--metrics-url", f"http://127.0.0.1:{port}/metrics"])
    finally:
        server.shutdown()
        server.server_close()
    assert result.exit_code == 0, result.output
    assert statuses(result.output) == {
        "reachable": "PASS", "auth": "PASS", "model listed": "PASS", "pruning headers": "PASS",
        "ratio plausible": "SKIP", "calibration": "SKIP", "target clock": "PASS", "store reachable": "PASS",
        "store migrated": "PASS", "metrics endpoint": "PASS"}
    assert "none, as expected of a baseline (ratio recorded as absent)" in result.output
    missing = CliRunner().invoke(cli(), ["--target", "vllm", "--config", config, "--db",
                                         f"sqlite:///{tmp_path / 'nothing.db'}", "--metrics-url",
                                         f"http://127.0.0.1:{port}/metrics"])
    assert missing.exit_code == 1 and not (tmp_path / "nothing.db").exists()  # doctor never creates a store
    assert "-> start the collector (`prunewatch run` or `prunewatch collect` serves /metrics) or pass --metrics-url" in missing.output


def test_in_process_target_calibration_present_missing_and_foreign(tmp_path, probe_engine, calibration_dir):
    from prunewatch.collector.doctor import diagnose_in_process
    from prunewatch.collector.target_config import ResolvedTarget
    from prunewatch.engine import EngineSettings, PruningEngine
    from prunewatch.probes import load_probes

    probe_set = load_probes()
    collecting = PruningEngine.load(EngineSettings(model_dir=probe_engine.settings.model_dir, device="cpu",
                                                   calibration_dir=calibration_dir))
    collecting.load_or_calibrate(*calibration_inputs())  # as `collect` does at start
    spec = ResolvedTarget(name="embedded", kind="in_process", base_url=None, api_key_env=None, model=None,
                          model_dir=probe_engine.settings.model_dir, device="cpu", domains=["tech"], interval_s=60,
                          timeout_s=60, sensitivity=0.5, jitter_s=0)
    checks = {c.name: c for c in diagnose_in_process(spec, probe_set, calibration_dir=calibration_dir)}
    assert {n: c.status for n, c in checks.items()} == {
        "reachable": "PASS", "auth": "SKIP", "model listed": "PASS", "calibration": "PASS",
        "pruning headers": "PASS", "ratio plausible": "PASS"}

    empty = tmp_path / "empty"
    checks = {c.name: c for c in diagnose_in_process(spec, probe_set, calibration_dir=empty)}
    assert checks["calibration"].status == "FAIL" and "no calibration for this model and the calibration set" in checks[
        "calibration"].detail
    assert checks["ratio plausible"].status == "FAIL" and "(fallback: uncalibrated)" in checks["ratio plausible"].detail

    foreign = tmp_path / "foreign"
    shutil.copytree(calibration_dir, foreign)
    for path in foreign.glob("*.json"):  # every block calibration, whichever mechanisms it was made for
        if not path.name.endswith(".sparsity.json"):
            raw = json.loads(path.read_text())
            raw["model_fingerprint"] = "0" * 64
            path.write_text(json.dumps(raw))
    checks = {c.name: c for c in diagnose_in_process(spec, probe_set, calibration_dir=foreign)}
    assert checks["calibration"].status == "FAIL" and "calibration was made for model" in checks["calibration"].detail


def test_without_a_config_file_doctor_checks_the_main_job(tmp_path, monkeypatch, probe_model_dir, collected_sqlite):
    """`prunewatch doctor` alone checks what `prunewatch run` would probe, from the same PRUNEWATCH_* variables: the
    alert runbooks send people there for the main job, which has no targets file."""
    monkeypatch.setenv("HOME", str(tmp_path))  # no calibration cached yet: the one check that must fail
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("PRUNEWATCH_MODEL_DIR", str(probe_model_dir))
    monkeypatch.setenv("PRUNEWATCH_DB_URL", collected_sqlite)
    monkeypatch.setenv("PRUNEWATCH_METRICS_PORT", "0")  # the main job serves no /metrics: nothing to check there
    result = CliRunner().invoke(cli(), [])
    assert result.output.splitlines()[0] == "prunewatch doctor: target embedded (in_process)"
    assert statuses(result.output) == {
        "reachable": "PASS", "auth": "SKIP", "model listed": "PASS", "calibration": "FAIL", "pruning headers": "PASS",
        "ratio plausible": "FAIL", "target clock": "PASS", "store reachable": "PASS", "store migrated": "PASS"}
    assert f"loaded probe-llama from {probe_model_dir}" in result.output
    assert "`prunewatch run` or `prunewatch collect` calibrates at start" in result.output
    assert result.exit_code == 1

    lone = CliRunner().invoke(cli(), ["--target", "gpu-a"])
    assert (lone.exit_code, lone.output.strip()) == (2, "error: --target names a target of a --config file; without "
                                                        "--config doctor checks the main job (`prunewatch run`)")
    config = write_config(tmp_path, "  - name: gpu-a\n    kind: in_process\n")
    unnamed = CliRunner().invoke(cli(), ["--config", config])
    assert (unnamed.exit_code, unnamed.output.strip()) == (2, "error: --config needs --target: the name of the target "
                                                              "to check")
