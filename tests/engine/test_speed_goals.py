"""prunewatch/bench/speed_goals.py: the decode-speed goals checked from a result's own figures, run by run and
estimator by estimator, on constructed results whose verdicts are known."""

from __future__ import annotations

import json

import pytest

from prunewatch.bench.speed import main
from prunewatch.bench.speed_goals import (
    GOALS,
    REAL_WEIGHTS,
    bandwidth_goal,
    check_goals,
    format_goals,
    goals_summary,
    verdict,
)

REAL, SHAPE = "SmolLM2-135M-Instruct", "llama-0.67B-random"


def _row(model: str, run: str, **figures) -> dict:
    return {"model": model, "run": run, **figures}


def _result(real_dense_within: float = 1.01, shape_paired: float = 0.8) -> dict:
    """A result with every figure the goals read; the defaults meet some goals and miss others."""
    real = {"weights": REAL_WEIGHTS}
    shape = {"weights": "random (seed 0)"}
    rows = [
        _row(REAL, "plain", speedup_vs_plain=1.0, speedup_vs_plain_paired=1.0, fraction_of_bandwidth=0.40,
             fraction_of_paired_bandwidth=0.48),
        _row(REAL, "dense", speedup_vs_plain=0.96, speedup_vs_plain_paired=real_dense_within,
             fraction_of_bandwidth=0.36, fraction_of_paired_bandwidth=0.51),
        _row(REAL, "pruned", speedup_vs_plain=1.09, speedup_vs_plain_paired=1.12, fraction_of_bandwidth=0.30,
             fraction_of_paired_bandwidth=0.40, fraction_of_bound=0.84, fraction_of_bound_paired=0.83),
        _row(REAL, "dense-compiled", speedup_vs_plain=1.23, speedup_vs_plain_paired=1.31,
             fraction_of_bandwidth=0.46, fraction_of_paired_bandwidth=0.64),
        _row(REAL, "pruned-compiled", speedup_vs_plain=1.51, speedup_vs_plain_paired=1.39,
             fraction_of_bandwidth=0.43, fraction_of_paired_bandwidth=0.52, fraction_of_bound=0.92,
             fraction_of_bound_paired=0.83),
        _row(REAL, "served-dense", speedup_vs_plain=0.93, fraction_of_bandwidth=0.35, served_vs_in_process=0.97,
             served_vs_in_process_paired=0.99),
        _row(REAL, "served-pruned", speedup_vs_plain=1.01, fraction_of_bandwidth=0.28, served_vs_in_process=0.93,
             served_vs_in_process_paired=0.96),
    ]
    for run in ("plain", "dense", "pruned", "dense-compiled", "pruned-compiled"):
        rows.append(_row(SHAPE, run, speedup_vs_plain=1.0, fraction_of_bandwidth=0.75,
                         fraction_of_paired_bandwidth=shape_paired, fraction_of_bound=0.95,
                         fraction_of_bound_paired=0.97))
    return {"models": {REAL: real, SHAPE: shape}, "rows": rows}


def test_each_goal_reads_its_runs_of_its_model_under_each_estimator():
    checks = check_goals(_result())
    by_goal = {goal.key: [c for c in checks if c.goal == goal.key] for goal in GOALS}
    dense_vs_plain = by_goal["dense_vs_plain"]
    assert {(c.model, c.run, c.field) for c in dense_vs_plain} == {
        (REAL, run, field) for run in ("dense", "dense-compiled")
        for field in ("speedup_vs_plain", "speedup_vs_plain_paired")}
    # plain transformers is the baseline, never a run a goal holds the engine to
    assert all(c.run != "plain" for c in checks)
    assert {c.model for c in by_goal["shape_bandwidth"]} == {SHAPE}
    assert {c.model for c in by_goal["real_model_bandwidth"]} == {REAL}
    assert len(by_goal["real_model_bandwidth"]) == len(by_goal["shape_bandwidth"]) == 4 * 2
    assert {(c.run, c.field) for c in by_goal["default_vs_bound"]} == {
        (run, field) for run in ("pruned", "pruned-compiled") for field in ("fraction_of_bound", "fraction_of_bound_paired")}
    assert {(c.model, c.run, c.field) for c in by_goal["served_vs_in_process"]} == {
        (REAL, run, field) for run in ("served-dense", "served-pruned")
        for field in ("served_vs_in_process", "served_vs_in_process_paired")}
    met = {(c.goal, c.run, c.field): c.met for c in checks}
    assert met[("served_vs_in_process", "served-pruned", "served_vs_in_process")] is False  # 0.93 < 0.95
    assert met[("dense_vs_plain", "dense", "speedup_vs_plain")] is False  # 0.96 < 0.98
    assert met[("dense_vs_plain", "dense", "speedup_vs_plain_paired")] is True  # 1.01
    assert met[("real_model_bandwidth", "pruned", "fraction_of_paired_bandwidth")] is False  # 0.40 < 0.50
    assert met[("default_vs_bound", "pruned-compiled", "fraction_of_bound")] is True  # 0.92 >= 0.9


def test_verdicts_say_whether_every_some_or_no_check_met_the_goal():
    summary = {entry["goal"]: entry for entry in goals_summary(_result())}
    assert summary["dense_vs_plain"]["verdict"] == "partly met"
    assert summary["shape_bandwidth"]["verdict"] == "met"  # 75% and 80% against 70%
    assert summary["default_vs_bound"]["verdict"] == "partly met"
    assert summary["served_vs_in_process"]["verdict"] == "partly met"
    missed = {entry["goal"]: entry for entry in goals_summary(_result(shape_paired=0.5))}
    assert missed["shape_bandwidth"]["verdict"] == "partly met"  # 75% against the best sample still meets it
    everything_met = _result(real_dense_within=1.2)
    for row in everything_met["rows"]:
        for key in ("speedup_vs_plain", "fraction_of_bandwidth", "fraction_of_paired_bandwidth",
                    "fraction_of_bound", "fraction_of_bound_paired", "served_vs_in_process",
                    "served_vs_in_process_paired"):
            row[key] = 2.0
    assert {entry["verdict"] for entry in goals_summary(everything_met)} == {"met"}
    nothing_met = _result(real_dense_within=0.5)
    for row in nothing_met["rows"]:
        for key in list(row):
            if key not in ("model", "run"):
                row[key] = 0.1
    assert {entry["verdict"] for entry in goals_summary(nothing_met)} == {"not met"}


def test_a_result_without_a_figure_is_not_measured_rather_than_met():
    result = _result()
    for row in result["rows"]:
        row.pop("fraction_of_bound_paired", None)
        row.pop("fraction_of_bound", None)
    (entry,) = [e for e in goals_summary(result) if e["goal"] == "default_vs_bound"]
    assert entry["verdict"] == "not measured" and all(c["met"] is None for c in entry["checks"])
    assert verdict([]) == "not measured"
    # a result with only the shape has no real-model checks at all
    shape_only = {"models": {SHAPE: {"weights": "random"}}, "rows": [r for r in _result()["rows"] if r["model"] == SHAPE]}
    verdicts = {e["goal"]: e["verdict"] for e in goals_summary(shape_only)}
    assert verdicts["dense_vs_plain"] == "not measured" and verdicts["shape_bandwidth"] == "met"


def test_the_text_names_each_figure_with_its_estimator():
    text = format_goals(_result())
    assert "PARTLY MET  engine dense decode >= 0.98x plain transformers (real model)" in text
    assert f"{REAL} dense: 0.960 below (ratio of medians), 1.010 ok (within rounds)" in text
    assert f"{REAL} pruned: 30.0% below (median round vs best sample), 40.0% below (paired with each round)" in text


def test_report_prints_a_stored_result_and_refuses_what_is_not_one(tmp_path, capsys):
    path = tmp_path / "speed.json"
    result = _result()
    for row in result["rows"]:  # what format_table needs besides the goals' figures
        row.update(tokens_per_s=10.0, tokens_per_s_min=9.0, tokens_per_s_max=11.0, bytes_per_token=5_000_000)
    result.update(bandwidth_gb_s=18.0, bandwidth_gb_s_median=14.0, bandwidth_reps=[14.0, 18.0])
    result["machine"] = {"processor": "x86_64", "torch_threads": 1}
    path.write_text(json.dumps(result))
    assert main(["--report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "read bandwidth 18.0 GB/s" in out and "PARTLY MET" in out and f"{SHAPE} pruned-compiled" in out
    assert not list(tmp_path.glob("*.png"))  # a report draws nothing unless asked
    assert main(["--report", str(path), "--plot", str(tmp_path / "again.png")]) == 0
    assert (tmp_path / "again.png").stat().st_size > 0
    del result["machine"]  # the table and goals need no machine facts, the plot's title does
    path.write_text(json.dumps(result))
    with pytest.raises(SystemExit) as stop:
        main(["--report", str(path), "--plot", str(tmp_path / "no-machine.png")])
    assert stop.value.code == 2 and "KeyError" in capsys.readouterr().err
    for bad in ("[1]", "{not json", json.dumps({"rows": [{"model": REAL}]})):
        path.write_text(bad)
        with pytest.raises(SystemExit) as stop:
            main(["--report", str(path)])
        assert stop.value.code == 2
        assert "not a readable `bench speed` result" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        main(["--report", str(tmp_path / "missing.json")])
    assert stop.value.code == 2


def test_each_model_is_held_to_its_own_share_of_the_bandwidth():
    result = _result()
    assert bandwidth_goal(result, REAL) == 0.50
    assert bandwidth_goal(result, SHAPE) == 0.70
