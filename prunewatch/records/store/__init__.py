"""Durable history of probe results (SQLAlchemy 2.x: SQLite by default, PostgreSQL in production)."""

from prunewatch.records.store.database import (
           StoreUnavailableError,
           connect,
           connect_existing,
           connect_without_writing,
           safe_url,
)
from prunewatch.records.store.migrate import create_schema, head_revision, upgrade
from prunewatch.records.store.repository import ResultRepository
from prunewatch.records.store.retention import parse_age, prune_older_than

__all__ = ["ResultRepository", "StoreUnavailableError", "connect", "connect_existing", "connect_without_writing", "create_schema",
           "head_revision", "parse_age", "prune_older_than", "upgrade", "safe_url"]
