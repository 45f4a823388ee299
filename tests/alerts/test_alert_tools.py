"""The checks Prometheus users trust, run on the committed files (the same lines .ci/run runs).

    promtool check rules prunewatch/alerts/rules.yml
    promtool test rules prunewatch/alerts/rules_test.yml
    amtool check-config prunewatch/alerts/alertmanager.yml
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from prunewatch.alerts import RuleSettings, render_rules
from prunewatch.alerts.settings import ALERTMANAGER_PATH, RULES_PATH

REPO = RULES_PATH.parents[2]


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed (apt-get install prometheus prometheus-alertmanager)")
    return path


def run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([tool(args[0]), *args[1:]], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_promtool_check_rules() -> None:
    done = run("promtool", "check", "rules", "prunewatch/alerts/rules.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 33 rules found" in done.stdout


def test_promtool_test_rules() -> None:
    done = run("promtool", "test", "rules", "prunewatch/alerts/rules_test.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_promtool_tests_pin_the_thresholds(tmp_path: Path) -> None:
    """A rule file with the red line moved to 0.43 must fail the same tests: they are not vacuous."""
    (tmp_path / "rules.yml").write_text(render_rules(RuleSettings(quality_red_line=0.43)))
    cases = yaml.safe_load((RULES_PATH.parent / "rules_test.yml").read_text())
    cases["tests"] = [t for t in cases["tests"] if t["name"].startswith("PruningRatioQualityRisk")]
    (tmp_path / "rules_test.yml").write_text(yaml.safe_dump(cases))
    done = run("promtool", "test", "rules", "rules_test.yml", cwd=tmp_path)
    assert done.returncode != 0
    assert "PruningRatioQualityRisk" in done.stdout + done.stderr


def test_amtool_check_config() -> None:
    done = run("amtool", "check-config", "prunewatch/alerts/alertmanager.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 inhibit rules" in done.stdout and "2 receivers" in done.stdout


@pytest.mark.parametrize("labels, receiver", [
    (["severity=critical", "alertname=ProbeFailing"], "slack-critical"),
    (["severity=warning", "alertname=PruningRatioLow"], "slack-warning"),
    (["alertname=Unlabelled"], "slack-warning"),
])
def test_routes_by_severity(labels: list[str], receiver: str) -> None:
    done = run("amtool", "config", "routes", "test", f"--config.file={ALERTMANAGER_PATH}", *labels)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == receiver


SLO_CASES = [
    {"name": "LatencySLOBreached: p99 over a configured 1.3 s for 10m",
     "interval": "1m",
     "input_series": [{"series": f'prunewatch_inference_latency_seconds_bucket{{model="m",domain="legal",le="{le}"}}',
                       "values": values}
                      for le, values in (("0.1", "0x40"), ("0.3", "0x40"), ("0.5", "0x40"), ("0.8", "0x40"),
                                         ("1.2", "0x40"), ("2.0", "0+1x40"), ("5.0", "0+1x40"), ("+Inf", "0+1x40"))],
     "times": ("9m", "16m")},
    {"name": "LatencyPerTokenSLOBreached: 15 min average time per output token over a configured 0.08 s",
     "interval": "1m",
     "input_series": [{"series": 'prunewatch_time_per_output_token_seconds{model="m",domain="legal",probe="p"}',
                       "values": "0.05x9 0.2x40"}],
     "times": ("14m", "30m")},
]


def test_configured_slos_are_rules_promtool_and_the_embedded_evaluator_agree_on(tmp_path: Path) -> None:
    """The seeds' per-request SLO and a per-token SLO, rendered only where configured: the embedded evaluator's
    alerts (annotations included) at each time are written as the expectation, and promtool must pass them."""
    from datetime import timedelta

    from prunewatch.alerts import AlertingSettings, EmbeddedAlerting
    from prunewatch.alerts.durations import parse_duration
    from tests.alerts.promtool_cases import EPOCH, results_for
    from tests.alerts.test_alert_conformance import _store

    rules = tmp_path / "rules.yml"
    rules.write_text(render_rules(RuleSettings(latency_slo_s=1.3, latency_per_token_slo_s=0.08)))
    tests = []
    for index, case in enumerate(SLO_CASES):
        alertname = case["name"].split(":")[0]
        folder = tmp_path / str(index)
        folder.mkdir()
        store = _store(folder, results_for(case))
        alerting = EmbeddedAlerting(AlertingSettings(rules_path=rules, state_path=None), store)
        checks = []
        last = parse_duration(case["times"][-1])
        for minute in range(int(last / timedelta(minutes=1)) + 1):
            alerting.evaluate(EPOCH + timedelta(minutes=minute))
            if f"{minute}m" in case["times"]:
                got = [a for a in alerting.evaluator.alerts("firing") if a.rule == alertname]
                checks.append({"eval_time": f"{minute}m", "alertname": alertname, "exp_alerts": [
                    {"exp_labels": {k: v for k, v in a.labels if k != "alertname"}, "exp_annotations": a.annotations}
                    for a in got]})
        assert [len(c["exp_alerts"]) for c in checks] == [0, 1], alertname  # silent first, then firing
        tests.append({"name": case["name"], "interval": case["interval"], "input_series": case["input_series"],
                      "alert_rule_test": checks})
    (tmp_path / "rules_test.yml").write_text(yaml.safe_dump(
        {"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": tests}, sort_keys=False, width=1000))
    assert run("promtool", "check", "rules", "rules.yml", cwd=tmp_path).returncode == 0
    done = run("promtool", "test", "rules", "rules_test.yml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "configured SLO 1.3 s" in (tmp_path / "rules_test.yml").read_text()
