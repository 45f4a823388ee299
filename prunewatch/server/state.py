"""The parts of one API app, built once by `create_app`, kept on `app.state` and read by the routes.

A route reads what it needs from its request (`state.service(request)`) instead of closing over variables of
`create_app`, so the routes live in modules of their own (prunewatch/server/routes/) while every app keeps its
own engine, queue, metrics and policy. The attribute names are written here only.
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from prunewatch.engine.pruning_engine import PruningEngine
from prunewatch.server.admission import AdmissionQueue
from prunewatch.server.auth import ApiKeyAuth
from prunewatch.server.completions import CompletionService
from prunewatch.server.metrics import ServerMetrics
from prunewatch.server.policy import PruningPolicy
from prunewatch.server.settings import ServerSettings


def install(app: FastAPI, *, engine: PruningEngine, settings: ServerSettings, auth: ApiKeyAuth,
            metrics: ServerMetrics, queue: AdmissionQueue, service: CompletionService, policy: PruningPolicy,
            started: int) -> None:
    """Keep the app's parts on `app.state`; `started` is the Unix time the models list reports as `created`."""
    app.state.engine = engine
    app.state.settings = settings
    app.state.auth = auth
    app.state.metrics = metrics
    app.state.queue = queue
    app.state.service = service
    app.state.policy = policy
    app.state.started = started


def engine(request: Request) -> PruningEngine:
    return request.app.state.engine


def auth(request: Request) -> ApiKeyAuth:
    return request.app.state.auth


def metrics(request: Request) -> ServerMetrics:
    return request.app.state.metrics


def queue(app: FastAPI) -> AdmissionQueue:
    """The admission queue (of the app: the lifespan closes it without a request)."""
    return app.state.queue


def service(request: Request) -> CompletionService:
    return request.app.state.service


def policy(request: Request) -> PruningPolicy:
    return request.app.state.policy


def started(request: Request) -> int:
    return request.app.state.started
