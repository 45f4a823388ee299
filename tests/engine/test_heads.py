"""Attention-head gating: a gated head's work is not executed, the output equals the dense model with
that head's attention output removed, the KV cache stays consistent, the ratio counts exactly what
was skipped, and the planner gates heads only where it may."""

from __future__ import annotations

import logging

import pytest
import torch

from prunewatch.engine import EngineSettings, PruningEngine
from prunewatch.engine.execution import ExecutionLedger, ExecutionPlan, executing
from prunewatch.engine.heads import HeadGatedProjection, HeadGating
from prunewatch.engine.sparse.targets import in_out
from prunewatch.probes import load_probes
from tests.conftest import PROBE_MECHANISMS, calibration_inputs
from tests.engine.test_bypass import _gated_flops_per_row
from tests.engine.test_families import FAMILIES, family_dirs  # noqa: F401  (a fixture, used by name)

PROBES = load_probes().probes
GATED = (frozenset(), frozenset({0, 1}), frozenset({3}), frozenset({0, 1, 2, 3}))  # 4 blocks of 4 heads


def _out_projection(engine: PruningEngine, layer: int) -> HeadGatedProjection:
    return next(p for p in engine.head_gating.projections[layer] if p.role == "input")


def _expected_skipped_flops(gating: HeadGating, heads: int, tokens: int) -> int:
    """Work of the gated heads from the projection weights' shapes (q/k/v rows, o columns). The key/value
    head count is read off the weights too: the attention-input projections are (heads + 2 kv_heads) x
    head_dim wide (Falcon-7B's config says 4 key/value heads where its fused projection holds one)."""
    skipped = 0
    for layer, gated in enumerate(GATED):
        projections = gating.projections[layer]
        o_in, hidden = in_out(next(p for p in projections if p.role == "input").dense_layer())
        head_dim = o_in // heads
        qkv_width = sum(in_out(p.dense_layer())[1] for p in projections if p.role == "output")
        kv_heads = (qkv_width // head_dim - heads) // 2
        group = heads // kv_heads
        kv_off = sum(1 for k in range(kv_heads) if set(range(k * group, (k + 1) * group)) <= gated)
        skipped += 2 * hidden * head_dim * (2 * len(gated) + 2 * kv_off)
    return skipped * tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_gated_heads_equal_the_dense_model_without_their_output_and_are_not_computed(family, family_dirs, tmp_path):  # noqa: F811  (the fixture)
    engine = PruningEngine.load(EngineSettings(model_dir=family_dirs[family], device="cpu", calibration_dir=tmp_path,
                                               head_gating=True))
    assert engine.head_gating is not None and engine.head_gating.shape.heads == 4
    ids = torch.tensor([engine.render_prompt("Show the routing table.", "You are an administrator.")])
    plan = ExecutionPlan(gated_heads=GATED)
    gated_ledger = ExecutionLedger()
    with torch.no_grad(), executing(plan, gated_ledger):
        gated = engine.loaded.model(input_ids=ids, use_cache=False).logits

    # Reference: the dense model, with the gated heads' attention output zeroed before o_proj.
    head_dim = engine.head_gating.shape.head_dim
    handles = []
    for layer, heads in enumerate(GATED):
        mask = torch.ones(engine.head_gating.shape.heads * head_dim)
        for head in heads:
            mask[head * head_dim:(head + 1) * head_dim] = 0
        handles.append(_out_projection(engine, layer).inner.register_forward_pre_hook(
            lambda module, args, mask=mask: (args[0] * mask,)))
    try:
        dense_ledger = ExecutionLedger()
        with torch.no_grad(), executing(ExecutionPlan(), dense_ledger):
            reference = engine.loaded.model(input_ids=ids, use_cache=False).logits
    finally:
        for handle in handles:
            handle.remove()
    torch.testing.assert_close(gated, reference, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(gated[0, -1], engine.loaded.model(input_ids=ids).logits[0, -1], atol=1e-4)

    assert gated_ledger.dense_flops == dense_ledger.dense_flops == dense_ledger.executed_flops
    skipped = _expected_skipped_flops(engine.head_gating, 4, ids.shape[1])
    assert dense_ledger.executed_flops - gated_ledger.executed_flops == skipped
    assert plan.heads_gated == 7


def _falcon(**layout):
    from transformers import FalconConfig, FalconForCausalLM

    torch.manual_seed(3)
    config = FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                          max_position_embeddings=64, **layout)
    return FalconForCausalLM(config).eval()


@pytest.mark.parametrize("layout", [
    dict(new_decoder_architecture=True, num_kv_heads=2),  # Falcon-40B: [q q k v] per key/value head
    dict(multi_query=False),  # no multi-query: [q k v] per head, as GPT-NeoX
])
def test_falcon_fused_layouts_gate_exactly_the_gated_heads(layout):
    from prunewatch.engine.execution import instrument
    from prunewatch.engine.heads import install_head_gating

    instrumented = instrument(_falcon(**layout))
    gating = install_head_gating(instrumented)
    assert gating is not None and gating.shape.kv_heads == layout.get("num_kv_heads", 4)
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(5))
    plan = ExecutionPlan(gated_heads=GATED)
    gated_ledger, dense_ledger = ExecutionLedger(), ExecutionLedger()
    with torch.no_grad(), executing(plan, gated_ledger):
        gated = instrumented.model(input_ids=ids, use_cache=False).logits
    head_dim = gating.shape.head_dim
    handles = []
    for layer, heads in enumerate(GATED):
        mask = torch.ones(gating.shape.heads * head_dim)
        for head in heads:
            mask[head * head_dim:(head + 1) * head_dim] = 0
        out_projection = next(p for p in gating.projections[layer] if p.role == "input")
        handles.append(out_projection.inner.register_forward_pre_hook(lambda m, args, mask=mask: (args[0] * mask,)))
    try:
        with torch.no_grad(), executing(ExecutionPlan(), dense_ledger):
            reference = instrumented.model(input_ids=ids, use_cache=False).logits
    finally:
        for handle in handles:
            handle.remove()
    torch.testing.assert_close(gated, reference, rtol=1e-5, atol=1e-5)
    assert dense_ledger.executed_flops - gated_ledger.executed_flops == _expected_skipped_flops(gating, 4, 9)


def test_projection_widths_that_do_not_match_the_config_gate_nothing():
    from prunewatch.engine.execution import instrument
    from prunewatch.engine.heads import install_head_gating
    from tests.engine.test_sparse_engine import _tiny_llama

    model = _tiny_llama()
    model.config.num_key_value_heads = 4  # k_proj / v_proj hold 2 key/value heads
    assert install_head_gating(instrument(model)) is None
    assert not any(isinstance(m, HeadGatedProjection) for m in model.modules())


def test_kv_cache_is_consistent_under_a_head_gating_plan(probe_engine):
    ids = probe_engine.render_prompt(PROBES[0].prompt, PROBES[0].system)
    gated = tuple(frozenset({1, 4}) if i in (2, 5) else frozenset({0, 1, 2}) if i == 8 else frozenset()
                  for i in range(probe_engine.num_layers))
    plan = ExecutionPlan(gated_heads=gated)
    ledger, dense_ledger = ExecutionLedger(), ExecutionLedger()
    cached = list(probe_engine._decode(ids, plan, ledger, 12, use_cache=True))
    uncached = list(probe_engine._decode(ids, plan, ExecutionLedger(), 12, use_cache=False))
    list(probe_engine._decode(ids, ExecutionPlan(), dense_ledger, len(cached), use_cache=True))
    assert cached == uncached
    assert plan.heads_gated == 7
    # Layer 8 gates the 3 query heads of key/value head 0, so its k and v rows are skipped too.
    config = probe_engine.loaded.model.config
    blocks = probe_engine.instrumented.blocks
    per_row = sum(_gated_flops_per_row(blocks[i].block, gated[i], config.num_attention_heads,
                                       config.num_key_value_heads) for i in range(probe_engine.num_layers))
    rows = len(ids) + len(cached) - 1  # the prefill, then one row per decode step after the first token
    assert dense_ledger.executed_flops - ledger.executed_flops == per_row * rows


def test_calibration_measures_every_head_of_every_block(probe_engine):
    shape = probe_engine.head_gating.shape
    for profile in probe_engine.calibration.domains.values():
        assert len(profile.head_influence) == probe_engine.num_layers
        assert all(len(row) == shape.heads and all(v > 0 for v in row) for row in profile.head_influence)


def test_planner_gates_more_heads_with_sensitivity_only_in_kept_blocks(probe_engine):
    ids = probe_engine.render_prompt(PROBES[1].prompt, PROBES[1].system)
    previous, gated_any = 0, False
    for sensitivity in (0.2, 0.5, 0.8, 1.0):
        bypass_plan, fallback = probe_engine.plan(ids, sensitivity, [3])
        assert fallback is None
        plan = bypass_plan.plan
        for decision in bypass_plan.decisions:
            gated = plan.heads_gated_in(decision.layer)
            assert tuple(sorted(gated)) == decision.heads_gated
            if decision.decision != "KEEP":  # bypassed, protected, transition or blacklisted
                assert not gated, decision
        heads_off = plan.heads_gated + len(plan.bypass) * probe_engine.head_gating.shape.heads
        assert heads_off >= previous  # more blocks bypassed can leave fewer kept blocks to gate heads in
        previous = heads_off
        gated_any = gated_any or plan.heads_gated > 0
    assert gated_any
    assert not bypass_plan.plan.heads_gated_in(3)


def test_head_gating_off_or_zero_budget_gates_nothing(probe_model_dir, calibration_dir):
    ids = None
    for settings in (dict(head_gating=False), dict(head_budget=0.0)):
        engine = PruningEngine.load(EngineSettings(model_dir=probe_model_dir, device="cpu",
                                                   calibration_dir=calibration_dir,
                                                   **{**PROBE_MECHANISMS, **settings}))
        engine.load_or_calibrate(*calibration_inputs())
        ids = ids or engine.render_prompt(PROBES[2].prompt, PROBES[2].system)
        plan, _ = engine.plan(ids, 1.0, [])
        assert plan.plan.heads_gated == 0 and plan.plan.bypass
        stats = engine.generate(PROBES[2].prompt, system=PROBES[2].system, max_new_tokens=4, sensitivity=1.0).stats
        assert stats.heads_gated == 0
        if not settings.get("head_gating", True):
            assert engine.head_gating is None
            assert not any(isinstance(m, HeadGatedProjection) for m in engine.loaded.model.modules())


def test_stats_and_summary_log_report_the_heads_gated(probe_engine, caplog):
    caplog.set_level(logging.INFO, logger="prunewatch.engine")
    probe = PROBES[3]
    result = probe_engine.generate(probe.prompt, system=probe.system, max_new_tokens=4, sensitivity=0.9,
                                   log_level="SUMMARY")
    ids = probe_engine.render_prompt(probe.prompt, probe.system)
    plan, _ = probe_engine.plan(ids, 0.9, [])
    assert result.stats.heads_gated == plan.plan.heads_gated > 0
    summary = [r.getMessage() for r in caplog.records if result.stats.request_id in r.getMessage()]
    assert len(summary) == 1 and f"heads_gated={result.stats.heads_gated} " in summary[0]


def test_head_gating_composes_with_activation_sparsity_on_the_same_projections():
    from prunewatch.engine.execution import instrument
    from prunewatch.engine.heads import install_head_gating
    from prunewatch.engine.sparse import SparseLinear, calibrate_sparsity, install_sparsity
    from tests.engine.test_sparse_engine import LAYERS, _ids, _run, _tiny_llama

    instrumented = instrument(_tiny_llama())
    gating = install_head_gating(instrumented)
    corpus = [_ids(1, 48, seed) for seed in range(4)]
    calibration = calibrate_sparsity(instrumented, corpus, model_fingerprint="tiny", corpus_digest="random-ids")
    assert not any(".inner" in key for key in calibration.thresholds)  # names do not depend on the wrappers
    installation = install_sparsity(instrumented, calibration, model_fingerprint="tiny")
    try:
        for projections in gating.projections.values():
            assert all(isinstance(p.inner, SparseLinear) for p in projections)
        gated = (frozenset({0, 1}), frozenset({2}), frozenset())[:LAYERS]
        ids = _ids(1, 10, seed=7)
        sparse_only = ExecutionPlan(activation_sparsity=0.5)
        both = ExecutionPlan(activation_sparsity=0.5, gated_heads=gated)
        logits, ledger = _run(instrumented, ids, both)
        _, alone_ledger = _run(instrumented, ids, sparse_only)

        head_dim = gating.shape.head_dim
        handles = []
        for layer, heads in enumerate(gated):
            mask = torch.ones(gating.shape.heads * head_dim)
            for head in heads:
                mask[head * head_dim:(head + 1) * head_dim] = 0
            out_projection = next(p for p in gating.projections[layer] if p.role == "input")
            handles.append(out_projection.register_forward_pre_hook(lambda m, args, mask=mask: (args[0] * mask,)))
        try:
            reference, reference_ledger = _run(instrumented, ids, sparse_only)
        finally:
            for handle in handles:
                handle.remove()
        torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)
        # o_proj's kernel skipped the gated heads' weight rows; q/k/v ran every column and count so.
        assert ledger.executed_flops == reference_ledger.executed_flops < alone_ledger.executed_flops
        assert ledger.dense_flops == alone_ledger.dense_flops
    finally:
        installation.uninstall()
    assert all(not isinstance(p.inner, SparseLinear) for ps in gating.projections.values() for p in ps)
