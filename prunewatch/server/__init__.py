"""The engine's OpenAI-compatible HTTP API: chat, completions, batch, models, health, metrics."""

from prunewatch.server.app import create_app
from prunewatch.server.run import (
    ServeAddressError,
    bind_listener,
    build_engine,
    serve,
    serve_in_background,
)
from prunewatch.server.settings import ServerSettings

__all__ = ["ServeAddressError", "ServerSettings", "bind_listener", "build_engine", "create_app", "serve",
           "serve_in_background"]
