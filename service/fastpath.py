"""The lookup fast path: ``POST /v1/lookup`` and ``/v1/lookup/batch`` answered in front of FastAPI.

A profile of the running service (``bench/profile_lookup.py``, README "Performance") showed
most of a cached lookup's CPU in the framework rather than in the lookup: middleware, routing,
dependency solving, validating the request model around the domain objects, the response
model. The app (:class:`service.app.ServiceApp`) hands these two routes to
:class:`LookupFastPath` first, which answers well-formed lookups itself:

- the body is read once and parsed (``json.loads``); what it parses to (device, problems,
  their keys) is remembered by the parsed body's compact JSON text, so a body seen before -
  however it was laid out or padded - is neither validated nor keyed again. The memo holds at
  most ``AUTOTUNER_PARSE_MEMO_ENTRIES`` single bodies (:data:`BATCH_MEMO_MAX` batch bodies)
  and ``AUTOTUNER_PARSE_MEMO_BYTES`` (estimated) each, the least recently used going first,
  pickled (bytes the garbage collector does not traverse); a batch is parsed in a worker
  thread, an anonymous one in the pacer's slices (:mod:`service.pacing`);
- a new body's device and problems are validated by the same domain parsers the routes use
  (:mod:`service.field_types`, input limits included), and keyed once;
- the answers come from the lookup engine with those keys, as the JSON cached with them,
  and are sent as is; the request is counted in the metrics under its route.

Anything it does not answer goes to FastAPI unchanged (the body replayed): a body that is not
exactly ``{"device", "problem"}`` / ``{"device", "problems"}`` of valid objects, a batch over
``AUTOTUNER_MAX_BATCH``, a body over ``AUTOTUNER_MAX_BODY_BYTES`` or without a
``Content-Length``, a content type other than ``application/json``, a read token that does
not check out, any error - so every error is answered by the routes, in the same form as
before, and ``/docs`` still documents both routes.
"""

from __future__ import annotations

import json
import os
import pickle
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

from starlette.concurrency import run_in_threadpool
from starlette.types import Message, Receive, Scope, Send

from autotuner import Device, Problem
from service import auth
from service.bounded import BoundedDict, estimate
from service.field_types import _validate_device, _validate_problem
from service.pacing import SCOPE_KEY, Pacer

SINGLE = "/v1/lookup"
BATCH = "/v1/lookup/batch"
PATHS = (SINGLE, BATCH)
PROCESS_HEADER = b"x-autotuner-process"
BATCH_MEMO_MAX = 256  # batch bodies remembered (at most)
IDLE_SECONDS = 0.1  # a process that answered no other lookup for this long is idle (LookupFastPath.busy)

ASGI = Callable[[Scope, Receive, Send], Awaitable[None]]
# what a body parses to: the device, the problems, the device's key, the problems' keys
Parsed = tuple[Device, list[Problem], str, list[str]]


class _Unchecked(NamedTuple):
    text: str  # the body as parsed, compact: the memo's key
    device: Device
    raw: list[Any]  # the problems as sent


def _checked(raw: list[Any]) -> tuple[list[Problem], list[str]] | None:
    """The problems ``raw`` describes and their keys; None if one is not valid (the routes say why)."""
    try:
        problems = [_validate_problem(p) for p in raw]
    except ValueError:  # PydanticCustomError is one: the routes answer 422
        return None
    return problems, [p.key for p in problems]


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")  # NaN/Infinity: the routes say why


class LookupFastPath:
    """Answers lookups for ``state`` (a :class:`service.deps.ServiceState`); ``app`` gets
    everything else."""

    def __init__(self, app: ASGI, state: Any) -> None:
        self.app = app
        self.state = state
        settings = state.settings
        entries, nbytes = settings.parse_memo_entries, settings.parse_memo_bytes
        # the parsed bodies, pickled: bytes the garbage collector does not track (as objects,
        # ~9 per problem, a full memo made each full collection 100-200 ms longer: the p99)
        self._memo: BoundedDict[str, bytes] = BoundedDict(entries, nbytes, lru=True)
        self._batch_memo: BoundedDict[str, bytes] = BoundedDict(min(entries, BATCH_MEMO_MAX), nbytes, lru=True)
        self._pid = b"%d" % os.getpid()
        self.in_flight = 0  # lookups being answered here, not paced
        self.last_done = float("-inf")  # when the last of them was answered (time.monotonic)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path")
        if scope["type"] != "http" or path not in PATHS or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        length = content_type = token = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = value
            elif name == b"content-type":
                content_type = value
            elif name == b"authorization":
                token = value
        if (length is None or not length.isdigit() or int(length) > self.state.settings.max_body_bytes
                or content_type is None or not content_type.startswith(b"application/json")):
            await self.app(scope, receive, send)  # nothing read yet: FastAPI sees it as sent
            return
        body, after = await _read(receive)
        answer = None
        if after is None:
            pacer = scope.get(SCOPE_KEY)
            if pacer is None:
                self.in_flight += 1
            try:
                answer = await self._answer(path, body, token, pacer)
            except Exception:  # noqa: BLE001 - whatever it is, the routes answer it their way
                answer = None
            finally:
                if pacer is None:
                    self.in_flight -= 1
                    self.last_done = time.monotonic()
        if answer is None:
            await self.app(scope, _replay(body, after, receive), send)
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", b"%d" % len(answer)),
                                (PROCESS_HEADER, self._pid)]})
        await send({"type": "http.response.body", "body": answer})
        self.state.metrics.observe("POST", path, 200, time.perf_counter() - start)

    def busy(self) -> bool:
        """Whether this process answers other lookups now or did within ``IDLE_SECONDS``: the
        anonymous batches' pacer (service.pacing) rests between slices while it does."""
        return self.in_flight > 0 or time.monotonic() - self.last_done < IDLE_SECONDS

    def _parse(self, path: str, body: bytes) -> Parsed | None:
        start = self._start(path, body)
        if not isinstance(start, _Unchecked):  # answered from the memo, or not at all
            return start
        text, device, raw = start.text, start.device, start.raw
        checked = _checked(raw)
        return None if checked is None else self._remember(path, text, device, *checked)

    async def _parse_paced(self, body: bytes, pacer: Pacer) -> Parsed | None:
        """:meth:`_parse` of a batch in ``pacer``'s slices (an anonymous batch: service.pacing)."""
        start = await pacer.run(self._start, BATCH, body)
        if not isinstance(start, _Unchecked):
            return start
        problems, pkeys = [], []
        for part in pacer.slices_of(start.raw):
            checked = await pacer.run(_checked, part)
            if checked is None:
                return None
            problems += checked[0]
            pkeys += checked[1]
        return self._remember(BATCH, start.text, start.device, problems, pkeys)

    def _start(self, path: str, body: bytes) -> Parsed | _Unchecked | None:
        """The body's answer from the memo, or its device checked and its problems not yet;
        None: not a body the fast path answers."""
        req = json.loads(body, parse_constant=_no_constants)
        if not isinstance(req, dict):
            return None
        memo = self._memo if path == SINGLE else self._batch_memo
        text = json.dumps(req, separators=(",", ":"))  # the memo's key: the body as parsed
        hit = memo.get(text)
        if hit is not None:
            return pickle.loads(hit)  # noqa: S301 - this process's own pickle of its own objects
        if path == SINGLE:
            if req.keys() != {"device", "problem"}:
                return None
            raw = [req["problem"]]
        else:
            raw = req.get("problems")
            if req.keys() != {"device", "problems"} or not isinstance(raw, list) \
                    or not 1 <= len(raw) <= self.state.settings.max_batch:
                return None
        try:
            device = _validate_device(req["device"])
        except ValueError:  # PydanticCustomError is one: the routes answer 422
            return None
        return _Unchecked(text, device, raw)

    def _remember(self, path: str, text: str, device: Device, problems: list[Problem],
                  pkeys: list[str]) -> Parsed:
        parsed = (device, problems, self.state.parse_memo.key(device), pkeys)
        pickled = pickle.dumps(parsed, pickle.HIGHEST_PROTOCOL)
        (self._memo if path == SINGLE else self._batch_memo).put(text, pickled, estimate(len(text) + len(pickled), 1))
        return parsed

    async def _answer(self, path: str, body: bytes, token: bytes | None,
                      pacer: Pacer | None = None) -> bytes | None:
        state = self.state
        if state.settings.read_tokens:
            bearer = auth.bearer_token(token)
            if bearer is None:
                return None
            await auth.require("read", bearer, state.settings, state.database)
        if pacer is not None:
            parsed = await self._parse_paced(body, pacer)
        elif path == SINGLE:
            parsed = self._parse(path, body)
        else:  # a batch's parse takes milliseconds (~0.2 ms a new problem): off the event loop
            parsed = await run_in_threadpool(self._parse, path, body)
        if parsed is None:
            return None
        device, problems, dkey, pkeys = parsed
        results = await state.lookups.run_json(device, problems, (dkey, pkeys), pacer)
        if path == SINGLE:
            return results[0]
        state.metrics.batch_size.observe(len(problems))
        return b'{"device_key":%s,"results":[%s]}' % (json.dumps(dkey).encode(), b",".join(results))


async def _read(receive: Receive) -> tuple[bytes, Message | None]:
    """The whole body; and the message that ended it early (a disconnect), if one did."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), message
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks), None


def _replay(body: bytes, after: Message | None, receive: Receive) -> Receive:
    queue: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]
    if after is not None:
        queue.append(after)

    async def replay() -> Message:
        if queue:
            return queue.pop(0)
        return await receive()

    return replay
