"""The compiled sparse kernel: equal to a dense matmul of the masked input for batch 1 and batch > 1
(union of active channels), never reading the weight rows of inactive channels, and reporting
exactly the work it did."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prunewatch.engine.sparse import SparseKernelUnavailableError, sparse_linear

SHAPES = [(7, 5), (300, 200), (513, 130), (2048, 96), (64, 1030), (40, 1601)]  # (in, out): odd sizes hit group/tile tails


def _reference(x: torch.Tensor, weight: torch.Tensor, bias, scale: torch.Tensor, threshold: float):
    """Mask with plain torch ops, then a dense matmul: what the kernel must equal."""
    mask = x.abs() * scale > threshold  # (rows, in)
    return torch.nn.functional.linear(x * mask, weight, bias), mask


def _case(rows: int, n_in: int, n_out: int, seed: int, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n_in, generator=g)
    weight = torch.randn(n_out, n_in, generator=g) / n_in ** 0.5
    b = torch.randn(n_out, generator=g) if bias else None
    return x, weight, b


@pytest.mark.parametrize("threads", [0, 1])  # all of torch's threads (per-thread partial sums), or one
@pytest.mark.parametrize("rows", [1, 3, 4, 7])  # 3: rows paired plus an odd one; 4, 7: four-row passes, then the rest
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_equals_dense_matmul_of_the_masked_input(rows, shape, threads):
    n_in, n_out = shape
    x, weight, bias = _case(rows, n_in, n_out, seed=n_in * 31 + rows)
    scale = torch.ones(n_in)
    threshold = float(x.abs().flatten().quantile(0.5))
    expected, mask = _reference(x, weight, bias, scale, threshold)
    if rows > 1:  # the rows really have different patterns, so the union matters
        assert not torch.equal(mask[0], mask[1])
    result = sparse_linear(x, weight.t().contiguous(), bias, scale, threshold, threads=threads)
    torch.testing.assert_close(result.output, expected, rtol=1e-5, atol=1e-5)
    assert result.active_channels == int(mask.any(dim=0).sum())
    assert result.kept_entries == int(mask.sum())


@pytest.mark.parametrize("threads", [0, 1])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_rows_dense_output_is_bitwise_the_same_alone_and_among_other_rows(shape, threads):
    """Reading every channel (threshold -1, as a row-invariant plan does), each row's sums do not depend on the rows
    beside it, whatever pass (four, two or one rows) computes it: a batched dense request decodes its own tokens."""
    n_in, n_out = shape
    x, weight, bias = _case(12, n_in, n_out, seed=n_in + n_out)
    wt, scale = weight.t().contiguous(), torch.ones(n_in)
    alone = torch.cat([sparse_linear(x[r:r + 1], wt, bias, scale, -1.0, threads=threads).output for r in range(12)])
    for rows in (2, 3, 4, 5, 8, 12):
        together = sparse_linear(x[:rows], wt, bias, scale, -1.0, threads=threads).output
        assert torch.equal(together, alone[:rows]), rows


@pytest.mark.parametrize("rows", [1, 4])
def test_weight_rows_of_inactive_channels_are_never_read(rows):
    n_in, n_out = 777, 300
    x, weight, bias = _case(rows, n_in, n_out, seed=7)
    scale = torch.rand(n_in, generator=torch.Generator().manual_seed(8)) + 0.5  # a WINA-like score
    threshold = float((x.abs() * scale).flatten().quantile(0.6 if rows == 1 else 0.9))
    expected, mask = _reference(x, weight, bias, scale, threshold)
    inactive = ~mask.any(dim=0)
    assert int(inactive.sum()) > n_in // 5
    poisoned = weight.t().contiguous()
    poisoned[inactive] = float("nan")  # any read of these rows would turn the output NaN
    result = sparse_linear(x, poisoned, bias, scale, threshold)
    assert torch.isfinite(result.output).all()
    torch.testing.assert_close(result.output, expected, rtol=1e-5, atol=1e-5)


def test_shared_policy_keeps_the_top_k_channels_of_the_summed_score_for_every_row():
    x, weight, bias = _case(4, 500, 120, seed=3)
    scale = torch.rand(500, generator=torch.Generator().manual_seed(4)) + 0.1
    keep = 150
    top = torch.topk((x.abs() * scale).sum(dim=0), keep).indices
    mask = torch.zeros(500, dtype=torch.bool)
    mask[top] = True
    expected = torch.nn.functional.linear(x * mask, weight, bias)
    poisoned = weight.t().contiguous()
    poisoned[~mask] = float("nan")
    result = sparse_linear(x, poisoned, bias, scale, threshold=0.0, keep=keep)
    torch.testing.assert_close(result.output, expected, rtol=1e-5, atol=1e-5)
    assert result.active_channels == keep
    assert result.kept_entries == 4 * keep


def test_no_active_channel_returns_the_bias_and_reads_nothing():
    x, _, bias = _case(2, 64, 32, seed=5)
    result = sparse_linear(x, torch.full((64, 32), float("nan")), bias, torch.ones(64), threshold=1e9)
    assert result.active_channels == 0 and result.kept_entries == 0
    torch.testing.assert_close(result.output, bias.expand(2, 32))


def test_bfloat16_weights_match_the_dense_bfloat16_result():
    x, weight, bias = _case(1, 1024, 256, seed=6)
    x, weight, bias = x.bfloat16(), weight.bfloat16(), bias.bfloat16()
    scale = torch.ones(1024)
    threshold = float(x.float().abs().quantile(0.5))
    mask = x.float().abs() * scale > threshold
    expected = torch.nn.functional.linear((x * mask).float(), weight.float(), bias.float())
    result = sparse_linear(x, weight.t().contiguous(), bias, scale, threshold)
    assert result.output.dtype == torch.bfloat16
    torch.testing.assert_close(result.output.float(), expected, rtol=2e-2, atol=2e-2)


def test_bad_shapes_and_devices_raise_clear_errors():
    x, weight, _ = _case(1, 16, 8, seed=9)
    with pytest.raises(RuntimeError, match="input channels"):
        sparse_linear(x, torch.zeros(17, 8), None, torch.ones(16), 0.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        sparse_linear(x, weight.t(), None, torch.ones(16), 0.0)  # right shape, not a contiguous copy
    with pytest.raises(SparseKernelUnavailableError, match="CPU only"):
        sparse_linear(x.to("meta"), weight.t().contiguous(), None, torch.ones(16), 0.0)


def test_build_without_a_compiler_fails_with_one_actionable_line(tmp_path):
    env = {**os.environ, "PRUNEWATCH_EXTENSIONS_DIR": str(tmp_path), "CXX": "/bin/false"}
    done = subprocess.run([sys.executable, "-m", "prunewatch.engine.sparse.build"], env=env, capture_output=True, text=True,
                          check=False, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 1
    assert done.stderr.startswith("error: cannot build the sparse kernel in ")
    assert "python -m prunewatch.engine.sparse.build" in done.stderr and done.stderr.count("\n") == 1
