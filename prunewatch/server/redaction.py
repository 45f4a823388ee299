"""Credentials out of the logs: query-string parameters that look like secrets are redacted.

The API reads keys only from `Authorization: Bearer`, yet clients still put them in the URL
(`?api_key=`, `?key=`, `?access_token=`), and uvicorn's access log writes every request line with
its query string. A filter on the loggers that see request lines rewrites those values before any
handler formats the record, so no log file, collector or terminal ever holds the key.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from urllib.parse import parse_qsl, unquote_plus

REDACTED = "[REDACTED]"
# uvicorn's request lines, its errors, and this package's own server log.
REDACTED_LOGGERS = ("uvicorn.access", "uvicorn.error", "prunewatch.server")
# Over-matching is harmless (a value hidden from a log); missing one leaks a credential.
_SECRET_NAME = re.compile(r"key|token|secret|passw|pwd|auth|credential|signature|^sig$|session", re.IGNORECASE)
# One `name=value` of a query string inside any text: after ?, & or ;, up to the next separator.
_PARAM = re.compile(r"(?<=[?&;])([^=&;#?\s\"']+)=([^&;#\s\"']*)")


def is_secret_name(name: str) -> bool:
    """Whether a query parameter's name (percent-encoded or not) looks like it carries a credential."""
    return bool(_SECRET_NAME.search(unquote_plus(name)))


KeyCheck = Callable[[str], bool]
"""Whether a value is a configured API key (prunewatch.server.auth.ApiKeyAuth.is_key)."""


def redact_query(text: str, is_key: KeyCheck | None = None) -> str:
    """`/v1/models?api_key=sk-1&x=2` -> `/v1/models?api_key=[REDACTED]&x=2`; with `is_key`, a configured key
    under any name is redacted too (`?x=sk-1`). Other text is unchanged."""
    if "=" not in text:
        return text

    def replace(match: re.Match[str]) -> str:
        name, value = match.group(1), match.group(2)
        secret = is_secret_name(name) or (is_key is not None and bool(value) and is_key(unquote_plus(value)))
        return f"{name}={REDACTED}" if secret else match.group(0)

    return _PARAM.sub(replace, text)


def has_secret_param(query_string: bytes | str, is_key: KeyCheck | None = None) -> bool:
    """Whether a raw query string (the ASGI scope's bytes) carries a secret-looking parameter, or, with
    `is_key`, a configured key under any name."""
    text = query_string.decode("latin-1") if isinstance(query_string, bytes) else query_string
    return any(is_secret_name(name) or (is_key is not None and bool(value) and is_key(value))
               for name, value in parse_qsl(text, keep_blank_values=True))


class QuerySecretsFilter(logging.Filter):
    """Rewrites a record's arguments (uvicorn passes the request path as one) before formatting.

    The format string itself is rewritten only when there are no arguments: redacting a
    `key=%s` placeholder would break the formatting of the record. Configured keys are redacted under
    any parameter name: every app of the process registers its key check (`install_log_redaction`).
    """

    def __init__(self) -> None:
        super().__init__()
        self.key_checks: list[KeyCheck] = []

    def _is_key(self, value: str) -> bool:
        return any(check(value) for check in self.key_checks)

    def _redact(self, text: str) -> str:
        return redact_query(text, self._is_key if self.key_checks else None)

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(self._redact(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: self._redact(v) if isinstance(v, str) else v for k, v in record.args.items()}
        elif isinstance(record.msg, str):
            record.msg = self._redact(record.msg)
        return True


def install_log_redaction(logger_names: Iterable[str] = REDACTED_LOGGERS, is_key: KeyCheck | None = None) -> None:
    """Add the filter to each logger once (create_app runs once per app, tests build many apps), and
    `is_key` (the app's configured keys) to the checks it applies.

    A logger's filters survive uvicorn's `dictConfig`, which replaces handlers but not filters, so
    installing before or after uvicorn configures its logging both work.
    """
    for name in logger_names:
        logger = logging.getLogger(name)
        installed = next((f for f in logger.filters if isinstance(f, QuerySecretsFilter)), None)
        if installed is None:
            installed = QuerySecretsFilter()
            logger.addFilter(installed)
        if is_key is not None and is_key not in installed.key_checks:
            installed.key_checks.append(is_key)
