"""Quality for an engine that is not ours: an OpenAI-compatible server, scored by a dense reference over HTTP.

The target is a `prunewatch serve` that prunes hard (layer bypass and head gating at sensitivity 1), addressed as a
plain `kind: openai` server: the collector sends it no pruning header and asks it for no quality check. The reference is a second `prunewatch serve` at sensitivity 0 (the dense model), read only through
OpenAI's `echo` + `logprobs` on /v1/completions, with the chat prompt rendered from the model folder's template.
Every served answer gets its reference-scored agreement, NLL and task check; they are stored, exported and match
what the same model, run dense in this process, computes for the same text.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy.orm import Session

from prunewatch.collector.fleet import FleetSettings, build_jobs, run_collector
from prunewatch.collector.reference import EngineReference
from prunewatch.collector.target_config import load_targets
from prunewatch.probes import ProbeSet, load_probes
from prunewatch.records.metrics import CollectorMetrics
from prunewatch.records.store import ResultRepository, connect
from tests.support.servers import prunewatch_serve

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1500)]  # two servers start

PRUNE_HARD = {"PRUNEWATCH_ENGINE_INFLUENCE_BUDGET": "0.5", "PRUNEWATCH_ENGINE_HEAD_GATING": "true",
              "PRUNEWATCH_ENGINE_HEAD_BUDGET": "0.1"}


def test_an_openai_target_is_scored_by_an_http_reference(probe_model_dir: Path, calibration_dir: Path,
                                                           probe_engine, tmp_path: Path) -> None:
    probes = ProbeSet(load_probes().probes[:3], "reference test", "evaluation")
    with prunewatch_serve(probe_model_dir, args=("--sensitivity", "1.0"), env=PRUNE_HARD,
                          calibration_dir=calibration_dir) as (pruned, _), \
            prunewatch_serve(probe_model_dir, args=("--sensitivity", "0"), calibration_dir=calibration_dir) as (dense, _):
        config = tmp_path / "targets.yaml"
        config.write_text(
            "targets:\n"
            f"  - {{name: foreign, kind: openai, base_url: '{pruned}', model: probe-llama, reference: dense}}\n"
            "references:\n"
            f"  - {{name: dense, kind: http, base_url: '{dense}', model: probe-llama, template: '{probe_model_dir}'}}\n")
        (job,) = build_jobs(load_targets(config), probes)
        url = f"sqlite:///{tmp_path / 'foreign.db'}"
        metrics = CollectorMetrics(CollectorRegistry())
        outcome = run_collector(FleetSettings(db_url=url, buffer_path=tmp_path / "b.sqlite", rounds=1,
                                              metrics_port=0), [job], metrics=metrics)
    assert (outcome.rounds, outcome.failures) == (1, 0)
    store = connect(url)
    with Session(store) as session:
        results = {r.probe_id: r for r in ResultRepository(session).list()}
    store.dispose()
    local = EngineReference(probe_engine)  # the same model run dense here: the HTTP reference must agree with it
    by_id = {p.id: p for p in probes.probes}
    agreements = []
    for probe_id, result in results.items():
        assert result.quality_source == "reference:dense"  # not the engine's own check: none was asked for
        assert result.reference_tokens > 0 and 0.0 <= result.reference_agreement <= 1.0 and result.served_nll > 0
        probe = by_id[probe_id]
        assert result.task_passed == probe.check.passed(result.output_text)
        here = local.score(probe, result.output_text)
        assert result.reference_tokens == here.reference_tokens
        assert result.reference_agreement == pytest.approx(here.reference_agreement, abs=1e-6)
        assert result.served_nll == pytest.approx(here.served_nll, rel=1e-4)
        assert result.reference_nll == pytest.approx(here.reference_nll, rel=1e-4)
        assert result.divergence_at == here.divergence_at
        agreements.append(result.reference_agreement)
        labels = {"model": "probe-llama", "domain": probe.domain, "probe": probe_id, "target": "foreign"}
        assert metrics.registry.get_sample_value("prunewatch_reference_agreement", labels) == \
            result.reference_agreement
    assert min(agreements) < 1.0  # pruning this hard changes answers: the figure can tell
    window = {"model": "probe-llama", "domain": probes.probes[0].domain, "target": "foreign"}
    low = metrics.registry.get_sample_value("prunewatch_reference_agreement_window", {**window, "bound": "low"})
    high = metrics.registry.get_sample_value("prunewatch_reference_agreement_window", {**window, "bound": "high"})
    assert low is not None and high is not None and low <= high
