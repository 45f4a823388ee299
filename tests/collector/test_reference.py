"""Scoring what an engine served against a dense reference: the in-process reference on the probe model, the
OpenAI `logprobs` an HTTP reference reads, and the chat template rendered without the model."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from prunewatch.collector.probe_round import judge
from prunewatch.collector.reference import (
    ChatTemplate,
    EngineReference,
    ReferenceError,
    answer_positions,
    probe_messages,
)
from prunewatch.probes import Check, Probe
from prunewatch.records.results import ProbeResult

PROBE = Probe(id="eval-x", domain="tech", version=1, max_tokens=12, system="Answer briefly.",
              prompt="How do you list the files of a folder?")


def test_the_chat_template_renders_as_transformers_renders_it(probe_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(probe_model_dir)
    for messages in (probe_messages(PROBE), [{"role": "user", "content": "hi"}]):
        expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ChatTemplate.from_dir(probe_model_dir).render(messages) == expected


def test_a_folder_without_a_template_is_named(tmp_path):
    with pytest.raises(ReferenceError, match="holds no chat template"):
        ChatTemplate.from_dir(tmp_path)


def logprobs(tokens: list[str], values: list[float | None], tops: list[dict | None]) -> dict:
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def test_answer_tokens_are_read_from_an_echoed_completion():
    # prompt "Q:" (2 chars), answer " yes no" (7 chars), then the one generated token
    echoed = logprobs(["Q", ":", " yes", " no", "!"], [None, -1.0, -0.1, -2.0, -0.5],
                      [None, {":": -1.0}, {" yes": -0.1}, {" maybe": -0.3}, {"!": -0.5}])
    scored = answer_positions(echoed, 2, 9, "ref")
    assert scored.greedy == [True, False] and scored.pieces == [" yes", " no"]
    assert scored.agreement == 0.5 and scored.mean_nll == pytest.approx(1.05)


def test_a_reference_without_logprobs_is_refused():
    with pytest.raises(ReferenceError, match="must implement echo \\+ logprobs"):
        answer_positions(None, 0, 1, "plain")
    with pytest.raises(ReferenceError, match="of one length"):
        answer_positions({"tokens": ["a"], "token_logprobs": [], "top_logprobs": [], "text_offset": []}, 0, 1, "x")


def test_the_engine_run_dense_agrees_with_its_own_dense_answer_and_scores_a_pruned_one(probe_engine):
    reference = EngineReference(probe_engine)
    dense = probe_engine.generate(PROBE.prompt, system=PROBE.system, max_new_tokens=PROBE.max_tokens,
                                  sensitivity=0.0)
    own = reference.score(PROBE, dense.text, dense.served_ids)
    assert own.reference_agreement == 1.0 and own.divergence_at is None
    assert own.reference_tokens == len(dense.served_ids) and own.served_nll == pytest.approx(own.reference_nll)
    assert own.quality_source == f"reference:{probe_engine.name}"
    again = reference.score(PROBE, dense.text)  # the text, tokenized again, scores the same here
    assert again.reference_agreement == 1.0
    garbled = reference.score(PROBE, "zebra " * 6)
    assert garbled.reference_agreement < 0.5 and garbled.served_nll > own.served_nll
    assert garbled.divergence_at == 0


def test_judge_fills_the_task_check_and_the_reference_figures(probe_engine):
    probe = Probe(**{**PROBE.__dict__, "check": Check("contains", ("zebra",))})
    result = ProbeResult(target="t", model="m", probe_id=probe.id, probe_version=1, probe_hash=probe.content_hash,
                         domain="tech", status="ok", round_id="r" * 32, output_text="a zebra",
                         reference_agreement=0.1, quality_source="engine")
    judge(result, probe, EngineReference(probe_engine))
    assert result.task_passed is True and result.quality_source.startswith("reference:")
    assert result.reference_agreement != 0.1 and result.reference_tokens > 0 and result.quality_ms > 0

    class Broken:
        name = "broken"

        def score(self, *args):
            raise ReferenceError("down")

    kept = ProbeResult(target="t", model="m", probe_id=probe.id, probe_version=1, probe_hash=probe.content_hash,
                       domain="tech", status="ok", round_id="r" * 32, output_text="no", reference_agreement=0.7)
    judge(kept, probe, Broken())
    assert (kept.task_passed, kept.reference_agreement) == (False, 0.7)  # the answer stays data
