"""Activation sparsity through the engine: off at sensitivity 0, counted from what the kernel ran."""

from __future__ import annotations

from dataclasses import replace

import pytest

from prunewatch.engine import EngineSettings, PruningEngine
from prunewatch.engine.execution import ExecutionLedger
from prunewatch.engine.sparse import SparseLinear
from prunewatch.engine.sparse.targets import projection_family
from prunewatch.probes import load_probes
from tests.conftest import calibration_inputs
from tests.engine.sparse_oracle import count_kernel_call


@pytest.fixture(scope="module")
def sparse_engine(probe_model_dir, calibration_dir) -> PruningEngine:
    """Layer bypass and activation sparsity on, head gating off: the replay below takes sparsity out of
    the very same plan, and gated heads would change what the dense-input replay computes."""
    engine = PruningEngine.load(EngineSettings(model_dir=probe_model_dir, device="cpu",
                                               calibration_dir=calibration_dir, activation_sparsity=0.5,
                                               influence_budget=0.5, head_gating=False))
    engine.load_or_calibrate(*calibration_inputs())  # installs the kernel too
    return engine


def test_sensitivity_zero_stays_dense_with_the_kernel_installed(sparse_engine, probe_engine):
    probe = load_probes().probes[1]
    sparse = sparse_engine.generate(probe.prompt, system=probe.system, max_new_tokens=12, sensitivity=0.0)
    dense = probe_engine.generate(probe.prompt, system=probe.system, max_new_tokens=12, sensitivity=0.0)
    assert sparse.token_ids == dense.token_ids
    assert sparse.stats.pruning_ratio == 0.0 and sparse.stats.activation_sparsity == 0.0


def test_sparse_requests_skip_exactly_the_work_of_inactive_input_channels(sparse_engine):
    probe = load_probes().probes[3]
    steps = 12
    result = sparse_engine.generate(probe.prompt, system=probe.system, max_new_tokens=steps, sensitivity=1.0)
    stats = result.stats
    prompt_ids = sparse_engine.render_prompt(probe.prompt, probe.system)
    plan = sparse_engine.execution_plan(prompt_ids, 1.0, [], prompt_text=probe.prompt)
    assert sorted(plan.bypass) == stats.layers_bypassed and plan.bypass  # the request's own plan, bypass included
    assert plan.heads_gated == 0 and any(t > 0 for t in plan.layer_sparsity)

    # Replay the request's plan with an independent count of what each kernel call had to read: the
    # union over its rows of the input channels whose score passes the calibrated threshold.
    oracle = {"skipped": 0, "kept": 0, "entries": 0}

    def count(module: SparseLinear, args: tuple) -> None:
        target = plan.sparsity_for(module.layer, projection_family(module.name))
        if target <= 0.0:
            return
        count_kernel_call(module, args[0], target, oracle)

    wrapped = [m for m in sparse_engine.loaded.model.modules() if isinstance(m, SparseLinear)]
    handles = [m.register_forward_pre_hook(count) for m in wrapped]
    try:
        ledger = ExecutionLedger()
        tokens = list(sparse_engine._decode(prompt_ids, plan, ledger, steps, use_cache=True))
    finally:
        for handle in handles:
            handle.remove()
    assert tokens == result.token_ids[: len(tokens)] and len(tokens) == stats.completion_tokens
    assert (ledger.executed_flops, ledger.dense_flops) == (stats.executed_flops, stats.dense_flops)

    # The same plan without activation sparsity (same bypass, same number of token rows): the executed
    # work is larger by exactly what the oracle says the kernel skipped, and by nothing else.
    dense_inputs = replace(plan, activation_sparsity=0.0, layer_sparsity=(), family_scale=())
    replay = ExecutionLedger()
    replayed = list(sparse_engine._decode(prompt_ids, dense_inputs, replay, len(tokens), use_cache=True))
    assert len(replayed) == len(tokens)  # the same rows ran, so the dense work must match
    assert replay.dense_flops == ledger.dense_flops
    assert oracle["skipped"] > 0
    assert replay.executed_flops - ledger.executed_flops == oracle["skipped"]
    assert ledger.sparse_kept_entries == oracle["kept"] and ledger.sparse_input_entries == oracle["entries"]
    assert not ledger.overcounted and not replay.overcounted
    assert stats.pruning_ratio > replay.pruning_ratio > 0.0  # bypass alone skips some, sparsity the rest


def test_blacklisted_layers_keep_dense_inputs(sparse_engine):
    probe = load_probes().probes[0]
    ids = sparse_engine.render_prompt(probe.prompt, probe.system)
    plan, _ = sparse_engine.plan(ids, 1.0, [5], prompt_text=probe.prompt)
    full = sparse_engine._with_sparsity(plan, [5])
    assert full.sparsity_for(5) == 0.0
    assert full.sparsity_for(1) == pytest.approx(0.5 * plan.signals.effective_sensitivity, abs=1e-4)
