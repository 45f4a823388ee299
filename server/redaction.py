"""Credentials out of the logs: query-string parameters that look like secrets are redacted.

The API reads keys only from `Authorization: Bearer`, yet clients still put them in the URL
(`?api_key=`, `?key=`, `?access_token=`), and uvicorn's access log writes every request line with
its query string. A filter on the loggers that see request lines rewrites those values before any
handler formats the record, so no log file, collector or terminal ever holds the key.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
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


def redact_query(text: str) -> str:
    """`/v1/models?api_key=sk-1&x=2` -> `/v1/models?api_key=[REDACTED]&x=2`; other text is unchanged."""
    if "=" not in text:
        return text

    def replace(match: re.Match[str]) -> str:
        return f"{match.group(1)}={REDACTED}" if is_secret_name(match.group(1)) else match.group(0)

    return _PARAM.sub(replace, text)


def has_secret_param(query_string: bytes | str) -> bool:
    """Whether a raw query string (the ASGI scope's bytes) carries a secret-looking parameter."""
    text = query_string.decode("latin-1") if isinstance(query_string, bytes) else query_string
    return any(is_secret_name(name) for name, _ in parse_qsl(text, keep_blank_values=True))


class QuerySecretsFilter(logging.Filter):
    """Rewrites a record's arguments (uvicorn passes the request path as one) before formatting.

    The format string itself is rewritten only when there are no arguments: redacting a
    `key=%s` placeholder would break the formatting of the record.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact_query(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: redact_query(v) if isinstance(v, str) else v for k, v in record.args.items()}
        elif isinstance(record.msg, str):
            record.msg = redact_query(record.msg)
        return True


def install_log_redaction(logger_names: Iterable[str] = REDACTED_LOGGERS) -> None:
    """Add the filter to each logger once (create_app runs once per app, tests build many apps).

    A logger's filters survive uvicorn's `dictConfig`, which replaces handlers but not filters, so
    installing before or after uvicorn configures its logging both work.
    """
    for name in logger_names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, QuerySecretsFilter) for f in logger.filters):
            logger.addFilter(QuerySecretsFilter())
