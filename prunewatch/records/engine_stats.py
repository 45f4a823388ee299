"""An engine's RequestStats as a ProbeResult: the one place where the engine's figures enter the records.

Kept apart from prunewatch/records/results.py so that readers of results (ROI, alerts, dashboards) never import
the engine.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from prunewatch.engine.stats import QualityReport, RequestStats
from prunewatch.probes import Probe
from prunewatch.records.results import ProbeResult

_STATS_FIELDS = tuple(sorted(({f.name for f in fields(ProbeResult)} & {f.name for f in fields(RequestStats)})
                             - {"domain", "quality_ms", "device"}))
"""RequestStats fields a ProbeResult keeps under the same name (domain, quality_ms and device differ)."""


def probe_result_from_stats(*, target: str, probe: Probe, round_id: str, stats: RequestStats, text: str,
                            duration_ms: float, device_name: str | None = None) -> ProbeResult:
    """The record of one successful probe, every engine figure mapped by name, absent ones left None."""
    quality = stats.quality
    copied = {name: getattr(stats, name) for name in _STATS_FIELDS}  # same name, same meaning
    copied["layers_bypassed"] = list(stats.layers_bypassed)
    return ProbeResult(
        target=target, probe_id=probe.id, probe_version=probe.version, probe_hash=probe.content_hash,
        domain=probe.domain, status="ok", round_id=round_id, **copied,
        quality_ms=stats.quality_ms if quality else None,  # absent when no check ran, not 0
        **quality_fields(quality),
        matched_domain=stats.domain,  # the calibrated domain the prompt matched; `domain` is the probe's
        duration_ms=duration_ms, output_text=text, device=stats.device or None, device_name=device_name,
    )


QUALITY_FIELDS = ("reference_agreement", "reference_tokens", "served_nll", "reference_nll", "divergence_at",
                  "continuation_agreement", "perplexity_delta_pct")
"""QualityReport figures a ProbeResult keeps under the same name."""


def quality_fields(quality: QualityReport | None) -> dict[str, Any]:
    """A request's own quality check as ProbeResult fields; all None (not 0) when none ran. The engine scored the
    answer against its own weights run dense: `quality_source` "engine"."""
    if quality is None:
        return {name: None for name in QUALITY_FIELDS} | {"quality_source": None}
    return {name: getattr(quality, name) for name in QUALITY_FIELDS} | {"quality_source": "engine"}
