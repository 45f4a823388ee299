"""The X-Pruning-* request headers (per-request overrides) and the response headers.

Request: `X-Pruning-Sensitivity` (0..1), `X-Pruning-Log-Level` (NONE, SUMMARY, DETAILED),
`X-Pruning-Blacklist` (comma-separated layer indices), `X-Pruning-Quality` (on / off: score the
answer against the dense model). A malformed value is the client's error: 400 with `param`
naming the header, never a silent fallback to the default.

Response: `X-Pruning-Ratio`, `X-Pruning-Stats`
(`layers_bypassed=N,heads_gated=N,sparsity=F,total_tokens=N,prefill_ratio=F,decode_ratio=F`, plus
`agreement=F,ppl_delta_pct=F` when quality was scored) and the latency breakdown
`X-Prunewatch-{Preprocessing,Inference,Postprocessing,Quality,Queue}-Ms`. A streamed response's headers are
sent before any token exists, so there the same numbers come only in the final SSE chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.server.errors import APIError
from engine.settings import LogLevel
from engine.stats import RequestStats

SENSITIVITY = "X-Pruning-Sensitivity"
LOG_LEVEL = "X-Pruning-Log-Level"
BLACKLIST = "X-Pruning-Blacklist"
QUALITY = "X-Pruning-Quality"
RATIO = "X-Pruning-Ratio"
STATS = "X-Pruning-Stats"
REQUEST_ID = "X-Prunewatch-Request-Id"
PREPROCESSING_MS = "X-Prunewatch-Preprocessing-Ms"
INFERENCE_MS = "X-Prunewatch-Inference-Ms"
POSTPROCESSING_MS = "X-Prunewatch-Postprocessing-Ms"
QUALITY_MS = "X-Prunewatch-Quality-Ms"
QUEUE_MS = "X-Prunewatch-Queue-Ms"

RESPONSE_HEADERS = (RATIO, STATS, REQUEST_ID, PREPROCESSING_MS, INFERENCE_MS, POSTPROCESSING_MS, QUALITY_MS, QUEUE_MS)
_SWITCH = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False}


@dataclass(frozen=True)
class PruningRequest:
    """Per-request pruning overrides; None means the engine's configured default."""

    sensitivity: float | None = None
    layer_blacklist: tuple[int, ...] | None = None
    log_level: LogLevel | None = None
    quality: bool = False  # score the answer against the dense model


def _bad(header: str, message: str) -> APIError:
    return APIError(400, f"{header}: {message}", param=header, code="invalid_header")


def parse_sensitivity(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        sensitivity = float(value.strip())
    except ValueError:
        raise _bad(SENSITIVITY, f"expected a number within [0, 1], got {value!r}") from None
    if math.isnan(sensitivity) or not 0.0 <= sensitivity <= 1.0:
        raise _bad(SENSITIVITY, f"must be within [0, 1], got {value.strip()}")
    return sensitivity


def parse_blacklist(value: str | None, num_layers: int) -> tuple[int, ...] | None:
    if value is None:
        return None
    layers = []
    for part in value.split(","):
        part = part.strip()
        if not part:
            continue
        if not (part.isascii() and part.isdigit()):  # rejects signs, "1.5" and non-ASCII digits
            raise _bad(BLACKLIST, f"expected comma-separated layer indices, got {part!r}")
        layers.append(int(part))
    bad = sorted({i for i in layers if i >= num_layers})
    if bad:
        raise _bad(BLACKLIST, f"layer(s) {bad} out of range; the model has layers 0..{num_layers - 1}")
    return tuple(sorted(set(layers)))


def parse_log_level(value: str | None) -> LogLevel | None:
    if value is None:
        return None
    try:
        return LogLevel(value.strip().upper())
    except ValueError:
        allowed = ", ".join(level.value for level in LogLevel)
        raise _bad(LOG_LEVEL, f"expected one of {allowed}, got {value!r}") from None


def parse_quality(value: str | None) -> bool:
    if value is None:
        return False
    switch = _SWITCH.get(value.strip().lower())
    if switch is None:
        raise _bad(QUALITY, f"expected on or off, got {value!r}")
    return switch


def parse_pruning_headers(sensitivity: str | None, blacklist: str | None, log_level: str | None,
                          num_layers: int, quality: str | None = None) -> PruningRequest:
    """Validate every X-Pruning-* request header, or raise the 400 for the first bad one."""
    return PruningRequest(
        sensitivity=parse_sensitivity(sensitivity),
        layer_blacklist=parse_blacklist(blacklist, num_layers),
        log_level=parse_log_level(log_level),
        quality=parse_quality(quality),
    )


def stats_header(stats: RequestStats) -> str:
    """`layers_bypassed=N,heads_gated=N,sparsity=F,total_tokens=N,prefill_ratio=F,decode_ratio=F`,
    then `agreement=F,ppl_delta_pct=F` when the request was scored; sparsity is activation sparsity."""
    header = (
        f"layers_bypassed={len(stats.layers_bypassed)},heads_gated={stats.heads_gated},"
        f"sparsity={round(stats.activation_sparsity, 4)!r},"
        f"total_tokens={stats.prompt_tokens + stats.completion_tokens},"
        f"prefill_ratio={stats.prefill_pruning_ratio!r},decode_ratio={stats.decode_pruning_ratio!r}"
    )
    if stats.quality is not None:
        header += (f",agreement={stats.quality.token_agreement!r}"
                   f",ppl_delta_pct={stats.quality.perplexity_delta_pct!r}")
    return header


def response_headers(stats: RequestStats, queue_ms: float) -> dict[str, str]:
    return {
        RATIO: repr(stats.pruning_ratio),
        STATS: stats_header(stats),
        REQUEST_ID: stats.request_id,
        PREPROCESSING_MS: f"{stats.preprocessing_ms:.3f}",
        INFERENCE_MS: f"{stats.inference_ms:.3f}",
        POSTPROCESSING_MS: f"{stats.postprocessing_ms:.3f}",
        QUALITY_MS: f"{stats.quality_ms:.3f}",
        QUEUE_MS: f"{queue_ms:.3f}",
    }
