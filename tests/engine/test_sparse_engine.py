"""Activation sparsity on a tiny random Llama: switchable per request, equal to the masked dense model,
counted from what ran (agreeing with torch.profiler FLOPs and with the union of active channels),
and refusing bad calibrations and bad plans with typed errors."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from prunewatch.engine import CalibrationMismatchError, InvalidRequestError
from prunewatch.engine.execution import ExecutionLedger, ExecutionPlan, executing, instrument
from prunewatch.engine.sparse import (
    SparseLinear,
    SparsityCalibration,
    SparsityOptions,
    calibrate_sparsity,
    find_sparse_targets,
    install_sparsity,
)

LAYERS = 3
PROJECTIONS = 7  # q, k, v, o, gate, up, down


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tiny():
    """An instrumented tiny Llama with activation sparsity installed, and its calibration."""
    model = _tiny_llama()
    instrumented = instrument(model)
    g = torch.Generator().manual_seed(1)
    corpus = [torch.randint(0, 256, (1, 48), generator=g) for _ in range(6)]
    calibration = calibrate_sparsity(instrumented, corpus, model_fingerprint="tiny", corpus_digest="random-ids")
    installation = install_sparsity(instrumented, calibration, model_fingerprint="tiny")
    yield instrumented, calibration, installation
    installation.uninstall()


def _run(instrumented, ids: torch.Tensor, plan: ExecutionPlan, step: bool = True):
    """Logits of `ids` under `plan`, one token per forward (decode-shaped calls) or all at once."""
    ledger = ExecutionLedger()
    with torch.no_grad(), executing(plan, ledger):
        if not step:
            return instrumented.model(input_ids=ids, use_cache=False).logits, ledger
        from transformers import DynamicCache

        cache = DynamicCache(config=instrumented.model.config)
        logits = [instrumented.model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True,
                                     position_ids=torch.full((ids.shape[0], 1), t)).logits
                  for t in range(ids.shape[1])]
    return torch.cat(logits, dim=1), ledger


def _ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_every_projection_of_every_block_is_wrapped(tiny):
    instrumented, _, installation = tiny
    assert len(installation.layers) == LAYERS * PROJECTIONS
    assert all(isinstance(m, SparseLinear) for m in installation.layers.values())
    attn = instrumented.blocks[1].block.self_attn
    assert isinstance(attn.q_proj, SparseLinear) and attn.q_proj.weight.shape == (64, 64)


def test_target_zero_is_the_dense_model_and_is_counted_dense(tiny):
    instrumented, _, _ = tiny
    ids = _ids(1, 10, seed=2)
    dense, dense_ledger = _run(instrumented, ids, ExecutionPlan(), step=False)
    off, ledger = _run(instrumented, ids, ExecutionPlan(activation_sparsity=0.0), step=False)
    assert torch.equal(dense, off)
    assert ledger.pruning_ratio == 0.0 and ledger.activation_sparsity == 0.0
    assert ledger.executed_flops == ledger.dense_flops == dense_ledger.dense_flops


def _masked_reference_logits(calibration: SparsityCalibration, ids, target: float):
    """The un-sparsified layers with a forward pre-hook masking each input by its threshold."""
    model = _tiny_llama()  # same seed, same weights, no sparsity installed
    reference = instrument(model)
    handles = []
    for key, (_, module) in find_sparse_targets(reference).items():
        threshold = calibration.threshold(key, target)
        handles.append(module.register_forward_pre_hook(
            lambda m, args, t=threshold: (args[0] * (args[0].abs() > t),)))
    try:
        logits, _ = _run(reference, ids, ExecutionPlan(), step=True)
    finally:
        for handle in handles:
            handle.remove()
    return logits


@pytest.mark.parametrize("batch", [1, 4])
def test_sparse_decode_equals_the_dense_model_on_masked_inputs(tiny, batch):
    instrumented, calibration, _ = tiny
    ids = _ids(batch, 8, seed=3 + batch)
    sparse, _ = _run(instrumented, ids, ExecutionPlan(activation_sparsity=0.5))
    expected = _masked_reference_logits(calibration, ids, 0.5)
    torch.testing.assert_close(sparse, expected, rtol=1e-4, atol=1e-4)
    dense, _ = _run(instrumented, ids, ExecutionPlan())
    assert (sparse - dense).abs().max() > 1e-3  # the mask really changed the computation


def _profiled_mm_flops(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        fn()
    return sum(e.flops for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm"))


@pytest.mark.parametrize("batch", [1, 4])
def test_ratio_agrees_with_profiler_flops_and_counted_active_channels(tiny, batch):
    instrumented, calibration, installation = tiny
    ids = _ids(batch, 4, seed=11 + batch)
    plan = ExecutionPlan(activation_sparsity=0.5)
    # Independent count of the kernel's work: recompute each call's mask with torch and take the
    # union of active input channels over the call's rows.
    counted = {"flops": 0}
    handles = []
    for key, layer in installation.layers.items():
        threshold = calibration.threshold(key, 0.5)

        def pre_hook(module, args, t=threshold):
            x = args[0].reshape(-1, module.in_features)
            union = int((x.abs() > t).any(dim=0).sum())
            counted["flops"] += 2 * union * module.out_features * x.shape[0]

        handles.append(layer.register_forward_pre_hook(pre_hook))
    ledgers = {}
    try:
        sparse_mm = _profiled_mm_flops(lambda: ledgers.setdefault("sparse", _run(instrumented, ids, plan)[1]))
    finally:
        for handle in handles:
            handle.remove()
    dense_mm = _profiled_mm_flops(lambda: ledgers.setdefault("dense", _run(instrumented, ids, ExecutionPlan())[1]))
    independent = 1.0 - (sparse_mm + counted["flops"]) / dense_mm
    ledger = ledgers["sparse"]
    assert ledger.dense_flops == dense_mm  # the engine's denominator is what the profiler saw dense
    assert ledger.pruning_ratio > (0.3 if batch == 1 else 0.02)  # a batch reads the union of its rows
    assert abs(ledger.pruning_ratio - independent) <= 0.01 * independent
    # the dense hooks of the wrapped layers did not fire: the profiler saw only the output head
    head = instrumented.model.get_output_embeddings()
    assert sparse_mm == 2 * head.in_features * head.out_features * ids.numel()


def test_batch_of_four_counts_the_union_of_its_rows(tiny):
    instrumented, _, _ = tiny
    ids = _ids(4, 6, seed=21)
    _, single = _run(instrumented, ids[:1], ExecutionPlan(activation_sparsity=0.5))
    _, batch = _run(instrumented, ids, ExecutionPlan(activation_sparsity=0.5))
    # per-row sparsity is what the thresholds target; the union over 4 rows skips less work
    assert abs(batch.input_sparsity - 0.5) < 0.15
    assert batch.activation_sparsity < batch.input_sparsity - 0.2
    assert single.activation_sparsity > batch.activation_sparsity + 0.2


def test_shared_policy_skips_the_target_share_at_any_batch(tiny):
    instrumented, _, _ = tiny
    ids = _ids(4, 5, seed=22)
    _, ledger = _run(instrumented, ids, ExecutionPlan(activation_sparsity=0.5, sparsity_policy="shared"))
    assert ledger.activation_sparsity == pytest.approx(0.5, abs=0.01)  # round((1 - s) * in) kept


def test_layer_targets_switch_sparsity_per_layer(tiny):
    instrumented, _, installation = tiny
    ids = _ids(1, 6, seed=23)
    _, ledger = _run(instrumented, ids, ExecutionPlan(layer_sparsity=(0.0, 0.6, 0.0)))
    per_layer = 2 * sum(m.in_features * m.out_features for k, m in installation.layers.items() if m.layer == 1)
    assert ledger.sparse_dense_flops == per_layer * ids.numel()  # only block 1 ran sparse
    assert 0.45 < ledger.activation_sparsity < 0.75


def test_long_prefill_runs_masked_dense_and_is_counted_dense(tiny):
    instrumented, _, _ = tiny
    ids = _ids(1, 40, seed=24)  # 40 rows > max_kernel_rows: the dense GEMM wins here
    _, ledger = _run(instrumented, ids, ExecutionPlan(activation_sparsity=0.5), step=False)
    assert ledger.pruning_ratio == 0.0 and ledger.activation_sparsity == 0.0
    assert 0.35 < ledger.input_sparsity < 0.65  # the mask still applied, so quality reflects it


def test_calibration_round_trips_and_refuses_other_models(tiny, tmp_path):
    _, calibration, _ = tiny
    path = tmp_path / "sparsity.json"
    calibration.save(path)
    loaded = SparsityCalibration.load(path)
    assert loaded == calibration
    assert calibration.threshold("0:mlp.down_proj", 0.505) == pytest.approx(
        (calibration.threshold("0:mlp.down_proj", 0.50) + calibration.threshold("0:mlp.down_proj", 0.51)) / 2)
    with pytest.raises(CalibrationMismatchError, match="fingerprint"):
        loaded.check_model("another-model")
    incomplete = replace(calibration, thresholds={k: v for k, v in calibration.thresholds.items() if not k.startswith("2:")})
    fresh = instrument(_tiny_llama())
    with pytest.raises(CalibrationMismatchError, match="no thresholds for layer 2:"):
        install_sparsity(fresh, incomplete)
    assert not any(isinstance(m, SparseLinear) for m in fresh.model.modules())  # nothing half-installed
    with pytest.raises(CalibrationMismatchError, match="fingerprint"):
        install_sparsity(fresh, calibration, model_fingerprint="another-model")


def test_bad_plans_and_double_installs_raise_typed_errors(tiny):
    instrumented, calibration, _ = tiny
    with pytest.raises(InvalidRequestError, match=r"\[0, 1\)"):
        ExecutionPlan(activation_sparsity=1.0)
    assert not ExecutionPlan().skips_work and not ExecutionPlan(layer_sparsity=(0.0, 0.0)).skips_work
    assert ExecutionPlan(activation_sparsity=0.3).skips_work and ExecutionPlan(layer_sparsity=(0.0, 0.2)).skips_work
    with pytest.raises(InvalidRequestError, match="sparsity_policy"):
        ExecutionPlan(activation_sparsity=0.5, sparsity_policy="column")
    with pytest.raises(InvalidRequestError, match="already installed"):
        install_sparsity(instrumented, calibration)
    with pytest.raises(ValueError):
        SparsityOptions(max_kernel_rows=0)


def test_uninstall_restores_the_original_layers_and_outputs():
    model = _tiny_llama()
    instrumented = instrument(model)
    ids = _ids(1, 7, seed=30)
    before, _ = _run(instrumented, ids, ExecutionPlan(), step=False)
    calibration = calibrate_sparsity(instrumented, [ids], model_fingerprint="t", corpus_digest="d")
    installation = install_sparsity(instrumented, calibration)
    installation.uninstall()
    assert not any(isinstance(m, SparseLinear) for m in model.modules())
    assert model.model.layers[0].block.mlp.down_proj.weight.is_contiguous()
    after, _ = _run(instrumented, ids, ExecutionPlan(), step=False)
    assert torch.equal(before, after)


def _family(name: str):
    from transformers import AutoModelForCausalLM, GPT2Config, Phi3Config, Qwen2Config

    common = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    config = {
        "gpt2": GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                           bos_token_id=1, eos_token_id=2, pad_token_id=0),
        "phi3": Phi3Config(**common),
        "qwen2": Qwen2Config(**common),
    }[name]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize(("family", "projections"), [
    ("gpt2", ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]),  # Conv1D: weights stored (in, out)
    ("phi3", ["mlp.down_proj", "mlp.gate_up_proj", "self_attn.o_proj", "self_attn.qkv_proj"]),  # fused layers
    ("qwen2", ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.o_proj",
               "self_attn.q_proj", "self_attn.v_proj"]),  # q/k/v with bias
])
def test_other_families_with_the_wina_score_equal_their_masked_dense_model(family, projections):
    from prunewatch.engine.sparse.targets import score_scale

    instrumented = instrument(_family(family))
    ids = _ids(1, 10, seed=40)
    calibration = calibrate_sparsity(instrumented, [ids], model_fingerprint=family, corpus_digest="d", score="wina")
    installation = install_sparsity(instrumented, calibration)
    assert sorted(k.split(":", 1)[1] for k in installation.layers if k.startswith("0:")) == projections
    sparse, ledger = _run(instrumented, ids, ExecutionPlan(activation_sparsity=0.5))
    installation.uninstall()
    handles = []
    for key, (_, module) in find_sparse_targets(instrumented).items():
        threshold, scale = calibration.threshold(key, 0.5), score_scale(module, "wina")
        handles.append(module.register_forward_pre_hook(
            lambda m, args, t=threshold, s=scale: (args[0] * (args[0].abs() * s > t),)))
    try:
        expected, _ = _run(instrumented, ids, ExecutionPlan())
    finally:
        for handle in handles:
            handle.remove()
    torch.testing.assert_close(sparse, expected, rtol=1e-4, atol=1e-4)
    assert 0.3 < ledger.pruning_ratio < 0.6


def test_a_model_on_a_device_without_a_kernel_is_refused_rather_than_run_dense():
    from prunewatch.engine.sparse import SparseKernelUnavailableError

    model = _tiny_llama()
    instrumented = instrument(model)
    calibration = calibrate_sparsity(instrumented, [_ids(1, 8, seed=50)], model_fingerprint="t", corpus_digest="d")
    model.to("meta")  # a device with neither the compiled CPU kernel nor the Triton CUDA kernel
    with pytest.raises(SparseKernelUnavailableError, match="CUDA \\(Triton\\) and the CPU only; the model is on meta"):
        install_sparsity(instrumented, calibration)
