"""Measure a model's healthy operating range on held-out evaluation prompts (records/operating_range.py).

The evaluation prompts of the probed domains run twice on the target, each prompt dense (sensitivity 0) and at
the default sensitivity back to back (alternating which goes first), every served answer at the default scored
by the dense reference. From the two rounds: the ratio
at the default, the reference-scored agreement (95% interval over prompts, and each prompt's), the task pass
rate both ways, and the per-token times both ways. `prunewatch run` measures it once per model (weights
fingerprint) and caches it beside the calibration; `prunewatch tune` writes one from its sweep.

Measured at the engine's *default* pruning configuration only: a range measured on a configuration that is
itself the regression would call the regression healthy. A run configured otherwise (layer bypass, head
gating, another sparsity) uses the cached range, or none (the rules' fallbacks) and says so.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from statistics import fmean
from typing import Any

from prunewatch.collector.probe_round import run_round
from prunewatch.collector.reference import Reference
from prunewatch.probes import EVALUATION_PATH, ProbeSet, load_probes
from prunewatch.records.intervals import Interval, bootstrap_rate, bootstrap_share
from prunewatch.records.latency_window import time_per_output_token_s, ttft_per_prompt_token_s
from prunewatch.records.operating_range import (
    Derivation,
    OperatingRange,
    PhaseTimes,
    Source,
    median,
    range_path,
)
from prunewatch.records.quality_window import scored_answer
from prunewatch.records.results import ProbeResult

logger = logging.getLogger("prunewatch.collector")

RANGE_SETTINGS = ("activation_sparsity", "output_head_sparsity", "output_head_candidates", "influence_budget",
                  "head_gating", "head_budget", "sparsity_allocation", "sparsity_score", "sparsity_family_scale",
                  "layer_blacklist", "protect_edge_layers")
"""Engine settings that change what pruning does: a range records them, and is measured only at their defaults."""


def engine_configuration(settings: Any) -> dict[str, Any]:
    """The pruning settings of an EngineSettings, as plain data."""
    return {name: _plain(getattr(settings, name)) for name in RANGE_SETTINGS if hasattr(settings, name)}


def non_default_settings(settings: Any) -> dict[str, Any]:
    """The pruning settings that differ from their defaults (empty: the engine runs its default configuration)."""
    fields = type(settings).model_fields
    out = {}
    for name in RANGE_SETTINGS:
        if name not in fields:
            continue
        default = fields[name].get_default(call_default_factory=True)
        if _plain(getattr(settings, name)) != _plain(default):
            out[name] = _plain(getattr(settings, name))
    return out


def _plain(value: Any) -> Any:
    if hasattr(value, "value"):  # enums
        return value.value
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, dict):
        return dict(value)
    return value


def evaluation_probes(domains: Sequence[str], path: Path = EVALUATION_PATH) -> ProbeSet:
    """The evaluation prompts of `domains` (those the collector probes); all of them when none of the domains is
    in the set."""
    probes = load_probes(path)
    known = [d for d in domains if d in probes.domains]
    return probes.filter(known) if known else probes


def _interval(result: Interval | None) -> dict[str, float | int] | None:
    return None if result is None else result.to_dict()


def summarise(dense: Sequence[ProbeResult], pruned: Sequence[ProbeResult], *, model: str, fingerprint: str,
              source: Source, probe_set: ProbeSet, sensitivity: float, engine: Mapping[str, Any], device: str,
              derivation: Derivation = Derivation(), measured_at: str | None = None) -> OperatingRange:
    """The range from a dense and a default round over the same prompts (failed results left out)."""
    ok = [r for r in pruned if r.ok]
    if not ok:
        raise ValueError(f"no probe of {probe_set.source} succeeded at sensitivity {sensitivity:g}: nothing to measure")
    by_domain: dict[str, list[float]] = defaultdict(list)
    for r in ok:
        if r.pruning_ratio is not None:
            by_domain[r.domain].append(r.pruning_ratio)
    ratios = [v for values in by_domain.values() for v in values]
    scored = [(r, s) for r in ok if (s := scored_answer(r)) is not None]
    agreement = bootstrap_share([m for _, (m, _) in scored], [n for _, (_, n) in scored])
    dense_ok = [r for r in dense if r.ok]
    return OperatingRange(
        model=model, model_fingerprint=fingerprint, source=source,
        measured_at=measured_at or datetime.now(UTC).isoformat(timespec="seconds"),
        probe_set=f"evaluation prompts ({Path(probe_set.source).name}, domains {', '.join(probe_set.domains)})",
        probe_set_digest=probe_set.digest, prompts=len({r.probe_id for r in ok}), sensitivity=sensitivity,
        engine=dict(engine), device=device,
        ratio=fmean(ratios) if ratios else 0.0,
        ratio_max=max((fmean(v) for v in by_domain.values()), default=0.0),
        agreement=_interval(agreement),
        agreement_per_prompt=sorted(round(r.reference_agreement, 6) for r, _ in scored
                                    if r.reference_agreement is not None),
        pass_rate_dense=_interval(bootstrap_rate([r.task_passed for r in dense_ok if r.task_passed is not None])),
        pass_rate_default=_interval(bootstrap_rate([r.task_passed for r in ok if r.task_passed is not None])),
        dense=PhaseTimes(median(time_per_output_token_s(r) for r in dense_ok),
                         median(ttft_per_prompt_token_s(r) for r in dense_ok)),
        default=PhaseTimes(median(time_per_output_token_s(r) for r in ok),
                           median(ttft_per_prompt_token_s(r) for r in ok)),
        derivation=derivation)


@dataclass
class RangeOutcome:
    """What `load_or_measure` did: the range (None: none for this model), and why, in words."""

    range: OperatingRange | None
    how: str  # "loaded", "measured", "none"
    detail: str
    path: Path | None = None


def load_or_measure(target: Any, reference: Reference | None, probe_set: ProbeSet, *, directory: Path, model: str,
                    fingerprint: str, sensitivity: float, engine_settings: Any, device: str,
                    timeout_s: float | None = None, progress: Callable[[int, int], None] | None = None,
                    measure: bool = True) -> RangeOutcome:
    """The model's cached range, else measured now on `probe_set` at the default configuration and cached.

    `target` is an in-process target (`with_overrides`); `reference` scores the default round's answers;
    `progress(done, total)` hears of each prompt measured (a first measurement takes minutes on a CPU). Not
    measured (outcome "none") when the engine's pruning settings are not the defaults, or `measure` is off."""
    path = range_path(directory, model, fingerprint)
    if path.is_file():
        try:
            return RangeOutcome(OperatingRange.load(path), "loaded", f"operating range of {model} from {path}", path)
        except ValueError as exc:
            logger.warning("%s; measuring it again", exc)
    changed = non_default_settings(engine_settings)
    if changed:
        return RangeOutcome(None, "none", "no operating range is measured for a non-default pruning configuration "
                            f"({', '.join(f'{k}={v}' for k, v in changed.items())}): the alert rules use their "
                            "fallbacks for this model unless a range was measured before at the defaults", None)
    if not measure:
        return RangeOutcome(None, "none", "measuring the operating range is turned off: the alert rules use their "
                                          "fallbacks for this model", None)
    say = progress or (lambda _done, _total: None)
    dense_target = target.with_overrides(sensitivity=0.0, quality=False)
    pruned_target = target.with_overrides(sensitivity=sensitivity, quality=False)
    dense: list[ProbeResult] = []
    pruned: list[ProbeResult] = []
    for index, probe in enumerate(probe_set.probes):
        # Each prompt dense and pruned back to back, in alternating order: a neighbour's load on a shared host
        # slows both runs of a pair, not one configuration's whole round.
        one = ProbeSet((probe,), probe_set.source, probe_set.role)
        order = ((dense_target, None, dense), (pruned_target, reference, pruned))
        for runner, scorer, into in (order if index % 2 == 0 else order[::-1]):
            into.extend(run_round(runner, one, [], timeout_s=timeout_s, reference=scorer).results)
        say(index + 1, len(probe_set.probes))
    measured = summarise(dense, pruned, model=model, fingerprint=fingerprint, source="calibration",
                         probe_set=probe_set, sensitivity=sensitivity,
                         engine=engine_configuration(engine_settings), device=device)
    measured.save(path)
    return RangeOutcome(measured, "measured", f"operating range of {model} measured on {measured.prompts} evaluation "
                                              f"prompts, cached in {path}", path)
