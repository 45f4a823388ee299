"""What activation sparsity keeps in a batch: `prunewatch bench batch-sparsity` (or `python -m
prunewatch.bench.batch_sparsity`).

b requests (b = 1, 2, 4, 8) decode the same fixed number of tokens together through one continuous batcher
(prunewatch/engine/batching.py), each on its own thread as `serve` runs them, three ways in the same run, their order
alternating from level to level:
- dense: every request at sensitivity 0;
- union: every request at the default pruning, and steps of up to 8 rows keep it (each layer at the rows' lowest
  target, the kernel reading the union of the rows' active channels);
- policy: the default pruning under the server's policy (`sparse_rows` 1: steps of more than one row run dense).
Per level and way: aggregate decode tokens/s over the b requests (wall clock from the first request's start to
the last one's end, prefills included) and the requests' mean decode pruning ratio (the engine's own count).
Union against dense is what pruning is worth at batch b; the policy line is what `serve` does.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from prunewatch.bench._common import RESULTS_DIR, invocation, machine_info
from prunewatch.engine.model_store import DEFAULT_MODEL, models_root

logger = logging.getLogger("prunewatch.bench.batch_sparsity")

WAYS = ("dense", "union", "policy")
SPARSE_ROWS = {"dense": 1, "union": 8, "policy": 1}
METHOD = {
    "aggregate_tokens_per_s": "measured: decode tokens of the b requests over the wall clock from the first start to "
                              "the last end (prefills included)",
    "decode_pruning_ratio": "measured by the engine: mean over the b requests of 1 - executed / dense linear FLOPs "
                            "of their decode steps (a batched step's work split equally among its rows)",
    "mean_batch_size": "measured by the engine: mean over the requests of the rows per decode step they ran in",
    "vs_dense": "measured: aggregate_tokens_per_s over dense's at the same b, same run",
}


def _prompts(count: int) -> list[str]:
    from prunewatch.probes import EVALUATION_PATH, load_probes

    prompts = [p.prompt for p in load_probes(EVALUATION_PATH).probes]
    return [prompts[i % len(prompts)] for i in range(count)]


def run_level(engine: Any, way: str, prompts: list[str], tokens: int, threads: int | None) -> dict[str, Any]:
    """b = len(prompts) requests decoding `tokens` tokens each, together, one of the WAYS."""
    from prunewatch.engine.execution import ExecutionPlan

    ids = [engine.render_prompt(p) for p in prompts]
    plans = [ExecutionPlan() if way == "dense" else
             engine.execution_plan(i, engine.settings.sensitivity, list(engine.settings.layer_blacklist),
                                   prompt_text=p) for i, p in zip(ids, prompts, strict=True)]
    batcher = engine.new_batcher(max(8, len(prompts)), threads, sparse_rows=SPARSE_ROWS[way])
    results: list[Any] = [None] * len(prompts)

    def decode(index: int) -> None:
        torch.set_num_threads(1)  # as serve's request threads: the stepper holds the cores
        try:
            results[index] = engine.measure_decode(ids[index], plans[index], tokens, batcher=batcher)
        except BaseException as exc:  # re-raised below, on the caller's thread
            results[index] = exc

    workers = [threading.Thread(target=decode, args=(i,)) for i in range(len(prompts))]
    started = time.perf_counter()
    try:
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        batcher.close()
    seconds = time.perf_counter() - started
    for result in results:
        if isinstance(result, BaseException):
            raise result
    decoded = sum(len(r.tokens) - 1 for r in results)
    return {
        "batch": len(prompts),
        "way": way,
        "aggregate_tokens_per_s": round(decoded / seconds, 3),
        "decode_pruning_ratio": round(statistics.fmean(r.ledger.decode_pruning_ratio for r in results), 4),
        "mean_batch_size": round(statistics.fmean(r.ledger.mean_batch_size for r in results), 2),
    }


def measure(model_dir: Path, batches: list[int], tokens: int, threads: int | None,
            calibration_dir: Path | None) -> dict[str, Any]:
    from prunewatch.engine.threads import release_openmp_team
    from prunewatch.server.run import build_engine

    started = time.perf_counter()
    engine = build_engine(model_dir, device="cpu", calibration_dir=calibration_dir, threads=threads)
    release_openmp_team()
    rows: list[dict[str, Any]] = []
    for level, batch in enumerate(batches):
        prompts = _prompts(batch)
        order = WAYS if level % 2 == 0 else tuple(reversed(WAYS))
        measured = {way: run_level(engine, way, prompts, tokens, threads) for way in order}
        for way in WAYS:
            row = measured[way]
            row["vs_dense"] = round(row["aggregate_tokens_per_s"] / measured["dense"]["aggregate_tokens_per_s"], 3)
            rows.append(row)
            logger.info("b=%d %-6s %.1f tok/s (%.2fx dense) decode ratio %.3f, %.2f rows per step", batch, way,
                        row["aggregate_tokens_per_s"], row["vs_dense"], row["decode_pruning_ratio"],
                        row["mean_batch_size"])
    return {
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": invocation("batch-sparsity"),
        "machine": machine_info("cpu"),
        "model": engine.name,
        "sensitivity": engine.settings.sensitivity,
        "tokens": tokens,
        "threads": threads or torch.get_num_threads(),
        "ways": {"dense": "sensitivity 0", "union": "default pruning kept in steps of up to 8 rows",
                 "policy": "default pruning, steps of more than one row dense (serve's policy)"},
        "method": METHOD,
        "rows": rows,
        "duration_s": round(time.perf_counter() - started, 1),
    }


def format_table(result: dict[str, Any]) -> str:
    lines = ["| batch | way | aggregate tok/s | vs dense | decode pruning ratio | rows per step |",
             "|---:|---|---:|---:|---:|---:|"]
    for row in result["rows"]:
        lines.append(f"| {row['batch']} | {row['way']} | {row['aggregate_tokens_per_s']:.1f} | {row['vs_dense']:.2f}x | "
                     f"{row['decode_pruning_ratio']:.3f} | {row['mean_batch_size']:.2f} |")
    return "\n".join(lines)


def _batches(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"batches must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 or v > 64 for v in values):
        raise argparse.ArgumentTypeError(f"batches must be within 1..64, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prunewatch bench batch-sparsity", description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=models_root() / DEFAULT_MODEL)
    parser.add_argument("--batches", type=_batches, default=[1, 2, 4, 8], help="batch sizes (default 1,2,4,8)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens each request decodes (default 32)")
    parser.add_argument("--threads", type=int, default=None, help="the stepper's intra-op threads (default: torch's)")
    parser.add_argument("--calibration-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "batch-sparsity-cpu.json")
    args = parser.parse_args(argv)
    if args.tokens < 2:
        parser.error("--tokens must be at least 2")
    if not (args.model_dir / "config.json").is_file():
        parser.error(f"no model at {args.model_dir} (run `prunewatch models pull`)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = measure(args.model_dir, args.batches, args.tokens, args.threads, args.calibration_dir)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(format_table(result))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
