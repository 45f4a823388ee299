"""Model families: tiny random-weight configs of each supported architecture load from a local folder,
run dense at sensitivity 0, skip bypassed blocks for real, keep the KV cache consistent, and match
their golden logits (regenerate with PRUNEWATCH_UPDATE_GOLDEN=1)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from engine import EngineSettings, PruningEngine
from engine.execution import ExecutionLedger, ExecutionPlan, executing

GOLDEN = Path(__file__).parent / "golden" / "families.json"
VOCAB = 4096  # the probe model's tokenizer is reused, so every family reads the same token ids


def _configs():
    from transformers import GemmaConfig, GPT2Config, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return {
        "llama": LlamaConfig(**common),
        "qwen2": Qwen2Config(**common),
        "mistral": MistralConfig(**common),
        "phi3": Phi3Config(**common),
        "gemma": GemmaConfig(**common, head_dim=16),
        "gpt2": GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=256,
                           bos_token_id=1, eos_token_id=2, pad_token_id=0),
    }


FAMILIES = sorted(_configs())


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, probe_model_dir) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM

    dirs = {}
    for name, config in _configs().items():
        torch.manual_seed(1234)
        model = AutoModelForCausalLM.from_config(config)
        folder = tmp_path_factory.mktemp(f"family-{name}")
        model.save_pretrained(folder)
        for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (probe_model_dir / file).exists():
                shutil.copy(probe_model_dir / file, folder / file)
        dirs[name] = folder
    return dirs


def _engine(folder: Path, tmp_path: Path) -> PruningEngine:
    engine = PruningEngine.load(EngineSettings(model_dir=folder, device="cpu", calibration_dir=tmp_path))
    engine.calibrate({"tech": ["The routing table lists the default gateway.", "Decode is memory bound."],
                      "legal": ["The licensee shall indemnify the licensor against all claims."]}, "family-test")
    return engine


@pytest.mark.parametrize("family", FAMILIES)
def test_family_dense_bypass_cache_and_golden(family, family_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = family_dirs[family]
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = _engine(folder, tmp_path)
    ids = torch.tensor([engine.render_prompt("Show the routing table.", "You are an administrator.")])
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        with executing(ExecutionPlan(), ExecutionLedger()):
            wrapped = engine.loaded.model(input_ids=ids).logits
    assert torch.equal(expected, wrapped), "instrumenting must not change the dense computation"

    dense = engine.generate("Show the routing table.", system="You are an administrator.", max_new_tokens=6,
                            sensitivity=0.0)
    with torch.no_grad():
        hf = reference.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert dense.token_ids == hf[: len(dense.token_ids)]
    assert dense.stats.pruning_ratio == 0.0

    ledger = ExecutionLedger()
    with torch.no_grad(), executing(ExecutionPlan(frozenset({1, 2})), ledger):
        engine.loaded.model(input_ids=ids)
    per_block = engine.instrumented.blocks[1].dense_flops_per_row
    assert ledger.block_calls == {0: 1, 3: 1} and ledger.block_bypasses == {1: 1, 2: 1}
    assert ledger.dense_flops - ledger.executed_flops == 2 * per_block * ids.shape[1]

    plan = ExecutionPlan(frozenset({1}))
    cached = list(engine._decode(ids[0].tolist(), plan, ExecutionLedger(), 6, use_cache=True))
    uncached = list(engine._decode(ids[0].tolist(), plan, ExecutionLedger(), 6, use_cache=False))
    assert cached == uncached

    observed = [round(float(v), 4) for v in expected[0, -1, :8]]
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    if os.environ.get("PRUNEWATCH_UPDATE_GOLDEN") == "1":
        golden[family] = observed
        GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    assert family in golden, f"no golden logits for {family}; run with PRUNEWATCH_UPDATE_GOLDEN=1"
    assert observed == pytest.approx(golden[family], abs=1e-3)
