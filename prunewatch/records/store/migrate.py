"""Schema migrations (Alembic), run from code so the CLI, the collector and tests share one path.

`upgrade` brings any store to the newest revision. A store created before migrations existed
(tables present, no `alembic_version`) is adopted: it is stamped at the initial revision, which
equals the schema that code created, and then upgraded like any other.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, inspect
from sqlalchemy.exc import SQLAlchemyError

from prunewatch.records.store.database import StoreUnavailableError, reason

MIGRATIONS_DIR = Path(str(files("prunewatch.records.store").joinpath("migrations")))
INITIAL_REVISION = "0001"
_TABLES = ("collector_rounds", "probe_results")


def _config(connection: Connection | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    """The newest revision this code knows."""
    head = ScriptDirectory.from_config(_config()).get_current_head()
    if head is None:  # pragma: no cover - the package always ships revisions
        raise RuntimeError(f"no migrations found in {MIGRATIONS_DIR}")
    return head


def current_revision(engine: Engine) -> str | None:
    """The store's revision; None for a store that was never migrated (or is empty)."""
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    except SQLAlchemyError as exc:
        raise StoreUnavailableError(f"cannot read the schema revision: {reason(exc)}") from exc


def is_current(engine: Engine) -> bool:
    return current_revision(engine) == head_revision()


def upgrade(engine: Engine, revision: str = "head") -> tuple[str | None, str]:
    """Migrate to `revision` (default: newest); returns (revision before, revision after)."""
    try:
        with engine.begin() as connection:
            before = MigrationContext.configure(connection).get_current_revision()
            config = _config(connection)
            if before is None and set(_TABLES) <= set(inspect(connection).get_table_names()):
                command.stamp(config, INITIAL_REVISION)  # adopt a store made before migrations existed
            command.upgrade(config, revision)
            after = MigrationContext.configure(connection).get_current_revision()
    except SQLAlchemyError as exc:
        raise StoreUnavailableError(f"cannot migrate the schema: {reason(exc)}") from exc
    return before, after or "base"


def downgrade(engine: Engine, revision: str) -> tuple[str | None, str]:
    """Migrate back to `revision`; returns (revision before, revision after). For tests and rollbacks."""
    try:
        with engine.begin() as connection:
            before = MigrationContext.configure(connection).get_current_revision()
            command.downgrade(_config(connection), revision)
            after = MigrationContext.configure(connection).get_current_revision()
    except SQLAlchemyError as exc:
        raise StoreUnavailableError(f"cannot migrate the schema: {reason(exc)}") from exc
    return before, after or "base"


def create_schema(engine: Engine) -> None:
    """Bring the store to the newest schema through the migrations (creating it when empty).

    Why migrations even for a fresh SQLite file: a store made today must be upgradable by the
    same history tomorrow, which a bare create_all would not record.
    """
    upgrade(engine)
