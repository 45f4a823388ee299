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
                   quality_ms=1234.4, reference_agreement=0.9583, continuation_agreement=0.5, task_passed=True,
                   decode_tokens_per_s=40.0, output_text="The capital of\nFrance is Paris.")
    long = replace(ok_result(), result_id="b" * 32, probe_id="legal-x", domain="legal", output_text="word " * 40)
    failed = replace(ok_result(), result_id="c" * 32, probe_id="legal-y", domain="legal", status="failed",
                     failure_reason="timeout", error_message="no answer within 60 s")
    text = render(RoundSummary(round_id="r", target="embedded", results=[good, long, failed]))
    assert "round 3 · target embedded" in text
    row = next(line for line in text.splitlines() if "tech-route" in line)
    for figure in ("0.031", "0.064", "1234", "25.0", "0.958", "pass", "The capital of France is Paris."):
        assert figure in row, (figure, row)
    assert "0.500" not in row  # the continuation figure is not the quality shown
    assert "word word" in text and "…" in text  # long answers are cut, not wrapped over the screen
    assert "timeout: no answer within 60 s" in text
    assert text.index("legal-x") < text.index("tech-route")  # grouped by domain


def test_reference_agreement_check_and_dense_baselines_are_labelled():
    pruned = replace(ok_result(), probe_id="legal-a", domain="legal", reference_agreement=0.41, task_passed=False)
    dense = replace(ok_result(), result_id="d" * 32, probe_id="legal-a", domain="legal", baseline=True,
                    sensitivity=0.0, pruning_ratio=0.0, reference_agreement=None, task_passed=None)
    text = render(RoundSummary(round_id="r", target="embedded", results=[dense, pruned]))
    rows = [line for line in text.splitlines() if "legal-a" in line]
    assert len(rows) == 2 and "(dense)" not in rows[0] and "(dense)" in rows[1]  # pruned first, its baseline after
    assert "0.410" in rows[0] and "fail" in rows[0]
    assert "reference-scored" in text
