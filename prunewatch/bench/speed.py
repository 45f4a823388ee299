"""Decode speed against the hardware: `prunewatch bench speed` (or `python -m prunewatch.bench.speed`).

One run measures, on this machine:
1. its read bandwidth: a STREAM-like read (a sum, and a matrix-vector product, the faster counts) of
   a buffer far larger than the caches, several times before the decodes and right before and after
   every decode run (on a shared host the ceiling moves with the load: the best sample is the
   conservative fractions' ceiling, the two samples beside a run the paired fraction's);
2. for the real model (SmolLM2-135M-Instruct) and for the 0.67 B benchmark shape (random weights,
   prunewatch.bench.engine.SpeedModelConfig), greedy decoding by plain transformers (`generate`), by the engine
   at sensitivity 0 (dense) and by the engine at its default operating point (EngineSettings
   defaults: calibrated activation sparsity scaled by the request's effective sensitivity, and the
   output-head shortlist), the engine's two runs both eagerly and with compiled decode steps
   (prunewatch.engine.compiled_decode; their graphs compile in the warm-up, untimed; --no-compiled skips them);
   and the real model served: `prunewatch serve` on 127.0.0.1 in a process of its own with the same threads,
   dense and default, one streamed chat completion per run timed by the client (prunewatch.bench.served), in
   the same rounds, with its ratio to the in-process run of the same plan (--no-served skips it).
Per run: decode tokens/s (median and spread over rounds whose order rotates), the bytes one decode
step really reads (weights of the linears that ran minus the rows the sparse kernel skipped, the
head, the KV cache; counted by the execution ledger, not estimated), the share of the measured
bandwidth that makes (median round against the best sample; best round against it; paired: median
over rounds of each round against the bandwidth measured beside it), the speedup against plain
transformers, for compiled runs the share of their tokens equal to the eager run's, and for the
pruned runs the fraction of the bound 1 / (1 - s f) it reaches (f: share of a dense decode step's
bytes in the layers that ran sparse, the output head included when it had a target; s: share of
those bytes the step did not read, from the ledger; so s f is the share of the dense step's bytes
skipped). Speedups come twice: as the ratio of two medians, and within rounds (the median over rounds of
the ratio between the two runs of one round, which a load slowing the whole round cancels). Where a
step's time goes: the step's weight products replayed alone (prunewatch.bench.step_products) against the rest of
the step, and for pruned runs the products' own speedup over the bound; the same replays per projection
(every layer's q_proj, ..., down_proj and the head, each call timed alone), for pruned runs with each
projection's speedup against dense's: which products shorten when rows are skipped and which are held by
fixed per-call costs. Writes JSON
and a PNG plot; prints a table and the goals the result is held to (prunewatch.bench.speed_goals: every run under
every estimator, with a verdict per goal). `--report FILE` prints both for a result written before.
Tests never assert timings: tests/engine/test_speed_bench.py checks structure on the probe model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from prunewatch.bench._common import RESULTS_DIR, invocation, machine_info, synchronize
from prunewatch.bench.served import ServedModel
from prunewatch.bench.speed_goals import REAL_WEIGHTS, bandwidth_goal, format_goals, goals_summary
from prunewatch.bench.step_products import capture_checked, median_ms, time_replay, time_replay_by_projection
from prunewatch.engine.model_store import DEFAULT_MODEL, PROBE_MODEL_DIR, models_root

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from prunewatch.engine.execution import ExecutionLedger, ExecutionPlan
    from prunewatch.engine.pruning_engine import PruningEngine

logger = logging.getLogger("prunewatch.bench.speed")

RESULTS = RESULTS_DIR
REAL_MODEL_DIR = models_root() / DEFAULT_MODEL
PROMPT = "Explain how a CPU cache works, step by step, for a new programmer."


@dataclass
class RunRow:
    """One model x one way of decoding."""

    model: str
    # "plain" (transformers generate), "dense" (engine, sensitivity 0), "pruned" (engine default); with the
    # suffix "-compiled" the engine's decode steps ran as one torch.compile graph (prunewatch.engine.compiled_decode)
    run: str
    tokens_per_s: float  # median over rounds
    tokens_per_s_min: float
    tokens_per_s_max: float
    rounds: list[float]
    bytes_per_token: int  # bytes one decode step reads (ledger), the same model's dense count for "plain"
    fraction_of_bandwidth: float  # bytes_per_token x tokens/s / measured read bandwidth
    speedup_vs_plain: float  # tokens/s over plain transformers' (medians)
    decode_sparsity: float | None = None  # s: share of the pruneable layers' bytes a decode step did not read
    pruneable_share: float | None = None  # f: share of a dense decode step's bytes in the layers run sparse
    # (the sparse-wrapped linears, and the output head when it has a target)
    bound: float | None = None  # 1 / (1 - s f)
    speedup_vs_dense: float | None = None
    fraction_of_bound: float | None = None  # speedup_vs_dense / bound
    decode_pruning_ratio: float | None = None
    fallback: str | None = None  # why the default operating point ran dense, if it did
    # Compiled runs: share of generated tokens equal to the eager run's of the same plan (fused arithmetic
    # may change a near-tie; 1.0 when the compiled step decodes exactly as the eager one).
    agreement_with_eager: float | None = None
    # The best round over the best bandwidth sample: on a shared host load only slows a run down, so
    # ceiling against ceiling; the median-based fraction above is the conservative figure.
    fraction_of_bandwidth_best: float = 0.0
    # Per round, the mean of the two bandwidth samples taken right before and right after the run: what
    # the host gave at that moment. The paired fraction is the median over rounds of bytes_per_token x
    # that round's tokens/s over that round's bandwidth, so a round slowed by a neighbour's load is set
    # against the bandwidth the same load left, not against the best sample of a quieter moment.
    rounds_bandwidth_gb_s: list[float] = field(default_factory=list)
    fraction_of_paired_bandwidth: float | None = None  # None: no bandwidth sampled beside the runs
    # The speedups again as the median over rounds of the ratio within each round (the runs of a round follow
    # each other, so a load that slows the whole round cancels): on a shared host a steadier estimate than
    # the ratio of two medians taken from different rounds. None in results written before they existed.
    speedup_vs_plain_paired: float | None = None
    speedup_vs_dense_paired: float | None = None
    fraction_of_bound_paired: float | None = None
    # Where a step's time goes (prunewatch.bench.step_products): the weight products of one real decode step of this
    # plan replayed alone right after each round's run (the same modules on the inputs they received, as
    # eager module calls; a compiled run replays its plan's), median over rounds; the rest is the median over
    # rounds of the round's step time minus its products: norms, attention, cache, Python or guards, which
    # skipping rows does not shorten. For pruned runs the products' speedup within rounds against the dense
    # run's products, and that over the bound.
    products_ms_per_token: float | None = None
    rounds_products_ms: list[float] = field(default_factory=list)  # per round, as `rounds`
    rest_ms_per_token: float | None = None
    products_speedup_vs_dense: float | None = None
    products_fraction_of_bound: float | None = None
    # The same replays per projection (prunewatch.bench.step_products.time_replay_by_projection: every layer's calls
    # to q_proj, ..., down_proj summed, and the head), each call timed alone: ms per token, median over rounds of
    # each round's median of REPS replays; for pruned runs each projection's speedup within rounds against the dense
    # run's. Says which products shorten when rows are skipped. None in results written before they existed.
    products_ms_by_projection: dict[str, float] | None = None
    products_speedup_by_projection: dict[str, float] | None = None
    # Served runs ("served-dense", "served-pruned": `prunewatch serve` on 127.0.0.1, streamed, timed by the client;
    # prunewatch.bench.served): tokens/s over the in-process run of the same plan in this process's main thread
    # ("dense", "pruned"), as the ratio of the medians and within rounds. None for the in-process runs.
    served_vs_in_process: float | None = None
    served_vs_in_process_paired: float | None = None


@dataclass
class SpeedResult:
    machine: dict
    bandwidth_gb_s: float  # best of the read-bandwidth samples (before and between runs): the fractions' ceiling
    bandwidth_gb_s_median: float
    bandwidth_reps: list[float]
    settings: dict
    models: dict[str, dict] = field(default_factory=dict)  # name -> facts (params, dtype, ...)
    rows: list[RunRow] = field(default_factory=list)
    # Models still to measure when this was written: the JSON is rewritten after each model, so a run that
    # fails in its second model keeps the first's measurements (0 once the run is complete).
    models_pending: int = 0
    # The issue's goals checked against the rows, run by run and estimator by estimator (prunewatch.bench.speed_goals);
    # derived from the rows when the JSON is written, so they always agree with them.
    goals: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


# -- bandwidth ------------------------------------------------------------------------------------


class BandwidthReader:
    """A STREAM-like read of a float32 buffer far larger than the caches, allocated once and touched
    before the first sample. Two read kernels, the best counts: torch's (vectorised, multi-threaded)
    sum, and a matrix-vector product over the buffer viewed as a (rows, 4096) matrix, which reads each
    element once with the access pattern (and the BLAS prefetching) of a decode step; at one thread
    the product reads ~1.4x faster than the sum on the reference host."""

    def __init__(self, mib: int = 1024, device: str = "cpu") -> None:
        self.place = torch.device(device)
        self.buffer = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32, device=self.place)
        self.matrix = self.buffer.view(-1, 4096)  # (rows, 4096)
        self.vector = torch.ones(4096, dtype=torch.float32, device=self.place)
        self.buffer.sum()  # pages touched, threads woken
        torch.mv(self.matrix, self.vector)

    def _timed(self, read: Callable[[], torch.Tensor]) -> float:
        synchronize(self.place)
        started = time.perf_counter()
        read()
        synchronize(self.place)
        return self.buffer.numel() * 4 / (time.perf_counter() - started) / 1e9

    def sample(self) -> float:
        """GB/s of the faster of one summed read and one matrix-vector read of the whole buffer."""
        return max(self._timed(self.buffer.sum), self._timed(lambda: torch.mv(self.matrix, self.vector)))


# -- plain transformers ---------------------------------------------------------------------------


class _Stamps:
    """A transformers streamer that only notes when each generated token arrived."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # generate() first puts the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def plain_decode_rate(model: PreTrainedModel, prompt_ids: Sequence[int], new_tokens: int) -> float:
    """Decode tokens/s of transformers' own greedy `generate` (first token to last), fixed length."""
    from transformers import GenerationMixin

    if not isinstance(model, GenerationMixin):
        raise TypeError(f"{type(model).__name__} has no generate(): plain decoding needs a causal LM")
    stamps = _Stamps()
    ids = torch.tensor([list(prompt_ids)], device=next(model.parameters()).device)  # (1, T)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       streamer=stamps, pad_token_id=0)
    return (len(stamps.times) - 1) / (stamps.times[-1] - stamps.times[0])


# -- one model ------------------------------------------------------------------------------------


_RunOutcome = tuple[float, "ExecutionLedger | None", "list[int] | None"]
"""One timed run: decode tokens/s, and for an engine run its ledger and generated tokens (None for the others)."""


@dataclass
class _Subject:
    name: str
    engine: PruningEngine  # with activation sparsity installed
    plain: PreTrainedModel  # the same weights in plain transformers, never wrapped
    prompt_ids: list[int]
    facts: dict
    model_dir: Path | None = None  # the folder `prunewatch serve` can load (None: the random-weight shape)


def _load_real(model_dir: Path, calibration_dir: Path | None, device: str = "cpu") -> _Subject:
    from transformers import AutoModelForCausalLM

    from prunewatch.engine import EngineSettings, PruningEngine
    from prunewatch.probes import load_calibration_set

    engine = PruningEngine.load(EngineSettings(model_dir=model_dir, device=device, log_level="NONE",
                                               calibration_dir=calibration_dir))
    probe_set = load_calibration_set()
    engine.load_or_calibrate(probe_set.calibration_texts(), probe_set.digest)
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=engine.loaded.dtype).to(engine.loaded.device).eval()
    return _Subject(model_dir.name, engine, plain, engine.render_prompt(PROMPT), _facts(plain, REAL_WEIGHTS), model_dir)


def _load_shape(shape, calibration_dir: Path, seed: int = 0, texts_per_domain: int = 2, device: str = "cpu") -> _Subject:
    """The benchmark shape with random weights, served by the engine from a temporary folder (the probe
    model's tokenizer; calibrated on a few probe texts per domain)."""
    from transformers import AutoTokenizer

    from prunewatch.bench.engine import build_speed_model
    from prunewatch.engine import EngineSettings, PruningEngine
    from prunewatch.engine.loading import LoadedModel
    from prunewatch.probes import load_calibration_set

    place = torch.device(device)
    dtype = torch.float32 if place.type == "cpu" else torch.bfloat16  # as prunewatch.engine.loading serves each device
    model = build_speed_model(shape, seed, place, dtype)
    plain = build_speed_model(shape, seed, place, dtype)
    tokenizer = AutoTokenizer.from_pretrained(PROBE_MODEL_DIR)
    name = f"llama-{sum(p.numel() for p in plain.parameters()) / 1e9:.2f}B-random"
    loaded = LoadedModel(model=model, tokenizer=tokenizer, name=name, path=PROBE_MODEL_DIR,
                         device=place, dtype=dtype, fingerprint=f"{name}-seed{seed}")
    engine = PruningEngine(loaded, EngineSettings(model_dir=PROBE_MODEL_DIR, device=place.type, log_level="NONE",
                                                  calibration_dir=calibration_dir))
    probe_set = load_calibration_set()
    texts = {d: list(t)[:texts_per_domain] for d, t in probe_set.calibration_texts().items()}
    engine.load_or_calibrate(texts, f"{probe_set.digest[:8]}-first{texts_per_domain}")
    return _Subject(name, engine, plain, engine.render_prompt(PROMPT), _facts(plain, f"random (seed {seed})"))


def _facts(model: PreTrainedModel, weights: str) -> dict:
    params = sum(p.numel() for p in model.parameters())
    config = model.config
    return {"params": params, "weights": weights, "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size}


def measure(subject: _Subject, new_tokens: int, rounds: int,
            bandwidth: Callable[[], float] | None = None, compiled: bool = True,
            served: ServedModel | None = None) -> tuple[list[RunRow], list[float]]:
    """Plain, dense and pruned decode of one model, `rounds` times each in rotating order; `bandwidth`
    (one read-bandwidth sample) runs before each run and after each round's last, so every run has a
    sample on either side, taken under the same load as the run on a shared host. `compiled`: also the
    engine's two runs with compiled decode steps (after a warm-up that compiles their graphs). `served`: also
    the same model served by `prunewatch serve` (prunewatch.bench.served), dense and default, streamed and timed
    by the client, in the same rounds. Returns the rows and the bandwidth samples (GB/s)."""
    from prunewatch.engine.execution import ExecutionPlan

    engine = subject.engine
    plan = engine.execution_plan(subject.prompt_ids, engine.settings.sensitivity, list(engine.settings.layer_blacklist),
                                 prompt_text=PROMPT)
    _, fallback = engine.plan(subject.prompt_ids, engine.settings.sensitivity, list(engine.settings.layer_blacklist),
                              prompt_text=PROMPT)
    runs: dict[str, Callable[[], _RunOutcome]] = {
        "plain": lambda: (plain_decode_rate(subject.plain, subject.prompt_ids, new_tokens), None, None),
        "dense": lambda: _engine_run(engine, subject.prompt_ids, ExecutionPlan(), new_tokens, False),
        "pruned": lambda: _engine_run(engine, subject.prompt_ids, plan, new_tokens, False),
    }
    if compiled:
        runs["dense-compiled"] = lambda: _engine_run(engine, subject.prompt_ids, ExecutionPlan(), new_tokens, True)
        runs["pruned-compiled"] = lambda: _engine_run(engine, subject.prompt_ids, plan, new_tokens, True)
    served_ratios: dict[str, list[float | None]] = {}  # per served run and round: the server's decode ratio
    if served is not None:
        def served_run(name: str, dense: bool) -> Callable[[], tuple[float, None, None]]:
            def run() -> tuple[float, None, None]:
                decode = served.decode(PROMPT, new_tokens, dense=dense)
                served_ratios.setdefault(name, []).append(decode.decode_pruning_ratio)
                return decode.tokens_per_s, None, None
            return run

        runs["served-dense"] = served_run("served-dense", True)
        runs["served-pruned"] = served_run("served-pruned", False)
    for name, run in runs.items():  # warm-up: first-call allocations, thread pools, the kernel's caches, graphs
        started = time.perf_counter()
        run()
        logger.info("%s %s warm-up %.1f s", subject.name, name, time.perf_counter() - started)
    if compiled and engine.compiled_decode(True) is None:
        raise RuntimeError(f"the compiled decode step failed to compile: {engine.compiled_decode_failure}")
    products = StepReplays.capture(subject, plan)
    rates: dict[str, list[float]] = {name: [] for name in runs}
    products_ms: dict[str, list[float]] = {name: [] for name in runs}  # per round: its products, right after it
    projection_ms: dict[str, list[dict[str, float]]] = {name: [] for name in runs}  # per round, per projection
    ledgers: dict[str, ExecutionLedger] = {}
    tokens: dict[str, list[int]] = {}
    samples: list[float] = []
    paired: dict[str, list[float]] = {name: [] for name in runs}  # per round: mean of the samples beside the run
    names = list(runs)
    for r in range(rounds):
        before = bandwidth() if bandwidth is not None else None
        for name in names[r % len(names):] + names[:r % len(names)]:
            rate, ledger, generated = runs[name]()
            rates[name].append(rate)
            if ledger is not None and generated is not None:  # an engine run: both or neither
                ledgers[name], tokens[name] = ledger, generated
            if bandwidth is not None and before is not None:
                after = bandwidth()
                samples.append(before)
                paired[name].append((before + after) / 2)
                before = after
            products_ms[name].append(products.ms(_plan_of(name)))
            projection_ms[name].append(products.ms_by_projection(_plan_of(name)))
        if before is not None:
            samples.append(before)
        logger.info("%s round %d: %s (load %.1f)", subject.name, r + 1,
                    {k: round(v[-1], 2) for k, v in rates.items()}, os.getloadavg()[0])
    logger.info("%s weight products per step: %s ms", subject.name,
                {k: round(statistics.median(v), 2) for k, v in products_ms.items()})
    steps = new_tokens - 1
    if "dense-compiled" in ledgers and ledgers["dense-compiled"].decode_bytes_read != ledgers["dense"].decode_bytes_read:
        raise RuntimeError(f"{subject.name}: the compiled dense step counted {ledgers['dense-compiled'].decode_bytes_read} "
                           f"bytes, the eager one {ledgers['dense'].decode_bytes_read}: they must count the same")
    if "pruned-compiled" in ledgers:  # fused arithmetic may flip a channel at its threshold, no more
        eager_bytes, graph_bytes = ledgers["pruned"].decode_bytes_read, ledgers["pruned-compiled"].decode_bytes_read
        if abs(graph_bytes - eager_bytes) > 0.005 * eager_bytes:
            raise RuntimeError(f"{subject.name}: the compiled pruned step read {graph_bytes} bytes, the eager one "
                               f"{eager_bytes}: more than 0.5% apart")
    dense_bytes = ledgers["dense"].decode_bytes_read // steps
    element = next(subject.plain.parameters()).element_size()
    head_bytes = subject.plain.get_output_embeddings().weight.numel() * element
    medians = {name: statistics.median(values) for name, values in rates.items()}
    rows = []
    for name in names:
        counterpart = name.removeprefix("served-")  # a served run reads what the in-process run of its plan reads
        pruned = ledgers.get(counterpart) if counterpart.startswith("pruned") else None
        bytes_per_token = pruned.decode_bytes_read // steps if pruned is not None else dense_bytes
        row = RunRow(model=subject.name, run=name, tokens_per_s=round(medians[name], 3),
                     tokens_per_s_min=round(min(rates[name]), 3), tokens_per_s_max=round(max(rates[name]), 3),
                     rounds=[round(v, 3) for v in rates[name]], bytes_per_token=int(bytes_per_token),
                     fraction_of_bandwidth=0.0, speedup_vs_plain=round(medians[name] / medians["plain"], 4),
                     rounds_bandwidth_gb_s=[round(v, 3) for v in paired[name]])
        row.speedup_vs_plain_paired = round(paired_ratio(rates[name], rates["plain"]), 4)
        if paired[name]:
            row.fraction_of_paired_bandwidth = round(statistics.median(
                bytes_per_token * rate / 1e9 / gb_s for rate, gb_s in zip(rates[name], paired[name])), 4)
        if pruned is not None:
            s, f = _sparsity_and_share(pruned, dense_bytes, steps, element,
                                       head_bytes if plan.output_head_sparsity > 0 else 0)
            bound = 1.0 / (1.0 - s * f)  # = dense bytes / pruned bytes per step: time proportional to bytes
            speedup = medians[name] / medians[name.replace("pruned", "dense")]
            row.decode_sparsity, row.pruneable_share, row.bound = round(s, 4), round(f, 4), round(bound, 4)
            row.speedup_vs_dense = round(speedup, 4)
            row.fraction_of_bound = round(speedup / bound, 4)
            within_rounds = paired_ratio(rates[name], rates[name.replace("pruned", "dense")])
            row.speedup_vs_dense_paired = round(within_rounds, 4)
            row.fraction_of_bound_paired = round(within_rounds / bound, 4)
            row.decode_pruning_ratio = round(pruned.decode_pruning_ratio, 6)
            if served_ratios.get(name):  # the server's own figure for its plan (the same prompt and defaults)
                row.decode_pruning_ratio = round(statistics.median(v or 0.0 for v in served_ratios[name]), 6)
            row.fallback = fallback
        row.rounds_products_ms = [round(v, 3) for v in products_ms[name]]
        row.products_ms_per_token = round(statistics.median(products_ms[name]), 3)
        row.rest_ms_per_token = round(statistics.median(
            1e3 / rate - replayed for rate, replayed in zip(rates[name], products_ms[name])), 3)
        if pruned is not None and row.bound is not None:  # within rounds, against the dense plan's products
            # replayed beside its dense run (row.bound is set for every pruned run above)
            dense_name = name.replace("pruned", "dense")
            row.products_speedup_vs_dense = round(statistics.median(
                dense / pruned_ms for dense, pruned_ms in zip(products_ms[dense_name], products_ms[name])), 4)
            row.products_fraction_of_bound = round(row.products_speedup_vs_dense / row.bound, 4)
        row.products_ms_by_projection = {
            projection: round(statistics.median(r[projection] for r in projection_ms[name]), 4)
            for projection in projection_ms[name][0]}
        if pruned is not None:  # within rounds, against the dense run's same projection
            dense_rounds = projection_ms[name.replace("pruned", "dense")]
            row.products_speedup_by_projection = {
                projection: round(statistics.median(
                    d[projection] / r[projection] for d, r in zip(dense_rounds, projection_ms[name])), 4)
                for projection in projection_ms[name][0] if projection in dense_rounds[0]}
        if name.startswith("served-"):
            row.served_vs_in_process = round(medians[name] / medians[counterpart], 4)
            row.served_vs_in_process_paired = round(paired_ratio(rates[name], rates[counterpart]), 4)
        if name.endswith("-compiled"):
            eager = tokens[name.removesuffix("-compiled")]
            row.agreement_with_eager = round(sum(a == b for a, b in zip(tokens[name], eager)) / len(eager), 4)
        rows.append(row)
    return rows, samples


class StepReplays:
    """One real decode step's weight products per plan (prunewatch.bench.step_products): plain transformers, the
    engine's dense step and its step under the default plan, each replayed alone beside the run it belongs
    to, so the products and the step they are subtracted from meet the same load of a shared host."""

    REPS = 9  # replays per run (tens of ms each on SmolLM2, where a neighbour's burst moves one by 20%): their median

    def __init__(self, captured: dict, contexts: dict, device: torch.device) -> None:
        self.captured, self.contexts, self.device = captured, contexts, device

    @classmethod
    def capture(cls, subject: _Subject, plan) -> StepReplays:
        """Capture the three steps; each replay is first checked to reproduce the outputs its step computed,
        so what is timed is the step's work."""
        from prunewatch.engine.execution import ExecutionLedger, ExecutionPlan, executing

        engine, dense = subject.engine, ExecutionPlan()
        model = engine.loaded.model
        dense_step, pruned_step = engine.eager_step_plan(dense), engine.eager_step_plan(plan)  # as the steps ran
        contexts: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
            "plain": contextlib.nullcontext, "dense": lambda: executing(dense_step, ExecutionLedger()),
            "pruned": lambda: executing(pruned_step, ExecutionLedger())}
        decodes = {
            "plain": (subject.plain, lambda: plain_decode_rate(subject.plain, subject.prompt_ids, 3)),
            "dense": (model, lambda: engine.measure_decode(subject.prompt_ids, dense, 3, compiled=False)),
            "pruned": (model, lambda: engine.measure_decode(subject.prompt_ids, plan, 3, compiled=False)),
        }
        captured = {name: capture_checked(m, decode, contexts[name], f"{subject.name} {name}")
                    for name, (m, decode) in decodes.items()}
        return cls(captured, contexts, engine.loaded.device)

    def ms(self, name: str) -> float:
        """Milliseconds of the products of `name`'s step (plain, dense or pruned), median of REPS replays."""
        return median_ms(time_replay(self.captured[name], self.contexts[name], self.REPS,
                                     lambda: synchronize(self.device)))

    def ms_by_projection(self, name: str) -> dict[str, float]:
        """Milliseconds of the same step's products per projection, each the median of REPS replays."""
        times = time_replay_by_projection(self.captured[name], self.contexts[name], self.REPS,
                                          lambda: synchronize(self.device))
        return {projection: median_ms(seconds) for projection, seconds in times.items()}


def _plan_of(name: str) -> str:
    """The plan a run decodes under, as StepReplays names it: plain, dense or pruned."""
    return name.removeprefix("served-").removesuffix("-compiled")


def paired_ratio(rates: Sequence[float], baseline: Sequence[float]) -> float:
    """Median over rounds of rates[i] / baseline[i]: both runs of round i, so what slowed the round cancels."""
    if len(rates) != len(baseline) or not rates:
        raise ValueError(f"paired ratio needs one baseline per round: {len(rates)} rounds, {len(baseline)} baselines")
    return statistics.median(rate / base for rate, base in zip(rates, baseline))


def _sparsity_and_share(pruned, dense_bytes: int, steps: int, element: int, head_bytes: int) -> tuple[float, float]:
    """(s, f) of one pruned run from its ledger: f the share of a dense step's bytes in the layers that ran
    sparse (the shortlist head's weights included when it ran: `head_bytes`), s the share of those not read."""
    sparse_bytes = pruned.decode_sparse_dense_flops // 2 * element // steps + head_bytes  # rows = 1 per step
    skipped = max(0, dense_bytes - pruned.decode_bytes_read // steps)
    s = skipped / sparse_bytes if sparse_bytes else 0.0
    f = sparse_bytes / dense_bytes if dense_bytes else 0.0
    return s, f


def _engine_run(engine: PruningEngine, prompt_ids: list[int], plan: ExecutionPlan, new_tokens: int,
                compiled: bool) -> _RunOutcome:
    measurement = engine.measure_decode(prompt_ids, plan, new_tokens, compiled=compiled)
    return measurement.decode_tokens_per_s, measurement.ledger, measurement.tokens


# -- report ---------------------------------------------------------------------------------------


def format_table(result: dict) -> str:
    head = (f"read bandwidth {result['bandwidth_gb_s']:.1f} GB/s (best of {len(result['bandwidth_reps'])}; "
            f"median {result['bandwidth_gb_s_median']:.1f})\n")
    columns = f"{'model':<28} {'run':<15} {'tok/s':>8} {'min-max':>13} {'MB/token':>9} {'of BW':>6} {'best':>6} " \
              f"{'paired':>6} " \
              f"{'vs plain':>8} {'paired':>7} {'vs in-proc':>10} {'paired':>7} {'s':>6} {'f':>6} {'bound':>6} {'vs dense':>8} {'paired':>7} " \
              f"{'of bound':>8} {'paired':>7} {'=eager':>6} {'prod ms':>7} {'rest ms':>7} {'prod/bound':>10}"
    lines = [head + columns, "-" * len(columns)]
    for row in result["rows"]:
        def opt(key: str, fmt: str, row: dict = row) -> str:
            return format(row[key], fmt) if row.get(key) is not None else "-"
        lines.append(
            f"{row['model']:<28} {row['run']:<15} {row['tokens_per_s']:>8.2f} "
            f"{row['tokens_per_s_min']:>6.1f}-{row['tokens_per_s_max']:<6.1f} {row['bytes_per_token'] / 1e6:>9.1f} "
            f"{row['fraction_of_bandwidth']:>6.1%} {row.get('fraction_of_bandwidth_best', 0.0):>6.1%} "
            f"{opt('fraction_of_paired_bandwidth', '.1%'):>6} "
            f"{row['speedup_vs_plain']:>7.3f}x {opt('speedup_vs_plain_paired', '.3f'):>7} "
            f"{opt('served_vs_in_process', '.3f'):>10} {opt('served_vs_in_process_paired', '.3f'):>7} "
            f"{opt('decode_sparsity', '.3f'):>6} {opt('pruneable_share', '.3f'):>6} {opt('bound', '.3f'):>6} "
            f"{opt('speedup_vs_dense', '.3f'):>8} {opt('speedup_vs_dense_paired', '.3f'):>7} "
            f"{opt('fraction_of_bound', '.3f'):>8} {opt('fraction_of_bound_paired', '.3f'):>7} "
            f"{opt('agreement_with_eager', '.3f'):>6} {opt('products_ms_per_token', '.1f'):>7} "
            f"{opt('rest_ms_per_token', '.1f'):>7} {opt('products_fraction_of_bound', '.3f'):>10}")
    return "\n".join(lines)


def format_projection_table(result: dict) -> str:
    """Each run's replayed products per projection, ms per token, and for pruned runs the projection's speedup
    within rounds against dense's in brackets; empty for a result written before they were replayed so."""
    rows = [row for row in result["rows"] if row.get("products_ms_by_projection")]
    if not rows:
        return ""
    lines = ["weight products per projection, ms per token (pruned: speedup vs dense within rounds)"]
    for model in dict.fromkeys(row["model"] for row in rows):
        runs = [row for row in rows if row["model"] == model]
        projections = list(dict.fromkeys(p for row in runs for p in row["products_ms_by_projection"]))
        header = f"{model[:28]:<28} " + " ".join(f"{p[:15]:>15}" for p in projections)
        lines += ["", header, "-" * len(header)]
        for row in runs:
            cells = []
            for projection in projections:
                ms = row["products_ms_by_projection"].get(projection)
                speedup = (row.get("products_speedup_by_projection") or {}).get(projection)
                cell = "-" if ms is None else f"{ms:.2f}" + (f" ({speedup:.2f}x)" if speedup is not None else "")
                cells.append(f"{cell:>15}")
            lines.append(f"{row['run']:<28} " + " ".join(cells))
    return "\n".join(lines)


def format_projection_markdown(result: dict) -> str:
    """The first model's products per projection as the README's markdown table: dense and default ms per token,
    the default's speedup within rounds, and plain transformers beside them; empty without the replays."""
    rows = {row["run"]: row for row in result["rows"] if row.get("products_ms_by_projection")}
    if "dense" not in rows or "pruned" not in rows:
        return ""
    model = rows["dense"]["model"]
    rows = {run: row for run, row in rows.items() if row["model"] == model}
    projections = list(rows["dense"]["products_ms_by_projection"])
    speedups = rows["pruned"].get("products_speedup_by_projection") or {}

    def line(label: str, cells: list[str]) -> str:
        return f"| {label} | " + " | ".join(cells) + " |"

    lines = [line("projection", projections), "|---|" + "---:|" * len(projections),
             line("dense, ms per token", [f"{rows['dense']['products_ms_by_projection'][p]:.2f}" for p in projections]),
             line("default, ms per token", [f"{rows['pruned']['products_ms_by_projection'][p]:.2f}" for p in projections]),
             line("default vs dense, within rounds", [f"{speedups[p]:.2f}x" if p in speedups else "" for p in projections])]
    if "plain" in rows:
        lines.append(line("plain transformers (BLAS), ms per token",
                          [f"{rows['plain']['products_ms_by_projection'][p]:.2f}"
                           if p in rows["plain"]["products_ms_by_projection"] else "" for p in projections]))
    return "\n".join(lines)


def write_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(row["model"] for row in result["rows"]))
    runs = list(dict.fromkeys(row["run"] for row in result["rows"]))
    breakdown = all(row.get("products_ms_per_token") is not None for row in result["rows"])  # not before it existed
    fig, axes = plt.subplots(1, 3 if breakdown else 2, figsize=(18 if breakdown else 12, 4.4))
    left, right = axes[0], axes[1]
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        x, rows = _placed(result, models, run, i, len(runs), width)
        left.bar(x, [r["tokens_per_s"] for r in rows], width, label=run,
                 yerr=[[r["tokens_per_s"] - r["tokens_per_s_min"] for r in rows],
                       [r["tokens_per_s_max"] - r["tokens_per_s"] for r in rows]], capsize=3)
        right.bar(x, [100 * r["fraction_of_bandwidth"] for r in rows], width, label=run)
        paired = [(v, 100 * r["fraction_of_paired_bandwidth"]) for v, r in zip(x, rows)
                  if r.get("fraction_of_paired_bandwidth") is not None]  # results written before it: none
        if paired:
            right.hlines([y for _, y in paired], [v - width / 2 for v, _ in paired], [v + width / 2 for v, _ in paired],
                         color="black", linewidth=2, zorder=3, label="paired" if i == 0 else None)
    for axis, title in ((left, "decode tokens/s (median, min-max)"),
                         (right, "% of read bandwidth: bars vs best sample, dashes paired (median round)")):
        axis.set_xticks(range(len(models)), models, fontsize=8)
        axis.set_title(title, fontsize=10)
        axis.legend(fontsize=8)
    right.axhline(100, color="grey", lw=0.8, ls="--")
    for j, model in enumerate(models):  # the share of the bandwidth each model's engine runs are held to
        target = bandwidth_goal(result, model)
        right.hlines(100 * target, j - 0.45, j + 0.45, color="red", linestyles=":", linewidth=1.5,
                     label="goal" if j == 0 else None)
    right.legend(fontsize=8)
    if breakdown:
        _plot_breakdown(axes[2], result, models, runs, width)
    threads = result['machine']['torch_threads']
    fig.suptitle(f"decode speed, {result['machine']['processor']}, {threads} thread{'' if threads == 1 else 's'}, "
                 f"read bandwidth {result['bandwidth_gb_s']:.1f} GB/s", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _placed(result: dict, models: list[str], run: str, i: int, runs: int, width: float
            ) -> tuple[list[float], list[dict]]:
    """Bar positions and rows of `run` (the i-th of `runs`) for the models that have it (the random-weight shape
    has no served runs)."""
    placed = [(j + (i - (runs - 1) / 2) * width, row) for j, model in enumerate(models)
              for row in result["rows"] if row["model"] == model and row["run"] == run]
    return [x for x, _ in placed], [row for _, row in placed]


def _plot_breakdown(axis, result: dict, models: list[str], runs: list[str], width: float) -> None:
    """Each run's step time over the engine's dense eager step of the same model: the weight products
    replayed alone (solid) and the rest of the step (light), which skipping rows does not shorten."""
    colors = [f"C{i}" for i in range(len(runs))]
    for i, run in enumerate(runs):
        x, rows = _placed(result, models, run, i, len(runs), width)
        dense_ms = [1e3 / next(r for r in result["rows"] if r["model"] == row["model"] and r["run"] == "dense")[
            "tokens_per_s"] for row in rows]
        products = [r["products_ms_per_token"] / d for r, d in zip(rows, dense_ms)]
        rest = [max(0.0, r["rest_ms_per_token"]) / d for r, d in zip(rows, dense_ms)]
        axis.bar(x, products, width, color=colors[i], label=run)
        axis.bar(x, rest, width, bottom=products, color=colors[i], alpha=0.35)
    axis.axhline(1.0, color="grey", lw=0.8, ls="--")
    axis.set_xticks(range(len(models)), models, fontsize=8)
    axis.set_title("step time / engine dense eager step: products replayed alone (solid), rest (light)", fontsize=9)
    axis.legend(fontsize=8)


def _serving(subject: _Subject, served: bool, calibration_dir: Path | None, device: str):
    """`prunewatch serve` of the subject's model folder with this thread's intra-op threads, or nothing (no
    folder to serve: the random-weight shape; or served runs not asked for)."""
    if not served or subject.model_dir is None:
        return contextlib.nullcontext(None)
    return ServedModel(subject.model_dir, threads=torch.get_num_threads(), calibration_dir=calibration_dir,
                       device=device)


def run(model_dir: Path | None, shape, *, new_tokens: int, rounds: int, bandwidth_mib: int, bandwidth_reps: int,
        calibration_dir: Path | None, out: Path, plot: Path | None, device: str = "cpu",
        compiled: bool = True, served: bool = True) -> dict:
    """The whole benchmark; returns the result written to `out` (rewritten after each model). `served`: the real
    model also through `prunewatch serve` (prunewatch.bench.served)."""
    if model_dir is None and shape is None:
        raise ValueError("nothing to measure: neither a real model nor a shape")
    reader = BandwidthReader(bandwidth_mib, device)
    reps = [reader.sample() for _ in range(bandwidth_reps)]
    result = SpeedResult(machine=machine_info(device), bandwidth_gb_s=round(max(reps), 3),
                         bandwidth_gb_s_median=round(statistics.median(reps), 3),
                         bandwidth_reps=[round(v, 3) for v in reps],
                         settings={"new_tokens": new_tokens, "rounds": rounds, "bandwidth_mib": bandwidth_mib,
                                   "prompt": PROMPT, "timer": "first generated token to last, fixed length",
                                   "compiled": compiled and device == "cpu",
                                   "served": served and model_dir is not None,
                                   "served_timer": "prunewatch serve on 127.0.0.1 (same threads, eager), one streamed "
                                                   "chat completion per run, timed by the client from the first text "
                                                   "chunk to the last (one chunk per token)"})
    logger.info("read bandwidth %.1f GB/s", result.bandwidth_gb_s)
    subjects = []
    with tempfile.TemporaryDirectory(prefix="prunewatch-speed-") as scratch:
        if model_dir is not None:
            subjects.append(lambda: _load_real(model_dir, calibration_dir, device))
        if shape is not None:
            subjects.append(lambda: _load_shape(shape, calibration_dir or Path(scratch), device=device))
        for done, load in enumerate(subjects, start=1):
            subject = load()
            result.models[subject.name] = subject.facts
            with _serving(subject, served, calibration_dir, device) as server:
                rows, samples = measure(subject, new_tokens, rounds, reader.sample,
                                        compiled=compiled and device == "cpu", served=server)
            result.rows.extend(rows)
            reps.extend(samples)
            del subject  # one model in memory at a time
            result.models_pending = len(subjects) - done
            data = _write(result, reps, out)
    if plot is not None:
        write_plot(data, plot)
    return data


def _write(result: SpeedResult, reps: list[float], out: Path) -> dict:
    """Set the bandwidth figures and every row's shares from all samples so far, and write the JSON."""
    result.bandwidth_reps = [round(v, 3) for v in reps]
    result.bandwidth_gb_s = round(max(reps), 3)
    result.bandwidth_gb_s_median = round(statistics.median(reps), 3)
    for row in result.rows:
        row.fraction_of_bandwidth = round(row.bytes_per_token * row.tokens_per_s / 1e9 / result.bandwidth_gb_s, 4)
        row.fraction_of_bandwidth_best = round(
            row.bytes_per_token * row.tokens_per_s_max / 1e9 / result.bandwidth_gb_s, 4)
    result.goals = goals_summary(result.as_dict())
    data = {**result.as_dict(), "command": invocation("speed")}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    return data


def main(argv: list[str] | None = None) -> int:
    from prunewatch.bench.engine import SpeedModelConfig

    parser = argparse.ArgumentParser(prog="prunewatch bench speed", description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=REAL_MODEL_DIR,
                        help="real model folder (default: SmolLM2-135M-Instruct in the prunewatch cache)")
    parser.add_argument("--no-real", action="store_true", help="skip the real model")
    parser.add_argument("--no-shape", action="store_true", help="skip the 0.67 B random-weight shape")
    parser.add_argument("--shape", type=str, default=None,
                        help="JSON of SpeedModelConfig fields overriding the 0.67 B shape (for small smoke runs)")
    parser.add_argument("--tokens", type=int, default=48, help="generated tokens per run (decode steps + 1)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each kind, order rotating")
    parser.add_argument("--bandwidth-mib", type=int, default=2048, help="read-bandwidth buffer (MiB)")
    parser.add_argument("--bandwidth-reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--calibration-dir", type=Path, default=None)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="JSON (default bench/results/speed-DEVICE.json)")
    parser.add_argument("--plot", type=Path, default=None, help="PNG (default bench/results/speed-DEVICE.png)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--no-compiled", action="store_true",
                        help="skip the compiled decode runs (each graph compiles for about a minute first)")
    parser.add_argument("--no-served", action="store_true",
                        help="skip the served runs (the real model through `prunewatch serve` on 127.0.0.1)")
    parser.add_argument("--report", type=Path, default=None, metavar="JSON",
                        help="measure nothing: print the table and the goals of a result written before "
                             "(and draw its plot to --plot, when given)")
    args = parser.parse_args(argv)
    if args.report is not None:
        try:
            data = json.loads(args.report.read_text())
            report = _report(data)
            if args.plot is not None:
                write_plot(data, args.plot)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            parser.error(f"--report {args.report}: not a readable `bench speed` result ({type(exc).__name__}: {exc})")
        sys.stdout.write(report + "\n")
        return 0
    if args.tokens < 3 or args.rounds < 1:
        parser.error("--tokens must be >= 3 and --rounds >= 1")
    if args.no_real and args.no_shape:
        parser.error("--no-real and --no-shape together leave nothing to measure")
    if args.bandwidth_mib < 1 or args.bandwidth_reps < 1 or (args.threads is not None and args.threads < 1):
        parser.error("--bandwidth-mib, --bandwidth-reps and --threads must be >= 1")
    shape = None
    if not args.no_shape:
        try:
            shape = SpeedModelConfig(**json.loads(args.shape or "{}"))
        except (ValueError, TypeError) as exc:  # bad JSON, unknown or out-of-range fields (pydantic's are ValueErrors)
            parser.error(f"--shape: {str(exc).strip().splitlines()[0]}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = None if args.no_real else args.model_dir
    if model_dir is not None and not (model_dir / "config.json").is_file():  # before minutes of bandwidth reads
        from prunewatch.engine.errors import ModelLoadError

        raise ModelLoadError(f"no model at {model_dir}; fetch SmolLM2-135M-Instruct with `prunewatch models pull "
                             "SmolLM2-135M-Instruct`, name another with --model-dir, or pass --no-real")
    data = run(model_dir, shape, new_tokens=args.tokens, rounds=args.rounds, bandwidth_mib=args.bandwidth_mib,
               bandwidth_reps=args.bandwidth_reps, calibration_dir=args.calibration_dir,
               out=args.out or RESULTS / f"speed-{args.device}.json",
               plot=None if args.no_plot else args.plot or RESULTS / f"speed-{args.device}.png", device=args.device,
               compiled=not args.no_compiled, served=not args.no_served)
    sys.stdout.write(_report(data) + "\n")
    return 0


def _report(data: dict) -> str:
    """The run table, the per-projection products when the result has them, and the goals."""
    projections = format_projection_table(data)
    return format_table(data) + (f"\n\n{projections}" if projections else "") + "\n\n" + format_goals(data)


if __name__ == "__main__":
    sys.exit(main())
