"""Resolve the cost model's inputs from measurements and assumptions, each with its provenance.

How "after" relates to "before" is decided here and stated in `ResolvedInputs.time_basis`:
- measured: the store holds pruned and dense runs of the same probes, so GPU time per request
  after = before x (pruned / dense inference time on those probes);
- estimated: only the pruned configuration was measured, so before = measured pruned time /
  (1 - measured pruning ratio x prunable share of inference time), an assumption-driven bound;
- measured under load: a `prunewatch bench load` run measured the aggregate output tokens/s of dense and pruned
  serving at the deployment's concurrency, so time per request = output tokens per request / aggregate tokens/s
  (a batched server decodes several requests per step; their single-stream times would overstate the cost and
  misstate what pruning saves).
Token counts and the failure rate are taken as the same before and after: probes cannot tell
which configuration a failed request would have run, and the output budget does not change.
"""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict

from prunewatch.roi.assumptions import Assumptions
from prunewatch.roi.errors import NoMeasurementsError
from prunewatch.roi.load_profile import LoadPoint, clients_text
from prunewatch.roi.measured import MeasuredSummary
from prunewatch.roi.provenance import InputValue, Provenance


class TimeBasis(str, Enum):
    """How GPU time per request after pruning was related to the time before pruning."""

    MEASURED = "measured"
    ESTIMATED = "estimated"
    UNDER_LOAD = "measured-under-load"


_ASSUMPTION_KEYS = ("requests_per_day", "gpu_hourly_usd", "gpu_utilisation", "incident_cost_usd",
                    "input_usd_per_mtok", "output_usd_per_mtok", "implementation_cost_usd")


class ResolvedInputs(BaseModel):
    """Every number the cost model uses, labelled; None where a figure does not apply."""

    model_config = ConfigDict(frozen=True)

    requests_per_day: InputValue
    gpu_hourly_usd: InputValue
    gpu_utilisation: InputValue
    incident_cost_usd: InputValue
    input_usd_per_mtok: InputValue
    output_usd_per_mtok: InputValue
    implementation_cost_usd: InputValue
    prompt_tokens_per_request: InputValue
    completion_tokens_per_request: InputValue
    failure_rate: InputValue
    time_basis: TimeBasis
    matched_probes: int = 0  # probes measured pruned and dense (measured basis)
    dense_inference_s: InputValue | None = None  # measured baseline or user-entered
    pruned_inference_s: InputValue | None = None  # measured pruned time (the anchor when estimated)
    time_factor: InputValue | None = None  # measured pruned/dense time ratio (measured basis only)
    pruning_ratio: InputValue | None = None
    prunable_time_share: InputValue | None = None  # used by the estimated basis only
    concurrency: InputValue | None = None  # the deployment's concurrent clients (under-load basis only)
    dense_tokens_per_s: InputValue | None = None  # measured aggregate tokens/s at that concurrency (under load)
    pruned_tokens_per_s: InputValue | None = None
    load: LoadPoint | None = None  # the load run and concurrency those three come from

    def rows(self) -> list[InputValue]:
        """Every input that applies, in a stable order (the inputs table, CSV, PDF)."""
        names = [name for name in type(self).model_fields if name not in ("time_basis", "matched_probes", "load")]
        return [value for value in (getattr(self, name) for name in names) if isinstance(value, InputValue)]

    def replace(self, key: str, value: float) -> ResolvedInputs:
        """A copy with one input's value changed (sensitivity analysis)."""
        current = getattr(self, key)
        if not isinstance(current, InputValue):
            raise KeyError(key)
        return self.model_copy(update={key: current.with_value(value)})

    @property
    def factor(self) -> float:
        """GPU time per request after / before pruning, by the stated basis."""
        if self.time_basis is TimeBasis.UNDER_LOAD:  # time per token is the inverse of the aggregate throughput
            return self.dense_tokens_per_s.value / self.pruned_tokens_per_s.value  # type: ignore[union-attr]
        if self.time_basis is TimeBasis.MEASURED and self.time_factor is not None:
            return self.time_factor.value
        return 1.0 - self.pruning_ratio.value * self.prunable_time_share.value  # type: ignore[union-attr]

    def describe_basis(self) -> str:
        """One sentence that says how 'after' was derived from 'before' and how sure that is."""
        if self.time_basis is TimeBasis.UNDER_LOAD:
            return self._describe_under_load()
        if self.time_basis is TimeBasis.MEASURED:
            return (f"Measured: GPU time per request after pruning = before × {self.factor:.3f}, the ratio of "
                    f"pruned to dense inference time on {self.matched_probes} probes run in both configurations.")
        return (f"Estimated: no dense baseline was measured, so GPU time per request after pruning = before × "
                f"(1 − {self.pruning_ratio.value:.3f} measured pruning ratio × "  # type: ignore[union-attr]
                f"{self.prunable_time_share.value:.2f} assumed prunable share of inference time) = before × "  # type: ignore[union-attr]
                f"{self.factor:.3f}.")

    def _describe_under_load(self) -> str:
        dense, pruned, clients = self.dense_tokens_per_s, self.pruned_tokens_per_s, self.concurrency
        if dense is None or pruned is None or clients is None or self.load is None:
            raise ValueError("the under-load basis needs the load run's throughputs and the concurrency")
        ratio = pruned.value / dense.value
        verdict = ("pays" if ratio > 1 else "does not pay") + " at this load"
        before = ("the entered time per request" if self.dense_inference_s is not None
                  else "output tokens per request / dense aggregate tokens/s")
        return (f"Measured under load: at {clients_text(round(clients.value))} ({clients.provenance.value}) the "
                f"pruned configuration streams {pruned.value:.1f} aggregate output tokens/s against dense's "
                f"{dense.value:.1f}, so pruned/dense aggregate throughput is {ratio:.2f}x and pruning {verdict}: "
                f"time per request before pruning = {before}, after = before × {self.factor:.3f} "
                f"({self.load.profile.source}).")


def _assumed(assumptions: Assumptions, name: str, note: str = "") -> InputValue:
    return InputValue(key=name, label=Assumptions.label(name), value=float(getattr(assumptions, name)),
                      unit=Assumptions.unit(name), provenance=assumptions.provenance(name),
                      note=note or Assumptions.model_fields[name].description or "")


def _measured_or_override(assumptions: Assumptions, name: str, measured: float | None, measured_note: str,
                          missing: str, time_noun: str | None = None) -> InputValue:
    """The user's value where entered, else the store's. `time_noun`: what a measured time is ("CPU time" for
    probes that ran on a CPU), which replaces the label's "GPU time"; an entered one keeps it."""
    override = getattr(assumptions, name)
    if override is not None:
        return InputValue(key=name, label=Assumptions.label(name), value=float(override),
                          unit=Assumptions.unit(name), provenance=Provenance.USER_ENTERED,
                          note=f"overrides the measured value ({_plain(measured)})")
    if measured is None:
        raise NoMeasurementsError(missing)
    label = Assumptions.label(name)
    if time_noun is not None and label.startswith("GPU time"):
        label = time_noun + label.removeprefix("GPU time")
    return InputValue(key=name, label=label, value=float(measured), unit=Assumptions.unit(name),
                      provenance=Provenance.MEASURED, note=measured_note)


def _plain(value: float | None) -> str:
    return "none" if value is None else f"{value:.4g}"


def _where(summary: MeasuredSummary) -> str:
    target = f"target {summary.target}" if summary.target else "all targets"
    model = f", model {summary.model}" if summary.model else ""
    return (f"{target}{model} between {summary.window.start:%Y-%m-%d %H:%M} and "
            f"{summary.window.end:%Y-%m-%d %H:%M} UTC")


def _unmatched_filter(summary: MeasuredSummary) -> str:
    """What a target or model filter that matched nothing could have been, so the fix is in the message."""
    if summary.model and summary.model not in summary.models:
        seen = ", ".join(summary.models) or "none"
        return f"; no result of model {summary.model} in this window (models with results: {seen})"
    if summary.target and summary.target not in summary.targets:
        seen = ", ".join(summary.targets) or "none"
        return f"; no result of target {summary.target} in this window (targets with results: {seen})"
    return ""


def _under_load(load: LoadPoint, assumptions: Assumptions) -> dict[str, InputValue]:
    """The inputs of the under-load basis: the concurrency, the two measured throughputs, an entered time."""
    level, profile = load.level, load.profile
    measured = f"aggregate output tokens/s at {clients_text(level.clients)}, {profile.source}"
    values = {
        "concurrency": InputValue(
            key="concurrency", label="Concurrent clients (deployment)", value=float(level.clients), unit="clients",
            provenance=load.concurrency_provenance,
            note=f"priced at this measured level; measured levels: {', '.join(map(str, profile.concurrencies))}"),
        "dense_tokens_per_s": InputValue(
            key="dense_tokens_per_s", label="Aggregate output tokens/s before pruning (dense, under load)",
            value=level.dense_tokens_per_s, unit="tokens/s", provenance=Provenance.MEASURED, note=measured),
        "pruned_tokens_per_s": InputValue(
            key="pruned_tokens_per_s", label="Aggregate output tokens/s after pruning (default, under load)",
            value=level.pruned_tokens_per_s, unit="tokens/s", provenance=Provenance.MEASURED, note=measured),
    }
    if assumptions.dense_inference_s is not None:
        values["dense_inference_s"] = InputValue(
            key="dense_inference_s", label=Assumptions.label("dense_inference_s"),
            value=assumptions.dense_inference_s, unit=Assumptions.unit("dense_inference_s"),
            provenance=Provenance.USER_ENTERED, note="overrides the time under load; after = it × the load's ratio")
    return values


def resolve_inputs(summary: MeasuredSummary, assumptions: Assumptions, load: LoadPoint | None = None) -> ResolvedInputs:
    """Combine measurements and assumptions; raises NoMeasurementsError when the evidence is missing.

    With `load`, GPU time per request comes from the load run's aggregate throughput at its concurrency instead
    of the probes' single-stream times; tokens, failures and quality still come from the probes."""
    if summary.pruned_results == 0:
        raise NoMeasurementsError(
            f"no measurements yet: no successful probe of a pruned configuration (sensitivity > 0) for "
            f"{_where(summary)} ({summary.results_total} results, {summary.results_failed} failed)"
            f"{_unmatched_filter(summary) or '; run the collector with pruning enabled or widen the window'}")
    if summary.pruned_inference_ms is None:
        raise NoMeasurementsError(f"the pruned probes for {_where(summary)} measured no inference time")
    n_pruned = summary.pruned_results
    values: dict[str, object] = {name: _assumed(assumptions, name) for name in _ASSUMPTION_KEYS}
    values["prompt_tokens_per_request"] = _measured_or_override(
        assumptions, "prompt_tokens_per_request", summary.prompt_tokens,
        f"mean over {n_pruned} pruned probe requests; same before and after pruning",
        "no prompt token counts were measured; enter input tokens per request")
    values["completion_tokens_per_request"] = _measured_or_override(
        assumptions, "completion_tokens_per_request", summary.completion_tokens,
        f"mean over {n_pruned} pruned probe requests; same before and after pruning",
        "no completion token counts were measured; enter output tokens per request")
    values["failure_rate"] = _measured_or_override(
        assumptions, "failure_rate", summary.failure_rate,
        f"{summary.results_failed} failed of {summary.results_total} probe requests; same before and after",
        "no probe requests in the window")
    if summary.mean_pruning_ratio is not None:
        values["pruning_ratio"] = InputValue(
            key="pruning_ratio", label="Pruning ratio", value=summary.mean_pruning_ratio,
            unit=summary.ratio_unit or "fraction", provenance=Provenance.MEASURED,
            note=f"mean over {n_pruned} pruned probe requests (work skipped / dense work)")

    if load is not None:
        values.update(_under_load(load, assumptions))
        return ResolvedInputs(time_basis=TimeBasis.UNDER_LOAD, matched_probes=summary.matched_probes, load=load,
                              **values)
    if summary.has_dense_baseline:
        basis = TimeBasis.MEASURED
        values["time_factor"] = InputValue(
            key="time_factor", label=f"{summary.time_noun} after / before", value=summary.matched_pruned_ms / summary.matched_dense_ms,  # type: ignore[operator]
            unit="ratio", provenance=Provenance.MEASURED,
            note=f"pruned / dense inference time, mean over {summary.matched_probes} probes run in both configurations")
        values["dense_inference_s"] = _measured_or_override(
            assumptions, "dense_inference_s", summary.matched_dense_ms / 1000.0,  # type: ignore[operator]
            f"dense-baseline inference time on the {summary.matched_probes} matched probes, {summary.measured_on}", "",
            time_noun=summary.time_noun)
    else:
        if summary.mean_pruning_ratio is None:
            raise NoMeasurementsError(
                f"the pruned probes for {_where(summary)} report no pruning ratio and no dense baseline was "
                f"measured, so the effect of pruning cannot be told; run a dense baseline (sensitivity 0)")
        basis = TimeBasis.ESTIMATED
        values["prunable_time_share"] = _assumed(assumptions, "prunable_time_share")
        values["pruned_inference_s"] = InputValue(
            key="pruned_inference_s", label=f"{summary.time_noun} per request after pruning",
            value=summary.pruned_inference_ms / 1000.0, unit="s/request", provenance=Provenance.MEASURED,
            note=f"mean inference time over {n_pruned} pruned probe requests, {summary.measured_on}")
        if assumptions.dense_inference_s is not None:
            estimate = summary.pruned_inference_ms / 1000.0 / max(1e-9, 1.0 - summary.mean_pruning_ratio
                                                                  * assumptions.prunable_time_share)
            values["dense_inference_s"] = InputValue(
                key="dense_inference_s", label=Assumptions.label("dense_inference_s"),
                value=assumptions.dense_inference_s, unit=Assumptions.unit("dense_inference_s"),
                provenance=Provenance.USER_ENTERED, note=f"overrides the estimate ({estimate:.4g} s)")
    return ResolvedInputs(time_basis=basis, matched_probes=summary.matched_probes, **values)
