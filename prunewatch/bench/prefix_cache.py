"""Prefills with and without the prefix cache, on the batcher's stepper as `prunewatch serve` runs them.

Why: under load a prefill runs alone on the stepper while the decoding requests wait, so its time is what the cache
must shorten. A hit skips the head's work but the rest still pays a whole forward pass (every weight read, the
per-operator overhead); a head seen for the first time costs two passes (the head, then the rest), the price of
getting the same tokens hit or miss (prunewatch/engine/prefix_cache.py). This run measures both sides on the
held-out prompts as the load benchmark sends them (two thirds keep the template's default system prompt, the rest
bring their own, mostly once), and on the same questions behind one long application system prompt, with the
cache off, cold (every head computed) and as served (the engine's settings, carried from prompt to prompt), and as
served with heads of any length split off (prefix_cache_min_tokens 1). Rounds
interleave the configurations, so a slower minute of the host falls on all of them.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from prunewatch.bench._common import RESULTS_DIR, invocation, machine_info
from prunewatch.engine.model_store import DEFAULT_MODEL, models_root

REAL_MODEL_DIR = models_root() / DEFAULT_MODEL

CONFIGURATIONS = ("off", "cold", "served", "served, every head")
# An application's system prompt of about 240 tokens: the case a prefix cache is for.
LONG_SYSTEM = ("You are the support assistant of a hosting company. Answer questions about servers, networking, billing "
               "and account security. Keep answers short and practical, give commands when they help, and never ask "
               "for passwords. If a question is about a refund, explain the policy: refunds are possible within 30 "
               "days for annual plans and 7 days for monthly plans, prorated after that. ") * 3
METHOD = {
    "prefill_ms": "measured: the stepper's time in the request's prefill job (DecodeBatcher.stepper_time), one "
                  "request at a time, max_new_tokens 1; median and mean over the prompts and rounds",
    "cached_share": "measured: prompt tokens the prefix cache served over all prompt tokens",
    "vs_off": "measured: mean prefill_ms of the configuration over the cache off, same prompts, same run",
    "off": "prefix_cache_entries 0: every prompt prefilled in one pass",
    "cold": "the store emptied before each prompt: a head is computed (and stored) by its own pass, then the rest",
    "served": "the engine's prefix_cache_entries, the store carried from prompt to prompt after one pass over them",
    "served, every head": "as served, with prefix_cache_min_tokens 1: heads shorter than the setting split off too",
}


def prompt_sets() -> dict[str, list[list[dict[str, str]]]]:
    """The load benchmark's held-out chat prompts, and the same questions behind LONG_SYSTEM."""
    from prunewatch.bench.load import load_prompts

    held_out = load_prompts()
    behind_long = [[{"role": "system", "content": LONG_SYSTEM}, messages[-1]] for messages in held_out]
    return {"held-out": held_out, "long system prompt": behind_long}


def _prefill_ms(engine: Any, batcher: Any, messages: list[dict[str, str]]) -> tuple[float, int, int]:
    """(ms of the stepper in this request's prefill, prompt tokens, cached prompt tokens)."""
    before = batcher.stepper_time().jobs_s
    result = engine.generate(messages=messages, max_new_tokens=1, batcher=batcher)
    return ((batcher.stepper_time().jobs_s - before) * 1e3, result.stats.prompt_tokens,
            result.stats.cached_prompt_tokens)


def measure(engine: Any, batcher: Any, prompts: list[list[dict[str, str]]], rounds: int,
            progress: Any = None) -> dict[str, dict[str, Any]]:
    entries, min_tokens = engine.prefix_cache.max_entries, engine.prefix_cache.min_tokens
    samples: dict[str, list[float]] = {name: [] for name in CONFIGURATIONS}
    tokens = {name: [0, 0] for name in CONFIGURATIONS}
    for _ in range(rounds):
        for name in CONFIGURATIONS:
            engine.prefix_cache.max_entries = 0 if name == "off" else entries
            engine.prefix_cache.min_tokens = 1 if name == "served, every head" else min_tokens
            engine.prefix_cache.clear()
            if name.startswith("served"):
                for messages in prompts:  # one pass to fill the store, as a server that has run a while
                    engine.generate(messages=messages, max_new_tokens=1, batcher=batcher)
            for messages in prompts:
                if name == "cold":
                    engine.prefix_cache.clear()
                ms, prompt_tokens, cached = _prefill_ms(engine, batcher, messages)
                samples[name].append(ms)
                tokens[name][0] += prompt_tokens
                tokens[name][1] += cached
                if progress is not None:
                    progress.update(1)
    engine.prefix_cache.max_entries, engine.prefix_cache.min_tokens = entries, min_tokens
    off = statistics.fmean(samples["off"])
    return {name: {"prompts": len(prompts), "rounds": rounds,
                   "mean_prompt_tokens": round(tokens[name][0] / len(samples[name]), 1),
                   "cached_share": round(tokens[name][1] / tokens[name][0], 3),
                   "prefill_ms_median": round(statistics.median(samples[name]), 1),
                   "prefill_ms_mean": round(statistics.fmean(samples[name]), 1),
                   "vs_off": round(off / statistics.fmean(samples[name]), 3)}
            for name in CONFIGURATIONS}


def run(model_dir: Path, *, rounds: int, threads: int, out: Path) -> dict[str, Any]:
    import torch
    from tqdm import tqdm

    from prunewatch.server.run import build_engine

    torch.set_num_threads(threads)
    engine = build_engine(model_dir)
    torch.set_num_threads(1)  # this thread only detokenizes, as serve's request threads do: one OpenMP team
    batcher = engine.new_batcher(4, threads=threads)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": invocation("prefix-cache"),
        "machine": machine_info(),
        "model": {"name": model_dir.name, "path": str(model_dir)},
        "threads": threads, "prefix_cache_entries": engine.prefix_cache.max_entries,
        "prefix_cache_min_tokens": engine.prefix_cache.min_tokens,
        "method": METHOD, "sets": {},
    }
    try:
        sets = prompt_sets()
        with tqdm(total=sum(len(p) for p in sets.values()) * rounds * len(CONFIGURATIONS), unit="prefill",
                  desc="prefills", file=sys.stderr) as progress:
            for name, prompts in sets.items():
                result["sets"][name] = measure(engine, batcher, prompts, rounds, progress)
    finally:
        batcher.close()
    result["duration_s"] = round(time.perf_counter() - started, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def format_table(result: dict[str, Any]) -> str:
    lines = ["| prompts | prefix cache | prompt tokens | served from the cache | prefill ms median / mean | "
             "speedup vs off |", "|---|---|---:|---:|---:|---:|"]
    for set_name, rows in result["sets"].items():
        for name in CONFIGURATIONS:
            row = rows[name]
            lines.append(f"| {set_name} | {name} | {row['mean_prompt_tokens']:.1f} | {row['cached_share']:.0%} | "
                         f"{row['prefill_ms_median']:.1f} / {row['prefill_ms_mean']:.1f} | {row['vs_off']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(prog="prunewatch bench prefix-cache", description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=REAL_MODEL_DIR)
    parser.add_argument("--rounds", type=int, default=2, help="passes over each prompt set per configuration")
    parser.add_argument("--threads", type=int, default=None, help="the stepper's threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "prefix-cache-cpu.json")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if not (args.model_dir / "config.json").is_file():
        parser.error(f"no model at {args.model_dir} (run `prunewatch models pull`)")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", stream=sys.stderr)
    result = run(args.model_dir, rounds=args.rounds, threads=args.threads or torch.get_num_threads(), out=args.out)
    print(format_table(result))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
