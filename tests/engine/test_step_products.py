"""prunewatch/bench/step_products.py on the probe model: the replay is one real decode step's products, the same
modules on the same inputs under the same plan, and it reproduces what the step computed."""

from __future__ import annotations

import contextlib

import pytest
import torch

from prunewatch.bench.speed import _load_real, plain_decode_rate
from prunewatch.bench.step_products import capture_step, product_modules, replay, time_replay, time_replay_by_projection
from prunewatch.engine.execution import ExecutionLedger, ExecutionPlan, executing
from prunewatch.engine.sparse.module import SparseLinear
from prunewatch.engine.sparse.output_head import ShortlistHead


@pytest.fixture(scope="module")
def subject(probe_model_dir, calibration_dir):
    """The speed bench's subject: the engine at its defaults (activation sparsity, head shortlist) and
    plain transformers on the same weights."""
    return _load_real(probe_model_dir, calibration_dir)


@pytest.fixture(scope="module")
def default_plan(subject):
    engine = subject.engine
    plan = engine.execution_plan(subject.prompt_ids, engine.settings.sensitivity, list(engine.settings.layer_blacklist))
    assert any(t > 0 for t in plan.layer_sparsity) and plan.output_head_sparsity > 0  # the defaults prune here
    return plan


def test_plain_step_is_one_call_of_every_linear_reproduced_exactly(subject):
    products = capture_step(subject.plain, lambda: plain_decode_rate(subject.plain, subject.prompt_ids, 3))
    linears = product_modules(subject.plain)
    assert all(isinstance(m, torch.nn.Linear) for m in linears)
    assert [id(m) for m, _ in products.calls] == [id(m) for m in linears]  # model order, each once
    assert all(x.numel() == x.shape[-1] for _, x in products.calls)
    for replayed, output in zip(replay(products), products.outputs, strict=True):
        assert torch.equal(replayed, output)


def test_engine_step_replays_the_wrappers_under_the_plan(subject, default_plan):
    engine = subject.engine
    products = capture_step(engine.loaded.model,
                            lambda: engine.measure_decode(subject.prompt_ids, default_plan, 3, compiled=False))
    kinds = {type(m) for m, _ in products.calls}
    assert SparseLinear in kinds and ShortlistHead in kinds  # wrappers, not the linears inside them
    assert not any(isinstance(m, torch.nn.Linear) and any(m is w.linear for w, _ in products.calls)
                   for m, _ in products.calls)
    step_plan = engine.eager_step_plan(default_plan)  # the plan the eager step ran
    with_plan = replay(products, lambda: executing(step_plan, ExecutionLedger()))
    for replayed, output in zip(with_plan, products.outputs, strict=True):
        assert torch.equal(replayed, output)
    # Without the plan in force the wrappers compute dense: the replay differs where the step skipped work,
    # so a replay that equals the step did apply its plan.
    dense = replay(products)
    assert any(not torch.equal(a, b) for a, b in zip(dense, products.outputs, strict=True))
    dense_step = capture_step(engine.loaded.model,
                              lambda: engine.measure_decode(subject.prompt_ids, ExecutionPlan(), 3, compiled=False))
    assert [id(m) for m, _ in dense_step.calls] == [id(m) for m, _ in products.calls]


def test_a_decode_without_single_row_steps_is_refused(subject):
    with pytest.raises(ValueError, match="not one call per module"):
        capture_step(subject.plain, lambda: None)


def test_each_replay_is_timed_under_its_context(subject):
    products = capture_step(subject.plain, lambda: plain_decode_rate(subject.plain, subject.prompt_ids, 3))
    entered: list[int] = []

    def context():
        entered.append(len(entered))
        return contextlib.nullcontext()

    times = time_replay(products, context, reps=3)
    assert len(times) == 3 and all(s > 0 for s in times) and entered == [0, 1, 2]


def test_the_steps_of_plain_and_engine_line_up_by_projection(subject, default_plan):
    engine = subject.engine
    plain = capture_step(subject.plain, lambda: plain_decode_rate(subject.plain, subject.prompt_ids, 3))
    pruned = capture_step(engine.loaded.model,
                          lambda: engine.measure_decode(subject.prompt_ids, default_plan, 3, compiled=False))
    assert plain.projections == pruned.projections  # a wrapper is named as the linear it replaced
    layers = subject.plain.config.num_hidden_layers
    assert plain.projections.count("q_proj") == layers and plain.projections.count("down_proj") == layers
    assert plain.projections[-1] == "lm_head"


def test_a_replay_by_projection_times_every_call_once_per_rep(subject, default_plan):
    engine = subject.engine
    products = capture_step(engine.loaded.model,
                            lambda: engine.measure_decode(subject.prompt_ids, default_plan, 3, compiled=False))
    called: list[str] = []
    handles = [module.register_forward_hook(lambda m, a, o, name=name: called.append(name))
               for (module, _), name in zip(products.calls, products.projections)]
    try:
        times = time_replay_by_projection(
            products, lambda: executing(engine.eager_step_plan(default_plan), ExecutionLedger()), reps=2)
    finally:
        for handle in handles:
            handle.remove()
    assert set(times) == set(products.projections)
    assert all(len(seconds) == 2 and all(s > 0 for s in seconds) for seconds in times.values())
    assert called == products.projections * 2  # each call once per rep, in the step's order
