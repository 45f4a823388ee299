"""A live terminal table of the last round: one row per probe, with the answer the model gave (rich)."""

from __future__ import annotations

from rich.table import Table

from prunewatch.collector.probe_round import RoundSummary
from prunewatch.records.results import ProbeResult

ANSWER_CHARS = 60  # enough to recognise an answer (or a broken one) at a glance


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _answer(result: ProbeResult) -> str:
    if not result.ok:
        return f"[red]{result.failure_reason or 'failed'}[/red]: {(result.error_message or '')[:ANSWER_CHARS]}"
    text = " ".join((result.output_text or "").split())
    return text if len(text) <= ANSWER_CHARS else text[:ANSWER_CHARS - 1] + "…"


def round_table(summary: RoundSummary, round_number: int) -> Table:
    """Per probe, by domain: ratio (request and decode), latency, tokens/s, agreement and the answer."""
    table = Table(title=f"prunewatch · round {round_number} · target {summary.target}", title_justify="left",
                  caption="all figures measured on this round's probes; ratios in linear-layer FLOPs, agreement "
                          "teacher-forced against the dense model", caption_justify="left")
    for column in ("domain", "probe", "ratio", "decode", "infer ms", "quality ms", "tok/s", "agreement", "answer"):
        table.add_column(column, justify="left" if column in ("domain", "probe", "answer") else "right",
                         overflow="fold" if column == "answer" else "ellipsis")
    for result in sorted(summary.results, key=lambda r: (r.domain, r.probe_id)):
        table.add_row(
            result.domain, result.probe_id,
            _fmt(result.pruning_ratio, ".3f"), _fmt(result.decode_pruning_ratio, ".3f"),
            _fmt(result.inference_ms, ".0f"), _fmt(result.quality_ms, ".0f"),
            _fmt(result.tokens_per_s, ".1f"), _fmt(result.continuation_agreement, ".3f"),
            _answer(result),
        )
    return table
