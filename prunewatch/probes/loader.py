"""Load and validate a probes YAML file.

Each probe has an id, a domain, a version, a system prompt, a prompt, max_tokens and optionally a
machine check of its answer (probes/checks.py). Its content hash covers everything that changes what
the model is asked and how the answer is judged, so a result row always names the exact text it
measured.

Every file has a role. *Calibration* sets are what thresholds, block influence and the greedy
sparsity plan are fitted on (`calibration.yaml`); *evaluation* sets are what quality, the frontier,
the governor, the alerts and ROI read (`evaluation.yaml`, and `canonical.yaml`, the collector's
default domain probes, a subset of it). No text is in both: an evaluation set refuses to hand out
calibration texts, and a test checks that no evaluation prompt shares an 8-word run with calibration.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from prunewatch.probes.checks import Check, CheckSpec

DEFAULT_PROBES_PATH = Path(str(files("prunewatch.probes").joinpath("canonical.yaml")))
"""The collector's default probes: the canonical legal, tech and finance prompts (role evaluation)."""
EVALUATION_PATH = Path(str(files("prunewatch.probes").joinpath("evaluation.yaml")))
"""The broad held-out evaluation set (role evaluation) benchmarks and defaults are judged on."""
CALIBRATION_PATH = Path(str(files("prunewatch.probes").joinpath("calibration.yaml")))
"""The calibration set (role calibration) every engine is calibrated on."""
ROLES = ("calibration", "evaluation")


class ProbeFileError(ValueError):
    """The probes file is missing, not YAML, or a probe is invalid; the message names which."""


class _ProbeSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=128, pattern=r"^[a-z0-9][a-z0-9._-]*$")
    domain: str = Field(min_length=1, max_length=64, pattern=r"^[a-z0-9_-]+$")
    version: int = Field(ge=1)
    max_tokens: int = Field(ge=1, le=4096)
    system: str = ""
    prompt: str = Field(min_length=1)
    check: CheckSpec | None = None

    @field_validator("prompt", "system")
    @classmethod
    def _strip(cls, value: str) -> str:
        return value.strip()


@dataclass(frozen=True)
class Probe:
    """One canonical probe."""

    id: str
    domain: str
    version: int
    max_tokens: int
    system: str
    prompt: str
    check: Check | None = None  # how the served answer is judged correct; None: no machine check

    @property
    def content_hash(self) -> str:
        """sha256 of the fields that define what is asked and how it is judged (first 16 hex digits)."""
        fields: dict[str, object] = {"system": self.system, "prompt": self.prompt, "max_tokens": self.max_tokens}
        if self.check is not None:  # probes without a check keep the hash they always had
            fields["check"] = self.check.describe()
        payload = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ProbeSet:
    """The probes of one file, in file order, plus a digest of the whole set."""

    probes: tuple[Probe, ...]
    source: str
    role: str = "evaluation"  # calibration or evaluation (see the module doc)

    @property
    def digest(self) -> str:
        digest = hashlib.sha256()
        for probe in self.probes:
            digest.update(f"{probe.id}:{probe.version}:{probe.content_hash}".encode())
        return digest.hexdigest()

    @property
    def domains(self) -> list[str]:
        return sorted({p.domain for p in self.probes})

    def by_domain(self) -> dict[str, list[Probe]]:
        out: dict[str, list[Probe]] = {}
        for probe in self.probes:
            out.setdefault(probe.domain, []).append(probe)
        return out

    def texts(self) -> dict[str, list[str]]:
        """Per domain, the probe texts (system + prompt)."""
        return {d: [f"{p.system}\n\n{p.prompt}".strip() for p in ps] for d, ps in self.by_domain().items()}

    def calibration_texts(self) -> dict[str, list[str]]:
        """Per domain, the texts an engine is calibrated on; only a calibration set has them (an evaluation set
        that was calibrated on would no longer measure held-out quality)."""
        if self.role != "calibration":
            raise ProbeFileError(f"{self.source} is an {self.role} set: engines are calibrated on a calibration set "
                                 f"only (default {CALIBRATION_PATH.name})")
        return self.texts()

    def filter(self, domains: Iterable[str] | None) -> ProbeSet:
        if not domains:
            return self
        wanted = set(domains)
        unknown = wanted - set(self.domains)
        if unknown:
            raise ProbeFileError(f"unknown domain(s) {sorted(unknown)}; the probes cover {self.domains}")
        return ProbeSet(tuple(p for p in self.probes if p.domain in wanted), self.source, self.role)


def _describe(error: ValidationError, index: int, raw: object) -> str:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "probe"
    name = raw.get("id", f"#{index + 1}") if isinstance(raw, dict) else f"#{index + 1}"
    return f"probe {name}: {where}: {first['msg']}"


def read_yaml(path: Path, what: str, error: type[Exception]) -> Any:
    """The parsed YAML document of `path`; `error` with one line naming `what` file when it is missing or
    unreadable. Shared by every versioned input file (probes here, the collector's targets)."""
    try:
        return yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise error(f"{what} file not found: {path}") from None
    except (OSError, yaml.YAMLError) as exc:
        raise error(f"cannot read {what} file {path}: {str(exc).splitlines()[0]}") from None


def load_probes(path: Path | str = DEFAULT_PROBES_PATH) -> ProbeSet:
    """Parse and validate; raise ProbeFileError with a one-line reason on any problem."""
    path = Path(path)
    document = read_yaml(path, "probes", ProbeFileError)
    if not isinstance(document, dict) or not isinstance(document.get("probes"), list):
        raise ProbeFileError(f"{path}: expected a mapping with a 'probes' list")
    probes: list[Probe] = []
    seen: set[str] = set()
    for index, raw in enumerate(document["probes"]):
        try:
            spec = _ProbeSpec.model_validate(raw)
        except ValidationError as exc:
            raise ProbeFileError(f"{path}: {_describe(exc, index, raw)}") from None
        if spec.id in seen:
            raise ProbeFileError(f"{path}: probe id {spec.id!r} appears twice")
        seen.add(spec.id)
        fields = spec.model_dump(exclude={"check"})
        probes.append(Probe(**fields, check=spec.check.build() if spec.check is not None else None))
    if not probes:
        raise ProbeFileError(f"{path}: the probes list is empty")
    role = document.get("role", "evaluation")
    if role not in ROLES:
        raise ProbeFileError(f"{path}: role must be one of {', '.join(ROLES)}, got {role!r}")
    unknown = set(document) - {"probes", "role"}
    if unknown:
        raise ProbeFileError(f"{path}: unknown top-level key(s) {sorted(unknown)}; a probes file has role and probes")
    return ProbeSet(tuple(probes), str(path), role)


def load_calibration_set(path: Path | str = CALIBRATION_PATH) -> ProbeSet:
    """The calibration set (ProbeFileError unless the file's role is calibration)."""
    probe_set = load_probes(path)
    if probe_set.role != "calibration":
        raise ProbeFileError(f"{path} has role {probe_set.role}, not calibration: engines are calibrated on a "
                             "calibration set only")
    return probe_set


HELDOUT_PATH = Path(str(files("prunewatch.probes").joinpath("heldout.txt")))


def heldout_texts(path: Path = HELDOUT_PATH) -> list[str]:
    """The held-out passages (never calibrated on) that perplexity checks score; '#' lines are comments."""
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if not line.startswith("#")]
    passages = [" ".join(part.split()) for part in "\n".join(lines).split("\n---\n")]
    return [p for p in passages if p]
