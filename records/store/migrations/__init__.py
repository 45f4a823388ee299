"""Alembic migrations of the result store; run with `prunewatch db upgrade` or `records.store.upgrade`."""
