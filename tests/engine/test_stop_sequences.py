"""Stop sequences: the completion ends where one first appears, cut before it, streamed or not."""

from __future__ import annotations

import pytest

from prunewatch.engine.errors import InvalidRequestError
from prunewatch.engine.pruning_engine import GenerationResult, TokenDelta

PROMPT = "Summarise the indemnification clause of a software licence in two sentences."
TOKENS = 24


@pytest.fixture(scope="module")
def baseline(probe_engine) -> GenerationResult:
    """The dense greedy answer without stop sequences: the text every case below cuts."""
    result = probe_engine.generate(PROMPT, max_new_tokens=TOKENS, sensitivity=0.0)
    assert result.stats.finish_reason == "length" and len(result.text) > 20, result.text
    return result


def _middle_stop(text: str, length: int = 3, at_fraction: float = 0.4) -> tuple[str, int]:
    """A substring from the middle of `text` and where it first appears (possibly earlier)."""
    for start in range(int(len(text) * at_fraction), len(text) - length):
        stop = text[start:start + length]
        first = text.find(stop)
        if first > 0 and stop.strip():
            return stop, first
    raise AssertionError(f"no usable stop sequence in {text!r}")


def _streamed(engine, **kwargs) -> tuple[list[str], GenerationResult]:
    pieces, result = [], None
    for item in engine.stream(PROMPT, max_new_tokens=TOKENS, sensitivity=0.0, **kwargs):
        if isinstance(item, TokenDelta):
            pieces.append(item.text)
        else:
            result = item
    assert isinstance(result, GenerationResult)
    return pieces, result


def test_a_stop_sequence_cuts_the_text_before_it_and_ends_generation(probe_engine, baseline) -> None:
    stop, at = _middle_stop(baseline.text)
    result = probe_engine.generate(PROMPT, max_new_tokens=TOKENS, sensitivity=0.0, stop=[stop])
    assert result.text == baseline.text[:at]
    assert result.stats.finish_reason == "stop"
    # Generation ended at the token that completed the stop sequence, not at max_new_tokens.
    assert result.token_ids == baseline.token_ids[:len(result.token_ids)]
    assert result.stats.completion_tokens == len(result.token_ids) < len(baseline.token_ids)
    tokenizer = probe_engine.loaded.tokenizer
    assert stop in tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert stop not in tokenizer.decode(result.token_ids[:-1], skip_special_tokens=True)


def test_the_earliest_of_several_stop_sequences_wins(probe_engine, baseline) -> None:
    found = {_middle_stop(baseline.text, length=4, at_fraction=f) for f in (0.2, 0.4, 0.6, 0.8)}
    (early, early_at), *_, (late, late_at) = sorted(found, key=lambda pair: pair[1])
    assert early_at < late_at, found
    result = probe_engine.generate(PROMPT, max_new_tokens=TOKENS, sensitivity=0.0, stop=[late, early])
    assert result.text == baseline.text[:early_at]


def test_streamed_pieces_never_show_a_stop_sequence_and_add_up_to_the_answer(probe_engine, baseline) -> None:
    stop, at = _middle_stop(baseline.text, length=5)
    pieces, result = _streamed(probe_engine, stop=[stop])
    assert "".join(pieces) == result.text == baseline.text[:at]
    assert result.stats.finish_reason == "stop"
    # A stop sequence that never appears: the held-back tail is sent at the end, nothing is lost.
    absent = "\x00never\x00"
    pieces, result = _streamed(probe_engine, stop=absent)
    assert "".join(pieces) == result.text == baseline.text
    assert result.stats.finish_reason == "length"
    assert len(pieces) > 1  # still streamed as it went, not in one piece at the end


def test_quality_is_scored_over_the_tokens_the_answer_kept(probe_engine) -> None:
    """With pruning on, the dense reference decodes as many tokens as the stopped answer, not max_new_tokens."""
    whole = probe_engine.generate(PROMPT, max_new_tokens=TOKENS, sensitivity=1.0)
    assert whole.stats.pruning_ratio > 0.0  # the plan skips work, so quality re-runs the dense model
    stop, at = _middle_stop(whole.text)
    pruned = probe_engine.generate(PROMPT, max_new_tokens=TOKENS, sensitivity=1.0, quality="full", stop=[stop])
    assert pruned.text == whole.text[:at] and pruned.stats.finish_reason == "stop"
    assert pruned.stats.quality is not None
    assert pruned.stats.quality.continuation_tokens == len(pruned.token_ids) < TOKENS
    # The served answer is what the client received: its text, cut before the stop, tokenized again.
    served = probe_engine.loaded.tokenizer(pruned.text, add_special_tokens=False).input_ids
    assert pruned.served_ids == served and pruned.stats.quality.reference_tokens == len(served)


@pytest.mark.parametrize("stop, message", [
    ([f"s{i}" for i in range(17)], "at most 16 stop sequences, got 17"),
    (["ok", ""], "stop sequences must be non-empty strings"),
    ("", "stop sequences must be non-empty strings"),
    (["x" * 257], "a stop sequence is longer than 256 characters"),
])
def test_bad_stop_sequences_are_refused_before_any_work(probe_engine, stop, message) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        probe_engine.generate(PROMPT, max_new_tokens=2, stop=stop)
