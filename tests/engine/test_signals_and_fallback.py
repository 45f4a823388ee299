"""Adaptive-threshold signals and the protective fallback, on their own and through the engine."""

from __future__ import annotations

import logging

import pytest

from prunewatch.engine.anomaly import AnomalyLimits, anomaly_reason
from prunewatch.engine.signals import SignalWeights, combine, normalised_entropy, semantic_density, transition_layers

LIMITS = AnomalyLimits()


@pytest.mark.parametrize("text, reason", [
    ("Show the routing table of a Debian server.", None),
    ("Revenue was 2.45 billion, up from 2.18 billion; gross profit 1.32 billion.", None),
    ("hello\x00world, please summarise", "control_characters"),
    ("Explain this: ?!?!?!?!?!?!?!?!", "punctuation_run"),
    ("a#b%c^d&e*f(g)h_i+j{k}l|m:n<o>p?q~r", "byte_soup"),
])
def test_anomaly_checks(text, reason):
    assert anomaly_reason(text, token_count=len(text) // 4, nearest_domain_similarity=0.9, limits=LIMITS) == reason


def test_out_of_domain_is_a_fallback_reason():
    assert anomaly_reason("An ordinary sentence about cooking pasta.", 8, 0.05, LIMITS) == "out_of_domain"
    assert anomaly_reason("An ordinary sentence about cooking pasta.", 8, 0.5, LIMITS) is None


def test_signal_arithmetic():
    assert semantic_density([1, 1, 2, 2]) == 0.5
    assert normalised_entropy([1 / 3] * 3) == pytest.approx(1.0)
    assert normalised_entropy([1.0, 0.0, 0.0]) == 0.0
    assert transition_layers([0.1, 0.1, 0.5, 0.5], threshold=1.0) == (2,)
    weights = SignalWeights()
    calm = combine(0.5, [1, 1, 2, 2], [1.0, 0.0], [0.1] * 4, pressure=0.5, weights=weights)
    assert calm.effective_sensitivity == pytest.approx(0.5)
    dense_prompt = combine(0.5, list(range(10)), [1.0, 0.0], [0.1] * 4, pressure=0.5, weights=weights)
    assert dense_prompt.density_factor == pytest.approx(0.5) and dense_prompt.effective_sensitivity == pytest.approx(0.25)
    unsure = combine(0.5, [1, 1, 2, 2], [0.5, 0.5], [0.1] * 4, pressure=0.5, weights=weights)
    assert unsure.entropy_factor == pytest.approx(0.5)
    pressured = combine(0.8, [1, 1, 2, 2], [1.0, 0.0], [0.1] * 4, pressure=1.0, weights=weights)
    assert pressured.memory_factor == pytest.approx(1.5) and pressured.effective_sensitivity == 1.0


def test_engine_falls_back_to_dense_and_says_why(probe_engine):
    result = probe_engine.generate("Explain\x07 the routing table", max_new_tokens=4, sensitivity=1.0)
    assert result.stats.fallback_reason == "control_characters"
    assert result.stats.pruning_ratio == 0.0 and result.stats.layers_bypassed == []
    soup = probe_engine.generate("#$%^&*()_+{}|:<>?~`#$%^&*()", max_new_tokens=4, sensitivity=1.0)
    assert soup.stats.fallback_reason == "punctuation_run"


def test_canonical_probes_do_not_fall_back(probe_engine):
    from prunewatch.probes import load_probes

    calibrated = set(probe_engine.calibration.domains)
    for probe in load_probes().probes:
        stats = probe_engine.generate(probe.prompt, system=probe.system, max_new_tokens=2, sensitivity=0.5).stats
        assert stats.fallback_reason is None, probe.id
        # Planned for a calibrated domain. Which one is matched from the prompt's mean token direction, among the
        # calibration set's nine domains; the 6 M-parameter probe model tells them apart poorly, so the canonical
        # domain itself is checked on the real model (tests/engine/test_real_model.py).
        assert stats.domain in calibrated, (probe.id, stats.domain)


def test_detailed_log_names_signals_and_every_layer_decision(probe_engine, caplog):
    caplog.set_level(logging.INFO, logger="prunewatch.engine")
    probe = "Estimate the implied volatility of a European call option."
    result = probe_engine.generate(probe, max_new_tokens=2, sensitivity=0.9, log_level="DETAILED")
    lines = [r.getMessage() for r in caplog.records if result.stats.request_id in r.getMessage()]
    assert any("signals {" in line and "effective_sensitivity" in line for line in lines)
    decisions = [line for line in lines if " layer=" in line]
    assert len(decisions) == probe_engine.num_layers
    assert all(any(f"decision={d}" in line for d in ("KEEP", "BYPASS", "PROTECTED", "TRANSITION", "BLACKLISTED"))
               for line in decisions)
    caplog.clear()
    probe_engine.generate(probe, max_new_tokens=2, sensitivity=0.9, log_level="NONE")
    assert not caplog.records
