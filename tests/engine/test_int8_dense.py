"""The dense int8 product (csrc/int8_dense.cpp): its layout, its arithmetic against a by-hand reference of the
inputs' rounding to int16, its distance from the fp32 product, the bits a row gets in any batch and under any thread
count, and where an int8 layer uses it (and where it cannot)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from prunewatch.engine.execution import ExecutionLedger, ExecutionPlan, executing
from prunewatch.engine.sparse.kernel import int8_dense_kernel
from prunewatch.engine.sparse.module import SparseLinear, SparsityOptions
from prunewatch.engine.sparse.quantize import (
    INT4_GROUP,
    dequantize_int8,
    int8_by_output_fits,
    pack_int8_by_output,
    quantize_int8,
)
from prunewatch.engine.sparse.thresholds import LayerThresholds

ROUNDED_ORDER = [*range(0, 8), *range(16, 24), *range(8, 16), *range(24, 32)]


@pytest.fixture(scope="module")
def kernel():
    return int8_dense_kernel("cpu")


def _layer(n_in: int, n_out: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, scale = quantize_int8(torch.randn(n_in, n_out, generator=g) * 0.05)
    return q, scale, pack_int8_by_output(q)


def _reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y by hand, in float64: x rounded to int16 per group of 32 (scale amax / 32767, half to even), the integer
    dot products with the weights' codes, then the inputs' and the outputs' scales."""
    rows, n_in = x.shape
    groups = n_in // INT4_GROUP
    xg = x.double().reshape(rows, groups, INT4_GROUP)
    amax = xg.abs().amax(dim=-1, keepdim=True)
    xq = torch.where(amax > 0, torch.round(xg.float() * (32767 / amax.float())).double(), torch.zeros_like(xg))
    dots = torch.einsum("rgi,gio->rgo", xq, q.double().reshape(groups, INT4_GROUP, -1))  # integers
    return (dots * (amax / 32767)).sum(dim=1) * scale.double()


def _bound(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """How far the product may be from the fp32 one: each input moved by at most half its group's step."""
    rows, n_in = x.shape
    step = x.abs().reshape(rows, -1, INT4_GROUP).amax(dim=-1).double() / 65534  # (rows, groups)
    weights = dequantize_int8(q, scale).double().abs().reshape(n_in // INT4_GROUP, INT4_GROUP, -1).sum(dim=1)
    return torch.einsum("rg,go->ro", step, weights)


def test_the_by_output_layout_pairs_the_weights_of_16_outputs_per_pair_of_rounded_inputs():
    q, _, by_output = _layer(64, 48, seed=1)
    assert by_output.shape == (3, 2, 16, 32) and by_output.dtype == torch.int8
    for o, g, j in ((0, 0, 0), (13, 1, 5), (47, 1, 15), (20, 0, 9)):
        piece = by_output[o // 16, g, j]  # 16 outputs' weights for rounded inputs 2j and 2j + 1, side by side
        expected = q[[32 * g + ROUNDED_ORDER[2 * j], 32 * g + ROUNDED_ORDER[2 * j + 1]], o]
        assert torch.equal(piece[2 * (o % 16):2 * (o % 16) + 2], expected)
    assert int8_by_output_fits(576, 192) and not int8_by_output_fits(48, 64) and not int8_by_output_fits(64, 24)
    with pytest.raises(ValueError, match="int8"):
        pack_int8_by_output(q[:48].contiguous())
    with pytest.raises(ValueError, match="int8"):
        pack_int8_by_output(q.float())


@pytest.mark.parametrize(("shape", "rows"), [((32, 16), 1), ((64, 96), 2), ((576, 192), 3), ((576, 192), 7), ((1536, 576), 8)])
def test_the_product_is_the_integer_dot_products_of_int16_inputs(kernel, shape, rows):
    q, scale, by_output = _layer(*shape, seed=rows)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(rows, shape[0], generator=g)
    if shape[0] > INT4_GROUP:
        x[0, :INT4_GROUP] = 0.0  # a group with nothing to scale
    bias = torch.randn(shape[1], generator=g)
    y = kernel(x, by_output, scale, bias, 0)
    torch.testing.assert_close(y.double(), _reference(x, q, scale) + bias.double(), rtol=1e-5, atol=1e-4)
    exact = x.double() @ dequantize_int8(q, scale).double() + bias.double()
    assert bool(((y.double() - exact).abs() <= _bound(x, q, scale) + 1e-5).all())
    assert 0 < float((y.double() - exact).abs().max()) < 1e-3  # it rounds, by little
    # An outlier input coarsens only its own group's step: the product stays within the same bound.
    x[:, 5] = 40.0
    y = kernel(x, by_output, scale, bias, 0)
    exact = x.double() @ dequantize_int8(q, scale).double() + bias.double()
    assert bool(((y.double() - exact).abs() <= _bound(x, q, scale) + 1e-5).all())


def test_misshapen_inputs_are_refused(kernel):
    _, scale, by_output = _layer(64, 32, seed=5)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel(torch.randn(1, 48), by_output, scale, None, 0)
    with pytest.raises(RuntimeError, match="by_output must be"):
        kernel(torch.randn(1, 64), by_output[:, :1].contiguous(), scale, None, 0)
    with pytest.raises(RuntimeError, match="by_output must be"):
        kernel(torch.randn(1, 64), by_output.view(torch.uint8), scale, None, 0)
    with pytest.raises(RuntimeError, match="weight_scale must be"):
        kernel(torch.randn(1, 64), by_output, scale.half(), None, 0)
    with pytest.raises(RuntimeError, match="bias"):
        kernel(torch.randn(1, 64), by_output, scale, torch.zeros(31), 0)


def _int8_layer(n_in: int, n_out: int) -> SparseLinear:
    thresholds = LayerThresholds(levels=(0.0, 0.5), values=(0.0, 0.5))
    return SparseLinear(nn.Linear(n_in, n_out, bias=True), 0, "mlp.up_proj", thresholds, torch.ones(n_in),
                        SparsityOptions(weights="int8", max_kernel_rows=4))


def test_an_int8_layer_multiplies_few_rows_laid_out_by_output_and_a_prefill_in_fp32(kernel):
    layer = _int8_layer(64, 96)
    g = torch.Generator().manual_seed(6)
    decode, prefill = torch.randn(1, 2, 64, generator=g), torch.randn(1, 9, 64, generator=g)
    with torch.no_grad(), executing(ExecutionPlan(), ExecutionLedger()):
        y_decode, y_prefill = layer(decode), layer(prefill)
    assert torch.equal(y_decode[0], kernel(decode[0], layer.weight_by_output, layer.weight_scale, layer.linear.bias, 0))
    weights = dequantize_int8(layer.weight_t, layer.weight_scale)
    torch.testing.assert_close(y_prefill, F.linear(prefill, weights.t(), layer.linear.bias))


def test_an_int8_layer_whose_sizes_do_not_fit_reads_its_rows_exactly():
    layer = _int8_layer(40, 20)  # 40 inputs: not whole groups of 32
    assert layer.weight_by_output is None
    x = torch.randn(1, 40, generator=torch.Generator().manual_seed(8))
    with torch.no_grad(), executing(ExecutionPlan(), ExecutionLedger()):
        y = layer(x)
    expected = F.linear(x, dequantize_int8(layer.weight_t, layer.weight_scale).t(), layer.linear.bias)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)  # fp32 sums of the exact weights, no rounding


def test_the_compiled_steps_operator_takes_the_same_product_and_counts_every_row(kernel):
    from prunewatch.engine.sparse.kernel import counted_op

    q, scale, by_output = _layer(576, 192, seed=9)
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(10))
    stats = torch.zeros(2, 3, dtype=torch.long)
    thresholds, keeps = torch.tensor([-1.0, -1.0]), torch.tensor([-1, -1])
    y = counted_op()(x, q, None, torch.ones(576), thresholds, keeps, 0, stats, 1, scale, by_output)
    assert torch.equal(y, kernel(x, by_output, scale, None, 0))  # bits: the row kernel would differ by the rounding
    assert stats[1].tolist() == [576, 2 * 576, 1] and stats[0].tolist() == [0, 0, 0]


def test_an_int8_output_head_takes_the_dense_product_for_few_rows_and_counts_it_dense(kernel):
    from prunewatch.engine.sparse.output_head import ShortlistHead

    torch.manual_seed(11)
    head = ShortlistHead(nn.Linear(64, 208, bias=False), max_kernel_rows=4, weights="int8")
    assert head.weight_by_output is not None
    x = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(12))
    ledger = ExecutionLedger()
    with torch.no_grad(), executing(ExecutionPlan(), ledger):
        y = head(x)
    assert torch.equal(y[0], kernel(x[0], head.weight_by_output, head.weight_scale, None, 0))
    assert ledger.executed_flops == ledger.dense_flops == 3 * 2 * 64 * 208
    assert ledger.weight_bytes_read == head.dense_read_bytes
    expected = F.linear(x, dequantize_int8(head.weight_t, head.weight_scale).t())
    assert float((y - expected).abs().max()) < 1e-3  # the int16 rounding of the inputs, nothing more
    odd = ShortlistHead(nn.Linear(40, 200, bias=False), weights="int8")  # 40 inputs: not whole groups
    assert odd.weight_by_output is None
    with torch.no_grad(), executing(ExecutionPlan(), ExecutionLedger()):
        y = odd(x[..., :40])
    torch.testing.assert_close(y, F.linear(x[..., :40], dequantize_int8(odd.weight_t, odd.weight_scale).t()),
                               rtol=1e-5, atol=1e-5)
