"""The compiled decode step (prunewatch/engine/compiled_decode.py): the same tokens and the same counted work as the
eager engine, new request targets without new graphs, eager decoding where a plan cannot compile, and a
compiler failure that never fails a request."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F

from prunewatch.engine.compiled_decode import NO_THRESHOLD
from prunewatch.engine.execution import ExecutionPlan
from prunewatch.engine.sparse.kernel import counted_op
from tests.conftest import SPEED_PROMPT, load_probe_engine

PROMPT = SPEED_PROMPT
TOKENS = 8


def _load(probe_model_dir, calibration_dir, **overrides):
    return load_probe_engine(probe_model_dir, calibration_dir, **{"compile_decode": True, **overrides})


@pytest.fixture(scope="module")
def engine(probe_model_dir, calibration_dir):
    """The probe model with the engine's default mechanisms (activation sparsity, output head), compiled."""
    return _load(probe_model_dir, calibration_dir)


def _default_plan(engine, sensitivity: float | None = None) -> ExecutionPlan:
    ids = engine.render_prompt(PROMPT)
    return engine.execution_plan(ids, engine.settings.sensitivity if sensitivity is None else sensitivity, [],
                                 prompt_text=PROMPT)


def _both(engine, plan: ExecutionPlan, tokens: int = TOKENS):
    ids = engine.render_prompt(PROMPT)
    return (engine.measure_decode(ids, plan, tokens, compiled=False),
            engine.measure_decode(ids, plan, tokens, compiled=True))


# What the kernels report: fused arithmetic in the graph may move an activation across its threshold, so
# these may differ by a channel or two from the eager run (on the probe model they have been equal).
# Everything else is fixed by the plan and must be equal.
KERNEL_COUNTED = ("executed_flops", "weight_bytes_read", "sparse_executed_flops", "sparse_kept_entries")


def _differences(eager, compiled) -> dict:
    a, b = dataclasses.asdict(eager), dataclasses.asdict(compiled)
    # cached_prompt_tokens says whether the prefix cache held the head (the second run finds the first's), not how
    # the steps ran; every count is the same either way (tests/engine/test_prefix_cache.py).
    return {key: (a[key], b[key]) for key in a if not key.startswith("_") and key != "cached_prompt_tokens"
            and (a[key] != b[key] if key not in KERNEL_COUNTED else abs(a[key] - b[key]) > 1e-3 * abs(a[key]))}


def test_compiled_dense_decode_equals_eager(engine):
    eager, compiled = _both(engine, ExecutionPlan())
    assert engine.compiled_decode(True) is not None, engine.compiled_decode_failure
    assert compiled.tokens == eager.tokens
    assert _differences(eager.ledger, compiled.ledger) == {}
    assert compiled.ledger.decode_pruning_ratio == 0.0


def test_compiled_default_plan_equals_eager_and_counts_the_same_skips(engine):
    plan = _default_plan(engine)
    targets = [layer.target_under(plan) for layer in engine.compiled_decode(True).layers]
    # The default plan runs sparse layers, dense (transition) layers and the sparse head in one graph.
    assert any(t > 0 for t in targets) and any(t == 0 for t in targets) and plan.output_head_sparsity > 0
    eager, compiled = _both(engine, plan)
    assert compiled.tokens == eager.tokens
    assert _differences(eager.ledger, compiled.ledger) == {}
    assert compiled.ledger.decode_pruning_ratio > 0.05
    assert compiled.ledger.sparse_kept_entries < compiled.ledger.sparse_input_entries


def test_new_request_targets_reuse_the_compiled_graphs(engine):
    from torch._dynamo.utils import counters

    ids = engine.render_prompt(PROMPT)
    engine.measure_decode(ids, _default_plan(engine, 0.5), 3, compiled=True)  # its graph exists
    graphs = counters["stats"]["unique_graphs"]
    for sensitivity in (0.3, 0.8):
        plan = _default_plan(engine, sensitivity)
        eager, compiled = _both(engine, plan, 5)
        assert compiled.tokens == eager.tokens
        assert _differences(eager.ledger, compiled.ledger) == {}
    assert counters["stats"]["unique_graphs"] == graphs  # thresholds and head size are tensors, not constants


def test_a_new_shortlist_size_gets_its_own_graph_and_counts(engine):
    """The graphs keep no guards on the model's modules; the shortlist size, a constant of the sparse head's
    graph, is guarded through COMPILED_STEP, so a plan with another size never reuses a graph built for the last."""
    base = _default_plan(engine)
    eager_default, compiled_default = _both(engine, base, 5)
    for candidates in (2, 64):
        plan = dataclasses.replace(base, output_head_candidates=candidates)
        eager, compiled = _both(engine, plan, 5)
        assert compiled.tokens == eager.tokens
        assert _differences(eager.ledger, compiled.ledger) == {}
        assert compiled.ledger.executed_flops != compiled_default.ledger.executed_flops  # the shortlist's own work


@pytest.mark.parametrize("change", [
    {"bypass": frozenset({3})},
    {"gated_heads": (frozenset({1}),) * 12},
    {"sparsity_policy": "shared"},
])
def test_plans_that_cannot_compile_decode_eagerly(engine, change):
    plan = dataclasses.replace(_default_plan(engine), **change)
    assert not engine.compiled_decode(True).supports(plan)
    eager, compiled = _both(engine, plan, 5)
    assert compiled.tokens == eager.tokens
    assert _differences(eager.ledger, compiled.ledger) == {}


def test_a_compiler_failure_turns_compilation_off_and_decodes_eagerly(probe_model_dir, calibration_dir, caplog):
    engine = _load(probe_model_dir, calibration_dir)
    step = engine.compiled_decode()
    assert step is not None

    def fail(**_inputs):
        raise torch._dynamo.exc.Unsupported("an operator the compiler cannot trace")

    step._forward = fail
    plan = _default_plan(engine)
    with caplog.at_level(logging.WARNING, logger="prunewatch.engine.compiled"):
        compiled = engine.measure_decode(engine.render_prompt(PROMPT), plan, 5)  # per settings: compiled
    eager = engine.measure_decode(engine.render_prompt(PROMPT), plan, 5, compiled=False)
    assert compiled.tokens == eager.tokens
    assert _differences(eager.ledger, compiled.ledger) == {}
    assert [r.message for r in caplog.records].count(
        "compiled decode turned off for this engine, decoding eagerly: Unsupported: an operator the compiler "
        "cannot trace") == 1
    assert engine.compiled_decode() is None
    assert engine.compiled_decode_failure == "Unsupported: an operator the compiler cannot trace"


def test_a_warm_up_whose_compilation_fails_reports_nothing_ready(probe_model_dir, calibration_dir):
    engine = _load(probe_model_dir, calibration_dir)

    def fail(**_inputs):
        raise torch._dynamo.exc.Unsupported("an operator the compiler cannot trace")

    engine.compiled_decode()._forward = fail
    assert engine.warm_up_compiled() is None  # a server must not log graphs as ready: it decodes eagerly
    assert engine.compiled_decode_failure == "Unsupported: an operator the compiler cannot trace"


def test_counted_operator_applies_and_counts_in_its_own_slot():
    torch.manual_seed(0)
    op = counted_op()
    x, weight_t, bias = torch.randn(3, 64), torch.randn(64, 40), torch.randn(40)
    scale = torch.rand(64) + 0.5
    stats = torch.zeros(4, 3, dtype=torch.long)
    # Each slot reads its own threshold and top-k: slot 2 a threshold, slot 0 none, slot 3 a top-k of 10.
    thresholds = torch.tensor([NO_THRESHOLD, 100.0, 0.6, 0.0])
    keeps = torch.tensor([-1, -1, -1, 10])
    output = op(x, weight_t, bias, scale, thresholds, keeps, 1, stats, 2)
    kept = (x.abs() * scale) > 0.6
    torch.testing.assert_close(output, (x * kept) @ weight_t + bias, rtol=1e-5, atol=1e-5)
    assert stats[2].tolist() == [int(kept.any(0).sum()), int(kept.sum()), 1]
    assert stats[[0, 1, 3]].abs().sum() == 0
    # Below zero: every channel passes; the dense product, bit for bit what the eager layer computes.
    dense = op(x, weight_t, bias, scale, thresholds, keeps, 1, stats, 0)
    assert torch.equal(dense, F.linear(x, weight_t.t(), bias))
    assert stats[0].tolist() == [64, 3 * 64, 1]
    op(x, weight_t, None, scale, thresholds, keeps, 1, stats, 3)
    assert stats[3].tolist() == [10, 30, 1]
    # Slot 1's threshold passes nothing: no weight row read, a zero product, still one call.
    torch.testing.assert_close(op(x, weight_t, bias, scale, thresholds, keeps, 1, stats, 1), bias.expand(3, 40))
    assert stats[1].tolist() == [0, 0, 1]
    with pytest.raises(RuntimeError, match="out of range"):
        op(x, weight_t, None, scale, thresholds, keeps, 1, stats, 4)
    with pytest.raises(RuntimeError, match="one entry per row of stats"):
        op(x, weight_t, None, scale, thresholds[:3], keeps, 1, stats, 0)


def test_requests_decoding_at_once_keep_their_own_plans_and_counts(engine):
    from concurrent.futures import ThreadPoolExecutor

    plans = [_default_plan(engine, 0.3), ExecutionPlan(), _default_plan(engine, 0.9)]
    expected = [_both(engine, plan, 6)[0] for plan in plans]
    ids = engine.render_prompt(PROMPT)
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda plan: engine.measure_decode(ids, plan, 6, compiled=True), plans * 2))
    for plan_index, result in enumerate(results):
        assert result.tokens == expected[plan_index % 3].tokens
        assert _differences(expected[plan_index % 3].ledger, result.ledger) == {}


def test_warm_up_compiles_the_dense_and_default_graphs(engine, probe_model_dir, calibration_dir, monkeypatch):
    from torch._dynamo.utils import counters

    step = engine.compiled_decode()
    stepped: list[ExecutionPlan] = []
    run_step = step.step
    monkeypatch.setattr(step, "step", lambda plan, ledger, **inputs: stepped.append(plan) or run_step(plan, ledger, **inputs))
    assert engine.warm_up_compiled() > 0
    # Both plans ran compiled steps (on a fresh engine, that is what compiles their graphs)...
    assert {plan.skips_work for plan in stepped} == {False, True}
    assert all(step.supports(plan) for plan in stepped)
    # ... and another prompt's requests find their graphs.
    graphs = counters["stats"]["unique_graphs"]
    ids = engine.render_prompt("Another prompt entirely, about bonds and their coupons.")
    for plan in (ExecutionPlan(), engine.execution_plan(ids, engine.settings.sensitivity, [])):
        engine.measure_decode(ids, plan, 3)
    assert counters["stats"]["unique_graphs"] == graphs
    assert _load(probe_model_dir, calibration_dir, compile_decode=False).warm_up_compiled() is None


def test_a_step_torch_ran_eagerly_is_counted_as_the_dense_step_it_was(probe_model_dir, calibration_dir, caplog):
    engine = _load(probe_model_dir, calibration_dir)
    step = engine.compiled_decode()
    step._forward = engine.loaded.model.forward  # what torch does past its recompile limit: the eager frame
    plan = _default_plan(engine)
    ids = engine.render_prompt(PROMPT)
    with caplog.at_level(logging.WARNING, logger="prunewatch.engine.compiled"):
        measured = engine.measure_decode(ids, plan, 2)  # the prefill, then one decode step
    ledger = measured.ledger
    # Outside the request's execution every wrapper ran dense and counted nothing; the step was counted
    # once, as dense work, and compilation is off from then on.
    assert ledger.decode_pruning_ratio == 0.0
    assert ledger.dense_flops - ledger.prefill_dense_flops == engine.instrumented.dense_flops_per_token
    assert engine.compiled_decode() is None
    assert any("ran eagerly instead of the compiled graph" in r.message for r in caplog.records)


@pytest.mark.parametrize("family", ["gpt2"])
def test_other_families_compile_to_the_same_tokens_and_counts(family, probe_model_dir, tmp_path):
    """GPT-2, the family least like Llama (Conv1D projections, fused qkv, learned positions). All ten of
    tests/engine/test_families.py decode the same tokens with the same ledger compiled and eagerly; one
    here keeps the suite's compile time down."""
    from transformers import AutoModelForCausalLM

    from prunewatch.engine import EngineSettings, PruningEngine
    from tests.engine.test_families import PROMPT as FAMILY_PROMPT
    from tests.engine.test_families import SYSTEM, TEXTS, _configs, _save

    torch.manual_seed(1234)
    folder = _save(AutoModelForCausalLM.from_config(_configs()[family]), tmp_path / "model", probe_model_dir)
    engine = PruningEngine.load(EngineSettings(model_dir=folder, device="cpu", calibration_dir=tmp_path / "calibration",
                                               compile_decode=True, log_level="NONE", sparsity_allocation="uniform"))
    engine.load_or_calibrate(TEXTS, f"compiled-{family}")
    ids = engine.render_prompt(FAMILY_PROMPT, SYSTEM)
    plan = ExecutionPlan(activation_sparsity=0.5, output_head_sparsity=0.6)
    assert engine.compiled_decode().supports(plan)
    for each in (ExecutionPlan(), plan):
        eager = engine.measure_decode(ids, each, 6, compiled=False)
        compiled = engine.measure_decode(ids, each, 6, compiled=True)
        assert compiled.tokens == eager.tokens
        assert _differences(eager.ledger, compiled.ledger) == {}
    assert engine.compiled_decode() is not None and compiled.ledger.decode_pruning_ratio > 0.1
