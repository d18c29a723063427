"""What the commands and the program-level work (`autotuner.program`) share to talk and to stop:
the stderr console, `say` (a progress line), `fail` (one line, exit 2), and the results database a
--db option names (`db_url`, `open_database`: a brand-new SQLite file is created by migration).
`autotuner.cli.common` re-exports them for the command groups."""

from __future__ import annotations

import sys
from typing import Any

import typer
from rich.console import Console

err = Console(stderr=True, width=None if sys.stderr.isatty() else 150, emoji=False)


def say(message: str) -> None:
    """A progress or status line on stderr (stdout stays for results and --json)."""
    err.print(message, highlight=False)


def fail(message: str, code: int = 2) -> None:
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


DB_HELP = "the results database URL (default AUTOTUNER_DB_URL, else ./autotuner.db)"


def db_url(db: str | None) -> str:
    from autotuner.settings import get_settings, normalize_db_url

    return normalize_db_url(db) if db else get_settings().db_url


def open_database(url: str, *, create: bool = True) -> Any:
    """The results database at `url`. A brand-new SQLite file is created by migration;
    anything else must already be at the current schema (SchemaError names the command)."""
    from db import Database, SchemaError, current_revision

    database = Database(url)
    try:
        database.check_schema()
    except SchemaError:
        if not (create and database.dialect == "sqlite" and current_revision(database.engine) is None
                and not _has_tables(database)):
            raise
        from autotuner.settings import redact_db_url

        err.print(f"creating the results database {redact_db_url(url)} (alembic upgrade head)")
        database.upgrade()
    return database


def _has_tables(database: Any) -> bool:
    from sqlalchemy import inspect

    return bool(inspect(database.engine).get_table_names())
