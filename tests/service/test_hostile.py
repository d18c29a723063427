"""Hostile input (issue 26): what a request can make the service keep is bounded (memos, answer
cache, nearest index, demand rows), every value a request carries is held to its limits with a
422 naming the field (fast path and routes, SQLite and PostgreSQL), and a request's error is
its own (coalesced lookups of other requests are answered; a bug is one 500, logged once)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from autotuner import Device, Problem
from db import repository as repo
from service.field_types import ParseMemo
from service.lookups import DemandRecorder, _Coalescer
from service.routes.lookup import PROCESS_HEADER
from service.testing import DEVICE, WRITE_HEADERS, WRITE_TOKEN, live_server, measurements, problem

JSON = {"content-type": "application/json"}


def _rss(pid: int) -> int:
    """The resident set of process ``pid``, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _padded(body: dict[str, Any], i: int, size: int) -> bytes:
    """``body``'s JSON led by ``size`` bytes of whitespace, different for every ``i``."""
    ws = "".join(" \t"[(i >> b) & 1] for b in range(16)) + "\n" * (size - 16)
    return ("{" + ws + json.dumps(body)[1:]).encode()


# -- bounds ----------------------------------------------------------------------------------------

def test_padded_copies_of_one_lookup_are_one_memo_entry(make_client):
    c = make_client(parse_memo_entries=8, parse_memo_bytes=200_000)
    fast = c.app.fast_path
    body = {"device": DEVICE, "problem": problem()}
    first = c.post("/v1/lookup", json=body).json()
    for i in range(20):
        r = c.post("/v1/lookup", content=_padded(body, i, 2000), headers=JSON)
        assert r.status_code == 200 and r.json() == first
    assert len(fast._memo) == 1
    for i in range(30):  # distinct problems: the memo keeps its bounds
        assert c.post("/v1/lookup", json={"device": DEVICE, "problem": problem(64 * (i + 1))}).status_code == 200
        assert len(fast._memo) <= 8 and fast._memo.nbytes <= 200_000
    batch = {"device": DEVICE, "problems": [problem(64 * (i + 1)) for i in range(40)]}
    assert c.post("/v1/lookup/batch", json=batch).status_code == 200
    assert fast._batch_memo.nbytes <= 200_000 and len(fast._batch_memo) <= 8


def test_the_routes_parse_memo_is_bounded_in_entries_and_bytes():
    memo = ParseMemo(max_entries=4, max_bytes=10_000)
    for i in range(50):
        memo.problem(problem(64 * (i + 1)))
        memo.key(Problem.from_dict(problem(64 * (i + 1))))
        memo.device({**DEVICE, "num_devices": i + 1})
        for table in (memo._parsed, memo._keys):
            assert len(table) <= 4 and table.nbytes <= 10_000
    small = ParseMemo(max_entries=100, max_bytes=3_000)  # bytes bind before entries
    for i in range(50):
        small.problem(problem(64 * (i + 1)))
    assert 0 < len(small._parsed) < 50 and small._parsed.nbytes <= 3_000


def test_answer_cache_nearest_index_and_demand_are_bounded(make_client, post_results):
    c = make_client(lookup_cache_entries=5, nearest_max_groups=3, demand_max_rows=10)
    state = c.app.state.autotuner
    engine = state.lookups
    for x in (2, 4, 8):  # a tuned problem per group (mesh size 2, 4, 8)
        post_results(c, problem(x=x))
    devices = [{**DEVICE, "num_devices": n} for n in (8, 16, 32)]
    for d in devices:
        for x in (2, 4, 8, 16, 32):
            for m in (512, 1024, 4096):
                assert c.post("/v1/lookup", json={"device": d, "problem": problem(m, x=x)}).status_code == 200
            engine.nearest.wait()
            assert len(engine._answers) <= 5
            assert len(engine.nearest._groups) <= 3
    state.lookups.demand.flush()
    rows = c.get("/v1/demand", params={"limit": 100}).json()["items"]
    assert 0 < len(rows) <= 10


def test_demand_rows_keep_the_most_missed(database):
    dev = Device.from_dict(DEVICE)
    with database.session() as s:
        popular = Problem.from_dict(problem())
        repo.record_misses(s, [(dev.key, DEVICE, popular.key, popular.canonical(), 50)])
        for i in range(30):
            p = Problem.from_dict(problem(64 * (i + 1)))
            repo.record_misses(s, [(dev.key, DEVICE, p.key, p.canonical(), 1)])
            repo.trim_demand(s, 10)
        rows = repo.list_demand(s, 100)
        assert len(rows) <= 10 and rows[0].problem_key == popular.key and rows[0].count == 50
        repo.record_misses(s, [(dev.key, DEVICE, popular.key, popular.canonical(), 2**31 - 1)])
        assert repo.list_demand(s, 1)[0].count == 2**31 - 1  # a count saturates at the column's range
    recorder = DemandRecorder(database, max_rows=10, max_pending=3)
    recorder._thread = threading.current_thread()  # "running": add() leaves the writes to it
    for i in range(8):
        p = Problem.from_dict(problem(64 * (i + 1)))
        recorder.add(dev, dev.key, {p.key: (p, 2)})
    assert len(recorder._pending) == 3 and recorder.dropped == 10
    assert recorder.flush() == 6 and recorder.dropped == 0


@pytest.mark.slow
def test_padded_lookups_do_not_grow_the_servers_memory(sqlite_url):
    """1500 lookups of one problem, each padded with different whitespace to ~300 KB, against
    a real uvicorn process: its resident set grows by less than 150 MB (each body was kept
    before: 450 MB)."""
    body = {"device": DEVICE, "problem": problem()}
    with live_server(sqlite_url) as url:
        pid = int(httpx.post(f"{url}/v1/lookup", json=body, trust_env=False).headers[PROCESS_HEADER])

        def send(i: int) -> tuple[int, str]:
            with httpx.Client(base_url=url, trust_env=False, timeout=30) as h:
                r = h.post("/v1/lookup", content=_padded(body, i, 300_000), headers=JSON)
                return r.status_code, r.json()["problem_key"]

        with ThreadPoolExecutor(4) as pool:
            warm = list(pool.map(send, range(40)))  # the allocator's arenas for such bodies
            before = _rss(pid)
            got = list(pool.map(send, range(40, 1540)))
            after = _rss(pid)
    assert {s for s, _ in warm + got} == {200} and len({k for _, k in got}) == 1
    assert after - before < 150 * 2**20, (before, after)


# -- limits ----------------------------------------------------------------------------------------

def _hostile() -> list[tuple[str, dict[str, Any], dict[str, Any], list[Any]]]:
    """(name, device, problem, the loc the 422 names under the problem/device)."""
    eq = problem()
    eq["equation"] = "m" * 100_000
    axes = problem()
    axes["mesh"] = {"x": 8, **{f"a{i}": 1 for i in range(4999)}}
    dtype = problem(dtype="float" + "9" * 5000)
    return [
        ("axis size 2^63", DEVICE, problem(2**63, x=2**63), ["problem", "mesh", "x"]),
        ("dimension 2^62", DEVICE, problem(2**62), ["problem", "lhs", "shape", 0]),
        ("100k-character equation", DEVICE, eq, ["problem", "equation"]),
        ("5000 mesh axes", DEVICE, axes, ["problem", "mesh"]),
        ("200k-character device kind", {**DEVICE, "device_kind": "k" * 200_000}, problem(),
         ["device", "device_kind"]),
        ("absurd dtype", DEVICE, dtype, ["problem", "dtype"]),
        ("device count 2^63", {**DEVICE, "num_devices": 2**63}, problem(), ["device", "num_devices"]),
        ("mesh size 2^31 (PostgreSQL's integer)", DEVICE, problem(2**31, x=2**31), ["problem", "mesh", "x"]),
    ]


def _requests() -> list[tuple[str, str, dict[str, Any], list[Any]]]:
    """(name, path, body, loc) of every hostile request: single, batched, results, jobs."""
    out = []
    for name, device, p, loc in _hostile():
        at = loc[1:] if loc[0] == "problem" else None
        out.append((name, "/v1/lookup", {"device": device, "problem": p}, ["body", *loc]))
        out.append((f"{name} (batch)", "/v1/lookup/batch",
                    {"device": device, "problems": [problem(), p, problem(64, 64, 64)]},
                    ["body", "problems", 1, *at] if at is not None else ["body", *loc]))
        out.append((f"{name} (results)", "/v1/results",
                    {"device": device, "problem": p, "measurements": measurements()}, ["body", *loc]))
        out.append((f"{name} (jobs)", "/v1/jobs", {"device": device, "problem": p}, ["body", *loc]))
    return out


def test_hostile_lookups_are_422s_beside_valid_ones(db_url):
    """Hostile requests (single, batched, results, jobs) sent while valid lookups run beside them
    against a real uvicorn process: no 5xx, each hostile one a 422 naming its field, every valid
    one answered 200 (on a device with a winner, so that a lookup reaches the nearest search)."""
    with live_server(db_url, env={"AUTOTUNER_WRITE_TOKENS": WRITE_TOKEN}) as url:
        with httpx.Client(base_url=url, trust_env=False, timeout=60) as h:
            r = h.post("/v1/results", headers=WRITE_HEADERS,
                       json={"device": DEVICE, "problem": problem(), "measurements": measurements()})
            assert r.status_code == 201, r.text
        hostile = _requests()

        def attack(case: tuple[str, str, dict[str, Any], list[Any]]) -> tuple[str, int, Any, list[Any]]:
            name, path, body, loc = case
            with httpx.Client(base_url=url, trust_env=False, timeout=60) as h:
                r = h.post(path, json=body, headers=WRITE_HEADERS)
                return name, r.status_code, r.json(), loc

        def valid(i: int) -> int:
            with httpx.Client(base_url=url, trust_env=False, timeout=60) as h:
                if i % 5 == 0:
                    body = {"device": DEVICE, "problems": [problem(64 * (i + 1)), problem(), problem(x=4)]}
                    return h.post("/v1/lookup/batch", json=body).status_code
                return h.post("/v1/lookup", json={"device": DEVICE, "problem": problem(128 * (i % 7 + 1))}).status_code

        with ThreadPoolExecutor(6) as pool:  # each hostile request between two valid ones
            good, evil = [], []
            for i, case in enumerate(hostile):
                good.append(pool.submit(valid, i))
                evil.append(pool.submit(attack, case))
            good += [pool.submit(valid, i) for i in range(len(hostile), len(hostile) + 10)]
            statuses = [f.result() for f in good]
            bad = [f.result() for f in evil]
    assert statuses == [200] * len(statuses)
    for name, status, body, loc in bad:
        assert status == 422, (name, status, str(body)[:300])
        assert any(d["loc"][: len(loc)] == loc for d in body["detail"]), (name, loc, str(body)[:300])


# -- isolation -------------------------------------------------------------------------------------

def test_a_failing_problem_fails_only_its_own_coalesced_lookup():
    device = Device.from_dict(DEVICE)

    async def resolve(device: Device, dkey: str, problems: dict[str, Any], provisional: set[str]) -> dict[str, Any]:
        if "bad" in problems:
            raise OverflowError("Python int too large to convert to SQLite INTEGER")
        return {k: f"answer {k}" for k in problems}

    async def main() -> list[Any]:
        c = _Coalescer(resolve)
        p = Problem.from_dict(problem())
        return await asyncio.gather(*(c.get(device, "d", k, p) for k in ("a", "bad", "c", "bad")),
                                    return_exceptions=True)

    a, bad, c, bad2 = asyncio.run(main())
    assert a == ("answer a", False) and c == ("answer c", False)
    assert isinstance(bad, OverflowError) and isinstance(bad2, OverflowError)


def test_an_engine_bug_is_a_500_for_that_request_alone_logged_once(make_client, caplog):
    BAD = 4096

    def model(p: Problem, d: Device) -> None:
        if p.lhs.shape[0] == BAD:
            raise RuntimeError("a bug in the cost model")
        return None

    c = make_client(model=model)
    bodies = [{"device": DEVICE, "problem": problem(m)} for m in (512, BAD, 1024, BAD, 2048)]
    with caplog.at_level(logging.ERROR, logger="service"):
        with ThreadPoolExecutor(5) as pool:
            got = list(pool.map(lambda b: c.post("/v1/lookup", json=b), bodies))
        sent_id = c.post("/v1/lookup", json=bodies[1], headers={"x-request-id": "req-42"})
    assert [r.status_code for r in got] == [200, 500, 200, 500, 200]
    ids = [r.json()["request_id"] for r in (got[1], got[3], sent_id)]
    assert ids[2] == "req-42" and len(set(ids)) == 3
    assert all(r.headers["x-request-id"] == i for r, i in zip((got[1], got[3], sent_id), ids, strict=True))
    lines = [rec for rec in caplog.records if rec.name == "service"]
    assert len(lines) == 3 and all(sum(i in rec.getMessage() for rec in lines) == 1 for i in ids)
    assert sum(rec.exc_info is not None for rec in lines) == 1  # one traceback, not one per request
