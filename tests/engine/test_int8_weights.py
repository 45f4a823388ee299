"""int8 weights (prunewatch/engine/sparse/quantize.py and the kernel's int8 path): the kernel equals the
dense product of the dequantized weights, masked as the fp32 kernel masks, dense plans read int8 rows too,
and the engine counts the bytes an int8 step really reads, eagerly and in a compiled step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prunewatch.engine.execution import ExecutionPlan
from prunewatch.engine.sparse import sparse_linear
from prunewatch.engine.sparse.quantize import INT8_MAX, dequantize_int8, quantize_int8
from tests.conftest import SPEED_PROMPT, assert_compiled_steps_equal_eager, load_probe_engine

SHAPES = [(7, 5), (300, 200), (513, 130), (64, 1030), (40, 1601)]  # odd sizes hit group, vector and tile tails


def _case(rows: int, n_in: int, n_out: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n_in, generator=g)
    weight = torch.randn(n_out, n_in, generator=g) / n_in ** 0.5
    return x, weight, torch.randn(n_out, generator=g)


def test_quantization_is_within_half_a_step_and_keeps_each_outputs_peak():
    weight_t = torch.randn(96, 40) * torch.linspace(0.01, 3.0, 40)  # outputs of very different ranges
    weight_t[:, 7] = 0.0  # an output channel of zeros
    q, scale = quantize_int8(weight_t)
    assert q.dtype == torch.int8 and q.shape == weight_t.shape and scale.shape == (40,)
    assert int(q.abs().max()) == INT8_MAX and scale[7] == 1.0 and not q[:, 7].any()
    error = (dequantize_int8(q, scale) - weight_t).abs()
    assert bool((error <= scale / 2 + 1e-7).all())
    peaks = weight_t.abs().argmax(dim=0)
    exact = dequantize_int8(q, scale)[peaks, torch.arange(40)]
    torch.testing.assert_close(exact, weight_t[peaks, torch.arange(40)])


@pytest.mark.parametrize("bad", [torch.randn(4), torch.randint(-3, 3, (4, 4))])
def test_quantization_refuses_what_it_cannot_quantize(bad):
    with pytest.raises(ValueError):
        quantize_int8(bad)


@pytest.mark.parametrize("threads", [0, 1])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("quantile", [None, 0.5])  # None: every channel read (a dense plan's call)
def test_int8_kernel_equals_the_dense_product_of_the_dequantized_weights(shape, rows, threads, quantile):
    n_in, n_out = shape
    x, weight, bias = _case(rows, n_in, n_out, seed=n_in * 7 + rows)
    q, scale = quantize_int8(weight.t().contiguous())
    ones = torch.ones(n_in)
    threshold = -1.0 if quantile is None else float(x.abs().flatten().quantile(quantile))
    mask = x.abs() > threshold
    expected = F.linear(x * mask, dequantize_int8(q, scale).t(), bias)
    result = sparse_linear(x, q, bias, ones, threshold, threads=threads, weight_scale=scale)
    torch.testing.assert_close(result.output, expected, rtol=1e-4, atol=1e-4)
    assert result.active_channels == int(mask.any(dim=0).sum())
    assert result.kept_entries == int(mask.sum())


def test_int8_kernel_never_reads_the_rows_of_inactive_channels():
    x, weight, bias = _case(1, 777, 300, seed=3)
    q, scale = quantize_int8(weight.t().contiguous())
    threshold = float(x.abs().flatten().quantile(0.6))
    inactive = (x.abs() <= threshold)[0]
    expected = sparse_linear(x, q, bias, torch.ones(777), threshold, weight_scale=scale).output
    poisoned = q.clone()
    poisoned[inactive] = 127  # would change every output if any of these rows were read
    result = sparse_linear(x, poisoned, bias, torch.ones(777), threshold, weight_scale=scale)
    torch.testing.assert_close(result.output, expected, rtol=0, atol=0)


def test_int8_kernel_refuses_missing_or_misshapen_scales():
    x, weight, _ = _case(1, 64, 32, seed=5)
    q, scale = quantize_int8(weight.t().contiguous())
    ones = torch.ones(64)
    with pytest.raises(RuntimeError, match="weight_scale"):
        sparse_linear(x, q, None, ones, 0.0)
    with pytest.raises(RuntimeError, match="weight_scale"):
        sparse_linear(x, q, None, ones, 0.0, weight_scale=scale[:-1].contiguous())
    with pytest.raises(RuntimeError, match="weight_scale"):
        sparse_linear(x, weight.t().contiguous(), None, ones, 0.0, weight_scale=scale)


PROMPT = SPEED_PROMPT


@pytest.fixture(scope="module")
def engines(probe_model_dir, calibration_dir):
    return (load_probe_engine(probe_model_dir, calibration_dir),
            load_probe_engine(probe_model_dir, calibration_dir, weights="int8", activation_sparsity=0.0, output_head_sparsity=0.0))


def test_int8_engine_holds_int8_weights_even_without_pruning_mechanisms(engines):
    _, int8 = engines
    layers = list(int8._sparsity.layers.values())
    assert layers and all(layer.weight_t.dtype == torch.int8 and layer.weight_scale is not None for layer in layers)
    head = int8.loaded.model.get_output_embeddings()
    assert head.weight_t.dtype == torch.int8
    # Every path multiplies by the same int8 values: the fp32 weight the layer keeps for prefills is dequantized.
    layer = layers[0]
    torch.testing.assert_close(layer.linear.weight.t(), dequantize_int8(layer.weight_t, layer.weight_scale))


def test_int8_dense_step_reads_the_int8_rows_and_scales_in_place_of_fp32(engines):
    fp32, int8 = engines
    ids = fp32.render_prompt(PROMPT)
    dense32 = fp32.measure_decode(ids, ExecutionPlan(), 6)
    dense8 = int8.measure_decode(ids, ExecutionPlan(), 6)
    steps = 5  # the first token comes from the prefill
    layers = list(int8._sparsity.layers.values())
    head = int8.loaded.model.get_output_embeddings()
    fp32_head = head.linear.weight.numel() * 4
    saved_per_step = sum(m.counted_bytes - m.dense_read_bytes for m in layers) + fp32_head - head.dense_read_bytes
    # Same positions, same KV reads: the difference is exactly the weights' bytes, every decode step.
    assert dense32.ledger.decode_bytes_read - dense8.ledger.decode_bytes_read == steps * saved_per_step
    weights32 = sum(m.counted_bytes for m in layers) + fp32_head
    assert saved_per_step / weights32 > 0.74  # int8 rows: a quarter of the fp32 bytes, plus one scale per output
    assert dense8.ledger.decode_pruning_ratio == 0.0  # int8 is not pruning: every multiply still runs
    assert dense8.ledger.executed_flops == dense32.ledger.executed_flops


def test_int8_engine_generates_and_its_default_plan_prunes(probe_model_dir, calibration_dir):
    # quantized_sparse_from=0: its layers read their active rows at any sparsity (the kernel's int8 path)
    engine = load_probe_engine(probe_model_dir, calibration_dir, weights="int8", quantized_sparse_from=0.0)
    result = engine.generate(PROMPT, max_new_tokens=6, quality="on")
    assert result.text
    assert result.stats.decode_pruning_ratio > 0.0
    assert result.stats.quality is not None


@pytest.fixture(scope="module")
def compiled_int8(probe_model_dir, calibration_dir):
    return load_probe_engine(probe_model_dir, calibration_dir, weights="int8", compile_decode=True,
                             quantized_sparse_from=0.0, quantized_output_head_sparsity=0.6)  # layers and head prune


def test_compiled_int8_steps_equal_eager_and_count_the_same_bytes(compiled_int8):
    assert assert_compiled_steps_equal_eager(compiled_int8).ledger.decode_pruning_ratio > 0  # the default pruned


def test_two_engines_of_one_family_never_run_each_others_graphs(probe_model_dir, calibration_dir, compiled_int8):
    """Compiled graphs keep no guards on the model's modules, so each engine compiles a code object of its own:
    an fp32 and an int8 engine of the same model, stepping in turn, each decode as their eager selves."""
    fp32 = load_probe_engine(probe_model_dir, calibration_dir, compile_decode=True)
    int8 = compiled_int8
    ids = fp32.render_prompt(PROMPT)
    for engine in (fp32, int8, fp32, int8):
        eager = engine.measure_decode(ids, ExecutionPlan(), 5, compiled=False)
        compiled = engine.measure_decode(ids, ExecutionPlan(), 5, compiled=True)
        assert engine.compiled_decode(True) is not None, engine.compiled_decode_failure
        assert compiled.tokens == eager.tokens
        assert compiled.ledger.decode_bytes_read == eager.ledger.decode_bytes_read
