"""`prunewatch tune`: knees found on known curves, and a real sweep of the probe engine written as JSON + PNG."""

from __future__ import annotations

import json
import struct
import uuid

import pytest
import typer
from typer.testing import CliRunner

from prunewatch.collector.http_target import HttpTarget
from prunewatch.collector.in_process import InProcessTarget
from prunewatch.collector.tune import (
    TuneError,
    TuneSettings,
    kneedle,
    tune,
    word_agreement,
    write_report,
)
from prunewatch.commands.collect import tune_command
from prunewatch.engine.stats import GenerationResult, QualityReport, RequestStats
from prunewatch.probes import ProbeSet
from tests.collector.prod_helpers import PROBES, SMALL_PROBES

GRID = tuple(round(i / 10, 1) for i in range(11))


class CurveTarget:
    """A target whose figures are known functions of sensitivity (and of a protected layer 5).

    quality: 1 dense; 0.95 while layer 5 is bypassed; falls by 0.2 per 0.1 above 0.6.
    latency per token: 100 ms dense, falling linearly to 40 ms at 0.5, flat after.
    """

    name = "curve"
    model = "curve-model"

    def __init__(self, sensitivity: float = 0.5, layer_blacklist=None, with_quality: bool = True) -> None:
        self.sensitivity = sensitivity
        self.layer_blacklist = list(layer_blacklist or [])
        self.with_quality = with_quality

    def with_overrides(self, *, sensitivity=None, layer_blacklist=None):
        return CurveTarget(sensitivity, layer_blacklist, self.with_quality)

    def run_probe(self, probe):
        s = self.sensitivity
        bypassed = [layer for layer in ([3, 5] if s > 0 else []) if layer not in self.layer_blacklist]
        quality = 1.0 - (0.05 if 5 in bypassed else 0.0) - max(0.0, round(s - 0.6, 6)) * 2
        per_token = 100.0 * (1 - 0.6 * min(s, 0.5) / 0.5)
        stats = RequestStats(
            request_id=uuid.uuid4().hex, model=self.model, device="cpu", dtype="float32", prompt_tokens=8,
            completion_tokens=4, preprocessing_ms=1.0, inference_ms=per_token * 4, postprocessing_ms=1.0, ttft_ms=1.0,
            decode_tokens_per_s=1.0, tokens_per_s=1.0, sensitivity=s, pruning_ratio=0.5 * s, executed_flops=1,
            dense_flops=2, layers_bypassed=bypassed,
            quality=QualityReport(reference_agreement=quality, reference_tokens=4, served_nll=1.0)
            if self.with_quality else None)
        return GenerationResult(text="word " * round(quality * 20), token_ids=[1, 2, 3, 4], stats=stats)


def test_kneedle_on_textbook_curves():
    xs = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert kneedle(xs, [1.0, 1.0, 1.0, 0.99, 0.9, 0.6], decreasing=True, min_distance=0.05) == 0.6
    assert kneedle(xs, [0.0, 0.2, 0.35, 0.42, 0.45, 0.46], decreasing=False, min_distance=0.05) == 0.4
    assert kneedle(xs, [0.0, 0.2, 0.4, 0.6, 0.8, 1.0], decreasing=False, min_distance=0.05) is None  # no bend
    assert kneedle(xs, [1.0] * 6, decreasing=True, min_distance=0.05) is None  # flat


def test_known_curves_give_the_expected_knees_recommendation_and_blacklist(tmp_path):
    report = tune(CurveTarget(), ProbeSet(PROBES.probes[:2], "t"), TuneSettings(sensitivities=GRID, blacklist=True))
    assert [p.pruning_ratio for p in report.points] == [0.5 * s for s in GRID]
    assert [p.latency_ms for p in report.points] == pytest.approx([100, 88, 76, 64, 52, 40, 40, 40, 40, 40, 40])
    assert [p.quality for p in report.points] == pytest.approx([1, .95, .95, .95, .95, .95, .95, .75, .55, .35, .15])
    assert (report.quality_knee, report.latency_knee, report.knee) == (0.6, 0.5, 0.5)
    assert report.recommended_sensitivity == 0.43 and report.margin == 0.07
    assert [(t.layer, round(t.quality_gain, 6)) for t in report.blacklist_trials] == [(3, 0.0), (5, 0.05)]
    assert report.recommended_blacklist == [5]
    assert report.quality_source.startswith("reference-scored agreement of the served answer")
    twice = tune(CurveTarget(), ProbeSet(PROBES.probes[:2], "t"), TuneSettings(sensitivities=GRID, repeats=2))
    assert [p.probes for p in twice.points] == [4] * 11  # two passes of two probes per point
    assert (twice.knee, twice.recommended_sensitivity) == (0.5, 0.43)
    json_path, png_path = write_report(report, tmp_path)
    saved = json.loads(json_path.read_text())
    assert saved["recommended_sensitivity"] == 0.43 and len(saved["points"]) == 11
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_engine_quality_the_output_is_compared_with_the_dense_answer():
    report = tune(CurveTarget(with_quality=False), ProbeSet(PROBES.probes[:1], "t"), TuneSettings(sensitivities=GRID))
    assert report.quality_source.startswith("word agreement with the target's own output at sensitivity 0")
    assert [p.quality for p in report.points] == pytest.approx([1, .95, .95, .95, .95, .95, .95, .75, .55, .35, .15])
    assert word_agreement("a b x", "a b c d") == 0.5 and word_agreement("", "") == 1.0


def test_settings_and_targets_that_cannot_be_tuned():
    with pytest.raises(TuneError, match="must include the baselines 0.0 \\(dense\\) and 1.0"):
        TuneSettings(sensitivities=(0.0, 0.5, 0.9))
    with pytest.raises(TuneError, match="at least 3 distinct values in increasing order"):
        TuneSettings(sensitivities=(0.0, 1.0, 0.5))
    baseline = HttpTarget(name="vllm", base_url="http://127.0.0.1:9", model="m", kind="openai")
    with pytest.raises(TuneError, match="vllm is a baseline \\(openai\\): it does not prune"):
        tune(baseline, PROBES)


def test_real_sweep_of_the_probe_engine(probe_engine, tmp_path):
    report = tune(InProcessTarget(probe_engine, name="embedded"), SMALL_PROBES,
                  TuneSettings(sensitivities=(0.0, 0.5, 1.0)))
    dense, half, full = report.points
    assert (dense.pruning_ratio, dense.quality, dense.layers_bypassed, dense.failed) == (0.0, 1.0, {}, 0)
    assert 0 < half.pruning_ratio < full.pruning_ratio < 1  # measured, more skipped at higher sensitivity
    assert set(half.layers_bypassed) <= set(full.layers_bypassed)
    assert all(0 <= p.quality <= 1 and p.latency_ms > 0 for p in report.points)
    assert report.recommended_sensitivity == round(max(0.0, report.knee - 0.07), 4)
    assert report.latency_source == "engine inference time per token (measured)"
    _, png = write_report(report, tmp_path)
    width, height = struct.unpack(">II", png.read_bytes()[16:24])
    assert (width, height) == (880, 715)


def test_tune_command_bad_input(tmp_path):
    app = typer.Typer()
    app.command()(tune_command)
    config = tmp_path / "t.yaml"
    config.write_text("targets:\n  - {name: vllm, kind: openai, base_url: 'http://127.0.0.1:9', model: m}\n")
    runner = CliRunner()
    bad = runner.invoke(app, ["--target", "vllm", "--config", str(config), "--points", "0,0.5,2"])
    assert bad.exit_code == 2 and bad.output.strip() == "error: --points: sensitivities must be within [0, 1], got '0,0.5,2'"
    baseline = runner.invoke(app, ["--target", "vllm", "--config", str(config)])
    assert baseline.exit_code == 2
    assert baseline.output.strip() == "error: target vllm is a baseline (openai): it does not prune, there is nothing to tune"
    unknown = runner.invoke(app, ["--target", "nope", "--config", str(config)])
    assert unknown.exit_code == 2 and "no target named 'nope'" in unknown.output


def test_alert_thresholds_come_from_the_sweep_points():
    """Curve: ratio 0.5 x s; quality 0.95 while layer 5 is bypassed, falling 0.2 per 0.1 above 0.6."""
    report = tune(CurveTarget(), PROBES, TuneSettings(sensitivities=GRID, quality_floor=0.9,
                                                      configured_red_line=0.44))
    thresholds = report.alert_thresholds
    # quality at 0.7 is 0.75 (< 0.9): the lowest ratio with lost quality is 0.35; the highest kept one 0.3 (s 0.6)
    assert (thresholds.quality_risk_ratio, thresholds.quality_red_line) == (0.35, 0.3)
    assert thresholds.ratio_low == pytest.approx(round(0.5 * 0.5 * report.recommended_sensitivity, 4))
    assert set(thresholds.evidence) == {"ratio_low", "quality_red_line", "quality_risk_ratio"}
    never_lost = tune(CurveTarget(), PROBES, TuneSettings(sensitivities=GRID, quality_floor=0.1,
                                                          configured_red_line=0.44)).alert_thresholds  # worst: 0.15
    assert never_lost.quality_risk_ratio is None and never_lost.quality_red_line is None  # keep the defaults
    assert "never fell below 0.1" in never_lost.evidence["quality_risk_ratio"]


class WordsReference:
    """A dense reference that scores an answer by its length: 20 words is the reference's own answer."""

    name = "words"

    def score(self, probe, served_text, served_ids=None):
        from prunewatch.collector.reference import ReferenceScore

        words = len(served_text.split())
        return ReferenceScore(reference_agreement=min(1.0, words / 20), reference_tokens=20, served_nll=1.0,
                              reference_nll=1.0, divergence_at=None, quality_source="reference:words", quality_ms=1.0)


def test_with_a_reference_the_knee_is_found_on_the_reference_scored_agreement():
    """The curve's served answers shrink as quality falls; the reference scores them. Its continuation agreement
    (the engine's) is ignored where a reference scored the answer."""
    report = tune(CurveTarget(), ProbeSet(PROBES.probes[:2], "t"), TuneSettings(sensitivities=GRID),
                  reference=WordsReference())
    assert report.quality_source.startswith("reference-scored agreement of the served answer")
    assert [p.quality for p in report.points] == pytest.approx([1, .95, .95, .95, .95, .95, .95, .75, .55, .35, .15])
    assert report.quality_knee == 0.6
    measured = report.operating_range
    assert measured is not None and measured.source == "tune" and measured.sensitivity == 0.5
    assert measured.ratio == pytest.approx(0.25) and measured.agreement["estimate"] == pytest.approx(0.95)
    kinds = {t.kind: t for t in measured.thresholds()}
    assert kinds["ratio_low"].value == pytest.approx(0.125)  # half the ratio measured at the default
    assert "tune" in kinds["ratio_risk"].evidence and kinds["ratio_risk"].source == "tune"


@pytest.mark.integration
def test_tune_on_a_model_records_its_operating_range_for_the_rules(probe_model_dir, tmp_path, calibration_dir):
    import os
    import subprocess
    import sys

    from tests.deploy.test_stack import PROBES as TWO_PROBES

    out = tmp_path / "tune"
    env = {**os.environ, "PRUNEWATCH_COLLECTOR_CALIBRATION_DIR": str(calibration_dir)}
    done = subprocess.run([sys.executable, "-m", "prunewatch", "tune", "--model", str(probe_model_dir), "--device",
                           "cpu", "--points", "0,0.5,1", "--probes", str(TWO_PROBES), "--quality-floor", "0.99",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "tune-probe-llama.json").read_text())
    assert report["quality_source"].startswith("reference-scored agreement of the served answer")
    measured = json.loads((out / "tune-probe-llama-range.json").read_text())
    assert measured["source"] == "tune" and measured["model"] == "probe-llama" and measured["sensitivity"] == 0.5
    kinds = {t["kind"]: t for t in measured["thresholds"]}
    assert {"ratio_low", "ratio_red_line", "ratio_risk", "quality_floor", "tpot_vs_dense_max"} <= set(kinds)
    assert all(t["source"] == "tune" and t["evidence"] for t in kinds.values())
    # Installed where `prunewatch run` and `prunewatch alerts eval` read it for this model.
    (installed,) = calibration_dir.glob("probe-llama-*.operating-range.json")
    assert json.loads(installed.read_text())["measured_at"] == measured["measured_at"]
    assert f"installed the operating range as {installed}" in done.stdout
    listed = subprocess.run([sys.executable, "-m", "prunewatch", "alerts", "thresholds", "--ranges", str(calibration_dir)],
                            capture_output=True, text=True, timeout=120, env=env)
    assert listed.returncode == 0 and "ratio_low" in listed.stdout and "tune" in listed.stdout, listed.stdout
