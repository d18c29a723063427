"""Anonymous batch lookups are paced (service/pacing.py): their work runs one slice at a time
across every anonymous batch of a process, each slice followed by a rest that keeps them to a
share of the process's time; lookups with a valid token are not paced. And SQLite single
lookups read their exact matches on the event loop (service/lookups.py, ``inline_reads``)."""

from __future__ import annotations

import asyncio
import json
import math
import threading
from typing import Any

import pytest

import service.lookups as lookups_module
from service.pacing import Pacer
from service.testing import DEVICE, WRITE_HEADERS, measurements, problem

ROUTES_ONLY = {"content-type": "application/x-routes+json"}  # skipped by the fast path


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(round(seconds, 9))
        self.now += seconds


def test_each_slice_waits_out_the_rest_the_one_before_it_left():
    clock = Clock()
    pacer = Pacer(0.25, 4, sleep=clock.sleep, clock=clock)

    def work(seconds: float) -> float:
        clock.now += seconds
        return seconds

    async def main() -> None:
        assert await pacer.run(work, 1.0) == 1.0  # an idle pacer: at once
        assert await pacer.run(work, 2.0) == 2.0  # after 3 x 1.0 of rest
        clock.now += 100.0  # idle for longer than the rest: at once
        await pacer.run(work, 0.5)
        await pacer.run(work, 0.5)

    asyncio.run(main())
    assert clock.slept == [3.0, 1.5]
    assert pacer.slices == 4 and pacer.busy_seconds == 4.0
    assert pacer.slices_of(list(range(10))) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_slices_of_concurrent_batches_never_overlap():
    pacer = Pacer(0.5, 1)
    running, most = 0, 0
    lock = threading.Lock()

    def work() -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        threading.Event().wait(0.002)
        with lock:
            running -= 1

    async def batch() -> None:
        for _ in range(5):
            await pacer.run(work)

    async def main() -> None:
        await asyncio.gather(*(batch() for _ in range(4)))

    asyncio.run(main())
    assert most == 1 and pacer.slices == 20


def test_no_rest_while_nothing_else_waits():
    clock, waiting = Clock(), [False]
    pacer = Pacer(0.1, 1, busy=lambda: waiting[0], sleep=clock.sleep, clock=clock)

    def work() -> None:
        clock.now += 1.0

    async def main() -> None:
        await pacer.run(work)
        await pacer.run(work)  # nothing waits: at once
        waiting[0] = True
        await pacer.run(work)  # a lookup waits: the rest its predecessor left, 9 x 1.0
        waiting[0] = False
        await pacer.run(work)

    asyncio.run(main())
    assert clock.slept == [9.0]


@pytest.mark.parametrize("share,size", [(0.0, 1), (1.5, 1), (0.5, 0)])
def test_a_pacer_refuses_a_share_or_slice_out_of_range(share: float, size: int):
    with pytest.raises(ValueError, match="share|slice"):
        Pacer(share, size)


def _batch(n: int) -> dict[str, Any]:
    return {"device": DEVICE, "problems": [problem(64 * (i + 1)) for i in range(n)]}


def test_anonymous_batches_are_answered_in_slices_token_holders_in_one_piece(make_client):
    c = make_client(anon_batch_slice=4, anon_batch_share=0.5)
    pacer = c.app.anonymous_limit.pacer
    n = 10
    slices = math.ceil(n / 4)
    with_token = c.post("/v1/lookup/batch", json=_batch(n), headers=WRITE_HEADERS)
    assert with_token.status_code == 200 and pacer.slices == 0
    anonymous = c.post("/v1/lookup/batch", json=_batch(n))
    assert anonymous.status_code == 200
    assert anonymous.json() == with_token.json()  # the same answers, however they were paced
    # one slice: the body, found in the parse memo (the token's batch was the same body), and no
    # problem to resolve (its answers are in the cache)
    assert pacer.slices == 1
    fresh = {"device": DEVICE, "problems": [problem(64 * (i + 1), k=2048) for i in range(n)]}
    assert c.post("/v1/lookup/batch", json=fresh).status_code == 200
    assert pacer.slices == 1 + (1 + slices) + slices  # the body, its problems, their answers
    # the routes (a body the fast path leaves to FastAPI) resolve an anonymous batch in slices too
    routed = {"device": DEVICE, "problems": [problem(64 * (i + 1), k=4096) for i in range(n)]}
    r = c.post("/v1/lookup/batch", content=json.dumps(routed), headers=ROUTES_ONLY)
    assert r.status_code == 200, r.text[:300]
    assert pacer.slices == 1 + (1 + slices) + 2 * slices
    assert c.post("/v1/lookup", json={"device": DEVICE, "problem": problem(8192)}).status_code == 200
    assert pacer.slices == 1 + (1 + slices) + 2 * slices  # single lookups are not paced


def test_sqlite_reads_a_single_lookups_exact_match_on_the_event_loop(make_client, backend, monkeypatch):
    """A tuned single lookup needs no worker thread on SQLite (one on PostgreSQL, whose read
    waits for the network); an untuned one goes to a thread for the nearest index and the model."""
    c = make_client()
    r = c.post("/v1/results", headers=WRITE_HEADERS,
               json={"device": DEVICE, "problem": problem(), "measurements": measurements()})
    assert r.status_code == 201, r.text
    hops: list[str] = []
    real = lookups_module.run_in_threadpool

    async def counted(fn: Any, *args: Any) -> Any:
        hops.append(fn.__name__)
        return await real(fn, *args)

    monkeypatch.setattr(lookups_module, "run_in_threadpool", counted)
    tuned = c.post("/v1/lookup", json={"device": DEVICE, "problem": problem()})
    assert tuned.status_code == 200 and tuned.json()["source"] == "tuned"
    assert hops == ([] if backend == "sqlite" else ["_resolve"])
    hops.clear()
    untuned = c.post("/v1/lookup", json={"device": DEVICE, "problem": problem(4096)})
    assert untuned.status_code == 200 and untuned.json()["source"] != "tuned"
    assert hops == (["_inexact"] if backend == "sqlite" else ["_resolve"])
