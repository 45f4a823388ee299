"""Durable history of probe results (SQLAlchemy 2.x: SQLite by default, PostgreSQL in production)."""

from collector.store.database import StoreUnavailableError, connect, create_schema
from collector.store.repository import ResultRepository

__all__ = ["ResultRepository", "StoreUnavailableError", "connect", "create_schema"]
