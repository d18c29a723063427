"""Helpers shared by the repository modules (private to :mod:`db`)."""

from __future__ import annotations

import math
import typing
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from db.fields import INT_MAX, Spec

MAX_PAGE = 1000


def utcnow() -> datetime:
    """The current time, timezone-aware, in UTC."""
    return datetime.now(UTC)


def dialect(s: Session) -> str:
    return s.get_bind().dialect.name


def insert(s: Session, entity: Any) -> Any:
    """The dialect's INSERT (with ``on_conflict_do_*``) for ``entity``."""
    name = dialect(s)
    if name == "postgresql":
        return postgresql.insert(entity)
    if name == "sqlite":
        return sqlite.insert(entity)
    raise ValueError(f"unsupported database dialect {name!r}")


def now_utc(now: datetime | None) -> datetime:
    """``now`` as an aware UTC datetime (naive means UTC); the current time if ``None``."""
    if now is None:
        return utcnow()
    if now.tzinfo is None:
        return now.replace(tzinfo=UTC)
    return now.astimezone(UTC)


def seconds(value: float, name: str) -> timedelta:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
    return timedelta(seconds=float(value))


def check_page(offset: int, limit: int) -> None:
    if not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset must be an integer >= 0, not {offset!r}")
    if not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
        raise ValueError(f"limit must be an integer in 1..{MAX_PAGE}, not {limit!r}")


def finite(
    value: Any, name: str, *, optional: bool = False, minimum: float | None = None
) -> float | None:
    """``value`` as a finite float (``None`` allowed when ``optional``), else ValueError."""
    if value is None:
        if optional:
            return None
        raise ValueError(f"{name} is required")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, not {type(value).__name__}")
    x = float(value)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, not {value!r}")
    if minimum is not None and x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, not {value!r}")
    return x


def text_field(value: Any, name: str, *, max_len: int, optional: bool = False) -> str | None:
    if value is None:
        if optional:
            return None
        raise ValueError(f"{name} is required")
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, not {type(value).__name__}")
    if not optional and not value:
        raise ValueError(f"{name} must not be empty")
    if len(value) > max_len:
        raise ValueError(f"{name} is longer than {max_len} characters")
    return value


def json_object(value: Any, name: str, *, optional: bool = False) -> dict[str, Any] | None:
    if value is None and optional:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object (dict), not {type(value).__name__}")
    return value


def named_lock(s: Session, name: str) -> None:
    """Serialise, until the transaction ends, every transaction that takes the lock `name`.

    PostgreSQL: a transaction-scoped advisory lock on a hash of the name. SQLite: nothing to
    do, since our transactions begin with BEGIN IMMEDIATE and so already hold the one write lock.
    """
    if dialect(s) == "postgresql":
        from sqlalchemy import text

        s.execute(text("SELECT pg_advisory_xact_lock(hashtextextended(:name, 0))"), {"name": name})


def check_value(spec: Spec, value: Any, name: str) -> Any:
    """``value`` for the field ``spec`` (named ``name`` in errors), or ValueError: text within
    its length, numbers finite and >= 0 (integers >= their minimum and at most
    :data:`~db.fields.INT_MAX`, :func:`~db.fields.signed`
    ones any sign), flags as bools, JSON objects as dicts, lists of such numbers or objects as
    lists."""
    if value is None and spec.optional:
        return None
    if spec.kind is str:
        return text_field(value, name, max_len=spec.max_len or 0, optional=spec.optional)
    if spec.kind is float:
        return finite(value, name, minimum=None if spec.signed else 0.0)
    if spec.kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, not {value!r}")
        return value
    if spec.kind is int:
        minimum = spec.minimum if spec.minimum is not None else 0
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}, not {value!r}")
        if value > INT_MAX:
            raise ValueError(f"{name} must be an integer <= {INT_MAX} (the range of its column)")
        return value
    if spec.kind is dict:
        return json_object(value, name)
    if spec.kind is tuple:  # a JSON list of numbers or of JSON objects
        if not isinstance(value, list | tuple):
            raise ValueError(f"{name} must be a list")
        (item_type, *_) = typing.get_args(spec.hint)
        item = Spec(name=spec.name, hint=item_type, kind=typing.get_origin(item_type) or item_type,
                    optional=False)
        return [check_value(item, x, f"{name}[{j}]") for j, x in enumerate(value)]
    if spec.kind is datetime:
        if not isinstance(value, datetime):
            raise ValueError(f"{name} must be a datetime")
        return value
    raise ValueError(f"{name}: no check for {spec.hint!r}")  # pragma: no cover - specs() refuses


def check_values(fields: Mapping[str, Spec], values: Mapping[str, Any],
                 where: str | None = None) -> dict[str, Any]:
    """Every field of ``fields`` checked (:func:`check_value`); a missing optional one is
    ``None``, a missing required one or an unknown name is a ValueError naming it (as
    ``WHERE.NAME`` when ``where`` is given, e.g. ``items[3].host``)."""
    unknown = set(values) - set(fields)
    if unknown:
        raise ValueError(f"{where or 'values'} has unknown fields {sorted(unknown)}")
    return {name: check_value(spec, values.get(name), f"{where}.{name}" if where else name)
            for name, spec in fields.items()}
