"""What a migration's downgrade may drop: a table whose rows are results refuses to go while it
holds any (issue 38: a downgrade never loses data silently); the coherence tables (`generation`,
`winner_changes`) are derived state the service rebuilds, and go. Used by the revisions under
db/migrations/versions; the error says how to keep the rows first."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from db.errors import SchemaError

__all__ = ["refuse_to_drop_rows"]


def refuse_to_drop_rows(*tables: str, revision: str) -> None:
    """SchemaError, naming each table and its row count, where downgrading below `revision` would
    drop rows of `tables`; nothing where they are empty (or absent)."""
    bind = op.get_bind()
    present = set(sa.inspect(bind).get_table_names())
    full = {t: n for t in tables if t in present
            and (n := bind.execute(sa.text(f'SELECT count(*) FROM "{t}"')).scalar_one())}
    if full:
        held = ", ".join(f"{t} ({n} row{'s' if n != 1 else ''})" for t, n in full.items())
        raise SchemaError(
            f"downgrading below {revision} would drop {held}: keep them first with `autotuner db export "
            f"FILE`, then delete those rows (or stay at {revision} or above); nothing was changed")
