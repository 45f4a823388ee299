"""Model families matrix: tiny random-weight configs of each architecture load from a local folder, run
dense at sensitivity 0, and prune with every mechanism: a bypassed block equals the model with that
block replaced by the identity (computed on plain transformers), activation sparsity skips exactly the
work of the inactive input channels, head gating (tests/engine/test_heads.py) removes exactly the
gated heads, cached decode equals uncached decode under a plan that combines all three, and the dense
and pruned logits match golden values (regenerate with PRUNEWATCH_UPDATE_GOLDEN=1). Architectures the
engine cannot wrap are refused at load with one typed line.

Family    | bypass (block returns) | head gating layout              | activation-sparsity targets
----------|------------------------|---------------------------------|-------------------------------------
falcon    | yes (tuple of 2)       | query_key_value grouped, dense  | query_key_value, dense, dense_h_to_4h, dense_4h_to_h
gemma     | yes (tensor)           | q/k/v/o_proj                    | q/k/v/o_proj, gate/up/down_proj
gpt2      | yes (tensor)           | c_attn [q|k|v], c_proj          | c_attn, c_proj, c_fc
gpt_neox  | yes (tensor)           | query_key_value per head, dense | query_key_value, dense, dense_h_to_4h, dense_4h_to_h
llama     | yes (tensor)           | q/k/v/o_proj                    | q/k/v/o_proj, gate/up/down_proj
mistral   | yes (tensor)           | q/k/v/o_proj                    | q/k/v/o_proj, gate/up/down_proj
opt       | yes (tensor)           | q/k/v_proj, out_proj            | q/k/v_proj, out_proj, fc1, fc2
phi3      | yes (tensor)           | qkv_proj [q|k|v], o_proj        | qkv_proj, o_proj, gate_up_proj, down_proj
qwen2     | yes (tensor)           | q/k/v/o_proj                    | q/k/v/o_proj, gate/up/down_proj
stablelm  | yes (tensor)           | q/k/v/o_proj                    | q/k/v/o_proj, gate/up/down_proj
mamba     | refused: no attention decoder blocks (UnsupportedArchitectureError)
mixtral   | refused: mixture of experts, per-token work varies by routing (ModelLoadError)
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from prunewatch.engine import EngineSettings, ModelLoadError, PruningEngine, UnsupportedArchitectureError
from prunewatch.engine.execution import ExecutionLedger, ExecutionPlan, executing
from prunewatch.engine.sparse import SparseLinear
from prunewatch.engine.sparse.targets import is_conv1d, projection_family
from tests.engine.sparse_oracle import count_kernel_call, hook_count, oracle_ratio

GOLDEN = Path(__file__).parent / "golden" / "families.json"
VOCAB = 4096  # the probe model's tokenizer is reused, so every family reads the same token ids
TEXTS = {"tech": ["The routing table lists the default gateway.", "Decode is memory bound."],
         "legal": ["The licensee shall indemnify the licensor against all claims."]}
PROMPT, SYSTEM = "Show the routing table.", "You are an administrator."
# Every mechanism on, explicitly (the engine's defaults leave bypass and head gating off).
# Uniform thresholds: the golden pruned logits pin the family plumbing, not the greedy plan (tests/engine/test_allocation.py).
MECHANISMS = dict(influence_budget=0.5, head_gating=True, head_budget=0.05, activation_sparsity=0.5,
                  sparsity_allocation="uniform")
BYPASS = frozenset({1, 2})
# Bypass, gated heads and activation sparsity together (4 blocks of 4 query heads).
COMBINED = ExecutionPlan(frozenset({1}), activation_sparsity=0.5,
                         gated_heads=(frozenset(), frozenset({2}), frozenset({0, 1}), frozenset({3})))
STEPS = 6  # decode steps per check


def _configs():
    from transformers import (
        FalconConfig,
        GemmaConfig,
        GPT2Config,
        GPTNeoXConfig,
        LlamaConfig,
        MistralConfig,
        OPTConfig,
        Phi3Config,
        Qwen2Config,
        StableLmConfig,
    )

    ids = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    common = dict(**ids, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return {
        "llama": LlamaConfig(**common),
        "qwen2": Qwen2Config(**common),
        "mistral": MistralConfig(**common),
        "phi3": Phi3Config(**common),
        "gemma": GemmaConfig(**common, head_dim=16),
        "stablelm": StableLmConfig(**common),
        "gpt2": GPT2Config(**ids, n_embd=64, n_layer=4, n_head=4, n_positions=256),
        "gpt_neox": GPTNeoXConfig(**ids, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, max_position_embeddings=256),
        "opt": OPTConfig(**ids, hidden_size=64, ffn_dim=128, num_hidden_layers=4, num_attention_heads=4,
                         max_position_embeddings=256, word_embed_proj_dim=64),
        # Falcon-7B style: multi-query attention (one key/value head), parallel attention and MLP,
        # decoder layers that return (hidden states, attention weights).
        "falcon": FalconConfig(**ids, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                               max_position_embeddings=256),
    }


FAMILIES = sorted(_configs())


def _save(model, folder: Path, probe_model_dir: Path) -> Path:
    model.save_pretrained(folder)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (probe_model_dir / file).exists():
            shutil.copy(probe_model_dir / file, folder / file)
    return folder


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, probe_model_dir) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM

    dirs = {}
    for name, config in _configs().items():
        torch.manual_seed(1234)
        model = AutoModelForCausalLM.from_config(config)
        dirs[name] = _save(model, tmp_path_factory.mktemp(f"family-{name}"), probe_model_dir)
    return dirs


@dataclass
class FamilyRun:
    """One family's engine with every mechanism installed, beside the plain transformers model."""

    engine: PruningEngine
    reference: torch.nn.Module  # the same weights loaded by transformers alone, never wrapped
    ids: torch.Tensor  # (1, T) the rendered prompt
    wrapped_dense_logits: torch.Tensor  # dense logits after wrapping blocks and heads, before sparsity


@pytest.fixture(scope="module")
def family_runs(family_dirs, tmp_path_factory):
    """Load, calibrate and install each family once for all the checks below (seconds per family)."""
    from transformers import AutoModelForCausalLM

    runs: dict[str, FamilyRun] = {}

    def get(family: str) -> FamilyRun:
        if family not in runs:
            folder = family_dirs[family]
            engine = PruningEngine.load(EngineSettings(model_dir=folder, device="cpu",
                                                       calibration_dir=tmp_path_factory.mktemp("calibration"),
                                                       **MECHANISMS))
            ids = torch.tensor([engine.render_prompt(PROMPT, SYSTEM)])
            with torch.no_grad(), executing(ExecutionPlan(), ExecutionLedger()):
                wrapped = engine.loaded.model(input_ids=ids).logits
            engine.load_or_calibrate(TEXTS, f"family-test-{family}")  # installs the sparse kernel too
            reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            runs[family] = FamilyRun(engine, reference, ids, wrapped)
        return runs[family]

    return get


def _weight_flops_per_row(module: torch.nn.Module) -> int:
    """2 x in x out summed over 2-D weights: from the parameters, not from the engine's hooks."""
    return sum(2 * p.numel() for name, p in module.named_parameters() if p.dim() == 2 and name.endswith("weight"))


def _reference_blocks(reference: torch.nn.Module) -> torch.nn.ModuleList:
    for path in ("model.layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers"):
        node = reference
        for part in path.split("."):
            node = getattr(node, part, None)
        if isinstance(node, torch.nn.ModuleList):
            return node
    raise AssertionError(f"no decoder blocks in {type(reference).__name__}")


def _check_golden(family: str, key: str, logits: torch.Tensor) -> None:
    observed = [round(float(v), 4) for v in logits[:8]]
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    if os.environ.get("PRUNEWATCH_UPDATE_GOLDEN") == "1":
        golden.setdefault(family, {})[key] = observed
        GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    assert key in golden.get(family, {}), f"no golden {key} for {family}; run with PRUNEWATCH_UPDATE_GOLDEN=1"
    assert observed == pytest.approx(golden[family][key], abs=1e-3)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_runs_dense_like_transformers(family, family_runs):
    run = family_runs(family)
    engine, ids = run.engine, run.ids
    with torch.no_grad():
        expected = run.reference(input_ids=ids).logits
        ledger = ExecutionLedger()
        with executing(ExecutionPlan(), ledger):
            installed = engine.loaded.model(input_ids=ids).logits
    assert torch.equal(expected, run.wrapped_dense_logits), "wrapping blocks and heads must not change the dense model"
    torch.testing.assert_close(installed, expected, rtol=1e-5, atol=1e-5)  # the idle sparse kernel neither
    assert ledger.executed_flops == ledger.dense_flops == engine.instrumented.dense_flops_per_token * ids.shape[1]

    dense = engine.generate(PROMPT, system=SYSTEM, max_new_tokens=STEPS, sensitivity=0.0)
    with torch.no_grad():
        hf = run.reference.generate(ids, max_new_tokens=STEPS, do_sample=False,
                                    pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert dense.token_ids == hf[: len(dense.token_ids)]
    assert dense.stats.pruning_ratio == 0.0 and dense.stats.executed_flops == dense.stats.dense_flops
    _check_golden(family, "dense_logits", expected[0, -1])


@pytest.mark.parametrize("family", FAMILIES)
def test_family_bypass_equals_the_model_with_that_block_replaced_by_identity(family, family_runs):
    run = family_runs(family)
    engine, ids, reference = run.engine, run.ids, run.reference
    ledger = ExecutionLedger()
    with torch.no_grad(), executing(ExecutionPlan(BYPASS), ledger):
        pruned = engine.loaded.model(input_ids=ids, use_cache=False).logits

    def identity(module, args, kwargs, output):  # the block's input, packed as the block packs its output
        hidden = args[0] if args else kwargs["hidden_states"]
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    blocks = _reference_blocks(reference)
    handles = [blocks[i].register_forward_hook(identity, with_kwargs=True) for i in BYPASS]
    try:
        with torch.no_grad():
            expected = reference(input_ids=ids, use_cache=False).logits
    finally:
        for handle in handles:
            handle.remove()
    torch.testing.assert_close(pruned, expected, rtol=1e-5, atol=1e-5)

    # The counts, against a count from the plain model's weight shapes.
    tokens = ids.shape[1]
    per_block = [_weight_flops_per_row(block) for block in blocks]
    head = 2 * reference.get_output_embeddings().weight.numel()
    assert ledger.block_calls == {0: 1, 3: 1} and ledger.block_bypasses == {1: 1, 2: 1}
    assert ledger.dense_flops == (sum(per_block) + head) * tokens
    assert ledger.executed_flops == (sum(p for i, p in enumerate(per_block) if i not in BYPASS) + head) * tokens
    assert ledger.pruning_ratio == pytest.approx(sum(per_block[i] for i in BYPASS) / (sum(per_block) + head))


def _masked_linear(module: SparseLinear, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The dense layer on the masked input, by hand (calling the layer would fire any hook counting it)."""
    weight, bias = module.linear.weight, module.linear.bias
    masked = x * mask
    out = masked @ weight if is_conv1d(module.linear) else F.linear(masked, weight)
    return out if bias is None else out + bias


@pytest.mark.parametrize("family", FAMILIES)
def test_family_sparsity_skips_exactly_the_inactive_input_channels(family, family_runs):
    run = family_runs(family)
    engine, prompt = run.engine, run.ids[0].tolist()
    target = 0.5
    plan = ExecutionPlan(activation_sparsity=target)
    wrapped = [m for m in engine.loaded.model.modules() if isinstance(m, SparseLinear)]
    assert wrapped and all(projection_family(m.name) is not None for m in wrapped)
    oracle = {"skipped": 0, "kept": 0, "entries": 0, "kernel_calls": 0}
    mismatches = []

    def before(module, args):  # an independent count of the channels each call had to read
        keep = count_kernel_call(module, args[0], target, oracle)
        module._oracle_mask = keep.reshape(args[0].shape).to(args[0].dtype)

    def after(module, args, output):  # the kernel computed the masked product, nothing else
        expected = _masked_linear(module, args[0], module._oracle_mask)
        if not torch.allclose(output, expected, rtol=1e-4, atol=1e-5):
            mismatches.append(module.name)

    handles = [h for m in wrapped for h in (m.register_forward_pre_hook(before), m.register_forward_hook(after))]
    try:
        ledger = ExecutionLedger()
        tokens = list(engine._decode(prompt, plan, ledger, STEPS, use_cache=True))
    finally:
        for handle in handles:
            handle.remove()
    dense_ledger = ExecutionLedger()
    dense_tokens = list(engine._decode(prompt, ExecutionPlan(), dense_ledger, len(tokens), use_cache=True))
    assert len(dense_tokens) == len(tokens)  # the same rows ran, so the dense work is the same
    assert not mismatches
    assert oracle["kernel_calls"] > 0 and oracle["skipped"] > 0
    assert ledger.dense_flops == dense_ledger.dense_flops == dense_ledger.executed_flops
    assert dense_ledger.executed_flops - ledger.executed_flops == oracle["skipped"]
    assert ledger.sparse_kept_entries == oracle["kept"] and ledger.sparse_input_entries == oracle["entries"]
    assert not ledger.overcounted and 0.0 < ledger.activation_sparsity < 1.0


@pytest.mark.parametrize("family", FAMILIES)
def test_family_combined_plan_decodes_the_same_with_and_without_cache(family, family_runs):
    run = family_runs(family)
    engine, ids = run.engine, run.ids
    assert engine.head_gating is not None, f"{family}: head gating should recognise this attention layout"
    assert COMBINED.heads_gated == 3
    cached_ledger, uncached_ledger = ExecutionLedger(), ExecutionLedger()
    cached = list(engine._decode(ids[0].tolist(), COMBINED, cached_ledger, STEPS, use_cache=True))
    uncached = list(engine._decode(ids[0].tolist(), COMBINED, uncached_ledger, STEPS, use_cache=False))
    assert cached == uncached
    assert cached_ledger.block_bypasses == {1: len(cached)}
    for ledger in (cached_ledger, uncached_ledger):
        assert not ledger.overcounted and 0.0 < ledger.pruning_ratio < 1.0

    prefill = ExecutionLedger()
    with torch.no_grad(), executing(COMBINED, prefill):
        pruned = engine.loaded.model(input_ids=ids, use_cache=False).logits
    assert not prefill.overcounted and prefill.executed_flops < prefill.dense_flops
    _check_golden(family, "pruned_logits", pruned[0, -1])

    # A request through the planner: whatever it chose, it ran and was counted consistently.
    result = engine.generate(PROMPT, system=SYSTEM, max_new_tokens=STEPS, sensitivity=1.0)
    assert 0.0 <= result.stats.pruning_ratio < 1.0 and result.stats.executed_flops <= result.stats.dense_flops


def test_over_counting_shows_as_a_negative_ratio_and_one_warning(caplog):
    caplog.set_level(logging.WARNING, logger="prunewatch.engine.execution")
    ledger = ExecutionLedger(executed_flops=120, dense_flops=100, sparse_executed_flops=60, sparse_dense_flops=50)
    assert ledger.overcounted
    assert ledger.pruning_ratio == pytest.approx(-0.2)  # the true value, not clamped to 0
    assert ledger.activation_sparsity == pytest.approx(-0.2)
    ledger.end_prefill()
    assert ledger.prefill_pruning_ratio == pytest.approx(-0.2)
    assert len([r for r in caplog.records if "over-counts" in r.getMessage()]) == 1
    assert not ExecutionLedger(executed_flops=80, dense_flops=100).overcounted


def _refused_configs():
    from transformers import MambaConfig, MixtralConfig

    return {
        "mamba": (MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=4, num_hidden_layers=2),
                  UnsupportedArchitectureError, "decoder blocks"),
        "mixtral": (MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=2,
                                  num_experts_per_tok=1), ModelLoadError, "mixture-of-experts"),
    }


@pytest.mark.parametrize("family", ["mamba", "mixtral"])
def test_unsupported_families_are_refused_at_load_with_one_line(family, tmp_path, probe_model_dir):
    from transformers import AutoModelForCausalLM

    config, error, reason = _refused_configs()[family]
    torch.manual_seed(0)
    folder = _save(AutoModelForCausalLM.from_config(config), tmp_path / family, probe_model_dir)
    with pytest.raises(error) as raised:
        PruningEngine.load(EngineSettings(model_dir=folder, device="cpu", calibration_dir=tmp_path, **MECHANISMS))
    message = str(raised.value)
    assert reason in message and "\n" not in message


@pytest.mark.parametrize("family", FAMILIES)
def test_family_ratio_agrees_with_an_independent_hook_count(family, family_runs):
    """The ledger counts from blocks, the plan and the kernels' reports; a Python hook on every linear
    per call (tests/engine/sparse_oracle.py) counts the same decode independently: within 1%, and in
    fact to the FLOP."""
    run = family_runs(family)
    engine, prompt = run.engine, run.ids[0].tolist()
    plans = (ExecutionPlan(), ExecutionPlan(activation_sparsity=0.5), COMBINED,
             replace(COMBINED, output_head_sparsity=0.6, output_head_candidates=16))
    for plan in plans:
        ledger = ExecutionLedger()
        with hook_count(engine.instrumented) as count:
            tokens = list(engine._decode(prompt, plan, ledger, STEPS, use_cache=True))
        assert tokens and count["dense"] == ledger.dense_flops
        assert ledger.pruning_ratio == pytest.approx(oracle_ratio(count), abs=0.01)
        assert ledger.executed_flops == count["executed"]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_decodes_the_same_tokens_alone_in_process_and_batched(family, family_runs):
    """Batched steps reach each family's attention (StableLM's decoder layers drop extra keyword arguments, so the
    step's caches travel in a context variable): three dense requests decoded together through a batcher get the
    tokens each gets in process, and the steps did hold several rows."""
    from tests.engine.test_batching import generate_together

    engine = family_runs(family).engine
    requests = [{"prompt": prompt, "system": SYSTEM, "max_new_tokens": STEPS + index, "sensitivity": 0.0}
                for index, prompt in enumerate((PROMPT, "List the open ports.", "Restart the service."))]
    alone = [engine.generate(**request).token_ids for request in requests]
    batcher = engine.new_batcher(max_batch=4, gather_s=0.2)
    try:
        together = generate_together(engine, batcher, requests)
    finally:
        batcher.close()
    assert [result.token_ids for result in together] == alone
    assert max(batcher.batch_sizes) >= 2, batcher.batch_sizes
