"""The X-Pruning-* request headers (per-request overrides) and the response headers.

Request: `X-Pruning-Sensitivity` (0..1), `X-Pruning-Log-Level` (NONE, SUMMARY, DETAILED),
`X-Pruning-Blacklist` (comma-separated layer indices), `X-Pruning-Quality` (on / off: score the
answer against the dense model). A malformed value is the client's error: 400 with `param`
naming the header, never a silent fallback to the default. So is a header sent twice: which copy
wins differs between proxies and frameworks, so the server refuses to guess.

Response: `X-Pruning-Ratio`, `X-Pruning-Stats`
(`layers_bypassed=N,heads_gated=N,sparsity=F,total_tokens=N,prefill_ratio=F,decode_ratio=F`, plus
`agreement=F,nll=F` when quality was scored, `continuation_agreement=F,ppl_delta_pct=F` after a full check) and the latency breakdown
`X-Prunewatch-{Preprocessing,Inference,Postprocessing,Quality,Queue}-Ms`. A streamed response's headers are
sent before any token exists, so there the same numbers come only in the final SSE chunk.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Protocol

from prunewatch.engine.headers import (
    BLACKLIST,
    INFERENCE_MS,
    LOG_LEVEL,
    POSTPROCESSING_MS,
    PREPROCESSING_MS,
    QUALITY,
    QUALITY_MS,
    QUEUE_MS,
    RATIO,
    REQUEST_ID,
    SENSITIVITY,
    STATS,
)
from prunewatch.engine.settings import LogLevel
from prunewatch.engine.stats import RequestStats
from prunewatch.server.errors import APIError

RESPONSE_HEADERS = (RATIO, STATS, REQUEST_ID, PREPROCESSING_MS, INFERENCE_MS, POSTPROCESSING_MS, QUALITY_MS, QUEUE_MS)
REQUEST_HEADERS = (SENSITIVITY, LOG_LEVEL, BLACKLIST, QUALITY)
_SWITCH = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False}
# A plain decimal number; float() alone would also take "1_0" and non-ASCII digits. nan and inf
# parse, so that the range check names them ("must be within [0, 1], got nan").
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|[+-]?(?:nan|inf|infinity)",
                     re.ASCII | re.IGNORECASE)
_OWS = " \t"  # HTTP's optional whitespace; str.strip() would also drop Latin-1's NBSP and NEL
_SHOWN_CHARS = 40  # of a bad value echoed in an error message: enough to recognise it, not a reflection


class _MultiHeaders(Protocol):
    """Starlette's `Headers`: every value of a header, in the order it was sent."""

    def getlist(self, key: str) -> list[str]: ...


@dataclass(frozen=True)
class PruningRequest:
    """Per-request pruning overrides; None means the engine's configured default."""

    sensitivity: float | None = None
    layer_blacklist: tuple[int, ...] | None = None
    log_level: LogLevel | None = None
    quality: str = "off"  # score the answer against the dense model: "off", "on" or "full" (engine.quality)


def _bad(header: str, message: str) -> APIError:
    return APIError(400, f"{header}: {message}", param=header, code="invalid_header")


def _shown(value: str) -> str:
    """`repr` of a client's value, cut short: a 60 KB header must not come back in the error body."""
    if len(value) <= _SHOWN_CHARS:
        return repr(value)
    return f"{value[:_SHOWN_CHARS]!r}... ({len(value)} characters)"


def single_value(headers: _MultiHeaders, name: str) -> str | None:
    """The one value of header `name`, None when absent; a header sent twice is a 400."""
    values = headers.getlist(name)
    if len(values) > 1:
        raise _bad(name, f"sent {len(values)} times; send it once")
    return values[0] if values else None


def parse_sensitivity(value: str | None) -> float | None:
    if value is None:
        return None
    text = value.strip(_OWS)
    if not _NUMBER.fullmatch(text):
        raise _bad(SENSITIVITY, f"expected a number within [0, 1], got {_shown(value)}")
    sensitivity = float(text)  # cannot fail on a _NUMBER, however many digits it has
    if math.isnan(sensitivity) or not 0.0 <= sensitivity <= 1.0:
        shown = text if len(text) <= _SHOWN_CHARS else _shown(text)
        raise _bad(SENSITIVITY, f"must be within [0, 1], got {shown}")
    return sensitivity + 0.0  # "-0" is 0.0, not a -0.0 reported back in the stats


def parse_blacklist(value: str | None, num_layers: int) -> tuple[int, ...] | None:
    if value is None:
        return None
    layers = []
    index_digits = len(str(max(num_layers - 1, 0)))
    for part in value.split(","):
        part = part.strip(_OWS)
        if not part:
            continue
        if not (part.isascii() and part.isdigit()):  # rejects signs, "1.5" and non-ASCII digits
            raise _bad(BLACKLIST, f"expected comma-separated layer indices, got {_shown(part)}")
        digits = part.lstrip("0") or "0"  # int() counts leading zeros against its 4300-digit limit too
        if len(digits) > index_digits:  # out of range for sure, and maybe past what int() converts
            raise _bad(BLACKLIST, f"layer {_shown(part)} out of range; the model has layers 0..{num_layers - 1}")
        layers.append(int(digits))
    bad = sorted({i for i in layers if i >= num_layers})
    if bad:
        raise _bad(BLACKLIST, f"layer(s) {bad} out of range; the model has layers 0..{num_layers - 1}")
    return tuple(sorted(set(layers)))


def parse_log_level(value: str | None) -> LogLevel | None:
    if value is None:
        return None
    try:
        return LogLevel(value.strip(_OWS).upper())
    except ValueError:
        allowed = ", ".join(level.value for level in LogLevel)
        raise _bad(LOG_LEVEL, f"expected one of {allowed}, got {_shown(value)}") from None


def parse_quality(value: str | None) -> str:
    """X-Pruning-Quality: on (or true/1) scores the served answer, full adds the dense re-generation, off (false/0)."""
    if value is None:
        return "off"
    word = value.strip(_OWS).lower()
    if word == "full":
        return "full"
    switch = _SWITCH.get(word)
    if switch is None:
        raise _bad(QUALITY, f"expected on, full or off, got {_shown(value)}")
    return "on" if switch else "off"


def parse_pruning_headers(sensitivity: str | None, blacklist: str | None, log_level: str | None,
                          num_layers: int, quality: str | None = None) -> PruningRequest:
    """Validate every X-Pruning-* request header, or raise the 400 for the first bad one."""
    return PruningRequest(
        sensitivity=parse_sensitivity(sensitivity),
        layer_blacklist=parse_blacklist(blacklist, num_layers),
        log_level=parse_log_level(log_level),
        quality=parse_quality(quality),
    )


def parse_request_headers(headers: _MultiHeaders, num_layers: int) -> PruningRequest:
    """`parse_pruning_headers` over a request's headers, refusing any X-Pruning-* header sent twice."""
    sensitivity, log_level, blacklist, quality = (single_value(headers, name) for name in REQUEST_HEADERS)
    return parse_pruning_headers(sensitivity, blacklist, log_level, num_layers, quality)


def stats_header(stats: RequestStats) -> str:
    """`layers_bypassed=N,heads_gated=N,sparsity=F,total_tokens=N,prefill_ratio=F,decode_ratio=F`, then
    `agreement=F,nll=F` (the served answer scored against the dense model) when the request was scored and
    `continuation_agreement=F,ppl_delta_pct=F` after a full check; sparsity is activation sparsity."""
    header = (
        f"layers_bypassed={len(stats.layers_bypassed)},heads_gated={stats.heads_gated},"
        f"sparsity={round(stats.activation_sparsity, 4)!r},"
        f"total_tokens={stats.prompt_tokens + stats.completion_tokens},"
        f"prefill_ratio={stats.prefill_pruning_ratio!r},decode_ratio={stats.decode_pruning_ratio!r}"
    )
    quality = stats.quality
    if quality is not None:
        header += f",agreement={quality.reference_agreement!r},nll={quality.served_nll!r}"
        if quality.continuation_agreement is not None:
            header += (f",continuation_agreement={quality.continuation_agreement!r}"
                       f",ppl_delta_pct={quality.perplexity_delta_pct!r}")
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
