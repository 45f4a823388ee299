"""The ROI core against hand-computed cases: measured and estimated bases, overrides, edge cases."""

from __future__ import annotations

import csv
import io
import json
import math

import pytest

from prunewatch.roi import (
    Assumptions,
    Basis,
    NoMeasurementsError,
    NoTrafficError,
    Provenance,
    TimeBasis,
    calculate,
    projection,
    sensitivity,
    summarize,
    waterfall,
)
from prunewatch.roi.costs import DAYS_PER_MONTH, reserved_gpus
from prunewatch.roi.errors import RoiError
from prunewatch.roi.formatting import payback_text, usd
from prunewatch.roi.tables import headlines, to_csv
from tests.roi.factories import WINDOW, failed, measured_basis_results, probe

# Round assumptions for the hand-computed cases (all user-entered).
HAND = dict(requests_per_day=45_000, gpu_hourly_usd=2.0, gpu_utilisation=0.5, incident_cost_usd=1.0,
            input_usd_per_mtok=1.0, output_usd_per_mtok=4.0, implementation_cost_usd=1_000.0)


def test_summary_matches_probes_across_configurations_and_counts_failures() -> None:
    summary = summarize(measured_basis_results(), WINDOW)
    assert (summary.results_total, summary.results_ok, summary.results_failed) == (8, 7, 1)
    assert summary.failures_by_reason == {"timeout": 1}
    assert (summary.pruned_results, summary.dense_results, summary.matched_probes) == (4, 3, 2)
    assert summary.matched_pruned_ms == pytest.approx(2500.0)
    assert summary.matched_dense_ms == pytest.approx(3200.0)
    assert summary.pruned_inference_ms == pytest.approx((3000 + 3400 + 1800 + 1000) / 4)
    assert summary.mean_pruning_ratio == pytest.approx(0.3)
    assert (summary.prompt_tokens, summary.completion_tokens) == (pytest.approx(100.0), pytest.approx(50.0))
    assert summary.failure_rate == pytest.approx(0.125)
    assert summary.continuation_agreement_min == pytest.approx(0.9)
    assert summary.uses_probe_model  # the factories report the bundled probe model's name


def test_summary_window_is_half_open_and_filters_target_and_model() -> None:
    inside = probe(minutes=0)
    at_end = probe(minutes=24 * 60)  # WINDOW ends exactly one day after T0
    other_target = probe(target="gpu-1")
    other_model = probe(model="llama-8b")
    summary = summarize([inside, at_end, other_target, other_model], WINDOW, target="embedded", model="probe-llama")
    assert summary.results_total == 1
    assert summary.targets == ["embedded", "gpu-1"]
    assert summary.models == ["llama-8b", "probe-llama"]
    assert summary.uses_probe_model
    assert not summarize([other_model], WINDOW, model="llama-8b").uses_probe_model


def test_measured_basis_hand_computed_costs_on_both_bases() -> None:
    summary, result = calculate(measured_basis_results(), WINDOW, Assumptions(**HAND))
    inputs = result.inputs
    assert inputs.time_basis is TimeBasis.MEASURED
    assert inputs.factor == pytest.approx(0.78125)
    assert (result.gpu_time.before_s, result.gpu_time.after_s) == (pytest.approx(3.2), pytest.approx(2.5))
    assert result.gpu_time.before_provenance is Provenance.MEASURED
    assert result.gpu_time.after_provenance is Provenance.MEASURED
    # Usage: busy 45000*3.2/3600 = 40 h -> 80 billed h -> $160; after 31.25 h -> 62.5 h -> $125.
    # Tokens 45000*(100*1 + 50*4)/1e6 = $13.50; failures 45000*0.125*$1 = $5625 (same before and after).
    usage = result.usage
    assert usage.before.gpu_usd == pytest.approx(160.0) and usage.after.gpu_usd == pytest.approx(125.0)
    assert usage.before.token_usd == pytest.approx(13.5) == usage.after.token_usd
    assert usage.before.failure_usd == pytest.approx(5625.0) == usage.after.failure_usd
    assert usage.savings_per_day == pytest.approx(35.0)
    assert usage.savings_per("month") == pytest.approx(35.0 * 365 / 12)
    assert usage.savings_per("year") == pytest.approx(35.0 * 365)
    # Allocation: ceil(40 / (24*0.5)) = 4 GPUs before, ceil(31.25/12) = 3 after, 24 h x $2 each.
    alloc = result.allocation
    assert (alloc.gpus_before, alloc.gpus_after) == (4, 3)
    assert alloc.before.gpu_usd == pytest.approx(192.0) and alloc.after.gpu_usd == pytest.approx(144.0)
    assert alloc.savings_per_day == pytest.approx(48.0)
    assert result.payback(Basis.ALLOCATION).days == pytest.approx(1000 / 48)
    assert result.payback(Basis.USAGE).days == pytest.approx(1000 / 35)
    assert [m.net_usd for m in result.milestones(Basis.USAGE)] == pytest.approx([35 * 30 - 1000, 35 * 60 - 1000,
                                                                                  35 * 90 - 1000])
    assert "0.781" in inputs.describe_basis() and "2 probes" in inputs.describe_basis()
    provenance = {row.key: row.provenance for row in inputs.rows()}
    assert provenance["requests_per_day"] is Provenance.USER_ENTERED
    assert provenance["failure_rate"] is Provenance.MEASURED
    assert provenance["time_factor"] is Provenance.MEASURED
    assert "prunable_time_share" not in provenance  # only the estimated basis uses it


def test_estimated_basis_scales_by_one_minus_ratio_times_prunable_share() -> None:
    results = [probe("tech-a", inference_ms=2000, ratio=0.25), probe("legal-b", inference_ms=2000, ratio=0.25, minutes=1)]
    assumptions = Assumptions(requests_per_day=3600, gpu_hourly_usd=1.0, gpu_utilisation=1.0,
                              input_usd_per_mtok=0.0, output_usd_per_mtok=0.0)
    _, result = calculate(results, WINDOW, assumptions)
    assert result.inputs.time_basis is TimeBasis.ESTIMATED
    assert result.inputs.factor == pytest.approx(1 - 0.25 * 0.8)
    # before = 2.0 s / 0.8 = 2.5 s (estimated); after = 2.0 s (measured); 3600 requests -> 2.5 h vs 2.0 h at $1.
    assert result.gpu_time.before_s == pytest.approx(2.5) and result.gpu_time.after_s == pytest.approx(2.0)
    assert result.gpu_time.before_provenance is Provenance.ESTIMATED
    assert result.gpu_time.after_provenance is Provenance.MEASURED
    assert result.usage.savings_per_day == pytest.approx(0.5)
    assert result.inputs.prunable_time_share.provenance is Provenance.ASSUMED_DEFAULT
    assert result.inputs.describe_basis().startswith("Estimated: no dense baseline was measured")


def test_overrides_are_user_entered_and_make_after_an_estimate() -> None:
    assumptions = Assumptions(**HAND, dense_inference_s=4.0, failure_rate=0.0, prompt_tokens_per_request=1000)
    _, result = calculate(measured_basis_results(), WINDOW, assumptions)
    rows = {row.key: row for row in result.inputs.rows()}
    assert rows["dense_inference_s"].provenance is Provenance.USER_ENTERED
    assert rows["dense_inference_s"].note == "overrides the measured value (3.2)"
    assert rows["failure_rate"].value == 0.0 and rows["failure_rate"].provenance is Provenance.USER_ENTERED
    assert result.gpu_time.after_s == pytest.approx(4.0 * 0.78125)
    assert result.gpu_time.after_provenance is Provenance.ESTIMATED
    # 45000 * (1000*1 + 50*4) / 1e6 = $54 of tokens a day, no failure cost.
    assert result.usage.before.token_usd == pytest.approx(54.0)
    assert result.usage.before.failure_usd == 0.0


def test_zero_traffic_is_a_typed_error_not_a_division_error() -> None:
    with pytest.raises(NoTrafficError, match="request volume is 0 per day"):
        calculate(measured_basis_results(), WINDOW, Assumptions(requests_per_day=0))


@pytest.mark.parametrize("results, message", [
    ([], r"no measurements yet: .*\(0 results, 0 failed\)"),
    ([failed(), failed(minutes=1)], r"no measurements yet: .*\(2 results, 2 failed\)"),
    ([probe(sensitivity=0.0)], r"no measurements yet: no successful probe of a pruned configuration"),
])
def test_no_measurements_is_a_clear_message(results, message) -> None:
    with pytest.raises(NoMeasurementsError, match=message):
        calculate(results, WINDOW, Assumptions())


def test_no_ratio_and_no_dense_baseline_cannot_be_costed() -> None:
    with pytest.raises(NoMeasurementsError, match="run a dense baseline"):
        calculate([probe(ratio=None)], WINDOW, Assumptions())


def test_slower_pruning_has_no_payback() -> None:
    results = [probe(inference_ms=1200), probe(sensitivity=0.0, inference_ms=1000, minutes=1)]
    _, result = calculate(results, WINDOW, Assumptions(**HAND))
    assert result.usage.savings_per_day < 0
    payback = result.payback(Basis.USAGE)
    assert payback.days is None and payback_text(payback) == "no payback"


def test_reserved_gpus_round_up_and_need_one_for_any_traffic() -> None:
    assert reserved_gpus(0.0, 0.7) == 0
    assert reserved_gpus(0.01, 0.7) == 1
    assert reserved_gpus(12.0, 0.5) == 1  # exactly one GPU's capacity, no float creep to two
    assert reserved_gpus(12.0001, 0.5) == 2


def test_sensitivity_hand_computed_swings() -> None:
    _, result = calculate(measured_basis_results(), WINDOW, Assumptions(**HAND))
    rows = {row.key: row for row in sensitivity(result, Basis.USAGE, 20)}
    month = DAYS_PER_MONTH
    assert (rows["requests_per_day"].savings_low, rows["requests_per_day"].savings_high) == (
        pytest.approx(28 * month), pytest.approx(42 * month))
    # utilisation 0.4 / 0.6: (40 - 31.25) h / u x $2.
    assert rows["gpu_utilisation"].savings_low == pytest.approx(8.75 / 0.4 * 2 * month)
    assert rows["gpu_utilisation"].savings_high == pytest.approx(8.75 / 0.6 * 2 * month)
    # factor 0.625 -> after 2.0 s -> $100; factor 0.9375 -> 3.0 s -> $150 (before $160).
    assert rows["time_factor"].savings_low == pytest.approx(60 * month)
    assert rows["time_factor"].savings_high == pytest.approx(10 * month)
    assert rows["incident_cost_usd"].swing == 0.0  # same before and after: moves both sides alike
    assert "implementation_cost_usd" not in rows
    ordered = sensitivity(result, Basis.USAGE, 20)
    assert ordered[0].key == "time_factor" and [r.swing for r in ordered] == sorted((r.swing for r in ordered), reverse=True)


def test_waterfall_and_projection_add_up() -> None:
    _, result = calculate(measured_basis_results(), WINDOW, Assumptions(**HAND))
    steps = waterfall(result, Basis.ALLOCATION)
    assert [s.label for s in steps] == ["Cost before", "GPU", "Tokens", "Failures", "Cost after"]
    assert steps[1].amount_usd == pytest.approx(-48 * DAYS_PER_MONTH)
    assert steps[0].amount_usd + sum(s.amount_usd for s in steps[1:4]) == pytest.approx(steps[4].amount_usd)
    points = projection(result, Basis.USAGE, months=12)
    assert points[0].after_usd == pytest.approx(1000.0) and points[0].before_usd == 0.0
    assert points[12].before_usd - points[12].after_usd == pytest.approx(35 * 365 - 1000)


def test_assumptions_provenance_defaults_and_files(tmp_path) -> None:
    defaults = Assumptions()
    assert (defaults.gpu_hourly_usd, defaults.gpu_utilisation, defaults.incident_cost_usd) == (0.91, 0.70, 400.0)
    assert defaults.provenance("gpu_hourly_usd") is Provenance.ASSUMED_DEFAULT
    form = Assumptions.from_changes({"gpu_hourly_usd": 0.91, "requests_per_day": 1234.0, "failure_rate": None})
    assert form.provenance("gpu_hourly_usd") is Provenance.ASSUMED_DEFAULT
    assert form.provenance("requests_per_day") is Provenance.USER_ENTERED
    path = tmp_path / "assumptions.json"
    path.write_text(form.to_json())
    assert json.loads(path.read_text()) == {"requests_per_day": 1234.0}
    reloaded = Assumptions.from_file(path)
    assert reloaded == form and reloaded.provenance("requests_per_day") is Provenance.USER_ENTERED
    path.write_text('{"gpu_utilisation": 1.5}')
    with pytest.raises(RoiError, match=r"gpu_utilisation: Input should be less than or equal to 1"):
        Assumptions.from_file(path)
    with pytest.raises(ValueError):
        Assumptions(gpu_hourly_usd=-1)


def test_csv_lists_every_input_with_provenance_and_every_output() -> None:
    summary, result = calculate(measured_basis_results(), WINDOW, Assumptions(requests_per_day=45_000))
    rows = list(csv.DictReader(io.StringIO(to_csv(result, summary))))
    inputs = {r["name"]: r for r in rows if r["section"] == "input"}
    assert set(inputs) == {row.key for row in result.inputs.rows()}
    assert inputs["requests_per_day"]["provenance_or_basis"] == "user-entered"
    assert inputs["gpu_hourly_usd"]["provenance_or_basis"] == "assumed-default"
    assert inputs["time_factor"]["provenance_or_basis"] == "measured"
    outputs = {(r["name"], r["provenance_or_basis"]): r["value"] for r in rows if r["section"] == "output"}
    assert float(outputs[("savings_per_month", "usage")]) == pytest.approx(result.usage.savings_per("month"), abs=0.005)
    assert math.isclose(float(outputs[("cost_before_per_year", "allocation")]),
                        result.allocation.before_per("year"), abs_tol=0.005)


def test_headlines_use_one_formatter() -> None:
    _, result = calculate(measured_basis_results(), WINDOW, Assumptions(**HAND))
    values = {h.label: h.value for h in headlines(result, Basis.USAGE)}
    assert values["Savings / month"] == usd(35 * DAYS_PER_MONTH) == "$1,065"
    assert values["Payback"] == "29 days"
    assert usd(12.345) == "$12.35" and usd(-1234.4) == "-$1,234"
