"""DRAM bytes read per executed instruction of one decode step, measured with Nsight Compute.

The engine's own byte counts (ExecutionLedger.weight_bytes_read) are derived from the weights a
kernel was asked to read; they say nothing about what reached DRAM. This module asks the hardware:
it runs a short child process that decodes one step between cudaProfilerStart/Stop, under
`ncu --csv`, and sums dram__bytes_read.sum and sm__inst_executed.sum over every kernel of that
step. Dense and sparse steps of one model can then be compared on measured bytes, and bytes per
instruction shows whether a sparse step traded bytes for bookkeeping instructions.

    python -m prunewatch.engine.ncu measure --sparsity 0.5         # runs ncu around the workload below
    python -m prunewatch.engine.ncu decode-step --sparsity 0.5     # the workload itself (what ncu launches)

ncu must be on PATH (or named by PRUNEWATCH_NCU); reading GPU counters may need root, or the driver
option NVreg_RestrictProfilingToAdminUsers=0. ncu replays each kernel with its caches flushed
(--cache-control all, its default), so every kernel's bytes are counted from cold DRAM.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from prunewatch.engine.errors import EngineError

NCU_ENV = "PRUNEWATCH_NCU"
"""Environment variable naming the ncu executable when it is not on PATH."""

BYTES_METRIC = "dram__bytes_read.sum"
INSTRUCTIONS_METRIC = "sm__inst_executed.sum"
METRICS = (BYTES_METRIC, INSTRUCTIONS_METRIC)

_BASE_UNITS = {BYTES_METRIC: "byte", INSTRUCTIONS_METRIC: "inst"}
_PREFIXES = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}  # ncu scales by powers of 1000
_PERMISSION_MARKER = "ERR_NVGPUCTRPERM"  # ncu's message when the driver hides GPU counters from the user


class NcuUnavailableError(EngineError):
    """Nsight Compute (ncu) is not installed here, or cannot read the GPU's counters."""


class NcuOutputError(EngineError):
    """ncu ran but its output has no usable figure (no kernel profiled, a metric missing or n/a)."""


@dataclass(frozen=True)
class DramMeasurement:
    """Measured DRAM traffic and instructions of one profiled workload, summed over its kernels."""

    dram_bytes_read: float  # sum of dram__bytes_read.sum over the kernels, bytes
    instructions: float  # sum of sm__inst_executed.sum over the kernels (warp instructions)
    kernels: int  # kernel launches profiled
    source: Literal["ncu"] = "ncu"  # measured by Nsight Compute, not estimated from tensor sizes

    @property
    def bytes_per_instruction(self) -> float:
        """DRAM bytes read per executed warp instruction; 0 when nothing ran."""
        return self.dram_bytes_read / self.instructions if self.instructions else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "bytes_per_instruction": self.bytes_per_instruction}


def find_ncu(explicit: str | None = None) -> str:
    """Path of the ncu executable: `explicit`, $PRUNEWATCH_NCU, or PATH; a typed error when absent."""
    name = explicit or os.environ.get(NCU_ENV) or "ncu"
    found = shutil.which(name)
    if found is None:
        raise NcuUnavailableError(
            f"Nsight Compute's `{name}` was not found; install Nsight Compute (it ships with the CUDA "
            f"toolkit, e.g. /usr/local/cuda/bin/ncu), put it on PATH or set {NCU_ENV} to its path")
    return found


def build_command(ncu: str, workload: Sequence[str], log_file: Path) -> list[str]:
    """ncu's command line around `workload`: the two metrics as CSV in base units, in `log_file`.

    Only kernels between cudaProfilerStart and cudaProfilerStop are profiled, so the child's model
    loading, calibration and warm-up (Triton compiles) are not counted; clocks are left as they are.
    """
    if not workload:
        raise ValueError("the workload to profile needs a command line")
    return [ncu, "--metrics", ",".join(METRICS), "--clock-control", "none", "--csv", "--print-units", "base",
            "--target-processes", "all", "--profile-from-start", "off", "--log-file", str(log_file), *workload]


def _number(text: str) -> float | None:
    """A metric value as ncu prints it ('1,234,567', '12.5', 'n/a'); None when there is none."""
    cleaned = text.strip().replace(",", "")
    if cleaned in ("", "n/a", "N/A"):
        return None
    try:
        return float(cleaned)
    except ValueError:
        return None


def _scale(metric: str, unit: str) -> float:
    """Factor from `unit` (e.g. 'Mbyte', 'Kinst', 'byte'; empty: the base unit) to the metric's base unit."""
    base = _BASE_UNITS[metric]
    if not unit.strip():
        return 1.0
    match = re.fullmatch(rf"([KMGTP]?){base}s?", unit.strip())
    if match is None:
        raise NcuOutputError(f"ncu reported {metric} in unit {unit!r}, expected {base} with an SI prefix")
    return _PREFIXES[match.group(1)]


def _table(text: str) -> list[dict[str, str]]:
    """The CSV rows of ncu's output; lines before the header (==PROF== notes, child output) dropped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID",')), None)
    if start is None:
        raise NcuOutputError(
            "ncu's output has no CSV table: no kernel was profiled between cudaProfilerStart and Stop")
    return list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))


def parse_csv(text: str) -> DramMeasurement:
    """Sum dram__bytes_read.sum and sm__inst_executed.sum over the kernels of ncu's --csv output.

    Reads the long format ncu prints by default (one row per kernel and metric: "ID", ...,
    "Metric Name", "Metric Unit", "Metric Value"), with or without --print-units base and with
    thousands separators. A kernel missing either metric, or reporting it as n/a, is an error:
    a sum with holes would understate the traffic.
    """
    rows = _table(text)
    if rows and not {"Metric Name", "Metric Unit", "Metric Value"} <= set(rows[0]):
        raise NcuOutputError(f"ncu's CSV has no Metric Name/Unit/Value columns: {sorted(rows[0])}")
    per_kernel: dict[str, dict[str, float]] = {}
    for row in rows:
        metric = row["Metric Name"]
        if metric not in _BASE_UNITS:
            continue
        value = _number(row["Metric Value"])
        if value is None:
            raise NcuOutputError(
                f"ncu reported {metric} as {row['Metric Value']!r} for kernel {row.get('Kernel Name', '?')}; "
                "this GPU or ncu version cannot measure it")
        kernel = f"{row.get('Process ID', '')}:{row['ID']}"  # IDs count launches per profiled process
        per_kernel.setdefault(kernel, {})[metric] = value * _scale(metric, row["Metric Unit"])
    if not per_kernel:
        raise NcuOutputError(f"ncu's CSV has no {BYTES_METRIC} or {INSTRUCTIONS_METRIC} rows")
    incomplete = sorted(kernel for kernel, metrics in per_kernel.items() if len(metrics) != len(METRICS))
    if incomplete:
        raise NcuOutputError(
            f"ncu's CSV lacks one of {', '.join(METRICS)} for kernels (process:ID) {', '.join(incomplete)}")
    return DramMeasurement(
        dram_bytes_read=sum(m[BYTES_METRIC] for m in per_kernel.values()),
        instructions=sum(m[INSTRUCTIONS_METRIC] for m in per_kernel.values()),
        kernels=len(per_kernel))


def _failure(completed: subprocess.CompletedProcess, log: str) -> EngineError:
    """The typed error for a failed ncu run, with the line that says why."""
    output = "\n".join((log, completed.stdout or "", completed.stderr or ""))
    if _PERMISSION_MARKER in output:
        return NcuUnavailableError(
            "ncu cannot read the GPU's performance counters as this user (ERR_NVGPUCTRPERM); run it as root "
            "or load the NVIDIA driver with NVreg_RestrictProfilingToAdminUsers=0")
    lines = [line for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "ERROR" in line or "Error" in line]
    reason = (errors or lines or [f"exit status {completed.returncode}"])[-1].strip()
    return NcuOutputError(f"ncu exited with status {completed.returncode}: {reason}")


def measure(workload: Sequence[str], *, ncu: str | None = None, timeout_s: float = 600.0) -> DramMeasurement:
    """Run `workload` under ncu and return its summed DRAM bytes and instructions."""
    executable = find_ncu(ncu)
    with tempfile.TemporaryDirectory(prefix="prunewatch-ncu-") as folder:
        log_file = Path(folder) / "ncu.csv"
        env = {**os.environ, "LC_ALL": "C"}  # '.' decimals and ',' thousands, whatever the host's locale
        try:
            completed = subprocess.run(build_command(executable, workload, log_file), capture_output=True,
                                       text=True, timeout=timeout_s, env=env, check=False)
        except subprocess.TimeoutExpired as exc:
            raise NcuOutputError(f"ncu did not finish within {timeout_s:.0f} s; profile a shorter workload") from exc
        log = log_file.read_text() if log_file.exists() else ""
        if completed.returncode != 0:
            raise _failure(completed, log)
        return parse_csv(log or completed.stdout)


def decode_step_command(*, sparsity: float, batch: int = 1, policy: str = "row", dtype: str = "bfloat16",
                        model_dir: Path | None = None) -> list[str]:
    """The child command line that decodes one profiled step (see `run_decode_step`)."""
    command = [sys.executable, "-m", "prunewatch.engine.ncu", "decode-step", "--sparsity", str(sparsity), "--batch", str(batch),
               "--policy", policy, "--dtype", dtype]
    return command + (["--model-dir", str(model_dir)] if model_dir is not None else [])


def measure_decode_step(*, sparsity: float, batch: int = 1, policy: str = "row", dtype: str = "bfloat16",
                        model_dir: Path | None = None, ncu: str | None = None,
                        timeout_s: float = 600.0) -> DramMeasurement:
    """DRAM bytes and instructions of one decode step at `sparsity` (0: dense), measured by ncu."""
    return measure(decode_step_command(sparsity=sparsity, batch=batch, policy=policy, dtype=dtype,
                                       model_dir=model_dir), ncu=ncu, timeout_s=timeout_s)


def _random_llama(dtype):
    """A small Llama with random weights: 4 blocks of TinyLlama's width, enough for a memory-bound step."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=1024,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype=dtype).eval()


def run_decode_step(*, sparsity: float, batch: int, policy: str, dtype: str, model_dir: Path | None) -> None:
    """The profiled workload: load, calibrate and warm up on CUDA, then one decode step between
    cudaProfilerStart and cudaProfilerStop, so that only that step's kernels are counted."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from prunewatch.engine.execution import ExecutionLedger, ExecutionPlan, executing, instrument
    from prunewatch.engine.sparse import calibrate_sparsity, install_sparsity

    torch_dtype = getattr(torch, dtype)
    model = (AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval() if model_dir is not None
             else _random_llama(torch_dtype)).to("cuda")
    instrumented = instrument(model)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    plan = ExecutionPlan()
    if sparsity > 0:
        corpus = [torch.randint(0, vocab, (1, 32), generator=g) for _ in range(2)]
        calibration = calibrate_sparsity(instrumented, corpus, model_fingerprint="ncu-workload",
                                         corpus_digest="random-ids", max_rows_per_layer=64)
        install_sparsity(instrumented, calibration)
        plan = ExecutionPlan(activation_sparsity=sparsity, sparsity_policy=policy)
    prompt = torch.randint(0, vocab, (batch, 8), generator=g).to("cuda")
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), executing(ExecutionPlan(), ExecutionLedger()):
        ids = model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
    with torch.no_grad(), executing(plan, ExecutionLedger()):
        for step in range(2):  # the first compiles Triton kernels and fills allocator caches; the second is profiled
            positions = torch.full((batch, 1), prompt.shape[1] + step, device="cuda")
            torch.cuda.synchronize()
            if step == 1:
                torch.cuda.profiler.start()
            logits = model(input_ids=ids, cache=cache, use_cache=True, position_ids=positions, logits_to_keep=1).logits
            torch.cuda.synchronize()
            if step == 1:
                torch.cuda.profiler.stop()
            ids = logits[:, -1].argmax(-1, keepdim=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prunewatch.engine.ncu", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (("measure", "run ncu around one decode step and print the measurement as JSON"),
                       ("decode-step", "the workload ncu profiles: one decode step on CUDA")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("--sparsity", type=float, default=0.0, help="activation sparsity target; 0 is dense")
        sub.add_argument("--batch", type=int, default=1)
        sub.add_argument("--policy", choices=("row", "shared"), default="row")
        sub.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
        sub.add_argument("--model-dir", type=Path, default=None, help="a model folder (default: random Llama)")
    args = parser.parse_args(argv)
    options = {"sparsity": args.sparsity, "batch": args.batch, "policy": args.policy, "dtype": args.dtype,
               "model_dir": args.model_dir}
    if args.command == "decode-step":
        run_decode_step(**options)
        return 0
    try:
        result = measure_decode_step(**options)
    except EngineError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    sys.stdout.write(json.dumps({**options, "model_dir": str(args.model_dir) if args.model_dir else None,
                                 **result.to_dict()}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
