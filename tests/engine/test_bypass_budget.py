"""The layer-bypass budget counts only blocks that may be bypassed, on two differently trained models.

A block that can never be skipped (protected, blacklisted, transition) must not enlarge the budget:
otherwise a model whose edge blocks carry most of the influence lets the planner bypass nearly
every other block (9 of 12 on the second probe model, ratio 0.74, before this rule).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from prunewatch.engine import EngineSettings, PruningEngine
from prunewatch.probes import load_probes
from tests.conftest import calibration_inputs

REPO = Path(__file__).resolve().parents[2]
MODELS = {"probe-llama": REPO / "prunewatch" / "engine" / "models" / "probe-llama",
          "probe-llama-b": REPO / "prunewatch" / "engine" / "models" / "probe-llama-b"}  # another seed, fewer steps


@pytest.fixture(scope="module", params=sorted(MODELS))
def engine(request, tmp_path_factory):
    engine = PruningEngine.load(EngineSettings(model_dir=MODELS[request.param], device="cpu", log_level="NONE",
                                               calibration_dir=tmp_path_factory.mktemp("calibration"),
                                               activation_sparsity=0.0))
    engine.load_or_calibrate(*calibration_inputs())
    return engine


def _prompt(engine) -> list[int]:
    probe = load_probes().probes[0]
    return engine.render_prompt(probe.prompt, probe.system)


def _planned(engine, budget: float, blacklist: list[int]):
    defaults = engine.settings
    engine.settings = defaults.model_copy(update={"influence_budget": budget})
    try:
        plan, fallback = engine.plan(_prompt(engine), 1.0, blacklist)
    finally:
        engine.settings = defaults
    assert fallback is None
    return plan


def test_defaults_bypass_no_block(engine):
    result = engine.generate(prompt_ids=_prompt(engine), max_new_tokens=4)
    assert result.stats.layers_bypassed == [] and result.stats.heads_gated == 0


@pytest.mark.parametrize("budget", [0.25, 0.5])
def test_bypassed_influence_stays_within_the_share_of_bypassable_blocks(engine, budget):
    plan = _planned(engine, budget, [])
    eligible = [d for d in plan.decisions if d.decision in ("KEEP", "BYPASS")]
    bypassed = [d for d in plan.decisions if d.decision == "BYPASS"]
    effective = plan.signals.effective_sensitivity
    assert plan.budget == pytest.approx(effective * budget * sum(d.influence for d in eligible))
    assert sum(d.influence for d in bypassed) <= plan.budget + 1e-9
    assert len(bypassed) < len(eligible)  # some bypassable block always keeps running at budget < 1
    assert {d.layer for d in plan.decisions if d.decision == "PROTECTED"} == {0, engine.num_layers - 1}


def test_blacklisting_a_block_shrinks_the_budget_instead_of_freeing_it(engine):
    open_plan = _planned(engine, 0.5, [])
    kept = [d for d in open_plan.decisions if d.decision == "KEEP"]
    assert kept, "at budget 0.5 some bypassable block keeps running"
    heaviest = max(kept, key=lambda d: d.influence).layer
    narrowed = _planned(engine, 0.5, [heaviest])
    assert narrowed.budget < open_plan.budget
    assert set(narrowed.plan.bypass) <= set(open_plan.plan.bypass)  # a shorter prefix of the same walk
