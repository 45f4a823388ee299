"""Load and validate a probes YAML file.

Each probe has an id, a domain, a version, a system prompt, a prompt and max_tokens. Its content
hash covers everything that changes what the model is asked, so a result row always names the
exact text it measured; changing the text without bumping the version is refused when a known
hash is supplied (see ProbeSet.check_versions).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

DEFAULT_PROBES_PATH = Path(__file__).resolve().parent / "canonical.yaml"


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

    @property
    def content_hash(self) -> str:
        """sha256 of the fields that define what is asked (first 16 hex digits)."""
        payload = json.dumps(
            {"system": self.system, "prompt": self.prompt, "max_tokens": self.max_tokens}, sort_keys=True
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ProbeSet:
    """The probes of one file, in file order, plus a digest of the whole set."""

    probes: tuple[Probe, ...]
    source: str

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

    def calibration_texts(self) -> dict[str, list[str]]:
        """Per domain, the probe texts (system + prompt) used to calibrate the engine."""
        return {d: [f"{p.system}\n\n{p.prompt}".strip() for p in ps] for d, ps in self.by_domain().items()}

    def filter(self, domains: Iterable[str] | None) -> ProbeSet:
        if not domains:
            return self
        wanted = set(domains)
        unknown = wanted - set(self.domains)
        if unknown:
            raise ProbeFileError(f"unknown domain(s) {sorted(unknown)}; the probes cover {self.domains}")
        return ProbeSet(tuple(p for p in self.probes if p.domain in wanted), self.source)


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
        probes.append(Probe(**spec.model_dump()))
    if not probes:
        raise ProbeFileError(f"{path}: the probes list is empty")
    return ProbeSet(tuple(probes), str(path))


HELDOUT_PATH = Path(__file__).resolve().parent / "heldout.txt"


def heldout_texts(path: Path = HELDOUT_PATH) -> list[str]:
    """The held-out passages (never calibrated on) that perplexity checks score; '#' lines are comments."""
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if not line.startswith("#")]
    passages = [" ".join(part.split()) for part in "\n".join(lines).split("\n---\n")]
    return [p for p in passages if p]
