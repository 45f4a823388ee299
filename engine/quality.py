"""Score a pruned execution plan against the dense model on the same prompt.

Teacher forcing on the dense continuation isolates the plan's effect from divergence: both
models read the very same tokens, and we compare their next-token predictions position by
position (agreement) and the likelihood each assigns to the dense continuation (perplexity).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from engine.execution import ExecutionLedger, ExecutionPlan, InstrumentedModel, executing
from engine.stats import QualityReport


@torch.no_grad()
def _continuation_logits(instrumented: InstrumentedModel, ids: torch.Tensor, plan: ExecutionPlan) -> torch.Tensor:
    with executing(plan, ExecutionLedger()):  # scoring work is not the request's work
        return instrumented.model(input_ids=ids, use_cache=False).logits[0].float()  # (T, V)


def score_against_dense(
    instrumented: InstrumentedModel,
    prompt_ids: list[int],
    dense_continuation: list[int],
    plan: ExecutionPlan,
    device: torch.device,
) -> QualityReport | None:
    """Agreement and perplexity delta of `plan` on the dense continuation; None if it is empty."""
    if not dense_continuation:
        return None
    ids = torch.tensor([prompt_ids + dense_continuation], device=device)
    start = len(prompt_ids) - 1  # logits at position t predict token t + 1
    targets = ids[0, len(prompt_ids):]
    dense_logits = _continuation_logits(instrumented, ids, ExecutionPlan())[start:-1]
    pruned_logits = dense_logits if not plan.skips_work else _continuation_logits(instrumented, ids, plan)[start:-1]
    agreement = float((pruned_logits.argmax(-1) == targets).float().mean())
    dense_nll = float(torch.nn.functional.cross_entropy(dense_logits, targets))
    pruned_nll = float(torch.nn.functional.cross_entropy(pruned_logits, targets))
    dense_ppl, pruned_ppl = math.exp(dense_nll), math.exp(pruned_nll)
    return QualityReport(
        token_agreement=round(agreement, 6),
        dense_perplexity=round(dense_ppl, 4),
        pruned_perplexity=round(pruned_ppl, 4),
        perplexity_delta_pct=round((pruned_ppl - dense_ppl) / dense_ppl * 100.0, 4),
        scored_tokens=int(targets.numel()),
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
        dense = _continuation_logits(engine.instrumented, x, ExecutionPlan())[:-1]
        pruned = dense if not plan.skips_work else _continuation_logits(engine.instrumented, x, plan)[:-1]
        dense_nll += float(torch.nn.functional.cross_entropy(dense, targets, reduction="sum"))
        pruned_nll += float(torch.nn.functional.cross_entropy(pruned, targets, reduction="sum"))
        tokens += int(targets.numel())
    if tokens == 0:
        raise ValueError("held-out texts have no tokens to score")
    return (math.exp((pruned_nll - dense_nll) / tokens) - 1.0) * 100.0
