"""Machine checks of a probe's answer: did the served text do the task?

A check is declared with the probe (YAML) and applied to the text an engine served, so the task pass
rate compares engines (dense, pruned, quantized, foreign) on correctness rather than on closeness to
one reference answer. Kinds:

- `contains: [a, b]`: every string appears (case-insensitive);
- `any_of: [a, b]`: at least one appears (case-insensitive);
- `regex: PATTERN`: `re.search`, case-insensitive;
- `number: 42` (with `tolerance`, relative, default 1e-6): some number written in the answer equals it;
- `python: {function: f, asserts: ["f(2) == 4"]}`: the answer's code (its first ```python block, else
  its first ``` block, else the whole answer) is run in a separate, isolated interpreter (`python -I`,
  no site packages, a 5 s limit, a temporary working folder) followed by each assert; it passes when
  the process exits 0. The answer's code is the model's: it never runs in the collector's process.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

PYTHON_TIMEOUT_S = 5.0
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?")
_FENCE = re.compile(r"```(?:[ \t]*(?P<lang>[\w+-]*))?[ \t]*\n(?P<code>.*?)(?:```|\Z)", re.DOTALL)


class _PythonSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    function: str = Field(pattern=r"^[A-Za-z_]\w*$", description="The function the answer must define.")
    asserts: list[str] = Field(min_length=1, description="Python expressions that must all be true.")


class CheckSpec(BaseModel):
    """One check as written in a probes file: exactly one kind."""

    model_config = ConfigDict(extra="forbid")

    contains: list[str] | None = Field(None, min_length=1)
    any_of: list[str] | None = Field(None, min_length=1)
    regex: str | None = None
    number: float | None = None
    tolerance: float | None = Field(None, ge=0.0, description="Relative tolerance of `number` (default 1e-6).")
    python: _PythonSpec | None = None

    @field_validator("regex")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"not a valid regular expression: {exc}") from None
        return value

    @model_validator(mode="after")
    def _one_kind(self) -> CheckSpec:
        kinds = [k for k in ("contains", "any_of", "regex", "number", "python") if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError(f"a check has exactly one of contains, any_of, regex, number, python; got {kinds or 'none'}")
        if self.tolerance is not None and self.number is None:
            raise ValueError("tolerance applies to a number check only")
        return self

    def build(self) -> Check:
        kind = next(k for k in ("contains", "any_of", "regex", "number", "python") if getattr(self, k) is not None)
        value: Any = getattr(self, kind)
        if kind == "python":
            value = (value.function, tuple(value.asserts))
        elif kind in ("contains", "any_of"):
            value = tuple(value)
        return Check(kind=kind, value=value, tolerance=self.tolerance if self.tolerance is not None else 1e-6)


@dataclass(frozen=True)
class Check:
    """A probe's check, ready to apply to answers."""

    kind: str  # contains, any_of, regex, number, python
    value: Any
    tolerance: float = 1e-6

    def describe(self) -> dict[str, Any]:
        """The check as data (what the probe's content hash covers)."""
        if self.kind == "python":
            function, asserts = self.value
            return {"python": {"function": function, "asserts": list(asserts)}}
        if self.kind == "number":
            return {"number": self.value, "tolerance": self.tolerance}
        return {self.kind: list(self.value) if isinstance(self.value, tuple) else self.value}

    def passed(self, answer: str) -> bool:
        text = answer.lower()
        if self.kind == "contains":
            return all(s.lower() in text for s in self.value)
        if self.kind == "any_of":
            return any(s.lower() in text for s in self.value)
        if self.kind == "regex":
            return re.search(self.value, answer, flags=re.IGNORECASE) is not None
        if self.kind == "number":
            return any(_close(n, float(self.value), self.tolerance) for n in numbers_in(answer))
        function, asserts = self.value
        return run_python_check(answer_code(answer), function, asserts)


def _close(found: float, expected: float, tolerance: float) -> bool:
    return math.isclose(found, expected, rel_tol=tolerance, abs_tol=tolerance if expected == 0 else 0.0)


def numbers_in(text: str) -> list[float]:
    """Every number written in `text` (thousands separators allowed: 1,234.5)."""
    out = []
    for match in _NUMBER.finditer(text):
        try:
            out.append(float(match.group(0).replace(",", "")))
        except ValueError:
            continue
    return out


def answer_code(answer: str) -> str:
    """The code of an answer: its first ```python block, else its first fenced block, else the whole answer."""
    blocks = list(_FENCE.finditer(answer))
    for block in blocks:
        if block.group("lang") and block.group("lang").lower() in ("python", "py", "python3"):
            return block.group("code")
    return blocks[0].group("code") if blocks else answer


def run_python_check(code: str, function: str, asserts: tuple[str, ...] | list[str],
                     timeout_s: float = PYTHON_TIMEOUT_S) -> bool:
    """Run `code` then the asserts in an isolated interpreter; True when it defines `function` and every assert holds."""
    program = "\n".join([code, "", f"assert callable({function})", *(f"assert {a}" for a in asserts)]) + "\n"
    with tempfile.TemporaryDirectory(prefix="prunewatch-check-") as folder:
        try:
            done = subprocess.run([sys.executable, "-I", "-S", "-c", program], cwd=folder, capture_output=True,
                                  timeout=timeout_s, stdin=subprocess.DEVNULL, env={"PYTHONHASHSEED": "0"})
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0
