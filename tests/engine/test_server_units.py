"""Unit tests of the HTTP API's parts that need no model: settings, auth, headers, admission."""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import logging
import math
import threading
import time
from dataclasses import replace

import pytest
from pydantic import ValidationError
from starlette.datastructures import Headers

from prunewatch.collector.http_target import parse_stats_header
from prunewatch.engine.settings import LogLevel
from prunewatch.engine.stats import QualityReport, RequestStats
from prunewatch.server.admission import AdmissionQueue, QueueFullError
from prunewatch.server.auth import ApiKeyAuth, bearer_token, read_keys_file
from prunewatch.server.errors import APIError, _loc
from prunewatch.server.middleware import BodyLimitMiddleware, endpoint_label
from prunewatch.server.pruning_headers import (
    PruningRequest,
    parse_blacklist,
    parse_log_level,
    parse_quality,
    parse_request_headers,
    parse_sensitivity,
    stats_header,
)
from prunewatch.server.redaction import (
    QuerySecretsFilter,
    has_secret_param,
    install_log_redaction,
    redact_query,
)
from prunewatch.server.settings import ServerSettings

# -- settings -----------------------------------------------------------------------------------


def test_settings_defaults_and_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PRUNEWATCH_API_KEYS", raising=False)
    settings = ServerSettings()
    assert (settings.host, settings.port, settings.queue_depth, settings.workers) == ("127.0.0.1", 8000, 64, 8)
    assert settings.api_keys == ()
    with pytest.raises(ValidationError, match="queue_depth"):
        ServerSettings(queue_depth=0)
    with pytest.raises(ValidationError, match="default_max_tokens \\(32\\) exceeds max_tokens_limit \\(16\\)"):
        ServerSettings(default_max_tokens=32, max_tokens_limit=16)


def test_settings_read_keys_from_environment_and_mask_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRUNEWATCH_API_KEYS", "alpha-secret, beta-secret,,")
    monkeypatch.setenv("API_KEYS", "not-ours")  # a generic variable must not be picked up
    monkeypatch.setenv("PRUNEWATCH_SERVER_QUEUE_DEPTH", "5")
    settings = ServerSettings()
    assert [k.get_secret_value() for k in settings.api_keys] == ["alpha-secret", "beta-secret"]
    assert settings.queue_depth == 5
    shown = repr(settings) + str(settings) + settings.model_dump_json()
    assert "alpha-secret" not in shown and "beta-secret" not in shown


def test_settings_reject_a_missing_keys_file(tmp_path) -> None:
    with pytest.raises(ValidationError, match="API keys file not found"):
        ServerSettings(keys_file=tmp_path / "absent.txt")


# -- auth ---------------------------------------------------------------------------------------


def test_keys_file_and_env_keys_are_merged_and_only_hashes_are_kept(tmp_path) -> None:
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text("# team keys\nfile-key-1\n\n  file-key-2  # rotated 2024\n")
    assert read_keys_file(keys_file) == ["file-key-1", "file-key-2"]
    auth = ApiKeyAuth.from_settings(ServerSettings(api_keys=["env-key"], keys_file=keys_file))
    assert auth.key_count == 3 and repr(auth) == "ApiKeyAuth(keys=3)"
    assert auth._digests == tuple(sorted(hashlib.sha256(k.encode()).digest()
                                         for k in ("env-key", "file-key-1", "file-key-2")))
    for key in ("env-key", "file-key-1", "file-key-2"):
        assert auth.is_authorized(f"Bearer {key}")
    assert not auth.is_authorized("Bearer file-key-3")
    assert not auth.is_authorized("Basic env-key")
    assert not auth.is_authorized(None)


def test_bearer_token_parsing() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer   abc ") == "abc"
    assert bearer_token("Bearer") is None
    assert bearer_token("Token abc") is None
    assert bearer_token("") is None


def test_auth_is_off_without_keys() -> None:
    auth = ApiKeyAuth([])
    assert not auth.enabled and auth.is_authorized(None)


# -- pruning headers ----------------------------------------------------------------------------


def test_sensitivity_header() -> None:
    assert parse_sensitivity(None) is None
    assert parse_sensitivity(" 0 ") == 0.0 and parse_sensitivity("1") == 1.0 and parse_sensitivity("0.25") == 0.25
    for bad, message in [("1.5", "X-Pruning-Sensitivity: must be within [0, 1], got 1.5"),
                         ("nan", "X-Pruning-Sensitivity: must be within [0, 1], got nan"),
                         ("-0.1", "X-Pruning-Sensitivity: must be within [0, 1], got -0.1"),
                         ("half", "X-Pruning-Sensitivity: expected a number within [0, 1], got 'half'")]:
        with pytest.raises(APIError) as caught:
            parse_sensitivity(bad)
        assert caught.value.status_code == 400
        assert caught.value.body() == {"error": {"message": message, "type": "invalid_request_error",
                                                 "param": "X-Pruning-Sensitivity", "code": "invalid_header"}}


def test_blacklist_header() -> None:
    assert parse_blacklist(None, 12) is None
    assert parse_blacklist("", 12) == ()
    assert parse_blacklist("5, 1,5,", 12) == (1, 5)
    with pytest.raises(APIError, match=r"layer\(s\) \[12, 40\] out of range; the model has layers 0..11"):
        parse_blacklist("40,12,3", 12)
    for bad in ("-1", "1.5", "a", "١"):  # the last is an Arabic-Indic digit: not an ASCII layer index
        with pytest.raises(APIError, match="expected comma-separated layer indices"):
            parse_blacklist(bad, 12)


def test_log_level_header() -> None:
    assert parse_log_level("detailed") == LogLevel.DETAILED
    assert parse_log_level(None) is None
    with pytest.raises(APIError, match="expected one of NONE, SUMMARY, DETAILED, got 'LOUD'"):
        parse_log_level("LOUD")


def test_stats_header_format() -> None:
    stats = RequestStats(
        request_id="r", model="m", device="cpu", dtype="float32", prompt_tokens=140, completion_tokens=16,
        preprocessing_ms=1.0, inference_ms=2.0, postprocessing_ms=0.5, ttft_ms=1.5, decode_tokens_per_s=1.0,
        tokens_per_s=1.0, sensitivity=0.5, pruning_ratio=0.3, executed_flops=7, dense_flops=10,
        layers_bypassed=[2, 5, 7], heads_gated=12, activation_sparsity=0.41, prefill_pruning_ratio=0.25,
        decode_pruning_ratio=0.5,
    )
    assert stats_header(stats) == ("layers_bypassed=3,heads_gated=12,sparsity=0.41,total_tokens=156,"
                                   "prefill_ratio=0.25,decode_ratio=0.5")
    served = replace(stats, quality=QualityReport(reference_agreement=0.875, reference_tokens=16, served_nll=1.25))
    assert stats_header(served).endswith(",decode_ratio=0.5,agreement=0.875,nll=1.25")
    full = replace(stats, quality=QualityReport(
        reference_agreement=0.875, reference_tokens=16, served_nll=1.25, continuation_agreement=0.9375,
        dense_perplexity=3.0, pruned_perplexity=3.1, perplexity_delta_pct=3.3333, continuation_tokens=16))
    assert stats_header(full).endswith(",agreement=0.875,nll=1.25,continuation_agreement=0.9375,ppl_delta_pct=3.3333")
    assert parse_stats_header(stats_header(full)) == {
        "layers_bypassed": 3, "heads_gated": 12, "sparsity": 0.41, "total_tokens": 156, "prefill_ratio": 0.25,
        "decode_ratio": 0.5, "agreement": 0.875, "nll": 1.25, "continuation_agreement": 0.9375,
        "ppl_delta_pct": 3.3333}  # what the collector reads back


@pytest.mark.parametrize("value, expected", [(None, "off"), ("on", "on"), ("ON", "on"), ("off", "off"),
                                             (" true ", "on"), ("0", "off"), ("full", "full"), (" FULL", "full")])
def test_quality_header_is_off_on_or_full(value, expected) -> None:
    assert parse_quality(value) == expected


def test_quality_header_rejects_anything_else() -> None:
    with pytest.raises(APIError) as caught:
        parse_quality("maybe")
    assert (caught.value.status_code, caught.value.body()["error"]["param"]) == (400, "X-Pruning-Quality")


def test_absurd_header_values_are_400s_that_quote_only_their_start() -> None:
    """Past int()'s 4300 digits, a layer index is out of range without being converted."""
    with pytest.raises(APIError) as caught:
        parse_blacklist("9" * 5000, 12)
    assert caught.value.message == ("X-Pruning-Blacklist: layer '" + "9" * 40 + "'... (5000 characters) out of range; "
                                    "the model has layers 0..11")
    assert parse_blacklist("0" * 5000 + "3, 011", 12) == (3, 11)  # leading zeros are still the layer
    with pytest.raises(APIError, match=r"must be within \[0, 1\], got '9{40}'\.\.\. \(5000 characters\)$"):
        parse_sensitivity("9" * 5000)
    with pytest.raises(APIError, match="got 1e999$"):
        parse_sensitivity("1e999")
    for bad in ("1_0", "0_0", "0x1", "½", "0.5\xa0", "1e", "--1"):  # float() takes the first two
        with pytest.raises(APIError, match="expected a number within"):
            parse_sensitivity(bad)
    zero = parse_sensitivity("-0")
    assert zero == 0.0 and math.copysign(1.0, zero) == 1.0
    assert parse_sensitivity("1e-400") == 0.0 and parse_sensitivity("\t.5 ") == 0.5
    with pytest.raises(APIError, match=r"got 'x{40}'\.\.\. \(100 characters\)$"):
        parse_log_level("x" * 100)
    with pytest.raises(APIError, match=r"got 'on\\xa0'"):  # only HTTP's own whitespace is stripped
        parse_quality("on\xa0")


def test_a_pruning_header_sent_twice_is_refused() -> None:
    def headers(*pairs: tuple[str, str]) -> Headers:
        return Headers(raw=[(name.encode(), value.encode("latin-1")) for name, value in pairs])

    assert parse_request_headers(headers(("x-pruning-sensitivity", "0.5"), ("x-pruning-quality", "on")), 12) == (
        PruningRequest(sensitivity=0.5, quality="on"))
    for name, second in [("x-pruning-quality", "on"), ("x-pruning-quality", "off"), ("x-pruning-blacklist", "")]:
        with pytest.raises(APIError) as caught:
            parse_request_headers(headers(("x-pruning-sensitivity", "0.5"), (name, "on"), (name, second)), 12)
        header = "X-Pruning-Quality" if "quality" in name else "X-Pruning-Blacklist"
        assert (caught.value.status_code, caught.value.body()) == (400, {"error": {
            "message": f"{header}: sent 2 times; send it once", "type": "invalid_request_error", "param": header,
            "code": "invalid_header"}})


def test_error_param_names_the_client_field_not_pydantic_tags() -> None:
    assert _loc(("body", "requests", 0, "/v1/completions", "custom_id")) == "requests.0.custom_id"
    assert _loc(("body", "messages", 0, "content", "list[TextPart]", 0, "text")) == "messages.0.content.0.text"


# -- log redaction ------------------------------------------------------------------------------


def test_query_secrets_are_redacted() -> None:
    assert redact_query("/v1/models?api_key=sk-1&model=m") == "/v1/models?api_key=[REDACTED]&model=m"
    assert redact_query("/a?KEY=1;access_token=2&q=3&api%5Fkey=4&x-api-key=5") == (
        "/a?KEY=[REDACTED];access_token=[REDACTED]&q=3&api%5Fkey=[REDACTED]&x-api-key=[REDACTED]")
    assert redact_query("key=value, but no query string") == "key=value, but no query string"
    assert has_secret_param(b"model=m&apikey=") and has_secret_param("Token=x")
    assert not has_secret_param(b"model=m&q=key") and not has_secret_param(b"")
    # A configured key is a secret under any name, encoded or not; other values are left alone.
    is_key = {"sk-live"}.__contains__
    assert redact_query("/v1/models?x=sk-live&y=sk-other", is_key) == "/v1/models?x=[REDACTED]&y=sk-other"
    assert redact_query("/v1/models?x=sk%2Dlive", is_key) == "/v1/models?x=[REDACTED]"
    assert has_secret_param(b"x=sk-live", is_key) and not has_secret_param(b"x=sk-other", is_key)


def test_the_log_filter_rewrites_uvicorn_access_lines_and_is_installed_once() -> None:
    access = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "GET", "/v1/models?key=sk-1&n=2", "1.1", 401), None)
    assert QuerySecretsFilter().filter(access)
    assert access.getMessage() == '127.0.0.1:5 - "GET /v1/models?key=[REDACTED]&n=2 HTTP/1.1" 401'
    assert access.args[4] == 401  # uvicorn's AccessFormatter unpacks the five arguments
    plain = logging.LogRecord("prunewatch.server", logging.INFO, __file__, 1, "GET /x?token=abc", None, None)
    QuerySecretsFilter().filter(plain)
    assert plain.getMessage() == "GET /x?token=[REDACTED]"
    name = "prunewatch.test.redaction"
    install_log_redaction([name])
    install_log_redaction([name])
    assert [type(f) for f in logging.getLogger(name).filters] == [QuerySecretsFilter]


# -- request body limit -------------------------------------------------------------------------


def test_body_limit_hands_the_app_the_whole_body_and_answers_413_past_it() -> None:
    """Chunked (no Content-Length) or not, the app gets the body in one piece or never runs."""
    received: list[dict] = []

    async def app(scope, receive, send) -> None:
        received.extend([await receive(), await receive()])  # the body, then the client's disconnect
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    def run(chunks: list[bytes], headers: list[tuple[bytes, bytes]] | None = None,
            disconnect_after: int | None = None) -> list[dict]:
        incoming = [{"type": "http.request", "body": c, "more_body": True} for c in chunks[:disconnect_after]]
        if disconnect_after is None:
            incoming[-1]["more_body"] = False
        incoming += [{"type": "http.disconnect"}] * 2
        sent: list[dict] = []

        async def receive() -> dict:
            return incoming.pop(0)

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/", "headers": headers or []}
        asyncio.run(BodyLimitMiddleware(app, max_bytes=10)(scope, receive, send))
        return sent

    assert run([b"12345", b"", b"67890"])[0]["status"] == 200
    assert received == [{"type": "http.request", "body": b"1234567890", "more_body": False},
                        {"type": "http.disconnect"}]
    received.clear()
    for refused in (run([b"123456", b"78901"]), run([b"1"], [(b"content-length", b"9" * 5000)])):
        assert refused[0]["status"] == 413
        assert json.loads(refused[1]["body"])["error"]["code"] == "request_too_large"
    assert received == []
    run([b"123", b"45"], disconnect_after=1)  # the client leaves mid-body: the app is told, and answers
    assert received == [{"type": "http.disconnect"}] * 2


def test_endpoint_label_is_bounded() -> None:
    assert endpoint_label("/v1/chat/completions") == "/v1/chat/completions"
    assert endpoint_label("/v1/models/probe-llama") == "/v1/models/{model}"
    assert endpoint_label("/wp-admin.php") == "other"


# -- admission ----------------------------------------------------------------------------------


def test_admission_is_bounded_all_or_nothing_and_released() -> None:
    seen: list[int] = []
    queue = AdmissionQueue(depth=3, workers=1, on_change=seen.append)
    try:
        first = queue.admit(2)
        with pytest.raises(QueueFullError) as caught:
            queue.admit(2)  # only one slot left: none are taken
        assert caught.value.retry_after_s == 1  # nothing finished yet: no service-time estimate
        assert str(caught.value) == ("The server's request queue is full (3 requests waiting or running); "
                                     "retry after 1 s.")
        assert queue.in_flight == 2
        last = queue.admit(1)
        for slot in first + last + first:  # releasing twice is harmless
            slot.release()
        assert queue.in_flight == 0
        assert seen == [2, 3, 2, 1, 0]
    finally:
        queue.close()


def test_retry_after_follows_the_service_time() -> None:
    queue = AdmissionQueue(depth=4, workers=2)
    try:
        queue._observe_service(3.0)
        queue.admit(4)
        assert queue.retry_after_s() == 6  # 3 s each, 4 admitted, 2 at a time
    finally:
        queue.close()


_REQUEST = contextvars.ContextVar("request", default=None)


def test_jobs_run_in_isolated_contexts_and_release_their_slots() -> None:
    """Two interleaved jobs each set a ContextVar (as the engine does) and never see the other's."""
    queue = AdmissionQueue(depth=2, workers=2)
    both_started = threading.Barrier(2, timeout=5)

    def job(name: str):
        def run():
            token = _REQUEST.set(name)
            both_started.wait()
            try:
                for step in range(5):
                    time.sleep(0.005)
                    yield (name, step, _REQUEST.get())
            finally:
                _REQUEST.reset(token)
        return run

    async def main() -> list[list[tuple[str, int, str]]]:
        slots = queue.admit(2)
        jobs = [queue.start(slot, job(name)) for slot, name in zip(slots, ("a", "b"))]

        async def collect(j):
            return [item async for item in j.items()]

        out = await asyncio.gather(*(collect(j) for j in jobs))
        for j in jobs:
            await asyncio.wrap_future(j.future)
        return out

    try:
        a, b = asyncio.run(main())
        assert a == [("a", i, "a") for i in range(5)]
        assert b == [("b", i, "b") for i in range(5)]
        assert queue.in_flight == 0
        assert _REQUEST.get() is None
    finally:
        queue.close()


def test_a_failing_job_raises_in_the_reader_and_frees_its_slot() -> None:
    queue = AdmissionQueue(depth=1)

    def broken():
        yield 1
        raise ValueError("boom")

    async def main() -> list[int]:
        job = queue.start(queue.admit()[0], broken)
        got = []
        with pytest.raises(ValueError, match="boom"):
            async for item in job.items():
                got.append(item)
        await asyncio.wrap_future(job.future)
        return got

    try:
        assert asyncio.run(main()) == [1]
        assert queue.in_flight == 0
    finally:
        queue.close()


def test_the_slot_is_free_before_the_reader_sees_the_end() -> None:
    """A response is sent when its reader sees the end; a client reading the queue gauge right after
    must not find its own request still counted. The worker is held back after its job returns, so
    a slot released only when the worker's future completes would still be taken here."""
    queue = AdmissionQueue(depth=1)
    submit = queue.threads.submit

    def slow_to_finish(fn):
        def run():
            fn()
            time.sleep(0.3)
        return submit(run)

    queue.threads.submit = slow_to_finish  # type: ignore[method-assign]

    async def main() -> tuple[list[int], int]:
        job = queue.start(queue.admit()[0], lambda: iter([1, 2]))
        got = [item async for item in job.items()]
        in_flight_at_end = queue.in_flight
        await asyncio.wrap_future(job.future)
        return got, in_flight_at_end

    try:
        assert asyncio.run(main()) == ([1, 2], 0)
    finally:
        queue.close()


def test_leaving_early_stops_the_worker() -> None:
    queue = AdmissionQueue(depth=1)
    produced: list[int] = []

    def endless():
        for i in range(10_000):
            produced.append(i)
            time.sleep(0.001)
            yield i

    async def main() -> None:
        job = queue.start(queue.admit()[0], endless)
        async for item in job.items():
            if item == 2:
                break
        await asyncio.wrap_future(job.future)

    try:
        asyncio.run(main())
        assert len(produced) < 100
        assert queue.in_flight == 0
    finally:
        queue.close()
