"""measurements: aa_width, the A/A width of the session that measured each strategy

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04

Every session of the tuner times the baseline twice (an A/A check); how far the ratio CI of the
two copies reached from 1.0 is stored with each of the session's measurements, so that a stored
speedup can be read against the noise it was measured in. Nullable: older rows had no A/A.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("measurements", sa.Column("aa_width", sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("measurements") as batch:
        batch.drop_column("aa_width")
