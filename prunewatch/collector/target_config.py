"""The collector's config file: which targets to probe, how often, and where results go (YAML).

    collector:                    # optional; flags override these
      db_url: postgresql+psycopg://prunewatch@db/prunewatch
      buffer_path: /var/lib/prunewatch/buffer.sqlite
      metrics_port: 9464
    defaults:                     # optional; apply to every target that does not say otherwise
      interval_s: 60
      timeout_s: 30
      sensitivity: 0.5
    targets:
      - name: embedded            # the engine, loaded in this process
        kind: in_process
      - name: gpu-a               # a prunewatch engine over HTTP
        kind: prunewatch
        base_url: http://10.0.0.5:8000
        api_key_env: PRUNEWATCH_GPU_A_KEY
        model: probe-llama
        domains: [legal, tech]
      - name: vllm-baseline       # a plain OpenAI-compatible server: no pruning, ratio recorded as absent
        kind: openai
        base_url: http://10.0.0.6:8000
        model: meta-llama/Llama-3.1-8B-Instruct
      - name: llama-cpp-q4        # any OpenAI-compatible server, its answers scored by a reference
        kind: openai
        base_url: http://10.0.0.8:8080
        model: smollm2-q4_1
        reference: smollm2-dense
    references:                   # optional; dense models that score what targets served (collector/reference.py)
      - name: smollm2-dense       # an OpenAI-compatible server with echo + logprobs on /v1/completions
        kind: http
        base_url: http://10.0.0.7:8000
        model: SmolLM2-135M-Instruct
        template: /models/SmolLM2-135M-Instruct   # model folder whose chat template renders the probes
      - name: local-dense         # or the model loaded in this process, run dense
        kind: local
        model_dir: /models/SmolLM2-135M-Instruct
    governor:                     # optional; defaults of every governed target (prunewatch/collector/governor.py)
      floor: 0.95
    # a target is governed with `governor: true` (these defaults) or `governor: {floor: 0.9, ...}`
    # (its own values over them); not an openai baseline, which does not prune.

Quality is the reference-scored agreement of what each target served. An in_process target is
scored by its own engine run dense unless it names a reference; a prunewatch target scores its answers
against its own weights (X-Pruning-Quality) unless it names one; an openai target has quality only
with a reference.

Validation happens before anything runs and every problem is one line naming the file, the
target and the field. API keys are never in the file: `api_key_env` names the variable holding one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from prunewatch.collector.governor import GovernorSettings
from prunewatch.engine.model_store import PROBE_MODEL_DIR
from prunewatch.probes import read_yaml

TargetKindName = Literal["in_process", "prunewatch", "openai"]
_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class TargetConfigError(ValueError):
    """The config file is missing, not YAML, or invalid; the message says where and what."""


class TargetDefaults(BaseModel):
    """Values a target inherits unless it sets its own."""

    model_config = ConfigDict(extra="forbid")

    interval_s: float = Field(60.0, ge=1.0, le=86_400.0, description="Seconds between rounds of a target.")
    timeout_s: float = Field(120.0, gt=0.0, le=3600.0,
                             description="A probe running longer is cancelled and recorded as a timeout failure.")
    sensitivity: float = Field(0.5, ge=0.0, le=1.0, description="Pruning sensitivity asked of pruning targets.")
    jitter_s: float = Field(0.0, ge=0.0, le=3600.0, description="Random delay added to each round's start.")
    baseline_every: int | None = Field(
        None, ge=1, le=100_000,
        description="Every N rounds (the first included) also run each probe dense (sensitivity 0) on the same "
                    "engine, stored as a baseline: the measured 'before' of the ROI report. None: never.")


class ReferenceSpec(BaseModel):
    """A dense model that scores served answers (collector/reference.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=_NAME_PATTERN, description="What targets call it (`reference: NAME`).")
    kind: Literal["http", "local"] = Field(description="http: an OpenAI-compatible server with echo + logprobs on "
                                                       "/v1/completions; local: a model folder loaded here, run dense.")
    base_url: str | None = Field(None, description="http: the server's base URL, without /v1.")
    model: str | None = Field(None, min_length=1, description="http: the model id the server serves.")
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                                    description="http: the environment variable holding its API key.")
    template: Path | None = Field(None, description="http: the model folder whose chat template renders the probes.")
    model_dir: Path | None = Field(None, description="local: the model folder.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="local: where it runs.")
    timeout_s: float = Field(120.0, gt=0.0, le=3600.0, description="http: seconds one scoring call may take.")

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        return _check_http_url(value)

    @model_validator(mode="after")
    def _fits_kind(self) -> ReferenceSpec:
        needed = ("base_url", "model", "template") if self.kind == "http" else ("model_dir",)
        missing = [name for name in needed if getattr(self, name) is None]
        if missing:
            raise ValueError(f"a {self.kind} reference needs {', '.join(missing)}")
        foreign = (("model_dir",) if self.kind == "http" else ("base_url", "model", "api_key_env", "template"))
        given = [name for name in foreign if getattr(self, name) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} do(es) not apply to a {self.kind} reference")
        return self

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


def _check_http_url(value: str | None) -> str | None:
    if value is None:
        return None
    value = value.strip().rstrip("/")
    if not value.startswith(("http://", "https://")) or len(value.split("://", 1)[1]) == 0:
        raise ValueError(f"must be an http:// or https:// URL, got {value!r}")
    if value.endswith("/v1"):
        raise ValueError("give the server's base URL without /v1 (the collector adds /v1/...)")
    return value


class TargetSpec(BaseModel):
    """One target as written in the file."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=_NAME_PATTERN, description="Label of the target in rows and metrics.")
    kind: TargetKindName = Field(description="in_process, prunewatch (engine over HTTP) or openai (baseline).")
    base_url: str | None = Field(None, description="http(s)://host:port of an HTTP target, without /v1.")
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                                    description="Name of the environment variable that holds the API key.")
    model: str | None = Field(None, min_length=1, description="Model id sent to (and listed by) an HTTP target.")
    model_dir: Path | None = Field(None, description="in_process: the model folder (default: the bundled model).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="in_process: where the engine runs.")
    domains: list[str] | None = Field(None, min_length=1, description="Probe only these domains (default: all).")
    interval_s: float | None = Field(None, ge=1.0, le=86_400.0)
    timeout_s: float | None = Field(None, gt=0.0, le=3600.0)
    sensitivity: float | None = Field(None, ge=0.0, le=1.0)
    jitter_s: float | None = Field(None, ge=0.0, le=3600.0)
    governor: bool | dict[str, Any] | None = Field(
        None, description="true: governed with the file's governor defaults; a mapping: its own values over them.")
    baseline_every: int | None = Field(None, ge=1, le=100_000)

    reference: str | None = Field(None, description="Name of a `references` entry that scores this target's answers.")

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        return _check_http_url(value)

    @model_validator(mode="after")
    def _fits_kind(self) -> TargetSpec:
        if self.kind == "in_process":
            for name in ("base_url", "api_key_env"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} does not apply to an in_process target")
        else:
            if self.base_url is None:
                raise ValueError(f"base_url is required for a {self.kind} target")
            if self.model is None:
                raise ValueError(f"model is required for a {self.kind} target (the id GET /v1/models lists)")
            if self.model_dir is not None:
                raise ValueError(f"model_dir applies to in_process targets only, not to {self.kind}")
        if self.kind == "openai" and self.sensitivity is not None:
            raise ValueError("an openai (baseline) target does not prune; remove sensitivity")
        if self.kind == "openai" and self.governor not in (None, False):
            raise ValueError("an openai (baseline) target does not prune; it cannot be governed")
        if self.kind == "openai" and self.baseline_every is not None:
            raise ValueError("an openai target is dense already; baseline_every applies to pruning targets")
        return self


class CollectorSection(BaseModel):
    """Process-wide settings that may live in the file (command-line flags win)."""

    model_config = ConfigDict(extra="forbid")

    db_url: str | None = None
    buffer_path: Path | None = None
    metrics_host: str | None = None
    metrics_port: int | None = Field(None, ge=0, le=65535)
    pushgateway_url: str | None = None
    probes_path: Path | None = None


class TargetsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    collector: CollectorSection = Field(default_factory=CollectorSection)
    defaults: TargetDefaults = Field(default_factory=TargetDefaults)
    targets: list[TargetSpec] = Field(min_length=1)
    references: list[ReferenceSpec] = Field(default_factory=list, description="Dense models that score answers.")
    governor: GovernorSettings = Field(default_factory=GovernorSettings,
                                       description="Governor settings of every governed target unless it sets its own.")

    @model_validator(mode="after")
    def _unique_names(self) -> TargetsFile:
        seen: set[str] = set()
        for spec in self.targets:
            if spec.name in seen:
                raise ValueError(f"target name {spec.name!r} appears twice")
            seen.add(spec.name)
        references = [r.name for r in self.references]
        if len(set(references)) != len(references):
            raise ValueError("a reference name appears twice")
        for spec in self.targets:
            if spec.reference is not None and spec.reference not in references:
                raise ValueError(f"target {spec.name}: reference {spec.reference!r} is not among the references "
                                 f"{references}")
        return self


class ResolvedTarget(BaseModel):
    """A target with defaults applied and its API key read from the environment."""

    model_config = ConfigDict(frozen=True)

    name: str
    kind: TargetKindName
    base_url: str | None
    api_key_env: str | None
    model: str | None
    model_dir: Path
    device: str
    domains: list[str] | None
    interval_s: float
    timeout_s: float
    sensitivity: float | None  # None for baselines
    jitter_s: float
    governor: GovernorSettings | None = None  # None: not governed
    baseline_every: int | None = None  # rounds between dense baseline runs; None: never
    reference: ReferenceSpec | None = None  # scores its answers; None: the target's own (see the module doc)

    def api_key(self) -> str | None:
        """The key from the environment, read when needed (never stored in the config object)."""
        return os.environ.get(self.api_key_env) if self.api_key_env else None


class CollectorConfig(BaseModel):
    collector: CollectorSection
    targets: list[ResolvedTarget]
    source: str

    def target(self, name: str) -> ResolvedTarget:
        for target in self.targets:
            if target.name == name:
                return target
        raise TargetConfigError(f"{self.source}: no target named {name!r}; the file has "
                                f"{[t.name for t in self.targets]}")


def _where(error: ErrorDetails, document: Any) -> str:
    loc = list(error.get("loc", ()))
    if len(loc) >= 2 and loc[0] == "targets" and isinstance(loc[1], int):
        index = loc[1]
        name = None
        try:
            name = document["targets"][index].get("name")
        except (KeyError, IndexError, TypeError, AttributeError):
            pass
        head = f"targets[{index}]" + (f" ({name})" if name else "")
        rest = [str(p) for p in loc[2:] if not str(p).startswith("function-")]
        return head + (f": {'.'.join(rest)}" if rest else "")
    return ".".join(str(p) for p in loc)


def _governor(path: Path, index: int, spec: TargetSpec, defaults: GovernorSettings) -> GovernorSettings | None:
    if spec.governor is None or spec.governor is False:
        return None
    if spec.governor is True:
        return defaults
    try:
        return GovernorSettings.model_validate({**defaults.model_dump(), **spec.governor})
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first.get("loc", ()))
        message = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        raise TargetConfigError(f"{path}: targets[{index}] ({spec.name}): governor"
                                f"{'.' + field if field else ''}: {message}") from None


def load_targets(path: Path | str) -> CollectorConfig:
    """Parse, validate and resolve the file; TargetConfigError with one line naming the first problem."""
    path = Path(path)
    document = read_yaml(path, "targets", TargetConfigError)
    if not isinstance(document, dict):
        raise TargetConfigError(f"{path}: expected a mapping with a 'targets' list")
    try:
        parsed = TargetsFile.model_validate(document)
    except ValidationError as exc:
        first = exc.errors()[0]
        message = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        where = _where(first, document)
        raise TargetConfigError(f"{path}: {where + ': ' if where else ''}{message}") from None
    defaults = parsed.defaults
    resolved = []
    for index, spec in enumerate(parsed.targets):
        if spec.api_key_env and not os.environ.get(spec.api_key_env):
            raise TargetConfigError(f"{path}: target {spec.name}: environment variable {spec.api_key_env} "
                                    f"(api_key_env) is not set or empty")
        resolved.append(ResolvedTarget(
            name=spec.name, kind=spec.kind, base_url=spec.base_url, api_key_env=spec.api_key_env, model=spec.model,
            model_dir=spec.model_dir or PROBE_MODEL_DIR, device=spec.device, domains=spec.domains,
            interval_s=spec.interval_s if spec.interval_s is not None else defaults.interval_s,
            timeout_s=spec.timeout_s if spec.timeout_s is not None else defaults.timeout_s,
            sensitivity=None if spec.kind == "openai" else (
                spec.sensitivity if spec.sensitivity is not None else defaults.sensitivity),
            jitter_s=spec.jitter_s if spec.jitter_s is not None else defaults.jitter_s,
            governor=_governor(path, index, spec, parsed.governor),
            baseline_every=None if spec.kind == "openai" else (
                spec.baseline_every if spec.baseline_every is not None else defaults.baseline_every),
            reference=next((r for r in parsed.references if r.name == spec.reference), None),
        ))
    for reference in parsed.references:
        if reference.api_key_env and not os.environ.get(reference.api_key_env):
            raise TargetConfigError(f"{path}: reference {reference.name}: environment variable "
                                    f"{reference.api_key_env} (api_key_env) is not set or empty")
    return CollectorConfig(collector=parsed.collector, targets=resolved, source=str(path))
