"""The embedded evaluator on the store of a real two-round collector run (the bundled probe model)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from datetime import timedelta
from pathlib import Path

from pydantic import SecretStr
from sqlalchemy.orm import Session

from prunewatch.alerts import AlertingSettings, EmbeddedAlerting, RuleSettings, render_rules
from prunewatch.records.store import ResultRepository, connect
from tests.alerts.slack_receiver import SlackReceiver


def test_real_results_raise_pruning_ratio_low(collected_sqlite: str, receiver: SlackReceiver, tmp_path: Path) -> None:
    engine = connect(collected_sqlite)
    try:
        with Session(engine) as session:
            results = ResultRepository(session).list()
        at = max(r.created_at for r in results) + timedelta(seconds=1)
        per_probe: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for r in results:
            if not r.baseline:  # dense baselines feed their own series, never the pruned configuration's ratio
                per_probe[r.domain][r.probe_id].append(r.pruning_ratio)
        # avg by (target, model, domain) (avg_over_time(ratio[24h])), one target here: the mean of each probe's mean
        expected = {domain: statistics.fmean(statistics.fmean(v) for v in probes.values())
                    for domain, probes in per_probe.items()}
        assert all(value < 0.35 for value in expected.values()), f"probe-model ratios {expected} (measured)"

        # Production thresholds: the condition holds, but PruningRatioLow waits out its 2h before posting.
        production = EmbeddedAlerting(AlertingSettings(state_path=None, slack_webhook_url=SecretStr(receiver.url)),
                                      engine)
        report = production.after_round(at)
        assert report.transitions == [] and receiver.snapshot() == []
        pending = {(a.rule, a.label("domain")) for a in production.evaluator.alerts("pending")}
        assert {("PruningRatioLow", domain) for domain in expected} <= pending

        # The same rules with the hold at 0s: one warning per domain reaches Slack with the measured average.
        rules = tmp_path / "rules.yml"
        rules.write_text(render_rules(RuleSettings(ratio_low_for="0s")))
        immediate = EmbeddedAlerting(AlertingSettings(rules_path=rules, state_path=None,
                                                      slack_webhook_url=SecretStr(receiver.url)), engine)
        report = immediate.after_round(at)
    finally:
        engine.dispose()
    low = sorted(t.alert.label("domain") for t in report.transitions if t.alert.rule == "PruningRatioLow")
    assert low == sorted(expected)
    posts = {p.title: p.text for p in receiver.snapshot() if "PruningRatioLow" in p.title}
    model = results[0].model
    for domain, value in expected.items():
        text = posts[f"[FIRING:1] PruningRatioLow (warning) on {model}/{domain} at {results[0].target}"]
        assert f"24 h average pruning ratio is {value:.3f} (measured by the engine" in text
