"""The live table of `prunewatch run`: one row per probe with its measured figures and its answer."""

from __future__ import annotations

from dataclasses import replace

from rich.console import Console

from prunewatch.collector.live_table import round_table
from prunewatch.collector.probe_round import RoundSummary
from tests.collector.factories import ok_result


def render(summary: RoundSummary) -> str:
    console = Console(width=200, record=True, color_system=None)
    console.print(round_table(summary, 3))
    return console.export_text()


def test_each_probe_shows_its_figures_and_answer():
    good = replace(ok_result(), probe_id="tech-route", domain="tech", pruning_ratio=0.0312, decode_pruning_ratio=0.0641,
                   quality_ms=1234.4, continuation_agreement=0.9583, output_text="The capital of\nFrance is Paris.")
    long = replace(ok_result(), result_id="b" * 32, probe_id="legal-x", domain="legal", output_text="word " * 40)
    failed = replace(ok_result(), result_id="c" * 32, probe_id="legal-y", domain="legal", status="failed",
                     failure_reason="timeout", error_message="no answer within 60 s")
    text = render(RoundSummary(round_id="r", target="embedded", results=[good, long, failed]))
    assert "round 3 · target embedded" in text
    row = next(line for line in text.splitlines() if "tech-route" in line)
    for figure in ("0.031", "0.064", "1234", "0.958", "The capital of France is Paris."):
        assert figure in row, (figure, row)
    assert "word word" in text and "…" in text  # long answers are cut, not wrapped over the screen
    assert "timeout: no answer within 60 s" in text
    assert text.index("legal-x") < text.index("tech-route")  # grouped by domain
