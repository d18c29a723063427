"""The compile-time client of the autotuner service.

>>> client = Client("http://tuner:8000")                       # doctest: +SKIP
>>> client.lookup(problem, device).strategy                     # doctest: +SKIP
Strategy(method='ring', direction='bidi', chunks=2, ...)

Where an answer comes from, in order:

1. the in-process cache: every answer the service gave, keyed by ``(device.key, problem.key)``
   (and, in front of it, by the very objects, so that a repeated trace-time lookup costs a
   dictionary probe: about a microsecond);
2. the service (``POST /v1/lookup`` / ``/v1/lookup/batch``), unless it failed less than
   ``retry_after`` seconds ago;
3. the on-disk cache (``cache_dir``), written with every service answer: what a process that
   cannot reach the service still knows;
4. the baseline (``source="default"``).

``Client(offline="snapshot.json")`` never touches the network: it answers from a snapshot
exported from the service (``GET /v1/snapshot``, :meth:`Client.export_snapshot`, or
``autotuner snapshot``), else the baseline. When the service cannot be reached the client logs
ONE warning (per outage, not per call) and falls back as above.

``Answer.origin`` says which of these answered: ``service``, ``memory``, ``disk``,
``snapshot`` or ``fallback``.

:meth:`Client.evidence` answers, for one program (``Plan.program``), the in-program evidence
that ``autotuner tune-model`` stored (``GET /v1/evidence``, or the snapshot's ``evidence``):
``overlap`` prefers it to the isolated winners for that program. Nothing there, or a service
that cannot answer, is ``{}``.

:meth:`Client.upload` stores a session measured in the job (``overlap(fn, tune="missing")``):
``POST /v1/results`` with the client's token, or into the offline snapshot's file, or nowhere
without a token; its winner becomes the client's answer for that problem.

An answer that does not parse (not UTF-8 or JSON, nested too deep, an array where an object
belongs, a field of the wrong type, a key that is not :data:`KEY_RE`) counts as an unreachable
service. Answers are filed under the client's own keys. A disk cache file with a line that does
not parse is set aside (``NAME.corrupt-TIME-PID``) and rewritten from its good lines. No lock
is held while a request is in flight.

Each request has one deadline, ``timeout`` seconds in all (connect, headers and the whole body:
a service or proxy that trickles its answer cannot stall a compile), and an answer larger than
:data:`MAX_ANSWER_BYTES` is not read on; both count as an unreachable service. A 408, 429 or 503
is "not now": the baseline for this call, and the service asked again after its Retry-After
(else ``retry_after``); other 4xx are final for the problems refused.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from autotuner import rule, snapshot
from autotuner.answer import KEY_RE, Answer
from autotuner.device import Device
from autotuner.files import write_atomic
from autotuner.problem import GroupedProblem, Problem, problem_from_dict
from autotuner.runtime.answers import DiskCache as _DiskCache
from autotuner.runtime.answers import session_answer, snapshot_answers
from autotuner.runtime.transport import (
    ClientError,
    _decode,
    _NotNow,
    _Refused,
    _send,
    check_url,
)

__all__ = ["KEY_RE", "Client", "ClientError", "default_client", "load_snapshot", "session_answer"]

log = logging.getLogger("autotuner.runtime.client")

SOURCES = rule.SOURCES
BATCH = 500  # problems per POST /v1/lookup/batch (the service accepts up to AUTOTUNER_MAX_BATCH)
# Seconds per request. The service lets its cost model predict for untuned shapes for up to
# AUTOTUNER_MODEL_BUDGET_SECONDS per request (settings.model_budget_seconds: 2 s by default;
# checked before each prediction, so one more may run past it), after reading its database
# and index, and a request may wait behind others in a worker: a client that gave up at the
# budget itself (the old default, 2 s) cut off exactly the requests the service was busy
# answering. 10 s is five budgets. Connecting involves none of that work: it is capped at
# CONNECT_TIMEOUT, so an unreachable host costs 3 s per outage (then `retry_after` of quiet).
# `timeout` is also each request's total deadline, connect, headers and body together: httpx's
# timeouts are per read, so a service (or proxy) that trickles its answer a byte at a time would
# otherwise stall the compile waiting for it without end.
DEFAULT_TIMEOUT = 10.0
CONNECT_TIMEOUT = 3.0


def load_snapshot(path: str | os.PathLike[str]) -> dict[tuple[str, str], Answer]:
    """The answers of a snapshot file (``GET /v1/snapshot``), by (device key, problem key)."""
    try:
        return snapshot_answers(path)[0]
    except snapshot.SnapshotError as e:
        raise ClientError(str(e)) from None


def _read_offline(path: str | os.PathLike[str]) -> tuple[dict[tuple[str, str], Answer], list[Any]]:
    """A client's snapshot (`answers.snapshot_answers`): one that cannot be read (missing,
    truncated, garbage, another format) is a client with no answers, said once as a warning,
    never an exception at the training job's start (every pair keeps its default)."""
    try:
        return snapshot_answers(path)
    except snapshot.SnapshotError as e:
        log.warning("autotuner: %s; this client has no answers, so every pair keeps its default", e)
        return {}, []


class Client:
    """Looks up the strategy to use per (problem, device); see the module docs for the order.

    ``url``: the service (e.g. ``http://127.0.0.1:8000``); ``token``: a bearer token (needed
    when the service closes reads, and for :meth:`export_snapshot` likewise); ``timeout``:
    seconds per request (:data:`DEFAULT_TIMEOUT`, above the service's model budget; connecting
    at most :data:`CONNECT_TIMEOUT` of them); ``cache_dir``: where the on-disk cache lives
    (none by default); ``offline``: a snapshot file to answer from instead of the service;
    ``retry_after``: seconds to skip the service after it failed; ``device``: the fingerprint
    :func:`autotuner.collective_einsum` uses (default ``Device.current(topology)``).
    Thread-safe; the lock guards the caches' state only, never a request in flight.
    """

    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                 cache_dir: str | os.PathLike[str] | None = None,
                 offline: str | os.PathLike[str] | None = None, *, retry_after: float = 30.0,
                 device: Device | None = None, topology: str | None = None) -> None:
        if url is None and offline is None:
            raise ValueError("Client needs a service url, or offline=SNAPSHOT_FILE")
        if url is not None:
            check_url(url)
        self.url = url.rstrip("/") if url else None
        self.timeout = timeout
        self.retry_after = retry_after
        self.topology = topology
        self._device = device
        self._token = token
        self._memo: dict[tuple[Device, Problem], Answer] = {}   # by object: the fast path
        self._cache: dict[tuple[str, str], Answer] = {}          # by (device key, problem key)
        self._keys: dict[Problem | Device, str] = {}
        self._disk = _DiskCache(Path(cache_dir)) if cache_dir is not None else None
        self._snapshot, self._evidence_items = _read_offline(offline) if offline is not None else (None, [])
        self._evidence: dict[tuple[str, str], dict[str, Any]] = {}   # (device key, program key) -> answers
        self.offline = offline
        self._http: httpx.Client | None = None
        self._lock = threading.Lock()  # the caches' and warnings' state, the HTTP client's creation
        self._down_until = 0.0
        self._warned: set[str] = set()

    def __repr__(self) -> str:  # the token never shows
        where = f"offline={str(self.offline)!r}" if self.offline is not None else repr(self.url)
        return f"Client({where})"

    # -- the fast path -------------------------------------------------------------------------
    def lookup(self, problem: Problem, device: Device | None = None) -> Answer:
        """The strategy for ``problem`` on ``device`` (default: :attr:`device`); never raises
        for an unreachable service (falls back as the module docs say)."""
        if device is None:
            device = self.device
        try:
            hit = self._memo.get((device, problem))
        except TypeError:  # a dict, not a Problem
            hit = None
        if hit is not None:
            return hit
        return self.lookup_batch([problem], device)[0]

    def lookup_batch(self, problems: Sequence[Problem], device: Device | None = None) -> list[Answer]:
        """:meth:`lookup` for many problems at once: cache hits locally, the rest in batches of
        :data:`BATCH` per request."""
        if device is None:
            device = self.device
        problems = [p if isinstance(p, (Problem, GroupedProblem)) else problem_from_dict(p) for p in problems]
        out: list[Answer | None] = [self._memo.get((device, p)) for p in problems]
        todo = [i for i, r in enumerate(out) if r is None]
        if not todo:
            return out  # type: ignore[return-value]
        dkey = self._key(device)
        ask: dict[str, Problem] = {}
        for i in todo:
            p = problems[i]
            pkey = self._key(p)
            hit = self._cache.get((dkey, pkey))
            if hit is not None:
                out[i] = hit
                self._memo[(device, p)] = hit
            else:
                ask.setdefault(pkey, p)
        if ask:
            answers = self._resolve(device, dkey, ask)
            for i in todo:
                if out[i] is None:
                    out[i] = answers[self._key(problems[i])]
        return out  # type: ignore[return-value]

    # -- the slow path -------------------------------------------------------------------------
    @property
    def device(self) -> Device:
        """The fingerprint of this process's devices (imports JAX), unless given."""
        if self._device is None:
            self._device = Device.current(self.topology)
        return self._device

    def _key(self, obj: Problem | Device) -> str:
        key = self._keys.get(obj)
        if key is None:
            key = obj.key
            if len(self._keys) > 100_000:
                self._keys.clear()
            self._keys[obj] = key
        return key

    def _remember(self, device: Device, problems: dict[str, Problem], results: Iterable[Answer]) -> None:
        cached = [replace(r, origin="memory") for r in results]
        with self._lock:
            if len(self._memo) > 200_000:  # a bound, far above any program's distinct einsums
                self._memo.clear()
                self._cache.clear()
            for r in cached:
                self._cache[(r.device_key, r.problem_key)] = r
                p = problems.get(r.problem_key)
                if p is not None:
                    self._memo[(device, p)] = r

    def _resolve(self, device: Device, dkey: str, ask: dict[str, Problem]) -> dict[str, Answer]:
        answers: dict[str, Answer] = {}
        if self._snapshot is not None:
            for pkey in ask:
                hit = self._snapshot.get((dkey, pkey))
                answers[pkey] = hit if hit is not None else Answer.baseline(pkey, dkey)
            self._remember(device, ask, answers.values())
            return answers
        got = self._ask_service(device, dkey, ask)
        if got is not None:
            self._remember(device, ask, got.values())
            if self._disk is not None:
                self._disk.put(r for r in got.values() if r.origin == "service")
            return got
        # the service is down: the disk cache, then the baseline (not remembered: ask again later)
        for pkey in ask:
            hit = self._disk.get(dkey, pkey) if self._disk is not None else None
            answers[pkey] = hit if hit is not None else Answer.baseline(pkey, dkey)
        return answers

    def _client(self) -> httpx.Client:
        """The HTTP client (one, shared by threads: each request on a pooled connection)."""
        with self._lock:  # while making it, not while it sends
            if self._http is None:
                headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
                timeout = httpx.Timeout(self.timeout, connect=min(self.timeout, CONNECT_TIMEOUT))
                self._http = httpx.Client(base_url=self.url or "", timeout=timeout, headers=headers,
                                          trust_env=False)
            return self._http

    def _ask_service(self, device: Device, dkey: str, ask: dict[str, Problem]) -> dict[str, Answer] | None:
        """The service's answers; None (and one warning) when it cannot be reached, fails, or
        answers what does not parse. No lock is held: concurrent lookups, concurrent requests.

        A refusal (4xx: e.g. a problem this service version rejects, or a missing read token)
        is final for those problems: they get the baseline, remembered like an answer."""
        if time.monotonic() < self._down_until:
            return None
        keys = list(ask)
        out: dict[str, Answer] = {}
        try:
            http = self._client()
            for lo in range(0, len(keys), BATCH):
                chunk = keys[lo:lo + BATCH]
                docs = self._fetch(http, device, dkey, chunk, ask)
                for k, doc in zip(chunk, docs, strict=True):
                    out[k] = _answer(doc, k, dkey)
        except (httpx.HTTPError, httpx.InvalidURL, ClientError) as e:
            wait = e.retry_after if isinstance(e, _NotNow) and e.retry_after is not None else self.retry_after
            self._down_until = time.monotonic() + wait
            self._warn_once("down", f"autotuner service {self.url} cannot answer ({type(e).__name__}: {e}); "
                            f"using cached strategies, else the baseline; asking again in {wait:g}s")
            return None
        if "down" in self._warned:
            self._warned.discard("down")
            log.info("autotuner service %s answers again", self.url)
        return out

    def _fetch(self, http: httpx.Client, device: Device, dkey: str, chunk: list[str],
               ask: dict[str, Problem]) -> list[Any]:
        """The service's answers for ``chunk``. A refused batch (413/422: too large for this
        service, or one problem it rejects) is split in halves until the refused problems are
        alone; those, and everything on a 401/403, get the baseline."""
        try:
            return self._post_chunk(http, device, [ask[k] for k in chunk])
        except _Refused as e:
            if len(chunk) > 1 and e.status in (413, 422):
                mid = len(chunk) // 2
                return (self._fetch(http, device, dkey, chunk[:mid], ask)
                        + self._fetch(http, device, dkey, chunk[mid:], ask))
            self._warn_once("refused", f"autotuner service {self.url} refused a lookup ({e}); "
                                       "using the baseline for it")
            return [{**Answer.baseline(k, dkey).to_json(), "origin": "fallback"} for k in chunk]

    def evidence(self, program_key: str, device: Device | None = None) -> dict[str, dict[str, Any]]:
        """In-program evidence for the program `program_key` on `device` (default: this client's):
        problem key -> {strategy, previous (Strategies), speedup, confidence}; {} where there is
        none or the service cannot answer (warned once; asked again after ``retry_after``)."""
        dkey = self._key(device or self.device)
        k = (dkey, str(program_key))
        with self._lock:
            hit = self._evidence.get(k)
        if hit is not None:
            return hit
        if self._snapshot is not None:
            got = snapshot.evidence_answers(self._evidence_items, dkey, str(program_key))
        elif time.monotonic() < self._down_until:
            return {}
        else:
            try:
                r = _send(self._client(), "GET", "/v1/evidence", self.timeout,
                          params={"device_key": dkey, "program_key": str(program_key)})
                if r.status_code != 200:
                    raise ClientError(f"GET /v1/evidence answered {r.status_code}")
                doc = _decode(r.content, "GET /v1/evidence")
                got = snapshot.evidence_answers(doc.get("evidence") if isinstance(doc, dict) else None,
                                                dkey, str(program_key))
            except (httpx.HTTPError, httpx.InvalidURL, ClientError) as e:
                self._warn_once("evidence", f"autotuner service {self.url} cannot answer in-program evidence "
                                f"({type(e).__name__}: {e}); the isolated winners decide")
                return {}
        with self._lock:
            if len(self._evidence) > 1000:
                self._evidence.clear()
            self._evidence[k] = got
        return got

    def _warn_once(self, kind: str, message: str) -> None:
        """One warning per kind (``down``: per outage; ``refused``: per client)."""
        with self._lock:
            new = kind not in self._warned
            self._warned.add(kind)
        if new:
            log.warning("%s", message)

    def _post_chunk(self, http: httpx.Client, device: Device, problems: list[Problem]) -> list[Any]:
        if len(problems) == 1:
            path, body = "/v1/lookup", {"device": device.to_dict(), "problem": problems[0].to_dict()}
        else:
            path = "/v1/lookup/batch"
            body = {"device": device.to_dict(), "problems": [p.to_dict() for p in problems]}
        resp = _send(http, "POST", path, self.timeout, json=body)
        if 400 <= resp.status_code < 500:
            raise _Refused(resp.status_code, f"POST {path}: {resp.status_code} {resp.text[:200]}")
        if resp.status_code != 200:
            raise ClientError(f"POST {path} answered {resp.status_code}: {resp.text[:200]}")
        doc = _decode(resp.content, f"POST {path}")
        docs = [doc] if len(problems) == 1 else doc.get("results") if isinstance(doc, dict) else None
        if not isinstance(docs, list) or len(docs) != len(problems):
            raise ClientError(f"POST {path}: the answer is not {len(problems)} result(s)")
        return docs

    # -- storing measurements ------------------------------------------------------------------
    def upload(self, device: Device | None, problem: Problem | GroupedProblem, session: Any, *,
               name: str | None = None, run_id: str | None = None) -> tuple[Answer | None, str]:
        """Store one measured session (`measure.run_session`'s `SessionResult`) of `problem` on
        `device` (default: :attr:`device`), and make its winner this client's answer for it.
        Returns (the answer, where it was stored). With a service and a token: ``POST
        /v1/results`` (the body `autotuner tune --service` sends, `tune.store.results_body`), then
        the service's answer is looked up again (its winner rule, over every measurement it holds);
        offline: the winner is added to the snapshot in memory and written to the snapshot file;
        without a token: kept in this process only. The answer is the session's winner by the
        service's rule (`session_answer`) wherever the service's is not to be had; None when the
        baseline did not run (nothing to answer). Never raises for the service or the file."""
        device = device if device is not None else self.device
        dkey, pkey = self._key(device), self._key(problem)
        local = session_answer(session, pkey, dkey)
        if self._snapshot is not None:
            where = self._save_offline(device, local)
        elif not self._token:
            where = "nowhere (the client has no write token): it holds for this process only"
        else:
            where = self._post_results(device, problem, session, name, run_id)
            if where.startswith("the service"):
                got = self._ask_service(device, dkey, {pkey: problem})
                if got is not None and got[pkey].source in rule.EXACT_SOURCES:
                    local = got[pkey]
        if local is not None:
            self._remember(device, {pkey: problem}, [local])
        return local, where

    def _post_results(self, device: Device, problem: Problem | GroupedProblem, session: Any,
                      name: str | None, run_id: str | None) -> str:
        from autotuner.results import results_body, session_items

        try:
            body = results_body(device, problem, session_items(session, run_id, source="in-job"), name)
            r = _send(self._client(), "POST", "/v1/results", self.timeout, json=body)
            if r.status_code >= 300:
                raise ClientError(f"POST /v1/results answered {r.status_code}: {r.text[:200]}")
        except (httpx.HTTPError, httpx.InvalidURL, ClientError, ValueError) as e:
            log.warning("autotuner: could not store in-job measurements at %s (%s: %s)", self.url,
                        type(e).__name__, e)
            return f"nowhere (the upload to {self.url} failed: {type(e).__name__}: {str(e)[:120]})"
        return f"the service {self.url}"

    def _save_offline(self, device: Device, answer: Answer | None) -> str:
        """Add `answer` to the snapshot in memory and to its file (atomically rewritten)."""
        assert self._snapshot is not None and self.offline is not None
        if answer is None:
            return "nowhere (the baseline did not run)"
        with self._lock:
            self._snapshot[(answer.device_key, answer.problem_key)] = replace(answer, origin="snapshot")
        try:
            snapshot.put_entry(self.offline, device, answer)
        except snapshot.SnapshotError as e:
            log.warning("autotuner: could not write in-job results to the snapshot %s (%s)", self.offline, e)
            return f"this process's snapshot in memory only ({e})"
        return f"the snapshot {self.offline}"

    # -- the rest ------------------------------------------------------------------------------
    def export_snapshot(self, path: str | os.PathLike[str], device: Device | None = None, *,
                        all_devices: bool = False) -> int:
        """Write the service's snapshot (of ``device``, or every device) to ``path``
        atomically; returns the number of entries. Raises :class:`ClientError`."""
        if self.url is None:
            raise ClientError("export_snapshot needs a service url")
        params = {} if all_devices else {"device_key": self._key(device or self.device)}
        try:
            resp = self._client().get("/v1/snapshot", params=params, timeout=max(self.timeout, 60.0))
        except httpx.HTTPError as e:
            raise ClientError(f"GET /v1/snapshot failed: {type(e).__name__}: {e}") from None
        if resp.status_code != 200:
            raise ClientError(f"GET /v1/snapshot answered {resp.status_code}: {resp.text[:300]}")
        try:
            doc = snapshot.check(_decode(resp.content, "GET /v1/snapshot"), "GET /v1/snapshot")
        except snapshot.SnapshotError as e:
            raise ClientError(str(e)) from None
        try:
            write_atomic(path, json.dumps(doc))
        except OSError as e:
            raise ClientError(f"cannot write the snapshot {path}: {e}") from None
        return len(doc.get("entries") or [])

    def clear_cache(self) -> None:
        """Forget the in-process cache (the on-disk cache stays)."""
        self._memo.clear()
        self._cache.clear()

    def close(self) -> None:
        with self._lock:
            http, self._http = self._http, None
        if http is not None:
            http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _answer(doc: Any, problem_key: str, device_key: str) -> Answer:
    """The service's answer, filed under the client's keys; ClientError if not an answer."""
    try:
        return replace(Answer.from_json(doc, "service"), problem_key=problem_key, device_key=device_key)
    except Exception as e:  # noqa: BLE001 - untrusted JSON: whatever does not parse is no answer
        raise ClientError(f"an invalid answer ({type(e).__name__}: {str(e)[:200]})") from None


_default: Client | None = None
_default_lock = threading.Lock()
_refused: set[str] = set()   # AUTOTUNER_SERVICE_URLs that are no URL, said once each


def default_client() -> Client | None:
    """The client ``AUTOTUNER_SERVICE_URL`` / ``AUTOTUNER_SERVICE_TOKEN`` configure (settings),
    built once; ``None`` when no service is configured."""
    global _default
    with _default_lock:
        if _default is None:
            from autotuner.settings import get_settings

            settings = get_settings()
            if not settings.service_url:
                return None
            try:
                _default = Client(settings.service_url, token=settings.service_token)
            except ValueError as e:   # the job goes on as with no service configured, and says why once
                if settings.service_url not in _refused:
                    _refused.add(settings.service_url)
                    log.warning("autotuner: AUTOTUNER_SERVICE_URL: %s; no client, so every pair keeps its default", e)
                return None
        return _default
