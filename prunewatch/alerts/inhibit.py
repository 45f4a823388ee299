"""Alertmanager's inhibit_rules, read from prunewatch/alerts/alertmanager.yml and applied by the embedded evaluator.

Without Alertmanager nothing would mute PruningRatioQualityRisk while ProbeFailing fires, or the
warning red line while the critical line fires; reading the very rules Alertmanager uses keeps
both paths quiet in the same situations. Semantics as in Alertmanager: a firing alert that
matches a rule's target matchers is muted while another firing alert matches its source
matchers and has the same values for the `equal` labels.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from prunewatch.alerts._parser import Matcher
from prunewatch.alerts.ruleset import RuleFileError

_MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*')


@dataclass(frozen=True)
class LabelMatcher:
    """An Alertmanager matcher: the PromQL label matcher applied to one alert's label set."""

    name: str
    op: str
    value: str

    def matches(self, labels: Mapping[str, str]) -> bool:
        return Matcher(self.name, self.op, self.value).matches(labels.get(self.name, ""))


@dataclass(frozen=True)
class InhibitRule:
    source: tuple[LabelMatcher, ...]
    target: tuple[LabelMatcher, ...]
    equal: tuple[str, ...]

    def mutes(self, alert: Mapping[str, str], firing: Iterable[Mapping[str, str]]) -> bool:
        if not all(m.matches(alert) for m in self.target):
            return False
        for source in firing:
            if source is alert or dict(source) == dict(alert):
                continue  # an alert never inhibits itself
            if all(m.matches(source) for m in self.source) and \
                    all(source.get(name, "") == alert.get(name, "") for name in self.equal):
                return True
        return False


def parse_matcher(text: str) -> LabelMatcher:
    match = _MATCHER.fullmatch(text)
    if match is None:
        raise RuleFileError(f"matcher {text!r} is not of the form name=\"value\" (ops =, !=, =~, !~)")
    return LabelMatcher(match.group(1), match.group(2), match.group(3))


def load_inhibit_rules(path: Path) -> list[InhibitRule]:
    """The inhibit_rules of an Alertmanager configuration file (matchers syntax)."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise RuleFileError(f"cannot read Alertmanager config {path}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise RuleFileError(f"Alertmanager config {path} is not valid YAML: {str(exc).splitlines()[0]}") from exc
    rules = []
    for raw in data.get("inhibit_rules") or []:
        if "source_match" in raw or "target_match" in raw or "source_match_re" in raw or "target_match_re" in raw:
            raise RuleFileError(f"{path}: use source_matchers/target_matchers, not the deprecated *_match forms")
        rules.append(InhibitRule(source=tuple(parse_matcher(m) for m in raw.get("source_matchers") or []),
                                 target=tuple(parse_matcher(m) for m in raw.get("target_matchers") or []),
                                 equal=tuple(raw.get("equal") or ())))
    return rules


def is_muted(alert: Mapping[str, str], firing: Sequence[Mapping[str, str]], rules: list[InhibitRule]) -> bool:
    return any(rule.mutes(alert, firing) for rule in rules)
