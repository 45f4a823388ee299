"""A live terminal table of the last round per domain (rich)."""

from __future__ import annotations

from rich.table import Table

from collector.probe_round import RoundSummary


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def round_table(summary: RoundSummary, round_number: int) -> Table:
    """Per domain: mean ratio (measured), latency breakdown, tokens/s, agreement, failures."""
    table = Table(title=f"prunewatch · round {round_number} · target {summary.target}", title_justify="left",
                  caption="all figures measured on this round's probes (means per domain); ratio in linear-layer FLOPs",
                  caption_justify="left")
    for column in ("domain", "probes", "ratio", "pre ms", "infer ms", "post ms", "TTFT ms", "tok/s",
                   "agreement", "failed"):
        table.add_column(column, justify="left" if column == "domain" else "right")
    by_domain: dict[str, list] = {}
    for result in summary.results:
        by_domain.setdefault(result.domain, []).append(result)

    def mean(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return sum(present) / len(present) if present else None

    for domain in sorted(by_domain):
        results = by_domain[domain]
        ok = [r for r in results if r.ok]
        table.add_row(
            domain, str(len(results)),
            _fmt(mean([r.pruning_ratio for r in ok]), ".3f"),
            _fmt(mean([r.preprocessing_ms for r in ok]), ".1f"),
            _fmt(mean([r.inference_ms for r in ok]), ".1f"),
            _fmt(mean([r.postprocessing_ms for r in ok]), ".1f"),
            _fmt(mean([r.ttft_ms for r in ok]), ".1f"),
            _fmt(mean([r.tokens_per_s for r in ok]), ".1f"),
            _fmt(mean([r.token_agreement for r in ok]), ".3f"),
            str(len(results) - len(ok)),
        )
    return table
