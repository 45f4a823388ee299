"""Targets over HTTP: prunewatch engines and plain OpenAI-compatible servers (vLLM, TGI, llama.cpp) as baselines.

A probe is one streamed `POST {base}/v1/chat/completions` (`stream_options.include_usage`). The
collector times the stream itself: time to the first content token and decode tokens/s (completion
tokens after the first over the time between first and last token), network included, recorded as
client_ttft_ms / client_decode_tokens_per_s next to whatever the server reports. A prunewatch engine
is asked for the target's sensitivity with `X-Pruning-Sensitivity` and sends its measured pruning
figures in the final chunk's `prunewatch` object (and the `X-Pruning-*` headers when not streamed).
A baseline server sends none of them: its ratio and engine-side timings are recorded as absent
(NULL), never as 0; its latency is what the collector measured. A server that ignores `stream`
and answers with one JSON body is read as such (no client TTFT then).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from prunewatch.collector.targets import ProbeCancelledError, ProbeTimeoutError, TargetError
from prunewatch.engine import headers
from prunewatch.probes import Probe
from prunewatch.records.results import ProbeResult

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
    "agreement": "reference_agreement",
    "nll": "served_nll",
    "continuation_agreement": "continuation_agreement",
    "ppl_delta_pct": "perplexity_delta_pct",
}
QUALITY_BODY_FIELDS = ("reference_tokens", "reference_nll", "divergence_at")
"""Figures of the body's `quality` object that have no X-Pruning-Stats key."""


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
    except ValueError as exc:
        raise TargetProtocolError(f"not a chat completion: {type(exc).__name__}: {str(exc)[:200]}") from None
    return observation_from_body(body, response.headers, configured_model=configured_model,
                                 requested_sensitivity=requested_sensitivity)


def observation_from_body(body: Any, headers: Mapping[str, str], *, configured_model: str,
                          requested_sensitivity: float | None) -> HttpObservation:
    """A chat completion body (and the response's pruning headers) as figures; absent ones stay None."""
    try:
        text = body["choices"][0]["message"]["content"] or ""
    except (KeyError, IndexError, TypeError) as exc:
        raise TargetProtocolError(f"not a chat completion: {type(exc).__name__}: {str(exc)[:200]}") from None
    usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
    stats = body.get("prunewatch") if isinstance(body.get("prunewatch"), dict) else {}
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
    reported_quality = stats.get("quality")
    quality = reported_quality if isinstance(reported_quality, dict) else {}
    body_figures = {"prefill_pruning_ratio": stats.get("prefill_pruning_ratio"),
                    "decode_pruning_ratio": stats.get("decode_pruning_ratio"),
                    **{name: quality.get(name) for name in ("reference_agreement", "served_nll",
                                                           "continuation_agreement", "perplexity_delta_pct")}}
    for key, name in STATS_HEADER_FIELDS.items():
        value = _float(body_figures[name])
        fields[name] = _float(header_stats.get(key)) if value is None else value
    for name in QUALITY_BODY_FIELDS:
        fields[name] = _int(quality.get(name)) if name != "reference_nll" else _float(quality.get(name))
    # The engine scored its own answer against its own weights run dense (X-Pruning-Quality).
    fields["quality_source"] = "engine" if fields["reference_agreement"] is not None else None
    for name, width in (("device", 16), ("device_name", 128)):  # where the engine measured its timings
        value = stats.get(name)
        fields[name] = (value.strip()[:width] or None) if isinstance(value, str) else None
    fields["matched_domain"] = stats.get("domain")
    fields["fallback_reason"] = stats.get("fallback_reason")
    fields["dram_source"] = stats.get("dram_source") if fields["dram_bytes_per_instruction"] is not None else None
    model = body.get("model") if isinstance(body.get("model"), str) and body.get("model") else configured_model
    return HttpObservation(model=model, text=text, fields=fields)


@dataclass
class StreamTiming:
    """When the content of a streamed answer arrived, on this client's clock (time.perf_counter)."""

    started: float
    first_content: float | None = None
    last_content: float | None = None
    content_chunks: int = 0

    def saw_content(self) -> None:
        now = time.perf_counter()
        if self.first_content is None:
            self.first_content = now
        self.last_content = now
        self.content_chunks += 1

    def ttft_ms(self) -> float | None:
        return None if self.first_content is None else round((self.first_content - self.started) * 1000, 3)

    def decode_tokens_per_s(self, completion_tokens: int | None) -> float | None:
        """Tokens after the first over the time from first to last content: None when that is not measurable."""
        if not completion_tokens or completion_tokens < 2 or self.first_content is None or self.last_content is None:
            return None
        span = self.last_content - self.first_content
        return round((completion_tokens - 1) / span, 3) if span > 0 else None


def read_event_stream(lines: Iterator[str], timing: StreamTiming,
                      cancel: threading.Event | None = None) -> dict[str, Any]:
    """Server-sent chat completion chunks folded into one completion body (text, usage, prunewatch, model).

    Content arrival is noted on `timing`; an in-band error (OpenAI's `{"error": ...}` event) raises
    TargetHTTPError as a server error; a stream that ends without `[DONE]` or any chunk is a protocol error.
    """
    pieces: list[str] = []
    final: dict[str, Any] = {}
    chunks = 0
    for line in lines:
        if cancel is not None and cancel.is_set():
            raise ProbeCancelledError("the answer was still streaming after the probe's timeout")
        if not line.startswith("data:"):
            continue  # comments, event names, keep-alive blank lines
        data = line[5:].strip()
        if data == "[DONE]":
            break
        try:
            chunk = json.loads(data)
        except ValueError:
            raise TargetProtocolError(f"a stream event is not JSON: {data[:200]}") from None
        if not isinstance(chunk, dict):
            raise TargetProtocolError(f"a stream event is not a JSON object: {data[:200]}")
        if isinstance(chunk.get("error"), dict):
            raise TargetHTTPError(500, str(chunk["error"].get("message") or chunk["error"])[:300])
        chunks += 1
        for key in ("model", "usage", "prunewatch"):
            if chunk.get(key):
                final[key] = chunk[key]
        choices = chunk.get("choices") if isinstance(chunk.get("choices"), list) else []
        delta = choices[0].get("delta") if choices and isinstance(choices[0], dict) else None
        content = delta.get("content") if isinstance(delta, dict) else None
        if isinstance(content, str) and content:
            timing.saw_content()
            pieces.append(content)
    if chunks == 0:
        raise TargetProtocolError("the stream ended without a chat completion chunk")
    final["choices"] = [{"message": {"content": "".join(pieces)}}]
    return final


class HttpTarget:
    """An engine behind an OpenAI-compatible HTTP API."""

    def __init__(self, *, name: str, base_url: str, model: str, kind: TargetKind = "prunewatch",
                 api_key: str | None = None, timeout_s: float = 30.0, sensitivity: float | None = None,
                 layer_blacklist: Sequence[int] | None = None, transport: httpx.BaseTransport | None = None,
                 quality: bool = True) -> None:
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
        self.quality = quality  # ask a prunewatch engine to score the answer against dense (off for baselines)
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

    def with_overrides(self, *, sensitivity: float | None = None, layer_blacklist: Sequence[int] | None = None,
                       quality: bool | None = None) -> HttpTarget:
        return HttpTarget(
            name=self.name, base_url=self.base_url, model=self.model, kind=self.kind, api_key=self._api_key,
            timeout_s=self.timeout_s, transport=self._transport,
            sensitivity=self.sensitivity if sensitivity is None else sensitivity,
            layer_blacklist=self.layer_blacklist if layer_blacklist is None else layer_blacklist,
            quality=self.quality if quality is None else quality)

    def pruning_headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self.kind == "prunewatch":
            if self.sensitivity is not None:
                headers[SENSITIVITY_HEADER] = repr(float(self.sensitivity))
            if self.layer_blacklist:
                headers[BLACKLIST_HEADER] = ",".join(str(i) for i in self.layer_blacklist)
            if self.quality:
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

    def stream_chat(self, messages: list[dict[str, str]], max_tokens: int,
                    cancel: threading.Event | None = None) -> HttpObservation:
        """One streamed chat completion, timed by this client (see the module docstring)."""
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}}
        path = "/v1/chat/completions"
        started = time.perf_counter()
        try:
            with self.client.stream("POST", path, json=body, headers=self.pruning_headers()) as response:
                if response.status_code >= 300:
                    response.read()
                    if response.status_code in (401, 403):
                        raise TargetAuthError(f"HTTP {response.status_code}: {_error_message(response)}")
                    raise TargetHTTPError(response.status_code, _error_message(response))
                if "text/event-stream" not in response.headers.get("content-type", ""):
                    response.read()  # the server ignored `stream`: one JSON body, no client TTFT
                    return observation_from_response(response, configured_model=self.model,
                                                     requested_sensitivity=self.sensitivity)
                timing = StreamTiming(started)
                final = read_event_stream(response.iter_lines(), timing, cancel)
                headers = response.headers
        except httpx.TimeoutException as exc:
            raise ProbeTimeoutError(f"POST {self.base_url}{path}: no answer within {self.timeout_s}s "
                                    f"({type(exc).__name__})") from None
        except httpx.TransportError as exc:
            raise TargetUnreachableError(f"POST {self.base_url}{path}: {type(exc).__name__}: {exc}") from None
        observation = observation_from_body(final, headers, configured_model=self.model,
                                            requested_sensitivity=self.sensitivity)
        tokens = observation.fields.get("completion_tokens") or timing.content_chunks
        observation.fields["client_ttft_ms"] = timing.ttft_ms()
        observation.fields["client_decode_tokens_per_s"] = timing.decode_tokens_per_s(tokens)
        return observation

    def run_probe(self, probe: Probe, cancel: threading.Event | None = None) -> HttpObservation:
        messages = ([{"role": "system", "content": probe.system}] if probe.system else []) + [
            {"role": "user", "content": probe.prompt}]
        observation = self.stream_chat(messages, probe.max_tokens, cancel)
        if cancel is not None and cancel.is_set():
            raise ProbeCancelledError(f"probe {probe.id} answered after its timeout")
        return observation

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
