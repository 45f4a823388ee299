"""`logprobs`, `top_logprobs` and `echo` over HTTP, as OpenAI documents them, on the probe model.

The server runs the engine's default settings (activation sparsity and the output-head shortlist at the
default sensitivity), so pruned answers really skip work. Dense numbers are checked against transformers
itself: the same folder loaded without the engine, one teacher-forced pass, fp32 log-softmax.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch
from prometheus_client import CollectorRegistry
from transformers import AutoModelForCausalLM

from prunewatch.engine.pruning_engine import PruningEngine
from prunewatch.server import ServerSettings, build_engine, create_app, serve_in_background

API_KEY = "sk-prunewatch-logprobs-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
DENSE = {**AUTH, "X-Pruning-Sensitivity": "0"}
PROMPT = "Explain why decoding at batch size one is limited by memory bandwidth."
QUESTION = "Question: Which command shows the routing table of a Debian server?\nAnswer: ip route"
CHAT = [{"role": "user", "content": "How do you show the routing table of a Debian server?"}]


@pytest.fixture(scope="module")
def engine(probe_model_dir, calibration_dir) -> PruningEngine:
    """The engine `prunewatch serve` runs (default settings), calibrated once per test session."""
    return build_engine(probe_model_dir, sensitivity=0.5, device="cpu", calibration_dir=calibration_dir)


@pytest.fixture(scope="module")
def base_url(engine: PruningEngine) -> Iterator[str]:
    settings = ServerSettings(api_keys=[API_KEY], queue_depth=8, workers=1, max_prompt_tokens=200,
                              max_tokens_limit=16, default_max_tokens=4)
    with serve_in_background(create_app(engine, settings, registry=CollectorRegistry())) as url:
        yield url


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def reference(probe_model_dir):
    return AutoModelForCausalLM.from_pretrained(probe_model_dir, dtype=torch.float32).eval()


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """(T - 1, V): row t is the fp32 log-distribution of token t + 1 of `ids`, under plain transformers."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def complete(http: httpx.Client, headers: dict[str, str] = AUTH, **body: Any) -> dict[str, Any]:
    response = http.post("/v1/completions", json={"model": "probe-llama", **body}, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


def chat(http: httpx.Client, headers: dict[str, str] = AUTH, **body: Any) -> dict[str, Any]:
    response = http.post("/v1/chat/completions", json={"model": "probe-llama", "messages": CHAT, **body},
                         headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


def events(http: httpx.Client, path: str, body: dict[str, Any], headers: dict[str, str] = DENSE) -> list[dict]:
    with http.stream("POST", path, json={"model": "probe-llama", "stream": True, **body}, headers=headers) as stream:
        assert stream.status_code == 200
        lines = [line[len("data: "):] for line in stream.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def refused(http: httpx.Client, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    response = http.post(path, json={"model": "probe-llama", **body}, headers=AUTH)
    return response.status_code, response.json()["error"]


# -- shapes -------------------------------------------------------------------------------------


def test_echo_with_one_new_token_is_what_lm_eval_reads(http: httpx.Client, engine: PruningEngine) -> None:
    """lm-eval's loglikelihood request: every prompt token, then exactly one generated token."""
    answer = complete(http, prompt=QUESTION, max_tokens=1, logprobs=1, echo=True, temperature=0, seed=1234)
    (choice,) = answer["choices"]
    logprobs = choice["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    prompt_ids = engine.render_raw(QUESTION)
    assert answer["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 1,
                               "total_tokens": len(prompt_ids) + 1,
                               "prompt_tokens_details": {"cached_tokens": 0}}  # every prompt position is scored
    assert all(len(values) == len(prompt_ids) + 1 for values in logprobs.values())
    assert logprobs["tokens"][:-1] == [engine.token_texts.text(i) for i in prompt_ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert choice["text"].startswith(QUESTION) and choice["index"] == 0
    for token, value, top in zip(logprobs["tokens"][1:], logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:]):
        assert value <= 0.0 and 1 <= len(top) <= 2 and top[token] == value  # the most likely, and the token itself
    for token, offset in zip(logprobs["tokens"], logprobs["text_offset"]):
        assert choice["text"][offset:offset + len(token)] == token
    assert logprobs["text_offset"][-1] == len(QUESTION)  # the generated token follows the echoed prompt


def test_no_new_tokens_with_echo_scores_the_prompt_alone(http: httpx.Client, engine: PruningEngine) -> None:
    one = complete(http, DENSE, prompt=QUESTION, max_tokens=1, logprobs=2, echo=True)
    none = complete(http, DENSE, prompt=QUESTION, max_tokens=0, logprobs=2, echo=True)
    (choice,) = none["choices"]
    assert choice["text"] == QUESTION and choice["finish_reason"] == "length"
    assert none["usage"]["completion_tokens"] == 0
    assert none["prunewatch"]["executed_flops"] > 0  # the prompt's forward pass ran and was counted
    assert choice["logprobs"] == {key: values[:-1] for key, values in one["choices"][0]["logprobs"].items()}
    echo_only = complete(http, DENSE, prompt=QUESTION, max_tokens=0, echo=True)
    assert echo_only["choices"][0]["text"] == QUESTION and echo_only["choices"][0]["logprobs"] is None


def test_token_id_prompts_are_read_as_given(http: httpx.Client, engine: PruningEngine) -> None:
    ids = engine.render_raw(QUESTION)
    answers = [complete(http, DENSE, prompt=prompt, max_tokens=3, logprobs=1, echo=True)
               for prompt in (QUESTION, ids, [ids], [QUESTION])]
    assert all(a["choices"] == answers[0]["choices"] and a["usage"] == answers[0]["usage"] for a in answers)
    # Special tokens in ids are the caller's: read as sent, echoed as their text.
    eos = engine.loaded.tokenizer.eos_token_id
    special = complete(http, DENSE, prompt=[eos, *ids], max_tokens=1, logprobs=0, echo=True)["choices"][0]
    assert special["text"].startswith(engine.loaded.tokenizer.eos_token + QUESTION)
    assert special["logprobs"]["tokens"][0] == engine.loaded.tokenizer.eos_token


def test_chat_logprobs_have_openai_shape(http: httpx.Client) -> None:
    answer = chat(http, max_tokens=6, logprobs=True, top_logprobs=3)
    (choice,) = answer["choices"]
    content = choice["logprobs"]["content"]
    assert len(content) == answer["usage"]["completion_tokens"]
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 3
        assert all(set(t) == {"token", "logprob", "bytes"} for t in entry["top_logprobs"])
        assert entry["top_logprobs"][0]["logprob"] >= entry["logprob"]
    assert bytes(b for entry in content for b in entry["bytes"]).decode() == choice["message"]["content"]
    plain = chat(http, max_tokens=6, logprobs=True)["choices"][0]["logprobs"]["content"]
    assert [e["top_logprobs"] for e in plain] == [[]] * len(plain)
    assert chat(http, max_tokens=6)["choices"][0]["logprobs"] is None


def test_the_openai_sdk_reads_them(base_url: str) -> None:
    sdk = openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    completion = sdk.completions.create(model="probe-llama", prompt=QUESTION, max_tokens=2, logprobs=2, echo=True)
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.token_logprobs[0] is None
    assert len(logprobs.tokens or []) == completion.usage.prompt_tokens + 2
    answer = sdk.chat.completions.create(model="probe-llama", messages=CHAT, max_tokens=3, logprobs=True,
                                         top_logprobs=2)
    content = answer.choices[0].logprobs.content
    assert content and content[0].top_logprobs[0].token and isinstance(content[0].logprob, float)


# -- numbers ------------------------------------------------------------------------------------


def test_dense_logprobs_equal_the_models_own(http: httpx.Client, engine: PruningEngine, reference) -> None:
    """At sensitivity 0 the served logprobs are transformers' log-softmax, to 1e-4, for every token and its top 5."""
    answer = complete(http, DENSE, prompt=PROMPT, max_tokens=6, logprobs=5, echo=True)
    assert answer["prunewatch"]["pruning_ratio"] == 0.0
    logprobs = answer["choices"][0]["logprobs"]
    prompt_ids = engine.render_raw(PROMPT)
    answer_ids = engine.generate(PROMPT, prompt_ids=prompt_ids, max_new_tokens=6, sensitivity=0.0).token_ids
    ids = prompt_ids + answer_ids
    assert len(logprobs["token_logprobs"]) == len(ids)
    expected = reference_logprobs(reference, ids)
    served = torch.tensor(logprobs["token_logprobs"][1:])
    assert torch.allclose(served, expected.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0], atol=1e-4)
    for top, row in zip(logprobs["top_logprobs"][1:], expected):
        values, top_ids = row.topk(5)
        want = dict.fromkeys(engine.token_texts.text(i) for i in top_ids.tolist())  # token texts, most likely first
        assert list(top)[:len(want)] == list(want)
        assert torch.allclose(torch.tensor(list(top.values())[:5]), values[:len(want)], atol=1e-4)

    content = chat(http, DENSE, max_tokens=6, logprobs=True)["choices"][0]["logprobs"]["content"]
    chat_ids = engine.render_prompt(messages=CHAT)
    chat_answer = engine.generate(messages=CHAT, prompt_ids=chat_ids, max_new_tokens=6, sensitivity=0.0).token_ids
    rows = reference_logprobs(reference, chat_ids + chat_answer)[len(chat_ids) - 1:]
    want = rows.gather(-1, torch.tensor(chat_answer)[:, None])[:, 0]
    assert torch.allclose(torch.tensor([e["logprob"] for e in content]), want, atol=1e-4)


def test_pruned_logprobs_differ_where_the_plan_skips_work(http: httpx.Client) -> None:
    pruned = complete(http, prompt=PROMPT, max_tokens=6, logprobs=1, echo=True)
    dense = complete(http, DENSE, prompt=PROMPT, max_tokens=6, logprobs=1, echo=True)
    stats = pruned["prunewatch"]
    assert stats["pruning_ratio"] > 0.0 and stats["executed_flops"] < stats["dense_flops"]
    assert stats["prefill_pruning_ratio"] > 0.0  # the echoed prompt's rows ran under the plan too
    n = len(dense["choices"][0]["logprobs"]["tokens"]) - 6  # prompt positions, the same tokens in both
    gaps = [abs(p - d) for p, d in zip(pruned["choices"][0]["logprobs"]["token_logprobs"][1:n],
                                       dense["choices"][0]["logprobs"]["token_logprobs"][1:n])]
    assert max(gaps) > 1e-3, gaps
    # Echo asks for more, never for another answer: the same text and stats as without it.
    plain = complete(http, prompt=PROMPT, max_tokens=6)
    assert pruned["choices"][0]["text"] == PROMPT + plain["choices"][0]["text"]
    assert plain["prunewatch"]["decode_pruning_ratio"] == stats["decode_pruning_ratio"]


# -- streaming ----------------------------------------------------------------------------------


def test_streamed_chunks_carry_the_logprobs_of_their_tokens(http: httpx.Client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 8, "logprobs": 2, "echo": True}
    whole = complete(http, DENSE, **body)["choices"][0]
    chunks = [e["choices"][0] for e in events(http, "/v1/completions", body)]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert chunks[0]["text"] == PROMPT  # the echo comes first, with the prompt's logprobs
    joined: dict[str, list] = {key: [] for key in whole["logprobs"]}
    for c in chunks:
        for key, values in (c["logprobs"] or {}).items():
            joined[key] += values
    assert joined == whole["logprobs"]

    whole_chat = chat(http, DENSE, max_tokens=8, logprobs=True, top_logprobs=2)["choices"][0]["logprobs"]["content"]
    streamed = [entry for e in events(http, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 8,
                                                                     "logprobs": True, "top_logprobs": 2})
                for entry in ((e["choices"][0]["logprobs"] or {}).get("content") or [])]
    assert streamed == whole_chat


# -- refusals -----------------------------------------------------------------------------------


def test_bad_combinations_are_refused_naming_the_field(http: httpx.Client) -> None:
    status, error = refused(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0})
    assert (status, error["param"], error["code"]) == (400, "max_tokens", "invalid_value")
    assert "echo" in error["message"]
    status, error = refused(http, "/v1/completions", {"prompt": PROMPT, "logprobs": 6})
    assert (status, error["param"]) == (422, "logprobs") and "less than or equal to 5" in error["message"]
    status, error = refused(http, "/v1/completions", {"prompt": [PROMPT, PROMPT], "echo": True, "logprobs": 1})
    assert (status, error["param"]) == (422, "prompt") and "one prompt per request" in error["message"]
    status, error = refused(http, "/v1/completions", {"prompt": [[1, 2], [3]], "echo": True})
    assert (status, error["param"]) == (422, "prompt") and "got a list of 2" in error["message"]
    status, error = refused(http, "/v1/completions", {"prompt": [5, 10**6]})
    assert (status, error["param"]) == (400, "prompt") and "1000000" in error["message"]
    status, error = refused(http, "/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2})
    assert (status, error["param"], error["message"]) == (400, "top_logprobs", "top_logprobs needs logprobs: true")
    status, error = refused(http, "/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21})
    assert (status, error["param"]) == (422, "top_logprobs")
    status, error = refused(http, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 0})
    assert (status, error["param"]) == (422, "max_tokens")  # chat has no echo, so nothing to score without tokens
    batch = http.post("/v1/batch", headers=AUTH, json={"requests": [
        {"url": "/v1/completions", "body": {"model": "probe-llama", "prompt": PROMPT, "max_tokens": 0}},
        {"url": "/v1/completions", "body": {"model": "probe-llama", "prompt": PROMPT, "max_tokens": 0, "echo": True,
                                            "logprobs": 0}}]}).json()["data"]
    assert [item["status_code"] for item in batch] == [400, 200]
    assert batch[0]["error"]["param"] == "requests.0.body.max_tokens"
    assert len(batch[1]["response"]["choices"][0]["logprobs"]["tokens"]) == batch[1]["response"]["usage"]["prompt_tokens"]


def test_more_stop_sequences_than_openai_allows(http: httpx.Client) -> None:
    """lm-eval's completions send a task's `until` strings plus the end-of-sequence text: 5 for a task with 4."""
    whole = complete(http, DENSE, prompt=PROMPT, max_tokens=16)["choices"][0]["text"]
    at = next(i for i in range(len(whole) // 2, len(whole) - 2) if whole.find(whole[i:i + 2]) == i)
    stops = ["\x00a", "\x00b", "\x00c", "</s>", whole[at:at + 2]]
    cut = complete(http, DENSE, prompt=PROMPT, max_tokens=16, stop=stops, logprobs=0)["choices"][0]
    assert cut["text"] == whole[:at] and cut["finish_reason"] == "stop"
    assert all(offset < at for offset in cut["logprobs"]["text_offset"])
    status, error = refused(http, "/v1/completions", {"prompt": PROMPT, "stop": [f"s{i}" for i in range(17)]})
    assert (status, error["param"], error["message"]) == (400, "stop", "at most 16 stop sequences, got 17")


def test_logprob_values_are_finite_json_numbers(http: httpx.Client) -> None:
    answer = complete(http, prompt=PROMPT, max_tokens=4, logprobs=5, echo=True)
    values = [v for v in answer["choices"][0]["logprobs"]["token_logprobs"] if v is not None]
    values += [v for top in answer["choices"][0]["logprobs"]["top_logprobs"] if top for v in top.values()]
    assert values and all(math.isfinite(v) and v <= 0.0 for v in values)
