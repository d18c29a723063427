"""Every endpoint through FastAPI's TestClient, on SQLite and (marked postgres) PostgreSQL."""

from __future__ import annotations

import time
from typing import Any

import pytest

from autotuner import Device, Problem
from db import Database
from db import repository as repo
from service.costmodel_hook import ModelAnswer
from service.testing import (
    DEVICE,
    READ_HEADERS,
    READ_TOKEN,
    RING,
    WRITE_HEADERS,
    measurements,
    problem,
)

DEVICE_KEY = Device.from_dict(DEVICE).key


def key(p: dict[str, Any]) -> str:
    return Problem.from_dict(p).key


def lookup(c: Any, p: dict[str, Any], device: dict[str, Any] | None = None, **kw: Any) -> Any:
    return c.post("/v1/lookup", json={"device": device or DEVICE, "problem": p}, **kw)


def counts(database: Database) -> tuple[int, int, int]:
    """(problems, jobs, measurements of every problem) stored."""
    with database.session(read_only=True) as s:
        page = repo.list_problems(s, tuned_only=False, limit=1000)
        jobs = repo.list_jobs(s).total
        ms = sum(len(repo.list_measurements(s, r.problem.id)) for r in page.items)
        return page.total, jobs, ms


# -- health, docs ----------------------------------------------------------------------------------

def test_healthz_openapi_and_metrics(client):
    r = client.get("/healthz")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    spec = client.get("/openapi.json").json()
    paths = set(spec["paths"])
    assert {"/v1/lookup", "/v1/lookup/batch", "/v1/results", "/v1/jobs", "/v1/jobs/claim",
            "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/heartbeat", "/v1/jobs/{job_id}/finish",
            "/v1/jobs/{job_id}/release", "/v1/jobs/{job_id}/retry", "/v1/jobs/{job_id}/cancel", "/v1/jobs/from-demand",
            "/v1/problems", "/v1/problems/{problem}", "/v1/demand", "/v1/snapshot", "/v1/devices",
            "/v1/model-benches", "/v1/model-benches/{bench_id}",
            "/healthz", "/metrics"} <= paths
    assert "BearerToken" in spec["components"]["securitySchemes"]
    lookup(client, problem())
    lookup(client, {"equation": "nope"})
    text = client.get("/metrics").text
    assert 'autotuner_http_requests_total{method="POST",route="/v1/lookup",status="200"} 1.0' in text
    assert 'autotuner_http_requests_total{method="POST",route="/v1/lookup",status="422"} 1.0' in text
    assert 'autotuner_http_request_duration_seconds_bucket{le="0.01",method="POST",route="/v1/lookup"}' in text
    assert 'autotuner_lookups_total{source="default"} 1.0' in text
    assert "autotuner_lookup_misses_total 1.0" in text


def test_healthz_reports_an_unmigrated_database(testclient_cls, tmp_path):
    from autotuner.settings import Settings
    from db import SchemaError
    from service import create_app

    settings = Settings(db_url=f"sqlite:///{tmp_path / 'empty.db'}")
    with testclient_cls(create_app(settings, check_schema=False)) as c:
        r = c.get("/healthz")
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
        assert "autotuner db upgrade" in r.json()["database"]
        # unready, but alive: the liveness probe does not restart a replica for its database
        assert c.get("/livez").status_code == 200 and c.get("/livez").json()["status"] == "ok"
        assert str(tmp_path) not in r.text   # where the database is stays in the log
        r = lookup(c, problem())
        assert r.status_code == 503 and "results database" in r.json()["detail"]
        assert "no such table" not in r.text and str(tmp_path) not in r.text   # nor the driver's words
    with pytest.raises(SchemaError, match="autotuner db upgrade"):
        with testclient_cls(create_app(settings)):
            pass


# -- lookup ----------------------------------------------------------------------------------------

def test_lookup_default_then_tuned(client, post_results):
    p = problem()
    r = lookup(client, p)
    assert r.status_code == 200
    body = r.json()
    assert body["source"] == "default" and body["strategy"] == {"method": "baseline"}
    assert body["speedup"] == 1.0 and body["confidence"] is None and body["record_id"] is None
    assert body["problem_key"] == key(p) and body["device_key"] == DEVICE_KEY

    posted = post_results(client, p, ratio=1.3)
    assert posted["winner"]["strategy"] == RING and posted["recorded"] == 2
    body = lookup(client, p).json()  # the answer cache of this process was dropped by the upload
    assert body["source"] == "tuned"
    assert body["strategy"] == RING and body["strategy_key"] == "ring-uni-c1-ufull-loop-send"
    assert body["speedup"] == pytest.approx(1.3)
    assert body["confidence"] == pytest.approx([1.25, 1.35])
    assert body["record_id"] == posted["winner"]["id"] and body["measured_at"]
    assert body["trials"] == 2

    # the same problem with other letters and a dtype alias is the same canonical key
    renamed = dict(p, equation="ab,bc->ac", dtype="f32")
    assert lookup(client, renamed).json()["source"] == "tuned"
    # another device has no record
    other = dict(DEVICE, topology="lab-ring-1gbit")
    assert lookup(client, p, other).json()["source"] == "default"


def test_lookup_nearest(client, post_results):
    post_results(client, problem(2048, 1024, 512), ratio=1.4)
    near = lookup(client, problem(2048, 1024, 768)).json()
    assert near["source"] == "nearest"
    assert near["strategy"] == RING and near["neighbor_key"] == key(problem(2048, 1024, 512))
    assert 0 < near["distance"] < 1
    # far away (beyond AUTOTUNER_NEAREST_MAX_DISTANCE), another dtype or another mesh size: default
    assert lookup(client, problem(64, 64, 64)).json()["source"] == "default"
    assert lookup(client, problem(2048, 1024, 768, dtype="bfloat16")).json()["source"] == "default"
    assert lookup(client, problem(2048, 1024, 768, x=4)).json()["source"] == "default"
    # a reduce-scatter is another pattern
    assert lookup(client, problem(2048, 1024, 768, kind="rs")).json()["source"] == "default"


def test_nearest_skips_a_strategy_that_cannot_run(client, post_results):
    chunks4 = dict(RING, chunks=4)
    post_results(client, problem(2048, 1024, 512), strategy=chunks4)  # block 256: 4 chunks fit
    # m=2056 is not a multiple of 8*4: the neighbour's strategy cannot run; no other neighbour
    body = lookup(client, problem(2056, 1024, 512)).json()
    assert body["source"] == "default"
    body = lookup(client, problem(2112, 1024, 512)).json()  # block 264 = 4 x 66: it can
    assert body["source"] == "nearest" and body["strategy"] == chunks4


def test_model_hook(make_client):
    seen = []

    def model(p: Problem, d: Device) -> ModelAnswer:
        seen.append((p.key, d.key))
        from autotuner import Strategy

        return ModelAnswer(Strategy.from_dict(RING), speedup=1.1, confidence=(1.0, 1.2))

    c = make_client(model=model)
    body = lookup(c, problem()).json()
    assert body["source"] == "model" and body["strategy"] == RING and body["speedup"] == 1.1
    assert seen == [(key(problem()), DEVICE_KEY)]
    # the (strategy, speedup) form of autotuner.costmodel.model_answer; a strategy that cannot run
    # the problem is not served
    from autotuner import Strategy

    pairs = make_client(model=lambda p, d: (Strategy.from_dict(RING), 1.2))
    assert lookup(pairs, problem()).json()["source"] == "model"
    bad = make_client(model=lambda p, d: (Strategy.from_dict(dict(RING, chunks=4)), 1.2))
    assert lookup(bad, problem(2056)).json()["source"] == "default"
    from service.costmodel_hook import model_answer

    assert model_answer(Problem.from_dict(problem()), Device.from_dict(DEVICE)) is None


def test_lookup_batch(client, post_results):
    tuned, untuned = problem(1024, 512, 256), problem(4096, 512, 256, dtype="bfloat16")
    post_results(client, tuned)
    body = client.post("/v1/lookup/batch",
                       json={"device": DEVICE, "problems": [tuned, untuned, tuned, renamed(tuned)]}).json()
    assert body["device_key"] == DEVICE_KEY
    assert [r["source"] for r in body["results"]] == ["tuned", "default", "tuned", "tuned"]
    assert [r["problem_key"] for r in body["results"]] == [key(tuned), key(untuned), key(tuned), key(tuned)]


def test_lookup_batch_uses_a_bulk_repository_query_when_there_is_one(client, post_results, monkeypatch):
    from service import lookups

    tuned = [problem(1024 * (i + 1), 512, 256) for i in range(3)]
    for p in tuned:
        post_results(client, p)
    calls = []

    def get_winners(s: Any, device_key: str, keys: list[str]) -> dict[str, Any]:
        calls.append(list(keys))
        return {k: w for k in keys if (w := repo.get_winner(s, device_key, k)) is not None}

    monkeypatch.setattr(lookups.repo, "get_winners", get_winners, raising=False)
    far = problem(64, 64, 64)
    body = client.post("/v1/lookup/batch", json={"device": DEVICE, "problems": [*tuned, far, tuned[0]]}).json()
    assert [r["source"] for r in body["results"]] == ["tuned", "tuned", "tuned", "default", "tuned"]
    assert calls == [[key(p) for p in tuned] + [key(far)]]  # one call, each key once


def renamed(p: dict[str, Any]) -> dict[str, Any]:
    return dict(p, equation="".join({"m": "i", "k": "j", "n": "l"}.get(c, c) for c in p["equation"]))


def test_lookup_batch_limit(make_client):
    c = make_client(max_batch=3)
    ok = c.post("/v1/lookup/batch", json={"device": DEVICE, "problems": [problem()] * 3})
    assert ok.status_code == 200
    r = c.post("/v1/lookup/batch", json={"device": DEVICE, "problems": [problem()] * 4})
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", "problems"]
    assert "at most 3" in r.json()["detail"][0]["msg"]


def test_validation_names_the_field(client):
    bad = problem()
    bad["lhs"] = {"shape": [2048, 1024], "spec": ["y", None]}
    r = lookup(client, bad)
    assert r.status_code == 422
    err = r.json()["detail"][0]
    assert err["loc"] == ["body", "problem", "lhs", "spec", 0] and "unknown mesh axis 'y'" in err["msg"]

    r = lookup(client, dict(problem(), dtype="int8"))
    assert r.json()["detail"][0]["loc"] == ["body", "problem", "dtype"]
    r = lookup(client, problem(), dict(DEVICE, num_devices=0))
    assert r.json()["detail"][0]["loc"] == ["body", "device", "num_devices"]
    r = lookup(client, problem(), dict(DEVICE, device_kind="a\x00b"))
    assert r.json()["detail"][0]["loc"] == ["body", "device", "device_kind"]
    r = client.post("/v1/lookup/batch", json={"device": DEVICE, "problems": [problem(), dict(problem(), mesh={"x": 0})]})
    assert r.json()["detail"][0]["loc"] == ["body", "problems", 1, "mesh", "x"]
    r = client.post("/v1/lookup", json={"device": DEVICE})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "problem"]
    r = client.post("/v1/lookup", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422
    huge = problem()
    huge["lhs"]["shape"] = [2 ** 1100, 1024]
    huge["rhs"]["shape"] = [1024, 512]
    r = lookup(client, huge)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][:3] == ["body", "problem", "lhs"]


def test_results_validation(client, database):
    def post(items: list[dict[str, Any]]) -> Any:
        return client.post("/v1/results", headers=WRITE_HEADERS,
                           json={"device": DEVICE, "problem": problem(), "measurements": items})

    items = measurements()
    items[1] = dict(items[1], strategy_key="ring-bidi-c1-ufull-loop-send")
    r = post(items)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "measurements", 1, "strategy_key"]
    items = measurements()
    items[1] = dict(items[1], strategy=dict(RING, chunks=3))
    r = post(items)
    assert r.json()["detail"][0]["loc"] == ["body", "measurements", 1, "strategy", "chunks"]
    items = measurements()
    del items[0]["median_s"]
    assert post(items).status_code == 422
    items = measurements()
    items[0]["samples"] = [1.0, float("inf")]
    assert client.post("/v1/results", headers={**WRITE_HEADERS, "content-type": "application/json"},
                       content=_json({"device": DEVICE, "problem": problem(), "measurements": items})
                       ).status_code == 422
    assert counts(database) == (0, 0, 0)
    # a measurement with a matching key and a failed one are fine
    items = measurements()
    items[1]["strategy_key"] = "ring-uni-c1-ufull-loop-send"
    items.append({"strategy": dict(RING, chunks=2), "status": "failed", "reason": "OOM"})
    body = post(items).json()
    assert body["recorded"] == 3 and body["winner"]["strategy_key"] == "ring-uni-c1-ufull-loop-send"


def test_an_upload_sent_again_is_stored_once(client, database):
    """A worker that lost the answer to its upload sends it again: the measurements of a run that
    are stored already are counted as repeated, not stored twice (the winner's trials stay)."""
    def post(items: list[dict[str, Any]]) -> Any:
        r = client.post("/v1/results", headers=WRITE_HEADERS,
                        json={"device": DEVICE, "problem": problem(), "measurements": items})
        assert r.status_code == 201, r.text
        return r.json()

    run = [dict(m, run_id="r1") for m in measurements()]
    run.append({"strategy": dict(RING, chunks=2), "status": "failed", "reason": "OOM", "run_id": "r1"})
    first = post(run)
    assert (first["recorded"], first["repeated"], first["winner"]["trials"]) == (3, 0, 3)
    again = post(run)
    assert (again["recorded"], again["repeated"], again["winner"]["trials"]) == (0, 3, 3)
    assert counts(database)[2] == 3
    # another run's identical figures, a changed sample, a changed reason, or no run id: stored
    other = [dict(run[0], run_id="r2"), dict(run[1], samples=[*run[1]["samples"][:-1], 1e-4]),
             dict(run[2], reason="timeout"), {k: v for k, v in run[0].items() if k != "run_id"}]
    more = post(other + run[:1])
    assert (more["recorded"], more["repeated"]) == (4, 1)
    assert counts(database)[2] == 7


def _json(doc: Any) -> bytes:
    import json

    return json.dumps(doc, allow_nan=True).encode()


def test_body_limit(make_client, database):
    c = make_client(max_body_bytes=2000)
    body = {"device": DEVICE, "problem": problem(), "measurements": measurements() * 20}
    r = c.post("/v1/results", headers=WRITE_HEADERS, json=body)
    assert r.status_code == 413 and "2000 bytes" in r.json()["detail"]

    def chunks():  # no Content-Length: counted as it arrives
        text = _json(body)
        for i in range(0, len(text), 500):
            yield text[i:i + 500]

    r = c.post("/v1/results", headers={**WRITE_HEADERS, "content-type": "application/json"}, content=chunks())
    assert r.status_code == 413
    assert counts(database) == (0, 0, 0)


# -- auth ------------------------------------------------------------------------------------------

def test_writes_need_a_write_token(make_client, database):
    with database.session() as s:
        repo.add_token(s, "ci-reader", "stored-read", "read")
        repo.add_token(s, "ci-writer", "stored-write", "write")
        revoked = repo.add_token(s, "old", "stored-revoked", "write")
        repo.revoke_token(s, revoked.id)
    c = make_client(read_tokens=[READ_TOKEN])
    results = {"device": DEVICE, "problem": problem(), "measurements": measurements()}
    job = {"device": DEVICE, "problem": problem()}
    writes = [("/v1/results", results), ("/v1/jobs", job), ("/v1/jobs/claim", {"worker": "w"}),
              ("/v1/jobs/1/heartbeat", {"worker": "w"}), ("/v1/jobs/1/finish", {"worker": "w", "status": "done"}),
              ("/v1/jobs/1/release", {"worker": "w"}), ("/v1/jobs/1/retry", {}), ("/v1/jobs/1/cancel", {}),
              ("/v1/jobs/from-demand", {"device_key": "d"})]
    for path, body in writes:
        r = c.post(path, json=body)
        assert r.status_code == 401, (path, r.text)
        assert r.headers["www-authenticate"].startswith("Bearer")
        for bad in ("Bearer nope", "Bearer stored-revoked", "Basic d3JpdGU6dG9rZW4=", "Bearer "):
            assert c.post(path, json=body, headers={"Authorization": bad}).status_code == 401, (path, bad)
        for reader in (READ_HEADERS, {"Authorization": "Bearer stored-read"}):
            r = c.post(path, json=body, headers=reader)
            assert r.status_code == 403, (path, r.text)
    assert counts(database) == (0, 0, 0)
    # a token in the header is never echoed back
    r = c.post("/v1/jobs", json=job, headers={"Authorization": "Bearer secret-value-123"})
    assert "secret-value-123" not in r.text
    # the stored write token and the settings one both write
    assert c.post("/v1/jobs", json=job, headers={"Authorization": "Bearer stored-write"}).status_code == 201
    assert c.post("/v1/results", json=results, headers=WRITE_HEADERS).status_code == 201
    assert counts(database) == (1, 1, 2)


def test_reads_open_unless_read_tokens(make_client):
    open_ = make_client()
    assert lookup(open_, problem()).status_code == 200
    assert open_.get("/v1/problems").status_code == 200
    closed = make_client(read_tokens=[READ_TOKEN])
    for call in (lambda **kw: lookup(closed, problem(), **kw),
                 lambda **kw: closed.post("/v1/lookup/batch", json={"device": DEVICE, "problems": [problem()]}, **kw),
                 lambda **kw: closed.get("/v1/problems", **kw), lambda **kw: closed.get("/v1/demand", **kw),
                 lambda **kw: closed.get("/v1/jobs/1", **kw), lambda **kw: closed.get("/v1/snapshot", **kw),
                 lambda **kw: closed.get("/v1/devices", **kw), lambda **kw: closed.get("/v1/jobs", **kw),
                 lambda **kw: closed.get("/v1/problems/1", **kw)):
        assert call().status_code == 401
        assert call(headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert call(headers=READ_HEADERS).status_code in (200, 404)
        assert call(headers=WRITE_HEADERS).status_code in (200, 404)
    assert closed.get("/healthz").status_code == 200 and closed.get("/metrics").status_code == 200


# -- problems --------------------------------------------------------------------------------------

def test_problems_filter_sort_paginate(client, post_results):
    shapes = [(1024 * (i + 1), 512, 256) for i in range(7)]
    for i, (m, k, n) in enumerate(shapes):
        post_results(client, problem(m, k, n, dtype="bfloat16" if i % 2 else "float32"), ratio=1.1 + i / 10)
    lookup(client, problem(64, 64, 64))  # a miss creates no problem row
    r = client.get("/v1/problems", params={"limit": 3, "sort": "speedup", "desc": "false"})
    page = r.json()
    assert page["total"] == 7 and page["limit"] == 3 and page["next_offset"] == 3
    speedups = [row["winner"]["speedup"] for row in page["items"]]
    assert speedups == pytest.approx([1.1, 1.2, 1.3])
    seen = []
    offset: int | None = 0
    while offset is not None:
        page = client.get("/v1/problems", params={"limit": 3, "offset": offset, "sort": "flops"}).json()
        seen += [row["problem"]["key"] for row in page["items"]]
        offset = page["next_offset"]
    assert len(seen) == len(set(seen)) == 7
    flops = client.get("/v1/problems", params={"sort": "flops", "limit": 7}).json()["items"]
    assert [r["problem"]["flops"] for r in flops] == sorted((r["problem"]["flops"] for r in flops), reverse=True)
    bf16 = client.get("/v1/problems", params={"dtype": "bfloat16"}).json()
    assert bf16["total"] == 3 and {r["problem"]["dtype"] for r in bf16["items"]} == {"bfloat16"}
    assert client.get("/v1/problems", params={"pattern": "all_gather:lhs:free", "device_key": DEVICE_KEY}
                      ).json()["total"] == 7
    assert client.get("/v1/problems", params={"method": "baseline"}).json()["total"] == 0
    first = key(problem(*shapes[0]))
    hit = client.get("/v1/problems", params={"search": first[:8]}).json()
    assert [r["problem"]["key"] for r in hit["items"]] == [first]
    assert hit["items"][0]["device"]["key"] == DEVICE_KEY and hit["next_offset"] is None
    assert client.get("/v1/problems", params={"limit": 0}).status_code == 422
    assert client.get("/v1/problems", params={"limit": 1001}).status_code == 422
    assert client.get("/v1/problems", params={"sort": "nope"}).status_code == 422


def test_problem_detail(client, post_results):
    p = problem()
    post_results(client, p)
    post_results(client, p, ratio=1.5)
    post_results(client, p, device=dict(DEVICE, topology="other"))
    rows = client.get("/v1/problems", params={"search": key(p)}).json()["items"]
    pid = rows[0]["problem"]["id"]
    for ref in (str(pid), key(p)):
        d = client.get(f"/v1/problems/{ref}").json()
        assert d["problem"]["key"] == key(p) and d["problem"]["canonical"]["equation"] == "ab,bc->ac"
        assert len(d["measurements"]) == 6 and len(d["winners"]) == 2
        assert {m["device_key"] for m in d["measurements"]} == {DEVICE_KEY, Device.from_dict(dict(DEVICE, topology="other")).key}
        mine = next(w for w in d["winners"] if w["device_key"] == DEVICE_KEY)
        assert mine["speedup"] == pytest.approx(1.5) and mine["trials"] == 4
    assert client.get("/v1/problems/999").status_code == 404
    assert client.get("/v1/problems/99999999999999999999").status_code == 404
    assert client.get("/v1/problems/ffffffffffffffffffffffffffffffff").status_code == 404
    assert client.get("/v1/problems/a%20b").status_code == 422


# -- demand ----------------------------------------------------------------------------------------

def test_demand_from_misses(client, post_results):
    a, b, tuned = problem(4096, 256, 256), problem(8192, 256, 256), problem(1024, 1024, 1024)
    post_results(client, tuned)
    for _ in range(3):
        lookup(client, a)
    lookup(client, tuned)
    client.post("/v1/lookup/batch", json={"device": DEVICE, "problems": [b, tuned, a]})
    # a read writes nothing ...
    client.app.state.autotuner.lookups.demand.flush()   # ... the background writer does (0.5 s)
    items = client.get("/v1/demand").json()["items"]
    assert [(d["problem_key"], d["count"]) for d in items] == [(key(a), 4), (key(b), 1)]
    assert items[0]["device"] == DEVICE and items[0]["device_key"] == DEVICE_KEY
    assert Problem.from_dict(items[0]["problem"]).key == key(a)  # ready for POST /v1/jobs
    page = client.get("/v1/demand", params={"limit": 1}).json()
    assert len(page["items"]) == 1 and page["next_offset"] == 1
    post_results(client, a)
    untuned = client.get("/v1/demand", params={"untuned_only": "true"}).json()["items"]
    assert [d["problem_key"] for d in untuned] == [key(b)]
    other = client.get("/v1/demand", params={"device_key": "0" * 32}).json()["items"]
    assert other == []


def test_demand_is_written_by_the_background_writer(client):
    lookup(client, problem(4096, 256, 256))
    state = client.app.state.autotuner
    assert state.lookups.demand.running
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with state.database.session(read_only=True) as s:
            if repo.list_demand(s):
                break
        time.sleep(0.05)
    with state.database.session(read_only=True) as s:
        assert [d.count for d in repo.list_demand(s)] == [1]


# -- jobs ------------------------------------------------------------------------------------------

def test_jobs_lifecycle(client):
    body = {"device": DEVICE, "problem": problem(), "params": {"trials": 8}, "priority": 2}
    r = client.post("/v1/jobs", json=body, headers=WRITE_HEADERS)
    assert r.status_code == 201
    job = r.json()
    assert job["status"] == "queued" and job["params"] == {"trials": 8} and job["problem_key"] == key(problem())
    assert job["device"] == DEVICE and job["device_key"] == DEVICE_KEY
    again = client.post("/v1/jobs", json=body, headers=WRITE_HEADERS).json()
    assert again["id"] == job["id"]  # one active job per (device, problem)
    other = client.post("/v1/jobs", json={"device": DEVICE, "problem": problem(1024)}, headers=WRITE_HEADERS).json()

    assert client.get(f"/v1/jobs/{job['id']}").json()["status"] == "queued"
    assert client.get("/v1/jobs/999").status_code == 404
    assert client.get("/v1/jobs/0").status_code == 422
    listed = client.get("/v1/jobs", params={"status": "queued"}).json()
    assert listed["total"] == 2

    claimed = client.post("/v1/jobs/claim", json={"worker": "w1"}, headers=WRITE_HEADERS).json()["job"]
    assert claimed["id"] == job["id"] and claimed["status"] == "running"  # higher priority first
    assert claimed["worker"] == "w1" and claimed["attempts"] == 1 and claimed["lease_expires_at"]
    second = client.post("/v1/jobs/claim", json={"worker": "w2"}, headers=WRITE_HEADERS).json()["job"]
    assert second["id"] == other["id"]
    assert client.post("/v1/jobs/claim", json={"worker": "w3"}, headers=WRITE_HEADERS).json() == {
        "job": None, "abandoned": []}

    beat = client.post(f"/v1/jobs/{job['id']}/heartbeat", json={"worker": "w1", "lease_seconds": 600},
                       headers=WRITE_HEADERS).json()
    assert beat["lease_expires_at"] > claimed["lease_expires_at"]
    r = client.post(f"/v1/jobs/{job['id']}/heartbeat", json={"worker": "w2"}, headers=WRITE_HEADERS)
    assert r.status_code == 409 and "not held by worker 'w2'" in r.json()["detail"]
    r = client.post(f"/v1/jobs/{job['id']}/finish", json={"worker": "w2", "status": "done"}, headers=WRITE_HEADERS)
    assert r.status_code == 409
    done = client.post(f"/v1/jobs/{job['id']}/finish", json={"worker": "w1", "status": "done"},
                       headers=WRITE_HEADERS).json()
    assert done["status"] == "done" and done["lease_expires_at"] is None
    failed = client.post(f"/v1/jobs/{other['id']}/finish", json={"worker": "w2", "status": "failed", "error": "boom"},
                         headers=WRITE_HEADERS).json()
    assert failed["status"] == "failed" and failed["error"] == "boom"
    assert client.post("/v1/jobs/999/finish", json={"worker": "w1", "status": "done"},
                       headers=WRITE_HEADERS).status_code == 404
    assert client.post(f"/v1/jobs/{job['id']}/finish", json={"worker": "w1", "status": "queued"},
                       headers=WRITE_HEADERS).status_code == 422
    # a finished job is final: enqueueing again makes a new one
    renewed = client.post("/v1/jobs", json=body, headers=WRITE_HEADERS).json()
    assert renewed["id"] != job["id"] and renewed["status"] == "queued"


def test_job_release_returns_it_to_the_queue_at_once(client):
    job = client.post("/v1/jobs", json={"device": DEVICE, "problem": problem()}, headers=WRITE_HEADERS).json()
    claimed = client.post("/v1/jobs/claim", json={"worker": "w1", "lease_seconds": 3600},
                          headers=WRITE_HEADERS).json()["job"]
    assert claimed["id"] == job["id"] and claimed["attempts"] == 1
    r = client.post(f"/v1/jobs/{job['id']}/release", json={"worker": "w2"}, headers=WRITE_HEADERS)
    assert r.status_code == 409 and "not held by worker 'w2'" in r.json()["detail"]
    assert client.post("/v1/jobs/999/release", json={"worker": "w1"}, headers=WRITE_HEADERS).status_code == 404
    assert client.post(f"/v1/jobs/{job['id']}/release", json={}, headers=WRITE_HEADERS).status_code == 422
    back = client.post(f"/v1/jobs/{job['id']}/release", json={"worker": "w1"}, headers=WRITE_HEADERS).json()
    assert (back["status"], back["worker"], back["lease_expires_at"], back["attempts"]) == ("queued", None, None, 0)
    # the hour-long lease does not hold it: another worker claims it now, a first attempt
    again = client.post("/v1/jobs/claim", json={"worker": "w2", "max_attempts": 1},
                        headers=WRITE_HEADERS).json()["job"]
    assert again["id"] == job["id"] and again["worker"] == "w2" and again["attempts"] == 1


def test_jobs_from_demand(client):
    for p in (problem(), problem(1024), problem()):      # missed: problem() twice, problem(1024) once
        lookup(client, p)
    deadline = time.monotonic() + 10   # misses reach the demand table within the writer's interval
    while len(client.get("/v1/demand").json()["items"]) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    r = client.post("/v1/jobs/from-demand", json={"device_key": DEVICE_KEY, "limit": 1, "params": {"trials": 4}},
                    headers=WRITE_HEADERS)
    assert r.status_code == 200, r.text
    (first,) = r.json()["items"]
    assert first["problem"] == Problem.from_dict(problem()).canonical() and first["device"] == DEVICE
    assert (first["status"], first["params"]) == ("queued", {"trials": 4})
    again = client.post("/v1/jobs/from-demand", json={"device_key": DEVICE_KEY}, headers=WRITE_HEADERS).json()
    assert [j["problem_key"] for j in again["items"]] == [Problem.from_dict(problem(1024)).key]
    assert client.post("/v1/jobs/from-demand", json={"device_key": DEVICE_KEY},
                       headers=WRITE_HEADERS).json() == {"items": []}
    for bad in ({"device_key": DEVICE_KEY, "limit": 0}, {"device_key": ""}, {"limit": 3}):
        assert client.post("/v1/jobs/from-demand", json=bad, headers=WRITE_HEADERS).status_code == 422, bad


def test_job_lease_expiry_and_reclaim(client):
    job = client.post("/v1/jobs", json={"device": DEVICE, "problem": problem()}, headers=WRITE_HEADERS).json()
    # a lease long enough that the next request comes inside it on a loaded machine (0.3 s did not)
    first = client.post("/v1/jobs/claim", json={"worker": "dead", "lease_seconds": 1.5},
                        headers=WRITE_HEADERS).json()["job"]
    assert first["id"] == job["id"]
    assert client.post("/v1/jobs/claim", json={"worker": "w2"}, headers=WRITE_HEADERS).json()["job"] is None
    time.sleep(1.6)
    again = client.post("/v1/jobs/claim", json={"worker": "w2", "device_key": DEVICE_KEY, "lease_seconds": 0.3},
                        headers=WRITE_HEADERS).json()["job"]
    assert again["id"] == job["id"] and again["worker"] == "w2" and again["attempts"] == 2
    r = client.post(f"/v1/jobs/{job['id']}/heartbeat", json={"worker": "dead"}, headers=WRITE_HEADERS)
    assert r.status_code == 409
    r = client.post(f"/v1/jobs/{job['id']}/finish", json={"worker": "dead", "status": "done"}, headers=WRITE_HEADERS)
    assert r.status_code == 409
    # max_attempts: a job claimed twice is not handed out a third time; once its second lease has
    # run out too (w2 died as well), it is failed, and the claim says so
    time.sleep(0.35)
    got = client.post("/v1/jobs/claim", json={"worker": "w3", "max_attempts": 2}, headers=WRITE_HEADERS).json()
    assert got["job"] is None and [(j["id"], j["status"]) for j in got["abandoned"]] == [(job["id"], "failed")]
    assert got["abandoned"][0]["error"].startswith("abandoned: claimed 2 times, and each worker's lease ran out")
    assert client.post(f"/v1/jobs/{job['id']}/finish", json={"worker": "w2", "status": "done"},
                       headers=WRITE_HEADERS).status_code == 409
    assert client.post("/v1/jobs/claim", json={"worker": "w3", "max_attempts": 2},
                       headers=WRITE_HEADERS).json() == {"job": None, "abandoned": []}
    assert got["abandoned"][0]["error"].endswith(f"queue it again: POST /v1/jobs/{job['id']}/retry")
    # queued again, as the error says: a new job of the pair, no claims yet; the failed one stays
    r = client.post(f"/v1/jobs/{job['id']}/retry", headers=WRITE_HEADERS)
    assert r.status_code == 201, r.text
    new = r.json()
    assert (new["status"], new["attempts"], new["problem_key"], new["device_key"]) == (
        "queued", 0, job["problem_key"], job["device_key"]) and new["id"] != job["id"]
    assert client.get(f"/v1/jobs/{job['id']}").json()["status"] == "failed"
    # asked again while that one is queued: the same job; other params and priority on request
    again = client.post(f"/v1/jobs/{job['id']}/retry", json={"params": {"trials": 48}, "priority": 5},
                        headers=WRITE_HEADERS).json()
    assert again["id"] == new["id"] and again["params"] == new["params"]
    claimed = client.post("/v1/jobs/claim", json={"worker": "w4"}, headers=WRITE_HEADERS).json()["job"]
    client.post(f"/v1/jobs/{claimed['id']}/finish", json={"worker": "w4", "status": "done"}, headers=WRITE_HEADERS)
    more = client.post(f"/v1/jobs/{claimed['id']}/retry", json={"params": {"trials": 48}, "priority": 5},
                       headers=WRITE_HEADERS).json()
    assert (more["params"], more["priority"], more["status"]) == ({"trials": 48}, 5, "queued")
    assert client.post("/v1/jobs/999999/retry", headers=WRITE_HEADERS).status_code == 404
    # cancelled while queued: failed with its reason, not claimed; the route answers 404 / 422 as others
    r = client.post(f"/v1/jobs/{more['id']}/cancel", json={"reason": "wrong mesh"}, headers=WRITE_HEADERS)
    assert r.status_code == 200 and (r.json()["status"], r.json()["error"]) == ("failed", "cancelled: wrong mesh")
    assert client.post("/v1/jobs/claim", json={"worker": "w5"}, headers=WRITE_HEADERS).json()["job"] is None
    assert client.post("/v1/jobs/999999/cancel", headers=WRITE_HEADERS).status_code == 404
    assert client.post(f"/v1/jobs/{more['id']}/cancel", json={"reason": 3}, headers=WRITE_HEADERS).status_code == 422
    assert client.post(f"/v1/jobs/{job['id']}/retry", json={"priority": "high"},
                       headers=WRITE_HEADERS).status_code == 422


# -- snapshot --------------------------------------------------------------------------------------

def test_snapshot_and_devices(client, post_results):
    post_results(client, problem(), ratio=1.3)
    post_results(client, problem(1024), device=dict(DEVICE, topology="other"))
    devices = client.get("/v1/devices").json()
    assert {d["key"] for d in devices} == {DEVICE_KEY, Device.from_dict(dict(DEVICE, topology="other")).key}
    snap = client.get("/v1/snapshot", params={"device_key": DEVICE_KEY}).json()
    assert snap["format"] == "autotuner-snapshot" and snap["version"] == 1
    assert [d["key"] for d in snap["devices"]] == [DEVICE_KEY]
    (entry,) = snap["entries"]
    assert entry["problem_key"] == key(problem()) and entry["strategy"] == RING
    assert entry["confidence"] == pytest.approx([1.25, 1.35])
    assert len(client.get("/v1/snapshot").json()["entries"]) == 2
    assert client.get("/v1/snapshot", params={"device_key": "nope"}).json()["entries"] == []


# -- concurrency -----------------------------------------------------------------------------------

def test_concurrent_single_lookups_are_coalesced(db_url, database):
    from autotuner.settings import Settings
    from autotuner.tune import store
    from service import create_app

    tuned = [problem(1024 + 64 * i) for i in range(12)]
    for p in tuned:
        store.save(database, Device.from_dict(DEVICE), Problem.from_dict(p), _items())
    app = create_app(Settings(db_url=db_url, lookup_cache_seconds=0))
    try:
        _coalesce(app, tuned)
    finally:
        app.state.autotuner.database.dispose()  # no lifespan ran: close its engine here


def _coalesce(app: Any, tuned: list[dict[str, Any]]) -> None:
    import asyncio

    import httpx

    from db import StorageError

    engine = app.state.autotuner.lookups
    rounds: list[list[str]] = []
    resolve = engine._coalescer._resolve

    def counted(device: Any, dkey: str, problems: dict[str, Any], provisional: set[str]) -> Any:
        rounds.append(list(problems))
        return resolve(device, dkey, problems, provisional)

    engine._coalescer._resolve = counted

    async def ask(bodies: list[dict[str, Any]]) -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
            return await asyncio.gather(*(h.post("/v1/lookup", json=b) for b in bodies))

    bodies = [{"device": DEVICE, "problem": p} for p in tuned + tuned[:4]]
    responses = asyncio.run(ask(bodies))
    assert [r.json()["problem_key"] for r in responses] == [key(b["problem"]) for b in bodies]
    assert {r.json()["source"] for r in responses} == {"tuned"}
    assert sum(len(r) for r in rounds) <= len(tuned) and len(rounds) < len(tuned)  # together

    def broken(*args: Any) -> Any:
        raise StorageError("database error (OperationalError): disk I/O error")

    engine._coalescer._resolve = broken
    responses = asyncio.run(ask(bodies[:5]))
    assert [r.status_code for r in responses] == [503] * 5
    assert "unavailable" in responses[0].json()["detail"]   # the driver's words stay in the log
    assert "disk I/O error" not in responses[0].text


def _items() -> list[dict[str, Any]]:
    from autotuner import Strategy

    return [{**m, "strategy": Strategy.from_dict(m["strategy"]).to_dict(),
             "strategy_key": Strategy.from_dict(m["strategy"]).key} for m in measurements()]


def test_lookup_answers_from_a_calibrated_cost_model_by_default(make_client, database):
    """create_app's default model is autotuner.costmodel's: a device with a calibration in the
    database gets `model` answers for untuned shapes; an uncalibrated one gets `default`."""
    import dataclasses

    from autotuner import costmodel

    gbit = 1e9 / 8
    params = costmodel.Params(mm=tuple((f, f / 20e9) for f in (1e6, 1e9, 1e11)), mem_bw=1e10,
                              ag=(1e-4, 1 / (2 * gbit)), rs=(1e-4, 1 / (2 * gbit)), alpha=1e-4,
                              beta_uni=1 / (2 * gbit), beta_bidi=1 / (2 * gbit), kappa=0.0, kappa_x=0.0,
                              loop_s=1e-4, copy_bw=1e10, num_devices=8)
    device = Device.from_dict(DEVICE)
    costmodel.save_params(database, device, params)
    p = problem(2048, 1024, 512)
    best, speedup = costmodel.predict(Problem.from_dict(p), device, params)
    assert not best.is_baseline and speedup >= 1.1  # the made-up device overlaps this shape well

    c = make_client()
    body = lookup(c, p).json()
    assert body["source"] == "model", body
    assert body["strategy"] == best.to_dict() and body["speedup"] == pytest.approx(speedup)
    other = dataclasses.replace(device, topology="lab-ring-1gbit").to_dict()
    assert c.post("/v1/lookup", json={"device": other, "problem": p}).json()["source"] == "default"


def test_a_batch_asks_the_model_only_within_its_time_budget(make_client):
    """Untuned shapes beyond the per-request model budget are answered `default` and not
    cached, so the next lookup of them gets the model's answer."""
    from autotuner import Strategy

    asked = []

    def slow(p, d):
        asked.append(p.key)
        time.sleep(0.05)
        return (Strategy.from_dict(RING), 1.3)

    c = make_client(model=slow, model_budget_seconds=0.12)
    ps = [problem(1024 * (i + 1), 512, 256) for i in range(8)]
    body = c.post("/v1/lookup/batch", json={"device": DEVICE, "problems": ps}).json()
    sources = [r["source"] for r in body["results"]]
    assert sources[0] == "model" and "default" in sources, sources
    assert sources == sorted(sources, key=lambda x: x != "model")  # the model answered a prefix
    first_default = sources.index("default")
    assert len(asked) == first_default
    again = lookup(c, ps[first_default]).json()
    assert again["source"] == "model"
