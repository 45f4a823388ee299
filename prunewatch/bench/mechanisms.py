"""Pruning mechanisms: pruning ratio, the quality of the served answers and decode speed at one sensitivity.

Each configuration sets the budgets of the mechanisms (layer bypass: influence_budget; head gating:
head_budget; activation sparsity: activation_sparsity; the output-head shortlist) and runs every
prompt of the held-out evaluation set (prunewatch/probes/evaluation.yaml, never calibrated on) through
the engine exactly as a request would run. Configurations run interleaved per prompt (the order
rotates), so machine load hits them alike; the dense configuration is the speed baseline of the same
run.

Every figure is measured: the ratio from the executed linear work; quality is the reference-scored
agreement of the answer each configuration served (the share of its tokens equal to the dense
model's argmax given the served prefix, one teacher-forced dense pass), pooled over prompts with a
95% interval bootstrapped over prompts, and the task pass rate of the prompts that carry a check,
with its interval; held-out perplexity on prunewatch/probes/heldout.txt; tokens/s from wall time.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from prunewatch.bench._common import RESULTS_DIR, invocation
from prunewatch.engine.model_store import PROBE_MODEL_DIR
from prunewatch.engine.paths import calibration_cache
from prunewatch.engine.quality import heldout_perplexity_delta
from prunewatch.probes import heldout_texts
from prunewatch.records.intervals import bootstrap_rate, bootstrap_share

if TYPE_CHECKING:
    from prunewatch.engine.pruning_engine import PruningEngine

RESULTS = RESULTS_DIR
QUALITY_METHOD = {
    "agreement": ("measured: reference-scored agreement of the served answers (share of answer tokens equal to the "
                  "dense model's argmax given the served prefix, one teacher-forced dense pass), pooled over the "
                  "evaluation prompts; agreement_low / _high: 95% interval bootstrapped over prompts"),
    "pass_rate": "measured: share of the prompts with a check whose served answer passed it, 95% interval likewise",
    "changed_answers": "measured: share of prompts whose served answer differs from the dense configuration's",
    "served_nll": "measured: mean NLL (nats/token) of the served answers under the dense model",
}
PROBE_MODEL = PROBE_MODEL_DIR


class Mechanisms(BaseModel):
    """One configuration: the budget of each mechanism at sensitivity 1 (scaled per request)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    influence_budget: float = Field(0.0, ge=0.0, le=1.0)
    head_budget: float = Field(0.0, ge=0.0, le=1.0)
    activation_sparsity: float = Field(0.0, ge=0.0, lt=1.0)
    output_head_sparsity: float = Field(0.0, ge=0.0, le=0.9)  # prunewatch.engine.sparse.output_head; 0: dense head


def interleaved(probes: Sequence, variants: Sequence) -> Iterator[tuple]:
    """(probe, variant) pairs, every variant once per probe, the order rotated by one per probe: drift in the
    machine's speed spreads over every variant instead of tilting the last ones."""
    for index, probe in enumerate(probes):
        shift = index % len(variants)
        for variant in list(variants[shift:]) + list(variants[:shift]):
            yield probe, variant


def engine_defaults() -> Mechanisms:
    """The budgets an engine gets when nothing is configured (EngineSettings' defaults)."""
    from prunewatch.engine.settings import EngineSettings

    fields = EngineSettings.model_fields
    return Mechanisms(name="engine defaults", influence_budget=fields["influence_budget"].default,
                      head_budget=fields["head_budget"].default if fields["head_gating"].default else 0.0,
                      activation_sparsity=fields["activation_sparsity"].default,
                      output_head_sparsity=fields["output_head_sparsity"].default)


DENSE = Mechanisms(name="dense")
GRID: tuple[Mechanisms, ...] = (
    DENSE,
    engine_defaults(),
    Mechanisms(name="bypass 0.15", influence_budget=0.15),
    Mechanisms(name="bypass 0.25", influence_budget=0.25),
    Mechanisms(name="bypass 0.5", influence_budget=0.5),
    Mechanisms(name="heads 0.05", head_budget=0.05),
    Mechanisms(name="heads 0.1", head_budget=0.1),
    Mechanisms(name="heads 0.25", head_budget=0.25),
    Mechanisms(name="sparsity 0.2", activation_sparsity=0.2),
    Mechanisms(name="sparsity 0.5", activation_sparsity=0.5),
    Mechanisms(name="sparsity 0.8", activation_sparsity=0.8),
    Mechanisms(name="sparsity 0.95", activation_sparsity=0.95),
    Mechanisms(name="bypass 0.1 + heads 0.05 + sparsity 0.8", influence_budget=0.1, head_budget=0.05,
               activation_sparsity=0.8),
    Mechanisms(name="bypass 0.15 + heads 0.05 + sparsity 0.8", influence_budget=0.15, head_budget=0.05,
               activation_sparsity=0.8),
    Mechanisms(name="bypass 0.5 + heads 0.25 + sparsity 0.8", influence_budget=0.5, head_budget=0.25,
               activation_sparsity=0.8),
)
QUALITY_TARGET = {"perplexity_delta_pct": 2.0, "agreement": 0.97, "agreement_low": 0.95}
"""What "meets quality" means: reference-scored agreement of the served answers >= 0.97 with its interval's
lower bound >= 0.95, on the evaluation set, and held-out perplexity within +2%."""


@dataclass
class MechanismRow:
    """Aggregates of one configuration over every prompt."""

    name: str
    influence_budget: float
    head_budget: float
    activation_sparsity_budget: float
    pruning_ratio: float  # mean over prompts
    pruning_ratio_min: float
    pruning_ratio_max: float
    prefill_pruning_ratio: float  # mean over prompts, prompt forward pass only
    decode_pruning_ratio: float  # mean over prompts, decode steps only
    layers_bypassed: float  # mean per request
    heads_gated: float  # mean per request
    activation_sparsity: float  # mean measured share of the sparse layers' work skipped
    agreement: float  # reference-scored agreement of the served answers, pooled over prompts
    agreement_low: float  # its 95% interval, bootstrapped over prompts
    agreement_high: float
    agreement_min: float  # the lowest prompt's
    prompts: int  # prompts scored
    tokens: int  # served answer tokens scored
    served_nll: float  # mean NLL (nats/token) of the served answers under the dense model
    changed_answers: float  # share of prompts whose served answer is not the dense answer
    pass_rate: float | None  # share of checked prompts whose answer passed its check
    pass_low: float | None
    pass_high: float | None
    checked: int  # prompts with a check
    heldout_perplexity_delta_pct: float  # on prunewatch/probes/heldout.txt, text the calibration never saw
    decode_tokens_per_s: float  # median over prompts
    speedup: float  # decode tokens/s over the dense configuration's, same run
    meets_quality: bool  # QUALITY_TARGET
    requests: int
    output_head_sparsity_budget: float = 0.0  # configured output-head target (prunewatch.engine.sparse.output_head)


@dataclass
class ServedAnswer:
    """One request of one configuration: what it cost and what it served."""

    probe_id: str
    stats: Any  # RequestStats, its quality scored against the dense model ("on")
    served_ids: list[int]
    passed: bool | None  # the prompt's check on the served text; None: no check


def _engine(model_dir: Path, calibration_dir: Path, sensitivity: float, **settings):
    """A calibrated CPU engine with head gating and the sparse kernel installed; `settings` are further
    EngineSettings fields (e.g. sparsity_allocation, sparsity_score)."""
    from prunewatch.engine import EngineSettings, PruningEngine
    from prunewatch.probes import EVALUATION_PATH, load_calibration_set, load_probes

    calibration = load_calibration_set()
    engine = PruningEngine.load(EngineSettings(model_dir=model_dir, device="cpu", calibration_dir=calibration_dir,
                                               sensitivity=sensitivity, log_level="NONE", head_gating=True,
                                               **settings))
    engine.load_or_calibrate(calibration.calibration_texts(), calibration.digest)
    engine.enable_activation_sparsity(calibration.calibration_texts(), calibration.digest)
    engine.enable_output_head()
    return engine, load_probes(EVALUATION_PATH)  # quality is read on held-out prompts, never on calibration


def _aggregate(config: Mechanisms, answers: list[ServedAnswer], dense: list[ServedAnswer], dense_tps: float,
               heldout_delta: float) -> MechanismRow:
    stats = [a.stats for a in answers]
    scored = [s.quality for s in stats if s.quality is not None]
    interval = bootstrap_share([round(q.reference_agreement * q.reference_tokens) for q in scored],
                               [q.reference_tokens for q in scored])
    rate = bootstrap_rate([a.passed for a in answers if a.passed is not None])
    dense_ids = {a.probe_id: a.served_ids for a in dense}
    ratios = [s.pruning_ratio for s in stats]
    tps = statistics.median(s.decode_tokens_per_s for s in stats)
    agreement = interval.estimate if interval else float("nan")
    low = interval.low if interval else float("nan")
    return MechanismRow(
        name=config.name, influence_budget=config.influence_budget, head_budget=config.head_budget,
        activation_sparsity_budget=config.activation_sparsity,
        pruning_ratio=round(statistics.fmean(ratios), 4), pruning_ratio_min=round(min(ratios), 4),
        pruning_ratio_max=round(max(ratios), 4),
        prefill_pruning_ratio=round(statistics.fmean(s.prefill_pruning_ratio for s in stats), 4),
        decode_pruning_ratio=round(statistics.fmean(s.decode_pruning_ratio for s in stats), 4),
        layers_bypassed=round(statistics.fmean(len(s.layers_bypassed) for s in stats), 2),
        heads_gated=round(statistics.fmean(s.heads_gated for s in stats), 2),
        activation_sparsity=round(statistics.fmean(s.activation_sparsity for s in stats), 4),
        agreement=round(agreement, 4), agreement_low=round(low, 4),
        agreement_high=round(interval.high if interval else float("nan"), 4),
        agreement_min=round(min((q.reference_agreement for q in scored), default=float("nan")), 4),
        prompts=interval.prompts if interval else 0, tokens=interval.tokens if interval else 0,
        served_nll=round(statistics.fmean(q.served_nll for q in scored), 4) if scored else float("nan"),
        changed_answers=round(statistics.fmean(a.served_ids != dense_ids.get(a.probe_id) for a in answers), 4),
        pass_rate=round(rate.estimate, 4) if rate else None, pass_low=round(rate.low, 4) if rate else None,
        pass_high=round(rate.high, 4) if rate else None, checked=rate.prompts if rate else 0,
        heldout_perplexity_delta_pct=round(heldout_delta, 3),
        decode_tokens_per_s=round(tps, 2), speedup=round(tps / dense_tps, 3) if dense_tps > 0 else 0.0,
        meets_quality=(heldout_delta <= QUALITY_TARGET["perplexity_delta_pct"]
                       and agreement >= QUALITY_TARGET["agreement"] and low >= QUALITY_TARGET["agreement_low"]),
        requests=len(stats),
        output_head_sparsity_budget=config.output_head_sparsity,
    )


def _configured(base, config: Mechanisms, sensitivity: float):
    """The engine settings of one configuration (dense runs at sensitivity 0)."""
    return base.model_copy(update={
        "influence_budget": config.influence_budget,
        "head_budget": config.head_budget,
        "activation_sparsity": config.activation_sparsity,
        "output_head_sparsity": config.output_head_sparsity,
        "sensitivity": 0.0 if config == DENSE else sensitivity,
    })


PointT = TypeVar("PointT", bound=Mechanisms)


def measure_points(points: Sequence[PointT], probes: Sequence, configure: Callable[[PointT], PruningEngine], *,
                   max_new_tokens: int, desc: str, heldout: bool = True
                   ) -> tuple[dict[str, list[ServedAnswer]], dict[str, float]]:
    """Every point on every prompt, interleaved, each served answer scored against the dense model and by the
    prompt's check, then each point's held-out perplexity delta (NaN when `heldout` is False). A prompt's answer
    is at most `max_new_tokens` long (its own max_tokens when shorter). `configure(point)` returns the engine set
    up for that point. Returns (served answers per point name, held-out delta per point name)."""
    from tqdm import tqdm

    collected: dict[str, list[ServedAnswer]] = {p.name: [] for p in points}
    with tqdm(total=len(probes) * len(points), desc=desc, unit="request", file=sys.stderr) as bar:
        for probe, point in interleaved(probes, points):
            engine = configure(point)
            result = engine.generate(probe.prompt, system=probe.system or None,
                                     max_new_tokens=min(probe.max_tokens, max_new_tokens), quality="on")
            passed = probe.check.passed(result.text) if probe.check is not None else None
            collected[point.name].append(ServedAnswer(probe.id, result.stats, list(result.served_ids or []), passed))
            bar.update(1)
    held: dict[str, float] = {}
    for point in tqdm(points, desc="held-out perplexity", unit="point", file=sys.stderr):
        held[point.name] = heldout_perplexity_delta(configure(point), heldout_texts()) if heldout else float("nan")
    return collected, held


def run(grid: tuple[Mechanisms, ...], out: Path, plot: Path | None, *, model_dir: Path = PROBE_MODEL,
        calibration_dir: Path | None = None, sensitivity: float = 0.5, max_new_tokens: int = 32,
        probes: int | None = None) -> dict:
    """Run every configuration on every probe, interleaved; write the JSON (and plot); return it."""
    if grid[0] != DENSE:
        raise ValueError("the first configuration must be 'dense': it is the speed baseline")
    started = time.time()
    calibration_dir = calibration_dir or calibration_cache()
    engine, probe_set = _engine(model_dir, calibration_dir, sensitivity)
    chosen = probe_set.probes[:probes] if probes else probe_set.probes
    base = engine.settings

    def configure(config: Mechanisms) -> PruningEngine:
        engine.settings = _configured(base, config, sensitivity)
        return engine

    collected, heldout = measure_points(grid, chosen, configure, max_new_tokens=max_new_tokens, desc="mechanisms")
    engine.settings = base
    dense = collected[DENSE.name]
    dense_tps = statistics.median(a.stats.decode_tokens_per_s for a in dense)
    rows = [_aggregate(c, collected[c.name], dense, dense_tps, heldout[c.name]) for c in grid]
    feasible = [r for r in rows if r.meets_quality]
    best = max(feasible, key=lambda r: r.pruning_ratio) if feasible else None
    defaults = next((r for r in rows if r.name == "engine defaults"), None)
    result = {
        "device": "cpu",
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": invocation("mechanisms"),
        "duration_s": round(time.time() - started, 1),
        "model": {"name": engine.name, "fingerprint": engine.loaded.fingerprint,
                  "layers": engine.num_layers, "heads": engine.head_gating.shape.heads if engine.head_gating else None},
        "sensitivity": sensitivity,
        "max_new_tokens": max_new_tokens,
        "probes": [p.id for p in chosen],
        "method": {
            "pruning_ratio": "measured: 1 - executed / dense linear FLOPs of the whole request (prefill + decode)",
            **QUALITY_METHOD,
            "heldout_perplexity_delta_pct": ("measured: teacher-forced NLL of prunewatch/probes/heldout.txt (never calibrated "
                                             "on), each passage planned as a request, pruned vs dense"),
            "speedup": "measured: median decode tokens/s over the dense configuration's in the same run",
        },
        "quality_target": QUALITY_TARGET,
        "rows": [asdict(r) for r in rows],
        "best_within_quality": asdict(best) if best else None,
        "target": {
            "target": ("engine defaults keep quality on the evaluation set: reference-scored agreement >= 0.97 with its "
                       "interval's lower bound >= 0.95, and held-out perplexity +<= 2%"),
            "defaults": asdict(defaults) if defaults else None,
            "met": bool(defaults and defaults.meets_quality),
        },
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    if plot is not None:
        write_plot(result, plot)
    return result


def write_plot(result: dict, path: Path) -> None:
    """Agreement and perplexity delta against the measured pruning ratio, one point per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (agree, ppl) = plt.subplots(1, 2, figsize=(15, 6.2))
    target = result["quality_target"]
    for row in result["rows"]:
        kinds = [k for k, v in (("bypass", row["influence_budget"]), ("heads", row["head_budget"]),
                                ("sparsity", row["activation_sparsity_budget"])) if v > 0]
        single: dict[tuple[str, ...], str] = {("bypass",): "tab:blue", ("heads",): "tab:orange",
                                               ("sparsity",): "tab:green"}
        color = single.get(tuple(kinds), "tab:purple" if kinds else "black")
        agreement_bar(agree, row, color)
        for axis, key in ((agree, "agreement"), (ppl, "heldout_perplexity_delta_pct")):
            axis.scatter(row["decode_pruning_ratio"], row[key], color=color, s=40, zorder=3)
            axis.annotate(row["name"], (row["decode_pruning_ratio"], row[key]), fontsize=7, xytext=(4, 3),
                          textcoords="offset points")
    agree.axhline(target["agreement"], color="grey", ls="--", lw=1, label=f"agreement floor {target['agreement']}")
    ppl.axhline(target["perplexity_delta_pct"], color="grey", ls="--", lw=1,
                label=f"perplexity +{target['perplexity_delta_pct']}%")
    agree.axhline(target["agreement_low"], color="grey", ls=":", lw=1,
                  label=f"interval's lower bound {target['agreement_low']}")
    finish_quality_figure(fig, agree, ppl, path, "reference-scored agreement of the served answers (95% interval)",
                          f"{result['model']['name']}: mechanisms at sensitivity {result['sensitivity']} "
                          f"({len(result['probes'])} held-out prompts, up to {result['max_new_tokens']} tokens each)")


def agreement_bar(axis, row: dict, color: str) -> None:
    """The agreement's 95% interval as a vertical bar at the point's decode ratio."""
    low, high = row.get("agreement_low"), row.get("agreement_high")
    if low is None or high is None or math.isnan(low) or math.isnan(high):
        return
    axis.plot([row["decode_pruning_ratio"]] * 2, [low, high], color=color, lw=1.2, alpha=0.6, zorder=2)


def finish_quality_figure(fig, agree, ppl, path: Path, agreement_label: str, title: str) -> None:
    """Axes of a ratio-vs-quality figure (agreement left, held-out perplexity right), titled and saved."""
    import matplotlib.pyplot as plt

    for axis in (agree, ppl):
        axis.set_xlabel("decode pruning ratio (measured, linear FLOPs of the decode steps)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8, loc="best")
    agree.set_ylabel(agreement_label)
    ppl.set_ylabel("held-out perplexity delta, %")
    ppl.set_yscale("symlog", linthresh=1.0)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def interval_text(value: float | None, low: float | None, high: float | None) -> str:
    """`0.971 [0.955, 0.984]`, or n/a."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.3f} [{low:.3f}, {high:.3f}]"


def format_table(result: dict) -> str:
    lines = ["| configuration | ratio | decode ratio | layers | heads | act. sparsity | agreement [95% CI] "
             "| pass rate [95% CI] | answers changed | ppl delta (held-out) | speedup |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['name']} | {r['pruning_ratio']:.3f} | {r['decode_pruning_ratio']:.3f} "
                     f"| {r['layers_bypassed']:.1f} | {r['heads_gated']:.1f} | {r['activation_sparsity']:.3f} "
                     f"| {interval_text(r['agreement'], r['agreement_low'], r['agreement_high'])} "
                     f"| {interval_text(r['pass_rate'], r['pass_low'], r['pass_high'])} "
                     f"| {r['changed_answers']:.0%} "
                     f"| {r['heldout_perplexity_delta_pct']:+.2f}% | {r['speedup']:.2f} |")
    first = result["rows"][0]
    lines.append(f"\n{first['prompts']} prompts ({first['checked']} with a check), "
                 f"{sum(r['tokens'] for r in result['rows']) // max(1, len(result['rows']))} answer tokens per "
                 "configuration on average; intervals bootstrapped over prompts.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prunewatch bench mechanisms", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "mechanisms-cpu.json", help="JSON path")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG beside the JSON")
    parser.add_argument("--model", type=Path, default=PROBE_MODEL, help="model folder (default: the probe model)")
    parser.add_argument("--sensitivity", type=float, default=0.5, help="request sensitivity (default 0.5)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--only", default=None,
                        help="comma-separated configuration names to run (dense always runs first); default: all")
    args = parser.parse_args(argv)
    if not 0.0 < args.sensitivity <= 1.0:
        parser.error(f"--sensitivity must be in (0, 1], got {args.sensitivity}")
    torch.set_num_threads(args.threads)
    grid = GRID
    if args.only:
        wanted = {name.strip() for name in args.only.split(",") if name.strip()}
        unknown = wanted - {c.name for c in GRID}
        if unknown:
            parser.error(f"unknown configuration(s) {sorted(unknown)}; known: {[c.name for c in GRID]}")
        grid = (DENSE, *(c for c in GRID if c.name in wanted and c != DENSE))
    result = run(grid, args.out, None if args.no_plot else args.out.with_suffix(".png"), model_dir=args.model,
                 sensitivity=args.sensitivity, max_new_tokens=args.max_new_tokens)
    print(format_table(result))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
