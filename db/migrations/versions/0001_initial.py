"""initial schema: devices, problems, measurements, winners, tuning_jobs, demand, tokens

Revision ID: 0001
Revises:
Create Date: 2026-12-02

Types here are frozen copies (plain ``sa.DateTime(timezone=True)`` for the models'
``UTCDateTime``, which only converts values in Python), so later model changes never alter
what this revision creates.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from db.downgrade_guard import refuse_to_drop_rows

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ACTIVE_JOB = "status IN ('queued', 'running')"


def _ts(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "devices",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(length=128), nullable=False),
        sa.Column("platform", sa.String(length=32), nullable=False),
        sa.Column("device_kind", sa.String(length=128), nullable=False),
        sa.Column("num_devices", sa.Integer(), nullable=False),
        sa.Column("num_processes", sa.Integer(), nullable=False),
        sa.Column("topology", sa.String(length=128), nullable=True),
        sa.Column("jax_version", sa.String(length=32), nullable=False),
        sa.Column("jaxlib_version", sa.String(length=32), nullable=False),
        _ts("created_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_devices")),
        sa.UniqueConstraint("key", name=op.f("uq_devices_key")),
    )

    op.create_table(
        "problems",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(length=128), nullable=False),
        sa.Column("canonical", sa.JSON(), nullable=False),
        sa.Column("equation", sa.String(length=256), nullable=False),
        sa.Column("pattern", sa.String(length=64), nullable=False),
        sa.Column("dtype", sa.String(length=32), nullable=False),
        sa.Column("mesh_size", sa.Integer(), nullable=False),
        *(sa.Column(c, sa.Double(), nullable=False) for c in ("m", "n", "k", "b")),
        sa.Column("flops", sa.Double(), nullable=False),
        sa.Column("comm_bytes", sa.Double(), nullable=False),
        *(sa.Column(c, sa.Double(), nullable=False) for c in ("lm", "ln", "lk", "lb")),
        _ts("created_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_problems")),
        sa.UniqueConstraint("key", name=op.f("uq_problems_key")),
    )
    op.create_index(
        op.f("ix_problems_pattern_dtype_mesh_size"), "problems", ["pattern", "dtype", "mesh_size"]
    )

    op.create_table(
        "measurements",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("problem_id", sa.Integer(), nullable=False),
        sa.Column("device_id", sa.Integer(), nullable=False),
        sa.Column("strategy", sa.JSON(), nullable=False),
        sa.Column("strategy_key", sa.String(length=256), nullable=False),
        sa.Column("method", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("samples", sa.JSON(), nullable=False),
        sa.Column("median_s", sa.Double(), nullable=True),
        sa.Column("iqr_s", sa.Double(), nullable=True),
        sa.Column("min_s", sa.Double(), nullable=True),
        sa.Column("n", sa.Integer(), nullable=False),
        sa.Column("ratio", sa.Double(), nullable=True),
        sa.Column("ratio_lo", sa.Double(), nullable=True),
        sa.Column("ratio_hi", sa.Double(), nullable=True),
        sa.Column("compile_s", sa.Double(), nullable=True),
        sa.Column("memory", sa.JSON(), nullable=True),
        sa.Column("run_id", sa.String(length=64), nullable=True),
        sa.Column("host", sa.String(length=256), nullable=True),
        _ts("created_at"),
        sa.CheckConstraint("status IN ('ok', 'failed')", name=op.f("ck_measurements_status")),
        sa.ForeignKeyConstraint(
            ["device_id"],
            ["devices.id"],
            name=op.f("fk_measurements_device_id_devices"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["problem_id"],
            ["problems.id"],
            name=op.f("fk_measurements_problem_id_problems"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_measurements")),
    )
    op.create_index(
        op.f("ix_measurements_device_id_problem_id"), "measurements", ["device_id", "problem_id"]
    )
    op.create_index(op.f("ix_measurements_problem_id"), "measurements", ["problem_id"])

    op.create_table(
        "winners",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("device_id", sa.Integer(), nullable=False),
        sa.Column("problem_id", sa.Integer(), nullable=False),
        sa.Column("strategy", sa.JSON(), nullable=False),
        sa.Column("strategy_key", sa.String(length=256), nullable=False),
        sa.Column("method", sa.String(length=64), nullable=False),
        sa.Column("speedup", sa.Double(), nullable=False),
        sa.Column("speedup_lo", sa.Double(), nullable=True),
        sa.Column("speedup_hi", sa.Double(), nullable=True),
        sa.Column("baseline_s", sa.Double(), nullable=True),
        sa.Column("winner_s", sa.Double(), nullable=True),
        sa.Column("measurement_ids", sa.JSON(), nullable=False),
        sa.Column("trials", sa.Integer(), nullable=False),
        _ts("created_at"),
        _ts("updated_at"),
        sa.ForeignKeyConstraint(
            ["device_id"],
            ["devices.id"],
            name=op.f("fk_winners_device_id_devices"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["problem_id"],
            ["problems.id"],
            name=op.f("fk_winners_problem_id_problems"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_winners")),
        sa.UniqueConstraint(
            "device_id", "problem_id", name=op.f("uq_winners_device_id_problem_id")
        ),
    )
    op.create_index(op.f("ix_winners_method"), "winners", ["method"])
    op.create_index(op.f("ix_winners_problem_id"), "winners", ["problem_id"])
    op.create_index(op.f("ix_winners_updated_at"), "winners", ["updated_at"])

    op.create_table(
        "tuning_jobs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("problem_key", sa.String(length=128), nullable=False),
        sa.Column("problem", sa.JSON(), nullable=False),
        sa.Column("device_key", sa.String(length=128), nullable=False),
        sa.Column("device", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("worker", sa.String(length=256), nullable=True),
        _ts("lease_expires_at", nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        _ts("created_at"),
        _ts("updated_at"),
        sa.CheckConstraint(
            "status IN ('queued', 'running', 'done', 'failed')", name=op.f("ck_tuning_jobs_status")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tuning_jobs")),
    )
    op.create_index(
        op.f("ix_tuning_jobs_status_priority_created_at"),
        "tuning_jobs",
        ["status", "priority", "created_at"],
    )
    op.create_index(
        "uq_tuning_jobs_active",
        "tuning_jobs",
        ["device_key", "problem_key"],
        unique=True,
        sqlite_where=sa.text(ACTIVE_JOB),
        postgresql_where=sa.text(ACTIVE_JOB),
    )

    op.create_table(
        "demand",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("device_key", sa.String(length=128), nullable=False),
        sa.Column("device", sa.JSON(), nullable=False),
        sa.Column("problem_key", sa.String(length=128), nullable=False),
        sa.Column("problem", sa.JSON(), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        _ts("first_seen"),
        _ts("last_seen"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_demand")),
        sa.UniqueConstraint(
            "device_key", "problem_key", name=op.f("uq_demand_device_key_problem_key")
        ),
    )
    op.create_index(op.f("ix_demand_last_seen"), "demand", ["last_seen"])

    op.create_table(
        "tokens",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("scope", sa.String(length=8), nullable=False),
        _ts("created_at"),
        _ts("revoked_at", nullable=True),
        sa.CheckConstraint("scope IN ('read', 'write')", name=op.f("ck_tokens_scope")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tokens")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_tokens_token_hash")),
    )


def downgrade() -> None:
    # the results (demand and the job queue are derived, and go); indexes go with their tables
    refuse_to_drop_rows("devices", "problems", "measurements", "winners", "tokens", revision="0001")
    # children before parents
    for table in (
        "tokens",
        "demand",
        "tuning_jobs",
        "winners",
        "measurements",
        "problems",
        "devices",
    ):
        op.drop_table(table)
