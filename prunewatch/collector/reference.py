"""Score what any engine served against a dense reference model with the same tokenizer.

The figure is the reference-scored agreement of the served answer: the reference reads prompt +
served answer in one teacher-forced pass, and the share of answer tokens equal to its argmax given
the served prefix is the agreement; the answer's mean NLL under the reference comes from the same
pass. It needs no second generation and nothing from the engine that served the answer but its text,
so a pruned prunewatch engine, a quantized llama.cpp build and a vLLM server are scored alike.

Once per probe the reference also generates its own greedy answer (cached by the probe's content
hash): its NLL is the yardstick the served NLL is read against, and the first token where the served
answer leaves it is recorded (`divergence_at`).

Two references:
- `EngineReference`: a prunewatch engine in this process, run dense (the embedded main job uses its
  own engine: the same weights, no pruning).
- `HttpReference`: any OpenAI-compatible server that implements `echo` + `logprobs` on
  `/v1/completions` (vLLM, llama.cpp's server, `prunewatch serve` at sensitivity 0): the convention
  lm-eval-harness uses for loglikelihoods. The chat prompt is rendered locally with the model's chat
  template (a model folder's `chat_template.jinja` / `tokenizer_config.json`), so the reference scores
  the exact text a chat endpoint would have rendered.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from prunewatch.probes import Probe

logger = logging.getLogger("prunewatch.collector")

GREEDY_TOLERANCE = 1e-5
"""A served token counts as the reference's argmax when its logprob is within this of the top logprob
(a tie in the reference's own distribution is not a disagreement)."""


class ReferenceError(RuntimeError):
    """The reference could not score an answer (unreachable, no logprobs, another tokenizer); the message says why."""


@dataclass(frozen=True)
class ReferenceScore:
    """One served answer scored by a reference: the ProbeResult fields of the same names."""

    reference_agreement: float | None  # None when the answer had no token to score
    reference_tokens: int
    served_nll: float | None
    reference_nll: float | None  # mean NLL of the reference's own greedy answer
    divergence_at: int | None  # first token where the served answer leaves the reference's; None: it never does
    quality_source: str  # "reference:<name>"
    quality_ms: float  # time the scoring took (the reference's own answer, once per probe, included)

    def fields(self) -> dict[str, Any]:
        """As ProbeResult fields."""
        return {"reference_agreement": self.reference_agreement, "reference_tokens": self.reference_tokens,
                "served_nll": self.served_nll, "reference_nll": self.reference_nll,
                "divergence_at": self.divergence_at, "quality_source": self.quality_source,
                "quality_ms": self.quality_ms}


class Reference(Protocol):
    name: str

    def score(self, probe: Probe, served_text: str, served_ids: Sequence[int] | None = None) -> ReferenceScore: ...


def probe_messages(probe: Probe) -> list[dict[str, str]]:
    """The chat turns a probe sends (as every target renders them)."""
    return ([{"role": "system", "content": probe.system}] if probe.system else []) + [
        {"role": "user", "content": probe.prompt}]


def _divergence(served: Sequence[Any], reference: Sequence[Any]) -> int | None:
    for index, (a, b) in enumerate(zip(served, reference)):
        if a != b:
            return index
    return None if len(served) == len(reference) else min(len(served), len(reference))


@dataclass(frozen=True)
class _Scored:
    """Per answer token: whether it was the reference's argmax, and its logprob; plus the token pieces."""

    greedy: list[bool]
    logprobs: list[float]
    pieces: list[Any]  # token ids or token strings, to find where two answers part

    @property
    def agreement(self) -> float | None:
        return sum(self.greedy) / len(self.greedy) if self.greedy else None

    @property
    def mean_nll(self) -> float | None:
        return -sum(self.logprobs) / len(self.logprobs) if self.logprobs else None


class _CachedReference:
    """The shared part: the reference's own answer per probe (cached), and the score of a served one."""

    name: str
    takes_ids = False  # scores token ids as served (an engine with the same tokenizer), not only text

    def __init__(self) -> None:
        self._own: dict[str, _Scored] = {}
        self._lock = threading.Lock()

    def _own_answer(self, probe: Probe) -> _Scored:
        with self._lock:
            cached = self._own.get(probe.content_hash)
        if cached is None:
            cached = self._score_text(probe, self._generate(probe))
            with self._lock:
                self._own[probe.content_hash] = cached
        return cached

    def score(self, probe: Probe, served_text: str, served_ids: Sequence[int] | None = None) -> ReferenceScore:
        started = time.perf_counter()
        own = self._own_answer(probe)
        served = (self._score_ids(probe, served_ids) if served_ids is not None and self.takes_ids
                  else self._score_text(probe, served_text))
        return ReferenceScore(
            reference_agreement=None if served.agreement is None else round(served.agreement, 6),
            reference_tokens=len(served.greedy),
            served_nll=None if served.mean_nll is None else round(served.mean_nll, 6),
            reference_nll=None if own.mean_nll is None else round(own.mean_nll, 6),
            divergence_at=_divergence(served.pieces, own.pieces),
            quality_source=f"reference:{self.name}",
            quality_ms=round((time.perf_counter() - started) * 1000, 3))

    # the reference's own ways
    def _generate(self, probe: Probe) -> str:
        raise NotImplementedError

    def _score_text(self, probe: Probe, text: str) -> _Scored:
        raise NotImplementedError

    def _score_ids(self, probe: Probe, ids: Sequence[int]) -> _Scored:
        raise NotImplementedError


class EngineReference(_CachedReference):
    """A prunewatch engine in this process, run dense (sensitivity 0) whatever its settings.

    `engine` is a `prunewatch.engine.PruningEngine` (not imported here: the collector reads HTTP
    targets without torch)."""

    takes_ids = True

    def __init__(self, engine: Any, name: str | None = None) -> None:
        super().__init__()
        self.engine = engine
        self.name = name or engine.name
        self._own_ids: dict[str, list[int]] = {}

    def _prompt_ids(self, probe: Probe) -> list[int]:
        ids: list[int] = self.engine.render_prompt(probe.prompt, probe.system or None)
        return ids

    def _on_engine(self, method: Callable[..., Any], *args: Any) -> Any:
        """Run on the engine's generation thread, where its probes run: a forward pass on the collector's
        thread would start a second OpenMP team, and two make every step sleep and wake."""
        threads = getattr(self.engine, "generation_thread", None)
        return method(*args) if threads is None else threads.run(method, *args)

    def _generate(self, probe: Probe) -> str:
        ids = self._on_engine(self.engine.reference_answer, self._prompt_ids(probe), probe.max_tokens)
        self._own_ids[probe.content_hash] = ids
        text: str = self.engine.loaded.tokenizer.decode(ids, skip_special_tokens=True)
        return text

    def _own_answer(self, probe: Probe) -> _Scored:
        with self._lock:
            cached = self._own.get(probe.content_hash)
        if cached is None:
            self._generate(probe)
            cached = self._score_ids(probe, self._own_ids[probe.content_hash])
            with self._lock:
                self._own[probe.content_hash] = cached
        return cached

    def _score_text(self, probe: Probe, text: str) -> _Scored:
        ids = self.engine.loaded.tokenizer(text, add_special_tokens=False).input_ids if text else []
        return self._score_ids(probe, ids)

    def _score_ids(self, probe: Probe, ids: Sequence[int]) -> _Scored:
        ids = list(ids)
        if not ids:
            return _Scored([], [], [])
        greedy, logprobs = self._on_engine(self.engine.answer_logprobs, self._prompt_ids(probe), ids)
        return _Scored(greedy, logprobs, ids)


@dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template, rendered as transformers renders it (Jinja, sandboxed), without loading the model."""

    source: str
    bos_token: str = ""
    eos_token: str = ""

    @classmethod
    def from_dir(cls, folder: Path | str) -> ChatTemplate:
        """From a model folder: `chat_template.jinja`, else tokenizer_config.json's `chat_template`."""
        folder = Path(folder)
        config: dict[str, Any] = {}
        config_path = folder / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except ValueError as exc:
                raise ReferenceError(f"{config_path} is not valid JSON: {exc}") from None
        template_path = folder / "chat_template.jinja"
        source = template_path.read_text(encoding="utf-8") if template_path.is_file() else config.get("chat_template")
        if not isinstance(source, str) or not source.strip():
            raise ReferenceError(f"{folder} holds no chat template (chat_template.jinja or tokenizer_config.json)")

        def token(name: str) -> str:
            value = config.get(name)
            if isinstance(value, dict):  # an AddedToken written out
                value = value.get("content")
            return value if isinstance(value, str) else ""

        return cls(source=source, bos_token=token("bos_token"), eos_token=token("eos_token"))

    def render(self, messages: list[dict[str, str]]) -> str:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.filters["tojson"] = lambda value, **kw: json.dumps(value, ensure_ascii=False, **kw)
        environment.globals["raise_exception"] = raise_exception
        return environment.from_string(self.source).render(
            messages=messages, add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token)


class HttpReference(_CachedReference):
    """An OpenAI-compatible server with `echo` + `logprobs` on `/v1/completions`, serving the reference model."""

    def __init__(self, *, name: str, base_url: str, model: str, template: ChatTemplate, api_key: str | None = None,
                 timeout_s: float = 120.0, transport: httpx.BaseTransport | None = None) -> None:
        super().__init__()
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.template = template
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=self.base_url, headers=headers, transport=transport,
                                    timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)))

    def __repr__(self) -> str:  # never shows the key
        return f"HttpReference(name={self.name!r}, base_url={self.base_url!r}, model={self.model!r})"

    def _complete(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            response = self._client.post("/v1/completions", json={"model": self.model, "temperature": 0.0, **body})
        except httpx.HTTPError as exc:
            raise ReferenceError(f"reference {self.name} ({self.base_url}): {type(exc).__name__}: {exc}") from None
        if response.status_code >= 300:
            raise ReferenceError(f"reference {self.name}: HTTP {response.status_code}: {response.text[:300]}")
        try:
            choice = response.json()["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ReferenceError(f"reference {self.name}: not a completion: {exc}") from None
        if not isinstance(choice, dict):
            raise ReferenceError(f"reference {self.name}: not a completion choice: {choice!r:.200}")
        return choice

    def _generate(self, probe: Probe) -> str:
        prompt = self.template.render(probe_messages(probe))
        return str(self._complete({"prompt": prompt, "max_tokens": probe.max_tokens}).get("text") or "")

    def _score_text(self, probe: Probe, text: str) -> _Scored:
        if not text:
            return _Scored([], [], [])
        prompt = self.template.render(probe_messages(probe))
        choice = self._complete({"prompt": prompt + text, "max_tokens": 1, "echo": True, "logprobs": 1})
        return answer_positions(choice.get("logprobs"), len(prompt), len(prompt) + len(text), self.name)

    def close(self) -> None:
        self._client.close()


def answer_positions(logprobs: Any, start: int, end: int, name: str) -> _Scored:
    """The answer's tokens in an echoed completion's OpenAI `logprobs`: those whose text starts in [start, end)
    (the prompt's end up to the answer's end; the generated token after it is left out)."""
    if not isinstance(logprobs, dict):
        raise ReferenceError(f"reference {name} returned no logprobs: it must implement echo + logprobs "
                             "on /v1/completions")
    tokens, values = logprobs.get("tokens"), logprobs.get("token_logprobs")
    tops, offsets = logprobs.get("top_logprobs"), logprobs.get("text_offset")
    if not (isinstance(tokens, list) and isinstance(values, list) and isinstance(tops, list)
            and isinstance(offsets, list)) or not (
            len(tokens) == len(values) == len(tops) == len(offsets)):
        raise ReferenceError(f"reference {name}: logprobs need tokens, token_logprobs, top_logprobs and text_offset "
                             "of one length")
    greedy: list[bool] = []
    scores: list[float] = []
    pieces: list[Any] = []
    for token, value, top, offset in zip(tokens, values, tops, offsets):
        if not isinstance(offset, int) or not start <= offset < end:
            continue
        if value is None or not isinstance(top, dict) or not top:
            raise ReferenceError(f"reference {name}: an answer token at offset {offset} has no logprob")
        best = max(float(v) for v in top.values())
        greedy.append(float(value) >= best - GREEDY_TOLERANCE)
        scores.append(float(value))
        pieces.append(token)
    return _Scored(greedy, scores, pieces)


Scorer = Callable[[Probe, str, Sequence[int] | None], ReferenceScore]
