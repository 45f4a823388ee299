"""Alembic migrations of the result store; run with `prunewatch db upgrade` or `prunewatch.records.store.upgrade`."""
