"""int4 weights (quantize_int4 and the kernel's int4 path): GGUF Q4_1 blocks come back exactly, the kernel
equals the dense product of the dequantized weights and reads no inactive row, and an int4 engine counts the
bytes its steps read, eagerly and compiled."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prunewatch.engine.execution import ExecutionPlan
from prunewatch.engine.sparse import sparse_linear
from prunewatch.engine.sparse.quantize import INT4_GROUP, dequantize_int4, int4_fits, quantize_int4
from tests.conftest import SPEED_PROMPT, assert_compiled_steps_equal_eager, load_probe_engine

SHAPES = [(32, 32), (64, 96), (576, 192), (96, 1600)]  # out 96 and 1600: a run of 32 after the runs of 64


def _q4_1_weights(n_in: int, n_out: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight_t, q, d, m): weights a Q4_1 GGUF dequantizes to, in (in, out) layout, with their blocks; every
    block holds a 0 and a 15, as llama.cpp's quantizer makes them (its minimum and its maximum)."""
    g = torch.Generator().manual_seed(seed)
    groups = n_in // INT4_GROUP
    q = torch.randint(0, 16, (groups, INT4_GROUP, n_out), generator=g)
    q[:, 0, :], q[:, 1, :] = 0, 15
    d = (torch.rand(groups, n_out, generator=g) * 0.01 + 1e-4).half()
    m = (-torch.rand(groups, n_out, generator=g) * 0.08).half()
    weight_t = (q.float() * d.float()[:, None, :] + m.float()[:, None, :]).reshape(n_in, n_out)
    return weight_t, q.reshape(n_in, n_out), d, m


def test_q4_1_blocks_come_back_exactly():
    weight_t, q, d, m = _q4_1_weights(128, 96, seed=1)
    packed, scales = quantize_int4(weight_t)
    assert packed.dtype == torch.uint8 and packed.shape == (128, 48) and scales.shape == (4, 2, 96)
    assert scales.dtype == torch.float16
    assert torch.equal(scales[:, 0, :], d) and torch.equal(scales[:, 1, :], m)
    assert torch.equal(dequantize_int4(packed, scales), weight_t)  # bit for bit: the model's own weights
    # Layout: in each run of 32 outputs, byte k holds output k (low nibble) and output k + 16 (high nibble).
    run = packed[5, 16:32]  # row 5, outputs 32..63
    assert torch.equal((run & 0xF).long(), q[5, 32:48]) and torch.equal((run >> 4).long(), q[5, 48:64])


def test_quantization_of_other_weights_is_within_half_a_step():
    weight_t = torch.randn(64, 64) * torch.linspace(0.01, 3.0, 64)
    weight_t[:32, 7] = 0.25  # a constant block: step 0, every weight its minimum
    packed, scales = quantize_int4(weight_t)
    step = scales[:, 0, :].float().repeat_interleave(INT4_GROUP, dim=0)
    error = (dequantize_int4(packed, scales) - weight_t).abs()
    # half a step, plus the fp16 rounding of the minimum (relative 2^-11 of the block's range)
    assert bool((error <= step / 2 + weight_t.abs().amax() * 2 ** -10).all())
    assert float(error[:32, 7].max()) < 1e-3


@pytest.mark.parametrize("shape", [(48, 64), (64, 40), (0, 32)])
def test_int4_refuses_sizes_that_are_not_whole_groups(shape):
    assert not int4_fits(*shape)
    with pytest.raises(ValueError, match="multiples of 32"):
        quantize_int4(torch.randn(*shape))


@pytest.mark.parametrize("threads", [0, 1])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("quantile", [None, 0.5])  # None: every channel read (a dense plan's call)
def test_int4_kernel_equals_the_dense_product_of_the_dequantized_weights(shape, rows, threads, quantile):
    n_in, n_out = shape
    g = torch.Generator().manual_seed(n_in + rows)
    x = torch.randn(rows, n_in, generator=g)
    weight_t = torch.randn(n_in, n_out, generator=g) / n_in ** 0.5
    bias = torch.randn(n_out, generator=g)
    packed, scales = quantize_int4(weight_t)
    threshold = -1.0 if quantile is None else float(x.abs().flatten().quantile(quantile))
    mask = x.abs() > threshold
    expected = F.linear(x * mask, dequantize_int4(packed, scales).t(), bias)
    result = sparse_linear(x, packed, bias, torch.ones(n_in), threshold, threads=threads, weight_scale=scales)
    assert result.output.shape == (rows, n_out)
    torch.testing.assert_close(result.output, expected, rtol=1e-4, atol=1e-4)
    assert result.active_channels == int(mask.any(dim=0).sum())
    assert result.kept_entries == int(mask.sum())


def test_int4_kernel_never_reads_the_rows_of_inactive_channels():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 640, generator=g)
    packed, scales = quantize_int4(torch.randn(640, 320, generator=g))
    threshold = float(x.abs().flatten().quantile(0.6))
    inactive = (x.abs() <= threshold)[0]
    expected = sparse_linear(x, packed, None, torch.ones(640), threshold, weight_scale=scales).output
    poisoned = packed.clone()
    poisoned[inactive] = 0xFF  # q = 15 everywhere: would change every output if any of these rows were read
    result = sparse_linear(x, poisoned, None, torch.ones(640), threshold, weight_scale=scales)
    torch.testing.assert_close(result.output, expected, rtol=0, atol=0)


def test_int4_kernel_refuses_missing_or_misshapen_scales():
    packed, scales = quantize_int4(torch.randn(64, 32))
    x, ones = torch.randn(1, 64), torch.ones(64)
    with pytest.raises(RuntimeError, match="weight_scale"):
        sparse_linear(x, packed, None, ones, 0.0)
    with pytest.raises(RuntimeError, match="int4 weight_scale"):
        sparse_linear(x, packed, None, ones, 0.0, weight_scale=scales.float())
    with pytest.raises(RuntimeError, match="int4 weight_scale"):
        sparse_linear(x, packed, None, ones, 0.0, weight_scale=scales[:1].contiguous())
    with pytest.raises(RuntimeError, match="multiples of 32"):
        sparse_linear(torch.randn(1, 48), packed[:48].contiguous(), None, torch.ones(48), 0.0, weight_scale=scales)


def test_a_layer_whose_sizes_are_not_whole_groups_keeps_int8_weights():
    from torch import nn

    from prunewatch.engine.execution import ExecutionLedger, executing
    from prunewatch.engine.sparse.module import SparseLinear, SparsityOptions
    from prunewatch.engine.sparse.thresholds import LayerThresholds

    thresholds = LayerThresholds(levels=(0.0, 0.5), values=(0.0, 0.5))
    options = SparsityOptions(weights="int4")
    whole = SparseLinear(nn.Linear(64, 96, bias=False), 0, "mlp.up_proj", thresholds, torch.ones(64), options)
    ragged = SparseLinear(nn.Linear(48, 64, bias=False), 0, "mlp.up_proj", thresholds, torch.ones(48), options)
    assert (whole.weight_format, whole.weight_t.dtype) == ("int4", torch.uint8)
    assert (ragged.weight_format, ragged.weight_t.dtype) == ("int8", torch.int8)
    x = torch.randn(1, 48)
    with torch.no_grad(), executing(ExecutionPlan(), ExecutionLedger()):  # a dense call still reads the int8 rows
        torch.testing.assert_close(ragged(x), F.linear(x, ragged.linear.weight), rtol=1e-4, atol=1e-4)


PROMPT = SPEED_PROMPT


@pytest.fixture(scope="module")
def engines(probe_model_dir, calibration_dir):
    return (load_probe_engine(probe_model_dir, calibration_dir),
            load_probe_engine(probe_model_dir, calibration_dir, weights="int4", compile_decode=True,
                              quantized_sparse_from=0.0, quantized_output_head_sparsity=0.6))  # layers and head prune


def test_int4_engine_holds_int4_projections_and_an_int8_head(engines):
    _, int4 = engines
    layers = list(int4._sparsity.layers.values())
    assert layers and all(layer.weight_t.dtype == torch.uint8 and layer.weight_format == "int4" for layer in layers)
    assert int4.loaded.model.get_output_embeddings().weight_t.dtype == torch.int8
    layer = layers[0]  # prefills multiply by the same values as the kernel
    torch.testing.assert_close(layer.linear.weight.t(), dequantize_int4(layer.weight_t, layer.weight_scale))


def test_int4_dense_step_reads_an_eighth_of_the_bytes_plus_scales(engines):
    fp32, int4 = engines
    ids = fp32.render_prompt(PROMPT)
    dense32 = fp32.measure_decode(ids, ExecutionPlan(), 6)
    dense4 = int4.measure_decode(ids, ExecutionPlan(), 6)
    layers = list(int4._sparsity.layers.values())
    head = int4.loaded.model.get_output_embeddings()
    saved = sum(m.counted_bytes - m.dense_read_bytes for m in layers) + head.linear.weight.numel() * 4 \
        - head.dense_read_bytes
    assert dense32.ledger.decode_bytes_read - dense4.ledger.decode_bytes_read == 5 * saved
    for m in layers:  # rows of out / 2 bytes, and an fp16 scale and minimum per group of 32 inputs and output
        assert m.dense_read_bytes == m.in_features * m.out_features // 2 + (m.in_features // 32) * 2 * m.out_features * 2
    assert dense4.ledger.decode_pruning_ratio == 0.0 and dense4.ledger.executed_flops == dense32.ledger.executed_flops


def test_compiled_int4_steps_equal_eager_and_count_the_same_bytes(engines):
    _, engine = engines
    assert assert_compiled_steps_equal_eager(engine).ledger.decode_pruning_ratio > 0  # the default plan pruned


@pytest.mark.slow
def test_int4_holds_smollm2s_gguf_weights_exactly():
    """SmolLM2's GGUF ships every projection as Q4_1: int4 gives back the converted fp32 weights bit for bit."""
    from safetensors import safe_open

    from prunewatch.engine.model_store import DEFAULT_MODEL, models_root

    weights = models_root() / DEFAULT_MODEL / "model.safetensors"
    if not weights.is_file():
        pytest.skip("SmolLM2 not pulled (prunewatch models pull)")
    checked = 0
    with safe_open(str(weights), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            if name.endswith("proj.weight"):
                weight_t = f.get_tensor(name).t().contiguous()
                assert torch.equal(dequantize_int4(*quantize_int4(weight_t)), weight_t), name
                checked += 1
    assert checked == 30 * 7
