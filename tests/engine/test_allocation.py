"""The greedy sparsity allocation: the pure allocator on made-up curves, and the calibrated plan on the
probe model (protected blocks get nothing, the achieved mean matches the global target, the same seed
gives the same plan, the stored calibration round-trips, the engine's thresholds follow the plan)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from prunewatch.engine.errors import CalibrationMismatchError
from prunewatch.engine.execution import instrument
from prunewatch.engine.loading import weights_fingerprint
from prunewatch.engine.sparse.allocation import greedy_allocation
from prunewatch.engine.sparse.calibration import SparsityCalibration, calibrate_sparsity_on_texts, text_digest
from prunewatch.engine.sparse.calibration_cache import sparsity_calibration_path
from prunewatch.engine.sparse.targets import find_sparse_targets, in_out
from prunewatch.engine.sparse.thresholds import LEVELS
from prunewatch.probes import load_calibration_set
from tests.conftest import calibration_inputs

GRID = [i / 10 for i in range(10)]  # 0.0 .. 0.9


def _mean(plan: dict[str, list[float]], weights: dict[str, float], keys, index: int) -> float:
    return sum(plan[k][index] * weights[k] for k in keys) / sum(weights[k] for k in keys)


def test_allocator_sparsifies_the_cheap_layer_first_and_meets_each_target():
    costs = {"0:cheap": [0.1 * x * x for x in GRID], "1:dear": [10.0 * x * x for x in GRID],
             "2:kept": [0.0 for _ in GRID]}
    weights = {"0:cheap": 1.0, "1:dear": 1.0, "2:kept": 1.0}
    targets = [0.0, 0.2, 0.45, 0.6, 0.9]
    plan = greedy_allocation(costs, weights, ["0:cheap", "1:dear"], GRID, targets, max_sparsity=0.9)
    assert plan["2:kept"] == [0.0] * len(targets)  # not eligible: never sparsified, even at zero cost
    for i, target in enumerate(targets):
        assert _mean(plan, weights, ["0:cheap", "1:dear"], i) == pytest.approx(target, abs=1e-3)
        assert plan["0:cheap"][i] >= plan["1:dear"][i]
    assert plan["0:cheap"][1] > 0.3 and plan["1:dear"][1] < 0.1  # the cheap layer carries a low target
    assert plan["0:cheap"][-1] == plan["1:dear"][-1] == 0.9  # at the cap both are full


def test_allocator_weighs_cost_per_flop_and_is_monotone():
    costs = {"0:big": [x for x in GRID], "0:small": [0.5 * x for x in GRID]}
    weights = {"0:big": 8.0, "0:small": 1.0}  # per FLOP skipped, the big layer is 4x cheaper
    targets = [t / 100 for t in range(0, 91, 5)]
    plan = greedy_allocation(costs, weights, list(costs), GRID, targets)
    assert plan["0:big"][targets.index(0.5)] > plan["0:small"][targets.index(0.5)]
    for key in plan:
        assert all(a <= b + 1e-9 for a, b in zip(plan[key], plan[key][1:])), key
    with pytest.raises(ValueError, match="global targets"):
        greedy_allocation(costs, weights, list(costs), GRID, [0.95], max_sparsity=0.9)


@pytest.fixture(scope="module")
def probe(probe_model_dir):
    """A private copy of the probe model (the session engine is left untouched), instrumented."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(probe_model_dir)
    model = AutoModelForCausalLM.from_pretrained(probe_model_dir, dtype=torch.float32).eval()
    return instrument(model), tokenizer, weights_fingerprint(probe_model_dir)


# Two calibration texts per domain: enough tokens for a plan (its properties do not depend on the corpus
# size), at a third of the whole set's calibration time.
TEXTS = [t for group in load_calibration_set().calibration_texts().values() for t in group[:2]]


@pytest.fixture(scope="module")
def greedy(probe):
    instrumented, tokenizer, fingerprint = probe
    return calibrate_sparsity_on_texts(instrumented, tokenizer, TEXTS, model_fingerprint=fingerprint,
                                       corpus_digest="test", allocation="greedy", protected_layers=[0, 2],
                                       max_tokens_per_text=96)


def test_greedy_plan_protects_blocks_and_meets_the_target(probe, greedy):
    instrumented = probe[0]
    plan = greedy.allocation
    assert plan is not None and greedy.allocation_method == "greedy" and plan.protected_layers == [0, 2]
    assert plan.text_sha256 == text_digest(TEXTS) and plan.tokens > 100
    targets = find_sparse_targets(instrumented)
    assert set(plan.sparsity) == set(targets)
    weights = {key: float(math.prod(in_out(module))) for key, (_, module) in targets.items()}
    eligible = [key for key, (layer, _) in targets.items() if layer not in (0, 2)]
    for target in (0.1, 0.25, 0.5, 0.8):
        chosen = plan.plan_at(target)
        assert all(chosen[key] == 0.0 for key, (layer, _) in targets.items() if layer in (0, 2))
        achieved = sum(chosen[k] * weights[k] for k in eligible) / sum(weights[k] for k in eligible)
        assert achieved == pytest.approx(target, abs=0.01)
        assert max(chosen.values()) <= plan.max_sparsity + 1e-9
    assert len({round(v, 2) for v in plan.plan_at(0.3).values()}) > 2  # not uniform: the plan chose


def test_greedy_plan_is_deterministic_for_a_seed(probe, greedy):
    instrumented, tokenizer, fingerprint = probe
    again = calibrate_sparsity_on_texts(instrumented, tokenizer, TEXTS, model_fingerprint=fingerprint,
                                        corpus_digest="test", allocation="greedy", protected_layers=[2, 0],
                                        max_tokens_per_text=96)
    assert again.allocation.sparsity == greedy.allocation.sparsity
    assert again.thresholds == greedy.thresholds


def test_greedy_calibration_round_trips_and_drives_the_thresholds(tmp_path, greedy):
    path = sparsity_calibration_path(tmp_path / "model-v2.json", "greedy", "magnitude")
    assert path.name == "model-v2.greedy-magnitude.sparsity.json"
    assert sparsity_calibration_path(tmp_path / "model-v2.json", "uniform", "magnitude").name == "model-v2.sparsity.json"
    greedy.save(path)
    loaded = SparsityCalibration.load(path)
    assert loaded == greedy
    raw = json.loads(path.read_text())
    assert raw["allocation"]["text_sha256"] == text_digest(TEXTS) and raw["allocation"]["levels"][-1] == 0.9
    key = max(loaded.allocation.plan_at(0.3).items(), key=lambda kv: kv[1])[0]  # the layer sparsified most
    curve = loaded.layer(key)  # maps the request's target to this layer's allocated sparsity's threshold
    uniform = SparsityCalibration(**{**raw, "allocation": None}).layer(key)
    assert curve.at(0.3) == pytest.approx(uniform.at(loaded.allocation.at(key, 0.3)))
    assert curve.at(0.3) > uniform.at(0.3)  # sparsified beyond the mean target: a higher threshold
    raw["allocation"]["sparsity"][key] = raw["allocation"]["sparsity"][key][:-1]
    path.write_text(json.dumps(raw))
    with pytest.raises(CalibrationMismatchError, match="allocation"):
        SparsityCalibration.load(path)


def test_uniform_calibration_has_no_plan_and_old_files_still_load(tmp_path, probe):
    instrumented, tokenizer, fingerprint = probe
    uniform = calibrate_sparsity_on_texts(instrumented, tokenizer, TEXTS[:2], model_fingerprint=fingerprint,
                                          corpus_digest="test", max_tokens_per_text=48)
    assert uniform.allocation is None and uniform.allocation_method == "uniform"
    raw = uniform.to_dict()
    del raw["allocation"]  # a file written before allocations existed
    path = tmp_path / "old.sparsity.json"
    path.write_text(json.dumps(raw))
    assert SparsityCalibration.load(path) == uniform
    with pytest.raises(ValueError, match="allocation"):
        calibrate_sparsity_on_texts(instrumented, tokenizer, TEXTS[:1], model_fingerprint=fingerprint,
                                    corpus_digest="test", allocation="random")
    assert LEVELS[0] == 0.0


def test_engine_calibrates_the_plan_its_settings_select(tmp_path, probe_model_dir):
    """Engine defaults: the greedy plan, protecting blacklisted and transition blocks; a cached plan
    made for other protected blocks is recalibrated, not reused."""
    from prunewatch.engine import EngineSettings, PruningEngine
    from prunewatch.engine.sparse.allocation import sparsity_protected_layers
    from prunewatch.engine.sparse.calibration_cache import load_or_calibrate_sparsity

    texts, digest = calibration_inputs()
    texts, digest = {domain: group[:2] for domain, group in texts.items()}, f"{digest[:12]}-two-per-domain"
    engine = PruningEngine.load(EngineSettings(model_dir=probe_model_dir, device="cpu", calibration_dir=tmp_path,
                                               log_level="NONE", layer_blacklist=[1]))
    assert engine.settings.sparsity_allocation == "greedy"
    engine.load_or_calibrate(texts, digest)
    path = sparsity_calibration_path(engine.calibration_path(digest), "greedy", "magnitude")
    stored = SparsityCalibration.load(path)
    protected = sparsity_protected_layers(engine.settings, engine.calibration)
    assert 1 in protected and stored.allocation.protected_layers == protected
    assert all(v == 0.0 for k, v in stored.allocation.plan_at(0.5).items() if int(k.split(":")[0]) in protected)
    engine.settings = engine.settings.model_copy(update={"layer_blacklist": [3]})
    again = load_or_calibrate_sparsity(engine, texts, digest)
    assert 3 in again.allocation.protected_layers and 1 not in again.allocation.protected_layers
