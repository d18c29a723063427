"""In-program evidence served (issue 24 item 3): GET /v1/evidence for one device and program,
the snapshot's `evidence`, and the client's `evidence()` over the real route (SQLite and
PostgreSQL); a service that cannot answer gives {} and one warning."""

from __future__ import annotations

import logging

import pytest

from autotuner.device import Device
from autotuner.runtime.client import Client
from autotuner.snapshot import device_values
from autotuner.strategy import Strategy
from db import repository as repo
from service.testing import DEVICE

DEV = Device.from_dict(DEVICE)
RING = Strategy("ring", "uni", 2, "full", "loop", True)
PROGRAM = "0123456789abcdef"


def _store(database, problem_key: str, program: str = PROGRAM, strategy: Strategy = RING) -> None:
    with database.session() as s:
        dev = repo.upsert_device(s, **device_values(DEV))
        repo.record_evidence(s, dev.id, program_key=program, program="m:step {}", problem_key=problem_key,
                             name="bsd,df->bsf", strategy=strategy.to_dict(), strategy_key=strategy.key,
                             previous=Strategy.baseline().to_dict(), previous_key="baseline", speedup=1.1,
                             speedup_lo=1.05, speedup_hi=1.15, reps=15,
                             tried=[{"strategy_key": strategy.key, "speedup": 1.1, "speedup_lo": 1.05,
                                     "speedup_hi": 1.15}])


def test_evidence_is_served_and_read_by_the_client(client, database, caplog):
    _store(database, "p" * 64)
    _store(database, "q" * 64, program="fedcba9876543210")
    r = client.get("/v1/evidence", params={"device_key": DEV.key, "program_key": PROGRAM})
    assert r.status_code == 200
    (item,) = r.json()["evidence"]
    assert item["problem_key"] == "p" * 64 and item["strategy"] == RING.to_dict() and item["confidence"] == [1.05, 1.15]
    assert client.get("/v1/evidence", params={"device_key": DEV.key, "program_key": "nope"}).json() == {"evidence": []}
    assert client.get("/v1/evidence", params={"device_key": DEV.key}).status_code == 422
    assert client.get("/v1/evidence", params={"device_key": DEV.key, "program_key": "x" * 65}).status_code == 422
    snap = client.get("/v1/snapshot").json()
    assert {e["program_key"] for e in snap["evidence"]} == {PROGRAM, "fedcba9876543210"}

    c = Client("http://testserver", device=DEV)
    c._http = client   # the TestClient is an httpx.Client on the app: the real route and parsing
    got = c.evidence(PROGRAM)
    assert list(got) == ["p" * 64] and got["p" * 64]["strategy"] == RING
    assert got["p" * 64]["previous"].is_baseline and got["p" * 64]["confidence"] == (1.05, 1.15)
    assert c.evidence("fedcba9876543210") and c.evidence("0" * 16) == {}

    down = Client("http://127.0.0.1:9", device=DEV, timeout=0.5)
    with caplog.at_level(logging.WARNING, logger="autotuner"):
        assert down.evidence(PROGRAM) == {} and down.evidence("1" * 16) == {}
    assert len([r for r in caplog.records if "in-program evidence" in r.getMessage()]) == 1


@pytest.mark.parametrize("body", [b"[]", b'"x"', b'{"evidence": 3}', b'{"evidence": [{"device_key": 1}]}',
                                  b"\xff\xfe", b"{" * 5000])
def test_an_evidence_answer_that_does_not_parse_is_none(body):
    import httpx

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body)

    c = Client("http://testserver", device=DEV)
    c._http = httpx.Client(base_url="http://testserver", transport=httpx.MockTransport(answer))
    assert c.evidence(PROGRAM) == {}
