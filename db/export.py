"""Every table of the results database to one file and back (`autotuner db export` / `import`):
a backup of the results beyond `/v1/snapshot` (winners only), and the way to keep rows a
downgrade would drop (`db.downgrade_guard`).

The file is JSON (gzipped when its name ends in .gz): the schema revision it was written at and,
per table in dependency order, its rows as objects (timestamps ISO 8601 in UTC, JSON columns as
JSON). Import fills an empty database at the same revision with exactly those rows, ids
included, in one transaction; on PostgreSQL the id sequences then continue after them. The
tables are read from the ORM's metadata (`db.tables.Base`), so a table added later is exported
without a change here.
"""

from __future__ import annotations

import gzip
import json
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import DateTime, insert, select, text

from db.database import Database, current_revision
from db.errors import SchemaError
from db.tables import Base

__all__ = ["FORMAT", "export_rows", "import_rows", "read_export", "write_export"]

FORMAT = "autotuner-db-export"
# tables whose rows the schema itself starts with (0006's one-row change counter, 0010's schema readers): an import
# replaces them rather than finding the database not empty
SEEDED = frozenset({"generation", "schema_readers"})


def _is_time(column: Any) -> bool:
    t = column.type
    return isinstance(getattr(t, "impl", t), DateTime) or isinstance(t, DateTime)


def export_rows(database: Database) -> dict[str, Any]:
    """The whole database as one document (see the module docs), read in one transaction (on
    PostgreSQL a repeatable-read one: one snapshot of every table)."""
    revision = current_revision(database.engine)
    with database.session(read_only=True) as s:
        if database.dialect == "postgresql":
            s.connection(execution_options={"isolation_level": "REPEATABLE READ"})
        tables: dict[str, list[dict[str, Any]]] = {}
        for table in Base.metadata.sorted_tables:
            times = {c.name for c in table.columns if _is_time(c)}
            pk = list(table.primary_key.columns)
            rows = s.execute(select(table).order_by(*pk)).mappings().all()
            tables[table.name] = [{k: (v.isoformat() if k in times and v is not None else v) for k, v in r.items()}
                                  for r in rows]
    return {"format": FORMAT, "revision": revision, "tables": tables}


def import_rows(database: Database, doc: dict[str, Any]) -> dict[str, int]:
    """Write `doc` (`export_rows`) into `database`, which must be at the same revision and empty
    (SchemaError otherwise, nothing written); rows per table."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("tables"), dict):
        raise SchemaError(f"not an autotuner database export (expected format {FORMAT!r})")
    known = {t.name: t for t in Base.metadata.sorted_tables}
    unknown = sorted(set(doc["tables"]) - set(known))
    if unknown:
        raise SchemaError(f"the export has tables this version does not know: {', '.join(unknown)}")
    written: dict[str, int] = {}
    revision = current_revision(database.engine)
    with database.session() as s:
        if revision != doc.get("revision"):
            raise SchemaError(f"the export was written at revision {doc.get('revision')!r}, this database is at "
                              f"{revision!r}: migrate one of them first (autotuner db upgrade)")
        for name, table in known.items():
            if name not in SEEDED and s.execute(select(table).limit(1)).first() is not None:
                raise SchemaError(f"the database is not empty (table {name} has rows): import fills an empty one")
        for name, table in known.items():   # parents before children
            if name in SEEDED and name in doc["tables"]:
                s.execute(table.delete())
            times = {c.name for c in table.columns if _is_time(c)}
            rows = [{k: (datetime.fromisoformat(v) if k in times and v is not None else v) for k, v in r.items()}
                    for r in doc["tables"].get(name, [])]
            if rows:
                s.execute(insert(table), rows)
            written[name] = len(rows)
        if s.get_bind().dialect.name == "postgresql":   # ids go on after the imported ones
            for name, table in known.items():
                if "id" in table.columns and written.get(name):
                    s.execute(text(f"SELECT setval(pg_get_serial_sequence('{name}', 'id'), "
                                   f"(SELECT max(id) FROM {name}))"))
    return written


def write_export(doc: dict[str, Any], path: str | Path) -> None:
    """`doc` as JSON at `path`, gzipped for a .gz name, written whole or not at all."""
    from autotuner.files import write_atomic

    data = json.dumps(doc, separators=(",", ":")).encode()
    write_atomic(str(path), gzip.compress(data, mtime=0) if str(path).endswith(".gz") else data)


def read_export(path: str | Path) -> dict[str, Any]:
    """The document at `path` (gzipped or not); SchemaError for a file that is not one."""
    try:
        raw = Path(path).read_bytes()
        doc = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    except (OSError, ValueError, EOFError) as e:
        raise SchemaError(f"cannot read the export {path}: {e}") from None
    if not isinstance(doc, dict):
        raise SchemaError(f"{path} is not an autotuner database export")
    return doc
