"""Field metadata of the records, and what a record's field list says about each field.

:mod:`db.records` writes each record's fields once, with the metadata these helpers attach
where the type alone does not say enough: :func:`text` (the most characters, also the
column's width), :func:`long_text`, :func:`at_least`, :func:`signed` (a number that may be
negative; numbers are >= 0 otherwise) and :func:`joined` (a value read from another table, not a
column of the record's own). A JSON list (``tuple[...]``) holds numbers or JSON objects. :func:`specs` reads a record's fields back
with their types and metadata: :mod:`db.tables` builds the columns from them, the repository
its row -> record converters and its checks on write, :mod:`service.schemas` the API's models.
Pure Python (no SQLAlchemy).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

__all__ = ["INT_MAX", "KEY_LEN", "LONG_TEXT", "Spec", "at_least", "fields_of", "joined", "long_text",
           "signed", "specs", "text"]

KEY_LEN = 128  # device and problem keys
LONG_TEXT = 100_000  # free text: a failure's reason, a job's error
INT_MAX = 2**31 - 1  # the largest integer column (INTEGER: 32-bit on PostgreSQL) holds


def text(max_len: int) -> Any:
    """A text field of at most ``max_len`` characters (a ``VARCHAR(max_len)`` column)."""
    return field(metadata={"max_len": max_len})


def long_text() -> Any:
    """Free text of at most :data:`LONG_TEXT` characters (a ``TEXT`` column)."""
    return field(metadata={"max_len": LONG_TEXT, "long": True})


def at_least(minimum: int) -> Any:
    """An integer that is ``minimum`` or more (checked on write)."""
    return field(metadata={"minimum": minimum})


def signed() -> Any:
    """A number that may be negative (e.g. a saving that turned out a loss); finite still."""
    return field(metadata={"signed": True})


def joined() -> Any:
    """A value the repository reads from another table (e.g. a winner's device key)."""
    return field(metadata={"joined": True})


@dataclass(frozen=True, slots=True)
class Spec:
    """One field of a record: its name, its type without ``None`` (``kind`` is that type's
    origin: ``str``, ``int``, ``float``, ``bool``, ``datetime``, ``dict`` or ``tuple``), whether
    ``None`` is allowed, and its metadata (the helpers above)."""

    name: str
    hint: Any
    kind: type
    optional: bool
    max_len: int | None = None
    long: bool = False
    minimum: int | None = None
    signed: bool = False
    joined: bool = False


def _split_optional(hint: Any) -> tuple[Any, bool]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return hint, False


def specs(record: type) -> tuple[Spec, ...]:
    """The fields of a record class, in order."""
    hints = typing.get_type_hints(record)
    out = []
    for f in dataclasses.fields(record):
        hint, optional = _split_optional(hints[f.name])
        kind = typing.get_origin(hint) or hint
        spec = Spec(name=f.name, hint=hint, kind=kind, optional=optional, **f.metadata)
        if kind not in (str, int, float, bool, datetime, dict, tuple):
            raise TypeError(f"{record.__name__}.{f.name}: no storage for type {hint!r}")
        if kind is str and spec.max_len is None and not spec.joined:
            raise TypeError(f"{record.__name__}.{f.name}: a text field needs text(n) or long_text()")
        out.append(spec)
    return tuple(out)


def fields_of(record: type, names: tuple[str, ...] | None = None, *,
              skip: tuple[str, ...] = ()) -> dict[str, Spec]:
    """``record``'s fields by name: those in ``names`` (in that order), else all but ``skip``."""
    by_name = {s.name: s for s in specs(record)}
    if names is not None:
        return {n: by_name[n] for n in names}
    return {n: s for n, s in by_name.items() if n not in skip}
