"""Connect to the store and make sure its schema exists."""

from __future__ import annotations

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError


class StoreUnavailableError(RuntimeError):
    """The database URL is invalid or the server cannot be reached."""


def safe_url(url: str) -> str:
    """The URL with its password masked, for messages and logs."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "<unparseable URL>"


def reason(exc: BaseException) -> str:
    """The driver's own first line (e.g. "connection refused"), without SQLAlchemy's wrapping."""
    lines = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


PG_CONNECT_TIMEOUT_S = 5  # a collector must notice an unreachable server quickly and buffer instead


def connect(url: str, *, check: bool = True) -> Engine:
    """An Engine for `url`; with `check`, one round trip proves the database answers."""
    try:
        connect_args = {}
        if make_url(url).get_backend_name() == "postgresql":
            connect_args["connect_timeout"] = PG_CONNECT_TIMEOUT_S
        engine = create_engine(url, pool_pre_ping=True, future=True, connect_args=connect_args)
    except (ArgumentError, ImportError, SQLAlchemyError) as exc:
        raise StoreUnavailableError(f"invalid database URL {safe_url(url)}: {exc}".splitlines()[0]) from exc
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
            raise StoreUnavailableError(f"cannot connect to database {safe_url(url)}: {reason}") from exc
    return engine


def create_schema(engine: Engine) -> None:
    """Bring the store to the newest schema through the migrations (creating it when empty).

    Why migrations even for a fresh SQLite file: a store made today must be upgradable by the
    same history tomorrow, which a bare create_all would not record.
    """
    from collector.store.migrate import upgrade

    upgrade(engine)
