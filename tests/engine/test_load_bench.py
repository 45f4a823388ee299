"""`prunewatch bench load`: what its figures count, and its runs against `prunewatch serve` of the probe model and a
stand-in llama-server; never timings."""

from __future__ import annotations

import json

import pytest

from prunewatch.bench import load
from prunewatch.bench.load import StreamedRequest, nearest_rank, summarise
from tests.engine.test_precision_bench import RECORDED
from tests.support.llama_cpp_fake import fake_llama_cpp


def test_a_level_counts_only_the_tokens_that_arrived_inside_its_window():
    window = (10.0, 20.0)
    requests = [
        StreamedRequest(0, sent=10.0, arrivals=[11.0, 11.5, 12.0, 12.5], status=200, finished=True,
                        decode_pruning_ratio=0.25),
        StreamedRequest(0, sent=12.5, arrivals=[18.0, 19.0, 20.0, 21.0, 22.0], status=200),  # cut: 3 inside
        StreamedRequest(1, sent=10.0, arrivals=[], status=0),  # queued the whole window
        StreamedRequest(1, sent=10.2, arrivals=[], status=503, error="HTTP 503: busy"),
    ]
    level = summarise(requests, window, clients=2)
    assert level["tokens"] == 4 + 3
    assert level["aggregate_tokens_per_s"] == pytest.approx(0.7)
    assert level["per_client_tokens_per_s"] == pytest.approx(0.35)
    assert (level["requests"], level["finished"], level["cut"], level["unserved"]) == (4, 1, 1, 2)
    assert level["errors"] == {"HTTP 503": 1}
    # per request, from the chunks inside the window: 0.5 s and 1.0 s per token; first tokens after 1.0 s and 5.5 s
    assert (level["tpot_p50_ms"], level["tpot_p99_ms"]) == (500.0, 1000.0)
    assert (level["ttft_p50_ms"], level["ttft_p99_ms"]) == (1000.0, 5500.0)
    assert level["mean_decode_pruning_ratio"] == 0.25
    assert requests[1].tpot_s() == pytest.approx(1.0) and requests[2].ttft_s() is None


def test_nearest_rank_returns_an_observed_value():
    assert nearest_rank([], 0.5) is None
    assert nearest_rank([3.0, 1.0, 2.0], 0.5) == 2.0
    assert nearest_rank([float(v) for v in range(1, 101)], 0.99) == 99.0
    assert nearest_rank([1.0, 9.0], 0.99) == 9.0


def test_the_stepper_counters_are_read_back_from_the_servers_exposition():
    """What the bench reads is what the server's collector publishes, packed passes included."""
    from prometheus_client import CollectorRegistry, generate_latest

    from prunewatch.engine.batching import STEPPER_ACTIVITIES, StepperTime
    from prunewatch.server.metrics import StepperTimeCollector

    spent = StepperTime(jobs_s=1.5, packed_s=2.25, packed=3, packed_rows=7, gather_s=0.25, idle_s=4.0, jobs=2,
                        step_s_by_rows={1: 0.5, 4: 3.0}, steps_by_rows={1: 10, 4: 60})
    registry = CollectorRegistry()
    registry.register(StepperTimeCollector("m", lambda: spent))
    counters = load.parse_stepper(generate_latest(registry).decode())
    assert counters is not None
    assert counters.seconds == dict(zip(STEPPER_ACTIVITIES, (3.5, 2.25, 1.5, 0.25, 4.0), strict=True))
    assert counters.steps == {1: 10, 4: 60} and counters.step_seconds == {1: 0.5, 4: 3.0}
    assert counters.packed == {"passes": 3, "rows": 7}
    zero = load.StepperCounters({a: 0.0 for a in STEPPER_ACTIVITIES}, {}, {})
    between = load.stepper_between(zero, counters)
    assert between is not None and (between["packed_passes"], between["packed_rows"]) == (3, 7)
    assert load.parse_stepper("# nothing here\n") is None


def test_load_bench_drives_serve_dense_and_default_at_each_level(probe_model_dir, calibration_dir, tmp_path):
    out, plot = tmp_path / "load.json", tmp_path / "load.png"
    code = load.main(["--model-dir", str(probe_model_dir), "--calibration-dir", str(calibration_dir),
                      "--clients", "2,1", "--window", "3", "--max-tokens", "6", "--threads", "1",
                      "--out", str(out), "--plot", str(plot)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["command"].startswith("prunewatch bench load") and result["levels"] == [1, 2]
    assert set(result["method"]) >= {"aggregate_tokens_per_s", "tpot_p50_ms, tpot_p99_ms", "default_vs_dense"}
    assert set(result["series"]) == {"dense", "default"}
    for rows in result["series"].values():
        assert [r["clients"] for r in rows] == [1, 2]
        assert rows[0]["scaling_vs_1_client"] == 1.0
        for row in rows:
            assert row["errors"] == {} and row["tokens"] > 0 and row["requests"] >= row["clients"]
            assert row["aggregate_tokens_per_s"] == pytest.approx(row["tokens"] / row["window_s"], rel=1e-3)
            assert row["tpot_p50_ms"] is not None and row["tpot_p50_ms"] <= row["tpot_p99_ms"]
            assert row["finished"] >= 1  # six-token answers end well inside three seconds on the probe model
            stepper = row["stepper"]  # the server's own account of the level
            assert sum(stepper["share"].values()) == pytest.approx(1.0, abs=1e-3) and stepper["share"]["decode"] > 0
            assert set(stepper["ms_per_step_by_rows"]) == set(stepper["steps_by_rows"])
            assert min(stepper["ms_per_step_by_rows"].values()) > 0
            # every token after a request's first came from a decode step, or a packed pass, the server counted
            assert stepper["packed_rows"] >= stepper["packed_passes"] >= 0
            assert (sum(int(rows) * n for rows, n in stepper["steps_by_rows"].items()) + stepper["packed_rows"]
                    >= row["tokens"] - row["requests"])
    for row in result["series"]["dense"]:
        assert row["mean_decode_pruning_ratio"] == 0.0  # X-Pruning-Sensitivity: 0
    for row in result["series"]["default"]:
        assert row["default_vs_dense"] > 0
    assert plot.stat().st_size > 0
    table = load.format_table(result)
    assert table.count("| default | 2 |") == 2  # the load table and the stepper's


def test_load_bench_puts_llama_server_with_n_slots_beside_each_level(probe_model_dir, calibration_dir, tmp_path):
    gguf = tmp_path / "probe.F32.gguf"  # already F32: loaded as it is, no llama-quantize run and nothing cached
    gguf.write_bytes(b"GGUF" + b"\0" * 60)  # the stand-in llama-server never reads it
    tools = fake_llama_cpp(tmp_path / "llama.cpp", RECORDED)
    out = tmp_path / "load.json"
    code = load.main(["--model-dir", str(probe_model_dir), "--calibration-dir", str(calibration_dir), "--clients",
                      "1,2", "--window", "2", "--max-tokens", "4", "--threads", "1", "--out", str(out), "--no-plot",
                      "--peer", "llama.cpp", "--llama-cpp-dir", str(tools), "--gguf", str(gguf)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["peer"]["version"].startswith("version: 0 (test)") and result["peer"]["gguf"] == str(gguf)
    peer = result["series"]["llama.cpp F32"]
    assert [r["clients"] for r in peer] == [1, 2]
    for row in peer:
        assert row["errors"] == {} and row["tokens"] > 0 and row["finished"] >= 1
        assert f"-np {row['clients']} " in row["command"] and row["command"].endswith("--no-repack")
    servers = [c for c in (tools / "calls.log").read_text().splitlines() if c.startswith("llama-server")]
    assert len(servers) == 2 and all("-t 1 " in c and ".F32.gguf" in c for c in servers)


def test_load_bench_rejects_bad_levels_and_a_missing_llama_server(probe_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load.main(["--model-dir", str(probe_model_dir), "--clients", "0,2"])
    assert exit_info.value.code == 2 and "integers >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        load.main(["--model-dir", str(probe_model_dir), "--peer", "llama.cpp", "--llama-cpp-dir", str(tmp_path)])
    assert exit_info.value.code == 2 and "bench/build-llama-cpp.sh" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        load.main(["--model-dir", str(probe_model_dir), "--gguf", str(tmp_path / "missing.gguf")])
    assert exit_info.value.code == 2 and "no GGUF at" in capsys.readouterr().err


def test_the_server_gets_the_prefix_cache_setting_asked_for(tmp_path, monkeypatch):
    from prunewatch.bench.served import ServedModel
    from prunewatch.engine import EngineSettings

    monkeypatch.setenv("PRUNEWATCH_ENGINE_PREFIX_CACHE_ENTRIES", "5")
    assert ServedModel(tmp_path, threads=1).environment()["PRUNEWATCH_ENGINE_PREFIX_CACHE_ENTRIES"] == "5"
    env = ServedModel(tmp_path, threads=1, prefix_cache_entries=0).environment()
    monkeypatch.setenv("PRUNEWATCH_ENGINE_PREFIX_CACHE_ENTRIES", env["PRUNEWATCH_ENGINE_PREFIX_CACHE_ENTRIES"])
    assert EngineSettings(model_dir=tmp_path).prefix_cache_entries == 0  # what `serve` reads from it
