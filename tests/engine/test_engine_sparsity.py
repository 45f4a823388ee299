"""Activation sparsity through the engine: off at sensitivity 0, counted from what the kernel ran."""

from __future__ import annotations

import pytest

from engine import EngineSettings, PruningEngine
from engine.execution import ExecutionLedger, ExecutionPlan
from probes import load_probes


@pytest.fixture(scope="module")
def sparse_engine(probe_model_dir, calibration_dir) -> PruningEngine:
    probe_set = load_probes()
    engine = PruningEngine.load(EngineSettings(model_dir=probe_model_dir, device="cpu",
                                               calibration_dir=calibration_dir, activation_sparsity=0.5))
    engine.load_or_calibrate(probe_set.calibration_texts(), probe_set.digest)  # installs the kernel too
    return engine


def test_sensitivity_zero_stays_dense_with_the_kernel_installed(sparse_engine, probe_engine):
    probe = load_probes().probes[1]
    sparse = sparse_engine.generate(probe.prompt, system=probe.system, max_new_tokens=12, sensitivity=0.0)
    dense = probe_engine.generate(probe.prompt, system=probe.system, max_new_tokens=12, sensitivity=0.0)
    assert sparse.token_ids == dense.token_ids
    assert sparse.stats.pruning_ratio == 0.0 and sparse.stats.activation_sparsity == 0.0


def test_sparse_requests_skip_more_than_the_same_bypass_plan_alone(sparse_engine):
    probe = load_probes().probes[3]
    result = sparse_engine.generate(probe.prompt, system=probe.system, max_new_tokens=16, sensitivity=1.0)
    stats = result.stats
    assert stats.activation_sparsity > 0.0
    # Replay the same bypass plan without activation sparsity: the dense work is the same, the
    # executed work is larger by exactly what the kernel skipped.
    prompt_ids = sparse_engine.render_prompt(probe.prompt, probe.system)
    bypass_only = ExecutionPlan(frozenset(stats.layers_bypassed))
    ledger = ExecutionLedger()
    tokens = list(sparse_engine._decode(prompt_ids, bypass_only, ledger, 16, use_cache=True))
    assert len(tokens) == stats.completion_tokens  # same tokens processed, so the dense work must match
    assert ledger.dense_flops == stats.dense_flops
    assert stats.executed_flops < ledger.executed_flops
    assert stats.pruning_ratio > ledger.pruning_ratio


def test_blacklisted_layers_keep_dense_inputs(sparse_engine):
    probe = load_probes().probes[0]
    ids = sparse_engine.render_prompt(probe.prompt, probe.system)
    plan, _ = sparse_engine.plan(ids, 1.0, [5], prompt_text=probe.prompt)
    full = sparse_engine._with_sparsity(plan, [5])
    assert full.sparsity_for(5) == 0.0
    assert full.sparsity_for(1) == pytest.approx(0.5 * plan.signals.effective_sensitivity, abs=1e-4)
