"""The engine's HTTP API, driven over real sockets by the `openai` SDK, httpx and schemathesis.

One engine (the bundled probe model) is loaded per module; every figure the server reports is
compared with a direct `engine.generate` call on the same input, so the tests prove the numbers
travel intact, not merely that they are present. Generations are kept to a few tokens.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from prunewatch.engine.hardware import processor_name
from prunewatch.engine.pruning_engine import PruningEngine
from prunewatch.server import ServerSettings, build_engine, create_app, serve_in_background
from prunewatch.server import pruning_headers as ph

MODEL_DIR = Path(__file__).parents[2] / "prunewatch" / "engine" / "models" / "probe-llama"
API_KEY = "sk-prunewatch-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_TOKENS = 6
CHAT = [{"role": "system", "content": "You are a Linux system administrator."},
        {"role": "user", "content": "How do you show the routing table of a Debian server?"}]
PROMPT = "Explain why decoding at batch size one is limited by memory bandwidth."


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> PruningEngine:
    if not (MODEL_DIR / "config.json").is_file():
        pytest.fail(f"the bundled probe model is missing at {MODEL_DIR}; build it with `prunewatch build-model`")
    return build_engine(MODEL_DIR, sensitivity=0.5, device="cpu",
                        calibration_dir=tmp_path_factory.mktemp("calibration"))


def settings(**overrides: Any) -> ServerSettings:
    # One worker: requests run one at a time, so each answer's stats are those of its direct run (requests that
    # share decode steps split the steps' work: tests/engine/test_batching.py).
    values: dict[str, Any] = dict(api_keys=[API_KEY], queue_depth=8, workers=1, max_prompt_tokens=200,
                                  max_tokens_limit=16, default_max_tokens=4, max_batch_size=4,
                                  max_body_bytes=64 * 1024)
    values.update(overrides)
    return ServerSettings(**values)


@pytest.fixture(scope="module")
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture(scope="module")
def app(engine: PruningEngine, registry: CollectorRegistry):
    return create_app(engine, settings(), registry=registry)


@pytest.fixture(scope="module")
def base_url(app) -> Iterator[str]:
    with serve_in_background(app) as url:
        yield url


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def sdk(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def error(message: str, type_: str = "invalid_request_error", param: str | None = None,
          code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def assert_same_stats(served: dict[str, Any], direct) -> None:
    """The server's `prunewatch` block carries the engine's own measured numbers."""
    stats = direct.stats
    assert served["pruning_ratio"] == stats.pruning_ratio
    assert served["executed_flops"] == stats.executed_flops
    assert served["dense_flops"] == stats.dense_flops
    assert served["layers_bypassed"] == stats.layers_bypassed
    assert served["sensitivity"] == stats.sensitivity
    assert served["domain"] == stats.domain
    assert served["total_tokens"] == stats.prompt_tokens + stats.completion_tokens
    assert (served["ratio_unit"], served["ratio_source"]) == ("linear_flops", "measured")
    # Where the timings were measured: the type, and the model name a collector stores with the result.
    assert served["device"] == stats.device and served["device_name"] == processor_name() is not None


# -- the openai SDK -----------------------------------------------------------------------------


def test_sdk_chat_reports_pruning_in_headers_and_body(sdk: openai.OpenAI, engine: PruningEngine) -> None:
    raw = sdk.chat.completions.with_raw_response.create(model=engine.name, messages=CHAT, max_tokens=MAX_TOKENS)
    chat = raw.parse()
    direct = engine.generate(messages=CHAT, max_new_tokens=MAX_TOKENS)
    stats = direct.stats
    assert stats.pruning_ratio > 0 and stats.activation_sparsity > 0, "the default sensitivity must prune something"

    assert chat.choices[0].message.content == direct.text
    assert chat.choices[0].finish_reason == stats.finish_reason
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens) == (
        stats.prompt_tokens, stats.completion_tokens, stats.prompt_tokens + stats.completion_tokens)
    assert float(raw.headers["X-Pruning-Ratio"]) == stats.pruning_ratio
    assert raw.headers["X-Pruning-Stats"] == (
        f"layers_bypassed={len(stats.layers_bypassed)},heads_gated={stats.heads_gated},"
        f"sparsity={round(stats.activation_sparsity, 4)!r},total_tokens={stats.prompt_tokens + stats.completion_tokens},"
        f"prefill_ratio={stats.prefill_pruning_ratio!r},decode_ratio={stats.decode_pruning_ratio!r}")
    assert "agreement=" not in raw.headers["X-Pruning-Stats"] and raw.headers["X-Prunewatch-Quality-Ms"] == "0.000"
    body = chat.model_extra["prunewatch"]
    assert_same_stats(body, direct)
    assert chat.id == f"chatcmpl-{body['request_id']}" and raw.headers["X-Prunewatch-Request-Id"] == body["request_id"]
    for phase in ("Preprocessing", "Inference", "Postprocessing", "Queue"):
        assert float(raw.headers[f"X-Prunewatch-{phase}-Ms"]) == body[f"{phase.lower()}_ms"]
    assert body["inference_ms"] > 0


def test_sdk_sensitivity_zero_header_gives_the_dense_output(sdk: openai.OpenAI, engine: PruningEngine) -> None:
    raw = sdk.chat.completions.with_raw_response.create(
        model=engine.name, messages=CHAT, max_tokens=MAX_TOKENS, extra_headers={"X-Pruning-Sensitivity": "0"})
    chat = raw.parse()
    dense = engine.generate(messages=CHAT, max_new_tokens=MAX_TOKENS, sensitivity=0.0)
    assert dense.stats.pruning_ratio == 0.0 and dense.stats.layers_bypassed == []
    assert chat.choices[0].message.content == dense.text
    assert raw.headers["X-Pruning-Ratio"] == "0.0"
    assert raw.headers["X-Pruning-Stats"].startswith("layers_bypassed=0,")
    body = chat.model_extra["prunewatch"]
    assert_same_stats(body, dense)
    assert body["executed_flops"] == body["dense_flops"]


def test_sdk_completion(sdk: openai.OpenAI, engine: PruningEngine) -> None:
    raw = sdk.completions.with_raw_response.create(model=engine.name, prompt=PROMPT, max_tokens=MAX_TOKENS)
    completion = raw.parse()
    direct = engine.generate(PROMPT, prompt_ids=engine.render_raw(PROMPT), max_new_tokens=MAX_TOKENS)
    assert completion.object == "text_completion"
    assert completion.choices[0].text == direct.text
    assert completion.usage.completion_tokens == direct.stats.completion_tokens
    assert float(raw.headers["X-Pruning-Ratio"]) == direct.stats.pruning_ratio
    assert_same_stats(completion.model_extra["prunewatch"], direct)


def test_sdk_chat_stream_ends_with_usage_and_stats(sdk: openai.OpenAI, engine: PruningEngine) -> None:
    chunks = list(sdk.chat.completions.create(model=engine.name, messages=CHAT, max_tokens=MAX_TOKENS, stream=True))
    direct = engine.generate(messages=CHAT, max_new_tokens=MAX_TOKENS)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == direct.text
    final = chunks[-1]
    assert final.choices[0].finish_reason == direct.stats.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert final.usage.completion_tokens == direct.stats.completion_tokens
    assert final.usage.prompt_tokens == direct.stats.prompt_tokens
    assert_same_stats(final.model_extra["prunewatch"], direct)
    assert all(c.usage is None and "prunewatch" not in (c.model_extra or {}) for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_sdk_completion_stream_with_overrides(sdk: openai.OpenAI, engine: PruningEngine) -> None:
    headers = {"X-Pruning-Sensitivity": "1", "X-Pruning-Blacklist": "1,2", "X-Pruning-Log-Level": "detailed"}
    chunks = list(sdk.completions.create(model=engine.name, prompt=PROMPT, max_tokens=MAX_TOKENS, stream=True,
                                         extra_headers=headers))
    direct = engine.generate(PROMPT, prompt_ids=engine.render_raw(PROMPT), max_new_tokens=MAX_TOKENS, sensitivity=1.0,
                             layer_blacklist=[1, 2])
    assert "".join(c.choices[0].text for c in chunks) == direct.text
    stats = chunks[-1].model_extra["prunewatch"]
    assert_same_stats(stats, direct)
    assert stats["sensitivity"] == 1.0 and not {1, 2} & set(stats["layers_bypassed"])


def test_sdk_stop_sequences_cut_the_answer_streamed_or_not(sdk: openai.OpenAI, engine: PruningEngine) -> None:
    """OpenAI's `stop`: the answer ends where a stop sequence first appears, without it, finish_reason "stop";
    streamed, the pieces add up to the same text."""
    whole = engine.generate(messages=CHAT, max_new_tokens=16).text
    start = next(i for i in range(len(whole) // 3, len(whole) - 3) if whole.find(whole[i:i + 3]) > 0
                 and whole[i:i + 3].strip())
    stop = whole[start:start + 3]
    cut = whole[:whole.find(stop)]
    answer = sdk.chat.completions.create(model=engine.name, messages=CHAT, max_tokens=16, stop=[stop, "\x00absent"])
    assert (answer.choices[0].message.content, answer.choices[0].finish_reason) == (cut, "stop")
    assert answer.usage.completion_tokens < 16
    chunks = list(sdk.chat.completions.create(model=engine.name, messages=CHAT, max_tokens=16, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_prompt_list_holding_one_prompt_is_that_prompt(http: httpx.Client, engine: PruningEngine) -> None:
    """OpenAI's completions take `prompt` as a string or a list (the SDK sends lists as given)."""
    answers = [http.post("/v1/completions", headers=AUTH, json={"model": engine.name, "prompt": prompt, "max_tokens": 4,
                                                                "logprobs": None, "echo": False, "best_of": 1})
               for prompt in (PROMPT, [PROMPT])]
    assert [a.status_code for a in answers] == [200, 200]
    texts = [a.json()["choices"][0]["text"] for a in answers]
    assert texts[0] == texts[1] and answers[0].json()["usage"] == answers[1].json()["usage"]


def test_sdk_models_and_errors(sdk: openai.OpenAI, engine: PruningEngine, base_url: str) -> None:
    assert [m.id for m in sdk.models.list().data] == [engine.name]
    assert sdk.models.retrieve(engine.name).id == engine.name
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
    assert missing.value.body == {"message": f"The model `gpt-4o` does not exist; this server serves "
                                             f"`{engine.name}`.", "type": "invalid_request_error",
                                  "param": "model", "code": "model_not_found"}
    stranger = openai.OpenAI(base_url=f"{base_url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as denied:
        stranger.models.list()
    assert denied.value.status_code == 401 and denied.value.code == "invalid_api_key"


def test_log_level_header_sets_the_engine_log_detail(http: httpx.Client, engine: PruningEngine,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    def lines(level: str) -> list[str]:
        response = http.post("/v1/chat/completions", json={"model": engine.name, "messages": CHAT, "max_tokens": 2},
                             headers={**AUTH, "X-Pruning-Log-Level": level, "X-Pruning-Sensitivity": "1"})
        assert response.status_code == 200
        request_id = response.json()["prunewatch"]["request_id"]
        return [r.getMessage() for r in caplog.records
                if r.name == "prunewatch.engine" and r.getMessage().startswith(f"request {request_id} ")]

    with caplog.at_level("INFO", logger="prunewatch.engine"):
        detailed, summary, silent = lines("DETAILED"), lines("summary"), lines("NONE")
    assert len([line for line in detailed if " layer=" in line]) == engine.num_layers
    assert len(summary) == 1 and " layer=" not in summary[0]
    assert silent == []


# -- auth, limits, validation -------------------------------------------------------------------


def chat_body(engine: PruningEngine, **extra: Any) -> dict[str, Any]:
    return {"model": engine.name, "messages": CHAT, "max_tokens": 2, **extra}


def test_401_without_or_with_a_wrong_key_and_health_is_exempt(http: httpx.Client, engine: PruningEngine) -> None:
    missing = http.post("/v1/chat/completions", json=chat_body(engine))
    assert missing.status_code == 401
    assert missing.headers["WWW-Authenticate"] == "Bearer"
    assert missing.json() == error("You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'.",
                                   "authentication_error", code="invalid_api_key")
    for header in ("Bearer sk-wrong", "Basic " + API_KEY, API_KEY):
        wrong = http.post("/v1/chat/completions", json=chat_body(engine), headers={"Authorization": header})
        assert wrong.status_code == 401
        assert wrong.json() == error("Incorrect API key provided.", "authentication_error", code="invalid_api_key")
    # Two Authorization headers, even with the right key among them: which one counts depends on who reads
    # the request (a proxy may check the first, the server the last), so none does.
    for pair in ([AUTH["Authorization"], "Bearer sk-wrong"], ["Bearer sk-wrong", AUTH["Authorization"]],
                 [AUTH["Authorization"]] * 2):
        twice = http.post("/v1/chat/completions", json=chat_body(engine),
                          headers=httpx.Headers([("Authorization", value) for value in pair]))
        assert twice.status_code == 401 and twice.headers["WWW-Authenticate"] == "Bearer"
        assert twice.json() == error("Authorization: sent 2 times; send it once.", "authentication_error",
                                     code="invalid_api_key")
    # auth runs before the body is parsed: garbage from a stranger is a 401, not a 422
    assert http.post("/v1/completions", content=b"{not json").status_code == 401
    assert http.get("/metrics").status_code == 401
    assert http.get("/v1/models").status_code == 401
    health = http.get("/health")
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "model": engine.name, "calibrated": True}


def test_400_for_bad_pruning_headers_and_parameters(http: httpx.Client, engine: PruningEngine) -> None:
    last = engine.num_layers - 1
    cases = [
        ({"X-Pruning-Sensitivity": "1.5"}, {},
         error("X-Pruning-Sensitivity: must be within [0, 1], got 1.5", param="X-Pruning-Sensitivity",
               code="invalid_header")),
        ({"X-Pruning-Blacklist": f"2,{last + 1}"}, {},
         error(f"X-Pruning-Blacklist: layer(s) [{last + 1}] out of range; the model has layers 0..{last}",
               param="X-Pruning-Blacklist", code="invalid_header")),
        ({"X-Pruning-Log-Level": "LOUD"}, {},
         error("X-Pruning-Log-Level: expected one of NONE, SUMMARY, DETAILED, got 'LOUD'",
               param="X-Pruning-Log-Level", code="invalid_header")),
        ({}, {"max_tokens": 17},
         error("max_tokens is 17, above this server's limit of 16", param="max_tokens", code="max_tokens_exceeded")),
        ({}, {"max_completion_tokens": 40},
         error("max_completion_tokens is 40, above this server's limit of 16", param="max_completion_tokens",
               code="max_tokens_exceeded")),
        ({}, {"stop": [f"s{i}" for i in range(17)]},
         error("at most 16 stop sequences, got 17", param="stop", code="invalid_value")),
        ({}, {"top_logprobs": 2}, error("top_logprobs needs logprobs: true", param="top_logprobs",
                                        code="invalid_value")),
        ({}, {"stop": ["\n", ""]}, error("stop sequences must be non-empty strings", param="stop", code="invalid_value")),
        ({}, {"stop": "x" * 257},
         error("a stop sequence is longer than 256 characters", param="stop", code="invalid_value")),
    ]
    for headers, extra, expected in cases:
        response = http.post("/v1/chat/completions", json=chat_body(engine, **extra), headers={**AUTH, **headers})
        assert (response.status_code, response.json()) == (400, expected), (headers, extra)


def test_413_for_a_long_prompt_and_a_large_body(http: httpx.Client, engine: PruningEngine) -> None:
    prompt = "route " * 300
    tokens = len(engine.render_raw(prompt))
    assert tokens > 200
    response = http.post("/v1/completions", json={"model": engine.name, "prompt": prompt, "max_tokens": 2},
                         headers=AUTH)
    assert response.status_code == 413
    assert response.json() == error(f"The prompt is {tokens} tokens, above this server's limit of 200.",
                                    param="prompt", code="context_length_exceeded")
    huge = http.post("/v1/completions", json={"model": engine.name, "prompt": "x" * 70_000}, headers=AUTH)
    assert huge.status_code == 413
    assert huge.json() == error("The request body is larger than this server's limit of 65536 bytes.",
                                code="request_too_large")


def test_422_for_invalid_bodies(http: httpx.Client, engine: PruningEngine) -> None:
    cases = [
        ({"model": engine.name}, error("messages: Field required", param="messages", code="validation_error")),
        (chat_body(engine, max_tokens=0),
         error("max_tokens: Input should be greater than or equal to 1", param="max_tokens",
               code="validation_error")),
        (chat_body(engine, messages=[{"role": "wizard", "content": "hi"}]),
         error("messages.0.role: Input should be 'system', 'developer', 'user' or 'assistant'",
               param="messages.0.role", code="validation_error")),
        (chat_body(engine, n=2), error("n: Input should be less than or equal to 1", param="n",
                                       code="validation_error")),
        ({"model": engine.name, "prompt": ["one", "two"]}, error(
            "prompt: Value error, one prompt per request, got a list of 2; send several as /v1/batch items",
            param="prompt", code="validation_error")),
        (chat_body(engine, logprobs=True, top_logprobs=21), error(
            "top_logprobs: Input should be less than or equal to 20", param="top_logprobs", code="validation_error")),
        ({"model": engine.name, "prompt": "hi", "logprobs": 6}, error(
            "logprobs: Input should be less than or equal to 5", param="logprobs", code="validation_error")),
        ({"model": engine.name, "prompt": "hi", "suffix": "end"}, error(
            "suffix: Input should be None", param="suffix", code="validation_error")),
        ({"model": engine.name, "prompt": []}, error(
            "prompt: Value error, the prompt is an empty list", param="prompt", code="validation_error")),
        ({"model": engine.name, "prompt": "\ud903 lone surrogate"}, error(
            "prompt: Value error, text must be valid Unicode (it holds a lone surrogate code point)",
            param="prompt", code="validation_error")),
    ]
    for body, expected in cases:
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        # json.dumps escapes a lone surrogate as \\ud903, as a JavaScript client would send it
        response = http.post(path, content=json.dumps(body), headers={**AUTH, "Content-Type": "application/json"})
        assert (response.status_code, response.json()) == (422, expected), body


def test_unknown_routes_and_methods_keep_the_error_shape(http: httpx.Client) -> None:
    response = http.get("/v1/nothing", headers=AUTH)
    assert (response.status_code, response.json()) == (404, error("Not Found", code="not_found"))
    response = http.get("/v1/chat/completions", headers=AUTH)
    assert (response.status_code, response.json()) == (405, error("Method Not Allowed", code="method_not_allowed"))


# -- hostile input: absurd numbers, repeated headers, chunked bodies, keys in the URL -----------

DIGITS = "9" * 5000  # past the 4300 digits int() and json.loads accept


def generating_requests(engine: PruningEngine) -> list[tuple[str, dict[str, Any]]]:
    chat = chat_body(engine, max_tokens=1)
    return [("/v1/chat/completions", chat),
            ("/v1/completions", {"model": engine.name, "prompt": PROMPT, "max_tokens": 1}),
            ("/v1/batch", {"requests": [{"url": "/v1/chat/completions", "body": chat}]})]


def with_raw_number(body: dict[str, Any], path: tuple[str | int, ...], number: str) -> bytes:
    """`body` as JSON with the value at `path` replaced by a raw number literal json.dumps cannot write."""
    copy = json.loads(json.dumps(body))
    target: Any = copy
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = "@NUMBER@"
    return json.dumps(copy).replace('"@NUMBER@"', number).encode()


def test_absurd_numbers_in_headers_and_bodies_are_a_400_not_a_500(http: httpx.Client, engine: PruningEngine) -> None:
    for path, body in generating_requests(engine):
        for header in (ph.BLACKLIST, ph.SENSITIVITY):
            response = http.post(path, json=body, headers={**AUTH, header: DIGITS})
            assert response.status_code == 400, (path, header, response.text[:300])
            detail = response.json()["error"]
            assert (detail["param"], detail["code"], detail["type"]) == (header, "invalid_header",
                                                                         "invalid_request_error")
            assert detail["message"].endswith("(5000 characters)" + (
                f" out of range; the model has layers 0..{engine.num_layers - 1}" if header == ph.BLACKLIST else ""))
    # in a body, json.loads refuses the literal before any field is checked
    item = {"url": "/v1/chat/completions", "body": chat_body(engine, max_tokens=1), "pruning": {"layer_blacklist": [1]}}
    raw_cases = [("/v1/chat/completions", chat_body(engine), ("max_tokens",)),
                 ("/v1/chat/completions", chat_body(engine, temperature=1), ("temperature",)),
                 ("/v1/completions", {"model": engine.name, "prompt": PROMPT, "seed": 1}, ("seed",)),
                 ("/v1/batch", {"requests": [item]}, ("requests", 0, "pruning", "layer_blacklist", 0)),
                 ("/v1/batch", {"requests": [item]}, ("requests", 0, "body", "max_tokens"))]
    for path, body, field in raw_cases:
        response = http.post(path, content=with_raw_number(body, field, DIGITS),
                             headers={**AUTH, "Content-Type": "application/json"})
        assert (response.status_code, response.json()) == (400, error(
            "There was an error parsing the body: Exceeds the limit (4300 digits) for integer string conversion: "
            "value has 5000 digits", code="invalid_request_body")), (path, field)
    # 4300 digits still parse: then the field's own check answers, for the item alone in a batch
    just_parses = with_raw_number({"requests": [item]}, ("requests", 0, "body", "max_tokens"), "9" * 4300)
    response = http.post("/v1/batch", content=just_parses,
                         headers={**AUTH, "Content-Type": "application/json"})
    assert response.status_code == 200
    assert response.json()["data"][0]["error"]["code"] == "max_tokens_exceeded"


def test_an_oversized_chunked_body_is_a_413_and_a_small_one_is_served(http: httpx.Client,
                                                                      engine: PruningEngine) -> None:
    """No Content-Length (Transfer-Encoding: chunked): the limit still answers 413, not a 400."""
    def chunked(body: dict[str, Any]) -> Iterator[bytes]:
        data = json.dumps(body).encode()
        return (data[i:i + 1000] for i in range(0, len(data), 1000))

    huge = http.post("/v1/completions", content=chunked({"model": engine.name, "prompt": "x" * 70_000}),
                     headers={**AUTH, "Content-Type": "application/json"})
    assert huge.request.headers.get("Transfer-Encoding") == "chunked" and "Content-Length" not in huge.request.headers
    assert (huge.status_code, huge.json()) == (413, error(
        "The request body is larger than this server's limit of 65536 bytes.", code="request_too_large"))
    small = http.post("/v1/completions", content=chunked({"model": engine.name, "prompt": "x " * 40, "max_tokens": 1}),
                      headers={**AUTH, "Content-Type": "application/json"})
    assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 1


def test_a_repeated_pruning_header_is_refused_naming_it(http: httpx.Client, engine: PruningEngine) -> None:
    for header, value, other in [(ph.SENSITIVITY, "0", "1"), (ph.BLACKLIST, "1", "1,2"), (ph.LOG_LEVEL, "NONE", "NONE"),
                                 (ph.QUALITY, "off", "on")]:
        for second in (value, other):
            for path, body in generating_requests(engine):
                twice = [*AUTH.items(), (header, value), (header.lower(), second)]
                response = http.post(path, json=body, headers=twice)
                assert (response.status_code, response.json()) == (400, error(
                    f"{header}: sent 2 times; send it once", param=header, code="invalid_header")), (header, path)


class _Lines(logging.Handler):
    """Every record's final message, as any formatter would print it."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_an_api_key_in_the_url_is_refused_and_never_logged(http: httpx.Client) -> None:
    """Keys come only from `Authorization: Bearer`; a request with one in the query string is refused, even
    beside a valid header (the URL has already put the key into proxies' and browsers' logs), and the key
    reaches no log of ours: uvicorn's access log (which does not propagate to the root logger) and ours, under
    a credential-like parameter name or under any other name."""
    capture = _Lines()
    loggers = [logging.getLogger(name) for name in ("uvicorn.access", "uvicorn.error", "prunewatch")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(capture)
        logger.setLevel(logging.INFO)
    try:
        in_url = error("API keys are not accepted in the URL, where logs keep them; send it as "
                       "'Authorization: Bearer YOUR_KEY'.", "authentication_error", code="invalid_api_key")
        for query in (f"api_key={API_KEY}", f"key={API_KEY}", f"model=m&access_token={API_KEY}",
                      f"api%5Fkey={API_KEY}", f"x-api-key={API_KEY}", f"x={API_KEY}"):
            for headers in ({}, AUTH):
                refused = http.get(f"/v1/models?{query}", headers=headers)
                assert (refused.status_code, refused.json()) == (401, in_url), (query, headers)
        assert http.post(f"/v1/nothing?token={API_KEY}", headers=AUTH).status_code == 401
        assert http.get("/v1/models?x=not-a-key", headers=AUTH).status_code == 200  # other values pass
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(capture)
            logger.setLevel(level)
    assert any("/v1/models?api_key=[REDACTED]" in line and " 401" in line for line in capture.lines), capture.lines
    assert any("/v1/models?model=m&access_token=[REDACTED]" in line for line in capture.lines), capture.lines
    assert any("/v1/models?x=[REDACTED]" in line for line in capture.lines), capture.lines
    assert any("/v1/models?x=not-a-key" in line for line in capture.lines), capture.lines
    assert len([line for line in capture.lines if "[REDACTED]" in line]) >= 13
    assert not [line for line in capture.lines if API_KEY in line]


# -- the bounded queue --------------------------------------------------------------------------


class GatedEngine:
    """The real engine behind a gate: generations wait until the test opens it."""

    def __init__(self, inner: PruningEngine) -> None:
        self._inner = inner
        self.gate = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def stream(self, *args: Any, **kwargs: Any):
        if not self.gate.wait(timeout=30):
            raise TimeoutError("the test never opened the gate")
        yield from self._inner.stream(*args, **kwargs)


def test_429_with_retry_after_when_the_queue_is_full(engine: PruningEngine) -> None:
    gated = GatedEngine(engine)
    registry = CollectorRegistry()
    app = create_app(gated, settings(queue_depth=2, workers=1), registry=registry)  # type: ignore[arg-type]
    in_queue = {"model": engine.name}
    with serve_in_background(app) as url, httpx.Client(base_url=url, timeout=60, headers=AUTH) as client, \
            ThreadPoolExecutor(2) as pool:
        assert registry.get_sample_value("prunewatch_queue_depth_limit", in_queue) == 2
        first = [pool.submit(client.post, "/v1/chat/completions", json=chat_body(engine)) for _ in range(2)]
        deadline = time.monotonic() + 20
        while registry.get_sample_value("prunewatch_requests_in_queue", in_queue) != 2:
            assert time.monotonic() < deadline, "the two requests were never admitted"
            time.sleep(0.01)
        refused = client.post("/v1/chat/completions", json=chat_body(engine))
        assert refused.status_code == 429
        assert refused.headers["Retry-After"] == "1"
        assert refused.json() == error(
            "The server's request queue is full (2 requests waiting or running); retry after 1 s.",
            "rate_limit_error", code="queue_full")
        batch = client.post("/v1/batch", json={"requests": [
            {"url": "/v1/completions", "body": {"model": engine.name, "prompt": "hi", "max_tokens": 1}}]})
        assert batch.status_code == 429
        gated.gate.set()
        assert [f.result().status_code for f in first] == [200, 200]
        # a slot is freed when its worker finishes, a moment after the answer went out
        deadline = time.monotonic() + 10
        while registry.get_sample_value("prunewatch_requests_in_queue", in_queue) != 0:
            assert time.monotonic() < deadline, "the slots were never released"
            time.sleep(0.01)
        assert client.post("/v1/chat/completions", json=chat_body(engine)).status_code == 200
        labels = {"model": engine.name, "endpoint": "/v1/chat/completions"}
        # the middleware counts a response once it has been sent, a moment after the client has it
        deadline = time.monotonic() + 10
        while registry.get_sample_value("prunewatch_requests_total", {**labels, "status": "200"}) != 3:
            assert time.monotonic() < deadline, registry.get_sample_value(
                "prunewatch_requests_total", {**labels, "status": "200"})
            time.sleep(0.01)
        assert registry.get_sample_value("prunewatch_requests_total", {**labels, "status": "429"}) == 1


class SlowEngine(GatedEngine):
    """The real engine, pausing after every streamed item, so a client can leave mid-generation."""

    def __init__(self, inner: PruningEngine) -> None:
        super().__init__(inner)
        self.gate.set()
        self.items = 0

    def stream(self, *args: Any, **kwargs: Any):
        for item in self._inner.stream(*args, **kwargs):
            self.items += 1
            yield item
            time.sleep(0.1)


def test_a_client_leaving_a_stream_stops_its_generation_and_frees_the_slot(engine: PruningEngine) -> None:
    slow = SlowEngine(engine)
    registry = CollectorRegistry()
    app = create_app(slow, settings(queue_depth=1, workers=1), registry=registry)  # type: ignore[arg-type]
    body = {"model": engine.name, "messages": CHAT, "max_tokens": 16, "stream": True}
    with serve_in_background(app) as url, httpx.Client(base_url=url, timeout=60, headers=AUTH) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            first = next(response.iter_lines())
            assert first.startswith("data: ") and '"role": "assistant"' in first
        deadline = time.monotonic() + 10  # 16 tokens at 0.1 s each would take 1.6 s more
        while registry.get_sample_value("prunewatch_requests_in_queue", {"model": engine.name}) != 0:
            assert time.monotonic() < deadline, "the abandoned generation kept its slot"
            time.sleep(0.01)
        assert slow.items < 8, f"the worker went on after the client left ({slow.items} items)"
        assert client.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 1}).status_code == 200


# -- concurrency, batch, metrics ----------------------------------------------------------------

VARIANTS = [
    ({}, {}),
    ({"X-Pruning-Sensitivity": "0"}, {"sensitivity": 0.0}),
    ({"X-Pruning-Sensitivity": "1"}, {"sensitivity": 1.0}),
    ({"X-Pruning-Sensitivity": "1", "X-Pruning-Blacklist": "3,4,5"},
     {"sensitivity": 1.0, "layer_blacklist": [3, 4, 5]}),
]


def test_concurrent_requests_keep_their_own_stats(http: httpx.Client, engine: PruningEngine) -> None:
    """Eight concurrent requests with four pruning settings: each matches its solo run."""
    prompts = [CHAT, [{"role": "user", "content": PROMPT}]]
    jobs = [(variant, messages) for variant in VARIANTS for messages in prompts]
    expected = [engine.generate(messages=messages, max_new_tokens=MAX_TOKENS, **kwargs)
                for (_, kwargs), messages in jobs]
    assert len({e.stats.pruning_ratio for e in expected}) >= 3, "the variants must prune differently"

    def call(job):
        (headers, _), messages = job
        return http.post("/v1/chat/completions", headers={**AUTH, **headers},
                         json={"model": engine.name, "messages": messages, "max_tokens": MAX_TOKENS})

    with ThreadPoolExecutor(len(jobs)) as pool:
        responses = list(pool.map(call, jobs))
    for response, direct in zip(responses, expected):
        assert response.status_code == 200
        body = response.json()
        assert body["choices"][0]["message"]["content"] == direct.text
        assert_same_stats(body["prunewatch"], direct)
        assert float(response.headers["X-Pruning-Ratio"]) == direct.stats.pruning_ratio
    assert len({r.json()["prunewatch"]["request_id"] for r in responses}) == len(jobs)


def test_quality_header_scores_the_served_answer_on_chat_and_batch(http: httpx.Client, engine: PruningEngine) -> None:
    headers = {**AUTH, "X-Pruning-Sensitivity": "1", "X-Pruning-Quality": "on"}
    body = {"model": engine.name, "messages": CHAT, "max_tokens": MAX_TOKENS}
    response = http.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200
    direct = engine.generate(messages=CHAT, max_new_tokens=MAX_TOKENS, sensitivity=1.0, quality=True)
    served = response.json()["prunewatch"]
    assert served["quality"]["reference_agreement"] == direct.stats.quality.reference_agreement
    assert served["quality"]["served_nll"] == direct.stats.quality.served_nll
    assert served["quality"]["reference_tokens"] == len(direct.served_ids) and served["quality_ms"] > 0
    assert served["quality"]["continuation_agreement"] is None  # "on" scores what was served, nothing more
    assert float(response.headers["X-Prunewatch-Quality-Ms"]) == served["quality_ms"]
    quality = direct.stats.quality
    assert response.headers["X-Pruning-Stats"].endswith(
        f",agreement={quality.reference_agreement!r},nll={quality.served_nll!r}")
    full = http.post("/v1/chat/completions", json=body, headers={**headers, "X-Pruning-Quality": "full"})
    checked = engine.generate(messages=CHAT, max_new_tokens=MAX_TOKENS, sensitivity=1.0, quality="full").stats.quality
    assert full.json()["prunewatch"]["quality"]["continuation_agreement"] == checked.continuation_agreement
    assert full.headers["X-Pruning-Stats"].endswith(
        f",continuation_agreement={checked.continuation_agreement!r},ppl_delta_pct={checked.perplexity_delta_pct!r}")
    batch = http.post("/v1/batch", headers={**AUTH, "X-Pruning-Sensitivity": "1"}, json={"requests": [
        {"url": "/v1/chat/completions", "body": body, "pruning": {"quality": True}},
        {"url": "/v1/chat/completions", "body": body}]}).json()["data"]
    scored, unscored = (item["response"]["prunewatch"] for item in batch)
    assert scored["quality"]["reference_agreement"] == quality.reference_agreement
    assert unscored["quality"] is None and unscored["quality_ms"] == 0.0  # no header, no cost
    refused = http.post("/v1/chat/completions", json=body, headers={**AUTH, "X-Pruning-Quality": "sometimes"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "X-Pruning-Quality"


def test_batch_prunes_each_item_independently(http: httpx.Client, engine: PruningEngine) -> None:
    items = [
        {"custom_id": "a", "url": "/v1/chat/completions",
         "body": {"model": engine.name, "messages": CHAT, "max_tokens": MAX_TOKENS}},
        {"custom_id": "b", "url": "/v1/completions",
         "body": {"model": engine.name, "prompt": PROMPT, "max_tokens": MAX_TOKENS}, "pruning": {"sensitivity": 0}},
        {"custom_id": "c", "url": "/v1/chat/completions",
         "body": {"model": engine.name, "messages": CHAT, "max_tokens": 2},
         "pruning": {"layer_blacklist": [engine.num_layers]}},
        {"custom_id": "d", "url": "/v1/completions", "body": {"model": "other", "prompt": "hi"}},
    ]
    response = http.post("/v1/batch", json={"requests": items}, headers={**AUTH, "X-Pruning-Sensitivity": "1"})
    assert response.status_code == 200
    data = response.json()["data"]
    assert [(r["index"], r["custom_id"], r["status_code"]) for r in data] == [
        (0, "a", 200), (1, "b", 200), (2, "c", 400), (3, "d", 404)]
    pruned = engine.generate(messages=CHAT, max_new_tokens=MAX_TOKENS, sensitivity=1.0)
    dense = engine.generate(PROMPT, prompt_ids=engine.render_raw(PROMPT), max_new_tokens=MAX_TOKENS, sensitivity=0.0)
    assert data[0]["response"]["choices"][0]["message"]["content"] == pruned.text
    assert_same_stats(data[0]["response"]["prunewatch"], pruned)
    assert data[1]["response"]["choices"][0]["text"] == dense.text
    assert_same_stats(data[1]["response"]["prunewatch"], dense)
    last = engine.num_layers - 1
    assert data[2]["error"] == error(f"layer(s) [{last + 1}] out of range; the model has layers 0..{last}",
                                     param="requests.2.pruning.layer_blacklist", code="invalid_value")["error"]
    assert data[3]["error"]["code"] == "model_not_found" and data[3]["error"]["param"] == "requests.3.body.model"

    too_many = http.post("/v1/batch", json={"requests": [items[1]] * 5}, headers=AUTH)
    assert (too_many.status_code, too_many.json()) == (413, error(
        "The batch has 5 requests, above this server's limit of 4.", param="requests", code="batch_too_large"))
    streamed = http.post("/v1/batch", headers=AUTH, json={"requests": [
        {"url": "/v1/completions", "body": {"model": engine.name, "prompt": "hi", "stream": True}}]})
    assert streamed.json()["data"][0]["error"]["message"] == "stream is not supported inside a batch"


def test_metrics_count_live_traffic(http: httpx.Client, engine: PruningEngine, registry: CollectorRegistry) -> None:
    model = engine.name
    ok = {"model": model, "endpoint": "/v1/completions", "status": "200"}
    bad = {**ok, "status": "422"}
    denied = {**ok, "status": "401"}

    def value(name: str, labels: dict[str, str]) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    before = {k: value("prunewatch_requests_total", v) for k, v in (("ok", ok), ("bad", bad), ("denied", denied))}
    tokens_before = value("prunewatch_completion_tokens_total", {"model": model})
    response = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS},
                         headers=AUTH)
    assert http.post("/v1/completions", json={"model": model}, headers=AUTH).status_code == 422
    assert http.post("/v1/completions", json={"model": model}).status_code == 401
    stats = response.json()["prunewatch"]
    assert value("prunewatch_requests_total", ok) == before["ok"] + 1
    assert value("prunewatch_requests_total", bad) == before["bad"] + 1
    assert value("prunewatch_requests_total", denied) == before["denied"] + 1
    assert value("prunewatch_completion_tokens_total", {"model": model}) == (
        tokens_before + response.json()["usage"]["completion_tokens"])
    assert value("prunewatch_pruning_ratio", {"model": model, "domain": stats["domain"], "probe": "live",
                                              "target": ""}) == (
        stats["pruning_ratio"])
    exposition = http.get("/metrics", headers=AUTH)
    assert exposition.status_code == 200
    for name in ("prunewatch_pruning_ratio{", "prunewatch_inference_latency_seconds_bucket{",
                 "prunewatch_tokens_per_second{", "prunewatch_requests_total{", "prunewatch_executed_flops_total{",
                 "prunewatch_dense_flops_total{", "prunewatch_requests_in_queue{"):
        assert name in exposition.text
    assert 'le="0.8"' in exposition.text and 'le="1.2"' in exposition.text


def test_openapi_document(http: httpx.Client) -> None:
    document = http.get("/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/batch", "/v1/models", "/health", "/metrics"} <= set(
        document["paths"])
    chat = document["paths"]["/v1/chat/completions"]["post"]
    assert {p["name"] for p in chat["parameters"]} == {
        "X-Pruning-Sensitivity", "X-Pruning-Log-Level", "X-Pruning-Blacklist", "X-Pruning-Quality"}
    assert {"200", "400", "401", "404", "413", "422", "429"} <= set(chat["responses"])
    assert "text/event-stream" in chat["responses"]["200"]["content"]
    assert chat["security"] == [{"HTTPBearer": []}]


# -- schemathesis -------------------------------------------------------------------------------


def send(client: httpx.Client, kwargs: dict[str, Any]) -> httpx.Response:
    """Send a schemathesis case's request (its `requests`-style kwargs) with httpx.

    schemathesis' own requests transport breaks when urllib3-future shadows urllib3, as it does in
    this venv, so the cases go over a real socket with httpx instead.
    """
    body: dict[str, Any] = {}
    if "json" in kwargs:
        body["json"] = kwargs["json"]
    elif isinstance(kwargs.get("data"), (bytes, str)):
        body["content"] = kwargs["data"]
    elif kwargs.get("data") is not None:
        body["data"] = kwargs["data"]
    return client.request(kwargs["method"], kwargs["url"], params=kwargs.get("params") or None,
                          headers=kwargs.get("headers"), cookies=kwargs.get("cookies") or None, **body)


def test_fuzzing_the_openapi_document_finds_no_server_error(engine: PruningEngine) -> None:
    """Schema-driven requests, valid and invalid, get documented answers and never a 5xx."""
    import schemathesis
    from hypothesis import HealthCheck, given
    from hypothesis import settings as hypothesis_settings
    from hypothesis import strategies as st
    from hypothesis.errors import Unsatisfiable
    from schemathesis.checks import not_a_server_error
    from schemathesis.generation import GenerationMode
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        negative_data_rejection,
        response_schema_conformance,
        status_code_conformance,
    )

    app = create_app(engine, settings(max_tokens_limit=3, default_max_tokens=2, workers=1),
                     registry=CollectorRegistry())
    schema = schemathesis.openapi.from_dict(app.openapi())
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    statuses: list[int] = []
    seen: set[tuple[str, int]] = set()

    @st.composite
    def mostly_servable(draw: st.DrawFn, case_strategy: st.SearchStrategy) -> Any:
        """Positive cases carry our key and model. Half of them are also trimmed to what this server
        can serve (no random pruning headers or stop strings, a short prompt, few tokens), so valid
        bodies reach the engine instead of stopping at a 400/413; the other half keep what was drawn."""
        case = draw(case_strategy)
        case.headers = {**(case.headers or {}), **AUTH}
        bodies = [case.body] if isinstance(case.body, dict) else []
        bodies += [item["body"] for body in bodies for item in body.get("requests", [])]  # batch items
        for body in bodies:
            if "model" in body:
                body["model"] = engine.name
        if draw(st.booleans()):
            case.headers = {k: v for k, v in case.headers.items() if not k.lower().startswith("x-pruning-")}
            for body in bodies:
                body.pop("stop", None)
                for key in ("max_tokens", "max_completion_tokens"):
                    if isinstance(body.get(key), int):
                        body[key] = min(body[key], 3)
                if isinstance(body.get("messages"), list):
                    body["messages"] = body["messages"][:2]
                if isinstance(body.get("prompt"), str):  # 40 characters stay under the 200-token limit; "" is a 400
                    body["prompt"] = body["prompt"][:40] or "Hello"
        return case

    operations = [result.ok() for result in schema.get_all_operations()]
    unsatisfiable: list[str] = []
    assert len(operations) == 9  # 7 OpenAI/prunewatch routes + GET/PUT /v1/pruning/policy

    def fuzz(client: httpx.Client, url: str, strategy: Any, examples: int, case_checks: list[Any]) -> None:
        @hypothesis_settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                             suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def one(case) -> None:
            response = send(client, case.as_transport_kwargs(base_url=url, headers=AUTH))
            statuses.append(response.status_code)
            seen.add((case.path, response.status_code))
            assert response.status_code < 500, response.text
            case.validate_response(response, checks=case_checks, headers=AUTH)

        one()

    with serve_in_background(app) as url, httpx.Client(timeout=60) as client:
        for operation in operations:
            post = operation.method.upper() == "POST"  # bodies are where the input space is
            positive = mostly_servable(operation.as_strategy(generation_mode=GenerationMode.POSITIVE))
            fuzz(client, url, positive, 12 if post else 2, checks)
            try:
                fuzz(client, url, operation.as_strategy(generation_mode=GenerationMode.NEGATIVE), 5 if post else 1,
                     [*checks, negative_data_rejection])
            except Unsatisfiable:
                unsatisfiable.append(operation.label)  # an operation without inputs has no invalid ones
    assert len(statuses) >= 45 and all(status < 500 for status in statuses)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/batch"):
        assert (path, 200) in seen, f"no generated request to {path} was served: {sorted(seen)}"
    assert any(400 <= status < 500 for status in statuses)
    assert unsatisfiable == ["GET /health"]


def test_usage_counts_the_prompt_tokens_the_prefix_cache_served(http: httpx.Client, engine: PruningEngine,
                                                                registry: CollectorRegistry) -> None:
    """Once one request computed a chat prompt's head (its system prompt up to the user's turn), the next with the
    same head gets it from the prefix cache and says so in OpenAI's usage field; a raw completion has no head."""
    def usage(path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = http.post(path, headers=AUTH, json={"model": engine.name, "max_tokens": 2, **body})
        assert response.status_code == 200, response.text
        return response.json()["usage"]

    min_tokens = engine.prefix_cache.min_tokens
    engine.prefix_cache.min_tokens = 1  # CHAT's head is shorter than the default minimum
    try:
        head = engine.prefix_cache.head_length(engine.render_prompt(messages=CHAT))
        assert head > 0
        usage("/v1/chat/completions", {"messages": CHAT})
        sample = ("prunewatch_prompt_tokens_cached_total", {"model": engine.name})
        before = registry.get_sample_value(*sample) or 0.0
        assert usage("/v1/chat/completions", {"messages": CHAT})["prompt_tokens_details"] == {"cached_tokens": head}
        assert registry.get_sample_value(*sample) == before + head
        assert usage("/v1/completions", {"prompt": PROMPT})["prompt_tokens_details"] == {"cached_tokens": 0}
    finally:
        engine.prefix_cache.min_tokens = min_tokens
        engine.prefix_cache.clear()
