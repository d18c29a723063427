"""One field list per record (db/records.py), and what is derived from it: the ORM columns, the
row -> record converters, the checks on write, MeasurementInput and the service's models."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import JSON, Boolean, Double, Integer, String, Text

from autotuner.measure import Candidate
from db import records
from db._common import check_values
from db._convert import row_converter
from db.fields import KEY_LEN, LONG_TEXT, Spec, fields_of, joined, long_text, specs, text
from db.tables import Base, UTCDateTime
from service import schemas

# every table, the record its columns come from, and the columns no record shows
TABLES = {
    "devices": (records.DeviceRecord, set()),
    "problems": (records.ProblemRecord, {"lm", "ln", "lk", "lb"}),
    "measurements": (records.MeasurementRecord, set()),
    "winners": (records.WinnerRecord, set()),
    "tuning_jobs": (records.JobRecord, set()),
    "demand": (records.DemandRecord, set()),
    "tokens": (records.TokenRecord, {"token_hash"}),
    "calibrations": (records.CalibrationRecord, set()),
    "failures": (records.FailureRecord, set()),
    "model_benches": (records.ModelBenchRecord, set()),
    "step_evidence": (records.EvidenceRecord, set()),
}
# bookkeeping tables no record shows (the service's change log, db/_changes.py; which code reads the
# schema, db.database.check_schema): never read by a route or a converter, so no field list of their own
INTERNAL = {"generation", "winner_changes", "schema_readers"}
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_every_table_has_exactly_its_records_fields_as_stored() -> None:
    assert set(Base.metadata.tables) == set(TABLES) | INTERNAL
    for name, (record, extra) in TABLES.items():
        table = Base.metadata.tables[name]
        own = {s.name: s for s in specs(record) if not s.joined}
        assert set(table.columns.keys()) == set(own) | extra, name
        for spec in own.values():
            column = table.columns[spec.name]
            assert column.nullable == spec.optional, (name, spec.name)
            expected = {str: Text if spec.long else String, int: Integer, float: Double, bool: Boolean,
                        datetime: UTCDateTime, dict: JSON, tuple: JSON}[spec.kind]
            assert isinstance(column.type, expected), (name, spec.name, column.type)
            if expected is String:
                assert column.type.length == spec.max_len, (name, spec.name)
        assert [c.name for c in table.primary_key.columns] == ["id"]


def test_a_text_field_needs_a_length_and_a_type_needs_a_column() -> None:
    @dataclass(frozen=True)
    class NoLength:
        name: str

    @dataclass(frozen=True)
    class NoColumn:
        when: set[int]

    @dataclass(frozen=True)
    class Fine:
        key: str = text(KEY_LEN)
        other_key: str = joined()
        note: str | None = long_text()

    with pytest.raises(TypeError, match=r"NoLength.name: a text field needs text\(n\)"):
        specs(NoLength)
    with pytest.raises(TypeError, match="NoColumn.when: no storage"):
        specs(NoColumn)
    assert [(s.name, s.max_len, s.long, s.joined, s.optional) for s in specs(Fine)] == [
        ("key", KEY_LEN, False, False, False), ("other_key", None, False, True, False),
        ("note", LONG_TEXT, True, False, True)]


def test_row_converter_copies_json_and_takes_joined_values_in_order() -> None:
    row = type("Row", (), {})()
    values = {"id": 7, "device_id": 1, "problem_id": 2, "strategy": {"method": "ring", "k": [1]},
              "strategy_key": "r", "method": "ring", "speedup": 1.5, "speedup_lo": None,
              "speedup_hi": None, "baseline_s": 2.0, "winner_s": 1.0, "measurement_ids": [3, 4],
              "trials": 2, "serial_s": None, "traffic_speedup": None, "created_at": T0, "updated_at": T0}
    row.__dict__.update(values)
    w = row_converter(records.WinnerRecord)(row, "dev", "prob")
    assert (w.device_key, w.problem_key, w.measurement_ids) == ("dev", "prob", (3, 4))
    w.strategy["k"].append(2)  # the record's JSON is a copy: the row's stays as it was
    assert row.strategy == {"method": "ring", "k": [1]}
    with pytest.raises(ValueError):  # a joined value missing
        row_converter(records.WinnerRecord)(row, "dev")


def test_checks_on_write_follow_the_fields() -> None:
    fields = fields_of(records.MeasurementRecord, ("strategy_key", "reason", "samples", "n",
                                                   "median_s", "memory", "host"))
    ok = check_values(fields, {"strategy_key": "k", "samples": (1.0, 2), "n": 2, "median_s": 0.5})
    assert ok == {"strategy_key": "k", "reason": None, "samples": [1.0, 2.0], "n": 2,
                  "median_s": 0.5, "memory": None, "host": None}
    good = {"strategy_key": "k", "samples": [], "n": 0}
    bad = [
        ({**good, "strategy_key": "x" * 257}, "items[0].strategy_key is longer than 256"),
        ({"samples": [], "n": 0}, "items[0].strategy_key is required"),
        ({**good, "strategy_key": ""}, "items[0].strategy_key must not be empty"),
        ({**good, "samples": [1.0, -1.0]}, "items[0].samples[1] must be >= 0"),
        ({**good, "samples": "1.0"}, "items[0].samples must be a list"),
        ({**good, "n": -1}, "items[0].n must be an integer >= 0"),
        ({"strategy_key": "k", "samples": []}, "items[0].n must be an integer >= 0, not None"),
        ({**good, "median_s": float("nan")}, "items[0].median_s must be finite"),
        ({**good, "memory": [1]}, "items[0].memory must be a JSON object"),
        ({**good, "typo": 1}, "items[0] has unknown fields ['typo']"),
    ]
    for values, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            check_values(fields, values, "items[0]")
    bench = fields_of(records.ModelBenchRecord, ("slower", "predicted_saved_s", "pairs"))
    assert check_values(bench, {"slower": True, "predicted_saved_s": -0.5, "pairs": [{"a": 1}]}) == {
        "slower": True, "predicted_saved_s": -0.5, "pairs": [{"a": 1}]}  # signed(): may be negative
    for values, message in [({"slower": 0, "pairs": []}, "slower must be true or false, not 0"),
                            ({"slower": True, "pairs": [[1]]}, "pairs[0] must be a JSON object"),
                            ({"slower": True, "pairs": [], "predicted_saved_s": float("inf")}, "finite")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            check_values(bench, values)
    device = fields_of(records.DeviceRecord, ("num_devices",))
    with pytest.raises(ValueError, match="num_devices must be an integer >= 1, not 0"):
        check_values(device, {"num_devices": 0})


def test_measurement_input_is_the_record_less_what_the_database_sets() -> None:
    assert set(records.MEASUREMENT_INPUT_FIELDS) == (
        {f.name for f in dataclasses.fields(records.MeasurementRecord)}
        - {"id", "problem_id", "device_id", "method", "token_id"})
    assert records.MeasurementInput.__required_keys__ == {"strategy", "strategy_key", "status"}
    c = Candidate(strategy={"method": "ring"}, key="ring-k", samples=[1.0, 2.0], median_s=1.5,
                  n=2, ratio=1.2, ratio_lo=1.1, ratio_hi=1.3, memory={"peak": 1})
    item = records.measurement_input(c, strategy_key=c.key, run_id="r", host="h")
    assert item == {"strategy": {"method": "ring"}, "strategy_key": "ring-k", "status": "ok",
                    "reason": None, "samples": [1.0, 2.0], "median_s": 1.5, "iqr_s": None,
                    "min_s": None, "n": 2, "ratio": 1.2, "ratio_lo": 1.1, "ratio_hi": 1.3, "aa_width": None,
                    "compile_s": None, "memory": {"peak": 1}, "run_id": "r", "host": "h",
                    "serial_s": None, "traffic_speedup": None, "source": None}
    assert item["strategy"] is not c.strategy
    with pytest.raises(AttributeError, match="run_id"):  # a field the source lacks must be given
        records.measurement_input(c, strategy_key=c.key)


def test_a_field_added_to_a_record_reaches_the_derived_models() -> None:
    """What adding a field to a record means for the code derived from it (the ORM table needs
    the migration besides; the test above keeps models and records in step)."""
    hints = {f.name: f.type for f in dataclasses.fields(records.MeasurementRecord)}
    grown = dataclasses.make_dataclass(
        "MeasurementRecord",
        [*((f.name, hints[f.name], f) for f in dataclasses.fields(records.MeasurementRecord)),
         ("p90_s", "float | None"), ("kernel", "str | None", text(32))],
        frozen=True, slots=True, namespace={"__module__": records.__name__})
    names = [s.name for s in specs(grown)]
    assert names[-2:] == ["p90_s", "kernel"]
    out = schemas.record_out(grown, after={"device_id": {"device_key": str | None}})
    assert list(out.model_fields) == [*list(schemas.MeasurementOut.model_fields), "p90_s", "kernel"]
    kernel: Spec = fields_of(grown, ("kernel",))["kernel"]
    assert check_values({"kernel": kernel}, {"kernel": "x" * 32}) == {"kernel": "x" * 32}
    with pytest.raises(ValueError, match="longer than 32"):
        check_values({"kernel": kernel}, {"kernel": "x" * 33})
    row = type("Row", (), {})()
    row.__dict__.update({n: None for n in names}, samples=[1], strategy={}, p90_s=2.5)
    assert row_converter(grown)(row).p90_s == 2.5


def test_the_services_record_models_show_the_records_fields() -> None:
    def fields(model: Any) -> list[str]:
        return list(model.model_fields)

    def record(rec: type) -> list[str]:
        return [f.name for f in dataclasses.fields(rec)]

    assert fields(schemas.DeviceOut) == record(records.DeviceRecord)
    assert fields(schemas.ProblemOut) == record(records.ProblemRecord)
    assert fields(schemas.JobOut) == record(records.JobRecord)
    assert fields(schemas.DemandOut) == record(records.DemandRecord)
    w = [n for n in record(records.WinnerRecord) if n not in ("device_id", "problem_id")]
    at = w.index("traffic_speedup") + 1   # and the property derived from it
    assert fields(schemas.WinnerOut) == [*w[:at], "overlap_speedup", *w[at:]]
    assert fields(schemas.ModelBenchOut) == [n for n in record(records.ModelBenchRecord) if n != "device_id"]
    m = record(records.MeasurementRecord)
    assert fields(schemas.MeasurementOut) == [*m[:3], "device_key", *m[3:]]
    assert fields(schemas.MeasurementIn) == [n for n in records.MEASUREMENT_INPUT_FIELDS
                                             if n != "created_at"]
