"""What both integer dense products (csrc/int4_dense.cpp, csrc/int8_dense.cpp) promise batched decoding: a row's
output has the same bits in a batch of any size and under any thread count."""

from __future__ import annotations

import pytest
import torch

from prunewatch.engine.sparse.kernel import int4_dense_kernel, int8_dense_kernel
from prunewatch.engine.sparse.quantize import pack_int4_by_output, pack_int8_by_output, quantize_int4, quantize_int8


def _layer(weights: str, n_in: int, n_out: int):
    weight_t = torch.randn(n_in, n_out, generator=torch.Generator().manual_seed(3)) * 0.05
    if weights == "int4":
        packed, scales = quantize_int4(weight_t)
        return int4_dense_kernel("cpu"), pack_int4_by_output(packed), scales
    q, scale = quantize_int8(weight_t)
    return int8_dense_kernel("cpu"), pack_int8_by_output(q), scale


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_a_row_gets_the_same_bits_in_any_batch_and_under_any_thread_count(weights):
    kernel, by_output, scales = _layer(weights, 576, 1536)
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(4))
    batch = kernel(x, by_output, scales, None, 0)
    for row in (0, 5, 7):
        assert torch.equal(kernel(x[row:row + 1], by_output, scales, None, 0), batch[row:row + 1])
    assert torch.equal(kernel(x, by_output, scales, None, 1), batch)
