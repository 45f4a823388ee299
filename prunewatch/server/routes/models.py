"""The one model this server serves, as OpenAI's models endpoints list it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from prunewatch.server import state
from prunewatch.server.errors import APIError
from prunewatch.server.schemas import ErrorResponse, ModelCard, ModelList

router = APIRouter()


def _card(request: Request) -> dict[str, Any]:
    return ModelCard(id=state.engine(request).name, created=state.started(request)).model_dump()


@router.get("/v1/models", response_model=ModelList, tags=["openai"], responses={401: {"model": ErrorResponse}})
async def list_models(request: Request) -> dict[str, Any]:
    """The one model this server serves."""
    return {"object": "list", "data": [_card(request)]}


@router.get("/v1/models/{model}", response_model=ModelCard, tags=["openai"],
            responses={401: {"model": ErrorResponse}, 404: {"model": ErrorResponse}})
async def retrieve_model(model: str, request: Request) -> dict[str, Any]:
    if model != state.engine(request).name:
        raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
    return _card(request)
