"""The served-quality window a target is judged on: which answers count, for how long, per setting."""

from __future__ import annotations

from prunewatch.records.quality_window import AnswerWindow, QualityWindows
from prunewatch.records.results import ProbeResult


def answer(probe: str, agreement: float | None, round_id: str, *, tokens: int = 10, passed: bool | None = None,
           sensitivity: float | None = 0.5, target: str = "t", domain: str = "legal", **extra) -> ProbeResult:
    return ProbeResult(target=target, model="m", probe_id=probe, probe_version=1, probe_hash="h" * 16, domain=domain,
                       status="ok", round_id=round_id, reference_agreement=agreement,
                       reference_tokens=None if agreement is None else tokens, task_passed=passed,
                       sensitivity=sensitivity, **extra)


def test_rounds_older_than_the_window_leave_it():
    window = AnswerWindow(window_rounds=2)
    window.add(answer("a", 0.5, "r1"))
    window.add(answer("b", 1.0, "r2"))
    assert window.agreement().prompts == 2
    window.add(answer("c", 1.0, "r3"))  # r1 leaves: a's answer is no longer evidence
    assert (window.agreement().prompts, window.agreement().estimate) == (2, 1.0)
    window.add(answer("a", 0.0, "r4"))  # answered again later: it counts, by its newest answer
    assert window.agreement().estimate == 0.5


def test_the_pass_rate_counts_checked_prompts_only():
    window = AnswerWindow()
    for probe, passed in (("a", True), ("b", False), ("c", None), ("d", True)):
        window.add(answer(probe, 1.0, "r1", passed=passed))
    rate = window.pass_rate()
    assert (rate.estimate, rate.prompts) == (2 / 3, 3)


def test_windows_are_kept_per_target_model_and_domain_and_ignore_non_evidence():
    windows = QualityWindows()
    assert windows.add(answer("a", 1.0, "r1", baseline=True)) is None
    assert windows.add(answer("a", 1.0, "r1", fallback_reason="uncalibrated")) is None
    first = windows.add(answer("a", 1.0, "r1"))
    other = windows.add(answer("a", 0.5, "r1", target="u"))
    assert first is not other and len(windows.windows) == 2
    assert windows.add(answer("b", None, "r1")) is first  # an unscored answer keeps its place for the pass rate
    assert first.agreement().prompts == 1
