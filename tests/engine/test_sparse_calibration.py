"""Threshold calibration on the real probe model: the calibrated thresholds reach the target sparsity
on text they were not calibrated on, and a teacher-forced pass (what the quality guard scores) equals
token-by-token sparse decoding through the kernel."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prunewatch.engine.execution import ExecutionLedger, ExecutionPlan, executing, instrument
from prunewatch.engine.loading import weights_fingerprint
from prunewatch.engine.sparse import calibrate_sparsity_on_texts, install_sparsity
from prunewatch.probes import load_calibration_set

LICENSES = Path("/usr/share/common-licenses")  # Debian base-files: present on every Debian host


@pytest.fixture(scope="module")
def probe(probe_model_dir):
    """A private copy of the probe model (the session engine is left untouched), instrumented."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(probe_model_dir)
    model = AutoModelForCausalLM.from_pretrained(probe_model_dir, dtype=torch.float32).eval()
    return instrument(model), tokenizer, weights_fingerprint(probe_model_dir)


def _calibration_texts() -> list[str]:
    texts = [t for group in load_calibration_set().calibration_texts().values() for t in group]
    return texts + [(LICENSES / "Apache-2.0").read_text()[:3000]]


def _held_out(tokenizer) -> list[torch.Tensor]:
    texts = [(LICENSES / "GPL-3").read_text()[2000:5000], (LICENSES / "MPL-2.0").read_text()[:3000]]
    return [tokenizer(t, return_tensors="pt", add_special_tokens=False).input_ids[:, :160] for t in texts]


@pytest.fixture(scope="module")
def calibrated(probe):
    """score -> calibration, made once per module (calibrating is a dense pass over the corpus)."""
    instrumented, tokenizer, fingerprint = probe
    made = {}

    def get(score: str):
        if score not in made:
            made[score] = calibrate_sparsity_on_texts(
                instrumented, tokenizer, _calibration_texts(), model_fingerprint=fingerprint,
                corpus_digest="test", score=score, max_tokens_per_text=128)
        return made[score]

    return get


@pytest.mark.parametrize("score", ["magnitude", "wina"])
def test_thresholds_reach_the_target_sparsity_on_held_out_text(probe, calibrated, score):
    instrumented, tokenizer, fingerprint = probe
    calibration = calibrated(score)
    assert calibration.score == score and calibration.rows_per_layer >= 400
    assert len(calibration.thresholds) == 12 * 7
    installation = install_sparsity(instrumented, calibration, model_fingerprint=fingerprint)
    try:
        for target in (0.25, 0.5):
            ledger = ExecutionLedger()
            with torch.no_grad(), executing(ExecutionPlan(activation_sparsity=target), ledger):
                for ids in _held_out(tokenizer):
                    instrumented.model(input_ids=ids, use_cache=False)
            assert ledger.sparse_input_entries == sum(
                ids.numel() * layer.in_features for ids in _held_out(tokenizer) for layer in installation.layers.values())
            assert abs(ledger.input_sparsity - target) <= 0.04, (score, target, ledger.input_sparsity)
    finally:
        installation.uninstall()


def test_teacher_forced_scoring_equals_sparse_decoding_through_the_kernel(probe, calibrated):
    from transformers import DynamicCache

    instrumented, tokenizer, fingerprint = probe
    model = instrumented.model
    calibration = calibrated("magnitude")
    installation = install_sparsity(instrumented, calibration, model_fingerprint=fingerprint)
    ids = _held_out(tokenizer)[0][:, :24]  # 24 rows: above max_kernel_rows, so masked then dense
    plan = ExecutionPlan(activation_sparsity=0.5)
    try:
        forced_ledger, decode_ledger = ExecutionLedger(), ExecutionLedger()
        with torch.no_grad():
            with executing(plan, forced_ledger):
                forced = model(input_ids=ids, use_cache=False).logits[0]  # (T, V)
            cache = DynamicCache(config=model.config)
            with executing(plan, decode_ledger):
                stepped = torch.cat([model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True,
                                           position_ids=torch.tensor([[t]])).logits[0] for t in range(ids.shape[1])])
    finally:
        installation.uninstall()
    torch.testing.assert_close(stepped, forced, rtol=1e-4, atol=1e-4)
    assert forced_ledger.pruning_ratio == 0.0  # the long pass ran dense GEMMs and says so
    assert decode_ledger.pruning_ratio > 0.35  # the decode steps skipped work in the kernel
    assert decode_ledger.input_sparsity == pytest.approx(forced_ledger.input_sparsity, abs=1e-9)
