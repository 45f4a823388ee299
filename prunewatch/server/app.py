"""The FastAPI application: OpenAI-compatible routes over an already-built `PruningEngine`.

`create_app` takes the engine rather than a model path, so tests and the bench inject one engine
loaded once, and a deployment decides how it is loaded and calibrated (see `run.serve`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Body, Depends, FastAPI, Header, Request, Security
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from prunewatch.engine.pruning_engine import PruningEngine
from prunewatch.server import pruning_headers as ph
from prunewatch.server.admission import AdmissionQueue
from prunewatch.server.auth import ApiKeyAuth
from prunewatch.server.completions import CompletionService, GenerationSpec
from prunewatch.server.errors import APIError, install_error_handlers
from prunewatch.server.metrics import ServerMetrics
from prunewatch.server.middleware import (
    AuthMiddleware,
    BodyLimitMiddleware,
    RequestMetricsMiddleware,
)
from prunewatch.server.policy import PruningPolicy, policy_router
from prunewatch.server.redaction import install_log_redaction
from prunewatch.server.schemas import (
    BatchRequest,
    BatchResponse,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
)
from prunewatch.server.settings import ServerSettings

logger = logging.getLogger("prunewatch.server")

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 422, 429)}
# One server-sent event (the schema applies per event): `data` is a JSON chunk (the final one carries
# `usage` and `prunewatch`), an OpenAI error object if generation fails mid-stream, or `[DONE]`.
_SSE = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
}}}




def create_app(engine: PruningEngine, settings: ServerSettings | None = None,
               registry: CollectorRegistry | None = None) -> FastAPI:
    """An ASGI app serving `engine`; metrics go to `registry` (a fresh one when None)."""
    settings = settings or ServerSettings()
    auth = ApiKeyAuth.from_settings(settings)
    # Before the first request line reaches uvicorn's access log; this app's keys under any parameter name too.
    install_log_redaction(is_key=auth.is_key if auth.enabled else None)
    if not auth.enabled:
        logger.warning("no API keys configured (PRUNEWATCH_API_KEYS / PRUNEWATCH_API_KEYS_FILE): "
                       "the API accepts every request")
    metrics = ServerMetrics(engine.name, registry)
    metrics.set_queue_limit(settings.queue_depth)
    queue = AdmissionQueue(settings.queue_depth, settings.workers, on_change=metrics.set_in_queue,
                           threads=engine.settings.threads)
    policy = PruningPolicy()  # per-domain defaults for requests without X-Pruning-Sensitivity (prunewatch/server/policy.py)
    service = CompletionService(engine, settings, queue, metrics, policy=policy)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        queue.close()

    app = FastAPI(
        title="prunewatch engine API",
        version="1",
        description=(
            "OpenAI-compatible chat and completions over a pruning inference engine. Per-request pruning "
            "controls come as X-Pruning-* headers; every answer reports what was skipped (X-Pruning-Ratio, "
            "X-Pruning-Stats and the `prunewatch` body field, in linear-layer FLOPs, measured). Decoding is "
            "greedy: temperature, top_p and seed are accepted and have no effect."
        ),
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.queue = queue
    app.state.service = service
    app.state.policy = policy
    install_error_handlers(app)
    # Added innermost first: metrics sees every answer, auth runs before the body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(AuthMiddleware, auth=auth, public_metrics=settings.public_metrics)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)

    bearer = HTTPBearer(auto_error=False, description="An API key, as OpenAI clients send it.")
    api = APIRouter(dependencies=[Security(bearer)])
    examples = {
        "chat": {"summary": "chat", "value": {"model": engine.name, "max_tokens": 4,
                                                "messages": [{"role": "user", "content": "Hello"}]}},
    }
    completion_examples = {"completion": {"summary": "completion",
                                          "value": {"model": engine.name, "prompt": "Hello", "max_tokens": 4}}}

    def pruning(
        request: Request,
        sensitivity: str | None = Header(None, alias=ph.SENSITIVITY, description="0..1; 0 runs the dense model."),
        log_level: str | None = Header(None, alias=ph.LOG_LEVEL, description="NONE, SUMMARY or DETAILED."),
        blacklist: str | None = Header(None, alias=ph.BLACKLIST,
                                       description="Comma-separated layer indices never bypassed."),
        quality: str | None = Header(None, alias=ph.QUALITY, description=(
            "on: also score this answer against the dense model (token agreement, perplexity delta; "
            "costs a dense re-run, reported as quality_ms). off or absent: no check.")),
    ) -> ph.PruningRequest:
        """The X-Pruning-* request headers, declared once for every generating route.

        The parameters document the headers in the OpenAPI description; the values are read from
        all of the request's headers instead, because FastAPI keeps only one copy of a repeated
        header and a repeated pruning header must be refused, not resolved.
        """
        del sensitivity, log_level, blacklist, quality
        return ph.parse_request_headers(request.headers, engine.num_layers)

    async def respond(spec: GenerationSpec) -> Response:
        slot = service.admit()[0]
        if spec.stream:
            job = service.start(slot, spec)
            return StreamingResponse(service.sse(job, spec), media_type="text/event-stream", headers={
                ph.REQUEST_ID: spec.request_id, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        result, queue_ms = await service.complete(slot, spec)
        return JSONResponse(service.body(spec, result, queue_ms),
                            headers=ph.response_headers(result.stats, queue_ms))

    @api.post("/v1/chat/completions", response_model=ChatCompletion, tags=["openai"],
              responses={**_ERRORS, 200: {"content": _SSE}})
    async def chat_completions(
        body: ChatCompletionRequest = Body(openapi_examples=examples),
        overrides: ph.PruningRequest = Depends(pruning),
    ) -> Response:
        """Chat completion, streamed as server-sent events when `stream` is true."""
        return await respond(await service.prepare(body, overrides))

    @api.post("/v1/completions", response_model=Completion, tags=["openai"],
              responses={**_ERRORS, 200: {"content": _SSE}})
    async def completions(
        body: CompletionRequest = Body(openapi_examples=completion_examples),
        overrides: ph.PruningRequest = Depends(pruning),
    ) -> Response:
        """Text completion: the prompt is continued as given, without the chat template."""
        return await respond(await service.prepare(body, overrides))

    @api.post("/v1/batch", response_model=BatchResponse, tags=["prunewatch"], responses=_ERRORS)
    async def batch(
        body: BatchRequest,
        overrides: ph.PruningRequest = Depends(pruning),
    ) -> JSONResponse:
        """Several requests in one call, each pruned independently with its own stats.

        The headers set the batch's defaults; an item's `pruning` object overrides them. An item
        that fails its checks gets its own error; the batch is admitted as a whole (429 if it does
        not fit in the queue).
        """
        return JSONResponse(await service.batch(body, overrides))

    @api.get("/v1/models", response_model=ModelList, tags=["openai"], responses={401: {"model": ErrorResponse}})
    async def list_models() -> dict[str, Any]:
        """The one model this server serves."""
        return {"object": "list", "data": [ModelCard(id=engine.name, created=started).model_dump()]}

    @api.get("/v1/models/{model}", response_model=ModelCard, tags=["openai"],
             responses={401: {"model": ErrorResponse}, 404: {"model": ErrorResponse}})
    async def retrieve_model(model: str) -> dict[str, Any]:
        if model != engine.name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return ModelCard(id=engine.name, created=started).model_dump()

    @app.get("/health", response_model=Health, tags=["ops"])
    async def health() -> dict[str, Any]:
        """Liveness for load balancers; needs no API key."""
        return {"status": "ok", "model": engine.name, "calibrated": engine.calibration is not None}

    @api.get("/metrics", tags=["ops"], response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}},
                        401: {"model": ErrorResponse}})
    async def prometheus_metrics() -> Response:
        """Prometheus exposition of live-traffic metrics (the collector's names plus request counters)."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(api)
    app.include_router(policy_router(
        policy, auth, lambda: sorted(engine.calibration.domains) if engine.calibration is not None else None),
        dependencies=[Security(bearer)])
    return app
