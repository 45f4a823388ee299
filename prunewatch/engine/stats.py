"""Plain per-request statistics. The engine fills them; exporters (SQL, Prometheus, logs) read them.

Every figure carries how it was obtained: the pruning ratio is *measured* by counting the linear
layers' work that really executed; DRAM bytes per instruction is either measured by Nsight
Compute (`ncu`) or a model-level *estimate*; nothing here is configured.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from prunewatch.engine.logprobs import TokenLogprob

RATIO_UNIT = "linear_flops"
"""The pruning ratio's unit: FLOPs of the linear (matmul) layers, 2 x in x out per token row.

Attention-score products (QK^T, AV) are excluded from numerator and denominator alike, so the
ratio slightly understates what a bypassed layer saves. The output head (LM head) is counted on
both sides: dense, or under an output-head target (prunewatch.engine.sparse.output_head) the weight rows of
its kept inputs plus its exact shortlist. A ratio below 0 is reported as measured, never clamped:
it would mean work was counted twice."""


@dataclass(frozen=True)
class QualityReport:
    """The answer this request served, scored against the dense model (the reference) on the same prompt.

    The primary figures read the served answer itself: one teacher-forced pass of the dense model over
    prompt + served answer, counting the answer's tokens that equal the dense argmax given the served
    prefix. The `continuation_*` figures need a second, dense generation (quality "full"): the pruned
    model teacher-forced on the dense model's own continuation, a more forgiving figure (an answer that
    left the dense path early can still score high there) that only this engine can give."""

    reference_agreement: float  # share of served answer tokens equal to the dense argmax, 0..1
    reference_tokens: int  # served answer tokens scored
    served_nll: float  # mean NLL (nats/token) of the served answer under the dense model
    continuation_agreement: float | None = None  # pruned plan's argmax on the dense continuation, teacher-forced
    dense_perplexity: float | None = None  # perplexity of the dense continuation under the dense model
    pruned_perplexity: float | None = None  # ... and under the pruned model with the request's plan
    perplexity_delta_pct: float | None = None  # (pruned - dense) / dense x 100
    continuation_tokens: int | None = None  # length of the dense continuation that was scored
    reference_nll: float | None = None  # mean NLL of the dense continuation under the dense model
    divergence_at: int | None = None  # first token where the served answer leaves the dense one; None: it never does


@dataclass
class RequestStats:
    """What one request cost and what pruning skipped, as measured while it ran."""

    request_id: str
    model: str
    device: str
    dtype: str
    prompt_tokens: int
    completion_tokens: int
    preprocessing_ms: float  # tokenize, domain match, bypass plan
    inference_ms: float  # prefill + decode
    postprocessing_ms: float  # detokenize, stats (the quality check is quality_ms, apart)
    ttft_ms: float  # request start -> first generated token
    decode_tokens_per_s: float  # tokens after the first / decode time
    tokens_per_s: float  # completion tokens / inference time
    sensitivity: float
    pruning_ratio: float  # 1 - executed / dense work, in RATIO_UNIT, over prefill + decode
    executed_flops: int
    dense_flops: int
    prefill_pruning_ratio: float = 0.0  # the same over the prompt's forward pass alone
    decode_pruning_ratio: float = 0.0  # ... over the decode steps alone (where skipping saves time)
    quality_ms: float = 0.0  # dense re-run + teacher-forced scoring, only when quality was asked for
    ratio_unit: str = RATIO_UNIT
    ratio_source: str = "measured"  # counted from the linear layers that ran
    layers_bypassed: list[int] = field(default_factory=list)
    layers_total: int = 0
    heads_gated: int = 0
    activation_sparsity: float = 0.0
    domain: str | None = None  # calibrated domain the prompt matched best
    domain_confidence: float = 0.0  # softmax weight of that domain, 0..1
    fallback_reason: str | None = None  # why the request ran dense although sensitivity > 0
    effective_sensitivity: float = 0.0  # sensitivity after the adaptive-threshold signals
    signals: dict[str, Any] | None = None  # each signal's value and factor (see prunewatch/engine/signals.py)
    quality_flags: list[str] = field(default_factory=list)  # ratio_above_red_line, agreement_below_floor
    quality: QualityReport | None = None
    peak_memory_bytes: int = 0
    peak_memory_source: str = "rss_delta"  # or "cuda_max_allocated"
    dram_bytes_per_instruction: float | None = None
    dram_source: str = "estimate"  # "ncu" when measured with Nsight Compute; "unavailable" on a GPU without a profile
    finish_reason: str = "length"  # "stop" when the model emitted end of sequence
    # Rows per decode step it ran in: 1.0 alone; more when it shared steps with other requests (continuous
    # batching, prunewatch/engine/batching.py), whose work its counts hold an equal share of.
    mean_batch_size: float = 1.0
    # Prompt positions whose keys and values came from the prefix cache instead of the prefill
    # (prunewatch/engine/prefix_cache.py). The head's work is in neither FLOP count, stored or not.
    cached_prompt_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GenerationResult:
    """Generated text plus the request's statistics."""

    text: str
    token_ids: list[int]  # every generated token, end of sequence included
    stats: RequestStats
    served_ids: list[int] | None = None  # the tokens the client received: no end of sequence, none past a stop cut
    # Asked for with logprobs: every token of `text` (and the end of sequence, if it ended so) with its
    # log-probability; `offset` counts characters of `text`. None when not asked for.
    logprobs: list[TokenLogprob] | None = None
    # Asked for with echo: the prompt as its tokens decode, and with logprobs its tokens' entries (the
    # first one's logprob is None); `offset` counts characters of `prompt_text`.
    prompt_logprobs: list[TokenLogprob] | None = None
    prompt_text: str | None = None
