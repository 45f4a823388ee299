"""The quality governor: per (target, domain), the most aggressive pruning that keeps served quality at the floor.

Its evidence is the reference-scored agreement of the answers the target served
(`ProbeResult.reference_agreement`: the share of a served answer's tokens equal to a dense reference's
argmax, collector/reference.py), pooled over the domain's prompts answered at the current setting in
the last `window_rounds` rounds, with a 95% interval bootstrapped over prompts
(records/intervals.py). Dense baselines and requests that fell back to dense are not evidence: they
say nothing of the setting. A prompt answered again at the same setting counts once (its newest
answer): a greedy engine repeats itself, so repeats add no evidence. The evidence starts afresh when
the setting changes. After each round `decide` (a pure function) reads it:

- the interval's upper bound below `floor` (quality is below the floor beyond sampling noise), or the
  estimate below `floor` over at least `decisive_prompts` prompts: lower the sensitivity at once, by
  `step_down` (bounded, never below `min_sensitivity`): reason `breach` (counted as a clamp), or
  `breach_at_min` when already there;
- the estimate below `floor` on fewer prompts, with the interval reaching above it: hold
  (`hold_uncertain`) while the evidence grows;
- the lower bound below `floor + margin`: hold, and the count of good rounds starts again
  (`hold_near_floor`: no relaxing unless the floor is kept beyond noise, with a margin);
- the lower bound at or above `floor + margin`: one more good round (`hold`); after `relax_after`
  consecutive good rounds, raise it by `step_up` (`relax`, never above `max_sensitivity`;
  `hold_at_max` there);
- fewer than `min_probes` prompts scored: hold (`no_evidence`).

So it lowers on conclusive evidence and relaxes slowly, in bounded steps, and sampling noise around a
quality above the floor moves nothing. Every decision is stored with its evidence and interval
(prunewatch/records/store/governor.py), exported as `prunewatch_governor_setting` / `_clamps_total`
(prunewatch/records/governor_metrics.py), and applied: in-process and HTTP probes run at the governed
sensitivity (`GovernedTarget`), and a `prunewatch` engine gets it for its live traffic through
`PUT /v1/pruning/policy` (`push_policy`) whenever it changes.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from prunewatch.records.governor_metrics import GovernorMetrics
from prunewatch.records.intervals import Interval
from prunewatch.records.quality_window import AnswerWindow
from prunewatch.records.results import ProbeResult, utcnow
from prunewatch.records.store.governor import GovernorDecision, GovernorRepository

logger = logging.getLogger("prunewatch.collector")

POLICY_PATH = "/v1/pruning/policy"
"""The engine server's policy endpoint (prunewatch/server/policy.py)."""

BREACH = "breach"
BREACH_AT_MIN = "breach_at_min"
RELAX = "relax"
HOLD = "hold"
HOLD_NEAR_FLOOR = "hold_near_floor"
HOLD_UNCERTAIN = "hold_uncertain"
HOLD_AT_MAX = "hold_at_max"
NO_EVIDENCE = "no_evidence"
REASONS = (BREACH, BREACH_AT_MIN, RELAX, HOLD, HOLD_NEAR_FLOOR, HOLD_UNCERTAIN, HOLD_AT_MAX, NO_EVIDENCE)

_DIGITS = 6  # settings are rounded so that repeated steps do not drift (0.1 + 0.2 != 0.3)


class GovernorSettings(BaseModel):
    """How the governor holds the quality floor (per target in the targets file, or for `prunewatch run`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    floor: float = Field(0.95, gt=0.0, le=1.0,
                         description="Reference-scored agreement the answers of a domain must keep; conclusive "
                                     "evidence below it lowers the sensitivity at once.")
    step_down: float = Field(0.2, gt=0.0, le=1.0,
                             description="How much one breach lowers the sensitivity (bounded: quality comes back "
                                         "within a few rounds without dropping straight to dense).")
    step_up: float = Field(0.05, gt=0.0, le=1.0,
                           description="How much one relax raises it; at most step_down, so relaxing is slower "
                                       "than backing off.")
    margin: float = Field(0.02, ge=0.0, le=0.5,
                          description="Hysteresis: only rounds whose interval's lower bound is at or above "
                                      "floor + margin count toward relaxing.")
    relax_after: int = Field(3, ge=1, le=10_000,
                             description="Consecutive good rounds before one step up (slow relax).")
    min_sensitivity: float = Field(0.0, ge=0.0, le=1.0,
                                   description="Lowest sensitivity the governor sets (0 runs dense).")
    max_sensitivity: float = Field(1.0, ge=0.0, le=1.0, description="Highest sensitivity the governor sets.")
    min_probes: int = Field(1, ge=1, le=10_000,
                            description="Prompts with a measured agreement the evidence needs before it is read.")
    window_rounds: int = Field(10, ge=1, le=10_000,
                               description="Rounds whose answers (at the current setting) form the evidence.")
    decisive_prompts: int = Field(8, ge=1, le=100_000,
                                  description="Prompts from which an estimate below the floor lowers the setting "
                                              "even when its interval still reaches above the floor.")

    @model_validator(mode="after")
    def _consistent(self) -> GovernorSettings:
        if self.min_sensitivity > self.max_sensitivity:
            raise ValueError(f"min_sensitivity ({self.min_sensitivity:g}) exceeds max_sensitivity "
                             f"({self.max_sensitivity:g})")
        if self.step_up > self.step_down:
            raise ValueError(f"step_up ({self.step_up:g}) must not exceed step_down ({self.step_down:g}): "
                             "the governor relaxes more slowly than it backs off")
        if self.floor + self.margin > 1.0:
            raise ValueError(f"floor + margin ({self.floor + self.margin:g}) exceeds 1: it would never relax")
        return self

    def bounded(self, sensitivity: float) -> float:
        return round(min(self.max_sensitivity, max(self.min_sensitivity, sensitivity)), _DIGITS)


def decide(settings: GovernorSettings, setting: float, evidence: Interval | None,
           good_rounds: int) -> tuple[float, str, int]:
    """The next sensitivity, the reason and the new count of consecutive good rounds (see the module doc)."""
    if evidence is None or evidence.prompts < settings.min_probes or math.isnan(evidence.estimate):
        return setting, NO_EVIDENCE, good_rounds
    if evidence.high < settings.floor or (
            evidence.estimate < settings.floor and evidence.prompts >= settings.decisive_prompts):
        lowered = settings.bounded(setting - settings.step_down)
        return (lowered, BREACH, 0) if lowered < setting else (setting, BREACH_AT_MIN, 0)
    if evidence.estimate < settings.floor:
        return setting, HOLD_UNCERTAIN, 0
    if evidence.low < settings.floor + settings.margin:
        return setting, HOLD_NEAR_FLOOR, 0
    good = good_rounds + 1
    if setting >= settings.max_sensitivity:
        return setting, HOLD_AT_MAX, good
    if good >= settings.relax_after:
        return settings.bounded(setting + settings.step_up), RELAX, 0
    return setting, HOLD, good


@dataclass
class _State:
    model: str
    setting: float
    good_rounds: int = 0
    pushed: float | None = None  # the setting the engine's policy endpoint last accepted
    evidence: AnswerWindow | None = None  # answers at `setting`; made on first use


PolicyPush = Callable[[Mapping[str, float]], None]


class Governor:
    """The governor of every governed target in one collector process (thread-safe)."""

    def __init__(self, settings: Mapping[str, GovernorSettings], *, metrics: GovernorMetrics | None = None,
                 sink: Callable[[Sequence[GovernorDecision]], None] | None = None,
                 pushers: Mapping[str, PolicyPush] | None = None,
                 clock: Callable[[], datetime] = utcnow) -> None:
        self.settings = dict(settings)
        self.metrics = metrics
        self.sink = sink
        self.pushers = dict(pushers or {})
        self.clock = clock
        self._states: dict[tuple[str, str], _State] = {}
        self._lock = threading.Lock()

    def governs(self, target: str) -> bool:
        return target in self.settings

    def start(self, target: str, model: str, domains: Iterable[str], sensitivity: float | None) -> None:
        """Begin governing `domains` of `target` at its configured sensitivity (bounded)."""
        for domain in domains:
            self._state(target, model, domain, sensitivity)

    def resume(self, decisions: Iterable[GovernorDecision]) -> int:
        """Continue from stored decisions (the newest of each key, e.g. after a restart); returns how many."""
        decisions = list(decisions)
        resumed = 0
        with self._lock:
            for decision in decisions:
                settings = self.settings.get(decision.target)
                if settings is None:
                    continue
                self._states[(decision.target, decision.domain)] = _State(
                    model=decision.model, setting=settings.bounded(decision.new_setting),
                    good_rounds=decision.good_rounds)
                resumed += 1
        for decision in decisions:
            state = self._states.get((decision.target, decision.domain))
            if state is not None and self.metrics is not None:
                self.metrics.track(decision.target, decision.domain, state.setting)
        return resumed

    def _state(self, target: str, model: str, domain: str, sensitivity: float | None) -> _State:
        with self._lock:
            state = self._states.get((target, domain))
            if state is not None:
                return state
            settings = self.settings[target]
            start = settings.max_sensitivity if sensitivity is None else sensitivity
            state = self._states[(target, domain)] = _State(model=model, setting=settings.bounded(start))
        if self.metrics is not None:
            self.metrics.track(target, domain, state.setting)
        return state

    def setting(self, target: str, model: str, domain: str, default: float | None = None) -> float:
        """The sensitivity the next probe of `domain` on `target` runs at."""
        return self._state(target, model, domain, default).setting

    def policy(self, target: str) -> dict[str, float]:
        """Every governed domain of `target` and its sensitivity."""
        with self._lock:
            return {domain: state.setting for (name, domain), state in sorted(self._states.items()) if name == target}

    def observe(self, target: str, round_id: str | None, results: Sequence[ProbeResult],
                default_sensitivity: float | None = None) -> list[GovernorDecision]:
        """Decide after one round of `target`; store, export and push what was decided. Never raises for I/O."""
        settings = self.settings.get(target)
        if settings is None:
            return []
        decided_at = self.clock()
        decisions = []
        models = {r.domain: r.model for r in results}
        by_domain: dict[str, list[ProbeResult]] = {}
        for result in results:
            if not getattr(result, "baseline", False):
                by_domain.setdefault(result.domain, []).append(result)
        for domain, answers in sorted(by_domain.items()):
            state = self._state(target, models[domain], domain, default_sensitivity)
            with self._lock:
                old = state.setting
                if state.evidence is None:
                    state.evidence = AnswerWindow(settings.window_rounds)
                state.evidence.extend(answers)  # answers at another setting start it afresh
                evidence = state.evidence.agreement()
                new, reason, good = decide(settings, old, evidence, state.good_rounds)
                state.setting, state.good_rounds = new, good
            decision = GovernorDecision(
                decided_at=decided_at, target=target, model=state.model, domain=domain, old_setting=old,
                new_setting=new, reason=reason, agreement=None if evidence is None else round(evidence.estimate, 6),
                probes=0 if evidence is None else evidence.prompts, good_rounds=good, floor=settings.floor,
                round_id=round_id,
                agreement_low=None if evidence is None else round(evidence.low, 6),
                agreement_high=None if evidence is None else round(evidence.high, 6),
                tokens=None if evidence is None else evidence.tokens)
            decisions.append(decision)
            level = logging.WARNING if decision.clamped else logging.INFO
            logger.log(level, "governor %s/%s: %s, sensitivity %g -> %g (reference agreement %s, floor %g)",
                       target, domain, reason, old, new, "n/a" if evidence is None else str(evidence),
                       settings.floor)
            if self.metrics is not None:
                self.metrics.record(target, domain, new, clamped=decision.clamped)
        if decisions and self.sink is not None:
            try:
                self.sink(decisions)
            except Exception:  # a decision that could not be stored is logged; governing goes on
                logger.exception("could not store %d governor decision(s) of %s", len(decisions), target)
        self._push(target)
        return decisions

    def observe_round(self, summary: Any, default_sensitivity: float | None = None) -> list[GovernorDecision]:
        """`observe` for a `RoundSummary` (the collector's round callback)."""
        return self.observe(summary.target, summary.round_id, summary.results, default_sensitivity)

    def _push(self, target: str) -> None:
        push = self.pushers.get(target)
        if push is None:
            return
        with self._lock:
            states = {domain: state for (name, domain), state in self._states.items() if name == target}
            if all(state.pushed == state.setting for state in states.values()):
                return
            policy = {domain: state.setting for domain, state in sorted(states.items())}
        try:
            push(policy)
        except Exception as exc:  # the engine keeps its last policy; the next round pushes again
            logger.warning("could not push the pruning policy of %s: %s", target, exc)
            return
        with self._lock:
            for domain, setting in policy.items():
                states[domain].pushed = setting
        logger.info("pushed pruning policy %s to %s", policy, target)


class PolicyPushError(RuntimeError):
    """The engine refused or could not take the policy."""


def push_policy(target: Any, policy: Mapping[str, float]) -> None:
    """`PUT /v1/pruning/policy` on a prunewatch `HttpTarget` (with its API key): live traffic follows it."""
    response = target.request("PUT", POLICY_PATH, json_body={"domains": dict(policy)})
    if response.status_code >= 300:
        raise PolicyPushError(f"PUT {POLICY_PATH}: HTTP {response.status_code}: {response.text[:200]}")


class DecisionWriter:
    """Writes decisions to the store in their own transaction; keeps them (bounded) while the store is away."""

    def __init__(self, engine: Any, max_pending: int = 10_000) -> None:
        self.engine = engine
        self.max_pending = max_pending
        self.pending: list[GovernorDecision] = []
        self._lock = threading.Lock()

    def __call__(self, decisions: Sequence[GovernorDecision]) -> None:
        from sqlalchemy.orm import Session

        with self._lock:
            self.pending.extend(decisions)
            del self.pending[:-self.max_pending]
            try:
                with Session(self.engine) as session, session.begin():
                    repository = GovernorRepository(session)
                    for decision in self.pending:
                        repository.add(decision)
            except Exception as exc:
                logger.warning("governor decisions wait for the store (%d pending): %s", len(self.pending),
                               str(exc).splitlines()[0])
                return
            self.pending.clear()


def load_latest(engine: Any) -> list[GovernorDecision]:
    """The newest stored decision of each key; empty when the store cannot answer (a fresh start)."""
    from sqlalchemy.orm import Session

    try:
        with Session(engine) as session:
            return GovernorRepository(session).latest()
    except Exception as exc:
        logger.warning("governor starts from the configured sensitivities: %s", str(exc).splitlines()[0])
        return []


def _accepts_cancel(target: Any) -> bool:
    try:
        return "cancel" in inspect.signature(target.run_probe).parameters
    except (TypeError, ValueError):
        return False


class GovernedTarget:
    """A target whose probes run at the governor's sensitivity for their domain.

    The variant of the wrapped target for each sensitivity (`with_overrides`) is kept, so an HTTP
    target's connection pool is reused; only the last few are kept open.
    """

    KEPT_VARIANTS = 8

    def __init__(self, inner: Any, governor: Governor) -> None:
        self.inner = inner
        self.governor = governor
        self.name = inner.name
        self.model = inner.model
        self.device_name = getattr(inner, "device_name", None)
        self._variants: OrderedDict[float, Any] = OrderedDict()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"GovernedTarget({self.inner!r})"

    def __getattr__(self, name: str) -> Any:  # everything else (kind, sensitivity, ...) is the wrapped target's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def with_overrides(self, **overrides: Any) -> Any:
        """An ungoverned copy with explicit overrides (tune sweeps, dense baselines)."""
        return self.inner.with_overrides(**overrides)

    def _variant(self, sensitivity: float) -> Any:
        with self._lock:
            variant = self._variants.get(sensitivity)
            if variant is None:
                variant = self._variants[sensitivity] = self.inner.with_overrides(sensitivity=sensitivity)
                while len(self._variants) > self.KEPT_VARIANTS:
                    _, old = self._variants.popitem(last=False)
                    _close(old, self.inner)
            else:
                self._variants.move_to_end(sensitivity)
            return variant

    def run_probe(self, probe: Any, cancel: threading.Event | None = None) -> Any:
        sensitivity = self.governor.setting(self.name, self.model, probe.domain, getattr(self.inner, "sensitivity", None))
        target = self._variant(sensitivity)
        if cancel is not None and _accepts_cancel(target):
            return target.run_probe(probe, cancel=cancel)
        return target.run_probe(probe)

    def close(self) -> None:
        with self._lock:
            for variant in self._variants.values():
                _close(variant, self.inner)
            self._variants.clear()
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()


def _close(variant: Any, inner: Any) -> None:
    close = getattr(variant, "close", None)
    if variant is not inner and close is not None:
        close()


def governed(targets: Iterable[Any], settings: Mapping[str, GovernorSettings]) -> list[Any]:
    """`targets` with each one named in `settings` wrapped in a `GovernedTarget` under one shared `Governor`."""
    targets = list(targets)
    if not settings:
        return targets
    governor = Governor(settings)
    return [GovernedTarget(t, governor) if t.name in settings else t for t in targets]


def governor_of(targets: Iterable[Any]) -> Governor | None:
    """The governor behind the `GovernedTarget`s among `targets` (one per process), or None."""
    for target in targets:
        if isinstance(target, GovernedTarget):
            return target.governor
    return None


def start_governing(governor: Governor, jobs: Iterable[Any], *, registry: Any,
                    on_change: Callable[[], None] | None = None, store: Any = None) -> None:
    """Wire the governor to the collector: metrics in `registry`, decisions into `store` (resumed from it),
    each governed job's domains tracked from the start, and a policy push for `prunewatch` engines."""
    governor.metrics = GovernorMetrics(registry, on_change=on_change)
    if store is not None:
        governor.sink = DecisionWriter(store)
        resumed = governor.resume(load_latest(store))
        if resumed:
            logger.info("governor resumed %d setting(s) from the store", resumed)
    for job in jobs:
        target = job.target
        if not isinstance(target, GovernedTarget):
            continue
        governor.start(target.name, target.model, job.probe_set.domains, getattr(target.inner, "sensitivity", None))
        if getattr(target.inner, "kind", None) == "prunewatch" and hasattr(target.inner, "request"):
            inner = target.inner
            governor.pushers[target.name] = functools.partial(push_policy, inner)
