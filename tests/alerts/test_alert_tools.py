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
