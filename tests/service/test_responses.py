"""The JSON of every response form, pinned: field names, their order and their values.

One scenario walks every endpoint that answers with a record (lookups of each source, results,
jobs, problems, demand, devices, snapshot, health) and the error forms; each body is compared
with the literal below after only the clock's values are replaced (a timestamp must be an
ISO 8601 string with a UTC offset; it becomes ``"<time>"``). A change to a response model,
a record or the way one is built from the other fails here first.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

from autotuner import Device, Problem, Strategy
from service.costmodel_hook import ModelAnswer
from service.routes.health import VERSION
from service.testing import DEVICE, RING, WRITE_HEADERS, measurements, problem

TIME = "<time>"
_ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$")
OTHER = dict(DEVICE, topology="other")


def _clockless(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _clockless(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clockless(v) for v in value]
    if isinstance(value, str) and _ISO.match(value):
        assert datetime.fromisoformat(value).utcoffset() is not None, value
        return TIME
    return value


def _order(value: Any) -> Any:
    """Every object's keys in order, nested (dict equality ignores the order; this does not)."""
    if isinstance(value, dict):
        return [(k, _order(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [_order(v) for v in value]
    return value


def _scenario(make_client: Any) -> dict[str, Any]:
    c = make_client(model=lambda p, d: ModelAnswer(Strategy.from_dict(RING), 1.1, (1.0, 1.2))
                    if p.lhs.shape[0] == 512 else None)
    out: dict[str, Any] = {}

    def keep(name: str, r: Any, status: int) -> None:
        assert r.status_code == status, (name, r.status_code, r.text)
        out[name] = json.loads(r.text)

    tuned, near, far, modelled = TUNED, NEAR, FAR, MODELLED
    keep("lookup_default", c.post("/v1/lookup", json={"device": DEVICE, "problem": far}), 200)
    keep("results", c.post("/v1/results", headers=WRITE_HEADERS, json={
        "device": DEVICE, "problem": tuned, "measurements": measurements(1.25)}), 201)
    keep("results_no_winner", c.post("/v1/results", headers=WRITE_HEADERS, json={
        "device": OTHER, "problem": far, "measurements": [
            {"strategy": {"method": "baseline"}, "status": "failed", "reason": "oom"}]}), 201)
    keep("lookup_tuned", c.post("/v1/lookup", json={"device": DEVICE, "problem": tuned}), 200)
    keep("lookup_nearest", c.post("/v1/lookup", json={"device": DEVICE, "problem": near}), 200)
    keep("lookup_model", c.post("/v1/lookup", json={"device": DEVICE, "problem": modelled}), 200)
    keep("lookup_batch", c.post("/v1/lookup/batch",
                                json={"device": DEVICE, "problems": [tuned, far]}), 200)

    job = {"device": DEVICE, "problem": far, "params": {"trials": 8}, "priority": 2}
    keep("job", c.post("/v1/jobs", json=job, headers=WRITE_HEADERS), 201)
    keep("claim", c.post("/v1/jobs/claim", json={"worker": "w1"}, headers=WRITE_HEADERS), 200)
    keep("claim_none", c.post("/v1/jobs/claim", json={"worker": "w2"}, headers=WRITE_HEADERS), 200)
    keep("heartbeat", c.post("/v1/jobs/1/heartbeat", json={"worker": "w1"}, headers=WRITE_HEADERS), 200)
    keep("finish", c.post("/v1/jobs/1/finish", json={"worker": "w1", "status": "failed",
                                                     "error": "boom"}, headers=WRITE_HEADERS), 200)
    keep("job_get", c.get("/v1/jobs/1"), 200)
    keep("jobs", c.get("/v1/jobs"), 200)

    keep("problems", c.get("/v1/problems", params={"tuned_only": "false", "sort": "key", "desc": "false"}), 200)
    keep("problem_detail", c.get("/v1/problems/1"), 200)
    c.app.state.autotuner.lookups.demand.flush()   # what the background writer does every 0.5 s
    keep("demand", c.get("/v1/demand", params={"limit": 1}), 200)  # the others: ties by time
    keep("devices", c.get("/v1/devices"), 200)
    with c.app.state.autotuner.database.session() as s:  # as `bench-model --db` stores a run
        from db import repository as repo

        repo.record_model_bench(s, 1, **BENCH)
    keep("model_benches", c.get("/v1/model-benches"), 200)
    keep("model_bench", c.get("/v1/model-benches/1"), 200)
    keep("model_bench_404", c.get("/v1/model-benches/2"), 404)
    snapshot = c.get("/v1/snapshot")
    keep("snapshot", snapshot, 200)
    keep("healthz", c.get("/healthz"), 200)

    keep("error_401", c.post("/v1/jobs", json=job), 401)
    keep("error_404", c.get("/v1/jobs/99"), 404)
    keep("error_409", c.post("/v1/jobs/1/heartbeat", json={"worker": "w1"}, headers=WRITE_HEADERS), 409)
    keep("error_422", c.post("/v1/lookup", json={"device": DEVICE, "problem": {"equation": "x"}}), 422)
    return out



def key(p: dict[str, Any]) -> str:
    return Problem.from_dict(p).key


DKEY, OKEY = Device.from_dict(DEVICE).key, Device.from_dict(OTHER).key
TUNED, NEAR, FAR, MODELLED = problem(2048, 1024, 512), problem(2048, 1024, 768), problem(64, 64, 64), problem(512, 64, 64)
RING_KEY = "ring-uni-c1-ufull-loop-send"
BENCH_PAIR = {"names": ["attn/q"], "key": "k" * 64, "strategy": RING_KEY, "count": 2, "baseline_s": 0.004,
              "strategy_s": 0.003, "comm_s": 0.002, "comp_s": 0.0015, "ratio": 1.33, "ratio_lo": 1.2,
              "ratio_hi": 1.4, "failed": None, "saved_s": 0.002}
BENCH = {"program": "m:f", "kwargs": {"layers": 1}, "target": "inproc:8", "mesh": {"x": 8}, "strategy": "auto",
         "reps": 20, "plain_s": 0.02, "plain_lo_s": 0.019, "plain_hi_s": 0.021, "overlapped_s": 0.016,
         "overlapped_lo_s": 0.015, "overlapped_hi_s": 0.017, "speedup": 1.25, "speedup_lo": 1.18,
         "speedup_hi": 1.31, "slower": False, "rel_error": 1e-06, "pairs": [BENCH_PAIR], "comm_s": 0.008,
         "decomposed_comm_s": 0.004, "predicted_saved_s": 0.004, "host": "h"}
BASELINE = {"method": "baseline"}


def canonical(p: dict[str, Any]) -> dict[str, Any]:
    return {"equation": "ab,bc->ac", "lhs": {"shape": p["lhs"]["shape"], "spec": ["x", None]},
            "rhs": {"shape": p["rhs"]["shape"], "spec": [None, None]}, "out_spec": [None, None],
            "dtype": "float32", "mesh": {"x": 8}}


def device_out(id: int, key: str, topology: str) -> dict[str, Any]:
    return {"id": id, "key": key, "platform": "cpu", "device_kind": "cpu", "num_devices": 8,
            "num_processes": 1, "topology": topology, "jax_version": "0.10.2",
            "jaxlib_version": "0.10.2", "created_at": TIME}


def lookup_out(source: str, p: dict[str, Any], **changes: Any) -> dict[str, Any]:
    tuned = {"strategy": RING, "strategy_key": RING_KEY, "source": source, "speedup": 1.25,
             "confidence": [1.2, 1.3], "record_id": 1, "measured_at": TIME, "trials": 2}
    untuned = {"strategy": BASELINE, "strategy_key": "baseline", "source": source, "speedup": 1.0,
               "confidence": None, "record_id": None, "measured_at": None, "trials": None}
    body = tuned if source in ("tuned", "nearest") else untuned
    return {**body, "distance": None, "neighbor_key": None, "traffic_speedup": None,
            "overlap_speedup": None, "problem_key": key(p),
            "device_key": DKEY, **changes}


def job_out(**changes: Any) -> dict[str, Any]:
    return {"id": 1, "status": "queued", "priority": 2, "problem_key": key(FAR),
            "problem": canonical(FAR), "device_key": DKEY, "device": DEVICE,
            "params": {"trials": 8}, "worker": None, "lease_expires_at": None, "attempts": 0,
            "error": None, "created_at": TIME, "updated_at": TIME, **changes}


def measurement_out(id: int, device_id: int, device_key: str, **changes: Any) -> dict[str, Any]:
    return {"id": id, "problem_id": 1, "device_id": device_id, "device_key": device_key,
            "strategy": BASELINE, "strategy_key": "baseline", "method": "baseline", "status": "ok",
            "reason": None, "samples": [0.001] * 7, "median_s": 0.001, "iqr_s": None,
            "min_s": None, "n": 7, "ratio": None, "ratio_lo": None, "ratio_hi": None, "aa_width": None,
            "compile_s": None, "memory": None, "run_id": None, "host": None, "serial_s": None,
            "traffic_speedup": None, "source": "tuned", "token_id": None, "created_at": TIME,
            **changes}


class AnyId:
    """Equal to any positive int: PostgreSQL's upserts use up sequence values, SQLite's do not."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, int) and other > 0

    def __repr__(self) -> str:
        return "<id>"


def demand_out(p: dict[str, Any], count: int) -> dict[str, Any]:
    return {"id": AnyId(), "device_key": DKEY, "device": DEVICE, "problem_key": key(p),
            "problem": canonical(p), "count": count, "first_seen": TIME, "last_seen": TIME}


PROBLEM_OUT = {"id": 1, "key": key(TUNED), "canonical": canonical(TUNED), "equation": "mk,kn->mn",
               "pattern": "all_gather:lhs:free", "dtype": "float32", "mesh_size": 8, "m": 2048.0,
               "n": 512.0, "k": 1024.0, "b": 1.0, "flops": 2147483648.0, "comm_bytes": 7340032.0, "name": None,
               "created_at": TIME}
FAR_OUT = {**PROBLEM_OUT, "id": 2, "key": key(FAR), "canonical": canonical(FAR), "m": 64.0,
           "n": 64.0, "k": 64.0, "flops": 524288.0, "comm_bytes": 14336.0}
WINNER_OUT = {"id": 1, "device_key": DKEY, "problem_key": key(TUNED), "strategy": RING,
              "strategy_key": RING_KEY, "method": "ring", "speedup": 1.25, "speedup_lo": 1.2,
              "speedup_hi": 1.3, "baseline_s": 0.001, "winner_s": 0.0008, "measurement_ids": [1, 2],
              "trials": 2, "serial_s": None, "traffic_speedup": None, "overlap_speedup": None,
              "created_at": TIME, "updated_at": TIME}
RUNNING = {"status": "running", "worker": "w1", "lease_expires_at": TIME, "attempts": 1}
FAILED = {"status": "failed", "worker": "w1", "attempts": 1, "error": "boom"}
DEVICES = [device_out(1, DKEY, "inproc"), device_out(2, OKEY, "other")]

EXPECTED: dict[str, Any] = {
    "lookup_default": lookup_out("default", FAR),
    "results": {"device_key": DKEY, "problem_key": key(TUNED), "recorded": 2, "repeated": 0, "winner": WINNER_OUT},
    "results_no_winner": {"device_key": OKEY, "problem_key": key(FAR), "recorded": 1, "repeated": 0,
                          "winner": None},
    "lookup_tuned": lookup_out("tuned", TUNED),
    "lookup_nearest": lookup_out("nearest", NEAR, distance=0.584963, neighbor_key=key(TUNED)),
    "lookup_model": lookup_out("model", MODELLED, strategy=RING, strategy_key=RING_KEY,
                               speedup=1.1, confidence=[1.0, 1.2]),
    "lookup_batch": {"device_key": DKEY,
                     "results": [lookup_out("tuned", TUNED), lookup_out("default", FAR)]},
    "job": job_out(),
    "claim": {"job": job_out(**RUNNING), "abandoned": []},
    "claim_none": {"job": None, "abandoned": []},
    "heartbeat": job_out(**RUNNING),
    "finish": job_out(**FAILED),
    "job_get": job_out(**FAILED),
    "jobs": {"items": [job_out(**FAILED)], "total": 1, "offset": 0, "limit": 50,
             "next_offset": None},
    "problems": {"items": [{"problem": FAR_OUT, "device": None, "winner": None},
                           {"problem": PROBLEM_OUT, "device": DEVICES[0], "winner": WINNER_OUT}],
                 "total": 2, "offset": 0, "limit": 50, "next_offset": None},
    "problem_detail": {"problem": PROBLEM_OUT, "winners": [WINNER_OUT], "measurements": [
        measurement_out(1, 1, DKEY),
        measurement_out(2, 1, DKEY, strategy=RING, strategy_key=RING_KEY, method="ring",
                        samples=[0.0008] * 7, median_s=0.0008, ratio=1.25, ratio_lo=1.2,
                        ratio_hi=1.3)]},
    "demand": {"items": [demand_out(FAR, 2)], "offset": 0, "limit": 1, "next_offset": 1},
    "devices": DEVICES,
    "model_benches": [{"id": 1, "device_key": DKEY, **BENCH, "created_at": TIME, "attribution": None}],
    "model_bench": {"id": 1, "device_key": DKEY, **BENCH, "created_at": TIME, "attribution": None},
    "model_bench_404": {"detail": "bench-model run 2 does not exist"},
    "snapshot": {"format": "autotuner-snapshot", "version": 1, "exported_at": TIME,
                 "devices": DEVICES,
                 "entries": [{"device_key": DKEY, "problem_key": key(TUNED), "strategy": RING,
                              "strategy_key": RING_KEY, "speedup": 1.25, "confidence": [1.2, 1.3],
                              "record_id": 1, "measured_at": TIME, "trials": 2,
                              "traffic_speedup": None}],
                 "evidence": []},
    "healthz": {"status": "ok", "database": "ok", "dialect": "<backend>", "version": VERSION},
    "error_401": {"detail": "a bearer token is required (write): send 'Authorization: Bearer "
                            "TOKEN'"},
    "error_404": {"detail": "job 99 does not exist"},
    "error_409": {"detail": "job 1 is not held by worker 'w1' (status 'failed', worker 'w1')"},
    "error_422": {"detail": [{"type": "problem_invalid", "loc": ["body", "problem", "equation"],
                              "msg": "'x' must have exactly one '->' (implicit output is not "
                                     "supported)",
                              "input": {"equation": "x"},
                              "ctx": {"path": "equation",
                                      "message": "'x' must have exactly one '->' (implicit output "
                                                 "is not supported)"}}]},
}


def test_every_response_form_is_pinned(make_client, backend) -> None:
    got = _clockless(_scenario(make_client))
    dialect = {"sqlite": "sqlite", "postgres": "postgresql"}[backend]
    expected = {**EXPECTED, "healthz": {**EXPECTED["healthz"], "dialect": dialect}}
    assert set(got) == set(expected)
    for name, body in expected.items():
        assert _order(got[name]) == _order(body), name
