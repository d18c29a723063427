"""`autotuner db`: create or migrate the results database's schema; export it to a file and import it back."""

from __future__ import annotations

from typing import Annotated

import typer

from autotuner.cli.common import DB_HELP, db_app, db_url, err, fail, open_database

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


@db_app.command("export")
def db_export(
    path: Annotated[str, typer.Argument(metavar="FILE", help="where to write it (.json, or .json.gz gzipped)")],
    db: Annotated[str | None, typer.Option("--db", help=DB_HELP)] = None,
) -> None:
    """Every table of the results database to FILE (a backup beyond /v1/snapshot's winners)."""
    from autotuner.settings import redact_db_url
    from db import Database, StorageError
    from db.export import export_rows, write_export

    url = db_url(db)
    try:
        with Database(url) as database:
            database.check_schema()
            doc = export_rows(database)
        write_export(doc, path)
    except (StorageError, OSError) as e:
        fail(f"db export: {e}")
    rows = sum(len(r) for r in doc["tables"].values())
    err.print(f"exported {rows} row(s) of {len(doc['tables'])} tables at revision {doc['revision']} from "
              f"{redact_db_url(url)} to {path}", highlight=False)


@db_app.command("import")
def db_import(
    path: Annotated[str, typer.Argument(metavar="FILE", help="an `autotuner db export` file")],
    db: Annotated[str | None, typer.Option("--db", help=DB_HELP + "; empty, at the export's revision")] = None,
) -> None:
    """Fill an empty results database with an export's rows, ids included (a new SQLite file is
    created at the current revision first)."""
    from autotuner.settings import redact_db_url
    from db import StorageError
    from db.export import import_rows, read_export

    url = db_url(db)
    try:
        doc = read_export(path)
        with open_database(url) as database:
            written = import_rows(database, doc)
    except StorageError as e:
        fail(f"db import: {e}")
    err.print(f"imported {sum(written.values())} row(s) into {redact_db_url(url)}", highlight=False)
