"""generation, winner_changes: tell every service process which winners changed

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04

Every transaction that writes a winner (or a calibration) increments the one row of
`generation` and records what it changed in `winner_changes` under the new value
(db/_changes.py). A service process polls `winner_changes` for generations above the last
one it saw and drops exactly those cached answers, so answers can stay cached until they
change.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "generation",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("value", sa.BigInteger(), nullable=False),
        sa.CheckConstraint("id = 1", name=op.f("ck_generation_one_row")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_generation")),
    )
    op.execute("INSERT INTO generation (id, value) VALUES (1, 0)")
    op.create_table(
        "winner_changes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("device_key", sa.String(length=128), nullable=False),
        sa.Column("problem_key", sa.String(length=128), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_winner_changes")),
    )
    op.create_index(op.f("ix_winner_changes_generation"), "winner_changes", ["generation"])


def downgrade() -> None:
    op.drop_table("winner_changes")  # its index goes with it
    op.drop_table("generation")
