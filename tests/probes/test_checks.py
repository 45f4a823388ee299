"""The machine checks of an answer, on answers that pass and answers that do not."""

from __future__ import annotations

import json

import pytest

from prunewatch.probes import EVALUATION_PATH, load_probes
from prunewatch.probes.checks import Check, answer_code, numbers_in, run_python_check


def test_substring_checks_ignore_case():
    assert Check("contains", ("paris", "france")).passed("The capital of France is Paris.")
    assert not Check("contains", ("paris", "italy")).passed("The capital of France is Paris.")
    assert Check("any_of", ("bonjour", "salut")).passed("Salut !")
    assert not Check("any_of", ("bonjour",)).passed("Hello")


def test_regex_is_searched_case_insensitively():
    assert Check("regex", r"\bip route\b").passed("Run `IP ROUTE show`.")
    assert not Check("regex", r"\bip route\b").passed("Run `iproute2`.")


def test_a_number_anywhere_in_the_answer_counts_with_relative_tolerance():
    assert numbers_in("It costs 1,234.5 dollars, or -3e2 cents") == [1234.5, -300.0]
    assert Check("number", 42.0).passed("The answer is 42.")
    assert Check("number", 1234.5).passed("about 1,234.5 in total")
    assert not Check("number", 42.0).passed("The answer is 43, not 4 2.")
    assert Check("number", 100.0, tolerance=0.01).passed("roughly 100.5")
    assert not Check("number", 0.0).passed("0.001")


def test_code_is_taken_from_the_python_block_else_the_first_block_else_the_answer():
    assert answer_code("text\n```\nplain\n```\n```python\ndef f(): pass\n```") == "def f(): pass\n"
    assert answer_code("```\nx = 1\n```") == "x = 1\n"
    assert answer_code("x = 1") == "x = 1"
    assert answer_code("```python\ndef f():\n    return 1") == "def f():\n    return 1"  # unclosed: to the end


def test_python_check_runs_the_answer_apart_and_needs_every_assert():
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    assert Check("python", ("add", ("add(2, 3) == 5", "add(-1, 1) == 0"))).passed(good)
    assert not Check("python", ("add", ("add(2, 3) == 5",))).passed(wrong)
    assert not Check("python", ("add", ("add(2, 3) == 5",))).passed("I cannot write code.")
    assert not Check("python", ("helper", ("True",))).passed(good)  # the named function must exist


def test_python_check_is_isolated_and_bounded(tmp_path, monkeypatch):
    monkeypatch.setenv("PRUNEWATCH_SECRET", "x")
    leaked = "import os\ndef f():\n    return os.environ.get('PRUNEWATCH_SECRET')"
    assert not run_python_check(leaked, "f", ["f() == 'x'"])  # the answer sees no environment of ours
    assert not run_python_check("def f():\n    while True: pass", "f", ["f()"], timeout_s=1.0)


def test_every_shipped_check_is_well_formed_and_a_correct_answer_passes_the_code_checks():
    evaluation = load_probes(EVALUATION_PATH)
    described = [json.dumps(p.check.describe()) for p in evaluation.probes if p.check is not None]
    assert len(described) >= 30
    code = {p.id: p for p in evaluation.by_domain()["code"]}
    factorial = next((p for p in code.values() if p.check.value[0] == "factorial"), None)
    if factorial is not None:
        answer = "```python\ndef factorial(n):\n    return 1 if n <= 1 else n * factorial(n - 1)\n```"
        assert factorial.check.passed(answer)


@pytest.mark.parametrize("kind", ["contains", "any_of", "regex", "number"])
def test_an_empty_answer_fails_every_text_check(kind):
    value = {"contains": ("a",), "any_of": ("a",), "regex": "a", "number": 1.0}[kind]
    assert not Check(kind, value).passed("")
