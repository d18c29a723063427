"""calibrations: per-device cost-model parameters

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02

One row per calibration run (append-only: the newest row of a device and model is the one in
use, older ones stay as history). Types are frozen copies, as in 0001.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from db.downgrade_guard import refuse_to_drop_rows

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "calibrations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("device_id", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=64), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("raw", sa.JSON(), nullable=True),
        sa.Column("host", sa.String(length=256), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["device_id"],
            ["devices.id"],
            name=op.f("fk_calibrations_device_id_devices"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_calibrations")),
    )
    op.create_index(
        op.f("ix_calibrations_device_id_model_created_at"),
        "calibrations",
        ["device_id", "model", "created_at"],
    )


def downgrade() -> None:
    refuse_to_drop_rows("calibrations", revision="0002")
    op.drop_table("calibrations")  # its index goes with it
