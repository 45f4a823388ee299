"""Connect to the store and make sure its schema exists."""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.pool import ConnectionPoolEntry


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
        def _sqlite_pragmas(dbapi_connection: DBAPIConnection, _record: ConnectionPoolEntry) -> None:  # durable and concurrent enough
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


def sqlite_file(url: str) -> Path | None:
    """The file a SQLite URL names; None for another backend, an in-memory database or a bad URL."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        return None
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database)


def connect_existing(url: str) -> Engine:
    """An Engine on a store that already exists, for commands that only read or prune one.

    Why: connecting to a SQLite file that does not exist creates it, so a mistyped path would leave an
    empty file behind and the command would fail later on a missing table; here it fails first, and
    nothing is written. Server databases are checked with one round trip, as `connect` does.
    """
    path = sqlite_file(url)
    if path is not None and not path.is_file():
        raise StoreUnavailableError(f"no result store at {path} (the SQLite file does not exist); "
                                    f"`prunewatch run --db {safe_url(url)}` creates and fills one")
    return connect(url)


def connect_without_writing(url: str) -> Engine:
    """An Engine for `url`, checked as far as that is possible without creating or writing anything.

    Why: bad input must leave nothing behind, and connecting to a SQLite file that does not exist
    creates it. So a missing SQLite file is only checked to be creatable (its folder exists and is
    writable) and is created by the first write (`create_schema`); an existing one, and any server
    database, is checked with one round trip as `connect` does.
    """
    path = sqlite_file(url)
    if path is None or path.exists():
        return connect(url)
    engine = connect(url, check=False)  # the URL parses and its driver imports
    folder = path.parent if str(path.parent) else Path(".")
    problem = (f"folder {folder} does not exist" if not folder.is_dir()
               else f"folder {folder} is not writable" if not os.access(folder, os.W_OK | os.X_OK) else None)
    if problem is not None:
        engine.dispose()
        raise StoreUnavailableError(f"cannot create database {safe_url(url)}: {problem}")
    return engine

