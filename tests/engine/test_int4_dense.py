"""The dense int4 product (csrc/int4_dense.cpp): its layout, its arithmetic against a by-hand reference of the
inputs' rounding to int16, its distance from the fp32 product, the bits a row gets in any batch and under any thread
count, and where an int4 layer uses it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from prunewatch.engine.execution import ExecutionLedger, ExecutionPlan, executing
from prunewatch.engine.sparse.kernel import int4_dense_kernel
from prunewatch.engine.sparse.module import SparseLinear, SparsityOptions
from prunewatch.engine.sparse.quantize import INT4_GROUP, dequantize_int4, pack_int4_by_output, quantize_int4
from prunewatch.engine.sparse.thresholds import LayerThresholds


@pytest.fixture(scope="module")
def kernel():
    return int4_dense_kernel("cpu")


def _layer(n_in: int, n_out: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    packed, scales = quantize_int4(torch.randn(n_in, n_out, generator=g) * 0.05)
    return packed, scales, pack_int4_by_output(packed)


def _reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y by hand, in float64: x rounded to int16 per group of 32 (scale amax / 32767, half to even), the integer
    dot products with the weights' codes, then the weights' scales and minimums."""
    rows, n_in = x.shape
    groups = n_in // INT4_GROUP
    xg = x.double().reshape(rows, groups, INT4_GROUP)
    amax = xg.abs().amax(dim=-1, keepdim=True)
    xq = torch.where(amax > 0, torch.round(xg.float() * (32767 / amax.float())).double(), torch.zeros_like(xg))
    step, minimum = scales[:, 0, :].double(), scales[:, 1, :].double()
    weights = dequantize_int4(packed, scales).double().reshape(groups, INT4_GROUP, -1)
    q = torch.round((weights - minimum[:, None, :]) / torch.where(step > 0, step, 1.0)[:, None, :])
    dots = torch.einsum("rgi,gio->rgo", xq, q)  # integers
    return (dots * (amax / 32767) * step[None]).sum(dim=1) + (xg.sum(dim=-1)[:, :, None] * minimum[None]).sum(dim=1)


def test_the_by_output_layout_pairs_the_nibbles_of_16_outputs_with_the_rounded_inputs():
    packed, _, by_output = _layer(64, 96, seed=1)
    runs = packed.reshape(64, 3, 16)
    q = torch.stack((runs & 0xF, runs >> 4), dim=2).reshape(64, 96)  # the sparse kernel's layout, read back
    assert by_output.shape == (6, 2, 8, 32) and by_output.dtype == torch.uint8
    rounded = [*range(0, 8), *range(16, 24), *range(8, 16), *range(24, 32)]  # the rounded order (csrc/integer_dense.h)
    for o, g, j in ((0, 0, 0), (13, 1, 3), (95, 1, 7), (40, 0, 5)):
        pair = by_output[o // 16, g, j, 2 * (o % 16):2 * (o % 16) + 2]  # two bytes per output and piece
        # low nibbles: rounded inputs 4j, 4j + 1; high nibbles: 4j + 2, 4j + 3
        assert torch.equal(pair & 0xF, q[[32 * g + rounded[4 * j], 32 * g + rounded[4 * j + 1]], o])
        assert torch.equal(pair >> 4, q[[32 * g + rounded[4 * j + 2], 32 * g + rounded[4 * j + 3]], o])
    with pytest.raises(ValueError, match="uint8"):
        pack_int4_by_output(packed[:48].contiguous())


@pytest.mark.parametrize(("shape", "rows"), [((32, 32), 1), ((64, 96), 2), ((576, 192), 3), ((576, 192), 7), ((1536, 576), 8)])
def test_the_product_is_the_integer_dot_products_of_int16_inputs(kernel, shape, rows):
    packed, scales, by_output = _layer(*shape, seed=rows)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(rows, shape[0], generator=g)
    if shape[0] > INT4_GROUP:
        x[0, :INT4_GROUP] = 0.0  # a group with nothing to scale
    bias = torch.randn(shape[1], generator=g)
    y = kernel(x, by_output, scales, bias, 0)
    expected = _reference(x, packed, scales) + bias.double()
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-4)  # fp32 sums over up to 48 groups
    # Against the fp32 product: each input moved by at most half its group's step (amax / 65534).
    exact = x.double() @ dequantize_int4(packed, scales).double() + bias.double()
    step = x.abs().reshape(rows, -1, INT4_GROUP).amax(dim=-1).double() / 65534  # (rows, groups)
    bound = torch.einsum("rg,go->ro", step, dequantize_int4(packed, scales).double().abs().reshape(
        shape[0] // INT4_GROUP, INT4_GROUP, -1).sum(dim=1))
    assert bool(((y.double() - exact).abs() <= bound + 1e-5).all())
    assert 0 < float((y.double() - exact).abs().max()) < 1e-3  # it rounds, by little
    # An outlier input coarsens only its own group's step: the product stays within the same bound.
    x[:, 5] = 40.0
    y = kernel(x, by_output, scales, bias, 0)
    exact = x.double() @ dequantize_int4(packed, scales).double() + bias.double()
    step = x.abs().reshape(rows, -1, INT4_GROUP).amax(dim=-1).double() / 65534
    bound = torch.einsum("rg,go->ro", step, dequantize_int4(packed, scales).double().abs().reshape(
        shape[0] // INT4_GROUP, INT4_GROUP, -1).sum(dim=1))
    assert bool(((y.double() - exact).abs() <= bound + 1e-5).all())


def test_misshapen_inputs_are_refused(kernel):
    _, scales, by_output = _layer(64, 32, seed=5)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel(torch.randn(1, 48), by_output, scales, None, 0)
    with pytest.raises(RuntimeError, match="by_output must be"):
        kernel(torch.randn(1, 64), by_output[:, :1].contiguous(), scales, None, 0)
    with pytest.raises(RuntimeError, match="scales must be"):
        kernel(torch.randn(1, 64), by_output, scales.float(), None, 0)
    with pytest.raises(RuntimeError, match="bias"):
        kernel(torch.randn(1, 64), by_output, scales, torch.zeros(31), 0)


def test_an_int4_layer_multiplies_few_rows_laid_out_by_output_and_a_prefill_in_fp32(kernel):
    thresholds = LayerThresholds(levels=(0.0, 0.5), values=(0.0, 0.5))
    layer = SparseLinear(nn.Linear(64, 96, bias=True), 0, "mlp.up_proj", thresholds, torch.ones(64),
                         SparsityOptions(weights="int4", max_kernel_rows=4))
    g = torch.Generator().manual_seed(6)
    decode, prefill = torch.randn(1, 2, 64, generator=g), torch.randn(1, 9, 64, generator=g)
    with torch.no_grad(), executing(ExecutionPlan(), ExecutionLedger()):
        y_decode, y_prefill = layer(decode), layer(prefill)
    assert torch.equal(y_decode[0], kernel(decode[0], layer.weight_by_output, layer.weight_scale, layer.linear.bias, 0))
    weights = dequantize_int4(layer.weight_t, layer.weight_scale)
    torch.testing.assert_close(y_prefill, F.linear(prefill, weights.t(), layer.linear.bias))
