"""`prunewatch governor status`: the pruning policy the quality governor holds, and why.

Plain functions with typer options; the `prunewatch` app mounts them under `governor`.
"""

from __future__ import annotations

from typing import Annotated

import typer

from prunewatch.cli_errors import fail
from prunewatch.records.settings import DEFAULT_STORE_URL, STORE_URL_ENV


def status_command(
    db: Annotated[str, typer.Option("--db", envvar=STORE_URL_ENV, help="SQLAlchemy URL of the store.")] = DEFAULT_STORE_URL,
    target: Annotated[str | None, typer.Option("--target", "-t", help="Only this target.")] = None,
) -> None:
    """Print the current sensitivity per (target, model, domain) with the last decision and its evidence."""
    from sqlalchemy import inspect
    from sqlalchemy.exc import SQLAlchemyError
    from sqlalchemy.orm import Session

    from prunewatch.records.store import StoreUnavailableError, connect_existing, safe_url
    from prunewatch.records.store.governor import GovernorRepository

    try:
        engine = connect_existing(db)
        if "governor_decisions" not in inspect(engine).get_table_names():
            raise fail(f"store {safe_url(db)} has no governor decisions table; run `prunewatch db upgrade --db ...`")
        with Session(engine) as session:
            latest = GovernorRepository(session).latest(target=target)
        engine.dispose()
    except StoreUnavailableError as exc:
        raise fail(str(exc))
    except SQLAlchemyError as exc:
        raise fail(f"cannot read governor decisions from {safe_url(db)}: {str(exc).splitlines()[0]}")
    if not latest:
        typer.echo("no governor decisions" + (f" for target {target}" if target else "") + f" in {safe_url(db)}")
        return
    for d in latest:
        agreement = "not measured" if d.agreement is None else f"{d.agreement:.4f}" + (
            f" [{d.agreement_low:.4f}, {d.agreement_high:.4f}] (95%, {d.tokens} tokens)"
            if d.agreement_low is not None and d.agreement_high is not None else "")
        change = (f"{d.old_setting:g} -> {d.new_setting:g}" if d.changed else f"held at {d.new_setting:g}")
        typer.echo(f"{d.target} / {d.model} / {d.domain}: sensitivity {d.new_setting:g}")
        typer.echo(f"  why: {d.reason} ({change}) at {d.decided_at:%Y-%m-%d %H:%M:%S} UTC; reference-scored "
                   f"agreement {agreement} over {d.probes} prompt(s), floor {d.floor:g}, {d.good_rounds} good "
                   f"round(s) in a row, "
                   f"round {d.round_id or '-'}")
