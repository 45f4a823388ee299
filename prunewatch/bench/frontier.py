"""The pruning frontier: decode pruning ratio against quality for each mechanism and allocation, one run.

Every point runs every evaluation prompt through the engine as a request would (prunewatch.bench.mechanisms'
loop: configurations interleaved per probe, order rotating, dense first as the speed baseline) and
reports the measured decode-phase pruning ratio, the reference-scored agreement and pass rate of the
served answers with their intervals, held-out perplexity delta
(prunewatch.engine.quality.heldout_perplexity_delta on prunewatch/probes/heldout.txt) and decode speedup over dense.

Curves (each a sweep of the activation-sparsity target at sensitivity 1 unless named otherwise):
- teal-uniform: |x| thresholds, every layer the same target (TEAL's rule), the baseline;
- wina-uniform: |x| * ||W[:, i]|| thresholds (WINA), uniform;
- greedy: |x| thresholds, spread by the calibrated greedy plan (prunewatch/engine/sparse/allocation.py: sparsify
  first where the estimated output error grows least per skipped FLOP, fitted on the calibration set's prompts,
  never on the continuations or held-out text scored here);
- bypass, heads: layer bypass and head gating budgets alone;
- combination: the greedy plan with a small head budget;
- output head: the output head's default input sparsity and exact shortlist alone
  (prunewatch/engine/sparse/output_head.py);
- greedy + output head: the greedy plan with that output head, the engine default's mechanism at
  other targets;
- engine default: EngineSettings' defaults, nothing configured.
Each allocation/score pair has its own engine (the thresholds are fixed when the kernel is installed);
they share the interleaved loop, so machine load hits every point alike.

Quality is the reference-scored agreement of the served answers on the held-out evaluation set
(prunewatch.bench.mechanisms), with 95% intervals bootstrapped over prompts. The check written with the
results: for every agreement level a in [0.90, 0.99], the engine default's curve reaches a decode ratio
at least TEAL-uniform's (a curve's ratio at a is the highest measured decode ratio among its points with
agreement estimate >= a; dense counts as ratio 0 at agreement 1), and no TEAL point beats the default
curve's nearest point at or above its ratio with separated intervals. Differences are claimed only where
the intervals separate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from pydantic import Field

from prunewatch.bench._common import invocation
from prunewatch.bench.mechanisms import (
    DENSE,
    PROBE_MODEL,
    QUALITY_METHOD,
    RESULTS,
    Mechanisms,
    _aggregate,
    _engine,
    agreement_bar,
    finish_quality_figure,
    interval_text,
    measure_points,
)
from prunewatch.engine.paths import calibration_cache
from prunewatch.engine.settings import OUTPUT_HEAD_FULL_AT
from prunewatch.engine.sparse.calibration import SparsityCalibration
from prunewatch.engine.sparse.calibration_cache import sparsity_calibration_path
from prunewatch.probes import load_calibration_set

if TYPE_CHECKING:
    from prunewatch.engine.pruning_engine import PruningEngine

AGREEMENT_RANGE = (0.90, 0.99)
DOUBLE_FROM = 0.95  # at agreement >= this, the default's ratio must be >= 2x TEAL-uniform's
SWEEP_SENSITIVITY = 1.0
HEAD_CURVE = "greedy + output head"


class FrontierPoint(Mechanisms):
    """One point: budgets as in prunewatch.bench.mechanisms, plus the curve it belongs to and how sparsity is spread."""

    curve: str = "dense"
    allocation: str = Field("uniform", pattern="^(uniform|greedy)$")
    score: str = Field("magnitude", pattern="^(magnitude|wina)$")
    sensitivity: float = Field(SWEEP_SENSITIVITY, ge=0.0, le=1.0)

    @property
    def variant(self) -> tuple[str, str]:
        return (self.allocation, self.score)


def default_point() -> FrontierPoint:
    """The engine with nothing configured (EngineSettings' defaults)."""
    from prunewatch.engine.settings import EngineSettings

    fields = EngineSettings.model_fields
    return FrontierPoint(
        name="engine default", curve="engine default",
        influence_budget=fields["influence_budget"].default,
        head_budget=fields["head_budget"].default if fields["head_gating"].default else 0.0,
        activation_sparsity=fields["activation_sparsity"].default,
        output_head_sparsity=fields["output_head_sparsity"].default,
        allocation=fields["sparsity_allocation"].default, score=fields["sparsity_score"].default,
        sensitivity=fields["sensitivity"].default)


def _sweep(curve: str, levels: tuple[float, ...], **fields) -> tuple[FrontierPoint, ...]:
    return tuple(FrontierPoint(name=f"{curve} {level:g}", curve=curve, activation_sparsity=level, **fields)
                 for level in levels)


DENSE_POINT = FrontierPoint(name=DENSE.name, curve="dense", sensitivity=0.0)


def grid(levels: tuple[float, ...] = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4),
         greedy_levels: tuple[float, ...] = (0.1, 0.15, 0.2, 0.3, 0.4, 0.5),
         wina_levels: tuple[float, ...] = (0.3,),
         head_levels: tuple[float, ...] = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5)) -> tuple[FrontierPoint, ...]:
    """Every point of a frontier run; dense first. `head_levels`: greedy targets run with the output head."""
    head = default_point().output_head_sparsity
    return (
        DENSE_POINT,
        default_point(),
        *_sweep("teal-uniform", levels),
        *_sweep("wina-uniform", wina_levels, score="wina"),
        *_sweep("greedy", greedy_levels, allocation="greedy"),
        FrontierPoint(name=f"output head {head:g}", curve="output head", allocation="greedy",
                      output_head_sparsity=head),
        *_sweep(HEAD_CURVE, head_levels, allocation="greedy", output_head_sparsity=head),
        FrontierPoint(name="bypass 0.05", curve="bypass", influence_budget=0.05),
        FrontierPoint(name="heads 0.02", curve="heads", head_budget=0.02),
        FrontierPoint(name="greedy 0.3 + heads 0.02", curve="combination", allocation="greedy",
                      activation_sparsity=0.3, head_budget=0.02),
    )


def ratio_at(points: list[dict], agreement: float) -> float:
    """The highest decode ratio among points with agreement >= `agreement` (dense: ratio 0 at 1)."""
    return max([p["decode_pruning_ratio"] for p in points if p["agreement"] >= agreement - 1e-9] + [0.0])


def _separated(a: dict, b: dict) -> bool:
    """The agreement intervals of two points do not overlap: only then is a quality difference claimed."""
    return a["agreement_low"] > b["agreement_high"] or b["agreement_low"] > a["agreement_high"]


def check(rows: list[dict]) -> dict:
    """The engine default's curve against TEAL-uniform, with intervals.

    The envelope table reads each curve by its agreement estimates: for every level a in AGREEMENT_RANGE, the
    highest decode ratio among its points with agreement >= a. Estimates alone claim nothing: each TEAL point is
    also paired with the default curve's point of the nearest decode ratio at or above its own, and a quality
    difference is claimed only where the two agreement intervals separate. The default's curve is its own point
    plus every sweep point with its allocation, score and output-head target and no other mechanism."""
    default = next((r for r in rows if r["curve"] == "engine default"), None)
    if default is None:
        return {"met": False, "reason": "no engine default point"}
    teal = [r for r in rows if r["curve"] == "teal-uniform"]
    ours = [r for r in rows if r["curve"] == "engine default" or (
        r["allocation"] == default["allocation"] and r["score"] == default["score"] and r["curve"] != "dense"
        and r.get("output_head_sparsity_budget", 0.0) == default.get("output_head_sparsity_budget", 0.0)
        and r["influence_budget"] == 0.0 and r["head_budget"] == 0.0
        and (r["activation_sparsity_budget"] > 0 or r.get("output_head_sparsity_budget", 0.0) > 0))]
    steps = round((AGREEMENT_RANGE[1] - AGREEMENT_RANGE[0]) / 0.005)
    table = []
    for i in range(steps + 1):
        level = round(AGREEMENT_RANGE[0] + 0.005 * i, 3)
        theirs, mine = ratio_at(teal, level), ratio_at(ours, level)
        table.append({"agreement": level, "teal_uniform_ratio": round(theirs, 4), "default_ratio": round(mine, 4),
                      "dominates": mine >= theirs, "at_least_double": mine >= 2 * theirs if level >= DOUBLE_FROM else None})
    pairs = []
    for point in sorted(teal, key=lambda r: r["decode_pruning_ratio"]):
        above = [r for r in ours if r["decode_pruning_ratio"] >= point["decode_pruning_ratio"]]
        if not above:
            continue
        match = min(above, key=lambda r: r["decode_pruning_ratio"])
        separated = _separated(match, point)
        pairs.append({"teal": point["name"], "teal_ratio": point["decode_pruning_ratio"],
                      "teal_agreement": [point["agreement"], point["agreement_low"], point["agreement_high"]],
                      "ours": match["name"], "our_ratio": match["decode_pruning_ratio"],
                      "our_agreement": [match["agreement"], match["agreement_low"], match["agreement_high"]],
                      "separated": separated,
                      "claim": ("ours better" if separated and match["agreement"] > point["agreement"] else
                                "ours worse" if separated else "no difference claimed")})
    dominates = all(row["dominates"] for row in table)
    doubles = all(row["at_least_double"] for row in table if row["at_least_double"] is not None)
    teal_at_default = ratio_at(teal, default["agreement"])
    return {
        "rule": ("ratio at agreement a = highest measured decode ratio among a curve's points with agreement estimate "
                 ">= a (table); a quality difference between two points is claimed only where their 95% agreement "
                 "intervals separate (pairs)"),
        "default_curve": sorted(r["name"] for r in ours),
        "by_agreement": table,
        "pairs": pairs,
        "ours_better": sum(p["claim"] == "ours better" for p in pairs),
        "ours_worse": sum(p["claim"] == "ours worse" for p in pairs),
        "dominates": dominates,
        "doubles_from_0_95": doubles,
        "default_point": {"decode_pruning_ratio": default["decode_pruning_ratio"], "agreement": default["agreement"],
                          "agreement_interval": [default["agreement_low"], default["agreement_high"]],
                          "teal_uniform_ratio_at_its_agreement": round(teal_at_default, 4),
                          "times_teal": round(default["decode_pruning_ratio"] / teal_at_default, 2)
                          if teal_at_default > 0 else None},
        "met": dominates and not any(p["claim"] == "ours worse" for p in pairs),
    }


def run(points: tuple[FrontierPoint, ...], out: Path, plot: Path | None, *, model_dir: Path = PROBE_MODEL,
        calibration_dir: Path | None = None, max_new_tokens: int = 32, probes: int | None = None,
        heldout: bool = True) -> dict:
    """Run every point on every probe, interleaved; write the JSON (and plot); return it."""
    if points[0] != DENSE_POINT:
        raise ValueError("the first point must be 'dense': it is the speed baseline")
    started = time.time()
    calibration_dir = calibration_dir or calibration_cache()
    engines = {}
    for variant in dict.fromkeys(p.variant for p in points):
        allocation, score = variant
        engines[variant], probe_set = _engine(model_dir, calibration_dir, SWEEP_SENSITIVITY,
                                              sparsity_allocation=allocation, sparsity_score=score)
    bases = {variant: engine.settings for variant, engine in engines.items()}
    chosen = probe_set.probes[:probes] if probes else probe_set.probes

    def configure(point: FrontierPoint) -> PruningEngine:
        engine = engines[point.variant]
        engine.settings = bases[point.variant].model_copy(update={
            "influence_budget": point.influence_budget, "head_budget": point.head_budget,
            "activation_sparsity": point.activation_sparsity, "output_head_sparsity": point.output_head_sparsity,
            "sensitivity": 0.0 if point == DENSE_POINT else point.sensitivity})
        return engine

    collected, held = measure_points(points, chosen, configure, max_new_tokens=max_new_tokens, desc="frontier",
                                     heldout=heldout)
    for variant, engine in engines.items():
        engine.settings = bases[variant]
    dense = collected[DENSE_POINT.name]
    dense_tps = statistics.median(a.stats.decode_tokens_per_s for a in dense)
    rows = []
    for point in points:
        row = asdict(_aggregate(point, collected[point.name], dense, dense_tps, held[point.name]))
        row.update(curve=point.curve, allocation=point.allocation, score=point.score, sensitivity=point.sensitivity)
        rows.append(row)
    some = next(iter(engines.values()))
    greedy = next((e for (allocation, _), e in engines.items() if allocation == "greedy"), None)
    plan = _plan_summary(greedy, load_calibration_set().digest) if greedy is not None else None
    result = {
        "device": "cpu",
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": invocation("frontier"),
        "duration_s": round(time.time() - started, 1),
        "model": {"name": some.name, "fingerprint": some.loaded.fingerprint, "layers": some.num_layers},
        "max_new_tokens": max_new_tokens,
        "probes": [p.id for p in chosen],
        "torch_threads": torch.get_num_threads(),
        "method": {
            "decode_pruning_ratio": "measured: 1 - executed / dense linear FLOPs of the decode steps (LM head included; "
                                    "it skips work only at points with an output-head target)",
            **QUALITY_METHOD,
            "heldout_perplexity_delta_pct": "measured: teacher-forced NLL of prunewatch/probes/heldout.txt, pruned vs dense",
            "speedup": "measured: median decode tokens/s over the dense point's, same run, interleaved",
            "activation_sparsity_budget": "target at sensitivity 1; each request scales it by its effective "
                                          "sensitivity (prompt signals)",
            "output_head_sparsity_budget": f"configured output-head input sparsity (reached from effective "
                                           f"sensitivity {OUTPUT_HEAD_FULL_AT:g}), exact logits for the "
                                           f"{some.settings.output_head_candidates} highest approximate ones",
        },
        "rows": rows,
        "greedy_plan": plan,
        "check": check(rows),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    if plot is not None:
        write_plot(result, plot)
    return result


def _plan_summary(engine, corpus_digest: str) -> dict:
    """What the greedy calibration chose: its manifest (text hash, levels) and per-projection means."""
    path = sparsity_calibration_path(engine.calibration_path(corpus_digest), engine.settings.sparsity_allocation,
                                     engine.settings.sparsity_score)
    calibration = SparsityCalibration.load(path)
    if calibration.allocation is None:
        return {}
    plan = calibration.allocation
    by_projection = {}
    for target in (0.1, 0.2, 0.3, 0.4):
        chosen = plan.plan_at(target)
        groups: dict[str, list[float]] = {}
        for key, value in chosen.items():
            groups.setdefault(key.split(":", 1)[1].rsplit(".", 1)[-1], []).append(value)
        by_projection[f"{target:g}"] = {name: round(statistics.fmean(v), 3) for name, v in sorted(groups.items())}
    return {"method": plan.method, "cost": plan.cost, "text_sha256": plan.text_sha256, "tokens": plan.tokens,
            "corpus_digest": calibration.corpus_digest, "protected_layers": plan.protected_layers,
            "max_sparsity": plan.max_sparsity, "levels": [plan.levels[0], plan.levels[-1], len(plan.levels)],
            "mean_sparsity_by_projection": by_projection}


CURVE_STYLE = {"teal-uniform": ("tab:green", "o-"), "wina-uniform": ("tab:olive", "s--"),
               "greedy": ("tab:red", "o-"), "bypass": ("tab:blue", "^"), "heads": ("tab:orange", "v"),
               "combination": ("tab:purple", "D"), "output head": ("tab:brown", "P"), HEAD_CURVE: ("black", "o-"), "engine default": ("black", "*"),
               "dense": ("grey", "x")}


def write_plot(result: dict, path: Path) -> None:
    """Agreement and held-out perplexity delta against the decode pruning ratio, one line per curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (agree, ppl) = plt.subplots(1, 2, figsize=(15, 6.2))
    for curve, (color, style) in CURVE_STYLE.items():
        rows = sorted((r for r in result["rows"] if r["curve"] == curve), key=lambda r: r["decode_pruning_ratio"])
        if not rows:
            continue
        for r in rows:
            agreement_bar(agree, r, color)
        for axis, key in ((agree, "agreement"), (ppl, "heldout_perplexity_delta_pct")):
            axis.plot([r["decode_pruning_ratio"] for r in rows], [r[key] for r in rows], style, color=color,
                      label=curve, ms=12 if curve == "engine default" else 6)
            for r in rows:
                axis.annotate(f"{r['activation_sparsity_budget']:g}" if curve in ("teal-uniform", "greedy",
                                                                                   "wina-uniform", HEAD_CURVE)
                              else r["name"],
                              (r["decode_pruning_ratio"], r[key]), fontsize=7, xytext=(3, 3),
                              textcoords="offset points")
    agree.axhspan(*AGREEMENT_RANGE, color="grey", alpha=0.08, label="checked agreement range")
    verdict = "met" if result["check"].get("met") else "not met"
    finish_quality_figure(fig, agree, ppl, path, "reference-scored agreement of the served answers (95% interval)",
                          f"{result['model']['name']}: pruning frontier ({len(result['probes'])} held-out prompts, "
                          f"up to {result['max_new_tokens']} tokens); default vs TEAL-uniform check {verdict}")


def format_table(result: dict) -> str:
    lines = ["| point | curve | decode ratio | agreement [95% CI] | pass rate [95% CI] | ppl delta (held-out) "
             "| speedup |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['name']} | {r['curve']} | {r['decode_pruning_ratio']:.3f} "
                     f"| {interval_text(r['agreement'], r['agreement_low'], r['agreement_high'])} "
                     f"| {interval_text(r['pass_rate'], r['pass_low'], r['pass_high'])} "
                     f"| {r['heldout_perplexity_delta_pct']:+.2f}% | {r['speedup']:.2f} |")
    return "\n".join(lines)


def _levels(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(",") if v.strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prunewatch bench frontier", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=PROBE_MODEL, help="model folder (default: the probe model)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default: bench/results/frontier-<model folder name>.json)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG beside the JSON")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--probes", type=int, default=None, help="first N probes only (default: all)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--levels", type=_levels, default=(0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4),
                        help="TEAL-uniform targets, comma-separated")
    parser.add_argument("--greedy-levels", type=_levels, default=(0.1, 0.15, 0.2, 0.3, 0.4, 0.5),
                        help="greedy-plan targets, comma-separated")
    parser.add_argument("--wina-levels", type=_levels, default=(0.3,), help="WINA-uniform targets")
    parser.add_argument("--head-levels", type=_levels, default=(0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5),
                        help="greedy-plan targets run with the default output head, comma-separated")
    parser.add_argument("--calibration-dir", type=Path, default=None)
    parser.add_argument("--no-heldout", action="store_true", help="skip held-out perplexity (reported as NaN)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = args.out or RESULTS / f"frontier-{args.model.resolve().name}.json"
    result = run(grid(args.levels, args.greedy_levels, args.wina_levels, args.head_levels), out,
                 None if args.no_plot else out.with_suffix(".png"), model_dir=args.model,
                 calibration_dir=args.calibration_dir, max_new_tokens=args.max_new_tokens, probes=args.probes,
                 heldout=not args.no_heldout)
    print(format_table(result))
    check_result = result["check"]
    print(f"default dominates TEAL-uniform on {list(AGREEMENT_RANGE)}: {check_result.get('dominates')}; "
          f">= 2x from {DOUBLE_FROM}: {check_result.get('doubles_from_0_95')}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
