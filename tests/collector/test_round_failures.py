"""A failed probe is data, not a crash; a failing exporter never costs the others their result."""

from dataclasses import replace

from prometheus_client import CollectorRegistry
from sqlalchemy.orm import Session

from prunewatch.collector.exporters import SqlExporter
from prunewatch.collector.probe_round import run_round
from prunewatch.engine.errors import InvalidRequestError
from prunewatch.engine.stats import GenerationResult, RequestStats
from prunewatch.probes import ProbeSet
from prunewatch.records.metrics import CollectorMetrics
from prunewatch.records.store import ResultRepository, connect, create_schema
from tests.collector.factories import PROBE

SECOND = replace(PROBE, id="tech-second")
THIRD = replace(PROBE, id="tech-third")


def stats(model: str = "fake") -> RequestStats:
    return RequestStats(request_id="x", model=model, device="cpu", dtype="float32", prompt_tokens=5,
                        completion_tokens=4, preprocessing_ms=1.0, inference_ms=200.0, postprocessing_ms=2.0,
                        ttft_ms=50.0, decode_tokens_per_s=20.0, tokens_per_s=20.0, sensitivity=0.5,
                        pruning_ratio=0.25, executed_flops=75, dense_flops=100)


class ScriptedTarget:
    """Fails the probes named in `failures` with the given exception, succeeds on the rest."""

    name = "scripted"
    model = "fake"

    def __init__(self, failures: dict[str, Exception]) -> None:
        self.failures = failures

    def run_probe(self, probe):
        if probe.id in self.failures:
            raise self.failures[probe.id]
        return GenerationResult(text="ok", token_ids=[1, 2, 3, 4], stats=stats())


class BrokenExporter:
    def __init__(self):
        self.calls = 0

    def record(self, result):
        self.calls += 1
        raise RuntimeError("disk full")


def test_failures_become_rows_and_counter_increments(tmp_path):
    db = connect(f"sqlite:///{tmp_path / 'r.db'}")
    create_schema(db)
    metrics = CollectorMetrics(CollectorRegistry())
    broken = BrokenExporter()
    target = ScriptedTarget({SECOND.id: TimeoutError("probe exceeded 5 s"),
                             THIRD.id: InvalidRequestError("sensitivity must be within [0, 1], got 2")})
    summary = run_round(target, ProbeSet((PROBE, SECOND, THIRD), "test"), [broken, SqlExporter(db), metrics])

    assert (summary.ok, summary.failed, summary.export_errors) == (1, 2, 3)
    assert broken.calls == 3
    with Session(db) as session:
        rows = {r.probe_id: r for r in ResultRepository(session).list()}
    assert rows[PROBE.id].status == "ok" and rows[PROBE.id].pruning_ratio == 0.25
    assert (rows[SECOND.id].status, rows[SECOND.id].failure_reason) == ("failed", "timeout")
    assert rows[SECOND.id].error_message == "TimeoutError: probe exceeded 5 s"
    assert rows[SECOND.id].pruning_ratio is None
    assert rows[THIRD.id].failure_reason == "invalid_request"
    get = metrics.registry.get_sample_value
    labels = {"model": "fake", "domain": "tech", "target": ScriptedTarget.name}
    assert get("prunewatch_probe_failures_total", {**labels, "reason": "timeout"}) == 1
    assert get("prunewatch_probe_failures_total", {**labels, "reason": "invalid_request"}) == 1
    assert get("prunewatch_probe_results_total", {**labels, "status": "ok"}) == 1
    with Session(db) as session:
        from prunewatch.records.store.models import RoundRow

        round_row = session.get(RoundRow, summary.round_id)
        assert (round_row.probes_ok, round_row.probes_failed) == (1, 2)
        assert round_row.finished_at is not None


class TimedTarget(ScriptedTarget):
    """Answers every probe; `with_overrides` gives a dense twin sharing the call log, as an engine target does."""

    def __init__(self, calls: list[tuple[str, float]], sensitivity: float = 0.5) -> None:
        super().__init__({})
        self.calls, self.sensitivity = calls, sensitivity

    def with_overrides(self, *, sensitivity: float, quality: bool) -> "TimedTarget":
        return TimedTarget(self.calls, sensitivity)

    def run_probe(self, probe):
        self.calls.append((probe.id, self.sensitivity))
        return super().run_probe(probe)


def test_a_baseline_round_runs_each_probe_pruned_and_dense_back_to_back_and_the_pairs_are_exported():
    calls: list[tuple[str, float]] = []
    metrics = CollectorMetrics(CollectorRegistry())
    summary = run_round(TimedTarget(calls), ProbeSet((PROBE, SECOND, THIRD), "test"), [metrics], baseline=True)
    # Neighbours on the host slow both runs of a pair: each probe's two runs are adjacent, first side alternating.
    assert calls == [(PROBE.id, 0.5), (PROBE.id, 0.0), (SECOND.id, 0.0), (SECOND.id, 0.5),
                     (THIRD.id, 0.5), (THIRD.id, 0.0)]
    assert [r.baseline for r in summary.results] == [False, True, True, False, False, True]
    pairs = metrics.registry.get_sample_value(
        "prunewatch_latency_vs_dense_pairs", {"model": "fake", "domain": "tech", "target": "scripted",
                                              "phase": "decode"})
    assert pairs == 3.0
