"""model_benches: one row per `autotuner bench-model` run (plain jit vs overlapped, per step)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04

A program's step timed plain and overlapped, interleaved in one run: medians per step with their
95% intervals, the speedup with its interval, the `slower` flag, the per-pair breakdown (JSON)
and the collectives' time and savings. Append-only; the dashboard's models page lists them.
Types are frozen copies, as in 0001.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from db.downgrade_guard import refuse_to_drop_rows

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "model_benches",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("device_id", sa.Integer(), nullable=False),
        sa.Column("program", sa.String(length=512), nullable=False),
        sa.Column("kwargs", sa.JSON(), nullable=False),
        sa.Column("target", sa.String(length=256), nullable=False),
        sa.Column("mesh", sa.JSON(), nullable=True),
        sa.Column("strategy", sa.String(length=256), nullable=False),
        sa.Column("reps", sa.Integer(), nullable=False),
        sa.Column("plain_s", sa.Double(), nullable=False),
        sa.Column("plain_lo_s", sa.Double(), nullable=True),
        sa.Column("plain_hi_s", sa.Double(), nullable=True),
        sa.Column("overlapped_s", sa.Double(), nullable=False),
        sa.Column("overlapped_lo_s", sa.Double(), nullable=True),
        sa.Column("overlapped_hi_s", sa.Double(), nullable=True),
        sa.Column("speedup", sa.Double(), nullable=False),
        sa.Column("speedup_lo", sa.Double(), nullable=True),
        sa.Column("speedup_hi", sa.Double(), nullable=True),
        sa.Column("slower", sa.Boolean(), nullable=False),
        sa.Column("rel_error", sa.Double(), nullable=True),
        sa.Column("pairs", sa.JSON(), nullable=False),
        sa.Column("comm_s", sa.Double(), nullable=True),
        sa.Column("decomposed_comm_s", sa.Double(), nullable=True),
        sa.Column("predicted_saved_s", sa.Double(), nullable=True),
        sa.Column("host", sa.String(length=256), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["device_id"], ["devices.id"], name=op.f("fk_model_benches_device_id_devices"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_model_benches")),
    )
    op.create_index(op.f("ix_model_benches_device_id_created_at"), "model_benches", ["device_id", "created_at"])
    op.create_index(op.f("ix_model_benches_program_created_at"), "model_benches", ["program", "created_at"])


def downgrade() -> None:
    refuse_to_drop_rows("model_benches", revision="0007")
    op.drop_table("model_benches")  # its indexes go with it
