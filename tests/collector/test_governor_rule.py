"""The quality governor's decision rule, settings, bookkeeping and policy push, without an engine."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError
from sqlalchemy.orm import Session

from prunewatch.collector.governor import (
    BREACH,
    BREACH_AT_MIN,
    HOLD,
    HOLD_AT_MAX,
    HOLD_NEAR_FLOOR,
    HOLD_UNCERTAIN,
    NO_EVIDENCE,
    RELAX,
    DecisionWriter,
    GovernedTarget,
    Governor,
    GovernorSettings,
    decide,
    start_governing,
)
from prunewatch.collector.http_target import HttpTarget
from prunewatch.collector.scheduler import TargetJob
from prunewatch.collector.target_config import TargetConfigError, load_targets
from prunewatch.probes import Probe, ProbeSet
from prunewatch.records.governor_metrics import GovernorMetrics
from prunewatch.records.intervals import Interval
from prunewatch.records.quality_window import AnswerWindow
from prunewatch.records.results import ProbeResult
from prunewatch.records.store import connect, create_schema
from prunewatch.records.store.governor import GovernorRepository

S = GovernorSettings(floor=0.9, step_down=0.2, step_up=0.05, margin=0.02, relax_after=3, min_sensitivity=0.1,
                     max_sensitivity=0.9, decisive_prompts=8)
ONE = S.model_copy(update={"decisive_prompts": 1})  # the plumbing tests decide on one prompt's estimate
T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def probe(domain: str, n: int = 1) -> Probe:
    return Probe(id=f"{domain}-{n}", domain=domain, version=1, max_tokens=4, system="", prompt=f"{domain} {n}")


def result(domain: str, agreement: float | None, *, n: int = 1, ok: bool = True, baseline: bool = False,
           target: str = "t", tokens: int = 40, round_id: str = "r" * 32, sensitivity: float | None = None,
           fallback: str | None = None) -> ProbeResult:
    p = probe(domain, n)
    if not ok:
        return ProbeResult.failure(target=target, model="m", probe=p, round_id=round_id, reason="timeout",
                                   message="slow", duration_ms=1.0)
    return ProbeResult(target=target, model="m", probe_id=p.id, probe_version=1, probe_hash=p.content_hash,
                       domain=domain, status="ok", round_id=round_id, reference_agreement=agreement,
                       reference_tokens=tokens if agreement is not None else None, baseline=baseline,
                       sensitivity=sensitivity, fallback_reason=fallback)


def evidence(estimate: float, low: float, high: float, prompts: int = 4) -> Interval:
    return Interval(estimate, low, high, prompts, prompts * 40)


# -- the rule -----------------------------------------------------------------------------------
def test_conclusive_breach_lowers_at_once_by_one_bounded_step() -> None:
    below = evidence(0.5, 0.4, 0.6)  # the whole interval under the floor
    assert decide(S, 0.9, below, good_rounds=2) == (0.7, BREACH, 0)  # a deep breach still moves one step
    assert decide(S, 0.7, evidence(0.88, 0.86, 0.899), good_rounds=0) == (0.5, BREACH, 0)
    assert decide(S, 0.25, below, good_rounds=0) == (0.1, BREACH, 0)  # bounded below by min_sensitivity
    assert decide(S, 0.1, below, good_rounds=0) == (0.1, BREACH_AT_MIN, 0)


def test_an_estimate_under_the_floor_lowers_only_on_enough_prompts() -> None:
    """Sampling noise: an estimate just under the floor whose interval reaches above it holds until the evidence
    covers `decisive_prompts` prompts; then the estimate decides."""
    assert decide(S, 0.7, evidence(0.89, 0.80, 0.95, prompts=3), good_rounds=1) == (0.7, HOLD_UNCERTAIN, 0)
    assert decide(S, 0.7, evidence(0.89, 0.85, 0.93, prompts=8), good_rounds=1) == (0.5, BREACH, 0)


def test_relaxing_needs_the_lower_bound_above_floor_plus_margin() -> None:
    """Above the floor but not beyond it with a margin, the setting holds and earlier good rounds no longer count."""
    assert decide(S, 0.5, evidence(0.95, 0.89, 0.99), good_rounds=2) == (0.5, HOLD_NEAR_FLOOR, 0)
    assert decide(S, 0.5, evidence(0.95, 0.919, 0.99), good_rounds=2) == (0.5, HOLD_NEAR_FLOOR, 0)
    assert decide(S, 0.5, evidence(0.95, 0.92, 0.99), good_rounds=2) == (0.55, RELAX, 0)  # floor + margin is good


def test_relaxes_slowly_one_small_step_after_k_good_rounds() -> None:
    setting, good, trail = 0.5, 0, []
    for _ in range(7):
        setting, reason, good = decide(S, setting, evidence(1.0, 0.98, 1.0), good)
        trail.append((setting, reason))
    assert trail == [(0.5, HOLD), (0.5, HOLD), (0.55, RELAX), (0.55, HOLD), (0.55, HOLD), (0.6, RELAX),
                     (0.6, HOLD)]


def test_bounds_and_missing_evidence() -> None:
    good = evidence(1.0, 0.98, 1.0)
    assert decide(S, 0.9, good, good_rounds=5) == (0.9, HOLD_AT_MAX, 6)
    assert decide(S, 0.88, good, good_rounds=2) == (0.9, RELAX, 0)  # bounded above by max_sensitivity
    assert decide(S, 0.5, None, good_rounds=2) == (0.5, NO_EVIDENCE, 2)
    few = S.model_copy(update={"min_probes": 5})
    assert decide(few, 0.5, evidence(0.1, 0.0, 0.2, prompts=4), good_rounds=1) == (0.5, NO_EVIDENCE, 1)
    assert decide(S, 0.5, evidence(float("nan"), 0.0, 1.0), good_rounds=0) == (0.5, NO_EVIDENCE, 0)


def test_repeated_steps_do_not_drift() -> None:
    settings = GovernorSettings(step_down=0.1, step_up=0.1, relax_after=1)
    setting = 0.0
    for _ in range(3):
        setting = decide(settings, setting, evidence(1.0, 1.0, 1.0), 0)[0]
    assert setting == 0.3


@pytest.mark.parametrize("overrides, message", [
    ({"floor": 0.0}, "greater than 0"),
    ({"floor": 1.2}, "less than or equal to 1"),
    ({"step_up": 0.3, "step_down": 0.2}, "step_up (0.3) must not exceed step_down (0.2)"),
    ({"min_sensitivity": 0.6, "max_sensitivity": 0.4}, "min_sensitivity (0.6) exceeds max_sensitivity (0.4)"),
    ({"floor": 0.99, "margin": 0.05}, "it would never relax"),
    ({"relax_after": 0}, "greater than or equal to 1"),
    ({"window_rounds": 0}, "greater than or equal to 1"),
    ({"flor": 0.9}, "Extra inputs are not permitted"),
])
def test_settings_are_ranged(overrides: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=__import__("re").escape(message)):
        GovernorSettings(**overrides)


def test_evidence_is_the_pooled_agreement_of_the_domains_pruned_answers() -> None:
    """Baselines, failures, fallbacks to dense and unscored answers are no evidence; a prompt counts once."""
    window = AnswerWindow(window_rounds=10)
    window.extend([result("legal", 0.8, n=1, tokens=10), result("legal", 1.0, n=2, tokens=30),
                   result("legal", None, n=3), result("legal", 0.0, n=4, baseline=True),
                   result("legal", 0.0, n=5, fallback="uncalibrated"), result("legal", None, ok=False)])
    interval = window.agreement()
    assert (interval.estimate, interval.prompts, interval.tokens) == (pytest.approx(38 / 40), 2, 40)
    window.add(result("legal", 0.5, n=1, tokens=10, round_id="s" * 32))  # a newer answer replaces the older
    assert window.agreement().estimate == pytest.approx(35 / 40)
    window.add(result("legal", 1.0, n=1, tokens=10, round_id="u" * 32, sensitivity=0.3))  # another setting
    assert (window.agreement().estimate, window.agreement().prompts) == (1.0, 1)


def test_sampling_noise_around_a_quality_above_the_floor_moves_nothing_and_a_real_breach_does() -> None:
    """Every round answers 6 new prompts whose agreement scatters around a fixed quality (sd 0.03 per prompt)."""
    settings = GovernorSettings(floor=0.95, relax_after=3, margin=0.02, max_sensitivity=0.9)
    rng = random.Random(7)

    def round_results(quality: float, index: int, setting: float) -> list[ProbeResult]:
        return [result("legal", min(1.0, max(0.0, rng.gauss(quality, 0.03))), n=index * 10 + k,
                       round_id=f"{index:032d}", sensitivity=setting, tokens=48) for k in range(6)]

    governor = Governor({"t": settings})
    governor.start("t", "m", ["legal"], 0.5)
    reasons = []
    for index in range(40):
        (decision,) = governor.observe("t", f"{index:032d}", round_results(0.965, index, 0.5))
        reasons.append(decision.reason)
        assert decision.new_setting == 0.5, (index, decision)
        assert decision.agreement_low <= decision.agreement <= decision.agreement_high
    assert BREACH not in reasons and HOLD_NEAR_FLOOR in reasons
    # Quality falls to 0.85 at the same setting: the window still holds the earlier answers, so the estimate
    # crosses the floor within two rounds, and the setting is lowered once.
    decisions = [governor.observe("t", f"{i:032d}", round_results(0.85, i, governor.setting("t", "m", "legal")))[0]
                 for i in range(40, 43)]
    assert [d.reason for d in decisions][:2].count(BREACH) == 1
    breach = next(d for d in decisions if d.reason == BREACH)
    assert breach.new_setting == 0.3 and breach.agreement < 0.95 and breach.probes >= S.decisive_prompts


# -- the governor: state, metrics, storage, push ---------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        self.now += timedelta(seconds=30)
        return self.now


def test_governor_records_every_decision_and_counts_clamps(tmp_path) -> None:
    registry = CollectorRegistry()
    store = connect(f"sqlite:///{tmp_path / 'g.db'}")
    create_schema(store)
    pushed: list[dict] = []
    governor = Governor({"t": ONE}, metrics=GovernorMetrics(registry), sink=DecisionWriter(store),
                        pushers={"t": pushed.append}, clock=Clock())
    governor.start("t", "m", ["legal"], 0.9)
    def clamps() -> float | None:
        return registry.get_sample_value("prunewatch_governor_clamps_total", {"target": "t", "domain": "legal"})

    assert clamps() == 0.0  # exists before the first clamp: Prometheus sees the first one as an increase
    answers = {0: [0.5, 0.4], 1: [0.975, 1.0], 2: [0.975, 1.0], 3: [0.975, 1.0], 4: [0.9, 0.9]}
    for index, agreements in answers.items():
        setting = governor.setting("t", "m", "legal")
        governor.observe("t", f"{index:032d}", [result("legal", a, n=k, round_id=f"{index:032d}", sensitivity=setting)
                                                for k, a in enumerate(agreements)])
    assert registry.get_sample_value("prunewatch_governor_setting", {"target": "t", "domain": "legal"}) == 0.75
    assert clamps() == 1.0
    with Session(store) as session:
        rows = GovernorRepository(session).history(target="t")
        (latest,) = GovernorRepository(session).latest()
    assert [(r.old_setting, r.new_setting, r.reason, r.good_rounds) for r in rows] == [
        (0.9, 0.7, BREACH, 0), (0.7, 0.7, HOLD, 1), (0.7, 0.7, HOLD, 2), (0.7, 0.75, RELAX, 0),
        (0.75, 0.75, HOLD_NEAR_FLOOR, 0)]
    assert [r.agreement for r in rows] == [0.45, 0.9875, 0.9875, 0.9875, 0.9]
    assert (rows[0].agreement_low, rows[0].agreement_high, rows[0].tokens) == (0.4, 0.5, 80)  # its interval
    assert latest == rows[-1] and latest.floor == 0.9 and latest.probes == 2 and latest.round_id == f"{4:032d}"
    assert pushed == [{"legal": 0.7}, {"legal": 0.75}]  # only when the setting changed

    restarted = Governor({"t": ONE}, metrics=GovernorMetrics(CollectorRegistry()))
    assert restarted.resume([latest]) == 1 and restarted.setting("t", "m", "legal", 0.9) == 0.75
    store.dispose()


def test_a_failed_push_is_retried_next_round_and_a_failed_write_is_kept() -> None:
    calls: list[dict] = []

    def flaky(policy: dict) -> None:
        calls.append(policy)
        if len(calls) == 1:
            raise ConnectionError("engine down")

    broken = DecisionWriter(connect("sqlite:////nonexistent-folder/x.db", check=False))
    governor = Governor({"t": ONE}, sink=broken, pushers={"t": flaky})
    governor.observe("t", None, [result("legal", 0.5)])
    governor.observe("t", None, [result("legal", 0.91, sensitivity=0.7)])  # no change, but the last push failed
    assert calls == [{"legal": 0.7}, {"legal": 0.7}]
    assert len(broken.pending) == 2


class FakeTarget:
    def __init__(self, name: str = "t", sensitivity: float | None = 0.9) -> None:
        self.name, self.model, self.sensitivity = name, "m", sensitivity
        self.ran: list[tuple[str, float | None]] = []

    def with_overrides(self, *, sensitivity=None, **_):
        variant = FakeTarget(self.name, sensitivity)
        variant.ran = self.ran
        return variant

    def run_probe(self, probe):
        self.ran.append((probe.domain, self.sensitivity))
        return probe.domain


def test_governed_target_runs_each_domain_at_its_setting() -> None:
    inner = FakeTarget()
    governor = Governor({"t": ONE})
    target = GovernedTarget(inner, governor)
    governor.observe("t", None, [result("legal", 0.1)])  # legal breached: 0.9 -> 0.7
    target.run_probe(probe("legal"))
    target.run_probe(probe("tech"))
    assert inner.ran == [("legal", 0.7), ("tech", 0.9)]
    assert target.with_overrides(sensitivity=0.0).sensitivity == 0.0  # an explicit override is not governed
    assert target.sensitivity == 0.9 and target.name == "t"


def test_policy_push_puts_the_whole_policy_with_the_key() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"domains": {}})

    http = HttpTarget(name="gpu", base_url="http://engine:8000", model="m", api_key="sk-x", sensitivity=0.9,
                      transport=httpx.MockTransport(handler))
    governor = Governor({"gpu": ONE})
    target = GovernedTarget(http, governor)
    start_governing(governor, [TargetJob(target, ProbeSet((probe("legal"), probe("tech")), "t"), 60.0)],
                    registry=CollectorRegistry())
    governor.observe("gpu", None, [result("legal", 0.2, target="gpu"), result("tech", 1.0, target="gpu")])
    (request,) = seen
    assert request.method == "PUT" and request.url.path == "/v1/pruning/policy"
    assert request.headers["authorization"] == "Bearer sk-x"
    assert __import__("json").loads(request.content) == {"domains": {"legal": 0.7, "tech": 0.9}}


def test_targets_file_enables_the_governor_per_target(tmp_path) -> None:
    path = tmp_path / "targets.yaml"
    path.write_text("governor: {floor: 0.9, relax_after: 5}\n"
                    "targets:\n"
                    "  - {name: a, kind: in_process, governor: true}\n"
                    "  - {name: b, kind: in_process, governor: {floor: 0.97, step_up: 0.01}}\n"
                    "  - {name: c, kind: in_process}\n")
    config = load_targets(path)
    a, b, c = config.targets
    assert (a.governor.floor, a.governor.relax_after) == (0.9, 5)
    assert (b.governor.floor, b.governor.step_up, b.governor.relax_after) == (0.97, 0.01, 5)
    assert c.governor is None
    path.write_text("targets:\n  - {name: b, kind: in_process, governor: {floor: 2}}\n")
    with pytest.raises(TargetConfigError, match=r"targets\[0\] \(b\): governor.floor: Input should be less than"):
        load_targets(path)
    path.write_text("targets:\n  - {name: v, kind: openai, base_url: 'http://x:1', model: m, governor: true}\n")
    with pytest.raises(TargetConfigError, match="cannot be governed"):
        load_targets(path)


def test_build_jobs_wraps_governed_targets_under_one_governor(tmp_path, monkeypatch) -> None:
    from prunewatch.collector.fleet import build_jobs
    from prunewatch.probes import load_probes

    monkeypatch.setenv("GOV_TEST_KEY", "sk-x")
    path = tmp_path / "targets.yaml"
    path.write_text("targets:\n"
                    "  - {name: a, kind: prunewatch, base_url: 'http://a:8000', model: m, api_key_env: GOV_TEST_KEY,\n"
                    "     governor: {floor: 0.9}, domains: [tech]}\n"
                    "  - {name: b, kind: prunewatch, base_url: 'http://b:8000', model: m, governor: true}\n"
                    "  - {name: c, kind: openai, base_url: 'http://c:8000', model: m}\n")
    a, b, c = build_jobs(load_targets(path), load_probes())
    assert isinstance(a.target, GovernedTarget) and isinstance(b.target, GovernedTarget)
    assert not isinstance(c.target, GovernedTarget)
    assert a.target.governor is b.target.governor
    assert a.target.governor.settings["a"].floor == 0.9 and a.target.governor.settings["b"].floor == 0.95
    assert a.target.kind == "prunewatch" and a.probe_set.domains == ["tech"]
