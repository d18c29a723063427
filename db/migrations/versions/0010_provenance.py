"""measurements record who wrote them; in-job tokens; the schema says which older code reads it

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06

Provenance (issue 38): a measurement's `source` (tuned, in-job; null on rows written before, which
tuning runs wrote) and `token_id` (the stored token that uploaded it; null for a settings token or a
direct write); the winner rule lets weaker evidence replace a stronger winner only with an interval
that says it is better (`autotuner.rule`). Tokens may have the scope `in-job`: reads, and uploads of
in-job measurements only.

Upgrades without an outage: `schema_readers` holds the oldest code revision that reads this schema.
Everything here is expand-only (nullable columns, a new table, a wider check), so code at 0009
reads and writes it as before: the row says 0009, and code from this revision on serves a database
at a later revision whose row it satisfies (`db.database.check_schema`). (Code before this
revision does not know the table and still demands its own head.)
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from db.errors import SchemaError

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SOURCES = "source IN ('tuned', 'in-job')"
SCOPES_NEW = "scope IN ('read', 'write', 'in-job')"
SCOPES_OLD = "scope IN ('read', 'write')"
MIN_READER = "0009"


def upgrade() -> None:
    with op.batch_alter_table("measurements") as batch:
        batch.add_column(sa.Column("source", sa.String(16), nullable=True))
        batch.add_column(sa.Column("token_id", sa.Integer(), nullable=True))
        batch.create_check_constraint("source", SOURCES)
    with op.batch_alter_table("tokens") as batch:
        batch.drop_constraint("scope", type_="check")
        batch.create_check_constraint("scope", SCOPES_NEW)
    readers = op.create_table(
        "schema_readers",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("min_revision", sa.String(32), nullable=False),
        sa.CheckConstraint("id = 1", name="one_row"),
    )
    op.bulk_insert(readers, [{"id": 1, "min_revision": MIN_READER}])


def downgrade() -> None:
    bind = op.get_bind()
    held = bind.execute(sa.text("SELECT count(*) FROM tokens WHERE scope = 'in-job'")).scalar_one()
    if held:
        raise SchemaError(
            f"downgrading below 0010 would leave {held} token(s) of scope 'in-job', which 0009 does not "
            "know: revoke and delete them first (or stay at 0010 or above); nothing was changed")
    op.drop_table("schema_readers")
    with op.batch_alter_table("tokens") as batch:
        batch.drop_constraint("scope", type_="check")
        batch.create_check_constraint("scope", SCOPES_OLD)
    with op.batch_alter_table("measurements") as batch:
        batch.drop_constraint("source", type_="check")
        batch.drop_column("token_id")
        batch.drop_column("source")
