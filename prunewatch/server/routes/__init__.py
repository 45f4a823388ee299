"""The API's routes, one module per concern; handlers read the app's parts from `request.app.state` (../state.py).

    generation   POST /v1/chat/completions, /v1/completions, /v1/batch
    models       GET /v1/models, /v1/models/{model}
    ops          GET /health (public), /metrics
    policy       GET and PUT /v1/pruning/policy

Every route but /health sits behind `API_KEY`, which documents the bearer key in the OpenAPI description
(the auth middleware checks it: prunewatch/server/middleware.py).
"""

from fastapi import Security
from fastapi.security import HTTPBearer

API_KEY = Security(HTTPBearer(auto_error=False, description="An API key, as OpenAI clients send it."))
