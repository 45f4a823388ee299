"""Log-probabilities of tokens under the model that produced them (OpenAI's `logprobs`, `top_logprobs`, `echo`).

A position is scored only when a request asks for it: the fp32 log-softmax of that position's logits,
the value of the token that is there, and the k largest values. The engine's decode loop
(`PruningEngine._decode`) calls `score_positions` on the logits it already has, under the request's
plan; echo scores the prompt from the prefill's own forward pass, which then keeps every row of
logits instead of the last. `TokenTexts` turns token ids into what an OpenAI client reads: each
token's text, its bytes, and where its characters begin in the decoded text. Importing this module
does not import torch: prunewatch.engine.stats, which must not, holds its records.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20  # OpenAI's chat limit; its legacy completions allow 5 (the server checks each)
# JSON has no -Infinity: a token the model rules out entirely (a masked logit) is reported at this floor,
# as vLLM does. No finite fp32 log-softmax reaches it for a real vocabulary.
LOGPROB_FLOOR = -9999.0
SCORE_CHUNK_ROWS = 256  # rows log-softmaxed at once: an echoed prompt's extra memory stays 256 x vocab floats
_DECODE_WINDOW = 16  # tokens decoded together when measuring a sequence's character offsets


@dataclass(frozen=True)
class Scored:
    """One scored position, as the decode loop yields it: the token there and the model's log-probabilities."""

    token_id: int
    logprob: float | None  # ln p(token | everything before it); None for a prompt's first token: nothing predicts it
    top_ids: tuple[int, ...] = ()  # the k most likely tokens at this position, most likely first
    top_logprobs: tuple[float, ...] = ()
    in_prompt: bool = False  # an echoed prompt position (its scores come from the prefill) rather than a generated one


@dataclass(frozen=True)
class TopLogprob:
    """One of the most likely tokens at a position."""

    token_id: int
    text: str  # the token decoded alone (OpenAI's token text)
    bytes: bytes  # its own bytes: a character split over two tokens shows here, not in `text`
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """A token of an answer (or of an echoed prompt) with its log-probability and the most likely alternatives."""

    token_id: int
    text: str  # the token decoded alone
    bytes: bytes
    logprob: float | None  # None for a prompt's first token
    offset: int  # where the token's characters begin in its text: the decoded prompt, or the completion
    top: tuple[TopLogprob, ...] = ()  # most likely first; empty for a prompt's first token


def score_positions(logits: torch.Tensor, targets: Sequence[int], top: int, in_prompt: bool = False) -> list[Scored]:
    """Score `targets` (N,) under `logits` (N, V): fp32 log-softmax, each target's value and the `top` largest.

    The target's value and the top values are read from one tensor, so a target that is the most likely
    token carries exactly the float of the first top entry (lm-eval's is_greedy compares them with ==).
    """
    import torch

    scored: list[Scored] = []
    for start in range(0, logits.shape[0], SCORE_CHUNK_ROWS):
        rows = logits[start:start + SCORE_CHUNK_ROWS]
        ids = torch.tensor(list(targets[start:start + rows.shape[0]]), device=rows.device)  # (n,)
        logp = torch.log_softmax(rows.float(), dim=-1).nan_to_num_(nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR)  # (n, V)
        chosen = logp.gather(-1, ids[:, None])[:, 0].tolist()
        if top > 0:
            values, indices = logp.topk(top, dim=-1)  # (n, k), sorted
            top_values, top_indices = values.tolist(), indices.tolist()
        else:
            top_values = top_indices = [[] for _ in chosen]
        scored.extend(Scored(int(t), max(float(v), LOGPROB_FLOOR), tuple(i), tuple(max(x, LOGPROB_FLOOR) for x in tv),
                             in_prompt)
                      for t, v, i, tv in zip(ids.tolist(), chosen, top_indices, top_values))
    return scored


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table), reversed: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _decoder_types(tokenizer: Any) -> set[str]:
    """The `tokenizers` decoder types a fast tokenizer chains ("ByteLevel", "ByteFallback", ...); empty otherwise."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except (ValueError, AttributeError):
        return set()
    parts = decoder.get("decoders") or [decoder]
    return {part.get("type", "") for part in parts if isinstance(part, dict)}


class TokenTexts:
    """Token ids as an OpenAI client reads them, for one tokenizer (texts and bytes are cached per id)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoders = _decoder_types(tokenizer)
        self._byte_level = _byte_alphabet() if "ByteLevel" in decoders else None
        self._byte_fallback = "ByteFallback" in decoders
        self._added = {int(i): str(t) for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}

    def text(self, token_id: int) -> str:
        """The token decoded alone, special tokens included (OpenAI's token text)."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def raw_bytes(self, token_id: int) -> bytes:
        """The token's own bytes: exact for byte-level BPE and byte-fallback vocabularies, else its text's UTF-8."""
        value = self._bytes.get(token_id)
        if value is None:
            value = self._bytes[token_id] = self._token_bytes(token_id)
        return value

    def _token_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_level is not None and all(c in self._byte_level for c in piece):
                return bytes(self._byte_level[c] for c in piece)
            if self._byte_fallback and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
        return self.text(token_id).encode("utf-8")

    def offsets(self, ids: Sequence[int], skip_special_tokens: bool = False) -> tuple[str, list[int]]:
        """(decode(ids), where each token's characters begin in it).

        A token that ends inside a character (byte-level BPE splits some characters over tokens) begins
        where that character does, as does the token that completes it. Decoded in short windows that
        overlap by one token, so a long prompt costs a linear number of decodes.
        """
        decode = self.tokenizer.decode
        offsets: list[int] = []
        base = 0  # characters of the whole text before the window's first piece
        start, done = 0, ""  # the window's first token, and the window decoded up to the last whole character
        for k in range(len(ids)):
            offsets.append(base + len(done))
            text = decode(list(ids[start:k + 1]), skip_special_tokens=skip_special_tokens)
            if text.endswith("\ufffd") and k + 1 < len(ids):
                continue  # a character continues in the next token
            done = text
            if k - start >= _DECODE_WINDOW:  # restart the window at this token, kept as its context
                context = decode([ids[k]], skip_special_tokens=skip_special_tokens)
                if text.endswith(context):  # not when the token alone decodes otherwise (it ends a split character)
                    base += len(text) - len(context)
                    start, done = k, context
        whole = decode(list(ids), skip_special_tokens=skip_special_tokens)
        if offsets and base + len(done) != len(whole):  # a tokenizer whose pieces do not add up (cleanup rules)
            logger.debug("token offsets do not add up to the decoded text (%d != %d characters)",
                         base + len(done), len(whole))
        return whole, offsets

    def entry(self, scored: Scored, offset: int) -> TokenLogprob:
        """One answer (or prompt) token, ready for the API."""
        top = tuple(TopLogprob(i, self.text(i), self.raw_bytes(i), v) for i, v in zip(scored.top_ids, scored.top_logprobs))
        return TokenLogprob(scored.token_id, self.text(scored.token_id), self.raw_bytes(scored.token_id), scored.logprob,
                            offset, top)
