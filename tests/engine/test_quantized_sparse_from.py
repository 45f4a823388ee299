"""Where pruning does not pay on quantized weights (SparsityOptions.quantized_sparse_from): a quantized layer asked
for less sparsity than that multiplies dense and counts as dense work, judged on its own share of the request's
target (its allocation), while fp32 layers prune at any target; the engine's plans follow it eagerly and compiled."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from prunewatch.engine.execution import ExecutionLedger, ExecutionPlan, executing
from prunewatch.engine.sparse.kernel import int8_dense_kernel
from prunewatch.engine.sparse.module import SparseLinear, SparsityOptions
from prunewatch.engine.sparse.thresholds import LayerThresholds
from tests.conftest import SPEED_PROMPT, load_probe_engine

THRESHOLDS = LayerThresholds(levels=(0.0, 0.5, 0.9), values=(0.0, 0.67, 1.64))  # |x| quantiles of a unit normal


def _layer(weights: str, sparse_from: float, sparsity: LayerThresholds | None = None) -> SparseLinear:
    torch.manual_seed(0)
    return SparseLinear(nn.Linear(64, 96), 0, "mlp.up_proj", THRESHOLDS, torch.ones(64),
                        SparsityOptions(weights=weights, quantized_sparse_from=sparse_from), sparsity=sparsity)


def _run(layer: SparseLinear, target: float) -> tuple[torch.Tensor, ExecutionLedger]:
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(1))
    ledger = ExecutionLedger()
    with torch.no_grad(), executing(ExecutionPlan(activation_sparsity=target), ledger):
        return layer(x), ledger


def test_a_quantized_layer_below_the_floor_multiplies_dense_and_counts_it_dense():
    layer = _layer("int8", 0.6)
    assert layer.target_under(ExecutionPlan(activation_sparsity=0.4)) == 0.0
    y, ledger = _run(layer, 0.4)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(y, int8_dense_kernel("cpu")(x, layer.weight_by_output, layer.weight_scale, layer.linear.bias, 0))
    assert ledger.sparse_dense_flops == 0 and ledger.sparse_executed_flops == 0  # nothing asked of the kernel


def test_a_quantized_layer_at_or_above_the_floor_reads_only_its_active_rows():
    layer = _layer("int8", 0.6)
    assert layer.target_under(ExecutionPlan(activation_sparsity=0.7)) == pytest.approx(0.7)
    _, ledger = _run(layer, 0.7)
    assert 0 < ledger.sparse_executed_flops < 0.6 * ledger.sparse_dense_flops


def test_the_floor_judges_the_layers_own_share_of_the_target():
    generous = LayerThresholds(levels=(0.0, 1.0), values=(0.0, 2.0))  # this layer gets twice the request's target
    layer = _layer("int4", 0.6, sparsity=generous)
    assert layer.target_under(ExecutionPlan(activation_sparsity=0.4)) == pytest.approx(0.4)  # its share: 0.8
    assert layer.target_under(ExecutionPlan(activation_sparsity=0.2)) == 0.0  # its share: 0.4


def test_fp32_layers_and_a_floor_of_zero_prune_at_any_target():
    assert _layer("fp32", 0.6).target_under(ExecutionPlan(activation_sparsity=0.1)) == pytest.approx(0.1)
    assert _layer("int8", 0.0).target_under(ExecutionPlan(activation_sparsity=0.1)) == pytest.approx(0.1)
    assert _layer("int8", 1.0).target_under(ExecutionPlan(activation_sparsity=0.95)) == 0.0


def test_an_engine_with_quantized_layers_kept_dense_decodes_its_default_plan_as_dense_work(probe_model_dir,
                                                                                          calibration_dir):
    engine = load_probe_engine(probe_model_dir, calibration_dir, weights="int8", quantized_sparse_from=1.0,
                               output_head_sparsity=0.0, compile_decode=True)
    ids = engine.render_prompt(SPEED_PROMPT)
    plan = engine.execution_plan(ids, 1.0, [], prompt_text=SPEED_PROMPT)
    assert any(t > 0.0 for t in plan.layer_sparsity)  # the plan asks for sparsity; the layers decline it
    dense = engine.measure_decode(ids, ExecutionPlan(), 5, compiled=False)
    for compiled in (False, True):
        run = engine.measure_decode(ids, plan, 5, compiled=compiled)
        assert run.tokens == dense.tokens
        assert run.ledger.decode_pruning_ratio == 0.0
        assert run.ledger.decode_bytes_read == pytest.approx(dense.ledger.decode_bytes_read, rel=1e-3)


def test_a_quantized_engine_runs_its_head_dense_unless_told_its_own_head_sparsity(probe_model_dir, calibration_dir):
    ids = None
    for setting, expected in ((None, 0.0), (0.6, 0.6)):
        extra = {} if setting is None else {"quantized_output_head_sparsity": setting}
        engine = load_probe_engine(probe_model_dir, calibration_dir, weights="int8", output_head_sparsity=0.6, **extra)
        ids = ids or engine.render_prompt(SPEED_PROMPT)
        plan = engine.execution_plan(ids, 1.0, [], prompt_text=SPEED_PROMPT)
        assert plan.output_head_sparsity == pytest.approx(expected)  # output_head_sparsity is fp32's
