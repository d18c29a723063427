"""A measurement as it travels: its fields, written once (the database's `MeasurementInput` and the
body of ``POST /v1/results`` are built from this list), and the item of one measured candidate.

Pure and light: the training job's upload path (`Client.upload` -> `autotuner.results`) builds
its items here and loads no database code; `db.records` checks at import that its record has
exactly these fields (and the ones the database sets itself).
"""

from __future__ import annotations

from typing import Any

__all__ = ["MEASUREMENT_FIELDS", "OPTIONAL_FIELDS", "SPLIT_FIELDS", "measurement_item", "overlap_speedup"]

# What a caller gives for a measurement: every field of a stored one but those the database sets
# (ids, and `method`, which is `strategy["method"]`); `created_at` is optional (default: now).
MEASUREMENT_FIELDS = ("strategy", "strategy_key", "status", "reason", "samples", "median_s", "iqr_s",
                      "min_s", "n", "ratio", "ratio_lo", "ratio_hi", "aa_width", "compile_s", "memory",
                      "run_id", "host", "serial_s", "traffic_speedup", "source", "created_at")
# A ring's split by its serial control timed in the same session (`autotuner.measure.session.split`):
# the control's median and its ratio (reference / control: what decomposing saves without overlap);
# None for anything else. Optional on the wire: a source without them gives None.
SPLIT_FIELDS = ("serial_s", "traffic_speedup")
# Fields a source object may lack (None then): the split, and who measured it (`source`:
# `autotuner.rule.MEASUREMENT_SOURCES`; the service checks it against the writer's token).
OPTIONAL_FIELDS = (*SPLIT_FIELDS, "source")


def overlap_speedup(speedup: float | None, traffic: float | None) -> float | None:
    """What running the transfers beside the einsums adds: the speedup over its traffic part
    (`speedup = traffic x overlap`); None where either is unknown."""
    if speedup is None or traffic is None or not traffic > 0:
        return None
    return speedup / traffic


def measurement_item(of: Any, /, **given: Any) -> dict[str, Any]:
    """The item of ``of`` (a measured candidate, ``autotuner.measure.Candidate``, or a stored
    record): each field (``created_at`` aside) from ``given`` if there, else from ``of``'s
    attribute of that name. JSON-ready: the strategy is copied and sequences become lists."""
    item: dict[str, Any] = {}
    for name in MEASUREMENT_FIELDS:
        if name == "created_at" and name not in given:
            continue
        value = given[name] if name in given else getattr(of, name, None) if name in OPTIONAL_FIELDS \
            else getattr(of, name)
        item[name] = list(value) if isinstance(value, tuple | list) else value
    item["strategy"] = dict(item["strategy"])
    return item
