"""A tuning run's measurements travel whole: tuner -> scratch database -> POST /v1/results ->
the service's database, every field of db.MeasurementInput unchanged on the way (all three
steps build or accept items from the one field list in db/records.py)."""

from __future__ import annotations

import shutil
import time

from autotuner import Device, Problem
from autotuner.measure import Candidate
from autotuner.tune import service_worker, store
from db import Database
from db import repository as repo
from db.records import MEASUREMENT_INPUT_FIELDS
from service.testing import DEVICE, RING, WRITE_HEADERS, problem


def _candidates() -> list[Candidate]:
    base = Candidate(strategy={"method": "baseline"}, key="baseline", samples=[1e-3] * 3,
                     median_s=1e-3, iqr_s=1e-5, min_s=9.9e-4, n=3, compile_s=0.5,
                     memory={"temp_size_in_bytes": 1024}, aa_width=0.03)
    ring = Candidate(strategy=RING, key="ring-uni-c1-ufull-loop-send", samples=[8e-4] * 3,
                     median_s=8e-4, iqr_s=2e-5, min_s=7.9e-4, n=3, ratio=1.25, ratio_lo=1.2,
                     ratio_hi=1.3, compile_s=0.7, memory={"temp_size_in_bytes": 2048}, aa_width=0.03)
    failed = Candidate(strategy=dict(RING, chunks=4), key="ring-uni-c4-ufull-loop-send",
                       status="failed", reason="does not divide")
    return [base, ring, failed]


def test_a_runs_measurements_reach_the_service_unchanged(client, sqlite_template, tmp_path):
    device, prob = Device.from_dict(DEVICE), Problem.from_dict(problem())
    shutil.copyfile(sqlite_template, tmp_path / "scratch.db")  # the worker's local database
    scratch = Database(f"sqlite:///{tmp_path / 'scratch.db'}")
    try:
        earlier = [store.measurement_item(c, run_id="run-0", host="h0") for c in _candidates()[:1]]
        store.save(scratch, device, prob, earlier)
        # the ring timed beside its serial control: 1.25 = traffic 1.2 x overlap 1.04
        split = {"ring-uni-c1-ufull-loop-send": {"serial_s": 8.33e-4, "traffic_speedup": 1.2}}
        items = [store.measurement_item(c, run_id="run-1", host="h1", **split.get(c.key, {})) for c in _candidates()]
        store.save(scratch, device, prob, items)
        uploaded = service_worker.run_items(scratch, device, prob, "run-1")
        with scratch.session(read_only=True) as s:
            dev, p = repo.get_device_by_key(s, device.key), repo.get_problem_by_key(s, prob.key)
            local = [m for m in repo.list_measurements(s, p.id, dev.id) if m.run_id == "run-1"]
    finally:
        scratch.dispose()
    assert len(uploaded) == 3 and all("created_at" not in item for item in uploaded)

    client.headers.update(WRITE_HEADERS)
    body = service_worker.send_kept(client, service_worker.keep(tmp_path / "outbox", "run-1", store.results_body(
        device, prob, uploaded)), time.monotonic() + 30)
    assert body["recorded"] == 3 and body["winner"]["strategy"] == RING
    assert body["winner"]["traffic_speedup"] == 1.2 and abs(body["winner"]["overlap_speedup"] - 1.25 / 1.2) < 1e-12

    database = client.app.state.autotuner.database
    with database.session(read_only=True) as s:
        p = repo.get_problem_by_key(s, prob.key)
        served = repo.list_measurements(s, p.id)
    fields = [f for f in MEASUREMENT_INPUT_FIELDS if f != "created_at"]
    assert [[getattr(m, f) for f in fields] for m in served] == \
        [[getattr(m, f) for f in fields] for m in local]
    for f in fields:  # each field is set somewhere above: none was dropped on the way
        assert any(getattr(m, f) not in (None, (), 0) for m in served), f
    assert served[0].memory == {"temp_size_in_bytes": 1024} and served[2].reason == "does not divide"
    assert {m.host for m in served} == {"h1"}


def test_an_earlier_runs_measurements_the_study_skips_travel_with_the_next_run(client, sqlite_template, tmp_path):
    """A run that crashed before uploading (run-0) measured the ring; the next run on the same
    scratch database resumes the study, so it measures the references again but not the ring: its
    upload carries run-0's ring too, and the service's winner is the ring (it was the baseline,
    from run-1's items alone). Sent again, nothing is stored twice."""
    device, prob = Device.from_dict(DEVICE), Problem.from_dict(problem())
    shutil.copyfile(sqlite_template, tmp_path / "scratch.db")
    scratch = Database(f"sqlite:///{tmp_path / 'scratch.db'}")
    base, ring, failed = _candidates()
    try:
        store.save(scratch, device, prob, [store.measurement_item(c, run_id="run-0") for c in (base, ring)])
        store.save(scratch, device, prob, [store.measurement_item(c, run_id="run-1") for c in (base, failed)])
        uploaded = service_worker.run_items(scratch, device, prob, "run-1")
        assert service_worker.run_items(scratch, device, prob, "run-2") == []   # a run with nothing of its own
    finally:
        scratch.dispose()
    assert [(m["run_id"], m["strategy_key"]) for m in uploaded] == [
        ("run-1", "baseline"), ("run-1", failed.key), ("run-0", ring.key)]
    client.headers.update(WRITE_HEADERS)
    body = store.results_body(device, prob, uploaded)
    first = client.post("/v1/results", json=body).json()
    assert first["recorded"] == 3 and first["winner"]["strategy"] == RING
    again = client.post("/v1/results", json=body).json()
    assert (again["recorded"], again["repeated"]) == (0, 3)


def test_an_upload_carries_the_problems_readable_name(client):
    """`tune --service` uploads the problem's name (its layer) with the measurements; a later upload
    without one keeps it."""
    device, prob = Device.from_dict(DEVICE), Problem.from_dict(problem())
    items = [store.measurement_item(c, run_id="run-1", host="h1") for c in _candidates()]
    client.headers.update(WRITE_HEADERS)
    for body in (store.results_body(device, prob, items, name="mlp/up_proj"), store.results_body(device, prob, items)):
        assert client.post("/v1/results", json=body).status_code == 201
    with client.app.state.autotuner.database.session(read_only=True) as s:
        assert repo.get_problem_by_key(s, prob.key).name == "mlp/up_proj"
    r = client.post("/v1/results", json={"device": DEVICE, "problem": problem(), "name": "x" * 257,
                                         "measurements": items})
    assert r.status_code == 422 and "name" in r.text


def test_kept_uploads_are_sent_once_and_a_refused_one_is_set_aside(client, tmp_path):
    """The worker's outbox: a body kept before it is sent, removed once stored; the same body sent
    again (its answer lost) stores nothing twice; one the service refuses is kept as *.refused
    and the others still go."""
    import pytest

    from autotuner.errors import ServiceError

    device, prob = Device.from_dict(DEVICE), Problem.from_dict(problem())
    items = [store.measurement_item(c, run_id="run-1", host="h") for c in _candidates()]
    body = store.results_body(device, prob, items)
    folder = tmp_path / "outbox"
    client.headers.update(WRITE_HEADERS)
    until = time.monotonic() + 30
    first = service_worker.send_kept(client, service_worker.keep(folder, "run-1", body), until)
    assert (first["recorded"], first["repeated"]) == (3, 0) and list(folder.iterdir()) == []

    said: list[str] = []
    service_worker.keep(folder, "a-again", body)                          # sent, the answer lost
    service_worker.keep(folder, "b-bad", {**body, "problem": {"equation": "nope"}})
    service_worker.keep(folder, "c-other", store.results_body(device, Problem.from_dict(problem(1024)), items))
    service_worker.send_pending(client, folder, until, said.append)
    assert sorted(p.name for p in folder.iterdir()) == ["b-bad.refused"]
    assert said[0] == "uploaded 0 measurement(s) an earlier run kept (a-again.json; 3 the service had)"
    assert said[1].startswith("b-bad.json: refused, kept as ") and "HTTP 422" in said[1]
    assert said[2] == "uploaded 3 measurement(s) an earlier run kept (c-other.json; 0 the service had)"

    database = client.app.state.autotuner.database
    with database.session(read_only=True) as s:
        assert len(repo.list_measurements(s, repo.get_problem_by_key(s, prob.key).id)) == 3
    client.headers.pop("Authorization")   # a token refused: at once, and the upload is kept to send again
    with pytest.raises(ServiceError, match="HTTP 401"):
        service_worker.send_kept(client, service_worker.keep(folder, "d", body), until)
    with pytest.raises(ServiceError, match="HTTP 401"):
        service_worker.send_pending(client, folder, until, said.append)
    assert sorted(p.name for p in folder.iterdir()) == ["b-bad.refused", "d.json"]
