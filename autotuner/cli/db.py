"""`autotuner db`: create or migrate the results database's schema; export it to a file and import it back; its stored tokens."""

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


@db_app.command("token")
def db_token(
    action: Annotated[str, typer.Argument(help="add NAME | list | revoke ID")],
    what: Annotated[str | None, typer.Argument(metavar="NAME|ID", help="add: a name for it; revoke: its id")] = None,
    scope: Annotated[str, typer.Option(help="add: read (lookups), write (everything), or in-job (reads, and "
                                            "uploads of in-job measurements only: the token a training job "
                                            "holds for overlap(tune='missing'))")] = "in-job",
    db: Annotated[str | None, typer.Option("--db", help=DB_HELP)] = None,
) -> None:
    """The service's stored tokens: `add NAME` prints a new token once (only its SHA-256 digest
    is stored), `list` shows each id, name, scope and state, `revoke ID` ends one. Every
    measurement a stored token uploads records its id (the dashboard shows its name)."""
    import secrets

    from db import Database, NotFoundError, StorageError
    from db import repository as repo

    if action not in ("add", "list", "revoke"):
        fail(f"db token: the action is add, list or revoke, not {action!r}")
    if action != "list" and not what:
        fail(f"db token {action}: give the token's {'name' if action == 'add' else 'id'}")
    if action == "revoke" and not (what or "").isdigit():
        fail(f"db token revoke: the id is a number (see `autotuner db token list`), not {what!r}")
    try:
        with Database(db_url(db)) as database:
            database.check_schema()
            with database.session() as s:
                if action == "add":
                    token = secrets.token_urlsafe(32)
                    rec = repo.add_token(s, what or "", token, scope)
                    print(token)
                    err.print(f"token {rec.id} {rec.name!r} ({rec.scope}) stored; this is the only time it is shown",
                              highlight=False)
                elif action == "revoke":
                    rec = repo.revoke_token(s, int(what or 0))
                    err.print(f"token {rec.id} {rec.name!r} revoked", highlight=False)
                else:
                    for t in repo.list_tokens(s):
                        state = f"revoked {t.revoked_at:%Y-%m-%d %H:%M}" if t.revoked_at else "active"
                        print(f"{t.id}\t{t.name}\t{t.scope}\t{state}")
    except ValueError as e:
        fail(f"db token {action}: {e}")
    except (NotFoundError, StorageError) as e:
        fail(f"db token {action}: {e}")
