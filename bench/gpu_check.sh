#!/usr/bin/env bash
# GPU check of activation sparsity on one NVIDIA GPU, from this repository's working tree:
#   1. the Triton kernel's tests on real CUDA (not interpreted) and the ncu parser's tests;
#   2. the Triton kernel against dense torch at batch 1/4/8 with NaN in every inactive weight row,
#      and the sparse engine on CUDA against a masked dense run of the same model;
#   3. the engine benchmark on CUDA (quick mode, then the full speed part if time is left);
#   4. DRAM bytes per instruction of one dense and one sparse decode step, if `ncu` is on PATH;
#   5. (informational) decode speed against the measured read bandwidth, prunewatch/bench/speed.py --device cuda.
#
# Usage: bash bench/gpu_check.sh            (from anywhere; results in $OUT, else bench/results/gpu/)
# Environment: OUT (result folder), GPU_CHECK_BUDGET_S (total seconds, default 360),
#              GPU_CHECK_VENV (venv to create or reuse, default .venv-gpu), PYTHON (interpreter to try first).
# Python: the first of $PYTHON, .venv/bin/python, $GPU_CHECK_VENV/bin/python, python3 whose torch sees
# CUDA; with only a system python3 that has CUDA torch, a venv with --system-site-packages is made on top
# of it; with none, a venv gets `pip install torch==2.13.0 -e .[test]` (needs a package index).
# Exit status: 0 all checks passed; 1 a correctness check or a benchmark failed; 3 no usable Python/GPU.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${OUT:-$ROOT/bench/results/gpu}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-360}"
VENV="${GPU_CHECK_VENV:-$ROOT/.venv-gpu}"
START_S=$SECONDS
FAILURES=()
cd "$ROOT" || exit 3
mkdir -p "$OUT_DIR"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # the tree as checked out, installed or not
export TRITON_DEFAULT_FP_FUSION=1                      # triton's current default, stated to silence its warning
unset TRITON_INTERPRET                                 # compile for the GPU, never interpret

log() { printf '[gpu_check %4ds] %s\n' "$((SECONDS - START_S))" "$*"; }

# Seconds left of the budget, capped at $1: every step gets a bounded `timeout`.
left() {
  local remaining=$((BUDGET_S - (SECONDS - START_S)))
  if ((remaining < $1)); then echo "$remaining"; else echo "$1"; fi
}

# Run one step under `timeout`, tee its output to $OUT_DIR/<name>.log, print its duration.
# Usage: step NAME MAX_SECONDS KIND COMMAND...   (KIND: check = a failure fails the run; info = reported only)
step() {
  local name=$1 max=$2 kind=$3 limit started status
  shift 3
  limit=$(left "$max")
  if ((limit < 20)); then
    log "SKIP $name: under 20 s of the ${BUDGET_S} s budget left"
    return 0
  fi
  log "START $name (at most ${limit} s)"
  started=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
  status=${PIPESTATUS[0]}
  if ((status == 0)); then
    log "PASS $name in $((SECONDS - started)) s"
  elif [[ $kind == check ]]; then
    log "FAIL $name (status $status$([[ $status == 124 ]] && echo ', timed out')) in $((SECONDS - started)) s"
    FAILURES+=("$name")
  else
    log "NOT MEASURED $name (status $status) in $((SECONDS - started)) s"
  fi
  return 0
}

has_cuda_torch() {
  [[ -x "$1" ]] || command -v "$1" >/dev/null 2>&1 || return 1
  timeout 120 "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1
}

pick_python() {
  local candidate
  for candidate in ${PYTHON:+"$PYTHON"} "$ROOT/.venv/bin/python" "$VENV/bin/python"; do
    if has_cuda_torch "$candidate"; then PY=$candidate; return 0; fi
  done
  if has_cuda_torch python3; then
    log "python3 has a CUDA torch: making $VENV on top of it (--system-site-packages)"
    python3 -m venv --system-site-packages "$VENV" || return 1
    # Registers the project only: torch and the rest come from the system, so no index is needed.
    timeout 300 "$VENV/bin/pip" install --no-deps --no-build-isolation -e "$ROOT" >"$OUT_DIR/pip.log" 2>&1 ||
      log "note: editable install failed (see $OUT_DIR/pip.log); running from the tree through PYTHONPATH"
    PY="$VENV/bin/python"
    return 0
  fi
  log "no Python with a CUDA torch: making $VENV and installing torch==2.13.0 and .[test] (needs a package index)"
  python3 -m venv "$VENV" || return 1
  timeout 900 "$VENV/bin/pip" install "torch==2.13.0" -e "${ROOT}[test]" >"$OUT_DIR/pip.log" 2>&1 || {
    log "pip install failed; last lines of $OUT_DIR/pip.log:"
    tail -n 5 "$OUT_DIR/pip.log"
    return 1
  }
  has_cuda_torch "$VENV/bin/python" && PY="$VENV/bin/python"
}

# What the steps import, checked up front so a missing package is named rather than a traceback.
preflight() {
  "$PY" - <<'PY'
import importlib
import sys

import torch

print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"GPU {torch.cuda.get_device_name()} (capability {torch.cuda.get_device_capability()})")
needed = ["triton", "transformers", "tokenizers", "safetensors", "pydantic", "pydantic_settings", "numpy",
          "matplotlib", "yaml", "psutil", "pytest"]
missing = [name for name in needed if importlib.util.find_spec(name) is None]
if missing:
    print("missing Python packages: " + " ".join(missing) + "  (pip install them, or `pip install -e .[test]`)")
    sys.exit(1)
import triton  # noqa: E402

print(f"triton {triton.__version__}")
for module in ("prunewatch.engine.sparse", "prunewatch.engine.sparse.triton_kernel", "prunewatch.engine.ncu", "prunewatch.bench.engine"):
    try:
        importlib.import_module(module)
    except ImportError as exc:
        print(f"cannot import {module}: {exc}")
        sys.exit(1)
PY
}

correctness() {
  "$PY" - <<'PY'
"""Triton kernel vs dense torch on CUDA, NaN in every inactive row; the sparse engine vs masked dense."""
import sys
import time

import torch

from prunewatch.engine.sparse.triton_kernel import sparse_linear

torch.manual_seed(0)
failures = []
SHAPES = [(2048, 2048), (2048, 5632), (5632, 2048), (2050, 1000)]  # TinyLlama's projections, and odd sizes
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def check(name, ok, detail):
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")
    if not ok:
        failures.append(name)


def timed(fn, repeat=50):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / repeat  # microseconds per call


for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for n_in, n_out in SHAPES:
        for rows in (1, 4, 8):
            for policy in ("row", "shared"):
                x = torch.randn(rows, n_in, device="cuda").to(dtype)
                weight = (torch.randn(n_out, n_in, device="cuda") / n_in ** 0.5).to(dtype)
                bias = torch.randn(n_out, device="cuda").to(dtype)
                scale = torch.rand(n_in, device="cuda") + 0.5
                score = x.float().abs() * scale
                if policy == "row":
                    threshold, keep = float(score.flatten().quantile(0.5 if rows == 1 else 0.85)), -1
                    mask = score > threshold
                else:
                    threshold, keep = 0.0, n_in // 2
                    top = torch.sort(score.double().sum(0), descending=True, stable=True).indices[:keep]
                    mask = torch.zeros(n_in, dtype=torch.bool, device="cuda")
                    mask[top] = True
                    mask = mask.expand_as(x)
                union = mask.any(0)
                weight_t = weight.t().contiguous()
                weight_t[~union] = float("nan")
                output, active, kept = sparse_linear(x, weight_t, bias, scale, threshold, keep)
                expected = (x.double() * mask) @ weight.double().t() + bias.double()
                error = float((output.double() - expected).abs().max())
                scale_ref = float(expected.abs().max())
                name = f"{str(dtype)[6:]} {n_in}x{n_out} rows={rows} {policy}"
                expected_kept = int((mask & (x != 0)).sum()) if policy == "shared" else int(mask.sum())
                ok = (bool(torch.isfinite(output).all()) and error <= TOL[dtype] * max(1.0, scale_ref)
                      and active == int(union.sum()) and kept == expected_kept)
                detail = f"max error {error:.2e}, active {active}/{n_in} (union {int(union.sum())}), kept {kept}"
                if rows in (1, 8) and policy == "row" and n_in == 2048 and n_out == 5632:
                    clean = weight.t().contiguous()
                    sparse_us = timed(lambda: sparse_linear(x, clean, bias, scale, threshold, keep))
                    dense_us = timed(lambda: torch.nn.functional.linear(x, weight, bias))
                    detail += f"; {sparse_us:.1f} us sparse (with count readback) vs {dense_us:.1f} us dense"
                check(name, ok, detail)


def engine_check(dtype, tol):
    """The sparse engine on CUDA (calibration, install, kernel per layer) vs a masked dense run."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from prunewatch.engine.execution import ExecutionLedger, ExecutionPlan, executing, instrument
    from prunewatch.engine.sparse import calibrate_sparsity, install_sparsity
    from prunewatch.engine.sparse.targets import find_sparse_targets, score_scale

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(1)
    model = LlamaForCausalLM(config).eval().to(device="cuda", dtype=dtype)
    instrumented = instrument(model)
    g = torch.Generator().manual_seed(2)
    corpus = [torch.randint(0, 512, (1, 32), generator=g) for _ in range(2)]
    calibration = calibrate_sparsity(instrumented, corpus, model_fingerprint="t", corpus_digest="d", score="wina")
    ids = torch.randint(0, 512, (1, 8), generator=g).to("cuda")  # 8 rows per call: the kernel path, rows differ
    installation = install_sparsity(instrumented, calibration)
    devices = {str(m.weight_t.device) for m in installation.layers.values()} | {
        str(m.scale.device) for m in installation.layers.values()}
    ledger = ExecutionLedger()
    with torch.no_grad(), executing(ExecutionPlan(activation_sparsity=0.5), ledger):
        sparse = model(input_ids=ids, use_cache=False).logits.float()
    installation.uninstall()
    handles = []
    for key, (_, module) in find_sparse_targets(instrumented).items():
        threshold, scale = calibration.threshold(key, 0.5), score_scale(module, "wina").to("cuda")
        handles.append(module.register_forward_pre_hook(
            lambda m, args, t=threshold, s=scale: (args[0] * (args[0].float().abs() * s > t),)))
    with torch.no_grad(), executing(ExecutionPlan(), ExecutionLedger()):
        expected = model(input_ids=ids, use_cache=False).logits.float()
    for handle in handles:
        handle.remove()
    error = float((sparse - expected).abs().max())
    # 8 rows read the union of their channels, so the work skipped is small; the entries zeroed are not.
    check(f"engine on CUDA, {str(dtype)[6:]}", devices == {"cuda:0"} and error <= tol and 0.3 < ledger.input_sparsity < 0.7,
          f"buffers on {sorted(devices)}, max logit error {error:.2e}, input sparsity {ledger.input_sparsity:.3f}, "
          f"pruning ratio {ledger.pruning_ratio:.3f}")


started = time.perf_counter()
engine_check(torch.float32, 1e-3)
engine_check(torch.bfloat16, 0.25)
print(f"engine checks in {time.perf_counter() - started:.1f} s")
print(f"{len(failures)} failure(s)" + (": " + ", ".join(failures) if failures else ""))
sys.exit(1 if failures else 0)
PY
}

ncu_step() {
  local sparsity=$1
  "$PY" -m prunewatch.engine.ncu measure --sparsity "$sparsity" >"$OUT_DIR/ncu-sparsity-$sparsity.json" || return 1
  cat "$OUT_DIR/ncu-sparsity-$sparsity.json"
}

log "repository $ROOT, results in $OUT_DIR, budget ${BUDGET_S} s"
timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee "$OUT_DIR/nvidia-smi.log" ||
  log "note: nvidia-smi did not answer"
PY=""
if ! pick_python || [[ -z $PY ]]; then
  log "ERROR: no Python with a CUDA-enabled torch here. Install one (pip install torch==2.13.0, or a CUDA build"
  log "matching the driver) or set PYTHON=/path/to/python, then rerun."
  exit 3
fi
log "using $PY"
export PY OUT_DIR
export -f correctness ncu_step  # run under `timeout` through a child bash
if ! preflight 2>&1 | tee "$OUT_DIR/preflight.log"; then
  log "ERROR: the Python above lacks what the checks import (see the lines above); install it and rerun"
  exit 3
fi

step triton-tests 180 check "$PY" -m pytest -q -p no:cacheprovider tests/engine/test_triton_sparse.py tests/engine/test_ncu_parse.py
step correctness 150 check bash -c correctness
quality=()
if ! command -v g++ >/dev/null 2>&1 && ! command -v c++ >/dev/null 2>&1; then
  log "note: no C++ compiler, so no CPU kernel: the benchmark's quality part (CPU) is skipped and no PNG is drawn"
  quality=(--skip-quality)
fi
step bench-quick 240 check "$PY" -m prunewatch.bench.engine --quick --device cuda ${quality[@]+"${quality[@]}"} --out "$OUT_DIR/engine-cuda-quick.json"
if command -v ncu >/dev/null 2>&1 || [[ -n ${PRUNEWATCH_NCU:-} ]]; then
  step ncu-dense 120 info bash -c "ncu_step 0"
  step ncu-sparse 120 info bash -c "ncu_step 0.5"
  if [[ -s $OUT_DIR/ncu-sparsity-0.json && -s $OUT_DIR/ncu-sparsity-0.5.json ]]; then
    "$PY" - "$OUT_DIR/ncu-sparsity-0.json" "$OUT_DIR/ncu-sparsity-0.5.json" <<'PY' | tee "$OUT_DIR/ncu-summary.txt"
import json
import sys

dense, sparse = (json.load(open(path)) for path in sys.argv[1:3])
for name, r in (("dense", dense), ("sparse 0.5", sparse)):
    print(f"{name:>10}: {r['dram_bytes_read'] / 1e6:9.2f} MB DRAM read, {r['instructions'] / 1e6:9.2f} M warp instructions, "
          f"{r['bytes_per_instruction']:.2f} B/inst over {r['kernels']} kernels (source {r['source']})")
print(f"sparse/dense DRAM bytes: {sparse['dram_bytes_read'] / dense['dram_bytes_read']:.3f}")
PY
  fi
else
  log "SKIP ncu: Nsight Compute's ncu is not on PATH (set PRUNEWATCH_NCU to its path to measure DRAM bytes)"
fi
step bench-full-speed 300 check "$PY" -m prunewatch.bench.engine --device cuda --skip-quality --no-plot --out "$OUT_DIR/engine-cuda.json"
# Decode speed against the GPU's read bandwidth (prunewatch/bench/speed.py); informational, last, only with time left.
speed_args=()
[[ -f "$HOME/.cache/prunewatch/models/SmolLM2-135M-Instruct/config.json" ]] || speed_args=(--no-real)
step bench-decode-speed 240 info "$PY" -m prunewatch.bench.speed --device cuda ${speed_args[@]+"${speed_args[@]}"} \
  --out "$OUT_DIR/speed-cuda.json" --plot "$OUT_DIR/speed-cuda.png"

log "done in $((SECONDS - START_S)) s; results in $OUT_DIR"
if ((${#FAILURES[@]})); then
  log "FAILED: ${FAILURES[*]}"
  exit 1
fi
log "all checks passed"
