"""Connect to the store and make sure its schema exists."""

from __future__ import annotations

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from collector.store.models import Base


class StoreUnavailableError(RuntimeError):
    """The database URL is invalid or the server cannot be reached."""


def _safe_url(url: str) -> str:
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "<unparseable URL>"


def connect(url: str, *, check: bool = True) -> Engine:
    """An Engine for `url`; with `check`, one round trip proves the database answers."""
    try:
        engine = create_engine(url, pool_pre_ping=True, future=True)
    except (ArgumentError, ImportError, SQLAlchemyError) as exc:
        raise StoreUnavailableError(f"invalid database URL {_safe_url(url)}: {exc}".splitlines()[0]) from exc
    if engine.dialect.name == "sqlite":
        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection, _record) -> None:  # durable and concurrent enough
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()
    if check:
        try:
            with engine.connect() as connection:
                connection.execute(text("SELECT 1"))
        except SQLAlchemyError as exc:
            engine.dispose()
            reason = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
            raise StoreUnavailableError(f"cannot connect to database {_safe_url(url)}: {reason}") from exc
    return engine


def create_schema(engine: Engine) -> None:
    """Create missing tables (a fresh SQLite default); production schemas are migrated instead."""
    try:
        Base.metadata.create_all(engine)
    except SQLAlchemyError as exc:
        raise StoreUnavailableError(f"cannot create the schema: {str(exc).splitlines()[0]}") from exc
