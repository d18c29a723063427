"""The client against a service (or a proxy before it) that is slow, huge or busy (issue 39): a
lookup returns within its deadline with the fallback, reads no more than `MAX_ANSWER_BYTES`, and
takes a 408/429/503 as "not now", asking again after its Retry-After instead of pinning the
baseline for the life of the process.

The server is a raw `http.server` on 127.0.0.1 in a thread, misbehaving on purpose."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from autotuner import Strategy
from autotuner.runtime import transport as C
from autotuner.runtime.client import Client
from service.testing import RING

from .test_client_hostile import DEVICE, TUNED, answer


class Server:
    """Answers POST /v1/lookup as `mode` says: "trickle" (a valid answer's headers, then its body
    one byte a second), "huge" (a body of 1 GiB, as fast as it goes), "busy" (429 with
    Retry-After: 1, then valid answers)."""

    def __init__(self, mode: str) -> None:
        self.mode, self.requests, self.sent = mode, 0, 0
        srv = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                self.rfile.read(int(self.headers["Content-Length"]))
                srv.requests += 1
                body = json.dumps(answer(TUNED)).encode()
                if srv.mode == "busy" and srv.requests == 1:
                    self.send_response(429)
                    self.send_header("Retry-After", "1")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                size = 2**30 if srv.mode == "huge" else len(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(size))
                self.end_headers()
                try:
                    if srv.mode == "trickle":
                        for i in range(len(body)):
                            self.wfile.write(body[i:i + 1])
                            self.wfile.flush()
                            srv.sent += 1
                            time.sleep(1.0)
                    elif srv.mode == "huge":
                        block = b" " * 2**20
                        while srv.sent < size:
                            self.wfile.write(block)
                            srv.sent += len(block)
                    else:
                        self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass   # the client stopped reading: what the tests want

            def log_message(self, *a: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    s = Server(request.param)
    yield s
    s.close()


@pytest.mark.parametrize("server", ["trickle"], indirect=True)
def test_a_trickling_answer_ends_at_the_deadline_with_the_fallback(server: Server) -> None:
    """Each byte arrives well within httpx's per-read timeout, so only the total deadline ends
    the request: the lookup returns the baseline after about `timeout` seconds, not the ~500 s
    the whole answer would take."""
    c = Client(server.url, timeout=2.0, device=DEVICE)
    t = time.monotonic()
    got = c.lookup(TUNED)
    took = time.monotonic() - t
    assert got.source == "default" and got.strategy.is_baseline, got
    assert server.sent < len(json.dumps(answer(TUNED))) // 4, server.sent   # far from the whole answer
    assert took < 2.0 + 3.0, took   # the deadline, plus at most one byte's wait


@pytest.mark.parametrize("server", ["huge"], indirect=True)
def test_an_answer_past_the_size_cap_is_not_read_on(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(C, "MAX_ANSWER_BYTES", 4 * 2**20)
    c = Client(server.url, timeout=30.0, device=DEVICE)
    got = c.lookup(TUNED)
    assert got.source == "default", got
    time.sleep(0.2)
    assert server.sent < 64 * 2**20, server.sent   # socket buffers aside, the client stopped at the cap


@pytest.mark.parametrize("server", ["busy"], indirect=True)
def test_a_busy_answer_is_not_a_final_no(server: Server) -> None:
    """A 429 (a proxy's rate limit) gives the baseline now, and is not remembered: after its
    Retry-After the service is asked again and its answer used."""
    c = Client(server.url, timeout=5.0, device=DEVICE, retry_after=600.0)
    first = c.lookup(TUNED)
    assert first.source == "default" and server.requests == 1, first
    assert c.lookup(TUNED).source == "default" and server.requests == 1   # within Retry-After: not asked
    time.sleep(1.1)
    again = c.lookup(TUNED)
    assert server.requests == 2 and again.source == "tuned" and again.strategy == Strategy.from_dict(RING), again


@pytest.mark.parametrize(("value", "want"), [("7", 7.0), ("-3", 0.0), ("1e9", C.MAX_RETRY_AFTER), ("nan", None),
                                              ("soon", None), (None, None)])
def test_retry_after_is_read_and_capped(value: str | None, want: float | None) -> None:
    assert C._retry_after(value) == want
