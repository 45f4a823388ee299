"""A live terminal table of the last round: one row per probe, with the answer the model gave (rich)."""

from __future__ import annotations

from rich.table import Table

from prunewatch.collector.probe_round import RoundSummary
from prunewatch.records.latency_window import time_per_output_token_s
from prunewatch.records.results import ProbeResult

ANSWER_CHARS = 60  # enough to recognise an answer (or a broken one) at a glance


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _answer(result: ProbeResult) -> str:
    if not result.ok:
        return f"[red]{result.failure_reason or 'failed'}[/red]: {(result.error_message or '')[:ANSWER_CHARS]}"
    text = " ".join((result.output_text or "").split())
    return text if len(text) <= ANSWER_CHARS else text[:ANSWER_CHARS - 1] + "…"


def _check(result: ProbeResult) -> str:
    if result.task_passed is None:
        return "—"
    return "[green]pass[/green]" if result.task_passed else "[red]fail[/red]"


def round_table(summary: RoundSummary, round_number: int) -> Table:
    """Per probe, by domain: ratio (request and decode), latency, time per output token, the reference-scored
    agreement of the served answer, its check, and the answer; dense baseline runs marked as such."""
    table = Table(title=f"prunewatch · round {round_number} · target {summary.target}", title_justify="left",
                  caption="all figures measured on this round's probes; ratios in linear-layer FLOPs; agreement: share "
                          "of the served answer's tokens equal to the dense reference's argmax (reference-scored); "
                          "check: the probe's task check on the served text; dense: a baseline run at sensitivity 0",
                  caption_justify="left")
    for column in ("domain", "probe", "ratio", "decode", "infer ms", "ms/token", "quality ms", "agreement", "check",
                   "answer"):
        table.add_column(column, justify="left" if column in ("domain", "probe", "check", "answer") else "right",
                         overflow="fold" if column == "answer" else "ellipsis")
    for result in sorted(summary.results, key=lambda r: (r.domain, r.probe_id, r.baseline)):
        per_token = time_per_output_token_s(result)
        table.add_row(
            result.domain, result.probe_id + (" [dim](dense)[/dim]" if result.baseline else ""),
            _fmt(result.pruning_ratio, ".3f"), _fmt(result.decode_pruning_ratio, ".3f"),
            _fmt(result.inference_ms, ".0f"), _fmt(None if per_token is None else per_token * 1000, ".1f"),
            _fmt(result.quality_ms, ".0f"), _fmt(result.reference_agreement, ".3f"), _check(result),
            _answer(result),
        )
    return table
