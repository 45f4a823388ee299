"""Store in production: Alembic migrations equal the models, upserts, retention, and the db commands."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import typer
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from prunewatch.commands.collect import db_prune_command, db_upgrade_command
from prunewatch.records.store import ResultRepository, connect, create_schema
from prunewatch.records.store.governor import GovernorDecision, GovernorRepository
from prunewatch.records.store.migrate import current_revision, downgrade, head_revision, upgrade
from prunewatch.records.store.models import Base
from prunewatch.records.store.retention import parse_age, prune_older_than
from tests.collector.factories import ok_result
from tests.collector.prod_helpers import count_rows, fresh_database

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
QUERY_INDEXES = {"ix_probe_results_created_at", "ix_probe_results_target_created_at",
                 "ix_probe_results_domain_created_at", "ix_probe_results_model_domain_created_at",
                 "ix_probe_results_round_id"}


def assert_schema_equals_models(engine) -> None:
    with engine.connect() as connection:
        assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
    assert {ix["name"] for ix in inspect(engine).get_indexes("probe_results")} == QUERY_INDEXES
    assert current_revision(engine) == head_revision() == "0007"


@pytest.mark.integration
def test_postgres_upgrade_from_empty_then_again(postgres):
    engine = connect(fresh_database(postgres))
    assert current_revision(engine) is None
    assert upgrade(engine) == (None, "0007")
    assert upgrade(engine) == ("0007", "0007")  # idempotent
    assert_schema_equals_models(engine)
    with engine.connect() as connection:  # timestamps are zone-aware in PostgreSQL
        kinds = set(connection.execute(text(
            "SELECT data_type FROM information_schema.columns WHERE column_name IN ('created_at', 'started_at')")).scalars())
    assert kinds == {"timestamp with time zone"}
    engine.dispose()


@pytest.mark.integration
def test_postgres_step_by_step_and_downgrade(postgres):
    engine = connect(fresh_database(postgres))
    assert upgrade(engine, "0001") == (None, "0001")
    assert "ix_probe_results_round_id" not in {ix["name"] for ix in inspect(engine).get_indexes("probe_results")}
    assert upgrade(engine, "0002") == ("0001", "0002")
    assert "decode_pruning_ratio" not in {c["name"] for c in inspect(engine).get_columns("probe_results")}
    assert upgrade(engine, "0003") == ("0002", "0003")
    assert "device" not in {c["name"] for c in inspect(engine).get_columns("probe_results")}
    assert upgrade(engine, "0004") == ("0003", "0004")
    assert "baseline" not in {c["name"] for c in inspect(engine).get_columns("probe_results")}
    assert upgrade(engine) == ("0004", "0007")
    assert_schema_equals_models(engine)
    engine.dispose()


def test_store_made_before_migrations_is_adopted(tmp_path):
    """A SQLite file created by create_all (the embedded collector before migrations) is stamped, then upgraded."""
    engine = connect(f"sqlite:///{tmp_path / 'old.db'}")
    old_models = [ix for ix in Base.metadata.tables["probe_results"].indexes
                  if ix.name in ("ix_probe_results_model_domain_created_at", "ix_probe_results_round_id")]
    Base.metadata.create_all(engine)
    with engine.begin() as connection:  # as the first release created it: without 0002's indexes
        for ix in old_models:
            connection.execute(text(f"DROP INDEX {ix.name}"))
        connection.execute(text("DROP INDEX ix_collector_rounds_target_started_at"))
    with Session(engine) as session, session.begin():
        repo = ResultRepository(session)
        result = ok_result(device=None, device_name=None)  # as the first release stored it
        repo.start_round(round_id=result.round_id, target="t", model="m", started_at=NOW, probe_set_digest="d")
        repo.add(result)
    with engine.begin() as connection:  # nor 0003's and 0004's columns (the row written above has them NULL)
        for column in ("prefill_pruning_ratio", "decode_pruning_ratio", "quality_ms", "device", "device_name",
                       "client_ttft_ms", "client_decode_tokens_per_s", "baseline"):
            connection.execute(text(f"ALTER TABLE probe_results DROP COLUMN {column}"))
        connection.execute(text("DROP INDEX ix_collector_rounds_status_target"))
        connection.execute(text("ALTER TABLE collector_rounds DROP COLUMN status"))
    create_schema(engine)
    assert_schema_equals_models(engine)
    with Session(engine) as session:
        assert ResultRepository(session).get(result.result_id) == result  # data kept
    assert count_rows(str(engine.url), "SELECT status FROM collector_rounds") == [("running",)]  # never finished
    engine.dispose()


def check_0004_upgrade(url: str) -> None:
    """Rounds with an end become complete, open ones stay running; old results keep no device; twice is a no-op."""
    engine = connect(url)
    assert upgrade(engine, "0003")[1] == "0003"
    with engine.begin() as connection:
        for round_id, finished in (("d" * 32, NOW), ("o" * 32, None)):
            connection.execute(text(
                "INSERT INTO collector_rounds (round_id, target, model, started_at, finished_at, probes_ok, "
                "probes_failed, probe_set_digest) VALUES (:id, 't', 'm', :started, :finished, 3, 0, 'd')"),
                dict(id=round_id, started=NOW - timedelta(minutes=5), finished=finished))
    assert upgrade(engine, "0004") == ("0003", "0004")
    assert sorted(count_rows(url, "SELECT round_id, status FROM collector_rounds")) == [
        ("d" * 32, "complete"), ("o" * 32, "running")]
    assert downgrade(engine, "0003") == ("0004", "0003")  # drops what 0004 added; upgrading again restores it
    assert "status" not in {c["name"] for c in inspect(engine).get_columns("collector_rounds")}
    assert upgrade(engine, "0004") == ("0003", "0004")
    with engine.begin() as connection:  # a result stored before 0005: no client timings, not a baseline
        connection.execute(text(
            "INSERT INTO probe_results (result_id, round_id, created_at, target, model, probe_id, probe_version, "
            "probe_hash, domain, status, token_agreement) VALUES ('r', :round, :at, 't', 'm', 'p', 1, 'h', 'legal', 'ok', "
            "0.875)"), dict(round=("d" * 32), at=NOW))
    assert upgrade(engine) == ("0004", "0007")
    assert count_rows(url, "SELECT baseline, client_ttft_ms FROM probe_results") in ([(False, None)], [(0, None)])
    # 0007: the teacher-forced figure keeps its values under its new name; the served-answer figures start empty
    assert count_rows(url, "SELECT continuation_agreement, reference_agreement, task_passed FROM probe_results") == [
        (0.875, None, None)]
    assert downgrade(engine, "0006") == ("0007", "0006")  # the old name back, the value kept
    assert count_rows(url, "SELECT token_agreement FROM probe_results") == [(0.875,)]
    assert upgrade(engine) == ("0006", "0007")
    assert_schema_equals_models(engine)
    engine.dispose()


def test_0004_upgrade_sqlite(tmp_path):
    check_0004_upgrade(f"sqlite:///{tmp_path / 'm.db'}")


@pytest.mark.integration
def test_0004_upgrade_postgres(postgres):
    check_0004_upgrade(fresh_database(postgres))


def seed(engine, ages_days: dict[str, list[float]], now: datetime = NOW) -> dict[str, list[str]]:
    """One round per key, started at the oldest of its results; results aged as given (days before `now`)."""
    ids: dict[str, list[str]] = {}
    with Session(engine) as session, session.begin():
        repo = ResultRepository(session)
        for round_key, ages in ages_days.items():
            round_id = round_key * 32
            repo.start_round(round_id=round_id, target="t", model="m",
                             started_at=now - timedelta(days=max(ages)), probe_set_digest="d")
            batch = [ok_result(round_id=round_id, created_at=now - timedelta(days=age)) for age in ages]
            assert repo.add_many(batch) == len(batch)
            assert repo.add_many(batch) == 0  # a replay inserts nothing
            ids[round_key] = [r.result_id for r in batch]
    return ids


def check_retention(url: str) -> None:
    engine = connect(url)
    create_schema(engine)
    ids = seed(engine, {"a": [120, 100], "b": [95, 80], "c": [10, 1]})
    dry = prune_older_than(engine, timedelta(days=90), now=NOW, dry_run=True)
    assert (dry.results_deleted, dry.rounds_deleted, dry.dry_run) == (3, 1, True)
    report = prune_older_than(engine, timedelta(days=90), now=NOW, batch_size=2)
    assert (report.results_deleted, report.rounds_deleted) == (3, 1)
    assert report.cutoff == NOW - timedelta(days=90)
    with Session(engine) as session:
        repo = ResultRepository(session)
        assert sorted(r.result_id for r in repo.list()) == sorted([ids["b"][1], *ids["c"]])
        assert repo.round_count() == 2  # round b keeps its recent result; round a is gone
    assert prune_older_than(engine, timedelta(days=90), now=NOW).results_deleted == 0
    engine.dispose()


def _decision(days_ago: float, domain: str, setting: float) -> GovernorDecision:
    return GovernorDecision(decided_at=NOW - timedelta(days=days_ago), target="t", model="m", domain=domain,
                            old_setting=setting, new_setting=setting, reason="hold", agreement=0.97, probes=2,
                            good_rounds=1, floor=0.95)


def check_decision_retention(url: str) -> None:
    """Old decisions go, except the newest per key: it is the policy in force however old it is."""
    engine = connect(url)
    create_schema(engine)
    with Session(engine) as session, session.begin():
        repo = GovernorRepository(session)
        for decision in (_decision(200, "legal", 0.5), _decision(150, "legal", 0.45), _decision(120, "legal", 0.4),
                         _decision(100, "tech", 0.6), _decision(95, "finance", 0.55), _decision(5, "finance", 0.5)):
            repo.add(decision)
    dry = prune_older_than(engine, timedelta(days=90), now=NOW, dry_run=True)
    assert dry.decisions_deleted == 3  # legal 200 and 150 (120 is newer), finance 95 (5 is newer); tech is alone
    report = prune_older_than(engine, timedelta(days=90), now=NOW, batch_size=2)
    assert report.decisions_deleted == 3
    with Session(engine) as session:
        latest = {d.domain: d.new_setting for d in GovernorRepository(session).latest()}
        remaining = sorted((d.domain, d.new_setting) for d in GovernorRepository(session).history())
    assert latest == {"legal": 0.4, "tech": 0.6, "finance": 0.5}
    assert remaining == [("finance", 0.5), ("legal", 0.4), ("tech", 0.6)]
    assert prune_older_than(engine, timedelta(days=90), now=NOW).decisions_deleted == 0
    engine.dispose()


def test_decision_retention_sqlite(tmp_path):
    check_decision_retention(f"sqlite:///{tmp_path / 'd.db'}")


def test_decision_retention_postgres(postgres):
    check_decision_retention(fresh_database(postgres))


def test_retention_sqlite(tmp_path):
    check_retention(f"sqlite:///{tmp_path / 'r.db'}")


@pytest.mark.integration
def test_retention_postgres(postgres):
    check_retention(fresh_database(postgres))


@pytest.mark.parametrize("text_, seconds", [("90d", 90 * 86400), ("12h", 43200), ("30m", 1800), ("2w", 1209600),
                                            (" 7d ", 604800)])
def test_parse_age(text_, seconds):
    assert parse_age(text_).total_seconds() == seconds


@pytest.mark.parametrize("bad", ["", "90", "0d", "-1d", "1y", "1.5d", "d90"])
def test_parse_age_rejects(bad):
    with pytest.raises(ValueError, match="expected a positive age like 90d"):
        parse_age(bad)


def test_parse_age_accepts_a_century_and_no_more():
    assert parse_age("36500d").days == 36_500 and parse_age("5214w").days == 36_498
    for too_long in ("36501d", "5215w", "876001h", "99999999999999999999m"):
        with pytest.raises(ValueError, match="longer than the longest age accepted, 36500 days"):
            parse_age(too_long)


def cli() -> typer.Typer:
    app = typer.Typer()
    db = typer.Typer()
    db.command("upgrade")(db_upgrade_command)
    db.command("prune")(db_prune_command)
    app.add_typer(db, name="db")
    return app


@pytest.mark.integration
def test_db_commands_against_postgres(postgres):
    url = fresh_database(postgres)
    runner = CliRunner()
    first = runner.invoke(cli(), ["db", "upgrade", "--db", url])
    assert first.exit_code == 0, first.output
    assert "schema empty -> 0007" in first.output and "prunewatch:***@" in first.output and ":prunewatch@" not in first.output
    again = runner.invoke(cli(), ["db", "upgrade", "--db", url])
    assert "schema 0007 -> 0007 (already current)" in again.output
    older = runner.invoke(cli(), ["db", "upgrade", "--db", url, "--revision", "0003"])
    assert older.exit_code == 0
    assert "schema 0007 -> 0007 (already past 0003: an upgrade never goes back, nothing changed)" in older.output
    engine = connect(url)
    seed(engine, {"a": [400, 200], "b": [1]}, now=datetime.now(UTC))  # the command prunes from the real now
    engine.dispose()
    dry = runner.invoke(cli(), ["db", "prune", "--db", url, "--older-than", "90d", "--dry-run"])
    assert dry.exit_code == 0 and dry.output.startswith("would delete 2 result(s), 1 round(s) and 0 superseded ")
    pruned = runner.invoke(cli(), ["db", "prune", "--db", url, "--older-than", "90d"])
    assert pruned.exit_code == 0, pruned.output
    assert pruned.output.startswith("deleted 2 result(s), 1 round(s) and 0 superseded governor decision(s) older than ")
    assert count_rows(url, "SELECT round_id FROM probe_results") == [("b" * 32,)]


def test_db_prune_under_a_day_needs_yes(tmp_path):
    """`m` is minutes, as in Prometheus durations: `--older-than 1m` meant as a month would empty the store, so an
    age under a day deletes only with --yes (a dry run counts without it)."""
    url = f"sqlite:///{tmp_path / 'r.db'}"
    engine = connect(url)
    create_schema(engine)
    seed(engine, {"a": [0.5, 0.01], "b": [0.0001]}, now=datetime.now(UTC))  # 12 h, 14 min and 9 s old
    engine.dispose()
    runner = CliRunner()
    refused = runner.invoke(cli(), ["db", "prune", "--db", url, "--older-than", "1m"])
    assert refused.exit_code == 2
    assert refused.output.strip() == ("error: --older-than 1m keeps only the last 1 minute(s) of results: add --yes to "
                                      "delete everything older, or --dry-run to count it (m is minutes; a month is 30d)")
    assert len(count_rows(url, "SELECT result_id FROM probe_results")) == 3
    hours = runner.invoke(cli(), ["db", "prune", "--db", url, "--older-than", "6h"])
    assert hours.exit_code == 2 and "keeps only the last 6 hour(s) of results" in hours.output
    counted = runner.invoke(cli(), ["db", "prune", "--db", url, "--older-than", "1m", "--dry-run"])
    assert counted.exit_code == 0 and counted.output.startswith("would delete 2 result(s), 1 round(s)")
    confirmed = runner.invoke(cli(), ["db", "prune", "--db", url, "--older-than", "1m", "--yes"])
    assert confirmed.exit_code == 0 and confirmed.output.startswith("deleted 2 result(s), 1 round(s)")
    assert len(count_rows(url, "SELECT result_id FROM probe_results")) == 1


def test_db_commands_bad_input(tmp_path):
    runner = CliRunner()
    bad_age = runner.invoke(cli(), ["db", "prune", "--older-than", "ninety days", "--db", f"sqlite:///{tmp_path}/x.db"])
    assert bad_age.exit_code == 2
    assert bad_age.output.strip() == ("error: --older-than: expected a positive age like 90d, 12h, 30m or 2w, "
                                      "got 'ninety days'")
    too_old = runner.invoke(cli(), ["db", "prune", "--older-than", "99999999d", "--db", f"sqlite:///{tmp_path}/x.db"])
    assert too_old.exit_code == 2
    assert too_old.output.strip() == "error: --older-than: '99999999d' is longer than the longest age accepted, 36500 days"
    missing = runner.invoke(cli(), ["db", "prune", "--older-than", "90d", "--db", f"sqlite:///{tmp_path}/x.db"])
    assert missing.exit_code == 2
    assert missing.output.strip() == (f"error: no result store at {tmp_path}/x.db (the SQLite file does not exist); "
                                      f"`prunewatch run --db sqlite:///{tmp_path}/x.db` creates and fills one")
    assert not (tmp_path / "x.db").exists()  # a mistyped path leaves nothing behind
    (tmp_path / "x.db").touch()
    unmigrated = runner.invoke(cli(), ["db", "prune", "--older-than", "90d", "--db", f"sqlite:///{tmp_path}/x.db"])
    assert unmigrated.exit_code == 2 and "is not migrated to the current schema; run `prunewatch db upgrade`" in unmigrated.output
    down = runner.invoke(cli(), ["db", "upgrade", "--db", "postgresql+psycopg://u:secret@127.0.0.1:9/x"])
    assert down.exit_code == 2 and down.output.startswith("error: cannot connect to database ")
    assert "secret" not in down.output
    garbage = runner.invoke(cli(), ["db", "upgrade", "--db", "not a url"])
    assert garbage.exit_code == 2 and garbage.output.startswith("error: invalid database URL")
