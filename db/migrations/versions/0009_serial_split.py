"""measurements and winners carry a ring's split by its serial control (serial_s, traffic_speedup)

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06

A ring timed beside its serial control (the same ring, nothing overlapped) in one session splits
its speedup into traffic (reference / control) and overlap (control / ring). The measurement stores
the control's median and its ratio; the winner copies its winning measurement's (issue 40). Null
for every row written before: nothing says how those speedups split.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("measurements", "winners")


def upgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("serial_s", sa.Double(), nullable=True))
            batch.add_column(sa.Column("traffic_speedup", sa.Double(), nullable=True))


def downgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("traffic_speedup")
            batch.drop_column("serial_s")
