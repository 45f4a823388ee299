"""The targets file: defaults, resolution and one clear line per mistake."""

from __future__ import annotations

import textwrap

import pytest

from prunewatch.collector.fleet import build_jobs
from prunewatch.collector.target_config import TargetConfigError, load_targets
from prunewatch.engine.model_store import PROBE_MODEL_DIR
from tests.collector.prod_helpers import PROBES

GOOD = """
collector:
  db_url: postgresql+psycopg://prunewatch@db/prunewatch
  metrics_port: 9500
defaults:
  interval_s: 30
  timeout_s: 20
  sensitivity: 0.4
  jitter_s: 2
targets:
  - name: embedded
    kind: in_process
    device: cpu
  - name: gpu-a
    kind: prunewatch
    base_url: http://10.0.0.5:8000/
    api_key_env: PW_TEST_KEY
    model: probe-llama
    domains: [legal, tech]
    interval_s: 10
    sensitivity: 0.6
  - name: vllm
    kind: openai
    base_url: https://vllm.internal:8443
    model: meta-llama/Llama-3.1-8B-Instruct
    timeout_s: 5
"""


def write(tmp_path, body: str):
    path = tmp_path / "targets.yaml"
    path.write_text(textwrap.dedent(body))
    return path


def test_defaults_apply_and_keys_come_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PW_TEST_KEY", "sk-secret")
    config = load_targets(write(tmp_path, GOOD))
    embedded, gpu, vllm = config.targets
    assert (embedded.kind, embedded.interval_s, embedded.timeout_s, embedded.sensitivity, embedded.jitter_s,
            embedded.model_dir, embedded.device) == ("in_process", 30.0, 20.0, 0.4, 2.0, PROBE_MODEL_DIR, "cpu")
    assert (gpu.base_url, gpu.interval_s, gpu.timeout_s, gpu.sensitivity, gpu.domains) == (
        "http://10.0.0.5:8000", 10.0, 20.0, 0.6, ["legal", "tech"])
    assert gpu.api_key() == "sk-secret" and "sk-secret" not in repr(config)
    assert (vllm.sensitivity, vllm.timeout_s, vllm.api_key()) == (None, 5.0, None)  # a baseline never prunes
    assert config.collector.metrics_port == 9500


def test_http_jobs_carry_schedule_and_probe_subset(tmp_path, monkeypatch):
    monkeypatch.setenv("PW_TEST_KEY", "sk-secret")
    config = load_targets(write(tmp_path, GOOD))
    gpu, vllm = build_jobs(config, PROBES, only=["gpu-a", "vllm"])
    assert [p.domain for p in gpu.probe_set.probes] == ["legal", "legal", "tech", "tech"]
    assert (gpu.interval_s, gpu.timeout_s, gpu.jitter_s) == (10.0, 20.0, 2.0)
    assert gpu.target.pruning_headers() == {"X-Pruning-Sensitivity": "0.6", "X-Pruning-Quality": "on"}
    assert vllm.target.pruning_headers() == {} and len(vllm.probe_set.probes) == 6


BAD = [
    ("targets: []\n", "targets: List should have at least 1 item after validation, not 0"),
    ("targets:\n  - {name: a, kind: grpc, base_url: 'http://x'}\n",
     "targets[0] (a): kind: Input should be 'in_process', 'prunewatch' or 'openai'"),
    ("targets:\n  - {name: a, kind: prunewatch, model: m}\n", "targets[0] (a): base_url is required for a prunewatch target"),
    ("targets:\n  - {name: a, kind: prunewatch, base_url: 'http://x:1'}\n",
     "targets[0] (a): model is required for a prunewatch target (the id GET /v1/models lists)"),
    ("targets:\n  - {name: a, kind: openai, base_url: 'http://x:1', model: m, sensitivity: 0.5}\n",
     "targets[0] (a): an openai (baseline) target does not prune; remove sensitivity"),
    ("targets:\n  - {name: a, kind: prunewatch, base_url: 'ftp://x', model: m}\n",
     "targets[0] (a): base_url: must be an http:// or https:// URL, got 'ftp://x'"),
    ("targets:\n  - {name: a, kind: prunewatch, base_url: 'http://x/v1', model: m}\n",
     "targets[0] (a): base_url: give the server's base URL without /v1 (the collector adds /v1/...)"),
    ("targets:\n  - {name: a, kind: in_process, timeout_s: 0}\n",
     "targets[0] (a): timeout_s: Input should be greater than 0"),
    ("targets:\n  - {name: a, kind: in_process, base_url: 'http://x:1'}\n",
     "targets[0] (a): base_url does not apply to an in_process target"),
    ("targets:\n  - {name: a, kind: in_process}\n  - {name: a, kind: in_process}\n",
     "targets.yaml: target name 'a' appears twice"),
    ("targets:\n  - {name: a, kind: in_process, colour: red}\n", "targets[0] (a): colour: Extra inputs are not permitted"),
    ("targets:\n  - {name: 'bad name', kind: in_process}\n",
     "targets[0] (bad name): name: String should match pattern '^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$'"),
    ("targets:\n  - {name: a, kind: prunewatch, base_url: 'http://x:1', model: m, api_key_env: PW_UNSET_VAR}\n",
     "target a: environment variable PW_UNSET_VAR (api_key_env) is not set or empty"),
    ("defaults: {interval_s: 0.5}\ntargets:\n  - {name: a, kind: in_process}\n",
     "defaults.interval_s: Input should be greater than or equal to 1"),
    ("- just a list\n", "expected a mapping with a 'targets' list"),
    ("targets: [\n", "cannot read targets file"),
]


@pytest.mark.parametrize("body, message", BAD, ids=[m[:40] for _, m in BAD])
def test_each_mistake_is_one_line_naming_where(tmp_path, monkeypatch, body, message):
    monkeypatch.delenv("PW_UNSET_VAR", raising=False)
    path = write(tmp_path, body)
    with pytest.raises(TargetConfigError) as error:
        load_targets(path)
    text = str(error.value)
    assert "\n" not in text and message in text and str(path) in text


def test_unknown_domain_and_unknown_target_name(tmp_path):
    config = load_targets(write(tmp_path, "targets:\n  - {name: a, kind: openai, base_url: 'http://x:1', model: m, "
                                          "domains: [medicine]}\n"))
    with pytest.raises(TargetConfigError, match=r"target a: domains: unknown domain\(s\) \['medicine'\]"):
        build_jobs(config, PROBES)
    with pytest.raises(TargetConfigError, match=r"no target named 'b'; the file has \['a'\]"):
        config.target("b")
    with pytest.raises(TargetConfigError, match="targets file not found"):
        load_targets(tmp_path / "missing.yaml")


def test_fleet_settings_hide_the_password_and_order_the_backoff():
    from pydantic import ValidationError

    from prunewatch.collector.fleet import FleetSettings

    settings = FleetSettings(db_url="postgresql+psycopg://prunewatch:s3cret@db:5432/prunewatch")
    assert "s3cret" not in repr(settings) and "s3cret" not in str(settings)
    assert settings.store_fingerprint() == "postgresql+psycopg://prunewatch:***@db:5432/prunewatch"
    with pytest.raises(ValidationError, match=r"backoff_initial_s \(5.0\) exceeds backoff_max_s \(1.0\)"):
        FleetSettings(backoff_initial_s=5, backoff_max_s=1)
