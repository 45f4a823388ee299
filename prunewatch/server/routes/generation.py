"""The generating routes: chat, text completions and batches, with the X-Pruning-* request headers.

Every check that can refuse a request runs in `CompletionService.prepare` before admission; a route admits
the checked request and answers it as JSON, or as server-sent events when `stream` is true.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from prunewatch.server import pruning_headers as ph
from prunewatch.server import state
from prunewatch.server.completions import CompletionService, GenerationSpec
from prunewatch.server.schemas import (
    BatchRequest,
    BatchResponse,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
)

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 422, 429)}
# One server-sent event (the schema applies per event): `data` is a JSON chunk (the final one carries
# `usage` and `prunewatch`), an OpenAI error object if generation fails mid-stream, or `[DONE]`.
_SSE = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
}}}


def pruning(
    request: Request,
    sensitivity: Annotated[str | None, Header(alias=ph.SENSITIVITY, description="0..1; 0 runs the dense model.")] = None,
    log_level: Annotated[str | None, Header(alias=ph.LOG_LEVEL, description="NONE, SUMMARY or DETAILED.")] = None,
    blacklist: Annotated[str | None, Header(alias=ph.BLACKLIST,
                                            description="Comma-separated layer indices never bypassed.")] = None,
    quality: Annotated[str | None, Header(alias=ph.QUALITY, description=(
        "on: also score this answer against the dense model (token agreement, perplexity delta; "
        "costs a dense re-run, reported as quality_ms). off or absent: no check."))] = None,
) -> ph.PruningRequest:
    """The X-Pruning-* request headers, declared once for every generating route.

    The parameters document the headers in the OpenAPI description; the values are read from
    all of the request's headers instead, because FastAPI keeps only one copy of a repeated
    header and a repeated pruning header must be refused, not resolved.
    """
    del sensitivity, log_level, blacklist, quality
    return ph.parse_request_headers(request.headers, state.engine(request).num_layers)


PruningHeaders = Annotated[ph.PruningRequest, Depends(pruning)]


async def _respond(service: CompletionService, spec: GenerationSpec) -> Response:
    """Admit a checked request (429 when the queue is full) and answer it, streamed or whole."""
    slot = service.admit()[0]
    if spec.stream:
        job = service.start(slot, spec)
        return StreamingResponse(service.sse(job, spec), media_type="text/event-stream", headers={
            ph.REQUEST_ID: spec.request_id, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    result, queue_ms = await service.complete(slot, spec)
    return JSONResponse(service.body(spec, result, queue_ms), headers=ph.response_headers(result.stats, queue_ms))


async def chat_completions(
    request: Request,
    body: ChatCompletionRequest,
    overrides: PruningHeaders,
) -> Response:
    """Chat completion, streamed as server-sent events when `stream` is true."""
    service = state.service(request)
    return await _respond(service, await service.prepare(body, overrides))


async def completions(
    request: Request,
    body: CompletionRequest,
    overrides: PruningHeaders,
) -> Response:
    """Text completion: the prompt is continued as given, without the chat template."""
    service = state.service(request)
    return await _respond(service, await service.prepare(body, overrides))


async def batch(
    request: Request,
    body: BatchRequest,
    overrides: PruningHeaders,
) -> JSONResponse:
    """Several requests in one call, each pruned independently with its own stats.

    The headers set the batch's defaults; an item's `pruning` object overrides them. An item
    that fails its checks gets its own error; the batch is admitted as a whole (429 if it does
    not fit in the queue).
    """
    return JSONResponse(await state.service(request).batch(body, overrides))


def _request_examples(name: str, value: dict[str, Any]) -> dict[str, Any]:
    """An OpenAPI request-body example, as `Body(openapi_examples=...)` would declare it."""
    return {"requestBody": {"content": {"application/json": {"examples": {name: {"summary": name, "value": value}}}}}}


def router(model: str) -> APIRouter:
    """The generating routes; `model`, the served model's name, fills their OpenAPI request examples (so that
    "Try it out" on /docs sends a request this server accepts)."""
    routes = APIRouter()
    streamed = {**_ERRORS, 200: {"content": _SSE}}
    routes.add_api_route(
        "/v1/chat/completions", chat_completions, methods=["POST"], response_model=ChatCompletion,
        tags=["openai"], responses=streamed, openapi_extra=_request_examples("chat", {
            "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hello"}]}))
    routes.add_api_route(
        "/v1/completions", completions, methods=["POST"], response_model=Completion, tags=["openai"],
        responses=streamed, openapi_extra=_request_examples(
            "completion", {"model": model, "prompt": "Hello", "max_tokens": 4}))
    routes.add_api_route("/v1/batch", batch, methods=["POST"], response_model=BatchResponse, tags=["prunewatch"],
                         responses=_ERRORS)
    return routes
