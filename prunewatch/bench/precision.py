"""Precision x sparsity: `prunewatch bench precision` (or `python -m prunewatch.bench.precision`).

One run, one machine, the same threads, on the real model (SmolLM2-135M-Instruct by default):
1. three engines of the same model, fp32, int8 and int4 weights (EngineSettings.weights;
   prunewatch/engine/sparse/quantize.py), each at sensitivity 0 (dense) and at its default operating point;
2. decode speed: each of the six configurations greedy-decodes the same prompt for `--tokens` tokens
   (end of sequence ignored), `--rounds` times in rotating order; tokens/s as the median over rounds, the
   speedups both as a ratio of medians and within rounds (median of each round's ratio, which a load
   slowing the whole round cancels), and the weight and KV bytes a decode step reads from the ledger; the
   same six again with compiled decode steps (prunewatch.engine.compiled_decode; graphs compiled in the
   warm-up, untimed; --no-compiled skips them), each with the share of its tokens equal to its eager run's;
3. quality: every prompt of the held-out evaluation set (prunewatch/probes/evaluation.yaml, never
   calibrated on) served by each configuration, interleaved, and each served answer scored by the fp32
   dense model (reference-scored agreement: the share of answer tokens equal to fp32 dense's argmax given
   the served prefix), pooled over prompts with a 95% interval bootstrapped over prompts; the prompts'
   checks give a pass rate likewise;
4. served: each precision through `prunewatch serve --weights <precision>` on 127.0.0.1 (same threads, eager),
   dense and default, streamed and timed by the client, in the same rounds, with the ratio to the same
   configuration in-process (--no-served skips it);
5. with `--peer llama.cpp`: llama.cpp's llama-bench on the same model (F32, Q8_0 and Q4_1 GGUFs made from the
   one `models pull` keeps; prunewatch/bench/llama_cpp.py), same threads and decoded tokens, taking its turn in
   the same rotating rounds; each engine configuration's ratio to it within rounds.

Writes JSON and a PNG (speedup over fp32 dense against agreement, with intervals) to bench/results and
prints a table. Tests never assert timings: tests/engine/test_precision_bench.py checks structure on the
probe model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prunewatch.bench._common import RESULTS_DIR, invocation, machine_info
from prunewatch.bench.llama_cpp import (
    PEER_TYPES,
    LlamaCpp,
    PeerCrashedError,
    PeerUnavailableError,
    bench_command,
    peer_gguf,
    report,
    run_tool,
)
from prunewatch.bench.llama_cpp import decode_rate as peer_decode_rate
from prunewatch.bench.mechanisms import QUALITY_TARGET
from prunewatch.bench.served import ServedModel
from prunewatch.bench.speed import paired_ratio
from prunewatch.bench.step_products import StepProducts, capture_checked, median_ms, time_replay
from prunewatch.engine.model_store import DEFAULT_MODEL, models_root
from prunewatch.records.intervals import bootstrap_rate, bootstrap_share

if TYPE_CHECKING:
    from prunewatch.engine.pruning_engine import PruningEngine

logger = logging.getLogger("prunewatch.bench.precision")

PROMPT = "Explain how a CPU cache works, step by step, for a new programmer."
REAL_MODEL_DIR = models_root() / DEFAULT_MODEL
PRECISIONS = ("fp32", "int8", "int4")
PLANS = ("dense", "default")
MODES = ("eager", "compiled")
REPLAYS = 5  # replays of a step's products after each round's run; their median
METHOD = {
    "tokens_per_s": "measured: decode tokens/s (wall clock of the decode steps), median over rounds in rotating order",
    "speedup_vs_fp32_dense": "measured: ratio of median tokens/s to fp32 dense's; _paired: median over rounds of the "
                             "ratio within a round",
    "speedup_vs_same_precision_dense": "measured: the same against the dense configuration of the same precision",
    "bytes_per_token": "counted: weight and KV bytes one decode step reads (execution ledger), not estimated",
    "agreement": "measured: reference-scored agreement of the served answers against the fp32 dense model (share of "
                 "answer tokens equal to its argmax given the served prefix), pooled over the evaluation prompts; "
                 "agreement_low / _high: 95% interval bootstrapped over prompts",
    "pass_rate": "measured: share of the prompts with a check whose served answer passed it, 95% interval likewise",
    "changed_answers": "measured: share of prompts whose served answer differs from fp32 dense's",
    "agreement_with_eager": "measured: share of a compiled run's speed-prompt tokens equal to the eager run's; "
                            "quality is measured on the eager runs",
    "products_ms": "measured: an eager step's weight products (every projection and the output head, on the inputs "
                   "one real step gave them, under its plan) replayed alone right after each round's run, median of "
                   f"{REPLAYS} replays, median over rounds (prunewatch/bench/step_products.py)",
    "rest_ms": "measured: 1000 / tokens_per_s minus products_ms within each round, median over rounds: norms, attention, "
               "rotary embeddings, cache updates, sampling and Python around every operator",
}
SERVED_METHOD = {
    "tokens_per_s": "measured by the client: `prunewatch serve --weights <precision>` on 127.0.0.1 (same threads, "
                    "eager decode), one streamed chat completion of the speed prompt per round, (text chunks - 1) over "
                    "the first to the last chunk's arrival (prunewatch/bench/served.py), median over rounds; dense runs "
                    "send X-Pruning-Sensitivity: 0",
    "vs_in_process_paired": "measured: median over rounds of the served rate over the same precision and plan "
                            "decoded eagerly in this process's main thread in the same round",
}
PEER_METHOD = {
    "tokens_per_s": "measured by llama-bench (its own timer of the decode of the same number of tokens after a "
                    "context of the speed prompt's length), one repetition per round in the engine's rotation, "
                    "median over rounds",
    "engine_<plan>_<mode>_vs_llama_cpp": "measured: median over rounds of the engine configuration's tokens/s over "
                                         "llama.cpp's in the same round, at the corresponding precision",
}


@dataclass
class PrecisionRow:
    """One configuration: a precision at one plan, its speed and the quality of what it served."""

    precision: str
    plan: str
    mode: str  # eager or compiled decode steps
    tokens_per_s: float
    tokens_per_s_min: float
    tokens_per_s_max: float
    rounds: list[float]
    bytes_per_token: int
    decode_pruning_ratio: float
    speedup_vs_fp32_dense: float
    speedup_vs_fp32_dense_paired: float
    speedup_vs_same_precision_dense: float
    speedup_vs_same_precision_dense_paired: float
    agreement: float | None
    agreement_low: float | None
    agreement_high: float | None
    prompts: int
    answer_tokens: int
    pass_rate: float | None
    pass_low: float | None
    pass_high: float | None
    checked: int
    changed_answers: float
    agreement_with_eager: float | None = None  # compiled runs: share of tokens equal to the eager run's
    products_ms: float | None = None  # eager runs: the step's weight products replayed alone, median over rounds
    rest_ms: float | None = None  # eager runs: step time minus its products, median over rounds


def _engine(model_dir: Path, weights: str, calibration_dir: Path | None) -> PruningEngine:
    from prunewatch.engine import EngineSettings, PruningEngine
    from prunewatch.probes import load_calibration_set

    engine = PruningEngine.load(EngineSettings(model_dir=model_dir, device="cpu", log_level="NONE", weights=weights,
                                               calibration_dir=calibration_dir))
    probe_set = load_calibration_set()
    engine.load_or_calibrate(probe_set.calibration_texts(), probe_set.digest)
    return engine


def _plan(engine: PruningEngine, name: str, prompt_ids: list[int], prompt: str):
    from prunewatch.engine.execution import ExecutionPlan

    if name == "dense":
        return ExecutionPlan()
    return engine.execution_plan(prompt_ids, engine.settings.sensitivity, list(engine.settings.layer_blacklist),
                                 prompt_text=prompt)


def measure_speed(engines: dict[str, PruningEngine], tokens: int, rounds: int, compiled: bool,
                  peer: PeerRuns | None = None, servers: dict[str, ServedModel] | None = None) -> dict[str, dict]:
    """Decode tokens/s and counted bytes per step of every (precision, plan, mode), rounds in rotating order;
    with a peer, its run at each precision takes its turn in the same rotation (plan "llama.cpp"); with servers
    (one `prunewatch serve` per precision), each plan served, streamed and client-timed, takes its turn too
    (mode "served"; returned under "served" rather than as rows of their own)."""
    names = [(p, plan, mode) for mode in (MODES if compiled else MODES[:1]) for p in engines for plan in PLANS]
    runs = {}
    for precision, plan_name, mode in names:
        engine = engines[precision]
        ids = engine.render_prompt(PROMPT)
        runs[(precision, plan_name, mode)] = (engine, ids, _plan(engine, plan_name, ids, PROMPT), mode == "compiled")
    for engine, ids, plan, graph in runs.values():  # warm-up: allocations, thread pools, caches, graphs
        engine.measure_decode(ids, plan, min(tokens, 8), compiled=graph)
        if graph and engine.compiled_decode(True) is None:
            raise RuntimeError(f"the compiled decode step failed to compile: {engine.compiled_decode_failure}")
    # Where an eager step's time goes (prunewatch.bench.step_products): its weight products replayed alone right
    # after each round's run, so they meet that run's load; the rest of the step is its time minus them.
    products = {name: _capture(runs[name][0], runs[name][1], runs[name][2], " ".join(name))
                for name in names if name[2] == "eager"}
    products_ms: dict[tuple[str, str, str], list[float]] = {name: [] for name in products}
    peer_names = [(p, PEER, "eager") for p in peer.ggufs] if peer is not None else []
    served_names = [(p, plan, "served") for p in (servers or {}) for plan in PLANS]
    order = names + peer_names + served_names
    rates: dict[tuple[str, str, str], list[float]] = {name: [] for name in order}
    measured: dict[tuple[str, str, str], dict] = {}
    for r in range(rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            if name[1] == PEER:
                assert peer is not None
                rates[name].append(peer.decode_rate(name[0], tokens - 1))
                continue
            if name[2] == "served":
                assert servers is not None
                rates[name].append(servers[name[0]].decode(PROMPT, tokens, dense=name[1] == "dense").tokens_per_s)
                continue
            engine, ids, plan, graph = runs[name]
            decode = engine.measure_decode(ids, plan, tokens, compiled=graph)
            rates[name].append((tokens - 1) / decode.decode_s)
            if name in products:
                products_ms[name].append(median_ms(time_replay(products[name], _executing(engine.eager_step_plan(plan)),
                                                               REPLAYS)))
            measured[name] = {"bytes_per_token": decode.ledger.decode_bytes_read // (tokens - 1),
                              "decode_pruning_ratio": decode.ledger.decode_pruning_ratio, "tokens": decode.tokens}
        logger.info("round %d: %s", r + 1, {" ".join(k): round(v[-1], 2) for k, v in rates.items()})
    if peer is not None:
        peer.rates = {p: rates[(p, PEER, "eager")] for p in peer.ggufs}
    for (precision, plan, mode), values in measured.items():
        if mode == "compiled":
            eager = measured[(precision, plan, "eager")]["tokens"]
            values["agreement_with_eager"] = round(sum(a == b for a, b in zip(values["tokens"], eager)) / len(eager), 4)
    speed = {" ".join(name): {"rates": rates[name], **measured[name]} for name in names}
    for name, replayed in products_ms.items():
        speed[" ".join(name)]["products_ms"] = replayed
    if served_names:
        speed["served"] = {" ".join(name): rates[name] for name in served_names}
    return speed


def served_rows(speed: dict[str, dict]) -> list[dict]:
    """Per served (precision, plan): client-timed tokens/s and its ratio to the same configuration in-process
    (eager, the main thread), median over rounds of the within-round ratio."""
    rows = []
    for name, values in speed.get("served", {}).items():
        precision, plan, _ = name.split(" ")
        in_process = speed[f"{precision} {plan} eager"]["rates"]
        rows.append({"precision": precision, "plan": plan, "tokens_per_s": round(statistics.median(values), 3),
                     "rounds": [round(v, 3) for v in values],
                     "vs_in_process": round(statistics.median(values) / statistics.median(in_process), 4),
                     "vs_in_process_paired": round(paired_ratio(values, in_process), 4)})
    return rows


def _capture(engine: PruningEngine, ids: list[int], plan, label: str) -> StepProducts:
    """The weight products of one eager decode step of `engine` under `plan`, checked to replay exactly."""
    return capture_checked(engine.loaded.model, lambda: engine.measure_decode(ids, plan, 3, compiled=False),
                           _executing(engine.eager_step_plan(plan)), label)


def _executing(plan):
    """A context factory running one replay under `plan` (the engine's eager step plan), as the step ran."""
    from prunewatch.engine.execution import ExecutionLedger, executing

    return lambda: executing(plan, ExecutionLedger())


PEER = "llama.cpp"


@dataclass
class PeerRuns:
    """llama.cpp's llama-bench at the precision matching each engine precision, in the engine's rounds."""

    llama: LlamaCpp
    ggufs: dict[str, Path]  # engine precision -> GGUF at the matching llama.cpp type
    threads: int
    depth: int  # context tokens before the timed decode: the engine's speed prompt length
    repack: bool = True
    rates: dict[str, list[float]] | None = None

    def command(self, precision: str, decoded: int) -> list[str]:
        return bench_command(self.llama, self.ggufs[precision], self.threads, decoded, self.depth, 1, self.repack)

    def decode_rate(self, precision: str, decoded: int) -> float:
        return peer_decode_rate(run_tool(self.command(precision, decoded)))

    def check(self) -> None:
        """Decode two tokens at every precision before the rounds, so that a llama-bench that cannot run here
        fails the benchmark in seconds rather than after the engine's first round. With repacking on, a crash
        says to turn it off: llama.cpp's repacked quantized paths crash on some CPUs (llama-bench was killed by
        SIGSEGV on an AVX512-VNNI Xeon, minutes into a run, before this check)."""
        for precision in self.ggufs:
            try:
                self.decode_rate(precision, 2)
            except PeerCrashedError as exc:
                if not self.repack:
                    raise
                raise PeerCrashedError(f"{exc}; llama.cpp's weight repacking crashes on some CPUs: run again "
                                       "with --peer-no-repack") from exc

    def rows(self, speed: dict[str, dict], decoded: int) -> list[dict]:
        """Per precision: llama.cpp's tokens/s and the engine's dense and default against it, within rounds."""
        rows = []
        for precision, values in (self.rates or {}).items():
            row: dict = {"precision": precision, "llama_cpp_type": PEER_TYPES[precision],
                         "gguf": self.ggufs[precision].name, "tokens_per_s": round(statistics.median(values), 3),
                         "rounds": [round(v, 3) for v in values], "command": " ".join(self.command(precision, decoded))}
            for plan in PLANS:
                for mode in MODES:
                    ours = speed.get(f"{precision} {plan} {mode}")
                    if ours is not None:
                        row[f"engine_{plan}_{mode}_vs_llama_cpp"] = round(paired_ratio(ours["rates"], values), 4)
            rows.append(row)
        return rows


def prepare_peer(engines: dict[str, PruningEngine], model_dir: Path, llama_cpp_dir: Path | None,
                 threads: int, repack: bool) -> PeerRuns:
    """llama.cpp's GGUFs for every engine precision, made from the GGUF `models pull` kept with the model."""
    from prunewatch.engine.model_store import source_gguf

    llama = LlamaCpp.find(llama_cpp_dir)
    source = source_gguf(model_dir)
    if source is None:
        raise PeerUnavailableError(f"{model_dir} holds no source GGUF for llama.cpp to run: models pulled "
                                   "before the GGUF was kept need `prunewatch models pull` again")
    ggufs = {p: peer_gguf(llama, source, p) for p in engines}
    depth = len(engines["fp32"].render_prompt(PROMPT))
    runs = PeerRuns(llama=llama, ggufs=ggufs, threads=threads, depth=depth, repack=repack)
    runs.check()
    return runs


def measure_quality(engines: dict[str, PruningEngine], max_new_tokens: int, probes: int | None) -> dict[str, dict]:
    """Every evaluation prompt served by every (precision, plan), interleaved; each answer scored by fp32 dense."""
    from tqdm import tqdm

    from prunewatch.bench.mechanisms import interleaved
    from prunewatch.engine.quality import score_served
    from prunewatch.probes import EVALUATION_PATH, load_probes

    reference = engines["fp32"]
    chosen = load_probes(EVALUATION_PATH).probes
    chosen = chosen[:probes] if probes else chosen
    configs = [(p, plan) for p in engines for plan in PLANS]
    served: dict[tuple[str, str], dict[str, tuple[list[int], bool | None]]] = {c: {} for c in configs}
    scores: dict[tuple[str, str], list[tuple[int, int]]] = {c: [] for c in configs}
    with tqdm(total=len(chosen) * len(configs), desc="precision quality", unit="request", file=sys.stderr) as bar:
        for probe, (precision, plan) in interleaved(chosen, configs):
            engine = engines[precision]
            result = engine.generate(probe.prompt, system=probe.system or None, quality="off",
                                     max_new_tokens=min(probe.max_tokens, max_new_tokens),
                                     sensitivity=0.0 if plan == "dense" else engine.settings.sensitivity)
            answer = list(result.served_ids or [])
            passed = probe.check.passed(result.text) if probe.check is not None else None
            served[(precision, plan)][probe.id] = (answer, passed)
            prompt_ids = reference.render_prompt(probe.prompt, system=probe.system or None)
            score = score_served(reference.loaded.model, prompt_ids, answer, reference.loaded.device)
            if score is not None:
                scores[(precision, plan)].append((score.matches, score.tokens))
            bar.update(1)
    baseline = {pid: answer for pid, (answer, _) in served[("fp32", "dense")].items()}
    quality = {}
    for precision, plan in configs:
        pairs = scores[(precision, plan)]
        interval = bootstrap_share([m for m, _ in pairs], [t for _, t in pairs])
        rate = bootstrap_rate([p for _, p in served[(precision, plan)].values() if p is not None])
        quality[f"{precision} {plan}"] = {
            "agreement": round(interval.estimate, 4) if interval else None,
            "agreement_low": round(interval.low, 4) if interval else None,
            "agreement_high": round(interval.high, 4) if interval else None,
            "prompts": interval.prompts if interval else 0, "answer_tokens": interval.tokens if interval else 0,
            "pass_rate": round(rate.estimate, 4) if rate else None, "pass_low": round(rate.low, 4) if rate else None,
            "pass_high": round(rate.high, 4) if rate else None, "checked": rate.prompts if rate else 0,
            "changed_answers": round(statistics.fmean(
                answer != baseline.get(pid) for pid, (answer, _) in served[(precision, plan)].items()), 4),
        }
    return quality


def rows_of(speed: dict[str, dict], quality: dict[str, dict]) -> list[PrecisionRow]:
    """One row per configuration, speedups against fp32 dense and against the same precision's dense, both in
    the same mode (eager against eager, compiled against compiled); quality is the eager run's."""
    speed = {name: s for name, s in speed.items() if name != "served"}
    medians = {name: statistics.median(s["rates"]) for name, s in speed.items()}
    rows = []
    for name, s in speed.items():
        precision, plan, mode = name.split(" ")
        fp32_dense, own_dense = f"fp32 dense {mode}", f"{precision} dense {mode}"
        rows.append(PrecisionRow(
            precision=precision, plan=plan, mode=mode, tokens_per_s=round(medians[name], 3),
            tokens_per_s_min=round(min(s["rates"]), 3), tokens_per_s_max=round(max(s["rates"]), 3),
            rounds=[round(v, 3) for v in s["rates"]], bytes_per_token=int(s["bytes_per_token"]),
            decode_pruning_ratio=round(s["decode_pruning_ratio"], 4),
            speedup_vs_fp32_dense=round(medians[name] / medians[fp32_dense], 4),
            speedup_vs_fp32_dense_paired=round(paired_ratio(s["rates"], speed[fp32_dense]["rates"]), 4),
            speedup_vs_same_precision_dense=round(medians[name] / medians[own_dense], 4),
            speedup_vs_same_precision_dense_paired=round(paired_ratio(s["rates"], speed[own_dense]["rates"]), 4),
            agreement_with_eager=s.get("agreement_with_eager"), **quality[f"{precision} {plan}"],
            **_step_split(s)))
    return rows


def _step_split(speed: dict) -> dict[str, Any]:
    """products_ms and rest_ms of an eager run (empty for a compiled one): medians over rounds."""
    if "products_ms" not in speed:
        return {}
    rest = [1e3 / rate - replayed for rate, replayed in zip(speed["rates"], speed["products_ms"])]
    return {"products_ms": round(statistics.median(speed["products_ms"]), 3), "rest_ms": round(statistics.median(rest), 3)}


def run(model_dir: Path, *, tokens: int, rounds: int, max_new_tokens: int, probes: int | None,
        calibration_dir: Path | None, threads: int | None, out: Path, plot: Path | None, compiled: bool = True,
        peer: str | None = None, llama_cpp_dir: Path | None = None, peer_repack: bool = True,
        served: bool = True) -> dict:
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    started = time.time()
    engines = {precision: _engine(model_dir, precision, calibration_dir) for precision in PRECISIONS}
    peer_runs = (prepare_peer(engines, model_dir, llama_cpp_dir, torch.get_num_threads(), peer_repack)
                 if peer == PEER else None)
    with contextlib.ExitStack() as stack:
        servers = {p: stack.enter_context(ServedModel(model_dir, threads=torch.get_num_threads(), weights=p,
                                                      calibration_dir=calibration_dir))
                   for p in (engines if served else ())}
        speed = measure_speed(engines, tokens, rounds, compiled, peer_runs, servers)
    quality = measure_quality(engines, max_new_tokens, probes)
    rows = rows_of(speed, quality)
    result = {
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": invocation("precision"),
        "duration_s": round(time.time() - started, 1),
        "machine": machine_info("cpu"),
        "model": {"name": engines["fp32"].name, "fingerprint": engines["fp32"].loaded.fingerprint},
        "tokens": tokens, "rounds": rounds, "max_new_tokens": max_new_tokens,
        "method": METHOD,
        "rows": [asdict(r) for r in rows],
    }
    if served:
        result["served"] = {"rows": served_rows(speed), "method": SERVED_METHOD}
    if peer_runs is not None:
        result["peer"] = {"name": PEER, "version": peer_runs.llama.version(), "repack": peer_runs.repack,
                          "context_tokens": peer_runs.depth, "rows": peer_runs.rows(speed, tokens - 1),
                          "method": PEER_METHOD}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    if plot is not None:
        write_plot(result, plot)
    return result


def format_table(result: dict) -> str:
    lines = [f"{'configuration':<23} {'tok/s':>7} {'vs fp32 dense':>14} {'vs own dense':>13} {'MB/token':>9} "
             f"{'decode ratio':>12} {'products+rest ms':>16}  agreement vs fp32 dense [95%]"]
    for row in result["rows"]:
        agreement = ("n/a" if row["agreement"] is None
                     else f"{row['agreement']:.3f} [{row['agreement_low']:.3f}, {row['agreement_high']:.3f}]")
        if row["mode"] != "eager":  # quality is measured on the eager runs
            agreement = f"eager's; {row['agreement_with_eager']:.2f} of its tokens = eager's"
        lines.append(f"{' '.join((row['precision'], row['plan'], row['mode'])):<23} {row['tokens_per_s']:>7.2f} "
                     f"{row['speedup_vs_fp32_dense']:>6.2f}x ({row['speedup_vs_fp32_dense_paired']:.2f}x) "
                     f"{row['speedup_vs_same_precision_dense']:>6.2f}x ({row['speedup_vs_same_precision_dense_paired']:.2f}x)"
                     f" {row['bytes_per_token'] / 1e6:>8.1f} {row['decode_pruning_ratio']:>12.3f} {_split(row):>16}"
                     f"  {agreement}")
    for served in result.get("served", {}).get("rows", []):
        lines.append(f"{served['precision'] + ' ' + served['plan'] + ' served':<23} {served['tokens_per_s']:>7.2f}  "
                     f"{served['vs_in_process']:.2f}x ({served['vs_in_process_paired']:.2f}x) of the same in-process, "
                     "eager")
    for peer in result.get("peer", {}).get("rows", []):
        ratios = ", ".join(f"{k.removeprefix('engine_').removesuffix('_vs_llama_cpp').replace('_', ' ')} {v:.2f}x"
                           for k, v in peer.items() if k.endswith("_vs_llama_cpp"))
        lines.append(f"{PEER + ' ' + peer['llama_cpp_type']:<23} {peer['tokens_per_s']:>7.2f}  step "
                     f"{1e3 / peer['tokens_per_s']:.1f} ms; engine {peer['precision']} against it: {ratios}")
    return "\n".join(lines)


def _split(row: dict) -> str:
    """An eager row's step as products + rest in ms; '-' for a compiled one."""
    if row.get("products_ms") is None:
        return "-"
    return f"{row['products_ms']:.1f}+{row['rest_ms']:.1f}"


def write_plot(result: dict, path: Path) -> None:
    """Speedup over fp32 dense (within rounds) against agreement with fp32 dense, one point per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(7, 4.5))
    colors = {"fp32": "tab:blue", "int8": "tab:orange", "int4": "tab:green"}
    for row in result["rows"]:
        if row["agreement"] is None or row["mode"] != "eager":
            continue
        low, high = row["agreement"] - row["agreement_low"], row["agreement_high"] - row["agreement"]
        axis.errorbar(row["speedup_vs_fp32_dense_paired"], row["agreement"], yerr=[[low], [high]], fmt="o" if
                      row["plan"] == "dense" else "s", color=colors.get(row["precision"], "gray"), capsize=4,
                      label=f"{row['precision']} {row['plan']}")
    floor = QUALITY_TARGET["agreement"]
    axis.axhline(floor, linestyle="--", color="gray", linewidth=1, label=f"quality floor {floor}")
    axis.set_xlabel("decode speedup over fp32 dense, eager (median within rounds)")
    axis.set_ylabel("agreement with fp32 dense (95% interval)")
    axis.set_title(f"Precision x sparsity, {result['model']['name']} ({result['machine']['torch_threads']} threads)")
    axis.grid(alpha=0.3)
    axis.legend(loc="lower left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prunewatch bench precision", description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=REAL_MODEL_DIR)
    parser.add_argument("--tokens", type=int, default=64, help="generated tokens per speed run (decode steps + 1)")
    parser.add_argument("--rounds", type=int, default=5, help="speed runs of each configuration, order rotating")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="longest answer scored per evaluation prompt")
    parser.add_argument("--probes", type=int, default=None, help="first N evaluation prompts (default: all)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--calibration-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "precision-cpu.json")
    parser.add_argument("--plot", type=Path, default=RESULTS_DIR / "precision-cpu.png")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--no-compiled", action="store_true", help="skip the runs with compiled decode steps")
    parser.add_argument("--no-served", action="store_true",
                        help="skip the runs through `prunewatch serve` (one server per precision)")
    parser.add_argument("--peer", choices=[PEER], default=None,
                        help="time llama.cpp's llama-bench at each precision in the same rounds (F32, Q8_0, Q4_1)")
    parser.add_argument("--llama-cpp-dir", type=Path, default=None,
                        help="llama.cpp build holding bin/llama-bench (default: $PRUNEWATCH_LLAMA_CPP_DIR, else "
                             "the cache; bench/build-llama-cpp.sh makes one)")
    parser.add_argument("--peer-no-repack", action="store_true",
                        help="run llama.cpp without repacking quantized weights at load")
    args = parser.parse_args(argv)
    if args.tokens < 2 or args.rounds < 1 or args.max_new_tokens < 1:
        parser.error("--tokens must be >= 2, --rounds and --max-new-tokens >= 1")
    if not (args.model_dir / "config.json").is_file():
        parser.error(f"no model at {args.model_dir} (run `prunewatch models pull`)")
    if args.peer is not None:
        try:
            LlamaCpp.find(args.llama_cpp_dir)
        except PeerUnavailableError as exc:
            parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    return report(lambda: run(args.model_dir, tokens=args.tokens, rounds=args.rounds,
                              max_new_tokens=args.max_new_tokens, probes=args.probes,
                              calibration_dir=args.calibration_dir, threads=args.threads, out=args.out,
                              plot=None if args.no_plot else args.plot, compiled=not args.no_compiled,
                              peer=args.peer, llama_cpp_dir=args.llama_cpp_dir, peer_repack=not args.peer_no_repack,
                              served=not args.no_served),
                  format_table, args.out)

if __name__ == "__main__":
    sys.exit(main())
