"""API-key authentication as OpenAI clients send it: `Authorization: Bearer <key>`.

Only sha256 digests of the keys are kept in memory, so a heap dump or a repr does not leak them,
and a presented key is compared against every digest with `hmac.compare_digest` (no early exit),
so response timing says nothing about which key or how much of one matched.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from pathlib import Path

from prunewatch.server.settings import ServerSettings


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def read_keys_file(path: Path) -> list[str]:
    """Keys of a keys file: one per line; blank lines and '#' comments are skipped."""
    keys = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            keys.append(line)
    return keys


class ApiKeyAuth:
    """Checks bearer tokens against the configured keys; disabled when none are configured."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests: tuple[bytes, ...] = tuple(sorted({_digest(k) for k in keys if k}))

    @classmethod
    def from_settings(cls, settings: ServerSettings) -> ApiKeyAuth:
        keys = [k.get_secret_value() for k in settings.api_keys]
        if settings.keys_file is not None:
            keys += read_keys_file(settings.keys_file)
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    @property
    def key_count(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"ApiKeyAuth(keys={self.key_count})"

    def is_authorized(self, authorization: str | None) -> bool:
        """True when auth is off, or the header is `Bearer <k>` for a configured key k."""
        if not self.enabled:
            return True
        token = bearer_token(authorization)
        return token is not None and self.is_key(token)

    def is_key(self, value: str) -> bool:
        """Whether `value` is one of the configured keys (False when none is configured)."""
        presented = _digest(value)
        matched = False
        for digest in self._digests:  # always walk every digest: constant time in the key count
            matched |= hmac.compare_digest(presented, digest)
        return matched


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, or None for any other shape."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token
