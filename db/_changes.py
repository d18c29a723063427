"""Which winners changed, for the caches of every process (private; see :mod:`db.repository`).

A transaction that writes a winner (:func:`db.repository.recompute_winner`) or a calibration
notes it with :func:`note_change`. When that transaction commits, the notes are written in
one step at its very end: the one row of ``generation`` is incremented (its row lock, taken
last, orders the generations as the commits on PostgreSQL; SQLite has one writer anyway) and
each noted (device, problem) becomes a ``winner_changes`` row under the new value. Readers
ask :func:`changes_since` for everything above the last generation they saw - one indexed
query that returns nothing while nothing changes - so a service process can keep answers
cached until they change. Only the last :data:`KEEP_GENERATIONS` generations are kept; a
reader further behind is told so (``complete=False``) and drops everything.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import delete, event, insert, select, update
from sqlalchemy.orm import Session

from db.tables import Generation, WinnerChange

KEEP_GENERATIONS = 10_000
MAX_ROWS = 10_000  # per changes_since call; more means "drop everything"
_PENDING = "autotuner_winner_changes"


@dataclass(frozen=True)
class Changes:
    """The changes after a generation: ``items`` are (device key, problem key or None for the
    whole device); ``generation`` is the newest one they include. ``complete`` is False when
    some were no longer kept (or too many): the reader must drop everything it cached."""

    generation: int
    items: tuple[tuple[str, str | None], ...]
    complete: bool = True


def note_change(s: Session, device_key: str, problem_key: str | None = None) -> None:
    """Note, in ``s``'s transaction, that the winner of (device, problem) changed (every answer
    of the device when ``problem_key`` is None); written when the transaction commits."""
    s.info.setdefault(_PENDING, set()).add((device_key, problem_key))


def current_generation(s: Session) -> int:
    value = s.execute(select(Generation.value).where(Generation.id == 1)).scalar_one_or_none()
    return int(value or 0)


def changes_since(s: Session, generation: int) -> Changes:
    """Every change after ``generation``, oldest first (see the module docs)."""
    rows = s.execute(
        select(WinnerChange.generation, WinnerChange.device_key, WinnerChange.problem_key)
        .where(WinnerChange.generation > generation)
        .order_by(WinnerChange.generation, WinnerChange.id)
        .limit(MAX_ROWS + 1)
    ).all()
    if not rows:
        return Changes(generation, ())
    if len(rows) > MAX_ROWS:
        return Changes(max(current_generation(s), rows[-1][0]), (), complete=False)
    # generations are consecutive (each commit adds one, with at least one row): a gap after
    # `generation` means its rows were pruned
    complete = rows[0][0] == generation + 1
    return Changes(rows[-1][0], tuple((d, p) for _, d, p in rows), complete)


@event.listens_for(Session, "before_commit")
def _write_changes(s: Session) -> None:
    pending = s.info.pop(_PENDING, None)
    if not pending:
        return
    conn = s.connection()
    gen = conn.execute(update(Generation).where(Generation.id == 1)
                       .values(value=Generation.value + 1).returning(Generation.value)).scalar()
    if gen is None:  # a database created without the migration's row
        gen = 1
        conn.execute(insert(Generation).values(id=1, value=gen))
    conn.execute(insert(WinnerChange), [{"generation": gen, "device_key": d, "problem_key": p}
                                        for d, p in sorted(pending, key=lambda x: (x[0], x[1] or ""))])
    if gen > KEEP_GENERATIONS:
        conn.execute(delete(WinnerChange).where(WinnerChange.generation <= gen - KEEP_GENERATIONS))


@event.listens_for(Session, "after_soft_rollback")
def _forget_changes(s: Session, _previous: object) -> None:
    s.info.pop(_PENDING, None)
