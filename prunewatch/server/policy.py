"""The pruning policy: per-domain default sensitivities for live traffic, set over an authenticated endpoint.

    PUT /v1/pruning/policy   {"domains": {"legal": 0.8, "tech": 0.6}}   replaces the policy
    GET /v1/pruning/policy                                             the policy in force

A request without an explicit `X-Pruning-Sensitivity` (nor a batch item's own `pruning.sensitivity`)
runs at the policy's sensitivity for the calibrated domain its prompt matches (the same centroid
match the engine plans with); a domain the policy does not name, or an empty policy, keeps the
server's configured default. The collector's quality governor pushes its settings here.

Changing the policy needs an API key (the auth middleware answers 401 without a valid one) and is
refused on a server that has no keys configured. Every change is logged with who made it (a
fingerprint of the key, never the key) and what changed. The routes: prunewatch/server/routes/policy.py.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from prunewatch.server.auth import bearer_token
from prunewatch.server.errors import APIError
from prunewatch.server.pruning_headers import PruningRequest

POLICY_PATH = "/v1/pruning/policy"
MAX_DOMAINS = 256
_DOMAIN = r"^[a-z0-9_-]{1,64}$"  # the probes' domain names (prunewatch/probes/loader.py)


class PolicyUpdate(BaseModel):
    """The body of PUT /v1/pruning/policy: the whole policy (domains left out fall back to the default)."""

    model_config = ConfigDict(extra="forbid")

    domains: dict[str, float] = Field(
        description="Calibrated domain -> default pruning sensitivity in [0, 1] for requests without "
                    "X-Pruning-Sensitivity.", max_length=MAX_DOMAINS)


class PolicyView(BaseModel):
    """The policy in force."""

    domains: dict[str, float]
    updated_at: float | None = Field(description="Unix time of the last change; null: never set.")
    updated_by: str | None = Field(description="Fingerprint of the API key that set it (sha256 prefix).")


def key_fingerprint(authorization: str | None) -> str:
    """`sha256:<12 hex>` of the presented key: names who changed the policy without revealing the key."""
    token = bearer_token(authorization)
    if token is None:
        return "anonymous"
    return "sha256:" + hashlib.sha256(token.encode("utf-8")).hexdigest()[:12]


def _invalid(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


class PruningPolicy:
    """The per-domain sensitivities in force (thread-safe; replaced as a whole)."""

    def __init__(self) -> None:
        self._domains: dict[str, float] = {}
        self._updated_at: float | None = None
        self._updated_by: str | None = None
        self._lock = threading.Lock()

    def view(self) -> dict[str, Any]:
        with self._lock:
            return {"domains": dict(self._domains), "updated_at": self._updated_at, "updated_by": self._updated_by}

    def replace(self, domains: dict[str, float], who: str) -> dict[str, float]:
        """Set the policy; returns the previous one."""
        with self._lock:
            previous = self._domains
            self._domains = dict(sorted(domains.items()))
            self._updated_at = time.time()
            self._updated_by = who
        return previous

    def sensitivity(self, domain: str | None) -> float | None:
        with self._lock:
            return None if domain is None else self._domains.get(domain)

    @property
    def empty(self) -> bool:
        with self._lock:
            return not self._domains


def validate_update(update: PolicyUpdate, known_domains: Sequence[str] | None) -> dict[str, float]:
    """Ranges and names of a policy update; a domain the engine is not calibrated on is refused."""
    import re

    out = {}
    for domain, sensitivity in update.domains.items():
        param = f"domains.{domain}"
        if not re.fullmatch(_DOMAIN, domain):
            raise _invalid(f"domain {domain[:40]!r} is not a domain name (a-z, 0-9, _ and -, at most 64)", "domains")
        if known_domains is not None and domain not in known_domains:
            raise _invalid(f"the engine is not calibrated on domain {domain!r}; it knows {sorted(known_domains)}",
                           param)
        if not (0.0 <= sensitivity <= 1.0):  # NaN fails too
            raise _invalid(f"sensitivity of {domain} must be within [0, 1], got {sensitivity}", param)
        out[domain] = sensitivity + 0.0
    return out


def matched_domain(engine: Any, prompt_ids: Sequence[int]) -> str | None:
    """The calibrated domain the engine's planner matches this prompt to; None without a calibration."""
    import torch

    from prunewatch.engine.calibration import mean_token_direction
    from prunewatch.engine.planner import match_domain

    calibration = engine.calibration
    if calibration is None or not calibration.domains:
        return None
    embed = engine.loaded.model.get_input_embeddings()
    with torch.no_grad():
        direction = mean_token_direction(embed(torch.tensor(list(prompt_ids), device=engine.loaded.device)))
    return match_domain(calibration, direction)[1]


def apply_policy(policy: PruningPolicy | None, engine: Any, prompt_ids: Sequence[int],
                 pruning: PruningRequest) -> PruningRequest:
    """`pruning` with the policy's sensitivity when the request did not set one (tensor work: the server runs it
    on the generation thread, at the start of the request's generation)."""
    if policy is None or pruning.sensitivity is not None or policy.empty:
        return pruning
    sensitivity = policy.sensitivity(matched_domain(engine, prompt_ids))
    return pruning if sensitivity is None else replace(pruning, sensitivity=sensitivity)

