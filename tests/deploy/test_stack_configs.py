"""The local stack's generated configs, checked by the same tools as the compose configs, and its settings."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from prunewatch.alerts.settings import ALERTMANAGER_PATH, RULES_PATH
from prunewatch.engine.model_store import PROBE_MODEL_DIR
from prunewatch.stack import configs
from prunewatch.stack.settings import StackSettings

ENGINES = [configs.EngineEndpoint("engine-a", 18001), configs.EngineEndpoint("engine-b", 18002)]


def _tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed (apt-get install {package})")
    return path


def test_generated_prometheus_config_passes_promtool_with_the_committed_rules(tmp_path):
    key = configs.engine_api_key(tmp_path / "secrets")
    engines_file = configs.write_json(tmp_path / "engines.json", configs.engines_file_sd(ENGINES))
    path = configs.write_yaml(tmp_path / "prometheus.yml", configs.prometheus_config(
        collector_port=19464, engines_file=engines_file, alertmanager_port=19093, key_file=key, scrape_interval_s=1))
    done = subprocess.run([_tool("promtool", "prometheus"), "check", "config", str(path)], check=False,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    rules = sum(len(group["rules"]) for group in yaml.safe_load(RULES_PATH.read_text())["groups"])
    assert f"Checking {RULES_PATH}" in done.stdout and f"SUCCESS: {rules} rules found" in done.stdout
    config = yaml.safe_load(path.read_text())
    assert config["global"] == {"scrape_interval": "1s", "evaluation_interval": "1s"}
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {configs.COLLECTOR_JOB, configs.ENGINE_JOB}
    assert jobs[configs.ENGINE_JOB]["authorization"] == {"type": "Bearer", "credentials_file": str(key)}
    assert json.loads(engines_file.read_text()) == [
        {"targets": ["127.0.0.1:18001"], "labels": {"engine": "engine-a"}},
        {"targets": ["127.0.0.1:18002"], "labels": {"engine": "engine-b"}}]


def test_alertmanager_config_keeps_the_routes_and_points_each_receiver_at_the_sink(tmp_path):
    config, written = configs.alertmanager_config(tmp_path / "secrets", 19099, group_wait_s=1)
    committed = yaml.safe_load(ALERTMANAGER_PATH.read_text())
    assert config["route"] == {**committed["route"], "group_wait": "1s"}
    assert config["inhibit_rules"] == committed["inhibit_rules"]
    assert sorted(p.name for p in written) == ["slack-critical-webhook-url", "slack-warning-webhook-url"]
    for path in written:
        assert path.read_text() == f"http://127.0.0.1:19099/{path.name}\n"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    files = {r["name"]: r["slack_configs"][0]["api_url_file"] for r in config["receivers"]}
    assert files == {"slack-critical": str(tmp_path / "secrets" / "slack-critical-webhook-url"),
                     "slack-warning": str(tmp_path / "secrets" / "slack-warning-webhook-url")}
    path = configs.write_yaml(tmp_path / "alertmanager.yml", config)
    done = subprocess.run([_tool("amtool", "prometheus-alertmanager"), "check-config", str(path)], check=False,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    unchanged, _ = configs.alertmanager_config(tmp_path / "other", 19099, group_wait_s=None)
    assert unchanged["route"]["group_wait"] == committed["route"]["group_wait"] == "30s"


def test_targets_file_loads_as_one_http_target_per_engine(tmp_path, monkeypatch):
    from prunewatch.collector.target_config import load_targets

    path = configs.write_yaml(tmp_path / "targets.yaml", configs.targets_config(
        ENGINES, model="probe-llama", probes_path=Path("/p.yaml"), buffer_path=tmp_path / "b.sqlite",
        metrics_port=19464, interval_s=3, timeout_s=60, sensitivity=0.4))
    monkeypatch.setenv(configs.TARGET_KEY_ENV, "secret")
    loaded = load_targets(path)
    assert [(t.name, t.kind, t.base_url, t.model, t.interval_s, t.timeout_s, t.sensitivity, t.api_key())
            for t in loaded.targets] == [
        ("engine-a", "prunewatch", "http://127.0.0.1:18001", "probe-llama", 3.0, 60.0, 0.4, "secret"),
        ("engine-b", "prunewatch", "http://127.0.0.1:18002", "probe-llama", 3.0, 60.0, 0.4, "secret")]
    assert (loaded.collector.metrics_port, loaded.collector.probes_path) == (19464, Path("/p.yaml"))


def test_engine_key_is_made_once_and_kept_private(tmp_path):
    first = configs.engine_api_key(tmp_path)
    key = first.read_text()
    assert len(key.strip()) == 43 and stat.S_IMODE(first.stat().st_mode) == 0o600  # 32 random bytes, base64url
    assert configs.engine_api_key(tmp_path).read_text() == key  # the next `stack up` keeps it


def test_stack_defaults_match_the_collector_and_bad_input_is_one_line():
    from prunewatch.collector.settings import CollectorSettings

    assert StackSettings().model_dir == CollectorSettings().model_dir == PROBE_MODEL_DIR
    done = subprocess.run([sys.executable, "-m", "prunewatch.stack", "up", "--engines", "0"], check=False,
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (2, "error: engines: Input should be greater than or equal to 1 (got 0)\n")
    done = subprocess.run([sys.executable, "-m", "prunewatch.stack", "up", "--model", "/nonexistent"], check=False,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr == ("error: model_dir: Value error, /nonexistent has no config.json "
                           "(not a Hugging Face model folder) (got PosixPath('/nonexistent'))\n")
