"""DRAM profiles from Nsight Compute: measured once per model and GPU, saved, refused for another model,
and reported per request only where the request's steps have the profiled shape; otherwise the
estimate, labelled as such."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from prunewatch.engine import CalibrationMismatchError, EngineSettings, PruningEngine
from prunewatch.engine.dram_profile import DramLevel, DramProfile, profile_dram
from prunewatch.engine.ncu import parse_csv
from prunewatch.probes import load_probes
from tests.conftest import PROBE_MECHANISMS, calibration_inputs
from tests.engine.test_ncu_parse import SAMPLE, _fake_ncu

PROBE = load_probes().probes[0]


def _profile(fingerprint: str, device: str = "cpu") -> DramProfile:
    return DramProfile(model_fingerprint=fingerprint, device_name=device, dtype="float32", batch=1, levels=[
        DramLevel(sparsity=0.0, dram_bytes_read=8e6, instructions=1e6, kernels=40, bytes_per_instruction=8.0),
        DramLevel(sparsity=0.5, dram_bytes_read=4.5e6, instructions=1.1e6, kernels=60, bytes_per_instruction=4.09)])


def test_profile_measures_each_level_under_ncu_and_round_trips(tmp_path, probe_model_dir):
    sample = tmp_path / "sample.csv"
    sample.write_text(SAMPLE)
    ncu = _fake_ncu(tmp_path, 'echo "$@" >> "$(dirname "$0")/calls"\n'
                              f'while [ "$1" != "--log-file" ]; do shift; done\ncp "{sample}" "$2"\n')
    seen = []
    profile = profile_dram(probe_model_dir, model_fingerprint="f" * 64, device_name="NVIDIA H200",
                           sparsities=(0.5, 0.0, 0.5), ncu=str(ncu), progress=lambda d, t: seen.append((d, t)))
    expected = parse_csv(SAMPLE)
    assert [level.sparsity for level in profile.levels] == [0.0, 0.5]
    assert all(level.bytes_per_instruction == expected.bytes_per_instruction for level in profile.levels)
    assert seen == [(1, 2), (2, 2)]
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 2 and all(f"--model-dir {probe_model_dir}" in call for call in calls)
    assert "--sparsity 0.0" in calls[0] and "--sparsity 0.5" in calls[1]
    path = tmp_path / "profile.json"
    profile.save(path)
    assert DramProfile.load(path) == profile
    assert profile.level_for(0.47) == profile.levels[1] and profile.level_for(0.2) is None
    with pytest.raises(ValueError, match=r"must be in \[0, 1\)"):
        profile_dram(probe_model_dir, model_fingerprint="f", device_name="x", sparsities=(1.2,), ncu=str(ncu))


def test_engine_reports_ncu_only_for_requests_of_the_profiled_shape(tmp_path, probe_model_dir, calibration_dir,
                                                                    probe_engine):
    fingerprint = probe_engine.loaded.fingerprint
    path = tmp_path / "profile.json"
    _profile(fingerprint).save(path)
    engine = PruningEngine.load(EngineSettings(model_dir=probe_model_dir, device="cpu",
                                               calibration_dir=calibration_dir, dram_profile=path,
                                               **PROBE_MECHANISMS))
    engine.load_or_calibrate(*calibration_inputs())
    dense = engine.generate(PROBE.prompt, system=PROBE.system, max_new_tokens=3, sensitivity=0.0).stats
    assert (dense.dram_bytes_per_instruction, dense.dram_source) == (8.0, "ncu")
    pruned = engine.generate(PROBE.prompt, system=PROBE.system, max_new_tokens=3, sensitivity=0.9).stats
    assert pruned.layers_bypassed and pruned.dram_source == "estimate"
    assert pruned.dram_bytes_per_instruction != 8.0 and pruned.dram_bytes_per_instruction > 0


def test_a_profile_of_another_model_is_refused_and_of_another_gpu_unused(tmp_path, probe_model_dir, caplog):
    path = tmp_path / "profile.json"
    _profile("0" * 64).save(path)
    with pytest.raises(CalibrationMismatchError, match="DRAM profile was measured on model 000000000000"):
        PruningEngine.load(EngineSettings(model_dir=probe_model_dir, device="cpu", dram_profile=path))
    engine = PruningEngine.load(EngineSettings(model_dir=probe_model_dir, device="cpu"))
    replace(_profile(engine.loaded.fingerprint), device_name="NVIDIA H200").save(path)
    with caplog.at_level(logging.WARNING, logger="prunewatch.engine"):
        other = PruningEngine.load(EngineSettings(model_dir=probe_model_dir, device="cpu", dram_profile=path))
    assert other.dram_profile is None and "measured on NVIDIA H200, not on cpu" in caplog.text
    stats = other.generate(PROBE.prompt, system=PROBE.system, max_new_tokens=2, sensitivity=0.0).stats
    assert stats.dram_source == "estimate"
    (tmp_path / "old.json").write_text('{"format_version": 0}')
    with pytest.raises(CalibrationMismatchError, match="has format 0"):
        DramProfile.load(tmp_path / "old.json")


def test_a_sparse_request_is_matched_on_its_decode_steps_not_its_dense_prefill(tmp_path, probe_model_dir,
                                                                                calibration_dir, probe_engine):
    """The whole request's sparsity is diluted by the dense prefill; a decode-step profile must be matched
    on the decode steps' sparsity, or a sparse request would receive the dense step's figure."""
    engine = PruningEngine.load(EngineSettings(model_dir=probe_model_dir, device="cpu", calibration_dir=calibration_dir,
                                               activation_sparsity=0.9, log_level="NONE"))
    engine.load_or_calibrate(*calibration_inputs())
    probe = engine.generate(PROBE.prompt, system=PROBE.system, max_new_tokens=8, sensitivity=1.0).stats
    assert probe.fallback_reason is None and not probe.layers_bypassed and probe.heads_gated == 0
    assert probe.activation_sparsity < 0.05 < probe.decode_pruning_ratio  # prefill dense, decode sparse
    # A profile with a dense level (which the whole-request figure lies near) and a level at the decode sparsity.
    profile = _profile(engine.loaded.fingerprint)
    decode_sparsity = engine_decode_sparsity(engine)
    profile = replace(profile, levels=[profile.levels[0], replace(profile.levels[1], sparsity=round(decode_sparsity, 2))])
    path = tmp_path / "profile.json"
    profile.save(path)
    engine.dram_profile = engine._load_dram_profile(path)
    stats = engine.generate(PROBE.prompt, system=PROBE.system, max_new_tokens=8, sensitivity=1.0).stats
    assert (stats.dram_bytes_per_instruction, stats.dram_source) == (4.09, "ncu")


def engine_decode_sparsity(engine: PruningEngine) -> float:
    """The decode steps' activation sparsity of one request, read from its ledger."""
    from prunewatch.engine.execution import ExecutionLedger

    ids = engine.render_prompt(PROBE.prompt, PROBE.system)
    plan = engine.execution_plan(ids, 1.0, [], prompt_text=PROBE.prompt)
    ledger = ExecutionLedger()
    for _ in engine._decode(ids, plan, ledger, 8, True):
        pass
    return ledger.decode_activation_sparsity
