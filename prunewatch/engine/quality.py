"""Score what a request served against the dense model (the reference) on the same prompt.

The primary figure reads the served answer itself: one teacher-forced pass of the dense model over
prompt + served answer gives, at every answer position, the dense argmax given the served prefix;
the reference-scored agreement is the share of answer tokens equal to it, and the served answer's
mean NLL under the dense model comes from the same pass. No second generation is needed, and the
same figure scores any engine that returns text (collector/reference.py does that over HTTP).

The secondary figure needs the dense model's own greedy continuation: the pruned plan is
teacher-forced on it, so both models read the very same tokens and the plan's effect is measured
position by position, apart from divergence (agreement and perplexity on the dense continuation).
It is more forgiving: an answer that left the dense path at token 2 can still score about 31/32.

The primitives (greedy continuation, teacher-forced logits, agreement, NLL) are public so the
benchmarks measure quality exactly as the engine reports it, rather than with a copy that can drift.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from prunewatch.engine.errors import InvalidRequestError
from prunewatch.engine.execution import ExecutionLedger, ExecutionPlan, InstrumentedModel, executing
from prunewatch.engine.stats import QualityReport

QUALITY_CHECKS = ("off", "on", "full")
"""What a request's quality check does: nothing; score the served answer against the dense model (one
teacher-forced pass); or that plus a dense re-generation for the continuation figures and the divergence."""


def quality_check(value: bool | str | None) -> str:
    """A request's quality check as one of QUALITY_CHECKS (True is "on", False and None "off")."""
    if value is None or value is False:
        return "off"
    if value is True:
        return "on"
    check = str(value).strip().lower()
    if check not in QUALITY_CHECKS:
        raise InvalidRequestError(f"quality must be one of {', '.join(QUALITY_CHECKS)}, got {value!r}")
    return check


@dataclass(frozen=True)
class ServedScore:
    """A served answer scored by a reference: counts, so callers can pool them over answers."""

    matches: int  # answer tokens equal to the reference's argmax given the served prefix
    tokens: int  # answer tokens scored
    nll_sum: float  # summed NLL (nats) of the answer's tokens under the reference

    @property
    def agreement(self) -> float:
        return self.matches / self.tokens

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / self.tokens


@torch.no_grad()
def teacher_forced_logits(model: nn.Module, ids: torch.Tensor, plan: ExecutionPlan,
                          ledger: ExecutionLedger | None = None) -> torch.Tensor:
    """fp32 logits (T, V) of one sequence `ids` (1, T) under `plan`, in one forward without a cache.

    Row t predicts token t + 1. The work is counted into `ledger` when one is given, else into a
    throwaway one: scoring work is not a request's work.
    """
    with executing(plan, ledger if ledger is not None else ExecutionLedger()):
        return model(input_ids=ids, use_cache=False).logits[0].float()  # (T, V)


def token_agreement(logits: torch.Tensor, targets: torch.Tensor) -> tuple[int, int]:
    """(matches, positions): how many argmax predictions of `logits` (N, V) equal `targets` (N,).

    Counts rather than a share, so callers can pool positions over several sequences.
    """
    return int((logits.argmax(dim=-1) == targets).sum()), int(targets.numel())


def next_token_nll(logits: torch.Tensor, targets: torch.Tensor,
                   reduction: Literal["sum", "mean"] = "sum") -> float:
    """Negative log-likelihood of `targets` (N,) under `logits` (N, V): summed to pool, or the mean."""
    return float(torch.nn.functional.cross_entropy(logits, targets, reduction=reduction))


@torch.no_grad()
def greedy_continuation(model: nn.Module, prompt: torch.Tensor, steps: int,
                        plan: ExecutionPlan | None = None, ledger: ExecutionLedger | None = None) -> torch.Tensor:
    """Token ids (steps,) `model` picks greedily after `prompt` (1, P) under `plan` (dense when None), with a KV cache.

    The plan governs the prefill as well as every decode step, so the cache matches the plan.
    This is the reference continuation `continuation_agreement` scores a plan against.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with executing(plan if plan is not None else ExecutionPlan(), ledger if ledger is not None else ExecutionLedger()):
        out = model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(dim=-1, keepdim=True)  # (1, 1)
        tokens = [token]
        for step in range(steps - 1):
            positions = torch.full((1, 1), prompt.shape[1] + step, device=prompt.device)
            out = model(input_ids=token, cache=cache, use_cache=True, position_ids=positions, logits_to_keep=1)
            token = out.logits[:, -1].argmax(dim=-1, keepdim=True)
            tokens.append(token)
    return torch.cat(tokens, dim=1)[0]


def continuation_agreement(model: nn.Module, prompt: torch.Tensor, continuation: torch.Tensor,
                           plan: ExecutionPlan) -> tuple[int, int]:
    """(matches, positions): `plan`'s teacher-forced predictions of a reference `continuation` (C,).

    The model reads `prompt` (1, P) and the reference itself, so one early miss does not make every
    later position differ: each position measures the plan, not the divergence before it.
    """
    ids = torch.cat([prompt[0], continuation])[None]  # (1, P + C)
    logits = teacher_forced_logits(model, ids, plan)[prompt.shape[1] - 1:-1]  # (C, V): predicts the continuation
    return token_agreement(logits, continuation)


def teacher_forced_nll(model: nn.Module, ids: torch.Tensor, plan: ExecutionPlan,
                       ledger: ExecutionLedger | None = None) -> tuple[float, int]:
    """(summed NLL, tokens scored) of `ids` (1, T) under `plan`: every token after the first, in one forward."""
    logits = teacher_forced_logits(model, ids, plan, ledger)[:-1]  # (T - 1, V)
    return next_token_nll(logits, ids[0, 1:]), ids.shape[1] - 1


@torch.no_grad()
def answer_token_scores(model: nn.Module, prompt_ids: Sequence[int], answer_ids: Sequence[int],
                        device: torch.device) -> tuple[list[bool], list[float]]:
    """Per answer token: whether it is `model`'s argmax given prompt + the answer before it, and its log-probability;
    `model` run dense in one teacher-forced pass over prompt + answer. The work is counted into a throwaway ledger:
    scoring is not the request's work."""
    if not answer_ids:
        return [], []
    ids = torch.tensor([list(prompt_ids) + list(answer_ids)], device=device)  # (1, P + A)
    logits = teacher_forced_logits(model, ids, ExecutionPlan())[len(prompt_ids) - 1:-1]  # (A, V): predicts the answer
    targets = ids[0, len(prompt_ids):]  # (A,)
    greedy = logits.argmax(dim=-1) == targets  # (A,)
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]  # (A,)
    return greedy.tolist(), logprobs.tolist()


def score_served(model: nn.Module, prompt_ids: Sequence[int], answer_ids: Sequence[int],
                 device: torch.device) -> ServedScore | None:
    """`answer_ids` scored by `model` run dense (answer_token_scores, pooled); None when the answer is empty."""
    greedy, logprobs = answer_token_scores(model, prompt_ids, answer_ids, device)
    if not greedy:
        return None
    return ServedScore(matches=sum(greedy), tokens=len(greedy), nll_sum=-sum(logprobs))


def divergence(served: Sequence[int], reference: Sequence[int]) -> int | None:
    """The first token index where `served` leaves `reference` (one ending where the other goes on counts);
    None when they are the same tokens."""
    for index, (a, b) in enumerate(zip(served, reference)):
        if a != b:
            return index
    return None if len(served) == len(reference) else min(len(served), len(reference))


def quality_report(instrumented: InstrumentedModel, prompt_ids: list[int], served_ids: list[int], plan: ExecutionPlan,
                   device: torch.device, dense_continuation: list[int] | None = None) -> QualityReport | None:
    """The served answer scored against the dense model; with `dense_continuation` (the dense model's own greedy
    answer), also the plan's agreement and perplexity on it and where the served answer leaves it. None when
    nothing was served."""
    served = score_served(instrumented.model, prompt_ids, served_ids, device)
    if served is None:
        return None
    report = QualityReport(reference_agreement=round(served.agreement, 6), reference_tokens=served.tokens,
                           served_nll=round(served.mean_nll, 6))
    if not dense_continuation:
        return report
    ids = torch.tensor([prompt_ids + dense_continuation], device=device)
    start = len(prompt_ids) - 1  # logits at position t predict token t + 1
    targets = ids[0, len(prompt_ids):]
    dense_logits = teacher_forced_logits(instrumented.model, ids, ExecutionPlan())[start:-1]
    pruned_logits = (dense_logits if not plan.skips_work
                     else teacher_forced_logits(instrumented.model, ids, plan)[start:-1])
    matches, positions = token_agreement(pruned_logits, targets)
    dense_nll = next_token_nll(dense_logits, targets, reduction="mean")
    pruned_nll = next_token_nll(pruned_logits, targets, reduction="mean")
    dense_ppl, pruned_ppl = math.exp(dense_nll), math.exp(pruned_nll)
    return QualityReport(
        reference_agreement=report.reference_agreement,
        reference_tokens=report.reference_tokens,
        served_nll=report.served_nll,
        continuation_agreement=round(matches / positions, 6),
        dense_perplexity=round(dense_ppl, 4),
        pruned_perplexity=round(pruned_ppl, 4),
        perplexity_delta_pct=round((pruned_ppl - dense_ppl) / dense_ppl * 100.0, 4),
        continuation_tokens=int(targets.numel()),
        reference_nll=round(dense_nll, 6),
        divergence_at=divergence(served_ids, dense_continuation),
    )


@torch.no_grad()
def heldout_perplexity_delta(engine, texts: Sequence[str]) -> float:
    """Perplexity delta (%) of the engine's configured pruning on text it was never calibrated on.

    Each passage is planned as a request with that passage as its prompt (so the adaptive signals
    see it), then scored teacher-forced under that plan and dense; NLL is pooled over all tokens.
    `engine` is a PruningEngine (not imported here: the engine module imports this one).
    """
    dense_nll = pruned_nll = 0.0
    tokens = 0
    for text in texts:
        ids = engine.render_raw(text)
        if len(ids) < 2:
            continue
        plan = engine.execution_plan(ids, engine.settings.sensitivity, list(engine.settings.layer_blacklist),
                                     prompt_text=text)
        x = torch.tensor([ids], device=engine.loaded.device)
        targets = x[0, 1:]
        dense = teacher_forced_logits(engine.instrumented.model, x, ExecutionPlan())[:-1]
        pruned = dense if not plan.skips_work else teacher_forced_logits(engine.instrumented.model, x, plan)[:-1]
        dense_nll += next_token_nll(dense, targets)
        pruned_nll += next_token_nll(pruned, targets)
        tokens += int(targets.numel())
    if tokens == 0:
        raise ValueError("held-out texts have no tokens to score")
    return (math.exp((pruned_nll - dense_nll) / tokens) - 1.0) * 100.0
