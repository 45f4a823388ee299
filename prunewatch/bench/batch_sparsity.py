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

Then the quality `serve` delivers at the default: every held-out evaluation prompt answered alone, and `--quality-batch`
at a time through the same policy, each answer scored by the dense model (reference-scored agreement, pooled over
answer tokens, with its 95% bootstrap interval over prompts).
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
from prunewatch.bench.mechanisms import interval_text
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
    "agreement": "measured: share of the served answers' tokens that are the dense model's argmax given the answer "
                 "so far (teacher-forced), pooled over the evaluation prompts; low/high: 95% bootstrap interval over "
                 "prompts",
    "changed_vs_alone": "measured: share of prompts whose served answer differs from the one served alone",
}


def _prompts(count: int) -> list[str]:
    from prunewatch.probes import EVALUATION_PATH, load_probes

    prompts = [p.prompt for p in load_probes(EVALUATION_PATH).probes]
    return [prompts[i % len(prompts)] for i in range(count)]


def run_level(engine: Any, way: str, prompts: list[str], tokens: int, threads: int | None) -> dict[str, Any]:
    """b = len(prompts) requests decoding `tokens` tokens each, together, one of the WAYS."""
    from prunewatch.engine.execution import ExecutionPlan

    ids = [engine.render_prompt(p) for p in prompts]
    batcher = engine.new_batcher(max(8, len(prompts)), threads, sparse_rows=SPARSE_ROWS[way])
    results: list[Any] = [None] * len(prompts)

    def decode(index: int) -> None:
        torch.set_num_threads(1)  # as serve's request threads: the stepper holds the cores
        try:
            # Planned here, as serve plans on the request's thread: planned on this process's main thread (torch's
            # threads), its small tensor operators would start an OpenMP team beside the stepper's, and two teams on
            # the cores make GNU OpenMP sleep and wake its threads at every parallel region of every later step
            # (prunewatch/engine/threads.py), slowing each level after the first pruned one by about a quarter.
            plan = ExecutionPlan() if way == "dense" else engine.execution_plan(
                ids[index], engine.settings.sensitivity, list(engine.settings.layer_blacklist),
                prompt_text=prompts[index])
            results[index] = engine.measure_decode(ids[index], plan, tokens, batcher=batcher)
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


def _serve_group(engine: Any, batcher: Any, group: list[Any], max_new_tokens: int) -> list[Any]:
    """The default's answers to `group` (evaluation probes), generated together through `batcher`."""
    results: list[Any] = [None] * len(group)

    def serve(index: int) -> None:
        torch.set_num_threads(1)
        probe = group[index]
        try:
            results[index] = engine.generate(probe.prompt, system=probe.system or None, batcher=batcher,
                                             max_new_tokens=min(probe.max_tokens, max_new_tokens))
        except BaseException as exc:  # re-raised below, on the caller's thread
            results[index] = exc

    workers = [threading.Thread(target=serve, args=(i,)) for i in range(len(group))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def measure_quality(engine: Any, batch: int, max_new_tokens: int, probes: int | None,
                    threads: int | None) -> list[dict[str, Any]]:
    """Reference-scored agreement of the default's served answers, alone and `batch` at a time (serve's policy)."""
    from tqdm import tqdm

    from prunewatch.engine.quality import score_served
    from prunewatch.probes import EVALUATION_PATH, load_probes
    from prunewatch.records.intervals import bootstrap_share

    chosen = list(load_probes(EVALUATION_PATH).probes)
    chosen = chosen[:probes] if probes else chosen
    answers: dict[int, list[Any]] = {}
    with tqdm(total=2 * len(chosen), desc="batched quality", unit="answer", file=sys.stderr) as bar:
        for size in (1, batch):
            batcher = engine.new_batcher(max(8, size), threads)
            try:
                answers[size] = []
                for start in range(0, len(chosen), size):
                    answers[size].extend(_serve_group(engine, batcher, chosen[start:start + size], max_new_tokens))
                    bar.update(len(chosen[start:start + size]))
            finally:
                batcher.close()
    rows = []
    for size, results in answers.items():
        pairs = []
        for probe, result in zip(chosen, results, strict=True):
            ids = engine.render_prompt(probe.prompt, system=probe.system or None)
            score = score_served(engine.loaded.model, ids, list(result.served_ids or []), engine.loaded.device)
            if score is not None:
                pairs.append((score.matches, score.tokens))
        interval = bootstrap_share([m for m, _ in pairs], [t for _, t in pairs])
        rows.append({
            "batch": size,
            "agreement": round(interval.estimate, 4) if interval else None,
            "agreement_low": round(interval.low, 4) if interval else None,
            "agreement_high": round(interval.high, 4) if interval else None,
            "prompts": interval.prompts if interval else 0,
            "answer_tokens": interval.tokens if interval else 0,
            "decode_pruning_ratio": round(statistics.fmean(r.stats.decode_pruning_ratio for r in results), 4),
            "mean_batch_size": round(statistics.fmean(r.stats.mean_batch_size for r in results), 2),
            "changed_vs_alone": round(statistics.fmean(
                a.token_ids != b.token_ids for a, b in zip(answers[1], results, strict=True)), 4),
        })
    return rows


def measure(model_dir: Path, batches: list[int], tokens: int, threads: int | None,
            calibration_dir: Path | None, quality_batch: int = 0, max_new_tokens: int = 64,
            probes: int | None = None) -> dict[str, Any]:
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
    quality = measure_quality(engine, quality_batch, max_new_tokens, probes, threads) if quality_batch > 1 else []
    for row in quality:
        logger.info("served %d at a time: agreement %.3f [%.3f, %.3f], decode ratio %.3f, %.2f rows per step, "
                    "%.2f of answers changed", row["batch"], row["agreement"], row["agreement_low"],
                    row["agreement_high"], row["decode_pruning_ratio"], row["mean_batch_size"],
                    row["changed_vs_alone"])
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
        "max_new_tokens": max_new_tokens,
        "quality": quality,
        "duration_s": round(time.perf_counter() - started, 1),
    }


def format_table(result: dict[str, Any]) -> str:
    lines = ["| batch | way | aggregate tok/s | vs dense | decode pruning ratio | rows per step |",
             "|---:|---|---:|---:|---:|---:|"]
    for row in result["rows"]:
        lines.append(f"| {row['batch']} | {row['way']} | {row['aggregate_tokens_per_s']:.1f} | {row['vs_dense']:.2f}x | "
                     f"{row['decode_pruning_ratio']:.3f} | {row['mean_batch_size']:.2f} |")
    if result.get("quality"):
        lines += ["", "| served at a time | agreement [95% CI] | prompts / tokens | decode pruning ratio | rows per step | "
                      "answers changed vs alone |", "|---:|---:|---:|---:|---:|---:|"]
        for row in result["quality"]:
            agreement = interval_text(row["agreement"], row["agreement_low"], row["agreement_high"])
            lines.append(f"| {row['batch']} | {agreement} | {row['prompts']} / {row['answer_tokens']} | "
                         f"{row['decode_pruning_ratio']:.3f} | {row['mean_batch_size']:.2f} | "
                         f"{row['changed_vs_alone']:.2f} |")
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
    parser.add_argument("--quality-batch", type=int, default=4,
                        help="serve the evaluation prompts alone and this many at a time, scored by the dense model "
                             "(default 4; 0 skips)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="longest answer in the quality part (default 64)")
    parser.add_argument("--probes", type=int, default=None, help="first N evaluation prompts (default: all)")
    parser.add_argument("--calibration-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "batch-sparsity-cpu.json")
    args = parser.parse_args(argv)
    if args.tokens < 2:
        parser.error("--tokens must be at least 2")
    if args.quality_batch < 0 or args.quality_batch == 1 or args.max_new_tokens < 1 or (
            args.probes is not None and args.probes < 1):
        parser.error("--quality-batch must be 0 or >= 2, --max-new-tokens and --probes >= 1")
    if not (args.model_dir / "config.json").is_file():
        parser.error(f"no model at {args.model_dir} (run `prunewatch models pull`)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = measure(args.model_dir, args.batches, args.tokens, args.threads, args.calibration_dir,
                     args.quality_batch, args.max_new_tokens, args.probes)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(format_table(result))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
