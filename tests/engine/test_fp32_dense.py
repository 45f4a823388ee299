"""The dense product of few rows of fp32 weights (csrc/fp32_dense.cpp): its arithmetic against a by-hand chain of
fused multiply-adds, the bits a row gets in any batch and under any thread count, the refusal of misshapen inputs, and
where a layer and the output head use it."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from prunewatch.engine.execution import ExecutionLedger, ExecutionPlan, executing
from prunewatch.engine.sparse.kernel import fp32_dense_kernel
from prunewatch.engine.sparse.module import ROW_INVARIANT_CHUNK_ROWS, SparseLinear, SparsityOptions
from prunewatch.engine.sparse.thresholds import LayerThresholds


@pytest.fixture(scope="module")
def kernel():
    found = fp32_dense_kernel("cpu", torch.float32)
    assert found is not None
    return found


def _case(n_in: int, n_out: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, n_in, generator=g), torch.randn(n_in, n_out, generator=g) * 0.05,
            torch.randn(n_out, generator=g))


def _to_fp32(value: Fraction) -> np.float32:
    """`value` rounded once to the nearest fp32, ties to even: the fp32 values around it, the nearest taken."""
    near = np.float32(float(value))
    candidates = {near, np.nextafter(near, np.float32(np.inf)), np.nextafter(near, np.float32(-np.inf))}
    return min(candidates, key=lambda c: (abs(Fraction(float(c)) - value), int(c.view(np.uint32)) & 1))


def _fma_chain(x: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor | None, row: int, column: int) -> float:
    """One output as the kernel defines it, in exact arithmetic: from zero, per input in ascending order the product
    plus the sum so far rounded once to fp32 (a fused multiply-add), then the bias added in fp32."""
    acc = np.float32(0.0)
    for k in range(x.shape[1]):
        acc = _to_fp32(Fraction(float(x[row, k])) * Fraction(float(wt[k, column])) + Fraction(float(acc)))
    return float(acc) if bias is None else float(_to_fp32(Fraction(float(acc)) + Fraction(float(bias[column]))))


@pytest.mark.parametrize(("n_in", "n_out", "rows"), [(7, 5, 1), (40, 37, 3), (64, 48, 8), (96, 100, 11)])
def test_each_output_is_one_chain_of_fused_multiply_adds_over_the_inputs_in_order(kernel, n_in, n_out, rows):
    # 37 and 100 outputs end in a partial vector: the scalar tail must give the vector lanes' bits.
    x, wt, bias = _case(n_in, n_out, rows, seed=n_out)
    y = kernel(x, wt, bias, 0)
    for row in {0, rows // 2, rows - 1}:
        for column in {0, 1, n_out // 2, n_out - 2, n_out - 1}:
            assert float(y[row, column]) == _fma_chain(x, wt, bias, row, column), (row, column)
    exact = x.double() @ wt.double() + bias.double()
    torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kernel(x, wt, None, 0), y - bias, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("n_in", "n_out"), [(576, 192), (1536, 576), (576, 1000)])
def test_a_row_gets_the_same_bits_in_any_batch_and_under_any_thread_count(kernel, n_in, n_out):
    x, wt, bias = _case(n_in, n_out, 64, seed=n_in + n_out)
    full = kernel(x, wt, bias, 2)
    # decode steps' few rows, and prefill chunks' many (longer channel blocks past one register tile of rows)
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 16, 33, 64):
        for first in (0, 64 - rows):
            for threads in (1, 2):
                part = kernel(x[first:first + rows], wt, bias, threads)
                assert torch.equal(part, full[first:first + rows]), (rows, first, threads)
    # The rows beside it do not matter either: the same row among other values.
    shuffled = torch.cat([torch.randn(3, n_in, generator=torch.Generator().manual_seed(1)), x[5:6]])
    assert torch.equal(kernel(shuffled, wt, bias, 2)[3], full[5])


def test_misshapen_inputs_are_refused(kernel):
    x, wt, bias = _case(64, 32, 2, seed=3)
    with pytest.raises(RuntimeError, match="input channels"):
        kernel(x[:, :48].contiguous(), wt, bias, 0)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        kernel(x, wt.t(), bias, 0)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        kernel(x, wt.double(), bias, 0)
    with pytest.raises(RuntimeError, match="float32"):
        kernel(x.double(), wt, bias, 0)
    with pytest.raises(RuntimeError, match="bias"):
        kernel(x, wt, torch.zeros(31), 0)
    assert kernel(x[:0], wt, bias, 0).shape == (0, 32)
    assert torch.equal(kernel(x[:, :0], wt[:0], bias, 0), bias.expand(2, 32))  # no inputs: the bias alone


def test_only_fp32_weights_on_the_cpu_have_it():
    assert fp32_dense_kernel("cpu", torch.bfloat16) is None
    assert fp32_dense_kernel("meta", torch.float32) is None


def _layer(n_in: int, n_out: int) -> SparseLinear:
    thresholds = LayerThresholds(levels=(0.0, 0.5), values=(0.0, 0.5))
    return SparseLinear(nn.Linear(n_in, n_out, bias=True), 0, "mlp.up_proj", thresholds, torch.ones(n_in),
                        SparsityOptions(max_kernel_rows=4))


def test_a_row_invariant_dense_call_of_few_rows_or_a_short_chunk_takes_it_and_a_long_chunk_takes_blas(kernel):
    layer = _layer(64, 96)
    g = torch.Generator().manual_seed(6)
    decode, chunk = torch.randn(1, 3, 64, generator=g), torch.randn(1, ROW_INVARIANT_CHUNK_ROWS, 64, generator=g)
    long = torch.randn(1, ROW_INVARIANT_CHUNK_ROWS + 1, 64, generator=g)
    ledger = ExecutionLedger()
    with torch.no_grad(), executing(ExecutionPlan(row_invariant=True), ledger):
        y_decode, y_chunk, y_long = layer(decode), layer(chunk), layer(long)
    assert torch.equal(y_decode[0], kernel(decode[0], layer.weight_t, layer.linear.bias, 0))
    assert torch.equal(y_chunk[0], kernel(chunk[0], layer.weight_t, layer.linear.bias, 0))
    assert torch.equal(y_long, F.linear(long, layer.linear.weight, layer.linear.bias))
    with torch.no_grad(), executing(ExecutionPlan(), ExecutionLedger()):  # not row-invariant: BLAS
        assert torch.equal(layer(decode), F.linear(decode, layer.linear.weight, layer.linear.bias))


def test_the_output_head_takes_it_for_few_rows_under_a_row_invariant_plan_and_counts_it_dense(kernel):
    from prunewatch.engine.sparse.output_head import ShortlistHead

    torch.manual_seed(11)
    head = ShortlistHead(nn.Linear(64, 200, bias=False), max_kernel_rows=4)
    x = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(12))
    ledger = ExecutionLedger()
    with torch.no_grad(), executing(ExecutionPlan(row_invariant=True), ledger):
        y = head(x)
    assert torch.equal(y[0], kernel(x[0], head.weight_t, None, 0))
    assert ledger.executed_flops == ledger.dense_flops == 3 * 2 * 64 * 200
    assert ledger.weight_bytes_read == head.dense_read_bytes
    torch.testing.assert_close(y, F.linear(x, head.linear.weight), rtol=1e-5, atol=1e-5)
