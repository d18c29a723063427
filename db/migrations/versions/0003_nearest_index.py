"""problems: index (pattern, dtype, mesh_size, lm, ln, lk, lb) for nearest-shape queries

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03

`repository.nearest_winners` bounds each log feature to a box around the target when it is
given a maximum distance; the box's lm range is an index range rather than a walk over the
whole (pattern, dtype, mesh_size) group, and with the other log features in the index the
distance is computed without reading the rows. It replaces the three-column index, whose
prefix it keeps.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.drop_index("ix_problems_pattern_dtype_mesh_size", table_name="problems")
    op.create_index("ix_problems_nearest", "problems",
                    ["pattern", "dtype", "mesh_size", "lm", "ln", "lk", "lb"])


def downgrade() -> None:
    op.drop_index("ix_problems_nearest", table_name="problems")
    op.create_index("ix_problems_pattern_dtype_mesh_size", "problems", ["pattern", "dtype", "mesh_size"])
