"""Cache coherence: a winner stored by any process is served by every uvicorn worker within
1 s (service/coherence.py, db/_changes.py), on SQLite and PostgreSQL.

The workers keep answers for an hour (AUTOTUNER_LOOKUP_CACHE_SECONDS=3600), so only the
generation poll can make them serve the new winner in time.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from autotuner import Device, Problem, Strategy
from autotuner.tune import store
from db import Database
from service.coherence import ChangeWatcher
from service.routes.lookup import PROCESS_HEADER
from service.testing import (
    DEVICE,
    RING,
    WRITE_HEADERS,
    WRITE_TOKEN,
    live_server,
    measurements,
    problem,
)

BOUND_S = 1.0
RING2 = {**RING, "chunks": 2}
RING4 = {**RING, "chunks": 4}


def _items(ms: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """API measurements as ``store.save`` items (with their strategy keys)."""
    return [{**m, "strategy_key": Strategy.from_dict(m["strategy"]).key} for m in ms]


def _ask(clients: list[httpx.Client], body: dict[str, Any]) -> dict[str, str]:
    """The strategy each worker (by pid) answered, asking over every connection."""
    got: dict[str, str] = {}
    for c in clients:
        r = c.post("/v1/lookup", json=body)
        assert r.status_code == 200, r.text
        got[r.headers[PROCESS_HEADER]] = repr(r.json()["strategy"])
    return got


def _connections(url: str, workers: int) -> list[httpx.Client]:
    """Keep-alive connections until every worker holds at least one."""
    clients: list[httpx.Client] = []
    pids: set[str] = set()
    deadline = time.monotonic() + 30
    while len(pids) < workers:
        assert time.monotonic() < deadline, f"only workers {pids} accepted connections"
        c = httpx.Client(base_url=url, trust_env=False, timeout=10)
        clients.append(c)
        pids.add(c.get("/healthz").headers.get(PROCESS_HEADER, "")
                 or c.post("/v1/lookup", json={"device": DEVICE, "problem": problem(64, 64, 64)})
                 .headers[PROCESS_HEADER])
    return clients


def _served_everywhere_within(clients: list[httpx.Client], body: dict[str, Any], want: dict[str, Any],
                              workers: int, since: float) -> float:
    """Seconds from ``since`` until every worker answered ``want``."""
    late: dict[str, float] = {}
    while time.monotonic() - since < 5 * BOUND_S:
        for pid, strategy in _ask(clients, body).items():
            if strategy == repr(want):
                late.setdefault(pid, time.monotonic() - since)
        if len(late) == workers:
            return max(late.values())
        time.sleep(0.02)
    raise AssertionError(f"after {5 * BOUND_S} s only workers {sorted(late)} serve the new winner")


@pytest.mark.slow
def test_a_new_winner_is_served_by_every_worker_within_a_second(db_url: str) -> None:
    workers = 2
    body = {"device": DEVICE, "problem": problem()}
    env = {"AUTOTUNER_WRITE_TOKENS": WRITE_TOKEN, "AUTOTUNER_LOOKUP_CACHE_SECONDS": "3600",
           "AUTOTUNER_LOOKUP_POLL_SECONDS": "0.2"}
    with live_server(db_url, workers=workers, env=env) as url:
        clients = _connections(url, workers)
        try:
            def post(strategy: dict[str, Any], ratio: float) -> None:
                r = clients[0].post("/v1/results", headers=WRITE_HEADERS, json={
                    **body, "measurements": measurements(ratio, strategy)})
                assert r.status_code == 201, r.text
                assert r.json()["winner"]["strategy"] == strategy

            post(RING, 1.25)
            # every worker answers RING, and keeps it (cached for an hour)
            assert _served_everywhere_within(clients, body, RING, workers, time.monotonic()) < 5
            assert set(_ask(clients, body).values()) == {repr(RING)}

            # a faster strategy, stored through the API (one worker gets it)
            t = time.monotonic()
            post(RING2, 2.0)
            took = _served_everywhere_within(clients, body, RING2, workers, t)
            assert took <= BOUND_S, f"the new winner reached every worker after {took:.2f} s"

            # and one a tuner stores in the database directly, from outside the service
            with Database(db_url) as database:
                t = time.monotonic()
                store.save(database, Device.from_dict(DEVICE), Problem.from_dict(problem()),
                           _items(measurements(3.0, RING4)))
            took = _served_everywhere_within(clients, body, RING4, workers, t)
            assert took <= BOUND_S, f"the new winner reached every worker after {took:.2f} s"
        finally:
            for c in clients:
                c.close()


def test_the_watcher_hands_over_exactly_what_changed(db_url: str) -> None:
    seen: list[Any] = []
    with Database(db_url) as database:
        watcher = ChangeWatcher(database, seen.append)
        watcher.poll()  # the first poll: nothing cached predates it
        assert seen == [None]
        assert watcher.poll() == 0
        device, p = Device.from_dict(DEVICE), Problem.from_dict(problem())
        store.save(database, device, p, _items(measurements(1.25)))
        assert watcher.poll() == 1
        assert seen[-1] == ((device.key, p.key),)
        assert watcher.poll() == 0 and len(seen) == 2
