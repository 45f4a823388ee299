"""Property-based tests of the HTTP API: whatever a client sends, the answer is documented.

Every request header and body field of /v1/chat/completions, /v1/completions and /v1/batch is
drawn from valid values, boundary values and garbage (nan, inf, integers past the 4300 digits
Python's int() accepts, lone surrogates, repeated headers). The invariant: a 2xx, or a 4xx whose
body is exactly OpenAI's error object; never a 5xx, and /health answers 200 after every request.
Where the draw says whether the request is valid, the test also checks which of the two it got.

The app runs in-process over a `FakeEngine`: these tests exercise the server's checks, not
generation, and must stay fast (the real model took up to 0.8 s a request on the shared CPU;
test_server.py drives it over sockets). The fake refuses what `PruningEngine.stream` refuses, using the engine's
own `validate_request`, so a value the server lets through and the engine rejects still fails here.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from prunewatch.engine.batching import StepperTime
from prunewatch.engine.errors import InvalidRequestError
from prunewatch.engine.logprobs import TokenLogprob, TopLogprob
from prunewatch.engine.planner import validate_request
from prunewatch.engine.prefix_cache import PrefixCache
from prunewatch.engine.pruning_engine import TokenDelta
from prunewatch.engine.settings import LogLevel
from prunewatch.engine.stats import GenerationResult, QualityReport, RequestStats
from prunewatch.server import ServerSettings, create_app
from prunewatch.server import pruning_headers as ph

API_KEY = "sk-prunewatch-property-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "fake-llama"
NUM_LAYERS = 12
DEFAULT_SENSITIVITY = 0.5
MAX_TOKENS_LIMIT = 4
MAX_BATCH = 3
MAX_BODY_BYTES = 32 * 1024
JSON_INT_DIGITS = 4300  # json.loads / int() refuse longer integers (sys.get_int_max_str_digits)

FAST = settings(max_examples=50, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])


# -- a model-free engine ------------------------------------------------------------------------


class FakeEngine:
    """What the server uses of `PruningEngine`, answering at once.

    A token is a UTF-8 byte, so a prompt's length in tokens is predictable and the prompt-size
    and context-window checks can be reached on purpose.
    """

    name = MODEL
    num_layers = NUM_LAYERS
    calibration = None
    loaded = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=256)),
                             device=SimpleNamespace(type="cpu"))
    context_window = 256
    settings = SimpleNamespace(threads=None)  # the generation threads' intra-op threads: their share of the cores
    vocab_size = 256
    prefix_cache = PrefixCache((), max_entries=0, max_bytes=0)  # no chat template to split: nothing kept

    def decode_prompt(self, prompt_ids: list[int]) -> str:
        return bytes(prompt_ids).decode("utf-8", "replace")

    def new_batcher(self, max_batch: int, threads: int | None = None, *, kv_budget_bytes: int | None = None) -> Any:
        """No model to batch: a server with several workers holds this, checks each request against its KV budget
        (no cache here: everything fits), hands it to `stream` (which ignores it), publishes its stepper's time
        (none spent) and closes it when it stops."""
        return SimpleNamespace(max_batch=max_batch, threads=threads, kv_budget_bytes=kv_budget_bytes,
                               kv_reserved_bytes=0, check_fits=lambda tokens: None, close=lambda: None,
                               stepper_time=StepperTime)

    def render_raw(self, prompt: str) -> list[int]:
        ids = list(prompt.encode("utf-8"))
        if not ids:
            raise InvalidRequestError("the prompt is empty after tokenization")
        return ids

    def render_prompt(self, prompt: str | None = None, system: str | None = None,
                      messages: list[dict[str, str]] | None = None) -> list[int]:
        return self.render_raw("".join(f"<{m['role']}>{m['content']}" for m in messages or []) + "<assistant>")

    def stream(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
               max_new_tokens: int = 1, sensitivity: float | None = None, layer_blacklist: list[int] | None = None,
               log_level: LogLevel | None = None, quality: bool | str = False, request_id: str | None = None,
               prompt_ids: list[int] | None = None, logprobs: int | None = None, echo: bool = False,
               **_: Any) -> Iterator[TokenDelta | GenerationResult]:
        sensitivity = DEFAULT_SENSITIVITY if sensitivity is None else float(sensitivity)
        blacklist = sorted(set(layer_blacklist or ()))
        validate_request(self.num_layers, sensitivity, blacklist)  # what the real engine refuses
        if log_level is not None:
            LogLevel(log_level)
        if max_new_tokens < (0 if echo else 1):
            raise InvalidRequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if logprobs is not None and not 0 <= logprobs <= 20:
            raise InvalidRequestError(f"logprobs must be within 0..20, got {logprobs}")

        def entry(token: int, offset: int, first: bool = False) -> TokenLogprob:
            top = () if first else tuple(TopLogprob(t, chr(t), bytes([t]), -0.25 * (t + 1)) for t in range(logprobs or 0))
            return TokenLogprob(token, chr(token), bytes([token]), None if first else -1.5, offset, top)

        prompt_ids = list(prompt_ids or [])
        prompt_text = self.decode_prompt(prompt_ids) if echo else None
        prompt_logprobs = ([entry(t, i, i == 0) for i, t in enumerate(prompt_ids)]
                           if echo and logprobs is not None else None)
        if echo:
            yield TokenDelta(text=prompt_text or "", token_id=prompt_ids[-1], logprobs=tuple(prompt_logprobs or ()),
                             echo=True)
        generated = [entry(ord("x"), i) for i in range(max_new_tokens)] if logprobs is not None else None
        for i in range(max_new_tokens):
            yield TokenDelta(text="x", token_id=i, logprobs=(generated[i],) if generated else ())
        bypassed = [i for i in range(round(sensitivity * 6)) if i not in blacklist]
        ratio = len(bypassed) / self.num_layers
        stats = RequestStats(
            request_id=request_id or "r", model=self.name, device="cpu", dtype="float32",
            prompt_tokens=len(prompt_ids or ()), completion_tokens=max_new_tokens, preprocessing_ms=0.1,
            inference_ms=0.2, postprocessing_ms=0.1, ttft_ms=0.1, decode_tokens_per_s=10.0, tokens_per_s=10.0,
            sensitivity=sensitivity, pruning_ratio=ratio, executed_flops=100 - len(bypassed), dense_flops=100,
            prefill_pruning_ratio=ratio, decode_pruning_ratio=ratio, layers_bypassed=bypassed,
            layers_total=self.num_layers, effective_sensitivity=sensitivity,
            quality=QualityReport(reference_agreement=1.0, reference_tokens=max_new_tokens, served_nll=0.7,
                                  continuation_agreement=1.0, dense_perplexity=2.0, pruned_perplexity=2.0,
                                  perplexity_delta_pct=0.0, continuation_tokens=max_new_tokens)
            if quality not in (False, "off") else None,
        )
        yield GenerationResult(text="x" * max_new_tokens, token_ids=list(range(max_new_tokens)), stats=stats,
                               logprobs=generated, prompt_logprobs=prompt_logprobs, prompt_text=prompt_text)


@pytest.fixture(scope="module")
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture(scope="module")
def client(registry: CollectorRegistry) -> Iterator[TestClient]:
    server_settings = ServerSettings(api_keys=[API_KEY], queue_depth=8, workers=1, max_prompt_tokens=200,
                                     max_tokens_limit=MAX_TOKENS_LIMIT, default_max_tokens=2,
                                     max_batch_size=MAX_BATCH, max_body_bytes=MAX_BODY_BYTES)
    app = create_app(FakeEngine(), server_settings, registry=registry)  # type: ignore[arg-type]
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


# -- the invariant ------------------------------------------------------------------------------


def documented(response: httpx.Response) -> dict[str, Any]:
    """Assert the invariant on one answer and return its JSON body ({} for a stream)."""
    event(f"HTTP {response.status_code}")  # the spread shows with --hypothesis-show-statistics
    assert response.status_code < 500, response.text
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        assert response.status_code == 200
        assert response.text.endswith("data: [DONE]\n\n") or '"error"' in response.text, response.text
        return {}
    body = response.json()
    if response.status_code >= 400:
        assert set(body) == {"error"}, body
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str)
        assert error["param"] is None or isinstance(error["param"], str)
        assert error["code"] is None or isinstance(error["code"], str)
    return body


def still_healthy(client: TestClient, registry: CollectorRegistry) -> None:
    """/health answers and no admission slot leaked: a refused or finished request holds none."""
    assert client.get("/health").status_code == 200
    assert registry.get_sample_value("prunewatch_requests_in_queue", {"model": MODEL}) == 0, "a slot leaked"


# -- JSON with values json.dumps cannot write ---------------------------------------------------


@dataclass(frozen=True)
class Digits:
    """An integer literal of `count` nines, written raw into the JSON (Python cannot str() it)."""

    count: int


_DIGITS = re.compile(r'"@@DIGITS(\d+)@@"')


def to_json(body: Any) -> bytes:
    """json.dumps, plus NaN/Infinity (allow_nan) and `Digits` as raw integer literals; lone
    surrogates are escaped as a JavaScript client escapes them (\\ud800)."""
    def default(value: Any) -> str:
        if isinstance(value, Digits):
            return f"@@DIGITS{value.count}@@"
        raise TypeError(type(value).__name__)

    text = json.dumps(body, default=default)
    return _DIGITS.sub(lambda m: "9" * int(m.group(1)), text).encode("ascii")


def post(client: TestClient, path: str, body: Any, headers: list[tuple[str, bytes]] | None = None) -> httpx.Response:
    return client.post(path, content=to_json(body),
                       headers=[*AUTH.items(), ("Content-Type", "application/json"), *(headers or [])])


# -- header values ------------------------------------------------------------------------------

# What an HTTP/1.1 server passes on as a header value: visible ASCII, Latin-1 (obs-text), inner
# spaces; the ends stripped as h11 strips them.
header_text = st.text(st.characters(codec="latin-1", exclude_categories=["Cc"]), max_size=24).map(
    lambda s: s.strip(" \t"))
long_digits = st.integers(1, 6000).map(lambda n: "9" * n)

# Each header's values: two branches of mostly valid values, one of anything (one_of picks a
# branch uniformly), so that valid header sets, which reach the engine, are not a rarity.
sensitivities = st.one_of(
    st.floats(0.0, 1.0).map(repr),
    st.sampled_from(["0", "1", "-0", " .5", "1e-400", "0.25", "1.", "+0.5", "nan", "1_0"]),
    st.one_of(st.floats().map(repr), long_digits, header_text,  # nan, inf, 1e308, 6000 digits
              st.from_regex(r"\A[+-]?[0-9]{0,3}(\.[0-9]{0,4})?([eE][+-]?[0-9]{1,4})?\Z"),
              st.sampled_from(["-inf", "Infinity", "0_0", "0x1", "½", "0.5\xa0"])),
)
layer_index = st.one_of(
    st.integers(0, NUM_LAYERS - 1).map(str),
    st.sampled_from(["", " 3", "011", "0" * 5000 + "3"]),  # "0...03" is layer 3, however many zeros
    st.one_of(st.integers(-3, 40).map(str), long_digits, st.sampled_from(["1.5", "a", "+1", "²", "0x2", "\xa0"])),
)
blacklists = st.one_of(st.lists(layer_index, max_size=5).map(",".join), header_text)
log_levels = st.one_of(
    st.sampled_from(["NONE", "SUMMARY", "DETAILED"]),
    st.sampled_from(["none", "Summary", " detailed", "LOUD", "DEBUG", "", "NONE\xa0"]),
    header_text)
qualities = st.one_of(
    st.sampled_from(["on", "off", "full"]),
    st.sampled_from(["ON", "true", "False", "1", "0", "yes", "", "maybe", "on\x85"]),
    header_text)
HEADER_VALUES = {ph.SENSITIVITY: sensitivities, ph.BLACKLIST: blacklists, ph.LOG_LEVEL: log_levels,
                 ph.QUALITY: qualities}


OWS = " \t"  # the only whitespace HTTP lets around a value


def sensitivity_ok(value: str) -> bool:
    text = value.strip(OWS)
    if "_" in text or not text.isascii():  # Decimal, unlike the documented format, takes "1_0"
        return False
    try:
        number = Decimal(text)
    except InvalidOperation:
        return False
    return number.is_finite() and 0 <= number <= 1


def layers_of(value: str) -> list[str]:
    """The comma-separated layer indices of a blacklist, leading zeros dropped (int() counts them)."""
    return [p.strip(OWS).lstrip("0") or "0" for p in value.split(",") if p.strip(OWS)]


def blacklist_ok(value: str) -> bool:
    return all(re.fullmatch(r"[0-9]{1,2}", p) and int(p) < NUM_LAYERS for p in layers_of(value))


HEADER_OK = {
    ph.SENSITIVITY: sensitivity_ok,
    ph.BLACKLIST: blacklist_ok,
    ph.LOG_LEVEL: lambda v: v.strip(OWS).upper() in {"NONE", "SUMMARY", "DETAILED"},
    ph.QUALITY: lambda v: v.strip(OWS).lower() in {"on", "off", "full", "true", "false", "1", "0"},
}


@st.composite
def pruning_headers(draw: st.DrawFn) -> dict[str, list[str]]:
    """Each X-Pruning-* header absent, sent once, or sent twice (equal or different values)."""
    headers: dict[str, list[str]] = {}
    for name, values in HEADER_VALUES.items():
        copies = draw(st.sampled_from([1, 0, 1, 2, 1, 0]))  # the first is the simplest, drawn most
        if copies:
            first = draw(values)
            headers[name] = [first, draw(st.one_of(st.just(first), values))] if copies == 2 else [first]
    return headers


ROUTES = ["chat", "chat-stream", "completion", "batch"]


def route_request(route: str) -> tuple[str, dict[str, Any]]:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    if route == "chat":
        return "/v1/chat/completions", chat
    if route == "chat-stream":
        return "/v1/chat/completions", {**chat, "stream": True}
    if route == "completion":
        return "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    return "/v1/batch", {"requests": [{"url": "/v1/chat/completions", "body": chat}]}


@FAST
@given(route=st.sampled_from(ROUTES), headers=pruning_headers())
# Known regressions run every time, whatever the draw: integers past int()'s limit, leading zeros
# that count against it, a repeated header.
@example(route="batch", headers={ph.BLACKLIST: ["9" * 5000]})
@example(route="chat", headers={ph.BLACKLIST: ["0" * 5000 + "3"]})
@example(route="completion", headers={ph.SENSITIVITY: ["9" * 5000], ph.QUALITY: ["on"]})
@example(route="chat-stream", headers={ph.LOG_LEVEL: ["NONE", "NONE"]})
def test_pruning_headers_get_a_200_or_a_400_naming_the_header(client: TestClient, registry: CollectorRegistry,
                                                              route: str, headers: dict[str, list[str]]) -> None:
    """A valid set of X-Pruning-* headers is served and reaches the engine as sent; an invalid or
    repeated one is a 400 whose `param` names it, on every generating route."""
    path, body = route_request(route)
    sent = [(name, value.encode("latin-1")) for name, values in headers.items() for value in values]
    response = post(client, path, body, sent)
    answer = documented(response)
    bad = {name for name, values in headers.items() if len(values) > 1 or not HEADER_OK[name](values[0])}
    if bad:
        assert response.status_code == 400, (headers, answer)
        assert answer["error"]["param"] in bad and answer["error"]["code"] == "invalid_header", answer
        assert len(answer["error"]["message"]) < 300, "a long header value came back whole"
    else:
        assert response.status_code == 200, (headers, answer)
        if route == "chat":
            stats = answer["prunewatch"]
            expected = float(headers[ph.SENSITIVITY][0]) if ph.SENSITIVITY in headers else DEFAULT_SENSITIVITY
            assert stats["sensitivity"] == expected
            blacklist = headers.get(ph.BLACKLIST, [""])[0]
            assert not {int(p) for p in layers_of(blacklist)} & set(stats["layers_bypassed"])
            assert (stats["quality"] is not None) == (headers.get(ph.QUALITY, ["off"])[0].strip(OWS).lower()
                                                      in {"on", "full", "true", "1"})
        if route == "batch":
            assert answer["data"][0]["status_code"] == 200
    still_healthy(client, registry)


# -- body fields --------------------------------------------------------------------------------

OK, ITEM, WHOLE = 0, 1, 2  # served; refused by the server's checks (per item in a batch); refused whole
ABSENT = object()  # the field is left out of the body

texts = st.text(max_size=20)
surrogate_text = st.tuples(texts, st.characters(categories=["Cs"]), texts).map("".join)
digits_ok = st.integers(3, JSON_INT_DIGITS).map(Digits)  # a valid JSON integer, far above any limit
digits_too_long = st.integers(JSON_INT_DIGITS + 1, 6000).map(Digits)


@dataclass(frozen=True)
class Field:
    """A body field's values by verdict: served (OK), refused by the server's own checks (ITEM),
    or refused for the whole request by the schema (422) or the JSON parser (400) (WHOLE)."""

    ok: st.SearchStrategy[Any]
    item: st.SearchStrategy[Any] | None = None
    whole: st.SearchStrategy[Any] | None = None

    @property
    def can_fail(self) -> bool:
        return self.item is not None or self.whole is not None

    def values(self, allow_whole: bool = True) -> st.SearchStrategy[tuple[Any, int]]:
        """Any of its values, each with its verdict."""
        options = [(self.ok, OK), (self.item, ITEM), (self.whole if allow_whole else None, WHOLE)]
        return st.one_of(*(s.map(lambda value, k=k: (value, k)) for s, k in options if s is not None))


MODES = ["valid", "a check fails", "the schema fails", "anything"]


@st.composite
def draw_fields(draw: st.DrawFn, spec: dict[str, Field], mode: str | None = None,
                allow_whole: bool = True) -> dict[str, tuple[Any, int]]:
    """Every field valid, exactly one refused by a server check, exactly one refused by the schema,
    or anything (`mode`; drawn when None): so each refusal is also met alone, and a valid request
    is not a rarity, as it is when every field is drawn independently."""
    if mode is None:
        mode = draw(st.sampled_from([m for m in MODES if allow_whole or m != "the schema fails"]))
    faulty_options = {"a check fails": [n for n, f in spec.items() if f.item is not None],
                      "the schema fails": [n for n, f in spec.items() if f.whole is not None]}.get(mode)
    faulty = draw(st.sampled_from(faulty_options)) if faulty_options else None
    drawn = {}
    for name, f in spec.items():
        if name == faulty:
            strategy = (f.item.map(lambda v: (v, ITEM)) if mode == "a check fails"  # type: ignore[union-attr]
                        else f.whole.map(lambda v: (v, WHOLE)))  # type: ignore[union-attr]
        else:
            strategy = f.values(allow_whole) if mode == "anything" else f.ok.map(lambda v: (v, OK))
        drawn[name] = draw(strategy)
    return drawn


def out_of(low: float, high: float) -> st.SearchStrategy[float]:
    """Floats a [low, high] range check must refuse: nan, the infinities, either side of the range."""
    return st.one_of(st.sampled_from([math.nan, math.inf, -math.inf]), st.floats(max_value=low - 1e-9),
                     st.floats(min_value=high + 1e-9))


def floats_within(high: float) -> Field:
    return Field(ok=st.one_of(st.just(ABSENT), st.none(), st.floats(0.0, high), st.integers(0, int(high))),
                 whole=st.one_of(out_of(0.0, high), st.sampled_from(["hot", [], {}]), digits_ok, digits_too_long))


def verdict_of_tokens(value: Any, known: bool) -> tuple[int | None, int]:
    """(count asked for, verdict) of a max_tokens-like value; `known` is False for a field the
    request type ignores, which only the JSON parser can refuse."""
    if isinstance(value, Digits) and value.count > JSON_INT_DIGITS:
        return None, WHOLE
    if not known or value is ABSENT or value is None:
        return None, OK
    if isinstance(value, Digits):
        return 10**30, OK
    if isinstance(value, int):  # True included: pydantic's lax mode reads it as 1
        return (int(value), OK) if value >= 1 else (None, WHOLE)
    return None, WHOLE


TOKENS = Field(ok=st.one_of(st.just(ABSENT), st.none(), st.integers(1, MAX_TOKENS_LIMIT), st.just(True)),
               item=st.one_of(st.integers(MAX_TOKENS_LIMIT + 1, 40), st.integers(10**6, 10**40), digits_ok),
               whole=st.one_of(st.integers(-5, 0), digits_too_long, st.sampled_from([1.5, "three", [], False])))
ROLES = st.sampled_from(["system", "developer", "user", "assistant"])
# Content of at most 20 characters: two messages stay within the 200-token prompt limit.
CONTENTS = st.one_of(texts, st.lists(st.builds(lambda t: {"type": "text", "text": t}, st.text(max_size=10)),
                                     max_size=2))
message = st.fixed_dictionaries({"role": ROLES, "content": CONTENTS})
bad_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["wizard", "", 3]), "content": CONTENTS}),
    st.fixed_dictionaries({"role": ROLES, "content": st.one_of(surrogate_text, st.sampled_from(
        [5, [{"type": "image", "url": "x"}], [{"type": "text", "text": "\ud800"}]]))}),
)
MESSAGES = Field(ok=st.lists(message, min_size=1, max_size=2),
                 item=st.just([{"role": "user", "content": "x" * 300}]),  # over the prompt limit: 413
                 whole=st.one_of(st.sampled_from([[], ABSENT, "hi"]),
                                 st.tuples(st.lists(message, max_size=1), bad_message).map(lambda t: [*t[0], t[1]])))


COMMON_FIELDS = {
    "model": Field(ok=st.just(MODEL), item=texts.filter(lambda t: t != MODEL),
                   whole=st.one_of(surrogate_text, st.sampled_from([ABSENT, None, 5, []]))),
    "temperature": floats_within(2.0),
    "top_p": floats_within(1.0),
    "n": Field(ok=st.sampled_from([ABSENT, None, 1]), whole=st.sampled_from([0, 2, "one", 10**40])),
    "stream": Field(ok=st.sampled_from([ABSENT, None, False, True]), whole=st.sampled_from(["maybe", 2, []])),
    "stream_options": Field(ok=st.sampled_from([ABSENT, None, {}, {"include_usage": True}]),
                            whole=st.sampled_from([5, {"include_usage": "often"}])),
    "stop": Field(ok=st.sampled_from([ABSENT, None, "", [], "\n", ["end", "."], ["a", "b", "c", "d", "<eos>"]]),
                  item=st.sampled_from([[f"s{i}" for i in range(17)], ["ok", ""], "x" * 257]),
                  whole=st.one_of(surrogate_text, st.sampled_from([5, [5]]))),
    "seed": Field(ok=st.one_of(st.just(ABSENT), st.none(), st.integers(-10**40, 10**40), digits_ok),
                  whole=st.one_of(digits_too_long, st.sampled_from(["s", 1.5, []]))),
    "user": Field(ok=st.one_of(st.just(ABSENT), texts), whole=st.one_of(surrogate_text, st.just(7))),
    "unknown_option": Field(ok=st.one_of(st.just(ABSENT), st.integers(), texts, st.just([None]))),  # ignored
    "max_tokens": TOKENS,
    "max_completion_tokens": TOKENS,
}
token_ids = st.lists(st.integers(0, 255), min_size=1, max_size=20)  # FakeEngine's vocabulary: bytes
PROMPT = Field(ok=st.one_of(st.text(min_size=1, max_size=20), st.lists(st.text(min_size=1, max_size=20), min_size=1,
                                                                          max_size=1),  # a list holding one prompt
                            token_ids, token_ids.map(lambda ids: [ids])),  # token ids, or a list holding them
               item=st.sampled_from(["", "x" * 300, [""], [256], [[7, 10**40]], [1] * 300]),  # empty: 400; long: 413
               whole=st.one_of(surrogate_text, st.sampled_from([ABSENT, 5, None, [], ["a", "b"], [-1], [[]], [1.5],
                                                                [[1], [2]], [True]])))
# Options this server cannot honour: their neutral values pass, anything that asks for them is refused.
CHAT_ONLY = {
    "logprobs": Field(ok=st.sampled_from([ABSENT, None, False, True]), whole=st.sampled_from(["maybe", 5, []])),
    # 1..20 ask for alternatives, which needs logprobs: true (generation_bodies serves them when it is)
    "top_logprobs": Field(ok=st.sampled_from([ABSENT, None, 0]), item=st.sampled_from([1, 20]),
                          whole=st.sampled_from([21, -1, "two"])),
}
COMPLETION_ONLY = {
    "logprobs": Field(ok=st.sampled_from([ABSENT, None, 0, 1, 5]), whole=st.sampled_from([6, -1, "many", 1.5])),
    "echo": Field(ok=st.sampled_from([ABSENT, None, False, True]), whole=st.sampled_from(["maybe", 2])),
    "best_of": Field(ok=st.sampled_from([ABSENT, None, 1]), whole=st.sampled_from([0, 2])),
    "suffix": Field(ok=st.sampled_from([ABSENT, None]), whole=st.sampled_from(["end", 3])),
}


@st.composite
def generation_bodies(draw: st.DrawFn, kind: str, mode: str | None = None,
                      allow_whole: bool = True) -> tuple[dict[str, Any], int]:
    """(body, verdict) of a chat or completion request."""
    own = {"messages": MESSAGES, **CHAT_ONLY} if kind == "chat" else {"prompt": PROMPT, **COMPLETION_ONLY}
    drawn = draw(draw_fields({**COMMON_FIELDS, **own}, mode, allow_whole))
    body = {name: value for name, (value, _) in drawn.items() if value is not ABSENT}
    if kind == "chat" and drawn["top_logprobs"][1] == ITEM and body.get("logprobs") is True:
        drawn["top_logprobs"] = (body["top_logprobs"], OK)  # alternatives with logprobs: served
    verdict = max(v for name, (_, v) in drawn.items() if not name.startswith("max_"))
    max_tokens, tokens_verdict = verdict_of_tokens(body.get("max_tokens"), known=True)
    if kind == "completion" and isinstance(body.get("max_tokens"), int) and body["max_tokens"] == 0:
        # a completion's max_tokens 0 (False reads as 0) scores an echoed prompt; without echo it is refused
        max_tokens, tokens_verdict = 0, (OK if body.get("echo") is True else ITEM)
    max_completion_tokens, completion_verdict = verdict_of_tokens(body.get("max_completion_tokens"),
                                                                  known=kind == "chat")
    verdict = max(verdict, tokens_verdict, completion_verdict)
    if verdict == OK and (max_completion_tokens or max_tokens or 2) > MAX_TOKENS_LIMIT:
        verdict = ITEM
    event(f"{kind}: {['valid', 'refused by a check', 'refused by the schema'][verdict]}")
    return body, verdict


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["chat", "completion"])
@settings(FAST, max_examples=15)  # x 8 cases
@given(drawn=st.data())
def test_chat_and_completion_bodies_are_served_or_refused_with_a_4xx(
        client: TestClient, registry: CollectorRegistry, kind: str, mode: str, drawn: st.DataObject) -> None:
    """Every field of a chat or completion body, valid or not, numbers past every limit included:
    a valid body is served (streamed when asked), any other gets a documented 4xx."""
    body, verdict = drawn.draw(generation_bodies(kind, mode))
    response = post(client, "/v1/chat/completions" if kind == "chat" else "/v1/completions", body)
    answer = documented(response)
    if verdict == OK:
        assert response.status_code == 200, (body, answer)
        if body.get("stream") is not True:
            assert answer["object"] == ("chat.completion" if kind == "chat" else "text_completion")
            assert answer["usage"]["completion_tokens"] <= MAX_TOKENS_LIMIT
    else:
        assert 400 <= response.status_code < 500, (body, answer)
    still_healthy(client, registry)


PRUNING_FIELDS = {
    "sensitivity": Field(ok=st.one_of(st.just(ABSENT), st.none(), st.floats(0.0, 1.0)),
                         whole=st.one_of(out_of(0.0, 1.0), digits_too_long, st.just("high"))),
    "layer_blacklist": Field(
        ok=st.one_of(st.just(ABSENT), st.none(), st.lists(st.integers(0, NUM_LAYERS - 1), max_size=4)),
        item=st.one_of(st.lists(st.integers(NUM_LAYERS, 10**40), min_size=1, max_size=2),
                       digits_ok.map(lambda d: [d])),  # out of range: 400 for the item
        whole=st.one_of(st.sampled_from([[-1], [1.5], ["a"], "1,2"]), digits_too_long.map(lambda d: [d]))),
    "log_level": Field(ok=st.sampled_from([ABSENT, None, "NONE", "SUMMARY", "DETAILED"]),
                       whole=st.sampled_from(["detailed", "LOUD", 3])),
    "quality": Field(ok=st.sampled_from([ABSENT, None, True, False]), whole=st.sampled_from(["perhaps", []])),
    "unknown": Field(ok=st.just(ABSENT), whole=st.just(1)),  # a pruning object forbids other keys
}
ITEM_FIELDS = {
    "custom_id": Field(ok=st.one_of(st.just(ABSENT), texts),
                       whole=st.one_of(surrogate_text, st.sampled_from(["c" * 257, 9]))),
    "url_ok": Field(ok=st.just(True), whole=st.sampled_from(["/v1/embeddings", None])),
}


@st.composite
def batch_items(draw: st.DrawFn, allow_whole: bool) -> tuple[dict[str, Any], int]:
    kind = draw(st.sampled_from(["chat", "completion"]))
    body, verdict = draw(generation_bodies(kind, allow_whole=allow_whole))
    if body.get("stream") is True and verdict == OK:
        verdict = ITEM  # stream is not allowed inside a batch
    drawn = draw(draw_fields(ITEM_FIELDS, allow_whole=allow_whole))
    url = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    item = {"url": url if drawn["url_ok"][0] is True else drawn["url_ok"][0], "body": body}
    if drawn["custom_id"][0] is not ABSENT:
        item["custom_id"] = drawn["custom_id"][0]
    verdicts = [verdict, *(v for _, v in drawn.values())]
    if draw(st.booleans()):
        pruning = draw(draw_fields(PRUNING_FIELDS, allow_whole=allow_whole))
        item["pruning"] = {name: value for name, (value, _) in pruning.items() if value is not ABSENT}
        verdicts += [v for _, v in pruning.values()]
    return item, max(verdicts)


@FAST
@given(drawn=st.data(), allow_whole=st.booleans())
def test_batch_items_get_their_own_answer_and_a_bad_batch_a_4xx(
        client: TestClient, registry: CollectorRegistry, drawn: st.DataObject, allow_whole: bool) -> None:
    """A batch the schema accepts is a 200 whose items are each served or refused on their own;
    one the schema refuses (or that is too long) is a documented 4xx as a whole. Half the batches
    hold no schema error, so that mixed batches of served and refused items are common."""
    items = drawn.draw(st.lists(batch_items(allow_whole), min_size=1, max_size=MAX_BATCH + 1))
    response = post(client, "/v1/batch", {"requests": [item for item, _ in items]})
    answer = documented(response)
    if any(verdict == WHOLE for _, verdict in items) or len(items) > MAX_BATCH:
        assert 400 <= response.status_code < 500, (items, answer)
        still_healthy(client, registry)
        return
    assert response.status_code == 200, (items, answer)
    assert [result["index"] for result in answer["data"]] == list(range(len(items)))
    for result, (item, verdict) in zip(answer["data"], items):
        assert result["custom_id"] == item.get("custom_id")
        if verdict == OK:
            assert (result["status_code"], result["error"]) == (200, None), (item, result)
        else:
            assert 400 <= result["status_code"] < 500 and result["response"] is None, (item, result)
            assert set(result["error"]) == {"message", "type", "param", "code"}
            assert result["error"]["param"] is None or result["error"]["param"].startswith("requests.")
    still_healthy(client, registry)


# -- framing, routes and the query string -------------------------------------------------------

GENERATING = ["/v1/chat/completions", "/v1/completions", "/v1/batch"]


@FAST
@given(path=st.sampled_from(GENERATING), chunked=st.booleans(),
       size=st.one_of(st.integers(0, 1024), st.integers(MAX_BODY_BYTES - 2, MAX_BODY_BYTES + 2),
                      st.integers(MAX_BODY_BYTES, 2 * MAX_BODY_BYTES)),
       content_type=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded",
                                     "multipart/form-data; boundary=x", ""]),
       filler=st.binary(min_size=1, max_size=8))
def test_any_body_bytes_get_a_4xx_and_413_exactly_when_too_large(
        client: TestClient, registry: CollectorRegistry, path: str, size: int, chunked: bool, content_type: str,
        filler: bytes) -> None:
    """Bytes that are not a request (or are too many), with or without Content-Length: 413 exactly
    when the body is over the limit, some other documented 4xx otherwise."""
    body = (filler * (size // len(filler) + 1))[:size]
    headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}
    content: bytes | Iterator[bytes] = body
    if chunked:  # no Content-Length: Transfer-Encoding: chunked, in pieces
        content = iter([body[i:i + 4096] for i in range(0, len(body), 4096)])
    response = client.post(path, content=content, headers=headers)
    answer = documented(response)
    if size > MAX_BODY_BYTES:
        assert response.status_code == 413 and answer["error"]["code"] == "request_too_large", answer
    else:
        assert 400 <= response.status_code < 500 and response.status_code != 413, (body[:80], answer)
    still_healthy(client, registry)


query_names = st.one_of(st.sampled_from(["api_key", "key", "access_token", "token", "model", "q"]), texts)
query_values = st.one_of(texts, st.just(API_KEY), st.from_regex(r"\Ask-[0-9a-f]{16}\Z"))


@FAST
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
       path=st.sampled_from([*GENERATING, "/v1/models", f"/v1/models/{MODEL}", "/v1/models/other", "/metrics",
                             "/health", "/nowhere"]),
       query=st.lists(st.tuples(query_names, query_values), max_size=3),
       authorized=st.sampled_from([True, True, False]))
def test_any_route_method_and_query_string_gets_a_documented_answer(
        client: TestClient, registry: CollectorRegistry, method: str, path: str, query: list[tuple[str, str]],
        authorized: bool) -> None:
    """Query parameters are never read: a key there authorizes nothing and is never echoed."""
    response = client.request(method, path, params=query, headers=AUTH if authorized else {})
    if path != "/metrics" or response.status_code != 200:
        documented(response)
    if not authorized and path != "/health":
        assert response.status_code == 401, response.text
    for _, value in query:
        if value.startswith("sk-"):
            assert value not in response.text
    still_healthy(client, registry)
