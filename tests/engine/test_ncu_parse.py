"""Nsight Compute's CSV, read into DRAM bytes per instruction: units and separators as ncu prints
them, every kernel counted once, holes refused; and the command line and a missing ncu."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from prunewatch.engine.ncu import (
    DramMeasurement,
    NcuOutputError,
    NcuUnavailableError,
    build_command,
    decode_step_command,
    find_ncu,
    measure,
    parse_csv,
)

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def _row(kernel_id: int, kernel: str, metric: str, unit: str, value: str, pid: int = 4242) -> str:
    return (f'"{kernel_id}","{pid}","python3","127.0.0.1","{kernel}","1","7","(128, 1, 1)","(32, 1, 1)","0","9.0",'
            f'"Command line profiler metrics","{metric}","{unit}","{value}"')


# The shape of `ncu --csv` output: the profiler's own notes and the child's stdout before the table,
# auto-scaled units (decimal prefixes) and thousands separators in the values.
SAMPLE = "\n".join([
    "==PROF== Connected to process 4242 (/usr/bin/python3.11)",
    "decode step done",
    '==PROF== Profiling "_sparse_gemm_kernel" - 0: 0%....50%....100% - 1 pass',
    '==PROF== Profiling "gemv2T_kernel_val" - 1: 0%....50%....100% - 1 pass',
    HEADER,
    _row(0, "_sparse_gemm_kernel", "dram__bytes_read.sum", "Mbyte", "4.19"),
    _row(0, "_sparse_gemm_kernel", "sm__inst_executed.sum", "inst", "1,048,576"),
    _row(1, "void gemv2T_kernel_val<int, int, __nv_bfloat16, float, 128, 16, 4, 4, false>(Params)",
         "dram__bytes_read.sum", "Kbyte", "2.048"),
    _row(1, "void gemv2T_kernel_val<int, int, __nv_bfloat16, float, 128, 16, 4, 4, false>(Params)",
         "sm__inst_executed.sum", "Kinst", "12"),
    _row(2, "elementwise_kernel", "dram__bytes_read.sum", "byte", "2,816"),
    _row(2, "elementwise_kernel", "sm__inst_executed.sum", "inst", "1,024"),
    "==PROF== Disconnected from process 4242",
    "",
])


def test_sums_bytes_and_instructions_over_kernels_in_base_units():
    result = parse_csv(SAMPLE)
    assert result == DramMeasurement(dram_bytes_read=4.19e6 + 2048 + 2816,
                                     instructions=1_048_576 + 12_000 + 1024, kernels=3)
    assert result.source == "ncu"
    assert result.bytes_per_instruction == pytest.approx((4.19e6 + 4864) / 1_061_600)
    assert result.to_dict()["bytes_per_instruction"] == result.bytes_per_instruction


def test_base_units_and_an_empty_unit_read_as_given():
    text = "\n".join([HEADER, _row(0, "k", "dram__bytes_read.sum", "byte", "1,000,000"),
                      _row(0, "k", "sm__inst_executed.sum", "", "250")])
    assert parse_csv(text) == DramMeasurement(dram_bytes_read=1e6, instructions=250, kernels=1)


def test_the_same_launch_id_in_two_processes_is_two_kernels():
    text = "\n".join([HEADER, *(_row(0, "k", metric, unit, "10", pid=pid) for pid in (1, 2)
                                for metric, unit in (("dram__bytes_read.sum", "byte"),
                                                     ("sm__inst_executed.sum", "inst")))])
    assert parse_csv(text).kernels == 2


def test_other_metrics_are_ignored():
    text = "\n".join([HEADER, _row(0, "k", "gpu__time_duration.sum", "nsecond", "5,000"),
                      _row(0, "k", "dram__bytes_read.sum", "byte", "64"), _row(0, "k", "sm__inst_executed.sum", "inst", "8")])
    assert parse_csv(text).bytes_per_instruction == 8.0


@pytest.mark.parametrize("text, message", [
    ("==PROF== Connected to process 1\n==PROF== Disconnected from process 1\n", "no kernel was profiled"),
    ("\n".join([HEADER, _row(0, "k", "dram__bytes_read.sum", "byte", "64")]), "lacks one of"),
    ("\n".join([HEADER, _row(0, "k", "dram__bytes_read.sum", "byte", "n/a"),
                _row(0, "k", "sm__inst_executed.sum", "inst", "8")]), "cannot measure it"),
    ("\n".join([HEADER, _row(0, "k", "dram__bytes_read.sum", "sector", "2"),
                _row(0, "k", "sm__inst_executed.sum", "inst", "8")]), "unit 'sector'"),
    ("\n".join([HEADER, _row(0, "k", "gpu__time_duration.sum", "nsecond", "5")]), "no dram__bytes_read.sum"),
])
def test_output_without_a_complete_figure_is_a_typed_error(text, message):
    with pytest.raises(NcuOutputError, match=message):
        parse_csv(text)


def test_command_profiles_only_the_marked_range_of_the_workload(tmp_path):
    command = build_command("/opt/ncu", ["python", "-m", "prunewatch.engine.ncu", "decode-step"], tmp_path / "out.csv")
    assert command[0] == "/opt/ncu"
    assert command[command.index("--metrics") + 1] == "dram__bytes_read.sum,sm__inst_executed.sum"
    for flag, value in (("--clock-control", "none"), ("--target-processes", "all"), ("--print-units", "base"),
                        ("--profile-from-start", "off"), ("--log-file", str(tmp_path / "out.csv"))):
        assert command[command.index(flag) + 1] == value
    assert "--csv" in command
    assert command[-4:] == ["python", "-m", "prunewatch.engine.ncu", "decode-step"]  # the workload comes last, unchanged
    with pytest.raises(ValueError):
        build_command("/opt/ncu", [], tmp_path / "out.csv")


def test_decode_step_command_runs_this_module_with_the_same_interpreter():
    command = decode_step_command(sparsity=0.5, batch=4, policy="shared", model_dir=Path("/m"))
    assert command[:4] == [sys.executable, "-m", "prunewatch.engine.ncu", "decode-step"]
    assert command[command.index("--sparsity") + 1] == "0.5" and command[-2:] == ["--model-dir", "/m"]


def test_a_missing_ncu_is_a_typed_error_that_says_where_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("PRUNEWATCH_NCU", raising=False)
    with pytest.raises(NcuUnavailableError, match="install Nsight Compute.*PRUNEWATCH_NCU"):
        find_ncu()
    with pytest.raises(NcuUnavailableError):
        measure(["true"])


def _fake_ncu(folder: Path, body: str) -> Path:
    """An executable standing in for ncu: it sees ncu's arguments, so it can write the --log-file."""
    path = folder / "ncu"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_measure_reads_the_log_file_ncu_writes(tmp_path):
    sample = tmp_path / "sample.csv"
    sample.write_text(SAMPLE)
    ncu = _fake_ncu(tmp_path, f'while [ "$1" != "--log-file" ]; do shift; done\ncp "{sample}" "$2"\n')
    assert measure(["true"], ncu=str(ncu)).kernels == 3


def test_counters_hidden_from_the_user_is_an_actionable_error(tmp_path):
    ncu = _fake_ncu(tmp_path, 'echo "==ERROR== ERR_NVGPUCTRPERM - The user does not have permission" >&2\nexit 1\n')
    with pytest.raises(NcuUnavailableError, match="NVreg_RestrictProfilingToAdminUsers=0"):
        measure(["true"], ncu=str(ncu))
    other = _fake_ncu(tmp_path, 'echo "==ERROR== Failed to prepare kernel for profiling" >&2\nexit 9\n')
    with pytest.raises(NcuOutputError, match="status 9: ==ERROR== Failed to prepare kernel"):
        measure(["true"], ncu=str(other))


@pytest.mark.skipif(os.name != "posix", reason="uses a shell script as a stand-in for ncu")
def test_the_prunewatch_ncu_variable_names_the_executable(monkeypatch, tmp_path):
    ncu = _fake_ncu(tmp_path, "exit 0\n")
    monkeypatch.setenv("PRUNEWATCH_NCU", str(ncu))
    assert find_ncu() == str(ncu)
