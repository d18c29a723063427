"""Cache coherence: a winner stored by any process is served by every uvicorn worker after
one poll of its generation check (service/coherence.py, db/_changes.py), on SQLite and
PostgreSQL.

The workers keep answers for an hour (AUTOTUNER_LOOKUP_CACHE_SECONDS=3600), so only the
generation poll can make them serve the new winner. The multi-worker test runs
:func:`service.testing.coherence_probe_app`, whose workers poll only when the test asks them
to: it counts the polls each worker needed, not seconds. How soon a poll comes is
``AUTOTUNER_LOOKUP_POLL_SECONDS`` (checked to reach the watcher below); figures of speed
belong in bench/ (bench/load.py).
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

RING2 = {**RING, "chunks": 2}
RING4 = {**RING, "chunks": 4}
BASELINE = Strategy.baseline().to_dict()
PROBE = "service.testing:coherence_probe_app"


def _items(ms: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """API measurements as ``store.save`` items (with their strategy keys)."""
    return [{**m, "strategy_key": Strategy.from_dict(m["strategy"]).key} for m in ms]


def _ask(workers: dict[str, httpx.Client], body: dict[str, Any]) -> dict[str, Any]:
    """The strategy each worker (by pid) answers, asked over its own connection."""
    got: dict[str, Any] = {}
    for pid, c in workers.items():
        r = c.post("/v1/lookup", json=body)
        assert r.status_code == 200, r.text
        assert r.headers[PROCESS_HEADER] == pid  # a keep-alive connection stays with its worker
        got[pid] = r.json()["strategy"]
    return got


def _workers(url: str, n: int) -> dict[str, httpx.Client]:
    """One keep-alive connection per worker, by the worker's pid."""
    workers: dict[str, httpx.Client] = {}
    extra: list[httpx.Client] = []
    for _ in range(200):  # a bound, not a speed: the kernel spreads connections over workers
        if len(workers) == n:
            break
        c = httpx.Client(base_url=url, trust_env=False, timeout=30)
        pid = c.get("/_test/coherence").json()["pid"]
        if pid in workers:
            extra.append(c)
        else:
            workers[pid] = c
    for c in extra:
        c.close()
    assert len(workers) == n, f"only workers {sorted(workers)} accepted connections"
    return workers


def _polls_until_served(workers: dict[str, httpx.Client], body: dict[str, Any],
                        want: dict[str, Any], limit: int = 3) -> dict[str, int]:
    """How many polls of its generation check each worker needed before it answered ``want``:
    ask every worker, make each one that still answers something else poll once, repeat."""
    polls = dict.fromkeys(workers, 0)
    for _ in range(limit + 1):
        late = [pid for pid, strategy in _ask(workers, body).items() if strategy != want]
        if not late:
            return polls
        for pid in late:
            r = workers[pid].post("/_test/coherence/poll")
            assert r.status_code == 200 and r.json()["pid"] == pid, r.text
            polls[pid] += 1
    raise AssertionError(f"workers {late} still serve an older winner after {polls} polls")


@pytest.mark.slow
def test_a_new_winner_is_served_by_every_worker_after_one_poll(db_url: str) -> None:
    body = {"device": DEVICE, "problem": problem()}
    env = {"AUTOTUNER_WRITE_TOKENS": WRITE_TOKEN, "AUTOTUNER_LOOKUP_CACHE_SECONDS": "3600"}
    with live_server(db_url, workers=2, env=env, app=PROBE, factory=True) as url:
        workers = _workers(url, 2)
        a, b = workers
        try:
            def post(worker: str, strategy: dict[str, Any], ratio: float) -> None:
                r = workers[worker].post("/v1/results", headers=WRITE_HEADERS, json={
                    **body, "measurements": measurements(ratio, strategy)})
                assert r.status_code == 201, r.text
                assert r.json()["winner"]["strategy"] == strategy

            # every worker answers the baseline, and keeps it (cached for an hour)
            assert _ask(workers, body) == {a: BASELINE, b: BASELINE}
            assert _polls_until_served(workers, body, BASELINE) == {a: 0, b: 0}

            # a winner stored through worker a: a drops its answer at once; b serves the old
            # one until its next poll, and the new one after it
            post(a, RING, 1.25)
            assert _polls_until_served(workers, body, RING) == {a: 0, b: 1}
            # a faster one through worker b: the other way round
            post(b, RING2, 2.0)
            assert _polls_until_served(workers, body, RING2) == {a: 1, b: 0}

            # and one a tuner stores in the database directly, from outside the service:
            # every worker needs exactly one poll
            with Database(db_url) as database:
                store.save(database, Device.from_dict(DEVICE), Problem.from_dict(problem()),
                           _items(measurements(3.0, RING4)))
            assert _polls_until_served(workers, body, RING4) == {a: 1, b: 1}
            # the workers polled only when asked (so the counts above are all the polls)
            assert {pid: c.get("/_test/coherence").json()["polls"] for pid, c in workers.items()} \
                == {a: 2, b: 2}
        finally:
            for c in workers.values():
                c.close()


def test_the_app_polls_for_changes_in_the_background(db_url: str, make_client: Any) -> None:
    """The watcher that create_app starts polls on its own thread at the configured
    lookup_poll_seconds: a winner stored from outside the process is served once its polls see
    it, with no write through this process and nobody asking it to poll."""
    client = make_client(lookup_cache_seconds=3600, lookup_poll_seconds=0.05)
    watcher = client.app.state.autotuner.watcher
    assert watcher.running and watcher.interval == 0.05
    body = {"device": DEVICE, "problem": problem()}
    assert client.post("/v1/lookup", json=body).json()["strategy"] == BASELINE
    polls = watcher.polls
    with Database(db_url) as database:
        store.save(database, Device.from_dict(DEVICE), Problem.from_dict(problem()),
                   _items(measurements(1.25)))
    deadline = time.monotonic() + 60  # a hang guard, not a speed bound
    while (got := client.post("/v1/lookup", json=body).json()["strategy"]) != RING:
        assert time.monotonic() < deadline, f"still {got} after {watcher.polls - polls} polls"
        time.sleep(0.02)
    assert watcher.polls > polls


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
