"""Operations: liveness for load balancers (no API key) and the Prometheus exposition (behind the key)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from prunewatch.server import state
from prunewatch.server.schemas import ErrorResponse, Health

public_router = APIRouter()
router = APIRouter()


@public_router.get("/health", response_model=Health, tags=["ops"])
async def health(request: Request) -> dict[str, Any]:
    """Liveness for load balancers; needs no API key."""
    engine = state.engine(request)
    return {"status": "ok", "model": engine.name, "calibrated": engine.calibration is not None}


@router.get("/metrics", tags=["ops"], response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}},
                       401: {"model": ErrorResponse}})
async def prometheus_metrics(request: Request) -> Response:
    """Prometheus exposition of live-traffic metrics (the collector's names plus request counters)."""
    return Response(generate_latest(state.metrics(request).registry), media_type=CONTENT_TYPE_LATEST)
