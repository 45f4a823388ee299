"""Names of the store's settings, shared by every command: importing this costs nothing (no SQLAlchemy)."""

from __future__ import annotations

STORE_URL_ENV = "PRUNEWATCH_DB_URL"
"""The one environment variable that names the store, for every command and service that reads or writes it."""
DEFAULT_STORE_URL = "sqlite:///prunewatch.db"
"""Where results go when neither a flag, the environment nor a config file names a store."""
