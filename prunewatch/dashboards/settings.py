"""What the generated dashboards are configured with: datasource uids and the prices of the cost panel.

The defaults are what the committed JSON is generated from (and what the provisioning files
name), so a plain `prunewatch dashboards export` reproduces the committed files byte for byte.
The prices only seed editable dashboard variables: every cost figure is labelled as computed from
*configured* prices, and a user can change them in Grafana without re-exporting.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from prunewatch.records.prices import PLACEHOLDER_GPU_USD_PER_HOUR, PLACEHOLDER_OUTPUT_USD_PER_MTOK

UID_PATTERN = r"^[A-Za-z0-9_-]{1,40}$"  # Grafana uids: at most 40 characters


class DashboardSettings(BaseModel):
    """Inputs of the dashboard builders; the defaults produce the committed JSON."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prometheus_uid: str = Field(
        "prunewatch-prometheus", pattern=UID_PATTERN,
        description="uid of the Prometheus datasource (the provisioning file creates it with this uid).")
    postgres_uid: str = Field(
        "prunewatch-postgres", pattern=UID_PATTERN,
        description="uid of the PostgreSQL datasource holding the collector's probe_results table.")
    usd_per_million_tokens: float = Field(
        PLACEHOLDER_OUTPUT_USD_PER_MTOK, ge=0.0, le=10_000.0,
        description="Configured price of 1M generated tokens (list price or internal charge-back rate); the "
                    "default is the placeholder output-token price the ROI calculator also starts from "
                    "(prunewatch/records/prices.py): replace it with yours.")
    gpu_usd_per_hour: float = Field(
        PLACEHOLDER_GPU_USD_PER_HOUR, ge=0.0, le=10_000.0,
        description="Configured cost of one GPU hour (cloud on-demand price or amortised hardware); the default "
                    "is the placeholder GPU price the ROI calculator also starts from: replace it with yours.")
    refresh: str = Field("30s", pattern=r"^[1-9][0-9]*[smh]$", description="Dashboard auto-refresh interval.")
    time_from: str = Field("now-6h", pattern=r"^now-[1-9][0-9]*[mhdw]$", description="Default time range start.")
