"""The `prunewatch alerts` command functions, mounted on a local app as the lead mounts them."""

from __future__ import annotations

import os
import sqlite3
from datetime import timedelta
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from prunewatch.alerts import RULES_PATH
from prunewatch.commands.alerts import check_command, eval_command, render_rules_command, thresholds_command
from prunewatch.records.operating_range import range_path
from tests.alerts.conftest import T0, measured_range, result, store_results

app = typer.Typer()
app.command("render-rules")(render_rules_command)
app.command("check")(check_command)
app.command("eval")(eval_command)
app.command("thresholds")(thresholds_command)


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    for name in list(os.environ):
        if name.startswith(("PRUNEWATCH_RULE_", "PRUNEWATCH_ALERT_")):
            monkeypatch.delenv(name)
    return CliRunner()


def test_render_rules_writes_and_checks(runner: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "rules.yml"
    assert runner.invoke(app, ["render-rules", "--out", str(out)]).exit_code == 0
    assert out.read_text() == RULES_PATH.read_text()
    assert runner.invoke(app, ["render-rules", "--out", str(out), "--check"]).exit_code == 0
    out.write_text(out.read_text().replace("> 0.44", "> 0.4"))
    stale = runner.invoke(app, ["render-rules", "--out", str(out), "--check"])
    assert stale.exit_code == 1 and "differs from the rendered rules" in stale.output


def test_render_rules_refuses_bad_thresholds_in_one_line(runner: CliRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRUNEWATCH_RULE_LATENCY_SLO_S", "-1")
    done = runner.invoke(app, ["render-rules"])
    assert done.exit_code == 2
    assert done.output.strip() == \
        "error: invalid rule settings: latency_slo_s: Input should be greater than 0 (got '-1')"


def test_check_lists_what_only_prometheus_evaluates(runner: CliRunner) -> None:
    done = runner.invoke(app, ["check"])
    assert done.exit_code == 0, done.output
    assert "15 evaluated, 1 Prometheus only, 2 inhibit rules" in done.output
    assert "measured, on(model)" in done.output and "fallback" in done.output
    assert "CollectorBufferBacklog" in done.output and "Prometheus only" in done.output
    governor = next(line for line in done.output.splitlines() if "PruningGovernorClamped" in line)
    assert "evaluated" in governor and "Prometheus only" not in governor  # from the stored decisions


@pytest.mark.parametrize("kind", ["alert", "record"])
def test_check_refuses_an_expression_that_is_not_promql(runner: CliRunner, tmp_path: Path, kind: str) -> None:
    rules = tmp_path / "rules.yml"
    rules.write_text(f"groups:\n- name: g\n  rules:\n  - {kind}: Broken\n    expr: sum(rate(foo[5m])\n")
    done = runner.invoke(app, ["check", "--rules", str(rules)])
    assert done.exit_code == 2 and len(done.output.strip().splitlines()) == 1
    assert done.output.startswith("error: rule ") and "Broken" in done.output and "sum(rate(foo[5m])" in done.output
    assert "Prometheus only" not in done.output  # Prometheus refuses it as well: the file is invalid


def test_check_rejects_a_missing_file(runner: CliRunner, tmp_path: Path) -> None:
    done = runner.invoke(app, ["check", "--rules", str(tmp_path / "nope.yml")])
    assert done.exit_code == 2 and done.output.startswith("error: cannot read rule file")


def test_eval_shows_alerts_whose_condition_holds(runner: CliRunner, store, tmp_path: Path) -> None:
    store_results(store, [result(T0, "legal", p, ratio=0.6) for p in ("legal-1", "legal-2")])
    url = str(store.url)
    ranges = tmp_path / "ranges"  # none: the fallbacks
    done = runner.invoke(app, ["eval", "--db", url, "--at", (T0 + timedelta(seconds=5)).isoformat(),
                               "--ranges", str(ranges)])
    assert done.exit_code == 0, done.output
    assert done.output.count("PruningRatioQualityRisk (") == 2 and "pending" in done.output  # warning, critical
    assert "0.6" in done.output and "measured thresholds: none" in done.output
    assert "source=fallback" in done.output and "0.45 is a fallback" in " ".join(done.output.split())
    bad = runner.invoke(app, ["eval", "--db", url, "--at", "yesterday"])
    assert bad.exit_code == 2 and "is not an ISO 8601 time" in bad.output


def test_eval_refuses_a_store_that_is_not_there_or_empty_and_writes_nothing(runner: CliRunner, tmp_path: Path) -> None:
    missing = tmp_path / "missing.db"
    done = runner.invoke(app, ["eval", "--db", f"sqlite:///{missing}"])
    assert done.exit_code == 2
    assert done.output.strip() == (f"error: no result store at {missing} (the SQLite file does not exist); "
                                   f"`prunewatch run --db sqlite:///{missing}` creates and fills one")
    assert not missing.exists()
    empty = tmp_path / "empty.db"
    empty.touch()
    done = runner.invoke(app, ["eval", "--db", f"sqlite:///{empty}"])
    assert done.exit_code == 2 and len(done.output.strip().splitlines()) == 1
    assert done.output.startswith(f"error: store sqlite:///{empty} has no probe results table;")
    with sqlite3.connect(empty) as connection:  # the evaluation created nothing in it
        assert connection.execute("SELECT name FROM sqlite_master").fetchall() == []


def test_eval_and_thresholds_read_the_models_measured_ranges(runner: CliRunner, store, tmp_path: Path) -> None:
    """A model with a measured range is held to its own lines, quoted with their source; `thresholds` lists them."""
    ranges = tmp_path / "ranges"
    measured = measured_range(ratio=0.12, ratio_max=0.15)  # red line 1.5 x 0.15, risk 2 x 0.15
    measured.save(range_path(ranges, measured.model, measured.model_fingerprint))
    store_results(store, [result(T0, "legal", p, ratio=0.25) for p in ("legal-1", "legal-2")])
    done = runner.invoke(app, ["eval", "--db", str(store.url), "--at", (T0 + timedelta(seconds=5)).isoformat(),
                               "--ranges", str(ranges)])
    assert done.exit_code == 0, done.output
    text = " ".join(done.output.split())
    assert "measured thresholds: probe-llama" in text
    assert "source=calibration" in text and "source=fallback" not in text
    assert "above the red line 0.225, measured for probe-llama (calibration;" in text  # 0.25 > 0.225, < risk 0.3
    assert text.count("PruningRatioQualityRisk (") == 1
    listed = runner.invoke(app, ["thresholds", "--ranges", str(ranges)])
    assert listed.exit_code == 0, listed.output
    flat = " ".join(listed.output.split())
    for kind in ("ratio_low", "ratio_red_line", "ratio_risk", "quality_floor", "tpot_vs_dense_max"):
        assert kind in flat
    assert "0.5 x the mean pruning ratio 0.1200" in flat
    empty = runner.invoke(app, ["thresholds", "--ranges", str(tmp_path / "none")])
    assert empty.exit_code == 0 and "the rules use their fallbacks" in empty.output
