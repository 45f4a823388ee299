"""The row policy's mask of a call with many rows in one pass (csrc/threshold_mask.cpp): the same bits and counts as
the tensor operators it replaces, the refusal of misshapen inputs, and a prefill of a sparse layer taking it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from prunewatch.engine.execution import ExecutionLedger, ExecutionPlan, executing
from prunewatch.engine.sparse.kernel import threshold_mask_kernel
from prunewatch.engine.sparse.module import SparseLinear, SparsityOptions
from prunewatch.engine.sparse.thresholds import LayerThresholds


@pytest.fixture(scope="module")
def mask():
    found = threshold_mask_kernel("cpu", torch.float32)
    assert found is not None
    return found


def _operators(x: torch.Tensor, scale: torch.Tensor, threshold: float) -> tuple[torch.Tensor, int]:
    """What SparseLinear computed with tensor operators before: the score, the comparison, x times the mask."""
    kept = x.abs().float() * scale > threshold
    return x * kept, int(kept.sum())


@pytest.mark.parametrize("shape", [(1, 40, 64), (3, 7), (2, 5, 96)])
def test_the_mask_is_the_operators_bit_for_bit_with_their_count(mask, shape):
    g = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(*shape, generator=g)
    x.view(-1)[:5] = torch.tensor([0.0, -0.0, -1e-30, float("inf"), -float("inf")])  # zeros, a tiny and infinities
    scale = torch.rand(shape[-1], generator=g) + 0.5
    for threshold in (-1.0, 0.0, 0.3, 0.7 + 1e-9, 10.0):
        masked, kept = mask(x, scale, threshold)
        expected, expected_kept = _operators(x, scale, threshold)
        assert kept == expected_kept
        assert torch.equal(masked, expected)
        assert torch.equal(torch.signbit(masked), torch.signbit(expected))  # a dropped negative is -0 in both
    masked, kept = mask(x, scale, 10.0)
    assert kept == 2 and int((masked != 0).sum()) == 2  # only the infinities pass a threshold of 10


def test_misshapen_inputs_are_refused(mask):
    x, scale = torch.randn(4, 8), torch.ones(8)
    with pytest.raises(RuntimeError, match="length 8"):
        mask(x, torch.ones(7), 0.1)
    with pytest.raises(RuntimeError, match="float32"):
        mask(x.double(), scale, 0.1)
    with pytest.raises(RuntimeError, match="contiguous"):
        mask(x.t(), torch.ones(4), 0.1)
    assert threshold_mask_kernel("cpu", torch.bfloat16) is None and threshold_mask_kernel("meta", torch.float32) is None


def test_a_prefill_of_a_sparse_layer_is_the_masked_input_times_the_dense_weights(mask):
    thresholds = LayerThresholds(levels=(0.0, 0.5), values=(0.0, 0.6))
    layer = SparseLinear(nn.Linear(64, 48, bias=True), 0, "mlp.up_proj", thresholds, torch.ones(64),
                         SparsityOptions(max_kernel_rows=4))
    x = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(3))  # 9 rows > max_kernel_rows
    ledger = ExecutionLedger()
    with torch.no_grad(), executing(ExecutionPlan(activation_sparsity=0.5), ledger):
        y = layer(x)
    threshold = layer.thresholds.at(0.5)
    expected, kept = _operators(x, layer.scale, threshold)
    assert torch.equal(y, layer.linear(expected))
    assert ledger.sparse_kept_entries == kept and 0 < kept < x.numel()
    assert ledger.sparse_executed_flops == 9 * 2 * 64 * 48  # counted as the dense work it is
