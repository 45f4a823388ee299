"""HTTP server configuration: typed, ranged, read from arguments or PRUNEWATCH_SERVER_* variables.

API keys are the one exception to the prefix: OpenAI-style deployments pass them as
`PRUNEWATCH_API_KEYS` (comma-separated) or `PRUNEWATCH_API_KEYS_FILE` (one key per line), the
names the issue fixed. Keys are `SecretStr`, so printing the settings never shows one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

API_KEYS_ENV = "PRUNEWATCH_API_KEYS"
API_KEYS_FILE_ENV = "PRUNEWATCH_API_KEYS_FILE"


class ServerSettings(BaseSettings):
    """How the engine's HTTP API listens, admits requests and bounds their size."""

    model_config = SettingsConfigDict(env_prefix="PRUNEWATCH_SERVER_", extra="forbid", validate_by_name=True)

    host: str = Field(
        "127.0.0.1", description="Interface to bind; loopback by default so nothing is exposed by accident."
    )
    port: int = Field(8000, ge=0, le=65535, description="TCP port (0 lets the OS pick one).")
    queue_depth: int = Field(
        64, ge=1, le=100_000,
        description="Requests admitted at once, waiting plus running; past it the server answers 429 + Retry-After.",
    )
    workers: int = Field(
        8, ge=1, le=64,
        description=(
            "Generations decoded together: up to this many requests share each decode step (continuous batching, "
            "prunewatch/engine/batching.py), which reads the weights once for all of them; the rest wait in the "
            "queue. 1 runs one generation at a time, without the batcher."
        ),
    )
    kv_cache_mib: int = Field(
        1024, ge=1, le=1_048_576,
        description=(
            "KV cache the requests decoding together may hold, in MiB. Each reserves its prompt plus max_tokens at "
            "every layer when it starts and waits for room past the budget; one that alone needs more is 400. "
            "With workers 1 (no batcher) there is one cache at a time and no bound."
        ),
    )
    max_prompt_tokens: int = Field(
        2048, ge=1, description="Longest prompt accepted, in tokens after the chat template; longer is 413."
    )
    max_tokens_limit: int = Field(
        512, ge=1, le=8192, description="Largest max_tokens a request may ask for; larger is 400."
    )
    default_max_tokens: int = Field(
        16, ge=1, description="Completion length when a request names none (OpenAI's legacy completions default)."
    )
    max_batch_size: int = Field(16, ge=1, le=1024, description="Requests per POST /v1/batch; more is 413.")
    max_body_bytes: int = Field(
        1_048_576, ge=1024, description="Largest request body read, in bytes; larger is 413 before parsing."
    )
    public_metrics: bool = Field(
        False, description="Serve /metrics without an API key (a Prometheus on a private network)."
    )
    api_keys: Annotated[tuple[SecretStr, ...], NoDecode] = Field(
        (), validation_alias=API_KEYS_ENV,
        description="Accepted bearer keys, comma-separated in the environment. None configured: auth is off.",
    )
    keys_file: Path | None = Field(
        None, validation_alias=API_KEYS_FILE_ENV,
        description="File with one API key per line ('#' starts a comment); merged with api_keys.",
    )

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        """Accept 'a,b' from the environment as well as a list from code; drop blanks."""
        if isinstance(value, (str, SecretStr)):
            raw = value.get_secret_value() if isinstance(value, SecretStr) else value
            value = raw.split(",")
        if isinstance(value, (list, tuple)):
            keys = [k.get_secret_value() if isinstance(k, SecretStr) else str(k) for k in value]
            return tuple(k.strip() for k in keys if k.strip())
        return value

    @model_validator(mode="after")
    def _default_within_limit(self) -> ServerSettings:
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(
                f"default_max_tokens ({self.default_max_tokens}) exceeds max_tokens_limit ({self.max_tokens_limit})"
            )
        if self.keys_file is not None and not self.keys_file.is_file():
            raise ValueError(f"API keys file not found: {self.keys_file}")
        return self
