"""Shared fixtures: the bundled probe model, one loaded engine, real servers, a real collector run."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from prunewatch.engine.sparse.kernel import CACHE_ENV, cache_dir
from tests.support.servers import postgres_available, postgres_server

# Processes a test starts with a fresh HOME (for a fresh calibration cache) still find the sparse kernel
# that `make kernels` built instead of compiling it again (~50 s each here); the tests about building it
# point CACHE_ENV elsewhere themselves.
os.environ.setdefault(CACHE_ENV, str(cache_dir().parents[1]))

REPO_ROOT = Path(__file__).resolve().parent.parent
PROBE_MODEL_DIR = REPO_ROOT / "prunewatch" / "engine" / "models" / "probe-llama"


def calibration_inputs() -> tuple[dict[str, list[str]], str]:
    """(texts by domain, digest) of the calibration set, as every engine is calibrated (never on evaluation)."""
    from prunewatch.probes import load_calibration_set

    calibration = load_calibration_set()
    return calibration.calibration_texts(), calibration.digest


SPEED_PROMPT = "Explain how a CPU cache works, step by step, for a new programmer."
"""The prompt the decode benchmarks time, used by the tests that decode the way they do."""


def load_probe_engine(model_dir: Path, calibration_dir: Path, **overrides):
    """A quiet CPU engine of `model_dir` with EngineSettings `overrides`, calibrated on the calibration set."""
    from prunewatch.engine import EngineSettings, PruningEngine

    settings = {"log_level": "NONE", **overrides}
    engine = PruningEngine.load(EngineSettings(model_dir=model_dir, device="cpu", calibration_dir=calibration_dir,
                                               **settings))
    engine.load_or_calibrate(*calibration_inputs())
    return engine


def assert_compiled_steps_equal_eager(engine, tokens: int = 6):
    """A compiled engine's dense and default plans decode the speed prompt to eager's tokens, with the bytes the
    ledger counts within 0.1% of eager's; returns the default plan's eager measurement."""
    from prunewatch.engine.execution import ExecutionPlan

    ids = engine.render_prompt(SPEED_PROMPT)
    plan = engine.execution_plan(ids, engine.settings.sensitivity, [], prompt_text=SPEED_PROMPT)
    for chosen in (ExecutionPlan(), plan):
        eager = engine.measure_decode(ids, chosen, tokens, compiled=False)
        compiled = engine.measure_decode(ids, chosen, tokens, compiled=True)
        assert engine.compiled_decode(True) is not None, engine.compiled_decode_failure
        assert compiled.tokens == eager.tokens
        assert abs(compiled.ledger.decode_bytes_read - eager.ledger.decode_bytes_read) \
            <= 1e-3 * eager.ledger.decode_bytes_read
    return eager


@pytest.fixture(scope="session")
def probe_model_dir() -> Path:
    if not (PROBE_MODEL_DIR / "model.safetensors").is_file():
        pytest.fail(f"bundled probe model missing at {PROBE_MODEL_DIR}; run `prunewatch build-model`")
    return PROBE_MODEL_DIR


@pytest.fixture(scope="session")
def calibration_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("calibration")


# The engine's defaults keep quality on a real model and leave layer bypass and head gating off; the
# plumbing tests on the probe model exercise those mechanisms, so they switch them on explicitly.
PROBE_MECHANISMS = {"influence_budget": 0.5, "head_gating": True, "head_budget": 0.05, "activation_sparsity": 0.0,
                    "output_head_sparsity": 0.0}


@pytest.fixture(scope="session")
def probe_engine(probe_model_dir: Path, calibration_dir: Path):
    """One calibrated engine on the CPU for the whole session (loading and calibrating cost seconds),
    with layer bypass and head gating on (PROBE_MECHANISMS)."""
    from prunewatch.engine import EngineSettings, PruningEngine
    engine = PruningEngine.load(EngineSettings(model_dir=probe_model_dir, device="cpu", calibration_dir=calibration_dir,
                                               **PROBE_MECHANISMS))
    engine.load_or_calibrate(*calibration_inputs())
    return engine


@pytest.fixture(scope="session")
def postgres() -> Iterator:
    """A real PostgreSQL server for the session (initdb + pg_ctl on a temp dir and a free port)."""
    if not postgres_available():
        pytest.fail("PostgreSQL server binaries are not installed (apt-get install postgresql)")
    with postgres_server() as server:
        yield server


@pytest.fixture(scope="session")
def collected_sqlite(tmp_path_factory, probe_model_dir: Path, calibration_dir: Path) -> str:
    """A SQLite store filled by a real two-round embedded collector run; returns its URL."""
    from prunewatch.collector.settings import CollectorSettings
    from prunewatch.embedded import run_embedded

    path = tmp_path_factory.mktemp("store") / "collected.db"
    url = f"sqlite:///{path}"
    # No operating range: measuring one runs the evaluation prompts twice, which the stored rounds do not need.
    outcome = run_embedded(CollectorSettings(db_url=url, rounds=2, interval_s=1.0, metrics_port=0,
                                             model_dir=probe_model_dir, device="cpu", operating_range=False),
                           calibration_dir=calibration_dir)
    assert outcome.rounds == 2 and outcome.failures == 0
    return url
