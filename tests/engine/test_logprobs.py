"""Log-probabilities from the engine's own decode loop: the dense model's exactly, the pruned plan's when pruned.

The reference is computed apart from the engine: a plain transformers model loaded from the same folder
(no wrapped blocks, no plan), one teacher-forced forward pass over prompt + answer, fp32 log-softmax.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from prunewatch.engine import pruning_engine
from prunewatch.engine.errors import InvalidRequestError
from prunewatch.engine.logprobs import LOGPROB_FLOOR, TokenTexts, score_positions
from prunewatch.engine.pruning_engine import TokenDelta
from prunewatch.engine.quality import teacher_forced_logits
from prunewatch.engine.stats import GenerationResult

PROMPT = "The router forwards packets to the next hop listed in the routing table, and"  # in the tech domain
UNICODE = "Crème brûlée — 日本語 🎉: the routing table"
TOKENS = 8
TOP = 3


@pytest.fixture(scope="module")
def reference(probe_model_dir):
    """The probe model as transformers loads it, outside the engine."""
    return AutoModelForCausalLM.from_pretrained(probe_model_dir, dtype=torch.float32).eval()


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """(T - 1, V) fp32 log-probabilities of positions 1..T-1 of `ids` under `model`."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()  # (T, V)
    return torch.log_softmax(logits, dim=-1)[:-1]


def echo(engine, prompt: str = PROMPT, **kwargs) -> GenerationResult:
    ids = engine.render_raw(prompt)
    return engine.generate(prompt, prompt_ids=ids, max_new_tokens=kwargs.pop("max_new_tokens", TOKENS),
                           logprobs=kwargs.pop("logprobs", TOP), echo=True, **kwargs)


def values(result: GenerationResult) -> list[float | None]:
    return [e.logprob for e in (result.prompt_logprobs or []) + (result.logprobs or [])]


def test_dense_logprobs_equal_the_models_own_log_softmax(probe_engine, reference) -> None:
    result = echo(probe_engine, sensitivity=0.0)
    prompt_ids = probe_engine.render_raw(PROMPT)
    ids = prompt_ids + result.token_ids
    assert [e.token_id for e in result.prompt_logprobs + result.logprobs] == ids
    expected = reference_logprobs(reference, ids)  # row t scores token t + 1
    got = values(result)
    assert got[0] is None and result.prompt_logprobs[0].top == ()  # nothing predicts the first token
    want = expected.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(got[1:]), want, atol=1e-4), (got[1:], want)
    for entry, row in zip(result.prompt_logprobs[1:] + result.logprobs, expected):
        top_values, top_ids = row.topk(TOP)
        assert [t.token_id for t in entry.top] == top_ids.tolist()
        assert torch.allclose(torch.tensor([t.logprob for t in entry.top]), top_values, atol=1e-4)
    # Greedy: each answer token is its position's most likely, and carries exactly the first top entry's value.
    for entry in result.logprobs:
        assert entry.token_id == entry.top[0].token_id and entry.logprob == entry.top[0].logprob


def test_pruned_logprobs_are_the_pruned_plans_not_the_dense_models(probe_engine, reference) -> None:
    result = echo(probe_engine, sensitivity=1.0)
    assert result.stats.pruning_ratio > 0.0 and result.stats.layers_bypassed  # the plan skips blocks
    prompt_ids = probe_engine.render_raw(PROMPT)
    ids = prompt_ids + result.token_ids
    dense = reference_logprobs(reference, ids).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    got = torch.tensor(values(result)[1:])
    assert (got - dense).abs().max() > 1e-2  # pruning changed the model's probabilities
    # ... into those of the plan the request ran: the same plan, teacher-forced over the same tokens.
    plan = probe_engine.execution_plan(prompt_ids, 1.0, [], prompt_text=PROMPT)
    assert plan.bypass == frozenset(result.stats.layers_bypassed)
    logits = teacher_forced_logits(probe_engine.instrumented.model, torch.tensor([ids]), plan)[:-1]
    planned = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert torch.allclose(got, planned, atol=1e-4)


def test_echo_changes_neither_the_answer_nor_its_logprobs(probe_engine) -> None:
    ids = probe_engine.render_raw(PROMPT)
    for sensitivity in (0.0, 1.0):
        plain = probe_engine.generate(PROMPT, prompt_ids=ids, max_new_tokens=TOKENS, sensitivity=sensitivity,
                                      logprobs=TOP)
        echoed = echo(probe_engine, sensitivity=sensitivity)
        assert echoed.token_ids == plain.token_ids and echoed.text == plain.text
        assert plain.prompt_logprobs is None and plain.prompt_text is None
        assert torch.allclose(torch.tensor([e.logprob for e in echoed.logprobs]),
                              torch.tensor([e.logprob for e in plain.logprobs]), atol=1e-5)
        # The prompt's rows went through the output head as well: more prefill work, counted, never over dense.
        assert echoed.stats.dense_flops > plain.stats.dense_flops
        assert 0.0 <= echoed.stats.prefill_pruning_ratio <= 1.0


def test_no_new_tokens_with_echo_scores_the_prompt_only(probe_engine) -> None:
    with_one = echo(probe_engine, max_new_tokens=1, sensitivity=0.0)
    only = echo(probe_engine, max_new_tokens=0, sensitivity=0.0)
    assert only.token_ids == [] and only.text == "" and only.logprobs == []
    assert only.stats.completion_tokens == 0 and only.stats.finish_reason == "length"
    assert only.prompt_text == PROMPT and only.prompt_logprobs == with_one.prompt_logprobs
    assert only.stats.dense_flops > 0  # the prompt's forward pass ran, and was counted
    with pytest.raises(InvalidRequestError, match="max_new_tokens must be >= 1, got 0"):
        probe_engine.generate(PROMPT, max_new_tokens=0)
    with pytest.raises(InvalidRequestError, match="logprobs must be within 0..20, got 21"):
        probe_engine.generate(PROMPT, max_new_tokens=1, logprobs=21)


def test_no_logprobs_asked_for_means_no_log_softmax(probe_engine, monkeypatch) -> None:
    calls = []

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return score_positions(*args, **kwargs)

    monkeypatch.setattr(pruning_engine, "score_positions", counting)
    probe_engine.generate(PROMPT, max_new_tokens=4, sensitivity=0.0)
    probe_engine.generate(PROMPT, max_new_tokens=4, sensitivity=0.0, echo=True)  # echo alone needs no scores
    assert calls == []
    result = probe_engine.generate(PROMPT, max_new_tokens=4, sensitivity=0.0, logprobs=0)
    assert len(calls) == result.stats.completion_tokens and all(shape[0] == 1 for shape in calls)  # a row a step


def test_offsets_and_bytes_locate_every_token_in_the_text(probe_engine) -> None:
    result = echo(probe_engine, UNICODE, sensitivity=0.0, max_new_tokens=12)
    assert result.prompt_text == UNICODE
    special = set(probe_engine.loaded.tokenizer.all_special_ids)  # an end of sequence adds no text to the answer
    for text, entries in ((result.prompt_text, result.prompt_logprobs), (result.text, result.logprobs)):
        offsets = [e.offset for e in entries]
        assert offsets == sorted(offsets) and all(0 <= at <= len(text) for at in offsets)
        for entry in entries:
            if "\ufffd" not in entry.text and entry.token_id not in special:  # whole characters: found where it says
                assert text[entry.offset:entry.offset + len(entry.text)] == entry.text
    # Bytes are each token's own, so they add up to the text even where a character spans two tokens.
    assert any("\ufffd" in e.text for e in result.prompt_logprobs), "the prompt splits no character"
    assert b"".join(e.bytes for e in result.prompt_logprobs).decode() == UNICODE


def test_streamed_pieces_carry_their_tokens_logprobs(probe_engine) -> None:
    ids = probe_engine.render_raw(PROMPT)
    whole = echo(probe_engine, sensitivity=0.0, max_new_tokens=16, logprobs=2)
    stop = next(whole.text[i:i + 3] for i in range(len(whole.text) // 2, len(whole.text) - 3)
                if whole.text.find(whole.text[i:i + 3]) > 0)
    items = list(probe_engine.stream(PROMPT, prompt_ids=ids, max_new_tokens=16, sensitivity=0.0, logprobs=2,
                                     echo=True, stop=[stop]))
    result = items[-1]
    assert isinstance(result, GenerationResult)
    deltas = [item for item in items if isinstance(item, TokenDelta)]
    assert deltas[0].echo and deltas[0].text == PROMPT and len(deltas[0].logprobs) == len(ids)
    assert not any(d.echo for d in deltas[1:])
    streamed = [e for d in deltas[1:] for e in d.logprobs]
    assert streamed == result.logprobs[:len(streamed)]  # in order; what is left goes with the final chunk
    # A stop sequence cuts the logprobs where it cuts the text: the tokens from where it begins are left out.
    cut = whole.text.find(stop)
    assert result.text == whole.text[:cut]
    assert result.logprobs == [e for e in whole.logprobs if e.offset < cut]
    assert len(result.logprobs) < len(result.token_ids)


def test_scores_are_read_from_one_tensor_and_stay_finite() -> None:
    logits = torch.tensor([[0.0, 2.0, float("-inf"), 1.0], [3.0, 3.0, 0.0, float("nan")]])
    first, second = score_positions(logits, [1, 2], top=2)
    assert first.token_id == 1 and first.top_ids == (1, 3) and first.logprob == first.top_logprobs[0]
    assert second.logprob == LOGPROB_FLOOR  # a NaN row reports the floor, never a value JSON cannot carry
    assert all(v >= LOGPROB_FLOOR for v in first.top_logprobs + second.top_logprobs)
    masked = score_positions(logits[:1], [2], top=0)[0]
    assert masked.logprob == LOGPROB_FLOOR and masked.top_ids == ()


def test_token_texts_of_a_byte_level_vocabulary(probe_engine) -> None:
    texts = TokenTexts(probe_engine.loaded.tokenizer)
    ids = probe_engine.render_raw(UNICODE)
    decoded, offsets = texts.offsets(ids)
    assert decoded == UNICODE and len(offsets) == len(ids)
    assert b"".join(texts.raw_bytes(i) for i in ids) == UNICODE.encode()
    eos = probe_engine.loaded.tokenizer.eos_token_id
    assert texts.text(eos) == probe_engine.loaded.tokenizer.eos_token and texts.raw_bytes(eos) == texts.text(eos).encode()
