"""step_evidence: in-program evidence per (device, program, problem); model_benches.attribution

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04

`autotuner tune-model` times each problem's choices in the whole step and stores what it found
(the kept choice, the one it started from, the step's speedup with its interval, every candidate
tried); `overlap` prefers it for the same program. `bench-model --attribute` stores each decomposed
problem's saving in the step with its run (JSON, null without --attribute). Types are frozen
copies, as in 0001.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from db.downgrade_guard import refuse_to_drop_rows

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "step_evidence",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("device_id", sa.Integer(), nullable=False),
        sa.Column("program_key", sa.String(length=64), nullable=False),
        sa.Column("program", sa.String(length=1024), nullable=False),
        sa.Column("problem_key", sa.String(length=128), nullable=False),
        sa.Column("name", sa.String(length=512), nullable=True),
        sa.Column("strategy", sa.JSON(), nullable=False),
        sa.Column("strategy_key", sa.String(length=256), nullable=False),
        sa.Column("previous", sa.JSON(), nullable=False),
        sa.Column("previous_key", sa.String(length=256), nullable=False),
        sa.Column("speedup", sa.Double(), nullable=True),
        sa.Column("speedup_lo", sa.Double(), nullable=True),
        sa.Column("speedup_hi", sa.Double(), nullable=True),
        sa.Column("reps", sa.Integer(), nullable=False),
        sa.Column("tried", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["device_id"], ["devices.id"], name=op.f("fk_step_evidence_device_id_devices"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_step_evidence")),
    )
    op.create_index(op.f("ix_step_evidence_device_id_program_key_problem_key_created_at"), "step_evidence",
                    ["device_id", "program_key", "problem_key", "created_at"])
    with op.batch_alter_table("model_benches") as batch:
        batch.add_column(sa.Column("attribution", sa.JSON(), nullable=True))


def downgrade() -> None:
    refuse_to_drop_rows("step_evidence", revision="0008")
    with op.batch_alter_table("model_benches") as batch:
        batch.drop_column("attribution")
    op.drop_table("step_evidence")  # its indexes go with it
