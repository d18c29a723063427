"""The client against a service that answers nonsense, a disk cache that is corrupt, and
threads that ask at once (issue 26).

The service here is a tiny ``http.server`` on 127.0.0.1 in a thread, answering whatever bytes a
test sets. Whatever it answers, ``lookup`` returns an answer (the baseline, when nothing else is
known), never raises, and warns once; what it writes to disk stays in ``cache_dir`` and parses.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from autotuner import Device, Problem, Strategy
from autotuner.answer import Answer
from autotuner.runtime.client import DEFAULT_TIMEOUT, Client
from service.testing import RING, free_port, problem

DEVICE = Device(platform="cpu", device_kind="cpu", num_devices=8, num_processes=1, topology="hostile-test",
                jax_version="0.10.2", jaxlib_version="0.10.2")
TUNED = Problem.from_dict(problem())
OTHER = Problem.from_dict(problem(64, 64, 64))
CACHE_FILE = f"lookups-{DEVICE.key}.jsonl"


def answer(p: Problem, **fields: Any) -> dict[str, Any]:
    """A valid answer for ``p`` on DEVICE (a tuned ring), with ``fields`` replaced."""
    r = Answer(strategy=Strategy.from_dict(RING), source="tuned", speedup=1.25, confidence=(1.2, 1.3),
                     record_id=7, measured_at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC), problem_key=p.key,
                     device_key=DEVICE.key, trials=12)
    return {**r.to_json(), "strategy_key": r.strategy.key, **fields}


class FakeService:
    """POST /v1/lookup and /v1/lookup/batch answered by ``respond(path, request) -> bytes``;
    counts the requests in flight at once. With ``gate`` set, each request waits there (a
    barrier) before it is answered."""

    def __init__(self) -> None:
        self.respond: Callable[[str, dict[str, Any]], bytes] = self.valid
        self.gate: threading.Barrier | None = None
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = self.requests = 0
        self.gate_broken = False
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.requests += 1
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                try:
                    status, body = 200, fake.respond(self.path, request)
                    if fake.gate is not None:
                        try:
                            fake.gate.wait()
                        except threading.BrokenBarrierError:
                            fake.gate_broken = True
                            status, body = 503, b'{"detail": "the other request never came"}'
                finally:
                    with fake.lock:
                        fake.in_flight -= 1
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)

    @staticmethod
    def valid(path: str, request: dict[str, Any]) -> bytes:
        if path == "/v1/lookup":
            return json.dumps(answer(Problem.from_dict(request["problem"]))).encode()
        return json.dumps({"device_key": DEVICE.key,
                           "results": [answer(Problem.from_dict(p)) for p in request["problems"]]}).encode()


@pytest.fixture
def service() -> Iterator[FakeService]:
    fake = FakeService()
    fake.thread.start()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "autotuner.runtime.client" and r.levelno == logging.WARNING]


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def _valid_cache(path: Path) -> list[Answer]:
    """Every line of a cache file, parsed (fails on a line that does not parse)."""
    return [Answer.from_json(json.loads(line), "disk") for line in path.read_bytes().splitlines()]


# -- answers that do not parse ---------------------------------------------------------------------

def _one(**fields: Any) -> Callable[[str, dict[str, Any]], bytes]:
    """A single answer with ``fields`` replaced (a batch: each answer so)."""
    def respond(path: str, request: dict[str, Any]) -> bytes:
        if path == "/v1/lookup":
            return json.dumps(answer(Problem.from_dict(request["problem"]), **fields)).encode()
        return json.dumps({"device_key": DEVICE.key, "results": [answer(Problem.from_dict(p), **fields)
                                                                 for p in request["problems"]]}).encode()
    return respond


def _bytes(body: bytes) -> Callable[[str, dict[str, Any]], bytes]:
    return lambda path, request: body


NESTED = b'{"a":' * 5000 + b"1" + b"}" * 5000
HOSTILE = {
    "an array": _bytes(b"[]"),
    "a string": _bytes(b'"tuned"'),
    "null": _bytes(b"null"),
    "a number": _bytes(b"42"),
    "not JSON": _bytes(b"<html>502 Bad Gateway</html>"),
    "invalid UTF-8": _bytes(b'{"strategy": {"method": "ring"}, "source": "\xff\xfe\xfd"}'),
    "5000 nested objects": _bytes(NESTED),
    "5000 nested arrays": _bytes(b"[" * 5000 + b"]" * 5000),
    "numeric measured_at": _one(measured_at=1767322800),
    "measured_at not a time": _one(measured_at="yesterday"),
    "a string speedup": _one(speedup="fast"),
    "a NaN speedup": lambda path, request: json.dumps(answer(Problem.from_dict(request["problem"]),
                                                             speedup=float("nan"))).encode(),
    "a huge integer speedup": _one(speedup=10 ** 400),
    "a string confidence": _one(confidence="narrow"),
    "a numeric confidence": _one(confidence=1.2),
    "a 1-element confidence": _one(confidence=[1.2]),
    "a boolean record_id": _one(record_id=True),
    "a string trials": _one(trials="12"),
    "a strategy that is a string": _one(strategy="ring"),
    "a strategy that is an array": _one(strategy=[]),
    "an unknown method": _one(strategy={"method": {"evil": 1}}),
    "no problem_key": _one(problem_key=None),
    "a numeric device_key": _one(device_key=12),
    "a device_key that walks out of the cache": _one(device_key="../../etc/x"),
    "a device_key with a slash": _one(device_key="a/b"),
    "a device_key of 10000 characters": _one(device_key="a" * 10_000),
}
BATCH_HOSTILE = {
    "an array": _bytes(b"[]"),
    "results a string": _bytes(b'{"results": "x"}'),
    "results an object": _bytes(b'{"results": {"a": 1, "b": 2}}'),
    "results of strings": _bytes(b'{"results": ["a", "b"]}'),
    "too few results": lambda path, request: json.dumps(
        {"results": [answer(Problem.from_dict(request["problems"][0]))]}).encode(),
    "5000 nested objects": _bytes(NESTED),
    "a device_key that walks out of the cache": _one(device_key="../../etc/x"),
}


@pytest.mark.parametrize("respond", list(HOSTILE.values()), ids=list(HOSTILE))
def test_an_answer_that_does_not_parse_is_a_service_down(service, tmp_path, caplog, respond):
    caplog.set_level(logging.INFO, "autotuner.runtime.client")
    cache = tmp_path / "a" / "cache"
    # what an unchecked device_key '../../etc/x' would reach: tmp_path/a/etc/x.jsonl
    (cache / "lookups-..").mkdir(parents=True)
    (tmp_path / "a" / "etc").mkdir()
    service.respond = respond
    with Client(service.url, device=DEVICE, cache_dir=cache, retry_after=0) as client:
        results = [client.lookup(TUNED) for _ in range(3)] + client.lookup_batch([OTHER, TUNED])
    assert all(r.strategy.is_baseline and r.source == "default" and r.origin == "fallback" for r in results)
    assert service.requests == 4  # retry_after=0: asked every time, and every time refused the answer
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "cannot answer" in warnings[0] and "baseline" in warnings[0], warnings
    assert _files(tmp_path) == set()  # nothing written, in the cache or outside it


@pytest.mark.parametrize("respond", list(BATCH_HOSTILE.values()), ids=list(BATCH_HOSTILE))
def test_a_batch_answer_that_does_not_parse_is_a_service_down(service, tmp_path, caplog, respond):
    caplog.set_level(logging.WARNING, "autotuner.runtime.client")
    service.respond = respond
    with Client(service.url, device=DEVICE, cache_dir=tmp_path) as client:
        results = client.lookup_batch([TUNED, OTHER])
        assert [r.origin for r in results] == ["fallback", "fallback"]
        assert client.lookup(TUNED).origin == "fallback"  # within retry_after: not asked again
    assert service.requests == 1 and len(_warnings(caplog)) == 1
    assert _files(tmp_path) == set()


def test_the_service_answers_again_after_nonsense(service, tmp_path, caplog):
    """Nonsense is an outage like any other: once the service answers properly, its answers
    are used, cached and written under the client's own device key."""
    caplog.set_level(logging.WARNING, "autotuner.runtime.client")
    service.respond = _bytes(b"[]")
    with Client(service.url, device=DEVICE, cache_dir=tmp_path, retry_after=0) as client:
        assert client.lookup(TUNED).origin == "fallback"
        service.respond = _one(device_key="0123456789abcdef" * 2)  # a valid key, not ours
        got = client.lookup(TUNED)
        assert got.origin == "service" and got.strategy == Strategy.from_dict(RING)
        assert got.device_key == DEVICE.key and got.problem_key == TUNED.key
        assert got.measured_at == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
        assert client.lookup(TUNED).origin == "memory"
    assert _files(tmp_path) == {CACHE_FILE}
    assert [(r.device_key, r.problem_key) for r in _valid_cache(tmp_path / CACHE_FILE)] == [(DEVICE.key, TUNED.key)]
    assert len(_warnings(caplog)) == 1


def test_from_json_raises_value_error_only():
    """Answer.from_json, for the snapshot loader and any caller: ValueError (a
    StrategyError is one) for every answer above, never AttributeError or TypeError."""
    good = answer(TUNED)
    assert Answer.from_json(good, "service").strategy == Strategy.from_dict(RING)
    bad: list[Any] = [[], "tuned", None, 42, {**good, "measured_at": 1767322800}, {**good, "speedup": "x"},
                      {**good, "speedup": 10 ** 400}, {**good, "confidence": 1.2}, {**good, "record_id": "7"},
                      {**good, "device_key": "../../etc/x"}, {**good, "strategy": "ring"},
                      {k: v for k, v in good.items() if k != "strategy"}]
    for d in bad:
        with pytest.raises(ValueError):
            Answer.from_json(d, "service")


# -- a corrupt disk cache --------------------------------------------------------------------------

def _line(p: Problem) -> bytes:
    r = Answer.from_json(answer(p), "disk")
    return json.dumps(r.to_json()).encode() + b"\n"


CORRUPT = {
    "non-UTF-8 bytes": b"\xff\xfe\x00garbage\x80\n",
    "truncated JSON": b'{"strategy": {"method": "ring", "direction": "u',
    "a JSON array": b"[]\n",
    "5000 nested objects": NESTED + b"\n",
    "a wrong type": json.dumps({**answer(OTHER), "measured_at": 5}).encode() + b"\n",
}


@pytest.mark.parametrize("junk", list(CORRUPT.values()), ids=list(CORRUPT))
def test_a_corrupt_cache_is_set_aside_and_rebuilt_while_the_service_is_down(tmp_path, caplog, junk):
    caplog.set_level(logging.INFO, "autotuner.runtime.client")
    original = _line(TUNED) + junk
    (tmp_path / CACHE_FILE).write_bytes(original)
    dead = f"http://127.0.0.1:{free_port()}"
    with Client(dead, device=DEVICE, cache_dir=tmp_path, timeout=0.5) as client:
        got = client.lookup(TUNED)
        assert got.origin == "disk" and got.strategy == Strategy.from_dict(RING)  # the good line survives
        for _ in range(3):
            other = client.lookup(OTHER)
            assert other.origin == "fallback" and other.strategy.is_baseline
    aside = [f for f in _files(tmp_path) if f.startswith(f"{CACHE_FILE}.corrupt-")]
    assert len(aside) == 1 and _files(tmp_path) == {CACHE_FILE, aside[0]}
    assert (tmp_path / aside[0]).read_bytes() == original  # kept as it was, for a look
    assert [r.problem_key for r in _valid_cache(tmp_path / CACHE_FILE)] == [TUNED.key]
    assert len(_warnings(caplog)) == 1  # the outage; the repair is logged at INFO
    assert any("bad line" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
    # a later client reads the rebuilt file as it is: no second set-aside
    with Client(dead, device=DEVICE, cache_dir=tmp_path, timeout=0.5) as again:
        assert again.lookup(TUNED).origin == "disk"
    assert _files(tmp_path) == {CACHE_FILE, aside[0]}


@pytest.mark.parametrize("junk", list(CORRUPT.values()), ids=list(CORRUPT))
def test_a_corrupt_cache_is_rebuilt_with_the_services_answers(service, tmp_path, caplog, junk):
    caplog.set_level(logging.WARNING, "autotuner.runtime.client")
    (tmp_path / CACHE_FILE).write_bytes(junk)
    with Client(service.url, device=DEVICE, cache_dir=tmp_path) as client:
        assert [r.origin for r in client.lookup_batch([TUNED, OTHER])] == ["service", "service"]
    aside = [f for f in _files(tmp_path) if ".corrupt-" in f]
    assert len(aside) == 1 and _files(tmp_path) == {CACHE_FILE, aside[0]}
    assert sorted(r.problem_key for r in _valid_cache(tmp_path / CACHE_FILE)) == sorted([TUNED.key, OTHER.key])
    assert _warnings(caplog) == []


# -- threads ---------------------------------------------------------------------------------------

def test_concurrent_lookups_are_concurrent_requests(service):
    """Two threads looking up two problems: both requests are in flight at once. The server
    holds each request at a barrier until the other has arrived, so a client that held a lock
    across its request would never let the second one out: the barrier breaks (after its
    generous deadlock guard) and the lookups fall back."""
    service.gate = threading.Barrier(2, timeout=30)
    results: dict[str, Answer] = {}
    errors: list[BaseException] = []
    with Client(service.url, device=DEVICE, timeout=60) as client:
        def ask(p: Problem) -> None:
            try:
                results[p.key] = client.lookup(p)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=ask, args=(p,)) for p in (TUNED, OTHER)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=90)
    assert not errors and not service.gate_broken
    assert service.max_in_flight == 2 and service.requests == 2
    assert {k: r.origin for k, r in results.items()} == {TUNED.key: "service", OTHER.key: "service"}


def test_the_default_timeout_is_above_the_services_model_budget():
    from autotuner.settings import Settings

    budget = Settings.model_fields["model_budget_seconds"].default
    assert DEFAULT_TIMEOUT >= 2 * budget
    assert Client("http://127.0.0.1:1", device=DEVICE).timeout == DEFAULT_TIMEOUT
