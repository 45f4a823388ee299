"""The FastAPI application: OpenAI-compatible routes over an already-built `PruningEngine`.

`create_app` takes the engine rather than a model path, so tests and the bench inject one engine
loaded once, and a deployment decides how it is loaded and calibrated (see `run.serve`). It builds the
app's parts (auth, metrics, admission queue, policy, completion service), keeps them on `app.state`
(prunewatch/server/state.py) and includes the routers of prunewatch/server/routes/, which read them there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from prunewatch.engine.pruning_engine import PruningEngine
from prunewatch.server import state
from prunewatch.server.admission import AdmissionQueue
from prunewatch.server.auth import ApiKeyAuth
from prunewatch.server.completions import CompletionService
from prunewatch.server.errors import install_error_handlers
from prunewatch.server.metrics import ServerMetrics
from prunewatch.server.middleware import (
    AuthMiddleware,
    BodyLimitMiddleware,
    RequestMetricsMiddleware,
)
from prunewatch.server.policy import PruningPolicy
from prunewatch.server.redaction import install_log_redaction
from prunewatch.server.routes import API_KEY, generation, models, ops
from prunewatch.server.routes import policy as policy_routes
from prunewatch.server.settings import ServerSettings

logger = logging.getLogger("prunewatch.server")


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
    prefix_cache = engine.prefix_cache
    metrics.watch_prefix_cache(lambda: prefix_cache.bytes, lambda: prefix_cache.entries, prefix_cache.max_bytes)
    # With more than one worker the requests' threads only detokenize and stream (one intra-op thread each): every
    # forward pass runs on the batcher's stepper, which holds the cores.
    batcher = (engine.new_batcher(settings.workers, kv_budget_bytes=settings.kv_cache_mib * 2**20)
               if settings.workers > 1 else None)
    if batcher is not None:
        metrics.watch_kv_cache(lambda: batcher.kv_reserved_bytes, settings.kv_cache_mib * 2**20)
        metrics.watch_stepper(batcher.stepper_time)
    queue = AdmissionQueue(settings.queue_depth, settings.workers, on_change=metrics.set_in_queue,
                           threads=1 if batcher is not None else engine.settings.threads)
    policy = PruningPolicy()  # per-domain defaults for requests without X-Pruning-Sensitivity (prunewatch/server/policy.py)
    service = CompletionService(engine, settings, queue, metrics, policy=policy, batcher=batcher)
    app = FastAPI(
        title="prunewatch engine API",
        version="1",
        description=(
            "OpenAI-compatible chat and completions over a pruning inference engine. Per-request pruning "
            "controls come as X-Pruning-* headers; every answer reports what was skipped (X-Pruning-Ratio, "
            "X-Pruning-Stats and the `prunewatch` body field, in linear-layer FLOPs, measured). Decoding is "
            "greedy: temperature, top_p and seed are accepted and have no effect."
        ),
        lifespan=_lifespan,
    )
    state.install(app, engine=engine, settings=settings, auth=auth, metrics=metrics, queue=queue, service=service,
                  policy=policy, started=int(time.time()))
    install_error_handlers(app)
    # Added innermost first: metrics sees every answer, auth runs before the body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(AuthMiddleware, auth=auth, public_metrics=settings.public_metrics)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)

    app.include_router(ops.public_router)
    for router in (generation.router(engine.name), models.router, ops.router, policy_routes.router):
        app.include_router(router, dependencies=[API_KEY])
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Stop the admission queue's generation threads and the batcher when the server shuts down."""
    yield
    state.queue(app).close()
    batcher = app.state.service.batcher
    if batcher is not None:
        batcher.close()
