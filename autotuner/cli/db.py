"""`autotuner db upgrade`: create or migrate the results database's schema."""

from __future__ import annotations

from typing import Annotated

import typer

from autotuner.cli.common import DB_HELP, db_app, db_url, err

# -- db --------------------------------------------------------------------------------------------

@db_app.command("upgrade")
def db_upgrade(
    db: Annotated[str | None, typer.Option("--db", help=DB_HELP)] = None,
    revision: Annotated[str, typer.Option(help="target revision")] = "head",
) -> None:
    """Create or migrate the schema (alembic upgrade)."""
    from autotuner.settings import redact_db_url
    from db import Database

    url = db_url(db)
    Database(url).upgrade(revision)
    err.print(f"database {redact_db_url(url)} is at revision {revision}")
