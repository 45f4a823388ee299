"""One probe round: every probe against one target, each result handed to every exporter."""

from __future__ import annotations

import inspect
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeGuard

from prunewatch.collector.deadline import DeadlineExceeded, call_with_deadline
from prunewatch.collector.exporters import Exporter, RoundExporter
from prunewatch.collector.reference import Reference
from prunewatch.collector.targets import CancellableTarget, Observation, Target, TargetError, TunableTarget
from prunewatch.engine import GenerationResult
from prunewatch.engine.errors import EngineError, InvalidRequestError
from prunewatch.probes import Probe, ProbeSet
from prunewatch.records.engine_stats import probe_result_from_stats
from prunewatch.records.results import ProbeResult, utcnow

logger = logging.getLogger("prunewatch.collector")


def classify_failure(exc: BaseException) -> str:
    """A short, stable reason label for metrics and rows."""
    if isinstance(exc, TargetError):
        return exc.reason
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, InvalidRequestError):
        return "invalid_request"
    if isinstance(exc, EngineError):
        return "engine_error"
    if isinstance(exc, ConnectionError):
        return "unreachable"
    return "exception"


@dataclass
class RoundSummary:
    round_id: str
    target: str
    results: list[ProbeResult] = field(default_factory=list)
    export_errors: int = 0

    @property
    def ok(self) -> int:
        return sum(r.ok for r in self.results)

    @property
    def failed(self) -> int:
        return len(self.results) - self.ok


def _export(exporters: Sequence[Exporter], result: ProbeResult) -> int:
    errors = 0
    for exporter in exporters:
        try:
            exporter.record(result)
        except Exception:  # an exporter's failure is logged and counted, never fatal to the round
            errors += 1
            logger.exception("exporter %s failed for result %s", type(exporter).__name__, result.result_id)
    return errors


def _accepts_cancel(target: Target) -> TypeGuard[CancellableTarget]:
    try:
        return "cancel" in inspect.signature(target.run_probe).parameters
    except (TypeError, ValueError):
        return False


def _round_aware(exporter: Exporter) -> TypeGuard[RoundExporter]:
    return hasattr(exporter, "start_round")


def _overridable(target: Target) -> TypeGuard[TunableTarget]:
    return hasattr(target, "with_overrides")


def _probe_once(target: Target, probe: Probe, timeout_s: float | None) -> GenerationResult | Observation:
    """The target's answer to one probe; with a timeout, the probe runs under a deadline."""
    if timeout_s is None:
        return target.run_probe(probe)
    cooperative = target if _accepts_cancel(target) else None

    def call(cancel: threading.Event) -> GenerationResult | Observation:
        return cooperative.run_probe(probe, cancel=cancel) if cooperative is not None else target.run_probe(probe)

    return call_with_deadline(call, timeout_s, label=f"probe {probe.id} on {target.name}")


def _probe_result(target: Target, probe: Probe, round_id: str, timeout_s: float | None
                  ) -> tuple[ProbeResult, threading.Thread | None, list[int] | None]:
    """One probe as a result (a failure is a result too), the worker left running if it timed out, and the served
    token ids when the engine ran in this process (a reference with the same tokenizer scores them as served)."""
    began = time.perf_counter()
    try:
        generated = _probe_once(target, probe, timeout_s)
        duration_ms = round((time.perf_counter() - began) * 1000, 3)
        if isinstance(generated, GenerationResult):
            return probe_result_from_stats(target=target.name, probe=probe, round_id=round_id, stats=generated.stats,
                                           text=generated.text, duration_ms=duration_ms,
                                           device_name=getattr(target, "device_name", None)), None, generated.served_ids
        return (generated.to_result(target=target.name, probe=probe, round_id=round_id, duration_ms=duration_ms),
                None, None)
    except Exception as exc:  # a failed probe is data, not a crash
        reason = classify_failure(exc)
        logger.warning("probe %s on %s failed (%s): %s", probe.id, target.name, reason, exc)
        result = ProbeResult.failure(target=target.name, model=target.model, probe=probe, round_id=round_id,
                                     reason=reason, message=f"{type(exc).__name__}: {exc}",
                                     duration_ms=round((time.perf_counter() - began) * 1000, 3))
        return result, exc.worker if isinstance(exc, DeadlineExceeded) else None, None


def judge(result: ProbeResult, probe: Probe, reference: Reference | None,
          served_ids: Sequence[int] | None = None) -> None:
    """Fill a served answer's quality: the probe's task check on its text, and, with a reference, the
    reference-scored figures (over the engine's own, which scored it against its own weights). A reference
    that cannot score is logged and leaves the figures the target reported: the answer is still data."""
    if not result.ok:
        return
    if probe.check is not None:
        result.task_passed = probe.check.passed(result.output_text or "")
    if reference is None or result.baseline:
        return
    try:
        score = reference.score(probe, result.output_text or "", served_ids)
    except Exception as exc:  # scoring is the collector's own work: it never turns an answer into a failure
        logger.warning("reference %s could not score probe %s of %s: %s", reference.name, probe.id, result.target,
                       exc)
        return
    for name, value in score.fields().items():
        setattr(result, name, value)


def run_round(target: Target, probe_set: ProbeSet, exporters: Sequence[Exporter],
              stop: threading.Event | None = None, *, timeout_s: float | None = None,
              cancel_grace_s: float = 5.0, baseline: bool = False,
              reference: Reference | None = None) -> RoundSummary:
    """Run every probe once. A failed probe becomes a failure result; `stop` ends between probes.

    With `timeout_s`, a probe that overruns it is cancelled and recorded as a `timeout` failure;
    an answer that arrives later is dropped, so each probe yields exactly one result. With
    `baseline`, each probe also runs dense (sensitivity 0) on the same target, right before or after its pruned
    run, stored with `baseline` set: the dense time of the same prompt on the same engine, measured beside it.
    With a `reference`, every served answer (not the baselines) is scored against it before it is exported.
    """
    summary = RoundSummary(round_id=uuid.uuid4().hex, target=target.name)
    round_aware = [e for e in exporters if _round_aware(e)]
    started = utcnow()
    for exporter in round_aware:
        try:
            exporter.start_round(round_id=summary.round_id, target=target.name, model=target.model,
                                 started_at=started, probe_set_digest=probe_set.digest)
        except Exception:
            summary.export_errors += 1
            logger.exception("could not record the start of round %s", summary.round_id)
    runs = [(target, probe, False) for probe in probe_set.probes]
    if baseline:  # dense on the same engine, no quality check (it would compare dense with itself)
        if not _overridable(target):
            raise TypeError(f"target {target.name} cannot run dense baselines: it has no with_overrides")
        dense = target.with_overrides(sensitivity=0.0, quality=False)
        # Each probe pruned and dense back to back, alternating which goes first: a neighbour's load slows both
        # runs of a pair rather than one side of the round, so the pair's ratio (records/latency_window.py)
        # measures pruning, not the host.
        runs = []
        for index, probe in enumerate(probe_set.probes):
            pair = [(target, probe, False), (dense, probe, True)]
            runs += pair if index % 2 == 0 else pair[::-1]
    for runner, probe, is_baseline in runs:
        if stop is not None and stop.is_set():
            break
        result, abandoned, served_ids = _probe_result(runner, probe, summary.round_id, timeout_s)
        result.baseline = is_baseline
        judge(result, probe, reference, served_ids)
        summary.results.append(result)
        summary.export_errors += _export(exporters, result)
        if abandoned is not None:  # let a cancelled probe wind down so the next one does not compete with it
            abandoned.join(cancel_grace_s)
    for exporter in round_aware:
        try:
            exporter.finish_round(summary.round_id, finished_at=utcnow(), ok=summary.ok, failed=summary.failed)
        except Exception:
            summary.export_errors += 1
            logger.exception("could not record the end of round %s", summary.round_id)
    return summary
