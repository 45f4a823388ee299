"""The operating range on the collector side: measured at the default configuration only, cached, exported."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from prunewatch.collector.fleet import FleetSettings, export_thresholds
from prunewatch.collector.operating_range import evaluation_probes, load_or_measure, non_default_settings, summarise
from prunewatch.engine.settings import EngineSettings
from prunewatch.probes import ProbeSet, load_probes
from prunewatch.records.metrics import CollectorMetrics
from prunewatch.records.operating_range import range_path
from prunewatch.records.results import ProbeResult
from tests.alerts.conftest import measured_range


def test_only_the_default_pruning_configuration_is_measured(tmp_path, probe_model_dir) -> None:
    defaults = EngineSettings(model_dir=probe_model_dir, sensitivity=1.0, device="cpu")  # sensitivity is per request
    assert non_default_settings(defaults) == {}
    bypass = EngineSettings(model_dir=probe_model_dir, influence_budget=1.0)
    assert non_default_settings(bypass) == {"influence_budget": 1.0}
    outcome = load_or_measure(None, None, evaluation_probes(["legal"]), directory=tmp_path, model="m",
                              fingerprint="f" * 64, sensitivity=0.5, engine_settings=bypass, device="cpu")
    assert outcome.range is None and outcome.how == "none"
    assert "non-default pruning configuration (influence_budget=1.0)" in outcome.detail
    cached = measured_range(model="m")  # measured before, at the defaults: a regression run keeps comparing with it
    cached.save(range_path(tmp_path, "m", "f" * 64))
    again = load_or_measure(None, None, evaluation_probes(["legal"]), directory=tmp_path, model="m",
                            fingerprint="f" * 64, sensitivity=0.5, engine_settings=bypass, device="cpu")
    assert again.how == "loaded" and again.range == cached


def test_evaluation_prompts_of_the_probed_domains() -> None:
    prompts = evaluation_probes(["legal", "tech", "finance"])
    assert prompts.domains == ["finance", "legal", "tech"] and len(prompts.probes) == 21
    assert prompts.role == "evaluation"
    assert len(evaluation_probes(["not-a-domain"]).probes) == 63  # none probed is in the set: all of it


def test_the_collector_exports_the_thresholds_of_the_models_it_probes(tmp_path, caplog) -> None:
    measured = measured_range(model="SmolLM2-135M-Instruct")
    measured.save(range_path(tmp_path, measured.model, measured.model_fingerprint))
    measured_range(model="elsewhere").save(range_path(tmp_path, "elsewhere", "e" * 64))
    jobs = [SimpleNamespace(target=SimpleNamespace(model="SmolLM2-135M-Instruct")),
            SimpleNamespace(target=SimpleNamespace(model="probe-llama"))]
    metrics = CollectorMetrics()
    with caplog.at_level(logging.INFO, logger="prunewatch.collector"):
        found = export_thresholds(metrics, FleetSettings(operating_range_dir=tmp_path), jobs)
    assert found == ["SmolLM2-135M-Instruct"]
    exported = {(s.labels["model"], s.labels["kind"]) for family in metrics.registry.collect()
                if family.name == "prunewatch_alert_threshold" for s in family.samples}
    assert ("SmolLM2-135M-Instruct", "ratio_low") in exported and not any(m != "SmolLM2-135M-Instruct"
                                                                          for m, _ in exported)
    assert "no operating range of probe-llama" in caplog.text and "fallbacks" in caplog.text


def _result(probe, *, sensitivity, ratio, agreement=None, passed=None, tps=20.0, ttft_ms=50.0, baseline=False):
    return ProbeResult(target="t", model="m", probe_id=probe.id, probe_version=probe.version,
                       probe_hash=probe.content_hash, domain=probe.domain, status="ok", round_id="r",
                       sensitivity=sensitivity, pruning_ratio=ratio, reference_agreement=agreement,
                       reference_tokens=None if agreement is None else 20, task_passed=passed,
                       decode_tokens_per_s=tps, ttft_ms=ttft_ms, prompt_tokens=25, baseline=baseline)


def test_summarise_reads_the_dense_and_default_rounds() -> None:
    probes = ProbeSet(load_probes().probes[:4], "evaluation.yaml")
    dense = [_result(p, sensitivity=0.0, ratio=0.0, passed=True, tps=20.0) for p in probes.probes]
    pruned = [_result(p, sensitivity=0.5, ratio=0.1 + 0.02 * i, agreement=0.8 + 0.05 * i, passed=i != 0, tps=25.0)
              for i, p in enumerate(probes.probes)]
    measured = summarise(dense, pruned, model="m", fingerprint="f" * 64, source="calibration", probe_set=probes,
                         sensitivity=0.5, engine={}, device="cpu: test")
    assert measured.prompts == 4 and measured.ratio == pytest.approx(0.13)
    assert measured.agreement["estimate"] == pytest.approx(0.875) and measured.agreement["prompts"] == 4
    assert measured.agreement_per_prompt == [0.8, 0.85, 0.9, 0.95]
    assert measured.pass_rate_dense["estimate"] == 1.0 and measured.pass_rate_default["estimate"] == 0.75
    assert measured.dense.time_per_output_token_s == pytest.approx(0.05)
    assert measured.default.time_per_output_token_s == pytest.approx(0.04)
    assert measured.dense.ttft_per_prompt_token_s == pytest.approx(0.002)
    with pytest.raises(ValueError, match="nothing to measure"):
        summarise(dense, [], model="m", fingerprint="f", source="calibration", probe_set=probes, sensitivity=0.5,
                  engine={}, device="cpu")


def test_measured_once_with_each_prompt_dense_and_pruned_back_to_back(tmp_path, probe_model_dir) -> None:
    from tests.collector.test_prod_tune import CurveTarget, WordsReference

    calls: list[float] = []

    class Recorded(CurveTarget):
        def with_overrides(self, *, sensitivity=None, layer_blacklist=None, quality=None):
            return Recorded(sensitivity, layer_blacklist, self.with_quality)

        def run_probe(self, probe):
            calls.append(self.sensitivity)
            return super().run_probe(probe)

    probes = ProbeSet(load_probes().probes[:3], "evaluation.yaml")
    defaults = EngineSettings(model_dir=probe_model_dir)
    progress: list[tuple[int, int]] = []
    measured = load_or_measure(Recorded(), WordsReference(), probes, directory=tmp_path, model="curve-model",
                               fingerprint="f" * 64, sensitivity=0.5, engine_settings=defaults, device="cpu: test",
                               progress=lambda done, total: progress.append((done, total)))
    assert measured.how == "measured" and calls == [0.0, 0.5, 0.5, 0.0, 0.0, 0.5]  # pairs, alternating order
    assert progress == [(1, 3), (2, 3), (3, 3)]  # the bar hears of each prompt measured
    assert measured.range.ratio == pytest.approx(0.25) and measured.range.agreement["estimate"] == pytest.approx(0.95)
    assert measured.path == range_path(tmp_path, "curve-model", "f" * 64) and measured.path.is_file()
    again = load_or_measure(Recorded(), WordsReference(), probes, directory=tmp_path, model="curve-model",
                            fingerprint="f" * 64, sensitivity=0.5, engine_settings=defaults, device="cpu: test")
    assert again.how == "loaded" and len(calls) == 6  # cached: not measured twice
