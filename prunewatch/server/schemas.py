"""Request and response bodies, mirroring OpenAI's chat and legacy completions APIs.

Unknown request fields are ignored, as OpenAI-compatible servers commonly do, so clients that send
newer OpenAI options still work; options this engine cannot honour (several choices, `suffix`) are
rejected explicitly rather than silently ignored. Decoding is greedy: `temperature`,
`top_p` and `seed` are accepted for compatibility and have no effect (reported as
`prunewatch.decoding = "greedy"`). `logprobs`, `top_logprobs` and `echo` are OpenAI's: the
log-probabilities are those of the model that produced the answer, under the request's pruning plan.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    StrictInt,
    Tag,
    WithJsonSchema,
)

from prunewatch.engine.logprobs import MAX_TOP_LOGPROBS
from prunewatch.engine.pruning_engine import MAX_STOP_SEQUENCES
from prunewatch.engine.stats import RATIO_UNIT

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for the legacy completions' `logprobs` (chat's is MAX_TOP_LOGPROBS)


def _encodable(value: str) -> str:
    """JSON can carry lone UTF-16 surrogates ("\\ud903") that no tokenizer can encode: refuse them here."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (it holds a lone surrogate code point)") from None
    return value


# Every free-text request field is Text, not str: the model name and custom_id are echoed back,
# and a lone surrogate in a JSON answer cannot be encoded (a 500 instead of this 422).
Text = Annotated[str, AfterValidator(_encodable)]

# -- requests ----------------------------------------------------------------------------------


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(BaseModel):
    """One text part of a message's content list (OpenAI's multi-part content)."""

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    """A chat turn. `developer` is OpenAI's newer name for `system` and is rendered as one."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]
    name: Text | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    """Accepted for compatibility: the final chunk always carries `usage`."""

    include_usage: bool | None = None


class _GenerationParams(_Request):
    model: Text = Field(description="The served model's id, as GET /v1/models lists it.")
    max_tokens: Annotated[int | None, Field(ge=1)] = Field(None, description="Completion length limit.")
    temperature: Annotated[float | None, Field(ge=0.0, le=2.0)] = Field(
        None, description="Accepted; decoding is greedy, so it has no effect.")
    top_p: Annotated[float | None, Field(ge=0.0, le=1.0)] = Field(
        None, description="Accepted; decoding is greedy, so it has no effect.")
    n: Annotated[int | None, Field(ge=1, le=1)] = Field(None, description="Only one choice is generated.")
    stream: bool | None = Field(False, description="Server-sent events, ending with `data: [DONE]`.")
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = Field(
        None, description=f"Up to {MAX_STOP_SEQUENCES} non-empty strings (256 characters at most each): the "
                          "completion ends where one first appears, and its text is cut before it "
                          "(finish_reason \"stop\").")
    seed: int | None = Field(None, description="Accepted; greedy decoding is deterministic anyway.")
    user: Text | None = None


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, int) and not isinstance(v, bool)
                                                           for v in value)


def _one_prompt(value: Any) -> Any:
    """OpenAI's `prompt` is a string, token ids, or a list of either; this server answers one prompt per request
    (then checked as Text or token ids): a list of ints is one prompt's tokens, any other list must hold one."""
    if not isinstance(value, list) or _is_token_ids(value):
        return value
    if not value:
        raise ValueError("the prompt is an empty list")
    if len(value) != 1:
        raise ValueError(f"one prompt per request, got a list of {len(value)}; send several as /v1/batch items")
    return value[0]


TokenId = Annotated[StrictInt, Field(ge=0)]
# One prompt, text or token ids: checked as one or the other (a list is ids), so an error names one problem.
# The tags read as pydantic's own union tags, which error locations leave out (prunewatch.server.errors._loc).
OnePrompt = Annotated[
    Annotated[Text, Tag("str")] | Annotated[list[TokenId], Field(min_length=1), Tag("list[int]")],
    Discriminator(lambda value: "list[int]" if isinstance(value, list) else "str"),
]
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
# What `prompt` accepts, as _one_prompt reads it (the validated type is only its result).
_PROMPT_SCHEMA = {
    "description": "The text to continue: a string or token ids (a list of integers), or a list holding one of "
                   "those.",
    "anyOf": [
        {"type": "string"},
        _TOKEN_IDS,
        {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1},
        {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": 1},
    ],
}


class ChatCompletionRequest(_GenerationParams):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int | None, Field(ge=1)] = Field(
        None, description="OpenAI's newer name for max_tokens; wins when both are given.")
    logprobs: bool | None = Field(
        None, description="true: each answer token's log-probability under the model that generated it "
                          "(`choices[0].logprobs.content`).")
    top_logprobs: Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)] = Field(
        None, description="With logprobs: how many of the most likely tokens to list at each position.")


class CompletionRequest(_GenerationParams):
    """POST /v1/completions. The prompt is continued as given (no chat template)."""

    prompt: Annotated[OnePrompt, BeforeValidator(_one_prompt), WithJsonSchema(_PROMPT_SCHEMA)]
    max_tokens: Annotated[int | None, Field(ge=0)] = Field(
        None, description="Completion length limit; 0 (with echo) scores the prompt without generating.")
    logprobs: Annotated[int | None, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] = Field(
        None, description="Each token's log-probability, with this many of the most likely tokens at its position "
                          "(`choices[0].logprobs`: tokens, token_logprobs, top_logprobs, text_offset).")
    echo: bool | None = Field(
        None, description="Return the prompt before the completion (with logprobs, its tokens' too; the first "
                          "token's logprob is null).")
    best_of: Annotated[int | None, Field(ge=1, le=1)] = Field(None, description="Only one candidate is generated.")
    suffix: None = Field(None, description="Not supported: only null.")


class PruningOverrides(BaseModel):
    """Per-item pruning controls of a batch item (the X-Pruning-* headers, as JSON)."""

    model_config = ConfigDict(extra="forbid")

    sensitivity: Annotated[float | None, Field(ge=0.0, le=1.0)] = None
    layer_blacklist: list[Annotated[int, Field(ge=0)]] | None = None
    log_level: Literal["NONE", "SUMMARY", "DETAILED"] | None = None
    quality: bool | Literal["on", "full", "off"] | None = Field(
        None, description="Score this item's answer against the dense model, as X-Pruning-Quality (true is on).")


class ChatBatchItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    custom_id: Text | None = Field(None, max_length=256, description="Echoed back to match results to items.")
    url: Literal["/v1/chat/completions"]
    body: ChatCompletionRequest
    pruning: PruningOverrides | None = None


class CompletionBatchItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    custom_id: Text | None = Field(None, max_length=256, description="Echoed back to match results to items.")
    url: Literal["/v1/completions"]
    body: CompletionRequest
    pruning: PruningOverrides | None = None


class BatchRequest(BaseModel):
    """POST /v1/batch: several requests, each pruned independently; `stream` is not allowed inside."""

    model_config = ConfigDict(extra="forbid")

    requests: list[Annotated[ChatBatchItem | CompletionBatchItem, Field(discriminator="url")]] = Field(min_length=1)


# -- responses ---------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(
        description="Prompt tokens whose keys and values came from the prefix cache (the prompt's head: up to the last user turn) "
                    "instead of being computed by the prefill.")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class QualityScore(BaseModel):
    """The served answer scored against the dense model on the same prompt (prunewatch.engine.quality)."""

    reference_agreement: float = Field(
        description="Share of the served answer's tokens equal to the dense model's argmax given the served prefix.")
    reference_tokens: int = Field(description="Served answer tokens scored.")
    served_nll: float = Field(description="Mean NLL (nats/token) of the served answer under the dense model.")
    continuation_agreement: float | None = Field(
        None, description="Full check only: the pruned model's argmax agreement, teacher-forced on the dense "
                          "model's own continuation (more forgiving than reference_agreement).")
    dense_perplexity: float | None = None
    pruned_perplexity: float | None = None
    perplexity_delta_pct: float | None = Field(None, description="Full check only: (pruned - dense) / dense x 100 "
                                                                 "on the dense continuation.")
    continuation_tokens: int | None = None
    reference_nll: float | None = Field(None, description="Full check only: mean NLL of the dense continuation.")
    divergence_at: int | None = Field(
        None, description="Full check only: first token where the served answer leaves the dense one; null if never.")


class PrunewatchStats(BaseModel):
    """What pruning did to this request, and what it cost. Same numbers as the X-Pruning-* headers."""

    request_id: str
    pruning_ratio: float = Field(description="1 - executed / dense work, in ratio_unit, prefill + decode; 0 is dense.")
    prefill_pruning_ratio: float = Field(description="The same over the prompt's forward pass alone.")
    decode_pruning_ratio: float = Field(description="The same over the decode steps alone.")
    ratio_unit: str = Field(RATIO_UNIT, description="What the ratio counts: linear-layer FLOPs.")
    ratio_source: str = Field(description="'measured': counted from the linear layers that actually ran.")
    executed_flops: int
    dense_flops: int
    sensitivity: float
    layers_bypassed: list[int]
    layers_total: int
    heads_gated: int
    sparsity: float = Field(description="Activation sparsity of the linear inputs (0 until the engine zeroes any).")
    total_tokens: int
    mean_batch_size: float = Field(
        1.0, description="Rows per decode step the request ran in: 1 alone; more when it shared steps with other "
                         "requests, whose counted work it holds an equal share of.")
    domain: str | None = Field(description="Calibrated domain the prompt matched; null when it ran dense.")
    domain_confidence: float
    fallback_reason: str | None = Field(description="Why it ran dense although sensitivity > 0 (e.g. uncalibrated).")
    effective_sensitivity: float = Field(description="Sensitivity after the adaptive-threshold signals (configured weights).")
    signals: dict[str, Any] | None = Field(description="Each adaptive-threshold signal's value and factor.")
    quality_flags: list[str] = Field(description="ratio_above_red_line / agreement_below_floor when crossed.")
    quality: QualityScore | None = Field(
        description="Measured against the dense model on the same prompt; null unless X-Pruning-Quality: on or full.")
    preprocessing_ms: float
    inference_ms: float
    postprocessing_ms: float
    quality_ms: float = Field(description="Time of the quality check (the scoring pass, plus the dense re-generation "
                                          "of a full check); 0 when not asked.")
    queue_ms: float = Field(description="Time admitted but waiting for a free worker.")
    ttft_ms: float
    tokens_per_s: float
    decode_tokens_per_s: float
    decoding: Literal["greedy"] = "greedy"
    device: str
    device_name: str | None = Field(
        None, description="Where the timings were measured: the processor's model name on a CPU, the GPU's on CUDA.")
    dtype: str
    peak_memory_bytes: int
    peak_memory_source: str
    dram_bytes_per_instruction: float | None
    dram_source: str


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(BaseModel):
    token: str = Field(description="The token decoded alone.")
    logprob: float = Field(description="Natural log of its probability under the model that generated it.")
    bytes: list[int] | None = Field(description="The token's own UTF-8 bytes (a character may span two tokens).")
    top_logprobs: list[TopLogprob] = Field(description="The top_logprobs most likely tokens here, most likely first.")


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs: one entry per token, the echoed prompt's first."""

    tokens: list[str] = Field(description="Each token decoded alone.")
    token_logprobs: list[float | None] = Field(description="Null for the first token of an echoed prompt.")
    top_logprobs: list[dict[str, float] | None] = Field(
        description="The most likely tokens at each position, and the token itself; null where token_logprobs is.")
    text_offset: list[int] = Field(description="Where each token's characters begin in `text`.")


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    finish_reason: Literal["stop", "length"]
    logprobs: ChatLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prunewatch: PrunewatchStats


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    prunewatch: PrunewatchStats


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error object; every non-2xx answer has this shape."""

    error: ErrorDetail


class BatchResult(BaseModel):
    index: int
    custom_id: str | None
    status_code: int
    response: ChatCompletion | Completion | None = None
    error: ErrorDetail | None = None


class BatchResponse(BaseModel):
    object: Literal["batch.result"] = "batch.result"
    data: list[BatchResult]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "prunewatch"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    model: str
    calibrated: bool
