"""Assumptions of the cost model: visible defaults a user can edit, never mixed with measurements.

A field the caller set explicitly is *user-entered*; a field left at its default is an
*assumed default*. The optional overrides replace a measured figure only when set.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from prunewatch.records.prices import (
    PLACEHOLDER_GPU_USD_PER_HOUR,
    PLACEHOLDER_INPUT_USD_PER_MTOK,
    PLACEHOLDER_OUTPUT_USD_PER_MTOK,
)
from prunewatch.roi.errors import RoiError
from prunewatch.roi.provenance import Provenance


def _meta(label: str, unit: str) -> dict[str, Any]:
    return {"label": label, "unit": unit}


class Assumptions(BaseModel):
    """What prunewatch cannot measure: prices, traffic, utilisation and the cost of a failure."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Every default below is a placeholder, not a measurement or a quoted price: the app and the report
    # label it "assumed default" until the user enters a value; the dashboards' cost panels start from
    # the same prices (prunewatch/records/prices.py).
    requests_per_day: float = Field(
        50_000.0, ge=0.0, le=1e10, json_schema_extra=_meta("Request volume", "requests/day"),
        description="Production requests per day the GPUs serve (placeholder; enter your traffic).")
    gpu_hourly_usd: float = Field(
        PLACEHOLDER_GPU_USD_PER_HOUR, gt=0.0, le=1_000.0, json_schema_extra=_meta("GPU price", "$/GPU-hour"),
        description="Price of one GPU hour (placeholder of the order of a small cloud GPU's hourly rental; "
                    "enter yours).")
    gpu_utilisation: float = Field(
        0.70, ge=0.01, le=1.0, json_schema_extra=_meta("GPU utilisation", "fraction"),
        description="Share of paid GPU time spent computing (placeholder; enter your fleet's).")
    incident_cost_usd: float = Field(
        400.0, ge=0.0, le=1e7, json_schema_extra=_meta("Cost per failed request", "$/incident"),
        description="Support cost of one failed request (5xx or timeout) that becomes an incident (placeholder).")
    input_usd_per_mtok: float = Field(
        PLACEHOLDER_INPUT_USD_PER_MTOK, ge=0.0, le=1_000.0, json_schema_extra=_meta("Input token price", "$/1M tokens"),
        description="Price of input (prompt) tokens: an API list price or your internal charge-back (placeholder).")
    output_usd_per_mtok: float = Field(
        PLACEHOLDER_OUTPUT_USD_PER_MTOK, ge=0.0, le=1_000.0,
        json_schema_extra=_meta("Output token price", "$/1M tokens"),
        description="Price of output (completion) tokens, priced separately from input tokens (placeholder).")
    prunable_time_share: float = Field(
        0.80, ge=0.0, le=1.0, json_schema_extra=_meta("Prunable share of inference time", "fraction"),
        description="Share of inference time spent in the work the pruning ratio counts (linear layers); "
                    "used only when no dense baseline was measured.")
    implementation_cost_usd: float = Field(
        10_000.0, ge=0.0, le=1e9, json_schema_extra=_meta("Implementation cost", "$ one-off"),
        description="One-off cost of deploying pruning (engineering time, validation); drives payback "
                    "(placeholder).")
    # Overrides of measured figures: None means "use what the store measured".
    dense_inference_s: float | None = Field(
        None, gt=0.0, le=3_600.0, json_schema_extra=_meta("GPU time per request before pruning", "s/request"),
        description="Overrides the measured (or estimated) dense inference time per request, e.g. with a "
                    "production figure at your batch size.")
    failure_rate: float | None = Field(
        None, ge=0.0, le=1.0, json_schema_extra=_meta("Failed request share", "fraction"),
        description="Overrides the measured share of failed probe requests.")
    prompt_tokens_per_request: float | None = Field(
        None, ge=0.0, le=1e7, json_schema_extra=_meta("Input tokens per request", "tokens"),
        description="Overrides the measured mean prompt tokens per request.")
    completion_tokens_per_request: float | None = Field(
        None, ge=0.0, le=1e7, json_schema_extra=_meta("Output tokens per request", "tokens"),
        description="Overrides the measured mean completion tokens per request.")

    def provenance(self, name: str) -> Provenance:
        """User-entered when the caller set the field, otherwise the visible default."""
        if name not in type(self).model_fields:
            raise KeyError(name)
        return Provenance.USER_ENTERED if name in self.model_fields_set else Provenance.ASSUMED_DEFAULT

    @classmethod
    def label(cls, name: str) -> str:
        return cls._extra(name, "label")

    @classmethod
    def unit(cls, name: str) -> str:
        return cls._extra(name, "unit")

    @classmethod
    def _extra(cls, name: str, key: str) -> str:
        """A field's label or unit: every field declares both in its json_schema_extra mapping."""
        extra = cls.model_fields[name].json_schema_extra
        if not isinstance(extra, dict):
            raise TypeError(f"assumption {name} declares no {key}")
        return str(extra[key])

    @classmethod
    def from_changes(cls, values: dict[str, Any]) -> Assumptions:
        """Build from a form: values equal to the default are left unset, so they stay 'assumed-default'."""
        defaults = cls()
        changed = {k: v for k, v in values.items() if v != getattr(defaults, k)}
        return cls(**changed)

    @classmethod
    def from_file(cls, path: Path) -> Assumptions:
        """Load user-entered assumptions from a JSON object (the app's 'download assumptions' file)."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise RoiError(f"cannot read assumptions file {path}: {exc}") from exc
        if not isinstance(data, dict):
            raise RoiError(f"assumptions file {path} must hold a JSON object of field: value")
        try:
            return cls(**data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ())) or "value"
            raise RoiError(f"assumptions file {path}: {where}: {first.get('msg')} (got {first.get('input')!r})") from exc

    def to_json(self) -> str:
        """The explicitly set fields only, so reloading keeps the same provenance."""
        return json.dumps(self.model_dump(include=self.model_fields_set), indent=2, sort_keys=True)
