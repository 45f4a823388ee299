"""Load a Prometheus rule file for the embedded evaluator and sort its rules into runnable or not.

A rule is runnable when its expression evaluates on stored probe results and its annotations
render; the check is a dry run over an empty store, so it exercises exactly the code that later
runs. Rules that are not runnable are listed with the reason (`RuleFile.unsupported`), never
dropped silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from promql_parser import Expr

from prunewatch.alerts._engine import Engine, EvaluationError, RecordedRule
from prunewatch.alerts._parser import PromQLSyntaxError, UnsupportedExpression, longest_range, parse
from prunewatch.alerts._series import StoreSeries
from prunewatch.alerts._templates import UnsupportedTemplate, check
from prunewatch.alerts.durations import parse_duration


class RuleFileError(ValueError):
    """The rule file is missing, not YAML, or not shaped like Prometheus rule groups."""


@dataclass(frozen=True)
class AlertRule:
    """One alerting rule as written in the file."""

    name: str
    expr: str
    node: Expr
    hold_s: float
    labels: tuple[tuple[str, str], ...]
    annotations: tuple[tuple[str, str], ...]
    group: str


@dataclass(frozen=True)
class UnsupportedRule:
    """An alerting rule the embedded evaluator will not evaluate, and why."""

    name: str
    group: str
    expr: str
    reason: str

    def __str__(self) -> str:
        return f"{self.group}/{self.name}: {self.reason}"


@dataclass
class RuleFile:
    path: Path
    alerting: list[AlertRule] = field(default_factory=list)
    recorded: dict[str, list[RecordedRule]] = field(default_factory=dict)
    unsupported: list[UnsupportedRule] = field(default_factory=list)

    def horizon_s(self, lookback_s: float) -> float:
        """How much history one evaluation needs: the longest range in any runnable rule, plus the lookback."""
        ranges = [longest_range(rule.node) for rule in self.alerting]
        ranges += [longest_range(r.expr) for rules in self.recorded.values() for r in rules]
        return max(ranges, default=0.0) + lookback_s


def _string_map(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise RuleFileError(f"{where} must be a mapping of names to strings")
    return tuple((k, str(v)) for k, v in value.items())


def read_rule_groups(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(group name, raw rule) for every rule of a Prometheus rule file, in file order.

    The one reader of rules.yml: the evaluator (load_rules) and the dashboards (prunewatch/dashboards/rules.py)
    build their views from it. Raises `RuleFileError` for a file that is missing, not YAML, or not
    shaped like rule groups of alerting / recording rules with an `expr` each.
    """
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise RuleFileError(f"cannot read rule file {path}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise RuleFileError(f"rule file {path} is not valid YAML: {str(exc).splitlines()[0]}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("groups"), list):
        raise RuleFileError(f"rule file {path} has no 'groups' list")
    rules: list[tuple[str, dict[str, Any]]] = []
    for group in data["groups"]:
        if not isinstance(group, dict) or not isinstance(group.get("rules"), list):
            raise RuleFileError(f"rule file {path}: every group needs a name and a 'rules' list")
        group_name = str(group.get("name", ""))
        for raw in group["rules"]:
            if not isinstance(raw, dict) or not isinstance(raw.get("expr"), str):
                raise RuleFileError(f"rule file {path}, group {group_name}: every rule needs an 'expr' string")
            if "record" not in raw and "alert" not in raw:
                raise RuleFileError(f"rule file {path}, group {group_name}: a rule needs 'alert' or 'record'")
            rules.append((group_name, raw))
    return rules


def load_rules(path: Path, lookback_s: float = 300.0) -> RuleFile:
    """Read `path`; raise `RuleFileError` for a broken file (YAML, structure, or an expression that is not
    PromQL, which Prometheus refuses as well), list the rules it cannot run in the result."""
    result = RuleFile(path=Path(path))
    pending: list[tuple[str, dict[str, Any]]] = []
    for group_name, raw in read_rule_groups(path):
        if "record" in raw:
            try:
                node = parse(raw["expr"])
            except PromQLSyntaxError as exc:  # Prometheus would refuse the whole file too
                raise RuleFileError(f"rule file {path}, group {group_name}, record {raw['record']}: {exc}") from exc
            except UnsupportedExpression:
                continue  # a recording rule only matters if an alert uses it, which is then reported
            result.recorded.setdefault(str(raw["record"]), []).append(
                RecordedRule(str(raw["record"]), node, _string_map(raw.get("labels"), "labels")))
        else:
            pending.append((group_name, raw))
    for group_name, raw in pending:
        rule_or_reason = _alert_rule(group_name, raw, result, lookback_s)
        if isinstance(rule_or_reason, AlertRule):
            result.alerting.append(rule_or_reason)
        else:
            result.unsupported.append(UnsupportedRule(str(raw["alert"]), group_name, raw["expr"], rule_or_reason))
    return result


def _alert_rule(group: str, raw: dict[str, Any], rules: RuleFile, lookback_s: float) -> AlertRule | str:
    name = str(raw["alert"])
    try:
        hold_s = parse_duration(str(raw.get("for", "0s"))).total_seconds()
    except ValueError as exc:
        raise RuleFileError(f"rule {group}/{name}: {exc}") from exc
    labels = _string_map(raw.get("labels"), f"rule {group}/{name} labels")
    annotations = _string_map(raw.get("annotations"), f"rule {group}/{name} annotations")
    try:
        node = parse(raw["expr"])
    except PromQLSyntaxError as exc:  # not PromQL at all: Prometheus would refuse the whole file too
        raise RuleFileError(f"rule {group}/{name}: {exc}") from exc
    except UnsupportedExpression as exc:
        return str(exc)
    try:
        Engine(StoreSeries([]), at=0.0, lookback_s=lookback_s, recorded=rules.recorded).vector(node)
        for _, text in (*labels, *annotations):
            check(text)
    except (UnsupportedExpression, UnsupportedTemplate, EvaluationError) as exc:
        return str(exc)
    return AlertRule(name=name, expr=raw["expr"], node=node, hold_s=hold_s, labels=labels,
                     annotations=annotations, group=group)
