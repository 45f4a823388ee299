"""One collector run probes two targets, the in-process engine and a prunewatch server over HTTP, into PostgreSQL."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from prunewatch.collector.fleet import FleetSettings, run_collector
from prunewatch.collector.http_target import HttpTarget
from prunewatch.collector.in_process import InProcessTarget
from prunewatch.collector.scheduler import TargetJob
from prunewatch.records.metrics import CollectorMetrics
from prunewatch.records.store import ResultRepository, connect
from prunewatch.server.app import create_app
from prunewatch.server.settings import ServerSettings
from tests.collector.prod_helpers import SMALL_PROBES, fresh_database, serving

pytestmark = pytest.mark.integration


def test_in_process_and_http_targets_in_one_run(postgres, probe_engine, tmp_path):
    from sqlalchemy.orm import Session

    url = fresh_database(postgres)
    metrics = CollectorMetrics(CollectorRegistry())
    with serving(create_app(probe_engine, ServerSettings(api_keys=["k"]))) as base_url:
        jobs = [
            TargetJob(InProcessTarget(probe_engine, name="embedded", sensitivity=0.5), SMALL_PROBES,
                      interval_s=3600, timeout_s=120),
            TargetJob(HttpTarget(name="gpu-a", base_url=base_url, model=probe_engine.name, api_key="k",
                                 sensitivity=0.5, timeout_s=120), SMALL_PROBES, interval_s=3600, timeout_s=120),
        ]
        outcome = run_collector(FleetSettings(db_url=url, buffer_path=tmp_path / "b.sqlite", rounds=1,
                                              metrics_port=0), jobs, metrics=metrics)
    assert (outcome.rounds, outcome.results, outcome.failures, outcome.written, outcome.buffered) == (2, 4, 0, 4, 0)
    engine = connect(url)
    with Session(engine) as session:
        repo = ResultRepository(session)
        stored = {(r.target, r.probe_id): r for r in repo.list()}
        assert repo.round_count() == 2
    engine.dispose()
    assert sorted(stored) == sorted((t, p.id) for t in ("embedded", "gpu-a") for p in SMALL_PROBES.probes)
    for probe in SMALL_PROBES.probes:
        local, remote = stored[("embedded", probe.id)], stored[("gpu-a", probe.id)]
        # Same engine, same greedy tokens, same plan: the ratio measured in-process and over HTTP agree exactly.
        assert local.pruning_ratio == remote.pruning_ratio and local.pruning_ratio > 0
        assert local.layers_bypassed == remote.layers_bypassed and local.output_text == remote.output_text
        # Both scored against the same engine's own weights run dense (X-Pruning-Quality over HTTP): the same figure.
        assert local.reference_agreement is not None and remote.reference_agreement == local.reference_agreement
        assert (local.quality_source, remote.quality_source) == ("engine", "engine")
        assert remote.reference_tokens == local.reference_tokens and remote.served_nll == local.served_nll
    for target in ("embedded", "gpu-a"):
        assert metrics.registry.get_sample_value("prunewatch_last_success_timestamp_seconds",
                                                 {"model": probe_engine.name, "target": target}) > 0
        assert metrics.registry.get_sample_value("prunewatch_probe_duration_seconds_count",
                                                 {"model": probe_engine.name, "target": target, "status": "ok"}) == 2
        # Same model behind both targets: each keeps its own per-probe series, none overwrites the other's.
        for probe in SMALL_PROBES.probes:
            assert metrics.registry.get_sample_value(
                "prunewatch_pruning_ratio", {"model": probe_engine.name, "domain": probe.domain, "probe": probe.id,
                                             "target": target}) == stored[(target, probe.id)].pruning_ratio
