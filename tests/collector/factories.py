"""Build ProbeResults and probes for collector tests without running a model."""

from __future__ import annotations

from datetime import UTC, datetime

from prunewatch.probes import Probe
from prunewatch.records.results import ProbeResult

PROBE = Probe(id="tech-route", domain="tech", version=3, max_tokens=8, system="Be brief.", prompt="Show routes.")


def ok_result(**overrides) -> ProbeResult:
    values = dict(
        target="embedded", model="probe-llama", probe_id=PROBE.id, probe_version=PROBE.version,
        probe_hash=PROBE.content_hash, domain=PROBE.domain, status="ok", round_id="r" * 32,
        created_at=datetime(2026, 11, 29, 12, 0, 0, 123000, tzinfo=UTC),
        sensitivity=0.5, pruning_ratio=0.3125, ratio_unit="linear_flops", ratio_source="measured",
        executed_flops=123_456_789_012, dense_flops=179_574_420_381, layers_bypassed=[3, 7, 9], layers_total=12,
        heads_gated=0, activation_sparsity=0.0, prompt_tokens=41, completion_tokens=8, preprocessing_ms=1.5,
        inference_ms=420.25, postprocessing_ms=33.0, ttft_ms=80.5, tokens_per_s=19.04, decode_tokens_per_s=21.3,
        continuation_agreement=0.875, perplexity_delta_pct=1.25, matched_domain="tech", domain_confidence=0.91,
        fallback_reason=None, peak_memory_bytes=4096, dram_bytes_per_instruction=5.5, dram_source="estimate",
        duration_ms=455.0, output_text="ip route show", device="cpu", device_name="Test CPU 9000",
    )
    values.update(overrides)
    return ProbeResult(**values)
