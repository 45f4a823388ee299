"""prunewatch/bench/speed.py end to end on the bundled probe model and a tiny random shape: structure and internal
consistency of what it writes, never timings (the machine running the tests is shared and noisy)."""

from __future__ import annotations

import itertools
import json

import pytest

from prunewatch.bench.engine import SpeedModelConfig
from prunewatch.bench.speed import (
    format_projection_markdown,
    format_projection_table,
    format_table,
    main,
    paired_ratio,
    run,
    write_plot,
)

TINY = SpeedModelConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=4096)


def stored(*values: float, digits: int = 3) -> float:
    """The relative error a ratio of `values` (each stored rounded to `digits` decimals, the stored ratio among
    them) may carry: small rates on a loaded host make it larger than any fixed tolerance."""
    half = 0.5 * 10 ** -digits
    return sum(half / abs(v) for v in values if v) + 1e-4


@pytest.fixture(scope="module")
def speed_result(tmp_path_factory, probe_model_dir, calibration_dir):
    out = tmp_path_factory.mktemp("speed")
    data = run(probe_model_dir, TINY, new_tokens=4, rounds=1, bandwidth_mib=16, bandwidth_reps=2,
               calibration_dir=calibration_dir, out=out / "speed.json", plot=out / "speed.png")
    return data, out


def test_speed_bench_writes_every_model_and_run(speed_result):
    data, out = speed_result
    assert json.loads((out / "speed.json").read_text()) == data
    assert (out / "speed.png").stat().st_size > 0
    assert data["bandwidth_gb_s"] == max(data["bandwidth_reps"]) > 0
    assert len(data["models"]) == 2 and data["models_pending"] == 0
    runs = {(row["model"], row["run"]) for row in data["rows"]}
    assert data["settings"]["compiled"] is True and data["settings"]["served"] is True
    in_process = ("plain", "dense", "pruned", "dense-compiled", "pruned-compiled")
    served = ("served-dense", "served-pruned")  # a model folder `prunewatch serve` loads: the real model, not the shape
    assert runs == {(model, run) for model in data["models"] for run in in_process} | {
        ("probe-llama", run) for run in served}
    table = format_table(data)
    assert all(model in table for model in data["models"])


def test_speed_bench_figures_are_consistent(speed_result):
    data, _ = speed_result
    for model in data["models"]:
        rows = {row["run"]: row for row in data["rows"] if row["model"] == model}
        plain, dense, pruned = rows["plain"], rows["dense"], rows["pruned"]
        assert plain["speedup_vs_plain"] == 1.0
        for row in rows.values():
            assert row["tokens_per_s_min"] <= row["tokens_per_s"] <= row["tokens_per_s_max"]
            assert len(row["rounds"]) == 1 and row["bytes_per_token"] > 0
            assert row["fraction_of_bandwidth"] == pytest.approx(
                row["bytes_per_token"] * row["tokens_per_s"] / 1e9 / data["bandwidth_gb_s"], rel=1e-2, abs=1e-4)
        assert plain["bytes_per_token"] == dense["bytes_per_token"] >= pruned["bytes_per_token"]
        for row in rows.values():  # each round against the bandwidth measured right beside it
            (gb_s,) = row["rounds_bandwidth_gb_s"]
            assert row["fraction_of_paired_bandwidth"] == pytest.approx(
                row["bytes_per_token"] * row["rounds"][0] / 1e9 / gb_s, rel=1e-2, abs=1e-4)
        # The compiled step counts the same work as the eager one (the bench refuses to write otherwise).
        assert rows["dense-compiled"]["bytes_per_token"] == dense["bytes_per_token"]
        assert rows["pruned-compiled"]["bytes_per_token"] == pytest.approx(pruned["bytes_per_token"], rel=5e-3)
        assert rows["pruned-compiled"]["bound"] == pytest.approx(pruned["bound"], rel=5e-3)
        assert rows["dense-compiled"]["agreement_with_eager"] == rows["pruned-compiled"]["agreement_with_eager"] == 1.0
        assert dense["agreement_with_eager"] is None
        assert rows["pruned-compiled"]["speedup_vs_dense"] == pytest.approx(
            rows["pruned-compiled"]["tokens_per_s"] / rows["dense-compiled"]["tokens_per_s"],
            rel=stored(rows["pruned-compiled"]["tokens_per_s"], rows["dense-compiled"]["tokens_per_s"])
            + stored(rows["pruned-compiled"]["speedup_vs_dense"], digits=4))
        # The default operating point ran sparse on the probe model's prompt: s and f measured, bound from them.
        s, f = pruned["decode_sparsity"], pruned["pruneable_share"]
        assert 0.0 <= s < 1.0 and 0.0 <= f <= 1.0
        assert pruned["bound"] == pytest.approx(1.0 / (1.0 - s * f), abs=1e-3)
        assert pruned["fraction_of_bound"] == pytest.approx(pruned["speedup_vs_dense"] / pruned["bound"], rel=stored(
            pruned["speedup_vs_dense"], pruned["bound"], pruned["fraction_of_bound"], digits=4))
        if pruned["fallback"] is None and s > 0:
            assert pruned["bytes_per_token"] < dense["bytes_per_token"]
        # The within-round speedups: from the stored rounds, against the run of the same round.
        for name, row in rows.items():
            assert row["speedup_vs_plain_paired"] == pytest.approx(row["rounds"][0] / plain["rounds"][0], rel=(
                stored(row["rounds"][0], plain["rounds"][0]) + stored(row["speedup_vs_plain_paired"], digits=4)))
            if name.removeprefix("served-").startswith("pruned"):
                baseline = rows[name.replace("pruned", "dense")]
                assert row["speedup_vs_dense_paired"] == pytest.approx(
                    row["rounds"][0] / baseline["rounds"][0], rel=(stored(row["rounds"][0], baseline["rounds"][0])
                                                                   + stored(row["speedup_vs_dense_paired"], digits=4)))
                assert row["fraction_of_bound_paired"] == pytest.approx(
                    row["speedup_vs_dense_paired"] / row["bound"], rel=stored(
                        row["speedup_vs_dense_paired"], row["bound"], row["fraction_of_bound_paired"], digits=4))
            else:
                assert row["speedup_vs_dense_paired"] is None and row["fraction_of_bound_paired"] is None
        # Where the step's time goes: products replayed alone right after each round's run, the rest from
        # that round's step (one round here, so each median is the round's own figure).
        for name, row in rows.items():
            (replayed,) = row["rounds_products_ms"]
            assert row["products_ms_per_token"] == replayed > 0
            step_ms = 1e3 / row["rounds"][0]  # rates are stored to 3 decimals: the step's ms to about this
            assert row["rest_ms_per_token"] == pytest.approx(step_ms - replayed,
                                                             abs=2e-3 + step_ms * 1e-3 / row["rounds"][0])
            if name.removeprefix("served-").startswith("pruned"):
                baseline = rows[name.replace("pruned", "dense")]
                expected = baseline["rounds_products_ms"][0] / replayed
                assert row["products_speedup_vs_dense"] == pytest.approx(expected, rel=stored(
                    baseline["rounds_products_ms"][0], replayed) + stored(row["products_speedup_vs_dense"], digits=4))
                assert row["products_fraction_of_bound"] == pytest.approx(
                    row["products_speedup_vs_dense"] / row["bound"], rel=stored(
                        row["products_speedup_vs_dense"], row["bound"], row["products_fraction_of_bound"], digits=4))
            else:
                assert row["products_speedup_vs_dense"] is None and row["products_fraction_of_bound"] is None


def test_served_runs_stand_beside_the_in_process_runs_of_their_plan(speed_result):
    """`prunewatch serve` of the same folder, dense and default: each served row reads what the in-process run of
    its plan reads, and its ratio to it is stored, as the ratio of medians and within the round."""
    data, _ = speed_result
    rows = {row["run"]: row for row in data["rows"] if row["model"] == "probe-llama"}
    for name, counterpart in (("served-dense", "dense"), ("served-pruned", "pruned")):
        row, base = rows[name], rows[counterpart]
        assert row["bytes_per_token"] == base["bytes_per_token"] and row["tokens_per_s"] > 0
        assert row["served_vs_in_process"] == pytest.approx(row["tokens_per_s"] / base["tokens_per_s"], rel=stored(
            row["tokens_per_s"], base["tokens_per_s"]) + stored(row["served_vs_in_process"], digits=4))
        assert row["served_vs_in_process_paired"] == pytest.approx(row["rounds"][0] / base["rounds"][0], rel=stored(
            row["rounds"][0], base["rounds"][0]) + stored(row["served_vs_in_process_paired"], digits=4))
        assert base["served_vs_in_process"] is None and base["served_vs_in_process_paired"] is None
    assert rows["served-dense"]["decode_pruning_ratio"] is None  # dense: no plan, as the in-process dense row
    assert rows["served-pruned"]["decode_pruning_ratio"] > 0  # the server's default plan skipped work
    # The table shows the ratio in its "vs in-proc" columns, for the served rows only.
    header, _, *lines = format_table(data).splitlines()[1:]
    assert "vs in-proc" in header
    for line in lines:
        fields = line.split()
        assert (fields[10] != "-") == fields[1].startswith("served-")


def test_paired_ratio_cancels_what_slowed_a_whole_round():
    """Round 2 ran at half speed for both runs: the within-round ratio still sees the run 10% faster in two of
    three rounds, where the ratio of the medians (9 / 10) would call it 10% slower."""
    plain, run_ = [10.0, 5.0, 10.0], [11.0, 5.5, 9.0]
    assert paired_ratio(run_, plain) == pytest.approx(1.1)
    assert paired_ratio(plain, plain) == 1.0
    with pytest.raises(ValueError, match="one baseline per round"):
        paired_ratio(run_, plain[:2])
    with pytest.raises(ValueError):
        paired_ratio([], [])


def test_a_result_without_within_round_speedups_shows_none(speed_result):
    data, _ = speed_result
    older = json.loads(json.dumps(data))  # as results written before the within-round speedups read back
    for row in older["rows"]:
        del row["speedup_vs_plain_paired"], row["speedup_vs_dense_paired"], row["fraction_of_bound_paired"]
    for line in format_table(older).splitlines()[3:]:
        fields = line.split()
        assert fields[9] == "-" and fields[-5] == "-"  # vs plain's and of bound's within-round columns


def test_a_result_without_the_step_breakdown_shows_none(speed_result):
    data, _ = speed_result
    older = json.loads(json.dumps(data))  # as results written before the products were replayed
    for row in older["rows"]:
        for key in ("products_ms_per_token", "rounds_products_ms", "rest_ms_per_token", "products_speedup_vs_dense",
                    "products_fraction_of_bound"):
            del row[key]
    for line, now in zip(format_table(older).splitlines()[3:], format_table(data).splitlines()[3:], strict=True):
        assert line.split()[-3:] == ["-", "-", "-"]
        assert now.split()[-3] != "-" and now.split()[-2] != "-"  # products and rest, for every run


def test_every_run_breaks_its_products_down_by_projection(speed_result):
    data, _ = speed_result
    for row in data["rows"]:
        by_projection = row["products_ms_by_projection"]
        assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"} == set(
            by_projection)
        assert all(ms > 0 for ms in by_projection.values())
        if row["run"].endswith("pruned") or row["run"].endswith("pruned-compiled"):
            dense = next(r for r in data["rows"] if r["model"] == row["model"]
                         and r["run"] == row["run"].replace("pruned", "dense"))
            for projection, speedup in row["products_speedup_by_projection"].items():  # one round: one ratio
                expected = dense["products_ms_by_projection"][projection] / by_projection[projection]
                assert speedup == pytest.approx(expected, rel=stored(
                    dense["products_ms_by_projection"][projection], by_projection[projection], digits=4) + stored(speedup, digits=4))
        else:
            assert row["products_speedup_by_projection"] is None
    table = format_projection_table(data)
    assert all(model[:28] in table for model in data["models"]) and "q_proj" in table and "x)" in table
    older = json.loads(json.dumps(data))
    for row in older["rows"]:
        del row["products_ms_by_projection"], row["products_speedup_by_projection"]
    assert format_projection_table(older) == "" and format_projection_markdown(older) == ""
    markdown = format_projection_markdown(data).splitlines()
    assert markdown[0].startswith("| projection | q_proj") and len(markdown) == 6  # dense, default, speedup, plain


def test_speed_bench_pairs_every_run_with_the_samples_beside_it(speed_result):
    data, _ = speed_result
    runs = {model: sum(row["model"] == model for row in data["rows"]) for model in data["models"]}
    # Two samples before the decodes, then per model and round one before each run and one after the last.
    samples = data["bandwidth_reps"]
    assert len(samples) == 2 + sum(n + 1 for n in runs.values())
    start = 2
    for model, runs_per_model in runs.items():
        beside = samples[start:][:runs_per_model + 1]
        start += runs_per_model + 1
        rows = [row for row in data["rows"] if row["model"] == model]  # one round: run order = row order
        assert [row["rounds_bandwidth_gb_s"][0] for row in rows] == pytest.approx(
            [(a + b) / 2 for a, b in itertools.pairwise(beside)], abs=2e-3)


def test_a_result_without_paired_samples_shows_no_paired_figure(speed_result, tmp_path):
    data, _ = speed_result
    older = json.loads(json.dumps(data))  # as results written before the paired share read back
    for row in older["rows"]:
        del row["fraction_of_paired_bandwidth"], row["rounds_bandwidth_gb_s"]
    now, before = format_table(data).splitlines()[3:], format_table(older).splitlines()[3:]
    for line, old_line in zip(now, before, strict=True):  # median, best, paired shares; then no paired one
        assert line.count("%") == 3 and old_line.count("%") == 2
        assert old_line.split()[:9] == line.split()[:7] + ["-"] + line.split()[8:9]
    write_plot(older, tmp_path / "older.png")
    assert (tmp_path / "older.png").stat().st_size > 0


@pytest.mark.parametrize(("argv", "message"), [
    (["--no-real", "--no-shape"], "nothing to measure"),
    (["--no-real", "--shape", "{not json"], "--shape: Expecting property name"),
    (["--no-real", "--shape", '{"hidden_size": 8}'], "--shape: 1 validation error"),
    (["--no-real", "--shape", '{"layers": 2}'], "--shape: 1 validation error"),
    (["--no-real", "--shape", "[2]"], "--shape: "),
    (["--no-real", "--bandwidth-mib", "0"], "--bandwidth-mib"),
    (["--no-real", "--threads", "0"], "--threads"),
    (["--no-real", "--tokens", "2"], "--tokens must be >= 3"),
])
def test_bad_arguments_are_refused_before_anything_runs(argv, message, capsys, tmp_path):
    """Each is a usage error (exit 2, one line naming the option), raised before the bandwidth read or a model
    load, so nothing is written."""
    out = tmp_path / "speed.json"
    with pytest.raises(SystemExit) as raised:
        main([*argv, "--out", str(out), "--no-plot"])
    assert raised.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_a_run_that_fails_in_its_second_model_keeps_the_first(probe_model_dir, calibration_dir, tmp_path, monkeypatch):
    """The JSON is written after each model: the failure of the second loses nothing measured before it."""
    def broken_shape(*args, **kwargs):
        raise RuntimeError("the shape could not be built")

    monkeypatch.setattr("prunewatch.bench.speed._load_shape", broken_shape)
    out = tmp_path / "speed.json"
    with pytest.raises(RuntimeError, match="could not be built"):
        run(probe_model_dir, TINY, new_tokens=4, rounds=1, bandwidth_mib=16, bandwidth_reps=2,
            calibration_dir=calibration_dir, out=out, plot=None, compiled=False, served=False)
    kept = json.loads(out.read_text())
    assert kept["models_pending"] == 1 and list(kept["models"]) == ["probe-llama"]
    assert {row["run"] for row in kept["rows"]} == {"plain", "dense", "pruned"}
    assert all(row["fraction_of_bandwidth"] > 0 for row in kept["rows"])
    with pytest.raises(ValueError, match="nothing to measure"):
        run(None, None, new_tokens=4, rounds=1, bandwidth_mib=16, bandwidth_reps=2, calibration_dir=None,
            out=out, plot=None)


def test_the_result_carries_its_goals_derived_from_its_rows(speed_result):
    from prunewatch.bench.speed_goals import GOALS, goals_summary

    data, _ = speed_result
    assert [entry["goal"] for entry in data["goals"]] == [goal.key for goal in GOALS]
    assert data["goals"] == goals_summary(data)
    checked = {(check["model"], check["run"]) for entry in data["goals"] for check in entry["checks"]}
    assert checked == {(row["model"], row["run"]) for row in data["rows"] if row["run"] != "plain"}
