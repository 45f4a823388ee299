"""Throughput under load: a `prunewatch bench load` file read, priced, and used as the basis of GPU time per request."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import pytest

from prunewatch.roi import (
    Assumptions,
    Basis,
    LoadPoint,
    LoadProfile,
    LoadProfileError,
    Provenance,
    TimeBasis,
    calculate,
    sensitivity,
)
from prunewatch.roi.load_profile import UnmeasuredConcurrencyError, cost_per_mtok
from prunewatch.roi.tables import load_caption, load_rows, to_csv
from tests.roi.factories import WINDOW, load_result, load_row, measured_basis_results, write_load

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "bench" / "results" / "load-cpu.json"
# Round assumptions (all user-entered), as in test_costs: 45000 requests a day, $2 per GPU hour, 50% utilisation.
HAND = dict(requests_per_day=45_000, gpu_hourly_usd=2.0, gpu_utilisation=0.5, incident_cost_usd=1.0,
            input_usd_per_mtok=1.0, output_usd_per_mtok=4.0, implementation_cost_usd=1_000.0)
def test_a_results_file_is_read_with_where_it_came_from(tmp_path: Path) -> None:
    path = write_load(tmp_path)
    profile = LoadProfile.from_file(path)
    assert profile.concurrencies == (1, 2, 4)
    level = profile.at(4)
    assert (level.dense_tokens_per_s, level.pruned_tokens_per_s) == (50.0, 40.0)
    assert level.pruned_vs_dense == pytest.approx(0.8) and level.time_factor == pytest.approx(1.25)
    assert (profile.command, profile.created_at, profile.model) == (
        "prunewatch bench load --clients 1,2,4", "2026-12-01T10:00:00Z", "SmolLM2-135M-Instruct")
    assert profile.machine == "cpu: Test CPU 9000, 2 threads" and profile.time_noun == "CPU time"
    assert profile.source == (f"{path}: measured by `prunewatch bench load --clients 1,2,4` at 2026-12-01T10:00:00Z "
                              "on cpu: Test CPU 9000, 2 threads, model SmolLM2-135M-Instruct")


def test_the_committed_load_run_parses_and_agrees_with_its_own_ratios() -> None:
    data = json.loads(COMMITTED.read_text())
    profile = LoadProfile.from_file(COMMITTED)
    assert profile.concurrencies == tuple(data["levels"])
    for row, dense in zip(data["series"]["default"], data["series"]["dense"], strict=True):
        level = profile.at(row["clients"])
        assert level.dense_tokens_per_s == dense["aggregate_tokens_per_s"]
        assert level.pruned_tokens_per_s == row["aggregate_tokens_per_s"]
        assert round(level.pruned_vs_dense, 3) == row["default_vs_dense"]  # the bench's own ratio, same rounding
    assert profile.created_at == data["created_at"] and profile.command == data["command"]
    assert not profile.on_gpu and profile.model == data["model"]["name"]


def test_cost_per_million_output_tokens_is_the_hour_over_the_hours_tokens(tmp_path: Path) -> None:
    # $3.60 per hour / (tok/s x 3600 s) x 1e6 = 1000 / tok/s dollars per 1M tokens.
    assert cost_per_mtok(3.6, 20.0) == pytest.approx(50.0)
    assert cost_per_mtok(0.91, 42.298) == pytest.approx(0.91 / (42.298 * 3600) * 1e6)
    rows = LoadProfile.from_file(write_load(tmp_path)).cost_rows(3.6)
    assert [(r.level.clients, r.dense_usd_per_mtok, r.pruned_usd_per_mtok) for r in rows] == [
        (1, pytest.approx(50.0), pytest.approx(40.0)), (2, pytest.approx(1000 / 36), pytest.approx(1000 / 36)),
        (4, pytest.approx(20.0), pytest.approx(25.0))]
    assert [r.pays for r in rows] == [True, False, False]
    with pytest.raises(LoadProfileError, match="must be positive"):
        cost_per_mtok(1.0, 0.0)


def test_the_cost_table_says_where_pruning_stops_paying_and_how_it_was_obtained(tmp_path: Path) -> None:
    _, result = calculate(measured_basis_results(), WINDOW, Assumptions(gpu_hourly_usd=3.6),
                          load=LoadPoint.choose(LoadProfile.from_file(write_load(tmp_path)), 4))
    hourly = result.inputs.gpu_hourly_usd
    rows = load_rows(result.inputs.load, hourly)
    assert [row["Concurrent clients"] for row in rows] == ["1", "2", "4 (deployment)"]
    assert rows[0] == {"Concurrent clients": "1", "Dense tokens/s": "20.0", "Pruned tokens/s": "25.0",
                       "Pruned / dense": "1.25x", "Dense $/1M output tokens": "$50.00",
                       "Pruned $/1M output tokens": "$40.00", "Pruning": "saves 20%"}
    assert (rows[1]["Pruning"], rows[2]["Pruning"]) == ("no change", "costs 25% more")
    assert (rows[2]["Dense $/1M output tokens"], rows[2]["Pruned $/1M output tokens"]) == ("$20.00", "$25.00")
    caption = load_caption(result.inputs.load, hourly)
    assert "Tokens/s measured (" in caption and "at $3.60 per GPU hour (user-entered)" in caption
    assert caption.endswith("The deployment's concurrency, 4 concurrent clients, is user-entered.")


def test_under_load_gpu_time_is_output_tokens_over_aggregate_throughput(tmp_path: Path) -> None:
    """50 output tokens per request: 50 / 50 tok/s = 1.0 s dense, 50 / 40 = 1.25 s pruned at 4 clients."""
    profile = LoadProfile.from_file(write_load(tmp_path))
    summary, result = calculate(measured_basis_results(), WINDOW, Assumptions(**HAND),
                                load=LoadPoint.choose(profile, 4))
    inputs, times = result.inputs, result.gpu_time
    assert inputs.time_basis is TimeBasis.UNDER_LOAD
    assert (times.before_s, times.after_s) == (pytest.approx(1.0), pytest.approx(1.25))
    assert times.before_provenance is Provenance.MEASURED_UNDER_LOAD is times.after_provenance
    assert inputs.factor == pytest.approx(50.0 / 40.0) == times.factor  # dense_agg / default_agg
    assert times.label("probe label") == ("CPU time per request under load (4 concurrent clients, measured on "
                                          "cpu: Test CPU 9000, 2 threads)")
    # Usage: 45000 x 1.0 s = 12.5 busy h -> 25 billed h at 50% -> $50; after 15.625 h -> 31.25 h -> $62.50.
    assert result.usage.before.gpu_usd == pytest.approx(50.0) and result.usage.after.gpu_usd == pytest.approx(62.5)
    assert result.usage.savings_per_day == pytest.approx(-12.5)
    # Allocation: ceil(12.5 / 12) = 2 GPUs before and ceil(15.625 / 12) = 2 after: no saving, no loss.
    assert (result.allocation.gpus_before, result.allocation.gpus_after) == (2, 2)
    assert result.payback(Basis.USAGE).days is None
    basis = inputs.describe_basis()
    assert basis.startswith("Measured under load: at 4 concurrent clients (user-entered) the pruned configuration "
                            "streams 40.0 aggregate output tokens/s against dense's 50.0, so pruned/dense aggregate "
                            "throughput is 0.80x and pruning does not pay at this load")
    assert "after = before × 1.250" in basis and profile.source in basis
    rows = {row.key: row for row in inputs.rows()}
    assert rows["concurrency"].value == 4 and rows["concurrency"].provenance is Provenance.USER_ENTERED
    assert rows["dense_tokens_per_s"].provenance is Provenance.MEASURED and profile.source in rows["dense_tokens_per_s"].note
    assert rows["pruned_tokens_per_s"].value == 40.0
    assert "time_factor" not in rows and "dense_inference_s" not in rows  # the probes' single-stream times are unused
    # Tokens, failures and quality still come from the probes, unchanged by the load run.
    plain_summary, plain = calculate(measured_basis_results(), WINDOW, Assumptions(**HAND))
    assert summary == plain_summary
    assert result.usage.before.token_usd == plain.usage.before.token_usd
    assert result.usage.before.failure_usd == plain.usage.before.failure_usd


def test_at_one_client_pruning_pays_and_the_numbers_follow(tmp_path: Path) -> None:
    load = LoadPoint.choose(LoadProfile.from_file(write_load(tmp_path)), 1, Provenance.ASSUMED_DEFAULT)
    _, result = calculate(measured_basis_results(), WINDOW, Assumptions(**HAND), load=load)
    # 50 / 20 = 2.5 s and 50 / 25 = 2.0 s: 31.25 and 25 busy h -> 62.5 and 50 billed h -> $125 and $100 a day.
    assert (result.gpu_time.before_s, result.gpu_time.after_s) == (pytest.approx(2.5), pytest.approx(2.0))
    assert result.usage.savings_per_day == pytest.approx(25.0)
    assert "(assumed-default)" in result.inputs.describe_basis() and "pruning pays at this load" in result.inputs.describe_basis()


def test_an_entered_time_under_load_scales_by_the_loads_ratio(tmp_path: Path) -> None:
    load = LoadPoint.choose(LoadProfile.from_file(write_load(tmp_path)), 4)
    _, result = calculate(measured_basis_results(), WINDOW, Assumptions(**HAND, dense_inference_s=2.0), load=load)
    times = result.gpu_time
    assert (times.before_s, times.after_s) == (pytest.approx(2.0), pytest.approx(2.5))
    assert (times.before_provenance, times.after_provenance) == (Provenance.USER_ENTERED, Provenance.ESTIMATED)
    assert times.label("probe label") == "GPU time per request (user-entered)"
    assert "time per request before pruning = the entered time per request" in result.inputs.describe_basis()


def test_sensitivity_moves_each_measured_throughput_and_not_the_concurrency(tmp_path: Path) -> None:
    load = LoadPoint.choose(LoadProfile.from_file(write_load(tmp_path)), 4)
    _, result = calculate(measured_basis_results(), WINDOW, Assumptions(**HAND), load=load)
    rows = {row.key: row for row in sensitivity(result, Basis.USAGE, 20)}
    assert "concurrency" not in rows
    month = 365 / 12
    # Pruned tokens/s 32 or 48: after 50/32 or 50/48 s per request; before stays 1.0 s ($50 a day).
    for value, savings in ((rows["pruned_tokens_per_s"].low_value, rows["pruned_tokens_per_s"].savings_low),
                           (rows["pruned_tokens_per_s"].high_value, rows["pruned_tokens_per_s"].savings_high)):
        after_usd = 45_000 * 50 / value / 3600 / 0.5 * 2.0
        assert savings == pytest.approx((50.0 - after_usd) * month)
    assert rows["dense_tokens_per_s"].swing > 0


def test_the_csv_carries_the_load_inputs_and_the_cost_per_million_tokens(tmp_path: Path) -> None:
    load = LoadPoint.choose(LoadProfile.from_file(write_load(tmp_path)), 4)
    summary, result = calculate(measured_basis_results(), WINDOW, Assumptions(gpu_hourly_usd=3.6), load=load)
    rows = list(csv.DictReader(io.StringIO(to_csv(result, summary))))
    inputs = {r["name"]: r for r in rows if r["section"] == "input"}
    assert inputs["concurrency"]["value"] == "4.0" and inputs["pruned_tokens_per_s"]["provenance_or_basis"] == "measured"
    priced = {r["name"]: float(r["value"]) for r in rows if r["section"] == "load"}
    assert priced["dense_usd_per_mtok_at_4_clients"] == pytest.approx(20.0)
    assert priced["pruned_usd_per_mtok_at_1_clients"] == pytest.approx(40.0)
    outputs = {r["name"]: r for r in rows if r["section"] == "output"}
    assert outputs["gpu_s_per_request_after"]["provenance_or_basis"] == "measured-under-load"


def test_without_a_load_run_the_basis_is_the_probes_as_before() -> None:
    _, result = calculate(measured_basis_results(), WINDOW, Assumptions(**HAND), load=None)
    assert result.inputs.time_basis is TimeBasis.MEASURED and result.inputs.load is None
    assert (result.gpu_time.before_s, result.gpu_time.after_s) == (pytest.approx(3.2), pytest.approx(2.5))
    assert not {"concurrency", "dense_tokens_per_s", "pruned_tokens_per_s"} & {r.key for r in result.inputs.rows()}


@pytest.mark.parametrize("content, message", [
    ("{not json", r"load results file .*load.json is not JSON: Expecting property name enclosed in double quotes "
                  r"at line 1$"),
    ([1, 2], r"load results file .*load.json must hold a JSON object \(a `prunewatch bench load` result\)$"),
    ({"levels": [1]}, r"load results file .*load.json has no series; is it a `prunewatch bench load` result\?$"),
    (load_result(pruned={}), r"load results file .*load.json has no default series \(it holds: default, dense\); "
                             r"the ROI needs both, measured in the same run$"),
    ({**load_result(), "series": {"llama.cpp F32": [load_row(1, 50.0)]}},
     r"has no dense and no default series \(it holds: llama.cpp F32\)"),
    (load_result(pruned={1: 25.0, 2: 0.0, 4: 40.0}),
     r"load results file .*load.json: default at 2 clients has aggregate_tokens_per_s 0.0; a throughput must be "
     r"positive to price a token$"),
    (load_result(dense={1: 20.0, 2: None, 4: 50.0}), r"dense at 2 clients has aggregate_tokens_per_s None"),
    (load_result(dense={1: -3.0, 2: 36.0, 4: 50.0}), r"dense at 1 clients has aggregate_tokens_per_s -3.0"),
    (load_result(pruned={1: 25.0, 2: 36.0}), r"measured dense at 1, 2, 4 clients but default at 1, 2; the ROI "
                                              r"compares them at the same concurrency$"),
])
def test_a_bad_results_file_is_one_clear_line(tmp_path: Path, content: Any, message: str) -> None:
    path = tmp_path / "load.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(LoadProfileError, match=message) as caught:
        LoadProfile.from_file(path)
    assert "\n" not in str(caught.value)


def test_a_missing_file_and_an_unmeasured_concurrency_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(LoadProfileError) as caught:
        LoadProfile.from_file(tmp_path / "absent.json")
    assert str(caught.value) == (f"no load results file at {tmp_path / 'absent.json'}; run `prunewatch bench load` to "
                                 "write one")
    path = write_load(tmp_path)
    profile = LoadProfile.from_file(path)
    with pytest.raises(UnmeasuredConcurrencyError) as unmeasured:
        LoadPoint.choose(profile, 3)
    assert str(unmeasured.value) == (f"concurrency 3 was not measured in {path}; measured levels: 1, 2, 4 (or measure "
                                     "it: prunewatch bench load --clients 3)")
    assert isinstance(unmeasured.value, LoadProfileError)


def test_the_readme_under_load_table_is_the_committed_run_at_the_placeholder_price() -> None:
    """The README's 'ROI under load' rows, re-rendered from the committed run at the assumed $0.91 per GPU hour."""
    from prunewatch.records.prices import PLACEHOLDER_GPU_USD_PER_HOUR

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert PLACEHOLDER_GPU_USD_PER_HOUR == 0.91 and "placeholder $0.91\nper GPU hour (assumed" in readme
    for row in LoadProfile.from_file(COMMITTED).cost_rows(PLACEHOLDER_GPU_USD_PER_HOUR):
        level = row.level
        line = (f"| {level.clients} | {level.dense_tokens_per_s:.1f} | {level.pruned_tokens_per_s:.1f} | "
                f"{level.pruned_vs_dense:.2f}x | ${row.dense_usd_per_mtok:.2f} | ${row.pruned_usd_per_mtok:.2f} |")
        assert line in readme, line
    assert f"before × {LoadProfile.from_file(COMMITTED).at(4).time_factor:.3f}" in readme
