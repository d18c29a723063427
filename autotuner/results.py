"""Measurements as the service takes them: the items and the body of ``POST /v1/results``.

One place for what a measured session becomes on the wire or in the database:
`autotuner tune --service` and the worker (`tune.service_worker.send_run`), the local store
(`tune.store.save`) and in-job tuning (`runtime.Client.upload`, from `overlap(tune="missing")`)
all build their items and bodies here. The items are `autotuner.measurement.measurement_item`'s,
the fields the database takes (`db.records.MeasurementInput` checks they are its own): the
training job's upload path loads no database code.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from typing import Any

from autotuner.device import Device
from autotuner.measure import Candidate, SessionResult
from autotuner.measure.session import controls_of, split
from autotuner.measurement import measurement_item as item_of
from autotuner.problem import GroupedProblem, Problem


def measurement_item(c: Candidate, run_id: str | None = None, host: str | None = None, source: str = "tuned",
                     **split: float | None) -> dict[str, Any]:
    """A candidate as a measurement item (`autotuner.measurement`), with its strategy key, this
    run's id and host, who measured it (`source`: `autotuner.rule.MEASUREMENT_SOURCES`), and its
    split by its serial control where `split` gives one."""
    return item_of(c, strategy_key=c.key, run_id=run_id, host=host or socket.gethostname(), source=source,
                   **split)


def session_items(session: SessionResult, run_id: str | None = None,
                  include: Iterable[str] | None = None, source: str = "tuned") -> list[dict[str, Any]]:
    """Measurement items of a session: the baseline and every candidate (or those in `include`);
    a ring timed beside its serial control carries its split (`serial_s`, `traffic_speedup`:
    `autotuner.measure.session.split`), from the same repetitions."""
    keep = set(include) if include is not None else None
    everyone = [session.baseline, *session.candidates]
    controls = controls_of(everyone)
    out = []
    for c in everyone:
        if keep is None or c.key in keep:
            parts = split(c, controls.get(id(c)))
            out.append(measurement_item(c, run_id, source=source, serial_s=parts["serial_s"],
                                        traffic_speedup=parts["traffic_speedup"]))
    return out


def results_body(device: Device, problem: Problem | GroupedProblem, items: list[dict[str, Any]],
                 name: str | None = None) -> dict[str, Any]:
    """The body of ``POST /v1/results``: measurement items of one problem on one device, and an
    optional readable name."""
    body: dict[str, Any] = {"device": device.to_dict(), "problem": problem.to_dict(), "measurements": items}
    if name is not None:
        body["name"] = name[:256]
    return body
