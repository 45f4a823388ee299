"""The decode-speed goals a `bench speed` result is held to, checked from the result's own figures.

A goal is met or missed run by run and estimator by estimator, never as one hand-picked number: on a
shared host the estimators disagree (a ratio of medians may set a slow round of one run against a quiet
round of the other; within-round ratios and the bandwidth paired with each round cancel what slowed a
whole round, while the best bandwidth sample is the ceiling of a quieter moment), so each check names
the figure of the result it read, and a goal's verdict says whether every check met it, some did, or
none. Nothing here measures: the checks of a result written earlier are the same when computed again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

ENGINE_RUNS = ("dense", "pruned", "dense-compiled", "pruned-compiled")
REAL_WEIGHTS = "real weights"
"""A model's `weights` fact in a result when it is pretrained (prunewatch.bench.speed writes it); any other value is
the random-weight benchmark shape."""

# The estimators a goal can be read under: (label, field of a result row).
SPEEDUP_VS_PLAIN = (("ratio of medians", "speedup_vs_plain"), ("within rounds", "speedup_vs_plain_paired"))
SHARE_OF_BANDWIDTH = (("median round vs best sample", "fraction_of_bandwidth"),
                      ("paired with each round", "fraction_of_paired_bandwidth"))
SHARE_OF_BOUND = (("ratio of medians", "fraction_of_bound"), ("within rounds", "fraction_of_bound_paired"))
SERVED_VS_IN_PROCESS = (("ratio of medians", "served_vs_in_process"), ("within rounds", "served_vs_in_process_paired"))
SERVED_RUNS = ("served-dense", "served-pruned")


@dataclass(frozen=True)
class Goal:
    """One line of what decoding must reach: `runs` of the real model or of the random-weight shape
    reach `target` under every estimator in `estimators`."""

    key: str
    text: str
    real_model: bool  # the pretrained model (True) or the random-weight benchmark shape (False)
    runs: tuple[str, ...]
    target: float
    estimators: tuple[tuple[str, str], ...]
    percent: bool = False  # shown as a percentage


GOALS: tuple[Goal, ...] = (
    Goal("dense_vs_plain", "engine dense decode >= 0.98x plain transformers (real model)", True,
         ("dense", "dense-compiled"), 0.98, SPEEDUP_VS_PLAIN),
    Goal("real_model_bandwidth", "dense and pruned decode of the real model >= 50% of the read bandwidth", True,
         ENGINE_RUNS, 0.50, SHARE_OF_BANDWIDTH, percent=True),
    Goal("shape_bandwidth", "dense and pruned decode of the benchmark shape >= 70% of the read bandwidth", False,
         ENGINE_RUNS, 0.70, SHARE_OF_BANDWIDTH, percent=True),
    Goal("default_vs_bound", "default operating point >= 0.9 of its bound 1/(1-s f) (real model)", True,
         ("pruned", "pruned-compiled"), 0.90, SHARE_OF_BOUND),
    Goal("served_vs_in_process", "served decode (prunewatch serve, streamed, client-timed) >= 0.95x the in-process "
         "main-thread decode, dense and default (real model)", True, SERVED_RUNS, 0.95, SERVED_VS_IN_PROCESS),
)


@dataclass(frozen=True)
class GoalCheck:
    """One run of one model against one goal under one estimator; value None: the result has no such figure."""

    goal: str
    model: str
    run: str
    estimator: str
    field: str
    value: float | None
    target: float

    @property
    def met(self) -> bool | None:
        return None if self.value is None else self.value >= self.target


def _is_real(result: dict, model: str) -> bool:
    return result.get("models", {}).get(model, {}).get("weights") == REAL_WEIGHTS


def bandwidth_goal(result: dict, model: str, goals: Sequence[Goal] = GOALS) -> float:
    """The share of the read bandwidth `model`'s engine runs are held to (the real model's or the shape's)."""
    real = _is_real(result, model)
    return next(goal.target for goal in goals if goal.estimators == SHARE_OF_BANDWIDTH and goal.real_model == real)


def check_goals(result: dict, goals: Sequence[Goal] = GOALS) -> list[GoalCheck]:
    """Every goal against every run of every model it applies to, under each of its estimators."""
    checks = []
    for goal in goals:
        for row in result.get("rows", []):
            if row["run"] not in goal.runs or _is_real(result, row["model"]) != goal.real_model:
                continue
            for label, key in goal.estimators:
                value = row.get(key)
                checks.append(GoalCheck(goal.key, row["model"], row["run"], label, key,
                                        None if value is None else float(value), goal.target))
    return checks


def verdict(checks: Sequence[GoalCheck]) -> str:
    """'met' (every check with a figure), 'partly met' (some), 'not met' (none), 'not measured' (no figure)."""
    known = [check.met for check in checks if check.met is not None]
    if not known:
        return "not measured"
    return "met" if all(known) else "partly met" if any(known) else "not met"


def goals_summary(result: dict, goals: Sequence[Goal] = GOALS) -> list[dict]:
    """Per goal: its text, target, verdict and checks, as stored beside the rows in the result's JSON."""
    checks = check_goals(result, goals)
    summary = []
    for goal in goals:
        mine = [check for check in checks if check.goal == goal.key]
        summary.append({"goal": goal.key, "text": goal.text, "target": goal.target, "verdict": verdict(mine),
                        "checks": [{**asdict(check), "met": check.met} for check in mine]})
    return summary


def format_goals(result: dict, goals: Sequence[Goal] = GOALS) -> str:
    """The goals as text: a verdict line per goal, then each run's figure under each estimator."""
    lines = []
    for goal, entry in zip(goals, goals_summary(result, goals)):
        lines.append(f"{entry['verdict'].upper():>12}  {goal.text}")
        by_run: dict[tuple[str, str], list[dict]] = {}
        for check in entry["checks"]:
            by_run.setdefault((check["model"], check["run"]), []).append(check)
        for (model, run), checks in by_run.items():
            figures = []
            for check in checks:
                value = check["value"]
                shown = "-" if value is None else f"{value:.1%}" if goal.percent else f"{value:.3f}"
                mark = "" if check["met"] is None else " ok" if check["met"] else " below"
                figures.append(f"{shown}{mark} ({check['estimator']})")
            lines.append(f"{'':>14}{model} {run}: " + ", ".join(figures))
    return "\n".join(lines)
