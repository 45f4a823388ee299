"""How `PruningEngine.stream` turns a request into pieces of text: its checked arguments, the completion's text as
tokens arrive (cut where a stop sequence begins, its last characters held back while they may still begin one, each
token's logprob entry placed in it), and the echoed prompt."""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from prunewatch.engine.logprobs import Scored, TokenLogprob, TokenTexts
from prunewatch.engine.settings import LogLevel


@dataclass(frozen=True)
class StreamRequest:
    """One stream() call's arguments, checked, with the settings' defaults filled in."""

    request_id: str
    prompt_ids: list[int]  # the rendered prompt
    user_text: str | None  # what the anomaly checks read: the prompt, or the user messages' text
    max_new_tokens: int
    sensitivity: float
    blacklist: list[int]  # sorted, no repeats
    log_level: LogLevel
    check: str  # the quality check: "off", "on" or "full" (prunewatch.engine.quality.quality_check)
    stops: tuple[str, ...]
    logprobs: int | None  # alternatives per token; None computes no log-probabilities
    echo: bool
    use_cache: bool


class Piece(NamedTuple):
    """A piece of text ready to go out (the fields of a TokenDelta)."""

    text: str
    token_id: int
    logprobs: tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class Completion:
    """The generated answer once decoding stopped."""

    tokens: list[int]  # every generated token, end of sequence included
    text: str  # cut before a stop sequence
    logprobs: list[TokenLogprob]  # with logprobs, every token's entry; those from a stop sequence on left out
    stopped_at: int  # where a stop sequence begins in the text; -1 when none appeared
    finish_reason: str  # "stop" (end of sequence or a stop sequence) or "length"
    rest: Piece | None  # the text not yet sent (held back for a stop sequence), if any


class RequestTimes(NamedTuple):
    """When a request reached each stage (time.perf_counter())."""

    started: float
    preprocessed: float  # prompt rendered, plan chosen
    first_token_at: float | None  # None when no token was generated (an echoed prompt scored only)
    inferred: float  # decoding done


def first_stop(text: str, stops: Sequence[str]) -> int:
    """Where the earliest stop sequence begins in `text`; -1 when none appears."""
    found = [at for at in (text.find(s) for s in stops) if at >= 0]
    return min(found) if found else -1


class CompletionText:
    """The completion's text as it grows token by token: the pieces that may go out, where a stop sequence ends it."""

    def __init__(self, tokenizer: Any, token_texts: TokenTexts, stops: tuple[str, ...],
                 eos_ids: Collection[int]) -> None:
        self._tokenizer = tokenizer
        self._token_texts = token_texts
        self._stops = stops
        self._eos_ids = eos_ids
        self._hold = max((len(s) for s in stops), default=1) - 1  # trailing characters that may begin a stop sequence
        self.tokens: list[int] = []
        self.first_token_at: float | None = None  # perf_counter() when the first token arrived
        self.ended = False  # an end of sequence or a stop sequence arrived: no token is wanted after it
        self._stopped_at = -1  # where a stop sequence begins in the text; -1 while none has appeared
        self._text_so_far = ""  # what went out
        # With logprobs: each generated token's entry, where its characters begin in the completion (`_whole`:
        # the completion's length up to its last whole character), and how many went out with a piece.
        self._scored: list[TokenLogprob] = []
        self._whole = 0
        self._sent = 0

    def add(self, token: int, scored: Scored | None = None) -> Piece | None:
        """Take the next generated token (with its scores when logprobs were asked for); the piece of text that
        may go out now, if any."""
        if scored is not None:
            self._scored.append(self._token_texts.entry(scored, self._whole))
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.tokens.append(token)
        if token in self._eos_ids:
            self.ended = True
            return None
        text = self._tokenizer.decode(self.tokens, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            self._whole = len(text)
        self._stopped_at = first_stop(text, self._stops)
        if self._stopped_at >= 0:
            self.ended = True
            return None
        ready = len(text) - self._hold
        if ready <= len(self._text_so_far) or text.endswith("\ufffd"):
            return None
        done = self._sent
        while done < len(self._scored) and self._scored[done].offset < ready:  # tokens whose text begins in it
            done += 1
        piece = Piece(text[len(self._text_so_far):ready], token, tuple(self._scored[self._sent:done]))
        self._text_so_far, self._sent = text[:ready], done
        return piece

    def finish(self) -> Completion:
        """The answer as decoded: its text and entries cut before a stop sequence, and the rest not yet sent."""
        ended_by_eos = bool(self.tokens) and self.tokens[-1] in self._eos_ids
        stopped_at = self._stopped_at
        text = self._tokenizer.decode(self.tokens, skip_special_tokens=True)
        scored = self._scored
        if stopped_at >= 0:
            text = text[:stopped_at]
            scored = [entry for entry in scored if entry.offset < stopped_at]  # as the text, cut before the stop
        rest = None
        if len(text) > len(self._text_so_far):
            rest = Piece(text[len(self._text_so_far):], self.tokens[-1], tuple(scored[self._sent:]))
        return Completion(tokens=self.tokens, text=text, logprobs=scored, stopped_at=stopped_at,
                          finish_reason="stop" if ended_by_eos or stopped_at >= 0 else "length", rest=rest)


class PromptEcho:
    """The echoed prompt: its text, and with logprobs its tokens' entries from the prefill's scored positions."""

    def __init__(self, prompt_ids: list[int], token_texts: TokenTexts) -> None:
        self._prompt_ids = prompt_ids
        self._token_texts = token_texts
        self._scores: list[Scored] = []
        self.text: str | None = None  # once it went out
        self.logprobs: list[TokenLogprob] | None = None  # with logprobs, once every prompt token was scored

    def plain(self, tokenizer: Any) -> Piece:
        """The prompt's text, without logprobs (special tokens kept: they are the client's own)."""
        self.text = tokenizer.decode(self._prompt_ids, skip_special_tokens=False)
        return Piece(self.text, self._prompt_ids[-1], ())

    def add(self, scored: Scored) -> Piece | None:
        """Take one scored prompt position; the prompt's piece, with its entries, once every position is in."""
        self._scores.append(scored)
        if len(self._scores) != len(self._prompt_ids):
            return None
        self.text, offsets = self._token_texts.offsets(self._prompt_ids)
        self.logprobs = [self._token_texts.entry(p, at) for p, at in zip(self._scores, offsets)]
        return Piece(self.text, self._prompt_ids[-1], tuple(self.logprobs))
