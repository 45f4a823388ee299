"""The embedded evaluator against promtool's own test cases (prunewatch/alerts/rules_test.yml).

Each case's input series become stored probe results (and governor decisions) in a real SQLite store, the measured
thresholds and quality windows series as the collector exports them (promtool_cases.SERIES_GIVEN); the evaluator steps
through the same evaluation times as promtool and must produce exactly the expected alerts
(labels and rendered annotations) and recorded samples. promtool checks the same file
(test_alert_tools.py), so Prometheus and the embedded evaluator cannot drift apart silently.
"""

from __future__ import annotations

import math
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from sqlalchemy.orm import Session

from prunewatch.alerts import AlertingSettings, EmbeddedAlerting
from prunewatch.alerts.durations import parse_duration
from prunewatch.alerts.settings import RULES_PATH
from prunewatch.records.store import ResultRepository, connect, create_schema
from prunewatch.records.store.governor import GovernorRepository
from tests.alerts.promtool_cases import (
    EPOCH,
    NotConvertible,
    decisions_for,
    given_series,
    load_cases,
    parse_series,
    results_for,
)

RULES_TEST = RULES_PATH.parent / "rules_test.yml"
EVAL_INTERVAL, CASES = load_cases(RULES_TEST)


def _store(tmp_path: Path, results, decisions=()) -> object:
    engine = connect(f"sqlite:///{tmp_path / 'conformance.db'}")
    create_schema(engine)
    with Session(engine) as session, session.begin():
        for decision in decisions:
            GovernorRepository(session).add(decision)
        repo = ResultRepository(session)
        for round_id in sorted({r.round_id for r in results}):
            first = min(r.created_at for r in results if r.round_id == round_id)
            repo.start_round(round_id=round_id, target="embedded", model="probe-llama", started_at=first,
                             probe_set_digest="0" * 64)
        for result in results:
            repo.add(result)
    return engine


def _expected_alerts(test: dict) -> list[tuple[dict, dict]]:
    out = []
    for alert in test.get("exp_alerts") or []:
        labels = {**{k: str(v) for k, v in (alert.get("exp_labels") or {}).items()}, "alertname": test["alertname"]}
        out.append((labels, {k: str(v) for k, v in (alert.get("exp_annotations") or {}).items()}))
    return sorted(out, key=lambda pair: sorted(pair[0].items()))


def _case_id(case: dict) -> str:
    return case["name"].split(":")[0]


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_embedded_evaluator_matches_promtool_case(case: dict, tmp_path: Path) -> None:
    try:
        results = results_for(case)
    except NotConvertible as exc:
        # Only rules over metrics the store does not hold may be left to Prometheus, and the
        # evaluator must say so for each alert the case tests.
        alerting = EmbeddedAlerting(AlertingSettings(state_path=None), connect("sqlite://"))
        unsupported = {rule.name: rule.reason for rule in alerting.unsupported}
        for test in case.get("alert_rule_test", []):
            assert "not derived from stored probe results" in unsupported[test["alertname"]], exc
        assert not case.get("promql_expr_test"), "promql_expr_test cases must be convertible"
        return
    engine = _store(tmp_path, results, decisions_for(case))
    alerting = EmbeddedAlerting(AlertingSettings(state_path=None), engine, extra_series=given_series(case))
    assert not {t["alertname"] for t in case.get("alert_rule_test", [])} & {r.name for r in alerting.unsupported}

    checks = sorted(case.get("alert_rule_test", []), key=lambda t: parse_duration(t["eval_time"]))
    if checks:
        last = parse_duration(checks[-1]["eval_time"])
        steps = int(last / EVAL_INTERVAL)
        pending = list(checks)
        fired_somewhere = False
        for step in range(steps + 1):
            at = EPOCH + EVAL_INTERVAL * step
            alerting.evaluate(at)
            while pending and parse_duration(pending[0]["eval_time"]) == at - EPOCH:
                test = pending.pop(0)
                got = sorted(((dict(a.labels), a.annotations) for a in alerting.evaluator.alerts("firing")
                              if a.rule == test["alertname"]), key=lambda pair: sorted(pair[0].items()))
                expected = _expected_alerts(test)
                assert got == expected, f"{test['alertname']} at {test['eval_time']}"
                fired_somewhere = fired_somewhere or bool(expected)
        assert not pending, "every eval_time must lie on the evaluation grid"
        assert fired_somewhere, "a case that never expects an alert proves nothing"

    for test in case.get("promql_expr_test", []):
        at = EPOCH + parse_duration(test["eval_time"])
        got = sorted(alerting.query(test["expr"], at), key=lambda pair: sorted(pair[0].items()))
        expected = []
        for sample in test.get("exp_samples") or []:
            name, labels = parse_series(sample["labels"]) if sample["labels"] != "{}" else ("", {})
            if name:
                labels["__name__"] = name
            expected.append((labels, float(sample["value"])))
        expected.sort(key=lambda pair: sorted(pair[0].items()))
        assert [labels for labels, _ in got] == [labels for labels, _ in expected], test["expr"]
        for (_, value), (_, want) in zip(got, expected):
            assert math.isclose(value, want, rel_tol=1e-9, abs_tol=1e-12), (test["expr"], value, want)


def test_every_alert_rule_has_a_promtool_case() -> None:
    """A new rule without a case in rules_test.yml fails here, before it reaches production."""
    rules = yaml.safe_load(RULES_PATH.read_text())
    alert_names = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    tested = {t["alertname"] for case in CASES for t in case.get("alert_rule_test", [])}
    assert alert_names == tested
    records = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    queried = {name for case in CASES for t in case.get("promql_expr_test", []) for name in records
               if name in t["expr"]}
    assert records == queried


def test_conversion_reproduces_the_counters_it_was_given() -> None:
    """The converter itself: the ProbeFailing case's series come back from the results it builds."""
    case = next(c for c in CASES if c["name"].startswith("ProbeFailing"))
    results = results_for(case)
    legal = [r for r in results if r.domain == "legal"]
    assert sum(r.status == "failed" for r in legal) == 60  # failed counter ends at 60
    assert sum(r.ok for r in legal) == 63 + 3 * 30  # ok counter ends at 153
    assert {r.failure_reason for r in legal if not r.ok} == {"timeout"}
    at_11m = [r for r in legal if r.created_at == EPOCH + timedelta(minutes=11)]
    assert sorted(r.status for r in at_11m) == ["failed", "failed", "ok"]
