"""failures: problems that could not be tuned on a device; problems.name: a readable label

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-10

`autotuner tune` records a problem whose harness raised, or whose every candidate failed, as a
row of `failures` (one per device and problem, the latest error; removed once the problem is
tuned there) and goes on with the batch. `problems.name` is the label a model's extraction gave
the problem (e.g. `layers/attn/q_proj`), the first one it was stored with. Types are frozen
copies, as in 0001.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from db.downgrade_guard import refuse_to_drop_rows

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("problems") as batch:
        batch.add_column(sa.Column("name", sa.String(length=256), nullable=True))
    op.create_table(
        "failures",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("device_id", sa.Integer(), nullable=False),
        sa.Column("problem_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=256), nullable=True),
        sa.Column("error", sa.Text(), nullable=False),
        sa.Column("run_id", sa.String(length=64), nullable=True),
        sa.Column("host", sa.String(length=256), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["device_id"], ["devices.id"], name=op.f("fk_failures_device_id_devices"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["problem_id"], ["problems.id"], name=op.f("fk_failures_problem_id_problems"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_failures")),
        sa.UniqueConstraint("device_id", "problem_id", name=op.f("uq_failures_device_id_problem_id")),
    )
    op.create_index(op.f("ix_failures_problem_id"), "failures", ["problem_id"])


def downgrade() -> None:
    refuse_to_drop_rows("failures", revision="0004")
    op.drop_table("failures")  # its index goes with it
    with op.batch_alter_table("problems") as batch:
        batch.drop_column("name")
