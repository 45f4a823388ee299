"""The shortlist output head (prunewatch/engine/sparse/output_head.py): exact logits where it says so, the masked
approximation elsewhere, the dense argmax kept, and its work counted from what it read."""

from __future__ import annotations

import pytest
import torch

from prunewatch.engine.errors import InvalidRequestError
from prunewatch.engine.execution import ExecutionLedger, ExecutionPlan, executing
from prunewatch.engine.settings import OUTPUT_HEAD_FULL_AT, output_head_target
from prunewatch.engine.sparse.output_head import ShortlistHead
from tests.conftest import calibration_inputs
from tests.engine.sparse_oracle import hook_count, oracle_ratio


@pytest.fixture(scope="module")
def head_engine(probe_model_dir, calibration_dir):
    """The probe model with the engine's default output head (and no other mechanism)."""
    from prunewatch.engine import EngineSettings, PruningEngine

    engine = PruningEngine.load(EngineSettings(model_dir=probe_model_dir, device="cpu", calibration_dir=calibration_dir,
                                               activation_sparsity=0.0, log_level="NONE"))
    engine.load_or_calibrate(*calibration_inputs())
    return engine


def _hidden(engine, rows: int) -> torch.Tensor:
    """Final hidden states of real text, the head's real input: (rows, hidden)."""
    ids = torch.tensor([engine.render_raw("The routing table lists every network the router can reach. " * 4)])
    with torch.no_grad():
        return engine.loaded.model.model(input_ids=ids).last_hidden_state[0, :rows]


def _masked(x: torch.Tensor, sparsity: float) -> torch.Tensor:
    keep = max(1, round((1 - sparsity) * x.shape[-1]))
    kept = x.abs().topk(keep, dim=-1).indices
    return torch.zeros_like(x).scatter(-1, kept, x.gather(-1, kept))


def test_the_default_engine_installs_the_head_and_scales_its_target(head_engine):
    head = head_engine.loaded.model.get_output_embeddings()
    assert isinstance(head, ShortlistHead)
    ids = head_engine.render_prompt("Show the routing table.")
    setting = head_engine.settings.output_head_sparsity
    assert setting == 0.6
    for sensitivity in (1.0, 0.5, 0.25, 0.1):
        plan = head_engine.execution_plan(ids, sensitivity, [])
        effective = head_engine.plan(ids, sensitivity, [])[0].signals.effective_sensitivity
        assert plan.output_head_sparsity == pytest.approx(output_head_target(setting, effective), abs=1e-4)
        assert plan.output_head_candidates == 1024
    assert output_head_target(0.6, OUTPUT_HEAD_FULL_AT) == 0.6 and output_head_target(0.6, 1.0) == 0.6
    assert output_head_target(0.6, OUTPUT_HEAD_FULL_AT / 2) == pytest.approx(0.3)
    assert head_engine.execution_plan(ids, 0.0, []).output_head_sparsity == 0.0


@pytest.mark.parametrize("rows", [1, 3, 40])  # decode step, a small batch, teacher-forced scoring (masked dense)
def test_shortlisted_logits_are_exact_and_the_rest_approximate(head_engine, rows):
    head = head_engine.loaded.model.get_output_embeddings()
    x = _hidden(head_engine, rows)
    assert x.shape[0] == rows
    weight = head.linear.weight
    dense = x @ weight.T
    approx = _masked(x, 0.6) @ weight.T
    plan = ExecutionPlan(output_head_sparsity=0.6, output_head_candidates=64)
    ledger = ExecutionLedger()
    with torch.no_grad(), executing(plan, ledger):
        logits = head(x)
    shortlist = approx.topk(64, dim=-1).indices
    assert torch.allclose(logits.gather(-1, shortlist), dense.gather(-1, shortlist), atol=1e-4)
    outside = torch.ones_like(dense, dtype=torch.bool).scatter(-1, shortlist, False)
    assert torch.allclose(logits[outside], approx[outside], atol=1e-4)
    assert torch.equal(logits.argmax(-1), dense.argmax(-1))  # the dense winners are all shortlisted here
    hidden, vocab = weight.shape[1], weight.shape[0]
    keep = round(0.4 * hidden)
    approximate = 2 * vocab * (keep if rows <= head.max_kernel_rows else hidden)
    assert ledger.dense_flops == 2 * vocab * hidden * rows
    assert ledger.executed_flops == (approximate + 2 * 64 * hidden) * rows


def test_the_head_runs_dense_without_a_target_and_counts_through_its_hook(head_engine):
    head = head_engine.loaded.model.get_output_embeddings()
    x = _hidden(head_engine, 2)
    ledger = ExecutionLedger()
    with torch.no_grad(), executing(ExecutionPlan(), ledger):
        logits = head(x)
    assert torch.equal(logits, head.linear(x))
    assert ledger.executed_flops == ledger.dense_flops == 2 * head.linear.weight.numel() * 2


def test_a_request_with_the_head_agrees_with_the_hook_count_and_keeps_the_dense_tokens(head_engine):
    ids = head_engine.render_prompt("Summarise the liability clause of the contract.")
    dense = head_engine.measure_decode(ids, ExecutionPlan(), 8).tokens
    plan = ExecutionPlan(output_head_sparsity=0.5, output_head_candidates=256)
    ledger = ExecutionLedger()
    with hook_count(head_engine.instrumented) as count:
        tokens = list(head_engine._decode(ids, plan, ledger, 8, use_cache=True, stop_at_eos=False))
    assert tokens == dense
    assert ledger.dense_flops == count["dense"] and ledger.executed_flops == count["executed"]
    assert ledger.decode_pruning_ratio > 0.0 and ledger.pruning_ratio == pytest.approx(oracle_ratio(count))
    assert not ledger.overcounted


@pytest.mark.parametrize("fields, message", [
    ({"output_head_sparsity": 1.0}, "output head sparsity"),
    ({"output_head_sparsity": -0.1}, "output head sparsity"),
    ({"output_head_candidates": 0}, "candidates"),
])
def test_plans_refuse_an_output_head_target_out_of_range(fields, message):
    with pytest.raises(InvalidRequestError, match=message):
        ExecutionPlan(**fields)


def test_instrumenting_again_counts_the_wrapped_head_once(head_engine):
    """instrument() is idempotent: with the shortlist head in place of the model's own, the dense work per
    token still includes the head (read through the wrapper), and nothing inside a block counts twice."""
    from prunewatch.engine.execution import instrument

    assert isinstance(head_engine.loaded.model.get_output_embeddings(), ShortlistHead)
    again = instrument(head_engine.loaded.model)
    head = head_engine.loaded.model.get_output_embeddings().linear
    assert again.dense_flops_per_token == head_engine.instrumented.dense_flops_per_token
    assert again.dense_flops_per_token == sum(b.dense_flops_per_row for b in again.blocks) + 2 * head.weight.numel()
