"""Targets over HTTP: prunewatch engines and plain OpenAI-compatible servers (vLLM, TGI) as baselines.

A probe is one non-streamed `POST {base}/v1/chat/completions`. A prunewatch engine is asked for
the target's sensitivity with `X-Pruning-Sensitivity` and answers with its measured pruning
figures in the `X-Pruning-*` / `X-Prunewatch-*-Ms` headers and the body's `prunewatch` object.
A baseline server sends none of them: its ratio and engine-side timings are recorded as absent
(NULL), never as 0, and its only latency is the probe duration the collector measures itself.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

import httpx

from collector.targets import ProbeCancelledError, ProbeTimeoutError, TargetError
from engine import headers
from probes import Probe
from records.results import ProbeResult

TargetKind = Literal["prunewatch", "openai"]

SENSITIVITY_HEADER = headers.SENSITIVITY
BLACKLIST_HEADER = headers.BLACKLIST
QUALITY_HEADER = headers.QUALITY
RATIO_HEADER = headers.RATIO
STATS_HEADER = headers.STATS
MS_HEADERS = {  # header -> ProbeResult field
    headers.PREPROCESSING_MS: "preprocessing_ms",
    headers.INFERENCE_MS: "inference_ms",
    headers.POSTPROCESSING_MS: "postprocessing_ms",
    headers.QUALITY_MS: "quality_ms",
}
STATS_HEADER_FIELDS = {  # X-Pruning-Stats key -> ProbeResult field, read when the body lacks the figure
    "prefill_ratio": "prefill_pruning_ratio",
    "decode_ratio": "decode_pruning_ratio",
    "agreement": "token_agreement",
    "ppl_delta_pct": "perplexity_delta_pct",
}


class TargetUnreachableError(TargetError, ConnectionError):
    reason = "unreachable"


class TargetAuthError(TargetError):
    reason = "auth"


class TargetHTTPError(TargetError):
    """A non-2xx answer; the reason says whose fault it is."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        if status == 429:
            self.reason = "rate_limited"
        elif status >= 500:
            self.reason = "server_error"
        else:
            self.reason = "invalid_request"


class TargetProtocolError(TargetError):
    """The answer is not an OpenAI chat completion."""

    reason = "protocol"


def _float(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _int(value: Any) -> int | None:
    number = _float(value)
    return None if number is None else int(number)


def parse_stats_header(value: str | None) -> dict[str, float]:
    """`layers_bypassed=N,heads_gated=N,sparsity=F,total_tokens=N` as numbers; unknown keys kept."""
    out: dict[str, float] = {}
    for part in (value or "").split(","):
        key, sep, raw = part.partition("=")
        number = _float(raw) if sep else None
        if number is not None:
            out[key.strip()] = number
    return out


def _error_message(response: httpx.Response) -> str:
    try:
        error = response.json().get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:300]
    except (ValueError, AttributeError):
        pass
    return response.text[:300] or response.reason_phrase


@dataclass
class HttpObservation:
    """One chat completion's figures as the server reported them (None: not reported)."""

    model: str
    text: str
    fields: dict[str, Any]

    def to_result(self, *, target: str, probe: Probe, round_id: str, duration_ms: float) -> ProbeResult:
        return ProbeResult(
            target=target, model=self.model, probe_id=probe.id, probe_version=probe.version,
            probe_hash=probe.content_hash, domain=probe.domain, status="ok", round_id=round_id,
            duration_ms=duration_ms, output_text=self.text, **self.fields,
        )


def observation_from_response(response: httpx.Response, *, configured_model: str,
                              requested_sensitivity: float | None) -> HttpObservation:
    """Read body, pruning headers and the `prunewatch` body object; absent figures stay None."""
    try:
        body = response.json()
        text = body["choices"][0]["message"]["content"] or ""
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise TargetProtocolError(f"not a chat completion: {type(exc).__name__}: {str(exc)[:200]}") from None
    usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
    stats = body.get("prunewatch") if isinstance(body.get("prunewatch"), dict) else {}
    headers = response.headers
    header_stats = parse_stats_header(headers.get(STATS_HEADER))
    ratio = _float(stats.get("pruning_ratio"))
    if ratio is None:
        ratio = _float(headers.get(RATIO_HEADER))
    fields: dict[str, Any] = {
        "prompt_tokens": _int(usage.get("prompt_tokens")),
        "completion_tokens": _int(usage.get("completion_tokens")),
        "pruning_ratio": ratio,
    }
    if ratio is not None:  # only an engine that measured a ratio says how
        fields["ratio_unit"] = stats.get("ratio_unit")
        fields["ratio_source"] = stats.get("ratio_source") or "measured"
        sensitivity = _float(stats.get("sensitivity"))
        fields["sensitivity"] = requested_sensitivity if sensitivity is None else sensitivity
    for header, name in MS_HEADERS.items():
        value = _float(stats.get(name))
        fields[name] = _float(headers.get(header)) if value is None else value
    for name in ("ttft_ms", "tokens_per_s", "decode_tokens_per_s", "domain_confidence",
                 "dram_bytes_per_instruction"):
        fields[name] = _float(stats.get(name))
    for name in ("executed_flops", "dense_flops", "layers_total", "peak_memory_bytes"):
        fields[name] = _int(stats.get(name))
    bypassed = stats.get("layers_bypassed")
    fields["layers_bypassed"] = [int(i) for i in bypassed] if isinstance(bypassed, list) else None
    heads = stats.get("heads_gated", header_stats.get("heads_gated"))
    fields["heads_gated"] = _int(heads)
    fields["activation_sparsity"] = _float(stats.get("sparsity", header_stats.get("sparsity")))
    quality = stats.get("quality") if isinstance(stats.get("quality"), dict) else {}
    body_figures = {"prefill_pruning_ratio": stats.get("prefill_pruning_ratio"),
                    "decode_pruning_ratio": stats.get("decode_pruning_ratio"),
                    "token_agreement": quality.get("token_agreement"),
                    "perplexity_delta_pct": quality.get("perplexity_delta_pct")}
    for key, name in STATS_HEADER_FIELDS.items():
        value = _float(body_figures[name])
        fields[name] = _float(header_stats.get(key)) if value is None else value
    for name, width in (("device", 16), ("device_name", 128)):  # where the engine measured its timings
        value = stats.get(name)
        fields[name] = (value.strip()[:width] or None) if isinstance(value, str) else None
    fields["matched_domain"] = stats.get("domain")
    fields["fallback_reason"] = stats.get("fallback_reason")
    fields["dram_source"] = stats.get("dram_source") if fields["dram_bytes_per_instruction"] is not None else None
    model = body.get("model") if isinstance(body.get("model"), str) and body.get("model") else configured_model
    return HttpObservation(model=model, text=text, fields=fields)


class HttpTarget:
    """An engine behind an OpenAI-compatible HTTP API."""

    def __init__(self, *, name: str, base_url: str, model: str, kind: TargetKind = "prunewatch",
                 api_key: str | None = None, timeout_s: float = 30.0, sensitivity: float | None = None,
                 layer_blacklist: Sequence[int] | None = None, transport: httpx.BaseTransport | None = None) -> None:
        if kind not in ("prunewatch", "openai"):
            raise ValueError(f"kind must be 'prunewatch' or 'openai', got {kind!r}")
        if kind == "openai" and (sensitivity is not None or layer_blacklist):
            raise ValueError("a baseline (openai) target does not prune: sensitivity and blacklist do not apply")
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.kind = kind
        self.timeout_s = timeout_s
        self.sensitivity = sensitivity
        self.layer_blacklist = None if layer_blacklist is None else sorted(set(layer_blacklist))
        self._api_key = api_key
        self._transport = transport
        self._client: httpx.Client | None = None  # shared: httpx clients are thread-safe, connections pooled
        self._client_lock = threading.Lock()

    def __repr__(self) -> str:  # never shows the key
        return f"HttpTarget(name={self.name!r}, kind={self.kind!r}, base_url={self.base_url!r}, model={self.model!r})"

    @property
    def client(self) -> httpx.Client:
        with self._client_lock:
            if self._client is None:
                headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
                self._client = httpx.Client(
                    base_url=self.base_url, headers=headers, transport=self._transport,
                    timeout=httpx.Timeout(self.timeout_s, connect=min(self.timeout_s, 10.0)))
            return self._client

    def with_overrides(self, *, sensitivity: float | None = None,
                       layer_blacklist: Sequence[int] | None = None) -> "HttpTarget":
        return HttpTarget(
            name=self.name, base_url=self.base_url, model=self.model, kind=self.kind, api_key=self._api_key,
            timeout_s=self.timeout_s, transport=self._transport,
            sensitivity=self.sensitivity if sensitivity is None else sensitivity,
            layer_blacklist=self.layer_blacklist if layer_blacklist is None else layer_blacklist)

    def pruning_headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self.kind == "prunewatch":
            if self.sensitivity is not None:
                headers[SENSITIVITY_HEADER] = repr(float(self.sensitivity))
            if self.layer_blacklist:
                headers[BLACKLIST_HEADER] = ",".join(str(i) for i in self.layer_blacklist)
            headers[QUALITY_HEADER] = "on"  # every probe is scored against the dense model
        return headers

    def request(self, method: str, path: str, *, json_body: Mapping[str, Any] | None = None,
                headers: Mapping[str, str] | None = None) -> httpx.Response:
        """One HTTP call with failures mapped to TargetError reasons; non-2xx answers are returned."""
        try:
            return self.client.request(method, path, json=json_body, headers=dict(headers or {}))
        except httpx.TimeoutException as exc:
            raise ProbeTimeoutError(f"{method} {self.base_url}{path}: no answer within {self.timeout_s}s "
                                    f"({type(exc).__name__})") from None
        except httpx.TransportError as exc:
            raise TargetUnreachableError(f"{method} {self.base_url}{path}: {type(exc).__name__}: {exc}") from None

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> httpx.Response:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                "stream": False}
        response = self.request("POST", "/v1/chat/completions", json_body=body, headers=self.pruning_headers())
        if response.status_code in (401, 403):
            raise TargetAuthError(f"HTTP {response.status_code}: {_error_message(response)}")
        if response.status_code >= 300:
            raise TargetHTTPError(response.status_code, _error_message(response))
        return response

    def run_probe(self, probe: Probe, cancel: threading.Event | None = None) -> HttpObservation:
        messages = ([{"role": "system", "content": probe.system}] if probe.system else []) + [
            {"role": "user", "content": probe.prompt}]
        response = self.chat(messages, probe.max_tokens)
        if cancel is not None and cancel.is_set():
            raise ProbeCancelledError(f"probe {probe.id} answered after its timeout")
        return observation_from_response(response, configured_model=self.model,
                                         requested_sensitivity=self.sensitivity)

    def list_models(self) -> list[str]:
        """Model ids of GET /v1/models (doctor's "model listed" check)."""
        response = self.request("GET", "/v1/models")
        if response.status_code in (401, 403):
            raise TargetAuthError(f"HTTP {response.status_code}: {_error_message(response)}")
        if response.status_code >= 300:
            raise TargetHTTPError(response.status_code, _error_message(response))
        try:
            return [str(m["id"]) for m in response.json()["data"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise TargetProtocolError(f"GET /v1/models is not a model list: {exc}") from None

    def close(self) -> None:
        with self._client_lock:
            if self._client is not None:
                self._client.close()
                self._client = None
