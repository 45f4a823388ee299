"""Alembic environment: migrate the connection the caller hands over (see prunewatch/records/store/migrate.py).

The project runs migrations programmatically, never from an alembic.ini: the caller opens the
connection (so URL handling, SQLite pragmas and errors are the store's own) and passes it in
`config.attributes["connection"]`.
"""

from __future__ import annotations

from alembic import context

from prunewatch.records.store.models import Base

target_metadata = Base.metadata


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is None:
        raise RuntimeError("collector migrations need a connection in config.attributes['connection']")
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite alters tables by copying them
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    raise RuntimeError("offline (SQL script) migrations are not supported; run `prunewatch db upgrade`")
run_migrations_online()
