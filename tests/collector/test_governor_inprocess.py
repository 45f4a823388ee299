"""The governor holds the floor on a real in-process engine, through the production collector's round loop.

Measured first (bundled probe model, layer bypass and head gating switched on hard: influence budget 0.5, head
budget 0.1; the two canonical `finance` prompts cut to 12 new tokens; answers scored against the engine's own
weights run dense): reference-scored agreement 0.833 and 0.417 at sensitivity 1.0, 1.0 and 1.0 from 0.0 to 0.15.
So the floor is the governor's default 0.95 and the two prompts decide by their estimate (decisive_prompts 2):
sensitivity 1 breaches it. With step_down 1.0 the first round (at 1.0) breaches and the second runs dense, which
meets any floor, so quality is back in the next round whatever the engine does. Relaxing is one 0.05 step per good
round (relax_after 1, to keep the test short); the evidence starts afresh at each new setting.
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
from prunewatch.collector.in_process import InProcessTarget
from prunewatch.collector.scheduler import TargetJob
from prunewatch.probes import ProbeSet, load_probes
from prunewatch.records.intervals import bootstrap_share
from prunewatch.records.metrics import CollectorMetrics
from prunewatch.records.store import ResultRepository, connect
from prunewatch.records.store.governor import GovernorRepository
from tests.conftest import calibration_inputs

FLOOR = 0.95
SETTINGS = GovernorSettings(floor=FLOOR, margin=0.02, step_down=1.0, step_up=0.05, relax_after=1,
                            decisive_prompts=2)
ROUNDS = 4
DOMAIN = "finance"
PRUNE_HARD = {"influence_budget": 0.5, "head_gating": True, "head_budget": 0.1}


@pytest.fixture(scope="module")
def hard_engine(probe_model_dir, calibration_dir):
    """The engine with layer bypass and head gating on hard, calibrated on the calibration set."""
    from prunewatch.engine import EngineSettings, PruningEngine

    engine = PruningEngine.load(EngineSettings(model_dir=probe_model_dir, device="cpu",
                                               calibration_dir=calibration_dir, **PRUNE_HARD))
    engine.load_or_calibrate(*calibration_inputs())
    return engine


def domain_probes() -> ProbeSet:
    return ProbeSet(tuple(replace(p, max_tokens=12) for p in load_probes().by_domain()[DOMAIN]), "governor test")


def test_governor_brings_agreement_back_to_the_floor_and_relaxes(hard_engine, tmp_path):
    url = f"sqlite:///{tmp_path / 'governed.db'}"
    (target,) = governed([InProcessTarget(hard_engine, name="embedded", sensitivity=1.0)], {"embedded": SETTINGS})
    metrics = CollectorMetrics(CollectorRegistry())
    labels = {"target": "embedded", "domain": DOMAIN}

    def clamps() -> float | None:
        return metrics.registry.get_sample_value("prunewatch_governor_clamps_total", labels)

    scraped: list[float] = []  # the clamp counter after each round, as a scrape between rounds sees it
    outcome = run_collector(FleetSettings(db_url=url, buffer_path=tmp_path / "buffer.sqlite", rounds=ROUNDS,
                                          metrics_port=0), [TargetJob(target, domain_probes(), interval_s=1.0)],
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
    assert len(decisions) == ROUNDS and all(d.domain == DOMAIN and d.model == hard_engine.name for d in decisions)

    # Each decision explains its step: the round ran at its old setting, its evidence is the pooled agreement of
    # the answers served at that setting (a new setting each round here), and the new setting is what the rule
    # gives for that evidence.
    good = 0
    for d in decisions:
        ran = by_round[d.round_id]
        assert {r.sensitivity for r in ran} == {d.old_setting} and d.probes == len(ran) == 2
        interval = bootstrap_share([round(r.reference_agreement * r.reference_tokens) for r in ran],
                                   [r.reference_tokens for r in ran])
        assert (d.agreement, d.agreement_low, d.agreement_high, d.tokens) == (
            round(interval.estimate, 6), round(interval.low, 6), round(interval.high, 6), interval.tokens)
        assert (d.new_setting, d.reason, d.good_rounds) == decide(SETTINGS, d.old_setting, interval, good)
        good = d.good_rounds
    trail = [(d.old_setting, d.reason, d.new_setting) for d in decisions]

    # Round 1 at sensitivity 1 breaches the floor and is lowered at once, by one bounded step (to dense here).
    assert decisions[0].agreement < FLOOR, trail
    assert (decisions[0].old_setting, decisions[0].reason, decisions[0].new_setting) == (1.0, BREACH, 0.0)
    # The next round is back at the floor, and from there the governor relaxes step by step (measured: 0 -> 0.15).
    assert decisions[1].agreement >= FLOOR, trail
    assert trail[1:] == [(0.0, RELAX, 0.05), (0.05, RELAX, 0.1), (0.1, RELAX, 0.15)], trail
    # The clamp happened exactly once: one breach row, one increment of the counter PruningGovernorClamped reads.
    assert [d.reason for d in decisions].count(BREACH) == 1
    assert clamps() == 1.0 and scraped == [1.0, 1.0, 1.0, 1.0]
    assert_clamp_alert_fires_once(scraped, tmp_path)
    assert_embedded_clamp_alert_fires_once(url, decisions)
    assert metrics.registry.get_sample_value("prunewatch_governor_setting", labels) == 0.15

    # `prunewatch governor status` prints the policy in force and why.
    from prunewatch.cli import app

    done = CliRunner().invoke(app, ["governor", "status", "--db", url, "--target", "embedded"])
    assert done.exit_code == 0, done.output
    assert f"embedded / {hard_engine.name} / {DOMAIN}: sensitivity 0.15" in done.output
    assert "why: relax (0.1 -> 0.15)" in done.output and "floor 0.95" in done.output


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
