"""ORM rows -> frozen records (private to :mod:`db`), one converter per record, each derived
from the record's field list (:func:`row_converter`).

``winner_record(row, device_key, problem_key)`` and ``calibration_record(row, device_key)``
take the values of the record's joined fields after the row.
"""

from __future__ import annotations

import copy
import operator
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from db import records as r
from db.fields import Spec, specs

R = TypeVar("R")


def _copier(spec: Spec) -> Callable[[Any], Any] | None:
    c = _copier_of(spec)
    if c is None or not spec.optional:
        return c
    return lambda x: None if x is None else c(x)


def _copier_of(spec: Spec) -> Callable[[Any], Any] | None:
    if spec.kind is dict:  # a fresh copy: changing a record never changes the database's row
        return copy.deepcopy
    if spec.kind is tuple:  # a JSON list; its items as the record's type says (objects copied)
        (item, *_) = typing.get_args(spec.hint)
        if (typing.get_origin(item) or item) is dict:
            return lambda xs: tuple(copy.deepcopy(xs))
        return lambda xs: tuple(map(item, xs))
    return None


def row_converter(record: type[R]) -> Callable[..., R]:
    """``convert(row, *joined)`` -> a ``record`` from a row (an ORM object or a result row)
    holding every field of the record's table, and the values of its :func:`joined` fields
    in their order. Kept lean: it is on the service's lookup path."""
    fields = specs(record)
    own = [s for s in fields if not s.joined]
    get = operator.attrgetter(*(s.name for s in own))
    copies = [(i, c) for i, s in enumerate(own) if (c := _copier(s)) is not None]
    joined_at = [i for i, s in enumerate(fields) if s.joined]  # ascending: inserted in order

    def convert(row: Any, *joined_values: Any) -> R:
        values = list(get(row)) if len(own) > 1 else [get(row)]
        for i, c in copies:
            values[i] = c(values[i])
        if len(joined_values) != len(joined_at):
            raise ValueError(f"{record.__name__} needs {len(joined_at)} joined values, "
                             f"got {len(joined_values)}")
        for i, value in zip(joined_at, joined_values, strict=True):
            values.insert(i, value)
        return record(*values)

    convert.__name__ = convert.__qualname__ = f"to_{record.__name__}"
    return convert


calibration_record = row_converter(r.CalibrationRecord)
demand_record = row_converter(r.DemandRecord)
device_record = row_converter(r.DeviceRecord)
evidence_record = row_converter(r.EvidenceRecord)
failure_record = row_converter(r.FailureRecord)
job_record = row_converter(r.JobRecord)
measurement_record = row_converter(r.MeasurementRecord)
model_bench_record = row_converter(r.ModelBenchRecord)
problem_record = row_converter(r.ProblemRecord)
token_record = row_converter(r.TokenRecord)
winner_record = row_converter(r.WinnerRecord)
