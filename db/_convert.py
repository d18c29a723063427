"""ORM rows -> frozen records (private to :mod:`db`), one converter per record, each derived
from the record's field list (:func:`row_converter`).

``winner_record(row, device_key, problem_key)`` and ``calibration_record(row, device_key)``
take the values of the record's joined fields after the row.
"""

from __future__ import annotations

import copy
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from db import records as r
from db.fields import Spec, specs

R = TypeVar("R")


def _copier(spec: Spec) -> Callable[[Any], Any] | None:
    if spec.kind is dict:  # a fresh copy: changing a record never changes the database's row
        return copy.deepcopy
    if spec.kind is tuple:  # a JSON list; its items as the record's type says
        (item, *_) = typing.get_args(spec.hint)
        return lambda xs: tuple(item(x) for x in xs)
    return None


def row_converter(record: type[R]) -> Callable[..., R]:
    """``convert(row, *joined)`` -> a ``record`` from a row (an ORM object or a result row)
    holding every field of the record's table, and the values of its :func:`joined` fields
    in their order."""
    own = [(s.name, _copier(s)) for s in specs(record) if not s.joined]
    joined_names = [s.name for s in specs(record) if s.joined]

    def convert(row: Any, *joined_values: Any) -> R:
        values = {n: getattr(row, n) if c is None else c(getattr(row, n)) for n, c in own}
        values.update(zip(joined_names, joined_values, strict=True))
        return record(**values)

    convert.__name__ = convert.__qualname__ = f"to_{record.__name__}"
    return convert



calibration_record = row_converter(r.CalibrationRecord)
demand_record = row_converter(r.DemandRecord)
device_record = row_converter(r.DeviceRecord)
job_record = row_converter(r.JobRecord)
measurement_record = row_converter(r.MeasurementRecord)
problem_record = row_converter(r.ProblemRecord)
token_record = row_converter(r.TokenRecord)
winner_record = row_converter(r.WinnerRecord)
