"""The governor holds the floor on a real in-process engine, through the production collector's round loop.

Measured first (bundled probe model, default engine settings as `prunewatch serve` runs them, the two
`tech` probes cut to 8 new tokens, calibrated on the canonical probes): mean token agreement 0.75 at
sensitivity 1.0, 1.0 at 0.6 and at 0.5 (and 1.0 by construction at 0, where the model runs dense).
So the floor is the governor's default 0.95: sensitivity 1 cannot meet it, 0.5 clears it with the
0.02 margin. With step_down 0.5 the first round (at 1.0) breaches and the second runs at 0.5; even if
0.5 breached too, 0.0 (dense) would meet any floor, so quality is back within three rounds whatever
the engine does. Relaxing is one 0.05 step per good round (relax_after 1, to keep the test short).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import replace

import pytest
import yaml
from prometheus_client import CollectorRegistry
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from prunewatch.alerts.settings import RULES_PATH
from prunewatch.collector.fleet import FleetSettings, run_collector
from prunewatch.collector.governor import BREACH, RELAX, GovernorSettings, decide, governed
from prunewatch.collector.scheduler import TargetJob
from prunewatch.collector.targets import InProcessTarget
from prunewatch.probes import ProbeSet, load_probes
from prunewatch.records.metrics import CollectorMetrics
from prunewatch.records.store import ResultRepository, connect
from prunewatch.records.store.governor import GovernorRepository
from tests.conftest import calibration_inputs

FLOOR = 0.95
SETTINGS = GovernorSettings(floor=FLOOR, margin=0.02, step_down=0.5, step_up=0.05, relax_after=1)
ROUNDS = 4
DOMAIN = "tech"


@pytest.fixture(scope="module")
def default_engine(probe_model_dir, tmp_path_factory):
    """The engine with its default settings (what `prunewatch serve` runs), calibrated on the canonical probes."""
    from prunewatch.engine import EngineSettings, PruningEngine

    engine = PruningEngine.load(EngineSettings(model_dir=probe_model_dir, device="cpu",
                                               calibration_dir=tmp_path_factory.mktemp("calibration")))
    engine.load_or_calibrate(*calibration_inputs())
    return engine


def tech_probes() -> ProbeSet:
    return ProbeSet(tuple(replace(p, max_tokens=8) for p in load_probes().by_domain()[DOMAIN]), "governor test")


def test_governor_brings_agreement_back_to_the_floor_and_relaxes(default_engine, tmp_path):
    url = f"sqlite:///{tmp_path / 'governed.db'}"
    (target,) = governed([InProcessTarget(default_engine, name="embedded", sensitivity=1.0)], {"embedded": SETTINGS})
    metrics = CollectorMetrics(CollectorRegistry())
    labels = {"target": "embedded", "domain": DOMAIN}
    clamps = lambda: metrics.registry.get_sample_value("prunewatch_governor_clamps_total", labels)  # noqa: E731
    scraped: list[float] = []  # the clamp counter after each round, as a scrape between rounds sees it
    outcome = run_collector(FleetSettings(db_url=url, buffer_path=tmp_path / "buffer.sqlite", rounds=ROUNDS,
                                          metrics_port=0), [TargetJob(target, tech_probes(), interval_s=1.0)],
                            metrics=metrics, on_round=lambda _summary: scraped.append(clamps()))
    assert (outcome.rounds, outcome.failures, outcome.buffered) == (ROUNDS, 0, 0)

    store = connect(url)
    with Session(store) as session:
        decisions = GovernorRepository(session).history(target="embedded")
        results = ResultRepository(session).list()
    store.dispose()
    by_round: dict[str, list] = {}
    for r in results:
        by_round.setdefault(r.round_id, []).append(r)
    assert len(decisions) == ROUNDS and all(d.domain == DOMAIN and d.model == default_engine.name for d in decisions)

    # Each decision explains its step: the round ran at its old setting, its agreement is that round's
    # stored mean, and the new setting is what the rule gives for that evidence.
    good = 0
    for d in decisions:
        ran = by_round[d.round_id]
        assert {r.sensitivity for r in ran} == {d.old_setting} and d.probes == len(ran) == 2
        assert d.agreement == pytest.approx(sum(r.continuation_agreement for r in ran) / len(ran), abs=1e-6)
        assert (d.new_setting, d.reason, d.good_rounds) == decide(SETTINGS, d.old_setting, d.agreement, d.probes, good)
        good = d.good_rounds
    trail = [(d.old_setting, d.reason, d.new_setting) for d in decisions]

    # Round 1 at sensitivity 1 breaches the floor and is lowered at once, by one bounded step.
    assert decisions[0].agreement < FLOOR, trail
    assert (decisions[0].old_setting, decisions[0].reason, decisions[0].new_setting) == (1.0, BREACH, 0.5)
    # Within a bounded number of rounds the stored agreement is back at or above the floor ...
    back = next(i for i, d in enumerate(decisions) if d.agreement >= FLOOR)
    assert back <= 2, trail
    # ... and once the breach has cleared, the governor relaxes step by step (measured: 0.5 -> 0.65).
    assert trail[1:] == [(0.5, RELAX, 0.55), (0.55, RELAX, 0.6), (0.6, RELAX, 0.65)], trail
    # The clamp happened exactly once: one breach row, one increment of the counter PruningGovernorClamped reads.
    assert [d.reason for d in decisions].count(BREACH) == 1
    assert clamps() == 1.0 and scraped == [1.0, 1.0, 1.0, 1.0]
    assert_clamp_alert_fires_once(scraped, tmp_path)
    assert_embedded_clamp_alert_fires_once(url, decisions)
    assert metrics.registry.get_sample_value("prunewatch_governor_setting", labels) == 0.65

    # `prunewatch governor status` prints the policy in force and why.
    from prunewatch.cli import app

    done = CliRunner().invoke(app, ["governor", "status", "--db", url, "--target", "embedded"])
    assert done.exit_code == 0, done.output
    assert f"embedded / {default_engine.name} / tech: sensitivity 0.65" in done.output
    assert "why: relax (0.6 -> 0.65)" in done.output and "floor 0.95" in done.output


def assert_clamp_alert_fires_once(scraped: list[float], tmp_path) -> None:
    """The committed rule over the counter history this run produced (0 before the first round, then one
    sample per round a minute apart, then unchanged): promtool sees PruningGovernorClamped fire at the
    first round and stay firing until the clamp leaves its 15m window: one episode, no second one."""
    rules = yaml.safe_load(RULES_PATH.read_text())
    (rule,) = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "PruningGovernorClamped"]
    annotations = {k: v.replace("{{ $labels.target }}", "embedded").replace("{{ $labels.domain }}", DOMAIN)
                   .replace('{{ $value | printf "%.0f" }}', "1") for k, v in rule["annotations"].items()}
    firing = [{"exp_labels": {"target": "embedded", "domain": DOMAIN, "severity": "warning"},
               "exp_annotations": annotations}]
    values = " ".join(f"{v:g}" for v in [0.0, *scraped]) + f" {scraped[-1]:g}x25"
    case = {"rule_files": [str(RULES_PATH)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": f'prunewatch_governor_clamps_total{{target="embedded",domain="{DOMAIN}"}}',
                          "values": values}],
        "alert_rule_test": [{"eval_time": f"{m}m", "alertname": "PruningGovernorClamped",
                             "exp_alerts": firing if 1 <= m <= 15 else []} for m in range(0, 26)],
    }]}
    (tmp_path / "clamp_test.yml").write_text(yaml.safe_dump(case))
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed (apt-get install prometheus)"
    done = subprocess.run([promtool, "test", "rules", str(tmp_path / "clamp_test.yml")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def assert_embedded_clamp_alert_fires_once(url: str, decisions: list) -> None:
    """Without Prometheus: the embedded evaluator reads the same run's stored decisions and fires
    PruningGovernorClamped once, at the breach's round, and resolves it when the breach leaves the window."""
    from datetime import timedelta

    from prunewatch.alerts import AlertingSettings, EmbeddedAlerting

    store = connect(url)
    alerting = EmbeddedAlerting(AlertingSettings(state_path=None), store)
    assert "PruningGovernorClamped" not in {rule.name for rule in alerting.unsupported}
    start = decisions[0].decided_at
    kinds = []
    for minute in range(0, 20):
        evaluation = alerting.evaluate(start + timedelta(minutes=minute, seconds=1))
        kinds += [(minute, t.kind) for t in evaluation.transitions if t.alert.rule == "PruningGovernorClamped"]
    store.dispose()
    assert kinds == [(0, "firing"), (15, "resolved")], kinds
