"""Streamlit ROI calculator over the result store; started by `prunewatch roi` (`streamlit run prunewatch/roi/app.py`).

Every number comes from the pure core (prunewatch.roi.calculator, prunewatch.roi.analysis, prunewatch.roi.tables), so the app,
its CSV and the CFO report agree. The store URL comes from PRUNEWATCH_DB_URL or from
`-- --db URL` after the script path; PRUNEWATCH_ROI_PASSWORD, when set, locks the app;
PRUNEWATCH_ROI_LOAD_RESULTS, when set, prices time per request from a load run at the selected concurrency.
"""

from __future__ import annotations

import argparse
import hmac
import sys
from datetime import UTC, datetime, timedelta
from typing import Any, SupportsFloat

import pandas as pd
import streamlit as st
from annotated_types import Ge, Gt, Le
from pydantic import ValidationError

from prunewatch.records.results import ProbeResult
from prunewatch.records.store import safe_url
from prunewatch.roi import app_charts
from prunewatch.roi.analysis import no_sensitivity_text, projection, sensitivity, waterfall
from prunewatch.roi.assumptions import Assumptions
from prunewatch.roi.calculator import calculate
from prunewatch.roi.costs import Basis
from prunewatch.roi.errors import RoiError
from prunewatch.roi.formatting import number, pct
from prunewatch.roi.load_profile import LoadPoint, LoadProfile
from prunewatch.roi.measured import (
    PROBE_MODEL_CAVEAT,
    MeasuredSummary,
    Window,
    scatter_points,
    select,
    summarize,
    trend,
)
from prunewatch.roi.provenance import InputValue, Provenance
from prunewatch.roi.settings import WINDOW_CHOICES_DAYS, RoiAppSettings
from prunewatch.roi.store import load_results
from prunewatch.roi.tables import (
    basis_text,
    cost_rows,
    headlines,
    input_rows,
    load_caption,
    load_rows,
    quality_rows,
    to_csv,
)

ALL_TARGETS = "All targets"
ALL_MODELS = "All models"
ASSUMPTION_FIELDS = ("requests_per_day", "gpu_hourly_usd", "gpu_utilisation", "incident_cost_usd",
                     "input_usd_per_mtok", "output_usd_per_mtok", "prunable_time_share", "implementation_cost_usd")
OVERRIDE_FIELDS = ("dense_inference_s", "failure_rate", "prompt_tokens_per_request", "completion_tokens_per_request")
_STEPS = {"requests_per_day": 1_000.0, "implementation_cost_usd": 1_000.0, "incident_cost_usd": 10.0,
          "dense_inference_s": 0.01, "prompt_tokens_per_request": 1.0, "completion_tokens_per_request": 1.0}
_FORMATS = {"requests_per_day": "%.0f", "implementation_cost_usd": "%.0f", "incident_cost_usd": "%.0f",
            "dense_inference_s": "%.3f", "failure_rate": "%.4f", "prompt_tokens_per_request": "%.1f",
            "completion_tokens_per_request": "%.1f"}


def app_settings(argv: list[str]) -> RoiAppSettings:
    """Settings from the environment; `--db URL` after the script path wins over PRUNEWATCH_DB_URL."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--db")
    known, _ = parser.parse_known_args(argv)
    settings = RoiAppSettings()
    return settings.model_copy(update={"db_url": known.db}) if known.db else settings


def authorised(settings: RoiAppSettings) -> bool:
    """True when no password is configured or this session typed the right one."""
    if settings.password is None or st.session_state.get("roi_authenticated"):
        return True
    st.title("prunewatch ROI")
    with st.form("login"):
        typed = st.text_input("Password", type="password", key="roi_password")
        submitted = st.form_submit_button("Sign in")
    if submitted:
        if hmac.compare_digest(typed.encode(), settings.password.get_secret_value().encode()):
            st.session_state["roi_authenticated"] = True
            st.rerun()
        st.error("Wrong password.")
    return False


@st.cache_data(ttl=60, show_spinner="Reading probe results")
def _load(db_url: str, start: datetime, end: datetime) -> list[ProbeResult]:
    return load_results(db_url, Window(start=start, end=end))


def current_window(days: int, now: datetime | None = None) -> Window:
    """The last `days` days, ending at the next whole minute (so reruns within a minute share the cache)."""
    now = now or datetime.now(UTC)
    end = now.replace(second=0, microsecond=0) + timedelta(minutes=1)
    return Window(start=end - timedelta(days=days), end=end)


def _number(bound: object) -> float:
    """An annotated_types bound (typed only as comparable) as a float; the assumptions' bounds are numbers."""
    if not isinstance(bound, SupportsFloat):
        raise TypeError(f"assumption bound {bound!r} is not a number")
    return float(bound)


def _bounds(name: str) -> tuple[float | None, float | None]:
    low = high = None
    for item in Assumptions.model_fields[name].metadata:
        if isinstance(item, Ge):
            low = _number(item.ge)
        elif isinstance(item, Gt):
            low = _number(item.gt) + (0.01 if name.endswith("_usd") else 0.001)
        elif isinstance(item, Le):
            high = _number(item.le)
    return low, high


def assumption_inputs(summary_hint: MeasuredSummary) -> dict[str, Any]:
    """Sidebar inputs for every assumption (defaults shown) and for the overrides of measured figures."""
    defaults = Assumptions()
    values: dict[str, Any] = {}
    st.sidebar.subheader("Assumptions")
    st.sidebar.caption("Defaults are placeholders (assumed-default); any change is marked user-entered.")
    for name in ASSUMPTION_FIELDS:
        low, high = _bounds(name)
        values[name] = st.sidebar.number_input(
            f"{Assumptions.label(name)} ({Assumptions.unit(name)})", min_value=low, max_value=high,
            value=float(getattr(defaults, name)), step=_STEPS.get(name, 0.01), format=_FORMATS.get(name, "%.2f"),
            key=name, help=Assumptions.model_fields[name].description)
    st.sidebar.subheader("Override a measurement")
    st.sidebar.caption("Leave empty to use what the store measured.")
    dense_ms = summary_hint.matched_dense_ms if summary_hint.has_dense_baseline else None
    hints = {"failure_rate": summary_hint.failure_rate, "prompt_tokens_per_request": summary_hint.prompt_tokens,
             "completion_tokens_per_request": summary_hint.completion_tokens,
             "dense_inference_s": None if dense_ms is None else dense_ms / 1000}
    for name in OVERRIDE_FIELDS:
        low, high = _bounds(name)
        hint = hints.get(name)
        if hint is not None:
            placeholder = f"measured: {hint:.4g}"
        else:
            placeholder = "estimated (see the inputs table)" if name == "dense_inference_s" else "not measured"
        values[name] = st.sidebar.number_input(
            f"{Assumptions.label(name)} ({Assumptions.unit(name)})", min_value=low, max_value=high, value=None,
            step=_STEPS.get(name, 0.001), format=_FORMATS.get(name, "%.3f"), key=name, placeholder=placeholder,
            help=Assumptions.model_fields[name].description)
    return values


def choose_load(settings: RoiAppSettings) -> LoadPoint | None:
    """The load run at the concurrency picked in the sidebar (among its measured levels), or None without one.

    Starts at the configured concurrency (user-entered) or at the run's highest level (assumed-default, the busiest
    load measured); picking another level makes it user-entered. Raises RoiError for a bad file or level."""
    if settings.load_results is None:
        return None
    profile = LoadProfile.from_file(settings.load_results)
    start = settings.concurrency if settings.concurrency is not None else profile.concurrencies[-1]
    profile.at(start)  # a configured level the run did not measure is an error naming the measured ones
    st.sidebar.subheader("Throughput under load")
    chosen = st.sidebar.selectbox(
        "Concurrent clients (deployment)", profile.concurrencies, index=profile.concurrencies.index(start),
        key="concurrency", help="Time per request = output tokens / aggregate tokens/s measured at this many "
                                f"concurrent clients ({profile.source}).")
    entered = settings.concurrency is not None or chosen != start
    return LoadPoint.choose(profile, chosen, Provenance.USER_ENTERED if entered else Provenance.ASSUMED_DEFAULT)


def show_load(load: LoadPoint, hourly: InputValue) -> None:
    """Cost per 1M output tokens, dense vs pruned, at every measured concurrency: where pruning stops paying."""
    st.subheader("Throughput under load")
    left, right = st.columns([3, 2])
    with left:
        st.table(load_rows(load, hourly))
        st.caption(load_caption(load, hourly))
    with right:
        st.altair_chart(app_charts.load_cost_chart(load.profile.cost_rows(hourly.value), load.concurrency),
                        width="stretch")


def show_measured(summary: MeasuredSummary) -> None:
    """What the store measured in the window: counts, ratio, quality kept."""
    st.subheader("Measured in the window")
    cols = st.columns(5)
    cols[0].metric("Probe requests", f"{summary.results_total}", help="measured: probe results in the window")
    cols[1].metric("Failed", f"{summary.results_failed}",
                   help="measured: " + (", ".join(f"{k} {v}" for k, v in summary.failures_by_reason.items()) or "none"))
    cols[2].metric("Mean pruning ratio", "n/a" if summary.mean_pruning_ratio is None else f"{summary.mean_pruning_ratio:.3f}",
                   help=f"measured: work skipped / dense work ({summary.ratio_unit or 'no unit'}), pruned configuration")
    agreement = summary.reference_agreement
    cols[3].metric("Quality kept (reference-scored agreement)",
                   "n/a" if agreement is None else pct(agreement["estimate"]),
                   help="measured: share of the served answers' tokens equal to the dense reference's argmax"
                        + ("" if agreement is None else
                           f"; 95% interval {pct(agreement['low'])} to {pct(agreement['high'])} over "
                           f"{int(agreement['prompts'])} prompts (bootstrap over prompts)"))
    cols[4].metric("Pruned / dense runs", f"{summary.pruned_results} / {summary.dense_results}",
                   help="measured: successful probes with sensitivity > 0 / with sensitivity 0")
    st.table([{"Figure": figure, "Value": value, "How it was obtained": how}
              for figure, value, how in quality_rows(summary)])


def main() -> None:
    st.set_page_config(page_title="prunewatch ROI", layout="wide")
    try:
        settings = app_settings(sys.argv[1:])
    except ValidationError as exc:
        st.error(f"invalid setting: {exc.errors()[0].get('msg')}")
        return
    if not authorised(settings):
        return
    st.title("Pruning ROI")
    st.caption(f"Store: {safe_url(settings.db_url)}. Costs are computed from measured probe data and the "
               "assumptions in the sidebar; every input's provenance is listed below.")

    st.sidebar.header("Window and target")
    choices = sorted(set(WINDOW_CHOICES_DAYS) | {settings.default_days})
    days = st.sidebar.selectbox("Window (last N days)", choices, index=choices.index(settings.default_days), key="days")
    window = current_window(days)
    try:
        results = _load(settings.db_url, window.start, window.end)
    except RoiError as exc:
        st.error(str(exc))
        return
    everything = summarize(results, window)
    target_choice = st.sidebar.selectbox("Target", [ALL_TARGETS, *everything.targets], key="target")
    target = None if target_choice == ALL_TARGETS else target_choice
    models = summarize(results, window, target).models
    model_choice = st.sidebar.selectbox("Model", [ALL_MODELS, *models], key="model",
                                        help="Pick one model when a target served several in the window.")
    model = None if model_choice == ALL_MODELS else model_choice
    basis = Basis(st.sidebar.radio("Cost basis", [b.value for b in Basis], key="basis",
                                   help="allocation: reserved whole GPUs; usage: billed busy hours / utilisation"))
    hint = summarize(results, window, target, model)
    try:
        assumptions = Assumptions.from_changes(assumption_inputs(hint))
    except ValueError as exc:
        st.error(f"invalid input: {exc}")
        return
    swing = st.sidebar.slider("Sensitivity range (± %)", 5, 50, 20, step=5, key="sensitivity_pct")
    try:
        load = choose_load(settings)
    except RoiError as exc:
        st.error(str(exc))
        return

    try:
        summary, result = calculate(results, window, assumptions, target, model, load)
    except RoiError as exc:
        st.warning(str(exc))
        show_measured(hint)
        return

    st.subheader(f"Headline ({basis.value} basis)")
    for column, headline in zip(st.columns(5), headlines(result, basis, summary)):
        column.metric(headline.label, headline.value, help=headline.help)
    st.info(f"{basis_text(summary, result)} Cost basis — {basis.value}: {basis.description}.")
    if summary.uses_probe_model:
        st.caption(PROBE_MODEL_CAVEAT)
    if load is not None:
        show_load(load, result.inputs.gpu_hourly_usd)
    show_measured(summary)

    left, right = st.columns(2)
    with left:
        st.markdown("**Cumulative cost, before vs after pruning**")
        st.altair_chart(app_charts.projection_chart(projection(result, basis)), width="stretch")
    with right:
        st.markdown("**Monthly savings waterfall**")
        st.altair_chart(app_charts.waterfall_chart(waterfall(result, basis)), width="stretch")
    chosen = select(results, window, target, model)
    left, right = st.columns(2)
    with left:
        st.markdown("**Pruning ratio vs inference time (measured, one dot per probe)**")
        st.altair_chart(app_charts.scatter_chart(scatter_points(chosen)), width="stretch")
    with right:
        width_s, points = trend(chosen)
        st.markdown(f"**Measured trend ({width_s // 60}-minute buckets)**" if width_s < 86_400
                    else f"**Measured trend ({width_s // 86_400}-day buckets)**")
        st.altair_chart(app_charts.trend_chart(points), width="stretch")
    rows = sensitivity(result, basis, swing)
    st.markdown(f"**Sensitivity of monthly savings to each input (±{swing}%)**")
    if any(row.swing > 0 for row in rows):
        st.altair_chart(app_charts.sensitivity_chart(rows, swing, result.costs(basis).savings_per("month")),
                        width="stretch", height=app_charts.sensitivity_height(rows))
    else:
        st.caption(no_sensitivity_text(basis, swing))

    st.subheader("Every input and its provenance")
    inputs_table = input_rows(result)
    st.dataframe(pd.DataFrame(inputs_table), hide_index=True, width="stretch", height=36 * (len(inputs_table) + 1) + 4)
    st.subheader(f"Cost per month by line ({basis.value} basis)")
    st.dataframe(pd.DataFrame(cost_rows(result, basis)), hide_index=True, width="stretch")
    times = result.gpu_time
    st.caption(f"{times.label(summary.time_label)}: before {number(times.before_s, 's/request')} "
               f"({times.before_provenance.value}), after {number(times.after_s, 's/request')} "
               f"({times.after_provenance.value}).")
    left, right = st.columns(2)
    left.download_button("Download inputs and results (CSV)", to_csv(result, summary), file_name="prunewatch-roi.csv",
                         mime="text/csv", key="download_csv")
    right.download_button("Download assumptions (JSON, for `prunewatch report --assumptions`)", assumptions.to_json(),
                          file_name="roi-assumptions.json", mime="application/json", key="download_assumptions")


if __name__ == "__main__":
    main()
