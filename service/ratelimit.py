"""Limits on anonymous lookups: what a caller without a valid token can make a service process
spend on ``POST /v1/lookup`` and ``/v1/lookup/batch`` (issue 38 item 4).

Reads are open unless ``AUTOTUNER_READ_TOKENS`` is set, and a batch of 1000 untuned problems
costs a process about 2 s of cost-model CPU. So a lookup that carries no valid token is held,
in each service process, to

- a token bucket per client address, counted in problems (a single lookup costs 1, a batch of
  500 costs 500): ``AUTOTUNER_ANON_LOOKUP_BURST`` problems at once, refilled at
  ``AUTOTUNER_ANON_LOOKUP_RATE`` per second; a batch larger than the burst costs the whole
  burst (it waits for a full bucket instead of never passing). At most
  ``AUTOTUNER_ANON_LOOKUP_CLIENTS`` addresses are remembered, the least recently seen going
  first, so a scan from many addresses cannot grow the table;
- at most ``AUTOTUNER_ANON_BATCH_CONCURRENCY`` anonymous batch lookups running at once;
- and what the admitted batches cost the process: their work is paced (:mod:`service.pacing`),
  one slice of ``AUTOTUNER_ANON_BATCH_SLICE`` problems at a time, resting so that together they
  take at most ``AUTOTUNER_ANON_BATCH_SHARE`` of the process's time.

Past either it is answered 429 with ``{"detail": ...}`` naming the limit and the setting that
raises it, and ``Retry-After``; refused requests are counted in
``autotuner_lookups_limited_total{limit}``. A request whose token :mod:`service.auth` accepts
(read or write; a settings token or one of the tokens table) is never limited; with read tokens
configured every lookup needs one, so nothing here applies.

:class:`AnonymousLimiter` is the accounting (no I/O, thread-safe); :class:`AnonymousLookupLimit`
the ASGI layer in front of the lookup fast path (:mod:`service.fastpath`), which answers most
lookups before FastAPI's routes would see them: both are limited alike. It reads an anonymous
batch's body to count its problems and hands the body on unchanged.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from db import StorageError
from service import auth
from service.bounded import BoundedDict
from service.fastpath import ASGI, BATCH, PATHS, _read, _replay
from service.pacing import SCOPE_KEY, Pacer

CLIENT_BYTES = 256  # an address's bucket in the table, roughly (the key, two floats, the entry)
CONCURRENCY_RETRY_SECONDS = 1  # a slot frees when a batch ends: milliseconds, or seconds while paced


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused: ``limit`` ("rate" or "concurrency"), the 429's ``detail``, and
    the seconds to wait (``Retry-After``)."""

    limit: str
    detail: str
    retry_after: int


class AnonymousLimiter:
    """Token buckets per address (``rate`` problems/s, ``burst`` at most; ``rate`` 0: none) and
    a cap of ``concurrency`` batches running at once (0: none). Thread-safe; ``clock`` for tests."""

    def __init__(self, rate: float, burst: int, concurrency: int, max_clients: int, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = burst
        self.concurrency = concurrency
        self.clock = clock
        # address -> (problems left, when counted)
        self.buckets: BoundedDict[str, tuple[float, float]] = BoundedDict(
            max_clients, max_clients * CLIENT_BYTES, lru=True)
        self.running = 0  # anonymous batches admitted and not done
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return self.rate > 0 or self.concurrency > 0

    def admit(self, client: str, cost: int, *, batch: bool) -> Refusal | None:
        """Charge ``cost`` problems to ``client`` and, for a batch, take a running slot (give it
        back with :meth:`done`); or do neither and say why."""
        with self._lock:
            if batch and self.concurrency and self.running >= self.concurrency:
                return Refusal("concurrency", f"too many anonymous batch lookups: at most {self.concurrency} "
                               "run at once in a service process; retry later, send a token, or raise "
                               "AUTOTUNER_ANON_BATCH_CONCURRENCY", CONCURRENCY_RETRY_SECONDS)
            if self.rate > 0:
                now = self.clock()
                cost = min(cost, self.burst)
                last = self.buckets.get(client)
                left = self.burst if last is None else min(self.burst, last[0] + (now - last[1]) * self.rate)
                if left < cost:
                    self.buckets.put(client, (left, now), CLIENT_BYTES)
                    wait = max(1, math.ceil((cost - left) / self.rate))
                    return Refusal("rate", f"too many anonymous lookups from this address: {self.rate:g} "
                                   f"problems/s, at most {self.burst} at once, without a token (this "
                                   f"request costs {cost}); retry after {wait} s, send a token, or raise "
                                   "AUTOTUNER_ANON_LOOKUP_RATE / AUTOTUNER_ANON_LOOKUP_BURST", wait)
                self.buckets.put(client, (left - cost, now), CLIENT_BYTES)
            if batch:
                self.running += 1
            return None

    def done(self) -> None:
        """An admitted batch has ended."""
        with self._lock:
            self.running -= 1


async def has_valid_token(token: str, state: Any) -> bool:
    """Whether :mod:`service.auth` accepts ``token`` at all (any scope); a database that cannot
    say counts as no."""
    try:
        return await auth.grant_of(token, state.settings, state.database) is not None
    except StorageError:
        return False


def _bearer(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            return auth.bearer_token(value)
    return None


def _count(body: bytes) -> int:
    try:
        problems = json.loads(body).get("problems")
    except (ValueError, RecursionError, AttributeError):  # the routes answer it 422
        problems = None
    return len(problems) if isinstance(problems, list) else 1


class AnonymousLookupLimit:
    """ASGI: lookups without a valid token admitted by :class:`AnonymousLimiter` (else a 429),
    everything else straight to ``app`` (the fast path)."""

    def __init__(self, app: ASGI, state: Any) -> None:
        self.app = app
        self.state = state
        s = state.settings
        self.limiter = AnonymousLimiter(s.anon_lookup_rate, s.anon_lookup_burst, s.anon_batch_concurrency,
                                        s.anon_lookup_clients)
        # the admitted anonymous batches' work, one slice at a time (service.pacing)
        self.pacer = Pacer(s.anon_batch_share, s.anon_batch_slice, busy=getattr(app, "busy", None))
        self.active = self.limiter.active or self.pacer.share < 1

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path")
        if (scope["type"] != "http" or path not in PATHS or scope["method"] != "POST"
                or not self.active or self.state.settings.read_tokens):
            await self.app(scope, receive, send)  # with read tokens, auth refuses the anonymous
            return
        start = time.perf_counter()
        token = _bearer(scope)
        if token is not None and await has_valid_token(token, self.state):
            await self.app(scope, receive, send)
            return
        batch = path == BATCH
        cost = 1
        if batch:
            cost, receive = await self._problems(scope, receive)
        client = scope.get("client")
        refusal = self.limiter.admit(client[0] if client else "", cost, batch=batch)
        if refusal is not None:
            headers = {"Retry-After": str(refusal.retry_after)}
            await JSONResponse({"detail": refusal.detail}, 429, headers)(scope, receive, send)
            self.state.metrics.observe("POST", path, 429, time.perf_counter() - start)
            self.state.metrics.limited.labels(refusal.limit).inc()
            return
        if batch:
            scope = {**scope, SCOPE_KEY: self.pacer}
        try:
            await self.app(scope, receive, send)
        finally:
            if batch:
                self.limiter.done()

    async def _problems(self, scope: Scope, receive: Receive) -> tuple[int, Receive]:
        """A batch's problems (1 to ``AUTOTUNER_MAX_BATCH``), and a ``receive`` that replays
        its body. A body not read here (no ``Content-Length``, or over
        ``AUTOTUNER_MAX_BODY_BYTES``: refused later with a 413) counts as a full batch."""
        settings = self.state.settings
        length = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = value
        if length is None or not length.isdigit() or int(length) > settings.max_body_bytes:
            return settings.max_batch, receive
        body, after = await _read(receive)
        n = await run_in_threadpool(_count, body)
        return max(1, min(n, settings.max_batch)), _replay(body, after, receive)
