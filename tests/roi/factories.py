"""ProbeResults and load runs with round numbers, so ROI figures can be computed by hand in the tests."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from prunewatch.records.results import ProbeResult
from prunewatch.roi.measured import Window

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
WINDOW = Window(start=T0 - timedelta(days=1), end=T0 + timedelta(days=1))


def probe(probe_id: str = "tech-a", *, sensitivity: float = 0.5, inference_ms: float = 1000.0, ratio: float | None = 0.3,
          prompt_tokens: int = 100, completion_tokens: int = 50, minutes: float = 0.0, target: str = "embedded",
          model: str = "probe-llama", agreement: float | None = 0.9, version: int = 1) -> ProbeResult:
    """A successful probe; sensitivity 0 makes it a dense-baseline run."""
    return ProbeResult(
        target=target, model=model, probe_id=probe_id, probe_version=version, probe_hash="h" * 16,
        domain=probe_id.split("-")[0], status="ok", round_id="r" * 32, created_at=T0 + timedelta(minutes=minutes),
        sensitivity=sensitivity, pruning_ratio=ratio if sensitivity > 0 else 0.0, ratio_unit="linear_flops",
        ratio_source="measured", prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        inference_ms=inference_ms, tokens_per_s=completion_tokens / inference_ms * 1000,
        continuation_agreement=agreement if sensitivity > 0 else 1.0, perplexity_delta_pct=1.5 if sensitivity > 0 else 0.0)


def failed(probe_id: str = "tech-a", *, reason: str = "timeout", minutes: float = 0.0, target: str = "embedded") -> ProbeResult:
    return ProbeResult(target=target, model="probe-llama", probe_id=probe_id, probe_version=1, probe_hash="h" * 16,
                       domain=probe_id.split("-")[0], status="failed", round_id="r" * 32,
                       created_at=T0 + timedelta(minutes=minutes), failure_reason=reason, error_message="slow")


def measured_basis_results() -> list[ProbeResult]:
    """Two probes run pruned and dense, one pruned only, one failure.

    Per-probe means: A pruned 3200 ms / dense 4000 ms; B pruned 1800 ms / dense 2400 ms; C pruned
    only (1000 ms, not matched). Matched means: pruned 2500 ms, dense 3200 ms -> factor 0.78125.
    Pruned tokens: prompt mean (100+100+160+40)/4 = 100, completion 50. Ratios mean 0.3.
    Failure share 1/8 = 0.125.
    """
    return [
        probe("tech-a", inference_ms=3000, ratio=0.3, prompt_tokens=100),
        probe("tech-a", inference_ms=3400, ratio=0.3, prompt_tokens=100, minutes=1),
        probe("legal-b", inference_ms=1800, ratio=0.2, prompt_tokens=160, minutes=2),
        probe("finance-c", inference_ms=1000, ratio=0.4, prompt_tokens=40, minutes=3),
        probe("tech-a", sensitivity=0.0, inference_ms=4000, minutes=4),
        probe("legal-b", sensitivity=0.0, inference_ms=2000, minutes=5),
        probe("legal-b", sensitivity=0.0, inference_ms=2800, minutes=6),
        failed("finance-c", minutes=7),
    ]


# Aggregate tokens/s: pruning is faster alone, even at 2 clients, slower at 4 (as batching does to it).
DENSE = {1: 20.0, 2: 36.0, 4: 50.0}
PRUNED = {1: 25.0, 2: 36.0, 4: 40.0}


def load_row(clients: int, rate: float | None) -> dict[str, Any]:
    """One level as `prunewatch bench load` writes it (prunewatch/bench/load.py `summarise`)."""
    return {"clients": clients, "window_s": 30.0, "requests": 10, "finished": 9, "cut": 1, "unserved": 0, "errors": {},
            "tokens": 0 if rate is None else round(rate * 30), "aggregate_tokens_per_s": rate,
            "per_client_tokens_per_s": None if rate is None else rate / clients, "tpot_p50_ms": 50.0,
            "tpot_p99_ms": 80.0, "ttft_p50_ms": 200.0, "ttft_p99_ms": 300.0, "mean_decode_pruning_ratio": 0.0,
            "mean_batch_size": float(clients), "scaling_vs_1_client": 1.0}


def load_result(dense: dict[int, float | None] | None = None, pruned: dict[int, float | None] | None = None,
                **top: Any) -> dict[str, Any]:
    """A results file's content in the schema `prunewatch bench load` writes."""
    dense = DENSE if dense is None else dense
    pruned = PRUNED if pruned is None else pruned
    return {"created_at": "2026-12-01T10:00:00Z", "command": "prunewatch bench load --clients 1,2,4",
            "machine": {"device": "cpu", "cpu": "Test CPU 9000", "cpus": 2, "torch_threads": 2},
            "model": {"name": "SmolLM2-135M-Instruct", "path": "/models/SmolLM2-135M-Instruct"},
            "levels": sorted(dense), "window_s": 30.0, "max_tokens": 64, "threads": 2,
            "prompts": "63 held-out evaluation prompts, cycled", "server": "prunewatch serve", "method": {},
            "series": {"dense": [load_row(c, r) for c, r in sorted(dense.items())],
                       "default": [load_row(c, r) for c, r in sorted(pruned.items())]},
            "duration_s": 200.0, **top}


def write_load(tmp_path: Path, content: Any = None, name: str = "load.json") -> Path:
    """A results file in `tmp_path`: the default load run, or `content` as given."""
    path = tmp_path / name
    path.write_text(json.dumps(load_result() if content is None else content))
    return path
