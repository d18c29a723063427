"""Limits on anonymous lookups (service/ratelimit.py): a lookup without a valid token is held to
a token bucket per address, counted in problems, and to a cap on anonymous batches running at
once; past either it is a 429 naming the limit and its setting, with Retry-After. A request with
a valid token (a settings token, or one of the tokens table) is never limited, and no lookup,
limited or not, writes to the database."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from sqlalchemy import event

from autotuner import Device, Problem
from autotuner.settings import Settings
from db import Database
from db import repository as repo
from service import create_app
from service.ratelimit import AnonymousLimiter
from service.testing import DEVICE, HOST, WRITE_HEADERS, WRITE_TOKEN, free_port, problem

STORED_READ, STORED_WRITE, REVOKED = "stored-read-token", "stored-write-token", "stored-revoked-token"
ROUTES_ONLY = {"content-type": "application/x-routes+json"}  # skipped by the fast path
TINY_RATE = 1e-6  # problems/s: the bucket does not refill while a test runs
BENCH = Path(__file__).resolve().parents[2] / "bench"


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _batch(n: int, first: int = 0) -> dict[str, Any]:
    """A batch of ``n`` distinct untuned problems."""
    return {"device": DEVICE, "problems": [problem(64 * (first + i + 1)) for i in range(n)]}


def _store_tokens(database: Database) -> None:
    with database.session() as s:
        repo.add_token(s, "reader", STORED_READ, "read")
        repo.add_token(s, "writer", STORED_WRITE, "write")
        revoked = repo.add_token(s, "old", REVOKED, "read")
    with database.session() as s:
        repo.revoke_token(s, revoked.id)


# -- the accounting ----------------------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_bucket_counts_problems_per_address_and_refills():
    clock = Clock()
    lim = AnonymousLimiter(rate=2.0, burst=10, concurrency=0, max_clients=100, clock=clock)
    assert lim.admit("a", 6, batch=True) is None
    refused = lim.admit("a", 6, batch=True)  # 4 left
    assert refused is not None and refused.limit == "rate" and refused.retry_after == 1
    assert "AUTOTUNER_ANON_LOOKUP_RATE" in refused.detail and "AUTOTUNER_ANON_LOOKUP_BURST" in refused.detail
    assert lim.admit("b", 10, batch=True) is None  # another address: its own bucket
    clock.now += 1.0  # +2
    assert lim.admit("a", 6, batch=True) is None
    assert lim.admit("a", 1, batch=False) is not None  # empty
    refused = lim.admit("a", 1000, batch=True)  # larger than the burst: costs the whole burst
    assert refused is not None and refused.retry_after == 5
    clock.now += 5.0
    assert lim.admit("a", 1000, batch=True) is None
    assert lim.admit("a", 1, batch=False) is not None


def test_the_concurrency_cap_counts_running_batches_and_charges_nothing_it_refuses():
    clock = Clock()
    lim = AnonymousLimiter(rate=1.0, burst=100, concurrency=1, max_clients=100, clock=clock)
    assert lim.admit("a", 10, batch=True) is None
    refused = lim.admit("a", 10, batch=True)
    assert refused is not None and refused.limit == "concurrency" and refused.retry_after == 1
    assert "AUTOTUNER_ANON_BATCH_CONCURRENCY" in refused.detail
    assert lim.buckets["a"][0] == 90  # the refused batch cost nothing
    assert lim.admit("a", 1, batch=False) is None  # single lookups are not capped
    lim.done()
    assert lim.admit("a", 10, batch=True) is None and lim.running == 1
    off = AnonymousLimiter(rate=0.0, burst=1, concurrency=0, max_clients=1, clock=clock)
    assert not off.active
    assert all(off.admit("a", 1000, batch=True) is None for _ in range(10))


def test_the_bucket_table_is_bounded():
    lim = AnonymousLimiter(rate=1.0, burst=10, concurrency=0, max_clients=50, clock=Clock())
    for i in range(10_000):  # a scan from many addresses
        lim.admit(f"10.0.{i // 256}.{i % 256}", 1, batch=False)
        assert len(lim.buckets) <= 50
    assert "10.0.39.15" in lim.buckets and "10.0.0.0" not in lim.buckets  # the least recent went


# -- the service -------------------------------------------------------------------------------------

def test_anonymous_batches_past_the_burst_are_429s_token_holders_never(make_client, database):
    _store_tokens(database)
    c = make_client(anon_lookup_burst=100, anon_lookup_rate=TINY_RATE)
    assert c.post("/v1/lookup/batch", json=_batch(40)).status_code == 200
    assert c.post("/v1/lookup/batch", json=_batch(40, 40)).status_code == 200  # 20 problems left
    refused = [c.post("/v1/lookup/batch", json=_batch(40, 80)),
               c.post("/v1/lookup/batch", content=json.dumps(_batch(40, 80)), headers=ROUTES_ONLY),
               c.post("/v1/lookup/batch", json=_batch(40, 80), headers=_bearer("not-a-token")),
               c.post("/v1/lookup/batch", json=_batch(40, 80), headers=_bearer(REVOKED))]
    for r in refused:
        assert r.status_code == 429, r.text[:300]
        assert r.headers["content-type"] == "application/json"
        assert r.json().keys() == {"detail"} and "AUTOTUNER_ANON_LOOKUP_RATE" in r.json()["detail"]
        assert 1 <= int(r.headers["retry-after"]) <= 20_000_000
    assert c.post("/v1/lookup", json={"device": DEVICE, "problem": problem(64)}).status_code == 200  # costs 1
    # a valid token in the same burst: never limited, however much it asks
    for i in range(4):
        for headers in (WRITE_HEADERS, _bearer(STORED_READ), _bearer(STORED_WRITE)):
            r = c.post("/v1/lookup/batch", json=_batch(40, 40 * i), headers=headers)
            assert r.status_code == 200, r.text[:300]
            assert len(r.json()["results"]) == 40
        r = c.post("/v1/lookup/batch", content=json.dumps(_batch(40, 40 * i)),
                   headers={**ROUTES_ONLY, **_bearer(STORED_READ)})
        assert r.status_code == 200, r.text[:300]
    assert c.post("/v1/lookup/batch", json=_batch(40)).status_code == 429  # still empty for the anonymous
    metrics = c.get("/metrics").text
    assert 'autotuner_lookups_limited_total{limit="rate"} 5.0' in metrics
    assert 'route="/v1/lookup/batch",status="429"} 5.0' in metrics


def test_a_running_anonymous_batch_holds_the_cap_tokens_pass(make_client, database):
    """Cap 1: while one anonymous batch is held inside the cost model, a second anonymous batch
    is a 429 and batches with a valid token are answered."""
    _store_tokens(database)
    held_m = 64 * 999
    entered, release = threading.Event(), threading.Event()

    def model(p: Problem, d: Device) -> None:
        if p.lhs.shape[0] == held_m:
            entered.set()
            release.wait(60)  # a safety net: the test releases it
        return None

    c = make_client(model=model, anon_batch_concurrency=1)
    try:
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(c.post, "/v1/lookup/batch",
                               json={"device": DEVICE, "problems": [problem(held_m), problem(64)]})
            assert entered.wait(30), "the first batch never reached the cost model"
            r = c.post("/v1/lookup/batch", json=_batch(3))
            assert r.status_code == 429, r.text[:300]
            assert "AUTOTUNER_ANON_BATCH_CONCURRENCY" in r.json()["detail"] and r.headers["retry-after"] == "1"
            assert c.post("/v1/lookup/batch", json=_batch(3), headers=WRITE_HEADERS).status_code == 200
            assert c.post("/v1/lookup/batch", json=_batch(3), headers=_bearer(STORED_READ)).status_code == 200
            assert c.post("/v1/lookup", json={"device": DEVICE, "problem": problem(128)}).status_code == 200
            assert not held.done()
            release.set()
            assert held.result(timeout=30).status_code == 200
    finally:
        release.set()
    assert c.post("/v1/lookup/batch", json=_batch(3)).status_code == 200  # the slot is free again
    assert 'autotuner_lookups_limited_total{limit="concurrency"} 1.0' in c.get("/metrics").text


# -- under load, on a real server ----------------------------------------------------------------------

WRITE_SQL = re.compile(r"^\s*(INSERT|UPDATE|DELETE|REPLACE|MERGE|UPSERT)\b|^\s*WITH\b.*\b(INSERT|UPDATE|DELETE)\b",
                       re.IGNORECASE | re.DOTALL)


@contextmanager
def _served(app: Any) -> Iterator[str]:
    """``app`` under a real uvicorn server on 127.0.0.1, in a thread of this process (so that
    a listener on its database's engine sees every statement the server sends)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host=HOST, port=port, log_level="warning",
                                           access_log=False, lifespan="on"))
    thread = threading.Thread(target=server.run, name="uvicorn-under-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://{HOST}:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.mark.slow
def test_anonymous_flood_beside_valid_lookups_on_a_live_server(db_url):
    """16 anonymous batches of 50 problems beside 24 valid lookups (settings and stored tokens,
    batches and singles), all at once against uvicorn: every valid one 200, the anonymous ones
    exactly what the burst allows (2 x 50) and 429 past it, and not one SQL write while they run
    (the misses wait in memory for the demand writer, which is paused here)."""
    database = Database(db_url)
    _store_tokens(database)
    settings = Settings(db_url=db_url, write_tokens=[WRITE_TOKEN], anon_lookup_burst=100,
                        anon_lookup_rate=TINY_RATE, anon_batch_concurrency=2)
    app = create_app(settings, database=database)
    demand = app.state.autotuner.lookups.demand
    demand.interval = 3600.0  # the background writer: not during the load
    statements: list[tuple[str, str]] = []

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append((threading.current_thread().name, statement))

    try:
        with _served(app) as url:
            def send(kind: str, i: int) -> tuple[str, int, str]:
                headers = {"anonymous": {}, "settings": WRITE_HEADERS,
                           "stored": _bearer(STORED_READ)}[kind.split()[0]]
                with httpx.Client(base_url=url, trust_env=False, timeout=60) as h:
                    if kind.endswith("single"):
                        r = h.post("/v1/lookup", json={"device": DEVICE, "problem": problem(64 * (i + 1))},
                                   headers=headers)
                    else:
                        r = h.post("/v1/lookup/batch", json=_batch(50, 50 * i), headers=headers)
                    return kind, r.status_code, r.text

            work = [("anonymous", i) for i in range(16)] + [("settings", i) for i in range(8)] + \
                [("stored", i) for i in range(8)] + [("settings single", i) for i in range(8)]
            order = sorted(range(len(work)), key=lambda j: (j * 7) % len(work))  # interleaved
            event.listen(database.engine, "before_cursor_execute", seen)
            with ThreadPoolExecutor(8) as pool:
                got = list(pool.map(lambda j: send(*work[j]), order))
            during, pending = list(statements), len(demand._pending)
            demand.flush()  # what the background writer does: the listener sees its writes
            event.remove(database.engine, "before_cursor_execute", seen)
            written = [s for _, s in statements[len(during):] if WRITE_SQL.match(s)]
            with httpx.Client(base_url=url, trust_env=False) as h:
                demand_rows = h.get("/v1/demand").json()["items"]
    finally:
        database.dispose()
    valid = [(k, st, text[:200]) for k, st, text in got if k != "anonymous"]
    assert all(st == 200 for _, st, _ in valid), valid
    anonymous = [(st, text) for k, st, text in got if k == "anonymous"]
    assert sorted(st for st, _ in anonymous) == [200] * 2 + [429] * 14, [t[:200] for _, t in anonymous]
    assert all("AUTOTUNER_ANON_" in json.loads(t)["detail"] for st, t in anonymous if st == 429)
    assert len(during) > 0, "the lookups read nothing: the listener saw no statement"
    writes = [(thread, s) for thread, s in during if WRITE_SQL.match(s)]
    assert writes == [], writes[:5]
    assert pending > 0, "the misses were not counted in memory"
    assert written, "the listener saw no write even from the demand writer: it counts nothing"
    assert demand_rows, "the misses never reached the demand table"


@pytest.mark.slow
def test_the_load_benchmark_floods_at_a_small_rate(tmp_path):
    out = subprocess.run([sys.executable, str(BENCH / "load.py"), "--db", str(tmp_path / "bench.db"),
                          "--fill", "300", "--seconds", "1", "--workers", "1", "--rate", "50", "--batch", "50",
                          "--anonymous-flood", "4", "--json", "--client", "httpx"],   # (the other generator)
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "AUTOTUNER_ANON_LOOKUP_BURST": "100",
                              "AUTOTUNER_ANON_LOOKUP_RATE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["phase"] for r in rows] == ["valid, alone", "valid, beside the anonymous flood",
                                          "valid, alone again"], out.stdout
    alone, flooded, again = rows
    assert alone["errors"] == flooded["errors"] == again["errors"] == 0
    assert alone["requests"] > 0 and flooded["requests"] > 0 and again["requests"] > 0
    assert alone["anonymous_sent"] == again["anonymous_sent"] == 0 and flooded["anonymous_sent"] > 0
    assert flooded["anonymous_429"] > 0, out.stdout
    assert "p99 ms" in out.stdout and "anon 429" in out.stdout
