"""The Streamlit app driven by streamlit.testing: inputs change, headline metrics follow the core."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from prunewatch.records.settings import STORE_URL_ENV as DB_URL_ENV
from prunewatch.records.store import connect, create_schema
from prunewatch.roi import Assumptions, Basis, LoadPoint, LoadProfile, Provenance, calculate
from prunewatch.roi.app import current_window
from prunewatch.roi.measured import PROBE_MODEL_CAVEAT
from prunewatch.roi.settings import CONCURRENCY_ENV, LOAD_RESULTS_ENV, PASSWORD_ENV
from prunewatch.roi.store import load_results
from prunewatch.roi.tables import headlines
from tests.roi.factories import write_load

APP = Path(__file__).resolve().parents[2] / "prunewatch" / "roi" / "app.py"
TIMEOUT_S = 90  # the first run imports pandas/altair and reads the store; CI machines are shared


def _run(monkeypatch, url: str, password: str | None = None) -> AppTest:
    monkeypatch.setenv(DB_URL_ENV, url)
    if password is None:
        monkeypatch.delenv(PASSWORD_ENV, raising=False)
    else:
        monkeypatch.setenv(PASSWORD_ENV, password)
    app = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S)
    app.run()
    assert not app.exception, app.exception
    return app


def _metrics(app: AppTest) -> dict[str, str]:
    return {metric.label: metric.value for metric in app.metric}


def _expected(url: str, basis: Basis, load: LoadPoint | None = None, **changes) -> dict[str, str]:
    window = current_window(30)
    _, result = calculate(load_results(url, window), window, Assumptions(**changes), load=load)
    return {h.label: h.value for h in headlines(result, basis)}


def _provenance(app: AppTest) -> dict[str, str]:
    table = app.dataframe[0].value
    return dict(zip(table["Input"], table["Provenance"]))


def test_default_inputs_show_the_cores_headline_and_provenance(monkeypatch, collected_sqlite: str) -> None:
    app = _run(monkeypatch, collected_sqlite)
    metrics = _metrics(app)
    expected = _expected(collected_sqlite, Basis.ALLOCATION)
    assert {label: metrics[label] for label in expected} == expected
    assert metrics["Probe requests"] == "18" and metrics["Failed"] == "0"
    assert metrics["Pruned / dense runs"] == "12 / 6"  # two rounds, the first with its dense baselines
    # The collected store has dense baselines, so "after" is measured against them, and in the words of the
    # device it was measured on: the probes ran on a CPU, so no "GPU time" is claimed.
    assert app.info[0].value.startswith("Measured: CPU time per request after pruning = before × ")
    assert "GPU time" not in app.info[0].value
    provenance = _provenance(app)
    assert provenance["Request volume"] == "assumed-default"
    # Measured on a CPU, and labelled so: the dense baselines' time before pruning and the after/before ratio.
    assert provenance["CPU time per request before pruning"] == "measured"
    assert provenance["CPU time after / before"] == "measured"
    assert not [name for name in provenance if name.startswith("GPU time")]
    assert any(c.value == PROBE_MODEL_CAVEAT for c in app.caption)  # the collector ran the bundled probe model
    assert len(app.get("download_button")) == 2  # CSV of inputs and results, JSON of assumptions


def test_changing_volume_and_basis_updates_the_headline(monkeypatch, collected_sqlite: str) -> None:
    app = _run(monkeypatch, collected_sqlite)
    base = _expected(collected_sqlite, Basis.USAGE)
    app.radio(key="basis").set_value("usage").run()
    assert _metrics(app)["Savings / month"] == base["Savings / month"]
    app.number_input(key="requests_per_day").set_value(100_000.0).run()
    metrics = _metrics(app)
    doubled = _expected(collected_sqlite, Basis.USAGE, requests_per_day=100_000.0)
    assert {label: metrics[label] for label in doubled} == doubled
    assert metrics["Savings / month"] != base["Savings / month"]
    assert _provenance(app)["Request volume"] == "user-entered"
    # Usage cost is linear in volume: twice the requests, twice the savings (to the cent of the rounding).
    window = current_window(30)
    results = load_results(collected_sqlite, window)
    one = calculate(results, window, Assumptions())[1].usage.savings_per_day
    two = calculate(results, window, Assumptions(requests_per_day=100_000.0))[1].usage.savings_per_day
    assert two == pytest.approx(2 * one)


def test_overriding_dense_time_is_user_entered(monkeypatch, collected_sqlite: str) -> None:
    app = _run(monkeypatch, collected_sqlite)
    app.number_input(key="dense_inference_s").set_value(2.0).run()
    metrics = _metrics(app)
    expected = _expected(collected_sqlite, Basis.ALLOCATION, dense_inference_s=2.0)
    assert metrics["Cost before / month"] == expected["Cost before / month"]
    assert _provenance(app)["GPU time per request before pruning"] == "user-entered"
    # The entered time is not the store's CPU time: the caption names it as entered.
    caption = next(c.value for c in app.caption if c.value.startswith("GPU time per request (user-entered)"))
    assert "before 2.000 s (user-entered)" in caption and caption.endswith("(estimated).")
    assert not [c for c in app.caption if c.value.startswith("CPU time per request (measured on cpu")]


def test_zero_traffic_shows_a_message_instead_of_numbers(monkeypatch, collected_sqlite: str) -> None:
    app = _run(monkeypatch, collected_sqlite)
    app.number_input(key="requests_per_day").set_value(0.0).run()
    assert not app.exception
    assert "request volume is 0 per day" in app.warning[0].value
    assert "Savings / month" not in _metrics(app)
    assert _metrics(app)["Probe requests"] == "18"  # the measurements are still shown


def test_empty_store_says_no_measurements_yet(monkeypatch, tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    engine = connect(url)
    create_schema(engine)
    engine.dispose()
    app = _run(monkeypatch, url)
    assert app.warning[0].value.startswith("no measurements yet: no successful probe of a pruned configuration")
    assert "Savings / month" not in _metrics(app)


def test_missing_store_is_an_error_message(monkeypatch, tmp_path) -> None:
    app = _run(monkeypatch, f"sqlite:///{tmp_path / 'absent.db'}")
    assert app.error[0].value.startswith("no result store at")
    assert not (tmp_path / "absent.db").exists()


def test_password_from_env_guards_every_number(monkeypatch, collected_sqlite: str) -> None:
    app = _run(monkeypatch, collected_sqlite, password="s3cret")
    assert _metrics(app) == {}
    app.text_input(key="roi_password").input("wrong")
    app.button[0].click().run()
    assert app.error[0].value == "Wrong password."
    assert _metrics(app) == {}
    app.text_input(key="roi_password").input("s3cret")
    app.button[0].click().run()
    assert _metrics(app)["Savings / month"] == _expected(collected_sqlite, Basis.ALLOCATION)["Savings / month"]


def _load_table(app: AppTest):
    return next(table.value for table in app.table if "Concurrent clients" in table.value.columns)


def test_a_load_results_setting_prices_time_under_load_and_shows_cost_per_million_tokens(
        monkeypatch, collected_sqlite: str, tmp_path: Path) -> None:
    path = write_load(tmp_path)
    monkeypatch.setenv(LOAD_RESULTS_ENV, str(path))
    monkeypatch.delenv(CONCURRENCY_ENV, raising=False)
    app = _run(monkeypatch, collected_sqlite)
    profile = LoadProfile.from_file(path)
    # Nobody named the deployment's concurrency: the app starts at the run's highest level and says it assumed it.
    assert app.info[0].value.startswith("Measured under load: at 4 concurrent clients (assumed-default)")
    assert "GPU time" not in app.info[0].value
    expected = _expected(collected_sqlite, Basis.ALLOCATION, LoadPoint.choose(profile, 4, Provenance.ASSUMED_DEFAULT))
    metrics = _metrics(app)
    assert {label: metrics[label] for label in expected} == expected
    table = _load_table(app)
    assert list(table["Concurrent clients"]) == ["1", "2", "4 (deployment)"]
    # The default $0.91 per GPU hour: 0.91 / (tok/s x 3600) x 1e6 per 1M output tokens.
    assert list(table["Dense $/1M output tokens"]) == ["$12.64", "$7.02", "$5.06"]
    assert list(table["Pruned $/1M output tokens"]) == ["$10.11", "$7.02", "$6.32"]
    assert list(table["Pruning"]) == ["saves 20%", "no change", "costs 25% more"]
    assert any(c.value.startswith("Tokens/s measured (") and "(assumed-default)" in c.value for c in app.caption)
    specs = [chart.proto.spec for chart in app.get("vega_lite_chart")]
    assert sum("$ per 1M output tokens" in spec for spec in specs) == 1  # the chart beside the table
    provenance = _provenance(app)
    assert provenance["Concurrent clients (deployment)"] == "assumed-default"
    assert provenance["Aggregate output tokens/s after pruning (default, under load)"] == "measured"

    app.selectbox(key="concurrency").set_value(1).run()
    assert not app.exception
    assert app.info[0].value.startswith("Measured under load: at 1 concurrent client (user-entered)")
    expected = _expected(collected_sqlite, Basis.ALLOCATION, LoadPoint.choose(profile, 1))
    metrics = _metrics(app)
    assert {label: metrics[label] for label in expected} == expected
    assert list(_load_table(app)["Concurrent clients"]) == ["1 (deployment)", "2", "4"]
    assert _provenance(app)["Concurrent clients (deployment)"] == "user-entered"


def test_a_configured_concurrency_starts_there_and_an_unmeasured_one_is_named(
        monkeypatch, collected_sqlite: str, tmp_path: Path) -> None:
    path = write_load(tmp_path)
    monkeypatch.setenv(LOAD_RESULTS_ENV, str(path))
    monkeypatch.setenv(CONCURRENCY_ENV, "2")
    app = _run(monkeypatch, collected_sqlite)
    assert app.info[0].value.startswith("Measured under load: at 2 concurrent clients (user-entered)")
    monkeypatch.setenv(CONCURRENCY_ENV, "3")
    app = _run(monkeypatch, collected_sqlite)
    assert app.error[0].value == (f"concurrency 3 was not measured in {path}; measured levels: 1, 2, 4 (or measure "
                                  "it: prunewatch bench load --clients 3)")
    assert "Savings / month" not in _metrics(app)
    monkeypatch.setenv(LOAD_RESULTS_ENV, str(tmp_path / "absent.json"))
    monkeypatch.delenv(CONCURRENCY_ENV)
    app = _run(monkeypatch, collected_sqlite)
    assert app.error[0].value.startswith(f"no load results file at {tmp_path / 'absent.json'}")
