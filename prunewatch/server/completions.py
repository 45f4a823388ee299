"""Serve one completion request: check it, admit it, run it on a worker, shape the answer.

Shared by the chat, legacy completions and batch endpoints. Every check that can refuse a request
(model name, sizes, pruning headers) runs before admission, so a refused request never holds a
queue slot; only admission itself answers 429.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from jinja2 import TemplateError

from prunewatch.engine.errors import InvalidRequestError, KVBudgetError
from prunewatch.engine.hardware import device_model_name
from prunewatch.engine.logprobs import TokenLogprob
from prunewatch.engine.pruning_engine import PruningEngine, TokenDelta, stop_sequences
from prunewatch.engine.quality import quality_check
from prunewatch.engine.settings import LogLevel
from prunewatch.engine.stats import GenerationResult, RequestStats
from prunewatch.server.admission import AdmissionQueue, GenerationJob, QueueFullError, Slot
from prunewatch.server.errors import (
    RATE_LIMIT,
    SERVER_ERROR,
    APIError,
    error_body,
    invalid_request,
)
from prunewatch.server.metrics import ServerMetrics
from prunewatch.server.policy import PruningPolicy, apply_policy
from prunewatch.server.pruning_headers import PruningRequest
from prunewatch.server.schemas import (
    BatchRequest,
    ChatCompletionRequest,
    CompletionRequest,
    PrunewatchStats,
    PruningOverrides,
)
from prunewatch.server.settings import ServerSettings

if TYPE_CHECKING:
    from prunewatch.engine.batching import DecodeBatcher

logger = logging.getLogger("prunewatch.server")

Kind = Literal["chat", "completion"]


@dataclass(frozen=True)
class GenerationSpec:
    """A checked request, ready to run: what the engine is asked, under which pruning overrides."""

    kind: Kind
    request_id: str
    prompt: str | None
    messages: tuple[dict[str, str], ...] | None
    prompt_ids: tuple[int, ...]  # rendered once, when the size limits were checked
    prompt_tokens: int
    max_new_tokens: int
    pruning: PruningRequest
    stream: bool
    stop: tuple[str, ...] = ()  # strings that end the completion (OpenAI's `stop`)
    logprobs: int | None = None  # most likely tokens listed per position; None: no logprobs at all
    echo: bool = False  # a completion returns its prompt first

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.request_id


def _stop_sequences(stop: str | list[str] | None, param: str) -> tuple[str, ...]:
    """OpenAI's `stop` (a string or a list; null, "" and [] ask for none), checked as the engine checks it."""
    if not stop:
        return ()
    try:
        return stop_sequences(stop)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param=param, code="invalid_value") from None


def prunewatch_block(stats: RequestStats, queue_ms: float, device_name: str | None = None) -> dict[str, Any]:
    """The `prunewatch` body field: the X-Pruning-* header numbers plus how each was obtained.

    Every field of PrunewatchStats that RequestStats has is taken by name; only the header's own
    names (sparsity, total_tokens), the server's queue time and the device's model name are added here."""
    return PrunewatchStats.model_validate({
        **stats.to_dict(),  # quality becomes a plain dict; fields the API does not publish are ignored
        "sparsity": stats.activation_sparsity,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "queue_ms": queue_ms,
        "device_name": device_name,
    }).model_dump()


def completion_logprobs(entries: list[TokenLogprob], base: int = 0) -> dict[str, Any]:
    """OpenAI's legacy `logprobs` object for `entries`, their offsets shifted by `base` characters (an echoed
    prompt's length). Each position's top_logprobs maps token text to logprob, the token itself included (as
    OpenAI does); where two tokens share a text, the more likely keeps the key."""
    tops: list[dict[str, float] | None] = []
    for entry in entries:
        if entry.logprob is None:
            tops.append(None)
            continue
        top: dict[str, float] = {}
        for alternative in entry.top:
            top.setdefault(alternative.text, alternative.logprob)
        top.setdefault(entry.text, entry.logprob)
        tops.append(top)
    return {"tokens": [e.text for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": tops, "text_offset": [e.offset + base for e in entries]}


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's chat `logprobs` object for answer tokens."""
    return {"content": [{"token": e.text, "logprob": e.logprob, "bytes": list(e.bytes),
                         "top_logprobs": [{"token": t.text, "logprob": t.logprob, "bytes": list(t.bytes)}
                                          for t in e.top]}
                        for e in entries]}


def usage(stats: RequestStats) -> dict[str, Any]:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens`: prompt tokens served from the prefix cache."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_prompt_tokens},
    }


def merge_overrides(base: PruningRequest, item: PruningOverrides | None, num_layers: int,
                    param: str) -> PruningRequest:
    """A batch item's own pruning settings over the batch's headers; out-of-range layers are a 400."""
    if item is None:
        return base
    merged = base
    if item.sensitivity is not None:
        merged = replace(merged, sensitivity=item.sensitivity)
    if item.layer_blacklist is not None:
        bad = sorted({i for i in item.layer_blacklist if i >= num_layers})
        if bad:
            raise APIError(400, f"layer(s) {bad} out of range; the model has layers 0..{num_layers - 1}",
                           param=f"{param}.layer_blacklist", code="invalid_value")
        merged = replace(merged, layer_blacklist=tuple(sorted(set(item.layer_blacklist))))
    if item.log_level is not None:
        merged = replace(merged, log_level=LogLevel(item.log_level))
    if item.quality is not None:
        merged = replace(merged, quality=quality_check(item.quality))
    return merged


class CompletionService:
    """The request path between the HTTP routes and the engine."""

    def __init__(self, engine: PruningEngine, settings: ServerSettings, queue: AdmissionQueue,
                 metrics: ServerMetrics, policy: PruningPolicy | None = None,
                 batcher: DecodeBatcher | None = None) -> None:
        self.engine = engine
        self.batcher = batcher  # requests decode together through it (ServerSettings.workers > 1)
        self.policy = policy  # per-domain default sensitivity for requests that set none
        self.settings = settings
        self.queue = queue
        self.metrics = metrics
        self.context_window: int | None = engine.context_window
        self.device_name = device_model_name(engine.loaded.device)  # published with every answer's timings

    # -- checks before admission -------------------------------------------------------------
    async def prepare(self, body: ChatCompletionRequest | CompletionRequest, pruning: PruningRequest,
                      param_prefix: str = "") -> GenerationSpec:
        """Check a request and count its prompt tokens; raise the APIError that refuses it."""
        if body.model != self.engine.name:
            raise APIError(404, f"The model `{body.model}` does not exist; this server serves "
                                f"`{self.engine.name}`.", param=f"{param_prefix}model", code="model_not_found")
        stop = _stop_sequences(body.stop, f"{param_prefix}stop")
        requested = getattr(body, "max_completion_tokens", None) or body.max_tokens
        max_new = requested if requested is not None else self.settings.default_max_tokens
        if max_new > self.settings.max_tokens_limit:
            name = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
            raise APIError(400, f"{name} is {max_new}, above this server's limit of "
                                f"{self.settings.max_tokens_limit}", param=f"{param_prefix}{name}",
                           code="max_tokens_exceeded")
        logprobs, echo = self._logprobs(body, param_prefix)
        if max_new == 0 and not echo:
            raise APIError(400, "max_tokens 0 generates nothing: it is allowed with echo: true only (to score the "
                                "prompt)", param=f"{param_prefix}max_tokens", code="invalid_value")
        if isinstance(body, ChatCompletionRequest):
            kind: Kind = "chat"
            prompt = None
            messages = tuple({"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                             for m in body.messages)
            what = "messages"
        else:
            kind, prompt, messages, what = "completion", body.prompt, None, "prompt"
        try:
            if isinstance(prompt, list):  # token ids, read as given
                ids = self._token_ids(prompt, f"{param_prefix}prompt")
                prompt = await asyncio.to_thread(self.engine.decode_prompt, ids)  # the text the anomaly checks read
            elif isinstance(prompt, str):  # a text completion continues the prompt as given, no chat template
                ids = await asyncio.to_thread(self.engine.render_raw, prompt)
            else:  # chat: the model's chat template renders the messages
                ids = await asyncio.to_thread(self.engine.render_prompt, None, None, list(messages or ()))
        except InvalidRequestError as exc:
            raise invalid_request(exc, param=f"{param_prefix}{what}") from None
        except TemplateError as exc:  # e.g. a template that requires alternating user/assistant turns
            raise APIError(400, f"The model's chat template rejected the messages: {exc}",
                           param=f"{param_prefix}{what}", code="invalid_value") from None
        if len(ids) > self.settings.max_prompt_tokens:
            raise APIError(413, f"The prompt is {len(ids)} tokens, above this server's limit of "
                                f"{self.settings.max_prompt_tokens}.", param=f"{param_prefix}{what}",
                           code="context_length_exceeded")
        if self.context_window is not None and len(ids) + max_new > self.context_window:
            raise APIError(400, f"This model's context is {self.context_window} tokens; the prompt's "
                                f"{len(ids)} plus {max_new} completion tokens do not fit.",
                           param=f"{param_prefix}{what}", code="context_length_exceeded")
        if self.batcher is not None:
            try:
                self.batcher.check_fits(len(ids) + max_new)
            except KVBudgetError as exc:
                raise APIError(400, f"{str(exc)[0].upper()}{str(exc)[1:]}.", param=f"{param_prefix}{what}",
                               code="kv_budget_exceeded") from None
        return GenerationSpec(kind=kind, request_id=uuid.uuid4().hex, prompt=prompt, messages=messages,
                              prompt_ids=tuple(ids), prompt_tokens=len(ids), max_new_tokens=max_new, pruning=pruning,
                              stream=bool(body.stream), stop=stop, logprobs=logprobs, echo=echo)

    @staticmethod
    def _logprobs(body: ChatCompletionRequest | CompletionRequest, param_prefix: str) -> tuple[int | None, bool]:
        """(most likely tokens listed per position, or None for no logprobs; echo) as the engine takes them."""
        if isinstance(body, CompletionRequest):
            return body.logprobs, bool(body.echo)
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param=f"{param_prefix}top_logprobs",
                           code="invalid_value")
        return (body.top_logprobs or 0) if body.logprobs else None, False

    def _token_ids(self, ids: list[int], param: str) -> list[int]:
        """A prompt sent as token ids: every id must be one the model has."""
        vocab = self.engine.vocab_size
        bad = sorted({i for i in ids if i >= vocab})
        if bad:
            shown = ", ".join(str(i) for i in bad[:3]) + (", ..." if len(bad) > 3 else "")
            raise APIError(400, f"token id(s) {shown[:120]} out of range; this model's vocabulary is 0..{vocab - 1}",
                           param=param, code="invalid_value")
        return list(ids)

    # -- admission and running ---------------------------------------------------------------
    def admit(self, count: int = 1) -> list[Slot]:
        try:
            return self.queue.admit(count)
        except QueueFullError as exc:
            raise APIError(429, str(exc), type_=RATE_LIMIT, code="queue_full",
                           headers={"Retry-After": str(exc.retry_after_s)}) from None

    def start(self, slot: Slot, spec: GenerationSpec) -> GenerationJob[TokenDelta | GenerationResult]:
        engine, policy, batcher = self.engine, self.policy, self.batcher

        def run() -> Iterator[TokenDelta | GenerationResult]:
            # The policy's domain match reads the prompt's embeddings: tensor work, so it runs here, on the
            # generation thread, rather than on a helper thread that would start an OpenMP team of its own.
            pruning = apply_policy(policy, engine, spec.prompt_ids, spec.pruning)
            return engine.stream(
                spec.prompt,
                messages=list(spec.messages) if spec.messages is not None else None,
                max_new_tokens=spec.max_new_tokens,
                sensitivity=pruning.sensitivity,
                layer_blacklist=list(pruning.layer_blacklist) if pruning.layer_blacklist is not None else None,
                log_level=pruning.log_level,
                quality=pruning.quality,
                request_id=spec.request_id,
                prompt_ids=list(spec.prompt_ids),
                stop=spec.stop,
                logprobs=spec.logprobs,
                echo=spec.echo,
                batcher=batcher,
            )

        return self.queue.start(slot, run)

    async def complete(self, slot: Slot, spec: GenerationSpec) -> tuple[GenerationResult, float]:
        """Run to the end; returns the result and the time it waited for a worker (ms)."""
        job = self.start(slot, spec)
        result: GenerationResult | None = None
        try:
            async for item in job.items():
                if isinstance(item, GenerationResult):
                    result = item
        except InvalidRequestError as exc:
            raise invalid_request(exc) from None
        if result is None:
            raise RuntimeError("the engine's stream ended without a GenerationResult")
        self.metrics.record_generation(result.stats)
        return result, job.queue_ms

    async def batch(self, body: BatchRequest, defaults: PruningRequest) -> dict[str, Any]:
        """Run a batch: each item checked and pruned on its own, with its own stats or error.

        Items that fail their checks get their error without taking a slot; the rest are admitted
        together (all or none, so a batch never half-runs into a 429) and run on the worker pool.
        """
        if len(body.requests) > self.settings.max_batch_size:
            raise APIError(413, f"The batch has {len(body.requests)} requests, above this server's limit of "
                                f"{self.settings.max_batch_size}.", param="requests", code="batch_too_large")
        results: list[dict[str, Any] | None] = [None] * len(body.requests)

        def failed(index: int, error: APIError) -> dict[str, Any]:
            return {"index": index, "custom_id": body.requests[index].custom_id, "status_code": error.status_code,
                    "response": None, "error": error.body()["error"]}

        specs: list[tuple[int, GenerationSpec]] = []
        for index, item in enumerate(body.requests):
            prefix = f"requests.{index}."
            try:
                if item.body.stream:
                    raise APIError(400, "stream is not supported inside a batch", param=f"{prefix}body.stream",
                                   code="unsupported_parameter")
                overrides = merge_overrides(defaults, item.pruning, self.engine.num_layers, f"{prefix}pruning")
                specs.append((index, await self.prepare(item.body, overrides, f"{prefix}body.")))
            except APIError as exc:
                results[index] = failed(index, exc)
        slots = self.admit(len(specs)) if specs else []
        outcomes = await asyncio.gather(*(self.complete(slot, spec) for slot, (_, spec) in zip(slots, specs)),
                                        return_exceptions=True)
        for (index, spec), outcome in zip(specs, outcomes):
            if isinstance(outcome, APIError):
                results[index] = failed(index, outcome)
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                result, queue_ms = outcome
                results[index] = {"index": index, "custom_id": body.requests[index].custom_id, "status_code": 200,
                                  "response": self.body(spec, result, queue_ms), "error": None}
        return {"object": "batch.result", "data": results}

    # -- response bodies ---------------------------------------------------------------------
    def body(self, spec: GenerationSpec, result: GenerationResult, queue_ms: float) -> dict[str, Any]:
        stats = result.stats
        generated = result.logprobs or []
        if spec.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": result.text},
                                      "finish_reason": stats.finish_reason,
                                      "logprobs": chat_logprobs(generated) if spec.logprobs is not None else None}
            obj = "chat.completion"
        else:
            echoed = (result.prompt_text or "") if spec.echo else ""
            logprobs = None
            if spec.logprobs is not None:
                logprobs = completion_logprobs((result.prompt_logprobs or []) if spec.echo else [])
                after = completion_logprobs(generated, base=len(echoed))
                logprobs = {key: logprobs[key] + after[key] for key in logprobs}
            choice = {"index": 0, "text": echoed + result.text, "finish_reason": stats.finish_reason,
                      "logprobs": logprobs}
            obj = "text_completion"
        return {
            "id": spec.response_id,
            "object": obj,
            "created": int(time.time()),
            "model": self.engine.name,
            "choices": [choice],
            "usage": usage(stats),
            "prunewatch": prunewatch_block(stats, queue_ms, self.device_name),
        }

    async def sse(self, job: GenerationJob[TokenDelta | GenerationResult], spec: GenerationSpec
                  ) -> AsyncIterator[bytes]:
        """Server-sent events: text chunks, a final chunk with usage and prunewatch stats, [DONE].

        `job` is started by the caller before the response is, so its slot is released when the
        generation ends even if this iterator is never read.
        """
        try:
            async for event in self._events(job, spec):
                yield event
        finally:  # the client went away or the stream ended: the worker stops at its next token
            job.cancel()

    async def _events(self, job: GenerationJob[TokenDelta | GenerationResult], spec: GenerationSpec
                      ) -> AsyncIterator[bytes]:
        created = int(time.time())
        chat = spec.kind == "chat"
        base = {"id": spec.response_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": self.engine.name}

        def chunk(choice: dict[str, Any], **extra: Any) -> bytes:
            return b"data: " + json.dumps({**base, "choices": [choice], **extra}).encode() + b"\n\n"

        def logprobs(entries: list[TokenLogprob], base: int = 0) -> dict[str, Any] | None:
            if spec.logprobs is None:
                return None
            return chat_logprobs(entries) if chat else completion_logprobs(entries, base)

        if chat:
            yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                         "logprobs": None})
        echoed = sent = 0  # characters of the echoed prompt; answer tokens whose logprobs went out
        try:
            async for item in job.items():
                if isinstance(item, TokenDelta):
                    if item.echo:  # the prompt, first, with its tokens' logprobs (offsets into the prompt)
                        echoed = len(item.text)
                        yield chunk({"index": 0, "text": item.text, "finish_reason": None,
                                     "logprobs": logprobs(list(item.logprobs))})
                        continue
                    sent += len(item.logprobs)
                    if chat:
                        yield chunk({"index": 0, "delta": {"content": item.text}, "finish_reason": None,
                                     "logprobs": logprobs(list(item.logprobs))})
                    else:
                        yield chunk({"index": 0, "text": item.text, "finish_reason": None,
                                     "logprobs": logprobs(list(item.logprobs), echoed)})
                    continue
                stats = item.stats
                self.metrics.record_generation(stats)
                rest = (item.logprobs or [])[sent:]  # e.g. the end of sequence, which adds no text
                final = ({"index": 0, "delta": {}, "finish_reason": stats.finish_reason,
                          "logprobs": logprobs(rest) if rest else None} if chat
                         else {"index": 0, "text": "", "finish_reason": stats.finish_reason,
                               "logprobs": logprobs(rest, echoed) if rest else None})
                yield chunk(final, usage=usage(stats), prunewatch=prunewatch_block(stats, job.queue_ms, self.device_name))
        except InvalidRequestError as exc:
            yield b"data: " + json.dumps(error_body(str(exc), code="invalid_value")).encode() + b"\n\n"
            return
        except Exception:  # the status line is gone: report in-band, as OpenAI does, and end the stream
            logger.exception("generation %s failed while streaming", spec.request_id)
            yield b"data: " + json.dumps(error_body("The server had an error while generating.", SERVER_ERROR,
                                                    code="internal_error")).encode() + b"\n\n"
            return
        yield b"data: [DONE]\n\n"
