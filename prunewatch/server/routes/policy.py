"""GET and PUT /v1/pruning/policy: the per-domain default sensitivities in force (prunewatch/server/policy.py)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request

from prunewatch.server import state
from prunewatch.server.errors import APIError
from prunewatch.server.policy import POLICY_PATH, PolicyUpdate, PolicyView, key_fingerprint, validate_update
from prunewatch.server.schemas import ErrorResponse

logger = logging.getLogger("prunewatch.server")

_GET_ERRORS: dict[int | str, dict[str, Any]] = {401: {"model": ErrorResponse}}
_PUT_ERRORS: dict[int | str, dict[str, Any]] = {status: {"model": ErrorResponse} for status in (400, 401, 403, 413, 422)}

router = APIRouter()


@router.get(POLICY_PATH, response_model=PolicyView, tags=["prunewatch"], responses=_GET_ERRORS)
async def get_policy(request: Request) -> dict[str, Any]:
    """The per-domain default sensitivities in force (empty: the server's configured default everywhere)."""
    return state.policy(request).view()


@router.put(POLICY_PATH, response_model=PolicyView, tags=["prunewatch"], responses=_PUT_ERRORS)
async def put_policy(update: PolicyUpdate, request: Request) -> dict[str, Any]:
    """Replace the policy. Needs an API key; audited in the server log (key fingerprint, old and new)."""
    if not state.auth(request).enabled:
        raise APIError(403, "the pruning policy can only be changed on a server with API keys configured "
                            "(PRUNEWATCH_API_KEYS or PRUNEWATCH_API_KEYS_FILE)", code="policy_needs_auth")
    calibration = state.engine(request).calibration
    domains = validate_update(update, sorted(calibration.domains) if calibration is not None else None)
    who = key_fingerprint(request.headers.get("authorization"))
    policy = state.policy(request)
    previous = policy.replace(domains, who)
    client = request.client.host if request.client else "unknown"
    logger.warning("pruning policy changed by key %s from %s: %s -> %s", who, client, previous, domains)
    return policy.view()
